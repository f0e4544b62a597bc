"""hf_fedshard: FL+FSDP and FL+HSDP (federated averaging across FSDP2 groups) for Transformers, Accelerate and
plain PyTorch loops.

The package's folders are its layers:

- ``engine/``: `FederatedAverager`, the averaging itself (schedule, fragments, outer optimizer, exchange, codec,
  divergence); it imports torch only, so a plain training loop can use it.
- ``topology.py``: how the world splits into federation groups (`FederationLayout`) and its device mesh.
- ``transports/``: how the groups reach each other, one module each, registered by ``fed_transport`` with
  `hf_fedshard.transports.register_transport`: ``mesh`` (one job), ``torchft`` (a launch per group), or your own.
- ``averaging.py``: the public `FederatedAverager`, the engine's over the one-job transport when given a mesh.
- ``integrations/``: the Trainer and TRL side (`FedShardTrainer`, the callback, arguments, model card).
- ``checkpointing/``: federated checkpoints, their manifest and the resume that verifies them.
- ``tools/``: the cost model, offline data and model presets; no training path imports them.

Names are imported on first use, so ``import hf_fedshard.engine`` does not import Transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "AveragingObserver": "hf_fedshard.engine.observer",
    "FedAvgCallback": "hf_fedshard.integrations.callback",
    "FederatedAverager": "hf_fedshard.averaging",
    "FedShardArgumentsMixin": "hf_fedshard.integrations.arguments",
    "FedShardMixin": "hf_fedshard.integrations.trainer",
    "FedShardTrainer": "hf_fedshard.integrations.trainer",
    "FedShardTrainingArguments": "hf_fedshard.integrations.arguments",
    "FederatedParallelismConfig": "hf_fedshard.integrations.fsdp",
    "FederationLayout": "hf_fedshard.topology",
    "MeshAxis": "hf_fedshard.topology",
}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hf_fedshard' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return [*globals(), *__all__]

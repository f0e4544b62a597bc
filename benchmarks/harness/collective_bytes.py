"""Bytes that a rank hands to collectives spanning several federation groups, per optimizer step, and how many
of those collectives the averaging engine ran.

On a real cluster those collectives cross the slow tier between groups. The counter wraps the
``torch.distributed`` functions that Trainer, Accelerate and TRL call, and those that
``hf_fedshard.engine.communicator`` imports by name (every cross-group collective of hf_fedshard goes through
it), so it sees every collective issued from Python; FSDP2's own collectives run inside the group and are not
counted. A collective's bytes are those of this rank's input tensor (for ``all_gather_object``, its pickle), the
payload it contributes.

Used by ``tests/scripts/train_sft.py`` (``--count_cross_group_bytes``) to measure the SFT path.
"""

from __future__ import annotations

import functools
import inspect
import pickle
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

import hf_fedshard.engine.communicator
from hf_fedshard.topology import FederationLayout

# Each wrapped function and the name of its argument holding this rank's contribution.
_COLLECTIVES = {
    "all_reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter_tensor": "input",
    "broadcast": "tensor",
    "all_gather_object": "obj",
    "all_gather_single": "input_tensor",
    "all_to_all_single": "input",
}
_ENGINE_COLLECTIVES = ("all_reduce", "all_gather_single", "all_to_all_single")


def _payload_bytes(data: Any) -> int:
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    if isinstance(data, (list, tuple)):
        return sum(_payload_bytes(d) for d in data)
    return len(pickle.dumps(data))


class CrossGroupBytes(TrainerCallback):
    """Counts, per optimizer step, the bytes this rank hands to collectives over ranks of several groups.

    A step's window runs from its ``on_step_begin`` to the next one, so it includes the averaging at its end and
    the logging that follows it. Install with :meth:`install` before training; :meth:`uninstall` restores.
    """

    def __init__(self, layout: FederationLayout) -> None:
        self.layout = layout
        self.per_step: dict[int, int] = defaultdict(int)
        self.engine_calls: dict[int, int] = defaultdict(int)  # cross-group collectives of hf_fedshard's engine
        self.step = 0
        self._originals: list[tuple[Any, str, Callable]] = []

    def _spans_groups(self, group: Any) -> bool:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        return len({self.layout.group_index(rank) for rank in ranks}) > 1

    def _wrap(self, fn: Callable, payload: str, engine: bool) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            if self._spans_groups(bound.get("group")):
                self.per_step[self.step] += _payload_bytes(bound[payload])
                self.engine_calls[self.step] += engine
            return fn(*args, **kwargs)

        return counted

    def install(self) -> CrossGroupBytes:
        engine = hf_fedshard.engine.communicator
        targets = [(dist, name) for name in _COLLECTIVES] + [(engine, name) for name in _ENGINE_COLLECTIVES]
        for module, name in targets:
            original = getattr(module, name)
            self._originals.append((module, name, original))
            setattr(module, name, self._wrap(original, _COLLECTIVES[name], module is engine))
        return self

    def uninstall(self) -> None:
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)
        self._originals.clear()

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1

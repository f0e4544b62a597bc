"""The parts of the cost model that only the studies use, beside them: what `python -m hf_fedshard.tools.cost` (the
planner users run) does not need. The gloo reduce-scatter factor (the emulated cluster runs gloo), the payload
bytes of each ``fed_sync_dtype`` (the studies predict the bytes they measured), and the model state one rank
holds (benchmarks/scaling.py compares it with the memory it measured). The collectives themselves are the
planner's (`hf_fedshard.tools.cost`).
"""

from __future__ import annotations

from hf_fedshard.engine.sparse import SparseCodec
from hf_fedshard.tools.cost import DENSE_BYTES_PER_VALUE, topk_bytes_per_value
from hf_fedshard.topology import FederationLayout

GLOO = 2.0  # torch's gloo reduce_scatter_tensor all-reduces the input: measured by benchmarks/gloo_collectives.py
OPTIMIZER_STATE_BYTES = 16  # fp32 parameter, gradient, and AdamW's two moments, per parameter
OUTER_STATE_BYTES = 8  # an outer optimizer's fp32 anchor and momentum (DiLoCo-style), per parameter


def sync_bytes_per_value(sync_dtype: str, settings: dict[str, str] | None = None) -> float:
    """b_s: payload bytes per averaged value for ``fed_sync_dtype`` (int8 carries one fp32 scale per block; topk
    its codes, indices and chunk scales at the density, bits and chunk of ``settings``, fed settings by name)."""
    if sync_dtype == "topk":  # the settings given, the codec's defaults for the others
        given = {name: cast(settings[f"fed_sync_{name}"]) for name, cast in (("density", float), ("bits", int),
                 ("chunk", int)) if f"fed_sync_{name}" in (settings or {})}  # fmt: skip
        return topk_bytes_per_value(SparseCodec(**given))
    return DENSE_BYTES_PER_VALUE[sync_dtype]


def model_state_bytes_per_rank(params: int, layout: FederationLayout, outer_optimizer: bool = False) -> float:
    """Model state one rank holds: parameters, gradients and AdamW state in fp32 (and an outer optimizer's anchor
    and momentum), sharded over the group's ``dp_shard`` axis; a replica or a whole-model method (DDP, LocalSGD:
    a layout with shard size 1) holds all of it. Activations and FSDP2's gathered units come on top."""
    per_param = OPTIMIZER_STATE_BYTES + (OUTER_STATE_BYTES if outer_optimizer else 0)
    return per_param * params / layout.shard_size


def largest_model_params(budget_bytes: float, layout: FederationLayout, outer_optimizer: bool = False) -> int:
    """The most parameters whose model state fits ``budget_bytes`` per rank under ``layout``."""
    return int(budget_bytes / model_state_bytes_per_rank(1, layout, outer_optimizer))

"""Metric gathers of a training step kept inside the federation group.

Trainer subclasses gather per-step metrics with ``accelerator.gather_for_metrics`` inside ``compute_loss`` (TRL's
``SFTTrainer``: token accuracy, entropy and token counts, three to four gathers per micro-batch). Over the world,
each of them crosses the slow tier between groups at every step, which is the traffic FL+FSDP exists to remove.
Inside :func:`gathers_within_group` they gather over the group's ranks only: the same values for a one-group run,
the group's own statistics with several groups (a subclass may combine the groups' at logging steps, as
``hf_fedshard.trl.FedShardSFTTrainer`` does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import recursively_apply
from torch.distributed import ProcessGroup


def gather_in_group(data: Any, group: ProcessGroup | None) -> Any:
    """``accelerator.gather`` over ``group`` (``None``: this rank alone): tensors (0-d ones as 1-d) concatenated
    along dim 0 in rank order."""

    def gather_one(tensor: torch.Tensor) -> torch.Tensor:
        tensor = (tensor[None] if tensor.ndim == 0 else tensor).contiguous()
        if group is None:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        return torch.cat(parts)

    return recursively_apply(gather_one, data, error_on_other_type=True)


@contextlib.contextmanager
def gathers_within_group(accelerator: Accelerator, group: ProcessGroup | None) -> Iterator[None]:
    """Within the block, ``accelerator.gather_for_metrics`` of tensors gathers over ``group`` (``None``: a group
    of this rank alone); objects (``use_gather_object=True``) still go over the world.

    The instance attribute shadows the method for the block only; ``del`` restores Accelerate's own.
    """
    world_gather = accelerator.gather_for_metrics

    def gather_for_metrics(data: Any, use_gather_object: bool = False) -> Any:
        return world_gather(data, use_gather_object=True) if use_gather_object else gather_in_group(data, group)

    accelerator.gather_for_metrics = gather_for_metrics
    try:
        yield
    finally:
        del accelerator.gather_for_metrics

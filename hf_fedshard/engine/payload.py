"""The payload: which local shards an averaging moves, and their plain mean over groups.

No full parameter is ever gathered: under FSDP2 every parameter is a DTensor and ``to_local()`` is this rank's
shard; the ranks at the same (replica, shard) position of every group hold shards of identical shapes, so one
all-reduce over the peers (one rank per group) averages them. Sums are accumulated in fp32 (or wider) whatever the
parameter dtype, and divided by the number of groups afterwards because gloo has no AVG reduction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hf_fedshard.engine.communicator import Communicator

# Sync payloads are cut into buckets of this size so that averaging an 8B model does not need a second
# fp32 copy of the whole local shard at once; one all-reduce per bucket.
BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Address:
    """Where a local tensor sits in the whole one: ``numel`` values in ``rows`` rows; ``sharded``: ``Shard(0)``
    over the group's shard ranks (parameters, moments), else held whole by every rank (buffers)."""

    numel: int
    rows: int
    sharded: bool = True

    @classmethod
    def of(cls, tensor: torch.Tensor, sharded: bool) -> Address:
        """The address of ``tensor`` (a DTensor's global shape, or a plain tensor's own)."""
        return cls(tensor.numel(), tensor.shape[0] if tensor.dim() else 1, sharded)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that the optimizer changes; frozen ones (a PEFT base model) are identical everywhere."""
    return [p for p in model.parameters() if p.requires_grad]


def model_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Local shards of what FedAvg averages: trainable parameters and floating persistent buffers.

    FSDP2 units left unsharded by a forward without backward (an evaluation) are resharded first, so
    that every parameter is its sharded DTensor again. Non-persistent buffers (e.g. rotary ``inv_freq``)
    are caches derived from the config, equal everywhere, and integer buffers are counters: neither is sent.
    """
    reshard_units(model)
    return [local_tensor(p) for p in trainable_parameters(model)] + [local_tensor(b) for b in _buffers(model)]


def reshard_units(model: nn.Module) -> None:
    """Put every FSDP2 unit back on its shards: a forward without backward (an evaluation) leaves the units FSDP
    does not reshard after forward (the root) on their unsharded parameters, which the shards would not show."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def model_state_addresses(model: nn.Module) -> list[Address]:
    """The `Address` of each of `model_state_tensors`: parameters are sharded, buffers held whole."""
    params = [Address.of(p, sharded=True) for p in trainable_parameters(model)]
    return params + [Address.of(b, sharded=False) for b in _buffers(model)]


def model_state_shapes(model: nn.Module) -> list[tuple[int, ...]]:
    """The whole shape of each of `model_state_tensors` (a DTensor's global one)."""
    return [tuple(p.shape) for p in trainable_parameters(model)] + [tuple(b.shape) for b in _buffers(model)]


def _buffers(model: nn.Module) -> Iterator[torch.Tensor]:
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and name not in module._non_persistent_buffers_set:
                yield buffer


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[torch.Tensor]:
    """Local shards of the optimizer's per-parameter moments (e.g. Adam's ``exp_avg``, ``exp_avg_sq``)."""
    return [local_tensor(value) for value in _moments(optimizer, model)]


def optimizer_state_addresses(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[Address]:
    """The `Address` of each of `optimizer_state_tensors` (sharded as their parameter)."""
    return [Address.of(value, sharded=True) for value in _moments(optimizer, model)]


def _moments(optimizer: torch.optim.Optimizer, model: nn.Module) -> Iterator[torch.Tensor]:
    state = getattr(optimizer, "optimizer", optimizer).state
    for param in trainable_parameters(model):
        for value in state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape:
                yield value


def _buckets(tensors: Iterable[torch.Tensor], bucket_bytes: int) -> Iterable[list[torch.Tensor]]:
    """Consecutive runs of tensors sharing a device and accumulation dtype, each at most ``bucket_bytes``."""
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        nbytes = tensor.numel() * _accumulation_dtype(tensor).itemsize
        same_kind = not bucket or (
            _accumulation_dtype(bucket[0]) == _accumulation_dtype(tensor) and bucket[0].device == tensor.device
        )
        if bucket and (not same_kind or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket


def _accumulation_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when no tensor holds a NaN or an Inf (one device sync for the whole list)."""
    flags = [torch.isfinite(t).all() for t in tensors if t.numel()]
    return bool(torch.stack(flags).all()) if flags else True


@torch.no_grad()
def plain_mean_over_groups(
    tensors: Sequence[torch.Tensor],
    peers: Communicator,
    contributors: int,
    contribute: bool = True,
    bucket_bytes: int = BUCKET_BYTES,
) -> int:
    """Replace every tensor (in place) by its plain mean over ``peers``; return the payload bytes this rank sent.

    No outer step and no anchor: for buffers, the initial weights and the temporary global model. All peers must
    pass tensors of the same shapes and dtypes in the same order. A rank with ``contribute=False`` (its group
    diverged) adds zeros, not its values, and receives the mean of the ``contributors`` other groups.
    """
    sent = 0
    for bucket in _buckets(tensors, bucket_bytes):
        if contribute:
            flat = torch.cat([t.reshape(-1).to(_accumulation_dtype(t)) for t in bucket])
        else:  # NaN × 0 is NaN: send true zeros
            numel = sum(t.numel() for t in bucket)
            flat = torch.zeros(numel, dtype=_accumulation_dtype(bucket[0]), device=bucket[0].device)
        peers.all_reduce_sum(flat)
        flat.div_(contributors)
        sent += flat.numel() * flat.element_size()
        for tensor, mean in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
            tensor.copy_(mean.view_as(tensor))
    return sent


@torch.no_grad()
def load_model_state(model: nn.Module, values: Sequence[torch.Tensor]) -> None:
    """Copy ``values`` (`model_state_tensors` of a model of the same layout) into ``model``'s own."""
    for tensor, value in zip(model_state_tensors(model), values, strict=True):
        tensor.copy_(value)


@torch.no_grad()
def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Zero every tensor of the optimizer state (moments and step counts) in place.

    For Adam/AdamW (and SGD without dampening) a zeroed state steps exactly like a fresh one. Emptying the state
    instead would make the next checkpoint's `get_optimizer_state_dict` run an initialising step of its own.
    """
    for state in getattr(optimizer, "optimizer", optimizer).state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.zero_()

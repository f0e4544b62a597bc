"""A heal across groups of unequal size: a live group's `FederatedAverager.peer_state` cut into parts any layout can
take.

With groups of one size a joining group takes rank r's state from rank r of a live group (their shards pair). With
``fed_group_size 4,2,2`` they do not, so the state is cut in two (`cut`):

- what every layout shares: the counters, the settings history, the schedule position (and whatever the training
  loop adds), sent as it is from the live group's first rank;
- the tensors, each addressed in its whole index space (`TensorSpec`): the model's trainable parameters and
  floating buffers, then each trainable parameter's anchor, then the outer momentum of those that have one. They
  are copied byte for byte from the live group's shards onto the healing group's own
  (`hf_fedshard.engine.pieces.PieceExchange.copy`), into the flat parts `receiving` allocates.

`mend` puts a healing rank's parts back together as a `peer_state` of its own layout, its outer state held by
parameter (the form `FederatedAverager.load_state_dict` takes from a checkpoint read onto another layout).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_fedshard.engine.payload import Address
from hf_fedshard.engine.pieces import GroupShape


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a peer state: where it sits (``address``), the whole tensor's shape and its dtype."""

    address: Address
    shape: tuple[int, ...]
    dtype: torch.dtype

    def local_shape(self, numel: int) -> tuple[int, ...]:
        """The shape of a part of ``numel`` values: FSDP2's ``Shard(0)`` keeps the trailing dims; a buffer is whole."""
        if not self.address.sharded or not self.shape:
            return self.shape
        width = math.prod(self.shape[1:])
        return (numel // width if width else self.shape[0], *self.shape[1:])


@dataclass
class PeerParts:
    """A peer state in parts: ``state`` without its tensors (picklable), ``specs`` of the tensors, and this rank's
    flat parts of them (``tensors``, in ``specs``' order; on a healing rank, filled by the copy)."""

    state: dict
    specs: list[TensorSpec]
    tensors: list[torch.Tensor]


def cut(peer: dict, shapes: Sequence[tuple[int, ...]], addresses: Sequence[Address]) -> PeerParts:
    """`FederatedAverager.peer_state`'s output in parts; ``shapes`` and ``addresses`` are those of its ``model``
    tensors (`model_state_shapes`, `model_state_addresses`)."""
    averager = peer["averager"]
    fragments = averager["outer"]["fragments"]
    anchors = [anchor for fragment in fragments for anchor in fragment["anchor"]]
    momenta = [
        fragment["optimizer"]["state"].get(i, {}).get("momentum_buffer")
        for fragment in fragments
        for i in range(len(fragment["anchor"]))
    ]
    held = [m is not None for m in momenta]
    model = list(peer["model"])
    tensors = model + anchors + [m for m in momenta if m is not None]
    owners = [*range(len(model)), *range(len(anchors)), *(i for i, h in enumerate(held) if h)]  # their parameter
    specs = [
        TensorSpec(addresses[i], tuple(shapes[i]), t.dtype) for i, t in zip(owners, tensors, strict=True)
    ]  # fmt: skip
    state = {**peer, "model": None, "averager": {**averager, "outer": {"momentum_held": held}}}
    return PeerParts(state, specs, [t.reshape(-1) for t in tensors])


def receiving(specs: Sequence[TensorSpec], shape: GroupShape, shard: int, device: torch.device) -> list[torch.Tensor]:
    """Empty flat parts for a rank of shard ``shard`` of a group of ``shape``: what the copy fills."""
    spans = [shape.span(spec.address, shard) for spec in specs]
    return [
        torch.empty(stop - start, dtype=spec.dtype, device=device)
        for spec, (start, stop) in zip(specs, spans, strict=True)
    ]


def mend(parts: PeerParts) -> dict:
    """A healing rank's parts as a `FederatedAverager.peer_state` of its own layout (outer state by parameter)."""
    tensors = [t.view(spec.local_shape(t.numel())) for spec, t in zip(parts.specs, parts.tensors, strict=True)]
    averager = parts.state["averager"]
    held = averager["outer"]["momentum_held"]
    count = len(parts.specs) - len(held) - sum(held)  # the model's tensors
    model, anchors, momenta = tensors[:count], tensors[count : count + len(held)], iter(tensors[count + len(held) :])
    outer = {"anchor": anchors, "momentum": [next(momenta) if h else None for h in held]}
    return {**parts.state, "model": model, "averager": {**averager, "outer": outer}}


def mended(parts: PeerParts) -> dict:
    """A heal's parts, received on this rank's own shards, as the committed state they were cut from (`cut` works
    on its ``averager`` part; the others travel whole)."""
    if not parts.specs:
        return parts.state
    return {**parts.state, "averager": mend(dataclasses.replace(parts, state=parts.state["averager"]))}

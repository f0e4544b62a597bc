"""The exchange between groups of unequal size, where no rank of one group holds what a rank of another holds.

With equal groups, rank r of every group holds the same shard and `hf_fedshard.engine.exchange` averages it over
those peers. With ``fed_group_size 4,2,2`` a group of 4 shards a parameter in quarters and a group of 2 in halves,
so the exchange addresses every tensor in its *global* flat index space instead:

- a group of s shard ranks and Q replicas holds a parameter (or a moment) as FSDP2 does, ``Shard(0)`` by
  ``torch.chunk``: shard k holds rows [k·c, (k+1)·c) ∩ [0, rows), c = ⌈rows / s⌉, on each of its Q replicas;
  a buffer is held whole by every rank of the group;
- the boundaries of every group's shards cut a tensor into *pieces*, each held by exactly one shard of every
  group; a large piece is cut again into G parts, so that the G groups share the work;
- every piece has an *owner* group and, in each group, a *designated* holder (HSDP replicas, or every rank for a
  buffer, take turns): the pieces held by the same ranks take the owner groups in turn, and each owner's holders.

The mean of a piece moves in three all-to-alls over every rank of the federation:

1. each group's designated holder sends the piece, encoded, to the owner's designated holder;
2. the owner sums the G decoded copies, each weighted by its group's samples, divides, encodes the mean once,
   and sends those bytes to each other group's designated holder;
3. each designated holder hands the same bytes to its group's other holders (the fast tier).

Rule, per piece x (G groups, weights w_g, W the weight of the contributing groups, codec encode E and decode D)::

    mean = D(E(Σ_g w_g · D(E(x_g)) / W))        summed in fp32, in group order

w_g is the group's number of ranks: every rank reads ``per_device_train_batch_size × gradient_accumulation_steps``
samples per step and every group takes the same steps, so w_g counts the samples group g trained on since the
last averaging. A group that diverged sends zeros and is left out of W. Each piece is encoded on its own (padded to
the codec's block), so its bytes do not depend on what travels with it, and every holder of every group decodes
the owner's one encoding: groups stay bit-identical.

The slow tier carries each piece once per group and back, as a ring all-reduce does: 2·(G−1) copies of the model
per averaging in all, whatever the sizes.

The sparse payload (``topk``, `hf_fedshard.engine.sparse`) cannot be summed by the owner and re-encoded: each
piece is encoded on its own (its chunks start at the piece's first value), the owner gathers the G encodings and
sends all of them, in group order, to each other group's designated holder, who hands them on; every holder
decodes them and computes Σ_g w_g · D(E(x_g)) / W itself, in group order. The slow tier then carries (G − 1)
encodings to the owner and G to each of the G − 1 others: (G + 1)(G − 1) per piece, against the equal groups'
gather's G (G − 1).

A heal (`PieceExchange.copy`) uses the same pieces without a mean: the source group's designated holder sends each
piece's raw bytes to each healing group's designated holder, who hands them to its group's other holders.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from hf_fedshard.engine.codec import INT8_BLOCK, Encoded, alignment, decode, encode
from hf_fedshard.engine.communicator import Communicator
from hf_fedshard.engine.exchange import bucket_ranges
from hf_fedshard.engine.payload import BUCKET_BYTES, Address
from hf_fedshard.engine.sparse import SPARSE, SparseCodec
from hf_fedshard.errors import ConfigError

SPLIT_VALUES = 65536  # a piece of at least G × this many values is cut into G parts, one per owner group
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "int8": 1}
_WIRE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
FLOAT64 = "float64"  # the plain means' wire for fp64 tensors (as the equal groups' accumulate them)


@dataclass(frozen=True)
class GroupShape:
    """One federation group: its ranks in the exchange's communicator (replica-major), and its shard size."""

    ranks: tuple[int, ...]
    shard_size: int

    @property
    def weight(self) -> int:
        """Samples per step, in units of one rank's: every rank of a group reads its own batch."""
        return len(self.ranks)

    def span(self, address: Address, shard: int) -> tuple[int, int]:
        """The flat [start, stop) of ``address`` that shard ``shard`` of this group holds."""
        if not address.sharded:
            return 0, address.numel
        width = address.numel // address.rows if address.rows else 0
        chunk = math.ceil(address.rows / self.shard_size)
        return min(address.rows, shard * chunk) * width, min(address.rows, (shard + 1) * chunk) * width

    def cuts(self, address: Address) -> set[int]:
        """Every boundary between this group's shards of ``address``."""
        return {bound for k in range(self.shard_size) for bound in self.span(address, k)}

    def holders(self, address: Address, index: int) -> tuple[int, ...]:
        """The ranks holding flat index ``index`` of ``address`` (its shard's replicas, or every rank)."""
        if not address.sharded:
            return self.ranks
        shard = next(k for k in range(self.shard_size) if self.span(address, k)[0] <= index < self.span(address, k)[1])
        return self.ranks[shard :: self.shard_size]


@dataclass(frozen=True)
class Piece:
    """A flat range of one tensor, held by one shard of every group: ``holders[g]`` (designated holder first)."""

    tensor: int
    start: int
    stop: int
    owner: int
    holders: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def designated(self, group: int) -> int:
        return self.holders[group][0]


def _parts(start: int, stop: int, groups: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into ``groups`` parts on the int8 block grid if it is large, else whole."""
    if stop - start < groups * SPLIT_VALUES:
        return [(start, stop)]
    size = math.ceil((stop - start) / groups / INT8_BLOCK) * INT8_BLOCK
    bounds = [min(stop, start + k * size) for k in range(groups + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


@lru_cache(maxsize=1024)
def plan(addresses: tuple[Address, ...], groups: tuple[GroupShape, ...]) -> tuple[Piece, ...]:
    """The pieces of ``addresses`` with their owners and holders: a function of its arguments only, so every rank
    computes the same plan without a collective."""
    pieces: list[Piece] = []
    turns: dict[tuple[tuple[int, ...], ...], int] = {}  # per set of holders: its pieces so far
    for index, address in enumerate(addresses):
        cuts = sorted(set().union(*(group.cuts(address) for group in groups)))
        for start, stop in itertools.pairwise(cuts):
            holders = tuple(group.holders(address, start) for group in groups)
            for a, b in _parts(start, stop, len(groups)):
                # The pieces of one set of holders take the G owner groups in turn, and each owner's designated
                # holders in turn among its replicas: every holder of every group carries its share of the work.
                turn = turns[holders] = turns.get(holders, -1) + 1
                shift = turn // len(groups)
                rotated = tuple(h[shift % len(h) :] + h[: shift % len(h)] for h in holders)
                pieces.append(Piece(index, a, b, turn % len(groups), rotated))
    return tuple(pieces)


def to_owner(piece: Piece) -> list[tuple[int, int]]:
    """Phase 1, (source, target) ranks: each other group's designated holder → the owner's."""
    owner = piece.designated(piece.owner)
    return [(piece.designated(g), owner) for g in range(len(piece.holders)) if g != piece.owner]


def from_owner(piece: Piece) -> list[tuple[int, int]]:
    """Phase 2: the owner's designated holder → each other group's."""
    return [(target, source) for source, target in to_owner(piece)]


def to_replicas(piece: Piece) -> list[tuple[int, int]]:
    """Phase 3: each group's designated holder → the group's other holders of the piece (the fast tier)."""
    return [(holders[0], other) for holders in piece.holders for other in holders[1:]]


def _encoded_bytes(numel: int, sync_dtype: str) -> int:
    if sync_dtype == FLOAT64:
        return 8 * numel
    padded = math.ceil(numel / alignment(sync_dtype)) * alignment(sync_dtype)
    scales = padded // INT8_BLOCK * 4 if sync_dtype == "int8" else 0
    return padded * _ITEMSIZE[sync_dtype] + scales


def _to_bytes(x: torch.Tensor, sync_dtype: str) -> torch.Tensor:
    """``x`` (flat fp32; fp64 for `FLOAT64`) encoded on its own, as bytes."""
    if sync_dtype == FLOAT64:
        return x.double().view(torch.uint8)
    encoded = encode(F.pad(x, (0, -x.numel() % alignment(sync_dtype))), sync_dtype)
    parts = [encoded.values.reshape(-1).view(torch.uint8)]
    if encoded.scales is not None:
        parts.append(encoded.scales.view(torch.uint8))
    return torch.cat(parts)


def _from_bytes(data: torch.Tensor, numel: int, sync_dtype: str) -> torch.Tensor:
    """The fp32 values of `_to_bytes`'s output (``numel`` of them; fp64 for `FLOAT64`)."""
    if sync_dtype == FLOAT64:
        return data.clone().view(torch.float64)
    padded = math.ceil(numel / alignment(sync_dtype)) * alignment(sync_dtype)
    end = padded * _ITEMSIZE[sync_dtype]
    values = data[:end].clone().view(_WIRE[sync_dtype])  # a copy: a view across dtypes needs an aligned start
    scales = data[end:].clone().view(torch.float32) if sync_dtype == "int8" else None
    return decode(Encoded(values, scales))[:numel]


Transfers = Callable[[Piece], list[tuple[int, int]]]


class PieceExchange:
    """Weighted means over groups of unequal size (see the module docstring), with `Exchange`'s interface.

    Args:
        world: every rank of the federation (the ranks `GroupShape.ranks` number).
        groups: the groups, in order.
        group: this rank's group.
        sync_dtype: the wire dtype (``fed_sync_dtype``).
        bucket_bytes: fp32 bytes of the whole tensors exchanged per round of all-to-alls, over the smallest shard
            size (so that no rank holds more than about this much of a round).
        sparse: the codec of ``sync_dtype`` ``"topk"``.
    """

    def __init__(
        self,
        world: Communicator,
        groups: Sequence[GroupShape],
        group: int,
        sync_dtype: str = "float32",
        bucket_bytes: int = BUCKET_BYTES,
        sparse: SparseCodec | None = None,
    ) -> None:
        self.world, self.groups, self.group, self.sync_dtype = world, tuple(groups), group, sync_dtype
        self.sparse = sparse
        self.me = world.rank()
        self.bucket_bytes = bucket_bytes * min(g.shard_size for g in self.groups)
        self._group_of = {rank: g for g, shape in enumerate(self.groups) for rank in shape.ranks}

    def offset(self, address: Address, local: torch.Tensor) -> int:
        """Where this rank's ``local`` part of ``address`` starts; a part that is not FSDP2's is refused."""
        shape = self.groups[self.group]
        start, stop = shape.span(address, shape.ranks.index(self.me) % shape.shard_size)
        if local.numel() != stop - start:
            raise ConfigError(
                f"fed_group_size: this rank holds {local.numel()} values of a tensor of {address.numel}, where "
                f"FSDP2's Shard(0) over its group's {shape.shard_size} shard ranks gives {stop - start}: groups of "
                "unequal size need every parameter sharded on dim 0 (fully_shard's default placement)."
            )
        return start

    def mean(
        self, tensors: Sequence[torch.Tensor], contributors: int, addresses: Sequence[Address]
    ) -> tuple[list[torch.Tensor], int]:
        """The weighted mean over groups of each tensor (new fp32 tensors), and the payload bytes this rank sent.

        ``contributors``: the summed weight of the groups sending non-zero values.
        """
        return self._means([t.float() for t in tensors], contributors, addresses, self.sync_dtype)

    @torch.no_grad()
    def sent(self, tensors: Sequence[torch.Tensor], addresses: Sequence[Address]) -> list[torch.Tensor]:
        """What `mean` sends of this rank's part of each tensor, as the others decode it: the sparse payload's
        `SparseCodec.roundtrip` piece by piece (a piece's bounds are a function of its tensor's address alone)."""
        out = []
        for tensor, address in zip(tensors, addresses, strict=True):
            flat = tensor.reshape(-1).float()
            offset, sent = self.offset(address, flat), torch.zeros_like(flat)
            for piece in plan((address,), self.groups):
                lo = piece.start - offset
                if lo >= 0 and piece.stop - offset <= flat.numel():  # a piece lies in one shard or none
                    sent[lo : lo + piece.numel] = self.sparse.roundtrip(flat[lo : lo + piece.numel])
            out.append(sent.view_as(tensor))
        return out

    @torch.no_grad()
    def plain_mean(
        self, tensors: Sequence[torch.Tensor], contributors: int, contribute: bool, addresses: Sequence[Address]
    ) -> int:
        """Replace every tensor (in place) by its weighted mean, summed in fp32 (fp64 tensors in fp64): buffers, the
        initial weights, the global model lent between averagings. A group with ``contribute=False`` sends zeros.
        Returns the bytes sent."""
        sent = 0
        for wire, dtype in (
            ("float32", torch.float32),
            (FLOAT64, torch.float64),
        ):  # fp64 stays fp64, as equal groups do
            chosen = [i for i, t in enumerate(tensors) if (t.dtype == torch.float64) == (dtype == torch.float64)]
            if not chosen:  # the same on every rank: the model's dtypes
                continue
            sources = [tensors[i].to(dtype) if contribute else tensors[i].new_zeros(tensors[i].shape, dtype=dtype)
                       for i in chosen]  # fmt: skip
            means, nbytes = self._means(sources, contributors, [addresses[i] for i in chosen], wire)
            for i, mean in zip(chosen, means, strict=True):
                tensors[i].copy_(mean)
            sent += nbytes
        return sent

    @torch.no_grad()
    def _means(
        self, tensors: list[torch.Tensor], contributors: int, addresses: Sequence[Address], sync_dtype: str
    ) -> tuple[list[torch.Tensor], int]:
        means: list[torch.Tensor] = []
        sent = 0
        for start, stop in bucket_ranges([a.numel * 4 for a in addresses], self.bucket_bytes):  # whole tensors
            bucket = tensors[start:stop]
            flats = [t.reshape(-1) for t in bucket]
            results, nbytes = self._mean_flat(flats, contributors, tuple(addresses[start:stop]), sync_dtype)
            means += [r.view_as(t) for r, t in zip(results, bucket, strict=True)]
            sent += nbytes
        return means, sent

    def _mean_flat(
        self, flats: list[torch.Tensor], contributors: int, addresses: tuple[Address, ...], sync_dtype: str
    ) -> tuple[list[torch.Tensor], int]:
        """The three all-to-alls of the module docstring over one bucket of flat fp32 tensors: the owner sums the
        decoded copies and encodes the mean once, or (the sparse payload) gathers the G encodings and hands all of
        them on, each holder summing them itself."""
        if self.sparse is not None and sync_dtype == SPARSE:
            codec, groups = self.sparse, len(self.groups)

            def weighted_sum(piece: Piece, bundle: torch.Tensor) -> torch.Tensor:
                total = torch.zeros(piece.numel, dtype=torch.float32, device=bundle.device)
                for shape, part in zip(self.groups, bundle.split(codec.nbytes(piece.numel)), strict=True):
                    total += shape.weight * codec.decode(part, piece.numel)  # in group order
                return total / contributors

            results, mine = self._through_owners(
                flats, addresses, codec.encode, lambda p: codec.nbytes(p.numel),
                lambda p, own, copies: torch.cat([own if g == self.group else copies[(p, g)] for g in range(groups)]),
                lambda p: groups * codec.nbytes(p.numel), weighted_sum,
            )  # fmt: skip
            # a copy to the owner; the owner's G copies to each of the G - 1 others
            copies = [(groups - 1) * groups if p.owner == self.group else 1 for p in mine]
            return results, sum(n * codec.nbytes(p.numel) for n, p in zip(copies, mine, strict=True))

        def nbytes(piece: Piece) -> int:
            return _encoded_bytes(piece.numel, sync_dtype)

        results, mine = self._through_owners(
            flats, addresses, lambda x: _to_bytes(x, sync_dtype), nbytes,
            lambda p, own, copies: self._owner_mean(p, own, copies, contributors, sync_dtype), nbytes,
            lambda p, data: _from_bytes(data, p.numel, sync_dtype),
        )  # fmt: skip
        return results, sum(nbytes(p) for p in mine)

    def _through_owners(
        self,
        flats: list[torch.Tensor],
        addresses: tuple[Address, ...],
        encode: Callable[[torch.Tensor], torch.Tensor],
        nbytes: Callable[[Piece], int],
        combine: Callable[[Piece, torch.Tensor, dict], torch.Tensor],
        combined_bytes: Callable[[Piece], int],
        finish: Callable[[Piece, torch.Tensor], torch.Tensor],
    ) -> tuple[list[torch.Tensor], list[Piece]]:
        """Each piece ``encode``d by its designated holders and sent to its owner's, who ``combine``s the G copies
        (its own first argument, the others by (piece, group)); the result back to every group's holder and on to
        its other holders, where ``finish`` turns it into the piece's values. Returns the new flat tensors and the
        pieces this rank encoded."""
        pieces = plan(addresses, self.groups)
        offsets = [self.offset(a, f) for a, f in zip(addresses, flats, strict=True)]
        device = flats[0].device

        def span(piece: Piece) -> slice:
            lo = piece.start - offsets[piece.tensor]
            return slice(lo, lo + piece.numel)

        mine = [p for p in pieces if p.designated(self.group) == self.me]
        encoded = {p: encode(flats[p.tensor][span(p)]) for p in mine}
        copies = self._route(pieces, to_owner, encoded, nbytes, device)
        combined = {p: combine(p, encoded[p], copies) for p in mine if p.owner == self.group}
        back = self._route(pieces, from_owner, combined, combined_bytes, device)
        combined.update({p: data for (p, _), data in back.items()})
        fanned = self._route(pieces, to_replicas, combined, combined_bytes, device)
        combined.update({p: data for (p, _), data in fanned.items()})
        results = [f.clone() for f in flats]
        for piece, data in combined.items():
            results[piece.tensor][span(piece)] = finish(piece, data)
        return results, mine

    def _owner_mean(
        self,
        piece: Piece,
        own: torch.Tensor,
        copies: dict[tuple[Piece, int], torch.Tensor],
        contributors: int,
        sync_dtype: str,
    ) -> torch.Tensor:
        """Σ_g w_g · D(E(x_g)) / W in group order (this group's own copy decoded from its own bytes), encoded once."""
        dtype = torch.float64 if sync_dtype == FLOAT64 else torch.float32
        total = torch.zeros(piece.numel, dtype=dtype, device=own.device)
        for g, shape in enumerate(self.groups):
            data = own if g == self.group else copies[(piece, g)]
            total += shape.weight * _from_bytes(data, piece.numel, sync_dtype)
        return _to_bytes(total / contributors, sync_dtype)

    @torch.no_grad()
    def copy(
        self,
        flats: Sequence[torch.Tensor] | None,
        addresses: Sequence[Address],
        source: int,
        targets: Sequence[int],
        device: torch.device,
    ) -> None:
        """Overwrite the groups ``targets``' parts of every tensor with group ``source``'s, byte for byte (a heal:
        the targets' shards need not pair with the source's).

        ``flats``: this rank's flat parts of ``addresses`` (any dtype, each group's own shards) on the ranks of
        ``source`` and ``targets``; ``None`` on the other groups' ranks, which only take part in the all-to-alls.
        The source's designated holder of each piece sends its bytes to each target's designated holder, who hands
        them to the target's other holders (the fast tier). ``device``: where the bytes travel (the world's).
        """
        for start, stop in bucket_ranges([a.numel * 4 for a in addresses], self.bucket_bytes):
            bucket = None if flats is None else flats[start:stop]
            self._copy_flat(bucket, tuple(addresses[start:stop]), source, tuple(targets), device)

    def _copy_flat(
        self,
        flats: Sequence[torch.Tensor] | None,
        addresses: tuple[Address, ...],
        source: int,
        targets: tuple[int, ...],
        device: torch.device,
    ) -> None:
        """`copy` over one bucket: two all-to-alls (source → targets, then inside each target)."""
        pieces = plan(addresses, self.groups)
        offsets = [] if flats is None else [self.offset(a, f) for a, f in zip(addresses, flats, strict=True)]

        def part(piece: Piece) -> torch.Tensor:  # this rank's values of the piece, as bytes (a view)
            lo = piece.start - offsets[piece.tensor]
            return flats[piece.tensor][lo : lo + piece.numel].view(torch.uint8)

        def nbytes(piece: Piece) -> int:
            return piece.numel * flats[piece.tensor].element_size()

        def to_targets(piece: Piece) -> list[tuple[int, int]]:
            return [(piece.designated(source), piece.designated(t)) for t in targets]

        def inside_targets(piece: Piece) -> list[tuple[int, int]]:
            return [(piece.holders[t][0], other) for t in targets for other in piece.holders[t][1:]]

        sent = {p: part(p).to(device) for p in pieces if p.designated(source) == self.me}
        received = {p: data for (p, _), data in self._route(pieces, to_targets, sent, nbytes, device).items()}
        fanned = self._route(pieces, inside_targets, received, nbytes, device)
        received.update({p: data for (p, _), data in fanned.items()})
        for piece, data in received.items():
            part(piece).copy_(data)

    def _route(
        self,
        pieces: Sequence[Piece],
        transfers: Transfers,
        payloads: dict[Piece, torch.Tensor],
        nbytes: Callable[[Piece], int],
        device: torch.device,
    ) -> dict[tuple[Piece, int], torch.Tensor]:
        """One all-to-all over the world: each piece's bytes go along its ``transfers`` (source, target) pairs.

        ``nbytes``: the bytes of a piece this rank receives. Returns what this rank received, by (piece, the sender's
        group). No collective where the plan has no transfer (a function of the plan: the same on every rank).
        """
        size = self.world.size()
        outgoing: list[list[torch.Tensor]] = [[] for _ in range(size)]
        incoming: list[list[tuple[Piece, int]]] = [[] for _ in range(size)]
        routed = False
        for piece in pieces:
            for source, target in transfers(piece):
                routed = True
                if source == self.me:
                    outgoing[target].append(payloads[piece])
                if target == self.me:
                    incoming[source].append((piece, nbytes(piece)))
        if not routed:
            return {}
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        send = [torch.cat(parts) if parts else empty for parts in outgoing]
        output = torch.empty(sum(n for row in incoming for _, n in row), dtype=torch.uint8, device=device)
        self.world.all_to_all_v(
            output, torch.cat(send), [sum(n for _, n in row) for row in incoming], [s.numel() for s in send]
        )
        received, cursor = {}, 0
        for source, row in enumerate(incoming):
            for piece, nbytes in row:
                received[(piece, self._group_of[source])] = output[cursor : cursor + nbytes]
                cursor += nbytes
        return received

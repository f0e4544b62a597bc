"""The exchange: the mean over federation groups of each rank's fp32 payload, sent in the wire dtype.

Rule, for G contributing groups, codec encode E and decode D (`hf_fedshard.engine.codec`)::

    mean = D(E(Σ_g D(E(x_g)) / G))

An all-to-all of the encoded chunks gives each rank the G copies of the chunk it owns; it sums them in fp32,
divides, re-encodes, and an all-gather hands every rank every owner's encoded chunk. Every group, the owner
included, applies the decoded re-encoded values, so all groups decode the same bytes and stay bit-identical
(the shape of torchft's quantised all-reduce). A bf16 all-reduce would instead sum in bf16 at every hop.
float32 needs no re-encoding: it is one fp32 all-reduce.

FL+HSDP split exchange: the Q replicas of a group hold the same shard, so replica r exchanges only chunk r of
the payload (1/Q of it) across groups, then the group all-gathers the Q means over its replicas (fast tier):
the slow tier carries the payload once per group instead of Q times.

The sparse payload (``topk``, `hf_fedshard.engine.sparse`) cannot be summed on the wire: an all-gather hands every
rank every group's bytes, and each rank decodes them and sums in fp32, in group order, then divides::

    mean = Σ_g D(E(x_g)) / G

so every group computes the same tensor from the same bytes. Each tensor is encoded on its own (chunks start at its
first value) and, split over replicas, cut on its chunks' boundaries, so what a rank sends is `SparseCodec.roundtrip`
of its tensors whatever the buckets and parts. A gather carries G − 1 other groups' payloads to every rank: its
bytes grow with G, where an all-reduce's do not.

Collectives go through a `Communicator` (`hf_fedshard.engine.communicator`), so the arithmetic is tested
in-process with a fake one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hf_fedshard.engine.codec import Encoded, alignment, decode, encode
from hf_fedshard.engine.communicator import Communicator
from hf_fedshard.engine.payload import BUCKET_BYTES, Address
from hf_fedshard.engine.sparse import SparseCodec


def _pad(x: torch.Tensor, multiple: int) -> torch.Tensor:
    return F.pad(x, (0, -x.numel() % multiple))


def _all_to_all(comm: Communicator, payload: Encoded) -> Encoded:
    values = torch.empty_like(payload.values)
    comm.all_to_all(values, payload.values)
    scales = None
    if payload.scales is not None:
        scales = torch.empty_like(payload.scales)
        comm.all_to_all(scales, payload.scales)
    return Encoded(values, scales)


def _all_gather(comm: Communicator, payload: Encoded) -> Encoded:
    parts = comm.size()
    values = payload.values.new_empty(parts * payload.values.numel())
    comm.all_gather(values, payload.values)
    scales = None
    if payload.scales is not None:
        scales = payload.scales.new_empty(parts * payload.scales.numel())
        comm.all_gather(scales, payload.scales)
    return Encoded(values, scales)


def mean_over_groups(
    x: torch.Tensor, fed: Communicator, contributors: int, sync_dtype: str
) -> tuple[torch.Tensor, int]:
    """The mean of flat fp32 ``x`` over the ``fed`` peers (``contributors`` of them send non-zero values).

    Returns the mean (a new tensor, ``x``'s length) and the bytes this rank sent to the other groups, scales
    included: a reduce-scatter and an all-gather each send (G − 1)/G of the payload (the fp32 all-reduce counted as
    the ring's, whatever algorithm gloo or NCCL picks), so the payload once at G = 2 and 1.5 times at G = 4.
    """
    groups = fed.size()
    if sync_dtype == "float32":
        total = x.float().clone()
        fed.all_reduce_sum(total)
        return total.div_(contributors), 2 * (groups - 1) * total.numel() * total.element_size() // groups
    padded = _pad(x.float(), groups * alignment(sync_dtype))
    payload = encode(padded, sync_dtype)
    received = _all_to_all(fed, payload)  # row g: group g's copy of the chunk this rank owns
    owned = encode(decode(received).view(groups, -1).sum(dim=0).div_(contributors), sync_dtype)
    gathered = _all_gather(fed, owned)
    return decode(gathered)[: x.numel()], (groups - 1) * (payload.nbytes // groups + owned.nbytes)


def split_mean_over_groups(
    x: torch.Tensor, fed: Communicator, replicas: Communicator, contributors: int, sync_dtype: str
) -> tuple[torch.Tensor, int]:
    """`mean_over_groups` with the payload split over the group's replicas (identical ``x`` on each)."""
    parts = replicas.size()
    chunks = _pad(x.float(), parts * alignment(sync_dtype)).view(parts, -1)
    mine, sent = mean_over_groups(chunks[replicas.rank()], fed, contributors, sync_dtype)
    gathered = mine.new_empty(chunks.numel())
    replicas.all_gather(gathered, mine.contiguous())
    return gathered[: x.numel()], sent


def sparse_mean_over_groups(
    tensors: Sequence[torch.Tensor], fed: Communicator, contributors: int, codec: SparseCodec
) -> tuple[list[torch.Tensor], int]:
    """The mean over the ``fed`` peers of each flat fp32 tensor sent sparse, and the bytes this rank sent: its
    payload to each of the G − 1 other groups."""
    data = torch.cat([codec.encode(t) for t in tensors])
    groups, size = fed.size(), data.numel()
    if not size:  # no values here: the same on every peer (equal shards)
        return [torch.zeros(t.numel(), dtype=torch.float32, device=t.device) for t in tensors], 0
    gathered = data.new_empty(groups * size)
    fed.all_gather(gathered, data)
    sizes = [codec.nbytes(t.numel()) for t in tensors]
    total = [torch.zeros(t.numel(), dtype=torch.float32, device=t.device) for t in tensors]
    for row in gathered.view(groups, size):  # in group order
        for i, part in enumerate(row.split(sizes)):
            total[i] += codec.decode(part, tensors[i].numel())
    return [t.div_(contributors) for t in total], (groups - 1) * size


def chunk_parts(numel: int, chunk: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of ``parts`` consecutive parts of a tensor of ``numel`` values, cut on chunk boundaries."""
    per = math.ceil(math.ceil(numel / chunk) / parts) * chunk
    return [(min(numel, r * per), min(numel, (r + 1) * per)) for r in range(parts)]


def split_sparse_mean_over_groups(
    tensors: Sequence[torch.Tensor], fed: Communicator, replicas: Communicator, contributors: int, codec: SparseCodec
) -> tuple[list[torch.Tensor], int]:
    """`sparse_mean_over_groups` with each tensor split over the group's replicas on its chunks' boundaries."""
    parts = [chunk_parts(t.numel(), codec.chunk, replicas.size()) for t in tensors]
    mine = replicas.rank()
    means, sent = sparse_mean_over_groups([t[p[mine][0] : p[mine][1]] for t, p in zip(tensors, parts, strict=True)],
                                          fed, contributors, codec)  # fmt: skip
    lengths = [[b - a for a, b in p] for p in parts]
    row = max(sum(n[r] for n in lengths) for r in range(replicas.size()))
    flat = F.pad(torch.cat(means), (0, row - sum(n[mine] for n in lengths)))
    gathered = flat.new_empty(replicas.size() * row)
    replicas.all_gather(gathered, flat)
    results = [torch.empty(t.numel(), dtype=torch.float32, device=t.device) for t in tensors]
    for r, received in enumerate(gathered.view(replicas.size(), row)):
        cursor = 0
        for result, part in zip(results, parts, strict=True):
            a, b = part[r]
            result[a:b] = received[cursor : cursor + b - a]
            cursor += b - a
    return results, sent


def bucket_ranges(sizes: Sequence[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) index ranges of consecutive items of ``sizes`` bytes holding at most ``bucket_bytes`` (at least
    one item each)."""
    ranges, start, size = [], 0, 0
    for i, nbytes in enumerate(sizes):
        if i > start and size + nbytes > bucket_bytes:
            ranges.append((start, i))
            start, size = i, 0
        size += nbytes
    if start < len(sizes):
        ranges.append((start, len(sizes)))
    return ranges


class Exchange:
    """Means over groups of lists of fp32 tensors, in buckets, with the codec and (FL+HSDP) the replica split.

    Args:
        fed: this rank's peers at the same position in the other groups.
        sync_dtype: the wire dtype (``fed_sync_dtype``).
        replicas: this rank's replicas inside its group, to split the payload over; ``None``: no split.
        bucket_bytes: fp32 bytes of payload exchanged per collective.
        sparse: the codec of ``sync_dtype`` ``"topk"``.
    """

    def __init__(
        self,
        fed: Communicator,
        sync_dtype: str = "float32",
        replicas: Communicator | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        sparse: SparseCodec | None = None,
    ) -> None:
        self.fed, self.sparse = fed, sparse
        self.sync_dtype = sync_dtype
        self.replicas = replicas if replicas is not None and replicas.size() > 1 else None
        self.bucket_bytes = bucket_bytes

    @torch.no_grad()
    def mean(
        self, tensors: Sequence[torch.Tensor], contributors: int, addresses: Sequence[Address] | None = None
    ) -> tuple[list[torch.Tensor], int]:
        """The mean over groups of each fp32 tensor (new tensors), and the payload bytes this rank sent.

        ``addresses`` is `PieceExchange`'s: equal groups' peers hold the same shards, so it is not needed here.
        """
        means: list[torch.Tensor] = []
        sent = 0
        for start, stop in bucket_ranges([t.numel() * 4 for t in tensors], self.bucket_bytes):  # fp32 bytes
            bucket = tensors[start:stop]
            if self.sparse is not None:
                mean, nbytes = self._sparse_mean([t.reshape(-1).float() for t in bucket], contributors)
                means += [m.view_as(t) for m, t in zip(mean, bucket, strict=True)]
                sent += nbytes
                continue
            flat = torch.cat([t.reshape(-1).float() for t in bucket])
            if not flat.numel():  # empty shards (FSDP2's uneven split): the same on every peer, nothing to send
                means += [t.float().clone() for t in bucket]
                continue
            if self.replicas is None:
                mean, nbytes = mean_over_groups(flat, self.fed, contributors, self.sync_dtype)
            else:
                mean, nbytes = split_mean_over_groups(flat, self.fed, self.replicas, contributors, self.sync_dtype)
            sent += nbytes
            means += [m.view_as(t) for m, t in zip(mean.split([t.numel() for t in bucket]), bucket, strict=True)]
        return means, sent

    @torch.no_grad()
    def sent(self, tensors: Sequence[torch.Tensor], addresses: Sequence[Address] | None = None) -> list[torch.Tensor]:
        """What `mean` sends of each tensor, as the peers decode it (the sparse payload: its `SparseCodec.roundtrip`,
        tensor by tensor, whatever the buckets and replica parts); error feedback keeps the rest."""
        return [self.sparse.roundtrip(t.reshape(-1).float()).view_as(t) for t in tensors]

    def _sparse_mean(self, flats: list[torch.Tensor], contributors: int) -> tuple[list[torch.Tensor], int]:
        """The sparse payload's means of one bucket (a tensor each)."""
        if not sum(t.numel() for t in flats):  # empty shards: the same on every peer, nothing to send
            return [t.clone() for t in flats], 0
        if self.replicas is None:
            return sparse_mean_over_groups(flats, self.fed, contributors, self.sparse)
        return split_sparse_mean_over_groups(flats, self.fed, self.replicas, contributors, self.sparse)

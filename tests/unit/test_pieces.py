"""The exchange between groups of unequal size (`hf_fedshard.engine.pieces`), in one process with fake ranks.

Every group holds each tensor as FSDP2 would (``Shard(0)`` by ``torch.chunk`` over its shard ranks, on each of its
replicas; buffers whole on every rank); the tests pin the weighted rule on the whole tensors, not on the pieces.

The weights are written here, never read from `GroupShape.weight` (the code under test): the module docstring's w_g is
the group's number of ranks (shard ranks × replicas), so ``fed_group_size 4,2,2`` weighs 4, 2, 2 and its mean divides
by 8, or by 6 with the second group left out. Uniform weights, or a divisor that counts groups, fail here.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hf_fedshard.engine import pieces
from hf_fedshard.engine.pieces import Address, GroupShape, PieceExchange, plan
from hf_fedshard.errors import ConfigError

from ..fake_communicator import run_ranks

# (rows, columns, sharded): odd row counts so that groups of 4, 2 and 3 cut them at different rows; a tensor with
# fewer rows than a group has shards (FSDP2 leaves the last shards empty); a buffer held whole.
TENSORS = [(7, 3, True), (16, 5, True), (2, 4, True), (5, 1, False), (33, 64, True)]


def layout(sizes: list[int], shard: int | None) -> list[GroupShape]:
    groups, first = [], 0
    for size in sizes:
        groups.append(GroupShape(tuple(range(first, first + size)), size if shard is None else shard))
        first += size
    return groups


def whole(group: int, index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Group ``group``'s whole tensor ``index``: different in every group and every element."""
    rows, cols, _ = TENSORS[index]
    gen = torch.Generator().manual_seed(1000 * group + index)
    return torch.randn(rows, cols, generator=gen).to(dtype)


def local(full: torch.Tensor, shape: GroupShape, rank: int, sharded: bool) -> torch.Tensor:
    """What ``rank`` holds of ``full`` under FSDP2."""
    if not sharded:
        return full.clone()
    chunks = torch.chunk(full, shape.shard_size)
    shard = shape.ranks.index(rank) % shape.shard_size
    return chunks[shard].clone() if shard < len(chunks) else full[:0].clone()


def exchange(sizes, shard, sync_dtype, weights, contribute=None, plain=False):
    """Every rank's (means, bytes sent) of the tensors of `TENSORS`; ``contribute[g]`` False: group g sends zeros.
    ``weights``: the groups' weights the test expects, whose sum over the contributing groups is passed as W."""
    groups = layout(sizes, shard)
    addresses = [Address(r * c, r, sharded) for r, c, sharded in TENSORS]
    contribute = contribute or [True] * len(groups)
    weight = sum(w for w, c in zip(weights, contribute, strict=True) if c)

    def rank_fn(world):
        group = next(g for g, shape in enumerate(groups) if world.rank() in shape.ranks)
        mine = [
            local(whole(group, i), groups[group], world.rank(), sharded) for i, (_, _, sharded) in enumerate(TENSORS)
        ]
        ex = PieceExchange(world, groups, group, sync_dtype)
        if plain:
            sent = ex.plain_mean(mine, weight, contribute[group], addresses)
            return group, mine, sent
        if not contribute[group]:
            mine = [torch.zeros_like(t) for t in mine]
        means, sent = ex.mean(mine, weight, addresses)
        return group, means, sent

    return groups, run_ranks(sum(sizes), rank_fn)


def expected(weights, index, contribute=None, sync_dtype="float32") -> torch.Tensor:
    """Σ_g w_g · x_g / W in group order, in fp32 (bf16: each x_g and the mean rounded elementwise); ``weights``: the
    hard-coded w_g, W their sum over the contributing groups."""
    contribute = contribute or [True] * len(weights)
    total = torch.zeros_like(whole(0, index))
    for g, w in enumerate(weights):
        x = whole(g, index) if contribute[g] else torch.zeros_like(total)
        if sync_dtype == "bfloat16":
            x = x.bfloat16().float()
        total += w * x
    mean = total / sum(w for w, c in zip(weights, contribute, strict=True) if c)
    return mean.bfloat16().float() if sync_dtype == "bfloat16" else mean


# (sizes, shard size, the weights w_g = each group's ranks: replicas × shards, written out)
WEIGHTED = [
    ([4, 2, 2], None, [4, 2, 2]),
    ([4, 2, 2], 2, [4, 2, 2]),  # group 0: 2 replicas of 2 shards, still 4 ranks' samples
    ([3, 1], None, [3, 1]),
    ([2, 2], None, [2, 2]),  # equal weights, W = 4: weights of 1 would halve the mean
    ([1, 3, 2], 1, [1, 3, 2]),  # FL+HSDP: every rank a replica of the whole model
]


def test_a_group_weighs_its_ranks_replicas_included():
    """w_g counts the samples a group reads per step: one batch per rank, shard ranks and replicas alike."""
    assert GroupShape((0, 1, 2, 3), 4).weight == 4
    assert GroupShape((0, 1, 2, 3), 2).weight == 4  # 2 replicas of 2 shards
    assert GroupShape((5,), 1).weight == 1


@pytest.mark.parametrize("sizes, shard, weights", WEIGHTED)
@pytest.mark.parametrize("sync_dtype", ["float32", "bfloat16"])
def test_every_rank_gets_the_weighted_mean_of_the_whole_tensors_to_the_bit(
    sizes, shard, weights, sync_dtype, monkeypatch
):
    monkeypatch.setattr(pieces, "SPLIT_VALUES", 64)  # cut the large pieces G ways, as a real model's are
    groups, results = exchange(sizes, shard, sync_dtype, weights)
    for rank, (group, means, _) in enumerate(results):
        for i, (_, _, sharded) in enumerate(TENSORS):
            want = local(expected(weights, i, sync_dtype=sync_dtype), groups[group], rank, sharded)
            assert torch.equal(means[i], want), f"rank {rank}, tensor {i}"


def test_int8_groups_decode_the_same_bytes_and_stay_within_the_codec_error(monkeypatch):
    monkeypatch.setattr(pieces, "SPLIT_VALUES", 64)
    groups, results = exchange([4, 2, 2], None, "int8", [4, 2, 2])
    for i, (_, _, sharded) in enumerate(TENSORS):
        want = expected([4, 2, 2], i)
        assembled = {}
        for rank, (group, means, _) in enumerate(results):
            got = means[i]
            ref = local(want, groups[group], rank, sharded)
            assembled.setdefault(group, []).append((rank, got))
            if not got.numel():
                continue
            # two int8 roundings, each off by at most half a block's scale: max|x| / 127 / 2
            bound = 2 * max(whole(g, i).abs().max().item() for g in range(3)) / 127
            assert (got - ref).abs().max().item() <= bound
        # every group holds the same values, to the bit: reassemble each group's whole tensor and compare
        if sharded:
            fulls = [torch.cat([t for _, t in sorted(parts)][: groups[g].shard_size]) for g, parts in assembled.items()]
            assert all(torch.equal(fulls[0], f) for f in fulls[1:]), f"tensor {i}"


def test_a_group_that_sends_zeros_is_left_out_of_the_weights():
    """Weights 4, 2, 2 with the second group out: (4 x_0 + 2 x_2) / 6."""
    groups, results = exchange([4, 2, 2], None, "float32", [4, 2, 2], contribute=[True, False, True])
    for rank, (group, means, _) in enumerate(results):
        for i, (_, _, sharded) in enumerate(TENSORS):
            want = local((4 * whole(0, i) + 2 * whole(2, i)) / 6, groups[group], rank, sharded)
            assert torch.equal(means[i], want), (rank, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_plain_mean_replaces_in_place_summing_in_fp32_or_wider(dtype):
    """bf16 and fp32 tensors are summed in fp32 and cast back; fp64 ones in fp64 (a buffer keeps its precision)."""
    groups = layout([3, 1], None)
    addresses = [Address(r * c, r, sharded) for r, c, sharded in TENSORS]

    def rank_fn(world):
        group = 0 if world.rank() < 3 else 1
        mine = [local(whole(group, i, dtype), groups[group], world.rank(), t[2]) for i, t in enumerate(TENSORS)]
        PieceExchange(world, groups, group).plain_mean(mine, 4, True, addresses)
        return group, mine

    wide = torch.float64 if dtype == torch.float64 else torch.float32
    for rank, (group, tensors) in enumerate(run_ranks(4, rank_fn)):
        for i, (_, _, sharded) in enumerate(TENSORS):
            total = torch.zeros_like(whole(0, i), dtype=wide)
            for g, w in enumerate((3, 1)):  # each group's ranks
                total += w * whole(g, i, dtype).to(wide)
            want = local((total / 4).to(dtype), groups[group], rank, sharded)
            assert tensors[i].dtype == dtype and torch.equal(tensors[i], want), (rank, i)


def test_each_piece_is_sent_once_per_group_and_the_bytes_are_the_groups_payload():
    """The bytes a group's ranks count are its payload once: the model's size, whatever its shards or replicas."""
    _, results = exchange([4, 2, 2], 2, "float32", [4, 2, 2])
    numel = sum(r * c for r, c, _ in TENSORS)
    for g in range(3):
        assert sum(sent for group, _, sent in results if group == g) == 4 * numel


@pytest.mark.parametrize(("sync_dtype", "payload"), [("float32", 8904), ("bfloat16", 4452), ("int8", 4160)])
def test_a_groups_bytes_are_what_its_pieces_put_on_the_wire_scales_and_padding_included(sync_dtype, payload):
    """Groups of 4, 2 and 2 ranks, 2 shards each: every tensor is cut at the same rows in every group, into the
    pieces 12 + 9, 40 + 40, 4 + 4 values, the buffer's 5, and 17 × 64 = 1,088 + 16 × 64 = 1,024 values (2,226 in
    all). fp32 sends 4 bytes a value (8,904), bf16 2 (4,452). int8 pads each piece to its 256-value blocks and
    sends a 4-byte scale per block: 7 pieces of one block (260 bytes each), 5 blocks (1,300), 4 blocks (1,040):
    4,160 bytes, where the values alone would be 2,226."""
    _, results = exchange([4, 2, 2], 2, sync_dtype, [4, 2, 2])
    assert [sum(sent for group, _, sent in results if group == g) for g in range(3)] == [payload] * 3


def test_the_plan_is_a_function_of_the_layout_and_every_piece_has_one_shard_per_group():
    groups = tuple(layout([4, 2, 2], None))
    addresses = tuple(Address(r * c, r, s) for r, c, s in TENSORS)
    pieces_ = plan(addresses, groups)
    assert pieces_ == plan(addresses, tuple(layout([4, 2, 2], None)))
    for piece in pieces_:
        for shape, holders in zip(groups, piece.holders, strict=True):
            for rank in holders:
                k = shape.ranks.index(rank) % shape.shard_size
                start, stop = shape.span(addresses[piece.tensor], k)
                assert start <= piece.start and piece.stop <= stop
    for i, address in enumerate(addresses):  # each tensor's pieces tile it: contiguous, no gap, no overlap
        spans = sorted((p.start, p.stop) for p in pieces_ if p.tensor == i)
        assert spans[0][0] == 0 and spans[-1][1] == address.numel
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert {p.owner for p in pieces_} == {0, 1, 2}


def test_every_replica_of_a_group_carries_a_share_of_the_pieces(monkeypatch):
    """Groups of 4 and 2 ranks with shards of 2: group 0 has 2 replicas of each shard, and each is the designated
    holder of some of the pieces it holds, the ones its group owns among them."""
    monkeypatch.setattr(pieces, "SPLIT_VALUES", 64)
    groups = tuple(layout([4, 2], 2))
    pieces_ = plan(tuple(Address(r * c, r, s) for r, c, s in TENSORS), groups)
    designated = {p.designated(0) for p in pieces_}
    owning = {p.designated(0) for p in pieces_ if p.owner == 0}
    assert designated == owning == {0, 1, 2, 3}


def test_a_shard_that_is_not_fsdp2s_is_refused_before_any_collective():
    groups = layout([2, 1], None)
    ex = PieceExchange(_Solo(), groups, 0)
    with pytest.raises(ConfigError, match=r"fed_group_size: this rank holds 3 values .* gives 6"):
        ex.mean([torch.zeros(3)], 3, [Address(12, 4, True)])


class _Solo:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 3

    def all_to_all_v(self, *args) -> None:
        raise AssertionError("no collective before the shards are checked")


def test_split_pieces_fall_on_the_int8_block_grid(monkeypatch):
    monkeypatch.setattr(pieces, "SPLIT_VALUES", 64)
    parts = pieces._parts(0, 1000, 3)
    assert [a for a, _ in parts] == [0, 512] and parts[-1][1] == 1000
    assert all(a % 256 == 0 for a, _ in parts) and math.prod(b > a for a, b in parts)


@pytest.mark.parametrize(
    ("sizes", "shard", "source", "targets"),
    [([1, 2], None, 0, [1]), ([4, 2, 2], 2, 1, [0]), ([2, 1, 3], None, 2, [0, 1]), ([3, 1], 1, 1, [0])],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_gives_the_targets_the_sources_values_byte_for_byte_and_leaves_the_others(
    sizes, shard, source, targets, dtype, monkeypatch
):
    """A heal: the targets' shards (of their own size) take the source's values bit for bit; other groups send and
    receive nothing but take part in the collectives (``None``)."""
    monkeypatch.setattr(pieces, "SPLIT_VALUES", 64)
    groups = layout(sizes, shard)
    addresses = [Address(r * c, r, sharded) for r, c, sharded in TENSORS]

    def rank_fn(world):
        group = next(g for g, shape in enumerate(groups) if world.rank() in shape.ranks)
        mine = [local(whole(group, i, dtype), groups[group], world.rank(), t[2]).reshape(-1)
                for i, t in enumerate(TENSORS)]  # fmt: skip
        flats = mine if group == source or group in targets else None
        PieceExchange(world, groups, group).copy(flats, addresses, source, targets, torch.device("cpu"))
        return group, mine

    for rank, (group, tensors) in enumerate(run_ranks(sum(sizes), rank_fn)):
        origin = source if group in targets else group
        for i, (_, _, sharded) in enumerate(TENSORS):
            want = local(whole(origin, i, dtype), groups[group], rank, sharded).reshape(-1)
            assert torch.equal(tensors[i].view(torch.uint8), want.view(torch.uint8)), (rank, i)

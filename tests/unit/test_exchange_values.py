"""The values the exchange and the buffer averaging hand every peer, bit for bit, with groups left out.

The reference is the rule of `hf_fedshard.engine.exchange` written again from the codec primitives: a wrong divisor,
a sum in bf16, a skipped re-encoding or a mis-cut chunk changes bits that a tolerance would let through.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_fedshard.engine import payload
from hf_fedshard.engine.codec import alignment, decode, encode
from hf_fedshard.engine.exchange import Exchange

from ..fake_communicator import run_ranks, run_split

SHAPES = [(7, 13), (300,), (3, 200)]  # 991 values: int8 blocks straddle tensors and the last one is padded


def deltas(groups: int) -> list[list[torch.Tensor]]:
    """Each group's Δ, one tensor per shape, a different scale per group (so that the divisor shows)."""
    generator = torch.Generator().manual_seed(0)
    return [[torch.randn(s, generator=generator) * (g + 1) for s in SHAPES] for g in range(groups)]


def rule(xs: list[torch.Tensor], contributing: list[int], sync_dtype: str) -> torch.Tensor:
    """decode(encode(Σ_g decode(encode(x_g)) / C)) over the C contributing groups, summed in fp32 in group order."""
    numel = xs[0].numel()

    def wire(x: torch.Tensor) -> torch.Tensor:  # what x stands for once sent
        return decode(encode(F.pad(x.float(), (0, -x.numel() % alignment(sync_dtype))), sync_dtype))

    total = torch.zeros_like(wire(xs[0]))
    for g in contributing:
        total += wire(xs[g])
    return wire(total / len(contributing))[:numel]


def sent_by(group: int, contributing: list[int], ds: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """What a group sends: its Δ, or zeros when it is left out (as `FederatedAverager._deltas` does)."""
    return ds[group] if group in contributing else [torch.zeros_like(d) for d in ds[group]]


def expected_means(ds: list[list[torch.Tensor]], contributing: list[int], sync_dtype: str) -> list[torch.Tensor]:
    flats = [torch.cat([d.reshape(-1) for d in group]) for group in ds]
    mean = rule(flats, contributing, sync_dtype)
    return [m.view(s) for m, s in zip(mean.split([d.numel() for d in ds[0]]), SHAPES, strict=True)]


def assert_every_peer_got(results: list, expected: list[torch.Tensor]) -> None:
    for rank, (means, _) in enumerate(results):
        for i, (got, want) in enumerate(zip(means, expected, strict=True)):
            differ = (got != want).sum().item()
            assert torch.equal(got, want), f"rank {rank}, tensor {i}: {differ}/{want.numel()} values differ"


@pytest.mark.parametrize("sync_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("contributing", [[0, 1, 2, 3], [0, 2, 3], [1]], ids=["all", "3of4", "1of4"])
def test_exchange_is_the_rule_over_the_contributing_groups_exactly(sync_dtype, contributing):
    """Catches a mean divided by the peers (4) instead of the contributors, a sum in bf16 rather than fp32, a
    chunk owner keeping its fp32 mean instead of the re-encoded one, and an int8 block cut at the wrong place."""
    ds = deltas(4)
    results = run_ranks(
        4, lambda comm: Exchange(comm, sync_dtype).mean(sent_by(comm.rank(), contributing, ds), len(contributing))
    )
    assert_every_peer_got(results, expected_means(ds, contributing, sync_dtype))


@pytest.mark.parametrize("sync_dtype", ["bfloat16", "int8"])
def test_split_exchange_is_the_rule_over_the_contributing_groups_exactly(sync_dtype):
    """FL+HSDP, 4 groups × 2 replicas, group 1 left out: catches a replica exchanging the wrong chunk, chunks
    gathered in the wrong order, or the split changing the int8 blocks (every rank must decode the rule's bytes)."""
    ds, contributing = deltas(4), [0, 2, 3]
    results = run_split(
        4, 2, lambda g, fed, reps: Exchange(fed, sync_dtype, reps).mean(sent_by(g, contributing, ds), 3)
    )
    assert_every_peer_got(results, expected_means(ds, contributing, sync_dtype))


def test_buffers_left_out_group_gets_the_mean_of_the_others_only():
    """`plain_mean_over_groups(contribute=False)` on a group whose buffers are NaN: catches NaN × 0 sent instead
    of zeros, a division by the peers (4) instead of the contributors (3), and a bf16 buffer summed in bf16."""

    generator = torch.Generator().manual_seed(1)
    buffers = [
        [torch.randn(5, 3, generator=generator) * (g + 1), torch.randn(40, generator=generator).bfloat16()]
        for g in range(4)
    ]
    for b in buffers[1]:
        b.fill_(float("nan"))  # group 1 diverged
    contributing = [0, 2, 3]
    expected = [(sum(buffers[g][i].float() for g in contributing) / 3).to(buffers[0][i].dtype) for i in range(2)]

    def rank_fn(comm):
        mine = [b.clone() for b in buffers[comm.rank()]]
        payload.plain_mean_over_groups(mine, comm, 3, contribute=comm.rank() in contributing)
        return mine, None

    assert_every_peer_got(run_ranks(4, rank_fn), expected)

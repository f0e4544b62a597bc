"""The sparse payload (``fed_sync_dtype topk``): its codec against the rule written here element by element, its error
feedback's bookkeeping over rounds, its exchange over fake communicators (gathered, summed in group order; split
over replicas on chunk boundaries; piece by piece for groups of unequal size), its bytes, and its settings."""

from __future__ import annotations

import math
import re
import threading

import pytest
import torch

from hf_fedshard.engine.exchange import Exchange, chunk_parts
from hf_fedshard.engine.feedback import ErrorFeedback
from hf_fedshard.engine.options import AveragingOptions
from hf_fedshard.engine.payload import Address
from hf_fedshard.engine.pieces import GroupShape, PieceExchange
from hf_fedshard.engine.sparse import SparseCodec
from hf_fedshard.errors import ConfigError

from ..fake_communicator import FakeCommunicator, run_ranks
from ..tiny_federation import engine_run


def rule(x: torch.Tensor, codec: SparseCodec) -> torch.Tensor:
    """D(E(x)) by the module docstring, chunk by chunk and index by index."""
    levels = 2 ** (codec.bits - 1) - 1
    out = torch.zeros_like(x)
    for start in range(0, x.numel(), codec.chunk):
        chunk = x[start : start + codec.chunk]
        n = chunk.numel()
        k = min(n, max(1, math.ceil(codec.density * n)))
        chosen = sorted(range(n), key=lambda i: (-abs(chunk[i].item()), i))[:k]  # ties: the lower index first
        picked = chunk[chosen]
        scale = picked.abs().max() / levels
        if scale == 0:
            continue
        out[[start + i for i in chosen]] = torch.round(picked / scale).clamp(-levels, levels) * scale
    return out


CASES = [  # (values, codec): ties, a chunk of zeros, a short last chunk, each index type, each width
    (torch.tensor([1.0, -3.0, 3.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, -0.25]), SparseCodec(0.4, 2, 5)),
    (torch.tensor([2.0, -2.0, 2.0, 2.0, 1.0, -1.0, 1.0]), SparseCodec(0.5, 4, 3)),
    (torch.randn(1000, generator=torch.Generator().manual_seed(0)), SparseCodec(0.03, 8, 256)),
    (torch.randn(1000, generator=torch.Generator().manual_seed(1)), SparseCodec(0.02, 4, 300)),
    (torch.randn(70_001, generator=torch.Generator().manual_seed(2)), SparseCodec(0.001, 2, 70_000)),
]


@pytest.mark.parametrize(("x", "codec"), CASES, ids=["ties", "equal-magnitudes", "uint8", "uint16", "int32"])
def test_encode_then_decode_follows_the_rule_to_the_bit(x, codec):
    data = codec.encode(x)
    assert data.dtype == torch.uint8 and data.numel() == codec.nbytes(x.numel())
    torch.testing.assert_close(codec.decode(data, x.numel()), rule(x, codec), rtol=0, atol=0)


def test_ties_go_to_the_lower_index_and_two_bits_send_sign_times_the_largest():
    codec = SparseCodec(0.4, 2, 5)  # k = 2 of 5; L = 1
    got = codec.roundtrip(torch.tensor([1.0, -3.0, 3.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, -0.2]))
    assert got.tolist() == [0.0, -3.0, 3.0, 0.0, 0.0] + [0.0] * 5 + [0.5, 0.0]  # the last chunk: 2 values, k = 1


def test_the_bytes_are_codes_indices_and_scales():
    """10,000 values in chunks of 4096 at 1%: 41 + 41 + ⌈18.08⌉ = 101 values: 26 bytes of 2-bit codes, 202 of
    uint16 indices, 3 fp32 scales."""
    codec = SparseCodec(0.01, 2, 4096)
    assert codec.nbytes(10_000) == 26 + 202 + 12 == codec.encode(torch.randn(10_000)).numel()
    assert SparseCodec(0.01, 8, 256).index_dtype == torch.uint8 and codec.index_dtype == torch.uint16
    assert SparseCodec(0.01, 4, 2**16 + 1).index_dtype == torch.int32
    assert codec.nbytes(0) == 0 and codec.decode(codec.encode(torch.empty(0)), 0).numel() == 0


def test_error_feedback_keeps_exactly_what_was_not_sent_over_rounds():
    """Each round: x = Δ + β e; what was sent plus what is kept is x, to the bit; what was never sent is decayed."""
    codec, generator = SparseCodec(0.05, 2, 64), torch.Generator().manual_seed(3)
    feedback = ErrorFeedback([torch.zeros(1000)], decay=0.9)
    for _ in range(5):
        delta = torch.randn(1000, generator=generator)
        before = feedback.residual[0].clone()
        (x,) = feedback.add([delta])
        torch.testing.assert_close(x, delta + 0.9 * before, rtol=0, atol=0)
        sent = codec.roundtrip(x)
        (kept,) = ErrorFeedback.left([x], [sent])
        assert torch.equal(sent + kept, x) and torch.equal(kept[sent == 0], x[sent == 0])
        feedback.keep([kept])
    feedback.reset()
    assert not feedback.residual[0].any()


def gather_means(tensors_of, groups: int, contributors: int, codec: SparseCodec, replicas: int = 1) -> list:
    """Each rank's (means, bytes) of `Exchange.mean` over ``groups`` groups of ``replicas`` ranks (fake groups)."""
    shared = {f"p{r}": {"barrier": threading.Barrier(groups)} for r in range(replicas)}
    shared |= {f"r{g}": {"barrier": threading.Barrier(replicas)} for g in range(groups)}

    def rank_fn(world):
        group, replica = divmod(world.rank(), replicas)
        peers = FakeCommunicator(shared[f"p{replica}"], group, groups)
        split = FakeCommunicator(shared[f"r{group}"], replica, replicas) if replicas > 1 else None
        return Exchange(peers, "topk", split, sparse=codec).mean(tensors_of(group), contributors)

    return run_ranks(groups * replicas, rank_fn)


def test_the_exchange_sums_the_decoded_payloads_in_group_order_and_counts_a_gathers_bytes():
    """Three groups, the third diverged (zeros, left out of the 2 contributors): mean = Σ_g D(E(x_g)) / 2; every rank
    ends with the same tensors; each sent its payload to the 2 others. Split over 2 replicas: the same values."""
    codec = SparseCodec(0.25, 4, 8)
    generator = torch.Generator().manual_seed(4)
    inputs = [[torch.randn(5, 7, generator=generator), torch.randn(13, generator=generator)] for _ in range(2)]
    inputs.append([torch.zeros(5, 7), torch.zeros(13)])
    want = [(codec.roundtrip(a.reshape(-1)) + codec.roundtrip(b.reshape(-1)) + 0.0) / 2 for a, b in
            zip(inputs[0], inputs[1], strict=True)]  # fmt: skip
    for replicas in (1, 2):
        for means, sent in gather_means(lambda g: inputs[g], 3, 2, codec, replicas):
            for got, expected in zip(means, want, strict=True):
                torch.testing.assert_close(got.reshape(-1), expected, rtol=0, atol=0)
            if replicas == 1:
                assert sent == 2 * (codec.nbytes(35) + codec.nbytes(13))
    assert chunk_parts(35, 8, 2) == [(0, 24), (24, 35)] and chunk_parts(13, 8, 2) == [(0, 8), (8, 13)]
    assert Exchange(None, "topk", sparse=codec).sent(inputs[0], None)[1].equal(codec.roundtrip(inputs[0][1]))


def test_groups_of_unequal_size_sum_every_groups_pieces_weighted_in_group_order():
    """Groups of 2 and 1 shard ranks: the pieces are the halves of a tensor, each encoded on its own (14 bytes: 3
    values, 3 uint8 indices, 2 scales); mean = (2 · D(E(x_0)) + 1 · D(E(x_1))) / 3 per piece, on every rank; `sent`
    is the same pieces' roundtrip. Group 0 owns both halves: its ranks each send their half's 2 encodings to group 1,
    whose rank sends its 2 halves' encodings to them: 28 bytes each."""
    codec = SparseCodec(0.5, 8, 4)
    shapes = (GroupShape((0, 1), 2), GroupShape((2,), 1))
    address = Address(12, 6)
    whole = [torch.arange(12.0) - 5.5, torch.linspace(3.0, -2.0, 12)]

    def rank_fn(world):
        group = 0 if world.rank() < 2 else 1
        span = shapes[group].span(address, world.rank() % 2 if group == 0 else 0)
        exchange = PieceExchange(world, shapes, group, "topk", sparse=codec)
        local = [whole[group][span[0] : span[1]]]
        return group, span, exchange.mean(local, 3, [address]), exchange.sent(local, [address])

    pieces = [(0, 6), (6, 12)]
    assert codec.nbytes(6) == 14
    for group, span, (means, nbytes), sent in run_ranks(3, rank_fn):
        assert nbytes == 28
        expected = torch.cat([(2 * codec.roundtrip(whole[0][a:b]) + codec.roundtrip(whole[1][a:b])) / 3
                              for a, b in pieces])  # fmt: skip
        torch.testing.assert_close(means[0], expected[span[0] : span[1]], rtol=0, atol=0)
        own = torch.cat([codec.roundtrip(whole[group][a:b]) for a, b in pieces])
        torch.testing.assert_close(sent[0], own[span[0] : span[1]], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sync_dtype": "topk", "sync_density": 0.0}, "fed_sync_density=0.0: it must be in (0, 1]"),
        ({"sync_dtype": "topk", "sync_bits": 3}, "fed_sync_bits=3: a sent value takes 2, 4 or 8 bits"),
        ({"sync_dtype": "topk", "sync_chunk": 0}, "fed_sync_chunk=0: it must be a positive number"),
        ({"sync_dtype": "topk", "sync_feedback_decay": 1.5}, "fed_sync_feedback_decay=1.5: it must be in [0, 1]"),
        ({"sync_dtype": "int8", "sync_chunk": 512}, "fed_sync_chunk set the sparse payload, but fed_sync_dtype='int8'"),
    ],
)
def test_bad_sparse_settings_are_refused_in_one_line_naming_the_setting(settings, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}") as err:
        AveragingOptions(**settings)
    assert "\n" not in str(err.value)


def test_the_counted_bytes_are_what_each_rank_gathers_to_the_two_others():
    """3 groups, H = 4, 8 steps: step 0's fp32 plain mean of 26 parameters and a 2-value buffer (112 bytes), then
    two averagings of 2 × (19 + 7 + 13 + 6) bytes of sparse Δ (the 12, 4, 8 and 2 values in chunks of 5 at k = 2 of
    5: codes, uint8 indices, scales) and the buffer's 8 bytes in fp32."""
    results = engine_run(8, sync_dtype="topk", sync_density=0.4, sync_chunk=5)
    codec = SparseCodec(0.4, 2, 5)
    assert [codec.nbytes(n) for n in (12, 4, 8, 2)] == [19, 7, 13, 6]
    for _, averager, _, _ in results:
        assert averager.counters.inter_group_bytes == 112 + 2 * (2 * 45 + 8)


def test_a_group_with_nan_is_left_out_and_starts_again_from_an_empty_residual():
    """Group 1 turns NaN at step 7, holding a residual from step 4's averaging: the averaging of step 8 leaves it out
    (the mean of groups 0 and 2's payloads) and restarts it from the global model with e = 0; the others keep what
    they did not send."""
    results = engine_run(8, nan_at=(1, 7), sync_dtype="topk", sync_density=0.4, sync_chunk=5)
    residuals = [[e for f in averager.fragments for e in f.feedback.residual] for _, averager, _, _ in results]
    assert not any(e.any() for e in residuals[1])
    assert all(any(e.any() for e in residuals[g]) for g in (0, 2))
    assert results[1][1].counters.diverged_groups == 1
    for g in (1, 2):
        for mine, theirs in zip(results[g][0], results[0][0], strict=True):
            assert torch.equal(mine, theirs)  # every group on the global model

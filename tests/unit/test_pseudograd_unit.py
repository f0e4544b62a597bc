"""Fast in-process checks of the codec, the exchange (with a fake communicator, and over a one-rank gloo group)
and the outer optimizer."""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from hf_fedshard.engine.codec import INT8_BLOCK, decode, encode
from hf_fedshard.engine.communicator import ProcessGroupCommunicator
from hf_fedshard.engine.exchange import Exchange, mean_over_groups, split_mean_over_groups
from hf_fedshard.engine.outer import OuterOptimizer
from hf_fedshard.errors import ConfigError
from hf_fedshard.integrations.arguments import FedShardTrainingArguments

from ..asserts import labelled
from ..fake_communicator import run_ranks, run_split


def payloads(groups: int, numel: int = 1000) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(numel, generator=generator) * (g + 1) for g in range(groups)]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ---- codec ----


def test_int8_codec_is_exact_on_block_maxima_and_within_half_a_step_elsewhere():
    x = torch.randn(4 * INT8_BLOCK)
    payload = encode(x, "int8")
    assert payload.values.dtype == torch.int8 and payload.scales.shape == (4,)
    assert payload.nbytes == x.numel() + 4 * 4
    y = decode(payload)
    step = (x.view(4, -1).abs().amax(dim=1) / 127).repeat_interleave(INT8_BLOCK)
    assert ((x - y).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(decode(encode(torch.zeros(INT8_BLOCK), "int8")), torch.zeros(INT8_BLOCK))


def test_codec_bytes_are_one_half_and_about_one_quarter_of_fp32():
    x = torch.randn(8 * INT8_BLOCK)
    fp32 = encode(x, "float32").nbytes
    assert encode(x, "bfloat16").nbytes * 2 == fp32
    assert encode(x, "int8").nbytes == fp32 // 4 + 8 * 4  # values, plus one fp32 scale per block


# ---- exchange ----


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_every_group_decodes_the_same_bytes(dtype):
    xs = payloads(3)
    means = run_ranks(3, lambda comm: mean_over_groups(xs[comm.rank()], comm, 3, dtype)[0])
    assert all(torch.equal(means[0], m) for m in means)
    bound = {"float32": 1e-6, "bfloat16": 1e-2, "int8": 5e-2}[dtype]
    assert relative_error(means[0], torch.stack(xs).mean(0)) < bound


@pytest.mark.parametrize("dtype, ratio", [("bfloat16", 2), ("int8", 4)])
def test_exchange_bytes_shrink_with_the_wire_dtype(dtype, ratio):
    xs = payloads(2, numel=4 * 2 * INT8_BLOCK)
    sent = run_ranks(2, lambda comm: mean_over_groups(xs[comm.rank()], comm, 2, dtype)[1])
    fp32 = xs[0].numel() * 4
    scales = 4 * xs[0].numel() // INT8_BLOCK if dtype == "int8" else 0
    assert sent == [fp32 // ratio + scales] * 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_rank_sends_its_payload_one_and_a_half_times_at_four_groups(dtype):
    numel = 4 * 4 * INT8_BLOCK
    xs = payloads(4, numel=numel)
    sent = run_ranks(4, lambda comm: mean_over_groups(xs[comm.rank()], comm, 4, dtype)[1])
    payload = {"float32": 4 * numel, "bfloat16": 2 * numel, "int8": numel + 4 * numel // INT8_BLOCK}[dtype]
    assert sent == [3 * payload // 2] * 4  # a reduce-scatter and an all-gather, each 3/4 of the payload


def test_split_exchange_equals_the_unsplit_one_with_bytes_divided_by_the_replicas():
    """2 groups × 2 replicas: world rank = group × 2 + replica; replicas of a group hold the same payload."""
    xs = payloads(2, numel=999)
    split = run_split(2, 2, lambda g, fed, replicas: Exchange(fed, "float32", replicas).mean([xs[g].view(27, 37)], 2))
    unsplit = run_ranks(2, lambda comm: Exchange(comm, "float32").mean([xs[comm.rank()].view(27, 37)], 2))
    for means, sent in split:
        assert torch.equal(means[0], unsplit[0][0][0])
        assert sent * 2 == unsplit[0][1] + 4  # half the payload, padded to an even length
    assert unsplit[0][1] == 999 * 4


@pytest.fixture
def gloo_world_of_one() -> Iterator[ProcessGroupCommunicator]:
    """A real one-rank gloo process group in the test process: torch's own collectives, without launching ranks."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ProcessGroupCommunicator(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_process_group_exchange_uses_no_deprecated_collective(gloo_world_of_one, dtype):
    """The compressed exchange and the replica split through torch.distributed: values of the fake communicator's
    rule, and no FutureWarning/DeprecationWarning (torch 2.13 deprecates all_gather_into_tensor)."""
    x = payloads(1, numel=3 * INT8_BLOCK + 5)[0]
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning):
            warnings.simplefilter("error", category)
        mean, _ = Exchange(gloo_world_of_one, dtype).mean([x], 1)
        split, _ = split_mean_over_groups(x, gloo_world_of_one, gloo_world_of_one, 1, dtype)
    (expected,) = run_ranks(1, lambda comm: mean_over_groups(x, comm, 1, dtype)[0])
    assert torch.equal(mean[0], expected) and torch.equal(split, expected)


# ---- outer optimizer ----


START = torch.randn(5, generator=torch.Generator().manual_seed(1))


def outer_round(lr: float, momentum: float, rounds: int = 3) -> list[torch.Tensor]:
    """Two groups moving away from a shared start; their model after each averaging (full tensors, one process)."""
    outers = [OuterOptimizer([START], lr, momentum) for _ in range(2)]
    locals_ = [START.clone(), START.clone()]
    history = []
    for k in range(rounds):
        for g, local in enumerate(locals_):
            local.add_(torch.full_like(local, 0.1 * (g + 1) * (k + 1)))
        deltas = [outer.deltas([local])[0] for outer, local in zip(outers, locals_, strict=True)]
        mean = (deltas[0] + deltas[1]) / 2
        for outer, local in zip(outers, locals_, strict=True):
            outer.step([mean], [local])
        assert torch.equal(locals_[0], locals_[1]) and torch.equal(outers[0].anchor[0], outers[1].anchor[0])
        history.append(locals_[0].clone())
    return history


def test_pseudogradient_sign():
    """Groups that each add +c produce Δ = −c: the pseudo-gradient points against the groups' move."""
    outer = OuterOptimizer([torch.zeros(3)])
    assert torch.equal(outer.deltas([torch.full((3,), 0.25)])[0], torch.full((3,), -0.25))


def test_fedavg_outer_step_is_the_plain_average():
    history = outer_round(1.0, 0.0)
    expected = START.clone()
    for k in range(3):
        expected += 0.15 * (k + 1)  # the mean of the groups' moves, +0.1 (k+1) and +0.2 (k+1)
        torch.testing.assert_close(history[k], expected, atol=1e-6, rtol=0, msg=labelled(f"round {k}"))


def test_nesterov_with_lr_1_and_no_momentum_equals_fedavg(tmp_path):
    def history(**settings) -> list[torch.Tensor]:
        args = FedShardTrainingArguments(output_dir=str(tmp_path), report_to="none", **settings)
        return outer_round(*args.fed_averaging_options.outer)

    nesterov = history(fed_outer_optimizer="nesterov", fed_outer_lr=1.0, fed_outer_momentum=0.0)
    assert all(torch.equal(a, b) for a, b in zip(nesterov, history(), strict=True))
    assert not torch.equal(history(fed_outer_optimizer="nesterov")[-1], history()[-1])


def test_nesterov_follows_the_diloco_update():
    """anchor ← anchor − lr (g + μ b), b ← μ b + g (torch's Nesterov SGD), g = mean Δ = −(mean move)."""
    lr, mu = 0.7, 0.9
    history = outer_round(lr, mu)
    anchor = START.clone()
    buf = None
    for k in range(3):
        g = -torch.full((5,), 0.15 * (k + 1))
        buf = g.clone() if buf is None else mu * buf + g
        anchor = anchor - lr * (g + mu * buf)
        torch.testing.assert_close(history[k], anchor, atol=1e-6, rtol=0, msg=labelled(f"round {k}"))


def test_outer_state_round_trip_continues_exactly():
    tensors = [torch.randn(4)]
    a = OuterOptimizer(tensors, 0.7, 0.9)
    a.step([torch.ones(4)], tensors)
    b = OuterOptimizer([torch.zeros(4)], 0.7, 0.9)
    file = io.BytesIO()
    torch.save(a.state_dict(), file)
    file.seek(0)
    b.load_state_dict(torch.load(file, weights_only=True))
    ta, tb = [torch.zeros(4)], [torch.zeros(4)]
    a.step([torch.ones(4)], ta)
    b.step([torch.ones(4)], tb)
    assert torch.equal(ta[0], tb[0])


# ---- bad input: one line each, from the arguments (before any process group) ----


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"fed_outer_optimizer": "adam"}, "fed_outer_optimizer='adam' is unknown"),
        ({"fed_sync_dtype": "float8"}, "fed_sync_dtype='float8' is unknown"),
        ({"fed_outer_optimizer": "nesterov", "fed_outer_lr": 0.0}, "fed_outer_lr=0.0: it must be positive"),
        ({"fed_outer_optimizer": "nesterov", "fed_outer_momentum": 1.0}, r"fed_outer_momentum=1.0: it must be in"),
        ({"fed_outer_optimizer": "nesterov", "fed_outer_momentum": -0.1}, r"fed_outer_momentum=-0.1: it must be in"),
        ({"fed_outer_lr": 0.5}, "apply to fed_outer_optimizer='nesterov'"),
    ],
)
def test_bad_outer_settings_fail_with_one_line(tmp_path, settings, match):
    with pytest.raises(ConfigError, match=match) as err:
        FedShardTrainingArguments(output_dir=str(tmp_path), report_to="none", **settings)
    assert "\n" not in str(err.value)


def test_nesterov_defaults_are_dilocos(tmp_path):
    args = FedShardTrainingArguments(output_dir=str(tmp_path), report_to="none", fed_outer_optimizer="nesterov")
    assert args.fed_averaging_options.outer == (0.7, 0.9)
    fedavg = FedShardTrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert fedavg.fed_averaging_options.outer == (1.0, 0.0)

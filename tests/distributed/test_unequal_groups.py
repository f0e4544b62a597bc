"""Groups of unequal size (``--fed_group_size 2,1,1``) on gloo with real FSDP2: each group shards the model its
own way, the averaging weights each group by the samples it trained on, every group ends on the same bits, and a
checkpoint resumes exactly on its own layout.

Two 4-rank runs and three resumes: FL+FSDP (group 0 shards over 2 ranks, groups 1 and 2 hold the whole model) with
blocking fp32 FedAvg, where the rule is replayed to the bit; and the same sizes as FL+HSDP (group 0 is 2 replicas
of 1 shard) with the int8 codec, Nesterov and an overlapped exchange, checkpointed at step 3 and resumed on its own
layout, on 2 groups × 2 ranks, and from there (checkpoint-6) on groups of 2, 1 and 1 again.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ..asserts import labelled
from ..launch import train_tiny
from .test_reliability import read_dcp

pytestmark = pytest.mark.timeout(900)

SIZES = ["--fed_group_size", "2,1,1"]
WEIGHTS = {0: 2, 2: 1, 3: 1}  # one rank of each group (rank 0 for group 0): its weight, its ranks
RECORD = ["--record_syncs", "true"]
STREAMED = [*SIZES, "--fed_shard_size", "1", "--fed_sync_dtype", "int8", "--fed_outer_optimizer", "nesterov",
            "--fed_sync_overlap", "1", "--fed_sync_steps", "2", "--max_steps", "6", "--save_strategy", "steps",
            "--save_steps", "3"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    fedavg = train_tiny(4, tmp_path_factory.mktemp("fedavg"), [*SIZES, "--fed_sync_steps", "2", "--max_steps", "6",
                                                              *RECORD])  # fmt: skip
    streamed_dir = tmp_path_factory.mktemp("streamed")
    streamed = train_tiny(4, streamed_dir, [*STREAMED, *RECORD])
    resume = ["--resume_from_checkpoint", str(streamed_dir / "checkpoint-3")]
    resumed = train_tiny(4, tmp_path_factory.mktemp("resumed"), [*STREAMED, *resume])
    equal_dir = tmp_path_factory.mktemp("on_2x2")
    on_2x2 = train_tiny(4, equal_dir, [*STREAMED, *resume, "--fed_group_size", "2", "--fed_shard_size", "2",
                                       "--record_resume", "true"])  # fmt: skip
    back = ["--resume_from_checkpoint", str(equal_dir / "checkpoint-6"), "--max_steps", "8", "--record_resume", "true"]
    back_on_unequal = train_tiny(4, tmp_path_factory.mktemp("back"), [*STREAMED, *back])
    return {"fedavg": fedavg, "streamed": streamed, "streamed_dir": streamed_dir, "resumed": resumed,
            "on_2x2": on_2x2, "equal_dir": equal_dir, "back_on_unequal": back_on_unequal}  # fmt: skip


def test_each_group_shards_the_model_its_own_way(runs):
    assert [rank["mesh_shape"] for rank in runs["fedavg"]] == [[2], [2], [1], [1]]
    assert [rank["placements"] for rank in runs["streamed"]] == [["R", "S(0)"]] * 2 + [["S(0)"]] * 2


def test_fedavg_weights_each_group_by_its_samples_to_the_bit(runs):
    """anchor − Σ_g w_g (anchor − model_g) / Σ w_g with w = (2, 1, 1), replayed on the recorded whole models; the
    unweighted mean is shown to differ, so the test tells the two rules apart."""
    run = runs["fedavg"]
    anchor = dict(run[0]["start_params"])
    assert all(torch.equal(anchor[n], run[r]["start_params"][n]) for r in WEIGHTS for n in anchor)
    steps = sorted(run[0]["sync_params"])
    assert steps == [2, 4, 6]
    for step in steps:
        before = {r: run[r]["sync_params"][step][0] for r in WEIGHTS}
        after = run[0]["sync_params"][step][1]
        unweighted_gap = 0.0
        for name, a in anchor.items():
            weighted = a - sum(w * (a - before[r][name]) for r, w in WEIGHTS.items()) / 4
            assert torch.equal(after[name], weighted), labelled(f"{name} at step {step}")
            unweighted = a - sum(a - before[r][name] for r in WEIGHTS) / 3
            unweighted_gap = max(unweighted_gap, (after[name] - unweighted).abs().max().item())
        assert unweighted_gap > 1e-5
        for rank in range(1, 4):
            other = run[rank]["sync_params"][step][1]
            assert all(torch.equal(after[n], other[n]) for n in after), f"rank {rank} at step {step}"
        anchor = after


def test_every_rank_reads_its_own_samples(runs):
    """64 samples, 8 a step (2 per rank, whatever its group's size), 6 steps: 48 samples, none read twice."""
    seen = Counter(i for rank in runs["fedavg"] for i in rank["seen"])
    assert [len(rank["seen"]) for rank in runs["fedavg"]] == [12] * 4
    assert len(seen) == 48 and set(seen.values()) == {1}


def test_each_group_sends_the_model_once_per_averaging_whatever_its_size(runs):
    sent = [rank["fed_counters"]["inter_group_bytes"] for rank in runs["fedavg"]]
    assert sent[0] + sent[1] == sent[2] == sent[3] > 0


def test_streamed_int8_groups_end_on_the_same_bits_near_the_weighted_mean(runs):
    run = runs["streamed"]
    final = run[0]["full_params"]
    for rank in range(1, 4):
        assert all(torch.equal(final[n], run[rank]["full_params"][n]) for n in final), f"rank {rank}"
    # the last averaging (step 6, blocking at the end): the int8 mean Δ against the fp32 weighted mean of the Δ
    deltas = {r: run[r]["sync_exchanges"][6][0] for r in WEIGHTS}
    got = run[0]["sync_exchanges"][6][1]
    errors, norms = 0.0, 0.0
    for i, mean in enumerate(got):
        exact = sum(w * deltas[r][i] for r, w in WEIGHTS.items()) / 4
        errors += (mean - exact).double().square().sum().item()
        norms += exact.double().square().sum().item()
    assert 0 < (errors / norms) ** 0.5 < 5e-2


def test_a_checkpoint_of_unequal_groups_resumes_exactly(runs):
    for rank, (whole, resumed) in enumerate(zip(runs["streamed"], runs["resumed"], strict=True)):
        for name, value in whole["full_params"].items():
            assert torch.equal(resumed["full_params"][name], value), labelled(f"rank {rank}: {name}")
        assert resumed["eval"]["eval_loss"] == whole["eval"]["eval_loss"]


def test_a_checkpoint_between_averagings_resumes_on_equal_groups_from_the_weighted_mean(runs, tmp_path):
    """checkpoint-3 (an overlapped exchange applied at step 3 kept each group's progress: the groups differ) on
    2 × 2: the model is Σ_g w_g · model_g / Σ w_g in fp32, group order, w = (2, 1, 1)."""
    checkpoint = runs["streamed_dir"] / "checkpoint-3"
    models = [read_dcp(checkpoint / f"fed_group{g}" / "model", tmp_path)["model"] for g in range(3)]
    for rank in runs["on_2x2"]:
        assert rank["resumed"]["step"] == 3
        for name, value in rank["resumed"]["params"].items():
            total = models[0][name].float().clone().mul_(2)
            for model in models[1:]:
                total.add_(model[name].float())
            assert torch.equal(value, total.div_(4)), name
    assert not torch.equal(models[0]["model.norm.weight"], models[1]["model.norm.weight"])  # a real mean


def test_a_checkpoint_of_equal_groups_resumes_on_unequal_ones(runs, tmp_path):
    """checkpoint-6 of 2 × 2 (written at an averaging: every group holds the global model) on 2, 1, 1: every group
    starts from that model, bit for bit, and trains on to step 8."""
    model = read_dcp(runs["equal_dir"] / "checkpoint-6" / "fed_group0" / "model", tmp_path)["model"]
    for rank in runs["back_on_unequal"]:
        assert rank["resumed"]["step"] == 6
        assert all(torch.equal(value, model[name]) for name, value in rank["resumed"]["params"].items())
    final = runs["back_on_unequal"][0]["full_params"]
    assert all(torch.equal(final[n], runs["back_on_unequal"][3]["full_params"][n]) for n in final)

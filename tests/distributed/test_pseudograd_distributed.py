"""Multi-process checks of averaging on pseudo-gradients (gloo, real FSDP2): the outer optimizer against a
one-process reference, compressed payloads on real training deltas, FL+HSDP's split exchange, evaluations that
change nothing, and exact resume with an anchor and outer momentum.

Eight short runs, each reused by several checks: 4 ranks where the layout matters (2 groups × 2 shards for
FL+FSDP; 2 groups × 2 replicas × 1 shard, the smallest FL+HSDP), 2 groups of 1 rank where only the averaging does.
"""

from __future__ import annotations

import pytest
import torch

from hf_fedshard.engine.codec import INT8_BLOCK

from ..asserts import labelled
from ..launch import train_tiny
from .test_reliability import ADAMW, assert_same_run

pytestmark = pytest.mark.timeout(900)

FL_FSDP = ["--fed_group_size", "2"]
FL_HSDP = ["--fed_group_size", "2", "--fed_shard_size", "1"]
TWO_RANKS = ["--fed_group_size", "1"]  # 2 groups of 1 rank
NESTEROV = ["--fed_outer_optimizer", "nesterov"]
EVALS = ["--eval_strategy", "steps", "--eval_steps", "3"]
RECORD = ["--record_syncs", "true"]
# Nesterov on FL+FSDP, H=4, 12 steps, AdamW: checkpoint-6 falls between the averagings of steps 4 and 8.
NESTEROV_RUN = [*FL_FSDP, *NESTEROV, "--fed_sync_steps", "4", "--max_steps", "12", "--save_strategy", "steps",
                "--save_steps", "6", *ADAMW]  # fmt: skip
INT8_RUN = [*TWO_RANKS, *NESTEROV, "--fed_sync_dtype", "int8", "--fed_sync_steps", "2", "--max_steps", "6", *RECORD]
FEDAVG_BF16_RUN = [*TWO_RANKS, "--fed_sync_dtype", "bfloat16", "--fed_sync_steps", "4", "--max_steps", "8"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    def run(name: str, nproc: int, *args) -> list[dict]:
        return train_tiny(nproc, tmp_path_factory.mktemp(name), list(args))

    hsdp = [*FL_HSDP, *NESTEROV, "--fed_sync_steps", "2", "--max_steps", "6", *RECORD]
    out = {
        "nesterov_evals": run("nesterov_evals", 4, *NESTEROV_RUN, *EVALS, *RECORD),
        "hsdp_split": run("hsdp_split", 4, *hsdp),
        "hsdp_unsplit": run("hsdp_unsplit", 4, *hsdp, "--fed_split_exchange", "false"),
        "fedavg_evals": run("fedavg_evals", 2, *FEDAVG_BF16_RUN, *EVALS, *RECORD),
        "fedavg": run("fedavg", 2, *FEDAVG_BF16_RUN),
        "int8": run("int8", 2, *INT8_RUN),
    }
    nesterov = tmp_path_factory.mktemp("nesterov")
    out["nesterov"] = train_tiny(4, nesterov, NESTEROV_RUN)
    resume = ["--resume_from_checkpoint", nesterov / "checkpoint-6"]
    out["nesterov_resumed"] = run("nesterov_resumed", 4, *NESTEROV_RUN, *resume)
    return out


def peer(run: list[dict]) -> int:
    """The rank of rank 0's peer in group 1 (the same position): the group size."""
    return len(run) // 2


def outer_reference(run: list[dict], lr: float = 0.7, momentum: float = 0.9) -> None:
    """Replay the averagings on full tensors in this process (group g's model before each averaging, recorded)."""
    start = run[0]["start_params"]
    assert all(torch.equal(start[n], run[peer(run)]["start_params"][n]) for n in start)  # one model at step 0
    anchor = {n: t.clone() for n, t in start.items()}
    outer = torch.optim.SGD(list(anchor.values()), lr=lr, momentum=momentum, nesterov=True)
    steps = sorted(run[0]["sync_params"])
    assert len(steps) >= 3
    for step in steps:
        before = [run[rank]["sync_params"][step][0] for rank in (0, peer(run))]
        for name, a in anchor.items():
            a.grad = sum(a - group[name] for group in before) / 2
        outer.step()
        after = run[0]["sync_params"][step][1]
        for name, a in anchor.items():
            torch.testing.assert_close(after[name], a, atol=1e-6, rtol=0, msg=labelled(f"{name} at step {step}"))


def test_nesterov_equals_a_one_process_reference_on_fl_fsdp(runs):
    outer_reference(runs["nesterov_evals"])


def test_nesterov_equals_a_one_process_reference_on_fl_hsdp(runs):
    outer_reference(runs["hsdp_split"])


@pytest.mark.parametrize("name", ["nesterov_evals", "hsdp_split", "fedavg_evals", "int8"])
def test_groups_are_bit_identical_after_every_averaging(runs, name):
    run = runs[name]
    for step, (_, after) in run[0]["sync_params"].items():
        assert all(torch.equal(after[n], run[peer(run)]["sync_params"][step][1][n]) for n in after), step


@pytest.mark.parametrize("optimizer", ["nesterov", "fedavg"])
def test_evaluations_between_averagings_change_nothing(runs, optimizer):
    """Evaluations every 3 steps at H=4 (steps 3, 6, 9 fall between averagings): the same final parameters."""
    with_evals, without = runs[f"{optimizer}_evals"], runs[optimizer]
    assert [h["step"] for h in with_evals[0]["log_history"] if "eval_loss" in h][:2] == [3, 6]
    for rank, reference in enumerate(without):
        for name, value in reference["full_params"].items():
            assert torch.equal(with_evals[rank]["full_params"][name], value), name


def test_delta_norm_and_group_drift_are_logged(runs):
    logs = [h for h in runs["nesterov"][0]["log_history"] if "fed_delta_norm" in h]
    assert logs[-1]["fed_delta_norm"] > 0 and logs[-1]["fed_group_drift"] > 0
    assert len({h["fed_delta_norm"] for h in logs if h["fed_syncs"] >= 2}) >= 2  # one value per averaging


def mean_delta_error(run: list[dict]) -> float:
    """Relative error of the decoded mean Δ against the fp32 mean of the groups' Δ, over the whole model."""
    errors, norms = 0.0, 0.0
    for position in range(peer(run)):  # each shard position: rank p and its peer p + group size
        for step, (deltas, decoded) in run[position]["sync_exchanges"].items():
            theirs = run[position + peer(run)]["sync_exchanges"][step][0]
            for mine, other, got in zip(deltas, theirs, decoded, strict=True):
                exact = (mine + other) / 2
                errors += (got - exact).double().square().sum().item()
                norms += exact.double().square().sum().item()
    return (errors / norms) ** 0.5


@pytest.mark.parametrize("name, bound", [("fedavg_evals", 1e-2), ("int8", 5e-2)])
def test_compressed_mean_delta_is_close_to_fp32_on_real_deltas(runs, name, bound):
    assert 0 < mean_delta_error(runs[name]) < bound


def payload_bytes_per_averaging(rank: dict) -> tuple[int, float]:
    """(fp32 bytes of this rank's trainable shards, bytes it sent per scheduled averaging)."""
    numel = sum(t.numel() for t in rank["local_params"].values())
    last = [h for h in rank["log_history"] if "fed_syncs" in h][-1]
    first = 4 * numel  # step 0's averaging of the initial weights, in fp32
    return 4 * numel, (last["fed_inter_group_bytes"] - first) / (last["fed_syncs"] - 1)


def test_bf16_sends_half_and_int8_about_a_quarter(runs):
    for rank in runs["fedavg"]:  # bf16, no evaluation (whose temporary average is fp32)
        fp32, sent = payload_bytes_per_averaging(rank)
        assert sent == fp32 / 2 + 2 * (fp32 // 4 % 2)  # padded to a multiple of the 2 groups
    for rank in runs["int8"]:
        fp32, sent = payload_bytes_per_averaging(rank)
        padded = -(-fp32 // 4 // (2 * INT8_BLOCK)) * 2 * INT8_BLOCK
        assert sent == padded + 4 * padded // INT8_BLOCK  # int8 values + one fp32 scale per block
        assert 0.25 < sent / fp32 < 0.27


def test_hsdp_split_exchange_equals_the_unsplit_one_with_half_the_bytes(runs):
    split, unsplit = runs["hsdp_split"], runs["hsdp_unsplit"]
    for rank in range(4):
        for name, value in unsplit[rank]["full_params"].items():
            assert torch.equal(split[rank]["full_params"][name], value), name
        fp32, sent_split = payload_bytes_per_averaging(split[rank])
        _, sent_unsplit = payload_bytes_per_averaging(unsplit[rank])
        assert sent_unsplit == fp32
        assert sent_split == fp32 / 2 + 2 * (fp32 // 4 % 2)  # Q = 2 replicas; padded to an even length


def test_nesterov_resumes_exactly_between_averagings(runs):
    """From checkpoint-6 (averaged at 4, next at 8): the anchor, the outer momentum and every group's own model."""
    resumed = runs["nesterov_resumed"]
    assert [rank["started_at_step"] for rank in resumed] == [6] * 4
    assert_same_run(resumed, runs["nesterov"])

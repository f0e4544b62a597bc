"""Multi-process checks of streaming averaging (gloo, real FSDP2): fragments and overlap against a one-process
reference of the rule on full tensors, evaluations inside an exchange's window that change nothing, and exact
resume from a checkpoint taken while an exchange was in flight.

Four short runs: FL+FSDP 2 groups × 2 shards, nesterov, H=4, F=2, τ=1, 12 steps (fragment 0 starts at 2, 6, 10
and applies at 3, 7, 11; fragment 1 starts at 4, 8 and applies at 5, 9; both average, blocking, at the end) with
evaluations every 3 steps and a checkpoint at step 6, where fragment 0's exchange is in flight; the same
without evaluations; the resume from checkpoint-6; and 2 groups of 1 rank with F=2, τ=0 (blocking fragments).
"""

from __future__ import annotations

import pytest
import torch

from ..asserts import labelled
from ..launch import train_tiny
from .test_pseudograd_distributed import peer
from .test_reliability import ADAMW, assert_same_run

pytestmark = pytest.mark.timeout(900)

STREAM = ["--fed_group_size", "2", "--fed_outer_optimizer", "nesterov", "--fed_sync_steps", "4",
          "--fed_sync_fragments", "2", "--fed_sync_overlap", "1", "--max_steps", "12", *ADAMW]  # fmt: skip
SAVES = ["--save_strategy", "steps", "--save_steps", "6"]
EVALS = ["--eval_strategy", "steps", "--eval_steps", "3"]
RECORD = ["--record_syncs", "true"]
BLOCKING_FRAGMENTS = ["--fed_group_size", "1", "--fed_sync_steps", "4", "--fed_sync_fragments", "2",
                      "--max_steps", "8", *RECORD]  # fmt: skip


class Runs:
    """The runs of this module, each made the first time a test asks for it (so ``-k`` runs only what it needs)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory, self.done = factory, {}

    def __getitem__(self, name: str) -> list[dict]:
        if name not in self.done:
            self.done[name] = getattr(self, f"_{name}")()
        return self.done[name]

    def _stream(self) -> list[dict]:
        self.stream_dir = self.factory.mktemp("stream")
        return train_tiny(4, self.stream_dir, [*STREAM, *SAVES, *EVALS, *RECORD])

    def _resumed(self) -> list[dict]:
        self["stream"]
        resume = ["--resume_from_checkpoint", self.stream_dir / "checkpoint-6"]
        return train_tiny(4, self.factory.mktemp("resumed"), [*STREAM, *SAVES, *EVALS, *resume])

    def _no_evals(self) -> list[dict]:
        return train_tiny(4, self.factory.mktemp("no_evals"), STREAM)

    def _blocking_fragments(self) -> list[dict]:
        return train_tiny(2, self.factory.mktemp("blocking"), BLOCKING_FRAGMENTS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory)


def _outer(anchor: dict[str, torch.Tensor], lr: float, momentum: float) -> torch.optim.SGD:
    return torch.optim.SGD(list(anchor.values()), lr=lr, momentum=momentum, nesterov=momentum > 0)


def streaming_reference(run: list[dict], lr: float, momentum: float, atol: float = 1e-6) -> int:
    """Replay every averaging of a 2-group run on full tensors in this process; returns how many were checked.

    Blocking (τ = 0 or the end): anchor ← SGD(mean_g (anchor − before_g)); every group's fragment = anchor.
    Overlapped: Δ_g = anchor − snapshot_g at the start; at the apply, anchor ← SGD(mean Δ) and group g's
    fragment = anchor + (before_g − snapshot_g); the other fragments are left as they were.
    """
    groups = (run[0], run[peer(run)])
    names = groups[0]["fragment_names"]
    start = groups[0]["start_params"]
    anchors = [{n: start[n].clone() for n in fragment} for fragment in names]
    outers = [_outer(anchor, lr, momentum) for anchor in anchors]
    events = [(step, 0, "apply") for step in groups[0]["exchange_applies"]]
    events += [(step, 1, "sync") for step in groups[0]["sync_params"]]
    checked = 0
    for step, _, kind in sorted(events):
        if kind == "apply":
            fragment, started, _, _ = groups[0]["exchange_applies"][step]
            snapshots = [g["exchange_starts"][started][1] for g in groups]
            befores = [g["exchange_applies"][step][2] for g in groups]
            afters = [g["exchange_applies"][step][3] for g in groups]
            steps = [(fragment, snapshots, [dict(b) for b in befores])]
        else:
            befores = [g["sync_params"][step][0] for g in groups]
            afters = [g["sync_params"][step][1] for g in groups]
            steps = [(f, befores, None) for f in groups[0]["sync_fragments"][step]]
        expected = [dict(b) for b in befores]
        for fragment, taken_from, progress in steps:
            for name, a in anchors[fragment].items():
                a.grad = sum(a - g[name] for g in taken_from) / len(groups)
            outers[fragment].step()
            for g, exp in enumerate(expected):
                for name, a in anchors[fragment].items():
                    exp[name] = a.clone() if progress is None else a + (progress[g][name] - taken_from[g][name])
        for g in range(len(groups)):
            for name, value in expected[g].items():
                torch.testing.assert_close(
                    afters[g][name], value, atol=atol, rtol=0, msg=labelled(f"group {g}, {name}, step {step}")
                )
        checked += len(steps)
    return checked


def test_overlapped_fragments_equal_a_one_process_reference(runs):
    run = runs["stream"]
    assert sorted(run[0]["exchange_applies"]) == [3, 5, 7, 9, 11]
    assert [run[0]["exchange_applies"][s][:2] for s in (3, 5, 7, 9, 11)] == [(0, 2), (1, 4), (0, 6), (1, 8), (0, 10)]
    assert run[0]["sync_fragments"] == {12: [0, 1]}  # the end: every fragment, blocking
    assert streaming_reference(run, lr=0.7, momentum=0.9) == 5 + 2


def test_blocking_fragments_equal_a_one_process_reference(runs):
    run = runs["blocking_fragments"]
    assert run[0]["sync_fragments"] == {2: [0], 4: [1], 6: [0], 8: [0, 1]}  # the end: fragment 0 is stale too
    assert run[0]["exchange_applies"] == {}
    assert streaming_reference(run, lr=1.0, momentum=0.0) == 5


def test_fragments_are_whole_units_and_cover_the_model(runs):
    names = runs["stream"][0]["fragment_names"]
    assert len(names) == 2 and all(names)
    layers = [{n.split(".")[2] for n in fragment if ".layers." in n} for fragment in names]
    assert not layers[0] & layers[1]  # a decoder layer (an FSDP unit) is never split
    assert sorted(n for f in names for n in f) == sorted(runs["stream"][0]["full_params"])


def test_groups_are_identical_at_the_end(runs):
    run = runs["stream"]
    for name, value in run[0]["full_params"].items():
        assert torch.equal(value, run[peer(run)]["full_params"][name]), name


def test_evaluations_inside_an_exchange_window_change_nothing(runs):
    """Evaluations at 3, 6, 9 (at 6 fragment 0's exchange is in flight): the same final parameters as without."""
    with_evals, without = runs["stream"], runs["no_evals"]
    assert [h["step"] for h in with_evals[0]["log_history"] if "eval_loss" in h][:3] == [3, 6, 9]
    for rank, reference in enumerate(without):
        for name, value in reference["full_params"].items():
            assert torch.equal(with_evals[rank]["full_params"][name], value), name


def test_resume_with_an_exchange_in_flight_is_exact(runs):
    resumed = runs["resumed"]
    assert [rank["started_at_step"] for rank in resumed] == [6] * 4
    assert_same_run(resumed, runs["stream"])


def test_overlap_logs_the_time_the_loop_waited(runs):
    last = [h for h in runs["no_evals"][0]["log_history"] if "fed_sync_wait_seconds_total" in h][-1]
    assert last["fed_sync_wait_seconds_total"] >= 0 and last["fed_syncs"] == 1 + 5 + 1

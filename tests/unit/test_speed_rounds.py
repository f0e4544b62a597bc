"""Speed-aware rounds (``fed_round_policy speed``, `hf_fedshard.engine.speed`) in one process: three groups on fake
communicators with fake clocks (group g's step costs 1, 2, 4 seconds), against a reference of the rule on full
tensors: which steps each group trains, the samples-weighted mean of Δ over the contributing groups, exact to the
bit; the plan a checkpoint and a heal restore; the rule's rounding and bounds; the settings' errors.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hf_fedshard import FederatedAverager, notices
from hf_fedshard.engine.options import AveragingOptions
from hf_fedshard.engine.speed import RoundPlan, RoundReport, RoundSpeeds, next_round_steps
from hf_fedshard.errors import ConfigError

from ..fake_communicator import run_federation
from ..tiny_federation import GROUPS, Reference, build, poison, train_step
from .test_arguments import parse

COST = (1.0, 2.0, 4.0)  # seconds per trained step of each group: H_g = 4, 2, 1 once measured


def test_the_rule_rounds_half_up_within_the_bounds_and_plans_all_h_where_unmeasured():
    assert next_round_steps(8, 1, [0.1, 0.2, 0.4, 0.0]) == [8, 4, 2, 8]
    assert next_round_steps(8, 1, [1.0, 3.0, 1.6, 100.0]) == [8, 3, 5, 1]  # 2.67 → 3, 5.0 → 5, 0.08 → the minimum
    assert next_round_steps(8, 3, [1.0, 100.0]) == [8, 3]
    assert next_round_steps(5, 1, [1.0, 2.0]) == [5, 3]  # 2.5 rounds up (Python's round() would give 2)
    assert next_round_steps(8, 1, [0.0, 0.0]) == [8, 8]


def test_a_groups_speed_is_the_median_of_its_trained_steps_over_two_rounds():
    """H = 4: round 1 trains 4 steps of 1 s; round 2 (planned 2 steps) 3 s each, then 2 passed over in 0 s; round 3
    one step of 3 s and one of 9 s: τ = median(1, 1, 1, 1) = 1, median(1, 1, 1, 1, 3, 3) = 1, then median(3, 3, 3, 9)
    = 3 (round 1 left the window); the steps a group passes over are not measured."""
    now = [0.0]
    plan = RoundPlan(4, 1, clock=lambda: now[0])
    reported = []
    for step, (seconds, steps_next) in enumerate([(1, 0), (1, 0), (1, 0), (1, 2), (3, 0), (3, 0), (0, 0), (0, 2),
                                                  (3, 0), (9, 0)], start=1):  # fmt: skip
        plan.restart_clock()
        now[0] += seconds
        plan.stepped(step)
        if steps_next or step == 10:
            reported.append(plan.report(step))
            plan.next_round(RoundSpeeds([4.0], [1.0]), 0)
            plan.steps = steps_next or plan.steps
    assert reported == [RoundReport(4, 1.0), RoundReport(2, 1.0), RoundReport(2, 3.0)]


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"round_policy": "fastest"}, "fed_round_policy='fastest' is unknown. Set --fed_round_policy to one of steps"),
        ({"round_policy": "speed", "min_round_steps": 9}, "fed_min_round_steps=9 must be in [1, fed_sync_steps=8]"),
        ({"round_policy": "speed", "sync_fragments": 2}, "fed_round_policy speed plans whole rounds, which fed_sync"),
        ({"round_policy": "speed", "sync_overlap": 2}, "fed_min_round_steps=1 is below fed_sync_overlap=2"),
    ],
)
def test_bad_round_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError) as err:
        AveragingOptions(sync_steps=8, **settings)
    assert message in str(err.value) and "\n" not in str(err.value)


class SpeedReference(Reference):
    """`Reference`'s rule with speed-aware rounds: group g trains the first H_g steps of a round; the mean of Δ is
    Σ s_g Δ_g / Σ s_g over the contributing groups; H_g' = clamp(⌊H · τ_min / τ_g + ½⌋, 1, H) with τ_g = COST[g]."""

    def __init__(self, overlap: int = 0) -> None:
        super().__init__(sync_steps=4)
        self.tau = overlap
        self.plan = [4] * GROUPS
        self.trained: list[list[int]] = [[] for _ in range(GROUPS)]  # the steps each group trained
        self.begun: tuple | None = None  # an overlapped averaging: (apply step, snapshots, means, diverged, buffer)

    def run(self, steps: int, nan_at: tuple[int, int] | None = None) -> list[list[torch.Tensor]]:
        """With overlap τ the averaging begun at the end of a round (Δ of its snapshot) is applied τ steps later,
        each group keeping its progress since; the next round's plan is the one agreed then (its first τ steps are
        trained under any plan)."""
        for step in range(1, steps + 1):
            position = (step - 1) % 4
            for g in range(GROUPS):
                if position < self.plan[g]:
                    train_step(self.models[g], self.optimizers[g], g, step)
                    self.trained[g].append(step)
                if nan_at == (g, step):
                    poison(self.models[g])
            if self.begun is not None and (self.begun[0] == step or step == steps):
                self.land()
            if step % 4 == 0 or step == steps:
                self.begin([min(self.plan[g], position + 1) for g in range(GROUPS)], step, 0 if step == steps else 1)
        return [[t.detach().clone() for t in self.state(g)] for g in range(GROUPS)]

    @torch.no_grad()
    def begin(self, trained: list[int], step: int, later: int) -> None:
        diverged = self.diverged()
        weight = sum(float(s) for g, s in enumerate(trained) if g not in diverged)
        snapshots = [[p.float().clone() for p in self.params(g)] for g in range(GROUPS)]
        deltas = [[self.deltas(g, i, snapshots[g][i], diverged) * float(trained[g]) for g in range(GROUPS)]
                  for i in range(4)]  # fmt: skip
        means = [(d[0] + d[1] + d[2]) / weight for d in deltas]
        stats = [torch.zeros(2) if g in diverged else self.models[g].stat for g in range(GROUPS)]
        buffer = (stats[0] + stats[1] + stats[2]) / (GROUPS - len(diverged))  # buffers: the plain mean
        self.begun = (step + self.tau * later, snapshots if self.tau * later else None, means, diverged, buffer)
        if not self.tau * later:
            self.land()

    @torch.no_grad()
    def land(self) -> None:
        _, snapshots, means, diverged, buffer = self.begun
        self.begun = None
        for i in range(4):
            self.outer_step(i, means[i])
            for g in range(GROUPS):
                local = self.params(g)[i]
                kept = snapshots is not None and g not in diverged
                local.copy_(self.anchor[i] + (local.float() - snapshots[g][i]) if kept else self.anchor[i])
        for g in range(GROUPS):
            self.models[g].stat.copy_(buffer)
        self.restart(diverged, keep=[0])
        self.plan = [max(1, min(4, int(4 * min(COST) / c + 0.5))) for c in COST]


def speed_run(steps: int, nan_at: tuple[int, int] | None = None, pieces: bool = False, overlap: int = 0) -> list:
    """Every group's state at the end, the steps it trained, its averager; a trained step costs COST[g] seconds."""

    def rank_fn(comm):
        group = comm.group
        now = [0.0]
        model, optimizer = build(group)
        averager = FederatedAverager(
            model,
            optimizer,
            communicator=comm,
            sync_steps=4,
            round_policy="speed",
            clock=lambda: now[0],
            sync_overlap=overlap,
        )
        trained = []
        for step in range(1, steps + 1):
            if averager.should_train:
                train_step(model, optimizer, group, step)
                now[0] += COST[group]
                trained.append(step)
            if nan_at == (group, step):
                poison(model)
            averager.step(last=step == steps)
        return [t.detach().clone() for t in (*model.parameters(), model.stat)], trained, averager

    return run_federation(GROUPS, rank_fn, pieces=pieces)


@pytest.mark.parametrize("pieces", [False, True], ids=["peers", "pieces"])
@pytest.mark.parametrize("nan_at", [None, (1, 6)], ids=["finite", "group1-nan"])
def test_each_group_trains_its_planned_steps_and_the_mean_is_weighted_by_them(pieces, nan_at):
    """14 steps, H = 4: round 1 every group trains 4 steps (no measurement yet), then 4, 2, 1 of each round (the
    last round, steps 13–14, ends early: 2, 2, 1); the mean is Σ s_g Δ_g / Σ s_g, bit for bit; a group with a NaN
    (group 1 at step 6) sends nothing and Σ leaves it out."""
    reference = SpeedReference()
    want = reference.run(14, nan_at)
    got = speed_run(14, nan_at, pieces)
    assert reference.trained == [
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
        [1, 2, 3, 4, 5, 6, 9, 10, 13, 14],
        [1, 2, 3, 4, 5, 9, 13],
    ]
    for g, (state, trained, averager) in enumerate(got):
        assert trained == reference.trained[g], f"group {g}"
        for i, (tensor, expected) in enumerate(zip(state, want[g], strict=True)):
            assert torch.equal(tensor, expected), f"group {g} tensor {i}: {(tensor - expected).abs().max()}"
        assert averager.metrics()["fed_round_steps"] == [2, 2, 1][g]  # the last round's trained steps


def test_with_overlap_each_group_trains_a_prefix_and_the_exchange_still_overlaps():
    """τ = 1: each round's averaging begins at its last step and is applied one step into the next round, whose plan
    (4, 2, 1 once measured) is agreed then; its first step is trained under any plan (fed_min_round_steps ≥ τ).
    Bit for bit against the rule; the exchange ran on the worker thread (the apply came a step after the begin)."""
    reference = SpeedReference(overlap=1)
    want = reference.run(14)
    got = speed_run(14, overlap=1)
    assert reference.trained[1:] == [[1, 2, 3, 4, 5, 6, 9, 10, 13, 14], [1, 2, 3, 4, 5, 9, 13]]
    for g, (state, trained, averager) in enumerate(got):
        assert trained == reference.trained[g], f"group {g}"
        for i, (tensor, expected) in enumerate(zip(state, want[g], strict=True)):
            assert torch.equal(tensor, expected), f"group {g} tensor {i}: {(tensor - expected).abs().max()}"
        assert averager.metrics()["fed_round_steps"] == [2, 2, 1][g]


def test_a_checkpoint_keeps_the_rounds_plan_and_a_heal_forgets_it():
    """A checkpoint at step 6 (round 2: the plan 4, 2, 1) resumes the same plan; a group that heals from a peer
    takes the peer's model and counts but trains all H until its own speed is measured."""

    def rank_fn(comm):
        now = [0.0]
        model, optimizer = build(comm.group)
        averager = FederatedAverager(
            model, optimizer, communicator=comm, sync_steps=4, round_policy="speed", clock=lambda: now[0]
        )
        for _ in range(6):
            now[0] += COST[comm.group] if averager.should_train else 0.0
            averager.step()
        state = averager.state_dict()
        resumed = FederatedAverager(
            model, optimizer, communicator=comm, sync_steps=4, round_policy="speed", average_initial_weights=False
        )
        resumed.load_state_dict(state)
        plan = resumed.should_train, resumed.rounds.steps
        resumed.load_peer_state(averager.peer_state())
        return state["counters"]["round_steps_planned"], plan, resumed.rounds.steps

    results = run_federation(GROUPS, rank_fn)
    assert [saved for saved, _, _ in results] == [4, 2, 1]
    assert [plan for _, plan, _ in results] == [(True, 4), (False, 2), (False, 1)]  # step 7: position 2
    assert [healed for _, _, healed in results] == [4, 4, 4]


def test_the_settings_parse_and_a_log_that_would_pace_the_groups_is_named(
    tmp_path, world4_no_setup, caplog, monkeypatch
):
    """From the command line to the engine's options; in one job a loss log between averagings (an all-gather over
    every group) is named with its fix, once, and a log on averaging steps is not."""
    monkeypatch.setattr(notices, "_said", set())
    caplog.set_level(logging.WARNING, logger="hf_fedshard")
    args = parse(tmp_path, "--fed_group_size", "2", "--fed_sync_steps", "4", "--fed_round_policy", "speed",
                 "--fed_min_round_steps", "2", "--logging_steps", "3")  # fmt: skip
    assert (args.fed_averaging_options.round_policy, args.fed_averaging_options.min_round_steps) == ("speed", 2)
    said = [r.getMessage() for r in caplog.records if "fed_round_policy speed" in r.getMessage()]
    assert said == [
        "hf_fedshard: fed_round_policy speed: logging_steps=3 is not a multiple of fed_sync_steps=4, and Trainer's "
        "loss log gathers over every group, so the faster groups wait for the slowest at each log. Set "
        "--logging_steps to a multiple of 4."
    ]
    caplog.clear()
    parse(tmp_path, "--fed_group_size", "2", "--fed_sync_steps", "4", "--fed_round_policy", "speed",
          "--logging_steps", "8")  # fmt: skip
    assert not [r for r in caplog.records if "fed_round_policy speed" in r.getMessage()]

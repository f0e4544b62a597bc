"""``fed_delta_norm`` and ``fed_group_drift`` of an averaging that left a diverged group out, in one process, against
the rule on full tensors written here.

The rule (`hf_fedshard.engine.control`): with Δ_g = anchor − group g's model and mean Δ = Σ w_g Δ_g / W over the
groups that contributed (a group holding a NaN/Inf sends zeros and is left out of W),

    fed_delta_norm  = ‖mean Δ‖                                        over the whole model
    fed_group_drift = (1 / C) · Σ_{g contributing} ‖Δ_g − mean Δ‖ / ‖mean Δ‖    C: how many groups contributed

and both are published one averaging late: step 4's values appear at step 8's control all-reduce, or at ``finish``
(the last step) when the run ends on step 4.

Why this file: where every group contributes, dividing by all groups or by the contributing ones is the same number,
and the NaN test of tests/unit/test_engine.py reads the norms only at the end of 8 steps, after step 8's averaging
(every group contributing) has replaced step 4's. Here the norms of step 4's averaging, with group 1 (or 2) left
out, are read where they are published, on equal groups, on the exchange of unequal groups with groups of one rank,
and on groups of unequal size (weights 2, 1, 1; drift still a plain mean over the contributing groups).
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from hf_fedshard import FederatedAverager
from hf_fedshard.engine import FederationCommunicator
from hf_fedshard.engine.pieces import GroupShape

from ..fake_communicator import BARRIER_TIMEOUT_S, FakeCommunicator, run_federation, run_ranks
from ..tiny_federation import build, poison, train_step

OPTIONS = [pytest.param({}, id="blocking"), pytest.param({"sync_overlap": 1}, id="overlap")]


@torch.no_grad()
def reference_norms(weights: list[int], diverged: int, steps: int = 4, nan_step: int = 3) -> tuple[float, float]:
    """(‖mean Δ‖, drift) of the averaging at ``steps`` on full tensors: every group starts from the weighted plain
    mean (step 0's), trains ``steps`` steps, group ``diverged`` gets a NaN at ``nan_step`` and is left out."""
    models = [build(g) for g in range(len(weights))]
    params = [list(model.parameters()) for model, _ in models]
    anchor = []
    for tensors in zip(*params, strict=True):
        total = torch.zeros_like(tensors[0])
        for w, t in zip(weights, tensors, strict=True):
            total += w * t
        anchor.append(total / sum(weights))
    for group_params in params:
        for p, a in zip(group_params, anchor, strict=True):
            p.copy_(a)
    for step in range(1, steps + 1):
        for g, (model, optimizer) in enumerate(models):
            train_step(model, optimizer, g, step)
            if (g, step) == (diverged, nan_step):
                poison(model)
    contributing = [g for g in range(len(weights)) if g != diverged]
    deltas = {g: [a - p for a, p in zip(anchor, params[g], strict=True)] for g in contributing}
    total_weight = sum(weights[g] for g in contributing)
    mean = [sum(weights[g] * deltas[g][i] for g in contributing) / total_weight for i in range(len(anchor))]
    norm = math.sqrt(sum(m.double().square().sum().item() for m in mean))
    drifts = [
        math.sqrt(sum((d - m).double().square().sum().item() for d, m in zip(deltas[g], mean, strict=True)))
        for g in contributing
    ]
    return norm, sum(drifts) / len(contributing) / norm


def train(comm: FederationCommunicator, group: int, steps: int, last: bool, **options) -> list[tuple[float, float]]:
    """(fed_delta_norm, fed_group_drift) after each step; group 1 gets a NaN at step 3 (after the step-4 averaging
    it is restarted from the others' mean, so step 8's averaging has every group)."""
    model, optimizer = build(group)
    averager = FederatedAverager(model, optimizer, communicator=comm, sync_steps=4, **options)
    published = []
    for step in range(1, steps + 1):
        train_step(model, optimizer, group, step)
        if (group, step) == (1, 3):
            poison(model)
        averager.step(last=last and step == steps)
        published.append((averager.counters.delta_norm, averager.counters.group_drift))
    assert averager.counters.diverged_groups == 1
    return published


def assert_published(got: tuple[float, float], want: tuple[float, float], where: str) -> None:
    assert got[0] == pytest.approx(want[0], rel=1e-6), f"fed_delta_norm {where}"
    assert got[1] == pytest.approx(want[1], rel=1e-6), f"fed_group_drift {where}"


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("pieces", [False, True], ids=["equal", "pieces"])
def test_the_norms_of_an_averaging_without_a_diverged_group_are_published_at_the_next(options, pieces):
    """3 groups, group 1 NaN at step 3: nothing is published before step 8 (step 4's norms wait for its control
    all-reduce), then step 4's, over the 2 contributing groups."""
    want = reference_norms([1, 1, 1], diverged=1)
    results = run_federation(3, lambda comm: train(comm, comm.group, 8, last=False, **options), pieces=pieces)
    for g, published in enumerate(results):
        assert published[:7] == [(0.0, 0.0)] * 7, f"group {g}"
        assert_published(published[7], want, f"group {g} at step 8")


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("pieces", [False, True], ids=["equal", "pieces"])
def test_finish_publishes_the_norms_of_a_last_averaging_without_a_diverged_group(options, pieces):
    want = reference_norms([1, 1, 1], diverged=1)
    results = run_federation(3, lambda comm: train(comm, comm.group, 4, last=True, **options), pieces=pieces)
    for g, published in enumerate(results):
        assert_published(published[-1], want, f"group {g} after finish")


def test_groups_of_unequal_size_weigh_the_mean_but_the_drift_is_a_mean_over_contributing_groups():
    """Groups of 2 replicas, 1 and 1 rank (weights 2, 1, 1), every rank holding whole tensors; group 2 gets a NaN at
    step 3: mean Δ = (2 Δ_0 + Δ_1) / 3, drift = (‖Δ_0 − mean Δ‖ + ‖Δ_1 − mean Δ‖) / 2 / ‖mean Δ‖ (group 0's two
    replicas count once)."""
    shapes = (GroupShape((0, 1), 1), GroupShape((2,), 1), GroupShape((3,), 1))
    shared = {name: {"barrier": threading.Barrier(4, timeout=BARRIER_TIMEOUT_S)} for name in ("c", "x")}

    def rank_fn(world):
        group = {0: 0, 1: 0, 2: 1, 3: 2}[world.rank()]
        control, exchange = (FakeCommunicator(shared[n], world.rank(), 4) for n in ("c", "x"))
        comm = FederationCommunicator(
            None, control, exchange, hsdp_replicas=2 if group == 0 else 1, groups=shapes, this_group=group
        )
        model, optimizer = build(group)
        averager = FederatedAverager(model, optimizer, communicator=comm, sync_steps=4)
        for step in range(1, 5):
            train_step(model, optimizer, group, step)
            if (group, step) == (2, 3):
                poison(model)
            averager.step(last=step == 4)
        return averager.counters.delta_norm, averager.counters.group_drift

    want = reference_norms([2, 1, 1], diverged=2)
    for rank, published in enumerate(run_ranks(4, rank_fn)):
        assert_published(published, want, f"rank {rank}")

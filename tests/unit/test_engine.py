"""`FederatedAverager` run whole in one process, one thread per group over fake communicators, against a reference
of the rule written on full tensors here: schedule × overlap × divergence × outer optimizer, exact to the bit.

What these catch that shape checks do not: a mean divided by the peers instead of the contributing groups, a
snapshot that aliases the live parameter (the progress kept over an exchange would be lost), a temporary global
model left in place, an outer step or a restart on the wrong fragment, a resume that is not exact.
"""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
from torch import nn

from hf_fedshard import FederatedAverager
from hf_fedshard.engine import FederationCommunicator
from hf_fedshard.engine.fragments import Schedule
from hf_fedshard.engine.pieces import GroupShape, PieceExchange
from hf_fedshard.errors import ConfigError

from ..asserts import labelled
from ..fake_communicator import BARRIER_TIMEOUT_S, FakeCommunicator, run_federation, run_ranks

GROUPS = 3
RANGES = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 4: [(0, 1), (1, 2), (2, 3), (3, 4)]}  # by bytes: 48, 16, 32, 8


class Tiny(nn.Module):
    """Four parameters (four units without FSDP) and one floating buffer, which "training" moves too."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 2)
        self.register_buffer("stat", torch.full((2,), float(seed)))
        generator = torch.Generator().manual_seed(seed)  # not the global RNG: the groups are threads
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)


def build(group: int) -> tuple[Tiny, torch.optim.Optimizer]:
    model = Tiny(seed=group)  # the groups start apart: step 0's plain mean makes them one
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)


@torch.no_grad()
def train_step(model: Tiny, optimizer: torch.optim.Optimizer, group: int, step: int) -> None:
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.01 * (group + 1) * (1 + (step + i) % 3)) + 0.05 * p
    optimizer.step()
    optimizer.zero_grad()
    model.stat.add_(0.1 * (group + 1))


def poison(model: Tiny) -> None:
    with torch.no_grad():
        model.first.weight.view(-1)[0] = math.nan


def engine_run(
    steps: int, nan_at: tuple[int, int] | None = None, finish_apart: bool = False, pieces: bool = False, **options
) -> list:
    """Every group's parameters and buffer after ``steps`` steps and the end, its averager, its optimizer."""
    options = {"sync_steps": 4, **options}

    def rank_fn(comm):
        group = comm.group
        model, optimizer = build(group)
        averager = FederatedAverager(model, optimizer, communicator=comm, **options)
        for step in range(1, steps + 1):
            train_step(model, optimizer, group, step)
            if nan_at == (group, step):
                poison(model)
            averager.step(last=step == steps and not finish_apart)
        if finish_apart:
            averager.finish()
        return [t.detach().clone() for t in (*model.parameters(), model.stat)], averager, optimizer, comm

    return run_federation(GROUPS, rank_fn, pieces=pieces)


class Reference:
    """The averaging rule on full tensors, group by group, written from the docs (not from the engine)."""

    def __init__(self, sync_steps=4, fragments=1, overlap=0, lr=1.0, momentum=0.0) -> None:
        self.schedule = Schedule(sync_steps, fragments, overlap)
        self.ranges, self.lr, self.momentum = RANGES[fragments], lr, momentum
        self.models, self.optimizers = zip(*(build(g) for g in range(GROUPS)), strict=True)
        self.averaged_at = [0] * fragments
        self.flight: tuple | None = None  # (fragment, apply step, snapshots, means, diverged)
        self.delta_norm = self.drift = 0.0
        with torch.no_grad():
            for tensors in zip(*(self.state(g) for g in range(GROUPS)), strict=True):
                mean = sum(t.float() for t in tensors) / GROUPS
                for t in tensors:
                    t.copy_(mean)
        self.anchor = [p.detach().float().clone() for p in self.params(0)]
        self.buffer: list[torch.Tensor | None] = [None] * 4

    def params(self, g: int) -> list[torch.Tensor]:
        return list(self.models[g].parameters())

    def state(self, g: int) -> list[torch.Tensor]:
        return [*self.params(g), self.models[g].stat]

    def run(self, steps: int, nan_at: tuple[int, int] | None = None) -> list[list[torch.Tensor]]:
        for step in range(1, steps + 1):
            for g in range(GROUPS):
                train_step(self.models[g], self.optimizers[g], g, step)
                if nan_at == (g, step):
                    poison(self.models[g])
            if self.flight is not None and self.flight[1] == step:
                self.apply()
            fragment = self.schedule.starting(step)
            if step == steps:
                if self.flight is not None:
                    self.apply()
                self.average([f for f in range(len(self.ranges)) if self.averaged_at[f] < step], step)
            elif fragment is not None and self.schedule.overlap == 0:
                self.average([fragment], step)
            elif fragment is not None:
                self.start(fragment, step)
        return [[t.detach().clone() for t in self.state(g)] for g in range(GROUPS)]

    def diverged(self) -> list[int]:
        return [g for g in range(GROUPS) if not all(torch.isfinite(t).all() for t in self.state(g))]

    @torch.no_grad()
    def deltas(self, g: int, i: int, local: torch.Tensor, diverged: list[int]) -> torch.Tensor:
        return torch.zeros_like(self.anchor[i]) if g in diverged else self.anchor[i] - local.float()

    @torch.no_grad()
    def outer_step(self, i: int, mean: torch.Tensor) -> None:
        """torch.optim.SGD's single-tensor step (Nesterov when momentum > 0) on the anchor, gradient mean Δ."""
        grad = mean
        if self.momentum:
            if self.buffer[i] is None:
                self.buffer[i] = grad.clone()
            else:
                self.buffer[i].mul_(self.momentum).add_(grad)
            grad = grad.add(self.buffer[i], alpha=self.momentum)
        self.anchor[i].add_(grad, alpha=-self.lr)

    @torch.no_grad()
    def average(self, fragments: list[int], step: int) -> None:
        if not fragments:
            return
        diverged = self.diverged()
        contributors = GROUPS - len(diverged)
        squares = [0.0] * (GROUPS + 1)
        for f in fragments:
            for i in range(*self.ranges[f]):
                deltas = [self.deltas(g, i, self.params(g)[i], diverged) for g in range(GROUPS)]
                mean = (deltas[0] + deltas[1] + deltas[2]) / contributors
                self.note_norms(squares, deltas, mean, diverged)
                self.outer_step(i, mean)
                for g in range(GROUPS):
                    self.params(g)[i].copy_(self.anchor[i])
            self.averaged_at[f] = step
        if len(self.ranges) - 1 in fragments:
            stats = [torch.zeros(2) if g in diverged else self.models[g].stat for g in range(GROUPS)]
            mean = (stats[0] + stats[1] + stats[2]) / contributors
            for g in range(GROUPS):
                self.models[g].stat.copy_(mean)
        self.publish(squares, contributors)
        self.restart(diverged, keep=fragments)

    @torch.no_grad()
    def start(self, fragment: int, step: int) -> None:
        diverged = self.diverged()
        contributors = GROUPS - len(diverged)
        snapshots = [[self.params(g)[i].float().clone() for i in range(*self.ranges[fragment])] for g in range(GROUPS)]
        means = []
        for k, i in enumerate(range(*self.ranges[fragment])):
            deltas = [self.deltas(g, i, snapshots[g][k], diverged) for g in range(GROUPS)]
            means.append((deltas[0] + deltas[1] + deltas[2]) / contributors)
        if fragment == len(self.ranges) - 1:
            stats = [torch.zeros(2) if g in diverged else self.models[g].stat for g in range(GROUPS)]
            mean = (stats[0] + stats[1] + stats[2]) / contributors
            for g in range(GROUPS):
                self.models[g].stat.copy_(mean)
        self.flight = (fragment, step + self.schedule.overlap, snapshots, means, diverged)

    @torch.no_grad()
    def apply(self) -> None:
        fragment, _, snapshots, means, diverged = self.flight
        self.flight = None
        for k, i in enumerate(range(*self.ranges[fragment])):
            self.outer_step(i, means[k])
            for g in range(GROUPS):
                local = self.params(g)[i]
                kept = self.anchor[i] if g in diverged else self.anchor[i] + (local.float() - snapshots[g][k])
                local.copy_(kept)
        self.restart(diverged, keep=[fragment])

    @torch.no_grad()
    def restart(self, diverged: list[int], keep: list[int]) -> None:
        for g in diverged:
            for f, (a, b) in enumerate(self.ranges):
                if f not in keep:
                    for i in range(a, b):
                        self.params(g)[i].copy_(self.anchor[i])
            for state in self.optimizers[g].state.values():
                state["momentum_buffer"].zero_()

    def note_norms(self, squares, deltas, mean, diverged) -> None:
        for g in range(GROUPS):
            if g not in diverged:
                squares[g] += (deltas[g] - mean).double().square().sum().item()
        squares[-1] += GROUPS * mean.double().square().sum().item()

    def publish(self, squares, contributors) -> None:
        self.delta_norm = math.sqrt(squares[-1] / GROUPS)
        self.drift = sum(math.sqrt(s) for s in squares[:-1]) / contributors / self.delta_norm


MATRIX = [
    pytest.param({}, id="fedavg-blocking"),
    pytest.param({"outer_optimizer": "nesterov"}, id="nesterov-blocking"),
    pytest.param({"sync_fragments": 2}, id="fedavg-2-fragments"),
    pytest.param({"sync_fragments": 2, "sync_overlap": 1}, id="fedavg-2-fragments-overlap-1"),
    pytest.param({"sync_fragments": 4, "sync_overlap": 0, "sync_steps": 8}, id="fedavg-4-fragments"),
    pytest.param({"outer_optimizer": "nesterov", "sync_overlap": 2}, id="nesterov-overlap-2"),
]


def reference_for(options: dict) -> Reference:
    lr, momentum = (0.7, 0.9) if options.get("outer_optimizer") == "nesterov" else (1.0, 0.0)
    return Reference(
        options.get("sync_steps", 4), options.get("sync_fragments", 1), options.get("sync_overlap", 0), lr, momentum
    )


def assert_exchanged_by(results: list, pieces: bool) -> None:
    """Every group's Δ went through `PieceExchange` (``pieces``: groups described as groups of unequal size are) or
    through the equal groups' `Exchange`, and the exchange communicator carried it."""
    for g, (_, averager, _, comm) in enumerate(results):
        assert isinstance(averager.exchange, PieceExchange) == pieces, f"group {g}: {type(averager.exchange).__name__}"
        assert comm.exchange.calls > 0, f"group {g}: no exchange collective"


def assert_groups_equal_reference(results: list, expected: list[list[torch.Tensor]]) -> None:
    for g, (state, *_) in enumerate(results):
        for i, (got, want) in enumerate(zip(state, expected[g], strict=True)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=labelled(f"group {g}, tensor {i}"))


@pytest.mark.parametrize("options", MATRIX)
@pytest.mark.parametrize("steps", [10, 12])
def test_the_engine_follows_the_rule_to_the_bit(options, steps):
    """10 steps end between averagings (finish averages what is stale), 12 on one."""
    results = engine_run(steps, **options)
    reference = reference_for(options)
    assert_groups_equal_reference(results, reference.run(steps))
    averager = results[0][1]
    assert averager.counters.delta_norm == pytest.approx(reference.delta_norm, rel=1e-12)
    assert averager.counters.group_drift == pytest.approx(reference.drift, rel=1e-12)


@pytest.mark.parametrize("options", MATRIX)
def test_the_exchange_of_unequal_groups_follows_the_same_rule_where_the_groups_weigh_the_same(options):
    """`hf_fedshard.engine.pieces` (groups of unequal size) with groups of equal weight: in fp32 its rule is the
    equal groups' rule, so every fragment, overlap, outer optimizer and buffer must land on the same bits."""
    results = engine_run(10, pieces=True, **options)
    assert_exchanged_by(results, pieces=True)
    assert_groups_equal_reference(results, reference_for(options).run(10))


@pytest.mark.parametrize("options", [pytest.param({}, id="blocking"), pytest.param({"sync_overlap": 1}, id="overlap")])
@pytest.mark.parametrize("pieces", [False, True], ids=["equal", "pieces"])
def test_a_diverged_group_is_left_out_and_restarted(options, pieces):
    """Group 1 gets a NaN at step 3; the averaging of step 4 divides by the 2 contributing groups, group 1 takes
    their mean (overlapped: at the apply, step 5), and its optimizer momentum is zeroed."""
    results = engine_run(8, nan_at=(1, 3), pieces=pieces, **options)
    assert_exchanged_by(results, pieces)
    assert_groups_equal_reference(results, reference_for(options).run(8, nan_at=(1, 3)))
    assert [r[1].counters.diverged_groups for r in results] == [1, 1, 1]
    assert [r[1].diverged_at_step for r in results] == [4 + options.get("sync_overlap", 0)] * 3


def test_global_model_lends_the_plain_mean_and_gives_each_group_its_own_back():
    def rank_fn(comm):
        model, optimizer = build(comm.group)
        averager = FederatedAverager(model, optimizer, communicator=comm, sync_steps=4)
        for step in (1, 2):
            train_step(model, optimizer, comm.group, step)
            averager.step()
        own = [t.detach().clone() for t in (*model.parameters(), model.stat)]
        with averager.global_model():
            lent = [t.detach().clone() for t in (*model.parameters(), model.stat)]
            with pytest.raises(RuntimeError, match="already open: the blocks do not nest"), averager.global_model():
                pass
        after = [t.detach().clone() for t in (*model.parameters(), model.stat)]
        return own, lent, after

    results = run_federation(GROUPS, rank_fn)
    for i in range(5):
        mean = sum(r[0][i].float() for r in results) / GROUPS
        for g, (own, lent, after) in enumerate(results):
            torch.testing.assert_close(lent[i], mean.to(lent[i].dtype), rtol=0, atol=0, msg=labelled(f"lent {g},{i}"))
            torch.testing.assert_close(after[i], own[i], rtol=0, atol=0, msg=labelled(f"given back {g},{i}"))


RESUME_CASES = [
    pytest.param({}, 6, id="blocking-between-averagings"),
    pytest.param({}, 8, id="blocking-on-an-averaging"),
    pytest.param({"outer_optimizer": "nesterov", "sync_fragments": 2, "sync_overlap": 1}, 6, id="in-flight"),
    pytest.param({"outer_optimizer": "nesterov", "sync_fragments": 2, "sync_overlap": 1}, 7, id="after-apply"),
]


@pytest.mark.parametrize(("options", "stop"), RESUME_CASES)
def test_a_state_dict_round_trip_resumes_exactly(options, stop):
    """Stop after ``stop`` steps, rebuild model, optimizer and averager from copies of their state (another init,
    no initial averaging), and go on: the end is bit-identical to the run that never stopped, counters too."""

    def rank_fn(comm):
        group = comm.group
        model, optimizer = build(group)
        averager = FederatedAverager(model, optimizer, communicator=comm, sync_steps=4, **options)
        for step in range(1, stop + 1):
            train_step(model, optimizer, group, step)
            averager.step()
        saved = copy.deepcopy((averager.state_dict(), model.state_dict(), optimizer.state_dict()))
        model, optimizer = build(group + 10)
        model.load_state_dict(saved[1])
        optimizer.load_state_dict(saved[2])
        averager = FederatedAverager(
            model, optimizer, communicator=comm, sync_steps=4, average_initial_weights=False, **options
        )
        averager.load_state_dict(saved[0])
        for step in range(stop + 1, 13):
            train_step(model, optimizer, group, step)
            averager.step(last=step == 12)
        return [t.detach().clone() for t in (*model.parameters(), model.stat)], averager

    resumed = run_federation(GROUPS, rank_fn)
    straight = engine_run(12, **options)
    assert_groups_equal_reference(resumed, [s[0] for s in straight])
    timing = {"last_sync_seconds", "total_sync_seconds", "total_wait_seconds", "total_barrier_seconds"}
    for r, s in zip(resumed, straight, strict=True):
        got, want = ({k: v for k, v in x[1].state_dict()["counters"].items() if k not in timing} for x in (r, s))
        assert got == want


def test_one_control_all_reduce_per_averaging_besides_the_exchange():
    """12 steps at H = 4 in fp32: 3 averagings, each 1 control all-reduce (flags, previous norms) and 1 exchange
    all-reduce; the end publishes the last norms with 1 more. Step 0's plain mean and the buffers use peers."""
    results = engine_run(12)
    for _, _, _, comm in results:
        assert (comm.control.calls, comm.exchange.calls) == (3 + 1, 3)
        assert comm.peers.calls == 1 + 3  # step 0's mean, then the buffers at each averaging


def test_finish_apart_equals_last_step_and_step_after_finish_is_refused():
    apart = engine_run(10, finish_apart=True, sync_fragments=2, sync_overlap=1)
    together = engine_run(10, sync_fragments=2, sync_overlap=1)
    assert_groups_equal_reference(apart, [t[0] for t in together])
    with pytest.raises(RuntimeError, match=r"step\(\) after finish\(\)"):
        apart[0][1].step()


def test_bad_values_are_refused_before_any_collective():
    model, optimizer = build(0)
    with pytest.raises(ConfigError, match="fed_sync_overlap=4 must be in"):
        FederatedAverager(model, optimizer, communicator=None, sync_steps=4, sync_overlap=4)
    with pytest.raises(ConfigError, match="fed_outer_lr/fed_outer_momentum apply to fed_outer_optimizer='nesterov'"):
        FederatedAverager(model, optimizer, communicator=None, outer_lr=0.5)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="the optimizer is not over the model's trainable parameters"):
        FederatedAverager(model, other, communicator=None)
    with pytest.raises(ConfigError, match="needs the world mesh"):
        FederatedAverager(model, optimizer)


def test_without_initial_averaging_a_state_must_be_loaded_first():
    def rank_fn(comm):
        model, optimizer = build(comm.group)
        averager = FederatedAverager(model, optimizer, communicator=comm, average_initial_weights=False)
        with pytest.raises(RuntimeError, match=r"no load_state_dict\(\) before the first step\(\)"):
            averager.step()

    run_federation(GROUPS, rank_fn)


class GroupMesh:
    """Just enough of a world DeviceMesh for the sharding check: this rank's group is ranks 0 and 1."""

    mesh = torch.tensor([[0, 1]])

    def __getitem__(self, axes):
        return self


def test_a_model_not_sharded_over_its_group_is_refused_before_any_collective():
    model, optimizer = build(0)
    with pytest.raises(
        ConfigError, match=r"the model is not sharded, but this rank's federation group is ranks \[0, 1\]"
    ):
        FederatedAverager(model, optimizer, GroupMesh())


def test_with_every_group_diverged_the_check_and_the_lent_model_answer_and_an_averaging_stops():
    def rank_fn(comm):
        model, optimizer = build(comm.group)
        averager = FederatedAverager(model, optimizer, communicator=comm, sync_steps=4)
        train_step(model, optimizer, comm.group, 1)
        poison(model)
        averager.step()
        assert averager.find_diverged_groups() == [0, 1, 2]
        with averager.global_model():  # nothing to average: each group keeps its own
            assert math.isnan(model.first.weight.view(-1)[0].item())
        for _ in range(2):
            averager.step()
        with pytest.raises(RuntimeError, match=r"every federation group \(3\) has NaN/Inf in its model at step 4"):
            averager.step()

    run_federation(GROUPS, rank_fn)


def test_groups_of_unequal_size_average_by_their_samples():
    """Group 0 is 2 replicas (ranks 0 and 1, weight 2), group 1 one rank (weight 1), every rank holding whole
    tensors: the averaging of step 4 gives anchor − (2 Δ0 + Δ1) / 3, to the bit, in every group; and ‖mean Δ‖
    counts group 0's replicas once."""
    shapes = (GroupShape((0, 1), 1), GroupShape((2,), 1))
    shared = {name: {"barrier": threading.Barrier(3, timeout=BARRIER_TIMEOUT_S)} for name in ("c", "x")}

    def rank_fn(world):
        group = 0 if world.rank() < 2 else 1
        control, exchange = (FakeCommunicator(shared[n], world.rank(), 3) for n in ("c", "x"))
        comm = FederationCommunicator(None, control, exchange, hsdp_replicas=2 - group, groups=shapes, this_group=group)
        model, optimizer = build(group)
        averager = FederatedAverager(model, optimizer, communicator=comm, sync_steps=4)
        anchor = [p.detach().clone() for p in model.parameters()]
        for step in range(1, 5):
            train_step(model, optimizer, group, step)
            before = [p.detach().clone() for p in model.parameters()]
            averager.step()
        averager.finish()
        return group, anchor, before, [p.detach().clone() for p in model.parameters()], averager

    results = run_ranks(3, rank_fn)
    anchor = results[0][1]
    models = {group: before for group, _, before, _, _ in results}
    groups = zip(anchor, models[0], models[1], strict=True)
    means = [(torch.zeros_like(a) + 2 * (a - x0) + 1 * (a - x1)) / 3 for a, x0, x1 in groups]
    for group, _, _, after, averager in results:
        for i, (got, a, mean) in enumerate(zip(after, anchor, means, strict=True)):
            torch.testing.assert_close(got, a - mean, rtol=0, atol=0, msg=labelled(f"group {group}, parameter {i}"))
        norm = sum(m.double().square().sum() for m in means) ** 0.5
        assert averager.counters.delta_norm == pytest.approx(float(norm), rel=1e-6)

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

from hf_fedshard import AveragingObserver, FederatedAverager
from hf_fedshard.engine import FederationCommunicator
from hf_fedshard.engine.pieces import GroupShape
from hf_fedshard.errors import ConfigError

from ..asserts import labelled
from ..fake_communicator import BARRIER_TIMEOUT_S, FakeCommunicator, run_federation, run_ranks
from ..tiny_federation import (
    GROUPS,
    assert_exchanged_by,
    assert_groups_equal_reference,
    build,
    engine_run,
    poison,
    reference_for,
    train_step,
)

MATRIX = [
    pytest.param({}, id="fedavg-blocking"),
    pytest.param({"outer_optimizer": "nesterov"}, id="nesterov-blocking"),
    pytest.param({"sync_fragments": 2}, id="fedavg-2-fragments"),
    pytest.param({"sync_fragments": 2, "sync_overlap": 1}, id="fedavg-2-fragments-overlap-1"),
    pytest.param({"sync_fragments": 4, "sync_overlap": 0, "sync_steps": 8}, id="fedavg-4-fragments"),
    pytest.param({"outer_optimizer": "nesterov", "sync_overlap": 2}, id="nesterov-overlap-2"),
]


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


@pytest.mark.parametrize("options", MATRIX[1:])
def test_the_optimizer_state_travels_with_the_last_fragment_and_replaces_the_live_one_at_its_apply(options):
    """fed_average_optimizer_state: the momentum buffers' plain mean, of their values when the last fragment's
    averaging began, replaces them where it is applied (τ steps later with overlap), as the floating buffer's does;
    parameters and moments end on the rule's values, to the bit."""
    options = {**options, "average_optimizer_state": True}
    results = engine_run(10, **options)
    reference = reference_for(options)
    assert_groups_equal_reference(results, reference.run(10))
    for g, (_, _, optimizer, _) in enumerate(results):
        for i, (param, ref) in enumerate(zip(optimizer.param_groups[0]["params"], reference.params(g), strict=True)):
            got, want = optimizer.state[param]["momentum_buffer"], reference.optimizers[g].state[ref]["momentum_buffer"]
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=labelled(f"group {g} moment {i}"))


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


TOPK = {"sync_dtype": "topk", "sync_density": 0.4, "sync_chunk": 5}  # error feedback left over at every averaging
RESUME_CASES = [
    pytest.param({}, 6, id="blocking-between-averagings"),
    pytest.param({}, 8, id="blocking-on-an-averaging"),
    pytest.param({"outer_optimizer": "nesterov", "sync_fragments": 2, "sync_overlap": 1}, 6, id="in-flight"),
    pytest.param({"outer_optimizer": "nesterov", "sync_fragments": 2, "sync_overlap": 1}, 7, id="after-apply"),
    pytest.param({**TOPK, "sync_feedback_decay": 0.9}, 6, id="topk-residual"),
    pytest.param({**TOPK, "sync_fragments": 2, "sync_overlap": 1}, 6, id="topk-in-flight"),
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


class Events(AveragingObserver):
    """Each call of the public hook, with the parameters' values where the hook exposes a moment."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.calls, self.moments = model, [], {}

    def averaging(self, step, fragments):
        self.calls.append(("averaging", step, list(fragments)))
        self.moments[("before", step)] = [p.detach().clone() for p in self.model.parameters()]

    def averaged(self, step, fragments):
        self.calls.append(("averaged", step, list(fragments)))
        self.moments[("after", step)] = [p.detach().clone() for p in self.model.parameters()]

    def exchange_started(self, step, fragment):
        self.calls.append(("exchange_started", step, fragment))

    def applying(self, step, fragment, started_at):
        self.calls.append(("applying", step, fragment, started_at))

    def applied(self, step, fragment):
        self.calls.append(("applied", step, fragment))

    def exchanged(self, step, fragment, deltas, means):
        self.calls.append(("exchanged", step, fragment))
        self.moments[("exchanged", step, fragment)] = ([d.clone() for d in deltas], [m.clone() for m in means])


@pytest.mark.parametrize("overlap", [0, 1])
def test_the_observer_sees_each_averaging_in_order_with_what_was_sent_and_agreed(overlap):
    """`AveragingObserver`, the public hook the tests' recorders use: H=4, 2 fragments, 9 steps; each exchange's
    means are the mean over the groups of what each sent, and a blocking averaging's "before" and "after" differ."""

    def rank_fn(comm):
        model, optimizer = build(comm.group)
        averager = FederatedAverager(model, optimizer, communicator=comm, sync_steps=4, sync_fragments=2,
                                     sync_overlap=overlap)  # fmt: skip
        events = Events(model)
        averager.add_observer(events)
        for step in range(1, 10):
            train_step(model, optimizer, comm.group, step)
            averager.step(last=step == 9)
        return events

    events = run_federation(GROUPS, rank_fn)
    if overlap:  # fragment 0 starts at 2 and 6, fragment 1 at 4 and 8, each applied a step later; the end averages
        # both (an applied fragment kept the progress made while in flight)
        expected = [
            ("exchange_started", 2, 0), ("applying", 3, 0, 2), ("exchanged", 3, 0), ("applied", 3, 0),
            ("exchange_started", 4, 1), ("applying", 5, 1, 4), ("exchanged", 5, 1), ("applied", 5, 1),
            ("exchange_started", 6, 0), ("applying", 7, 0, 6), ("exchanged", 7, 0), ("applied", 7, 0),
            ("exchange_started", 8, 1), ("applying", 9, 1, 8), ("exchanged", 9, 1), ("applied", 9, 1),
            ("averaging", 9, [0, 1]), ("exchanged", 9, 0), ("exchanged", 9, 1), ("averaged", 9, [0, 1]),
        ]  # fmt: skip
    else:  # fragment 0 at step 2 and 6, fragment 1 at 4 and 8, both at the end
        expected = []
        for step, fragments in ((2, [0]), (4, [1]), (6, [0]), (8, [1]), (9, [0, 1])):
            exchanged = [("exchanged", step, f) for f in fragments]
            expected += [("averaging", step, fragments), *exchanged, ("averaged", step, fragments)]
    for g, got in enumerate(events):
        assert got.calls == expected, f"group {g}: {got.calls}"
    for key in [k for k in events[0].moments if k[0] == "exchanged"]:
        sent = [e.moments[key][0] for e in events]
        for g in range(GROUPS):
            for i, mean in enumerate(events[g].moments[key][1]):
                want = sum((s[i] for s in sent), torch.zeros_like(sent[0][i])) / GROUPS
                torch.testing.assert_close(mean, want, rtol=0, atol=1e-7, msg=labelled(f"{key} group {g} tensor {i}"))
    if not overlap:
        assert not torch.equal(events[0].moments[("before", 2)][0], events[0].moments[("after", 2)][0])

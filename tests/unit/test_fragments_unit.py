"""Fast in-process checks of streaming averaging: the schedule's golden table, fragments of whole FSDP units
balanced by bytes, the apply rule that keeps local progress, and one-line refusals of bad settings."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from hf_fedshard import FederatedAverager
from hf_fedshard.engine import AveragingOptions
from hf_fedshard.engine.fragments import Schedule, fragment_ranges, partition, unit_sizes
from hf_fedshard.engine.outer import OuterOptimizer
from hf_fedshard.errors import ConfigError
from hf_fedshard.integrations.arguments import FedShardTrainingArguments
from hf_fedshard.integrations.callback import FedAvgCallback

# H = 8, F = 4, τ = 1: fragment f starts at steps ≡ 2(f + 1) (mod 8) and applies one step later.
GOLDEN_H8_F4_T1 = """\
step | f0 | f1 | f2 | f3
   1 | - | - | - | -
   2 | start | - | - | -
   3 | apply | - | - | -
   4 | - | start | - | -
   5 | - | apply | - | -
   6 | - | - | start | -
   7 | - | - | apply | -
   8 | - | - | - | start
   9 | - | - | - | apply
  10 | start | - | - | -
  11 | apply | - | - | -
  12 | - | start | - | -"""

GOLDEN_H4_F2_T0 = """\
step | f0 | f1
   1 | - | -
   2 | sync | -
   3 | - | -
   4 | - | sync
   5 | - | -
   6 | sync | -"""

GOLDEN_H4_F1_T3 = """\
step | f0
   1 | -
   2 | -
   3 | -
   4 | start
   5 | -
   6 | -
   7 | apply
   8 | start"""


@pytest.mark.parametrize(
    "schedule, steps, golden",
    [
        (Schedule(8, 4, 1), 12, GOLDEN_H8_F4_T1),
        (Schedule(4, 2, 0), 6, GOLDEN_H4_F2_T0),
        (Schedule(4, 1, 3), 8, GOLDEN_H4_F1_T3),
    ],
)
def test_schedule_golden_table(schedule, steps, golden):
    schedule.validate()
    assert schedule.table(steps) == golden


def test_blocking_schedule_averages_the_whole_model_every_h_steps():
    schedule = Schedule(8)
    assert not schedule.streaming
    assert [s for s in range(1, 33) if schedule.phases(s)] == [8, 16, 24, 32]
    assert all(schedule.phases(s) == {0: "sync"} for s in (8, 16))


def test_each_fragment_averages_once_every_h_steps_and_one_exchange_is_in_flight_at_most():
    for h, f, tau in [(8, 4, 1), (8, 2, 3), (12, 3, 2), (8, 8, 0)]:
        schedule = Schedule(h, f, tau)
        schedule.validate()
        starts = [schedule.starting(s) for s in range(1, 4 * h + 1)]
        for fragment in range(f):
            assert starts.count(fragment) == 4
        pending = None  # (fragment, apply step)
        for step in range(1, 4 * h + 1):
            if tau and pending is not None and pending[1] == step:
                assert schedule.applying(step) == pending[0]
                pending = None
            elif tau:
                assert schedule.applying(step) is None
            fragment = schedule.starting(step)
            if fragment is not None and tau:
                assert pending is None  # the previous exchange was applied before this one starts
                pending = (fragment, step + tau)


@pytest.mark.parametrize(
    "h, f, tau, match",
    [
        (8, 3, 0, "fed_sync_fragments=3 must be at least 1 and divide fed_sync_steps=8"),
        (8, 0, 0, "fed_sync_fragments=0 must be at least 1"),
        (8, 4, 2, r"fed_sync_overlap=2 must be in \[0, fed_sync_steps / fed_sync_fragments = 2\)"),
        (8, 1, -1, "fed_sync_overlap=-1 must be in"),
    ],
)
def test_bad_schedules_fail_with_one_line(tmp_path, h, f, tau, match):
    settings = {"fed_sync_steps": h, "fed_sync_fragments": f, "fed_sync_overlap": tau}
    with pytest.raises(ConfigError, match=match) as err:
        FedShardTrainingArguments(output_dir=str(tmp_path), report_to="none", **settings)
    assert "\n" not in str(err.value)


def test_streaming_takes_averaging_the_optimizer_state(tmp_path):
    """It was refused; the moments now travel with the last fragment (tests/unit/test_engine.py pins the values)."""
    args = FedShardTrainingArguments(
        output_dir=str(tmp_path), report_to="none", fed_sync_overlap=1, fed_average_optimizer_state=True
    )
    assert args.fed_schedule.streaming and args.fed_average_optimizer_state


def test_partition_is_contiguous_balanced_and_never_splits_a_unit():
    assert partition([10, 10, 10, 10], 2) == [2, 2]
    assert partition([40, 10, 10, 10, 10], 2) == [1, 4]  # the first unit alone already holds half
    assert partition([1, 1, 1, 100], 3) == [2, 1, 1]  # every run keeps at least one unit
    assert partition([5, 5, 5], 3) == [1, 1, 1]
    assert sum(partition([3, 1, 4, 1, 5, 9, 2, 6], 4)) == 8


def test_more_fragments_than_units_fails_with_one_line():
    with pytest.raises(ConfigError, match="fed_sync_fragments=5 exceeds the model's 4 FSDP units") as err:
        partition([1, 2, 3, 4], 5)
    assert "\n" not in str(err.value)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)


def test_without_fsdp_each_parameter_is_a_unit_and_fragments_cover_every_parameter():
    model = nn.Sequential(nn.Embedding(10, 4), Block(4), Block(4), nn.Linear(4, 10))
    params = list(model.parameters())
    assert unit_sizes(model, params) == [1] * len(params)
    ranges = fragment_ranges(model, params, 3)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(params)
    assert all(a < b and b == c for (a, b), (c, _) in itertools.pairwise(ranges))


def test_apply_keeps_the_local_progress_made_while_the_exchange_ran():
    anchor0 = torch.tensor([1.0, 2.0])
    local = anchor0.clone()
    outer = OuterOptimizer([local])
    snapshot = torch.tensor([0.5, 1.0])  # the group's local at the start of the exchange
    mean = outer.deltas([snapshot])[0]  # one group: mean Δ = its own Δ = anchor − snapshot
    local.copy_(torch.tensor([0.25, 1.5]))  # τ more steps of training
    outer.step([mean], [local], snapshots=[snapshot])
    torch.testing.assert_close(outer.anchor[0], snapshot)  # fedavg: the new anchor is the mean of the snapshots
    torch.testing.assert_close(local, snapshot + (torch.tensor([0.25, 1.5]) - snapshot))


def test_apply_without_snapshots_is_the_blocking_rule():
    local = torch.tensor([1.0, 2.0])
    outer = OuterOptimizer([local], lr=0.7, momentum=0.9)
    local.sub_(0.5)
    delta = outer.deltas([local])
    outer.step(delta, [local])
    assert torch.equal(local, outer.anchor[0])


def resume_state(synced_at: list[int], in_flight: dict | None = None) -> dict:
    counters = {"syncs": 3, "inter_group_bytes": 10, "last_sync_seconds": 0.1, "diverged_groups": 0}
    return {"counters": {**counters, "synced_at": synced_at}, "in_flight": in_flight, "outer": None}


def test_resuming_with_another_number_of_fragments_fails_with_one_line():
    callback = FedAvgCallback(None, AveragingOptions(sync_steps=4, sync_fragments=2, sync_overlap=1))
    with pytest.raises(ConfigError, match="fed_sync_fragments=2, but the checkpoint was written with 1") as err:
        callback.load_state_dict(resume_state([4]))
    assert "\n" not in str(err.value)
    callback.load_state_dict(resume_state([4, 2]))


def test_resuming_an_exchange_the_schedule_does_not_hold_fails_with_one_line():
    callback = FedAvgCallback(None, AveragingOptions(sync_steps=8, sync_fragments=4, sync_overlap=1))
    flight = {"fragment": 0, "start_step": 2, "apply_step": 4, "snapshots": [], "contribute": True,
              "contributors": 2, "diverged": [], "blocked_s": 0.0, "means": [], "sent": 0}  # fmt: skip
    with pytest.raises(ConfigError, match="started at step 2 for step 4, which fed_sync_steps=8") as err:
        callback.load_state_dict(resume_state([0] * 4, flight))
    assert "\n" not in str(err.value)
    callback.load_state_dict(resume_state([0] * 4, {**flight, "apply_step": 3}))


def test_more_fragments_than_fsdp_units_is_refused_before_the_first_averaging():
    """FederatedAverager refuses F > units before step 0's averaging (here it would need a communicator)."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="fed_sync_fragments=8 exceeds the model's 2 FSDP units") as err:
        FederatedAverager(model, optimizer, communicator=None, sync_steps=8, sync_fragments=8)
    assert "\n" not in str(err.value)

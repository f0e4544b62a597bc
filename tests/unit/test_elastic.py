"""``fed_transport torchft`` in process: the settings' refusals, and the engine's rounds on fake communicators
with a fake membership (a round that does not commit is redone and changes nothing; a group that lost a round the
others committed takes a peer's state and ends on the rule's value). The real launches are
tests/distributed/test_elastic.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import threading
from collections.abc import Callable

import pytest
import torch
from transformers import TrainerState

from hf_fedshard import FederatedAverager, FedShardTrainingArguments
from hf_fedshard.engine.communicator import FederationCommunicator, Round
from hf_fedshard.engine.rounds import HealState
from hf_fedshard.errors import ConfigError
from hf_fedshard.integrations.card import quorum_rows
from hf_fedshard.integrations.elastic import trainer_state_now

from ..fake_communicator import BARRIER_TIMEOUT_S, run_federation
from ..tiny_federation import GROUPS, assert_groups_equal_reference, build, reference_for, train_step

ELASTIC = ["--fed_transport", "torchft", "--fed_lighthouse", "http://localhost:1"]


# ---- Settings ----


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fed_group_id", "0", "--fed_num_groups", "2"], r"^fed_transport torchft needs fed_lighthouse"),
        (["--fed_group_id", "2", "--fed_num_groups", "2"], r"^fed_group_id=2 must be in 0 … fed_num_groups - 1"),
        (["--fed_group_id", "0", "--fed_num_groups", "2", "--fed_group_size", "2"], r"^fed_group_size=2 but this"),
        (["--fed_group_id", "0", "--fed_num_groups", "2", "--fed_sync_overlap", "2", "--eval_strategy", "steps",
          "--eval_steps", "3"], r"^eval_steps=3 puts evaluations inside an exchange's flight"),
        (["--fed_group_id", "0", "--fed_num_groups", "2", "--load_best_model_at_end", "true", "--eval_strategy",
          "steps", "--eval_steps", "8", "--save_strategy", "steps", "--save_steps", "8"],
         r"^load_best_model_at_end reloads each group's best checkpoint"),
    ],
)  # fmt: skip
def test_torchft_settings_are_refused_in_one_line(extra, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = [*ELASTIC, *extra]
    if "fed_lighthouse" in message:
        argv = argv[:2] + argv[4:]
    with pytest.raises(ConfigError, match=message) as caught:
        parse(argv)
    assert "\n" not in str(caught.value)


def test_torchft_settings_without_torchft_are_refused():
    with pytest.raises(ConfigError, match=r"^fed_group_id, fed_num_groups belong to fed_transport torchft"):
        parse(["--fed_group_id", "0", "--fed_num_groups", "2"])


def test_a_torchft_group_counts_the_federation_and_writes_in_a_folder_of_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse([*ELASTIC, "--fed_group_id", "1", "--fed_num_groups", "3", "--output_dir", str(tmp_path)])
    assert args.output_dir == os.path.join(tmp_path, "fed_group1")
    assert (args.fed_layout.world_size, args.fed_layout.num_groups, args.fed_layout.method) == (3, 3, "FL+FSDP")
    assert (args.fed_launch_layout.world_size, args.fed_launch_layout.num_groups) == (1, 1)
    assert args.fed_group_index(0) == 1


def parse(argv: list[str]) -> FedShardTrainingArguments:
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(FedShardTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "unused", "--report_to", "none", *argv]
    )
    return args


# ---- The engine's rounds (in process) ----


class FakeMembership:
    """Rounds on fake communicators: the commits listed in ``fail`` return False (all groups: ``"all"``, or one
    group, which then heals from group 0's committed state, sent right after group 0 committed)."""

    def __init__(self, shared: dict, group: int, fail: dict[int, str]) -> None:
        self.shared, self.group, self.fail = shared, group, fail
        self.heal = HealState()
        self.commits = self.rounds = 0

    def commit(self) -> bool:
        self.commits += 1
        who = self.fail.get(self.commits)
        return who is None or (who != "all" and int(who) != self.group)

    def next_round(self) -> Round:
        """Right after a round: group 0 sends its committed state (a copy, as a wire would) while the next quorum
        forms; the group that lost the round receives it."""
        self.rounds += 1
        who = self.fail.get(self.commits)
        if who not in (None, "all") and self.group == 0:
            self.shared["peer"] = copy.deepcopy(self.heal.committed())
            self.shared["published"].set()
        if who not in (None, "all") and int(who) == self.group:
            assert self.shared["published"].wait(BARRIER_TIMEOUT_S)
            self.heal.receive(copy.deepcopy(self.shared["peer"]))
            return Round(healed=True, changed=True)
        return Round()

    def metrics(self) -> dict[str, float]:
        return {"fed_commits": self.commits}

    def end(self, new_quorum: Callable[[Round], None], last: Round | None) -> list[int]:
        return []  # every group is at the end together here


def with_membership(
    comm: FederationCommunicator, shared: dict, fail: dict[int, str]
) -> tuple[FederationCommunicator, FakeMembership]:
    """``comm`` with a `FakeMembership` of its group (``shared`` among the groups; ``fail``: its failing commits)."""
    membership = FakeMembership(shared, comm.group, fail)
    peers, control, exchange = comm.peers, comm.control, comm.exchange
    return FederationCommunicator(peers, control, exchange, timeout=comm.timeout, membership=membership), membership


def elastic_run(steps: int, fail: dict[int, str], **options) -> list:
    """`test_engine.engine_run` with a `FakeMembership` on every group's communicator."""
    shared = {"published": threading.Event()}
    options = {"sync_steps": 4, **options}

    def rank_fn(comm: FederationCommunicator):
        group = comm.group
        comm, membership = with_membership(comm, shared, fail)
        model, optimizer = build(group)
        averager = FederatedAverager(model, optimizer, communicator=comm, **options)
        for step in range(1, steps + 1):
            train_step(model, optimizer, group, step)
            averager.step(last=step == steps)
        return [t.detach().clone() for t in (*model.parameters(), model.stat)], averager, membership, comm

    return run_federation(GROUPS, rank_fn)


@pytest.mark.parametrize("outer", [{}, {"outer_optimizer": "nesterov"}], ids=["fedavg", "nesterov"])
def test_a_round_that_does_not_commit_changes_nothing_and_is_redone(outer):
    """Commit 3 (the averaging of step 8) fails everywhere: the engine redoes it (twice the collectives at step 8)
    and ends on the rule's values, to the bit; applying a lost round would take the outer step twice."""
    results = elastic_run(12, fail={3: "all"}, **outer)
    assert_groups_equal_reference(results, reference_for(outer).run(12))
    for _, averager, membership, comm in results:
        assert membership.commits == 1 + 3 + 1  # step 0, steps 4, 8 (twice), 12
        assert comm.exchange.calls == 3 + 1
        assert averager.counters.syncs == 1 + 3


def test_a_group_that_lost_a_round_the_others_committed_heals_from_a_peer():
    """Commit 2 (step 4) fails in group 2 only: it takes group 0's state after that averaging and all groups end
    on the rule's values, to the bit, with its own inner optimizer state kept."""
    results = elastic_run(12, fail={2: "2"})
    assert_groups_equal_reference(results, reference_for({}).run(12))
    assert [r[2].rounds for r in results] == [1 + 3, 1 + 3, 1 + 3]
    assert [r[1].counters.syncs for r in results] == [4, 4, 4]


STREAMED = [
    pytest.param({"sync_fragments": 2}, id="2-fragments"),
    pytest.param({"sync_fragments": 2, "sync_overlap": 1}, id="2-fragments-overlap-1"),
    pytest.param({"outer_optimizer": "nesterov", "sync_overlap": 2}, id="nesterov-overlap-2"),
    pytest.param({"sync_overlap": 1, "average_optimizer_state": True}, id="overlap-1-optimizer-state"),
]


@pytest.mark.parametrize("options", STREAMED)
def test_a_streamed_round_that_does_not_commit_is_redone_from_what_it_began_with(options):
    """Commit 3 fails everywhere (fragment 1 of step 4, or the averaging of step 4 with τ = 2): the round is redone
    at its apply step, blocking, from the Δ and buffers it began with, and the end is the rule's, to the bit (a
    redo that re-read the model moved τ steps, or kept the failed attempt's buffers, would not be)."""
    results = elastic_run(12, fail={3: "all"}, **options)
    assert_groups_equal_reference(results, reference_for(options).run(12))
    unfailed = elastic_run(12, fail={}, **options)
    for (_, averager, membership, comm), (_, once, _, once_comm) in zip(results, unfailed, strict=True):
        assert membership.commits == once.counters.syncs + 1
        assert comm.exchange.calls == once_comm.exchange.calls + 1  # the redo: one fragment's exchange again
        assert averager.counters.syncs == once.counters.syncs


def test_a_group_that_lost_a_streamed_round_heals_to_the_global_model_where_it_was_applied():
    """2 fragments, τ = 1: commit 3 is fragment 1's, begun at step 4 and applied at 5; group 2 alone fails it and
    heals there from group 0's committed state: every fragment its anchor (its own progress since is dropped), the
    buffer group 0's; the end is the rule's with that heal, to the bit, every group on one model."""
    options = {"sync_fragments": 2, "sync_overlap": 1}
    results = elastic_run(12, fail={3: "2"}, **options)
    assert_groups_equal_reference(results, reference_for(options).run(12, heal_at=(2, 5)))
    assert [r[1].counters.syncs for r in results] == [1 + 6] * GROUPS


@pytest.mark.parametrize(
    ("options", "advice"),
    [
        ({}, "set eval_steps/save_steps to multiples of fed_sync_steps"),
        ({"sync_overlap": 1}, "evaluate after training"),
    ],
    ids=["blocking", "overlap"],
)
def test_the_global_model_between_averagings_is_refused_with_rounds_in_one_line_before_any_collective(options, advice):
    """With a membership the groups meet only in rounds: a lent global model at step 5 (H = 4) is refused on every
    rank alike, before any collective, with the advice that fits the schedule."""

    def rank_fn(comm: FederationCommunicator):
        comm, _ = with_membership(comm, {"published": threading.Event()}, {})
        model, optimizer = build(comm.group)
        averager = FederatedAverager(model, optimizer, communicator=comm, sync_steps=4, **options)
        for step in range(1, 6):
            train_step(model, optimizer, comm.group, step)
            averager.step()
        calls = comm.control.calls
        with pytest.raises(ConfigError) as caught, averager.global_model():
            pass
        assert comm.control.calls == calls
        return str(caught.value)

    for message in run_federation(GROUPS, rank_fn):
        assert message.startswith("hf_fedshard: at step 5 the global model is lent") and advice in message, message
        assert "\n" not in message


@pytest.mark.parametrize(
    "options", [{}, {"sync_fragments": 2, "sync_overlap": 1}], ids=["blocking", "2-fragments-overlap"]
)
def test_an_evaluation_between_averagings_is_a_round_that_lends_the_plain_mean_and_changes_nothing(options):
    """An evaluation at step 6 (H = 4; with 2 fragments, the step fragment 0 begins): a round of its own (one more
    commit) averages the groups' models as they are after step 6; `global_model` lends that mean without a
    collective and gives each group its own back; the run ends on the rule's values as without the evaluation."""

    def rank_fn(comm: FederationCommunicator):
        comm, membership = with_membership(comm, {"published": threading.Event()}, {})
        model, optimizer = build(comm.group)
        averager = FederatedAverager(model, optimizer, communicator=comm, sync_steps=4, **options)
        own = lent = None
        for step in range(1, 13):
            train_step(model, optimizer, comm.group, step)
            averager.step(evaluating=step == 6, last=step == 12)
            if step == 6:
                own = [t.detach().clone() for t in (*model.parameters(), model.stat)]
                calls = comm.control.calls, comm.peers.calls
                with averager.global_model(evaluating=True):
                    lent = [t.detach().clone() for t in (*model.parameters(), model.stat)]
                assert (comm.control.calls, comm.peers.calls) == calls
                assert all(torch.equal(a, b) for a, b in zip(own, (*model.parameters(), model.stat), strict=True))
        return [t.detach().clone() for t in (*model.parameters(), model.stat)], own, lent, membership.commits

    results = run_federation(GROUPS, rank_fn)
    assert_groups_equal_reference([(r[0],) for r in results], reference_for(options).run(12))
    owns = [r[1] for r in results]
    for g, (_, _, lent, commits) in enumerate(results):
        for i, tensor in enumerate(lent):
            mean = (owns[0][i] + owns[1][i] + owns[2][i]) / GROUPS
            assert torch.equal(tensor, mean), f"group {g} tensor {i}"
        assert commits == elastic_run(12, fail={}, **options)[g][2].commits + 1


def test_metrics_carry_the_transports_own():
    (_, averager, *_), *_ = elastic_run(4, fail={})
    assert averager.metrics()["fed_commits"] == 2


def test_the_card_says_how_many_groups_took_part_and_the_heals():
    history = [{"fed_groups_in_quorum": n, "fed_heals": h} for n, h in ((3, 0), (2, 0), (3, 1))]
    rows = dict(quorum_rows(history, 4, history[-1]))
    assert rows["Groups per averaging (fewest–most logged)"] == "2–3 of 4"
    assert rows["Groups healed from a live peer"] == "1"
    assert "Final averaging" not in rows
    history[-1].update(fed_groups_in_quorum=2, fed_groups_dropped=1)
    rows = dict(quorum_rows(history, 4, history[-1]))
    assert rows["Final averaging"] == (
        "2 groups, without 1 of the averaging before (they left or came late: the end of training's log line says "
        "which)"
    )


def test_the_trainer_state_taken_at_a_commit_is_asdicts_and_later_steps_do_not_change_it():
    """What a joining group is sent of the trainer state equals `dataclasses.asdict` at the commit (the JSON its
    resume folder holds), and steps and logs after the commit leave it as it was."""
    state = TrainerState(global_step=8, max_steps=24)
    state.log_history.append({"loss": 1.25, "step": 8})
    taken = trainer_state_now(state)
    assert json.dumps(taken, sort_keys=True) == json.dumps(dataclasses.asdict(state), sort_keys=True)
    state.global_step = 12
    state.log_history.append({"loss": 0.5, "step": 12})
    assert taken["global_step"] == 8 and taken["log_history"] == [{"loss": 1.25, "step": 8}]

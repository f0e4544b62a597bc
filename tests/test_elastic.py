"""``fed_transport torchft``: groups as separate launches that die and join between averagings.

In process (fast): the settings' refusals, and the engine's rounds on fake communicators with a fake membership
(a round that does not commit is redone and changes nothing; a group that lost a round the others committed takes a
peer's state and ends on the rule's value). Multi-process (torchrun launches + a lighthouse, gloo): the transport
equals the one-job mesh to the bit; a killed group leaves, the others average among themselves without restarting,
and the group, restarted by its launcher, heals and rejoins, reading its own data from the step it healed at.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from hf_fedshard import FederatedAverager, FedShardTrainingArguments
from hf_fedshard.engine.communicator import FederationCommunicator, Round
from hf_fedshard.errors import ConfigError

from .asserts import labelled
from .fake_communicator import BARRIER_TIMEOUT_S, run_federation
from .launch import finish, lighthouse, start_group, train_groups, train_tiny
from .test_engine import GROUPS, assert_groups_equal_reference, build, reference_for, train_step

ELASTIC = ["--fed_transport", "torchft", "--fed_lighthouse", "http://localhost:1"]


# ---- Settings ----


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fed_group_id", "0", "--fed_num_groups", "2"], r"^fed_transport torchft needs fed_lighthouse"),
        (["--fed_group_id", "2", "--fed_num_groups", "2"], r"^fed_group_id=2 must be in 0 … fed_num_groups - 1"),
        (["--fed_group_id", "0", "--fed_num_groups", "2", "--fed_group_size", "2"], r"^fed_group_size=2 but this"),
        (["--fed_group_id", "0", "--fed_num_groups", "2", "--eval_strategy", "steps", "--eval_steps", "6"],
         r"^eval_steps=6 is not a multiple of fed_sync_steps=8"),
        (["--fed_group_id", "0", "--fed_num_groups", "2", "--fed_sync_fragments", "2"],
         r"^fed_sync_fragments/fed_sync_overlap stream"),
        (["--fed_group_id", "0", "--fed_num_groups", "2", "--fed_eval_per_group", "true"],
         r"^load_best_model_at_end and fed_eval_per_group"),
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
    group, which then heals from group 0's `peer_state` published right after group 0 committed)."""

    def __init__(self, shared: dict, group: int, fail: dict[int, str]) -> None:
        self.shared, self.group, self.fail = shared, group, fail
        self.averager: FederatedAverager | None = None
        self.commits = self.rounds = 0

    def commit(self) -> bool:
        self.commits += 1
        who = self.fail.get(self.commits)
        return who is None or (who != "all" and int(who) != self.group)

    def next_round(self) -> Round:
        """Right after a round: group 0 publishes its state (as torchft sends it while the next quorum forms)."""
        self.rounds += 1
        who = self.fail.get(self.commits)
        if who not in (None, "all") and self.group == 0:
            self.shared["peer"] = self.averager.peer_state()
            self.shared["published"].set()
        if who not in (None, "all") and int(who) == self.group:
            assert self.shared["published"].wait(BARRIER_TIMEOUT_S)
            self.averager.load_peer_state(self.shared["peer"])
            return Round(healed=True, changed=True)
        return Round()

    def metrics(self) -> dict[str, float]:
        return {"fed_commits": self.commits}


def elastic_run(steps: int, fail: dict[int, str], **options) -> list:
    """`test_engine.engine_run` with a `FakeMembership` on every group's communicator."""
    shared = {"published": threading.Event()}
    options = {"sync_steps": 4, **options}

    def rank_fn(comm: FederationCommunicator):
        group = comm.group
        membership = FakeMembership(shared, group, fail)
        comm = FederationCommunicator(
            peers=comm.peers, control=comm.control, exchange=comm.exchange, timeout=comm.timeout, membership=membership
        )
        model, optimizer = build(group)
        membership.averager = averager = FederatedAverager(model, optimizer, communicator=comm, **options)
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


def test_metrics_carry_the_transports_own():
    (_, averager, *_), *_ = elastic_run(4, fail={})
    assert averager.metrics()["fed_commits"] == 2


# ---- Separate launches (torchrun + lighthouse) ----

TINY = ["--num_samples", "128"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="fedavg-fp32"),
        pytest.param(["--fed_outer_optimizer", "nesterov", "--fed_sync_dtype", "int8"], id="nesterov-int8"),
    ],
)
def test_torchft_equals_the_one_job_mesh_to_the_bit(tmp_path, extra):
    """2 groups × 2 ranks, H = 4, 10 steps (the last averaging at the end): the same shards, logs and evaluation
    as one job of 4 ranks with fed_group_size 2 (the same data: group G reads slice G of 2)."""
    common = [*TINY, "--max_steps", "10", "--fed_sync_steps", "4", *extra]
    with lighthouse(min_groups=2) as address:
        groups = train_groups(2, 2, tmp_path / "ft", common, address)
    mesh = train_tiny(4, tmp_path / "mesh", [*common, "--fed_group_size", "2"])
    for g in range(2):
        for r in range(2):
            ours, theirs = groups[g][r], mesh[2 * g + r]
            assert ours["seen"] == theirs["seen"], labelled(f"group {g} rank {r}: samples read")
            for name, value in ours["local_params"].items():
                torch.testing.assert_close(
                    value, theirs["local_params"][name], rtol=0, atol=0, msg=labelled(f"group {g} rank {r} {name}")
                )
            assert ours["eval"]["eval_loss"] == theirs["eval"]["eval_loss"]
    losses = [[h["loss"] for h in groups[0][0]["log_history"] if "loss" in h] for _ in range(1)]
    assert losses == [[h["loss"] for h in mesh[0]["log_history"] if "loss" in h]]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_group_leaves_and_heals_back_while_the_others_go_on(tmp_path):
    """3 groups × 2 ranks, H = 4, 48 steps (two epochs). Group 1's rank 0 is SIGKILLed as step 6 begins; its
    torchrun ends the group and restarts it. The others never restart: their averaging of step 8 fails, is
    redone by the two of them (the mean of their own two Δ, exactly), and they go on. Group 1 heals from a live
    group right after an averaging, resumes there and reads the samples its ranks read in one job of 3 groups from
    that step on. All three end on one global model."""
    common = [*TINY, "--num_samples", "512", "--max_steps", "48", "--fed_sync_steps", "4", "--step_sleep_s", "0.4",
              "--record_syncs", "true", "--fed_timeout_s", "30"]  # fmt: skip
    kill = ["--kill_at_step", "6", "--fault_rank", "0", "--fault_group", "1"]
    with lighthouse(min_groups=1) as address:
        launches = [
            start_group(g, 3, 2, tmp_path, [*common, *(kill if g == 1 else [])], address, max_restarts=int(g == 1))
            for g in range(3)
        ]
        results = [finish(launch, 600) for launch in launches]
    for g, result in enumerate(results):
        assert result.returncode == 0, f"group {g}:\n{result.stdout[-6000:]}"
    dumps = [
        [torch.load(tmp_path / f"dump{g}" / f"rank{r}.pt", weights_only=False) for r in range(2)] for g in range(3)
    ]
    healed_at = dumps[1][0]["started_at_step"]
    assert [dumps[g][0]["started_at_step"] for g in (0, 2)] == [0, 0]  # the survivors never restarted
    assert healed_at > 6 and healed_at % 4 == 0
    quorum = {h["step"]: h["fed_groups_in_quorum"] for h in dumps[0][0]["log_history"] if "fed_groups_in_quorum" in h}
    assert quorum[4] == 3 and quorum[9] == 2 and quorum[48] == 3, quorum
    assert dumps[0][0]["log_history"][-3]["fed_heals"] == 1
    for r in range(2):
        deltas = {g: dumps[g][r]["sync_exchanges"][8][0] for g in (0, 2)}
        for g in (0, 2):  # the redone averaging of step 8: the mean over the two groups alive
            for got, d0, d2 in zip(dumps[g][r]["sync_exchanges"][8][1], deltas[0], deltas[2], strict=True):
                torch.testing.assert_close(got, (d0 + d2) / 2, rtol=0, atol=0, msg=labelled(f"group {g} rank {r}"))
        for g in (1, 2):
            for name, value in dumps[g][r]["local_params"].items():
                torch.testing.assert_close(
                    value, dumps[0][r]["local_params"][name], rtol=0, atol=0, msg=labelled(f"group {g} {name}")
                )
    one_job = train_tiny(6, tmp_path / "mesh", [*common[:-4], "--fed_group_size", "2", "--step_sleep_s", "0"])
    for r in range(2):
        per_step = 2  # per_device_train_batch_size
        tail = one_job[2 + r]["seen"][healed_at * per_step :]
        assert dumps[1][r]["seen"] == tail, labelled(f"group 1 rank {r}: samples read after the heal at {healed_at}")

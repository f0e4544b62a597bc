"""A transport written outside the package (tests/store_transport.py: a launch per group, meeting at a TCPStore this
test hosts), registered through `hf_fedshard.transports.register_transport` by the training script: the Trainer
runs it end to end, every averaging a round voted through the store by its own membership, with no file under
hf_fedshard/ naming it, and its two groups end where one job of the same two groups (the mesh) ends, to the bit;
also when one group is killed mid-run and heals back from the other. (Its membership also runs the round
protocol's fault schedules in the simulator: tests/unit/test_round_simulator.py.)"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ..asserts import labelled
from ..launch import SCRIPTS, SGD, finish, start_torchrun


def store_groups(tmp_path, extra: dict[int, list], max_restarts: dict[int, int] | None = None) -> list:
    """Two launches of 2 ranks (H = 4, 10 steps, as `one_job_h4`) meeting at a TCPStore hosted here; ``extra``:
    each group's further arguments. Each group's ranks' dumps."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    launches = []
    for g in range(2):
        options = json.dumps({"group_id": g, "num_groups": 2, "store": f"127.0.0.1:{store.port}"})
        args = ["--output_dir", tmp_path, "--dump_dir", tmp_path / f"dump{g}", *SGD, "--num_samples", "128",
                "--max_steps", "10", "--fed_sync_steps", "4", "--transport_module", "tests.store_transport",
                "--fed_transport", "store", "--fed_transport_options", options, *extra.get(g, [])]  # fmt: skip
        launches.append(start_torchrun(2, SCRIPTS / "train_tiny.py", args, (max_restarts or {}).get(g, 0)))
    results = [finish(launch, 300) for launch in launches]
    for g, result in enumerate(results):
        assert result.returncode == 0, f"group {g}:\n{result.stdout[-6000:]}"
    return [[torch.load(tmp_path / f"dump{g}" / f"rank{r}.pt", weights_only=False) for r in range(2)] for g in range(2)]


@pytest.mark.timeout(400)
def test_a_transport_registered_from_outside_trains_two_groups_as_one_job_does(tmp_path, one_job_h4):
    dumps = store_groups(tmp_path, {})
    for g in range(2):
        assert (tmp_path / f"fed_group{g}").is_dir(), "a launch per group writes under output_dir/fed_group{G}"
        for r in range(2):
            ours = dumps[g][r]
            theirs = one_job_h4[2 * g + r]
            assert ours["seen"] == theirs["seen"], labelled(f"group {g} rank {r}: samples read")
            for name, value in ours["local_params"].items():
                torch.testing.assert_close(
                    value, theirs["local_params"][name], rtol=0, atol=0, msg=labelled(f"group {g} rank {r} {name}")
                )
            syncs = [h["fed_syncs"] for h in ours["log_history"] if "fed_syncs" in h]
            assert syncs[-1] == 4, syncs  # the initial weights', steps 4 and 8, and the end (10)
            quorum = [h["fed_groups_in_quorum"] for h in ours["log_history"] if "fed_groups_in_quorum" in h]
            assert quorum and set(quorum) == {2}, quorum  # its membership's metrics reach the logs


@pytest.mark.timeout(400)
def test_a_group_killed_mid_run_heals_from_the_other_through_the_store_and_both_end_as_one_job(tmp_path, one_job_h4):
    """Group 1's rank 0 is SIGKILLed as step 6 begins and torchrun restarts the group: its new launch claims a place in
    the open quorum and then supersedes the dead one at the store, so group 0's averaging of step 8 fails at once
    instead of after fed_timeout_s, and the two meet in that quorum however slow the restart (under load, a restart
    that superseded before it claimed once left group 0 to redo step 8 alone). Group 1 heals there from group 0's
    state committed at step 4 (each rank its own shard through the store), trains steps 5-8 again on the samples it
    read the first time, and the averaging of step 8 is redone by both. Both groups then end where one job ends, to
    the bit."""
    kill = ["--kill_at_step", "6", "--fault_rank", "0", "--fault_group", "1", "--fed_timeout_s", "60"]
    dumps = store_groups(tmp_path, {0: ["--fed_timeout_s", "60"], 1: kill}, max_restarts={1: 1})
    assert [dumps[g][0]["started_at_step"] for g in range(2)] == [0, 4]  # group 1: healed to step 4's commit
    per_step = len(one_job_h4[0]["seen"]) // 10
    for g in range(2):
        for r in range(2):
            theirs = one_job_h4[2 * g + r]
            start = dumps[g][0]["started_at_step"] * per_step
            assert dumps[g][r]["seen"] == theirs["seen"][start:], labelled(f"group {g} rank {r}: samples read")
            for name, value in dumps[g][r]["local_params"].items():
                torch.testing.assert_close(
                    value, theirs["local_params"][name], rtol=0, atol=0, msg=labelled(f"group {g} rank {r} {name}")
                )
    history = dumps[1][0]["log_history"]
    assert [h["fed_heals"] for h in history if "fed_heals" in h][-1] == 1, history  # its own heal, counted once

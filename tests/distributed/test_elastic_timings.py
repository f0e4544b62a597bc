"""``fed_transport torchft`` when faults arrive at awkward moments, with real launches: a group back within seconds
(before the quorum without it formed), a group started again while the lighthouse still knows its dead launch,
and every group resumed from checkpoints 0, 5 and 10 s apart. Each must end with every group on one model and one
averaging count. The same timings, and hundreds more, run in process in tests/unit/test_round_simulator.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ..asserts import labelled
from ..launch import Background, finish, kill_tree, launched, lighthouse, start_group

FAST_SGD = ["--num_samples", "128", "--fed_sync_steps", "4", "--fed_timeout_s", "60", "--record_syncs", "false"]


def export(out_dir: Path, group: int) -> list[str]:
    """Where group ``group`` saves its final model (``save_model``), for `assert_one_model`."""
    return ["--export_dir", str(out_dir / f"model{group}")]


def assert_one_model(out_dir: Path, groups: int, ranks: int) -> None:
    """Every group saved the same weights (sha256 of ``model.safetensors``), every group's rank r holds the same
    parameters, and every rank counted the same averagings."""
    digests = {g: hashlib.sha256((out_dir / f"model{g}" / "model.safetensors").read_bytes()).hexdigest()
               for g in range(groups)}  # fmt: skip
    assert len(set(digests.values())) == 1, digests
    dumps = [
        [torch.load(out_dir / f"dump{g}" / f"rank{r}.pt", weights_only=False) for r in range(ranks)]
        for g in range(groups)
    ]
    syncs = {(g, r): dumps[g][r]["fed_counters"]["syncs"] for g in range(groups) for r in range(ranks)}
    assert len(set(syncs.values())) == 1, syncs
    for g in range(1, groups):
        for r in range(ranks):
            for name, value in dumps[g][r]["local_params"].items():
                torch.testing.assert_close(
                    value, dumps[0][r]["local_params"][name], rtol=0, atol=0, msg=labelled(f"group {g} rank {r} {name}")
                )


@pytest.mark.timeout(600)
def test_a_worker_restarted_by_torchrun_within_seconds_heals_in_phase(tmp_path):
    """2 groups × 2 ranks, H = 4, 24 steps, a lighthouse that forms quorums of both groups only (so that neither
    goes on alone however slow the machine). Group 1's rank 0 is SIGKILLed as step 10 begins and torchrun brings the
    group back at once (preloaded: in about 2 s), while group 0's averaging of step 12 fails and waits for a quorum.
    The restarted group heals from the state group 0 committed at step 8 (not from its live state of step 12),
    trains 9–12 and averages with it; both end on one model with one count (issue 30, failure 1). Both save a
    checkpoint every 8 steps: the healed group's first one (step 16) is written whole."""
    common = [*FAST_SGD, "--max_steps", "24", "--step_sleep_s", "0.2", "--save_strategy", "steps", "--save_steps", "8"]
    kill = ["--kill_at_step", "10", "--fault_rank", "0", "--fault_group", "1"]
    with lighthouse(min_groups=2, heartbeat_timeout_s=5.0) as address:
        launches = [
            start_group(
                g, 2, 2, tmp_path, [*common, *export(tmp_path, g), *(kill if g == 1 else [])], address, max_restarts=g
            )
            for g in range(2)
        ]
        results = [finish(launch, 500) for launch in launches]
    for g, result in enumerate(results):
        assert result.returncode == 0, f"group {g}:\n{result.stdout[-6000:]}"
    assert "healed from a live group: resuming at step 8 " in results[1].stdout, results[1].stdout[-3000:]
    assert_one_model(tmp_path, 2, 2)
    for step in (16, 24):
        state = json.loads((tmp_path / "fed_group1" / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert (state["global_step"], set(state["stateful_callbacks"])) == (step, {"TrainerControl"}), state


@pytest.mark.timeout(600)
def test_a_group_started_again_while_its_dead_launch_is_known_joins(tmp_path):
    """3 groups × 1 rank, a lighthouse that forms quorums of all three only (the survivors wait for group 2 instead
    of finishing without it on a slow machine). Group 2's worker stops as step 6 begins and the test SIGKILLs its
    whole launch (torchrun and worker, as a lost node); the same group is launched again 1 s later, while the
    lighthouse still knows the dead launch (heartbeats time out after 5 s). It is not refused as a second
    fed_group_id=2: it heals and all three end on one model (issue 30, failure 2)."""
    common = [*FAST_SGD, "--max_steps", "24", "--step_sleep_s", "0.3"]
    with lighthouse(min_groups=3, heartbeat_timeout_s=5.0) as address:
        survivors = [Background(start_group(g, 3, 1, tmp_path, [*common, *export(tmp_path, g)], address), 500)
                     for g in range(2)]  # fmt: skip
        doomed = start_group(2, 3, 1, tmp_path, [*common, "--stop_at_step", "6", "--fault_rank", "0"], address)
        wait_until_a_worker_stops(doomed, 300)
        kill_tree(doomed)
        assert finish(doomed, 60).returncode != 0
        time.sleep(1.0)
        again = finish(start_group(2, 3, 1, tmp_path, [*common, *export(tmp_path, 2)], address), 500)
        results = [b.result() for b in survivors]
    for g, result in enumerate([*results, again]):
        assert result.returncode == 0, f"group {g}:\n{result.stdout[-6000:]}"
    assert "two launches claim" not in again.stdout
    assert_one_model(tmp_path, 3, 1)


def wait_until_a_worker_stops(launch: subprocess.Popen, timeout_s: float) -> int:
    """Until a process below ``launch`` is stopped (SIGSTOP: state ``T`` in /proc); its pid."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in launched(launch):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                    return pid
        time.sleep(0.2)
    raise TimeoutError("no worker of the launch stopped")


@pytest.mark.timeout(600)
def test_a_full_resume_with_groups_started_seconds_apart_averages_together(tmp_path):
    """3 groups × 1 rank checkpoint every 4 steps; the lighthouse is killed once every group has checkpoint-8, so
    every group fails at its next averaging. A new lighthouse, and the groups resumed (fed_auto_resume) 0, 5 and
    10 s apart: the first ones wait for the others at their first quorum (up to fed_timeout_s, 60 s here), the norms
    saved for 3 groups never meet a smaller quorum, and all three end on one model with one count (issue 30,
    failure 3)."""
    common = [*FAST_SGD, "--max_steps", "20", "--save_strategy", "steps", "--save_steps", "4",
              "--fed_auto_resume", "true"]  # fmt: skip
    with lighthouse(min_groups=1) as address:
        first = [*common, "--step_sleep_s", "0.5", "--fed_timeout_s", "20"]  # each fails 20 s after the loss
        launches = [start_group(g, 3, 1, tmp_path, first, address) for g in range(3)]
        deadline = time.monotonic() + 300
        while not all((tmp_path / f"fed_group{g}" / "checkpoint-8").exists() for g in range(3)):
            assert time.monotonic() < deadline, "no checkpoint-8 in every group"
            time.sleep(0.3)
    for launch in launches:
        assert finish(launch, 120).returncode != 0
    with lighthouse(min_groups=1) as address:
        resumed = []
        for g in range(3):
            resumed.append(Background(start_group(g, 3, 1, tmp_path, [*common, *export(tmp_path, g)], address), 500))
            time.sleep(5.0 if g < 2 else 0.0)
        results = [b.result() for b in resumed]
    for g, result in enumerate(results):
        assert result.returncode == 0, f"group {g}:\n{result.stdout[-6000:]}"
        dump = torch.load(tmp_path / f"dump{g}" / "rank0.pt", weights_only=False)
        assert dump["started_at_step"] >= 8, f"group {g} started at {dump['started_at_step']}"
    assert_one_model(tmp_path, 3, 1)

"""A launch's start and end under plain torchrun (fresh interpreters; the tests' preloaded launcher forks its workers
into torchrun's own session, which would hide what a user meets): `hf_fedshard.launch_guard`.

A worker whose torchrun is SIGKILLed ends within seconds, saying so, and the group's relaunch heals; a restart that
shares torchrun's store is warned of at the first start and explained when it fails; a world whose set-up waits for
a rank that never comes ends in one line at the deadline. The in-process half is tests/unit/test_launch_guard.py.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from ..asserts import labelled
from ..launch import SCRIPTS, Background, finish, lighthouse, start_group, start_torchrun

COMMON = ["--num_samples", "256", "--max_steps", "48", "--fed_sync_steps", "4", "--step_sleep_s", "0.25",
          "--fed_timeout_s", "30"]  # fmt: skip


@pytest.mark.timeout(400)
def test_a_group_whose_torchrun_is_killed_ends_at_once_and_its_relaunch_heals(tmp_path):
    """2 groups × 1 rank (torchft). Group 1's worker SIGKILLs its own torchrun as step 6 begins; the worker, alone in
    its session, ends within seconds with one line (before: it trained on, and the relaunch was refused as a second
    claim of fed_group_id=1). Relaunched 5 s later, group 1 heals from group 0 (held at step 10 until the relaunch
    starts) at one of its averagings, and both end on one model, the last averaging with both groups."""
    back = tmp_path / "group1-relaunched"
    hold = ["--hold_at_step", "10", "--hold_until", back]
    with lighthouse(min_groups=1) as address:
        survivor = Background(start_group(0, 2, 1, tmp_path, [*COMMON, *hold], address, preloaded=False), 300)
        kill = ["--kill_launcher_at_step", "6", "--fault_rank", "0"]
        killed = start_group(1, 2, 1, tmp_path, [*COMMON, *kill], address, preloaded=False)
        first = finish(killed, 240)  # once its output closed: torchrun SIGKILLed, and the orphaned worker ended
        time.sleep(5)
        relaunch = start_group(1, 2, 1, tmp_path, [*COMMON, "--start_marker", back], address, preloaded=False)
        second, kept = finish(relaunch, 300), survivor.result()
    # Said by the worker's watch (every 0.5 s): had it not ended, the launch's keeper would have stopped it after 5 s
    # without a word (tests.launch, benchmarks.harness.process_tree).
    line = r"hf_fedshard: rank 0: the launcher that started this worker \(pid \d+\) is gone; ending this worker"
    assert len(re.findall(line, first.stdout)) == 1, first.stdout[-3000:]
    assert second.returncode == 0 and kept.returncode == 0, second.stdout[-3000:] + kept.stdout[-3000:]
    dumps = [torch.load(tmp_path / f"dump{g}" / "rank0.pt", weights_only=False) for g in range(2)]
    healed_at = dumps[1]["started_at_step"]
    assert dumps[0]["started_at_step"] == 0 and healed_at > 8 and healed_at % 4 == 0, second.stdout[-6000:]
    quorum = {h["step"]: h["fed_groups_in_quorum"] for h in dumps[0]["log_history"] if "fed_groups_in_quorum" in h}
    assert quorum[8] == 1 and quorum[48] == 2, quorum
    for name, value in dumps[1]["local_params"].items():
        torch.testing.assert_close(value, dumps[0]["local_params"][name], rtol=0, atol=0, msg=labelled(name))


@pytest.mark.timeout(300)
def test_a_shared_restart_store_is_named_and_a_setup_that_waits_ends_at_its_deadline(tmp_path):
    """Two 2-rank launches at once. (1) --max-restarts 1 with torchrun's store shared: rank 0 warns once, at the first
    start; rank 1 crashes; the restarted workers read the dead ones' addresses and, depending on timing, fail at
    once or hang to the set-up deadline (either way in one line naming the fix), or set up. (2) Rank 1 never sets
    up: rank 0 ends after HF_FEDSHARD_SETUP_TIMEOUT_S=5 in one line, not after ddp_timeout (30 minutes)."""
    shared = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0", "HF_FEDSHARD_SETUP_TIMEOUT_S": "30"}  # after the imports
    script = SCRIPTS / "setup_guard.py"
    restart = Background(start_torchrun(2, script, ["--output_dir", tmp_path / "a", "--crash_rank", "1"], 1,
                                        preloaded=False, env=shared), 200)  # fmt: skip
    started = time.monotonic()
    waits = finish(start_torchrun(2, script, ["--output_dir", tmp_path / "b", "--absent_rank", "1"], preloaded=False,
                                  env={"HF_FEDSHARD_SETUP_TIMEOUT_S": "5"}), 200)  # fmt: skip
    waited_s = time.monotonic() - started
    restarted = restart.result().stdout
    warning = ("hf_fedshard: torchrun --max-restarts=1 shares its rendezvous store with the workers it restarts, which "
               "then read the dead workers' addresses")  # fmt: skip
    assert restarted.count(warning) == 1 and restarted.count("rank 1 set up on cpu:0 (attempt 0)") == 1, restarted
    failed = ("error: this worker, restarted by torchrun, could not set up the world's process group: torchrun "
              "shared its rendezvous store with it")  # fmt: skip
    stalled = ("the world's process group was not set up within 30 s: torchrun restarted it and shared its rendezvous "
               "store with it")  # fmt: skip
    explained = failed in restarted or stalled in restarted  # the restart failed at once, or hung to the deadline
    both_up = all(f"rank {r} set up on cpu:0 (attempt 1)" in restarted for r in range(2))
    assert both_up != explained, restarted[-4000:]
    assert waits.returncode != 0
    deadline = ("hf_fedshard: rank 0: the world's process group was not set up within 5 s: another rank never started, "
                "or started far later")  # fmt: skip
    assert waits.stdout.count(deadline) == 1 and waited_s < 60, (waited_s, waits.stdout[-3000:])

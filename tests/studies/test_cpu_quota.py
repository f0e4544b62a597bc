"""The CPU quotas of benchmarks/speed_rounds.py are real and leave nothing behind: a process in a cgroup of 0.2 of a
core gets 0.2 of a core; every cgroup is removed on exit, on SIGTERM, and (on the next start) after SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.harness.cpu_quota import CPU_ROOT, CpuGroups, unavailable

from ..launch import REPO

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

BUSY = "import time\nt = time.process_time()\nend = time.time() + 2\nwhile time.time() < end: pass\n" \
       "print(time.process_time() - t)"  # fmt: skip


def ours(pid: int) -> list[str]:
    return sorted(p.name for p in CPU_ROOT.glob(f"fsb{pid}q*"))


def test_a_quota_is_the_share_of_a_core_a_cgroup_gets_and_its_cgroups_go_at_exit():
    with CpuGroups(2, period_us=10_000) as cpu:
        cpu.set_quota(0, 0.2)  # group 1: no quota
        assert (cpu.path(0) / "cpu.cfs_quota_us").read_text().strip() == "2000"
        procs = [subprocess.Popen(cpu.wrap(g, [sys.executable, "-c", BUSY]), stdout=subprocess.PIPE, text=True)
                 for g in range(2)]  # fmt: skip
        used = [float(p.communicate(timeout=60)[0]) for p in procs]
        assert 0.3 < used[0] < 0.5 < used[1]  # 0.2 of a core for 2 s; without a quota, what the machine gives
        assert cpu.stat(0)["nr_throttled"] > 0 and cpu.stat(1)["nr_throttled"] == 0
        assert ours(os.getpid()) == [f"fsb{os.getpid()}q0", f"fsb{os.getpid()}q1"]
    assert ours(os.getpid()) == []


HARNESS = """
import subprocess, sys, time
from benchmarks.harness.cpu_quota import CpuGroups
from benchmarks.harness.netns import handle_termination
with handle_termination(), CpuGroups(2) as cpu:
    cpu.set_quota(1, 0.1)
    sleeper = subprocess.Popen(cpu.wrap(1, ["sleep", "120"]))
    time.sleep(0.5)
    print("ready", sleeper.pid, flush=True)
    time.sleep(120)
"""


def start_harness() -> tuple[subprocess.Popen, int]:
    """A process holding 2 cgroups, a sleeping process in one; returns it and the sleeper's pid."""
    proc = subprocess.Popen([sys.executable, "-c", HARNESS], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    word, pid = proc.stdout.readline().split()
    assert word == "ready" and len(ours(proc.pid)) == 2
    assert pid in Path(CPU_ROOT / f"fsb{proc.pid}q1" / "cgroup.procs").read_text().split()
    return proc, int(pid)


def test_sigterm_removes_the_cgroups_and_sigkill_leaves_them_to_the_next_start():
    proc, sleeper = start_harness()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert ours(proc.pid) == []  # the sleeper went back to the root cgroup, its cgroup was removed
    os.kill(sleeper, signal.SIGKILL)
    proc, sleeper = start_harness()
    proc.kill()  # no chance to clean up
    proc.wait(timeout=30)
    assert len(ours(proc.pid)) == 2
    os.kill(sleeper, signal.SIGKILL)
    time.sleep(0.2)
    with CpuGroups(1):
        assert ours(proc.pid) == []
    assert ours(os.getpid()) == []

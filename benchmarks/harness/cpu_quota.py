"""A CPU quota per launch: each federation group's processes in a cgroup of their own, throttled for real.

The Linux CFS bandwidth controller (cgroup v1 ``cpu`` controller, ``/sys/fs/cgroup/cpu``) lets the processes of a
cgroup run at most ``cpu.cfs_quota_us`` microseconds of CPU time in every ``cpu.cfs_period_us``: a quota of 40 ms per
100 ms period is 0.4 of a core, whatever the processes do, however many threads they run (see the kernel's
``Documentation/scheduler/sched-bwc.rst``). A group given 0.2 of a core computes half as fast as one given 0.4, with
no change to the training loop: a slower machine, not a sleep.

Layout, one cgroup per group, named after this process as the emulated cluster's namespaces are::

    /sys/fs/cgroup/cpu/fsb<pid>q<g>/    cpu.cfs_period_us = the period, cpu.cfs_quota_us = cores × period (-1: none)

A launch enters its cgroup before it starts anything (`CpuGroups.wrap`: ``sh -c 'echo $$ > …/cgroup.procs && exec
"$@"'``), so torchrun and every worker it forks are in it from their first instruction, with no race. Every cgroup
is removed on exit of the ``with`` block (its remaining processes moved back to the root cgroup first), also on an
exception, Ctrl-C or SIGTERM under `netns.handle_termination`; cgroups of an earlier run whose process died are
removed on start. ``cpu.stat`` counts the periods in which a cgroup was throttled (`CpuGroups.stat`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.netns import alive

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
_NAME = re.compile(r"^fsb(\d+)q\d+$")


def unavailable(root: Path = CPU_ROOT) -> str | None:
    """Why CPU quotas cannot be set here (not root, no cgroup v1 ``cpu`` controller), ``None`` when they can."""
    if os.geteuid() != 0:
        return "CPU quotas need root (cgroups)"
    if not (root / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {root}"
    return None


def _remove(path: Path, root: Path) -> bool:
    """Move what still runs in ``path`` to ``root``'s cgroup and remove ``path``; whether it is gone."""
    for _ in range(50):  # a process exiting right now may still be listed for a moment
        with contextlib.suppress(FileNotFoundError):
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # gone meanwhile
                    (root / "cgroup.procs").write_text(pid)
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.1)
    return not path.exists()


def remove_stale(root: Path = CPU_ROOT) -> list[str]:
    """Remove the cgroups an earlier run of this module left (its process gone, e.g. killed by SIGKILL)."""
    removed = []
    for path in root.glob("fsb*q*"):
        match = _NAME.match(path.name)
        if match and int(match.group(1)) != os.getpid() and not alive(int(match.group(1))) and _remove(path, root):
            removed.append(path.name)
    return removed


@dataclass
class CpuGroups:
    """``count`` cgroups of the ``cpu`` controller, each without a quota until `set_quota`; a context manager.

    Args:
        count: how many cgroups (one per federation group).
        period_us: the CFS period of every cgroup, in microseconds (the kernel's default is 100,000).
        root: where the ``cpu`` controller is mounted.
    """

    count: int
    period_us: int = 100_000
    root: Path = CPU_ROOT
    prefix: str = field(default_factory=lambda: f"fsb{os.getpid()}")
    created: list[Path] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if not 1_000 <= self.period_us <= 1_000_000:
            raise ValueError(f"period_us={self.period_us}: the kernel takes a CFS period of 1 ms to 1 s.")
        reason = unavailable(self.root)
        if reason is not None:
            raise PermissionError(f"{reason}: run the study as root on a machine with cgroup v1's cpu controller.")

    def path(self, group: int) -> Path:
        return self.root / f"{self.prefix}q{group}"

    def __enter__(self) -> CpuGroups:
        remove_stale(self.root)
        try:
            for group in range(self.count):
                path = self.path(group)
                path.mkdir()
                self.created.append(path)
                (path / "cpu.cfs_period_us").write_text(str(self.period_us))
                self.set_quota(group, None)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def quota_us(self, cores: float | None) -> int:
        """``cores`` of CPU time per period, in microseconds (-1: no quota); the kernel's minimum is 1 ms."""
        if cores is None:
            return -1
        quota = round(cores * self.period_us)
        if quota < 1_000:
            raise ValueError(f"{cores:g} cores of a {self.period_us} µs period is under the kernel's 1 ms minimum.")
        return quota

    def set_quota(self, group: int, cores: float | None) -> None:
        """Let ``group``'s processes use at most ``cores`` cores from now on (``None``: as much as they get)."""
        (self.path(group) / "cpu.cfs_quota_us").write_text(str(self.quota_us(cores)))

    def wrap(self, group: int, argv: list[str]) -> list[str]:
        """``argv`` run inside ``group``'s cgroup: the shell enters it, then becomes ``argv`` (same process)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path(group) / "cgroup.procs"), *argv]

    def stat(self, group: int) -> dict[str, int]:
        """``cpu.stat`` of ``group``: CFS periods elapsed with a quota, periods throttled, nanoseconds throttled."""
        lines = (self.path(group) / "cpu.stat").read_text().splitlines()
        values = dict(line.split() for line in lines if line.strip())
        return {key: int(values[key]) for key in ("nr_periods", "nr_throttled", "throttled_time") if key in values}

    def close(self) -> None:
        """Remove every cgroup made here (what still runs in one goes back to the root cgroup first)."""
        self.created = [path for path in self.created if not _remove(path, self.root)]
        if self.created:
            raise RuntimeError(f"could not remove cgroups {[str(p) for p in self.created]}; remove them with rmdir.")

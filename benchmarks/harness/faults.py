"""Launches of federation groups that a study kills and restarts: on localhost, or in the emulated cluster's nodes.

- `Hosts` starts a command where a group runs: localhost (`Localhost`) or a node of a `netns.Cluster`
  (`ClusterNodes`, one node per group, each with a host name of its own for torchft's managers);
- `torchrun` is the command of one launch (one group under ``fed_transport torchft``, one node of the job under
  ``mesh``), `start_lighthouse` the torchft Lighthouse's;
- a launch runs below a keeper (`process_tree.popen`); `process_tree.kill` is the fault of a lost node: SIGKILL to
  every process of the launch at once; `kill_worker` that of a crashed process: SIGKILL to one worker, which its
  torchrun restarts;
- `fault_schedule` says when: one group killed every ``interval_s`` seconds, restarted ``restart_s`` later.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from benchmarks.harness import REPO, TRAIN_SCRIPT, process_tree, torchrun_command
from benchmarks.harness.netns import Cluster
from benchmarks.harness.process_tree import cmdline, descendants, process_children

ENV = {
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": str(REPO),
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}  # fmt: skip  (restarts must not read the dead workers' store)


class Hosts(Protocol):
    """Where the launches of a study run."""

    def start(self, node: int, argv: Sequence[str], log: Path) -> subprocess.Popen: ...

    def address(self, node: int) -> str: ...


class Localhost:
    """Every launch on this machine's loopback (no shaped links)."""

    def start(self, node: int, argv: Sequence[str], log: Path) -> subprocess.Popen:
        with open(log, "a") as out:
            return process_tree.popen(argv, cwd=REPO, env={**os.environ, **ENV}, stdout=out, stderr=subprocess.STDOUT)

    def address(self, node: int) -> str:
        return "127.0.0.1"


@dataclass
class ClusterNodes:
    """Launch ``node`` in the emulated cluster's node ``node`` (its namespace; built with ``hostnames=True``)."""

    cluster: Cluster

    def start(self, node: int, argv: Sequence[str], log: Path) -> subprocess.Popen:
        return self.cluster.launch(node, argv, ENV, log)

    def address(self, node: int) -> str:
        return self.cluster.address(node)


LAUNCHERS = (b"torch.distributed.run", b"hf_fedshard.launch")  # torchrun, and torchrun with forked workers


def torchrun(nproc: int, args: Sequence[str], rendezvous: str | None = None, node_rank: int = 0, nodes: int = 1,
             max_restarts: int = 0, launcher: str | None = None) -> list[str]:  # fmt: skip
    """One launch of bench_train.py: ``--standalone`` (a torchft group), or node ``node_rank`` of ``nodes`` of one job
    whose c10d rendezvous is at ``rendezvous`` (HOST:PORT; ``mesh``, restarted as a whole by ``max_restarts``);
    ``launcher``: a module run instead of torchrun (`torchrun_command`): ``hf_fedshard.launch``, the same flags with
    workers forked after the imports."""
    where = ["--standalone"]
    if rendezvous is not None:
        where = [f"--nnodes={nodes}", f"--node_rank={node_rank}", "--rdzv-backend=c10d"]
        where.append(f"--rdzv-endpoint={rendezvous}")
    start = [sys.executable, "-m", launcher] if launcher else torchrun_command()
    return [*start, *where, f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}", str(TRAIN_SCRIPT), *args]  # fmt: skip


def start_lighthouse(hosts: Hosts, node: int, log: Path, join_timeout_s: float = 10.0,
                     heartbeat_timeout_s: float = 2.0, port: int = 0) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """A Lighthouse on ``node``, on ``port`` (0: a free one; min_groups 1: the federation goes on with the groups
    alive); returns it and its ``--fed_lighthouse`` value, once it listens."""
    argv = [sys.executable, "-m", "hf_fedshard.lighthouse", "--port", str(port), "--min_groups", "1",
            "--join_timeout_s", str(join_timeout_s), "--heartbeat_timeout_s", str(heartbeat_timeout_s)]  # fmt: skip
    # Its quorum log (stderr) goes to a file of its own: unbuffered, it could land inside the address line.
    stderr_to = ["sh", "-c", 'exec "$@" 2>>"$0"', str(log.with_suffix(".stderr.log"))]
    proc = hosts.start(node, [*stderr_to, *argv], log)
    deadline = time.monotonic() + 60
    while "--fed_lighthouse" not in (text := log.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            process_tree.kill(proc)
            raise RuntimeError(f"the lighthouse did not start; its log ({log}):\n{text[-2000:]}")
        time.sleep(0.2)
    listening = text.split("--fed_lighthouse", 1)[1].split()[0].rsplit(":", 1)[1]
    return proc, f"http://{hosts.address(node)}:{listening}"


def kill_worker(proc: subprocess.Popen) -> int:
    """SIGKILL one worker of a launch (the lowest-numbered child of its torchrun, rank 0 as a rule), leaving torchrun
    to restart the group's workers as it does after a crash; the worker's pid. The agent is the topmost process
    naming a launcher: ``hf_fedshard.launch``'s workers are forked from it and bear its command line."""
    children = process_children()  # below the launch's keeper, whose own command line names torchrun too
    below = descendants(proc.pid, children=children)  # an ancestor before its descendants
    agents = [pid for pid in below if any(name in cmdline(pid) for name in LAUNCHERS)]
    workers = children.get(agents[0], []) if agents else []
    if not workers:
        raise RuntimeError(f"the launch {proc.pid} has no worker to kill (it ended with {proc.poll()})")
    os.kill(min(workers), signal.SIGKILL)
    return min(workers)


@dataclass(frozen=True)
class Fault:
    """Group ``group`` is killed at ``kill_s`` and restarted at ``restart_s`` (seconds after the run's start)."""

    group: int
    kill_s: float
    restart_s: float


def fault_schedule(run_s: float, interval_s: float, restart_s: float, victims: Sequence[int]) -> list[Fault]:
    """A kill in the middle of every ``interval_s`` seconds (at T/2, 3T/2, …: a run of n·T seconds holds exactly n
    faults, so its failure rate is 1/T), each restarted ``restart_s`` later, the victims taken in turn; none whose
    restart would fall after ``run_s``."""
    faults, kill_s = [], interval_s / 2
    while kill_s + restart_s < run_s:
        faults.append(Fault(victims[len(faults) % len(victims)], kill_s, kill_s + restart_s))
        kill_s += interval_s
    return faults

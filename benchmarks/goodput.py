"""Goodput under failures: a fault every T seconds, torchft's federation of launches against a job restart.

    sudo python -m benchmarks.goodput --quick      # 4 groups × 1 rank, T = 30 s, 60 s runs, under 15 minutes
    sudo python -m benchmarks.goodput              # 4 groups × 2 ranks, T = 120 s, 240 s runs, under 45 minutes
    sudo python -m benchmarks.goodput --intervals-s 30 60 120 --faults launch     # the failure-rate sweep
    sudo python -m benchmarks.goodput --paths torchft torchft-overlap-int8 --faults worker launch --repeats 2
                                                   # the overlapped int8 averaging against the blocking one
    sudo python -m benchmarks.goodput --paths torchft torchft-overlap-int8 --faults none --run-s 120 --repeats 3
                                                   # their throughput alone, without failures
    sudo python -m benchmarks.goodput --paths torchft torchft-save4 torchft-async4 --faults full
                                                   # full restarts: checkpoints every 16 steps, every 4, every 4 in
                                                   # the background (the seconds lost, split by whose they are)
    sudo python -m benchmarks.goodput --quick --groups 2 --run-s 6 --intervals-s 5 --restart-s 1 --stagger-s 1 \
        --faults full                              # the smoke the tests run: 1 fault a run, 4 runs of 6 s

On the emulated cluster (benchmarks/harness/netns.py: a network namespace per group, 100 Mbit/s links between
them), 4 federation groups train the ``micro`` Llama on Shakespeare (benchmarks/harness/bench_train.py, H = 8,
``fed_timeout_s`` 30 s, a checkpoint every K = 16 steps). Every T seconds of training a fault strikes (in the middle
of each T: at T/2, 3T/2, …, so a run of n·T seconds holds n faults), of one of three kinds (``--faults``):

- ``worker``: one worker process of a group is SIGKILLed, as a crash; the group's torchrun (``--max-restarts``)
  restarts its workers within a second or two, as in production;
- ``launch``: a group's whole launch (torchrun and its workers) is SIGKILLed, as a lost node, and started again R
  seconds later with the same command;
- ``full``: every launch, and torchft's lighthouse, is SIGKILLed (a lost coordinator, or a job cancelled); the
  lighthouse is started again R seconds later and the groups one by one, ``--stagger-s`` apart (group g at
  R + g × stagger), all with ``fed_auto_resume``, as a scheduler requeues a job.

The victims of ``worker`` and ``launch`` are groups 1, 2, 3 in turn (group 0's node hosts the lighthouse and the job's
rendezvous; with ``--groups G``, groups 1 … G-1). At the end of a run the study writes one step S (past every group's)
to the launches' stop file; every group stops at its averaging of S and writes the SHA-256 of its shards, so the table
says whether the groups ended on one model. The paths (``--paths``, default ``torchft mesh``):

- ``torchft``: ``--fed_transport torchft``, one torchrun per group, a lighthouse (``--min_groups 1``,
  ``--join_timeout_s 10``, ``--heartbeat_timeout_s 2``) on node 0; the survivors go on averaging among themselves,
  the restarted group heals from a live one and rejoins;
- ``torchft-overlap-int8``: the same with the README's performance tips, ``--fed_sync_overlap 1 --fed_sync_dtype
  int8`` (each averaging's exchange runs while the next step trains; a round that loses a group is redone at its
  apply step);
- ``torchft-save4``, ``torchft-async4``: torchft with a checkpoint every 4 steps instead of K (the last 4 kept),
  written synchronously or in the background (``--fed_async_checkpoint``): with ``--faults full``, what checkpointing
  more often saves a full restart, and what it costs without failures. Their table splits each full restart's seconds
  lost per group into the study's (R and the stagger), the start-up's and the rollback's;
- ``torchft-forked``: torchft launched by ``python -m hf_fedshard.launch`` instead of torchrun (the same flags):
  the workers it starts, and those it restarts after a ``worker`` fault, are forked after the imports;
  ``torchft-forked-async4`` adds ``torchft-async4``'s checkpoints: both cuts of a full restart's loss at once;
- ``mesh``: today's path, one job of 4 nodes (``torchrun --nnodes 4 --rdzv-backend c10d --max-restarts 100``) with
  ``--fed_auto_resume`` and a checkpoint every K = 16 steps: a killed group stops every group, torchrun restarts
  the whole job once the node is back, and it resumes from the newest checkpoint.

Goodput is counted in group-steps: steps committed to the global model, summed over groups, ÷ the group-steps the
same path makes in the same wall time without failures (a run of its own, in the same repetition). All groups share
this machine's 2 cores, so a killed group frees CPU for the others, and a wall-clock throughput would credit the
survivors with its share; group-steps count only work that made it into the global model. Committed: with torchft,
a group's steps since its previous averaging count when it completes the next one (a killed group loses the steps
since its last averaging); with mesh, the job's last averaged step counts for every group, and a kill rolls it back
to the newest checkpoint. The clock starts at the first training step; steps not yet averaged when the run is
stopped count for neither path.

Also reported, per failure: the survivors' longest stall (the longest gap between two averagings of a group that
was not killed, from the kill to the next fault; mesh: of the job) against ``fed_timeout_s`` + one averaging
interval; and how long a restarted group takes to be back (from its restart to its first averaging; mesh: the job's
first averaging after the restart). Without network namespaces (not root, no iproute2) every group runs on
localhost, which the results say.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.harness import faults, progress, report
from benchmarks.harness.faults import ClusterNodes, Fault, Hosts, Localhost
from benchmarks.harness.methods import BenchConfig, prepare_data
from benchmarks.harness.netns import Cluster, handle_termination
from benchmarks.harness.process_tree import kill
from benchmarks.harness.study import Study, add_folder_options, new_parser

# Each path: its transport, and the settings it adds to every launch. ``torchft-overlap-int8`` is the README's
# performance tips (an int8 payload exchanged while the next τ = 1 steps train) on torchft's elastic groups.
ASYNC4 = ["--save_steps", "4", "--save_total_limit", "4", "--fed_async_checkpoint", "true"]
PATHS = {
    "torchft": ("torchft", []),
    "torchft-overlap-int8": ("torchft", ["--fed_sync_overlap", "1", "--fed_sync_dtype", "int8"]),
    "mesh": ("mesh", []),
    # Checkpoints 4 times as often (K = 4, kept for more than one averaging interval, so that a full restart finds a
    # step every group published), synchronous or written in the background: what a full restart rolls back.
    "torchft-save4": ("torchft", ["--save_steps", "4", "--save_total_limit", "4"]),
    "torchft-async4": ("torchft", ASYNC4),
    # torchft launched by `python -m hf_fedshard.launch`: a restarted worker is forked after the imports; and the
    # same with background checkpoints every 4 steps: both of the project's cuts to a full restart's loss at once.
    "torchft-forked": ("torchft", []),
    "torchft-forked-async4": ("torchft", ASYNC4),
}
LAUNCHER = dict.fromkeys(("torchft-forked", "torchft-forked-async4"), "hf_fedshard.launch")  # others: torchrun
RESTART_CUTS = ("torchft-async4", "torchft-forked-async4")  # meant to halve torchft's own share of a full restart
WORKER_BACK_S = 9.0  # a worker restarted by torchrun back in the federation (issue 43's target; 17.6 s before)
FASTER_PATHS = ("torchft-overlap-int8",)  # meant to train faster than blocking torchft: its tokens/s target
FAULTS = ("worker", "launch", "full")
LOSSES = ("imposed_s", "startup_s", "rollback_s")  # a full restart's seconds lost per group (`full_restart_losses`)
BLOCK_SIZE = BenchConfig().block_size  # tokens per sample of `prepare_data`'s blocks


@dataclass
class GoodputConfig:
    """One study: the federation, the faults, the two paths' settings."""

    groups: int = 4
    ranks_per_group: int = 2
    intervals_s: tuple[float, ...] = (120.0,)  # T: a fault every T seconds of training
    faults: tuple[str, ...] = FAULTS
    paths: tuple[str, ...] = ("torchft", "mesh")
    restart_s: float = 10.0  # R: a killed launch (``full``: the lighthouse) is started again R seconds later
    stagger_s: float = 5.0  # ``full``: group g is started g × this after the lighthouse
    run_s: float = 240.0  # training wall time of every run (from the first step): 2 faults at T = 120 s
    repeats: int = 1  # each fault is a sample of the stall and the return; the 8 runs take ~40 minutes
    sync_steps: int = 8  # H
    save_steps: int = 16  # K: mesh's checkpoints
    fed_timeout_s: float = 30.0
    # The lighthouse holds a quorum this long for a group that heartbeats but has not asked (hf_fedshard's default).
    join_timeout_s: float = 10.0
    rate_mbit: float = 100.0
    model_size: str = "micro"
    batch_size: int = 4
    victims: tuple[int, ...] = (1, 2, 3)  # group 0 hosts the lighthouse and the rendezvous
    startup_timeout_s: float = 240.0  # a run whose training has not started by then fails
    stop_timeout_s: float = 150.0  # the launches still up this long after the stop file are killed

    def validate(self) -> None:
        if self.save_steps % self.sync_steps:
            raise ValueError(f"--save-steps={self.save_steps} must be a multiple of H={self.sync_steps}.")
        if max(self.victims) >= self.groups or 0 in self.victims:
            raise ValueError(f"victims {self.victims} must be groups 1 … {self.groups - 1}.")
        if self.faults and not all(self.restart_s < t < self.run_s for t in self.intervals_s):
            raise ValueError(f"every interval must lie between R={self.restart_s} s and the run, {self.run_s} s.")
        if unknown := set(self.faults) - set(FAULTS):
            raise ValueError(f"--faults {' '.join(sorted(unknown))}: the kinds are {', '.join(FAULTS)}.")
        if unknown := set(self.paths) - set(PATHS):
            raise ValueError(f"--paths {' '.join(sorted(unknown))}: the paths are {', '.join(PATHS)}.")
        if not self.paths or len(set(self.paths)) != len(self.paths):
            raise ValueError(f"--paths {' '.join(self.paths)}: name each path once.")


def elastic(path: str) -> bool:
    """Whether ``path`` runs a launch per group under torchft (else one mesh job)."""
    return PATHS[path][0] == "torchft"


@dataclass
class Run:
    """One run of one path: its faults (as injected, seconds from the first step) and what each launch logged."""

    path: str
    interval_s: float | None  # None: the run without failures
    fault: str | None = None  # one of FAULTS; None: the run without failures
    t0: float = 0.0  # time.time() of the first training step
    startup_s: float = 0.0  # from the launches to the first training step
    faults: list[dict] = field(default_factory=list)
    events: dict[str, list[dict]] = field(default_factory=dict)  # progress log name: its events


def train_args(cfg: GoodputConfig, data: Path, run_dir: Path, log: str) -> list[str]:
    """bench_train.py's arguments shared by both paths: training until the stop file says, a progress log, a
    checkpoint every K steps and ``fed_auto_resume`` (a launch's own folder), no evaluation."""
    return [
        "--data_dir", str(data), "--record_dir", str(run_dir / f"records_{log}"), "--output_dir",
        str(run_dir / f"out_{log}"), "--progress_log", str(run_dir / f"{log}.jsonl"), "--model_size", cfg.model_size,
        "--per_device_train_batch_size", str(cfg.batch_size), "--max_steps", "100000", "--learning_rate", "2e-3",
        "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--seed", "0", "--eval_strategy", "no",
        "--logging_steps", str(cfg.sync_steps), "--report_to", "none", "--disable_tqdm", "true",
        "--dataloader_drop_last", "true", "--fed_sync_steps", str(cfg.sync_steps),
        "--fed_timeout_s", str(cfg.fed_timeout_s), "--ddp_timeout", str(int(cfg.fed_timeout_s)),
        "--stop_file", str(run_dir / "stop_at"), "--save_strategy", "steps", "--save_steps", str(cfg.save_steps),
        "--save_total_limit", "2", "--fed_auto_resume", "true",
    ]  # fmt: skip


def launch_commands(cfg: GoodputConfig, path: str, data: Path, run_dir: Path, rendezvous: str) -> list[list[str]]:
    """One command per group's node: a torchft group of its own, or a node of the one mesh job."""
    extra = PATHS[path][1]
    if elastic(path):
        return [faults.torchrun(cfg.ranks_per_group, [*train_args(cfg, data, run_dir, f"group{g}"), *extra,
                "--fed_transport", "torchft", "--fed_lighthouse", rendezvous, "--fed_group_id", str(g),
                "--fed_num_groups", str(cfg.groups)], max_restarts=100,
                launcher=LAUNCHER.get(path)) for g in range(cfg.groups)]  # fmt: skip
    args = [*train_args(cfg, data, run_dir, "job"), *extra, "--fed_group_size", str(cfg.ranks_per_group)]
    return [faults.torchrun(cfg.ranks_per_group, args, rendezvous, g, cfg.groups, max_restarts=100)
            for g in range(cfg.groups)]  # fmt: skip


@dataclass
class Launches:
    """The launches of one run: each group's command and process, and torchft's lighthouse (on node 0, at a fixed
    port, so that a full restart finds it where the groups' commands say)."""

    hosts: Hosts
    run_dir: Path
    port: int
    join_timeout_s: float
    commands: list[list[str]] = field(default_factory=list)
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    lighthouse: subprocess.Popen | None = None
    started: int = 0  # numbers the log files

    def start_lighthouse(self) -> str:
        self.started += 1
        log = self.run_dir / f"lighthouse.{self.started}.log"
        self.lighthouse, address = faults.start_lighthouse(self.hosts, 0, log, self.join_timeout_s, port=self.port)
        return address

    def start(self, group: int) -> None:
        self.started += 1
        log = self.run_dir / f"node{group}.{self.started}.log"
        self.procs[group] = self.hosts.start(group, self.commands[group], log)

    def kill(self, group: int) -> None:
        kill(self.procs[group])

    def kill_all(self) -> None:
        for proc in [*self.procs.values(), *([self.lighthouse] if self.lighthouse else [])]:
            if proc.poll() is None:
                kill(proc)


def run_path(cfg: GoodputConfig, hosts: Hosts, path: str, fault: str | None, interval_s: float | None,
             run_dir: Path, data: Path, port: int) -> Run:  # fmt: skip
    """Start every group, inject the faults for ``run_s`` seconds of training, stop every group at one step, kill
    what is left; what happened."""
    run_dir.mkdir(parents=True)
    run, launches = Run(path, interval_s, fault), Launches(hosts, run_dir, port, cfg.join_timeout_s)
    rendezvous = launches.start_lighthouse() if elastic(path) else f"{hosts.address(0)}:{port}"
    launches.commands = launch_commands(cfg, path, data, run_dir, rendezvous)
    launched = time.time()
    for group in range(cfg.groups):
        launches.start(group)
    try:
        run.t0 = wait_for_training(run_dir, launches.procs, cfg.startup_timeout_s)
        run.startup_s = run.t0 - launched
        schedule = faults.fault_schedule(cfg.run_s, interval_s, cfg.restart_s, cfg.victims) if interval_s else []
        for fault_at in schedule:
            inject(run, fault_at, launches, cfg)
        time.sleep(max(0.0, run.t0 + cfg.run_s - time.time()))
        stop_at_one_step(run, run_dir, launches.procs, cfg)
    finally:
        launches.kill_all()
    run.events = {p.stem: progress.read(p) for p in sorted(run_dir.glob("*.jsonl"))}
    return run


def stop_at_one_step(run: Run, run_dir: Path, procs: dict[int, subprocess.Popen], cfg: GoodputConfig) -> int:
    """Once every launch killed by a fault trains again, ask every group to stop at one averaging step, two past the
    furthest any group has logged (so past every rank's), and wait for the launches to end; the step."""
    deadline = time.time() + cfg.stop_timeout_s
    while not back_in_training(run, run_dir) and time.time() < deadline:
        time.sleep(0.5)
    logged = [e["step"] for p in run_dir.glob("*.jsonl") for e in progress.read(p) if e["event"] in ("begin", "sync")]
    stop = (max(logged, default=0) // cfg.sync_steps + 2) * cfg.sync_steps
    (run_dir / "stop_at.tmp").write_text(str(stop))
    (run_dir / "stop_at.tmp").rename(run_dir / "stop_at")  # whole or absent for the ranks that read it
    while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
        time.sleep(0.5)
    print(f"    stopped at step {stop}; launches still up after {cfg.stop_timeout_s:g} s: "
          f"{[g for g, p in procs.items() if p.poll() is None] or 'none'}", flush=True)  # fmt: skip
    return stop


def back_in_training(run: Run, run_dir: Path) -> bool:
    """Whether every launch a fault killed has begun training since (mesh: the job; -1: every group)."""
    for fault in run.faults:
        if run.path == "mesh":
            logs = ["job"]
        else:
            logs = [p.stem for p in run_dir.glob("group*.jsonl")] if fault["group"] < 0 else [f"group{fault['group']}"]
        kill = run.t0 + fault["kill_s"]
        for log in logs:
            if not any(e["event"] == "begin" and e["t"] > kill for e in progress.read(run_dir / f"{log}.jsonl")):
                return False
    return True


def wait_for_training(run_dir: Path, launches: dict, timeout_s: float) -> float:
    """The time of the first ``begin`` in any progress log; raises if none comes, or a launch dies first."""
    deadline = time.time() + timeout_s
    while not (begins := [e["t"] for p in run_dir.glob("*.jsonl") for e in progress.read(p) if e["event"] == "begin"]):
        dead = {g: p.returncode for g, p in launches.items() if p.poll() is not None}
        if dead or time.time() > deadline:
            raise RuntimeError(f"training did not start (launches ended: {dead}); logs in {run_dir}")
        time.sleep(0.2)
    return min(begins)


def inject(run: Run, fault: Fault, launches: Launches, cfg: GoodputConfig) -> None:
    """The fault of ``run.fault`` at ``fault.kill_s``, and the restarts that follow it (recorded as done). A full
    restart's group is -1 (every group); a worker's restart is its torchrun's, at once."""
    time.sleep(max(0.0, run.t0 + fault.kill_s - time.time()))
    killed_at, group = time.time(), fault.group
    if run.fault == "worker":
        faults.kill_worker(launches.procs[group])
    elif run.fault == "launch":
        launches.kill(group)
        time.sleep(max(0.0, run.t0 + fault.restart_s - time.time()))
        launches.start(group)
    else:
        group = -1
        launches.kill_all()
        time.sleep(max(0.0, run.t0 + fault.restart_s - time.time()))
        if elastic(run.path):
            launches.start_lighthouse()
        for g in range(cfg.groups):
            time.sleep(max(0.0, run.t0 + fault.restart_s + g * cfg.stagger_s - time.time()))
            launches.start(g)
    restarted_at = killed_at if run.fault == "worker" else run.t0 + fault.restart_s
    run.faults.append({"group": group, "kill_s": killed_at - run.t0, "restart_s": restarted_at - run.t0})
    print(f"    {run.path}: {run.fault} fault ({'every group' if group < 0 else f'group {group}'}) at "
          f"{killed_at - run.t0:.0f} s, restarted at {restarted_at - run.t0:.0f} s", flush=True)  # fmt: skip


# ---- figures (pure functions of the runs) ----


def committed_torchft(logs: dict[str, list[dict]], end: float) -> int:
    """Group-steps committed by ``end``: each group's steps since its previous averaging (or its start or heal),
    counted when it completes the next averaging; a group that begins again behind its last averaging (resumed
    from an older checkpoint after a full restart) loses the steps between the two, and one that begins again from
    a checkpoint of its own ahead of it (saved between two averagings) keeps the steps that checkpoint holds."""
    total = 0
    for events in logs.values():
        base = last = None
        saved: set[int] = set()
        for e in (e for e in events if e["t"] <= end):
            if e["event"] == "begin":
                own = e["step"] in saved and last is not None  # its own checkpoint, not a heal from a live group
                base = min(e["step"], last) if own else e["step"]
                total -= max(0, (last or 0) - e["step"])
            elif e["event"] == "save":
                saved.add(e["step"])
            elif e["event"] == "sync" and base is not None:
                total, base, last = total + e["step"] - base, e["step"], e["step"]
    return total


def committed_mesh(events: list[dict], kills: list[float], end: float, groups: int) -> int:
    """Group-steps committed by ``end`` in one job: every group's steps up to the job's last averaging, rolled back
    to the newest complete checkpoint by a kill (the restart resumes there)."""
    marks = [(e["t"], e["event"], e["step"]) for e in events if e["event"] in ("begin", "sync", "save")]
    step = saved = 0
    for _t, event, at in sorted([*marks, *[(t, "kill", 0) for t in kills]]):
        if _t > end:
            break
        if event in ("begin", "sync"):
            step = at
        elif event == "save":
            saved = at
        else:
            step = min(step, saved)
    return groups * step


def committed(run: Run, cfg: GoodputConfig) -> int:
    end = run.t0 + cfg.run_s
    if elastic(run.path):
        return committed_torchft(run.events, end)
    kills = [run.t0 + f["kill_s"] for f in run.faults]
    return committed_mesh(run.events.get("job", []), kills, end, cfg.groups)


def sync_times(events: list[dict]) -> list[float]:
    return [e["t"] for e in events if e["event"] == "sync"]


def longest_gap(times: list[float], start: float, stop: float) -> float | None:
    """The longest gap between consecutive times that reaches into [start, stop) (one still open at ``stop`` is
    counted to ``stop``); None without a time before ``start``."""
    before = [t for t in times if t < start]
    if not before:
        return None
    inside = [t for t in times if start <= t < stop]
    points = [before[-1], *inside]
    gaps = [b - a for a, b in itertools.pairwise(points)]
    return max([*gaps, stop - points[-1]])


def fault_figures(run: Run, cfg: GoodputConfig) -> list[dict]:
    """Per fault: the survivors' longest stall, and how long the restarted group (mesh: the job) took to be back."""
    figures, end = [], run.t0 + cfg.run_s
    back = {}
    for index, fault in enumerate(run.faults):
        kill, restart = run.t0 + fault["kill_s"], run.t0 + fault["restart_s"]
        stop = run.t0 + run.faults[index + 1]["kill_s"] if index + 1 < len(run.faults) else end
        back[index] = back_at(run, fault["group"], restart)
        figures.append({"group": fault["group"], "kill_t": kill, "restart_t": restart, "stop_t": stop,
                        "back_s": back[index] - restart if back[index] else None})  # fmt: skip
    for index, figure in enumerate(figures):
        figure["stall_s"], figure["survivors_interval_s"] = survivors_stall(run, figures, index)
    return figures


def full_restart_losses(run: Run, cfg: GoodputConfig, steps_per_s: float | None) -> list[dict]:
    """Per full restart of a torchft path, the seconds a group lost, the mean over the groups, split three ways:
    imposed by the study (R, and the group's place in the stagger), start-up (its launch's start to its training's
    ``begin``), and rollback (the steps it trains again, its last averaged step before the kill less the step it
    resumed at, at ``steps_per_s``: a group's pace in the path's run without failures)."""
    if not elastic(run.path) or run.fault != "full" or not steps_per_s:
        return []
    out = []
    for fault in run.faults:
        kill, restart = run.t0 + fault["kill_s"], run.t0 + fault["restart_s"]
        groups = []
        for g in range(cfg.groups):
            events, start = run.events.get(f"group{g}", []), restart + g * cfg.stagger_s
            begin = next((e for e in events if e["event"] == "begin" and e["t"] > start), None)
            if begin is None:  # not back before the run ended: its loss shows in the goodput alone
                continue
            synced = max((e["step"] for e in events if e["event"] == "sync" and e["t"] <= kill), default=0)
            groups.append((start - kill, begin["t"] - start, max(0, synced - begin["step"]) / steps_per_s))
        if groups:
            imposed, startup, rollback = (statistics.mean(column) for column in zip(*groups, strict=True))
            out.append({"imposed_s": imposed, "startup_s": startup, "rollback_s": rollback})
    return out


def back_at(run: Run, group: int, restart: float) -> float | None:
    """When the restarted group (-1: the last of every group; mesh: the job) first averaged after ``restart``."""
    if run.path == "mesh":
        logs = ["job"]
    else:
        logs = [f"group{g}" for g in range(len(run.events))] if group < 0 else [f"group{group}"]
    firsts = [next((t for t in sync_times(run.events.get(log, [])) if t > restart), None) for log in logs]
    return None if None in firsts else max(firsts)


def ended_models(run: Run, ranks_per_group: int) -> dict[int, tuple[str, ...]]:
    """Each group whose every rank wrote its ``end`` event: the SHA-256s of its shards, by position in the group."""
    shas: dict[int, dict[int, str]] = {}
    for log, events in run.events.items():
        for e in (e for e in events if e["event"] == "end"):
            in_job = not log.startswith("group")  # mesh: one job, global ranks
            group, position = divmod(e["rank"], ranks_per_group) if in_job else (int(log[5:]), e["rank"])
            shas.setdefault(group, {})[position] = e["sha256"]
    return {g: tuple(by[p] for p in range(ranks_per_group)) for g, by in shas.items() if len(by) == ranks_per_group}


def survivors_stall(run: Run, figures: list[dict], index: int) -> tuple[float | None, float | None]:
    """From fault ``index``'s kill to the next fault, for the groups that were up all along (mesh: the job): the
    longest gap between two averagings, and (torchft) the median gap while the victim was down, which shows how
    much faster the survivors ran on the cores it freed."""
    figure = figures[index]
    if run.path == "mesh":
        return longest_gap(sync_times(run.events.get("job", [])), figure["kill_t"], figure["stop_t"]), None
    down = {f["group"] for f in figures if f["kill_t"] < figure["stop_t"] and (f["restart_t"] + (f["back_s"] or 1e9))
            > figure["kill_t"]}  # fmt: skip
    survivors = [sync_times(events) for log, events in run.events.items() if not {int(log[5:]), -1} & down]
    gaps = [g for times in survivors if (g := longest_gap(times, figure["kill_t"], figure["stop_t"])) is not None]
    outage_end = figure["restart_t"] + figure["back_s"] if figure["back_s"] is not None else figure["stop_t"]
    kill = figure["kill_t"]
    during = [b - a for times in survivors for a, b in itertools.pairwise(times) if kill < a < b < outage_end]
    return (max(gaps) if gaps else None), (statistics.median(during) if during else None)


def averaging_interval_s(run: Run) -> float | None:
    """The median gap between consecutive averagings of a run without failures (any launch's log)."""
    gaps = [b - a for events in run.events.values() for a, b in itertools.pairwise(sync_times(events))]
    return statistics.median(gaps) if gaps else None


def median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize_repetition(runs: list[Run], cfg: GoodputConfig) -> dict:
    """Every run's figures, with goodput against the same repetition's run of the same path without failures."""
    baseline = {r.path: committed(r, cfg) for r in runs if r.interval_s is None}
    out = []
    for run in runs:
        figures = fault_figures(run, cfg)
        pace = baseline[run.path] / cfg.groups / cfg.run_s if baseline.get(run.path) else None  # steps/s of a group
        losses = full_restart_losses(run, cfg, pace)
        done = committed(run, cfg)
        models = ended_models(run, cfg.ranks_per_group)
        out.append({"path": run.path, "fault": run.fault, "interval_s": run.interval_s, "group_steps": done,
                    "tokens_per_s": done * cfg.ranks_per_group * cfg.batch_size * BLOCK_SIZE / cfg.run_s,
                    "groups_ended": sorted(models), "models_at_end": len(set(models.values())),
                    "goodput": done / baseline[run.path] if baseline.get(run.path) else None, "faults": figures,
                    "averaging_interval_s": averaging_interval_s(run), "startup_s": run.startup_s,
                    "max_stall_s": max((f["stall_s"] for f in figures if f["stall_s"] is not None), default=None),
                    "survivors_interval_s": median_or_none([f["survivors_interval_s"] for f in figures]),
                    "back_s": [f["back_s"] for f in figures], "losses": losses})  # fmt: skip
    return {"runs": out}


def combine(reps: list[dict], cfg: GoodputConfig) -> list[dict]:
    """Per path, fault kind and interval: median (min–max) over repetitions of each figure."""
    rows = []
    for fault, interval in [(None, None), *itertools.product(cfg.faults, cfg.intervals_s)]:
        for path in cfg.paths:
            runs = [r for rep in reps for r in rep["runs"] if (r["path"], r["fault"], r["interval_s"]) ==
                    (path, fault, interval)]  # fmt: skip
            row = {"path": path, "fault": fault, "interval_s": interval,
                   "faults_per_run": report.spread([len(r["faults"]) for r in runs]),
                   "ended": [len(r["groups_ended"]) for r in runs],
                   "models": [r["models_at_end"] for r in runs]}  # fmt: skip
            for key in ("goodput", "group_steps", "tokens_per_s", "max_stall_s", "averaging_interval_s",
                        "survivors_interval_s", "startup_s"):  # fmt: skip
                values = [r[key] for r in runs if r[key] is not None]
                row[key] = report.spread(values) if values else None
            for key in LOSSES:  # per full restart, over every run's
                values = [loss[key] for r in runs for loss in r.get("losses", [])]
                row[f"lost_{key}"] = report.spread(values) if values else None
            backs = [b for r in runs for b in r["back_s"]]
            known = [b for b in backs if b is not None]
            row["back_s"], row["never_back"] = (report.spread(known) if known else None), len(backs) - len(known)
            rows.append(row)
    return rows


def ended_identical(row: dict, groups: int) -> bool:
    """Every run of the row ended with all its groups on one model."""
    return all(n == groups and m == 1 for n, m in zip(row["ended"], row["models"], strict=True))


def targets(rows: list[dict], cfg: GoodputConfig) -> list[dict]:
    """The targets for each torchft path, each on the medians: goodput ≥ 90% at a fault every 120 s, every run ending
    with its groups on one model; a survivor's stall ≤ fed_timeout_s + one averaging interval, and a restarted group
    back within its start-up + one averaging interval (both from the path's run without failures; a full restart's
    last group starts (G - 1) × the stagger later); without failures, tokens/s of the `FASTER_PATHS` at least the
    blocking torchft path's."""
    out = []
    blocking = next((r for r in rows if r["path"] == "torchft" and r["interval_s"] is None), None)
    for path in filter(elastic, cfg.paths):
        out += path_targets([r for r in rows if r["path"] == path], blocking, cfg)
    return out + restart_share_targets(rows)


def project_share(row: dict) -> float | None:
    """A full restart's seconds lost per group that are the project's own (start-up + rollback), on the medians."""
    if not row.get("lost_startup_s") or not row.get("lost_rollback_s"):
        return None
    return row["lost_startup_s"]["median"] + row["lost_rollback_s"]["median"]


def restart_share_targets(rows: list[dict]) -> list[dict]:
    """Each of the `RESTART_CUTS` (background checkpoints every 4 steps; with them, workers forked after the
    imports) halves the project's share of a full restart's loss (start-up + rollback) against torchft's synchronous
    checkpoints every K steps, where the study ran both."""
    full = {r["path"]: r for r in rows if r["fault"] == "full" and project_share(r) is not None}
    if "torchft" not in full:
        return []
    bound = project_share(full["torchft"]) / 2
    out = []
    for path in (p for p in RESTART_CUTS if p in full):
        measured = project_share(full[path])
        out.append({"target": f"{path}, full restarts: the project's seconds lost per group (start-up + rollback) ≤ "
                    f"half torchft's ({bound:.1f} s)", "measured": measured, "met": measured <= bound, "scale": 1.0,
                    "unit": " s"})  # fmt: skip
    return out


def path_targets(rows: list[dict], blocking: dict | None, cfg: GoodputConfig) -> list[dict]:
    """`targets` for the rows of one torchft path; ``blocking``: the torchft path's row without failures (``None``
    where the study did not run it)."""
    base = next(r for r in rows if r["interval_s"] is None)
    interval = base["averaging_interval_s"]["median"] if base["averaging_interval_s"] else 0.0
    startup = base["startup_s"]["median"] if base["startup_s"] else 0.0
    out = []
    for row in rows:
        what = "no faults" if row["fault"] is None else f"{row['fault']} faults every {row['interval_s']:g} s"
        what = f"{row['path']}, {what}"
        out.append({"target": f"{what}: every group ended on one model", "measured": None,
                    "met": ended_identical(row, cfg.groups)})  # fmt: skip
        if row["fault"] is None:
            checks = []
            if blocking is not None and row["path"] in FASTER_PATHS and blocking["tokens_per_s"]:
                floor = blocking["tokens_per_s"]["median"]
                checks.append((f"{what}: tokens/s ≥ blocking torchft's ({floor:.0f})", row["tokens_per_s"], floor,
                               1.0, ""))  # fmt: skip
        else:
            checks = [(f"{what}: goodput ≥ 90%", row["goodput"], 0.9, 100.0, "%")] if row["interval_s"] >= 120 else []
            stagger = (cfg.groups - 1) * cfg.stagger_s if row["fault"] == "full" else 0.0  # the last group's delay
            late = (" + the stagger", f" + {stagger:g}") if stagger else ("", "")
            checks.append((f"{what}: restarted group back ≤ start-up + one averaging{late[0]} ({startup:.1f} + "
                           f"{interval:.1f}{late[1]} s)", row["back_s"], -(startup + interval + stagger), 1.0,
                           " s"))  # fmt: skip
            if row["fault"] == "worker" and row["path"] in LAUNCHER:
                checks.append((f"{what}: restarted worker back ≤ {WORKER_BACK_S:g} s", row["back_s"], -WORKER_BACK_S,
                               1.0, " s"))  # fmt: skip
            if row["fault"] != "full":
                checks.append((f"{what}: survivors' longest stall ≤ fed_timeout_s + one averaging "
                               f"({cfg.fed_timeout_s:g} + {interval:.1f} s)", row["max_stall_s"],
                               -(cfg.fed_timeout_s + interval), 1.0, " s"))  # fmt: skip
        for name, value, bound, scale, unit in checks:  # a negative bound is an upper one
            measured = value["median"] if value else None
            met = measured is not None and (measured >= bound if bound > 0 else measured <= -bound)
            out.append({"target": name, "measured": measured, "met": met, "scale": scale, "unit": unit})
    return out


def fault_label(fault: str | None, cfg: dict) -> str:
    """What the fault was, in a table cell."""
    back = f"back after {cfg['restart_s']:g} s"
    labels = {None: "none", "worker": "a worker killed (torchrun restarts it)",
              "launch": f"a group's launch killed, {back}",
              "full": f"every launch killed, {back}, {cfg['stagger_s']:g} s apart"}  # fmt: skip
    return labels[fault]


def identical_cell(row: dict, groups: int) -> str:
    """'yes' when every run ended with all groups on one model; otherwise what happened, per run."""
    if ended_identical(row, groups):
        return "yes"
    return "**no**: " + "; ".join(f"{n} of {groups} ended, {m} model(s)" for n, m in zip(row["ended"], row["models"],
                                                                                          strict=True))  # fmt: skip


def markdown(results: dict) -> str:
    cfg = results["config"]
    where = f"LOCALHOST (no network namespaces: {results['hosts']})"
    if results["hosts"] == "netns":
        where = f"the emulated cluster ({cfg['groups']} network namespaces, {cfg['rate_mbit']:g} Mbit/s between groups)"
    lines = [
        f"{cfg['groups']} groups × {cfg['ranks_per_group']} ranks on {where}, Llama `{cfg['model_size']}`, H = "
        f"{cfg['sync_steps']}, fed_timeout_s {cfg['fed_timeout_s']:g} s, a checkpoint every K = {cfg['save_steps']} "
        f"steps and fed_auto_resume on both paths; each run trains {cfg['run_s']:g} s (from its first step), with a "
        "fault every T s: a worker SIGKILLed (its torchrun restarts the group's workers), a group's whole launch "
        f"SIGKILLed and started again R = {cfg['restart_s']:g} s later (groups {', '.join(map(str, cfg['victims']))} "
        f"in turn), or every launch and the lighthouse SIGKILLed and started again R s later, {cfg['stagger_s']:g} s "
        f"apart. torchft: a launch per group, a lighthouse (join timeout {cfg['join_timeout_s']:g} s); mesh: one job, "
        "torchrun --max-restarts. Goodput: group-steps committed to the global model ÷ those of the same path without "
        "failures in the same time (all groups share 2 cores: a killed group frees CPU for the others, so throughput "
        "would flatter the survivors). Groups ended identical: at the end every group is asked to stop at one "
        "averaging step, and the SHA-256 of every rank's shards is compared with the same rank's of the other groups. "
        f"Median (min–max) over {results['repeats']} repetition(s).",
        "",
        "| path | fault | every | faults per run | group-steps | committed tokens/s | goodput | groups ended identical "
        "| survivors' longest stall (s) | restarted group back after (s) | averaging interval (s) "
        "| survivors' averaging interval, a group down (s) | start-up (s) |",
        "|---|---|---:|---:|---:|---:|---:|:---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        never = f" ({row['never_back']} never back)" if row["never_back"] else ""
        cells = [
            row["path"], fault_label(row["fault"], cfg),
            "—" if row["interval_s"] is None else f"{row['interval_s']:g} s",
            report.median_range(row["faults_per_run"], ".0f"), report.median_range(row["group_steps"], ".0f"),
            report.median_range(row["tokens_per_s"], ".0f"),
            report.median_range(row["goodput"], ".0f", 100) + "%" if row["goodput"] else "—",
            identical_cell(row, cfg["groups"]), report.median_range(row["max_stall_s"], ".1f"),
            report.median_range(row["back_s"], ".1f") + never, report.median_range(row["averaging_interval_s"], ".2f"),
            report.median_range(row["survivors_interval_s"], ".2f"), report.median_range(row["startup_s"], ".1f"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += loss_lines(results["rows"])
    lines += ["", "| target (torchft, on the medians) | measured | met |", "|---|---:|:---:|"]
    for t in results["targets"]:
        measured = "—" if t["measured"] is None else f"{t['measured'] * t['scale']:.1f}{t['unit']}"
        lines.append(f"| {t['target']} | {measured} | {'yes' if t['met'] else '**no**'} |")
    load = results["machine"]
    lines += ["", f"Machine: {load['cpus']} CPUs; 1-minute load average before each run (after the previous one's "
              f"processes ended): {', '.join(f'{x:.1f}' for x in load['loadavg_before_runs'])}. "
              f"{load['others']}"]  # fmt: skip
    lines += report.run_record_lines(results)
    return "\n".join(lines)


def loss_lines(rows: list[dict]) -> list[str]:
    """The seconds a full restart cost each group, split by whose they are (none where no full restart ran)."""
    full = [r for r in rows if r["fault"] == "full" and r.get("lost_startup_s")]
    if not full:
        return []
    lines = ["", "Seconds lost per full restart and group (the mean over the groups, median (min–max) over the "
             "restarts): imposed by the study (R and the group's place in the stagger), start-up (its launch's start "
             "to its training's begin), rollback (the steps it trains again: its last averaged step less the step it "
             "resumed at, at the path's pace without failures).", "",
             "| path | imposed by the study (s) | start-up (s) | rollback (s) | the project's: start-up + rollback (s) "
             "| goodput |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in full:
        cells = [r["path"], *(report.median_range(r[f"lost_{k}"], ".1f") for k in LOSSES), f"{project_share(r):.1f}",
                 report.median_range(r["goodput"], ".0f", 100) + "%" if r["goodput"] else "—"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(results: dict, out: Path) -> Path:
    """Goodput per fault kind and interval, the two paths side by side, min–max as error bars."""
    fig, ax = report.new_axes()
    paths = results["config"]["paths"]
    cases = [(r["fault"], r["interval_s"]) for r in results["rows"] if r["path"] == paths[0] and r["fault"]]
    width = 0.8 / len(paths)
    for offset, path in enumerate(paths):
        rows = {(r["fault"], r["interval_s"]): r for r in results["rows"] if r["path"] == path and r["fault"]}
        goodput = [rows[c]["goodput"] or {"median": 0.0, "min": 0.0, "max": 0.0} for c in cases]
        xs = [i + (offset - (len(paths) - 1) / 2) * width for i in range(len(cases))]
        mid = [100 * g["median"] for g in goodput]
        err = [[100 * (g["median"] - g["min"]) for g in goodput], [100 * (g["max"] - g["median"]) for g in goodput]]
        ax.bar(xs, mid, width, yerr=err, capsize=3, label=path)
    ax.set_xticks(range(len(cases)), [f"{fault}\nevery {t:g} s" for fault, t in cases])
    ax.axhline(90, color="grey", linestyle=":", linewidth=1)
    ax.set_ylabel("goodput (% of group-steps)")
    ax.set_ylim(0, 110)
    ax.legend()
    return report.save_figure(fig, out / "goodput.png")


def other_jobs() -> str:
    """Processes of others that were busy as the study ended (the machine is shared), in one sentence."""
    ps = subprocess.run(["ps", "-eo", "pcpu,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
    busy = [line.split(None, 1) for line in ps.splitlines()[1:8]]
    busy = [(float(cpu), args[:90]) for cpu, args in busy if float(cpu) >= 5.0]
    if not busy:
        return "No other process was using 5% of a core or more as the study ended."
    return "Other busy processes as the study ended (% of a core): " + "; ".join(f"`{a}` ({c:.0f}%)" for c, a in busy)


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="4 groups × 1 rank, T = 30 s, 60 s runs, R = 5 s, once.")
    p.add_argument("--intervals-s", type=float, nargs="+", help="Failure intervals T (default 120; quick 30).")
    p.add_argument("--faults", nargs="+", choices=[*FAULTS, "none"],
                   help="Fault kinds (default: all three); none: only the runs without failures.")  # fmt: skip
    p.add_argument("--paths", nargs="+", choices=list(PATHS), help="Paths (default: torchft mesh).")
    p.add_argument("--run-s", type=float, help="Training seconds per run (default 240; quick 60).")
    p.add_argument("--restart-s", type=float, help="Seconds a killed launch stays down (default 10; quick 5).")
    p.add_argument("--stagger-s", type=float, help="A full restart's groups start this far apart (default 5).")
    p.add_argument("--repeats", type=int, help="Repetitions (default 1; quick 1).")
    p.add_argument("--ranks-per-group", type=int, help="Ranks per group (default 2; quick 1).")
    p.add_argument("--groups", type=int, help="Federation groups (default 4); the victims are groups 1 … G-1 in turn.")
    p.add_argument("--localhost", action="store_true", help="Run on localhost even where namespaces are available.")
    add_folder_options(p, "goodput", work="every run's logs")
    return p


def config_from_args(args: argparse.Namespace) -> GoodputConfig:
    quick = {"intervals_s": (30.0,), "run_s": 60.0, "restart_s": 5.0, "repeats": 1, "ranks_per_group": 1}
    cfg = GoodputConfig(**(quick if args.quick else {}))
    given = {"intervals_s": tuple(args.intervals_s) if args.intervals_s else None, "run_s": args.run_s,
             "faults": tuple(f for f in args.faults if f != "none") if args.faults else None,
             "paths": tuple(args.paths) if args.paths else None, "stagger_s": args.stagger_s,
             "restart_s": args.restart_s, "repeats": args.repeats, "ranks_per_group": args.ranks_per_group,
             "groups": args.groups, "victims": tuple(range(1, args.groups)) if args.groups else None}  # fmt: skip
    cfg = GoodputConfig(**{**asdict(cfg), **{k: v for k, v in given.items() if v is not None}})
    cfg.validate()
    return cfg


def repetition(cfg: GoodputConfig, hosts: Hosts, data: Path, work: Path, loads: list[float]) -> list[Run]:
    """The runs without failures, then each fault kind and interval, each path in turn (a drift in load hits both
    alike)."""
    runs = []
    for fault, interval in [(None, None), *itertools.product(cfg.faults, cfg.intervals_s)]:
        for path in cfg.paths:
            loads.append(os.getloadavg()[0])
            label = "no failures" if fault is None else f"a {fault} fault every {interval:g} s"
            print(f"  {path}, {label}", flush=True)
            run_dir = work / f"{path}_{'none' if fault is None else f'{fault}_{interval:g}s'}"
            runs.append(run_path(cfg, hosts, path, fault, interval, run_dir, data, 29400 + len(loads)))
    return runs


def run_study(cfg: GoodputConfig, work: Path, data_cache: Path, localhost: bool) -> dict:
    """Every repetition on the emulated cluster (or localhost, saying why); the runs' figures."""
    data = prepare_data(BenchConfig(eval_samples=32), data_cache)
    reps, loads, how = [], [], "netns"
    with handle_termination(), contextlib.ExitStack() as stack:
        try:
            if localhost:
                raise PermissionError("--localhost given")
            hosts: Hosts = ClusterNodes(stack.enter_context(Cluster(cfg.groups, cfg.rate_mbit, hostnames=True)))
        except (PermissionError, OSError, subprocess.CalledProcessError) as err:
            how, hosts = str(err).splitlines()[0][:200], Localhost()
            print(f"no network namespaces ({how}): every group runs on LOCALHOST", flush=True)
        for rep in range(cfg.repeats):
            print(f"repetition {rep + 1}/{cfg.repeats}", flush=True)
            reps.append(summarize_repetition(repetition(cfg, hosts, data, work / f"r{rep}", loads), cfg))
    machine = {"cpus": os.cpu_count(), "loadavg_before_runs": loads, "others": other_jobs()}
    return {"config": asdict(cfg), "hosts": how, "repeats": cfg.repeats, "reps": reps, "machine": machine}


def main(argv: list[str] | None = None) -> int:
    study = Study("goodput", make_parser(), argv)
    cfg = config_from_args(study.args)
    with study.running() as work:
        results = run_study(cfg, work, study.args.data_cache, study.args.localhost)
    results["rows"] = combine(results["reps"], cfg)
    results["targets"] = targets(results["rows"], cfg)
    return study.finish(results, markdown, plot)


if __name__ == "__main__":
    raise SystemExit(main())

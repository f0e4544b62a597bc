"""Goodput under failures: a group killed every T seconds, torchft's federation of launches against a job restart.

    sudo python -m benchmarks.goodput --quick      # 4 groups × 1 rank, T = 15 and 30 s, 60 s runs, under 10 minutes
    sudo python -m benchmarks.goodput              # 4 groups × 2 ranks, T = 30, 60 and 120 s, 240 s runs, under 45
    sudo python -m benchmarks.goodput --quick --groups 2 --run-s 10 --intervals-s 8 --restart-s 2
                                                   # the smoke the tests run: 1 fault a run, 4 runs of 10 s

On the emulated cluster (benchmarks/harness/netns.py: a network namespace per group, 100 Mbit/s links between
them), 4 federation groups train the ``micro`` Llama on Shakespeare (benchmarks/harness/bench_train.py, H = 8,
``fed_timeout_s`` 30 s). Every T seconds of training one group's whole launch (torchrun and its workers) is
SIGKILLed, as a lost node (in the middle of each T: at T/2, 3T/2, …, so a run of n·T seconds holds n faults), and
started again R seconds later with the same command; the victims are groups 1, 2, 3 in turn (group 0's node hosts
the lighthouse and the job's rendezvous, which this study keeps alive; with ``--groups G``, groups 1 … G-1). Two paths:

- ``torchft``: ``--fed_transport torchft``, one torchrun per group, a lighthouse (``--min_groups 1``,
  ``--join_timeout_s 10``, ``--heartbeat_timeout_s 2``) on node 0; the survivors go on averaging among themselves,
  the restarted group heals from a live one and rejoins;
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
from benchmarks.harness.faults import ClusterNodes, Fault, Hosts, Localhost, kill_tree
from benchmarks.harness.methods import BenchConfig, prepare_data
from benchmarks.harness.netns import Cluster, handle_termination
from benchmarks.harness.study import Study, add_folder_options, new_parser

PATHS = ("torchft", "mesh")


@dataclass
class GoodputConfig:
    """One study: the federation, the faults, the two paths' settings."""

    groups: int = 4
    ranks_per_group: int = 2
    intervals_s: tuple[float, ...] = (30.0, 60.0, 120.0)  # T: a group killed every T seconds of training
    restart_s: float = 10.0  # R: a killed group's launch is started again R seconds later
    run_s: float = 240.0  # training wall time of every run (from the first step): 8, 4 and 2 faults
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

    def validate(self) -> None:
        if self.save_steps % self.sync_steps:
            raise ValueError(f"--save-steps={self.save_steps} must be a multiple of H={self.sync_steps}.")
        if max(self.victims) >= self.groups or 0 in self.victims:
            raise ValueError(f"victims {self.victims} must be groups 1 … {self.groups - 1}.")
        if not all(self.restart_s < t < self.run_s for t in self.intervals_s):
            raise ValueError(f"every interval must lie between R={self.restart_s} s and the run, {self.run_s} s.")


@dataclass
class Run:
    """One run of one path: its faults (as injected, seconds from the first step) and what each launch logged."""

    path: str
    interval_s: float | None  # None: the run without failures
    t0: float = 0.0  # time.time() of the first training step
    startup_s: float = 0.0  # from the launches to the first training step
    faults: list[dict] = field(default_factory=list)
    events: dict[str, list[dict]] = field(default_factory=dict)  # progress log name: its events


def train_args(cfg: GoodputConfig, data: Path, run_dir: Path, log: str) -> list[str]:
    """bench_train.py's arguments shared by both paths: time-bounded training, a progress log, no evaluation."""
    return [
        "--data_dir", str(data), "--record_dir", str(run_dir / f"records_{log}"), "--output_dir",
        str(run_dir / "out"), "--progress_log", str(run_dir / f"{log}.jsonl"), "--model_size", cfg.model_size,
        "--per_device_train_batch_size", str(cfg.batch_size), "--max_steps", "100000", "--learning_rate", "2e-3",
        "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--seed", "0", "--eval_strategy", "no",
        "--logging_steps", str(cfg.sync_steps), "--report_to", "none", "--disable_tqdm", "true",
        "--dataloader_drop_last", "true", "--fed_sync_steps", str(cfg.sync_steps),
        "--fed_timeout_s", str(cfg.fed_timeout_s), "--ddp_timeout", str(int(cfg.fed_timeout_s)),
    ]  # fmt: skip


def launch_commands(cfg: GoodputConfig, path: str, data: Path, run_dir: Path, rendezvous: str) -> list[list[str]]:
    """One command per group's node: a torchft group of its own, or a node of the one mesh job."""
    if path == "torchft":
        return [faults.torchrun(cfg.ranks_per_group, [*train_args(cfg, data, run_dir, f"group{g}"),
                "--save_strategy", "no", "--fed_transport", "torchft", "--fed_lighthouse", rendezvous,
                "--fed_group_id", str(g), "--fed_num_groups", str(cfg.groups)]) for g in range(cfg.groups)]  # fmt: skip
    args = [*train_args(cfg, data, run_dir, "job"), "--fed_group_size", str(cfg.ranks_per_group), "--save_strategy",
            "steps", "--save_steps", str(cfg.save_steps), "--save_total_limit", "2",
            "--fed_auto_resume", "true"]  # fmt: skip
    return [faults.torchrun(cfg.ranks_per_group, args, rendezvous, g, cfg.groups, max_restarts=100)
            for g in range(cfg.groups)]  # fmt: skip


def run_path(cfg: GoodputConfig, hosts: Hosts, path: str, interval_s: float | None, run_dir: Path, data: Path,
             port: int) -> Run:  # fmt: skip
    """Start every group, inject the faults for ``run_s`` seconds of training, stop everything; what happened."""
    run_dir.mkdir(parents=True)
    run, lighthouse = Run(path, interval_s), None
    if path == "torchft":
        lighthouse, rendezvous = faults.start_lighthouse(hosts, 0, run_dir / "lighthouse.log", cfg.join_timeout_s)
    else:
        rendezvous = f"{hosts.address(0)}:{port}"
    commands = launch_commands(cfg, path, data, run_dir, rendezvous)
    launched = time.time()
    launches = {g: hosts.start(g, cmd, run_dir / f"node{g}.0.log") for g, cmd in enumerate(commands)}
    try:
        run.t0 = wait_for_training(run_dir, launches, cfg.startup_timeout_s)
        run.startup_s = run.t0 - launched
        schedule = faults.fault_schedule(cfg.run_s, interval_s, cfg.restart_s, cfg.victims) if interval_s else []
        for index, fault in enumerate(schedule):
            inject(run, fault, index, hosts, launches, commands, run_dir)
        time.sleep(max(0.0, run.t0 + cfg.run_s - time.time()))
    finally:
        for proc in [*launches.values(), *([lighthouse] if lighthouse else [])]:
            if proc.poll() is None:
                kill_tree(proc)
    run.events = {p.stem: progress.read(p) for p in sorted(run_dir.glob("*.jsonl"))}
    return run


def wait_for_training(run_dir: Path, launches: dict, timeout_s: float) -> float:
    """The time of the first ``begin`` in any progress log; raises if none comes, or a launch dies first."""
    deadline = time.time() + timeout_s
    while not (begins := [e["t"] for p in run_dir.glob("*.jsonl") for e in progress.read(p) if e["event"] == "begin"]):
        dead = {g: p.returncode for g, p in launches.items() if p.poll() is not None}
        if dead or time.time() > deadline:
            raise RuntimeError(f"training did not start (launches ended: {dead}); logs in {run_dir}")
        time.sleep(0.2)
    return min(begins)


def inject(run: Run, fault: Fault, index: int, hosts: Hosts, launches: dict, commands: list, run_dir: Path) -> None:
    """Kill ``fault.group``'s launch at its time and start it again at its restart time (recorded as done)."""
    time.sleep(max(0.0, run.t0 + fault.kill_s - time.time()))
    killed_at = time.time()
    kill_tree(launches[fault.group])
    time.sleep(max(0.0, run.t0 + fault.restart_s - time.time()))
    restarted_at = time.time()
    launches[fault.group] = hosts.start(
        fault.group, commands[fault.group], run_dir / f"node{fault.group}.{index + 1}.log"
    )
    run.faults.append({"group": fault.group, "kill_s": killed_at - run.t0, "restart_s": restarted_at - run.t0})
    print(f"    {run.path}: group {fault.group} killed at {killed_at - run.t0:.0f} s, restarted at "
          f"{restarted_at - run.t0:.0f} s", flush=True)  # fmt: skip


# ---- figures (pure functions of the runs) ----


def committed_torchft(logs: dict[str, list[dict]], end: float) -> int:
    """Group-steps committed by ``end``: each group's steps since its previous averaging (or its start or heal),
    counted when it completes the next averaging."""
    total = 0
    for events in logs.values():
        base = None
        for e in (e for e in events if e["t"] <= end):
            if e["event"] == "begin":
                base = e["step"]
            elif e["event"] == "sync" and base is not None:
                total, base = total + e["step"] - base, e["step"]
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
    if run.path == "torchft":
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
        log = f"group{fault['group']}" if run.path == "torchft" else "job"
        rejoined = [t for t in sync_times(run.events.get(log, [])) if t > restart]
        back[index] = rejoined[0] if rejoined else None
        figures.append({"group": fault["group"], "kill_t": kill, "restart_t": restart, "stop_t": stop,
                        "back_s": back[index] - restart if back[index] else None})  # fmt: skip
    for index, figure in enumerate(figures):
        figure["stall_s"], figure["survivors_interval_s"] = survivors_stall(run, figures, index)
    return figures


def survivors_stall(run: Run, figures: list[dict], index: int) -> tuple[float | None, float | None]:
    """From fault ``index``'s kill to the next fault, for the groups that were up all along (mesh: the job): the
    longest gap between two averagings, and (torchft) the median gap while the victim was down, which shows how
    much faster the survivors ran on the cores it freed."""
    figure = figures[index]
    if run.path == "mesh":
        return longest_gap(sync_times(run.events.get("job", [])), figure["kill_t"], figure["stop_t"]), None
    down = {f["group"] for f in figures if f["kill_t"] < figure["stop_t"] and (f["restart_t"] + (f["back_s"] or 1e9))
            > figure["kill_t"]}  # fmt: skip
    survivors = [sync_times(events) for log, events in run.events.items() if int(log[5:]) not in down]
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
        done = committed(run, cfg)
        out.append({"path": run.path, "interval_s": run.interval_s, "group_steps": done,
                    "goodput": done / baseline[run.path] if baseline.get(run.path) else None, "faults": figures,
                    "averaging_interval_s": averaging_interval_s(run), "startup_s": run.startup_s,
                    "max_stall_s": max((f["stall_s"] for f in figures if f["stall_s"] is not None), default=None),
                    "survivors_interval_s": median_or_none([f["survivors_interval_s"] for f in figures]),
                    "back_s": [f["back_s"] for f in figures]})  # fmt: skip
    return {"runs": out}


def combine(reps: list[dict], cfg: GoodputConfig) -> list[dict]:
    """Per path and interval: median (min–max) over repetitions of each figure."""
    rows = []
    for interval in (None, *cfg.intervals_s):
        for path in PATHS:
            runs = [r for rep in reps for r in rep["runs"] if r["path"] == path and r["interval_s"] == interval]
            row = {
                "path": path,
                "interval_s": interval,
                "faults_per_run": report.spread([len(r["faults"]) for r in runs]),
            }
            for key in (
                "goodput",
                "group_steps",
                "max_stall_s",
                "averaging_interval_s",
                "survivors_interval_s",
                "startup_s",
            ):
                values = [r[key] for r in runs if r[key] is not None]
                row[key] = report.spread(values) if values else None
            backs = [b for r in runs for b in r["back_s"]]
            row["back_s"] = (
                report.spread([b for b in backs if b is not None]) if any(b is not None for b in backs) else None
            )
            row["never_back"] = sum(b is None for b in backs)
            rows.append(row)
    return rows


def targets(rows: list[dict], cfg: GoodputConfig) -> list[dict]:
    """The issue's targets for torchft, each on the medians: stall ≤ fed_timeout_s + one averaging interval, back in
    the quorum within its start-up + one averaging interval (both from the run without failures)."""
    base = next(r for r in rows if r["path"] == "torchft" and r["interval_s"] is None)
    interval = base["averaging_interval_s"]["median"] if base["averaging_interval_s"] else 0.0
    startup = base["startup_s"]["median"] if base["startup_s"] else 0.0
    out = []
    for row in rows:
        if row["path"] != "torchft" or row["interval_s"] is None:
            continue
        t = row["interval_s"]
        for name, value, bound in (
            (f"T = {t:g} s: survivors' longest stall ≤ fed_timeout_s + one averaging ({cfg.fed_timeout_s:g} + "
             f"{interval:.1f} s)", row["max_stall_s"], cfg.fed_timeout_s + interval),
            (f"T = {t:g} s: restarted group back ≤ start-up + one averaging ({startup:.1f} + {interval:.1f} s)",
             row["back_s"], startup + interval),
        ):  # fmt: skip
            measured = value["median"] if value else None
            out.append({"target": name, "measured": measured, "met": measured is not None and measured <= bound})
    return out


def markdown(results: dict) -> str:
    cfg = results["config"]
    where = f"LOCALHOST (no network namespaces: {results['hosts']})"
    if results["hosts"] == "netns":
        where = f"the emulated cluster ({cfg['groups']} network namespaces, {cfg['rate_mbit']:g} Mbit/s between groups)"
    lines = [
        f"{cfg['groups']} groups × {cfg['ranks_per_group']} ranks on {where}, Llama `{cfg['model_size']}`, H = "
        f"{cfg['sync_steps']}, fed_timeout_s {cfg['fed_timeout_s']:g} s; each run trains {cfg['run_s']:g} s "
        f"(from its first step); a group ({', '.join(map(str, cfg['victims']))} in turn) is SIGKILLed every T s "
        f"and restarted R = {cfg['restart_s']:g} s later. torchft: a launch per group, a lighthouse (join timeout "
        f"{cfg['join_timeout_s']:g} s); mesh: one job, torchrun "
        f"--max-restarts + fed_auto_resume, a checkpoint every K = {cfg['save_steps']} steps. Goodput: group-steps "
        "committed to the global model ÷ those of the same path without failures in the same time (all groups share "
        "2 cores: a killed group frees CPU for the others, so throughput would flatter the survivors). Median "
        f"(min–max) over {results['repeats']} repetition(s).",
        "",
        "| path | failure every | faults per run | group-steps | goodput | survivors' longest stall (s) | restarted "
        "group back after (s) | averaging interval (s) | survivors' averaging interval, a group down (s) | "
        "start-up (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        never = f" ({row['never_back']} never back)" if row["never_back"] else ""
        cells = [
            row["path"], "never" if row["interval_s"] is None else f"{row['interval_s']:g} s",
            report.median_range(row["faults_per_run"], ".0f"), report.median_range(row["group_steps"], ".0f"),
            report.median_range(row["goodput"], ".0f", 100) + "%" if row["goodput"] else "—",
            report.median_range(row["max_stall_s"], ".1f"), report.median_range(row["back_s"], ".1f") + never,
            report.median_range(row["averaging_interval_s"], ".2f"),
            report.median_range(row["survivors_interval_s"], ".2f"), report.median_range(row["startup_s"], ".1f"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| target (torchft, on the medians) | measured (s) | met |", "|---|---:|:---:|"]
    for t in results["targets"]:
        measured = "—" if t["measured"] is None else f"{t['measured']:.1f}"
        lines.append(f"| {t['target']} | {measured} | {'yes' if t['met'] else '**no**'} |")
    load = results["machine"]
    lines += ["", f"Machine: {load['cpus']} CPUs; 1-minute load average before each run (after the previous one's "
              f"processes ended): {', '.join(f'{x:.1f}' for x in load['loadavg_before_runs'])}. "
              f"{load['others']}"]  # fmt: skip
    lines += report.run_record_lines(results)
    return "\n".join(lines)


def plot(results: dict, out: Path) -> Path:
    fig, ax = report.new_axes()
    for path, marker in zip(PATHS, "os", strict=True):
        rows = [r for r in results["rows"] if r["path"] == path and r["interval_s"] and r["goodput"]]
        xs = [r["interval_s"] for r in rows]
        mid = [100 * r["goodput"]["median"] for r in rows]
        err = [[100 * (r["goodput"]["median"] - r["goodput"]["min"]) for r in rows],
               [100 * (r["goodput"]["max"] - r["goodput"]["median"]) for r in rows]]  # fmt: skip
        ax.errorbar(xs, mid, yerr=err, marker=marker, capsize=3, label=path)
    ax.set_xlabel("failure interval T (s)")
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
    p.add_argument("--quick", action="store_true", help="4 groups × 1 rank, T = 15 and 30 s, 60 s runs, R = 5 s, once.")
    p.add_argument("--intervals-s", type=float, nargs="+", help="Failure intervals T (default 30 60 120; quick 15 30).")
    p.add_argument("--run-s", type=float, help="Training seconds per run (default 240; quick 60).")
    p.add_argument("--restart-s", type=float, help="Seconds a killed group stays down (default 10; quick 5).")
    p.add_argument("--repeats", type=int, help="Repetitions (default 1; quick 1).")
    p.add_argument("--ranks-per-group", type=int, help="Ranks per group (default 2; quick 1).")
    p.add_argument("--groups", type=int, help="Federation groups (default 4); the victims are groups 1 … G-1 in turn.")
    p.add_argument("--localhost", action="store_true", help="Run on localhost even where namespaces are available.")
    add_folder_options(p, "goodput", work="every run's logs")
    return p


def config_from_args(args: argparse.Namespace) -> GoodputConfig:
    quick = {"intervals_s": (15.0, 30.0), "run_s": 60.0, "restart_s": 5.0, "repeats": 1, "ranks_per_group": 1}
    cfg = GoodputConfig(**(quick if args.quick else {}))
    given = {"intervals_s": tuple(args.intervals_s) if args.intervals_s else None, "run_s": args.run_s,
             "restart_s": args.restart_s, "repeats": args.repeats, "ranks_per_group": args.ranks_per_group,
             "groups": args.groups, "victims": tuple(range(1, args.groups)) if args.groups else None}  # fmt: skip
    cfg = GoodputConfig(**{**asdict(cfg), **{k: v for k, v in given.items() if v is not None}})
    cfg.validate()
    return cfg


def repetition(cfg: GoodputConfig, hosts: Hosts, data: Path, work: Path, loads: list[float]) -> list[Run]:
    """The runs without failures, then each interval, each path in turn (a drift in load hits both alike)."""
    runs = []
    for interval in (None, *cfg.intervals_s):
        for path in PATHS:
            loads.append(os.getloadavg()[0])
            label = "no failures" if interval is None else f"a failure every {interval:g} s"
            print(f"  {path}, {label}", flush=True)
            run_dir = work / f"{path}_{'none' if interval is None else f'{interval:g}s'}"
            runs.append(run_path(cfg, hosts, path, interval, run_dir, data, 29400 + len(loads)))
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

"""A torchft federation loses a group mid-run and takes it back; printed as a timeline (``make elastic-demo``).

    python -m benchmarks.elastic_demo            # what `make elastic-demo` runs, on CPU, about 2-3 minutes here

A Lighthouse (``python -m hf_fedshard.lighthouse --min_groups 1``) and 3 federation groups × 2 CPU ranks, each
group its own ``torchrun`` (``--fed_transport torchft``), train a tiny Llama (the ``micro`` preset, built from its
config) on the embedded Shakespeare text, averaging every H = 4 steps (benchmarks/harness/bench_train.py). Once
group 1 has taken part in 2 averagings, it is killed halfway to its next one with SIGKILL, the whole launch
(torchrun and both workers, as a lost node), and started again 5 s later with the same command. The survivors go
on averaging as 2 groups, without a restart; the restarted group heals from a live one (global model, outer
state, step) and rejoins. Each group's rank 0 appends what happened to a progress log (harness/progress.py), from
which the timeline is printed: every averaging with the groups in it, the kill, the restart, the heal, and where
each group's steps went.

Exits 1, saying why, unless that story happened: the killed group rejoined after a heal, the survivors never
restarted, and every group ended at the last step on one global model (the ranks at each position hold
bit-identical shards).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import progress
from benchmarks.harness.faults import Localhost, start_lighthouse, torchrun
from benchmarks.harness.methods import DATA_CACHE, BenchConfig, prepare_data
from benchmarks.harness.process_tree import kill
from benchmarks.harness.study import new_parser


@dataclass
class DemoConfig:
    """The demo's federation and its one fault."""

    groups: int = 3
    ranks_per_group: int = 2
    sync_steps: int = 4  # H
    max_steps: int = 128
    victim: int = 1
    kill_after_syncs: int = 2  # the victim dies halfway between its 2nd averaging and its 3rd
    restart_after_s: float = 5.0
    timeout_s: float = 420.0  # the whole run: a hang fails the demo
    model_size: str = "micro"
    batch_size: int = 4  # per rank: a group step reads 2 × 4 blocks of 128 tokens


@dataclass
class Launch:
    """One torchrun of one group; times are time.time(), ``killed_at`` set if the demo killed it."""

    group: int
    proc: subprocess.Popen
    started_at: float = field(default_factory=time.time)
    killed_at: float | None = None
    processes_killed: int = 0


@dataclass
class DemoRun:
    """What happened: the launches in order, each group's progress log, the start time."""

    cfg: DemoConfig
    start: float
    launches: list[Launch] = field(default_factory=list)
    logs: dict[int, Path] = field(default_factory=dict)

    def events(self, group: int) -> list[dict]:
        return progress.read(self.logs[group])


def group_args(cfg: DemoConfig, data: Path, work: Path, lighthouse: str, group: int) -> list[str]:
    """bench_train.py's arguments for ``group``: no evaluation, no checkpoint, a log at every averaging."""
    return [
        "--data_dir", str(data), "--record_dir", str(work / f"records{group}"), "--output_dir", str(work / "out"),
        "--progress_log", str(work / f"group{group}.jsonl"), "--model_size", cfg.model_size,
        "--per_device_train_batch_size", str(cfg.batch_size), "--max_steps", str(cfg.max_steps),
        "--learning_rate", "2e-3", "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--seed", "0",
        "--eval_strategy", "no", "--logging_steps", str(cfg.sync_steps), "--save_strategy", "no",
        "--report_to", "none", "--disable_tqdm", "true", "--dataloader_drop_last", "true",
        "--fed_sync_steps", str(cfg.sync_steps), "--fed_timeout_s", "30", "--fed_transport", "torchft",
        "--fed_lighthouse", lighthouse, "--fed_group_id", str(group), "--fed_num_groups", str(cfg.groups),
    ]  # fmt: skip


def run_demo(cfg: DemoConfig, work: Path, data_cache: Path = DATA_CACHE) -> DemoRun:
    """Start the lighthouse and the groups, kill and restart the victim, wait for every group to finish."""
    data = prepare_data(BenchConfig(eval_samples=32), data_cache)
    hosts = Localhost()
    lighthouse, address = start_lighthouse(hosts, 0, work / "lighthouse.log", join_timeout_s=10)
    run = DemoRun(cfg, time.time(), logs={g: work / f"group{g}.jsonl" for g in range(cfg.groups)})
    argv = {g: torchrun(cfg.ranks_per_group, group_args(cfg, data, work, address, g)) for g in range(cfg.groups)}
    try:
        for group in range(cfg.groups):
            run.launches.append(Launch(group, hosts.start(0, argv[group], work / f"group{group}.log")))
        victim = run.launches[cfg.victim]
        wait_for_kill_point(run, victim)
        victim.processes_killed = kill(victim.proc)
        victim.killed_at = time.time()
        print(f"  killed group {cfg.victim} (SIGKILL to {victim.processes_killed} processes)", flush=True)
        time.sleep(cfg.restart_after_s)
        run.launches.append(Launch(cfg.victim, hosts.start(0, argv[cfg.victim], work / f"group{cfg.victim}.log")))
        print(f"  restarted group {cfg.victim}", flush=True)
        wait_for_all(run, work)
    finally:
        for launch in run.launches:
            if launch.proc.poll() is None:
                kill(launch.proc)
        kill(lighthouse)
    return run


def wait_for_kill_point(run: DemoRun, victim: Launch) -> None:
    """Until the victim has taken part in ``kill_after_syncs`` averagings, then half its averaging interval more."""
    deadline = run.start + run.cfg.timeout_s
    while len(syncs := [e for e in run.events(victim.group) if e["event"] == "sync"]) < run.cfg.kill_after_syncs:
        if victim.proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"group {victim.group} ended or stalled before its averaging {run.cfg.kill_after_syncs}")
        time.sleep(0.1)
    interval_s = syncs[-1]["t"] - syncs[-2]["t"] if len(syncs) > 1 else 1.0
    time.sleep(interval_s / 2)


def wait_for_all(run: DemoRun, work: Path) -> None:
    """Until every live launch has exited; a launch still running at the deadline fails the demo."""
    deadline = run.start + run.cfg.timeout_s
    for launch in [launch for launch in run.launches if launch.killed_at is None]:
        try:
            launch.proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            message = f"group {launch.group} did not finish within {run.cfg.timeout_s:.0f} s; logs in {work}"
            raise RuntimeError(message) from None


def timeline_rows(run: DemoRun) -> list[tuple[float, str]]:
    """(seconds since the start, what happened), in time order."""
    rows, syncs = [], {}
    for group in range(run.cfg.groups):
        for e in run.events(group):
            if e["event"] == "sync":
                syncs.setdefault(e["step"], []).append((group, e))
            elif e["event"] == "begin":
                how = "starts training" if e["step"] == 0 else "healed from a live group: resumes training"
                rows.append((e["t"], f"group {group} {how} at step {e['step']}"))
            elif e["event"] == "end" and e["rank"] == 0:
                rows.append((e["t"], f"group {group} finished at step {e['step']}"))
    for step, seen in syncs.items():
        groups = {g for g, _ in seen}
        lanes = " ".join(str(g) if g in groups else "." for g in range(run.cfg.groups))
        quorum = max(e.get("fed_groups_in_quorum", 0) for _, e in seen)
        heals = max(e.get("fed_heals", 0) for _, e in seen)
        rows.append((min(e["t"] for _, e in seen), f"averaging at step {step:>3}: groups [{lanes}]  next quorum "
                     f"{quorum} groups, heals so far {heals}"))  # fmt: skip
    for launch in run.launches:
        if launch.killed_at is not None:
            rows.append((launch.killed_at, f"group {launch.group} KILLED (SIGKILL to torchrun and its workers, "
                         f"{launch.processes_killed} processes)"))  # fmt: skip
    for launch in run.launches[run.cfg.groups :]:
        rows.append((launch.started_at, f"group {launch.group} restarted (the same torchrun command)"))
    return sorted((t - run.start, text) for t, text in rows)


def group_steps(run: DemoRun, group: int) -> str:
    """Where a group's steps went: each attempt's stretch, from its first step to its last averaging."""
    stretches: list[list[int]] = []
    for e in run.events(group):
        if e["event"] == "begin":
            stretches.append([e["step"], e["step"]])
        elif e["event"] == "sync" and stretches:
            stretches[-1][1] = e["step"]
    return ", then ".join(f"steps {a + 1}–{b} committed" for a, b in stretches)


def story_failures(run: DemoRun) -> list[str]:
    """What did not happen as the demo tells it (empty: the story happened)."""
    cfg, failures = run.cfg, []
    for launch in run.launches:
        if launch.killed_at is None and launch.proc.returncode != 0:
            failures.append(f"group {launch.group}'s launch exited with {launch.proc.returncode}")
    begins = {g: [e for e in run.events(g) if e["event"] == "begin"] for g in range(cfg.groups)}
    for group, starts in begins.items():
        if group != cfg.victim and len(starts) != 1:
            failures.append(f"survivor group {group} started {len(starts)} times (it should never restart)")
    healed = [e for e in begins[cfg.victim][1:] if e["step"] > 0]
    if not healed:
        failures.append(f"group {cfg.victim} did not heal from a live group after its restart")
    rejoined = [e for e in run.events(cfg.victim) if e["event"] == "sync" and healed and e["t"] > healed[0]["t"]]
    if not rejoined:
        failures.append(f"group {cfg.victim} did not take part in any averaging after its restart")
    ends = {g: {e["rank"]: e for e in run.events(g) if e["event"] == "end"} for g in range(cfg.groups)}
    for rank in range(cfg.ranks_per_group):
        found = {g: ends[g].get(rank) for g in range(cfg.groups)}
        if any(e is None or e["step"] != cfg.max_steps for e in found.values()):
            failures.append(f"not every group's rank {rank} ended at step {cfg.max_steps}")
        elif len({e["sha256"] for e in found.values()}) != 1:
            failures.append(f"the groups' rank {rank} hold different shards at the end: not one global model")
    return failures


def report(run: DemoRun) -> str:
    lines = ["", "  time  what happened", "------  -------------"]
    lines += [f"{t:5.1f}s  {text}" for t, text in timeline_rows(run)]
    lines += ["", "Steps of each group (an averaging commits a group's steps since its previous one):"]
    lines += [f"  group {g}: {group_steps(run, g)}" for g in range(run.cfg.groups)]
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--max-steps", type=int, default=DemoConfig.max_steps, help="Steps of every group.")
    p.add_argument("--restart-after-s", type=float, default=DemoConfig.restart_after_s, help="Seconds down.")
    p.add_argument("--ranks-per-group", type=int, default=DemoConfig.ranks_per_group, help="CPU ranks of a group.")
    p.add_argument("--work", type=Path, help="Keep the logs here (default: a temporary folder).")
    p.add_argument("--data-cache", type=Path, default=DATA_CACHE, help="Where the tokenized text is kept.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    cfg = DemoConfig(
        max_steps=args.max_steps, restart_after_s=args.restart_after_s, ranks_per_group=args.ranks_per_group
    )
    with tempfile.TemporaryDirectory(prefix="fedshard-elastic-demo-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print(f"{cfg.groups} groups × {cfg.ranks_per_group} ranks, H = {cfg.sync_steps}, {cfg.max_steps} steps; "
              f"group {cfg.victim} dies after averaging {cfg.kill_after_syncs}, back {cfg.restart_after_s:g} s later",
              flush=True)  # fmt: skip
        run = run_demo(cfg, work, args.data_cache)
        print(report(run))
        failures = story_failures(run)
    print(f"\nwall time {time.time() - run.start:.0f} s")
    if failures:
        print("\nThe story did not happen:\n" + "\n".join(f"  - {f}" for f in failures))
        return 1
    print(f"OK: group {cfg.victim} rejoined after a heal; the survivors never restarted; all groups ended on one "
          "global model (bit-identical shards).")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

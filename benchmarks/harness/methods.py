"""The methods the cluster studies compare, and one run of them on a fresh emulated cluster.

FSDP, HSDP, FL+FSDP, FL+HSDP, the ideal (FL+FSDP whose groups never average), Accelerate's LocalSGD and the
variants of ``report.VARIANTS``, each as bench_train.py arguments (`method_args`) on top of what every method
shares (`shared_args`); `benchmark` builds the cluster a `BenchConfig` describes, runs the chosen methods one after
the other with the real multi-node launcher, and returns every figure (`report.summarize`) with the machine's
load around each method. Used by benchmarks/tiers.py, scaling.py and overlap.py; time_to_quality.py runs its own
methods and settings through `run_methods`; quality.py and outer_lr_sweep.py take the data and shared arguments only,
layout_change.py the data only; stream_quality.py the data and shared arguments, and trains on this machine's
loopback through `train_on_localhost` (no emulated cluster: a study of the loss only).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.harness import REPO, TRAIN_SCRIPT, process_tree, report, torchrun_command
from benchmarks.harness.netns import Cluster, handle_termination
from benchmarks.harness.report import VARIANTS, base_method
from hf_fedshard.errors import ConfigError

DATA_CACHE = Path.home() / ".cache" / "hf_fedshard" / "benchmark-data"
FULL_METHODS = ("FSDP", "HSDP", "FL+FSDP", "FL+HSDP", "ideal", "LocalSGD", *VARIANTS)


@dataclass
class BenchConfig:
    """Everything that defines a run; the same for every method except the parallelism."""

    nodes: int = 4
    ranks_per_node: int = 2
    rate_mbit: float = 100.0  # node links (two tiers: the only shaped tier)
    racks: int = 1  # > 1: three tiers, FL+HSDP groups = racks
    rack_rate_mbit: float | None = None  # rack uplinks (three tiers)
    methods: tuple[str, ...] = FULL_METHODS
    model_size: str = "tiny"
    block_size: int = 128
    batch_size: int = 4  # per device
    steps: int = 48
    sync_steps: int = 8  # H, for every method that averages
    warmup_steps: int = 8  # left out of the throughput (one window of H steps)
    eval_steps: int = 16
    eval_samples: int = 64
    max_train_lines: int | None = None  # a prefix of the training text (tests); None: all of it
    learning_rate: float = 2e-3
    seed: int = 0
    timeout_s: float = 600.0  # per method
    extra: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def nodes_per_rack(self) -> int | None:
        """Nodes per rack with three tiers, ``None`` with two (one switch)."""
        return self.nodes // self.racks if self.racks > 1 else None

    @property
    def fl_hsdp_nodes(self) -> int:
        """Nodes in an FL+HSDP group: a rack with three tiers, 2 with two."""
        return self.nodes_per_rack or 2

    @property
    def tokens_per_step(self) -> int:
        """World tokens per optimizer step: the same for every method."""
        return self.world_size * self.batch_size * self.block_size

    def validate(self) -> None:
        unknown = set(self.methods) - set(FULL_METHODS)
        if unknown:
            raise ValueError(f"--methods {sorted(unknown)} unknown; choose from {', '.join(FULL_METHODS)}.")
        if self.racks < 1 or self.nodes % self.racks:
            raise ValueError(f"--racks={self.racks} must divide --nodes={self.nodes}.")
        if any(base_method(m) == "FL+HSDP" for m in self.methods) and (
            self.nodes % self.fl_hsdp_nodes or self.fl_hsdp_nodes < 2
        ):
            raise ValueError(
                f"FL+HSDP puts {self.fl_hsdp_nodes} nodes in a group (a rack with three tiers, else 2): "
                f"--nodes={self.nodes} must be a multiple of it, and a rack must hold at least 2 nodes."
            )
        if self.steps % self.sync_steps or self.eval_steps % self.sync_steps or self.steps % self.eval_steps:
            raise ValueError(
                f"--steps={self.steps}, --eval-steps={self.eval_steps} and H={self.sync_steps}: steps and eval "
                "steps must be multiples of H (and steps of eval steps), so every window and eval follows a sync."
            )
        for name in self.methods:
            try:
                report.layout_of(name, asdict(self))
            except ConfigError as err:
                raise ValueError(f"--methods {name!r} does not fit {self.world_size} ranks: {err}") from None
        if self.steps <= self.warmup_steps:
            raise ValueError(f"--steps={self.steps} must exceed --warmup-steps={self.warmup_steps}.")


def method_args(name: str, cfg: BenchConfig) -> list[str]:
    """The parallelism of each method (and a variant's settings), as bench_train.py arguments."""
    r, h = cfg.ranks_per_node, str(cfg.sync_steps)
    variant = VARIANTS[name][1] if name in VARIANTS else []
    unsplit = ["--fed_split_exchange", "false"]  # FL+HSDP as before the split; "FL+HSDP split" turns it on
    return {
        "FSDP": ["--fsdp"],
        "HSDP": ["--fed_shard_size", str(r)],
        "FL+FSDP": ["--fed_group_size", str(r), "--fed_sync_steps", h],
        "FL+HSDP": [
            "--fed_group_size",
            str(cfg.fl_hsdp_nodes * r),
            "--fed_shard_size",
            str(r),
            "--fed_sync_steps",
            h,
            *unsplit,
        ],
        "ideal": ["--fed_group_size", str(r), "--no_averaging", "true"],
        "LocalSGD": ["--use_cpu", "true", "--local_sgd_steps", h],
    }[base_method(name)] + variant


def shared_args(cfg: BenchConfig) -> list[str]:
    return [
        "--model_size", cfg.model_size, "--per_device_train_batch_size", str(cfg.batch_size),
        "--per_device_eval_batch_size", str(max(1, cfg.eval_samples // cfg.world_size)),
        "--max_steps", str(cfg.steps), "--learning_rate", str(cfg.learning_rate), "--lr_scheduler_type", "constant",
        "--warmup_steps", "0", "--weight_decay", "0", "--max_grad_norm", "1.0", "--seed", str(cfg.seed),
        "--eval_strategy", "steps", "--eval_steps", str(cfg.eval_steps), "--eval_on_start", "true",
        "--logging_steps", str(cfg.sync_steps), "--save_strategy", "no", "--report_to", "none",
        "--disable_tqdm", "true", "--average_tokens_across_devices", "false", "--dataloader_drop_last", "true",
    ]  # fmt: skip


def prepare_data(cfg: BenchConfig, cache: Path) -> Path:
    """Tokenizer and packed Shakespeare blocks, made once and loaded by every rank of every method."""
    from datasets import disable_progress_bars

    from hf_fedshard.tools.data import load_text, pack, train_bpe_tokenizer

    disable_progress_bars()

    path = cache / f"shakespeare-bpe8192-block{cfg.block_size}-eval{cfg.eval_samples}-lines{cfg.max_train_lines}"
    if (path / "blocks" / "dataset_dict.json").exists():
        return path
    raw = load_text("shakespeare")
    if cfg.max_train_lines is not None:
        raw["train"] = raw["train"].select(range(min(cfg.max_train_lines, len(raw["train"]))))
    tokenizer = train_bpe_tokenizer(raw["train"], 8192)
    blocks = pack(raw, tokenizer, cfg.block_size)
    blocks["validation"] = blocks["validation"].shuffle(seed=0).select(range(cfg.eval_samples))
    blocks.save_to_disk(str(path / "blocks"))
    tokenizer.save_pretrained(str(path / "tokenizer"))
    return path


def train_on_localhost(
    world: int, args: list[str], data: Path, run_dir: Path, timeout_s: float, niceness: int = 0
) -> dict:
    """bench_train.py on ``world`` ranks of this machine (``torchrun --standalone``, no namespaces); rank 0's record.

    For the studies of the loss only: nothing here shapes or measures the network. ``niceness`` > 0 runs the launcher
    and its ranks under ``nice -n niceness``, so that a long study yields the cores to other jobs. The ranks' output
    goes to ``run_dir/log.txt``; a failed run raises with its tail.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [*(["nice", "-n", str(niceness)] if niceness else []), *torchrun_command(),
           "--standalone", f"--nproc_per_node={world}", str(TRAIN_SCRIPT), "--data_dir", str(data),
           "--record_dir", str(run_dir / "records"), "--output_dir", str(run_dir / "out"), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    log = run_dir / "log.txt"
    with open(log, "w") as out:
        try:
            code = process_tree.run(cmd, timeout_s, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
        except subprocess.TimeoutExpired:  # stopped with every rank
            code = f"killed after {timeout_s:.0f} s"
    if code:
        raise RuntimeError(f"bench_train.py on {world} ranks failed (exit {code}); log in {log}:\n"
                           f"{log.read_text()[-5000:]}")  # fmt: skip
    return json.loads((run_dir / "records" / "rank0.json").read_text())


def run_method(
    cluster: Cluster, name: str, cfg: BenchConfig, data: Path, work: Path, port: int, args: list[str] | None = None
) -> list[dict]:
    """Train ``name`` on the cluster; return every rank's record.

    ``args``: the method's bench_train.py arguments after the shared ones (default `method_args(name, cfg)`), for a
    study that runs a method under its own name with settings of its own.
    """
    run_dir = work / name.replace("+", "_").replace(" ", "_").replace("×", "x").replace("/", "_")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    args = ["--data_dir", str(data), "--record_dir", str(run_dir / "records"), "--output_dir", str(run_dir / "out"),
            *shared_args(cfg), *(method_args(name, cfg) if args is None else args)]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    logs = [run_dir / f"node{node}.log" for node in range(cfg.nodes)]
    start = time.monotonic()
    commands = cluster.torchrun_commands(cfg.ranks_per_node, port, [str(TRAIN_SCRIPT), *args])
    codes = cluster.run(commands, env, logs, cfg.timeout_s)
    print(f"  {name}: exit codes {codes} in {time.monotonic() - start:.0f} s", flush=True)
    if any(codes):
        tail = "\n".join(log.read_text()[-3000:] for log in logs)
        raise RuntimeError(f"{name} failed (exit codes {codes}); logs in {run_dir}:\n{tail}")
    return [json.loads(p.read_text()) for p in sorted((run_dir / "records").glob("rank*.json"))]


def busy_cpu_s() -> tuple[float, float]:
    """CPU seconds the whole machine has been busy since boot (all processes, /proc/stat), and ours.

    Returns (machine, ours): ours is this process plus its waited-for descendants (every launcher and rank).
    """
    ticks = os.sysconf("SC_CLK_TCK")
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    machine = (user + nice + system + irq + softirq + steal) / ticks
    own = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return machine, sum(r.ru_utime + r.ru_stime for r in own)


def others_cpu(start: tuple[float, float], wall_s: float) -> dict:
    """Cores that other processes kept busy on average since ``start`` (a `busy_cpu_s()` reading)."""
    machine, ours = busy_cpu_s()
    foreign = max(0.0, (machine - start[0]) - (ours - start[1]))
    return {"other_processes_cpu_s": round(foreign, 1), "other_processes_cores": round(foreign / wall_s, 3)}


def machine_load() -> dict:
    """Load averages and the busiest other processes, to judge how much the timings were disturbed."""
    ps = subprocess.run(["ps", "-eo", "pid,pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True).stdout
    busy = [line.split(None, 2) for line in ps.splitlines()[1:6]]
    return {"loadavg_1_5_15": list(os.getloadavg()), "cpus": os.cpu_count(),
            "top_processes": [{"pid": int(p), "pcpu": float(c), "comm": n} for p, c, n in busy]}  # fmt: skip


def wait_until_quiet(max_wait_s: float, poll_s: float = 30.0, threshold: float = 0.5) -> dict:
    """Poll the 1-minute load average until it is below ``threshold`` (others' tests distort timings)."""
    start = time.monotonic()
    while True:
        load = os.getloadavg()[0]
        waited = time.monotonic() - start
        if load < threshold or waited >= max_wait_s:
            return {"quiet": load < threshold, "waited_s": round(waited), "load_1min": load, "threshold": threshold}
        print(f"  machine busy (1-min load {load:.2f}); waiting {poll_s:.0f} s", flush=True)
        time.sleep(poll_s)


def benchmark(cfg: BenchConfig, work: Path, data_cache: Path, quiet: dict | None = None) -> dict:
    """Build the cluster, run every method, and return every figure; the cluster is removed whatever happens.

    The caller records its own command and writes the results (`report.write`) where it keeps them.
    """
    cfg.validate()
    runs = run_methods(cfg, {name: method_args(name, cfg) for name in cfg.methods}, work, data_cache)
    results = report.summarize(runs["records"], asdict(cfg), runs["link"])
    machine = runs["machine"]
    results["machine"] = {"before": machine["before"], "after_each_method": machine["after_each_method"],
                          "quiet_wait": quiet, "wall_s": machine["wall_s"], "started": machine["started"]}  # fmt: skip
    return results


def run_methods(cfg: BenchConfig, methods: dict[str, list[str]], work: Path, data_cache: Path) -> dict:
    """Build the cluster, train each method (name: its bench_train.py arguments) one after the other, remove the
    cluster whatever happens; return every rank's record per method, the link's goodput and the machine's load."""
    records, load_before, load_after_each = {}, machine_load(), {}
    started = time.time()
    data = prepare_data(cfg, data_cache)
    with handle_termination(), Cluster(cfg.nodes, cfg.rate_mbit, cfg.racks, cfg.rack_rate_mbit) as cluster:
        link = cluster.probe_goodput(0, 1)
        if cfg.racks > 1:
            link["rack"] = cluster.probe_goodput(0, cluster.nodes_per_rack)
        for index, (name, args) in enumerate(methods.items()):
            cpu, start = busy_cpu_s(), time.monotonic()
            records[name] = run_method(cluster, name, cfg, data, work, 29500 + index, args)
            # The load average counts this method's own ranks; the CPU others used is what disturbed it.
            load_after_each[name] = {**machine_load(), **others_cpu(cpu, time.monotonic() - start)}
    machine = {"before": load_before, "after_each_method": load_after_each, "wall_s": round(time.time() - started),
               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started))}  # fmt: skip
    return {"records": records, "link": link, "machine": machine}

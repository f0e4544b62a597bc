"""The training loop's own cost: FedShardTrainer against plain `Trainer` + FSDP2 and a hand-written loop.

Same work per rank in every method: the same Llama preset and initialisation, per-device batch, sequence length,
AdamW hyperparameters, gradient clipping, constant learning rate and number of optimizer steps, on 4 CPU ranks:

- ``fedshard``: `FedShardTrainer`, FL+FSDP with 2 groups × 2 ranks, FedAvg every H steps;
- ``fedshard_no_reshard``: the same with ``--fsdp_config '{"reshard_after_forward": false}'`` (Accelerate's
  switch): each group keeps its layers gathered from forward to backward, one all-gather per layer and for the
  embedding less per step, for a whole model's parameters in memory;
- ``trainer``: plain `transformers.Trainer` with FSDP2 over 2 ranks, run as two jobs of 2 ranks side by side
  (one group each, never averaging): the same per-rank compute and intra-group traffic as ``fedshard``. On CPU,
  Accelerate turns FSDP into DDP (see ../shared/FACTS.md), so its state is switched back to FSDP with the same
  6 lines hf_fedshard uses (`hf_fedshard.integrations.fsdp.ensure_fsdp`); nothing else of hf_fedshard runs;
- ``handwritten``: a minimal FSDP2 + FedAvg loop (`fully_shard` per decoder layer and the root on the group's
  mesh, `torch.optim.AdamW`, an all-reduce of the local shards along ``fed`` every H steps). Accelerate also gives
  the input embedding and the output head (with the final norm, kept gathered) units of their own, so the
  Trainer-based methods issue three collectives per step more: the count column shows it;
- ``engine``: the same loop with hf_fedshard's `FederatedAverager` doing the averaging (README's plain loop:
  FedAvg, fp32), in place of the bare all-reduce.

Each optimizer step is cut into phases from timestamps taken on rank 0: data (fetching the batch), forward,
backward, optimizer (clipping, step, zero_grad, LR scheduler), averaging, and other (callbacks, logging and
whatever else the loop does between steps). Beside the wall clock, rank 0's CPU time per step (``process_time``):
4 ranks share the cores, and CPU time counts the work a rank does, not the time it waits for the others, so it
separates the loop's own cost from the machine's load; and the all-gathers and reduce-scatters FSDP2 issues per step
(counted), the points at which a rank waits for the others of its group. The methods run interleaved, ``--reps``
times each, and every figure is the median over repetitions with its spread (min–max); a ratio between two methods
is taken in each repetition (they ran back to back) before its median. Run it alone on the machine (it takes
/tmp/hf_fedshard_cpu.lock while it runs):

    python -m benchmarks.overhead                 # tiny preset, 48 steps, 3 repetitions (about 8 minutes)
    python -m benchmarks.overhead --quick         # micro preset, 24 steps, 2 repetitions (about 3 minutes)

Four ranks on 2 cores wait for each other's turn on a core, and that moves a step by ±15–20% between runs.
``--pin`` gives each rank a core of its own: ``--group-size 1`` (2 groups of one rank, no FSDP collective: the
loop and the averaging alone; without ``trainer``, which needs 2 ranks for FSDP) or ``--num-groups 1`` (one group
of 2 ranks, which never averages):

    python -m benchmarks.overhead --group-size 1 --pin --reps 6 --methods fedshard handwritten engine
    python -m benchmarks.overhead --num-groups 1 --pin --reps 6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.harness import REPO, process_tree, results_folder
from benchmarks.harness.exclusive import exclusive_cores
from benchmarks.harness.methods import busy_cpu_s, others_cpu

METHODS = ("fedshard", "fedshard_no_reshard", "trainer", "handwritten", "engine")
PHASES = ("data", "forward", "backward", "optimizer", "averaging", "other")
VOCAB = 8192
LR, WEIGHT_DECAY, MAX_GRAD_NORM, SEED = 3e-4, 0.0, 1.0, 0


class CollectiveCounter:
    """Counts the all-gathers and reduce-scatters FSDP2 issues (it calls them through ``torch.distributed``): the
    synchronisations of a step, a figure the machine's load does not change. On CPU/gloo nothing else calls these
    two (on NCCL Accelerate's gather of the logged loss would be counted too)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.calls = 0
        for name in ("all_gather_single", "reduce_scatter_single"):
            setattr(dist, name, self._counted(getattr(dist, name)))

    def _counted(self, collective):
        def counted(*args, **kwargs):
            self.calls += 1
            return collective(*args, **kwargs)

        return counted


class Timeline:
    """Timestamps of named events on this rank; each optimizer step's phases are read off them."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._last_end: float | None = None
        self._last_cpu = time.process_time()
        self._counter, self._last_calls = CollectiveCounter(), 0

    def mark(self, name: str) -> None:
        self._current[name] = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self._current[name] = self._current.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def end_step(self) -> None:
        """Close the step: its total runs from the previous step's end (so logging and callbacks are in)."""
        now = time.perf_counter()
        start = self._last_end if self._last_end is not None else self._current.pop("first_start", now)
        record = {phase: self._current.get(phase, 0.0) for phase in PHASES if phase != "other"}
        record["total"] = now - start
        record["other"] = record["total"] - sum(record[p] for p in PHASES if p != "other")
        cpu = time.process_time()
        record["cpu"], self._last_cpu = cpu - self._last_cpu, cpu
        record["collectives"], self._last_calls = self._counter.calls - self._last_calls, self._counter.calls
        self.steps.append(record)
        self._current, self._last_end = {}, now


def random_blocks(num_samples: int, seq_len: int) -> list[dict]:
    """Sample i: tokens from a generator seeded with i (identical in every method and on every rank)."""
    import torch

    blocks = []
    for i in range(num_samples):
        ids = torch.randint(0, VOCAB, (seq_len,), generator=torch.Generator().manual_seed(i))
        blocks.append({"input_ids": ids, "labels": ids.clone()})
    return blocks


def build_model(size: str, seq_len: int):
    import torch
    from transformers import AutoModelForCausalLM

    from hf_fedshard.tools.models import llama_config

    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(llama_config(size, VOCAB, seq_len))


# ---- Trainer-based methods ----


def trainer_worker(opts: argparse.Namespace) -> list[dict]:
    """Run `FedShardTrainer` (fedshard) or plain `Trainer` with FSDP2 (trainer) with the phases timed."""
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    from hf_fedshard import FedShardTrainer, FedShardTrainingArguments
    from hf_fedshard.integrations.fsdp import ensure_fsdp, requested_fsdp_plugin

    timeline = Timeline()
    common = dict(
        output_dir=opts.workdir, per_device_train_batch_size=opts.batch_size, max_steps=opts.steps,
        learning_rate=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM, lr_scheduler_type="constant",
        warmup_steps=0, logging_steps=opts.logging_steps, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=SEED, dataloader_num_workers=0, average_tokens_across_devices=False,
    )  # fmt: skip
    if opts.method.startswith("fedshard"):
        keep = {"fsdp_config": {"reshard_after_forward": False}} if opts.method == "fedshard_no_reshard" else {}
        args = FedShardTrainingArguments(**common, fed_group_size=opts.group_size, fed_sync_steps=opts.sync_steps,
                                         **keep)  # fmt: skip
        base = FedShardTrainer
    else:
        args = TrainingArguments(**common, use_cpu=True, fsdp=True, fsdp_config={"version": 2})  # as FedShard's
        base = Trainer

    class TimedTrainer(base):
        """Times the loop's phases by wrapping the methods that hold them (benchmark only)."""

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if base is Trainer:  # Accelerate's CPU fallback to DDP, undone as on a GPU machine
                ensure_fsdp(self.accelerator, requested_fsdp_plugin(self.args))
                self.is_fsdp_enabled = True

        def get_batch_samples(self, *a, **k):
            with timeline.timed("data"):
                return super().get_batch_samples(*a, **k)

        def compute_loss(self, *a, **k):
            with timeline.timed("forward"):
                return super().compute_loss(*a, **k)

        def training_step(self, *a, **k):
            start = time.perf_counter()
            try:
                return super().training_step(*a, **k)
            finally:  # training_step is forward + backward; compute_loss timed the forward
                timeline.add("backward", time.perf_counter() - start - timeline._current.get("forward", 0.0))
                timeline.mark("backward_end")

    class Phases(TrainerCallback):
        def on_train_begin(self, *a, **k):
            timeline._last_end, timeline._last_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):  # runs first: the optimizer phase ends here
            timeline.add("optimizer", time.perf_counter() - timeline._current["backward_end"])
            timeline.mark("optimizer_end")

    class BeforeAveraging(TrainerCallback):
        def on_step_end(self, *a, **k):  # runs right before the FedAvg callback
            timeline.mark("averaging_start")

    class AfterAveraging(TrainerCallback):
        def on_step_end(self, *a, **k):  # runs right after the FedAvg callback
            timeline.add("averaging", time.perf_counter() - timeline._current["averaging_start"])

    class StepEnd(TrainerCallback):
        def on_step_begin(self, *a, **k):  # the previous step's logging is done by now
            if timeline._current.get("optimizer_end"):
                timeline.end_step()

        def on_train_end(self, *a, **k):
            timeline.end_step()

    model = build_model(opts.model_size, opts.seq_len)
    data = random_blocks(opts.num_samples, opts.seq_len)
    trainer = TimedTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
    fed = getattr(trainer, "fed_callback", None)
    if fed is not None:
        trainer.remove_callback(fed)
    trainer.callback_handler.callbacks.insert(0, Phases())
    trainer.add_callback(BeforeAveraging())
    if fed is not None:
        trainer.add_callback(fed)
    trainer.add_callback(AfterAveraging())
    trainer.add_callback(StepEnd())
    trainer.train()
    return timeline.steps


# ---- The hand-written loop ----


def handwritten_worker(opts: argparse.Namespace) -> list[dict]:
    """FSDP2 in groups and FedAvg of the local shards every H steps, with nothing else around it (``engine``:
    `FederatedAverager` averages, on the mesh `FederationLayout` builds)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import default_data_collator

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if opts.method == "engine":
        from hf_fedshard import FederatedAverager, FederationLayout

        mesh = FederationLayout(world, group_size=opts.group_size).build_mesh("cpu")
        group_mesh = mesh["dp_replicate", "dp_shard"]
    else:
        mesh = init_device_mesh("cpu", (opts.num_groups, opts.group_size), mesh_dim_names=("fed", "dp_shard"))
        group_mesh = mesh["dp_shard"]
    model = build_model(opts.model_size, opts.seq_len)
    for layer in model.model.layers:
        fully_shard(layer, mesh=group_mesh)
    fully_shard(model, mesh=group_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    averager = (
        FederatedAverager(model, optimizer, mesh, sync_steps=opts.sync_steps) if opts.method == "engine" else None
    )
    data = random_blocks(opts.num_samples, opts.seq_len)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=opts.batch_size, sampler=sampler, collate_fn=default_data_collator)
    fed_group = None if averager is not None else mesh.get_group("fed")
    timeline, batches = Timeline(), iter(loader)
    timeline._last_end, timeline._last_cpu = time.perf_counter(), time.process_time()
    model.train()
    for step in range(1, opts.steps + 1):
        with timeline.timed("data"):
            batch = next(batches)
        with timeline.timed("forward"):
            loss = model(**batch).loss
        with timeline.timed("backward"):
            loss.backward()
        with timeline.timed("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            optimizer.zero_grad()
        if averager is not None:
            with timeline.timed("averaging"):
                averager.step(last=step == opts.steps)
        elif opts.num_groups > 1 and (step % opts.sync_steps == 0 or step == opts.steps):
            with timeline.timed("averaging"), torch.no_grad():
                shards = [p.to_local() for p in model.parameters()]
                flat = torch.cat([s.reshape(-1) for s in shards])
                dist.all_reduce(flat, group=fed_group)
                flat.div_(opts.num_groups)
                for shard, mean in zip(shards, flat.split([s.numel() for s in shards]), strict=True):
                    shard.copy_(mean.view_as(shard))
        if step % opts.logging_steps == 0 and rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        timeline.end_step()
    dist.destroy_process_group()
    return timeline.steps


# ---- The driver ----


def worker(opts: argparse.Namespace) -> None:
    if opts.pin:
        cores = sorted(os.sched_getaffinity(0))  # the cores this process may use, not always 0..N-1
        os.sched_setaffinity(0, {cores[opts.first_core + int(os.environ["LOCAL_RANK"])]})
    steps = handwritten_worker(opts) if opts.method in ("handwritten", "engine") else trainer_worker(opts)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(opts.record).write_text(json.dumps(steps))


def jobs(opts: argparse.Namespace, method: str) -> list[tuple[int, str, int]]:
    """The launches of one run of ``method``, as (ranks, name, first core): one over all groups' ranks, or for
    ``trainer`` one per group side by side (its ranks on the cores after the previous group's)."""
    size, groups = opts.group_size, opts.num_groups
    if method == "trainer":
        return [(size, f"{method}{j}", j * size) for j in range(groups)]
    return [(size * groups, method, 0)]


def launch(opts: argparse.Namespace, method: str, record_dir: Path) -> list[tuple[int, list[dict]]]:
    """One run of ``method``: (ranks, rank 0's steps) per launch."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    procs = []
    for nproc, name, first_core in jobs(opts, method):
        record = record_dir / f"{name}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               __file__, "--worker", "--method", method, "--record", str(record), "--workdir",
               str(record_dir / name), "--first-core", str(first_core), *opts.worker_args]  # fmt: skip
        log = open(record_dir / f"{name}.log", "w")  # noqa: SIM115 (closed when the process ends)
        proc = process_tree.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        procs.append((nproc, proc, record, log))
    results = []
    for nproc, proc, record, log in procs:
        if proc.wait(timeout=opts.timeout_s) != 0:
            raise RuntimeError(f"{method} failed: see {log.name}")
        log.close()
        results.append((nproc, json.loads(record.read_text())))
    return results


def summarise(launches: list[tuple[int, list[dict]]], tokens_per_rank_step: int, warmup: int) -> dict:
    """tokens/s of one run (all its launches together) and its mean phase times per step after the warm-up."""
    rate = sum(nproc * tokens_per_rank_step * len(steps[warmup:]) / sum(s["total"] for s in steps[warmup:])
               for nproc, steps in launches)  # fmt: skip
    kept = [s for _, steps in launches for s in steps[warmup:]]
    phases = {p: statistics.mean(s[p] for s in kept) * 1000 for p in (*PHASES, "total", "cpu")}
    phases["collectives"] = statistics.mean(s["collectives"] for s in kept)  # a count, not ms
    return {"tokens_per_s": rate, "ms_per_step": phases}


def median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def paired(results: dict[str, list[dict]], method: str, base: str, key: str) -> tuple[float, float, float]:
    """``method``'s figure ÷ ``base``'s in each repetition (the two ran back to back): median, min, max."""
    return median_spread([value(m, key) / value(b, key) for m, b in zip(results[method], results[base], strict=True)])


def value(run: dict, key: str) -> float:
    return run["tokens_per_s"] if key == "tokens_per_s" else run["ms_per_step"][key]


def report(results: dict[str, list[dict]]) -> str:
    columns = (*PHASES, "total", "cpu", "collectives")
    med = {m: median_spread([r["tokens_per_s"] for r in results[m]]) for m in results}
    lines = ["| method | tokens/s (median, min–max) | vs trainer | "
             + " | ".join(f"{p} ms" for p in (*PHASES, "total")) + " | CPU ms (rank 0) | FSDP collectives |",
             "|---|---:|---:|" + "---:|" * len(columns)]  # fmt: skip
    for method, runs in results.items():
        phase_ms = [statistics.median(r["ms_per_step"][p] for r in runs) for p in columns]
        rate, low, high = med[method]
        ratio = f"{rate / med['trainer'][0]:.3f}" if "trainer" in med else "—"
        lines.append(f"| {method} | {rate:,.0f} ({low:,.0f}–{high:,.0f}) | {ratio} | "
                     + " | ".join(f"{v:.1f}" for v in phase_ms) + " |")  # fmt: skip
    if "fedshard" in results and "trainer" in results:
        own = [r["ms_per_step"]["total"] - r["ms_per_step"]["averaging"] for r in results["fedshard"]]
        base = [r["ms_per_step"]["total"] for r in results["trainer"]]
        cost = statistics.median(own) / statistics.median(base) - 1
        lines.append(f"\nhf_fedshard's own cost over Trainer + FSDP2 (step time less averaging): {cost:+.1%} "
                     f"(target ≤ +3%: {'met' if cost <= 0.03 else 'missed'})")  # fmt: skip
    for loop, name in (("handwritten", "Hand-written loop"), ("engine", "Plain loop with FederatedAverager")):
        for method in ("fedshard", "fedshard_no_reshard"):
            if loop in results and method in results:
                rate, low, high = paired(results, loop, method, "tokens_per_s")
                cpu = paired(results, method, loop, "cpu")
                lines.append(f"{name} vs {method}: {rate - 1:+.1%} ({low - 1:+.1%} to {high - 1:+.1%}) tokens/s "
                             f"(target ≤ +5%: {'met' if rate <= 1.05 else 'missed'}); {method}'s CPU time per step "
                             f"{cpu[0]:.3f}× ({cpu[1]:.3f}–{cpu[2]:.3f}) the loop's")  # fmt: skip
    busy = ", ".join(f"{m} {statistics.median(r['other_processes_cores'] for r in runs):.2f}"
                     for m, runs in results.items() if all("other_processes_cores" in r for r in runs))  # fmt: skip
    if busy:
        lines.append(f"CPU cores kept busy by other processes during each method's runs (median): {busy}")
    if "fedshard" in results and "fedshard_no_reshard" in results:
        rate, low, high = paired(results, "fedshard_no_reshard", "fedshard", "tokens_per_s")
        lines.append(f"reshard_after_forward false vs true: {rate - 1:+.1%} ({low - 1:+.1%} to {high - 1:+.1%}) "
                     "tokens/s")  # fmt: skip
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="micro preset, 24 steps, 2 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of each method (default 3, quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 48, quick 24)")
    parser.add_argument("--warmup", type=int, default=8, help="first steps left out of every figure")
    parser.add_argument("--model-size", default=None, help="Llama preset (default tiny, quick micro)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--sync-steps", type=int, default=8, help="H for fedshard and handwritten")
    parser.add_argument("--num-groups", type=int, default=2, help="federation groups (1: no averaging)")
    parser.add_argument("--group-size", type=int, default=2, help="ranks per group (FSDP2 shards over them)")
    parser.add_argument("--pin", action="store_true", help="pin each rank to a core of its own")
    parser.add_argument("--logging-steps", type=int, default=10, help="logging_steps of every method")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results/overhead_<quick|full>)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--num-samples", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--first-core", type=int, default=0, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    world = opts.num_groups * opts.group_size
    if opts.pin and world > len(os.sched_getaffinity(0)):
        parser.error(f"--pin needs a core per rank: {world} ranks, {len(os.sched_getaffinity(0))} cores; "
                     "lower --num-groups or --group-size")  # fmt: skip
    if opts.group_size < 2 and "trainer" in opts.methods and not opts.worker:
        parser.error("--group-size 1 leaves trainer out (plain Trainer turns FSDP on with 2 ranks or more): "
                     "add --methods without it")  # fmt: skip
    layout = None if (opts.num_groups, opts.group_size) == (2, 2) else f"{opts.num_groups}x{opts.group_size}"
    variant = "_".join(v for v in (layout, "pinned" if opts.pin else None) if v) or None
    opts.out = opts.out or results_folder("overhead", opts.quick, variant)
    opts.reps = opts.reps or (2 if opts.quick else 3)
    opts.steps = opts.steps or (24 if opts.quick else 48)
    opts.model_size = opts.model_size or ("micro" if opts.quick else "tiny")
    opts.num_samples = opts.num_samples or opts.steps * opts.batch_size * world
    opts.worker_args = ["--steps", str(opts.steps), "--model-size", opts.model_size, "--batch-size",
                        str(opts.batch_size), "--seq-len", str(opts.seq_len), "--sync-steps", str(opts.sync_steps),
                        "--logging-steps", str(opts.logging_steps), "--num-samples", str(opts.num_samples),
                        "--num-groups", str(opts.num_groups), "--group-size", str(opts.group_size),
                        *(["--pin"] if opts.pin else [])]  # fmt: skip
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse(sys.argv[1:] if argv is None else argv)
    if opts.worker:
        return worker(opts)
    opts.out.mkdir(parents=True, exist_ok=True)
    tokens_per_rank_step = opts.batch_size * opts.seq_len
    results: dict[str, list[dict]] = {m: [] for m in opts.methods}
    with exclusive_cores("benchmarks.overhead"):
        for rep in range(opts.reps):  # interleaved: a drift in the machine's load hits every method alike
            for method in opts.methods:
                record_dir = opts.out / "runs" / f"{method}-{rep}"
                record_dir.mkdir(parents=True, exist_ok=True)
                start, began = busy_cpu_s(), time.monotonic()
                summary = summarise(launch(opts, method, record_dir), tokens_per_rank_step, opts.warmup)
                results[method].append({**summary, **others_cpu(start, time.monotonic() - began)})
                print(f"rep {rep} {method}: {results[method][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    table = report(results)
    settings = {k: v for k, v in vars(opts).items() if k not in ("out", "worker_args")}
    (opts.out / "results.json").write_text(json.dumps({"settings": settings, "results": results}, indent=1,
                                                      default=str))  # fmt: skip
    (opts.out / "results.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

"""Quality at equal tokens under identical hyperparameters: FSDP against FL+FSDP as the world grows.

The paper attributes part of FL+FSDP's lower perplexity to the global batch: FSDP's grows with the world at an
unchanged learning rate, FL+FSDP's group batch stays bounded by the group. This study holds the per-device
batch, the learning rate, the schedule and the token budget fixed, and runs at world sizes 4, 8 and 16:

- FL+FSDP: its real groups (``--group-size`` ranks each, default 2), W ranks, every H steps a FedAvg;
- FSDP: one model over the world batch W × b, reproduced on ``--fsdp-ranks`` ranks with gradient accumulation
  W / fsdp_ranks (the same batch and the same update; only the number of processes differs);
- FSDP, √-lr: the same, its learning rate scaled for its batch by the square-root rule,
  lr × √(W / group size), so that a gap from the batch shows apart from a gap from the tuning.

Every run reads the same number of tokens (``--tokens``), so bigger worlds take fewer, larger steps. Eval
perplexity on whole held-out plays after the last step; several seeds. No network shaping: all on localhost.

    python -m benchmarks.quality --quick     # worlds 4 and 8, FSDP and FL+FSDP, 2 seeds, micro (≤ 5 min)
    python -m benchmarks.quality             # worlds 4, 8, 16, all three, 2 seeds, tiny

Results (JSON, Markdown, PNG) go to ``--out`` (default benchmarks/results/quality_<quick|full>/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.harness import REPO, TRAIN_SCRIPT, process_tree
from benchmarks.harness.methods import BenchConfig, prepare_data
from benchmarks.harness.report import new_axes, run_record_lines, save_figure
from benchmarks.harness.study import Study, add_folder_options, new_parser, validated

VARIANTS = ("FSDP", "FSDP √-lr", "FL+FSDP")


@dataclass
class QualityConfig:
    """What every run shares; only the parallelism (and, for √-lr, the learning rate) differs."""

    worlds: tuple[int, ...] = (4, 8, 16)
    variants: tuple[str, ...] = VARIANTS
    seeds: tuple[int, ...] = (0, 1)
    model_size: str = "tiny"
    batch_size: int = 4  # per device, blocks of 128 tokens
    block_size: int = 128
    tokens: int = 16 * 4 * 128 * 24  # budget per run: 24 steps of the largest world
    group_size: int = 2  # FL+FSDP ranks per group
    sync_steps: int = 4  # H
    fsdp_ranks: int = 2  # FSDP's world batch, reproduced with accumulation on this many ranks
    learning_rate: float = 2e-3
    eval_samples: int = 64
    timeout_s: float = 600.0

    def steps(self, world: int) -> int:
        """Optimizer steps of a run at ``world``: the token budget over the world batch (exact, or an error)."""
        per_step = world * self.batch_size * self.block_size
        if self.tokens % per_step:
            raise ValueError(f"--tokens={self.tokens} must be a multiple of the world batch {per_step} at W={world}.")
        return self.tokens // per_step

    def validate(self) -> None:
        for world in self.worlds:
            steps = self.steps(world)
            if world % self.group_size or world % self.fsdp_ranks or steps % self.sync_steps:
                raise ValueError(
                    f"W={world}: --group-size {self.group_size} and --fsdp-ranks {self.fsdp_ranks} must divide it, "
                    f"and H={self.sync_steps} its {steps} steps (so that the last step averages)."
                )
        processes = {p for w in self.worlds for p in (w, self.fsdp_ranks)}
        if self.eval_batch_size < 1 or any(self.eval_samples % (p * self.eval_batch_size) for p in processes):
            raise ValueError(
                f"eval_samples={self.eval_samples} must be read whole by every run: a multiple of the largest world "
                f"{max(self.worlds)} and of every run's processes × its per-device eval batch."
            )

    @property
    def eval_batch_size(self) -> int:
        """Per device: the largest world reads the eval set in one batch per rank, so every run reads all of it."""
        return self.eval_samples // max(self.worlds)

    def learning_rate_of(self, variant: str, world: int) -> float:
        """√-lr: the rate scaled by √(FSDP's batch / FL+FSDP's group batch) = √(W / group size)."""
        return self.learning_rate * (math.sqrt(world / self.group_size) if variant == "FSDP √-lr" else 1.0)


def run_args(cfg: QualityConfig, variant: str, world: int, seed: int) -> tuple[int, list[str]]:
    """(processes, bench_train.py arguments) of one run."""
    steps = cfg.steps(world)
    shared = [
        "--model_size", cfg.model_size, "--per_device_train_batch_size", str(cfg.batch_size),
        "--per_device_eval_batch_size", str(cfg.eval_batch_size), "--max_steps", str(steps),
        "--learning_rate", str(cfg.learning_rate_of(variant, world)), "--lr_scheduler_type", "constant",
        "--warmup_steps", "0", "--weight_decay", "0", "--max_grad_norm", "1.0", "--seed", str(seed),
        "--eval_strategy", "steps", "--eval_steps", str(steps), "--logging_steps", str(steps),
        "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
        "--average_tokens_across_devices", "false", "--dataloader_drop_last", "true",
    ]  # fmt: skip
    if variant == "FL+FSDP":
        return world, [*shared, "--fed_group_size", str(cfg.group_size), "--fed_sync_steps", str(cfg.sync_steps)]
    accumulation = world // cfg.fsdp_ranks
    return cfg.fsdp_ranks, [*shared, "--fsdp", "--gradient_accumulation_steps", str(accumulation)]


def run_one(cfg: QualityConfig, variant: str, world: int, seed: int, data: Path, work: Path) -> dict:
    """Train one run to its token budget; return its final eval perplexity and what defines it."""
    run_dir = work / f"{variant.replace(' ', '_').replace('+', '_').replace('√', 'sqrt')}-w{world}-s{seed}"
    nproc, args = run_args(cfg, variant, world, seed)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(TRAIN_SCRIPT), "--data_dir", str(data), "--record_dir",
           str(run_dir / "records"), "--output_dir", str(run_dir / "out"), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    start = time.monotonic()
    done = process_tree.run(cmd, cfg.timeout_s, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{variant} W={world} seed {seed} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    record = json.loads((run_dir / "records" / "rank0.json").read_text())
    final = record["evals"][-1]
    print(f"  {variant:<10} W={world:<3} seed {seed}: ppl {math.exp(final['eval_loss']):.1f} "
          f"({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
    group = cfg.group_size if variant == "FL+FSDP" else world
    return {
        "variant": variant, "world": world, "seed": seed, "processes": nproc, "steps": final["step"],
        "learning_rate": cfg.learning_rate_of(variant, world),
        "batch_samples": group * cfg.batch_size,  # per optimizer update: FL+FSDP's group batch, FSDP's world batch
        "tokens": final["step"] * world * cfg.batch_size * cfg.block_size,
        "eval_perplexity": math.exp(final["eval_loss"]),
    }  # fmt: skip


def summarize(runs: list[dict], cfg: QualityConfig) -> dict:
    """Median, min and max over seeds of each (variant, world): the spread printed beside every figure."""
    rows = []
    for variant in cfg.variants:
        for world in cfg.worlds:
            ppl = [r["eval_perplexity"] for r in runs if r["variant"] == variant and r["world"] == world]
            if not ppl:
                continue
            first = next(r for r in runs if r["variant"] == variant and r["world"] == world)
            rows.append({"variant": variant, "world": world, "median": statistics.median(ppl), "min": min(ppl),
                         "max": max(ppl), "seeds": len(ppl), "batch_samples": first["batch_samples"],
                         "steps": first["steps"], "learning_rate": first["learning_rate"]})  # fmt: skip
    return {"config": asdict(cfg), "runs": runs, "rows": rows}


CAPTION = """Llama `{model_size}`, {tokens:,} training tokens per run, per-device batch {batch_size} × {block_size}
tokens, constant lr {learning_rate:g} (AdamW), FL+FSDP groups of {group_size} ranks averaging every {sync_steps} steps;
FSDP's world batch on {fsdp_ranks} ranks with gradient accumulation; eval perplexity on held-out plays after the last
step: median (min–max) over seeds {seeds}."""


def markdown(results: dict) -> str:
    cfg = results["config"]
    lines = [
        CAPTION.format_map({**cfg, "seeds": ", ".join(map(str, cfg["seeds"]))}),
        "",
        "| method | W | batch per update (samples) | steps | lr | eval ppl median (min–max) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        lines.append(f"| {r['variant']} | {r['world']} | {r['batch_samples']} | {r['steps']} | "
                     f"{r['learning_rate']:.4g} | {r['median']:.1f} ({r['min']:.1f}–{r['max']:.1f}) |")  # fmt: skip
    lines += run_record_lines(results)
    return "\n".join(lines)


def plot(results: dict, out: Path) -> Path:
    fig, ax = new_axes()
    for variant in results["config"]["variants"]:
        rows = [r for r in results["rows"] if r["variant"] == variant]
        worlds = [r["world"] for r in rows]
        median = [r["median"] for r in rows]
        spread = [[r["median"] - r["min"] for r in rows], [r["max"] - r["median"] for r in rows]]
        ax.errorbar(worlds, median, yerr=spread, marker="o", capsize=3, label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("eval perplexity at equal tokens")
    ax.legend(fontsize=8)
    ax.set_title("Median over seeds, bars: min–max", fontsize=9)
    return save_figure(fig, out / "perplexity_vs_world.png")


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="Worlds 4 and 8, FSDP and FL+FSDP, micro, 2 seeds.")
    p.add_argument("--worlds", type=int, nargs="+", help="World sizes (default 4 8 16; 4 8 with --quick).")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, help="Default: all three (quick: FSDP, FL+FSDP).")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--model-size", help="Llama preset (default tiny; micro with --quick).")
    p.add_argument("--tokens", type=int, help="Training tokens per run (a multiple of every world batch).")
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--timeout-s", type=float, default=600.0, help="Bound on each run.")
    add_folder_options(p, "quality")
    return p


def config_from_args(args: argparse.Namespace) -> QualityConfig:
    quick = args.quick
    return validated(
        QualityConfig(
            worlds=tuple(args.worlds or ((4, 8) if quick else (4, 8, 16))),
            variants=tuple(args.variants or (("FSDP", "FL+FSDP") if quick else VARIANTS)),
            seeds=tuple(args.seeds),
            model_size=args.model_size or ("micro" if quick else "tiny"),
            tokens=args.tokens or (8 * 4 * 128 * 8 if quick else 16 * 4 * 128 * 24),
            learning_rate=args.learning_rate,
            timeout_s=args.timeout_s,
        )
    )


def main(argv: list[str] | None = None) -> int:
    study = Study("quality", make_parser(), argv)
    cfg = config_from_args(study.args)
    data = prepare_data(BenchConfig(block_size=cfg.block_size, eval_samples=cfg.eval_samples), study.args.data_cache)
    with study.running() as work:
        runs = [run_one(cfg, v, w, s, data, work) for s in cfg.seeds for w in cfg.worlds for v in cfg.variants]
    return study.finish(summarize(runs, cfg), markdown, plot)


if __name__ == "__main__":
    raise SystemExit(main())

"""Sweep of the nesterov outer learning rate (``fed_outer_lr``) at H = 8, tokens-matched, no network shaping.

FL+FSDP, 2 groups × 2 ranks on this machine (plain `torchrun --standalone`, no namespaces: only the loss matters
here), the benchmark's data, model and hyperparameters (benchmarks/harness/methods.py), one run per outer learning rate
with ``fed_outer_optimizer=nesterov`` (momentum 0.9) plus FedAvg as the reference; every run reads the same tokens.

    python -m benchmarks.outer_lr_sweep                      # lr 0.3 0.5 0.7 1.0 and FedAvg, 48 steps (~5 min)
    python -m benchmarks.outer_lr_sweep --lrs 0.7 --steps 16 --out /tmp/sweep

Writes ``results.json`` (every evaluation of every run), ``results.md`` and ``perplexity_vs_tokens.png`` into
``--out`` (default benchmarks/results/outer_lr_sweep_full/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from benchmarks.harness import REPO, TRAIN_SCRIPT, process_tree, results_folder
from benchmarks.harness.methods import DATA_CACHE, BenchConfig, prepare_data, shared_args
from benchmarks.harness.report import new_axes, save_figure
from benchmarks.harness.study import Study, new_parser

GROUPS, RANKS_PER_GROUP = 2, 2
CONFIG_FIELDS = ("model_size", "steps", "sync_steps", "eval_steps", "batch_size", "block_size", "learning_rate", "seed")


def run_args(lr: float | None, cfg: BenchConfig) -> list[str]:
    """FL+FSDP with nesterov at ``lr``, or FedAvg for ``None``."""
    outer = [] if lr is None else ["--fed_outer_optimizer", "nesterov", "--fed_outer_lr", str(lr)]
    return ["--fed_group_size", str(RANKS_PER_GROUP), "--fed_sync_steps", str(cfg.sync_steps), *outer]


def train(label: str, args: list[str], cfg: BenchConfig, data: Path, work: Path) -> list[dict]:
    """One run on 4 local ranks; rank 0's evaluations (step, eval_loss)."""
    run_dir = work / label
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.world_size}",
           str(TRAIN_SCRIPT), "--data_dir", str(data), "--record_dir", str(run_dir / "rec"),
           "--output_dir", str(run_dir / "out"), *shared_args(cfg), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    start = time.monotonic()
    result = process_tree.run(cmd, cfg.timeout_s, env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{label} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    print(f"  {label}: {time.monotonic() - start:.0f} s", flush=True)
    return json.loads((run_dir / "rec" / "rank0.json").read_text())["evals"]


def markdown(results: dict) -> str:
    cfg = results["config"]
    lines = [
        f"FL+FSDP, {GROUPS} groups × {RANKS_PER_GROUP} ranks, Llama `{cfg['model_size']}`, H = {cfg['sync_steps']}, "
        f"{cfg['steps']} steps of {results['tokens_per_step']:,} tokens, no network shaping. Command: "
        f"`{results['command']}`, started {results['started']}, {results['wall_s']} s.",
        "",
        "| outer optimizer | eval ppl at the end | best eval ppl (step) |",
        "|---|---:|---:|",
    ]
    for label, evals in results["runs"].items():
        best = min(evals, key=lambda e: e["eval_perplexity"])
        lines.append(
            f"| {label} | {evals[-1]['eval_perplexity']:.1f} | {best['eval_perplexity']:.1f} ({best['step']}) |"
        )
    return "\n".join(lines)


def plot(results: dict, out: Path) -> Path:
    fig, ax = new_axes()
    for label, evals in results["runs"].items():
        style = "--" if label == "fedavg" else "-"
        ax.plot([e["tokens"] for e in evals], [e["eval_perplexity"] for e in evals], style, marker="o", markersize=3,
                label=label)  # fmt: skip
    ax.set_xlabel("world tokens")
    ax.set_ylabel("eval perplexity")
    ax.set_yscale("log")
    ax.set_title(f"Outer learning rate, nesterov (momentum 0.9), H = {results['config']['sync_steps']}", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, out / "perplexity_vs_tokens.png")


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--lrs", type=float, nargs="+", default=[0.3, 0.5, 0.7, 1.0], help="Outer learning rates.")
    p.add_argument("--steps", type=int, default=48, help="Optimizer steps per run.")
    p.add_argument("--sync-steps", type=int, default=8, help="H.")
    p.add_argument("--eval-steps", type=int, default=8, help="Evaluate every this many steps.")
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--out", type=Path, default=results_folder("outer_lr_sweep"), help="Results folder.")
    p.add_argument("--data-cache", type=Path, default=DATA_CACHE)
    return p


def main(argv: list[str] | None = None) -> int:
    study = Study("outer_lr_sweep", make_parser(), argv)
    args = study.args
    cfg = BenchConfig(nodes=GROUPS, ranks_per_node=RANKS_PER_GROUP, steps=args.steps, sync_steps=args.sync_steps,
                      eval_steps=args.eval_steps, model_size=args.model_size, warmup_steps=0)  # fmt: skip
    data = prepare_data(cfg, args.data_cache)
    runs: dict[str, list[dict]] = {}
    with study.running() as work:
        for lr in [*args.lrs, None]:
            label = "fedavg" if lr is None else f"nesterov lr {lr:g}"
            evals = train(label.replace(" ", "_"), run_args(lr, cfg), cfg, data, work)
            runs[label] = [{**e, "tokens": e["step"] * cfg.tokens_per_step,
                            "eval_perplexity": math.exp(e["eval_loss"])} for e in evals]  # fmt: skip
    results = {
        "config": {k: getattr(cfg, k) for k in CONFIG_FIELDS},
        "tokens_per_step": cfg.tokens_per_step,
        "runs": runs,
    }
    return study.finish(results, markdown, plot)


if __name__ == "__main__":
    raise SystemExit(main())

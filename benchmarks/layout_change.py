"""Resuming on another layout: the loss bump of a federated checkpoint resumed on other groups, against the same layout.

A source run of FL+FSDP, 4 groups × 2 ranks (H = 8, AdamW, constant lr), writes ``checkpoint-S`` and trains on to T;
the same checkpoint is then resumed to T on each layout (hf_fedshard/checkpointing/reshard.py states what a new
layout starts from):

- ``4x2``: the source's own layout, Trainer's ordinary resume: the reference;
- ``2x2`` (4 ranks), ``3x2`` (6 ranks), ``2x4`` (8 ranks): fewer or more groups, or larger groups;
- ``2x4s2``: FL+HSDP, 2 groups × (2 replicas × 2 shards) (``--fed_group_size 4 --fed_shard_size 2``).

A layout is ``<groups>x<ranks per group>[s<shard size>]``. Every run is bench_train.py (`FedShardTrainer` on the packed
Shakespeare blocks, whole plays held out) under ``torchrun --standalone`` on this machine, no network shaping. The step
count is kept and the per-device batch too, so the world batch per step changes with the number of groups: 2 × 2
reads half the tokens per step of 4 × 2. Per layout: the train loss over the first H steps after the resume (mean),
its difference to the unchanged-layout resume (the *loss bump*), the global model's eval perplexity at S (the model
the resume starts from), S + H and T, and each resume's start-up line ("hf_fedshard: resuming step S of ...").
``--report-only results.json`` rewrites the tables and the plot of a finished run without running anything.

    python -m benchmarks.layout_change --quick   # micro, T = 32, S = 16: 4x2, 2x2, 3x2, 2x4s2 (under 8 min)
    python -m benchmarks.layout_change           # tiny, T = 96, S = 48: all five layouts (under 30 min)
    python -m benchmarks.layout_change --report-only benchmarks/results/layout_change_full/results.json

Results (JSON, Markdown, PNG) go to ``--out`` (default benchmarks/results/layout_change_<quick|full>/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.harness import REPO, TRAIN_SCRIPT, process_tree, torchrun_command
from benchmarks.harness.methods import BenchConfig, prepare_data
from benchmarks.harness.report import run_record_lines, save_figure
from benchmarks.harness.study import Study, add_folder_options, new_parser, rewrite, validated

SOURCE = "4x2"
FULL_LAYOUTS = ("4x2", "2x2", "3x2", "2x4", "2x4s2")
QUICK_LAYOUTS = ("4x2", "2x2", "3x2", "2x4s2")
START_LINE = re.compile(r"hf_fedshard: resuming step \d+ of .*")


@dataclass(frozen=True)
class Layout:
    """A federation layout: ``groups`` × ``group_size`` ranks, each model copy sharded over ``shard_size`` of them
    (``None``: the whole group, FL+FSDP; smaller: FL+HSDP with group_size ÷ shard_size replicas)."""

    groups: int
    group_size: int
    shard_size: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Layout:
        """``4x2``, ``2x4s2``: groups x ranks per group [s shard size]; raises naming the form."""
        match = re.fullmatch(r"(\d+)x(\d+)(?:s(\d+))?", spec)
        if match is None:
            raise ValueError(f"layout {spec!r}: write <groups>x<ranks per group>[s<shard size>], e.g. 2x2 or 2x4s2.")
        groups, group_size, shard = (int(g) if g else None for g in match.groups())
        layout = cls(groups, group_size, None if shard == group_size else shard)
        if groups < 2 or group_size < 1 or (shard is not None and (shard < 1 or group_size % shard)):
            raise ValueError(
                f"layout {spec!r}: at least 2 groups (a federation), and a shard size that divides the group size "
                f"{group_size}."
            )
        return layout

    @property
    def key(self) -> str:
        return f"{self.groups}x{self.group_size}" + (f"s{self.shard_size}" if self.shard_size else "")

    @property
    def world(self) -> int:
        return self.groups * self.group_size

    @property
    def label(self) -> str:
        if self.shard_size is None:
            return f"{self.groups} × {self.group_size}"
        replicas = self.group_size // self.shard_size
        return f"FL+HSDP {self.groups} × ({replicas} × {self.shard_size})"

    def describe(self) -> str:
        if self.shard_size is None:
            return f"FL+FSDP, {self.groups} groups × {self.group_size} ranks"
        return f"FL+HSDP, {self.groups} groups × {self.group_size} ranks, shards of {self.shard_size}"

    def args(self) -> list[str]:
        shard = ["--fed_shard_size", str(self.shard_size)] if self.shard_size else []
        return ["--fed_group_size", str(self.group_size), *shard]


@dataclass
class LayoutChangeConfig:
    """What every run shares; a resume differs from the source only in its layout (and where it starts)."""

    source: str = SOURCE
    layouts: tuple[str, ...] = FULL_LAYOUTS  # resumed on; the source's own layout is the reference
    model_size: str = "tiny"
    batch_size: int = 4  # per device, blocks of 128 tokens
    block_size: int = 128
    steps: int = 96  # T
    save_step: int = 48  # S, where the checkpoint is written and every resume starts
    sync_steps: int = 8  # H
    learning_rate: float = 2e-3
    eval_samples: int = 96  # read whole by every world here (4, 6 and 8 ranks)
    max_train_lines: int | None = None  # a prefix of the training text (tests); None: all of it
    seed: int = 0
    timeout_s: float = 600.0

    def validate(self) -> None:
        source = Layout.parse(self.source)
        layouts = [Layout.parse(spec) for spec in self.layouts]
        if source.key not in {layout.key for layout in layouts}:
            raise ValueError(f"--layouts {' '.join(self.layouts)} must hold the source's own layout {source.key}: the "
                             "unchanged-layout resume every other one is measured against.")  # fmt: skip
        h, s, t = self.sync_steps, self.save_step, self.steps
        if not 0 < s < t or s % h or t % h:
            raise ValueError(f"--save-step={s} and --steps={t} must be multiples of H={h}, with 0 < S < T (so that "
                             "the checkpoint follows an averaging and every evaluation one too).")  # fmt: skip
        worlds = sorted({layout.world for layout in [source, *layouts]})
        if any(self.eval_samples % world for world in worlds):
            raise ValueError(f"--eval-samples={self.eval_samples} must be a multiple of every world size {worlds}: "
                             "each rank evaluates one whole batch: every run reads the same samples.")  # fmt: skip

    def world_batch(self, layout: Layout) -> int:
        """Samples per optimizer step of the whole world (per device × ranks; no accumulation)."""
        return layout.world * self.batch_size


def run_args(cfg: LayoutChangeConfig, layout: Layout, resume_from: Path | None) -> list[str]:
    """bench_train.py arguments of the source run (``resume_from`` None: it saves at S) or of a resume from it."""
    shared = [
        "--model_size", cfg.model_size, "--per_device_train_batch_size", str(cfg.batch_size),
        "--per_device_eval_batch_size", str(cfg.eval_samples // layout.world), "--max_steps", str(cfg.steps),
        "--learning_rate", str(cfg.learning_rate), "--lr_scheduler_type", "constant", "--warmup_steps", "0",
        "--weight_decay", "0", "--max_grad_norm", "1.0", "--seed", str(cfg.seed), "--eval_strategy", "steps",
        "--eval_steps", str(cfg.sync_steps), "--eval_on_start", "true", "--logging_steps", "1", "--report_to", "none",
        "--disable_tqdm", "true", "--average_tokens_across_devices", "false", "--dataloader_drop_last", "true",
        "--fed_sync_steps", str(cfg.sync_steps), *layout.args(),
    ]  # fmt: skip
    if resume_from is None:
        return [*shared, "--save_strategy", "steps", "--save_steps", str(cfg.save_step)]
    return [*shared, "--save_strategy", "no", "--resume_from_checkpoint", str(resume_from)]


def train(cfg: LayoutChangeConfig, name: str, layout: Layout, args: list[str], data: Path, run_dir: Path) -> dict:
    """One run of bench_train.py on ``layout.world`` local ranks: rank 0's curves, the start-up line, the wall time."""
    cmd = [*torchrun_command(), "--standalone", f"--nproc_per_node={layout.world}",
           str(TRAIN_SCRIPT), "--data_dir", str(data), "--record_dir", str(run_dir / "records"),
           "--output_dir", str(run_dir / "out"), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    done = process_tree.run(cmd, cfg.timeout_s, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall_s = time.monotonic() - start
    (run_dir / "log.txt").write_text(done.stdout)
    if done.returncode:
        raise RuntimeError(f"{name} on {layout.key} failed (exit {done.returncode}); log in {run_dir / 'log.txt'}:\n"
                           f"{done.stdout[-5000:]}")  # fmt: skip
    record = json.loads((run_dir / "records" / "rank0.json").read_text())
    line = START_LINE.search(done.stdout)
    print(f"  {name} on {layout.label}: eval ppl at step {record['evals'][-1]['step']} "
          f"{math.exp(record['evals'][-1]['eval_loss']):.1f} ({wall_s:.0f} s)", flush=True)  # fmt: skip
    if line:
        print(f"    {line.group(0)}", flush=True)
    return {
        "layout": layout.key, "label": layout.label, "world": layout.world, "groups": layout.groups,
        "group_size": layout.group_size, "shard_size": layout.shard_size or layout.group_size,
        "world_batch_samples": cfg.world_batch(layout), "wall_s": round(wall_s, 1),
        "start_line": line.group(0) if line else None,
        "train_loss": [[e["step"], e["loss"]] for e in record["log_history"] if "loss" in e],
        "evals": [[e["step"], e["eval_loss"]] for e in record["evals"]],
    }  # fmt: skip


# ---- the figures: pure functions of the runs (tests/unit/test_benchmarks.py feeds them synthetic records) ----


def eval_at(run: dict, step: int) -> float | None:
    """Eval perplexity of the global model at ``step``; ``None`` if the run did not evaluate there."""
    return next((math.exp(loss) for s, loss in run["evals"] if s == step), None)


def check_resumed(run: dict, step: int) -> None:
    """A resume's first evaluation (``--eval_on_start``) is at ``step``; one at step 0 means it trained from scratch."""
    first = run["evals"][0][0] if run["evals"] else None
    if first != step:
        raise ValueError(f"the resume on {run['layout']} evaluated first at step {first}, not at {step}: it did not "
                         "start from the checkpoint (does the script pass --resume_from_checkpoint on?).")  # fmt: skip


def window_loss(run: dict, first: int, last: int) -> float:
    """Mean train loss over steps ``first``..``last`` (logged every step)."""
    losses = [loss for step, loss in run["train_loss"] if first <= step <= last]
    if len(losses) != last - first + 1:
        raise ValueError(f"{run['layout']}: {len(losses)} train losses logged in steps {first}–{last}; expected one "
                         "per step (--logging_steps 1).")  # fmt: skip
    return statistics.fmean(losses)


def tokens_read(cfg: dict, source: dict, run: dict | None, step: int) -> int:
    """World tokens read by the end of ``step``: the source's world batch up to S, then the run's (``None``: the
    source's own continuation)."""
    s, block = cfg["save_step"], cfg["block_size"]
    after = (run or source)["world_batch_samples"]
    return (min(step, s) * source["world_batch_samples"] + max(0, step - s) * after) * block


def summarize(source: dict, resumes: list[dict], cfg: dict) -> dict:
    """Per resume: the first window's train loss and its bump over the unchanged-layout resume, the eval perplexity
    at S, S + H and T (and its ratio to the unchanged resume's), the tokens read; the source's own continuation
    beside them (what the unchanged resume would be if resuming were exact)."""
    s, h, t = cfg["save_step"], cfg["sync_steps"], cfg["steps"]
    for run in resumes:
        check_resumed(run, s)
    reference = next(r for r in resumes if r["layout"] == Layout.parse(cfg["source"]).key)
    ref_loss, ref_final = window_loss(reference, s + 1, s + h), eval_at(reference, t)
    rows = []
    for run, role in [(r, "resume") for r in resumes] + [(source, "source, not interrupted")]:
        loss, final = window_loss(run, s + 1, s + h), eval_at(run, t)
        rows.append({
            "layout": run["layout"], "label": run["label"], "role": role, "world": run["world"],
            "world_batch_samples": run["world_batch_samples"],
            "group_batch_samples": run["world_batch_samples"] // run["groups"],
            "tokens_per_step": run["world_batch_samples"] * cfg["block_size"],
            "first_window_train_loss": loss, "loss_bump": loss - ref_loss,
            "eval_ppl_at_resume": eval_at(run, s), "eval_ppl_after_window": eval_at(run, s + h),
            "eval_ppl_final": final, "final_ppl_vs_unchanged": final / ref_final if final and ref_final else None,
            "tokens_read_final": tokens_read(cfg, source, None if run is source else run, t),
            "wall_s": run["wall_s"], "start_line": run.get("start_line") if role == "resume" else None,
        })  # fmt: skip
    return {"reference": reference["layout"], "source_eval_ppl_at_save": eval_at(source, s), "rows": rows}


def markdown(results: dict) -> str:
    cfg, summary = results["config"], results["summary"]
    s, h, t = cfg["save_step"], cfg["sync_steps"], cfg["steps"]
    ref = next(r for r in summary["rows"] if r["role"] == "resume" and r["layout"] == summary["reference"])
    layout = Layout.parse(cfg["source"])
    head = ["resumed on", "ranks", "world batch (samples/step)", "group batch", f"train loss, steps {s + 1}–{s + h} "
            "(mean)", "loss bump", f"eval ppl at {s} (resumed model)", f"at {s + h}", f"at {t}", f"at {t} ÷ unchanged",
            f"tokens read by {t} (M)", "run time (s)"]  # fmt: skip
    lines = [
        f"Source: {layout.describe()}, Llama `{cfg['model_size']}`, per-device "
        f"batch {cfg['batch_size']} × {cfg['block_size']} tokens, constant lr {cfg['learning_rate']:g} (AdamW), "
        f"H = {h}, T = {t} steps; its checkpoint-{s} (right after an averaging) resumed to step {t} on each layout; "
        f"eval perplexity of the global model on {cfg['eval_samples']} held-out blocks every {h} steps; seed "
        f"{cfg['seed']}. The step count (and the LR schedule with it) is kept and the per-device batch too, so the "
        "world batch per step changes with the number of ranks: a layout of half the ranks (2 × 2 against 4 × 2) "
        "reads half the tokens per step, and by step T has read fewer tokens in all; the group batch (what one inner "
        "step of a group averages over) changes with the group size only. Loss bump: the "
        f"mean train loss of steps {s + 1}–{s + h} less the unchanged-layout resume's ({ref['label']}); the source's "
        "own continuation (not interrupted) is the last row, against the same reference. The source's eval "
        f"perplexity at step {s}: {_f(summary['source_eval_ppl_at_save'])}.",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    for r in summary["rows"]:
        name = r["label"] + (" (unchanged)" if r is ref else "")
        if r["role"] != "resume":
            name = f"source ({r['label']}), not interrupted"
        cells = [name, r["world"], r["world_batch_samples"], r["group_batch_samples"],
                 f"{r['first_window_train_loss']:.3f}", f"{r['loss_bump']:+.3f}", _f(r["eval_ppl_at_resume"]),
                 _f(r["eval_ppl_after_window"]), _f(r["eval_ppl_final"]), _f(r["final_ppl_vs_unchanged"], ".3f"),
                 f"{r['tokens_read_final'] / 1e6:.2f}", f"{r['wall_s']:.0f}"]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "Start-up lines of the resumes (the unchanged layout is Trainer's ordinary resume: it logs none):"]
    lines.append("")
    for r in summary["rows"]:
        if r["role"] == "resume" and r["layout"] != summary["reference"]:
            lines.append(f"- {r['label']}: `{r['start_line'] or 'no start-up line found in its output'}`")
    lines += run_record_lines(results)
    return "\n".join(lines)


def _f(value: float | None, fmt: str = ".1f") -> str:
    return "—" if value is None else f"{value:{fmt}}"


def trailing_mean(points: list[list[float]], window: int) -> list[tuple[float, float]]:
    """(step, mean of the last ``window`` values up to it), from the first full window on."""
    return [(points[i][0], statistics.fmean(v for _, v in points[i - window + 1 : i + 1]))
            for i in range(window - 1, len(points))]  # fmt: skip


def plot(results: dict, out: Path) -> Path:
    """Train loss (trailing mean over H steps) and eval perplexity against the step, eval perplexity against the
    tokens read: the source up to S, its own continuation dotted, every resume from S."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, runs = results["config"], results["runs"]
    s, h = cfg["save_step"], cfg["sync_steps"]
    source = runs["source"]
    before = [p for p in source["train_loss"] if p[0] <= s]
    fig, (loss_ax, step_ax, token_ax) = plt.subplots(1, 3, figsize=(13, 3.6), dpi=100)

    def draw(run: dict | None, points: list, evals: list, **style) -> None:
        loss_ax.plot(*zip(*trailing_mean(points, h), strict=True), **style)
        steps = [e[0] for e in evals]
        ppl = [math.exp(e[1]) for e in evals]
        step_ax.plot(steps, ppl, marker="o", markersize=3, **style)
        token_ax.plot([tokens_read(cfg, source, run, x) / 1e6 for x in steps], ppl, marker="o", markersize=3, **style)

    label = Layout.parse(cfg["source"]).label
    draw(None, before, [e for e in source["evals"] if e[0] <= s], color="black", linewidth=2, label=f"source ({label})")
    draw(None, source["train_loss"], [e for e in source["evals"] if e[0] >= s], color="grey", linestyle=":",
         label="source, not interrupted")  # fmt: skip
    for run in runs["resumes"]:
        unchanged = run["layout"] == cfg["source"]
        points = before[len(before) - h + 1 :] + [p for p in run["train_loss"] if p[0] > s]  # reaching back before S
        draw(run, points, run["evals"], linestyle="--" if unchanged else "-",
             label=run["label"] + (" (unchanged)" if unchanged else ""))  # fmt: skip
    for ax in (loss_ax, step_ax):
        ax.axvline(s, color="grey", linewidth=0.8)
        ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel(f"train loss (mean of the last {h} steps)")
    step_ax.set_ylabel("eval perplexity (global model)")
    token_ax.set_xlabel("world tokens read (M)")
    token_ax.set_ylabel("eval perplexity (global model)")
    for ax in (step_ax, token_ax):
        ax.set_yscale("log")
    step_ax.legend(fontsize=7)
    fig.suptitle(f"checkpoint-{s} of {label} resumed on each layout to step {cfg['steps']}", fontsize=9)
    return save_figure(fig, out / "layout_change.png")


# ---- command line ----


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="micro, T = 32, S = 16, layouts 4x2 2x2 3x2 2x4s2.")
    p.add_argument("--source", default=SOURCE, help="The source run's layout (default 4x2).")
    p.add_argument("--layouts", nargs="+", help="Resumed on, <groups>x<ranks>[s<shard>]; must hold the source's "
                   f"(default {' '.join(FULL_LAYOUTS)}; quick: {' '.join(QUICK_LAYOUTS)}).")  # fmt: skip
    p.add_argument("--model-size", help="Llama preset (default tiny; micro with --quick).")
    p.add_argument("--steps", type=int, help="T, the source's and every resume's max_steps (default 96; quick 32).")
    p.add_argument("--save-step", type=int, help="S, the checkpoint resumed (default T / 2).")
    p.add_argument("--sync-steps", type=int, default=8, help="H (default 8).")
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--eval-samples", type=int, default=96, help="Held-out blocks (a multiple of every world size).")
    p.add_argument("--max-train-lines", type=int, help="Train on a prefix of the text (tests).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="Bound on each run.")
    add_folder_options(p, "layout_change", work="the runs (checkpoints, logs)", report_only="tables and plot")
    return p


def config_from_args(args: argparse.Namespace) -> LayoutChangeConfig:
    steps = args.steps or (32 if args.quick else 96)
    return validated(
        LayoutChangeConfig(
            source=args.source,
            layouts=tuple(args.layouts or (QUICK_LAYOUTS if args.quick else FULL_LAYOUTS)),
            model_size=args.model_size or ("micro" if args.quick else "tiny"),
            steps=steps,
            save_step=args.save_step or steps // 2,
            sync_steps=args.sync_steps,
            learning_rate=args.learning_rate,
            eval_samples=args.eval_samples,
            max_train_lines=args.max_train_lines,
            seed=args.seed,
            timeout_s=args.timeout_s,
        )
    )


def run_study(cfg: LayoutChangeConfig, data: Path, work: Path) -> dict:
    """The source run, then a resume of its checkpoint-S on every layout (read in place, never copied)."""
    source_layout = Layout.parse(cfg.source)
    print(f"source: {source_layout.label} to step {cfg.steps}, checkpoint-{cfg.save_step}", flush=True)
    source = train(cfg, "source", source_layout, run_args(cfg, source_layout, None), data, work / "source")
    checkpoint = work / "source" / "out" / f"checkpoint-{cfg.save_step}"
    resumes = []
    for spec in cfg.layouts:
        layout = Layout.parse(spec)
        run_dir = work / f"resume-{layout.key}"
        resumes.append(train(cfg, "resume", layout, run_args(cfg, layout, checkpoint), data, run_dir))
        check_resumed(resumes[-1], cfg.save_step)
    return {"source": source, "resumes": resumes}


def summary_again(results: dict) -> dict:
    """The summary of a finished run's results (``--report-only``)."""
    return summarize(results["runs"]["source"], results["runs"]["resumes"], results["config"])


def main(argv: list[str] | None = None) -> int:
    study = Study("layout_change", make_parser(), argv)
    if study.args.report_only:
        return rewrite(study.args.report_only, summary_again, markdown, plot)
    cfg = config_from_args(study.args)
    bench = BenchConfig(block_size=cfg.block_size, eval_samples=cfg.eval_samples, max_train_lines=cfg.max_train_lines)
    data = prepare_data(bench, study.args.data_cache)
    with study.running() as work:
        runs = run_study(cfg, data, work)
    results = {"config": asdict(cfg), "runs": runs}
    results["summary"] = summarize(runs["source"], runs["resumes"], results["config"])
    return study.finish(results, markdown, plot)


if __name__ == "__main__":
    raise SystemExit(main())

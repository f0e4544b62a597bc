"""Streamed averaging's quality over a longer run: does its gap to blocking FedAvg close, and if not, why.

The overlap study (benchmarks/overlap.py) found the streamed variants 3.7% (fp32) and 3.8% (int8) worse than blocking
FedAvg at equal tokens after 32 steps, each fragment averaged 4 times. This study trains FL+FSDP (``--groups`` ×
``--ranks-per-group`` ranks, default 2 × 2) for T = 200 steps, H = 8, with several seeds, evaluating the global model
on the held-out plays every 8 steps, so the gap shows over steps. The variants take the streamed one apart
(benchmarks/harness/report.py's VARIANTS where they exist):

- FL+FSDP: blocking fp32 FedAvg every H steps (the paper's), the reference;
- FL+FSDP overlap: the whole model's exchange behind τ = 1 step (the delayed application alone);
- FL+FSDP fragments: F = 4 fragments, one every H/4 steps, blocking (the fragments alone);
- FL+FSDP stream: F = 4, τ = 1; FL+FSDP stream int8: the same with the int8 codec (the overlap study's two);
- FL+FSDP int8: blocking with the int8 codec (the codec alone);
- on request (``--variants``), two settings a user might pick instead: FL+FSDP overlap int8 (τ = 1, int8) and
  FL+FSDP stream F2 (F = 2 fragments, τ = 1).

Per variant: eval perplexity at fixed steps, median (min–max) over seeds, and its ratio to blocking fp32 FedAvg of
the same seed (paired: the same initial weights and data order), median (min–max) over seeds. The evaluated model
is the groups' plain average at that step (hf_fedshard's temporary global model), which for fp32 FedAvg is what a
last averaging there would give: so the figure at step 32 is what a 32-step run would end on. Every step's train loss
is logged too (``--logging_steps 1``); its difference to the reference's at the same step and seed (the same batches)
is averaged by phase of the H-step cycle, which shows where in the cycle a variant loses.

Quality only, no timing: every launch runs under ``nice -n 19`` on this machine's loopback (no emulated cluster) and
the study does not take the benchmark lock (harness/exclusive.py) that the timed studies hold. That is sound because
what it reports, eval loss at equal tokens, does not depend on the speed of a step: each averaging (and the apply of
an overlapped exchange) happens at a step fixed by the schedule, never by the clock, and an exchange that has not
finished by then is waited for. Other jobs on the cores change the study's wall time (recorded, with the CPU other
processes used meanwhile), not its figures; and the jobs waiting on the lock need not wait for this one. (Checked: the
quick mode's blocking and stream runs, repeated under other loads, and with logging every step instead of every H,
gave the same eval losses to the last bit.)

    python -m benchmarks.stream_quality --quick   # micro, 32 steps, 3 variants, seeds 0 1 (458 s on shared cores)
    python -m benchmarks.stream_quality           # tiny, 200 steps, all 6 variants, seeds 0 1 (3,096 s, shared)
    python -m benchmarks.stream_quality --report-only benchmarks/results/stream_quality_full/results.json

Results (JSON, Markdown, three PNGs) go to ``--out`` (default benchmarks/results/stream_quality_<quick|full>/).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.harness.methods import (
    BenchConfig,
    busy_cpu_s,
    machine_load,
    method_args,
    others_cpu,
    prepare_data,
    shared_args,
    train_on_localhost,
)
from benchmarks.harness.report import (
    bytes_per_averaging,
    median_range,
    new_axes,
    run_record_lines,
    save_figure,
    spread,
    variant_settings,
)
from benchmarks.harness.study import Study, add_folder_options, new_parser, rewrite, validated

REFERENCE = "FL+FSDP"  # blocking fp32 FedAvg, the paper's
FRAGMENTS = int(variant_settings("FL+FSDP stream")["fed_sync_fragments"])  # the overlap study's F
FRAGMENTS_ONLY = "FL+FSDP fragments"
NESTEROV = ["--fed_outer_optimizer", "nesterov"]
TOPK_1, TOPK_3 = (["--fed_sync_dtype", "topk", "--fed_sync_density", d, "--fed_sync_bits", "2"]
                  for d in ("0.01", "0.03"))  # fmt: skip
OWN_VARIANTS = {  # on top of FL+FSDP; not in report.VARIANTS (tiers.py runs every one of those)
    FRAGMENTS_ONLY: ["--fed_sync_fragments", str(FRAGMENTS)],
    "FL+FSDP overlap int8": ["--fed_sync_overlap", "1", "--fed_sync_dtype", "int8"],
    "FL+FSDP stream F2": ["--fed_sync_fragments", "2", "--fed_sync_overlap", "1"],
    # The payloads (the sparse one's study: --variants PAYLOAD_VARIANTS): error feedback β = 1 unless said.
    "FL+FSDP int8 nesterov": ["--fed_sync_dtype", "int8", *NESTEROV],
    "FL+FSDP topk 1%": TOPK_1,
    "FL+FSDP topk 1% nesterov": [*TOPK_1, *NESTEROV],
    "FL+FSDP topk 3%": TOPK_3,
    "FL+FSDP topk 3% nesterov": [*TOPK_3, *NESTEROV],
    "FL+FSDP topk 1% no feedback": [*TOPK_1, "--fed_sync_feedback_decay", "0"],
    "FL+FSDP topk 1% no feedback nesterov": [*TOPK_1, "--fed_sync_feedback_decay", "0", *NESTEROV],
    "FL+FSDP SparseLoCo": [*TOPK_1, "--fed_sync_feedback_decay", "0.95"],  # decayed feedback, no outer momentum
}
PAYLOAD_VARIANTS = (
    "FL+FSDP",
    "FL+FSDP nesterov",
    "FL+FSDP int8",
    "FL+FSDP int8 nesterov",
    "FL+FSDP topk 1%",
    "FL+FSDP topk 1% nesterov",
    "FL+FSDP topk 3%",
    "FL+FSDP topk 3% nesterov",
    "FL+FSDP topk 1% no feedback",
    "FL+FSDP topk 1% no feedback nesterov",
    "FL+FSDP SparseLoCo",
)
VARIANTS = (REFERENCE, "FL+FSDP overlap", FRAGMENTS_ONLY, "FL+FSDP stream", "FL+FSDP stream int8", "FL+FSDP int8")
EXTRA_VARIANTS = ("FL+FSDP overlap int8", "FL+FSDP stream F2")  # on request (--variants): candidates to pick
CHOICES = tuple(dict.fromkeys(VARIANTS + EXTRA_VARIANTS + PAYLOAD_VARIANTS))
QUICK_VARIANTS = (REFERENCE, FRAGMENTS_ONLY, "FL+FSDP stream")
NICENESS = 19  # every launch yields the cores to other jobs: nothing here is timed


@dataclass
class StreamQualityConfig:
    """What every run shares; only the averaging's settings and the seed differ."""

    variants: tuple[str, ...] = VARIANTS
    seeds: tuple[int, ...] = (0, 1)
    groups: int = 2
    ranks_per_group: int = 2
    model_size: str = "tiny"
    steps: int = 200  # T
    sync_steps: int = 8  # H
    eval_steps: int = 8
    eval_samples: int = 64
    timeout_s: float = 900.0

    def bench(self, seed: int) -> BenchConfig:
        """The harness's run settings (data, batch, lr, evaluation) for ``seed``: one group of ranks per "node"."""
        return BenchConfig(nodes=self.groups, ranks_per_node=self.ranks_per_group, methods=(REFERENCE,),
                           model_size=self.model_size, steps=self.steps, sync_steps=self.sync_steps, warmup_steps=0,
                           eval_steps=self.eval_steps, eval_samples=self.eval_samples, seed=seed,
                           timeout_s=self.timeout_s)  # fmt: skip

    def report_steps(self) -> list[int]:
        """The steps of the table: the overlap study's run length (4 H), about half way, and T."""
        e = self.eval_steps
        return sorted({min(4 * self.sync_steps, self.steps), self.steps // 2 // e * e, self.steps} - {0})

    def validate(self) -> None:
        unknown = set(self.variants) - set(CHOICES)
        if unknown:
            raise ValueError(f"--variants {sorted(unknown)} unknown; choose from {', '.join(CHOICES)}.")
        if REFERENCE not in self.variants or len(self.variants) < 2:
            raise ValueError(f"--variants must hold {REFERENCE} (every ratio is to it) and at least one other.")
        if self.sync_steps % FRAGMENTS or self.sync_steps // FRAGMENTS < 2:
            raise ValueError(f"--sync-steps={self.sync_steps}: the streamed variants need F={FRAGMENTS} to divide H "
                             f"and H/F ≥ 2 (τ = 1 < H/F); use a multiple of {2 * FRAGMENTS}.")  # fmt: skip
        if self.groups < 2 or len(set(self.seeds)) != len(self.seeds) or not self.seeds:
            raise ValueError(f"--groups={self.groups} must be at least 2 (a federation) and --seeds distinct.")
        self.bench(self.seeds[0]).validate()  # steps, eval steps and H fit together


def variant_args(name: str, cfg: BenchConfig) -> list[str]:
    """bench_train.py's averaging settings of ``name``: the harness's FL+FSDP (and its variant), or this study's."""
    if name in OWN_VARIANTS:
        return [*method_args(REFERENCE, cfg), *OWN_VARIANTS[name]]
    return method_args(name, cfg)


def train(cfg: StreamQualityConfig, name: str, seed: int, data: Path, work: Path) -> dict:
    """One run; its evaluations of the global model as [step, eval loss], its train loss of every step (the world's
    mean, as Trainer logs it), its wall time."""
    bench = cfg.bench(seed)
    run_dir = work / f"{name.replace('+', '_').replace(' ', '_')}-s{seed}"
    args = [*shared_args(bench), "--logging_steps", "1", *variant_args(name, bench)]  # the train loss of every step
    kept = run_dir / "run.json"  # a finished run under --work, kept so that a long study can go on where it stopped
    if kept.exists() and (run := json.loads(kept.read_text()))["args"] == args:
        print(f"  {name:<20} seed {seed}: kept from {kept}", flush=True)
        return run["run"]
    start = time.monotonic()
    record = train_on_localhost(bench.world_size, args, data, run_dir, cfg.timeout_s, niceness=NICENESS)
    wall_s = time.monotonic() - start
    evals = [[e["step"], e["eval_loss"]] for e in record["evals"]]
    print(f"  {name:<20} seed {seed}: eval ppl at step {evals[-1][0]} {math.exp(evals[-1][1]):.1f} ({wall_s:.0f} s)",
          flush=True)  # fmt: skip
    train_loss = [[e["step"], e["loss"]] for e in record["log_history"] if "loss" in e]
    run = {"variant": name, "seed": seed, "evals": evals, "train_loss": train_loss, "wall_s": round(wall_s, 1),
           "bytes_per_averaging": bytes_per_averaging(record["log_history"])}  # fmt: skip
    kept.write_text(json.dumps({"args": args, "run": run}))
    return run


# ---- the figures: pure functions of the runs (tests/unit/test_benchmarks.py feeds them synthetic runs) ----


def perplexity_at(run: dict, step: int) -> float | None:
    """Eval perplexity of the run's global model at ``step``; ``None`` if it did not evaluate there."""
    return next((math.exp(loss) for s, loss in run["evals"] if s == step), None)


def step_reaching(evals: list[list[float]], loss: float) -> float | None:
    """The first step at which the eval loss curve ``evals`` ([step, loss], linear between evaluations) is at or
    below ``loss``; ``None`` if it never is."""
    for (s0, l0), (s1, l1) in itertools.pairwise(evals):
        if l1 <= loss:
            return s0 + (s1 - s0) * (l0 - loss) / (l0 - l1) if l0 > loss else s0
    return None


def last_quarter_ratio(runs: list[dict], name: str, steps: int) -> dict | None:
    """The ratio to the reference of the same seed, averaged over the evaluations of the run's last quarter
    (steps > 3T/4): less noisy than the last evaluation alone. A `spread` over seeds; ``None`` without pairs."""
    by_key = {(r["variant"], r["seed"]): r for r in runs}
    means = []
    for run in (r for r in runs if r["variant"] == name and (REFERENCE, r["seed"]) in by_key):
        ref = dict(map(tuple, by_key[(REFERENCE, run["seed"])]["evals"]))
        ratios = [math.exp(loss - ref[s]) for s, loss in run["evals"] if 4 * s > 3 * steps and s in ref]
        if ratios:
            means.append(statistics.fmean(ratios))
    return spread(means) if means else None


def reference_steps(runs: list[dict], name: str) -> dict:
    """The steps blocking fp32 FedAvg of the same seed took to reach the eval loss ``name`` ends on (what its last
    step is worth in the reference's steps): a `spread` over the seeds that reached it, and how many did not."""
    by_key = {(r["variant"], r["seed"]): r for r in runs}
    steps = [step_reaching(by_key[(REFERENCE, r["seed"])]["evals"], r["evals"][-1][1])
             for r in runs if r["variant"] == name and (REFERENCE, r["seed"]) in by_key]  # fmt: skip
    reached = [s for s in steps if s is not None]
    return {"steps": spread(reached) if reached else None, "not_reached": len(steps) - len(reached)}


def curves(runs: list[dict], variants: tuple[str, ...]) -> dict[str, list[dict]]:
    """Per variant and evaluated step: perplexity and its ratio to the reference of the same seed, each a `spread`
    over the seeds that evaluated there (ratios only where the reference did too)."""
    by_key = {(r["variant"], r["seed"]): r for r in runs}
    out = {}
    for name in variants:
        own = [r for r in runs if r["variant"] == name]
        steps = sorted({s for r in own for s, _ in r["evals"]})
        points = []
        for step in steps:
            ppl = {r["seed"]: perplexity_at(r, step) for r in own}
            ppl = {seed: p for seed, p in ppl.items() if p is not None}
            ref = {seed: perplexity_at(by_key[(REFERENCE, seed)], step) for seed in ppl if (REFERENCE, seed) in by_key}
            ratios = [ppl[seed] / ref[seed] for seed in ppl if ref.get(seed)]
            points.append({"step": step, "perplexity": spread(list(ppl.values())),
                           "ratio": spread(ratios) if ratios else None})  # fmt: skip
        out[name] = points
    return out


def train_loss_gap(runs: list[dict], variants: tuple[str, ...], sync_steps: int) -> dict[str, dict]:
    """Where in the averaging cycle a variant loses: its train loss less the reference's of the same seed at the same
    step (the same batches, so the batch-to-batch noise cancels), by phase p = 1 … H of the cycle (step ≡ p mod H;
    p = 1 is the first step after a blocking averaging, p = H the step that ends with one), over the steps after the
    first cycle; per variant, each phase's mean and the mean over all phases, as a `spread` over seeds."""
    by_key = {(r["variant"], r["seed"]): r for r in runs}
    out = {}
    for name in variants:
        per_seed = []
        for run in (r for r in runs if r["variant"] == name and (REFERENCE, r["seed"]) in by_key):
            ref = dict(map(tuple, by_key[(REFERENCE, run["seed"])].get("train_loss", [])))
            diffs = [(step, loss - ref[step]) for step, loss in run.get("train_loss", []) if step in ref]
            phases = {p: [d for step, d in diffs if step > sync_steps and (step - p) % sync_steps == 0]
                      for p in range(1, sync_steps + 1)}  # fmt: skip
            if all(phases.values()):
                per_seed.append({"mean": statistics.fmean(d for v in phases.values() for d in v),
                                 "by_phase": [statistics.fmean(phases[p]) for p in phases]})  # fmt: skip
        if per_seed:
            by_phase = [spread([s["by_phase"][i] for s in per_seed]) for i in range(sync_steps)]
            out[name] = {"mean": spread([s["mean"] for s in per_seed]), "by_phase": by_phase}
    return out


def config_of(cfg: dict) -> StreamQualityConfig:
    """The study's config from its ``results.json`` form (tuples come back as lists)."""
    return StreamQualityConfig(**{**cfg, "variants": tuple(cfg["variants"]), "seeds": tuple(cfg["seeds"])})


def summarize(runs: list[dict], cfg: dict) -> dict:
    """The curves, the table's rows (each variant at each report step) and the train-loss gap by phase."""
    study = config_of(cfg)
    lines, bench = curves(runs, study.variants), study.bench(0)
    rows = []
    for name in study.variants:
        at = {p["step"]: p for p in lines[name]}
        settings = variant_args(name, bench)[len(method_args(REFERENCE, bench)) :]  # past FL+FSDP's own
        others = [p for p in lines[name] if p["ratio"] and p["step"] > 0] if name != REFERENCE else []
        peak = max(others, key=lambda p: p["ratio"]["median"], default=None)  # where the gap was widest
        sent = [r["bytes_per_averaging"] for r in runs if r["variant"] == name and r.get("bytes_per_averaging")]
        rows.append({"variant": name, "settings": settings, "at": [at.get(s) for s in study.report_steps()],
                     "bytes_per_averaging": spread(sent) if sent else None,
                     "last_quarter": last_quarter_ratio(runs, name, study.steps), "peak": peak,
                     "reference_steps": reference_steps(runs, name)})  # fmt: skip
    gap = train_loss_gap(runs, study.variants, study.sync_steps)
    return {"curves": lines, "rows": rows, "report_steps": study.report_steps(), "train_loss_gap": gap}


def markdown(results: dict) -> str:
    cfg, summary = results["config"], results["summary"]
    steps = summary["report_steps"]
    bench = config_of(cfg).bench(0)
    lines = [
        f"FL+FSDP, {cfg['groups']} groups × {cfg['ranks_per_group']} ranks on one machine (no network shaping), Llama "
        f"`{cfg['model_size']}`, {cfg['steps']} steps of {bench.tokens_per_step:,} world tokens "
        f"({bench.world_size} × {bench.batch_size} × {bench.block_size}), constant lr {bench.learning_rate:g} "
        f"(AdamW), H = {cfg['sync_steps']}, each variant's settings in its row; eval perplexity of the global model on "
        f"{cfg['eval_samples']} held-out blocks every {cfg['eval_steps']} steps. Each figure: median (min–max) over "
        f"seeds {', '.join(map(str, cfg['seeds']))}; ÷ {REFERENCE}: the ratio to blocking fp32 FedAvg of the same "
        "seed, then median (min–max) of those ratios.",
        "",
        "| variant | settings | "
        + " | ".join(f"eval ppl at {s} | ÷ {REFERENCE} at {s}" for s in steps)
        + f" | ÷ {REFERENCE}, mean over steps {3 * cfg['steps'] // 4 + 1}–{cfg['steps']} | largest ÷ {REFERENCE} "
        f"(step) | {REFERENCE} reached its ppl at {cfg['steps']} at step | bytes rank 0 sent per averaging |",
        "|---|---|" + "---:|---:|" * len(steps) + "---:|---:|---:|---:|",
    ]
    for row in summary["rows"]:
        settings = " ".join(f"`{k} {v}`" for k, v in zip(row["settings"][::2], row["settings"][1::2], strict=True))
        cells = [row["variant"], settings or "blocking fp32 FedAvg"]
        for point in row["at"]:
            cells += [median_range(point and point["perplexity"], ".1f"), median_range(point and point["ratio"], ".3f")]
        peak = row.get("peak")
        cells.append(median_range(row.get("last_quarter"), ".3f"))
        cells.append(f"{median_range(peak['ratio'], '.3f')} ({peak['step']})" if peak else "—")
        cells.append(_reached(row.get("reference_steps")) if row["variant"] != REFERENCE else "—")
        cells.append(median_range(row.get("bytes_per_averaging"), ",.0f"))
        lines.append("| " + " | ".join(cells) + " |")
    gap, h = summary.get("train_loss_gap"), cfg["sync_steps"]
    if gap:
        lines += ["", "Train loss less blocking fp32 FedAvg's at the same step and seed (nats; the world's mean loss "
                      f"of each step, as Trainer logs it, steps {h + 1}–{cfg['steps']}), by phase of the averaging "
                      f"cycle: phase p holds the steps ≡ p (mod {h}); phase 1 is the first step after a blocking "
                      f"averaging, phase {h} the step that ends with one. Median (min–max) over seeds.", "",
                  "| variant | mean | " + " | ".join(f"phase {p}" for p in range(1, h + 1)) + " |",
                  "|---|---:|" + "---:|" * h]  # fmt: skip
        for name, g in gap.items():
            if name != REFERENCE:
                cells = [median_range(g["mean"], "+.3f"), *(median_range(s, "+.3f") for s in g["by_phase"])]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    machine = results.get("machine")
    if machine:
        lines += ["", f"Every launch under `nice -n {NICENESS}`, without the benchmark lock: other processes kept "
                      f"{machine['other_processes_cores']:.2f} cores busy on average during the study (quality only, "
                      "so they changed its wall time, not its figures)."]  # fmt: skip
    lines += run_record_lines(results)
    return "\n".join(lines)


def _reached(reference: dict | None) -> str:
    """The steps as median (min–max), and how many seeds' variant ended below the reference's last evaluation."""
    if reference is None:
        return "—"
    missed = reference["not_reached"]
    note = f"({missed} seed{'s' * (missed > 1)} ended below its last)" if missed else ""
    return " ".join(x for x in (median_range(reference["steps"], ".0f") if reference["steps"] else "", note) if x)


def plot(results: dict, out: Path) -> list[Path]:
    """Eval perplexity against the step, and its ratio to blocking fp32 FedAvg (median line, min–max band)."""
    lines = results["summary"]["curves"]
    color = {name: f"C{i}" for i, name in enumerate(CHOICES)}  # one colour per variant in every figure
    fig, ax = new_axes((7, 3.6))
    for name, points in lines.items():
        points = [p for p in points if p["step"] > 0]
        steps = [p["step"] for p in points]
        ax.plot(steps, [p["perplexity"]["median"] for p in points], linestyle="--" if name == REFERENCE else "-",
                color=color[name], label=name)  # fmt: skip
        ax.fill_between(steps, [p["perplexity"]["min"] for p in points], [p["perplexity"]["max"] for p in points],
                        color=color[name], alpha=0.15)  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("eval perplexity (global model)")
    ax.set_title("Median over seeds, band: min–max", fontsize=9)
    ax.legend(fontsize=7)
    perplexity = save_figure(fig, out / "perplexity_vs_step.png")

    fig, ax = new_axes((7, 3.6))
    for name, points in lines.items():
        if name == REFERENCE:
            continue
        points = [p for p in points if p["step"] > 0 and p["ratio"]]
        steps = [p["step"] for p in points]
        ax.plot(steps, [p["ratio"]["median"] for p in points], marker="o", markersize=2, color=color[name], label=name)
        ax.fill_between(steps, [p["ratio"]["min"] for p in points], [p["ratio"]["max"] for p in points],
                        color=color[name], alpha=0.15)  # fmt: skip
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.02, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"eval perplexity ÷ {REFERENCE} (same seed)")
    ax.set_title("Ratio to blocking fp32 FedAvg: median over seeds, band: min–max; dotted: 1.02", fontsize=9)
    ax.legend(fontsize=7)
    ratio = save_figure(fig, out / "ratio_vs_step.png")

    gap, h = results["summary"].get("train_loss_gap", {}), results["config"]["sync_steps"]
    fig, ax = new_axes((7, 3.6))
    for name, g in gap.items():
        if name == REFERENCE:
            continue
        phases = range(1, h + 1)
        ax.plot(phases, [s["median"] for s in g["by_phase"]], marker="o", color=color[name], label=name)
        ax.fill_between(phases, [s["min"] for s in g["by_phase"]], [s["max"] for s in g["by_phase"]],
                        color=color[name], alpha=0.15)  # fmt: skip
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xlabel(f"phase of the averaging cycle (step mod {h}; 1: first step after a blocking averaging)")
    ax.set_ylabel(f"train loss − {REFERENCE}'s (nats)")
    ax.set_title("Same seed, same step: median over seeds of the mean over cycles, band: min–max", fontsize=9)
    ax.legend(fontsize=7)
    phase = save_figure(fig, out / "train_loss_gap_by_phase.png")
    return [perplexity, ratio, phase]


# ---- command line ----


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--quick", action="store_true", help=f"micro, 32 steps, variants {', '.join(QUICK_VARIANTS)}.")
    p.add_argument("--variants", nargs="+", choices=CHOICES, help=f"Default: {', '.join(VARIANTS)} (quick: "
                   f"{', '.join(QUICK_VARIANTS)}); must hold {REFERENCE}.")  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--groups", type=int, default=2, help="Federation groups (default 2).")
    p.add_argument("--ranks-per-group", type=int, default=2, help="Ranks per group, FSDP inside it (default 2).")
    p.add_argument("--model-size", help="Llama preset (default tiny; micro with --quick).")
    p.add_argument("--steps", type=int, help="T, optimizer steps per run (default 200; 32 with --quick).")
    p.add_argument("--sync-steps", type=int, default=8, help="H (default 8, a multiple of 2 F).")
    p.add_argument("--eval-steps", type=int, default=8, help="Evaluate every this many steps (a multiple of H).")
    p.add_argument("--timeout-s", type=float, default=900.0, help="Bound on each run.")
    add_folder_options(p, "stream_quality", work="the runs (records, logs)", report_only="tables and plots")
    return p


def config_from_args(args: argparse.Namespace) -> StreamQualityConfig:
    return validated(
        StreamQualityConfig(
            variants=tuple(args.variants or (QUICK_VARIANTS if args.quick else VARIANTS)),
            seeds=tuple(args.seeds),
            groups=args.groups,
            ranks_per_group=args.ranks_per_group,
            model_size=args.model_size or ("micro" if args.quick else "tiny"),
            steps=args.steps or (32 if args.quick else 200),
            sync_steps=args.sync_steps,
            eval_steps=args.eval_steps,
            timeout_s=args.timeout_s,
        )
    )


def main(argv: list[str] | None = None) -> int:
    study = Study("stream_quality", make_parser(), argv)
    if study.args.report_only:
        return rewrite(study.args.report_only, lambda r: summarize(r["runs"], r["config"]), markdown, plot)
    cfg = config_from_args(study.args)
    data = prepare_data(cfg.bench(cfg.seeds[0]), study.args.data_cache)
    # Without the benchmark lock: nothing here is timed (see the module docstring); every launch is niced instead.
    with study.running(exclusive=False) as work:
        cpu, load_before = busy_cpu_s(), machine_load()
        runs = [train(cfg, name, seed, data, work) for seed in cfg.seeds for name in cfg.variants]
        machine = {"before": load_before, "after": machine_load(), **others_cpu(cpu, time.time() - study.started)}
    results = {"config": asdict(cfg), "runs": runs, "machine": machine}
    results["summary"] = summarize(runs, results["config"])
    return study.finish(results, markdown, plot)


if __name__ == "__main__":
    raise SystemExit(main())

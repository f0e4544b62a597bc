"""Averaging hidden behind compute: blocking FL+FSDP against overlapped and streamed averaging, repeated.

On the two-tier emulated cluster (4 nodes × 2 ranks, 100 Mbit/s links), each repetition runs every method once
in the same order, so a drift in the machine's load hits every method of a repetition alike; every figure is
the median over repetitions with its range. Methods (benchmarks/harness/report.py's VARIANTS):

- FL+FSDP: blocking fp32 FedAvg every H steps (the paper's algorithm);
- FL+FSDP overlap: the whole model's exchange runs behind τ = 1 step;
- FL+FSDP stream: F = 4 fragments, one every H/4 steps, each behind τ = 1 step;
- FL+FSDP stream int8: the same with the int8 codec;
- ideal: FL+FSDP whose groups never average; LocalSGD: Accelerate's, DDP with a whole model per rank.

Two times are divided by (bytes node 0's uplink sent ÷ link rate): the *exchange wait*, the seconds rank 0 waited
for overlapped exchanges to finish (``fed_sync_wait_seconds_total``, the target), and the *callback time*,
the training loop's whole time inside the averaging callback (snapshots, divergence checks, norms, outer steps,
and for blocking averaging the exchange itself). For blocking FL+FSDP the per-averaging ratio of
benchmarks/tiers.py is printed beside them. ``--report-only results.json`` rewrites the tables of a finished
run without running anything.

    python -m benchmarks.overlap            # 3 repetitions, tiny, 32 steps, H = 8
    python -m benchmarks.overlap --quick    # 2 nodes, micro, 16 steps, 1 repetition (the harness, not figures)
    python -m benchmarks.overlap --report-only benchmarks/results/overlap_full/results.json
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict

from benchmarks.harness.methods import BenchConfig, benchmark
from benchmarks.harness.report import judge, median_range, overlap_targets, run_record_lines, spread, table_head
from benchmarks.harness.study import Study, add_folder_options, new_parser, rewrite

METHODS = ("FL+FSDP", "FL+FSDP overlap", "FL+FSDP stream", "FL+FSDP stream int8", "ideal", "LocalSGD")
FIGURES = ("tokens_per_s", "fraction_of_ideal", "exchange_wait_ratio", "loop_wait_ratio", "averaging_ratio_median",
           "final_eval_perplexity")  # fmt: skip


def combine(runs: list[dict], methods: tuple[str, ...]) -> dict:
    """Each method's figures over the repetitions (median, min, max), and the targets on the medians."""
    out = {}
    for name in methods:
        figures = {}
        for key in FIGURES:
            values = [r["methods"][name][key] for r in runs if r["methods"][name].get(key) is not None]
            if values:
                figures[key] = spread(values)
        figures["predicted_s_per_step"] = statistics.median(r["methods"][name]["predicted"]["s_per_step"] for r in runs)
        out[name] = figures
    medians = {name: {k: v["median"] for k, v in f.items() if isinstance(v, dict)} for name, f in out.items()}
    blocking = medians.get("FL+FSDP", {}).get("averaging_ratio_median")
    blocking_row = ("blocking FL+FSDP averaging time ≤ 1.2× bytes ÷ link rate", blocking, 1.2, "≤")
    return {"methods": out, "targets": judge([blocking_row, *overlap_targets(medians)])}


CAPTION = """{nodes} nodes × {ranks_per_node} ranks, links {rate_mbit:g} Mbit/s, Llama `{model_size}`, {steps} steps,
H = {sync_steps}; median (min–max) over {repeats} interleaved repetitions. Exchange wait: seconds rank 0 waited for
overlapped exchanges ÷ (bytes node 0's uplink sent ÷ link rate); callback time: the loop's whole time in the averaging
callback, over the same; blocking ratio: an averaging's time ÷ its bytes ÷ rate, as in benchmarks/tiers.py. Predicted
s/step: the cost model with the ideal's step as compute."""


def markdown(results: dict) -> str:
    columns = ["method", "tokens/s", "of ideal", "predicted s/step", "exchange wait ÷ (bytes ÷ rate)",
               "callback time ÷ (bytes ÷ rate)", "blocking averaging ratio", "eval ppl, equal tokens"]  # fmt: skip
    lines = table_head(CAPTION.format(**results["config"], repeats=results["repeats"]), columns, "l" + "r" * 7)
    for name, f in results["summary"]["methods"].items():
        cells = [
            median_range(f.get("tokens_per_s"), ",.0f"),
            median_range(f.get("fraction_of_ideal"), ".0f", 100) + "%",
            f"{f['predicted_s_per_step']:.2f}",
            median_range(f.get("exchange_wait_ratio"), ".4f"),
            median_range(f.get("loop_wait_ratio"), ".3f"),
            median_range(f.get("averaging_ratio_median"), ".2f"),
            median_range(f.get("final_eval_perplexity"), ".1f"),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| target (on the medians) | measured | met |", "|---|---:|:---:|"]
    for t in results["summary"]["targets"]:
        lines.append(f"| {t['target']} | {t['measured']:.3f} | {'yes' if t['met'] else '**no**'} |")
    lines += run_record_lines(results)
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="2 nodes, micro, 16 steps, 1 repetition.")
    p.add_argument("--repeats", type=int, help="Repetitions (default 3; 1 with --quick).")
    p.add_argument("--steps", type=int, help="Steps per method (default 32; 16 with --quick).")
    p.add_argument("--methods", nargs="+", choices=METHODS, help="Default: all.")
    add_folder_options(p, "overlap", report_only="tables")
    return p


def main(argv: list[str] | None = None) -> int:
    study = Study("overlap", make_parser(), argv)
    args = study.args
    if args.report_only:
        return rewrite(args.report_only, lambda r: combine(r["runs"], tuple(r["config"]["methods"])), markdown)
    steps = args.steps or (16 if args.quick else 32)
    cfg = BenchConfig(
        nodes=2 if args.quick else 4, methods=tuple(args.methods or METHODS), model_size="micro" if args.quick
        else "tiny", steps=steps, sync_steps=8, warmup_steps=8, eval_steps=steps, eval_samples=32 if args.quick
        else 64,
    )  # fmt: skip
    cfg.validate()
    repeats = args.repeats or (1 if args.quick else 3)
    runs = []
    with study.running() as work:
        for rep in range(repeats):
            print(f"repetition {rep + 1}/{repeats}", flush=True)
            runs.append(benchmark(cfg, work / f"r{rep}", args.data_cache))
    results = {"config": asdict(cfg), "repeats": repeats, "summary": combine(runs, cfg.methods), "runs": runs}
    return study.finish(results, markdown)


if __name__ == "__main__":
    raise SystemExit(main())

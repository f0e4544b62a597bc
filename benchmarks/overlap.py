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

    python benchmarks/overlap.py            # 3 repetitions, tiny, 32 steps, H = 8
    python benchmarks/overlap.py --quick    # 2 nodes, micro, 16 steps, 1 repetition (the harness, not figures)
    python benchmarks/overlap.py --report-only benchmarks/results/overlap_full/results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: import this checkout's packages
    sys.path.insert(0, str(REPO))

from benchmarks.harness import results_folder  # noqa: E402
from benchmarks.harness.exclusive import exclusive_cores  # noqa: E402
from benchmarks.harness.methods import DATA_CACHE, BenchConfig, benchmark  # noqa: E402
from benchmarks.harness.report import (  # noqa: E402
    judge,
    median_range,
    overlap_targets,
    run_record,
    run_record_lines,
    spread,
    write_study,
)

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


def markdown(results: dict) -> str:
    cfg = results["config"]
    lines = [
        f"{cfg['nodes']} nodes × {cfg['ranks_per_node']} ranks, links {cfg['rate_mbit']:g} Mbit/s, Llama "
        f"`{cfg['model_size']}`, {cfg['steps']} steps, H = {cfg['sync_steps']}; median (min–max) over "
        f"{results['repeats']} interleaved repetitions. Exchange wait: seconds rank 0 waited for overlapped "
        "exchanges ÷ (bytes node 0's uplink sent ÷ link rate); callback time: the loop's whole time in the averaging "
        "callback, over the same; blocking ratio: an averaging's time ÷ its bytes ÷ rate, as in "
        "benchmarks/tiers.py. Predicted s/step: the cost model with the ideal's step as compute.",
        "",
        "| method | tokens/s | of ideal | predicted s/step | exchange wait ÷ (bytes ÷ rate) | callback time ÷ "
        "(bytes ÷ rate) | blocking averaging ratio | eval ppl, equal tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 nodes, micro, 16 steps, 1 repetition.")
    p.add_argument("--repeats", type=int, help="Repetitions (default 3; 1 with --quick).")
    p.add_argument("--steps", type=int, help="Steps per method (default 32; 16 with --quick).")
    p.add_argument("--methods", nargs="+", choices=METHODS, help="Default: all.")
    p.add_argument("--out", type=Path, help="Results folder (default benchmarks/results/overlap_<quick|full>).")
    p.add_argument("--data-cache", type=Path, default=DATA_CACHE, help="Where the tokenized data is kept.")
    p.add_argument("--report-only", type=Path, help="Rewrite the tables of this results.json; run nothing.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.report_only:
        results = json.loads(args.report_only.read_text())
        results["summary"] = combine(results["runs"], tuple(results["config"]["methods"]))
        print(write_study(args.report_only.parent, results, markdown))
        return 0
    steps = args.steps or (16 if args.quick else 32)
    cfg = BenchConfig(
        nodes=2 if args.quick else 4, methods=tuple(args.methods or METHODS), model_size="micro" if args.quick
        else "tiny", steps=steps, sync_steps=8, warmup_steps=8, eval_steps=steps, eval_samples=32 if args.quick
        else 64,
    )  # fmt: skip
    cfg.validate()
    out = args.out or results_folder("overlap", args.quick)
    repeats = args.repeats or (1 if args.quick else 3)
    runs = []
    with exclusive_cores("benchmarks/overlap.py"), tempfile.TemporaryDirectory(prefix="fedshard-overlap-") as tmp:
        started = time.time()  # after the lock: the record's wall time is the study's own
        for rep in range(repeats):
            print(f"repetition {rep + 1}/{repeats}", flush=True)
            runs.append(benchmark(cfg, Path(tmp) / f"r{rep}", args.data_cache))
    results = {"config": asdict(cfg), "repeats": repeats, "summary": combine(runs, cfg.methods), "runs": runs}
    results.update(run_record("benchmarks/overlap.py", sys.argv[1:] if argv is None else argv, started))
    print(write_study(out, results, markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Scaling with the number of nodes: FSDP, HSDP, FL+FSDP, FL+HSDP and the ideal at 2, 4 and 8 nodes.

As the paper's scaling figure: speedup over FSDP against the number of nodes of the two-tier emulated cluster,
the cost model's prediction beside each point, and each method's share of the ideal at the same scale. Every
scale runs benchmarks/harness/methods.py's ``benchmark()`` ``--repeats`` times (a fresh cluster each time, methods in
the same order), so each figure is a median over repetitions printed with its range (min–max).

All ranks share this machine's 2 cores, so per-rank compute slows as ranks are added while the link rate stays:
the compute-to-communication ratio is *not* that of a real cluster at larger scales. We do not rescale the link
rates; instead each speedup is also reported against the ideal of the same scale (FL+FSDP whose groups never
average, run side by side), which cancels the slower compute.

    python -m benchmarks.scaling --quick    # 2 nodes × 2 ranks, FSDP, FL+FSDP, ideal, micro, 48 steps (≤ 5 min)
    python -m benchmarks.scaling            # 2, 4, 8 nodes × 2 ranks, five methods, tiny, 1 repetition (37 min here)

Tokens/s is the median window with the range over every window of every repetition; speedups and shares of the
ideal are medians over repetitions with their range (one repetition: one figure, its windows' spread beside it).

Results (JSON, Markdown, PNG) go to ``--out`` (default benchmarks/results/scaling_<quick|full>/).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.harness.cost_model import model_state_bytes_per_rank
from benchmarks.harness.methods import BenchConfig, benchmark
from benchmarks.harness.report import (
    layout_of,
    median_range,
    new_axes,
    run_record_lines,
    save_figure,
    spread,
    table_head,
)
from benchmarks.harness.study import Study, add_folder_options, new_parser

METHODS = ("FSDP", "HSDP", "FL+FSDP", "FL+HSDP", "ideal")


def point(runs: list[dict], method: str, cfg: dict) -> dict:
    """One method at one scale over its repetitions: speedups, share of the ideal, prediction and memory."""
    measured = [r["methods"][method] for r in runs]
    fsdp = [r["methods"]["FSDP"] for r in runs]
    pairs = zip(measured, fsdp, strict=True)
    predicted = [f["predicted"]["s_per_step"] / m["predicted"]["s_per_step"] for m, f in pairs]
    layout, _ = layout_of(method, cfg)
    windows = [w for m in measured for w in m["window_tokens_per_s"]]
    return {
        "speedup_vs_fsdp": spread([m["speedup_vs_fsdp"] for m in measured]),
        "fraction_of_ideal": spread([m["fraction_of_ideal"] for m in measured]),
        "tokens_per_s": spread(windows),
        "window_tokens_per_s": windows,
        "predicted_speedup_vs_fsdp": statistics.median(predicted),
        "memory_added_bytes": spread([m["memory_added_bytes_max"] for m in measured]),
        "model_state_bytes_predicted": model_state_bytes_per_rank(measured[0]["params"], layout),
    }


def methods_at(nodes: int, methods: tuple[str, ...]) -> tuple[str, ...]:
    """FL+HSDP puts 2 nodes in a group: with 2 nodes it would be one group (HSDP), so it runs from 4 nodes on."""
    return tuple(m for m in methods if not (m == "FL+HSDP" and nodes < 4))


def run_scales(base: BenchConfig, scales: tuple[int, ...], repeats: int, work: Path, data_cache: Path) -> dict:
    """Every scale, ``repeats`` times; the per-run results are kept whole in the JSON."""
    points, raw = {}, {}
    for nodes in scales:
        cfg = replace(base, nodes=nodes, methods=methods_at(nodes, base.methods))
        runs = []
        for rep in range(repeats):
            print(f"{nodes} nodes, repetition {rep + 1}/{repeats}", flush=True)
            runs.append(benchmark(cfg, work / f"n{nodes}r{rep}", data_cache))
        raw[nodes] = runs
        points[nodes] = {m: point(runs, m, asdict(cfg)) for m in cfg.methods}
    return {"config": asdict(base), "scales": list(scales), "repeats": repeats, "points": points, "runs": raw}


CAPTION = """Two tiers, {ranks_per_node} ranks per node, links {rate_mbit:g} Mbit/s, Llama `{model_size}`, {steps} steps
of (world × {batch_size} × {block_size}) tokens, H = {sync_steps}; speedup and share of ideal: median (min–max) over
{repeats} repetition(s) of each run's median window; tokens/s: median (min–max) over every window. Predicted: the cost
model's step time with the ideal's measured step as compute. Memory: peak resident memory less that before the model
was built, largest rank; model state: the cost model's fp32 parameters, gradients and AdamW state per rank."""


def markdown(results: dict) -> str:
    columns = ["nodes", "method", "speedup vs FSDP", "predicted", "share of ideal", "tokens/s", "memory MB/rank",
               "model state MB"]  # fmt: skip
    lines = table_head(CAPTION.format(**results["config"], repeats=results["repeats"]), columns, "rl" + "r" * 6)
    for nodes, methods in results["points"].items():
        for name, p in methods.items():
            lines.append(
                f"| {nodes} | {name} | {median_range(p['speedup_vs_fsdp'])} | {p['predicted_speedup_vs_fsdp']:.2f} | "
                f"{median_range(p['fraction_of_ideal'], '.0f', 100)}% | {median_range(p['tokens_per_s'], ',.0f')} | "
                f"{median_range(p['memory_added_bytes'], '.0f', 1e-6)} | {p['model_state_bytes_predicted'] / 1e6:.1f} |"
            )
    lines += run_record_lines(results)
    return "\n".join(lines)


def plot(results: dict, out: Path) -> Path:
    fig, ax = new_axes((6, 3.4))
    names = sorted({m for methods in results["points"].values() for m in methods}, key=METHODS.index)
    for index, name in enumerate(names):
        nodes = [int(n) for n, methods in results["points"].items() if name in methods]
        pts = [results["points"][n][name] for n in nodes]
        med = [p["speedup_vs_fsdp"]["median"] for p in pts]
        err = [[m - p["speedup_vs_fsdp"]["min"] for m, p in zip(med, pts, strict=True)],
               [p["speedup_vs_fsdp"]["max"] - m for m, p in zip(med, pts, strict=True)]]  # fmt: skip
        line = ax.errorbar(nodes, med, yerr=err, marker="o", capsize=3, label=name)
        ax.plot(nodes, [p["predicted_speedup_vs_fsdp"] for p in pts], "x--", color=line[0].get_color(),
                alpha=0.6, label=f"{name} (model)" if index == 0 else None)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes (2 ranks each)")
    ax.set_ylabel("speedup over FSDP (tokens/s)")
    ax.set_title("Median over repetitions (bars: min–max); x--: cost model", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, out / "speedup_vs_nodes.png")


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="2 nodes, FSDP, FL+FSDP, ideal, micro, 48 steps.")
    p.add_argument("--nodes", type=int, nargs="+", help="Scales (default 2 4 8; 2 with --quick).")
    p.add_argument("--repeats", type=int, default=1, help="Repetitions per scale (default 1).")
    p.add_argument("--methods", nargs="+", choices=METHODS, help="Default: all five (quick: FSDP, FL+FSDP, ideal).")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="Inter-node link rate, Mbit/s each way.")
    p.add_argument("--steps", type=int, help="Steps per method (default 32; 48 with --quick: 11 windows of H = 4).")
    add_folder_options(p, "scaling")
    return p


def main(argv: list[str] | None = None) -> int:
    study = Study("scaling", make_parser(), argv)
    args = study.args
    quick = args.quick
    h = 4 if quick else 8
    base = BenchConfig(
        ranks_per_node=2, rate_mbit=args.rate_mbit, methods=tuple(args.methods or (
            ("FSDP", "FL+FSDP", "ideal") if quick else METHODS)), model_size="micro" if quick else "tiny",
        steps=args.steps or (48 if quick else 32), sync_steps=h, warmup_steps=h, eval_steps=args.steps or (
            48 if quick else 32), eval_samples=32 if quick else 64,
    )  # fmt: skip
    scales = tuple(args.nodes or ((2,) if quick else (2, 4, 8)))
    for nodes in scales:
        replace(base, nodes=nodes, methods=methods_at(nodes, base.methods)).validate()
    with study.running() as work:
        results = run_scales(base, scales, args.repeats, work, args.data_cache)
    return study.finish(results, markdown, plot)


if __name__ == "__main__":
    raise SystemExit(main())

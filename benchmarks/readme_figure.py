"""The README's one figure: eval perplexity against the training clock for FSDP, HSDP, FL+FSDP and FL+HSDP on the
emulated three-tier cluster, drawn from the recorded run of ``time_to_quality.py --topology three-tier``.

Why a module of its own: the README's figure must come from a recorded run and be redrawn by one command whenever
that run is redone, without rerunning any training. It reads only ``results.json`` and draws each repetition of
each method (curves cut at the budget as the study cuts them), with the baseline's perplexity at the budget.

    python -m benchmarks.readme_figure        # writes docs/perplexity_vs_time_three_tier.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.harness.report import new_axes, save_figure
from benchmarks.time_to_quality import cut

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "time_to_quality_full_three_tier" / "results.json"
FIGURE = ROOT / "docs" / "perplexity_vs_time_three_tier.png"
METHODS = ("FSDP", "HSDP", "FL+FSDP", "FL+HSDP")  # the paper's four, in the README's order
YTICKS = (200, 300, 500, 1000, 2000, 5000, 10000)
COLORS = {"FSDP": "C2", "HSDP": "C0", "FL+FSDP": "C3", "FL+HSDP": "C1"}


def curves(results: dict, method: str) -> list[tuple[list[float], list[float]]]:
    """(minutes, perplexity) of ``method`` in every repetition, cut at the budget as the study cuts them."""
    out = []
    for run in results["runs"]:
        evals = run["methods"][method]["evals"]
        points = cut([(e["train_clock_s"], e["eval_loss"]) for e in evals], results["budget_s"])
        out.append(([t / 60 for t, _ in points], [math.exp(loss) for _, loss in points]))
    return out


def setting(results: dict) -> str:
    """The cluster in one line, from the run's own config (so the caption cannot drift from the data)."""
    cfg = results["config"]
    return (
        f"{cfg['racks']} racks × {cfg['nodes'] // cfg['racks']} nodes × {cfg['ranks_per_node']} ranks, "
        f"{cfg['rate_mbit']:g} Mbit/s in a rack, {cfg['rack_rate_mbit']:g} Mbit/s between racks, "
        f"Llama {cfg['model_size']}\n{len(results['runs'])} repetitions (solid: first)"
    )


def draw(results: dict, out: Path) -> Path:
    """Every recorded repetition of the four methods, HSDP's median perplexity at the budget dotted."""
    fig, ax = new_axes((7, 4))
    for method in (m for m in METHODS if m in results["labels"]):
        for rep, (minutes, ppl) in enumerate(curves(results, method)):
            style = {"linestyle": "-" if rep == 0 else "--", "alpha": 1.0 if rep == 0 else 0.6}
            ax.plot(minutes, ppl, color=COLORS[method], marker="o", markersize=2, linewidth=1,
                    label=None if rep else method, **style)  # fmt: skip
    ax.axhline(results["summary"]["targets"]["HSDP"]["median"], color="grey", linewidth=0.8, linestyle=":")
    ax.axvline(results["budget_s"] / 60, color="grey", linewidth=0.8, linestyle="--")
    ax.set(xlabel="training clock (min, evaluations excluded)", ylabel="eval perplexity (held-out plays)", yscale="log")
    ax.set_yticks(YTICKS, [f"{t:g}" for t in YTICKS])  # labelled ticks over the final range, not only 10³
    ax.set_title(setting(results) + "; dotted: HSDP's perplexity at the budget", fontsize=8)
    ax.legend(fontsize=7)
    return save_figure(fig, out)


def main(argv: list[str] | None = None) -> int:
    """Redraw the README's figure from a recorded results.json (no training)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme_figure", description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS, help=f"default: {RESULTS.relative_to(ROOT)}")
    p.add_argument("--out", type=Path, default=FIGURE, help=f"PNG to write (default: {FIGURE.relative_to(ROOT)})")
    args = p.parse_args(argv)
    print(draw(json.loads(args.results.read_text()), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

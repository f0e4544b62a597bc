"""The scaling, quality and overlap studies' arithmetic (no cluster, no training): run shapes, spreads, the √-lr
rule, the three-tier report's predictions and targets, and the overlap targets on medians over repetitions."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from benchmarks import overlap, quality, scaling
from benchmarks.harness import RESULTS, results_folder
from benchmarks.harness.report import predicted, targets

from .launch import REPO

STUDIES = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")  # what a user runs


def test_quality_runs_hold_tokens_and_per_device_batch_fixed():
    cfg = quality.QualityConfig(worlds=(4, 8, 16), tokens=16 * 4 * 128 * 24)
    assert [cfg.steps(w) for w in cfg.worlds] == [96, 48, 24]  # bigger worlds: fewer, larger steps
    nproc, args = quality.run_args(cfg, "FSDP", 16, seed=1)
    assert nproc == 2 and args[args.index("--gradient_accumulation_steps") + 1] == "8"  # 16 × 4 samples per update
    nproc, args = quality.run_args(cfg, "FL+FSDP", 16, seed=1)
    assert nproc == 16 and args[args.index("--fed_group_size") + 1] == "2"
    assert cfg.learning_rate_of("FSDP √-lr", 16) == pytest.approx(cfg.learning_rate * math.sqrt(8))
    assert cfg.learning_rate_of("FSDP", 16) == cfg.learning_rate_of("FL+FSDP", 16) == cfg.learning_rate
    for world in cfg.worlds:  # every run evaluates all eval samples in whole batches (W=16 once read none)
        for variant in quality.VARIANTS:
            nproc, args = quality.run_args(cfg, variant, world, seed=0)
            batch = int(args[args.index("--per_device_eval_batch_size") + 1])
            assert cfg.eval_samples % (nproc * batch) == 0 and cfg.eval_samples // (nproc * batch) >= 1


def test_quality_rejects_worlds_that_would_evaluate_on_part_of_the_eval_set():
    # eval batch 64 ÷ 8 = 8 per device: W=6 would read 48 of the 64 samples, FSDP's runs all 64.
    with pytest.raises(ValueError, match="eval_samples=64 must be read whole by every run"):
        quality.QualityConfig(worlds=(4, 6, 8), tokens=6 * 8 * 4 * 128 * 4).validate()


def test_quality_rejects_a_budget_that_is_not_whole_steps():
    with pytest.raises(ValueError, match="--tokens=1000 must be a multiple of the world batch 2048 at W=4"):
        quality.QualityConfig(worlds=(4,), tokens=1000).validate()
    with pytest.raises(ValueError, match="H=5"):
        quality.QualityConfig(worlds=(4,), tokens=4 * 4 * 128 * 8, sync_steps=5).validate()


def test_quality_summary_is_median_and_range_over_seeds():
    cfg = quality.QualityConfig(worlds=(4,), variants=("FSDP",), seeds=(0, 1, 2))
    runs = [{"variant": "FSDP", "world": 4, "seed": s, "eval_perplexity": p, "batch_samples": 16, "steps": 8,
             "learning_rate": 1e-3} for s, p in enumerate([30.0, 10.0, 20.0])]  # fmt: skip
    (row,) = quality.summarize(runs, cfg)["rows"]
    assert (row["median"], row["min"], row["max"], row["seeds"]) == (20.0, 10.0, 30.0, 3)
    assert "20.0 (10.0–30.0)" in quality.markdown(quality.summarize(runs, cfg))


def test_scaling_spread_and_methods_per_scale():
    assert scaling.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert scaling.median_range(scaling.spread([3.0, 1.0, 2.0])) == "2.00 (1.00–3.00)"
    assert scaling.median_range(scaling.spread([0.5]), ".0f", 100) == "50"  # one repetition: one figure
    assert scaling.methods_at(2, scaling.METHODS) == ("FSDP", "HSDP", "FL+FSDP", "ideal")  # one group: no FL+HSDP
    assert scaling.methods_at(4, scaling.METHODS) == scaling.METHODS


@pytest.mark.slow  # a subprocess per study: about 8 s each here
@pytest.mark.parametrize("study", STUDIES)
def test_study_help(study):
    """Every study a user runs answers --help as a script (its imports resolve; nothing runs)."""
    cmd, env = [sys.executable, f"benchmarks/{study}.py", "--help"], {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]


THREE_TIER = {"nodes": 4, "ranks_per_node": 2, "racks": 2, "rate_mbit": 1000.0, "rack_rate_mbit": 100.0,
              "sync_steps": 8}  # fmt: skip
RECORD = {"params": 1000, "once_params": 0, "units": 1}


def test_three_tier_prediction_puts_fl_hsdp_groups_on_racks():
    """P = 1000, 4 B everywhere. HSDP all-reduces each 2000-byte gradient shard over 4 nodes every step: 2 rings,
    2 (3/4) 2000 = 3000 B a hop, each ring leaving each rack once: 12000 B over both racks. FL+HSDP only averages
    between the racks every 8 steps: per rack M · 2 (K-1)/K · b_s P / H = 2 · 1 · 4000 / 8 = 1000 B, 2000 B both."""
    hsdp = predicted("HSDP", THREE_TIER, RECORD, compute_s=None)
    fl_hsdp = predicted("FL+HSDP", THREE_TIER, RECORD, compute_s=None)
    assert hsdp["inter_rack_bytes_per_step"] == pytest.approx(2 * 2 * 3 / 4 * 4000)
    assert fl_hsdp["inter_rack_bytes_per_step"] == pytest.approx(2000)
    assert predicted("HSDP", {**THREE_TIER, "racks": 1, "rack_rate_mbit": None}, RECORD, None)[
        "inter_rack_bytes_per_step"] == 0  # fmt: skip


def test_three_tier_targets():
    def method(tokens_per_s, rack_measured=None, rack_predicted=0.0):
        return {"tokens_per_s": tokens_per_s, "final_eval_perplexity": 10.0, "averaging_ratio_median": None,
                "inter_bytes_per_step": 100.0, "inter_rack_bytes_per_step": rack_measured,
                "predicted": {"inter_bytes_per_step": 100.0, "inter_rack_bytes_per_step": rack_predicted}}  # fmt: skip

    methods = {"HSDP": method(100, 120, 100), "FL+HSDP": method(160, 50, 50)}
    rows = {t["target"]: t for t in targets(methods, three_tier=True)}
    assert rows["FL+HSDP tokens/s ≥ 1.5× HSDP"]["met"] and rows["FL+HSDP tokens/s ≥ 1.5× HSDP"]["measured"] == 1.6
    assert not rows["HSDP inter-rack bytes within 15% of the model (measured/predicted - 1)"]["met"]  # +20%
    assert rows["FL+HSDP inter-rack bytes within 15% of the model (measured/predicted - 1)"]["met"]
    assert "FL+HSDP tokens/s ≥ 2× HSDP" in {t["target"] for t in targets(methods)}  # two tiers: the old target


def test_overlap_study_targets_are_taken_on_the_medians():
    def run(stream_tokens, stream_wait, ppl):
        def m(tokens, wait=None, blocking=None, ideal_share=None, perplexity=100.0):
            return {"tokens_per_s": tokens, "fraction_of_ideal": ideal_share, "loop_wait_ratio": wait,
                    "exchange_wait_ratio": wait if blocking is None else None,
                    "averaging_ratio_median": blocking, "final_eval_perplexity": perplexity,
                    "predicted": {"s_per_step": 1.0}}  # fmt: skip

        return {"methods": {"FL+FSDP": m(80, 1.0, 1.1), "FL+FSDP stream": m(stream_tokens, stream_wait, None, 0.9, ppl),
                            "ideal": m(100), "LocalSGD": m(90)}}  # fmt: skip

    runs = [run(96, 0.05, 101.0), run(90, 0.30, 101.0), run(97, 0.02, 101.0)]
    summary = overlap.combine(runs, ("FL+FSDP", "FL+FSDP stream", "ideal", "LocalSGD"))
    assert summary["methods"]["FL+FSDP stream"]["tokens_per_s"] == {"median": 96, "min": 90, "max": 97, "n": 3}
    rows = {t["target"]: t for t in summary["targets"]}
    assert rows["best FL+FSDP (FL+FSDP stream) tokens/s ≥ 95% of ideal"]["measured"] == 0.96
    assert rows["best FL+FSDP (FL+FSDP stream) tokens/s ≥ LocalSGD's"]["met"]
    assert rows["FL+FSDP stream loop's wait on exchanges ≤ 10% of bytes ÷ link rate"]["measured"] == pytest.approx(0.05)
    assert rows["FL+FSDP stream eval ppl at equal tokens ≤ 1.02× blocking fp32 FL+FSDP"]["met"]
    assert rows["blocking FL+FSDP averaging time ≤ 1.2× bytes ÷ link rate"]["met"]
    assert "| FL+FSDP stream | 96 (90–97) |" in overlap.markdown(
        {"config": {"nodes": 4, "ranks_per_node": 2, "rate_mbit": 100, "model_size": "tiny", "steps": 32,
                    "sync_steps": 8}, "repeats": 3, "summary": summary})  # fmt: skip


def test_results_folders_are_named_one_way():
    assert results_folder("tiers", quick=True, variant="three_tier") == RESULTS / "tiers_quick_three_tier"
    scheme = re.compile(rf"({'|'.join(STUDIES)})_(quick|full)(_[a-z0-9_]+)?")
    for folder in RESULTS.iterdir():
        assert folder.is_dir() and scheme.fullmatch(folder.name), f"{folder.name}: not <study>_<quick|full>[_<variant>]"

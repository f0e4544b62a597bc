"""The benchmark studies' arithmetic, in this process (no cluster, no training): the scaling, quality, overlap and
time-to-quality studies' run shapes, spreads, the √-lr rule, the three-tier report's predictions and targets, the
overlap targets on medians over repetitions, the time-to-quality curves (interpolation, time to reach, the budget stop
without evaluation time), the goodput study's fault schedule and committed group-steps, the layout-change study's
loss bump, the speed-rounds study's trained tokens, time to the target, perplexity at equal tokens and its stop at the
target; and the tiers benchmark's figures (windows, perplexity at equal time, variants and their targets).
tests/studies/ runs the studies themselves end to end."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from transformers import TrainerControl, TrainerState

from benchmarks import checkpoint_overhead as co
from benchmarks import goodput, overhead, overlap, pretrained, quality, scaling
from benchmarks import layout_change as lc
from benchmarks import speed_rounds as sr
from benchmarks import stream_quality as sq
from benchmarks import time_to_quality as ttq
from benchmarks.harness import RESULTS, bench_train, faults, progress, results_folder
from benchmarks.harness.methods import BenchConfig, method_args
from benchmarks.harness.report import perplexity_at, predicted, targets, variant_targets, window_throughputs

from ..launch import STUDIES


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


def test_pretrained_runs_differ_only_in_layout_and_the_verdict_pairs_seeds():
    cfg = pretrained.PretrainedConfig()

    def settings(method: str) -> dict[str, str]:
        args = pretrained.run_args(cfg, method, seed=1)
        return dict(zip(args[::2], args[1::2], strict=True))

    fsdp, fl, topk = settings("FSDP"), settings("FL+FSDP"), settings(pretrained.TOPK)
    payload = {k: topk.pop(k) for k in ("--fed_sync_dtype", "--fed_sync_density", "--fed_sync_bits")}
    assert payload == {"--fed_sync_dtype": "topk", "--fed_sync_density": "0.01", "--fed_sync_bits": "2"}
    assert topk == fl  # FL+FSDP's layout and H, the same tokens
    assert fsdp.pop("--fed_group_size") == "2" and fl.pop("--fed_group_size") == "1"  # 1 × 2 ranks; 2 groups × 1
    assert fl.pop("--fed_sync_steps") == "4" and fsdp == fl  # every other setting the same: the same tokens
    assert fsdp["--model_name_or_path"] == "smollm2-135m-instruct" and fsdp["--block_size"] == "64"
    base = pretrained.run_args(cfg, "base", 0)
    assert " ".join(base).count("--max_steps 0 --num_train_epochs 0") == 1  # evaluated by the recipe, untrained

    def run(method: str, seed: int, ppl: float) -> dict:
        return {"method": method, "seed": seed, "eval_perplexity": ppl, "setup": pretrained.SETUP[method],
                "s_per_step": None if method == "base" else 2.0, "peak_rss_bytes_per_rank": [1e9, 2e9]}  # fmt: skip

    runs = [run("base", 0, 80.0), run("FSDP", 0, 40.0), run("FL+FSDP", 0, 38.0), run("FSDP", 1, 44.0),
            run("FL+FSDP", 1, 45.1)]  # fmt: skip
    summary = pretrained.summarize({"config": asdict(cfg), "runs": runs})
    assert summary["fl_over_fsdp"] == pytest.approx([0.95, 1.025])  # paired by seed
    sparse = pretrained.summarize(
        {
            "config": {**asdict(cfg), "methods": ("FL+FSDP", pretrained.TOPK)},
            "runs": [*runs, run(pretrained.TOPK, 1, 49.61), run(pretrained.TOPK, 0, 39.9)],
        }
    )
    assert sparse["topk_over_fp32"] == pytest.approx([1.1, 1.05])  # per seed, against FL+FSDP's fp32
    assert [r["method"] for r in sparse["rows"]] == ["base", "FL+FSDP", pretrained.TOPK]
    assert summary["verdict"] == (
        "lower perplexity: not settled, lower than FSDP's for some seeds and not for others; no worse (≤ 1.05× FSDP's "
        "for every seed): met"
    )
    rows = {r["method"]: r for r in summary["rows"]}
    assert rows["FL+FSDP"]["eval_perplexity"] == pytest.approx({"median": 41.55, "min": 38.0, "max": 45.1, "n": 2})
    assert rows["FSDP"]["vs_base"]["median"] == pytest.approx(0.525)
    assert (rows["FSDP"]["batch_samples"], rows["FL+FSDP"]["batch_samples"]) == (8, 4)
    assert pretrained.verdict([0.9, 0.99]).startswith("lower perplexity: reproduced, lower than FSDP's for every seed")
    assert pretrained.verdict([1.0, 1.05]).endswith("not lower than FSDP's for any seed; no worse (≤ 1.05× FSDP's "
                                                   "for every seed): met")  # fmt: skip
    assert pretrained.verdict([0.9, 1.06]).endswith("missed")
    smollm2 = [p for p in pretrained.projection() if p["model"] == "SmolLM2-135M"]  # the real model's count
    assert len(smollm2) == 2 and {p["params"] for p in smollm2} == {134_515_008}
    with pytest.raises(ValueError, match="--steps=30 must be a positive multiple of H = --sync-steps 4"):
        pretrained.PretrainedConfig(steps=30).validate()
    with pytest.raises(ValueError, match="--eval-samples=48 must be a positive multiple of 2 ranks"):
        pretrained.PretrainedConfig(eval_samples=48).validate()
    with pytest.raises(ValueError, match="--seeds is empty"):
        pretrained.PretrainedConfig(seeds=()).validate()


def test_stream_quality_ratios_are_paired_by_seed_and_taken_at_the_report_steps():
    """Seed 1's blocking run is twice as bad as seed 0's; each stream run is 10% and 30% above its own seed's: the
    ratio is paired (1.1, 1.3), never a ratio of medians, and a step the reference lacks has no ratio."""
    evals = {("FL+FSDP", 0): [100.0, 50.0], ("FL+FSDP", 1): [200.0, 100.0],
             ("FL+FSDP stream", 0): [110.0, 55.0], ("FL+FSDP stream", 1): [260.0, 130.0]}  # fmt: skip
    runs = [{"variant": v, "seed": seed, "evals": [[8 * (i + 1), math.log(p)] for i, p in enumerate(ppl)]}
            for (v, seed), ppl in evals.items()]  # fmt: skip
    runs[2]["evals"].append([24, math.log(40.0)])  # the stream run evaluated once more than its reference
    cfg = sq.StreamQualityConfig(variants=("FL+FSDP", "FL+FSDP stream"), steps=16, eval_steps=8)
    cfg.validate()
    results = {"config": asdict(cfg)}
    results["summary"] = sq.summarize(runs, results["config"])
    assert results["summary"]["report_steps"] == [8, 16]
    stream = {p["step"]: p for p in results["summary"]["curves"]["FL+FSDP stream"]}
    assert stream[16]["ratio"] == pytest.approx({"median": 1.2, "min": 1.1, "max": 1.3, "n": 2})
    assert stream[16]["perplexity"] == pytest.approx({"median": 92.5, "min": 55.0, "max": 130.0, "n": 2})
    assert stream[24]["ratio"] is None  # no blocking run there to pair with
    last_quarter = results["summary"]["rows"][1]["last_quarter"]  # steps > 12 that both evaluated: 16 only
    assert last_quarter == pytest.approx({"median": 1.2, "min": 1.1, "max": 1.3, "n": 2})
    table = sq.markdown(results)
    assert "| FL+FSDP stream | `--fed_sync_fragments 4` `--fed_sync_overlap 1` | 185.0 (110.0–260.0) | " in table
    assert "| 1.200 (1.100–1.300) |" in table
    # the steps blocking needs to reach a run's last eval loss, linear in the loss between its evaluations: seed 1's
    # stream ends on 130 (between blocking's 200 at step 8 and 100 at 16); seed 0's on 40, below blocking's last
    assert sq.step_reaching([[0, 8.0], [8, 6.0], [16, 5.0]], 5.5) == 12.0
    assert sq.step_reaching([[0, 8.0], [8, 6.0]], 4.0) is None and sq.step_reaching([[0, 8.0], [8, 6.0]], 9.0) == 0
    reached = results["summary"]["rows"][1]["reference_steps"]
    assert reached["not_reached"] == 1 and reached["steps"]["median"] == pytest.approx(8 + 8 * math.log2(200 / 130))
    with pytest.raises(ValueError, match="must hold FL\\+FSDP"):
        sq.StreamQualityConfig(variants=("FL+FSDP stream", "FL+FSDP overlap")).validate()
    with pytest.raises(ValueError, match="multiple of 8"):
        sq.StreamQualityConfig(sync_steps=4, eval_steps=4).validate()


def test_scaling_spread_and_methods_per_scale():
    assert scaling.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert scaling.median_range(scaling.spread([3.0, 1.0, 2.0])) == "2.00 (1.00–3.00)"
    assert scaling.median_range(scaling.spread([0.5]), ".0f", 100) == "50"  # one repetition: one figure
    assert scaling.methods_at(2, scaling.METHODS) == ("FSDP", "HSDP", "FL+FSDP", "ideal")  # one group: no FL+HSDP
    assert scaling.methods_at(4, scaling.METHODS) == scaling.METHODS


def test_overhead_pins_a_core_per_rank_and_runs_trainer_as_a_job_per_group(monkeypatch, capsys):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # CI's 2 cores, on any machine
    pinned = overhead.parse(["--num-groups", "1", "--pin"])
    assert pinned.out == RESULTS / "overhead_full_1x2_pinned" and pinned.num_samples == 48 * 4 * 2
    assert overhead.jobs(pinned, "trainer") == [(2, "trainer0", 0)] and pinned.worker_args[-1] == "--pin"
    default = overhead.parse([])
    assert default.out == RESULTS / "overhead_full" and "--pin" not in default.worker_args
    assert overhead.jobs(default, "trainer") == [(2, "trainer0", 0), (2, "trainer1", 2)]
    assert overhead.jobs(default, "fedshard") == [(4, "fedshard", 0)]
    ones = overhead.parse(["--group-size", "1", "--pin", "--methods", "fedshard", "handwritten"])
    assert ones.out == RESULTS / "overhead_full_2x1_pinned"
    assert overhead.jobs(ones, "handwritten") == [(2, "handwritten", 0)]
    for argv, message in ((["--pin"], "--pin needs a core per rank: 4 ranks, 2 cores"),
                          (["--group-size", "1"], "--group-size 1 leaves trainer out")):  # fmt: skip
        with pytest.raises(SystemExit):
            overhead.parse(argv)
        assert message in capsys.readouterr().err


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


# (training clock s, eval loss) every 8 s; the budget, 28 s, falls halfway between the last two evaluations.
BUDGET_S = 28.0
CURVES = {  # per repetition; losses are binary fractions, so every interpolation below is exact
    "FSDP": [[(0, 9), (8, 8.5), (16, 8), (24, 7.5), (32, 7)], [(0, 9), (8, 8.5), (16, 8), (24, 7.75), (32, 7.25)]],
    "FL+FSDP": [[(0, 9), (4, 8), (8, 7), (12, 6.5), (32, 5)], [(0, 9), (4, 8), (8, 7), (12, 6.5), (32, 5)]],
    "FSDP lr ×2": [[(0, 9), (8, 8), (16, 7.5), (24, 7), (32, 6.5)], [(0, 9), (8, 8), (16, 7.5), (24, 7), (32, 6.5)]],
    "LocalSGD": [[(0, 9), (16, 8.5), (32, 8)], [(0, 9), (16, 8.5), (32, 8)]],
}  # fmt: skip


def ttq_records(points: list[tuple[float, float]], stop_steps: tuple[int, ...] = (4, 4)) -> list[dict]:
    """The ranks' records bench_train.py writes, as far as the study reads them: rank 0's evaluations, each
    rank's steps (one per evaluation here) and memory."""
    steps = [{"step": i, "train_clock_s": float(t)} for i, (t, _) in enumerate(points[1:], start=1)]
    return [{"rank": rank, "evals": [{"step": i, "train_clock_s": float(t), "eval_loss": float(loss)}
                                     for i, (t, loss) in enumerate(points)] if rank == 0 else [],
             "steps": steps[:stop], "peak_rss_bytes": (300 + rank) * 10**6, "rss_before_model_bytes": 100 * 10**6}
            for rank, stop in enumerate(stop_steps)]  # fmt: skip


def test_time_to_quality_interpolates_in_the_training_clock_and_cuts_at_the_budget():
    points = CURVES["FSDP"][0]
    assert ttq.loss_at(points, 28.0) == 7.25  # halfway between 7.5 at 24 s and 7 at 32 s
    assert ttq.loss_at(points, 0.0) == 9 and ttq.loss_at(points, 32.0) == 7
    assert ttq.loss_at(points, 33.0) is None  # past the last evaluation: the run stopped before the budget
    assert ttq.cut(points, BUDGET_S) == [(0, 9), (8, 8.5), (16, 8), (24, 7.5), (28.0, 7.25)]
    assert ttq.cut(points, 24.0) == [(0, 9), (8, 8.5), (16, 8), (24, 7.5)]  # on an evaluation: nothing added
    assert ttq.time_to_reach(points, 8.25, BUDGET_S) == 12.0  # 8.5 at 8 s, 8 at 16 s
    assert ttq.time_to_reach(points, 7.25, BUDGET_S) == BUDGET_S  # its own loss at the budget: at the budget
    assert ttq.time_to_reach(points, 7.0, BUDGET_S) is None  # reached at 32 s, after the budget
    assert ttq.time_to_reach(points, 9.5, BUDGET_S) == 0  # already there at the start


def test_time_to_quality_reports_per_repetition_against_fsdp_and_the_tuned_fsdp():
    labels = tuple(CURVES)
    runs = [{"methods": {m: ttq.run_summary(ttq_records(c[rep]), BUDGET_S, tokens_per_step=1000)
                         for m, c in CURVES.items()},
             "machine": {"before": {"cpus": 2}, "after_each_method": {m: {"other_processes_cores": 0.25 * rep}
                                                                      for m in CURVES}}}
            for rep in range(2)]  # fmt: skip
    fsdp = runs[0]["methods"]["FSDP"]
    assert (fsdp["loss_at_budget"], fsdp["steps_in_budget"], fsdp["tokens_in_budget"]) == (7.25, 3, 3000)
    assert fsdp["stop_step_per_rank"] == [4] and fsdp["peak_rss_bytes_max"] == 301 * 10**6
    assert fsdp["memory_added_bytes_max"] == 201 * 10**6
    assert ttq.run_summary(ttq_records(CURVES["FSDP"][0], (4, 3)), BUDGET_S, 1)["stop_step_per_rank"] == [3, 4]

    summary = ttq.combine(runs, labels, BUDGET_S)
    assert summary["tuned_fsdp"] == "FSDP lr ×2"  # 6.75 at the budget in both repetitions, FSDP 7.25 and 7.5
    assert summary["targets"]["FSDP"] == ttq.spread([math.exp(7.25), math.exp(7.5)])
    fl = summary["methods"]["FL+FSDP"]
    # FSDP's target differs per repetition (7.25, 7.5): FL+FSDP crosses it at 4 + 4 · 0.75 and 4 + 4 · 0.5 s.
    assert fl["time_to_FSDP"] == {"per_repetition": [7.0, 6.0], "reached": [7.0, 6.0]}
    assert fl["speedup_to_FSDP"] == ttq.spread([28.0 / 7.0, 28.0 / 6.0])
    assert fl["time_to_tuned FSDP"]["per_repetition"] == [10.0, 10.0]  # 6.75 between 7 at 8 s and 6.5 at 12 s
    assert summary["methods"]["FSDP"]["time_to_FSDP"]["per_repetition"] == [BUDGET_S, BUDGET_S]
    assert summary["methods"]["FSDP"]["time_to_tuned FSDP"]["reached"] == []
    local = summary["methods"]["LocalSGD"]
    assert local["time_to_FSDP"]["per_repetition"] == [None, None] and local["speedup_to_FSDP"] is None
    assert local["perplexity_at_budget"]["median"] == math.exp(8.125)

    results = {"config": {"nodes": 4, "ranks_per_node": 2, "rate_mbit": 100.0, "model_size": "tiny",
                          "batch_size": 4, "block_size": 128, "learning_rate": 2e-3, "sync_steps": 8,
                          "eval_samples": 64, "eval_steps": 8},
               "budget_s": BUDGET_S, "repeats": 2, "summary": summary, "runs": runs}  # fmt: skip
    table = ttq.markdown(results)
    # exp(6.5 - 1.5 · 16/20) = 200.3 at the budget; 6.5 s (6–7) = 0.11 (0.10–0.12) min; 28 ÷ 7, 28 ÷ 6; 10 s
    assert "| FL+FSDP | 200.3 | 3 | 0.11 (0.10–0.12) | 4.33 (4.00–4.67) | 0.17 | 301 | 201 |" in table
    assert "| LocalSGD | 3377.9 | 1 | not reached (ppl 3377.9 at the budget) | — |" in table  # exp(8.125)
    assert "| FSDP lr ×2 (tuned) | 854.1 |" in table
    assert "over repetitions): FSDP 0.12 (0.00–0.25), FL+FSDP 0.12 (0.00–0.25)," in table
    assert ttq.headline(results) == (
        "On 4 nodes × 2 ranks sharing 2 CPU cores, 100 Mbit/s between nodes, Llama `tiny`, a budget of 28 s of "
        "training: to reach perplexity 1608.1 (1408.1–1808.0) (FSDP's at the budget), FL+FSDP needed 0.11 "
        "(0.10–0.12) min where FSDP needed 0.47 min (median (min–max) over 2 repetition(s))."
    )


def test_time_to_quality_clocks_the_slowest_rank_and_compares_the_payloads():
    records = ttq_records(CURVES["FSDP"][0])
    for step in records[1]["steps"]:  # rank 1 two seconds behind rank 0 at every step
        step["train_clock_s"] += 2
    late = ttq.run_summary(records, BUDGET_S, 1)  # 7.5 at 26 s, 7 at 34 s (rank 0's clock alone: 7.25)
    assert (late["loss_at_budget"], late["steps_in_budget"], late["train_clock_at_stop_s"]) == (7.375, 3, 34.0)

    curves = {"FL+FSDP": CURVES["FSDP"], ttq.INT8: CURVES["FSDP lr ×2"], ttq.TOPK: CURVES["FL+FSDP"]}
    runs = [{"methods": {m: ttq.run_summary(ttq_records(c[rep]), BUDGET_S, 1) for m, c in curves.items()}}
            for rep in range(2)]  # fmt: skip
    results = {"summary": ttq.combine(runs, tuple(curves), BUDGET_S, baselines=("FL+FSDP",)),
               "baselines": ["FL+FSDP"]}  # fmt: skip
    # FL+FSDP's 7.25 and 7.5 at the budget: int8 reaches them at 20 and 16 s, topk at 7 and 6 s
    assert ttq.payload_sentence(results) == (
        "FL+FSDP overlap topk 1% reached FL+FSDP's perplexity at the budget 2.76 (2.67–2.86)× sooner than FL+FSDP "
        "overlap int8 (int8's time ÷ topk's, per repetition: 2.86, 2.67); target ≥ 1.5× in every repetition: met."
    )
    assert ttq.headline({**results, "budget_s": BUDGET_S}) is None  # FL+FSDP as the target has no counterpart
    with pytest.raises(ValueError, match="--target FSDP did not run: add it to --methods"):
        ttq.config_from_args(ttq.make_parser().parse_args(["--methods", "FL+FSDP", "--target", "FSDP"]))


def test_time_to_quality_on_three_tiers_measures_fl_hsdp_against_hsdp_first():
    cfg, labels = ttq.config_from_args(ttq.make_parser().parse_args(["--topology", "three-tier"]))[:2]
    assert (cfg.racks, cfg.nodes, cfg.rate_mbit, cfg.rack_rate_mbit) == (2, 4, 1000.0, 100.0)
    assert labels == ("HSDP", "FL+HSDP", "FSDP", "FL+FSDP")
    assert ttq.study_args("FL+HSDP", cfg, 120)[:4] == ["--fed_group_size", "4", "--fed_shard_size", "2"]  # a rack
    curves = {"HSDP": CURVES["FSDP"], "FL+HSDP": CURVES["FL+FSDP"], "FSDP": CURVES["LocalSGD"],
              "FL+FSDP": CURVES["FSDP lr ×2"]}  # fmt: skip
    runs = [{"methods": {m: ttq.run_summary(ttq_records(c[rep]), BUDGET_S, tokens_per_step=1000)
                         for m, c in curves.items()},
             "machine": {"before": {"cpus": 2}, "after_each_method": {m: {"other_processes_cores": 0.0}
                                                                      for m in curves}}}
            for rep in range(2)]  # fmt: skip
    summary = ttq.combine(runs, labels, BUDGET_S, baselines=("HSDP", "FSDP"))
    assert list(summary["targets"]) == ["HSDP", "FSDP"] and summary["tuned_fsdp"] is None  # no lr grid
    fl = summary["methods"]["FL+HSDP"]
    assert fl["time_to_HSDP"]["per_repetition"] == [7.0, 6.0]  # HSDP's targets 7.25 and 7.5, as FSDP's above
    assert fl["time_to_FSDP"]["per_repetition"] == [3.5, 3.5]  # FSDP's 8.125 at the budget: 9 → 8 over 4 s
    assert fl["speedup_to_FSDP"] == ttq.spread([8.0, 8.0])  # FSDP reaches its own at the budget, 28 s
    results = {"config": {**asdict(cfg), "batch_size": 4, "learning_rate": 2e-3}, "baselines": ["HSDP", "FSDP"],
               "budget_s": BUDGET_S, "repeats": 2, "summary": summary, "runs": runs}  # fmt: skip
    table = ttq.markdown(results)
    assert table.startswith("2 racks × 2 nodes × 2 ranks, links 1000 Mbit/s between the nodes of a rack and 100 "
                            "Mbit/s between racks")  # fmt: skip
    assert ("| time to HSDP's ppl (min) | speed-up vs HSDP | time to FSDP's ppl (min) | speed-up vs FSDP | peak RSS"
            in table)  # fmt: skip
    assert "| FL+HSDP | 200.3 | 3 | 0.11 (0.10–0.12) | 4.33 (4.00–4.67) | 0.06 | 8.00 | 301 | 201 |" in table
    assert ttq.headline(results) == (
        "On 2 racks × 2 nodes × 2 ranks sharing 2 CPU cores, 1000 Mbit/s between the nodes of a rack and 100 Mbit/s "
        "between racks, Llama `tiny`, a budget of 28 s of training: to reach perplexity 1608.1 (1408.1–1808.0) "
        "(HSDP's at the budget), FL+HSDP needed 0.11 (0.10–0.12) min where HSDP needed 0.47 min (median (min–max) "
        "over 2 repetition(s))."
    )


def test_time_to_quality_runs_share_arguments_but_the_study_settings():
    cfg = ttq.config_from_args(ttq.make_parser().parse_args([]))[0]
    assert (cfg.nodes, cfg.ranks_per_node, cfg.rate_mbit, cfg.model_size, cfg.eval_steps) == (4, 2, 100.0, "tiny", 8)
    assert ttq.study_args("FL+FSDP overlap", cfg, 120) == [
        "--fed_group_size", "2", "--fed_sync_steps", "8", "--fed_sync_overlap", "1", "--eval_offset_steps", "1",
        "--budget_s", "120"]  # fmt: skip
    assert ttq.study_args("FL+FSDP 1 rank/group", cfg, 120)[:2] == ["--fed_group_size", "1"]
    assert ttq.study_args("FSDP lr ×0.5", cfg, 120) == ["--fsdp", "--learning_rate", "0.001", "--budget_s", "120"]
    assert [ttq.lr_factor(m) for m in ("FSDP", "FSDP lr ×4", "HSDP")] == [1.0, 4.0, None]


def test_budget_stop_leaves_evaluations_out_of_the_clock_and_stops_every_rank_at_one_step(monkeypatch):
    """Evaluations of 2 and 3 s between steps of 4 and 7 s: the clock at step 2 is 4 + 7 = 11 s, not 16 s, and
    with a budget of 10 s training stops after step 2 (the first evaluated step past it), not after step 1."""
    now = [100.0]
    monkeypatch.setattr(bench_train.time, "perf_counter", lambda: now[0])
    recorder = bench_train.StepRecorder(read_counters=False)
    budget = bench_train.BudgetStop(recorder, budget_s=10.0)
    state, control = TrainerState(), TrainerControl()

    def evaluate(at: float, loss: float) -> None:
        now[0] = at
        for callback in (budget, recorder):  # the Trainer's order: BudgetStop is added before the recorder
            callback.on_evaluate(None, state, control, metrics={"eval_loss": loss})

    recorder.on_train_begin(None, state, control)
    evaluate(102.0, 9.0)  # at the start
    stops = []
    for step, (begin, end, eval_end) in enumerate([(102.0, 106.0, 109.0), (109.0, 116.0, 118.0)], start=1):
        state.global_step, now[0] = step, begin
        recorder.on_step_begin(None, state, control)
        now[0], control.should_evaluate = end, True
        recorder.on_step_end(None, state, control)
        evaluate(eval_end, 9.0 - step)
        stops.append(control.should_training_stop)
    assert [s["train_clock_s"] for s in recorder.steps] == [4.0, 11.0]
    assert [(e["step"], e["train_clock_s"]) for e in recorder.evals] == [(0, 0.0), (1, 4.0), (2, 11.0)]
    assert stops == [False, True]
    assert bench_train.world_max(3.5) == 3.5  # no process group: the rank's own clock


def test_eval_offset_moves_evaluations_and_logs_past_the_apply():
    state, control, offset = TrainerState(eval_steps=8, max_steps=20), TrainerControl(), bench_train.EvalOffset(1)
    moved = []
    for step in range(1, 21):
        state.global_step = step
        control.should_evaluate = control.should_log = step % 8 == 0  # as Trainer's flow callback asks
        offset.on_step_end(None, state, control)
        moved += [step] if control.should_evaluate and control.should_log else []
    assert moved == [1, 9, 17, 20]  # τ = 1 past each multiple of 8, and the last step


# ---- speed_rounds.py: trained tokens, time to the target, perplexity at equal tokens, the slow group's plan ----

SR_CFG = {"groups": 2, "factors": [2.0], "budget_s": 3.0, "cap_factor": 3.0, "sync_steps": 2, "batch_size": 1,
          "block_size": 2}  # fmt: skip
# Evaluations every H = 2 steps: losses 8, 6, 5, 4.5 (the same per step in every run: the same data and seed).
SR_LOSSES = [8.0, 6.0, 5.0, 4.5]


def sr_records(s_per_step: float, trained: list[list[bool]], compute_s: list[float], barrier_s: list[float]) -> list:
    """Records of a 2-group run (a rank each) of ``len(trained[0])`` steps, ``s_per_step`` of training clock each on
    rank 0; group g's trained steps take ``compute_s[g]`` (an untrained one 0.01 s), an averaging 0.25 s more."""
    records = []
    for rank, flags in enumerate(trained):
        steps, t = [], 0.0
        for k, flag in enumerate(flags, start=1):
            sync = 0.25 if k % 2 == 0 else 0.0
            took = (compute_s[rank] if flag else 0.01) + sync
            steps.append({"step": k, "begin_s": t, "end_s": t + took, "sync_s": sync, "trained": flag,
                          "train_clock_s": s_per_step * k})  # fmt: skip
            t += took
        evals = [{"step": k, "train_clock_s": s_per_step * k, "eval_loss": SR_LOSSES[k // 2]}
                 for k in range(0, len(flags) + 1, 2)]  # fmt: skip
        records.append({"rank": rank, "steps": steps, "evals": evals if rank == 0 else [],
                        "fed": {"fed_barrier_seconds_total": barrier_s[rank]}})  # fmt: skip
    return records


def sr_repetition() -> dict:
    """All fast (1 s a step, stopped at the first evaluation past the 3 s budget), 2× slower under steps (2 s a
    step) and under speed (1 s a step; the slow group trains 1 of each round's 2 steps after the first)."""
    fast = sr.run_summary(sr_records(1.0, [[True] * 4] * 2, [0.5, 0.5], [0.5, 0.5]), SR_CFG, limit_s=3.0)
    sync = sr.run_summary(sr_records(2.0, [[True] * 6] * 2, [0.5, 1.0], [6.0, 0.25]), SR_CFG, limit_s=9.0)
    speed_flags = [[True] * 6, [True, True, True, False, True, False]]
    speed = sr.run_summary(sr_records(1.0, speed_flags, [0.5, 1.0], [1.0, 0.5]), SR_CFG, limit_s=9.0)
    for run in (fast, sync, speed):
        run["throttled_share"] = [0.1, 0.5]
    runs = {sr.FAST: fast, sr.run_label(2.0, "steps"): sync, sr.run_label(2.0, "speed"): speed}
    machine = {label: {"other_processes_cores": 0.25} for label in runs}
    return {"runs": runs, "target": sr.target_of(fast), "machine": {"after_each_run": machine}}


def test_speed_rounds_counts_only_the_tokens_each_group_trained():
    speed = sr_records(1.0, [[True] * 6, [True, True, True, False, True, False]], [0.5, 1.0], [1.0, 0.5])
    assert sr.world_trained_tokens(speed, tokens_per_step=2) == [0, 4, 8, 12, 14, 18, 20]  # 2 then 1 group a step
    summary = sr.run_summary(speed, SR_CFG, limit_s=9.0)
    assert [e["trained_tokens"] for e in summary["evals"]] == [0, 8, 14, 20]
    assert (summary["trained_tokens"], summary["tokens_per_s"], summary["train_clock_at_stop_s"]) == (20, 20 / 6, 6.0)
    slow = summary["groups"][1]
    assert slow["round_plan"] == [2, 1, 1] and slow["trained_steps"] == 4 and slow["barrier_s"] == 0.5
    assert (summary["groups"][0]["s_per_trained_step"], slow["s_per_trained_step"]) == (0.5, 1.0)  # averaging out
    assert sr.slowdown(summary, slow_group=1) == 2.0
    assert sr.settled_plan(summary, 1) == [1, 1] and sr.expected_plan(summary, 2, slow_group=1) == 1  # ⌊2 · ½ + ½⌋
    assert sr.step_spread(speed[1]["steps"]) == 0.0  # every trained step of the slow group took 1 s
    assert sr.round_plan(speed[1]["steps"][:5], 2) == [2, 1]  # a round cut short by the stop is left out


def test_a_budget_reached_on_another_ranks_clock_is_read_at_the_evaluation_that_stopped_the_run():
    """Rank 0's clock is 4.0 s at the stopping evaluation (step 4), rank 1's 4.2 s: a 4.1 s budget stopped the run
    there (the slowest rank's clock reached it), and the target is read at that evaluation, not past the curve."""
    records = sr_records(1.0, [[True] * 4] * 2, [0.5, 0.5], [0.5, 0.5])
    for step in records[1]["steps"]:
        step["train_clock_s"] += 0.2
    fast = sr.run_summary(records, SR_CFG, limit_s=4.1)
    assert sr.target_of(fast) == {"loss": SR_LOSSES[2], "tokens": 16}
    records[1]["steps"][-1]["train_clock_s"] = 4.05  # no rank reached it: the budget did not stop this run
    assert sr.run_summary(records, SR_CFG, limit_s=4.1)["loss_at_limit"] is None


def test_speed_rounds_target_and_equal_tokens_are_read_between_the_same_evaluations():
    rep = sr_repetition()
    fast = rep["runs"][sr.FAST]
    # The budget, 3 s, lies halfway between the evaluations at 2 s (6.0, 8 tokens) and 4 s (5.0, 16 tokens).
    assert rep["target"] == {"loss": 5.5, "tokens": 12.0}
    assert sr.loss_at_tokens(fast, 12.0) == 5.5  # the all-fast run's own loss at the reference tokens: the target
    assert sr.time_to_target(fast, 5.5) == 3.0
    sync, speed = rep["runs"][sr.run_label(2.0, "steps")], rep["runs"][sr.run_label(2.0, "speed")]
    assert sr.time_to_target(sync, 5.5) == 6.0  # 6.0 at 4 s, 5.0 at 8 s
    assert sr.time_to_target(speed, 5.5) == 3.0
    assert sr.loss_at_tokens(sync, 12.0) == 5.5
    assert sr.loss_at_tokens(speed, 11.0) == 5.5  # 6.0 at 8 tokens, 5.0 at 14: fewer tokens per step
    assert sr.loss_at_tokens(speed, 21.0) is None  # not reached
    assert sr.time_to_target(speed, 4.0) is None


def test_speed_rounds_compares_each_pair_per_repetition_and_judges_the_targets():
    reps = [sr_repetition(), sr_repetition()]
    summary = sr.combine(reps, SR_CFG)
    pair = summary["pairs"]["2"]
    first = pair["per_repetition"][0]
    assert (first["sync_over_speed_time"], first["speed_over_fast_time"], first["sync_reached"]) == (2.0, 1.0, True)
    assert first["ppl_ratio_equal_tokens"] == pytest.approx(math.exp((6.0 - 4 / 6) - 5.5))  # 5.33 against 5.5
    speed = summary["runs"][sr.run_label(2.0, "speed")]
    assert speed["slow_plan"] == sr.spread([1, 1]) and speed["expected_slow_plan"] == sr.spread([1, 1])
    assert speed["barrier_share"][0] == sr.spread([1 / 6, 1 / 6])
    met = {t["target"].split(": ")[1].split(" (")[0]: (t["measured"], t["met"]) for t in summary["targets"]}
    assert met == {
        "speed-aware reaches the target ≥ 1.5× sooner than synchronous": (2.0, True),
        "speed-aware within 15% of the all-fast federation's time": (1.0, True),
        "perplexity at equal tokens within 2% of synchronous": (pytest.approx(math.exp(-1 / 6)), True),
    }
    # A synchronous run that never reached the target: its ratio is a lower bound, the cap (9 s) ÷ speed's time.
    sync = sr.run_label(2.0, "steps")
    for rep in reps:
        rep["runs"][sync]["evals"] = [{**e, "eval_loss": 7.0} for e in rep["runs"][sync]["evals"]]
    summary = sr.combine(reps, SR_CFG)
    assert summary["pairs"]["2"]["sync_over_speed_time"] == sr.spread([3.0, 3.0])
    assert summary["targets"][0]["lower_bound"] and summary["targets"][0]["met"]
    assert summary["pairs"]["2"]["ppl_ratio_equal_tokens"] == sr.spread([math.exp(6.0 - 4 / 6 - 7.0)] * 2)
    results = {"config": {**SR_CFG, "model_size": "micro", "rate_mbit": 100.0, "learning_rate": 2e-3,
                          "fast_cores": 0.4, "period_ms": 10.0},
               "repeats": 2, "summary": summary, "reps": reps,
               "machine_before": {"loadavg_1_5_15": [0.1, 0.2, 0.3], "cpus": 2}}  # fmt: skip
    table = sr.markdown(results)
    assert f"| {sync} | not reached in 9 s | 2 | 1096.6 | 2.00 |" in table  # 24 tokens in 12 s; exp(7): flat at 7.0
    assert "| 2× | ≥ 3.00 (sync not reached within the cap) | 1.00 | 0.19 |" in table
    assert "| 2× slower, speed | 3.0 | 3 | 207.1 | 2.00 | 0.500 / 1.000 | 1.0 / 0.5 | 17% / 8% | 1.0 (1) |" in table
    assert "groups 0: 0.4 of a core each; group 1: the same ÷ F." in table


def test_speed_rounds_runs_share_arguments_and_refuse_quotas_past_the_cores(monkeypatch):
    cfg = sr.config_from_args(sr.make_parser().parse_args([]))
    assert [(r.label, r.factor, r.policy) for r in sr.plan(cfg)] == [
        ("all fast", 1.0, "steps"), ("2× slower, steps", 2.0, "steps"), ("2× slower, speed", 2.0, "speed"),
        ("4× slower, steps", 4.0, "steps"), ("4× slower, speed", 4.0, "speed")]  # fmt: skip
    assert cfg.cores(4.0) == [0.4, 0.4, 0.4, 0.1] and cfg.timeout_s == cfg.cap_s + 300
    fast, speed = sr.plan(cfg)[0], sr.plan(cfg)[2]
    assert sr.run_args(cfg, fast, None) == ["--fed_group_size", "1", "--fed_sync_steps", "8", "--fed_round_policy",
                                            "steps", "--budget_s", "60"]  # fmt: skip
    assert sr.run_args(cfg, speed, {"loss": 6.25, "tokens": 1000.5})[4:] == [
        "--fed_round_policy", "speed", "--budget_s", "180", "--target_loss", "6.25", "--target_tokens",
        "1001"]  # fmt: skip
    quick = sr.config_from_args(sr.make_parser().parse_args(["--quick"]))
    assert (quick.factors, quick.budget_s, quick.repeats, quick.cap_s) == ((2.0,), 15.0, 1, 37.5)
    monkeypatch.setattr(sr.os, "cpu_count", lambda: 1)
    with pytest.raises(ValueError, match=r"0.4 × 4 groups = 1.6 cores must stay below this machine's 1"):
        cfg.validate()
    monkeypatch.setattr(sr.os, "cpu_count", lambda: 2)
    with pytest.raises(ValueError, match="under the kernel's 1 ms minimum quota"):
        sr.SpeedConfig(factors=(8.0,)).validate()  # 0.05 of a core of a 10 ms period: 0.5 ms


def test_target_stop_needs_the_loss_and_the_tokens_and_the_recorder_marks_untrained_steps():
    trains = iter([True, False, True])
    recorder = bench_train.StepRecorder(read_counters=False, trains=lambda: next(trains))
    stop = bench_train.TargetStop(recorder, target_loss=5.0, target_tokens=1024, tokens_per_step=512)
    state, control = TrainerState(), TrainerControl()
    recorder.on_train_begin(None, state, control)
    reached = []
    for step, loss in [(1, 4.0), (2, 4.0), (3, 5.5), (3, 5.0)]:
        if step > state.global_step:
            state.global_step = step
            recorder.on_step_begin(None, state, control)
            recorder.on_step_end(None, state, control)
        stop.on_evaluate(None, state, control, metrics={"eval_loss": loss})
        reached.append(control.should_training_stop)
    assert [s["trained"] for s in recorder.steps] == [True, False, True]
    # step 1: 512 tokens; step 2 passed over: still 512; step 3: 1024, but the loss 5.5; then 5.0: stop
    assert reached == [False, False, False, True]
    assert bench_train.world_sum(3.0) == 3.0  # no process group: the rank's own value


def test_start_gate_waits_for_go(tmp_path):
    args = type("Args", (), {"process_index": 3})()
    (tmp_path / "go").touch()
    bench_train.StartGate(str(tmp_path)).on_train_begin(args, None, None)
    assert (tmp_path / "ready3").exists()
    (tmp_path / "go").unlink()
    with pytest.raises(RuntimeError, match="did not start us"):
        bench_train.StartGate(str(tmp_path), timeout_s=0.05).on_train_begin(args, None, None)


# ---- goodput.py and elastic_demo.py: fault injection, committed group-steps, stalls ----


def test_fault_schedule_kills_in_turn_and_restarts_within_the_run():
    kills = [(1, 15), (2, 45), (3, 75), (1, 105)]  # in the middle of each 30 s: 4 faults in 120 s
    assert faults.fault_schedule(120, 30, 5, victims=(1, 2, 3)) == [faults.Fault(g, t, t + 5) for g, t in kills]
    assert faults.fault_schedule(48, 30, 5, victims=(1, 2)) == [faults.Fault(1, 15, 20)]  # 45 + 5 > 48: not injected


def ev(event: str, t: float, step: int, **extra) -> dict:
    return {"event": event, "t": t, "step": step, **extra}


def test_torchft_commits_a_groups_steps_at_its_next_averaging():
    """H = 4. Group 0 averages at 4, 8, 12; group 1 dies after 4 (its steps 5..7 are lost), heals at 8 and averages
    at 12: 12 + 4 + 4 group-steps by t = 12; by t = 9, 8 + 4."""
    logs = {"group0": [ev("begin", 0, 0), ev("sync", 4, 4), ev("sync", 8, 8), ev("sync", 12, 12)],
            "group1": [ev("begin", 0, 0), ev("sync", 4, 4), ev("begin", 10, 8), ev("sync", 12, 12)]}  # fmt: skip
    assert goodput.committed_torchft(logs, end=12) == 20
    assert goodput.committed_torchft(logs, end=9) == 12


def test_torchft_loses_the_steps_a_full_restart_rolls_back():
    """H = 4, a checkpoint at 8: group 0 averages at 4, 8, 12, every launch is killed, and it resumes from 8 and
    averages at 12 again: 12 - 4 (rolled back) + 4 group-steps by t = 30; a heal ahead of its last averaging loses
    none."""
    logs = {"group0": [ev("begin", 0, 0), ev("sync", 4, 4), ev("sync", 8, 8), ev("sync", 12, 12),
                       ev("begin", 20, 8), ev("sync", 25, 12)]}  # fmt: skip
    assert goodput.committed_torchft(logs, end=19) == 12
    assert goodput.committed_torchft(logs, end=21) == 8
    assert goodput.committed_torchft(logs, end=30) == 12
    healed = {"group1": [ev("begin", 0, 0), ev("sync", 4, 4), ev("begin", 10, 8), ev("sync", 12, 12)]}
    assert goodput.committed_torchft(healed, end=12) == 8


def test_a_full_restart_from_a_checkpoint_between_averagings_keeps_the_steps_it_holds():
    """H = 4, a checkpoint every 2 steps: group 0 averages at 4 and 8, saves at 10, is killed at step 11; it resumes
    from 10 (its own checkpoint) and averages at 12: 12 group-steps, none lost. Resumed from 6 instead, it loses the
    2 steps behind its averaging at 8."""
    before = [ev("begin", 0, 0), ev("sync", 4, 4), ev("save", 4.1, 4), ev("save", 6, 6), ev("sync", 8, 8),
              ev("save", 8.1, 8), ev("save", 10, 10)]  # fmt: skip
    ahead = {"group0": [*before, ev("begin", 30, 10), ev("sync", 33, 12)]}
    assert goodput.committed_torchft(ahead, end=40) == 12
    behind = {"group0": [*before, ev("begin", 30, 6), ev("sync", 37, 12)]}
    assert goodput.committed_torchft(behind, end=40) == 8 - 2 + 6


def test_a_full_restarts_loss_is_split_into_the_studys_the_start_ups_and_the_rollbacks():
    """2 groups, R = 10 s, stagger 5 s, killed at t = 20 (t0 = 0), a group's pace 2 steps/s: group 0 (averaged at 8,
    resumed at 8) begins 12 s after its start at 30; group 1 (averaged at 8, resumed at 4) 14 s after 35."""
    cfg = goodput.GoodputConfig(groups=2, restart_s=10.0, stagger_s=5.0)
    run = goodput.Run("torchft-async4", 60.0, "full", t0=0.0, faults=[{"group": -1, "kill_s": 20.0, "restart_s": 30.0}],
                      events={"group0": [ev("sync", 10, 8), ev("begin", 42, 8)],
                              "group1": [ev("sync", 10, 8), ev("sync", 21, 16), ev("begin", 49, 4)]})  # fmt: skip
    (loss,) = goodput.full_restart_losses(run, cfg, steps_per_s=2.0)
    assert loss == {"imposed_s": (10 + 15) / 2, "startup_s": (12 + 14) / 2, "rollback_s": (0 + 4 / 2) / 2}

    def row(path: str, startup: float, rollback: float) -> dict:
        return {"path": path, "fault": "full", "lost_startup_s": {"median": startup},
                "lost_rollback_s": {"median": rollback}}  # fmt: skip

    cut, both = goodput.restart_share_targets([row("torchft", 20.0, 10.0), row("torchft-async4", 12.0, 3.0),
                                                row("torchft-forked-async4", 12.0, 3.5)])  # fmt: skip
    assert (cut["measured"], cut["met"]) == (15.0, True) and "≤ half torchft's (15.0 s)" in cut["target"]
    assert (both["measured"], both["met"]) == (15.5, False) and both["target"].startswith("torchft-forked-async4")
    assert goodput.restart_share_targets([row("torchft-async4", 12.0, 3.0)]) == []


def test_ended_models_compares_each_rank_with_the_same_rank_of_the_other_groups():
    """torchft: a log per group, in-group ranks; mesh: one log, global ranks (2 per group). A group counts once all
    its ranks ended."""
    torchft = goodput.Run("torchft", None, events={
        "group0": [ev("end", 9, 16, rank=0, sha256="a"), ev("end", 9, 16, rank=1, sha256="b")],
        "group1": [ev("end", 9, 16, rank=1, sha256="b"), ev("end", 9, 16, rank=0, sha256="a")],
        "group2": [ev("end", 9, 16, rank=0, sha256="a")]})  # fmt: skip
    assert goodput.ended_models(torchft, ranks_per_group=2) == {0: ("a", "b"), 1: ("a", "b")}
    mesh = goodput.Run("mesh", None, events={"job": [ev("end", 9, 16, rank=r, sha256="ab"[r % 2] + str(r // 3))
                                                     for r in range(4)]})  # fmt: skip
    models = goodput.ended_models(mesh, ranks_per_group=2)
    assert models == {0: ("a0", "b0"), 1: ("a0", "b1")}
    row = {"ended": [2, 3], "models": [1, 1]}
    assert not goodput.ended_identical(row, groups=3)
    assert goodput.identical_cell(row, groups=3) == "**no**: 2 of 3 ended, 1 model(s); 3 of 3 ended, 1 model(s)"
    assert goodput.identical_cell({"ended": [3], "models": [1]}, groups=3) == "yes"


def test_a_run_is_stopped_only_once_every_killed_launch_trains_again(tmp_path):
    """Group 1 killed at 4 s (t0 = 100): not back until its log has a begin after 104; a full restart (-1) waits
    for every group."""
    (tmp_path / "group0.jsonl").write_text(json.dumps(ev("begin", 100, 0)) + "\n")
    (tmp_path / "group1.jsonl").write_text(json.dumps(ev("begin", 100, 0)) + "\n")
    run = goodput.Run("torchft", 8.0, "launch", t0=100.0, faults=[{"group": 1, "kill_s": 4, "restart_s": 6}])
    assert not goodput.back_in_training(run, tmp_path)
    progress.append(tmp_path / "group1.jsonl", ev("begin", 120, 16))
    assert goodput.back_in_training(run, tmp_path)
    run.faults.append({"group": -1, "kill_s": 30, "restart_s": 32})
    progress.append(tmp_path / "group1.jsonl", ev("begin", 140, 16))
    assert not goodput.back_in_training(run, tmp_path)  # group 0 has not begun since 130
    progress.append(tmp_path / "group0.jsonl", ev("begin", 145, 16))
    assert goodput.back_in_training(run, tmp_path)


def test_mesh_rolls_back_to_the_newest_checkpoint_at_a_kill():
    """K = 8, H = 4, 4 groups: averaged to step 12, killed at t = 13 (checkpoint 8 complete): 4 × 8 until the
    restarted job averages again at step 12 (t = 30), 4 × 12 from there."""
    events = [ev("begin", 0, 0), ev("sync", 4, 4), ev("sync", 8, 8), ev("save", 8.5, 8), ev("sync", 12, 12),
              ev("begin", 25, 8), ev("sync", 30, 12)]  # fmt: skip
    assert goodput.committed_mesh(events, kills=[13], end=12.5, groups=4) == 48
    assert goodput.committed_mesh(events, kills=[13], end=29, groups=4) == 32
    assert goodput.committed_mesh(events, kills=[13], end=31, groups=4) == 48
    assert goodput.committed_mesh(events[:3] + events[4:], kills=[13], end=20, groups=4) == 0  # no save: from scratch


def test_longest_gap_reaches_into_the_window_and_stays_open_at_its_end():
    assert goodput.longest_gap([0, 4, 8, 20, 24], start=10, stop=30) == 12  # 8 → 20 spans the kill at 10
    assert goodput.longest_gap([0, 4, 8], start=10, stop=30) == 22  # nothing after the kill: open to the stop
    assert goodput.longest_gap([12], start=10, stop=30) is None  # nothing before the kill


def test_survivors_stall_leaves_out_groups_still_down_and_back_counts_from_the_restart():
    """Group 1 killed at 10 s, restarted at 15, back at its first averaging at 40; group 2 killed at 20: group 1 is
    no survivor of that fault (down until 40), group 0 and 3 are."""
    run = goodput.Run("torchft", 10.0, t0=0.0, faults=[{"group": 1, "kill_s": 10, "restart_s": 15},
                                                         {"group": 2, "kill_s": 20, "restart_s": 25}])  # fmt: skip
    syncs = {0: [4, 8, 12, 16, 30, 34, 38, 42], 1: [4, 8, 40, 44], 2: [4, 8, 12, 16, 44], 3: [4, 8, 12, 16, 32, 36]}
    run.events = {f"group{g}": [ev("sync", t, 0) for t in times] for g, times in syncs.items()}
    figures = goodput.fault_figures(run, goodput.GoodputConfig(run_s=50.0, intervals_s=(10.0,)))
    assert [f["back_s"] for f in figures] == [25, 19]  # 40 - 15; group 2's first averaging after 25 is at 44
    assert figures[1]["stall_s"] == 16  # group 3: 16 → 32 (group 0's 14, group 1 left out)
    assert figures[0]["stall_s"] == 4  # up to the next kill, at 20: 16 → 20 at most
    assert figures[1]["survivors_interval_s"] == 4  # group 0 and 3 between the kill at 20 and group 2's return at 44


def test_goodput_study_refuses_intervals_outside_the_run():
    with pytest.raises(ValueError, match=re.escape("every interval must lie between R=10.0 s and the run, 240.0 s")):
        goodput.GoodputConfig(intervals_s=(300.0,)).validate()
    with pytest.raises(ValueError, match="must be a multiple of H=8"):
        goodput.GoodputConfig(save_steps=12).validate()
    with pytest.raises(ValueError, match="--faults node: the kinds are worker, launch, full"):
        goodput.GoodputConfig(faults=("node",)).validate()


def test_goodput_study_with_fewer_groups_kills_each_of_the_others_in_turn():
    cfg = goodput.config_from_args(goodput.make_parser().parse_args(["--quick", "--groups", "2"]))
    assert (cfg.groups, cfg.victims, cfg.ranks_per_group, cfg.run_s) == (2, (1,), 1, 60.0)
    assert goodput.config_from_args(goodput.make_parser().parse_args([])).victims == (1, 2, 3)


def test_progress_log_drops_a_line_cut_short(tmp_path):
    log = tmp_path / "group0.jsonl"
    progress.append(log, ev("begin", 1.0, 0))
    with open(log, "a") as f:
        f.write('{"event": "sync", "t": 2.')  # SIGKILL mid-line
    assert progress.read(log) == [ev("begin", 1.0, 0)] and progress.read(tmp_path / "none.jsonl") == []


# ---- layout_change.py: a checkpoint resumed on other layouts, the loss bump against the unchanged layout ----

LC_CONFIG = {"source": "4x2", "layouts": ["4x2", "2x2", "2x4s2"], "model_size": "micro", "batch_size": 4,
             "block_size": 128, "steps": 8, "save_step": 4, "sync_steps": 2, "learning_rate": 2e-3, "eval_samples": 8,
             "max_train_lines": None, "seed": 0, "timeout_s": 60.0}  # fmt: skip


def lc_run(layout: str, losses: dict[int, float], evals: dict[int, float], line: str | None = None) -> dict:
    """What `layout_change.train` keeps of a run; a resume's log history holds the source's losses up to S too."""
    shape = lc.Layout.parse(layout)
    return {"layout": layout, "label": shape.label, "world": shape.world, "groups": shape.groups,
            "group_size": shape.group_size, "shard_size": shape.shard_size or shape.group_size,
            "world_batch_samples": shape.world * 4, "wall_s": 10.0, "start_line": line,
            "train_loss": sorted(losses.items()), "evals": sorted(evals.items())}  # fmt: skip


def lc_runs() -> dict:
    """Losses are binary fractions, so the means below are exact. Every resume starts from the source's step-4 model
    (eval loss 6 at step 4); 2 × 2 bumps by +0.5 over steps 5–6, FL+HSDP by +0.25."""
    before = {1: 8.0, 2: 7.5, 3: 7.0, 4: 6.5}
    source = lc_run("4x2", {**before, 5: 6.0, 6: 5.5, 7: 5.0, 8: 4.5}, {0: 9.0, 2: 7.0, 4: 6.0, 6: 5.5, 8: 5.0})
    unchanged = lc_run("4x2", {**before, 5: 6.0, 6: 5.5, 7: 5.0, 8: 4.5}, {4: 6.0, 6: 5.5, 8: 5.0})
    line = "hf_fedshard: resuming step 4 of FL+FSDP, 4 groups × 2 ranks on FL+FSDP, 2 groups × 2 ranks: the model is"
    half = lc_run("2x2", {**before, 5: 6.5, 6: 6.0, 7: 5.5, 8: 5.0}, {4: 6.0, 6: 6.0, 8: 5.5}, line)
    hsdp = lc_run("2x4s2", {**before, 5: 6.25, 6: 5.75, 7: 5.0, 8: 4.5}, {4: 6.0, 6: 5.75, 8: 5.0})
    return {"source": source, "resumes": [unchanged, half, hsdp]}


def test_layout_change_layouts_parse_and_map_to_arguments():
    hsdp = lc.Layout.parse("2x4s2")
    assert (hsdp.world, hsdp.key, hsdp.label) == (8, "2x4s2", "FL+HSDP 2 × (2 × 2)")
    assert hsdp.args() == ["--fed_group_size", "4", "--fed_shard_size", "2"]
    assert lc.Layout.parse("3x2").args() == ["--fed_group_size", "2"] and lc.Layout.parse("2x4s4").key == "2x4"
    for spec in ("4by2", "1x8", "2x4s3"):
        with pytest.raises(ValueError, match=re.escape(f"layout {spec!r}")):
            lc.Layout.parse(spec)
    cfg = lc.config_from_args(lc.make_parser().parse_args(["--quick"]))
    assert (cfg.model_size, cfg.steps, cfg.save_step, cfg.layouts) == ("micro", 32, 16, lc.QUICK_LAYOUTS)
    args = lc.run_args(cfg, lc.Layout.parse("3x2"), Path("/ckpt/checkpoint-16"))
    assert args[args.index("--resume_from_checkpoint") + 1] == "/ckpt/checkpoint-16"
    assert args[args.index("--per_device_eval_batch_size") + 1] == "16"  # 96 held-out blocks over 6 ranks
    assert args[args.index("--save_strategy") + 1] == "no" and args[args.index("--max_steps") + 1] == "32"
    source = lc.run_args(cfg, lc.Layout.parse("4x2"), None)
    assert source[source.index("--save_steps") + 1] == "16" and "--resume_from_checkpoint" not in source


def test_layout_change_refuses_a_study_it_could_not_measure():
    with pytest.raises(ValueError, match="must hold the source's own layout 4x2"):
        lc.LayoutChangeConfig(layouts=("2x2", "3x2")).validate()
    with pytest.raises(ValueError, match="must be multiples of H=8"):
        lc.LayoutChangeConfig(steps=96, save_step=44).validate()
    worlds = re.escape("--eval-samples=64 must be a multiple of every world size [4, 6, 8]")
    with pytest.raises(ValueError, match=worlds):
        lc.LayoutChangeConfig(eval_samples=64).validate()


def test_layout_change_measures_the_bump_against_the_unchanged_resume(tmp_path):
    runs = lc_runs()
    summary = lc.summarize(runs["source"], runs["resumes"], LC_CONFIG)
    rows = {(r["layout"], r["role"]): r for r in summary["rows"]}
    assert summary["reference"] == "4x2" and summary["source_eval_ppl_at_save"] == math.exp(6.0)
    half, unchanged = rows[("2x2", "resume")], rows[("4x2", "resume")]
    assert (unchanged["first_window_train_loss"], unchanged["loss_bump"]) == (5.75, 0.0)
    assert (half["first_window_train_loss"], half["loss_bump"]) == (6.25, 0.5)
    assert rows[("2x4s2", "resume")]["loss_bump"] == 0.25 and rows[("2x4s2", "resume")]["group_batch_samples"] == 16
    assert rows[("4x2", "source, not interrupted")]["loss_bump"] == 0.0  # the resume was exact
    assert half["eval_ppl_at_resume"] == math.exp(6.0) and half["eval_ppl_after_window"] == math.exp(6.0)
    assert half["final_ppl_vs_unchanged"] == pytest.approx(math.exp(0.5))
    assert half["tokens_read_final"] == (4 * 32 + 4 * 16) * 128  # the source's batch to S, then half of it
    assert unchanged["tokens_read_final"] == 8 * 32 * 128 and half["world_batch_samples"] == 16
    scratch = {**runs["resumes"][1], "evals": [[0, 9.0], *runs["resumes"][1]["evals"]]}  # trained from step 0
    with pytest.raises(ValueError, match="the resume on 2x2 evaluated first at step 0, not at 4"):
        lc.summarize(runs["source"], [runs["resumes"][0], scratch], LC_CONFIG)
    with pytest.raises(ValueError, match="2x2: 1 train losses logged in steps 5–6; expected one per step"):
        lc.window_loss({**runs["resumes"][1], "train_loss": [[5, 6.5]]}, 5, 6)

    results = {"config": LC_CONFIG, "runs": runs, "summary": summary}
    table = lc.markdown(results)
    assert "| 2 × 2 | 4 | 16 | 8 | 6.250 | +0.500 | 403.4 | 403.4 | 244.7 | 1.649 | 0.02 | 10 |" in table
    assert "| 4 × 2 (unchanged) | 8 | 32 | 8 | 5.750 | +0.000 |" in table
    assert "| source (4 × 2), not interrupted | 8 | 32 | 8 | 5.750 | +0.000 |" in table
    assert "- 2 × 2: `hf_fedshard: resuming step 4 of FL+FSDP, 4 groups × 2 ranks on" in table
    assert "- FL+HSDP 2 × (2 × 2): `no start-up line found in its output`" in table
    assert lc.plot(results, tmp_path).read_bytes()[:4] == b"\x89PNG"


# ---- tiers.py: the figures of one benchmark run ----


def test_window_throughput_counts_each_window_with_its_sync():
    # steps 1-4 take 1 s each, but steps 2 and 4 end with a 1 s sync: windows of H = 2 take 3 s.
    clock = [1, 3, 4, 6]
    steps = [{"train_clock_s": c} for c in clock]
    assert window_throughputs(steps, tokens_per_step=300, window=2, warmup=0) == [200, 200]
    assert window_throughputs(steps, tokens_per_step=300, window=2, warmup=2) == [200]


def test_perplexity_at_equal_time_takes_the_last_eval_within_it():
    evals = [{"step": 0, "train_clock_s": 0.0, "eval_loss": 5.0}, {"step": 4, "train_clock_s": 10.0, "eval_loss": 4.0}]
    assert perplexity_at(evals, 9.9)["step"] == 0
    assert perplexity_at(evals, 10.0) == {"step": 4, "train_clock_s": 10.0, "eval_perplexity": math.exp(4.0)}


def test_variants_are_their_base_method_plus_settings():
    cfg = BenchConfig(nodes=4, ranks_per_node=2)
    assert method_args("FL+FSDP int8", cfg) == [*method_args("FL+FSDP", cfg), "--fed_sync_dtype", "int8"]
    assert method_args("FL+HSDP", cfg)[-2:] == ["--fed_split_exchange", "false"]  # the unsplit row, as before
    assert method_args("FL+HSDP split", cfg)[-2:] == ["--fed_split_exchange", "true"]


def test_variant_targets_compare_bytes_with_fp32_and_the_model():
    def method(inter: float, predicted: float, ppl: float) -> dict:
        return {"inter_bytes_per_step": inter, "predicted": {"inter_bytes_per_step": predicted},
                "final_eval_perplexity": ppl}  # fmt: skip

    methods = {"FL+FSDP": method(400, 400, 100.0), "FL+FSDP int8": method(103, 101.5, 103.0)}
    rows = {label: (value, bound, sense) for label, value, bound, sense in variant_targets(methods)}
    assert rows["FL+FSDP int8 inter-node bytes ÷ fp32 FL+FSDP's (≈ 0.25)"] == (103 / 400, 0.25, "≈")
    assert rows["FL+FSDP int8 eval ppl at equal tokens ≤ 1.02× fp32 FL+FSDP"] == (1.03, 1.02, "≤")
    value, bound, _ = rows["FL+FSDP int8 inter-node bytes within 5% of the model (measured/predicted - 1)"]
    assert value == pytest.approx(103 / 101.5 - 1) and bound == 0.05


def test_goodput_targets_hold_each_torchft_path_to_its_own_runs_and_its_tokens_to_the_blocking_ones():
    """Two torchft paths: each one's restart target uses its own start-up and averaging interval; without failures the
    overlapped path must commit at least the blocking path's tokens/s (1,100 ≥ 1,000: met; 900: not)."""

    def row(path, fault, tokens, startup, back=None):
        one = lambda x: None if x is None else {"median": x, "min": x, "max": x}  # noqa: E731
        return {"path": path, "fault": fault, "interval_s": None if fault is None else 120.0, "ended": [4],
                "models": [1], "tokens_per_s": one(tokens), "goodput": one(None if fault is None else 0.95),
                "averaging_interval_s": one(4.0), "startup_s": one(startup), "back_s": one(back),
                "max_stall_s": one(5.0)}  # fmt: skip

    cfg = goodput.GoodputConfig(paths=("torchft", "torchft-overlap-int8"), faults=("worker",))
    for overlapped, met in ((1100.0, True), (900.0, False)):
        rows = [row("torchft", None, 1000.0, 30.0), row("torchft-overlap-int8", None, overlapped, 20.0),
                row("torchft", "worker", 950.0, 30.0, back=33.0), row("torchft-overlap-int8", "worker", 990.0, 20.0,
                back=25.0)]  # fmt: skip
        targets = {t["target"]: t["met"] for t in goodput.targets(rows, cfg)}
        assert targets["torchft-overlap-int8, no faults: tokens/s ≥ blocking torchft's (1000)"] is met
        assert targets["torchft, worker faults every 120 s: restarted group back ≤ start-up + one averaging (30.0 + "
                       "4.0 s)"]  # fmt: skip
        assert not targets["torchft-overlap-int8, worker faults every 120 s: restarted group back ≤ start-up + one "
                           "averaging (20.0 + 4.0 s)"]  # 25 s: its own start-up, not the blocking path's  # fmt: skip
    with pytest.raises(ValueError, match="--paths torchft torchft: name each path once"):
        goodput.GoodputConfig(paths=("torchft", "torchft")).validate()
    alone = goodput.targets([r for r in rows if r["path"] != "torchft"], replace(cfg, paths=("torchft-overlap-int8",)))
    assert alone and not any("tokens/s" in t["target"] for t in alone)  # no blocking path to compare with
    forked = [row("torchft-forked", None, 1000.0, 30.0), row("torchft-forked", "worker", 990.0, 30.0, back=9.5)]
    targets = {t["target"]: t for t in goodput.targets(forked, replace(cfg, paths=("torchft-forked",)))}
    worker = targets["torchft-forked, worker faults every 120 s: restarted worker back ≤ 9 s"]
    assert (worker["measured"], worker["met"]) == (9.5, False)  # its own target, beside start-up + one averaging
    assert goodput.elastic("torchft-overlap-int8") and not goodput.elastic("mesh")


def test_checkpoint_overhead_takes_the_slowest_rank_per_save_and_pairs_the_modes_per_repetition():
    def run(mode: str, repeat: int, saves: list[list[float]], writing: bool) -> dict:
        steps = [{"seconds": 9.0, "writing": False}, *({"seconds": 0.5, "writing": writing} for _ in range(2)),
                 {"seconds": 0.25, "writing": False}]  # fmt: skip
        first = "previous write" if mode == "background" else "writes and barriers"  # half, then a quarter
        ranks = [{"save_seconds": s, "waited_seconds": 0.0, "steps": steps, "peak_rss_bytes": 2e9 + 1e8 * (mode ==
                  "background"), "staged_bytes": 5e7, "load_seconds": 0.1,
                  "stall_parts": [{first: x / 2, "host copies": x / 4} for x in s]} for s in saves]  # fmt: skip
        return {"model": "tiny", "mode": mode, "repeat": repeat, "tokens_per_step": 1000, "ranks": ranks,
                "total_bytes": 7e7, "parameters": 2.8e6}  # fmt: skip

    runs = [
        run("synchronous", 0, [[1.0, 2.0], [1.5, 1.0]], False),
        run("background", 0, [[0.1, 0.2], [0.3, 0.1]], True),
        run("synchronous", 1, [[2.0, 2.0], [1.0, 1.0]], False),
        run("background", 1, [[0.1, 0.1], [0.1, 0.1]], True),
    ]
    summary = co.summarize(runs, {"models": ["tiny"]})["tiny"]
    # slowest rank per save, then the mean: 1.75 s and 0.25 s in repetition 0; 2.0 s and 0.1 s in repetition 1
    assert summary["modes"]["synchronous"]["stall_s"] == {"median": 1.875, "min": 1.75, "max": 2.0, "n": 2}
    assert summary["stall_ratio"] == {"median": (0.25 / 1.75 + 0.05) / 2, "min": 0.05, "max": 0.25 / 1.75, "n": 2}
    assert summary["modes"]["background"]["tokens_s_writing"]["median"] == 2000.0  # the first step is warm-up
    assert summary["modes"]["background"]["tokens_s_quiet"]["median"] == 4000.0
    assert "tokens_s_writing" not in summary["modes"]["synchronous"]  # no write runs between its steps
    assert summary["added_peak_rss_bytes"]["median"] == 1e8 and summary["target"]["met"] is True  # 0.096 ≤ 0.10
    # the parts of each save's slowest rank (0.3 s, 0.2 s; then 0.1 s, 0.1 s), the rest "other"
    parts = summary["modes"]["background"]["parts"]
    assert list(parts) == ["previous write", "host copies", "other"]
    assert (parts["previous write"]["min"], parts["previous write"]["max"]) == pytest.approx((0.05, 0.125))
    assert (parts["other"]["min"], parts["other"]["max"]) == pytest.approx((0.025, 0.0625))
    table = co.markdown({"config": {"save_steps": 4, "max_steps": 24, "repeats": 2}, "summary": {"tiny": summary}})
    # after the first save: 0.2 s ÷ 2.0 s, 0.1 s ÷ 2.0 s
    assert ("| tiny | background | 0.175 (0.100–0.250) | 0.096 (0.050–0.143) | 0.150 (0.100–0.200) | 0.075 "
            "(0.050–0.100) | 2000 | 4000 | 2100 | 50.0 |") in table  # fmt: skip
    assert "| tiny | synchronous |  |  | 0.469 (0.438–0.500) |  | 0.938 (0.875–1.000) | 0.469 (0.438–0.500) |" in table

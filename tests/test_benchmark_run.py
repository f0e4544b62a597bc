"""The benchmark end to end on a tiny run (2 nodes × 1 rank, a few steps), and its figures' definitions."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from benchmarks.harness.methods import BenchConfig, method_args
from benchmarks.harness.netns import list_namespaces
from benchmarks.harness.report import perplexity_at, variant_targets, window_throughputs

from .launch import REPO

METHOD_FIELDS = {
    "layout", "tokens_per_s", "window_tokens_per_s", "s_per_step", "speedup_vs_fsdp", "fraction_of_ideal",
    "inter_bytes_per_step", "inter_bytes_per_node", "predicted", "bytes_measured_over_predicted", "averaging",
    "final_eval_perplexity", "eval_at_equal_time", "evals", "train_clock_s", "step_s",
}  # fmt: skip


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


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="network namespaces need root")
def test_tiny_benchmark_writes_every_figure(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "benchmarks/tiers.py", "--nodes", "2", "--ranks-per-node", "1",
           "--methods", "FSDP", "FL+FSDP", "ideal", "LocalSGD", "--steps", "4", "--sync-steps", "2",
           "--eval-steps", "4", "--model-size", "micro", "--max-train-lines", "3000", "--timeout-s", "240",
           "--out", str(out), "--work", str(tmp_path), "--data-cache", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out_text, _ = proc.communicate(timeout=840)
    assert proc.returncode == 0, out_text[-6000:]
    assert not [name for name in list_namespaces() if name.startswith(f"fsb{proc.pid}")]  # this run's, not another's

    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"FSDP", "FL+FSDP", "ideal", "LocalSGD"}
    for name, method in results["methods"].items():
        assert method.keys() >= METHOD_FIELDS, name
        assert method["tokens_per_s"] > 0 and method["final_eval_perplexity"] > 1
        assert len(method["inter_bytes_per_node"]) == 2
    assert results["link"]["goodput_mbit"] > 0
    assert results["machine"]["before"]["loadavg_1_5_15"]
    assert results["methods"]["FSDP"]["speedup_vs_fsdp"] == 1.0
    assert results["methods"]["ideal"]["fraction_of_ideal"] == 1.0
    for name in ("FSDP", "FL+FSDP", "LocalSGD"):  # the cost model predicts the measured inter-node bytes
        assert results["methods"][name]["bytes_measured_over_predicted"] == pytest.approx(1.0, abs=0.15), name
    assert [a["step"] for a in results["methods"]["FL+FSDP"]["averaging"]] == [2, 4]
    assert {t["target"].split()[0] for t in results["targets"]} >= {"FL+FSDP"}
    assert "| FL+FSDP |" in (out / "results.md").read_text()
    for png in ("throughput.png", "perplexity_vs_time.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"

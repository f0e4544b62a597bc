"""Resuming a federated checkpoint on another layout, with real launches (torchrun, gloo).

A run of 2 groups × 2 ranks with the Nesterov outer optimizer, AdamW and the sparse payload (topk, error feedback)
writes checkpoint-2 (between averagings) and checkpoint-4 (on one); other layouts resume them, and what their
training starts from is pinned to the rule: the global model (group 0's, or the plain mean of the groups' models in
fp32), the anchor and outer momentum, the mean of the groups' AdamW moments and of their error-feedback residuals,
the LR schedule's step, and the samples each rank reads next. The data
arithmetic and the outer state by parameter are tests/unit/test_reshard.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ..launch import SCRIPTS, SGD, torchrun
from .test_reliability import ADAMW, read_dcp

SOURCE = ["--fed_group_size", "2", "--fed_sync_steps", "4", "--max_steps", "6", "--save_strategy", "steps",
          "--save_steps", "2", "--fed_outer_optimizer", "nesterov", *ADAMW, "--fed_sync_dtype", "topk",
          "--fed_sync_density", "0.05", "--fed_sync_bits", "4", "--fed_sync_chunk", "64"]  # fmt: skip
BATCH = 2  # per device (tests.launch.SGD)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, list[int]]:
    """The 2 × 2 run, and the order its world read the samples in (the epoch's permutation, steps 1–6)."""
    out = tmp_path_factory.mktemp("source")
    runs = run(4, out, SOURCE)
    return out, world_order([r["seen"] for r in runs])


def run(nproc: int, out: Path, args: list) -> list[dict]:
    result = torchrun(nproc, SCRIPTS / "train_tiny.py", ["--output_dir", out, "--dump_dir", out / "dump", *SGD, *args])
    assert result.returncode == 0, result.stdout[-6000:]
    runs = [torch.load(out / "dump" / f"rank{r}.pt", weights_only=False) for r in range(nproc)]
    runs[0]["stdout"] = result.stdout
    return runs


def world_order(seen: list[list[int]]) -> list[int]:
    """The samples of the world's steps in order: rank r's i-th batch is the world's batch i·W + r (Accelerate's
    BatchSamplerShard), each of BATCH samples."""
    world = len(seen)
    batches = {(i * world + r): seen[r][i * BATCH : (i + 1) * BATCH] for r in range(world) for i in
               range(len(seen[r]) // BATCH)}  # fmt: skip
    return [sample for index in sorted(batches) for sample in batches[index]]


def mean_of_groups(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The rule: fp32 sums in group order, ÷ the number of groups."""
    total = tensors[0].float().clone()
    for t in tensors[1:]:
        total.add_(t.float())
    return total.div_(len(tensors))


def assert_starts_from(resumed: dict, checkpoint: Path, tmp_path: Path, model_groups: list[int]) -> None:
    """The model is the mean of ``model_groups``' models (one group: its model, bit for bit); the anchor and outer
    momentum are the checkpoint's (no momentum before the first outer step); the AdamW moments the mean of both
    groups', their step count the same."""
    models = [read_dcp(checkpoint / f"fed_group{g}" / "model", tmp_path)["model"] for g in model_groups]
    outer = read_dcp(checkpoint / "fed_outer", tmp_path)
    optimizers = [read_dcp(checkpoint / f"fed_group{g}" / "optimizer", tmp_path)["optimizer"] for g in (0, 1)]
    assert sorted(resumed["momentum"]) == sorted(outer.get("momentum", {}))
    residuals = [read_dcp(checkpoint / f"fed_group{g}" / "feedback", tmp_path)["feedback"] for g in (0, 1)]
    assert sorted(resumed["feedback"]) == sorted(resumed["anchor"])
    for name, value in resumed["params"].items():
        expected = models[0][name] if len(models) == 1 else mean_of_groups([m[name] for m in models])
        assert torch.equal(value, expected), name
        assert torch.equal(resumed["anchor"][name], outer["anchor"][name]), name
        if resumed["momentum"]:
            assert torch.equal(resumed["momentum"][name], outer["momentum"][name]), name
        for moment in ("exp_avg", "exp_avg_sq"):
            per_group = [o["state"][name][moment] for o in optimizers]
            assert not torch.equal(*per_group)  # the groups' moments differ: the mean is a real one
            assert torch.equal(resumed["moments"][name][moment], mean_of_groups(per_group)), (name, moment)
        assert resumed["inner_steps"][name] == float(optimizers[0]["state"][name]["step"])
        assert torch.equal(resumed["feedback"][name], mean_of_groups([r[name] for r in residuals])), name


@pytest.mark.timeout(900)
def test_between_averagings_resumes_on_three_groups_of_one(source, tmp_path):
    """checkpoint-2 (groups drifted since step 0's averaging) on 3 ranks × 1: the plain mean of the 2 groups' models;
    the world read 16 samples, 3 steps of 6 cover them, so the new run reads the order's samples 18–41."""
    out, order = source
    args = ["--resume_from_checkpoint", out / "checkpoint-2", "--fed_group_size", "1", "--record_resume", "true"]
    runs = run(3, tmp_path, [*SOURCE, *args])
    assert [r["resumed"]["step"] for r in runs] == [2, 2, 2] and runs[0]["resumed"]["last_epoch"] == 2
    for r in runs:
        assert_starts_from(r["resumed"], out / "checkpoint-2", tmp_path, model_groups=[0, 1])
    assert sorted(world_order([r["seen"] for r in runs])) == sorted(order[18:42])
    line = re.search(r"hf_fedshard: resuming step 2 of (.*)", runs[0]["stdout"]).group(1)
    assert line.startswith(
        "FL+FSDP, 2 groups × 2 ranks on FL+FSDP, 3 groups × 1 ranks: the model is the mean of the 2 groups' "
        "(the checkpoint is between averagings); the anchor and outer momentum are the checkpoint's, resharded;"
    ), line
    assert "world batch goes from 8 to 6 samples per step; epoch 0 resumes after its first 16 samples (3 steps" in line
    assert "2 samples in between are not read in this epoch" in line
    record = json.loads((tmp_path / "checkpoint-4" / "fed_layout.json").read_text())  # written on 3 × 1
    assert (record["epoch"], record["epoch_samples"]) == (0, 30)  # 18 covered at the resume + 2 steps of 6
    for r in runs[1:]:  # the run ends on one global model
        assert all(torch.equal(v, runs[0]["full_params"][n]) for n, v in r["full_params"].items())
    assert runs[0]["fed_counters"]["syncs"] == 3  # step 0's, step 4's and the end's


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("nproc", "layout"), [(2, ["--fed_group_size", "1"]),
                                               (4, ["--fed_group_size", "2", "--fed_shard_size", "1"])])  # fmt: skip
def test_after_an_averaging_resumes_on_two_groups_and_on_fl_hsdp(source, tmp_path, nproc, layout):
    """checkpoint-4 (every group held the global model) on 2 × 1 and on FL+HSDP (2 groups × 2 replicas): group 0's
    model bit for bit; the 32 samples read are 32 / (2·nproc) whole steps, so nothing is skipped."""
    out, order = source
    args = ["--resume_from_checkpoint", out / "checkpoint-4", *layout, "--record_resume", "true"]
    runs = run(nproc, tmp_path, [*SOURCE, *args])
    residuals = [read_dcp(out / "checkpoint-4" / f"fed_group{g}" / "feedback", tmp_path)["feedback"] for g in (0, 1)]
    assert all(not torch.equal(*(r[n] for r in residuals)) for n in residuals[0])  # each kept what it did not send
    for r in runs:
        assert r["resumed"]["momentum"], "the outer step at 4 started Nesterov's momentum"
        assert_starts_from(r["resumed"], out / "checkpoint-4", tmp_path, model_groups=[0])
    assert sorted(world_order([r["seen"] for r in runs])) == sorted(order[32 : 32 + 2 * BATCH * nproc])
    assert "the model is group 0's (every group held it" in runs[0]["stdout"]


@pytest.mark.timeout(300)
def test_a_layout_change_without_max_steps_is_refused_on_every_rank(source, tmp_path):
    """With epochs the schedule's length would follow the new world batch: refused before training, every rank."""
    args = [*SOURCE, "--resume_from_checkpoint", source[0] / "checkpoint-2", "--fed_group_size", "1",
            "--max_steps", "-1", "--num_train_epochs", "1"]  # fmt: skip
    result = torchrun(2, SCRIPTS / "train_tiny.py", ["--output_dir", tmp_path, "--dump_dir", tmp_path, *SGD, *args])
    assert result.returncode != 0
    line = (
        "was written on FL+FSDP, 2 groups × 2 ranks and this run is FL+FSDP, 2 groups × 1 ranks: a layout change "
        "keeps counting optimizer steps, so it needs --max_steps"
    )
    assert result.stdout.count(line) == 2, result.stdout[-3000:]

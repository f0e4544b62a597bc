"""Per-group evaluation (`fed_eval_per_group`) on 2 groups × 2 ranks: each group's own model,
before averaging, on the whole eval set."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from ..launch import SCRIPTS, train_tiny


def _tiny_script():
    spec = importlib.util.spec_from_file_location("train_tiny", SCRIPTS / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    spec.loader.exec_module(module)
    return module


ARGS = ["--fed_sync_steps", "2", "--num_samples", "32", "--num_train_epochs", "2", "--eval_strategy", "epoch",
        "--fed_eval_per_group", "true", "--record_eval_params", "true", "--num_eval_samples", "25"]  # fmt: skip


def own_loss(script, params: dict, samples: int = 25) -> float:
    """The loss of a model holding ``params`` on the whole eval set, computed here in one process."""
    data = script.TokenDataset(samples)
    input_ids = torch.stack([data[i]["input_ids"] for i in range(samples)])
    model = script.tiny_llama()
    model.load_state_dict(params)
    with torch.no_grad():
        return model(input_ids=input_ids, labels=input_ids).loss.item()


@pytest.mark.timeout(400)
def test_each_groups_eval_loss_is_its_own_model_on_the_whole_eval_set(tmp_path):
    """2 groups × 2 ranks, H=2, evaluation at each epoch's end (4 steps: an averaging step, whose averaging comes
    before the epoch-end decision to evaluate); 25 eval samples so that one rank runs an empty batch."""
    args = ["--fed_group_size", "2", "--fed_sync_steps", "2", "--num_samples", "32", "--num_train_epochs", "2",
            "--eval_strategy", "epoch", "--fed_eval_per_group", "true", "--record_eval_params", "true",
            "--num_eval_samples", "25"]  # fmt: skip
    runs = train_tiny(4, tmp_path, args)
    script = _tiny_script()
    samples = script.TokenDataset(25)
    input_ids = torch.stack([samples[i]["input_ids"] for i in range(25)])
    evals = [e for e in runs[0]["log_history"] if "eval_loss" in e]
    assert [e["step"] for e in evals] == [4, 8, 8]  # the last one is the explicit evaluate() after training
    for entry in evals[:2]:
        for group in (0, 1):
            model = script.tiny_llama()
            model.load_state_dict(runs[2 * group]["eval_params"][entry["step"]])
            with torch.no_grad():
                expected = model(input_ids=input_ids, labels=input_ids).loss.item()
            assert entry[f"eval_group{group}_loss"] == pytest.approx(expected, rel=1e-5)
            assert entry[f"eval_group{group}_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
        assert entry["eval_group0_loss"] != pytest.approx(entry["eval_group1_loss"], rel=1e-6)
    assert not any(k.startswith("eval_group") for k in evals[2])  # after training the groups are one model
    for run in runs[1:]:  # every rank logs the same figures
        other = [e for e in run["log_history"] if "eval_loss" in e]
        assert [(e.get("eval_group0_loss"), e.get("eval_group1_loss")) for e in other] == [
            (e.get("eval_group0_loss"), e.get("eval_group1_loss")) for e in evals
        ]


@pytest.mark.timeout(400)
def test_groups_of_unequal_size_evaluate_each_group_too(tmp_path):
    """Groups of 2 and 1 ranks (fed_group_size 2,1): every rank logs both groups' losses, each its own model's on
    the whole eval set. (Under torchft each launch logs its own group's: tests/distributed/test_elastic.py.)"""
    script = _tiny_script()
    unequal = train_tiny(3, tmp_path / "unequal", [*ARGS, "--fed_group_size", "2,1"])
    evals = [e for e in unequal[0]["log_history"] if "eval_loss" in e][:2]
    for entry in evals:
        for group, rank in ((0, 0), (1, 2)):
            want = own_loss(script, unequal[rank]["eval_params"][entry["step"]])
            assert entry[f"eval_group{group}_loss"] == pytest.approx(want, rel=1e-5)
    assert [[e.get("eval_group1_loss") for e in r["log_history"] if "eval_loss" in e][:2] for r in unequal[1:]] == [
        [e["eval_group1_loss"] for e in evals]
    ] * 2

"""Per-group evaluation (`fed_eval_per_group`): each group's own model, before averaging, on the whole eval set."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from hf_fedshard.integrations.card import _curves
from hf_fedshard.integrations.group_eval import rank_batches

from .launch import SCRIPTS, train_tiny


@pytest.mark.parametrize(("num_samples", "world", "batch_size"), [(24, 2, 4), (25, 2, 4), (3, 4, 2), (9, 4, 4)])
def test_rank_batches_cover_every_sample_once_with_equal_forward_counts(num_samples, world, batch_size):
    shares = [rank_batches(num_samples, rank, world, batch_size) for rank in range(world)]
    assert sorted(i for share in shares for batch in share for i in batch) == list(range(num_samples))
    assert len({len(share) for share in shares}) == 1
    assert all(len(batch) <= batch_size for share in shares for batch in share)


def test_plot_has_one_eval_line_per_group_and_one_for_the_global_model():
    history = [
        {"step": 2, "eval_loss": 4.0, "eval_perplexity": 54.6, "eval_group0_perplexity": 60.0,
         "eval_group10_perplexity": 62.0, "eval_group1_perplexity": 61.0},
        {"step": 2, "loss": 4.2},
    ]  # fmt: skip
    curves = _curves(history)
    groups = [f"group {g} (before averaging)" for g in (0, 1, 10)]
    assert list(curves["eval perplexity"]) == ["global model", *groups]
    assert curves["eval perplexity"]["group 1 (before averaging)"] == [(2, 61.0)]


def _tiny_script():
    spec = importlib.util.spec_from_file_location("train_tiny", SCRIPTS / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
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

"""The model card extends the trainer's own: a run without federation says what it really was, and a federated
run's figures come from its records (in-process)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from huggingface_hub import ModelCard
from transformers import TrainerState, TrainingArguments

from hf_fedshard import FedShardTrainer, FedShardTrainingArguments
from hf_fedshard.integrations.card import card_section, results_table

from ..scripts.train_tiny import TokenDataset, tiny_llama


def test_card_of_a_run_without_federation(tmp_path):
    args = FedShardTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, eval_strategy="steps", eval_steps=2,
        report_to="none", disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    data = {"train_dataset": TokenDataset(8), "eval_dataset": TokenDataset(4)}
    trainer = FedShardTrainer(model=tiny_llama(), args=args, **data)
    trainer.train()
    trainer.create_model_card(model_name="tiny", dataset="tokens", tokens_per_sample=16)
    card = ModelCard.load(tmp_path / "README.md")
    (result,) = card.data.eval_results  # model-index parses, with the eval perplexity
    last_eval = [h for h in trainer.state.log_history if "eval_perplexity" in h][-1]
    assert result.metric_type == "perplexity"
    assert result.metric_value == pytest.approx(last_eval["eval_perplexity"], rel=1e-4)
    assert "### Training hyperparameters" in card.text and "### Framework versions" in card.text  # Trainer's
    assert "**one process, no FSDP**, without federation" in card.text
    assert "Federation groups" not in card.text and "FedAvg" not in card.text and "bibtex" not in card.text
    assert "hf_fedshard" in card.data.tags and "federated-averaging" not in card.data.tags
    assert "Wall Seconds" not in card.text  # the card clock's stamps stay out of Trainer's results table


@pytest.fixture
def world4(world4_no_setup, monkeypatch):
    """Arguments of a 2-group run on 4 ranks, for a card built from records alone."""
    monkeypatch.setattr(TrainingArguments, "world_size", 4)  # what the 4 ranks' set-up would report


def records_of(tmp_path, history: list[dict], **fed: Any) -> SimpleNamespace:
    """What the card reads of a trainer (arguments, layout, state), without training: FL+FSDP, 2 groups × 2."""
    args = FedShardTrainingArguments(output_dir=str(tmp_path), fed_group_size=2, fed_sync_steps=4, **fed)
    state = TrainerState(global_step=history[-1]["step"], log_history=history)
    callback = SimpleNamespace(settings_history=[(0, args.fed_averaging_settings)])
    layout = args.fed_layout
    return SimpleNamespace(args=args, fed_layout=layout, state=state, is_fsdp_enabled=True, fed_callback=callback)


# A run resumed at step 4: the clock's stamps continue across the restart, train_runtime covers the second session.
RESUMED = [
    {"loss": 2.0, "step": 4, "wall_seconds": 40.0},
    {"fed_syncs": 1, "fed_inter_group_bytes": 10, "fed_sync_seconds_total": 1.0, "step": 4, "wall_seconds": 40.0},
    {"loss": 1.5, "step": 8, "wall_seconds": 79.0},
    {"fed_syncs": 2, "fed_inter_group_bytes": 20, "fed_sync_seconds_total": 2.0, "step": 8, "wall_seconds": 79.0},
    {"train_runtime": 10.0, "train_samples_per_second": 3.2, "step": 8, "wall_seconds": 80.0},
]


def test_card_times_a_resumed_run_over_the_whole_run(tmp_path, world4):
    rows = dict(results_table(records_of(tmp_path, RESUMED), tokens_per_sample=None))
    assert rows["Time in inter-group averaging (s, rank 0)"] == "2.00 (2.5% of training)"  # 2 s of 80 s, not of 10
    assert rows["Training wall time (s)"] == "80.0"


@pytest.mark.parametrize(
    ("fed", "sentence"),
    [
        ({}, "combined, on each rank's local shard, by FedAvg, Δ sent in float32, blocking."),
        (
            {"fed_outer_optimizer": "nesterov", "fed_outer_lr": 0.5, "fed_outer_momentum": 0.8},
            "combined, on each rank's local shard, by Nesterov outer SGD (lr 0.5, momentum 0.8), Δ sent in float32",
        ),
    ],
)
def test_card_sentence_names_the_outer_optimizer_that_ran(tmp_path, world4, fed, sentence):
    text = " ".join(card_section(records_of(tmp_path, RESUMED, **fed)).split())  # the template wraps lines
    assert sentence in text
    assert ("FedAvg" in text) == (not fed)

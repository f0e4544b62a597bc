"""The model card extends the trainer's own: a run without federation says what it really was (in-process)."""

from __future__ import annotations

import pytest
from huggingface_hub import ModelCard

from hf_fedshard import FedShardTrainer, FedShardTrainingArguments

from .scripts.train_tiny import TokenDataset, tiny_llama


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

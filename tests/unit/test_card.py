"""The model card extends the trainer's own: a run without federation says what it really was, and a federated
run's figures come from its records (in-process)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, TrainerState, TrainingArguments
from trl.trainer.utils import generate_model_card

from hf_fedshard import FedShardTrainer, FedShardTrainingArguments
from hf_fedshard.integrations.card import (
    ORIGIN_FILE,
    Start,
    card_section,
    correct_card,
    correct_card_text,
    results_table,
    starting_point,
)

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
    lines = card.text.splitlines()
    assert "This model was trained from scratch on the tokens dataset." in lines  # not "fine-tuned version of []"
    assert "A llama causal language model of 26,784 parameters: 2 layers, hidden size 32, vocabulary 128." in lines
    assert "The tokens dataset: 8 training samples and 4 evaluation samples." in lines
    assert "- optimizer: adamw_torch_fused (betas 0.9, 0.999; epsilon 1e-08)" in lines
    assert "More information needed" not in card.text and "## Intended uses" not in card.text
    assert card.data.base_model is None


SMOLLM2_ORIGIN = {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "weights": "dequantized from GGUF Q4_1",
                  "license": "apache-2.0"}  # fmt: skip


def test_card_of_a_run_from_a_folder_that_records_its_origin(tmp_path):
    folder = tmp_path / "base"
    tiny_llama().save_pretrained(folder)
    (folder / ORIGIN_FILE).write_text(json.dumps(SMOLLM2_ORIGIN))
    args = FedShardTrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    trainer = FedShardTrainer(model=AutoModelForCausalLM.from_pretrained(folder), args=args)
    trainer.create_model_card(dataset="shakespeare")
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.license == "apache-2.0"
    assert (
        "This model was fine-tuned from [HuggingFaceTB/SmolLM2-135M-Instruct]"
        "(https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct) (weights dequantized from GGUF Q4_1) "
        "on the shakespeare dataset."
    ) in card.text.splitlines()


def fake_trainer(tmp_path, name_or_path: str) -> SimpleNamespace:
    """What `correct_card` reads of a trainer: arguments, model, datasets, tokenizer."""
    model = tiny_llama()
    model.config._name_or_path = name_or_path
    args = FedShardTrainingArguments(output_dir=str(tmp_path / "tiny-sft-kjv"), use_cpu=True)
    return SimpleNamespace(args=args, model=model, train_dataset=None, eval_dataset=None, processing_class=None)


def test_trl_card_names_the_local_model_it_started_from_and_loads_this_one(tmp_path):
    (tmp_path / "tiny-fl-fsdp").mkdir()
    # What SFTTrainer.create_model_card writes for a model loaded from a local folder, not pushed to the Hub.
    card = generate_model_card(
        base_model=None,
        model_name="tiny-sft-kjv",
        hub_model_id=None,
        dataset_name="kjv",
        tags=[],
        wandb_url=None,
        trackio_url=None,
        trainer_name="SFT",
    )
    correct_card(card, fake_trainer(tmp_path, str(tmp_path / "tiny-fl-fsdp")), None, "kjv", hub_dataset=False)
    lines = card.text.splitlines()
    assert f"This model was fine-tuned from the local model `{tmp_path / 'tiny-fl-fsdp'}` on the kjv dataset." in lines
    assert f'generator = pipeline("text-generation", model="{tmp_path / "tiny-sft-kjv"}")' in lines
    assert 'print(generator("Once upon a time", max_new_tokens=64)[0]["generated_text"])' in lines  # no chat template
    assert "None" not in card.text and "huggingface.co/datasets" not in card.text
    assert {"licence", "base_model", "datasets"}.isdisjoint(card.data.to_dict())


def test_adapter_card_names_the_hub_model_not_the_converted_folder(tmp_path):
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / ORIGIN_FILE).write_text(json.dumps(SMOLLM2_ORIGIN))
    card = ModelCard(f"---\ntags:\n- base_model:adapter:{folder}\n- lora\n---\n")  # as PEFT's save_pretrained tags it
    correct_card(card, fake_trainer(tmp_path, str(folder)), None, "kjv")
    assert card.data.tags == ["lora"] and card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_opening_sentence_says_where_the_model_started(tmp_path):
    assert starting_point("").sentence("kjv") == "This model was trained from scratch on the kjv dataset."
    assert starting_point(str(tmp_path)).sentence(None) == (
        f"This model was fine-tuned from the local model `{tmp_path}` on an unknown dataset."
    )
    assert starting_point("org/model").sentence("kjv") == (
        "This model was fine-tuned from [org/model](https://huggingface.co/org/model) on the kjv dataset."
    )


def test_card_names_the_device_that_ran():
    text = "- seed: 42\n- distributed_type: multi-GPU\n- num_devices: 4\n"
    fixed = correct_card_text(text, fake_trainer(Path("/tmp"), ""), Start(), None)
    assert fixed == "- seed: 42\n- distributed_type: multi-CPU\n- num_devices: 4\n"


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


def test_a_perplexity_that_ends_inside_one_decade_gets_labelled_ticks_there():
    """A curve from 33,000 down to the Quickstart's 497.7 → 227.6 spans over two decades, where matplotlib's log
    axis labels only powers of ten: nothing between 227.6 and 497.7 (checked: an empty list). Labelled: 300."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_fedshard.integrations.card import label_log_axis

    fig, ax = plt.subplots()
    ax.plot(range(7), [33000, 5000, 497.7, 331.1, 261.6, 232.2, 227.6])
    label_log_axis(ax)
    fig.canvas.draw()
    ticks = (*ax.get_yticklabels(), *ax.get_yticklabels(minor=True))
    shown = [t.get_text() for t in ticks if t.get_text() and 227.6 <= t.get_position()[1] <= 497.7]
    plt.close(fig)
    assert shown == ["300"], shown

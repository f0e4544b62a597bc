"""Without clipping (``max_grad_norm 0``) Trainer measures the gradient norm at every step, a collective under
FSDP, only to log it: FedShardTrainer measures it on the steps that log, and logs the same values (in-process)."""

from __future__ import annotations

import pytest
from accelerate import Accelerator
from transformers import Trainer, TrainingArguments

from hf_fedshard import FedShardTrainer, FedShardTrainingArguments

from ..scripts.train_tiny import TokenDataset, tiny_llama

STEPS = 5


def measured_norms(trainer_class, arguments_class, tmp_path, monkeypatch, **logging) -> tuple[int, dict]:
    """(how many times the norm was measured, {step: logged grad_norm}) of a 5-step run without clipping."""
    measured = []
    clip = Accelerator.clip_grad_norm_

    def counted(self, parameters, max_norm, norm_type=2):
        measured.append(max_norm)
        return clip(self, parameters, max_norm, norm_type)

    monkeypatch.setattr(Accelerator, "clip_grad_norm_", counted)
    args = arguments_class(
        output_dir=str(tmp_path / trainer_class.__name__), max_steps=STEPS, per_device_train_batch_size=2,
        max_grad_norm=0.0, report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no", **logging,
    )  # fmt: skip
    trainer = trainer_class(model=tiny_llama(), args=args, train_dataset=TokenDataset(16))
    trainer.train()
    return len(measured), {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}


@pytest.fixture(scope="module")
def trainer_norms(tmp_path_factory) -> dict:
    """Trainer's logged norm at every step."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        tmp_path = tmp_path_factory.mktemp("trainer")
        return measured_norms(Trainer, TrainingArguments, tmp_path, monkeypatch, logging_steps=1)[1]


@pytest.mark.parametrize(
    ("logging", "logged_steps"),
    [
        ({"logging_steps": 2}, [2, 4]),
        ({"logging_steps": 2, "logging_first_step": True}, [1, 2, 4]),
        ({"logging_strategy": "no"}, []),
        ({"logging_strategy": "no", "logging_first_step": True}, [1]),
    ],
    ids=["every-2", "first-and-every-2", "never", "first-only"],
)
def test_the_norm_is_measured_on_logging_steps_only_and_logs_as_trainer(
    tmp_path, monkeypatch, trainer_norms, logging, logged_steps
):
    count, norms = measured_norms(FedShardTrainer, FedShardTrainingArguments, tmp_path, monkeypatch, **logging)
    assert count == len(logged_steps)
    assert norms == {step: trainer_norms[step] for step in logged_steps}


def test_by_epoch_the_norm_is_measured_at_every_step(tmp_path, monkeypatch, trainer_norms):
    count, norms = measured_norms(FedShardTrainer, FedShardTrainingArguments, tmp_path, monkeypatch,
                                  logging_strategy="epoch")  # fmt: skip
    assert count == STEPS
    assert norms == {STEPS: trainer_norms[STEPS]}


def test_a_ratio_of_the_steps_with_accumulation_logs_as_trainer(tmp_path, monkeypatch):
    every = {"gradient_accumulation_steps": 2}
    reference = measured_norms(Trainer, TrainingArguments, tmp_path, monkeypatch, logging_steps=1, **every)[1]
    count, norms = measured_norms(FedShardTrainer, FedShardTrainingArguments, tmp_path, monkeypatch,
                                  logging_steps=0.4, **every)  # fmt: skip
    assert count == 2  # Trainer's schedule: every ceil(0.4 × 5) = 2 optimizer steps
    assert norms == {2: reference[2], 4: reference[4]}

"""hf_fedshard with TRL's SFTTrainer and with a user's own Trainer subclass, in process: the composition (base
order, overrides that still run, the ImportError without TRL). The gloo runs are tests/distributed/test_trl.py.
"""

from __future__ import annotations

import importlib
import math
import sys

import pytest
from transformers import Trainer

from hf_fedshard import FedShardMixin, FedShardTrainingArguments

from ..scripts.train_tiny import TokenDataset, tiny_llama

pytest.importorskip("trl")


class CountingTrainer(Trainer):
    """A user's own Trainer subclass that overrides compute_loss."""

    calls = 0

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.calls += 1
        return super().compute_loss(model, inputs, *args, **kwargs)


class FedCountingTrainer(CountingTrainer, FedShardMixin):
    """The one line that gives the user's trainer the federation."""


def test_mixin_composes_with_a_subclass_that_overrides_compute_loss(tmp_path):
    mro = FedCountingTrainer.__mro__  # the user's override first, then the mixin and its parts, then Trainer
    assert mro[:3] == (FedCountingTrainer, CountingTrainer, FedShardMixin) and mro[-2:] == (Trainer, object)
    assert mro[3:-2] == FedShardMixin.__bases__[:-1]
    args = FedShardTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, logging_steps=1, report_to="none",
        disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    trainer = FedCountingTrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(8))
    trainer.train()
    assert trainer.calls == 2  # the subclass's override ran at every step
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(h["perplexity"] == pytest.approx(math.exp(h["loss"])) for h in logs)  # and the mixin's


def test_sft_trainer_base_order_keeps_trl_overrides_first():
    from trl import SFTTrainer

    from hf_fedshard.trl import FedShardSFTConfig, FedShardSFTTrainer

    mro = FedShardSFTTrainer.__mro__
    assert mro.index(SFTTrainer) < mro.index(FedShardMixin) < mro.index(Trainer)
    for method in ("_save_checkpoint", "compute_loss", "training_step"):  # TRL's own, reaching the mixin by super()
        assert getattr(FedShardSFTTrainer, method) is getattr(SFTTrainer, method)
    assert FedShardSFTConfig.__mro__[1].__name__ == "FedShardArgumentsMixin"


def test_clear_import_error_without_trl(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl now raises ImportError
    monkeypatch.delitem(sys.modules, "hf_fedshard.trl", raising=False)
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[trl\]\" \(in the clone\)"):
        importlib.import_module("hf_fedshard.trl")

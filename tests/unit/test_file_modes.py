"""Exported weights follow the umask (safetensors writes them 0600), in process on real files."""

from __future__ import annotations

import os
import stat

import torch
from safetensors.torch import save_file

from hf_fedshard import FedShardTrainer, FedShardTrainingArguments
from hf_fedshard.integrations.file_modes import current_umask, follow_umask

from ..scripts.train_tiny import tiny_llama


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_weights_written_by_safetensors_get_the_umasks_mode_and_other_files_are_left(tmp_path):
    previous = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
        (tmp_path / "notes.txt").write_text("")
        (tmp_path / "notes.txt").chmod(0o600)
        follow_umask(tmp_path)
    finally:
        os.umask(previous)
    assert _mode(tmp_path / "model.safetensors") == 0o640
    assert _mode(tmp_path / "notes.txt") == 0o600


def test_the_trainers_export_gives_the_weights_the_mode_of_its_config(tmp_path):
    """What a user sees with ``ls -l`` after ``trainer.save_model()``: one mode for the whole folder."""
    args = FedShardTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    FedShardTrainer(model=tiny_llama(), args=args).save_model()
    assert _mode(tmp_path / "model.safetensors") == _mode(tmp_path / "config.json") == 0o666 & ~current_umask()

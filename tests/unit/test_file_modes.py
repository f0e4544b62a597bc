"""Exported weights follow the umask (safetensors writes them 0600), in process on real files."""

from __future__ import annotations

import os
import stat

import torch
from safetensors.torch import save_file

from hf_fedshard.integrations.file_modes import follow_umask


def test_weights_written_by_safetensors_get_the_umasks_mode_and_other_files_are_left(tmp_path):
    previous = os.umask(0o027)
    try:
        save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
        (tmp_path / "notes.txt").write_text("")
        (tmp_path / "notes.txt").chmod(0o600)
        follow_umask(tmp_path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "notes.txt").stat().st_mode) == 0o600

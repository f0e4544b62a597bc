"""Tooling that no training path imports: the cost model, offline corpora, Llama presets built from configs."""

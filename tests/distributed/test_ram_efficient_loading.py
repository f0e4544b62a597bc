"""Accelerate's ``cpu_ram_efficient_loading`` under the federation (2 groups × 2 ranks on gloo): rank 0 alone reads
the weights, Accelerate broadcasts them over the world as each group shards them over its own ranks, and every rank
then holds what a normal load would give it, bit for bit, tied embeddings still tied."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from ..launch import train_tiny
from ..scripts.train_tiny import tiny_llama

RAM_EFFICIENT = ["--fsdp_config", json.dumps({"cpu_ram_efficient_loading": True})]


@pytest.mark.timeout(400)
def test_only_rank_0_reads_the_weights_and_every_group_starts_from_a_normal_load(tmp_path):
    folder = tmp_path / "pretrained"
    tiny_llama(tie_word_embeddings=True).save_pretrained(folder)
    args = ["--pretrained_dir", folder, *RAM_EFFICIENT, "--fed_group_size", "2", "--fed_sync_steps", "2",
            "--max_steps", "2"]  # fmt: skip
    runs = train_tiny(4, tmp_path, args)

    assert [run["on_meta"] for run in runs] == [False, True, True, True]  # only rank 0 read the file
    normal = dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters(remove_duplicate=False))
    for rank, run in enumerate(runs):
        prepared = run["prepared"]
        assert prepared["tied"], f"rank {rank}: lm_head no longer shares the embedding"
        assert prepared["local"].keys() == normal.keys()
        for name, value in normal.items():  # FSDP2 shards dim 0 in chunks: rank r of its group holds chunk r
            expected = torch.chunk(value.detach(), 2, dim=0)[rank % 2]
            assert torch.equal(prepared["local"][name], expected), f"rank {rank}: {name}"
    for name, value in runs[0]["full_params"].items():  # and training goes on: the groups agree after step 2's sync
        assert torch.equal(runs[2]["full_params"][name], value), name

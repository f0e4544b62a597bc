"""Distributed check script: trains a tiny Llama and writes what each rank saw and holds.

Launched by the tests with torchrun (gloo, CPU):

    torchrun --nproc_per_node 4 tests/scripts/train_tiny.py --output_dir /tmp/x --fed_group_size 2 \
        --max_steps 4 --dump_dir /tmp/x/dump

Each rank writes ``rank{R}.pt``: log history, sample indices read, per-step checksums of its local shards,
DTensor placements and mesh shape, the full (group-gathered) parameters and its local shards at the end.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, set_seed

from hf_fedshard import FedShardTrainer, FedShardTrainingArguments

SEQ_LEN = 16
VOCAB = 128


@dataclass
class ScriptArguments:
    dump_dir: str = field(metadata={"help": "Folder for the per-rank dumps."})
    trainer: str = field(default="fed", metadata={"help": "fed: FedShardTrainer; plain: transformers.Trainer."})
    num_samples: int = field(default=64, metadata={"help": "Training samples (sample i starts with token i)."})
    freeze_all: bool = field(default=False, metadata={"help": "Freeze every parameter (error case)."})


class TokenDataset(torch.utils.data.Dataset):
    """Sample i: token i, then random tokens from a generator seeded with i (identical on every rank)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rest = torch.randint(0, VOCAB, (SEQ_LEN - 1,), generator=torch.Generator().manual_seed(i))
        ids = torch.cat([torch.tensor([i % VOCAB]), rest])
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
    )
    set_seed(0)
    return LlamaForCausalLM(config)


def local_checksum(model: torch.nn.Module) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.detach().double().sum()
    return total.item()


class Recorder(TrainerCallback):
    """Runs after FedAvgCallback: records this rank's local checksum at each optimizer step."""

    def __init__(self) -> None:
        self.checksums: dict[int, float] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.checksums[state.global_step] = local_checksum(model)


def main(argv: list[str] | None = None) -> None:
    parser = HfArgumentParser((ScriptArguments, FedShardTrainingArguments))
    script, args = parser.parse_args_into_dataclasses(argv)
    model = tiny_llama()
    if script.freeze_all:
        model.requires_grad_(False)
    seen: list[int] = []
    model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.extend(kw["input_ids"][:, 0].tolist()) if model.training else None,
        with_kwargs=True,
    )
    trainer_cls = FedShardTrainer if script.trainer == "fed" else Trainer
    trainer = trainer_cls(
        model=model, args=args, train_dataset=TokenDataset(script.num_samples), eval_dataset=TokenDataset(24)
    )
    recorder = Recorder()
    trainer.add_callback(recorder)
    trainer.train()
    metrics = trainer.evaluate()
    for module in trainer.model.modules():  # evaluation leaves the no-reshard tail unsharded
        if isinstance(module, FSDPModule):
            module.reshard()
    param = next(trainer.model.parameters())
    dump = {
        "log_history": trainer.state.log_history,
        "eval": metrics,
        "seen": seen,
        "checksums": recorder.checksums,
        "is_dtensor": [isinstance(p, DTensor) for p in trainer.model.parameters()],
        "placements": [str(pl) for pl in param.placements] if isinstance(param, DTensor) else None,
        "mesh_shape": list(param.device_mesh.shape) if isinstance(param, DTensor) else None,
        "full_params": {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in trainer.model.named_parameters()
        },
        "local_params": {
            n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in trainer.model.named_parameters()
        },
    }
    os.makedirs(script.dump_dir, exist_ok=True)
    torch.save(dump, os.path.join(script.dump_dir, f"rank{trainer.args.process_index}.pt"))


if __name__ == "__main__":
    main(sys.argv[1:])

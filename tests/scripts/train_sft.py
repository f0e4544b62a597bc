"""Distributed check script: TRL's SFTTrainer, with and without hf_fedshard, on a tiny Llama.

Launched by the tests with torchrun (gloo, CPU); also measures the SFT path's inter-group traffic:

    torchrun --nproc_per_node 4 tests/scripts/train_sft.py --output_dir /tmp/sft --dump_dir /tmp/sft/dump \
        --fed_group_size 2 --fed_sync_steps 4 --max_steps 8 --logging_steps 4 --bf16 false --use_cpu true

``--trainer plain`` runs `trl.SFTTrainer` itself (DDP on CPU) on the same data. Every sample has the same length
and no padding, so every rank trains on equally many tokens. Each rank writes ``rank{R}.pt``: log history, eval
metrics, full and local parameters at the end, the initial parameters, and the bytes it handed to collectives
spanning several federation groups at each optimizer step (``benchmarks.harness.collective_bytes``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models
from torch.distributed.tensor import DTensor
from train_tiny import SEQ_LEN, VOCAB, full_tensor, tiny_llama  # this folder is sys.path[0]
from transformers import HfArgumentParser, PreTrainedTokenizerFast
from trl import SFTTrainer

from benchmarks.harness.collective_bytes import CrossGroupBytes  # the launcher puts the checkout on PYTHONPATH
from hf_fedshard.topology import FederationLayout
from hf_fedshard.transports.mesh import destroy_gloo_groups_at_exit
from hf_fedshard.trl import FedShardSFTConfig, FedShardSFTTrainer


@dataclass
class ScriptArguments:
    dump_dir: str = field(metadata={"help": "Folder for the per-rank dumps."})
    trainer: str = field(default="fed", metadata={"help": "fed: FedShardSFTTrainer; plain: trl.SFTTrainer."})
    use_peft: bool = field(default=False, metadata={"help": "LoRA (r=4 on q_proj, v_proj) through peft_config."})
    num_samples: int = field(default=64, metadata={"help": "Training samples."})
    count_group_size: int = field(
        default=2, metadata={"help": "Ranks per group when counting cross-group bytes (plain runs have no groups)."}
    )


def token_dataset(n: int, seed: int) -> Dataset:
    """n samples of SEQ_LEN tokens in 1..VOCAB-1 (0 is the pad token, never in the data), the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"input_ids": torch.randint(1, VOCAB, (n, SEQ_LEN), generator=generator).tolist()})


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")), pad_token="t0", eos_token="t1"
    )


def main(argv: list[str]) -> None:
    script, args = HfArgumentParser((ScriptArguments, FedShardSFTConfig)).parse_args_into_dataclasses(argv)
    destroy_gloo_groups_at_exit()
    model = tiny_llama()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if script.use_peft else None
    trainer_cls = FedShardSFTTrainer if script.trainer == "fed" else SFTTrainer
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=token_dataset(script.num_samples, seed=0),
        eval_dataset=token_dataset(16, seed=1),
        processing_class=tokenizer(),
        peft_config=peft_config,
    )
    layout = args.fed_layout if args.fed_requested else FederationLayout.from_env(script.count_group_size, None)
    counter = CrossGroupBytes(layout).install()
    trainer.add_callback(counter)
    trainer.train()
    counter.uninstall()
    metrics = trainer.evaluate()
    named = list(trainer.model.named_parameters())
    dump = {
        "log_history": trainer.state.log_history,
        "eval": metrics,
        "cross_group_bytes": dict(counter.per_step),
        "engine_calls": dict(counter.engine_calls),
        "initial_params": initial,
        "trainable": [n for n, p in named if p.requires_grad],
        "full_params": {n: full_tensor(p) for n, p in named},
        "local_params": {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in named},
        "mro": [c.__name__ for c in type(trainer).__mro__],
    }
    os.makedirs(script.dump_dir, exist_ok=True)
    torch.save(dump, os.path.join(script.dump_dir, f"rank{args.process_index}.pt"))


if __name__ == "__main__":
    main(sys.argv[1:])

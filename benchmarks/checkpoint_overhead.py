"""What a federated checkpoint costs: seconds to save and to load it back, bytes on disk, next to a training step.

FL+FSDP on 4 CPU processes (2 groups × 2 ranks), the Quickstart's tiny Llama, AdamW, a checkpoint every 4 steps:

    torchrun --nproc_per_node 4 benchmarks/checkpoint_overhead.py --output_dir /tmp/ckpt_overhead \
        --fed_group_size 2 --model_size tiny --max_steps 12 --save_steps 4

The test suite's micro model: ``--model_size micro --vocab_size 128``; FL+HSDP: 8 processes and
``--fed_group_size 4 --fed_shard_size 2``. Rank 0 prints one JSON line: the mean and max seconds of a save (as
the slowest rank sees it: the publishing rename waits for every rank), the seconds to load model and optimizer
state back, the bytes of the last checkpoint split into model shards, optimizer state and the rest, and the mean
seconds of a training step. Data are random tokens: only the sizes matter here.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, TrainerCallback, set_seed

from hf_fedshard import FedShardTrainer, FedShardTrainingArguments
from hf_fedshard.checkpointing.checkpoint import latest_complete_checkpoint
from hf_fedshard.tools.models import PRESETS, llama_config


@dataclass
class BenchArguments:
    model_size: str = field(default="tiny", metadata={"help": "Llama preset.", "choices": list(PRESETS)})
    vocab_size: int = field(default=8192, metadata={"help": "Vocabulary size (8192: the Quickstart's BPE)."})
    block_size: int = field(default=128, metadata={"help": "Tokens per sample."})
    num_samples: int = field(default=1024, metadata={"help": "Random-token training samples."})


class RandomTokens(torch.utils.data.Dataset):
    """Sample i: ``block_size`` tokens from a generator seeded with i (the same on every rank)."""

    def __init__(self, n: int, block_size: int, vocab_size: int) -> None:
        self.n, self.block_size, self.vocab_size = n, block_size, vocab_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab_size, (self.block_size,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class StepClock(TrainerCallback):
    """Seconds of each optimizer step, averaging included, checkpoints excluded (they happen after on_step_end)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)


class TimedTrainer(FedShardTrainer):
    """Records the wall time of every checkpoint save."""

    save_seconds: list[float]

    def _save_checkpoint(self, model, trial) -> None:
        start = time.perf_counter()
        super()._save_checkpoint(model, trial)
        self.save_seconds.append(time.perf_counter() - start)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoint_bytes(checkpoint: Path) -> dict[str, int]:
    """Bytes of one checkpoint: every group's model shards, its optimizer state, and everything else."""
    model = sum(folder_bytes(group / "model") for group in checkpoint.glob("fed_group*"))
    optimizer = sum(folder_bytes(group / "optimizer") for group in checkpoint.glob("fed_group*"))
    total = folder_bytes(checkpoint)
    return {"model_bytes": model, "optimizer_bytes": optimizer, "other_bytes": total - model - optimizer,
            "total_bytes": total}  # fmt: skip


def load_seconds(trainer: FedShardTrainer, checkpoint: str) -> float:
    """Seconds to read model and optimizer state back (what a resume adds before its first step)."""
    start = time.perf_counter()
    trainer._load_from_checkpoint(checkpoint, trainer.model)
    trainer._load_optimizer_and_scheduler(checkpoint)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((BenchArguments, FedShardTrainingArguments))
    parser.set_defaults(save_strategy="steps", save_steps=4, max_steps=12, optim="adamw_torch", report_to=["none"],
                        logging_steps=1000, disable_tqdm=True, per_device_train_batch_size=2)  # fmt: skip
    bench, args = parser.parse_args_into_dataclasses(argv)
    set_seed(args.seed)
    model = AutoModelForCausalLM.from_config(llama_config(bench.model_size, bench.vocab_size, bench.block_size))
    trainer = TimedTrainer(
        model=model, args=args, train_dataset=RandomTokens(bench.num_samples, bench.block_size, bench.vocab_size)
    )
    trainer.save_seconds = []
    clock = StepClock()
    trainer.add_callback(clock)
    trainer.train()
    checkpoint = latest_complete_checkpoint(args.output_dir)
    result = {
        "layout": trainer.fed_layout.describe(),
        "model_size": bench.model_size,
        "parameters": model.num_parameters(),
        "saves": len(trainer.save_seconds),
        "save_seconds_mean": round(statistics.mean(trainer.save_seconds), 4),
        "save_seconds_max": round(max(trainer.save_seconds), 4),
        "load_seconds": round(load_seconds(trainer, checkpoint), 4),
        "step_seconds_mean": round(statistics.mean(clock.seconds[1:]), 4),  # the first step includes warm-up
        **checkpoint_bytes(Path(checkpoint)),
        "command": " ".join(["torchrun", f"--nproc_per_node {os.environ.get('LOCAL_WORLD_SIZE', '?')}",
                             "benchmarks/checkpoint_overhead.py", *(sys.argv[1:] if argv is None else argv)]),
    }  # fmt: skip
    if args.process_index == 0:
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()

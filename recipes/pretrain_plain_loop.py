"""FL+FSDP pre-training in a plain Accelerate loop, no Trainer: the engine `FederatedAverager` on its own.

The loop is the one you would write for FSDP2; the federation adds three lines (the layout's mesh, the averager,
``averager.step()``) and ``averager.finish()``. On 4 CPU processes, 2 groups × 2 ranks, offline::

    torchrun --nproc_per_node 4 recipes/pretrain_plain_loop.py --group_size 2 --sync_steps 8 --max_steps 40

From a pretrained model, with its perplexity before and after: ``--model_name_or_path smollm2-135m-instruct
--eval_on_start --learning_rate 1e-4``.

Every rank reads its own slice of each world batch (``accelerator.prepare`` of the data loader over the world),
each group shards the model with FSDP2 over its own ranks, and every ``sync_steps`` steps the groups average.
The evaluation at the end is the global model's, and ``--output_dir`` receives it in the Hugging Face format.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import fields

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, default_data_collator, set_seed

from hf_fedshard import FederatedAverager, FederationLayout
from hf_fedshard.engine import AveragingOptions
from hf_fedshard.errors import ConfigError, exit_on_config_error
from hf_fedshard.integrations.file_modes import follow_umask
from hf_fedshard.tools.data import load_text, pack, train_bpe_tokenizer
from hf_fedshard.tools.models import PRESETS, SMOLLM2, build_model, resolve_model
from hf_fedshard.transports.mesh import fsdp_mesh


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group_size", type=int, required=True, help="Ranks per federation group.")
    parser.add_argument("--shard_size", type=int, default=None, help="Ranks sharding one copy (FL+HSDP below it).")
    add_averaging_arguments(parser, AVERAGING)
    parser.add_argument("--model_size", default="tiny", choices=list(PRESETS))
    parser.add_argument(
        "--model_name_or_path", default=None, help=f"Start from this model (folder, Hub id, or {SMOLLM2} offline)."
    )
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=8, help="Samples per rank and step.")
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--max_eval_samples", type=int, default=64)
    parser.add_argument(
        "--eval_on_start", action="store_true", help="Also evaluate the model before training (as Trainer's flag)."
    )
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--output_dir", default=None, help="Save the global model here (save_pretrained).")
    parser.add_argument("--seed", type=int, default=42)
    return parser


AVERAGING = ("sync_steps", "outer_optimizer", "sync_dtype", "sync_overlap", "round_policy")  # this recipe's flags


def add_averaging_arguments(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    """``--<name>`` for each averaging setting in ``names``, with the engine's default, choices and help (their one
    source, `hf_fedshard.engine.options.AveragingOptions`)."""
    declared = {f.name: f for f in fields(AveragingOptions)}
    for name in names:
        setting = declared[name]
        parser.add_argument(f"--{name}", type=type(setting.default), default=setting.default,
                            choices=setting.metadata.get("choices"), help=setting.metadata["help"])  # fmt: skip


def shard(model: torch.nn.Module, mesh) -> None:
    """FSDP2 over this rank's group: each decoder layer a unit, then the rest (embeddings, norm, head)."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh(mesh))
    fully_shard(model, mesh=fsdp_mesh(mesh))


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> float:
    """The mean token loss over the world's share of the eval set (each rank its own batches)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for batch in loader:
        total += torch.tensor([model(**batch).loss.item() * len(batch["input_ids"]), len(batch["input_ids"])])
    model.train()
    loss_sum, samples = accelerator.reduce(total, reduction="sum").tolist()
    return loss_sum / samples


def main(argv: list[str] | None = None) -> dict[str, float]:
    opts = make_parser().parse_args(argv)
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), dataloader_config=config)
    layout = FederationLayout(accelerator.num_processes, opts.group_size, opts.shard_size)  # checks the sizes
    path = resolve_model(opts.model_name_or_path)
    with accelerator.local_main_process_first():
        raw = load_text("shakespeare")
        tokenizer = AutoTokenizer.from_pretrained(path) if path else train_bpe_tokenizer(raw["train"], vocab_size=8192)
        blocks = pack(raw, tokenizer, opts.block_size)
    set_seed(opts.seed)
    model = build_model(opts.model_size, len(tokenizer), opts.block_size, path).to(accelerator.device)
    mesh = layout.build_mesh(accelerator.device.type)
    shard(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.learning_rate)
    averager = FederatedAverager(model, optimizer, mesh, **{name: getattr(opts, name) for name in AVERAGING})
    batches = dict(batch_size=opts.batch_size, collate_fn=default_data_collator, drop_last=True)
    train = accelerator.prepare(DataLoader(blocks["train"].with_format("torch"), shuffle=True, **batches))
    evaluation = blocks["validation"].select(range(min(opts.max_eval_samples, len(blocks["validation"]))))
    eval_loader = accelerator.prepare(DataLoader(evaluation.with_format("torch"), **batches))
    if len(eval_loader) == 0:  # the same length on every rank: all refuse alike, before any step
        raise ConfigError(
            f"max_eval_samples={opts.max_eval_samples} gives no full eval batch of batch_size={opts.batch_size} per "
            f"rank on {accelerator.num_processes} ranks. Raise --max_eval_samples to at least "
            f"{opts.batch_size * accelerator.num_processes}."
        )
    accelerator.print(f"{layout.describe()}; averaging every {opts.sync_steps} steps")
    before = {}
    if opts.eval_on_start:  # every group holds the global model here: the averager averaged the initial weights
        loss = evaluate(model, eval_loader, accelerator)
        accelerator.print(f"eval loss {loss:.3f}, perplexity {math.exp(loss):.1f} (before training)")
        before = {"eval_before_loss": loss, "eval_before_perplexity": math.exp(loss)}
    step, epoch = 0, 0
    while step < opts.max_steps:
        train.set_epoch(epoch)
        for batch in train:
            if averager.should_train:  # always, but past a slow group's share of a speed-aware round
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            averager.step()
            step += 1
            if step % opts.logging_steps == 0:
                accelerator.print(f"step {step}: loss {loss.item():.3f} (rank 0's group) {averager.metrics()}")
            if step == opts.max_steps:
                break
        epoch += 1
    averager.finish()  # every group now holds the global model
    eval_loss = evaluate(model, eval_loader, accelerator)
    accelerator.print(f"eval loss {eval_loss:.3f}, perplexity {math.exp(eval_loss):.1f}")
    if opts.output_dir is not None:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if accelerator.is_main_process:
            model.save_pretrained(opts.output_dir, state_dict=state)
            tokenizer.save_pretrained(opts.output_dir)
            follow_umask(opts.output_dir)  # safetensors writes the weights 0600, the rest gets the umask's mode
    return {**before, "eval_loss": eval_loss, "eval_perplexity": math.exp(eval_loss), **averager.metrics()}


if __name__ == "__main__":
    exit_on_config_error(main)

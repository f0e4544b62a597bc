"""Pre-train a Llama with FL+FSDP or FL+HSDP: the paper's workload, from two CPU cores to a GPU cluster.

Offline on a CPU machine, 4 processes = 2 federation groups × 2 ranks (the README Quickstart):

    accelerate launch --config_file accelerate_configs/fl_fsdp_cpu.yaml recipes/pretrain_clm.py \
        --output_dir outputs/tiny-fl-fsdp --fed_group_size 2 --fed_sync_steps 8 --max_steps 200

One node of 8 GPUs as 2 groups of 4 (FL+FSDP), on a Hub dataset:

    accelerate launch --config_file accelerate_configs/fl_fsdp.yaml --num_processes 8 recipes/pretrain_clm.py \
        --output_dir outputs/small --model_size small --dataset_name wikitext \
        --dataset_config_name wikitext-103-raw-v1 --fed_group_size 4 --bf16

Two nodes × 4 GPUs, one group per node (run on each node, machine_rank 0 and 1):

    accelerate launch --config_file accelerate_configs/fl_fsdp.yaml --num_machines 2 --num_processes 8 \
        --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR --main_process_port 29500 \
        recipes/pretrain_clm.py --output_dir outputs/8b --model_size llama-8b --fed_group_size 4 --bf16 ...

The same with torchrun: `torchrun --nnodes 2 --nproc_per_node 4 --node_rank $NODE_RANK
--rdzv_endpoint $MASTER_ADDR:29500 recipes/pretrain_clm.py ... --fed_group_size 4` (FSDP2 is turned on
by the fed settings). `--fed_shard_size 2` with `--fed_group_size 4` gives FL+HSDP (2 replicas × 2 shards).
The accelerate config's `fsdp_cpu_ram_efficient_loading: true` (rank 0 alone reads `--model_name_or_path`'s weights)
is `--fsdp_config '{"cpu_ram_efficient_loading": true}'` with torchrun.

Batch arithmetic (printed at start): one optimizer step of one group reads
per_device_train_batch_size × fed_group_size × gradient_accumulation_steps blocks of block_size tokens.
"""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from datasets import DatasetDict
from transformers import AutoTokenizer, HfArgumentParser, PreTrainedTokenizerBase, default_data_collator, set_seed

from hf_fedshard import FedShardTrainer, FedShardTrainingArguments
from hf_fedshard.errors import exit_on_config_error
from hf_fedshard.integrations.fsdp import loads_weights
from hf_fedshard.tools.data import EMBEDDED, load_text, pack, prepare_once, train_bpe_tokenizer
from hf_fedshard.tools.models import PRESETS, SMOLLM2, build_model, resolve_model


@dataclass
class ModelArguments:
    model_size: str = field(
        default="tiny",
        metadata={"help": "Llama size preset for a model trained from scratch.", "choices": list(PRESETS)},
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": f"Start from this model (local folder, Hub id, or {SMOLLM2} offline) instead of a preset."},
    )


@dataclass
class DataArguments:
    dataset_name: str | None = field(
        default="shakespeare",
        metadata={"help": f"A Hub dataset id, or an embedded offline corpus: {', '.join(EMBEDDED)}."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    train_file: str | None = field(
        default=None, metadata={"help": "A local text file to train on (overrides the name)."}
    )
    validation_file: str | None = field(default=None, metadata={"help": "A local text file to evaluate on."})
    validation_split_percentage: int = field(
        default=5,
        metadata={"help": "Without a validation split: percent of the rows held out, as one contiguous block."},
    )
    block_size: int = field(default=128, metadata={"help": "Tokens per training sample (packed across documents)."})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "A tokenizer to load; default: a byte-level BPE trained on the train split."}
    )
    vocab_size: int = field(
        default=8192, metadata={"help": "Vocabulary of the BPE trained when no tokenizer is given."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only the first N evaluation blocks."})


def make_parser() -> HfArgumentParser:
    parser = HfArgumentParser((ModelArguments, DataArguments, FedShardTrainingArguments))
    # Defaults that differ from TrainingArguments: a from-scratch schedule, TensorBoard, periodic evaluation.
    parser.set_defaults(
        learning_rate=2e-3,
        lr_scheduler_type="cosine",
        warmup_steps=20,
        weight_decay=0.1,
        report_to=["tensorboard"],
        eval_strategy="steps",
        eval_steps=50,
        logging_steps=10,
    )
    return parser


def prepare(data_args: DataArguments, model_args: ModelArguments) -> tuple[DatasetDict, PreTrainedTokenizerBase]:
    """Text, tokenizer (loaded, or a BPE trained on the train split) and packed blocks: once per machine."""
    raw = load_text(
        data_args.dataset_name,
        data_args.dataset_config_name,
        data_args.train_file,
        data_args.validation_file,
        data_args.validation_split_percentage,
    )
    tokenizer_source = data_args.tokenizer_name or model_args.model_name_or_path
    if tokenizer_source:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    else:
        tokenizer = train_bpe_tokenizer(raw["train"], data_args.vocab_size)
    return pack(raw, tokenizer, data_args.block_size), tokenizer


def data_key(data_args: DataArguments, model_args: ModelArguments) -> dict:
    """What the prepared data depends on (local files by size and time too), naming its cache folder."""
    files = [f for f in (data_args.train_file, data_args.validation_file) if f and Path(f).is_file()]
    return {
        "recipe": "pretrain_clm",
        **{k: v for k, v in vars(data_args).items() if k not in ("max_train_samples", "max_eval_samples")},
        "tokenizer_source": data_args.tokenizer_name or model_args.model_name_or_path,
        "files": [(f, Path(f).stat().st_size, Path(f).stat().st_mtime) for f in files],
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    model_args, data_args, args = make_parser().parse_args_into_dataclasses(argv)
    model_args.model_name_or_path = resolve_model(model_args.model_name_or_path)
    set_seed(args.seed)
    blocks, tokenizer = prepare_once(args, data_key(data_args, model_args), lambda: prepare(data_args, model_args))
    train, evaluation = blocks["train"], blocks["validation"]
    if data_args.max_train_samples is not None:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    if data_args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(data_args.max_eval_samples, len(evaluation))))
    # Under cpu_ram_efficient_loading only rank 0 reads the weights; Accelerate broadcasts them as it shards the model.
    path, empty = model_args.model_name_or_path, not loads_weights(args)
    model = build_model(model_args.model_size, len(tokenizer), data_args.block_size, path, empty)

    trainer = FedShardTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    start = time.perf_counter()
    train_result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = {**train_result.metrics, **trainer.evaluate()}
    metrics["train_tokens_per_second"] = metrics["train_samples_per_second"] * data_args.block_size
    metrics["wall_seconds"] = time.perf_counter() - start
    trainer.save_model()
    trainer.save_metrics("all", metrics)
    trainer.save_state()
    trainer.create_model_card(
        dataset=data_args.train_file or data_args.dataset_name,
        tokens_per_sample=data_args.block_size,
        command=shlex.join(["recipes/pretrain_clm.py", *(sys.argv[1:] if argv is None else argv)]),
    )
    return metrics


if __name__ == "__main__":
    exit_on_config_error(main)

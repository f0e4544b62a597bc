"""LoRA fine-tuning of a causal LM under FL+FSDP: only the adapter is trained, and only it crosses groups.

Offline on a CPU machine, after the Quickstart pre-training run (fine-tunes its model on the King James
Bible, a second public-domain domain, and reports perplexity there before and after):

    accelerate launch --config_file accelerate_configs/fl_fsdp_cpu.yaml recipes/finetune_lora.py \
        --model_name_or_path outputs/tiny-fl-fsdp --output_dir outputs/tiny-lora-kjv --fed_group_size 2 \
        --max_steps 60

Without a pre-trained model it builds a tiny Llama (`--model_size tiny`) and a tokenizer on the new text.
On GPUs, any causal LM: `--model_name_or_path meta-llama/Llama-3.1-8B --dataset_name <hub id> --bf16`.

The log line `adapter: ...` gives the trainable fraction; `fed_inter_group_bytes` in the logs grows by
the adapter's local shard bytes per averaging, that fraction of what full-model averaging would send.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, HfArgumentParser, default_data_collator, set_seed

from hf_fedshard import FedShardTrainer, FedShardTrainingArguments
from hf_fedshard.errors import exit_on_config_error
from hf_fedshard.integrations.fsdp import loads_weights
from hf_fedshard.tools.data import EMBEDDED, load_text, pack, train_bpe_tokenizer
from hf_fedshard.tools.models import PRESETS, SMOLLM2, build_model, resolve_model


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default="outputs/tiny-fl-fsdp",
        metadata={
            "help": f"Model to adapt (local folder, Hub id, or {SMOLLM2} offline). If the default folder is absent, "
            "a preset is built."
        },
    )
    model_size: str = field(
        default="tiny", metadata={"help": "Preset built when there is no model to load.", "choices": list(PRESETS)}
    )


@dataclass
class LoraArguments:
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: str = field(
        default="q_proj,k_proj,v_proj,o_proj", metadata={"help": "Comma-separated module names to adapt."}
    )


@dataclass
class DataArguments:
    dataset_name: str | None = field(
        default="kjv", metadata={"help": f"A Hub dataset id, or an embedded offline corpus: {', '.join(EMBEDDED)}."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    train_file: str | None = field(default=None, metadata={"help": "A local text file to train on."})
    validation_file: str | None = field(default=None, metadata={"help": "A local text file to evaluate on."})
    block_size: int = field(default=128, metadata={"help": "Tokens per training sample (packed)."})
    vocab_size: int = field(default=8192, metadata={"help": "BPE vocabulary when a model is built from scratch."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only the first N evaluation blocks."})


def make_parser() -> HfArgumentParser:
    parser = HfArgumentParser((ModelArguments, LoraArguments, DataArguments, FedShardTrainingArguments))
    # Defaults that differ from TrainingArguments: an adapter-sized learning rate, TensorBoard, periodic evaluation.
    parser.set_defaults(
        learning_rate=1e-3, report_to=["tensorboard"], eval_strategy="steps", eval_steps=20, logging_steps=5
    )
    return parser


def _model_and_tokenizer(model_args: ModelArguments, data_args: DataArguments, raw, empty: bool):
    """The model to adapt and its tokenizer; a fresh preset (and a BPE on the new text) if the default is absent.
    ``empty``: parameters on the meta device (cpu_ram_efficient_loading fills them from rank 0's)."""
    path = model_args.model_name_or_path
    if path is not None and (Path(path).is_dir() or path != ModelArguments.model_name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        path, tokenizer = None, train_bpe_tokenizer(raw["train"], data_args.vocab_size)
    return build_model(model_args.model_size, len(tokenizer), data_args.block_size, path, empty), tokenizer


def main(argv: list[str] | None = None) -> dict[str, float]:
    model_args, lora_args, data_args, args = make_parser().parse_args_into_dataclasses(argv)
    model_args.model_name_or_path = resolve_model(model_args.model_name_or_path)
    set_seed(args.seed)
    raw = load_text(
        data_args.dataset_name, data_args.dataset_config_name, data_args.train_file, data_args.validation_file
    )
    model, tokenizer = _model_and_tokenizer(model_args, data_args, raw, empty=not loads_weights(args))
    blocks = pack(raw, tokenizer, data_args.block_size)
    evaluation = blocks["validation"]
    if data_args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(data_args.max_eval_samples, len(evaluation))))
    lora = LoraConfig(
        r=lora_args.lora_r,
        lora_alpha=lora_args.lora_alpha,
        lora_dropout=lora_args.lora_dropout,
        target_modules=lora_args.lora_target_modules.split(","),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    trainable, total = model.get_nb_trainable_parameters()
    print(f"adapter: {trainable:,} of {total:,} parameters trainable ({trainable / total:.3%}); only they are averaged")

    trainer = FedShardTrainer(
        model=model,
        args=args,
        train_dataset=blocks["train"],
        eval_dataset=evaluation,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    before = trainer.evaluate(metric_key_prefix="eval_before")
    train_result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = {**before, **train_result.metrics, **trainer.evaluate()}
    metrics.update(trainable_parameters=trainable, trainable_fraction=trainable / total)
    trainer.save_model()
    trainer.save_metrics("all", metrics)
    trainer.save_state()
    trainer.create_model_card(
        dataset=data_args.train_file or data_args.dataset_name,
        tokens_per_sample=data_args.block_size,
        tags=["lora", "peft"],
        command=shlex.join(["recipes/finetune_lora.py", *(sys.argv[1:] if argv is None else argv)]),
    )
    if trainer.is_world_process_zero():
        print(f"eval perplexity on {data_args.dataset_name}: {before['eval_before_perplexity']:.2f} before, "
              f"{metrics['eval_perplexity']:.2f} after")  # fmt: skip
        fed = trainer.fed_callback.metrics() if trainer.fed_callback is not None else {}
        if fed.get("fed_syncs"):
            sent = fed["fed_inter_group_bytes"] / fed["fed_syncs"]
            full = 4 * total / trainer.fed_layout.shard_size  # fp32 shard of every parameter
            print(f"inter-group bytes per averaging: {sent:,.0f} (adapter) vs {full:,.0f} for the full model")
    return metrics


if __name__ == "__main__":
    exit_on_config_error(main)

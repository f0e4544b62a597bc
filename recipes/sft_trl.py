"""Supervised fine-tuning with TRL's `SFTTrainer` under FL+FSDP: `FedShardSFTTrainer`, offline by default.

Offline on a CPU machine (4 processes = 2 groups × 2 ranks), fine-tuning the Quickstart's model (or, without it,
a fresh tiny Llama) on the King James Bible, with perplexity on held-out books before and after:

    accelerate launch --config_file accelerate_configs/fl_fsdp_cpu.yaml recipes/sft_trl.py \\
        --output_dir outputs/tiny-sft-kjv --fed_group_size 2 --fed_sync_steps 8 --max_steps 48

The same with a LoRA adapter (`peft_config`: only the adapter is trained, so only it crosses groups):

    accelerate launch --config_file accelerate_configs/fl_fsdp_cpu.yaml recipes/sft_trl.py \\
        --output_dir outputs/tiny-sft-kjv-lora --fed_group_size 2 --fed_sync_steps 8 --max_steps 48 --use_peft

A real chat model on an offline chat corpus: SmolLM2-135M-Instruct on Shakespeare's dialogue (`shakespeare-chat`:
each conversation four consecutive speeches of a scene, user and assistant in turn), which SFTTrainer renders with
the model's chat template (rank 0 prints the first training sequence as formatted):

    accelerate launch --config_file accelerate_configs/fl_fsdp_cpu.yaml recipes/sft_trl.py \\
        --output_dir outputs/smollm2-sft-chat --model_name_or_path smollm2-135m-instruct \\
        --dataset_name shakespeare-chat --fed_group_size 2 --fed_sync_steps 8 --max_steps 48

The loss on the assistant's turns only: `--assistant_only_loss true` needs a chat template with `{% generation %}`
markers, which TRL cannot add to SmolLM2's; give it the one shipped here, which renders the same text:
`--chat_template_path recipes/chat_templates/smollm2_training.jinja`.

With network access, any Hub model and dataset (a model given as a Hub id is loaded by SFTTrainer itself;
conversational datasets go through its chat template), e.g. on one node of 8 GPUs as 2 groups of 4:

    accelerate launch --config_file accelerate_configs/fl_fsdp.yaml --num_processes 8 recipes/sft_trl.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/Capybara --fed_group_size 4 --bf16 \\
        --packing_strategy bfd --output_dir outputs/qwen-sft

Defaults that differ from SFTConfig: `bf16` off (CPUs; pass `--bf16` on GPUs), packing on with the "wrapped"
strategy into `max_length`=128-token blocks, a 1e-4 learning rate (an adapter usually wants more: `--use_peft`
with `--learning_rate 1e-3`), evaluation every 16 steps. A text dataset is tokenized once per machine
(`hf_fedshard.tools.data.prepare_once`); SFTTrainer packs it, and renders, tokenizes and packs a chat corpus.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from datasets import DatasetDict
from peft import LoraConfig
from transformers import AutoTokenizer, HfArgumentParser, PreTrainedTokenizerBase, set_seed

from hf_fedshard.errors import ConfigError, exit_on_config_error
from hf_fedshard.integrations.fsdp import loads_weights
from hf_fedshard.tools.data import CHAT, EMBEDDED, load_text, prepare_once, shakespeare_chat, train_bpe_tokenizer
from hf_fedshard.tools.models import PRESETS, SMOLLM2, build_model, resolve_model
from hf_fedshard.trl import FedShardSFTConfig, FedShardSFTTrainer

QUICKSTART_MODEL = "outputs/tiny-fl-fsdp"


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(
        default=QUICKSTART_MODEL,
        metadata={"help": f"Model to fine-tune (local folder, Hub id, or {SMOLLM2} offline). If the default folder "
                  "is absent, a fresh --model_size preset is built with a BPE trained on the data."},
    )  # fmt: skip
    model_size: str = field(
        default="tiny", metadata={"help": "Preset built when there is no model to load.", "choices": list(PRESETS)}
    )
    dataset_name: str = field(
        default="kjv",
        metadata={"help": f"A Hub dataset id, an embedded offline corpus ({', '.join(EMBEDDED)}), or the offline chat "
                  f"corpus {', '.join(CHAT)} (conversations, through the model's chat template)."},
    )  # fmt: skip
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    max_eval_samples: int | None = field(default=64, metadata={"help": "Keep only the first N evaluation rows."})
    vocab_size: int = field(default=8192, metadata={"help": "BPE vocabulary when a model is built from scratch."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter (peft_config) instead."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_target_modules: str = field(
        default="q_proj,k_proj,v_proj,o_proj", metadata={"help": "Comma-separated module names to adapt."}
    )


def make_parser() -> HfArgumentParser:
    parser = HfArgumentParser((ScriptArguments, FedShardSFTConfig))
    parser.set_defaults(
        bf16=False, packing=True, packing_strategy="wrapped", max_length=128, learning_rate=1e-4,
        lr_scheduler_type="constant", report_to=["tensorboard"], eval_strategy="steps", eval_steps=16,
        logging_steps=8, save_strategy="no",
    )  # fmt: skip
    return parser


def load_data(script: ScriptArguments) -> DatasetDict:
    """The train and validation splits: a ``text`` column, or ``messages`` for a chat corpus."""
    if script.dataset_name in CHAT:
        return shakespeare_chat()
    return load_text(script.dataset_name, script.dataset_config_name)


def prepare(
    script: ScriptArguments, model_path: str | None, args: FedShardSFTConfig
) -> tuple[DatasetDict, PreTrainedTokenizerBase]:
    """Text datasets tokenized (with EOS) by the model's tokenizer, or by a BPE trained on them; once per machine.
    Conversations are left to SFTTrainer, which renders them with the tokenizer's chat template."""
    raw = load_data(script)
    if script.max_eval_samples is not None:
        raw["validation"] = raw["validation"].select(range(min(script.max_eval_samples, len(raw["validation"]))))
    if model_path is not None:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    else:
        tokenizer = train_bpe_tokenizer(raw["train"], script.vocab_size)
    if "messages" in raw["train"].column_names:
        if tokenizer.chat_template is None and args.chat_template_path is None:
            raise ConfigError(
                f"--dataset_name {script.dataset_name} holds conversations, and {model_path or 'a fresh model'} has "
                "no chat template. Fine-tune a chat model (--model_name_or_path smollm2-135m-instruct) or give "
                "--chat_template_path."
            )
        return raw, tokenizer

    def tokenize(batch: dict) -> dict:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [[*row, tokenizer.eos_token_id] for row in ids]}

    return raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names), tokenizer


def show_chat_formatting(trainer: FedShardSFTTrainer) -> None:
    """The first training sequence as SFTTrainer made it (chat template applied, tokenized, packed), and how many of
    its tokens the loss reads (all of them, or with ``assistant_only_loss`` the assistant's): what the model is
    trained on, at a glance."""
    first = trainer.train_dataset[0]
    text = trainer.processing_class.decode(first["input_ids"])
    line = f"first training sequence, as SFTTrainer formatted it: {text[:200]!r}"
    if "labels" in first:  # SFTTrainer's labels: -100 where a mask (assistant, completion) keeps a token out
        line += f"; the loss reads {sum(t != -100 for t in first['labels'])} of its {len(first['labels'])} tokens"
    print(line, flush=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    script, args = make_parser().parse_args_into_dataclasses(argv)
    script.model_name_or_path = resolve_model(script.model_name_or_path)
    set_seed(args.seed)
    local = script.model_name_or_path if Path(script.model_name_or_path).is_dir() else None
    if local is None and script.model_name_or_path != QUICKSTART_MODEL:
        # A Hub id: SFTTrainer loads the model and its tokenizer, and prepares the data (on every rank).
        model, tokenizer = script.model_name_or_path, None
        data = load_data(script)
    else:  # the Quickstart's model, or a fresh preset when it is absent
        key = {"recipe": "sft_trl", **vars(script), "model": local and str(Path(local).resolve())}
        data, tokenizer = prepare_once(args, key, lambda: prepare(script, local, args))
        model = build_model(script.model_size, len(tokenizer), args.max_length, local, empty=not loads_weights(args))
    peft_config = None
    if script.use_peft:
        peft_config = LoraConfig(
            r=script.lora_r, lora_alpha=script.lora_alpha, target_modules=script.lora_target_modules.split(",")
        )
    trainer = FedShardSFTTrainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    if script.use_peft:
        trainable, total = trainer.model.get_nb_trainable_parameters()
    else:
        trainable = total = sum(p.numel() for p in trainer.model.parameters())
    if trainer.is_world_process_zero() and "messages" in data["train"].column_names:
        show_chat_formatting(trainer)
    before = trainer.evaluate(metric_key_prefix="eval_before")
    train_result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = {**before, **train_result.metrics, **trainer.evaluate()}
    metrics.update(trainable_parameters=trainable, trainable_fraction=trainable / total)
    trainer.save_model()
    trainer.save_metrics("all", metrics)
    trainer.save_state()
    trainer.create_model_card(
        model_name=Path(args.output_dir).name,
        dataset_name=script.dataset_name,
        hub_dataset=script.dataset_name not in (*EMBEDDED, *CHAT),
        tokens_per_sample=args.max_length,
        command=shlex.join(["recipes/sft_trl.py", *(sys.argv[1:] if argv is None else argv)]),
    )
    if trainer.is_world_process_zero():
        print(f"eval perplexity on {script.dataset_name}: {before['eval_before_perplexity']:.2f} before, "
              f"{metrics['eval_perplexity']:.2f} after")  # fmt: skip
        fed = trainer.fed_callback.metrics() if trainer.fed_callback is not None else {}
        if fed.get("fed_syncs"):
            what = f"adapter, {trainable / total:.2%} of the parameters" if script.use_peft else "full model"
            sent, syncs = fed["fed_inter_group_bytes"], fed["fed_syncs"]
            print(f"inter-group bytes per rank: {sent:,} in {syncs} averagings ({what}), "
                  f"{sent / trainer.state.global_step:,.0f} per optimizer step")  # fmt: skip
    return metrics


if __name__ == "__main__":
    exit_on_config_error(main)

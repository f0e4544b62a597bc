"""hf_fedshard's part of a run's Hub model card: a section, tags, the eval perplexity, training curves.

The card is the trainer's own (`Trainer.create_model_card`: hyperparameters, results table, framework versions;
or a subclass's, such as TRL's), loaded back with `huggingface_hub.ModelCard` and extended: the eval perplexity
joins `model-index`, and a section rendered from ``templates/card_section.md`` describes the federation where
there was one, and what the run really was otherwise. Every figure comes from the trainer's own records
(`state.log_history`, the federation counters).

What the upstream cards guess wrong is corrected in place (`correct_card_text`): where the model started (a Hub
model, a local folder's recorded origin, a local folder, or from scratch), the device, the optimizer's name, the
"More information needed" sections, and TRL's quick-start snippet.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import EvalResult, ModelCard
from transformers import TrainerCallback, TrainerState

from hf_fedshard.engine.settings_history import History, describe_history
from hf_fedshard.startup import first_step_done, moment

if TYPE_CHECKING:
    from hf_fedshard.engine.fragments import Schedule
    from hf_fedshard.integrations.trainer import FedShardTrainer

TEMPLATE = Path(__file__).parent / "templates" / "card_section.md"
PLOT_NAME = "training_curves.png"
# create_model_card keywords for hf_fedshard's part of the card only
CARD_EXTRAS = ("tokens_per_sample", "command", "hub_dataset")
PAPER_TITLE = "Accelerating Sharded Data Parallelism at Scale with Federated Learning"
PAPER_BIBTEX = """@inproceedings{fedshard2026,
  title     = {Accelerating Sharded Data Parallelism at Scale with Federated Learning},
  booktitle = {Euro-Par 2026: Parallel Processing},
  year      = {2026}
}"""


WALL_SECONDS = "wall_seconds"
ORIGIN_FILE = "origin.json"  # in a model folder: the Hub model it was made from, and how (hf_fedshard.tools.models)


class TrainingClock(TrainerCallback):
    """Stamps every entry of `state.log_history` with the seconds since training began (``wall_seconds``).

    The stamp lives in the history, which checkpoints keep, so a resumed run continues the clock where its
    checkpoint stopped and the plot against time covers the whole run. Loggers (`report_to`) never see it.
    """

    def __init__(self) -> None:
        self._start: float | None = None  # entries logged before training (an evaluation) are at 0 s

    def on_train_begin(self, args, state, control, **kwargs):
        moment("train begin")
        resumed = state.global_step > 0
        stamps = [e[WALL_SECONDS] for e in state.log_history if WALL_SECONDS in e and e["step"] <= state.global_step]
        self._start = time.perf_counter() - (stamps[-1] if resumed and stamps else 0.0)

    def on_step_end(self, args, state, control, **kwargs):
        first_step_done()  # the start-up line (hf_fedshard.startup), once

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.log_history:
            elapsed = 0.0 if self._start is None else time.perf_counter() - self._start
            state.log_history[-1][WALL_SECONDS] = round(elapsed, 3)


@contextlib.contextmanager
def clock_hidden(state: TrainerState) -> Iterator[None]:
    """Trainer's card turns every key of `log_history` into a results column: hide the clock's stamps from it."""
    history = state.log_history
    state.log_history = [{k: v for k, v in entry.items() if k != WALL_SECONDS} for entry in history]
    try:
        yield
    finally:
        state.log_history = history


def wall_seconds(history: list[dict]) -> dict[int, float]:
    """Seconds at which each step was first logged: an evaluation's own duration is not charged to its point."""
    seconds: dict[int, float] = {}
    for entry in history:
        if WALL_SECONDS in entry:
            seconds.setdefault(entry["step"], entry[WALL_SECONDS])
    return seconds


def divergence_steps(history: list[dict]) -> list[int]:
    """Steps at which groups diverged: where the logged ``fed_diverged_groups`` rises (NaN losses are not logged)."""
    steps, count = [], 0
    for entry in history:
        if entry.get("fed_diverged_groups", count) > count:
            steps.append(entry["step"])
            count = entry["fed_diverged_groups"]
    return steps


def _last(history: list[dict], key: str) -> dict:
    return next((entry for entry in reversed(history) if key in entry), {})


def training_wall_seconds(history: list[dict]) -> float | None:
    """The whole run's training wall time: the clock's stamp on the last ``train_runtime`` entry.

    Trainer's ``train_runtime`` covers only the last `train()` call, so after a resume it is a fraction of the run
    whose averaging time (``fed_sync_seconds_total``, kept in checkpoints) the card divides; the stamp is not.
    """
    return _last(history, "train_runtime").get(WALL_SECONDS)


def setup_description(trainer: FedShardTrainer) -> str:
    """What the run really was, in a few words: the method with a federation, the plain set-up without one."""
    layout, world = trainer.fed_layout, trainer.args.world_size
    if layout.federated:
        return layout.method
    if trainer.is_fsdp_enabled and layout.replicas > 1:
        return f"HSDP (FSDP2, {layout.replicas} replicas × {layout.shard_size} shards) over {world} ranks"
    if trainer.is_fsdp_enabled:
        return f"FSDP2 over {world} rank{'s' if world > 1 else ''}"
    return f"data parallel (DDP) over {world} ranks, no FSDP" if world > 1 else "one process, no FSDP"


def averaging_description(history: History, schedule: Schedule) -> str:
    """What the averagings did, in one cell: the outer optimizer and wire dtype (each stretch of the run, when a
    resume changed them), then the schedule."""
    timing = f"{schedule.fragments} fragment(s), " if schedule.fragments > 1 else ""
    timing += f"each exchange {schedule.overlap} step(s) behind training" if schedule.overlap else "blocking"
    return describe_history(history) + (", " if len(history) == 1 else "; ") + timing


def _averaging(trainer: FedShardTrainer) -> str:
    return averaging_description(trainer.fed_callback.settings_history, trainer.args.fed_schedule)


def results_table(trainer: FedShardTrainer, tokens_per_sample: int | None) -> list[tuple[str, str]]:
    """(quantity, value) rows of the card's results table, all read from the run's own records.

    The federation rows (groups, H, inter-group traffic) only where there was a federation.
    """
    args, layout, history = trainer.args, trainer.fed_layout, trainer.state.log_history
    per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
    samples_seen = trainer.state.global_step * per_rank * layout.world_size
    train, evaluation, fed = _last(history, "train_runtime"), _last(history, "eval_loss"), _last(history, "fed_syncs")
    wall_s = training_wall_seconds(history)
    sizes = layout.distinct_sizes  # groups of unequal size: each size's batch
    group_batch = "/".join(str(per_rank * size) for size in sizes)
    if tokens_per_sample:
        group_batch += f" ({'/'.join(f'{per_rank * size * tokens_per_sample:,}' for size in sizes)} tokens)"
    rows = [("Method", setup_description(trainer)), ("World size (ranks)", str(layout.world_size))]
    if layout.federated:
        shards = "each group's own" if layout.shard_size is None else str(layout.shard_size)
        rows += [
            ("Federation groups", str(layout.num_groups)),
            ("Group size (ranks)", layout.group_size_arg),
            ("Shard size (ranks)", shards),
            ("H (optimizer steps between averagings)", str(args.fed_sync_steps)),
            ("Group batch (samples per optimizer step)", group_batch),
            ("Averaging", _averaging(trainer)),
        ]
    else:
        rows.append(("Batch (samples per optimizer step)", group_batch))
    rows += [
        ("Optimizer steps", str(trainer.state.global_step)),
        ("Tokens seen (world)", f"{samples_seen * tokens_per_sample:,}" if tokens_per_sample else "—"),
    ]
    if "train_samples_per_second" in train and tokens_per_sample:
        rows.append(("Train tokens/s (world)", f"{train['train_samples_per_second'] * tokens_per_sample:,.0f}"))
    if evaluation:
        rows += [("Final eval loss", f"{evaluation['eval_loss']:.4f}"),
                 ("Final eval perplexity", f"{evaluation['eval_perplexity']:.2f}")]  # fmt: skip
    if fed:
        rows += [("Inter-group syncs", str(fed["fed_syncs"])),
                 ("Inter-group bytes sent per rank", f"{fed['fed_inter_group_bytes']:,}")]  # fmt: skip
        if "fed_sync_seconds_total" in fed:
            share = f" ({fed['fed_sync_seconds_total'] / wall_s:.1%} of training)" if wall_s else ""
            rows.append(("Time in inter-group averaging (s, rank 0)", f"{fed['fed_sync_seconds_total']:.2f}{share}"))
        if "fed_groups_in_quorum" in fed:
            rows += quorum_rows(history, layout.num_groups, fed)
        if fed.get("fed_diverged_groups"):
            steps = ", ".join(map(str, divergence_steps(history)))
            rows.append(
                ("Diverged groups restarted from the others", f"{fed['fed_diverged_groups']} (at step {steps})")
            )
    if wall_s is not None:
        rows.append(("Training wall time (s)", f"{wall_s:.1f}"))
    return rows


def quorum_rows(history: list[dict], num_groups: int, last: dict) -> list[tuple[str, str]]:
    """fed_transport torchft: how many groups took part in the averagings, how many healed from a live peer, and
    whether the final averaging ran without groups of the one before (they healed at the end of training, or
    the log's end line names them)."""
    counts = [h["fed_groups_in_quorum"] for h in history if "fed_groups_in_quorum" in h]
    rows = [
        ("Transport", "torchft (one launch per group; each averaging over the groups alive)"),
        ("Groups per averaging (fewest–most logged)", f"{min(counts)}–{max(counts)} of {num_groups}"),
        ("Groups healed from a live peer", str(last["fed_heals"])),
    ]
    if last.get("fed_groups_dropped"):
        final = f"{last['fed_groups_in_quorum']} groups, without {last['fed_groups_dropped']} of the averaging before"
        rows.append(("Final averaging", f"{final} (they left or came late: the end of training's log line says which)"))
    return rows


def _is_group_ppl(key: str) -> bool:
    return key.startswith("eval_group") and key.endswith("_perplexity")


def _curves(history: list[dict]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Panel name -> line label -> (step, value) points: the global model, and each group's own if evaluated."""

    def points(key: str) -> list[tuple[int, float]]:
        return [(e["step"], e[key]) for e in history if key in e]

    groups = {int(k[len("eval_group") : -len("_perplexity")]) for e in history for k in e if _is_group_ppl(k)}
    evals = {"global model": points("eval_perplexity")}
    evals.update({f"group {g} (before averaging)": points(f"eval_group{g}_perplexity") for g in sorted(groups)})
    return {"eval perplexity": evals, "training loss": {"training loss": points("loss")}}


def plot_curves(history: list[dict], path: Path) -> None:
    """Eval perplexity (global model, and each group's own model when evaluated) and training loss against
    optimizer step and against wall-clock seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = wall_seconds(history)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), squeeze=False)
    for row, (name, lines) in enumerate(_curves(history).items()):
        for label, points in lines.items():
            style = {"marker": "o" if row == 0 else None, "label": label}
            if label.startswith("group"):
                style.update(linestyle="--", alpha=0.7, marker=".")
            axes[row][0].plot([s for s, _ in points], [v for _, v in points], **style)
            timed = [(seconds[s], v) for s, v in points if s in seconds]
            axes[row][1].plot([t for t, _ in timed], [v for _, v in timed], **style)
        axes[row][0].set_xlabel("optimizer step")
        axes[row][1].set_xlabel("wall-clock seconds")
        for ax in axes[row]:
            ax.set_ylabel(name)
            if row == 0:
                label_log_axis(ax)
            ax.grid(alpha=0.3)
            if len(lines) > 1:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def label_log_axis(ax: Any) -> None:
    """A log y axis whose ticks carry plain numbers at 1, 2, 3 and 5 × 10^k: a perplexity that ends inside one decade
    (say 227–497) would otherwise show no label at all over that range."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_locator(LogLocator(subs=(2, 3, 5)))
    ax.yaxis.set_minor_formatter(plain)


def _perplexity_result(trainer: FedShardTrainer, dataset: str | None) -> EvalResult | None:
    """The last eval perplexity as a `model-index` entry (what the Hub shows as the model's result)."""
    evaluation = _last(trainer.state.log_history, "eval_perplexity")
    if not evaluation:
        return None
    return EvalResult(
        task_type="text-generation",
        task_name="Causal language modeling",
        dataset_type=dataset or "unknown",
        dataset_name=dataset or "unknown",
        metric_type="perplexity",
        metric_name="Perplexity",
        metric_value=round(evaluation["eval_perplexity"], 4),
    )


def card_section(trainer: FedShardTrainer, tokens_per_sample: int | None = None, command: str | None = None) -> str:
    """hf_fedshard's section of the card: the federation where there was one, the plain set-up otherwise."""
    import jinja2

    layout = trainer.fed_layout
    return jinja2.Template(TEMPLATE.read_text()).render(
        federated=layout.federated,
        method=layout.method,
        layout=layout.describe(),
        averaging=_averaging(trainer) if layout.federated else None,
        setup=setup_description(trainer),
        rows=results_table(trainer, tokens_per_sample),
        plot=PLOT_NAME,
        command=command,
        world_size=layout.world_size,
        paper_title=PAPER_TITLE,
        paper_bibtex=PAPER_BIBTEX,
    )


@dataclass(frozen=True)
class Start:
    """Where a run's model started: a Hub model (``base_model``, perhaps from a folder's recorded origin), a local
    folder that records none (``local``), or neither (trained from scratch)."""

    base_model: str | None = None
    local: str | None = None
    weights: str | None = None  # how the weights differ from the Hub model's ("dequantized from GGUF Q4_1")
    license: str | None = None

    def sentence(self, dataset: str | None) -> str:
        """The card's opening sentence (Trainer's and TRL's both guess it from a Hub id alone)."""
        if self.base_model:
            link = f"[{self.base_model}](https://huggingface.co/{self.base_model})"
            start = f"was fine-tuned from {link}" + (f" (weights {self.weights})" if self.weights else "")
        elif self.local:
            start = f"was fine-tuned from the local model `{self.local}`"
        else:
            start = "was trained from scratch"
        return f"This model {start} on {f'the {dataset} dataset' if dataset else 'an unknown dataset'}."


def read_origin(name_or_path: str | None) -> dict | None:
    """The origin a local model folder records in ``origin.json``, or None."""
    path = Path(name_or_path) / ORIGIN_FILE if name_or_path else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def starting_point(name_or_path: str | None) -> Start:
    """Where a model loaded from ``name_or_path`` (its config's ``_name_or_path``; empty when built from a config)
    started: a folder's ``origin.json`` names its Hub model, another folder is named as it is, else a Hub id."""
    origin = read_origin(name_or_path)
    if origin is not None:
        return Start(base_model=origin["base_model"], weights=origin.get("weights"), license=origin.get("license"))
    if not name_or_path:
        return Start()
    return Start(local=name_or_path) if Path(name_or_path).is_dir() else Start(base_model=name_or_path)


def _device(trainer: FedShardTrainer) -> str:
    """Trainer writes "multi-GPU" for any distributed run: name the device the ranks really ran on."""
    kind = trainer.args.device.type
    return f"multi-{ {'cuda': 'GPU'}.get(kind, kind.upper()) }"


def optimizer_description(args: Any) -> str:
    """The optimizer as its ``--optim`` name and settings (Trainer writes "Use OptimizerNames.X with ...")."""
    name = getattr(args.optim, "value", args.optim)
    settings = f" (betas {args.adam_beta1}, {args.adam_beta2}; epsilon {args.adam_epsilon})" if "adam" in name else ""
    return name + settings + (f", optim_args {args.optim_args}" if args.optim_args else "")


def _model_description(model: Any) -> str:
    """Trainer's "Model description" placeholder: the shape, from the config (DTensor parameters count whole)."""
    config = model.config
    tied = ", tied input and output embeddings" if getattr(config, "tie_word_embeddings", False) else ""
    return (
        f"A {config.model_type} causal language model of {sum(p.numel() for p in model.parameters()):,} "
        f"parameters: {config.num_hidden_layers} layers, hidden size {config.hidden_size}, vocabulary "
        f"{config.vocab_size:,}{tied}."
    )


def _data_description(trainer: FedShardTrainer, dataset: str | None) -> str | None:
    """Trainer's "Training and evaluation data" placeholder: the dataset as given and its sizes (None: unknown)."""
    if dataset is None:
        return None
    sizes = [
        f"{len(data):,} {split} samples"
        for split, data in (("training", trainer.train_dataset), ("evaluation", trainer.eval_dataset))
        if hasattr(data, "__len__") and not isinstance(data, dict)
    ]
    return f"The {dataset} dataset" + (f": {' and '.join(sizes)}." if sizes else ".")


def quick_start(location: str, chat: bool) -> str:
    """TRL's quick-start snippet, loading this model from ``location`` (TRL's loads ``hub_model_id``: "None" unless
    pushed), with a chat prompt only where the tokenizer has a chat template."""
    load = f'generator = pipeline("text-generation", model="{location}")\n'
    if chat:
        prompt = '[{"role": "user", "content": "What is the capital of France?"}]'
        call = f'print(generator({prompt}, max_new_tokens=64, return_full_text=False)[0]["generated_text"])\n'
    else:
        call = 'print(generator("Once upon a time", max_new_tokens=64)[0]["generated_text"])\n'
    return "from transformers import pipeline\n\n" + load + call


def correct_card_text(text: str, trainer: FedShardTrainer, start: Start, dataset: str | None) -> str:
    """The upstream card's text with what it guessed replaced by what ran (each a no-op where it is absent)."""
    text = re.sub(r"^This model (is a fine-tuned version of|was trained from scratch) .*$",
                  lambda _: start.sentence(dataset), text, count=1, flags=re.M)  # fmt: skip
    text = re.sub(r"^- distributed_type: .*$", lambda _: f"- distributed_type: {_device(trainer)}", text, flags=re.M)
    optimizer = f"- optimizer: {optimizer_description(trainer.args)}"
    text = re.sub(r"^- optimizer: Use .*?(?=\n- |\n\n)", lambda _: optimizer, text, flags=re.M | re.S)
    known = {"Model description": _model_description(trainer.model), "Training and evaluation data":
             _data_description(trainer, dataset)}  # fmt: skip
    text = re.sub(r"\n## ([^\n]+)\n\nMore information needed\n",
                  lambda m: f"\n## {m[1]}\n\n{known[m[1]]}\n" if known.get(m[1]) else "", text)  # fmt: skip
    location = getattr(trainer, "hub_model_id", None) or trainer.args.output_dir
    chat = getattr(trainer.processing_class, "chat_template", None) is not None
    return re.sub(r"(## Quick start\n\n```python\n).*?(```)",
                  lambda m: m[1] + quick_start(location, chat) + m[2], text, count=1, flags=re.S)  # fmt: skip


def correct_card(
    card: ModelCard, trainer: FedShardTrainer, finetuned_from: str | None, dataset: str | None, hub_dataset: bool = True
) -> None:
    """Metadata and text of the upstream card made right for what ran: ``base_model`` (from the model's own
    origin unless ``finetuned_from`` is given) and the tags naming it, the license a recorded origin names, no TRL
    placeholders, and no ``datasets`` entry (a Hub link) for data that is not a Hub dataset."""
    start = starting_point(finetuned_from or getattr(trainer.model.config, "_name_or_path", None))
    card.data.base_model = start.base_model
    card.data.license = card.data.license or start.license
    card.data.pop("licence", None)  # TRL's misspelt placeholder ("licence: license")
    # PEFT tags an adapter "base_model:adapter:<where it was loaded from>", a local path for a converted model.
    base = f":{start.base_model}"
    card.data.tags = [t for t in card.data.tags or [] if not t.startswith("base_model:") or t.endswith(base)] or None
    if not hub_dataset:
        card.data.datasets = None
    card.text = correct_card_text(card.text, trainer, start, dataset)


def extend_card(
    trainer: FedShardTrainer,
    dataset: str | None = None,
    dataset_name: str | None = None,
    tokens_per_sample: int | None = None,
    command: str | None = None,
    finetuned_from: str | None = None,
    hub_dataset: bool = True,
    **_unused: Any,
) -> Path:
    """Add hf_fedshard's section, tags, plot and eval perplexity to the card the trainer just wrote (Trainer's or
    a subclass's README.md); call on the main process only.

    Args:
        dataset / dataset_name: the training data's name (`Trainer.create_model_card` / TRL's keyword).
        tokens_per_sample: tokens in one sample (block size), for the token counts of the results table.
        command: the script and its arguments, for "How to reproduce".
        finetuned_from: where the model started, if not where it was loaded from (`Trainer.create_model_card`).
        hub_dataset: False for data that is not a Hub dataset (an offline corpus, local files): no Hub link to it.
    """
    out = Path(trainer.args.output_dir)
    path = out / "README.md"
    card = ModelCard.load(path)
    correct_card(card, trainer, finetuned_from, dataset or dataset_name, hub_dataset)
    layout = trainer.fed_layout
    tags = ["hf_fedshard"]
    if trainer.is_fsdp_enabled:
        tags.append("fsdp2")
    if layout.federated:
        tags += [layout.method.lower().replace("+", "-"), "federated-averaging"]
    card.data.tags = [*(card.data.tags or []), *(t for t in tags if t not in (card.data.tags or []))]
    result = _perplexity_result(trainer, dataset or dataset_name)
    if result is not None:
        card.data.model_name = card.data.model_name or out.name
        others = [r for r in card.data.eval_results or [] if r.metric_type != "perplexity"]
        card.data.eval_results = [*others, result]
    plot_curves(trainer.state.log_history, out / PLOT_NAME)
    card.text = card.text.rstrip() + "\n\n" + card_section(trainer, tokens_per_sample, command) + "\n"
    card.save(path)
    return path

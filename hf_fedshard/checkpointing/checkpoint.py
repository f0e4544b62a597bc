"""Federated checkpoints: every group saves its own shards, and a checkpoint is complete or absent.

Between two averagings the groups hold different models and optimizer moments, so each group writes its own
copy with distributed checkpointing (DCP) over its own ranks: no rank gathers the full model, no traffic crosses
the slow tier, and no two groups write the same keys (Accelerate's FSDP save runs DCP over the whole world,
where they would). A federated ``checkpoint-N/`` holds::

    fed_layout.json                   format version, layout and model fingerprint: read first at a resume, so
                                      another format, layout or model fails with one clear line
    fed_group{g}/model/               DCP checkpoint of group g's model shards, written by group g's ranks only
    fed_group{g}/optimizer/           DCP checkpoint of group g's optimizer state
    fed_group{g}/fedavg_rank{r}.json  averaging counters of rank r (syncs, bytes sent, last averaged step, ...)
    fed_group{g}/in_flight_rank{r}.pt rank r's overlapped exchange in flight at the save (its snapshot and mean
                                      Δ, to apply at its scheduled step after a resume); absent when none was
    fed_outer/                        DCP checkpoint of the anchor and outer momentum by parameter name (equal
                                      in every group: group 0 writes it, every group reads it, on any layout)
    config.json, scheduler.pt, rng_state_{r}.pth, trainer_state.json   Trainer's own files
    manifest.json                     every other file's size and SHA-256, written last (`checkpointing.manifest`)

Everything is written into ``tmp-checkpoint-N/`` and renamed to ``checkpoint-N/`` once every rank has finished,
so a job killed while saving leaves the previous checkpoints intact and no ``checkpoint-N`` that looks complete
(Trainer's ``get_last_checkpoint`` and `latest_complete_checkpoint` only see ``checkpoint-N`` names).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_fedshard.checkpointing.manifest import write_manifest
from hf_fedshard.errors import ConfigError
from hf_fedshard.topology import FederationLayout

FED_LAYOUT_NAME = "fed_layout.json"
FORMAT_VERSION = 1
"""The checkpoint format this release writes (``"format"`` in ``fed_layout.json``) and the only one it loads: a
checkpoint without one, or of another version, is refused in one line before anything else is read
(`check_format`). Raise it with any change that a checkpoint written before cannot be read through."""
OUTER_DIR = "fed_outer"
STAGING_PREFIX = "tmp-"
DAMAGED_PREFIX = "damaged-"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def group_dir(checkpoint: str | Path, group_index: int) -> str:
    """The folder of one group's files inside a checkpoint."""
    return os.path.join(checkpoint, f"fed_group{group_index}")


def complete_checkpoints(output_dir: str | Path) -> list[str]:
    """The ``checkpoint-N`` folders that hold ``trainer_state.json`` (written last), newest (highest N) first.

    Federated checkpoints appear by rename only when complete; the file test also skips a plain Trainer
    checkpoint whose job died while writing it.
    """
    if not os.path.isdir(output_dir):
        return []
    steps = [
        (int(match.group(1)), name)
        for name in os.listdir(output_dir)
        if (match := _CHECKPOINT_RE.match(name)) and os.path.isfile(os.path.join(output_dir, name, TRAINER_STATE_NAME))
    ]
    return [os.path.join(output_dir, name) for _, name in sorted(steps, reverse=True)]


def steps_every_group_has(output_dir: str) -> set[int] | None:
    """The checkpoint steps present in every group's folder beside ``output_dir`` (``…/fed_group{G}``), or
    ``None`` where no other group's folder is visible (no shared file system: each group resumes its own; or a first
    run, whose folders another rank has not made yet)."""
    parent = os.path.dirname(os.path.abspath(output_dir))
    names = os.listdir(parent) if os.path.isdir(parent) else []
    groups = [os.path.join(parent, name) for name in names if name.startswith("fed_group")]
    if len(groups) < 2:
        return None
    sets = [{int(c.rsplit("-", 1)[-1]) for c in complete_checkpoints(g)} for g in groups]
    return set.intersection(*sets)


def latest_complete_checkpoint(output_dir: str | Path) -> str | None:
    """The newest of `complete_checkpoints`, or ``None``."""
    return next(iter(complete_checkpoints(output_dir)), None)


def set_aside(checkpoint: str) -> str:
    """Rename a damaged checkpoint to ``damaged-checkpoint-N[-k]`` (never delete it); return the new path.

    The new name is invisible to resuming and to Trainer's rotation (both match ``checkpoint-*``), and a later save
    of the same step writes a fresh ``checkpoint-N``.
    """
    run_dir, name = os.path.split(checkpoint)
    target = os.path.join(run_dir, DAMAGED_PREFIX + name)
    suffix = 1
    while os.path.exists(target):
        suffix += 1
        target = os.path.join(run_dir, f"{DAMAGED_PREFIX}{name}-{suffix}")
    os.rename(checkpoint, target)
    return target


class CheckpointReadError(RuntimeError):
    """A file (or DCP folder) of a checkpoint could not be read; the message names it."""


@contextlib.contextmanager
def reading(path: str) -> Iterator[None]:
    """Name ``path`` when reading it fails: torch.load and DCP say what went wrong, never in which file.

    DCP's `CheckpointException` derives from `BaseException`, so it is named here explicitly.
    """
    try:
        yield
    except (Exception, CheckpointException) as err:
        raise CheckpointReadError(f"cannot read {path} ({_one_line(err)})") from err


def _one_line(err: BaseException) -> str:
    """What went wrong, on one line: DCP's exception carries every failed rank's traceback; keep their errors."""
    if isinstance(err, CheckpointException):
        causes = sorted({f"{type(exc).__name__}: {exc}" for exc, _ in err.failures.values()})
        return " ".join(f"rank(s) {sorted(err.failures)}: {'; '.join(causes)}".split())
    return " ".join(f"{type(err).__name__}: {err}".split())


def _unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under Accelerate's wrapper (DCP's helpers step it to initialise empty state)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def dcp_write(state: dict[str, Any], directory: str, group: ProcessGroup) -> None:
    """Write ``state`` with DCP over ``group`` now: the synchronous `StateWrite` (the background one:
    `hf_fedshard.checkpointing.background.BackgroundCheckpointer.write`)."""
    dcp.save(state, checkpoint_id=directory, process_group=group)


StateWrite = Callable[[dict[str, Any], str, ProcessGroup], None]
"""How a save writes one DCP state (``state``, ``directory``, ``group``): now, or staged for the background."""


def save_group_model(model: nn.Module, directory: str, group: ProcessGroup, write: StateWrite = dcp_write) -> None:
    """Write this group's model shards with DCP; every rank of ``group`` (and only those) must call it."""
    write({"model": get_model_state_dict(model)}, directory, group)


def load_group_model(model: nn.Module, directory: str, group: ProcessGroup) -> None:
    """Read this group's model shards in place; every rank of ``group`` must call it."""
    state = {"model": get_model_state_dict(model)}
    with reading(directory):
        dcp.load(state, checkpoint_id=directory, process_group=group)
    set_model_state_dict(model, state["model"])


def save_group_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    directory: str,
    group: ProcessGroup,
    write: StateWrite = dcp_write,
) -> None:
    """Write this group's optimizer state (sharded like its parameters) with DCP."""
    write({"optimizer": get_optimizer_state_dict(model, _unwrap_optimizer(optimizer))}, directory, group)


def load_group_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, group: ProcessGroup
) -> None:
    """Read this group's optimizer state in place."""
    optimizer = _unwrap_optimizer(optimizer)
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    with reading(directory):
        dcp.load(state, checkpoint_id=directory, process_group=group)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """What must match to resume: the model type, its parameter count and a hash of every name and global shape.

    Names and shapes are the same before and after FSDP2 sharding (a DTensor reports its global shape).
    """
    shapes = sorted((name, tuple(p.shape)) for name, p in model.named_parameters())
    config = getattr(model, "config", None)
    return {
        "model_type": getattr(config, "model_type", type(model).__name__),
        "parameters": sum(p.numel() for p in model.parameters()),
        "shapes_sha256": hashlib.sha256(repr(shapes).encode()).hexdigest()[:16],
    }


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any] | None:
    """What must match in the tokenizer: its class, vocabulary size and a hash of every token and id (``None``
    for a processing class without a vocabulary). The model's shapes only see the vocabulary's size."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is None:
        return None
    items = sorted(vocab().items(), key=lambda item: item[1])
    return {
        "class": type(tokenizer).__name__,
        "tokens": len(items),
        "vocab_sha256": hashlib.sha256(repr(items).encode()).hexdigest()[:16],
    }


def read_layout_record(checkpoint: str) -> dict[str, Any] | None:
    """``checkpoint``'s ``fed_layout.json``, or ``None`` for a checkpoint without one (not a federated run's)."""
    path = os.path.join(checkpoint, FED_LAYOUT_NAME)
    if not os.path.isfile(path):
        return None
    with reading(path), open(path) as f:
        return json.load(f)


def check_tokenizer_matches(checkpoint: str, current: dict[str, Any] | None) -> None:
    """Refuse a checkpoint whose recorded tokenizer differs from this run's (one line, no collective)."""
    record = read_layout_record(checkpoint) if current is not None else None
    saved = None if record is None else record.get("tokenizer")
    if saved is not None and saved != current:
        raise ConfigError(
            f"resume_from_checkpoint={checkpoint} was trained with another tokenizer: {saved['class']} with "
            f"{saved['tokens']:,} tokens (vocabulary {saved['vocab_sha256']}), but this run has {current['class']} "
            f"with {current['tokens']:,} (vocabulary {current['vocab_sha256']}). Load the tokenizer saved with "
            "the run, or use another output_dir."
        )


def layout_record(layout: FederationLayout, model: nn.Module, data: dict[str, int]) -> dict[str, Any]:
    """The content of ``fed_layout.json``: the checkpoint's format, the layout, the model, and what the run read
    (``data``: a step's ``samples_per_step`` and ``steps_per_epoch``, for a resume on another layout, and the
    ``tokenizer``)."""
    return {
        "format": FORMAT_VERSION,
        "method": layout.method,
        "world_size": layout.world_size,
        "fed_group_size": layout.group_size,
        "fed_shard_size": layout.shard_size,
        "num_groups": layout.num_groups,
        "model": model_fingerprint(model),
        **data,
    }


def recorded_layout(saved: dict[str, Any]) -> FederationLayout:
    """The layout a ``fed_layout.json`` records (a list of sizes for groups of unequal size, which the layout
    takes as it takes a tuple)."""
    return FederationLayout(saved["world_size"], saved["fed_group_size"], saved["fed_shard_size"])


def write_layout_record(checkpoint: str, layout: FederationLayout, model: nn.Module, data: dict[str, int]) -> None:
    with open(os.path.join(checkpoint, FED_LAYOUT_NAME), "w") as f:
        json.dump(layout_record(layout, model, data), f, indent=2)


def check_resumable(checkpoint: str, layout: FederationLayout, model: nn.Module, federated: bool) -> None:
    """Raise `ConfigError` unless ``checkpoint`` is of the format this release loads (`check_format`, first) and was
    written by a run of this model; on another layout, unless it records the data arithmetic a layout change needs
    (``samples_per_step``: `hf_fedshard.checkpointing.reshard`).

    ``layout`` is what the checkpoint holds (this launch's groups); ``federated`` whether this run is one of a
    federation (a torchft group is, though its launch holds one group). A run of one group without federation checks
    only a federated checkpoint (and refuses it): others are Trainer's own. Reads one small file and no collective, so
    every rank raises the same error and none waits for the others.
    """
    saved = read_layout_record(checkpoint)
    if not federated and saved is None:
        return
    if saved is None:
        raise ConfigError(
            f"resume_from_checkpoint={checkpoint} has no {FED_LAYOUT_NAME}: it was not written by a federated "
            f"FedShardTrainer run, and this run is {layout.describe()}. Resume from a checkpoint of this run's "
            "output_dir, or start without resume_from_checkpoint."
        )
    check_format(saved, checkpoint)  # before any other field is read: another format may hold them otherwise
    if federated and "samples_per_step" in saved:  # another layout is resharded (checkpointing.reshard)
        check_model_matches(saved["model"], model_fingerprint(model), checkpoint)
        return
    check_layout_matches(saved, layout, checkpoint, federated)
    check_model_matches(saved["model"], model_fingerprint(model), checkpoint)


def check_format(saved: dict[str, Any], checkpoint: str) -> None:
    """Refuse a checkpoint whose ``fed_layout.json`` (``saved``) records no format or another than `FORMAT_VERSION`."""
    found = saved.get("format")
    if found != FORMAT_VERSION:
        recorded = "no checkpoint format" if found is None else f"checkpoint format {found!r}"
        raise ConfigError(
            f"resume_from_checkpoint={checkpoint} records {recorded} in {FED_LAYOUT_NAME}, but this release of "
            f"hf_fedshard loads format {FORMAT_VERSION} only. Resume it with the hf_fedshard release that wrote it, "
            "or start without resume_from_checkpoint."
        )


def check_layout_matches(saved: dict[str, Any], layout: FederationLayout, checkpoint: str, federated: bool) -> None:
    """One group resumes no federated checkpoint, and a checkpoint without its data arithmetic (``samples_per_step``)
    resumes only on its own world, group and shard sizes."""
    then = recorded_layout(saved)
    if layout != then:
        why = (
            "one group (no federation) does not resume a federated checkpoint"
            if not federated
            else "it records no data arithmetic (samples_per_step), which a resume on another layout needs"
        )
        raise ConfigError(
            f"resume_from_checkpoint={checkpoint} was written with fed_group_size={then.group_size_arg}, "
            f"fed_shard_size={then.shard_size} on WORLD_SIZE={then.world_size}, but this run has fed_group_size="
            f"{layout.group_size_arg}, fed_shard_size={layout.shard_size} on WORLD_SIZE={layout.world_size}, and "
            f"{why}. Relaunch on {then.world_size} ranks with --fed_group_size {then.group_size_arg} "
            f"--fed_shard_size {then.shard_size}, or use another output_dir."
        )


def check_model_matches(saved: dict[str, Any], current: dict[str, Any], checkpoint: str) -> None:
    if saved != current:
        raise ConfigError(
            f"resume_from_checkpoint={checkpoint} holds a different model: {saved['model_type']} with "
            f"{saved['parameters']:,} parameters (shapes {saved['shapes_sha256']}), but this run trains "
            f"{current['model_type']} with {current['parameters']:,} (shapes {current['shapes_sha256']}). Build "
            "the model from the checkpoint's config.json, or use another output_dir."
        )


def remove_staging_folders(run_dir: str) -> None:
    """Delete what jobs killed while saving left behind (no other save can be running: all ranks are here)."""
    if not os.path.isdir(run_dir):
        return
    for name in os.listdir(run_dir):
        if name.startswith(STAGING_PREFIX + PREFIX_CHECKPOINT_DIR):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def staging_dir(final_dir: str) -> str:
    """Where ``final_dir`` is written before its rename: ``tmp-checkpoint-N`` beside it."""
    run_dir, name = os.path.split(final_dir)
    return os.path.join(run_dir, STAGING_PREFIX + name)


def open_staging(final_dir: str, is_writer: bool) -> str:
    """The staging folder of ``final_dir``, emptied of what killed jobs left and created by ``is_writer``; a barrier
    over the world, so that no rank writes into it before it exists."""
    run_dir, staging = os.path.dirname(final_dir), staging_dir(final_dir)
    if is_writer:
        os.makedirs(run_dir, exist_ok=True)
        remove_staging_folders(run_dir)
        os.makedirs(staging)
    dist.barrier()
    return staging


def publish(staging: str, final_dir: str) -> None:
    """Rename the finished ``staging`` folder (its manifest written) to ``final_dir``: the moment it exists."""
    if os.path.isdir(final_dir):  # the same step saved again (a rerun in this output_dir)
        shutil.rmtree(final_dir)
    os.rename(staging, final_dir)


@contextlib.contextmanager
def atomic_checkpoint(final_dir: str, is_writer: bool) -> Iterator[str]:
    """Yield a staging folder for every rank to write into; publish it as ``final_dir`` when all are done.

    ``is_writer`` (Trainer's ``should_save``) prepares and renames, on the shared file system that DCP needs.
    A collective over the world: the barriers make the rename wait for the slowest rank's last byte, and the
    manifest (`hf_fedshard.checkpointing.manifest`) is written once every file is there.
    """
    staging = open_staging(final_dir, is_writer)
    yield staging
    dist.barrier()
    write_manifest(staging, is_writer)
    if is_writer:
        publish(staging, final_dir)
    dist.barrier()

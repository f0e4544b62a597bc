"""Checkpoints written while training goes on (``fed_async_checkpoint``).

A federated save stops training for as long as DCP takes to write every rank's shards. Here the save is cut where
the state is copied: the main thread copies each DCP state (model, optimizer, averaging state) into host memory,
writes the small files (`hf_fedshard.checkpointing.checkpoint`), and goes back to training; one background thread
per rank then writes the copies with DCP, in the order the main thread asked for them, over a gloo process group of
its own, and hashes its share of the checkpoint's files for the manifest. Not ``dcp.async_save``: each of its calls
starts a thread of its own, and four saves issuing collectives at once could order them differently on different
ranks (and the main thread's groups must not see a second thread's collectives either).

A background save goes through these phases (`Phase`):

    STAGED     this rank's copies are taken, the staging folder ``tmp-checkpoint-N/`` holds its small files.
    WRITTEN    this rank's DCP files are written; it says so with ``.ranks/rank{r}.written`` in the staging folder.
    HASHED     every rank said WRITTEN (no file changes any more): this rank described its share of the files (size,
               SHA-256) in ``.ranks/rank{r}.hashed``, so that the hashing is spread over the ranks as in a
               synchronous save, without a collective.
    PUBLISHED  (the writer, Trainer's ``should_save``) every rank said HASHED: the marks are removed, the manifest
               written from their entries, the folder renamed ``checkpoint-N/`` and older ones rotated.
    FAILED     a write or a hash raised (``.ranks/rank{r}.failed`` says so), or a rank's mark did not come within the
               timeout: nothing is renamed; at the failing `wait`, once every rank's thread ended, the writer removes
               the staging folder, so that no mark of it is found by a later save of the same step.

Invariants:
- only PUBLISHED makes a ``checkpoint-N`` name, so resuming (`latest_complete_checkpoint`) and Trainer's rotation
  never see a checkpoint in flight, and a crash at any moment leaves the newest published one as it was;
- at most one save is in flight on a rank: the next save, and the end of training, first `wait` for it (the writer
  for its publication too), and the seconds waited are counted; only then are the host copies overwritten;
- a failed write fails every rank at that wait, together (one flag all-reduced), never one rank alone.

The host copies are made at the first save and kept for the next ones (one per DCP state: model, optimizer,
averaging state), so that a save copies into memory already mapped instead of allocating and faulting in a
checkpoint's worth of pages each time: the same peak memory, held between saves. With CUDA tensors they are pinned,
so that the device-to-host copy runs at full speed. This machine has no GPU: the pinned path is untested here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.tensor import DTensor

from hf_fedshard.checkpointing.manifest import describe_share

RANKS_DIR = ".ranks"
_POLL_S = 0.05


class Phase(str, Enum):
    STAGED = "staged"
    WRITTEN = "written"
    HASHED = "hashed"
    PUBLISHED = "published"
    FAILED = "failed"


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed on some rank: the checkpoint was not published."""


@dataclass
class BackgroundSave:
    """One checkpoint in flight on this rank: its staged states, where they go, and how far it got."""

    staging: str
    final_dir: str
    writes: list[tuple[dict[str, Any], str]]
    publish: Callable[[dict[str, Any]], None] | None  # the writer's (manifest entries → manifest, rename,
    # rotation); None on the other ranks
    phase: Phase = Phase.STAGED
    error: BaseException | None = None
    thread: threading.Thread | None = field(default=None, repr=False)


class BackgroundCheckpointer:
    """This rank's background checkpoint writes: `write` stages a DCP state now, `start` writes them in a thread,
    `wait` ends the one in flight.

    ``group_ranks``: every federation group's ranks in this job (each group writes its own DCP folders over its own
    ranks, as a synchronous save does); every rank of the job must construct it at the same point, since it creates
    the process groups. ``world_size`` marks are awaited before publication. ``pinned``: the states live on a GPU.
    """

    def __init__(self, group_ranks: list[list[int]], world_size: int, timeout: timedelta, pinned: bool) -> None:
        self._group, _ = dist.new_subgroups_by_enumeration(group_ranks, timeout=timeout, backend="gloo")
        self.rank, self.world_size, self.timeout_s = dist.get_rank(), world_size, timeout.total_seconds()
        self._pinned = pinned
        self._copies: dict[str, tuple[Any, dict[str, Any]]] = {}  # per DCP state: its structure, its host copy
        self._pending: list[tuple[dict[str, Any], str]] = []
        self.current: BackgroundSave | None = None
        self.waited_s = 0.0
        self.staged_bytes = 0  # host memory the copies of the last save take (this rank's)

    def write(self, state: dict[str, Any], directory: str, group: ProcessGroup | None = None) -> None:
        """Copy ``state`` to host memory for `start` to write into ``directory``; the save functions' DCP write
        (``group``, the main thread's, is replaced by this checkpointer's own group of the same ranks)."""
        if self.current is not None:  # its thread may still read the host copies this would overwrite
            raise RuntimeError(f"{os.path.basename(self.current.final_dir)} is still in flight: wait() for it first")
        key = os.path.basename(directory)  # model, optimizer, feedback, fed_outer: one host copy each
        structure = _structure(state)
        if key not in self._copies or self._copies[key][0] != structure:  # the first save, or the state changed
            self._copies[key] = (structure, _create_cpu_state_dict(state, pin_memory=self._pinned))
        self._pending.append((_copy_state_dict(state, self._copies[key][1]), directory))

    def start(self, staging: str, final_dir: str, publish: Callable[[dict[str, Any]], None] | None) -> None:
        """Write the staged states in a background thread, then publish (``publish``: the writer's, given the
        manifest's entries)."""
        if self.current is not None:  # the invariant `wait` keeps: a second save would race the first's collectives
            raise RuntimeError(f"{os.path.basename(self.current.final_dir)} is still in flight: wait() for it first")
        save = BackgroundSave(staging, final_dir, self._pending, publish)
        self.staged_bytes = sum(_tensor_bytes(state) for state, _ in self._pending)
        self._pending = []
        save.thread = threading.Thread(target=self._run, args=(save,), name="fedshard-checkpoint", daemon=True)
        self.current = save
        save.thread.start()

    def _run(self, save: BackgroundSave) -> None:
        marks = os.path.join(save.staging, RANKS_DIR)
        try:
            for state, directory in save.writes:
                self._write_state(state, directory)
            save.writes = []
            _mark(marks, self.rank, Phase.WRITTEN)
            save.phase = Phase.WRITTEN
            self._await_marks(marks, Phase.WRITTEN)  # every rank's files are there: the listing is final
            share = describe_share(save.staging, self.rank, self.world_size, skip=RANKS_DIR)
            _mark(marks, self.rank, Phase.HASHED, json.dumps(share))
            save.phase = Phase.HASHED
            if save.publish is not None:
                shares = self._await_marks(marks, Phase.HASHED)
                shutil.rmtree(marks)
                save.publish({path: entry for text in shares for path, entry in json.loads(text).items()})
                save.phase = Phase.PUBLISHED
        except BaseException as err:  # DCP raises CheckpointException (a BaseException): every rank learns at `wait`
            save.error, save.phase = err, Phase.FAILED
            with contextlib.suppress(OSError):  # the disk that failed the write may fail the mark too
                _mark(marks, self.rank, Phase.FAILED, f"{type(err).__name__}: {err}")

    def _write_state(self, state: dict[str, Any], directory: str) -> None:
        dcp.save(state, checkpoint_id=directory, process_group=self._group)

    def _await_marks(self, marks: str, phase: Phase) -> list[str]:
        """Until every rank said ``phase``: their marks' texts, by rank; raise at a rank's FAILED mark or after the
        timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            names = os.listdir(marks) if os.path.isdir(marks) else []
            failed = sorted(n for n in names if n.endswith(Phase.FAILED.value))
            if failed:
                said = [(n.split(".")[0], _read(os.path.join(marks, n)) or "no reason given") for n in failed]
                reasons = "; ".join(f"{rank}: {reason}" for rank, reason in said)
                raise CheckpointWriteError(f"a background write failed ({reasons})")
            said = [n for n in names if n.endswith("." + phase.value)]
            if len(said) == self.world_size:
                return [_read(os.path.join(marks, f"rank{r}.{phase.value}")) for r in range(self.world_size)]
            if time.monotonic() > deadline:
                verb = "wrote" if phase is Phase.WRITTEN else "hashed"
                raise CheckpointWriteError(
                    f"{len(said)} of {self.world_size} ranks {verb} their shards within {self.timeout_s:.0f} s"
                )
            time.sleep(_POLL_S)

    def wait(self) -> tuple[float, str | None]:
        """End the save in flight: the seconds waited, and the checkpoint this rank published (or ``None``).

        A collective over the job's world (every rank calls it at the same step): when the write failed on any rank,
        every rank raises `CheckpointWriteError` here, so that none waits for the others.
        """
        save, self.current, start = self.current, None, time.monotonic()
        if save is not None and save.thread is not None:
            save.thread.join()
        waited = time.monotonic() - start
        self.waited_s += waited
        failed = torch.tensor([1.0 if save is not None and save.phase is Phase.FAILED else 0.0])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            if save is not None and save.publish is not None:  # the writer; every rank's thread has ended by now
                shutil.rmtree(save.staging, ignore_errors=True)
            name = os.path.basename(save.final_dir) if save is not None else "the last checkpoint"
            detail = f": {save.error}" if save is not None and save.error is not None else " on another rank"
            raise CheckpointWriteError(
                f"{name} was not published: its background write failed{detail}. Check the output_dir's disk "
                "(space, permissions), or save synchronously (leave --fed_async_checkpoint off)."
            )
        return waited, (save.final_dir if save is not None and save.phase is Phase.PUBLISHED else None)


def _tensor_bytes(state: Any) -> int:
    """Bytes of every tensor in a (nested) staged state: its host copy's size."""
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_tensor_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if isinstance(state, DTensor) else state
        return local.numel() * local.element_size()
    return 0


def _structure(state: Any) -> Any:
    """What a host copy must match to be reused: the nesting, and each tensor's local shape and dtype (a value that
    is not a tensor is copied as it is, whatever it holds)."""
    if isinstance(state, dict):
        return tuple((key, _structure(value)) for key, value in state.items())
    if isinstance(state, list | tuple):
        return tuple(_structure(value) for value in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if isinstance(state, DTensor) else state
        return (type(state).__name__, tuple(local.shape), local.dtype)
    return type(state).__name__


def _mark(marks: str, rank: int, phase: Phase, text: str = "") -> None:
    """Say this rank's ``phase`` with a file: written whole under a temporary name, then renamed."""
    os.makedirs(marks, exist_ok=True)
    path = os.path.join(marks, f"rank{rank}.{phase.value}")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()

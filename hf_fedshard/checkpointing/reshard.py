"""Resuming a federated checkpoint on another layout: another number of groups, group size or shard size.

A shared cluster rarely gives a restarted job the same allocation. What a run on the new layout starts from (the
rules docs/fault_tolerance.md states, "Resuming on another layout"):

- **Model**: the global model. Right after a blocking averaging with nothing in flight every group held it, so it
  is group 0's model; otherwise it is the plain mean of the groups' models (the model evaluated and exported at
  that step). DCP reads each group's shards onto the new groups' own.
- **Anchor and outer momentum**: the checkpoint's, resharded (`hf_fedshard.checkpointing.averaging_state`).
- **Inner optimizer**: the plain mean of the groups' moments, resharded; its step count is kept.
- **Error feedback** (``fed_sync_dtype topk``): every new group starts from the mean of the old groups' residuals,
  resharded (weighted by their ranks where they were of unequal size): what the groups had not sent yet enters the
  global model's next averagings as it would have, in the mean.
- **An exchange in flight** is dropped: the plain mean of the models holds the progress it carried, and the anchor
  is still the one before it, so the next averaging's Δ covers both windows.
- **Counters**: group 0's first rank's (schedule position, counts); the last averaging's pending norms are dropped.
- **Schedule**: the LR schedule and ``max_steps`` keep counting optimizer steps; the world batch of a step changes
  with the layout.
- **Data**: epoch e = S // (steps per epoch then) resumes after the samples the old layout read in it,
  c = (S mod steps per epoch) × its world batch, rounded up to whole steps of the new layout: the fewer than one
  step's samples in between are not read in this epoch, and no sample is read twice.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup
from transformers.trainer import TRAINER_STATE_NAME

from hf_fedshard.checkpointing.averaging_state import (
    feedback_dir,
    in_flight_path,
    load_feedback,
    load_outer_state,
    read_counters,
)
from hf_fedshard.checkpointing.checkpoint import (
    group_dir,
    load_group_model,
    load_group_optimizer,
    read_layout_record,
    reading,
    recorded_layout,
)
from hf_fedshard.engine.payload import model_state_tensors, optimizer_state_tensors
from hf_fedshard.topology import FederationLayout


@dataclass(frozen=True)
class LayoutChange:
    """A checkpoint (its path, ``fed_layout.json`` and step) and the layout resuming it, where the layouts differ."""

    checkpoint: str
    saved: dict
    step: int
    layout: FederationLayout

    @property
    def old_groups(self) -> int:
        return int(self.saved["num_groups"])

    def old_layout(self) -> str:
        return recorded_layout(self.saved).summary()

    def new_layout(self) -> str:
        return self.layout.summary()


def checkpoint_step(checkpoint: str) -> int:
    """The optimizer step ``checkpoint`` was written at (its ``trainer_state.json``)."""
    path = os.path.join(checkpoint, TRAINER_STATE_NAME)
    with reading(path), open(path) as f:
        return int(json.load(f)["global_step"])


def changes_layout(saved: dict | None, layout: FederationLayout) -> bool:
    """Whether a checkpoint's record (``fed_layout.json``) is of another world, group or shard size."""
    if saved is None:
        return False
    return recorded_layout(saved) != layout


def layout_change(checkpoint: str, layout: FederationLayout) -> LayoutChange | None:
    """The change from ``checkpoint``'s layout to ``layout``, or ``None`` where they match (or nothing is recorded)."""
    saved = read_layout_record(checkpoint)
    if not changes_layout(saved, layout):
        return None
    return LayoutChange(checkpoint, saved, checkpoint_step(checkpoint), layout)


def groups_held_global_model(change: LayoutChange) -> bool:
    """Whether every group held the global model at the save: all fragments averaged at its step, none in flight."""
    synced = read_counters(change.checkpoint, 0, 0)["synced_at"]
    old = recorded_layout(change.saved)
    in_flight = any(
        os.path.isfile(in_flight_path(change.checkpoint, old.group_index(rank), rank)) for rank in range(old.world_size)
    )
    return all(int(s) == change.step for s in synced) and not in_flight


def global_model_source(change: LayoutChange) -> str:
    """Where the new groups' model comes from, for the start-up line."""
    if groups_held_global_model(change):
        return "group 0's (every group held it: the checkpoint follows an averaging)"
    return f"{mean_of_old_groups(change)} (the checkpoint is between averagings)"


def mean_of_old_groups(change: LayoutChange) -> str:
    """How the old groups' models or moments are combined, in words."""
    weighted = "" if recorded_layout(change.saved).equal else ", weighted by their ranks"
    return f"the mean of the {change.old_groups} groups'{weighted}"


def _mean_of_groups(
    load: Callable[[str], None], tensors: Callable[[], list[torch.Tensor]], folders: list[str], weights: list[int]
) -> None:
    """Load each of ``folders`` in turn and leave the mean in ``tensors()``: Σ w_g · x_g in fp32 in folder order,
    ÷ Σ w_g, cast back (the rule the tests reproduce to the bit). The weights are the old groups' ranks (the
    samples each trained on, as an averaging weighs them), all 1 where the groups were of equal size."""
    sums: list[torch.Tensor] = []
    for index, (folder, weight) in enumerate(zip(folders, weights, strict=True)):
        load(folder)
        current = tensors()
        if index == 0:
            sums = [t.detach().float().clone().mul_(weight) for t in current]
        else:
            for total, t in zip(sums, current, strict=True):
                total.add_(t.float(), alpha=weight)
    with torch.no_grad():
        for total, t in zip(sums, tensors(), strict=True):
            t.copy_(total.div_(sum(weights)))


def load_global_model(model: nn.Module, change: LayoutChange, group: ProcessGroup) -> None:
    """Load the checkpoint's global model (`global_model_source`) onto this group's shards."""
    if groups_held_global_model(change):
        return load_group_model(model, os.path.join(group_dir(change.checkpoint, 0), "model"), group)
    folders = [os.path.join(group_dir(change.checkpoint, g), "model") for g in range(change.old_groups)]
    _mean_of_groups(
        lambda folder: load_group_model(model, folder, group), lambda: model_state_tensors(model), folders,
        recorded_layout(change.saved).group_weights,
    )  # fmt: skip


def load_mean_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, change: LayoutChange, group: ProcessGroup
) -> None:
    """The inner optimizer's moments as the mean of the old groups' (each resharded onto this group; weighted by
    their ranks where they were of unequal size)."""
    folders = [os.path.join(group_dir(change.checkpoint, g), "optimizer") for g in range(change.old_groups)]
    _mean_of_groups(
        lambda folder: load_group_optimizer(model, optimizer, folder, group),
        lambda: optimizer_state_tensors(optimizer, model),
        folders,
        recorded_layout(change.saved).group_weights,
    )


def load_resharded_averaging_state(change: LayoutChange, model: nn.Module, group: ProcessGroup) -> dict:
    """The averager's state on a new layout: the first rank's counters (its pending norms dropped), nothing in
    flight, the outer state by parameter."""
    counters = {**read_counters(change.checkpoint, 0, 0), "pending_norms": None}
    outer = load_outer_state(change.checkpoint, model, group)
    feedback = load_mean_feedback(change, model, group)
    return {"counters": counters, "in_flight": None, "outer": outer, "feedback": feedback}


def load_mean_feedback(change: LayoutChange, model: nn.Module, group: ProcessGroup) -> list[torch.Tensor] | None:
    """The mean of the old groups' error-feedback residuals on this rank's shards (``None`` where they have none)."""
    folders = [feedback_dir(change.checkpoint, g) for g in range(change.old_groups)]
    if not all(os.path.isdir(folder) for folder in folders):
        return None
    loaded: list[list[torch.Tensor]] = [[]]  # the last group's, which `_mean_of_groups` leaves the mean in

    def load(folder: str) -> None:
        loaded[0] = load_feedback(folder, model, group)

    _mean_of_groups(load, lambda: loaded[0], folders, recorded_layout(change.saved).group_weights)
    return loaded[0]


@dataclass(frozen=True)
class DataPosition:
    """Where the data of a resumed epoch starts on the new layout."""

    epoch: int
    consumed: int  # samples of ``epoch`` the old layout read
    steps: int  # whole steps of the new layout that cover them (what Trainer skips)
    skipped: int  # samples between, not read in this epoch

    def describe(self) -> str:
        if self.consumed == 0:
            return f"epoch {self.epoch} starts from its beginning"
        return (
            f"epoch {self.epoch} resumes after its first {self.consumed} samples ({self.steps} steps of the new "
            f"layout; {self.skipped} samples in between are not read in this epoch)"
        )


def data_position(saved: dict, step: int, samples_per_step: int, steps_per_epoch: int) -> DataPosition:
    """The resumed epoch, and this layout's steps that cover what the checkpoint's run read of it (rounded up).

    The record's ``epoch`` and ``epoch_samples`` say where the run was; a record without them (a run that never
    changed layout) is placed by its step: epoch = step // steps per epoch, as Trainer does.
    """
    if "epoch_samples" in saved:
        epoch, consumed = int(saved["epoch"]), int(saved["epoch_samples"])
    else:
        epoch, done = divmod(step, int(saved["steps_per_epoch"]))
        consumed = done * int(saved["samples_per_step"])
    steps = math.ceil(consumed / samples_per_step)
    if steps >= steps_per_epoch:  # what remains of the epoch is less than one step of the new layout
        return DataPosition(epoch + 1, 0, 0, 0)
    return DataPosition(epoch, consumed, steps, steps * samples_per_step - consumed)

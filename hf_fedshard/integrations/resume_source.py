"""Where a federated run's state comes from, chosen once in `FedShardMixin.train`, and what it offers.

Three sources, one set of operations (the model, the averaging state, the optimizer and schedule, the trainer state,
the data position), which the Trainer's loading hooks call without asking which source it is:

- `GroupCheckpoint`: a checkpoint written on this layout; each rank reads its own group's shards.
- `ResizedCheckpoint`: a checkpoint of another layout (groups, group size or shard size; a torchft group relaunched
  on another size too): its global model and averaging state resharded, the inner optimizer the mean of the old
  groups' moments, the data resumed after the samples read (`hf_fedshard.checkpointing.reshard`).
- `LivePeer`: a live group's committed state, received at the first quorum (a heal,
  `hf_fedshard.engine.rounds.HealState`): the global model, anchors, outer state, schedule and trainer state, from
  memory; the inner optimizer starts afresh, as no peer sends its own moments. A heal mid-run takes the same parts
  through the same `HealState` (each part's ``load``); only a heal before training goes through Trainer's resume.

A checkpoint's own files that Trainer reads itself (``trainer_state.json``, the RNG and scaler states) are read from
its ``folder``; a live peer has none, and sends its trainer state instead.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup
from transformers import TrainerState
from transformers.trainer import SCHEDULER_NAME

from hf_fedshard.checkpointing.averaging_state import in_flight_path, load_averaging_state, read_counters
from hf_fedshard.checkpointing.checkpoint import (
    group_dir,
    load_group_model,
    load_group_optimizer,
    read_layout_record,
    reading,
)
from hf_fedshard.checkpointing.reshard import (
    DataPosition,
    LayoutChange,
    checkpoint_step,
    data_position,
    global_model_source,
    layout_change,
    load_global_model,
    load_mean_optimizer,
    load_resharded_averaging_state,
    mean_of_old_groups,
)
from hf_fedshard.engine.payload import load_model_state
from hf_fedshard.errors import ConfigError
from hf_fedshard.topology import FederationLayout


class ResumeSource(ABC):
    """A run's state before it trains: a checkpoint on this layout, one of another layout, or a live peer's."""

    folder: str | None  # the checkpoint's folder, whose trainer_state.json, RNG and scaler files Trainer reads
    committed = False  # a live group's committed state: once loaded, this group's own (it may be a heal's source)

    @property
    @abstractmethod
    def step(self) -> int:
        """The optimizer step the state is of."""

    @property
    @abstractmethod
    def averagings(self) -> int:
        """The averagings the state holds (the first quorum compares them: a group behind heals)."""

    @abstractmethod
    def load_model(self, model: nn.Module, group: ProcessGroup) -> None:
        """Put the state's model on this rank's shards (``group``: this group's ranks)."""

    @abstractmethod
    def averaging_state(self, model: nn.Module, group: ProcessGroup) -> dict:
        """The averager's state (`FederatedAverager.state_dict`'s form) on this rank's shards."""

    @abstractmethod
    def load_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: ProcessGroup) -> None:
        """Load the inner optimizer's moments (or leave it afresh where the source has none)."""

    @abstractmethod
    def scheduler_state(self) -> dict | None:
        """The learning-rate schedule's state (``None``: none saved)."""

    def check(self, max_steps: int) -> None:
        """Refuse, on every rank alike, what this run cannot resume from it (``max_steps``: the run's). A
        checkpoint of this layout and a live peer's state resume in any run."""
        return None

    def trainer_state(self) -> TrainerState | None:
        """The trainer state, where it does not come from ``folder``'s trainer_state.json (Trainer reads that)."""
        return None

    def release(self) -> None:
        """Drop what is loaded by now (Trainer's loop keeps the source to the end of training). A checkpoint holds
        nothing in memory."""
        return None

    def data_position(self, samples_per_step: int, steps_per_epoch: int, batches_per_epoch: int) -> DataPosition | None:
        """Where the data resumes on this layout (``batches_per_epoch``: each rank's); ``None``: where Trainer puts it
        from the step."""
        return None

    def start_line(self, position: DataPosition | None, samples_per_step: int) -> str | None:
        """What the run says when it starts from this source (beyond Trainer's own resume lines)."""
        return None


@dataclass
class GroupCheckpoint(ResumeSource):
    """A verified checkpoint written on this layout: this rank reads its group's shards and averaging state.

    ``record``: its ``fed_layout.json`` (``None`` for a checkpoint that has none), ``step`` its optimizer step,
    ``layout`` the launch's layout, ``group_index`` this rank's group in it, ``rank`` this rank's index."""

    folder: str
    record: dict | None
    at_step: int
    layout: FederationLayout
    group_index: int
    rank: int

    def __str__(self) -> str:
        return self.folder

    @property
    def step(self) -> int:
        return self.at_step

    @property
    def averagings(self) -> int:
        return int(read_counters(self.folder, self.group_index, self.rank)["syncs"])

    @property
    def committed(self) -> bool:
        """Written right after a committed averaging (every fragment averaged at this step, no exchange in flight):
        once loaded, the state a group behind may heal from (`hf_fedshard.engine.rounds` I1). After a full restart
        without a shared folder each group resumes its own newest checkpoint, and the groups behind the one that
        published an averaging later must heal from it; from a checkpoint between averagings they wait for its
        next commit."""
        synced = read_counters(self.folder, self.group_index, self.rank).get("synced_at") or []
        in_flight = os.path.isfile(in_flight_path(self.folder, self.group_index, self.rank))
        return bool(synced) and all(step == self.at_step for step in synced) and not in_flight

    def load_model(self, model: nn.Module, group: ProcessGroup) -> None:
        load_group_model(model, os.path.join(group_dir(self.folder, self.group_index), "model"), group)

    def averaging_state(self, model: nn.Module, group: ProcessGroup) -> dict:
        return load_averaging_state(self.folder, self.layout, self.rank, model, group)

    def load_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: ProcessGroup) -> None:
        directory = _optimizer_dir(self.folder, self.group_index)
        if os.path.isdir(directory):  # a save_only_model checkpoint has none, as with Trainer
            load_group_optimizer(model, optimizer, directory, group)

    def scheduler_state(self) -> dict | None:
        return _saved_scheduler(self.folder, _optimizer_dir(self.folder, self.group_index))

    def data_position(self, samples_per_step: int, steps_per_epoch: int, batches_per_epoch: int) -> DataPosition | None:
        if self.record is None or "epoch_samples" not in self.record:
            return None  # a run that never changed layout: Trainer's own arithmetic from the step holds
        return data_position(self.record, self.at_step, samples_per_step, steps_per_epoch)


@dataclass
class ResizedCheckpoint(ResumeSource):
    """A verified checkpoint of another layout (``change``), resharded onto this one."""

    change: LayoutChange

    def __post_init__(self) -> None:
        self.folder = self.change.checkpoint

    def __str__(self) -> str:
        return self.change.checkpoint

    @property
    def step(self) -> int:
        return self.change.step

    @property
    def averagings(self) -> int:
        return int(read_counters(self.change.checkpoint, 0, 0)["syncs"])

    def check(self, max_steps: int) -> None:
        if max_steps <= 0:
            change = self.change
            raise ConfigError(
                f"resume_from_checkpoint={change.checkpoint} was written on {change.old_layout()} and this run is "
                f"{change.new_layout()}: a layout change keeps counting optimizer steps, so it needs --max_steps "
                "(the schedule's length; epochs would change it with the world batch). Pass --max_steps."
            )

    def load_model(self, model: nn.Module, group: ProcessGroup) -> None:
        load_global_model(model, self.change, group)

    def averaging_state(self, model: nn.Module, group: ProcessGroup) -> dict:
        return load_resharded_averaging_state(self.change, model, group)

    def load_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: ProcessGroup) -> None:
        if os.path.isdir(_optimizer_dir(self.change.checkpoint, 0)):  # group 0's is there on every layout
            load_mean_optimizer(model, optimizer, self.change, group)

    def scheduler_state(self) -> dict | None:
        return _saved_scheduler(self.change.checkpoint, _optimizer_dir(self.change.checkpoint, 0))

    def data_position(self, samples_per_step: int, steps_per_epoch: int, batches_per_epoch: int) -> DataPosition:
        return data_position(self.change.saved, self.change.step, samples_per_step, steps_per_epoch)

    def start_line(self, position: DataPosition | None, samples_per_step: int) -> str:
        change = self.change
        data = position.describe() if position is not None else "the data resumes from the step"
        return (
            f"hf_fedshard: resuming step {change.step} of {change.old_layout()} on {change.new_layout()}: the model is "
            f"{global_model_source(change)}; the anchor and outer momentum are the checkpoint's, resharded; the inner "
            f"optimizer's moments are {mean_of_old_groups(change)}, resharded; an exchange in flight (if any) is "
            f"dropped; the world batch goes from {change.saved['samples_per_step']} to {samples_per_step} samples per "
            f"step; {data}."
        )


@dataclass
class LivePeer(ResumeSource):
    """A live group's committed state (`HealState`'s parts: ``trainer``, ``scheduler``, ``averager``), sent to a
    group behind the federation at its first quorum; ``group_id`` names the healing group in the start-up line,
    ``accumulation`` is its gradient_accumulation_steps."""

    state: dict
    group_id: int
    accumulation: int
    folder: None = None
    committed = True

    def __str__(self) -> str:
        return f"a live peer's state of step {self.step}"

    @property
    def step(self) -> int:
        return int(self.state["trainer"]["global_step"])

    @property
    def averagings(self) -> int:
        return int(self.state["averager"]["averager"]["counters"]["syncs"])

    def load_model(self, model: nn.Module, group: ProcessGroup) -> None:
        load_model_state(model, self.state["averager"]["model"])

    def averaging_state(self, model: nn.Module, group: ProcessGroup) -> dict:
        return self.state["averager"]["averager"]

    def load_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: ProcessGroup) -> None:
        """A peer sends no inner moments (they are its group's own): the optimizer starts afresh."""

    def scheduler_state(self) -> dict:
        return self.state["scheduler"]

    def trainer_state(self) -> TrainerState:
        state = TrainerState(**{**self.state["trainer"], "stateful_callbacks": {}})  # its callbacks are its own
        if state.best_model_checkpoint is not None and not os.path.isdir(state.best_model_checkpoint):
            state.best_model_checkpoint = None  # as Trainer: the peer's best is not on this file system
        return state

    def data_position(self, samples_per_step: int, steps_per_epoch: int, batches_per_epoch: int) -> DataPosition | None:
        """Where the peer's ranks are in their epoch: its fractional epoch (Trainer's, in batches, the same count on
        every rank of every group) read back as whole batches and steps. After a layout change the step alone no
        longer says it; otherwise this is Trainer's own placement from the step."""
        epoch = self.state["trainer"].get("epoch")
        if epoch is None:
            return None
        whole = math.floor(epoch + 1e-9)
        steps = round((epoch - whole) * batches_per_epoch) // self.accumulation
        if steps >= steps_per_epoch:
            return DataPosition(whole + 1, 0, 0, 0)
        return DataPosition(whole, steps * samples_per_step, steps, 0)

    def release(self) -> None:
        """The model, anchors, outer state and schedule are loaded: keep only the trainer state."""
        self.state = {"trainer": self.state["trainer"]}

    def start_line(self, position: DataPosition | None, samples_per_step: int) -> str:
        return (
            f"hf_fedshard: fed_group{self.group_id} healed from a live group: resuming at step {self.step} (its last "
            "averaging) with the global model, its anchors and outer state; the inner optimizer "
            "starts afresh."
        )


def checkpoint_source(folder: str, layout: FederationLayout, group_index: int, rank: int) -> ResumeSource:
    """A verified checkpoint as this run's source: on this launch's ``layout`` (``group_index``, ``rank``: this
    rank's), or resharded from the layout it was written on."""
    change = layout_change(folder, layout)
    if change is not None:
        return ResizedCheckpoint(change)
    return GroupCheckpoint(folder, read_layout_record(folder), checkpoint_step(folder), layout, group_index, rank)


def _optimizer_dir(folder: str, group_index: int) -> str:
    """Where a checkpoint holds group ``group_index``'s inner optimizer (none in a save_only_model checkpoint)."""
    return os.path.join(group_dir(folder, group_index), "optimizer")


def _saved_scheduler(folder: str, optimizer: str) -> dict | None:
    """The schedule saved beside the ``optimizer`` folder (a save_only_model checkpoint has neither)."""
    if not os.path.isdir(optimizer):
        return None
    path = os.path.join(folder, SCHEDULER_NAME)
    with reading(path):
        return torch.load(path, weights_only=True)

"""`FedAvgCallback`: the FedAvg schedule, as a `TrainerCallback` so the training loop stays Transformers' own."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.distributed import ProcessGroup
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .averaging import average_across_groups, model_state_tensors, optimizer_state_tensors


class FedAvgCallback(TrainerCallback):
    """Averages the model state across federation groups every ``sync_steps`` optimizer steps.

    It also averages right before an evaluation and after the last step (or when another callback stops
    training early), so that what is evaluated, saved at the end or pushed is always the global model.
    Every decision is a function of ``global_step`` and of flags that are equal on all ranks, so all ranks
    enter the collective together.

    Args:
        fed_group: process group of the ranks holding the same shards in the other groups (``mesh["fed"]``).
        num_groups: number of federation groups (size of ``fed_group``).
        sync_steps: H, optimizer steps between two averagings.
        average_optimizer_state: also average the optimizer's moments (off in the paper).
    """

    def __init__(
        self, fed_group: ProcessGroup, num_groups: int, sync_steps: int, average_optimizer_state: bool = False
    ) -> None:
        self.fed_group = fed_group
        self.num_groups = num_groups
        self.sync_steps = sync_steps
        self.average_optimizer_state = average_optimizer_state
        self.syncs = 0
        self.inter_group_bytes = 0
        self.last_sync_seconds = 0.0
        self._last_synced_step = 0

    def metrics(self) -> dict[str, float]:
        """Counters for the training logs."""
        return {
            "fed_syncs": self.syncs,
            "fed_inter_group_bytes": self.inter_group_bytes,
            "fed_sync_seconds": round(self.last_sync_seconds, 6),
        }

    def sync(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        """Average now (a collective: every rank of the world must call it at the same step)."""
        tensors = model_state_tensors(model)
        if self.average_optimizer_state and optimizer is not None:
            tensors += optimizer_state_tensors(optimizer, model)
        start = time.perf_counter()
        self.inter_group_bytes += average_across_groups(tensors, self.fed_group, self.num_groups)
        if tensors and tensors[0].is_cuda:
            torch.cuda.synchronize()
        self.last_sync_seconds = time.perf_counter() - start
        self.syncs += 1
        self._last_synced_step = step

    def _sync_if_stale(self, state: TrainerState, model: nn.Module, optimizer) -> None:
        if state.global_step > self._last_synced_step:
            self.sync(model, optimizer, state.global_step)

    def on_train_begin(self, args, state, control, **kwargs):
        # Resuming: steps before the checkpoint are not ours to average again.
        self._last_synced_step = state.global_step

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model=None,
        optimizer=None,
        **kwargs,
    ):
        due = state.global_step % self.sync_steps == 0
        if due or control.should_evaluate or control.should_training_stop:
            self._sync_if_stale(state, model, optimizer)

    def on_epoch_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if control.should_evaluate or control.should_training_stop:
            self._sync_if_stale(state, model, optimizer)

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._sync_if_stale(state, model, optimizer)

"""`FedAvgCallback`: the FedAvg schedule, as a `TrainerCallback` so the training loop stays Transformers' own."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp, all_reduce, get_rank
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import IntervalStrategy

from .averaging import all_finite, average_across_groups, model_state_tensors, optimizer_state_tensors

logger = logging.getLogger(__name__)


@torch.no_grad()
def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Zero every tensor of the optimizer state (moments and step counts) in place.

    For Adam/AdamW (and SGD without dampening) a zeroed state steps exactly like a fresh one. Emptying the state
    instead would make the next checkpoint's `get_optimizer_state_dict` run an initialising step of its own.
    """
    for state in getattr(optimizer, "optimizer", optimizer).state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.zero_()


class FedAvgCallback(TrainerCallback):
    """Averages the model state across federation groups every ``sync_steps`` optimizer steps.

    It also averages right before an evaluation and after the last step (or when another callback stops
    training early), so that what is evaluated, saved at the end or pushed is always the global model.
    Every decision is a function of ``global_step`` and of flags that are equal on all ranks, so all ranks
    enter the collective together.

    Before each averaging the groups agree, with two tiny collectives, on which of them hold a NaN or an Inf
    (a diverged group). A diverged group sends nothing and restarts from the others' average with its optimizer
    state reset; if every group diverged, training stops with an error.

    Args:
        fed_group: process group of the ranks holding the same shards in the other groups (``mesh["fed"]``).
        num_groups: number of federation groups (size of ``fed_group``).
        sync_steps: H, optimizer steps between two averagings.
        average_optimizer_state: also average the optimizer's moments (off in the paper).
        group: process group of this rank's own federation group, to agree on its divergence flag; ``None``
            when a group is one rank.
        timeout_s: the timeout ``fed_group`` was created with, quoted in the error when a group stops answering.
        before_eval: called on every rank right before the averaging that precedes an evaluation, while the
            groups still hold their own models (per-group evaluation).
    """

    def __init__(
        self,
        fed_group: ProcessGroup,
        num_groups: int,
        sync_steps: int,
        average_optimizer_state: bool = False,
        group: ProcessGroup | None = None,
        timeout_s: float | None = None,
        before_eval: Callable[[], None] | None = None,
    ) -> None:
        self.fed_group = fed_group
        self.num_groups = num_groups
        self.sync_steps = sync_steps
        self.average_optimizer_state = average_optimizer_state
        self.group = group
        self.timeout_s = timeout_s
        self.before_eval = before_eval
        self.syncs = 0
        self.inter_group_bytes = 0
        self.last_sync_seconds = 0.0
        self.total_sync_seconds = 0.0
        self.diverged_groups = 0
        self._last_synced_step = 0
        self._diverged_at_step: int | None = None
        self._output_dir: str | None = None

    def metrics(self) -> dict[str, float]:
        """Counters for the training logs."""
        return {
            "fed_syncs": self.syncs,
            "fed_inter_group_bytes": self.inter_group_bytes,
            "fed_sync_seconds": round(self.last_sync_seconds, 6),
            "fed_sync_seconds_total": round(self.total_sync_seconds, 6),
            "fed_diverged_groups": self.diverged_groups,
        }

    def state_dict(self) -> dict[str, float]:
        """The counters a checkpoint must hold to continue exactly (this rank's: byte counts differ by shard)."""
        return {
            "syncs": self.syncs,
            "inter_group_bytes": self.inter_group_bytes,
            "last_sync_seconds": self.last_sync_seconds,
            "total_sync_seconds": self.total_sync_seconds,
            "diverged_groups": self.diverged_groups,
            "last_synced_step": self._last_synced_step,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.syncs = int(state["syncs"])
        self.inter_group_bytes = int(state["inter_group_bytes"])
        self.last_sync_seconds = float(state["last_sync_seconds"])
        self.total_sync_seconds = float(state.get("total_sync_seconds", 0.0))
        self.diverged_groups = int(state["diverged_groups"])
        self._last_synced_step = int(state["last_synced_step"])

    def payload(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
        """This rank's local shards that an averaging sends: the model state, and the moments if asked."""
        tensors = model_state_tensors(model)
        if self.average_optimizer_state and optimizer is not None:
            tensors += optimizer_state_tensors(optimizer, model)
        return tensors

    def diverged(self, tensors: list[torch.Tensor], step: int) -> list[int]:
        """Indices of the groups holding a NaN/Inf in their ``tensors`` (a collective over the whole world).

        One flag per rank, reduced (max) inside the group, then one slot per group summed along ``fed``: every
        rank gets the same list, so every rank takes the same branch afterwards.
        """
        device = tensors[0].device if tensors else torch.device("cpu")
        with self._explain_failures(step):
            local = torch.tensor([0.0 if all_finite(tensors) else 1.0], device=device)
            if self.group is not None:
                all_reduce(local, op=ReduceOp.MAX, group=self.group)
            flags = torch.zeros(self.num_groups, device=device)
            flags[get_rank(self.fed_group)] = local[0]
            all_reduce(flags, op=ReduceOp.SUM, group=self.fed_group)
        return [g for g, flag in enumerate(flags.tolist()) if flag > 0]

    def sync(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        """Average now (a collective: every rank of the world must call it at the same step)."""
        tensors = self.payload(model, optimizer)
        start = time.perf_counter()
        diverged = self.diverged(tensors, step)
        if len(diverged) == self.num_groups:
            raise RuntimeError(
                f"hf_fedshard: every federation group ({self.num_groups}) has NaN/Inf in its model at step {step}; "
                f"training stopped. The latest checkpoint in {self._output_dir} holds finite weights (checkpoints "
                "are skipped while a group has NaN/Inf): resume from it with a lower learning_rate or max_grad_norm."
            )
        mine_diverged = get_rank(self.fed_group) in diverged
        with self._explain_failures(step):
            self.inter_group_bytes += average_across_groups(
                tensors, self.fed_group, self.num_groups - len(diverged), contribute=not mine_diverged
            )
        if tensors and tensors[0].is_cuda:
            torch.cuda.synchronize()
        self.last_sync_seconds = time.perf_counter() - start
        self.total_sync_seconds += self.last_sync_seconds
        self.syncs += 1
        self._last_synced_step = step
        if diverged:
            self._restart_diverged(diverged, mine_diverged, optimizer, step)

    def sync_if_stale(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        """Average unless the groups already hold the average of ``step`` (a collective, like `sync`)."""
        if step > self._last_synced_step:
            self.sync(model, optimizer, step)

    def _restart_diverged(
        self, diverged: list[int], mine_diverged: bool, optimizer: torch.optim.Optimizer | None, step: int
    ) -> None:
        """Count the diverged groups; theirs took the others' average, and their moments go too."""
        self.diverged_groups += len(diverged)
        self._diverged_at_step = step
        if mine_diverged and optimizer is not None and not self.average_optimizer_state:
            reset_optimizer_state(optimizer)
        if get_rank() == 0:
            logger.warning(
                "hf_fedshard: group(s) %s had NaN/Inf at step %d: left out of the average and restarted from the "
                "other groups' average%s (fed_diverged_groups=%d).",
                diverged,
                step,
                "" if self.average_optimizer_state else ", optimizer state reset",
                self.diverged_groups,
            )

    @contextlib.contextmanager
    def _explain_failures(self, step: int) -> Iterator[None]:
        """Turn a failed inter-group collective (a timeout, a peer gone) into an error that says what to do."""
        try:
            yield
        except RuntimeError as err:
            limit = f"fed_timeout_s={self.timeout_s:g}" if self.timeout_s else "ddp_timeout (fed_timeout_s unset)"
            raise RuntimeError(
                f"hf_fedshard: an exchange across federation groups failed at step {step}: another group stopped "
                f"answering (no reply within {limit} seconds, or its ranks died). Check that group's logs; if it is "
                f"only slow, raise --fed_timeout_s. Cause: {err}"
            ) from err

    def on_train_begin(self, args, state, control, **kwargs):
        # A fresh run starts unsynced; a resumed one keeps the counters its checkpoint restored.
        if state.global_step == 0:
            self._last_synced_step = 0
        self._output_dir = args.output_dir

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        due = state.global_step % self.sync_steps == 0
        evaluating = control.should_evaluate or _epoch_evaluation_follows(args, state, control)
        self._sync_if_needed(model, optimizer, state.global_step, due, evaluating, control.should_training_stop)
        if self._diverged_at_step == state.global_step:
            control.should_log = (
                True  # a log at the divergence's step: Trainer's logging_nan_inf_filter hides NaN losses
            )

    def on_epoch_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        step = state.global_step
        self._sync_if_needed(model, optimizer, step, False, control.should_evaluate, control.should_training_stop)

    def _sync_if_needed(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        step: int,
        due: bool,
        evaluating: bool,
        stopping: bool,
    ) -> None:
        """Average when due, and before an evaluation or the end of training (after `before_eval`, if any)."""
        if not (due or evaluating or stopping):
            return
        if evaluating and self.before_eval is not None and step > self._last_synced_step:
            self.before_eval()
        self.sync_if_stale(model, optimizer, step)

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.sync_if_stale(model, optimizer, state.global_step)


def _epoch_evaluation_follows(args: TrainingArguments, state: TrainerState, control: TrainerControl) -> bool:
    """Whether `on_epoch_end` will ask for an evaluation after this step (it decides after `on_step_end`)."""
    epoch_ends = control.should_training_stop or abs(state.epoch - round(state.epoch)) < 1e-9
    return args.eval_strategy == IntervalStrategy.EPOCH and epoch_ends and args.eval_delay <= state.epoch

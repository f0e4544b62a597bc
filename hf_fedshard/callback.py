"""`FedAvgCallback`: the averaging schedule, as a `TrainerCallback` so the training loop stays Transformers' own.

The schedule (when to average) lives here; what an averaging does is composed from the outer optimizer
(`hf_fedshard.outer`: anchor, pseudo-gradients), the exchange (`hf_fedshard.exchange`: the mean over groups) and
its codec (`hf_fedshard.codec`: the wire dtype).
"""

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

from .averaging import (
    all_finite,
    average_across_groups,
    model_state_tensors,
    optimizer_state_tensors,
    trainable_parameters,
)
from .exchange import Exchange, ProcessGroupCommunicator
from .outer import OuterOptimizer

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

    An averaging is an outer step on pseudo-gradients: each rank's trainable shards move from the anchor (the
    global model of the previous averaging) to ``OuterOptimizer``'s step with the groups' mean Δ, exchanged by
    ``exchange``; floating buffers (and the optimizer's moments, if asked) are plainly averaged. At step 0 the
    groups average their initial weights, so the anchor is one model even if the groups were initialised apart.
    The last step (or a stop asked by another callback) ends with an averaging, so what is saved at the end is
    the global model. Evaluations and exports in between use `global_model`, which changes nothing that trains.
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
        before_eval: called on every rank right before an evaluation between averagings (or the averaging on
            an evaluation's step), while the groups still hold their own models (per-group evaluation).
        exchange: how the mean Δ is computed (wire dtype, FL+HSDP split); default: fp32 over ``fed_group``.
        outer_lr, outer_momentum: the outer SGD's (1 and 0: FedAvg).
        replicas: HSDP replicas per group (ranks holding the same shard), to turn shard norms into model norms.
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
        exchange: Exchange | None = None,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        replicas: int = 1,
    ) -> None:
        self.fed_group = fed_group
        self.num_groups = num_groups
        self.sync_steps = sync_steps
        self.average_optimizer_state = average_optimizer_state
        self.group = group
        self.timeout_s = timeout_s
        self.before_eval = before_eval
        self.exchange = exchange or Exchange(ProcessGroupCommunicator(fed_group))
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.replicas = replicas
        self.outer: OuterOptimizer | None = None  # built when training starts, on the sharded model
        self._saved_outer_state: dict | None = None  # from a checkpoint, loaded into `outer` when it is built
        self.delta_norm = 0.0
        self.group_drift = 0.0
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
            "fed_delta_norm": self.delta_norm,
            "fed_group_drift": self.group_drift,
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
            "delta_norm": self.delta_norm,
            "group_drift": self.group_drift,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.syncs = int(state["syncs"])
        self.inter_group_bytes = int(state["inter_group_bytes"])
        self.last_sync_seconds = float(state["last_sync_seconds"])
        self.total_sync_seconds = float(state.get("total_sync_seconds", 0.0))
        self.diverged_groups = int(state["diverged_groups"])
        self._last_synced_step = int(state["last_synced_step"])
        self.delta_norm = float(state.get("delta_norm", 0.0))
        self.group_drift = float(state.get("group_drift", 0.0))

    def outer_state_dict(self) -> dict | None:
        """The anchor and outer momentum of this rank's shards (equal in every group); ``None`` before training."""
        return None if self.outer is None else self.outer.state_dict()

    def load_outer_state(self, state: dict | None) -> None:
        """Keep a checkpoint's outer state until `on_train_begin` builds the outer optimizer on the model."""
        self._saved_outer_state = state

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
        params, others = tensors[: len(self.outer.anchor)], tensors[len(self.outer.anchor) :]
        start = time.perf_counter()
        diverged = self.diverged(tensors, step)
        if len(diverged) == self.num_groups:
            raise RuntimeError(
                f"hf_fedshard: every federation group ({self.num_groups}) has NaN/Inf in its model at step {step}; "
                f"training stopped. The latest checkpoint in {self._output_dir} holds finite weights (checkpoints "
                "are skipped while a group has NaN/Inf): resume from it with a lower learning_rate or max_grad_norm."
            )
        mine_diverged = get_rank(self.fed_group) in diverged
        contributors = self.num_groups - len(diverged)
        with self._explain_failures(step):
            self.inter_group_bytes += self._outer_step(params, contributors, contribute=not mine_diverged)
            self.inter_group_bytes += average_across_groups(
                others, self.fed_group, contributors, contribute=not mine_diverged
            )
        if tensors and tensors[0].is_cuda:
            torch.cuda.synchronize()
        self.last_sync_seconds = time.perf_counter() - start
        self.total_sync_seconds += self.last_sync_seconds
        self.syncs += 1
        self._last_synced_step = step
        if diverged:
            self._restart_diverged(diverged, mine_diverged, optimizer, step)

    def _outer_step(self, params: list[torch.Tensor], contributors: int, contribute: bool) -> int:
        """Δ, its mean over groups, the outer step and the norms; returns the payload bytes this rank sent."""
        deltas = self.outer.deltas(params)
        if not contribute:  # a diverged group's Δ holds NaN: it sends zeros and takes the others' mean
            deltas = [torch.zeros_like(d) for d in deltas]
        means, sent = self.exchange.mean(deltas, contributors)
        self._measure(deltas, means, contribute, contributors)
        self.outer.step(means, params)
        return sent

    @torch.no_grad()
    def _measure(
        self, deltas: list[torch.Tensor], means: list[torch.Tensor], contribute: bool, contributors: int
    ) -> None:
        """``fed_delta_norm`` = ‖mean Δ‖ and ``fed_group_drift`` = mean_g ‖Δ_g − mean Δ‖ / ‖mean Δ‖ (one all-reduce).

        Each rank adds its shard's squares to its group's slot and to the mean's slot, over the whole world; a
        shard is held by ``replicas`` ranks of each group, so the sums count it that many times.
        """
        sums = torch.zeros(self.num_groups + 1, dtype=torch.float64, device=means[0].device if means else "cpu")
        if contribute:
            drift = (d - m for d, m in zip(deltas, means, strict=True))
            sums[get_rank(self.fed_group)] = sum((x.double().square().sum() for x in drift), 0.0)
        sums[-1] = sum((m.double().square().sum() for m in means), 0.0)
        all_reduce(sums, op=ReduceOp.SUM)
        sums /= self.replicas
        mean_norm = (sums[-1] / self.num_groups).sqrt()  # every group holds the same mean Δ
        self.delta_norm = mean_norm.item()
        drift = sums[:-1].sqrt().sum() / contributors
        self.group_drift = (drift / mean_norm).item() if mean_norm > 0 else 0.0

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

    @contextlib.contextmanager
    def global_model(self, model: nn.Module, step: int, evaluating: bool = False) -> Iterator[None]:
        """Inside the block the model is the plain average of the groups' current models; after it, each group's own.

        For evaluations and exports between averagings (a collective, like `sync`): no outer step, no counter but
        the bytes, so the training trajectory is the same with or without them. A no-op on an averaged step.
        """
        if step <= self._last_synced_step:
            yield
            return
        if evaluating and self.before_eval is not None:
            self.before_eval()
        tensors = model_state_tensors(model)
        own = [t.clone() for t in tensors]
        diverged = self.diverged(tensors, step)
        if len(diverged) < self.num_groups:
            with self._explain_failures(step):
                self.inter_group_bytes += average_across_groups(
                    tensors,
                    self.fed_group,
                    self.num_groups - len(diverged),
                    contribute=get_rank(self.fed_group) not in diverged,
                )
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, saved in zip(model_state_tensors(model), own, strict=True):
                    tensor.copy_(saved)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # A fresh run averages the initial weights into the first anchor; a resumed one restores its checkpoint's.
        self._output_dir = args.output_dir
        if state.global_step == 0:
            self._last_synced_step = 0
            self._average_initial_weights(model)
        params = model_state_tensors(model)[: len(trainable_parameters(model))]
        self.outer = OuterOptimizer(params, self.outer_lr, self.outer_momentum)
        if state.global_step > 0:
            if self._saved_outer_state is None:
                raise RuntimeError(
                    f"hf_fedshard: the checkpoint resumed at step {state.global_step} holds no anchor (fed_outer/); "
                    "it was written before pseudo-gradient averaging. Resume from a newer checkpoint or start afresh."
                )
            self.outer.load_state_dict(self._saved_outer_state)

    def _average_initial_weights(self, model: nn.Module) -> None:
        """Step 0's plain average, so that groups initialised differently start from one global model."""
        start = time.perf_counter()
        with self._explain_failures(0):
            self.inter_group_bytes += average_across_groups(model_state_tensors(model), self.fed_group, self.num_groups)
        self.last_sync_seconds = time.perf_counter() - start
        self.total_sync_seconds += self.last_sync_seconds
        self.syncs += 1

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        due = state.global_step % self.sync_steps == 0
        evaluating = control.should_evaluate or _epoch_evaluation_follows(args, state, control)
        self._sync_if_needed(model, optimizer, state.global_step, due, evaluating, control.should_training_stop)
        if self._diverged_at_step == state.global_step:  # Trainer's logging_nan_inf_filter hides NaN losses
            control.should_log = True

    def on_epoch_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._sync_if_needed(model, optimizer, state.global_step, False, False, control.should_training_stop)

    def _sync_if_needed(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        step: int,
        due: bool,
        evaluating: bool,
        stopping: bool,
    ) -> None:
        """Average when due and at the end of training; an evaluation right after sees each group first."""
        if not (due or stopping):
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

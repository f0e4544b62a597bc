"""`FedAvgCallback`: the averaging schedule, as a `TrainerCallback` so the training loop stays Transformers' own.

When to average comes from `hf_fedshard.fragments` (which fragment starts and applies at each step); what an
averaging does is composed from the outer optimizer (`hf_fedshard.outer`: anchor, pseudo-gradients), the exchange
(`hf_fedshard.exchange`: the mean over groups) and its codec (`hf_fedshard.codec`: the wire dtype). An overlapped
exchange runs on one worker thread over process groups of its own (`hf_fedshard.mesh.exchange_process_groups`),
so the main thread's collectives never share a group with it; evaluations, saves and the end wait for it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

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
from .errors import ConfigError
from .exchange import Exchange, ProcessGroupCommunicator
from .fragments import Schedule, fragment_ranges
from .notices import notice
from .outer import OuterOptimizer, outer_state_device
from .settings_history import (
    AveragingSettings,
    History,
    history_from_state,
    history_to_state,
    settings_of_outer_state,
)
from .timeouts import peer_died

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


@dataclass
class InFlight:
    """An overlapped exchange of ``fragment``'s mean Δ, started at ``start_step`` and applied at ``apply_step``.

    ``snapshots`` are this rank's fp32 local shards Δ was taken from (to keep the progress made since);
    ``result`` is (mean Δ, bytes sent) once the worker thread has finished (or from a checkpoint).
    """

    fragment: int
    start_step: int
    apply_step: int
    snapshots: list[torch.Tensor]
    contribute: bool
    contributors: int
    diverged: list[int]
    blocked_s: float  # loop time its start took
    future: Future | None = None
    result: tuple[list[torch.Tensor], int] | None = None

    def wait(self) -> tuple[list[torch.Tensor], int]:
        if self.result is None:
            self.result, self.future = self.future.result(), None
        return self.result

    def state_dict(self) -> dict:
        means, sent = self.wait()
        fields = ("fragment", "start_step", "apply_step", "snapshots", "contribute", "contributors", "diverged")
        return {**{k: getattr(self, k) for k in fields}, "blocked_s": self.blocked_s, "means": means, "sent": sent}

    @classmethod
    def from_state_dict(cls, state: dict) -> InFlight:
        kept = {k: v for k, v in state.items() if k not in ("means", "sent")}
        return cls(**kept, result=(state["means"], state["sent"]))


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

    With ``schedule`` streaming (`hf_fedshard.fragments`), the trainable shards are cut into fragments of whole
    FSDP units, each with its own anchor and outer momentum, each exchanged on its own step and, with overlap τ,
    applied τ steps later while training goes on (local ← anchor' + the progress made meanwhile).

    Before each averaging the groups agree, with two tiny collectives, on which of them hold a NaN or an Inf
    (a diverged group). A diverged group sends nothing and restarts from the others' average (every fragment from
    its anchor) with its optimizer state reset; if every group diverged, training stops with an error. With
    overlap, a group that diverges inside the τ window restarts at the apply step.

    Args:
        fed_group: process group of the ranks holding the same shards in the other groups (``mesh["fed"]``).
        num_groups: number of federation groups (size of ``fed_group``).
        sync_steps: H, optimizer steps between two averagings.
        average_optimizer_state: also average the optimizer's moments (off in the paper).
        group: process group of this rank's own federation group, to agree on its divergence flag; ``None``
            when a group is one rank.
        timeout_s: the timeout ``fed_group`` was created with, quoted in the error when a group stops answering.
        world_group: every rank, created with ``timeout_s``, for the norms of `_measure` (default: the world's
            group, whose timeout is ``ddp_timeout``).
        before_eval: called on every rank right before an evaluation between averagings (or the averaging on
            an evaluation's step), while the groups still hold their own models (per-group evaluation).
        exchange: how the mean Δ is computed (wire dtype, FL+HSDP split); default: fp32 over ``fed_group``.
        settings: the outer optimizer and wire dtype (`AveragingSettings`; default FedAvg in fp32); the dtype is
            recorded here, ``exchange`` sends in it. A resume may change them (`hf_fedshard.settings_history`).
        replicas: HSDP replicas per group (ranks holding the same shard), to turn shard norms into model norms.
        schedule: fragments and overlap (default: every ``sync_steps`` steps, the whole model, blocking).
        outer_on_device: keep CUDA shards' anchors and momentum on the GPU instead of pinned CPU memory.
    """

    def __init__(
        self,
        fed_group: ProcessGroup,
        num_groups: int,
        sync_steps: int,
        average_optimizer_state: bool = False,
        group: ProcessGroup | None = None,
        timeout_s: float | None = None,
        world_group: ProcessGroup | None = None,
        before_eval: Callable[[], None] | None = None,
        exchange: Exchange | None = None,
        settings: AveragingSettings | None = None,
        replicas: int = 1,
        schedule: Schedule | None = None,
        outer_on_device: bool = False,
    ) -> None:
        self.fed_group = fed_group
        self.num_groups = num_groups
        self.sync_steps = sync_steps
        self.average_optimizer_state = average_optimizer_state
        self.group = group
        self.timeout_s = timeout_s
        self.world_group = world_group
        self.before_eval = before_eval
        self.exchange = exchange or Exchange(ProcessGroupCommunicator(fed_group))
        self.settings = settings or AveragingSettings()
        self.settings_history: History = [(0, self.settings)]  # what ran from which step (a resume adds to it)
        self._saved_history: History | None = None
        self.replicas = replicas
        self.schedule = schedule or Schedule(sync_steps)
        self.schedule.validate()
        if self.schedule.overlap and exchange is None:
            raise ValueError(
                "FedAvgCallback: an overlapped schedule needs an `exchange` over process groups of its own "
                "(hf_fedshard.mesh.exchange_process_groups): the worker thread must not share fed_group."
            )
        self.outer_on_device = outer_on_device
        self.outers: list[OuterOptimizer] = []  # one per fragment, built when training starts on the sharded model
        self.ranges: list[tuple[int, int]] = []  # each fragment's [start, stop) in the trainable parameters
        self._saved_outer_state: dict | None = None  # from a checkpoint, loaded into `outers` when they are built
        self._in_flight: InFlight | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.delta_norm = 0.0
        self.group_drift = 0.0
        self.syncs = 0
        self.inter_group_bytes = 0
        self.last_sync_seconds = 0.0
        self.total_sync_seconds = 0.0
        self.last_wait_seconds = 0.0
        self.total_wait_seconds = 0.0
        self.diverged_groups = 0
        self._synced_at = [0] * self.schedule.fragments  # the step each fragment was last equal in every group
        self._groups_evaluated_at: int | None = None  # the step `before_eval` last ran at
        self._diverged_at_step: int | None = None
        self._output_dir: str | None = None

    def metrics(self) -> dict[str, float]:
        """Counters for the training logs."""
        return {
            "fed_syncs": self.syncs,
            "fed_inter_group_bytes": self.inter_group_bytes,
            "fed_sync_seconds": round(self.last_sync_seconds, 6),
            "fed_sync_seconds_total": round(self.total_sync_seconds, 6),
            "fed_sync_wait_seconds_total": round(self.total_wait_seconds, 6),
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
            "total_wait_seconds": self.total_wait_seconds,
            "diverged_groups": self.diverged_groups,
            "synced_at": list(self._synced_at),
            "delta_norm": self.delta_norm,
            "group_drift": self.group_drift,
            "averaging": history_to_state(self.settings_history),
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.syncs = int(state["syncs"])
        self.inter_group_bytes = int(state["inter_group_bytes"])
        self.last_sync_seconds = float(state["last_sync_seconds"])
        self.total_sync_seconds = float(state.get("total_sync_seconds", 0.0))
        self.total_wait_seconds = float(state.get("total_wait_seconds", 0.0))
        self.diverged_groups = int(state["diverged_groups"])
        if "synced_at" not in state:
            raise ConfigError(
                "the checkpoint's FedAvg counters hold last_synced_step, written by an hf_fedshard release before "
                "pseudo-gradient averaging, which this one does not resume. Resume it with that release, or start "
                "afresh in another output_dir."
            )
        synced_at = state["synced_at"]
        if len(synced_at) != self.schedule.fragments:
            raise ConfigError(
                f"fed_sync_fragments={self.schedule.fragments}, but the checkpoint was written with "
                f"{len(synced_at)} fragment(s). Resume with --fed_sync_fragments {len(synced_at)}."
            )
        self._synced_at = [int(step) for step in synced_at]
        self.delta_norm = float(state.get("delta_norm", 0.0))
        self.group_drift = float(state.get("group_drift", 0.0))
        self._saved_history = history_from_state(state["averaging"]) if "averaging" in state else None

    def outer_state_dict(self) -> dict | None:
        """Each fragment's anchor and outer momentum on this rank (equal in every group); ``None`` before training."""
        return {"fragments": [outer.state_dict() for outer in self.outers]} if self.outers else None

    def load_outer_state(self, state: dict | None) -> None:
        """Keep a checkpoint's outer state until `on_train_begin` builds the outer optimizers on the model."""
        self._saved_outer_state = state

    def in_flight_state_dict(self) -> dict | None:
        """This rank's exchange in flight (waited for, not applied), for a checkpoint; ``None`` if there is none."""
        if self._in_flight is None:
            return None
        with self._explain_failures(self._in_flight.start_step):
            return self._in_flight.state_dict()

    def load_in_flight_state(self, state: dict | None) -> None:
        """Restore a checkpoint's exchange in flight: it is applied at its scheduled step, as without the stop."""
        if state is not None and (
            state["apply_step"] - state["start_step"] != self.schedule.overlap
            or self.schedule.starting(state["start_step"]) != state["fragment"]
        ):
            raise ConfigError(
                f"the checkpoint holds an exchange started at step {state['start_step']} for step "
                f"{state['apply_step']}, which fed_sync_steps={self.schedule.sync_steps}, fed_sync_fragments="
                f"{self.schedule.fragments}, fed_sync_overlap={self.schedule.overlap} do not schedule. Resume with "
                "the schedule the checkpoint was written with."
            )
        self._in_flight = None if state is None else InFlight.from_state_dict(state)

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
        self._wait_in_flight()
        device = tensors[0].device if tensors else torch.device("cpu")
        with self._explain_failures(step):
            local = torch.tensor([0.0 if all_finite(tensors) else 1.0], device=device)
            if self.group is not None:
                all_reduce(local, op=ReduceOp.MAX, group=self.group)
            flags = torch.zeros(self.num_groups, device=device)
            flags[get_rank(self.fed_group)] = local[0]
            all_reduce(flags, op=ReduceOp.SUM, group=self.fed_group)
        return [g for g, flag in enumerate(flags.tolist()) if flag > 0]

    def sync(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        step: int,
        fragments: Sequence[int] | None = None,
    ) -> None:
        """Average ``fragments`` (default: all) now, blocking (a collective: every rank at the same step).

        The last fragment carries the rest of the payload (floating buffers, and the moments if asked).
        """
        fragments = range(self.schedule.fragments) if fragments is None else fragments
        tensors = self.payload(model, optimizer)
        params, others = self._split_payload(tensors)
        start = time.perf_counter()
        diverged = self.diverged(tensors, step)
        self._check_not_all_diverged(diverged, step)
        mine_diverged = get_rank(self.fed_group) in diverged
        contributors = self.num_groups - len(diverged)
        with self._explain_failures(step):
            sent_deltas, means = [], []
            for f in fragments:
                a, b = self.ranges[f]
                deltas, mean = self._outer_step(f, params[a:b], contributors, contribute=not mine_diverged)
                sent_deltas += deltas
                means += mean
            self._measure(sent_deltas, means, not mine_diverged, contributors)
            if self.schedule.fragments - 1 in fragments:
                self.inter_group_bytes += average_across_groups(
                    others, self.fed_group, contributors, contribute=not mine_diverged
                )
        if tensors and tensors[0].is_cuda:
            torch.cuda.synchronize()
        self._count(time.perf_counter() - start, 0.0)
        for f in fragments:
            self._synced_at[f] = step
        if diverged:
            self._restart_diverged(diverged, mine_diverged, optimizer, step, params, keep=fragments)

    def _split_payload(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(trainable shards, the rest): the payload's first tensors are the trainable parameters'."""
        trainable = self.ranges[-1][1]
        return tensors[:trainable], tensors[trainable:]

    def _check_not_all_diverged(self, diverged: list[int], step: int) -> None:
        if len(diverged) == self.num_groups:
            raise RuntimeError(
                f"hf_fedshard: every federation group ({self.num_groups}) has NaN/Inf in its model at step {step}; "
                f"training stopped. The latest checkpoint in {self._output_dir} holds finite weights (checkpoints "
                "are skipped while a group has NaN/Inf): resume from it with a lower learning_rate or max_grad_norm."
            )

    def _outer_step(
        self, fragment: int, params: list[torch.Tensor], contributors: int, contribute: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Δ, its mean over groups and the outer step of one fragment; returns (Δ as sent, mean Δ)."""
        outer = self.outers[fragment]
        deltas = outer.deltas(params)
        if not contribute:  # a diverged group's Δ holds NaN: it sends zeros and takes the others' mean
            deltas = [torch.zeros_like(d) for d in deltas]
        means, sent = self.exchange.mean(deltas, contributors)
        self.inter_group_bytes += sent
        outer.step(means, params)
        return deltas, means

    def _count(self, blocked_s: float, waited_s: float) -> None:
        """One more averaging, which held the training loop ``blocked_s`` (``waited_s`` of it on the network)."""
        self.last_sync_seconds, self.last_wait_seconds = blocked_s, waited_s
        self.total_sync_seconds += blocked_s
        self.syncs += 1

    def start(self, model: nn.Module, fragment: int, step: int) -> None:
        """Start ``fragment``'s exchange on the worker thread; `apply` finishes it ``overlap`` steps later."""
        if self._in_flight is not None:
            raise RuntimeError(
                f"hf_fedshard: an exchange started at step {self._in_flight.start_step} is still in flight at step "
                f"{step}; the schedule applies one before the next starts (fed_sync_overlap < H / F)."
            )
        begin = time.perf_counter()
        tensors = model_state_tensors(model)
        params, others = self._split_payload(tensors)
        diverged = self.diverged(tensors, step)
        self._check_not_all_diverged(diverged, step)
        contribute = get_rank(self.fed_group) not in diverged
        contributors = self.num_groups - len(diverged)
        a, b = self.ranges[fragment]
        snapshots = [p.detach().to(torch.float32, copy=True) for p in params[a:b]]
        deltas = self.outers[fragment].deltas(snapshots)
        if not contribute:
            deltas = [torch.zeros_like(d) for d in deltas]
        if fragment == self.schedule.fragments - 1 and others:
            with self._explain_failures(step):
                self.inter_group_bytes += average_across_groups(others, self.fed_group, contributors, contribute)
        future = self._worker().submit(self._exchange_in_background, deltas, contributors, _ready_event(deltas))
        self._in_flight = InFlight(
            fragment, step, step + self.schedule.overlap, snapshots, contribute, contributors, diverged,
            blocked_s=time.perf_counter() - begin, future=future,
        )  # fmt: skip

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_fedshard-exchange")
        return self._executor

    def _exchange_in_background(
        self, deltas: list[torch.Tensor], contributors: int, ready: torch.cuda.Event | None
    ) -> tuple[list[torch.Tensor], int]:
        """The mean Δ, on the worker thread (on CUDA: its own stream, after Δ was computed on the main one)."""
        if ready is None:
            return self.exchange.mean(deltas, contributors)
        torch.cuda.set_device(deltas[0].device)  # a new thread starts on device 0
        stream = torch.cuda.Stream(device=deltas[0].device)
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            result = self.exchange.mean(deltas, contributors)
        stream.synchronize()
        return result

    def _wait_in_flight(self) -> float:
        """Let the exchange in flight finish (not applied); returns the seconds the loop waited, counted as such."""
        if self._in_flight is None or self._in_flight.result is not None:
            return 0.0
        begin = time.perf_counter()
        with self._explain_failures(self._in_flight.start_step):
            self._in_flight.wait()
        waited = time.perf_counter() - begin
        self._in_flight.blocked_s += waited
        self.total_wait_seconds += waited
        return waited

    def apply(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        """Finish the exchange in flight: the outer step on its mean Δ, keeping the local progress made since."""
        flight = self._in_flight
        waited = self._wait_in_flight()
        begin = time.perf_counter()
        means, sent = flight.wait()
        tensors = model_state_tensors(model)
        params, _ = self._split_payload(tensors)
        a, b = self.ranges[flight.fragment]
        outer = self.outers[flight.fragment]
        deltas = outer.deltas(flight.snapshots) if flight.contribute else [torch.zeros_like(m) for m in means]
        with self._explain_failures(step):
            self._measure(deltas, means, flight.contribute, flight.contributors)
        self._in_flight = None
        diverged_now = self.diverged(tensors, step)
        self._check_not_all_diverged(diverged_now, step)
        diverged = sorted(set(flight.diverged) | set(diverged_now))
        mine_diverged = get_rank(self.fed_group) in diverged
        outer.step(means, params[a:b], None if mine_diverged else flight.snapshots)
        if tensors and tensors[0].is_cuda:
            torch.cuda.synchronize()
        self.inter_group_bytes += sent
        self._count(flight.blocked_s + time.perf_counter() - begin, waited)
        if diverged:
            self._restart_diverged(diverged, mine_diverged, optimizer, step, params, keep=[flight.fragment])

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
        all_reduce(sums, op=ReduceOp.SUM, group=self.world_group)
        sums /= self.replicas
        mean_norm = (sums[-1] / self.num_groups).sqrt()  # every group holds the same mean Δ
        self.delta_norm = mean_norm.item()
        drift = sums[:-1].sqrt().sum() / contributors
        self.group_drift = (drift / mean_norm).item() if mean_norm > 0 else 0.0

    def finish(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        """End on the global model: apply the exchange in flight now, then average every fragment not equal yet."""
        if self._in_flight is not None:
            self.apply(model, optimizer, step)
        stale = [f for f in range(self.schedule.fragments) if self._synced_at[f] < step]
        if stale:
            self.sync(model, optimizer, step, stale)

    def _identical_at(self, step: int) -> bool:
        """Whether every group holds the same model at ``step`` (every fragment averaged at it, none in flight)."""
        return self._in_flight is None and all(synced >= step for synced in self._synced_at)

    def _restart_diverged(
        self,
        diverged: list[int],
        mine_diverged: bool,
        optimizer: torch.optim.Optimizer | None,
        step: int,
        params: list[torch.Tensor],
        keep: Sequence[int],
    ) -> None:
        """Count the diverged groups; theirs took the others' average, every other fragment its anchor, and
        their moments go too."""
        self.diverged_groups += len(diverged)
        self._diverged_at_step = step
        if mine_diverged:
            for f, (a, b) in enumerate(self.ranges):
                if f not in keep:
                    self.outers[f].restart(params[a:b])
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
            if peer_died(err):
                raise RuntimeError(
                    f"hf_fedshard: an exchange across federation groups failed at step {step}: a rank of another "
                    f"group died (its connection closed). Check that group's logs for its error. Cause: {err}"
                ) from err
            limit = f"fed_timeout_s={self.timeout_s:g}" if self.timeout_s else "ddp_timeout (fed_timeout_s unset)"
            raise RuntimeError(
                f"hf_fedshard: an exchange across federation groups failed at step {step}: another group stopped "
                f"answering (no reply within {limit} seconds). Check that group's logs; if it is only slow, raise "
                f"--fed_timeout_s. Cause: {err}"
            ) from err

    @contextlib.contextmanager
    def global_model(self, model: nn.Module, step: int, evaluating: bool = False) -> Iterator[None]:
        """Inside the block the model is the plain average of the groups' current models; after it, each group's own.

        For evaluations and exports between averagings (a collective, like `sync`): no outer step, no counter but
        the bytes, so the training trajectory is the same with or without them. A no-op on an averaged step.
        """
        if self._identical_at(step):
            yield
            return
        if evaluating:
            self._evaluate_groups(step)
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

    def _evaluate_groups(self, step: int) -> None:
        """Each group's own evaluation (``before_eval``), once per step, while the groups still differ."""
        if self.before_eval is not None and self._groups_evaluated_at != step:
            self._groups_evaluated_at = step
            self.before_eval()

    def average_models(self, model: nn.Module, step: int) -> None:
        """Make every group's model the groups' plain average now (a collective), e.g. after each group reloaded
        its own best checkpoint: what is then saved is one global model."""
        self._wait_in_flight()
        self._in_flight = None
        with self._explain_failures(step):
            self.inter_group_bytes += average_across_groups(model_state_tensors(model), self.fed_group, self.num_groups)
        self._synced_at = [step] * self.schedule.fragments

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # A fresh run averages the initial weights into the first anchor; a resumed one restores its checkpoint's.
        self._output_dir = args.output_dir
        trainable = trainable_parameters(model)
        self.ranges = fragment_ranges(model, trainable, self.schedule.fragments)  # refuses F > units: no collective yet
        if state.global_step == 0:
            self._synced_at = [0] * self.schedule.fragments
            self._in_flight = None
            self._average_initial_weights(model)
        params = model_state_tensors(model)[: len(trainable)]
        device = outer_state_device(params, self.outer_on_device)
        lr, momentum = self.settings.outer_lr, self.settings.outer_momentum
        self.outers = [OuterOptimizer(params[a:b], lr, momentum, device) for a, b in self.ranges]
        self._describe(trainable, device)
        if state.global_step > 0:
            self._load_outers(state.global_step)
            self._continue_history(state.global_step)

    def _describe(self, trainable: list[nn.Parameter], device: torch.device) -> None:
        """Say once, on rank 0, how the model is averaged and the outer state's memory per rank."""
        sizes = " / ".join(f"{sum(p.numel() for p in trainable[a:b]) / 1e6:.2f}" for a, b in self.ranges)
        timing = f"each behind {self.schedule.overlap} step(s)" if self.schedule.overlap else "blocking"
        notice(
            "averaging with %s: %d fragment(s) of whole FSDP units (%s M parameters), %s; outer state (anchor%s) "
            "%.1f MB per rank on %s",
            self.settings.describe(), len(self.ranges), sizes, timing,
            ", momentum" if self.settings.outer_momentum else "", sum(outer.nbytes for outer in self.outers) / 1e6,
            device,
        )  # fmt: skip

    def _load_outers(self, step: int) -> None:
        """Every fragment's anchor and momentum from the checkpoint."""
        saved = self._saved_outer_state
        if saved is None:
            raise RuntimeError(
                f"hf_fedshard: the checkpoint resumed at step {step} holds no anchor (fed_outer/); it was written "
                "before pseudo-gradient averaging. Resume from a newer checkpoint or start afresh."
            )
        fragments = saved["fragments"]
        if len(fragments) != len(self.outers):
            raise ConfigError(
                f"fed_sync_fragments={len(self.outers)}, but the checkpoint holds {len(fragments)} fragment(s). "
                f"Resume with --fed_sync_fragments {len(fragments)}."
            )
        for outer, state in zip(self.outers, fragments, strict=True):
            outer.load_state_dict(state)

    def _continue_history(self, step: int) -> None:
        """The checkpoint's settings history, plus this run's settings from ``step`` on where they differ."""
        history = self._saved_history or [
            (0, settings_of_outer_state(self._saved_outer_state, self.settings.sync_dtype))
        ]
        if history[-1][1] != self.settings:
            if get_rank() == 0:
                logger.warning(
                    "hf_fedshard: resuming at step %d with other averaging settings than the checkpoint's, honoured "
                    "from this step on: %s.",
                    step,
                    history[-1][1].changes_to(self.settings),
                )
            history = [*history, (step, self.settings)]
        self.settings_history = history

    def _average_initial_weights(self, model: nn.Module) -> None:
        """Step 0's plain average, so that groups initialised differently start from one global model."""
        start = time.perf_counter()
        with self._explain_failures(0):
            self.inter_group_bytes += average_across_groups(model_state_tensors(model), self.fed_group, self.num_groups)
        self.last_sync_seconds = time.perf_counter() - start
        self.total_sync_seconds += self.last_sync_seconds
        self.syncs += 1

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        step = state.global_step
        if self._in_flight is not None and self._in_flight.apply_step == step:
            self.apply(model, optimizer, step)
        evaluating = control.should_evaluate or _epoch_evaluation_follows(args, state, control)
        self._sync_if_needed(model, optimizer, step, evaluating, control.should_training_stop)
        if self._diverged_at_step == step:  # Trainer's logging_nan_inf_filter hides NaN losses
            control.should_log = True

    def on_epoch_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if control.should_training_stop:
            self.finish(model, optimizer, state.global_step)

    def _sync_if_needed(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int, evaluating: bool, stopping: bool
    ) -> None:
        """Start or run the averaging due at ``step``, and end on the global model; an evaluation right after a
        blocking averaging sees each group first."""
        fragment = self.schedule.starting(step)
        if fragment is None and not stopping:
            return
        if stopping or self.schedule.overlap == 0:
            if evaluating and not self._identical_at(step):
                self._evaluate_groups(step)
            if stopping:
                self.finish(model, optimizer, step)
            elif self._synced_at[fragment] < step:
                self.sync(model, optimizer, step, [fragment])
            return
        self.start(model, fragment, step)

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.finish(model, optimizer, state.global_step)
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None


def _ready_event(tensors: list[torch.Tensor]) -> torch.cuda.Event | None:
    """On CUDA, an event after ``tensors`` were computed on the current stream, for the worker's stream to wait on."""
    if not tensors or not tensors[0].is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _epoch_evaluation_follows(args: TrainingArguments, state: TrainerState, control: TrainerControl) -> bool:
    """Whether `on_epoch_end` will ask for an evaluation after this step (it decides after `on_step_end`)."""
    epoch_ends = control.should_training_stop or abs(state.epoch - round(state.epoch)) < 1e-9
    return args.eval_strategy == IntervalStrategy.EPOCH and epoch_ends and args.eval_delay <= state.epoch

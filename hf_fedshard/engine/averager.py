"""`FederatedAverager`: the federation's averaging, for any training loop (the Trainer's callback is one).

Call `step()` after every optimizer step and `finish()` after the last; in between, `global_model()` lends the
groups' plain average for an evaluation or an export. An averaging is an outer step on pseudo-gradients: each
rank's trainable shards move from the anchor (the global model of the previous averaging) by
`OuterOptimizer`'s step with the groups' mean Δ, exchanged by `Exchange`; floating buffers (and the optimizer's
moments, if asked) are plainly averaged. Every decision is a function of the step count and of values equal on
every rank, so all ranks enter each collective together.

With streaming (`hf_fedshard.engine.fragments`) the trainable shards are cut into fragments of whole FSDP units,
each with its own anchor and outer momentum, exchanged on its own step and, with overlap τ, applied τ steps later
while training goes on (local ← anchor' + the progress made meanwhile).

Divergence: the groups agree before each exchange, in the averaging's one control all-reduce
(`hf_fedshard.engine.control`), on which of them hold a NaN or an Inf. A diverged group sends nothing and restarts
from the others' average (every fragment from its anchor) with its optimizer state reset; if every group diverged,
training stops with an error. With overlap, a group that diverges inside an exchange's τ window is found by the
next exchange's agreement (it sent a finite Δ to this one), and restarts when that one is applied.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, replace
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hf_fedshard.engine.communicator import FederationCommunicator, Round
from hf_fedshard.engine.control import Agreement, Norms, agree
from hf_fedshard.engine.counters import Counters
from hf_fedshard.engine.exchange import Exchange
from hf_fedshard.engine.failures import explain_failures
from hf_fedshard.engine.feedback import ErrorFeedback
from hf_fedshard.engine.fragments import Fragment, fragment_ranges
from hf_fedshard.engine.observer import AveragingObserver
from hf_fedshard.engine.options import AveragingOptions, averaging_options
from hf_fedshard.engine.outer import OuterOptimizer, fragments_from_flat, outer_state_device
from hf_fedshard.engine.overlap import Begun, InFlight, Outcome, Worker
from hf_fedshard.engine.payload import (
    Address,
    all_finite,
    load_model_state,
    model_state_addresses,
    model_state_tensors,
    optimizer_state_addresses,
    optimizer_state_tensors,
    plain_mean_over_groups,
    reset_optimizer_state,
    trainable_parameters,
)
from hf_fedshard.engine.pieces import PieceExchange
from hf_fedshard.engine.resumable import check_state, continue_history
from hf_fedshard.engine.rounds import run_round
from hf_fedshard.engine.settings_history import History, history_from_state, history_to_state
from hf_fedshard.engine.speed import RoundPlan
from hf_fedshard.errors import ConfigError
from hf_fedshard.notices import notice

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class FederatedAverager:
    """Averages a model across federation groups every ``sync_steps`` optimizer steps, from any training loop.

    Construct it on every rank once the model is sharded (FSDP2 over ``mesh["dp_replicate", "dp_shard"]``) and
    the optimizer built: it averages the initial weights, so every group starts from one global model. To resume,
    construct it, load the model's and optimizer's own state, then `load_state_dict`.

    Args:
        model: the model, sharded inside this rank's federation group.
        optimizer: the inner optimizer over the model's parameters.
        mesh: the world mesh of `FederationLayout.build_mesh`, to check the model is sharded inside its group.
        communicator: the cross-group collectives a transport gives (`hf_fedshard.engine.communicator`), or a
            function that builds them from the checked options (how `hf_fedshard.FederatedAverager` turns a mesh
            into the one-job transport's).
        **settings: the averaging settings, `AveragingOptions`' fields (``sync_steps=8``, ``sync_dtype="int8"``,
            ...): the ``fed_*`` settings without the prefix, declared and documented there.
        before_eval: called on every rank before the global model is lent for an evaluation that sees the groups
            differ, while each group still holds its own model (the Trainer's per-group evaluation).
        average_initial_weights: ``False`` when a `load_state_dict` follows (a resume), which must then come
            before the first `step`.
        clock: seconds, monotonic: what a speed-aware round measures its steps with (tests pass their own).

    With ``round_policy="speed"`` the loop asks `should_train` before each step and, where it is ``False``, takes
    the step's batch without training on it, then calls `step` as ever (`hf_fedshard.engine.speed`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        mesh: DeviceMesh | None = None,
        *,
        communicator: FederationCommunicator | Callable[[AveragingOptions], FederationCommunicator] | None = None,
        before_eval: Callable[[], None] | None = None,
        average_initial_weights: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        **settings: Any,
    ) -> None:
        options = averaging_options(settings)
        self.options, self.schedule, self.settings = options, options.schedule, options.settings
        trainable = _check_model_and_optimizer(model, optimizer, mesh)
        ranges = fragment_ranges(model, trainable, self.schedule.fragments)  # refuses F > units: no collective yet
        if communicator is None:
            raise ConfigError(
                "FederatedAverager needs the world mesh (FederationLayout.build_mesh) or a communicator=."
            )
        self.comm = communicator(options) if callable(communicator) else communicator
        self.model, self.optimizer, self.before_eval = model, optimizer, before_eval
        self._addresses = model_state_addresses(model)
        self._shapes = self.comm.shapes  # the groups the exchanges below were built for
        self._exchange, self._pieces = self._exchanges(options.sync_dtype)
        self.settings_history: History = [(0, self.settings)]
        self.counters = Counters()
        self.step_count = 0
        self.diverged_at_step: int | None = None  # the last step a group was found with NaN/Inf
        self._trainable = len(trainable)
        self._norms: Norms | None = None  # this rank's norm sums of the last averaging, published by the next
        self._worker = Worker()
        self._loaded = average_initial_weights
        self._finished = self._lending = False
        self._groups_evaluated_at: int | None = None
        self._lent: tuple[int, list[torch.Tensor] | None] | None = None  # a lend round's (step, means; None: healed)
        self._last_round: Round | None = None  # the last quorum formed (`finish` starts the END round from it)
        self._observers: list[AveragingObserver] = []
        params = model_state_tensors(model)[: self._trainable]
        device = outer_state_device(params, options.outer_state_on_device)
        lr, momentum = self.settings.outer_lr, self.settings.outer_momentum
        self.fragments = [
            Fragment(i, a, b, OuterOptimizer(params[a:b], lr, momentum, device), feedback=self._feedback(params[a:b]))
            for i, (a, b) in enumerate(ranges)
        ]
        self.rounds = RoundPlan(options.sync_steps, options.min_round_steps, clock) if options.speed_aware else None
        self._describe(trainable, device)
        if self.comm.membership is not None:  # a joining group heals from this group's state of the last commit,
            # from step 0's averaging on: its round's snapshot must hold this part (a quorum may heal a group there)
            self.comm.membership.heal.register("averager", self.peer_state, self.load_peer_state)
        if average_initial_weights:
            self._average_initial_weights()

    # ---- The loop's calls ----

    def step(self, *, evaluating: bool = False, last: bool = False) -> None:
        """One more optimizer step was taken: apply, start or run the averaging the schedule gives for it.

        ``evaluating``: an evaluation of the global model follows this step (the groups are evaluated first if
        ``before_eval`` is set); ``last``: this was the last step, so end on the global model (`finish`).
        """
        if self._finished:
            raise RuntimeError("FederatedAverager.step() after finish(): finish() ends the averaging; build a new one.")
        if not self._loaded:
            raise RuntimeError(
                "FederatedAverager: average_initial_weights=False but no load_state_dict() before the first step(): "
                "the groups would start from different anchors. Load a checkpoint's state first, or construct it "
                "with average_initial_weights=True."
            )
        if self.rounds is not None:
            self.rounds.stepped(self.step_count + 1)
        self.step_count += 1
        self._after_step(evaluating, last)
        if self.rounds is not None:
            self.rounds.restart_clock()

    def step_begins(self) -> None:
        """Optional, before a step: a speed-aware round measures the step's duration from here (else from the last
        `step`'s return), so what the loop does between steps (logging, evaluation, checkpoints) is left out."""
        if self.rounds is not None:
            self.rounds.restart_clock()

    @property
    def should_train(self) -> bool:
        """Whether this group trains the next step: always, but in a speed-aware round past the group's H_g."""
        return self.rounds is None or self.rounds.trains(self.step_count + 1)

    def _after_step(self, evaluating: bool, last: bool) -> None:
        """`step`'s work once the step is counted: apply, start or run the averaging the schedule gives for it."""
        step = self.step_count
        flight = self._in_flight()
        if flight is not None and flight.in_flight.begun.apply_step == step:
            self._land(flight)
        fragment = self.schedule.starting(step)
        lend = evaluating and not last and self.comm.membership is not None
        if fragment is None and not last:
            if lend:
                self._lend_round()
            return
        if last or self.schedule.overlap == 0:
            if evaluating and not self._identical():
                self._evaluate_groups()
            if last:
                self.finish()
            elif self.fragments[fragment].averaged_at < step:
                self._average([fragment])
            if lend:
                self._lend_round()
            return
        if lend:  # before the begin: a round's quorum forms only where nothing is in flight
            self._lend_round()
        self._begin_overlapped(self.fragments[fragment])

    def finish(self) -> None:
        """End on the global model: apply the exchange in flight now, then average every fragment not equal yet.

        A collective. Publishes the last averaging's norms (`metrics`); calling it again does nothing.
        """
        if self._finished:
            return
        flight = self._in_flight()
        if flight is not None:
            self._land(flight)
        stale = [f.index for f in self.fragments if f.averaged_at < self.step_count]
        if stale:
            self._average(stale)
        if self._norms is not None and self.comm.membership is None:  # a round of its own is not worth the wait
            self._agree([])
        if self.comm.membership is not None:  # END (`hf_fedshard.engine.rounds` I10): late groups heal from here
            self.comm.membership.end(self._new_quorum, self._last_round)
        self._worker.shutdown()
        self._finished = True

    @contextlib.contextmanager
    def global_model(self, evaluating: bool = False) -> Iterator[None]:
        """Inside the block the model is the plain average of the groups' current models; after it, each group's own.

        For evaluations and exports between averagings (a collective, like `step`): no outer step, no counter but
        the bytes, so the training trajectory is the same with or without them. A no-op where the groups are equal.
        ``evaluating``: the groups are first evaluated by ``before_eval``.
        """
        if self._lending:
            raise RuntimeError("FederatedAverager.global_model() is already open: the blocks do not nest.")
        lent = self._lent[1] if self._lent is not None and self._lent[0] == self.step_count else ()
        if self._identical() or lent is None:  # one model; or this group healed in the lend round: its own
            yield
            return
        tensors = model_state_tensors(self.model)
        own = [t.clone() for t in tensors]
        if lent:  # the lend round of this step (`_lend_round`) already averaged them: no collective here
            with torch.no_grad():
                for tensor, mean in zip(tensors, lent, strict=True):
                    tensor.copy_(mean)
        else:
            self._refuse_outside_rounds("the global model is lent (an evaluation or an export)")
            if evaluating:
                self._evaluate_groups()
            self._lend_now(tensors)
        self._lending = True
        try:
            yield
        finally:
            self._lending = False
            with torch.no_grad():
                for tensor, saved in zip(model_state_tensors(self.model), own, strict=True):
                    tensor.copy_(saved)

    def _lend_now(self, tensors: list[torch.Tensor]) -> None:
        """``tensors`` ← the groups' plain mean (the diverged left out), the bytes counted."""
        diverged = self._agree(tensors)
        if len(diverged) < self.comm.num_groups:
            contribute, contributors = self._contribution(diverged)
            self.counters.inter_group_bytes += self._plain_mean(tensors, self._addresses, contributors, contribute)

    def _lend_round(self) -> None:
        """With a `Membership`, an evaluation between averagings: a round of its own (the plain mean of the model
        state into copies, committed), whose result `global_model` lends at this step without a collective. It runs
        where nothing is in flight (a quorum may form after it); a group that heals in it evaluates its own model,
        the source's committed one. Nothing else changes: the training trajectory is the same with or without it."""
        step = self.step_count
        if self._identical():
            return
        if self._in_flight() is not None:
            raise ConfigError(
                f"hf_fedshard: an evaluation at step {step} falls while an exchange begun at step "
                f"{self._in_flight().in_flight.begun.start_step} is in flight, where fed_transport torchft cannot "
                f"form a round. Evaluate on multiples of fed_sync_steps / fed_sync_fragments = "
                f"{self.schedule.sync_steps // self.schedule.fragments}."
            )
        self._evaluate_groups()
        self._lent = (step, None)

        def attempt() -> list[torch.Tensor]:
            means = [t.detach().clone() for t in model_state_tensors(self.model)]
            self._lend_now(means)
            return means

        def apply(means: list[torch.Tensor]) -> None:
            self._lent = (step, means)

        self._in_round(attempt, apply)

    def adopt_plain_average(self) -> None:
        """Make every group's model the groups' plain average now (a collective, no outer step), e.g. after each
        group reloaded its own best checkpoint: what is then saved is one global model."""
        self._refuse_outside_rounds("every group adopts the plain average (e.g. load_best_model_at_end)")
        self._wait_in_flight()
        for fragment in self.fragments:
            fragment.in_flight = None
        self.counters.inter_group_bytes += self._plain_mean(model_state_tensors(self.model), self._addresses)
        for fragment in self.fragments:
            fragment.averaged_at = self.step_count

    def find_diverged_groups(self) -> list[int]:
        """The groups holding a NaN/Inf in their payload now (a collective; e.g. before a checkpoint is written).

        None right after an averaging: every group then holds the global model, finite (the diverged restarted).
        """
        if self._identical():
            return []
        self._refuse_outside_rounds("the groups are checked for NaN/Inf (e.g. before a checkpoint)")
        return self._agree(self._payload())

    def peer_state(self) -> dict:
        """What a group that joins needs to take part from now on (a heal), as of the last committed averaging
        (`hf_fedshard.engine.rounds`, I1): the global model, `state_dict`. Taken right after each commit; until the
        next one nothing in it changes (the anchors are the global model, the buffers are copied), so it holds
        references: a transport sends a copy."""
        state = self.state_dict()
        state["feedback"] = None  # the source's unsent Δ is its own: the joiner starts from none (engine.feedback)
        state["counters"]["pending_norms"] = None  # sums over a quorum without the joining group: not published
        state["counters"]["round_steps_planned"] = None  # the source's plan is its speed's: the joiner trains all H
        anchors = [anchor for f in self.fragments for anchor in f.outer.anchor]
        buffers = [t.detach().clone() for t in model_state_tensors(self.model)[self._trainable :]]
        return {"model": anchors + buffers, "averager": state}

    def load_peer_state(self, state: dict) -> None:
        """Take a live peer's `peer_state` (same layout and settings): model, anchors, outer state, counters."""
        load_model_state(self.model, state["model"])
        self.load_state_dict(state["averager"])

    def add_observer(self, observer: AveragingObserver) -> None:
        """Call ``observer`` at each averaging from now on (`hf_fedshard.engine.observer`)."""
        self._observers.append(observer)

    def _tell(self, event: str, *args: Any) -> None:
        for observer in self._observers:
            getattr(observer, event)(*args)

    def metrics(self) -> dict[str, float]:
        """The ``fed_*`` values to log (``fed_delta_norm`` and ``fed_group_drift`` are the averaging's before the
        last one until `finish`, see `hf_fedshard.engine.control`), and the transport's own (torchft's quorum)."""
        membership = self.comm.membership
        return {**self.counters.metrics(), **(membership.metrics() if membership is not None else {})}

    @property
    def exchange(self) -> Exchange | PieceExchange:
        """The exchange of Δ over this round's groups (rebuilt where a transport's groups of unequal size changed)."""
        self._follow_groups()
        return self._exchange

    # ---- Checkpoints ----

    def state_dict(self) -> dict:
        """What this rank needs to continue exactly: ``counters`` (JSON: schedule position, counts, settings
        history), ``outer`` (each fragment's anchor and outer momentum, equal in every group) and ``in_flight``
        (the exchange started, waited for but not applied; ``None`` if none)."""
        counters = {
            **self.counters.state_dict(),
            "synced_at": [f.averaged_at for f in self.fragments],
            "averaging": history_to_state(self.settings_history),
            "pending_norms": None if self._norms is None else asdict(self._norms),
            "round_steps_planned": None if self.rounds is None else self.rounds.steps,
        }
        flight = self._in_flight()
        in_flight = None
        if flight is not None:  # with a `Membership` its outcome is not committed yet: a resume attempts it again
            with self._explain(flight.in_flight.begun.start_step):
                in_flight = flight.in_flight.state_dict(with_outcome=self.comm.membership is None)
        return {
            "step": self.step_count,
            "counters": counters,
            "outer": {"fragments": [f.outer.state_dict() for f in self.fragments]},
            "in_flight": in_flight,
            "feedback": self._residuals(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict`'s output, with this averager's own settings (a resume may change the outer
        optimizer and the wire dtype: `hf_fedshard.engine.settings_history`). ``outer`` may also be held by
        parameter (`fragments_from_flat`), as a checkpoint read onto another layout holds it."""
        if "anchor" in state["outer"]:
            ranges = [(f.start, f.stop) for f in self.fragments]
            outer = fragments_from_flat(state["outer"], ranges, [f.outer for f in self.fragments])
            state = {**state, "outer": outer}
        check_state(state, self.schedule, len(self.fragments))
        self.step_count = int(state["step"])
        counters = state["counters"]
        self.counters.load_state_dict(counters)
        for fragment, synced, outer in zip(
            self.fragments, counters["synced_at"], state["outer"]["fragments"], strict=True
        ):
            fragment.averaged_at = int(synced)
            fragment.outer.load_state_dict(outer)
            fragment.in_flight = None
        if state["in_flight"] is not None:
            flight = self._flight_of(state["in_flight"])
            self.fragments[flight.begun.fragments[0]].in_flight = flight
        self._load_residuals(state.get("feedback"))
        if self.rounds is not None:  # this round's plan; a checkpoint of fed_round_policy steps trains all H
            self.rounds.forget()
            self.rounds.steps = int(counters.get("round_steps_planned") or self.schedule.sync_steps)
        pending = counters.get("pending_norms")
        self._norms = None if pending is None else Norms(**pending)
        saved = history_from_state(counters["averaging"]) if "averaging" in counters else None
        log = self.comm.control.rank() == 0
        self.settings_history = continue_history(saved, state["outer"], self.settings, self.step_count, log)
        self._loaded = True

    def _flight_of(self, state: dict) -> InFlight:
        """A checkpoint's exchange in flight; one written before `Begun` existed (its buffers averaged when it
        began, its Δ taken against the anchor just loaded) is read as such."""
        if "begun" in state:
            return InFlight.from_state_dict(state)
        snapshots = tuple(state["snapshots"])
        begun = Begun((state["fragment"],), state["start_step"], state["apply_step"], (snapshots,), (), True)
        deltas = self._deltas(self.fragments[state["fragment"]], snapshots, state["contribute"])
        outcome = Outcome(state["diverged"], None, None, state["contribute"], state["contributors"], [deltas],
                          [state["means"]], [], state["sent"])  # fmt: skip
        return InFlight(begun, state["blocked_s"], outcome=outcome)

    # ---- An averaging ----

    def _average(self, indices: Sequence[int]) -> None:
        """Average the fragments ``indices`` now, blocking: it begins, is attempted and applied at this step.

        The last fragment carries the rest of the payload (floating buffers, and the moments if asked). With a
        `Membership` this is a round: nothing changes unless every collective succeeded (`_in_round`).
        """
        self._tell("averaging", self.step_count, list(indices))
        start = time.perf_counter()
        begun = self._begin(indices, overlap=0)
        self._in_round(
            lambda: self._attempt(begun), lambda outcome: self._apply(begun, outcome, time.perf_counter() - start, 0.0)
        )
        self._tell("averaged", self.step_count, list(indices))

    def _begin_overlapped(self, fragment: Fragment) -> None:
        """Begin ``fragment``'s averaging and run its exchange on the worker thread; `_land` applies it τ steps
        later. The control all-reduce runs now, on this thread, and publishes the previous averaging's norms."""
        self._tell("exchange_started", self.step_count, fragment.index)
        start = time.perf_counter()
        begun = self._begin([fragment.index], self.schedule.overlap)
        head, exchange = self._prepare(begun)
        self._publish(head.published)
        head = replace(head, published=None)
        if not self.comm.background_exchange:  # the transport's collectives run on the loop's thread only
            with self._explain():
                outcome = exchange(head, False)
            fragment.in_flight = InFlight(begun, time.perf_counter() - start, outcome=outcome)
            return
        inputs = [d for deltas in head.deltas for d in deltas]
        future = self._worker.submit(lambda: exchange(head, True), inputs)
        fragment.in_flight = InFlight(begun, time.perf_counter() - start, future=future)

    def _land(self, fragment: Fragment) -> None:
        """Apply ``fragment``'s overlapped averaging: its exchange's outcome, committed (with a `Membership`, a
        round whose first attempt is the one in flight, and whose redo runs here, blocking)."""
        flight = fragment.in_flight
        self._tell("applying", self.step_count, fragment.index, flight.begun.start_step)
        waited = self._wait_in_flight()
        start = time.perf_counter()
        fragment.in_flight = None  # a round's snapshot (I1) and a quorum see nothing in flight from here on
        first = [flight]

        def attempt() -> Outcome:
            outcome = None
            if first:
                with self._explain(flight.begun.start_step):
                    outcome = first.pop().result()
            return self._attempt(flight.begun) if outcome is None else outcome

        def apply(outcome: Outcome) -> None:
            self._apply(flight.begun, outcome, flight.blocked_s + time.perf_counter() - start, waited)

        self._in_round(attempt, apply)
        self._tell("applied", self.step_count, fragment.index)

    def _begin(self, indices: Sequence[int], overlap: int) -> Begun:
        """What every attempt of the averaging of ``indices`` reads of this rank, taken now (`Begun`)."""
        payload = self._payload()
        params, rest = payload[: self._trainable], payload[self._trainable :]
        snapshots = None
        if overlap:
            snapshots = tuple(
                tuple(p.detach().to(torch.float32, copy=True) for p in self.fragments[i].of(params)) for i in indices
            )
        if self.schedule.fragments - 1 not in indices:
            rest = []
        elif overlap:
            rest = [t.detach().clone() for t in rest]
        report = self.rounds.report(self.step_count) if self.rounds is not None else None
        step = self.step_count
        return Begun(tuple(indices), step, step + overlap, snapshots, tuple(rest), all_finite(payload), report)

    def _attempt(self, begun: Begun) -> Outcome:
        """EXCHANGE, inline: every collective of ``begun``'s averaging; changes no state but the time counted."""
        head, exchange = self._prepare(begun)
        with self._explain():
            return exchange(head, False)

    def _prepare(self, begun: Begun) -> tuple[Outcome, Callable[[Outcome, bool], Outcome]]:
        """An attempt's part on the loop's thread: the control all-reduce and this rank's Δ (``head``); and the
        exchange still to run, inline or on the worker (``background``: over the worker's own peers)."""
        agreed = self._agree_values(begun.finite, begun)
        contribute, contributors = self._contribution(agreed.diverged)
        scale, weighted = self._speed_weights(agreed, contributors)
        params = model_state_tensors(self.model)[: self._trainable]  # not the moments: Δ is of parameters
        deltas = [
            self._deltas(self.fragments[i], begun.sources(k, self.fragments[i].of(params)), contribute)
            for k, i in enumerate(begun.fragments)
        ]
        head = Outcome(agreed.diverged, agreed.published, agreed.speeds, contribute, contributors, deltas)
        exchange, addresses = self.exchange, self._payload_addresses()
        rest_addresses = addresses[len(addresses) - len(begun.rest) :]
        redo = self.comm.membership is not None  # a round may redo it from ``begun``: keep its rest untouched

        def run(head: Outcome, background: bool) -> Outcome:
            means, sent = [], 0
            for index, fragment_deltas in zip(begun.fragments, head.deltas, strict=True):
                sending = fragment_deltas if scale == 1 else [d * scale for d in fragment_deltas]
                mean, nbytes = exchange.mean(sending, weighted, self.fragments[index].of(addresses))
                means.append(mean)
                sent += nbytes
            plain = [t.clone() for t in begun.rest] if redo else list(begun.rest)
            sent += self._plain_mean(plain, rest_addresses, contributors, contribute, background)
            residuals = None
            if self.options.sparse is not None and contribute:
                residuals = [
                    ErrorFeedback.left(x, exchange.sent(x, self.fragments[i].of(addresses)))
                    for i, x in zip(begun.fragments, head.deltas, strict=True)
                ]
            return replace(head, means=means, plain=plain, sent=sent, residuals=residuals)

        return head, run

    def _speed_weights(self, agreed: Agreement, contributors: int) -> tuple[float, float]:
        """(what this rank multiplies its Δ by, what the exchange divides the sum by): with a speed-aware round's
        speeds, the steps its group trained and Σ over the contributing groups of w_g × s_g
        (`hf_fedshard.engine.speed`); else 1 and the contributing groups' weight."""
        if agreed.speeds is None:
            return 1.0, contributors
        weights, trained = self.comm.group_weights, agreed.speeds.trained
        total = sum(w * s for g, (w, s) in enumerate(zip(weights, trained, strict=True)) if g not in agreed.diverged)
        return trained[self.comm.group], total

    def _apply(self, begun: Begun, outcome: Outcome, seconds: float, waited: float) -> None:
        """APPLY: each fragment's outer step on its mean Δ (keeping the local progress made since ``begun`` where it
        began earlier), the rest replaced by its plain means, the averaging counted, the diverged restarted."""
        self._publish(outcome.published)
        if outcome.speeds is not None:
            self.counters.round_steps = round(outcome.speeds.trained[self.comm.group])
            self.rounds.next_round(outcome.speeds, self.comm.group)
        self.counters.inter_group_bytes += outcome.sent
        payload = self._payload()
        params = payload[: self._trainable]
        kept = begun.snapshots is not None and self.comm.group not in outcome.diverged
        with torch.no_grad():
            for k, (index, deltas, mean) in enumerate(zip(begun.fragments, outcome.deltas, outcome.means, strict=True)):
                fragment = self.fragments[index]
                if self._observers:  # a speed-aware round's sent copy is made only for whoever watches
                    self._tell("exchanged", self.step_count, index, _sent(deltas, outcome, self.comm.group), mean)
                fragment.outer.step(mean, fragment.of(params), begun.snapshots[k] if kept else None)
                if outcome.residuals is not None:
                    fragment.feedback.keep(outcome.residuals[k])
                if begun.snapshots is None:  # every group now holds this fragment's global model
                    fragment.averaged_at = self.step_count
            rest = payload[self._trainable :] if begun.rest else []
            for tensor, averaged in zip(rest, outcome.plain, strict=True):
                if tensor is not averaged:
                    tensor.copy_(averaged)
        deltas = [d for fragment_deltas in outcome.deltas for d in fragment_deltas]
        means = [m for fragment_means in outcome.means for m in fragment_means]
        self._norms = Norms.of(
            deltas, means, outcome.contribute, self.comm.group, self.comm.num_groups, len(outcome.diverged)
        )
        _synchronize(params)
        self.counters.count(seconds, waited)
        if outcome.diverged:
            self._restart_diverged(outcome.diverged, params, keep=begun.fragments)

    def _in_round(self, attempt: Callable[[], _T], apply: Callable[[_T], None]) -> None:
        """``apply(attempt())``; with a `Membership`, a round of `hf_fedshard.engine.rounds`: redone over each new
        quorum until it commits, or until this group heals there."""
        membership = self.comm.membership
        if membership is None:
            apply(attempt())
            return
        assert self._in_flight() is None, "a round's quorum forms only where no exchange is in flight"
        describe = f"at step {self.step_count}" if self.comm.control.rank() == 0 else ""
        run_round(membership, membership.heal, attempt, apply, self._new_quorum, describe)

    def _new_quorum(self, formed: Round) -> None:
        """The pending norms are dropped where the quorum changed (their slots were the old quorum's)."""
        self._last_round = formed
        if formed.changed:
            self._norms = None

    def _agree(self, tensors: list[torch.Tensor]) -> list[int]:
        """The control all-reduce outside an averaging: which groups hold a NaN/Inf in ``tensors``; publishes the
        norms."""
        agreed = self._agree_values(all_finite(tensors))
        self._publish(agreed.published)
        return agreed.diverged

    def _agree_values(self, finite: bool, begun: Begun | None = None) -> Agreement:
        """The control all-reduce (`hf_fedshard.engine.control.agree`), changing nothing but the time counted in it.
        For an averaging (``begun``) that time is the wait for the slowest group (``fed_barrier_seconds_total``), and
        the step the groups must share is the one it began at (I2): a redo at its apply step meets a group that
        healed into it and begins it now."""
        self._wait_in_flight()
        step = self.step_count if begun is None else begun.start_step
        report = None if begun is None else begun.report
        begin = time.perf_counter()
        with self._explain():
            agreed = agree(self.comm, finite, self._norms, _device_of(self.model), step, report)
        if begun is not None:
            self.counters.total_barrier_seconds += time.perf_counter() - begin
        return agreed

    def _publish(self, published: tuple[float, float] | None) -> None:
        if published is not None:
            self.counters.delta_norm, self.counters.group_drift = published
            self._norms = None

    def _plain_mean(
        self,
        tensors: list[torch.Tensor],
        addresses: Sequence[Address],
        contributors: int | None = None,
        contribute: bool = True,
        background: bool = False,
    ) -> int:
        """``tensors`` ← their plain mean over the groups (no outer step; weighted by the groups' samples where
        they are of unequal size); returns the bytes sent. ``background``: on the worker thread, over its peers."""
        if not tensors:
            return 0
        contributors = contributors or sum(self.comm.group_weights)
        if background:
            if isinstance(self._exchange, PieceExchange):  # over the worker's peers: every rank
                return self._exchange.plain_mean(tensors, contributors, contribute, addresses)
            return plain_mean_over_groups(tensors, self.comm.exchange_peers, contributors, contribute)
        self._follow_groups()
        with self._explain():
            if self._pieces is not None:
                return self._pieces.plain_mean(tensors, contributors, contribute, addresses)
            return plain_mean_over_groups(tensors, self.comm.peers, contributors, contribute)

    def _contribution(self, diverged: list[int]) -> tuple[bool, int]:
        """(whether this rank's group sends its Δ, how many groups do); an averaging without any stops training."""
        if len(diverged) == self.comm.num_groups:
            raise RuntimeError(
                f"hf_fedshard: every federation group ({self.comm.num_groups}) has NaN/Inf in its model at step "
                f"{self.step_count}; training stopped. Resume from the latest checkpoint (checkpoints are skipped "
                "while a group has NaN/Inf, so it holds finite weights) with a lower learning_rate or max_grad_norm."
            )
        weights = self.comm.group_weights
        return self.comm.group not in diverged, sum(w for g, w in enumerate(weights) if g not in diverged)

    @staticmethod
    def _deltas(fragment: Fragment, tensors: list[torch.Tensor], contribute: bool) -> list[torch.Tensor]:
        """Δ = anchor − local, plus β · e with error feedback; zeros from a diverged group, whose Δ holds NaN (it
        takes the others' mean)."""
        deltas = fragment.outer.deltas(tensors)
        if not contribute:
            return [torch.zeros_like(d) for d in deltas]
        return deltas if fragment.feedback is None else fragment.feedback.add(deltas)

    def _restart_diverged(self, diverged: list[int], params: list[torch.Tensor], keep: Sequence[int]) -> None:
        """Count the diverged groups; theirs took the others' average for ``keep``, every other fragment its anchor,
        and their moments go too."""
        self.counters.diverged_groups += len(diverged)
        self.diverged_at_step = self.step_count
        mine = self.comm.group in diverged
        if mine:
            for fragment in self.fragments:
                if fragment.index not in keep:
                    fragment.outer.restart(fragment.of(params))
                if fragment.feedback is not None:  # NaN/Inf, or built from a model that diverged
                    fragment.feedback.reset()
        if mine and self.optimizer is not None and not self.options.average_optimizer_state:
            reset_optimizer_state(self.optimizer)
        if self.comm.control.rank() == 0:
            logger.warning(
                "hf_fedshard: group(s) %s had NaN/Inf at step %d: left out of the average and restarted from the "
                "other groups' average%s (fed_diverged_groups=%d).",
                diverged, self.step_count, "" if self.options.average_optimizer_state else ", optimizer state reset",
                self.counters.diverged_groups,
            )  # fmt: skip

    # ---- Helpers ----

    def _feedback(self, params: list[torch.Tensor]) -> ErrorFeedback | None:
        """A fragment's error feedback, with the sparse payload."""
        return None if self.options.sparse is None else ErrorFeedback(params, self.options.feedback_decay)

    def _residuals(self) -> list[torch.Tensor] | None:
        """Every fragment's residual, by trainable parameter (``None`` without error feedback)."""
        if self.options.sparse is None:
            return None
        return [e for f in self.fragments for e in f.feedback.state_dict()]

    def _load_residuals(self, residuals: list[torch.Tensor] | None) -> None:
        """`_residuals`' output, or e = 0 where a state has none (a heal; a checkpoint of another payload)."""
        for fragment in self.fragments:
            if fragment.feedback is None:
                continue
            if residuals is None:
                fragment.feedback.reset()
            else:
                fragment.feedback.load_state_dict(fragment.of(residuals))

    def _payload(self) -> list[torch.Tensor]:
        """This rank's local shards that an averaging sends: the model state, and the moments if asked."""
        tensors = model_state_tensors(self.model)
        if self.options.average_optimizer_state and self.optimizer is not None:
            tensors += optimizer_state_tensors(self.optimizer, self.model)
        return tensors

    def _exchanges(self, sync_dtype: str) -> tuple[Exchange | PieceExchange, PieceExchange | None]:
        """The exchange of Δ, and with groups of unequal size the plain means' (over whole tensors, fp32); a shard
        that is not FSDP2's is refused there, before any collective."""
        comm, shapes = self.comm, self._shapes
        if shapes is None:
            return Exchange(comm.exchange_peers, sync_dtype, comm.split, sparse=self.options.sparse), None
        _check_dim0_shards(self.model)
        plain = PieceExchange(comm.control, shapes, comm.group)
        for address, tensor in zip(self._addresses, model_state_tensors(self.model), strict=True):
            plain.offset(address, tensor)
        return PieceExchange(comm.exchange_peers, shapes, comm.group, sync_dtype, sparse=self.options.sparse), plain

    def _follow_groups(self) -> None:
        """Rebuild the exchanges where the groups of unequal size changed since they were built (a new quorum of
        torchft launches): pieces, owners and weights are functions of the groups."""
        shapes = self.comm.shapes
        if shapes != self._shapes:
            self._shapes = shapes
            self._exchange, self._pieces = self._exchanges(self.options.sync_dtype)

    def _payload_addresses(self) -> list[Address]:
        """The `Address` of each of `_payload`'s tensors."""
        addresses = list(self._addresses)
        if self.options.average_optimizer_state and self.optimizer is not None:
            addresses += optimizer_state_addresses(self.optimizer, self.model)
        return addresses

    def _in_flight(self) -> Fragment | None:
        """The fragment whose exchange is in flight (the schedule allows one at a time)."""
        return next((f for f in self.fragments if f.in_flight is not None), None)

    def _wait_in_flight(self) -> float:
        """Let the exchange in flight finish (not applied); returns the seconds the loop waited, counted as such."""
        fragment = self._in_flight()
        if fragment is None or not fragment.in_flight.running:
            return 0.0
        begin = time.perf_counter()
        with self._explain(fragment.in_flight.begun.start_step):
            fragment.in_flight.result()
        waited = time.perf_counter() - begin
        fragment.in_flight.blocked_s += waited
        self.counters.total_wait_seconds += waited
        return waited

    def _identical(self) -> bool:
        """Whether every group holds the same model now (every fragment averaged at this step, none in flight)."""
        return all(f.in_flight is None and f.averaged_at >= self.step_count for f in self.fragments)

    def _evaluate_groups(self) -> None:
        """Each group's own evaluation (``before_eval``), once per step, while the groups still differ."""
        if self.before_eval is not None and self._groups_evaluated_at != self.step_count:
            self._groups_evaluated_at = self.step_count
            self.before_eval()

    def _explain(self, step: int | None = None) -> contextlib.AbstractContextManager[None]:
        return explain_failures(self.step_count if step is None else step, self.comm.timeout)

    def _average_initial_weights(self) -> None:
        """Step 0's plain average, so that groups initialised differently start from one global model."""
        start = time.perf_counter()
        tensors = model_state_tensors(self.model)

        def attempt() -> list[torch.Tensor]:
            means = tensors if self.comm.membership is None else [t.clone() for t in tensors]
            self.counters.inter_group_bytes += self._plain_mean(means, self._addresses)
            return means

        def apply(means: list[torch.Tensor]) -> None:
            with torch.no_grad():
                for tensor, mean in zip(tensors, means, strict=True):
                    if tensor is not mean:
                        tensor.copy_(mean)
            params = tensors[: self._trainable]
            for fragment in self.fragments:  # the anchors were the group's own initial weights until now
                fragment.outer.move_anchor(fragment.of(params))
            self.counters.count(time.perf_counter() - start, 0.0)

        self._in_round(attempt, apply)

    def _refuse_outside_rounds(self, what: str) -> None:
        """With a `Membership` every cross-group collective belongs to an averaging's round: refuse the others."""
        if self.comm.membership is None:
            return
        when = (
            "evaluate after training: with fragments or overlap no step before the last holds one global model"
            if self.schedule.streaming
            else "set eval_steps/save_steps to multiples of fed_sync_steps (and keep load_best_model_at_end off)"
        )
        raise ConfigError(
            f"hf_fedshard: at step {self.step_count} {what} between two averagings, which needs the groups outside "
            f"an averaging; with fed_transport torchft that happens only at averaging steps: {when}."
        )

    def _describe(self, trainable: list[nn.Parameter], device: torch.device) -> None:
        """Say once, on rank 0, how the model is averaged and the outer state's memory per rank."""
        sizes = " / ".join(f"{sum(p.numel() for p in trainable[f.start : f.stop]) / 1e6:.2f}" for f in self.fragments)
        timing = f"each behind {self.schedule.overlap} step(s)" if self.schedule.overlap else "blocking"
        if self.rounds is not None:
            timing += (
                f", speed-aware rounds (each group trains {self.rounds.min_steps}–{self.schedule.sync_steps} of the "
                f"{self.schedule.sync_steps} steps of a round, by its speed)"
            )
        codec, sparse = self.options.sparse, ""
        if codec is not None:
            residual = sum(e.numel() * e.element_size() for f in self.fragments for e in f.feedback.residual) / 1e6
            sparse = (f"; topk sends {codec.density:g} of each {codec.chunk}-value chunk in {codec.bits} bits, "
                      f"error feedback β = {self.options.feedback_decay:g} ({residual:.1f} MB per rank on the "
                      "shards' device)")  # fmt: skip
        notice(
            "averaging with %s: %d fragment(s) of whole FSDP units (%s M parameters), %s; outer state (anchor%s) "
            "%.1f MB per rank on %s%s",
            self.settings.describe(), len(self.fragments), sizes, timing,
            ", momentum" if self.settings.outer_momentum else "",
            sum(f.outer.nbytes for f in self.fragments) / 1e6, device, sparse,
        )  # fmt: skip


def _check_model_and_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh: DeviceMesh | None
) -> list[nn.Parameter]:
    """The trainable parameters, once the model and optimizer are known to fit together (before any collective)."""
    trainable = trainable_parameters(model)
    if not trainable:
        raise ConfigError(
            f"{type(model).__name__} has no parameter with requires_grad=True: nothing to train or average. "
            "Unfreeze some parameters (or attach a PEFT adapter) first."
        )
    if optimizer is not None:
        ours = {id(p) for p in trainable}
        theirs = [p for group in getattr(optimizer, "optimizer", optimizer).param_groups for p in group["params"]]
        if not theirs or any(id(p) not in ours for p in theirs):
            raise ConfigError(
                "FederatedAverager: the optimizer is not over the model's trainable parameters. Build the optimizer "
                "after sharding the model (fully_shard replaces the parameters), from model.parameters()."
            )
    if mesh is not None:
        _check_sharded_on(trainable, mesh)
    return trainable


def _check_sharded_on(params: list[nn.Parameter], mesh: DeviceMesh) -> None:
    """Every trainable parameter is sharded over this rank's group (``mesh["dp_replicate", "dp_shard"]``)."""
    group_mesh = mesh["dp_replicate", "dp_shard"]
    group_ranks = sorted(group_mesh.mesh.flatten().tolist())
    for param in params:
        ranks = sorted(param.device_mesh.mesh.flatten().tolist()) if isinstance(param, DTensor) else None
        if ranks is None and len(group_ranks) == 1:
            continue  # one rank per group: a plain module is its own shard
        if ranks != group_ranks:
            where = "not sharded" if ranks is None else f"sharded over ranks {ranks}"
            raise ConfigError(
                f"FederatedAverager: the model is {where}, but this rank's federation group is ranks {group_ranks}. "
                'Shard it with fully_shard(module, mesh=mesh["dp_replicate", "dp_shard"]) before building the '
                "averager."
            )


def _check_dim0_shards(model: nn.Module) -> None:
    """Groups of unequal size address a shard by its rows: every trainable DTensor must be sharded on dim 0 (FSDP2's
    default) or replicated. The placements are the same on every rank, so every rank refuses alike."""
    for name, param in model.named_parameters():
        placements = param.placements if isinstance(param, DTensor) and param.requires_grad else ()
        if any(not (p.is_replicate() or (p.is_shard() and p.dim == 0)) for p in placements):
            raise ConfigError(
                f"fed_group_size lists groups of unequal size, which address each shard by its rows, but {name} is "
                f"placed {placements}. Shard with fully_shard's default placement (no shard_placement_fn), or give "
                "every group the same size."
            )


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _sent(deltas: list[torch.Tensor], result: Outcome, group: int) -> list[torch.Tensor]:
    """What this rank sent of ``deltas`` in ``result``'s exchange: Δ, times its group's trained steps in a speed-aware
    round (`FederatedAverager._speed_weights`)."""
    return deltas if result.speeds is None else [d * result.speeds.trained[group] for d in deltas]


def _synchronize(tensors: list[torch.Tensor]) -> None:
    """Wait for the device, so that the time counted is the averaging's, not the next step's."""
    if tensors and tensors[0].is_cuda:
        torch.cuda.synchronize()

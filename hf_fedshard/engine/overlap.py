"""An averaging's three values, whichever way it runs: what it read of this rank when it began (`Begun`), what its
collectives returned (`Outcome`), and an attempt still running on the worker thread (`InFlight`).

A blocking averaging begins, attempts and applies at one step; an overlapped one (``fed_sync_overlap`` τ > 0)
begins at step s, runs its exchange on the worker thread while training goes on, and applies at s + τ. Both are the
same attempt → commit → apply (`hf_fedshard.engine.rounds`): "overlap" is only a later apply.

The worker runs over process groups of its own (the transport's ``exchange`` peers), so the main thread's
collectives never share a group with it; on CUDA it runs on its own stream after Δ was computed on the main one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields

import torch

from hf_fedshard.engine.speed import RoundReport, RoundSpeeds


@dataclass(frozen=True)
class Begun:
    """What every attempt of one averaging reads of this rank, taken at the step it began, so that an attempt redone
    over a new quorum (or after a resume) sends what the first one sent, whatever the model did since.

    ``snapshots``: per fragment, fp32 copies of its local shards, for an apply τ > 0 steps later (``None``: τ = 0,
    the live shards, unchanged until the apply). ``rest``: the rest of the payload (floating buffers, the moments if
    asked) when the last fragment is in: copies for a later apply, else the live tensors. ``finite``: whether this
    rank's payload held no NaN/Inf; ``report``: a speed-aware round's report.
    """

    fragments: tuple[int, ...]
    start_step: int
    apply_step: int
    snapshots: tuple[tuple[torch.Tensor, ...], ...] | None
    rest: tuple[torch.Tensor, ...]
    finite: bool
    report: RoundReport | None = None

    def sources(self, k: int, live: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The shards the ``k``-th fragment's Δ is taken from: its snapshots, or the ``live`` ones."""
        return live if self.snapshots is None else self.snapshots[k]

    def state_dict(self) -> dict:
        report = None if self.report is None else [self.report.trained, self.report.seconds_per_step]
        return {
            "fragments": list(self.fragments), "start_step": self.start_step, "apply_step": self.apply_step,
            "snapshots": None if self.snapshots is None else [list(s) for s in self.snapshots],
            "rest": list(self.rest), "finite": self.finite, "report": report,
        }  # fmt: skip

    @classmethod
    def from_state_dict(cls, state: dict) -> Begun:
        snapshots = state["snapshots"]
        return cls(
            tuple(state["fragments"]), int(state["start_step"]), int(state["apply_step"]),
            None if snapshots is None else tuple(tuple(s) for s in snapshots), tuple(state["rest"]),
            bool(state["finite"]), None if state["report"] is None else RoundReport(*state["report"]),
        )  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    """What one attempt's collectives returned, before anything is applied: the agreement (``diverged``, the last
    averaging's ``published`` norms, a speed-aware round's ``speeds``), this rank's Δ per fragment as taken, and once
    exchanged the mean Δ per fragment, the rest's plain means, the bytes this rank sent and (``topk``) what this
    rank's error feedback keeps. With error feedback ``deltas`` are what was compressed, Δ + β · e."""

    diverged: list[int]
    published: tuple[float, float] | None
    speeds: RoundSpeeds | None
    contribute: bool
    contributors: int
    deltas: list[list[torch.Tensor]]
    means: list[list[torch.Tensor]] | None = None
    plain: list[torch.Tensor] | None = None
    sent: int = 0
    residuals: list[list[torch.Tensor]] | None = None  # the sparse payload's e' per fragment, to keep at the apply

    def state_dict(self) -> dict:
        speeds = None if self.speeds is None else [self.speeds.trained, self.speeds.seconds_per_step]
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "speeds": speeds}

    @classmethod
    def from_state_dict(cls, state: dict) -> Outcome:
        speeds = None if state["speeds"] is None else RoundSpeeds(*state["speeds"])
        return cls(**{**state, "speeds": speeds})


@dataclass
class InFlight:
    """An averaging begun (``begun``) whose exchange is running on the worker thread (``future``), or has run
    (``outcome``), or is to be attempted again at its apply (neither: a checkpoint of a federation whose rounds
    commit, which saves no result its quorum did not commit). ``blocked_s``: the loop's time its begin took."""

    begun: Begun
    blocked_s: float
    future: Future | None = None
    outcome: Outcome | None = None

    @property
    def running(self) -> bool:
        return self.future is not None

    def result(self) -> Outcome | None:
        """The attempt's outcome, once the worker finished it (``None``: attempt it again)."""
        if self.future is not None:
            self.outcome, self.future = self.future.result(), None
        return self.outcome

    def state_dict(self, with_outcome: bool) -> dict:
        outcome = self.result()
        kept = None if outcome is None or not with_outcome else outcome.state_dict()
        return {"begun": self.begun.state_dict(), "blocked_s": self.blocked_s, "outcome": kept}

    @classmethod
    def from_state_dict(cls, state: dict) -> InFlight:
        outcome = None if state["outcome"] is None else Outcome.from_state_dict(state["outcome"])
        return cls(Begun.from_state_dict(state["begun"]), float(state["blocked_s"]), outcome=outcome)


class Worker:
    """One thread that runs exchanges in the background (created on first use)."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, exchange: Callable[[], Outcome], inputs: Sequence[torch.Tensor]) -> Future:
        """Run ``exchange`` on the worker; on CUDA after the main stream computed ``inputs``."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_fedshard-exchange")
        return self._executor.submit(_in_background, exchange, inputs[0] if inputs else None, _ready_event(inputs))

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None


def _in_background(
    exchange: Callable[[], Outcome], probe: torch.Tensor | None, ready: torch.cuda.Event | None
) -> Outcome:
    """The exchange, on the worker thread (on CUDA: its own stream, after Δ was computed on the main one)."""
    if ready is None:
        return exchange()
    torch.cuda.set_device(probe.device)  # a new thread starts on device 0
    stream = torch.cuda.Stream(device=probe.device)
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        result = exchange()
    stream.synchronize()
    return result


def _ready_event(tensors: Sequence[torch.Tensor]) -> torch.cuda.Event | None:
    """On CUDA, an event after ``tensors`` were computed on the current stream, for the worker's stream to wait on."""
    if not tensors or not tensors[0].is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event

"""The overlapped exchange: one fragment's mean Δ computed on a worker thread while training goes on.

The worker runs over process groups of its own (the transport's ``exchange`` peers), so the main thread's
collectives never share a group with it; on CUDA it runs on its own stream after Δ was computed on the main one.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

Mean = Callable[[list[torch.Tensor], int], tuple[list[torch.Tensor], int]]


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


class Worker:
    """One thread that computes means of Δ in the background (created on first use)."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, mean: Mean, deltas: list[torch.Tensor], contributors: int) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_fedshard-exchange")
        return self._executor.submit(_in_background, mean, deltas, contributors, _ready_event(deltas))

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None


def _in_background(
    mean: Mean, deltas: list[torch.Tensor], contributors: int, ready: torch.cuda.Event | None
) -> tuple[list[torch.Tensor], int]:
    """The mean Δ, on the worker thread (on CUDA: its own stream, after Δ was computed on the main one)."""
    if ready is None:
        return mean(deltas, contributors)
    torch.cuda.set_device(deltas[0].device)  # a new thread starts on device 0
    stream = torch.cuda.Stream(device=deltas[0].device)
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        result = mean(deltas, contributors)
    stream.synchronize()
    return result


def _ready_event(tensors: list[torch.Tensor]) -> torch.cuda.Event | None:
    """On CUDA, an event after ``tensors`` were computed on the current stream, for the worker's stream to wait on."""
    if not tensors or not tensors[0].is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event

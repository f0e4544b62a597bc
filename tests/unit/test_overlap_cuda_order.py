"""The overlapped exchange's CUDA ordering (`engine/overlap.py`), on CPU with a fake ``torch.cuda``: the main thread
records an event after Δ was computed and submits; the worker thread selects the tensors' device, makes its own
stream, waits on that event, runs the exchange inside the stream, and synchronizes the stream before its result is
returned. Out of that order the exchange would read Δ before the main stream wrote it, or the apply would read the
mean before the worker's stream wrote it; the GPU check (`tests/gpu_check.py`) runs the real streams."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from hf_fedshard.engine import overlap


class FakeCuda:
    """Records each call with its thread; an Event, a Stream and the stream context as plain objects."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def _say(self, what: str) -> None:
        self.calls.append((threading.current_thread().name.split("_")[0], what))

    def Event(self):
        cuda = self

        class Event:
            def record(self) -> None:
                cuda._say("event.record")

        return Event()

    def Stream(self, device):
        cuda = self
        self._say(f"Stream({device})")

        class Stream:
            def wait_event(self, event) -> None:
                cuda._say("stream.wait_event")

            def synchronize(self) -> None:
                cuda._say("stream.synchronize")

        return Stream()

    def set_device(self, device) -> None:
        self._say(f"set_device({device})")

    def stream(self, stream):
        cuda = self

        class Context:
            def __enter__(self):
                cuda._say("enter stream")

            def __exit__(self, *exc):
                cuda._say("exit stream")

        return Context()


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    cuda = FakeCuda()
    names = {name: getattr(cuda, name) for name in ("Event", "Stream", "set_device", "stream")}
    monkeypatch.setattr(overlap.torch, "cuda", SimpleNamespace(**names))
    return cuda


def test_the_worker_waits_on_the_main_streams_event_and_synchronizes_before_returning(fake_cuda):
    delta = SimpleNamespace(is_cuda=True, device="cuda:1")  # a CUDA tensor as far as the worker asks

    def exchange() -> str:
        fake_cuda._say("exchange")
        return "mean"

    worker = overlap.Worker()
    try:
        assert worker.submit(exchange, [delta]).result(timeout=30) == "mean"
    finally:
        worker.shutdown()
    main = threading.current_thread().name.split("_")[0]
    assert fake_cuda.calls == [
        (main, "event.record"),
        ("hf", "set_device(cuda:1)"),  # the worker thread is "hf_fedshard-exchange"
        ("hf", "Stream(cuda:1)"),
        ("hf", "stream.wait_event"),
        ("hf", "enter stream"),
        ("hf", "exchange"),
        ("hf", "exit stream"),
        ("hf", "stream.synchronize"),
    ]


def test_on_cpu_no_event_and_no_stream(fake_cuda):
    worker = overlap.Worker()
    try:
        assert worker.submit(lambda: "mean", [SimpleNamespace(is_cuda=False)]).result(timeout=30) == "mean"
    finally:
        worker.shutdown()
    assert fake_cuda.calls == []

"""Where a checkpoint's stall of the training loop goes, part by part.

A save stops training from Trainer's call until it returns: waiting for the previous background write, the NaN/Inf
check, the host copies, the state dicts and small files, the writes and barriers of a synchronous save. Each part is
timed where it runs (`SaveStall.part`), so that a slow save says which part to cut;
``FedShardTrainer.fed_checkpoint_stalls`` keeps one per save, and the writer logs it at INFO.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class SaveStall:
    """The seconds one save (at ``step``) kept the training loop, by part; a part's own seconds exclude those of the
    parts timed inside it."""

    step: int
    parts: dict[str, float] = field(default_factory=dict)
    _nested: float = field(default=0.0, repr=False)  # seconds of the parts inside the one being timed

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        outer, self._nested = self._nested, 0.0
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.parts[name] = self.parts.get(name, 0.0) + elapsed - self._nested
            self._nested = outer + elapsed

    @property
    def total_s(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        """One line: the total, then each part."""
        parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.parts.items())
        return f"checkpoint-{self.step} stalled training {self.total_s:.2f} s: {parts}"

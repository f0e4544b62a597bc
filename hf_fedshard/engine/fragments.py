"""Streaming averaging: the trainable state cut into F fragments, each exchanged on its own step, τ steps late.

Streaming DiLoCo's schedule, on FSDP units: fragment f (f = 0 … F−1) holds whole, contiguous FSDP units
(balanced by bytes; a unit is never split) and starts its exchange at the end of the steps s ≥ 1 with
s ≡ (f + 1)·H/F (mod H), so fragment F−1 is the one averaged on H's multiples. With overlap τ > 0 the exchange
runs while training goes on and is applied at the end of step s + τ; τ < H/F keeps at most one exchange in flight.
F = 1, τ = 0 is the blocking averaging of every H-th step.

The apply rule (this package's choice; see `OuterOptimizer.step`): the fragment's new local state is the new
anchor plus the τ steps of local progress made while the exchange ran, ``anchor' + (local_now − snapshot)``.
torchft's streaming DiLoCo discards that progress by default (``local = anchor'``); keeping it wastes no compute,
and the next Δ, taken against ``anchor'``, carries it into the next average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hf_fedshard.engine.feedback import ErrorFeedback
from hf_fedshard.engine.outer import OuterOptimizer
from hf_fedshard.engine.overlap import InFlight
from hf_fedshard.errors import ConfigError

START, APPLY, SYNC = "start", "apply", "sync"  # SYNC: start and apply on the same step (τ = 0)


@dataclass(frozen=True)
class Schedule:
    """When each fragment starts and applies its exchange: a function of the step only, equal on every rank."""

    sync_steps: int
    fragments: int = 1
    overlap: int = 0

    def validate(self) -> None:
        """One-line errors naming the setting, before any collective."""
        h, f, tau = self.sync_steps, self.fragments, self.overlap
        if f < 1 or h % f:
            raise ConfigError(
                f"fed_sync_fragments={f} must be at least 1 and divide fed_sync_steps={h}: each fragment averages "
                f"every H steps, H/F apart. Pick --fed_sync_fragments among the divisors of {h}."
            )
        if not 0 <= tau < h // f:
            raise ConfigError(
                f"fed_sync_overlap={tau} must be in [0, fed_sync_steps / fed_sync_fragments = {h // f}): one exchange "
                "is applied before the next fragment's starts. Lower --fed_sync_overlap or --fed_sync_fragments."
            )

    @property
    def streaming(self) -> bool:
        """Whether this is anything but the blocking averaging of the whole model."""
        return self.fragments > 1 or self.overlap > 0

    def starting(self, step: int) -> int | None:
        """The fragment whose exchange starts at the end of ``step``, if any (at most one)."""
        period = self.sync_steps // self.fragments
        if step < 1 or step % period:
            return None
        return (step // period - 1) % self.fragments

    def applying(self, step: int) -> int | None:
        """The fragment whose exchange is applied at the end of ``step``, if any."""
        return self.starting(step - self.overlap)

    def phases(self, step: int) -> dict[int, str]:
        """{fragment: phase} at the end of ``step``: ``sync`` when τ = 0, else ``start`` and ``apply``."""
        start, apply = self.starting(step), self.applying(step)
        if self.overlap == 0:
            return {} if start is None else {start: SYNC}
        return {f: p for f, p in ((apply, APPLY), (start, START)) if f is not None}

    def table(self, steps: int) -> str:
        """Step × fragment × phase, one line per step: the golden table the tests pin and the docs show."""
        header = "step | " + " | ".join(f"f{f}" for f in range(self.fragments))
        rows = [header]
        for step in range(1, steps + 1):
            phases = self.phases(step)
            rows.append(f"{step:>4} | " + " | ".join(phases.get(f, "-") for f in range(self.fragments)))
        return "\n".join(rows)


def unit_sizes(model: nn.Module, params: list[nn.Parameter]) -> list[int]:
    """How many of ``params`` (in order) each FSDP unit owns, units in the order of their first parameter.

    A parameter belongs to its closest FSDP-wrapped ancestor; without FSDP every parameter is a unit of its own.
    Fragments are contiguous in parameter order, so a unit whose parameters are not (the root unit: embeddings
    first, final norm and head last) counts as one unit per contiguous run.
    """
    owner: dict[int, int] = {}

    def visit(module: nn.Module, unit: int) -> None:
        if isinstance(module, FSDPModule):
            unit = id(module)
        for param in module.parameters(recurse=False):
            owner[id(param)] = unit
        for child in module.children():
            visit(child, unit)

    visit(model, -1)
    units: list[int] = []
    sizes: list[int] = []
    for param in params:
        unit = owner.get(id(param), -1)
        unit = id(param) if unit == -1 else unit
        if units and units[-1] == unit:
            sizes[-1] += 1
        else:
            units.append(unit)
            sizes.append(1)
    return sizes


def partition(unit_bytes: list[int], parts: int) -> list[int]:
    """Split consecutive units into ``parts`` non-empty runs balanced by bytes; returns the units per run.

    Greedy on the running total: run k ends at the first unit whose cumulative size reaches k/parts of the
    whole, while leaving at least one unit for each later run.
    """
    if parts > len(unit_bytes):
        raise ConfigError(
            f"fed_sync_fragments={parts} exceeds the model's {len(unit_bytes)} FSDP units: a unit is never split. "
            f"Set --fed_sync_fragments to at most {len(unit_bytes)}."
        )
    total, counts, start, running = sum(unit_bytes), [], 0, 0
    for i, size in enumerate(unit_bytes):
        running += size
        k = len(counts) + 1
        left_units, left_runs = len(unit_bytes) - i - 1, parts - k
        if k < parts and (running * parts >= k * total or left_units == left_runs):
            counts.append(i + 1 - start)
            start = i + 1
    counts.append(len(unit_bytes) - start)
    return counts


def fragment_ranges(model: nn.Module, params: list[nn.Parameter], parts: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of ``params`` for each of ``parts`` fragments of whole FSDP units."""
    sizes = unit_sizes(model, params)
    bounds, index = [], 0
    for size in sizes:
        bounds.append((index, index + size))
        index += size
    unit_bytes = [sum(params[i].numel() * params[i].element_size() for i in range(a, b)) for a, b in bounds]
    ranges, first = [], 0
    for count in partition(unit_bytes, parts):
        ranges.append((bounds[first][0], bounds[first + count - 1][1]))
        first += count
    return ranges


@dataclass
class Fragment:
    """One fragment of the trainable state: its parameters, anchor and outer optimizer, and its exchange in flight.

    ``start``/``stop`` index the trainable parameters (whole FSDP units); ``averaged_at`` is the last step at which
    every group held the same values of it (a blocking averaging); ``in_flight`` its overlapped exchange, if any.
    """

    index: int
    start: int
    stop: int
    outer: OuterOptimizer
    averaged_at: int = 0
    in_flight: InFlight | None = None
    feedback: ErrorFeedback | None = None  # the sparse payload's residual (`hf_fedshard.engine.feedback`)

    def of(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """This fragment's share of the trainable shards ``params``."""
        return params[self.start : self.stop]

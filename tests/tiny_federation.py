"""The tests' shared in-process federation: a tiny model that "trains" deterministically per group, an engine run
of `GROUPS` groups over fake communicators, and `Reference`, the averaging rule written on full tensors from the
docs (not from the engine). Used by the engine's tests and by every in-process test that needs a federation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hf_fedshard import FederatedAverager
from hf_fedshard.engine.fragments import Schedule
from hf_fedshard.engine.pieces import PieceExchange

from .asserts import labelled
from .fake_communicator import run_federation

GROUPS = 3
RANGES = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 4: [(0, 1), (1, 2), (2, 3), (3, 4)]}  # by bytes: 48, 16, 32, 8


class Tiny(nn.Module):
    """Four parameters (four units without FSDP) and one floating buffer, which "training" moves too."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 2)
        self.register_buffer("stat", torch.full((2,), float(seed)))
        generator = torch.Generator().manual_seed(seed)  # not the global RNG: the groups are threads
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)


def build(group: int) -> tuple[Tiny, torch.optim.Optimizer]:
    model = Tiny(seed=group)  # the groups start apart: step 0's plain mean makes them one
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)


@torch.no_grad()
def train_step(model: Tiny, optimizer: torch.optim.Optimizer, group: int, step: int) -> None:
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.01 * (group + 1) * (1 + (step + i) % 3)) + 0.05 * p
    optimizer.step()
    optimizer.zero_grad()
    model.stat.add_(0.1 * (group + 1))


def poison(model: Tiny) -> None:
    with torch.no_grad():
        model.first.weight.view(-1)[0] = math.nan


def engine_run(
    steps: int, nan_at: tuple[int, int] | None = None, finish_apart: bool = False, pieces: bool = False, **options
) -> list:
    """Every group's parameters and buffer after ``steps`` steps and the end, its averager, its optimizer."""
    options = {"sync_steps": 4, **options}

    def rank_fn(comm):
        group = comm.group
        model, optimizer = build(group)
        averager = FederatedAverager(model, optimizer, communicator=comm, **options)
        for step in range(1, steps + 1):
            train_step(model, optimizer, group, step)
            if nan_at == (group, step):
                poison(model)
            averager.step(last=step == steps and not finish_apart)
        if finish_apart:
            averager.finish()
        return [t.detach().clone() for t in (*model.parameters(), model.stat)], averager, optimizer, comm

    return run_federation(GROUPS, rank_fn, pieces=pieces)


class Reference:
    """The averaging rule on full tensors, group by group, written from the docs (not from the engine)."""

    def __init__(self, sync_steps=4, fragments=1, overlap=0, lr=1.0, momentum=0.0, moments=False) -> None:
        self.schedule = Schedule(sync_steps, fragments, overlap)
        self.moments = moments  # the optimizer's momentum buffers are averaged with the buffer
        self.ranges, self.lr, self.momentum = RANGES[fragments], lr, momentum
        self.models, self.optimizers = zip(*(build(g) for g in range(GROUPS)), strict=True)
        self.averaged_at = [0] * fragments
        self.flight: tuple | None = None  # (fragment, apply step, snapshots, means, diverged, buffers' mean)
        self.delta_norm = self.drift = 0.0
        with torch.no_grad():
            for tensors in zip(*(self.state(g) for g in range(GROUPS)), strict=True):
                mean = sum(t.float() for t in tensors) / GROUPS
                for t in tensors:
                    t.copy_(mean)
        self.anchor = [p.detach().float().clone() for p in self.params(0)]
        self.buffer: list[torch.Tensor | None] = [None] * 4

    def params(self, g: int) -> list[torch.Tensor]:
        return list(self.models[g].parameters())

    def state(self, g: int) -> list[torch.Tensor]:
        return [*self.params(g), self.models[g].stat]

    def rest(self, g: int) -> list[torch.Tensor]:
        """What the last fragment carries besides parameters: the buffer, and the momentum buffers if asked."""
        momenta = [self.optimizers[g].state[p]["momentum_buffer"] for p in self.params(g)] if self.moments else []
        return [self.models[g].stat, *momenta]

    def rest_means(self, diverged: list[int], contributors: int) -> list[torch.Tensor]:
        rests = [[torch.zeros_like(t) if g in diverged else t for t in self.rest(g)] for g in range(GROUPS)]
        return [(a + b + c) / contributors for a, b, c in zip(*rests, strict=True)]

    def adopt(self, means: list[torch.Tensor]) -> None:
        for g in range(GROUPS):
            for tensor, mean in zip(self.rest(g), means, strict=True):
                tensor.copy_(mean)

    def run(
        self, steps: int, nan_at: tuple[int, int] | None = None, heal_at: tuple[int, int] | None = None
    ) -> list[list[torch.Tensor]]:
        """``heal_at`` (group, step): that group lost the round applied at that step, which the others committed,
        and took group 0's committed state there: every parameter its anchor, the buffer group 0's."""
        for step in range(1, steps + 1):
            for g in range(GROUPS):
                train_step(self.models[g], self.optimizers[g], g, step)
                if nan_at == (g, step):
                    poison(self.models[g])
            if self.flight is not None and self.flight[1] == step:
                self.apply()
            fragment = self.schedule.starting(step)
            if step == steps:
                if self.flight is not None:
                    self.apply()
                self.average([f for f in range(len(self.ranges)) if self.averaged_at[f] < step], step)
            elif fragment is not None and self.schedule.overlap == 0:
                self.average([fragment], step)
            elif fragment is not None:
                self.start(fragment, step)
            if heal_at is not None and heal_at[1] == step:
                self.heal(heal_at[0])
        return [[t.detach().clone() for t in self.state(g)] for g in range(GROUPS)]

    def diverged(self) -> list[int]:
        return [g for g in range(GROUPS) if not all(torch.isfinite(t).all() for t in self.state(g))]

    @torch.no_grad()
    def deltas(self, g: int, i: int, local: torch.Tensor, diverged: list[int]) -> torch.Tensor:
        return torch.zeros_like(self.anchor[i]) if g in diverged else self.anchor[i] - local.float()

    @torch.no_grad()
    def outer_step(self, i: int, mean: torch.Tensor) -> None:
        """torch.optim.SGD's single-tensor step (Nesterov when momentum > 0) on the anchor, gradient mean Δ."""
        grad = mean
        if self.momentum:
            if self.buffer[i] is None:
                self.buffer[i] = grad.clone()
            else:
                self.buffer[i].mul_(self.momentum).add_(grad)
            grad = grad.add(self.buffer[i], alpha=self.momentum)
        self.anchor[i].add_(grad, alpha=-self.lr)

    @torch.no_grad()
    def average(self, fragments: list[int], step: int) -> None:
        if not fragments:
            return
        diverged = self.diverged()
        contributors = GROUPS - len(diverged)
        squares = [0.0] * (GROUPS + 1)
        for f in fragments:
            for i in range(*self.ranges[f]):
                deltas = [self.deltas(g, i, self.params(g)[i], diverged) for g in range(GROUPS)]
                mean = (deltas[0] + deltas[1] + deltas[2]) / contributors
                self.note_norms(squares, deltas, mean, diverged)
                self.outer_step(i, mean)
                for g in range(GROUPS):
                    self.params(g)[i].copy_(self.anchor[i])
            self.averaged_at[f] = step
        if len(self.ranges) - 1 in fragments:
            self.adopt(self.rest_means(diverged, contributors))
        self.publish(squares, contributors)
        self.restart(diverged, keep=fragments)

    @torch.no_grad()
    def start(self, fragment: int, step: int) -> None:
        diverged = self.diverged()
        contributors = GROUPS - len(diverged)
        snapshots = [[self.params(g)[i].float().clone() for i in range(*self.ranges[fragment])] for g in range(GROUPS)]
        means = []
        for k, i in enumerate(range(*self.ranges[fragment])):
            deltas = [self.deltas(g, i, snapshots[g][k], diverged) for g in range(GROUPS)]
            means.append((deltas[0] + deltas[1] + deltas[2]) / contributors)
        rest = None  # the buffers' mean, of their values now, replaces them at the apply (an EMA keeps no progress)
        if fragment == len(self.ranges) - 1:
            rest = self.rest_means(diverged, contributors)
        self.flight = (fragment, step + self.schedule.overlap, snapshots, means, diverged, rest)

    @torch.no_grad()
    def apply(self) -> None:
        fragment, _, snapshots, means, diverged, rest = self.flight
        self.flight = None
        if rest is not None:
            self.adopt(rest)
        for k, i in enumerate(range(*self.ranges[fragment])):
            self.outer_step(i, means[k])
            for g in range(GROUPS):
                local = self.params(g)[i]
                kept = self.anchor[i] if g in diverged else self.anchor[i] + (local.float() - snapshots[g][k])
                local.copy_(kept)
        self.restart(diverged, keep=[fragment])

    @torch.no_grad()
    def heal(self, g: int) -> None:
        for param, anchor in zip(self.params(g), self.anchor, strict=True):
            param.copy_(anchor)
        self.models[g].stat.copy_(self.models[0].stat)

    @torch.no_grad()
    def restart(self, diverged: list[int], keep: list[int]) -> None:
        for g in diverged:
            for f, (a, b) in enumerate(self.ranges):
                if f not in keep:
                    for i in range(a, b):
                        self.params(g)[i].copy_(self.anchor[i])
            for state in self.optimizers[g].state.values() if not self.moments else ():
                state["momentum_buffer"].zero_()

    def note_norms(self, squares, deltas, mean, diverged) -> None:
        for g in range(GROUPS):
            if g not in diverged:
                squares[g] += (deltas[g] - mean).double().square().sum().item()
        squares[-1] += GROUPS * mean.double().square().sum().item()

    def publish(self, squares, contributors) -> None:
        self.delta_norm = math.sqrt(squares[-1] / GROUPS)
        self.drift = sum(math.sqrt(s) for s in squares[:-1]) / contributors / self.delta_norm


def reference_for(options: dict) -> Reference:
    lr, momentum = (0.7, 0.9) if options.get("outer_optimizer") == "nesterov" else (1.0, 0.0)
    return Reference(
        options.get("sync_steps", 4),
        options.get("sync_fragments", 1),
        options.get("sync_overlap", 0),
        lr,
        momentum,
        options.get("average_optimizer_state", False),
    )


def assert_exchanged_by(results: list, pieces: bool) -> None:
    """Every group's Δ went through `PieceExchange` (``pieces``: groups described as groups of unequal size are) or
    through the equal groups' `Exchange`, and the exchange communicator carried it."""
    for g, (_, averager, _, comm) in enumerate(results):
        assert isinstance(averager.exchange, PieceExchange) == pieces, f"group {g}: {type(averager.exchange).__name__}"
        assert comm.exchange.calls > 0, f"group {g}: no exchange collective"


def assert_groups_equal_reference(results: list, expected: list[list[torch.Tensor]]) -> None:
    for g, (state, *_) in enumerate(results):
        for i, (got, want) in enumerate(zip(state, expected[g], strict=True)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=labelled(f"group {g}, tensor {i}"))

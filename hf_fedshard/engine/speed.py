"""Speed-aware rounds (``fed_round_policy speed``): each group trains as many of a round's steps as its speed allows,
so that the groups reach the averaging together and a slow group no longer sets everyone's pace.

A round stays H = ``fed_sync_steps`` steps of the federation, averaged at the same steps as ever: the schedule,
``max_steps``, the learning-rate schedule, evaluations, checkpoints and the data position all count them, so a
resume and a heal mean what they mean under ``steps``. Group g *trains* the first H_g steps of each round and
passes over the rest: it reads their batches (its data position stays the federation's; a slow group leaves
those batches untrained) but runs no forward, backward or optimizer step there (the Trainer's LR scheduler still
steps). After each round, from τ_g, the median duration of the group's trained steps in that round and the one before
(a median over two rounds: an evaluation or a checkpoint inside a round, or one noisy round, does not move it)::

    H_g' = clamp(⌊H · τ_min / τ_g + ½⌋, fed_min_round_steps, H)      τ_min: the fastest group's τ

so the fastest group trains all H steps and a group half as fast H/2. A group with no measurement (the first round,
a round a resume left no trained step in, a group that has just joined) trains all H.

The mean of the pseudo-gradients is weighted by the samples each group trained in the round, over the groups that
contributed (`hf_fedshard.engine.control`'s divergence flags)::

    mean Δ = Σ_g w_g s_g Δ_g / Σ_g w_g s_g       s_g: the steps group g trained, w_g: its samples per step (its ranks
                                                 with groups of unequal size, 1 with equal ones)

each rank sending s_g Δ_g (so the wire dtype encodes the scaled Δ). Every rank of a group must train the same
steps (their FSDP collectives pair up) and every rank must divide by the same Σ: both come from values agreed in
the round's control all-reduce, where each rank adds its group's s_g and its own τ (`RoundReport`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ROUND_POLICIES = ("steps", "speed")


@dataclass(frozen=True)
class RoundReport:
    """What a rank adds to the round's control all-reduce: its group's trained steps, its median step's seconds
    (0: not measured)."""

    trained: int
    seconds_per_step: float


@dataclass(frozen=True)
class RoundSpeeds:
    """The round's reports agreed over every rank: per group, the steps it trained and its mean τ over its ranks."""

    trained: list[float]
    seconds_per_step: list[float]


def next_round_steps(sync_steps: int, min_steps: int, seconds_per_step: Sequence[float]) -> list[int]:
    """H_g' for every group from its τ_g (the module's rule); 0 or less: not measured, all H."""
    known = [s for s in seconds_per_step if s > 0]
    if not known:
        return [sync_steps] * len(seconds_per_step)
    fastest = min(known)
    return [
        sync_steps if s <= 0 else max(min_steps, min(sync_steps, math.floor(sync_steps * fastest / s + 0.5)))
        for s in seconds_per_step
    ]


class RoundPlan:
    """One rank's view of its group's speed-aware round: the steps it trains in this round and the durations of
    those steps, measured between the training loop's calls of `FederatedAverager.step`.

    Args:
        sync_steps: H, the round's steps.
        min_steps: the fewest steps a group trains in a round (``fed_min_round_steps``).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, sync_steps: int, min_steps: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.sync_steps, self.min_steps, self.clock = sync_steps, min_steps, clock
        self.steps = sync_steps  # H_g of the current round
        self._durations: list[float] = []  # this round's trained steps'
        self._previous: list[float] = []  # the last round's
        self._since = clock()  # the end of the loop's previous call (or of the construction)

    def trains(self, step: int) -> bool:
        """Whether this group trains ``step`` (counted from 1): one of the first H_g of its round."""
        return (step - 1) % self.sync_steps < self.steps

    def stepped(self, step: int) -> None:
        """The loop took ``step``: its duration counts if the group trained it."""
        if self.trains(step):
            self._durations.append(self.clock() - self._since)

    def restart_clock(self) -> None:
        """The loop's call returned (an averaging may have run in it): the next step's duration starts now."""
        self._since = self.clock()

    def report(self, step: int) -> RoundReport:
        """This round's at ``step``, its end (or the last step, which may end a round early), for the control
        all-reduce."""
        trained = min(self.steps, (step - 1) % self.sync_steps + 1)
        window = self._previous + self._durations
        return RoundReport(trained, statistics.median(window) if window else 0.0)

    def next_round(self, speeds: RoundSpeeds, group: int) -> None:
        """The round committed: plan this group's next one from the agreed speeds."""
        self.steps = next_round_steps(self.sync_steps, self.min_steps, speeds.seconds_per_step)[group]
        self._previous, self._durations = self._durations, []

    def forget(self) -> None:
        """Start over: all H steps this round, no duration measured yet (a resume then sets its plan)."""
        self.steps, self._durations, self._previous = self.sync_steps, [], []

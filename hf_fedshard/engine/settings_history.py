"""What the averagings of a run did, step by step: the outer optimizer and the wire dtype, which a resume may change.

These four settings change nothing that a checkpoint must match (the anchor is fp32 whatever the wire dtype, and
SGD's momentum buffer does not depend on the lr or the momentum factor), so a resume honours new values from its
step on instead of refusing them:

- ``fed_outer_lr``, ``fed_outer_momentum``: the outer SGD takes them at the next averaging; the momentum buffer is
  kept (as for the inner learning rate, a hyperparameter a user retunes without discarding state).
- ``fed_outer_optimizer``: ``fedavg`` → ``nesterov`` starts the momentum from zero (there is none);
  ``nesterov`` → ``fedavg`` drops the buffer (so switching back later starts from zero too).
- ``fed_sync_dtype``: the next exchange is sent in the new dtype (an exchange in flight at the save holds its
  decoded mean already).

The run keeps every change with its step (in its checkpoints' counters), so logs and the model card say what ran.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class AveragingSettings:
    """The outer optimizer (``fedavg``: lr 1, momentum 0) and the dtype Δ is sent in."""

    outer_optimizer: str = "fedavg"
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    sync_dtype: str = "float32"

    def describe(self) -> str:
        """One phrase, as the card's "Averaging" row and the start-up line say it."""
        outer = "FedAvg"
        if self.outer_optimizer == "nesterov":
            outer = f"Nesterov outer SGD (lr {self.outer_lr:g}, momentum {self.outer_momentum:g})"
        return f"{outer}, Δ sent in {self.sync_dtype}"

    def changes_to(self, new: AveragingSettings) -> str:
        """The settings that differ, as ``fed_<name> old → new``, and what happens to the outer momentum."""
        changed = [
            f"fed_{f.name} {getattr(self, f.name)} → {getattr(new, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(new, f.name)
        ]
        if self.outer_momentum == 0 < new.outer_momentum:
            changed.append("the outer momentum starts from zero")
        elif new.outer_momentum == 0 < self.outer_momentum:
            changed.append("the outer momentum buffer is dropped")
        elif self.outer_momentum != new.outer_momentum or self.outer_lr != new.outer_lr:
            changed.append("the outer momentum buffer is kept")
        return ", ".join(changed)


History = list[tuple[int, AveragingSettings]]  # (first step, settings), in step order


def history_to_state(history: History) -> list[dict[str, Any]]:
    return [{"step": step, **asdict(settings)} for step, settings in history]


def history_from_state(state: list[dict[str, Any]]) -> History:
    return [
        (int(entry["step"]), AveragingSettings(**{k: v for k, v in entry.items() if k != "step"})) for entry in state
    ]


def settings_of_outer_state(outer_state: dict, sync_dtype: str) -> AveragingSettings:
    """What a checkpoint written before the history was recorded ran, read off its outer SGD's param group.

    The wire dtype left no trace in such a checkpoint: ``sync_dtype`` (the current one) is assumed.
    """
    group = outer_state["fragments"][0]["optimizer"]["param_groups"][0]
    lr, momentum = float(group["lr"]), float(group["momentum"])
    name = "fedavg" if (lr, momentum) == (1.0, 0.0) else "nesterov"
    return AveragingSettings(name, lr, momentum, sync_dtype)


def describe_history(history: History) -> str:
    """The settings of each stretch of the run: one phrase, or one per change with its steps."""
    if len(history) == 1:
        return history[0][1].describe()
    parts = []
    for i, (step, settings) in enumerate(history):
        until = f"steps {step}–{history[i + 1][0]}" if i + 1 < len(history) else f"from step {step}"
        parts.append(f"{settings.describe()} ({until})")
    return "; ".join(parts)

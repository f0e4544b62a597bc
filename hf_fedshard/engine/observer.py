"""`AveragingObserver`: a public hook on a `FederatedAverager`'s averagings, for whoever wants to see or time them
(a profiler, a user's own logging, the tests' recorders) without reaching into the averager's private methods.

Every method is called on the training loop's thread, with the model as the loop sees it at that moment, and only
for what was applied: an attempt that a round redoes over a new quorum is not seen (`hf_fedshard.engine.rounds`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class AveragingObserver:
    """Subclass it and override what you need (each method does nothing here); add it with
    `FederatedAverager.add_observer` (the Trainer's: ``trainer.fed_callback.averager``, from ``on_train_begin``).

    A blocking averaging calls `averaging`, then `exchanged` per fragment, then `averaged`. An overlapped one
    (``fed_sync_overlap`` τ > 0) calls `exchange_started` at the step it starts, then τ steps later `applying`,
    `exchanged` and `applied`.
    """

    def averaging(self, step: int, fragments: Sequence[int]) -> None:
        """Before a blocking averaging of ``fragments`` (indices) after optimizer step ``step``."""

    def averaged(self, step: int, fragments: Sequence[int]) -> None:
        """After it: the outer step applied, the model is the new global model."""

    def exchange_started(self, step: int, fragment: int) -> None:
        """An overlapped exchange of ``fragment`` starts after ``step``; the model is not changed yet."""

    def applying(self, step: int, fragment: int, started_at: int) -> None:
        """Before the result of ``fragment``'s exchange started at ``started_at`` is applied, after ``step``."""

    def applied(self, step: int, fragment: int) -> None:
        """After it was applied (the local progress made since ``started_at`` kept)."""

    def exchanged(
        self, step: int, fragment: int, deltas: Sequence[torch.Tensor], means: Sequence[torch.Tensor]
    ) -> None:
        """``fragment``'s exchange, before its outer step: what this rank sent, its pseudo-gradients Δ (local shards,
        fp32; zeros for a group that did not contribute; in a speed-aware round, times the steps its group trained),
        and the mean Δ the groups agreed on."""

"""Error feedback: what a sparse payload did not send is kept, decayed, and sent with a later averaging.

Rule, per fragment and local shard (e = 0 at the start; β = ``fed_sync_feedback_decay``; C(x) the values the
exchange sent for x, as every group decodes them: `Exchange.sent`)::

    x  = Δ + β · e          what this averaging compresses (Δ = anchor − local, `hf_fedshard.engine.outer`)
    e' = x − C(x)           kept where the averaging is applied (C(x) + e' = x: what was sent plus what was not)

β = 1 is plain error feedback (nothing is lost, only delayed); SparseLoCo uses β < 1 with no outer momentum, the
residual acting as the momentum. e changes only where an averaging is applied, so a round redone over a new quorum
(or after a resume) compresses the same x. e is this group's own: a group that heals from another starts from
e = 0 (taking the other's would send that group's unsent part twice), as does a group restarted after a NaN/Inf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ErrorFeedback:
    """One fragment's residual e (fp32 copies shaped like its local shards), and the rule of the module docstring."""

    def __init__(self, tensors: Sequence[torch.Tensor], decay: float) -> None:
        self.decay = decay
        self.residual = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in tensors]

    @torch.no_grad()
    def add(self, deltas: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """x = Δ + β · e (new tensors)."""
        return [d + self.decay * e for d, e in zip(deltas, self.residual, strict=True)]

    @staticmethod
    @torch.no_grad()
    def left(x: Sequence[torch.Tensor], sent: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """e' = x − C(x): what an averaging of ``x`` that sent ``sent`` leaves for the next one."""
        return [t - s for t, s in zip(x, sent, strict=True)]

    def keep(self, residual: Sequence[torch.Tensor]) -> None:
        """The averaging that computed ``residual`` (`left`) was applied."""
        self.residual = list(residual)

    def reset(self) -> None:
        """e = 0: a heal, a restart after NaN/Inf, a resume that changed the payload."""
        self.residual = [torch.zeros_like(e) for e in self.residual]

    def state_dict(self) -> list[torch.Tensor]:
        return self.residual

    @torch.no_grad()
    def load_state_dict(self, residual: Sequence[torch.Tensor]) -> None:
        for mine, saved in zip(self.residual, residual, strict=True):
            mine.copy_(saved)

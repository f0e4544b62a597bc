"""The one small collective of an averaging besides the exchange: the divergence flags now, the norms of the last.

Before an exchange every group must know which groups hold a NaN or an Inf (they send nothing and restart), and
after it the engine reports ‖mean Δ‖ and the groups' drift from it, which need the mean. Rather than a collective
before the exchange and another after it, both ride on one all-reduce over every rank of the federation, before
the exchange: the flags of now and the norm sums of the averaging before. So ``fed_delta_norm`` and
``fed_group_drift`` are logged one averaging late, and `FederatedAverager.finish` publishes the last averaging's
with one more all-reduce.

One rank's vector (G groups), summed over every rank of every group::

    [ flag_0 … flag_{G−1} | drift_0 … drift_{G−1} | mean | holders | step | step² ]

flag_g counts the ranks of group g holding a NaN/Inf (so a group agrees on its own flag without a collective of
its own); drift_g sums ‖Δ_g − mean Δ‖² and ``mean`` sums ‖mean Δ‖², each rank adding its shard's squares divided
by its group's HSDP replicas (they hold the same shard; with groups of unequal size, a different number of them).
``holders`` counts the ranks holding norms of a quorum of G groups: the sums are published only where every rank
holds them (`hf_fedshard.engine.rounds` I5: after a resume or a heal, or a quorum of another size, none is).
``step`` and ``step²`` sum each rank's step modulo 1024: they are equal on every rank iff n·Σs² = (Σs)² (Cauchy-
Schwarz, exact in float64 up to 2^16 ranks), the cheap check that the groups of an averaging are at one step (I2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_fedshard.engine.communicator import FederationCommunicator

_STEP_CODES = 1024  # steps are compared modulo this: its square times the ranks stays exact in float64


@dataclass
class Norms:
    """This rank's norm sums of an averaging, kept until the next control all-reduce publishes them."""

    sums: list[float]  # drift_0 … drift_{G−1}, mean (float64 values of this rank's shard)
    contributors: int  # how many groups sent their Δ

    @classmethod
    def of(
        cls,
        deltas: Sequence[torch.Tensor],
        means: Sequence[torch.Tensor],
        contribute: bool,
        group: int,
        num_groups: int,
        diverged: int,
    ) -> Norms:
        """This rank's squares: ‖Δ − mean Δ‖² in its group's slot (if it contributed), ‖mean Δ‖² last;
        ``diverged``: how many groups sent nothing."""
        sums = [0.0] * (num_groups + 1)
        if contribute:
            drift = (d - m for d, m in zip(deltas, means, strict=True))
            sums[group] = float(sum((x.double().square().sum() for x in drift), torch.zeros((), dtype=torch.float64)))
        sums[-1] = float(sum((m.double().square().sum() for m in means), torch.zeros((), dtype=torch.float64)))
        return cls(sums, num_groups - diverged)


def agree(
    comm: FederationCommunicator, finite: bool, norms: Norms | None, device: torch.device, step: int
) -> tuple[list[int], tuple[float, float] | None]:
    """(the groups holding a NaN/Inf now, the published (‖mean Δ‖, drift) of ``norms`` or ``None``).

    A collective over every rank: every rank gets the same list, so every rank takes the same branch afterwards.
    drift = mean over the contributing groups of ‖Δ_g − mean Δ‖, relative to ‖mean Δ‖. Raises on every rank alike
    where the ranks are not at one ``step``.
    """
    groups = comm.num_groups
    vector = torch.zeros(2 * groups + 4, dtype=torch.float64, device=device)
    vector[comm.group] = 0.0 if finite else 1.0
    if norms is not None and len(norms.sums) == groups + 1:  # a shard is held by the group's replicas: each a share
        vector[groups : 2 * groups + 1] = torch.tensor(norms.sums, dtype=torch.float64) / comm.hsdp_replicas
        vector[-3] = 1.0
    code = float(step % _STEP_CODES)
    vector[-2], vector[-1] = code, code * code
    comm.control.all_reduce_sum(vector)
    values = vector.tolist()
    ranks = comm.control.size()
    if ranks * values[-1] != values[-2] * values[-2]:
        raise RuntimeError(
            f"hf_fedshard: the groups of the averaging at step {step} are not all at that step; they left each "
            "other's schedule (a group healed or resumed out of phase). Restart the groups from a common checkpoint."
        )
    diverged = [g for g in range(groups) if values[g] > 0]
    if norms is None or values[-3] != ranks:
        return diverged, None
    sums = values[groups : 2 * groups + 1]
    mean_norm = (sums[-1] / groups) ** 0.5  # every group holds the same mean Δ
    drift = sum(s**0.5 for s in sums[:-1]) / norms.contributors
    return diverged, (mean_norm, drift / mean_norm if mean_norm > 0 else 0.0)

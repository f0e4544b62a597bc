"""The one small collective of an averaging besides the exchange: the divergence flags now, the norms of the last.

Before an exchange every group must know which groups hold a NaN or an Inf (they send nothing and restart), and
after it the engine reports ‖mean Δ‖ and the groups' drift from it, which need the mean. Rather than a collective
before the exchange and another after it, both ride on one all-reduce over every rank of the federation, before
the exchange: the flags of now and the norm sums of the averaging before. So ``fed_delta_norm`` and
``fed_group_drift`` are logged one averaging late, and `FederatedAverager.finish` publishes the last averaging's
with one more all-reduce.

One rank's vector (G groups), summed over every rank of every group::

    [ flag_0 … flag_{G−1} | drift_0 … drift_{G−1} | mean | trained_0 … | seconds_0 … | holders | step | step² ]

flag_g counts the ranks of group g holding a NaN/Inf (so a group agrees on its own flag without a collective of
its own); drift_g sums ‖Δ_g − mean Δ‖² and ``mean`` sums ‖mean Δ‖², each rank adding its shard's squares divided
by its group's HSDP replicas (they hold the same shard; with groups of unequal size, a different number of them).
``holders`` counts the ranks holding norms of a quorum of G groups: the sums are published only where every rank
holds them (`hf_fedshard.engine.rounds` I5: after a resume or a heal, or a quorum of another size, none is).
``trained_g`` and ``seconds_g`` carry a speed-aware round's reports (`hf_fedshard.engine.speed`): each rank of group g
adds the steps its group trained and its median step's seconds; divided by the group's ranks, they give s_g and the
mean τ of its ranks.
``step`` and ``step²`` sum each rank's step modulo 1024: they are equal on every rank iff n·Σs² = (Σs)² (Cauchy-
Schwarz, exact in float64 up to 2^16 ranks), the cheap check that the groups of an averaging are at one step (I2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_fedshard.engine.communicator import FederationCommunicator
from hf_fedshard.engine.speed import RoundReport, RoundSpeeds

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


@dataclass(frozen=True)
class Agreement:
    """What the control all-reduce gave every rank alike: the groups holding a NaN/Inf now, the published
    (‖mean Δ‖, drift) of the last averaging's norms or ``None``, and the round's speeds (``None`` unless reported)."""

    diverged: list[int]
    published: tuple[float, float] | None = None
    speeds: RoundSpeeds | None = None


def agree(
    comm: FederationCommunicator,
    finite: bool,
    norms: Norms | None,
    device: torch.device,
    step: int,
    report: RoundReport | None = None,
) -> Agreement:
    """The control all-reduce: every rank gets the same `Agreement`, so every rank takes the same branch afterwards.

    drift = mean over the contributing groups of ‖Δ_g − mean Δ‖, relative to ‖mean Δ‖. ``report``: this rank's
    speed-aware round (every rank of a round reports, or none). Raises on every rank alike where the ranks are not
    at one ``step``.
    """
    groups = comm.num_groups
    trained, seconds, holders = 2 * groups + 1, 3 * groups + 1, 4 * groups + 1  # offsets, see the module docstring
    vector = torch.zeros(4 * groups + 4, dtype=torch.float64, device=device)
    vector[comm.group] = 0.0 if finite else 1.0
    if norms is not None and len(norms.sums) == groups + 1:  # a shard is held by the group's replicas: each a share
        vector[groups:trained] = torch.tensor(norms.sums, dtype=torch.float64) / comm.hsdp_replicas
        vector[holders] = 1.0
    if report is not None:
        vector[trained + comm.group], vector[seconds + comm.group] = report.trained, report.seconds_per_step
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
    speeds = None
    if report is not None:
        per_group = group_ranks(comm)
        speeds = RoundSpeeds(
            [values[trained + g] / per_group[g] for g in range(groups)],
            [values[seconds + g] / per_group[g] for g in range(groups)],
        )
    if norms is None or values[holders] != ranks:
        return Agreement(diverged, None, speeds)
    sums = values[groups:trained]
    mean_norm = (sums[-1] / groups) ** 0.5  # every group holds the same mean Δ
    drift = sum(s**0.5 for s in sums[:-1]) / norms.contributors
    return Agreement(diverged, (mean_norm, drift / mean_norm if mean_norm > 0 else 0.0), speeds)


def group_ranks(comm: FederationCommunicator) -> list[int]:
    """How many ranks of ``control`` each group of the round has (equal groups: the same number each)."""
    weights = comm.group_weights  # ranks with groups of unequal size, else 1 each
    per_weight = comm.control.size() // sum(weights)
    return [w * per_weight for w in weights]

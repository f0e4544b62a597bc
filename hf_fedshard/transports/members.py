"""The checks when the groups of a torchft federation meet: no two launches claim one group, every group runs the
same settings. Equal groups (`hf_fedshard.transports.elastic`) and groups of unequal size
(`hf_fedshard.transports.quorum_world`) sum the same figures over the quorum and refuse alike."""

from __future__ import annotations

import hashlib

from hf_fedshard.errors import ConfigError


def settings_code(text: str) -> float:
    """A 20-bit code of ``text``: its square and sums over a few thousand groups stay exact in float64."""
    return float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % (1 << 20))


def refuse_bad_members(
    claims: float, group_id: int, num_groups: int, groups: int, codes: float, squares: float, settings: str
) -> None:
    """Refuse in one line, on every rank alike (they all read the same sums): ``claims`` launches of this group,
    or settings that differ among the ``groups`` groups (``codes`` and ``squares``: the sums of their
    `settings_code` and of its square; equal iff every code is the same, by Cauchy-Schwarz). ``settings`` names
    what must match."""
    if claims > 1:
        raise ConfigError(
            f"hf_fedshard: two launches claim fed_group_id={group_id}. Give every group its own "
            f"--fed_group_id in 0..{num_groups - 1}."
        )
    if groups * squares != codes * codes:
        raise ConfigError(
            f"hf_fedshard: the groups of the federation were started with different settings ({settings}). Start "
            "every group with the same ones."
        )

"""The checks when the groups of a torchft federation meet: no two launches claim one group, every group runs the
same settings. Equal groups (`hf_fedshard.transports.elastic`) and groups of unequal size
(`hf_fedshard.transports.quorum_world`) sum the same figures over the quorum and refuse alike."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from hf_fedshard.engine.communicator import Communicator
from hf_fedshard.errors import ConfigError

_FINGERPRINT_BYTES = 8192  # a fingerprint is a few hundred characters; longer ones are cut


def settings_code(text: str) -> float:
    """A 20-bit code of ``text``: its square and sums over a few thousand groups stay exact in float64."""
    return float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % (1 << 20))


def settings_differ(groups: int, codes: float, squares: float) -> bool:
    """Whether the ``groups`` groups' `settings_code` s differ, from their sum ``codes`` and the sum of their squares
    ``squares`` (all equal iff groups · squares = codes², by Cauchy-Schwarz; exact in float64 for these codes)."""
    return groups * squares != codes * codes


def refuse_bad_members(
    claims: float,
    group_id: int,
    num_groups: int,
    groups: int,
    codes: float,
    squares: float,
    settings: str,
    differences: Callable[[], str] | None = None,
) -> None:
    """Refuse in one line, on every rank alike (they all read the same sums): ``claims`` launches of this group,
    or settings that differ among the ``groups`` groups (``codes`` and ``squares``: the sums of their
    `settings_code` and of its square; equal iff every code is the same, by Cauchy-Schwarz). ``settings`` names
    what must match; ``differences`` (a collective, called only where they differ) names what does not."""
    if claims > 1:
        raise ConfigError(
            f"hf_fedshard: two launches claim fed_group_id={group_id} (both answer: a second launch, or a worker that "
            "outlived its killed torchrun, which starts workers in sessions of their own; a dead launch is not "
            f"counted). Give every group its own --fed_group_id in 0..{num_groups - 1}, and end stray workers."
        )
    if settings_differ(groups, codes, squares):
        which = f": {differences()}" if differences is not None else f" ({settings})"
        raise ConfigError(
            f"hf_fedshard: the groups of the federation were started with different settings{which}. Start every "
            "group with the same ones."
        )


def fingerprint(**settings: object) -> str:
    """A text naming the settings every group must share (``name=value`` joined by ``;``), for the checks when
    groups meet; `differing_settings` reads it back."""
    return ";".join(f"{k}={v}" for k, v in sorted(settings.items()))


def differing_settings(fingerprints: dict[str, str]) -> str:
    """The settings whose values differ among the groups' `fingerprint` s (by where they come from), each with every
    group's value: ``seed 0 in fed_group0, 1 in fed_group1``."""
    parsed = {
        g: dict(item.split("=", 1) for item in text.split(";") if "=" in item) for g, text in fingerprints.items()
    }
    names = sorted({name for settings in parsed.values() for name in settings})
    lines = []
    for name in names:
        values = {g: settings.get(name, "(unset)") for g, settings in parsed.items()}
        if len(set(values.values())) > 1:
            lines.append(f"{name} " + ", ".join(f"{_short(v)} in {where}" for where, v in values.items()))
    return "; ".join(lines) or "their settings texts differ"


def gather_fingerprints(peers: Communicator, group_id: int, fingerprint: str) -> dict[str, str]:
    """Every group's fingerprint by group id, over ``peers`` (one rank per group): an all-gather of fixed size."""
    data = f"{group_id}|{fingerprint}".encode()[:_FINGERPRINT_BYTES]
    mine = torch.zeros(_FINGERPRINT_BYTES, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = torch.zeros(_FINGERPRINT_BYTES * peers.size(), dtype=torch.uint8)
    peers.all_gather(everyone, mine)
    texts = [bytes(part.tolist()).rstrip(b"\0").decode(errors="replace") for part in everyone.chunk(peers.size())]
    pairs = sorted((int(text.split("|", 1)[0]), text.split("|", 1)[1]) for text in texts if "|" in text)
    return {f"fed_group{g}": text for g, text in pairs}


def _short(value: str) -> str:
    return value if len(value) <= 60 else value[:57] + "…"

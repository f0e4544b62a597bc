"""Assertion helpers shared by the tests."""

from __future__ import annotations

from collections.abc import Callable


def labelled(label: str) -> Callable[[str], str]:
    """An ``assert_close`` msg naming what is compared, before torch's mismatch report.

    A str ``msg`` replaces that report (how many values differ and by how much); a callable keeps it.
    """
    return lambda report: f"{label}: {report}"

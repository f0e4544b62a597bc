"""The README's Results table against the recorded runs: every figure in its result column must appear in the
opening table of benchmarks/README.md or in a file of the results folder the row cites (a row with no results folder,
the cost model's, cites the section of benchmarks/README.md that quotes its output, which test_cost.py checks).

Why: the README's table is a digest typed into Markdown; without this check it drifts from the studies' own output
(as its earlier paragraph did). A figure passes if it is one of the summary table's figures (the two tables must
agree) or a value of the cited results.json rounded to the digits shown (a figure only the run holds)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
CITED = re.compile(r"\(benchmarks/results/([^)]+)\)")
QUOTED = "(benchmarks/README.md#"  # a row with no results folder (the cost model) cites the section quoting its output


def section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same level."""
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    end = text.find(f"\n{level} ", start + len(heading) + 2)
    return text[start : end if end != -1 else None]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every body row of the Markdown tables in ``text`` (header and separator rows left out)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    headers = {i for i in range(len(rows) - 1) if _sep(rows[i + 1])}
    return [r for i, r in enumerate(rows) if i not in headers and not _sep(r)]


def _sep(row: list[str]) -> bool:
    """Whether ``row`` is a table's header separator (``|---|---|``)."""
    return all(c and set(c) <= set("-: ") for c in row)


def figures(cell: str) -> list[str]:
    """The numbers written in a cell, thousands separators dropped (``3,683`` → ``3683``)."""
    return [n.replace(",", "") for n in NUMBER.findall(cell)]


def leaves(value: object) -> Iterator[float]:
    """Every number in a parsed JSON document."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        for v in value:
            yield from leaves(v)
    elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        yield float(value)


def recorded(folder: Path) -> tuple[set[float], set[str]]:
    """The numbers a cited results folder (or file) holds: the JSON leaves and the text's figures."""
    files = [folder] if folder.is_file() else sorted(folder.glob("*.json")) + sorted(folder.glob("*.txt"))
    values: set[float] = set()
    words: set[str] = set()
    for f in files:
        text = f.read_text()
        values |= set(leaves(json.loads(text))) if f.suffix == ".json" else set()
        words |= set(figures(text))
    return values, words


def in_run(figure: str, values: set[float]) -> bool:
    """Whether some recorded value, as it is, in percent or in minutes, rounds to ``figure``."""
    digits = len(figure.split(".")[1]) if "." in figure else 0
    target = float(figure)
    return any(round(v * k, digits) == target for v in values for k in (1, 100, 1 / 60))


README = (ROOT / "README.md").read_text()
ROWS = table_rows(section(README, "## Results"))
SUMMARY = set(figures(section((ROOT / "benchmarks" / "README.md").read_text(), "## Summary of results")))


def test_readme_results_is_one_table_of_six_columns():
    assert len(ROWS) >= 8
    assert {len(r) for r in ROWS} == {6}


@pytest.mark.parametrize("row", ROWS, ids=[r[0][:40] for r in ROWS])
def test_every_readme_figure_comes_from_a_recorded_run(row: list[str]):
    cited = [ROOT / "benchmarks" / "results" / c for c in CITED.findall(row[5])]
    assert all(c.exists() for c in cited), f"row cites a missing results folder: {row[5]}"
    assert cited or QUOTED in row[5], f"row cites neither a results folder nor benchmarks/README.md: {row[5]}"
    values, words = set(), set()
    for c in cited:
        v, w = recorded(c)
        values |= v
        words |= w
    missing = [f for f in figures(row[3]) if f not in SUMMARY and f not in words and not in_run(f, values)]
    assert not missing, f"{row[0]}: {missing} neither in benchmarks/README.md's summary nor in {cited}"


def test_readme_figure_exists_and_is_embedded():
    assert "](docs/perplexity_vs_time_three_tier.png)" in section(README, "## Results")
    assert (ROOT / "docs" / "perplexity_vs_time_three_tier.png").stat().st_size > 10_000

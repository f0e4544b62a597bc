"""How a study runs: as a module from the repository's root, one timed study at a time on this machine's cores, its
results naming the command that reproduces them.

    python -m benchmarks.<study> [options]     # from the repository's root: no PYTHONPATH, no sys.path edits

A study's ``make_parser`` starts from `new_parser` and adds its folders with `add_folder_options`; its ``main``
holds a `Study`: ``with study.running() as work:`` takes the benchmark lock (`exclusive_cores`), a scratch folder
(``--work`` where the study has it) and the wall clock; `Study.finish` writes results.json and results.md into
``--out`` (default: the study's folder under benchmarks/results/), draws the plot and prints the table. `rewrite`
is ``--report-only``: the tables and plots of a finished results.json again, nothing run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar

from benchmarks.harness import results_folder
from benchmarks.harness.exclusive import exclusive_cores
from benchmarks.harness.methods import DATA_CACHE
from benchmarks.harness.report import run_record, write_study

Markdown = Callable[[dict], str]
Plot = Callable[[dict, Path], object]


class Validating(Protocol):
    def validate(self) -> None: ...


T = TypeVar("T", bound=Validating)


def new_parser(doc: str) -> argparse.ArgumentParser:
    """A study's parser: its docstring's first line as the description, its launch commands kept as written."""
    return argparse.ArgumentParser(description=doc.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)


def add_folder_options(
    p: argparse.ArgumentParser, study: str, variants: str = "", work: str | None = None, report_only: str | None = None
) -> None:
    """``--out`` (default benchmarks/results/<study>_<quick|full><variants>), ``--work`` where the study keeps
    ``work`` if asked, ``--data-cache``, and ``--report-only`` where it can rewrite its ``report_only`` alone."""
    default = f"benchmarks/results/{study}_<quick|full>{variants}"
    p.add_argument("--out", type=Path, help=f"Results folder (default {default}).")
    if work is not None:
        p.add_argument("--work", type=Path, help=f"Keep {work} here (default: a temporary folder).")
    p.add_argument("--data-cache", type=Path, default=DATA_CACHE, help="Where the tokenized data is kept.")
    if report_only is not None:
        p.add_argument("--report-only", type=Path, help=f"Rewrite the {report_only} of this results.json; run nothing.")


class Study:
    """One run of ``benchmarks/<name>.py``: its arguments parsed from ``argv`` (None: this process's command line)."""

    def __init__(self, name: str, parser: argparse.ArgumentParser, argv: list[str] | None = None) -> None:
        self.name = name
        self.argv = sys.argv[1:] if argv is None else list(argv)
        self.args = parser.parse_args(self.argv)
        self.started = time.time()

    @property
    def command(self) -> str:
        """The command that reproduces this run, as its results record it."""
        return shlex.join(["python", "-m", f"benchmarks.{self.name}", *self.argv])

    def out(self, variant: str | None = None) -> Path:
        """``--out``, else the study's folder for this mode and ``variant`` (`results_folder`)."""
        return self.args.out or results_folder(self.name, getattr(self.args, "quick", False), variant)

    @contextlib.contextmanager
    def running(self, exclusive: bool = True) -> Iterator[Path]:
        """Hold the benchmark lock (unless ``exclusive`` is False: a study that times nothing) and a scratch folder,
        ``--work`` if given, else a temporary one removed afterwards; the wall clock starts once the lock is held."""
        lock = exclusive_cores(f"benchmarks.{self.name}") if exclusive else contextlib.nullcontext()
        with lock, tempfile.TemporaryDirectory(prefix=f"fedshard-{self.name.replace('_', '-')}-") as tmp:
            self.started = time.time()  # after the lock: the record's wall time is the study's own
            yield getattr(self.args, "work", None) or Path(tmp)

    def record(self) -> dict[str, object]:
        """Where the figures come from: the command, start time and wall seconds (`report.run_record`)."""
        return {**run_record(f"benchmarks/{self.name}.py", self.argv, self.started), "command": self.command}

    def finish(self, results: dict, markdown: Markdown, plot: Plot | None = None, variant: str | None = None) -> int:
        """Add the record to ``results``, write them into `out` with their plot, print the table; the exit status."""
        results.update(self.record())
        return publish(self.out(variant), results, markdown, plot)


def rewrite(results_json: Path, summarize: Callable[[dict], dict], markdown: Markdown, plot: Plot | None = None) -> int:
    """``--report-only``: summarize a finished run's results.json again, rewrite its tables and plots beside it."""
    results = json.loads(results_json.read_text())
    results["summary"] = summarize(results)
    return publish(results_json.parent, results, markdown, plot)


def publish(out: Path, results: dict, markdown: Markdown, plot: Plot | None = None) -> int:
    """results.json, results.md and the plots into ``out``; prints the table and returns the exit status, 0."""
    table = write_study(out, results, markdown)
    if plot is not None:
        plot(results, out)
    print(table)
    return 0


def validated(config: T) -> T:
    """``config`` once its ``validate()`` passed: a study refuses settings that do not fit before it runs anything."""
    config.validate()
    return config

"""A flake hunt under load: the launched tests run again and again while busy processes take the cores (``make
test-stress``).

    python -m tests.stress                                   # tests/distributed and tests/studies, 5 times, 2 busy
    python -m tests.stress --reps 3 --busy 2 --workers 0 tests/distributed/test_reliability.py -k checkpoint

A shared CI machine runs the suite beside other jobs; a test that passes on a quiet machine and fails there fails a
landing at random. Each repetition is one pytest session over the chosen tests (session fixtures are built once per
repetition, as in CI) on ``--workers`` pytest workers (2, as `make test` runs them), with ``--busy`` processes
spinning beside it. The report lists every test that failed at
least once, how often, and the first failure's message; ``--report`` writes it as JSON with every failure's output.
Exits 1 if any test failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPIN = "while True: pass"


def parse_junit(path: Path) -> dict[str, str | None]:
    """Each test's outcome from pytest's JUnit XML: ``None`` for a pass or skip, else its failure's text."""
    outcomes: dict[str, str | None] = {}
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        failed = case.find("failure")
        if failed is None:
            failed = case.find("error")
        outcomes[name] = None if failed is None else f"{failed.get('message', '')}\n{failed.text or ''}"
    return outcomes


def one_repetition(
    tests: list[str], junit: Path, timeout_s: float, workers: int
) -> tuple[dict[str, str | None], float]:
    """One pytest session over ``tests`` (on ``workers`` pytest workers, as `make test` runs them; 0: in one
    process); every test's outcome and the session's seconds."""
    started = time.monotonic()
    parallel = ["-n", str(workers), "--dist", "loadscope"] if workers else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *parallel, f"--junitxml={junit}", *tests]
    try:
        subprocess.run(cmd, cwd=REPO, timeout=timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    except subprocess.TimeoutExpired:
        return {"<session>": f"the repetition ran past {timeout_s:.0f} s"}, time.monotonic() - started
    if not junit.exists():
        return {"<session>": "pytest wrote no report (collection failed?)"}, time.monotonic() - started
    return parse_junit(junit), time.monotonic() - started


def hunt(tests: list[str], reps: int, busy: int, timeout_s: float, workers: int = 0) -> dict:
    """Run ``tests`` ``reps`` times beside ``busy`` spinning processes; the failures by test and the times."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    failures: dict[str, list[str]] = {}
    seconds, counted = [], 0
    try:
        with tempfile.TemporaryDirectory() as folder:
            for rep in range(reps):
                outcomes, took = one_repetition(tests, Path(folder) / f"rep{rep}.xml", timeout_s, workers)
                seconds.append(round(took, 1))
                counted = max(counted, len(outcomes))
                for name, failure in outcomes.items():
                    if failure is not None:
                        failures.setdefault(name, []).append(f"repetition {rep}: {failure}")
                bad = sum(f is not None for f in outcomes.values())
                print(f"repetition {rep + 1}/{reps}: {len(outcomes)} tests, {bad} failed, {took:.0f} s", flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    return {"tests": tests, "reps": reps, "busy": busy, "workers": workers, "tests_run": counted,
            "seconds": seconds, "failures": failures}  # fmt: skip


def summary(report: dict) -> str:
    took = ", ".join(f"{s:.0f}" for s in report["seconds"])
    on = f" on {report['workers']} pytest workers" if report.get("workers") else ""
    lines = [f"{report['tests_run']} tests × {report['reps']} repetitions{on} beside {report['busy']} busy processes "
             f"({took} s): {len(report['failures'])} failed at least once"]  # fmt: skip
    for name, runs in sorted(report["failures"].items()):
        first = runs[0].strip().splitlines()
        lines.append(f"  {name}: failed {len(runs)} of {report['reps']}: {first[0][:300] if first else ''}")
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tests", nargs="*", default=["tests/distributed", "tests/studies"], help="pytest paths/node ids.")
    p.add_argument("-k", dest="keyword", help="pytest's -k expression, applied to every repetition.")
    p.add_argument("--reps", type=int, default=5, help="Repetitions of every test (default 5).")
    p.add_argument("--busy", type=int, default=2, help="Spinning processes beside the tests (default 2: CI's cores).")
    p.add_argument("--workers", type=int, default=2, help="pytest workers (default 2, as make test; 0: one process).")
    p.add_argument("--timeout-s", type=float, default=5400, help="Bound on one repetition (default 5,400 s).")
    p.add_argument("--report", type=Path, help="Write the report, every failure's output included, as JSON here.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    tests = [*args.tests, *(["-k", args.keyword] if args.keyword else [])]
    report = hunt(tests, args.reps, args.busy, args.timeout_s, args.workers)
    print(summary(report))
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""tests/stress.py, the flake hunt: what it reads from pytest's JUnit report and what it says of it."""

from __future__ import annotations

from ..stress import parse_junit, summary

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.distributed.test_a" name="test_passes" time="1.0"/>
<testcase classname="tests.distributed.test_a" name="test_skipped" time="0.0"><skipped message="root"/></testcase>
<testcase classname="tests.distributed.test_b" name="test_counts" time="2.0">
<failure message="AssertionError: assert 3 == 4">rank 3 was stopped first</failure></testcase>
<testcase classname="tests.studies.test_c" name="test_fixture" time="0.5">
<error message="failed on setup with TimeoutError">the launch hung</error></testcase>
</testsuite></testsuites>"""


def test_failures_and_errors_are_read_with_their_text_and_passes_and_skips_are_not(tmp_path):
    report = tmp_path / "rep.xml"
    report.write_text(JUNIT)
    assert parse_junit(report) == {
        "tests.distributed.test_a::test_passes": None,
        "tests.distributed.test_a::test_skipped": None,
        "tests.distributed.test_b::test_counts": "AssertionError: assert 3 == 4\nrank 3 was stopped first",
        "tests.studies.test_c::test_fixture": "failed on setup with TimeoutError\nthe launch hung",
    }


def test_the_summary_names_each_failed_test_with_how_often_and_its_first_message():
    failures = {"t::flaky": ["repetition 1: AssertionError: 3 == 4\ntail", "repetition 4: other"]}
    report = {"tests": [], "reps": 5, "busy": 2, "workers": 2, "tests_run": 4, "seconds": [40.2, 39.6],
              "failures": failures}  # fmt: skip
    assert summary(report).splitlines() == [
        "4 tests × 5 repetitions on 2 pytest workers beside 2 busy processes (40, 40 s): 1 failed at least once",
        "  t::flaky: failed 2 of 5: repetition 1: AssertionError: 3 == 4",
    ]

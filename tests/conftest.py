"""Fixtures shared by the tests: in-process settings, and multi-process runs that several test files assert on
(each launched once per session, which under `make test`'s two pytest workers is once per worker that needs it: a
4-rank launch costs about 15 CPU-seconds, most of it the ranks' start-up).

The suite is laid out by cost: ``tests/unit/`` runs in this process (fake communicators, pure functions; `make
test-fast`), ``tests/distributed/`` launches ranks (torchrun, ``accelerate launch``, a torchft lighthouse), and
``tests/studies/`` runs the benchmark scripts end to end at their smallest honest size. `make test` runs all three.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from transformers import TrainingArguments

from .launch import SERVER_STARTS_S, train_tiny


@pytest.fixture
def world4_no_setup(monkeypatch):
    """WORLD_SIZE=4 without process groups: the fields are final when `TrainingArguments.__post_init__` starts."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: None)


@pytest.fixture(scope="session")
def fl_fsdp_h2(tmp_path_factory):
    """FL+FSDP: 2 groups × 2 ranks, H=2, 4 steps, 64 samples (tests/scripts/train_tiny.py, every rank's dump)."""
    return train_tiny(4, tmp_path_factory.mktemp("fl_fsdp_h2"), ["--fed_group_size", "2", "--fed_sync_steps", "2",
                                                                   "--max_steps", "4"])  # fmt: skip


@pytest.fixture(scope="session")
def one_job_h4(tmp_path_factory) -> list[dict]:
    """One job of 2 groups × 2 ranks (the mesh), H = 4, 10 steps, 128 samples: the reference of the runs of a launch
    per group with those settings (torchft's, the transport registered from outside the package)."""
    args = ["--num_samples", "128", "--max_steps", "10", "--fed_sync_steps", "4", "--fed_group_size", "2"]
    return train_tiny(4, tmp_path_factory.mktemp("mesh_h4"), args)


@pytest.fixture(scope="session")
def ddp_4_ranks(tmp_path_factory):
    """DDP (transformers.Trainer on CPU, no federation) over 4 ranks, 3 steps: the reference of the H=1 runs."""
    return train_tiny(
        4, tmp_path_factory.mktemp("ddp"), ["--trainer", "plain", "--use_cpu", "true", "--max_steps", "3"]
    )


# ---- The suite's budget: CI's log shows where the time goes ----

_seconds_by_folder: dict[str, float] = {}
_seconds_by_test: dict[str, float] = {}
_started: list[float] = []
SUITE_BUDGET_S = 1080  # .ci/run's 20 minutes on a clean clone, less about 2 minutes of install and lint
LONG_TEST_S = 60  # a test over this says in its docstring why it needs the time
STUDY_SMOKE_S = 20  # a study's smoke test (tests/studies) runs every stage at its smallest size, in seconds


def pytest_sessionstart(session: pytest.Session) -> None:
    _started.append(time.monotonic())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Say in the report how long this phase spent starting the launch server (it travels to xdist's controller)."""
    report = yield
    report.user_properties.append(("launch_server_s", sum(SERVER_STARTS_S)))
    SERVER_STARTS_S.clear()  # charged once
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each test's setup, call and teardown time to its folder (a session fixture counts where it is built), less
    the start of the launch server it may have been the first to need (once per pytest worker, about 10 s of imports:
    counted apart, as "launch server")."""
    folder = report.nodeid.split("/")[1] if report.nodeid.startswith("tests/") else "other"
    server_s = dict(report.user_properties).get("launch_server_s", 0.0)
    _seconds_by_folder["launch server"] = _seconds_by_folder.get("launch server", 0.0) + server_s
    _seconds_by_folder[folder] = _seconds_by_folder.get(folder, 0.0) + report.duration - server_s
    _seconds_by_test[report.nodeid] = _seconds_by_test.get(report.nodeid, 0.0) + report.duration - server_s


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the session's wall time against the budget (`.ci/run` in at most 20 minutes on CI's 2 cores, the
    install and the lint included, which leaves the tests about 1,080 s), and the seconds of its tests per folder
    (unit, distributed, studies): with `make test`'s two pytest workers these add up to more than the wall time."""
    if _seconds_by_folder and _started:
        wall_s = time.monotonic() - _started[0]
        parts = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in sorted(_seconds_by_folder.items()))
        terminalreporter.write_line(
            f"{wall_s:.0f} s of pytest (budget: {SUITE_BUDGET_S:,} s on CI's 2 cores); test time per folder: {parts}"
        )
    for nodeid, seconds in sorted(_seconds_by_test.items(), key=lambda item: -item[1]):
        if seconds > LONG_TEST_S:
            terminalreporter.write_line(f"over {LONG_TEST_S} s ({seconds:.0f} s; its docstring says why): {nodeid}")
        elif seconds > STUDY_SMOKE_S and nodeid.startswith("tests/studies/"):
            terminalreporter.write_line(f"study smoke test over {STUDY_SMOKE_S} s ({seconds:.0f} s): {nodeid}")


@pytest.fixture
def group_of_one_rank() -> Iterator[None]:
    """A real one-rank gloo world in this process: what a heal agrees over, a background checkpoint all-reduces on."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()

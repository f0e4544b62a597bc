"""The start-up line's arithmetic (`hf_fedshard.startup`): each phase from its moments, the rest as ``other``, said
once. (A real launch prints it: tests/distributed/test_elastic.py's restart test reads it in a group's output.)"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from hf_fedshard import startup


def test_the_breakdown_splits_the_time_to_the_first_step_by_phase_and_is_said_once(monkeypatch, caplog):
    moments = {"imports done": 110.0, "trainer": 114.0, "loop": 120.0, "train begin": 123.0}
    seconds = {"arguments and process groups": 1.0, "trainer set-up": 2.0, "quorum and heal": 3.0, startup.LOAD: 1.5}
    monkeypatch.setattr(startup, "_moments", moments)
    monkeypatch.setattr(startup, "_seconds", seconds)
    monkeypatch.setattr(startup, "time", SimpleNamespace(time=lambda: 125.0))
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.WARNING, logger="hf_fedshard"):
        breakdown = startup.first_step_done(started=100.0)
    assert breakdown == {
        "interpreter and imports": 10.0,
        "arguments and process groups": 1.0,
        "your script (data and model)": 3.0,  # 14 s before the trainer, less the imports and the process groups
        "trainer set-up": 2.0,
        "quorum and heal": 3.0,
        "FSDP set-up": 1.5,  # the loop's 3 s before its first step, less the state's load
        startup.LOAD: 1.5,
        "first step": 2.0,
        "other": 1.0,  # 25 s in all
        "total": 25.0,
    }
    said = "hf_fedshard: start-up 25.0 s to the first trained step: interpreter and imports 10.0 s, arguments"
    assert caplog.messages[-1].startswith(said)
    assert startup.first_step_done(started=100.0) is None  # said once per process
    startup._seconds["trainer set-up"] = 2.0
    with startup.phase("trainer set-up"):  # a phase after the first step is not the start-up's
        pass
    assert startup._seconds["trainer set-up"] == 2.0


def test_the_process_start_comes_from_the_kernel():
    """This pytest process began before this test and within CI's 90 minutes."""
    started = startup.process_start()
    assert started is not None and 0 < time.time() - started < 90 * 60


def test_a_process_forked_after_its_imports_spent_none_on_them(monkeypatch):
    """A launcher that forks preloaded workers (tests/preloaded_torchrun.py): the imports precede the process."""
    monkeypatch.setattr(startup, "_moments", {"imports done": 90.0, "trainer": 104.0, "train begin": 110.0})
    monkeypatch.setattr(startup, "_seconds", {"arguments and process groups": 1.0})
    monkeypatch.setattr(startup, "time", SimpleNamespace(time=lambda: 112.0))
    breakdown = startup.first_step_done(started=100.0)
    assert (breakdown["interpreter and imports"], breakdown["your script (data and model)"]) == (0.0, 3.0)
    assert breakdown["total"] == 12.0 and breakdown["other"] == 6.0  # the trainer's set-up and loop: not timed here

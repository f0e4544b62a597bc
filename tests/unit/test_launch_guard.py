"""`hf_fedshard.launch_guard` in this process: when the launcher watch ends a worker, which launches are warned of
their shared restart store, what the set-up deadline is and says. The launches themselves are
tests/distributed/test_launch_guard.py."""

from __future__ import annotations

import logging
import threading

import pytest

from hf_fedshard import launch_guard
from hf_fedshard.errors import ConfigError

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "0"}  # fmt: skip


@pytest.fixture
def ended(monkeypatch) -> list[str]:
    """What `_end` would say before ending the process (recorded instead), and no watch started before."""
    said: list[str] = []
    monkeypatch.setattr(launch_guard, "_end", said.append)
    monkeypatch.setattr(launch_guard, "_watched", {})
    monkeypatch.setattr(launch_guard, "WATCH_INTERVAL_S", 0.01)
    return said


def test_the_watch_ends_a_worker_once_its_launcher_is_gone_and_only_under_torchrun(monkeypatch, ended):
    parents = iter([4242, 4242, 4242, 1])  # the launcher, then init: it died and the worker was re-parented
    monkeypatch.setattr(launch_guard.os, "getppid", lambda: next(parents, 1))
    launch_guard.watch_launcher()  # not under torchrun: nothing watched
    assert launch_guard._watched == {}
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    launch_guard.watch_launcher()
    launch_guard.watch_launcher()  # once per process
    (watch,) = [t for t in threading.enumerate() if t.name == "hf_fedshard-launcher-watch"]
    watch.join(timeout=10)
    assert ended == [
        "the launcher that started this worker (pid 4242) is gone; ending this worker so that a restarted launch can "
        "take its place"
    ]


@pytest.mark.parametrize(
    ("change", "warned"),
    [({}, True), ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, False), ({"TORCHELASTIC_MAX_RESTARTS": "0"}, False),
     ({"TORCHELASTIC_RESTART_COUNT": "1"}, False), ({"RANK": "1"}, False)],
    ids=["shared", "not-shared", "no-restarts", "a-restart-itself", "rank-1"],
)  # fmt: skip
def test_the_shared_restart_store_is_said_once_at_the_first_start_by_rank_0(monkeypatch, caplog, change, warned):
    monkeypatch.setitem(launch_guard.notice.__globals__, "_said", set())
    for name, value in {**TORCHRUN, **change}.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="hf_fedshard"):
        launch_guard.check_restart_store()
        launch_guard.check_restart_store()
    expected = (
        "hf_fedshard: torchrun --max-restarts=2 shares its rendezvous store with the workers it restarts, which then "
        "read the dead workers' addresses and fail or hang in init_process_group (pytorch/pytorch#135712). Export "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where you start torchrun."
    )
    assert [r.getMessage() for r in caplog.records] == ([expected] if warned else [])


@pytest.mark.parametrize("value", ["0", "-3", "soon", "nan"])
def test_a_bad_setup_timeout_is_refused_in_one_line(monkeypatch, value):
    monkeypatch.setenv("HF_FEDSHARD_SETUP_TIMEOUT_S", value)
    with pytest.raises(ConfigError, match=rf"^HF_FEDSHARD_SETUP_TIMEOUT_S='{value}' must be a number of seconds above "
                       r"0\. Unset it, or set e\.g\. HF_FEDSHARD_SETUP_TIMEOUT_S=300\.$"):  # fmt: skip
        launch_guard.setup_timeout_s()


def test_the_setup_deadline_ends_a_stalled_setup_naming_its_likely_cause(monkeypatch, ended):
    monkeypatch.delenv("HF_FEDSHARD_SETUP_TIMEOUT_S", raising=False)
    assert launch_guard.setup_timeout_s() == 300
    monkeypatch.setenv("HF_FEDSHARD_SETUP_TIMEOUT_S", "0.05")
    with launch_guard.setup_deadline():
        threading.Event().wait(0.5)
    for name, value in {**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(name, value)
    with launch_guard.setup_deadline():
        threading.Event().wait(0.5)
    with launch_guard.setup_deadline():  # ended in time: nothing said
        pass
    threading.Event().wait(0.2)
    assert ended == [
        "the world's process group was not set up within 0.05 s: another rank never started, or started far later: "
        "check every rank's log; if they only start slowly, raise HF_FEDSHARD_SETUP_TIMEOUT_S",
        "the world's process group was not set up within 0.05 s: torchrun restarted it and shared its rendezvous "
        "store with it (pytorch/pytorch#135712): export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where you start torchrun",
    ]


def test_a_restarted_workers_failed_setup_names_the_shared_store_and_other_failures_pass_through(monkeypatch):
    for name, value in {**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(name, value)
    explained = (
        r"^this worker, restarted by torchrun, could not set up the world's process group: .* Export "
        r"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where you start torchrun\. \(Gloo connectFullMesh failed\)$"
    )
    with pytest.raises(ConfigError, match=explained), launch_guard.setup_deadline():
        raise RuntimeError("Gloo connectFullMesh failed\nmore")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    with pytest.raises(RuntimeError, match=r"^Gloo connectFullMesh failed$"), launch_guard.setup_deadline():
        raise RuntimeError("Gloo connectFullMesh failed")

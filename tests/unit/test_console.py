"""A refused setting under a launcher: said once, by rank 0, and the other ranks leave torchrun nothing to list."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from hf_fedshard import errors
from hf_fedshard.errors import ConfigError, exit_on_config_error

from ..launch import REPO


def _refuse() -> None:
    raise ConfigError("fed_sync_steps=0 must be at least 1.")


def test_rank_0_says_a_refused_setting_at_once(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as caught:
        exit_on_config_error(_refuse)
    assert caught.value.code == 2
    assert capsys.readouterr().err == "error: fed_sync_steps=0 must be at least 1.\n"


def test_another_rank_says_it_only_if_rank_0_did_not_fail(monkeypatch, capsys):
    """Rank 0 passed (an error of this rank alone): after the grace this rank says its own error."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(errors, "RANK_0_GRACE_S", 0.01)
    monkeypatch.setattr(errors.signal, "signal", lambda *_: None)  # pytest's own SIGTERM handling stays
    with pytest.raises(SystemExit) as caught:
        exit_on_config_error(_refuse)
    assert caught.value.code == 2
    assert capsys.readouterr().err == "error: fed_sync_steps=0 must be at least 1.\n"


STOPPED_BY_THE_LAUNCHER = """
import time
from hf_fedshard import errors
sleep = time.sleep
errors.time = type("Clock", (), {"sleep": staticmethod(lambda s: (print("waiting", flush=True), sleep(s)))})
errors.exit_on_config_error(lambda: (_ for _ in ()).throw(errors.ConfigError("refused")))
"""


def test_another_rank_stopped_by_the_launcher_leaves_quietly():
    """torchrun SIGTERMs the other ranks once rank 0 failed: they exit 0 and silent, so its report lists rank 0."""
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "RANK": "1"}
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_BY_THE_LAUNCHER], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline() == "waiting\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (0, "")

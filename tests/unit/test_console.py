"""What a user sees in the terminal: a launch mistake named in one line, the averaging's line before the bar."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, ProgressCallback, TrainerCallback

from hf_fedshard import FederationLayout, errors
from hf_fedshard.errors import ConfigError, exit_on_config_error
from hf_fedshard.integrations.callback import add_before_progress

from ..launch import REPO


@pytest.mark.parametrize(
    ("group", "shard", "setting", "processes"),
    [(2, None, "fed_group_size=2", 4), ((2, 1), None, "fed_group_size=2,1", 3), (None, 2, "fed_shard_size=2", 2)],
)
def test_one_process_is_told_to_use_a_launcher(group, shard, setting, processes):
    with pytest.raises(ConfigError, match=rf"^{setting} needs several processes, but this is one") as caught:
        FederationLayout(1, group, shard)
    message = str(caught.value)
    assert f"accelerate launch --num_processes {processes} " in message
    assert f"torchrun --nproc_per_node {processes} " in message
    assert "\n" not in message and "Set --fed_group_size" not in message


@pytest.mark.parametrize(("group", "shard"), [(None, None), (1, None), (1, 1), ((1,), None)])
def test_one_process_of_one_group_still_runs(group, shard):
    assert FederationLayout(1, group, shard).method == "FSDP"


def test_plain_python_on_the_recipe_names_the_launchers():
    """The user's mistake as typed: one line, the recipe's own path in both commands, exit status 2."""
    env_free = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    done = subprocess.run(
        [sys.executable, "recipes/pretrain_clm.py", "--fed_group_size", "2", "--output_dir", "unused"],
        cwd=REPO, env=env_free, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: fed_group_size=2 needs several processes, but this is one (WORLD_SIZE=1): launch it with "
        "`accelerate launch --num_processes 4 recipes/pretrain_clm.py ...` or "
        "`torchrun --nproc_per_node 4 recipes/pretrain_clm.py ...`, not plain `python`."
    ]


def test_the_averaging_callback_goes_before_the_progress_bar():
    """Its on_train_begin says how it averages: before the bar opens, and after the flow callback's decisions."""
    handler = CallbackHandler([DefaultFlowCallback(), ProgressCallback()], None, None, None, None)
    mine = TrainerCallback()
    add_before_progress(handler, mine)
    assert [type(cb) for cb in handler.callbacks] == [DefaultFlowCallback, TrainerCallback, ProgressCallback]


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

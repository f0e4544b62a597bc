"""The forking launcher's own promise (`hf_fedshard.launch`, which tests/preloaded_torchrun.py serves): it uses
torchrun's and CPython's internals, and an upgrade that moves one must fail here, by name, rather than run ranks some
other way; what a fork cannot run is refused in one line."""

from __future__ import annotations

import atexit
import threading

import pytest
import torch.distributed.run

from hf_fedshard import launch


def test_this_torch_and_python_have_what_the_preloaded_launcher_uses():
    launch.require_internals()


@pytest.mark.parametrize(
    ("module", "name", "message"),
    [
        (torch.distributed.run, "run_script_path", None),
        (threading, "_shutdown", "threading._shutdown"),
        (atexit, "_run_exitfuncs", "atexit._run_exitfuncs"),
    ],
)
def test_a_moved_internal_is_named_with_the_way_out(module, name, message, monkeypatch):
    if message is None:  # torchrun's --run-path no longer looks run_script_path up
        code = torch.distributed.run.config_from_args.__code__
        names = tuple("run_script" if n == name else n for n in code.co_names)
        monkeypatch.setattr(torch.distributed.run.config_from_args, "__code__", code.replace(co_names=names))
        message = "config_from_args no longer runs run_script_path"
    else:
        monkeypatch.delattr(module, name)
    with pytest.raises(RuntimeError, match=rf"{message}.*Launch with torchrun instead"):
        launch.require_internals()


@pytest.mark.parametrize(("flag", "argv"), [("-m", ["-m", "train"]), ("--no-python", ["--no-python", "train.sh"])])
def test_what_a_forked_worker_cannot_run_is_refused_in_one_line(flag, argv):
    with pytest.raises(SystemExit, match=rf"^hf_fedshard.launch: {flag} is not supported .* launch with torchrun\.$"):
        launch.refuse_unforkable(["--standalone", "--nproc_per_node", "2", *argv])
    launch.refuse_unforkable(["--nproc_per_node", "2", "train.py", "-m", "x"])  # the script's own -m is its business

"""The test launcher's own promise: tests/preloaded_torchrun.py uses torchrun's and CPython's internals, and an
upgrade that moves one must fail here, by name, rather than run the suite's ranks some other way."""

from __future__ import annotations

import atexit
import threading

import pytest
import torch.distributed.run

from .. import preloaded_torchrun


def test_this_torch_and_python_have_what_the_preloaded_launcher_uses():
    preloaded_torchrun.require_internals()


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
    with pytest.raises(RuntimeError, match=rf"{message}.*HF_FEDSHARD_PLAIN_TORCHRUN=1"):
        preloaded_torchrun.require_internals()

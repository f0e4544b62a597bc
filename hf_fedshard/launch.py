"""``python -m hf_fedshard.launch``: torchrun whose workers are forked from a launcher that imported the libraries once.

A worker torchrun starts (or restarts, ``--max-restarts``) is a fresh interpreter that imports torch, Transformers,
Accelerate and hf_fedshard again: most of a restarted worker's way back into the federation (about 22 of 26 s per
launch on the goodput study's 2 cores, the start-up line's "interpreter and imports"). This launcher imports them
once, in torchrun's own process (the agent), and forks each worker from it: a restarted worker starts with them
loaded. Everything else is torchrun's (``torch.distributed.run.main``: rendezvous, restarts, failure reports, every
flag); only the worker start differs (``--run-path --start-method fork``). Each worker runs its script as
``python script.py`` would: the script's folder first on ``sys.path``, default signal handlers, an uncaught exception
printed and exit status 1, the atexit hooks at the end after the threads are joined.

    python -m hf_fedshard.launch --standalone --nproc_per_node 8 --max-restarts 3 train.py --fed_group_size 8 ...

What a fork changes: every rank shares the launcher's string-hash seed, and the launcher must not have touched the
accelerator (importing torch does not initialise CUDA; the workers do, after the fork, as under torchrun). A script
given as a module (``-m``) or a binary (``--no-python``) is refused: use torchrun for those. It leans on four
internals (torchrun's ``run_script_path`` and ``MultiprocessContext._start``, ``threading._shutdown``,
``atexit._run_exitfuncs``): `require_internals` names any that a torch or Python upgrade moved, before anything
starts.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence

import torch.distributed.run
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

# What a worker of a Trainer script imports anyway (hf_fedshard's Trainer pulls in Transformers, Accelerate, datasets).
PRELOAD = ("accelerate", "transformers", "transformers.models.llama.modeling_llama", "hf_fedshard.integrations.trainer")


def require_internals() -> None:
    """Raise, naming what is missing, if this torch or Python lacks an internal the launcher replaces or calls."""
    missing = []
    if "run_script_path" not in torch.distributed.run.config_from_args.__code__.co_names:
        missing.append("torch.distributed.run.config_from_args no longer runs run_script_path for --run-path")
    if not callable(getattr(MultiprocessContext, "_start", None)):
        missing.append("torch.distributed.elastic.multiprocessing.api.MultiprocessContext._start")
    missing += [f"{m.__name__}.{name}" for m, name in ((threading, "_shutdown"), (atexit, "_run_exitfuncs"))
                if not callable(getattr(m, name, None))]  # fmt: skip
    if missing:
        raise RuntimeError(
            f"hf_fedshard.launch cannot fork its workers with this torch/Python: {'; '.join(missing)}. Launch with "
            "torchrun instead (the same flags)."
        )


def refuse_unforkable(argv: Sequence[str]) -> None:
    """A one-line error for what a forked worker cannot run: a module (``-m``) or a binary (``--no-python``)."""
    args = torch.distributed.run.get_args_parser().parse_args(list(argv))
    if args.module or args.no_python or args.run_path:
        flag = "-m" if args.module else "--no-python" if args.no_python else "--run-path"
        raise SystemExit(
            f"hf_fedshard.launch: {flag} is not supported (each worker is forked to run a script path, as "
            f"`python train.py`). Give the script's path, or launch with torchrun."
        )


def preload(argv: Sequence[str]) -> None:
    """Import what every worker will (`PRELOAD`; torchft too for a ``--fed_transport torchft`` launch)."""
    for name in PRELOAD:
        importlib.import_module(name)
    if "torchft" in argv:
        with contextlib.suppress(ImportError):  # the [elastic] extra is missing: the workers say so themselves
            importlib.import_module("torchft")


_GATE: dict[str, int] = {}  # a pipe each forked worker reads until the launcher, done forking, closes its end


def _fork_all_then_start(start: Callable[[MultiprocessContext], None]) -> Callable[[MultiprocessContext], None]:
    """Wrap ``MultiprocessContext._start`` so that no worker starts before the last one is forked.

    The launcher serves torchrun's rendezvous store on a thread that runs ``getnameinfo`` for every connection it
    accepts, holding glibc's resolver lock: a worker forked while an earlier one connected could inherit that lock
    held and wait for it forever in its first ``getaddrinfo`` (an 8-rank launch hung, about once in ten)."""

    def start_all(context: MultiprocessContext) -> None:
        _GATE["read"], _GATE["write"] = os.pipe()
        try:
            start(context)
        finally:
            os.close(_GATE.pop("write"))
            os.close(_GATE.pop("read"))

    return start_all


def _wait_for_siblings() -> None:
    """In a forked worker: block until every write end of the gate is closed (EOF), its launcher's last."""
    os.close(_GATE["write"])
    os.read(_GATE["read"], 1)
    os.close(_GATE["read"])


def run_script(path: str, *args: str) -> None:
    """Run ``path`` with ``args`` in this (forked) worker as ``python path args`` would."""
    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(","):
        signal.signal(getattr(signal, name.strip()), signal.SIG_DFL)  # the agent's handlers, inherited by the fork
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _wait_for_siblings()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh interpreter's numpy starts from fresh entropy
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # printed by every rank, then exit status 1, as the interpreter does
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise SystemExit(1) from None
    finally:  # a forked worker leaves through os._exit: join the threads, then the atexit hooks, as python does
        threading._shutdown()
        atexit._run_exitfuncs()


def launch(argv: Sequence[str]) -> int:
    """torchrun's own main, its workers forked from this process; the exit status python would give it."""
    torch.distributed.run.run_script_path = run_script  # what --run-path runs in each worker
    MultiprocessContext._start = _fork_all_then_start(MultiprocessContext._start)
    try:
        torch.distributed.run.main(["--run-path", "--start-method", "fork", *argv])
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    require_internals()
    refuse_unforkable(argv)
    preload(argv)
    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())

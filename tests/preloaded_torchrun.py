"""torchrun whose workers are forked from a launcher that has already imported torch, Transformers and hf_fedshard.

Every check script imports the same libraries, about 12 CPU-seconds per rank on CI's 2 cores: with ~500 ranks
started, most of the suite's time. Here they are imported once per launch. The agent, rendezvous, restarts and
failure reports are torchrun's own (`torch.distributed.run.main`); only the worker start differs
(``--run-path --start-method fork``), and each worker runs its script as ``python script.py`` would: the
script's folder first on ``sys.path``, default signal handlers, an uncaught exception printed and exit status 1
(not torchrun's error file, which only the first failed rank's report would show), and the atexit hooks at the end
after the threads are joined (with ``sys.last_value`` set first on an uncaught exception, as the interpreter does).
What a fork cannot give: every rank shares the launcher's string-hash seed (set and dict orders of strings agree
across ranks, where a real launch could disagree). A check that needs a fresh interpreter's own exit
(tests/scripts/gloo_exit.py) or a restart's real start-up time is launched with plain torchrun instead.

It leans on three internals: torchrun's ``run_script_path`` (what ``--run-path`` runs), ``threading._shutdown`` and
``atexit._run_exitfuncs``. `require_internals` checks them before anything starts (tests/unit/test_launchers.py runs
it too), so an upgrade that moves them fails loudly; ``HF_FEDSHARD_PLAIN_TORCHRUN=1`` then runs the suite on plain
torchrun (fresh interpreters, slower) until the launcher is adapted.

    python tests/preloaded_torchrun.py --standalone --nproc_per_node 4 /abs/path/script.py --arg value
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys
import threading

import torch.distributed.run
from accelerate import Accelerator  # noqa: F401 (preloaded for the workers)
from transformers import LlamaForCausalLM, Trainer  # noqa: F401 (preloaded for the workers)

import hf_fedshard.integrations.trainer  # noqa: F401 (preloaded for the workers)


def require_internals() -> None:
    """Raise, naming what is missing, if this torch or Python lacks an internal the launcher replaces or calls."""
    missing = []
    if "run_script_path" not in torch.distributed.run.config_from_args.__code__.co_names:
        missing.append("torch.distributed.run.config_from_args no longer runs run_script_path for --run-path")
    missing += [f"{m.__name__}.{name}" for m, name in ((threading, "_shutdown"), (atexit, "_run_exitfuncs"))
                if not callable(getattr(m, name, None))]  # fmt: skip
    if missing:
        raise RuntimeError(
            f"tests/preloaded_torchrun.py cannot fork its workers here: {'; '.join(missing)}. Run the tests with "
            "HF_FEDSHARD_PLAIN_TORCHRUN=1 (plain torchrun) and adapt the launcher to this torch/Python."
        )


def run_script(path: str, *args: str) -> None:
    """Run ``path`` with ``args`` in this (forked) worker as ``python path args`` would."""
    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(","):
        signal.signal(getattr(signal, name.strip()), signal.SIG_DFL)  # the agent's handlers, inherited by the fork
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh interpreter's numpy starts from fresh entropy
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(path)
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


if __name__ == "__main__":
    require_internals()
    if "torchft" in sys.argv:
        import torchft  # noqa: F401 (preloaded for the workers of a torchft launch)
    torch.distributed.run.run_script_path = run_script  # what --run-path runs in each worker
    torch.distributed.run.main(["--run-path", "--start-method", "fork", *sys.argv[1:]])

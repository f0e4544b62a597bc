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

A forked worker waits until its launcher has forked all of them (`_fork_all_then_start`): the launcher serves
torchrun's rendezvous store on a thread that runs ``getnameinfo`` for every connection it accepts, holding glibc's
resolver lock, so a worker forked while an earlier one connected could inherit that lock held and wait for it
forever in its first ``getaddrinfo`` (an 8-rank launch hung before its first step, about once in ten on a loaded
machine).

It leans on four internals: torchrun's ``run_script_path`` (what ``--run-path`` runs) and
``MultiprocessContext._start`` (which forks the workers), ``threading._shutdown`` and ``atexit._run_exitfuncs``.
`require_internals` checks them before anything starts (tests/unit/test_launchers.py runs it too), so an upgrade
that moves them fails loudly; ``HF_FEDSHARD_PLAIN_TORCHRUN=1`` then runs the suite on plain
torchrun (fresh interpreters, slower) until the launcher is adapted.

    python tests/preloaded_torchrun.py --standalone --nproc_per_node 4 /abs/path/script.py --arg value

Even that import (about 6 CPU-seconds for the launcher itself) is paid once per test session: with ``--serve PATH``
the launcher imports once and waits on a Unix socket; each launch is then ``python tests/launch_client.py PATH
torchrun-args…``, a stdlib-only client that hands its argv, environment, folder and stdin/stdout/stderr to the
server, which forks a launcher for it (in a session of its own, below a keeper: `benchmarks.harness.process_tree`)
and sends back the keeper's pid and the launch's exit status. The server forks from a clean state (nothing but the
imports has run in it), never from the pytest process.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from collections.abc import Callable

import torch.distributed.run
from accelerate import Accelerator  # noqa: F401 (preloaded for the workers)
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext
from transformers import LlamaForCausalLM, Trainer  # noqa: F401 (preloaded for the workers)

import hf_fedshard.integrations.trainer  # noqa: F401 (preloaded for the workers)
from benchmarks.harness import process_tree


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
            f"tests/preloaded_torchrun.py cannot fork its workers here: {'; '.join(missing)}. Run the tests with "
            "HF_FEDSHARD_PLAIN_TORCHRUN=1 (plain torchrun) and adapt the launcher to this torch/Python."
        )


_GATE: dict[str, int] = {}  # a pipe each forked worker reads until the launcher, done forking, closes its end


def _fork_all_then_start(start: Callable[[MultiprocessContext], None]) -> Callable[[MultiprocessContext], None]:
    """Wrap ``MultiprocessContext._start`` so that no worker starts before the last one is forked (see above)."""

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


def launch(argv: list[str]) -> int:
    """torchrun's own main, its workers forked from this process; the exit status python would give it."""
    torch.distributed.run.run_script_path = run_script  # what --run-path runs in each worker
    MultiprocessContext._start = _fork_all_then_start(MultiprocessContext._start)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # tests.launch.finish asks for stacks; workers inherit it
    try:
        torch.distributed.run.main(["--run-path", "--start-method", "fork", *argv])
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """A request of `tests/launch_client.py`: its length-prefixed JSON (argv, env, cwd, client pid) and its 3 fds."""
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    (size,) = struct.unpack("!Q", head)
    body = b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), fds


def _start(conn: socket.socket, server: socket.socket) -> int:
    """Fork a launcher for one request; in the child, become what ``python preloaded_torchrun.py argv`` would be."""
    request, fds = _receive(conn)
    sys.stdout.flush()
    sys.stderr.flush()
    server_pid, pid = os.getpid(), os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        return pid
    code = 1
    try:
        server.close()
        conn.close()
        os.setsid()  # the client's session is not ours: a launch is killed by its process tree (tests.launch)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        process_tree.become_subreaper()  # this process keeps the launch: everything below it, orphans included
        launcher = os.fork()
        if launcher:
            code = process_tree.keep(launcher, server_pid)
        else:
            sys.argv = [__file__, *request["argv"]]
            code = launch(request["argv"])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(path: str) -> None:
    """Accept launches on the Unix socket ``path`` until the parent (the test session) is gone."""
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    clients: dict[int, socket.socket] = {}  # launcher pid: its client's connection
    while os.getppid() == parent:
        if select.select([server], [], [], 0.1)[0]:
            conn, _ = server.accept()
            clients[_start(conn, server)] = conn
        while clients:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            conn = clients.pop(pid)
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


if __name__ == "__main__":
    require_internals()
    if "torchft" in sys.argv or sys.argv[1:2] == ["--serve"]:
        with contextlib.suppress(ImportError):  # the [elastic] extra
            import torchft  # noqa: F401 (preloaded for the workers of a torchft launch)
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        sys.exit(launch(sys.argv[1:]))

"""Every process a launch starts, found and stopped: the one process-tree cleanup of the studies and the tests.

torchrun starts each worker in a session of its own, so a launch's process group does not hold its workers, and a
worker whose torchrun died is re-parented to init, out of reach of a walk down from the launcher. Here a launch
(`popen`) runs below a *keeper*: this file run as a script, standard library only, which makes itself its children's
subreaper (``PR_SET_CHILD_SUBREAPER``), so that every process the launch starts, new sessions and orphans included,
stays below it. The keeper waits for the command; as soon as it is asked to (SIGTERM, SIGINT, SIGHUP) or finds its
owner gone (a study or a test SIGKILLed), it stops every process below it: SIGTERM, a grace period, SIGKILL, and
reaps them. Once the command ended, what it left behind (workers whose torchrun died) gets the grace period to end by
itself first. Its exit status is the command's (128 + N after signal N, as a shell reports it).

- `popen` starts a command under a keeper (in a session of its own); `run` waits for it, with a timeout;
- `stop` / `stop_all` ask keepers to stop their trees (with the grace) and make sure, SIGKILLing what is left;
- `kill` SIGKILLs a launch's whole tree at once (the fault of a lost node);
- `descendants` lists the processes below a pid, from /proc; `keep` is the keeper's loop (tests/preloaded_torchrun.py
  runs it in the processes it forks).

    python benchmarks/harness/process_tree.py [--owner PID] [--grace-s 5] -- COMMAND ARGS...
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

KEEPER = Path(__file__).resolve()
GRACE_S = 5.0  # between SIGTERM and SIGKILL: torchrun forwards SIGTERM to its workers and waits for them
POLL_S = 0.05  # while processes are being stopped
OWNER_POLL_S = 0.5  # how soon a keeper finds its owner gone
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def popen(argv: Sequence[str], grace_s: float = GRACE_S, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(argv, **kwargs)`` below a keeper, in a session of its own: the returned process is the
    keeper, whose exit status is the command's; `stop` or `kill` it to end everything the command started."""
    keeper = [sys.executable, "-S", str(KEEPER), "--owner", str(os.getpid()), "--grace-s", str(grace_s), "--",
              *map(str, argv)]  # fmt: skip
    return subprocess.Popen(keeper, start_new_session=True, **kwargs)


def run(argv: Sequence[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    """`popen` and wait (output captured as ``kwargs`` ask); past ``timeout_s`` every process is stopped and
    ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    proc = popen(argv, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException:  # past the timeout, or this process interrupted: nothing of the command stays
        stop(proc)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def stop(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """Stop a `popen` launch and everything below it: SIGTERM to its keeper (which gives its tree ``grace_s``), then
    SIGKILL to whatever is left should the keeper not be done a little after that."""
    stop_all([proc], grace_s)


def stop_all(procs: Sequence[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """`stop` several launches at once: one grace period for all."""
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s + 5.0
    while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for proc in alive:
        if proc.poll() is None:
            kill(proc)


def kill(proc: subprocess.Popen) -> int:
    """SIGKILL a launch and every process below it at once (nothing is asked to stop); how many processes."""
    pids = kill_pids([proc.pid])
    proc.wait()
    return len(pids)


def kill_pids(roots: Sequence[int], adopted: dict[int, int] | None = None) -> list[int]:
    """SIGKILL every process below each of ``roots`` (``adopted``: as `descendants`), then the roots (below first: a
    keeper killed first would leave its tree to init); the pids signalled."""
    children = process_children()
    pids = [pid for root in roots for pid in descendants(root, adopted, children)] + list(roots)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def process_children() -> dict[int, list[int]]:
    """Every process's children, read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return children


def descendants(
    pid: int, adopted: dict[int, int] | None = None, children: dict[int, list[int]] | None = None
) -> list[int]:
    """Every process below ``pid`` (children first), read from /proc.

    ``adopted`` adds parent → child links /proc does not show (tests.launch: a launch client's launcher is forked by
    the session's launch server, not by the client)."""
    children = {k: list(v) for k, v in (children or process_children()).items()}
    for parent, child in (adopted or {}).items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def cmdline(pid: int) -> bytes:
    """A process's command line (NUL-separated), empty once it is gone."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def become_subreaper() -> None:
    """Make this process the subreaper of everything below it (Linux 3.4+): orphans are re-parented here."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def keep(child: int, owner: int, grace_s: float = GRACE_S, client: int | None = None) -> int:
    """The keeper's loop, in a subreaper whose child ``child`` runs the command: wait for it, or for a stop signal,
    or for this process's parent to be other than ``owner`` (which started it: gone, maybe before this loop began),
    or for process ``client`` (which waits for the command elsewhere: tests/launch_client.py) to end; then stop
    everything below this process (SIGKILL at once where the client ended: it was killed, and `kill` of a launch
    kills every process of it); the exit status to leave with."""
    asked: list[int] = []
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: asked.append(signum))
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # tests.launch.dump_stacks asks every process below for its stacks
    woken, wake = os.pipe()  # a signal writes here: the wait below ends at once on a stop request
    for end in (woken, wake):
        os.set_blocking(end, False)
    signal.set_wakeup_fd(wake)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    ended = os.pidfd_open(child)  # readable once the command ended
    gone = [os.pidfd_open(client)] if client is not None else []  # readable once the client ended (killed)
    code = None
    while code is None and not asked and os.getppid() == owner:
        ready = select.select([ended, woken, *gone], [], [], OWNER_POLL_S)[0]  # an end, a signal, a look at the owner
        with contextlib.suppress(BlockingIOError):
            os.read(woken, 512)
        code = _reap(child)
        if code is None and set(ready) & set(gone):  # as if the launch had been killed with its client (`kill`)
            kill_pids(descendants(os.getpid()))
            code = _reap_after_stopping(child, grace_s)
            return code if code is not None else 128 + signal.SIGKILL
    if code is None:  # asked to stop, or orphaned: the command too gets its SIGTERM and grace
        code = _reap_after_stopping(child, grace_s)
        return code if code is not None else 128 + (asked[0] if asked else signal.SIGTERM)
    deadline = time.monotonic() + grace_s  # what the command left behind (orphaned workers) may end by itself first
    while descendants(os.getpid()) and time.monotonic() < deadline and not asked:
        _reap(None)
        time.sleep(POLL_S)
    _reap_after_stopping(None, grace_s)
    return code


def _reap(child: int | None) -> int | None:
    """Reap every child that has ended (adopted orphans too); ``child``'s exit status if it was one of them."""
    code = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return code
        if pid == 0:
            return code
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            code = code if code >= 0 else 128 - code


def _reap_after_stopping(child: int | None, grace_s: float) -> int | None:
    """SIGTERM everything below this process, SIGKILL what is left after ``grace_s``, reap it all; ``child``'s exit
    status if it ended meanwhile."""
    code = None
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for pid in descendants(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while True:
            reaped = _reap(child)
            code = reaped if reaped is not None else code
            if not descendants(os.getpid()) or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        if not descendants(os.getpid()):
            break
    return code


def main(argv: list[str]) -> int:
    options = {"--owner": os.getppid(), "--grace-s": GRACE_S}
    while argv[:1] and argv[0] in options:
        options[argv[0]], argv = type(options[argv[0]])(argv[1]), argv[2:]
    if argv[:1] != ["--"] or len(argv) < 2:
        print("usage: process_tree.py [--owner PID] [--grace-s S] -- COMMAND ARGS...", file=sys.stderr)
        return 2
    become_subreaper()
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # held until `keep` handles them: none is lost
    try:
        child = os.posix_spawnp(argv[1], argv[1:], os.environ, setsigmask=(), setsigdef=_STOP_SIGNALS)
    except OSError as err:
        print(f"process_tree.py: cannot start {argv[1]!r}: {err}", file=sys.stderr)
        return 127
    return keep(child, options["--owner"], options["--grace-s"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The test suite's launcher: `hf_fedshard.launch` (torchrun whose workers are forked from a launcher that imported
torch, Transformers and hf_fedshard once), served once per test session.

Every check script imports the same libraries, about 12 CPU-seconds per rank on CI's 2 cores: with ~500 ranks
started, most of the suite's time. Here they are imported once. What a fork cannot give: every rank shares the
launcher's string-hash seed (set and dict orders of strings agree across ranks, where a real launch could
disagree). A check that needs a fresh interpreter's own exit (tests/scripts/gloo_exit.py) or a restart's real
start-up time is launched with plain torchrun instead. `hf_fedshard.launch.require_internals` checks the internals
the fork leans on before anything starts (tests/unit/test_launchers.py runs it too), so an upgrade that moves them
fails loudly; ``HF_FEDSHARD_PLAIN_TORCHRUN=1`` then runs the suite on plain torchrun (fresh interpreters, slower).

    python tests/preloaded_torchrun.py --standalone --nproc_per_node 4 /abs/path/script.py --arg value

Even that import (about 6 CPU-seconds for the launcher itself) is paid once per test session: with ``--serve PATH``
the launcher imports once and waits on a Unix socket; each launch is then ``python tests/launch_client.py PATH
torchrun-args…``, a stdlib-only client that hands its argv, environment, folder and stdin/stdout/stderr to the
server, which forks a launcher for it (in a session of its own, below a keeper: `benchmarks.harness.process_tree`)
and sends back the keeper's pid and the launch's exit status; the launch runs in the client's network, mount and
host-name namespaces and CPU cgroup (`join_client`: a study's node launches through it), and is killed with its
client. The server forks from a clean state (nothing but the imports has run in it), never from the pytest process.
SIGUSR1 prints every thread's stack (`tests.launch.finish` asks for them before it kills a hung launch).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import select
import signal
import socket
import struct
import sys
from pathlib import Path

from benchmarks.harness import process_tree
from hf_fedshard import launch as forked


def launch(argv: list[str]) -> int:
    """hf_fedshard.launch's torchrun (workers forked from this process), with stacks on SIGUSR1 for the tests."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # tests.launch.finish asks for stacks; workers inherit it
    return forked.launch(argv)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """A request of `tests/launch_client.py`: its length-prefixed JSON (argv, env, cwd, client pid) and its 3 fds."""
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    (size,) = struct.unpack("!Q", head)
    body = b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), fds


def _cgroups(pid: str) -> dict[tuple[str, str], str]:
    """Process ``pid``'s cgroup per (hierarchy, controllers), from /proc/PID/cgroup."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return {(h, c): path for h, c, path in (line.split(":", 2) for line in lines)}


def join_client(pid: int) -> None:
    """Join the cgroups and the mount, network and host-name namespaces of process ``pid`` where they differ from
    this process's: a study's launch on an emulated node is ``ip netns exec NODE ... launch_client.py`` (below a CPU
    quota's cgroup), and its torchrun must run where that client runs, as ``ip netns exec NODE torchrun`` would.

    The cgroups first: the node's mount namespace has a fresh ``/sys`` without them. Needs root where they differ.
    """
    ours = _cgroups("self")
    for (hierarchy, controllers), path in _cgroups(str(pid)).items():
        if controllers in ("cpu", "cpuacct") and ours.get((hierarchy, controllers)) != path:  # cgroup v1 quotas
            Path(f"/sys/fs/cgroup/{controllers}{path}/cgroup.procs").write_text(str(os.getpid()))
    libc = ctypes.CDLL(None, use_errno=True)
    joins = [kind for kind in ("mnt", "net", "uts")
             if os.stat(f"/proc/{pid}/ns/{kind}").st_ino != os.stat(f"/proc/self/ns/{kind}").st_ino]  # fmt: skip
    opened = [(kind, os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)) for kind in joins]  # before the mount ns moves
    for kind, fd in opened:
        if libc.setns(fd, 0) != 0:
            raise OSError(ctypes.get_errno(), f"setns into process {pid}'s {kind} namespace")
        os.close(fd)


def _start(conn: socket.socket, server: socket.socket) -> int:
    """Fork a launcher for one request; in the child, become what ``python preloaded_torchrun.py argv`` would be."""
    request, fds = _receive(conn)
    client, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
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
        join_client(client)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        process_tree.become_subreaper()  # this process keeps the launch: everything below it, orphans included
        launcher = os.fork()
        if launcher:
            code = process_tree.keep(launcher, server_pid, client=client)  # a killed client ends its launch
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
    forked.require_internals()
    forked.preload(["torchft"] if sys.argv[1:2] == ["--serve"] else sys.argv)  # a server's launches may need it
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        sys.exit(launch(sys.argv[1:]))

"""`benchmarks.harness.process_tree`, the one process-tree cleanup of the studies and tests, on small shell trees (no
torch): whatever a launch starts, in a session of its own or orphaned, ends with it; its exit status is the
command's; a stop, a timeout or the death of its owner (even by SIGKILL) stops all of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.harness import process_tree

# A tree as torchrun makes one: a child in a session of its own, and one whose parent leaves before it.
TREE = "setsid sleep 300 & (sleep 300 &) ; echo $! > {pids}; {rest}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _sleepers(marker: Path) -> list[int]:
    """The ``sleep 300`` processes whose environment names ``marker`` (this test's own)."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            ours = f"TREE_MARKER={marker}".encode() in env.read_bytes()
            if ours and (env.parent / "cmdline").read_bytes().startswith(b"sleep\0"):
                found.append(int(env.parent.name))
        except OSError:
            pass
    return found


def _wait_for_sleepers(marker: Path, count: int = 3, within_s: float = 30.0) -> list[int]:
    """Until the tree of ``marker`` runs its ``count`` sleeps (or ``within_s`` passed); their pids."""
    deadline = time.monotonic() + within_s
    while len(_sleepers(marker)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return _sleepers(marker)


def _gone(marker: Path, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in _sleepers(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in _sleepers(marker))


@pytest.fixture
def tree(tmp_path):
    """The command of a tree tagged with this test's marker, and the marker."""
    env = {**os.environ, "TREE_MARKER": str(tmp_path)}
    return lambda rest: (["/bin/sh", "-c", TREE.format(pids=tmp_path / "pid", rest=rest)], env, tmp_path)


def test_the_exit_status_is_the_commands_and_what_it_left_behind_ends_with_it(tree):
    command, env, marker = tree("exit 3")
    done = process_tree.run(command, 30, env=env, grace_s=0.5)
    assert done.returncode == 3
    assert _gone(marker, 2.0)
    killed = process_tree.run(["/bin/sh", "-c", "kill -9 $$"], 30)
    assert killed.returncode == 128 + signal.SIGKILL  # as a shell reports a command killed by a signal


def test_a_timeout_stops_the_whole_tree_and_raises(tree):
    command, env, marker = tree("sleep 300")
    with pytest.raises(subprocess.TimeoutExpired):
        process_tree.run(command, 1.0, env=env, grace_s=0.5)
    assert _gone(marker, 2.0)


def test_stop_gives_the_grace_to_a_command_that_handles_sigterm(tmp_path):
    trap = "trap 'echo stopping; exit 7' TERM; echo ready; while true; do sleep 0.05; done"
    proc = process_tree.popen(["/bin/sh", "-c", trap], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    process_tree.stop(proc, grace_s=5)
    assert proc.returncode == 7 and proc.stdout.read() == "stopping\n"


def test_the_owners_death_even_by_sigkill_stops_the_tree(tree):
    command, env, marker = tree("sleep 300")
    owner = subprocess.Popen([sys.executable, "-c", "import sys, time; from benchmarks.harness import process_tree; "
                              f"process_tree.popen({command!r}, env={env!r}, grace_s=0.5); time.sleep(300)"],
                             cwd=Path(process_tree.__file__).parents[2])  # fmt: skip
    assert len(_wait_for_sleepers(marker)) == 3
    owner.kill()
    owner.wait()
    assert _gone(marker, 3.0)


def test_kill_reaches_a_whole_tree_at_once_and_counts_it(tree):
    command, env, marker = tree("sleep 300")
    proc = process_tree.popen(command, env=env)
    _wait_for_sleepers(marker)
    assert process_tree.kill(proc) == 5  # the keeper, the shell and three sleeps
    assert proc.returncode == -signal.SIGKILL and _gone(marker, 1.0)


# A keeper as tests/preloaded_torchrun.py runs one: the launch is its child, a client elsewhere waits for it.
KEEP_FOR_CLIENT = """
import os, sys
from benchmarks.harness import process_tree
process_tree.become_subreaper()
child = os.fork()
if child == 0:
    os.execv("/bin/sh", ["/bin/sh", "-c", sys.argv[2]])
sys.exit(process_tree.keep(child, os.getppid(), grace_s=30, client=int(sys.argv[1])))
"""


def test_a_launch_kept_for_a_client_is_killed_with_it_at_once(tree):
    """The launch server keeps each launch for its client (tests/launch_client.py): a study that SIGKILLs a node's
    launch kills the client, and the whole launch goes at once (SIGKILL, no 30 s grace), as `kill` of a launch of its
    own would; the keeper's status says so."""
    command, env, marker = tree("sleep 300")
    client = subprocess.Popen(["sleep", "300"])
    keeper = subprocess.Popen([sys.executable, "-c", KEEP_FOR_CLIENT, str(client.pid), command[2]], env=env,
                              cwd=Path(process_tree.__file__).parents[2])  # fmt: skip
    try:
        assert len(_wait_for_sleepers(marker)) == 3
        client.kill()
        client.wait()
        assert keeper.wait(timeout=10) == 128 + signal.SIGKILL
        assert _gone(marker, 1.0)
    finally:
        keeper.kill()
        client.kill()

"""The emulated cluster's harness removes every namespace and link it made: after a failure, a timeout, an
exception, Ctrl-C, SIGTERM, and (on the next start) after SIGKILL; with three tiers, each tier's counters count
what crossed it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.harness.netns import RACK_NETNS_ENV, Cluster, list_namespaces

from ..launch import REPO

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("tc") is None, reason="network namespaces need root and iproute2"
    ),
]


def host_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def assert_removed(names: list[str]) -> None:
    left = set(names) & set(list_namespaces())
    assert not left, f"namespaces left behind: {left}"
    for device in ("uplink", "port0", "trunk", "rack0"):
        assert device not in host_links()


def test_cluster_is_two_tier_and_counts_bytes():
    with Cluster(2, rate_mbit=100) as cluster:
        names = list(cluster.created)
        assert len(names) == 3  # two nodes and the switch
        before = cluster.counters(0)["tx_bytes"]
        probe = cluster.probe_goodput(0, 1, seconds=1.0)
        sent = cluster.counters(0)["tx_bytes"] - before
        assert 60 < probe["goodput_mbit"] <= 100  # shaped to the link rate, not the host's loopback speed
        assert sent > probe["goodput_mbit"] * 1e6 / 8 * 0.8  # the probe's bytes went through node 0's uplink
    assert_removed(names)


def test_three_tier_cluster_counts_bytes_per_tier(tmp_path):
    """2 racks × 2 nodes, 1000 Mbit/s node links, 100 Mbit/s rack uplinks: traffic inside a rack never touches
    its trunk and runs at the node rate; traffic between racks crosses both, at the rack rate."""
    with Cluster(4, rate_mbit=1000, racks=2, rack_rate_mbit=100) as cluster:
        names = list(cluster.created)
        assert len(names) == 7  # four nodes, two rack switches, the core
        for src, dst, low, high, crosses in [(0, 1, 600, 1000, False), (0, 2, 60, 100, True)]:
            node, rack = cluster.counters(src)["tx_bytes"], cluster.rack_counters(0)["tx_bytes"]
            probe = cluster.probe_goodput(src, dst, seconds=1.0)
            sent = cluster.counters(src)["tx_bytes"] - node
            rack_sent = cluster.rack_counters(0)["tx_bytes"] - rack
            assert low < probe["goodput_mbit"] <= high, (src, dst, probe)
            assert sent > probe["goodput_mbit"] * 1e6 / 8 * 0.8
            assert (rack_sent > 0.95 * sent) if crosses else (rack_sent < 0.01 * sent), (src, dst, sent, rack_sent)
        logs = [tmp_path / f"node{i}.log" for i in range(4)]
        echo = ["sh", "-c", f'echo "${RACK_NETNS_ENV}"']
        assert cluster.run([echo] * 4, {}, logs, 60) == [0] * 4
        assert [log.read_text().strip() for log in logs] == [cluster.switch(0), "", cluster.switch(1), ""]
    assert_removed(names)


@pytest.mark.parametrize("racks", [1, 2])
def test_failed_run_stops_the_other_nodes_and_leaves_nothing(tmp_path, racks):
    logs = [tmp_path / f"node{i}.log" for i in range(4)]
    with Cluster(4, racks=racks, rack_rate_mbit=100) as cluster:
        names = list(cluster.created)
        start = time.monotonic()
        fail = [sys.executable, "-c", "raise SystemExit(3)"]
        codes = cluster.run([["sleep", "120"], fail, ["sleep", "120"], ["sleep", "120"]], {}, logs, 60)
        assert codes[1] == 3 and codes[0] != 0 and codes[2] != 0  # the others were killed, not waited for
        assert time.monotonic() - start < 30
    assert_removed(names)


def test_timeout_and_exception_leave_nothing(tmp_path):
    with pytest.raises(TimeoutError, match="did not finish within 1 s"), Cluster(2) as cluster:
        names = list(cluster.created)
        cluster.run([["sleep", "120"], ["sleep", "120"]], {}, [tmp_path / "a", tmp_path / "b"], timeout_s=1)
    assert_removed(names)
    with pytest.raises(ZeroDivisionError), Cluster(2) as cluster:
        names = list(cluster.created)
        proc = cluster.launch(0, ["sleep", "120"], {}, tmp_path / "c")
        _ = 1 / 0
    assert proc.poll() is not None
    assert_removed(names)


HARNESS = """
import sys, time
from pathlib import Path
from benchmarks.harness.netns import Cluster, handle_termination
with handle_termination(), Cluster(4, racks=2, rack_rate_mbit=100) as cluster:
    sleeper = cluster.launch(0, ["sleep", "120"], {}, Path(sys.argv[1]))
    print("ready", sleeper.pid, flush=True)
    time.sleep(120)
"""


def start_harness(tmp_path) -> tuple[subprocess.Popen, int]:
    """A harness process holding a cluster with one process launched in it; returns it and that process's id."""
    proc = subprocess.Popen([sys.executable, "-c", HARNESS, str(tmp_path / "sleep.log")], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    word, pid = proc.stdout.readline().split()
    assert word == "ready"
    assert any(name.startswith(f"fsb{proc.pid}") for name in list_namespaces())
    return proc, int(pid)


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout[:1] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_harness_cleans_up(tmp_path, sig):
    proc, sleeper = start_harness(tmp_path)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert not [name for name in list_namespaces() if name.startswith(f"fsb{proc.pid}")]
    assert not running(sleeper)


def test_namespaces_of_a_killed_harness_are_removed_on_next_start(tmp_path):
    proc, sleeper = start_harness(tmp_path)
    proc.kill()  # SIGKILL: no chance to clean up
    proc.wait(timeout=30)
    stale = [name for name in list_namespaces() if name.startswith(f"fsb{proc.pid}")]
    assert len(stale) == 7  # four nodes, two rack switches and the core of a three-tier cluster
    deadline = time.monotonic() + 15  # what it launched: stopped by the launch's keeper, which saw its owner go
    while running(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(sleeper)
    with Cluster(2) as cluster:
        names = list(cluster.created)
        assert not set(stale) & set(list_namespaces())
    assert_removed(names)

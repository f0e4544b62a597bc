"""An emulated two- or three-tier cluster on one Linux machine: a network namespace per node, rate-limited links.

Topology, all inside namespaces this module creates (nothing is added to the host's own network)::

    node i   namespace fsb<pid>n<i>:   lo, and "uplink" (10.213.0.<i+1>/24) with a tbf qdisc at the node rate
    rack r   namespace fsb<pid>sw<r>:  bridge "br0" whose ports "port<i>" (one per node of the rack) each have a
                                       tbf qdisc at the node rate, and (three tiers) "trunk" at the rack rate
    core     namespace fsb<pid>core:   (three tiers only) bridge "br0" whose ports "rack<r>" have a tbf qdisc at
                                       the rack rate

Each veth pair (uplink of node i <-> port<i> of its rack's switch) is a full-duplex link of ``rate_mbit`` in
each direction: the node's uplink shapes what the node sends, the switch port what it receives. With more than
one rack, each rack's switch reaches the core switch through a veth pair (trunk <-> rack<r>) of
``rack_rate_mbit`` each way. All nodes share one subnet; the bridges forward between them.

Tiers: ranks of one node talk through their namespace's own stack and never touch a veth (the fast tier);
ranks of different nodes of a rack cross two node links; ranks of different racks cross two node links and
two rack links (the slowest tier). Byte counters: a node's uplink (``/sys/class/net/uplink/statistics`` in its
namespace) counts all it sends to other nodes; a rack's trunk counts all that rack sends to other racks.

Token-bucket size: ``tc-tbf(8)`` says the burst must be at least rate / HZ, or the qdisc cannot reach its
rate; we use 10 ms of traffic (right for any HZ >= 100). ``netem`` (delay, loss) is not available here.

With ``hostnames``, every node also gets a host name of its own (its namespace's name, set in a UTS namespace per
launch) that every node resolves to its uplink's address (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` puts
over ``/etc/hosts``): software that advertises ``socket.gethostname()`` to its peers (torchft's managers) is
reachable across nodes, where the machine's own name would resolve to each node's loopback.

Every namespace is removed on exit of the ``with`` block, also on an exception, Ctrl-C or SIGTERM (see
:func:`handle_termination`): processes launched in the cluster are killed first, since a namespace with
processes inside outlives its name. Namespaces of an earlier run whose process died are removed on start.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import process_tree, torchrun_command

SUBNET = "10.213.0"
UPLINK = "uplink"
TRUNK = "trunk"  # a rack's link to the core switch, in the rack switch's namespace
RACK_NETNS_ENV = "FEDSHARD_RACK_NETNS"  # set for the first node of each rack: where its rack's trunk lives
BURST_S = 0.010  # token bucket of 10 ms of traffic: tc-tbf(8) needs at least rate / HZ
QUEUE_LATENCY_MS = 50  # tbf drops what would wait longer than this in its queue
_NAME = re.compile(r"^fsb(\d+)(?:n\d+|sw\d+|core)$")
Wrap = Callable[[int, list[str]], list[str]]  # (node, its whole command) -> the command to run instead


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def list_namespaces() -> list[str]:
    """Names of all network namespaces on the machine (ours have the ``fsb<pid>`` prefix)."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a leftover's owner that died leaves it to be cleaned up)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Remove namespaces left by an earlier run of this module whose process is gone (e.g. killed by SIGKILL)."""
    removed = []
    for name in list_namespaces():
        match = _NAME.match(name)
        if match and int(match.group(1)) != os.getpid() and not alive(int(match.group(1))):
            _ip("netns", "del", name, check=False)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
            removed.append(name)
    return removed


@contextlib.contextmanager
def handle_termination() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into ``SystemExit`` and SIGINT into ``KeyboardInterrupt`` so ``finally`` runs. SIGINT
    too: a process started in the background by a shell inherits it ignored, and Python then leaves it so."""

    def _exit(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, _exit) for sig in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def read_counters(namespace: str, device: str) -> dict[str, int]:
    """Bytes and packets ``device`` has sent and received, read inside ``namespace`` (the kernel's counters)."""
    stats = f"/sys/class/net/{device}/statistics"
    names = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
    cmd = ["ip", "netns", "exec", namespace, "cat", *(f"{stats}/{n}" for n in names)]
    values = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout.split()
    return dict(zip(names, map(int, values), strict=True))


@dataclass
class Cluster:
    """``nodes`` namespaces in ``racks`` racks of switches, links shaped per tier; use as a context manager.

    Args:
        nodes: number of emulated nodes (one namespace each), split into ``racks`` racks of contiguous nodes.
        rate_mbit: link rate between a node and its rack's switch, in Mbit/s, in each direction; ``None``: links as
            fast as the host (no qdisc), for runs that check what a multi-node launch computes, not its speed.
        racks: 1 is a two-tier cluster (one switch); more adds a core switch and a third tier.
        rack_rate_mbit: link rate between a rack's switch and the core, Mbit/s each way (``racks > 1`` only).
        hostnames: give each node a host name of its own that every node resolves (see the module's docstring).
    """

    nodes: int
    rate_mbit: float | None = 100.0
    racks: int = 1
    rack_rate_mbit: float | None = None
    hostnames: bool = False
    prefix: str = field(default_factory=lambda: f"fsb{os.getpid()}")
    created: list[str] = field(default_factory=list, init=False)
    _procs: list[subprocess.Popen] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.racks < 1 or self.nodes % self.racks:
            raise ValueError(f"racks={self.racks} must divide nodes={self.nodes}: racks hold equal numbers of nodes.")
        if self.nodes < 2:
            raise ValueError(f"nodes={self.nodes}: a cluster needs at least 2 nodes.")
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(
                f"rate_mbit={self.rate_mbit}: the link rate must be positive (Mbit/s), or None (unshaped)."
            )
        if self.racks > 1 and not (self.rack_rate_mbit or 0) > 0:
            raise ValueError(f"rack_rate_mbit={self.rack_rate_mbit}: racks={self.racks} needs a positive rack rate.")
        if os.geteuid() != 0:
            raise PermissionError("Network namespaces need root: run the benchmark as root (CI runs as root).")

    @property
    def nodes_per_rack(self) -> int:
        return self.nodes // self.racks

    def rack_of(self, node: int) -> int:
        return node // self.nodes_per_rack

    def namespace(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def switch(self, rack: int) -> str:
        """Namespace of ``rack``'s switch (the only switch of a two-tier cluster is rack 0's)."""
        return f"{self.prefix}sw{rack}"

    @property
    def core(self) -> str:
        return f"{self.prefix}core"

    def address(self, node: int) -> str:
        """IP address of ``node``'s uplink (inside its namespace only)."""
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> Cluster:
        remove_stale_namespaces()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    @staticmethod
    def _shape(namespace: str, device: str, rate_mbit: float) -> None:
        rate_bytes_s = rate_mbit * 1e6 / 8
        burst = max(int(rate_bytes_s * BURST_S), 16 * 1024)
        cmd = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
               "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", f"{QUEUE_LATENCY_MS}ms"]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)

    def _add_switch(self, name: str) -> None:
        self._add_namespace(name)
        _ip("-n", name, "link", "add", "br0", "type", "bridge")
        _ip("-n", name, "link", "set", "br0", "up")

    def _link(self, near: str, near_dev: str, switch: str, port: str, rate_mbit: float | None) -> None:
        """A veth ``near_dev`` (in ``near``) <-> ``port`` on ``switch``'s bridge, shaped to ``rate_mbit`` each way
        (``None``: not shaped)."""
        _ip("link", "add", near_dev, "netns", near, "type", "veth", "peer", "name", port, "netns", switch)
        _ip("-n", switch, "link", "set", port, "master", "br0")
        for ns, dev in ((switch, port), (near, near_dev)):
            _ip("-n", ns, "link", "set", dev, "up")
            if rate_mbit is not None:
                self._shape(ns, dev, rate_mbit)

    def _build(self) -> None:
        if self.racks > 1:
            self._add_switch(self.core)
        for rack in range(self.racks):
            self._add_switch(self.switch(rack))
            if self.racks > 1:
                self._link(self.switch(rack), TRUNK, self.core, f"rack{rack}", self.rack_rate_mbit)
                _ip("-n", self.switch(rack), "link", "set", TRUNK, "master", "br0")
        for node in range(self.nodes):
            ns = self.namespace(node)
            self._add_namespace(ns)
            self._link(ns, UPLINK, self.switch(self.rack_of(node)), f"port{node}", self.rate_mbit)
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", UPLINK)
        if self.hostnames:
            self._name_hosts()

    def _name_hosts(self) -> None:
        """Every node's ``/etc/hosts`` (as ``ip netns exec`` shows it) names every node by its namespace."""
        names = "".join(f"{self.address(node)} {self.namespace(node)}\n" for node in range(self.nodes))
        for node in range(self.nodes):
            folder = Path("/etc/netns") / self.namespace(node)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("127.0.0.1 localhost\n" + names)

    def counters(self, node: int) -> dict[str, int]:
        """Bytes and packets sent and received so far by ``node``'s uplink (its inter-node traffic)."""
        return read_counters(self.namespace(node), UPLINK)

    def rack_counters(self, rack: int) -> dict[str, int]:
        """Bytes and packets ``rack``'s trunk sent to and received from the other racks (three tiers only)."""
        return read_counters(self.switch(rack), TRUNK)

    def probe_goodput(self, src: int, dst: int, seconds: float = 2.0, port: int = 29400) -> dict[str, float]:
        """TCP goodput from node ``src`` to ``dst`` (one stream for ``seconds``): what the shaped link delivers."""
        receiver = (
            "import socket,sys,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('{self.address(dst)}',{port}));s.listen(1);print('ready',flush=True);c,_=s.accept();n=0\n"
            "t=time.perf_counter()\nwhile (b:=c.recv(1<<20)):\n n+=len(b)\nprint(n,time.perf_counter()-t)"
        )
        sender = (
            f"import socket,time\nc=socket.create_connection(('{self.address(dst)}',{port}),timeout=30)\n"
            f"buf=bytes(1<<16);end=time.perf_counter()+{seconds}\nwhile time.perf_counter()<end:\n c.sendall(buf)\n"
            "c.close()"
        )
        rx = subprocess.Popen(["ip", "netns", "exec", self.namespace(dst), "python3", "-c", receiver],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            rx.stdout.readline()
            subprocess.run(["ip", "netns", "exec", self.namespace(src), "python3", "-c", sender],
                           check=True, timeout=seconds + 30)  # fmt: skip
            nbytes, elapsed = rx.communicate(timeout=30)[0].split()
        finally:
            if rx.poll() is None:
                rx.kill()
                rx.wait()
        mbit_s = int(nbytes) * 8 / float(elapsed) / 1e6
        return {"rate_mbit": self.rate_mbit, "goodput_mbit": round(mbit_s, 2), "probe_s": round(float(elapsed), 2)}

    def torchrun_commands(self, ranks_per_node: int, port: int, argv: Sequence[str]) -> list[list[str]]:
        """One ``torchrun --nnodes N --node_rank i`` per node, rendezvous on node 0: the real multi-node launcher."""
        return [
            [*torchrun_command(), f"--nnodes={self.nodes}",
             f"--nproc_per_node={ranks_per_node}", f"--node_rank={node}", f"--master_addr={self.address(0)}",
             f"--master_port={port}", *argv]
            for node in range(self.nodes)
        ]  # fmt: skip

    def launch(
        self, node: int, argv: Sequence[str], env: dict[str, str], log: Path, wrap: Wrap | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace, in its own process group, output to ``log``.

        gloo is pointed at the uplink (``GLOO_SOCKET_IFNAME``): the only interface that reaches the other nodes.
        The first node of each rack of a three-tier cluster is told its rack switch's namespace
        (``FEDSHARD_RACK_NETNS``), where it reads the rack's trunk counters. ``wrap(node, command)`` may wrap the
        whole command, ``ip netns exec`` included: what must happen outside the namespace's own view of ``/sys``
        (`cpu_quota.CpuGroups.wrap` enters a cgroup, which ``ip netns exec``'s fresh ``/sys`` no longer shows).
        """
        rack = self.rack_of(node)
        reads_rack = {RACK_NETNS_ENV: self.switch(rack)} if self.racks > 1 and node % self.nodes_per_rack == 0 else {}
        named = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.namespace(node)]
        command = ["ip", "netns", "exec", self.namespace(node), *(named if self.hostnames else []), *argv]
        with open(log, "w") as out:
            proc = process_tree.popen(
                wrap(node, command) if wrap is not None else command,
                env={**os.environ, "GLOO_SOCKET_IFNAME": UPLINK, **env, **reads_rack},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self._procs.append(proc)
        return proc

    def run(
        self,
        commands: Sequence[Sequence[str]],
        env: dict[str, str],
        logs: Sequence[Path],
        timeout_s: float,
        tick: Callable[[], None] | None = None,
        wrap: Wrap | None = None,
    ):
        """Run one command per node to completion; return the exit codes.

        Raises ``TimeoutError`` after ``timeout_s`` (having killed every process), and stops the other nodes as
        soon as one fails, since its peers would otherwise wait for it until the collective timeout. ``tick`` is
        called at every poll (every 0.2 s) while they run: a study's hook (benchmarks/speed_rounds.py starts its
        ranks' training from there); what it raises stops the run as a failure does. ``wrap``: as `launch`'s.
        """
        procs = [self.launch(node, cmd, env, log, wrap)
                 for node, (cmd, log) in enumerate(zip(commands, logs, strict=True))]  # fmt: skip
        deadline = time.monotonic() + timeout_s
        try:
            while None in (codes := [p.poll() for p in procs]):
                if any(code not in (None, 0) for code in codes):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the run did not finish within {timeout_s:.0f} s; logs: {list(map(str, logs))}")
                if tick is not None:
                    tick()
                time.sleep(0.2)
        finally:
            self._kill()
        return [p.returncode for p in procs]

    def _kill(self, grace_s: float = 5.0) -> None:
        """Stop every launch of this cluster and every process it started (`process_tree.stop_all`: SIGTERM, then
        SIGKILL after ``grace_s``; torchrun's workers, in sessions of their own, and orphans included)."""
        process_tree.stop_all(self._procs, grace_s)
        self._procs = [p for p in self._procs if p.poll() is None]

    def close(self) -> None:
        """Kill what runs in the cluster, then delete every namespace it made (their links go with them)."""
        blocked = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._kill()
            for name in reversed(self.created):
                _ip("netns", "del", name, check=False)
                shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
            self.created = [name for name in self.created if name in list_namespaces()]
        finally:
            for sig, handler in blocked.items():
                signal.signal(sig, handler)
        if self.created:
            raise RuntimeError(f"could not remove network namespaces {self.created}; remove with `ip netns del`.")

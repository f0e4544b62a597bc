"""An in-process federation for testing the round protocol under any timing: a fake lighthouse, a fake clock and a
seeded scheduler, with the real engine (`FederatedAverager`, `hf_fedshard.engine.rounds`) in every group.

Each launch of a group is a thread; exactly one runs at a time, and a seeded scheduler picks which at every point
where a real launch could be overtaken (a training step, a collective, a quorum, a vote). When every launch waits,
the clock jumps to the next deadline (a timeout, a fault, a restart), so minutes of federation run in milliseconds
and the same seed gives the same interleaving. Faults are scheduled events: kill a launch (SIGKILL), stop and
continue it (SIGSTOP/SIGCONT), start a launch (a restart, a staggered resume), lose the lighthouse.

`SimulatedFederation` is the transport: the `Membership` a torchft launch would have, with torchft's semantics
(quorums of the launches that asked, within a join timeout; a dead launch stays known until its heartbeats time
out; a vote commits only if every member voted yes; a group behind heals from one at the highest averaging count).
"""

from __future__ import annotations

import copy
import itertools
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_fedshard.engine.communicator import FederationCommunicator, Round
from hf_fedshard.engine.rounds import HealState, end_round, join, lead, next_lineage
from hf_fedshard.errors import ConfigError


class Killed(BaseException):
    """Unwinds a killed launch's thread (not an Exception: nothing in the engine may catch it)."""


class Deadlock(RuntimeError):
    """Every launch waits on something no deadline will change."""


def _taken() -> threading.Lock:
    """A lock held from the start, used as a binary semaphore (released by the other side of each handoff): the
    scheduler and exactly one launch thread hand the turn back and forth, several times cheaper than a Semaphore."""
    lock = threading.Lock()
    lock.acquire()
    return lock


@dataclass
class _Thread:
    name: str
    go: threading.Lock = field(default_factory=_taken)
    ready: Callable[[], bool] = lambda: True
    deadline: float | None = None
    stopped_until: float = 0.0
    stopped_at: float = 0.0
    killed: bool = False
    kill_in: int = 0  # scheduling points left before a pending kill lands
    on_death: Callable[[], None] | None = None
    done: bool = False


class Simulation:
    """The fake clock and the seeded scheduler (see the module docstring). Launch threads call `wait_until` and
    `sleep`; the test's thread calls `spawn`, `at` and `run`."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self._threads: list[_Thread] = []
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._back = _taken()
        self._local = threading.local()
        self.errors: list[tuple[str, BaseException]] = []

    # ---- From the test ----

    def at(self, time: float, action: Callable[[], None]) -> None:
        """Run ``action`` on the scheduler's thread at fake ``time`` (a fault, a start)."""
        self._events.append((time, next(self._order), action))
        self._events.sort()

    def spawn(self, name: str, fn: Callable[[], object]) -> _Thread:
        """A launch thread running ``fn`` from the next scheduling point on; it dies with `Killed` when killed."""
        thread = _Thread(name)

        def body() -> None:
            self._local.thread = thread
            thread.go.acquire()
            try:
                if not thread.killed:
                    fn()
            except Killed:
                pass
            except BaseException as err:  # recorded: the test decides which errors a schedule may raise
                self.errors.append((name, err))
            finally:
                thread.done = True
                self._back.release()

        self._threads.append(thread)
        threading.Thread(target=body, name=name, daemon=True).start()
        return thread

    def kill(self, thread: _Thread, after_points: int = 0, then: Callable[[], None] | None = None) -> None:
        """SIGKILL ``thread`` now, or as it passes its ``after_points``-th scheduling point from now (between two
        calls of its own that nothing else separates); ``then`` runs at its death (e.g. schedules its restart)."""
        thread.kill_in, thread.on_death = after_points, then
        if after_points == 0:
            self._die(thread)

    def _die(self, thread: _Thread) -> None:
        thread.killed = True
        if thread.on_death is not None:
            thread.on_death()

    def stop(self, thread: _Thread, seconds: float) -> None:
        thread.stopped_at, thread.stopped_until = self.now, self.now + seconds

    def run(self, until: float) -> None:
        """Schedule until every launch ended and no event is left (or ``until`` fake seconds)."""
        while True:
            while self._events and self._events[0][0] <= self.now:
                self._events.pop(0)[2]()
            live = [t for t in self._threads if not t.done]
            runnable = [t for t in live if self._runnable(t)]
            if runnable:
                thread = self.rng.choice(runnable)
                thread.go.release()
                self._back.acquire()
                continue
            times = [t.deadline for t in live if t.deadline is not None and t.stopped_until <= self.now]
            times += [t.stopped_until for t in live if t.stopped_until > self.now]
            times += [e[0] for e in self._events]
            if not times:
                if live:
                    raise Deadlock(f"at {self.now:g} s every launch waits forever: {[t.name for t in live]}")
                return
            self.now = max(self.now, min(times))
            if self.now > until:
                raise Deadlock(f"still running at {until:g} fake seconds: {[t.name for t in live]}")

    def _runnable(self, thread: _Thread) -> bool:
        if thread.killed:
            return True  # to unwind
        if thread.stopped_until > self.now:
            return False
        return thread.ready() or (thread.deadline is not None and thread.deadline <= self.now)

    # ---- From a launch thread ----

    def wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Park until ``ready()`` (then True) or ``timeout`` fake seconds (then False); a scheduling point."""
        thread: _Thread = self._local.thread
        thread.ready, thread.deadline = ready, None if timeout is None else self.now + timeout
        self._back.release()
        thread.go.acquire()
        thread.ready, thread.deadline = (lambda: True), None
        if thread.kill_in > 0 and not thread.killed:
            thread.kill_in -= 1
            if thread.kill_in == 0:
                self._die(thread)
        if thread.killed:
            raise Killed
        return ready()

    def sleep(self, seconds: float) -> None:
        end = self.now + seconds
        self.wait_until(lambda: self.now >= end, seconds)

    def point(self) -> None:
        """A scheduling point: another launch may run before this one goes on."""
        self.wait_until(lambda: True, None)


@dataclass
class Launch:
    """One launch of a group as the lighthouse knows it."""

    group: int
    id: int
    thread: _Thread | None = None
    federation: SimulatedFederation | None = None
    died_at: float | None = None


@dataclass
class Quorum:
    id: int
    members: tuple[Launch, ...]
    counts: dict[int, tuple[int, int]]  # launch id -> (averagings committed, lineage) when it asked
    posts: dict[tuple, dict[int, Any]] = field(default_factory=dict)


class FakeLighthouse:
    """torchft's Lighthouse (`quorum_compute` in its src/lighthouse.rs), in the scheduler's terms. A quorum forms of
    every healthy launch that asked:

    - at once when every member of the previous quorum asked again (torchft's fast quorum: no other rule applies);
    - else once at least ``min_groups`` asked, more than half of the healthy launches (so two halves of a federation
      never average apart), and either every healthy launch asked or ``join_timeout_s`` passed since the first did.

    A launch is healthy from its first request until ``heartbeat_timeout_s`` after it died or stopped. A launch left
    out of a quorum asks again at once (its wait for the join timeout starts over), as torchft's server does."""

    def __init__(self, sim: Simulation, join_timeout_s: float, heartbeat_timeout_s: float, min_groups: int = 1) -> None:
        self.sim, self.join_timeout_s, self.heartbeat_timeout_s = sim, join_timeout_s, heartbeat_timeout_s
        self.min_groups = min_groups
        self.launches: list[Launch] = []
        self.asked: dict[int, tuple[Launch, tuple[int, int], float]] = {}  # launch id -> (launch, count, time)
        self.formed: dict[int, Quorum] = {}  # launch id -> the quorum it was given
        self.previous: tuple[Launch, ...] = ()  # the members of the last quorum formed
        self.lost = False
        self._ids = itertools.count(1)

    def alive(self, launch: Launch) -> bool:
        thread = launch.thread
        return thread is not None and not thread.killed and not thread.done and thread.stopped_until <= self.sim.now

    def silent_since(self, launch: Launch) -> float | None:
        """When ``launch``'s heartbeats stopped (it died or is stopped); ``None`` while it heartbeats."""
        thread = launch.thread
        if launch.died_at is not None:
            return launch.died_at
        if thread is not None and thread.stopped_until > self.sim.now:
            return thread.stopped_at
        return None

    def known(self, launch: Launch) -> bool:
        """Alive, or silent (dead, stopped) for less than the heartbeat timeout: torchft's healthy replicas."""
        if self.alive(launch):
            return True
        since = self.silent_since(launch)
        return since is not None and self.sim.now - since < self.heartbeat_timeout_s

    def ask(self, launch: Launch, count: tuple[int, int]) -> None:
        self.formed.pop(launch.id, None)
        self.asked[launch.id] = (launch, count, self.sim.now)

    def quorum_of(self, launch: Launch) -> Quorum | None:
        """The quorum given to ``launch``, forming one if the rule allows now (called by the waiting launch)."""
        if launch.id not in self.formed and not self.lost:
            self._form()
        return self.formed.get(launch.id)

    def next_change(self) -> float:
        """The next fake time at which the rule may decide otherwise with nobody asking anew: a join timeout
        running out, a silent launch's heartbeats timing out (a launch waiting for a quorum wakes then)."""
        times = [t + self.join_timeout_s for _, _, t in self.asked.values()]
        for launch in self.launches:
            since = self.silent_since(launch)
            if since is not None:
                times.append(since + self.heartbeat_timeout_s)
        return min((t for t in times if t > self.sim.now), default=float("inf"))

    def _form(self) -> None:
        healthy = [x for x in self.launches if self.known(x)]
        asking = [(a, c, t) for a, c, t in self.asked.values() if self.known(a)]
        if not asking:
            return
        ids = {a.id for a, _, _ in asking}
        fast = bool(self.previous) and all(m.id in ids for m in self.previous)
        if not fast:
            if len(asking) < self.min_groups or len(asking) <= len(healthy) // 2:
                return  # torchft's split-brain rule: more than half of the healthy launches
            everyone = len(asking) == len(healthy)
            if not everyone and self.sim.now - min(t for _, _, t in asking) < self.join_timeout_s:
                return
        members = tuple(sorted((a for a, _, _ in asking), key=lambda a: (a.group, a.id)))
        quorum = Quorum(next(self._ids), members, {a.id: c for a, c, _ in asking})
        for launch in members:
            self.formed[launch.id] = quorum
            del self.asked[launch.id]
        self.previous = members
        for left_out, (launch, count, _) in list(self.asked.items()):  # torchft clears its participants; those
            self.asked[left_out] = (launch, count, self.sim.now)  # still waiting join again at once


class SimulatedFederation:
    """This launch's side of the simulated federation: the `Membership` and the `Communicator` over its quorum.

    Args:
        sim: the scheduler and clock.
        lighthouse: the federation's fake lighthouse.
        launch: this launch (its group id and launch id).
        num_groups: the nominal number of groups (a launch that did not heal waits for all at its first quorum).
        timeout_s: how long a collective, a vote or a quorum waits (``fed_timeout_s``).
        heal: the parts of this launch's state (`hf_fedshard.engine.rounds.HealState`).
    """

    def __init__(
        self,
        sim: Simulation,
        lighthouse: FakeLighthouse,
        launch: Launch,
        num_groups: int,
        timeout_s: float,
        heal: HealState,
    ) -> None:
        self.sim, self.lighthouse, self.launch = sim, lighthouse, launch
        self.num_groups, self.timeout_s, self.heal = num_groups, timeout_s, heal
        self.count = 0  # averagings committed (torchft's step)
        self.lineage = 0  # `hf_fedshard.engine.rounds.next_lineage` of the commits so far
        self.quorum: Quorum | None = None
        self.error: str | None = None
        self.heals = 0
        self.ended: list[int] | None = None  # the groups END never met (`end`)
        self.commits: list[tuple[int, tuple[int, ...]]] = []  # (quorum id, member groups) of each commit
        self._ops = itertools.count()
        self._quorum_key: tuple[int, ...] = ()
        launch.federation = self
        lighthouse.launches.append(launch)

    # ---- Communicator over the quorum (peers and control: one rank per group) ----

    @property
    def communicator(self) -> FederationCommunicator:
        """The engine's collectives over the quorum, this launch's membership (a `Federation`'s, as transports give)."""
        return FederationCommunicator(
            peers=self,
            control=self,
            timeout=f"fed_timeout_s={self.timeout_s:g}",
            membership=self,
            background_exchange=False,  # a simulated collective runs on its launch's thread (`Simulation.wait_until`)
        )

    def size(self) -> int:
        return len(self.quorum.members) if self.quorum is not None else 1

    def rank(self) -> int:
        return self.quorum.members.index(self.launch) if self.quorum is not None else 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._collective(tensor, lambda posts: sum(posts[1:], posts[0].clone()), tensor)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._collective(input, torch.cat, output)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        me, n = self.rank(), self.size()
        self._collective(input, lambda posts: torch.cat([p.chunk(n)[me] for p in posts]), output)

    def all_to_all_v(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> None:
        raise NotImplementedError("the simulated federation's groups are of one size")

    def _collective(self, mine: torch.Tensor, combine: Callable[[list], torch.Tensor], output: torch.Tensor) -> None:
        """Post ``mine`` under this quorum's next operation and wait for every member's: a member gone fails it at
        once (its connection closed), a silent one after the timeout; a failure leaves zeros and is reported."""
        if self.error is None and self.quorum is not None:
            posts = self._meet(("op", next(self._ops)), mine.detach().clone())
            if posts is not None:
                output.copy_(combine(posts))
                return
        output.zero_()

    def _meet(self, key: tuple, value: Any) -> list | None:
        quorum, me = self.quorum, self.launch
        table = quorum.posts.setdefault(key, {})
        table[me.id] = value
        members = quorum.members

        def gone(m: Launch) -> bool:
            """Dead, or on to a later quorum (asking for one, or in one): its process group of this one is closed,
            so the wait fails at once."""
            if not self.lighthouse.alive(m) and m.died_at is not None:
                return True
            later = m.federation.quorum is not None and m.federation.quorum.id > quorum.id
            return later or m.id in self.lighthouse.asked

        def settled() -> bool:
            return len(table) == len(members) or any(gone(m) for m in members)

        self.sim.wait_until(settled, self.timeout_s)
        if len(table) == len(members):
            return [table[m.id] for m in members]
        left = [m.group for m in members if gone(m)]
        self.error = f"{'a member left' if left else 'timed out'} at {key} (quorum {quorum.id})"
        return None

    # ---- Membership ----

    def commit(self) -> bool:
        """Every member votes, once per quorum (a quorum holds one round); committed iff every one voted yes
        (torchft's should_commit). Not keyed by the operation count: a member whose collective failed skips the rest."""
        votes = self._meet(("vote",), self.error is None) if self.quorum is not None else None
        committed = votes is not None and all(votes)
        if committed:
            groups = tuple(m.group for m in self.quorum.members)
            self.count += 1
            self.lineage = next_lineage(self.lineage, self.count, groups)
            self.commits.append((self.quorum.id, groups))
        return committed

    def next_round(self) -> Round:
        """Ask the lighthouse for the next quorum; heal from a member at the highest count if behind."""
        self.sim.point()
        self.error = None
        self.lighthouse.ask(self.launch, (self.count, self.lineage))
        if not self._wait_for_quorum():
            raise RuntimeError(
                f"hf_fedshard: fed_group{self.launch.group} got no quorum of the federation within fed_timeout_s="
                f"{self.timeout_s:g}"
            )
        quorum = self.lighthouse.formed[self.launch.id]
        key = tuple(m.id for m in quorum.members)
        changed, self._quorum_key, self.quorum, self._ops = key != self._quorum_key, key, quorum, itertools.count()
        self._check_claims(quorum)
        target = lead([(m.group, *quorum.counts[m.id]) for m in quorum.members])
        groups = tuple(m.group for m in quorum.members if quorum.counts[m.id] == target)
        behind = tuple(m.group for m in quorum.members if quorum.counts[m.id] != target)
        if quorum.counts[self.launch.id] == target:
            return Round(healed=False, changed=changed, on_lead=groups, behind=behind)
        source = next(m for m in quorum.members if quorum.counts[m.id] == target)
        self.heal.receive(copy.deepcopy(source.federation.heal.committed()))  # a wire: the receiver gets a copy
        (self.count, self.lineage), self.heals = target, self.heals + 1
        return Round(healed=True, changed=changed, on_lead=groups, behind=behind)

    def _wait_for_quorum(self) -> bool:
        """Wait up to the timeout for this launch's quorum, waking whenever the lighthouse's rule may decide anew
        (torchft's lighthouse re-checks every 100 ms)."""
        sim, lighthouse, deadline = self.sim, self.lighthouse, self.sim.now + self.timeout_s
        while True:
            wake = min(deadline, lighthouse.next_change())
            if sim.wait_until(lambda: lighthouse.quorum_of(self.launch) is not None, wake - sim.now):
                return True
            if sim.now >= deadline:
                return False

    def join(self, averagings: int) -> Round:
        """The first quorum (before training), by the protocol's rule (`hf_fedshard.engine.rounds.join`)."""
        self.count = averagings
        sim = self.sim
        return join(self.next_round, self.size, self.num_groups, self.timeout_s, lambda: sim.now, sim.sleep)

    def end(self, new_quorum: Callable[[Round], None], last: Round | None) -> list[int]:
        """END (`hf_fedshard.engine.rounds.end_round`) on the fake clock."""
        sim, name = self.sim, f"fed_group{self.launch.group}"
        self.ended = end_round(
            self, self.heal, new_quorum, last, self.num_groups, self.timeout_s, lambda: sim.now, sim.sleep, name
        )
        return self.ended

    def metrics(self) -> dict[str, float]:
        return {"fed_heals": self.heals}

    def _check_claims(self, quorum: Quorum) -> None:
        """I6: two live launches of one group are refused; a dead one of the same id is not counted."""
        live = [m for m in quorum.members if m.group == self.launch.group and self.lighthouse.alive(m)]
        if len(live) > 1:
            raise ConfigError(f"hf_fedshard: two launches claim fed_group_id={self.launch.group}.")

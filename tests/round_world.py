"""A federation of simulated launches (`hf_fedshard.transports.simulated`) that trains as the Trainer does: each
launch joins, heals or resumes, trains its steps, averages every H through the real `FederatedAverager`, saves a
checkpoint every few averagings; faults are scheduled on the fake clock. `World.check` states what must hold at
the end whatever the faults: every group that finished ended on one model with one averaging count.

Whose membership the launches run is the world's ``backend``: `Lighthouse` (torchft's semantics, the package's
`SimulatedFederation`) or `Store` (the membership of the transport written outside the package,
`tests.store_transport.StoreMembership`, over `SimulatedStore`): the same schedules prove both."""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hf_fedshard import FederatedAverager
from hf_fedshard.engine.communicator import FederationCommunicator
from hf_fedshard.engine.payload import load_model_state, model_state_tensors
from hf_fedshard.engine.rounds import HealState
from hf_fedshard.transports.simulated import FakeLighthouse, Launch, SimulatedFederation, Simulation

from .store_transport import StoreMembership
from .tiny_federation import build, train_step

H, STEPS, STEP_S, CHECKPOINT_EVERY = 4, 24, 1.0, 8
TIMEOUT_S, JOIN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 20.0, 3.0, 5.0
SKIPPED_STEP_S = 0.01  # a step a speed-aware round passes over (no batch trained)
POLL_S = 0.2  # the store membership's reading interval (fake seconds: it costs only the test's time)
NO_QUORUM = "got no quorum of the federation"
LEFT_BEHIND = "it was sent a peer's state of step"  # the Trainer's words, `FedShardMixin._check_peer_step`
HEAL_LOST = "could not heal from"  # a heal whose source died during the copy (the transports' words)


class SimulatedStore:
    """The key-value calls of a `TCPStore` (`tests.store_transport.KeyValue`) on the simulator: every write, and
    one read in four, is a point where another launch may run (and where a pending kill may land);
    ``get`` of a missing key waits (as TCPStore's does) up to the timeout; a lost store fails every call, as a dead
    store host does."""

    def __init__(self, sim: Simulation, timeout_s: float) -> None:
        self.sim, self.timeout_s, self.data, self.lost = sim, timeout_s, {}, False
        self._reads = random.Random(sim.rng.random())  # which reads are scheduling points too

    def set(self, key: str, value: str | bytes) -> None:
        self._call()
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        self._call(write=False)
        ready = key in self.data or self.sim.wait_until(lambda: key in self.data or self.lost, self.timeout_s)
        if not ready or self.lost:
            raise dist.DistStoreError(f"wait timeout after {self.timeout_s:g}s, keys: {key}")
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        self._call(write=amount != 0)
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._call()
        if self.data.get(key, b"") == expected.encode():
            self.data[key] = desired.encode()
        return self.data.get(key, expected.encode())

    def check(self, keys: list[str]) -> bool:
        self._call(write=False)
        return all(key in self.data for key in keys)

    def delete_key(self, key: str) -> bool:
        self._call()
        return self.data.pop(key, None) is not None

    def _call(self, write: bool = True) -> None:
        if write or self._reads.random() < 0.25:
            self.sim.point()
        if self.lost:
            raise dist.DistStoreError("the store's host is gone")


class Federation(Protocol):
    """What a backend gives a launch: its first quorum, its communicator, its commits (quorum, groups), and
    ``error``, which makes its next vote no (an injected failure)."""

    communicator: FederationCommunicator
    commits: list[tuple[int, tuple[int, ...]]]
    error: str | None

    def join(self, averagings: int) -> Any: ...


class Lighthouse:
    """torchft's membership: `SimulatedFederation` over a `FakeLighthouse`; losing it loses the lighthouse."""

    def __init__(self, sim: Simulation) -> None:
        self.sim, self.lighthouse = sim, FakeLighthouse(sim, JOIN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S)

    def federation(self, launch: Launch, groups: int, heal: HealState) -> SimulatedFederation:
        return SimulatedFederation(self.sim, self.lighthouse, launch, groups, TIMEOUT_S, heal)

    def lose(self) -> None:
        self.lighthouse.lost = True

    def renew(self) -> None:
        self.lighthouse.lost = False
        self.lighthouse.asked.clear()


class Store:
    """The outside transport's membership, `StoreMembership`, over a `SimulatedStore`; losing it loses the store
    (a new one, empty, for the launches of a full resume)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim, self.store = sim, SimulatedStore(sim, TIMEOUT_S)

    def federation(self, launch: Launch, groups: int, heal: HealState) -> StoreMembership:
        sim = self.sim
        membership = StoreMembership(
            self.store, group_id=launch.group, num_groups=groups, heal=heal, timeout_s=TIMEOUT_S,
            clock=lambda: sim.now, sleep=sim.sleep, join_timeout_s=JOIN_TIMEOUT_S, poll_s=POLL_S,
        )  # fmt: skip
        membership.communicator = FederationCommunicator(
            peers=membership,
            control=membership,
            timeout=f"fed_timeout_s={TIMEOUT_S:g}",
            membership=membership,
            background_exchange=False,
        )
        return membership

    def lose(self) -> None:
        self.store.lost = True

    def renew(self) -> None:
        self.store = SimulatedStore(self.sim, TIMEOUT_S)


BACKENDS: dict[str, Callable[[Simulation], Lighthouse | Store]] = {"lighthouse": Lighthouse, "store": Store}


@dataclass
class Finished:
    """What a launch that trained to the end holds."""

    launch: int
    group: int
    tensors: list[torch.Tensor]
    syncs: int
    commits: list[tuple[int, tuple[int, ...]]]
    at: float = 0.0  # when it ended (after END)
    missing: list[int] | None = None  # the groups END never met


@dataclass
class World:
    """``groups`` groups of one rank training ``steps`` steps on a fake clock, seeded, meeting through ``backend`` (a
    `BACKENDS` name)."""

    seed: int
    groups: int = 3
    backend: str = "lighthouse"
    steps: int = STEPS
    options: dict[str, Any] = field(default_factory=dict)  # the averaging's settings (H = 4 unless sync_steps)
    sim: Simulation = field(init=False)
    launches: list[Launch] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    checkpoints: dict[int, dict[int, dict]] = field(default_factory=dict)  # group -> step -> state
    log: list[str] = field(default_factory=list)
    stops: list[tuple[int, float, float]] = field(default_factory=list)  # (group, from, until) of every stop

    def __post_init__(self) -> None:
        self.averaging = {"sync_steps": H, **self.options}
        self.sim = Simulation(self.seed)
        self._faults = random.Random(self.seed + 1_000_003)
        self.meeting = BACKENDS[self.backend](self.sim)
        self._ids = itertools.count()

    # ---- Faults and starts, on the fake clock ----

    def start(self, group: int, at: float = 0.0, resume_step: int | None = None) -> None:
        """A launch of ``group`` at ``at`` (afresh, or from its checkpoint of ``resume_step``)."""
        self.sim.at(at, lambda: self._launch(group, resume_step))

    def kill(self, group: int, at: float, restart_after: float | None = None) -> None:
        """SIGKILL ``group``'s live launch at ``at``; start it again afresh ``restart_after`` seconds later."""

        def kill() -> None:
            for i, launch in enumerate(self.live(group)):
                restart = restart_after if i == 0 else None  # one restart per group, as torchrun's

                def died(launch: Launch = launch, restart: float | None = restart) -> None:
                    launch.died_at = self.sim.now
                    self.log.append(f"{self.sim.now:.2f} kill group {group} launch {launch.id}")
                    if restart is not None:
                        self.start(group, self.sim.now + restart)

                # at once, or between two of its next store calls or collectives (drawn apart from the scheduler)
                self.sim.kill(launch.thread, after_points=self._faults.choice([0, 0, 1, 2, 3]), then=died)

        self.sim.at(at, kill)

    def stop(self, group: int, at: float, seconds: float) -> None:
        """SIGSTOP ``group``'s live launch at ``at``, SIGCONT ``seconds`` later."""
        self.stops.append((group, at, at + seconds))

        def stop() -> None:
            for launch in self.live(group):
                self.sim.stop(launch.thread, seconds)

        self.sim.at(at, stop)

    def fail_round(self, group: int, at: float) -> None:
        """Make ``group``'s live launch vote no in its next round (a collective that failed on one rank)."""

        def fail() -> None:
            for launch in self.live(group):
                if launch.federation is None:
                    continue  # not started yet: no round to fail
                launch.federation.error = "injected: a collective failed on this rank"
                self.log.append(f"{self.sim.now:.2f} fail the next round of group {group} launch {launch.id}")

        self.sim.at(at, fail)

    def lose_lighthouse(self, at: float) -> None:
        """Lose what the groups meet through (the lighthouse, or the store)."""

        def lose() -> None:
            self.meeting.lose()
            self.log.append(f"{self.sim.now:.2f} {self.backend} lost")

        self.sim.at(at, lose)

    def full_resume(self, at: float, delays: list[float]) -> None:
        """A new lighthouse at ``at``; every group started again from the latest checkpoint they all hold, group g
        ``delays[g]`` seconds later."""

        def resume() -> None:
            self.meeting.renew()
            common = set.intersection(*(set(self.checkpoints.get(g, {})) for g in range(self.groups)))
            step = max(common) if common else None
            self.log.append(f"{self.sim.now:.2f} full resume from {step}")
            for g, delay in enumerate(delays):
                self.start(g, self.sim.now + delay, step)

        self.sim.at(at, resume)

    def live(self, group: int) -> list[Launch]:
        """``group``'s launches whose thread runs (stopped ones too)."""
        return [x for x in self.launches if x.group == group and not (x.thread.killed or x.thread.done)]

    def run(self) -> World:
        self.sim.run(until=10_000.0)
        return self

    # ---- A launch: the Trainer's life, in short ----

    def _launch(self, group: int, resume_step: int | None) -> None:
        launch = Launch(group, next(self._ids))
        self.launches.append(launch)
        launch.thread = self.sim.spawn(f"group{group}#{launch.id}", lambda: self._life(launch, resume_step))
        self.log.append(f"{self.sim.now:.2f} start group {group} launch {launch.id} resume {resume_step}")

    def _life(self, launch: Launch, resume: int | None) -> None:
        """`_train`; a launch left behind by more than its round (it was sent a later step), or whose heal lost its
        source, exits with that error and is started again a second later, as torchrun --max-restarts does, to heal
        at its first quorum."""
        heal = HealState()
        federation = launch.federation = self.meeting.federation(launch, self.groups, heal)
        try:
            self._train(launch, federation, heal, resume)
        except RuntimeError as err:
            if LEFT_BEHIND not in str(err) and HEAL_LOST not in str(err):
                raise
            launch.died_at = self.sim.now
            why = "left behind" if LEFT_BEHIND in str(err) else "its heal lost its source"
            self.log.append(f"{self.sim.now:.2f} group {launch.group} launch {launch.id} {why}: restarted")
            self.start(launch.group, self.sim.now + 1.0)

    def _train(self, launch: Launch, federation: Federation, heal: HealState, resume: int | None) -> None:
        group = launch.group
        checkpoint = None if resume is None else self.checkpoints[group][resume]
        position = {"step": 0 if checkpoint is None else checkpoint["step"]}

        def check_step(state: dict) -> None:
            if state["step"] != position["step"]:
                raise RuntimeError(f"group {group} at step {position['step']} {LEFT_BEHIND} {state['step']}")

        heal.register("trainer", lambda: dict(position), check_step)
        federation.join(0 if checkpoint is None else checkpoint["averager"]["counters"]["syncs"])
        held = heal.take()
        model, optimizer = build(group)
        comm, sim = federation.communicator, self.sim
        clock = lambda: sim.now  # noqa: E731 (speed-aware rounds time the steps on the fake clock)
        if held:  # healed before training: resume from the peer's committed state
            position["step"] = held["trainer"]["step"]
            averager = FederatedAverager(
                model, optimizer, communicator=comm, average_initial_weights=False, clock=clock, **self.averaging
            )
            averager.load_peer_state(held["averager"])
            heal.commit()  # a group that joins later may heal from this one
        elif checkpoint is not None:
            load_model_state(model, checkpoint["model"])
            averager = FederatedAverager(
                model, optimizer, communicator=comm, average_initial_weights=False, clock=clock, **self.averaging
            )
            averager.load_state_dict(copy.deepcopy(checkpoint["averager"]))
        else:
            averager = FederatedAverager(model, optimizer, communicator=comm, clock=clock, **self.averaging)
        step_s = self._step_s(group)
        while position["step"] < self.steps:
            averager.step_begins()
            trains = averager.should_train  # speed-aware rounds: a slow group passes over the rest of a round
            self.sim.sleep(step_s if trains else SKIPPED_STEP_S)
            position["step"] += 1
            if trains:
                train_step(model, optimizer, group, position["step"])
            averager.step(last=position["step"] == self.steps)
            if position["step"] % CHECKPOINT_EVERY == 0:
                self.checkpoints.setdefault(group, {})[position["step"]] = {
                    "step": position["step"],
                    "model": [t.detach().clone() for t in model_state_tensors(model)],
                    "averager": copy.deepcopy(averager.state_dict()),
                }
        averager.finish()  # as the Trainer's on_train_end: END, also for a launch that healed to the last step
        tensors = [t.detach().clone() for t in model_state_tensors(model)]
        ended = getattr(federation, "ended", None)
        self.finished.append(
            Finished(launch.id, group, tensors, averager.counters.syncs, federation.commits, self.sim.now, ended)
        )

    def _step_s(self, group: int) -> float:
        """Seconds a step of ``group`` takes: STEP_S; with speed-aware rounds, a quarter longer per group id (1,
        1.25, 1.5, 1.75 s a step), so that the policy has slow groups to plan for. A round of the slowest (all H
        steps, as after a heal) stays shorter than TIMEOUT_S at H = 8: a group left out of a quorum by the join
        timeout waits a whole round for the next, and fails if that takes longer than fed_timeout_s (at 1 + g/2 s
        a step, rounds of 20 s, 6 of 80 schedules did)."""
        return STEP_S * (1 + 0.25 * group) if self.averaging.get("round_policy") == "speed" else STEP_S

    # ---- What must hold ----

    def check(self, allowed_errors: tuple[str, ...] = ()) -> None:
        """No error but the ``allowed_errors`` (substrings); every group finished once, all on one model, with one
        averaging count (I9, I10). Beyond I10's bound: a group stopped until less than a round before another ended
        (its END waited for it in vain) may end apart, each naming the other, or fail (an allowed error)."""
        unexpected = [(n, e) for n, e in self.sim.errors if not any(a in str(e) for a in allowed_errors)]
        assert not unexpected, f"seed {self.seed}: {unexpected[0][0]}: {unexpected[0][1]!r}\n" + "\n".join(self.log)
        groups = {f.group for f in self.finished}
        late = {g for g in range(self.groups) if any(self._late(g, f.at) for f in self.finished if f.group != g)}
        assert len(groups) == len(self.finished) and groups | late == set(range(self.groups)), (
            f"seed {self.seed}: finished {sorted(f.group for f in self.finished)}\n" + "\n".join(self.log)
        )
        first = self.finished[0]
        for other in self.finished[1:]:
            same = other.syncs == first.syncs and all(
                torch.equal(a, b) for a, b in zip(first.tensors, other.tensors, strict=True)
            )
            assert same or self._ended_apart(first, other), (
                f"seed {self.seed}: groups {first.group} and {other.group} differ\n" + "\n".join(self.log)
            )

    def _ended_apart(self, a: Finished, b: Finished) -> bool:
        """Whether one of ``a``, ``b`` was late for the other's END, and each named the other as never met."""
        named = b.group in (a.missing or []) and a.group in (b.missing or [])
        return named and (self._late(a.group, b.at) or self._late(b.group, a.at))

    def _late(self, group: int, time: float) -> bool:
        """Whether ``group`` was stopped at ``time``, or until less than a round (H steps) before it: back too late
        to ask for a quorum before then (it finishes the round it was in first)."""
        round_s = self.averaging["sync_steps"] * self._step_s(group)
        return any(g == group and start <= time <= until + round_s for g, start, until in self.stops)


def schedule(
    seed: int, backend: str = "lighthouse", steps: int = STEPS, long_stops: bool = False, **options: Any
) -> tuple[World, tuple[str, ...]]:
    """A seeded fault schedule of ``steps`` steps: one to three kills (each restarted after 0–10 s), stops (shorter
    than the timeout; with ``long_stops`` up to six times it, past the others' END round too), rounds that do not
    commit (one rank votes no), or a lost lighthouse and a staggered full resume; ``options``: the averaging's
    settings. Returns the world and the errors it may raise."""
    rng = random.Random(seed)
    groups = rng.choice([2, 3, 4])
    world = World(seed=seed, groups=groups, backend=backend, steps=steps, options=options)
    for g in range(groups):
        world.start(g, at=rng.choice([0.0, 0.0, rng.uniform(0, JOIN_TIMEOUT_S)]))
    kind = rng.choice(["kills", "kills", "stops", "votes", "resume"])
    if kind == "resume":
        lost = rng.uniform(CHECKPOINT_EVERY * STEP_S + 1, (steps - 3) * STEP_S)
        world.lose_lighthouse(at=lost)
        world.full_resume(at=lost + TIMEOUT_S + 1, delays=[rng.uniform(0, TIMEOUT_S / 2) for _ in range(groups)])
        return world, (NO_QUORUM,)
    longest = 6 * TIMEOUT_S if long_stops else TIMEOUT_S / 2
    for _ in range(rng.randint(1, 3)):
        at = rng.uniform(1, (steps / 2) * STEP_S)
        if kind == "kills":
            world.kill(rng.randrange(groups), at, restart_after=rng.choice([0.1, 0.5, 1, 2, 5, 10]) * rng.random())
        elif kind == "votes":
            world.fail_round(rng.randrange(groups), at)
        else:
            world.stop(rng.randrange(groups), at, seconds=rng.uniform(0.1, longest))
    return world, (NO_QUORUM,) if long_stops else ()

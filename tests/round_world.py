"""A federation of simulated launches (`hf_fedshard.transports.simulated`) that trains as the Trainer does: each
launch joins, heals or resumes, trains its steps, averages every H through the real `FederatedAverager`, saves a
checkpoint every few averagings; faults are scheduled on the fake clock. `World.check` states what must hold at
the end whatever the faults: every group that finished ended on one model with one averaging count."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

import torch

from hf_fedshard import FederatedAverager
from hf_fedshard.engine.payload import load_model_state, model_state_tensors
from hf_fedshard.engine.rounds import HealState
from hf_fedshard.transports.simulated import FakeLighthouse, Launch, SimulatedFederation, Simulation

from .tiny_federation import build, train_step

H, STEPS, STEP_S, CHECKPOINT_EVERY = 4, 24, 1.0, 8
TIMEOUT_S, JOIN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 20.0, 3.0, 5.0
LEFT_BEHIND = "it was sent a peer's state of step"  # the Trainer's words, `FedShardMixin._check_peer_step`


@dataclass
class Finished:
    """What a launch that trained to the end holds."""

    launch: int
    group: int
    tensors: list[torch.Tensor]
    syncs: int
    commits: list[tuple[int, tuple[int, ...]]]


@dataclass
class World:
    """``groups`` groups of one rank on a fake clock, seeded."""

    seed: int
    groups: int = 3
    sim: Simulation = field(init=False)
    lighthouse: FakeLighthouse = field(init=False)
    finished: list[Finished] = field(default_factory=list)
    checkpoints: dict[int, dict[int, dict]] = field(default_factory=dict)  # group -> step -> state
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sim = Simulation(self.seed)
        self.lighthouse = FakeLighthouse(self.sim, JOIN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S)
        self._ids = itertools.count()

    # ---- Faults and starts, on the fake clock ----

    def start(self, group: int, at: float = 0.0, resume_step: int | None = None) -> None:
        """A launch of ``group`` at ``at`` (afresh, or from its checkpoint of ``resume_step``)."""
        self.sim.at(at, lambda: self._launch(group, resume_step))

    def kill(self, group: int, at: float, restart_after: float | None = None) -> None:
        """SIGKILL ``group``'s live launch at ``at``; start it again afresh ``restart_after`` seconds later."""

        def kill() -> None:
            victims = self.live(group)
            for launch in victims:
                self.sim.kill(launch.thread)
                launch.died_at = self.sim.now
                self.log.append(f"{self.sim.now:.2f} kill group {group} launch {launch.id}")
            if victims and restart_after is not None:
                self.start(group, self.sim.now + restart_after)

        self.sim.at(at, kill)

    def stop(self, group: int, at: float, seconds: float) -> None:
        def stop() -> None:
            for launch in self.live(group):
                self.sim.stop(launch.thread, seconds)

        self.sim.at(at, stop)

    def fail_round(self, group: int, at: float) -> None:
        """Make ``group``'s live launch vote no in its next round (a collective that failed on one rank)."""

        def fail() -> None:
            for launch in self.live(group):
                launch.federation.error = "injected: a collective failed on this rank"
                self.log.append(f"{self.sim.now:.2f} fail the next round of group {group} launch {launch.id}")

        self.sim.at(at, fail)

    def lose_lighthouse(self, at: float) -> None:
        def lose() -> None:
            self.lighthouse.lost = True
            self.log.append(f"{self.sim.now:.2f} lighthouse lost")

        self.sim.at(at, lose)

    def full_resume(self, at: float, delays: list[float]) -> None:
        """A new lighthouse at ``at``; every group started again from the latest checkpoint they all hold, group g
        ``delays[g]`` seconds later."""

        def resume() -> None:
            self.lighthouse.lost = False
            self.lighthouse.asked.clear()
            common = set.intersection(*(set(self.checkpoints.get(g, {})) for g in range(self.groups)))
            step = max(common) if common else None
            self.log.append(f"{self.sim.now:.2f} full resume from {step}")
            for g, delay in enumerate(delays):
                self.start(g, self.sim.now + delay, step)

        self.sim.at(at, resume)

    def live(self, group: int) -> list[Launch]:
        return [x for x in self.lighthouse.launches if x.group == group and self.lighthouse.alive(x)]

    def run(self) -> World:
        self.sim.run(until=10_000.0)
        return self

    # ---- A launch: the Trainer's life, in short ----

    def _launch(self, group: int, resume_step: int | None) -> None:
        launch = Launch(group, next(self._ids))
        heal = HealState()
        federation = SimulatedFederation(self.sim, self.lighthouse, launch, self.groups, TIMEOUT_S, heal)
        launch.thread = self.sim.spawn(
            f"group{group}#{launch.id}", lambda: self._life(launch, federation, heal, resume_step)
        )
        self.log.append(f"{self.sim.now:.2f} start group {group} launch {launch.id} resume {resume_step}")

    def _life(self, launch: Launch, federation: SimulatedFederation, heal: HealState, resume: int | None) -> None:
        """`_train`; a launch left behind by more than its round (it was sent a later step) exits with that error
        and is started again a second later, as torchrun --max-restarts does, to heal at its first quorum."""
        try:
            self._train(launch, federation, heal, resume)
        except RuntimeError as err:
            if LEFT_BEHIND not in str(err):
                raise
            launch.died_at = self.sim.now
            self.log.append(f"{self.sim.now:.2f} group {launch.group} launch {launch.id} left behind: restarted")
            self.start(launch.group, self.sim.now + 1.0)

    def _train(self, launch: Launch, federation: SimulatedFederation, heal: HealState, resume: int | None) -> None:
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
        comm = federation.communicator
        if held:  # healed before training: resume from the peer's committed state
            position["step"] = held["trainer"]["step"]
            averager = FederatedAverager(
                model, optimizer, communicator=comm, sync_steps=H, average_initial_weights=False
            )
            averager.load_peer_state(held["averager"])
            heal.commit()  # a group that joins later may heal from this one
        elif checkpoint is not None:
            load_model_state(model, checkpoint["model"])
            averager = FederatedAverager(
                model, optimizer, communicator=comm, sync_steps=H, average_initial_weights=False
            )
            averager.load_state_dict(copy.deepcopy(checkpoint["averager"]))
        else:
            averager = FederatedAverager(model, optimizer, communicator=comm, sync_steps=H)
        while position["step"] < STEPS:
            self.sim.sleep(STEP_S)
            position["step"] += 1
            train_step(model, optimizer, group, position["step"])
            averager.step(last=position["step"] == STEPS)
            if position["step"] % CHECKPOINT_EVERY == 0:
                self.checkpoints.setdefault(group, {})[position["step"]] = {
                    "step": position["step"],
                    "model": [t.detach().clone() for t in model_state_tensors(model)],
                    "averager": copy.deepcopy(averager.state_dict()),
                }
        tensors = [t.detach().clone() for t in model_state_tensors(model)]
        self.finished.append(Finished(launch.id, group, tensors, averager.counters.syncs, federation.commits))

    # ---- What must hold ----

    def check(self, allowed_errors: tuple[str, ...] = ()) -> None:
        """No error but the ``allowed_errors`` (substrings); every group finished once, all on one model, with one
        averaging count, and every commit's members were one quorum."""
        unexpected = [(n, e) for n, e in self.sim.errors if not any(a in str(e) for a in allowed_errors)]
        assert not unexpected, f"seed {self.seed}: {unexpected[0][0]}: {unexpected[0][1]!r}\n" + "\n".join(self.log)
        groups = sorted(f.group for f in self.finished)
        assert groups == list(range(self.groups)), f"seed {self.seed}: finished {groups}\n" + "\n".join(self.log)
        first = self.finished[0]
        for other in self.finished[1:]:
            assert other.syncs == first.syncs, (self.seed, [(f.group, f.syncs) for f in self.finished], self.log)
            for a, b in zip(first.tensors, other.tensors, strict=True):
                assert torch.equal(a, b), (
                    f"seed {self.seed}: groups {first.group} and {other.group} differ\n" + "\n".join(self.log)
                )

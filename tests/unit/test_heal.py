"""A heal across groups of unequal size in parts (`hf_fedshard.engine.heal`), in one process with fake ranks: a
live group's `FederatedAverager.peer_state` cut, its tensors copied onto a group of another size, and mended there
into a `peer_state` of that group's own shards."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hf_fedshard import FederatedAverager
from hf_fedshard.engine.heal import PeerParts, cut, mend, receiving
from hf_fedshard.engine.payload import model_state_addresses, model_state_shapes, model_state_tensors
from hf_fedshard.engine.pieces import Address, GroupShape, PieceExchange
from hf_fedshard.topology import FederationLayout
from hf_fedshard.transports.quorum_world import QuorumGroups

from ..fake_communicator import BARRIER_TIMEOUT_S, run_federation, run_ranks
from ..tiny_federation import build, train_step

SHAPES = [(5, 3), (4,), (6, 2)]  # two parameters (odd rows: shards of 2 differ in size), then a buffer
ADDRESSES = [Address(15, 5, True), Address(4, 4, True), Address(12, 6, False)]
GROUPS = (GroupShape((0,), 1), GroupShape((1, 2), 2))  # a live group of 1 rank, a healing one of 2


def whole(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def live_peer_state() -> dict:
    """A `peer_state` of the 1-rank group (its shards are whole): Nesterov's momentum held for parameter 1 only."""
    model = [whole(i, s) for i, s in enumerate(SHAPES)]
    anchors = [whole(10 + i, s) for i, s in enumerate(SHAPES[:2])]
    optimizer = {"state": {1: {"momentum_buffer": whole(20, SHAPES[1])}}, "param_groups": [{"lr": 0.7}]}
    averager = {
        "step": 8,
        "counters": {"syncs": 2},
        "outer": {"fragments": [{"anchor": anchors, "optimizer": optimizer}]},
    }
    return {"model": model, "averager": averager}


def test_a_peer_state_cut_copied_onto_shards_of_another_size_and_mended_is_the_live_one_sharded():
    peer = live_peer_state()

    def rank_fn(world):
        group = 0 if world.rank() == 0 else 1
        parts = cut(peer, SHAPES, ADDRESSES)  # the live group's; a healing rank takes its state and specs only
        if group == 1:
            shard = GROUPS[1].ranks.index(world.rank())
            parts = PeerParts(parts.state, parts.specs, receiving(parts.specs, GROUPS[1], shard, torch.device("cpu")))
        PieceExchange(world, GROUPS, group).copy(
            parts.tensors, [s.address for s in parts.specs], 0, [1], torch.device("cpu")
        )
        return mend(parts) if group == 1 else None

    for shard, healed in enumerate(run_ranks(3, rank_fn)[1:]):
        params = [torch.chunk(t, 2)[shard] for t in peer["model"][:2]]
        for got, want in zip(healed["model"], [*params, peer["model"][2]], strict=True):
            assert torch.equal(got, want)
        outer = healed["averager"]["outer"]
        anchors = peer["averager"]["outer"]["fragments"][0]["anchor"]
        assert all(torch.equal(a, torch.chunk(w, 2)[shard]) for a, w in zip(outer["anchor"], anchors, strict=True))
        momentum = peer["averager"]["outer"]["fragments"][0]["optimizer"]["state"][1]["momentum_buffer"]
        assert outer["momentum"][0] is None and torch.equal(outer["momentum"][1], torch.chunk(momentum, 2)[shard])
        assert (healed["averager"]["step"], healed["averager"]["counters"]) == (8, {"syncs": 2})


def test_an_averager_takes_a_mended_peer_state_to_the_bit_momentum_included():
    """Two groups average with Nesterov at step 4; then group 1 (its model and outer state spoiled, as a group that
    lost the round) loads group 0's `peer_state`, cut and mended (one rank per group: the parts are whole): its
    model, anchors and outer momentum are group 0's, bit for bit (the outer state arrives held by parameter)."""
    published = threading.Event()
    shared: dict = {}

    def rank_fn(comm):
        group = comm.group
        model, optimizer = build(group)
        averager = FederatedAverager(model, optimizer, communicator=comm, sync_steps=4, outer_optimizer="nesterov")
        for step in range(1, 5):
            train_step(model, optimizer, group, step)
            averager.step()
        if group == 0:
            shared["parts"] = cut(averager.peer_state(), model_state_shapes(model), model_state_addresses(model))
            published.set()
            return averager
        assert published.wait(BARRIER_TIMEOUT_S)
        with torch.no_grad():
            for tensor in [*model_state_tensors(model), *averager.fragments[0].outer.anchor]:
                tensor.add_(1.0)
        sent = shared["parts"]
        averager.load_peer_state(mend(PeerParts(sent.state, sent.specs, [t.clone() for t in sent.tensors])))
        return averager

    live, healed = run_federation(2, rank_fn, pieces=True)
    for ours, theirs in zip(model_state_tensors(healed.model), model_state_tensors(live.model), strict=True):
        assert torch.equal(ours, theirs)
    ours, theirs = healed.fragments[0].outer, live.fragments[0].outer
    assert all(torch.equal(a, b) for a, b in zip(ours.anchor, theirs.anchor, strict=True))
    momenta = [[s["momentum_buffer"] for s in o.optimizer.state.values()] for o in (ours, theirs)]
    assert len(momenta[0]) == len(ours.anchor) and all(map(torch.equal, *momenta))
    assert healed.step_count == live.step_count == 4 and healed.counters.syncs == live.counters.syncs


class _FailedManager:
    """torchft's Manager once a collective of this round failed on this rank (the heal's collectives are skipped)."""

    def errored(self) -> Exception:
        return RuntimeError("Connection closed by peer")


@pytest.mark.parametrize("behind", [True, False], ids=["group-behind", "live-source"])
def test_a_heal_that_fails_is_raised_on_the_group_behind_and_left_reported_on_a_live_one(group_of_one_rank, behind):
    """Quorum of groups 0 (2 ranks, the source) and 1 (1 rank, behind); the heal's collectives fail on this rank. The
    group behind agrees over its ranks and raises one line on each; a live group goes on (its Manager holds the
    error, so its next round does not commit) and counts no heal."""
    federation = SimpleNamespace(
        group=dist.group.WORLD, group_id=int(behind), timeout_s=30.0, manager=_FailedManager(), heals=0,
        provide_parts=lambda: PeerParts({}, [], []), take_parts=None,
    )  # fmt: skip
    quorum = QuorumGroups(federation, FederationLayout(3, (2, 1)))
    quorum.arrange([0, 1])
    assert quorum.shapes() == (GroupShape((0, 1), 2), GroupShape((2,), 1)) and quorum.index() == int(behind)
    assert (quorum.world_rank, quorum.world_size) == (2 if behind else 0, 3)
    if behind:
        with pytest.raises(RuntimeError, match=r"^hf_fedshard: fed_group1 could not heal from fed_group0 \(") as err:
            quorum.heal([1], 0, 3, 0)
        assert "Cause: Connection closed by peer" in str(err.value) and "\n" not in str(err.value)
    else:
        quorum.heal([1], 0, 3, 0)
    assert federation.heals == 0

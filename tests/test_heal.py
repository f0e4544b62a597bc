"""A heal across groups of unequal size in parts (`hf_fedshard.engine.heal`), in one process with fake ranks: a
live group's `FederatedAverager.peer_state` cut, its tensors copied onto a group of another size, and mended there
into a `peer_state` of that group's own shards."""

from __future__ import annotations

import torch

from hf_fedshard.engine.heal import PeerParts, cut, mend, receiving
from hf_fedshard.engine.pieces import Address, GroupShape, PieceExchange

from .fake_communicator import run_ranks

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

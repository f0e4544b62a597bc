"""Every setting with every other: a pairwise covering set of the averaging's settings, each cell run through the
real `FederatedAverager` on fake communicators (three groups; a fake membership for the elastic transport, with a
fault) and compared, to the bit, with `PlainRule`: the averaging rule in plain tensor arithmetic, written here from
the docs, over the rounds that committed. It calls the codec's `encode`/`decode` (tested on their own) and nothing
else of the engine. A cell the settings refuse must be refused in one line naming the reason; `REFUSALS` is the
table docs/overlap.md ("Which settings combine") shows.

Factors: transport (mesh; elastic with a round that does not commit; elastic with a group that loses a round the
others commit and heals), H, fragments F, overlap τ, payload, outer optimizer, round policy (speed: group g's step
costs 1, 2, 4 fake seconds), HSDP replicas per group (1, 2: the exchange split over them), group sizes (equal; or
unequal: group 0 one replica more, weighing its ranks, exchanged piece by piece over every rank) and optimizer-state
averaging.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_fedshard import FederatedAverager
from hf_fedshard.engine import FederationCommunicator
from hf_fedshard.engine.codec import alignment, decode, encode
from hf_fedshard.engine.pieces import GroupShape
from hf_fedshard.engine.sparse import SparseCodec
from hf_fedshard.errors import ConfigError

from ..asserts import labelled
from ..fake_communicator import BARRIER_TIMEOUT_S, Counted, FakeCommunicator, run_ranks
from ..tiny_federation import GROUPS, RANGES, build, train_step
from .test_elastic import FakeMembership

FACTORS = {
    "transport": ["mesh", "elastic-redo", "elastic-heal"],
    "sync_steps": [4, 8],
    "sync_fragments": [1, 2, 4],
    "sync_overlap": [0, 1],
    "sync_dtype": ["float32", "bfloat16", "int8", "topk"],
    "outer_optimizer": ["fedavg", "nesterov"],
    "round_policy": ["steps", "speed"],
    "replicas": [1, 2],
    "groups": ["equal", "unequal"],
    "average_optimizer_state": [False, True],
}
TOPK = {"sync_density": 0.4, "sync_bits": 2, "sync_chunk": 5}  # k = 2 of each chunk; the tensors' 12, 4, 8, 2 values
# end in chunks of 2, 4, 3 and 2 (k = 1, 2, 2, 1)
CODEC = SparseCodec(TOPK["sync_density"], TOPK["sync_bits"], TOPK["sync_chunk"])
COST = (1.0, 2.0, 4.0)  # fake seconds per trained step of each group (speed-aware rounds)
FAILED_COMMIT = 3  # the elastic cells' fault: the second averaging after step 0's
HEALING = 2  # the group that loses it in elastic-heal (it heals from group 0's committed state)

REFUSALS = {  # why a combination cannot run: each a property of the mathematics, in the settings' own words
    "fed_sync_overlap=1 must be in": "τ ≥ H/F: one exchange is applied before the next fragment's begins",
    "fed_round_policy speed plans whole rounds": "speed with F > 1: each fragment's Δ spans its own window of H "
    "steps, offset from the round the speeds were measured over",
    "fed_sync_dtype topk keeps each group's unsent Δ": "topk with speed: error feedback carries a group's unsent Δ "
    "into later rounds, where it would be weighted by their steps, not by the round's it was trained in",
}


def refusal(cell: dict) -> str | None:
    """The start of the one-line error a cell must raise, or ``None`` where it runs."""
    if cell["sync_overlap"] >= cell["sync_steps"] // cell["sync_fragments"]:
        return "fed_sync_overlap=1 must be in"
    if cell["round_policy"] == "speed" and cell["sync_fragments"] > 1:
        return "fed_round_policy speed plans whole rounds"
    if cell["sync_dtype"] == "topk" and cell["round_policy"] == "speed":
        return "fed_sync_dtype topk keeps each group's unsent Δ"
    return None


def pairwise(factors: dict[str, list]) -> list[dict]:
    """A covering set: every pair of values of two factors that a runnable cell can hold is in some runnable cell
    (greedy: each cell taken from the full product covers the most pairs not covered yet; deterministic), then one
    cell per refusal."""
    names = list(factors)
    product = [dict(zip(names, values, strict=True)) for values in itertools.product(*factors.values())]
    runnable = [c for c in product if refusal(c) is None]

    def pairs(cell: dict) -> set:
        return {((a, cell[a]), (b, cell[b])) for a, b in itertools.combinations(names, 2)}

    uncovered = set().union(*(pairs(c) for c in runnable))
    cells = []
    while uncovered:
        best = max(runnable, key=lambda c: len(pairs(c) & uncovered))
        cells.append(best)
        uncovered -= pairs(best)
    for reason in REFUSALS:
        cells.append(next(c for c in product if refusal(c) == reason))
    return cells


CELLS = pairwise(FACTORS)


def cell_id(cell: dict) -> str:
    short = {"outer_optimizer": "", "sync_dtype": "", "transport": "", "round_policy": ""}
    return "-".join(f"{short.get(k, k.replace('sync_', '')[:4])}{v}" for k, v in cell.items())


def settings_of(cell: dict) -> dict:
    keys = ("sync_steps", "sync_fragments", "sync_overlap", "sync_dtype", "outer_optimizer", "round_policy",
            "average_optimizer_state")  # fmt: skip
    return {k: cell[k] for k in keys} | (TOPK if cell["sync_dtype"] == "topk" else {})


def steps_of(cell: dict) -> int:
    return 2 * cell["sync_steps"] + 2  # ends between two averagings: the end averages what is stale


# ---- The engine, in threads ----


def sizes_of(cell: dict) -> list[int]:
    """Each group's ranks (replicas of whole tensors): equal, or group 0 one replica more."""
    replicas = cell["replicas"]
    return [replicas + (cell["groups"] == "unequal" and g == 0) for g in range(GROUPS)]


def engine_cell(cell: dict) -> list:
    """Each rank's parameters, buffer and momentum buffers at the end; one thread per rank, ranks group by group."""
    sizes, steps = sizes_of(cell), steps_of(cell)
    ranks, firsts = sum(sizes), [sum(sizes[:g]) for g in range(GROUPS)]
    barrier = lambda n: {"barrier": threading.Barrier(n, timeout=BARRIER_TIMEOUT_S)}  # noqa: E731
    shared = {"c": barrier(ranks), "x": barrier(ranks)}
    for replica, name in itertools.product(range(max(sizes)), ("p", "x")):
        shared[f"{name}{replica}"] = barrier(GROUPS)
    for group in range(GROUPS):
        shared[f"r{group}"] = barrier(sizes[group])
    fail = {}
    if cell["transport"] != "mesh":
        fail = {FAILED_COMMIT: "all" if cell["transport"] == "elastic-redo" else str(HEALING)}
    heal_shared: dict = {"published": threading.Event()}
    shapes = tuple(GroupShape(tuple(range(first, first + n)), 1) for first, n in zip(firsts, sizes, strict=True))

    def communicator(rank: int, group: int, replica: int) -> FederationCommunicator:
        control = FakeCommunicator(shared["c"], rank, ranks)
        membership = FakeMembership(heal_shared, group, fail) if fail else None
        common = {"timeout": "fed_timeout_s=5", "membership": membership, "hsdp_replicas": sizes[group]}
        if cell["groups"] == "unequal":  # no peers: pieces over every rank, the worker's own world
            exchange = Counted(FakeCommunicator(shared["x"], rank, ranks))
            return FederationCommunicator(None, control, exchange, groups=shapes, this_group=group, **common)
        peers, exchange = (Counted(FakeCommunicator(shared[f"{n}{replica}"], group, GROUPS)) for n in ("p", "x"))
        split = FakeCommunicator(shared[f"r{group}"], replica, sizes[group]) if sizes[group] > 1 else None
        return FederationCommunicator(peers, control, exchange, split=split, **common)

    def rank_fn(world: FakeCommunicator) -> list[torch.Tensor]:
        group = max(g for g in range(GROUPS) if firsts[g] <= world.rank())
        comm = communicator(world.rank(), group, world.rank() - firsts[group])
        now = [0.0]
        model, optimizer = build(group)
        averager = FederatedAverager(model, optimizer, communicator=comm, clock=lambda: now[0], **settings_of(cell))
        for step in range(1, steps + 1):
            if averager.should_train:
                train_step(model, optimizer, group, step)
                now[0] += COST[group]
            averager.step(last=step == steps)
        return state_of(model, optimizer)

    return run_ranks(ranks, rank_fn)


def state_of(model, optimizer) -> list[torch.Tensor]:
    momenta = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    return [t.detach().clone() for t in (*model.parameters(), model.stat, *momenta)]


# ---- The rule, in plain tensor arithmetic ----


@dataclass
class Begun:
    """An averaging begun at a step: its fragments, every group's Δ (times its trained steps), the weight sum, the
    rest's means, each group's snapshots where it applies later."""

    fragments: list[int]
    apply_step: int
    means: dict[int, list[torch.Tensor]]
    rest: list[torch.Tensor] | None
    snapshots: list[list[torch.Tensor]] | None
    residuals: dict[int, list[torch.Tensor]]  # topk: per tensor index, each group's x − D(E(x)), kept at the apply


class PlainRule:
    """The averaging of three groups by the docs: Δ_g = anchor − local_g per fragment; mean Δ = D(E(Σ_g D(E(s_g Δ_g))
    / Σ_g s_g)) (fp32: the plain sum; s_g the steps group g trained in a speed-aware round, else 1); anchor ← outer
    SGD(anchor, mean Δ); local ← anchor (+ the progress since the begin where the apply comes τ steps later); the
    buffer (and the momentum buffers if asked) ← the plain mean of their values at the begin, at the apply.

    topk: x_g = Δ_g + e_g per tensor, mean Δ = Σ_g w_g D(E(x_g)) / Σ_g w_g (summed in group order, not re-encoded),
    e_g ← x_g − D(E(x_g)) at the apply; a group that heals starts again from e = 0."""

    def __init__(self, cell: dict) -> None:
        self.cell, self.h = cell, cell["sync_steps"]
        self.f, self.tau = cell["sync_fragments"], cell["sync_overlap"]
        self.ranges = RANGES[self.f]
        self.lr, self.momentum = (0.7, 0.9) if cell["outer_optimizer"] == "nesterov" else (1.0, 0.0)
        self.unequal = cell["groups"] == "unequal"
        self.weights = sizes_of(cell) if self.unequal else [1] * GROUPS  # samples per step, in ranks
        self.models, self.optimizers = zip(*(build(g) for g in range(GROUPS)), strict=True)
        with torch.no_grad():  # step 0: the plain mean of the initial state
            for tensors in zip(*(self.state(g) for g in range(GROUPS)), strict=True):
                mean = self.plain(list(tensors))
                for t in tensors:
                    t.copy_(mean)
        self.anchor = [p.detach().float().clone() for p in self.params(0)]
        self.buffers: list[torch.Tensor | None] = [None] * 4
        self.plan = [self.h] * GROUPS
        self.residual = [[torch.zeros_like(a) for a in self.anchor] for _ in range(GROUPS)]
        self.averagings = 1  # commits so far: step 0's
        self.flight: Begun | None = None

    def params(self, g: int) -> list[torch.Tensor]:
        return list(self.models[g].parameters())

    def state(self, g: int) -> list[torch.Tensor]:
        return [*self.params(g), self.models[g].stat]

    def rest(self, g: int) -> list[torch.Tensor]:
        momenta = [self.optimizers[g].state[p]["momentum_buffer"] for p in self.params(g)]
        return [self.models[g].stat, *(momenta if self.cell["average_optimizer_state"] else [])]

    def run(self) -> list[list[torch.Tensor]]:
        steps = steps_of(self.cell)
        speed = self.cell["round_policy"] == "speed"
        for step in range(1, steps + 1):
            position = (step - 1) % self.h
            for g in range(GROUPS):
                if not speed or position < self.plan[g]:
                    train_step(self.models[g], self.optimizers[g], g, step)
            if self.flight is not None and (self.flight.apply_step == step or step == steps):
                self.apply(self.flight)
            trained = [min(self.plan[g], position + 1) if speed else 1 for g in range(GROUPS)]
            period = self.h // self.f
            if step == steps:  # the end: every fragment once more, in one blocking averaging
                self.apply(self.begin(list(range(self.f)), step, 0, trained))
            elif step % period == 0:
                begun = self.begin([(step // period - 1) % self.f], step, self.tau, trained)
                self.flight = begun if self.tau else None
                if not self.tau:
                    self.apply(begun)
        return [[t.detach().clone() for t in (*self.state(g), *self.momenta(g))] for g in range(GROUPS)]

    def momenta(self, g: int) -> list[torch.Tensor]:
        return [self.optimizers[g].state[p]["momentum_buffer"] for p in self.params(g)]

    @torch.no_grad()
    def begin(self, fragments: list[int], step: int, later: int, trained: list[int]) -> Begun:
        speed = self.cell["round_policy"] == "speed"
        weight = float(sum(w * s for w, s in zip(self.weights, trained, strict=True))) if speed else sum(self.weights)
        means, residuals = {}, {}
        for f in fragments:
            a, b = self.ranges[f]
            sent = [[(self.anchor[i] - self.params(g)[i].float()).reshape(-1) for i in range(a, b)]
                    for g in range(GROUPS)]  # fmt: skip
            if speed:
                sent = [[d * float(trained[g]) for d in deltas] for g, deltas in enumerate(sent)]
            if self.cell["sync_dtype"] == "topk":
                x = [[d + self.residual[g][i].reshape(-1) for d, i in zip(deltas, range(a, b), strict=True)]
                     for g, deltas in enumerate(sent)]  # fmt: skip
                decoded = [[CODEC.decode(CODEC.encode(t), t.numel()) for t in xs] for xs in x]
                for k, i in enumerate(range(a, b)):
                    residuals[i] = [(x[g][k] - decoded[g][k]).view_as(self.anchor[i]) for g in range(GROUPS)]
                    total = torch.zeros(self.anchor[i].numel())
                    for w, d in zip(self.weights, decoded, strict=True):
                        total += w * d[k]
                    means.setdefault(f, []).append((total / weight).view_as(self.anchor[i]))
                continue
            if self.unequal:  # piece by piece: here each tensor is one piece, encoded on its own
                flats = [self.weighted_mean([deltas[k] for deltas in sent], weight) for k in range(b - a)]
            else:  # the fragment's tensors in one flat payload
                flat = self.mean([torch.cat(deltas) for deltas in sent], weight)
                flats = flat.split([self.anchor[i].numel() for i in range(a, b)])
            means[f] = [m.view_as(self.anchor[i]) for m, i in zip(flats, range(a, b), strict=True)]
        rest = None
        if self.f - 1 in fragments:
            rest = [self.plain(list(tensors)) for tensors in zip(*(self.rest(g) for g in range(GROUPS)), strict=True)]
        snapshots = [[p.float().clone() for p in self.params(g)] for g in range(GROUPS)] if later else None
        return Begun(fragments, step + later, means, rest, snapshots, residuals)

    def plain(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """A plain mean in fp32: equal groups sum in group order; groups of unequal size weigh each by its ranks."""
        if not self.unequal:
            return (tensors[0].float() + tensors[1].float() + tensors[2].float()) / GROUPS
        total = torch.zeros_like(tensors[0], dtype=torch.float32)
        for w, t in zip(self.weights, tensors, strict=True):
            total += w * t.float()
        return total / sum(self.weights)

    def weighted_mean(self, sent: list[torch.Tensor], weight: float) -> torch.Tensor:
        """One piece's mean over groups of unequal size: D(E(Σ_g w_g D(E(x_g)) / W)), summed from zero in group
        order, each payload encoded on its own (padded to the codec's block)."""
        dtype, n = self.cell["sync_dtype"], sent[0].numel()
        total = torch.zeros(n)
        for w, x in zip(self.weights, sent, strict=True):
            total += w * decode(encode(F.pad(x, (0, -n % alignment(dtype))), dtype))[:n]
        return decode(encode(F.pad(total / weight, (0, -n % alignment(dtype))), dtype))[:n]

    def mean(self, sent: list[torch.Tensor], weight: float) -> torch.Tensor:
        """The exchange's mean of the groups' flat payloads: fp32 summed in group order; otherwise each payload
        encoded and decoded, summed in group order, divided, encoded and decoded again."""
        dtype = self.cell["sync_dtype"]
        if dtype == "float32":
            return (sent[0] + sent[1] + sent[2]) / weight
        n = sent[0].numel()
        padded = [F.pad(x, (0, -n % (GROUPS * alignment(dtype)))) for x in sent]
        total = torch.stack([decode(encode(x, dtype)) for x in padded]).sum(dim=0) / weight
        return decode(encode(total, dtype))[:n]

    @torch.no_grad()
    def apply(self, begun: Begun) -> None:
        self.flight = None
        self.averagings += 1
        healing = HEALING if self.cell["transport"] == "elastic-heal" and self.averagings == FAILED_COMMIT else None
        for i, kept in begun.residuals.items():
            for g in range(GROUPS):
                self.residual[g][i] = kept[g]
        for f in begun.fragments:
            for k, i in enumerate(range(*self.ranges[f])):
                self.outer_step(i, begun.means[f][k])
                for g in range(GROUPS):
                    local = self.params(g)[i]
                    kept = begun.snapshots is not None and g != healing
                    local.copy_(self.anchor[i] + (local.float() - begun.snapshots[g][i]) if kept else self.anchor[i])
        for g in range(GROUPS):
            for tensor, mean in zip(self.rest(g), begun.rest or [], strict=False):
                if g != healing or tensor is self.models[g].stat:  # a heal takes the source's buffer, keeps its moments
                    tensor.copy_(mean)
        if self.cell["round_policy"] == "speed":
            self.plan = [max(1, min(self.h, int(self.h * min(COST) / c + 0.5))) for c in COST]
        if healing is not None:  # group 2 lost this round and took group 0's committed state: the anchors
            for param, anchor in zip(self.params(healing), self.anchor, strict=True):
                param.copy_(anchor)
            self.models[healing].stat.copy_(self.models[0].stat)
            self.residual[healing] = [torch.zeros_like(a) for a in self.anchor]
            self.plan[healing] = self.h  # its speed is not measured yet: all H

    @torch.no_grad()
    def outer_step(self, i: int, mean: torch.Tensor) -> None:
        """torch.optim.SGD's single-tensor step (Nesterov when momentum > 0), gradient mean Δ."""
        grad = mean
        if self.momentum:
            if self.buffers[i] is None:
                self.buffers[i] = grad.clone()
            else:
                self.buffers[i].mul_(self.momentum).add_(grad)
            grad = grad.add(self.buffers[i], alpha=self.momentum)
        self.anchor[i].add_(grad, alpha=-self.lr)


@pytest.mark.parametrize("cell", CELLS, ids=[cell_id(c) for c in CELLS])
def test_every_pair_of_settings_runs_to_the_rule_or_is_refused_for_its_reason(cell):
    reason = refusal(cell)
    if reason is not None:
        with pytest.raises(ConfigError, match=f"^{reason}") as err:
            engine_cell(cell)
        assert "\n" not in str(err.value)
        return
    ranks = engine_cell(cell)
    want = PlainRule(cell).run()
    sizes = sizes_of(cell)
    for rank, got in enumerate(ranks):
        group = max(g for g in range(GROUPS) if sum(sizes[:g]) <= rank)
        for i, (tensor, expected) in enumerate(zip(got, want[group], strict=True)):
            torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=labelled(f"rank {rank} tensor {i}"))


def test_the_covering_set_covers_every_pair_a_runnable_cell_can_hold():
    names = list(FACTORS)
    runnable = [c for c in CELLS if refusal(c) is None]
    for a, b in itertools.combinations(names, 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            possible = any(
                refusal(c) is None
                for c in (dict(zip(names, v, strict=True)) for v in itertools.product(*FACTORS.values()))
                if c[a] == x and c[b] == y
            )
            assert not possible or any(c[a] == x and c[b] == y for c in runnable), (a, x, b, y)


def test_the_docs_table_holds_every_refusal_this_test_expects():
    docs = (Path(__file__).parents[2] / "docs" / "overlap.md").read_text()
    for reason in REFUSALS.values():
        assert f"| {reason} |" in docs, reason
    assert f"{sum(refusal(c) is None for c in CELLS)} cells that run" in docs

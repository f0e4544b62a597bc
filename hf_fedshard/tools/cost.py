"""Communication cost model of FSDP, HSDP, FL+FSDP and FL+HSDP on tiered networks.

Run ``python -m hf_fedshard.tools.cost`` for the paper's setting.

Two tiers: ranks of one node talk over a fast fabric (NVLink; loopback in the emulated cluster), nodes over a
slow network (InfiniBand or Ethernet; a rate-limited veth in the emulation). Groups are blocks of contiguous
ranks and nodes hold ``R`` contiguous ranks each, as the usual launchers place them.

Notation
    P        trainable parameters; P_once of them in FSDP units kept unsharded after forward (all-gathered once
             per step; Accelerate and torchtitan keep the [final norm, output head] unit so), the rest twice
    U        FSDP units (transformer blocks, input embedding, [final norm, output head]): one collective call each
    b_p      bytes per element of the parameter all-gather (FSDP2's ``param_dtype``)
    b_g      bytes per element of the gradient reduction (FSDP2's ``reduce_dtype``)
    b_s      bytes per element of an averaging's payload (``fed_sync_dtype``): 4 for float32, 2 for bfloat16,
             1 + 4/256 for int8 (values and one fp32 scale per 256); for topk the bytes of one chunk's codes,
             indices and scale over the chunk's values (`topk_bytes_per_value`), gathered rather than reduced
    W, R     world size, ranks per node
    G, S     group size (``fed_group_size``), shard size (``fed_shard_size``); Q = G / S replicas, F = W / G groups
    H        optimizer steps between two averagings (``fed_sync_steps``)

Collectives assumed: rings, as NCCL's ring algorithm and gloo use them. A ring over k ranks on an N-byte tensor
(N = the unsharded size) sends over each of its k hops

    all-gather       (k-1)/k · N
    reduce-scatter   (k-1)/k · N          (``RING``; gloo's reduce_scatter_tensor is an all-reduce of the whole
                                           input, 2 (k-1)/k · N: benchmarks/gloo_collectives.py, whose
                                           factor the studies use, benchmarks/harness/cost_model.py)
    all-reduce       2 (k-1)/k · N        (reduce-scatter then all-gather)

A hop is inter-node when its two ranks sit on different nodes: a ring over sorted ranks spanning m > 1 nodes
has m inter-node hops, so it sends (hop bytes) through every node's uplink once.

Per optimizer step (no gradient accumulation), each rank takes part in three rings:

    shard ring (S ranks, in the group)     all-gather  b_p · (2 P - P_once)       in forward, and again in
                                                                                backward for units resharded
                                                                                after forward
                                           reduce-scatter  b_g · P
    replicate ring (Q ranks, HSDP only)    all-reduce  b_g · P / S                         (the gradient shard)
    fed ring (F ranks, one per group)      all-reduce  b_s · P / S, once every H steps      (FedAvg of the shard)

The sparse payload (``topk``) is all-gathered over the fed ring, each rank's b_s · P / S to every other group:
(F-1) · b_s · P / S per hop, where an all-reduce sends 2 (F-1)/F · b_s · P / S: it pays off while
b_s_topk · F / 2 < b_s of the dense payload.

With the FL+HSDP split exchange (``fed_split_exchange``) each replica sends 1/Q of the shard on the fed ring,
b_s · P / (S Q), and the replicate ring all-gathers the fp32 mean, 4 · P / S, once every H steps. The averaging's
all-to-all + all-gather sends what a ring all-reduce of the same wire bytes sends, 2 (F-1)/F of them per rank.

Closed forms for groups that are whole nodes (G = multiple of R, S = R) or the whole world, with RING
reduce-scatter; A = b_p (2P - P_once), inter-node bytes sent by one node per step (divide by R for one rank):

    FSDP     (S = W)             (W-1)/W · (A + b_g P)
    HSDP     (S = R, Q = W/R)    2 (Q-1)/Q · b_g P
    FL+FSDP  (G = S = R)         2 (F-1)/F · b_s P / H
    FL+HSDP  (G = Q R, S = R)    2 (Q-1)/Q · b_g P  +  2 (F-1)/F · b_s P / H

Three tiers (``nodes_per_rack``): nodes sit in racks (the paper's machine: Dragonfly+ cells) of M contiguous
nodes, K = W / (R M) racks, and a rack's uplink is slower than a node's link. A ring hop is inter-rack when its
two ranks sit in different racks; it then crosses the sender's node link *and* its rack's uplink, so a node's
link carries every inter-node hop (as in two tiers) and a rack's uplink the inter-rack hops of all its nodes.
Bytes one rack sends to other racks per step, groups laid out as below (FL+HSDP's group = one rack):

    FSDP     (S = W)                 (W-1)/W · (A + b_g P)                    (one hop of the world ring)
    HSDP     (S = R, Q = W/R)        2 (Q-1)/Q · b_g P                         (R rings, one hop out each)
    FL+FSDP  (G = S = R)             2 (F-1)/F · b_s P / H                     (R rings over F = K M groups)
    FL+HSDP  (G = M R, S = R)        M · 2 (K-1)/K · b_s P / H                 (G rings of K ranks, one per rack)

so HSDP puts as many bytes on a rack's uplink as on a node's link every step, while FL+HSDP's replicas
all-reduce gradients inside the rack and only FedAvg crosses it, once every H steps.

FSDP's inter-node traffic does not shrink with W: every node sends about three copies of the model per step.
FL+FSDP's is the model once in fp32, twice, every H steps. Time per step: for each tier, the bytes through its
busiest link divided by that link's bandwidth (a rack's uplink for the inter-rack tier, a node's uplink for the
inter tier, a rank's own link inside a node), summed over tiers (a conservative bound: a pipelined ring is
limited by its slowest link, which the sum exceeds by the faster tiers' share), plus one latency per ring step
per collective call (FSDP2 makes one call per unit), plus compute.
``serial`` adds communication to compute; ``overlapped`` takes the larger of the two (FSDP2 prefetching at best).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from hf_fedshard.engine.codec import INT8_BLOCK
from hf_fedshard.engine.payload import BUCKET_BYTES, Address
from hf_fedshard.engine.pieces import from_owner, plan, to_owner, to_replicas
from hf_fedshard.engine.sparse import SparseCodec
from hf_fedshard.topology import FederationLayout

RING = 1.0  # reduce-scatter bytes as a fraction of an all-reduce's (NCCL ring)
FEDAVG_BYTES = 4  # hf_fedshard.engine.payload accumulates and sends in fp32 (or wider)
# b_s of each dense ``fed_sync_dtype``: int8 carries one fp32 scale per block of INT8_BLOCK values
DENSE_BYTES_PER_VALUE = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + 4.0 / INT8_BLOCK}


@dataclass(frozen=True)
class ModelCost:
    """What one optimizer step of a model puts on the wire, independent of the layout.

    Args:
        params: trainable parameters P.
        once_params: P_once, parameters of units not resharded after forward (all-gathered once per step).
        units: U, FSDP units (one collective call each; only the latency term uses it).
        param_bytes: b_p, bytes per element of the all-gather (2 for bf16 ``param_dtype``).
        grad_bytes: b_g, bytes per element of the gradient reduction (4 for fp32 ``reduce_dtype``).
        sync_bytes: b_s, bytes per element of an averaging's payload (`sync_bytes_per_value`).
        reduce_scatter: RING or GLOO (reduce-scatter as an all-reduce).
        split_exchange: FL+HSDP's replicas each send 1/Q of the shard between groups, then all-gather.
        gathered_sync: the payload is all-gathered (``topk``), not all-reduced.
    """

    params: int
    once_params: int
    units: int
    param_bytes: int = 2
    grad_bytes: int = 4
    sync_bytes: float = FEDAVG_BYTES
    reduce_scatter: float = RING
    split_exchange: bool = False
    gathered_sync: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.once_params <= self.params:
            raise ValueError(f"once_params={self.once_params} must lie in [0, params={self.params}].")

    @property
    def all_gather_bytes(self) -> int:
        """Unsharded bytes all-gathered per step: units resharded after forward twice, the others once."""
        return self.param_bytes * (2 * self.params - self.once_params)


@dataclass(frozen=True)
class Network:
    """Per-tier bandwidth and latency.

    Args:
        inter_node_bytes_s: bandwidth of one node's uplink, each direction (all its NICs together).
        intra_node_bytes_s: bandwidth of one rank's link inside a node, each direction.
        inter_latency_s, intra_latency_s: cost of one ring step on that tier.
        inter_rack_bytes_s: bandwidth of one rack's uplink to the other racks, each direction (all its global
            links together); infinite for a two-tier network.
        inter_rack_latency_s: cost of one ring step that crosses racks.
    """

    inter_node_bytes_s: float
    intra_node_bytes_s: float
    inter_latency_s: float = 0.0
    intra_latency_s: float = 0.0
    inter_rack_bytes_s: float = math.inf
    inter_rack_latency_s: float = 0.0


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a step: ``kind`` over each ring of ``rings``, ``per_step`` times per step."""

    kind: str  # "all_gather", "reduce_scatter", "all_reduce"
    payload_bytes: float  # unsharded size N of the tensor, summed over the calls of one step
    rings: tuple[tuple[int, ...], ...]
    per_step: float = 1.0
    calls: int = 1  # collective calls per occurrence (one per FSDP unit, one per FedAvg bucket)
    averaging: bool = False  # part of the inter-group averaging (what overlap can hide)


@dataclass(frozen=True)
class StepCost:
    """Bytes of one optimizer step (averaged over H steps) on each tier, and its time."""

    method: str
    intra_bytes_per_rank: float
    inter_bytes_per_rank: float
    inter_bytes_per_node: float
    comm_s: float = 0.0
    inter_rack_bytes_per_rack: float = 0.0  # three tiers only: bytes a rack's uplink sends to other racks
    compute_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def overlapped_s(self) -> float:
        return max(self.compute_s, self.comm_s)


def ring_hop_bytes(kind: str, ranks: int, payload_bytes: float, reduce_scatter: float = RING) -> float:
    """Bytes each hop of a ring over ``ranks`` ranks carries for one collective on a ``payload_bytes`` tensor."""
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks * payload_bytes
    factors = {"all_gather": 1.0, "reduce_scatter": reduce_scatter, "all_reduce": 2.0}
    if kind not in factors:
        raise ValueError(f"kind={kind!r}: expected one of {sorted(factors)}.")
    return factors[kind] * share


def ring_hops(ring: Iterable[int], ranks_per_node: int) -> tuple[int, int]:
    """(intra-node hops, inter-node hops) of a ring visiting ``ring`` in order and back to its first rank."""
    ring = list(ring)
    if len(ring) <= 1:
        return 0, 0
    inter = sum(a // ranks_per_node != b // ranks_per_node for a, b in zip(ring, ring[1:] + ring[:1], strict=True))
    return len(ring) - inter, inter


def layout_rings(layout: FederationLayout) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Every distinct ring of each mesh axis: rank = group × G + replica × S + shard (see transports.mesh)."""
    groups, replicas, shards = layout.shape
    g_size, s_size = layout.group_size, layout.shard_size
    return {
        "shard": tuple(
            tuple(g * g_size + q * s_size + s for s in range(shards)) for g in range(groups) for q in range(replicas)
        ),
        "replicate": tuple(
            tuple(g * g_size + q * s_size + s for q in range(replicas)) for g in range(groups) for s in range(shards)
        ),
        "fed": tuple(tuple(g * g_size + j for g in range(groups)) for j in range(g_size)),
    }


def step_collectives(model: ModelCost, layout: FederationLayout, sync_steps: int | None) -> list[Collective]:
    """The collectives of one optimizer step; ``sync_steps=None`` means no averaging (the ideal).

    Groups of unequal size: each group's own rings here; the averaging is `piece_transfers`.
    """
    if not layout.equal:
        return [c for g in range(layout.num_groups) for c in _group_collectives(model, layout, g)]
    rings = layout_rings(layout)
    shard_bytes = model.params / layout.shard_size
    collectives = []
    if layout.shard_size > 1:
        collectives += [
            Collective("all_gather", model.all_gather_bytes, rings["shard"], calls=2 * model.units - 1),
            Collective("reduce_scatter", model.grad_bytes * model.params, rings["shard"], calls=model.units),
        ]
    if layout.replicas > 1:
        collectives.append(
            Collective("all_reduce", model.grad_bytes * shard_bytes, rings["replicate"], calls=model.units)
        )
    if layout.num_groups > 1 and sync_steps is not None:
        split = layout.replicas if model.split_exchange else 1
        sync = model.sync_bytes * shard_bytes / split
        buckets = max(1, math.ceil(FEDAVG_BYTES * shard_bytes / BUCKET_BYTES))
        if model.gathered_sync:  # every group's payload to every rank: N = F payloads
            fed = Collective("all_gather", layout.num_groups * sync, rings["fed"], 1 / sync_steps, buckets, True)
        else:
            fed = Collective("all_reduce", sync, rings["fed"], 1 / sync_steps, buckets, averaging=True)
        collectives.append(fed)
        if split > 1:  # the replicas' fp32 means, all-gathered inside the group
            collectives.append(
                Collective("all_gather", FEDAVG_BYTES * shard_bytes, rings["replicate"], 1 / sync_steps, buckets, True)
            )
    return collectives


def _group_collectives(model: ModelCost, layout: FederationLayout, group: int) -> list[Collective]:
    """The rings of one group of a layout of unequal groups: its shard rings and (HSDP) its replicate rings."""
    first, shards, replicas = layout.first_rank(group), layout.shard_of(group), layout.replicas_of(group)
    shard_rings = tuple(tuple(first + q * shards + s for s in range(shards)) for q in range(replicas))
    replicate_rings = tuple(tuple(first + q * shards + s for q in range(replicas)) for s in range(shards))
    collectives = []
    if shards > 1:
        collectives += [
            Collective("all_gather", model.all_gather_bytes, shard_rings, calls=2 * model.units - 1),
            Collective("reduce_scatter", model.grad_bytes * model.params, shard_rings, calls=model.units),
        ]
    if replicas > 1:
        shard_bytes = model.grad_bytes * model.params / shards
        collectives.append(Collective("all_reduce", shard_bytes, replicate_rings, calls=model.units))
    return collectives


def piece_transfers(model: ModelCost, layout: FederationLayout) -> dict[tuple[int, int], float]:
    """Bytes from rank to rank of one averaging of groups of unequal size (`hf_fedshard.engine.pieces`): the model
    as one flat tensor, cut at every group's shard boundaries; each piece to its owner and back, then to the
    group's other holders."""
    sent: dict[tuple[int, int], float] = {}
    for piece in plan((Address(model.params, model.params),), layout.group_shapes()):
        for phase in (to_owner, from_owner, to_replicas):
            for pair in phase(piece):
                sent[pair] = sent.get(pair, 0.0) + model.sync_bytes * piece.numel
    return sent


def step_cost(
    model: ModelCost,
    layout: FederationLayout,
    ranks_per_node: int,
    sync_steps: int | None,
    network: Network | None = None,
    compute_s: float = 0.0,
    method: str | None = None,
    nodes_per_rack: int | None = None,
    fragments: int = 1,
    overlap: int = 0,
) -> StepCost:
    """Bytes per rank, per node (and per rack) on each tier for one optimizer step, and its time on ``network``.

    ``nodes_per_rack=None`` is a two-tier network (one rack holding every node). With ``overlap`` τ > 0 an
    averaging of 1/``fragments`` of the model runs behind τ steps of compute and of the step's other traffic
    (assumed not to share its links: FL+FSDP with groups = nodes); only what does not fit there is exposed:
    max(0, t_exchange − τ · t_step) per exchange, F exchanges every H steps. Bytes do not change.
    """
    if ranks_per_node < 1 or layout.world_size % ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} must divide WORLD_SIZE({layout.world_size}): nodes hold equal "
            "numbers of ranks. Give the number of ranks (GPUs) per node."
        )
    if sync_steps is not None and sync_steps < 1:
        raise ValueError(f"sync_steps={sync_steps}: H must be at least 1 (or None for no averaging).")
    nodes = layout.world_size // ranks_per_node
    per_rack = nodes if nodes_per_rack is None else nodes_per_rack
    if per_rack < 1 or nodes % per_rack:
        raise ValueError(
            f"nodes_per_rack={nodes_per_rack} must divide the number of nodes, WORLD_SIZE({layout.world_size}) / "
            f"ranks_per_node({ranks_per_node}) = {nodes}: racks hold equal numbers of nodes."
        )
    racks = nodes // per_rack
    intra = inter = rack = comm_s = sync_s = 0.0
    for coll in step_collectives(model, layout, sync_steps):
        before = comm_s
        ring_size = len(coll.rings[0])
        hop = ring_hop_bytes(coll.kind, ring_size, coll.payload_bytes, model.reduce_scatter) * coll.per_step
        hops = [ring_hops(ring, ranks_per_node) for ring in coll.rings]
        rack_hops = sum(ring_hops(ring, ranks_per_node * per_rack)[1] for ring in coll.rings)
        coll_intra, coll_inter = hop * sum(h[0] for h in hops), hop * sum(h[1] for h in hops)
        intra, inter, rack = intra + coll_intra, inter + coll_inter, rack + hop * rack_hops
        if network is not None:
            steps = (2 if coll.kind == "all_reduce" else 1) * (ring_size - 1) * coll.calls * coll.per_step
            comm_s += coll_inter / nodes / network.inter_node_bytes_s
            comm_s += coll_intra / layout.world_size / network.intra_node_bytes_s
            if rack_hops:
                comm_s += hop * rack_hops / racks / network.inter_rack_bytes_s
                comm_s += steps * network.inter_rack_latency_s
            else:
                crosses = any(h[1] for h in hops)
                comm_s += steps * (network.inter_latency_s if crosses else network.intra_latency_s)
        if coll.averaging:
            sync_s += comm_s - before
    if not layout.equal and layout.federated and sync_steps is not None:
        before = comm_s
        tiers = _transfer_bytes(piece_transfers(model, layout), ranks_per_node, per_rack)
        intra, inter, rack = intra + tiers[0] / sync_steps, inter + tiers[1] / sync_steps, rack + tiers[2] / sync_steps
        if network is not None:  # three all-to-alls, each one step of latency on the slowest tier it crosses
            comm_s += tiers[1] / sync_steps / nodes / network.inter_node_bytes_s
            comm_s += tiers[0] / sync_steps / layout.world_size / network.intra_node_bytes_s
            comm_s += tiers[2] / sync_steps / racks / network.inter_rack_bytes_s
            latency = network.inter_rack_latency_s if tiers[2] else network.inter_latency_s
            comm_s += 3 * latency / sync_steps
        sync_s += comm_s - before
    if overlap > 0 and sync_s > 0:
        exchange_s = sync_s * sync_steps / fragments  # one fragment's exchange
        exposed = max(0.0, exchange_s - overlap * (compute_s + comm_s - sync_s))
        comm_s += exposed * fragments / sync_steps - sync_s
    return StepCost(
        method=method or layout.method,
        intra_bytes_per_rank=intra / layout.world_size,
        inter_bytes_per_rank=inter / layout.world_size,
        inter_bytes_per_node=inter / nodes,
        comm_s=comm_s,
        compute_s=compute_s,
        inter_rack_bytes_per_rack=rack / racks if nodes_per_rack is not None else 0.0,
    )


def _transfer_bytes(
    sent: dict[tuple[int, int], float], ranks_per_node: int, nodes_per_rack: int
) -> tuple[float, float, float]:
    """(intra-node, inter-node, inter-rack) bytes of rank-to-rank transfers: a transfer between racks crosses the
    sender's node link and its rack's uplink, as a ring hop does."""
    intra = inter = rack = 0.0
    for (source, target), nbytes in sent.items():
        if source // ranks_per_node == target // ranks_per_node:
            intra += nbytes
            continue
        inter += nbytes
        rack_size = ranks_per_node * nodes_per_rack
        rack += nbytes if source // rack_size != target // rack_size else 0.0
    return intra, inter, rack


def llama_parameters(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool = False, **_
) -> tuple[int, int]:
    """(P, P_once) of a Llama: attention, SwiGLU MLP and two RMSNorms per block, embeddings, final norm, head.

    P_once is the [final norm, output head] unit that is not resharded after forward (with tied embeddings the
    embedding shares that unit).
    """
    head_dim = hidden // heads
    block = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate + 2 * hidden
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * block + embeddings + hidden, vocab * hidden + hidden


def compute_seconds(params: int, tokens: int, peak_flop_s: float, mfu: float) -> float:
    """Training compute of one step: 6 FLOP per parameter per token (Kaplan et al. 2020, eq. 2.1 and C.1)."""
    return 6 * params * tokens / (peak_flop_s * mfu)


def method_layouts(
    world_size: int, ranks_per_node: int, fl_fsdp_group: int, fl_hsdp_group: int, fl_hsdp_shard: int, sync_steps: int
) -> dict[str, tuple[FederationLayout, int | None]]:
    """FSDP over the world, HSDP sharding inside a node, FL+FSDP and FL+HSDP: each layout and its H."""
    w, r = world_size, ranks_per_node
    return {
        "FSDP": (FederationLayout(w), None),
        "HSDP": (FederationLayout(w, w, r), None),
        "FL+FSDP": (FederationLayout(w, fl_fsdp_group), sync_steps),
        "FL+HSDP": (FederationLayout(w, fl_hsdp_group, fl_hsdp_shard), sync_steps),
    }


# ---- The paper's setting -------------------------------------------------------------------------------------
# Llama 3.1 8B (Meta's config: hidden 4096, MLP 14336, 32 layers, 32 heads, 8 KV heads, vocabulary 128,256,
# untied head), 512 A100 as 128 nodes × 4, FL+FSDP group = 1 node, FL+HSDP group = 8 nodes as 8 replicas ×
# 4 shards, H = 8, 2 sequences × 2048 tokens per GPU. Hardware figures: NVIDIA A100 datasheet (312 TFLOP/s
# dense BF16; NVLink 3 at 600 GB/s both directions, so 300 GB/s each way per GPU); InfiniBand HDR: 200 Gb/s per
# port. The paper's inter-node bandwidth, latency and MFU are not known to this model: they are assumptions,
# and the CLI prints the sweep over inter-node bandwidth next to them.
LLAMA_31_8B = dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128_256)
PAPER_HEADLINE_SPEEDUP = 8.04  # "up to 8.04× faster data processing" (the paper's abstract)


@dataclass(frozen=True)
class Setting:
    """A whole scenario: model, cluster, methods, workload and the assumptions behind the time model."""

    model: ModelCost
    world_size: int = 512
    ranks_per_node: int = 4
    fl_fsdp_group: int = 4
    fl_hsdp_group: int = 32
    fl_hsdp_shard: int = 4
    sync_steps: int = 8
    tokens_per_rank: int = 2 * 2048
    peak_flop_s: float = 312e12  # A100 dense BF16, NVIDIA datasheet
    mfu: float = 0.40  # assumed model FLOP utilisation
    network: Network = Network(
        inter_node_bytes_s=200e9 / 8,  # assumed: one HDR InfiniBand port (200 Gb/s) per node
        intra_node_bytes_s=300e9,  # NVLink 3, each direction per GPU (A100 datasheet)
        inter_latency_s=5e-6,  # assumed per ring step across nodes
        intra_latency_s=1e-6,  # assumed per ring step inside a node
    )
    nodes_per_rack: int | None = None  # three tiers: nodes per rack (cell); None: two tiers

    def layouts(self) -> dict[str, tuple[FederationLayout, int | None]]:
        """Each method's layout and H (``None`` when it does not average)."""
        return method_layouts(
            self.world_size, self.ranks_per_node, self.fl_fsdp_group, self.fl_hsdp_group, self.fl_hsdp_shard,
            self.sync_steps,
        )  # fmt: skip

    def costs(self) -> dict[str, StepCost]:
        compute = compute_seconds(self.model.params, self.tokens_per_rank, self.peak_flop_s, self.mfu)
        return {
            name: step_cost(
                self.model, layout, self.ranks_per_node, h, self.network, compute, name, self.nodes_per_rack
            )
            for name, (layout, h) in self.layouts().items()
        }


def paper_setting(**overrides) -> Setting:
    params, once = llama_parameters(**LLAMA_31_8B)
    model = ModelCost(params, once, units=LLAMA_31_8B["layers"] + 2, param_bytes=2, grad_bytes=4)
    return replace(Setting(model=model), **overrides)


# ---- Three tiers: Leonardo's Booster partition, the machine the paper's setting points to ----------------------
# Published (https://leonardo-supercomputer.cineca.eu/hpc-system and CINECA's LEONARDO User Guide,
# https://wiki.u-gov.it/confluence/display/SCAIUS/LEONARDO+User+Guide, read 2026-12-03): 3456 nodes of 4 A100
# 64 GB; per node 2 × dual-port HDR100 (400 Gb/s aggregated); InfiniBand HDR in a Dragonfly+ topology, "a maximum
# bandwidth of 200 Gbit/s between each pair of nodes"; NVLink 3.0 "200 GB/s". Not published there, so assumed
# here: how many nodes a cell holds and how much its global links carry. The paper's code puts each FL+HSDP group
# on one cell, so the 128 nodes are taken as 16 cells of 8, and the cells untapered: a cell's global links carry
# its 8 nodes' 200 Gb/s each (1.6 Tb/s). The CLI sweeps that assumption.
LEONARDO_PAIR_GBIT = 200.0  # between any two nodes (the system page); a ring hop is one pair
LEONARDO_NODE_GBIT = 400.0  # a node's four HDR100 ports together (the system page)
LEONARDO_NVLINK_BYTES_S = 200e9 / 2  # "NVLink 3.0 (200GB/s)" (User Guide), read as both directions together
LEONARDO_CELL_NODES = 8  # assumed: one FL+HSDP group (8 nodes × 4 GPUs) per cell


def leonardo_setting(cell_gbit: float | None = None, **overrides) -> Setting:
    """The paper's workload on Leonardo's Booster as three tiers (GPU, node, Dragonfly+ cell), FedAvg in bf16.

    ``cell_gbit``: bandwidth of a cell's global links to the other cells, Gb/s each way (default: untapered,
    its nodes' pair bandwidth summed). bf16 FedAvg because the paper's authors averaged in bf16.
    """
    cell = LEONARDO_CELL_NODES * LEONARDO_PAIR_GBIT if cell_gbit is None else cell_gbit
    base = paper_setting()
    network = Network(
        inter_node_bytes_s=LEONARDO_PAIR_GBIT * 1e9 / 8,
        intra_node_bytes_s=LEONARDO_NVLINK_BYTES_S,
        inter_latency_s=base.network.inter_latency_s,
        intra_latency_s=base.network.intra_latency_s,
        inter_rack_bytes_s=cell * 1e9 / 8,
        inter_rack_latency_s=2 * base.network.inter_latency_s,  # assumed: a global hop adds a switch hop or two
    )
    model = replace(base.model, sync_bytes=2)
    return replace(
        base, model=model, network=network, nodes_per_rack=LEONARDO_CELL_NODES,
        fl_hsdp_group=LEONARDO_CELL_NODES * base.ranks_per_node, **overrides,
    )  # fmt: skip


def speedups(costs: dict[str, StepCost], baseline: str = "FSDP", overlapped: bool = False) -> dict[str, float]:
    """Tokens/s of each method over ``baseline``'s: all methods process the same tokens per step."""
    time = (lambda c: c.overlapped_s) if overlapped else (lambda c: c.serial_s)
    return {name: time(costs[baseline]) / time(cost) for name, cost in costs.items()}


def bandwidth_for_speedup(
    setting: Setting, method: str, target: float, baseline: str = "FSDP", tier: str = "inter_node_bytes_s"
) -> float | None:
    """Bandwidth of ``tier`` (a `Network` field: bytes/s per node, or per rack for ``inter_rack_bytes_s``) at
    which ``method`` is ``target``× faster than ``baseline`` (serial model), found by bisection on a log scale;
    ``None`` if no bandwidth in [1 Mb/s, 10 Tb/s] gives it."""

    def gap(bw: float) -> float:
        net = replace(setting.network, **{tier: bw})
        return speedups(replace(setting, network=net).costs(), baseline)[method] - target

    low, high = 1e6 / 8, 1e13 / 8
    if gap(low) < 0 or gap(high) > 0:
        return None
    for _ in range(100):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if gap(mid) > 0 else (low, mid)
    return math.sqrt(low * high)


def peak_speedup(
    setting: Setting, method: str, baseline: str = "FSDP", tier: str = "inter_node_bytes_s"
) -> tuple[float, float]:
    """(the highest speedup of ``method`` over ``baseline`` on a log grid of ``tier``'s bandwidth in [1 Mb/s,
    10 Tb/s], that bandwidth in bytes/s). It may exceed the ratio of bytes, the limit as the bandwidth falls:
    at finite bandwidth the latency of FSDP's many collectives still weighs."""
    grid = [1e6 / 8 * 10 ** (i / 20) for i in range(141)]

    def speedup(bw: float) -> float:
        net = replace(setting.network, **{tier: bw})
        return speedups(replace(setting, network=net).costs(), baseline)[method]

    best = max(grid, key=speedup)
    return speedup(best), best


def _reach(setting: Setting, method: str, limit: float, tier: str, link: str, nodes: int = 1) -> str:
    """Where ``method`` reaches the paper's speedup over ``link``'s bandwidth (``tier``, shared by ``nodes``), or
    its highest, beside its ``limit`` as the bandwidth falls (the ratio of its bytes)."""
    needed = bandwidth_for_speedup(setting, method, PAPER_HEADLINE_SPEEDUP, tier=tier)
    if needed is not None:
        gbit = needed * 8 / 1e9
        shared = f" ({gbit / nodes:.2f} Gb/s per node of the cell)" if nodes > 1 else ""
        return f"reaches {PAPER_HEADLINE_SPEEDUP}× at a {link} bandwidth of {gbit:.1f} Gb/s{shared}"
    peak, at = peak_speedup(setting, method, tier=tier)
    where = (
        "the ratio of its bytes, approached as the bandwidth falls"
        if round(peak, 2) == round(limit, 2)
        else f"at {at * 8 / 1e9:.3g} Gb/s; {limit:.2f}×, the ratio of its bytes, as the bandwidth falls"
    )
    return (
        f"does not reach {PAPER_HEADLINE_SPEEDUP}× at any {link} bandwidth from 1 Mb/s to 10 Tb/s: at most "
        f"{peak:.2f}× ({where})"
    )


def topk_bytes_per_value(codec: SparseCodec) -> float:
    """b_s of the sparse payload: a whole chunk's bytes (codes, indices, scale) over its values."""
    return codec.nbytes(codec.chunk) / codec.chunk


def payload_report(setting: Setting) -> list[str]:
    """Each ``fed_sync_dtype`` on ``setting``: b_s, the inter-node bytes a node sends per averaging under FL+FSDP,
    and FL+FSDP's and FL+HSDP's speedups over FSDP (serial model)."""
    payloads = [(name, per_value, False) for name, per_value in DENSE_BYTES_PER_VALUE.items()]
    payloads += [(f"topk {d:g}, {b} bits, chunk 4096", topk_bytes_per_value(SparseCodec(d, b, 4096)), True)
                 for d, b in ((0.01, 2), (0.03, 2), (0.01, 8))]  # fmt: skip
    groups = setting.world_size // setting.fl_fsdp_group
    lines = [
        "Payloads (fed_sync_dtype): bytes a rank sends per value of its shard and averaging with G groups (ring "
        "all-reduce 2 (G-1)/G b_s; topk's gather (G-1) b_s), then on this setting (FL+FSDP: "
        f"{groups} groups):",
        f"payload                        b_s      G=2     G=4     G={groups:<4} inter GB/node per averaging  FL+FSDP  "
        "FL+HSDP",
    ]
    for name, per_value, gathered in payloads:
        sent = [(g - 1) * per_value if gathered else 2 * (g - 1) / g * per_value for g in (2, 4, groups)]
        model = replace(setting.model, sync_bytes=per_value, gathered_sync=gathered)
        costs = replace(setting, model=model).costs()
        ideal = replace(setting, model=model, sync_steps=10**9).costs()["FL+FSDP"].inter_bytes_per_node  # no averaging
        averaging = (costs["FL+FSDP"].inter_bytes_per_node - ideal) * setting.sync_steps
        speedup = speedups(costs)
        per_group = "".join(f"{x:7.3f} " for x in sent)
        lines.append(f"{name:<30} {per_value:7.4f} {per_group}  {_gb(averaging)}                   "
                     f"{speedup['FL+FSDP']:6.2f}× {speedup['FL+HSDP']:6.2f}×")  # fmt: skip
    return lines


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:8.2f}"


def report(setting: Setting) -> str:
    """The projection for ``setting`` as text: bytes per tier, step times, speedups, and the bandwidth sweep."""
    m, net = setting.model, setting.network
    costs = setting.costs()
    compute = next(iter(costs.values())).compute_s
    lines = [
        f"Model: P = {m.params:,} parameters ({m.once_params:,} gathered once per step), {m.units} FSDP units; "
        f"all-gather {m.param_bytes} B/element, gradient reduction {m.grad_bytes} B, FedAvg {m.sync_bytes} B.",
        f"Cluster: {setting.world_size} ranks = {setting.world_size // setting.ranks_per_node} nodes × "
        f"{setting.ranks_per_node}; inter-node {net.inter_node_bytes_s * 8 / 1e9:g} Gb/s per node, intra-node "
        f"{net.intra_node_bytes_s / 1e9:g} GB/s per rank; latency {net.inter_latency_s * 1e6:g} / "
        f"{net.intra_latency_s * 1e6:g} µs per ring step.",
        f"Workload: {setting.tokens_per_rank} tokens per rank per step; compute = 6 P tokens / "
        f"({setting.peak_flop_s / 1e12:g} TFLOP/s × MFU {setting.mfu:g}) = {compute:.3f} s; H = {setting.sync_steps}; "
        f"FL+FSDP group {setting.fl_fsdp_group}, FL+HSDP group {setting.fl_hsdp_group} = "
        f"{setting.fl_hsdp_group // setting.fl_hsdp_shard} replicas × {setting.fl_hsdp_shard} shards.",
        "",
        "method    intra GB/rank  inter GB/rank  inter GB/node  comm s   serial s  overlap s  speedup serial, overlap",
    ]
    serial, overlap = speedups(costs), speedups(costs, overlapped=True)
    for name, c in costs.items():
        lines.append(
            f"{name:<9} {_gb(c.intra_bytes_per_rank)}       {_gb(c.inter_bytes_per_rank)}       "
            f"{_gb(c.inter_bytes_per_node)}    {c.comm_s:7.3f}  {c.serial_s:7.3f}   {c.overlapped_s:7.3f}    "
            f"{serial[name]:6.2f}× {overlap[name]:6.2f}×"
        )
    lines += ["", "Speedup over FSDP (serial model) against the inter-node bandwidth per node:"]
    sweep = (25, 50, 100, 200, 400, 800, 1600)
    lines.append("Gb/s/node " + "".join(f"{bw:>8}" for bw in sweep))
    at_bandwidth = [
        speedups(replace(setting, network=replace(net, inter_node_bytes_s=bw * 1e9 / 8)).costs()) for bw in sweep
    ]
    for name in ("HSDP", "FL+FSDP", "FL+HSDP"):
        lines.append(f"{name:<10}" + "".join(f"{speedup[name]:7.2f}×" for speedup in at_bandwidth))
    lines += ["", *payload_report(setting), "", *headline(setting, costs)]
    return "\n".join(lines)


def headline(setting: Setting, costs: dict[str, StepCost]) -> list[str]:
    """The projection beside the paper's headline (``costs``: ``setting.costs()``), and why they differ."""
    serial = speedups(costs)
    best = max(("FL+FSDP", "FL+HSDP"), key=serial.get)
    ceiling = costs["FSDP"].inter_bytes_per_node / costs[best].inter_bytes_per_node
    bf16 = replace(setting, model=replace(setting.model, sync_bytes=2)).costs()
    return [
        f"Paper: up to {PAPER_HEADLINE_SPEEDUP}× faster data processing. This model: {best} {serial[best]:.2f}× "
        f"over FSDP (serial), {speedups(costs, overlapped=True)[best]:.2f}× (compute and communication overlapped).",
        f"Limit as inter-node bandwidth -> 0 (ratio of inter-node bytes per node): {ceiling:.2f}× with FedAvg in "
        f"fp32, {costs['FSDP'].inter_bytes_per_node / bf16[best].inter_bytes_per_node:.2f}× if it were in bf16. "
        f"{best} {_reach(setting, best, ceiling, 'inter_node_bytes_s', 'per-node inter-node')}, everything else as "
        "above.",
        "Why they differ: the paper measured its cluster, this model assumes its bandwidth, latency and MFU; it "
        "counts bytes of ring collectives at nominal rates, with no congestion between nodes, no stragglers, no "
        "tree or hierarchical algorithms, no memory effects (FSDP over 512 GPUs frees more memory, FL+FSDP must "
        "hold a node's shard) and no change of batch size. A measured speedup above the model's at this bandwidth "
        "means the cluster's effective inter-node bandwidth under FSDP's traffic is lower than assumed. In this "
        "two-tier model FL+HSDP sends about as many inter-node bytes as HSDP (its replicas still all-reduce "
        "gradients across the group's nodes at every step); a gain there needs a third tier (nodes of a group "
        "closer to each other than to other groups) or latency-bound collectives.",
    ]


def three_tier_report(setting: Setting) -> str:
    """The projection on three tiers (``setting.nodes_per_rack`` set), the sweep over the inter-cell bandwidth,
    the bandwidth at which FL+FSDP and FL+HSDP reach the paper's 8.04×, and what that requires."""
    net, cell = setting.network, setting.nodes_per_rack
    costs = setting.costs()
    serial, overlap = speedups(costs), speedups(costs, overlapped=True)
    fedavg = {2: "bf16", 4: "fp32"}.get(setting.model.sync_bytes, f"{setting.model.sync_bytes} B")
    lines = [
        f"Three tiers, Leonardo Booster: {setting.world_size} A100 = {setting.world_size // setting.ranks_per_node} "
        f"nodes × {setting.ranks_per_node} in cells of {cell} nodes (assumed; FL+HSDP group = a cell); node pair "
        f"{net.inter_node_bytes_s * 8 / 1e9:g} Gb/s (published; {LEONARDO_NODE_GBIT:g} Gb/s of ports per node), "
        f"NVLink {net.intra_node_bytes_s / 1e9:g} GB/s each way (published 200 GB/s), cell uplink "
        f"{net.inter_rack_bytes_s * 8 / 1e9:g} Gb/s (assumed); FedAvg in {fedavg}; MFU {setting.mfu:g}, H = "
        f"{setting.sync_steps}.",
        "",
        "method    inter GB/node  inter-cell GB/cell  comm s   serial s  speedup serial, overlap",
    ]
    for name, c in costs.items():
        lines.append(
            f"{name:<9} {_gb(c.inter_bytes_per_node)}       {_gb(c.inter_rack_bytes_per_rack)}          "
            f"{c.comm_s:7.3f}  {c.serial_s:7.3f}    {serial[name]:6.2f}× {overlap[name]:6.2f}×"
        )
    sweep = (12.5, 25, 50, 100, 200, 400, 800, 1600)
    lines += ["", "Speedup over FSDP (serial model) against a cell's uplink bandwidth:"]
    lines.append("Gb/s/cell " + "".join(f"{bw:>8g}" for bw in sweep))
    at = [speedups(replace(setting, network=replace(net, inter_rack_bytes_s=bw * 1e9 / 8)).costs()) for bw in sweep]
    for name in ("HSDP", "FL+FSDP", "FL+HSDP"):
        lines.append(f"{name:<10}" + "".join(f"{speedup[name]:7.2f}×" for speedup in at))
    lines.append("")
    for name in ("FL+FSDP", "FL+HSDP"):
        ceiling = costs["FSDP"].inter_rack_bytes_per_rack / costs[name].inter_rack_bytes_per_rack
        lines.append(f"{name} {_reach(setting, name, ceiling, 'inter_rack_bytes_s', 'cell uplink', cell)}.")
    fp32 = replace(setting, model=replace(setting.model, sync_bytes=4)).costs()
    fp32_ceiling = costs["FSDP"].inter_rack_bytes_per_rack / fp32["FL+FSDP"].inter_rack_bytes_per_rack
    lines += [
        "",
        f"What would have to be true for {PAPER_HEADLINE_SPEEDUP}×: in this model only FL+FSDP gets there, and only "
        "when the links leaving a cell are the bottleneck of FSDP's step: the job's share of a cell's global links "
        "around the figure above, an order of magnitude or two below its nodes' own links (a tapered Dragonfly+, "
        "global links shared with other jobs, or FSDP's many concurrent all-gather and reduce-scatter flows "
        "getting far less than the nominal rate), with FedAvg in bf16: in fp32 the ceiling is "
        f"{fp32_ceiling:.2f}×, below {PAPER_HEADLINE_SPEEDUP}×. FL+HSDP, as hf_fedshard averages it (every replica "
        f"all-reduces its shard across the cells, {cell} copies per cell), cannot: its replicas also all-reduce "
        "gradients between the cell's nodes at every step, at the node tier's rate. None of the cell figures is "
        "published with the machine's description; a measurement of FSDP's inter-cell throughput on the paper's "
        "placement would settle which of these holds.",
    ]
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    setting = paper_setting()
    parser = argparse.ArgumentParser(  # a one-line description: help lines wrap to the terminal, defaults shown
        prog="python -m hf_fedshard.tools.cost",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    two_tier = "two-tier projection only; the three-tier one is Leonardo's"
    parser.add_argument(
        "--inter-node-gbit",
        type=float,
        default=setting.network.inter_node_bytes_s * 8 / 1e9,
        help=f"Inter-node bandwidth per node, Gb/s: one HDR InfiniBand port ({two_tier}).",
    )
    parser.add_argument("--mfu", type=float, default=setting.mfu, help="Model FLOP utilisation of the compute.")
    parser.add_argument("--sync-steps", type=int, default=setting.sync_steps, help="H: steps between two averagings.")
    parser.add_argument(
        "--world-size", type=int, default=setting.world_size, help=f"Ranks (GPUs) in the job ({two_tier})."
    )
    parser.add_argument(
        "--ranks-per-node", type=int, default=setting.ranks_per_node, help=f"Ranks per node ({two_tier})."
    )
    parser.add_argument(
        "--cell-gbit",
        type=float,
        default=LEONARDO_CELL_NODES * LEONARDO_PAIR_GBIT,
        help="Three tiers: a Leonardo cell's uplink, Gb/s: its nodes' pair links added up (untapered, assumed).",
    )
    return parser  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    base = paper_setting()
    setting = replace(
        base,
        world_size=args.world_size,
        ranks_per_node=args.ranks_per_node,
        sync_steps=args.sync_steps,
        mfu=args.mfu,
        network=replace(base.network, inter_node_bytes_s=args.inter_node_gbit * 1e9 / 8),
    )
    print(report(setting))
    print()
    print(three_tier_report(leonardo_setting(args.cell_gbit, sync_steps=args.sync_steps, mfu=args.mfu)))


if __name__ == "__main__":
    main()

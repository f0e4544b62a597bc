"""The cost model on hand-checkable cases, its closed forms against its ring counting, and its CLI."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.harness.cost_model import GLOO, sync_bytes_per_value
from hf_fedshard.engine.sparse import SparseCodec
from hf_fedshard.tools.cost import (
    PAPER_HEADLINE_SPEEDUP,
    RING,
    ModelCost,
    Network,
    bandwidth_for_speedup,
    llama_parameters,
    main,
    make_parser,
    paper_setting,
    payload_report,
    peak_speedup,
    ring_hop_bytes,
    ring_hops,
    speedups,
    step_cost,
    topk_bytes_per_value,
)
from hf_fedshard.tools.models import PRESETS, llama_config
from hf_fedshard.topology import FederationLayout

from ..launch import REPO


def test_ring_hop_bytes_of_each_collective():
    assert ring_hop_bytes("all_gather", 4, 1000) == 750
    assert ring_hop_bytes("reduce_scatter", 4, 1000, RING) == 750
    assert ring_hop_bytes("reduce_scatter", 4, 1000, GLOO) == 1500  # gloo all-reduces the input
    assert ring_hop_bytes("all_reduce", 4, 1000) == 1500
    assert ring_hop_bytes("all_reduce", 1, 1000) == 0
    with pytest.raises(ValueError, match="kind='broadcast'"):
        ring_hop_bytes("broadcast", 4, 1000)


@pytest.mark.parametrize(
    ("ring", "ranks_per_node", "hops"),
    [([0, 1, 2, 3], 2, (2, 2)), ([0, 2], 2, (0, 2)), ([0, 1], 2, (2, 0)), ([5], 2, (0, 0)), ([0, 4, 8, 12], 8, (2, 2))],
)
def test_ring_hops_count_node_crossings(ring, ranks_per_node, hops):
    assert ring_hops(ring, ranks_per_node) == hops


def test_two_groups_one_step_exact_bytes():
    """FL+FSDP, 2 nodes × 2 ranks, a group per node, H = 1, P = 1000 fp32, nothing gathered once.

    Fed rings {0, 2} and {1, 3} all-reduce a 2000-byte shard: 2 × 1/2 × 2000 = 2000 bytes per hop, 2 hops
    each, both across nodes: 8000 bytes, 4000 per node, 2000 per rank. Shard rings {0, 1} and {2, 3}:
    all-gather 4 × 2 × 1000 = 8000 bytes (4000 a hop) and reduce-scatter 4000 (2000 a hop), 2 hops each,
    inside the node: 2 × 2 × 6000 = 24000 bytes, 6000 per rank.
    """
    model = ModelCost(params=1000, once_params=0, units=1, param_bytes=4, grad_bytes=4, sync_bytes=4)
    cost = step_cost(model, FederationLayout(4, 2), ranks_per_node=2, sync_steps=1)
    assert (cost.inter_bytes_per_node, cost.inter_bytes_per_rank, cost.intra_bytes_per_rank) == (4000, 2000, 6000)
    assert step_cost(model, FederationLayout(4, 2), 2, sync_steps=8).inter_bytes_per_rank == 250
    assert step_cost(model, FederationLayout(4, 2), 2, sync_steps=None).inter_bytes_per_rank == 0  # the ideal


def test_step_time_is_bytes_over_bandwidth_plus_compute():
    model = ModelCost(params=1000, once_params=0, units=1, param_bytes=4, grad_bytes=4, sync_bytes=4)
    network = Network(inter_node_bytes_s=1000, intra_node_bytes_s=math.inf)
    cost = step_cost(model, FederationLayout(4, 2), 2, 1, network, compute_s=1.5)
    assert cost.comm_s == pytest.approx(4.0)  # 4000 bytes through each node's uplink at 1000 B/s
    assert (cost.serial_s, cost.overlapped_s) == (pytest.approx(5.5), pytest.approx(4.0))


def test_overlap_hides_the_exchange_behind_tau_steps():
    """FL+FSDP 2 nodes × 2, P = 1000 fp32, H = 8: an averaging sends 4000 bytes per node, 4 s at 1000 B/s.

    Blocking: 4 s every 8 steps, 0.5 s per step. τ = 1 behind a 1.5 s step: 4 − 1.5 = 2.5 s exposed every 8
    steps. F = 4, τ = 1: each fragment's exchange takes 1 s < 1.5 s, so nothing is exposed.
    """
    model = ModelCost(params=1000, once_params=0, units=1, param_bytes=4, grad_bytes=4, sync_bytes=4)
    network = Network(inter_node_bytes_s=1000, intra_node_bytes_s=math.inf)
    layout = FederationLayout(4, 2)
    blocking = step_cost(model, layout, 2, 8, network, compute_s=1.5)
    assert blocking.comm_s == pytest.approx(0.5)
    assert step_cost(model, layout, 2, 8, network, 1.5, overlap=1).comm_s == pytest.approx(2.5 / 8)
    streamed = step_cost(model, layout, 2, 8, network, 1.5, fragments=4, overlap=1)
    assert streamed.comm_s == pytest.approx(0.0)
    assert streamed.inter_bytes_per_node == blocking.inter_bytes_per_node  # the same bytes, hidden


P, ONCE = 10_000, 1_000
B_P, B_G, B_S = 2, 4, 4


@pytest.mark.parametrize(("world", "per_node"), [(4, 2), (8, 2), (16, 4), (512, 4)])
def test_closed_forms_match_ring_counting(world, per_node):
    """The module docstring's closed forms (bytes a node sends per step), RING reduce-scatter, H = 8."""
    model = ModelCost(P, ONCE, units=3, param_bytes=B_P, grad_bytes=B_G, sync_bytes=B_S)
    a, nodes, h = B_P * (2 * P - ONCE), world // per_node, 8
    q = 2  # FL+HSDP: 2 nodes per group
    expected = {
        FederationLayout(world): (world - 1) / world * (a + B_G * P),
        FederationLayout(world, world, per_node): 2 * (nodes - 1) / nodes * B_G * P,
        FederationLayout(world, per_node): 2 * (nodes - 1) / nodes * B_S * P / h,
        FederationLayout(world, q * per_node, per_node): 2 * (q - 1) / q * B_G * P
        + 2 * (nodes // q - 1) / (nodes // q) * B_S * P / h,
    }
    for layout, per_node_bytes in expected.items():
        cost = step_cost(model, layout, per_node, h)
        assert cost.inter_bytes_per_node == pytest.approx(per_node_bytes), layout.method
        assert cost.inter_bytes_per_rank == pytest.approx(per_node_bytes / per_node), layout.method


def test_local_sgd_is_groups_of_one_rank():
    """LocalSGD (DDP, world all-reduce of fp32 parameters every H steps) as groups of one rank."""
    model = ModelCost(P, ONCE, units=3)
    cost = step_cost(model, FederationLayout(4, 1, 1), ranks_per_node=2, sync_steps=8)
    assert cost.inter_bytes_per_node == pytest.approx(2 * 3 / 4 * 4 * P / 8)  # one ring hop out of each node


def test_errors_name_the_values():
    model = ModelCost(P, ONCE, units=3)
    with pytest.raises(ValueError, match="ranks_per_node=3 must divide WORLD_SIZE"):
        step_cost(model, FederationLayout(4, 2), ranks_per_node=3, sync_steps=8)
    with pytest.raises(ValueError, match="sync_steps=0"):
        step_cost(model, FederationLayout(4, 2), ranks_per_node=2, sync_steps=0)
    with pytest.raises(ValueError, match="once_params=20 must lie in"):
        ModelCost(10, 20, units=1)


@pytest.mark.parametrize("size", ["micro", "tiny", "small"])
def test_llama_parameter_count_matches_transformers(size):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama_config(size, 8192, 128))
    shape = PRESETS[size]
    params, once = llama_parameters(
        shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["num_attention_heads"],
        shape["num_key_value_heads"], 8192,
    )  # fmt: skip
    assert params == sum(p.numel() for p in model.parameters())
    assert once == sum(p.numel() for n, p in model.named_parameters() if n.startswith(("lm_head.", "model.norm.")))


def test_paper_setting_and_bandwidth_for_speedup():
    setting = paper_setting()
    assert setting.model.params == 8_030_261_248  # Llama 3.1 8B
    costs = setting.costs()
    assert speedups(costs)["FSDP"] == 1.0
    assert costs["FL+FSDP"].inter_bytes_per_node < costs["FSDP"].inter_bytes_per_node / 7
    bandwidth = bandwidth_for_speedup(setting, "FL+FSDP", 3.0)
    from dataclasses import replace

    at = replace(setting, network=replace(setting.network, inter_node_bytes_s=bandwidth))
    assert speedups(at.costs())["FL+FSDP"] == pytest.approx(3.0, rel=1e-6)
    ceiling = costs["FSDP"].inter_bytes_per_node / costs["FL+FSDP"].inter_bytes_per_node
    assert bandwidth_for_speedup(setting, "FL+FSDP", ceiling + 0.5) is None


def test_cli_prints_projection_beside_the_headline(capsys):
    main(["--inter-node-gbit", "100"])
    out = capsys.readouterr().out
    for text in ("FSDP", "HSDP", "FL+FSDP", "FL+HSDP", f"{PAPER_HEADLINE_SPEEDUP}×", "Why they differ", "100 Gb/s"):
        assert text in out


def test_payload_dtype_scales_the_averaging_bytes():
    assert [sync_bytes_per_value(d) for d in ("float32", "bfloat16")] == [4, 2]
    assert sync_bytes_per_value("int8") == pytest.approx(1 + 4 / 256)  # one fp32 scale per 256 values
    fp32 = ModelCost(params=1000, once_params=0, units=1, sync_bytes=4)
    bf16 = ModelCost(params=1000, once_params=0, units=1, sync_bytes=2)
    costs = [step_cost(m, FederationLayout(4, 2), 2, sync_steps=1).inter_bytes_per_node for m in (fp32, bf16)]
    assert costs[1] * 2 == costs[0] == 4000


def test_the_sparse_payload_is_gathered_so_its_bytes_grow_with_the_groups():
    """topk at 1%, 2 bits, chunks of 4096: 41 values a chunk, 11 bytes of codes, 82 of uint16 indices, 4 of scale.
    FL+FSDP of 1000 parameters, one rank per node, H = 1: a gather of G groups sends (G - 1) · b_s · P per rank."""
    b_s = topk_bytes_per_value(SparseCodec(0.01, 2, 4096))
    assert b_s == (11 + 82 + 4) / 4096
    model = ModelCost(params=1000, once_params=0, units=1, sync_bytes=b_s, gathered_sync=True)
    for groups in (2, 4):
        cost = step_cost(model, FederationLayout(groups, 1), 1, sync_steps=1)
        assert cost.inter_bytes_per_node == pytest.approx((groups - 1) * b_s * 1000, rel=1e-12)
    lines = payload_report(paper_setting())
    assert any(line.startswith("topk 0.01, 2 bits, chunk 4096   0.0237   0.024   0.071") for line in lines), lines


def test_split_exchange_divides_the_inter_group_bytes_by_the_replicas():
    """FL+HSDP, 8 ranks, 2 groups of 2 replicas × 2 shards, one node per group (R = 4), H = 1, P = 1000.

    Unsplit: fed rings {j, 4 + j} all-reduce the 2000-byte shard: 2000 bytes a hop, 2 hops, 4 rings: 16000
    across nodes. Split: each sends half the shard (8000), then the replicas all-gather the 2000-byte fp32 mean
    inside the node (1000 a hop, 2 hops, 4 rings: 8000 more intra-node bytes).
    """
    layout = FederationLayout(8, 4, 2)
    plain = ModelCost(params=1000, once_params=0, units=1, sync_bytes=4, grad_bytes=0, param_bytes=0)
    split = ModelCost(params=1000, once_params=0, units=1, sync_bytes=4, grad_bytes=0, param_bytes=0,
                      split_exchange=True)  # fmt: skip
    unsplit_cost, split_cost = (step_cost(m, layout, 4, sync_steps=1) for m in (plain, split))
    assert unsplit_cost.inter_bytes_per_node * 2 == 16000
    assert split_cost.inter_bytes_per_node * 2 == 8000
    assert (split_cost.intra_bytes_per_rank - unsplit_cost.intra_bytes_per_rank) * 8 == 8000


def test_three_tiers_two_racks_exact_bytes():
    """2 racks × 2 nodes × 2 ranks (W = 8), P = 1000, 4 B everywhere, H = 1.

    HSDP (shard in a node, 4 replicas): replicate rings {0,2,4,6} and {1,3,5,7} all-reduce a 2000-byte shard,
    2 × 3/4 × 2000 = 3000 bytes a hop; each ring leaves every node once (6000 per node) and each rack once
    (hops 2->4 and 6->0 or 3->5 and 7->1): 6000 per rack. FL+HSDP (a group per rack, 2 replicas × 2 shards):
    replicate rings {0,2}, {1,3}, {4,6}, {5,7} stay in the rack (2000 a hop, 4000 per node); fed rings {0,4},
    {1,5}, {2,6}, {3,7} average a 2000-byte shard, 2000 a hop, every hop across racks: 4000 more per node and
    4 hops × 2000 = 8000 per rack.
    """
    model = ModelCost(params=1000, once_params=0, units=1, param_bytes=4, grad_bytes=4, sync_bytes=4)
    hsdp = step_cost(model, FederationLayout(8, 8, 2), 2, None, nodes_per_rack=2)
    fl_hsdp = step_cost(model, FederationLayout(8, 4, 2), 2, 1, nodes_per_rack=2)
    assert (hsdp.inter_bytes_per_node, hsdp.inter_rack_bytes_per_rack) == (6000, 6000)
    assert (fl_hsdp.inter_bytes_per_node, fl_hsdp.inter_rack_bytes_per_rack) == (8000, 8000)
    assert step_cost(model, FederationLayout(8, 4, 2), 2, 8, nodes_per_rack=2).inter_rack_bytes_per_rack == 1000
    assert step_cost(model, FederationLayout(8, 4, 2), 2, 1).inter_rack_bytes_per_rack == 0  # two tiers


def test_three_tier_time_adds_the_rack_uplink():
    """HSDP above on links of 1000 B/s per node and 100 B/s per rack: 6000 / 1000 + 6000 / 100 = 66 s."""
    model = ModelCost(params=1000, once_params=0, units=1, param_bytes=4, grad_bytes=4, sync_bytes=4)
    network = Network(inter_node_bytes_s=1000, intra_node_bytes_s=math.inf, inter_rack_bytes_s=100)
    cost = step_cost(model, FederationLayout(8, 8, 2), 2, None, network, nodes_per_rack=2)
    assert cost.comm_s == pytest.approx(66.0)
    two_tier = step_cost(model, FederationLayout(8, 8, 2), 2, None, network)
    assert two_tier.comm_s == pytest.approx(6.0)  # one rack: its uplink is never crossed


@pytest.mark.parametrize(("world", "per_node", "per_rack"), [(8, 2, 2), (16, 2, 2), (32, 4, 2), (512, 4, 8)])
def test_three_tier_closed_forms_match_ring_counting(world, per_node, per_rack):
    """The module docstring's bytes per rack uplink per step (RING reduce-scatter, H = 8, FL+HSDP group = rack)."""
    model = ModelCost(P, ONCE, units=3, param_bytes=B_P, grad_bytes=B_G, sync_bytes=B_S)
    a, nodes, h = B_P * (2 * P - ONCE), world // per_node, 8
    racks, q = nodes // per_rack, world // per_node
    expected = {
        FederationLayout(world): (world - 1) / world * (a + B_G * P),
        FederationLayout(world, world, per_node): 2 * (q - 1) / q * B_G * P,
        FederationLayout(world, per_node): 2 * (nodes - 1) / nodes * B_S * P / h,
        FederationLayout(world, per_rack * per_node, per_node): per_rack * 2 * (racks - 1) / racks * B_S * P / h,
    }
    for layout, per_rack_bytes in expected.items():
        cost = step_cost(model, layout, per_node, h, nodes_per_rack=per_rack)
        assert cost.inter_rack_bytes_per_rack == pytest.approx(per_rack_bytes), layout.method
        two_tier = step_cost(model, layout, per_node, h)  # the node tier does not change with racks
        assert cost.inter_bytes_per_node == pytest.approx(two_tier.inter_bytes_per_node), layout.method


def test_racks_must_divide_the_nodes():
    with pytest.raises(ValueError, match="nodes_per_rack=3 must divide the number of nodes"):
        step_cost(ModelCost(P, ONCE, units=3), FederationLayout(8, 2), 2, 8, nodes_per_rack=3)


def test_leonardo_three_tier_projection():
    """bf16 FedAvg on cells of 8 nodes: FL+FSDP reaches the paper's 8.04× at some cell bandwidth, FL+HSDP at none."""
    from dataclasses import replace

    from hf_fedshard.tools.cost import leonardo_setting

    setting = leonardo_setting()
    assert (setting.nodes_per_rack, setting.model.sync_bytes, setting.fl_hsdp_group) == (8, 2, 32)
    costs = setting.costs()
    # FSDP's world ring leaves each cell once per step, as it leaves each node: the same bytes on both tiers.
    assert costs["FSDP"].inter_rack_bytes_per_rack == pytest.approx(costs["FSDP"].inter_bytes_per_node)
    needed = bandwidth_for_speedup(setting, "FL+FSDP", PAPER_HEADLINE_SPEEDUP, tier="inter_rack_bytes_s")
    at = replace(setting, network=replace(setting.network, inter_rack_bytes_s=needed))
    assert speedups(at.costs())["FL+FSDP"] == pytest.approx(PAPER_HEADLINE_SPEEDUP, rel=1e-6)
    assert bandwidth_for_speedup(setting, "FL+HSDP", PAPER_HEADLINE_SPEEDUP, tier="inter_rack_bytes_s") is None


def test_cli_prints_the_three_tier_setting(capsys):
    main(["--cell-gbit", "100"])
    out = capsys.readouterr().out
    for text in ("Three tiers, Leonardo Booster", "cell uplink 100 Gb/s", "FedAvg in bf16", "What would have to be"):
        assert text in out


def test_model_state_per_rank_and_largest_model():
    """16 B per parameter (fp32 weights, gradients, two AdamW moments), 24 B with an outer optimizer, over S ranks."""
    from benchmarks.harness.cost_model import largest_model_params, model_state_bytes_per_rank

    assert model_state_bytes_per_rank(1000, FederationLayout(8)) == 2000  # FSDP over 8 ranks
    assert model_state_bytes_per_rank(1000, FederationLayout(8, 8, 2)) == 8000  # HSDP: shards of 2
    assert model_state_bytes_per_rank(1000, FederationLayout(8, 1, 1)) == 16000  # LocalSGD: a whole model
    assert model_state_bytes_per_rank(1000, FederationLayout(8, 2), outer_optimizer=True) == 12000
    assert largest_model_params(64e9, FederationLayout(512, 4)) == 16_000_000_000  # 64 GB, FL+FSDP over 4 GPUs


@pytest.mark.parametrize(
    ("sizes", "shard", "inter_mb"),
    [
        ((2, 2, 2, 2), None, 2 * 3 * 24),  # the equal layout: 2 (F-1) copies of the 24 MB model
        ((4, 2, 2), None, 2 * 2 * 24),  # 3 groups: each piece to its owner and back from 2 other groups
        ((4, 2, 2), 2, 2 * 2 * 24 + 24),  # group 0's replicas sit on nodes 0 and 1: the fan-out crosses once more
        ((6, 2), None, 2 * 1 * 24),
    ],
)
def test_groups_of_unequal_size_send_each_piece_to_its_owner_and_back(sizes, shard, inter_mb):
    """Inter-node bytes of one averaging (2 ranks per node, the 4-node world of the benchmarks), from the engine's
    own piece plan: the averaging alone, what the step costs beyond the same layout without averaging."""
    model = ModelCost(params=6_000_000, once_params=0, units=4)
    layout = FederationLayout(8, sizes, shard)
    averaging = (
        step_cost(model, layout, 2, 1).inter_bytes_per_node - step_cost(model, layout, 2, None).inter_bytes_per_node
    )
    assert averaging * 4 == pytest.approx(inter_mb * 1e6, rel=1e-9)


def test_the_output_quoted_in_benchmarks_readme_is_what_the_tool_prints(capsys):
    """benchmarks/README.md quotes the three-tier part of ``python -m hf_fedshard.tools.cost`` and its "what would
    have to be true" paragraph: both must be the tool's output now (a figure the model changes changes the quote)."""
    main([])
    printed = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(printed) if line.startswith("Three tiers,"))
    end = next(i for i, line in enumerate(printed) if line.startswith("What would have to be true"))
    readme = (REPO / "benchmarks" / "README.md").read_text()
    quoted = readme.split("Output of `python -m hf_fedshard.tools.cost` (three-tier part):\n\n```\n", 1)[1]
    assert quoted.split("\n```", 1)[0] == "\n".join(printed[start:end]).rstrip("\n")
    paragraph = readme.split("**What would have to be true for 8.04×** (printed by the same command): ", 1)[1]
    assert paragraph.split("\n", 1)[0] == printed[end].split(": ", 1)[1]


def test_help_names_the_module_and_gives_every_option_a_help_and_its_default():
    """``--help`` is what a reader runs first: it must show the command they type and what each option does."""
    parser = make_parser()
    assert parser.format_usage().startswith("usage: python -m hf_fedshard.tools.cost ")
    options = [a for a in parser._actions if a.dest != "help"]
    assert all(a.help and a.default is not None for a in options), [a.dest for a in options]
    text = " ".join(parser.format_help().split())
    assert "(default: 200.0)" in text and "(default: 1600.0)" in text


def test_no_speedup_printed_exceeds_the_limit_it_is_given():
    """The printed limit of a method that never reaches 8.04× (the ratio of its bytes) bounds the speedup at every
    bandwidth: the tool once printed a "ceiling" below a figure it reached."""
    setting = paper_setting()
    peak, _ = peak_speedup(setting, "FL+FSDP")
    costs = setting.costs()
    assert peak <= costs["FSDP"].inter_bytes_per_node / costs["FL+FSDP"].inter_bytes_per_node + 1e-9
    assert peak < PAPER_HEADLINE_SPEEDUP

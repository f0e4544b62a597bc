"""Plan a federation for your cluster: the cost model's step time and speed-up of each method at each H.

    python -m hf_fedshard.tools.plan --preset paper                 # the paper's 512 A100 (README: 2.41× / 1.17×)
    python -m hf_fedshard.tools.plan --preset leonardo --nodes 32   # your job on Leonardo's Booster
    python -m hf_fedshard.tools.plan --nodes 16 --gpus-per-node 8 --node-gbit 400 --intra-gbyte 450 \\
        --model llama-8b --tokens-per-gpu 8192 --peak-tflops 989 --sync-steps 4 8 16 32
    python -m hf_fedshard.tools.plan --nodes 64 --gpus-per-node 4 --node-gbit 200 --rack-nodes 16 --rack-gbit 800 \\
        --config path/to/config.json --payload bfloat16              # three tiers, a Hub model's config.json

What you know about the cluster goes in: nodes, GPUs per node, the bandwidth of each tier (inside a node per GPU,
a node's uplink, and optionally a rack's or cell's uplink for a third tier), the model, the tokens per GPU per step
and the GPU's speed. Out comes, for FSDP, HSDP, FL+FSDP and FL+HSDP at each H, the predicted time of an optimizer
step and the speed-up over FSDP, computed by `hf_fedshard.tools.cost` (ring collectives at nominal rates, see its
docstring for what it counts and what it leaves out). It is a model, not a measurement: use it to choose what to
measure first (benchmarks/README.md compares it with measured runs on emulated tiers).

Group placement follows the paper: an FL+FSDP group is one node (``--fl-fsdp-nodes``), an FL+HSDP group a rack (or
``--fl-hsdp-nodes`` nodes), sharded inside a node and replicated across the group's nodes.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

from hf_fedshard.tools.cost import (
    DENSE_BYTES_PER_VALUE,
    LEONARDO_CELL_NODES,
    LEONARDO_NVLINK_BYTES_S,
    LEONARDO_PAIR_GBIT,
    ModelCost,
    Network,
    Setting,
    llama_parameters,
    speedups,
)
from hf_fedshard.tools.models import PRESETS as MODEL_SIZES

LLAMA3_VOCAB = 128_256

# Named clusters: every field a flag can override. ``paper`` is the README's projection of the paper's setting
# (Llama 3.1 8B on 512 A100 = 128 nodes × 4 of Leonardo's Booster, cells of 8 nodes assumed, FedAvg in bf16 as the
# authors averaged, MFU 0.4); ``leonardo`` is the machine alone, for a job of your own size and model.
# A node's uplink is the pair bandwidth (200 Gb/s), not its 400 Gb/s of ports: each ring hop is one pair of nodes.
LEONARDO = {"gpus_per_node": 4, "node_gbit": LEONARDO_PAIR_GBIT, "intra_gbyte": LEONARDO_NVLINK_BYTES_S / 1e9,
            "rack_nodes": LEONARDO_CELL_NODES, "rack_gbit": LEONARDO_CELL_NODES * LEONARDO_PAIR_GBIT,
            "peak_tflops": 312.0}  # fmt: skip
CLUSTERS = {
    "paper": {
        **LEONARDO,
        "nodes": 128,
        "model": "llama-8b",
        "tokens_per_gpu": 2 * 2048,
        "payload": "bfloat16",
        "sync_steps": [8],
    },
    "leonardo": {**LEONARDO, "nodes": 16},
}
DEFAULTS = {"model": "llama-8b", "tokens_per_gpu": 4096, "mfu": 0.4, "payload": "float32", "sync_steps": [4, 8, 16, 32],
            "inter_latency_us": 5.0, "intra_latency_us": 1.0}  # fmt: skip
REQUIRED = ("nodes", "gpus_per_node", "node_gbit", "intra_gbyte", "peak_tflops")


def model_cost(model: str | None, config: Path | None, payload: str) -> tuple[ModelCost, str]:
    """The model's bytes per step (a preset of ``--model_size``, or a Hub ``config.json``) and its name."""
    if config is None and model not in MODEL_SIZES:
        raise SystemExit(f"error: --model={model} is not a preset: choose one of {', '.join(MODEL_SIZES)}, or give "
                         "--config with a Hub model's config.json.")  # fmt: skip
    try:  # a preset holds a config.json's keys but the vocabulary, Llama 3's for these sizes
        c = json.loads(config.read_text()) if config is not None else {**MODEL_SIZES[model], "vocab_size": LLAMA3_VOCAB}
        params, once = llama_parameters(
            hidden=c["hidden_size"], intermediate=c["intermediate_size"], layers=c["num_hidden_layers"],
            heads=c["num_attention_heads"], kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
            vocab=c["vocab_size"], tied=c.get("tie_word_embeddings", False),
        )  # fmt: skip
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"error: --config={config} is not a Llama-shaped config.json ({type(err).__name__}: "
                         f"{err}); give a decoder's config.json or --model with a preset.") from None  # fmt: skip
    cost = ModelCost(params, once, units=c["num_hidden_layers"] + 2, param_bytes=2, grad_bytes=4,
                     sync_bytes=DENSE_BYTES_PER_VALUE[payload])  # fmt: skip
    return cost, str(config) if config is not None else model


def check_values(values: dict) -> None:
    """Refuse what the cost model cannot take, naming the flag (before any arithmetic fails on it)."""
    positive = ("nodes", "gpus_per_node", "node_gbit", "intra_gbyte", "peak_tflops", "tokens_per_gpu", "mfu",
                "rack_nodes", "rack_gbit", "fl_fsdp_nodes", "fl_hsdp_nodes")  # fmt: skip
    for name in positive:
        if name in values and values[name] is not None and not values[name] > 0:
            raise SystemExit(f"error: --{name.replace('_', '-')}={values[name]} must be positive.")
    if values["nodes"] < 2:
        raise SystemExit(f"error: --nodes={values['nodes']}: a federation needs 2 or more nodes.")
    if min(values["sync_steps"]) < 1:
        raise SystemExit(f"error: --sync-steps {values['sync_steps']}: every H must be at least 1.")
    rack = values.get("rack_nodes")
    if (rack is None) != (values.get("rack_gbit") is None):
        raise SystemExit("error: a third tier needs both --rack-nodes (nodes per rack) and --rack-gbit (its uplink).")
    if rack is not None and values["nodes"] % rack:
        raise SystemExit(f"error: --rack-nodes={rack} must divide --nodes={values['nodes']}.")


def setting_from(args: argparse.Namespace) -> tuple[Setting, str, list[int], str]:
    """The cost model's `Setting` for the flags (a preset's values where a flag is not given), the model's name, the
    values of H and the payload."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    values = {**DEFAULTS, **CLUSTERS.get(args.preset, {}), **given}
    missing = [f"--{name.replace('_', '-')}" for name in REQUIRED if values.get(name) is None]
    if missing:
        raise SystemExit(f"error: give {', '.join(missing)} (or --preset {' / '.join(CLUSTERS)}).")
    check_values(values)
    nodes, gpn, rack = values["nodes"], values["gpus_per_node"], values.get("rack_nodes")
    fsdp_nodes = values.get("fl_fsdp_nodes", 1)
    hsdp_nodes = values.get("fl_hsdp_nodes", rack or 2)
    for flag, group, default in (("--fl-fsdp-nodes", fsdp_nodes, "1"), ("--fl-hsdp-nodes", hsdp_nodes,
                                                                          "--rack-nodes, or 2")):  # fmt: skip
        if nodes % group or group == nodes:
            given = "" if flag.replace("-", "_")[2:] in values else f" (its default: {default})"
            raise SystemExit(f"error: {flag}={group}{given} must divide --nodes={nodes} into 2 or more groups: give "
                             f"{flag} with a divisor of --nodes below it.")  # fmt: skip
    model, name = model_cost(values["model"], values.get("config"), values["payload"])
    network = Network(
        inter_node_bytes_s=values["node_gbit"] * 1e9 / 8,
        intra_node_bytes_s=values["intra_gbyte"] * 1e9,
        inter_latency_s=values["inter_latency_us"] * 1e-6,
        intra_latency_s=values["intra_latency_us"] * 1e-6,
        inter_rack_bytes_s=values["rack_gbit"] * 1e9 / 8 if rack else math.inf,
        inter_rack_latency_s=2 * values["inter_latency_us"] * 1e-6 if rack else 0.0,
    )
    setting = Setting(model=model, world_size=nodes * gpn, ranks_per_node=gpn, fl_fsdp_group=fsdp_nodes * gpn,
                      fl_hsdp_group=hsdp_nodes * gpn, fl_hsdp_shard=gpn, tokens_per_rank=values["tokens_per_gpu"],
                      peak_flop_s=values["peak_tflops"] * 1e12, mfu=values["mfu"], network=network,
                      nodes_per_rack=rack)  # fmt: skip
    return setting, name, values["sync_steps"], values["payload"]


def plan(setting: Setting, model_name: str, sync_steps: list[int], payload: str) -> str:
    """The table: each method's step time (serial and overlapped) and speed-up over FSDP at each H."""
    net, gpn = setting.network, setting.ranks_per_node
    nodes = setting.world_size // gpn
    tiers = (f"cells/racks of {setting.nodes_per_rack} nodes at {net.inter_rack_bytes_s * 8 / 1e9:g} Gb/s each"
             if setting.nodes_per_rack else "two tiers (no rack tier)")  # fmt: skip
    fl_fsdp_groups, fl_hsdp_groups = (
        setting.world_size // setting.fl_fsdp_group,
        setting.world_size // setting.fl_hsdp_group,
    )
    lines = [
        f"Model {model_name}: {setting.model.params:,} parameters; {setting.tokens_per_rank:,} tokens per GPU per "
        f"step, {setting.peak_flop_s / 1e12:g} TFLOP/s × MFU {setting.mfu:g}; FedAvg payload {payload}.",
        f"Cluster: {nodes} nodes × {gpn} GPUs = {setting.world_size}; inside a node "
        f"{net.intra_node_bytes_s / 1e9:g} GB/s per GPU, a node's uplink {net.inter_node_bytes_s * 8 / 1e9:g} Gb/s, "
        f"{tiers}.",
        f"Groups: FL+FSDP {setting.fl_fsdp_group // gpn} node(s) = {setting.fl_fsdp_group} GPUs ({fl_fsdp_groups} "
        f"groups); FL+HSDP {setting.fl_hsdp_group // gpn} nodes = {setting.fl_hsdp_group // gpn} replicas × {gpn} "
        f"shards ({fl_hsdp_groups} groups).",
        "",
        "Step time with communication after compute (serial) and hidden behind it at best (overlapped: FSDP2's",
        "prefetching, not --fed_sync_overlap), and the speed-up over FSDP of each:",
        "",
        "   H  method    step s (serial)  step s (overlapped)  vs FSDP (serial)  vs FSDP (overlapped)",
    ]
    speedup: dict[tuple[str, int], float] = {}
    for h in sync_steps:
        costs = replace(setting, sync_steps=h).costs()
        serial, overlapped = speedups(costs), speedups(costs, overlapped=True)
        for name, cost in costs.items():
            if name in ("FSDP", "HSDP") and h != sync_steps[0]:
                continue  # they do not average: the same at every H
            shown = f"{h:>4}" if name.startswith("FL") else "   -"
            lines.append(f"{shown}  {name:<9} {cost.serial_s:15.3f}  {cost.overlapped_s:19.3f}  {serial[name]:15.2f}×"
                         f"  {overlapped[name]:19.2f}×")  # fmt: skip
            if name.startswith("FL"):
                speedup[(name, h)] = serial[name]
    lines += ["", *choice(speedup)]
    return "\n".join(lines)


def choice(speedup: dict[tuple[str, int], float]) -> list[str]:
    """The faster federated method, at the smallest H within 5% of its best speed-up: a larger H saves little more
    and lets the groups drift further apart."""
    method = max(("FL+FSDP", "FL+HSDP"), key=lambda m: max(v for (n, _), v in speedup.items() if n == m))
    best = max(v for (n, _), v in speedup.items() if n == method)
    h = min(h for (n, h), v in speedup.items() if n == method and v >= 0.95 * best)
    return [f"In this model: {method}, at H = {h} ({speedup[(method, h)]:.2f}× FSDP, serial), the smallest H within 5% "
            f"of its best here ({best:.2f}×); a larger H sends less but lets the groups drift further apart "
            "(docs/cluster.md, H)."]  # fmt: skip


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_fedshard.tools.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--preset", choices=list(CLUSTERS), help="A named cluster; the flags below override its values.")
    p.add_argument("--nodes", type=int, help="Nodes in the job.")
    p.add_argument("--gpus-per-node", type=int, help="GPUs (ranks) per node.")
    p.add_argument("--node-gbit", type=float, help="A node's uplink to the other nodes, Gb/s each way (all its NICs).")
    p.add_argument("--intra-gbyte", type=float, help="One GPU's link inside its node, GB/s each way (NVLink).")
    p.add_argument("--rack-nodes", type=int, help="Third tier: nodes per rack or cell (omit for two tiers).")
    p.add_argument("--rack-gbit", type=float, help="Third tier: a rack's uplink to the other racks, Gb/s each way.")
    p.add_argument("--model", help=f"A --model_size preset ({', '.join(MODEL_SIZES)}; default llama-8b).")
    p.add_argument("--config", type=Path, help="Or a Hub model's config.json (a Llama-shaped decoder).")
    p.add_argument("--tokens-per-gpu", type=int, help="Tokens per GPU per optimizer step (default 4096).")
    p.add_argument("--peak-tflops", type=float, help="The GPU's dense bf16 TFLOP/s (A100 312, H100 SXM 989).")
    p.add_argument("--mfu", type=float, help="Model FLOP utilisation of the compute (default 0.4).")
    p.add_argument(
        "--payload", choices=list(DENSE_BYTES_PER_VALUE), help="--fed_sync_dtype of FedAvg (default float32)."
    )
    p.add_argument("--sync-steps", type=int, nargs="+", help="The values of H to compare (default 4 8 16 32).")
    p.add_argument("--fl-fsdp-nodes", type=int, help="Nodes per FL+FSDP group (default 1).")
    p.add_argument("--fl-hsdp-nodes", type=int, help="Nodes per FL+HSDP group (default: a rack, or 2).")
    p.add_argument("--inter-latency-us", type=float, help="Latency of a ring step between nodes, µs (default 5).")
    p.add_argument("--intra-latency-us", type=float, help="Latency of a ring step inside a node, µs (default 1).")
    return p


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    print(plan(*setting_from(args)))


if __name__ == "__main__":
    main()

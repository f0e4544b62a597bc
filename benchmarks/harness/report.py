"""Figures of a benchmark run from the ranks' records: throughput, bytes (measured and predicted), perplexity.

Pure functions of the records (testable without a cluster), plus the writers of the JSON, Markdown and PNGs.

Definitions (the same for every method):
- training clock: wall-clock seconds since the start of training, less the time spent evaluating and logging;
- throughput: world tokens per second over windows of H consecutive steps after the warm-up window, each
  window ending with a sync (so the averaging is paid for); the median over windows;
- inter-node bytes: the uplinks' ``tx_bytes`` summed over nodes, over the optimizer steps only (evaluations
  left out), divided by the number of steps; predicted by :mod:`hf_fedshard.tools.cost` with gloo's reduce-scatter;
  inter-rack bytes (three tiers): the same for the racks' trunks;
- eval perplexity at equal tokens: after the last step (every method reads the same tokens per step);
  at equal wall time: the last evaluation made within T*, the training clock of the fastest real method.
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness.cost_model import GLOO, sync_bytes_per_value
from hf_fedshard.tools.cost import ModelCost, Network, method_layouts, step_cost
from hf_fedshard.topology import FederationLayout, parse_group_size

AVERAGING = ("FL+FSDP", "FL+HSDP", "LocalSGD")
BYTES_TOLERANCE = 0.15
VARIANT_BYTES_TOLERANCE = 0.05
# Averaging on pseudo-gradients: each variant is its base method plus settings (bench_train.py arguments).
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "FL+FSDP bf16": ("FL+FSDP", ["--fed_sync_dtype", "bfloat16"]),
    "FL+FSDP int8": ("FL+FSDP", ["--fed_sync_dtype", "int8"]),
    "FL+FSDP nesterov": ("FL+FSDP", ["--fed_outer_optimizer", "nesterov"]),
    "FL+HSDP split": ("FL+HSDP", ["--fed_split_exchange", "true"]),
    "FL+FSDP overlap": ("FL+FSDP", ["--fed_sync_overlap", "1"]),
    "FL+FSDP stream": ("FL+FSDP", ["--fed_sync_fragments", "4", "--fed_sync_overlap", "1"]),
    "FL+FSDP stream int8": ("FL+FSDP", ["--fed_sync_fragments", "4", "--fed_sync_overlap", "1", "--fed_sync_dtype",
                                        "int8"]),
    # The cheapest payloads overlapped (time to quality on a slow link): int8, and topk at 1%, 2 bits
    "FL+FSDP overlap int8": ("FL+FSDP", ["--fed_sync_overlap", "1", "--fed_sync_dtype", "int8"]),
    "FL+FSDP overlap topk 1%": ("FL+FSDP", ["--fed_sync_overlap", "1", "--fed_sync_dtype", "topk", "--fed_sync_density",
                                            "0.01", "--fed_sync_bits", "2"]),
    # Other group sizes of the 4-node, 8-rank world: 2 groups of 2 nodes, and groups of unequal size.
    "FL+FSDP 2×4": ("FL+FSDP", ["--fed_group_size", "4"]),
    "FL+FSDP 4,2,2": ("FL+FSDP", ["--fed_group_size", "4,2,2"]),
}  # fmt: skip
OVERLAPPED = tuple(name for name, (_, args) in VARIANTS.items() if "--fed_sync_overlap" in args)


def base_method(method: str) -> str:
    """The method a variant modifies (a method is its own base)."""
    return VARIANTS[method][0] if method in VARIANTS else method


def bytes_per_averaging(log_history: list[dict]) -> float | None:
    """A rank's ``fed_inter_group_bytes`` per averaging after step 0's (the initial weights' plain fp32 mean), from
    the first and last logs that count averagings (an evaluation of the global model between averagings adds its
    own plain mean: evaluate on averaged steps)."""
    counted = [e for e in log_history if "fed_syncs" in e]
    if len(counted) < 2 or counted[-1]["fed_syncs"] == counted[0]["fed_syncs"]:
        return None
    first, last = counted[0], counted[-1]
    return (last["fed_inter_group_bytes"] - first["fed_inter_group_bytes"]) / (last["fed_syncs"] - first["fed_syncs"])


def variant_settings(method: str) -> dict[str, str]:
    """A variant's fed settings by name, without the leading dashes (empty for a plain method)."""
    args = VARIANTS[method][1] if method in VARIANTS else []
    return {k.removeprefix("--"): v for k, v in zip(args[::2], args[1::2], strict=True)}


def layout_of(method: str, cfg: dict) -> tuple[FederationLayout, int | None]:
    """The federation layout of ``method`` as bench_train.py runs it, and its H (``None``: no averaging)."""
    w, r, h = cfg["nodes"] * cfg["ranks_per_node"], cfg["ranks_per_node"], cfg["sync_steps"]
    hsdp_nodes = cfg["nodes"] // cfg.get("racks", 1) if cfg.get("racks", 1) > 1 else 2  # a rack, or 2 nodes
    layouts = method_layouts(w, r, fl_fsdp_group=r, fl_hsdp_group=hsdp_nodes * r, fl_hsdp_shard=r, sync_steps=h)
    layouts["ideal"] = (layouts["FL+FSDP"][0], None)
    layouts["LocalSGD"] = (FederationLayout(w, 1, 1), h)  # every rank its own group of one, world all-reduce
    sizes = variant_settings(method).get("fed_group_size")
    if sizes is not None:  # a variant of other group sizes (4-node world)
        return FederationLayout(w, parse_group_size(sizes)), h
    return layouts[base_method(method)]


def clock_at(steps: list[dict], step: int) -> float:
    """Training clock at the end of optimizer step ``step`` (0: the start)."""
    return 0.0 if step == 0 else steps[step - 1]["train_clock_s"]


def exchange_wait_ratio(fed_counters: dict | None, node0_tx_bytes: float, rate_bytes_s: float) -> float | None:
    """Seconds rank 0 waited for overlapped exchanges to finish (``fed_sync_wait_seconds_total``) ÷ (bytes node 0's
    uplink sent ÷ link rate); ``None`` for a run without that counter or without bytes sent."""
    waited = (fed_counters or {}).get("fed_sync_wait_seconds_total")
    return waited / (node0_tx_bytes / rate_bytes_s) if waited is not None and node0_tx_bytes else None


def window_throughputs(steps: list[dict], tokens_per_step: int, window: int, warmup: int) -> list[float]:
    """World tokens/s of each window of ``window`` steps after the first ``warmup`` steps."""
    return [
        window * tokens_per_step / (clock_at(steps, k + window) - clock_at(steps, k))
        for k in range(warmup, len(steps) - window + 1, window)
    ]


def perplexity_at(evals: list[dict], clock_s: float) -> dict:
    """The last evaluation made within ``clock_s`` seconds of training."""
    done = [e for e in evals if e["train_clock_s"] <= clock_s + 1e-9]
    last = done[-1]
    return {
        "step": last["step"],
        "train_clock_s": last["train_clock_s"],
        "eval_perplexity": math.exp(last["eval_loss"]),
    }


def predicted(method: str, cfg: dict, record: dict, compute_s: float | None) -> dict:
    """The cost model's bytes per step (and, given the compute time, s/step) for this run."""
    layout, h = layout_of(method, cfg)
    settings = variant_settings(method)
    sync_bytes = sync_bytes_per_value(settings.get("fed_sync_dtype", "float32"), settings)
    split = settings.get("fed_split_exchange") == "true"
    model = ModelCost(record["params"], record["once_params"], record["units"], 4, 4, sync_bytes, GLOO, split)
    racks = cfg.get("racks", 1)
    rack_rate = cfg.get("rack_rate_mbit") or math.inf
    network = Network(cfg["rate_mbit"] * 1e6 / 8, math.inf, inter_rack_bytes_s=rack_rate * 1e6 / 8)
    nodes_per_rack = cfg["nodes"] // racks if racks > 1 else None
    fragments, overlap = int(settings.get("fed_sync_fragments", 1)), int(settings.get("fed_sync_overlap", 0))
    cost = step_cost(model, layout, cfg["ranks_per_node"], h, network, compute_s or 0.0, method, nodes_per_rack,
                     fragments, overlap)  # fmt: skip
    alone = step_cost(model, layout, cfg["ranks_per_node"], None, network, 0.0, method, nodes_per_rack)
    return {
        "averaging_inter_bytes": (cost.inter_bytes_per_node - alone.inter_bytes_per_node) * cfg["nodes"] * h
        if h
        else 0.0,
        "inter_bytes_per_step": cost.inter_bytes_per_node * cfg["nodes"],
        "inter_rack_bytes_per_step": cost.inter_rack_bytes_per_rack * racks,
        "inter_bytes_per_node_per_step": cost.inter_bytes_per_node,
        "intra_bytes_per_rank_per_step": cost.intra_bytes_per_rank,
        "s_per_step": cost.serial_s if compute_s is not None else None,
    }


def summarize_method(method: str, records: list[dict], cfg: dict) -> dict:
    """Every measured figure of one method (before comparison with the others)."""
    rank0 = next(r for r in records if r["rank"] == 0)
    steps, h = rank0["steps"], cfg["sync_steps"]
    tokens = cfg["nodes"] * cfg["ranks_per_node"] * cfg["batch_size"] * cfg["block_size"]
    windows = window_throughputs(steps, tokens, h, cfg["warmup_steps"])
    tokens_per_s = statistics.median(windows)
    node_records = sorted((r for r in records if r["local_rank"] == 0), key=lambda r: r["node"])
    tx = [sum(s["tx_bytes"] for s in r["steps"]) for r in node_records]
    rack_tx = [sum(s["rack_tx_bytes"] for s in r["steps"]) for r in node_records if r.get("reads_rack")]
    memory = [r["peak_rss_bytes"] - r["rss_before_model_bytes"] for r in records if "peak_rss_bytes" in r]
    layout, sync = layout_of(method, cfg)
    syncs = [s for s in steps if sync is not None and s["step"] % sync == 0]
    rate_bytes_s = min(cfg["rate_mbit"], cfg.get("rack_rate_mbit") or math.inf) * 1e6 / 8  # the slowest link
    averaging = [
        {"step": s["step"], "sync_s": s["sync_s"], "node0_tx_bytes": s["sync_tx_bytes"],
         "ratio_to_bytes_over_rate": s["sync_s"] / (s["sync_tx_bytes"] / rate_bytes_s)}
        for s in syncs if s.get("sync_tx_bytes")
    ]  # fmt: skip
    evals = [{**e, "eval_perplexity": math.exp(e["eval_loss"])} for e in rank0["evals"]]
    loop_wait_s = sum(s["sync_s"] for s in steps)  # the loop's time inside the averaging callback
    by_step = [{s["step"]: s.get("sync_tx_bytes", 0) for s in r["steps"]} for r in node_records]
    averaging_bytes = [sum(nodes[s["step"]] for nodes in by_step) for s in syncs]  # every node's uplink
    return {
        "layout": layout.describe() if method != "LocalSGD" else f"DDP over {layout.world_size} ranks",
        "averages_every": sync,
        "params": rank0["params"],
        "tokens_per_step": tokens,
        "window_tokens_per_s": windows,
        "tokens_per_s": tokens_per_s,
        "s_per_step": tokens / tokens_per_s,
        "train_clock_s": clock_at(steps, len(steps)),
        "step_s": [s["end_s"] - s["begin_s"] for s in steps],
        "inter_bytes_per_node": tx,
        "inter_bytes_per_step": sum(tx) / len(steps),
        "inter_rack_bytes_per_rack": rack_tx,
        "inter_rack_bytes_per_step": sum(rack_tx) / len(steps) if rack_tx else None,
        "memory_added_bytes_per_rank": memory,
        "memory_added_bytes_max": max(memory) if memory else None,
        "averaging": averaging,
        "averaging_inter_bytes": statistics.median(averaging_bytes)
        if averaging_bytes and method not in OVERLAPPED
        else None,
        "averaging_ratio_median": statistics.median(a["ratio_to_bytes_over_rate"] for a in averaging)
        if averaging and method not in OVERLAPPED  # an overlapped exchange does not run in its sync steps
        else None,
        "loop_wait_s": loop_wait_s,
        "loop_wait_ratio": loop_wait_s / (tx[0] / rate_bytes_s)
        if base_method(method) == "FL+FSDP" and tx and tx[0]
        else None,
        "exchange_wait_ratio": exchange_wait_ratio(rank0["fed"], tx[0] if tx else 0, rate_bytes_s)
        if method in OVERLAPPED
        else None,
        "evals": evals,
        "final_eval_perplexity": evals[-1]["eval_perplexity"],
        "fed_counters_rank0": rank0["fed"],
    }


def targets(methods: dict, three_tier: bool = False) -> list[dict]:
    """The targets, each with the measured value and whether it is met (only for methods that ran)."""

    def ratio(a: str, b: str, key: str = "tokens_per_s") -> float | None:
        return methods[a][key] / methods[b][key] if a in methods and b in methods else None

    rows = [
        ("FL+FSDP tokens/s ≥ 3× FSDP", ratio("FL+FSDP", "FSDP"), 3.0, "≥"),
        ("FL+FSDP tokens/s ≥ 90% of ideal", ratio("FL+FSDP", "ideal"), 0.90, "≥"),
        ("FL+HSDP tokens/s ≥ 1.5× HSDP", ratio("FL+HSDP", "HSDP"), 1.5, "≥")
        if three_tier
        else ("FL+HSDP tokens/s ≥ 2× HSDP", ratio("FL+HSDP", "HSDP"), 2.0, "≥"),
        ("FL+FSDP eval ppl at equal tokens ≤ 1.05× FSDP", ratio("FL+FSDP", "FSDP", "final_eval_perplexity"), 1.05, "≤"),
    ]
    for name in ("FL+FSDP", "FL+HSDP"):
        if name in methods and methods[name]["averaging_ratio_median"] is not None:
            rows.append((f"{name} averaging time ≤ 1.2× bytes ÷ link rate", methods[name]["averaging_ratio_median"],
                         1.2, "≤"))  # fmt: skip
    rows += variant_targets(methods)
    rows += overlap_targets(methods)
    for name, m in methods.items():
        if m["predicted"]["inter_bytes_per_step"] > 0:
            error = m["inter_bytes_per_step"] / m["predicted"]["inter_bytes_per_step"] - 1
            rows.append((f"{name} inter-node bytes within 15% of the model (measured/predicted - 1)", error,
                         BYTES_TOLERANCE, "|≤|"))  # fmt: skip
        if three_tier and m["predicted"]["inter_rack_bytes_per_step"] > 0:
            error = m["inter_rack_bytes_per_step"] / m["predicted"]["inter_rack_bytes_per_step"] - 1
            rows.append((f"{name} inter-rack bytes within 15% of the model (measured/predicted - 1)", error,
                         BYTES_TOLERANCE, "|≤|"))  # fmt: skip
    return judge(rows)


def judge(rows: list[tuple[str, float | None, float, str]]) -> list[dict]:
    """(label, measured, bound, sense) rows as target records saying whether each is met; unmeasured rows dropped."""
    out = []
    for label, value, bound, sense in rows:
        if value is None:
            continue
        met = {
            "≥": value >= bound,
            "≤": value <= bound,
            "|≤|": abs(value) <= bound,
            "≈": abs(value / bound - 1) <= VARIANT_BYTES_TOLERANCE,  # int8 carries its scales: about 1.6% more
        }[sense]
        out.append({"target": label, "measured": value, "bound": bound, "met": met})
    return out


def variant_targets(methods: dict) -> list[tuple[str, float, float, str]]:
    """The pseudo-gradient variants' targets: payload bytes against fp32 and the model, perplexity against fp32."""
    rows = []
    for name, ratio in (("FL+FSDP bf16", 0.5), ("FL+FSDP int8", 0.25)):
        if name not in methods or "FL+FSDP" not in methods:
            continue
        measured, fp32 = methods[name], methods["FL+FSDP"]
        rows.append((f"{name} inter-node bytes ÷ fp32 FL+FSDP's (≈ {ratio:g})",
                     measured["inter_bytes_per_step"] / fp32["inter_bytes_per_step"], ratio, "≈"))  # fmt: skip
        rows.append((f"{name} eval ppl at equal tokens ≤ 1.02× fp32 FL+FSDP",
                     measured["final_eval_perplexity"] / fp32["final_eval_perplexity"], 1.02, "≤"))  # fmt: skip
    for name in [n for n in VARIANTS if n in methods and methods[n]["predicted"]["inter_bytes_per_step"] > 0]:
        error = methods[name]["inter_bytes_per_step"] / methods[name]["predicted"]["inter_bytes_per_step"] - 1
        rows.append((f"{name} inter-node bytes within 5% of the model (measured/predicted - 1)", error,
                     VARIANT_BYTES_TOLERANCE, "|≤|"))  # fmt: skip
    return rows


def overlap_targets(methods: dict) -> list[tuple[str, float, float, str]]:
    """Streaming averaging's targets: the best FL+FSDP near the ideal and LocalSGD, waits hidden, quality kept."""
    fl_fsdp = [n for n in methods if base_method(n) == "FL+FSDP"]
    if not any(n in OVERLAPPED for n in fl_fsdp):
        return []
    best = max(fl_fsdp, key=lambda n: methods[n]["tokens_per_s"])
    rows = []
    if "ideal" in methods:
        rows.append((f"best FL+FSDP ({best}) tokens/s ≥ 95% of ideal",
                     methods[best]["tokens_per_s"] / methods["ideal"]["tokens_per_s"], 0.95, "≥"))  # fmt: skip
    if "LocalSGD" in methods:
        rows.append((f"best FL+FSDP ({best}) tokens/s ≥ LocalSGD's",
                     methods[best]["tokens_per_s"] / methods["LocalSGD"]["tokens_per_s"], 1.0, "≥"))  # fmt: skip
    for name in [n for n in OVERLAPPED if n in methods]:
        if methods[name].get("exchange_wait_ratio") is not None:
            rows.append((f"{name} loop's wait on exchanges ≤ 10% of bytes ÷ link rate",
                         methods[name]["exchange_wait_ratio"], 0.10, "≤"))  # fmt: skip
        if "FL+FSDP" in methods:
            rows.append((f"{name} eval ppl at equal tokens ≤ 1.02× blocking fp32 FL+FSDP",
                         methods[name]["final_eval_perplexity"] / methods["FL+FSDP"]["final_eval_perplexity"], 1.02,
                         "≤"))  # fmt: skip
    return rows


def summarize(records: dict[str, list[dict]], cfg: dict, link: dict) -> dict:
    """All figures of a run: per method, relative to FSDP and the ideal, and the targets."""
    methods = {name: summarize_method(name, recs, cfg) for name, recs in records.items()}
    compute_s = methods["ideal"]["s_per_step"] if "ideal" in methods else None
    finish = [m["train_clock_s"] for name, m in methods.items() if name != "ideal"]
    equal_time_s = min(finish) if finish else None
    for name, m in methods.items():
        rank0 = next(r for r in records[name] if r["rank"] == 0)
        m["predicted"] = predicted(name, cfg, rank0, compute_s)
        m["bytes_measured_over_predicted"] = (
            m["inter_bytes_per_step"] / m["predicted"]["inter_bytes_per_step"]
            if m["predicted"]["inter_bytes_per_step"]
            else None
        )
        m["speedup_vs_fsdp"] = m["tokens_per_s"] / methods["FSDP"]["tokens_per_s"] if "FSDP" in methods else None
        m["fraction_of_ideal"] = m["tokens_per_s"] / methods["ideal"]["tokens_per_s"] if "ideal" in methods else None
        m["eval_at_equal_time"] = perplexity_at(m["evals"], equal_time_s) if equal_time_s is not None else None
    three_tier = cfg.get("racks", 1) > 1
    return {"config": cfg, "link": link, "equal_time_s": equal_time_s, "methods": methods,
            "targets": targets(methods, three_tier)}  # fmt: skip


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def _x(value: float | None, digits: int = 2, suffix: str = "×") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def markdown(results: dict) -> str:
    """The results table, the targets and the run's conditions, as Markdown."""
    cfg, link = results["config"], results["link"]
    three_tier = cfg.get("racks", 1) > 1
    where = (
        f"{cfg['racks']} racks × {cfg['nodes'] // cfg['racks']} nodes × {cfg['ranks_per_node']} ranks, node links "
        f"{cfg['rate_mbit']:g} Mbit/s (TCP goodput measured {link['goodput_mbit']:.1f}), rack uplinks "
        f"{cfg['rack_rate_mbit']:g} Mbit/s (goodput between racks {link['rack']['goodput_mbit']:.1f})"
        if three_tier
        else f"{cfg['nodes']} nodes × {cfg['ranks_per_node']} ranks, links {cfg['rate_mbit']:g} Mbit/s (TCP goodput "
        f"measured {link['goodput_mbit']:.1f} Mbit/s)"
    )
    rack_head = " inter-rack MB/step measured (predicted) |" if three_tier else ""
    lines = [
        f"{where}, Llama `{cfg['model_size']}`, {cfg['steps']} steps of "
        f"{cfg['nodes'] * cfg['ranks_per_node']} × {cfg['batch_size']} × {cfg['block_size']} tokens, H = "
        f"{cfg['sync_steps']}, throughput after {cfg['warmup_steps']} warm-up steps; equal wall time T* = "
        f"{results['equal_time_s']:.1f} s of training. Predicted s/step: the ideal's measured s/step as compute, plus "
        "the predicted bytes through each tier's busiest link ÷ its rate. Memory: peak resident memory of a rank less "
        "its resident memory before the model was built, largest over ranks.",
        "",
        "| method | layout | tokens/s | s/step (predicted) | vs FSDP | of ideal | inter-node MB/step measured | "
        f"predicted | measured/predicted |{rack_head} memory MB/rank | eval ppl, equal tokens | "
        "eval ppl at T* (step) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if three_tier else "") + "---:|---:|---:|",
    ]
    for name, m in results["methods"].items():
        at_t = m["eval_at_equal_time"]
        rack = (
            f" {_mb(m['inter_rack_bytes_per_step'] or 0)} ({_mb(m['predicted']['inter_rack_bytes_per_step'])}) |"
            if three_tier
            else ""
        )
        memory = m.get("memory_added_bytes_max")
        lines.append(
            f"| {name} | {m['layout']} | {m['tokens_per_s']:,.0f} | {m['s_per_step']:.2f} "
            f"({_x(m['predicted']['s_per_step'], 2, '')}) | "
            f"{_x(m['speedup_vs_fsdp'])} | {_x(m['fraction_of_ideal'] and 100 * m['fraction_of_ideal'], 0, '%')} | "
            f"{_mb(m['inter_bytes_per_step'])} | {_mb(m['predicted']['inter_bytes_per_step'])} | "
            f"{_x(m['bytes_measured_over_predicted'], 3, '')} |{rack} {_x(memory and memory / 1e6, 0, '')} | "
            f"{m['final_eval_perplexity']:.1f} | "
            f"{at_t['eval_perplexity']:.1f} ({at_t['step']}) |"
        )
    lines += _group_size_lines(results["methods"])
    lines += ["", "| target | measured | met |", "|---|---:|:---:|"]
    for t in results["targets"]:
        value = f"{100 * t['measured']:+.1f}%" if "(measured/predicted - 1)" in t["target"] else f"{t['measured']:.3f}"
        lines.append(f"| {t['target']} | {value} | {'yes' if t['met'] else '**no**'} |")
    machine = results.get("machine")
    if machine:
        load = machine["before"]["loadavg_1_5_15"]
        command = results.get("command", "tiers.py")
        lines += ["", f"Figures from one run of `{command}`, started {machine['started']}, "
                      f"{machine['wall_s']} s in all; load average before it "
                      f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min) on {machine['before']['cpus']} "
                      "CPUs."]  # fmt: skip
        others = {name: m.get("other_processes_cores") for name, m in machine.get("after_each_method", {}).items()}
        if others and None not in others.values():
            lines[-1] += (
                " CPU cores kept busy by other processes during each method (average): "
                + ", ".join(f"{name} {cores:.2f}" for name, cores in others.items())
                + "."
            )
    return "\n".join(lines)


def _group_size_lines(methods: dict) -> list[str]:
    """Where the run compares group sizes: the inter-node bytes of one blocking averaging, measured (every node's
    uplink during the averaging, median over averagings) and from the cost model, the averaging alone."""
    if not any("fed_group_size" in variant_settings(name) for name in methods):
        return []
    lines = ["", "| method | inter-node MB per averaging, measured | predicted | measured/predicted |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for name, m in methods.items():
        measured, model = m.get("averaging_inter_bytes"), m["predicted"].get("averaging_inter_bytes")
        if measured and model:
            lines.append(f"| {name} | {_mb(measured)} | {_mb(model)} | {measured / model:.3f} |")
    return lines


def plot(results: dict, out: Path) -> list[Path]:
    """Throughput per method (bars) and eval perplexity against the training clock (lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    names = list(methods)
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    bars = ax.bar(names, [methods[n]["tokens_per_s"] for n in names], color="tab:blue")
    ax.bar_label(bars, labels=[_x(methods[n]["speedup_vs_fsdp"]) for n in names], fontsize=8)
    ax.set_ylabel("world tokens/s")
    ax.set_title(f"Throughput at {results['config']['rate_mbit']:g} Mbit/s between nodes (labels: vs FSDP)", fontsize=9)
    fig.tight_layout()
    throughput = out / "throughput.png"
    fig.savefig(throughput)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    for name in names:
        evals = methods[name]["evals"]
        style = ":" if name == "ideal" else "-"
        ax.plot([e["train_clock_s"] for e in evals], [e["eval_perplexity"] for e in evals], style, marker="o",
                markersize=3, label=name)  # fmt: skip
    ax.axvline(results["equal_time_s"], color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("training clock (s, evaluations excluded)")
    ax.set_ylabel("eval perplexity")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    curves = out / "perplexity_vs_time.png"
    fig.savefig(curves)
    plt.close(fig)
    return [throughput, curves]


def write(results: dict, out: Path) -> None:
    """results.json (every figure), results.md (the tables) and the two plots into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results) + "\n")
    plot(results, out)


def update_readme(results: dict, out: Path, readme: Path, block: str = "results") -> None:
    """Replace the README's ``block`` block (``results``: two tiers, ``three-tier``) by this run's tables and plots."""
    begin, end = f"<!-- {block}:begin (written by tiers.py --update-readme) -->", f"<!-- {block}:end -->"
    rel = out.relative_to(readme.parent)
    text = "\n".join([begin, markdown(results), "", f"![throughput]({rel}/throughput.png)",
                       f"![eval perplexity against training time]({rel}/perplexity_vs_time.png)", end])  # fmt: skip
    current = readme.read_text()
    if begin not in current or end not in current:
        raise ValueError(f"{readme} has no {block} block; add the lines {begin!r} and {end!r}.")
    head, rest = current.split(begin, 1)
    readme.write_text(head + text + rest.split(end, 1)[1])


def new_axes(figsize: tuple[float, float] = (6, 3.2)):
    """A figure and its axes on matplotlib's file-only backend (the studies write PNGs, nothing is shown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize, dpi=100)


def save_figure(fig, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` and close it; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def spread(values: list[float]) -> dict:
    """Median and range of ``values`` over repetitions: what the repeated studies print every figure with."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def median_range(s: dict | None, fmt: str = ".2f", scale: float = 1.0) -> str:
    """A `spread` as "median (min–max)", each times ``scale`` in ``fmt``; one figure when all agree; "—" for none."""
    if s is None:
        return "—"
    if s["min"] == s["max"]:
        return f"{s['median'] * scale:{fmt}}"
    return f"{s['median'] * scale:{fmt}} ({s['min'] * scale:{fmt}}–{s['max'] * scale:{fmt}})"


def run_record(script: str, argv: list[str], started: float) -> dict[str, object]:
    """Where a study's figures come from: its command, start time and wall seconds (for its results and tables)."""
    return {
        "command": shlex.join(["python", script, *argv]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "wall_s": round(time.time() - started),
    }


def run_record_lines(results: dict) -> list[str]:
    """The Markdown sentence that names a study's run, when its results carry a `run_record`."""
    if "command" not in results:
        return []
    return ["", f"From one run of `{results['command']}`, started {results['started']}, {results['wall_s']} s in all."]


def write_study(out: Path, results: dict, markdown: Callable[[dict], str]) -> str:
    """A study's results.json and results.md into ``out``; returns the Markdown (the caller adds its plot)."""
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(results)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(table + "\n")
    return table


def table_head(caption: str, columns: list[str], aligns: str) -> list[str]:
    """A results.md table's opening lines: its caption, then the header of ``columns``, ``aligns`` one letter a
    column (``l`` left, ``r`` right)."""
    rule = "|".join("---" if a == "l" else "---:" for a in aligns)
    return [caption, "", f"| {' | '.join(columns)} |", f"|{rule}|"]

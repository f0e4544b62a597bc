"""FSDP vs HSDP vs FL+FSDP vs FL+HSDP (and the ideal, and Accelerate's LocalSGD) on an emulated two- or three-tier
cluster.

As root, on one Linux machine (network namespaces, `tc`; see benchmarks/README.md):

    python -m benchmarks.tiers --quick            # 2 nodes × 2 ranks: FSDP, HSDP, FL+FSDP, ideal (< 5 min)
    python -m benchmarks.tiers --update-readme    # 4 nodes × 2 ranks: every method and variant; README table
    python -m benchmarks.tiers --quick --rate-mbit 1000 --out /tmp/bench
    python -m benchmarks.tiers --topology three-tier   # 2 racks × 2 nodes × 2 ranks, 1 Gbit/s in a rack,
                                                       # 100 Mbit/s between racks; FL+HSDP groups = racks

Each method runs benchmarks/harness/bench_train.py with the real multi-node launcher,
`torchrun --nnodes N --node_rank i`, one launcher per node namespace, rendezvous on node 0's address. Results (JSON
with every figure, a Markdown table, PNG plots) go to ``--out`` (default
benchmarks/results/tiers_<quick|full>[_three_tier]/).
"""

from __future__ import annotations

import argparse

from benchmarks.harness import REPO, report
from benchmarks.harness.methods import FULL_METHODS, BenchConfig, benchmark, wait_until_quiet
from benchmarks.harness.study import Study, add_folder_options, new_parser, validated

QUICK_METHODS = ("FSDP", "HSDP", "FL+FSDP", "ideal")
THREE_TIER_METHODS = ("FSDP", "HSDP", "FL+FSDP", "FL+HSDP", "ideal")
# Three-tier defaults: the slow tier keeps the two-tier benchmark's 100 Mbit/s, so the two compare; a rack's node
# links are 10× faster, a tapered network in which a rack's uplink carries a tenth of what one node can send, as
# a Dragonfly+ cell's global links carry less than the sum of its nodes' links. 1 Gbit/s is also about what one
# shaped veth delivers here without the shaping itself taking the cores (TCP goodput measured 959 Mbit/s).
THREE_TIER = {"racks": 2, "nodes": 4, "rate_mbit": 1000.0, "rack_rate_mbit": 100.0}


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="2 nodes × 2 ranks, FSDP/HSDP/FL+FSDP/ideal, 24 steps.")
    p.add_argument(
        "--topology",
        choices=("two-tier", "three-tier"),
        default="two-tier",
        help="three-tier: racks of nodes under a core switch; defaults "
        + ", ".join(f"{k} {v:g}" for k, v in THREE_TIER.items())
        + "; FSDP, HSDP, FL+FSDP, FL+HSDP, ideal.",
    )
    p.add_argument("--nodes", type=int, help="Emulated nodes (default 4; 2 with --quick).")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate-mbit", type=float, help="Node link rate, Mbit/s each way (default 100; 1000 in racks).")
    p.add_argument("--racks", type=int, help="Racks of nodes (three-tier only; default 2).")
    p.add_argument("--rack-rate-mbit", type=float, help="Rack uplink rate, Mbit/s each way (three-tier; 100).")
    p.add_argument("--methods", nargs="+", help=f"Subset of {', '.join(FULL_METHODS)}.".replace("%", "%%"))  # argparse
    p.add_argument("--steps", type=int, help="Optimizer steps per method (default 48; 24 with --quick).")
    p.add_argument("--sync-steps", type=int, default=8, help="H for every method that averages.")
    p.add_argument("--eval-steps", type=int, help="Evaluate every this many steps (default 16; 8 with --quick).")
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--batch-size", type=int, default=4, help="Per-device batch (blocks of 128 tokens).")
    p.add_argument("--seed", type=int, default=0, help="Initialisation and data order (the same for every method).")
    p.add_argument("--max-train-lines", type=int, help="Train on this many lines of the text only (tests).")
    p.add_argument("--timeout-s", type=float, default=600.0, help="Bound on each method's run.")
    add_folder_options(p, "tiers", "[_three_tier]", work="the logs and records")
    p.add_argument("--wait-quiet-s", type=float, default=0.0, help="First wait up to this long for a quiet machine.")
    p.add_argument("--update-readme", action="store_true", help="Write the table into benchmarks/README.md.")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    quick, three = args.quick, args.topology == "three-tier"
    if not three and (args.racks or args.rack_rate_mbit):
        raise ValueError("--racks and --rack-rate-mbit need --topology three-tier.")
    default_methods = THREE_TIER_METHODS if three else (QUICK_METHODS if quick else FULL_METHODS)
    return validated(
        BenchConfig(
            nodes=args.nodes or (THREE_TIER["nodes"] if three else 2 if quick else 4),
            ranks_per_node=args.ranks_per_node,
            rate_mbit=args.rate_mbit or (THREE_TIER["rate_mbit"] if three else 100.0),
            racks=(args.racks or THREE_TIER["racks"]) if three else 1,
            rack_rate_mbit=(args.rack_rate_mbit or THREE_TIER["rack_rate_mbit"]) if three else None,
            methods=tuple(args.methods or default_methods),
            model_size=args.model_size,
            batch_size=args.batch_size,
            seed=args.seed,
            steps=args.steps or (24 if quick else 48),
            sync_steps=args.sync_steps,
            warmup_steps=args.sync_steps,
            eval_steps=args.eval_steps or (8 if quick else 16),
            max_train_lines=args.max_train_lines,
            timeout_s=args.timeout_s,
        )
    )


def main(argv: list[str] | None = None) -> int:
    study = Study("tiers", make_parser(), argv)
    args = study.args
    cfg = config_from_args(args)
    out = study.out("three_tier" if args.topology == "three-tier" else None)
    with study.running() as work:
        quiet = wait_until_quiet(args.wait_quiet_s) if args.wait_quiet_s > 0 else None
        results = benchmark(cfg, work, args.data_cache, quiet)
    results["command"] = study.command
    report.write(results, out)
    print(report.markdown(results))
    if args.update_readme:
        report.update_readme(
            results, out, REPO / "benchmarks" / "README.md", "three-tier" if cfg.racks > 1 else "results"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The round protocol under seeded fault schedules, per cell of the combination table (issue 59, item 4).

Each schedule is `tests.round_world.schedule`: 2–4 groups on the round simulator (the real engine in every group,
a fake clock, torchft's lighthouse rules or the store membership), one to three kills restarted after 0–10 s,
stops of up to six times fed_timeout_s (past the others' END round too), rounds that do not commit, or a lost
lighthouse and a staggered full resume. A schedule passes `World.check`: every group ends on one model with one
averaging count, but a group stopped through the others' whole END round (I10's bound), which ends apart with each
side naming the other, or fails in one line.

    python -m benchmarks.round_schedules                   # 1,000 schedules per cell and membership
    python -m benchmarks.round_schedules --quick           # 50 per cell
    python -m benchmarks.round_schedules --quick --cells tau2-F1 --backends store     # one cell, one membership

Prints one row per cell (failures and their seeds; the schedules that passed with a group back later than I10's
bound, which ended apart or, on the store, failed in one line; seconds) and writes them to
benchmarks/results/round_schedules_<full|quick>/results.json. H = 8 and 4H = 32 steps per schedule; the cells are
τ ∈ {0, 1, 2, 3} × F ∈ {1, 2} (τ < H/F), dense (float32) or topk payloads (Nesterov with τ ≥ 1, as the docs'
performance tips), and the speed-aware round policy with F = 1 and dense payloads (``fed_min_round_steps``
max(1, τ); group g's steps take 1 + g/4 s, so the policy plans for slow groups).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import results_folder
from tests.round_world import BACKENDS, schedule

H = 8
TOPK = {"sync_dtype": "topk", "sync_density": 0.05, "sync_bits": 2, "sync_chunk": 64, "sync_feedback_decay": 0.9}


def cells() -> dict[str, dict[str, Any]]:
    """Every valid cell at H = 8, named ``tau{τ}-F{F}-{payload}``."""
    table = {}
    for tau in range(4):
        for fragments in (1, 2):
            if tau >= H // fragments:
                continue
            for payload, extra in (("dense", {}), ("topk", TOPK)):
                outer = {"outer_optimizer": "nesterov"} if tau else {}
                options = {"sync_steps": H, "sync_fragments": fragments, "sync_overlap": tau, **outer, **extra}
                table[f"tau{tau}-F{fragments}-{payload}"] = options
                if fragments == 1 and payload == "dense":  # speed: F = 1 only, and not with topk (refused)
                    speed = {"round_policy": "speed", "min_round_steps": max(1, tau)}
                    table[f"tau{tau}-F1-dense-speed"] = {**options, **speed}
    return table


def run_cell(options: dict[str, Any], backend: str, schedules: int) -> dict[str, Any]:
    """``schedules`` seeded schedules of one cell on one membership: the seeds that failed and why."""
    failed: dict[int, str] = {}
    apart = refused = 0
    begin = time.perf_counter()
    for seed in range(schedules):
        world, allowed = schedule(seed, backend, steps=4 * H, long_stops=True, **options)
        try:
            world.run().check(allowed_errors=allowed)
        except Exception as err:  # a schedule's failure is this study's result
            failed[seed] = str(err).splitlines()[0][:200]
            continue
        apart += any(f.missing for f in world.finished)
        refused += len({f.group for f in world.finished}) < world.groups
    seconds = round(time.perf_counter() - begin, 1)
    return {"schedules": schedules, "failed": failed, "apart": apart, "refused": refused, "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=None, help="schedules per cell and membership (1,000)")
    parser.add_argument("--quick", action="store_true", help="50 schedules per cell and membership")
    parser.add_argument("--cells", default="", help="only the cells whose name contains this")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="memberships, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: results_folder's)")
    args = parser.parse_args(argv)
    schedules = args.schedules or (50 if args.quick else 1000)
    logging.disable(logging.WARNING)  # the engine's lines about redone rounds, thousands of them
    rows = []
    for backend in args.backends.split(","):
        for name, options in cells().items():
            if args.cells not in name:
                continue
            row = {"cell": name, "backend": backend, **run_cell(options, backend, schedules)}
            rows.append(row)
            seeds = sorted(row["failed"])[:10]
            print(f"{backend:10s} {name:18s} {len(row['failed']):4d} of {row['schedules']} failed {seeds}; "
                  f"{row['apart']:3d} ended apart past the bound, {row['refused']:3d} failed in one line; "
                  f"{row['seconds']:7.1f} s", flush=True)  # fmt: skip
    out = (args.out or results_folder("round_schedules", quick=args.quick)) / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"H": H, "steps": 4 * H, "rows": rows}, indent=1) + "\n")
    print(f"{sum(len(r['failed']) for r in rows)} failures in {sum(r['schedules'] for r in rows)} schedules → {out}")


if __name__ == "__main__":
    main()

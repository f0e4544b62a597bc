"""Which algorithm gloo uses for each collective FSDP2 and FedAvg call, read off the inter-node link's counters.

    python -m benchmarks.gloo_collectives     # as root: 2 nodes × 2 ranks, 16 MB per collective, prints a table

Each collective runs over the whole world of 4 ranks (2 per node); the bytes node 0's uplink sent are compared
with a ring's (hf_fedshard.tools.cost): the ring 0-1-2-3 crosses between nodes twice, so each node sends one hop.
The reduce-scatter result is why the cost model has a ``GLOO`` reduce-scatter: it costs an all-reduce.
Results go to benchmarks/results/gloo_collectives_full/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.harness import REPO, results_folder
from benchmarks.harness.netns import Cluster, handle_termination
from benchmarks.harness.study import new_parser

NUMEL = 4 * 2**20  # fp32 elements: 16 MiB
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def worker(out: Path) -> None:
    """On each rank (under torchrun): run each collective between barriers; node's first rank reads the counter."""
    import torch
    import torch.distributed as dist

    from benchmarks.harness.bench_train import uplink_bytes

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    full, shard = torch.ones(NUMEL), torch.ones(NUMEL // world)
    calls = {
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, shard),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_reduce": lambda: dist.all_reduce(full),
    }
    sent = {}
    for name in COLLECTIVES:
        dist.barrier()
        time.sleep(0.5)  # let the barrier's own packets leave
        before = uplink_bytes()["tx_bytes"]
        start = time.perf_counter()
        calls[name]()
        seconds = time.perf_counter() - start
        dist.barrier()
        time.sleep(0.5)
        sent[name] = {"tx_bytes": uplink_bytes()["tx_bytes"] - before, "seconds": seconds}
    if int(os.environ["LOCAL_RANK"]) == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"node{os.environ['GROUP_RANK']}.json").write_text(json.dumps(sent))
    dist.destroy_process_group()


def main() -> None:
    import tempfile

    from benchmarks.harness.cost_model import GLOO
    from hf_fedshard.tools.cost import RING, ring_hop_bytes

    payload = NUMEL * 4
    with tempfile.TemporaryDirectory() as tmp, handle_termination(), Cluster(2) as cluster:
        cmds = cluster.torchrun_commands(2, 29611, [__file__, "--worker", tmp])
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        codes = cluster.run(cmds, env, [Path(tmp, f"log{i}") for i in range(2)], timeout_s=300)
        if any(codes):
            raise RuntimeError(f"exit codes {codes}: {Path(tmp, 'log0').read_text()[-2000:]}")
        node0 = json.loads(Path(tmp, "node0.json").read_text())
    ring = {
        "all_gather_into_tensor": ring_hop_bytes("all_gather", 4, payload),
        "reduce_scatter_tensor": ring_hop_bytes("reduce_scatter", 4, payload, RING),
        "all_reduce": ring_hop_bytes("all_reduce", 4, payload),
    }
    rows = {
        name: {**node0[name], "ring_hop_bytes": ring[name], "measured_over_ring": node0[name]["tx_bytes"] / ring[name]}
        for name in COLLECTIVES
    }
    result = {"payload_bytes": payload, "world": "2 nodes × 2 ranks", "gloo_reduce_scatter_factor": GLOO, **rows}
    out = results_folder("gloo_collectives") / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'collective':<24} {'node 0 sent (MB)':>17} {'ring hop (MB)':>14} {'measured/ring':>14} {'s':>6}")
    for name, row in rows.items():
        print(f"{name:<24} {row['tx_bytes'] / 1e6:17.2f} {row['ring_hop_bytes'] / 1e6:14.2f} "
              f"{row['measured_over_ring']:14.3f} {row['seconds']:6.2f}")  # fmt: skip


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # on each rank, under torchrun: where to write
    return p


if __name__ == "__main__":
    args = make_parser().parse_args()
    if args.worker:
        worker(args.worker)
    else:
        main()

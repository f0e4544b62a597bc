"""Distributed check script: sets up the world as a recipe does (`FedShardTrainingArguments` on CPU), then leaves.

    torchrun --nproc_per_node 2 --max-restarts 1 tests/scripts/setup_guard.py --crash_rank 1
        rank 1 exits 1 right after the set-up of the first attempt, so that torchrun restarts both workers
    torchrun --nproc_per_node 2 tests/scripts/setup_guard.py --absent_rank 1
        rank 1 never sets up (it sleeps), so rank 0 waits in init_process_group

Each rank prints ``rank R set up (attempt A)`` once its world exists.
"""

import argparse
import os
import sys
import time

from hf_fedshard import FedShardTrainingArguments
from hf_fedshard.errors import exit_on_config_error


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--crash_rank", type=int)
    parser.add_argument("--absent_rank", type=int)
    script = parser.parse_args()
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if rank == script.absent_rank:
        time.sleep(120)
        return
    args = FedShardTrainingArguments(output_dir=script.output_dir, use_cpu=True, report_to="none")
    print(f"rank {rank} set up on {args.device} (attempt {attempt})", flush=True)
    if rank == script.crash_rank and attempt == 0:
        sys.exit(1)


if __name__ == "__main__":
    exit_on_config_error(main)

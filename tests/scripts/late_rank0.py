"""Run a recipe as ``python recipe.py args`` would, rank 0 a few seconds late: another rank of the machine then does
what a first run does first (the model conversion, under its lock), as it did in the failing first runs.

    torchrun --nproc_per_node 2 tests/scripts/late_rank0.py recipes/pretrain_clm.py --output_dir ... ...
"""

import os
import runpy
import sys
import time

if __name__ == "__main__":
    if os.environ.get("RANK", "0") == "0":
        time.sleep(float(os.environ.get("LATE_RANK0_S", "5")))
    recipe = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(recipe))
    runpy.run_path(recipe, run_name="__main__")

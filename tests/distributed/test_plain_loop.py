"""`FederatedAverager` in a plain Accelerate loop (no Trainer), multi-process on gloo: it equals DDP at H = 1 and
`FedShardTrainer` on the same data order, sample for sample."""

from __future__ import annotations

import ast
import re

import pytest
import torch

from ..asserts import labelled
from ..launch import REPO, SCRIPTS, torchrun

pytestmark = pytest.mark.timeout(900)


def plain_loop(out, args: list[str]) -> list[dict]:
    dump = out / "dump"
    result = torchrun(4, SCRIPTS / "plain_loop_tiny.py", ["--dump_dir", dump, *args])
    assert result.returncode == 0, result.stdout[-6000:]
    return [torch.load(dump / f"rank{r}.pt", weights_only=False) for r in range(4)]


def assert_same_params(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], atol=atol, rtol=0, msg=labelled(name))


def test_plain_loop_with_h1_equals_data_parallel(tmp_path, ddp_4_ranks):
    """H = 1, 3 steps, against tests/conftest.py's DDP run (Trainer on CPU, 4 ranks, 3 steps)."""
    plain = plain_loop(tmp_path / "plain", ["--group_size", "2", "--sync_steps", "1", "--max_steps", "3"])
    for rank in range(4):
        assert plain[rank]["seen"] == ddp_4_ranks[rank]["seen"]
        assert_same_params(plain[rank]["full_params"], ddp_4_ranks[0]["full_params"], atol=1e-5)


def test_plain_loop_equals_fedshardtrainer_on_the_same_data(tmp_path, fl_fsdp_h2):
    """Two groups × 2 ranks, H = 2, 4 steps (tests/conftest.py's FedShardTrainer run): the loop and the Trainer
    read the same samples on every rank and end on the same global model, after two averagings of trained models
    (within 1e-6: the Trainer divides the summed token loss, the loop takes the mean)."""
    plain = plain_loop(tmp_path / "plain", ["--group_size", "2", "--sync_steps", "2", "--max_steps", "4"])
    for rank in range(4):
        assert plain[rank]["seen"] == fl_fsdp_h2[rank]["seen"]
        assert_same_params(plain[rank]["full_params"], fl_fsdp_h2[rank]["full_params"], atol=1e-6)
        assert plain[rank]["counters"]["syncs"] == fl_fsdp_h2[rank]["fed_counters"]["syncs"] == 1 + 2


def test_the_readme_plain_loop_runs_as_written(tmp_path):
    """The README's complete example, cut out of the README and run on 4 CPU ranks: 32 steps at H = 8."""
    block = re.search(r"```python\n# plain_loop.py\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    script = tmp_path / "plain_loop.py"
    script.write_text(block.group(1))
    result = torchrun(4, script, [])
    assert result.returncode == 0, result.stdout[-6000:]
    for rank in range(4):
        line = re.search(rf"rank {rank}: (\{{.*?\}})", result.stdout).group(1)
        metrics = ast.literal_eval(line)
        assert (metrics["fed_syncs"], metrics["fed_diverged_groups"]) == (1 + 4, 0)  # step 0's, then every 8th
        assert metrics["fed_delta_norm"] > 0  # the last averaging's, published by finish()

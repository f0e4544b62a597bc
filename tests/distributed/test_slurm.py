"""The SLURM batch script users submit (`recipes/slurm/pretrain.sbatch`), under a fake SLURM on this host
(`tests/fake_slurm`: the batch shell expands the script once, as node 0; srun starts one task per node with that
node's own variables). 2 nodes × 2 CPU ranks end on the model one torchrun of the same 4 ranks saves, to the bit;
the line the README showed before, whose ``$SLURM_NODEID`` the batch shell expanded, tells both nodes they are node
0 and saves nothing.

Over 60 s on a loaded machine (68 s beside a flake hunt of two pytest workers and two spinners): two launches of 4 ranks
forked from the launch server, each with its start-up and save, and the old line's 20 s wait before it is stopped."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ..launch import REPO, finish, launch_env, start, study_launch_env, torchrun
from .test_recipes import OFFLINE

FAKE = REPO / "tests" / "fake_slurm"
TRAIN = ["--model_size", "micro", "--block_size", "64", "--per_device_train_batch_size", "2", "--max_steps", "4",
         "--max_eval_samples", "8", "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none",
         "--disable_tqdm", "true"]  # fmt: skip
FED = ["--fed_group_size", "2", "--fed_sync_steps", "2"]
# The README's SLURM line until this test came (recipes/slurm/pretrain.sbatch replaced it), scaled to this host.
OLD_LINE = """#!/bin/bash
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun --nnodes $SLURM_NNODES --nproc_per_node 2 --node_rank $SLURM_NODEID \\
    --rdzv_endpoint $MASTER_ADDR:$MASTER_PORT recipes/pretrain_clm.py $FED_ARGS $TRAIN_ARGS
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbatch(script, out, timeout_s: float, **env: str) -> subprocess.CompletedProcess:
    """``sbatch --nodes 2 script`` on the fake SLURM: 2 GPUs per node are 2 CPU ranks, the rest from the variables."""
    variables = {**launch_env(), **study_launch_env(), **OFFLINE, "PATH": f"{FAKE}:{launch_env()['PATH']}",
                 "PYTHON": sys.executable, "GPUS_PER_NODE": "2", "MASTER_PORT": str(_free_port()),
                 "FED_ARGS": " ".join(FED), "TRAIN_ARGS": " ".join([*TRAIN, "--output_dir", str(out)]),
                 **env}  # fmt: skip
    return finish(start([FAKE / "sbatch", "--nodes", "2", script], variables), timeout_s)


def _assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


@pytest.mark.timeout(500)
def test_the_sbatch_script_trains_two_nodes_as_one_host_does_and_the_old_line_tells_both_they_are_node_0(tmp_path):
    one_host = tmp_path / "one-host"
    reference = torchrun(4, REPO / "recipes" / "pretrain_clm.py", [*FED, *TRAIN, "--output_dir", one_host], 300)
    assert reference.returncode == 0, reference.stdout[-3000:]

    result = _sbatch(REPO / "recipes" / "slurm" / "pretrain.sbatch", tmp_path / "slurm", 300)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "srun: task 1 on node 1: bash -c" in result.stdout, result.stdout[-3000:]
    _assert_same_bits(load_file(tmp_path / "slurm" / "model.safetensors"), load_file(one_host / "model.safetensors"))

    old = tmp_path / "old.sbatch"
    old.write_text(OLD_LINE)
    tasks = tmp_path / "old-tasks.log"
    try:  # it hangs (node "0"'s torchrun waits in the rendezvous for a node 1 that never comes) or fails
        failed = _sbatch(old, tmp_path / "old", 20, FAKE_SLURM_LOG=str(tasks))
        assert failed.returncode != 0, failed.stdout[-3000:]
    except TimeoutError:
        pass
    told = tasks.read_text().splitlines()  # a file: a hang's output, stacks included, is cut to its end
    assert len(told) == 2 and all("--node_rank 0 " in line for line in told), told
    assert not (tmp_path / "old" / "model.safetensors").exists()


@pytest.mark.timeout(400)
def test_the_torchft_sbatch_script_runs_a_lighthouse_and_a_job_step_per_group_ending_on_one_model(tmp_path):
    """`recipes/slurm/pretrain_torchft.sbatch` on 2 fake nodes of 1 rank: the lighthouse on the first node, a job
    step per group (``srun --relative G``), both groups averaging to the end and saving one model, to the bit."""
    out, tasks = tmp_path / "out", tmp_path / "tasks.log"
    result = _sbatch(REPO / "recipes" / "slurm" / "pretrain_torchft.sbatch", out, 300, GPUS_PER_NODE="1",
                     LIGHTHOUSE_PORT=str(_free_port()), FED_ARGS="--fed_sync_steps 2 --fed_timeout_s 60",
                     FAKE_SLURM_LOG=str(tasks))  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:]
    # from the file: the job steps print at once into one output, where a line can run into another
    steps = sorted(line.split(":")[1].strip() for line in tasks.read_text().splitlines())
    assert steps == ["task 0 on node 0", "task 0 on node 1"], steps  # one job step per group
    _assert_same_bits(*(load_file(out / f"fed_group{g}" / "model.safetensors") for g in range(2)))

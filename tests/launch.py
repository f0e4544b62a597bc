"""Launch a distributed check script under torchrun (gloo, CPU) with a hard timeout.

A hang fails the test instead of blocking CI: the launcher and every process below it are killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"

# Settings shared by every check run: deterministic plain SGD, quiet logs, no files but the dumps.
SGD = [
    "--optim", "sgd", "--learning_rate", "0.1", "--lr_scheduler_type", "constant", "--weight_decay", "0",
    "--max_grad_norm", "0", "--warmup_steps", "0", "--per_device_train_batch_size", "2",
    "--per_device_eval_batch_size", "4", "--report_to", "none", "--save_strategy", "no",
    "--logging_steps", "1", "--disable_tqdm", "true", "--seed", "0",
]  # fmt: skip


def torchrun(
    nproc: int, script: str | Path, args: list[str], timeout_s: float = 240, max_restarts: int = 0
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` local CPU ranks; raise ``TimeoutError`` (after killing it) on a hang.

    With ``max_restarts``, torchrun restarts the whole job after a failure; its rendezvous store is then not
    shared with the workers, whose restarted process groups would otherwise read the dead ones' addresses
    (pytorch/pytorch#135712), as docs/fault_tolerance.md tells users to do.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--max-restarts={max_restarts}", str(script), *map(str, args)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1" if max_restarts else "0", "PYTHONPATH": str(REPO)}  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:  # torchrun starts each worker in a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        raise TimeoutError(f"{cmd} hung for {timeout_s}s; output:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def train_tiny(nproc: int, out_dir: Path, args: list[str], timeout_s: float = 240, max_restarts: int = 0) -> list[dict]:
    """Run tests/scripts/train_tiny.py and load every rank's dump."""
    dump = out_dir / "dump"
    result = torchrun(nproc, SCRIPTS / "train_tiny.py",
                      ["--output_dir", out_dir, "--dump_dir", dump, *SGD, *args], timeout_s, max_restarts)  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:]
    return [torch.load(dump / f"rank{r}.pt", weights_only=False) for r in range(nproc)]

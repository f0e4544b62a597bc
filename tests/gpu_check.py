"""The CUDA paths, checked once on a GPU: ``python -m tests.gpu_check`` (one process, one GPU, under 4 minutes).

This project's tests run on CPU; the lines that only run on a GPU (docs/cluster.md, "What has run where") are
checked here, each by running the same computation on the GPU and on the CPU and comparing:

1. FSDP2 with bf16 mixed precision (``MixedPrecisionPolicy``, the GPU configs' ``mixed_precision: bf16``): a micro
   Llama, 6 AdamW steps on one fixed batch, each step's loss within 5% of the CPU's (bf16 kernels round differently
   by device) and falling by at least 5% on both (the steps train: a broken backward or optimizer step would not);
2. the overlapped exchange (``fed_sync_overlap 1``): 3 groups as threads over in-process communicators
   (tests/fake_communicator.py), the exchange on its worker's own CUDA stream after an event on the main stream
   (`engine/overlap.py`), `torch.cuda.synchronize` before the averaging's timer (`engine/averager.py`), the outer
   optimizer's state in pinned host memory (`engine/outer.py`, Nesterov): every group's parameters after 12 steps
   equal to the CPU run's within fp32 rounding;
3. the topk codec on the GPU (``fed_sync_dtype topk``, error feedback on the device): the same, 12 steps;
4. a background checkpoint's pinned host copies (`checkpointing/background.py`): the state written from the GPU
   reads back bit-equal to its CPU copy.

Its 4 minutes are an estimate: it has not run on a GPU yet. ``--device cpu`` runs every check with the CPU on both
sides (what `tests/unit/test_gpu_check.py` runs: the script
itself works). Prints one line per check and exits 1 if any failed. Not covered here (they need several processes):
NCCL's first all-reduce in `transports/mesh.py` and torchft's `ProcessGroupNCCL` in `transports/elastic.py`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from hf_fedshard import FederatedAverager
from hf_fedshard.checkpointing.background import BackgroundCheckpointer
from hf_fedshard.tools.models import llama_config

from .fake_communicator import run_federation
from .tiny_federation import build, train_step

STEPS = 12


def fsdp2_bf16(device: torch.device) -> list[float]:
    """Losses of 6 AdamW steps on one batch of a micro Llama under FSDP2, bf16 parameters, fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config("micro", vocab_size=256, max_position_embeddings=64)).to(device)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    losses = []
    for _ in range(6):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def federation(device: torch.device, **options) -> list[list[torch.Tensor]]:
    """Every group's parameters and buffer (on the CPU) after `STEPS` steps of the tests' tiny federation, its
    model on ``device``."""

    def rank_fn(comm) -> list[torch.Tensor]:
        model, _ = build(comm.group)
        model.to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        averager = FederatedAverager(model, optimizer, communicator=comm, sync_steps=4, **options)
        for step in range(1, STEPS + 1):
            train_step(model, optimizer, comm.group, step)
            averager.step(last=step == STEPS)
        return [t.detach().cpu().clone() for t in (*model.parameters(), model.stat)]

    return run_federation(3, rank_fn)


def background_checkpoint(device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A state on ``device`` written by a background checkpoint (pinned host copies on a GPU), and what reads back."""
    state = {"w": torch.randn(1024, 256, generator=torch.Generator().manual_seed(2)).to(device),
             "b": torch.arange(4096, dtype=torch.bfloat16).to(device)}  # fmt: skip
    writer = BackgroundCheckpointer([[0]], 1, timedelta(seconds=60), pinned=device.type == "cuda")
    with tempfile.TemporaryDirectory() as folder:
        staging = Path(folder) / "staging"
        writer.write(state, str(staging / "model"))
        writer.start(str(staging), str(Path(folder) / "final"), publish=None)
        writer.wait()
        back = {name: torch.empty_like(t, device="cpu") for name, t in state.items()}
        dcp.load(back, checkpoint_id=str(staging / "model"), process_group=writer._group)
    return {name: t.cpu() for name, t in state.items()}, back


def compare(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    """The largest difference between two federations' tensors, relative to the tensor's own scale."""
    return max(
        float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))
        for ga, gb in zip(a, b, strict=True)
        for x, y in zip(ga, gb, strict=True)
    )


def checks(device: torch.device) -> list[tuple[str, Callable[[], str | None]]]:
    """Each check's name and a function returning ``None`` when it passed, else what differed."""
    cpu = torch.device("cpu")

    def fsdp() -> str | None:
        here, there = fsdp2_bf16(device), fsdp2_bf16(cpu)
        off = max(abs(a - b) / abs(b) for a, b in zip(here, there, strict=True))
        falls = all(run[-1] <= 0.95 * run[0] for run in (here, there))
        return None if off <= 0.05 and falls else f"losses {here} vs CPU {there} (off by {off:.1%})"

    def exchanged(**options) -> Callable[[], str | None]:
        def check() -> str | None:
            off = compare(federation(device, **options), federation(cpu, **options))
            return None if off <= 1e-5 else f"parameters off by {off:.2e} of their scale"

        return check

    def checkpoint() -> str | None:
        state, back = background_checkpoint(device)
        differ = [name for name in state if not torch.equal(state[name], back[name])]
        return f"{differ} read back differently" if differ else None

    return [
        ("FSDP2, bf16 parameters, fp32 reduction", fsdp),
        ("overlapped exchange (stream, event) with Nesterov's pinned state", exchanged(sync_overlap=1,
                                                                                       outer_optimizer="nesterov")),
        ("topk codec with error feedback", exchanged(sync_dtype="topk")),
        ("background checkpoint's host copies", checkpoint),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--device", default="cuda", help="The device checked against the CPU (default cuda).")
    device = torch.device(parser.parse_args(argv).device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; give --device cpu to check the script itself.")
        return 2
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)  # fmt: skip
    failed = 0
    try:
        for name, check in checks(device):
            start = time.monotonic()
            try:
                problem = check()
            except Exception as err:  # a one-shot run on a lent GPU: report it and go on to the next check
                problem = f"raised {type(err).__name__}: {err}"
            failed += problem is not None
            print(f"{'FAIL' if problem else 'ok  '} {name} on {device} vs cpu ({time.monotonic() - start:.1f} s)"
                  + (f": {problem}" if problem else ""), flush=True)  # fmt: skip
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every collective over the world honours ``ddp_timeout``, on CPU as on GPUs, and its failure names the step.

Transformers' ``use_cpu`` device set-up builds Accelerate's ``PartialState`` without ``ddp_timeout``, so on CPU the
world's gloo process group got PyTorch's 30-minute default: a stopped rank hung the job for half an hour. Creating
the state (and with it the process group) with the timeout first makes Transformers reuse it, since neither
Accelerate nor PyTorch initialises a process group twice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch.distributed as dist
from accelerate import PartialState
from transformers import TrainingArguments

from hf_fedshard.engine.failures import peer_died


def _uses_cpu(args: TrainingArguments) -> bool:
    """The condition of Transformers' CPU branch of ``_setup_devices`` (the one that drops ``ddp_timeout``)."""
    return args.use_cpu or os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")


def start_world_process_group(args: TrainingArguments) -> None:
    """Initialise the world's process group with ``args.ddp_timeout`` where Transformers would not pass it."""
    if _uses_cpu(args) and not dist.is_initialized():
        PartialState(cpu=True, backend=args.ddp_backend, timeout=timedelta(seconds=args.ddp_timeout))


@contextlib.contextmanager
def explain_stalled_collectives(step: Callable[[], int], ddp_timeout: float) -> Iterator[None]:
    """Turn a failed collective (a peer stopped or died) into an error naming the step and the setting."""
    try:
        yield
    except RuntimeError as err:
        if not _is_collective_failure(err):
            raise
        if peer_died(err):
            raise RuntimeError(
                f"hf_fedshard: a collective across ranks failed at step {step()}: a rank died (its connection "
                f"closed). Check the other ranks' logs for its error. Cause: {err}"
            ) from err
        raise RuntimeError(
            f"hf_fedshard: a collective across ranks failed at step {step()}: a rank stopped answering (no reply "
            f"within ddp_timeout={ddp_timeout:g} seconds). Check the other ranks' logs; if they are only "
            f"slow, raise --ddp_timeout. Cause: {err}"
        ) from err


def _is_collective_failure(err: RuntimeError) -> bool:
    """A communication error that hf_fedshard has not explained yet (gloo raises plain ``RuntimeError``s)."""
    text = str(err)
    explained = text.startswith("hf_fedshard:")
    return not explained and (isinstance(err, dist.DistError) or "gloo" in text or "NCCL" in text)

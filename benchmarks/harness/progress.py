"""A live record of training that survives SIGKILL: one JSON line per event, appended as it happens.

The fault studies (benchmarks/goodput.py, benchmarks/elastic_demo.py) kill launches mid-run, so a record written at
the end (bench_train.py's ``rank<R>.json``) never comes from the killed group. `ProgressLog` appends instead, to a
file per launch (a federation group under ``fed_transport torchft``, the whole job under ``mesh``):

- ``begin``: training starts (``step`` > 0 after a resume or a heal; ``attempt``: torchrun's restart count);
- ``sync``: an averaging step has ended (committed, with torchft), with the ``fed_*`` metrics logged there;
- ``save``: a checkpoint of ``step`` is complete;
- ``end``: every rank, after training: the SHA-256 of its local shards (the groups hold one global model iff
  the ranks at the same position of every group agree).

A study that kills launches ends a run by writing a step S (a multiple of H) to the launches' stop file: every group
stops at its averaging of step S, so that the groups still up end on one model, which their ``end`` events show.

Times are ``time.time()`` (seconds since the epoch), so that they line up with the faults the study injects.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

FED_KEYS = ("fed_groups_in_quorum", "fed_heals", "fed_quorum_seconds")


def append(path: str | Path, event: dict) -> None:
    """One JSON line, appended in a single write (lines of concurrent writers do not interleave)."""
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def read(path: str | Path) -> list[dict]:
    """Every complete line of a progress log (a line cut short by SIGKILL is dropped); none if it does not exist."""
    if not Path(path).exists():
        return []
    events = []
    for line in Path(path).read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def shards_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over this rank's local shards of every parameter, in order."""
    digest = hashlib.sha256()
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        digest.update(local.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


class ProgressLog(TrainerCallback):
    """Appends this launch's events to ``path``; add it last, so that a ``sync`` follows the averaging callback."""

    def __init__(self, path: str | Path, sync_steps: int, fed_metrics, stop_file: str | Path | None = None) -> None:
        self.path, self.sync_steps, self.fed_metrics = Path(path), sync_steps, fed_metrics
        self.stop_file = Path(stop_file) if stop_file else None
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def stop_step(self) -> int | None:
        """The step the study asked every group to stop at, once it has (the file holds one integer)."""
        if self.stop_file is None or not self.stop_file.exists():
            return None
        text = self.stop_file.read_text().strip()
        return int(text) if text else None

    def _event(self, name: str, step: int, **extra) -> dict:
        return {"event": name, "t": time.time(), "step": step, "attempt": self.attempt, **extra}

    def on_train_begin(self, args, state, control, **kwargs):
        if args.process_index == 0:
            append(self.path, self._event("begin", state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.sync_steps:
            return
        if args.process_index == 0:
            fed = {k: v for k, v in self.fed_metrics().items() if k in FED_KEYS}
            append(self.path, self._event("sync", state.global_step, **fed))
        stop = self.stop_step()  # read by every rank: S lies ahead of every rank when written, so all see it
        if stop is not None and state.global_step >= stop:
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        if args.process_index == 0:
            append(self.path, self._event("save", state.global_step))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        append(self.path, self._event("end", state.global_step, rank=args.process_index, sha256=shards_sha256(model)))

"""The averager's state in a checkpoint: counters and exchange in flight per rank, the outer state by parameter.

`FederatedAverager.state_dict` holds four parts. The counters (JSON) and the exchange in flight (its snapshot and
mean Δ, group-specific) are written by every rank into its group's folder; the sparse payload's error feedback (each
group's own residual) by every group's ranks with DCP into ``fed_group{g}/feedback/``, by parameter name, like the
outer state below. The anchor and the outer momentum, equal
in every group, are written once, by group 0's ranks, with DCP into ``fed_outer/``: each is wrapped as a DTensor
with its parameter's mesh and placements, so a run on another number or size of groups reads them back with its own
shards, DCP cutting from the saved chunks what each rank needs (`hf_fedshard.checkpointing.reshard`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from hf_fedshard.checkpointing.checkpoint import OUTER_DIR, StateWrite, dcp_write, group_dir, reading
from hf_fedshard.topology import FederationLayout

ANCHOR, MOMENTUM, FEEDBACK = "anchor", "momentum", "feedback"


def named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters with their names, in the order the engine holds their anchors."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _wrap(local: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """``local`` (a copy of ``param``'s local shard) as a DTensor laid out like ``param``; DCP reads and writes
    through it. On the parameter's device: the engine may keep the anchor in pinned CPU memory."""
    local = local.to(local_device(param))
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def local_device(param: nn.Parameter) -> torch.device:
    return param.to_local().device if isinstance(param, DTensor) else param.device


def _momentum(optimizer_state: dict, index: int) -> torch.Tensor | None:
    return optimizer_state["state"].get(index, {}).get("momentum_buffer")


def save_outer_state(
    checkpoint: str, model: nn.Module, outer: dict, group: ProcessGroup, write: StateWrite = dcp_write
) -> None:
    """Write the engine's ``outer`` state as DCP under ``fed_outer/``; every rank of ``group`` must call it."""
    named = named_trainable(model)
    fragments = outer["fragments"]
    anchors = [a for f in fragments for a in f["anchor"]]
    momenta = [_momentum(f["optimizer"], i) for f in fragments for i in range(len(f["anchor"]))]
    state = {
        ANCHOR: {name: _wrap(a, p) for (name, p), a in zip(named, anchors, strict=True)},
        MOMENTUM: {name: _wrap(m, p) for (name, p), m in zip(named, momenta, strict=True) if m is not None},
    }
    write(state, os.path.join(checkpoint, OUTER_DIR), group)


def load_outer_state(checkpoint: str, model: nn.Module, group: ProcessGroup) -> dict:
    """The outer state for this rank, read from DCP in the engine's flat form (``anchor`` and ``momentum``, a tensor
    or ``None`` per trainable parameter: `hf_fedshard.engine.outer.fragments_from_flat`); every rank of ``group``
    must call it."""
    directory = os.path.join(checkpoint, OUTER_DIR)
    with reading(directory):
        saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    named = named_trainable(model)
    anchors = [local_copy(p) for _, p in named]
    has_momentum = [f"{MOMENTUM}.{name}" in saved for name, _ in named]
    momenta = [local_copy(p) if present else None for (_, p), present in zip(named, has_momentum, strict=True)]
    state = {
        ANCHOR: {name: _wrap(a, p) for (name, p), a in zip(named, anchors, strict=True)},
        MOMENTUM: {name: _wrap(m, p) for (name, p), m in zip(named, momenta, strict=True) if m is not None},
    }
    with reading(directory):
        dcp.load(state, checkpoint_id=directory, process_group=group)
    return {  # held on the CPU until the averager copies them into its own anchors (their device)
        ANCHOR: [_local(state[ANCHOR][name]).cpu() for name, _ in named],
        MOMENTUM: [
            _local(state[MOMENTUM][name]) if m is not None else None
            for (name, _), m in zip(named, momenta, strict=True)
        ],
    }


def feedback_dir(checkpoint: str, group_index: int) -> str:
    return os.path.join(group_dir(checkpoint, group_index), FEEDBACK)


def save_feedback(
    directory: str, model: nn.Module, residual: list[torch.Tensor], group: ProcessGroup, write: StateWrite = dcp_write
) -> None:
    """Write this group's error-feedback residual (a tensor per trainable parameter) with DCP; every rank of
    ``group`` (the group's) must call it."""
    named = named_trainable(model)
    write({FEEDBACK: {name: _wrap(e, p) for (name, p), e in zip(named, residual, strict=True)}}, directory, group)


def load_feedback(directory: str, model: nn.Module, group: ProcessGroup) -> list[torch.Tensor] | None:
    """`save_feedback`'s residual on this rank's shards (resharded by DCP where the layout changed), or ``None``
    where the checkpoint has none (another payload); every rank of ``group`` must call it."""
    if not os.path.isdir(directory):
        return None
    named = named_trainable(model)
    state = {FEEDBACK: {name: _wrap(local_copy(p), p) for name, p in named}}
    with reading(directory):
        dcp.load(state, checkpoint_id=directory, process_group=group)
    return [_local(state[FEEDBACK][name]) for name, _ in named]


def local_copy(param: nn.Parameter) -> torch.Tensor:
    """An fp32 buffer shaped like ``param``'s local shard, for DCP to load into."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return torch.empty(local.shape, dtype=torch.float32, device=local.device)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def write_counters(checkpoint: str, group_index: int, rank: int, counters: dict[str, Any]) -> None:
    with open(os.path.join(group_dir(checkpoint, group_index), f"fedavg_rank{rank}.json"), "w") as f:
        json.dump(counters, f)


def read_counters(checkpoint: str, group_index: int, rank: int) -> dict[str, Any]:
    path = os.path.join(group_dir(checkpoint, group_index), f"fedavg_rank{rank}.json")
    with reading(path), open(path) as f:
        return json.load(f)


def in_flight_path(checkpoint: str | Path, group: int, rank: int) -> str:
    """The file of rank ``rank``'s exchange in flight (group-specific: it holds the group's own snapshot)."""
    return os.path.join(group_dir(checkpoint, group), f"in_flight_rank{rank}.pt")


def save_in_flight_state(checkpoint: str, group: int, rank: int, state: dict | None) -> None:
    """Write this rank's exchange in flight, if there is one."""
    if state is not None:
        torch.save(state, in_flight_path(checkpoint, group, rank))


def load_in_flight_state(checkpoint: str, group: int, rank: int, device: torch.device) -> dict | None:
    """This rank's exchange in flight at the save (its tensors on ``device``), or ``None`` when there was none."""
    path = in_flight_path(checkpoint, group, rank)
    if not os.path.isfile(path):
        return None
    location = "cpu" if device.type == "cpu" else device  # torch.load does not restore onto "cpu:0"
    with reading(path):
        return torch.load(path, map_location=location, weights_only=True)


def save_averaging_state(
    checkpoint: str,
    layout: FederationLayout,
    rank: int,
    state: dict,
    model: nn.Module,
    group: ProcessGroup,
    write: StateWrite = dcp_write,
) -> None:
    """Write rank ``rank``'s `FederatedAverager.state_dict` into its files: counters and exchange in flight in its
    group's folder, the outer state (equal in every group) by group 0's ranks over ``group`` (theirs); its DCP
    states through ``write``."""
    index = layout.group_index(rank)
    os.makedirs(group_dir(checkpoint, index), exist_ok=True)
    write_counters(checkpoint, index, rank, state["counters"])
    save_in_flight_state(checkpoint, index, rank, state["in_flight"])
    if state.get("feedback") is not None:
        save_feedback(feedback_dir(checkpoint, index), model, state["feedback"], group, write)
    if index == 0:
        save_outer_state(checkpoint, model, state["outer"], group, write)


def load_averaging_state(
    checkpoint: str, layout: FederationLayout, rank: int, model: nn.Module, group: ProcessGroup
) -> dict:
    """`save_averaging_state`'s files as rank ``rank``'s `FederatedAverager.state_dict` (without ``step``, which
    the Trainer's state holds); every rank of ``group`` (its group) must call it."""
    index = layout.group_index(rank)
    outer = load_outer_state(checkpoint, model, group)  # the group's collectives come first
    feedback = load_feedback(feedback_dir(checkpoint, index), model, group)
    return {
        "counters": read_counters(checkpoint, index, rank),
        "in_flight": load_in_flight_state(checkpoint, index, rank, local_device(next(model.parameters()))),
        "outer": outer,
        "feedback": feedback,
    }

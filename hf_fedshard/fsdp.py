"""Make an `Accelerator` shard with FSDP2 over each federation group, on GPUs and on CPU/gloo alike.

Two things Accelerate does not do by itself:

- On a machine without GPUs it turns an FSDP request into DDP without a word (the FSDP branch of
  `AcceleratorState` only covers accelerator devices). FSDP2 works on CPU with gloo, so we switch the
  state to FSDP ourselves.
- Its FSDP2 mesh spans the whole world. We give it the federation mesh through a
  `FederatedParallelismConfig`, whose FSDP axes are one group's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.device_mesh import DeviceMesh
from transformers import TrainingArguments

from .errors import ConfigError
from .mesh import FederationLayout


def requested_fsdp_plugin(args: TrainingArguments) -> FullyShardedDataParallelPlugin | None:
    """The FSDP plugin the user asked for, from the arguments or from `accelerate launch`'s environment."""
    if args.fsdp_plugin_args is not None:
        return FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return FullyShardedDataParallelPlugin()
    return None


def ensure_fsdp(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Switch a multi-CPU state to FSDP with ``plugin``; a no-op where Accelerate already did it."""
    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        return
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise ConfigError(
            f"FSDP was requested but Accelerate set up {state.distributed_type}. Launch with torchrun or "
            "accelerate launch (distributed_type: FSDP), with the same number of processes on every node."
        )
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def use_federation_mesh(accelerator: Accelerator, layout: FederationLayout) -> DeviceMesh:
    """Give ``accelerator`` the federation mesh, so `fully_shard` shards over this rank's group only."""
    existing = accelerator.parallelism_config
    if existing is not None and existing.non_data_parallel_size > 1:
        raise ConfigError(
            f"fed_group_size/fed_shard_size cannot be combined with tp/cp/sp parallelism (got {existing}). "
            "Remove the parallelism_config from the accelerate config."
        )
    if layout.world_size != accelerator.num_processes:
        raise ConfigError(
            f"WORLD_SIZE({layout.world_size}) != Accelerate's num_processes({accelerator.num_processes}). "
            "Launch every process with torchrun or accelerate launch."
        )
    config = layout.parallelism_config()
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh(accelerator.device.type)
    return accelerator.state.device_mesh


@contextlib.contextmanager
def world_data_view(accelerator: Accelerator) -> Iterator[None]:
    """Hide the mesh while preparing a data loader, so batches are sharded over every rank of the world.

    Accelerate derives the number of data shards from the mesh's dp axes, which span one group; every group
    must read its own slice of the data.
    """
    mesh = accelerator.state.device_mesh
    accelerator.state.device_mesh = None
    try:
        yield
    finally:
        accelerator.state.device_mesh = mesh

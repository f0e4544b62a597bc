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
from dataclasses import dataclass

from accelerate import Accelerator, ParallelismConfig, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.device_mesh import DeviceMesh
from transformers import TrainingArguments

from hf_fedshard.errors import ConfigError
from hf_fedshard.topology import FederationLayout, MeshAxis


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
    config = parallelism_config(layout, accelerator.process_index)
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh(accelerator.device.type)
    return accelerator.state.device_mesh


@contextlib.contextmanager
def world_data_view(
    accelerator: Accelerator, first_rank: int | None = None, world_size: int | None = None
) -> Iterator[None]:
    """Hide the mesh while preparing a data loader, so batches are sharded over every rank of the world.

    Accelerate derives the number of data shards from the mesh's dp axes, which span one group; every group
    must read its own slice of the data. With ``first_rank`` (this launch is one group of a federation of
    launches, torchft, whose ranks would be ``first_rank`` … in one job of ``world_size`` ranks) the shards are
    those of the federation's world, so the group reads what its ranks would read in that one job.
    """
    state = accelerator.state
    saved = state.device_mesh, state.num_processes, state.process_index
    state.device_mesh = None
    if first_rank is not None:
        state.num_processes, state.process_index = world_size, first_rank + saved[2]
    try:
        yield
    finally:
        state.device_mesh, state.num_processes, state.process_index = saved


@dataclass
class FederatedParallelismConfig(ParallelismConfig):
    """Accelerate's ``ParallelismConfig`` with one more axis, ``fed``, outside the FSDP axes.

    ``dp_replicate_size`` and ``dp_shard_size`` describe this rank's group, as Accelerate would for a job of that
    group alone; ``total_size`` counts every group so that it equals the world size (``fed_size`` groups of equal
    size, or the ``fed_group_sizes`` of groups of unequal size).
    """

    fed_size: int = 1
    fed_group_sizes: tuple[int, ...] | None = None
    fed_shard_size: int | None = None  # with fed_group_sizes: the setting (None: each group shards over itself)

    @property
    def total_size(self) -> int:
        if self.fed_group_sizes is not None:
            return sum(self.fed_group_sizes)
        return self.fed_size * super().total_size

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The group's own FSDP axes, so that Accelerate's ``mesh[fsdp_dim_names]`` slices no flattened axis.

        Accelerate names its flattened ``dp_shard_cp`` here, and slicing a flattened axis from the root mesh warns
        on every rank ("will be deprecated in PT 2.11"); without context parallelism (refused with a federation)
        it is ``dp_shard`` itself.
        """
        return [MeshAxis.REPLICATE.value, MeshAxis.SHARD.value] if self.dp_replicate_enabled else [MeshAxis.SHARD.value]

    def build_device_mesh(self, device_type: str) -> DeviceMesh:
        return self.layout.build_mesh(device_type)

    @property
    def layout(self) -> FederationLayout:
        """The federation this config describes."""
        if self.fed_group_sizes is not None:
            return FederationLayout(self.total_size, self.fed_group_sizes, self.fed_shard_size)
        group = self.dp_replicate_size * self.dp_shard_size
        return FederationLayout(world_size=self.total_size, group_size=group, shard_size=self.dp_shard_size)


def parallelism_config(layout: FederationLayout, rank: int = 0) -> FederatedParallelismConfig:
    """Accelerate's view of ``layout`` from ``rank``: its group's FSDP axes, and the groups as the ``fed`` axis."""
    group = layout.group_index(rank)
    return FederatedParallelismConfig(
        dp_replicate_size=layout.replicas_of(group),
        dp_shard_size=layout.shard_of(group),
        fed_size=layout.num_groups,
        fed_group_sizes=None if layout.equal else layout.group_sizes,
        fed_shard_size=layout.shard_size,
    )

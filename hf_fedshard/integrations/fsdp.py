"""Make an `Accelerator` shard with FSDP2 over each federation group, on GPUs and on CPU/gloo alike.

Two things Accelerate does not do by itself:

- On a machine without GPUs it turns an FSDP request into DDP without a word (the FSDP branch of
  `AcceleratorState` only covers accelerator devices). FSDP2 works on CPU with gloo, so we switch the
  state to FSDP ourselves.
- Its FSDP2 mesh spans the whole world. We give it the federation mesh through a
  `FederatedParallelismConfig`, whose FSDP axes are one group's.

Its ``cpu_ram_efficient_loading`` works as it is under a federation: `fsdp2_prepare_model` broadcasts the main
process's full state dict over the world (once, so the model crosses the slow tier once at start-up) and every group
shards it over its own mesh, so every group starts from the weights a normal load gives. Transformers 5 reads the
weights on every rank all the same: `loads_weights` says which ranks need not, and they build the model on the meta
device instead (`hf_fedshard.tools.models.build_model`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from accelerate import Accelerator, ParallelismConfig, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch import nn
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


def ram_efficient_loading(plugin: FullyShardedDataParallelPlugin | None) -> bool:
    """Whether Accelerate fills the model with the main process's weights as it shards it: the plugin's
    ``cpu_ram_efficient_loading`` (``fsdp_cpu_ram_efficient_loading: true`` in an accelerate config,
    ``fsdp_config={"cpu_ram_efficient_loading": True}`` in the arguments, ``FSDP_CPU_RAM_EFFICIENT_LOADING=1``)."""
    return plugin is not None and bool(plugin.cpu_ram_efficient_loading)


def loads_weights(args: TrainingArguments) -> bool:
    """Whether this rank must read the pretrained weights: every rank, but under ``cpu_ram_efficient_loading`` the
    main process alone, whose weights Accelerate broadcasts to the others (theirs may be on the meta device).

    The main process is rank 0 of the launch: of the world with ``fed_transport mesh``, of its group with torchft.
    Needs the process group (``args.process_index``), as the model is built after it exists.
    """
    return args.process_index == 0 or not ram_efficient_loading(requested_fsdp_plugin(args))


def check_weights_present(model: nn.Module, plugin: FullyShardedDataParallelPlugin | None, main_process: bool) -> None:
    """Refuse a model with parameters on the meta device that nothing would fill: without ``cpu_ram_efficient_loading``,
    or on the main process, whose weights are the ones broadcast."""
    meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
    if meta is None:
        return
    if not ram_efficient_loading(plugin):
        raise ConfigError(
            f"the model's {meta} is on the meta device (no weights) and cpu_ram_efficient_loading is off, so nothing "
            "would fill it. Load the weights on every rank, or set fsdp_cpu_ram_efficient_loading: true in the "
            "accelerate config (torchrun: --fsdp_config '{\"cpu_ram_efficient_loading\": true}')."
        )
    if main_process:
        raise ConfigError(
            f"cpu_ram_efficient_loading broadcasts the main process's weights, but its {meta} is on the meta device. "
            "Load the weights on rank 0 (only the other ranks may build the model empty: see loads_weights)."
        )


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

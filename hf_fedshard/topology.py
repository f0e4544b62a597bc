"""The federation's topology: how the world of ranks splits into federation groups, and its device mesh.

Vocabulary (as in torchtitan): an *axis* is a dimension of the device mesh, a *dim* is a tensor dimension.

The world is a 3-axis mesh, rank = group × group_size + replica × shard_size + shard::

    fed           (num_groups)   groups; FedAvg all-reduces local shards along this axis every H steps
    dp_replicate  (replicas)     HSDP replicas inside one group; gradients all-reduced every step
    dp_shard      (shard_size)   ranks that shard one copy of the model (FSDP2) inside one group

Groups are blocks of contiguous ranks, so a group is one node (or a few) under the usual launchers, and
the ``fed`` axis is the only one whose collectives cross the slow tier of the network. Groups may differ in size
(``fed_group_size 4,2,2``). Every transport (`hf_fedshard.transports`) reads the groups from here; none defines
them. (Accelerate reads the mesh through `hf_fedshard.integrations.fsdp.FederatedParallelismConfig`.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hf_fedshard.engine.pieces import GroupShape
from hf_fedshard.errors import ConfigError


class MeshAxis(str, Enum):
    """Names of the mesh axes; the only place these strings are spelled (Accelerate's names where it has one)."""

    FED = "fed"
    REPLICATE = "dp_replicate"
    SHARD = "dp_shard"
    # Flattened axes that Accelerate looks up by name.
    SHARD_CP = "dp_shard_cp"
    DATA = "dp"
    DATA_CP = "dp_cp"


@dataclass(frozen=True)
class FederationLayout:
    """Sizes of the federation: validated on construction, before any process group exists.

    Args:
        world_size: number of ranks in the job.
        group_size: ranks per federation group (``fed_group_size``); ``None`` means one group of the world; a
            tuple gives each group its own size (groups of unequal size, in rank order; equal sizes are the int).
        shard_size: ranks sharding one model copy inside a group (``fed_shard_size``); ``None`` means the
            whole group (FL+FSDP); smaller gives FL+HSDP with ``group_size // shard_size`` replicas.
    """

    world_size: int
    group_size: int | tuple[int, ...] | None = None
    shard_size: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"WORLD_SIZE must be at least 1, got {self.world_size}.")
        group = self.world_size if self.group_size is None else self.group_size
        if not isinstance(group, int):
            group = _unequal_sizes(tuple(group), self.world_size, self.shard_size)
        object.__setattr__(self, "group_size", group)
        if isinstance(group, tuple):
            return
        object.__setattr__(self, "shard_size", group if self.shard_size is None else self.shard_size)
        if not 1 <= group <= self.world_size or self.world_size % group:
            raise ConfigError(
                f"fed_group_size={group} must divide the world size: WORLD_SIZE({self.world_size}) % "
                f"fed_group_size({group}) = {self.world_size % group if group >= 1 else 'undefined'}. "
                f"Set --fed_group_size to a divisor of {self.world_size} (e.g. the ranks per node), or give "
                "each group its size (e.g. --fed_group_size 4,2,2)."
            )
        if not 1 <= self.shard_size <= group or group % self.shard_size:
            raise ConfigError(
                f"fed_shard_size={self.shard_size} must divide the group size: fed_group_size({group}) % "
                f"fed_shard_size({self.shard_size}) != 0. Set --fed_shard_size to a divisor of {group}, "
                f"or leave it unset for FL+FSDP (shard over the whole group)."
            )

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> FederationLayout:
        """The layout of a world mesh built by `build_mesh` (axes ``fed``, ``dp_replicate``, ``dp_shard``)."""
        names = (MeshAxis.FED.value, MeshAxis.REPLICATE.value, MeshAxis.SHARD.value)
        if tuple(mesh.mesh_dim_names or ()) != names:
            raise ConfigError(
                f"the mesh has axes {mesh.mesh_dim_names}, not {names}. Build it with "
                "FederationLayout(world_size, group_size).build_mesh(device_type); with groups of unequal size "
                "(one mesh per group) pass communicator=mesh_communicator(layout, mesh, …) instead of the mesh."
            )
        groups, replicas, shards = mesh.shape
        return cls(groups * replicas * shards, replicas * shards, shards)

    @classmethod
    def from_env(cls, group_size: int | tuple[int, ...] | None, shard_size: int | None) -> FederationLayout:
        """Layout for the job this process belongs to; reads ``WORLD_SIZE`` so it needs no process group. A
        process started without a launcher (no ``WORLD_SIZE``) that asks for several ranks is told to use one,
        rather than to change a size that is right (`launcher_needed`)."""
        if "WORLD_SIZE" not in os.environ and (message := launcher_needed(group_size, shard_size)):
            raise ConfigError(message)
        return cls(int(os.environ.get("WORLD_SIZE", "1")), group_size, shard_size)

    @property
    def equal(self) -> bool:
        """Whether every group has the same size (rank r of every group then holds the same shards)."""
        return isinstance(self.group_size, int)

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return self.group_size if isinstance(self.group_size, tuple) else (self.group_size,) * self.num_groups

    @property
    def num_groups(self) -> int:
        return len(self.group_size) if isinstance(self.group_size, tuple) else self.world_size // self.group_size

    def size_of(self, group: int) -> int:
        return self.group_sizes[group]

    def shard_of(self, group: int) -> int:
        """Ranks sharding one model copy in ``group``: ``fed_shard_size``, else the whole group."""
        return self.size_of(group) if self.shard_size is None else self.shard_size

    def replicas_of(self, group: int) -> int:
        """HSDP replicas inside ``group`` (1 for FL+FSDP)."""
        return self.size_of(group) // self.shard_of(group)

    def first_rank(self, group: int) -> int:
        return sum(self.group_sizes[:group])

    def ranks_of(self, group: int) -> tuple[int, ...]:
        start = self.first_rank(group)
        return tuple(range(start, start + self.size_of(group)))

    @property
    def group_weights(self) -> list[int]:
        """Each group's weight in a mean over groups: its ranks (the samples it reads) where sizes differ, else 1."""
        return [1] * self.num_groups if self.equal else list(self.group_sizes)

    @property
    def distinct_sizes(self) -> list[int]:
        """The group sizes, each once, largest first (one for equal groups): what a line about group batches lists."""
        return sorted(set(self.group_sizes), reverse=True)

    def group_shapes(self) -> tuple[GroupShape, ...]:
        """Every group's ranks and shard size, as the exchange between groups of unequal size addresses them."""
        return tuple(GroupShape(self.ranks_of(g), self.shard_of(g)) for g in range(self.num_groups))

    @property
    def replicas(self) -> int:
        """HSDP replicas inside one group (1 for FL+FSDP); of the largest group where groups differ in size."""
        return max(self.replicas_of(g) for g in range(self.num_groups))

    @property
    def federated(self) -> bool:
        """True when more than one group averages; False is plain FSDP/HSDP."""
        return self.num_groups > 1

    @property
    def method(self) -> str:
        """The paper's name for this layout: FSDP, HSDP, FL+FSDP or FL+HSDP."""
        inner = "HSDP" if self.replicas > 1 else "FSDP"
        return f"FL+{inner}" if self.federated else inner

    @property
    def shape(self) -> tuple[int, int, int]:
        if not self.equal:
            raise ConfigError("groups of unequal size have no (groups, replicas, shards) shape: one mesh per group.")
        return (self.num_groups, self.replicas, self.shard_size)

    def group_index(self, rank: int) -> int:
        """Index of the federation group that ``rank`` belongs to."""
        if self.equal:
            return rank // self.group_size
        return next(g for g in range(self.num_groups) if rank < self.first_rank(g) + self.size_of(g))

    def position(self, rank: int) -> int:
        """``rank``'s (replica, shard) position inside its group: the ranks of one position hold the same shards."""
        return rank - self.first_rank(self.group_index(rank))

    def fed_peer_ranks(self) -> list[list[int]]:
        """The ranks of each ``fed`` process group: one list per (replica, shard) position, one rank per group."""
        return [[g * self.group_size + position for g in range(self.num_groups)] for position in range(self.group_size)]

    def replica_peer_ranks(self) -> list[list[int]]:
        """The ranks of each replica set: one list per (group, shard) position, one rank per HSDP replica."""
        return [
            [g * self.group_size + r * self.shard_size + s for r in range(self.replicas)]
            for g in range(self.num_groups)
            for s in range(self.shard_size)
        ]

    @property
    def group_size_arg(self) -> str:
        """``fed_group_size`` as it is written on the command line: ``4``, or ``4,2,2`` for groups of unequal size."""
        return ",".join(map(str, self.group_sizes)) if not self.equal else str(self.group_size)

    def summary(self) -> str:
        """A few words for a start-up line: ``FL+FSDP, 4 groups × 2 ranks`` (shards and unequal sizes said)."""
        if not self.equal:
            shards = "" if self.shard_size is None else f", shards of {self.shard_size}"
            return f"{self.method}, groups of {self.group_size_arg} ranks{shards}"
        shards = f", shards of {self.shard_size}" if self.shard_size != self.group_size else ""
        return f"{self.method}, {self.num_groups} groups × {self.group_size} ranks{shards}"

    def describe(self) -> str:
        """One line for the log, with the arithmetic that explains it."""
        if self.equal:
            return (
                f"{self.method}: WORLD_SIZE({self.world_size}) = groups({self.num_groups}) × "
                f"replicas({self.replicas}) × shards({self.shard_size})"
            )
        groups = " + ".join(f"{self.replicas_of(g)}×{self.shard_of(g)}" for g in range(self.num_groups))
        return (
            f"{self.method}, groups of unequal size: WORLD_SIZE({self.world_size}) = {groups} "
            "(replicas × shards per group)"
        )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh (fed, dp_replicate, dp_shard) plus the flattened axes Accelerate looks up.

        - ``mesh["fed"]``: the ranks holding the same shards in every group (averaging uses a copy of it with its
          own timeout, `fed_process_group`).
        - ``mesh["dp_replicate", "dp_shard_cp"]``: the group's FSDP2/HSDP mesh given to ``fully_shard``.
        - ``mesh["dp"]``, ``mesh["dp_cp"]``: the group's data-parallel ranks (Accelerate's loss and metric axes).

        With groups of unequal size there is no world mesh: every rank builds every group's (dp_replicate,
        dp_shard) mesh, in group order (creating a process group is a collective of the world), and returns its
        own group's.
        """
        if not self.equal:
            meshes = [self._group_mesh(device_type, g) for g in range(self.num_groups)]
            return meshes[self.group_index(dist.get_rank())]
        mesh = init_device_mesh(
            device_type, self.shape, mesh_dim_names=(MeshAxis.FED.value, MeshAxis.REPLICATE.value, MeshAxis.SHARD.value)
        )
        _flatten_group_axes(mesh)
        return mesh

    def _group_mesh(self, device_type: str, group: int) -> DeviceMesh:
        """``group``'s mesh, built by every rank. Its ``dp_shard_cp`` axis is left out: flattening a slice needs a
        rank of the group, and no code path reads that name with a federation (it is ``dp_shard`` without context
        parallelism, which a federation refuses)."""
        ranks = torch.tensor(self.ranks_of(group)).view(self.replicas_of(group), self.shard_of(group))
        mesh = DeviceMesh(device_type, ranks, mesh_dim_names=(MeshAxis.REPLICATE.value, MeshAxis.SHARD.value))
        _flatten_group_axes(mesh, shard_cp=False)
        return mesh


def _flatten_group_axes(mesh: DeviceMesh, shard_cp: bool = True) -> None:
    """The flattened axes Accelerate looks up by name, over one group's (dp_replicate, dp_shard)."""
    if shard_cp:
        mesh[MeshAxis.SHARD.value]._flatten(MeshAxis.SHARD_CP.value)
    in_group = (MeshAxis.REPLICATE.value, MeshAxis.SHARD.value)
    mesh[in_group]._flatten(MeshAxis.DATA.value)
    mesh[in_group]._flatten(MeshAxis.DATA_CP.value)


def parse_group_size(value: int | str | Sequence[int] | None) -> int | tuple[int, ...] | None:
    """``fed_group_size`` as given on the command line ("2", "4,2,2") or in code: an int, or one size per group."""
    if value is None or isinstance(value, int):
        return value
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        sizes = tuple(int(part) for part in parts)
    except ValueError:
        raise ConfigError(
            f"fed_group_size={value!r} is not a size or a comma-separated list of sizes: e.g. --fed_group_size 4 "
            "(groups of 4 ranks) or --fed_group_size 4,2,2 (one size per group)."
        ) from None
    return sizes[0] if len(sizes) == 1 else sizes


def launcher_needed(group_size: int | tuple[int, ...] | None, shard_size: int | None) -> str | None:
    """The one line for sizes above one rank in a single process (plain ``python``, no launcher), else ``None``.

    Shrinking the sizes to 1 would "fix" it into a run without a federation, so the line names the setting as
    typed, both launchers and a process count that fits: two groups of ``fed_group_size`` (the smallest
    federation), the listed groups, or one group of ``fed_shard_size``.
    """
    sizes = group_size if isinstance(group_size, tuple) else (group_size or 1,)
    if max(sum(sizes), shard_size or 1) <= 1 or min(sizes) < 1:
        return None  # one rank asked for, or sizes the layout refuses with its own message
    processes = max(2 * sizes[0] if isinstance(group_size, int) else sum(sizes), shard_size or 1)
    listed = ",".join(map(str, sizes))
    setting = f"fed_shard_size={shard_size}" if group_size is None else f"fed_group_size={listed}"
    script = sys.argv[0] if sys.argv[0].endswith(".py") else "your_script.py"
    return (
        f"{setting} needs several processes, but this one was started without a launcher (no WORLD_SIZE): run "
        f"`accelerate launch --num_processes {processes} {script} ...` or `torchrun --nproc_per_node {processes} "
        f"{script} ...`, not plain `python`."
    )


def _unequal_sizes(sizes: tuple[int, ...], world_size: int, shard_size: int | None) -> int | tuple[int, ...]:
    """``fed_group_size`` given per group, checked; equal sizes come back as the one int."""
    listed = ",".join(map(str, sizes))  # FederationLayout.group_size_arg, before the layout exists
    if not sizes or min(sizes) < 1:
        raise ConfigError(
            f"fed_group_size={listed}: every group needs at least one rank. Drop the empty group(s) from the list."
        )
    if sum(sizes) != world_size:
        raise ConfigError(
            f"fed_group_size={listed} sums to {sum(sizes)} ranks, but WORLD_SIZE={world_size}: the groups must "
            f"cover the world. Give sizes that add up to {world_size}."
        )
    if shard_size is not None and (shard_size < 1 or any(size % shard_size for size in sizes)):
        raise ConfigError(
            f"fed_group_size={listed}: fed_shard_size={shard_size} must divide every group's size (it is each "
            "group's FSDP shard, the rest its HSDP replicas). Pick a common divisor, or leave --fed_shard_size unset."
        )
    return sizes[0] if len(set(sizes)) == 1 else sizes

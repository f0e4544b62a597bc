"""The federation layout: how the world of ranks splits into federation groups, and its device mesh.

Vocabulary (as in torchtitan): an *axis* is a dimension of the device mesh, a *dim* is a tensor dimension.

The world is a 3-axis mesh, rank = group × group_size + replica × shard_size + shard::

    fed           (num_groups)   groups; FedAvg all-reduces local shards along this axis every H steps
    dp_replicate  (replicas)     HSDP replicas inside one group; gradients all-reduced every step
    dp_shard      (shard_size)   ranks that shard one copy of the model (FSDP2) inside one group

Groups are blocks of contiguous ranks, so a group is one node (or a few) under the usual launchers, and
the ``fed`` axis is the only one whose collectives cross the slow tier of the network.

This is the one-job transport: every group is in one ``torch.distributed`` world, and `mesh_communicator` gives the
engine its cross-group collectives over process groups of that world. (Accelerate reads the mesh through
`hf_fedshard.integrations.fsdp.FederatedParallelismConfig`.)
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, new_subgroups_by_enumeration
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hf_fedshard.engine.communicator import FederationCommunicator, ProcessGroupCommunicator
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
        if self.world_size == 1:
            _refuse_one_process(self.group_size, self.shard_size)
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
        """Layout for the job this process belongs to; reads ``WORLD_SIZE`` so it needs no process group."""
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


def _refuse_one_process(group_size: int | tuple[int, ...] | None, shard_size: int | None) -> None:
    """Sizes above one rank in a single process: the script was run with plain ``python``, not a launcher.

    Shrinking the sizes to 1 would "fix" it into a run without a federation, so the error names the launchers
    and a process count that fits the sizes: two groups of ``fed_group_size``, every listed group, or one shard.
    """
    sizes = (group_size,) if isinstance(group_size, int) else tuple(group_size or ())
    if max(sum(sizes), shard_size or 1) <= 1 or (sizes and min(sizes) < 1):
        return  # one rank asked for, or sizes the other checks refuse with their own message
    processes = max(2 * sizes[0] if len(sizes) == 1 else sum(sizes), shard_size or 1)
    setting = f"fed_group_size={','.join(map(str, sizes))}" if sizes else f"fed_shard_size={shard_size}"
    script = sys.argv[0] if sys.argv[0].endswith(".py") else "SCRIPT.py"
    raise ConfigError(
        f"{setting} needs several processes, but this is one (WORLD_SIZE=1): launch it with `accelerate launch "
        f"--num_processes {processes} {script} ...` or `torchrun --nproc_per_node {processes} {script} ...`, "
        "not plain `python`."
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


def fed_process_group(layout: FederationLayout, timeout_s: float) -> ProcessGroup:
    """The process group of this rank's peers in the other groups (same replica and shard position).

    A new group with its own timeout (every rank must call this, in the same order), so that an averaging whose
    peers stopped answering fails within ``timeout_s``: the mesh's own groups get PyTorch's 30-minute default.
    """
    group, _ = new_subgroups_by_enumeration(layout.fed_peer_ranks(), timeout=timedelta(seconds=timeout_s))
    return group


def averaging_world_group(timeout_s: float) -> ProcessGroup:
    """Every rank, with the averaging's timeout: the norms an averaging sums over all groups fail within it too.

    The world's default group has ``ddp_timeout``; an averaging's collectives must all end within ``timeout_s``.
    """
    return dist.new_group(timeout=timedelta(seconds=timeout_s))


def exchange_process_groups(
    layout: FederationLayout, timeout_s: float, with_replicas: bool
) -> tuple[ProcessGroup, ProcessGroup | None]:
    """(peers in the other groups, replicas in this group if ``with_replicas``) for the overlapped exchange's
    worker thread alone.

    Two threads must not issue collectives on one process group (their order could differ between ranks), and
    the main thread keeps using the inter-group group (divergence flags, metrics) and FSDP the replica one. Each
    new group is warmed up here (`_warm_up`).
    """
    timeout = timedelta(seconds=timeout_s)
    fed, _ = new_subgroups_by_enumeration(layout.fed_peer_ranks(), timeout=timeout)
    replicas = None
    if with_replicas:
        replicas, _ = new_subgroups_by_enumeration(layout.replica_peer_ranks(), timeout=timeout)
    for group in (fed, replicas):
        if group is not None:
            _warm_up(group)
    return fed, replicas


def _warm_up(group: ProcessGroup) -> None:
    """One tiny all-reduce on the main thread, so that NCCL creates the group's communicator now, not in the
    overlap worker while FSDP's kernels run."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh to give ``fully_shard`` in a plain loop: this rank's group, ``(dp_replicate, dp_shard)`` for FL+HSDP,
    ``dp_shard`` alone for FL+FSDP (as Accelerate does for `FedShardTrainer`)."""
    replicate, shard = MeshAxis.REPLICATE.value, MeshAxis.SHARD.value
    return mesh[replicate, shard] if mesh[replicate].size() > 1 else mesh[shard]


def replica_process_group(mesh: DeviceMesh) -> ProcessGroup:
    """The process group of the HSDP replicas of this rank's shard inside its group (fast tier): split exchange."""
    return mesh.get_group(MeshAxis.REPLICATE.value)


def group_process_group(mesh: DeviceMesh) -> ProcessGroup:
    """The process group of every rank of this rank's federation group (fast tier): checkpoints, flags."""
    return mesh.get_group(MeshAxis.DATA.value)


@functools.cache
def destroy_gloo_groups_at_exit() -> None:
    """Destroy the gloo process groups at interpreter exit, once registered (idempotent).

    Trainer scripts rarely call ``destroy_process_group``; a gloo process that leaves it to interpreter
    finalization can abort with "terminate called without an active exception" (pytorch/pytorch#190489).
    A rank leaving on an uncaught exception is left alone: destroying waits for its queued gloo work, which
    could keep a failed rank alive up to the group's timeout instead of letting the launcher see it fail.
    """
    atexit.register(_destroy_gloo_groups)


def _destroy_gloo_groups() -> None:
    failed = hasattr(sys, "last_value")  # set by the interpreter for an uncaught exception
    if not failed and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()
        gc.collect()  # free what still holds the groups (a DDP reducer, FSDP states) while Python is alive


def mesh_communicator(
    layout: FederationLayout,
    mesh: DeviceMesh,
    timeout_s: float | None,
    *,
    overlap: bool,
    split: bool,
    timeout: str | None = None,
) -> FederationCommunicator:
    """The engine's cross-group collectives for the groups of this job (every rank calls it, in the same order).

    New process groups with ``timeout_s`` (PyTorch's default when ``None``), so that an averaging whose peers stopped
    answering fails within it; with ``overlap`` the exchange gets a second set for the worker thread. ``timeout``
    names the limit in errors (default ``timeout_s=…``).
    """
    seconds = default_pg_timeout.total_seconds() if timeout_s is None else timeout_s
    if not layout.equal:
        return _unequal_communicator(layout, seconds, overlap, timeout or f"timeout_s={seconds:g}")
    peers = fed_process_group(layout, seconds)
    split = split and layout.replicas > 1
    exchange, replicas = None, replica_process_group(mesh) if split else None
    if overlap:
        exchange, replicas = exchange_process_groups(layout, seconds, split)
    return FederationCommunicator(
        peers=ProcessGroupCommunicator(peers),
        control=ProcessGroupCommunicator(averaging_world_group(seconds)),
        exchange=None if exchange is None else ProcessGroupCommunicator(exchange),
        split=None if replicas is None else ProcessGroupCommunicator(replicas),
        hsdp_replicas=layout.replicas,
        timeout=timeout or f"timeout_s={seconds:g}",
    )


def _unequal_communicator(
    layout: FederationLayout, seconds: float, overlap: bool, timeout: str
) -> FederationCommunicator:
    """Groups of unequal size: no peers; every exchange runs over the world (`hf_fedshard.engine.pieces`), the
    overlapped one over a world group of its own (the worker thread's)."""
    groups = layout.group_shapes()
    group = layout.group_index(dist.get_rank())
    exchange = None
    if overlap:
        exchange = averaging_world_group(seconds)
        _warm_up(exchange)
    return FederationCommunicator(
        peers=None,
        control=ProcessGroupCommunicator(averaging_world_group(seconds)),
        exchange=None if exchange is None else ProcessGroupCommunicator(exchange),
        hsdp_replicas=layout.replicas_of(group),
        timeout=timeout,
        groups=groups,
        this_group=group,
    )

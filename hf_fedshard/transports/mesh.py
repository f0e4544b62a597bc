"""The one-job transport (``fed_transport mesh``): every group is in one ``torch.distributed`` world, and
`mesh_communicator` gives the engine its cross-group collectives over process groups of that world, cut along the
federation's mesh (`hf_fedshard.topology`). Its factory is `one_job_federation`.
"""

from __future__ import annotations

import atexit
import functools
import gc
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, new_subgroups_by_enumeration
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _world

from hf_fedshard.engine.communicator import FederationCommunicator, ProcessGroupCommunicator
from hf_fedshard.topology import FederationLayout, MeshAxis
from hf_fedshard.transports.federation import FederationRequest


@dataclass(frozen=True)
class OneJobFederation:
    """The one-job transport's federation: every group is in this job, so there is nobody to wait for at the start,
    no group that can drop out, and nothing to leave at the end."""

    communicator: FederationCommunicator

    def join(self, averagings: int) -> None:
        """Nothing to meet: every group starts with this job."""

    def shutdown(self) -> None:
        """Nothing to leave: the job's process groups end with it (`destroy_gloo_groups_at_exit`)."""


def one_job_federation(request: FederationRequest) -> OneJobFederation:
    """``fed_transport mesh``'s factory (`hf_fedshard.transports.register_transport`): the collectives over this
    job's groups, on new process groups of the world (every rank calls it, in the same order)."""
    overlap, split = request.options.sync_overlap > 0, request.options.split_exchange
    communicator = mesh_communicator(
        request.layout, request.mesh, request.timeout_s, overlap=overlap, split=split, timeout=request.timeout
    )
    return OneJobFederation(communicator)


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
    """Destroy every process group, the last reference to each dropped from Python, never from C++ under the GIL.

    ``ProcessGroupGloo``'s destructor joins its worker threads, and a worker that just finished a collective may need
    the GIL to free the work's tensors (a tensor whose Python object died first is owned by C++ and decrefs it). A
    group freed by a C++ owner inside ``gc.collect`` (a DDP reducer) runs that destructor holding the GIL: the worker
    waits for the GIL, the destructor for the worker, and the rank never exits (tests/scripts/gloo_exit.py makes it
    happen every time). Python's own references are dropped through bindings that release the GIL first, so the
    groups are held here until everything else that holds them is collected.
    """
    failed = hasattr(sys, "last_value")  # set by the interpreter for an uncaught exception
    if failed or not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    groups = list(_world.pg_map)
    dist.destroy_process_group()
    gc.collect()  # free what still holds the groups (a DDP reducer, FSDP states) while Python is alive
    del groups  # the last references: each destructor runs with the GIL released


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

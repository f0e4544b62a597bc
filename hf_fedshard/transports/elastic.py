"""The torchft transport: every federation group is its own launch, and groups may die and join between averagings.

Each group runs under its own ``torchrun``/``accelerate launch`` (its own rendezvous, FSDP2/HSDP over its own
ranks). Across groups, a torchft `Manager` on every rank asks the Lighthouse (`hf_fedshard.lighthouse`) for the
quorum of the groups alive before each averaging, and reconfigures a gloo (or NCCL) process group over the ranks
at this rank's position in those groups: the engine's ``peers``. An averaging is a round (`Membership`):

- it runs over the groups of its quorum and commits only if every collective succeeded on every rank of the
  group (torchft's ``should_commit``); otherwise the group forms a new quorum with the groups still alive and
  averages again, its local progress kept;
- after a committed round the next quorum is formed at once, while every group holds the global model: a group
  that starts (or one whose round failed where the others' committed, or one that holds another global model) is
  off the lead and heals there from a live peer's state as of its last committed averaging
  (`hf_fedshard.engine.rounds.HealState`: the averager's part and the training loop's); the round applies it once
  the quorum formed.

Every new quorum is arranged by `hf_fedshard.transports.quorum_world.QuorumGroups`: the groups' first ranks agree on
who is in it (and refuse two launches of one id or settings that differ), every rank joins one process group over
the quorum's ranks, and a group behind heals over it (cut in parts, copied shard by shard onto its own: one heal
path for groups of any size; torchft's own heal, rank r from rank r, is off). The control all-reduce (every rank of
the federation) is an all-reduce inside the group, then across the quorum; equal groups average over torchft's
process group (rank r of every group), groups of unequal size (each launch given the list, ``--fed_group_size
4,2,2``) over the quorum's process group.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions

from hf_fedshard.engine.communicator import (
    Communicator,
    FederationCommunicator,
    GroupThenPeers,
    ProcessGroupCommunicator,
    Round,
)
from hf_fedshard.engine.heal import PeerParts, mended
from hf_fedshard.engine.rounds import NOT_READY, HealState, end_round, join, next_lineage
from hf_fedshard.errors import ConfigError
from hf_fedshard.topology import FederationLayout
from hf_fedshard.transports.federation import FederationRequest
from hf_fedshard.transports.launches import GroupLaunch
from hf_fedshard.transports.mesh import replica_process_group
from hf_fedshard.transports.quorum_world import QuorumGroups, quorum_process_group
from hf_fedshard.transports.torchft_internals import check_torchft_internals
from hf_fedshard.transports.torchft_internals import quorum_id as torchft_quorum_id

logger = logging.getLogger(__name__)


def _import_torchft() -> Any:
    try:
        import torchft
    except ImportError as err:
        raise ConfigError(
            "fed_transport torchft needs torchft: pip install -e '.[elastic]' in the clone (torchft-nightly)."
        ) from err
    for name in ("torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)  # one INFO line per averaging otherwise
    return torchft


class QuorumPeers:
    """A `Communicator` over the ranks at this rank's position in the groups of the current quorum.

    A failed collective is reported to the `Manager` (the round will not commit) and leaves zeros in its output, so
    nothing that follows in the round acts on garbage; the collectives after it are skipped.
    """

    def __init__(self, federation: ElasticFederation) -> None:
        self.federation = federation

    @property
    def manager(self) -> Any:
        return self.federation.manager

    @property
    def pg(self) -> Any:
        return self.federation.pg

    def size(self) -> int:
        """The groups at this position in the quorum: every one of them, a group that heals in it included (torchft
        counts as participants only the groups level with the lead, for its own heal, which is off here)."""
        rendezvous = self.pg.rendezvous
        return rendezvous.world_size if rendezvous is not None else 1  # none: torchft's group failed, nothing runs

    def rank(self) -> int:
        rendezvous = self.pg.rendezvous
        return rendezvous.rank if rendezvous is not None else 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        self._run(lambda: self.pg.allreduce([tensor], opts), tensor)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._run(lambda: self.pg.alltoall_base(output, input, [], [], AllToAllOptions()), output)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        parts = list(output.chunk(self.size()))
        self._run(lambda: self.pg.allgather([parts], [input], AllgatherOptions()), output)

    def _run(self, collective: Callable[[], Any], output: torch.Tensor) -> None:
        if self.manager.errored() is None:
            try:
                collective().wait()
                return
            except Exception as err:  # a peer died or timed out: this round is lost, the next quorum redoes it
                self.manager.report_error(err)
                # Close this rank's links now: a peer waiting on it (not on the dead one, in a ring) fails at once
                # instead of after fed_timeout_s. The next quorum builds new ones.
                self.pg.abort()
        output.zero_()


@dataclass(frozen=True)
class TorchftSettings(GroupLaunch):
    """``fed_transport torchft``'s settings: a launch per group (``fed_group_id`` of ``fed_num_groups``), meeting at
    a torchft Lighthouse (``fed_lighthouse``, ``http://HOST:PORT``)."""

    lighthouse: str

    example = (
        "--fed_lighthouse http://HOST:29510 --fed_group_id 0 --fed_num_groups 4 (python -m hf_fedshard.lighthouse "
        "prints the address)"
    )


def torchft_federation(request: FederationRequest) -> ElasticFederation:
    """``fed_transport torchft``'s factory (`hf_fedshard.transports.register_transport`): this launch's side, which
    reaches the lighthouse when it joins the first quorum (`ElasticFederation.join`)."""
    settings, launch = request.settings, request.launch
    split = request.options.split_exchange and launch.replicas > 1
    return ElasticFederation(
        lighthouse=settings.lighthouse, group_id=settings.group_id, num_groups=settings.num_groups,
        group=request.group, timeout_s=request.timeout_s, fingerprint=request.fingerprint, heal=request.heal,
        layout=request.layout, cut=request.cut, hsdp_replicas=launch.replicas, timeout=request.timeout,
        split=ProcessGroupCommunicator(replica_process_group(request.mesh)) if split else None,
    )  # fmt: skip


class ElasticFederation:
    """This rank's side of a federation whose groups are separate launches (``fed_transport torchft``).

    Construct it on every rank of a group once its launch's process group exists; the first quorum is formed by
    `join`, before training starts, so that a group joining a running federation can take a live peer's state
    (``receive``) as its starting point.

    Args:
        lighthouse: the Lighthouse's address, ``http://HOST:PORT`` (``fed_lighthouse``).
        group_id: this group's id, ``0 ≤ group_id < num_groups`` (``fed_group_id``).
        num_groups: the nominal number of groups (``fed_num_groups``).
        group: the launch's process group (this group's ranks).
        timeout_s: how long a collective, a quorum or a heal waits (``fed_timeout_s``).
        fingerprint: the settings every group must share (checked when groups meet).
        heal: the parts of this group's state a joining group is sent (each as of the last committed averaging)
            and where a heal's parts are put (`hf_fedshard.engine.rounds.HealState`); the training loop registers
            its parts there.
        layout: the nominal federation (every group's size and shard size): groups of unequal size average over
            every rank of the quorum (`QuorumGroups`).
        cut: ``heal``'s committed state in parts (`hf_fedshard.engine.heal`), whose tensors a healing group takes
            shard by shard.
        split: FL+HSDP's split exchange over the group's replicas (equal groups), or ``None``.
        hsdp_replicas: the group's replicas; ``timeout``: how the limit is named in errors.
    """

    def __init__(
        self,
        *,
        lighthouse: str,
        group_id: int,
        num_groups: int,
        group: ProcessGroup,
        timeout_s: float,
        fingerprint: str,
        heal: HealState,
        layout: FederationLayout,
        cut: Callable[[dict], PeerParts],
        split: Communicator | None = None,
        hsdp_replicas: int = 1,
        timeout: str = "",
    ) -> None:
        _import_torchft()  # refuse a missing torchft at construction, before training
        self.group_id, self.num_groups, self.group = group_id, num_groups, group
        self.fingerprint, self.heal, self.cut = fingerprint, heal, cut
        self.timeout_s, self.lighthouse = timeout_s, lighthouse
        self.heals = 0
        self.groups_averaged = 0  # groups in the last committed averaging
        self.averaged: list[list[int]] = []  # the groups of the last two committed averagings, the older first
        self.lineage = 0  # `hf_fedshard.engine.rounds.next_lineage` of this group's commits (I8)
        self.quorum_seconds = 0.0
        self.manager: Any = None
        self.pg: Any = None
        self._healed = False
        self._last_quorum: int | None = None
        self.peers = QuorumPeers(self)
        self.quorum = QuorumGroups(self, layout)
        self.communicator = self._communicator(split, hsdp_replicas, timeout or f"fed_timeout_s={timeout_s:g}")

    def _start(self) -> None:
        """Start torchft's side (its Manager heartbeats to the lighthouse from now on) right before the first
        quorum: a group that heartbeats long before it asks would hold the others' quorum up to --join_timeout_s."""
        refuse_silent_lighthouse(self.lighthouse)
        torchft, group, timeout = _import_torchft(), self.group, timedelta(seconds=self.timeout_s)
        check_torchft_internals()
        use_cuda = torch.cuda.is_available() and dist.get_backend(group) == "nccl"
        base = torchft.ProcessGroupNCCL if use_cuda else torchft.ProcessGroupGloo
        self.pg = quorum_process_group(base, timeout)
        self.quorum.pg = base(timeout=timeout)
        self.quorum.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else self.quorum.device
        self._store = _group_store(group)
        try:
            self.manager = torchft.Manager(
                pg=self.pg, load_state_dict=None, state_dict=None, min_replica_size=1,
                use_async_quorum=False, init_sync=False, timeout=timeout, quorum_timeout=timeout,
                connect_timeout=timeout, rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                store_addr=self._store.host, store_port=self._store.port, lighthouse_addr=self.lighthouse,
                replica_id=f"fed_group{self.group_id}", hostname=advertised_hostname(),
            )  # fmt: skip
        except Exception as err:  # rank 0 could not reach the lighthouse; the group's other ranks lose its store
            raise RuntimeError(
                f"hf_fedshard: fed_group{self.group_id} could not start torchft on rank {dist.get_rank(group)}: check "
                f"that the lighthouse ({self.lighthouse}) is up and reachable from the group's first rank (other "
                f"ranks: see rank 0's error). Cause: {str(err).splitlines()[0][:300]}"
            ) from err

    def _communicator(self, split: Communicator | None, hsdp_replicas: int, timeout: str) -> FederationCommunicator:
        """The engine's collectives over the quorum (FL+HSDP: ``split`` over the group's replicas; groups of unequal
        size: every rank of the quorum, whose pieces need no split)."""
        if not self.quorum.layout.equal:
            return FederationCommunicator(
                peers=None, control=self.quorum.world, hsdp_replicas=hsdp_replicas, timeout=timeout,
                membership=self, round_groups=self.quorum,
            )  # fmt: skip
        return FederationCommunicator(
            peers=self.peers, control=GroupThenPeers(self.group, self.peers), split=split,
            hsdp_replicas=hsdp_replicas, timeout=timeout, membership=self,
        )  # fmt: skip

    def join(self, averagings: int = 0) -> Round:
        """Form the first quorum (before training): a group behind the others heals there (into ``heal``); one that
        did not waits for every group, up to the timeout (`hf_fedshard.engine.rounds.join`, I7).

        ``averagings``: the averagings this group has committed (a checkpoint's count; 0 afresh).
        """
        self._start()
        self.manager.load_state_dict({"step": averagings, "batches_committed": 0})
        present = lambda: len(self.quorum.shapes())  # noqa: E731
        return join(self.next_round, present, self.num_groups, self.timeout_s, time.monotonic, time.sleep)

    # ---- Membership ----

    def commit(self) -> bool:
        committed = self.manager.should_commit()
        if committed:  # the quorum of this averaging, before the next one forms
            groups = self.quorum.groups()
            self.groups_averaged = len(groups)
            self.averaged = [*self.averaged[-1:], sorted(groups)]
            self.lineage = next_lineage(self.lineage, self.manager.current_step(), groups)
        return committed

    def next_round(self) -> Round:
        """The quorum of the groups alive for the next averaging; a heal if this group is behind."""
        self._healed = False
        begin = time.perf_counter()
        try:
            self.manager.start_quorum(allow_heal=False)  # QuorumGroups heals a group behind, of any size
        except ConfigError:
            raise
        except Exception as err:  # the lighthouse is unreachable, or no quorum formed within the timeout
            raise self._no_quorum(err) from err
        self.quorum_seconds = time.perf_counter() - begin
        if self.manager.errored() is not None:
            raise self._no_quorum(self.manager.errored())
        quorum_id = torchft_quorum_id(self.manager)
        changed = quorum_id != self._last_quorum
        self._last_quorum = quorum_id
        # a quorum of the same launches as the last one: its heals are done (a group whose heal failed has left)
        on_lead = self.quorum.configure() if changed else tuple(self.quorum.groups())
        behind = tuple(g for g in self.quorum.groups() if g not in on_lead)
        if self.manager.errored() is not None:
            return Round(healed=self._healed, changed=changed)
        return Round(healed=self._healed, changed=changed, on_lead=on_lead, behind=behind)

    def end(self, new_quorum: Callable[[Round], None], last: Round | None) -> list[int]:
        """END (`hf_fedshard.engine.rounds.end_round`), on the group's first rank's clock (its ranks stop alike)."""
        rank = dist.get_rank(self.group)

        def clock() -> float:  # a tensor, not a pickled object: a peer's bytes are never unpickled here
            now = torch.tensor([time.monotonic()], dtype=torch.float64, device=self.quorum.device)  # the group's
            dist.broadcast(now, src=dist.get_global_rank(self.group, 0), group=self.group)
            return now.item()

        name = f"fed_group{self.group_id}" if rank == 0 else ""
        return end_round(self, self.heal, new_quorum, last, self.num_groups, self.timeout_s, clock, time.sleep, name)

    def dropped_groups(self) -> list[int]:
        """The groups of the averaging before the last one that the last one ran without: they left, or reached it
        more than ``fed_timeout_s`` after this group (or it after them); logged as ``fed_groups_dropped``. After the
        final averaging, END (`hf_fedshard.engine.rounds.end_round`) waits for them and names those it never met."""
        return sorted(set(self.averaged[0]) - set(self.averaged[1])) if len(self.averaged) == 2 else []

    def metrics(self) -> dict[str, float]:
        return {
            "fed_groups_in_quorum": self.groups_averaged,
            "fed_groups_dropped": len(self.dropped_groups()),
            "fed_heals": self.heals,
            "fed_quorum_seconds": round(self.quorum_seconds, 6),
        }

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)

    # ---- Heals and checks ----

    def _no_quorum(self, cause: object) -> RuntimeError:
        return RuntimeError(
            f"hf_fedshard: fed_group{self.group_id} got no quorum of the federation within fed_timeout_s="
            f"{self.timeout_s:g}: check that the lighthouse ({self.lighthouse}) is up and reachable, and that at "
            f"least its --min_groups groups are running. Cause: {str(cause).splitlines()[0][:300]}"
        )

    def provide_parts(self) -> PeerParts:
        """This group's committed state (`HealState.committed`) in parts, for a group that heals from it
        (`QuorumGroups.heal`)."""
        committed = self.heal.committed()
        return PeerParts(committed, [], []) if committed.get(NOT_READY) else self.cut(committed)

    def take_parts(self, parts: PeerParts, averagings: int, lineage: int) -> None:
        """A heal arrived on every rank of this group (`QuorumGroups.heal`): take it, and count the averagings the
        state holds as committed here too (torchft's own heal would set them; it is off)."""
        self._healed, self.lineage = True, lineage
        self.heal.receive(mended(parts))
        self.manager.load_state_dict({"step": averagings, "batches_committed": self.manager.batches_committed()})


class _Store:
    """This group's own TCPStore for torchft (hosted by the group's rank 0), fresh for every launch."""

    def __init__(self, store: dist.TCPStore, host: str) -> None:
        self.store, self.host, self.port = store, host, store.port


def _group_store(group: ProcessGroup) -> _Store:
    """A TCPStore of this launch on its rank 0, its address shared over ``group`` (a restart gets a fresh one)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    address = [None]
    store = None
    if rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, world, is_master=True, wait_for_workers=False)
        address = [(advertised_hostname(), store.port)]
    dist.broadcast_object_list(address, src=dist.get_global_rank(group, 0), group=group)
    host, port = address[0]
    if store is None:
        store = dist.TCPStore(host, port, world, is_master=False, wait_for_workers=False)
    return _Store(store, host)


def advertised_hostname() -> str:
    """The name other hosts reach this one by: ``$HF_FEDSHARD_HOSTNAME``, else the host name (set it where the host
    name resolves to a loopback address, as in many ``/etc/hosts``)."""
    return os.environ.get("HF_FEDSHARD_HOSTNAME") or socket.gethostname()


def refuse_silent_lighthouse(address: str, within_s: float = 2.0) -> None:
    """Refuse, in one line and within ``within_s``, a lighthouse address where nothing listens (torchft would retry
    for the whole timeout, then raise a chained traceback). Every rank checks alike, before any collective."""
    url = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((url.hostname or "localhost", url.port or 80), timeout=within_s):
            return
    except OSError as err:
        reason = err.strerror or type(err).__name__
    raise ConfigError(
        f"hf_fedshard: fed_lighthouse={address}: nothing answers there within {within_s:g} s ({reason}). Start it "
        f"(python -m hf_fedshard.lighthouse --port {url.port or 29510}) or fix --fed_lighthouse."
    )

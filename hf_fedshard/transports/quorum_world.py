"""The quorum's groups under ``fed_transport torchft``: who is in it, one process group over all its ranks, and the
heal of a group behind (one path for groups of any size).

torchft's `Manager` connects rank r of every group of the quorum (its process group, reconfigured per quorum): equal
groups average over it. After each new quorum, for groups of any size:

1. the groups' first ranks, which torchft's process group always connects (every group has a rank 0), sum one
   small table: which groups are in the quorum, in which order, at which averaging count and lineage
   (`hf_fedshard.engine.rounds` I8), with which settings (where they differ, the first ranks also gather the
   settings texts, so that the refusal names what differs); each first rank hands it to its group's other ranks
   (the fast tier); two launches of one group id, or settings that differ, are refused in one line on every rank;
2. every rank joins one gloo (or NCCL) process group over the quorum's ranks, numbered group by group in quorum
   order (world size = Σ sizes), through the store of the quorum's rendezvous under a key of its own;
3. a group off the lead (a restart, a late start, a round it lost, a round redone apart) heals over that group from
   the first group on the lead (`QuorumGroups.heal`, `hf_fedshard.engine.heal`): what every layout shares from its
   first rank, the tensors copied byte for byte from its shards onto the healing group's own. Groups of one size
   pair shard for shard; the copy is the same code.

With ``--fed_group_size 4,2,2`` (each launch names every group's size) the averaging itself runs over that process
group too: it addresses every tensor in its whole index space (`hf_fedshard.engine.pieces`), and carries the control
all-reduce; a failed collective is reported to the `Manager` (the round does not commit) and the rest of the round
is skipped, as on the equal groups' path.

torchft's Manager keeps its own process group: it serves the first ranks' table, and its ranks with no peer in a
smaller group rendezvous with the groups that have one (`quorum_process_group`). Its own heal (a live peer's state,
rank r from rank r) is off: step 3 replaces it for every layout.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hf_fedshard.engine.heal import PeerParts, receiving
from hf_fedshard.engine.pieces import GroupShape, PieceExchange
from hf_fedshard.engine.rounds import lead
from hf_fedshard.topology import FederationLayout
from hf_fedshard.transports.members import (
    differing_settings,
    gather_fingerprints,
    refuse_bad_members,
    settings_code,
    settings_differ,
)
from hf_fedshard.transports.torchft_internals import recording_process_group

if TYPE_CHECKING:
    from hf_fedshard.transports.elastic import ElasticFederation

_COLUMNS = 4  # per nominal group: present, position in the quorum, averagings committed, lineage (I8)


def quorum_process_group(base: type, timeout: timedelta) -> Any:
    """The Manager's process group: torchft's ``base`` (its gloo or NCCL group), which also rendezvouses where a
    group of the quorum has no rank at this rank's position, and records its rendezvous for `QuorumGroups`."""
    return recording_process_group(base, timeout)


class QuorumWorld:
    """A `Communicator` over every rank of every group in the quorum (`QuorumGroups`'s process group); a failed
    collective is reported to the Manager and leaves zeros, as `QuorumPeers` does."""

    def __init__(self, quorum: QuorumGroups) -> None:
        self.quorum = quorum

    def size(self) -> int:
        return self.quorum.world_size

    def rank(self) -> int:
        return self.quorum.world_rank

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._run(lambda pg: pg.allreduce([tensor], opts), tensor)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._run(lambda pg: pg.alltoall_base(output, input, [], [], dist.AllToAllOptions()), output)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        parts = list(output.chunk(self.size()))
        self._run(lambda pg: pg.allgather([parts], [input], dist.AllgatherOptions()), output)

    def all_to_all_v(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> None:
        opts = dist.AllToAllOptions()
        self._run(lambda pg: pg.alltoall_base(output, input, output_splits, input_splits, opts), output)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``obj`` of rank ``root`` (pickled), on every rank; ``None`` where a broadcast failed (reported)."""
        device, manager = self.quorum.device, self.quorum.federation.manager
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.rank() == root else None
        size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
        self._broadcast(size, root)
        empty = data is None
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device) if empty else data.to(device)
        self._broadcast(buffer, root)
        return None if manager.errored() is not None else pickle.loads(buffer.cpu().numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._run(lambda pg: pg.broadcast([tensor], opts), tensor)

    def _run(self, collective: Callable[[Any], Any], output: torch.Tensor) -> None:
        manager, pg = self.quorum.federation.manager, self.quorum.pg
        if manager.errored() is None:
            try:
                collective(pg).wait()
                return
            except Exception as err:  # a peer died or timed out: this round is lost, the next quorum redoes it
                manager.report_error(err)
                pg.abort()  # a peer waiting on this rank fails at once; the next quorum builds a new group
        output.zero_()


class QuorumGroups:
    """The groups of the current quorum (for groups of unequal size, the engine's
    `hf_fedshard.engine.communicator.RoundGroups`) and the process group over their ranks (``world``).

    Args:
        federation: this launch's torchft side (its Manager, its group's process group, its id and fingerprint).
        layout: the nominal federation (e.g. ``fed_group_size 4,2,2``): every group's size and shard size.
    """

    def __init__(self, federation: ElasticFederation, layout: FederationLayout) -> None:
        self.federation, self.layout = federation, layout
        me = federation.group_id
        self._shapes = (GroupShape(tuple(range(layout.size_of(me))), layout.shard_of(me)),)  # until a quorum
        self._groups, self._index = (me,), 0  # the quorum's nominal group ids, and this group's index among them
        self.device = torch.device("cpu")  # where the world's collectives run (the GPU under NCCL)
        self.world_rank, self.world_size = dist.get_rank(federation.group), layout.size_of(me)
        self.pg: Any = None  # torchft's gloo/NCCL group, given by the federation when it starts torchft
        self.world = QuorumWorld(self)

    def shapes(self) -> tuple[GroupShape, ...]:
        return self._shapes

    def index(self) -> int:
        return self._index

    def groups(self) -> list[int]:
        """The nominal ids of the quorum's groups."""
        return list(self._groups)

    def configure(self) -> tuple[int, ...]:
        """After a new quorum: learn its groups (the first ranks' table), check them, join the process group over
        their ranks, and heal the groups behind the others (`heal`); the groups on the lead before the heal. A
        failure is reported to the Manager (this round does not commit); two launches of one group, or settings
        that differ, are refused in one line."""
        from torchft.process_group import reconfigure_with_store

        federation = self.federation
        table, store, differences = self._exchange_table()
        if table is None:
            federation.manager.report_error(RuntimeError("the quorum's table of groups was not exchanged"))
            return ()
        order, steps, lineages = self._check(table, differences)
        self.arrange(order)
        try:  # alone in the quorum too: the control all-reduce and the HSDP replicas' pieces run over its ranks
            reconfigure_with_store(
                self.pg, f"{store}/hf_fedshard_world", self.world_rank, self.world_size,
                timedelta(seconds=federation.timeout_s),
            )  # fmt: skip
        except Exception as err:  # a group of the quorum left before joining: this round fails, the next redoes it
            federation.manager.report_error(err)
        target = lead([(g, int(steps[g]), int(lineages[g])) for g in order])  # I8: a count and one global model
        behind = [i for i, g in enumerate(order) if (int(steps[g]), int(lineages[g])) != target]
        if behind:
            source = next(i for i, g in enumerate(order) if (int(steps[g]), int(lineages[g])) == target)
            self.heal(behind, source, *target)
        return tuple(g for i, g in enumerate(order) if i not in behind)

    def arrange(self, order: list[int]) -> None:
        """Number the ranks of the quorum's groups (nominal ids, in quorum ``order``) group by group: each group's
        shape, this group's index and this rank's place in the world over them."""
        federation, offsets = self.federation, [0]
        for g in order:
            offsets.append(offsets[-1] + self.layout.size_of(g))
        self._shapes = tuple(
            GroupShape(tuple(range(offsets[i], offsets[i + 1])), self.layout.shard_of(g)) for i, g in enumerate(order)
        )
        self._groups, self._index = tuple(order), order.index(federation.group_id)
        self.world_rank = offsets[self._index] + dist.get_rank(federation.group)
        self.world_size = offsets[-1]

    def _exchange_table(self) -> tuple[torch.Tensor | None, str | None, str | None]:
        """The quorum's table (summed by the groups' first ranks over the Manager's process group), the address
        of the quorum's store and, where settings differ, which (`differing_settings`), handed to this group's other
        ranks; ``None`` if the sum failed."""
        federation = self.federation
        group = federation.group
        message: list[Any] = [None, None, None]
        if dist.get_rank(group) == 0:
            message = self._first_ranks_table()
        dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
        return message[0], message[1], message[2]

    def _first_ranks_table(self) -> list[Any]:
        """This group's row of the table, summed over the quorum's first ranks (rank 0 of each group)."""
        federation = self.federation
        rendezvous = federation.pg.rendezvous
        if federation.manager.errored() is not None or rendezvous is None:  # torchft's own group failed to form
            return [None, None, None]
        n = self.layout.num_groups
        table = torch.zeros(n * _COLUMNS + 2, dtype=torch.float64)
        g = federation.group_id
        table[g], table[n + g], table[2 * n + g] = 1.0, rendezvous.rank, federation.manager.current_step()
        table[3 * n + g] = federation.lineage
        code = settings_code(federation.fingerprint)
        table[-2], table[-1] = code, code * code
        federation.peers.all_reduce_sum(table)
        present = int((table[:n] > 0).sum().item())
        differences = None
        if settings_differ(present, table[-2].item(), table[-1].item()):  # every first rank gathers them
            texts = gather_fingerprints(federation.peers, g, federation.fingerprint)
            differences = differing_settings(texts)
        if federation.manager.errored() is not None:
            return [None, None, None]
        return [table, rendezvous.store_addr, differences]

    def _check(self, table: torch.Tensor, differences: str | None) -> tuple[list[int], list[float], list[float]]:
        """The groups of the quorum in quorum order and each nominal group's averaging count and lineage, once the
        table shows distinct ids and one setting (every rank of every group reads the same table and
        ``differences``, so every rank refuses alike)."""
        n, federation = self.layout.num_groups, self.federation
        counts, positions, steps = table[:n].tolist(), table[n : 2 * n].tolist(), table[2 * n : 3 * n].tolist()
        lineages = table[3 * n : 4 * n].tolist()
        present = [g for g in range(n) if counts[g] > 0]
        refuse_bad_members(counts[federation.group_id], federation.group_id, n, len(present), table[-2].item(),
                           table[-1].item(), "model, fed_* settings, group sizes or batch",
                           (lambda: differences) if differences else None)  # fmt: skip
        return sorted(present, key=lambda g: positions[g]), steps, lineages

    def heal(self, behind: list[int], source: int, averagings: int, lineage: int) -> None:
        """Copy group ``source``'s state (indices in the quorum; it holds the global model of ``averagings``
        averagings) onto the groups ``behind``: what every layout shares from its first rank, the tensors shard by
        shard (`hf_fedshard.engine.heal`). The other groups only take part in the collectives. A failure is
        reported to the Manager (this round does not commit) and, in a group behind, raised on each of its ranks."""
        federation, me = self.federation, self._index
        parts = federation.provide_parts() if me == source else None
        root = self._shapes[source].ranks[0]
        header = self.world.broadcast_object(
            (parts.state, parts.specs) if parts is not None and self.world_rank == root else None, root
        )
        flats = parts.tensors if parts is not None else None
        if header is not None and me in behind:
            flats = receiving(header[1], self._shapes[me], self._shard(), self.device)
        if header is not None and header[1]:
            exchange = PieceExchange(self.world, self._shapes, me)
            exchange.copy(flats, [spec.address for spec in header[1]], source, behind, self.device)
        failed = header is None or federation.manager.errored() is not None
        if me in behind:
            self._take(failed, header, flats, averagings, lineage, source)
        if not failed:
            federation.heals += len(behind)

    def _take(
        self, failed: bool, header: Any, flats: list[torch.Tensor], averagings: int, lineage: int, source: int
    ) -> None:
        """On a group behind: agree over its ranks whether the heal arrived everywhere, then take it (or raise on
        every rank: a group with half its ranks healed would average shards of two models)."""
        federation = self.federation
        flag = torch.tensor([float(failed)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=federation.group)
        if flag.item() > 0:
            cause = federation.manager.errored()
            raise RuntimeError(
                f"hf_fedshard: fed_group{federation.group_id} could not heal from fed_group"
                f"{self._groups[source]} (a group left or a link broke during the copy; fed_timeout_s="
                f"{federation.timeout_s:g}): restart it (torchrun --max-restarts) to heal again. Cause: "
                f"{str(cause).splitlines()[0][:300] if cause is not None else 'on another rank of this group'}"
            )
        state, specs = header
        held = [t.cpu() for t in flats]  # until the Trainer loads them: a joining rank's GPU holds its model only
        federation.take_parts(PeerParts(state, specs, held), averagings, lineage)

    def _shard(self) -> int:
        """This rank's shard in its group (its ranks are replica-major, as `GroupShape` numbers them)."""
        return dist.get_rank(self.federation.group) % self._shapes[self._index].shard_size

"""Groups of unequal size under ``fed_transport torchft``: one process group over every rank of the quorum.

torchft's `Manager` connects rank r of every group of the quorum (its process group, reconfigured per quorum), which
pairs groups of equal size only. With ``--fed_group_size 4,2,2`` (each launch names every group's size) the
averaging addresses every tensor in its whole index space instead (`hf_fedshard.engine.pieces`), over every rank
of every group in the quorum. After each new quorum:

1. the groups' first ranks, which torchft's process group always connects (every group has a rank 0), sum one
   small table: which groups are in the quorum, in which order, at which averaging count, with which settings;
   each first rank hands it to its group's other ranks (the fast tier);
2. every rank joins one gloo (or NCCL) process group over the quorum's ranks, numbered group by group in quorum
   order (world size = Σ sizes), through the store of the quorum's rendezvous under a key of its own;
3. that group carries the pieces of each averaging and its control all-reduce; a failed collective is reported to
   the `Manager` (the round does not commit) and the rest of the round is skipped, as on the equal groups' path.

torchft's Manager keeps its own process group: it serves the first ranks' table, and its ranks with no peer in a
smaller group rendezvous with the groups that have one (`quorum_process_group`). Its heal (a live peer's state,
rank r from rank r) cannot pair shards of groups of different sizes, so it is off here: a group behind the
others is refused in one line (`UnequalQuorum.configure`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hf_fedshard.engine.pieces import GroupShape
from hf_fedshard.errors import ConfigError
from hf_fedshard.transports.mesh import FederationLayout

if TYPE_CHECKING:
    from hf_fedshard.transports.elastic import ElasticFederation

_COLUMNS = 3  # per nominal group: present, position in the quorum, averagings committed


def quorum_process_group(base: type, timeout: timedelta) -> Any:
    """The Manager's process group: torchft's ``base`` (its gloo or NCCL group), which also rendezvouses where a
    group of the quorum has no rank at this rank's position (torchft hands such ranks an empty handle), and
    records its rendezvous (the quorum's store and this rank's place in it) for `UnequalQuorum`."""
    from torchft.process_group import _rendezvous

    class QuorumProcessGroup(base):
        rendezvous: Any = None

        def reconfigure(self, opts: Any) -> Any:
            opts.handles = [handle for handle in opts.handles if handle]  # groups smaller than this position
            self.rendezvous = _rendezvous(opts, self._handle_id())
            return super().reconfigure(opts)

    return QuorumProcessGroup(timeout=timeout)


class QuorumWorld:
    """A `Communicator` over every rank of every group in the quorum (`UnequalQuorum`'s process group); a failed
    collective is reported to the Manager and leaves zeros, as `QuorumPeers` does."""

    def __init__(self, quorum: UnequalQuorum) -> None:
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


class UnequalQuorum:
    """The groups of unequal size in the current quorum (`hf_fedshard.engine.communicator.RoundGroups`) and the
    process group over their ranks (``world``).

    Args:
        federation: this launch's torchft side (its Manager, its group's process group, its id and fingerprint).
        layout: the nominal federation (``fed_group_size 4,2,2``): every group's size and shard size.
    """

    def __init__(self, federation: ElasticFederation, layout: FederationLayout) -> None:
        self.federation, self.layout = federation, layout
        me = federation.group_id
        self._shapes = (GroupShape(tuple(range(layout.size_of(me))), layout.shard_of(me)),)  # until a quorum
        self._index = 0
        self.world_rank, self.world_size = dist.get_rank(federation.group), layout.size_of(me)
        self.pg: Any = None  # torchft's gloo/NCCL group, given by the federation when it starts torchft
        self.world = QuorumWorld(self)

    def shapes(self) -> tuple[GroupShape, ...]:
        return self._shapes

    def index(self) -> int:
        return self._index

    def configure(self) -> None:
        """After a new quorum: learn its groups (the first ranks' table), check them, and join the process group
        over their ranks. A failure is reported to the Manager (this round does not commit); a group behind the
        others, or settings that differ, are refused in one line."""
        from torchft.process_group import reconfigure_with_store

        federation = self.federation
        table, store = self._exchange_table()
        if table is None:
            federation.manager.report_error(RuntimeError("the quorum's table of groups was not exchanged"))
            return
        order = self._check(table)
        offsets = [0]
        for g in order:
            offsets.append(offsets[-1] + self.layout.size_of(g))
        self._shapes = tuple(
            GroupShape(tuple(range(offsets[i], offsets[i + 1])), self.layout.shard_of(g)) for i, g in enumerate(order)
        )
        self._index = order.index(federation.group_id)
        self.world_rank = offsets[self._index] + dist.get_rank(federation.group)
        self.world_size = offsets[-1]
        try:  # alone in the quorum too: the control all-reduce and the HSDP replicas' pieces run over its ranks
            reconfigure_with_store(
                self.pg, f"{store}/hf_fedshard_world", self.world_rank, self.world_size,
                timedelta(seconds=federation.timeout_s),
            )  # fmt: skip
        except Exception as err:  # a group of the quorum left before joining: this round fails, the next redoes it
            federation.manager.report_error(err)

    def _exchange_table(self) -> tuple[torch.Tensor | None, str | None]:
        """The quorum's table (summed by the groups' first ranks over the Manager's process group), and the address
        of the quorum's store, handed to this group's other ranks; ``None`` if the sum failed."""
        federation = self.federation
        group = federation.group
        message: list[Any] = [None, None]
        if dist.get_rank(group) == 0:
            message = self._first_ranks_table()
        dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
        return message[0], message[1]

    def _first_ranks_table(self) -> list[Any]:
        """This group's row of the table, summed over the quorum's first ranks (rank 0 of each group)."""
        federation = self.federation
        rendezvous = federation.pg.rendezvous
        if federation.manager.errored() is not None or rendezvous is None:  # torchft's own group failed to form
            return [None, None]
        n = self.layout.num_groups
        table = torch.zeros(n * _COLUMNS + 2, dtype=torch.float64)
        g = federation.group_id
        table[g], table[n + g], table[2 * n + g] = 1.0, rendezvous.rank, federation.manager.current_step()
        code = _code(federation.fingerprint)
        table[-2], table[-1] = code, code * code
        federation.peers.all_reduce_sum(table)
        if federation.manager.errored() is not None:
            return [None, None]
        return [table, rendezvous.store_addr]

    def _check(self, table: torch.Tensor) -> list[int]:
        """The groups of the quorum in quorum order, once the table shows distinct ids, one setting and no group
        behind the others (every rank of every group reads the same table, so every rank refuses alike)."""
        n, federation = self.layout.num_groups, self.federation
        counts, positions, steps = table[:n].tolist(), table[n : 2 * n].tolist(), table[2 * n : 3 * n].tolist()
        present = [g for g in range(n) if counts[g] > 0]
        latest = max(steps[g] for g in present)
        if counts[federation.group_id] > 1:
            raise ConfigError(
                f"hf_fedshard: two launches claim fed_group_id={federation.group_id}. Give every group its own "
                f"--fed_group_id in 0..{n - 1}."
            )
        if len(present) * table[-1].item() != table[-2].item() ** 2:  # every code equal (Cauchy-Schwarz)
            raise ConfigError(
                "hf_fedshard: the groups of the federation were started with different settings (model, fed_* "
                "settings, fed_group_size list or batch). Start every group with the same ones."
            )
        behind = latest - steps[federation.group_id]
        if behind > 0:
            raise ConfigError(
                f"hf_fedshard: fed_group{federation.group_id} is {behind:g} averaging(s) behind the live groups, and "
                "with groups of unequal size (fed_group_size list) a group cannot heal from a live one (their shards "
                "differ): restart every group from its newest checkpoint (fed_auto_resume), or give them one size."
            )
        return sorted((g for g in present if steps[g] == latest), key=lambda g: positions[g])  # the behind leave


def _code(text: str) -> float:
    """A 20-bit code of ``text`` (its square and sums stay exact in float64)."""
    return float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % (1 << 20))

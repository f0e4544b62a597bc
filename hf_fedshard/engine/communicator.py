"""The seam between the engine and a transport: every collective that crosses federation groups goes through here.

The engine never calls ``torch.distributed`` itself. A transport (``hf_fedshard.transports``) gives it one
`FederationCommunicator`, a bundle of `Communicator` s over the sets of ranks an averaging talks to:

- ``peers``: this rank and the ranks at the same (replica, shard) position in every other group: they hold shards
  of the same shapes. ``peers.rank()`` is this rank's group, ``peers.size()`` the number of groups. The plain means
  (buffers, the temporary global model) run over it.
- ``control``: every rank of the federation, for the one small all-reduce per averaging that carries the
  divergence flags and the previous averaging's norms (`hf_fedshard.engine.control`).
- ``exchange``: the peers the exchange of Δ runs over: ``peers`` itself, or (with overlap) a second set of the same
  ranks that the worker thread alone uses, since two threads must not share a process group.
- ``split``: the group's HSDP replicas that the exchange splits its payload over (FL+HSDP), or ``None``.
- ``groups``: with groups of unequal size (``fed_group_size 4,2,2``) no rank of one group holds what a rank of
  another holds, so there are no ``peers``: every exchange and plain mean addresses the whole tensors over
  ``control`` (or the worker's ``exchange``, every rank too), `hf_fedshard.engine.pieces`.
  Where the groups of unequal size change between rounds (torchft: each group its own launch), ``round_groups``
  gives the current round's instead.
- ``membership``: ``None`` where the set of groups is fixed for the job (one job, `hf_fedshard.transports.mesh`);
  a `Membership` where groups may leave and join between averagings (`hf_fedshard.transports.elastic`): there
  ``peers.size()`` and ``peers.rank()`` follow the quorum of the groups alive, and every averaging commits or
  is redone over the next quorum.

Tests run the whole engine in one process with a fake `Communicator` per rank (threads meeting at barriers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch.distributed import ProcessGroup, ReduceOp, all_gather_single, all_reduce, all_to_all_single

if TYPE_CHECKING:
    from hf_fedshard.engine.pieces import GroupShape
    from hf_fedshard.engine.rounds import HealState


class Communicator(Protocol):
    """The collectives the engine needs, over one set of ranks."""

    def size(self) -> int: ...

    def rank(self) -> int: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> None: ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None: ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None: ...

    def all_to_all_v(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> None:
        """``input_splits[r]`` elements of ``input`` to rank r; ``output_splits[r]`` from rank r into ``output``."""
        ...


class ProcessGroupCommunicator:
    """A `Communicator` over a torch.distributed process group (gloo or NCCL)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def size(self) -> int:
        return torch.distributed.get_world_size(self.group)

    def rank(self) -> int:
        return torch.distributed.get_rank(self.group)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        all_reduce(tensor, op=ReduceOp.SUM, group=self.group)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        all_to_all_single(output, input, group=self.group)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        all_gather_single(output, input, group=self.group)

    def all_to_all_v(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> None:
        all_to_all_single(output, input, output_splits, input_splits, group=self.group)


class GroupThenPeers:
    """A `Communicator` over every rank of a federation whose groups are separate launches (a control all-reduce):
    the sum inside this rank's group, then across its ``peers`` (one rank per group). For transports that meet
    groups at one shard position at a time (torchft's, or one written outside the package)."""

    def __init__(self, group: ProcessGroup, peers: Communicator) -> None:
        self.group, self.peers = ProcessGroupCommunicator(group), peers

    def size(self) -> int:
        return self.group.size() * self.peers.size()

    def rank(self) -> int:
        return self.peers.rank() * self.group.size() + self.group.rank()

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self.group.all_reduce_sum(tensor)
        self.peers.all_reduce_sum(tensor)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        raise NotImplementedError("the control collective is an all-reduce")

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        raise NotImplementedError("the control collective is an all-reduce")


class Membership(Protocol):
    """A transport whose set of groups may change between averagings.

    An averaging is a *round* (`hf_fedshard.engine.rounds`: its states and invariants): its collectives run over
    the quorum formed before it, then `commit` says whether every one of them succeeded on every rank of the
    quorum. Only a committed round changes any state; after it (or after a failed one) `next_round` forms the
    quorum of the groups alive for the next. A group that is behind (it failed a round the others committed, or it
    has just started) is handed a live peer's committed state there (into ``heal``), which the round applies.
    """

    heal: HealState  # the parts a joining group is sent (`hf_fedshard.engine.rounds`)

    def commit(self) -> bool: ...

    def next_round(self) -> Round: ...

    def metrics(self) -> dict[str, float]: ...

    def end(self, new_quorum: Callable[[Round], None], last: Round | None) -> list[int]:
        """The END of training (`hf_fedshard.engine.rounds.end_round`, I10) with this transport's clock: the nominal
        groups never met on this group's final model."""
        ...


class RoundGroups(Protocol):
    """Groups of unequal size whose set changes between rounds (``fed_transport torchft``): the current round's,
    numbered as in ``control``, and this rank's group among them."""

    def shapes(self) -> tuple[GroupShape, ...]: ...

    def index(self) -> int: ...


@dataclass(frozen=True)
class Round:
    """What `Membership.next_round` did: ``healed``: this group took a peer's state; ``changed``: the quorum is
    not the previous round's (groups left or joined); ``on_lead``: the nominal ids of the quorum's groups that held
    its lead when it formed (``()``: unknown, e.g. its table failed); ``behind``: those that heal there."""

    healed: bool = False
    changed: bool = False
    on_lead: tuple[int, ...] = ()
    behind: tuple[int, ...] = ()


@dataclass(frozen=True)
class FederationCommunicator:
    """What a transport hands the engine (see the module docstring for each set of ranks).

    Args:
        peers: this rank's peers in every group (``rank()`` = this group's index); ``None`` with ``groups``.
        control: every rank of the federation.
        exchange: the exchange's peers (the overlap worker's own; with ``groups`` every rank); ``None``: ``peers``
            (with ``groups``: ``control``).
        split: the HSDP replicas to split the exchange over; ``None``: no split.
        hsdp_replicas: ranks of one group holding the same shard (1 for FL+FSDP), to turn shard norms into model
            norms.
        timeout: how the limit on a cross-group collective is named in errors, e.g. ``"fed_timeout_s=30"``.
        membership: the rounds of a transport whose groups may change (`Membership`); ``None``: a fixed set.
        groups: groups of unequal size, their ranks numbered as in ``control``; ``None``: equal groups.
        this_group: this rank's index in ``groups``.
        round_groups: groups of unequal size that change between rounds (instead of ``groups``/``this_group``).
        background_exchange: whether an overlapped exchange may run on a worker thread (``False``: a transport
            whose collectives need the loop's thread, as the simulator's do; it then runs when the averaging begins).
    """

    peers: Communicator | None
    control: Communicator
    exchange: Communicator | None = None
    split: Communicator | None = None
    hsdp_replicas: int = 1
    timeout: str = "the process groups' timeout"
    membership: Membership | None = None
    groups: tuple[GroupShape, ...] | None = None
    this_group: int = 0
    round_groups: RoundGroups | None = None
    background_exchange: bool = True

    @property
    def shapes(self) -> tuple[GroupShape, ...] | None:
        """The groups of unequal size of this round (``None``: equal groups, exchanged over ``peers``)."""
        return self.round_groups.shapes() if self.round_groups is not None else self.groups

    @property
    def num_groups(self) -> int:
        shapes = self.shapes
        return self.peers.size() if shapes is None else len(shapes)

    @property
    def group(self) -> int:
        """This rank's federation group."""
        if self.round_groups is not None:
            return self.round_groups.index()
        return self.peers.rank() if self.groups is None else self.this_group

    @property
    def exchange_peers(self) -> Communicator:
        if self.exchange is not None:
            return self.exchange
        return self.peers if self.shapes is None else self.control

    @property
    def group_weights(self) -> list[int]:
        """Each group's weight in a mean: its ranks with unequal groups (the samples it reads), else 1."""
        shapes = self.shapes
        return [1] * self.num_groups if shapes is None else [g.weight for g in shapes]

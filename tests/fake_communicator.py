"""An in-process `Communicator`: each rank is a thread, a collective meets at a barrier (no process group)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from hf_fedshard.engine import FederationCommunicator
from hf_fedshard.engine.pieces import GroupShape

BARRIER_TIMEOUT_S = 30  # a rank that failed leaves the others waiting: they fail after this instead of hanging


class FakeCommunicator:
    """One rank of an in-process group of ``size`` ranks sharing the ``shared`` dict."""

    def __init__(self, shared: dict, rank: int, size: int) -> None:
        self.shared, self._rank, self._size = shared, rank, size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def _meet(self, tensor: object) -> list:
        """Every rank's tensor (or tuple), in rank order (two barriers: post, read, then free the slot)."""
        self.shared[self._rank] = tensor.clone() if isinstance(tensor, torch.Tensor) else tensor
        self.shared["barrier"].wait()
        everyone = [self.shared[r] for r in range(self._size)]
        self.shared["barrier"].wait()
        return everyone

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """The sum in ``tensor``'s dtype, in rank order, as a backend does: a too narrow dtype is not hidden."""
        everyone = self._meet(tensor)
        total = everyone[0].clone()
        for other in everyone[1:]:
            total += other
        tensor.copy_(total)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        everyone = self._meet(input)
        output.copy_(torch.cat([t.chunk(self._size)[self._rank] for t in everyone]))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(torch.cat(self._meet(input)))

    def all_to_all_v(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> None:
        everyone = self._meet((input.clone(), list(input_splits)))
        parts = [t.split(splits)[self._rank] for t, splits in everyone]
        if [p.numel() for p in parts] != list(output_splits):
            raise RuntimeError(f"rank {self._rank} expected {output_splits}, got {[p.numel() for p in parts]}")
        output.copy_(torch.cat(parts))


def run_ranks(size: int, fn: Callable[[FakeCommunicator], object]) -> list:
    """``fn(comm)`` on ``size`` threads sharing one fake group; the results in rank order."""
    shared: dict = {"barrier": threading.Barrier(size, timeout=BARRIER_TIMEOUT_S)}
    results: list = [None] * size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(FakeCommunicator(shared, rank, size))
        except BaseException as err:  # re-raised in the main thread
            errors.append(err)
            shared["barrier"].abort()

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def run_split(groups: int, replicas: int, fn: Callable[[int, FakeCommunicator, FakeCommunicator], object]) -> list:
    """``fn(group, fed, replicas)`` on ``groups × replicas`` threads (FL+HSDP); results by world rank.

    World rank = group × replicas + replica; ``fed`` joins the ranks at the same replica position of every
    group, ``replicas`` the ranks of one group.
    """
    fed_shared = [{"barrier": threading.Barrier(groups, timeout=BARRIER_TIMEOUT_S)} for _ in range(replicas)]
    rep_shared = [{"barrier": threading.Barrier(replicas, timeout=BARRIER_TIMEOUT_S)} for _ in range(groups)]

    def rank_fn(world: FakeCommunicator) -> object:
        group, replica = divmod(world.rank(), replicas)
        fed = FakeCommunicator(fed_shared[replica], group, groups)
        return fn(group, fed, FakeCommunicator(rep_shared[group], replica, replicas))

    return run_ranks(groups * replicas, rank_fn)


class Counted:
    """A `Communicator` that counts the collectives it runs (``calls``), then runs them on ``inner``."""

    def __init__(self, inner: FakeCommunicator) -> None:
        self.inner, self.calls = inner, 0

    def size(self) -> int:
        return self.inner.size()

    def rank(self) -> int:
        return self.inner.rank()

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self.calls += 1
        self.inner.all_reduce_sum(tensor)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.calls += 1
        self.inner.all_to_all(output, input)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.calls += 1
        self.inner.all_gather(output, input)

    def all_to_all_v(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> None:
        self.calls += 1
        self.inner.all_to_all_v(output, input, output_splits, input_splits)


def run_federation(groups: int, fn: Callable[[FederationCommunicator], object], pieces: bool = False) -> list:
    """``fn(comm)`` on ``groups`` threads, one rank per group: the engine's peers, control and exchange are three
    fake groups of the same ranks (the exchange's own, as the overlap worker needs), each `Counted`.

    ``pieces``: describe the groups as groups of unequal size do (``groups``, no ``peers``), so that the engine
    takes `hf_fedshard.engine.pieces` (here each group is one rank, so every group weighs the same).
    """
    shared = {name: {"barrier": threading.Barrier(groups, timeout=BARRIER_TIMEOUT_S)} for name in ("p", "c", "x")}

    def rank_fn(world: FakeCommunicator) -> object:
        rank = world.rank()
        peers, control, exchange = (Counted(FakeCommunicator(shared[n], rank, groups)) for n in ("p", "c", "x"))
        if pieces:
            shapes = tuple(GroupShape((r,), 1) for r in range(groups))
            return fn(FederationCommunicator(None, control, exchange, timeout="t=5", groups=shapes, this_group=rank))
        return fn(FederationCommunicator(peers=peers, control=control, exchange=exchange, timeout="fed_timeout_s=5"))

    return run_ranks(groups, rank_fn)

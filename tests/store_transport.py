"""A transport written outside the package, the worked example of the README's "How it is built": every group its own
launch, meeting at a key-value store (a `TCPStore` that one process hosts: here the test; on a cluster, any host every
group reaches). Importing this module registers it as ``fed_transport store`` through the public `register_transport`;
nothing under ``hf_fedshard/`` names it.

Its membership is its own and elastic: groups die, restart and heal between averagings, as torchft's do, by the
round protocol of `hf_fedshard.engine.rounds` (its states and invariants). Everything goes through six calls of the
store (`KeyValue`), so the same class runs in real launches over a `TCPStore` and in the round protocol's simulator
over a store on a fake clock (`tests.round_world.SimulatedStore`), under the simulator's fault schedules:

- QUORUM: a group's first rank appends a `Claim` (group, launch number, averagings committed, lineage) to the open
  quorum's list. The quorum closes, for good (`compare_set`), once every nominal group claimed, or once every launch
  of the last quorum still alive claimed (newcomers ride along), or ``timeout_s`` after the first of those claimed
  (one of them died); the first quorum of a federation waits ``join_timeout_s`` for the others. A claim that came
  after the close goes to the next quorum. A launch of a group supersedes its earlier ones once its first claim is
  written (`group{G}/launches`, the newest launch number that claimed): a dead launch is noticed at once when its
  group's restart asks for a quorum, and that restart is already in the quorum the others form then; a live launch
  superseded stops (I6).
- EXCHANGE: every collective posts this rank's tensor under the quorum's next operation and reads its peers'
  (the same sum order on every rank, so every group holds the same bits); a peer that is silent for ``timeout_s``,
  superseded, or that said it failed or left the quorum (`q{Q}/left/{position}`), fails the round (zeros, and a no
  vote).
- COMMIT: every rank of every group of the quorum votes; a group takes a round only if all its ranks saw every
  vote yes.
- HEAL: a group whose (averagings, lineage) is not the quorum's lead (`hf_fedshard.engine.rounds.lead`) reads the
  committed state of the first group on it, shard position by shard position, from the store (where it stays two
  quorums); the copy fails only if that source died, and then on every rank of the group.

Collectives through a store are slow: this is an example of the seam, not a transport for large models. Groups of
equal size only. Use: ``import store_transport`` in the training script, then ``--fed_transport store
--fed_transport_options '{"group_id": 0, "num_groups": 2, "store": "HOST:PORT"}'``.
"""

from __future__ import annotations

import io
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hf_fedshard.engine import FederationCommunicator
from hf_fedshard.engine.communicator import GroupThenPeers, Round
from hf_fedshard.engine.rounds import HealState, end_round, join, lead, next_lineage
from hf_fedshard.errors import ConfigError
from hf_fedshard.transports import FederationRequest, GroupLaunch, register_transport
from hf_fedshard.transports.members import differing_settings

POLL_S = 0.05  # how often a waiting rank reads the store again
JOIN_TIMEOUT_S = 3.0  # how long the first quorum of a federation waits for the groups to start


class KeyValue(Protocol):
    """The calls of `torch.distributed.TCPStore` this transport makes (a failure raises `dist.DistError`)."""

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def delete_key(self, key: str) -> bool: ...


@dataclass(frozen=True)
class StoreSettings(GroupLaunch):
    """A launch per group (``group_id`` of ``num_groups``), meeting at the TCPStore at ``store`` (``HOST:PORT``)."""

    store: str


@dataclass(frozen=True)
class Claim:
    """A group's ask for a place in a quorum: its launch number (its group's count of launches so far), and the
    averagings it committed with their lineage (`hf_fedshard.engine.rounds` I8)."""

    group: int
    launch: int
    count: int
    lineage: int


def _encode(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _decode(data: bytes, like: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(like.dtype).view(like.shape)


def _pickle(state: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


class StoreMembership:
    """One rank's side of the federation: the `Membership` (quorum, vote, heal) and its peers' `Communicator` (one
    rank per group at this shard position), every call through ``store``.

    ``share(obj)`` hands the group's first rank's ``obj`` to every rank of the group and ``any_rank(flag)`` is true
    if ``flag`` is on any of them (a launch of one rank: ``lambda x: x``): the group decides a quorum, a commit and
    a heal once, for all its ranks.
    """

    def __init__(
        self,
        store: KeyValue,
        *,
        group_id: int,
        num_groups: int,
        heal: HealState,
        timeout_s: float,
        position: int = 0,
        positions: int = 1,
        share: Callable[[Any], Any] = lambda x: x,
        any_rank: Callable[[bool], bool] = lambda x: x,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        join_timeout_s: float = JOIN_TIMEOUT_S,
        poll_s: float = POLL_S,
    ) -> None:
        self.store, self.group, self.num_groups, self.heal = store, group_id, num_groups, heal
        self.position, self.positions = position, positions  # this rank's shard position in its group, of how many
        self.timeout_s, self.join_timeout_s, self._poll = timeout_s, join_timeout_s, poll_s
        self._share, self._any_rank, self._clock, self._sleep = share, any_rank, clock, sleep
        self.launch = share(store.add(f"group{group_id}/numbers", 1) if position == 0 else None)
        self._announced = False  # whether this launch has superseded its group's earlier ones (`_announce`)
        self.count = self.lineage = self.heals = 0
        self.ended: list[int] | None = None  # the groups END never met (`end`)
        self.quorum, self.members = -1, ()  # the current quorum's number and its claims, by group
        self.error: str | None = None  # why a collective of this round failed (the vote is then no)
        self.commits: list[tuple[int, tuple[int, ...]]] = []  # (quorum, its groups) of every round committed
        self._ops, self._votes = itertools.count(), itertools.count()
        self._posted: list[str] = []  # this rank's tensors of the current quorum, deleted when it moves on
        self._states: list[list[str]] = [[], []]  # its heal states of the last two quorums (a healer may be slow)

    # ---- Membership (`hf_fedshard.engine.communicator`) ----

    def join(self, averagings: int) -> Round:
        """The first quorum, by the protocol's rule (`hf_fedshard.engine.rounds.join`), on the first rank's clock."""
        self.count = averagings
        clock = lambda: self._share(self._clock())  # noqa: E731 (every rank of the group decides alike)
        return join(self.next_round, lambda: len(self.members), self.num_groups, self.timeout_s, clock, self._sleep)

    def next_round(self) -> Round:
        """QUORUM, and HEAL if this group is not on the quorum's lead."""
        self._leave()
        decided = self._share(self._ask() if self.position == 0 else None)
        if isinstance(decided, Exception):  # the first rank's error (returned, not raised), raised by every rank
            raise decided
        previous = [(c.group, c.launch) for c in self.members]
        self.quorum, self.members = decided
        self._ops, self._votes, self.error = itertools.count(), itertools.count(), None
        changed = previous != [(c.group, c.launch) for c in self.members]
        target = lead([(c.group, c.count, c.lineage) for c in self.members])
        source = next(c for c in self.members if (c.count, c.lineage) == target)
        groups = tuple(c.group for c in self.members if (c.count, c.lineage) == target)
        behind = tuple(c.group for c in self.members if (c.count, c.lineage) != target)
        if (self.count, self.lineage) == target:
            if source.group == self.group and any((c.count, c.lineage) != target for c in self.members):
                self._send_state()
            return Round(healed=False, changed=changed, on_lead=groups, behind=behind)
        self._take(source, target)
        return Round(healed=True, changed=changed, on_lead=groups, behind=behind)

    def commit(self) -> bool:
        """COMMIT: this rank votes yes iff its collectives succeeded; the group takes the round iff every rank of
        every group voted yes, as every one of its ranks saw."""
        key = f"q{self.quorum}/vote{next(self._votes)}"
        try:  # a vote stays in the store: a peer may read it after this rank moved on
            self.store.set(f"{key}/{self.group}.{self.position}", b"1" if self.error is None else b"0")
            keys = [f"{key}/{c.group}.{p}" for c in self.members for p in range(self.positions)]
            no_yet = lambda: any(self.store.check([k]) and self.store.get(k) == b"0" for k in keys)  # noqa: E731
            seen = self._wait(keys, lambda: self._member_gone() or no_yet()) and all(
                self.store.get(k) == b"1" for k in keys
            )  # a no already posted ends the wait: the round cannot commit (a stalled member need not be awaited)
        except dist.DistError:
            seen = False
        if self._any_rank(not seen):
            return False
        self.count += 1
        groups = tuple(c.group for c in self.members)
        self.lineage = next_lineage(self.lineage, self.count, groups)
        self.commits.append((self.quorum, groups))
        return True

    def end(self, new_quorum: Callable[[Round], None], last: Round | None) -> list[int]:
        """END (`hf_fedshard.engine.rounds.end_round`), on the first rank's clock."""
        clock = lambda: self._share(self._clock())  # noqa: E731 (every rank of the group decides alike)
        name = f"fed_group{self.group}" if self.position == 0 else ""
        self.ended = end_round(
            self, self.heal, new_quorum, last, self.num_groups, self.timeout_s, clock, self._sleep, name
        )
        return self.ended

    def metrics(self) -> dict[str, float]:
        return {"fed_groups_in_quorum": len(self.members), "fed_heals": self.heals}

    # ---- Communicator: this rank's peers, one per group of the quorum ----

    def size(self) -> int:
        return max(len(self.members), 1)

    def rank(self) -> int:
        return next((i for i, c in enumerate(self.members) if c.group == self.group), 0)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._collective(tensor, tensor, lambda posts: sum(posts[1:], posts[0].clone()))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._collective(input, output, torch.cat)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        me, n = self.rank(), self.size()
        self._collective(input, output, lambda posts: torch.cat([p.chunk(n)[me] for p in posts]))

    def _collective(
        self, mine: torch.Tensor, output: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]
    ) -> None:
        """``combine`` of every peer's ``mine`` (in group order: the same bits on every rank); zeros if it failed."""
        posts = self._exchange(mine)
        if posts is None:
            output.zero_()
        else:
            output.copy_(combine(posts))

    # ---- The store ----

    def _ask(self) -> tuple[int, tuple[Claim, ...]] | Exception:
        """The first rank's QUORUM: claim a place in the open quorum until one closes with this group in it: its
        number and members. An error is returned, to be raised by every rank of the group (`next_round`)."""
        claim = Claim(self.group, self.launch, self.count, self.lineage)
        try:
            while True:
                quorum = int(self.store.add("open", 0))
                slot = self.store.add(f"q{quorum}/claims", 1)
                self.store.set(f"q{quorum}/claim{slot}", json.dumps(asdict(claim)))
                self._announce()
                members = self._close(quorum)
                mine = [c for c in members if c.group == self.group]
                if (mine and mine[0].launch != self.launch) or self._superseded(self.group, self.launch):
                    return ConfigError(
                        f"hf_fedshard: fed_group_id={self.group} is claimed by another launch (two launches of one "
                        "group id, or this one was restarted while it ran). Give each launch its own fed_group_id."
                    )
                if mine:
                    return quorum, tuple(members)
                self.store.compare_set("open", str(quorum), str(quorum + 1))  # it closed without us: the next one
        except (dist.DistError, TimeoutError) as err:
            cause = str(err).splitlines()[0][:300]
            return RuntimeError(f"hf_fedshard: fed_group{self.group} got no quorum of the federation: {cause}")

    def _close(self, quorum: int) -> list[Claim]:
        """The quorum's members once it closed (see the module docstring for when), closing it if this rank may."""
        expected = set(self._members_of(quorum - 1)) if quorum > 0 else set()
        start, first = self._clock(), None
        while not self.store.check([f"q{quorum}/members"]):
            claims = [c for c in self._claims(quorum) if not self._superseded(c.group, c.launch)]
            latest = {c.group: c for c in sorted(claims, key=lambda c: c.launch)}
            claimed = {(c.group, c.launch) for c in claims}
            alive = {e for e in expected if not self._superseded(*e)}
            now = self._clock()
            first = now if first is None and alive & claimed else first
            every_group = len(latest) >= self.num_groups
            every_member_back = bool(alive) and alive <= claimed  # the last quorum's launches alive: newcomers ride
            first_quorum_waited = not alive and now - start >= self.join_timeout_s
            a_member_silent = first is not None and now - first >= self.timeout_s  # one of them died
            if every_group or every_member_back or first_quorum_waited or a_member_silent:
                members = json.dumps([asdict(c) for c in sorted(latest.values(), key=lambda c: c.group)])
                self.store.compare_set(f"q{quorum}/members", "", members)
                break
            if first is None and now - start >= self.timeout_s:
                raise TimeoutError(f"no group of the last quorum asked for the next within {self.timeout_s:g} s")
            self._sleep(self._poll)
        self.store.compare_set("open", str(quorum), str(quorum + 1))
        return [Claim(**c) for c in json.loads(self.store.get(f"q{quorum}/members"))]

    def _claims(self, quorum: int) -> list[Claim]:
        """The claims written so far (a slot taken by a launch killed before it wrote its claim stays empty)."""
        keys = [f"q{quorum}/claim{s}" for s in range(1, self.store.add(f"q{quorum}/claims", 0) + 1)]
        return [Claim(**json.loads(self.store.get(key))) for key in keys if self.store.check([key])]

    def _members_of(self, quorum: int) -> list[tuple[int, int]]:
        if not self.store.check([f"q{quorum}/members"]):
            return []
        return [(c["group"], c["launch"]) for c in json.loads(self.store.get(f"q{quorum}/members"))]

    def _announce(self) -> None:
        """Supersede this group's earlier launches, once, after this launch's first claim is written: the peers that
        notice the dead launch then find this one's claim in the quorum they ask for, rather than closing one
        without it (a restart noticed before it claimed was left out of that quorum, healed one averaging later, and
        the federation averaged that round without it)."""
        if self._announced:
            return
        key, current = f"group{self.group}/launches", self.store.add(f"group{self.group}/launches", 0)
        while current < self.launch:  # the newest number that claimed: raise it to ours unless a later one did
            current = int(self.store.compare_set(key, str(current), str(self.launch)))
        self._announced = True

    def _superseded(self, group: int, launch: int) -> bool:
        """A later launch of ``group`` claimed a place in a quorum: ``launch`` is dead (or must stop, I6)."""
        return self.store.add(f"group{group}/launches", 0) > launch

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """EXCHANGE: every peer's ``tensor`` of this operation, in group order; ``None`` if one failed (the round's
        vote is then no)."""
        if self.error is not None or not self.members:
            return None
        key = f"q{self.quorum}/op{next(self._ops)}/{self.position}"
        try:
            self._post(f"{key}/{self.group}", _encode(tensor))
            keys = [f"{key}/{c.group}" for c in self.members]
            if self._wait(keys, lambda: self._member_gone() or self._peer_left()):
                return [_decode(self.store.get(k), tensor) for k in keys]
            self.error = f"a peer of quorum {self.quorum} left, restarted or was silent for {self.timeout_s:g} s"
            self.store.add(f"q{self.quorum}/left/{self.position}", 1)  # its peers waiting on this rank: fail now
        except dist.DistError as err:
            self.error = str(err).splitlines()[0]
        return None

    def _take(self, source: Claim, target: tuple[int, int]) -> None:
        """HEAL: the source group's committed state at this rank's shard position; the group raises on every rank
        if one of them could not read it (half a group healed would average two models)."""
        key = f"q{self.quorum}/state/{self.position}"
        try:
            got = self._wait([key], lambda: self._superseded(source.group, source.launch))
            state = torch.load(io.BytesIO(self.store.get(key)), weights_only=False) if got else None
        except Exception:  # a store error or a torn state: the group decides together, below
            state = None
        if self._any_rank(state is None):
            raise RuntimeError(
                f"hf_fedshard: fed_group{self.group} could not heal from fed_group{source.group} (it left during the "
                "copy): restart this group to heal again."
            )
        self.heal.receive(state)
        (self.count, self.lineage), self.heals = target, self.heals + 1

    def _wait(self, keys: list[str], failed: Callable[[], bool]) -> bool:
        """Until every key is set: False after ``timeout_s``, or as soon as ``failed()``."""
        deadline = self._clock() + self.timeout_s
        while not self.store.check(keys):
            if self._clock() > deadline or failed():
                return False
            self._sleep(self._poll)
        return True

    def _member_gone(self) -> bool:
        """A member of the quorum was superseded: it died (its group restarted)."""
        return any(self._superseded(c.group, c.launch) for c in self.members)

    def _peer_left(self) -> bool:
        """A peer at this shard position failed a collective of the round, or left the quorum (it was over for it):
        what this rank waits for will not come."""
        return self.quorum >= 0 and self.store.add(f"q{self.quorum}/left/{self.position}", 0) > 0

    def _send_state(self) -> None:
        """This group is the heal's source: its committed state at this rank's position, kept two quorums (a failed
        copy is then the healer's alone to report: the group raises together in `_take`)."""
        key = f"q{self.quorum}/state/{self.position}"
        try:
            self.store.set(key, _pickle(self.heal.committed()))
            self._states[-1].append(key)
        except dist.DistError as err:
            self.error = str(err).splitlines()[0]  # the round then fails here too, and the next quorum tries again

    def _post(self, key: str, value: bytes) -> None:
        self.store.set(key, value)
        self._posted.append(key)

    def _leave(self) -> None:
        """Leave the current quorum: say so (a peer still waiting on this rank fails at once), delete this rank's
        tensors (every peer that voted has read them) and its heal states of the quorum before."""
        stale, self._states = self._states[0], [self._states[1], []]
        try:
            if self.quorum >= 0:
                self.store.add(f"q{self.quorum}/left/{self.position}", 1)
            for key in self._posted + stale:
                self.store.delete_key(key)
        except dist.DistError:
            pass  # the store is gone, and the keys with it: the quorum that follows says so
        self._posted = []


class StoreFederation:
    """This launch's side over a `TCPStore`: a `StoreMembership` per rank, its group's decisions shared over the
    launch's own process group."""

    def __init__(self, request: FederationRequest) -> None:
        settings: StoreSettings = request.settings
        if not request.layout.equal:
            raise ConfigError("fed_transport store averages groups of equal size only. Drop the fed_group_size list.")
        host, port = settings.store.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=request.timeout_s))
        self.store, self.group, self.fingerprint = store, request.group, request.fingerprint
        self.membership = StoreMembership(
            store, group_id=settings.group_id, num_groups=settings.num_groups, heal=request.heal,
            timeout_s=request.timeout_s, position=dist.get_rank(request.group),
            positions=dist.get_world_size(request.group), share=self._share, any_rank=self._any_rank,
        )  # fmt: skip
        self.communicator = FederationCommunicator(
            peers=self.membership, control=GroupThenPeers(request.group, self.membership),
            hsdp_replicas=request.launch.replicas, timeout=request.timeout, membership=self.membership,
            background_exchange=False,  # its collectives share the group's process group with FSDP's
        )  # fmt: skip

    def join(self, averagings: int) -> Round:
        """Meet the others (a group behind heals here), having posted this group's settings; a group whose settings
        differ from those of a group of its first quorum is refused there (a newcomer reads the running groups'
        settings and stops; they go on)."""
        group = self.membership.group
        self.store.set(f"settings/{group}", self.fingerprint)
        joined = self.membership.join(averagings)
        texts = {f"fed_group{c.group}": self.store.get(f"settings/{c.group}").decode() for c in self.membership.members}
        if len(set(texts.values())) > 1:
            raise ConfigError(
                f"fed_transport store: fed_group{group} met groups started with other settings: "
                f"{differing_settings(texts)}. Launch every group with the same settings."
            )
        return joined

    def shutdown(self) -> None:
        """This launch's posts stay until the store's host ends (the others may still read its last vote)."""

    def _share(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _any_rank(self, flag: bool) -> bool:
        value = torch.tensor([float(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())


register_transport(
    "store", StoreFederation, settings=StoreSettings,
    summary="every group its own launch, meeting at a TCPStore (a test's example of a transport from outside).",
)  # fmt: skip

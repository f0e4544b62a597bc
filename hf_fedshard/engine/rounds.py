"""The averaging round of a federation whose groups may leave and join (``fed_transport torchft``, the simulator):
its states, its invariants, and the committed state a group heals from. It imports no transport.

One rank's round, for one averaging::

    QUORUM ──► EXCHANGE ──► COMMIT ──committed──► APPLY ──► snapshot ──► QUORUM (the next round's)
       ▲                       │
       └──────── REDO ◄────────┘ not committed: a new quorum of the groups alive; the local progress is kept
                                 (or HEAL there, if this group is behind: its round is over)

    after the final averaging:  END ──► QUORUM ──► END ... until every nominal group met this group on its final
                                        model, or fed_timeout_s passed (I10); then the group saves and exits

- QUORUM: the transport forms the quorum of the groups alive (`Membership.next_round`). A group behind the others
  (it has just started, or lost a round they committed) receives a live group's committed state there (HEAL); the
  transport hands it to `HealState.receive`, and the round applies it after the quorum formed, never inside it.
- EXCHANGE: ``attempt()`` runs every collective of the averaging and changes no state.
- COMMIT: every rank of every group of the quorum votes (`Membership.commit`): committed iff every collective
  succeeded everywhere.
- APPLY: ``apply(result)`` changes the state; then every registered part is snapshotted (`HealState.commit`).

Invariants (asserted where they can fail cheaply):

- I1 a group heals only from a state its source committed: `HealState.committed` is the snapshot taken after the
  last APPLY, never the live state, whatever the source is doing when a joining group asks (training, or redoing
  a round that did not commit yet).
- I2 the groups of a committed averaging are at the same step: the control all-reduce of every averaging sums each
  rank's step and its square (`hf_fedshard.engine.control.agree`), and a round whose groups differ is refused.
- I3 nothing is applied from a round that did not commit: ``apply`` runs only after `Membership.commit`.
- I4 after a heal the group is where its source committed: its averaging count, its step (the trainer resumes there
  and trains up to the round its peers are in) and its global model.
- I5 norms are published only where every rank of the round holds norms of a quorum of the same size
  (`hf_fedshard.engine.control.agree`): a resume or a heal never meets stale sums.
- I6 a launch replaces a dead launch of the same group id; two live launches of one id are refused (the transport
  counts the claims of the launches that answer, so a dead one is never counted).
- I7 a launch that starts without healing (afresh, or resumed from a checkpoint) waits at its first quorum for every
  nominal group, up to the timeout (`join`): groups resumed a few seconds apart average together instead of in
  separate quorums that would each commit the same averaging on other models.
- I8 the groups of a quorum hold one global model once it formed: each group keeps a lineage code, chained at every
  commit from the count and the groups that committed (`next_lineage`); two quorums that committed the same averaging
  apart (a group redid a round alone while the others redid it together) hold different codes, and when they meet
  every group not on the lead (`lead`: the highest count, then the code most groups hold) heals from one that is.

- I9 one federation: two groups alive never commit averagings in disjoint quorums for long. A group that stalls
  (SIGSTOP, a long pause) past ``fed_timeout_s`` is left out of the quorums the others form meanwhile; when it is
  back, its next round fails (its quorum is gone) and it asks again. It cannot form a quorum of its own while the
  others are alive (torchft's lighthouse: a quorum holds more than half of the live groups; the store transport:
  a quorum waits for every live launch of the last one), so it meets them at their next ask, is off the lead (I8)
  and heals, or is left behind by more than a round and exits to be healed at its restart. Checked by the
  simulator with stalls of many lengths at every point of a run (tests/unit/test_round_simulator.py).
- I10 the end of training is a round: a group that applied its final averaging does not exit at once (END): it
  forms quorums every half second, serving its committed final model, until every nominal group has been in a
  quorum with it on that model (on the lead, or healed to it there), or ``fed_timeout_s`` passed (`end_round`). A group
  that comes back within that bound meets it, heals (the same step: its round is over; an earlier step: it is left
  behind and heals at its restart) and ends on the same model. A group never met is named in one line by every
  group that ended without it (died, or back later than the bound: that one ends on a model of its own and names
  the others alike); nothing is left unsaid.

Streamed averagings (fragments, overlap τ): each fragment's averaging is one round, begun at step s and applied at
s + τ (τ = 0: both at s); the round's EXCHANGE starts at s (the control all-reduce, then the exchange on the worker
thread) and its COMMIT, APPLY and QUORUM come at s + τ. What the invariants mean per fragment:

- I1 a snapshot is taken only after a fragment's APPLY, where nothing is in flight; a heal never sends an exchange
  in flight (the next begins H/F > τ steps later).
- I2 the step the groups compare is the one the averaging began at (a redo at s + τ meets a group that healed into
  the round and begins it when it reaches s).
- I3 a fragment's mean Δ and the buffers' means are applied only after its vote; a failed vote redoes the round at
  s + τ, blocking, over the groups alive, from what it began with (snapshot, buffers, NaN flag), never from the
  model τ steps later: what a group applies is the fault-free result of the groups that committed it. A checkpoint
  taken inside the window holds only what the averaging began with; a resume attempts it again.
- I4 a group that heals takes the source's committed anchors, step and count, and no averaging in flight.
- I8 the count and the lineage advance once per committed fragment.

An evaluation between averagings (`FederatedAverager`'s lend round) is a round too: its EXCHANGE is the plain mean
of the model state into copies, its APPLY only keeps them for the evaluation; it runs where nothing is in flight.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hf_fedshard.engine.communicator import Membership, Round

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
NOT_READY = "not_ready"
LINEAGE_CODES = 1 << 20  # codes below 2^20: their sums and squares over a few thousand groups stay exact in float64


def next_lineage(lineage: int, count: int, groups: Sequence[int]) -> int:
    """The lineage code after a commit that brought the averaging count to ``count`` with ``groups`` (I8): equal on
    every group of that commit; two quorums that commit one averaging apart differ (but for a 2^-20 collision)."""
    digest = hashlib.sha256(f"{lineage}:{count}:{sorted(groups)}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % LINEAGE_CODES


def lead(members: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
    """The (count, lineage) every group of a quorum of ``members`` (group id, count, lineage) holds once it formed
    (I8): the highest averaging count, and among the groups at it the lineage most of them hold (a tie: the one
    of the lowest group id). A group that does not hold it heals from one that does."""
    top = max(count for _, count, _ in members)
    votes = Counter(lineage for _, count, lineage in members if count == top)
    most = max(votes.values())
    first = min((group, lineage) for group, count, lineage in members if count == top and votes[lineage] == most)
    return top, first[1]


class HealState:
    """The parts of a group's state registered by name, snapshotted at every committed averaging (I1).

    Each part registers ``save`` (its state now; called right after an averaging committed, and what it returns must
    stay valid until the next commit) and ``load`` (takes a source's saved state on a healing group). A part that
    arrives before its ``load`` is applied (a group healing before its training loop builds the averager) waits in
    `held` until the loop takes it (`take`).
    """

    def __init__(self) -> None:
        self._save: dict[str, Callable[[], Any]] = {}
        self._load: dict[str, Callable[[Any], None]] = {}
        self._committed: dict[str, Any] | None = None
        self.held: dict[str, Any] = {}

    def register(self, name: str, save: Callable[[], Any], load: Callable[[Any], None] | None = None) -> None:
        self._save[name] = save
        if load is not None:
            self._load[name] = load

    def commit(self) -> None:
        """Snapshot every part: the state a group behind heals from until the next commit."""
        self._committed = {name: save() for name, save in self._save.items()}

    def committed(self) -> dict[str, Any]:
        """The last snapshot; ``{NOT_READY: True}`` before the first commit (this group is resuming too)."""
        return {NOT_READY: True} if self._committed is None else self._committed

    def receive(self, parts: dict[str, Any]) -> None:
        """A source's snapshot arrived: hold it until `apply` (or the training loop's `take`)."""
        if parts.get(NOT_READY):
            raise RuntimeError(
                "hf_fedshard: this group is behind the federation, but the group it would heal from has not "
                "committed an averaging yet (it is resuming too). Restart this group once the others train."
            )
        self.held = dict(parts)

    def apply(self) -> None:
        """Hand each held part to its ``load`` (a heal between rounds); parts with none stay held. Once every part
        is loaded, the group holds its source's committed state: its own snapshot now (I1), should a group behind
        heal from it before its next commit."""
        for name in [n for n in self.held if n in self._load]:
            self._load[name](self.held.pop(name))
        if not self.held:
            self.commit()

    def take(self) -> dict[str, Any]:
        """Every held part, now the caller's (the training loop resumes from them before it trains)."""
        held, self.held = self.held, {}
        return held


def run_round(
    membership: Membership,
    heal: HealState,
    attempt: Callable[[], _T],
    apply: Callable[[_T], None],
    new_quorum: Callable[[Round], None],
    describe: str,
) -> None:
    """One averaging through its states (see the module docstring): EXCHANGE, COMMIT, then APPLY and the snapshot;
    or REDO over the next quorum until it commits, or until this group healed there (its round is then over).

    ``new_quorum`` sees every quorum formed (the averager drops what belonged to the previous one); ``describe``
    names the averaging in the warning of a redo (``""``: this rank does not log).
    """
    while True:
        result = attempt()  # EXCHANGE
        if membership.commit():  # COMMIT
            apply(result)  # APPLY (I3: only here)
            heal.commit()  # I1: what a joining group will be sent
            _quorum(membership, heal, new_quorum)  # the next round's, while every group holds the global model
            return
        if describe:
            logger.warning(
                "hf_fedshard: the averaging %s failed (a group left or a link broke): forming a new quorum and "
                "averaging again among the groups alive.",
                describe,
            )
        if _quorum(membership, heal, new_quorum).healed:  # REDO; or HEAL: the others committed it without us
            return


def _quorum(membership: Membership, heal: HealState, new_quorum: Callable[[Round], None]) -> Round:
    """QUORUM: the next quorum, and the heal it brought (applied here, once the transport is done)."""
    formed = membership.next_round()
    new_quorum(formed)
    if formed.healed:
        heal.apply()
    return formed


def join(
    ask: Callable[[], Round],
    present: Callable[[], int],
    num_groups: int,
    timeout_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> Round:
    """The first QUORUM of a launch, before training (I7): a launch that healed joins the running federation at
    once; one that did not asks again every half second until every one of ``num_groups`` is in its quorum, or
    ``timeout_s`` passed (the others then join when they start, healing from this one)."""
    joined = ask()
    deadline = clock() + timeout_s
    while not joined.healed and present() < num_groups:
        if clock() > deadline:
            logger.warning(
                "hf_fedshard: starting with %d of fed_num_groups=%d groups after %gs (fed_timeout_s); the others "
                "join when they start.",
                present(),
                num_groups,
                timeout_s,
            )
            break
        sleep(0.5)
        joined = ask()
    return joined


def end_round(
    membership: Membership,
    heal: HealState,
    new_quorum: Callable[[Round], None],
    last: Round | None,
    num_groups: int,
    timeout_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    name: str,
) -> list[int]:
    """END (I10): after this group's final averaging (``last``: the quorum formed right after it), form a quorum
    every half second, so that a late group meets this one and heals to its final model, until every one of
    ``num_groups`` was in a quorum with it on that model or ``timeout_s`` passed since the last quorum where a
    group healed; the groups never met, named in one line by ``name`` (this group, e.g. ``"fed_group0"``; ``""``:
    this rank does not log). ``clock`` must read alike on every rank of the group (each rank decides when to
    stop)."""
    met = set(last.on_lead) if last is not None and not last.healed else set()
    deadline = clock() + timeout_s
    while len(met) < num_groups and clock() < deadline:
        sleep(0.5)
        try:
            formed = _quorum(membership, heal, new_quorum)
        except RuntimeError as err:  # the lighthouse or the others are gone: nobody is left to meet
            if name:
                logger.warning("hf_fedshard: %s stopped waiting for late groups at the end of training: %s", name, err)
            break
        met = set(formed.on_lead) if formed.healed else met | set(formed.on_lead)
        if formed.behind and not formed.healed:  # a late group heals here (or is left behind, to heal at its
            deadline = max(deadline, clock() + timeout_s)  # restart): it is met at a later quorum; wait for it
    missing = sorted(set(range(num_groups)) - met)
    if missing and name:
        logger.warning(
            "hf_fedshard: %s ended without %s, which never met it on its final model within fed_timeout_s=%g s: "
            "each died, or is back later than that and ends on a model of its own (naming %s alike). Raise "
            "--fed_timeout_s to wait longer for a stalled group; start the lighthouse with --min_groups %d to have "
            "a group left alone fail instead.",
            name,
            ", ".join(f"fed_group{g}" for g in missing),
            timeout_s,
            name,
            num_groups,
        )
    return missing

"""The elastic round protocol (`hf_fedshard.engine.rounds`) under fault schedules on a fake clock: the real engine in
every group, a seeded scheduler, and each of two memberships (`tests.round_world.BACKENDS`): torchft's semantics in a
fake lighthouse (`hf_fedshard.transports.simulated`), and the membership of the transport written outside the
package (`tests.store_transport`) over a simulated store. Each schedule must end with every group on one model and
one averaging count (`tests.round_world.World.check`).

The three named schedules are the failures met with real launches (issue 30); the property test draws kills,
restarts after any delay, stops, rounds that do not commit and staggered full resumes from seeds."""

from __future__ import annotations

import pytest
import torch

from ..round_world import BACKENDS, HEARTBEAT_TIMEOUT_S, NO_QUORUM, STEP_S, TIMEOUT_S, World, schedule

backends = pytest.mark.parametrize("backend", list(BACKENDS))


@backends
def test_a_fast_restart_heals_in_phase(backend):
    """Failure 1: a group killed at step 10 and back 0.5 s later, before the quorum without it formed: it heals
    from the state its peer committed at step 8 (not from the peer's step-12 state while that round is redone),
    trains 9–12 and averages with it at 12."""
    world = World(seed=1, groups=2, backend=backend)
    for g in range(2):
        world.start(g)
    world.kill(1, at=10.5 * STEP_S, restart_after=0.5)
    world.run().check()


@backends
def test_a_group_restarted_while_its_dead_launch_is_still_known_joins(backend):
    """Failure 2: the new launch of group 2 arrives while the lighthouse still knows the dead one (its heartbeats
    have not timed out): the dead launch is not counted as a second claim of fed_group_id=2."""
    world = World(seed=2, groups=3, backend=backend)
    for g in range(3):
        world.start(g)
    world.kill(2, at=6.2 * STEP_S, restart_after=HEARTBEAT_TIMEOUT_S / 5)
    world.run().check()


@backends
def test_a_full_resume_with_staggered_starts_averages_together(backend):
    """Failure 3: the lighthouse is lost after checkpoint-16; every group fails at its next quorum; all restart
    from checkpoint-16 0, 5 and 10 s apart. The norms saved for 3 groups meet smaller quorums (not published, I5),
    and the first groups wait for the others (up to fed_timeout_s) instead of averaging apart."""
    world = World(seed=3, groups=3, backend=backend)
    for g in range(3):
        world.start(g)
    world.lose_lighthouse(at=17.5 * STEP_S)
    world.full_resume(at=17.5 * STEP_S + TIMEOUT_S + 5, delays=[0.0, 5.0, 10.0])
    world.run().check(allowed_errors=(NO_QUORUM,))


@backends
def test_a_group_back_right_after_step_0s_averaging_heals_with_every_part_of_the_state(backend):
    """Group 1 votes in step 0's averaging and dies before the others form the next quorum; its new launch joins
    that quorum and heals from group 0's snapshot of step 0's commit, which holds the averager's part (registered
    before that round, not after it) and, once applied, is what group 0 serves next (I1)."""
    world = World(seed=82, groups=2, backend=backend)
    world.start(1)
    world.start(0, at=2.31)
    world.kill(1, at=2.49, restart_after=0.06)
    world.run().check()


@backends
def test_two_halves_of_a_federation_never_average_apart(backend):
    """Schedule 482: groups 1, 0 and 2 are killed and restarted 3.5, 5.7 and 11.2 s in, which leaves groups {0, 3}
    and {1, 2} each averaging 4 s after the other, longer than the join timeout. Torchft's lighthouse forms a quorum
    only of more than half of the live launches; the simulated one did not, and each half averaged apart to the
    end, on two models."""
    world, allowed = schedule(482, backend)
    world.run().check(allowed_errors=allowed)


def test_a_claim_slot_left_empty_by_a_killed_launch_does_not_stop_the_quorum():
    """The store membership claims a place in two calls (take a slot, write the claim): a launch killed between
    them leaves a slot empty in the quorum the others are forming. They read the claims written, and average on."""
    world = World(seed=5, groups=2, backend="store")
    for g in range(2):
        world.start(g)

    def slot_taken_and_left_empty() -> None:  # on the scheduler's thread: the store's data, not its calls
        data = world.meeting.store.data
        slots = f"q{int(data.get('open', b'0'))}/claims"
        data[slots] = str(int(data.get(slots, b"0")) + 1).encode()

    world.sim.at(6.5 * STEP_S, slot_taken_and_left_empty)
    world.run().check()


@pytest.mark.parametrize("overlap, seed", [(2, 5), (2, 42), (3, 5), (3, 24), (3, 62)])
def test_the_join_race_at_overlap_2_and_3_ends_on_one_model(overlap, seed):
    """The join race of issue 59 (torchft's lighthouse, Nesterov, τ ≥ 2): a group that waited in the vote while the
    others trained τ more steps asks for a quorum a moment late, is left out by the join timeout and falls a round
    behind. Mid-run it heals at the next quorum; in these five schedules it happens at the final averaging, where
    the others used to exit and it ended on its own model. They now wait in their END round and it heals there."""
    world, allowed = schedule(seed, "lighthouse", sync_overlap=overlap, outer_optimizer="nesterov")
    world.run().check(allowed_errors=allowed)
    assert not any(f.missing for f in world.finished), [(f.group, f.missing) for f in world.finished]


@backends
def test_a_group_stalled_until_the_others_ended_heals_from_their_end_round(backend):
    """Issue 59's stalled group: 3 groups, 48 steps; group 2 stops (SIGSTOP) a third into the run for 70 s, longer
    than fed_timeout_s (20 s), and the others finish meanwhile. Before the END round they exited at once, and group 2,
    alone, averaged on and ended on a model of its own without a word. Now they wait for it (I10): back, it meets
    them, heals (restarted: it is left behind by more than a round) and all three end on one model."""
    world = World(seed=7, groups=3, backend=backend, steps=48)
    for g in range(3):
        world.start(g)
    world.stop(2, at=15.0 * STEP_S, seconds=3.5 * TIMEOUT_S)
    world.run().check()
    assert sorted(f.group for f in world.finished) == [0, 1, 2]
    assert all(f.missing == [] for f in world.finished), [(f.group, f.missing) for f in world.finished]
    assert all(f.at > 15.0 * STEP_S + 3.5 * TIMEOUT_S for f in world.finished)  # they waited for it


def test_a_group_back_after_the_others_end_round_ends_apart_and_each_side_names_the_other():
    """Beyond I10's bound: group 2 is stopped through the others' whole END round (fed_timeout_s after their last
    averaging). It cannot tell them from groups that died: it ends on a model of its own, and each side names the
    other as never met (the one line every group that ended without another says)."""
    world = World(seed=7, groups=3, steps=24)
    for g in range(3):
        world.start(g)
    world.stop(2, at=6.0 * STEP_S, seconds=6 * TIMEOUT_S)
    world.run().check()
    ends = {f.group: f for f in world.finished}
    assert [ends[g].missing for g in range(3)] == [[2], [2], [0, 1]]
    assert torch.equal(ends[0].tensors[0], ends[1].tensors[0]) and not torch.equal(
        ends[0].tensors[0], ends[2].tensors[0]
    )


@backends
@pytest.mark.parametrize("options", [{}, {"sync_fragments": 2, "sync_overlap": 1}], ids=["blocking", "streamed"])
def test_stalls_of_any_length_at_any_point_end_on_one_model(options, backend):
    """I9 and I10: one group stopped for 10 to 80 s (shorter and longer than fed_timeout_s=20 s, and than the rest
    of the run) at 18 points of a 48-step run, 54 schedules: every group ends on one model, but one stopped through
    the others' whole END round, which ends apart with each side naming the other (or, on the store, fails in one
    line: no quorum)."""
    seed = 0
    for at in (1.1 + 2.6 * i for i in range(18)):
        for seconds in (10.0, 35.0, 80.0):
            seed += 1
            world = World(seed=seed, groups=3, backend=backend, steps=48, options=options)
            for g in range(3):
                world.start(g)
            world.stop(seed % 3, at=at * STEP_S, seconds=seconds)
            world.run().check(allowed_errors=(NO_QUORUM,))


@backends
@pytest.mark.parametrize("block", range(4))
def test_every_group_ends_on_one_model_whatever_the_faults(block, backend):
    """300 seeded schedules (4 blocks of 75): each ends with every group on one model and one averaging count."""
    for seed in range(block * 75, (block + 1) * 75):
        world, allowed = schedule(seed, backend)
        world.run().check(allowed_errors=allowed)


STREAMED = [
    {"sync_fragments": 2, "sync_overlap": 1},  # fragment 0 begins at 2 (mod 4), is applied at 3, fragment 1 at 4, 5
    {"sync_overlap": 1, "outer_optimizer": "nesterov"},  # the whole model, applied a step after it began
    {"sync_fragments": 4},  # a fragment every step, blocking
]


@backends
@pytest.mark.parametrize("options", STREAMED, ids=["2-fragments-overlap-1", "nesterov-overlap-1", "4-fragments"])
def test_streamed_averagings_end_on_one_model_whatever_the_faults(options, backend):
    """The first 20 schedules with fragments and overlap (the first 40 pass on each membership; 20 here, for time): a
    round commits at its apply step, a failed one is redone there over the groups alive, a group heals only where
    nothing is in flight, a checkpoint taken with an exchange in flight is attempted again at its resume; every group
    ends on one model and one averaging count."""
    for seed in range(20):
        world, allowed = schedule(seed, backend, **options)
        world.run().check(allowed_errors=allowed)

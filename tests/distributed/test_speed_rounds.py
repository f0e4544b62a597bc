"""Speed-aware rounds (``fed_round_policy speed``) in real launches, one per transport, with group 1 slowed
(it sleeps 0.5 s before each step it trains): the groups' ranks train the steps their agreed plan gives (all H in
the first round, a shorter prefix of each later round for the slow group, the same steps on every rank of a group),
each exchange's mean is Σ s_g Δ_g / Σ s_g with s_g those steps, and every group ends on one model. The rule itself,
exact to the bit on fake clocks, is tests/unit/test_speed_rounds.py; the speed-up is benchmarks/speed_rounds.py's.
"""

from __future__ import annotations

import pytest
import torch

from ..asserts import labelled
from ..launch import lighthouse, train_groups, train_tiny

H, STEPS = 4, 12
COMMON = ["--num_samples", "128", "--max_steps", str(STEPS), "--fed_sync_steps", str(H), "--logging_steps", str(H)]
SPEED = [*COMMON, "--fed_round_policy", "speed", "--slow_group", "1", "--slow_step_s", "0.5", "--record_syncs", "true"]


def check_rounds(groups: list[list[dict]]) -> None:
    """The plan, the weighting and the end state, from every rank's dump (``groups[g][r]``)."""
    trained = [group[0]["trained"] for group in groups]
    for g, group in enumerate(groups):
        for r, rank in enumerate(group):
            assert rank["trained"] == trained[g], labelled(f"group {g} rank {r}: the steps trained")
    assert trained[0] == list(range(1, STEPS + 1)), "the fastest group trains every step"
    for start in range(H, STEPS, H):  # rounds 2, 3: a prefix of the round, shorter than H
        mine = [s for s in trained[1] if start < s <= start + H]
        assert 1 <= len(mine) < H and mine == list(range(start + 1, start + 1 + len(mine))), trained[1]
    assert trained[1][:H] == list(range(1, H + 1)), "unmeasured, the first round trains all H"
    for end in range(H, STEPS + 1, H):
        s = [sum(1 for step in trained[g] if end - H < step <= end) for g in range(2)]
        for r in range(len(groups[0])):
            sent = [groups[g][r]["sync_exchanges"][end][0] for g in range(2)]
            for g in range(2):  # each rank sends s_g Δ_g: its shard (dim 0) of anchor − local, times the steps
                dump = groups[g][r]
                anchor = dump["sync_params"][end - H][1] if end > H else dump["sync_start"]
                local = dump["sync_params"][end][0]
                for i, name in enumerate(local):
                    delta = (anchor[name] - local[name]).chunk(len(groups[g]))[r] * float(s[g])
                    assert torch.equal(sent[g][i], delta), labelled(f"step {end} group {g} rank {r} {name}: s_g Δ_g")
            for i, mean in enumerate(groups[0][r]["sync_exchanges"][end][1]):
                want = (sent[0][i] + sent[1][i]) / float(s[0] + s[1])
                assert torch.equal(mean, want), labelled(f"step {end} rank {r} tensor {i}: mean of {s} steps")
    final = groups[0][0]["full_params"]
    for g, group in enumerate(groups):
        for r, rank in enumerate(group):
            for name, value in rank["full_params"].items():
                assert torch.equal(value, final[name]), labelled(f"group {g} rank {r} {name}")
        assert group[0]["fed_counters"]["round_steps_planned"] >= 1


@pytest.mark.timeout(600)
def test_speed_rounds_in_one_job(tmp_path):
    """The mesh: 2 groups × 2 ranks, H = 4, 12 steps; each rank trains on the batches a run under ``steps`` reads at
    the steps it trains (2 samples per step)."""
    dumps = train_tiny(4, tmp_path / "speed", [*SPEED, "--fed_group_size", "2"], timeout_s=400)
    check_rounds([dumps[:2], dumps[2:]])
    steps = train_tiny(4, tmp_path / "steps", [*COMMON, "--fed_group_size", "2"], timeout_s=400)
    for r, (ours, theirs) in enumerate(zip(dumps, steps, strict=True)):  # the data position is the federation's
        batches = [theirs["seen"][2 * (step - 1) : 2 * step] for step in ours["trained"]]
        assert ours["seen"] == [i for batch in batches for i in batch], labelled(f"rank {r}: the samples trained")
    barrier = [h for h in dumps[0]["log_history"] if "fed_barrier_seconds_total" in h]
    assert barrier and barrier[-1]["fed_round_steps"] == H  # rank 0 is in the fast group


@pytest.mark.timeout(600)
def test_speed_rounds_over_torchft(tmp_path):
    """torchft: 2 launches of 1 rank, H = 4, 12 steps; the plan rides on the round's control all-reduce."""
    with lighthouse(min_groups=2) as address:
        groups = train_groups(2, 1, tmp_path, SPEED, address, timeout_s=400)
    check_rounds(groups)

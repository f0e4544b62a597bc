"""Averaging settings changed at a resume are honoured from its step on, and the record says what ran (in-process).

The outer optimizer's rule after a change is pinned against `torch.optim.SGD` given the same hyperparameter change
by hand: bit for bit, since both run the same kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_fedshard.engine.fragments import Schedule
from hf_fedshard.engine.outer import OuterOptimizer
from hf_fedshard.engine.settings_history import (
    AveragingSettings,
    describe_history,
    history_from_state,
    history_to_state,
    settings_of_outer_state,
)
from hf_fedshard.integrations.card import averaging_description

START = torch.tensor([1.0, -2.0, 0.5, 3.0])
FIRST, SECOND = torch.tensor([0.3, -0.1, 0.2, 0.05]), torch.tensor([-0.2, 0.4, 0.1, -0.3])  # mean Δ of two averagings
FEDAVG, NESTEROV = (1.0, 0.0), (0.7, 0.9)


def resumed_anchor(before: tuple[float, float], after: tuple[float, float]) -> OuterOptimizer:
    """An outer optimizer with ``before``'s (lr, momentum) steps FIRST, is checkpointed, and is resumed with
    ``after``'s, which steps SECOND."""
    first = OuterOptimizer([START.clone()], *before)
    first.step([FIRST], [torch.empty(4)])
    state = copy.deepcopy(first.state_dict())
    resumed = OuterOptimizer([torch.zeros(4)], *after)
    resumed.load_state_dict(state)
    resumed.step([SECOND], [torch.empty(4)])
    return resumed


def reference_anchor(before: tuple[float, float], after: tuple[float, float], keep_buffer: bool) -> torch.Tensor:
    """torch's SGD with its hyperparameters changed by hand between the two steps."""
    anchor = START.clone().requires_grad_()
    sgd = torch.optim.SGD([anchor], lr=before[0], momentum=before[1], nesterov=before[1] > 0)
    anchor.grad = FIRST.clone()
    sgd.step()
    if not keep_buffer:
        sgd.state.clear()
    sgd.param_groups[0].update(lr=after[0], momentum=after[1], nesterov=after[1] > 0)
    anchor.grad = SECOND.clone()
    sgd.step()
    return anchor.detach()


@pytest.mark.parametrize(
    ("before", "after", "keep_buffer"),
    [(FEDAVG, NESTEROV, True), (NESTEROV, (0.5, 0.8), True), (NESTEROV, FEDAVG, False)],
    ids=["fedavg-to-nesterov", "nesterov-new-lr-and-momentum", "nesterov-to-fedavg"],
)
def test_outer_step_after_a_resume_uses_the_new_hyperparameters(before, after, keep_buffer):
    resumed = resumed_anchor(before, after)
    expected = reference_anchor(before, after, keep_buffer)
    assert torch.equal(resumed.anchor[0], expected), f"{resumed.anchor[0]} != {expected}"
    group = resumed.optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (*after, after[1] > 0)
    assert bool(resumed.optimizer.state) == (after[1] > 0)  # fedavg keeps no buffer to resurrect later


def test_fedavg_to_nesterov_starts_the_momentum_from_zero():
    """Spelled out: the first Nesterov step on mean Δ g moves the anchor by lr·(1 + momentum)·g."""
    resumed = resumed_anchor(FEDAVG, NESTEROV)
    anchor_at_resume = START - FIRST
    expected = anchor_at_resume - 0.7 * (SECOND + 0.9 * SECOND)
    torch.testing.assert_close(resumed.anchor[0], expected, atol=1e-7, rtol=0, msg=lambda m: f"anchor: {m}")


def test_changes_are_said_with_their_effect_on_the_momentum():
    fedavg = AveragingSettings()
    nesterov = AveragingSettings("nesterov", 0.7, 0.9, "bfloat16")
    assert fedavg.changes_to(nesterov) == (
        "fed_outer_optimizer fedavg → nesterov, fed_outer_lr 1.0 → 0.7, fed_outer_momentum 0.0 → 0.9, "
        "fed_sync_dtype float32 → bfloat16, the outer momentum starts from zero"
    )
    assert nesterov.changes_to(fedavg).endswith("the outer momentum buffer is dropped")
    retuned = AveragingSettings("nesterov", 0.5, 0.9, "bfloat16")
    assert nesterov.changes_to(retuned) == "fed_outer_lr 0.7 → 0.5, the outer momentum buffer is kept"
    assert fedavg.changes_to(AveragingSettings(sync_dtype="int8")) == "fed_sync_dtype float32 → int8"


def test_the_card_says_what_ran_in_each_stretch_of_the_run():
    history = [(0, AveragingSettings()), (4, AveragingSettings("nesterov", 0.7, 0.9, "float32"))]
    assert history_from_state(history_to_state(history)) == history
    assert describe_history(history[:1]) == "FedAvg, Δ sent in float32"
    assert averaging_description(history[:1], Schedule(8)) == "FedAvg, Δ sent in float32, blocking"
    assert averaging_description(history, Schedule(8, 2, 1)) == (
        "FedAvg, Δ sent in float32 (steps 0–4); Nesterov outer SGD (lr 0.7, momentum 0.9), Δ sent in float32 "
        "(from step 4); 2 fragment(s), each exchange 1 step(s) behind training"
    )


def test_a_checkpoint_without_the_record_is_read_off_its_outer_optimizer():
    nesterov = OuterOptimizer([START.clone()], 0.5, 0.8)
    fedavg = OuterOptimizer([START.clone()])
    assert settings_of_outer_state({"fragments": [nesterov.state_dict()]}, "int8") == AveragingSettings(
        "nesterov", 0.5, 0.8, "int8"
    )
    assert settings_of_outer_state({"fragments": [fedavg.state_dict()]}, "float32") == AveragingSettings()

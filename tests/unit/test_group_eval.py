"""Per-group evaluation (`fed_eval_per_group`) in process: the batches of each rank, and the plot's lines."""

from __future__ import annotations

import pytest

from hf_fedshard.integrations.card import _curves
from hf_fedshard.integrations.group_eval import rank_batches


@pytest.mark.parametrize(("num_samples", "world", "batch_size"), [(24, 2, 4), (25, 2, 4), (3, 4, 2), (9, 4, 4)])
def test_rank_batches_cover_every_sample_once_with_equal_forward_counts(num_samples, world, batch_size):
    shares = [rank_batches(num_samples, rank, world, batch_size) for rank in range(world)]
    assert sorted(i for share in shares for batch in share for i in batch) == list(range(num_samples))
    assert len({len(share) for share in shares}) == 1
    assert all(len(batch) <= batch_size for share in shares for batch in share)


def test_plot_has_one_eval_line_per_group_and_one_for_the_global_model():
    history = [
        {"step": 2, "eval_loss": 4.0, "eval_perplexity": 54.6, "eval_group0_perplexity": 60.0,
         "eval_group10_perplexity": 62.0, "eval_group1_perplexity": 61.0},
        {"step": 2, "loss": 4.2},
    ]  # fmt: skip
    curves = _curves(history)
    groups = [f"group {g} (before averaging)" for g in (0, 1, 10)]
    assert list(curves["eval perplexity"]) == ["global model", *groups]
    assert curves["eval perplexity"]["group 1 (before averaging)"] == [(2, 61.0)]

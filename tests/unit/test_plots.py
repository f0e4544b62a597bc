"""Log axes label the range a curve ends in (the Quickstart's perplexity, 497.7 → 227.6, and a wider one)."""

from __future__ import annotations

import matplotlib.pyplot as plt  # headless: Agg
import pytest

from hf_fedshard.tools.plots import label_log_axis


def labels(values: list[float]) -> list[str]:
    fig, ax = plt.subplots()
    ax.plot(range(len(values)), values, marker="o")
    ax.set_yscale("log")
    label_log_axis(ax)
    fig.canvas.draw()
    low, high = ax.get_ylim()
    shown = [t.get_text() for t in ax.get_yticklabels() if t.get_text() and low <= t.get_position()[1] <= high]
    assert not [t.get_text() for t in ax.get_yticklabels(minor=True) if t.get_text()]
    plt.close(fig)
    return shown


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([497.7, 331.1, 261.6, 232.2, 227.6], ["250", "300", "350", "400", "450", "500"]),  # the Quickstart's
        ([8366.0, 3805.0, 799.4, 377.4], ["500", "1,000", "2,000", "5,000"]),  # the SFT recipe's, over a decade
    ],
)
def test_log_axis_labels_plain_numbers_near_the_end_of_the_curve(values, expected):
    assert labels(values) == expected

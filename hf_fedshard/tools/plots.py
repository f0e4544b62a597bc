"""Axes a reader can read: tick labels on a log axis whatever range the curve ends in.

Matplotlib's log axis labels only powers of ten and, as minor labels, some of ``k·10^n``: a perplexity curve that
ends between two labelled ticks (227 on an axis labelled 3×10² and 5×10²) shows no value over its final stretch.
"""

from __future__ import annotations

import numpy as np
from matplotlib import ticker
from matplotlib.axes import Axes

DECADE_STEPS = (1.0, 2.0, 5.0)  # labelled ticks per decade when the axis spans one or more


class ReadableLogLocator(ticker.Locator):
    """Ticks of a log axis: 1-2-5 in every decade over a wide range, evenly spaced round values (250, 300, …)
    within a narrow one, so some labelled tick always lies near the curve's end."""

    def __init__(self, bins: int = 6) -> None:
        self.bins = bins

    def __call__(self) -> np.ndarray:
        low, high = self.axis.get_view_interval()
        return self.tick_values(low, high)

    def tick_values(self, vmin: float, vmax: float) -> np.ndarray:
        low, high = sorted((vmin, vmax))
        if low <= 0:
            return ticker.LogLocator().tick_values(max(low, 1e-300), high)
        if high / low < 10:
            ticks = ticker.MaxNLocator(self.bins, steps=[1, 2, 2.5, 5, 10]).tick_values(low, high)
            return ticks[ticks > 0]
        return ticker.LogLocator(subs=DECADE_STEPS).tick_values(low, high)


def label_log_axis(ax: Axes) -> None:
    """Give ``ax``'s (log) y axis plain-number labels on `ReadableLogLocator`'s ticks; minor ticks stay unlabelled
    (their default labels, ``2×10²``, would crowd the major ones)."""
    ax.yaxis.set_major_locator(ReadableLogLocator())
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:,.6g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())

"""abs-max trend across batches, from ``history()``: where values start to drift before a NaN."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .common import limit_lines, module_label, new_figure

__all__ = ["plot_history", "largest_modules"]


def largest_modules(history: pd.DataFrame, count: int = 5) -> list[str]:
    """The ``count`` modules with the largest abs max, then any that went non-finite."""
    if history.empty:
        return []
    peak = history.groupby("module", sort=False)["abs_max"].max()
    ranked = list(peak.sort_values(ascending=False, na_position="last").index[:count])
    bad = history[history["nonfinite"].astype(bool)]
    if not bad.empty:
        # The first batch that went bad; its first named module (the root only if alone).
        first = bad[bad["batch"] == bad["batch"].min()]["module"].tolist()
        named = [m for m in first if m] or first
        if named[0] not in ranked:
            ranked.append(named[0])
    return ranked


def plot_history(history: pd.DataFrame, modules: Sequence[str] | None = None, *,
                 dtype: torch.dtype | str | None = None, count: int = 5,
                 title: str | None = None) -> Figure:
    """abs max per batch for ``modules`` (default: the ``count`` largest), log scale.

    A row covering a window of merged batches (``batch`` < ``batch_end``, the history's bounded
    memory) is drawn as a horizontal bar over that range at its maximum, joined to its
    neighbours at the window's middle. Batches where a module's output held a NaN/Inf are red
    crosses along the top. ``dtype`` draws that dtype's largest value as a dashed line.
    """
    figure, ax = new_figure()
    ax.set_xlabel("batch")
    ax.set_ylabel("abs max of outputs")
    ax.set_title(title or "abs max across batches", y=1.0, pad=4)
    ax.set_yscale("log")
    chosen = list(modules) if modules is not None else largest_modules(history, count)
    table = history[history["module"].isin(chosen)] if not history.empty else history
    if table.empty:
        ax.text(0.5, 0.5, "no history to plot", ha="center", va="center", transform=ax.transAxes)
        return figure

    plotted = np.empty(0)
    for module in chosen:
        rows = table[table["module"] == module].sort_values("batch")
        if rows.empty:
            continue
        start = rows["batch"].to_numpy(dtype=np.float64)
        end = rows["batch_end"].to_numpy(dtype=np.float64)
        values = rows["abs_max"].to_numpy(dtype=np.float64)
        values = np.where(values > 0, values, np.nan)  # log scale: zero has no place
        middle = (start + end) / 2
        (line,) = ax.plot(middle, values, marker="." if len(rows) <= 200 else None,
                          linewidth=1.2, label=module_label(module))
        windows = end > start
        if windows.any():
            ax.hlines(values[windows], start[windows], end[windows], colors=line.get_color(),
                      linewidth=3, alpha=0.5)
        bad = rows["nonfinite"].to_numpy(dtype=bool)
        if bad.any():
            ax.plot(middle[bad], np.full(int(bad.sum()), 0.97), "x", color="red",
                    transform=ax.get_xaxis_transform())
        plotted = np.concatenate([plotted, values])
    if table["nonfinite"].astype(bool).any():
        first = float(table.loc[table["nonfinite"].astype(bool), "batch"].min())
        ax.axvline(first, color="red", linewidth=1, label=f"first NaN/Inf (batch {first:.0f})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if dtype is not None:
        limit_lines(ax, [str(dtype).replace("torch.", "")], plotted)
    ax.legend(loc="lower left", fontsize=7)
    return figure

"""abs-max trend across batches, from ``history()``: where values start to drift before a NaN."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .common import (fit_inside, limit_lines, new_figure, outside_legend, readable_log_ticks,
                     say_nothing_to_plot, short_label)

__all__ = ["plot_history", "largest_modules", "neighbour_modules", "first_bad_module"]


def largest_modules(history: pd.DataFrame, count: int = 5) -> list[str]:
    """The ``count`` modules with the largest abs max, then any that went non-finite."""
    if history.empty:
        return []
    peak = history.groupby("module", sort=False)["abs_max"].max()
    ranked = list(peak.sort_values(ascending=False, na_position="last").index[:count])
    first = first_bad_module(history)
    if first is not None and first not in ranked:
        ranked.append(first)
    return ranked


def first_bad_module(history: pd.DataFrame) -> str | None:
    """A module whose outputs went non-finite in the first bad batch (a named one if any)."""
    if history.empty:
        return None
    bad = history[history["nonfinite"].astype(bool)]
    if bad.empty:
        return None
    first = bad[bad["batch"] == bad["batch"].min()]["module"].tolist()
    named = [m for m in first if m] or first
    return str(named[0])


def neighbour_modules(history: pd.DataFrame, module: str, count: int = 5) -> list[str]:
    """``module`` and the modules next to it in the model's order: up to ``count`` in all.

    The order is that of ``history()`` (the model's ``named_modules()``). The root module is
    left out unless it is ``module`` itself: its trend is the maximum of all the others.
    """
    order = [str(m) for m in pd.unique(history["module"])] if not history.empty else []
    if module not in order:
        return [module] if module else []
    others = [m for m in order if m or m == module]
    at = others.index(module)
    before = max(0, min(at - (count - 1) // 2, len(others) - count))
    return others[before:before + count]


WARNING_COLOR = "darkorange"


def _warnings_table(warnings: Sequence[Any] | pd.DataFrame | None) -> pd.DataFrame:
    """Early warnings (``w.warnings`` or a DataFrame of them) as a table: batch, module,
    abs_max, reason."""
    table = warnings if isinstance(warnings, pd.DataFrame) else pd.DataFrame(list(warnings or []))
    if table.empty or not {"batch", "module", "abs_max"} <= set(table.columns):
        return pd.DataFrame(columns=["batch", "module", "abs_max", "reason"])
    return table


def plot_history(history: pd.DataFrame, modules: Sequence[str] | None = None, *,
                 dtype: torch.dtype | str | None = None, count: int = 5,
                 title: str | None = None, around: str | None = None,
                 warnings: Sequence[Any] | pd.DataFrame | None = None) -> Figure:
    """abs max per batch of module outputs, log scale.

    Modules drawn: ``modules`` when given; else ``around`` (e.g. the event's module) and its
    neighbours; else, when some output went non-finite, that module and its neighbours; else
    the ``count`` largest. A row covering a window of merged batches (``batch`` < ``batch_end``,
    the history's bounded memory) is drawn as a horizontal bar over that range at its maximum,
    joined to its neighbours at the window's middle. Batches where a module's output held a
    NaN/Inf are red triangles along the top. ``dtype`` draws that dtype's largest value as a
    dashed line. ``warnings`` (``w.warnings``): each early warning on a drawn module is an
    orange ring at its batch and value, and the first one a dotted orange line.
    """
    figure, ax = new_figure()
    if modules is not None:
        chosen = list(modules)
    elif around is not None:
        chosen = neighbour_modules(history, around, count)
    elif (bad := first_bad_module(history)) is not None:
        chosen = neighbour_modules(history, bad, count)
    else:
        chosen = largest_modules(history, count)
    table = history[history["module"].isin(chosen)] if not history.empty else history
    if table.empty:
        say_nothing_to_plot(ax, "no history to plot" if history.empty
                            else "no module to plot: none matches")
        return figure

    ax.set_xlabel("batch")
    ax.set_ylabel("abs max of outputs")
    ax.set_title(title or "abs max of outputs across batches", pad=6, loc="left")
    ax.set_yscale("log")
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
        emphasis = dict(linewidth=2.2) if module == around else dict(linewidth=1.2)
        (line,) = ax.plot(middle, values, marker="." if len(rows) <= 200 else None,
                          label=short_label(module), **emphasis)
        windows = end > start
        if windows.any():
            ax.hlines(values[windows], start[windows], end[windows], colors=line.get_color(),
                      linewidth=3, alpha=0.5)
        bad = rows["nonfinite"].to_numpy(dtype=bool)
        if bad.any():
            ax.plot(middle[bad], np.full(int(bad.sum()), 0.965), "v", color="red", markersize=6,
                    clip_on=False, transform=ax.get_xaxis_transform())
        plotted = np.concatenate([plotted, values])
    early = _warnings_table(warnings)
    early = early[early["module"].isin(chosen)]
    if not early.empty:
        values = early["abs_max"].to_numpy(dtype=np.float64)
        ax.plot(early["batch"].to_numpy(dtype=np.float64), values, "o", markersize=9,
                markerfacecolor="none", markeredgecolor=WARNING_COLOR, markeredgewidth=2,
                label="early warning", zorder=5)
        first_warning = float(early["batch"].min())
        ax.axvline(first_warning, color=WARNING_COLOR, linestyle=":", linewidth=1.5,
                   label=f"first warning: batch {first_warning:.0f}")
        plotted = np.concatenate([plotted, values])
    if table["nonfinite"].astype(bool).any():
        first = float(table.loc[table["nonfinite"].astype(bool), "batch"].min())
        ax.axvline(first, color="red", linewidth=1, label=f"first NaN/Inf: batch {first:.0f}")
        ax.plot([], [], "v", color="red", markersize=6, label="NaN/Inf in outputs")
    if not np.isfinite(plotted).any():
        ax.set_ylim(0.1, 10)  # nothing finite to scale to: a sane empty range
    low, high = float(table["batch"].min()), float(table["batch_end"].max())
    pad = max(0.5, (high - low) * 0.03)
    ax.set_xlim(low - pad, high + pad)  # one batch: -0.5..0.5 around it, not ±0.045
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if dtype is not None:
        limit_lines(ax, [str(dtype).replace("torch.", "")], plotted)
    readable_log_ticks(ax)
    outside_legend(ax)
    fit_inside(figure)
    return figure

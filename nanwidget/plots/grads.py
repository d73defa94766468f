"""Gradient-norm trend plot from ``NanWatch.grad_history()``."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .common import (fit_inside, new_figure, outside_legend, readable_log_ticks,
                     say_nothing_to_plot, short_label)

__all__ = ["plot_grad_norms"]


def plot_grad_norms(grad_history: pd.DataFrame, *, top: int = 8, threshold: float | None = None,
                    ax: Axes | None = None) -> Figure:
    """Gradient norm per batch on a log scale: the ``top`` parameters with the largest norms.

    ``grad_history`` has the columns of ``NanWatch.grad_history()`` (``batch``, ``batch_end``,
    ``param``, ``norm``, ``nonfinite``); merged windows are drawn at their middle batch.
    Non-finite norms are marked with red crosses along the top edge, norms of exactly 0 (which
    a log axis cannot show: a parameter that got no gradient) with hollow circles along the
    bottom edge, named in the legend; ``threshold`` (e.g. the watch's ``grad_norm_warn``) is
    drawn as a dashed line. Draws into ``ax`` when given.
    """
    own_figure = ax is None
    if ax is None:
        figure, ax = new_figure()
    else:
        figure = ax.figure
    if grad_history is None or len(grad_history) == 0:
        say_nothing_to_plot(ax, "no gradient norms recorded yet\n"
                                "(call check_grad_norms() after backward)")
        return figure
    table = grad_history.copy()
    end = table["batch_end"] if "batch_end" in table else table["batch"]
    table["x"] = (table["batch"].astype(float) + end.astype(float)) / 2
    finite = table[np.isfinite(table["norm"].astype(float)) & (table["norm"] > 0)]
    ranking = finite.groupby("param")["norm"].max().sort_values(ascending=False)
    shown = list(ranking.index[:top])
    for param in shown:
        rows = finite[finite["param"] == param].sort_values("x")
        ax.plot(rows["x"], rows["norm"], label=short_label(param), linewidth=1.2)
    if len(ranking) > top:
        others = finite[~finite["param"].isin(shown)].groupby("x")["norm"].max()
        ax.plot(others.index, others.values, color="0.6", linewidth=0.8,
                label=f"max of {len(ranking) - top} other(s)")
    bad = table[table["nonfinite"].astype(bool)] if "nonfinite" in table else table.iloc[0:0]
    if threshold is not None and math.isfinite(threshold):
        ax.axhline(threshold, color="tab:orange", linestyle="--", linewidth=1,
                   label=f"threshold {threshold:g}")
    ax.set_yscale("log")
    if finite.empty and (threshold is None or not math.isfinite(threshold)):
        ax.set_ylim(0.1, 10)  # nothing to scale to: a sane empty range
    zero = table[table["norm"].astype(float) == 0]
    if len(zero):
        names = list(pd.unique(zero["param"]))
        named = ", ".join(short_label(str(name)) for name in names[:2])
        ax.scatter(zero["x"], np.zeros(len(zero)), transform=ax.get_xaxis_transform(),
                   marker="o", facecolors="none", edgecolors="tab:purple", clip_on=False,
                   zorder=5, label=f"norm 0: {named}" if len(names) <= 2
                   else f"norm 0: {named} and {len(names) - 2} more")
    if len(bad):
        ax.scatter(bad["x"], np.ones(len(bad)), transform=ax.get_xaxis_transform(),
                   marker="x", color="red", clip_on=False, zorder=5,
                   label=f"non-finite ({bad['param'].nunique()} parameter(s))")
    low, high = float(table["x"].min()), float(table["x"].max())
    pad = max(0.5, (high - low) * 0.02)
    ax.set_xlim(low - pad, high + pad)  # crosses use axes coordinates: keep their batches in view
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlabel("batch")
    ax.set_ylabel("gradient L2 norm")
    ax.set_title("Gradient norms per parameter", pad=6, loc="left")
    ax.grid(True, which="major", alpha=0.3)
    readable_log_ticks(ax)
    outside_legend(ax)
    if own_figure:
        fit_inside(figure)
    return figure

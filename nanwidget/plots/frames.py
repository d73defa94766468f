"""Magnitudes along the buffered frames: where values grow towards their dtype's limit."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .common import ROLE_GROUPS, frame_keys, limit_lines, module_label, new_figure, role_groups

__all__ = ["plot_frames"]


def _select_roles(frames: pd.DataFrame, roles: Iterable[str] | str | None) -> pd.DataFrame:
    """Keep rows whose role group ("weights", "inputs", ...) or exact role is in ``roles``."""
    if roles is None:
        return frames
    wanted = {roles} if isinstance(roles, str) else set(roles)
    groups = role_groups(frames)
    keep = groups.isin(wanted & set(ROLE_GROUPS)) | frames["role"].isin(wanted)
    return frames[keep.to_numpy()]


def plot_frames(frames: pd.DataFrame, *, roles: Iterable[str] | str | None = None,
                current: int | None = None, title: str | None = None) -> Figure:
    """abs max and abs min of each frame (in buffer order), on a log scale.

    One point per frame: the largest abs max and smallest non-zero abs min over its tensors
    (``roles`` narrows them to role groups "weights" / "inputs" / "outputs" / "grads" or exact
    role names such as "output"). Each float dtype's largest value is a dashed line, the first
    frame holding a NaN/Inf is marked with a red line and its non-finite frames with red
    crosses along the top. ``current`` (a position along the x axis) is shaded.
    """
    figure, ax = new_figure()
    selected = _select_roles(frames, roles)
    ax.set_xlabel("frame (buffer order)")
    ax.set_ylabel("|x|")
    ax.set_title(title or "abs max / abs min per frame", y=1.0, pad=4)
    if selected.empty:
        ax.text(0.5, 0.5, "no frames to plot", ha="center", va="center", transform=ax.transAxes)
        ax.set_yscale("log")
        return figure

    codes, first_rows = frame_keys(selected)
    n_frames = len(first_rows)
    # Per-frame reductions of values already in the table (max of maxima, min of non-zero minima).
    abs_max = selected["abs_max"].to_numpy(dtype=np.float64)
    abs_min = selected["abs_min"].to_numpy(dtype=np.float64)
    bad = (selected["nan"].to_numpy(dtype=bool) | selected["inf"].to_numpy(dtype=bool))
    frame_max = np.full(n_frames, np.nan)
    frame_min = np.full(n_frames, np.nan)
    with np.errstate(invalid="ignore"):
        finite_max = np.where(np.isfinite(abs_max), abs_max, -np.inf)
        maxima = np.full(n_frames, -np.inf)
        np.maximum.at(maxima, codes, finite_max)
        positive_min = np.where(np.isfinite(abs_min) & (abs_min > 0), abs_min, np.inf)
        minima = np.full(n_frames, np.inf)
        np.minimum.at(minima, codes, positive_min)
    frame_max[np.isfinite(maxima) & (maxima > 0)] = maxima[np.isfinite(maxima) & (maxima > 0)]
    frame_min[np.isfinite(minima)] = minima[np.isfinite(minima)]
    frame_bad = np.zeros(n_frames, dtype=bool)
    np.logical_or.at(frame_bad, codes, bad)

    x = np.arange(n_frames)
    marker = "." if n_frames <= 200 else None
    ax.plot(x, frame_max, marker=marker, color="tab:blue", label="abs max")
    ax.plot(x, frame_min, marker=marker, color="tab:green", alpha=0.7, label="abs min (non-zero)")
    ax.set_yscale("log")

    module_names = selected["module"].to_numpy(dtype=object)[first_rows]
    labels = [module_label(str(name)) for name in module_names]
    if n_frames <= 30:
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)

    limit_lines(ax, selected["dtype"].unique(), frame_max)
    if frame_bad.any():
        first = int(np.argmax(frame_bad))
        ax.axvline(first, color="red", linewidth=1.5,
                   label=f"first NaN/Inf: {labels[first]}")
        ax.plot(x[frame_bad], np.full(int(frame_bad.sum()), 0.97), "x", color="red",
                transform=ax.get_xaxis_transform(), label="non-finite frame")
    if current is not None and 0 <= current < n_frames:
        ax.axvspan(current - 0.5, current + 0.5, color="orange", alpha=0.2, label="current frame")
    ax.legend(loc="lower left", fontsize=7)
    return figure

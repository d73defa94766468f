"""Magnitudes along the buffered frames: where values grow towards their dtype's limit."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from ..core.schema import role_group
from .common import (FONT_SIZE, ROLE_GROUPS, SCREEN_DPI, fit_inside, frame_keys, limit_lines,
                     new_figure, outside_legend, readable_log_ticks, role_groups,
                     say_nothing_to_plot, short_label)

__all__ = ["plot_frames", "frame_window", "frame_name", "DEFAULT_WINDOW"]

DEFAULT_WINDOW = 40  # frames drawn at most; more are shown as a window around the current one
_TICK_FONT = FONT_SIZE - 1.5
# CSS pixels between ticks that module names need: slanted at 60° (easier to read), or upright.
# A name in the tick font is about 9.1 CSS px from the top of an "M" to the foot of a "g":
# neighbours need that and 15 % more across the text to read apart.
_SLANTED_SPACING = 12.5
_UPRIGHT_SPACING = 10.5
_TICK_CHARS = 16  # longest module name under a tick ...
_ROOMY_TICK_CHARS = 22  # ... and under ticks far apart (a few frames)
_ROOMY_SPACING = 40.0


def frame_name(batch: object, frame: object, rank: object = None) -> str:
    """A frame as the DataFrame names it: "batch 3, frame 2" (the ``frame`` column counts the
    hooks of its batch), with the rank in front when there are several: "rank 1, batch 3, ..."."""
    where = f"batch {batch}, frame {frame}"
    return f"rank {rank}, {where}" if rank is not None else where


def _select_roles(frames: pd.DataFrame, roles: Iterable[str] | str | None) -> pd.DataFrame:
    """Keep rows whose role group ("weights", "inputs", ...) or exact role is in ``roles``."""
    if roles is None:
        return frames
    wanted = {roles} if isinstance(roles, str) else set(roles)
    groups = role_groups(frames)
    keep = groups.isin(wanted & set(ROLE_GROUPS))
    for name in wanted - set(ROLE_GROUPS):
        # A parameter's name ("weight") is also the role of its gradient in a backward frame:
        # the name picks the rows of its own group, the weight's values, not its gradient.
        keep |= (frames["role"] == name) & (groups == role_group(name))
    return frames[keep.to_numpy()]


def frame_window(n_frames: int, current: int | None, window: int | None,
                 anchor: int | None = None) -> tuple[int, int]:
    """First and last frame number (1-based, inclusive) drawn for ``n_frames`` frames.

    All of them when they fit in ``window``; otherwise ``window`` frames centred on ``current``
    (or on ``anchor``, e.g. the first non-finite frame, or else the last frames).
    """
    if window is None or n_frames <= window:
        return 1, n_frames
    centre = current if current is not None else anchor if anchor is not None else n_frames
    first = int(np.clip(centre - window // 2, 1, n_frames - window + 1))
    return first, first + window - 1


def plot_frames(frames: pd.DataFrame, *, roles: Iterable[str] | str | None = None,
                current: int | None = None, title: str | None = None,
                window: int | None = DEFAULT_WINDOW, focus: int | None = None) -> Figure:
    """abs max and abs min of each frame on a log scale, one after the other in buffer order.

    One point per frame: the largest abs max and smallest non-zero abs min over its tensors
    (``roles`` narrows them to role groups "weights" / "inputs" / "outputs" / "grads" or exact
    role names such as "output"). A frame holding a NaN/Inf has no finite maximum to draw: it is
    marked with a red triangle along the top (with, when the frames carry ``finite_abs_max``, a
    hollow circle at its largest finite value), never drawn as a dip. Each float dtype's largest
    value is a dashed line, the first non-finite frame a red line, batch boundaries dotted lines
    labelled along the top. Each tick names the frame's module where there is room, else its
    ``frame`` number within the batch (the DataFrame's numbering). On the x axis frame number N
    means the Nth frame of ``frames`` (1-based; ``axes.get_xlim()`` is in these units):
    ``current`` (such a number) is shaded. With more than ``window`` frames, only a window of
    that many around ``current`` (or ``focus``, a frame to centre on without shading it; else
    the first non-finite frame) is drawn (``window=None``: all).
    """
    figure, ax = new_figure(bottom=0.8)
    selected = _select_roles(frames, roles)
    if selected.empty:
        say_nothing_to_plot(ax, "no frames to plot" if frames.empty
                            else "no frames with these roles")
        return figure

    codes, first_rows = frame_keys(selected)
    n_frames = len(first_rows)
    abs_max = selected["abs_max"].to_numpy(dtype=np.float64)
    abs_min = selected["abs_min"].to_numpy(dtype=np.float64)
    bad = selected["nan"].to_numpy(dtype=bool) | selected["inf"].to_numpy(dtype=bool)
    frame_bad = np.zeros(n_frames, dtype=bool)
    np.logical_or.at(frame_bad, codes, bad)
    with np.errstate(invalid="ignore"):
        maxima = np.full(n_frames, -np.inf)
        np.maximum.at(maxima, codes, np.where(np.isfinite(abs_max), abs_max, -np.inf))
        minima = np.full(n_frames, np.inf)
        np.minimum.at(minima, codes, np.where(np.isfinite(abs_min) & (abs_min > 0), abs_min, np.inf))
    frame_max = np.where(np.isfinite(maxima) & (maxima > 0), maxima, np.nan)
    frame_max[frame_bad] = np.nan  # its largest value is not finite: no point, no dip
    frame_min = np.where(np.isfinite(minima), minima, np.nan)
    finite_part = np.full(n_frames, np.nan)
    if "finite_abs_max" in selected.columns and frame_bad.any():
        finite_max = selected["finite_abs_max"].to_numpy(dtype=np.float64)
        with np.errstate(invalid="ignore"):
            best = np.full(n_frames, -np.inf)
            np.maximum.at(best, codes, np.where(np.isfinite(finite_max), finite_max, -np.inf))
        finite_part = np.where(frame_bad & np.isfinite(best) & (best > 0), best, np.nan)

    numbers = np.arange(1, n_frames + 1)
    bad_numbers = numbers[frame_bad]
    first_bad = int(bad_numbers[0]) if bad_numbers.size else None
    low, high = frame_window(n_frames, current if current is not None else focus, window,
                             anchor=first_bad)
    shown = slice(low - 1, high)
    x = numbers[shown]
    marker = "." if len(x) <= 200 else None
    ax.plot(x, frame_max[shown], marker=marker, color="tab:blue", label="abs max")
    ax.plot(x, frame_min[shown], marker=marker, color="tab:green", alpha=0.7,
            label="abs min (≠ 0)")
    ax.set_yscale("log")
    ax.set_xlim(low - 0.5, high + 0.5)

    module_names = selected["module"].to_numpy(dtype=object)[first_rows]
    frame_numbers = selected["frame"].to_numpy()[first_rows]
    box = ax.get_position()
    spacing = box.width * figure.get_figwidth() * SCREEN_DPI / len(x)  # CSS px per frame
    if spacing >= _UPRIGHT_SPACING:
        slanted = spacing >= _SLANTED_SPACING
        ax.set_xticks(x)
        placing = dict(rotation=60, ha="right", rotation_mode="anchor") if slanted \
            else dict(rotation=90, ha="center")
        chars = _ROOMY_TICK_CHARS if spacing >= _ROOMY_SPACING else _TICK_CHARS
        ax.set_xticklabels([short_label(str(name), chars) for name in module_names[shown]],
                           fontsize=_TICK_FONT, **placing)
        ax.set_xlabel("frames: the module each one recorded", labelpad=2)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_major_formatter(FuncFormatter(
            lambda value, _: str(frame_numbers[int(value) - 1])
            if value == int(value) and 1 <= value <= n_frames else ""))
        ax.set_xlabel("frame (hook order within its batch)")
    ax.set_ylabel("|x|")
    if low > 1 or high < n_frames:
        batches = selected["batch"].to_numpy()[first_rows][shown]
        span = f"batch {batches[0]}" if batches[0] == batches[-1] else \
            f"batches {batches[0]}–{batches[-1]}"
        title = f"{title or 'abs max / abs min per frame'}  ({high - low + 1} of {n_frames} " \
                f"frames: {span})"
    ax.set_title(title or "abs max / abs min per frame", pad=14, loc="left")

    _batch_boundaries(ax, selected, first_rows, low, high)
    limit_lines(ax, selected["dtype"].unique(), frame_max)
    shown_bad = bad_numbers[(bad_numbers >= low) & (bad_numbers <= high)]
    if first_bad is not None:
        at = first_rows[first_bad - 1]
        ranks = selected["rank"].nunique() > 1 if "rank" in selected.columns else False
        where = frame_name(selected["batch"].iloc[at], selected["frame"].iloc[at],
                           selected["rank"].iloc[at] if ranks else None)
        label = f"first NaN/Inf:\n{where}\n{short_label(str(module_names[first_bad - 1]))}"
        if low <= first_bad <= high:
            ax.axvline(first_bad, color="red", linewidth=1.5, label=label)
        else:
            side = "→" if first_bad > high else "←"
            ax.plot([], [], color="red", linewidth=1.5, label=f"{label} {side}")
    if shown_bad.size:
        ax.plot(shown_bad, np.full(shown_bad.size, 0.965), "v", color="red", markersize=6,
                clip_on=False, transform=ax.get_xaxis_transform(), label="NaN/Inf frame")
        in_part = finite_part[shown_bad - 1]
        if np.isfinite(in_part).any():
            ax.plot(shown_bad, in_part, "o", markerfacecolor="none", color="red", markersize=5,
                    label="its largest finite |x|")
    if current is not None and low <= current <= high:
        ax.axvspan(current - 0.5, current + 0.5, color="orange", alpha=0.25, label="current frame")
    readable_log_ticks(ax)
    outside_legend(ax)
    fit_inside(figure)
    return figure


def _batch_boundaries(ax, selected: pd.DataFrame, first_rows: np.ndarray, low: int,
                      high: int) -> None:
    """Dotted lines where the batch (or rank, or phase) changes; each stretch labelled on top."""
    columns = [c for c in ("rank", "batch", "phase") if c in selected.columns]
    keys = list(zip(*(selected[c].to_numpy()[first_rows][low - 1:high].tolist() for c in columns)))
    if not keys:
        return
    ranks = {key[0] for key in keys} if "rank" in columns else {0}
    bbox = ax.get_position()
    frame_px = (bbox.x1 - bbox.x0) * ax.figure.get_figwidth() * SCREEN_DPI / (high - low + 1)
    char_px = FONT_SIZE * 0.8  # a label character in CSS pixels, about
    starts = [0] + [i for i in range(1, len(keys)) if keys[i] != keys[i - 1]]
    ends = starts[1:] + [len(keys)]
    transform = ax.get_xaxis_transform()
    for start, end in zip(starts, ends):
        if start:
            ax.axvline(low + start - 0.5, color="0.45", linestyle=":", linewidth=1)
        values = dict(zip(columns, keys[start]))
        text = f"batch {values.get('batch', '?')}"
        if values.get("phase") == "backward":
            text += " bwd"
        if len(ranks) > 1:
            text = f"r{values.get('rank')} {text}"
        room = (end - start) * frame_px
        if room < (len(text) + 1) * char_px:
            text = text.replace("batch ", "b").replace(" bwd", "↩")
        if room < (len(text) + 0.5) * char_px:
            continue
        ax.text(low + (start + end - 1) / 2, 1.01, text, transform=transform, ha="center",
                va="bottom", fontsize=FONT_SIZE - 1.5, color="0.3", clip_on=False)

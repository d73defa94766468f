"""Pieces shared by the plots: figures without pyplot, frame keys, dtype limit lines."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..core.schema import ROLE_GROUPS, role_groups
from ..core.stats import dtype_max

__all__ = ["ROLE_GROUPS", "role_groups", "frame_keys", "limit_lines", "module_label",
           "new_figure", "figure_png", "NotebookFigure"]

FRAME_KEY = ["rank", "batch", "phase", "frame"]


class NotebookFigure(Figure):
    """A matplotlib Figure that shows itself as PNG in a notebook (``_repr_png_``) without
    pyplot: no global figure list, nothing to close, nothing registered with IPython."""

    def _repr_png_(self) -> bytes:
        return figure_png(self)


def new_figure(width: float = 7.0, height: float = 3.4) -> tuple[Figure, Axes]:
    """A figure not registered with pyplot: no global state, nothing to close, Agg-safe.

    Fixed margins rather than constrained layout: layout solving costs more than drawing.
    """
    figure = NotebookFigure(figsize=(width, height))
    figure.subplots_adjust(left=0.1, right=0.98, top=0.9, bottom=0.24)
    return figure, figure.add_subplot()


def figure_png(figure: Figure, dpi: int = 90) -> bytes:
    """PNG bytes of ``figure`` (for image widgets and files)."""
    import io
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def module_label(name: str) -> str:
    """The root module has the empty name; show it as users read it."""
    return name if name else "<root>"


def frame_keys(frames: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Frame number of each row (in order of first appearance) and each frame's first row."""
    keys = [column for column in FRAME_KEY if column in frames.columns]
    codes = frames.groupby(keys, sort=False).ngroup().to_numpy()
    _, first_rows = np.unique(codes, return_index=True)
    return codes, first_rows


def limit_lines(ax: Axes, dtypes: Iterable[object], values: np.ndarray) -> None:
    """A dashed line at each float dtype's largest value that is within reach of ``values``.

    A float32 limit (3.4e38) would squash a plot of values near 1, so a limit is drawn only when
    the data come within 30 decades of it; float16 and bfloat16-sized limits always show.
    """
    finite = values[np.isfinite(values) & (values > 0)]
    top = float(finite.max()) if finite.size else 1.0
    styles = ("--", "-.", ":")
    far: list[str] = []
    for position, dtype in enumerate(sorted({str(d) for d in dtypes if d})):
        limit = dtype_max(dtype)
        if not np.isfinite(limit):
            continue
        decades = np.log10(limit) - np.log10(top)
        if decades > 30:
            far.append(f"{dtype} max {limit:.3g}: {decades:.0f} decades above")
            continue
        ax.axhline(limit, color="black", linestyle=styles[position % len(styles)], linewidth=1,
                   label=f"{dtype} max ({limit:.6g})")
    if far:
        ax.text(0.99, 0.02, "\n".join(far), ha="right", va="bottom", fontsize=7,
                color="dimgray", transform=ax.transAxes)

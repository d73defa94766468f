"""Pieces shared by the plots: figures without pyplot, HiDPI output, legends, frame keys."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from ..core.report import printable
from ..core.schema import ROLE_GROUPS, role_groups
from ..core.stats import dtype_max

__all__ = ["ROLE_GROUPS", "SCREEN_DPI", "HIDPI_SCALE", "role_groups", "frame_keys", "limit_lines",
           "module_label", "short_label", "new_figure", "fit_inside", "figure_png",
           "display_width", "outside_legend", "say_nothing_to_plot", "readable_log_ticks", "NotebookFigure"]

FRAME_KEY = ["rank", "batch", "phase", "frame"]

# A figure is laid out for SCREEN_DPI pixels per inch of CSS width and drawn at HIDPI_SCALE times
# that: sharp on HiDPI screens, the same size on the page as a 1x drawing.
SCREEN_DPI = 90
HIDPI_SCALE = 2
FONT_SIZE = 9.0  # points: 11 CSS px at SCREEN_DPI
LEGEND_WIDTH = 1.85  # inches kept right of the axes for the legend
LABEL_CHARS = 20  # longest module name shown whole in a legend or tick label


# A dark JupyterLab (or VS Code) theme turns a figure light: each colour keeps its hue, dark and
# light swap, and the transparent background shows the theme's own.
_DARK_FIGURE_STYLE = (
    "<style>body[data-jp-theme-light='false'] img.nw-figure, body.vscode-dark img.nw-figure, "
    "body.vscode-high-contrast img.nw-figure {filter: invert(1) hue-rotate(180deg); "
    "background: transparent !important}</style>")


class NotebookFigure(Figure):
    """A matplotlib Figure that shows itself in a notebook without pyplot: no global figure
    list, nothing to close, nothing registered with IPython.

    The PNG is drawn at HIDPI_SCALE and shown at the figure's own size (as the inline
    backend's "retina" format does): sharp on HiDPI screens. Where HTML is shown (JupyterLab,
    VS Code) the figure follows the theme: drawn on a transparent background, turned light on
    a dark theme; its inline white background stays where a sanitizer strips the style. Plain
    PNG (``image/png``) is the same drawing on white.
    """

    def _display_size(self) -> dict[str, int]:
        width, height = self.get_size_inches()
        return {"width": round(width * SCREEN_DPI), "height": round(height * SCREEN_DPI)}

    def _repr_png_(self) -> tuple[bytes, dict[str, int]]:
        return figure_png(self), self._display_size()

    def _repr_mimebundle_(self, include: object = None,
                          exclude: object = None) -> tuple[dict[str, object], dict[str, object]]:
        size = self._display_size()
        drawn = figure_png(self, transparent=True)
        html = (f"{_DARK_FIGURE_STYLE}<img class='nw-figure' alt='nanwidget plot' "
                f"width='{size['width']}' height='{size['height']}' style='background:#fff' "
                f"src='data:image/png;base64,{base64.b64encode(drawn).decode('ascii')}'>")
        return {"image/png": _on_white(drawn), "text/html": html}, {"image/png": size}


def new_figure(width: float = 6.0, height: float = 3.0, *, bottom: float = 0.55,
               top: float = 0.42, legend: bool = True) -> tuple[Figure, Axes]:
    """A figure not registered with pyplot: no global state, nothing to close, Agg-safe.

    Margins are fixed in inches (not constrained layout, which costs more than drawing): room
    for the y label on the left, ``bottom`` for tick labels, ``top`` for the title, and with
    ``legend`` a column on the right so that the legend never covers data.
    """
    figure = NotebookFigure(figsize=(width, height))
    FigureCanvasAgg(figure)  # a renderer to measure text with (fit_inside), no pyplot
    right = LEGEND_WIDTH if legend else 0.2
    figure.subplots_adjust(left=0.72 / width, right=1 - right / width,
                           top=1 - top / height, bottom=bottom / height)
    ax = figure.add_subplot()
    ax.tick_params(labelsize=FONT_SIZE - 0.5)
    ax.xaxis.label.set_size(FONT_SIZE)
    ax.yaxis.label.set_size(FONT_SIZE)
    ax.title.set_size(FONT_SIZE + 0.5)
    return figure, ax


def fit_inside(figure: Figure, pad: float = 0.06, keep_axes: float = 0.6) -> None:
    """Make room for every text that sticks out of the figure (long tick labels, a wide
    legend, labels above the axes), so that nothing is cut when it is saved or shown.

    The figure keeps its width where it can (a page lays it out at that width): the axes give
    up what the sides need, down to ``keep_axes`` of their width; only beyond that does the
    figure grow wider. It grows taller for what sticks out at the top or the bottom.
    """
    renderer = figure.canvas.get_renderer()
    box = figure.get_tightbbox(renderer)  # inches
    width, height = figure.get_size_inches()
    left, bottom = -box.x0, -box.y0
    right, top = box.x1 - width, box.y1 - height
    left, bottom, right, top = (side + pad if side > 0 else 0.0
                                for side in (left, bottom, right, top))
    if not (left or bottom or right or top):
        return
    new_height = height + bottom + top
    for ax in figure.axes:
        place = ax.get_position()
        axes_width = place.width * width
        narrower = max(axes_width - left - right, keep_axes * axes_width)
        new_width = max(width, width + (left + right) - (axes_width - narrower))
        ax.set_position([(place.x0 * width + left) / new_width,
                         (place.y0 * height + bottom) / new_height,
                         narrower / new_width, place.height * height / new_height])
    figure.set_size_inches(new_width, new_height)


def figure_png(figure: Figure, dpi: int = SCREEN_DPI * HIDPI_SCALE, *,
               transparent: bool = False) -> bytes:
    """PNG bytes of ``figure``, drawn for HiDPI screens by default (show it at display_width).

    ``transparent``: no background, for pages that colour it themselves (the FrameBrowser
    follows the JupyterLab theme this way)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, facecolor="none" if transparent else "white",
                   transparent=transparent)
    return buffer.getvalue()


def _on_white(png: bytes) -> bytes:
    """A transparent PNG laid on white (cheaper than drawing the figure again)."""
    from PIL import Image  # matplotlib's own dependency
    picture = Image.open(io.BytesIO(png)).convert("RGBA")
    white = Image.new("RGBA", picture.size, (255, 255, 255, 255))
    buffer = io.BytesIO()
    Image.alpha_composite(white, picture).convert("RGB").save(buffer, format="png")
    return buffer.getvalue()


def display_width(figure: Figure) -> int:
    """CSS pixels the figure's PNG should take on the page (its drawing is HIDPI_SCALE wider)."""
    return round(figure.get_figwidth() * SCREEN_DPI)


def module_label(name: str) -> str:
    """The root module has the empty name; show it as users read it."""
    return name if name else "<root>"


def short_label(name: str, limit: int = LABEL_CHARS) -> str:
    """A module label of at most ``limit`` characters, as matplotlib text. A longer one keeps
    its start (which part of the model) and its end (the most specific part) with "…" between
    them, the end starting at a whole name where it can: "transformer.h.0.mlp.c_fc" ->
    "transfo…h.0.mlp.c_fc". A ``$`` in a name is shown, never read as mathtext, and control
    characters are written as escapes.
    """
    label = printable(module_label(name), keep_newlines=False)  # no control characters
    if len(label) > limit:
        keep = limit - 1  # characters besides the "…"
        end = label[-(keep - max(4, keep // 3)):]  # at least 4 characters of the start stay
        dot = end.find(".")
        if 0 <= dot <= len(end) // 3 and dot < len(end) - 1:
            end = end[dot + 1:]  # "rs.0.norm2" -> "0.norm2": no broken name at the cut
        label = label[:keep - len(end)] + "…" + end
    return label.replace("$", r"\$")


def outside_legend(ax: Axes) -> None:
    """The legend in the column right of the axes: it never hides data."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
                  fontsize=FONT_SIZE - 1, frameon=False, handlelength=1.5, labelspacing=0.35)


def _log_tick(value: float, _position: object = None) -> str:
    if value <= 0:
        return ""
    return f"{value:g}" if 1e-3 <= value < 1e4 else f"{value:.0e}".replace("e+0", "e").replace(
        "e-0", "e-").replace("e+", "e")


def readable_log_ticks(ax: Axes) -> None:
    """Short labels on a log y axis ("0.5", "2", "1e-4", "3e21"), minor ones only when few decades
    show: matplotlib's "2×10^0" labels are wide enough to push the y label off the figure."""
    low, high = ax.get_ylim()
    decades = np.log10(high / low) if low > 0 and high > 0 else 99
    ax.yaxis.set_major_formatter(FuncFormatter(_log_tick))
    if decades < 1.5:
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 3.0, 5.0)))
        ax.yaxis.set_minor_formatter(FuncFormatter(_log_tick))
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="y", which="minor", labelsize=FONT_SIZE - 1.5)


def say_nothing_to_plot(ax: Axes, message: str) -> None:
    """A short message in place of empty axes."""
    ax.set_axis_off()
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=FONT_SIZE + 1, color="dimgray",
            transform=ax.transAxes, wrap=True)


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
            far.append(f"{dtype} max {limit:.3g}:\n{decades:.0f} decades above")
            continue
        ax.axhline(limit, color="black", linestyle=styles[position % len(styles)], linewidth=1,
                   label=f"{dtype} max {limit:.3g}")
    if far:
        # In the legend column, under the legend: never on the data.
        ax.text(1.02, 0.0, "\n".join(far), ha="left", va="bottom", fontsize=FONT_SIZE - 1.5,
                color="dimgray", transform=ax.transAxes)

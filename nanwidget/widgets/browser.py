"""FrameBrowser: step through recorded frames, filter them, plot them, re-run a batch."""

from __future__ import annotations

import base64
import html
import json
import re
import time
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import numpy as np
import pandas as pd

from ..core.grads import skips_summary
from ..plots import plot_frames, plot_history
from ..plots.common import display_width, figure_png, module_label
from ..plots.frames import DEFAULT_WINDOW
from ..plots.history import neighbour_modules
from .sources import BrowserSource, open_source
from .table import FrameIndex, layer_pattern, layer_pattern_problem
from .theme import ALERT, MUTED, PLOT_IMAGE, STYLESHEET, WARNING

__all__ = ["FrameBrowser"]

_ANY_TYPE = "(all types)"
_ROLE_CHOICES = [("all roles", ""), ("weights", "weights"), ("inputs", "inputs"),
                 ("outputs", "outputs"), ("grads", "grads")]
# A data: URI larger than this is refused by some browsers: save to a path instead.
_DOWNLOAD_LIMIT = 1_500_000


def _classed(widget: widgets.Widget, *classes: str) -> Any:
    for name in classes:
        widget.add_class(name)
    return widget


class FrameBrowser(widgets.VBox):
    """An ipywidgets view of recorded frames.

    ``source``: a NanWatch, a loaded Run, a Trace, a NanEvent or a frames DataFrame. Opens at
    the first event's frame when there is one. Parts carry the CSS classes of the contract
    (``nw-browser``, ``nw-status``, ``nw-prev`` ...). Controls and table sit left of the plots
    (they wrap below on narrow pages). A frame is named as the DataFrame names it, "batch 3,
    frame 2" (the ``frame`` column counts the hooks of a batch): next to the slider, in the
    table's heading, in the frames plot (batches along its top), where the current frame is
    marked. The plots follow the JupyterLab theme, light or dark.

    Export: "export frames" downloads the filtered frames as a CSV file in the browser, in one
    click; a path typed next to "save" writes them on the kernel's machine instead (``.csv`` or
    ``.parquet``; a folder: a timestamped file in it). ``plots=False`` leaves the plots out
    (e.g. for very large tables).

    Displayed in a notebook, the browser also leaves a static HTML copy of itself (status, frame
    table, plots) in the output, hidden while the live widget shows: a saved notebook reopened
    without its kernel shows that copy instead of "model not found". ``static_copy=False``
    leaves it out.
    """

    def __init__(self, source: Any, *, export_dir: str | Path | None = None,
                 plots: bool = True, static_copy: bool = True) -> None:
        self._origin = source
        self.source: BrowserSource = open_source(source)
        self.export_dir = Path(export_dir) if export_dir is not None else Path.cwd()
        self.show_plots = plots
        self.static_copy = static_copy
        self.last_trace: Any = None
        self.last_export: Path | None = None
        self.last_download: tuple[str, bytes] | None = None
        self._mask = np.zeros(0, dtype=bool)
        self._visible = np.zeros(0, dtype=np.int64)
        self._updating = False
        self._frames_axis: tuple[float, ...] | None = None  # xlim and axes box of the frames plot
        self._frames_window = (1, 0)
        self._history_stale = True
        self._history_png = b""
        self._build_parts()
        super().__init__(children=self._layout())
        self.add_class("nw-browser")
        # Marks the live view: the static copy next to it hides while this class is on the page.
        self._live_class = f"nw-live-{self.model_id}"
        self.add_class(self._live_class)
        self._load_view(next(iter(self.source.views)))
        if self.source.trace is not None:
            self._show_trace(self.source.trace)

    # ------------------------------------------------------------------ parts
    def _build_parts(self) -> None:
        source = self.source
        self.style = widgets.HTML(STYLESHEET, layout=widgets.Layout(display="none"))
        self.status = _classed(widgets.HTML(), "nw-status")
        # min_width 0: a long view name shrinks the dropdown, never pushes the button out.
        self.view = _classed(widgets.Dropdown(options=list(source.views), description="view",
                                              tooltip="which frames to browse",
                                              layout=widgets.Layout(flex="1 1 auto", width="auto",
                                                                    min_width="0")), "nw-view")
        self.view.style.description_width = "34px"
        refresh_layout = widgets.Layout(width="36px", flex="0 0 auto",
                                        display=None if source.refreshable else "none")
        self.refresh = _classed(widgets.Button(icon="refresh",
                                               tooltip="read the frames again from the source",
                                               layout=refresh_layout), "nw-refresh")
        self.prev = _classed(widgets.Button(description="◀", tooltip="one frame back",
                                            layout=widgets.Layout(width="40px")), "nw-prev")
        self.next = _classed(widgets.Button(description="▶", tooltip="one frame forward",
                                            layout=widgets.Layout(width="40px")), "nw-next")
        # The slider is a position among the shown frames; the label beside it names the frame.
        self.frame = _classed(widgets.IntSlider(min=1, max=1, value=1, readout=False,
                                                continuous_update=True,
                                                tooltip="step through the frames",
                                                layout=widgets.Layout(flex="1 1 auto", width="auto",
                                                                      min_width="40px")),
                              "nw-frame")
        self.frame_label = _classed(widgets.HTML(layout=widgets.Layout(flex="0 0 auto")),
                                    "nw-frame-label")
        self.first_bad = _classed(widgets.Button(description="first NaN/Inf",
                                                 button_style="danger",
                                                 tooltip="jump to the first frame holding a NaN or Inf",
                                                 layout=widgets.Layout(width="120px")),
                                  "nw-first-bad")
        self.only_bad = _classed(widgets.Checkbox(description="only NaN/Inf", indent=False,
                                                  tooltip="show only tensors holding a NaN/Inf",
                                                  layout=widgets.Layout(width="auto",
                                                                        margin="0 0 0 12px")),
                                 "nw-only-bad")
        self.filter_layer = _classed(widgets.Text(placeholder="layer: name or regex",
                                                  continuous_update=False,
                                                  tooltip="module name filter (regex)",
                                                  layout=widgets.Layout(width="auto")),
                                     "nw-filter-layer")
        self.filter_type = _classed(widgets.Dropdown(options=[_ANY_TYPE],
                                                     tooltip="module type filter",
                                                     layout=widgets.Layout(width="50%")),
                                    "nw-filter-type")
        self.filter_role = _classed(widgets.Dropdown(options=_ROLE_CHOICES, value="",
                                                     tooltip="role filter",
                                                     layout=widgets.Layout(width="50%")),
                                    "nw-filter-role")
        self.table = _classed(widgets.HTML(), "nw-frame-table")

        self.plot_choice = _classed(widgets.ToggleButtons(
            options=[("frames", "frames"), ("history", "history")], value="frames",
            tooltips=["abs max / abs min of each frame; the current frame is marked",
                      "abs max of module outputs across batches"],
            style={"button_width": "80px"}), "nw-plot-choice")
        image_layout = dict(width="540px", height="auto", grid_area="1 / 1 / 2 / 2")
        self.frames_image = _classed(widgets.Image(format="png",
                                                   layout=widgets.Layout(**image_layout)),
                                     "nw-plot-frames", PLOT_IMAGE)
        self.frame_marker = _classed(widgets.HTML(layout=widgets.Layout(
            grid_area="1 / 1 / 2 / 2", width="100%", height="100%", margin="0")),
            "nw-marker-layer")
        self.frames_plot = _classed(widgets.GridBox(
            [self.frames_image, self.frame_marker],
            layout=widgets.Layout(grid_template_columns="auto", grid_template_rows="auto",
                                  width="fit-content", max_width="100%")), "nw-plot-stack")
        self.history_image = _classed(widgets.Image(format="png", layout=widgets.Layout(
            width="540px", height="auto", display="none")), "nw-plot-history", PLOT_IMAGE)
        self.plot_note = _classed(widgets.HTML(), "nw-plot-note")
        self.plot = _classed(widgets.VBox([self.plot_choice, self.frames_plot, self.history_image,
                                           self.plot_note],
                                          layout=widgets.Layout(flex="0 1 auto",
                                                                max_width="100%")), "nw-plot")

        self.batch = _classed(widgets.Dropdown(options=[], tooltip="batch to re-run",
                                               layout=widgets.Layout(width="100px")), "nw-batch")
        reason = source.no_replay_reason
        self.rerun = _classed(widgets.Button(
            description="re-run in trace mode" if not reason else "re-run not available",
            tooltip=reason or "replay this batch op by op and show where the NaN is made",
            disabled=bool(reason), layout=widgets.Layout(flex="1 1 auto", width="auto")),
            "nw-rerun")
        self.trace = _classed(widgets.HTML(
            value=f"<i>{html.escape(reason)}</i>" if reason else ""), "nw-trace")
        self.export = _classed(widgets.Button(description="export frames (CSV)", icon="download",
                                              tooltip="download the filtered frames to this "
                                                      "computer as CSV",
                                              layout=widgets.Layout(width="auto")), "nw-export")
        self.save_path = _classed(widgets.Text(
            placeholder="or save to: path.csv / .parquet",
            tooltip="a file or folder on the kernel's machine",
            layout=widgets.Layout(flex="1 1 auto", width="auto")), "nw-save-path")
        self.save = _classed(widgets.Button(description="save", icon="save",
                                            tooltip="write the filtered frames to this path on "
                                                    "the kernel's machine (a folder: a "
                                                    "timestamped file in it)",
                                            layout=widgets.Layout(width="76px",
                                                                  flex="0 0 auto")), "nw-save")
        self.export_link = _classed(widgets.HTML(), "nw-export-link")
        # Where the one-click download's script runs (an output area: widgets run no scripts),
        # added at the first export.
        self.download_script: widgets.Output | None = None

        self.prev.on_click(lambda _: self.step(-1))
        self.next.on_click(lambda _: self.step(+1))
        self.first_bad.on_click(lambda _: self.jump_to_first_bad())
        self.frame.observe(self._on_frame, names="value")
        for control in (self.filter_layer, self.filter_type, self.filter_role, self.only_bad):
            control.observe(self._on_filter, names="value")
        self.view.observe(self._on_view, names="value")
        self.plot_choice.observe(lambda _: self._show_chosen_plot(), names="value")
        self.refresh.on_click(lambda _: self.reload())
        self.rerun.on_click(lambda _: self.rerun_batch())
        self.export.on_click(lambda _: self.offer_download())
        self.save.on_click(lambda _: self._save_clicked())

    def _layout(self) -> list[widgets.Widget]:
        """Controls in a column beside the plot, the frame's table under both: about 520 px
        tall, so that controls, plot and table share one screen (the plot wraps under the
        controls on pages narrower than about 840 px)."""
        row = widgets.Layout(width="100%", flex_flow="row nowrap", align_items="center")
        controls = widgets.VBox([
            widgets.HBox([self.view, self.refresh], layout=row),
            widgets.HBox([self.prev, self.frame, self.frame_label, self.next], layout=row),
            widgets.HBox([self.first_bad, self.only_bad], layout=row),
            self.filter_layer,
            widgets.HBox([self.filter_type, self.filter_role], layout=row),
            widgets.HBox([self.batch, self.rerun], layout=row),
            self.export,
            widgets.HBox([self.save_path, self.save], layout=row),
        ], layout=widgets.Layout(width="280px", flex="0 0 auto"))
        controls.add_class("nw-controls")
        main = widgets.HBox([controls, self.plot],
                            layout=widgets.Layout(flex_flow="row wrap", align_items="flex-start",
                                                  grid_gap="4px 16px"))
        return [self.style, self.status, main, self.table, self.export_link, self.trace]

    # ------------------------------------------------------------------ data
    def _load_view(self, name: str, keep_filters: bool = False) -> None:
        """Read the view's DataFrame and index it once; filters and steps reuse the index."""
        self._view_label = name
        self.index = FrameIndex(self.source.views[name]())
        self.history = self.source.history() if self.source.history is not None else None
        self._history_stale = True
        self._updating = True
        try:
            if self.view.value != name:
                self.view.value = name
            types = [_ANY_TYPE] + self.index.module_types
            if self.filter_type.value not in types:
                self.filter_type.value = _ANY_TYPE
            self.filter_type.options = types
            if not keep_filters:
                self.filter_type.value = _ANY_TYPE
            batches = self.index.batches
            event = self.source.events[0] if self.source.events else None
            self.batch.options = [(f"batch {b}", b) for b in batches]
            if batches:
                self.batch.value = event.batch if event is not None and event.batch in batches \
                    else batches[-1]
        finally:
            self._updating = False
        self._apply_filters(start=self._start_position())

    def _on_view(self, change: dict) -> None:
        if not self._updating and change["new"] is not None:
            self._load_view(change["new"])

    def reload(self) -> None:
        """Read the source again (a live watch moves on: new frames, new events), keeping filters."""
        if self.source.refreshable:
            self.source = open_source(self._origin)
        self._set_view_options()
        name = self._view_label if self._view_label in self.source.views \
            else next(iter(self.source.views))
        self._load_view(name, keep_filters=True)

    def _set_view_options(self) -> None:
        self._updating = True
        try:
            self.view.options = list(self.source.views)
            if self._view_label in self.source.views:
                self.view.value = self._view_label
        finally:
            self._updating = False

    def _start_position(self) -> int | None:
        """The event's own frame when this view holds it, else the first non-finite frame."""
        for event in self.source.events:
            phase = "backward" if event.is_backward else "forward"
            position = self.index.position_of(event.rank, event.batch, phase, event.frame)
            if position is not None:
                return position
        bad = np.flatnonzero(self.index.frame_bad)
        return int(bad[0]) if bad.size else None

    @property
    def filtered_frames(self) -> pd.DataFrame:
        """The rows of the current view that pass the filters (what export writes)."""
        return self.index.table[self._mask]

    @property
    def current_frame(self) -> int | None:
        """Position of the frame shown, counted in the unfiltered view; None when none is."""
        if not len(self._visible):
            return None
        return int(self._visible[self.frame.value - 1])

    # ------------------------------------------------------------------ filters and steps
    def _on_filter(self, change: dict) -> None:
        if not self._updating:
            self._apply_filters(start=self.current_frame)

    def _apply_filters(self, start: int | None = None) -> None:
        index = self.index
        self._mask = index.row_mask(
            layer=self.filter_layer.value,
            module_type="" if self.filter_type.value in (_ANY_TYPE, None) else self.filter_type.value,
            role_group=self.filter_role.value or "",
            only_bad=self.only_bad.value)
        self._visible = index.visible_frames(self._mask)
        if self._layer_problem():
            self.filter_layer.add_class("nw-invalid")
        else:
            self.filter_layer.remove_class("nw-invalid")
        count = len(self._visible)
        if start is not None and count:
            # Stay on (or just after) the frame that was shown.
            target = int(min(np.searchsorted(self._visible, start), count - 1))
        else:
            target = count - 1 if count else 0
        self._updating = True
        try:
            self.frame.max = max(count, 1)
            self.frame.value = target + 1  # frames are counted from 1, as people do
            self.frame.disabled = count <= 1
        finally:
            self._updating = False
        self._history_stale = True
        # Red only when there is something to jump to.
        self.first_bad.button_style = "danger" if self.index.frame_bad.any() else ""
        self._render_frame()
        self._render_status()
        self._render_plots()

    def _on_frame(self, change: dict) -> None:
        if not self._updating:
            self._render_frame()
            self._render_marker()

    def step(self, delta: int) -> None:
        """Move ``delta`` frames along the filtered frames (clamped at both ends)."""
        if len(self._visible):
            self.frame.value = int(np.clip(self.frame.value + delta, 1, len(self._visible)))

    def jump_to_first_bad(self) -> bool:
        """Show the event's frame, or without one the first frame (under the filters) holding a
        NaN/Inf (a -inf mask is flagged but is no event); False when there is none."""
        event_position = self._start_position()
        if event_position is not None and self.source.events and len(self._visible):
            shown = np.flatnonzero(self._visible == event_position)
            if shown.size:
                self.frame.value = int(shown[0]) + 1
                return True
        bad = np.flatnonzero(self.index.frame_bad[self._visible]) if len(self._visible) else []
        if not len(bad):
            self.status.value = self._status_text() + " · <b>no NaN/Inf frame under these filters</b>"
            return False
        self.frame.value = int(bad[0]) + 1
        return True

    # ------------------------------------------------------------------ rendering
    def _render_frame(self) -> None:
        if not len(self._visible):
            self.frame_label.value = ""
            if not self.index.n_frames:
                self.table.value = "<i>No frames to show.</i>"
            else:
                problem = self._layer_problem()
                self.table.value = "<i>No frames match the filters.</i>" + (
                    f" <span class='nw-alert' style='{ALERT}'>{html.escape(problem)}</span>"
                    if problem else "")
            return
        position = int(self._visible[self.frame.value - 1])
        self.frame_label.value = f"<span class='nw-frame-name'>{self.index.frame_name(position)}</span>"
        self.table.value = self.index.frame_html(position, self._mask)

    def _layer_problem(self) -> str:
        """Why the layer filter is read as plain text ("" when it is a valid pattern)."""
        return layer_pattern_problem(self.filter_layer.value)

    def _status_text(self) -> str:
        index = self.index
        if not index.n_frames:
            held = "no frames held"
        else:
            batches = index.batches
            span = f"batch {batches[0]}" if batches[0] == batches[-1] else \
                f"batches {batches[0]}–{batches[-1]}"
            ranks = f", ranks {index.ranks[0]}–{index.ranks[-1]}" if len(index.ranks) > 1 else ""
            frames = "1 frame" if index.n_frames == 1 else f"{index.n_frames} frames"
            tensors = "1 tensor" if index.n_rows == 1 else f"{index.n_rows} tensors"
            held = f"{frames} ({tensors}) held, {span}{ranks}"
            if len(self._visible) != index.n_frames:
                held += f" · {len(self._visible)} match the filters"
            problem = self._layer_problem()
            if problem:
                held += f" · <span class='nw-alert' style='{ALERT}'>{html.escape(problem)}</span>"
        events = self.source.events
        if events:
            more = f" ({len(events)} events; first shown)" if len(events) > 1 else ""
            words = (f"<span class='nw-alert' style='{ALERT}'>"
                     f"{html.escape(events[0].summary(), quote=False)}</span>{more}")
            diagnosis = getattr(events[0], "diagnosis", None)
            if diagnosis is not None:
                # the first fix too, as the %%nanwatch stop message gives it: why, then what to try
                fix = (" <span class='nw-fix'><b>Try:</b> "
                       f"{html.escape(diagnosis.suggestion[0], quote=False)}</span>"
                       if diagnosis.suggestion else "")
                words += (f"<br><span class='nw-diagnosis'><b>{html.escape(diagnosis.kind)}</b>: "
                          f"{html.escape(diagnosis.summary, quote=False)}{fix}</span>")
        elif index.frame_bad.any():
            words = f"<span class='nw-alert' style='{ALERT}'>NaN/Inf in these frames</span>"
        else:
            words = "no NaN/Inf seen"
        watch = self.source.watch
        scaler = watch.parts.scaler if watch is not None else None
        skipped = skips_summary(scaler.skips, scaler.label) if scaler is not None else ""
        skipped = f" · {html.escape(skipped, quote=False)}" if skipped else ""
        return f"{held} · {words}{skipped}{self._warnings_text()}"

    def _warnings_text(self) -> str:
        """The early warnings in the status: the first one in full, how many more."""
        early = self.source.warnings
        if not early:
            return ""
        more = f" (+{len(early) - 1} more: see the history plot)" if len(early) > 1 else ""
        return (f"<br><span class='nw-warning' style='{WARNING}'>"
                f"{html.escape(str(early[0]), quote=False)}</span>{more}")

    def _render_status(self) -> None:
        self.status.value = self._status_text()

    def _render_plots(self) -> None:
        """Draw the frames plot of the filtered rows (and the history plot when it is shown)."""
        if not self.show_plots:
            self.plot.layout.display = "none"
            return
        rows = self.filtered_frames
        if rows.empty:
            self._frames_axis = None
            self.frames_image.value = b""
            self.frame_marker.value = ""
        else:
            self._draw_frames_plot()
        self._show_chosen_plot()

    def _draw_frames_plot(self, focus: int | None = None) -> None:
        """Draw the frames plot (a window around ``focus`` when there are many frames)."""
        figure = plot_frames(self.filtered_frames, window=DEFAULT_WINDOW,
                             focus=focus if focus is not None else int(self.frame.value))
        ax = figure.axes[0]
        if ax.axison:
            low, high = ax.get_xlim()
            box = ax.get_position()
            self._frames_axis = (low, high, box.x0, box.x1, box.y0, box.y1)
            self._frames_window = (int(np.ceil(low)), int(np.floor(high)))
        else:
            self._frames_axis = None
        self.frames_image.value = figure_png(figure, transparent=True)
        self.frames_image.layout.width = f"{display_width(figure)}px"
        self._render_marker(redraw=False)

    def _render_marker(self, redraw: bool = True) -> None:
        """Move the current-frame band over the frames plot: a cheap HTML change per step.

        Only when the frame leaves the plotted window (hundreds of frames) is the plot redrawn,
        centred on it.
        """
        axis = self._frames_axis
        if axis is None or not len(self._visible) or not self.show_plots:
            self.frame_marker.value = ""
            return
        number = int(self.frame.value)
        first, last = self._frames_window
        if redraw and not first <= number <= last:
            self._draw_frames_plot(focus=number)
            return
        low, high, x0, x1, y0, y1 = axis
        width = (x1 - x0) / (high - low)
        left = x0 + (number - 0.5 - low) * width
        position = int(self._visible[number - 1])
        module = module_label(str(self.index.module[self.index.first_rows[position]]))
        title = html.escape(f"{self.index.frame_name(position)}: {module}", quote=True)
        self.frame_marker.value = (
            f"<div class='nw-marker' title='{title}' "
            f"style='position:absolute;background:var(--nw-marker,rgba(255,152,0,.3));"
            f"left:{left * 100:.3f}%;width:{width * 100:.3f}%;top:{(1 - y1) * 100:.3f}%;"
            f"height:{(y1 - y0) * 100:.3f}%'></div>")

    def _show_chosen_plot(self) -> None:
        """Show the plot chosen with the toggle; draw the history only when it is looked at."""
        if not self.show_plots:
            return
        rows_empty = self.filtered_frames.empty
        if self.plot_choice.value == "frames":
            self.history_image.layout.display = "none"
            self.frames_plot.layout.display = "none" if rows_empty else None
            problem = self._layer_problem() if rows_empty else ""
            self.plot_note.value = ("<i class='nw-muted'>no frames match the filters: nothing "
                                    "to plot</i>" + (f" <span class='nw-alert' style='{ALERT}'>"
                                                     f"{html.escape(problem)}</span>"
                                                     if problem else "")
                                    if rows_empty else "")
            return
        self.frames_plot.layout.display = "none"
        note = self._ensure_history_png()
        self.history_image.layout.display = "none" if note else None
        self.plot_note.value = f"<i class='nw-muted'>{note}</i>" if note else ""

    def history_modules(self) -> list[str]:
        """Modules the history plot shows: the event's module and its neighbours, or, under a
        layer/type filter, the matching modules (the event's first)."""
        history = self.history
        if history is None or history.empty:
            return []
        event_module = self._event_module()
        pattern = layer_pattern(self.filter_layer.value)
        filtered = pattern is not None or self.filter_type.value not in (_ANY_TYPE, None)
        if not filtered:
            if event_module is not None:
                return neighbour_modules(history, event_module, 5)
            return []  # plot_history picks: around the first bad module, or the largest
        chosen = history
        if pattern is not None:
            chosen = chosen[chosen["module"].map(lambda m: bool(pattern.search(module_label(m))))]
        if self.filter_type.value not in (_ANY_TYPE, None):
            chosen = chosen[chosen["module_type"] == self.filter_type.value]
        names = [str(m) for m in pd.unique(chosen["module"])]
        if event_module in names:
            names.remove(event_module)
            names.insert(0, event_module)
        return names[:6]

    def _event_module(self) -> str | None:
        """The module the history plot centres on: the event's, the first bad frame's, or
        the first early warning's."""
        if self.source.events:
            return self.source.events[0].module
        bad = np.flatnonzero(self.index.frame_bad)
        if bad.size:
            return str(self.index.module[self.index.first_rows[int(bad[0])]])
        if self.source.warnings:
            return self.source.warnings[0].module
        return None

    def _ensure_history_png(self) -> str:
        """Draw the history plot if the filters changed since; return a note when there is none."""
        history = self.history
        if history is None:
            return "no history for this source"
        if history.empty:
            return "no history yet"
        if self._history_stale:
            modules = self.history_modules()
            filtered = layer_pattern(self.filter_layer.value) is not None or \
                self.filter_type.value not in (_ANY_TYPE, None)
            if filtered and not modules:
                self._history_png = b""
                self._history_stale = False
                return "no module matches the filters: nothing to plot"
            rows = self.filtered_frames
            output_dtypes = rows.loc[rows["role"].astype(str).str.startswith("output"), "dtype"] \
                if not rows.empty else pd.Series([], dtype=object)
            dtype = output_dtypes.iloc[-1] if len(output_dtypes) else None
            figure = plot_history(history, modules or None, dtype=dtype or None,
                                  around=self._event_module(), warnings=self.source.warnings)
            self._history_png = figure_png(figure, transparent=True)
            self.history_image.value = self._history_png
            self.history_image.layout.width = f"{display_width(figure)}px"
            self._history_stale = False
        return "" if self._history_png else "no module matches the filters: nothing to plot"

    # ------------------------------------------------------------------ re-run and export
    def rerun_batch(self, batch: int | None = None) -> Any:
        """Replay ``batch`` (default: the chosen one) in trace mode and show the trace."""
        watch = self.source.watch
        batch = self.batch.value if batch is None else batch
        if watch is None or self.source.no_replay_reason:
            self._replay_unavailable(self.source.no_replay_reason
                                     or "re-running needs a live watch")
            return None
        if batch is None:
            self.trace.value = "<i>choose a batch to re-run</i>"
            return None
        self.trace.value = f"<i>re-running batch {batch} in trace mode…</i>"
        try:
            # As the watch's own replay would run it: with its loss_fn, so that an event made
            # in the loss or the backward pass is traced too.
            replayer = watch.parts.replayer
            trace = replayer.rerun(batch) if replayer is not None else watch.replay(batch)
        except Exception as error:  # a batch no longer held, a closed watch: say so, stay usable
            self.trace.value = (f"<span class='nw-alert' style='{ALERT}'>could not re-run batch "
                                f"{batch}: {html.escape(f'{type(error).__name__}: {error}')}</span>")
            return None
        self._show_trace(trace)
        name = f"trace of re-run batch {batch}"
        frames = getattr(trace, "frames", None)
        if isinstance(frames, pd.DataFrame) and not frames.empty:
            self.source.views[name] = lambda f=frames: f
            self._set_view_options()
        return trace

    def _replay_unavailable(self, reason: str) -> None:
        self.rerun.description = "re-run not available"
        self.rerun.disabled = True
        self.rerun.tooltip = reason
        self.trace.value = f"<i>{html.escape(reason)}</i>"

    def _show_trace(self, trace: Any) -> None:
        self.last_trace = trace
        first = getattr(trace, "first_bad", None)
        if first is not None:
            op = html.escape(str(first.get("op", "?")))
            where = str(first.get("source", "") or "")
            in_loss = getattr(trace, "ran_in_loss", None)
            module = ("loss_fn" if in_loss is not None and in_loss(first) else
                      "module " + html.escape(module_label(str(first.get("module", "")))))
            place = (f" at <code>{html.escape(where)}</code>" if where else
                     " <span class='nw-muted'>(no line of your code on the stack: the op ran "
                     "inside torch or a library)</span>")
            headline = (f"<b class='nw-alert' style='{ALERT}'>first bad op: {op}</b> in "
                        f"{module}{place}")
        elif not getattr(trace, "reproduced", True):
            headline = (f"<b>not reproduced</b>, because "
                        f"{html.escape(trace.why_not_reproduced())}")
        else:
            headline = f"<b>{html.escape(trace.summary())}</b>"
        report = html.escape(trace.report()) if callable(getattr(trace, "report", None)) else ""
        self.trace.value = f"<div class='nw-trace-head'>{headline}</div><pre>{report}</pre>"

    def _export_table(self) -> pd.DataFrame:
        return self.filtered_frames

    def offer_download(self) -> str:
        """Download the filtered frames as a CSV file in the browser: the click on "export
        frames" starts it (a script the page runs once), and a link under the buttons offers
        the same file again.

        Returns the file name offered. Tables too large for a data: URI are refused with a
        message pointing at "save".
        """
        rows = self._export_table()
        data = rows.to_csv(index=False).encode("utf-8")
        name = f"nanwidget-frames-{time.strftime('%Y%m%d-%H%M%S')}.csv"
        encoded = base64.b64encode(data).decode("ascii")
        if len(encoded) > _DOWNLOAD_LIMIT:
            self.export_link.value = (
                f"<span class='nw-alert' style='{ALERT}'>{len(rows)} rows make "
                f"{len(data) / 1e6:.1f} MB: too large for a browser download; filter them, or "
                f"save them to a path on the kernel's disk</span>")
            return ""
        self.last_download = (name, data)
        href = f"data:text/csv;base64,{encoded}"
        self.export_link.value = (
            f"<span class='nw-muted' style='{MUTED}'>downloading {len(rows)} rows "
            f"({_size(len(data))}) as</span> <a class='nw-download' download='{name}' "
            f"href='{href}'>⬇ {name}</a> <span class='nw-muted' style='{MUTED}'>(if it did "
            "not start, click the name)</span>")
        self._start_download(name, href)
        return name

    def _start_download(self, name: str, href: str) -> None:
        """Have the page save ``href`` as ``name`` now. The script runs once: not again when
        the browser is shown a second time, nor in a notebook reopened later (saved widget
        state), where the link stays."""
        from IPython.display import Javascript
        token = f"{self.model_id}-{time.time_ns()}"
        script = (
            "(() => {"
            f" const token = {json.dumps(token)}, issued = {int(time.time() * 1000)};"
            " const done = (window.nanwidgetDownloads = window.nanwidgetDownloads || new Set());"
            " if (done.has(token) || Math.abs(Date.now() - issued) > 60000) return;"
            " done.add(token);"
            " const link = document.createElement('a');"
            f" link.href = {json.dumps(href)}; link.download = {json.dumps(name)};"
            " link.style.display = 'none'; document.body.appendChild(link); link.click();"
            " link.remove(); })();")
        if self.download_script is None:
            self.download_script = _classed(
                widgets.Output(layout=widgets.Layout(display="none")), "nw-download-script")
            self.children = (*self.children, self.download_script)
        self.download_script.outputs = ()  # the last click's script, only
        self.download_script.append_display_data(Javascript(script))

    def _save_clicked(self) -> None:
        typed = self.save_path.value.strip()
        if not typed:  # never a file nobody asked for: say what to type
            self.export_link.value = (
                f"<span class='nw-alert' style='{ALERT}'>type where to save first: a file "
                "(frames.csv, frames.parquet) or a folder on the kernel's machine</span>")
            return
        try:
            self.export_frames(typed)
        except (OSError, ValueError) as error:
            self.export_link.value = (f"<span class='nw-alert' style='{ALERT}'>could not save: "
                                      f"{html.escape(str(error))}</span>")

    def export_frames(self, path: str | Path | None = None) -> Path:
        """Write the filtered frames on the kernel's machine and return the path written.

        ``path``: a ``.csv`` or ``.parquet`` file, or a folder; none: ``export_dir``. In a
        folder the file is named ``nanwidget-frames-<time>`` (parquet when pyarrow is
        installed, else CSV). Raises ValueError for another suffix.
        """
        rows = self._export_table()
        target = Path(path).expanduser() if path is not None else self.export_dir
        if target.suffix.lower() in (".csv", ".parquet"):
            target.parent.mkdir(parents=True, exist_ok=True)
            suffix = target.suffix.lower()
        elif target.suffix and not target.is_dir():
            raise ValueError(f"save to a .csv or .parquet file (or a folder), not {target.name!r}")
        else:
            target.mkdir(parents=True, exist_ok=True)
            suffix = ".parquet" if _has_pyarrow() else ".csv"
            stamp = time.strftime("%Y%m%d-%H%M%S")
            folder, target = target, target / f"nanwidget-frames-{stamp}{suffix}"
            counter = 1
            while target.exists():
                target = folder / f"nanwidget-frames-{stamp}-{counter}{suffix}"
                counter += 1
        if suffix == ".parquet":
            table = rows.copy()
            table["shape"] = table["shape"].map(lambda s: list(s) if isinstance(s, tuple) else s)
            table.to_parquet(target, index=False)
        else:
            rows.to_csv(target, index=False)
        self.last_export = target.resolve()
        self.export_link.value = (f"wrote {len(rows)} rows to "
                                  f"<code>{html.escape(str(self.last_export))}</code>")
        return self.last_export

    # ------------------------------------------------------------------ static copy
    def static_html(self) -> str:
        """The browser as plain HTML: status, the current frame's table and both plots as PNG.

        What a saved notebook shows when its widgets cannot come back (no kernel, another
        viewer); :meth:`_ipython_display_` leaves it next to the live widget, hidden while the
        widget shows.
        """
        token = self.model_id
        parts = [
            STYLESHEET,
            # Hidden while the live browser is on the page; with no live browser, the
            # "Error displaying widget: model not found" line just above it is hidden instead.
            f"<style>body:has(.nw-live-{token}) .nw-static-{token} {{display:none}}\n"
            f".jp-OutputArea-child:has(+ .jp-OutputArea-child .nw-static-{token}) > "
            f".jp-OutputArea-output.jupyter-widgets:not(:has(*)) {{display:none}}</style>",
            f"<div class='nw-static nw-static-{token}'>",
            f"<div class='nw-muted' style='{MUTED};font-size:11px'>nanwidget FrameBrowser: a "
            "static copy saved with the notebook (run the cell again for the interactive one)"
            "</div>",
            # Not the live parts' contract classes: tests and user styles find one of each.
            f"<div class='nw-static-status'>{self.status.value}</div>",
            f"<div class='nw-static-table'>{self.table.value}</div>",
        ]
        if self.show_plots and not self.filtered_frames.empty and self.frames_image.value:
            # The live plot's own PNG with the same marker over it: no second drawing.
            width = self.frames_image.layout.width or "540px"
            parts.append("<div style='display:flex;flex-wrap:wrap;gap:8px;align-items:flex-start'>")
            parts.append(f"<div style='position:relative;width:{width};max-width:100%'>"
                         f"{_img(bytes(self.frames_image.value), 'frames plot', '100%')}"
                         f"{self.frame_marker.value}</div>")
            if self.history is not None and not self.history.empty and \
                    not self._ensure_history_png():
                parts.append(_img(self._history_png, "history plot",
                                  self.history_image.layout.width or "540px"))
            parts.append("</div>")
        if self.trace.value and self.last_trace is not None:
            parts.append(f"<div class='nw-static-trace'>{self.trace.value}</div>")
        parts.append("</div>")
        return "\n".join(parts)

    def status_words(self) -> str:
        """The status line as plain text (frames held, batch range, the event in words)."""
        text = re.sub(r"<[^>]*>", "", self.status.value.replace("<br>", "\n"))
        return html.unescape(text)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any] | None:
        """The widget; its text/plain (what a viewer without widgets shows: a terminal,
        nbconvert to text) is the status in words, not ipywidgets' repr of every child."""
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is not None:
            bundle["text/plain"] = f"nanwidget FrameBrowser: {self.status_words()}"
        return bundle

    def close(self) -> None:
        """Close the browser and every widget it is made of (its buttons, plots, layouts).

        ipywidgets keeps each widget alive until it is closed, and the browser's controls call
        back into it: closing only the outer box would keep the browser, and the watch, model
        and batches it shows, for as long as the kernel runs. A closed browser's output falls
        back to its static copy."""
        for part in self._parts_within():
            part.close()
        super().close()

    def _parts_within(self) -> list[widgets.Widget]:
        """Every widget below this one: its children, layouts and styles, and the parts held
        aside (a download area, a control the layout hides), each once."""
        found: dict[int, widgets.Widget] = {}
        pending = [value for value in vars(self).values() if isinstance(value, widgets.Widget)]
        pending.append(self)
        while pending:
            widget = pending.pop()
            if id(widget) in found:
                continue
            found[id(widget)] = widget
            for name in widget.keys:
                value = getattr(widget, name, None)
                values = value if isinstance(value, (tuple, list)) else (value,)
                pending.extend(item for item in values if isinstance(item, widgets.Widget))
        found.pop(id(self))
        return list(found.values())

    def _ipython_display_(self, **kwargs: Any) -> None:
        """Display the live widget, then its static copy (see :meth:`static_html`)."""
        from IPython.display import display
        display(self._repr_mimebundle_(**kwargs), raw=True)
        if self.static_copy:
            display({"text/html": self.static_html(),
                     "text/plain": "(static copy of the FrameBrowser above)"}, raw=True)


def _img(png: bytes, alt: str, width: str) -> str:
    return (f"<img class='{PLOT_IMAGE}' alt='{alt}' "
            f"style='width:{width};max-width:100%;display:block;background:#fff' "
            f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>")


def _size(count: int) -> str:
    return f"{count / 1e6:.1f} MB" if count >= 1e6 else f"{max(1, round(count / 1e3))} KB"


def _has_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True

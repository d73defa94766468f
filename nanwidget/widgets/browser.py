"""FrameBrowser: step through recorded frames, filter them, plot them, re-run a batch."""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import numpy as np
import pandas as pd

from ..plots import largest_modules, plot_frames, plot_history
from ..plots.common import figure_png, module_label
from .sources import BrowserSource, open_source
from .table import FrameIndex, layer_pattern

__all__ = ["FrameBrowser"]

_ANY_TYPE = "(all types)"
_ROLE_CHOICES = [("all roles", ""), ("weights", "weights"), ("inputs", "inputs"),
                 ("outputs", "outputs"), ("grads", "grads")]


def _classed(widget: widgets.Widget, *classes: str) -> Any:
    for name in classes:
        widget.add_class(name)
    return widget


class FrameBrowser(widgets.VBox):
    """An ipywidgets view of recorded frames.

    ``source``: a NanWatch, a loaded Run, a Trace, a NanEvent or a frames DataFrame. Opens at
    the first event's frame when there is one. Parts carry the CSS classes of the contract
    (``nw-browser``, ``nw-status``, ``nw-prev`` ...). ``export_dir`` is where the export
    button writes; ``plots=False`` leaves the plots out (e.g. for very large tables).
    """

    def __init__(self, source: Any, *, export_dir: str | Path | None = None,
                 plots: bool = True) -> None:
        self._origin = source
        self.source: BrowserSource = open_source(source)
        self.export_dir = Path(export_dir) if export_dir is not None else Path.cwd()
        self.show_plots = plots
        self.last_trace: Any = None
        self.last_export: Path | None = None
        self._mask = np.zeros(0, dtype=bool)
        self._visible = np.zeros(0, dtype=np.int64)
        self._updating = False
        self._build_parts()
        super().__init__(children=self._layout())
        self.add_class("nw-browser")
        self._load_view(next(iter(self.source.views)))
        if self.source.trace is not None:
            self._show_trace(self.source.trace)

    # ------------------------------------------------------------------ parts
    def _build_parts(self) -> None:
        source = self.source
        self.status = _classed(widgets.HTML(), "nw-status")
        self.view = _classed(widgets.Dropdown(options=list(source.views), description="frames",
                                              layout=widgets.Layout(width="420px")), "nw-view")
        refresh_layout = widgets.Layout(width="100px",
                                        display=None if source.refreshable else "none")
        self.refresh = _classed(widgets.Button(description="Refresh", icon="refresh",
                                               tooltip="read the frames again from the source",
                                               layout=refresh_layout), "nw-refresh")
        self.prev = _classed(widgets.Button(description="◀ back", tooltip="step one frame back",
                                            layout=widgets.Layout(width="90px")), "nw-prev")
        self.next = _classed(widgets.Button(description="forward ▶",
                                            tooltip="step one frame forward",
                                            layout=widgets.Layout(width="100px")), "nw-next")
        self.frame = _classed(widgets.IntSlider(min=1, max=1, value=1, description="frame",
                                                continuous_update=True,
                                                layout=widgets.Layout(width="360px")), "nw-frame")
        self.first_bad = _classed(widgets.Button(description="first NaN/Inf",
                                                 button_style="danger",
                                                 tooltip="jump to the first frame holding a NaN or Inf"),
                                  "nw-first-bad")
        self.filter_layer = _classed(widgets.Text(placeholder="layer name or regex",
                                                  description="layer", continuous_update=False,
                                                  layout=widgets.Layout(width="260px")),
                                     "nw-filter-layer")
        self.filter_type = _classed(widgets.Dropdown(options=[_ANY_TYPE], description="type",
                                                     layout=widgets.Layout(width="240px")),
                                    "nw-filter-type")
        self.filter_role = _classed(widgets.Dropdown(options=_ROLE_CHOICES, value="",
                                                     description="role",
                                                     layout=widgets.Layout(width="200px")),
                                    "nw-filter-role")
        self.only_bad = _classed(widgets.Checkbox(description="only NaN/Inf", indent=False,
                                                  layout=widgets.Layout(width="130px")),
                                 "nw-only-bad")
        self.table = _classed(widgets.HTML(), "nw-frame-table")
        plot_layout = dict(width="600px", height="auto")
        self.frames_image = _classed(widgets.Image(format="png", layout=widgets.Layout(**plot_layout)),
                                     "nw-plot-frames")
        self.history_image = _classed(widgets.Image(format="png",
                                                    layout=widgets.Layout(**plot_layout)),
                                      "nw-plot-history")
        self.plot_note = widgets.HTML()
        self.plot = _classed(widgets.HBox([self.frames_image, self.history_image, self.plot_note],
                                          layout=widgets.Layout(flex_flow="row wrap")), "nw-plot")
        self.batch = _classed(widgets.Dropdown(options=[], description="batch",
                                               layout=widgets.Layout(width="200px")), "nw-batch")
        reason = source.no_replay_reason
        self.rerun = _classed(widgets.Button(
            description="re-run in trace mode" if not reason else "re-run not available",
            tooltip=reason or "replay this batch op by op and show where the NaN is made",
            disabled=bool(reason), layout=widgets.Layout(width="220px")), "nw-rerun")
        self.trace = _classed(widgets.HTML(
            value=f"<i>{html.escape(reason)}</i>" if reason else ""), "nw-trace")
        self.export = _classed(widgets.Button(description="export frames", icon="download",
                                              tooltip="write the filtered frames to a file"),
                               "nw-export")
        self.export_path = _classed(widgets.HTML(), "nw-export-path")

        self.prev.on_click(lambda _: self.step(-1))
        self.next.on_click(lambda _: self.step(+1))
        self.first_bad.on_click(lambda _: self.jump_to_first_bad())
        self.frame.observe(self._on_frame, names="value")
        for control in (self.filter_layer, self.filter_type, self.filter_role, self.only_bad):
            control.observe(self._on_filter, names="value")
        self.view.observe(self._on_view, names="value")
        self.refresh.on_click(lambda _: self.reload())
        self.rerun.on_click(lambda _: self.rerun_batch())
        self.export.on_click(lambda _: self.export_frames())

    def _layout(self) -> list[widgets.Widget]:
        return [
            self.status,
            widgets.HBox([self.view, self.refresh]),
            widgets.HBox([self.prev, self.frame, self.next, self.first_bad]),
            widgets.HBox([self.filter_layer, self.filter_type, self.filter_role, self.only_bad]),
            self.table,
            self.plot,
            widgets.HBox([self.batch, self.rerun, self.export, self.export_path]),
            self.trace,
        ]

    # ------------------------------------------------------------------ data
    def _load_view(self, name: str, keep_filters: bool = False) -> None:
        """Read the view's DataFrame and index it once; filters and steps reuse the index."""
        self._view_label = name
        self.index = FrameIndex(self.source.views[name]())
        self.history = self.source.history() if self.source.history is not None else None
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
        count = len(self._visible)
        if start is not None and count:
            # Stay on (or just after) the frame that was shown.
            target = int(min(np.searchsorted(self._visible, start), count - 1))
        else:
            target = count - 1 if count else 0
        self._updating = True
        try:
            self.frame.max = max(count, 1)
            self.frame.value = target + 1  # the slider counts from 1, as people do
            self.frame.disabled = count <= 1
        finally:
            self._updating = False
        self._render_frame()
        self._render_status()
        self._render_plots()

    def _on_frame(self, change: dict) -> None:
        if not self._updating:
            self._render_frame()

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
            self.table.value = ("<i>No frames to show.</i>" if not self.index.n_frames
                                else "<i>No frames match the filters.</i>")
            return
        position = int(self._visible[self.frame.value - 1])
        self.table.value = self.index.frame_html(position, self._mask, self.frame.value - 1,
                                                 len(self._visible))

    def _status_text(self) -> str:
        index = self.index
        if not index.n_frames:
            held = "no frames held"
        else:
            batches = index.batches
            span = f"batch {batches[0]}" if batches[0] == batches[-1] else \
                f"batches {batches[0]}–{batches[-1]}"
            ranks = f", ranks {index.ranks[0]}–{index.ranks[-1]}" if len(index.ranks) > 1 else ""
            held = f"{index.n_frames} frames ({index.n_rows} tensors) held, {span}{ranks}"
            if len(self._visible) != index.n_frames:
                held += f" · {len(self._visible)} match the filters"
        events = self.source.events
        if events:
            more = f" ({len(events)} events; first shown)" if len(events) > 1 else ""
            words = f"<span style='color:#b00000'>{html.escape(events[0].summary(), quote=False)}</span>{more}"
        elif index.frame_bad.any():
            words = "<span style='color:#b00000'>NaN/Inf in these frames</span>"
        else:
            words = "no NaN/Inf seen"
        return f"{held} · {words}"

    def _render_status(self) -> None:
        self.status.value = self._status_text()

    def _render_plots(self) -> None:
        if not self.show_plots:
            self.plot.layout.display = "none"
            return
        rows = self.filtered_frames
        self.frames_image.value = figure_png(plot_frames(
            rows, title=f"abs max / abs min per frame ({self._view_label})"))
        history = self.history
        if history is None or history.empty:
            self.history_image.layout.display = "none"
            self.plot_note.value = "" if history is None else "<i>no history yet</i>"
            return
        pattern = layer_pattern(self.filter_layer.value)
        chosen = history
        if pattern is not None:
            chosen = chosen[chosen["module"].map(lambda m: bool(pattern.search(module_label(m))))]
        if self.filter_type.value not in (_ANY_TYPE, None):
            chosen = chosen[chosen["module_type"] == self.filter_type.value]
        modules = largest_modules(chosen)
        output_dtypes = rows.loc[rows["role"].astype(str).str.startswith("output"), "dtype"]
        dtype = output_dtypes.iloc[-1] if len(output_dtypes) else None
        self.history_image.layout.display = None
        self.history_image.value = figure_png(plot_history(history, modules, dtype=dtype or None))
        self.plot_note.value = ""

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
            trace = watch.replay(batch)
        except Exception as error:  # a batch no longer held, a closed watch: say so, stay usable
            self.trace.value = (f"<span style='color:#b00000'>could not re-run batch {batch}: "
                                f"{html.escape(f'{type(error).__name__}: {error}')}</span>")
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
            where = html.escape(str(first.get("source", "")))
            module = html.escape(module_label(str(first.get("module", ""))))
            headline = (f"<b style='color:#b00000'>first bad op: {op}</b> in module {module}"
                        f" at {where}")
        elif not getattr(trace, "reproduced", True):
            headline = (f"<b>not reproduced</b>, because "
                        f"{html.escape(trace.why_not_reproduced())}")
        else:
            headline = f"<b>{html.escape(trace.summary())}</b>"
        report = html.escape(trace.report()) if callable(getattr(trace, "report", None)) else ""
        self.trace.value = (f"<div class='nw-trace-head'>{headline}</div><pre style='line-height:1.3;max-height:"
                            f"320px;overflow:auto;font-size:11px'>{report}</pre>")

    def export_frames(self) -> Path:
        """Write the filtered frames: parquet when pyarrow is there, else CSV. Returns the path."""
        rows = self.filtered_frames
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.export_dir.mkdir(parents=True, exist_ok=True)
        try:
            import pyarrow  # noqa: F401
            suffix = ".parquet"
        except ImportError:
            suffix = ".csv"
        path = self.export_dir / f"nanwidget-frames-{stamp}{suffix}"
        counter = 1
        while path.exists():
            path = self.export_dir / f"nanwidget-frames-{stamp}-{counter}{suffix}"
            counter += 1
        if suffix == ".parquet":
            table = rows.copy()
            table["shape"] = table["shape"].map(lambda s: list(s) if isinstance(s, tuple) else s)
            table.to_parquet(path, index=False)
        else:
            rows.to_csv(path, index=False)
        self.last_export = path
        self.export_path.value = f"wrote {len(rows)} rows to <code>{html.escape(str(path))}</code>"
        return path

"""One frame table, indexed once so that stepping and filtering stay cheap at 10,000 rows."""

from __future__ import annotations

import html
import math
import re

import numpy as np
import pandas as pd

from ..core.schema import note_has_stats
from ..core.stats import dtype_max
from ..plots.common import frame_keys, module_label, role_groups
from ..plots.frames import frame_name
from .theme import ALERT, NEAR_LIMIT_ROW, NONFINITE_ROW

__all__ = ["FrameIndex", "NEAR_LIMIT_FRACTION", "layer_pattern", "layer_pattern_problem"]

# An abs max above this fraction of its dtype's largest value is marked (fp16: 6550.4).
NEAR_LIMIT_FRACTION = 0.1

_NONFINITE_STYLE = NONFINITE_ROW
_NEAR_STYLE = NEAR_LIMIT_ROW
_CELL = "padding:1px 8px;text-align:right;font-family:monospace"
_CELL_LEFT = "padding:1px 8px;text-align:left;font-family:monospace"


def layer_pattern(text: str) -> re.Pattern[str] | None:
    """The layer filter: a regular expression, or the literal text when it is not a valid one."""
    text = text.strip()
    if not text:
        return None
    try:
        return re.compile(text, re.IGNORECASE)
    except re.error:
        return re.compile(re.escape(text), re.IGNORECASE)


def layer_pattern_problem(text: str) -> str:
    """Why the layer filter ``text`` is not a valid regular expression (it is then matched as
    plain text); "" when it is one."""
    text = text.strip()
    if not text:
        return ""
    try:
        re.compile(text)
    except re.error as error:
        return (f"the layer pattern {text!r} is not a valid regular expression ({error}): "
                "matched as plain text")
    return ""


def _number(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    return f"{value:.3e}"


class FrameIndex:
    """A frames DataFrame grouped per frame once: rows of each frame, flags per row."""

    def __init__(self, frames: pd.DataFrame) -> None:
        table = frames.reset_index(drop=True)
        self.table = table
        self.n_rows = len(table)
        if self.n_rows:
            codes, first_rows = frame_keys(table)
        else:
            codes, first_rows = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        self.codes = codes
        self.n_frames = len(first_rows)
        self.first_rows = first_rows
        order = np.argsort(codes, kind="stable")
        bounds = np.searchsorted(codes[order], np.arange(self.n_frames + 1))
        self.rows_of_frame = [order[bounds[i]:bounds[i + 1]] for i in range(self.n_frames)]
        self.row_bad = (table["nan"].to_numpy(dtype=bool) | table["inf"].to_numpy(dtype=bool)) \
            if self.n_rows else np.zeros(0, dtype=bool)
        self.frame_bad = np.zeros(self.n_frames, dtype=bool)
        np.logical_or.at(self.frame_bad, codes, self.row_bad)
        self.role_group = role_groups(table).to_numpy() if self.n_rows else np.zeros(0, object)
        limits = {d: dtype_max(d) for d in table["dtype"].unique()} if self.n_rows else {}
        limit = table["dtype"].map(limits).to_numpy(dtype=np.float64) if self.n_rows else np.zeros(0)
        with np.errstate(invalid="ignore"):
            self.row_limit = limit
            self.row_near = np.isfinite(limit) & (table["abs_max"].to_numpy(dtype=np.float64)
                                                  > NEAR_LIMIT_FRACTION * limit) if self.n_rows \
                else np.zeros(0, dtype=bool)
        self.module = table["module"].astype(str).to_numpy() if self.n_rows else np.zeros(0, object)
        self.module_type = table["module_type"].astype(str).to_numpy() if self.n_rows \
            else np.zeros(0, object)
        self.modules = sorted(set(self.module))
        self.module_types = sorted(set(self.module_type))
        self.batches = sorted(int(b) for b in table["batch"].unique()) if self.n_rows else []
        self.ranks = sorted(int(r) for r in table["rank"].unique()) if self.n_rows else []
        key_columns = ["rank", "batch", "phase", "frame"]
        keys = zip(*(table[c].to_numpy()[first_rows].tolist() for c in key_columns)) \
            if self.n_rows else iter(())
        self._position = {key: i for i, key in enumerate(keys)}

    # ------------------------------------------------------------------ filtering
    def row_mask(self, layer: str = "", module_type: str = "", role_group: str = "",
                 only_bad: bool = False) -> np.ndarray:
        """Rows that pass the filters (empty strings mean "any")."""
        mask = np.ones(self.n_rows, dtype=bool)
        pattern = layer_pattern(layer)
        if pattern is not None:
            matching = {m for m in self.modules if pattern.search(module_label(m))}
            mask &= np.isin(self.module, list(matching))
        if module_type:
            mask &= self.module_type == module_type
        if role_group:
            mask &= self.role_group == role_group
        if only_bad:
            mask &= self.row_bad
        return mask

    def visible_frames(self, mask: np.ndarray) -> np.ndarray:
        """Frame positions (in frame order) that keep at least one row under ``mask``."""
        return np.unique(self.codes[mask])

    def position_of(self, rank: int, batch: int, phase: str, frame: int) -> int | None:
        return self._position.get((rank, batch, phase, frame))

    def frame_name(self, position: int) -> str:
        """Frame ``position`` as the DataFrame names it: "batch 3, frame 2" (the rank in front
        when the table holds several)."""
        first = self.table.iloc[int(self.first_rows[position])]
        rank = first["rank"] if len(self.ranks) > 1 else None
        return frame_name(first["batch"], first["frame"], rank)

    # ------------------------------------------------------------------ rendering
    def frame_html(self, position: int, mask: np.ndarray | None) -> str:
        """The table of frame ``position``: its rows under ``mask``, flagged, under a heading
        that names the frame as the DataFrame does ("batch 3, frame 2": the ``batch`` and
        ``frame`` columns, ``frame`` counting the hooks of the batch as they fired)."""
        rows = self.rows_of_frame[position]
        if mask is not None:
            rows = rows[mask[rows]]
        table = self.table
        first = table.iloc[int(self.first_rows[position])]
        bad = f" · <b class='nw-alert' style='{ALERT}'>NaN/Inf</b>" if self.frame_bad[position] else ""
        head = (f"<div class='nw-frame-head'><b>{html.escape(self.frame_name(position))}</b> · "
                f"<b>{html.escape(module_label(str(first['module'])))}</b>"
                f" ({html.escape(str(first['module_type']))}) · "
                f"{html.escape(str(first['phase']))} · call {first['call']}{bad}</div>")
        lines = ["<table class='nw-table' style='border-collapse:collapse'>",
                 "<thead><tr>" + "".join(
                     f"<th style='{_CELL_LEFT if i < 3 else _CELL}'>{name}</th>"
                     for i, name in enumerate(("role", "dtype", "shape", "abs min", "abs max",
                                               "flag"))) + "</tr></thead><tbody>"]
        roles = table["role"].to_numpy()
        dtypes = table["dtype"].to_numpy()
        shapes = table["shape"].to_numpy()
        mins = table["abs_min"].to_numpy()
        maxs = table["abs_max"].to_numpy()
        nans = table["nan"].to_numpy()
        infs = table["inf"].to_numpy()
        notes = table["note"].to_numpy()
        for row in rows:
            style, css, flag = "", "", ""
            note = str(notes[row])
            if self.row_bad[row]:
                kinds = "+".join(k for k, v in (("NaN", nans[row]), ("Inf", infs[row])) if v)
                style, css, flag = _NONFINITE_STYLE, "nw-nonfinite", kinds
            elif self.row_near[row]:
                limit = self.row_limit[row]
                style, css = _NEAR_STYLE, "nw-near-limit"
                flag = (f"near {dtypes[row]} max: {maxs[row] / limit:.0%} of {limit:.6g}")
            if note and note not in ("", "pending"):
                flag = f"{flag}; {note}" if flag else note
            shape = shapes[row]
            shape_text = "×".join(str(s) for s in shape) if isinstance(shape, (tuple, list)) \
                else str(shape)
            no_stats = not note_has_stats(note) and not self.row_bad[row]
            low = "–" if no_stats else _number(float(mins[row]))
            high = "–" if no_stats else _number(float(maxs[row]))
            lines.append(
                f"<tr class='{css}' style='{style}'><td style='{_CELL_LEFT}'>{html.escape(str(roles[row]))}"
                f"</td><td style='{_CELL_LEFT}'>{html.escape(str(dtypes[row]))}</td>"
                f"<td style='{_CELL_LEFT}'>{html.escape(shape_text)}</td><td style='{_CELL}'>{low}</td>"
                f"<td style='{_CELL}'>{high}</td><td style='{_CELL_LEFT}'>{html.escape(flag)}</td></tr>")
        lines.append("</tbody></table>")
        return head + "".join(lines)

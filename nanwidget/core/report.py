"""Text reports in the layout transformers' DebugUnderflowOverflow users already read."""

from __future__ import annotations

import math
import unicodedata
from typing import Any

import pandas as pd
import torch

from .events import NanEvent
from .schema import LEAF_NOTES, NO_STATS_NOTES

__all__ = ["format_frames", "format_event_report", "detect_overflow", "printable"]

# Categories a terminal acts on instead of showing: controls, format (bidi overrides), separators.
_HIDDEN_CATEGORIES = ("Cc", "Cf", "Zl", "Zp")


def printable(text: str, keep_newlines: bool = True) -> str:
    """``text`` with every control or format character written as an escape (``\\x1b``)."""
    out = []
    for char in text:
        if char == "\n" and keep_newlines:
            out.append(char)
        elif unicodedata.category(char) in _HIDDEN_CATEGORIES:
            out.append(repr(char)[1:-1])  # none of these is printable: repr escapes it
        else:
            out.append(char)
    return "".join(out)

_HEADER_INDENT = " " * 17  # transformers prints frame headers after this prefix
_COLUMNS_HEADER = f"{'abs min':8} {'abs max':8} metadata"
_FRAME_KEYS = ["rank", "batch", "phase", "frame"]


def _number(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'nan':>8}"
    return f"{value:8.2e}"


def _batch_separator(batch: int) -> list[str]:
    """What transformers prints when a batch starts, also inside a dump that spans batches."""
    return [*_BATCH_START_GAP, f"{_HEADER_INDENT} *** Starting batch number={batch} ***",
            _COLUMNS_HEADER]


_BATCH_START_GAP = ["", ""]  # the empty lines before a batch's start


def _tensor_line(row: Any) -> str:
    if row.note in LEAF_NOTES:  # the word right-aligned, as transformers prints it
        return f"{row.note:>17} {row.role}"
    has_numbers = bool(row.nan) or not math.isnan(row.abs_max)
    if not has_numbers and row.note:
        # No stats: what it was instead (an addition; transformers' hook crashes on most of these).
        return f"{'-':>8} {'-':>8} {row.role} ({row.note}, {row.dtype})"
    flag = ""
    if row.nan or row.inf:
        flag = "  <-- " + "+".join(k for k, v in (("nan", row.nan), ("inf", row.inf)) if v)
    elif row.note and row.note not in NO_STATS_NOTES:
        # A caveat on the numbers ("changed in place later"); a kind ("int") needs no remark.
        flag = f"  ({row.note})"
    return f"{_number(row.abs_min)} {_number(row.abs_max)} {row.role}{flag}"


def format_frames(frames: pd.DataFrame, separators: bool = False) -> list[str]:
    """One block per frame: a header with module name and class, then a line per tensor.

    With ``separators``, the first frame of each batch (and a batch change inside the table)
    is preceded by transformers' ``*** Starting batch number=N ***`` lines, so a dump that
    spans batches says where each one starts.
    """
    lines: list[str] = []
    if frames.empty:
        return lines
    previous_batch: tuple[int, int] | None = None
    for _, frame in frames.groupby(_FRAME_KEYS, sort=False):
        first = frame.iloc[0]
        batch = (int(first["rank"]), int(first["batch"]))
        if separators and first["phase"] == "forward" and (
                int(first["frame"]) == 0 or (previous_batch is not None and batch != previous_batch)):
            lines.extend(_batch_separator(batch[1]))
        previous_batch = batch
        call = f" call {first['call']}" if first["call"] else ""
        phase = " (backward)" if first["phase"] == "backward" else ""
        lines.append(f"{_HEADER_INDENT} {first['module']} {first['module_type']}{call}{phase}")
        lines.extend(_tensor_line(row) for row in frame.itertuples(index=False))
    return lines


def format_event_report(event: NanEvent | None, frames: pd.DataFrame, batch: int | None = None,
                        trace_frames: pd.DataFrame | None = None) -> str:
    """The whole dump, in the order transformers prints it during a run.

    A sentence in words and the diagnosis (with an event), then every frame of the trace batches
    (``trace_frames``: those recorded before the event), then the dump of ``frames``: the
    event's window, or the frames held when there is no event.
    """
    out: list[str] = []
    if event is not None:
        out.append(f"nanwidget: {event.summary()}")
        if event.diagnosis is not None:
            out.extend(event.diagnosis.lines())
    if trace_frames is not None and not trace_frames.empty:
        out.extend(format_frames(trace_frames, separators=True))
    if out:
        out.append("")
    if event is not None:
        out.append(f"Detected inf/nan during batch_number={event.batch}")
    elif batch is not None and batch >= 0:
        out.append(f"No inf/nan detected (batch_number={batch})")
    elif batch is not None:  # batches are numbered from 0: none ran yet
        out.append("No inf/nan detected: no batch has run under this watch yet")
    if event is not None and frames.empty:
        # Sentinel mode records no frames as a batch runs; when the replay did not reproduce
        # the event its frames are not the batch's own, and its report below shows them.
        replayed = event.trace is not None and not event.trace.frames.empty
        out.append(f"No frames of batch {event.batch} were recorded as it ran"
                   + (" (the replay's frames are below)." if replayed else "."))
        if event.frames_note:
            out.append(f"({event.frames_note})")
        if event.trace is not None:
            out.append("")
            out.append(event.trace.report())
        return "\n".join(out)
    n_frames = 0 if frames.empty else frames.groupby(_FRAME_KEYS).ngroups
    phases = set(frames["phase"]) if not frames.empty else {"forward"}
    direction = "forward and backward" if len(phases) > 1 else phases.pop()
    out.append(f"Last {n_frames} {direction} frames:")
    if event is not None and event.frames_note:
        out.append(f"({event.frames_note})")
    dump = format_frames(frames, separators=True)
    if dump[:len(_BATCH_START_GAP)] == _BATCH_START_GAP:
        # The dump opens where a batch starts: that start's own column header serves, and no
        # empty block under "Last N ... frames:" comes first (transformers prints one there).
        dump = dump[len(_BATCH_START_GAP):]
    else:
        out.append(_COLUMNS_HEADER)
    out.extend(dump)
    if event is not None and event.trace is not None:
        out.append("")
        out.append(event.trace.report())
    return "\n".join(out)


def detect_overflow(var: torch.Tensor, ctx: str) -> bool:
    """Print "<ctx> has nans" / "<ctx> has infs" and return whether either was found.

    A debugging helper to drop into a forward pass, as in transformers; it synchronises
    with the device, so keep it out of hot loops.
    """
    if not isinstance(var, torch.Tensor):
        raise TypeError(f"detect_overflow needs a tensor, got {type(var).__name__} "
                        f"({ctx!r}); check what that line receives")
    if not (var.is_floating_point() or var.is_complex()):
        return False  # integer and bool tensors hold no NaN or Inf
    detected = False
    with torch.no_grad():
        flags = torch.stack([torch.isnan(var).any(), torch.isinf(var).any()]).tolist()
    if flags[0]:
        detected = True
        print(f"{ctx} has nans")
    if flags[1]:
        detected = True
        print(f"{ctx} has infs")
    return detected

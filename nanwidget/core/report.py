"""Text reports in the layout transformers' DebugUnderflowOverflow users already read."""

from __future__ import annotations

import math

import pandas as pd
import torch

from .events import NanEvent

__all__ = ["format_frames", "format_event_report", "detect_overflow"]

_HEADER_INDENT = " " * 17  # transformers prints frame headers after this prefix
_SILENT_NOTES = ("None", "not a tensor")


def _number(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'nan':>8}"
    return f"{value:8.2e}"


def format_frames(frames: pd.DataFrame) -> list[str]:
    """One block per frame: a header with module name and class, then a line per tensor."""
    lines: list[str] = []
    if frames.empty:
        return lines
    keys = ["rank", "batch", "phase", "frame"]
    for _, frame in frames.groupby(keys, sort=False):
        first = frame.iloc[0]
        call = f" call {first['call']}" if first["call"] else ""
        phase = " (backward)" if first["phase"] == "backward" else ""
        lines.append(f"{_HEADER_INDENT} {first['module']} {first['module_type']}{call}{phase}")
        for row in frame.itertuples(index=False):
            if row.note in _SILENT_NOTES:
                continue
            if row.note and row.note not in ("", "changed in place later") and math.isnan(row.abs_max):
                lines.append(f"{'-':>8} {'-':>8} {row.role} ({row.note}, {row.dtype})")
                continue
            flag = ""
            if row.nan or row.inf:
                flag = "  <-- " + "+".join(k for k, v in (("nan", row.nan), ("inf", row.inf)) if v)
            elif row.note:
                flag = f"  ({row.note})"
            lines.append(f"{_number(row.abs_min)} {_number(row.abs_max)} {row.role}{flag}")
    return lines


def format_event_report(event: NanEvent | None, frames: pd.DataFrame, batch: int | None = None) -> str:
    """The whole dump: a sentence in words, then transformers' layout."""
    out: list[str] = []
    if event is not None:
        out.append(f"nanwidget: {event.summary()}")
        out.append("")
        out.append(f"Detected inf/nan during batch_number={event.batch}")
    else:
        if batch is not None:
            out.append(f"No inf/nan detected (batch_number={batch})")
    n_frames = 0 if frames.empty else frames.groupby(["rank", "batch", "phase", "frame"]).ngroups
    phases = set(frames["phase"]) if not frames.empty else {"forward"}
    direction = "forward and backward" if len(phases) > 1 else phases.pop()
    out.append(f"Last {n_frames} {direction} frames:")
    out.append(f"{'abs min':8} {'abs max':8} metadata")
    out.extend(format_frames(frames))
    if event is not None and event.trace is not None:
        out.append("")
        out.append(event.trace.report())
    return "\n".join(out)


def detect_overflow(var: torch.Tensor, ctx: str) -> bool:
    """Print "<ctx> has nans" / "<ctx> has infs" and return whether either was found.

    A debugging helper to drop into a forward pass, as in transformers; it synchronises
    with the device, so keep it out of hot loops.
    """
    if not isinstance(var, torch.Tensor) or not (var.is_floating_point() or var.is_complex()):
        return False
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

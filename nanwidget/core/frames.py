"""The frame: one module call and every tensor it touched. The one data model of nanwidget.

Hooks build :class:`Frame` objects whose entries point at :class:`TensorStats` that are filled
when the batch resolves; everything downstream (events, report, history, plots, widgets,
persistence) reads frames through :func:`frames_to_dataframe`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import pandas as pd

from .stats import TensorStats

__all__ = ["Frame", "FrameBuffer", "FRAME_COLUMNS", "frames_to_dataframe", "empty_frames",
           "non_tensor_entry"]

FRAME_COLUMNS = ["rank", "batch", "frame", "module", "module_type", "call", "phase", "role",
                 "dtype", "shape", "abs_min", "abs_max", "nan", "inf", "note"]

# One entry: (role, stats or None, dtype, shape, note). A tuple keeps the hook cheap.
Entry = tuple[str, "TensorStats | None", Any, Any, str]


class Frame:
    """One call of one module in one phase."""

    __slots__ = ("rank", "batch", "index", "module", "module_type", "call", "phase", "entries",
                 "first_output")

    def __init__(self, rank: int, batch: int, index: int, module: str, module_type: str,
                 call: int, phase: str, entries: list[Entry]) -> None:
        self.rank = rank
        self.batch = batch
        self.index = index
        self.module = module
        self.module_type = module_type
        self.call = call
        self.phase = phase
        self.entries = entries
        # Entries from here on are the outputs (forward frames); set by the recorder.
        self.first_output = len(entries)

    def nonfinite_entries(self) -> list[Entry]:
        return [e for e in self.entries if e[1] is not None and (e[1].nan or e[1].inf)]

    def rows(self) -> Iterable[tuple]:
        head = (self.rank, self.batch, self.index, self.module, self.module_type, self.call,
                self.phase)
        for role, stats, dtype, shape, note in self.entries:
            dtype_name = str(dtype).replace("torch.", "") if dtype is not None else ""
            shape_tuple = tuple(shape) if shape is not None else ()
            if stats is None:
                yield head + (role, dtype_name, shape_tuple, float("nan"), float("nan"),
                              False, False, note)
            else:
                yield head + (role, dtype_name, shape_tuple, stats.abs_min, stats.abs_max,
                              stats.nan, stats.inf, stats.note if stats.note != "pending" else "pending")

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Frame(batch={self.batch}, index={self.index}, module={self.module!r}, "
                f"call={self.call}, phase={self.phase!r}, entries={len(self.entries)})")


def non_tensor_entry(role: str, leaf: Any) -> Entry:
    """The entry of a leaf that is not a tensor: no stats, a note saying what it is."""
    return (role, None, None, None, "None" if leaf is None else "not a tensor")


def empty_frames() -> pd.DataFrame:
    """A frames DataFrame with the contract's columns and no rows."""
    return frames_to_dataframe([])


def frames_to_dataframe(frames: Iterable[Frame]) -> pd.DataFrame:
    """Tidy DataFrame, one row per tensor seen, columns as in the contract."""
    rows = [row for frame in frames for row in frame.rows()]
    table = pd.DataFrame.from_records(rows, columns=FRAME_COLUMNS)
    return table.astype({"rank": "int64", "batch": "int64", "frame": "int64", "call": "int64",
                         "abs_min": "float64", "abs_max": "float64", "nan": "bool",
                         "inf": "bool"})


class FrameBuffer:
    """The last ``max_frames`` resolved frames (a ring, like transformers' frame deque)."""

    def __init__(self, max_frames: int) -> None:
        self.max_frames = max_frames
        self._frames: deque[Frame] = deque(maxlen=max_frames)

    def extend(self, frames: list[Frame]) -> None:
        self._frames.extend(frames[-self.max_frames:])

    def window_ending_with(self, batch_frames: list[Frame], position: int) -> list[Frame]:
        """The ``max_frames`` frames ending with ``batch_frames[position]``, earlier batches included."""
        own = batch_frames[max(0, position + 1 - self.max_frames): position + 1]
        missing = self.max_frames - len(own)
        earlier = list(self._frames)[-missing:] if missing > 0 else []
        return earlier + own

    def __iter__(self):
        return iter(list(self._frames))

    def __len__(self) -> int:
        return len(self._frames)

    def clear(self) -> None:
        self._frames.clear()

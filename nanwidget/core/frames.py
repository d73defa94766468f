"""The frame: one module call and every tensor it touched. The one data model of nanwidget.

Hooks build :class:`Frame` objects whose entries point at stats that are filled when the batch
resolves; everything downstream (events, report, history, plots, widgets, persistence) reads
frames through :func:`frames_to_dataframe`, whose columns are
:data:`~nanwidget.core.schema.FRAME_COLUMNS`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import pandas as pd

from .entries import Entry
from .schema import FRAME_COLUMNS, FRAME_DTYPES, empty_table

__all__ = ["Frame", "FrameBuffer", "frames_to_dataframe", "empty_frames", "weights_finite_last",
           "weights_nonfinite_batches"]

_NAN = float("nan")


class Frame:
    """One call of one module in one phase.

    A forward frame's entries are the module's own weights (parameters and buffers, by name),
    then its inputs, then its outputs: read them with :meth:`weights`, :meth:`inputs` and
    :meth:`outputs`. A backward frame's entries are gradients (:meth:`grads`).
    """

    __slots__ = ("rank", "batch", "index", "module", "module_type", "call", "phase", "entries",
                 "first_input", "first_output")

    def __init__(self, rank: int, batch: int, index: int, module: str, module_type: str,
                 call: int, phase: str, entries: list[Entry], first_output: int | None = None,
                 first_input: int = 0) -> None:
        self.rank = rank
        self.batch = batch
        self.index = index
        self.module = module
        self.module_type = module_type
        self.call = call
        self.phase = phase
        self.entries = entries
        # Entries from first_output on are the outputs (forward frames; backward frames have
        # none); the weights come before first_input.
        self.first_output = len(entries) if first_output is None else first_output
        self.first_input = first_input

    def weights(self) -> list[Entry]:
        """The module's own parameters and buffers (forward frames)."""
        return self.entries[:self.first_input] if self.phase == "forward" else []

    def inputs(self) -> list[Entry]:
        """The module's inputs, positional (``input[i]...``) then keyword (``kwarg:name...``)."""
        return self.entries[self.first_input:self.first_output] if self.phase == "forward" else []

    def outputs(self) -> list[Entry]:
        """The module's outputs (``output``, ``output[1]``, ``output.logits`` ...)."""
        return self.entries[self.first_output:] if self.phase == "forward" else []

    def grads(self) -> list[Entry]:
        """A backward frame's gradients (``grad_output[i]``, ``grad_input[i]``)."""
        return list(self.entries) if self.phase == "backward" else []

    def nonfinite_entries(self) -> list[Entry]:
        """Entries whose tensor holds a NaN or an Inf."""
        return [e for e in self.entries if e.nonfinite]

    def rows(self) -> Iterator[tuple]:
        """One tuple per entry, in :data:`FRAME_COLUMNS` order."""
        head = (self.rank, self.batch, self.index, self.module, self.module_type, self.call,
                self.phase)
        for role, stats, dtype, shape, note in self.entries:
            dtype_name = str(dtype).replace("torch.", "") if dtype is not None else ""
            shape_tuple = tuple(shape) if shape is not None else ()
            if stats is None:
                yield head + (role, dtype_name, shape_tuple, _NAN, _NAN, _NAN, _NAN, False,
                              False, note)
            else:  # an entry's own note (e.g. "written in place here") wins over its stats'
                yield head + (role, dtype_name, shape_tuple, stats.abs_min, stats.abs_max,
                              stats.finite_abs_min, stats.finite_abs_max, stats.nan, stats.inf,
                              note or stats.note)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Frame(batch={self.batch}, index={self.index}, module={self.module!r}, "
                f"call={self.call}, phase={self.phase!r}, entries={len(self.entries)})")


def empty_frames() -> pd.DataFrame:
    """A frames DataFrame with the contract's columns and no rows."""
    return empty_table(FRAME_COLUMNS, FRAME_DTYPES)


def frames_to_dataframe(frames: Iterable[Frame]) -> pd.DataFrame:
    """Tidy DataFrame, one row per tensor seen, columns as in the contract."""
    rows = [row for frame in frames for row in frame.rows()]
    if not rows:
        return empty_frames()
    table = pd.DataFrame.from_records(rows, columns=FRAME_COLUMNS)
    return table.astype({name: dtype for name, dtype in FRAME_DTYPES.items() if dtype != "object"})


def weights_finite_last(frames: pd.DataFrame | None, names: Iterable[str],
                        before: int) -> dict[str, int]:
    """Per weight of ``names`` (qualified: ``module.role``): the last batch before ``before``
    whose forward frames in ``frames`` show it measured and finite (absent: none shows it)."""
    names = set(names)
    if frames is None or frames.empty or not names:
        return {}
    qualified = frames["module"].where(frames["module"] == "", frames["module"] + ".") + frames["role"]
    finite = frames[(frames["phase"] == "forward") & (frames["batch"] < before)
                    & qualified.isin(names) & ~frames["nan"] & ~frames["inf"]
                    & frames["abs_max"].notna()]
    return {name: int(last) for name, last in
            finite.groupby(qualified[finite.index])["batch"].max().items()}


def weights_nonfinite_batches(frames: pd.DataFrame | None, names: Iterable[str],
                              before: int) -> set[int]:
    """The batches before ``before`` whose forward frames in ``frames`` show every weight of
    ``names`` (qualified: ``module.role``) holding NaN/Inf."""
    names = set(names)
    if frames is None or frames.empty or not names:
        return set()
    qualified = frames["module"].where(frames["module"] == "", frames["module"] + ".") + frames["role"]
    bad = frames[(frames["phase"] == "forward") & (frames["batch"] < before)
                 & qualified.isin(names) & (frames["nan"] | frames["inf"])]
    held: dict[int, set[str]] = {}
    for batch, name in zip(bad["batch"], qualified[bad.index]):
        held.setdefault(int(batch), set()).add(name)
    return {batch for batch, bad_names in held.items() if names <= bad_names}


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

    def __iter__(self) -> Iterator[Frame]:
        return iter(list(self._frames))

    def __len__(self) -> int:
        return len(self._frames)

    def clear(self) -> None:
        self._frames.clear()


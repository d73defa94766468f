"""Bounded per-batch history of every module's output magnitude, for trend plots.

The last ``full_batches`` batches are kept at full resolution; older batches are merged into
windows (max of abs_max, min of abs_min, any non-finite) whose range is recorded in ``batch`` /
``batch_end``. When the windows themselves grow past ``max_windows``, neighbours merge and the
windows double in width. Nothing is dropped silently; memory stays bounded forever:
a 200-module model costs about 17 bytes x 200 x (10,100 + 1,000) = 38 MB.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

__all__ = ["History", "HISTORY_COLUMNS"]

HISTORY_COLUMNS = ["rank", "batch", "batch_end", "module", "module_type", "abs_max", "abs_min",
                   "nonfinite"]

_SEEN, _NONFINITE = 1, 2


class _Rows:
    """Growable 2-D arrays (rows x modules) of abs_max, abs_min and flags."""

    def __init__(self, n_modules: int, capacity: int) -> None:
        self.capacity = capacity
        self.n_modules = n_modules
        self.size = 0
        initial = min(capacity, 64)
        self.batch = np.zeros(initial, dtype=np.int64)
        self.batch_end = np.zeros(initial, dtype=np.int64)
        self.abs_max = np.full((initial, n_modules), -np.inf, dtype=np.float64)
        self.abs_min = np.full((initial, n_modules), np.inf, dtype=np.float64)
        self.flags = np.zeros((initial, n_modules), dtype=np.uint8)

    def _grow(self) -> None:
        new = min(self.capacity, max(64, 2 * len(self.batch)))
        extra = new - len(self.batch)
        self.batch = np.concatenate([self.batch, np.zeros(extra, np.int64)])
        self.batch_end = np.concatenate([self.batch_end, np.zeros(extra, np.int64)])
        self.abs_max = np.concatenate([self.abs_max, np.full((extra, self.n_modules), -np.inf, np.float64)])
        self.abs_min = np.concatenate([self.abs_min, np.full((extra, self.n_modules), np.inf, np.float64)])
        self.flags = np.concatenate([self.flags, np.zeros((extra, self.n_modules), np.uint8)])

    def append(self, batch: int, batch_end: int, abs_max: np.ndarray, abs_min: np.ndarray,
               flags: np.ndarray) -> None:
        if self.size == len(self.batch):
            self._grow()
        row = self.size
        self.batch[row], self.batch_end[row] = batch, batch_end
        self.abs_max[row], self.abs_min[row], self.flags[row] = abs_max, abs_min, flags
        self.size += 1

    def pop_front(self, count: int) -> tuple[np.ndarray, ...]:
        """Remove and return the oldest ``count`` rows."""
        parts = tuple(a[:count].copy() for a in (self.batch, self.batch_end, self.abs_max,
                                                 self.abs_min, self.flags))
        for array in (self.batch, self.batch_end, self.abs_max, self.abs_min, self.flags):
            array[: self.size - count] = array[count: self.size]
        self.size -= count
        return parts

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.batch, self.batch_end, self.abs_max, self.abs_min, self.flags))


class History:
    """Per (batch, module) output stats with bounded memory."""

    def __init__(self, modules: list[str], module_types: list[str], *, rank: int = 0,
                 full_batches: int = 10_000, max_windows: int = 1_000, window: int = 100) -> None:
        self.modules = modules
        self.module_types = module_types
        self.rank = rank
        self.full_batches = full_batches
        self.max_windows = max_windows
        self.window = window
        n = len(modules)
        self._full = _Rows(n, full_batches + window)
        self._windows = _Rows(n, max_windows + 1)
        # The batch being accumulated (several root calls may share one batch).
        self._current_batch: int | None = None
        self._cur_max = np.full(n, -np.inf, np.float64)
        self._cur_min = np.full(n, np.inf, np.float64)
        self._cur_flags = np.zeros(n, np.uint8)

    def record(self, batch: int, module_index: int, abs_max: float, abs_min: float,
               nonfinite: bool) -> None:
        """Fold one output's stats into the row of ``batch``."""
        if self._current_batch != batch:
            self.commit()
            self._current_batch = batch
        if not math.isnan(abs_max):
            if abs_max > self._cur_max[module_index]:
                self._cur_max[module_index] = abs_max
        if not math.isnan(abs_min):
            if abs_min < self._cur_min[module_index]:
                self._cur_min[module_index] = abs_min
        self._cur_flags[module_index] |= _SEEN | (_NONFINITE if nonfinite else 0)

    def commit(self) -> None:
        """Close the batch being accumulated (called when a new batch starts or on read)."""
        if self._current_batch is None:
            return
        if self._full.size >= self.full_batches + self.window:
            self._merge_oldest()
        b = self._current_batch
        self._full.append(b, b, self._cur_max, self._cur_min, self._cur_flags)
        self._current_batch = None
        self._cur_max.fill(-np.inf)
        self._cur_min.fill(np.inf)
        self._cur_flags.fill(0)

    def _merge_oldest(self) -> None:
        """Fold the oldest ``window`` full-resolution batches into one window (one memmove per window)."""
        batch, batch_end, abs_max, abs_min, flags = self._full.pop_front(self.window)
        self._windows.append(int(batch[0]), int(batch_end[-1]), abs_max.max(axis=0),
                             abs_min.min(axis=0), np.bitwise_or.reduce(flags, axis=0))
        if self._windows.size > self.max_windows:
            self._halve_windows()

    def _halve_windows(self) -> None:
        """Merge neighbouring windows pairwise: width doubles, count halves."""
        w = self._windows
        n = w.size
        pairs = n // 2
        even, odd = np.arange(0, 2 * pairs, 2), np.arange(1, 2 * pairs, 2)
        batch = w.batch[even].copy()
        batch_end = w.batch_end[odd].copy()
        abs_max = np.maximum(w.abs_max[even], w.abs_max[odd])
        abs_min = np.minimum(w.abs_min[even], w.abs_min[odd])
        flags = w.flags[even] | w.flags[odd]
        leftover = None
        if n % 2:
            leftover = (w.batch[n - 1], w.batch_end[n - 1], w.abs_max[n - 1].copy(),
                        w.abs_min[n - 1].copy(), w.flags[n - 1].copy())
        w.size = 0
        for i in range(pairs):
            w.append(int(batch[i]), int(batch_end[i]), abs_max[i], abs_min[i], flags[i])
        if leftover is not None:
            w.append(int(leftover[0]), int(leftover[1]), *leftover[2:])
        self.window *= 2
        self._full.capacity = self.full_batches + self.window

    def nbytes(self) -> int:
        """Memory held by the history arrays."""
        return self._full.nbytes() + self._windows.nbytes()

    def __len__(self) -> int:
        return self._full.size + self._windows.size + (self._current_batch is not None)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (batch or window, module that ran in it)."""
        self.commit()
        parts = []
        for rows in (self._windows, self._full):
            size = rows.size
            if size == 0:
                continue
            seen = (rows.flags[:size] & _SEEN).astype(bool)
            row_index, module_index = np.nonzero(seen)
            abs_max = rows.abs_max[:size][row_index, module_index].astype(np.float64)
            abs_min = rows.abs_min[:size][row_index, module_index].astype(np.float64)
            nonfinite = (rows.flags[:size][row_index, module_index] & _NONFINITE).astype(bool)
            # A module whose outputs held only NaN never got a real max/min.
            abs_max[np.isneginf(abs_max)] = np.nan
            abs_min[np.isposinf(abs_min) & ~np.isposinf(abs_max)] = np.nan
            names = np.asarray(self.modules, dtype=object)
            types = np.asarray(self.module_types, dtype=object)
            parts.append(pd.DataFrame({
                "rank": self.rank,
                "batch": rows.batch[:size][row_index],
                "batch_end": rows.batch_end[:size][row_index],
                "module": names[module_index] if len(names) else [],
                "module_type": types[module_index] if len(types) else [],
                "abs_max": abs_max, "abs_min": abs_min, "nonfinite": nonfinite,
            }))
        if not parts:
            return pd.DataFrame({c: pd.Series(dtype=t) for c, t in zip(
                HISTORY_COLUMNS, ["int64", "int64", "int64", "object", "object", "float64",
                                  "float64", "bool"])})
        table = pd.concat(parts, ignore_index=True)
        return table[HISTORY_COLUMNS].astype({"rank": "int64"})

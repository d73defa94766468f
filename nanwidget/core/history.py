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

from .schema import HISTORY_COLUMNS, HISTORY_DTYPES, empty_table

__all__ = ["History", "empty_history"]


def empty_history() -> pd.DataFrame:
    """A history DataFrame with the contract's columns and no rows."""
    return empty_table(HISTORY_COLUMNS, HISTORY_DTYPES)


_SEEN, _NONFINITE = 1, 2
# Closed batches buffered before one vectorised write (~100 us, most of it fixed): from
# _WRITE_ROWS on, once they hold _WRITE_ENTRIES (module, stats) entries or _MAX_WRITE_ROWS
# rows (the sentinel's one root entry per batch: every 512 batches). More entries held would
# cost more in garbage collection than the writes they save.
_WRITE_ROWS = 64
_WRITE_ENTRIES = 512
_MAX_WRITE_ROWS = 1024
# Rows looked back through for a batch recorded again after later ones (a replay of an earlier
# batch, or the sentinel's per-batch root row followed by that batch's replayed frames).
_FOLD_BACK = 8


class _Rows:
    """Ring of rows (rows x modules) of abs_max, abs_min and flags: popping the oldest rows
    moves no memory, so merging windows stays cheap however large the history is."""

    _ARRAYS = ("batch", "batch_end", "abs_max", "abs_min", "flags")

    def __init__(self, n_modules: int, capacity: int) -> None:
        self.capacity = capacity
        self.n_modules = n_modules
        self.size = 0
        self.head = 0  # physical index of the oldest row
        self._allocate(min(capacity, 64))

    def _allocate(self, rows: int) -> None:
        self.batch = np.zeros(rows, dtype=np.int64)
        self.batch_end = np.zeros(rows, dtype=np.int64)
        self.abs_max = np.full((rows, self.n_modules), -np.inf)
        self.abs_min = np.full((rows, self.n_modules), np.inf)
        self.flags = np.zeros((rows, self.n_modules), dtype=np.uint8)

    def physical(self, logical: np.ndarray | range) -> np.ndarray:
        return (self.head + np.asarray(logical, dtype=np.int64)) % len(self.batch)

    def _grow(self, needed: int) -> None:
        new = min(max(self.capacity, needed), max(64, 2 * len(self.batch), needed))
        order = self.physical(range(self.size))
        old = {name: getattr(self, name)[order] for name in self._ARRAYS}
        self._allocate(new)
        for name, values in old.items():
            getattr(self, name)[: self.size] = values
        self.head = 0

    def reserve(self, count: int) -> np.ndarray:
        """Add ``count`` empty rows at the end; return their physical indices."""
        if self.size + count > len(self.batch):
            self._grow(self.size + count)
        rows = self.physical(range(self.size, self.size + count))
        self.abs_max[rows] = -np.inf
        self.abs_min[rows] = np.inf
        self.flags[rows] = 0
        self.size += count
        return rows

    def append(self, batch: int, batch_end: int, abs_max: np.ndarray, abs_min: np.ndarray,
               flags: np.ndarray) -> None:
        row = self.reserve(1)[0]
        self.batch[row], self.batch_end[row] = batch, batch_end
        self.abs_max[row], self.abs_min[row], self.flags[row] = abs_max, abs_min, flags

    def widen(self, count: int) -> None:
        """Add ``count`` module columns, empty in every row held."""
        rows = len(self.batch)
        self.abs_max = np.concatenate([self.abs_max, np.full((rows, count), -np.inf)], axis=1)
        self.abs_min = np.concatenate([self.abs_min, np.full((rows, count), np.inf)], axis=1)
        self.flags = np.concatenate([self.flags, np.zeros((rows, count), dtype=np.uint8)], axis=1)
        self.n_modules += count

    def pop_front(self, count: int) -> tuple[np.ndarray, ...]:
        """Remove and return the oldest ``count`` rows."""
        count = min(count, self.size)
        rows = self.physical(range(count))
        parts = tuple(getattr(self, name)[rows] for name in self._ARRAYS)
        self.head = (self.head + count) % len(self.batch)
        self.size -= count
        return parts

    def ordered(self) -> tuple[np.ndarray, ...]:
        """Every row, oldest first."""
        rows = self.physical(range(self.size))
        return tuple(getattr(self, name)[rows] for name in self._ARRAYS)

    def clear(self) -> None:
        self.size = 0
        self.head = 0

    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in self._ARRAYS)


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
        # The batch being accumulated (several root calls may share one batch), in plain
        # Python floats: cheaper per output than numpy scalar updates; written out on commit.
        self._current_batch: int | None = None
        self._current: dict[int, list] = {}
        # Closed batches not yet written to the arrays (written in blocks).
        self._closed_rows: list[tuple[int, dict[int, list]]] = []
        self._closed_entries = 0
        self._latest_batch = -1  # the highest batch closed so far

    def add_modules(self, modules: list[str], module_types: list[str]) -> None:
        """Track more modules (or parameters) from now on; their indices follow the others'."""
        if not modules:
            return
        self.modules = list(self.modules) + list(modules)
        self.module_types = list(self.module_types) + list(module_types)
        for rows in (self._full, self._windows):
            rows.widen(len(modules))

    def record(self, batch: int, module_index: int, abs_max: float, abs_min: float,
               nonfinite: bool) -> None:
        """Fold one output's stats into the row of ``batch``."""
        if self._current_batch != batch:
            self.commit()
            self._current_batch = batch
        slot = self._current.get(module_index)
        if slot is None:
            self._current[module_index] = [abs_max if abs_max == abs_max else -math.inf,
                                           abs_min if abs_min == abs_min else math.inf, nonfinite]
            return
        if abs_max > slot[0]:
            slot[0] = abs_max
        if abs_min < slot[1]:
            slot[1] = abs_min
        if nonfinite:
            slot[2] = True

    def current_row(self, batch: int) -> dict[int, list] | None:
        """The row of ``batch`` while it is being accumulated: module index -> [abs_max,
        abs_min, nonfinite] of its outputs so far (abs_max -inf where only NaN was seen); None
        when no row of ``batch`` is open. For reading only (features read a finished batch's
        magnitudes here instead of going through its frames again)."""
        return self._current if self._current_batch == batch else None

    def row_between(self, first: int, end: int) -> dict[int, list]:
        """The batches from ``first`` up to ``end`` (not included) folded into one row, as
        :meth:`current_row` gives one: module index -> [largest abs_max, smallest abs_min,
        whether any was non-finite], over the batches held at full resolution (the one being
        accumulated too). Changes nothing; read when an optimizer step ends a stretch of
        batches (the early warning's fold), never per batch."""
        row: dict[int, list] = {}
        closed = self._closed_rows
        full = self._full
        # Batches come in order: from ``first`` on, they are among the last rows written (as
        # many as the batch numbers from there to the newest written), and none when the rows
        # not yet written begin at ``first`` or before.
        looked = 0
        if full.size and (not closed or first < closed[0][0]):
            newest = int(full.batch[full.physical(range(full.size - 1, full.size))[0]])
            looked = min(full.size, newest - first + 1)
        if looked > 0:
            rows = full.physical(range(full.size - looked, full.size))
            batches = full.batch[rows]
            rows = rows[(batches >= first) & (batches < end)]
            if rows.size:
                flags = np.bitwise_or.reduce(full.flags[rows], axis=0)
                highs = np.where(full.flags[rows] & _SEEN, full.abs_max[rows], -np.inf).max(axis=0)
                lows = np.where(full.flags[rows] & _SEEN, full.abs_min[rows], np.inf).min(axis=0)
                for module in np.flatnonzero(flags & _SEEN).tolist():
                    row[module] = [float(highs[module]), float(lows[module]),
                                   bool(flags[module] & _NONFINITE)]
        pending = [current for batch, current in self._newest_rows(first) if batch < end]
        for current in pending:  # (a plain loop: a step after 2048 batches folds them all)
            for module, (high, low, nonfinite) in current.items():
                slot = row.get(module)
                if slot is None:
                    row[module] = [high, low, nonfinite]
                    continue
                if high > slot[0]:
                    slot[0] = high
                if low < slot[1]:
                    slot[1] = low
                if nonfinite:
                    slot[2] = True
        return row

    def _newest_rows(self, first: int) -> list[tuple[int, dict[int, list]]]:
        """The rows not yet written (the one being accumulated too) from batch ``first`` on,
        the newest first; it stops at batch numbers that started again."""
        found = []
        if self._current_batch is not None and first <= self._current_batch:
            found.append((self._current_batch, self._current))
        newer = math.inf
        for batch, current in reversed(self._closed_rows):
            if batch < first or batch > newer:
                break
            newer = batch
            found.append((batch, current))
        return found

    def batch_row(self, batch: int) -> dict[str, tuple[float, bool]] | None:
        """The modules whose outputs ``batch`` measured, by name: (abs max of their finite
        outputs, NaN when only NaN was seen; whether any was non-finite). None when ``batch``
        is not held at full resolution. Changes nothing; read at a replay, never per batch."""
        found: dict[int, list] | None = None
        if self._current_batch == batch:
            found = self._current
        else:
            found = next((row for earlier, row in reversed(self._closed_rows)
                          if earlier == batch), None)
        if found is not None:
            values = {module: (high, nonfinite) for module, (high, _, nonfinite) in found.items()}
        else:
            full = self._full
            rows = full.physical(range(full.size))
            matches = np.flatnonzero(full.batch[rows] == batch)
            if not matches.size:
                return None
            row = rows[matches[-1]]
            seen = np.flatnonzero(full.flags[row] & _SEEN)
            values = {int(module): (float(full.abs_max[row, module]),
                                    bool(full.flags[row, module] & _NONFINITE))
                      for module in seen}
        return {self.modules[module]: (math.nan if high == -math.inf else high, nonfinite)
                for module, (high, nonfinite) in values.items()}

    def commit(self) -> None:
        """Close the batch being accumulated (called when a new batch starts or on read)."""
        batch = self._current_batch
        if batch is None:
            return
        current = self._current
        self._current_batch = None
        self._current = {}
        # A batch seen again (not the usual next one): one row per (batch, module) still.
        if batch <= self._latest_batch:
            if self._fold_into_earlier(batch, current):
                return
        else:
            self._latest_batch = batch
        closed = self._closed_rows
        closed.append((batch, current))
        self._closed_entries += len(current)
        if len(closed) >= _WRITE_ROWS and (self._closed_entries >= _WRITE_ENTRIES
                                           or len(closed) >= _MAX_WRITE_ROWS):
            self._write_closed_rows()

    def _fold_into_earlier(self, batch: int, current: dict[int, list]) -> bool:
        """Fold ``current`` into ``batch``'s row among the last few; False when none is there."""
        for earlier_batch, earlier in reversed(self._closed_rows[-_FOLD_BACK:]):
            if earlier_batch == batch:
                for module, (high, low, nonfinite) in current.items():
                    slot = earlier.setdefault(module, [high, low, nonfinite])
                    slot[0], slot[1] = max(slot[0], high), min(slot[1], low)
                    slot[2] = slot[2] or nonfinite
                return True
        full = self._full
        looked = min(_FOLD_BACK - len(self._closed_rows), full.size)
        if looked <= 0:
            return False
        rows = full.physical(range(full.size - looked, full.size))
        found = np.flatnonzero(full.batch[rows] == batch)
        if not found.size:
            return False
        row = rows[found[-1]]
        for module, (high, low, nonfinite) in current.items():
            full.abs_max[row, module] = max(full.abs_max[row, module], high)
            full.abs_min[row, module] = min(full.abs_min[row, module], low)
            full.flags[row, module] |= _SEEN | (_NONFINITE if nonfinite else 0)
        return True

    def _write_closed_rows(self) -> None:
        """Move closed batches into the arrays: one vectorised assignment per block of batches."""
        rows, self._closed_rows = self._closed_rows, []
        self._closed_entries = 0
        block = max(1, self.full_batches)
        for first in range(0, len(rows), block):
            self._write_block(rows[first:first + block])

    def _write_block(self, rows: list[tuple[int, dict[int, list]]]) -> None:
        full = self._full
        # len(rows) <= full_batches, so this only pops when more than a window is held.
        while full.size + len(rows) > self.full_batches + self.window:
            self._merge_oldest()
        physical = full.reserve(len(rows))
        full.batch[physical] = full.batch_end[physical] = [batch for batch, _ in rows]
        entries = [entry for _, current in rows for entry in current.items()]
        if not entries:
            return
        row_index = np.repeat(physical, [len(current) for _, current in rows])
        module_index = np.fromiter((module for module, _ in entries), np.int64, len(entries))
        values = np.array([slot for _, slot in entries], dtype=np.float64)  # high, low, nonfinite
        full.abs_max[row_index, module_index] = values[:, 0]
        full.abs_min[row_index, module_index] = values[:, 1]
        full.flags[row_index, module_index] = np.where(values[:, 2] != 0, _SEEN | _NONFINITE,
                                                       _SEEN)

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
        batch, batch_end, abs_max, abs_min, flags = w.ordered()
        n = len(batch)
        pairs = n // 2
        even, odd = np.arange(0, 2 * pairs, 2), np.arange(1, 2 * pairs, 2)
        merged = (batch[even], batch_end[odd], np.maximum(abs_max[even], abs_max[odd]),
                  np.minimum(abs_min[even], abs_min[odd]), flags[even] | flags[odd])
        w.clear()
        for i in range(pairs):
            w.append(int(merged[0][i]), int(merged[1][i]), merged[2][i], merged[3][i], merged[4][i])
        if n % 2:  # an odd window out stays as it is
            w.append(int(batch[-1]), int(batch_end[-1]), abs_max[-1], abs_min[-1], flags[-1])
        self.window *= 2
        self._full.capacity = self.full_batches + self.window

    def nbytes(self) -> int:
        """Memory held by the history arrays."""
        self._write_closed_rows()
        return self._full.nbytes() + self._windows.nbytes()

    def __len__(self) -> int:
        return (self._full.size + self._windows.size + len(self._closed_rows)
                + (self._current_batch is not None))

    def recent(self, count: int) -> tuple[list[int], np.ndarray]:
        """The last ``count`` batches, oldest first: their numbers, and each module's output abs
        max (rows x modules; NaN where a module did not run or held only NaN). Changes nothing:
        the batch being accumulated is read as it stands (a diagnosis reads this mid-batch)."""
        newest: list[tuple[int, np.ndarray]] = []
        n = len(self.modules)
        pending = list(self._closed_rows)
        if self._current_batch is not None:
            pending.append((self._current_batch, self._current))
        for batch, current in reversed(pending):
            if len(newest) >= count:
                break
            row = np.full(n, np.nan)
            for module, (high, _, _) in current.items():
                row[module] = high
            newest.append((batch, row))
        full = self._full
        take = min(count - len(newest), full.size)
        if take > 0:
            rows = full.physical(range(full.size - take, full.size))[::-1]
            for row in rows.tolist():
                values = full.abs_max[row].astype(np.float64)
                values[(full.flags[row] & _SEEN) == 0] = np.nan
                newest.append((int(full.batch[row]), values))
        newest.reverse()
        table = np.vstack([values for _, values in newest]) if newest else np.empty((0, n))
        table[np.isneginf(table)] = np.nan
        return [batch for batch, _ in newest], table

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (batch or window, module that ran in it)."""
        self.commit()
        self._write_closed_rows()
        parts = []
        for rows in (self._windows, self._full):
            if rows.size == 0:
                continue
            batches, batch_ends, all_max, all_min, all_flags = rows.ordered()
            row_index, module_index = np.nonzero(all_flags & _SEEN)
            abs_max = all_max[row_index, module_index].astype(np.float64)
            abs_min = all_min[row_index, module_index].astype(np.float64)
            nonfinite = (all_flags[row_index, module_index] & _NONFINITE).astype(bool)
            # A module whose outputs held only NaN never got a real max/min.
            abs_max[np.isneginf(abs_max)] = np.nan
            abs_min[np.isposinf(abs_min) & ~np.isposinf(abs_max)] = np.nan
            names = np.asarray(self.modules, dtype=object)
            types = np.asarray(self.module_types, dtype=object)
            parts.append(pd.DataFrame({
                "rank": self.rank,
                "batch": batches[row_index],
                "batch_end": batch_ends[row_index],
                "module": names[module_index] if len(names) else [],
                "module_type": types[module_index] if len(types) else [],
                "abs_max": abs_max, "abs_min": abs_min, "nonfinite": nonfinite,
            }))
        if not parts:
            return empty_history()
        table = pd.concat(parts, ignore_index=True)
        return table[HISTORY_COLUMNS].astype({"rank": "int64"})

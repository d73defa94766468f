"""Recording to disk as the run goes (``watch(..., log_dir=DIR)``).

Layout: one folder per rank, so ranks never share a file::

    DIR/rank-00000/manifest.json             format, rank, world size, model, modules, options
    DIR/rank-00000/history-000000.parquet    per (batch, module) output stats, one file per chunk
    DIR/rank-00000/frames-000000.parquet     every frame of the trace batches (and the last frames)
    DIR/rank-00000/grads-000000.parquet      gradient norms
    DIR/rank-00000/event-000000.json         one NaN/Inf event ...
    DIR/rank-00000/event-000000.frames.parquet   ... the frames that led to it
    DIR/rank-00000/event-000000.trace-frames.parquet ... and its replay, when it has one
    DIR/rank-00000/event-000000.trace-ops.parquet
    DIR/rank-00000/warnings.json             the early warnings (rewritten whole when one is added)

A new early warning is written at the end of the batch that made it. Chunks are flushed every
``NANWIDGET_FLUSH_BATCHES`` batches (default 200) or ``NANWIDGET_FLUSH_SECONDS`` seconds
(default 10), at every event kept and when the watch closes; a process killed with SIGKILL loses
at most the chunk not yet flushed. A watch that is never closed completes its recording anyway
(everything flushed, the manifest finalised): when the dropped watch is garbage collected, or at
interpreter exit. Only a finalised manifest has ``closed``; the reader says when a rank's has
none (its process still running, or killed).

Events: the disk keeps the events the watch keeps (the first ``max_events``), so a disk is
never filled by a NaN that repeats every batch; the ones past it are counted in the manifest's
``events_dropped``, rewritten at the flush after the count changed (so a killed run's count is
that of its last flush).

A forked child (Hogwild workers, DataLoader workers calling the watched model) inherits the
watch and its writer: the child's writer writes nothing (the folder, its rank and its batch
numbers are the parent's); the child's watch keeps recording in memory.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import math
import os
import socket
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch

from ..early_warning import EarlyWarning, warning_fields
from ..events import NanEvent, event_fields
from ..frames import Frame
from ..ranks import launched_rank, launched_world_size
from ..recorder import Feature, Recorder
from ..schema import FRAME_COLUMNS, OPS_COLUMNS
from ..trace import Trace
from .tables import (FORMAT_NAME, FORMAT_VERSION, FRAME_KINDS, HISTORY_KINDS, OPS_KINDS,
                     WARNINGS_FILE, WARNINGS_FORMAT_NAME, frame_rows_columns, parquet_enabled,
                     table_columns, write_json, write_table)

__all__ = ["RecordingWriter", "trace_fields", "prepare_log_dir"]

# Writers of this process that are still open, so that a forked child stops them all.
_OPEN_WRITERS: weakref.WeakSet[RecordingWriter] = weakref.WeakSet()


def _stop_writers_in_forked_child() -> None:
    for writer in list(_OPEN_WRITERS):
        writer._stop_in_forked_child()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_stop_writers_in_forked_child)


def prepare_log_dir(log_dir: str | os.PathLike) -> Path:
    """This rank's folder under ``log_dir``, created; raises FileExistsError when it already
    holds a recording and OSError when it cannot be made, before any watch is touched."""
    directory = Path(log_dir) / f"rank-{launched_rank():05d}"
    if (directory / "manifest.json").exists():
        raise FileExistsError(
            f"{directory} already holds a nanwidget recording; pass a new log_dir "
            "(or delete the old one) so two runs are never mixed")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _env_number(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    try:
        return float(value) if value else default
    except ValueError:
        return default


def trace_fields(trace: Trace) -> dict[str, Any]:
    """The plain fields of a trace (its tables are written apart)."""
    first = trace.first_bad
    earlier = trace.earlier_inf
    return {
        "batch": int(trace.batch),
        "first_bad": None if first is None else int(first["index"]),
        "earlier_inf": None if earlier is None else int(earlier["index"]),
        "first_bad_tensors": [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in row.items()
             if k != "weight" or isinstance(v, str)}  # no weight named: left out
            for row in trace.first_bad_tensors.to_dict("records")],
        "weights_changed": bool(trace.weights_changed),
        "changed_weights": [str(n) for n in trace.changed_weights],
        "buffers_updated": [str(n) for n in trace.buffers_updated],
        "snapshot_used": bool(trace.snapshot_used),
        "loss": None if trace.loss is None else float(trace.loss),
        "forwards": int(trace.forwards),
        "seconds": float(trace.seconds),
        "reproduced": bool(trace.reproduced),
        "changes": [str(c) for c in trace.changes],
        "expected": str(trace.expected),
        "found": str(trace.found),
        "raised": str(trace.raised),
        "backward_from": str(trace.backward_from),
        "summary": trace.summary(),
    }


class RecordingWriter(Feature):
    """Spools a watch's records to ``log_dir/rank-NNNNN/`` as the run goes.

    ``options``: the watch's options, written to the manifest. ``grad_history``: returns the
    gradient-norm history to spool (None: the watch records none). ``early_warnings``: returns
    the early warnings so far (None: the watch makes none).
    """

    def __init__(self, recorder: Recorder, log_dir: str | os.PathLike, *,
                 options: dict[str, Any],
                 grad_history: Callable[[], pd.DataFrame] | None = None,
                 early_warnings: Callable[[], list[EarlyWarning]] | None = None) -> None:
        self.recorder = recorder
        self.early_warnings = early_warnings
        self._warnings_written = 0
        self.log_dir = Path(log_dir)
        self.rank = launched_rank()
        self.world_size = launched_world_size()
        self.grad_history = grad_history
        self.directory = prepare_log_dir(log_dir)
        self.every_batches = max(1, int(_env_number("NANWIDGET_FLUSH_BATCHES", 200)))
        self.every_seconds = _env_number("NANWIDGET_FLUSH_SECONDS", 10.0)
        self._sequence = {"history": 0, "frames": 0, "grads": 0}
        self._events_written = 0
        self._events_seen = 0  # events the recorder passed on (it keeps the first max_events)
        self._dropped_in_manifest = 0
        self._frame_rows: list[tuple] = []
        # (batch, module, module_type) -> [abs_max, abs_min, nonfinite]
        self._history: dict[tuple[int, str, str], list] = {}
        self._batches_pending = 0
        self._last_flush = time.monotonic()
        self._last_grads_flush = self._last_flush
        self._grads_written_through = -1
        self._closed = False
        self._in_forked_child = False
        self.manifest = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "rank": self.rank,
            "world_size": self.world_size, "host": socket.gethostname(), "pid": os.getpid(),
            "model_class": type(recorder.model).__name__,
            "module_names": list(recorder.module_names),
            "module_types": list(recorder.module_types),
            "options": options,
            "table_format": "parquet" if parquet_enabled() else "json",
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
        }
        write_json(self.directory / "manifest.json", self.manifest)
        reference = weakref.ref(self)

        def close_at_exit() -> None:
            writer = reference()
            if writer is not None:
                writer.close()
        self._atexit = close_at_exit
        atexit.register(close_at_exit)
        _OPEN_WRITERS.add(self)

    def _stop_in_forked_child(self) -> None:
        """In a forked child: the folder is the parent's, and so are the rank, the batch numbers
        and what is pending (the parent writes it), so this copy writes nothing, ever; the
        watch goes on recording in the child's memory."""
        self._in_forked_child = True
        self._closed = True
        self._history = {}
        self._frame_rows = []
        atexit.unregister(self._atexit)

    def __del__(self) -> None:
        # A watch dropped without close(): its model, recorder and this writer are collected
        # together, all still whole while finalizers run, so the recording is completed now.
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # never raise from a finalizer
                pass

    # Feature ------------------------------------------------------------------------------
    # Each returns at once once closed, which a forked child's copy is from its start.
    def on_frames_resolved(self, frames: list[Frame]) -> None:
        self._take(frames)

    def on_frames_replayed(self, frames: list[Frame]) -> None:
        self._take(frames)

    def _take(self, frames: list[Frame]) -> None:
        if self._closed:
            return
        try:
            self._collect(frames)
        except Exception as error:  # a full disk must not break the user's forward
            self.recorder.internal_error(error)

    def on_batch_end(self, batch: int, frames: list[Frame]) -> None:
        if self._closed:
            return
        try:
            self._collect(frames)
            self._write_warnings()
            self._batches_pending += 1
            if (self._batches_pending >= self.every_batches
                    or time.monotonic() - self._last_flush >= self.every_seconds):
                self.flush()
        except Exception as error:  # a full disk must not break the user's forward
            self.recorder.internal_error(error)

    def on_event(self, event: NanEvent) -> None:
        if self._closed:
            return
        seen = self._events_seen
        self._events_seen += 1
        if seen >= self.recorder.max_events:
            return  # counted, not kept (as in memory); the manifest counts it at the next flush
        try:
            self._write_event(event)
            self.flush(force=True)
        except Exception as error:
            self.recorder.internal_error(error)

    def close(self) -> None:
        if self._closed:
            return
        recorder = self.recorder
        try:
            trace_batches = recorder.trace_batches
            for frame in recorder.held_frames():
                if frame.batch not in trace_batches:
                    self._frame_rows.extend(frame.rows())
            self.flush(force=True)
            self.manifest.update({
                "closed": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "batches": recorder.batch, "events": self._events_written,
                "events_dropped": recorder.events_dropped})
            write_json(self.directory / "manifest.json", self.manifest)
        finally:
            self._closed = True
            atexit.unregister(self._atexit)
            _OPEN_WRITERS.discard(self)

    def on_output_magnitude(self, batch: int, module: str, abs_max: float,
                            abs_min: float) -> None:
        if self._closed:
            return
        try:
            self._fold(batch, module, self.recorder.module_types[
                self.recorder.module_names.index(module)], abs_max, abs_min, False)
        except Exception as error:
            self.recorder.internal_error(error)

    # recording ---------------------------------------------------------------------------
    def _fold(self, batch: int, module: str, module_type: str, abs_max: float, abs_min: float,
              bad: bool) -> None:
        """One output's magnitudes into the history row of (batch, module)."""
        key = (batch, module, module_type)
        row = self._history.get(key)
        if row is None:
            self._history[key] = [abs_max, abs_min, bad]
            return
        if not math.isnan(abs_max) and not abs_max <= row[0]:
            row[0] = abs_max
        if not math.isnan(abs_min) and not abs_min >= row[1]:
            row[1] = abs_min
        row[2] = row[2] or bad

    def _collect(self, frames: list[Frame]) -> None:
        trace_batches = self.recorder.trace_batches
        for frame in frames:
            if frame.batch in trace_batches:
                self._frame_rows.extend(frame.rows())
            if frame.phase != "forward":
                continue
            for entry in frame.outputs():
                stats = entry.stats
                if stats is not None:
                    self._fold(frame.batch, frame.module, frame.module_type, stats.abs_max,
                               stats.abs_min, bool(stats.nan or stats.inf))

    def _write_event(self, event: NanEvent) -> None:
        number = self._events_written
        stem = f"event-{number:06d}"
        frames = event.frames if isinstance(event.frames, pd.DataFrame) else pd.DataFrame()
        columns = (frame_rows_columns([]) if frames.empty
                   else table_columns(frames, FRAME_COLUMNS))
        frames_path = write_table(self.directory / f"{stem}.frames", columns, FRAME_KINDS)
        meta: dict[str, Any] = event_fields(event)
        meta.update({"summary": event.summary(), "frames_file": frames_path.name})
        trace = event.trace
        if isinstance(trace, Trace):
            trace_frames = write_table(self.directory / f"{stem}.trace-frames",
                                       table_columns(trace.frames, FRAME_COLUMNS)
                                       if not trace.frames.empty else frame_rows_columns([]),
                                       FRAME_KINDS)
            ops = trace.ops
            trace_ops = write_table(self.directory / f"{stem}.trace-ops",
                                    table_columns(ops, OPS_COLUMNS) if not ops.empty
                                    else {name: [] for name in OPS_COLUMNS}, OPS_KINDS)
            meta["trace"] = dict(trace_fields(trace), frames_file=trace_frames.name,
                                 ops_file=trace_ops.name)
        # The JSON goes last: an event exists on disk only once its tables do.
        write_json(self.directory / f"{stem}.json", meta)
        self._events_written += 1

    def flush(self, force: bool = False) -> None:
        """Write what is pending as new chunk files (each written whole, then renamed).

        Gradient norms are written when ``force`` is set (events, close) or at most every
        ``every_seconds``. Nothing in a forked child (see the module docstring).
        """
        if self._in_forked_child:
            return
        if self._history:
            keys = list(self._history)
            values = [self._history[k] for k in keys]
            columns = {
                "rank": [self.rank] * len(keys), "batch": [k[0] for k in keys],
                "batch_end": [k[0] for k in keys], "module": [k[1] for k in keys],
                "module_type": [k[2] for k in keys], "abs_max": [v[0] for v in values],
                "abs_min": [v[1] for v in values], "nonfinite": [v[2] for v in values]}
            self._write_chunk("history", columns, HISTORY_KINDS)
            self._history = {}
        if self._frame_rows:
            self._write_chunk("frames", frame_rows_columns(self._frame_rows), FRAME_KINDS)
            self._frame_rows = []
        self._write_warnings()
        dropped = self.recorder.events_dropped
        if dropped != self._dropped_in_manifest:
            self.manifest["events_dropped"] = dropped
            write_json(self.directory / "manifest.json", self.manifest)
            self._dropped_in_manifest = dropped
        if self.grad_history is not None and (
                force or time.monotonic() - self._last_grads_flush >= self.every_seconds):
            # Reading the gradient history builds a table of all it holds: by time only.
            self._flush_grads()
            self._last_grads_flush = time.monotonic()
        self._batches_pending = 0
        self._last_flush = time.monotonic()

    def _write_warnings(self) -> None:
        """Rewrite the warnings file when a warning was added since it was written."""
        if self.early_warnings is None:
            return
        made = self.early_warnings()
        if len(made) == self._warnings_written:
            return
        write_json(self.directory / WARNINGS_FILE, {
            "format": WARNINGS_FORMAT_NAME, "version": FORMAT_VERSION,
            "warnings": [warning_fields(w) for w in made]})
        self._warnings_written = len(made)

    def _flush_grads(self) -> None:
        table = self.grad_history() if self.grad_history is not None else None
        if not isinstance(table, pd.DataFrame) or table.empty:
            return
        new = table[table["batch"] > self._grads_written_through]
        if new.empty:
            return
        self._write_chunk("grads", table_columns(new), None)
        self._grads_written_through = int(new["batch"].max())

    def _write_chunk(self, kind: str, columns: dict[str, Any], kinds: dict[str, str] | None) -> None:
        number = self._sequence[kind]
        write_table(self.directory / f"{kind}-{number:06d}", columns, kinds)
        self._sequence[kind] = number + 1

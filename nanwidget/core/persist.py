"""Recording to disk (``watch(..., log_dir=DIR)``) and reading it back (:func:`load_run`).

Layout: one folder per rank, so ranks never share a file::

    DIR/rank-00000/manifest.json             format, rank, world size, model, modules, options
    DIR/rank-00000/history-000000.parquet    per (batch, module) output stats, one file per chunk
    DIR/rank-00000/frames-000000.parquet     every frame of the trace batches (and the last frames)
    DIR/rank-00000/grads-000000.parquet      gradient norms, when nanwidget.core.grads records them
    DIR/rank-00000/event-000000.json         one NaN/Inf event ...
    DIR/rank-00000/event-000000.frames.parquet   ... and the frames that led to it

Tables are parquet when pyarrow is installed, else column-oriented JSON (``.json``); both are
plain data, read without running code from the directory (no pickle, no pandas metadata).
Every file is written once, to a temporary name, then renamed into place (``os.replace``), so a
process killed with SIGKILL leaves only whole files; it loses at most the chunk not yet flushed.
Chunks are flushed every ``NANWIDGET_FLUSH_BATCHES`` batches (default 200) or
``NANWIDGET_FLUSH_SECONDS`` seconds (default 10), at every event and when the watch closes.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import json
import math
import os
import re
import socket
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from .events import NanEvent
from .frames import FRAME_COLUMNS, Frame
from .history import HISTORY_COLUMNS
from .report import format_event_report
from .watch import WatchExtension

try:  # optional: parquet when available, JSON tables otherwise
    import pyarrow as _pa
    import pyarrow.parquet as _pq
except ImportError:  # pragma: no cover - exercised by monkeypatching in tests
    _pa = None
    _pq = None

if TYPE_CHECKING:  # pragma: no cover
    from .watch import NanWatch

__all__ = ["load_run", "Run", "RunLoadError", "make_extension", "PersistExtension",
           "FORMAT_NAME", "FORMAT_VERSION"]

FORMAT_NAME = "nanwidget-log"
FORMAT_VERSION = 1
TABLE_FORMAT_NAME = "nanwidget-table"

# Column kinds a table may hold; anything else in a file is refused.
_KINDS = ("int", "float", "bool", "str")

FRAME_KINDS = {"rank": "int", "batch": "int", "frame": "int", "module": "str",
               "module_type": "str", "call": "int", "phase": "str", "role": "str",
               "dtype": "str", "shape": "str", "abs_min": "float", "abs_max": "float",
               "nan": "bool", "inf": "bool", "note": "str"}
HISTORY_KINDS = {"rank": "int", "batch": "int", "batch_end": "int", "module": "str",
                 "module_type": "str", "abs_max": "float", "abs_min": "float",
                 "nonfinite": "bool"}
_EVENT_FIELDS = {"batch": int, "module": str, "module_type": str, "call": int, "role": str,
                 "kind": str, "origin": str, "is_backward": bool, "rank": int, "frame": int}

_RANK_DIR = re.compile(r"^rank-(\d{5,})$")
_CHUNK_FILE = re.compile(r"^(history|frames|grads)-(\d{6,})\.(parquet|json)$")
_EVENT_FILE = re.compile(r"^event-(\d{6,})\.json$")


def _env_number(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    try:
        return float(value) if value else default
    except ValueError:
        return default


class RunLoadError(ValueError):
    """A log_dir that cannot be read: missing, foreign, damaged or from a newer nanwidget."""


# ---------------------------------------------------------------------------- table files
def _column_kind(values: Any) -> str:
    dtype = np.asarray(values).dtype if not isinstance(values, pd.Series) else values.dtype
    if pd.api.types.is_bool_dtype(dtype):
        return "bool"
    if pd.api.types.is_integer_dtype(dtype):
        return "int"
    if pd.api.types.is_float_dtype(dtype):
        return "float"
    return "str"


def _normalise(values: Any, kind: str) -> list:
    if kind == "int":
        return [int(v) for v in values]
    if kind == "float":
        return [float(v) for v in values]
    if kind == "bool":
        return [bool(v) for v in values]
    return ["" if v is None else str(v) for v in values]


def _atomic_write(path: Path, write: Any) -> None:
    """Write through a temporary file in the same folder, then rename into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_json(path: Path, data: Any) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1, allow_nan=True)
            handle.flush()
            os.fsync(handle.fileno())
    _atomic_write(path, write)


def write_table(stem: Path, columns: dict[str, Any], kinds: dict[str, str] | None = None) -> Path:
    """Write ``columns`` (name -> values) as ``stem.parquet`` (pyarrow) or ``stem.json``."""
    kinds = dict(kinds or {})
    data: dict[str, list] = {}
    for name, values in columns.items():
        kind = kinds.get(name) or _column_kind(values)
        kinds[name] = kind
        data[name] = _normalise(values, kind)
    if _pq is not None:
        arrow_types = {"int": _pa.int64(), "float": _pa.float64(), "bool": _pa.bool_(),
                       "str": _pa.string()}
        schema = _pa.schema([(name, arrow_types[kinds[name]]) for name in data])
        table = _pa.Table.from_pydict(data, schema=schema)
        path = stem.with_name(stem.name + ".parquet")
        _atomic_write(path, lambda tmp: _pq.write_table(table, tmp))
        return path
    path = stem.with_name(stem.name + ".json")
    _write_json(path, {"format": TABLE_FORMAT_NAME, "version": FORMAT_VERSION,
                       "columns": {name: {"kind": kinds[name], "values": values}
                                   for name, values in data.items()}})
    return path


def _read_parquet(path: Path) -> dict[str, tuple[str, Any]]:
    if _pq is None:
        raise RunLoadError(f"{path}: reading parquet files needs pyarrow (pip install pyarrow)")
    kinds = {"int": ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32"),
             "float": ("float", "double", "halffloat"), "bool": ("bool",),
             "str": ("string", "large_string")}
    parquet = _pq.ParquetFile(path)
    schema = parquet.schema_arrow
    out: dict[str, tuple[str, Any]] = {}
    table = parquet.read()
    for field in schema:
        type_name = str(field.type)
        kind = next((k for k, names in kinds.items() if type_name in names), None)
        if kind is None:
            raise RunLoadError(f"{path}: column {field.name!r} has type {type_name}, which a "
                               "nanwidget recording never holds")
        column = table.column(field.name)
        if column.null_count:
            raise RunLoadError(f"{path}: column {field.name!r} has missing values")
        if kind == "str":
            values = column.to_pylist()
        else:
            values = column.to_numpy()
        out[field.name] = (kind, values)
    return out


def _read_json_table(path: Path) -> dict[str, tuple[str, Any]]:
    data = _read_json(path)
    if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT_NAME:
        raise RunLoadError(f"{path}: not a nanwidget table (no \"format\": \"{TABLE_FORMAT_NAME}\")")
    columns = data.get("columns")
    if not isinstance(columns, dict):
        raise RunLoadError(f"{path}: \"columns\" must be an object")
    out: dict[str, tuple[str, Any]] = {}
    for name, column in columns.items():
        if not isinstance(column, dict) or column.get("kind") not in _KINDS \
                or not isinstance(column.get("values"), list):
            raise RunLoadError(f"{path}: column {name!r} is malformed")
        kind, values = column["kind"], column["values"]
        checks = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                  "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str)}
        if not all(checks[kind](v) for v in values):
            raise RunLoadError(f"{path}: column {name!r} holds values that are not {kind}")
        dtype = {"int": np.int64, "float": np.float64, "bool": bool, "str": object}[kind]
        out[name] = (kind, np.asarray(values, dtype=dtype) if kind != "str" else list(values))
    return out


def read_table(path: Path, expected: dict[str, str] | None = None) -> pd.DataFrame:
    """Read one table file written by :func:`write_table`; any damage raises RunLoadError."""
    try:
        if path.suffix == ".parquet":
            columns = _read_parquet(path)
        else:
            columns = _read_json_table(path)
    except RunLoadError:
        raise
    except Exception as error:  # pyarrow / OS errors: name the file, keep the cause
        raise RunLoadError(f"{path}: cannot be read ({type(error).__name__}: {error})") from error
    lengths = {len(values) for _, values in columns.values()}
    if len(lengths) > 1:
        raise RunLoadError(f"{path}: columns have different lengths")
    for name, kind in (expected or {}).items():
        if name not in columns:
            raise RunLoadError(f"{path}: column {name!r} is missing")
        found = columns[name][0]
        if found != kind and not (kind == "float" and found == "int"):
            raise RunLoadError(f"{path}: column {name!r} is {found}, expected {kind}")
    frame = pd.DataFrame({name: values for name, (_, values) in columns.items()})
    if expected:
        # Strings keep pandas' default string dtype, as the watch's own DataFrames do.
        frame = frame.astype({n: {"int": "int64", "float": "float64", "bool": "bool"}[k]
                              for n, k in expected.items() if k != "str"})
    return frame


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise RunLoadError(f"{path}: not valid JSON ({error})") from error


def _shape_text(shape: Any) -> str:
    return ",".join(str(int(n)) for n in shape) if shape else ""


def _shape_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(",")) if text else ()


def _frames_columns(rows: list[tuple]) -> dict[str, list]:
    """Frame rows (as :meth:`Frame.rows` yields them) -> columns ready for :func:`write_table`."""
    columns: dict[str, list] = {name: [] for name in FRAME_COLUMNS}
    for row in rows:
        for name, value in zip(FRAME_COLUMNS, row):
            columns[name].append(value)
    columns["shape"] = [_shape_text(s) for s in columns["shape"]]
    return columns


def _frames_table_to_dataframe(table: pd.DataFrame) -> pd.DataFrame:
    table = table[FRAME_COLUMNS].copy()
    table["shape"] = [_shape_tuple(s) for s in table["shape"]]
    return table.reset_index(drop=True)


def _dataframe_columns(frame: pd.DataFrame) -> dict[str, Any]:
    return {name: frame[name].tolist() for name in frame.columns}


# ---------------------------------------------------------------------------- recording
def _rank_for_directory(watch: NanWatch) -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    # Under torchrun before init_process_group: the launcher already says who we are.
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return watch.rank, 1


class PersistExtension(WatchExtension):
    """Spools a watch's records to ``log_dir/rank-NNNNN/`` as the run goes."""

    kind = "persist"

    def __init__(self, watch: NanWatch, log_dir: str | os.PathLike) -> None:
        self.log_dir = Path(log_dir)
        self.rank, self.world_size = _rank_for_directory(watch)
        self.directory = self.log_dir / f"rank-{self.rank:05d}"
        if (self.directory / "manifest.json").exists():
            raise FileExistsError(
                f"{self.directory} already holds a nanwidget recording; pass a new log_dir "
                "(or delete the old one) so two runs are never mixed")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.every_batches = max(1, int(_env_number("NANWIDGET_FLUSH_BATCHES", 200)))
        self.every_seconds = _env_number("NANWIDGET_FLUSH_SECONDS", 10.0)
        self._sequence = {"history": 0, "frames": 0, "grads": 0}
        self._events_written = 0
        self._frame_rows: list[tuple] = []
        # (batch, module, module_type) -> [abs_max, abs_min, nonfinite]
        self._history: dict[tuple[int, str, str], list] = {}
        self._batches_pending = 0
        self._last_flush = time.monotonic()
        self._last_grads_flush = self._last_flush
        self._grads_written_through = -1
        self._closed = False
        self.manifest = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "rank": self.rank,
            "world_size": self.world_size, "host": socket.gethostname(), "pid": os.getpid(),
            "model_class": type(watch.model).__name__,
            "module_names": list(watch.module_names), "module_types": list(watch.module_types),
            "options": {
                "max_frames": watch.max_frames, "trace_batches": sorted(watch.trace_batches),
                "abort_after": watch.abort_after, "backward": watch.backward,
                "grad_norm_warn": watch.grad_norm_warn, "on_nan": watch.on_nan,
                "keep_batches": watch.keep_batches, "replay_on_nan": watch.replay_on_nan},
            "table_format": "parquet" if _pq is not None else "json",
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
        }
        _write_json(self.directory / "manifest.json", self.manifest)
        reference = weakref.ref(self)

        def flush_at_exit() -> None:
            extension = reference()
            if extension is not None and not extension._closed:
                extension.flush()
        self._atexit = flush_at_exit
        atexit.register(flush_at_exit)

    # WatchExtension protocol ------------------------------------------------------------
    def on_batch_start(self, watch: NanWatch, batch: int, args: tuple, kwargs: dict) -> None:
        pass

    def on_batch_end(self, watch: NanWatch, batch: int, frames: list[Frame],
                     event: NanEvent | None) -> None:
        try:
            self._collect(watch, frames)
            self._batches_pending += 1
            if event is not None:
                self._write_event(event)
                self.flush(watch, force=True)
            elif (self._batches_pending >= self.every_batches
                  or time.monotonic() - self._last_flush >= self.every_seconds):
                self.flush(watch)
        except Exception as error:  # a full disk must not break the user's forward
            watch._internal_error(error)

    def after_batch(self, watch: NanWatch, batch: int, event: NanEvent | None) -> NanEvent | None:
        return event

    def close(self, watch: NanWatch) -> None:
        if self._closed:
            return
        try:
            held = [frame for frame in watch._ring if frame.batch not in watch.trace_batches]
            for frame in held:
                self._frame_rows.extend(frame.rows())
            self.flush(watch, force=True)
            self.manifest.update({
                "closed": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "batches": watch.batch, "events": self._events_written,
                "events_dropped": watch.events_dropped})
            _write_json(self.directory / "manifest.json", self.manifest)
        finally:
            self._closed = True
            atexit.unregister(self._atexit)

    # recording ---------------------------------------------------------------------------
    def _collect(self, watch: NanWatch, frames: list[Frame]) -> None:
        trace_batches = watch.trace_batches
        history = self._history
        for frame in frames:
            if frame.batch in trace_batches:
                self._frame_rows.extend(frame.rows())
            if frame.phase != "forward":
                continue
            for role, stats, _dtype, _shape, _note in frame.entries:
                if stats is None or not role.startswith("output"):
                    continue
                key = (frame.batch, frame.module, frame.module_type)
                row = history.get(key)
                bad = bool(stats.nan or stats.inf)
                if row is None:
                    history[key] = [stats.abs_max, stats.abs_min, bad]
                    continue
                if not math.isnan(stats.abs_max) and not stats.abs_max <= row[0]:
                    row[0] = stats.abs_max
                if not math.isnan(stats.abs_min) and not stats.abs_min >= row[1]:
                    row[1] = stats.abs_min
                row[2] = row[2] or bad

    def _write_event(self, event: NanEvent) -> None:
        number = self._events_written
        stem = self.directory / f"event-{number:06d}.frames"
        frames = event.frames if isinstance(event.frames, pd.DataFrame) else pd.DataFrame()
        if frames.empty:
            columns: dict[str, Any] = _frames_columns([])
        else:
            columns = _dataframe_columns(frames[FRAME_COLUMNS])
            columns["shape"] = [_shape_text(s) for s in columns["shape"]]
        frames_path = write_table(stem, columns, FRAME_KINDS)
        meta = {name: getattr(event, name) for name in _EVENT_FIELDS}
        meta.update({"summary": event.summary(), "frames_file": frames_path.name})
        # The JSON goes last: an event exists on disk only once its frames do.
        _write_json(self.directory / f"event-{number:06d}.json", meta)
        self._events_written += 1

    def flush(self, watch: NanWatch | None = None, force: bool = False) -> None:
        """Write what is pending as new chunk files (each written whole, then renamed).

        Gradient norms are written when ``force`` is set (events, close) or at most every
        ``every_seconds``.
        """
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
            self._write_chunk("frames", _frames_columns(self._frame_rows), FRAME_KINDS)
            self._frame_rows = []
        if watch is not None and (force or time.monotonic() - self._last_grads_flush
                                  >= self.every_seconds):
            # Reading the gradient history builds a table of all it holds: by time only.
            self._flush_grads(watch)
            self._last_grads_flush = time.monotonic()
        self._batches_pending = 0
        self._last_flush = time.monotonic()

    def _flush_grads(self, watch: NanWatch) -> None:
        """New rows of ``nanwidget.core.grads.grad_history(watch)``, when that part is present."""
        try:
            from . import grads
        except ImportError:
            return
        grad_history = getattr(grads, "grad_history", None)
        if grad_history is None:
            return
        table = grad_history(watch)
        if not isinstance(table, pd.DataFrame) or table.empty or "batch" not in table.columns:
            return
        new = table[table["batch"] > self._grads_written_through]
        if new.empty:
            return
        if "rank" not in new.columns:
            new = new.assign(rank=self.rank)
        self._write_chunk("grads", _dataframe_columns(new), None)
        self._grads_written_through = int(new["batch"].max())

    def _write_chunk(self, kind: str, columns: dict[str, Any], kinds: dict[str, str] | None) -> None:
        number = self._sequence[kind]
        write_table(self.directory / f"{kind}-{number:06d}", columns, kinds)
        self._sequence[kind] = number + 1


def make_extension(watch: NanWatch) -> PersistExtension | None:
    """The persistence part of a watch, or None when ``log_dir`` is not set."""
    log_dir = getattr(watch, "log_dir", None)
    if log_dir is None or log_dir == "":
        return None
    return PersistExtension(watch, log_dir)


# ---------------------------------------------------------------------------- loading
def _check_manifest(path: Path) -> dict:
    manifest = _read_json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise RunLoadError(f"{path}: not a nanwidget manifest (no \"format\": \"{FORMAT_NAME}\")")
    version = manifest.get("version")
    if not isinstance(version, int) or version < 1:
        raise RunLoadError(f"{path}: bad format version {version!r}")
    if version > FORMAT_VERSION:
        raise RunLoadError(f"{path}: written by a newer nanwidget (format version {version}; "
                           f"this one reads up to {FORMAT_VERSION}); upgrade nanwidget")
    for key in ("rank", "world_size"):
        value = manifest.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise RunLoadError(f"{path}: {key!r} must be a non-negative integer, got {value!r}")
    names = manifest.get("module_names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise RunLoadError(f"{path}: 'module_names' must be a list of strings")
    return manifest


def _event_from_file(path: Path, directory: Path) -> NanEvent:
    meta = _read_json(path)
    if not isinstance(meta, dict):
        raise RunLoadError(f"{path}: an event must be a JSON object")
    fields: dict[str, Any] = {}
    for name, kind in _EVENT_FIELDS.items():
        value = meta.get(name)
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if not ok:
            raise RunLoadError(f"{path}: field {name!r} must be {kind.__name__}, got {value!r}")
        fields[name] = value
    frames_file = meta.get("frames_file")
    if not isinstance(frames_file, str) or Path(frames_file).name != frames_file \
            or not frames_file.startswith(path.stem + ".frames."):
        raise RunLoadError(f"{path}: 'frames_file' must name this event's frames file, "
                           f"got {frames_file!r}")
    frames_path = directory / frames_file
    if not frames_path.is_file():
        raise RunLoadError(f"{frames_path}: missing (named by {path.name})")
    frames = _frames_table_to_dataframe(read_table(frames_path, FRAME_KINDS))
    return NanEvent(frames=frames, **fields)


class Run:
    """What a ``log_dir`` holds, every rank merged: frames, history, events, gradient norms.

    Create it with :func:`load_run`. Everything is read (and checked) when it is created,
    so a damaged directory fails there with a :class:`RunLoadError` naming the file.
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = Path(log_dir)
        if not self.log_dir.exists():
            raise RunLoadError(f"{self.log_dir}: no such directory")
        if not self.log_dir.is_dir():
            raise RunLoadError(f"{self.log_dir}: not a directory")
        if (self.log_dir / "manifest.json").is_file():
            rank_dirs = [self.log_dir]  # pointed at one rank's folder
        else:
            rank_dirs = sorted(p for p in self.log_dir.iterdir()
                               if p.is_dir() and _RANK_DIR.match(p.name))
        if not rank_dirs:
            raise RunLoadError(f"{self.log_dir}: holds no nanwidget recording (expected "
                               "rank-NNNNN/manifest.json folders written by watch(log_dir=...))")
        self.manifests: dict[int, dict] = {}
        frames: list[pd.DataFrame] = []
        history: list[pd.DataFrame] = []
        grads: list[pd.DataFrame] = []
        events: list[NanEvent] = []
        for directory in rank_dirs:
            manifest_path = directory / "manifest.json"
            if not manifest_path.is_file():
                raise RunLoadError(f"{manifest_path}: missing; {directory} is not a complete "
                                   "nanwidget recording")
            manifest = _check_manifest(manifest_path)
            rank = manifest["rank"]
            match = _RANK_DIR.match(directory.name)
            if match and int(match.group(1)) != rank:
                raise RunLoadError(f"{manifest_path}: says rank {rank}, folder says "
                                   f"{int(match.group(1))}")
            if rank in self.manifests:
                raise RunLoadError(f"{manifest_path}: rank {rank} recorded twice")
            self.manifests[rank] = manifest
            for path in sorted(directory.iterdir()):
                chunk = _CHUNK_FILE.match(path.name)
                if chunk:
                    kind = chunk.group(1)
                    if kind == "history":
                        history.append(read_table(path, HISTORY_KINDS))
                    elif kind == "frames":
                        frames.append(_frames_table_to_dataframe(read_table(path, FRAME_KINDS)))
                    else:
                        table = read_table(path, {"batch": "int"})
                        grads.append(table if "rank" in table else table.assign(rank=rank))
                elif _EVENT_FILE.match(path.name):
                    events.append(_event_from_file(path, directory))
        events.sort(key=lambda e: (e.batch, e.rank))
        self._events = events
        self._frames = self._merge_frames(frames + [e.frames for e in events])
        self._history = self._merge_history(history)
        self._grads = (pd.concat(grads, ignore_index=True).sort_values(["batch", "rank"],
                                                                       kind="stable")
                       .reset_index(drop=True) if grads else None)

    @staticmethod
    def _merge_frames(parts: list[pd.DataFrame]) -> pd.DataFrame:
        parts = [p for p in parts if not p.empty]
        if not parts:
            from .frames import empty_frames
            return empty_frames()
        table = pd.concat(parts, ignore_index=True)
        key = ["rank", "batch", "phase", "frame", "module", "call", "role"]
        table = table.drop_duplicates(subset=key)
        order = table["phase"].map({"forward": 0, "backward": 1}).fillna(2)
        table = (table.assign(_order=order)
                 .sort_values(["rank", "batch", "_order", "frame"], kind="stable")
                 .drop(columns="_order").reset_index(drop=True))
        return table

    @staticmethod
    def _merge_history(parts: list[pd.DataFrame]) -> pd.DataFrame:
        if not parts:
            return pd.DataFrame({c: pd.Series(dtype=t) for c, t in zip(
                HISTORY_COLUMNS, ["int64", "int64", "int64", "object", "object", "float64",
                                  "float64", "bool"])})
        table = pd.concat(parts, ignore_index=True)[HISTORY_COLUMNS]
        key = ["rank", "batch", "batch_end", "module", "module_type"]
        if table.duplicated(subset=key).any():
            # One batch split over two chunks (several forwards per batch): fold it back.
            table = table.groupby(key, sort=False, as_index=False).agg(
                abs_max=("abs_max", "max"), abs_min=("abs_min", "min"),
                nonfinite=("nonfinite", "any"))
        return table.sort_values(["rank", "batch"], kind="stable").reset_index(drop=True)

    # The same reading surface as NanWatch -------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        """Ranks found in the directory."""
        return sorted(self.manifests)

    @property
    def world_size(self) -> int:
        """World size the ranks reported (1 without torch.distributed)."""
        return max(m["world_size"] for m in self.manifests.values())

    @property
    def model_class(self) -> str:
        return str(self.manifests[self.ranks[0]].get("model_class", ""))

    @property
    def module_names(self) -> list[str]:
        return list(self.manifests[self.ranks[0]].get("module_names", []))

    def frames(self, batch: int | None = None, rank: int | None = None) -> pd.DataFrame:
        """Every recorded frame (event windows, trace batches, last frames), ranks merged."""
        table = self._frames
        if batch is not None:
            table = table[table["batch"] == batch]
        if rank is not None:
            table = table[table["rank"] == rank]
        return table.reset_index(drop=True)

    def history(self) -> pd.DataFrame:
        """One row per (rank, batch, module): abs_max, abs_min, nonfinite of its outputs."""
        return self._history.copy()

    @property
    def events(self) -> list[NanEvent]:
        """Every recorded event, sorted by batch then rank."""
        return list(self._events)

    @property
    def event(self) -> NanEvent | None:
        """The first event (lowest batch, then lowest rank), or None."""
        return self._events[0] if self._events else None

    def grad_history(self) -> pd.DataFrame:
        """Gradient norms per batch and parameter, when the run recorded them."""
        if self._grads is None:
            return pd.DataFrame({"rank": pd.Series(dtype="int64"),
                                 "batch": pd.Series(dtype="int64")})
        return self._grads.copy()

    def report(self, event: NanEvent | None = None) -> str:
        """An event's report (default: the first event), or the recorded frames when none."""
        event = event or self.event
        if event is not None:
            return format_event_report(event, event.frames)
        frames = self._frames
        last = int(frames["batch"].max()) if not frames.empty else None
        return format_event_report(None, frames, batch=last)

    def browse(self) -> Any:
        """The FrameBrowser widget over this recording (needs ipywidgets)."""
        from ..widgets import FrameBrowser
        return FrameBrowser(self)

    def __repr__(self) -> str:
        return (f"<nanwidget.Run {str(self.log_dir)!r}: {self.model_class}, ranks {self.ranks}, "
                f"{len(self._events)} event(s)>")


def load_run(log_dir: str | os.PathLike) -> Run:
    """Read what ``watch(..., log_dir=log_dir)`` recorded, every rank merged.

    Raises :class:`RunLoadError` (a ValueError) naming the file when the directory is
    missing, foreign or damaged. Nothing in the directory is executed.
    """
    return Run(log_dir)

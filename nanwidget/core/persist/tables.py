"""The files of a recording: plain data tables (parquet or JSON) and JSON documents, written
whole or not at all, read back with every column checked.

Tables are parquet when pyarrow is installed, else column-oriented JSON (``.json``); both are
plain data, read without running code from the directory (no pickle, no pandas metadata).
Every file is written once, to a temporary name, then renamed into place (``os.replace``), so a
process killed with SIGKILL leaves only whole files.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..schema import (FRAME_COLUMNS, FRAME_DTYPES, HISTORY_DTYPES, OPS_COLUMNS, OPS_DTYPES,
                      column_kinds)
from ..state import parquet_wanted, use_parquet  # noqa: F401 - use_parquet re-exported

try:  # optional: parquet when available, JSON tables otherwise
    import pyarrow as _pa
    import pyarrow.parquet as _pq
except ImportError:  # pragma: no cover - exercised through use_parquet(False) in tests
    _pa = None
    _pq = None

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "TABLE_FORMAT_NAME", "RunLoadError", "FRAME_KINDS",
           "FRAME_KINDS_REQUIRED", "HISTORY_KINDS", "OPS_KINDS", "RANK_DIR", "CHUNK_FILE",
           "EVENT_FILE", "write_table",
           "read_table", "write_json", "read_json", "shape_text", "shape_tuple",
           "frame_rows_columns", "table_columns", "frames_from_table", "ops_from_table",
           "use_parquet", "parquet_enabled", "read_file", "inside", "MAX_TABLE_BYTES",
           "MAX_DOCUMENT_BYTES", "WARNINGS_FILE", "WARNINGS_FORMAT_NAME"]

FORMAT_NAME = "nanwidget-log"
FORMAT_VERSION = 1
TABLE_FORMAT_NAME = "nanwidget-table"

# Column kinds a table may hold; anything else in a file is refused.
_KINDS = ("int", "float", "bool", "str")
FRAME_KINDS = column_kinds(FRAME_DTYPES)
FRAME_KINDS["shape"] = "str"  # "2,3": tuples are stored as text
# What a frames file must hold to be read (older recordings lack the finite-range columns).
FRAME_KINDS_REQUIRED = {name: kind for name, kind in FRAME_KINDS.items()
                        if not name.startswith("finite_")}
HISTORY_KINDS = column_kinds(HISTORY_DTYPES)
OPS_KINDS = column_kinds(OPS_DTYPES)
OPS_KINDS["shape"] = "str"

RANK_DIR = re.compile(r"^rank-(\d{5,})$")
CHUNK_FILE = re.compile(r"^(history|frames|grads)-(\d{6,})\.(parquet|json)$")
EVENT_FILE = re.compile(r"^event-(\d{6,})\.json$")
WARNINGS_FILE = "warnings.json"  # a rank's early warnings (recordings before them have none)
WARNINGS_FORMAT_NAME = "nanwidget-warnings"

def parquet_enabled() -> bool:
    """Whether new tables are written as parquet (pyarrow is there and
    :func:`~nanwidget.core.state.use_parquet` left it on)."""
    return parquet_wanted() and _pq is not None


class RunLoadError(ValueError):
    """A log_dir that cannot be read: missing, foreign, damaged or from a newer nanwidget."""


# Reading a folder from elsewhere: no file past these sizes is read (a recording's chunks are
# written every few hundred batches; its documents are a few kilobytes).
MAX_TABLE_BYTES = 1 << 30
MAX_DOCUMENT_BYTES = 64 << 20


def inside(path: Path, within: Path) -> Path:
    """The real path behind ``path``; RunLoadError when it leads outside ``within`` (a symbolic
    link out of the recording is never followed)."""
    real = Path(os.path.realpath(path))
    root = Path(os.path.realpath(within))
    if real != root and root not in real.parents:
        target = os.readlink(path) if os.path.islink(path) else real
        raise RunLoadError(f"{path}: a symbolic link to {target}, outside the recording {root}; "
                           "not followed")
    return real


def _not_a_file(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def read_file(path: Path, within: Path, limit: int) -> bytes:
    """The bytes of ``path``: only a regular file inside ``within`` and at most ``limit``
    bytes; a FIFO, a device or a link out of the folder is refused before anything is read."""
    real = inside(path, within)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_BINARY", 0)
    try:
        descriptor = os.open(real, flags)  # non-blocking: opening a FIFO never waits
    except OSError as error:
        raise RunLoadError(f"{path}: cannot be opened ({error.strerror or error})") from error
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise RunLoadError(f"{path}: {_not_a_file(info.st_mode)}, not a file a recording "
                               "holds; not read")
        if info.st_size > limit:
            raise RunLoadError(f"{path}: {info.st_size:,} bytes, more than a recording file holds "
                               f"(at most {limit:,}); not read")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(descriptor, min(1 << 20, limit + 1 - total))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise RunLoadError(f"{path}: grew past {limit:,} bytes while being read; not read")
    finally:
        os.close(descriptor)


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


def write_json(path: Path, data: Any) -> None:
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
    if parquet_enabled():
        arrow_types = {"int": _pa.int64(), "float": _pa.float64(), "bool": _pa.bool_(),
                       "str": _pa.string()}
        schema = _pa.schema([(name, arrow_types[kinds[name]]) for name in data])
        table = _pa.Table.from_pydict(data, schema=schema)
        path = stem.with_name(stem.name + ".parquet")
        _atomic_write(path, lambda tmp: _pq.write_table(table, tmp))
        return path
    path = stem.with_name(stem.name + ".json")
    write_json(path, {"format": TABLE_FORMAT_NAME, "version": FORMAT_VERSION,
                       "columns": {name: {"kind": kinds[name], "values": values}
                                   for name, values in data.items()}})
    return path


def _read_parquet(path: Path, within: Path) -> dict[str, tuple[str, Any]]:
    if _pq is None:
        raise RunLoadError(f"{path}: reading parquet files needs pyarrow (pip install pyarrow)")
    kinds = {"int": ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32"),
             "float": ("float", "double", "halffloat"), "bool": ("bool",),
             "str": ("string", "large_string")}
    parquet = _pq.ParquetFile(_pa.BufferReader(read_file(path, within, MAX_TABLE_BYTES)))
    schema = parquet.schema_arrow
    out: dict[str, tuple[str, Any]] = {}
    # One thread: arrow's thread pool, once started, can still hold a worker when a short
    # process exits (`python -m nanwidget report`), which aborts it after its work is done
    # ("terminate called without an active exception", apache/arrow#34314). The tables are small.
    table = parquet.read(use_threads=False)
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


def _read_json_table(path: Path, within: Path) -> dict[str, tuple[str, Any]]:
    data = read_json(path, within, MAX_TABLE_BYTES)
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


def read_table(path: Path, expected: dict[str, str] | None = None, *,
               within: Path | None = None) -> pd.DataFrame:
    """Read one table file written by :func:`write_table`; any damage raises RunLoadError.

    Nothing outside ``within`` (default: the file's folder) is read; see :func:`read_file`.
    """
    within = path.parent if within is None else within
    try:
        if path.suffix == ".parquet":
            columns = _read_parquet(path, within)
        else:
            columns = _read_json_table(path, within)
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


def read_json(path: Path, within: Path | None = None, limit: int = MAX_DOCUMENT_BYTES) -> Any:
    """A JSON document; damage raises RunLoadError naming the file (also one nested too deeply
    to parse). Nothing outside ``within`` (default: the file's folder) is read."""
    data = read_file(path, path.parent if within is None else within, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise RunLoadError(f"{path}: nested too deeply to be a nanwidget file") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise RunLoadError(f"{path}: not valid JSON ({error})") from error


# A ragged dimension of a nested tensor (None in the shape tuple), as the text stores it.
RAGGED = "?"


def shape_text(shape: Any) -> str:
    """(2, 3) -> "2,3"; a nested tensor's (2, None, 4) -> "2,?,4"."""
    return ",".join(RAGGED if n is None else str(int(n)) for n in shape) if shape else ""


def shape_tuple(text: str) -> tuple[int | None, ...]:
    """"2,3" -> (2, 3), "2,?,4" -> (2, None, 4); ValueError on anything else."""
    if not text:
        return ()
    parts = text.split(",")
    if not all(part.isdigit() or part == RAGGED for part in parts):
        raise ValueError(f"shape {text!r} is not sizes separated by commas (e.g. '2,3')")
    return tuple(None if part == RAGGED else int(part) for part in parts)


def frame_rows_columns(rows: list[tuple]) -> dict[str, list]:
    """Frame rows (as :meth:`Frame.rows` yields them) -> columns ready for :func:`write_table`."""
    columns: dict[str, list] = {name: [] for name in FRAME_COLUMNS}
    for row in rows:
        for name, value in zip(FRAME_COLUMNS, row):
            columns[name].append(value)
    columns["shape"] = [shape_text(s) for s in columns["shape"]]
    return columns


def frames_from_table(table: pd.DataFrame, source: Path | str = "") -> pd.DataFrame:
    """A frames table as read from ``source`` -> the contract's frames DataFrame. Recordings made
    before the finite-range columns existed get them: the range itself where the row is finite,
    NaN (unknown) where it is not."""
    if "finite_abs_min" not in table.columns or "finite_abs_max" not in table.columns:
        table = table.copy()
        finite = ~(table["nan"].astype(bool) | table["inf"].astype(bool))
        table["finite_abs_min"] = table["abs_min"].where(finite)
        table["finite_abs_max"] = table["abs_max"].where(finite)
    return _with_shape_tuples(table, FRAME_COLUMNS, source)


def ops_from_table(table: pd.DataFrame, source: Path | str = "") -> pd.DataFrame:
    """An ops table as read from ``source`` -> a Trace's ops DataFrame."""
    return _with_shape_tuples(table, OPS_COLUMNS, source)


def _with_shape_tuples(table: pd.DataFrame, columns: list[str], source: Path | str) -> pd.DataFrame:
    table = table[columns].copy()
    try:
        table["shape"] = [shape_tuple(s) for s in table["shape"]]
    except ValueError as error:
        raise RunLoadError(f"{source or 'a table'}: column 'shape': {error}") from None
    return table.reset_index(drop=True)


def table_columns(frame: pd.DataFrame, columns: list[str] | None = None) -> dict[str, Any]:
    """A DataFrame's columns as lists for :func:`write_table`; a ``shape`` column as text."""
    names = list(frame.columns) if columns is None else columns
    data = {name: frame[name].tolist() for name in names}
    if "shape" in data:
        data["shape"] = [shape_text(s) for s in data["shape"]]
    return data



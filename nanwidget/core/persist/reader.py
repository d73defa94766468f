"""Reading a recording back (:func:`load_run`): every rank merged, every file checked.

Nothing in the directory is executed: tables are plain data and every column, field and file
name is checked before it is used; a damaged file raises :class:`RunLoadError` naming it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, TypeVar

import pandas as pd

from ..early_warning import (PERS, REASONS, WARNING_DEFAULTS, WARNING_FIELDS, EarlyWarning,
                             warning_from_fields)
from ..events import Diagnosis, NanEvent, event_from_fields
from ..frames import empty_frames
from ..history import empty_history
from ..report import format_event_report, printable
from ..schema import EVENT_FIELDS, HISTORY_COLUMNS
from ..trace import TENSOR_COLUMNS, TENSOR_COLUMNS_REQUIRED, Trace, empty_ops
from ..viewer import open_browser
from .tables import (CHUNK_FILE, EVENT_FILE, FORMAT_NAME, FORMAT_VERSION,
                     FRAME_KINDS_REQUIRED,
                     HISTORY_KINDS, OPS_KINDS, RANK_DIR, WARNINGS_FILE, WARNINGS_FORMAT_NAME,
                     RunLoadError, frames_from_table, inside, ops_from_table, read_json,
                     read_table)

__all__ = ["Run", "load_run", "RunLoadError"]

T = TypeVar("T")


def _check_manifest(path: Path, root: Path) -> dict:
    manifest = read_json(path, root)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise RunLoadError(f"{path}: not a nanwidget manifest (no \"format\": \"{FORMAT_NAME}\")")
    version = manifest.get("version")
    if not isinstance(version, int) or version < 1:
        raise RunLoadError(f"{path}: bad format version {version!r}")
    if version > FORMAT_VERSION:
        raise RunLoadError(f"{path}: written by a newer nanwidget (format version {version}; "
                           f"this one reads up to {FORMAT_VERSION}); upgrade nanwidget")
    for key, least in (("rank", 0), ("world_size", 1)):
        value = manifest.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise RunLoadError(f"{path}: {key!r} must be an integer >= {least}, got {value!r}")
    if manifest["rank"] >= manifest["world_size"]:
        raise RunLoadError(f"{path}: rank {manifest['rank']} is not below world size "
                           f"{manifest['world_size']}")
    closed = manifest.get("closed")  # set when the recording was finalised (close(), exit)
    if closed is not None and not isinstance(closed, str):
        raise RunLoadError(f"{path}: 'closed' must be a time stamp (text), got {closed!r}")
    dropped = manifest.get("events_dropped", 0)
    if not isinstance(dropped, int) or isinstance(dropped, bool) or dropped < 0:
        raise RunLoadError(f"{path}: 'events_dropped' must be an integer >= 0, got {dropped!r}")
    names = manifest.get("module_names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise RunLoadError(f"{path}: 'module_names' must be a list of strings")
    return manifest


def _option(manifest: dict, name: str, default: Any) -> Any:
    """A watch option the manifest recorded, or ``default`` when it is absent or malformed."""
    options = manifest.get("options")
    value = options.get(name) if isinstance(options, dict) else None
    if name == "trace_batches":
        ok = isinstance(value, list) and all(isinstance(b, int) for b in value)
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else default


def _own_file(path: Path, meta: dict, key: str, suffix: str, directory: Path) -> Path:
    """The file an event names under ``key``: only its own sibling, never another path."""
    name = meta.get(key)
    if not isinstance(name, str) or Path(name).name != name \
            or not name.startswith(path.stem + suffix):
        raise RunLoadError(f"{path}: {key!r} must name this event's own file, got {name!r}")
    found = directory / name
    if not os.path.lexists(found):
        raise RunLoadError(f"{found}: missing (named by {path.name})")
    return found


def _checked(path: Path, meta: dict, name: str, kind: type | tuple[type, ...],
             optional: bool = False) -> Any:
    value = meta.get(name)
    if optional and value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))
    if not ok:
        names = " or ".join(k.__name__ for k in kinds)
        raise RunLoadError(f"{path}: field {name!r} must be {names}, got {value!r}")
    return value


def _row_numbers(value: Any) -> bool:
    """Whether ``value`` is a list of row numbers (a described output's ``nonfinite_rows``)."""
    return isinstance(value, list) and all(type(r) is int for r in value)


def _trace_from_file(path: Path, meta: Any, directory: Path, root: Path) -> Trace:
    if not isinstance(meta, dict):
        raise RunLoadError(f"{path}: 'trace' must be an object")
    frames_path = _own_file(path, meta, "frames_file", ".trace-frames.", directory)
    frames = frames_from_table(read_table(frames_path, FRAME_KINDS_REQUIRED, within=root),
                               frames_path)
    ops_path = _own_file(path, meta, "ops_file", ".trace-ops.", directory)
    ops_table = read_table(ops_path, OPS_KINDS, within=root)
    ops = ops_from_table(ops_table, ops_path) if len(ops_table) else empty_ops()
    rows = {}
    for key in ("first_bad", "earlier_inf"):
        index = _checked(path, meta, key, int, optional=True)
        if index is not None and not 0 <= index < len(ops):
            raise RunLoadError(f"{path}: trace {key!r} names op {index}; the trace has {len(ops)}")
        rows[key] = None if index is None else ops.iloc[index]
    tensors = meta.get("first_bad_tensors", [])
    if not isinstance(tensors, list) or not all(
            isinstance(row, dict) and set(TENSOR_COLUMNS_REQUIRED) <= set(row) <= set(TENSOR_COLUMNS)
            and _row_numbers(row.get("nonfinite_rows", []))
            for row in tensors):  # older recordings lack the later columns (read as unknown)
        raise RunLoadError(f"{path}: trace 'first_bad_tensors' is malformed")
    names: dict[str, list[str]] = {}
    for key in ("changed_weights", "buffers_updated", "changes"):
        value = meta.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise RunLoadError(f"{path}: trace {key!r} must be a list of strings")
        names[key] = value
    loss = _checked(path, meta, "loss", (int, float), optional=True)
    raised = _checked(path, meta, "raised", str, optional=True) or ""  # older: none
    backward_from = _checked(path, meta, "backward_from", str, optional=True) or ""  # older: none
    return Trace(batch=_checked(path, meta, "batch", int), frames=frames, ops=ops,
                 first_bad=rows["first_bad"],
                 first_bad_tensors=pd.DataFrame(
                     [dict(row, shape=tuple(row["shape"]) if isinstance(row["shape"], list)
                           else row["shape"]) for row in tensors], columns=TENSOR_COLUMNS),
                 earlier_inf=rows["earlier_inf"],
                 weights_changed=_checked(path, meta, "weights_changed", bool),
                 changed_weights=names["changed_weights"],
                 buffers_updated=names["buffers_updated"],
                 snapshot_used=_checked(path, meta, "snapshot_used", bool),
                 loss=None if loss is None else float(loss),
                 forwards=_checked(path, meta, "forwards", int),
                 seconds=float(_checked(path, meta, "seconds", (int, float))),
                 reproduced=_checked(path, meta, "reproduced", bool),
                 changes=names["changes"],
                 expected=_checked(path, meta, "expected", str),
                 found=_checked(path, meta, "found", str), raised=raised,
                 backward_from=backward_from)


def _event_from_file(path: Path, directory: Path, root: Path, rank: int) -> NanEvent:
    meta = read_json(path, root)
    if not isinstance(meta, dict):
        raise RunLoadError(f"{path}: an event must be a JSON object")
    # Fields a writer may leave out (older or newer ones): what a missing one means.
    missing_means = {"is_backward": False, "frame": 0, "rank": rank}
    fields: dict[str, Any] = {
        name: missing_means[name] if name in missing_means and meta.get(name) is None
        else _checked(path, meta, name, kind) for name, kind in EVENT_FIELDS.items()}
    fields["peer_rank"] = _checked(path, meta, "peer_rank", int, optional=True)
    fields["peer_batch"] = _checked(path, meta, "peer_batch", int, optional=True)  # newer files
    for name in ("note", "frames_note", "model"):  # older files have none of them
        fields[name] = _checked(path, meta, name, str, optional=True) or ""
    diagnosis = meta.get("diagnosis")  # older files have none
    if diagnosis is not None and Diagnosis.from_fields(diagnosis) is None:
        raise RunLoadError(f"{path}: \"diagnosis\" must be an object with kind, summary, "
                           "confidence (text), evidence, suggestion (lists of text) and rows "
                           "(whole numbers)")
    fields["diagnosis"] = diagnosis
    frames_path = _own_file(path, meta, "frames_file", ".frames.", directory)
    frames = frames_from_table(read_table(frames_path, FRAME_KINDS_REQUIRED, within=root),
                               frames_path)
    trace = _trace_from_file(path, meta["trace"], directory, root) \
        if meta.get("trace") is not None else None
    return event_from_fields(fields, frames, trace)


def _warnings_from_file(path: Path, root: Path, rank: int) -> list[EarlyWarning]:
    """A rank's early warnings; every field checked."""
    data = read_json(path, root)
    if not isinstance(data, dict) or data.get("format") != WARNINGS_FORMAT_NAME:
        raise RunLoadError(f"{path}: not a nanwidget warnings file (no \"format\": "
                           f"\"{WARNINGS_FORMAT_NAME}\")")
    items = data.get("warnings")
    if not isinstance(items, list):
        raise RunLoadError(f"{path}: \"warnings\" must be a list")
    found = []
    for item in items:
        if not isinstance(item, dict):
            raise RunLoadError(f"{path}: each warning must be a JSON object")
        fields = {name: _checked(path, item, name, kind, optional=name in WARNING_DEFAULTS)
                  for name, kind in WARNING_FIELDS.items()}
        if fields["reason"] not in REASONS:
            raise RunLoadError(f"{path}: a warning's reason must be one of "
                               f"{', '.join(REASONS)}, got {fields['reason']!r}")
        if fields["per"] not in (None, *PERS):
            raise RunLoadError(f"{path}: a warning's per must be one of {', '.join(PERS)}, "
                               f"got {fields['per']!r}")
        if fields["rank"] != rank:
            raise RunLoadError(f"{path}: a warning says rank {fields['rank']}, the recording "
                               f"is rank {rank}'s")
        found.append(warning_from_fields(fields))
    return found


def _is_folder(path: Path, root: Path) -> bool:
    """A real folder inside the recording (a link to one is followed only when it stays inside)."""
    if not os.path.isdir(path):
        return False
    inside(path, root)
    return True


def _checked_file(path: Path, read: Callable[[], T]) -> T:
    """``read()``; whatever goes wrong in it is a RunLoadError naming ``path``."""
    try:
        return read()
    except RunLoadError:
        raise
    except Exception as error:  # malformed data that passed the format checks
        raise RunLoadError(f"{path}: damaged ({type(error).__name__}: {error})") from error


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
        # Every file is read through the recording's real folder: a link out of it is refused.
        root = Path(os.path.realpath(self.log_dir))
        if os.path.lexists(self.log_dir / "manifest.json"):
            rank_dirs = [self.log_dir]  # pointed at one rank's folder
        else:
            rank_dirs = sorted(p for p in self.log_dir.iterdir()
                               if RANK_DIR.match(p.name) and _is_folder(p, root))
        if not rank_dirs:
            raise RunLoadError(f"{self.log_dir}: holds no nanwidget recording (expected "
                               "rank-NNNNN/manifest.json folders written by watch(log_dir=...))")
        self.manifests: dict[int, dict] = {}
        frames: list[pd.DataFrame] = []
        history: list[pd.DataFrame] = []
        grads: list[pd.DataFrame] = []
        events: list[NanEvent] = []
        early: list[EarlyWarning] = []
        for directory in rank_dirs:
            manifest_path = directory / "manifest.json"
            if not os.path.lexists(manifest_path):
                raise RunLoadError(f"{manifest_path}: missing; {directory} is not a complete "
                                   "nanwidget recording")
            manifest = _checked_file(manifest_path, lambda: _check_manifest(manifest_path, root))
            rank = manifest["rank"]
            match = RANK_DIR.match(directory.name)
            if match and int(match.group(1)) != rank:
                raise RunLoadError(f"{manifest_path}: says rank {rank}, folder says "
                                   f"{int(match.group(1))}")
            if rank in self.manifests:
                raise RunLoadError(f"{manifest_path}: rank {rank} recorded twice")
            self.manifests[rank] = manifest
            for path in sorted(directory.iterdir()):
                chunk = CHUNK_FILE.match(path.name)
                if chunk:
                    kind = chunk.group(1)
                    if kind == "history":
                        history.append(_checked_file(
                            path, lambda: read_table(path, HISTORY_KINDS, within=root)))
                    elif kind == "frames":
                        frames.append(_checked_file(path, lambda: frames_from_table(
                            read_table(path, FRAME_KINDS_REQUIRED, within=root), path)))
                    else:
                        table = _checked_file(path, lambda: read_table(path, {"batch": "int"},
                                                                       within=root))
                        grads.append(table if "rank" in table else table.assign(rank=rank))
                elif EVENT_FILE.match(path.name):
                    events.append(_checked_file(
                        path, lambda: _event_from_file(path, directory, root, rank)))
                elif path.name == WARNINGS_FILE:  # recordings made before them have none
                    early.extend(_checked_file(
                        path, lambda: _warnings_from_file(path, root, rank)))
        # A rank that stopped for a peer ("peer" events) sorts after the rank that found it.
        events.sort(key=lambda e: (e.batch, e.origin == "peer", e.rank))
        self._events = events
        early.sort(key=lambda w: (w.batch, w.rank))
        self._warnings = early
        self._frames = self._merge_frames(frames + [e.frames for e in events])
        self._history = self._merge_history(history)
        self._grads = (pd.concat(grads, ignore_index=True).sort_values(["batch", "rank"],
                                                                       kind="stable")
                       .reset_index(drop=True) if grads else None)
        self._dropped = {rank: self._events_dropped(rank) for rank in self.manifests}
        self._notes = [note for rank in self.ranks for note in self._rank_notes(rank)]

    def _events_dropped(self, rank: int) -> int:
        """Events of ``rank`` past max_events: counted by the watch, on disk in no file."""
        manifest = self.manifests[rank]
        kept = sum(1 for event in self._events if event.rank == rank)
        if kept > _option(manifest, "max_events", kept):
            return 0  # an older nanwidget wrote every event, counted or not: none is missing
        return int(manifest.get("events_dropped", 0))

    def _last_batch(self, rank: int) -> int | None:
        """The last batch ``rank`` has anything of on disk (history, frames, events, grads)."""
        found = [table.loc[table["rank"] == rank, column]
                 for table, column in ((self._history, "batch_end"), (self._frames, "batch"),
                                       (self.grad_history(), "batch")) if not table.empty]
        found.append(pd.Series([e.batch for e in self._events if e.rank == rank], dtype="int64"))
        batches = pd.concat(found, ignore_index=True)
        return int(batches.max()) if not batches.empty else None

    def _rank_notes(self, rank: int) -> list[str]:
        manifest = self.manifests[rank]
        closed = manifest.get("closed") is not None
        whose = f"rank {rank}: " if len(self.manifests) > 1 or self.world_size > 1 else ""
        notes = []
        if not closed:
            last = self._last_batch(rank)
            held = "nothing was flushed yet" if last is None else (
                f"the last batch on disk is {last}; records made after the last flush may be "
                "missing")
            notes.append(f"{whose}recording not closed: its process is still running, or it "
                         f"ended before closing the watch (killed, or a hard crash); {held}")
        dropped = self._dropped[rank]
        if dropped:
            limit = _option(manifest, "max_events", None)
            count = f"{dropped}" if closed else f"at least {dropped}"
            first = f"the first {limit} are" if limit is not None else "the first ones are"
            notes.append(f"{whose}{count} later event(s) past max_events were counted but not "
                         f"kept ({first})")
        return notes

    @staticmethod
    def _merge_frames(parts: list[pd.DataFrame]) -> pd.DataFrame:
        parts = [p for p in parts if not p.empty]
        if not parts:
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
            return empty_history()
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
        """Every recorded event, by batch; within a batch the ranks that found a NaN/Inf first,
        then those that stopped with them ("peer")."""
        return list(self._events)

    @property
    def event(self) -> NanEvent | None:
        """The first event (lowest batch; the rank that found it before those that stopped with
        it; then lowest rank), or None."""
        return self._events[0] if self._events else None

    @property
    def events_dropped(self) -> int:
        """Events past ``max_events``, counted but not kept (the disk keeps what the watch
        kept), all ranks together; of a rank not closed, its count at its last flush."""
        return sum(self._dropped.values())

    @property
    def finished(self) -> bool:
        """True when every rank's recording was closed (``close()``, the watch collected, or
        interpreter exit). False while a process still writes, or when one ended without it
        (killed): then the records after its last flush may be missing (see ``notes``)."""
        return all(m.get("closed") is not None for m in self.manifests.values())

    @property
    def notes(self) -> list[str]:
        """What the recording lacks, in words, one line per rank and fact: a rank not closed
        (with its last batch on disk), events counted past ``max_events``. Empty when whole."""
        return list(self._notes)

    @property
    def warnings(self) -> list[EarlyWarning]:
        """The early warnings the run recorded, by batch (none in recordings made before
        nanwidget had them, or with ``early_warning=False``)."""
        return list(self._warnings)

    def grad_history(self) -> pd.DataFrame:
        """Gradient norms per batch and parameter, when the run recorded them."""
        if self._grads is None:
            return pd.DataFrame({"rank": pd.Series(dtype="int64"),
                                 "batch": pd.Series(dtype="int64")})
        return self._grads.copy()

    def report(self, event: NanEvent | None = None) -> str:
        """An event's report (default: the first event), or the recorded frames when none.

        As :meth:`NanWatch.report`: the trace batches recorded before the event come first. A
        recording may come from elsewhere: control characters in it (module names are
        whatever ``add_module`` accepted) are written as escapes (``\\x1b``), never sent
        to the terminal.
        """
        return printable(self._report(event))

    def _report(self, event: NanEvent | None) -> str:
        event = event or self.event
        frames = self._frames
        traced = pd.Series(False, index=frames.index)
        for rank, manifest in self.manifests.items():
            traced |= (frames["rank"] == rank) & frames["batch"].isin(_option(manifest, "trace_batches", []))
        if event is not None:
            earlier = traced & (frames["rank"] == event.rank) & (frames["batch"] < event.batch)
            return format_event_report(event, event.frames, trace_frames=frames[earlier])
        # The frames a watch held at the end: the last max_frames of each rank.
        keys = ["rank", "batch", "phase", "frame"]
        held = []
        for rank, manifest in sorted(self.manifests.items()):
            own = frames[frames["rank"] == rank]
            groups = own[keys].drop_duplicates().tail(_option(manifest, "max_frames", len(own)))
            held.append(own.merge(groups, on=keys))
        held_frames = pd.concat(held, ignore_index=True) if held else frames
        last = int(frames["batch"].max()) if not frames.empty else None
        return format_event_report(None, held_frames, batch=last, trace_frames=frames[traced])

    def browse(self) -> Any:
        """The FrameBrowser widget over this recording (needs ipywidgets)."""
        return open_browser(self)

    def __repr__(self) -> str:
        unfinished = "" if self.finished else ", not closed (see .notes)"
        return (f"<nanwidget.Run {str(self.log_dir)!r}: {self.model_class}, ranks {self.ranks}, "
                f"{len(self._events)} event(s){unfinished}>")


def load_run(log_dir: str | os.PathLike) -> Run:
    """Read what ``watch(..., log_dir=log_dir)`` recorded, every rank merged.

    Raises :class:`RunLoadError` (a ValueError) naming the file when the directory is
    missing, foreign or damaged. Nothing in the directory is executed.
    """
    return Run(log_dir)

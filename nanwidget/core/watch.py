"""NanWatch: the one handle a user holds. It checks the options, builds a
:class:`~nanwidget.core.recorder.Recorder` and composes the features the options ask for:

- replay (:mod:`.replay`): batch capture, ``replay()``, ``replay_on_nan``;
- gradients (:mod:`.grads`): backward frames (``backward=True``) and ``check_grad_norms()``;
- persistence (:mod:`.persist`): ``log_dir`` spooling;
- consensus (:mod:`.consensus`): every DDP rank stops at the same batch;
- sentinel (:mod:`.sentinel`): ``mode="sentinel"`` and compiled models: only the root's outputs
  and the gradients are checked, and a failing batch is replayed for the detail.

Each feature is a plain object that sees the recorder through its public API; the order they
are added in is the order they review an event (the replay attaches its trace, then the
consensus tells the other ranks, then the event is recorded and written to disk).
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import numbers
import operator
import os
import sys
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
from torch import nn

from .consensus import Consensus, consensus_wanted
from .events import GradEvent, NanEvent
from .grads import BackwardFrames, GradNorms
from .persist import RecordingWriter
from .recorder import Feature, Recorder
from .replay import BatchCapture, Replayer, ReplayError
from .report import format_event_report
from .schema import ON_NAN_CHOICES
from .sentinel import Sentinel, compiled_in_place, has_compiled_parts, is_compile_wrapper
from .trace import Trace
from .viewer import open_browser

__all__ = ["NanWatch", "WatchParts", "WatchOptions", "SkipTypesWarning", "check_options", "watch",
           "live_watches", "MAX_EVENTS", "MODES"]

MAX_EVENTS = 100

_LIVE: weakref.WeakSet[NanWatch] = weakref.WeakSet()


def live_watches() -> list[NanWatch]:
    """Every NanWatch that is still watching (a watch whose variable was lost can be closed)."""
    return [w for w in list(_LIVE) if not w.closed]


MODES = ("full", "sentinel")


@dataclass(frozen=True)
class _Target:
    """What a watch hooks: the model (names come from it), the module whose call is a batch
    (a torch.compile wrapper around the model, or the model), and how it is compiled."""

    root: nn.Module
    entry: nn.Module
    compiled: str  # "" | "wrapper" (torch.compile(model)) | "in place" | "parts"


def _unwrap_model(model: Any) -> _Target:
    if not isinstance(model, nn.Module):
        raise TypeError(f"nanwidget.watch needs a torch.nn.Module, got {type(model).__name__}")
    entry = model
    compiled = ""
    if is_compile_wrapper(model):
        compiled = "wrapper"
        model = model._orig_mod
    if isinstance(model, nn.DataParallel):
        raise TypeError("nanwidget does not watch nn.DataParallel (its replicas are rebuilt every "
                        "step, so hooks on them are lost); use DistributedDataParallel under "
                        "torchrun, or watch model.module on one device")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("nanwidget cannot see inside a TorchScript module (hooks do not run in "
                        "scripted code); watch the original nn.Module before torch.jit.script")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        if compiled:
            model = model.module  # torch.compile(DDP(model)): the user's module, eagerly replayed
        else:
            model = entry = model.module  # user's own names, no "module." prefix
    if not compiled and compiled_in_place(model):
        compiled = "in place"
    if not compiled and has_compiled_parts(model):
        compiled = "parts"
    return _Target(root=model, entry=entry, compiled=compiled)


def _resolve_mode(mode: str | None, target: _Target) -> str:
    """The mode a watch runs in: as asked, or sentinel for a compiled model (with a note)."""
    if not target.compiled:
        return mode or "full"
    what = {"wrapper": "a torch.compile'd model", "in place": "a model compiled in place "
            "(module.compile())", "parts": "a model with compiled submodules "
            f"({', '.join(has_compiled_parts(target.root)[:3])})"}[target.compiled]
    if mode == "full":
        raise ValueError(
            f"mode='full' cannot watch {what}: compiled code skips the hooks of the modules "
            "inside it (and Dynamo tracing them would break the graph). Watch it in sentinel "
            "mode, nw.watch(model) or nw.watch(model, mode='sentinel'): the outputs and gradients "
            "are checked every batch, and a failing batch is replayed eagerly in full detail. "
            "For full frames of every batch, watch the uncompiled module instead")
    if mode is None:
        warnings.warn(f"nanwidget: watching {what} in sentinel mode (no graph break, no "
                      "recompile; a NaN/Inf is replayed eagerly for the full detail)",
                      UserWarning, stacklevel=4)
    return "sentinel"


# ---------------------------------------------------------------------------- the options
MAX_FRAMES_LIMIT = 10_000_000  # a ring beyond this would not fit in memory anyway


@dataclass(frozen=True)
class WatchOptions:
    """The options of :func:`watch`, checked and normalised (see :func:`check_options`)."""

    max_frames: int
    trace_batches: frozenset[int]
    abort_after: int | None
    skip_classes: tuple[type, ...]
    skip_names: frozenset[str]
    backward: bool
    grad_norm_warn: float | None
    on_nan: str
    keep_batches: int
    replay_on_nan: bool
    log_dir: str | os.PathLike | None
    max_events: int
    snapshot_weights: bool
    allow_inf: tuple[tuple[str, ...], tuple[type, ...]]
    mode: str | None = None  # None: "full", or "sentinel" for a compiled model
    sample_every: int | None = None


def _whole_number(name: str, value: Any, *, least: int, most: int | None = None) -> int:
    """``value`` as an int (numpy and torch integers too); bools, floats and text refused."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a whole number, got {value!r} (a bool)")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a whole number, got {value!r} "
                        f"({type(value).__name__})") from None
    if number < least or (most is not None and number > most):
        bound = f"at least {least}" + (f" and at most {most:,}" if most is not None else "")
        raise ValueError(f"{name} must be {bound}, got {number}")
    return number


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def _batch_numbers(value: Any) -> frozenset[int]:
    if isinstance(value, (str, bytes)):
        raise TypeError(f"trace_batches takes batch numbers, got the text {value!r}; write a "
                        f"list such as [1, 3]")
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"trace_batches takes batch numbers, got {value!r}")
    try:
        return frozenset({operator.index(value)}) if not hasattr(value, "__iter__") or \
            getattr(value, "ndim", 1) == 0 else _each_batch(list(value))
    except TypeError:
        raise TypeError(f"trace_batches takes batch numbers (e.g. [1, 3]), got {value!r}") from None


def _each_batch(items: list[Any]) -> frozenset[int]:
    bad = []
    batches = set()
    for item in items:
        try:
            batches.add(_whole_number("trace_batches", item, least=0))
        except (TypeError, ValueError):
            bad.append(item)
    if bad:
        raise ValueError(f"trace_batches takes batch numbers, whole and >= 0 (batches count from "
                         f"0); these are not: {', '.join(repr(b) for b in bad)}")
    return frozenset(batches)


def _one_or_many(value: Any, takes: str) -> list:
    """A list of the items of an option that takes one string or class, or several."""
    if isinstance(value, (str, type)):
        return [value]
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{takes}, got {value!r}") from None


def _skip_types(model: nn.Module, value: Any) -> tuple[tuple[type, ...], frozenset[str]]:
    """Module classes or class names; one class or one name alone is accepted too."""
    items = _one_or_many(value, "skip_types takes nn.Module classes or class names (e.g. "
                                "[nn.Dropout] or ['Dropout'])")
    classes: list[type] = []
    names: set[str] = set()
    for item in items:
        if isinstance(item, str):
            names.add(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            classes.append(item)
        else:
            raise TypeError(f"skip_types takes nn.Module classes or class names, got {item!r}")
    present = {type(m).__name__ for m in model.modules()}
    for name in sorted(names - present):
        close = difflib.get_close_matches(name, sorted(present), n=1, cutoff=0.6) or [
            p for p in sorted(present) if p.lower() == name.lower()]
        hint = f"; did you mean {close[0]!r}?" if close else ""
        _warn_caller(f"skip_types: this model has no module of class {name!r}, so it skips "
                     f"nothing{hint}")
    return tuple(classes), frozenset(names)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class SkipTypesWarning(UserWarning):
    """A ``skip_types`` class name that no module of the model has: it skips nothing."""


def _warn_caller(message: str) -> None:
    """A warning pointing at the first frame outside nanwidget (the user's watch() call)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, SkipTypesWarning, stacklevel=level)


def _allow_inf(model: nn.Module, value: Any) -> tuple[tuple[str, ...], tuple[type, ...]]:
    """Module name globs and nn.Module classes whose outputs may hold ±inf (one, or several);
    one that matches no module of ``model`` warns (it would allow nothing)."""
    items = _one_or_many(value, "allow_inf takes module name globs (e.g. 'encoder.*.mask') or "
                                "nn.Module classes")
    patterns: list[str] = []
    classes: list[type] = []
    for item in items:
        if isinstance(item, str) and item:
            patterns.append(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            classes.append(item)
        else:
            raise TypeError(f"allow_inf takes module name globs (e.g. 'encoder.*.mask') or "
                            f"nn.Module classes, got {item!r}")
    named = dict(model.named_modules())
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in named)]
    unmatched += [c.__name__ for c in classes if not any(isinstance(m, c) for m in named.values())]
    if unmatched:
        examples = ", ".join(repr(n) for n in list(named)[1:4]) or "''"
        warnings.warn(f"nanwidget: allow_inf={', '.join(unmatched)} matches no module of this "
                      f"model, so it allows nothing (module names look like {examples})",
                      RuntimeWarning, stacklevel=4)
    return tuple(patterns), tuple(classes)


def _threshold(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating)):
        raise TypeError(f"grad_norm_warn must be a positive number or None, got {value!r} "
                        f"({type(value).__name__})")
    number = float(value)
    if not (0 < number < math.inf):
        raise ValueError(f"grad_norm_warn must be a positive finite number, got {value!r}")
    return number


def _directory(value: Any) -> str | os.PathLike | None:
    if value is None or (isinstance(value, str) and value == ""):
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"log_dir must be a directory path (str or pathlib.Path), got {value!r} "
                        f"({type(value).__name__})")
    path = os.fspath(value)
    if isinstance(path, bytes) or (os.path.exists(path) and not os.path.isdir(path)):
        raise ValueError(f"log_dir must be a directory; {path!r} is a file (pass a new folder: "
                         "it is created when missing)")
    return value


def check_options(model: nn.Module, *, max_frames: Any = 21, trace_batches: Any = (),
                  abort_after: Any = None, skip_types: Any = (), backward: Any = False,
                  grad_norm_warn: Any = None, on_nan: Any = "raise", keep_batches: Any = 4,
                  replay_on_nan: Any = False, log_dir: Any = None, max_events: Any = MAX_EVENTS,
                  snapshot_weights: Any = False, allow_inf: Any = (), mode: Any = None,
                  sample_every: Any = None) -> WatchOptions:
    """Every option of :func:`watch`, checked in one place before anything is hooked.

    Misuse raises TypeError (wrong kind of value) or ValueError (out of range) naming the
    option; a ``skip_types`` name that no module of ``model`` has warns with the closest one.
    """
    if not isinstance(on_nan, str) or on_nan not in ON_NAN_CHOICES:
        raise ValueError(f"on_nan must be one of {', '.join(ON_NAN_CHOICES)}; got {on_nan!r}")
    if mode is not None and (not isinstance(mode, str) or mode not in MODES):
        raise ValueError(f"mode must be 'full' or 'sentinel', got {mode!r}")
    if sample_every is not None:
        sample_every = _whole_number("sample_every", sample_every, least=1)
        if mode == "full":
            raise ValueError("sample_every is for mode='sentinel' (full mode records every "
                             "batch already)")
    skip_classes, skip_names = _skip_types(model, skip_types)
    return WatchOptions(
        max_frames=_whole_number("max_frames", max_frames, least=1, most=MAX_FRAMES_LIMIT),
        trace_batches=_batch_numbers(trace_batches),
        abort_after=None if abort_after is None else _whole_number("abort_after", abort_after,
                                                                   least=0),
        skip_classes=skip_classes, skip_names=skip_names,
        backward=_flag("backward", backward), grad_norm_warn=_threshold(grad_norm_warn),
        on_nan=on_nan, keep_batches=_whole_number("keep_batches", keep_batches, least=0),
        replay_on_nan=_flag("replay_on_nan", replay_on_nan), log_dir=_directory(log_dir),
        max_events=_whole_number("max_events", max_events, least=1),
        snapshot_weights=_flag("snapshot_weights", snapshot_weights),
        allow_inf=_allow_inf(model, allow_inf), mode=mode, sample_every=sample_every)


@dataclass(frozen=True)
class WatchParts:
    """The features a watch is made of (None where its option is off)."""

    capture: BatchCapture | None
    replayer: Replayer | None
    backward: BackwardFrames | None
    grads: GradNorms
    writer: RecordingWriter | None
    consensus: Consensus | None
    sentinel: Sentinel | None = None


class NanWatch:
    """Records frames of a model and stops at the first NaN/Inf. Create it with :func:`watch`."""

    def __init__(self, model: nn.Module, *, max_frames: int = 21,
                 trace_batches: Iterable[int] = (), abort_after: int | None = None,
                 skip_types: Iterable[type | str] = (), backward: bool = False,
                 grad_norm_warn: float | None = None, on_nan: str = "raise",
                 keep_batches: int = 4, replay_on_nan: bool = False,
                 log_dir: str | None = None, max_events: int = MAX_EVENTS,
                 snapshot_weights: bool = False,
                 allow_inf: Iterable[str | type] | str | type = (), mode: str | None = None,
                 sample_every: int | None = None) -> None:
        target = _unwrap_model(model)
        root = target.root
        checked = check_options(root, max_frames=max_frames, trace_batches=trace_batches,
                                abort_after=abort_after, skip_types=skip_types,
                                backward=backward, grad_norm_warn=grad_norm_warn, on_nan=on_nan,
                                keep_batches=keep_batches, replay_on_nan=replay_on_nan,
                                log_dir=log_dir, max_events=max_events,
                                snapshot_weights=snapshot_weights, allow_inf=allow_inf,
                                mode=mode, sample_every=sample_every)
        mode = _resolve_mode(checked.mode, target)
        if checked.sample_every is not None and mode != "sentinel":
            raise ValueError("sample_every is for mode='sentinel' (full mode records every "
                             "batch already)")
        snapshot_weights = checked.snapshot_weights
        skip = (checked.skip_classes, checked.skip_names)

        self.model = root
        self.max_frames = checked.max_frames
        self.trace_batches = checked.trace_batches
        self.abort_after = checked.abort_after
        self.backward = checked.backward
        self.grad_norm_warn = checked.grad_norm_warn
        self.on_nan = checked.on_nan
        self.keep_batches = checked.keep_batches
        self.replay_on_nan = checked.replay_on_nan
        self.log_dir = checked.log_dir
        self.max_events = checked.max_events
        self.allow_inf = checked.allow_inf[0] + checked.allow_inf[1]
        self.mode = mode
        self.sample_every = checked.sample_every
        # "" for an eager model; "wrapper", "in place" or "parts" for compiled code.
        self.compiled = target.compiled

        self._recorder = Recorder(root, max_frames=self.max_frames,
                                  trace_batches=self.trace_batches, abort_after=self.abort_after,
                                  skip=skip, on_nan=self.on_nan, max_events=self.max_events,
                                  allow_inf=checked.allow_inf, root_only=mode == "sentinel",
                                  entry=target.entry)
        self._recorder.owner = self  # lives as long as the hooks do: see live_watches()
        try:
            self._parts = self._compose(snapshot_weights)
        except BaseException:
            self._recorder.close()
            raise
        _LIVE.add(self)

    def _compose(self, snapshot_weights: bool) -> WatchParts:
        """Add the features the options ask for, in review order."""
        recorder = self._recorder
        capture = replayer = backward = writer = consensus = sentinel = None
        sentinel_mode = self.mode == "sentinel"
        keep = max(self.keep_batches, 1 if self.replay_on_nan or sentinel_mode else 0)
        if keep or self.trace_batches or snapshot_weights:
            capture = recorder.add_feature(BatchCapture(
                self.model, keep=keep, trace_batches=self.trace_batches,
                snapshot_weights=snapshot_weights))
            # In sentinel mode every event is replayed by the sentinel itself.
            replayer = Replayer(recorder, capture,
                                replay_on_nan=self.replay_on_nan and not sentinel_mode)
            if replayer.replay_on_nan:  # it reviews events only to replay them
                recorder.add_feature(replayer)
        if self.backward and not sentinel_mode:
            backward = recorder.add_feature(BackwardFrames(recorder))
        grads = recorder.add_feature(GradNorms(recorder, threshold=self.grad_norm_warn))
        with_consensus = consensus_wanted()
        if sentinel_mode:
            assert capture is not None
            sentinel = recorder.add_feature(Sentinel(
                recorder, capture, sample_every=self.sample_every, backward=self.backward,
                compiled=bool(self.compiled),
                defer_reads="never" if with_consensus else "device"))
        if with_consensus:
            consensus = recorder.add_feature(Consensus(recorder))
        if self.log_dir is not None and self.log_dir != "":
            writer = recorder.add_feature(RecordingWriter(
                recorder, self.log_dir, options=self._options(), grad_history=grads.history_table))
        return WatchParts(capture=capture, replayer=replayer, backward=backward, grads=grads,
                          writer=writer, consensus=consensus, sentinel=sentinel)

    def _options(self) -> dict[str, Any]:
        return {"max_frames": self.max_frames, "trace_batches": sorted(self.trace_batches),
                "abort_after": self.abort_after, "backward": self.backward,
                "grad_norm_warn": self.grad_norm_warn, "on_nan": self.on_nan,
                "keep_batches": self.keep_batches, "replay_on_nan": self.replay_on_nan,
                "max_events": self.max_events,
                "allow_inf": [a if isinstance(a, str) else a.__name__ for a in self.allow_inf],
                "mode": self.mode, "sample_every": self.sample_every}

    # ------------------------------------------------------------------ composition
    @property
    def parts(self) -> WatchParts:
        """The features this watch is made of (replay capture, gradients, writer, consensus)."""
        return self._parts

    @property
    def recorder(self) -> Recorder:
        """The recorder: hooks, batch state, frames and events."""
        return self._recorder

    def add_feature(self, feature: Feature) -> Feature:
        """Let ``feature`` (a :class:`~nanwidget.core.recorder.Feature`) see this watch's
        batches and events from now on; it is closed with the watch."""
        return self._recorder.add_feature(feature)

    # ------------------------------------------------------------------ state
    @property
    def batch(self) -> int:
        """The batch being recorded (0-based); the root forward's return counts the next one."""
        return self._recorder.batch

    @property
    def rank(self) -> int:
        """torch.distributed rank (0 without a process group)."""
        return self._recorder.rank

    @property
    def module_names(self) -> list[str]:
        """Qualified names of the hooked modules ("" is the root)."""
        return self._recorder.module_names

    @property
    def module_types(self) -> list[str]:
        """Class names of the hooked modules, in the order of :attr:`module_names`."""
        return self._recorder.module_types

    @property
    def events(self) -> list[NanEvent]:
        """Every event so far (capped at ``max_events``; see ``events_dropped``)."""
        return self._recorder.events

    @property
    def event(self) -> NanEvent | None:
        """The first event, or None."""
        return self._recorder.event

    @property
    def events_dropped(self) -> int:
        """Events past ``max_events``, counted but not kept."""
        return self._recorder.events_dropped

    @property
    def interrupted_batches(self) -> list[int]:
        """Batches whose forward never returned (e.g. KeyboardInterrupt)."""
        return list(self._recorder.interrupted_batches)

    @property
    def closed(self) -> bool:
        return self._recorder.closed

    def step(self) -> None:
        """End the current batch and count the next one; automatic counting stops. Called right
        after a forward that counted its batch, it ends that batch without skipping a number."""
        self._recorder.step()

    def set_batch(self, batch: int) -> None:
        """End the current batch (its frames are checked) and continue as ``batch``.

        From the first call on, the root forward no longer advances the count: use this for
        loops that call submodules directly or accumulate gradients over several forwards.
        """
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 0:
            raise ValueError(f"batch must be an integer >= 0, got {batch!r}")
        self._recorder.set_batch(batch)

    # ------------------------------------------------------------------ results
    def flush(self) -> None:
        """Resolve frames recorded since the last batch boundary (never raises NanDetected)."""
        self._recorder.flush()

    def frames(self, batch: int | None = None) -> pd.DataFrame:
        """Frames in the ring buffer, or every frame of trace batch ``batch``."""
        return self._recorder.frames_table(batch)

    def history(self) -> pd.DataFrame:
        """One row per (batch, module): abs_max, abs_min and nonfinite of its outputs."""
        return self._recorder.history_table()

    def report(self, event: NanEvent | None = None) -> str:
        """Text dump of an event's frames, or of the frames held; trace batches come first.

        With an event, the trace batches recorded before the event's batch precede its dump,
        as transformers prints them during the run.
        """
        event = event or self.event
        recorder = self._recorder
        traced = [self.frames(batch=batch) for batch in recorder.recorded_trace_batches
                  if event is None or batch < event.batch]
        trace_frames = pd.concat(traced, ignore_index=True) if traced else None
        if event is not None:
            if trace_frames is not None:
                trace_frames = trace_frames[trace_frames["rank"] == event.rank]
            return format_event_report(event, event.frames, trace_frames=trace_frames)
        held = self.frames()
        last = recorder.batch if recorder.manual_batches else recorder.batch - 1
        return format_event_report(None, held, batch=last, trace_frames=trace_frames)

    # ------------------------------------------------------------------ replay
    def replay(self, batch: int, *, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Trace:
        """Re-run ``batch`` in trace mode: every module frame and every tensor op.

        With ``loss_fn``, also runs the backward of ``loss_fn(output)``. The model is left exactly
        as it was (parameters, buffers, ``.grad``, train/eval flags, ``requires_grad``, RNG
        states) and the watch's own recording is not disturbed. Raises ``BatchNotHeldError``
        (listing the held batches) or ``InputModifiedError`` when a faithful replay is impossible.
        """
        replayer = self._parts.replayer
        if replayer is None:
            raise ReplayError("this watch holds no batches to replay: it was created with "
                              "keep_batches=0 and no trace_batches; watch with keep_batches=N")
        return replayer.replay(batch, loss_fn)

    def held_batches(self) -> list[int]:
        """Batch numbers :meth:`replay` can run now."""
        capture = self._parts.capture
        return capture.held_batches() if capture is not None else []

    def set_weight_snapshots(self, enabled: bool = True) -> None:
        """Copy parameters and buffers at the start of every held batch from now on, so that
        replays stay exact after optimizer steps (costs a copy of the weights per batch)."""
        capture = self._parts.capture
        if capture is None:
            raise ReplayError("this watch holds no batches to replay (keep_batches=0); weight "
                              "snapshots need held batches")
        capture.set_snapshots(enabled)

    # ------------------------------------------------------------------ gradients
    def check_grad_norms(self) -> bool:
        """After ``loss.backward()``: flag non-finite or too large gradient norms.

        Computes every parameter's gradient L2 norm in one batched reduction with one host sync,
        records them in :meth:`grad_history` under the batch of the last forward, and adds a
        :class:`GradEvent` for each norm that is non-finite or above ``grad_norm_warn`` (once
        per batch and parameter). Returns whether any norm was flagged; never raises for one
        (skip ``optimizer.step()`` on True). Under torchrun with ``on_nan="raise"`` (the
        ranks stop together), call it on every rank: they agree (one all-reduce), so each
        returns True when any rank flagged a norm (FSDP2 ranks measure their own gradient
        shards) and they all skip the same step. With "warn" or "record" the answer is this
        rank's own (the training callbacks make their decision together themselves).
        """
        flagged = self._parts.grads.check()
        consensus = self._parts.consensus
        if consensus is not None and self.on_nan == "raise":
            return consensus.any_rank(flagged)
        return flagged

    @property
    def grad_events(self) -> list[GradEvent]:
        """Every :class:`GradEvent` flagged by :meth:`check_grad_norms`."""
        return list(self._parts.grads.events)

    def grad_history(self) -> pd.DataFrame:
        """Gradient norms per batch and parameter (bounded: older batches merged into windows)."""
        return self._parts.grads.history_table()

    # ------------------------------------------------------------------ notebook
    def browse(self) -> Any:
        """The FrameBrowser widget for this watch (needs ipywidgets)."""
        return open_browser(self)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Remove exactly the hooks this watch added (never the user's own); idempotent."""
        self._recorder.close()
        _LIVE.discard(self)

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """While inside, this thread's hooks record nothing: batch count, ring, history and
        events stay put (trace-mode replays run the model under this)."""
        with self._recorder.suspend():
            yield

    def __enter__(self) -> NanWatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "watching"
        mode = f", {self.mode} mode" + (" (compiled)" if self.compiled else "") \
            if self.mode != "full" else ""
        return (f"<NanWatch {state} {type(self.model).__name__} ({len(self.module_names)} modules"
                f"{mode}), batch {self.batch}, {len(self.events)} event(s)>")


def watch(model: nn.Module, *, max_frames: int = 21, trace_batches: Iterable[int] = (),
          abort_after: int | None = None, skip_types: Iterable[type | str] = (),
          backward: bool = False, grad_norm_warn: float | None = None, on_nan: str = "raise",
          keep_batches: int = 4, replay_on_nan: bool = False, log_dir: str | None = None,
          max_events: int = MAX_EVENTS, snapshot_weights: bool = False,
          allow_inf: Iterable[str | type] | str | type = (), mode: str | None = None,
          sample_every: int | None = None) -> NanWatch:
    """Start watching ``model``: a frame per module call, a check at every batch end.

    Options as in the contract: ``max_frames`` frames kept in the ring buffer; ``trace_batches``
    whose every frame is kept; ``abort_after`` raises :class:`AbortAfterBatch` at the first
    finished batch numbered at or past it; ``skip_types`` module classes (or class names) not
    hooked; ``backward`` records gradient frames; ``grad_norm_warn`` flags larger gradient
    norms; ``on_nan`` is "raise", "warn" or "record"; ``keep_batches`` recent batches held for
    :meth:`NanWatch.replay`; ``replay_on_nan`` attaches a trace to each event; ``log_dir``
    spools records to disk; ``max_events`` events kept; ``snapshot_weights`` copies the weights
    of held batches so replays stay exact after optimizer steps; ``allow_inf`` names modules
    (name globs such as ``"*.mask_builder"``, or classes) whose outputs may hold ±inf on
    purpose (NaN always counts).

    ``mode``: "full" (the default for an eager model: hooks on every module, every batch) or
    "sentinel" (made to stay on: only the root's outputs, and with ``backward=True`` the
    gradients, are checked each batch, and a failing batch is replayed eagerly so its event,
    frames, report and trace are what full mode gives). A compiled model
    (``nw.watch(torch.compile(model))``, ``model.compile()``) is watched in sentinel mode:
    no graph break, no recompile. ``sample_every=N`` (sentinel mode): record every Nth batch
    in full, for the history, the trend plots and the FrameBrowser.
    Also a context manager: ``with nw.watch(model) as w: ...`` closes the hooks on exit.
    """
    return NanWatch(model, max_frames=max_frames, trace_batches=trace_batches,
                    abort_after=abort_after, skip_types=skip_types, backward=backward,
                    grad_norm_warn=grad_norm_warn, on_nan=on_nan, keep_batches=keep_batches,
                    replay_on_nan=replay_on_nan, log_dir=log_dir, max_events=max_events,
                    snapshot_weights=snapshot_weights, allow_inf=allow_inf, mode=mode,
                    sample_every=sample_every)

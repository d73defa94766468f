"""NanWatch: hooks a model, records a frame per module call, finds the first NaN/Inf.

Hot path (every module call): hooks read metadata, check weight version counters and hand
tensors to a :class:`PendingStats`, which reads dense CPU tensors at once with the native kernel
and queues the rest; no device result is read back. When the root module's forward returns,
the batch is *resolved*: the queued tensors get one batched reduction and one host copy per
device, then history, detection, the frame ring and the extensions (replay capture, gradients,
persistence, distributed consensus) see the finished frames.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Callable

import pandas as pd
import torch
from torch import nn

from .events import AbortAfterBatch, NanDetected, NanEvent
from .frames import Entry, Frame, FrameBuffer, frames_to_dataframe, non_tensor_entry
from .history import History
from .report import format_event_report, format_frames
from .stats import PendingStats, classify, version_of
from .walk import iter_leaves

if TYPE_CHECKING:  # pragma: no cover
    from .replay import Trace

__all__ = ["NanWatch", "watch", "NanWarning", "WatchExtension", "MAX_EVENTS", "current_rank",
           "live_watches"]

MAX_EVENTS = 100
ON_NAN_CHOICES = ("raise", "warn", "record")

_Tensor = torch.Tensor
_STRIDED = torch.strided
_INPUT_ROLES = tuple(f"input[{i}]" for i in range(16))

# Every module currently hooked by a live watch, so a second watch cannot double-record it.
_WATCHED: "weakref.WeakKeyDictionary[nn.Module, NanWatch]" = weakref.WeakKeyDictionary()


class NanWarning(RuntimeWarning):
    """Issued for each event when ``on_nan="warn"``."""


def live_watches() -> list[NanWatch]:
    """Every NanWatch that is still watching, in no particular order."""
    return list({id(w): w for w in list(_WATCHED.values()) if not w.closed}.values())


def current_rank() -> int:
    """torch.distributed rank, 0 without an initialised process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


class WatchExtension:
    """Something that rides along a watch (replay capture, gradients, persistence, DDP).

    Every method is optional to override; all run under the watch's lock except
    :meth:`after_batch`, which may raise to stop the run.
    """

    def on_batch_start(self, watch: NanWatch, batch: int, args: tuple, kwargs: dict) -> None:
        """The root forward is about to run ``batch``."""

    def before_resolve(self, watch: NanWatch) -> None:
        """Frames are about to be resolved: fill any stats this extension measured itself."""

    def on_batch_end(self, watch: NanWatch, batch: int, frames: list[Frame],
                     event: NanEvent | None) -> None:
        """``frames`` of ``batch`` are resolved; ``event`` is its first NaN/Inf, if any."""

    def after_batch(self, watch: NanWatch, batch: int, event: NanEvent | None) -> NanEvent | None:
        """Outside the lock, before the watch raises; may return an event to raise instead."""
        return event

    def close(self, watch: NanWatch) -> None:
        """The watch is closing: remove hooks, flush files."""


class _ModuleInfo:
    __slots__ = ("module", "name", "type_name", "index", "is_root", "pre_entries", "has_state")

    def __init__(self, module: nn.Module, name: str, index: int, is_root: bool) -> None:
        self.module = module
        self.name = name
        self.type_name = type(module).__name__
        self.index = index
        self.is_root = is_root
        # Own parameters or buffers (lazy modules hold uninitialised ones from the start).
        self.has_state = bool(module._parameters) or bool(module._buffers)
        # Input entries measured by the pre-hook of an in-place module (a stack: recursion).
        self.pre_entries: list[list[Entry]] = []


def _resolve_skip_types(skip_types: Iterable[type | str]) -> tuple[tuple[type, ...], frozenset[str]]:
    classes: list[type] = []
    names: set[str] = set()
    for item in skip_types:
        if isinstance(item, str):
            names.add(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            classes.append(item)
        else:
            raise TypeError(f"skip_types takes nn.Module subclasses or class names, got {item!r}")
    return tuple(classes), frozenset(names)


def _unwrap_model(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"nanwidget.watch needs a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.DataParallel):
        raise TypeError("nanwidget does not watch nn.DataParallel (its replicas are rebuilt every "
                        "step, so hooks on them are lost); use DistributedDataParallel under "
                        "torchrun, or watch model.module on one device")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("nanwidget cannot see inside a TorchScript module (hooks do not run in "
                        "scripted code); watch the original nn.Module before torch.jit.script")
    if type(model).__name__ == "OptimizedModule" or hasattr(model, "_orig_mod"):
        raise TypeError("nanwidget cannot see inside a torch.compile'd model (compiled graphs skip "
                        "module hooks); watch the uncompiled module, e.g. model._orig_mod, while "
                        "you debug")
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise TypeError("this module was compiled in place with module.compile(); nanwidget "
                        "cannot see inside compiled graphs. Watch an uncompiled copy while you debug")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module  # user's own names, no "module." prefix
    return model


class NanWatch:
    """Records frames of a model and stops at the first NaN/Inf. Create it with :func:`watch`."""

    def __init__(self, model: nn.Module, *, max_frames: int = 21,
                 trace_batches: Iterable[int] = (), abort_after: int | None = None,
                 skip_types: Iterable[type | str] = (), backward: bool = False,
                 grad_norm_warn: float | None = None, on_nan: str = "raise",
                 keep_batches: int = 4, replay_on_nan: bool = False,
                 log_dir: str | None = None) -> None:
        root = _unwrap_model(model)
        if not isinstance(max_frames, int) or isinstance(max_frames, bool) or max_frames < 1:
            raise ValueError(f"max_frames must be a positive integer, got {max_frames!r}")
        if on_nan not in ON_NAN_CHOICES:
            raise ValueError(f"on_nan must be one of {', '.join(ON_NAN_CHOICES)}; got {on_nan!r}")
        if abort_after is not None and (not isinstance(abort_after, int) or abort_after < 0):
            raise ValueError(f"abort_after must be a batch number >= 0 or None, got {abort_after!r}")
        if not isinstance(keep_batches, int) or keep_batches < 0:
            raise ValueError(f"keep_batches must be an integer >= 0, got {keep_batches!r}")
        if grad_norm_warn is not None and not (float(grad_norm_warn) > 0):
            raise ValueError(f"grad_norm_warn must be a positive number, got {grad_norm_warn!r}")
        try:
            trace_set = frozenset(int(b) for b in trace_batches)
        except (TypeError, ValueError):
            raise ValueError(f"trace_batches must be batch numbers, got {trace_batches!r}") from None
        skip_classes, skip_names = _resolve_skip_types(skip_types)

        self.model = root
        self.max_frames = max_frames
        self.trace_batches = trace_set
        self.abort_after = abort_after
        self.backward = bool(backward)
        self.grad_norm_warn = None if grad_norm_warn is None else float(grad_norm_warn)
        self.on_nan = on_nan
        self.keep_batches = keep_batches
        self.replay_on_nan = bool(replay_on_nan)
        self.log_dir = log_dir

        self.batch = 0
        self.rank = current_rank()
        self.events_dropped = 0
        self._events: list[NanEvent] = []
        self._manual_batches = False
        self._closed = False
        self._suspended = 0  # > 0 while suspended(): hooks record nothing (trace-mode replays)
        self._lock = threading.RLock()
        self._local = threading.local()
        self._ring = FrameBuffer(max_frames)
        self._trace_frames: dict[int, list[Frame]] = {}
        self._pending = PendingStats()
        self._batch_frames: list[Frame] = []
        self._calls: dict[int, int] = {}
        self._frame_counter = 0
        self._weight_cache: dict[int, tuple[torch.Tensor, int, Entry]] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._infos: dict[int, _ModuleInfo] = {}
        self.extensions: list[WatchExtension] = []

        modules: list[tuple[str, nn.Module]] = []
        for name, module in root.named_modules():
            if module is not root and (isinstance(module, skip_classes)
                                       or type(module).__name__ in skip_names):
                continue
            modules.append((name, module))
        for name, module in modules:
            owner = _WATCHED.get(module)
            if owner is not None and not owner._closed:
                raise RuntimeError(f"module '{name or '<root>'}' ({type(module).__name__}) is already "
                                   "watched by another NanWatch; close() that one first")
        self.module_names = [name for name, _ in modules]
        self.module_types = [type(m).__name__ for _, m in modules]
        self._name_index = {name: i for i, name in enumerate(self.module_names)}
        self._history = History(self.module_names, self.module_types, rank=self.rank)
        try:
            for index, (name, module) in enumerate(modules):
                info = _ModuleInfo(module, name, index, module is root)
                self._infos[id(module)] = info
                if info.is_root:
                    self._handles.append(module.register_forward_pre_hook(
                        self._root_pre_hook, with_kwargs=True))
                if getattr(module, "inplace", False) is True:
                    self._handles.append(module.register_forward_pre_hook(
                        self._inplace_pre_hook, with_kwargs=True))
                self._handles.append(module.register_forward_hook(
                    self._forward_hook, with_kwargs=True, always_call=True))
                _WATCHED[module] = self
            self._start_extensions()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ extensions
    def _start_extensions(self) -> None:
        """Attach the optional parts the options ask for (each lives in its own module)."""
        factories = _extension_factories()
        for factory in factories:
            extension = factory(self)
            if extension is not None:
                self.extensions.append(extension)

    # ------------------------------------------------------------------ hooks (hot path)
    def _root_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        local = self._local
        try:
            with self._lock:
                if self._closed or self._suspended:
                    return None
                if getattr(local, "root_open", False):
                    # The previous forward never returned (KeyboardInterrupt skips the hooks):
                    # resolve what it recorded so it is not mixed into this call.
                    self._resolve_locked(advance=False)
                local.root_open = True
                # An exception already being handled when the forward starts (a forward called
                # from an ``except`` block) is not the forward failing.
                local.exception_at_start = sys.exc_info()[1]
                for extension in self.extensions:
                    extension.on_batch_start(self, self.batch, args, kwargs)
        except Exception as error:  # never break the user's forward
            self._internal_error(error)
        return None

    def _inplace_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        info = self._infos.get(id(module))
        if info is None or self._closed or self._suspended:
            return None
        try:
            with self._lock:
                entries: list[Entry] = []
                self._input_entries(args, kwargs, entries, early=True)
                info.pre_entries.append(entries)
        except Exception as error:
            self._internal_error(error)
        return None

    def _forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        info = self._infos.get(id(module))
        if info is None or self._closed or self._suspended:
            return None
        try:
            with self._lock:
                self._record_forward(info, args, kwargs, output)
        except Exception as error:
            self._internal_error(error)
            return None
        if info.is_root:
            self._local.root_open = False
            # always_call hooks also run while an exception propagates: record, never raise then.
            current = sys.exc_info()[1]
            failing = current is not None and current is not getattr(self._local, "exception_at_start", None)
            self._finish_root_forward(raising=not failing)
        return None

    def _tensor_entry(self, role: str, tensor: torch.Tensor, early: bool = False) -> Entry:
        """Entry for one tensor: queued for stats when measurable, else with its note."""
        dtype = tensor.dtype
        # Fast path for the common case, in the order of the cheapest checks; classify() has
        # the full rules and runs only for tensors that fail one of them.
        if dtype.is_floating_point and tensor.layout is _STRIDED and not tensor.is_meta \
                and not tensor.is_nested and tensor.numel():
            stats = self._pending.reduce_now(tensor) if early else self._pending.add(tensor)
            return (role, stats, dtype, tensor.shape, "")
        note = classify(tensor)  # not "": the fast path above takes every measurable tensor
        return (role, None, dtype, None if note == "nested" else tensor.shape, note)

    def _leaf_entry(self, role: str, leaf: Any, early: bool = False) -> Entry:
        if isinstance(leaf, _Tensor):
            return self._tensor_entry(role, leaf, early)
        return non_tensor_entry(role, leaf)

    def _input_entries(self, args: tuple, kwargs: dict, entries: list[Entry], early: bool = False) -> None:
        tensor_entry = self._tensor_entry
        for position, value in enumerate(args):
            role = _INPUT_ROLES[position] if position < 16 else f"input[{position}]"
            if isinstance(value, _Tensor):
                entries.append(tensor_entry(role, value, early))
            else:
                for leaf_role, leaf in iter_leaves(value, role):
                    entries.append(self._leaf_entry(leaf_role, leaf, early))
        if kwargs:
            for key, value in kwargs.items():
                for leaf_role, leaf in iter_leaves(value, "kwarg:" + key):
                    entries.append(self._leaf_entry(leaf_role, leaf, early))

    def _weight_entries(self, module: nn.Module, entries: list[Entry]) -> None:
        cache = self._weight_cache
        for group in (module._parameters, module._buffers):
            if not group:
                continue
            # Buffers are measured every call: BatchNorm updates its running statistics in
            # place without bumping their version counters, so a cached entry would go stale.
            cacheable = group is module._parameters
            for name, tensor in group.items():
                if tensor is None:
                    continue
                if not cacheable:
                    entries.append(self._tensor_entry(name, tensor))
                    continue
                cached = cache.get(id(tensor))
                # Weights change once per optimizer step at most: re-measure only then,
                # and reuse the whole entry (same stats object) until then.
                if cached is not None and cached[0] is tensor and cached[1] == version_of(tensor) \
                        and cached[2][0] == name:
                    entries.append(cached[2])
                    continue
                entry = self._tensor_entry(name, tensor)
                if entry[1] is not None:
                    cache[id(tensor)] = (tensor, version_of(tensor), entry)
                entries.append(entry)

    def _record_forward(self, info: _ModuleInfo, args: tuple, kwargs: dict, output: Any) -> None:
        entries: list[Entry] = []
        if info.has_state:
            self._weight_entries(info.module, entries)
        if info.pre_entries:
            entries.extend(info.pre_entries.pop())
        elif len(args) == 1 and not kwargs and isinstance(args[0], _Tensor):
            entries.append(self._tensor_entry("input[0]", args[0]))  # the usual single input
        else:
            self._input_entries(args, kwargs, entries)
        first_output = len(entries)
        if isinstance(output, _Tensor):
            entries.append(self._tensor_entry("output", output))
        else:
            for role, leaf in iter_leaves(output, "output"):
                entries.append(self._leaf_entry(role, leaf))
        self.record_frame(info, "forward", entries).first_output = first_output

    def record_frame(self, info: _ModuleInfo, phase: str, entries: list[Entry],
                     batch: int | None = None) -> Frame:
        """Append a frame for ``info``'s module (caller holds the lock). Used by extensions too.

        ``batch`` overrides the current batch number, e.g. for backward frames that arrive
        after the root forward already advanced the count.
        """
        key = info.index if phase == "forward" else ~info.index
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        frame = Frame(self.rank, self.batch if batch is None else batch, self._frame_counter,
                      info.name, info.type_name, call, phase, entries)
        self._frame_counter += 1
        self._batch_frames.append(frame)
        return frame

    # ------------------------------------------------------------------ batch boundaries
    def _finish_root_forward(self, raising: bool) -> None:
        with self._lock:
            if self._closed:
                return
            finished = self.batch
            event = self._resolve_locked(advance=not self._manual_batches)
        self._after_batch(finished, event, raising=raising,
                          batch_finished=not self._manual_batches)

    def _resolve_locked(self, advance: bool) -> NanEvent | None:
        """Resolve pending stats and hand the batch's frames on. Caller holds the lock."""
        for extension in self.extensions:
            extension.before_resolve(self)
        self._pending.resolve()
        frames, self._batch_frames = self._batch_frames, []
        batch = self.batch
        self.rank = current_rank()
        event: NanEvent | None = None
        history_rows: list[tuple[int, int, float, float, bool]] = []
        name_index = self._name_index
        trace_batches = self.trace_batches
        for position, frame in enumerate(frames):
            bad = False
            entries = frame.entries
            first_output = frame.first_output if frame.phase == "forward" else len(entries)
            for slot, entry in enumerate(entries):
                stats = entry[1]
                if stats is None:
                    continue
                nonfinite = stats.nan or stats.inf
                if nonfinite:
                    bad = True
                if slot >= first_output:
                    history_rows.append((frame.batch, name_index[frame.module], stats.abs_max,
                                         stats.abs_min, nonfinite))
            if bad and event is None:
                event = self._make_event(frames, position)
            if trace_batches and frame.batch in trace_batches:
                self._trace_frames.setdefault(frame.batch, []).append(frame)
        self._history.record_many(history_rows)
        self._ring.extend(frames)
        if event is not None:
            if len(self._events) < MAX_EVENTS:
                self._events.append(event)
            else:
                self.events_dropped += 1
        for extension in self.extensions:
            extension.on_batch_end(self, batch, frames, event)
        if advance:
            self.batch += 1
            self._calls.clear()
            self._frame_counter = 0
        return event


    def _make_event(self, frames: list[Frame], position: int) -> NanEvent:
        frame = frames[position]
        bad = frame.nonfinite_entries()
        if frame.phase == "backward":
            origin, pick = "grad", bad
        else:
            weights = [e for e in bad if not e[0].startswith(("input", "kwarg:", "output"))]
            inputs = [e for e in bad if e[0].startswith(("input", "kwarg:"))]
            if weights:
                origin, pick = "weight", weights
            elif inputs:
                origin, pick = "input", inputs
            else:
                origin, pick = "output", bad
        role, stats = pick[0][0], pick[0][1]
        kind = "nan+inf" if stats.nan and stats.inf else ("nan" if stats.nan else "inf")
        window = self._ring.window_ending_with(frames, position)
        return NanEvent(batch=frame.batch, module=frame.module, module_type=frame.module_type,
                        call=frame.call, role=role, kind=kind, origin=origin,
                        is_backward=frame.phase == "backward",
                        frames=frames_to_dataframe(window), rank=frame.rank, frame=frame.index)

    def _after_batch(self, batch: int, event: NanEvent | None, *, raising: bool,
                     batch_finished: bool) -> None:
        """Outside the lock: let extensions weigh in, then raise, warn or go on."""
        for extension in self.extensions:
            event = extension.after_batch(self, batch, event)
        if event is not None:
            if self.on_nan == "raise" and raising:
                raise NanDetected(event)
            if self.on_nan in ("raise", "warn"):
                warnings.warn(f"nanwidget: {event.summary()}", NanWarning, stacklevel=4)
        if raising and batch_finished and self.abort_after is not None and batch == self.abort_after:
            raise AbortAfterBatch(batch)

    def step(self) -> None:
        """End the current batch and count the next one; automatic counting stops."""
        self.set_batch(self.batch + 1)

    def set_batch(self, batch: int) -> None:
        """End the current batch (its frames are checked) and continue as ``batch``.

        From the first call on, the root forward no longer advances the count: use this for
        loops that call submodules directly or accumulate gradients over several forwards.
        """
        if not isinstance(batch, int) or batch < 0:
            raise ValueError(f"batch must be an integer >= 0, got {batch!r}")
        with self._lock:
            self._manual_batches = True
            finished = self.batch
            had_frames = bool(self._batch_frames)
            event = self._resolve_locked(advance=False) if had_frames else None
            self.batch = batch
            self._calls.clear()
            self._frame_counter = 0
        self._after_batch(finished, event, raising=True, batch_finished=finished != batch)

    # ------------------------------------------------------------------ results
    def flush(self) -> None:
        """Resolve frames recorded since the last batch boundary (never raises NanDetected)."""
        with self._lock:
            if self._batch_frames:
                self._resolve_locked(advance=False)

    @property
    def events(self) -> list[NanEvent]:
        """Every event so far (capped at :data:`MAX_EVENTS`; see ``events_dropped``)."""
        return list(self._events)

    @property
    def event(self) -> NanEvent | None:
        """The first event, or None."""
        return self._events[0] if self._events else None

    def frames(self, batch: int | None = None) -> pd.DataFrame:
        """Frames in the ring buffer, or every frame of trace batch ``batch``."""
        self.flush()
        with self._lock:
            if batch is None:
                return frames_to_dataframe(list(self._ring))
            if batch not in self._trace_frames:
                held = sorted(self._trace_frames) or "none yet"
                raise KeyError(f"batch {batch} is not a recorded trace batch (trace_batches="
                               f"{sorted(self.trace_batches)}; recorded: {held})")
            return frames_to_dataframe(self._trace_frames[batch])

    def history(self) -> pd.DataFrame:
        """One row per (batch, module): abs_max, abs_min and nonfinite of its outputs."""
        self.flush()
        with self._lock:
            return self._history.to_dataframe()

    def report(self, event: NanEvent | None = None) -> str:
        """Text dump of an event's frames, or of the frames held (trace batches included)."""
        event = event or self.event
        if event is not None:
            return format_event_report(event, event.frames)
        self.flush()
        with self._lock:
            parts = [format_event_report(None, frames_to_dataframe(list(self._ring)),
                                         batch=self.batch - 1 if not self._manual_batches else self.batch)]
            for batch in sorted(self._trace_frames):
                parts.append(f"\n\n  *** Starting batch number={batch} ***")
                parts.extend(format_frames(frames_to_dataframe(self._trace_frames[batch])))
                parts.append(f"  *** Finished batch number={batch} ***")
        return "\n".join(parts)

    def replay(self, batch: int, *, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Trace:
        """Re-run ``batch`` in trace mode; see :mod:`nanwidget.core.replay`."""
        from .replay import replay_batch
        return replay_batch(self, batch, loss_fn=loss_fn)

    # Gradients (nanwidget.core.grads): thin delegations so the watch stays the one handle.
    def _extension(self, kind: str) -> Any:
        for extension in self.extensions:
            if getattr(extension, "kind", None) == kind:
                return extension
        return None

    def check_grad_norms(self) -> bool:
        """After ``loss.backward()``: flag non-finite or too large gradient norms; see ``grad_events``."""
        from .grads import check_grad_norms
        return check_grad_norms(self)

    @property
    def grad_events(self) -> list[Any]:
        """Every :class:`GradEvent` flagged by :meth:`check_grad_norms`."""
        from .grads import grad_events
        return grad_events(self)

    def grad_history(self) -> pd.DataFrame:
        """Gradient norms per batch and parameter (bounded)."""
        from .grads import grad_history
        return grad_history(self)

    def browse(self) -> Any:
        """The FrameBrowser widget for this watch (needs ipywidgets)."""
        from ..widgets import FrameBrowser
        return FrameBrowser(self)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Remove exactly the hooks this watch added; idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                if self._batch_frames:
                    self._resolve_locked(advance=False)
            except Exception as error:  # closing must always succeed
                self._internal_error(error)
            self._closed = True
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            for info in self._infos.values():
                if _WATCHED.get(info.module) is self:
                    del _WATCHED[info.module]
            extensions, self.extensions = self.extensions, []
        for extension in extensions:
            try:
                extension.close(self)
            except Exception as error:
                self._internal_error(error)

    @property
    def closed(self) -> bool:
        return self._closed

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """While inside, the hooks record nothing: batch count, ring, history and events stay put.

        Trace-mode replays run the model under this so that re-running a batch is not counted
        as a new one. Extensions that add hooks of their own should honour ``_suspended`` too.
        """
        with self._lock:
            self._suspended += 1
        try:
            yield
        finally:
            with self._lock:
                self._suspended -= 1

    def __enter__(self) -> NanWatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _internal_error(self, error: BaseException) -> None:
        if isinstance(error, (NanDetected, AbortAfterBatch)):
            raise error
        if not getattr(self, "_warned_internal", False):
            self._warned_internal = True
            warnings.warn(f"nanwidget: internal error while recording ({type(error).__name__}: "
                          f"{error}); your forward pass continues, some frames may be missing",
                          RuntimeWarning, stacklevel=3)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "watching"
        return (f"<NanWatch {state} {type(self.model).__name__} ({len(self._infos)} modules), "
                f"batch {self.batch}, {len(self._events)} event(s)>")


def _extension_factories() -> list[Callable[[NanWatch], WatchExtension | None]]:
    """Factories for the optional parts; each returns None when its option is off."""
    factories: list[Callable[[NanWatch], WatchExtension | None]] = []
    for module_name in ("replay", "grads", "persist", "distributed"):
        try:
            module = __import__(f"nanwidget.core.{module_name}", fromlist=["make_extension"])
        except ModuleNotFoundError as error:
            if error.name != f"nanwidget.core.{module_name}":
                raise
            continue
        factories.append(module.make_extension)
    return factories


def watch(model: nn.Module, *, max_frames: int = 21, trace_batches: Iterable[int] = (),
          abort_after: int | None = None, skip_types: Iterable[type | str] = (),
          backward: bool = False, grad_norm_warn: float | None = None, on_nan: str = "raise",
          keep_batches: int = 4, replay_on_nan: bool = False, log_dir: str | None = None) -> NanWatch:
    """Start watching ``model``: a frame per module call, a check at every batch end.

    Options as in the contract: ``max_frames`` frames kept in the ring buffer; ``trace_batches``
    whose every frame is kept; ``abort_after`` raises :class:`AbortAfterBatch` once that batch
    finished; ``skip_types`` module classes (or class names) not hooked; ``backward`` records
    gradient frames; ``grad_norm_warn`` flags larger gradient norms; ``on_nan`` is "raise",
    "warn" or "record"; ``keep_batches`` recent batches held for :meth:`NanWatch.replay`;
    ``replay_on_nan`` attaches a trace to each event; ``log_dir`` spools records to disk.
    Also a context manager: ``with nw.watch(model) as w: ...`` closes the hooks on exit.
    """
    return NanWatch(model, max_frames=max_frames, trace_batches=trace_batches,
                    abort_after=abort_after, skip_types=skip_types, backward=backward,
                    grad_norm_warn=grad_norm_warn, on_nan=on_nan, keep_batches=keep_batches,
                    replay_on_nan=replay_on_nan, log_dir=log_dir)

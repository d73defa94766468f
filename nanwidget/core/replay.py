"""Trace mode: hold recent batches, re-run one op by op, name the op and the line that made a NaN.

Module hooks see module boundaries only; a NaN made by ``torch.sqrt(h - 5)`` between two
submodules, a masked softmax or a custom ``autograd.Function`` can only be reported as "arrived
through the input of module B". Trace mode re-runs the batch exactly (same inputs, same RNG
states, same train/eval flags) under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
that measures every aten op, and names the first op whose output is not finite, its enclosing
module and the innermost line of user code that called it.

Capture, on every batch and under the watch's lock, is kept cheap: references to the root
forward's inputs (no copies) with their version counters, the RNG states, grad/autocast modes,
train/eval flags and the version counters of parameters and buffers. Tensors are copied only
when :func:`enable_weight_snapshots` asked for it.

A replay never touches the model's own tensors: it runs on *shadow* parameters (new Parameter
objects over the same storage, so ``.grad``, ``requires_grad`` and version counters of the real
ones stay as they are; an in-place write into a parameter's storage is saved first and undone
afterwards) and on cloned buffers (BatchNorm running statistics).
"""

from __future__ import annotations

import contextlib
import linecache
import math
import os
import sys
import sysconfig
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .events import NanEvent
from .frames import Entry, Frame, frames_to_dataframe, non_tensor_entry
from .report import format_frames
from .stats import AbsMeter, TensorStats, classify, version_of
from .walk import iter_leaves
from .watch import NanWatch, WatchExtension

__all__ = ["Trace", "ReplayError", "BatchNotHeldError", "InputModifiedError", "replay_batch",
           "enable_weight_snapshots", "held_batches", "make_extension", "OPS_COLUMNS"]

# Event batches pinned for replay beyond the last ``keep_batches`` (the first ones: the first
# event is the one users chase).
MAX_EVENT_BATCHES = 8
# Root forward calls held per batch (several when a loop accumulates gradients with set_batch).
MAX_FORWARDS_PER_BATCH = 64
# Automatic replays (``replay_on_nan=True``) per watch: a diverged run makes an event per batch.
MAX_AUTO_REPLAYS = 4

OPS_COLUMNS = ["index", "phase", "op", "aten", "module", "module_type", "dtype", "shape",
               "abs_min", "abs_max", "nan", "inf", "nonfinite", "source"]

_NODE_KEY = "nanwidget_op"  # autograd node metadata: (module, module_type, source) of its forward op
_Tensor = torch.Tensor
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)

# Ops left out of the op table: their output is uninitialised memory (measuring it would report
# garbage as a NaN), or holds exactly the values of their input (nothing new can go wrong there;
# views are left out through ``func.is_view``).
_UNMEASURED_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                             "empty_permuted", "resize_", "set_", "_unsafe_view", "clone",
                             "contiguous", "alias", "lift_fresh", "lift_fresh_copy"})
# Ops whose output holds the same set of values as their first input: its stats carry over.
_SAME_VALUES_OPS = frozenset({"view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose",
                              "permute", "unsqueeze", "squeeze", "alias", "detach", "clone",
                              "contiguous", "expand", "view_as", "lift_fresh"})

# Captures by watch, so that a watch closed by an exception can still replay its batches.
_CAPTURES: "weakref.WeakKeyDictionary[NanWatch, ReplayCapture]" = weakref.WeakKeyDictionary()


class ReplayError(RuntimeError):
    """A batch cannot be replayed (see the message for why and what to do)."""


class BatchNotHeldError(ReplayError):
    """The batch asked for is not (or no longer) held; the message lists the held ones."""


class InputModifiedError(ReplayError):
    """An input of the batch was modified in place since: a replay would run on other data."""


# ---------------------------------------------------------------------------------- capture
class _ForwardCapture:
    """What one root forward call needs to run again."""

    __slots__ = ("args", "kwargs", "inputs", "input_versions", "end_input_versions", "cpu_rng",
                 "cuda_rng", "grad_enabled", "inference", "autocast", "training", "weights",
                 "weight_versions", "end_buffer_versions", "snapshot", "needs_grad")

    def __init__(self) -> None:
        self.needs_grad: frozenset | set = frozenset()  # positions / keys of detached inputs that required grad
        self.end_input_versions: list[int] | None = None
        self.end_buffer_versions: list[int] | None = None
        self.snapshot: list[torch.Tensor | None] | None = None


class _HeldBatch:
    __slots__ = ("batch", "forwards", "truncated")

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.forwards: list[_ForwardCapture] = []
        self.truncated = False


class _WeightSlots:
    """Every parameter and buffer slot of the model, read by dict lookups (no module walk)."""

    def __init__(self, root: nn.Module) -> None:
        self.containers: list[dict] = []
        self.keys: list[str] = []
        self.names: list[str] = []
        self.is_buffer: list[bool] = []
        for module_name, module in root.named_modules():
            for is_buffer, container in ((False, module._parameters), (True, module._buffers)):
                for key, tensor in container.items():
                    if tensor is None:
                        continue
                    self.containers.append(container)
                    self.keys.append(key)
                    self.names.append(f"{module_name}.{key}" if module_name else key)
                    self.is_buffer.append(is_buffer)
        self.buffer_positions = [i for i, flag in enumerate(self.is_buffer) if flag]
        self.modules = list(root.modules())

    def read(self) -> list[torch.Tensor | None]:
        return [container.get(key) for container, key in zip(self.containers, self.keys)]


def _versions(tensors: list[torch.Tensor | None]) -> list[int]:
    try:
        return [t._version for t in tensors]  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):  # a slot set to None since, or an inference tensor
        return [-1 if t is None else version_of(t) for t in tensors]


def _autocast_state() -> tuple:
    state = []
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            state.append((device_type, torch.get_autocast_dtype(device_type)))
    return tuple(state)


class ReplayCapture(WatchExtension):
    """Holds what is needed to re-run recent, traced and failing batches; replays them."""

    kind = "replay"

    def __init__(self, watch: NanWatch) -> None:
        self.keep = max(watch.keep_batches, 1 if watch.replay_on_nan else 0)
        self.trace_batches = watch.trace_batches
        self.replay_on_nan = watch.replay_on_nan
        self.snapshot_weights = False
        self.slots = _WeightSlots(watch.model)
        self.held: OrderedDict[int, _HeldBatch] = OrderedDict()
        self.event_batches: set[int] = set()
        self.replaying = False
        self.auto_replays = 0

    # -- hot path: every batch, under the watch's lock
    def on_batch_start(self, watch: NanWatch, batch: int, args: tuple, kwargs: dict) -> None:
        if not self.keep and batch not in self.trace_batches:
            return
        held = self.held.get(batch)
        if held is not None and len(held.forwards) >= MAX_FORWARDS_PER_BATCH:
            held.truncated = True
            return
        capture = _ForwardCapture()
        # Tensors made by autograd are held as detached aliases (same data and version counter)
        # so that a held batch does not keep the graph behind them alive.
        if any(isinstance(v, _Tensor) and v.grad_fn is not None for v in args):
            capture.needs_grad = {i for i, v in enumerate(args)
                                  if isinstance(v, _Tensor) and v.requires_grad}
            args = tuple(v.detach() if isinstance(v, _Tensor) and v.grad_fn is not None else v
                         for v in args)
        if kwargs and any(isinstance(v, _Tensor) and v.grad_fn is not None for v in kwargs.values()):
            capture.needs_grad = capture.needs_grad | {k for k, v in kwargs.items()
                                                       if isinstance(v, _Tensor) and v.requires_grad}
            kwargs = {k: v.detach() if isinstance(v, _Tensor) and v.grad_fn is not None else v
                      for k, v in kwargs.items()}
        inputs: list[tuple[str, torch.Tensor]] = []
        for position, value in enumerate(args):
            role = f"input[{position}]"
            if isinstance(value, _Tensor):
                inputs.append((role, value))
            elif not isinstance(value, (int, float, bool, str, type(None))):
                inputs.extend((r, leaf) for r, leaf in iter_leaves(value, role)
                              if isinstance(leaf, _Tensor))
        if kwargs:
            for key, value in kwargs.items():
                inputs.extend((r, leaf) for r, leaf in iter_leaves(value, "kwarg:" + key)
                              if isinstance(leaf, _Tensor))
        capture.args = args
        capture.kwargs = kwargs
        capture.inputs = inputs
        capture.input_versions = _versions([t for _, t in inputs])
        capture.cpu_rng = torch.get_rng_state()
        capture.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        capture.grad_enabled = torch.is_grad_enabled()
        capture.inference = torch.is_inference_mode_enabled()
        capture.autocast = _autocast_state()
        capture.training = [m.training for m in self.slots.modules]
        weights = self.slots.read()
        capture.weights = weights
        capture.weight_versions = _versions(weights)
        if self.snapshot_weights:
            capture.snapshot = self._snapshot(weights)
        if held is None:
            held = self.held[batch] = _HeldBatch(batch)
            self._evict()
        held.forwards.append(capture)

    def on_batch_end(self, watch: NanWatch, batch: int, frames: list[Frame],
                     event: NanEvent | None) -> None:
        held = self.held.get(batch)
        if held is not None and held.forwards:
            last = held.forwards[-1]
            if last.end_input_versions is None:
                last.end_input_versions = _versions([t for _, t in last.inputs])
                if self.slots.buffer_positions:
                    weights = last.weights
                    last.end_buffer_versions = [
                        -1 if weights[i] is None else version_of(weights[i])
                        for i in self.slots.buffer_positions]
        if event is not None and event.batch in self.held and len(self.event_batches) < MAX_EVENT_BATCHES:
            self.event_batches.add(event.batch)

    def _evict(self) -> None:
        recent = [b for b in self.held if b not in self.event_batches and b not in self.trace_batches]
        for batch in recent[:max(0, len(recent) - self.keep)]:
            del self.held[batch]

    def _snapshot(self, weights: list) -> list[torch.Tensor | None]:
        """Copies of every parameter and buffer (tied ones once).

        Every batch copies everything: version counters cannot tell whether a tensor changed
        (BatchNorm's running statistics and writes through ``.data`` do not bump them).
        """
        copies: dict[int, torch.Tensor] = {}
        snapshot: list[torch.Tensor | None] = []
        with torch.no_grad():
            for tensor in weights:
                if tensor is None:
                    snapshot.append(None)
                    continue
                copy = copies.get(id(tensor))
                if copy is None:
                    copy = copies[id(tensor)] = tensor.detach().clone()
                snapshot.append(copy)
        return snapshot

    # -- outside the lock
    def after_batch(self, watch: NanWatch, batch: int, event: NanEvent | None) -> NanEvent | None:
        if (event is None or not self.replay_on_nan or event.trace is not None or event.is_backward
                or self.replaying or self.auto_replays >= MAX_AUTO_REPLAYS):
            return event
        self.auto_replays += 1
        try:
            event.trace = self.replay(watch, event.batch, None)
        except Exception as error:  # a failed replay must not hide the event itself
            warnings.warn(f"nanwidget: replay_on_nan could not replay batch {event.batch} "
                          f"({type(error).__name__}: {error})", RuntimeWarning, stacklevel=2)
        return event

    def held_batches(self) -> list[int]:
        return sorted(b for b, held in self.held.items() if held.forwards)

    # -- replay
    def replay(self, watch: NanWatch, batch: int, loss_fn: Callable[[Any], torch.Tensor] | None) -> Trace:
        if isinstance(batch, bool) or not isinstance(batch, int):
            raise TypeError(f"replay takes a batch number (int), got {batch!r}")
        held = self.held.get(batch)
        if held is None or not held.forwards:
            raise BatchNotHeldError(self._not_held_message(batch))
        if held.truncated:
            raise ReplayError(f"batch {batch} ran its root forward more than "
                              f"{MAX_FORWARDS_PER_BATCH} times; only the first ones were held, "
                              "so it cannot be replayed faithfully")
        _check_inputs(held)
        if self.replaying:
            raise ReplayError("a replay is already running (replay() cannot be called from "
                              "inside the model while it is being replayed)")
        self.replaying = True
        try:
            return _Replay(watch, self, held, loss_fn).run()
        finally:
            self.replaying = False

    def _not_held_message(self, batch: int) -> str:
        held = self.held_batches()
        listed = ", ".join(map(str, held)) if held else "none"
        return (f"batch {batch} is not held for replay; held batches: {listed}. A watch holds "
                f"the last keep_batches={self.keep} batches, its trace_batches and the batches "
                "of its first events; pass keep_batches=N or trace_batches=[...] to nw.watch() "
                "to hold others")


def _check_inputs(held: _HeldBatch) -> None:
    for capture in held.forwards:
        for k, ((role, tensor), version) in enumerate(zip(capture.inputs, capture.input_versions)):
            now = version_of(tensor)
            if now == version:
                continue
            during = (capture.end_input_versions is not None
                      and capture.end_input_versions[k] == now)
            when = ("by the model's own forward while the batch ran" if during
                    else "after the batch ran (e.g. by the training loop)")
            raise InputModifiedError(
                f"cannot replay batch {held.batch}: its {role} ({str(tensor.dtype).replace('torch.', '')} "
                f"{tuple(tensor.shape)}) was modified in place {when} (version {version} -> {now}), "
                "so a replay would run on different data. Give each batch its own tensor, or "
                "clone() it before changing it in place")


def make_extension(watch: NanWatch) -> ReplayCapture | None:
    """The replay capture for ``watch``, or None when it holds nothing (``keep_batches=0``,
    no ``trace_batches``, no ``replay_on_nan``)."""
    if watch.keep_batches == 0 and not watch.trace_batches and not watch.replay_on_nan:
        return None
    capture = ReplayCapture(watch)
    _CAPTURES[watch] = capture
    return capture


def _capture_of(watch: NanWatch) -> ReplayCapture:
    capture = _CAPTURES.get(watch)
    if capture is None:
        raise ReplayError("this watch holds no batches to replay: it was created with "
                          "keep_batches=0 and no trace_batches; watch with keep_batches=N")
    return capture


def enable_weight_snapshots(watch: NanWatch, enabled: bool = True) -> None:
    """Snapshot parameters and buffers at the start of every held batch.

    Replays are then faithful even after optimizer steps (and BatchNorm running statistics start
    where the batch started). Costs a copy of the weights at the start of every batch (device
    memory and bandwidth, no host sync), and about ``keep_batches`` + 1 copies held.
    """
    capture = _capture_of(watch)
    capture.snapshot_weights = bool(enabled)
    if not enabled:
        for held in capture.held.values():
            for forward in held.forwards:
                forward.snapshot = None


def held_batches(watch: NanWatch) -> list[int]:
    """Batch numbers that :func:`replay_batch` can replay now."""
    capture = _CAPTURES.get(watch)
    return capture.held_batches() if capture is not None else []


def replay_batch(watch: NanWatch, batch: int, *,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Trace:
    """Re-run ``batch`` in trace mode: every module frame and every tensor op.

    With ``loss_fn``, also runs the backward of ``loss_fn(output)``. The model is left exactly as
    it was (parameters, buffers, ``.grad``, train/eval flags, ``requires_grad``, RNG states) and the
    watch's own recording is not disturbed. Raises :class:`BatchNotHeldError` (listing the held
    batches) or :class:`InputModifiedError` when a faithful replay is impossible.
    """
    return _capture_of(watch).replay(watch, batch, loss_fn)


# ---------------------------------------------------------------------------------- source lines
_USER, _SKIP, _STOP = 0, 1, 2
_TORCH_DIR = os.path.normcase(os.path.dirname(os.path.abspath(torch.__file__))) + os.sep
_CORE_DIR = os.path.normcase(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIRS = tuple({os.path.normcase(os.path.abspath(sysconfig.get_paths()[key])) + os.sep
                      for key in ("stdlib", "platstdlib")})
_FILE_KINDS: dict[str, int] = {}


def _file_kind(filename: str) -> int:
    if filename.startswith("<"):
        return _SKIP if filename.startswith("<frozen") else _USER
    path = os.path.normcase(os.path.abspath(filename))
    if path.startswith(_CORE_DIR):
        return _STOP  # nanwidget's engine: whatever called it is not the model
    if path.startswith(_TORCH_DIR):
        return _SKIP
    if path.startswith(_STDLIB_DIRS) and "site-packages" not in path and "dist-packages" not in path:
        return _SKIP
    return _USER


def _user_source(frame: Any) -> str:
    """Innermost ``file:line`` outside torch, the standard library and nanwidget's engine."""
    kinds = _FILE_KINDS
    while frame is not None:
        filename = frame.f_code.co_filename
        kind = kinds.get(filename)
        if kind is None:
            kind = kinds[filename] = _file_kind(filename)
        if kind == _USER:
            return f"{filename}:{frame.f_lineno}"
        if kind == _STOP:
            return ""
        frame = frame.f_back
    return ""


# ---------------------------------------------------------------------------------- replay
def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, _Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, _Tensor)]
    return []


_MUTATED: dict[Any, tuple[tuple[int, ...], tuple[str, ...]]] = {}


def _mutated_arguments(func: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Positions and names of the arguments an op writes into (from its schema), cached."""
    found = _MUTATED.get(func)
    if found is None:
        positions, names = [], []
        try:
            for position, argument in enumerate(func._schema.arguments):
                alias = argument.alias_info
                if alias is not None and alias.is_write:
                    positions.append(position)
                    names.append(argument.name)
        except AttributeError:
            pass
        found = _MUTATED[func] = (tuple(positions), tuple(names))
    return found


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # tensor subclasses without a storage
        return None


class _Protected:
    """A tensor whose storage the replay must leave as it found it (copy on first write)."""

    __slots__ = ("write_through", "source", "saved")

    def __init__(self, write_through: torch.Tensor, source: torch.Tensor) -> None:
        self.write_through = write_through  # writes here reach the storage, not source's counter
        self.source = source
        self.saved: torch.Tensor | None = None


def _storage_alias(source: torch.Tensor) -> torch.Tensor:
    """A tensor over ``source``'s storage with a version counter of its own."""
    if type(source) in (_Tensor, nn.Parameter) and source.layout is torch.strided \
            and not source.is_meta:
        try:
            with torch.no_grad():
                return torch.empty(0, dtype=source.dtype, device=source.device).set_(
                    source.untyped_storage(), source.storage_offset(), source.size(), source.stride())
        except Exception:
            pass
    return source.detach()


class _Shadows:
    """Swaps the model's parameters and buffers for replay-only stand-ins, and back."""

    def __init__(self) -> None:
        self.swaps: list[tuple[dict, str, torch.Tensor]] = []
        self.protected: dict[int, list[_Protected]] = {}
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.flat_weights: list[tuple[nn.Module, list]] = []

    def install(self, slots: _WeightSlots, sources: list[torch.Tensor | None]) -> None:
        """Put the stand-ins in place; every swap is recorded as it is made, so that
        :meth:`restore` undoes exactly what was done even if this stops half-way."""
        current = slots.read()
        made: dict[int, torch.Tensor] = {}
        for i, original in enumerate(current):
            if original is None:
                continue
            source = sources[i]
            if source is None or source.shape != original.shape or source.dtype != original.dtype:
                source = original
            shadow = made.get(id(source))
            if shadow is None:
                shadow = made[id(source)] = self._make(original, source, slots.is_buffer[i])
            self.swaps.append((slots.containers[i], slots.keys[i], original))
            slots.containers[i][slots.keys[i]] = shadow
        # RNNs keep a list of their weights besides _parameters.
        for module in slots.modules:
            if isinstance(getattr(module, "_flat_weights", None), list) \
                    and hasattr(module, "_flat_weights_names"):
                self.flat_weights.append((module, module._flat_weights))
                module._flat_weights = [getattr(module, name, None)
                                        for name in module._flat_weights_names]

    def _make(self, original: torch.Tensor, source: torch.Tensor, is_buffer: bool) -> torch.Tensor:
        if is_buffer or not isinstance(original, nn.Parameter):
            with torch.no_grad():
                shadow = source.detach().clone()
            if original.requires_grad and shadow.is_floating_point():
                shadow.requires_grad_(True)
            return shadow
        alias = _storage_alias(source)
        shadow = nn.Parameter(alias, requires_grad=original.requires_grad)
        if original.__dict__:
            shadow.__dict__.update(original.__dict__)  # e.g. attributes libraries tag params with
        self._protect(shadow, source)
        # The shadow collects the replay's gradients; the original's .grad (or its None) stays,
        # even if some code reaches the original parameter through a reference of its own.
        self.grads.append((original, original.grad))
        if original.grad is not None:
            self._protect(original.grad, original.grad)
        return shadow

    def _protect(self, write_through: torch.Tensor, source: torch.Tensor) -> None:
        key = _storage_key(source)
        if key is not None:
            self.protected.setdefault(key, []).append(_Protected(write_through, source))

    def before_write(self, tensor: torch.Tensor) -> None:
        """Called for each tensor an op is about to write into: save protected ones first."""
        entries = self.protected.get(_storage_key(tensor))  # type: ignore[arg-type]
        if entries:
            for entry in entries:
                if entry.saved is None:
                    entry.saved = entry.source.detach().clone()

    def restore(self) -> None:
        for container, key, original in reversed(self.swaps):
            container[key] = original
        for module, weights in self.flat_weights:
            module._flat_weights = weights
        with torch.no_grad():
            for entries in self.protected.values():
                for entry in entries:
                    if entry.saved is not None:
                        entry.write_through.copy_(entry.saved)
        for original, grad in self.grads:
            if original.grad is not grad:
                original.grad = grad


class _Recorder:
    """Module frames and op rows of one replay."""

    def __init__(self, watch: NanWatch, batch: int, names: dict[int, tuple[str, str]]) -> None:
        self.watch = watch
        self.batch = batch
        self.rank = watch.rank
        self.infos = watch._infos
        self.names = names
        self.stack: list[tuple[str, str]] = []
        self.meter = AbsMeter()
        # Frame tensors, measured when the replay ends (as the watch does when a batch ends).
        self.queued: list[list] = []  # [tensor, version, stats, measured already]
        self.queued_index: dict[int, int] = {}  # id -> position of its latest version
        # id -> (weakref, version, abs_min, abs_max) of finite op outputs: frames reuse them.
        self.op_stats: dict[int, tuple[Any, int, float, float]] = {}
        self.pre_entries: dict[int, list[list[Entry]]] = {}
        self.frames: list[Frame] = []
        self.calls: dict[int, int] = {}
        self.rows: list[tuple] = []
        self.phase = "forward"
        self.paused = False
        self.to_tag: list[tuple[list[torch.Tensor], tuple[str, str, str]]] = []
        # First op with a NaN in its output, and first with an Inf; each with its tensors described.
        self.first_nan: tuple[int, list[dict]] | None = None
        self.first_inf: tuple[int, list[dict]] | None = None
        self.shadows: _Shadows | None = None

    # -- module hooks
    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.stack.append(self.names.get(id(module), ("?", type(module).__name__)))
        if id(module) in self.infos and getattr(module, "inplace", False) is True:
            entries: list[Entry] = []
            self.paused = True  # measuring is not one of the model's ops
            try:
                self._input_entries(args, kwargs, entries, early=True)
            finally:
                self.paused = False
            self.pre_entries.setdefault(id(module), []).append(entries)

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.stack:
            self.stack.pop()
        info = self.infos.get(id(module))
        if info is None:
            return
        entries: list[Entry] = []
        for group in (module._parameters, module._buffers):
            for name, tensor in group.items():
                if tensor is not None:
                    entries.append(self._tensor_entry(name, tensor))
        pre = self.pre_entries.get(id(module))
        if pre:
            entries.extend(pre.pop())
        else:
            self._input_entries(args, kwargs, entries)
        for role, leaf in iter_leaves(output, "output"):
            entries.append(self._leaf_entry(role, leaf))
        call = self.calls.get(info.index, 0)
        self.calls[info.index] = call + 1
        self.frames.append(Frame(self.rank, self.batch, len(self.frames), info.name,
                                 info.type_name, call, "forward", entries))

    def _tensor_entry(self, role: str, tensor: torch.Tensor, early: bool = False) -> Entry:
        note = classify(tensor)
        if note:
            return (role, None, tensor.dtype, tensor.shape, note)
        # As the watch's PendingStats: one stats object per (tensor, version) within the batch.
        position = self.queued_index.get(id(tensor))
        queued = self.queued[position] if position is not None else None
        if queued is None or queued[0] is not tensor or queued[1] != version_of(tensor):
            queued = [tensor, version_of(tensor), TensorStats(), False]
            self.queued_index[id(tensor)] = len(self.queued)
            self.queued.append(queued)
        if early and not queued[3]:
            # An in-place module is about to overwrite it: measure the values as they are now.
            self._fill(queued[2], tensor)
            queued[2].note = queued[2].note if queued[2].note.startswith("unsupported") else ""
            queued[3] = True
        return (role, queued[2], tensor.dtype, tensor.shape, "")

    def _fill(self, stats: TensorStats, tensor: torch.Tensor) -> None:
        try:
            low, high = self.meter.measure(tensor)
        except Exception as error:
            stats.note = f"unsupported ({type(error).__name__})"
            return
        stats.abs_min, stats.abs_max = low, high
        stats.nan = high != high
        stats.inf = high == math.inf
        if stats.nan:  # a NaN hides any Inf from max()
            with torch.no_grad():
                stats.inf = bool(torch.isinf(tensor.detach()).any())

    def resolve(self) -> None:
        """Measure the queued frame tensors, reusing what the op trace already measured."""
        queued, self.queued, self.queued_index = self.queued, [], {}
        op_stats = self.op_stats
        for tensor, version, stats, measured in queued:
            if measured:
                continue
            now = version_of(tensor)
            known = op_stats.get(id(tensor))
            if known is not None and known[0]() is tensor and known[1] == now:
                stats.abs_min, stats.abs_max = known[2], known[3]
                stats.nan = stats.inf = False
            else:
                self._fill(stats, tensor)
            if not stats.note.startswith("unsupported"):
                stats.note = "" if now == version else "changed in place later"

    def _leaf_entry(self, role: str, leaf: Any, early: bool = False) -> Entry:
        if isinstance(leaf, _Tensor):
            return self._tensor_entry(role, leaf, early)
        return non_tensor_entry(role, leaf)

    def _input_entries(self, args: tuple, kwargs: dict, entries: list[Entry], early: bool = False) -> None:
        for position, value in enumerate(args):
            for role, leaf in iter_leaves(value, f"input[{position}]"):
                entries.append(self._leaf_entry(role, leaf, early))
        for key, value in (kwargs or {}).items():
            for role, leaf in iter_leaves(value, "kwarg:" + key):
                entries.append(self._leaf_entry(role, leaf, early))

    # -- ops
    def tag_nodes(self) -> None:
        """Label the autograd nodes of the last forward op, so its backward ops find their module."""
        for tensors, tag in self.to_tag:
            for tensor in tensors:
                node = tensor.grad_fn
                if node is not None:
                    metadata = node.metadata
                    if _NODE_KEY not in metadata:
                        metadata[_NODE_KEY] = tag
        self.to_tag = []

    def before_op(self, func: Any, args: tuple, kwargs: dict) -> None:
        if self.to_tag:
            self.tag_nodes()
        shadows = self.shadows
        if shadows is not None and shadows.protected:
            positions, names = _mutated_arguments(func)
            if positions:
                for position in positions:
                    if position < len(args):
                        for tensor in _tensors_in(args[position]):
                            shadows.before_write(tensor)
                for name in names:
                    for tensor in _tensors_in(kwargs.get(name)):
                        shadows.before_write(tensor)

    def after_op(self, func: Any, args: tuple, kwargs: dict, output: Any, caller: Any) -> None:
        node = _current_autograd_node()
        if node is not None:
            phase = "backward"
            tag = node.metadata.get(_NODE_KEY)
            module, module_type, forward_source = tag if tag else ("", "", "")
            source = _user_source(caller) or forward_source
        else:
            phase = self.phase
            module, module_type = self.stack[-1] if self.stack else ("", "")
            source = _user_source(caller)
        tensors = _tensors_in(output)
        if node is None and tensors:
            self.to_tag.append((tensors, (module, module_type, source)))
        name = func.overloadpacket.__name__
        if name in _UNMEASURED_OPS or func.is_view:
            if name in _SAME_VALUES_OPS and len(tensors) == 1 and args and isinstance(args[0], _Tensor):
                known = self.op_stats.get(id(args[0]))
                if known is not None and known[0]() is args[0] and known[1] == version_of(args[0]):
                    out = tensors[0]
                    self.op_stats[id(out)] = (weakref.ref(out), version_of(out), known[2], known[3])
            return  # nothing computed (views, detach) or nothing defined (empty) to measure
        measurable = [t for t in tensors if not classify(t)]
        low = high = math.nan
        nan = inf = False
        if measurable:
            try:
                measured = [self.meter.measure(t) for t in measurable]
            except Exception:  # an exotic output: keep the row, without stats
                measured = []
            if measured:
                lows = [m[0] for m in measured]
                highs = [m[1] for m in measured]
                nan = any(h != h for h in highs)
                inf = any(h == math.inf for h in highs)
                low, high = (math.nan, math.nan) if nan else (min(lows), max(highs))
                if len(measurable) == 1 and not (nan or inf):
                    tensor = measurable[0]
                    self.op_stats[id(tensor)] = (weakref.ref(tensor), version_of(tensor), low, high)
        first = tensors[0] if tensors else None
        index = len(self.rows)
        self.rows.append((index, phase, name, str(func), module, module_type,
                          str(first.dtype).replace("torch.", "") if first is not None else "",
                          tuple(first.shape) if first is not None else (),
                          low, high, nan, inf, nan or inf, source))
        if nan and self.first_nan is None:
            self.first_nan = (index, _describe_op_tensors(func, args, kwargs, measurable))
        elif inf and self.first_inf is None:
            self.first_inf = (index, _describe_op_tensors(func, args, kwargs, measurable))


def _describe(role: str, tensor: torch.Tensor) -> dict:
    info = {"role": role, "dtype": str(tensor.dtype).replace("torch.", ""),
            "shape": tuple(tensor.shape), "numel": tensor.numel(), "min": math.nan,
            "max": math.nan, "nan_count": 0, "inf_count": 0}
    if tensor.numel() == 0 or tensor.is_complex() or tensor.dtype is torch.bool:
        return info
    try:
        with torch.no_grad():
            values = tensor.detach()
            if values.is_floating_point():
                nan_mask, inf_mask = torch.isnan(values), torch.isinf(values)
                finite = values[~(nan_mask | inf_mask)]
                low = finite.min().double() if finite.numel() else torch.tensor(math.nan)
                high = finite.max().double() if finite.numel() else torch.tensor(math.nan)
                numbers = torch.stack((low.cpu(), high.cpu(), nan_mask.sum().double().cpu(),
                                       inf_mask.sum().double().cpu())).tolist()
            else:
                numbers = [float(values.min()), float(values.max()), 0, 0]
        info.update(min=numbers[0], max=numbers[1], nan_count=int(numbers[2]),
                    inf_count=int(numbers[3]))
    except Exception:
        pass
    return info


def _describe_op_tensors(func: Any, args: tuple, kwargs: dict, outputs: list[torch.Tensor]) -> list[dict]:
    """Signed ranges and non-finite counts of the first bad op's inputs and outputs."""
    try:
        names = [a.name for a in func._schema.arguments]
    except AttributeError:
        names = []
    described = []
    for position, value in enumerate(args):
        name = names[position] if position < len(names) else f"arg{position}"
        tensors = _tensors_in(value)
        for k, tensor in enumerate(tensors):
            described.append(_describe(f"input {name}" + (f"[{k}]" if len(tensors) > 1 else ""), tensor))
    for name, value in kwargs.items():
        for tensor in _tensors_in(value):
            described.append(_describe(f"input {name}", tensor))
    for k, tensor in enumerate(outputs):
        described.append(_describe("output" + (f"[{k}]" if len(outputs) > 1 else ""), tensor))
    return described


class _OpTracer(TorchDispatchMode):
    """Measures every aten op the replay runs."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Recent torch wraps __torch_dispatch__ in a dynamo guard whose first call imports
        # torch._dynamo (seconds). A replay never runs under torch.compile: no guard needed.
        return False

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        recorder = self.recorder
        if recorder.paused:
            return func(*args, **kwargs)
        recorder.before_op(func, args, kwargs)
        output = func(*args, **kwargs)
        recorder.after_op(func, args, kwargs, output, sys._getframe(1))
        return output


class _Replay:
    """One trace-mode run of a held batch; restores everything in ``finally``."""

    def __init__(self, watch: NanWatch, capture: ReplayCapture, held: _HeldBatch,
                 loss_fn: Callable[[Any], torch.Tensor] | None) -> None:
        self.watch = watch
        self.capture = capture
        self.held = held
        self.loss_fn = loss_fn

    def _weight_status(self) -> tuple[list[str], list[str], bool]:
        """(changed since the batch started, buffers updated by the batch itself, snapshot used)."""
        slots = self.capture.slots
        first, last = self.held.forwards[0], self.held.forwards[-1]
        if first.snapshot is not None:
            return [], [], True
        current = slots.read()
        end_versions = dict(zip(slots.buffer_positions, last.end_buffer_versions or []))
        changed, updated = [], []
        for i, tensor in enumerate(current):
            then = first.weights[i] if i < len(first.weights) else None
            if tensor is then and (tensor is None or version_of(tensor) == first.weight_versions[i]):
                continue
            if tensor is then and end_versions.get(i) == version_of(tensor):
                updated.append(slots.names[i])
            else:
                changed.append(slots.names[i])
        return _with_running_stats(changed, slots), _with_running_stats(updated, slots), False

    def run(self) -> Trace:
        started = time.perf_counter()
        watch, slots, held = self.watch, self.capture.slots, self.held
        changed, updated, snapshot_used = self._weight_status()
        root = watch.model
        names = {id(m): (name, type(m).__name__) for name, m in root.named_modules()}
        recorder = _Recorder(watch, held.batch, names)
        saved_cpu_rng = torch.get_rng_state()
        saved_cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        saved_training = [m.training for m in slots.modules]
        handles: list[Any] = []
        shadows: _Shadows | None = None
        loss_value: float | None = None
        try:
            with watch.suspended():
                shadows = recorder.shadows = _Shadows()
                shadows.install(slots, held.forwards[0].snapshot or slots.read())
                for module in {id(m): m for m in root.modules()}.values():
                    handles.append(module.register_forward_pre_hook(recorder.pre_hook, with_kwargs=True))
                    handles.append(module.register_forward_hook(recorder.post_hook, with_kwargs=True,
                                                                always_call=True))
                for capture in held.forwards:
                    loss_value = self._run_forward(root, capture, recorder)
        finally:
            for handle in handles:
                handle.remove()
            if shadows is not None:
                shadows.restore()
            for module, flag in zip(slots.modules, saved_training):
                module.training = flag
            torch.set_rng_state(saved_cpu_rng)
            if saved_cuda_rng is not None:
                torch.cuda.set_rng_state_all(saved_cuda_rng)
        recorder.resolve()
        ops = pd.DataFrame.from_records(recorder.rows, columns=OPS_COLUMNS).astype(
            {"index": "int64", "abs_min": "float64", "abs_max": "float64", "nan": "bool",
             "inf": "bool", "nonfinite": "bool"})
        # A NaN is never intended; an Inf can be (masks filled with -inf), so the first NaN wins.
        chosen = recorder.first_nan or recorder.first_inf
        first_inf = None
        if recorder.first_inf is not None and recorder.first_nan is not None \
                and recorder.first_inf[0] < recorder.first_nan[0]:
            first_inf = ops.iloc[recorder.first_inf[0]]
        return Trace(batch=held.batch, frames=frames_to_dataframe(recorder.frames), ops=ops,
                     first_bad=ops.iloc[chosen[0]] if chosen is not None else None,
                     first_bad_tensors=pd.DataFrame(chosen[1] if chosen is not None else [],
                                                    columns=_TENSOR_COLUMNS),
                     earlier_inf=first_inf,
                     weights_changed=bool(changed), changed_weights=changed,
                     buffers_updated=updated, snapshot_used=snapshot_used, loss=loss_value,
                     forwards=len(held.forwards), seconds=time.perf_counter() - started)

    def _run_forward(self, root: nn.Module, capture: _ForwardCapture, recorder: _Recorder) -> float | None:
        loss_fn = self.loss_fn
        if len(capture.training) == len(self.capture.slots.modules):
            for module, flag in zip(self.capture.slots.modules, capture.training):
                module.training = flag
        torch.set_rng_state(capture.cpu_rng)
        if capture.cuda_rng is not None:
            torch.cuda.set_rng_state_all(capture.cuda_rng)
        needs_grad = capture.needs_grad
        args = tuple(_fresh(v, i in needs_grad) for i, v in enumerate(capture.args))
        kwargs = ({k: _fresh(v, k in needs_grad) for k, v in capture.kwargs.items()}
                  if capture.kwargs else {})
        with contextlib.ExitStack() as stack:
            if capture.inference and loss_fn is None:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(capture.grad_enabled or loss_fn is not None))
            wanted = dict(capture.autocast)
            for device_type in ("cpu", "cuda"):
                if device_type in wanted:
                    stack.enter_context(torch.autocast(device_type, dtype=wanted[device_type]))
                elif torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            stack.enter_context(_OpTracer(recorder))
            recorder.phase = "forward"
            output = root(*args, **kwargs)
            recorder.tag_nodes()
            if loss_fn is None:
                return None
            recorder.phase = "loss"
            loss = loss_fn(output)
            recorder.tag_nodes()
            if not isinstance(loss, _Tensor) or loss.numel() != 1:
                raise ReplayError("loss_fn must return a scalar tensor (the loss to run backward on)")
            recorder.phase = "backward"
            loss.backward()
        return float(loss.detach())


def _with_running_stats(names: list[str], slots: _WeightSlots) -> list[str]:
    """BatchNorm updates running_mean/var without bumping their version counters; its
    num_batches_tracked does bump: name the statistics along with it."""
    known = set(slots.names)
    result = list(names)
    for name in names:
        if name == "num_batches_tracked" or name.endswith(".num_batches_tracked"):
            prefix = name[: -len("num_batches_tracked")]
            for sibling in ("running_mean", "running_var"):
                if prefix + sibling in known and prefix + sibling not in result:
                    result.append(prefix + sibling)
    return result


def _fresh(value: Any, needed_grad: bool) -> Any:
    """A top-level tensor input as the replay passes it: same data, requires_grad as it was,
    and no gradient ever lands on the user's own tensor."""
    if isinstance(value, _Tensor):
        fresh = value.detach()
        if (value.requires_grad or needed_grad) and fresh.is_floating_point():
            fresh.requires_grad_(True)
        return fresh
    return value


# ---------------------------------------------------------------------------------- the result
_TENSOR_COLUMNS = ["role", "dtype", "shape", "numel", "min", "max", "nan_count", "inf_count"]


def _number(value: float) -> str:
    return "nan" if value != value else f"{value:.3e}"


@dataclass(repr=False)
class Trace:
    """A trace-mode replay of one batch: every module frame and every tensor op.

    ``frames``: the contract's frame DataFrame (every module frame, no ring limit). ``ops``: one
    row per aten op (:data:`OPS_COLUMNS`; ops that only make views or uninitialised memory are
    left out; ``inf`` can be hidden by a NaN in the same output). ``first_bad``: the first op row
    whose output holds a NaN, else the first whose output holds an Inf, else None (an Inf can be
    intended, as in masks filled with -inf; ``earlier_inf`` is the first Inf op when one came
    before the first NaN); ``first_bad_tensors``: signed ranges and non-finite counts
    of that op's inputs and outputs. ``weights_changed``: parameters or buffers changed since
    the batch ran, so the replay used today's values (``changed_weights`` names them).
    """

    batch: int
    frames: pd.DataFrame
    ops: pd.DataFrame
    first_bad: pd.Series | None = None
    first_bad_tensors: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=_TENSOR_COLUMNS))
    earlier_inf: pd.Series | None = None
    weights_changed: bool = False
    changed_weights: list[str] = field(default_factory=list)
    buffers_updated: list[str] = field(default_factory=list)
    snapshot_used: bool = False
    loss: float | None = None
    forwards: int = 1
    seconds: float = 0.0

    def summary(self) -> str:
        """One line: the first bad op and where, or that every op stayed finite."""
        if self.first_bad is None:
            return f"trace of batch {self.batch}: all {len(self.ops)} ops produced finite values"
        first = self.first_bad
        where = f" in module '{first['module'] or '<root>'}'" if first["phase"] != "loss" else " in loss_fn"
        return (f"trace of batch {self.batch}: first non-finite op {first['op']} "
                f"({first['phase']}){where} at {first['source'] or 'an unknown line'}")

    def report(self) -> str:
        """The first bad op with its source line, the weights' state, then every frame."""
        lines = [f"Trace of batch_number={self.batch} (replayed in trace mode: {len(self.ops)} ops, "
                 f"{self._frame_count()} module frames, {self.seconds:.2f} s)"]
        first = self.first_bad
        if first is None:
            lines.append("No op produced a non-finite value in the replay.")
        else:
            kind = "+".join(k for k in ("nan", "inf") if first[k]) or "non-finite"
            module = first["module"] or "<root>"
            module_type = f" ({first['module_type']})" if first["module_type"] else ""
            place = "in loss_fn" if first["phase"] == "loss" else f"in module '{module}'{module_type}"
            lines.append(f"First non-finite op: {first['op']} ({first['aten']}, {first['phase']}) "
                         f"{place}: {kind}")
            source = first["source"]
            if source:
                lines.append(f"  at {source}")
                filename, _, line = source.rpartition(":")
                text = linecache.getline(filename, int(line)).strip() if line.isdigit() else ""
                if text:
                    lines.append(f"  {line:>6} | {text}")
            else:
                lines.append("  (no line of user code on the stack)")
            for row in self.first_bad_tensors.itertuples(index=False):
                counts = [f"{n} of {row.numel} {k}" for n, k in ((row.nan_count, "NaN"),
                                                                 (row.inf_count, "Inf")) if n]
                state = ", ".join(counts) if counts else "no NaN or Inf"
                finite_range = (f"finite values from {_number(row.min)} to {_number(row.max)}"
                                if row.min == row.min else "no finite values")
                lines.append(f"  {row.role}: {row.dtype} {tuple(row.shape)}, {finite_range}, {state}")
            inputs = self.first_bad_tensors[self.first_bad_tensors["role"].str.startswith("input")]
            if len(inputs) and inputs["nan_count"].sum() > 0:
                lines.append("  Its inputs already held NaN that no traced op made: it came from "
                             "the batch's data or the weights.")
            earlier = self.earlier_inf
            if earlier is not None:
                place = ("loss_fn" if earlier["phase"] == "loss"
                         else f"module '{earlier['module'] or '<root>'}'")
                lines.append(f"  Before it, op {earlier['op']} in {place} made an Inf at "
                             f"{earlier['source'] or 'an unknown line'} (intended in masks filled "
                             "with -inf; an Inf reaching exp, softmax or a subtraction makes NaN).")
        if self.snapshot_used:
            lines.append("Weights: replayed with the snapshot taken when the batch started.")
        elif self.weights_changed:
            names = ", ".join(self.changed_weights[:6]) + (" ..." if len(self.changed_weights) > 6 else "")
            lines.append(f"Weights changed since batch {self.batch} ran ({names}): the replay used "
                         "their current values, so it may differ from what that batch saw. Call "
                         "nanwidget.core.replay.enable_weight_snapshots(w) before training for "
                         "faithful replays.")
        else:
            lines.append(f"Weights: unchanged since batch {self.batch} ran.")
        if self.buffers_updated and not self.snapshot_used:
            names = ", ".join(self.buffers_updated[:6]) + (" ..." if len(self.buffers_updated) > 6 else "")
            lines.append(f"Buffers updated by batch {self.batch}'s own forward ({names}): the replay "
                         "started from their updated values (train-mode BatchNorm outputs do not "
                         "depend on its running statistics).")
        lines.append("")
        lines.append(f"All {self._frame_count()} forward frames of the replay:")
        lines.append(f"{'abs min':8} {'abs max':8} metadata")
        lines.extend(format_frames(self.frames))
        return "\n".join(lines)

    def _frame_count(self) -> int:
        return 0 if self.frames.empty else int(self.frames["frame"].nunique())

    def __repr__(self) -> str:
        return f"<Trace {self.summary()}>"

    def _repr_html_(self) -> str:  # pragma: no cover - notebook nicety
        import html
        return f"<pre>{html.escape(self.report())}</pre>"

"""Gradients: backward frames, the gradient-norm check, and a guarded training loop.

Backward frames (``watch(model, backward=True)``)
    Full backward hooks (``register_full_backward_hook``) on the watched modules record one frame
    per module per backward pass, phase ``"backward"``, roles ``grad_output[i]`` then
    ``grad_input[i]``. The hooks reduce each gradient on its device (no host sync) and keep only
    the 3-number result, not the gradient itself, so the backward pass frees memory as usual.
    When the backward pass ends (an autograd final callback) the results are copied to the host
    in one transfer per device and the watch's usual detection runs: the first non-finite
    gradient in backward execution order becomes a :class:`NanEvent` with ``is_backward=True``
    and ``origin="grad"``; with ``on_nan="raise"`` the :class:`NanDetected` propagates out of
    ``loss.backward()`` unchanged (its type is kept by the autograd engine). Backward frames
    carry the batch of the last forward pass before them (the one that built the graph in a
    usual loop), and their ``frame`` numbers continue after that forward's frames.

Modules PyTorch refuses
    Full backward hooks wrap a module's inputs and outputs in views made by a custom autograd
    Function; PyTorch raises if such a view is later modified in place (``ReLU(inplace=True)``,
    ``out += residual``, ``x.clamp_()``). Static checks cannot see ``out += residual`` in a user's
    ``forward``, so the first complete forward of the model after ``watch`` is a *calibration*
    pass: it runs without backward hooks and watches the version counters of every module's
    inputs (during its own forward) and outputs (until the root forward returns). Modules with
    ``inplace=True``, modules that write into their inputs, modules whose outputs are written in
    place later, and modules whose output is not a tensor or tuple (full backward hooks ignore
    those) are skipped, with one warning naming them; the others get their hooks right after the
    calibration forward. So backward frames start with the second forward pass (the gradient-
    norm check works from the first). If an in-place write the calibration did not see (a data-
    dependent branch) hits a hooked tensor later, PyTorch raises its RuntimeError in that one
    forward; nanwidget adds a note to it, removes its backward hooks, and calibrates again on
    the next forward (after a second such failure backward frames stay off, with a warning).
    In-place writes to the model's *output* in the user's own loss code are not seen by the
    calibration pass; avoid them with ``backward=True``.

Gradient norms (``check_grad_norms``)
    After ``loss.backward()``: the L2 norm of every parameter gradient in one batched reduction
    (```torch._foreach_norm`` per device and dtype, accumulated in float64) and one host
    copy. A :class:`GradEvent` is recorded for each non-finite norm and each norm above
    ``grad_norm_warn``. Norms go into a bounded history (:func:`grad_history`).
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from torch import nn

from . import native
from .events import GradEvent, NanEvent
from .frames import Entry
from .history import History
from .stats import TensorStats, _abs_min_max, classify
from .watch import NanWatch, WatchExtension

if TYPE_CHECKING:  # pragma: no cover
    from .watch import _ModuleInfo

__all__ = ["GradsExtension", "make_extension", "check_grad_norms", "grad_events", "grad_history",
           "train_with_nan_guard", "GRAD_HISTORY_COLUMNS", "MAX_GRAD_EVENTS"]

GRAD_HISTORY_COLUMNS = ["rank", "batch", "batch_end", "param", "norm", "nonfinite"]
MAX_GRAD_EVENTS = 1_000
# Gradient-norm history bounds (core.history.History): the last FULL batches one row each (plus
# the window about to be merged); older batches merged into at most WINDOWS windows that keep
# the largest norm and whether any was non-finite. 300 parameters cost about 10 MB.
GRAD_HISTORY_FULL_BATCHES = 2_000
GRAD_HISTORY_WINDOWS = 500
GRAD_HISTORY_WINDOW = 20
# After this many runtime refusals (in-place writes the calibration pass missed), stop trying.
MAX_RUNTIME_REFUSALS = 2

_REFUSAL_MARKER = "BackwardHookFunction"
_RECENT_GRADS = 8  # gradients remembered to measure a tensor shared by two frames only once
_OUTPUT_ONLY_WARNING = ("Full backward hook is firing when gradients are computed with respect "
                        "to module outputs")


class _ProbeRecord:
    """Version counters seen during the calibration forward."""

    __slots__ = ("inputs", "outputs")

    def __init__(self) -> None:
        # id(module) -> stack of [(tensor, version)] of its positional tensor inputs.
        self.inputs: dict[int, list[list[tuple[torch.Tensor, int]]]] = {}
        # (id(module), tensor, version) of every tensor a module returned.
        self.outputs: list[tuple[int, torch.Tensor, int]] = []


class GradsExtension(WatchExtension):
    """Backward frames, gradient norms and their history for one watch."""

    kind = "grads"

    def __init__(self, watch: NanWatch) -> None:
        self.history: History | None = None  # created on the first check (parameter names)
        self._param_index: dict[str, int] = {}
        self.events: list[GradEvent] = []
        self.events_dropped = 0
        self._flagged_batch: int | None = None
        self._flagged: set[str] = set()  # parameters already flagged in _flagged_batch
        self._last_forward_batch: int | None = None
        self._next_frame_index = 0
        # Backward frame stats measured on the device, filled at the end of the backward pass.
        self._pending: list[tuple[TensorStats, torch.Tensor]] = []
        self._recent: dict[int, tuple[torch.Tensor, int, TensorStats]] = {}
        self._queued_task: int | None = None
        self._backward_batch: int | None = None
        self.skipped: dict[str, str] = {}  # module name -> why it has no backward hooks
        self._unsafe: dict[int, str] = {}
        self._runtime_refusals = 0
        self._backward_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._probe_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._control_handle: torch.utils.hooks.RemovableHandle | None = None
        self._probe: _ProbeRecord | None = None
        self._reprobe = False
        # "off": backward=False; "probe": calibrating; "active": hooks on; "disabled": gave up.
        self.mode = "off"
        if watch.backward:
            self._start_backward(watch)

    # ------------------------------------------------------------------ calibration
    def _start_backward(self, watch: NanWatch) -> None:
        # Modules whose inputs need no grad make PyTorch warn on every first backward; the
        # frame then simply has grad_input "None", which says the same thing.
        warnings.filterwarnings("ignore", message=_OUTPUT_ONLY_WARNING, category=UserWarning)
        for info in watch._infos.values():
            if getattr(info.module, "inplace", False) is True:
                self._unsafe[id(info.module)] = "inplace=True"
        self._install_probe(watch)
        root = watch.model
        self._control_handle = root.register_forward_hook(
            self._make_control_hook(watch), with_kwargs=True, always_call=True)

    def _install_probe(self, watch: NanWatch) -> None:
        self._probe = _ProbeRecord()
        self.mode = "probe"
        probe = self._probe

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if watch._suspended:  # a trace-mode replay: not a forward to calibrate on
                return
            try:
                seen = [(a, a._version) for a in args if isinstance(a, torch.Tensor)]
                probe.inputs.setdefault(id(module), []).append(seen)
            except Exception as error:
                watch._internal_error(error)

        def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._probe is not probe or watch._suspended:  # finished earlier in this round
                return
            error = sys.exc_info()[1]
            try:
                with watch._lock:
                    stack = probe.inputs.get(id(module))
                    seen = stack.pop() if stack else []
                    if error is None:
                        self._probe_outputs(probe, module, seen, output)
                    if module is watch.model and not watch._closed:
                        if error is None:
                            self._finish_probe(watch)
                        else:  # incomplete forward: calibrate again on the next one
                            probe.inputs.clear()
                            probe.outputs.clear()
            except Exception as internal:
                watch._internal_error(internal)

        for info in watch._infos.values():
            module = info.module
            self._probe_handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            self._probe_handles.append(module.register_forward_hook(
                post_hook, with_kwargs=True, always_call=True))

    def _probe_outputs(self, probe: _ProbeRecord, module: nn.Module,
                       seen: list[tuple[torch.Tensor, int]], output: Any) -> None:
        key = id(module)
        if any(tensor._version != version for tensor, version in seen):
            self._unsafe.setdefault(key, "writes into its input in place")
        if isinstance(output, torch.Tensor):
            probe.outputs.append((key, output, output._version))
        elif isinstance(output, tuple):
            for item in output:
                if isinstance(item, torch.Tensor):
                    probe.outputs.append((key, item, item._version))
        elif output is not None:
            self._unsafe.setdefault(key, f"returns {type(output).__name__}; full backward hooks "
                                         "need a tensor or a tuple of tensors")

    def _remove_probe(self) -> None:
        for handle in self._probe_handles:
            handle.remove()
        self._probe_handles.clear()
        self._probe = None

    def _finish_probe(self, watch: NanWatch) -> None:
        """After a complete calibration forward: decide, hook the safe modules, warn once."""
        probe = self._probe
        self._remove_probe()
        if probe is not None:
            for key, tensor, version in probe.outputs:
                if tensor._version != version:
                    self._unsafe.setdefault(key, "its output is modified in place after it returns")
        newly_skipped: list[str] = []
        for info in watch._infos.values():
            reason = self._unsafe.get(id(info.module))
            if reason is not None:
                label = info.name or "<root>"
                if label not in self.skipped:
                    newly_skipped.append(f"'{label}' ({info.type_name}: {reason})")
                self.skipped[label] = reason
                continue
            self._backward_handles.append(
                info.module.register_full_backward_hook(self._make_backward_hook(watch, info)))
        self.mode = "active"
        if newly_skipped:
            warnings.warn(
                f"nanwidget: no backward frames for {len(newly_skipped)} module(s) whose full "
                f"backward hooks PyTorch refuses (in-place writes on their inputs or outputs): "
                f"{', '.join(newly_skipped)}. Training is unaffected.", RuntimeWarning,
                stacklevel=2)

    def _make_control_hook(self, watch: NanWatch) -> Callable[..., None]:
        """Root forward hook (always called): reacts when PyTorch refuses a hooked tensor."""

        def control_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            error = sys.exc_info()[1]
            if error is None or self.mode != "active" or _REFUSAL_MARKER not in str(error) \
                    or watch._suspended:
                return
            try:
                with watch._lock:
                    if not watch._closed:
                        self._on_runtime_refusal(watch, error)
            except Exception as internal:
                watch._internal_error(internal)

        return control_hook

    def _on_runtime_refusal(self, watch: NanWatch, error: BaseException) -> None:
        """PyTorch refused a hooked tensor mid-forward: drop the hooks, recalibrate next time."""
        # The innermost running module wrote in place, but into its own input or into a
        # submodule's output: the next calibration forward tells which, so nobody is blamed here.
        culprit = _innermost_hooked_module(error, watch)
        for handle in self._backward_handles:
            handle.remove()
        self._backward_handles.clear()
        self._runtime_refusals += 1
        where = (f" while the forward of '{culprit.name or '<root>'}' ({culprit.type_name}) ran"
                 if culprit is not None else "")
        if self._runtime_refusals >= MAX_RUNTIME_REFUSALS:
            self.mode = "disabled"
            advice = ("backward frames are now off for this watch; gradient norms still work. "
                      "Run this forward again")
        else:
            self.mode = "probe"
            self._reprobe = True  # hooks cannot be added while the root's hooks are iterated
            advice = ("nanwidget removed its backward hooks and recalibrates on the next forward. "
                      "Run this forward again")
        note = (f"nanwidget: this error comes from nanwidget's backward hooks (backward=True): "
                f"a tensor they wrap was modified in place{where}. {advice}.")
        if hasattr(error, "add_note"):
            error.add_note(note)
        warnings.warn(note, RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ backward hooks
    def _make_backward_hook(self, watch: NanWatch, info: _ModuleInfo) -> Callable[..., None]:
        def backward_hook(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            try:
                with watch._lock:
                    if watch._closed or watch._suspended or self.mode != "active":
                        return None
                    entries: list[Entry] = []
                    for i, grad in enumerate(grad_output):
                        entries.append(self._grad_entry(f"grad_output[{i}]", grad))
                    for i, grad in enumerate(grad_input):
                        entries.append(self._grad_entry(f"grad_input[{i}]", grad))
                    self._record_backward(watch, info, entries)
                    self._queue_resolution(watch)
            except Exception as error:
                watch._internal_error(error)
            return None

        return backward_hook

    def _grad_entry(self, role: str, grad: Any) -> Entry:
        if grad is None:
            return (role, None, None, None, "None")
        if not isinstance(grad, torch.Tensor):
            return (role, None, None, None, "not a tensor")
        note = classify(grad)
        if note:
            return (role, None, grad.dtype, grad.shape, note)
        # A module's grad_input is usually the very tensor its producer's hook sees next as
        # grad_output: measure it once. Only a few recent gradients are held, never the pass.
        recent = self._recent
        seen = recent.get(id(grad))
        if seen is not None and seen[0] is grad and seen[1] == grad._version:
            return (role, seen[2], grad.dtype, grad.shape, "")
        stats = TensorStats()
        with torch.no_grad():
            try:
                detached = grad.detach()
                measured = native.abs_range(detached) \
                    if native.available() and native.eligible(detached) else None
                if measured is not None and measured[1] == measured[1]:
                    # A CPU gradient read once by the kernel; NaN-free, so the max shows any Inf.
                    stats.abs_min, stats.abs_max = measured
                    stats.inf, stats.note = measured[1] == math.inf, ""
                else:
                    # [abs_min, abs_max, has_inf] on the device; no host sync, gradient not kept.
                    result = torch.cat((torch.stack(_abs_min_max(detached)).double(),
                                        torch.isinf(detached).any().double().reshape(1)))
                    self._pending.append((stats, result))
            except Exception as error:  # exotic tensor subclass: report, never break backward
                stats.note = f"unsupported ({type(error).__name__})"
                return (role, stats, grad.dtype, grad.shape, stats.note)
        if len(recent) >= _RECENT_GRADS:
            del recent[next(iter(recent))]
        recent[id(grad)] = (grad, grad._version, stats)
        return (role, stats, grad.dtype, grad.shape, "")

    def _frame_batch(self, watch: NanWatch) -> int:
        """The batch of the forward that built the graph now running backward."""
        if self._last_forward_batch is not None:
            return self._last_forward_batch
        return watch.batch

    def _record_backward(self, watch: NanWatch, info: _ModuleInfo, entries: list[Entry]) -> None:
        batch = self._frame_batch(watch)
        if batch == watch.batch:
            watch.record_frame(info, "backward", entries, batch=batch)
            return
        # Automatic counting already advanced the batch and restarted its frame counter:
        # continue numbering after the forward's own frames of ``batch``.
        saved = watch._frame_counter
        watch._frame_counter = self._next_frame_index
        try:
            watch.record_frame(info, "backward", entries, batch=batch)
        finally:
            self._next_frame_index = watch._frame_counter
            watch._frame_counter = saved

    def _queue_resolution(self, watch: NanWatch) -> None:
        """Once per backward pass: resolve its frames when the autograd engine finishes."""
        task = torch._C._current_graph_task_id() if hasattr(torch._C, "_current_graph_task_id") else 0
        if self._queued_task == task:
            return
        self._queued_task = task
        self._backward_batch = self._frame_batch(watch)

        def backward_done() -> None:
            self._queued_task = None
            self.resolve_backward(watch, raising=True)

        torch.autograd.Variable._execution_engine.queue_callback(backward_done)

    def resolve_backward(self, watch: NanWatch, *, raising: bool) -> None:
        """Resolve recorded backward frames; run detection; raise or warn per ``on_nan``."""
        with watch._lock:
            if watch._closed or not (self._pending or watch._batch_frames):
                return
            batch = self._backward_batch if self._backward_batch is not None else watch.batch
            event = watch._resolve_locked(advance=False)
        watch._after_batch(batch, event, raising=raising, batch_finished=False)

    def before_resolve(self, watch: NanWatch) -> None:
        """Fill the backward stats measured so far: one host copy per device."""
        pending, self._pending = self._pending, []
        self._recent.clear()
        if not pending:
            return
        by_device: dict[torch.device, list[int]] = {}
        for position, (_, result) in enumerate(pending):
            by_device.setdefault(result.device, []).append(position)
        for positions in by_device.values():
            values = torch.stack([pending[p][1] for p in positions]).tolist()
            for position, (low, high, has_inf) in zip(positions, values):
                stats = pending[position][0]
                stats.abs_min, stats.abs_max = low, high
                stats.nan = high != high
                stats.inf = high == math.inf or has_inf > 0
                stats.note = ""

    # ------------------------------------------------------------------ batch boundaries
    def on_batch_start(self, watch: NanWatch, batch: int, args: tuple, kwargs: dict) -> None:
        self._last_forward_batch = batch
        self._backward_batch = None
        self._queued_task = None
        if self._reprobe:
            self._reprobe = False
            self._install_probe(watch)

    def on_batch_end(self, watch: NanWatch, batch: int, frames: list, event: NanEvent | None) -> None:
        if self.mode == "off":  # no backward frames to number: keep the per-batch path empty
            return
        forward = [f for f in frames if f.phase == "forward"]
        if forward and self._last_forward_batch is not None \
                and forward[-1].batch == self._last_forward_batch:
            self._next_frame_index = forward[-1].index + 1

    def close(self, watch: NanWatch) -> None:
        watch._closed_grads = self  # events and history stay readable after close()
        self._remove_probe()
        for handle in self._backward_handles:
            handle.remove()
        self._backward_handles.clear()
        if self._control_handle is not None:
            self._control_handle.remove()
            self._control_handle = None
        self._pending.clear()
        self._recent.clear()

    # ------------------------------------------------------------------ gradient norms
    def check(self, watch: NanWatch) -> bool:
        """See :func:`check_grad_norms`."""
        self.resolve_backward(watch, raising=False)
        named = [(name, p) for name, p in watch.model.named_parameters() if p.grad is not None]
        if not named:
            return False
        norms = _grad_norms([p.grad for _, p in named])
        batch = self._frame_batch(watch)
        threshold = watch.grad_norm_warn
        rank = watch.rank
        flagged = False
        with watch._lock:
            if self.history is None:
                names = [name for name, _ in watch.model.named_parameters()]
                self._param_index = {name: i for i, name in enumerate(names)}
                self.history = History(names, ["parameter"] * len(names), rank=rank,
                                       full_batches=GRAD_HISTORY_FULL_BATCHES,
                                       max_windows=GRAD_HISTORY_WINDOWS,
                                       window=GRAD_HISTORY_WINDOW)
            history, index = self.history, self._param_index
            for (name, _), norm in zip(named, norms):
                finite = math.isfinite(norm)
                position = index.get(name)
                if position is not None:
                    history.record(batch, position, norm, norm, not finite)
                if finite and (threshold is None or norm <= threshold):
                    continue
                flagged = True
                if self._flagged_batch != batch:
                    self._flagged_batch, self._flagged = batch, set()
                if name in self._flagged:
                    continue
                self._flagged.add(name)
                if len(self.events) < MAX_GRAD_EVENTS:
                    self.events.append(GradEvent(batch=batch, param=name, norm=norm,
                                                 threshold=threshold, rank=rank))
                else:
                    self.events_dropped += 1
        return flagged

    def history_frame(self) -> pd.DataFrame:
        if self.history is None:
            return _empty_grad_history()
        table = self.history.to_dataframe()
        if table.empty:
            return _empty_grad_history()
        table = table.rename(columns={"module": "param", "abs_max": "norm"})
        return table[GRAD_HISTORY_COLUMNS].reset_index(drop=True)


def _empty_grad_history() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in zip(
        GRAD_HISTORY_COLUMNS, ["int64", "int64", "int64", "object", "float64", "bool"])})


def _innermost_hooked_module(error: BaseException, watch: NanWatch) -> _ModuleInfo | None:
    """The innermost watched module whose ``forward`` was running when ``error`` was raised."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "_call_impl":
            module = tb.tb_frame.f_locals.get("self")
            info = watch._infos.get(id(module)) if module is not None else None
            if info is not None:
                found = info
        tb = tb.tb_next
    return found


def _grad_norms(grads: list[torch.Tensor]) -> list[float]:
    """L2 norm of each gradient: one ``_foreach_norm`` per (device, dtype), one host copy."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    sparse: list[int] = []
    for position, grad in enumerate(grads):
        if grad.layout is not torch.strided:
            sparse.append(position)
        else:
            groups.setdefault((grad.device, grad.dtype), []).append(position)
    order: list[int] = []
    parts: list[torch.Tensor] = []
    with torch.no_grad():
        for (_, dtype), positions in groups.items():
            group = [grads[p] for p in positions]
            if dtype.is_floating_point:
                # Accumulate in float64: squares of finite float32 (or bfloat16) gradients above
                # ~1e19 overflow a float32 sum, which would report an exploding but finite
                # gradient as non-finite.
                norms = torch._foreach_norm(group, 2, dtype=torch.float64)
            else:  # complex (rare): no fused kernel needed
                norms = [torch.linalg.vector_norm(g.to(torch.complex128)) for g in group]
            parts.append(torch.stack([n.double() for n in norms]))
            order.extend(positions)
        for position in sparse:
            parts.append(grads[position].coalesce().values().double().norm().reshape(1))
            order.append(position)
        if not parts:
            return []
        target = parts[0].device
        values = torch.cat([part.to(target) for part in parts]).tolist()  # the one host sync
    result = [math.nan] * len(grads)
    for position, value in zip(order, values):
        result[position] = value
    return result


# ---------------------------------------------------------------------- public functions
def make_extension(watch: NanWatch) -> GradsExtension:
    """Always created: gradient norms work without ``backward=True`` too."""
    return GradsExtension(watch)


def _grads(watch: NanWatch) -> GradsExtension:
    extension = watch._extension("grads")
    if extension is None:
        raise RuntimeError("this watch is closed; gradient norms are checked while it watches")
    return extension


def check_grad_norms(watch: NanWatch) -> bool:
    """After ``loss.backward()``: flag non-finite or too large parameter gradient norms.

    Computes every parameter's gradient L2 norm in one batched reduction with one host sync,
    records them in the gradient-norm history under the batch of the last forward, and adds a
    :class:`GradEvent` for each norm that is non-finite or above ``watch.grad_norm_warn``
    (once per batch and parameter). Returns whether any norm was flagged. Never raises for a
    flagged norm: the return value is the signal (skip ``optimizer.step()`` on True).
    """
    return _grads(watch).check(watch)


def grad_events(watch: NanWatch) -> list[GradEvent]:
    """Every :class:`GradEvent` flagged so far (capped at :data:`MAX_GRAD_EVENTS`)."""
    extension = watch._extension("grads")
    if extension is None:
        extension = getattr(watch, "_closed_grads", None)
    return list(extension.events) if extension is not None else []


def grad_history(watch: NanWatch) -> pd.DataFrame:
    """Gradient norms per batch and parameter: columns :data:`GRAD_HISTORY_COLUMNS`.

    Bounded: the last ``GRAD_HISTORY_FULL_BATCHES`` checked batches one row per parameter; older
    batches merged into windows (``batch``..``batch_end``) that keep the largest norm and whether
    any was non-finite. Several checks in one batch keep the largest norm.
    """
    extension = watch._extension("grads")
    if extension is None:
        extension = getattr(watch, "_closed_grads", None)
    return extension.history_frame() if extension is not None else _empty_grad_history()


# ---------------------------------------------------------------------- the guarded loop
def _to_device(value: Any, device: torch.device | str | None) -> Any:
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _split_batch(item: Any) -> tuple[Any, Any]:
    if isinstance(item, Mapping):
        return item, item
    if isinstance(item, (list, tuple)) and len(item) == 2:
        return item[0], item[1]
    raise TypeError("train_with_nan_guard: the loader must yield (inputs, targets) pairs or dicts, "
                    f"got {type(item).__name__}" + (f" of length {len(item)}"
                                                     if isinstance(item, (list, tuple)) else ""))


def _call_model(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


def _loss_value(loss: Any) -> torch.Tensor:
    if isinstance(loss, torch.Tensor):
        return loss
    value = getattr(loss, "loss", None)  # a transformers ModelOutput passed through
    if isinstance(value, torch.Tensor):
        return value
    raise TypeError(f"train_with_nan_guard: loss_fn must return a tensor, got {type(loss).__name__}")


def _tail_frames(watch: NanWatch) -> pd.DataFrame:
    frames = watch.frames()
    if len(frames):
        last = frames.drop_duplicates(["batch", "frame"]).tail(watch.max_frames)
        keep = set(zip(last["batch"], last["frame"]))
        frames = frames[[key in keep for key in zip(frames["batch"], frames["frame"])]]
    return frames.reset_index(drop=True)


def _loss_event(watch: NanWatch, batch: int, value: float, loss_fn: Any) -> NanEvent:
    frames = _tail_frames(watch)
    kind = "nan" if value != value else "inf"
    return NanEvent(batch=batch, module="<loss_fn>",
                    module_type=getattr(loss_fn, "__name__", type(loss_fn).__name__),
                    call=0, role="output", kind=kind, origin="output", is_backward=False,
                    frames=frames, rank=watch.rank,
                    frame=int(frames["frame"].iloc[-1]) if len(frames) else 0)


def _grad_norm_event(watch: NanWatch, model: nn.Module, grad: GradEvent) -> NanEvent:
    owner, _, leaf = grad.param.rpartition(".")
    modules = dict(model.named_modules())
    module = modules.get(owner)
    frames = _tail_frames(watch)
    kind = "nan" if grad.norm != grad.norm else "inf"
    return NanEvent(batch=grad.batch, module=owner,
                    module_type=type(module).__name__ if module is not None else "",
                    call=0, role=leaf, kind=kind, origin="grad", is_backward=True, frames=frames,
                    rank=grad.rank, frame=int(frames["frame"].iloc[-1]) if len(frames) else 0)


class _Progress:
    """tqdm when installed, else a throttled one-line stderr display; silent for short loaders."""

    def __init__(self, total: int | None, enabled: bool | None) -> None:
        if enabled is None:
            enabled = total is None or total >= 50
        self.enabled = enabled
        self.total = total
        self._bar = None
        self._last = 0.0
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            self._bar = tqdm(total=total, desc="nanwidget", unit="batch", leave=False)

    def update(self, batch: int, loss: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            return
        now = time.monotonic()
        if now - self._last >= 1.0:
            self._last = now
            total = f"/{self.total}" if self.total is not None else ""
            sys.stderr.write(f"\rnanwidget: batch {batch + 1}{total} loss {loss:.4g}   ")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self._last:
            sys.stderr.write("\n")


def train_with_nan_guard(model: nn.Module, loader: Iterable[Any],
                         loss_fn: Callable[[Any, Any], torch.Tensor],
                         optimizer: torch.optim.Optimizer, *,
                         device: torch.device | str | None = None, max_batches: int | None = None,
                         grad_norm_warn: float | None = None, progress: bool | None = None,
                         **watch_kwargs: Any) -> tuple[list[float], NanEvent | None]:
    """Train under a watch and stop at the first NaN/Inf: ``(losses, event)``.

    Each batch: forward, ``loss_fn(output, target)``, backward, :func:`check_grad_norms`,
    ``optimizer.step()``. ``loader`` yields ``(inputs, targets)`` pairs (``inputs`` a tensor, a
    tuple of positional arguments or a dict of keyword arguments) or dicts, which are passed as
    ``model(**batch)`` and also given to ``loss_fn`` as the target. ``device`` moves each batch
    there. The run stops at the first of:

    - a forward NaN/Inf in the model: that :class:`NanEvent`;
    - a non-finite loss: a NanEvent with ``module="<loss_fn>"``, ``role="output"``;
    - a backward NaN/Inf (``backward=True``, the default here): that NanEvent;
    - a non-finite parameter gradient norm: a NanEvent with ``origin="grad"``,
      ``is_backward=True``, ``module`` the parameter's owner and ``role`` its name
      (e.g. ``fc1`` / ``weight``).

    The optimizer step is skipped for the stopping batch, so weights are never updated from
    non-finite gradients. Norms above ``grad_norm_warn`` only warn (one warning per batch).
    ``losses`` holds the loss of every batch whose loss was computed (the last may be
    non-finite). Progress is shown for long (>= 50 batches) or unsized loaders unless
    ``progress=False``. Other keyword arguments go to :func:`nanwidget.watch`; ``on_nan`` is
    not accepted (the loop returns the event). Hooks are removed on every exit.
    """
    if "on_nan" in watch_kwargs:
        raise TypeError("train_with_nan_guard stops at the first event and returns it; "
                        "on_nan does not apply")
    if max_batches is not None and (not isinstance(max_batches, int) or max_batches < 0):
        raise ValueError(f"max_batches must be an integer >= 0 or None, got {max_batches!r}")
    watch_kwargs.setdefault("backward", True)
    from .watch import watch as start_watch

    try:
        total: int | None = len(loader)  # type: ignore[arg-type]
    except TypeError:
        total = None
    if max_batches is not None:
        total = max_batches if total is None else min(total, max_batches)
    losses: list[float] = []
    event: NanEvent | None = None
    bar = _Progress(total, progress)
    try:
        with start_watch(model, on_nan="record", grad_norm_warn=grad_norm_warn,
                         **watch_kwargs) as w:
            for index, item in enumerate(loader):
                if max_batches is not None and index >= max_batches:
                    break
                inputs, targets = _split_batch(item)
                inputs, targets = _to_device(inputs, device), _to_device(targets, device)
                seen = len(w.events)
                batch = w.batch
                optimizer.zero_grad(set_to_none=True)
                output = _call_model(model, inputs)
                if len(w.events) > seen:
                    event = w.events[seen]
                    break
                loss = _loss_value(loss_fn(output, targets))
                value = float(loss.detach())
                losses.append(value)
                if not math.isfinite(value):
                    event = _loss_event(w, batch, value, loss_fn)
                    break
                loss.backward()
                grads_before = len(w.grad_events)
                w.check_grad_norms()
                if len(w.events) > seen:
                    event = w.events[seen]
                    break
                flagged = w.grad_events[grads_before:]
                bad = [g for g in flagged if not math.isfinite(g.norm)]
                if bad:
                    event = _grad_norm_event(w, model, bad[0])
                    break
                if flagged:
                    worst = max(flagged, key=lambda g: g.norm)
                    warnings.warn(f"nanwidget: gradient norm of '{worst.param}' is {worst.norm:.3g} "
                                  f"> {grad_norm_warn:g} at batch {worst.batch} "
                                  f"({len(flagged)} parameter(s) above the threshold)",
                                  RuntimeWarning, stacklevel=2)
                optimizer.step()
                bar.update(index, value)
    finally:
        bar.close()
    return losses, event

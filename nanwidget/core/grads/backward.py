"""Backward frames (``watch(model, backward=True)``).

Full backward hooks (``register_full_backward_hook``) on the watched modules record one frame
per module per backward pass, phase ``"backward"``, roles ``grad_output[i]`` then
``grad_input[i]``. Each gradient is measured without being held (the native kernel on CPU, a
device reduction elsewhere: no host sync), so the backward pass frees memory as usual. When
the backward pass ends (an autograd final callback) the recorder resolves the frames: the first
non-finite gradient in backward execution order becomes a :class:`NanEvent` with
``is_backward=True`` and ``origin="grad"``; with ``on_nan="raise"`` the :class:`NanDetected`
propagates out of ``loss.backward()`` unchanged. Backward frames carry the batch of the last
forward pass before them, and their ``frame`` numbers continue after that forward's frames.

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
    calibration forward. If an in-place write the calibration did not see (a data-dependent
    branch) hits a hooked tensor later, PyTorch raises its RuntimeError in that one forward;
    nanwidget adds a note to it, removes its backward hooks, and calibrates again on the next
    forward (after a second such failure backward frames stay off, with a warning).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable

import torch
from torch import nn

from ..entries import Entry
from ..recorder import Feature, ModuleInfo, Recorder

__all__ = ["BackwardFrames", "MAX_RUNTIME_REFUSALS"]

# After this many runtime refusals (in-place writes the calibration pass missed), stop trying.
MAX_RUNTIME_REFUSALS = 2

_REFUSAL_MARKER = "BackwardHookFunction"
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


class BackwardFrames(Feature):
    """Records a backward frame per module per backward pass, after one calibration forward."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.skipped: dict[str, str] = {}  # module name -> why it has no backward hooks
        self._unsafe: dict[int, str] = {}
        self._runtime_refusals = 0
        self._last_forward_batch: int | None = None
        self._queued_task: int | None = None
        self._backward_batch: int | None = None
        self._backward_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._probe_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._control_handle: torch.utils.hooks.RemovableHandle | None = None
        self._probe: _ProbeRecord | None = None
        self._reprobe = False
        # "probe": calibrating; "active": hooks on; "disabled": gave up; "closed".
        self.mode = "probe"
        # Modules whose inputs need no grad make PyTorch warn on every backward; the frame then
        # simply has grad_input "None", which says the same thing. The filter lives exactly as
        # long as this watch (removed in close()).
        warnings.filterwarnings("ignore", message=_OUTPUT_ONLY_WARNING, category=UserWarning)
        self._warning_filter = warnings.filters[0]
        for info in recorder.modules:
            if getattr(info.module, "inplace", False) is True:
                self._unsafe[id(info.module)] = "inplace=True"
        self._install_probe()
        self._control_handle = recorder.model.register_forward_hook(
            self._control_hook, with_kwargs=True, always_call=True)

    # ------------------------------------------------------------------ calibration
    def _install_probe(self) -> None:
        self._probe = _ProbeRecord()
        self.mode = "probe"
        probe = self._probe
        recorder = self.recorder

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if recorder.suspended:  # a trace-mode replay: not a forward to calibrate on
                return
            try:
                seen = [(a, a._version) for a in args if isinstance(a, torch.Tensor)]
                probe.inputs.setdefault(id(module), []).append(seen)
            except Exception as error:
                recorder.internal_error(error)

        def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._probe is not probe or recorder.suspended:  # finished earlier in this round
                return
            error = sys.exc_info()[1]
            try:
                with recorder.lock:
                    stack = probe.inputs.get(id(module))
                    seen = stack.pop() if stack else []
                    if error is None:
                        self._probe_outputs(probe, module, seen, output)
                    if module is recorder.model and not recorder.closed:
                        if error is None:
                            self._finish_probe()
                        else:  # incomplete forward: calibrate again on the next one
                            probe.inputs.clear()
                            probe.outputs.clear()
            except Exception as internal:
                recorder.internal_error(internal)

        for info in recorder.modules:
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

    def _finish_probe(self) -> None:
        """After a complete calibration forward: decide, hook the safe modules, warn once."""
        probe = self._probe
        self._remove_probe()
        if probe is not None:
            for key, tensor, version in probe.outputs:
                if tensor._version != version:
                    self._unsafe.setdefault(key, "its output is modified in place after it returns")
        newly_skipped: list[str] = []
        for info in self.recorder.modules:
            reason = self._unsafe.get(id(info.module))
            if reason is not None:
                if info.label not in self.skipped:
                    newly_skipped.append(f"'{info.label}' ({info.type_name}: {reason})")
                self.skipped[info.label] = reason
                continue
            self._backward_handles.append(
                info.module.register_full_backward_hook(self._make_backward_hook(info)))
        self.mode = "active"
        if newly_skipped:
            warnings.warn(
                f"nanwidget: no backward frames for {len(newly_skipped)} module(s) whose full "
                f"backward hooks PyTorch refuses (in-place writes on their inputs or outputs): "
                f"{', '.join(newly_skipped)}. Training is unaffected.", RuntimeWarning,
                stacklevel=2)

    def _control_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Root forward hook (always called): reacts when PyTorch refuses a hooked tensor."""
        error = sys.exc_info()[1]
        recorder = self.recorder
        if error is None or self.mode != "active" or _REFUSAL_MARKER not in str(error) \
                or recorder.suspended:
            return
        try:
            with recorder.lock:
                if not recorder.closed:
                    self._on_runtime_refusal(error)
        except Exception as internal:
            recorder.internal_error(internal)

    def _on_runtime_refusal(self, error: BaseException) -> None:
        """PyTorch refused a hooked tensor mid-forward: drop the hooks, recalibrate next time."""
        # The innermost running module wrote in place, but into its own input or into a
        # submodule's output: the next calibration forward tells which, so nobody is blamed here.
        culprit = self._innermost_hooked_module(error)
        for handle in self._backward_handles:
            handle.remove()
        self._backward_handles.clear()
        self._runtime_refusals += 1
        where = (f" while the forward of '{culprit.label}' ({culprit.type_name}) ran"
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

    def _innermost_hooked_module(self, error: BaseException) -> ModuleInfo | None:
        """The innermost watched module whose ``forward`` was running when ``error`` was raised."""
        found = None
        tb = error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_name == "_call_impl":
                module = tb.tb_frame.f_locals.get("self")
                info = self.recorder.module_info(module) if isinstance(module, nn.Module) else None
                if info is not None:
                    found = info
            tb = tb.tb_next
        return found

    # ------------------------------------------------------------------ backward hooks
    def _make_backward_hook(self, info: ModuleInfo) -> Callable[..., None]:
        recorder = self.recorder

        def backward_hook(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            # A replay's backward may run on autograd's own threads: never wait for the lock
            # the replaying thread holds.
            if recorder.suspended or recorder.closed or self.mode != "active":
                return None
            try:
                with recorder.lock:
                    entries: list[Entry] = []
                    grad_entry = recorder.entries.grad_entry
                    for i, grad in enumerate(grad_output):
                        entries.append(grad_entry(f"grad_output[{i}]", grad))
                    for i, grad in enumerate(grad_input):
                        entries.append(grad_entry(f"grad_input[{i}]", grad))
                    recorder.record_frame(info, "backward", entries, batch=self._frame_batch())
                    self._queue_resolution()
            except Exception as error:
                recorder.internal_error(error)
            return None

        return backward_hook

    def _frame_batch(self) -> int:
        """The batch of the forward that built the graph now running backward."""
        if self._last_forward_batch is not None:
            return self._last_forward_batch
        return self.recorder.batch

    def _queue_resolution(self) -> None:
        """Once per backward pass: resolve its frames when the autograd engine finishes."""
        task = torch._C._current_graph_task_id() if hasattr(torch._C, "_current_graph_task_id") else 0
        if self._queued_task == task:
            return
        self._queued_task = task
        self._backward_batch = self._frame_batch()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._queued_task = None
        self.end_backward(raising=True)

    def end_backward(self, *, raising: bool) -> None:
        """Resolve recorded backward frames; record their first event; raise or warn per
        ``on_nan`` when ``raising``."""
        batch = self._backward_batch if self._backward_batch is not None else self.recorder.batch
        self.recorder.end_frames(batch, reason="backward", raising=raising)

    # ------------------------------------------------------------------ Feature
    def on_batch_start(self, batch: int, args: tuple, kwargs: dict) -> None:
        self._last_forward_batch = batch
        self._backward_batch = None
        self._queued_task = None
        if self._reprobe:
            self._reprobe = False
            self._install_probe()

    def close(self) -> None:
        self.mode = "closed"
        self._remove_probe()
        for handle in self._backward_handles:
            handle.remove()
        self._backward_handles.clear()
        if self._control_handle is not None:
            self._control_handle.remove()
            self._control_handle = None
        try:
            warnings.filters.remove(self._warning_filter)
            warnings._filters_mutated()  # type: ignore[attr-defined]
        except (ValueError, AttributeError):
            pass

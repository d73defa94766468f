"""Running a held batch again in trace mode, and leaving the model exactly as it was."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import pandas as pd
import torch
from torch import nn

from ..detect import Detector, first_event
from ..events import NanEvent
from ..frames import frames_to_dataframe
from ..recorder import Recorder
from ..schema import OPS_COLUMNS, OPS_DTYPES
from ..stats import version_of
from ..trace import TENSOR_COLUMNS, Trace
from .capture import BatchCapture, ForwardCapture, HeldBatch, ReplayError, WeightSlots, layouts_of
from .shadows import Shadows
from .tracer import OpRecorder, OpTracer

__all__ = ["replay_held_batch"]

_Tensor = torch.Tensor


def replay_held_batch(recorder: Recorder, capture: BatchCapture, held: HeldBatch,
                      loss_fn: Callable[[Any], torch.Tensor] | None = None,
                      expected: NanEvent | None = None) -> Trace:
    """Re-run ``held`` under the op tracer; the model, RNG states and the recorder's own
    recording are left as they were. ``expected``: the event recorded for this batch (None:
    the recorder's first forward event of the batch, if any), which the replay checks for."""
    if expected is None:
        expected = next((e for e in recorder.events if e.batch == held.batch
                         and not e.is_backward and e.origin != "peer"), None)
    structure = capture.slots.structure_changes()
    if structure:
        raise ReplayError(f"cannot replay batch {held.batch}: the model is not the one this watch "
                          f"hooked ({'; '.join(structure)}), so a replay would run a different "
                          "model. Close the watch and watch the model again")
    return _Replay(recorder, capture, held, loss_fn, expected).run()


class _Replay:
    """One trace-mode run of a held batch; restores everything in ``finally``."""

    def __init__(self, recorder: Recorder, capture: BatchCapture, held: HeldBatch,
                 loss_fn: Callable[[Any], torch.Tensor] | None, expected: NanEvent | None) -> None:
        self.recorder = recorder
        self.capture = capture
        self.held = held
        self.loss_fn = loss_fn
        self.expected = expected

    def _weight_status(self) -> tuple[list[str], list[str], list[str], bool]:
        """(what differs from when the batch started, in words; the parameters and buffers
        changed since; buffers updated by the batch itself; whether a snapshot is replayed)."""
        slots = self.capture.slots
        first, last = self.held.forwards[0], self.held.forwards[-1]
        current = slots.read()
        layout_now = layouts_of(current)
        changes: list[str] = []
        changed: list[str] = []
        updated: list[str] = []
        snapshot = first.snapshot
        end_versions = dict(zip(slots.buffer_positions, last.end_buffer_versions or []))
        for i, tensor in enumerate(current):
            name = slots.names[i]
            then = first.weights[i] if i < len(first.weights) else None
            (pointer_then, dtype_then) = first.weight_layout[i] if i < len(first.weight_layout) \
                else (-1, None)
            pointer_now, dtype_now = layout_now[i]
            if tensor is None or then is None:
                if tensor is not then:
                    changes.append(f"{name}: {'removed' if tensor is None else 'added'}")
                    changed.append(name)
                continue
            if dtype_then is not None and dtype_now != dtype_then:
                changes.append(f"{name}: dtype {_dtype(dtype_then)} -> {_dtype(dtype_now)} "
                               "(the replay runs the current dtype)")
                changed.append(name)
                continue
            if tensor is not then or pointer_now != pointer_then:
                how = "replaced by another tensor" if tensor is not then else \
                    "its data swapped (p.data = ... or a device move)"
                changes.append(f"{name}: {how} since the batch ran")
                changed.append(name)
                continue
            if snapshot is not None or version_of(tensor) == first.weight_versions[i]:
                continue
            if end_versions.get(i) == version_of(tensor):
                updated.append(name)
            else:
                changed.append(name)
                if snapshot is None:
                    changes.append(f"{name}: values changed since the batch ran (optimizer step "
                                   "or in-place write); the replay used the current values")
        changed = _with_running_stats(changed, slots)
        return changes, changed, _with_running_stats(updated, slots), snapshot is not None

    def run(self) -> Trace:
        started = time.perf_counter()
        slots, held = self.capture.slots, self.held
        changes, changed, updated, snapshot_used = self._weight_status()
        root = self.recorder.model
        names = {id(m): (name, type(m).__name__) for name, m in root.named_modules()}
        infos = {id(info.module): info for info in self.recorder.modules}
        recorder = OpRecorder(infos, held.batch, self.recorder.rank, names)
        saved_cpu_rng = torch.get_rng_state()
        saved_cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        saved_training = [m.training for m in slots.modules]
        handles: list[Any] = []
        shadows: Shadows | None = None
        loss_value: float | None = None
        try:
            with self.recorder.suspend():
                shadows = recorder.shadows = Shadows()
                shadows.install(slots, held.forwards[0].snapshot or slots.read())
                for module in {id(m): m for m in root.modules()}.values():
                    handles.append(module.register_forward_pre_hook(recorder.pre_hook, with_kwargs=True))
                    handles.append(module.register_forward_hook(recorder.post_hook, with_kwargs=True,
                                                                always_call=True))
                for capture in held.forwards:
                    try:
                        loss_value = self._run_forward(root, capture, recorder)
                    except Exception as error:
                        if not changes or isinstance(error, ReplayError):
                            raise
                        raise ReplayError(
                            f"replaying batch {held.batch} failed ({type(error).__name__}: "
                            f"{error}); the model changed since the batch ran: "
                            f"{'; '.join(changes[:4])}") from error
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
            {name: dtype for name, dtype in OPS_DTYPES.items() if dtype != "object"})
        born = recorder.first_born
        earlier = None  # an Inf some op held before the first born value (e.g. a -inf mask)
        if recorder.first_inf is not None and (born is None or recorder.first_inf < born[0]):
            earlier = ops.iloc[recorder.first_inf]
        found = first_event(recorder.frames, Detector(self.recorder.inf_allowed))
        return Trace(batch=held.batch, frames=frames_to_dataframe(recorder.frames), ops=ops,
                     first_bad=ops.iloc[born[0]] if born is not None else None,
                     first_bad_tensors=pd.DataFrame(born[1] if born is not None else [],
                                                    columns=TENSOR_COLUMNS),
                     earlier_inf=earlier,
                     weights_changed=bool(changed), changed_weights=changed,
                     buffers_updated=updated, snapshot_used=snapshot_used, loss=loss_value,
                     forwards=len(held.forwards), seconds=time.perf_counter() - started,
                     reproduced=_same_event(self.expected, found), changes=changes,
                     expected=self.expected.summary() if self.expected is not None else "",
                     found=found.summary() if found is not None else "")

    def _run_forward(self, root: nn.Module, capture: ForwardCapture, recorder: OpRecorder) -> float | None:
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
            stack.enter_context(OpTracer(recorder))
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


def _dtype(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "")


def _same_event(expected: NanEvent | None, found: NanEvent | None) -> bool:
    """Whether the replay met the recorded event again (or, with none recorded, none)."""
    if expected is None or found is None:
        return expected is None and found is None
    return (expected.module, expected.call, expected.origin, expected.role) == \
        (found.module, found.call, found.origin, found.role)


def _with_running_stats(names: list[str], slots: WeightSlots) -> list[str]:
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



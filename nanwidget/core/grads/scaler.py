"""AMP loss scaling: the steps a ``torch.amp.GradScaler`` skips on purpose are not events.

A float16 run multiplies its loss by a large scale before ``backward()``; when the gradients
overflow, the scaler's ``step()`` skips the optimizer step and ``update()`` lowers the scale.
That is how the scaler finds its scale (it starts at 65536 and overflows on purpose), so with
``grad_scaler=scaler``:

- a gradient event at the end of a backward pass (backward frames, or the sentinel's gradient
  check) is held until the scaler decides: when it skips the step, the event is dropped and the
  step is listed in ``w.scaler_skips`` (batch, scale before, scale after); when the scaler
  found the gradients finite, the held event is recorded and raised from ``optimizer.step()``,
  before the step applies. With one scaler for several optimizers, a step whose own gradients
  are finite while another optimizer's are not decides nothing (the scaler skips that other
  one); the step of an optimizer holding a non-finite gradient is an event;
- the loss is held as it goes through ``scaler.scale(loss)`` (the scaler instance's ``scale``
  and ``update`` are wrapped while the watch is open) and read once per step (before the
  optimizer steps, or at ``update()`` when the step was skipped; at the end of the backward
  pass when a gradient event needs it): a non-finite loss is an event, no overflow to skip;
- the ``scaler_patience``-th skipped step in a row is an event too (the scale keeps falling:
  the gradients stayed non-finite at every scale it tried), raised from ``scaler.update()``.

A forward event is an event as ever: the scale only multiplies the loss. A skipped step is
told by the scale: ``update()`` lowers it exactly when the step was skipped (a fused optimizer
is called even then, and skips inside its kernel). Cost: one host read of the scale per
``update()`` and one of the loss per step (single numbers; free on CPU); the scaler's
``found_inf`` and, at a step the scaler takes, whether the gradients are finite (one read per
device) only while a gradient event is held.

Keras' ``LossScaleOptimizer`` (the optimizer of a Keras model compiled under the
``mixed_float16`` policy, on the torch backend) does the same in two calls of its own: the loss
goes through ``scale_loss(loss)``, and ``apply(grads, ...)`` either takes the step or skips it,
halving its ``dynamic_scale``. It is watched the same way (told by those methods, see
``options.is_loss_scale_optimizer``; nothing of Keras is imported): its ``scale_loss`` and
``apply`` are wrapped; a held gradient event is recorded before an
``apply()`` whose gradients are all finite (it takes that step), and after ``apply()`` a fallen
scale is a skipped step (one host read of the scale per step).

Without ``grad_scaler``, :class:`ScalerHint` adds to an Inf gradient event of a float16 run, or
of a run with a GradScaler in the caller's frames, how to tell the watch about the scaler.
"""

from __future__ import annotations

import copy
import os
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..detect import event_kind
from ..events import LOSS_ROLE, PASS_THE_SCALER, SCALER_IN_THE_LOOP, NanEvent, ScalerSkip
from ..graph_capture import run_eagerly_under_dynamo
from ..options import is_loss_scale_optimizer
from ..recorder import Feature, Finding, Recorder
from ..stats import measure_tensor
from ..writes import wraps_an_optimizer

__all__ = ["ScalerWatch", "ScalerHint", "SkipRun", "skips_summary", "scaling_enabled",
           "PASS_THE_SCALER"]

_SKIPS_KEPT = 10_000
_STACK_DEPTH = 40  # caller frames searched for a GradScaler
# Library code (installed packages, torch, nanwidget): its variable names are not the user's.
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (
    torch.__file__, os.path.dirname(os.path.dirname(__file__))))


def scaling_enabled(scaler: Any) -> bool:
    """Whether ``scaler`` scales the loss now: an enabled GradScaler, or an optimizer that
    scales its loss itself (always)."""
    return is_loss_scale_optimizer(scaler) or scaler.is_enabled()


def skips_summary(skips: list[ScalerSkip], scaler: str = "GradScaler") -> str:
    """One line on the steps a GradScaler (or the loss scaler named ``scaler``) skipped ("" when
    none)."""
    if not skips:
        return ""
    first, last = skips[0], skips[-1]
    batches = f"batch {first.batch}" if len(skips) == 1 else \
        f"batches {first.batch}–{last.batch}"
    steps = "step" if len(skips) == 1 else "steps"
    return (f"{scaler} skipped {len(skips)} {steps} on overflow ({batches}; scale "
            f"{first.scale_before:.10g} → {last.scale_after:.10g}): not events")


class SkipRun(NamedTuple):
    """The steps a GradScaler skipped in a row, up to the event the ``scaler_patience``-th
    of them made: what the diagnosis of that event says in numbers."""

    first_batch: int
    last_batch: int
    skipped: int
    scale_first: float  # the scale the first skipped step ran at
    scale_last: float  # the scale the last one ran at
    scale_now: float  # after the last one
    scale_at_watch: float | None  # when the watch began
    steps_before: int  # optimizer steps the scaler took since the watch began, before the run
    loss: float | None  # |loss| of the last skipped step (finite), when it was read
    scaler: str = "GradScaler"  # what skipped them, as users know it
    scales_own_loss: bool = False  # an optimizer scaling its loss itself (Keras'), no GradScaler


def _non_finite(tensor: torch.Tensor | None) -> str | None:
    """"nan", "inf" or "nan+inf" when ``tensor`` holds such values, else None (a host read)."""
    if tensor is None or not (tensor.is_floating_point() or tensor.is_complex()) \
            or not tensor.numel():
        return None
    stats = measure_tensor(tensor)
    return event_kind(stats.nan, stats.inf) if stats.nan or stats.inf else None


class ScalerWatch(Feature):
    """Watches one GradScaler, or one optimizer that scales its loss itself (Keras'
    ``LossScaleOptimizer``), for a watch (see the module docstring).

    ``detail``: turns a held gradient event into the event to record, with the frames its
    replay made (the sentinel replays a gradient event only once it is one); None: recorded as
    held.
    """

    reviews_without_event = False  # its review only adds to an event

    def __init__(self, recorder: Recorder, scaler: Any, *, patience: int,
                 detail: Callable[[NanEvent], Finding] | None = None) -> None:
        self.recorder = recorder
        self.scaler = scaler
        # An optimizer that scales its loss itself (scale_loss / apply), not a GradScaler.
        self.scales_own_loss = is_loss_scale_optimizer(scaler)
        #: What the skipped steps are told to have been skipped by.
        self.label = type(scaler).__name__ if self.scales_own_loss else "GradScaler"
        self._scale_call = "optimizer.scale_loss()" if self.scales_own_loss \
            else "grad_scaler.scale()"
        self.patience = patience
        self.detail = detail
        self.skips: list[ScalerSkip] = []
        self.skips_dropped = 0
        self.in_a_row = 0  # skipped steps since the last step the optimizer took
        self.steps_taken = 0  # steps the optimizer took with the scaler since the watch began
        self._run_start: tuple[int, float] | None = None  # (batch, scale) of the run's first skip
        self._deciding: SkipRun | None = None  # while the patience event is recorded
        self._loss_abs: float | None = None  # the last loss read, when finite
        # The loss of the running step, as it went through scale(); read once (_loss_kind).
        self._loss: torch.Tensor | None = None
        self._loss_batch: int | None = None
        self._loss_read: str | None = None  # its verdict once read: "nan", "inf"... or None
        self._last_batch = recorder.batch
        self._held: NanEvent | None = None  # a gradient event waiting for the scaler
        # The scale after the last update() (a skipped step lowers it): one host read per
        # step, at update(), where the scaler is done with the step.
        self._scale_now = self._get_scale() if self._enabled() else None
        self._scale_at_watch = self._scale_now
        # The scaler instance's own scale/update while watched (the class's stay untouched);
        # what the instance held itself before (another wrapper) is put back on close. The
        # wrappers and the optimizer hook reach this watch weakly: a watch dropped unclosed is
        # collected, and then lets go of the scaler and the hook (the finalizer).
        me = weakref.ref(self)
        names = ("scale_loss", "apply") if self.scales_own_loss else ("scale", "update")
        self._wrapped: dict[str, Any] = {name: scaler.__dict__.get(name, _ABSENT)
                                         for name in names}
        self._wrappers = {name: _ScalerMethod(me, scaler, name, self._wrapped[name])
                          for name in names}
        for name, wrapper in self._wrappers.items():
            setattr(scaler, name, wrapper)
        # A loss-scale optimizer decides in its own apply(): no torch optimizer step to watch.
        # A compiled train step may call the optimizer: Dynamo runs the hook as plain Python.
        pre_step = None if self.scales_own_loss else register_optimizer_step_pre_hook(
            run_eagerly_under_dynamo(_weakly(me, "_before_step", _nothing)))
        self._let_go = weakref.finalize(self, _let_go, scaler, self._wrapped, self._wrappers,
                                        pre_step)

    # ------------------------------------------------------------------ the scaler's calls
    def _original(self, name: str) -> Any:
        return _original(self.scaler, self._wrapped, name)

    def _enabled(self) -> bool:
        return self.scales_own_loss or self.scaler.is_enabled()

    def _get_scale(self) -> float:
        """The loss scale now (a host read)."""
        if not self.scales_own_loss:
            return self.scaler.get_scale()
        scale = getattr(self.scaler, "dynamic_scale", None)  # made when it is built
        return float(self.scaler.initial_scale if scale is None else scale)

    def _scale(self, outputs: Any) -> Any:
        return self._hold_loss(outputs, self._original("scale")(outputs))

    def _scale_loss(self, loss: Any) -> Any:
        return self._hold_loss(loss, self._original("scale_loss")(loss))

    def _hold_loss(self, outputs: Any, scaled: Any) -> Any:
        if isinstance(outputs, torch.Tensor) and not self.recorder.closed:
            self._loss = outputs.detach()  # read once: at a gradient event, the step or update()
            self._loss_batch = self._last_batch
            self._loss_read = None
        return scaled

    def _loss_kind(self) -> str | None:
        """"nan", "inf" or "nan+inf" when the step's loss is non-finite, else None (one host
        read per step, at the first asking)."""
        if self._loss is not None:
            self._loss_read, self._loss_abs = _read_loss(self._loss)
            self._loss = None
        return self._loss_read

    def overflow_possible(self, batch: int) -> bool:
        """Whether a gradient event of ``batch`` may be an overflow the scaler skips (it scales,
        and the loss it scaled is finite): the sentinel then replays it only once it is one."""
        return self._enabled() and not (self._loss_batch == batch
                                        and self._loss_kind() is not None)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """An optimizer is about to step, called by the scaler (or directly). A non-finite loss
        is no overflow: an event, raised before the step applies. So is a held gradient event
        when the scaler found the gradients finite: a fused optimizer is called even when the
        scaler skips, handed its ``found_inf`` to skip by itself, so that flag is read (only
        with an event held)."""
        if self.recorder.closed or wraps_an_optimizer(optimizer):
            return  # a wrapper's step (accelerate's) hands over to the scaler: not yet
        batch = self._loss_batch if self._loss_batch is not None else self._last_batch
        event = self._loss_event(batch, self._held)
        if event is None and self._held is not None:
            # The scaler hands a fused optimizer its verdict as optimizer.found_inf (or, the
            # older way, itself as the grad_scaler keyword): the step then skips by itself.
            found_inf = getattr(optimizer, "found_inf", None)
            if isinstance(found_inf, torch.Tensor) and bool(found_inf.sum() > 0):
                return  # skipped inside the kernel: update() lists the skip
            if (kwargs or {}).get("grad_scaler") is not None:
                return  # the optimizer asks the scaler itself: update() tells
            stepped_bad = self._steps_a_bad_gradient(optimizer)
            if stepped_bad is None:
                return  # finite gradients here: the bad ones are another optimizer's to skip
            event = self._held
            event.note = _joined(event.note, f"the {self.label} did not skip this step" + (
                ": this optimizer was about to step with non-finite gradients (step it with "
                "scaler.step(optimizer), which skips such a step)" if stepped_bad else ""))
        if event is not None:
            self._held = None
            self._record(event.batch, event)

    def _steps_a_bad_gradient(self, optimizer: Any) -> bool | None:
        """Whether a step of ``optimizer`` with a gradient event held is the step the scaler
        should have skipped: True when it holds a non-finite gradient; False when no gradient
        of the model or the optimizer is non-finite (the Inf reached no parameter, so the
        scaler skips no step); None when only other parameters hold them (one GradScaler for
        several optimizers: it skips their steps, not this one, and update() tells). One host
        read per device, only while an event is held."""
        try:
            own = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
            bad = _with_non_finite_grads([*own, *self.recorder.model.parameters()])
        except Exception as error:  # gradients it cannot read: the event stands, as before
            self.recorder.internal_error(error)
            return False
        if any(id(p) in bad for p in own):
            return True
        return None if bad else False

    def _apply(self, grads: Any, *args: Any, **kwargs: Any) -> Any:
        """A loss-scale optimizer's step and scale update in one: it skips the step (halving
        its scale) when a gradient it is handed is not finite. A non-finite loss, or a held
        gradient event while the gradients it steps with are all finite, is an event raised
        before the step applies (one read of those gradients, only with an event held)."""
        if not self.recorder.closed:
            batch = self._loss_batch if self._loss_batch is not None else self._last_batch
            event = self._loss_event(batch, self._held)
            if event is None and self._held is not None and _all_finite(grads):
                event = self._held
                event.note = _joined(event.note, f"the {self.label} did not skip this step: "
                                                 "the gradients it steps with are finite")
            if event is not None:
                self._held = None
                self._record(event.batch, event)
        result = self._original("apply")(grads, *args, **kwargs)
        if not self.recorder.closed:
            self._scale_updated(None)
        return result

    def _update(self, new_scale: Any = None) -> Any:
        result = self._original("update")(new_scale)
        if not self.recorder.closed and self._enabled():
            self._scale_updated(new_scale)
        return result

    def _scale_updated(self, new_scale: Any) -> None:
        """The scaler updated its scale after a step (``new_scale``: the one the user set):
        a fallen scale is a skipped step (listed; the ``scaler_patience``-th in a row is an
        event), else the step was taken, with a held event an event all the same."""
        before, after = self._scale_now, self._get_scale()
        self._scale_now = after
        batch = self._loss_batch if self._loss_batch is not None else self._last_batch
        held, self._held = self._held, None
        if new_scale is not None or before is None or after >= before:
            self.in_a_row = 0  # the step was taken (or the user set the scale)
            self.steps_taken += 1
            event = self._loss_event(batch, held) or held
            self._step_over()
            if event is not None:  # the step was taken with it: an event all the same
                self._record(event.batch, event)
            return
        if len(self.skips) < _SKIPS_KEPT:
            self.skips.append(ScalerSkip(batch, before, after))
        else:
            self.skips_dropped += 1
        self.in_a_row += 1
        if self.in_a_row == 1:
            self._run_start = (batch, before)
        event = self._loss_event(batch, held)
        if event is None and self.in_a_row % self.patience == 0:
            event = self._patience_event(batch, held, after)
            start_batch, start_scale = self._run_start or (batch, before)
            self._deciding = SkipRun(start_batch, batch, self.in_a_row, start_scale, before,
                                     after, self._scale_at_watch, self.steps_taken,
                                     self._loss_abs, self.label, self.scales_own_loss)
        self._step_over()
        if event is not None:
            try:
                self._record(event.batch, event)
            finally:
                self._deciding = None

    def patience_run(self, event: NanEvent) -> SkipRun | None:
        """The skipped steps behind ``event`` when it is the event of the
        ``scaler_patience``-th skip in a row (asked while it is recorded), else None."""
        run = self._deciding
        return run if run is not None and event.is_backward and event.batch == run.last_batch \
            else None

    def _step_over(self) -> None:
        self._loss = self._loss_batch = self._loss_read = self._loss_abs = None

    # ------------------------------------------------------------------ Feature
    def on_batch_start(self, batch: int, args: tuple, kwargs: dict) -> None:
        self._last_batch = batch

    def review_event(self, batch: int, event: NanEvent | None, reason: str) -> NanEvent | None:
        if reason != "backward" or event is None or not event.is_backward \
                or not self._enabled():
            return event
        kind = self._loss_kind() if self._loss_batch == event.batch else None
        if kind is not None:  # a non-finite loss is no overflow: the event stands
            self._loss_read = None  # said here, not again at the step
            event.note = _joined(event.note, _loss_words(kind, self._scale_call))
            return event
        self._held = event  # the scaler decides at its step: skipped, or an event
        return None

    def close(self) -> None:
        self._let_go()
        self._held = None
        self._step_over()

    # ------------------------------------------------------------------ events
    def _record(self, batch: int, event: NanEvent) -> None:
        finding = Finding(event)
        if self.detail is not None and event.is_backward:
            try:
                finding = self.detail(event)
            except Exception as error:  # the event stands without its detail
                self.recorder.internal_error(error)
                finding = Finding(event)
            if finding.event is None:
                finding.event = event
            elif finding.event is not event:
                finding.event.note = _joined(finding.event.note, event.note)
        self.recorder.conclude(batch, finding, reason="grad_scaler", raising=True)

    def _loss_event(self, batch: int, held: NanEvent | None) -> NanEvent | None:
        """The event of a non-finite loss (read now, once), or None."""
        kind = self._loss_kind()
        if kind is None:
            return None
        self._loss_read = None  # one event per loss
        if held is not None:
            held.note = _joined(held.note, _loss_words(kind, self._scale_call))
            return held
        if any(e.batch == batch and not e.is_backward for e in self.recorder.events):
            return None  # the forward's own event said it already
        root = self.recorder.modules[0]
        return NanEvent(batch=batch, module=root.name, module_type=root.type_name, call=0,
                        role=LOSS_ROLE, kind=kind, origin="output", rank=self.recorder.rank,
                        note=_loss_words(kind, self._scale_call))

    def _patience_event(self, batch: int, held: NanEvent | None, after: float) -> NanEvent:
        words = (f"the {self.label} skipped {self.in_a_row} steps in a row (scale now {after:g}): "
                 "the gradients stayed non-finite at every scale it tried")
        if held is not None:
            held.note = _joined(held.note, words)
            return held
        name, kind = self._first_bad_gradient()
        # A container never called (Keras' ParameterDict) is no call: the module around it is.
        info, role = self.recorder.parameter_owner(name)
        module = info.name if info is not None else name.rpartition(".")[0]
        return NanEvent(batch=batch, module=module,
                        module_type=info.type_name if info is not None else "", call=0,
                        role=role, kind=kind, origin="grad", is_backward=True,
                        rank=self.recorder.rank, note=words)

    def _first_bad_gradient(self) -> tuple[str, str]:
        """(parameter name, kind) of the first non-finite gradient (event time only)."""
        for name, parameter in self.recorder.model.named_parameters():
            kind = _non_finite(parameter.grad)
            if kind is not None:
                return name, kind
        return "", "inf"


def _with_non_finite_grads(parameters: list[Any]) -> set[int]:
    """The ids of the parameters whose gradient holds a NaN or Inf (one host read per device:
    event time only)."""
    by_device: dict[torch.device, dict[int, torch.Tensor]] = {}
    for parameter in parameters:
        grad = getattr(parameter, "grad", None)
        if not isinstance(grad, torch.Tensor) or not (grad.is_floating_point()
                                                      or grad.is_complex()):
            continue
        if grad.layout != torch.strided:  # a sparse gradient: its stored values
            grad = grad.coalesce().values() if grad.is_sparse else grad.to_dense()
        by_device.setdefault(grad.device, {})[id(parameter)] = grad
    bad: set[int] = set()
    with torch.no_grad():
        for grads in by_device.values():
            flags = torch.stack([~torch.isfinite(g).all() for g in grads.values()]).tolist()
            bad.update(key for key, flag in zip(grads, flags) if flag)
    return bad


def _all_finite(grads: Any) -> bool:
    """Whether every gradient tensor in ``grads`` (a list or tuple; None entries skipped) is
    finite (one host read: event time only)."""
    if not isinstance(grads, (list, tuple)):
        return True
    tensors = [g for g in grads if isinstance(g, torch.Tensor)
               and (g.is_floating_point() or g.is_complex()) and g.numel()]
    if not tensors:
        return True
    with torch.no_grad():
        device = tensors[0].device
        flags = torch.stack([torch.isfinite(g).all().to(device) for g in tensors])
        return bool(flags.all())


def _read_loss(loss: torch.Tensor) -> tuple[str | None, float | None]:
    """("nan", "inf", "nan+inf" or None; its abs max when finite) of the loss (a host read)."""
    if not (loss.is_floating_point() or loss.is_complex()) or not loss.numel():
        return None, None
    stats = measure_tensor(loss)
    if stats.nan or stats.inf:
        return event_kind(stats.nan, stats.inf), None
    return None, float(stats.abs_max)


def _original(scaler: Any, wrapped: dict[str, Any], name: str) -> Any:
    """The scaler's own method ``name``: what the instance held before, or its class's."""
    own = wrapped[name]
    if own is not _ABSENT:
        return own
    return getattr(type(scaler), name).__get__(scaler)


class _ScalerMethod:
    """The watch's ``scale`` or ``update`` on the scaler instance: the watch's method while the
    watch lives, else the scaler's own. A copy of the scaler (``copy.deepcopy``, an EMA or
    checkpoint helper, ``pickle``) gets the scaler's own method back, bound to the copy, as it
    would have had without the watch: a copy never acts on the watched scaler, and pickles."""

    __slots__ = ("feature", "scaler", "name", "own")

    def __init__(self, feature: weakref.ref, scaler: Any, name: str, own: Any) -> None:
        self.feature, self.scaler, self.name, self.own = feature, scaler, name, own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        alive = self.feature()
        if alive is None:
            return _original(self.scaler, {self.name: self.own}, self.name)(*args, **kwargs)
        return getattr(alive, f"_{self.name}")(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        if self.own is not _ABSENT:  # what the instance held itself before the watch
            return copy.deepcopy(self.own, memo)
        twin = memo.get(id(self.scaler), self.scaler)  # the scaler being copied, made already
        return types.MethodType(getattr(type(twin), self.name), twin)

    def __reduce__(self) -> tuple:
        if self.own is not _ABSENT:
            return _same, (self.own,)
        # Unpickled while the scaler's own state is: the class's method, bound to the new one.
        return getattr, (self.scaler, self.name)


def _same(value: Any) -> Any:
    return value


def _weakly(feature: weakref.ref, method: str, fallback: Any) -> Callable[..., Any]:
    """Calls ``feature``'s ``method`` while it lives, else ``fallback``."""
    def call(*args: Any, **kwargs: Any) -> Any:
        alive = feature()
        if alive is None:
            return fallback(*args, **kwargs)
        return getattr(alive, method)(*args, **kwargs)
    return call


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _let_go(scaler: Any, wrapped: dict[str, Any], wrappers: dict[str, Any],
            pre_step: Any | None) -> None:
    """Remove the optimizer hook; put back the scaler's own methods where ours still sit (one
    set on top of ours since stays: it calls ours, which then passes every call through)."""
    if pre_step is not None:
        pre_step.remove()
    for name, own in wrapped.items():
        if scaler.__dict__.get(name) is wrappers[name]:
            if own is _ABSENT:
                del scaler.__dict__[name]
            else:
                scaler.__dict__[name] = own


def _loss_words(kind: str, scale_call: str) -> str:
    return f"the loss handed to {scale_call} is {kind}: no overflow the scaler can skip"


def _joined(note: str, words: str) -> str:
    return f"{note}; {words}" if note else words


class _Absent:
    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return "<absent>"


_ABSENT = _Absent()


class ScalerHint(Feature):
    """Without ``grad_scaler``: an Inf gradient event of a float16 run, or of a run with a
    GradScaler among the caller's variables, says how to pass the scaler to the watch."""

    reviews_without_event = False  # its review only adds to an event

    def review_event(self, batch: int, event: NanEvent | None, reason: str) -> NanEvent | None:
        if event is None or not event.is_backward or "inf" not in event.kind \
                or PASS_THE_SCALER.split(":")[0] in event.note:
            return event
        holder = _scaler_in_callers()
        if holder:
            # Named as the loop calls it: grad_scaler=fabric, grad_scaler=accelerator
            event.note = _joined(event.note, SCALER_IN_THE_LOOP + PASS_THE_SCALER.replace(
                "grad_scaler=scaler", f"grad_scaler={holder}"))
        elif event.ran_in("float16"):
            event.note = _joined(event.note, PASS_THE_SCALER)
        return event


def _enabled_scaler(value: Any) -> bool:
    return isinstance(value, torch.amp.GradScaler) and value.is_enabled()


def _holds_enabled_scaler(value: Any) -> bool:
    """An enabled GradScaler, or an object holding one as its own ``scaler`` attribute
    (accelerate's Accelerator, Lightning's precision plugins) or ``_scaler`` (timm's
    NativeScaler), or holding such a plugin as ``_precision`` (Lightning's Fabric); read
    without calling anything."""
    if _enabled_scaler(value):
        return True
    own = vars(value) if hasattr(value, "__dict__") else {}
    if _enabled_scaler(own.get("scaler")) or _enabled_scaler(own.get("_scaler")):
        return True
    plugin = own.get("_precision")
    plugin_own = vars(plugin) if hasattr(plugin, "__dict__") else {}
    return _enabled_scaler(plugin_own.get("scaler"))


def _scaler_in_callers() -> str:
    """The name to pass as ``grad_scaler=`` when a frame on the stack holds an enabled
    GradScaler (or an object holding one, see :func:`_holds_enabled_scaler`): that variable's
    name in the innermost frame of the user's code that holds it (the loop's "fabric",
    "accelerator", "scaler"), "scaler" when only library code holds it (a plugin's ``self``);
    "" when none does."""
    frame = sys._getframe(1)
    found = ""
    for _ in range(_STACK_DEPTH):
        if frame is None:
            break
        filename = frame.f_code.co_filename  # "<ipython-input-...>": a notebook cell's
        path = os.path.abspath(filename)
        library = filename.startswith("<frozen") or path.startswith(_LIBRARY_DIRS) \
            or any(part in path for part in _INSTALLED)
        for name, value in list(frame.f_locals.items()):
            try:
                if not _holds_enabled_scaler(value):
                    continue
            except Exception:  # an odd object: not a scaler
                continue
            if library or not name.isidentifier() or name == "self":
                found = "scaler"
            else:
                return name
        frame = frame.f_back
    return found

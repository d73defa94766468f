"""nanwidget for fastai: ``learn.fit(..., cbs=NanWatchCallback())``.

    from nanwidget.integrations.fastai import NanWatchCallback
    learn = tabular_learner(dls, cbs=NanWatchCallback())   # or learn.fit(1, cbs=...)

At ``before_fit`` the callback watches ``learn.model``. Every training batch and every
validation batch is one watch batch, numbered in the order they run (``callback.batches()``:
``phase`` "train" with the optimizer step it feeds, counted from 1, or "eval" with the steps done
and the validation batch's index). The loss is checked at ``after_loss`` (a NaN made by the loss
function, outside any module, is caught there) and the gradient norms just before each optimizer
step (``before_step``, after ``MixedPrecision`` unscaled them). At a finding the step is skipped
(fastai's ``CancelStepException``) and the fit ends after that batch (``CancelFitException``);
validation is checked at ``after_validate``.

fastai's own ``Optimizer`` (the default of every ``Learner``) is not a ``torch.optim.Optimizer``
and writes through ``p.data``: torch tells nobody of its steps. The callback tells the watch
after each step the optimizer took (:func:`nanwidget.core.writes.note_optimizer_step`), so the
frames of the next batch (validation included) show the new weights and a step with a NaN/Inf
learning rate is named as such. ``to_fp16()``'s ``MixedPrecision`` makes its ``GradScaler`` in
its own ``before_fit`` and drops it at ``after_fit``: this callback runs after it
(``order``) and passes ``learn.scaler`` as ``grad_scaler=``, so a step the scaler skips on
overflow stops nothing.

The hooks come off at ``after_fit``, when fastai takes the callback off the learner at the end
of a ``fit(cbs=...)`` (also when the fit raised: fastai runs no ``after_fit`` then), at the next
``before_fit`` (a callback given to ``Learner(cbs=...)`` whose fit raised) and at ``close()``.
When an error ends a ``fit(cbs=...)`` (a loss check that raises on a NaN loss) after the watch
found a NaN/Inf that no stop reported yet, one warning names it first, with its diagnosis.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from fastai.callback.core import Callback, CancelFitException, CancelStepException
from fastai.callback.fp16 import MixedPrecision

from nanwidget import AbortAfterBatch, NanWatch
from nanwidget.core.writes import note_optimizer_step

from .step_guard import (GuardedCallback, StepGuard, TrainingStop, check_callback_options,
                         recording_dir)

__all__ = ["NanWatchCallback"]


class NanWatchCallback(GuardedCallback, Callback):
    """Watch a fastai ``Learner``'s model for NaN/Inf during ``fit``.

    ``on_nan``: ``"stop"`` (default: skip the step with the finding and end the fit after that
    batch; the callback holds the event), ``"raise"`` (the same, raising
    :class:`nanwidget.NanDetected` out of ``fit``), ``"warn"`` or ``"record"`` (training goes on
    as without the callback). ``log_dir``: where the recording goes (default
    ``<learn.path>/nanwidget/run-N``; ``False``: none). Every other keyword goes to
    :func:`nanwidget.watch` (``backward``, ``mode``, ``grad_norm_warn``, ...).
    """

    # After MixedPrecision (order 10): its before_fit makes the GradScaler this one passes on.
    order = MixedPrecision.order + 1

    def __init__(self, *, on_nan: str = "stop", log_dir: str | os.PathLike | bool | None = None,
                 **watch_options: Any) -> None:
        check_callback_options(on_nan, watch_options, log_dir)
        self.on_nan = on_nan
        self.log_dir = log_dir
        self.abort_after = watch_options.pop("abort_after", None)
        self.watch_options = watch_options
        self.watch: NanWatch | None = None
        self.stop: TrainingStop | None = None
        self._guard: StepGuard | None = None
        self._next_batch = 0
        self._current_batch: int | None = None
        self._step_cancelled = False
        self._eval_index = 0

    _UNWATCHED = "nanwidget: the callback has not watched a fit yet"

    def __setattr__(self, name: str, value: Any) -> None:
        # fastai takes a fit(cbs=...) callback off with cb.learn = None, also when fit raised
        # (no after_fit then): the hooks come off with it.
        if name == "learn" and value is None and self._guard is not None:
            # Set in fit's `finally`: the error ending the fit is the one being handled.
            error = sys.exc_info()[1]
            if error is not None and self._active() and self.stop is None:
                self._guard.report_on_error(error)
            self.close()
        super().__setattr__(name, value)

    def _active(self) -> bool:
        return self._guard is not None and not self._guard.closed

    # ------------------------------------------------------------------ attaching
    def before_fit(self) -> None:
        self.close()
        learn = self.learn
        options = dict(self.watch_options)
        scaler = getattr(learn, "scaler", None)  # to_fp16(): made by MixedPrecision.before_fit
        if scaler is not None and "grad_scaler" not in options:
            options["grad_scaler"] = scaler
        self.stop = None
        self._next_batch = 0
        self._current_batch = None
        self._guard = StepGuard(learn.model, on_nan=self.on_nan,
                                log_dir=recording_dir(self.log_dir, learn.path),
                                watch_options=options, owner=self)
        self.watch = self._guard.watch

    def after_fit(self) -> None:
        self.close()

    def after_cancel_fit(self) -> None:
        self.close()

    # ------------------------------------------------------------------ batches
    def before_batch(self) -> None:
        if not self._active():
            return
        self._step_cancelled = False
        steps_done = self.learn.train_iter
        if self.learn.training:
            phase, step, index = "train", steps_done + 1, 0
        else:
            phase, step, index = "eval", steps_done, self._eval_index
            self._eval_index += 1
        batch = self._next_batch
        self._next_batch += 1
        self._current_batch = batch
        self.watch.set_batch(batch)  # also checks what the previous batch left
        self._guard.batches.note(batch, phase, step, index)

    def after_loss(self) -> None:
        if not self._active() or self._current_batch is None:
            return
        self.watch.set_batch(self._current_batch)  # check this batch's frames now
        loss = getattr(self.learn, "loss_grad", None)
        if self.learn.training and isinstance(loss, torch.Tensor):
            self._guard.note_loss(loss, self._current_batch)

    def before_step(self) -> None:
        guard = self._guard
        if not self._active():
            return
        self.watch.set_batch(self._current_batch)  # backward frames, with backward=True
        self._check_abort()
        found = guard.findings(check_grads=True)
        if not guard.stops or self.stop is not None:
            return
        decision = guard.agree(found)
        if decision:
            self._stop(guard.make_stop(self.learn.train_iter + 1, "train", found, decision),
                       decision)
            raise CancelStepException()  # the step with the finding changes nothing

    def after_cancel_step(self) -> None:
        self._step_cancelled = True

    def after_step(self) -> None:
        if self._active() and not self._step_cancelled:
            # fastai's Optimizer is no torch optimizer: tell the watch its step wrote the
            # weights (OptimWrapper's torch optimizer is seen by torch's own step hook).
            opt = self.learn.opt
            note_optimizer_step(getattr(opt, "opt", opt))

    def after_batch(self) -> None:
        if self._active():
            self._check_abort()
        if self.stop is not None and self.stop.phase == "train":
            raise CancelFitException()

    # ------------------------------------------------------------------ validation
    def before_validate(self) -> None:
        self._eval_index = 0

    def after_validate(self) -> None:
        guard = self._guard
        if not self._active():
            return
        if self._current_batch is not None:
            self.watch.set_batch(self._current_batch)
        found = guard.findings(check_grads=False)
        if not guard.stops or self.stop is not None:
            return
        decision = guard.agree(found)
        if decision:
            self._stop(guard.make_stop(self.learn.train_iter, "eval", found, decision), decision)
            raise CancelFitException()

    # ------------------------------------------------------------------ helpers
    def _check_abort(self) -> None:
        if self.abort_after is not None and self._current_batch is not None \
                and self._current_batch >= self.abort_after:
            self.close()
            raise AbortAfterBatch(self.abort_after)

    def _stop(self, stop: TrainingStop, decision: list[dict[str, Any]]) -> None:
        self.stop = stop
        if self.on_nan == "raise":
            error = self._guard.exception_for(stop, decision)
            self.close()
            raise error

"""nanwidget for Lightning: ``Trainer(callbacks=[NanWatchCallback()])``.

    from nanwidget.integrations.lightning import NanWatchCallback
    trainer = lightning.pytorch.Trainer(callbacks=[NanWatchCallback(log_trends=True)])

At ``on_fit_start`` the callback watches the LightningModule itself (never the DDP wrapper the
strategy puts around it). Every training batch (micro-batch, with ``accumulate_grad_batches``)
and every validation batch is one watch batch, numbered in the order they run
(``callback.batches()`` says which step each one fed). The watch's frames of a batch are checked
when its loss comes back (``on_before_backward``, which also checks the loss itself: a NaN made
in ``training_step`` outside any module is caught there), and just before each optimizer step
(``on_before_optimizer_step``, where Lightning has already unscaled the gradients under AMP) the
gradient norms are checked. Lightning syncs ``trainer.should_stop`` across ranks only inside
``EarlyStopping``, so the callback agrees with the other ranks itself (one flag all-reduce per
step): at a finding on any rank, every rank drops the step's gradients, so the optimizer step
changes nothing, and sets ``trainer.should_stop`` at the same step; under manual optimization
the steps of the batch's other optimizers (a GAN's discriminator) change nothing either.
Validation is checked at ``on_validation_end``. ``log_trends=True`` logs the per-module abs-max
of the watched modules to ``trainer.loggers`` every ``trends_every`` steps. Early warnings (an output near its dtype's
largest value, or growing towards it; ``early_warning=False`` turns them off) go to
``trainer.loggers`` as metrics when they are made (``nanwidget/early_warnings``, the count, and
``nanwidget/early_warning/<module>/<reason>``, the abs max seen), at the end of the training
batch or of the validation that made them. The hooks come off at ``on_fit_end`` and at
``on_exception``; when an error ends the fit (a ``training_step`` that raises on a NaN loss, a
backward that fails) after the watch found a NaN/Inf that no stop reported yet, one warning
names it first, with its diagnosis.
"""

from __future__ import annotations

import fnmatch
import os
from typing import Any

import lightning.pytorch as pl
import torch

from nanwidget import AbortAfterBatch, NanWatch

from .step_guard import (GuardedCallback, StepGuard, TrainingStop, check_callback_options,
                         recording_dir, warning_metrics)

__all__ = ["NanWatchCallback"]


class NanWatchCallback(GuardedCallback, pl.Callback):
    """Watch a LightningModule for NaN/Inf and stop every rank at the same step.

    ``on_nan``: ``"stop"`` (default: drop the step's gradients and set ``trainer.should_stop``),
    ``"raise"`` (the same, then raise :class:`nanwidget.NanDetected` out of ``trainer.fit`` on
    every rank), ``"warn"`` or ``"record"`` (training goes on as without the callback).
    ``log_dir``: where the per-rank recordings go (default
    ``<default_root_dir>/nanwidget/run-N``; ``False``: none). ``log_trends``: log per-module
    abs-max to the trainer's loggers every ``trends_every`` optimizer steps, as
    ``nanwidget/abs_max/<module>``, for the modules matching ``trend_modules`` (fnmatch globs;
    default all; the root is ``<root>``). Every other keyword goes to :func:`nanwidget.watch`.
    Note that Lightning honours ``should_stop`` only once ``min_epochs`` / ``min_steps`` are met;
    until then the callback keeps dropping the gradients of every step with a finding.
    """

    def __init__(self, *, on_nan: str = "stop", log_dir: str | os.PathLike | bool | None = None,
                 log_trends: bool = False, trends_every: int = 50,
                 trend_modules: tuple[str, ...] | list[str] | None = None,
                 **watch_options: Any) -> None:
        check_callback_options(on_nan, watch_options, log_dir)
        if not isinstance(trends_every, int) or isinstance(trends_every, bool) or trends_every < 1:
            raise ValueError(f"trends_every must be a positive number of steps, got {trends_every!r}")
        self.on_nan = on_nan
        self.log_dir = log_dir
        self.log_trends = bool(log_trends)
        self.trends_every = trends_every
        self.trend_modules = tuple(trend_modules) if trend_modules is not None else None
        self.abort_after = watch_options.pop("abort_after", None)
        self.watch_options = watch_options
        self.watch: NanWatch | None = None
        self.stop: TrainingStop | None = None
        self._guard: StepGuard | None = None
        self._next_batch = 0
        self._current_batch: int | None = None
        self._stopped_batch: int | None = None  # the training batch whose step a stop dropped
        self._eval_index = 0
        self._trends_logged_step = 0
        self._trends_from_batch = 0

    _UNWATCHED = "nanwidget: the callback has not watched a fit yet"

    # ------------------------------------------------------------------ attaching
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()
        log_dir = recording_dir(self.log_dir, trainer.default_root_dir)
        self.stop = None
        self._next_batch = 0
        self._current_batch = None
        self._stopped_batch = None
        self._trends_logged_step = trainer.global_step
        self._trends_from_batch = 0
        options = dict(self.watch_options)
        # 16-mixed precision: the precision plugin's GradScaler skips overflowing steps.
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and "grad_scaler" not in options:
            options["grad_scaler"] = scaler
        self._guard = StepGuard(pl_module, on_nan=self.on_nan, log_dir=log_dir,
                                watch_options=options, owner=self)
        self.watch = self._guard.watch

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        # A training_step that raises on a NaN loss (neuralforecast), or a backward that fails
        # on the constant put in its place (pytorch-forecasting), ends the fit before the next
        # look: say what the watch found, or the user sees only that error.
        if self._active() and self.stop is None:
            self._guard.report_on_error(exception)
        self.close()

    def _active(self) -> bool:
        return self._guard is not None and not self._guard.closed

    def _start_batch(self, phase: str, step: int, index: int) -> None:
        batch = self._next_batch
        self._next_batch += 1
        self._current_batch = batch
        self.watch.set_batch(batch)  # also checks what the previous batch left
        self._guard.batches.note(batch, phase, step, index)

    def _finish_batch(self) -> None:
        if self._current_batch is not None:
            self.watch.set_batch(self._current_batch)  # check this batch's frames now

    # ------------------------------------------------------------------ training
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if not self._active():
            return
        micro = batch_idx % max(1, trainer.accumulate_grad_batches)
        self._start_batch("train", trainer.global_step + 1, micro)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: torch.Tensor) -> None:
        if not self._active():
            return
        self._finish_batch()
        self._guard.note_loss(loss, self._current_batch if self._current_batch is not None else 0)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        guard = self._guard
        if not self._active():
            return
        self._finish_batch()  # backward frames, when backward=True
        self._check_abort()
        if self.stop is not None and self._stopped_batch == self._current_batch:
            # Another optimizer of the batch that stopped (manual optimization: a GAN's
            # discriminator after its generator): training_step goes on after the stop, and
            # its step would write what that batch made.
            guard.drop_gradients()
            return
        found = guard.findings(check_grads=True)
        if not guard.stops or self.stop is not None:  # the first stop is the one that counts
            return
        decision = guard.agree(found)
        if not decision:
            return
        guard.drop_gradients()  # Lightning unscaled them already, so no scaler is waiting
        self._stopped_batch = self._current_batch
        self._stop(trainer, guard.make_stop(trainer.global_step + 1, "train", found, decision),
                   decision)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._active():
            return
        self._check_abort()
        self._log_warnings(trainer)
        if self.log_trends and trainer.global_step >= self._trends_logged_step + self.trends_every:
            self._log_trends(trainer)

    # ------------------------------------------------------------------ validation
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_index = 0

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                  batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self._active():
            return
        self._start_batch("eval", trainer.global_step, self._eval_index)
        self._eval_index += 1

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        guard = self._guard
        if not self._active():
            return
        self._finish_batch()
        self._log_warnings(trainer)
        found = guard.findings(check_grads=False)
        if not guard.stops or self.stop is not None:  # the first stop is the one that counts
            return
        decision = guard.agree(found)
        if decision:
            self._stop(trainer, guard.make_stop(trainer.global_step, "eval", found, decision),
                       decision)

    # ------------------------------------------------------------------ helpers
    def _check_abort(self) -> None:
        if self.abort_after is not None and self._current_batch is not None \
                and self._current_batch >= self.abort_after:
            self.close()
            raise AbortAfterBatch(self.abort_after)

    def _stop(self, trainer: pl.Trainer, stop: TrainingStop, decision: list[dict[str, Any]]) -> None:
        self.stop = stop
        trainer.should_stop = True
        if self.on_nan == "raise":
            error = self._guard.exception_for(stop, decision)
            self.close()
            raise error

    def _log_warnings(self, trainer: pl.Trainer) -> None:
        """New early warnings, as metrics, to every logger of the trainer."""
        fresh = self._guard.new_warnings()
        if fresh and trainer.loggers:
            metrics = warning_metrics(fresh, len(self.watch.warnings))
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _log_trends(self, trainer: pl.Trainer) -> None:
        """Per-module abs-max of the batches since the last log, to every logger of the trainer."""
        self._trends_logged_step = trainer.global_step
        if not trainer.loggers:
            return
        history = self.watch.history()
        recent = history[history["batch"] >= self._trends_from_batch]
        self._trends_from_batch = self._next_batch
        if recent.empty:
            return
        largest = recent.groupby("module", sort=False)["abs_max"].max()
        metrics = {}
        for module, value in largest.items():
            name = module or "<root>"
            if self.trend_modules is not None and not any(
                    fnmatch.fnmatchcase(name, pattern) for pattern in self.trend_modules):
                continue
            metrics[f"nanwidget/abs_max/{name}"] = float(value)
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

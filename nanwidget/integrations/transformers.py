"""nanwidget for transformers' ``Trainer``: the one-line replacement for ``--debug underflow_overflow``.

    from nanwidget.integrations.transformers import NanWatchCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[NanWatchCallback()])

At ``on_train_begin`` the callback watches the unwrapped model (``trainer.model``: never the
DDP wrapper, nor the compiled one). Every forward pass is one watch batch: with
``gradient_accumulation_steps=k`` each optimizer step covers k batches (micro-batches), and an
evaluation batch is a batch of its own; ``callback.batches()`` says which step each batch fed.
Just before each optimizer step (``on_pre_optimizer_step``) the callback checks the gradient
norms and what the watch found since the previous step; every rank then agrees (one flag
all-reduce) and, at a finding on any rank, every rank drops the step's gradients, so the
optimizer step that follows changes nothing, and stops training at that same step
(``control.should_training_stop``). Evaluation is checked at ``on_evaluate`` the same way.
The stop is logged (with the report on the rank that found it), appended to
``state.log_history``, and written next to the per-rank recordings, which go under
``<output_dir>/nanwidget/run-N`` unless ``log_dir`` says otherwise (``log_dir=False``: none).
The hooks come off at ``on_train_end``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pandas as pd
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from nanwidget import AbortAfterBatch, NanEvent, NanWatch

from .step_guard import Findings, StepGuard, TrainingStop, check_callback_options, fresh_run_dir

__all__ = ["NanWatchCallback"]


class NanWatchCallback(TrainerCallback):
    """Watch a ``Trainer``'s model for NaN/Inf and stop every rank at the same step.

    ``on_nan``: ``"stop"`` (default: drop the step's gradients and end training normally, so
    ``trainer.train()`` returns and the callback holds the event), ``"raise"`` (the same, then
    raise :class:`nanwidget.NanDetected` out of ``trainer.train()`` on every rank), ``"warn"``
    or ``"record"`` (training goes on exactly as without the callback; the watch warns per
    event or only records). ``log_dir``: where the per-rank recordings go (default
    ``<output_dir>/nanwidget/run-N``, a new N per ``train()``; ``False`` records nothing to
    disk). Every other keyword goes to :func:`nanwidget.watch` (``max_frames``, ``backward``,
    ``grad_norm_warn``, ``skip_types``, ``trace_batches``, ``replay_on_nan``, ...);
    ``abort_after=N`` raises :class:`nanwidget.AbortAfterBatch` at the first callback after
    batch N, with the hooks already removed.
    """

    def __init__(self, *, on_nan: str = "stop", log_dir: str | os.PathLike | bool | None = None,
                 **watch_options: Any) -> None:
        check_callback_options(on_nan, watch_options)
        self.on_nan = on_nan
        self.log_dir = log_dir
        self.abort_after = watch_options.pop("abort_after", None)
        self.watch_options = watch_options
        self.watch: NanWatch | None = None  # the watch of the current (or last) train()
        self.stop: TrainingStop | None = None  # set when the callback stopped training
        self._guard: StepGuard | None = None
        self._stance: Any = None
        self._stopped_this_step = False
        self._micro = 0
        self._eval_index = 0
        self._warned_filter = False

    # ------------------------------------------------------------------ results
    @property
    def event(self) -> NanEvent | None:
        """This rank's first event, or None."""
        return self.watch.event if self.watch is not None else None

    def report(self, event: NanEvent | None = None) -> str:
        """The transformers-style frame dump of an event (default: this rank's first)."""
        if self.watch is None:
            return "nanwidget: the callback has not watched a training run yet"
        return self.watch.report(event)

    def batches(self) -> pd.DataFrame:
        """Which step each recent watch batch fed: ``batch``, ``phase``, ``step``, ``index``.

        ``phase`` is "train" (``index``: the micro-batch within optimizer step ``step``,
        counted from 1 like ``state.global_step``) or "eval" (``index``: the evaluation batch;
        ``step``: the optimizer steps done when it ran).
        """
        if self._guard is None:
            return pd.DataFrame(columns=["batch", "phase", "step", "index"])
        return self._guard.batches.to_dataframe()

    def close(self) -> None:
        """Remove the hooks now (``on_train_end`` does it too); idempotent."""
        if self._guard is not None:
            self._guard.close()
        if self._stance is not None:
            stance, self._stance = self._stance, None
            stance.__exit__(None, None, None)  # back to the compiler stance before the run

    # ------------------------------------------------------------------ attaching
    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: torch.nn.Module | None = None,
                       **kwargs: Any) -> None:
        self.close()  # a previous train() that raised
        if model is None:
            raise RuntimeError("nanwidget: the Trainer passed no model to on_train_begin")
        if args.n_gpu > 1 and args.parallel_mode.value == "not_distributed":
            raise TypeError("nanwidget does not watch nn.DataParallel (its replicas are rebuilt "
                            "every step, so hooks on them are lost); launch the script with "
                            "torchrun so that the Trainer uses DistributedDataParallel")
        compiled_wrapper = isinstance(model, torch._dynamo.OptimizedModule)
        if compiled_wrapper:  # a model given to the Trainer already compiled
            model = model._orig_mod
        if args.torch_compile or compiled_wrapper:
            self._run_compiled_model_eagerly()
        log_dir = self.log_dir
        if log_dir is None:
            log_dir = fresh_run_dir(os.path.join(args.output_dir, "nanwidget"))
        elif log_dir is False:
            log_dir = None
        self.stop = None
        self._micro = 0
        self._eval_index = 0
        try:
            self._guard = StepGuard(model, on_nan=self.on_nan, log_dir=log_dir,
                                    watch_options=self.watch_options, owner=self)
        except BaseException:
            self.close()
            raise
        self.watch = self._guard.watch
        self._guard.batches.noted_until = self.watch.batch

    def _run_compiled_model_eagerly(self) -> None:
        # Module hooks inside a compiled graph are traced by dynamo: the graph breaks at every
        # module and recompiles until its limit. Until sentinel mode exists, the watched run
        # goes eager, which is exactly what the hooks were written for.
        self._stance = torch.compiler.set_stance("force_eager")
        warnings.warn("nanwidget: torch_compile=True: while NanWatchCallback watches, the model "
                      "runs eagerly (torch.compiler.set_stance('force_eager'), undone at the end "
                      "of train()); a NaN that only the compiled kernels produce is then not "
                      "seen. Train without the callback to compare.", RuntimeWarning, stacklevel=3)

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._note_eval(state)
        self.close()

    # ------------------------------------------------------------------ training steps
    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        if self._guard is None or self._guard.closed:
            return
        self._note_eval(state)  # an evaluation between two steps
        self._micro = 0
        self._stopped_this_step = False

    def on_substep_end(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        if self._guard is None or self._guard.closed:
            return
        self._note_train(state)
        self._check_abort()

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, optimizer: Any = None,
                              **kwargs: Any) -> None:
        guard = self._guard
        if guard is None or guard.closed:
            return
        self._note_train(state)
        self._check_abort()
        found = guard.findings(check_grads=True)
        self._warn_if_logs_hide(args, state, found)
        if not guard.stops or self.stop is not None:  # the first stop is the one that counts
            return
        decision = guard.agree(found)
        if not decision:
            return
        # A gradient scaler that has not unscaled yet (no clipping) refuses a step without any
        # gradient: let it find NaN and skip the step itself.
        scaler = getattr(optimizer, "scaler", None)
        guard.drop_gradients(poison=scaler is not None and args.max_grad_norm <= 0)
        self._stop(state, control, guard.make_stop(state.global_step + 1, "train", found, decision),
                   decision)

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        if self._stopped_this_step:
            # No checkpoint and no evaluation of the step that was stopped (the default flow
            # callback, which runs first, may have asked for them).
            control.should_save = False
            control.should_evaluate = False

    # ------------------------------------------------------------------ evaluation
    def on_prediction_step(self, args: TrainingArguments, state: TrainerState,
                           control: TrainerControl, **kwargs: Any) -> None:
        if self._guard is None or self._guard.closed:
            return
        self._eval_index = self._guard.batches.note_until(self.watch.batch, "eval",
                                                          state.global_step, self._eval_index)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        guard = self._guard
        if guard is None or guard.closed:
            return
        self._note_eval(state)
        self._eval_index = 0
        found = guard.findings(check_grads=False)
        if not guard.stops or self.stop is not None:  # the first stop is the one that counts
            return
        decision = guard.agree(found)
        if decision:
            control.should_save = False  # the weights that just failed evaluation
            self._stop(state, control, guard.make_stop(state.global_step, "eval", found, decision),
                       decision)

    # ------------------------------------------------------------------ helpers
    def _note_train(self, state: TrainerState) -> None:
        self._micro = self._guard.batches.note_until(self.watch.batch, "train",
                                                     state.global_step + 1, self._micro)

    def _note_eval(self, state: TrainerState) -> None:
        if self._guard is not None and not self._guard.closed:
            self._eval_index = self._guard.batches.note_until(
                self.watch.batch, "eval", state.global_step, self._eval_index)

    def _check_abort(self) -> None:
        if self.abort_after is not None and self.watch.batch > self.abort_after:
            self.close()
            raise AbortAfterBatch(self.abort_after)

    def _stop(self, state: TrainerState, control: TrainerControl, stop: TrainingStop,
              decision: list[dict[str, Any]]) -> None:
        self.stop = stop
        self._stopped_this_step = stop.phase == "train"
        control.should_training_stop = True
        state.log_history.append({"nanwidget_stop": stop.summary(), "step": stop.step})
        if self.on_nan == "raise":
            error = self._guard.exception_for(stop, decision)
            self.close()
            raise error

    def _warn_if_logs_hide(self, args: TrainingArguments, state: TrainerState,
                           found: Findings) -> None:
        """Say so when transformers' logging_nan_inf_filter keeps a non-finite loss out of the logs."""
        if self._warned_filter or not args.logging_nan_inf_filter or not found:
            return
        batches = set(self._guard.batches.batches_of("train", state.global_step + 1))
        frames = self.watch.frames()
        bad_loss = frames[(frames["module"] == "") & frames["batch"].isin(batches)
                          & frames["role"].str.startswith("output") & (frames["nan"] | frames["inf"])]
        if found.loss is None and bad_loss.empty and not found.grad_events:
            return
        self._warned_filter = True
        what = "loss" if (found.loss is not None or not bad_loss.empty) else "gradient"
        warnings.warn(f"nanwidget: the {what} of step {state.global_step + 1} is not finite, but "
                      "transformers' logging_nan_inf_filter=True (its default) keeps NaN/Inf "
                      "losses out of the logged loss, so the logs still show a finite number. Set "
                      "TrainingArguments(logging_nan_inf_filter=False) to see them there too.",
                      RuntimeWarning, stacklevel=3)

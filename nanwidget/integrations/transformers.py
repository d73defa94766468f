"""nanwidget for transformers' ``Trainer``: the one-line replacement for ``--debug underflow_overflow``.

    from nanwidget.integrations.transformers import NanWatchCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[NanWatchCallback()])

At ``on_train_begin`` the callback watches the unwrapped model (``trainer.model``: never the
DDP wrapper), or a compiled model in sentinel mode (``torch_compile=True``: see below). Every
forward pass is one watch batch: with ``gradient_accumulation_steps=k`` each optimizer step
covers k micro-batches, and an evaluation batch is a batch of its own; a ``compute_loss`` that
calls the model more than once (a contrastive loss, R-Drop) makes that many watch batches per
micro-batch (or evaluation batch), numbered with the same ``index``.
``callback.batches()`` says which step each batch fed: ``phase`` "train" (``index``: the
micro-batch within optimizer step ``step``, the step counted from 1 like
``state.global_step``) or "eval" (``index``: the evaluation batch; ``step``: the optimizer steps
done when it ran). Micro-batches follow the Trainer's own (``on_substep_end``,
``on_pre_optimizer_step``); a stop message names a batch "training step 3, micro-batch 1", and
"..., forward 2 of 2" when the micro-batch ran the model twice.
Just before each optimizer step (``on_pre_optimizer_step``) the callback checks the gradient
norms, the losses ``training_step`` returned in the step (one host sync for them all: a loss the
Trainer computes outside the model, ``label_smoothing_factor``'s ``LabelSmoother``, is no
watched module's output) and what the watch found since the previous step; every rank then agrees (one flag
all-reduce) and, at a finding on any rank, every rank drops the step's gradients, so the
optimizer step that follows changes nothing, and stops training at that same step
(``control.should_training_stop``). Evaluation is checked at ``on_evaluate`` the same way.
The stop is logged (with the report on the rank that found it), appended to
``state.log_history``, and written next to the per-rank recordings, which go under
``<output_dir>/nanwidget/run-N`` unless ``log_dir`` says otherwise (``log_dir=False``: none).
The hooks come off at ``on_train_end``.

Early warnings (an output near its dtype's largest value, or growing towards it;
``early_warning=False`` turns them off) never stop training: after each optimizer step, each
evaluation and at the end of training the new ones are logged through ``Trainer.log`` as
numbers, so that every ``report_to`` integration records them (``nanwidget/early_warnings``, the
count so far, and ``nanwidget/early_warning/<module>/<reason>``, the abs max seen), and their
text is appended to ``state.log_history`` (``nanwidget_early_warning``).

``TrainingArguments(torch_compile=True)``: the training loop then calls a ``torch.compile``
wrapper around the model, made by accelerate in ``Trainer._prepare_for_training`` (its
``prepare()``), before ``on_train_begin``; callbacks still get the uncompiled ``trainer.model``.
Watching that one would put hooks inside the compiled call (refused with
:class:`nanwidget.CompiledCallError`: compiled code skips module hooks, and Dynamo tracing them
breaks the graph), and forcing the run eager (``torch.compiler.set_stance("force_eager")``,
what the callback did before sentinel mode existed) trains slower and never sees a NaN that only the
compiled kernels make. So the callback watches the compiled wrapper itself, the Trainer's
``model_wrapped`` (callbacks are not handed the Trainer: it is the one on the call stack whose
callback handler holds this callback), in sentinel mode: the model keeps running compiled with no
graph break and no recompile, every batch's outputs are checked (and with ``backward=True`` the
gradients when the backward pass ends), the gradient norms are still checked before each
optimizer step, and a failing batch is replayed eagerly to name the module. A model handed to the
Trainer already compiled (``torch.compile(model)`` or ``model.compile()``) is watched the same
way. During ``train()`` transformers evaluates the uncompiled model (``trainer.model``) eagerly,
not the wrapper: from the end of each optimizer step (``on_step_end``, ``on_epoch_end``; and from
``on_train_begin`` for ``eval_on_start``) until the next one begins (``on_step_begin``) the watch
also counts direct calls of the uncompiled model as batches
(:meth:`nanwidget.core.recorder.Recorder.attach_direct_call_hooks`), so evaluation batches are
numbered, checked and, on a NaN/Inf, replayed to name the module, as for an eager model. Nothing
compiles in that stretch; the hooks on the uncompiled model come off before the next training
step (and at the wrapper's next call in any case, before its compiled code runs, so that Dynamo
never traces them), at ``on_train_end`` and at :meth:`NanWatchCallback.close`. An evaluation that
ran no watched batch (one started outside that stretch) is still judged by its metrics: a
non-finite one (``eval_loss``) stops training, with no module named.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from nanwidget import AbortAfterBatch, NanWatch
from nanwidget.core.sentinel import (
    compiled_in_place,
    has_compiled_parts,
    is_compile_wrapper,
)

from .step_guard import (
    Findings,
    GuardedCallback,
    StepGuard,
    TrainingStop,
    check_callback_options,
    recording_dir,
    logger,
    warning_metrics,
)

__all__ = ["NanWatchCallback"]


def _compiled(module: torch.nn.Module) -> str:
    """How ``module`` runs compiled code: "wrapper" (torch.compile), "in place" (module.compile()),
    "parts" (compiled submodules, e.g. accelerate's regional compilation) or "" (eagerly)."""
    if is_compile_wrapper(module):
        return "wrapper"
    if compiled_in_place(module):
        return "in place"
    return "parts" if has_compiled_parts(module) else ""


class NanWatchCallback(GuardedCallback, TrainerCallback):
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
        check_callback_options(on_nan, watch_options, log_dir)
        self.on_nan = on_nan
        self.log_dir = log_dir
        self.abort_after = watch_options.pop("abort_after", None)
        self.watch_options = watch_options
        self.watch: NanWatch | None = None  # the watch of the current (or last) train()
        self.stop: TrainingStop | None = None  # set when the callback stopped training
        self._guard: StepGuard | None = None
        self.compiled = ""  # how the watched model is compiled: "" (eager), "wrapper", ...
        # Evaluation runs the uncompiled model, not the watched compile wrapper: the watch
        # counts direct calls of it between optimizer steps (see the module docstring).
        self._eval_direct = False
        self._stopped_this_step = False
        self._micro = 0
        self._eval_index = 0
        self._warned_filter = False
        # (loss, its last watch batch, its labels) of each micro-batch of the current step, as
        # training_step returned them (never synced until the step's check).
        self._step_losses: list[tuple[torch.Tensor, int, Any]] = []
        self._loss_not_finite = False  # one of them was NaN/Inf

    _UNWATCHED = "nanwidget: the callback has not watched a training run yet"

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
        target, options = self._watch_target(args, model)
        log_dir = recording_dir(self.log_dir, args.output_dir)
        self.stop = None
        self._micro = 0
        self._eval_index = 0
        try:
            self._guard = StepGuard(target, on_nan=self.on_nan, log_dir=log_dir,
                                    watch_options=options, owner=self)
        except BaseException:
            self.close()
            raise
        self.watch = self._guard.watch
        self._guard.batches.noted_until = self.watch.batch
        self._report_errors_of(self._calling_trainer())
        self._watch_evaluation()  # eval_on_start evaluates before the first step

    def _report_errors_of(self, trainer: Any) -> None:
        """Make an exception out of ``trainer.training_step`` tell what the watch found first.

        A NaN the watch records in a forward can make the user's own code raise before the
        next optimizer step, where the callback would have stopped training: generation
        inside the step (TRL's GRPO, RLOO, online DPO) sampling from NaN logits raises
        "probability tensor contains either inf, nan or element < 0". The Trainer calls no
        callback on an exception, so the step is wrapped (an instance attribute, removed at the
        end of ``train()``, at :meth:`close` and at the error): the error goes on unchanged,
        after one warning naming the batch, module and diagnosis (``report_on_error``)."""
        self._unwrap_training_step()
        guard = self._guard
        original = getattr(trainer, "training_step", None) if trainer is not None else None
        if guard is None or not guard.stops or not callable(original):
            return
        own = trainer.__dict__.get("training_step")

        losses = self._step_losses

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            try:
                inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
                labels = _labels_of(inputs)
                loss = original(*args, **kwargs)
                # Checked before the optimizer step (one host sync per step, not per micro-batch):
                # a loss made outside the model (label_smoothing_factor's LabelSmoother, a
                # compute_loss_func) is no watched module's output.
                if isinstance(loss, torch.Tensor):
                    losses.append((loss, guard.watch.batch - 1, labels))
                return loss
            except BaseException as error:
                self._unwrap_training_step()
                try:  # the interrupted micro-batch's forwards, so the warning names its step
                    guard.watch.flush()
                    self._note_train(trainer.state)
                except Exception:  # noqa: BLE001 - the user's error comes first
                    pass
                guard.report_on_error(error)  # never raises
                raise

        trainer.training_step = training_step
        # (trainer, wrapper, its own training_step before) until train() ends; never copied
        self._wrapped_step = (trainer, training_step, own)

    def _unwrap_training_step(self) -> None:
        wrapped = self.__dict__.pop("_wrapped_step", None)
        if wrapped is None:
            return
        trainer, wrapper, own = wrapped
        if trainer.__dict__.get("training_step") is wrapper:
            if own is None:
                del trainer.training_step
            else:
                trainer.training_step = own

    def _watch_target(self, args: TrainingArguments,
                      model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, Any]]:
        """What to watch, and the watch options: the model the Trainer passes to callbacks, or,
        when the training loop calls a compiled model, that compiled model in sentinel mode."""
        options = dict(self.watch_options)
        outer = model
        trainer = self._calling_trainer()
        if trainer is not None:
            # The model the training loop calls: a torch.compile wrapper with
            # torch_compile=True (accelerate compiles it in prepare(), before on_train_begin).
            outer = getattr(trainer, "model_wrapped", None)
        # float16 AMP: the accelerator's GradScaler skips overflowing steps on purpose.
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        if scaler is not None and "grad_scaler" not in options:
            options["grad_scaler"] = scaler
        if not isinstance(outer, torch.nn.Module) or not _compiled(outer) \
                or not any(module is model for module in outer.modules()):
            outer = model  # DDP (the hooks go on the module inside) or an eager model
        self.compiled = _compiled(outer)
        # Evaluation calls the model callbacks are given (transformers evaluates the uncompiled
        # model during train()), not the wrapper the watch is on.
        self._eval_direct = outer is not model
        if self.compiled:
            options.setdefault("mode", "sentinel")  # mode="full" is refused by nw.watch
            logger.info("nanwidget: the Trainer's model is compiled (%s): watching it in sentinel "
                        "mode (outputs checked each batch, gradients before each optimizer step, "
                        "a failing batch replayed eagerly to name the module)", self.compiled)
            if self._eval_direct and (args.eval_strategy != "no" or args.eval_on_start):
                logger.info("nanwidget: transformers evaluates the uncompiled model during "
                            "train(): its calls between optimizer steps are watched too")
        elif args.torch_compile:
            # Nothing compiled was found (a Trainer that compiles later or elsewhere): watch the
            # model as given; should it run inside compiled code, nw.CompiledCallError says so.
            logger.warning("nanwidget: torch_compile=True but the model the Trainer calls was not "
                           "found compiled at on_train_begin; watching the uncompiled model")
        return outer, options

    def _calling_trainer(self) -> Any:
        """The Trainer whose callback handler is calling this callback, found on the call stack
        (callbacks are not given the Trainer, and its ``model_wrapped`` is what it calls)."""
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer) and any(
                    callback is self for callback in owner.callback_handler.callbacks):
                return owner
            frame = frame.f_back
        return None

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._note_eval(state)
        if self._guard is not None and not self._guard.closed:
            self._log_warnings(state)
        self.close()

    def close(self) -> None:
        """Remove the hooks now (the end of training does it too), and the wrapper on the
        Trainer's ``training_step``; idempotent."""
        self._unwrap_training_step()
        super().close()

    # ------------------------------------------------------------------ training steps
    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        if self._guard is None or self._guard.closed:
            return
        self._note_eval(state)  # an evaluation between two steps
        self._unwatch_evaluation()  # before the next compiled training call
        self._micro = 0
        self._stopped_this_step = False
        self._step_losses.clear()

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
        self._check_losses(args)
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
        # Whatever evaluates after this step (Trainer._maybe_log_save_evaluate) runs before the
        # next on_step_begin.
        self._watch_evaluation()
        if self._guard is not None and not self._guard.closed:
            self._log_warnings(state)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._watch_evaluation()  # the evaluation at the end of an epoch

    # ------------------------------------------------------------------ evaluation
    def on_prediction_step(self, args: TrainingArguments, state: TrainerState,
                           control: TrainerControl, **kwargs: Any) -> None:
        if self._guard is None or self._guard.closed:
            return
        # Every forward since the previous prediction step belongs to this evaluation batch.
        before = self._guard.batches.noted_until
        self._guard.batches.note_group(self.watch.batch, "eval", state.global_step,
                                       self._eval_index)
        if self._guard.batches.noted_until > before:  # counts the evaluation batches watched
            self._eval_index += 1

    def on_evaluate(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        guard = self._guard
        if guard is None or guard.closed:
            return
        self._note_eval(state)
        self._log_warnings(state)
        watched_batches, self._eval_index = self._eval_index, 0
        found = guard.findings(check_grads=False)
        if self._eval_direct and not watched_batches and not found:
            # An evaluation of the uncompiled model that the watch did not see.
            found.loss = _non_finite_metric(kwargs.get("metrics"), state.global_step)
        if not guard.stops or self.stop is not None:  # the first stop is the one that counts
            return
        decision = guard.agree(found)
        if decision:
            control.should_save = False  # the weights that just failed evaluation
            self._stop(state, control, guard.make_stop(state.global_step, "eval", found, decision),
                       decision)

    # ------------------------------------------------------------------ helpers
    def _check_losses(self, args: TrainingArguments) -> None:
        """The losses ``training_step`` returned in this step: one host sync for all of them.
        A non-finite one that no module event explains was made outside the model (a module
        event comes first: :meth:`StepGuard.findings` keeps the loss only without one)."""
        losses, self._step_losses[:] = list(self._step_losses), []
        self._loss_not_finite = False
        if not losses:
            return
        values = [loss.detach().reshape(-1).float() for loss, _, _ in losses]
        if bool(torch.isfinite(torch.cat([v.to(values[0].device) for v in values])).all()):
            return
        self._loss_not_finite = True
        for loss, batch, labels in losses:
            self._guard.note_loss(loss, batch, self._outside_model(args, labels), target=labels)

    def _outside_model(self, args: TrainingArguments, labels: Any) -> str:
        """Where a non-finite loss that no watched module's output held was made, in the
        Trainer's terms."""
        trainer = self._calling_trainer()
        where = ("no watched module output was non-finite, so the Trainer's compute_loss made "
                 "it outside the model")
        loss_module = _loss_module(trainer)
        if loss_module is not None:
            return ("no watched module output was non-finite, so the Trainer's loss "
                    f"({type(loss_module).__name__}) made it outside the model, from the "
                    "model's outputs and the batch's labels")
        if trainer is None or getattr(trainer, "label_smoother", None) is None:
            return where + (" (a compute_loss_func, or a compute_loss of your own)"
                            if trainer is not None else "")
        where += (f": label_smoothing_factor={args.label_smoothing_factor:g} has the Trainer "
                  "compute the loss itself (LabelSmoother), dividing by the number of labels "
                  "that are not -100")
        ignore = getattr(trainer.label_smoother, "ignore_index", -100)
        if isinstance(labels, torch.Tensor) and labels.numel() \
                and not bool((labels != ignore).any()):
            where += (f", and every label of this micro-batch is {ignore}: 0/0. Drop or fix "
                      "such samples in the Dataset or data_collator (a sequence truncated "
                      "before its answer, a prompt-only row), or leave label_smoothing_factor "
                      "at 0")
        return where

    def _log_warnings(self, state: TrainerState) -> None:
        """New early warnings: their numbers through ``Trainer.log`` (every ``report_to``
        integration sees them), their text in ``state.log_history``."""
        fresh = self._guard.new_warnings()
        if not fresh:
            return
        for warning in fresh:
            state.log_history.append({"nanwidget_early_warning": str(warning),
                                      "step": state.global_step})
        trainer = self._calling_trainer()
        if trainer is not None:
            trainer.log(warning_metrics(fresh, len(self.watch.warnings)))

    def _watch_evaluation(self) -> None:
        """Count direct calls of the uncompiled model (evaluation during train()) as batches,
        until :meth:`_unwatch_evaluation`; only when the watch is on a compile wrapper."""
        if self._eval_direct and self._guard is not None and not self._guard.closed:
            self.watch.recorder.attach_direct_call_hooks()

    def _unwatch_evaluation(self) -> None:
        if self._eval_direct and self.watch is not None:
            self.watch.recorder.detach_direct_call_hooks()

    def _note_train(self, state: TrainerState) -> None:
        """Called once at the end of each micro-batch (``on_substep_end``, and
        ``on_pre_optimizer_step`` for the last): every forward since the previous one is part
        of it, as a compute_loss may call the model several times."""
        self._guard.batches.note_group(self.watch.batch, "train", state.global_step + 1,
                                       self._micro)
        self._micro += 1

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
        # The step's losses as training_step returned them: the root's output frame may have
        # left the frames window (backward frames fill it with backward=True).
        loss_bad = found.loss is not None or not bad_loss.empty or self._loss_not_finite
        if not loss_bad and not found.grad_events:
            return
        self._warned_filter = True
        what = "loss" if loss_bad else "gradient"
        warnings.warn(f"nanwidget: the {what} of step {state.global_step + 1} is not finite, but "
                      "transformers' logging_nan_inf_filter=True (its default) keeps NaN/Inf "
                      "losses out of the logged loss, so the logs still show a finite number. Set "
                      "TrainingArguments(logging_nan_inf_filter=False) to see them there too.",
                      RuntimeWarning, stacklevel=3)


def _labels_of(inputs: Any) -> Any:
    """The targets in a micro-batch as the Trainer's ``training_step`` gets it: ``labels``
    (transformers' collators), else ``label`` (sentence-transformers' collator puts a
    ``label``, ``score`` or ``scores`` column there); None when it holds neither."""
    if not isinstance(inputs, Mapping):
        return None
    labels = inputs.get("labels")
    return inputs.get("label") if labels is None else labels


def _loss_module(trainer: Any) -> torch.nn.Module | None:
    """The loss module a Trainer computes the loss with, when it holds one as ``loss``:
    sentence-transformers' ``SentenceTransformerTrainer`` (``loss=MultipleNegativesRankingLoss(
    model)``, which runs the model inside its forward; a dict of them per dataset: the first)."""
    loss = getattr(trainer, "loss", None)
    if isinstance(loss, Mapping):
        loss = next(iter(loss.values()), None)
    return loss if isinstance(loss, torch.nn.Module) else None


def _non_finite_metric(metrics: Any, step: int) -> str | None:
    """The finding for a non-finite evaluation metric, or None. With torch_compile=True,
    transformers evaluates the uncompiled model during train(); an evaluation whose batches the
    watch did not see (run outside the stretch between optimizer steps) leaves only its
    metrics to look at."""
    if not isinstance(metrics, dict):
        return None
    bad = [(name, value) for name, value in metrics.items()
           if isinstance(value, (int, float)) and not isinstance(value, bool)
           and not math.isfinite(value)]
    if not bad:
        return None
    name, value = bad[0]
    return (f"{name} is {value} in the evaluation after step {step} (the watch on the compiled "
            "model saw none of its batches: no module is named; evaluate without torch_compile "
            "to find it)")

"""NanWatch: the one handle a user holds. It checks the options, builds a
:class:`~nanwidget.core.recorder.Recorder` and composes the features the options ask for:

- replay (:mod:`.replay`): batch capture, ``replay()``, ``replay_on_nan``;
- gradients (:mod:`.grads`): backward frames (``backward=True``) and ``check_grad_norms()``;
- persistence (:mod:`.persist`): ``log_dir`` spooling;
- consensus (:mod:`.consensus`): every DDP rank stops at the same batch;
- sentinel (:mod:`.sentinel`): ``mode="sentinel"`` and compiled models: only the root's outputs
  and the gradients are checked, and a failing batch is replayed for the detail;
- diagnosis (:mod:`.diagnosis`): every event's ``diagnosis`` (why it happened).
- model changes (:mod:`.structure`): a module added or replaced after ``watch()`` is named in
  the event it affects.
- early warning (:mod:`.early_warning`): an output near its dtype's largest value, or growing
  towards it (``early_warning=True``, the default).

Each feature is a plain object that sees the recorder through its public API; the order they
are added in is the order they review an event (the replay attaches its trace, then the
consensus tells the other ranks, then the event is recorded and written to disk).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

import pandas as pd
import torch
from torch import nn

from .consensus import Consensus, consensus_wanted
from .diagnosis import Diagnoser, loss_told
from .early_warning import EarlyWarning, EarlyWarnings
from .events import LOSS_ROLE, GradEvent, NanEvent, ScalerSkip, event_kind
from .grads import BackwardFrames, GradNorms, ScalerHint, ScalerWatch, skips_summary
from .persist import RecordingWriter
from .recorder import Feature, Recorder
from .replay import BatchCapture, Replayer, ReplayError
from .replay.run import unreplayable_reason
from .report import format_event_report
from .opaque import own_call_note
from .options import (MAX_EVENTS, MODES, OPTIONS, SkipTypesWarning, WatchOptions, batch_number,
                      is_loss_scale_optimizer, loss_function, options_help,
                      signature_of_options, split_classes)
from .sentinel import Sentinel, compiled_in_place, has_compiled_parts, is_compile_wrapper
from .state import watching_recorders
from .structure import ModelChanges
from .trace import Trace
from .viewer import open_browser
from .writes import steps_taken

__all__ = ["NanWatch", "WatchParts", "WatchOptions", "SkipTypesWarning", "watch",
           "live_watches", "MAX_EVENTS", "MODES"]


def live_watches() -> list[NanWatch]:
    """Every NanWatch that is still watching (a watch whose variable was lost can be closed)."""
    return [r.owner for r in watching_recorders() if isinstance(r.owner, NanWatch)]


@dataclass(frozen=True)
class _Target:
    """What a watch hooks: the model (names come from it), the module whose call is a batch
    (a torch.compile wrapper around the model, or the model), and how it is compiled."""

    root: nn.Module
    entry: nn.Module
    compiled: str  # "" | "wrapper" (torch.compile(model)) | "in place" | "parts"
    # What scales the loss, found in the wrapper (Fabric's precision plugin's GradScaler)
    grad_scaler: Any = None


def _fabric_forward_module(model: nn.Module) -> nn.Module | None:
    """What Lightning Fabric's ``_FabricModule`` (``fabric.setup(model)``'s result) calls: the
    model, or the strategy's wrapper around it; None for any other module. Read from its
    children: the wrapper's ``__getattr__`` hands back the model's attributes."""
    if type(model).__name__ != "_FabricModule":
        return None
    forward = dict(model.named_children()).get("_forward_module")
    return forward if isinstance(forward, nn.Module) else None


def _unwrap_model(model: Any) -> _Target:
    if not isinstance(model, nn.Module):
        raise TypeError(f"nanwidget.watch needs a torch.nn.Module, got {type(model).__name__}")
    fabric = _fabric_forward_module(model)
    if fabric is not None:
        # fabric.setup(model): watch what the wrapper calls (the model, or the strategy's DDP
        # or compile wrapper around it) under the user's own names, not "_forward_module.".
        # The wrapper's casts and autocast run around that call, so the frames see them.
        # (A strategy wrapper nanwidget does not unwrap, FSDP's, keeps its own names.)
        # Its strategy's precision plugin holds the GradScaler of "16-mixed" (else None).
        precision = getattr(vars(model).get("_strategy"), "precision", None)
        return replace(_unwrap_model(fabric), grad_scaler=getattr(precision, "scaler", None))
    entry = model
    compiled = ""
    if is_compile_wrapper(model):
        compiled = "wrapper"
        model = model._orig_mod
    if isinstance(model, nn.DataParallel):
        raise TypeError("nanwidget does not watch nn.DataParallel (its replicas are rebuilt every "
                        "step, so hooks on them are lost); use DistributedDataParallel under "
                        "torchrun, or watch model.module on one device")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("nanwidget cannot see inside a TorchScript module (hooks do not run in "
                        "scripted code); watch the original nn.Module before torch.jit.script")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        if compiled:
            model = model.module  # torch.compile(DDP(model)): the user's module, eagerly replayed
        else:
            model = entry = model.module  # user's own names, no "module." prefix
    if not compiled and compiled_in_place(model):
        compiled = "in place"
    if not compiled and has_compiled_parts(model):
        compiled = "parts"
    return _Target(root=model, entry=entry, compiled=compiled)


def _loss_scale_optimizer_of(model: nn.Module) -> Any:
    """The optimizer a Keras model was compiled with, when it scales its loss itself (Keras'
    ``LossScaleOptimizer``, under the ``mixed_float16`` policy), else None."""
    try:
        optimizer = model.__dict__.get("optimizer")
    except Exception:  # an odd module: none
        return None
    return optimizer if is_loss_scale_optimizer(optimizer) else None


def _resolve_mode(mode: str | None, target: _Target) -> str:
    """The mode a watch runs in: as asked, or sentinel for a compiled model (with a note)."""
    if not target.compiled:
        if mode == "sentinel" and type(target.root).forward is nn.Module.forward \
                and "forward" not in vars(target.root):  # a forward set on the instance runs
            # Sentinel mode checks the root's calls only: a root without a forward is never
            # called (its modules are), so the watch would check nothing, silently.
            kind = type(target.root).__name__
            raise ValueError(
                f"mode='sentinel' checks the calls of the watched module, and this {kind} has "
                "no forward: its modules are called one by one, so nothing would be checked. "
                "Watch each model that is called on its own (a GAN's G and D: one "
                "nw.watch(..., mode='sentinel') each), "
                "or watch this one in full mode (nw.watch(model)), which checks every module call")
        return mode or "full"
    what = {"wrapper": "a torch.compile'd model", "in place": "a model compiled in place "
            "(module.compile())", "parts": "a model with compiled submodules "
            f"({', '.join(has_compiled_parts(target.root)[:3])})"}[target.compiled]
    if mode == "full":
        raise ValueError(
            f"mode='full' cannot watch {what}: compiled code skips the hooks of the modules "
            "inside it (and Dynamo tracing them would break the graph). Watch it in sentinel "
            "mode, nw.watch(model) or nw.watch(model, mode='sentinel'): the outputs and gradients "
            "are checked every batch, and a failing batch is replayed eagerly in full detail. "
            "For full frames of every batch, watch the uncompiled module instead")
    if mode is None:
        warnings.warn(f"nanwidget: watching {what} in sentinel mode (no graph break, no "
                      "recompile; a NaN/Inf is replayed eagerly for the full detail)",
                      UserWarning, stacklevel=4)
    return "sentinel"


@dataclass(frozen=True)
class WatchParts:
    """The features a watch is made of (None where its option is off)."""

    capture: BatchCapture | None
    replayer: Replayer | None
    backward: BackwardFrames | None
    grads: GradNorms
    writer: RecordingWriter | None
    consensus: Consensus | None
    sentinel: Sentinel | None = None
    diagnoser: Diagnoser | None = None
    scaler: ScalerWatch | None = None
    early_warning: EarlyWarnings | None = None


class NanWatch:
    """Records frames of a model and stops at the first NaN/Inf. Create it with :func:`watch`."""

    def __init__(self, model: nn.Module, **options: Any) -> None:
        target = _unwrap_model(model)
        root = target.root
        checked = WatchOptions.checked(root, **options)
        checked = checked.replace(mode=_resolve_mode(checked.mode, target))
        if "grad_scaler" not in options:
            # Fabric's GradScaler under "16-mixed", or a Keras model compiled under
            # mixed_float16: it scales its loss itself
            found = target.grad_scaler or _loss_scale_optimizer_of(root)
            if found is not None:
                checked = checked.replace(grad_scaler=found)
        #: The options, checked; ``mode`` is the mode the watch runs in ("full" or "sentinel").
        self.options = checked
        self.model = root
        # "" for an eager model; "wrapper", "in place" or "parts" for compiled code.
        self.compiled = target.compiled
        skip = split_classes(checked.skip_types)
        self._recorder = Recorder(root, max_frames=checked.max_frames,
                                  trace_batches=checked.trace_batches,
                                  abort_after=checked.abort_after, skip=(skip[1], frozenset(skip[0])),
                                  on_nan=checked.on_nan, max_events=checked.max_events,
                                  allow_inf=split_classes(checked.allow_inf),
                                  root_only=checked.mode == "sentinel", entry=target.entry)
        self._recorder.owner = self  # lives as long as the hooks do: see live_watches()
        self._unchecked_at_close: str | None = None  # "checked nothing", as it stood at close
        # Optimizer steps so far: steps while the model is never called mean another model
        # trained (skorch's fit() builds a new net.module_).
        self._steps_at_start = steps_taken()
        try:
            self._parts = self._compose()
        except BaseException:
            self._recorder.close()
            raise

    def __getattr__(self, name: str) -> Any:
        # w.max_frames, w.on_nan, w.mode ...: each option reads as an attribute of the watch.
        options = self.__dict__.get("options")
        if options is not None and name in OPTIONS:
            return getattr(options, name)
        raise AttributeError(f"'NanWatch' object has no attribute {name!r}")

    def _compose(self) -> WatchParts:
        """Add the features the options ask for, in review order."""
        recorder = self._recorder
        options = self.options
        capture = replayer = backward = writer = consensus = sentinel = scaler = early = None
        sentinel_mode = options.mode == "sentinel"
        # First to review an event: a module added after watch() is named before the others
        # (replay, consensus, files) see the event.
        recorder.add_feature(ModelChanges(recorder))
        keep = max(options.keep_batches, 1 if options.replay_on_nan or sentinel_mode else 0)
        if keep or options.trace_batches or options.snapshot_weights:
            capture = recorder.add_feature(BatchCapture(
                self.model, keep=keep, trace_batches=options.trace_batches,
                snapshot_weights=options.snapshot_weights))
            capture.ran_outside_root = recorder.ran_outside_root
        if options.backward and not sentinel_mode:
            # Held for replays of backward events: not when the loss replays them, nor when
            # this process alone cannot replay the model (FSDP2, tensor parallel).
            backward = recorder.add_feature(BackwardFrames(
                recorder, hold_output_grads=options.loss_fn is None and capture is not None
                and not unreplayable_reason(recorder)))
        if capture is not None:
            # In sentinel mode every event is replayed by the sentinel itself.
            replayer = Replayer(recorder, capture,
                                replay_on_nan=options.replay_on_nan and not sentinel_mode,
                                loss_fn=options.loss_fn,
                                output_grads=backward.output_grads if backward is not None
                                else None)
            if replayer.replay_on_nan:  # it reviews events only to replay them
                recorder.add_feature(replayer)
        grads = recorder.add_feature(GradNorms(recorder, threshold=options.grad_norm_warn,
                                               scaler=options.grad_scaler))
        with_consensus = consensus_wanted()
        if sentinel_mode:
            assert capture is not None
            sentinel = recorder.add_feature(Sentinel(
                recorder, capture, sample_every=options.sample_every, backward=options.backward,
                compiled=bool(self.compiled), loss_fn=options.loss_fn,
                defer_reads="never" if with_consensus else "device"))
        # Before the consensus: a gradient overflow the scaler skips is no event on any rank.
        if options.grad_scaler is not None:
            scaler = recorder.add_feature(ScalerWatch(
                recorder, options.grad_scaler, patience=options.scaler_patience,
                detail=sentinel.detail_grad_event if sentinel is not None else None))
            if sentinel is not None:
                sentinel.defer_grad_replays = scaler.overflow_possible
        elif options.backward:
            recorder.add_feature(ScalerHint())
        # After the traces are attached (replay, sentinel), before the other ranks hear of the
        # event and before it is written: every event gets its diagnosis.
        diagnoser = recorder.add_feature(Diagnoser(
            recorder, capture=capture, sentinel=sentinel_mode, loss_fn=options.loss_fn is not None,
            sample_every=options.sample_every if sentinel_mode else None,
            scaler_run=scaler.patience_run if scaler is not None else None,
            replay=replayer.trace_for if replayer is not None and not sentinel_mode else None,
            unreplayable=partial(unreplayable_reason, recorder),
            checks_gradients=options.backward,
            backward_passes=(lambda: backward.passes) if backward is not None
            else (lambda: sentinel.grad_checks) if sentinel is not None and options.backward
            else None))
        if with_consensus:
            consensus = recorder.add_feature(Consensus(recorder))
        if options.early_warning:
            # Before the writer: a warning made at a batch's end is written with that batch.
            early = recorder.add_feature(EarlyWarnings(recorder, root_output=sentinel))
        if options.log_dir is not None and options.log_dir != "":
            writer = recorder.add_feature(RecordingWriter(
                recorder, options.log_dir, options=options.manifest(),
                grad_history=grads.history_table,
                early_warnings=(lambda: early.warnings) if early is not None else None))
        return WatchParts(capture=capture, replayer=replayer, backward=backward, grads=grads,
                          writer=writer, consensus=consensus, sentinel=sentinel, scaler=scaler,
                          diagnoser=diagnoser, early_warning=early)

    # ------------------------------------------------------------------ composition
    @property
    def parts(self) -> WatchParts:
        """The features this watch is made of (replay capture, gradients, writer, consensus)."""
        return self._parts

    @property
    def recorder(self) -> Recorder:
        """The recorder: hooks, batch state, frames and events."""
        return self._recorder

    def add_feature(self, feature: Feature) -> Feature:
        """Let ``feature`` (a :class:`~nanwidget.core.recorder.Feature`) see this watch's
        batches and events from now on; it is closed with the watch."""
        return self._recorder.add_feature(feature)

    # ------------------------------------------------------------------ state
    @property
    def batch(self) -> int:
        """The batch being recorded (0-based); the root forward's return counts the next one."""
        return self._recorder.batch

    @property
    def rank(self) -> int:
        """torch.distributed rank (0 without a process group)."""
        return self._recorder.rank

    @property
    def module_names(self) -> list[str]:
        """Qualified names of the hooked modules ("" is the root)."""
        return self._recorder.module_names

    @property
    def module_types(self) -> list[str]:
        """Class names of the hooked modules, in the order of :attr:`module_names`."""
        return self._recorder.module_types

    @property
    def events(self) -> list[NanEvent]:
        """Every event so far (capped at ``max_events``; see ``events_dropped``)."""
        self._end_failed_backward()
        return self._recorder.events

    @property
    def event(self) -> NanEvent | None:
        """The first event, or None."""
        self._end_failed_backward()
        return self._recorder.event

    def _end_failed_backward(self) -> None:
        """A backward pass that raised left its frames unresolved (autograd ran no end for it):
        resolved, with its event, before events or frames are read."""
        backward = self._parts.backward
        if backward is not None:
            backward.end_failed_pass()

    @property
    def events_dropped(self) -> int:
        """Events past ``max_events``, counted but not kept."""
        return self._recorder.events_dropped

    @property
    def warnings(self) -> list[EarlyWarning]:
        """Early warnings so far (:class:`~nanwidget.core.early_warning.EarlyWarning`, once per
        module and reason): outputs near their dtype's largest value, or growing towards it.
        Empty with ``early_warning=False``. ``pd.DataFrame(w.warnings)`` tabulates them."""
        early = self._parts.early_warning
        if early is None:
            return []
        with self._recorder.lock:
            return list(early.warnings)

    @property
    def interrupted_batches(self) -> list[int]:
        """Batches whose forward never returned (e.g. KeyboardInterrupt)."""
        return list(self._recorder.interrupted_batches)

    @property
    def closed(self) -> bool:
        return self._recorder.closed

    def step(self) -> None:
        """End the current batch and count the next one; automatic counting stops. Called right
        after a forward that counted its batch, it ends that batch without skipping a number."""
        self._recorder.step()

    def set_batch(self, batch: int) -> None:
        """End the current batch (its frames are checked) and continue as ``batch``.

        From the first call on, the root forward no longer advances the count: use this for
        loops that call submodules directly or accumulate gradients over several forwards.
        """
        self._recorder.set_batch(batch_number(batch))

    # ------------------------------------------------------------------ results
    def flush(self) -> None:
        """Resolve frames recorded since the last batch boundary (never raises NanDetected)."""
        self._end_failed_backward()
        self._recorder.flush()

    def frames(self, batch: int | None = None) -> pd.DataFrame:
        """Frames in the ring buffer, or every frame of trace batch ``batch``."""
        self._end_failed_backward()
        return self._recorder.frames_table(batch)

    def history(self) -> pd.DataFrame:
        """One row per (batch, module): abs_max, abs_min and nonfinite of its outputs."""
        self._end_failed_backward()
        return self._recorder.history_table()

    def report(self, event: NanEvent | None = None) -> str:
        """Text dump of an event's frames, or of the frames held; trace batches come first.

        With an event, the trace batches recorded before the event's batch precede its dump,
        as transformers prints them during the run.
        """
        event = event or self.event
        recorder = self._recorder
        scaler = self._parts.scaler
        skipped = skips_summary(scaler.skips, scaler.label) if scaler is not None else ""
        traced = [self.frames(batch=batch) for batch in recorder.recorded_trace_batches
                  if event is None or batch < event.batch]
        trace_frames = pd.concat(traced, ignore_index=True) if traced else None
        if event is not None:
            if trace_frames is not None:
                trace_frames = trace_frames[trace_frames["rank"] == event.rank]
            text = format_event_report(event, event.frames, trace_frames=trace_frames)
        else:
            held = self.frames()
            last = recorder.batch if recorder.manual_batches else recorder.batch - 1
            text = format_event_report(None, held, batch=last, trace_frames=trace_frames)
            unchecked = self._unchecked_note()
            if unchecked:
                text = f"{text}\n{unchecked}"
        return f"{text}\n{skipped}" if skipped else text

    # ------------------------------------------------------------------ replay
    def replay(self, batch: int, *, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Trace:
        """Re-run ``batch`` in trace mode: every module frame and every tensor op.

        With ``loss_fn``, also runs the backward of ``loss_fn(output)``. The model is left exactly
        as it was (parameters, buffers, ``.grad``, train/eval flags, ``requires_grad``, RNG
        states) and the watch's own recording is not disturbed. Raises ``BatchNotHeldError``
        (listing the held batches) or ``InputModifiedError`` when a faithful replay is impossible.
        """
        replayer = self._parts.replayer
        if replayer is None:
            raise ReplayError("this watch holds no batches to replay: it was created with "
                              "keep_batches=0 and no trace_batches; watch with keep_batches=N")
        return replayer.replay(batch, loss_function(loss_fn))

    def held_batches(self) -> list[int]:
        """Batch numbers :meth:`replay` can run now."""
        capture = self._parts.capture
        return capture.held_batches() if capture is not None else []

    def set_weight_snapshots(self, enabled: bool = True) -> None:
        """Copy parameters and buffers at the start of every held batch from now on, so that
        replays stay exact after optimizer steps (costs a copy of the weights per batch)."""
        capture = self._parts.capture
        if capture is None:
            raise ReplayError("this watch holds no batches to replay (keep_batches=0); weight "
                              "snapshots need held batches")
        capture.set_snapshots(enabled)

    # ------------------------------------------------------------------ a loss
    def explain_loss(self, loss: torch.Tensor | float, *, batch: int | None = None,
                     target: torch.Tensor | None = None) -> NanEvent | None:
        """Why a loss computed outside the model, from its outputs, is NaN/Inf, when no module
        event explains it (``torch.isfinite(loss)`` failed in your loop; the training callbacks
        ask at their stop): the event it is, role ``"loss"`` at the root, with its
        ``diagnosis``: ``"divergence"`` when the weights climbed over the batches before (the
        optimizer drove the outputs up until the loss of them overflowed), else ``"loss"``.
        None for a finite loss. ``batch``: the batch whose forward made the outputs (default:
        the last one recorded). ``target``: the targets the loss compared the outputs with
        (optional): an Inf or NaN there is named with its rows, first. The loss function is
        told by the loss's ``grad_fn`` when torch's own made it (``F.mse_loss``,
        ``F.cross_entropy``, ``F.binary_cross_entropy``...), so the fixes fit it (no
        log-probability fixes for a regression). The event is not added to :attr:`events`.
        It reads the loss (a host sync) and diagnoses: call it once the loss is non-finite,
        not every batch."""
        if isinstance(loss, torch.Tensor):
            if loss.is_meta or not (loss.is_floating_point() or loss.is_complex()):
                return None  # no values (meta), or integers that hold no NaN/Inf
            value = loss.detach()
            if not value.numel() or bool(torch.isfinite(value).all()):
                return None
            kind = event_kind(bool(torch.isnan(value).any()), bool(torch.isinf(value).any()))
        else:
            if isinstance(loss, bool) or not isinstance(loss, (int, float)):
                raise TypeError("explain_loss takes the loss: a tensor or a Python number, got "
                                f"{type(loss).__name__}")
            number = float(loss)
            if number == number and abs(number) != float("inf"):
                return None
            kind = "nan" if number != number else "inf"
        if target is not None and not isinstance(target, torch.Tensor):
            raise TypeError("explain_loss's target= takes the targets as a tensor, got "
                            f"{type(target).__name__}")
        self.flush()  # the frames of the batch that made it
        if batch is None:
            recorded = self.history()["batch"]
            recorded = recorded[recorded <= self.batch]
            batch = int(recorded.max()) if len(recorded) else self.batch
        root = self._recorder.modules[0]
        event = NanEvent(batch=batch_number(batch), module=root.name,
                         module_type=root.type_name, call=0, role=LOSS_ROLE, kind=kind,
                         origin="output", rank=self.rank)
        diagnoser = self._parts.diagnoser
        if diagnoser is not None:
            event.diagnosis = diagnoser.diagnose(event, loss_told=loss_told(loss, target))
        return event

    # ------------------------------------------------------------------ gradients
    def check_grad_norms(self) -> bool:
        """After ``loss.backward()``: flag non-finite or too large gradient norms.

        Computes every parameter's gradient L2 norm in one batched reduction with one host sync,
        records them in :meth:`grad_history` under the batch of the last forward, and adds a
        :class:`GradEvent` for each norm that is non-finite or above ``grad_norm_warn`` (once
        per batch and parameter). Returns whether any norm was flagged; never raises for one
        (skip ``optimizer.step()`` on True). Under torchrun with ``on_nan="raise"`` (the
        ranks stop together), call it on every rank: they agree (one all-reduce), so each
        returns True when any rank flagged a norm (FSDP2 ranks measure their own gradient
        shards) and they all skip the same step. With "warn" or "record" the answer is this
        rank's own (the training callbacks make their decision together themselves). With
        ``grad_scaler``, a non-finite norm is an overflow the scaler skips the step for: not
        flagged (it stays in :meth:`grad_history`).
        """
        flagged = self._parts.grads.check()
        consensus = self._parts.consensus
        if consensus is not None and self.on_nan == "raise":
            return consensus.any_rank(flagged)
        return flagged

    @property
    def scaler_skips(self) -> list[ScalerSkip]:
        """The optimizer steps the ``grad_scaler`` skipped on overflow, oldest first: ``batch``,
        ``scale_before``, ``scale_after`` (not events; empty without a ``grad_scaler``)."""
        scaler = self._parts.scaler
        return list(scaler.skips) if scaler is not None else []

    @property
    def grad_events(self) -> list[GradEvent]:
        """Every :class:`GradEvent` flagged by :meth:`check_grad_norms`."""
        return list(self._parts.grads.events)

    def grad_history(self) -> pd.DataFrame:
        """Gradient norms per batch and parameter (bounded: older batches merged into windows)."""
        return self._parts.grads.history_table()

    # ------------------------------------------------------------------ notebook
    def browse(self) -> Any:
        """The FrameBrowser widget for this watch (needs ipywidgets)."""
        return open_browser(self)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Remove exactly the hooks this watch added (never the user's own); idempotent."""
        if self._recorder.closed:
            return
        unchecked = self._unchecked_note()
        self._recorder.close()
        self._unchecked_at_close = unchecked
        if unchecked:
            warnings.warn(f"nanwidget: {unchecked}", UserWarning, stacklevel=2)

    def _unchecked_note(self) -> str | None:
        """Sentinel mode's note that it checked nothing (see Sentinel.unchecked_note), as it
        stood at close once closed (what ran after is none of this watch's)."""
        parts = self._parts
        if self._recorder.closed:
            return self._unchecked_at_close
        try:
            note = None if parts.sentinel is None else parts.sentinel.unchecked_note()
            return note or self._never_called_note()
        except Exception:  # closing and reporting must always succeed
            return None

    def _never_called_note(self) -> str | None:
        """What to tell a user whose watched model was never called while optimizers stepped:
        the model that trained is another one (a wrapper built a new model for its fit)."""
        recorder = self._recorder
        own = own_call_note(self.model)
        if own:
            # Batches counted and frames held while the model's own forward never returned
            # through its hooks are those of modules called outside it (a GPyTorch model's
            # Softplus constraints): what tells is whether the model itself has a frame.
            table = recorder.history_table()
            if recorder.manual_batches or recorder.events \
                    or (len(table) and bool((table["module"] == "").any())):
                return None
        elif recorder.batch or recorder.manual_batches or recorder.events \
                or recorder.held_frames():
            return None
        steps = steps_taken() - self._steps_at_start
        if steps <= 0:
            return None
        kind = type(self.model).__name__
        if own:
            return (f"This watch checked nothing of its {kind}: no call of it reached the "
                    f"watch while {steps} optimizer step{'s' if steps > 1 else ''} ran. "
                    + own)
        return (f"This watch checked nothing: its {kind} was never called while {steps} "
                f"optimizer step{'s' if steps > 1 else ''} ran, so the model that trained is "
                "another object. A training wrapper may have built a new model for its fit: "
                "skorch's net.fit(X, y) makes a new net.module_ (watch net.module_ after "
                "net.initialize() and train with net.partial_fit(X, y), or make the net with "
                "warm_start=True). Watch the model that the loop calls.")

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """While inside, this thread's hooks record nothing: batch count, ring, history and
        events stay put (trace-mode replays run the model under this)."""
        with self._recorder.suspend():
            yield

    def __enter__(self) -> NanWatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "watching"
        mode = f", {self.mode} mode" + (" (compiled)" if self.compiled else "") \
            if self.mode != "full" else ""
        return (f"<NanWatch {state} {type(self.model).__name__} ({len(self.module_names)} modules"
                f"{mode}), batch {self.batch}, {len(self.events)} event(s)>")


def watch(model: nn.Module, **options: Any) -> NanWatch:
    return NanWatch(model, **options)


watch.__signature__ = signature_of_options(  # type: ignore[attr-defined]
    [inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD)])
watch.__doc__ = f"""Start watching ``model`` (an ``nn.Module``): a frame per module call, a check at
    every batch end; returns the ``NanWatch``. Also a context manager:
    ``with nw.watch(model) as w: ...`` removes the hooks when the block ends.

    Options (all keyword-only; defaults shown):

{options_help(indent="    ")}

    A compiled model (``nw.watch(torch.compile(model))``, ``model.compile()``) is watched in
    sentinel mode: no graph break, no recompile; a NaN/Inf is replayed eagerly in full detail.
    Misuse (a bad value, an unknown option) raises one TypeError or ValueError naming the option.
    """

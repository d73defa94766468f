"""Trace mode: hold recent batches, re-run one op by op, name the op and the line that made a NaN.

Module hooks see module boundaries only; a NaN made by ``torch.sqrt(h - 5)`` between two
submodules, a masked softmax or a custom ``autograd.Function`` can only be reported as "arrived
through the input of module B". Trace mode re-runs the batch exactly (same inputs, same RNG
states, same train/eval flags) under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
that measures every aten op, and names the first op whose output is not finite, its enclosing
module and the innermost line of user code that called it.

Parts: :mod:`.capture` holds batches (a feature of the recorder), :mod:`.shadows` keeps the
model's own tensors untouched, :mod:`.outside` those of the modules a replay runs outside the
model (a GAN's discriminator in the loss), :mod:`.tracer` measures ops and frames, :mod:`.run`
runs a batch again; the result is a :class:`~nanwidget.core.trace.Trace`.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

import torch

from ..events import NanEvent
from ..recorder import Feature, Recorder
from ..sourcelines import user_stacklevel
from ..trace import Trace
from .capture import (BatchCapture, BatchNotHeldError, InputModifiedError, ModelNotReplayableError,
                      ReplayError, MAX_EVENT_BATCHES, MAX_FORWARDS_PER_BATCH)
from .run import OutputGrads, automatic_loss, refuse_unreplayable, replay_held_batch

__all__ = ["Replayer", "BatchCapture", "Trace", "ReplayError", "BatchNotHeldError",
           "ModelNotReplayableError",
           "InputModifiedError", "MAX_AUTO_REPLAYS", "MAX_EVENT_BATCHES", "MAX_FORWARDS_PER_BATCH"]

# Automatic replays (``replay_on_nan=True``) per watch: a diverged run makes an event per batch.
MAX_AUTO_REPLAYS = 4


class Replayer(Feature):
    """Replays held batches on request, and each event's batch with ``replay_on_nan`` (the
    trace is attached before the event is recorded, so files and reports carry it).

    ``loss_fn``: the watch's loss function, run by every automatic replay (within the failing
    step, so a closure sees its targets); it also lets a backward event be replayed.
    ``output_grads(batch)``: the gradients the root's outputs received in the running backward
    pass of ``batch`` (:meth:`~nanwidget.core.grads.backward.BackwardFrames.output_grads`), or
    None; without ``loss_fn`` a backward event is replayed from them.
    """

    reviews_without_event = False  # its review only adds to an event

    def __init__(self, recorder: Recorder, capture: BatchCapture, *, replay_on_nan: bool,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 output_grads: Callable[[int], OutputGrads | None] | None = None) -> None:
        self.recorder = recorder
        self.capture = capture
        self.replay_on_nan = replay_on_nan
        self.loss_fn = loss_fn
        self.output_grads = output_grads
        # The thread whose replay runs (None: none); another thread's replay waits its turn.
        self._replaying_thread: int | None = None
        self._turn = threading.Condition()
        self.auto_replays = 0

    @property
    def replaying(self) -> bool:
        """Whether a replay runs now (in any thread)."""
        return self._replaying_thread is not None

    def replay(self, batch: int, loss_fn: Callable[[Any], torch.Tensor] | None = None,
               expected: NanEvent | None = None,
               output_grads: OutputGrads | None = None) -> Trace:
        """Re-run ``batch`` in trace mode (see :meth:`nanwidget.NanWatch.replay`); ``expected``:
        the event the replay checks for (default: the batch's recorded event);
        ``output_grads``: see :func:`~.run.replay_held_batch`."""
        held = self.capture.batch_to_replay(batch)
        refuse_unreplayable(self.recorder, self.capture, held)
        me = threading.get_ident()
        with self._turn:
            while self._replaying_thread is not None:
                if self._replaying_thread == me:
                    raise ReplayError("a replay is already running (replay() cannot be called "
                                      "from inside the model while it is being replayed)")
                self._turn.wait()  # another thread's replay: one at a time, in turn
            self._replaying_thread = me
        try:
            return replay_held_batch(self.recorder, self.capture, held, loss_fn, expected,
                                     output_grads)
        finally:
            with self._turn:
                self._replaying_thread = None
                self._turn.notify_all()

    def can_replay(self, event: NanEvent) -> bool:
        """Whether an automatic replay can run ``event``'s batch again: a forward event, or a
        backward one with the watch's ``loss_fn`` or the gradients its outputs received (the
        backward pass needs one of them)."""
        return (event.origin != "peer" and not self.replaying
                and (not event.is_backward or self.loss_fn is not None
                     or self._received(event.batch) is not None)
                and event.batch in self.capture.held)

    def _received(self, batch: int) -> OutputGrads | None:
        return self.output_grads(batch) if self.output_grads is not None else None

    def replay_event(self, event: NanEvent) -> Trace:
        """An automatic replay of ``event``'s batch, with the watch's ``loss_fn`` when the batch
        was a training step; a backward event without it runs from the gradients the outputs
        received."""
        loss_fn = automatic_loss(self.capture.batch_to_replay(event.batch), self.loss_fn)
        received = self._received(event.batch) if event.is_backward and loss_fn is None else None
        return self.replay(event.batch, loss_fn, expected=event, output_grads=received)

    def rerun(self, batch: int) -> Trace:
        """Re-run ``batch`` as the watch's own replay at its event would (the FrameBrowser's
        "re-run"): with the watch's ``loss_fn`` when the batch was a training step, and a
        backward event without it from the gradients the outputs received, so that an event
        made in the loss or the backward pass is traced, not only the forward."""
        recorded = [e for e in self.recorder.events if e.batch == batch and e.origin != "peer"]
        event = next((e for e in recorded if not e.is_backward), None) \
            or next((e for e in recorded if e.is_backward), None)
        if event is not None:
            return self.replay_event(event)
        return self.replay(batch, automatic_loss(self.capture.batch_to_replay(batch),
                                                 self.loss_fn))

    def trace_for(self, event: NanEvent) -> Trace | None:
        """A replay of ``event``'s batch for its diagnosis (not attached to the event): None
        when no automatic replay can run it, or when it fails. Raises
        :class:`ModelNotReplayableError` when this process alone cannot run the model (FSDP2,
        tensor parallel), :class:`InputModifiedError` when an input of the batch was written in
        place since (a cache the model fills as it runs: Mamba's states): the diagnosis says why
        it made no replay, and suggests none that would be refused the same way."""
        if not self.can_replay(event):
            return None
        try:
            return self.replay_event(event)
        except (ModelNotReplayableError, InputModifiedError):
            raise
        except Exception:  # the diagnosis goes on from the frames
            return None

    def review_event(self, batch: int, event: NanEvent | None, reason: str) -> NanEvent | None:
        if (event is None or not self.replay_on_nan or event.trace is not None
                or self.auto_replays >= MAX_AUTO_REPLAYS):
            return event
        if not self.can_replay(event):
            if not event.note and event.batch not in self.capture.held \
                    and self.recorder.ran_outside_root(event.batch):
                event.note = ("not replayed: the batch ran through another method than the "
                              "watched model's forward, so its inputs were not held")
            return event
        self.auto_replays += 1
        try:
            event.trace = self.replay_event(event)
        except Exception as error:  # a failed replay must not hide the event itself
            warnings.warn(f"nanwidget: replay_on_nan could not replay batch {event.batch} "
                          f"({type(error).__name__}: {error})", RuntimeWarning,
                          stacklevel=user_stacklevel())
        return event

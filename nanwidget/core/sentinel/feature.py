"""Sentinel mode: check only what leaves the model, replay a failing batch for the detail.

Per batch, with no hook on any module but the root:

- the root module's outputs: every float leaf of any structure (tensors, tuples, dicts,
  dataclasses, ``ModelOutput``) is checked for NaN/Inf (:class:`~.check.NonFiniteCheck`);
- with ``backward=True``, the gradients: every parameter's ``.grad`` when the backward pass
  ends (an autograd final callback queued by a hook on the outputs; when they hold no tensor
  that requires grad, by hooks on the parameters), before any optimizer step can use them; the gradient each output received is held until then, so that a failing
  backward pass can be replayed without the loss function;
- the batch itself stays held for replay (:class:`~nanwidget.core.replay.capture.BatchCapture`:
  references to the inputs, RNG states, modes, version counters).

What the sentinel checks is also what it shows: each checked batch's largest |x| over the
root's outputs (measured by the check itself, no extra read) is the root's row of
``history()`` for that batch and :attr:`Sentinel.outputs_abs_max`. A NaN/Inf made outside the
model, e.g. in a loss computed from its outputs, reaches no output: only the gradient check
(``backward=True``) can see it, once its gradients are non-finite (the watch's ``loss_fn``
runs in replays only, to name the loss's op).

Where the host reads happen (at most one small read per batch): on CPU the native kernel reads
each output where it lies, at the root forward's return (no device, nothing to wait for; without
the kernel the numbers are CPU tensors, read at once); on a GPU the per-tensor numbers are
computed on the device and copied to the host together, once, when the root forward returns
(inference) or, with ``backward=True`` and no DDP consensus, at the end of the backward pass
together with the gradients' numbers (so that the read overlaps with the backward kernels
instead of stalling between forward and backward). A root that ``allow_inf`` covers may put
±inf in its outputs: only a NaN there counts.

On a NaN/Inf the batch is replayed eagerly (:func:`~nanwidget.core.replay.run.replay_frames`:
the original module of a compiled model, every module hooked, every op traced); the recorder's
own verdict is taken once on its frames (:meth:`~nanwidget.core.recorder.Recorder.find_event`),
and the sentinel hands the event and the replayed frames back as a
:class:`~nanwidget.core.records.Finding`, which the recorder takes into its ring, history and
files before the other features review the event. So the event, its frames, ``report()`` and
the trace are what full mode gives. Frames of the
batches before it are replayed too when the event's window needs them and they can be replayed
faithfully (held, weights unchanged since or snapshotted); otherwise the event says they are
missing. When the replay does not reproduce the NaN (compiled kernels compute differently, or
something the replay cannot restore), the event says so plainly, with what was checked.

``sample_every=N`` and ``trace_batches`` batches are recorded in full: module hooks are attached
for that batch only (a compiled model skips module hooks, so its sampled batches are recorded
by an eager replay after the compiled forward instead). Direct calls of a compiled model's
original module that the recorder counts as batches
(:meth:`~nanwidget.core.recorder.Recorder.attach_direct_call_hooks`) are checked, held and
replayed the same way; they ran eagerly, so a NaN that their replay does not meet again gets
no compiled re-run.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from .. import native
from ..detect import event_kind
from ..entries import Entry
from ..events import NOT_REPLAYED, REPEATED_NOTES, NanEvent
from ..frames import Frame, frames_to_dataframe
from ..graph_capture import run_eagerly_under_dynamo
from ..opaque import own_call_note
from ..recorder import Feature, Finding, Recorder
from ..replay.capture import BatchCapture, ReplayError
from ..replay.run import Replayed, automatic_loss, replay_frames
from ..schema import LOCAL_SHARD
from ..stats import local_shard, measure_tensor, storage_holds, version_of
from ..trace import not_through_outputs
from ..writes import steps_taken, written_since
from .check import BadTensor, NonFiniteCheck, checkable, float_leaves
from .compiled import rerun_compiled

__all__ = ["Sentinel", "DEFER_CHOICES"]


def _accumulated(before: tuple[Any, int, int] | None, now: tuple[Any, int, int] | None) -> bool:
    """Whether a gradient's state ``now`` (see ``Sentinel._gradient_states``) is ``before``'s
    after one accumulation into it and nothing else: the same tensor (alive: a weak reference
    cannot mistake a new tensor at a reused address for it), the same storage, one version up
    (the autograd engine adds into an existing ``.grad`` in place; zero_() would add one more)."""
    if before is None or now is None:
        return False
    tensor = before[0]()
    return tensor is not None and tensor is now[0]() and before[1] == now[1] \
        and before[2] + 1 == now[2]


def _parameter_grad_hook(sentinel: Any) -> Any:
    """The hook on a parameter (see :meth:`Sentinel._await_parameter_grads`): its sentinel
    held weakly. The garbage collector does not see a tensor's hooks, so a hook holding the
    sentinel would keep the model and its watch alive once both are dropped without close()."""
    def hook(parameter: torch.Tensor) -> None:
        live = sentinel()
        if live is not None:
            live._parameter_grad_arrived()
    return run_eagerly_under_dynamo(hook)


def _replay_failed(batch: int, error: Exception) -> str:
    """The note of an event whose replay raised: what was seen stays the event."""
    text = " ".join(str(error).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"not replayed: the replay of batch {batch} failed ({type(error).__name__}: {text})"


# The note of a gradient event whose outputs required no grad (see _await_parameter_grads).
_NO_OUTPUT_GRADIENT = ("not replayed: no gradient reached the model's outputs (none of them "
                       "requires grad: what the model returned ran its modules later, as a "
                       "distribution's log_prob does); give the watch loss_fn (loss_fn(output) "
                       "-> loss) to replay the batch through the loss")


# Why a replay's forward can make a NaN its live forward did not, before the backward pass.
_CHANGED_BEFORE_BACKWARD = ("something the forward reads changed between the forward and the "
                            "backward pass (a module attribute or tensor set after the forward, "
                            "which a recompute under activation checkpointing reads as it is "
                            "then)")


def _closest_to_entry(bad: list[BadTensor], frames: list[Frame]
                      ) -> tuple[list[BadTensor], bool]:
    """The non-finite parameter gradients ``bad``, the one whose module ran last in the forward
    (``frames``: a replay's) first, and whether that order could be told (its module ran
    there). The backward pass reaches that module first, so a NaN that came into the backward
    pass spreads from there to the modules that ran before it: it is the one nearest to where
    it came in (the first in the model's order would be the input layer, which every such NaN
    reaches last). Parameters whose module ran in no frame keep their order, after the others."""
    ran = {f.module: f.index for f in frames if f.phase == "forward"}  # its last call
    ordered = sorted(bad, key=lambda b: -ran.get(b.label.rpartition(".")[0], -1))
    return ordered, bool(ordered) and ordered[0].label.rpartition(".")[0] in ran


def _nonfinite_gradients(bad: list[BadTensor], shown: int = 4) -> str:
    """The non-finite parameter gradients in words, for an event that names the first of
    them ("" when it is the only one)."""
    if len(bad) < 2:
        return ""
    names = ", ".join(b.label for b in bad[:shown]) + (" ..." if len(bad) > shown else "")
    return (f"; {len(bad)} parameters have non-finite gradients ({names}): the one named is "
            "of the module that ran last in the forward, where the backward pass met it first")


def _ran_in(event: NanEvent | None) -> bool:
    """Whether the module ``event`` names ran in the replay of its batch."""
    frames = getattr(getattr(event, "trace", None), "frames", None)
    return event is not None and frames is not None and len(frames) > 0 \
        and bool((frames["module"] == event.module).any())


def _stayed_finite(trace: Any, frames: list[Frame], its: str = "") -> str:
    """What a replay that did not meet the NaN checked, in words."""
    checked = f"{its}{len(frames)} module frames and {len(trace.ops)} ops"
    if trace.raised:  # the model's code raised in the replay: the rest did not run
        return f"it stopped where {trace.raised}, and {checked} before that stayed finite"
    return f"{checked} stayed finite"

_Tensor = torch.Tensor
_STRIDED = torch.strided
_INF = math.inf
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)

# When the output check of a training forward is read: "device" (only when it waits for a
# device: GPU), "always" (also on CPU; tests), "never" (at the forward's return).
DEFER_CHOICES = ("device", "always", "never")


class Sentinel(Feature):
    """The sentinel part of a watch (see the module docstring).

    ``compiled``: the model runs compiled code, so sampled batches are recorded by an eager
    replay. ``defer_reads``: see :data:`DEFER_CHOICES` (the facade passes "never" when a DDP
    consensus must exchange every forward's verdict right away). ``loss_fn``: the watch's
    loss function; the replays of training batches run it and its backward (a backward event
    is replayed through it rather than from the gradients the outputs received, so that the
    loss's own ops are traced).
    """

    reviews_without_event = False  # its review only adds to an event

    def __init__(self, recorder: Recorder, capture: BatchCapture, *,
                 sample_every: int | None = None, backward: bool = False,
                 compiled: bool = False, defer_reads: str = "device",
                 loss_fn: Any = None,
                 defer_grad_replays: Callable[[int], bool] | None = None) -> None:
        if defer_reads not in DEFER_CHOICES:
            raise ValueError(f"defer_reads must be one of {DEFER_CHOICES}, got {defer_reads!r}")
        self.recorder = recorder
        self.capture = capture
        self.sample_every = sample_every
        self.trace_batches = recorder.trace_batches
        self.backward = backward
        self.compiled = compiled
        self.defer_reads = defer_reads
        self.loss_fn = loss_fn
        # With a GradScaler: defer_grad_replays(batch) says whether a gradient event of that
        # batch may be an overflow the scaler skips; it is then replayed only once the scaler
        # did not skip its step (detail_grad_event), not at every overflow skipped on purpose.
        self.defer_grad_replays = defer_grad_replays
        self._deferred_grad: tuple[NanEvent, int, Any, list[BadTensor]] | None = None
        # What the tests and the benchmark read: forwards checked, host reads of device
        # numbers, gradient checks, replays run and how long the last event's replay took.
        self.checks = 0
        self.reads = 0
        self.grad_checks = 0
        self.replays = 0
        self.last_replay_seconds = 0.0
        # The root outputs' largest |x| (and its tensor's dtype) in the latest batch whose check
        # was read and found nothing: what a status line shows (NaN before the first).
        self.outputs_batch: int | None = None
        self.outputs_abs_max = float("nan")
        self.outputs_dtype: torch.dtype | None = None
        self._root_name = recorder.modules[0].name
        self._full_batches: list[int] = []  # recent batches recorded in full, live
        # Recent batches of a compiled model that ran eagerly: direct calls of the original
        # module (Recorder.attach_direct_call_hooks); no compiled re-run of those.
        self._eager_batches: list[int] = []
        self._hooked_batch: int | None = None  # module hooks attached for this batch
        self._replay_sample: int | None = None  # compiled: record this batch by eager replay
        self._forward_batch: int | None = None
        self._forward_index = 0
        # (batch, forward index, check) of the root forward that just returned.
        self._check: tuple[int, int, NonFiniteCheck] | None = None
        # (batch, forward index) of the root forward that just raised: no output to check.
        self._raised: tuple[int, int] | None = None
        # The common case (one plain tensor on CPU, read by the native kernel at the forward's
        # return, its row shown at once): whether it may be taken (not with reads deferred on
        # purpose, nor without the kernel).
        self._read_at_once = defer_reads != "always" and native.available()
        self._read_floats = native.contiguous_reader()
        # Checks whose read waits for the end of the backward pass (see the module docstring).
        self._deferred: list[tuple[int, int, NonFiniteCheck]] = []
        # batch -> per root forward: the gradient each output leaf received (by role).
        self._output_grads: dict[int, list[dict[str, torch.Tensor] | None]] = {}
        self._queued_task: int | None = None
        # The hooks on the parameters that tell the end of a backward pass through outputs
        # that require no grad (see _await_parameter_grads; None: not needed yet), and the
        # latest batch whose outputs were such.
        self._parameter_hooks: list[Any] | None = None
        self._lazy_batch: int | None = None
        self._grad_batch: int | None = None
        # The other batches whose outputs the same backward pass reached (model(a), model(b),
        # one loss: two batches when batches are numbered automatically).
        self._pass_batches: list[int] = []
        self._own_event: NanEvent | None = None  # the last event the sentinel made itself
        # The last forward and backward events it made (a cause that persists is not replayed
        # at every later batch: see _persisting_weight, _repeated_gradient), and the batch
        # whose forward event repeated one.
        self._last_forward: NanEvent | None = None
        self._last_backward: NanEvent | None = None
        self._repeated_forward: int | None = None
        # The weights holding a NaN/Inf when the last forward weight event was replayed: a
        # repeat is told without a replay only while no other weight joined them.
        self._bad_weights: frozenset[str] = frozenset()
        self._forward_since = self._backward_since = 0  # where the repeated cause was found
        # Parameter -> (its gradient, weakly; storage; version) when a backward pass ended with
        # it non-finite: the next pass tells an accumulation into it from a new one.
        self._bad_gradients: dict[str, tuple[Any, int, int]] = {}
        self._params = [i for i, is_buffer in enumerate(capture.slots.is_buffer) if not is_buffer]
        # The gradient check in one C call (None without the extension), on the slots'
        # containers and keys (fixed for the capture's life).
        self._grads_clean_in_c = native.grads_clean_reader()
        self._slot_containers, self._slot_keys = capture.slots.containers, capture.slots.keys
        self._root_may_hold_inf = recorder.modules[0].name in recorder.inf_allowed
        # The kernel's output buffers, reused: one for forwards (under the lock), one for the
        # end of backward passes (autograd's thread).
        self._result = native.result_buffer()
        self._grad_result = native.result_buffer()
        # The weights' versions and the optimizer steps when the watch began: a model trained
        # without its own forward ever being called was checked by nothing (unchecked_note).
        self._start_versions = [-1 if t is None else version_of(t) for t in capture.slots.read()]
        self._start_steps = steps_taken()
        # A wrapper's other methods call the model it wraps, not the root (peft's generate()
        # calls get_base_model()): the recorder counts those calls, made outside the root's
        # forward, as batches of their own, checked, held and replayed as the root's are.
        # (batch, forward index) -> that model's info, for the recent ones.
        self._entered: dict[tuple[int, int], Any] = {}
        wrapped = None if compiled else _wrapped_model(recorder)
        #: The name of the model whose calls outside the root count so, or None.
        self.outside_entry = wrapped.name if wrapped is not None \
            and recorder.count_outside_calls(wrapped.module) else None

    # ------------------------------------------------------------------ hot path (under the lock)
    def on_batch_start(self, batch: int, args: tuple, kwargs: dict) -> None:
        if self._deferred_grad is not None and self._deferred_grad[1] != batch:
            self._deferred_grad = None  # its step is over: the scaler skipped it
        if batch != self._forward_batch:
            self._forward_batch = batch
            self._forward_index = 0
            if self._output_grads:  # a backward that never came: let its gradients go
                # (those of batches still held for a pass that may cover them too, kept)
                awaiting = self.capture.awaiting_backward
                self._output_grads = {b: g for b, g in self._output_grads.items()
                                      if b == batch or b in awaiting}
        else:
            self._forward_index += 1
        if self.recorder.direct_call:
            if not self.compiled:
                return self._entered_outside(batch)
            if batch not in self._eager_batches:
                self._eager_batches = (self._eager_batches + [batch])[-8:]
        if batch in self.trace_batches or (self.sample_every and batch % self.sample_every == 0):
            if self.compiled:
                self._replay_sample = batch
            elif self._hooked_batch != batch:
                self.recorder.attach_module_hooks()
                self._hooked_batch = batch
                self._full_batches = (self._full_batches + [batch])[-8:]
        elif self._hooked_batch is not None:
            self._detach()

    def _entered_outside(self, batch: int) -> None:
        """A batch opened by a call of the wrapped model outside the root's forward (a step of
        peft's generate()): checked and held like a root forward, replayed by calling that
        model; never recorded in full (sample_every, trace_batches), which would hook every
        module for it."""
        info = self.recorder.batch_entry
        entered = self._entered
        entered[(batch, self._forward_index)] = info
        if len(entered) > 64:
            del entered[next(iter(entered))]
        self.capture.called_instead(batch, info.module)
        if self._hooked_batch is not None:
            self._detach()

    def _entry_of(self, batch: int, forward: int | None = None) -> Any:
        """The module whose call made that forward of ``batch`` (any forward: None): the
        root's info, or the wrapped model's for a call outside the root's forward."""
        entered = self._entered
        if entered:
            if forward is not None:
                info = entered.get((batch, forward))
                if info is not None:
                    return info
            else:
                for (number, _), info in entered.items():
                    if number == batch:
                        return info
        return self.recorder.modules[0]

    def on_batch_output(self, batch: int, output: Any) -> None:
        if type(output) is _Tensor and self._read_at_once and self._hooked_batch != batch \
                and output.layout is _STRIDED and not output.is_nested:
            # The common case (one plain tensor on CPU): the native kernel reads it now; clean,
            # its row is shown at once and nothing is kept (its check would not wait for the
            # backward pass). Else (NaN/Inf, or a tensor the kernel does not take) the general
            # check below says which.
            try:
                clean = self._read_floats(output, self._result)
            except RuntimeError:  # no data pointer (within vmap or grad): the general check
                clean = None
            if clean is not None and clean[1] < _INF:
                self.checks += 1
                self._check = None
                # _show_outputs, inlined (every batch)
                self.outputs_batch, self.outputs_abs_max, self.outputs_dtype = \
                    batch, clean[1], output.dtype
                self.recorder.add_history_row(
                    batch, self._entry_of(batch, self._forward_index).name if self._entered
                    else self._root_name, clean[1], clean[0])
                if self.backward and torch.is_grad_enabled():
                    if output.requires_grad:
                        self._hook_output_grads(batch, self._forward_index, [("output", output)])
                    else:
                        self._await_parameter_grads(batch)
                return
        unread: list[str] = []
        leaves = float_leaves(output, unread=unread)
        if unread:
            self.recorder.warn_unread(unread)
        forward = self._forward_index
        check = None
        if self._hooked_batch != batch:  # a batch recorded in full is checked by its frames
            check = NonFiniteCheck([(role, values) for role, _, values in leaves],
                                   result=self._result)
            self.checks += 1
        hooked = False
        if self.backward and torch.is_grad_enabled():
            needing = [(role, leaf) for role, leaf, _ in leaves if leaf.requires_grad]
            if needing:
                self._hook_output_grads(batch, forward, needing)
                hooked = True
            else:
                self._await_parameter_grads(batch)
        if check is not None:
            # A training forward's check on a device is read with the gradients' (one read per
            # batch); one that never sees its backward is read at the next forward's return.
            if hooked and (self.defer_reads == "always" or self.defer_reads == "device"
                           and check.on_device):
                self._deferred.append((batch, forward, check))
            else:
                self._check = (batch, forward, check)

    def on_batch_raised(self, batch: int, error: BaseException) -> None:
        # Its inputs are checked at the verdict, outside the lock (a host read, only here).
        self._raised = (batch, self._forward_index)

    def _hook_output_grads(self, batch: int, forward: int,
                           needing: list[tuple[str, torch.Tensor]]) -> None:
        """Hold the gradient each of these output leaves receives (for a backward replay)
        and check the parameters' gradients when the backward pass through them ends."""
        grads = self._output_grads.setdefault(batch, [])
        self.capture.await_backward(batch)
        grads.extend([None] * (forward + 1 - len(grads)))
        grads[forward] = {}
        for role, leaf in needing:
            node = leaf.grad_fn
            if node is None:  # an output that is a leaf itself (a parameter returned as is)
                leaf.register_hook(partial(self._output_grad, batch, forward, role))
            else:
                # A hook on the node that made the output sees the gradient the output
                # received, as a hook on the tensor does (after the tensor's own hooks, so a
                # hook of the user's that rescales it is seen as the node got it), at less
                # than half the cost: Tensor.register_hook takes about 14 us inside a training
                # loop, this about 6.
                node.register_prehook(partial(self._node_grad, batch, forward, role,
                                              leaf.output_nr))

    def _await_parameter_grads(self, batch: int) -> None:
        """A training forward whose outputs hold no tensor that requires grad: it returned
        something whose later use runs the modules (a distribution whose log_prob does, a
        closure), so no output hook can tell when its backward pass ends. Hooks on the
        trainable parameters do instead: installed at the first such forward (never in a model
        whose outputs require grad), their first call in a pass queues the end-of-backward
        check for the latest batch, as an output's gradient does."""
        if self._parameter_hooks is None:
            self._parameter_hooks = self._hook_parameters()
        if self._parameter_hooks:
            self._lazy_batch = batch
            self.capture.await_backward(batch)

    def _hook_parameters(self) -> list[Any]:
        hook = _parameter_grad_hook(weakref.ref(self))
        slots = self.capture.slots.read()
        handles = []
        for i in self._params:
            parameter = slots[i]
            if isinstance(parameter, _Tensor) and parameter.requires_grad:
                try:
                    handles.append(parameter.register_post_accumulate_grad_hook(hook))
                except Exception:  # not a leaf, or a subclass that refuses hooks
                    continue
        return handles

    def _parameter_grad_arrived(self) -> None:
        """A parameter's gradient was accumulated: queue the end-of-backward check once per
        pass, unless an output's gradient queued it already (outputs come first in a pass) or
        the latest forward's outputs required grad (their hooks tell its pass)."""
        batch = self._lazy_batch
        if batch is None or batch != self._forward_batch or self.recorder.closed:
            return
        task = _graph_task_id()
        if self._queued_task != task:
            self._queue_backward_check(batch, task)

    def on_batch_end(self, batch: int, frames: list[Frame]) -> None:
        if self._hooked_batch == batch:
            self._detach()

    def _detach(self) -> None:
        self.recorder.detach_module_hooks()
        self._hooked_batch = None

    # ------------------------------------------------------------------ verdicts
    def find_event(self, batch: int, event: NanEvent | None, reason: str) -> Finding | None:
        """At the end of a forward: read this batch's output check (and any earlier one whose
        backward never came); a NaN/Inf is replayed into its event and frames. When the
        watch closes, a weight an optimizer step made NaN/Inf that no forward met since."""
        if reason == "close":
            return self._written_after_last_forward(batch) if event is None else None
        if reason != "forward":
            return None
        if self._raised is not None:  # the root forward raised: no output was checked
            raised, self._raised = self._raised, None
            if event is None and raised[0] == batch:
                finding = self._raised_forward_event(batch, raised[1])
                if finding is not None:
                    return finding
        pending, self._check = self._check, None
        if pending is None and event is None and not self._deferred:
            # The common case, in short (a clean output read at once, shown already).
            return None if self._replay_sample != batch else self._record_by_replay(batch)
        stale = [d for d in self._deferred if d[0] != batch]  # a backward never came for them
        if stale:
            self._deferred = [d for d in self._deferred if d[0] == batch]
            for old_batch, forward, old_check in stale:
                bad = self._read(old_check, old_batch, forward)
                if bad and event is None:
                    return self._forward_event(old_batch, forward, bad)
        if event is not None:
            return None  # found in a batch recorded in full: the review adds the op trace
        if pending is not None:
            bad = self._read(pending[2], pending[0], pending[1])
            if bad:
                return self._forward_event(pending[0], pending[1], bad)
        if self._replay_sample == batch:
            return self._record_by_replay(batch)
        return None

    def review_event(self, batch: int, event: NanEvent | None, reason: str) -> NanEvent | None:
        # An event the recorder found in a batch recorded in full gets the op trace a sentinel
        # event has (the sentinel's own events carry theirs already, or say why not).
        if (reason == "forward" and event is not None and event.trace is None
                and event is not self._own_event and event.origin != "peer"
                and not event.is_backward):
            self._attach_trace(event)
        return event

    def _read(self, check: NonFiniteCheck, batch: int, forward: int) -> list[BadTensor]:
        if check.waiting:
            self.reads += 1
        bad = check.read()
        if bad and self._root_may_hold_inf:  # allow_inf covers the root: only a NaN counts
            bad = [b for b in bad if b.nan]
        if not bad:
            self._show_outputs(batch, forward, check)
        return bad

    def _show_outputs(self, batch: int, forward: int, check: NonFiniteCheck) -> None:
        """A clean check's magnitude: the root's row in the history (the wrapped model's, for
        its calls outside the root), and the latest values."""
        if check.abs_max == check.abs_max:  # measured (not NaN)
            self.outputs_batch, self.outputs_abs_max, self.outputs_dtype = \
                batch, check.abs_max, check.abs_max_dtype
            self.recorder.add_history_row(batch, self._entry_of(batch, forward).name,
                                          check.abs_max, check.abs_min)

    # ------------------------------------------------------------------ gradients
    @run_eagerly_under_dynamo
    def _node_grad(self, batch: int, forward: int, role: str, index: int,
                   grad_outputs: tuple) -> None:
        """The hook on the node that made an output leaf: its gradient is the node's
        ``index``-th (the leaf's ``output_nr``); none when that gradient is undefined."""
        grad = grad_outputs[index] if index < len(grad_outputs) else None
        if grad is not None:
            self._output_grad(batch, forward, role, grad)
        return None

    def _output_grad(self, batch: int, forward: int, role: str, grad: torch.Tensor) -> None:
        """The hook on an output leaf (bound to its batch, forward and role): hold the gradient
        it received and queue the end-of-backward check once per backward pass."""
        if self.recorder.closed:
            return None
        # Looked up now, not bound to the hook: an earlier backward pass through these outputs
        # (a gradient penalty's torch.autograd.grad) took the batch's gradients when it ended,
        # and this pass's own must still be held for its replay.
        grads = self._output_grads.get(batch)
        if grads is None:
            grads = self._output_grads[batch] = []
        if forward >= len(grads):
            grads.extend([None] * (forward + 1 - len(grads)))
        slot = grads[forward]
        if slot is None:
            slot = grads[forward] = {}
        slot[role] = grad
        task = _graph_task_id()
        if self._queued_task != task:
            self._queue_backward_check(batch, task)
        elif batch != self._grad_batch and batch not in self._pass_batches:
            self._pass_batches.append(batch)
        return None

    def _queue_backward_check(self, batch: int, task: int) -> None:
        self._queued_task = task
        self._grad_batch = batch
        if self._pass_batches:
            self._pass_batches = []
        # Requeued once it runs, so that it comes after DDP's / FSDP's own final callbacks
        # (their reductions): raising before them leaves DDP's reducer mid-pass.
        torch.autograd.Variable._execution_engine.queue_callback(self._requeue_last)

    @run_eagerly_under_dynamo  # autograd calls it at the pass's end
    def _requeue_last(self) -> None:
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        except RuntimeError:
            self._backward_done()

    @run_eagerly_under_dynamo  # autograd calls it at the pass's end
    def _backward_done(self) -> None:
        """The autograd engine finished a backward pass through the outputs of ``_grad_batch``."""
        self._queued_task = None
        recorder = self.recorder
        batch = self._grad_batch
        if batch is None or recorder.closed:
            return
        finding = None
        try:
            grads = self._output_grads.pop(batch, None)
            others = {b: self._output_grads.pop(b, None) for b in self._pass_batches}
            self.capture.backward_came([batch, *others] if others else [batch])
            deferred = []
            if self._deferred:  # none in the usual CPU step: no lists built for it
                deferred = [d for d in self._deferred if d[0] == batch]
                self._deferred = [d for d in self._deferred if d[0] != batch]
            if self._grads_clean(deferred):  # the usual CPU step
                self.grad_checks += 1
                if self._bad_gradients:
                    self._bad_gradients = {}
            else:
                finding = self._check_backward(batch, grads, deferred, self.capture.slots.read(),
                                               others)
        except Exception as error:
            recorder.internal_error(error)
            finding = None
        # Also with nothing found: the end of a backward pass is a boundary every rank reaches,
        # where the DDP consensus exchanges its flag on every rank (gradients differ between
        # ranks under FSDP2 and no_sync(), so the others may not have found anything).
        recorder.conclude(batch, finding, reason="backward", raising=True)

    def _check_backward(self, batch: int, grads: list | None, deferred: list,
                        slots: list, others: dict[int, list | None] | None = None
                        ) -> Finding | None:
        """The general check at the end of a backward pass: the parameters' gradients and the
        output checks that waited for it, read together; what they found, replayed."""
        names = self.capture.slots.names
        grad_check = NonFiniteCheck(((names[i], checkable(slots[i].grad)) for i in self._params
                                     if slots[i] is not None and slots[i].grad is not None),
                                    fused=True, result=self._grad_result)
        self.grad_checks += 1
        waiting = [c for _, _, c in deferred if c.waiting] + \
            ([grad_check] if grad_check.waiting else [])
        if waiting:
            self.reads += 1
            NonFiniteCheck.read_together(waiting)
        finding = None
        for forward_batch, forward, check in deferred:
            bad = check.read()
            if bad and self._root_may_hold_inf:
                bad = [b for b in bad if b.nan]
            if not bad:
                self._show_outputs(forward_batch, forward, check)
            if bad:
                finding = self._forward_event(forward_batch, forward, bad)
                break
        if finding is not None and finding.event is not None:
            return finding
        bad_grads = grad_check.read()
        inherited = self._bad_gradients
        self._bad_gradients = self._gradient_states(bad_grads, slots)
        if bad_grads and self.defer_grad_replays is not None \
                and self.defer_grad_replays(batch):
            event = self._grad_event(batch, bad_grads, "")
            self._deferred_grad = (event, batch, grads, bad_grads)
            return Finding(event)
        if bad_grads:
            if all(_accumulated(inherited.get(b.label), self._bad_gradients.get(b.label))
                   for b in bad_grads):
                # Every one was non-finite when the last pass ended and only accumulated
                # since: no new cause to replay (zero_grad() clears them).
                return self._found(self._repeated_gradient(batch, bad_grads), None, None,
                                   repeat=True)
            return self._backward_event_of_pass(batch, grads, bad_grads, others)
        return finding

    def _backward_event_of_pass(self, batch: int, grads: list | None, bad: list[BadTensor],
                                others: dict[int, list | None] | None) -> Finding:
        """The event of a backward pass that reached the outputs of ``batch`` (and of
        ``others``: earlier batches of one step, numbered automatically): the batches are
        replayed latest first (the order autograd runs their backward in, and so full mode's
        verdict) until one meets a non-finite value; when none does, the event is of the
        earliest of them in which the named parameter's module ran, as in full mode."""
        def met(finding: Finding) -> bool:  # no event to record, or a replay that met it
            event = finding.event
            return event is None or (event.trace is not None and event.trace.reproduced)

        first = self._backward_event(batch, grads, bad)
        if not others or met(first) or first.event.trace is None:  # type: ignore[union-attr]
            return first  # found, or not replayed at all (an earlier batch would not be either)
        earliest = first
        for other in sorted(others, reverse=True):
            finding = self._backward_event(other, others[other], bad)
            if met(finding):
                return finding
            if _ran_in(finding.event):
                earliest = finding
        # No replay met it: the batch full mode names, the earliest of the pass in which the
        # named parameter's module ran (its backward there ran last: the parameter's gradient
        # is complete there, and full mode puts it in that frame).
        return earliest

    def _grads_clean(self, deferred: list) -> bool:
        """Whether, with no deferred finding, every parameter's gradient is a tensor the native
        kernel reads (dense, contiguous, on CPU) and all of them are finite: the usual step,
        checked without a :class:`NonFiniteCheck`, in one C call on the parameters' slots where
        the extension is built (no list of them made). False also when one is not such a
        tensor (the general check then looks at them all)."""
        if deferred:
            return False
        if self._grads_clean_in_c is not None:
            clean = self._grads_clean_in_c(self._slot_containers, self._slot_keys, self._params)
            if clean is not None:
                return clean
        return native.grads_clean(self.capture.slots.read(), self._params, self._read_floats,
                                  self._grad_result)

    def detail_grad_event(self, event: NanEvent) -> Finding:
        """The gradient event found at the end of a backward pass and held (a GradScaler
        decides whether it is one), replayed now into its full detail."""
        deferred, self._deferred_grad = self._deferred_grad, None
        if deferred is None or deferred[0] is not event:
            return Finding(event)
        _, batch, grads, bad = deferred
        return self._backward_event(batch, grads, bad)

    # ------------------------------------------------------------------ replays
    def _found(self, event: NanEvent, replayed: Replayed | None, found: NanEvent | None,
               frames: list[list[Frame]] = (), started: float | None = None,
               repeat: bool = False) -> Finding:
        """What the sentinel hands the recorder: ``event`` with the trace of ``replayed``
        explained by the verdict on its frames (``found``: whether and where the replay met the
        event), and the frames the replays made."""
        if replayed is not None:
            event.trace = replayed.conclude(found, event)
        if started is not None:
            self.last_replay_seconds = time.perf_counter() - started
        self._own_event = event
        if event.is_backward:
            self._last_backward = event
            self._backward_since = self._backward_since if repeat else event.batch
        else:
            self._last_forward = event
            self._forward_since = self._forward_since if repeat else event.batch
            if not repeat and event.origin == "weight":
                self._bad_weights = frozenset(self._nonfinite_weights())
        return Finding(event, frames)

    def _forward_event(self, batch: int, forward: int, bad: list[BadTensor]) -> Finding:
        """The event of a forward whose outputs held a NaN/Inf: replayed in full detail."""
        repeat = self._persisting_weight(batch, forward)
        if repeat is not None:
            self._repeated_forward = batch
            return self._found(repeat, None, None, repeat=True)
        started = time.perf_counter()
        try:
            held = self.capture.batch_to_replay(batch)
        except ReplayError as error:
            return self._found(self._unreplayed(batch, forward, bad, f"not replayed: {error}"),
                               None, None)
        try:
            replayed = replay_frames(self.recorder, self.capture, held, trace_ops=True,
                                     loss_fn=automatic_loss(held, self.loss_fn))
        except ReplayError as error:  # refused before running (FSDP2, a changed model)
            return self._found(self._unreplayed(batch, forward, bad, f"not replayed: {error}"),
                               None, None)
        except Exception as error:  # the NaN was seen: a failed replay must not lose it
            return self._found(self._unreplayed(batch, forward, bad, _replay_failed(batch, error)),
                               None, None)
        self.replays += 1
        frames = replayed.frames
        context = _Context(self, batch)
        found = self.recorder.find_event(frames, context.window)  # the one verdict
        if found is None:  # nothing to record: the replay's frames stayed finite
            event = self._not_reproduced(batch, forward, bad, replayed.trace, frames, held)
            return self._found(event, replayed, found, started=started)
        maker = self._made_outside_forward(batch, forward, found, frames)
        if maker is not None:
            return self._found(maker, replayed, None, context.replayed + [frames], started)
        if context.missing:
            found.frames_note = context.missing
        return self._found(found, replayed, found, context.replayed + [frames], started)

    def _raised_forward_event(self, batch: int, forward: int) -> Finding | None:
        """A root forward that raised left no output to check; its held inputs are checked (one
        reduction each). A NaN/Inf there (a bad observation that made a distribution refuse its
        logits) is replayed, up to the exception, into its event as full mode records it; so is
        a NaN/Inf weight when the inputs are finite (a fake quantizer refusing a NaN weight's
        zero point). None when both are finite: the exception is not this watch's (an OOM, a
        shape error)."""
        held = self.capture.held.get(batch)
        if held is None or forward >= len(held.forwards):
            return None
        check = NonFiniteCheck(_readable(held.forwards[forward].inputs))
        bad = check.read()
        if bad and self._root_may_hold_inf:
            bad = [b for b in bad if b.nan]
        # Buffers, and weights this forward wrote before it raised (a fake quantizer's scale,
        # computed from a NaN weight, written by a fused op that moves no version counter):
        # the replay starts from them as they are now, so it meets them first; a non-finite
        # parameter among the rest is the cause.
        capture = held.forwards[forward]
        slots = self.capture.slots
        written = {name for name, tensor, version, is_buffer in zip(
                       slots.names, slots.read(), capture.weight_versions or (), slots.is_buffer)
                   if is_buffer or (tensor is not None and version_of(tensor) != version)}
        weight = None if bad else self._first_nonfinite_weight(written)
        if not bad and weight is None:
            return None

        def unreplayed(note: str) -> NanEvent:
            if bad:
                return self._bad_input_event(batch, forward, bad, note)
            return NanEvent(batch=batch, module=weight[0].name, module_type=weight[0].type_name,
                            call=0, role=weight[1].role,
                            kind=event_kind(weight[1].stats.nan, weight[1].stats.inf),
                            origin="weight", rank=self.recorder.rank, note=note)

        started = time.perf_counter()
        try:
            replayed = replay_frames(self.recorder, self.capture,
                                     self.capture.batch_to_replay(batch), trace_ops=True)
        except ReplayError as error:  # refused (FSDP2, a changed model, an input written)
            return self._found(unreplayed(f"not replayed: {error}"), None, None)
        except Exception as error:  # the NaN was seen: a failed replay must not lose it
            return self._found(unreplayed(_replay_failed(batch, error)), None, None)
        self.replays += 1
        frames = replayed.frames
        context = _Context(self, batch)
        found = self.recorder.find_event(frames, context.window)
        if found is None:
            event = unreplayed(
                f"not reproduced by an eager replay of batch {batch}: "
                f"{_stayed_finite(replayed.trace, frames, 'its ')}")
            return self._found(event, replayed, found, started=started)
        cause = None if weight is None else \
            f"{weight[0].name}.{weight[1].role}" if weight[0].name else weight[1].role
        if cause is not None and cause not in written and found.origin == "weight" \
                and found.qualified_role in written:
            event = unreplayed(
                f"the replay of batch {batch} met {found.qualified_role} first: the failed "
                f"forward likely wrote it from the non-finite {cause} before it raised, and a "
                "replay starts from it as that forward left it")
            return self._found(event, replayed, None, context.replayed + [frames], started)
        if context.missing:
            found.frames_note = context.missing
        return self._found(found, replayed, found, context.replayed + [frames], started)

    def _written_after_last_forward(self, batch: int) -> Finding | None:
        """At close, with no event recorded: a parameter an optimizer step wrote NaN/Inf after
        the last forward this watch checked. A model trained through other methods than its
        forward (Stable-Baselines3's PPO trains through ``policy.evaluate_actions``) met it
        there, outside the root's calls, and raised on it (a ``Normal`` refusing a NaN mean) or
        stopped, so no forward's output ever showed it. Its event is the next batch's, the
        first that would use it, as a weight event (the diagnosis tells the step that wrote
        it). At close only: one finiteness read of each parameter a step wrote."""
        if self.recorder.events or not self.checks:  # not called at all: unchecked_note
            return None
        slots, steps = self.capture.slots, self._start_steps
        tensors = slots.read()
        if not any(tensors[i] is not None and written_since(tensors[i], steps)
                   for i in self._params):
            return None
        bad = None
        for i in self._params:
            tensor = tensors[i]
            if tensor is None or not written_since(tensor, steps):
                continue
            values = checkable(tensor)
            if values is not None and storage_holds(values) \
                    and not bool(torch.isfinite(values).all()):
                bad = slots.names[i]
                break
        if bad is None:
            return None
        weight = self._first_nonfinite_weight(set())
        if weight is None:
            return None
        info, entry = weight
        return self._found(NanEvent(
            batch=batch, module=info.name, module_type=info.type_name, call=0, role=entry.role,
            kind=event_kind(entry.stats.nan, entry.stats.inf), origin="weight",
            rank=self.recorder.rank,
            note=f"found when the watch closed: an optimizer step wrote it after the last "
                 f"forward of the model (batch {batch - 1}), and no forward ran since; a pass "
                 "through other methods than the model's forward (Stable-Baselines3's "
                 "evaluate_actions) may have met it, and raised or stopped there"), None, None)

    def _made_outside_forward(self, batch: int, forward: int, found: NanEvent,
                              frames: list[Frame]) -> NanEvent | None:
        """The event of a weight that made the forward's input non-finite outside the
        forward: the replay met the NaN/Inf first in the batch's inputs while a weight of a
        module that did not run in it holds one. generate() runs a model's encoder (BART's,
        T5's) or its vision tower (Llava's get_image_features) once, before the forwards, and
        hands them its output (encoder_outputs=, mm_encoder_outputs=); full mode, whose hooks
        see that call, records the weight's event. None otherwise (at event time only: it
        reads every weight)."""
        held = self.capture.held.get(batch)
        if found.origin != "input" or found.is_backward or held is None \
                or forward >= len(held.forwards):
            return None
        bad = NonFiniteCheck(_readable(held.forwards[forward].inputs)).read()
        if not bad:
            return None  # it came from a functional op between modules, not with the inputs
        ran = {frame.module for frame in frames if frame.phase == "forward"}
        weight = self._first_nonfinite_weight(set(), skip=ran)
        if weight is None:
            return None
        info, entry = weight
        name = f"{info.name}.{entry.role}" if info.name else entry.role
        return NanEvent(
            batch=batch, module=info.name, module_type=info.type_name, call=0,
            role=entry.role, kind=event_kind(entry.stats.nan, entry.stats.inf), origin="weight",
            rank=self.recorder.rank,
            note=f"the replay of batch {batch} met the NaN/Inf first in the forward's "
                 f"{bad[0].label}, while {name} holds one and its module did not run in the "
                 "forward: a call of it outside the forward (generate() runs the encoder or the "
                 "vision tower once, before the forwards) made that input")

    def _bad_input_event(self, batch: int, forward: int, bad: list[BadTensor],
                         note: str) -> NanEvent:
        """The event of a non-finite input of the root forward (``bad``), where no replay
        named the module that met it first."""
        root = self._entry_of(batch, forward)
        first = bad[0]
        return NanEvent(batch=batch, module=root.name, module_type=root.type_name, call=forward,
                        role=first.label, kind=first.kind, origin="input",
                        rank=self.recorder.rank, note=note)

    def _backward_event(self, batch: int, grads: list | None,
                        bad: list[BadTensor]) -> Finding:
        """The event of a backward pass that left a non-finite gradient: the batch's forward
        and backward replayed from the gradients its outputs received."""
        if self._repeated_forward == batch:
            # Its forward event repeated a persisting weight's (_persisting_weight): its
            # gradients are non-finite for the same reason, told without a replay.
            return self._found(self._repeated_gradient(batch, bad), None, None, repeat=True)
        started = time.perf_counter()
        try:
            held = self.capture.batch_to_replay(batch)
        except ReplayError as error:
            return self._found(self._grad_event(batch, bad, f"not replayed: {error}", grads),
                               None, None)
        loss_fn = automatic_loss(held, self.loss_fn)
        if not grads and loss_fn is None:
            note = _NO_OUTPUT_GRADIENT if batch == self._lazy_batch else (
                f"{NOT_REPLAYED}no gradient reached the model's outputs of batch {batch} in this "
                f"backward pass: {not_through_outputs(batch)}")
            return self._found(self._grad_event(batch, bad, note), None, None)
        try:
            replayed = replay_frames(self.recorder, self.capture, held, trace_ops=True,
                                     output_grads=grads, backward_frames=True, loss_fn=loss_fn)
        except ReplayError as error:  # refused before running (FSDP2, a changed model)
            return self._found(self._grad_event(batch, bad, f"not replayed: {error}", grads),
                               None, None)
        except Exception as error:  # the NaN was seen: a failed replay must not lose it
            return self._found(self._grad_event(batch, bad, _replay_failed(batch, error), grads),
                               None, None)
        self.replays += 1
        frames = replayed.frames
        forward_event = self._forward_event_recorded(batch)
        if batch in self._full_batches or forward_event:
            # Its forward frames were recorded live, or taken with its forward event: only the
            # backward ones are new (recorded whatever the verdict, as full mode would have).
            # The verdict is theirs alone: a forward event already recorded is not found again
            # (the non-finite gradients came from it).
            forward = [f for f in frames if f.phase != "backward"]
            frames = [f for f in frames if f.phase == "backward"]
            context = None
            found = self.recorder.find_event(frames, _after(forward, self.recorder.max_frames))
            taken = [frames]
            if found is None and forward_event:
                return Finding(None, taken)  # full mode records no second event either
        else:
            context = _Context(self, batch)
            found = self.recorder.find_event(frames, context.window)
            taken = context.replayed + [frames] if found is not None else []
            differs = self._replay_outputs_differ(found, frames)
            if differs:
                # The live forward's outputs were checked finite: the replay's forward NaN is
                # not that forward's. The event is the gradient one, as full mode records it
                # (the backward's recompute, not the forward, met the NaN).
                bad, _ = _closest_to_entry(bad, replayed.frames)
                replayed.trace.changes.append(
                    f"the replay's forward made a NaN ({differs}) that the live forward of batch "
                    f"{batch} did not (its outputs were checked finite): {_CHANGED_BEFORE_BACKWARD}")
                event = self._grad_event(batch, bad, (
                    f"its live forward stayed finite, but the replay's forward made a NaN "
                    f"({differs}): something the forward reads changed before the backward pass "
                    "(see the trace's changes)"))
                return self._found(event, replayed, found, [], started)
        if found is None:
            ordered = False
            if not replayed.trace.raised:  # (else only part of the forward ran: no order)
                bad, ordered = _closest_to_entry(bad, replayed.frames)
            event = self._grad_event(batch, bad, f"not reproduced by an eager replay of batch "
                                                 f"{batch} "
                                                 f"({_stayed_finite(replayed.trace, frames)})"
                                                 f"{_nonfinite_gradients(bad) if ordered else ''}")
            return self._found(event, replayed, found, taken, started)
        if context is not None and context.missing:
            found.frames_note = context.missing
        return self._found(found, replayed, found, taken, started)

    def _replay_outputs_differ(self, found: NanEvent | None, frames: list[Frame]) -> str:
        """Where the replay's forward made the NaN ``found`` names, when that NaN reached the
        root's outputs, which the sentinel checked finite when the batch ran (so the live
        forward did not make it); "" otherwise: no forward event, or one that stayed inside the
        model as it may have live too (a NaN that ``where`` discards)."""
        if found is None or found.is_backward:
            return ""
        root = self._entry_of(found.batch).name
        for frame in frames:
            if frame.module == root and frame.phase == "forward" and any(
                    entry.stats is not None and (entry.stats.nan or entry.stats.inf
                                                 and not self._root_may_hold_inf)
                    for entry in frame.outputs()):
                return f"'{found.module}' {found.role}: {found.kind}"
        return ""

    # ------------------------------------------------------------------ causes that persist
    def _persisting_weight(self, batch: int, forward: int) -> NanEvent | None:
        """The event of a forward made non-finite by the weight the previous event found
        non-finite, which still is: told without a replay. A corrupted weight stays so until
        it is mended, and with on_nan "warn" or "record" every later batch would replay the
        model to find it again. None when that is not the case (the batch is replayed)."""
        last = self._last_forward
        if last is None or last.origin != "weight" or last.batch >= batch or forward \
                or (self.outputs_batch is not None and self.outputs_batch > last.batch):
            return None  # no such event, or a clean batch since: a new cause to look for
        bad = self._nonfinite_weights()
        stats = bad.get(last.qualified_role)
        if stats is None or not bad.keys() <= self._bad_weights:
            # Mended, or more weights went bad since (an optimizer step spread the NaN): the
            # first of them in this forward may be another, which only a replay can tell.
            return None
        return NanEvent(batch=batch, module=last.module, module_type=last.module_type,
                        call=last.call, role=last.role, kind=event_kind(stats.nan, stats.inf),
                        origin="weight", rank=self.recorder.rank,
                        note=f"{REPEATED_NOTES[1]}{last.qualified_role} found non-finite "
                             f"in batch "
                             f"{self._forward_since} still is (that event has the frames and "
                             "the trace)")

    def _first_nonfinite_weight(self, written: set[str], under: str = "",
                                skip: set[str] | frozenset[str] = frozenset()
                                ) -> tuple[Any, Entry] | None:
        """The first module (in the model's order; ``under``: of that module's, when not the
        root; none of the modules named in ``skip``) holding a NaN/Inf weight, and that
        weight's entry; one of ``written`` (qualified names: buffers, weights the forward
        wrote) only when no other is (at event time only: it reads every weight)."""
        first_written = None
        inside = f"{under}."
        for info in self.recorder.modules:
            if under and info.name != under and not info.name.startswith(inside):
                continue  # not called in the batch (a generation step calls the wrapped model)
            if info.name in skip:
                continue
            for entry in self.recorder.weights_now(info.name) or ():
                if entry.stats is not None and (entry.stats.nan or entry.stats.inf):
                    name = f"{info.name}.{entry.role}" if info.name else entry.role
                    if name not in written:
                        return info, entry
                    first_written = first_written or (info, entry)
        return first_written

    def _nonfinite_weights(self) -> dict[str, Any]:
        """The stats of every parameter and buffer holding a NaN/Inf now, by qualified name
        (at event time only: it reads every weight)."""
        bad = {}
        for info in self.recorder.modules:
            for entry in self.recorder.weights_now(info.name) or ():
                if entry.stats is not None and (entry.stats.nan or entry.stats.inf):
                    bad[f"{info.name}.{entry.role}" if info.name else entry.role] = entry.stats
        return bad

    def _repeated_gradient(self, batch: int, bad: list[BadTensor]) -> NanEvent:
        """A gradient event that repeats the last one, not replayed: in its place when its
        parameter is still among the non-finite ones, or when the forward repeated the last
        one's (then the gradients go bad where they did then); else at the first of them."""
        last = self._last_backward
        labels = [b.label for b in bad]
        since = f" since batch {self._backward_since}" if last is not None else ""
        if self._repeated_forward == batch:
            why = "its forward was made non-finite by the same weight as before"
            if last is not None and last.qualified_role not in labels:
                # The same forward sends the same non-finite values back the same way: the
                # last pass's first one (full mode's place: a grad_output, say), repeated.
                return NanEvent(batch=batch, module=last.module, module_type=last.module_type,
                                call=last.call, role=last.role, kind=last.kind, origin="grad",
                                is_backward=True, rank=self.recorder.rank,
                                note=f"{NOT_REPLAYED}{why}")
        else:
            why = ("its non-finite gradients were non-finite when the last backward pass ended "
                   f"and were only accumulated into{since} (zero_grad() clears them)")
        if last is not None and last.qualified_role in labels:
            label = last.qualified_role
            bad = [bad[labels.index(label)]] + [b for b in bad if b.label != label]
        return self._grad_event(batch, bad, f"{NOT_REPLAYED}{why}")  # why: "its ..."

    def _gradient_states(self, bad: list[BadTensor], slots: list) -> dict[str, tuple[Any, int, int]]:
        """(the tensor weakly, storage, version) of each non-finite parameter gradient, by
        name."""
        if not bad:
            return {}
        names = self.capture.slots.names
        wanted = {b.label for b in bad}
        states = {}
        for i in self._params:
            param = slots[i]
            grad = param.grad if param is not None else None
            if grad is not None and names[i] in wanted:
                try:
                    states[names[i]] = (weakref.ref(grad), grad.data_ptr(), grad._version)
                except Exception:  # no storage or no version counter: never a repeat
                    continue
        return states

    def _forward_event_recorded(self, batch: int) -> bool:
        """Whether an event of ``batch``'s forward pass is recorded already (on_nan "warn" or
        "record" let its backward pass run)."""
        return any(e.batch == batch and not e.is_backward and e.origin != "peer"
                   for e in self.recorder.events)

    def context(self, batch: int, needed: int) -> tuple[list[Frame], list[list[Frame]], str]:
        """Up to ``needed`` frames of the batches that ran before ``batch``, oldest first, as
        full mode's ring would hold them; the groups of frames replayed for them (oldest first,
        one per batch: not recorded yet); and why some are missing ("" when none are)."""
        recorder = self.recorder
        ring = recorder.held_frames()
        earlier = sorted({b for b in self.capture.held_batches() if b < batch}
                         | {f.batch for f in ring if f.batch < batch}, reverse=True)
        automatic = not recorder.manual_batches
        collected: list[Frame] = []
        replayed: list[list[Frame]] = []
        why, missing = "", batch - 1
        for previous in earlier:
            if needed <= 0:
                break
            if automatic and previous != missing:
                why = "not held"  # a gap: the batch that ran just before is gone
                break
            live = [f for f in ring if f.batch == previous]
            if live:
                frames = live
            elif self.backward:
                why = "backward"
                break
            else:
                try:
                    held = self.capture.batch_to_replay(previous)
                except ReplayError:
                    why = "not held"
                    break
                try:
                    earlier_run = replay_frames(recorder, self.capture, held, trace_ops=False)
                except Exception:  # only context for the event: go without it
                    why = "replay failed"
                    break
                self.replays += 1
                trace, frames = earlier_run.trace, earlier_run.frames
                if not (trace.snapshot_used or (not trace.weights_changed
                                                and not trace.buffers_updated)):
                    why = "weights changed"
                    break
                replayed.append(frames)
            collected = frames + collected
            needed -= len(frames)
            missing = previous - 1
        if not why and needed > 0 and missing >= 0 and automatic:
            why = "not held"  # batches are counted from 0: the one before is gone
        replayed.reverse()  # oldest first, as they ran
        if not why:
            return collected, replayed, ""
        reasons = {"backward": "with backward=True its backward frames would be needed too",
                   "not held": "it is no longer held for replay",
                   "weights changed": "its weights changed since it ran; snapshot_weights=True "
                                      "keeps copies",
                   "replay failed": "its replay failed"}
        return collected, replayed, (f"sentinel mode: frames before batch {batch} not shown; "
                                     f"batch {missing} was not recorded and {reasons[why]}")

    def _not_reproduced(self, batch: int, forward: int, bad: list[BadTensor], trace: Any,
                        frames: list[Frame], held: Any) -> NanEvent:
        """The event of a NaN the eager replay did not meet again: what was seen, where, and
        what the replay checked."""
        first = bad[0]
        note = (f"not reproduced by an eager replay of batch {batch}: "
                f"{_stayed_finite(trace, frames, 'its ')}")
        if self.compiled and batch in self._eager_batches:
            note += ("; the batch ran eagerly (a direct call of the original module), so no "
                     "compiled re-run applies")
        elif self.compiled:
            try:
                again = rerun_compiled(self.recorder, held, self.capture.slots)
            except Exception as error:  # a failed re-run must not hide the event
                note += f"; re-running the compiled model failed ({type(error).__name__})"
            else:
                if again:
                    note += (f"; the compiled model, re-run on the same batch, makes it again "
                             f"({again[0].label}: {again[0].kind}), so its compiled kernels "
                             "compute differently from eager PyTorch")
                else:
                    note += "; a compiled re-run of the batch stayed finite too"
        root = self._entry_of(batch, forward)
        own = [f for f in frames if f.module == root.name and f.phase == "forward"
               and f.call == forward]
        index = own[-1].index if own else 0
        position = next((i for i, f in enumerate(frames) if f.index == index), len(frames) - 1)
        window = frames[max(0, position + 1 - self.recorder.max_frames): position + 1]
        return NanEvent(batch=batch, module=root.name, module_type=root.type_name, call=forward,
                        role=first.label, kind=first.kind, origin="output",
                        frames=frames_to_dataframe(window), rank=self.recorder.rank,
                        frame=index, note=note)

    def _written_by(self, batch: int, forward: int) -> set[str]:
        """The parameters and buffers (qualified names) that root forward ``forward`` of
        ``batch`` may have written: every buffer (BatchNorm's running stats are written by a
        fused op that moves no version counter), and the parameters whose version moved since
        it began (when it is still held: else none, as a forward rarely writes one)."""
        slots = self.capture.slots
        held = self.capture.held.get(batch)
        versions = held.forwards[forward].weight_versions \
            if held is not None and forward < len(held.forwards) else None
        if versions is None:
            return {name for name, is_buffer in zip(slots.names, slots.is_buffer) if is_buffer}
        return {name for name, tensor, version, is_buffer in zip(
                    slots.names, slots.read(), versions, slots.is_buffer)
                if is_buffer or (tensor is not None and version_of(tensor) != version)}

    def _unreplayed(self, batch: int, forward: int, bad: list[BadTensor], note: str) -> NanEvent:
        """The event of a forward whose outputs held a NaN/Inf and whose batch was not
        replayed (``note`` says why): the first weight holding a NaN/Inf now, the cause a
        replay would have named, as full mode names it; else the root's output, where the
        check saw it. A weight the forward may have written (a buffer, as BatchNorm's running
        stats take a NaN input's mean; a parameter whose version moved) is no such cause."""
        root = self._entry_of(batch, forward)
        written = self._written_by(batch, forward)
        weight = self._first_nonfinite_weight(written, root.name)  # a written one: no other
        info, entry = weight if weight is not None else (None, None)
        if entry is not None and (f"{info.name}.{entry.role}" if info.name else entry.role) \
                not in written:
            return NanEvent(batch=batch, module=info.name, module_type=info.type_name, call=0,
                            role=entry.role, kind=event_kind(entry.stats.nan, entry.stats.inf),
                            origin="weight", rank=self.recorder.rank, note=note)
        first = bad[0]
        return NanEvent(batch=batch, module=root.name, module_type=root.type_name, call=forward,
                        role=first.label, kind=first.kind, origin="output",
                        rank=self.recorder.rank, note=note)

    def _grad_event(self, batch: int, bad: list[BadTensor], note: str,
                    grads: list | None = None) -> NanEvent:
        """A non-finite parameter gradient, named by its module and parameter; or, when the
        batch was not replayed and ``grads`` (what its outputs received) holds a non-finite
        gradient, that gradient: it reached the model's output so (the root's backward frame
        as the event's, as full mode records it), which the diagnosis reads as a NaN made
        after the model, in the loss."""
        received = self._output_grad_frame(batch, grads) if grads else None
        if received is not None:
            root = self.recorder.modules[0]
            entry = next(e for e in received.entries if e.nonfinite)
            return NanEvent(batch=batch, module=root.name, module_type=root.type_name,
                            call=received.call, role=entry.role,
                            kind=event_kind(entry.stats.nan, entry.stats.inf), origin="grad",
                            is_backward=True, frames=frames_to_dataframe([received]),
                            rank=self.recorder.rank, frame=received.index, note=note)
        first = bad[0]
        # A container never called (Keras' ParameterDict) is no call: the module around it is.
        info, param = self.recorder.parameter_owner(first.label)
        module_name = info.name if info is not None else first.label.rpartition(".")[0]
        return NanEvent(batch=batch, module=module_name,
                        module_type=info.type_name if info is not None else "", call=0,
                        role=param, kind=first.kind, origin="grad", is_backward=True,
                        rank=self.recorder.rank, note=note)

    def _output_grad_frame(self, batch: int, grads: list) -> Frame | None:
        """The root's backward frame of the first forward of ``batch`` whose outputs received
        a non-finite gradient (measured now: an event's host reads), else None."""
        root = self.recorder.modules[0]
        for forward, slot in enumerate(grads):
            entries = []
            for role, grad in (slot or {}).items():
                values = local_shard(grad)
                # A plain tensor's gradient is grad_output[0], as the backward frames name it.
                name = "grad_output[0]" if role == "output" else f"grad_{role}"
                entries.append(Entry((name, measure_tensor(values), grad.dtype,
                                      tuple(grad.shape), LOCAL_SHARD if values is not grad
                                      else "")))
            if any(e.nonfinite for e in entries):
                return Frame(self.recorder.rank, batch, 0, root.name, root.type_name, forward,
                             "backward", entries)
        return None

    def _attach_trace(self, event: NanEvent) -> None:
        try:
            held = self.capture.batch_to_replay(event.batch)
            replayed = replay_frames(self.recorder, self.capture, held, trace_ops=True,
                                     loss_fn=automatic_loss(held, self.loss_fn))
        except ReplayError:
            return  # the event stands without a trace (FSDP2, batch not held, model changed)
        self.replays += 1
        event.trace = replayed.conclude(self.recorder.find_event(replayed.frames), event)

    def _record_by_replay(self, batch: int) -> Finding | None:
        """A sampled or trace batch of a compiled model: its frames from an eager replay."""
        try:
            held = self.capture.batch_to_replay(batch)
            frames = replay_frames(self.recorder, self.capture, held, trace_ops=False).frames
        except ReplayError:
            return None
        self.replays += 1
        self._full_batches = (self._full_batches + [batch])[-8:]
        return Finding(None, [frames])

    def unchecked_note(self) -> str | None:
        """What to tell a user whose model was trained while this watch checked nothing: its
        weights moved, but the model itself was never called (its loop calls its modules
        directly, ``model.G(z)``), and sentinel mode checks the calls of the watched model.
        None when a call was checked, or nothing was trained."""
        if self.checks or self._forward_batch is not None:
            return None
        slots, start, steps = self.capture.slots, self._start_versions, self._start_steps
        moved = [name for name, tensor, version in zip(slots.names, slots.read(), start)
                 if tensor is not None and (version_of(tensor) != version
                                            or written_since(tensor, steps))]
        if not moved:
            return None
        kind = type(self.capture.slots.root).__name__
        own = own_call_note(self.capture.slots.root)
        if own:  # the model was called, perhaps, but its calls never ran the hooks
            return (f"Sentinel mode checked nothing: no call of this {kind} reached the watch "
                    "while its weights were updated. " + own + " If your loop calls its "
                    "modules directly, watch each one it calls.")
        children = list(dict.fromkeys(name.split(".")[0] for name in moved if "." in name))
        which = (f"the weights of its modules {', '.join(children[:4])}"
                 + (" ..." if len(children) > 4 else "")) if children else "its weights"
        # The example names one of this model's own modules (a child named "0" is model[0]).
        first = children[0] if children else ""
        example = f"model.{first}" if first.isidentifier() else \
            f"model[{first}]" if first.isdigit() else "model.part"
        said = (f"Sentinel mode checked nothing: this {kind} was never called while {which} "
                "were updated. Sentinel mode checks the calls of the watched model itself "
                "(model(x)): if your loop calls its modules directly, watch each one it calls "
                f"(nw.watch({example}, mode='sentinel'), one watch each), or watch this one in "
                "full mode (nw.watch(model)), which checks every module call.")
        if isinstance(self.capture.slots.root, nn.Sequential):
            # torch.utils.checkpoint.checkpoint_sequential(model, segments, x), the way its
            # docs use it, calls the Sequential's modules one by one, never the Sequential.
            said += (" torch.utils.checkpoint.checkpoint_sequential(model, segments, x) is such "
                     "a loop (it calls a Sequential's modules one by one, never the Sequential): "
                     "make that call in the forward of a module that holds this Sequential (def "
                     "forward(self, x): return checkpoint_sequential(self.layers, segments, x)) "
                     "and watch that module.")
        elif callable(getattr(self.capture.slots.root, "forward_features", None)):
            # timm's models: users call model.forward_features(x) (and forward_head,
            # forward_intermediates) for the features; watching each module those call is no
            # way to watch that pass.
            said += (f" model.forward_features(x) is such a loop (as are forward_head and "
                     f"forward_intermediates: they call this {kind}'s modules, never its "
                     "forward): make that call in the forward of a module that holds the model "
                     "(def forward(self, x): return self.model.forward_features(x)) and watch "
                     "that module in sentinel mode; for pooled features, model(x) of a model "
                     "made with num_classes=0 (or after model.reset_classifier(0)) returns them.")
        return said

    def close(self) -> None:
        for handle in self._parameter_hooks or ():
            handle.remove()
        self._parameter_hooks = []
        self._lazy_batch = None
        self._deferred_grad = None
        self._output_grads.clear()
        self._deferred.clear()
        self._check = None
        self._own_event = None


def _readable(inputs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The held inputs a check may read, as :func:`checkable` gives them: not those whose
    storage was freed since the forward (an offloading hook, FSDP): reading one crashes the
    process (torch's own ops too)."""
    return [(role, values) for role, values in ((role, checkable(tensor)) for role, tensor in inputs)
            if values is not None and storage_holds(values)]


#: Methods of a wrapper that runs the model it wraps step by step, never its own forward.
_SAMPLING_METHODS = ("generate", "sample")


def _wrapped_model(recorder: Recorder) -> Any:
    """The info of the watched module the root wraps and that its other methods call instead
    of the root's forward: what peft's ``get_base_model()`` gives (``PeftModel.generate()``
    calls it), or else the one child holding all the parameters of a root whose class has a
    ``generate()`` or ``sample()`` (x-transformers' ``AutoregressiveWrapper.generate()`` calls
    its ``net``, denoising-diffusion-pytorch's ``GaussianDiffusion.sample()`` its ``model``
    once per timestep); None when the root is no such wrapper."""
    model = recorder.model
    get = getattr(model, "get_base_model", None)
    if callable(get):
        try:
            wrapped = get()
        except Exception:  # not ready, or another meaning of the name
            return None
    else:
        wrapped = _sampled_child(model)
    if not isinstance(wrapped, torch.nn.Module) or wrapped is recorder.model:
        return None
    return next((info for info in recorder.modules if info.module is wrapped), None)


def _sampled_child(model: torch.nn.Module) -> torch.nn.Module | None:
    """The child a sampling wrapper runs: the root's class defines ``generate`` or ``sample``,
    holds no parameter of its own, and one child with a forward holds them all."""
    kind = type(model)
    if not any(callable(getattr(kind, name, None)) for name in _SAMPLING_METHODS) \
            or next(model.parameters(recurse=False), None) is not None:
        return None
    holders = [child for child in model.children()
               if next(child.parameters(), None) is not None]
    if len(holders) != 1 or type(holders[0]).forward is torch.nn.Module.forward:
        return None  # several, or one without a forward (a ModuleList of flow steps)
    return holders[0]


def _after(forward: list[Frame], limit: int) -> Any:
    """The window of a backward event: up to ``limit`` frames ending with its own, the batch's
    forward frames before its backward ones (as full mode's ring holds them)."""
    def window(batch_frames: list[Frame], position: int) -> list[Frame]:
        joined = forward + batch_frames
        end = len(forward) + position + 1
        return joined[max(0, end - limit): end]
    return window


class _Context:
    """The frames a sentinel event's report shows before its own, found when the verdict
    knows where the event's frame is: live frames of the batches before it, or their replays
    (see :meth:`Sentinel.context`)."""

    def __init__(self, sentinel: Sentinel, batch: int) -> None:
        self.sentinel = sentinel
        self.batch = batch
        self.replayed: list[list[Frame]] = []
        self.missing = ""

    def window(self, batch_frames: list[Frame], position: int) -> list[Frame]:
        limit = self.sentinel.recorder.max_frames
        own = batch_frames[max(0, position + 1 - limit): position + 1]
        needed = limit - len(own)
        if needed <= 0:
            return own
        before, self.replayed, self.missing = self.sentinel.context(self.batch, needed)
        return before[-needed:] + own

"""Running a held batch again in trace mode, and leaving the model exactly as it was."""

from __future__ import annotations

import contextlib
from functools import partial
import random
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import pandas as pd
import torch
from torch import nn

from ..detect import Detector, first_event
from ..events import NanEvent
from ..entries import Entry
from ..frames import Frame, frames_to_dataframe, weights_finite_last
from ..grads.backward import BackwardFrames, FrameSink
from ..fastpath import FusedPathKeeper, has_fused_path, keep_fused_path, release_fused_path
from ..opaque import add_forward_hook, add_forward_pre_hook, hookable_modules
from ..recorder import ModuleInfo, Recorder, in_backward_pass
from ..schema import DEQUANTIZED, OPS_COLUMNS, OPS_DTYPES, PACKED
from ..sourcelines import user_stacklevel
from ..stats import is_distributed_tensor, measure_tensor, stood_for, version_of
from ..trace import TENSOR_COLUMNS, Trace
from ..walk import iter_leaves
from ..writes import written_since
from .capture import (BatchCapture, ForwardCapture, HeldBatch, ModelNotReplayableError, ReplayError,
                      WeightSlots, cpu_rng_state, layouts_of)
from .collectives import no_collectives, refused_collective
from .divergence import ran_differently, replay_outputs
from .inputs import UncopiedInput, copy_structure
from .outside import OutsideModules, other_watches_quiet
from .shadows import ModuleAttributes, Shadows
from .tracer import OpRecorder, OpTracer, WriteGuard

__all__ = ["replay_held_batch", "replay_frames", "refuse_unreplayable", "unreplayable_reason", "automatic_loss",
           "eager_calls",
           "OutputGrads", "set_forward_state", "forward_arguments", "forward_modes",
           "ReplayFrames", "Replayed"]

_Tensor = torch.Tensor

# Per root forward of a held batch: the gradient that reached each output leaf (by role) in the
# live backward pass, or None for a forward that had no backward.
OutputGrads = list["dict[str, torch.Tensor] | None"]


def _replay_calls_only(hook: Callable[..., None], recorder: OpRecorder,
                       arity: int) -> Callable[..., None]:
    """``hook`` for the module calls of the replay itself: those on this thread, and the
    recomputations autograd runs on its own threads in the replay's backward. Another thread's
    call of the model (waiting for the replay at its root pre-hook, or calling a submodule
    directly) may have taken the module's hooks while the replay's were on and call them after
    they came off, when torch no longer passes them the kwargs (``arity``: the arguments after
    ``args``, kwargs included): such a call is none of the replay's, and is let be."""
    thread = threading.get_ident()

    def replay_call_only(module: nn.Module, args: tuple, *rest: Any) -> None:
        if len(rest) == arity and (threading.get_ident() == thread or (
                recorder.phase == "backward" and in_backward_pass())):
            return hook(module, args, *rest)
        return None

    return replay_call_only


def replay_held_batch(recorder: Recorder, capture: BatchCapture, held: HeldBatch,
                      loss_fn: Callable[[Any], torch.Tensor] | None = None,
                      expected: NanEvent | None = None,
                      output_grads: OutputGrads | None = None) -> Trace:
    """Re-run ``held`` under the op tracer; the model, RNG states and the recorder's own
    recording are left as they were. ``expected``: the event recorded for this batch (None:
    the recorder's first forward event of the batch, else its backward one), which the replay
    checks for: a replay that runs no backward pass does not meet a backward event.
    ``output_grads``: without ``loss_fn``, run each forward's backward pass from the gradients
    its outputs received live (see :func:`replay_frames`)."""
    if expected is None:
        # The batch's forward event; else, when this replay runs a backward pass (a loss, or
        # the gradients the outputs received), its backward event.
        recorded = [e for e in recorder.events if e.batch == held.batch and e.origin != "peer"]
        expected = next((e for e in recorded if not e.is_backward), None)
        if expected is None:
            # A backward event: met again only by a replay that runs a backward pass; one
            # that runs the forward only cannot meet it, and its verdict says so.
            expected = next((e for e in recorded if e.is_backward), None)
    refuse_unreplayable(recorder, capture, held)
    # A backward event is met again only in backward frames (a replay with a loss records them).
    backward = expected is not None and expected.is_backward
    replayed = _Replay(recorder, capture, held, loss_fn, backward_frames=backward,
                       output_grads=None if loss_fn is not None else output_grads).run()
    # The one verdict of this replay: the event its frames hold (their own weights as the
    # replay measured them; an inner module used without being called has none: measured now,
    # as the replay had them).
    weights = replayed_weights(recorder, capture, held)
    found = first_event(replayed.frames, Detector(
        recorder.inf_allowed, weights_now=partial(_read_at_event, weights),
        module_names=recorder.module_names, inner_weights_now=weights,
        is_buffer=recorder.is_buffer))
    return replayed.conclude(found, expected)


def _read_at_event(weights: Callable[[str], list[Entry] | None],
                   module: str) -> list[Entry] | None:
    """Of a module's weights measured now, those no frame reads (a quantized module's packed
    ones, a torchao weight dequantized), as the live event had them: a replay's frames hold
    the others as the replay measured them."""
    return [entry for entry in weights(module) or () if entry.note in (PACKED, DEQUANTIZED)]


def replayed_weights(recorder: Recorder, capture: BatchCapture,
                     held: HeldBatch) -> Callable[[str], list[Entry] | None]:
    """Measures a module's own weights, now, as a replay of ``held`` had them: the copies
    ``snapshot_weights=True`` took when the batch started (the live ones may have been written
    since: the step after a NaN loss writes NaN into them), else the live ones."""
    snapshot = held.forwards[0].snapshot
    if not snapshot:
        return recorder.weights_now
    slots = capture.slots
    # As Shadows.install takes them: a copy whose shape or dtype no longer fits is not used.
    copies = {name: copy for name, copy, live in zip(slots.names, snapshot, slots.read())
              if copy is not None and live is not None and copy.shape == live.shape
              and copy.dtype == live.dtype}

    def weights(module: str) -> list[Entry] | None:
        entries = recorder.weights_now(module)
        if not entries:
            return entries
        prefix = f"{module}." if module else ""
        return [entry if (copy := copies.get(prefix + entry.role)) is None
                else entry.replace(stats=measure_tensor(copy)) for entry in entries]

    return weights


def replay_frames(recorder: Recorder, capture: BatchCapture, held: HeldBatch, *,
                  trace_ops: bool = True, output_grads: OutputGrads | None = None,
                  backward_frames: bool = False,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Replayed:
    """Re-run ``held`` eagerly: its module frames as
    :class:`~nanwidget.core.frames.Frame` objects (resolved), built as the live watch builds
    them, and its op trace. ``trace_ops``: measure every op (else frames only, faster).
    ``output_grads``: run the backward pass of each forward from the gradients its outputs
    received live (no loss function needed). ``loss_fn``: run the loss on the output and its
    backward instead (its ops are traced too). ``backward_frames``: record a backward frame per
    module call, on the way the live watch records them (gradient hooks on tensors).
    No verdict is taken: the caller takes it on the frames, once, and hands it to
    :meth:`Replayed.conclude`, which explains the trace from it."""
    refuse_unreplayable(recorder, capture, held)
    return _Replay(recorder, capture, held, loss_fn, trace_ops=trace_ops,
                   output_grads=None if loss_fn is not None else output_grads,
                   backward_frames=backward_frames).run()


def automatic_loss(held: HeldBatch, loss_fn: Callable[[Any], torch.Tensor] | None
                   ) -> Callable[[Any], torch.Tensor] | None:
    """The loss an automatic replay of ``held`` runs: the watch's ``loss_fn`` for a training
    forward (grad enabled: the step whose targets a closure sees), none for an evaluation
    forward (its batch need not fit the training loss)."""
    if loss_fn is None or not all(capture.grad_enabled for capture in held.forwards):
        return None
    return loss_fn


class Replayed:
    """A replay that ran: its :class:`Trace` (ops, frames, what changed), its module frames,
    and what the op tracer saw, to explain the trace once the verdict is known."""

    def __init__(self, trace: Trace, frames: list[Frame], ops: OpRecorder) -> None:
        self.trace = trace
        self.frames = frames
        self._ops: OpRecorder | None = ops

    def conclude(self, found: NanEvent | None, expected: NanEvent | None) -> Trace:
        """The trace, explained by the verdict on this replay's frames: ``found`` is the event
        they hold (None: none), ``expected`` the one the replay looked for (the recorded event;
        for a sentinel event, the same). Sets where the value that reaches ``found`` was born
        (``first_bad``, following the data back), what it came with, and whether the replay
        met ``expected`` (``reproduced``). Once: the tracer's records are let go."""
        trace, ops = self.trace, self._ops
        self._ops = None
        if ops is not None and trace.ops is not None and len(trace.ops):
            _explain(trace, ops, found, expected)
        trace.set_verdict(expected, found)
        return trace


def refuse_unreplayable(recorder: Recorder, capture: BatchCapture, held: HeldBatch) -> None:
    """Raise :class:`ReplayError` when ``held`` cannot be replayed faithfully on this process
    alone: a model sharded with FSDP2 (its forward would wait for the other ranks' all-gathers,
    forever), a tensor-parallel one (its forward's collectives would wait for the other ranks,
    or take their next batch's values), or a model whose modules changed since the watch hooked
    it."""
    refusal = unreplayable_reason(recorder)
    if refusal:
        raise ModelNotReplayableError(refusal)
    structure = capture.slots.structure_changes()
    if structure:
        raise ReplayError(f"cannot replay batch {held.batch}: the model is not the one this watch "
                          f"hooked ({'; '.join(structure)}), so a replay would run a different "
                          "model. Close the watch and watch the model again")


def unreplayable_reason(recorder: Recorder) -> str:
    """Why no batch of ``recorder``'s model can be replayed on this process alone (FSDP2, tensor
    parallel, a collective an earlier replay met), or "" when it can. Read at an event only: it
    walks the parameters."""
    sharded = [info.label for info in recorder.modules if info.sharded]
    if sharded:
        return (f"cannot replay a model sharded with FSDP2 (fully_shard manages '{sharded[0]}'): "
                "its forward gathers parameters from every rank, and a replay runs on this rank "
                "alone, so it would wait for the others forever. Replay an unsharded copy of the "
                "model on one process instead")
    spread = _spread_over_ranks(recorder.model)
    if spread is not None:
        name, ranks = spread
        return (f"cannot replay a tensor-parallel model ('{name}' is a DTensor over {ranks} "
                "ranks): its forward exchanges values with the other ranks, and a replay runs on "
                "this rank alone, so it would wait for the others forever (or take their next "
                "batch's values). Replay an unsharded copy of the model on one process instead")
    return refused_collective(recorder.model)


def _spread_over_ranks(model: nn.Module) -> tuple[str, int] | None:
    """The first parameter or buffer of ``model`` that is a DTensor over more than one rank
    (``parallelize_module``: its forward runs collectives), and that rank count; None if none.
    Read at an event only, never per batch."""
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if is_distributed_tensor(tensor):
            mesh = getattr(tensor, "device_mesh", None)
            ranks = mesh.size() if mesh is not None else 0
            if ranks > 1:
                return name, ranks
    return None


@contextlib.contextmanager
def eager_calls() -> Iterator[None]:
    """Run ``torch.compile``'d code eagerly while inside (compiled models, ``module.compile()``,
    compiled submodules): the replay must see every module call. Nothing is compiled or
    recompiled; outside, compiled calls use their compiled code again."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if "torch._dynamo" not in sys.modules or set_stance is None:
        yield  # nothing was ever compiled in this process
        return
    with set_stance("force_eager"):
        yield


def _explain(trace: Trace, recorder: OpRecorder, found: NanEvent | None,
             expected: NanEvent | None) -> None:
    """Follow ``found``'s tensor back to the op where its NaN/Inf was born; when it cannot be
    followed, the first op that made one from finite inputs is the best guess."""
    ops = trace.ops
    lineage = recorder.event_lineage(found)
    if found is None and trace.raised and not lineage.followed and recorder.first_nan is not None:
        # The forward raised before any module returned its NaN (a distribution refusing NaN
        # logits): the first NaN made is what it raised on; an intended -inf is no cause.
        lineage = recorder.follow_op(recorder.first_nan)
    born = lineage.born
    if born is None and found is not None and (
            not lineage.followed or all(kind == "unknown" for kind, _ in lineage.came_with)):
        born = recorder.first_unexplained_birth()
        if born is not None or not lineage.followed:
            lineage.came_with = []
        # else: no op made it; the lineage says which op read it from a tensor no op made
    earlier = None  # an Inf some op held before the first bad op (e.g. a -inf mask)
    if recorder.first_inf is not None and (born is None or recorder.first_inf < born):
        earlier = ops.iloc[recorder.first_inf]
    trace.first_bad = ops.iloc[born] if born is not None else None
    trace.first_bad_tensors = pd.DataFrame(recorder.describe_birth(born) if born is not None
                                           else [], columns=TENSOR_COLUMNS)
    trace.earlier_inf = earlier
    trace.first_bad_grad_of = recorder.grad_nodes.get(born, "") if born is not None else ""
    trace.first_bad_reads_output = recorder.reads_output(born)
    trace.first_bad_picked_rows = recorder.picks_rows(born)
    trace.lineage = lineage.path if lineage.followed else []
    trace.came_with = lineage.came_with
    trace.inf_came_with = lineage.inf_came_with
    trace.earlier_inf_reaches = earlier is not None and int(earlier["index"]) in lineage.reached
    trace.weights_last_finite = _last_finite(expected, lineage.came_with, trace.batch)


@contextlib.contextmanager
def own_parametrization_cache() -> Iterator[None]:
    """Inside ``torch.nn.utils.parametrize.cached()``, a parametrized weight is computed once
    and reused until the block ends; a replay inside such a block (an automatic one, at the end
    of the forward) would reuse the weight the live forward computed from the model's own
    tensors. While inside, that cache starts empty (the replay computes its weights from its own
    stand-ins, once, as the live forward did) and is put back afterwards."""
    parametrize = sys.modules.get("torch.nn.utils.parametrize")
    if parametrize is None or not getattr(parametrize, "_cache_enabled", 0) \
            or not isinstance(getattr(parametrize, "_cache", None), dict):
        yield
        return
    saved = parametrize._cache
    parametrize._cache = {}
    try:
        yield
    finally:
        parametrize._cache = saved


# Pyro's effect handlers a replay keeps: those that hand a sample site the value a recorded
# trace holds (SVI runs the model under the guide's), recording nothing themselves.
_PYRO_HANDLERS_KEPT = ("ReplayMessenger",)


@contextlib.contextmanager
def outside_pyro_handlers() -> Iterator[None]:
    """Pyro runs a model under effect handlers (SVI's ``poutine.trace`` records each sample
    site once); an automatic replay at the end of the forward would run inside them and fail
    ("Multiple sample sites named 'sigma'"), or add its sites to the step's trace. While inside,
    Pyro's handler stack holds only the handlers that give sites their recorded values (the
    guide's, in SVI), and is put back afterwards. Pyro is never imported here."""
    runtime = sys.modules.get("pyro.poutine.runtime")
    stack = getattr(runtime, "_PYRO_STACK", None)
    if not isinstance(stack, list) or not stack:
        yield
        return
    saved = stack[:]
    stack[:] = [frame for frame in saved if type(frame).__name__ in _PYRO_HANDLERS_KEPT]
    try:
        yield
    finally:
        stack[:] = saved


class ReplayFrames(FrameSink):
    """The :class:`~nanwidget.core.grads.backward.FrameSink` of a replay, over its
    :class:`OpRecorder`: a replay's backward frames are recorded by the very code that records
    them live. Measuring a gradient is not one of the model's ops (not traced)."""

    def __init__(self, ops: OpRecorder, modules: list[ModuleInfo]) -> None:
        self.ops = ops
        self._modules = modules
        self._lock = threading.RLock()

    @property
    def batch(self) -> int:
        return self.ops.batch

    @property
    def frames_batch(self) -> int:
        return self.ops.batch  # a replay runs one batch

    @property
    def modules(self) -> list[ModuleInfo]:
        return self._modules

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    @property
    def suspended(self) -> bool:
        return False  # a replay records every gradient of its own backward pass

    @property
    def root_forward_running(self) -> bool:
        return self.ops.phase == "forward"

    @property
    def entries(self) -> ReplayFrames:
        return self  # grad_entry below

    def grad_entry(self, role: str, grad: Any, hold: bool = False) -> Entry:
        self.ops.paused = True
        try:
            return self.ops.entries.grad_entry(role, grad, hold)
        finally:
            self.ops.paused = False

    def record_frame(self, info: ModuleInfo, phase: str, entries: list[Entry],
                     batch: int | None = None, first_output: int | None = None,
                     first_input: int = 0, call: int | None = None) -> Frame:
        return self.ops.record_frame(info, phase, entries, first_output=first_output,
                                     first_input=first_input, call=call)

    def forward_calls(self, info: ModuleInfo) -> int | None:
        return self.ops.forward_calls(info)

    def called_by_another_model(self) -> bool:
        return False  # a replay runs the watched model alone

    def end_frames(self, batch: int, *, reason: str, raising: bool) -> None:
        """The replay resolves its frames itself, once it ran."""

    def internal_error(self, error: BaseException) -> None:
        # The replay fails with it: a ReplayError, not taken for the model's own code raising.
        raise ReplayError(f"the replay failed while recording its gradients "
                          f"({type(error).__name__}: {error})") from error


class _Replay:
    """One trace-mode run of a held batch; restores everything in ``finally``."""

    def __init__(self, recorder: Recorder, capture: BatchCapture, held: HeldBatch,
                 loss_fn: Callable[[Any], torch.Tensor] | None, *,
                 trace_ops: bool = True, output_grads: OutputGrads | None = None,
                 backward_frames: bool = False) -> None:
        self.recorder = recorder
        self.capture = capture
        self.held = held
        self.loss_fn = loss_fn
        self.trace_ops = trace_ops
        self.output_grads = output_grads
        self.backward_frames = backward_frames and (loss_fn is not None or output_grads is not None)
        # The replay's frames made by its root forwards (not by loss_fn or the backward pass):
        # (first, end) per forward, to compare with the batch's.
        self.forward_spans: list[tuple[int, int]] = []

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
            # The batch's forward may have run with its parameters' per-sample-gradient
            # stand-ins in their slots (ExpandedWeight): those are the parameters.
            then = stood_for(first.weights[i]) if i < len(first.weights) else None
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
            # A slot that holds its parameter's ExpandedWeight now (a replay made inside
            # call_for_per_sample_grads) holds that parameter.
            tensor = stood_for(tensor)
            if tensor is not then and tensor.is_meta and then.is_meta \
                    and tensor.shape == then.shape:
                continue  # offloaded (accelerate): a new meta stand-in, no values either time
            if tensor is not then or pointer_now != pointer_then:
                how = "replaced by another tensor" if tensor is not then else \
                    "its data swapped (p.data = ... or a device move)"
                changes.append(f"{name}: {how} since the batch ran")
                changed.append(name)
                continue
            if snapshot is not None or (version_of(tensor) == first.weight_versions[i]
                                        and not written_since(tensor, first.steps)):
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

    def run(self) -> Replayed:
        started = time.perf_counter()
        slots, held = self.capture.slots, self.held
        changes, changed, updated, snapshot_used = self._weight_status()
        with self.recorder.lock:  # what the batch measured, as it ran (read before replaying)
            live_outputs = self.recorder.records.history.batch_row(held.batch)
        root = self.recorder.model
        names = {id(m): (name, type(m).__name__) for name, m in root.named_modules()}
        infos = {id(info.module): info for info in self.recorder.modules}
        recorder = OpRecorder(infos, held.batch, self.recorder.rank, names)
        saved_cpu_rng = torch.get_rng_state()
        saved_cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        # Python's and NumPy's global generators too: a forward may draw from them (layer drop,
        # augmentation), and the training after the replay must draw what it would have.
        saved_random = random.getstate()
        numpy = sys.modules.get("numpy")
        saved_numpy = numpy.random.get_state() if numpy is not None else None
        saved_training = [m.training for m in slots.modules]
        attributes = ModuleAttributes(root.modules())
        earlier_pre_hooks = _PreHooksRunOnce(root)
        handles: list[Any] = []
        fused: list[tuple[nn.Module, FusedPathKeeper]] = []
        shadows: Shadows | None = None
        outside: OutsideModules | None = None
        backward: BackwardFrames | None = None
        loss_value: float | None = None
        raised: Exception | None = None  # what the model's code raised, where, and the
        raised_in, changes_then = ("forward", 0), []  # model's changes it may come from
        try:
            with self.recorder.suspend(), other_watches_quiet(self.recorder), eager_calls(), \
                    own_parametrization_cache(), outside_pyro_handlers(), \
                    no_collectives(root, partial(_running_now, recorder)):
                # Before this replay's own hooks go on the root (its first one is prepended).
                earlier_pre_hooks.wrap(*self.recorder.pre_hooks_before_held_inputs())
                shadows = recorder.shadows = Shadows()
                shadows.install(slots, held.forwards[0].snapshot or slots.read())
                # Modules run outside the model (the loss_fn's discriminator) get stand-ins too.
                outside = OutsideModules(root.modules(), shadows)
                outside.start()
                recorder.name_sources("weight", zip(slots.names, slots.read()))
                enter_hook, pre_hook, post_hook = (
                    _replay_calls_only(hook, recorder, arity)
                    for hook, arity in ((recorder.enter_hook, 1), (recorder.pre_hook, 1),
                                        (recorder.post_hook, 2)))
                for module in hookable_modules(root):
                    handles.append(add_forward_pre_hook(module, enter_hook,
                                                        with_kwargs=True, prepend=True))
                    handles.append(add_forward_pre_hook(module, pre_hook, with_kwargs=True))
                    handles.append(add_forward_hook(module, post_hook, with_kwargs=True,
                                                    always_call=True))
                    if has_fused_path(module):  # the batch ran its fused path: so does this
                        fused.append((module, keep_fused_path(module)))
                if self.backward_frames:
                    # The live watch's own backward frames (gradient hooks on tensors), recorded
                    # into this replay's frames: the same frames, roles and order as full mode.
                    backward = BackwardFrames(ReplayFrames(recorder, self.recorder.modules))
                for position, capture in enumerate(held.forwards):
                    grads = self.output_grads[position] if self.output_grads is not None \
                        and position < len(self.output_grads) else None
                    if backward is not None:
                        backward.on_batch_start(held.batch, (), {})  # a new graph: hook afresh
                    try:
                        with earlier_pre_hooks.skipped_once():
                            loss_value = self._run_forward(root, capture, recorder, grads)
                    except ReplayError:
                        raise
                    except Exception as error:
                        # The model's own code raised (an assert on a NaN state, a
                        # distribution refusing NaN logits), often because of the NaN: the
                        # ops traced until then name it. The replay stops there, as the batch did.
                        raised, raised_in = error, (recorder.phase, position)
                        changes_then = list(changes)
                        break
        finally:
            if outside is not None:
                outside.stop()
            earlier_pre_hooks.restore()
            if backward is not None:
                backward.close()
            for handle in handles:
                handle.remove()
            for layer, keeper in fused:
                release_fused_path(layer, keeper)
            if shadows is not None:
                shadows.restore()
            if outside is not None:
                outside.restore()
                lost = outside.lost_calls()
                if lost is not None:
                    changes.append(lost)
                    warnings.warn(f"nanwidget: replay of batch {held.batch}: {lost}",
                                  RuntimeWarning, stacklevel=user_stacklevel())
            attributes.restore()
            for module, flag in zip(slots.modules, saved_training):
                module.training = flag
            changes.extend(_unheld_draws(saved_random, numpy, saved_numpy))
            outside = self.capture.ran_outside_root
            ran_outside = outside is not None and outside(held.batch)
            if ran_outside:
                changes.append("watched modules also ran outside the model's forward in this "
                               "batch (called directly: a GAN's discriminator, model.encoder(x)); "
                               "a replay runs the model's forward only, so their calls are not "
                               "repeated")
            torch.set_rng_state(saved_cpu_rng)
            if saved_cuda_rng is not None:
                torch.cuda.set_rng_state_all(saved_cuda_rng)
            random.setstate(saved_random)
            if saved_numpy is not None:
                numpy.random.set_state(saved_numpy)
        recorder.resolve()
        ops = pd.DataFrame.from_records(recorder.rows, columns=OPS_COLUMNS).astype(
            {name: dtype for name, dtype in OPS_DTYPES.items() if dtype != "object"})
        frames = frames_to_dataframe(recorder.frames)
        if raised is not None and changes_then and not (
                ops["nonfinite"].any() or frames["nan"].any() or frames["inf"].any()):
            # No NaN/Inf before it: the model's change, not a NaN, most likely made it raise.
            raise ReplayError(
                f"replaying batch {held.batch} failed ({type(raised).__name__}: {raised}); the "
                f"model changed since the batch ran: {'; '.join(changes_then[:4])}") from raised
        differences = self._ran_differently(live_outputs, recorder.frames, complete=(
            raised is None and not held.truncated and not ran_outside), compare_values=not (
            changes or (updated and not snapshot_used)))
        changes.extend(differences)
        trace = Trace(batch=held.batch, frames=frames, ops=ops,
                      weights_changed=bool(changed), changed_weights=changed,
                      buffers_updated=updated, snapshot_used=snapshot_used, loss=loss_value,
                      forwards=len(held.forwards), seconds=time.perf_counter() - started,
                      changes=changes, differs_from_batch=bool(differences),
                      raised="" if raised is None else _raised_words(
                          *raised_in, raised, len(held.forwards)),
                      backward_from="loss" if self.loss_fn is not None else
                      "outputs" if self.output_grads and any(self.output_grads) else "")
        return Replayed(trace, recorder.frames, recorder)

    def _ran_differently(self, live: dict[str, tuple[float, bool]] | None, frames: list[Frame],
                         *, complete: bool, compare_values: bool) -> list[str]:
        """How this replay's forwards ran otherwise than the batch's (see :mod:`.divergence`)."""
        if live is None:
            return []
        forward_frames = [frame for first, end in self.forward_spans for frame in frames[first:end]]
        replayed = replay_outputs(forward_frames, set(self.recorder.module_names))
        # The module the batch called: the root, or the one called instead (peft's generate()).
        called = self.held.forwards[0].module if self.held.forwards else None
        entry = next((info.name for info in self.recorder.modules if info.module is called),
                     self.recorder.modules[0].name)
        return ran_differently(live, replayed, entry,
                               replay_complete=complete, compare_values=compare_values,
                               model=self.recorder.model)

    def _run_forward(self, root: nn.Module, capture: ForwardCapture, recorder: OpRecorder,
                     output_grads: dict[str, torch.Tensor] | None) -> float | None:
        """One root forward as it ran (modes, RNG, flags), then its backward if asked for."""
        loss_fn = self.loss_fn
        set_forward_state(capture, self.capture.slots)
        args, kwargs = forward_arguments(capture)
        recorder.name_sources("input", _input_leaves(args, kwargs))
        backward = loss_fn is not None or bool(output_grads)
        with contextlib.ExitStack() as stack:
            stack.enter_context(forward_modes(capture, backward=backward))
            if self.trace_ops:
                stack.enter_context(OpTracer(recorder))
            elif recorder.shadows is not None and recorder.shadows.protected:
                stack.enter_context(WriteGuard(recorder.shadows))
            recorder.phase = "forward"
            first = len(recorder.frames)
            try:
                output = (root if capture.module is None else capture.module)(*args, **kwargs)
            finally:
                self.forward_spans.append((first, len(recorder.frames)))
            recorder.tag_nodes()
            if output_grads:
                leaves = [(role, leaf) for role, leaf in iter_leaves(output, "output")
                          if role in output_grads and isinstance(leaf, _Tensor)]
                # A gradient is held under every role its output may have ("output[0]" and
                # "output" for a root returning one tensor): named by the role the forward
                # gives it, as the frames and the sentinel do; the others after, as fallbacks.
                recorder.name_sources("output-grad", [(role, output_grads[role])
                                                      for role, _ in leaves])
                recorder.name_sources("output-grad", output_grads.items())
                pairs = [(leaf, output_grads[role]) for role, leaf in leaves if leaf.requires_grad]
                if pairs:
                    recorder.phase = "backward"
                    backward_from_outputs(pairs)
                return None
            if loss_fn is None:
                return None
            recorder.phase = "loss"
            recorder.mark_output(leaf for _, leaf in iter_leaves(output, "output"))
            loss = loss_fn(output)
            recorder.tag_nodes()
            recorder.note_loss(loss)
            if not isinstance(loss, _Tensor) or loss.numel() != 1:
                raise ReplayError("loss_fn must return a scalar tensor (the loss to run backward on)")
            recorder.phase = "backward"
            loss.backward()
        return float(loss.detach())


def _raised_words(phase: str, position: int, error: Exception, forwards: int) -> str:
    """What raised in a replay and where, in words ("the forward raised ValueError: ...")."""
    where = {"loss": "loss_fn", "backward": "the backward pass"}.get(phase, "the forward")
    if forwards > 1 and phase == "forward":
        where = f"forward {position + 1} of {forwards}"
    text = " ".join(str(error).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{where} raised {type(error).__name__}" + (f" ({text})" if text else "")


def _running_now(recorder: OpRecorder) -> str:
    """The module a replay runs now, in words (for a refusal's message)."""
    if recorder.phase != "forward":
        return f"its {recorder.phase}"
    name = recorder.stack[-1][0] if recorder.stack else ""
    return f"'{name}'" if name else "its forward"


def backward_from_outputs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Run the backward pass of a replayed forward from the gradients its outputs received in
    the live run (``(output leaf, gradient)``), so that every gradient, at the outputs and
    upstream, equals the live one.

    A gradient held by a hook on an output is that output's whole gradient: what the caller
    sent in plus what the model's own later ops sent back when it also used the tensor inside
    (a returned key/value cache, hidden states). Fed in as a seed, that inner part would flow
    twice. So only the outputs no other output was computed from are seeds. Each of the others
    gets its held gradient back from a hook that runs before any other hook on it (the frames'
    hooks then read the live value), unless what the replay sent back to it is already
    non-finite: then the NaN was made inside, and the replay's own value goes on, for the op
    trace to find where."""
    unique: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for leaf, grad in pairs:  # one tensor under two roles: one seed, not two
        unique.setdefault(id(leaf), (leaf, grad))
    pairs = list(unique.values())
    inside = _used_inside([leaf for leaf, _ in pairs])
    seeds = [pair for pair, used in zip(pairs, inside) if not used]
    if not seeds:  # no edge found to tell them apart: every output a seed, as given
        seeds, inside = pairs, [False] * len(pairs)
    handles = []
    try:
        for (leaf, grad), used in zip(pairs, inside):
            if used:
                handle = leaf.register_hook(partial(_held_unless_nonfinite, grad))
                handles.append(handle)
                _run_first(getattr(leaf, "_backward_hooks", None), handle.id)
        torch.autograd.backward([leaf for leaf, _ in seeds], [grad for _, grad in seeds])
    finally:
        for handle in handles:
            handle.remove()


def _held_unless_nonfinite(held: torch.Tensor, arrived: torch.Tensor) -> torch.Tensor | None:
    with torch.no_grad():
        return None if not bool(torch.isfinite(arrived).all()) else held


def _used_inside(outputs: list[torch.Tensor]) -> list[bool]:
    """For each output: whether another output's graph reaches it (the model computed another
    output from it), by its gradient edge (node and output number)."""
    edges: list[tuple[Any, int]] = []
    for tensor in outputs:
        try:
            edge = torch.autograd.graph.get_gradient_edge(tensor)
            edges.append((edge[0], edge[1]))
        except Exception:  # no edge to look for: a seed
            edges.append((None, 0))
    reached: set[tuple[int, int]] = set()
    seen: set[int] = set()
    kept: list[Any] = []  # the nodes walked (each pushed first), alive while ids are compared
    stack = [tensor.grad_fn for tensor in outputs if tensor.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        kept.append(node)
        for next_node, number in node.next_functions:
            if next_node is None:
                continue
            reached.add((id(next_node), number))
            if id(next_node) not in seen:
                stack.append(next_node)
    return [node is not None and (id(node), number) in reached for node, number in edges]


def _run_first(hooks: Any, key: int) -> None:
    """Make the tensor hook ``key`` of ``hooks`` (a tensor's ``_backward_hooks``) run before the
    others: autograd calls them in the order of the underlying dict (``move_to_end`` reorders
    only the OrderedDict's own list), so the others are taken out and put back after it."""
    if not isinstance(hooks, dict) or key not in hooks:
        return
    others = [(other, hook) for other, hook in hooks.items() if other != key]
    for other, _ in others:
        del hooks[other]
    hooks.update(others)


def _last_finite(event: NanEvent | None, came_with: list[tuple[str, str]],
                 batch: int) -> dict[str, int]:
    """Per non-finite weight a trace's value came with: the last batch before ``batch`` whose
    frames in the event's window show it finite (the step, load or write after that batch
    made it non-finite). The same in every mode: the window is the event's own."""
    names = {name for kind, name in came_with if kind == "weight"}
    if event is None:
        return {}
    return weights_finite_last(event.frames, names, batch)


def _input_leaves(args: tuple, kwargs: dict) -> Iterator[tuple[str, Any]]:
    """The batch's input tensors by their frame roles (``input[0]``, ``kwarg:mask`` ...)."""
    for position, value in enumerate(args):
        yield from iter_leaves(value, f"input[{position}]")
    for key, value in kwargs.items():
        yield from iter_leaves(value, f"kwarg:{key}")


def _dtype(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "")


def set_forward_state(capture: ForwardCapture, slots: WeightSlots) -> None:
    """Put the train/eval flags and RNG states back as they were when ``capture`` started."""
    if len(capture.training) == len(slots.modules):
        for module, flag in zip(slots.modules, capture.training):
            module.training = flag
    torch.set_rng_state(cpu_rng_state(capture.cpu_rng))
    if capture.cuda_rng is not None:
        torch.cuda.set_rng_state_all(capture.cuda_rng)


class _PreHooksRunOnce:
    """The forward pre-hooks that ran before the watch held a batch's inputs (every global
    one, and the root's own registered before the watch: see
    :meth:`Recorder.pre_hooks_before_held_inputs`). The held inputs are what they made, so a
    replay's root call must not run them again (a hook that scales or extends the inputs
    would apply twice). Each is wrapped in place (torch's order kept) to skip its next call on
    the root in this thread inside :meth:`skipped_once`; every other call, of other modules,
    of a root calling itself, or from other threads, runs it as usual. :meth:`restore` puts
    the hooks back."""

    def __init__(self, root: nn.Module) -> None:
        self._root = root
        self._thread = threading.get_ident()
        self._pending: set[int] = set()
        self._wrapped: list[tuple[dict, int, Callable[..., Any], Callable[..., Any]]] = []

    def wrap(self, global_ids: list[int], own_ids: list[int]) -> None:
        """Wrap these hooks (by id; global ones, then the root's own)."""
        for hooks, ids in ((nn.modules.module._global_forward_pre_hooks, global_ids),
                           (self._root._forward_pre_hooks, own_ids)):
            for hook_id in ids:
                hook = hooks.get(hook_id)
                if hook is not None:
                    wrapper = partial(self._call, hook_id, hook)
                    hooks[hook_id] = wrapper  # an existing key: its place in the order stays
                    self._wrapped.append((hooks, hook_id, hook, wrapper))

    def _call(self, hook_id: int, hook: Callable[..., Any], module: nn.Module, *rest: Any) -> Any:
        if module is self._root and hook_id in self._pending \
                and threading.get_ident() == self._thread:
            self._pending.discard(hook_id)
            return None  # the held inputs are what it made of them
        return hook(module, *rest)

    @contextlib.contextmanager
    def skipped_once(self) -> Iterator[None]:
        """Around one root forward of the replay: the wrapped hooks skip the root's call."""
        self._pending = {hook_id for _, hook_id, _, _ in self._wrapped}
        try:
            yield
        finally:
            self._pending = set()

    def restore(self) -> None:
        """The hooks as they were (those removed meanwhile stay removed)."""
        for hooks, hook_id, hook, wrapper in self._wrapped:
            if hooks.get(hook_id) is wrapper:
                hooks[hook_id] = hook
        self._wrapped.clear()


def forward_arguments(capture: ForwardCapture) -> tuple[tuple, dict]:
    """The held inputs as a replay passes them: same data, ``requires_grad`` as it was, no
    gradient ever lands on the user's own tensors, and other inputs (caches, dicts, lists,
    objects) are fresh copies of the held copies (see :mod:`.inputs`): what the replayed
    forward changes belongs to this replay alone."""
    needs_grad = capture.needs_grad
    memo: dict[int, Any] = {}
    args = tuple(_fresh(v, i in needs_grad, memo) for i, v in enumerate(capture.args))
    kwargs = ({k: _fresh(v, k in needs_grad, memo) for k, v in capture.kwargs.items()}
              if capture.kwargs else {})
    return args, kwargs


@contextlib.contextmanager
def forward_modes(capture: ForwardCapture, *, backward: bool = False) -> Iterator[None]:
    """Grad, inference and autocast modes as they were when ``capture``'s forward ran
    (grad on when ``backward`` is to run too)."""
    with contextlib.ExitStack() as stack:
        if capture.inference and not backward:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(capture.grad_enabled or backward))
        wanted = dict(capture.autocast)
        for device_type in ("cpu", "cuda"):
            if device_type in wanted:
                stack.enter_context(torch.autocast(device_type, dtype=wanted[device_type]))
            elif torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


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


def _fresh(value: Any, needed_grad: bool, memo: dict[int, Any]) -> Any:
    """A top-level input as the replay passes it: a tensor with the same data, requires_grad
    as it was, no gradient ever landing on the user's own tensor; anything else a copy of
    its structure."""
    if isinstance(value, _Tensor):
        # One tensor passed at several places stays one (attention(x, x, x): nn.MultiheadAttention
        # takes its fast path only when query, key and value are the same tensor).
        fresh = memo.get(id(value))
        if fresh is None:
            fresh = memo[id(value)] = value.detach()
            if (value.requires_grad or needed_grad) and fresh.is_floating_point():
                fresh.requires_grad_(True)
        return fresh
    try:
        return copy_structure(value, memo, replay=True)
    except (UncopiedInput, RecursionError) as error:  # copied once already: should not happen
        raise ReplayError(f"cannot replay: an input could not be copied again ({error})") from None


def _unheld_draws(saved_random: Any, numpy: Any, saved_numpy: Any) -> list[str]:
    """What the replay drew from Python's and NumPy's global generators, as changes: a batch
    keeps torch's RNG states only (reading NumPy's costs every batch), so those draws differ
    from the batch's (wav2vec2's time masks come from ``np.random``)."""
    drew = []
    if random.getstate() != saved_random:
        drew.append("Python's random module")
    if numpy is not None and saved_numpy is not None:
        now = numpy.random.get_state()
        if now[2:] != saved_numpy[2:] or not numpy.array_equal(now[1], saved_numpy[1]):
            drew.append("NumPy's global generator (np.random)")
    return [f"the forward drew from {name}, whose state a batch does not keep: its random "
            "choices (masks, layer drop) differ from the batch's" for name in drew]


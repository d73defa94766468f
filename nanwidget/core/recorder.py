"""The recorder: hooks on every module, the batch state, detection, the frame ring and history.

Hot path (every module call): a hook reads metadata, checks weight version counters and hands
tensors to one :class:`~nanwidget.core.stats.PendingStats` (through an
:class:`~nanwidget.core.entries.EntryBuilder`), which reads dense CPU tensors at once with the
native kernel and queues the rest; no device result is read back. When the root module's
forward returns, the batch is *resolved*: the queued tensors get one batched reduction and one
host copy per device; then history, the frame ring and the features see the finished frames,
and the first NaN/Inf becomes an event.

Features (replay capture, gradients, persistence, consensus, sentinel, a notebook's live
status) are :class:`Feature` objects added with :meth:`Recorder.add_feature`; they see the
recorder only through its public methods and properties.

Batches
    The root forward's return ends a batch and counts the next one, unless the user numbers
    batches with :meth:`Recorder.set_batch`. A root module that calls itself is one batch. A
    forward that never returned (KeyboardInterrupt skips every hook) keeps its frames in its
    own batch, listed in :attr:`Recorder.interrupted_batches`, and the next forward starts a
    new one.

Recomputation
    A forward that runs while autograd executes a backward pass on this thread is a
    recomputation (``torch.utils.checkpoint``, reentrant or not, re-runs the checkpointed modules
    during batch N's backward): it records no frames and touches no batch state, because it
    repeats forward frames batch N already holds (checkpointing restores the RNG state, so the
    values are the same). Batch N+1 is untouched: its first real call of a module is call 0.
    Backward frames of recomputed modules still belong to batch N (see
    :mod:`~nanwidget.core.grads.backward`).

Direct calls of a compiled model's original module
    A watch whose entry is a ``torch.compile`` wrapper counts the wrapper's calls as batches.
    :meth:`Recorder.attach_direct_call_hooks` also counts direct (eager) calls of the original
    module, for a stretch where the caller knows that nothing compiles (a framework evaluating
    the uncompiled model between compiled training steps): the root's two hooks go on the
    original module too. Hooks on it must never be there while Dynamo compiles the wrapper (it
    traces them: a graph break), so they come off at :meth:`detach_direct_call_hooks`, at
    :meth:`close`, and at the start of the wrapper's next call, before its compiled code runs.
    Compiled calls of an already compiled wrapper do not run them (Dynamo does not guard on
    hooks), so a compiled call inside the stretch would be unseen by them but is still counted
    by the wrapper's own hooks.

Threads
    One forward at a time: a watched forward that a second thread enters while another
    thread's forward is running raises :class:`ConcurrentForwardError` before anything runs
    (frames of two threads would otherwise mix in one batch). A submodule that the second
    thread calls directly is refused at its forward hook, after it ran (its output dropped). Forwards from different threads
    one after the other are fine, and so is autograd's own threads running backward hooks or
    recomputing checkpointed modules. A batch's end is concluded (its event found, reviewed,
    replayed) before another thread's forward starts: that forward waits for it. A trace-mode
    replay starts only when no other thread's forward runs and holds the recorder's lock while
    it runs, so another thread's forward waits for it (a replay hooks the modules the other
    forward would run). While one watch replays a batch, every other watch records nothing on
    the replaying thread (:meth:`Recorder.quiet_on_this_thread`: a GAN generator's replay runs
    the watched discriminator in its loss) and records as usual on the other threads.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from .copies import (COPIED, copy_without_watch, drop_copied_hooks, is_nanwidget_hook,
                     stop_copying_without_watch)
from .fastpath import FusedPathKeeper, has_fused_path, keep_fused_path, release_fused_path
from .detect import Detector, Window, first_event
from .entries import Entry, EntryBuilder
from .events import AbortAfterBatch, NanDetected, NanEvent, NanWarning
from .frames import Frame
from .graph_capture import (captured, compile_wrappers_of, compiled_module_of,
                            dynamo_compiling, export_flag, mark_forward_as_watched, meta_only,
                            never_compiled, run_eagerly_under_dynamo, tracing, unmark_forward)
from .holders import has_no_forward, stand_ins
from .opaque import (add_forward_hook, add_forward_pre_hook, inside_torchscript, packed_weights,
                     weights_of)
from .options import name_matches, wrapper_names
from .ranks import current_rank
from .sourcelines import user_stacklevel
from .records import Finding, Records
from .schema import PACKED
from .state import watched_modules, watching_recorders
from .stats import PendingStats, is_distributed_tensor, sharded_parameters, stood_for
from .writes import steps_taken, track_optimizer_steps

__all__ = ["Recorder", "Feature", "Finding", "ModuleInfo", "ConcurrentForwardError",
           "AlreadyWatchedError", "CompiledCallError", "watched_by", "in_backward_pass",
           "is_fsdp_unit"]

_get_ident = threading.get_ident
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_Tensor = torch.Tensor
_CALL_IMPL = nn.Module._call_impl.__code__  # the frame of every module call with hooks
# Batches whose frame and call counters are kept for late backward frames (gradient
# accumulation can backpropagate several earlier forwards in one pass).
_RECENT_COUNTERS = 8


def raised_out_of(module: nn.Module, error: BaseException | None) -> bool:
    """Whether ``error`` is propagating out of ``module``'s call right now: an ``always_call``
    forward hook runs then, with None for the output the forward never returned. The call's
    own frame caught it (an exception the caller was already handling was caught elsewhere)."""
    trace = getattr(error, "__traceback__", None)
    if trace is None:
        return False
    frame = trace.tb_frame
    return frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is module


def _running_modules(frame: Any) -> Iterator[nn.Module]:
    """The modules whose calls are on the stack from ``frame`` outward, innermost first (read
    from the frames of ``Module._call_impl``)."""
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            module = frame.f_locals.get("self")
            if module is not None:
                yield module
        frame = frame.f_back


def _call_arguments(frame: Any, module: nn.Module) -> tuple[tuple, dict] | None:
    """The arguments of ``module``'s call on the stack from ``frame`` outward (read from its
    ``Module._call_impl`` frame), or None when it is not there."""
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            local = frame.f_locals
            if local.get("self") is module:
                return tuple(local.get("args") or ()), dict(local.get("kwargs") or {})
        frame = frame.f_back
    return None


def _weak_output_tensors(output: Any) -> list[weakref.ref[_Tensor]]:
    """Weak references to the tensors a root forward returned (the output itself, or the
    values of its tuple, list, dict or ModelOutput; a few at most), for telling the calls made
    on them afterwards (see :class:`_AfterForward`): weak, so that the output and its graph
    go when the user drops them."""
    if type(output) is _Tensor:
        return [weakref.ref(output)]
    found = []
    try:  # an odd output (a mapping whose values() raises) only goes unfollowed
        if isinstance(output, _Tensor):
            return [weakref.ref(output)]
        values = output.values() if isinstance(output, dict) else \
            output if isinstance(output, (tuple, list)) else ()
        for value in values:
            if isinstance(value, _Tensor):
                found.append(weakref.ref(value))
                if len(found) == _OUTPUTS_FOLLOWED:
                    break
    except Exception:
        return found
    return found


_OUTPUTS_FOLLOWED = 4  # output tensors of a root forward followed into calls made on them
_NODES_WALKED = 256  # autograd nodes walked back from a call's inputs to find the output's


def _storage_of(tensor: _Tensor) -> int:
    """The address of a dense tensor's memory; 0 for one without (sparse, meta, empty)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # sparse, nested or a subclass without one
        return 0


def _flows_from(outputs: list[_Tensor], args: tuple, kwargs: dict) -> bool:
    """Whether a call's inputs are, or were computed from, one of ``outputs``: the tensor
    itself, a view of it or its memory (``out.detach()``), or a tensor whose autograd graph
    reaches the output's (a ``log_softmax`` of the logits, ``out.logits.view(-1, V)``)."""
    ids = {id(tensor) for tensor in outputs}
    bases = {id(tensor._base) for tensor in outputs if tensor._base is not None} | ids
    storages = {_storage_of(tensor) for tensor in outputs} - {0}
    nodes = {tensor.grad_fn for tensor in outputs if tensor.grad_fn is not None}
    given: list[_Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, _Tensor):
            given.append(value)
        elif isinstance(value, (tuple, list, dict)):
            given.extend(item for item in (value.values() if isinstance(value, dict) else value)
                         if isinstance(item, _Tensor))
    pending = []
    for tensor in given[:16]:
        if id(tensor) in ids or (tensor._base is not None and id(tensor._base) in bases) \
                or (storages and _storage_of(tensor) in storages):
            return True
        if tensor.grad_fn is not None:
            pending.append(tensor.grad_fn)
    if not nodes:
        return False
    seen: set[int] = set()
    while pending and len(seen) < _NODES_WALKED:
        node = pending.pop()
        if node in nodes:
            return True
        if id(node) in seen:
            continue
        seen.add(id(node))
        pending.extend(following for following, _ in node.next_functions if following is not None)
    return False


class _AfterForward:
    """The root forward that returned last, while calls may follow on its output before the
    next batch starts: a loss the model holds, run on what it returned
    (``loss = model.loss(model(x), y)``). Such a call belongs to that forward's batch, though
    the root's return already counted the next one."""

    __slots__ = ("batch", "outputs", "modules", "steps")

    def __init__(self, batch: int, outputs: list[weakref.ref[_Tensor]]) -> None:
        self.batch = batch
        self.outputs = outputs
        self.steps = steps_taken()  # an optimizer step since ends that forward's calls
        # Outermost modules found running on the output (made at the first: one per batch).
        self.modules: set[int] | None = None

    def live_outputs(self) -> list[_Tensor]:
        return [tensor for tensor in (ref() for ref in self.outputs) if tensor is not None]


def in_backward_pass() -> bool:
    """Whether autograd is executing a backward pass on this thread (a forward running now is
    a recomputation, e.g. by ``torch.utils.checkpoint``)."""
    return _graph_task_id() >= 0

_WATCHED = watched_modules()  # module -> the recorder hooking it (see core.state)


class ConcurrentForwardError(RuntimeError):
    """A second thread entered a watched forward while another thread's forward was running."""


class AlreadyWatchedError(RuntimeError):
    """A module is already hooked by another live recorder."""


class CompiledCallError(RuntimeError):
    """A watched module runs inside compiled code that the watch was not made for."""


class _RefusedWhileDynamoTraces(CompiledCallError, AssertionError):
    """The :class:`CompiledCallError` raised while Dynamo traces the watched model's hooks (a
    ``torch.nn`` container compiled after the watch: Dynamo compiles its call hooks included).
    Dynamo hands an ``AssertionError`` raised while it traces to the caller as it is (any other
    error it wraps in its own), and caches nothing for the code it was tracing. Refused after a
    graph break instead, it would cache code that runs the call uncompiled, and that code is
    shared: every container of the class, compiled later in the process, would run uncompiled.
    Named as the error it is."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message  # without the user stack Dynamo appends to ``args``


_RefusedWhileDynamoTraces.__name__ = _RefusedWhileDynamoTraces.__qualname__ = "CompiledCallError"


_INSIDE_A_WRAPPER = ("runs inside a torch.compile'd model: you watched cm._orig_mod (or compiled "
                     "the model after nw.watch()) and called the compiled one")


def _in_optimized_module(eval_frame: Any) -> bool:
    """Whether a ``torch.compile`` wrapper's call is running its compiled code (not while
    ``torch.compiler.set_stance("force_eager")`` runs it eagerly, hooks included);
    ``eval_frame``: ``torch._dynamo.eval_frame`` (or None, not loaded)."""
    probe = getattr(eval_frame, "_is_in_optimized_module", None)
    return probe is not None and bool(probe()) and not _forced_eager(eval_frame)


def _forced_eager(eval_frame: Any) -> bool:
    return getattr(getattr(eval_frame, "_stance", None), "stance", "default") == "force_eager"


def is_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) manages ``module``: its parameters are unsharded only
    while its forward runs, so hooks that read them must run before FSDP's post-forward hook."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # imported by whoever called fully_shard
    unit = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return unit is not None and isinstance(module, unit)


def _within(name: str, outer: str) -> bool:
    """Whether module ``name`` is ``outer`` or inside it (qualified names; "" is the root)."""
    return outer == "" or name == outer or name.startswith(outer + ".")


def watched_by(module: nn.Module) -> Recorder | None:
    """The live recorder that hooks ``module``, if any."""
    reference = _WATCHED.get(module)
    owner = reference() if reference is not None else None
    return owner if owner is not None and not owner.closed else None


class Feature:
    """A part of a watch that rides along the recorder. Every method is optional: the recorder
    calls only the ones a feature overrides, so a feature costs nothing for what it does not do.

    Methods marked "under the lock" run while the recorder's lock is held: keep them short and
    never call into the model there. Features see the recorder through its public API only.
    """

    def on_batch_start(self, batch: int, args: tuple, kwargs: dict) -> None:
        """Under the lock: the root forward is about to run ``batch`` with these inputs."""

    def on_batch_output(self, batch: int, output: Any) -> None:
        """Under the lock: the outermost root forward of ``batch`` returned ``output`` (not
        called when it raised); runs before the batch's frames are resolved."""

    def on_batch_raised(self, batch: int, error: BaseException) -> None:
        """Under the lock: the outermost root forward of ``batch`` raised ``error`` (instead of
        :meth:`on_batch_output`; the exception goes on to the caller); runs before the batch's
        frames are resolved."""

    def before_resolve(self) -> None:
        """Under the lock: frames are about to be resolved (fill stats measured elsewhere)."""

    def on_batch_end(self, batch: int, frames: list[Frame]) -> None:
        """Under the lock: ``batch`` ended (its root forward returned, or
        :meth:`Recorder.set_batch` moved on); ``frames`` are its frames resolved now."""

    def on_frames_resolved(self, frames: list[Frame]) -> None:
        """Under the lock: frames resolved within a batch (the end of a backward pass, a flush,
        :meth:`Recorder.close`); no batch ended."""

    def on_frames_replayed(self, frames: list[Frame]) -> None:
        """Under the lock: frames a replay made (see :meth:`find_event`), taken into the ring
        and history as if recorded live."""

    def on_output_magnitude(self, batch: int, module: str, abs_max: float,
                            abs_min: float) -> None:
        """Under the lock: the finite outputs of ``module`` in ``batch`` reached ``abs_max``,
        measured outside the module hooks (the sentinel reads the root's outputs every batch);
        it is in the history already (:meth:`Recorder.add_history_row`)."""

    def find_event(self, batch: int, event: NanEvent | None, reason: str) -> Finding | None:
        """Outside the lock, before the reviews: a feature that checks batches on its own (the
        sentinel) returns what it found when ``reason`` ended (as in :meth:`review_event`): an
        event (used when the recorder found none) and the frames its replays made, which the
        recorder takes first. ``event``: what the recorder found itself. None: nothing."""
        return None

    #: Whether :meth:`review_event` runs also when there is no event (a feature that only adds
    #: detail to events says False: one call less on every batch).
    reviews_without_event = True

    def review_event(self, batch: int, event: NanEvent | None, reason: str) -> NanEvent | None:
        """Outside the lock, before an event is recorded: return the event to record (the one
        given, the same with more detail, another one, or None). ``reason`` says what ended:
        "forward", "backward", "set_batch", "flush", "interrupted" or "close" (at close,
        only with an event: what a feature found then)."""
        return event

    def on_event(self, event: NanEvent) -> None:
        """Under the lock: ``event`` was recorded (it is in :attr:`Recorder.events`)."""

    def close(self) -> None:
        """The recorder closed: remove hooks, flush files."""


# torch's modules whose kernels write their running statistics in place in the forward.
_RUNNING_STATS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                  nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


class ModuleInfo:
    """A watched module: its qualified name, class name and position in ``named_modules()``."""

    __slots__ = ("module", "name", "type_name", "index", "is_root", "has_state", "pre_entries",
                 "sharded", "weights", "sharded_parameters", "own_float_buffers", "pre_buffers")

    def __init__(self, module: nn.Module, name: str, index: int, is_root: bool,
                 sharded: bool = False) -> None:
        self.module = module
        self.name = name
        self.type_name = type(module).__name__
        self.index = index
        self.is_root = is_root
        # Where its frames read their weights: the module, or what a TorchScript module or a
        # GraphModule uses from inside it (see core.opaque).
        self.weights = weights_of(module)
        # Own parameters or buffers (lazy modules hold uninitialised ones from the start).
        self.has_state = bool(self.weights._parameters) or bool(self.weights._buffers)
        # Inside a module FSDP2 manages (``fully_shard``): its parameters are gathered into
        # the same tensors every forward, version counters kept, and freed after it.
        self.sharded = sharded
        # Its parameters FSDP2 keeps as DTensors between forwards (see weight()).
        self.sharded_parameters = sharded_parameters(self.weights) if sharded else {}
        # Input entries measured by the pre-hook of an in-place module (a stack: recursion).
        self.pre_entries: list[list[Entry]] = []
        # Floating buffers of a class from outside torch: its forward may rewrite them through
        # .data, version counters kept (vector-quantize-pytorch's EMA codebook), so they are
        # measured before it runs, as it read them (pre_buffers: a stack, as pre_entries).
        # Not a BatchNorm or InstanceNorm of another library (timm's BatchNormAct2d): their
        # running statistics are written by torch's kernel, also without a version bump, and a
        # NaN written there is the forward's own, seen after it.
        self.own_float_buffers = not type(module).__module__.startswith("torch.") \
            and not isinstance(module, _RUNNING_STATS) and any(
                tensor is not None and tensor.is_floating_point()
                for tensor in self.weights._buffers.values())
        self.pre_buffers: list[dict[str, Any]] = []

    @property
    def label(self) -> str:
        """The name as users read it: "<root>" for the model itself."""
        return self.name or "<root>"

    @property
    def has_no_forward(self) -> bool:
        """Whether the module cannot be called: its class has no forward of its own (a
        ``ParameterDict``, ``ParameterList`` or plain holder whose weights others read)."""
        return has_no_forward(self.module)


class _Counters:
    """Call counts and the next frame index of one batch."""

    __slots__ = ("batch", "calls", "next_frame")

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.calls: dict[int, int] = {}
        self.next_frame = 0


class Recorder:
    """Hooks ``model`` and records a frame per module call; finds the first NaN/Inf per batch.

    ``skip``: module classes and class names not hooked (never the root). ``on_nan``: "raise",
    "warn" or "record". ``abort_after``: raise :class:`AbortAfterBatch` at the first finished
    batch whose number is at or past it, or at the end of a root forward in a batch past it.
    ``max_events``: events kept (more are counted).
    ``allow_inf``: module name globs and module classes whose outputs may hold ±inf on purpose.
    ``root_only``: hook only the root (sentinel mode); :meth:`attach_module_hooks` hooks every
    module for the batches recorded in full. ``entry``: the module whose call is one batch when
    it is not ``model`` (the ``torch.compile`` wrapper around it); the root's hooks go there
    (and, while :meth:`attach_direct_call_hooks` says so, on ``model`` too).
    """

    def __init__(self, model: nn.Module, *, max_frames: int = 21,
                 trace_batches: Iterable[int] = (), abort_after: int | None = None,
                 skip: tuple[tuple[type, ...], frozenset[str]] = ((), frozenset()),
                 on_nan: str = "raise", max_events: int = 100,
                 allow_inf: tuple[tuple[str, ...], tuple[type, ...]] = ((), ()),
                 root_only: bool = False, entry: nn.Module | None = None) -> None:
        self.model = model
        # The module whose call is one batch: the model, or a torch.compile wrapper around it.
        self.entry = model if entry is None else entry
        # Only the root's hooks stay on; module hooks come with attach_module_hooks().
        self.root_only = root_only
        # The object that composed this recorder (a NanWatch). The hooks keep the recorder
        # alive and the recorder its owner, so a watch whose variable was lost is still
        # reachable (nanwidget.live_watches()) for as long as its hooks are attached.
        self.owner: Any = None
        self.max_frames = max_frames
        self.trace_batches = frozenset(trace_batches)
        self.abort_after = abort_after
        self.on_nan = on_nan
        self.max_events = max_events
        self.interrupted_batches: list[int] = []
        self._rank = current_rank()
        self._features: list[Feature] = []
        self._refresh_callbacks()
        self._lock = threading.RLock()
        # Signalled when a batch's conclusion ends (another thread's forward waits for it) and
        # when a root forward ends (a replay waits for it); see the module docstring, Threads.
        self._idle = threading.Condition(self._lock)
        self._idle_waiters = 0
        # The thread concluding the batch it just ended (finding, reviewing, replaying its
        # event), or None: another thread's root forward waits until it is done.
        self._concluding_thread: int | None = None
        self._closed = False
        # Fused optimizers write weights without version counters: count every step while
        # this recorder is open (core.writes), so that cached weight measurements renew; also
        # let go when the recorder is collected without close().
        self._step_tracking = track_optimizer_steps()
        weakref.finalize(self, self._step_tracking.release)
        # Suspensions in force (own replays, other watches' replays), and the threads whose
        # hooks they quiet (thread -> depth); the hooks read the count first (0: one read).
        self._suspended = 0
        self._suspended_threads: dict[int, int] = {}
        self._own_suspensions = 0  # suspend() blocks: every thread's features stand by
        # Guards the three above: another watch's replay changes them without self._lock (see
        # quiet_on_this_thread). Held for a few lines, never while taking another lock.
        self._suspensions_lock = threading.Lock()
        self._aside_thread: int | None = None  # a tracer runs the model on it (see tracing())
        self._aborted = False
        # Per pass (backward or not): (place, batch, repeated) of the last event warned about.
        self._warned: dict[bool, tuple[tuple, int, bool]] = {}
        self._size_words = ""  # "LlamaForCausalLM of 13.4K parameters", once asked for
        self._warned_internal = False
        # Batch state: one forward at a time (see the module docstring).
        self._batch = 0
        self._manual_batches = False
        self._frames: list[Frame] = []  # recorded since the last resolve
        self._counters = _Counters(0)
        # Counters of recent finished batches, for backward frames that arrive after the root
        # forward already counted the next batch (oldest first; at most _RECENT_COUNTERS).
        self._recent: dict[int, _Counters] = {}
        self._root_depth = 0
        self._root_frame: Any = None  # torch's call frame of the outermost running root call
        self._root_thread: int | None = None
        self._exception_at_start: BaseException | None = None
        self._pending = PendingStats()
        self.entries = EntryBuilder(self._pending)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # The root hooks on the original module while direct calls count (see the docstring).
        self._direct_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._direct_call = False  # the running (or last) batch came through them
        self._entered: nn.Module = model  # the module whose call opened that batch
        # (module, the forward count_outside_calls() gave it): calls outside the root count.
        self._outside_forwards: list[tuple[nn.Module, Any]] = []
        # id(root module) -> the id of the watch's forward hook on it, moved back behind the
        # user's own root forward hooks at each batch start (see _keep_forward_hook_last).
        self._last_forward_hooks: dict[int, int] = {}
        self._root_pre_hook_id: int | None = None  # the watch's forward pre-hook on the entry
        self._module_handles: list[torch.utils.hooks.RemovableHandle] = []
        # Layers whose fused path the hooks would turn off (core.fastpath): the root, while
        # the watch lasts; the others, while module hooks are attached.
        self._fused_root: tuple[nn.Module, FusedPathKeeper] | None = None
        self._fused_layers: list[tuple[nn.Module, FusedPathKeeper]] = []
        # torch.compile wrappers whose calls are refused (see _refuse_wrapper_call).
        self._wrappers: list[weakref.ref[nn.Module]] = []
        # (module, its forward while watched): code compiled before the watch, or for another
        # module of the class, must not run these modules without their hooks (see
        # core.graph_capture.mark_forward_as_watched).
        self._marked_forwards: list[tuple[nn.Module, Any]] = []
        self._infos: dict[int, ModuleInfo] = {}
        # Outermost modules whose calls outside a root forward returned in this batch (see
        # _record_outside_root): one that runs again starts the next batch.
        self._outside_returned: set[int] = set()
        # Optimizer steps taken (writes.steps_taken) when the last such call returned: a call
        # after a step that came later starts the next batch (see _pass_stepped).
        self._outside_steps = 0
        # Recent batches whose passes ran without the root forward (read for replay errors).
        self._outside_batches: collections.deque[int] = collections.deque(maxlen=64)
        # The last root forward, while calls on its output may follow (see _AfterForward), and
        # the batch the last call outside a root forward was filed under (see frames_batch).
        self._after_forward: _AfterForward | None = None
        self._outside_call_batch: int | None = None
        # (batch, frame) of recent forward frames of such calls (see ran_on_output).
        self._frames_on_output: collections.deque[tuple[int, int]] = \
            collections.deque(maxlen=256)
        # id(module outside the watched tree that called a watched one) -> (weak reference,
        # whether it belongs to another model): see _another_models_module.
        self._callers_outside: dict[int, tuple[weakref.ref[nn.Module], bool]] = {}
        # A module compiled in place (module.compile()) runs its hooks under Dynamo's frame
        # callback: its root hooks are wrapped so Dynamo never traces them (no graph, no break).
        self._compiled_in_place = getattr(model, "_compiled_call_impl", None) is not None

        skip_classes, skip_names = skip
        # Every module of the model when it was watched (skipped ones too), for
        # structure_changes(); held, so that an id is never reused while it is compared.
        self._initial_modules = {id(module): (name, module)
                                 for name, module in model.named_modules()}
        modules: list[tuple[str, nn.Module]] = []
        named = list(model.named_modules())
        hidden = inside_torchscript(named)  # their hooks never run: the TorchScript one is watched
        for name, module in named:
            if module is not model and (isinstance(module, skip_classes)
                                        or type(module).__name__ in skip_names
                                        or name in hidden):
                continue
            modules.append((name, module))
        for name, module in modules:
            if watched_by(module) is not None:
                raise AlreadyWatchedError(
                    f"module '{name or '<root>'}' ({type(module).__name__}) is already watched by "
                    "another NanWatch; close() that one first (nanwidget.live_watches() lists "
                    "the watches still attached)")
        units = [name for name, module in modules if is_fsdp_unit(module)]
        self.modules = [ModuleInfo(module, name, index, module is model,
                                   sharded=any(_within(name, unit) for unit in units))
                        for index, (name, module) in enumerate(modules)]
        self.module_names = [info.name for info in self.modules]
        self.module_types = [info.type_name for info in self.modules]
        self._by_name = {info.name: info for info in self.modules}
        patterns, classes = allow_inf
        allowed = {info.name for info in self.modules
                   if any(name_matches(info.name, p) for p in patterns)
                   or (classes and isinstance(info.module, classes))}
        # A wrapper (FSDP1's unit, checkpoint_wrapper) returns what the allowed module returns.
        self.inf_allowed = frozenset(allowed | wrapper_names(self.module_names, allowed))
        self._detector = Detector(self.inf_allowed, self.weights_now, self.module_names,
                                  is_buffer=self.is_buffer)
        self._warned_unread = False
        #: The ring, trace batches' frames, history and events of the finished batches.
        self.records = Records(self.module_names, self.module_types, max_frames=max_frames,
                               trace_batches=self.trace_batches, max_events=max_events,
                               detector=self._detector, rank=self._rank)
        try:
            for info in self.modules:
                self._infos[id(info.module)] = info
                _WATCHED[info.module] = weakref.ref(self)
                copy_without_watch(info.module)
            if self.entry is not model:
                self._infos[id(self.entry)] = self.modules[0]
                _WATCHED[self.entry] = weakref.ref(self)
                copy_without_watch(self.entry)
            self._install_root_hooks()
            if not root_only:
                self.attach_module_hooks()
            self._mark_forwards(root_only)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ public state
    @property
    def batch(self) -> int:
        """The batch being recorded (or about to be): 0-based."""
        return self._batch

    def structure_changes(self) -> tuple[list[tuple[str, nn.Module]], list[str]]:
        """Modules added to the model since it was watched (name, module: not hooked, so they
        record no frames; a replaced one counts as added), and the names of those removed (or
        replaced). A holder rebuilt around the same tensors (Keras' ``_torch_params`` on every
        ``fit()``: :mod:`.holders`) is no change: it is followed. Walks the model: for event
        time, not hooks."""
        now = {id(module): (name, module) for name, module in self.model.named_modules()}
        initial = self._initial_modules
        added = [(name, module) for key, (name, module) in now.items() if key not in initial]
        removed = [(name, module) for key, (name, module) in initial.items() if key not in now]
        for name, old, new in stand_ins(added, removed):
            del initial[id(old)]
            initial[id(new)] = (name, new)
        added = [(name, module) for name, module in added if id(module) not in initial]
        removed_names = [name for name, module in removed if id(module) in initial]
        return added, removed_names

    def moved_modules(self) -> dict[str, str]:
        """Watched modules that now sit at another path than when the model was watched (peft's
        ``get_peft_model()`` and ``merge_and_unload()`` move layers): name when watched -> name
        now. Frames and events keep the first. Walks the model: for event time, not hooks."""
        initial = self._initial_modules
        return {initial[id(module)][0]: name for name, module in self.model.named_modules()
                if id(module) in initial and initial[id(module)][0] != name}

    @property
    def module_hooks_attached(self) -> bool:
        """Whether every watched module is hooked now (always, unless ``root_only``)."""
        return bool(self._module_handles)

    def attach_module_hooks(self) -> None:
        """Hook every watched module besides the root (its frames are recorded from the next
        module call on) until :meth:`detach_module_hooks`. A ``root_only`` recorder calls this
        for the batches it records in full (sampled and trace batches). Caller may hold the
        lock; a no-op when attached already or closed."""
        with self._lock:
            if self._closed or self._module_handles:
                return
            handles = self._module_handles
            try:
                for info in self.modules:
                    if info.is_root:
                        continue  # the root's own hooks are always on (and measure its inputs)
                    module = info.module
                    if getattr(module, "inplace", False) is True:
                        handles.append(add_forward_pre_hook(
                            module, self._inplace_pre_hook, with_kwargs=True))
                    if info.own_float_buffers:
                        handles.append(add_forward_pre_hook(
                            module, self._buffers_pre_hook(info), with_kwargs=True))
                    # Before FSDP2's post-forward hook reshards: read the weights the forward used.
                    handles.append(add_forward_hook(
                        module, self._module_forward_hook(info), with_kwargs=True,
                        always_call=True, prepend=is_fsdp_unit(module)))
                    if has_fused_path(module):
                        self._fused_layers.append((module, keep_fused_path(module)))
            except BaseException:
                self.detach_module_hooks()
                raise

    def detach_module_hooks(self) -> None:
        """Remove the hooks :meth:`attach_module_hooks` added (the root's stay)."""
        with self._lock:
            for handle in self._module_handles:
                handle.remove()
            self._module_handles.clear()
            for info in self.modules:
                if not info.is_root:
                    info.pre_entries.clear()
                    info.pre_buffers.clear()
            for layer, keeper in self._fused_layers:
                release_fused_path(layer, keeper)
            self._fused_layers.clear()

    @property
    def direct_call_hooks_attached(self) -> bool:
        """Whether direct calls of the original module count as batches now (see
        :meth:`attach_direct_call_hooks`)."""
        return bool(self._direct_handles)

    @property
    def direct_call(self) -> bool:
        """Whether the batch running now (or the last one) was opened by a direct call of the
        original module (:meth:`attach_direct_call_hooks`) rather than by the entry: it ran
        eagerly, not compiled; or by a call of a module :meth:`count_outside_calls` counts
        (:attr:`batch_entry` names it). Features read it in ``on_batch_start``."""
        return self._direct_call

    def attach_direct_call_hooks(self) -> bool:
        """When the entry is a ``torch.compile`` wrapper, count direct calls of the original
        module (``recorder.model``) as batches too: the root's pre- and forward hooks go on it,
        so such a call is one batch exactly like a wrapper call (features see it the same way).
        Returns whether they are attached (False when the entry is the model itself: every
        call counts already; or when closed). Idempotent.

        Only for a stretch in which the wrapper is not compiled: Dynamo compiling it while
        these hooks are on traces them (a graph break). They are removed by
        :meth:`detach_direct_call_hooks`, :meth:`close`, and the wrapper's next call, before its
        compiled code runs."""
        with self._lock:
            if self._closed or self.entry is self.model:
                return False
            if self._direct_handles:
                return True
            model = self.model
            handles = self._direct_handles
            try:
                handles.append(model.register_forward_pre_hook(self._root_pre_hook,
                                                               with_kwargs=True))
                handles.append(add_forward_hook(
                    model, self._forward_hook, with_kwargs=True, always_call=True,
                    prepend=is_fsdp_unit(model)))
                if not is_fsdp_unit(model):
                    self._last_forward_hooks[id(model)] = handles[-1].id
            except BaseException:
                self.detach_direct_call_hooks()
                raise
            return True

    def detach_direct_call_hooks(self) -> None:
        """Remove the hooks :meth:`attach_direct_call_hooks` added; idempotent."""
        with self._lock:
            for handle in self._direct_handles:
                handle.remove()
            self._direct_handles.clear()
            if self.entry is not self.model:
                self._last_forward_hooks.pop(id(self.model), None)

    def count_outside_calls(self, module: nn.Module) -> bool:
        """Make each call of ``module`` (a watched module inside the model: what a wrapper's
        ``get_base_model()`` gives, which peft's ``generate()`` calls instead of the model's
        forward) made while no root forward runs a batch of its own, exactly as a root call
        is one: the root's pre- and forward hook logic runs around it, features see its
        inputs and outputs (``on_batch_start``, ``on_batch_output``) and
        :attr:`batch_entry` names ``module``. A call inside a root forward (the model's own
        forward calling it) costs one flag test and is part of that batch, as before.

        No hook is registered: ``module`` gets an instance-level ``forward`` (see
        :mod:`.fastpath`, which does the same) that tests the flag and calls the forward it had,
        so that the root's calls of it stay on torch's fast path. Copies and pickles leave it
        out; :meth:`close` takes it off. Returns whether calls are counted (False for the
        root, a module not watched, a module compiled in place or one whose forward the watch
        already replaced; also when closed). Idempotent."""
        with self._lock:
            if self._closed or module is self.model or module is self.entry \
                    or id(module) not in self._infos \
                    or getattr(module, "_compiled_call_impl", None) is not None:
                return False
            if any(counted is module for counted, _ in self._outside_forwards):
                return True
            previous = module.__dict__.get("forward")
            if isinstance(previous, FusedPathKeeper) or (
                    previous is not None and is_nanwidget_hook(previous)):
                return False
            run = previous if previous is not None else \
                types.MethodType(type(module).forward, module)
            # Read by a closure, not an attribute lookup: the root's calls of the module pay
            # one test of the recorder's depth (and of closed) on top of their own forward.
            recorder = self

            def forward(*args: Any, **kwargs: Any) -> Any:
                if recorder._root_depth or recorder._closed:
                    return run(*args, **kwargs)
                return recorder._outside_call(module, run, args, kwargs)

            forward.__wrapped__ = run  # type: ignore[attr-defined]  # inspect.signature()
            # What copies and pickles get instead (core.copies): the forward it had, or none.
            forward.previous = previous  # type: ignore[attr-defined]
            module.__dict__["forward"] = forward
            self._outside_forwards.append((module, forward))
            return True

    def _outside_call(self, module: nn.Module, run: Any, args: tuple, kwargs: dict) -> Any:
        """A call of a module :meth:`count_outside_calls` counts, made outside any root
        forward: one batch, through the root's own hooks (as torch would run them, the
        forward hook also when the forward raises)."""
        if self._skip_this_thread() or _graph_task_id() >= 0 or dynamo_compiling():
            return run(*args, **kwargs)  # a replay, a recomputation in backward, Dynamo
        self._root_pre_hook(module, args, kwargs)
        try:
            output = run(*args, **kwargs)
        except Exception:
            self._forward_hook(module, args, kwargs, None)
            raise
        self._forward_hook(module, args, kwargs, output)
        return output

    @property
    def batch_entry(self) -> ModuleInfo:
        """The module whose call opened the batch running now (or the last one): the root's
        info, or that of a module :meth:`count_outside_calls` counts (then
        :attr:`direct_call` is True too). For a feature's ``on_batch_start``."""
        if not self._direct_call:
            return self.modules[0]
        return self._infos.get(id(self._entered), self.modules[0])

    def _install_root_hooks(self) -> None:
        pre_hook, forward_hook = self._root_pre_hook, self._forward_hook
        if self._compiled_in_place and self.entry is self.model:
            import torch._dynamo  # loaded already: the model was compiled
            pre_hook = torch._dynamo.disable(pre_hook)
            forward_hook = torch._dynamo.disable(forward_hook)
        entry = self.entry
        if entry is self.model and has_fused_path(entry) and not self._compiled_in_place:
            self._fused_root = (entry, keep_fused_path(entry))
        self._handles.append(entry.register_forward_pre_hook(pre_hook, with_kwargs=True))
        self._root_pre_hook_id = self._handles[-1].id
        self._handles.append(add_forward_hook(
            entry, forward_hook, with_kwargs=True, always_call=True,
            prepend=is_fsdp_unit(entry)))
        if not is_fsdp_unit(entry):  # an FSDP unit's runs first, before it reshards
            self._last_forward_hooks[id(entry)] = self._handles[-1].id
        if entry is self.model:
            for wrapper in compile_wrappers_of(entry):
                self._handles.append(wrapper.register_forward_pre_hook(self._refuse_wrapper_call,
                                                                     with_kwargs=True))
                copy_without_watch(wrapper)
                self._wrappers.append(weakref.ref(wrapper))

    def _mark_forwards(self, root_only: bool) -> None:
        """Mark the forward of every module hooked for the whole watch (the root; in full mode
        every module) so that compiled code that ran them without these hooks is compiled anew
        (see :func:`~nanwidget.core.graph_capture.mark_forward_as_watched`). Module hooks that
        come and go (sentinel mode's sampled batches) mark nothing: each change would recompile.
        Not the root of a compile wrapper's entry (its compiled code runs outside the hooks),
        nor a layer whose fused path the watch keeps (that forward is already an instance's)."""
        if self.entry is not self.model:
            return
        for info in self.modules[:1] if root_only else self.modules:
            marked = mark_forward_as_watched(info.module)
            if marked is not None:
                self._marked_forwards.append((info.module, marked))

    def pre_hooks_before_held_inputs(self) -> tuple[list[int], list[int]]:
        """The forward pre-hooks that run on the model before the watch's root pre-hook takes
        a batch's inputs, so that a held batch holds what they made of them: (ids in torch's
        global forward pre-hooks, ids in the model's own registered before the watch), in the
        order they run. A replay calling the model must not run them again. None when the
        entry is a compile wrapper: its inputs are taken there, before the model's hooks run.
        For event time (reads torch's hook dicts)."""
        if self.entry is not self.model or self._root_pre_hook_id is None:
            return [], []
        own = list(self.model._forward_pre_hooks)
        if self._root_pre_hook_id not in own:
            return [], []  # closed
        return (list(nn.modules.module._global_forward_pre_hooks),
                own[:own.index(self._root_pre_hook_id)])

    def _records_frames(self) -> bool:
        """Whether this batch's frames are recorded (always, unless ``root_only`` and no
        module hooks are attached: then only the root's outputs are looked at, by a feature)."""
        return not self.root_only or bool(self._module_handles)

    @property
    def manual_batches(self) -> bool:
        """True once :meth:`set_batch` numbers the batches."""
        return self._manual_batches

    @property
    def rank(self) -> int:
        """torch.distributed rank seen at the last resolve (0 without a process group)."""
        return self._rank

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def suspended(self) -> bool:
        """True while a :meth:`suspend` block runs (a trace-mode replay), while another
        watch's replay runs on this thread (:meth:`quiet_on_this_thread`), or while a tracer
        runs the model (``torch.export``, ``torch.jit.trace``: the watch stands aside)."""
        if self._suspended and (self._own_suspensions
                                or _get_ident() in self._suspended_threads):
            return True
        return self._aside_thread is not None

    @property
    def lock(self) -> threading.RLock:
        """The lock that guards the batch state; features take it around their own records."""
        return self._lock

    @property
    def events(self) -> list[NanEvent]:
        """Every recorded event (at most ``max_events``; see ``events_dropped``)."""
        return list(self.records.events)

    @property
    def event(self) -> NanEvent | None:
        """The first recorded event, or None."""
        events = self.records.events
        return events[0] if events else None

    @property
    def events_dropped(self) -> int:
        """Events past ``max_events``, counted but not kept."""
        return self.records.events_dropped

    @property
    def features(self) -> list[Feature]:
        return list(self._features)

    def add_feature(self, feature: Feature) -> Feature:
        """Let ``feature`` see batches and events from now on (in the order added)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this watch is closed")
            self._features.append(feature)
            self._refresh_callbacks()
        return feature

    def _refresh_callbacks(self) -> None:
        """The bound methods each batch step calls: only those a feature overrides, so that a
        feature costs nothing on the hot path for what it does not do."""
        def overriding(name: str) -> list[Any]:
            base = getattr(Feature, name)
            return [getattr(f, name) for f in self._features
                    if getattr(type(f), name, base) is not base]
        self._on_batch_start = overriding("on_batch_start")
        self._on_batch_output = overriding("on_batch_output")
        self._on_batch_raised = overriding("on_batch_raised")
        self._before_resolve = overriding("before_resolve")
        self._on_batch_end = overriding("on_batch_end")
        self._on_frames_resolved = overriding("on_frames_resolved")
        self._on_frames_replayed = overriding("on_frames_replayed")
        self._on_output_magnitude = overriding("on_output_magnitude")
        self._find_event = overriding("find_event")
        self._review_event = [(review, getattr(review.__self__, "reviews_without_event", True))
                              for review in overriding("review_event")]
        first = next((i for i, (_, without) in enumerate(self._review_event) if without),
                     len(self._review_event))
        self._review_without_event = self._review_event[first:]
        self._on_event = overriding("on_event")

    # ------------------------------------------------------------------ hooks (hot path)
    def _skip_this_thread(self) -> bool:
        """While suspended, the suspending thread's hooks record nothing."""
        return self._suspended > 0 and _get_ident() in self._suspended_threads

    # Dynamo traces the start of the root's pre-hook (to refuse the compiled calls it must
    # refuse, before any graph break), never the rest; its frames run as plain Python.
    @never_compiled
    def _root_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._direct_handles and module is not self.model:
            # The compile wrapper is called: off with the original module's hooks before its
            # compiled code runs (Dynamo would trace them if it compiled now).
            self.detach_direct_call_hooks()
        if export_flag._is_exporting_flag:
            # Strict export runs this hook under Dynamo: nothing to do but return.
            return None if dynamo_compiling() else self._stand_aside()
        if self._aside_thread is not None:
            self._aside_thread = None  # a traced call that never returned (it raised past us)
        if dynamo_compiling():
            # Dynamo traces this hook: refused now, before it compiles a graph break here.
            self._refuse_traced_call()
            # Not refused (a compiled function calls the model): Dynamo stops here and runs
            # the hook as plain Python (this function's frames are never compiled).
            return self._root_pre_hook_untraced(module, args, kwargs)
        if self._closed or (self._suspended and _get_ident() in self._suspended_threads) \
                or _graph_task_id() >= 0:
            return None  # closed, a replay, or a recomputation during backward
        if self.entry is self.model and "torch._dynamo" in sys.modules:
            self._refuse_compiled_call()
        if captured():
            return self._stand_aside()
        first = args[0] if len(args) == 1 and not kwargs else None
        if not self._root_depth and (first.is_meta if type(first) is _Tensor  # model(x)
                                     else meta_only(args, kwargs)):
            return self._stand_aside()  # a data-less pass on meta tensors: no batch
        refusal = None
        ended = None
        try:
            with self._lock:
                if self._concluding_thread is not None:
                    self._wait_for_conclusion()
                if self._closed:
                    return None
                if not self._root_depth and not self._manual_batches and self._pass_stepped():
                    # A training pass made outside the forward, and its optimizer step, ended
                    # the batch: this forward starts the next one.
                    finished = self._batch
                    ended = (finished, self._resolve_locked(finished, advance=True))
                if self._root_depth:
                    owner = self._root_thread
                    if self._root_call_running(sys._getframe(1)):
                        if owner == _get_ident():
                            self._root_depth += 1  # the root calls itself: the same batch
                            if self._records_frames():
                                self._measure_inputs_now(module, args, kwargs)
                            return None
                        refusal = owner
                    else:
                        # The previous forward never returned (KeyboardInterrupt skips every
                        # hook): its frames stay in its own batch, marked as interrupted.
                        self._end_interrupted_locked()
                if refusal is None:
                    last_hook = self._last_forward_hooks.get(id(module))
                    if last_hook is not None \
                            and next(reversed(module._forward_hooks), last_hook) != last_hook:
                        self._keep_forward_hook_last(module, last_hook)
                    self._root_depth = 1
                    self._after_forward = self._outside_call_batch = None
                    self._direct_call = module is not self.entry
                    self._entered = module
                    self._root_frame = sys._getframe(1)
                    self._root_thread = _get_ident()
                    # An exception already being handled when the forward starts (a forward
                    # called from an ``except`` block) is not the forward failing.
                    self._exception_at_start = sys.exc_info()[1]
                    for on_batch_start in self._on_batch_start:
                        on_batch_start(self._batch, args, kwargs)
                    if not self.root_only or self._module_handles:  # _records_frames()
                        # A training forward measures its trainable weights once
                        # (core.entries); nothing is measured in a batch without frames.
                        self.entries.new_forward(self.model.training and torch.is_grad_enabled())
                        # The model's inputs as handed over, before any module writes into them.
                        self._measure_inputs_now(module, args, kwargs)
        except Exception as error:  # never break the user's forward
            self.internal_error(error)
        if ended is not None:
            self._conclude(ended[0], ended[1], reason="forward", raising=True, finished=True)
        if refusal is not None:
            raise ConcurrentForwardError(
                f"nanwidget: this model is watched and thread {refusal} is running its forward; "
                "a watch records one forward at a time (frames of two threads would mix in one "
                "batch). Run the forwards one after the other, or watch a separate model copy "
                "per thread")
        return None

    @run_eagerly_under_dynamo
    def _root_pre_hook_untraced(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """:meth:`_root_pre_hook`, where Dynamo traces it and need not refuse the call: Dynamo
        breaks its graph here and the hook runs again as plain Python (or this runs it)."""
        return self._root_pre_hook(module, args, kwargs)

    @staticmethod
    def _keep_forward_hook_last(module: nn.Module, hook_id: int) -> None:
        """Move the watch's forward hook on the root (``hook_id``) behind those the user added
        after the watch: model(x) returns what the last forward hook makes of the output (one
        returning torch.log(out) can make the NaN), so that is what the watch must check. The
        root pre-hook calls this at a batch start when the hook is not last already."""
        hooks = module._forward_hooks
        if hook_id in hooks:
            # Popped and inserted: last in the OrderedDict's order and in the plain dict's under
            # it, which Dynamo also reads (see core.opaque._insertion_order_as_run).
            hooks[hook_id] = hooks.pop(hook_id)

    def _stand_aside(self) -> None:
        """A tracer runs the model (see :func:`tracing`), or a data-less pass on meta tensors
        (:func:`meta_only`): no batch starts, nothing is recorded; features read
        :attr:`suspended` as True until the root call returns."""
        self._aside_thread = _get_ident()
        return None

    def _refuse_compiled_call(self) -> None:
        """A watch whose hooks sit inside a compiled call sees nothing of its submodules:
        compiled code skips their hooks (or Dynamo traces them, with graph breaks). Only a
        watch whose entry is the model itself (the caller checks)."""
        model = self.model
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        if getattr(model, "_compiled_call_impl", None) is not None \
                and not self._compiled_in_place and not _forced_eager(eval_frame):
            how = "was compiled in place with module.compile() after nw.watch()"
        elif _in_optimized_module(eval_frame):
            how = _INSIDE_A_WRAPPER
        else:
            return
        raise self._compiled_call_error(how)

    def _refuse_traced_call(self) -> None:
        """:meth:`_refuse_compiled_call`, called while Dynamo traces the root's pre-hook. Dynamo
        runs it, for real, rather than tracing it (``_dynamo_marked_constant``, set below), so
        that the refusal is raised while it traces, as :class:`_RefusedWhileDynamoTraces`."""
        if self._closed or self.entry is not self.model:
            return None
        try:
            self._refuse_compiled_call()
        except CompiledCallError as error:
            raise _RefusedWhileDynamoTraces(str(error)) from None

    # What torch._dynamo.assume_constant_result sets (torch sets it this way on its own
    # functions too), without importing Dynamo before anyone compiles.
    _refuse_traced_call._dynamo_marked_constant = True  # type: ignore[attr-defined]

    def _compiled_call_error(self, how: str) -> CompiledCallError:
        return CompiledCallError(
            f"nanwidget: the watched model ({type(self.model).__name__}) {how}. Compiled code "
            "skips the hooks of the modules inside it, so this watch would miss NaNs silently "
            "(and Dynamo tracing its hooks makes compiling slow). Close this watch (w.close()) "
            "and watch the compiled model itself, after compiling: w = nw.watch(compiled_model) "
            "(sentinel mode: no graph break, full detail by an eager replay)")

    def _refuse_wrapper_call(self, wrapper: nn.Module, args: tuple, kwargs: dict) -> None:
        """On a ``torch.compile`` wrapper of the watched model that compiled it before the
        watch (see :func:`~nanwidget.core.graph_capture.compile_wrappers_of`): its compiled
        code would run the model without any hook, so its calls are refused before it runs."""
        if self._closed or self._skip_this_thread() \
                or _forced_eager(sys.modules.get("torch._dynamo.eval_frame")):
            return None  # closed, a replay, or set_stance("force_eager"): the hooks run
        raise self._compiled_call_error(_INSIDE_A_WRAPPER)

    def _root_call_running(self, new_call: Any) -> bool:
        """Whether the outermost root call that opened the batch is still on its thread's
        stack (a recursion or another thread's running forward) rather than gone (interrupted)."""
        target, thread = self._root_frame, self._root_thread
        if target is None:
            return False
        if thread == _get_ident():
            frame = new_call.f_back if new_call is not None else sys._getframe(1)
        else:
            frame = sys._current_frames().get(thread)
        while frame is not None:
            if frame is target:
                return True
            frame = frame.f_back
        return False

    def _measure_inputs_now(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Measure a module's inputs before it runs (caller holds the lock); its forward hook
        uses these entries."""
        info = self._infos.get(id(module))
        if info is None:
            return
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            info.pre_entries.append([self.entries.tensor_entry("input[0]", args[0])])
            return
        entries: list[Entry] = []
        self.entries.input_entries(args, kwargs, entries)
        info.pre_entries.append(entries)

    @run_eagerly_under_dynamo
    def _inplace_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict = COPIED) -> None:
        if kwargs is COPIED:  # a copy torch.ao put on a module it swapped in
            return drop_copied_hooks(module)
        if export_flag._is_exporting_flag:
            return None
        if self._closed or self._skip_this_thread() or _graph_task_id() >= 0:
            return None
        if not self._root_depth and (self._aside_thread is not None or tracing()
                                     or self.called_by_another_model()):
            return None  # a tracer runs the model, or another model calls a module it shares
        try:
            with self._lock:
                self._measure_inputs_now(module, args, kwargs)
        except Exception as error:
            self.internal_error(error)
        return None

    def _buffers_pre_hook(self, info: ModuleInfo) -> Any:
        """The forward pre-hook of a module whose forward may rewrite its own buffers (see
        ``ModuleInfo.own_float_buffers``): measures them before it runs, for its forward
        hook's frame. Bound once per module, as :meth:`_module_forward_hook`."""
        lock, measure, weights = self._lock, self.entries.buffer_entries, info.weights
        pending = info.pre_buffers
        copied, flag = COPIED, export_flag

        def _pre_hook(module: nn.Module, args: tuple, kwargs: dict = copied) -> None:
            if kwargs is copied:  # a copy torch.ao put on a module it swapped in
                return drop_copied_hooks(module)
            if flag._is_exporting_flag or self._closed or self._skip_this_thread() \
                    or _graph_task_id() >= 0:
                return None
            if not self._root_depth and (self._aside_thread is not None or tracing()
                                         or self.called_by_another_model()):
                return None  # a tracer runs the model, or another model calls a shared module
            try:
                with lock:
                    pending.append(measure(weights))
            except Exception as error:
                self.internal_error(error)
            return None

        return run_eagerly_under_dynamo(_pre_hook)

    @run_eagerly_under_dynamo
    def _forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """The root's forward hook (on the entry, and on the model for direct calls of a
        compiled model's original): its frame when the batch records frames, then the batch's
        end. Other modules have :meth:`_module_forward_hook`'s."""
        if export_flag._is_exporting_flag:
            # torch.export traces the model (under Dynamo, in strict mode): when the root
            # returns from a non-strict export, the watch no longer stands aside.
            if self._aside_thread is not None and (module is self.entry or module is self.model) \
                    and not dynamo_compiling():
                self._aside_thread = None
            return None
        info = self._infos.get(id(module))
        if info is None or self._closed:
            return None
        thread = _get_ident()
        if self._suspended and thread in self._suspended_threads:
            return None
        if (self._root_thread != thread or not self._root_depth) \
                and self._skips_outside_own_forward(info, thread):
            return None
        # The exception propagating through this always_call hook, if any (read before the
        # frame's try below, whose handled errors are not the forward's).
        current_exception = sys.exc_info()[1]
        with self._lock:  # one hold for the root's frame and the batch's end
            frame = None
            if not self.root_only or self._module_handles:  # _records_frames()
                # The model's weights too (also for the compile wrapper's call).
                raised = output is None and raised_out_of(module, current_exception)
                frame = self._record_forward_locked(info, args, kwargs, output, raised=raised)
                if not raised:
                    frame = None
            ended = self._finish_root_locked(current_exception, output, frame)
            if ended is None:
                return None
            if ended[1] is not None and self._outside_pass_event(ended[0], ended[1]):
                ended = (ended[0], None, *ended[2:])
            # Marked under the hold that ended the batch: no other thread's forward starts
            # before the conclusion (which may replay the batch on these modules) is done.
            outer, self._concluding_thread = self._concluding_thread, thread
            if self._idle_waiters:
                self._idle.notify_all()  # a replay waiting for this forward to end
        finished, event, failing, advance = ended
        try:
            self._conclude(finished, event, reason="forward", raising=not failing,
                           finished=advance)
        finally:
            with self._lock:
                self._concluding_thread = outer
                if self._idle_waiters:
                    self._idle.notify_all()
        return None

    def _wait_for_conclusion(self) -> None:
        """Caller holds the lock, at a root forward's start: while another thread concludes
        the batch it ended, wait (the lock is let go meanwhile)."""
        me = _get_ident()
        self._idle_waiters += 1
        try:
            while self._concluding_thread is not None and self._concluding_thread != me \
                    and not self._closed:
                self._idle.wait(0.5)
        finally:
            self._idle_waiters -= 1

    def _wait_for_other_forward(self) -> None:
        """Caller holds the lock, before running the model on this thread: while another
        thread's root forward runs, wait for its end (the lock is let go meanwhile; once it
        is held again, no other forward can start). Re-checked every so often: a forward that
        never returns (interrupted) wakes nobody."""
        me = _get_ident()
        self._idle_waiters += 1
        try:
            while self._root_depth and self._root_thread != me and not self._closed \
                    and self._root_call_running(None):
                self._idle.wait(0.1)
        finally:
            self._idle_waiters -= 1

    def _module_forward_hook(self, info: ModuleInfo) -> Any:
        """The forward hook of ``info``'s module (not the root): what :meth:`_forward_hook`
        does for it, with what stays the same for the module bound once, since it runs on every
        module call."""
        lock = self._lock
        builder = self.entries
        forward_entries = builder.forward_entries
        weights, has_state, cache_weights = info.weights, info.has_state, not info.sharded
        pre_entries, pre_buffers = info.pre_entries, info.pre_buffers
        name, type_name, key = info.name, info.type_name, info.index
        flag = export_flag
        copied = COPIED

        def _forward_hook(module: nn.Module, args: tuple, kwargs: dict,
                          output: Any = COPIED) -> None:
            if output is copied:  # a copy torch.ao put on a module it swapped in
                return drop_copied_hooks(module)
            if flag._is_exporting_flag or self._closed:
                return None  # torch.export traces the model; or the watch closed
            thread = _get_ident()
            if self._suspended and thread in self._suspended_threads:
                return None
            if self._root_thread != thread or not self._root_depth:
                if self._skips_outside_own_forward(info, thread):
                    return None
                if not self._root_depth:  # model.forward_features(x): no root forward runs
                    return self._record_outside_root(info, args, kwargs, output)
            try:
                with lock:
                    entries, first_input, first_output = forward_entries(
                        weights, has_state, args, kwargs, output,
                        pre_entries.pop() if pre_entries else None, cache_weights,
                        pre_buffers.pop() if pre_buffers else None)
                    if output is None and raised_out_of(module, sys.exc_info()[1]):
                        del entries[first_output:]  # it raised: no output, not a None one
                    # record_frame(), inlined for the forward phase.
                    counters = self._counters
                    calls = counters.calls
                    call = calls.get(key, 0)
                    calls[key] = call + 1
                    self._frames.append(Frame(self._rank, counters.batch, counters.next_frame,
                                              name, type_name, call, "forward", entries,
                                              first_output, first_input))
                    counters.next_frame += 1
                    if builder.unread_roles and not self._warned_unread:
                        self._warn_unread()
            except Exception as error:
                self.internal_error(error)
            return None

        return run_eagerly_under_dynamo(_forward_hook)

    def _skips_outside_own_forward(self, info: ModuleInfo, thread: int) -> bool:
        """For a module's forward hook running outside this thread's own root forward: True
        when the call is not to be recorded (a recomputation during backward, a tracer running
        the model, a call refused before it ran); raises ConcurrentForwardError for a module
        run while another thread's root forward may be running."""
        if _graph_task_id() >= 0:
            return True  # a recomputation during backward (torch.utils.checkpoint)
        if self._aside_thread == thread or tracing():
            if info.is_root:
                self._aside_thread = None
            return True  # a tracer runs the model: the watch stands aside
        # A call refused with ConcurrentForwardError unwinds through always_call hooks,
        # recording nothing.
        if isinstance(sys.exc_info()[1], (ConcurrentForwardError, CompiledCallError)):
            return True  # nothing ran: nothing to record
        if self._root_depth:
            if not info.is_root and self.called_by_another_model():
                return True  # another model's call of a module it shares: not this forward's
            self._refuse_other_thread(info)
        return False

    def _record_outside_root(self, info: ModuleInfo, args: tuple, kwargs: dict,
                             output: Any) -> None:
        """A watched module ran while no root forward runs: the model is driven through
        another method (timm's ``model.forward_features(x)``, CLIP's
        ``get_image_features``). Such a pass has no root call to end it, so the outermost
        watched module running (found on the stack) stands for it: when its call returns,
        the frames so far are checked (events raise or warn as ``on_nan`` says), and when an
        outermost module that already returned in this batch runs again, a new pass began:
        the batch ends (unless batches are numbered with step()/set_batch()).

        A call made on what the last root forward returned, before the next batch starts (a
        loss the model holds: ``model.loss(model(x), y)``), is that forward's: its frames go
        to that batch (see :class:`_AfterForward`)."""
        outermost = self._outermost_running(info)
        if outermost is None:
            return None  # another model's call of a module it shares with this one
        ended = None
        event = None
        # A parametrized weight read outside the forward (a penalty on it in the loss, a log
        # of its norm) runs its parametrization: a read of the model's weight, not a pass of
        # the model. It belongs to the batch of the forward before it and ends none.
        weight_read = isinstance(outermost.module, ParametrizationList)
        with self._lock:
            if self._closed:
                return None
            on_output = not weight_read and self._made_on_output(outermost, info, args, kwargs)
            # Numbered with set_batch(): the batch it says; else that forward's.
            after = self._after_forward
            late = after.batch if not self._manual_batches and after is not None and (
                on_output or weight_read and after.steps == steps_taken()) else None
            self._outside_call_batch = late
            if late is None and not weight_read and not self._manual_batches and (
                    outermost.index in self._outside_returned or self._pass_stepped()):
                finished = self._batch
                ended = (finished, self._resolve_locked(finished, advance=True), True)
            frame = self._record_forward_locked(info, args, kwargs, output, raised=(
                output is None and raised_out_of(info.module, sys.exc_info()[1])), batch=late)
            if on_output and frame is not None:
                self._frames_on_output.append((frame.batch, frame.index))
            returned = outermost is info
            batch = self._batch if late is None else late
            if returned:
                if late is None and not weight_read:
                    self._outside_returned.add(info.index)
                    self._outside_steps = steps_taken()
                    if not self._outside_batches or self._outside_batches[-1] != batch:
                        self._outside_batches.append(batch)
                event = self._resolve_locked(None, advance=False)
                # One forward event per batch, as a root forward gives: the pass's first.
                if event is not None and any(e.batch == batch and not e.is_backward
                                             for e in self.records.events[-4:]):
                    event = None
        if ended is not None:
            self._conclude(ended[0], ended[1], reason="forward", raising=True,
                           finished=ended[2])
        if returned:
            self._conclude(batch, event, reason="flush", raising=True, finished=False)
        return None

    def _pass_stepped(self) -> bool:
        """Whether a pass outside the root forward returned in this batch and an optimizer
        step ran since (caller holds the lock): that pass was a training step (SB3's PPO and A2C
        train through ``policy.evaluate_actions``, SAC through ``actor.action_log_prob`` and
        ``critic(obs, act)``), so the next call, a root forward included, starts the next
        batch; a call before any step joins the pass's batch (``agent.critic(x)`` for the
        advantages, then the training forward)."""
        return bool(self._outside_returned) and steps_taken() != self._outside_steps

    def _outside_pass_event(self, batch: int, event: NanEvent) -> bool:
        """Whether the root forward that ended ``batch`` with forward ``event`` joined a pass
        outside it that already made a forward event in that batch (generate() runs the
        encoder or the vision tower once, before the forwards, and hands them its output):
        one forward event per batch, the pass's first, as for passes (caller holds the lock)."""
        return not event.is_backward and batch in self._outside_batches and any(
            e.batch == batch and not e.is_backward and e.rank == event.rank
            for e in self.records.events[-4:])

    def _made_on_output(self, outermost: ModuleInfo, info: ModuleInfo, args: tuple,
                        kwargs: dict) -> bool:
        """For a call outside a root forward (caller holds the lock): whether the outermost
        watched call running (``outermost``) was made on what the root forward that returned
        last gave back, before the next root forward started. The first call that was not
        made on it ends the time for such calls. Reads the stack and the inputs' autograd
        graph: outside root forwards only."""
        after = self._after_forward
        if after is None:
            return False
        if after.modules is not None and outermost.index in after.modules:
            return True
        try:
            given = (args, kwargs) if outermost is info else \
                _call_arguments(sys._getframe(1), outermost.module)
            outputs = after.live_outputs()
            on_output = given is not None and bool(outputs) and _flows_from(outputs, *given)
        except Exception as error:  # unreadable: counted as today's batch, as before
            self.internal_error(error)
            on_output = False
        if not on_output:
            self._after_forward = None
            return False
        if after.modules is None:
            after.modules = set()
        after.modules.add(outermost.index)
        return True

    def ran_on_output(self, batch: int, frame: int) -> bool:
        """Whether the forward frame ``frame`` of ``batch`` (lately) is a call made outside the
        root forward on what it returned: a loss the model holds, run on its output."""
        return (batch, frame) in self._frames_on_output

    @property
    def frames_batch(self) -> int:
        """The batch the frames of the module call running now are filed under: that of the
        root forward that returned last, for a call made on its output after it (a loss the
        model holds), else :attr:`batch`. For features that record frames of their own for
        that call (its backward frames)."""
        if not self._root_depth and self._outside_call_batch is not None \
                and self._after_forward is not None:
            return self._outside_call_batch
        return self._batch

    def _record_forward_locked(self, info: ModuleInfo, args: tuple, kwargs: dict,
                               output: Any, raised: bool = False,
                               batch: int | None = None) -> Frame | None:
        """The forward frame of one call of ``info``'s module (caller holds the lock), or None
        when it could not be made: a failure is an internal error, never the user's forward's.
        ``raised``: the call raised (it returned nothing: no output rows, rather than a None
        output). ``batch``: an earlier batch to file it under (see :meth:`record_frame`)."""
        try:
            measured = info.pre_entries.pop() if info.pre_entries else None
            entries, first_input, first_output = self.entries.forward_entries(
                info.weights, info.has_state, args, kwargs, output, measured,
                cache_weights=not info.sharded,
                measured_buffers=info.pre_buffers.pop() if info.pre_buffers else None)
            if raised:
                del entries[first_output:]
            frame = self.record_frame(info, "forward", entries, batch=batch,
                                      first_output=first_output, first_input=first_input)
            if self.entries.unread_roles and not self._warned_unread:
                self._warn_unread()
            return frame
        except Exception as error:
            self.internal_error(error)
            return None

    def _outermost_running(self, info: ModuleInfo) -> ModuleInfo | None:
        """The outermost watched module whose call is on this thread's stack (``info``'s own
        module when none around it runs), or None when the call belongs to another model (see
        :meth:`called_by_another_model`). Read from the frames of ``Module._call_impl``: only
        for calls outside a root forward, which are rare."""
        outermost = info
        caller_known = False
        try:
            for module in _running_modules(sys._getframe(2)):
                running = self._infos.get(id(module))
                if running is not None:
                    outermost = running
                elif not caller_known and id(module) not in self._initial_modules:
                    # The first module around the watched calls that is not one of ours.
                    if self._another_models_module(module):
                        return None
                    caller_known = True
        except Exception as error:  # a frame that cannot be read: this call stands for itself
            self.internal_error(error)
        return outermost

    def called_by_another_model(self) -> bool:
        """Whether the watched module call running on this thread was made by another model:
        the nearest module call around it that is not part of the watched model is a module
        that does not contain the watched model either. ultralytics' ``Conv`` layers share one
        ``nn.SiLU`` among every model of the process: another model's calls of it are none of
        this watch's business. A call made by user code (``model.encoder(x)``) or by a module
        that holds the watched model belongs to it. Reads the stack: only for calls outside a
        root forward on this thread (inside one, every call belongs to the batch)."""
        try:
            for module in _running_modules(sys._getframe(1)):
                if id(module) not in self._infos and id(module) not in self._initial_modules:
                    return self._another_models_module(module)
        except Exception as error:  # a frame that cannot be read: the call is ours, as before
            self.internal_error(error)
        return False

    def _another_models_module(self, module: nn.Module) -> bool:
        """Whether ``module``, not one the watch hooked or saw at its start, is outside the
        watched model (not added to it since) and does not hold it (a wrapper calling the
        watched model's parts is driving it), nor is a ``torch.compile`` wrapper of one of its
        modules (``torch.compile(model.encoder)``: that module's calls, compiled). Remembered
        per module: each walk is a tree's."""
        known = self._callers_outside.get(id(module))
        if known is not None and known[0]() is module:
            return known[1]
        root = self.model
        compiled = compiled_module_of(module)
        elsewhere = not any(part is module for part in root.modules()) \
            and not any(part is root for part in module.modules()) \
            and (compiled is None or id(compiled) not in self._initial_modules)
        if len(self._callers_outside) >= 1024:
            self._callers_outside.clear()
        self._callers_outside[id(module)] = (weakref.ref(module), elsewhere)
        return elsewhere

    def _refuse_other_thread(self, info: ModuleInfo) -> None:
        """A module ran in this thread while another thread's root forward may be running."""
        with self._lock:
            owner = self._root_thread
            if not self._root_depth or owner == _get_ident() or not self._root_call_running(None):
                return
        # Refused at its forward hook: a pre-hook on every module to refuse it before it runs
        # would cost every module call of every batch.
        raise ConcurrentForwardError(
            f"nanwidget: module '{info.label}' was called in thread {_get_ident()} while thread "
            f"{owner} runs the watched model's forward; a watch records one forward at a time. "
            "The call had already run when it was refused (a watch sees a submodule's call when "
            "it returns): what it changes has changed (a train-mode BatchNorm's running "
            "statistics), and its output is dropped. Call it after that forward returns "
            "(knowing that a second call changes them again), or watch a separate model copy "
            "per thread")

    def _warn_unread(self) -> None:
        self.warn_unread(self.entries.unread_roles)

    def warn_unread(self, unread: list[str]) -> None:
        """Say once per watch which values (role and why) could not be read."""
        if self._warned_unread:
            return
        self._warned_unread = True
        roles = ", ".join(unread[:5])
        warnings.warn(f"nanwidget: some values were not read and are not checked for NaN/Inf: "
                      f"{roles}. Their frames note them as 'not read'; return tensors (or lists "
                      "of them) instead of iterators to have them checked", RuntimeWarning,
                      stacklevel=user_stacklevel())

    def ran_outside_root(self, batch: int) -> bool:
        """Whether watched modules ran ``batch`` (lately) while the root's forward did not: the
        model driven through another method (peft's ``generate()``, timm's
        ``forward_features()``)."""
        return batch in self._outside_batches

    def forward_calls(self, info: ModuleInfo) -> int | None:
        """Forward frames of ``info``'s module recorded so far in the root forward running
        now; None when none runs (a recomputation during backward records no frames)."""
        if not self._root_depth:
            return None
        return self._counters.calls.get(info.index, 0)

    def is_buffer(self, module: str, role: str) -> bool:
        """Whether the named module keeps a buffer (not a parameter) called ``role``."""
        info = self._by_name.get(module)
        if info is None:
            return False
        try:
            return role in info.weights._buffers and role not in info.weights._parameters
        except Exception:  # a container that cannot tell
            return False

    def substituted(self, module: str, role: str) -> bool:
        """Whether the named module's parameter slot ``role`` holds, right now, a tensor that is
        no ``nn.Parameter``: a stand-in a stateless call put there for its forward
        (``torch.func.functional_call``, a meta-learning fast weight)."""
        info = self._by_name.get(module)
        if info is None:
            return False
        try:
            tensor = info.weights._parameters.get(role)
        except Exception:  # a container that cannot tell
            return False
        # An ExpandedWeight (per-sample gradients) is the module's own parameter, not another.
        return isinstance(tensor, torch.Tensor) and not isinstance(stood_for(tensor), nn.Parameter)

    def weight(self, module: str, role: str) -> torch.Tensor | None:
        """The named module's own parameter or buffer ``role`` (event time only), or None. A
        per-sample-gradient stand-in in the slot (torch's ``ExpandedWeight``, during its forward)
        is read as the parameter it holds. Inside a module FSDP2 manages, the parameter is the
        DTensor it keeps between forwards (the one the optimizer steps, and loads and in-place
        writes between steps write), also while the slot holds the gathered tensor that the
        forward reads (an event met during a forward)."""
        info = self._by_name.get(module)
        if info is None:
            return None
        try:
            tensor = info.weights._parameters.get(role)
            if tensor is None:
                tensor = info.weights._buffers.get(role)
        except Exception:  # a container that cannot tell
            return None
        if info.sharded_parameters and isinstance(tensor, torch.Tensor) \
                and not is_distributed_tensor(tensor):
            tensor = info.sharded_parameters.get(role, tensor)
        return stood_for(tensor) if isinstance(tensor, torch.Tensor) else None

    def weight_owner(self, qualified: str) -> tuple[str, str]:
        """The watched module that keeps the weight called ``qualified`` and the weight's name
        there: split at the last dot, unless a module nearer the root keeps the weight under a
        dotted name of its own (tensordict's ``TensorDictParams``, in every torchrl loss, puts
        ``"module.0.weight"`` straight into its ``_parameters``). Event time only."""
        module, _, role = qualified.rpartition(".")
        candidate, rest = module, role
        while True:
            info = self._by_name.get(candidate)
            if info is not None:
                try:
                    if rest in info.weights._parameters or rest in info.weights._buffers:
                        return candidate, rest
                except Exception:  # a container that cannot tell
                    pass
            if not candidate:
                return module, role
            candidate, _, inner = candidate.rpartition(".")
            rest = f"{inner}.{rest}"

    def parameter_owner(self, qualified: str) -> tuple[ModuleInfo | None, str]:
        """The module to name for the parameter called ``qualified`` (as in
        ``named_parameters()``), and the parameter's name from there: its own module, or for
        a container that is never called (a ``ParameterDict`` the forward reads, where Keras
        keeps every weight) the nearest watched module around it, which made the call. (None,
        ``qualified``'s last part) for a module not watched."""
        module, _, role = qualified.rpartition(".")
        info = self._by_name.get(module)
        while info is not None and not info.is_root and info.has_no_forward:
            outer_name, _, inner = module.rpartition(".")
            outer = self._by_name.get(outer_name)
            if outer is None:
                break
            module, role, info = outer_name, f"{inner}.{role}", outer
        return info, role

    def weights_now(self, name: str) -> list[Entry] | None:
        """The named module's own weights measured right now (event time only), a quantized
        module's packed ones included (:func:`~.opaque.packed_weights`); None for a module not
        watched or without any."""
        info = self._by_name.get(name)
        if info is None:
            return None
        # A torch.ao quantized module's packed weights: no frame holds them, so only here.
        packed = packed_weights(info.module)
        if not info.has_state and not packed:
            return None
        with self._lock:
            entries = self.entries.measure_weights_now(info.weights) if info.has_state else []
            return entries + self.entries.measure_now(packed, PACKED) if packed else entries

    # ------------------------------------------------------------------ recording (features)
    def record_frame(self, info: ModuleInfo, phase: str, entries: list[Entry],
                     batch: int | None = None, first_output: int | None = None,
                     first_input: int = 0, call: int | None = None) -> Frame:
        """Append a frame for ``info``'s module; caller holds :attr:`lock`.

        ``batch`` files it under an earlier batch (backward frames that arrive after the root
        forward already counted the next one): its frame and call numbers continue after that
        batch's own (kept for the last few batches). ``first_input`` and ``first_output``:
        positions of the first input and the first output entry (forward frames: weights come
        first, then inputs, then outputs). ``call``: the frame's call number, where the caller
        knows it (a backward frame: the forward call it belongs to); else counted here.
        """
        counters = self._counters
        if batch is not None and batch != counters.batch:
            counters = self._recent.get(batch)
            if counters is None:
                counters = self._remember_counters(_Counters(batch))
        key = info.index if phase == "forward" else ~info.index
        calls = counters.calls
        counted = calls.get(key, 0)
        calls[key] = counted + 1
        if call is None:
            call = counted
        frame = Frame(self._rank, counters.batch, counters.next_frame, info.name, info.type_name,
                      call, phase, entries, first_output, first_input)
        counters.next_frame += 1
        self._frames.append(frame)
        return frame

    def _remember_counters(self, counters: _Counters) -> _Counters:
        recent = self._recent
        recent.pop(counters.batch, None)
        recent[counters.batch] = counters
        while len(recent) > _RECENT_COUNTERS:
            del recent[next(iter(recent))]
        return counters

    @property
    def root_forward_running(self) -> bool:
        """Whether the root's forward is running now, so that a backward pass running now is
        the forward's own (``torch.autograd.grad`` in a PINN's forward), not the batch's. Asked
        from any thread: on a GPU autograd runs the pass on a thread of its own while the
        forward's waits. A forward that a KeyboardInterrupt left unfinished is not running (no
        longer on its thread's stack)."""
        return bool(self._root_depth) and self._root_call_running(None)

    @property
    def has_unresolved(self) -> bool:
        """Whether frames or stats are waiting for the next resolve."""
        return bool(self._frames) or len(self._pending) > 0

    # ------------------------------------------------------------------ batch boundaries
    def _finish_root_locked(self, current_exception: BaseException | None,
                            output: Any = None, raised_frame: Frame | None = None
                            ) -> tuple[int, NanEvent | None, bool, bool] | None:
        """A root call returned ``output``: the outermost one ends the batch. The call count,
        the features' look at the output, the resolve and the batch number move under the
        caller's hold of the lock, so that another thread's forward cannot start in between and
        land in this batch. Returns what the caller concludes outside the lock (the batch, its
        event, whether the forward is failing, whether the batch number moved on), or None
        when no batch ended. ``raised_frame``: the root's frame of a call that raised (no
        outputs): a NaN/Inf among its inputs is the batch's event when nothing else is."""
        if self._root_depth > 1:
            self._root_depth -= 1
            return None
        self._root_depth = 0
        self._root_frame = None
        start_exception, self._exception_at_start = self._exception_at_start, None
        if self._closed:
            return None
        # always_call hooks also run while an exception propagates: record, never raise then.
        failing = current_exception is not None and current_exception is not start_exception
        if not failing:
            for on_batch_output in self._on_batch_output:
                try:
                    on_batch_output(self._batch, output)
                except Exception as error:
                    self.internal_error(error)
        else:
            for on_batch_raised in self._on_batch_raised:
                try:
                    on_batch_raised(self._batch, current_exception)
                except Exception as error:
                    self.internal_error(error)

        finished = self._batch
        advance = not self._manual_batches
        # Calls on the output after the forward (a loss the model holds) file their frames
        # under this batch (unless numbered with set_batch()); only where submodules record
        # frames.
        self._after_forward = _AfterForward(finished, _weak_output_tensors(output)) \
            if not failing and self._module_handles else None
        return finished, self._resolve_locked(finished, advance=advance,
                                              raised=raised_frame if failing else None), \
            failing, advance

    def _end_interrupted_locked(self) -> None:
        """Resolve the frames of a forward that never returned, in their own batch."""
        batch = self._batch
        self.interrupted_batches.append(batch)
        del self.interrupted_batches[:-1000]
        self._root_depth = 0
        self._root_frame = None
        self._exception_at_start = None
        for info in self.modules:
            info.pre_entries.clear()
            info.pre_buffers.clear()
        event = self._resolve_locked(batch, advance=not self._manual_batches)
        if event is not None:
            self._record_event_locked(event)

    def _resolve_locked(self, ended: int | None, advance: bool,
                        raised: Frame | None = None) -> NanEvent | None:
        """Resolve pending stats and hand the frames on; the first NaN/Inf event or None.
        Caller holds the lock; the event is not recorded yet (see :meth:`_conclude`).
        ``raised``: the frame of a root call that raised (see :meth:`Records.take`)."""
        for before_resolve in self._before_resolve:
            before_resolve()
        frames, self._frames = self._frames, []
        if frames or len(self._pending):
            self._pending.resolve()
            self.entries.end_batch()  # the objects it walked went into these frames
        self._rank = current_rank()
        event = self.records.take(frames, raised=raised) if frames else None
        if ended is not None:
            if self._outside_returned:
                self._outside_returned = set()
            for on_batch_end in self._on_batch_end:
                on_batch_end(ended, frames)
        else:
            for on_frames_resolved in self._on_frames_resolved:
                on_frames_resolved(frames)
        if advance:
            counters = self._counters
            self._batch += 1
            if counters.next_frame or counters.calls:
                self._remember_counters(counters)
                self._counters = _Counters(self._batch)
            else:  # nothing recorded in it (sentinel mode): the same counters go on
                if self._recent:
                    self._recent.pop(counters.batch, None)
                counters.batch = self._batch
        return event

    def find_event(self, frames: list[Frame], window: Window | None = None) -> NanEvent | None:
        """The verdict on resolved frames made elsewhere (a replay's): their first event, not
        recorded, by the same rules as the live frames'. Its report shows ``window(frames,
        position)`` (by default up to ``max_frames`` of ``frames`` ending with its own)."""
        limit = self.max_frames
        return first_event(frames, self._detector, window or (
            lambda batch_frames, position: batch_frames[max(0, position + 1 - limit): position + 1]))

    def _take_replayed(self, groups: list[list[Frame]]) -> None:
        """Frames replays made, one group per batch, oldest first: history, trace batches and
        the ring take them as if recorded live; features see them (``on_frames_replayed``)."""
        with self._lock:
            if self._closed:
                return
            for frames in groups:
                self.records.take(frames, verdict=False)
                for on_frames_replayed in self._on_frames_replayed:
                    on_frames_replayed(list(frames))

    def conclude(self, batch: int, finding: Finding | None, *, reason: str,
                 raising: bool) -> None:
        """Outside the lock: what a feature found on its own (e.g. at the end of a backward
        pass; None: nothing): take its frames, let the features review its event, record it,
        and raise or warn as ``on_nan`` says (only when ``raising``). ``reason`` as in
        :meth:`Feature.review_event`."""
        self._conclude(batch, None, reason=reason, raising=raising, finished=False,
                       found=finding)

    def _conclude(self, batch: int, event: NanEvent | None, *, reason: str, raising: bool,
                  finished: bool, found: Finding | None = None) -> None:
        """Outside the lock: features that check on their own report what they found (their
        frames are taken), features review the event, it is recorded, then raise/warn/go on."""
        findings = None if found is None else [found]  # none on a clean batch: no list
        for find_event in self._find_event:
            try:
                finding = find_event(batch, event, reason)
            except (NanDetected, AbortAfterBatch):
                raise
            except Exception as error:
                self.internal_error(error)
                continue
            if finding is not None:
                findings = [finding] if findings is None else findings + [finding]
        if findings is not None:
            for finding in findings:
                if finding.frames:
                    self._take_replayed(finding.frames)
                if event is None:
                    event = finding.event
        # Without an event, the reviews before the first that runs without one are skipped
        # (the loop below would skip them): on a clean batch only those that always run; at
        # close, none (no batch ended).
        for review_event, without_event in (
                self._review_event if event is not None
                else () if reason == "close" else self._review_without_event):
            if event is None and not without_event:
                continue
            try:
                event = review_event(batch, event, reason)
            except (NanDetected, AbortAfterBatch):
                raise
            except Exception as error:
                self.internal_error(error)
        if event is not None:
            with self._lock:
                self._record_event_locked(event)
            if self.on_nan == "raise" and raising:
                raise NanDetected(event)
            if self.on_nan in ("raise", "warn"):
                text = self._warning_text(event)
                if text:
                    warnings.warn(text, NanWarning, stacklevel=user_stacklevel())
        # abort_after: at the end of the batch numbered abort_after or later, and at the end of
        # any root forward past it (a batch numbered with set_batch() beyond it, as transformers
        # does it).
        limit = self.abort_after
        if raising and limit is not None and not self._aborted and (
                (finished and batch >= limit) or (reason == "forward" and batch > limit)):
            self._aborted = True
            raise AbortAfterBatch(batch, limit)

    def size_words(self) -> str:
        """The watched model's class and parameter count in words ("LlamaForCausalLM of 13.4K
        parameters"), counted once."""
        if not self._size_words:
            model = self.modules[0].module
            count = sum(p.numel() for p in model.parameters())
            size = next((f"{count / scale:.3g}{unit}" for unit, scale in
                         (("B", 1e9), ("M", 1e6), ("K", 1e3)) if count >= scale), str(count))
            self._size_words = f"{type(model).__name__} of {size} parameters"
        return self._size_words

    def _model_label(self) -> str:
        """The watched model as an event names it while other watches are live (their models'
        module names may be the same: a model and its assistant, a policy and its reference
        model): its class and size, and which of nw.live_watches() when those are the same
        too. "" while this is the only live watch."""
        live = watching_recorders()
        if not any(other is not self for other in live):
            return ""
        own = self.size_words()
        if any(other is not self and other.size_words() == own for other in live):
            watches = [r for r in live if r.owner is not None]  # as live_watches() lists them
            index = next((i for i, r in enumerate(watches) if r is self), None)
            if index is not None:
                own += f", nw.live_watches()[{index}]"
        return own

    def _warning_text(self, event: NanEvent) -> str:
        """The warning of an event; "" for one that repeats the last warned event of its pass
        (forward or backward) in the same place in the next batch, after that repeat was said
        once. A weight left non-finite makes an event at every batch, and a warning each would
        bury the first one (the events stay in ``events``)."""
        place = (event.module, event.role, event.origin, event.rank)
        last = self._warned.get(event.is_backward)
        repeat = last is not None and last[0] == place and 0 <= event.batch - last[1] <= 1
        self._warned[event.is_backward] = (place, event.batch, repeat)
        if not repeat:
            return f"nanwidget: {event.summary()}"
        if last[2]:
            return ""  # said already: quiet until another place
        return (f"nanwidget: {event.summary()}; the same place as in batch {last[1]}: later "
                "events there, batch after batch, are recorded without a warning")

    def _record_event_locked(self, event: NanEvent) -> None:
        if not self.records.add_event(event):
            return
        if not event.model and any(event is kept for kept in self.records.events):
            event.model = self._model_label()
        for on_event in self._on_event:
            try:
                on_event(event)
            except Exception as error:
                self.internal_error(error)

    def end_frames(self, batch: int, *, reason: str, raising: bool) -> None:
        """Resolve the frames recorded since the last resolve (e.g. a backward pass's), let the
        features review the outcome, record its first event and raise or warn as ``on_nan``
        says (only when ``raising``).

        Features review the outcome also when nothing was recorded, so that a boundary every
        rank reaches (the end of a backward pass) is reviewed on every rank.
        """
        with self._lock:
            if self._closed:
                return
            event = self._resolve_locked(None, advance=False) if self.has_unresolved else None
        self._conclude(batch, event, reason=reason, raising=raising, finished=False)

    def set_batch(self, batch: int) -> None:
        """End the current batch (its frames are checked) and continue as ``batch``.

        From the first call on, the root forward no longer counts batches.
        """
        with self._lock:
            self._manual_batches = True
            finished = self._batch
            # A batch whose passes outside the root forward were checked already still ends
            # here (its features see the batch end).
            event = self._resolve_locked(finished, advance=False) \
                if self.has_unresolved or self._outside_returned else None
            if batch != finished:
                self._remember_counters(self._counters)
                self._batch = batch
                self._counters = self._recent.pop(batch, None) or _Counters(batch)
        self._conclude(finished, event, reason="set_batch", raising=True,
                       finished=finished != batch)

    def step(self) -> None:
        """End the current batch and continue with the next number (manual counting from now
        on). Right after a root forward counted the batch automatically, the batch that ends is
        that forward's: the numbering goes on without a gap (forward 0, ``step()``, forward 1)."""
        with self._lock:
            if not self._manual_batches and self._batch > 0 and self._counters.next_frame == 0 \
                    and not self._root_depth:
                self._manual_batches = True  # the forward already ended its batch
                return
            target = self._batch + 1
        self.set_batch(target)

    def flush(self) -> None:
        """Resolve frames recorded since the last boundary; events are recorded, never raised."""
        with self._lock:
            if self._closed or not self.has_unresolved:
                return
            event = self._resolve_locked(None, advance=False)
        self._conclude(self._batch, event, reason="flush", raising=False, finished=False)

    # ------------------------------------------------------------------ reading
    def held_frames(self) -> list[Frame]:
        """The frames in the ring buffer (the last ``max_frames``), oldest first."""
        with self._lock:
            return list(self.records.ring)

    def frames_table(self, batch: int | None = None) -> pd.DataFrame:
        """Frames in the ring buffer, or every frame of trace batch ``batch``."""
        self.flush()
        with self._lock:
            return self.records.frames_table(batch)

    @property
    def recorded_trace_batches(self) -> list[int]:
        """Trace batches with frames recorded so far."""
        with self._lock:
            return sorted(self.records.trace_frames)

    def add_history_row(self, batch: int, module: str, abs_max: float,
                        abs_min: float = float("nan")) -> None:
        """The finite outputs of ``module`` in ``batch`` reached ``abs_max`` (and ``abs_min``,
        NaN when not measured), measured outside the module hooks (sentinel mode reads the
        root's outputs every batch): folded into that batch's row of :meth:`history_table`."""
        with self._lock:
            if self._closed:
                return
            records = self.records
            records.history.record(batch, records.name_index[module], abs_max, abs_min, False)
            for on_output_magnitude in self._on_output_magnitude:
                on_output_magnitude(batch, module, abs_max, abs_min)

    def history_table(self) -> pd.DataFrame:
        """One row per (batch, module): abs_max, abs_min and nonfinite of its outputs."""
        self.flush()
        with self._lock:
            return self.records.history.to_dataframe()

    # ------------------------------------------------------------------ lifecycle
    @contextlib.contextmanager
    def suspend(self) -> Iterator[None]:
        """While inside, this thread's hooks record nothing and the lock is held, so other
        threads' forwards wait: batch count, ring, history and events stay put. It begins
        once no other thread's forward runs (the model run inside must not meet it)."""
        with self._lock:
            if self._root_depth and self._root_thread != _get_ident():
                self._wait_for_other_forward()
            me = _get_ident()
            self._quiet(me, +1, own=True)
            try:
                yield
            finally:
                self._quiet(me, -1, own=True)

    @contextlib.contextmanager
    def quiet_on_this_thread(self) -> Iterator[None]:
        """While inside, this thread's hooks record nothing: no batch counted, no frame, no
        history row, no event, no early warning (another watch replays a batch here, and its
        replay may run this watch's model: a GAN's discriminator in the generator's loss).
        Other threads record as usual; the lock is not taken, so one watch's replay never
        waits for another watch."""
        me = _get_ident()
        self._quiet(me, +1)
        try:
            yield
        finally:
            self._quiet(me, -1)

    def _quiet(self, thread: int, step: int, own: bool = False) -> None:
        """Count one suspension of ``thread`` in (``step`` 1) or out (-1); ``own``: a
        :meth:`suspend` block's. The hooks read the count, then the threads, without a lock:
        a thread is listed before it counts and stays listed until it no longer does."""
        with self._suspensions_lock:
            if own:
                self._own_suspensions += step
            threads = self._suspended_threads
            if step > 0:
                threads[thread] = threads.get(thread, 0) + 1
                self._suspended += 1
                return
            self._suspended -= 1
            depth = threads.get(thread, 1) - 1
            if depth:
                threads[thread] = depth
            else:
                threads.pop(thread, None)

    def close(self) -> None:
        """Remove exactly the hooks this recorder added, close the features; idempotent.
        Features that check on their own (the sentinel) look once more first (reason
        "close"): what they find is recorded, and warned about, never raised."""
        if self._find_event and not self._closed:
            try:
                self._conclude(self._batch, None, reason="close", raising=False,
                               finished=False)
            except Exception as error:  # closing must always succeed
                self.internal_error(error)
        with self._lock:
            if self._closed:
                return
            event = None
            try:
                if self.has_unresolved:
                    event = self._resolve_locked(None, advance=False)
                    if event is not None:
                        self._record_event_locked(event)
            except Exception as error:  # closing must always succeed
                self.internal_error(error)
            self._closed = True
            self._step_tracking.release()
            for handle in self._handles + self._module_handles + self._direct_handles:
                handle.remove()
            try:
                for module in self.model.modules():  # copies torch.ao made of the hooks
                    drop_copied_hooks(module)
            except Exception as error:  # closing must always succeed
                self.internal_error(error)
            for fused in self._fused_layers + [self._fused_root]:
                if fused is not None:
                    release_fused_path(*fused)
            self._fused_layers.clear()
            self._fused_root = None
            for module, marked in self._marked_forwards:
                unmark_forward(module, marked)
            for module, forward in self._outside_forwards:
                if module.__dict__.get("forward") is forward:  # else someone wrapped it since:
                    if forward.previous is None:               # it passes calls through now
                        del module.__dict__["forward"]
                    else:
                        module.__dict__["forward"] = forward.previous
            self._outside_forwards.clear()
            self._marked_forwards.clear()
            self._handles.clear()
            self._module_handles.clear()
            self._direct_handles.clear()
            for module in [info.module for info in self.modules] + [self.entry]:
                reference = _WATCHED.get(module)
                if reference is not None and reference() is self:
                    del _WATCHED[module]
                    stop_copying_without_watch(module)
            for reference in self._wrappers:
                wrapper = reference()
                if wrapper is not None:
                    stop_copying_without_watch(wrapper)
            features = list(reversed(self._features))
        for feature in features:
            try:
                feature.close()
            except Exception as error:
                self.internal_error(error)

    def internal_error(self, error: BaseException) -> None:
        """A failure inside nanwidget: warn once and carry on (the user's run never breaks).
        NanDetected and AbortAfterBatch are not failures: they propagate."""
        if isinstance(error, (NanDetected, AbortAfterBatch, ConcurrentForwardError,
                              CompiledCallError)):
            raise error
        if not self._warned_internal:
            self._warned_internal = True
            warnings.warn(f"nanwidget: internal error while recording ({type(error).__name__}: "
                          f"{error}); your forward pass continues, some frames may be missing",
                          RuntimeWarning, stacklevel=user_stacklevel())

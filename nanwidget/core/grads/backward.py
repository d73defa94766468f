"""Backward frames (``watch(model, backward=True)``): one frame per module call per backward pass.

How they are recorded
    Gradient hooks on tensors (``Tensor.register_hook``), registered when a module's forward
    returns with grad enabled: on each output tensor that requires grad and on each tensor input
    that requires grad. No module backward hooks: PyTorch's full backward hooks wrap a module's
    inputs and outputs in views of a custom autograd Function and refuse any later in-place
    write to them (``ReLU(inplace=True)``, ``out += residual``), which forced a calibration
    forward before. Tensor hooks wrap nothing, so every module is recorded from the first batch
    on, in-place writes included.

Roles (phase ``"backward"``)
    ``grad_output[i]``: the gradient of the module's i-th output tensor, summed over every use
    of it. The hook is registered before any later in-place write, and PyTorch then hands it the
    gradient of the value *before* that write: the value the module returned. Outputs that are
    structures are named like the forward roles (``grad_output[1][0]``, ``grad_output.logits``).
    ``grad_input[i]``: the gradient of the module's i-th positional input (keyword inputs:
    ``grad_kwarg:name``), as the module received it (for ``inplace=True`` modules the hook goes
    on before the write). It is the input tensor's *total* gradient, summed over every module
    and op that used that tensor, not only this module's share (measuring the share alone needs
    the input wrapping that forbids in-place writes). A gradient that never arrives (an output
    the loss does not use) shows the note "None".
    ``weight``, ``bias`` (any own parameter by its name): the parameter's gradient, as the
    optimizer will see it (``.grad`` once autograd has accumulated this pass's contribution),
    measured by a hook on the parameter (``register_post_accumulate_grad_hook``). It goes into
    the frame of the module that owns the parameter, the last one opened in the pass (a shared
    parameter is owned by its first module in ``named_modules()`` order). A parameter used
    without calling its module (``MultiheadAttention``'s ``out_proj.weight``, the
    ``ParameterDict`` Keras keeps every weight in) goes into the frame of the nearest enclosing
    module that ran, by its name from there (``out_proj.weight``, as a forward frame names it);
    a module never called is no module call. Only with no such frame does it open one of its
    own. A weight gradient can overflow while every ``grad_input`` stays finite (it sums
    over the batch): without this, the NaN showed only after the optimizer step, as a
    corrupted weight one batch later. Frozen parameters have no gradient and no entry (one
    unfrozen while the watch is open has its entries from then on);
    parameters FSDP2 shards (DTensors) have none either: FSDP2 hands their hooks the gradient
    reduced over the ranks, where another rank's NaN would look like this rank's own. Nor do a
    lazy module's parameters uninitialized when the watch starts (they refuse hooks).

Order, batch, blame
    A frame takes its place in the batch when its first gradient arrives (normally its
    ``grad_output``: the module's backward starts), so frames follow backward execution order;
    gradients arriving later (its ``grad_input``) fill the same frame before the pass resolves.
    Each frame belongs to the batch of the forward that built the graph (read when the hooks are
    registered), and its ``frame`` number continues after that batch's forward frames. Its
    ``call`` is the forward call whose gradients it holds (a cell run four times in a loop gets
    its backward frames in the order call 3, 2, 1, 0); a module recomputed by reentrant
    checkpointing has no forward frame there, so its backward frames are numbered as they
    come. The event of a backward pass is its first frame holding a non-finite gradient, refined by
    :func:`~nanwidget.core.detect.event_at`: a NaN born inside a module's backward shows as
    finite ``grad_output`` with non-finite ``grad_input`` there, and among nested modules that
    share the input the innermost is named. Two sibling modules that take the same tensor both
    see its total gradient: when one of them received a non-finite ``grad_output``, the value came
    in there and that one is named; else they cannot be told apart, and the one whose backward
    ran first is named.

A forward's own backward pass
    A backward pass run inside the root's forward (``torch.autograd.grad(u, x,
    create_graph=True)`` in a PINN) is part of that forward, not the batch's backward pass: its
    gradients open no frames and end no pass (an event there was a backward event, with
    nothing to replay). What it computes becomes the forward's values, where a NaN it makes is
    found by the forward frames and its op by the replay. Told by
    :attr:`FrameSink.root_forward_running`, asked only while no pass is open: at the first
    gradient of the batch's own pass, not again in it.

Several passes in one batch
    A PINN's loss is made from derivatives taken after the forward (``torch.autograd.grad(u,
    x, create_graph=True)``, maybe twice), then ``loss.backward()``; a gradient penalty does
    the same: one batch, several backward passes, each resolved on its own. The hooks on the
    tensors modules made live with the graph; those on leaf tensors (the batch's input that
    requires grad) would live forever, so they are removed at the next root forward after a
    pass ended (every pass of the batch sees them), at close, or at once when a pass failed.
    Every hook holds this feature weakly, and a leaf's hook holds its subscribers by key: a
    closed watch is freed while the points and their graph are kept.

Recomputation (``torch.utils.checkpoint``)
    The recorder records no forward frames while autograd recomputes checkpointed modules. With
    reentrant checkpointing, the forward inside the checkpoint ran without grad, so the hooks go
    on the recomputed tensors (the ones its backward uses), and their frames belong to the batch
    of the backward pass that recomputed them. Each module call still has one backward frame.

Resolution
    Once per backward pass: an autograd final callback, queued by the pass's first gradient and
    queued again when it runs so that it comes after the other final callbacks (DDP's and
    FSDP2's gradient reductions finish first). It resolves the pass's frames (one host copy per
    device; CPU gradients are read by the native kernel as they arrive) and lets the features
    review the outcome: the DDP consensus exchanges its flag there, so every rank stops before
    the optimizer step. With ``on_nan="raise"``, :class:`NanDetected` propagates out of
    ``loss.backward()``. Gradients are measured without being held, so memory is freed as usual,
    except the gradients the root's outputs received: without a loss function they are held
    until the pass is resolved (:meth:`BackwardFrames.output_grads`, up to
    :data:`MAX_HELD_OUTPUT_GRAD_BYTES` per pass), so that a backward event can be replayed from
    them (the diagnosis names the op that made the NaN in the backward).
"""

from __future__ import annotations

import threading
import weakref
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from ..copies import COPIED, drop_copied_hooks
from ..entries import Entry, nested_shape
from ..frames import Frame
from ..graph_capture import export_flag, run_eagerly_under_dynamo, tracing
from ..opaque import add_forward_hook, add_forward_pre_hook
from ..recorder import Feature, ModuleInfo, in_backward_pass
from ..stats import is_distributed_tensor
from ..walk import iter_leaves

__all__ = ["FrameSink", "BackwardFrames"]

_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_NO_GRADIENT = "None"  # the note of a gradient that never arrived (the contract's "None")
_MAX_LEAF_HOOKS = 4096  # hooks on leaf tensors waiting for a backward pass, at most
# The root outputs' gradients held for a replay, per pass, at most (a language model's logits'
# gradient can be gigabytes; past this the pass holds none and a replay needs the loss).
MAX_HELD_OUTPUT_GRAD_BYTES = 1 << 30


_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _recomputing_without_a_graph() -> bool:
    """Whether this recomputation is non-reentrant checkpointing's: it only refills saved
    tensors, its graph is thrown away, and the hooks of the original forward fire instead.
    (Told by the saved-tensor hooks it runs under; reentrant checkpointing runs under none.)"""
    if _top_saved_tensors_hooks is None:
        return False
    try:
        top = _top_saved_tensors_hooks(False)
    except Exception:
        return False
    pack = top[0] if top else None
    return "_recomputation_hook" in getattr(pack, "__qualname__", "")


class _PendingFrame:
    """The backward frame of one module call, waiting for its gradients.

    ``template``: one entry per hooked tensor (note "None" until its gradient arrives), outputs
    first. ``frame``: the frame recorded for it in backward pass ``pass_id``. ``call``: the
    forward call whose gradients it holds (None: a recomputation's, numbered as they come).
    """

    __slots__ = ("info", "batch", "template", "frame", "pass_id", "call")

    def __init__(self, info: ModuleInfo, batch: int | None, call: int | None = None) -> None:
        self.info = info
        self.batch = batch  # None: registered during a recomputation (the pass's batch)
        self.call = call
        self.template: list[Entry] = []
        self.frame: Any = None
        self.pass_id = -1


# (pending frame, slot in its entries) fed by one gradient hook.
_Subscribers = list[tuple[_PendingFrame, int]]


def _grad_targets(value: Any, role: str, targets: list[tuple[str, _Tensor]]) -> None:
    """Append ``("grad_" + role, tensor)`` for each tensor in ``value`` that requires grad."""
    if isinstance(value, _Tensor):
        if value.requires_grad:
            targets.append(("grad_" + role, value))
        return
    if value is None or isinstance(value, (int, float, str, bool)):
        return
    for leaf_role, leaf in iter_leaves(value, role):
        if isinstance(leaf, _Tensor) and leaf.requires_grad:
            targets.append(("grad_" + leaf_role, leaf))


# type -> whether it is a key/value cache (transformers' ``Cache`` and its subclasses).
_KV_CACHE_TYPES: dict[type, bool] = {}


def _is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a key/value cache handed to a module (by class name: the core does
    not import transformers)."""
    kind = type(value)
    known = _KV_CACHE_TYPES.get(kind)
    if known is None:
        known = _KV_CACHE_TYPES[kind] = any(c.__name__ == "Cache" for c in kind.__mro__)
    return known


def _input_targets(args: tuple, kwargs: dict | None, targets: list[tuple[str, _Tensor]]) -> None:
    """The input tensors whose gradients a module's backward frame shows. A key/value cache
    handed to a module is left out: every attention call gets the whole cache, so its frame
    would show the gradients of the other layers' keys and values, which reach it late in the
    pass (and one hook per cached tensor per call, layers squared per forward); the keys'
    gradients show at the projections that made them."""
    for position, value in enumerate(args):
        if isinstance(value, _Tensor):  # the common case, without a call
            if value.requires_grad:
                targets.append((_GRAD_INPUT_ROLES[position] if position < 8
                                else f"grad_input[{position}]", value))
        elif value is not None and not _is_kv_cache(value):
            _grad_targets(value, f"input[{position}]", targets)
    if kwargs:
        for key, value in kwargs.items():
            if isinstance(value, _Tensor) or value is None or not _is_kv_cache(value):
                _grad_targets(value, f"kwarg:{key}", targets)


def _enclosing(name: str, by_name: dict[str, ModuleInfo]) -> list[tuple[ModuleInfo, str]]:
    """The watched modules enclosing the one called ``name``, nearest first, each with the
    prefix that names its parameters from there ("out_proj." from "attn")."""
    found = []
    parts = name.split(".") if name else []
    for depth in range(len(parts) - 1, -1, -1):
        outer = by_name.get(".".join(parts[:depth]))
        if outer is not None:
            found.append((outer, ".".join(parts[depth:]) + "."))
    return found


def _parameter_hook(feature: Any, owner: int) -> Any:
    """The hook on a parameter (see :meth:`BackwardFrames._hook_parameters`): its feature held
    weakly and its owner by position, nothing that leads back to the model. The garbage
    collector does not see a tensor's hooks, so a hook holding the model would keep a model
    and its watch alive forever once both are dropped without ``close()``."""
    def hook(parameter: _Tensor) -> None:
        live = feature()
        if live is not None:
            live._on_parameter_grad(owner, parameter)
    return run_eagerly_under_dynamo(hook)


@run_eagerly_under_dynamo
def _gradient_hook(feature: Any, subscribers: _Subscribers, grad: Any) -> None:
    """The hook on a tensor a module made (see :meth:`BackwardFrames._hook_tensor`), bound
    with ``functools.partial`` (marked for Dynamo once, here, not per tensor): its feature held
    weakly, so that a graph kept after ``close()`` (a loss, a PINN's derivatives) does not keep
    the watch alive."""
    live = feature()
    if live is not None:
        live._on_grad(subscribers, grad)


@run_eagerly_under_dynamo
def _leaf_gradient_hook(feature: Any, key: int, grad: Any) -> None:
    """The hook on a leaf tensor (an input that requires grad), bound like
    :func:`_gradient_hook`: its feature held weakly, and its subscribers by key in the feature
    (:attr:`BackwardFrames._leaf_subscribers`). It lives for every backward pass of its batch,
    and a PINN keeps its input points for the whole run: through its frames it would hold the
    model, so a watch dropped unclosed with its model would live as long as the points (the
    garbage collector does not see a tensor's hooks)."""
    live = feature()
    if live is not None:
        subscribers = live._leaf_subscribers.get(key)
        if subscribers is not None:
            live._on_grad(subscribers, grad)


def _bound_to(method: Any, info: ModuleInfo) -> Any:
    """A module hook that calls ``method(info, *hook_args)``. A closure, not a
    ``functools.partial``: under a strict ``torch.export`` Dynamo traces module hooks, and
    torch 2.10 fails building its guard on a partial hook's arguments."""
    def hook(*args: Any) -> None:
        return method(info, *args)
    return run_eagerly_under_dynamo(hook)


_GRAD_INPUT_ROLES = tuple(f"grad_input[{i}]" for i in range(8))
# Hooked tensors remembered per batch (one hook per tensor version feeds every frame using it).
_MAX_HOOKED = 65_536


class GradEntries(Protocol):
    def grad_entry(self, role: str, grad: Any, hold: bool = False) -> Entry:
        """The entry of a gradient, measured without holding it (``hold``: held until the
        pass resolves)."""


class FrameSink(Protocol):
    """Where :class:`BackwardFrames` records: the live
    :class:`~nanwidget.core.recorder.Recorder`, or a replay's
    :class:`~nanwidget.core.replay.run.ReplayFrames` (so a replay's backward frames are made by
    this very code)."""

    @property
    def batch(self) -> int: ...

    @property
    def frames_batch(self) -> int: ...

    @property
    def modules(self) -> list[ModuleInfo]: ...

    @property
    def lock(self) -> threading.RLock: ...

    @property
    def suspended(self) -> bool: ...

    @property
    def root_forward_running(self) -> bool: ...

    @property
    def entries(self) -> GradEntries: ...

    def record_frame(self, info: ModuleInfo, phase: str, entries: list[Entry],
                     batch: int | None = None, first_output: int | None = None,
                     first_input: int = 0, call: int | None = None) -> Frame: ...

    def forward_calls(self, info: ModuleInfo) -> int | None: ...

    def called_by_another_model(self) -> bool: ...

    def end_frames(self, batch: int, *, reason: str, raising: bool) -> None: ...

    def internal_error(self, error: BaseException) -> None: ...


class BackwardFrames(Feature):
    """Records a backward frame per module call per backward pass, from the first batch on.
    ``hold_output_grads``: hold the gradients the root's outputs receive until the pass ends
    (for a replay of a backward event without a loss function)."""

    def __init__(self, recorder: FrameSink, *, hold_output_grads: bool = False) -> None:
        self.recorder = recorder
        self.hold_output_grads = hold_output_grads
        self.closed = False
        self._weak_self = weakref.ref(self)
        self.passes = 0  # backward passes resolved (tests read it)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # The hooks on leaf tensors, each with the key of its subscribers in
        # _leaf_subscribers (the hook itself holds neither them nor this feature).
        self._leaf_handles: list[tuple[torch.utils.hooks.RemovableHandle, int]] = []
        self._leaf_subscribers: dict[int, _Subscribers] = {}
        self._leaf_key = 0
        # How many of them were registered before a backward pass ended: they go at the next
        # root forward (a PINN's or a gradient penalty's batch runs several passes).
        self._leaf_handles_done = 0
        self._pass_id = 0
        self._pass_batch: int | None = None  # batch of the first frame of the running pass
        self._last_forward_batch: int | None = None
        self._queued = False  # a final callback is queued for the running pass
        # That callback, weakly: autograd lets it go unrun when the pass raises.
        self._queued_callback: Any = None
        self._last_opened: Any = None  # the frame the running pass opened last
        # id(tensor) -> (weak reference, version, subscribers) of the tensors hooked this
        # batch: a module's output is usually the next module's input, hooked once.
        self._hooked: dict[int, tuple[Any, int, _Subscribers]] = {}
        # id(module) -> stacks of pending frames opened by the pre-hook of an in-place module.
        self._opened: dict[int, list[_PendingFrame]] = {}
        # ModuleInfo.index -> the frame the running pass opened last for that module (where its
        # parameters' gradients go).
        self._pass_frames: dict[int, Any] = {}
        # The parameter gradients measured in this pass: (frame, entry index, role, parameter,
        # the .grad measured, its version then). One written again before the pass ends
        # (DDP's all-reduce averages .grad after the hook) is measured again.
        self._param_entries: list[tuple[Any, int, str, Any, Any, int]] = []
        # (module, name, its enclosing modules nearest first with the name prefix from each)
        # per hook.
        self._parameter_owners: list[tuple[ModuleInfo, str,
                                           list[tuple[ModuleInfo, str]]]] = []
        # batch -> root forward call -> the gradient each root output received in the running
        # pass, by the output's forward role ("output", "output.logits"); let go when it ends.
        self._root_grads: dict[int, dict[int, dict[str, _Tensor]]] = {}
        self._held_bytes = 0  # theirs, in the running pass (-1: past the limit, none held)
        try:
            for info in recorder.modules:
                module = info.module
                inplace = getattr(module, "inplace", False) is True
                if inplace:
                    # Its input is overwritten by its forward: hook the input before that.
                    self._handles.append(add_forward_pre_hook(
                        module, _bound_to(self._inplace_pre_hook, info), with_kwargs=True))
                # On the root, run before the recorder's own hook counts the next batch.
                hook = _bound_to(self._inplace_forward_hook if inplace else self._forward_hook,
                                 info)
                self._handles.append(add_forward_hook(
                    module, hook, with_kwargs=True, prepend=info.is_root))
            self._hook_parameters(recorder.modules)
        except BaseException:
            self.close()
            raise

    def _hook_parameters(self, modules: list[ModuleInfo]) -> None:
        """A hook on every trainable parameter, called once autograd has accumulated its
        gradient in a pass (see the module docstring: ``weight``, ``bias``)."""
        owned: set[int] = set()
        by_name = {info.name: info for info in modules}
        for info in modules:
            enclosing = _enclosing(info.name, by_name)
            try:
                parameters = list(info.weights._parameters.items())
            except Exception:  # a container without items(): nothing to hook
                continue
            for name, parameter in parameters:
                if not isinstance(parameter, _Tensor) or id(parameter) in owned:
                    continue
                owned.add(id(parameter))
                if is_distributed_tensor(parameter) \
                        or not (parameter.is_floating_point() or parameter.is_complex()):
                    # A sharded parameter (FSDP2): FSDP2 calls its hooks itself, with the
                    # gradient reduced over the ranks, so another rank's NaN would show here
                    # as this rank's own.
                    continue
                # A frozen parameter is hooked too, for when it is unfrozen (gradual
                # unfreezing); PyTorch hooks only a tensor that requires grad, for a moment.
                frozen = not parameter.requires_grad
                try:
                    if frozen:
                        parameter.requires_grad_(True)
                    try:
                        handle = parameter.register_post_accumulate_grad_hook(
                            _parameter_hook(weakref.ref(self), len(self._parameter_owners)))
                    finally:
                        if frozen:
                            parameter.requires_grad_(False)
                except Exception:  # not a leaf, or a subclass that refuses hooks: no entry
                    continue
                self._parameter_owners.append((info, name, enclosing))
                self._handles.append(handle)

    # ------------------------------------------------------------------ forward side
    def _skip(self) -> bool:
        if export_flag._is_exporting_flag:
            return True  # torch.export traces the model (under Dynamo, in strict mode)
        if self.closed or not _grad_enabled() or self.recorder.suspended:
            return True
        return _graph_task_id() >= 0 and _recomputing_without_a_graph()

    def _new_pending(self, info: ModuleInfo, frame_recorded: bool) -> _PendingFrame | None:
        """``frame_recorded``: whether the forward frame of this call is recorded already (the
        recorder's hook runs first, except on the root and in an in-place module's pre-hook).
        None when the call is another model's (of a module it shares with the watched one)."""
        # The backward frame of a module's n-th call is its call n, in whatever order the
        # gradients come (backward runs the calls of a reused module last to first).
        calls = self.recorder.forward_calls(info)
        call = None if calls is None else max(0, calls - frame_recorded)
        if _graph_task_id() < 0:
            # Outside a root forward only (never inside one): another model's backward must
            # not open frames or passes of this watch.
            if calls is None and self.recorder.called_by_another_model():
                return None
            if calls is None and tracing():
                return None  # a tracer runs a watched module by itself: the watch stands aside
            return _PendingFrame(info, self.recorder.frames_batch, call)
        # A recomputation (reentrant checkpoint): its frames go to the running pass's batch.
        if not self._queued:
            # None of our hooks has fired in this pass yet (the whole model is checkpointed):
            # resolve at the end of this, the outer, pass.
            with self.recorder.lock:
                self._queue_resolution()
        return _PendingFrame(info, None, call)

    def _hook(self, pending: _PendingFrame, targets: list[tuple[str, _Tensor]]) -> None:
        template = pending.template
        for role, tensor in targets:
            # A strided nested tensor's .shape raises; a jagged one's holds a symbolic size.
            shape = nested_shape(tensor) if tensor.is_nested else tensor.shape
            template.append(Entry((role, None, tensor.dtype, shape, _NO_GRADIENT)))
            self._hook_tensor(pending, len(template) - 1, tensor)

    def _hook_tensor(self, pending: _PendingFrame, slot: int, tensor: _Tensor) -> None:
        """One gradient hook per tensor version, feeding every frame that uses the tensor."""
        hooked = self._hooked
        key = id(tensor)
        version = tensor._version
        known = hooked.get(key)
        if known is not None and known[1] == version and known[0]() is tensor:
            known[2].append((pending, slot))
            return
        subscribers: _Subscribers = [(pending, slot)]
        if len(hooked) >= _MAX_HOOKED:
            hooked.clear()
        hooked[key] = (weakref.ref(tensor), version, subscribers)
        if tensor.grad_fn is not None:
            tensor.register_hook(partial(_gradient_hook, self._weak_self, subscribers))
            return
        # A leaf (an input that requires grad, a parameter passed as an argument) keeps its
        # hooks beyond the graph: they are removed at the next root forward after a backward
        # pass ended (every pass of the batch sees them), at close, or when a pass failed.
        self._leaf_key += 1
        self._leaf_subscribers[self._leaf_key] = subscribers
        handle = tensor.register_hook(partial(_leaf_gradient_hook, self._weak_self,
                                                   self._leaf_key))
        leaves = self._leaf_handles
        leaves.append((handle, self._leaf_key))
        if len(leaves) > _MAX_LEAF_HOOKS:
            self._remove_leaf_hooks(_MAX_LEAF_HOOKS // 2)

    def _inplace_pre_hook(self, info: ModuleInfo, module: nn.Module, args: tuple,
                          kwargs: dict = COPIED) -> None:
        if kwargs is COPIED:  # a copy torch.ao put on a module it swapped in
            return drop_copied_hooks(module)
        if self._skip():
            return None
        try:
            targets: list[tuple[str, _Tensor]] = []
            _input_targets(args, None, targets)
            pending = self._new_pending(info, False)
            if pending is None:
                return None
            # Slot 0 waits for the output (the same tensor, once written): outputs come first.
            pending.template.append(Entry(("grad_output[0]", None, None, None, _NO_GRADIENT)))
            self._hook(pending, targets)  # before the write: the gradient of the value received
            self._opened.setdefault(id(module), []).append(pending)
        except Exception as error:
            self.recorder.internal_error(error)
        return None

    def _inplace_forward_hook(self, info: ModuleInfo, module: nn.Module, args: tuple,
                              kwargs: dict, output: Any = COPIED) -> None:
        if output is COPIED:  # a copy torch.ao put on a module it swapped in
            return drop_copied_hooks(module)
        if self._skip():
            return None
        opened = self._opened.get(id(module))
        pending = opened.pop() if opened else None
        if pending is None:
            return self._forward_hook(info, module, args, kwargs, output)
        try:
            if isinstance(output, _Tensor):
                if output.requires_grad:
                    shape = nested_shape(output) if output.is_nested else output.shape
                    pending.template[0] = Entry(("grad_output[0]", None, output.dtype, shape,
                                                 _NO_GRADIENT))
                    self._hook_tensor(pending, 0, output)
            else:
                targets: list[tuple[str, _Tensor]] = []
                _grad_targets(output, "output", targets)
                self._hook(pending, targets)
        except Exception as error:
            self.recorder.internal_error(error)
        return None

    def _forward_hook(self, info: ModuleInfo, module: nn.Module, args: tuple, kwargs: dict,
                      output: Any = COPIED) -> None:
        if output is COPIED:  # a copy torch.ao put on a module it swapped in
            return drop_copied_hooks(module)
        if export_flag._is_exporting_flag:
            return None  # torch.export traces the model (under Dynamo, in strict mode)
        if self.closed or not _grad_enabled() or self.recorder.suspended:
            return None
        if _graph_task_id() >= 0 and _recomputing_without_a_graph():
            return None
        try:
            targets: list[tuple[str, _Tensor]] = []
            if isinstance(output, _Tensor):
                if output.requires_grad:
                    targets.append(("grad_output[0]", output))
            else:
                _grad_targets(output, "output", targets)
            _input_targets(args, kwargs, targets)
            if targets:
                pending = self._new_pending(info, not info.is_root)
                if pending is not None:
                    self._hook(pending, targets)
        except Exception as error:
            self.recorder.internal_error(error)
        return None

    # ------------------------------------------------------------------ backward side
    @run_eagerly_under_dynamo
    def _on_grad(self, subscribers: _Subscribers, grad: Any) -> None:
        recorder = self.recorder
        # A replay's backward may run on autograd's own threads: never wait for the lock the
        # replaying thread holds.
        if self.closed or recorder.suspended:
            return None
        if not self._queued and recorder.root_forward_running:
            return None  # the forward's own backward pass (module docstring)
        try:
            with recorder.lock:
                measured = None
                latest = self._last_opened  # before this gradient opened any frame
                for pending, slot in subscribers:
                    frame = pending.frame
                    role = pending.template[slot].role
                    if frame is None or pending.pass_id != self._pass_id:
                        frame = self._open_frame(pending)
                    elif frame is not latest and role.startswith("grad_output"):
                        # A gradient reaching one of the module's outputs after other modules
                        # ran their backward: that output is used further on inside the model
                        # too (a KV cache, a seq2seq model's encoder output), so its gradient
                        # comes from there as well. Its own frame, where it arrived: a NaN made
                        # there is not taken for one this module received first.
                        frame = self._open_frame(pending)
                    if measured is None:
                        measured = recorder.entries.grad_entry(role, grad)
                        frame.entries[slot] = measured
                    else:
                        frame.entries[slot] = measured.replace(role=role)
                    if pending.info.is_root and self.hold_output_grads \
                            and pending.batch is not None:
                        self._hold_root_grad(pending, role, grad)
        except Exception as error:
            recorder.internal_error(error)
        return None

    def _hold_root_grad(self, pending: _PendingFrame, role: str, grad: Any) -> None:
        if not isinstance(grad, _Tensor) or not role.startswith("grad_output") \
                or self._held_bytes < 0:
            return
        try:
            size = grad.numel() * grad.element_size()
        except Exception:  # a tensor without a size to tell (a subclass): not held
            return
        self._held_bytes += size
        if self._held_bytes > MAX_HELD_OUTPUT_GRAD_BYTES:
            self._root_grads.clear()
            self._held_bytes = -1
            return
        calls = self._root_grads.setdefault(pending.batch, {})  # type: ignore[arg-type]
        held = calls.setdefault(pending.call or 0, {})
        output_role = role[len("grad_"):]
        held[output_role] = grad
        if output_role == "output[0]":  # a root returning one tensor: its forward role
            held["output"] = grad

    def output_grads(self, batch: int) -> list[dict[str, _Tensor] | None] | None:
        """The gradients the root's outputs received in the running backward pass of
        ``batch``, one mapping (output role -> gradient) per root forward of the batch, in
        order; None when none arrived (or the pass is over: they are let go when it ends)."""
        calls = self._root_grads.get(batch)
        if not calls:
            return None
        return [calls.get(call) for call in range(max(calls) + 1)]

    def _on_parameter_grad(self, owner: int, parameter: _Tensor) -> None:
        """A parameter's gradient is accumulated for this pass: its entry, in the frame of the
        module that owns it (``self._parameter_owners[owner]``)."""
        recorder = self.recorder
        if self.closed or recorder.suspended:
            return None
        if not self._queued and recorder.root_forward_running:
            return None  # the forward's own backward pass (module docstring)
        try:
            info, name, enclosing = self._parameter_owners[owner]
            grad = parameter.grad
            if grad is None:
                return None
            with recorder.lock:
                frame = self._pass_frames.get(info.index)
                if frame is None:  # used without calling its module: an enclosing one's frame
                    for outer, prefix in enclosing:
                        frame = self._pass_frames.get(outer.index)
                        if frame is not None:
                            name = prefix + name
                            break
                if frame is None:  # no module around it ran either: a frame of its own
                    frame = self.recorder.record_frame(info, "backward", [],
                                                       batch=self._in_this_pass(None))
                    self._pass_frames[info.index] = frame
                    self._queue_resolution()
                # .grad stays alive until the pass resolves: held, not looked at twice.
                entry = recorder.entries.grad_entry(name, grad, hold=True)
                frame.entries.append(entry)
                frame.first_output = len(frame.entries)  # a backward frame has no outputs
                self._param_entries.append((frame, len(frame.entries) - 1, name, parameter, grad,
                                            grad._version))
        except Exception as error:
            recorder.internal_error(error)
        return None

    def _open_frame(self, pending: _PendingFrame) -> Any:
        """The first gradient of this module call in this pass: its frame takes its place now."""
        frame = self.recorder.record_frame(pending.info, "backward", list(pending.template),
                                           batch=self._in_this_pass(pending.batch),
                                           call=pending.call)
        pending.frame, pending.pass_id = frame, self._pass_id
        self._last_opened = frame
        self._pass_frames[pending.info.index] = frame
        self._queue_resolution()
        return frame

    def _in_this_pass(self, batch: int | None) -> int:
        """The batch a frame opened now belongs to (``batch``, or for None, one registered
        during a recomputation or a parameter's own frame, the running pass's); the pass takes
        the batch of its first frame."""
        if batch is None:
            batch = self._pass_batch if self._pass_batch is not None else self._forward_batch()
        if self._pass_batch is None:
            self._pass_batch = batch
        return batch

    def _forward_batch(self) -> int:
        if self._last_forward_batch is not None:
            return self._last_forward_batch
        return self.recorder.batch

    def _queue_resolution(self) -> None:
        """Once per backward pass (caller holds the lock): resolve when autograd finishes it."""
        if self._queued:
            return
        callback = self._requeue_last
        try:
            _queue_callback(callback)
        except RuntimeError:  # not inside a backward pass after all: resolved by the next boundary
            return
        self._queued = True
        self._queued_callback = weakref.ref(callback)

    @run_eagerly_under_dynamo  # autograd calls it at the pass's end
    def _requeue_last(self) -> None:
        # Final callbacks queued while they run go last: let DDP / FSDP finish their reductions.
        callback = self._backward_done
        try:
            _queue_callback(callback)
        except RuntimeError:
            self._backward_done()
            return
        self._queued_callback = weakref.ref(callback)

    def end_failed_pass(self) -> bool:
        """End a backward pass that raised (a solver's assert on a NaN gradient): autograd then
        drops the final callback that would have ended it, so its frames wait unresolved. Its
        frames are resolved and its event recorded now, never raised (the pass raised already).
        Returns whether there was one. For readers of the events (``w.events``, ``report()``),
        outside any forward or backward pass."""
        with self.recorder.lock:
            callback = self._queued_callback
            failed = self._queued and callback is not None and callback() is None \
                and not self.closed
        if failed:
            self.end_backward(raising=False)
        return failed

    @run_eagerly_under_dynamo  # autograd calls it at the pass's end
    def _backward_done(self) -> None:
        self.end_backward(raising=True)

    def end_backward(self, *, raising: bool) -> None:
        """End the running backward pass: resolve its frames, let the features review them,
        record the first event and raise or warn per ``on_nan`` when ``raising``."""
        recorder = self.recorder
        with recorder.lock:
            self._queued = False
            self._queued_callback = None
            batch = self._pass_batch if self._pass_batch is not None else self._forward_batch()
            self._pass_batch = None
            self._pass_id += 1
            self.passes += 1
            self._pass_frames.clear()
            # The inputs' hooks stay for the batch's later passes (a PINN's loss.backward()
            # after its torch.autograd.grad(..., create_graph=True), a gradient penalty's):
            # they go at the next root forward, or now when this pass failed.
            if raising:
                self._leaf_handles_done = len(self._leaf_handles)
            else:
                self._remove_leaf_hooks()
            if self._param_entries:
                self._measure_rewritten_grads()
        try:
            if not self.closed:
                recorder.end_frames(batch, reason="backward", raising=raising)
        finally:
            with recorder.lock:
                self._root_grads.clear()  # the pass is over: its gradients go
                self._held_bytes = 0

    def _measure_rewritten_grads(self) -> None:
        """At the end of the pass (after DDP's and FSDP's final callbacks): the parameter
        gradients written since their hook measured them (DDP averages ``.grad`` over the
        ranks after autograd accumulated it) are measured again, so that a frame holds the
        ``.grad`` the optimizer will use. Caller holds the lock."""
        entries, self._param_entries = self._param_entries, []
        for frame, index, role, parameter, grad, version in entries:
            now = parameter.grad
            if now is grad and (now is None or now._version == version):
                continue
            try:
                frame.entries[index] = self.recorder.entries.grad_entry(role, now, hold=True)
            except Exception as error:
                self.recorder.internal_error(error)

    # ------------------------------------------------------------------ Feature
    def on_batch_start(self, batch: int, args: tuple, kwargs: dict) -> None:
        self._last_forward_batch = batch
        self._opened.clear()
        self._hooked.clear()
        if self._leaf_handles_done:  # the inputs' hooks of the batches whose passes ended
            self._remove_leaf_hooks(self._leaf_handles_done)
        if self._queued and not in_backward_pass():
            # The last pass never finished (an error inside backward): its callback is gone.
            self._queued = False
            self._queued_callback = None
            self._pass_batch = None
            self._pass_id += 1
            self._pass_frames.clear()
            self._param_entries.clear()
            self._root_grads.clear()
            self._held_bytes = 0
            self._remove_leaf_hooks()

    def _remove_leaf_hooks(self, count: int | None = None) -> None:
        """Remove the hooks on leaf tensors: the first ``count`` registered, or all."""
        leaves = self._leaf_handles
        count = len(leaves) if count is None else min(count, len(leaves))
        for handle, key in leaves[:count]:
            handle.remove()
            self._leaf_subscribers.pop(key, None)
        del leaves[:count]
        self._leaf_handles_done = max(0, self._leaf_handles_done - count)

    def close(self) -> None:
        self.closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._remove_leaf_hooks()
        self._opened.clear()
        self._hooked.clear()
        self._pass_frames.clear()
        self._param_entries.clear()
        self._root_grads.clear()

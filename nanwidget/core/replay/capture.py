"""Holding batches for replay: what each root forward needs to run again, kept cheaply.

On every batch, under the recorder's lock: references to the root forward's inputs (no copies)
with their version counters, the RNG states, grad/autocast modes, train/eval flags and the
version counters of parameters and buffers. Tensors are copied only with
``snapshot_weights=True``.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from .. import native
from ..events import NanEvent
from ..frames import Frame
from ..holders import stand_ins
from ..options import batch_number
from ..recorder import Feature, is_fsdp_unit
from ..stats import sharded_parameters, stood_for, version_of
from ..walk import iter_leaves
from ..writes import step_in_progress, steps_taken
from .divergence import adapter_layer
from .inputs import UncopiedInput, copy_structure, needs_copy
from .static_cache import as_it_was, keep_lengths

__all__ = ["BatchCapture", "HeldBatch", "ForwardCapture", "WeightSlots", "layouts_of", "ReplayError",
           "BatchNotHeldError", "InputModifiedError", "ModelNotReplayableError",
           "MAX_EVENT_BATCHES", "MAX_FORWARDS_PER_BATCH", "cpu_rng_state"]

# Event batches pinned for replay beyond the last ``keep_batches`` (the first ones: the first
# event is the one users chase).
MAX_EVENT_BATCHES = 8
# Root forward calls held per batch (several when a loop accumulates gradients with set_batch).
MAX_AWAITING_BACKWARD = 4  # batches held for a backward pass that covers several
MAX_FORWARDS_PER_BATCH = 64

_Tensor = torch.Tensor
_no_torch_function = torch._C.DisableTorchFunctionSubclass
_PLAIN = (torch.Tensor, nn.Parameter)
_version_getter = operator.attrgetter("_version")
_training_getter = operator.attrgetter("training")
_dtype_getter = operator.attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr
# operator.call is Python 3.11's; the same, slower, before it
_call = getattr(operator, "call", None) or (lambda getter, key: getter(key))
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)
# The CPU RNG's state as a clone of the generator (a copy of its state made in C++: about 1 us
# inside a training loop, against 6-7 us for torch.get_rng_state()'s new tensor); read back
# with cpu_rng_state() at a replay only. torch.get_rng_state()'s tensor where there is no clone.
_cpu_rng_state = getattr(torch.default_generator, "clone_state", None) \
    or torch.default_generator.get_state


def cpu_rng_state(held: Any) -> torch.Tensor:
    """The CPU RNG state a capture holds, as torch.set_rng_state() takes it."""
    return held.get_state() if isinstance(held, torch.Generator) else held
_is_grad_enabled = torch.is_grad_enabled
_is_inference_mode_enabled = torch.is_inference_mode_enabled
# The roles of positional inputs, made once (one string per batch is measurable here).
_INPUT_ROLES = tuple(f"input[{i}]" for i in range(16))


class ReplayError(RuntimeError):
    """A batch cannot be replayed (see the message for why and what to do)."""


class ModelNotReplayableError(ReplayError):
    """The model cannot run on this process alone (FSDP2, tensor parallel): no batch of it can
    be replayed here."""


class BatchNotHeldError(ReplayError):
    """The batch asked for is not (or no longer) held; the message lists the held ones."""


class InputModifiedError(ReplayError):
    """An input of the batch was modified in place since: a replay would run on other data.
    ``by_model``: the model's own forward wrote it while the batch ran (a cache it fills in
    place), not the caller after it."""

    by_model = False
    reason = ""  # the message without its advice (a diagnosis gives its own)


class ForwardCapture:
    """What one root forward call needs to run again."""

    __slots__ = ("args", "kwargs", "inputs", "input_versions", "end_input_versions", "cpu_rng",
                 "cuda_rng", "grad_enabled", "inference", "autocast", "training", "weights",
                 "weight_versions", "weight_layout", "end_buffer_versions", "snapshot",
                 "needs_grad", "steps", "uncopied", "end_renormed_versions", "stepping",
                 "adapters_disabled", "active_adapters", "module", "restored")

    def __init__(self) -> None:
        self.uncopied = ""  # the first input that could not be copied, and why
        self.kwargs: dict = {}
        self.needs_grad: frozenset | set = frozenset()  # positions / keys of detached inputs that required grad
        self.end_input_versions: list[int] | None = None
        self.end_buffer_versions: list[int] | None = None
        self.end_renormed_versions: list[int] | None = None
        self.snapshot: list[torch.Tensor | None] | None = None
        self.steps = 0  # optimizer steps seen when it started (core.writes)
        self.stepping = 0  # the optimizer step it ran inside (a closure's forward); 0: none
        # Whether the model's peft-style adapters were switched off (``with
        # model.disable_adapter():``, a reference forward); None: the model has none.
        self.adapters_disabled: bool | None = None
        self.active_adapters: Any = None  # their names (peft's active_adapters)
        # The module called instead of the model (Recorder.count_outside_calls: the model
        # peft's generate() calls); None: the model's forward.
        self.module: nn.Module | None = None
        # The tensors of a static KV cache's layers that the forward writes in place and a
        # replay restores as they were (:mod:`.static_cache`): not a reason to refuse it.
        # (live tensor, held layer, attribute name)
        self.restored: list[tuple[torch.Tensor, Any, str]] = []


def _held_copy(capture: ForwardCapture, role: str, value: Any, memo: dict[int, Any]) -> Any:
    """The copy of an input's structure a held batch keeps (see :mod:`.inputs`); None, with
    the reason in ``capture.uncopied``, when it cannot be copied."""
    try:
        return copy_structure(value, memo, written=capture.restored)
    except UncopiedInput as error:
        if not capture.uncopied:
            capture.uncopied = f"{role}{error.where} ({error.why})"
    except RecursionError:
        if not capture.uncopied:
            capture.uncopied = f"{role} (nested too deeply)"
    return None


class HeldBatch:
    """The root forwards of one batch (several with gradient accumulation under set_batch)."""

    __slots__ = ("batch", "forwards", "truncated")

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.forwards: list[ForwardCapture] = []
        self.truncated = False


class _Slots:
    """A TorchScript module's ``_parameters`` / ``_buffers`` (a mapping without ``get``) as a
    dict-like container of slots."""

    __slots__ = ("mapping",)

    def __init__(self, mapping: Any) -> None:
        self.mapping = mapping

    def items(self) -> list[tuple[str, Any]]:
        return list(self.mapping.items())

    def get(self, key: str) -> Any:
        try:
            return self.mapping[key]
        except (KeyError, RuntimeError, AttributeError):
            return None

    def __setitem__(self, key: str, value: Any) -> None:
        self.mapping[key] = value


class WeightSlots:
    """Every parameter and buffer slot of the model, read by dict lookups (no module walk)."""

    def __init__(self, root: nn.Module) -> None:
        self.containers: list[dict] = []
        self.keys: list[str] = []
        self.names: list[str] = []
        self.is_buffer: list[bool] = []
        # Weights their own module writes in place in its forward (nn.Embedding(max_norm=...)
        # renormalises the rows it reads): their version moves within a batch, not after it.
        self.renormed_positions: list[int] = []
        # The parameters FSDP2 (fully_shard) keeps as DTensors between forwards: while its
        # forward runs, their slots hold the gathered tensor the forward reads, which no
        # optimizer step, load or in-place write between steps touches (its version counter
        # never moves). Their slots are read from a dict of their own that holds the DTensor
        # (FSDP2 puts that same parameter back after each forward and backward).
        managed: set[str] = set()  # the modules FSDP2 manages: its units and what is inside
        for module_name, module in root.named_modules():  # a module comes before its children
            if is_fsdp_unit(module) or module_name and module_name.rpartition(".")[0] in managed:
                managed.add(module_name)
            sharded = sharded_parameters(module) if module_name in managed else {}
            renorms = isinstance(module, (nn.Embedding, nn.EmbeddingBag)) \
                and getattr(module, "max_norm", None) is not None
            for is_buffer, container in ((False, module._parameters), (True, module._buffers)):
                if not isinstance(container, dict):  # a TorchScript module's: no .get()
                    container = _Slots(container)
                for key, tensor in container.items():
                    if tensor is None:
                        continue
                    if not is_buffer and key in sharded:
                        self.containers.append({key: sharded[key]})
                    else:
                        self.containers.append(container)
                    self.keys.append(key)
                    self.names.append(f"{module_name}.{key}" if module_name else key)
                    self.is_buffer.append(is_buffer)
                    if renorms and not is_buffer and key == "weight":
                        self.renormed_positions.append(len(self.names) - 1)
        self.buffer_positions = [i for i, flag in enumerate(self.is_buffer) if flag]
        self._getters = [container.get for container in self.containers]
        self.root = root
        self.modules = list(root.modules())
        # Held with their names: an id is never reused while it is compared.
        self._read_from = {id(m): (name, m) for name, m in root.named_modules()}

    def structure_changes(self) -> list[str]:
        """Modules added to or removed from the model since these slots were read. A holder
        rebuilt around the same tensors (Keras' ``_torch_params`` on every ``fit()``) is no
        change: the slots read the new one from then on."""
        now = {id(m): (name, m) for name, m in self.root.named_modules()}
        before = self._read_from
        added = [(name, m) for key, (name, m) in now.items() if key not in before]
        removed = [(name, m) for key, (name, m) in before.items() if key not in now]
        for name, old, new in stand_ins(added, removed):
            self._follow(old, new)
            del before[id(old)]
            before[id(new)] = (name, new)
        added_names = [name or "<root>" for name, m in added if id(m) not in before]
        removed_names = [name or "<root>" for name, m in removed if id(m) in before]
        changes = []
        if added_names:
            changes.append(f"modules added or replaced: {', '.join(added_names[:6])}")
        if removed_names:
            changes.append(f"modules removed or replaced: {', '.join(removed_names[:6])}")
        return changes

    def _follow(self, old: nn.Module, new: nn.Module) -> None:
        """Read ``new``'s parameters and buffers, and its train/eval flag, where ``old``'s were
        read: same positions (it holds the same tensors under the same names). In place: the
        sentinel's gradient check holds these lists."""
        for old_dict, new_dict in ((old._parameters, new._parameters),
                                   (old._buffers, new._buffers)):
            for i, container in enumerate(self.containers):
                if container is old_dict:
                    self.containers[i] = new_dict
                    self._getters[i] = new_dict.get
        self.modules[:] = [new if m is old else m for m in self.modules]

    def read(self) -> list[torch.Tensor | None]:
        return list(map(_call, self._getters, self.keys))  # one C loop (hot path)


def versions_of(tensors: list[torch.Tensor | None]) -> list[int]:
    """Version counters (-1 for None and inference tensors)."""
    try:
        return list(map(_version_getter, tensors))
    except (AttributeError, RuntimeError):  # a slot set to None since, or an inference tensor
        # (read without a subclass's own code: an ExpandedWeight refuses even ._version)
        with _no_torch_function():
            return [-1 if t is None else version_of(t) for t in tensors]


def _input_versions(tensors: list[torch.Tensor]) -> list[int]:
    """Version counters of a forward's inputs, read without running a tensor subclass's own
    ``__torch_function__``."""
    for tensor in tensors:
        if type(tensor) not in _PLAIN:
            with _no_torch_function():
                return versions_of(tensors)  # type: ignore[arg-type]
    return versions_of(tensors)  # type: ignore[arg-type]


def layouts_of(tensors: list[torch.Tensor | None]) -> list[tuple[int, torch.dtype | None]]:
    """(storage pointer, dtype) of each tensor; (-1, None) for None or a pointer-less subclass."""
    try:  # the usual case, in C loops
        return list(zip(map(_data_ptr, tensors), map(_dtype_getter, tensors)))
    except Exception:
        pass
    layout = []
    for tensor in tensors:
        if tensor is None:
            layout.append((-1, None))
            continue
        with _no_torch_function():  # a subclass's own code may refuse reads (ExpandedWeight)
            try:
                layout.append((tensor.data_ptr(), tensor.dtype))
            except Exception:
                try:
                    layout.append((-1, tensor.dtype))
                except Exception:
                    layout.append((-1, None))
    return layout


def _detached(value: Any, aliases: dict[int, torch.Tensor]) -> Any:
    """A tensor made by autograd as a detached alias (one per tensor: ``aliases`` keeps them by
    id); anything else as it is."""
    if isinstance(value, _Tensor) and value.grad_fn is not None:
        alias = aliases.get(id(value))
        if alias is None:
            alias = aliases[id(value)] = value.detach()
        return alias
    return value


def _made_by_autograd(args: tuple) -> bool:
    for value in args:
        if isinstance(value, _Tensor):
            if type(value) not in _PLAIN:
                with _no_torch_function():  # runs no tensor subclass's own code
                    if value.grad_fn is not None:
                        return True
            elif value.grad_fn is not None:
                return True
    return False


def _autocast_state() -> tuple:
    if _any_autocast is not None and not _any_autocast():
        return ()
    state = []
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            state.append((device_type, torch.get_autocast_dtype(device_type)))
    return tuple(state)


class BatchCapture(Feature):
    """Holds what is needed to re-run the last ``keep`` batches, the trace batches and the
    batches of the first events."""

    def __init__(self, model: nn.Module, *, keep: int, trace_batches: frozenset[int],
                 snapshot_weights: bool = False) -> None:
        self.keep = keep
        self.trace_batches = trace_batches
        self.snapshot_weights = snapshot_weights
        self.slots = WeightSlots(model)
        self.held: OrderedDict[int, HeldBatch] = OrderedDict()
        self.event_batches: set[int] = set()
        #: Batches whose outputs wait for a backward pass that may cover several batches (a
        #: siamese step: model(a), model(b), one loss): held past ``keep`` until it ends.
        self.awaiting_backward: list[int] = []
        # The weights' state in one C call (native.weight_state_reader), or None: Python reads.
        self._weight_state = native.weight_state_reader()
        #: Set by whoever composes the watch: whether a batch ran without the root's forward
        #: (its inputs were never held), for the error that says so.
        self.ran_outside_root: Callable[[int], bool] | None = None
        # A layer with peft-style adapters, found once: its flags are read once per forward;
        # the adapters active when the model was watched (the ones it trains).
        self._adapter_layer = layer = adapter_layer(model)
        self.watched_adapters = None if layer is None else tuple(layer.active_adapters)

    # -- hot path: every batch, under the recorder's lock
    def on_batch_start(self, batch: int, args: tuple, kwargs: dict) -> None:
        if not self.keep and batch not in self.trace_batches:
            return
        held = self.held.get(batch)
        if held is not None and len(held.forwards) >= MAX_FORWARDS_PER_BATCH:
            held.truncated = True
            return
        capture = ForwardCapture()
        self._hold_inputs(capture, args, kwargs)
        capture.cpu_rng = _cpu_rng_state()
        capture.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        capture.grad_enabled = _is_grad_enabled()
        capture.inference = _is_inference_mode_enabled()
        capture.autocast = _autocast_state()
        slots = self.slots
        # Storage and dtype (the layout): ``p.data = t`` and ``model.float()`` swap them without
        # a version bump. The native extension reads the usual model's in one call.
        state = None if self._weight_state is None else self._weight_state(
            slots.containers, slots.keys, slots.modules)
        if state is None:
            capture.training = list(map(_training_getter, slots.modules))  # one C loop
            capture.weights = weights = slots.read()
            capture.weight_versions = versions_of(weights)
            capture.weight_layout = layouts_of(weights)
        else:
            capture.weights, capture.weight_versions, capture.weight_layout, capture.training = \
                state
            weights = capture.weights
        capture.steps = steps_taken()  # fused optimizer steps move no version counter
        capture.stepping = step_in_progress()  # LBFGS's closure runs inside the step
        layer = self._adapter_layer
        if layer is not None:
            capture.adapters_disabled = layer.disable_adapters
            capture.active_adapters = layer.active_adapters
        if self.snapshot_weights:
            capture.snapshot = self._snapshot(weights)
        if held is None:
            every = self.held
            held = every[batch] = HeldBatch(batch)
            if len(every) > self.keep:
                if self.event_batches or self.trace_batches or self.awaiting_backward:
                    self._evict_unpinned()
                else:  # nothing pinned (the usual case): the oldest go, no list built
                    while len(every) > self.keep:
                        every.popitem(last=False)
        held.forwards.append(capture)

    @staticmethod
    def _hold_inputs(capture: ForwardCapture, args: tuple, kwargs: dict) -> None:
        """The root forward's inputs as ``capture`` holds them: references (detached aliases of
        tensors made by autograd), copies of structures a forward may change, and the input
        tensors by role with their version counters."""
        first = args[0] if len(args) == 1 else None
        if not kwargs and type(first) in _PLAIN and first.grad_fn is None:  # type: ignore[union-attr]
            # The usual call, model(x) (every batch): what the general path below makes of it,
            # without its loops.
            capture.args = args
            capture.kwargs = kwargs
            capture.inputs = [("input[0]", first)]  # type: ignore[list-item]
            try:
                capture.input_versions = [first._version]  # type: ignore[union-attr]
            except (AttributeError, RuntimeError):  # an inference tensor: versions_of's -1
                capture.input_versions = versions_of([first])
            return
        # Tensors made by autograd are held as detached aliases (same data and version counter)
        # so that a held batch does not keep the graph behind them alive.
        # One alias per tensor: a tensor passed at several places stays one (attention(x, x, x)).
        aliases: dict[int, torch.Tensor] = {}
        if _made_by_autograd(args):
            capture.needs_grad = {i for i, v in enumerate(args)
                                  if isinstance(v, _Tensor) and v.requires_grad}
            args = tuple(_detached(v, aliases) for v in args)
        if kwargs and _made_by_autograd(tuple(kwargs.values())):
            capture.needs_grad = capture.needs_grad | {k for k, v in kwargs.items()
                                                       if isinstance(v, _Tensor) and v.requires_grad}
            kwargs = {k: _detached(v, aliases) for k, v in kwargs.items()}
        inputs: list[tuple[str, torch.Tensor]] = []
        copies: dict[int, Any] | None = None  # one memo: objects shared by inputs stay shared
        for position, value in enumerate(args):
            role = _INPUT_ROLES[position] if position < 16 else f"input[{position}]"
            if isinstance(value, _Tensor):
                inputs.append((role, value))
            elif not isinstance(value, (int, float, bool, str, type(None))):
                inputs.extend((r, leaf) for r, leaf in iter_leaves(value, role)
                              if isinstance(leaf, _Tensor))
                if needs_copy(value):
                    if copies is None:
                        copies, args = {}, list(args)  # type: ignore[assignment]
                    args[position] = _held_copy(capture, role, value, copies)  # type: ignore[index]
        if copies is not None:
            args = tuple(args)
        if kwargs:
            for key, value in kwargs.items():
                if isinstance(value, _Tensor):
                    inputs.append(("kwarg:" + key, value))
                    continue
                inputs.extend((r, leaf) for r, leaf in iter_leaves(value, "kwarg:" + key)
                              if isinstance(leaf, _Tensor))
                if needs_copy(value):
                    if copies is None:
                        copies = {}
                    if kwargs is not capture.kwargs:
                        kwargs = capture.kwargs = dict(kwargs)
                    kwargs[key] = _held_copy(capture, "kwarg:" + key, value, copies)
        capture.args = args
        capture.kwargs = kwargs
        capture.inputs = inputs
        capture.input_versions = _input_versions([t for _, t in inputs])
        if capture.restored:  # a static KV cache: its lengths as the batch starts
            keep_lengths(capture.restored)

    def called_instead(self, batch: int, module: nn.Module) -> None:
        """The forward just held for ``batch`` was a call of ``module``, a module inside the
        model, not of the model (see :meth:`~nanwidget.core.recorder.Recorder.count_outside_calls`):
        a replay calls ``module`` with its inputs."""
        held = self.held.get(batch)
        if held is not None and held.forwards:
            held.forwards[-1].module = module

    def on_batch_end(self, batch: int, frames: list[Frame]) -> None:
        held = self.held.get(batch)
        if held is None or not held.forwards:
            return
        last = held.forwards[-1]
        if last.end_input_versions is None:
            inputs = last.inputs
            first = inputs[0][1] if len(inputs) == 1 else None
            if type(first) in _PLAIN:  # model(x), the usual call: _input_versions, in short
                try:
                    last.end_input_versions = [first._version]  # type: ignore[union-attr]
                except (AttributeError, RuntimeError):
                    last.end_input_versions = versions_of([first])  # type: ignore[list-item]
            else:
                last.end_input_versions = _input_versions([t for _, t in inputs])
            if self.slots.renormed_positions:
                weights = last.weights
                last.end_renormed_versions = [
                    -1 if weights[i] is None else version_of(weights[i])
                    for i in self.slots.renormed_positions]
            if self.slots.buffer_positions:
                weights = last.weights
                last.end_buffer_versions = [
                    -1 if weights[i] is None else version_of(weights[i])
                    for i in self.slots.buffer_positions]

    def on_event(self, event: NanEvent) -> None:
        if event.batch in self.held and len(self.event_batches) < MAX_EVENT_BATCHES:
            self.event_batches.add(event.batch)

    def await_backward(self, batch: int) -> None:
        """Hold ``batch`` until :meth:`backward_came` (at most the latest four: outputs whose
        backward never comes, an evaluation without no_grad(), let go in turn)."""
        awaiting = self.awaiting_backward
        if batch not in awaiting:
            awaiting.append(batch)
            if len(awaiting) > MAX_AWAITING_BACKWARD:
                del awaiting[0]

    def backward_came(self, batches: list[int]) -> None:
        """The backward pass through these batches' outputs ended: they are held as usual."""
        awaiting = self.awaiting_backward
        if len(batches) == 1 and awaiting == batches:  # the usual step
            awaiting.clear()
        else:
            self.awaiting_backward = [b for b in awaiting if b not in batches]

    def _evict_unpinned(self) -> None:
        """Past ``keep``: the oldest batches that neither an event, ``trace_batches`` nor a
        backward pass still to come pins go."""
        held = self.held
        awaiting = self.awaiting_backward
        recent = [b for b in held if b not in self.event_batches and b not in self.trace_batches
                  and b not in awaiting]
        for batch in recent[:max(0, len(recent) - self.keep)]:
            del held[batch]

    def _snapshot(self, weights: list) -> list[torch.Tensor | None]:
        """Copies of every parameter and buffer (tied ones once).

        Every batch copies everything: version counters cannot tell whether a tensor changed
        (BatchNorm's running statistics and writes through ``.data`` do not bump them).
        """
        copies: dict[int, torch.Tensor] = {}
        snapshot: list[torch.Tensor | None] = []
        with torch.no_grad():
            for tensor in weights:
                if tensor is None:
                    snapshot.append(None)
                    continue
                tensor = stood_for(tensor)  # an ExpandedWeight refuses .detach()
                copy = copies.get(id(tensor))
                if copy is None:
                    copy = copies[id(tensor)] = tensor.detach().clone()
                snapshot.append(copy)
        return snapshot

    def set_snapshots(self, enabled: bool) -> None:
        """Start or stop copying the weights at the start of each held batch."""
        self.snapshot_weights = bool(enabled)
        if not enabled:
            for held in self.held.values():
                for forward in held.forwards:
                    forward.snapshot = None

    # -- outside the hot path
    def held_batches(self) -> list[int]:
        """Batch numbers that can be replayed now."""
        return sorted(b for b, held in self.held.items() if held.forwards)

    def optimizer_steps(self) -> dict[int, int]:
        """Optimizer steps taken in this process when each held batch started, by batch (a
        step between two batches: the later one's number is larger)."""
        return {b: held.forwards[0].steps for b, held in self.held.items() if held.forwards}

    def steps_in_progress(self, batch: int) -> list[int]:
        """For each root forward of held ``batch``, the number of the optimizer step it ran
        inside (:func:`~nanwidget.core.writes.step_in_progress`: a closure the optimizer called,
        LBFGS's), 0 for a forward outside any step; empty when the batch is not held."""
        held = self.held.get(batch)
        return [capture.stepping for capture in held.forwards] if held is not None else []

    def held_inputs(self, batch: int) -> list[tuple[str, torch.Tensor]]:
        """The input tensors of ``batch``'s root forwards by role (``input[0]``,
        ``kwarg:mask`` ...), as they ran: those not changed in place since (a cache the model
        fills as it runs is left out, the data beside it kept); empty when the batch is not
        held. A batch run under a torch.func transform has its wrappers (a vmap's batched
        tensors): read them through :func:`~nanwidget.core.stats.vmapped_samples`."""
        held = self.held.get(batch_number(batch))
        if held is None or not held.forwards:
            return []
        return [pair for capture in held.forwards
                for pair in _inputs_as_they_ran(capture)]

    def _named_inputs(self, batch: int) -> list[tuple[str, Any]]:
        """(role, value) of each argument of ``batch``'s first root forward, as it was held;
        empty when the batch is not held."""
        held = self.held.get(batch)
        if held is None or not held.forwards:
            return []
        capture = held.forwards[0]
        return [(f"input[{i}]", value) for i, value in enumerate(capture.args)] + \
            [(f"kwarg:{key}", value) for key, value in capture.kwargs.items()]

    def sample_lists(self, batch: int) -> dict[str, int]:
        """The inputs of ``batch``'s root forward that are Python lists with one entry per
        sample, by role, with their length: lists of tensors (torchvision's detection models
        take a list of images) and lists of dicts of tensors (their per-image targets, DETR's
        labels); empty when the batch is not held."""
        return {role: len(value) for role, value in self._named_inputs(batch)
                if _per_sample_list(value)}

    def packed_sequences(self, batch: int) -> dict[str, Any]:
        """The inputs of ``batch``'s root forward that are PackedSequences, by role (their
        ``data`` is the leaf ``role[0]``); empty when the batch is not held."""
        return {role: value for role, value in self._named_inputs(batch)
                if isinstance(value, PackedSequence)}

    def buffers_written(self, batch: int) -> set[str]:
        """The buffers (by qualified name) that ``batch``'s root forwards wrote into (their
        version counters moved between its start and its end: BatchNorm's running
        statistics in training); empty when the batch is not held."""
        held = self.held.get(batch)
        if held is None or not held.forwards or held.forwards[-1].end_buffer_versions is None:
            return set()
        start, end = held.forwards[0].weight_versions, held.forwards[-1].end_buffer_versions
        names = self.slots.names
        written = {names[i] for i, after in zip(self.slots.buffer_positions, end)
                   if i < len(start) and i < len(names) and after != start[i]}
        # BatchNorm's kernel updates running_mean/var in place without a version bump; its
        # num_batches_tracked counter moves with them.
        for name in list(written):
            module, _, role = name.rpartition(".")
            if role == "num_batches_tracked":
                prefix = module + "." if module else ""
                written.update((prefix + "running_mean", prefix + "running_var"))
        return written

    def written_between_forwards(self, batch: int) -> dict[str, int]:
        """The weights written between two root forwards of ``batch`` (an optimizer step inside
        it: LBFGS's closure, SAM's two passes): name -> the last forward that started with
        them changed (a version counter moved, or the optimizer stepped)."""
        held = self.held.get(batch)
        if held is None or len(held.forwards) < 2:
            return {}
        names = self.slots.names
        written: dict[str, int] = {}
        for k in range(1, len(held.forwards)):
            before, after = held.forwards[k - 1], held.forwards[k]
            stepped = before.steps != after.steps
            for i, (then, now) in enumerate(zip(before.weight_versions, after.weight_versions)):
                if i < len(names) and (stepped or then != now):
                    written[names[i]] = k
        return written

    def versions_after(self, batch: int) -> dict[str, int]:
        """The version counters, when ``batch``'s last root forward ended, of the weights a
        forward writes in place itself (nn.Embedding(max_norm=...)); empty when not held."""
        held = self.held.get(batch)
        if held is None or not held.forwards or held.forwards[-1].end_renormed_versions is None:
            return {}
        names = self.slots.names
        return {names[i]: v for i, v in zip(self.slots.renormed_positions,
                                              held.forwards[-1].end_renormed_versions)}

    def replaced_between(self, first: int, second: int) -> set[str]:
        """The weights (by qualified name) whose slot held another tensor object when held batch
        ``second`` started than when held batch ``first`` did: a ``load_state_dict(...,
        assign=True)`` or ``module.weight = nn.Parameter(...)`` put a new tensor there (its
        version counter says nothing of the old one's). Empty when either is not held."""
        one, two = self.held.get(first), self.held.get(second)
        if one is None or two is None or not one.forwards or not two.forwards:
            return set()
        names = self.slots.names
        # A parameter's per-sample-gradient stand-in (ExpandedWeight), made anew for each
        # forward, is that parameter: no other tensor in its slot.
        return {names[i] for i, (then, now) in enumerate(zip(one.forwards[0].weights,
                                                             two.forwards[0].weights))
                if i < len(names) and then is not None and now is not None and then is not now
                and stood_for(then) is not stood_for(now)}

    def substituted_in(self, batch: int) -> set[str]:
        """The parameters (by qualified name) whose slot held a tensor that is no
        ``nn.Parameter`` in every root forward of held ``batch``: a stand-in that a stateless
        call put there for the forward (``torch.func.functional_call``, a meta-learning fast
        weight), as :meth:`Recorder.substituted` tells while the forward runs. Empty when the
        batch is not held."""
        held = self.held.get(batch)
        if held is None or not held.forwards:
            return set()
        slots = self.slots
        found: set[str] | None = None
        for capture in held.forwards:
            here = {slots.names[i] for i, tensor in enumerate(capture.weights)
                    if i < len(slots.names) and not slots.is_buffer[i]
                    and isinstance(tensor, torch.Tensor)
                    and not isinstance(stood_for(tensor), nn.Parameter)}
            found = here if found is None else found & here
        return found or set()

    def ran_with_grad(self, batch: int) -> bool | None:
        """Whether any root forward of held ``batch`` ran with gradients on (outside
        ``torch.no_grad()`` and ``torch.inference_mode()``); None when it is not held."""
        held = self.held.get(batch)
        if held is None or not held.forwards:
            return None
        return any(capture.grad_enabled for capture in held.forwards)

    def adapters_disabled(self, batch: int) -> bool | None:
        """Whether held ``batch`` ran with the model's peft-style adapters switched off (every
        root forward of it: ``with model.disable_adapter():``, the base model alone); None when
        the model has no adapters, the batch is not held, or its forwards differ."""
        held = self.held.get(batch)
        states = {capture.adapters_disabled for capture in held.forwards} if held else set()
        return states.pop() if len(states) == 1 else None

    def adapters_switched(self, batch: int) -> tuple[str, ...] | None:
        """The adapters active in every root forward of held ``batch`` (peft's
        ``set_adapter()``), when they were enabled and not those active when the model was
        watched (TRL's DPO runs its reference forward on a copy named "ref"); else None."""
        held = self.held.get(batch)
        if not held or self.watched_adapters is None:
            return None
        states = {(capture.adapters_disabled, tuple(capture.active_adapters or ()))
                  for capture in held.forwards}
        if len(states) != 1:
            return None
        disabled, active = states.pop()
        return active if disabled is False and active != self.watched_adapters else None

    def ran_in_train_mode(self, batch: int) -> bool | None:
        """Whether the model itself was in train mode (``model.train()``) in every root forward
        of held ``batch``; None when it is not held or its forwards differ."""
        held = self.held.get(batch)
        states = {bool(capture.training[0]) for capture in held.forwards
                  if capture.training} if held else set()
        return states.pop() if len(states) == 1 else None

    def held_weights(self, batch: int) -> list[tuple[str, int, torch.Tensor | None]]:
        """(name, version counter, copy or None) of every parameter and buffer when ``batch``
        started (copies with ``snapshot_weights``); empty when the batch is not held."""
        held = self.held.get(batch)
        if held is None or not held.forwards:
            return []
        first = held.forwards[0]
        copies = first.snapshot or [None] * len(first.weight_versions)
        return list(zip(self.slots.names, first.weight_versions, copies))

    def batch_to_replay(self, batch: int) -> HeldBatch:
        """The held batch, checked: raises a :class:`ReplayError` saying why it cannot run."""
        batch = batch_number(batch)
        held = self.held.get(batch)
        if held is None or not held.forwards:
            if self.ran_outside_root is not None and self.ran_outside_root(batch):
                raise BatchNotHeldError(
                    f"batch {batch} ran through another method than the watched model's forward "
                    "(peft's generate(), timm's forward_features(): its modules ran, the "
                    "model's own forward did not), so its inputs were not held: a replay runs "
                    "a forward again from the inputs it was called with. Call the model itself, "
                    "or watch the module that method calls (for peft: "
                    "nw.watch(model.base_model.model))")
            listed = ", ".join(map(str, self.held_batches())) or "none"
            raise BatchNotHeldError(
                f"batch {batch} is not held for replay; held batches: {listed}. A watch holds "
                f"the last keep_batches={self.keep} batches, its trace_batches and the batches "
                "of its first events; pass keep_batches=N or trace_batches=[...] to nw.watch() "
                "to hold others")
        if held.truncated:
            raise ReplayError(f"batch {batch} ran its root forward more than "
                              f"{MAX_FORWARDS_PER_BATCH} times; only the first ones were held, "
                              "so it cannot be replayed faithfully")
        for capture in held.forwards:
            if capture.uncopied:
                raise ReplayError(
                    f"cannot replay batch {batch}: its {capture.uncopied} could not be copied "
                    "when the batch ran, and a replay must not run the forward on your own "
                    "object (the forward may change it). Pass tensors, lists, dicts or objects "
                    "that copy.copy() can copy")
        _check_inputs(held, latest=max(self.held))
        if _transform_running():
            raise ReplayError(
                f"cannot replay batch {batch} now: a torch.func transform (grad, vjp, jacrev, "
                "hessian, vmap ...) is running, and a replay cannot run inside it. The batch is "
                f"held: call w.replay({batch}) once the transform has returned")
        return held


def _inputs_as_they_ran(capture: ForwardCapture) -> list[tuple[str, torch.Tensor]]:
    """``capture``'s input tensors not changed in place since it ran, and a static KV cache's
    keys and values as they were then (:func:`.static_cache.as_it_was`)."""
    kept = [pair for pair, version in zip(capture.inputs, capture.input_versions)
            if version_of(pair[1]) == version]
    if not capture.restored or len(kept) == len(capture.inputs):
        return kept
    restored = {id(tensor): (layer, name) for tensor, layer, name in capture.restored}
    result = []
    for pair, version in zip(capture.inputs, capture.input_versions):
        role, tensor = pair
        if version_of(tensor) == version:
            result.append(pair)
        elif id(tensor) in restored:
            then = as_it_was(*restored[id(tensor)])
            if then is not None:
                result.append((role, then))
    return result


def _per_sample_list(value: Any) -> bool:
    """Whether ``value`` is a list with one entry per sample: of tensors (two or more: ``[x]``
    is rather one batched tensor in a list), or of dicts holding tensors (a detection model's
    targets, one dict per image, also for a batch of one image)."""
    if type(value) is not list or not value:
        return False
    if all(isinstance(item, torch.Tensor) for item in value):
        return len(value) > 1
    return all(isinstance(item, dict) and any(isinstance(v, torch.Tensor) for v in item.values())
               for item in value)


def _transformed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a torch.func transform's wrapper (a vmap's batched tensor, a
    grad's tracked one): it escaped the transform with the batch's inputs."""
    try:
        return bool(torch._C._functorch.is_functorch_wrapped_tensor(tensor))
    except Exception:  # an older torch or an odd tensor: a plain one
        return False


def _transform_running() -> bool:
    """Whether a torch.func transform is running now (the replay was asked for from inside it:
    an event met within ``jacrev(...)``): its interpreter refuses what a replay does."""
    try:
        return torch._C._functorch.maybe_current_level() is not None
    except Exception:  # an older torch: none can be told
        return False


def _static_cache_rewritten(held: HeldBatch, latest: int) -> str:
    """Why a static KV cache a batch read cannot be restored for its replay (see
    :mod:`.static_cache`): ``reset()`` or a crop after the batch rewrote the positions it read
    (below its length then), which no later forward writes. Told by the length's version
    counter: each forward moves it once, so more moves than forwards since mean another write;
    or by a length now below the batch's. "" when it can be restored."""
    for position, capture in enumerate(held.forwards):
        if not capture.restored:
            continue
        index = {id(tensor): k for k, (_, tensor) in enumerate(capture.inputs)}
        # This forward, the batch's later ones, and (at least) one per later batch.
        forwards = len(held.forwards) - position + max(latest - held.batch, 0)
        for tensor, layer, name in capture.restored:
            k = index.get(id(tensor))
            if name != "cumulative_length" or k is None:
                continue
            then = int(layer.cumulative_length)
            if then == 0:
                continue  # the batch read none of the cache: nothing to restore
            role = capture.inputs[k][0]
            moved = version_of(tensor) - capture.input_versions[k]
            if moved > forwards or int(tensor) < then:
                return (f"cannot replay batch {held.batch}: the static KV cache it read "
                        f"({role.rpartition('.')[0]}) was reset or cropped since (its "
                        f"cumulative_length was written {moved} times by {forwards} forwards), "
                        f"so the keys and values it read below position {then} are gone. Run "
                        "the same tokens again (without the cache, or in a new one) and replay "
                        "that batch")
    return ""


def _check_inputs(held: HeldBatch, latest: int) -> None:
    reason = _static_cache_rewritten(held, latest)
    if reason:
        error = InputModifiedError(reason)
        error.by_model, error.reason = False, reason
        raise error
    for capture in held.forwards:
        for role, tensor in capture.inputs:
            if _transformed(tensor):
                raise ReplayError(
                    f"cannot replay batch {held.batch}: it ran inside a torch.func transform "
                    f"(vmap, grad, jacrev ...), and its {role} is that transform's own tensor, "
                    "which cannot be used outside it. Run the plain batch through the model "
                    "(model(x)) to replay it")
        restored = {id(tensor) for tensor, _, _ in capture.restored}
        for k, ((role, tensor), version) in enumerate(zip(capture.inputs, capture.input_versions)):
            now = version_of(tensor)
            if now == version or id(tensor) in restored:
                continue
            # The forward's own write tells, whatever came after it: a static KV cache that
            # generate() fills again at every later step has moved on since the batch ended.
            end = (capture.end_input_versions[k] if capture.end_input_versions is not None
                   else version)
            during = end != version
            when = ("after the batch ran (e.g. by the training loop)" if not during
                    else "by the model's own forward while the batch ran" if end == now
                    else "by the model's own forward while the batch ran, and again after it")
            if during:
                # The model writes it itself (a static KV cache it fills at every step): a
                # copy made by the caller would be written the same way.
                advice = ("The model writes this input as it runs, so a copy would be written "
                          "too: watch in full mode, whose frames are recorded as the batch runs "
                          "and need no replay; for a cache the model fills in place at every "
                          "step (a static KV cache, Mamba's conv and SSM states), run the same "
                          "tokens again without it (model(input_ids, use_cache=False)) and "
                          "replay that batch, or use transformers' default DynamicCache, not "
                          "written in place")
            else:
                advice = ("Give each batch its own tensor, or clone() it before changing it in "
                          "place")
            reason = (f"cannot replay batch {held.batch}: its {role} "
                      f"({str(tensor.dtype).replace('torch.', '')} {tuple(tensor.shape)}) was "
                      f"modified in place {when} (version {version} -> {now}), so a replay "
                      "would run on different data")
            error = InputModifiedError(f"{reason}. {advice}")
            error.by_model, error.reason = during, reason
            raise error

"""The op tracer of a replay: module frames through the watch's own entry builder, and one row
per aten op measured under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`."""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..entries import Entry, EntryBuilder
from ..frames import Frame
from ..recorder import ModuleInfo
from ..sourcelines import user_source
from ..stats import PendingStats, classify, measure_tensor, version_of
from .shadows import Shadows, mutated_arguments, tensors_in

__all__ = ["OpRecorder", "OpTracer"]

_NODE_KEY = "nanwidget_op"  # autograd node metadata: (module, module_type, source) of its forward op
_Tensor = torch.Tensor
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)

# Ops left out of the op table: their output is uninitialised memory (measuring it would report
# garbage as a NaN), or holds exactly the values of their input (nothing new can go wrong there;
# views are left out through ``func.is_view``).
_UNMEASURED_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                             "empty_permuted", "resize_", "set_", "_unsafe_view", "clone",
                             "contiguous", "alias", "lift_fresh", "lift_fresh_copy"})


class OpRecorder:
    """Module frames and op rows of one replay.

    Frames are built by an :class:`EntryBuilder` over a :class:`PendingStats` of the replay's
    own, exactly as the live watch builds them, and resolved when the replay ends.
    """

    def __init__(self, infos: dict[int, ModuleInfo], batch: int, rank: int,
                 names: dict[int, tuple[str, str]]) -> None:
        self.batch = batch
        self.rank = rank
        self.infos = infos
        self.names = names
        self.stack: list[tuple[str, str]] = []
        self.pending = PendingStats()
        self.op_pending = PendingStats()  # op outputs: measured and read back op by op
        self.entries = EntryBuilder(self.pending, cache_weights=False)
        self.frames: list[Frame] = []
        self.calls: dict[int, int] = {}
        self.rows: list[tuple] = []
        self.phase = "forward"
        self.paused = False
        self.to_tag: list[tuple[list[torch.Tensor], tuple[str, str, str]]] = []
        # The first op that made a NaN/Inf from finite inputs, with its tensors described; the
        # first op whose output holds a NaN, and an Inf.
        self.first_born: tuple[int, list[dict]] | None = None
        self.first_nan: int | None = None
        self.first_inf: int | None = None
        # id -> (weak reference, version, holds a NaN, holds an Inf) of tensors measured here.
        self.known: dict[int, tuple[Any, int, bool, bool]] = {}
        self.shadows: Shadows | None = None
        # Input entries an in-place module's pre-hook measured before it overwrote them.
        self.measured_inputs: dict[int, list[list[Entry]]] = {}

    # -- module hooks
    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.stack.append(self.names.get(id(module), ("?", type(module).__name__)))
        info = self.infos.get(id(module))
        # As the live watch: the root's and in-place modules' inputs as handed over.
        if info is not None and (info.is_root or getattr(module, "inplace", False) is True):
            entries: list[Entry] = []
            self.paused = True  # measuring is not one of the model's ops
            try:
                self.entries.input_entries(args, kwargs, entries)
            finally:
                self.paused = False
            self.measured_inputs.setdefault(id(module), []).append(entries)

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.stack:
            self.stack.pop()
        info = self.infos.get(id(module))
        if info is None:
            return
        measured = self.measured_inputs.get(id(module))
        self.paused = True
        try:
            entries, first_input, first_output = self.entries.forward_entries(
                module, info.has_state, args, kwargs, output, measured.pop() if measured else None)
        finally:
            self.paused = False
        self.record_frame(info, "forward", entries, first_output=first_output,
                          first_input=first_input)

    def record_frame(self, info: ModuleInfo, phase: str, entries: list[Entry],
                     batch: int | None = None, first_output: int | None = None,
                     first_input: int = 0) -> Frame:
        """Append a frame for ``info``'s module (call numbers count per module and phase)."""
        key = info.index if phase == "forward" else ~info.index
        call = self.calls.get(key, 0)
        self.calls[key] = call + 1
        frame = Frame(self.rank, self.batch, len(self.frames), info.name, info.type_name, call,
                      phase, entries, first_output, first_input)
        self.frames.append(frame)
        return frame

    def resolve(self) -> None:
        """Measure the frames' queued tensors (after the replay ran, outside the tracer)."""
        self.pending.resolve()

    # -- ops
    def tag_nodes(self) -> None:
        """Label the autograd nodes of the last forward op, so its backward ops find their module."""
        for tensors, tag in self.to_tag:
            for tensor in tensors:
                node = tensor.grad_fn
                if node is not None:
                    metadata = node.metadata
                    if _NODE_KEY not in metadata:
                        metadata[_NODE_KEY] = tag
        self.to_tag = []

    def before_op(self, func: Any, args: tuple, kwargs: dict) -> None:
        if self.to_tag:
            self.tag_nodes()
        shadows = self.shadows
        if shadows is not None and shadows.protected:
            positions, names = mutated_arguments(func)
            if positions:
                for position in positions:
                    if position < len(args):
                        for tensor in tensors_in(args[position]):
                            shadows.before_write(tensor)
                for name in names:
                    for tensor in tensors_in(kwargs.get(name)):
                        shadows.before_write(tensor)

    def after_op(self, func: Any, args: tuple, kwargs: dict, output: Any, caller: Any) -> None:
        node = _current_autograd_node()
        if node is not None:
            phase = "backward"
            tag = node.metadata.get(_NODE_KEY)
            module, module_type, forward_source = tag if tag else ("", "", "")
            source = user_source(caller) or forward_source
        else:
            phase = self.phase
            module, module_type = self.stack[-1] if self.stack else ("", "")
            source = user_source(caller)
        tensors = tensors_in(output)
        if node is None and tensors:
            self.to_tag.append((tensors, (module, module_type, source)))
        name = func.overloadpacket.__name__
        if name in _UNMEASURED_OPS or func.is_view:
            return  # nothing computed (views, detach) or nothing defined (empty) to measure
        measurable = [t for t in tensors if not classify(t)]
        low = high = math.nan
        nan = inf = False
        if measurable:
            measured = [measure_tensor(t, self.op_pending) for t in measurable]
            for tensor, stats in zip(measurable, measured):
                if not stats.note:
                    self._remember(tensor, stats.nan, stats.inf)
            measured = [m for m in measured if not m.note]
            if measured:
                nan = any(m.nan for m in measured)
                inf = any(m.inf for m in measured)
                if not nan:
                    low = min(m.abs_min for m in measured)
                    high = max(m.abs_max for m in measured)
        first = tensors[0] if tensors else None
        index = len(self.rows)
        self.rows.append((index, phase, name, str(func), module, module_type,
                          str(first.dtype).replace("torch.", "") if first is not None else "",
                          tuple(first.shape) if first is not None else (),
                          low, high, nan, inf, nan or inf, source))
        if (nan or inf) and self.first_born is None and self._born_here(func, args, kwargs, nan):
            self.first_born = (index, describe_op_tensors(func, args, kwargs, measurable))
        if nan and self.first_nan is None:
            self.first_nan = index
        elif inf and self.first_inf is None:
            self.first_inf = index

    def _remember(self, tensor: torch.Tensor, nan: bool, inf: bool) -> None:
        try:
            self.known[id(tensor)] = (weakref.ref(tensor), version_of(tensor), nan, inf)
        except TypeError:
            pass

    def _input_flags(self, tensor: torch.Tensor) -> tuple[bool, bool]:
        """(holds a NaN, holds an Inf) of an op's input: known when an earlier op of this replay
        made it, else measured now (weights, data, views of earlier results)."""
        known = self.known.get(id(tensor))
        if known is not None and known[0]() is tensor and known[1] == version_of(tensor):
            return known[2], known[3]
        if classify(tensor):
            return False, False
        stats = measure_tensor(tensor, self.op_pending)
        self._remember(tensor, stats.nan, stats.inf)
        return stats.nan, stats.inf

    def _born_here(self, func: Any, args: tuple, kwargs: dict, nan: bool) -> bool:
        """Whether this op made the non-finite value: a NaN from inputs without NaN (an Inf
        turning into NaN counts: softmax of a fully masked row), or an Inf from finite inputs
        (an overflow). An Inf written on purpose (a literal ±inf argument such as
        ``masked_fill(mask, -inf)`` or ``full(size, -inf)``) is not born here."""
        if not nan and _writes_literal_inf(args, kwargs):
            return False
        for value in list(args) + list(kwargs.values()):
            for tensor in tensors_in(value):
                input_nan, input_inf = self._input_flags(tensor)
                if input_nan or (input_inf and not nan):
                    return False
        return True


def _writes_literal_inf(args: tuple, kwargs: dict) -> bool:
    """Whether an op got ±inf as a plain number (not through a tensor)."""
    for value in list(args) + list(kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, float) and item in (math.inf, -math.inf):
                return True
    return False


def _describe(role: str, tensor: torch.Tensor) -> dict:
    """Signed finite range and non-finite counts of one tensor (the first bad op's report)."""
    info = {"role": role, "dtype": str(tensor.dtype).replace("torch.", ""),
            "shape": tuple(tensor.shape), "numel": tensor.numel(), "min": math.nan,
            "max": math.nan, "nan_count": 0, "inf_count": 0}
    if tensor.numel() == 0 or tensor.is_complex() or tensor.dtype is torch.bool:
        return info
    try:
        with torch.no_grad():
            values = tensor.detach()
            if values.is_floating_point():
                nan_mask, inf_mask = torch.isnan(values), torch.isinf(values)
                finite = values[~(nan_mask | inf_mask)]
                low = finite.min().double() if finite.numel() else torch.tensor(math.nan)
                high = finite.max().double() if finite.numel() else torch.tensor(math.nan)
                numbers = torch.stack((low.cpu(), high.cpu(), nan_mask.sum().double().cpu(),
                                       inf_mask.sum().double().cpu())).tolist()
            else:
                numbers = [float(values.min()), float(values.max()), 0, 0]
        info.update(min=numbers[0], max=numbers[1], nan_count=int(numbers[2]),
                    inf_count=int(numbers[3]))
    except Exception:
        pass
    return info


def describe_op_tensors(func: Any, args: tuple, kwargs: dict, outputs: list[torch.Tensor]) -> list[dict]:
    """Signed ranges and non-finite counts of the first bad op's inputs and outputs."""
    try:
        names = [a.name for a in func._schema.arguments]
    except AttributeError:
        names = []
    described = []
    for position, value in enumerate(args):
        name = names[position] if position < len(names) else f"arg{position}"
        tensors = tensors_in(value)
        for k, tensor in enumerate(tensors):
            described.append(_describe(f"input {name}" + (f"[{k}]" if len(tensors) > 1 else ""), tensor))
    for name, value in kwargs.items():
        for tensor in tensors_in(value):
            described.append(_describe(f"input {name}", tensor))
    for k, tensor in enumerate(outputs):
        described.append(_describe("output" + (f"[{k}]" if len(outputs) > 1 else ""), tensor))
    return described


class OpTracer(TorchDispatchMode):
    """Measures every aten op the replay runs."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Recent torch wraps __torch_dispatch__ in a dynamo guard whose first call imports
        # torch._dynamo (seconds). A replay never runs under torch.compile: no guard needed.
        return False

    def __init__(self, recorder: OpRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        recorder = self.recorder
        if recorder.paused:
            return func(*args, **kwargs)
        recorder.before_op(func, args, kwargs)
        output = func(*args, **kwargs)
        recorder.after_op(func, args, kwargs, output, sys._getframe(1))
        return output

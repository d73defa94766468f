"""The op tracer of a replay: module frames through the watch's own entry builder, and one row
per aten op measured under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`.

Lineage: every op whose output holds a NaN/Inf records which of its inputs brought one (the
op that last wrote a non-finite value into that input's storage) or that none did (it was
born there). Walking back from the event's tensor through those records finds the op where
the value that reached the event was born, and leaves alone the intended ±inf that never
reach it (masks, T5's relative-position buckets). Only non-finite ops pay for it: storage
pointers and small tuples, read from measurements the tracer makes anyway.
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..entries import Entry, EntryBuilder, nested_shape
from ..frames import Frame
from ..recorder import ModuleInfo
from ..schema import OP_ROWS_DESCRIBED, is_input_role, masks_rows
from ..sourcelines import python_backward_source, user_source
from ..stats import (PendingStats, TensorStats, classify, measure_tensor, nested_values,
                     version_of, widen_float8)
from .shadows import Shadows, mutated_arguments, tensors_in

__all__ = ["OpRecorder", "OpTracer", "Lineage", "storage_key"]

_NODE_KEY = "nanwidget_op"  # autograd node metadata: (module, module_type, source) of its forward op
_Tensor = torch.Tensor
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)

# Ops left out of the op table: their output is uninitialised memory (measuring it would report
# garbage as a NaN), or holds exactly the values of their input (nothing new can go wrong there;
# views are left out through ``func.is_view``).
_UNMEASURED_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                             "empty_permuted", "resize_", "set_", "_unsafe_view", "clone",
                             "contiguous", "alias", "lift_fresh", "lift_fresh_copy"})
# Among them: ops whose output is a copy of their first input in a new storage (its lineage
# carries over), and ops that allocate a new storage (nothing written there yet).
_COPY_OPS = frozenset({"clone", "contiguous", "lift_fresh_copy"})
# In-place ops whose domain the diagnosis checks on their inputs: an in-place op's input is its
# output once it ran, so these are described before they run (only these: replays stay fast).
_DOMAIN_IN_PLACE = frozenset({"pow_", "sqrt_", "rsqrt_", "log_", "log2_", "log10_", "log1p_",
                              "div_", "true_divide_", "reciprocal_", "remainder_", "fmod_",
                              "floor_divide_", "acos_", "asin_", "atanh_", "acosh_", "erfinv_",
                              "logit_"})
# In-place ops that replace what they write without reading it: its values before say nothing
# of their output. Every other in-place op reads its ``self`` first (add_, scatter_add_, mul_).
_OVERWRITING_IN_PLACE = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "random_",
                                   "bernoulli_", "exponential_", "geometric_", "cauchy_",
                                   "log_normal_", "set_", "resize_", "resize_as_"})
_FRESH_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                        "empty_permuted"})
# Ops computing beta * input + alpha * (a product): with beta=0 the input is not read (torch
# ignores its NaN and Inf; diffusers' attention passes uninitialised torch.empty there).
_SCALED_ACCUMULATE = frozenset({"addmm", "addbmm", "baddbmm", "addmv", "addr"})
# Births' tensors held (by reference) to describe the chosen one once the replay ran; past
# this many bytes a birth is described at once (a host sync) instead.
_HELD_BIRTH_BYTES = 64 << 20


# Ops that pick rows by index (x[idx], x[mask], index_select: the tokens a router sends one
# expert): dim 0 of what they make, and of what is made from it, is no longer the batch's
# samples, until an op puts the rows back in place into a tensor that kept them.
_GATHER_OPS = frozenset({"index", "index_select", "masked_select", "take", "gather"})
_SCATTER_OPS = frozenset({"index_add", "index_copy", "index_put", "_index_put_impl", "scatter",
                          "scatter_add", "scatter_reduce", "index_reduce", "masked_scatter",
                          "index_fill", "masked_fill", "put"})


def _picks_rows(name: str, args: tuple) -> bool:
    """Whether gather op ``name`` picks or reorders its input's leading rows (dims of size 1
    before the indexed one count as none): not every row in order, an index that is the
    identity (``logits[torch.arange(n), labels]`` keeps the samples), nor a column pick."""
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor):
        return False
    if name in ("masked_select", "take"):
        return True
    if name == "index":
        indices = list(args[1]) if len(args) > 1 else []
        dim = next((d for d, i in enumerate(indices) if i is not None), None)
        index = indices[dim] if dim is not None else None
    else:  # index_select / gather (input, dim, index)
        dim = args[1] if len(args) > 2 and isinstance(args[1], int) else None
        index = args[2] if len(args) > 2 else None
    if dim is None or not isinstance(index, torch.Tensor) or dim < 0:
        return False
    if any(size != 1 for size in source.shape[:dim]):
        return False  # a column or position pick: the rows stay the samples
    if name == "index" and index.dim() > 1 and index.dtype != torch.bool:
        return False  # a lookup (a table indexed by ids of shape batch x positions)
    size = source.shape[dim] if dim < source.dim() else 0
    try:
        with torch.no_grad():
            if index.dtype == torch.bool:
                return not (index.dim() == 1 and bool(index.all()))
            flat = index if index.dim() == 1 else index.flatten() if name != "gather" \
                else index.select(1, 0) if index.dim() > 1 else index
            return not (flat.numel() == size and torch.equal(
                flat.cpu(), torch.arange(size, dtype=flat.dtype)))
    except Exception:  # a subclass or layout that refuses: say picked (rows then go unnamed)
        return True


def storage_key(tensor: torch.Tensor) -> int | None:
    """The address of a tensor's storage: the same for every view of it; None without one."""
    try:
        if tensor.layout is torch.sparse_coo:  # no storage of its own: its values' storage
            tensor = tensor._values()
        elif tensor.layout is not torch.strided and tensor.is_sparse_csr:
            tensor = tensor.values()
        elif tensor.is_nested and tensor.layout is torch.jagged:  # its values' storage
            tensor = tensor.values()
        key = tensor.untyped_storage().data_ptr()
    except Exception:  # tensor subclasses without a storage
        return None
    return key or None  # 0: an empty storage, shared by all of them


def _covers_storage(tensor: torch.Tensor) -> bool:
    """Whether the tensor spans its whole storage (so its values are all the storage holds)."""
    try:
        return tensor.storage_offset() == 0 and \
            tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
    except Exception:
        return False



def _held_by(leaf: Any, depth: int = 4) -> list[torch.Tensor]:
    """``leaf`` if it is a tensor; the tensors a ``torch.distributions`` Distribution or
    Transform holds (its parameters, its component and base distributions, cached lazy
    properties), ``depth`` levels of them deep; nothing for anything else."""
    if isinstance(leaf, _Tensor):
        return [leaf]
    if depth <= 0 or not isinstance(leaf, (torch.distributions.Distribution,
                                           torch.distributions.Transform)):
        return []
    held: list[torch.Tensor] = []
    for value in vars(leaf).values():
        values = value if isinstance(value, (list, tuple)) else (value,)
        for item in values:
            held.extend(_held_by(item, depth - 1))
    return held

class _FramePending(PendingStats):
    """The frames' stats, each remembered with the storage of the tensor it was measured on and
    the op that had last written a NaN/Inf there (so an event's tensor can be followed back)."""

    __slots__ = ("on_add",)

    def add(self, tensor: torch.Tensor, hold: bool = True,
            check_storage: bool = True) -> TensorStats:
        stats = super().add(tensor, hold, check_storage)
        self.on_add(tensor, stats)
        return stats


class Lineage:
    """Where the non-finite value that reached a tensor came from.

    ``born``: the op index where it was born (finite inputs, non-finite output), or None.
    ``path``: op indices from the birth (or the first op that read a non-finite weight or
    input) to the op that wrote the tensor. ``came_with``: ``(kind, name)`` of the non-finite
    tensors no traced op made that flowed into it: kind "weight" (a parameter or buffer),
    "input" (the batch's inputs), "output-grad" (the gradient reaching the model's output) or
    "unknown". ``reached``: every op the value flowed through, and the ops whose Inf an op
    turned into NaN. ``followed``: whether the tensor could be followed at all.
    ``inf_came_with``: for a birth that made NaN of Infs no traced op made (inf - inf of a
    tensor computed before ``loss_fn`` ran), ``(kind, name)`` of the tensors they came with.
    """

    __slots__ = ("born", "path", "came_with", "reached", "followed", "inf_came_with")

    def __init__(self, born: int | None = None, path: list[int] | None = None,
                 came_with: list[tuple[str, str]] | None = None, reached: set[int] | None = None,
                 followed: bool = False,
                 inf_came_with: list[tuple[str, str]] | None = None) -> None:
        self.born = born
        self.path = path or []
        self.came_with = came_with or []
        self.reached = reached or set()
        self.followed = followed
        self.inf_came_with = inf_came_with or []


class _BeforeWrite:
    """The range of the tensor an in-place op is about to write, as the op reads it: once it
    ran, that tensor holds the op's output (an Inf it made there is no Inf it was given).
    Left on its device (no host sync) and read only when the op made a NaN/Inf."""

    __slots__ = ("func", "target", "range", "_read")

    def __init__(self, func: Any, target: torch.Tensor, low_high: torch.Tensor) -> None:
        self.func = func
        self.target = target
        self.range = low_high
        self._read: tuple[float, float] | None = None

    def read(self) -> tuple[float, float]:
        """(min, max) of the values before the write: NaN when one was NaN, ±inf for an Inf."""
        if self._read is None:
            low, high = self.range.double().tolist()
            self._read = (low, high)
        return self._read

    def nonfinite(self) -> tuple[bool, bool]:
        """(held a NaN, held an Inf) before the write. With a NaN the range cannot tell an Inf:
        not claimed."""
        low, high = self.read()
        if low != low or high != high:
            return True, False
        return False, math.isinf(low) or math.isinf(high)


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
        self.running: list[nn.Module] = []  # the modules of ``stack``
        # Modules whose own weights were on the meta device when their call began (accelerate's
        # offloading loads them inside the forward and puts them back after it), and, for each
        # running one, the weights seen loaded: (their ids, their entries).
        self.offloaded: set[int] = set()
        self.swapped_in: dict[int, tuple[set[int], dict[str, Entry]]] = {}
        self.pending = _FramePending()
        self.pending.on_add = self._frame_tensor
        self.op_pending = PendingStats()  # op outputs: measured and read back op by op
        self.entries = EntryBuilder(self.pending, cache_weights=False)
        self.frames: list[Frame] = []
        self.calls: dict[int, int] = {}
        self.rows: list[tuple] = []
        self.phase = "forward"
        # Module calls running now during the backward phase: recomputations of checkpointed
        # modules (torch.utils.checkpoint), which the live watch does not record again either.
        self.recomputing = 0
        self.paused = False
        self.to_tag: list[tuple[list[torch.Tensor], tuple[str, str, str]]] = []
        # The first op whose output holds a NaN, and an Inf.
        self.first_nan: int | None = None
        self.first_inf: int | None = None
        # id -> (weak reference, version, holds a NaN, holds an Inf) of tensors measured here.
        self.known: dict[int, tuple[Any, int, bool, bool]] = {}
        # Lineage. Storage -> the op that last wrote a NaN/Inf into it; per non-finite op: the
        # ops whose output brought the NaN/Inf in, the storages no traced op wrote that brought
        # it in, the same two for the Infs it turned into NaN, and whether it wrote a literal ±inf.
        self.bad_writer: dict[int, int] = {}
        self.links: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...],
                                    tuple[int, ...], bool]] = {}
        # Weights' and data's storages, measured whole: storage -> (version, NaN, Inf).
        self.storage_flags: dict[int, tuple[int, bool, bool]] = {}
        # Births' tensors, described when chosen: op index -> described now, or what to describe.
        self.births: dict[int, list[dict] | tuple] = {}
        # (op, its inputs described) of a domain op about to run in place (before_op).
        self.before_in_place: tuple[Any, list[dict]] | None = None
        # The range of the tensor an in-place op is about to write (before_op).
        self.before_write: _BeforeWrite | None = None
        self.held_bytes = 0
        # Frame stats -> (storage, the op that had last written a NaN/Inf there) when measured.
        self.frame_tensors: dict[int, tuple[int | None, int | None]] = {}
        # Storage -> (kind, name) of tensors no op makes: parameters, buffers, the batch's inputs.
        self.source_names: dict[int, tuple[str, str]] = {}
        # Non-finite backward ops -> the autograd node that ran them.
        self.grad_nodes: dict[int, str] = {}
        # Where the loss's non-finite value was written (a replay with loss_fn), if it was.
        self.loss_writer: int | None = None
        self.shadows: Shadows | None = None
        # Input entries an in-place module's pre-hook measured before it overwrote them.
        self.measured_inputs: dict[int, list[list[Entry]]] = {}
        # loss_fn's data flow from the model's output: the storages of the output and of what
        # loss_fn's ops made from it, and the loss ops (by index) that read one of them. A loss
        # op reading none computed only from the targets (or other tensors loss_fn holds).
        self.from_output: set[int] = set()
        self.read_output: set[int] = set()
        # Storages of tensors whose rows a gather picked (an expert's routed tokens), and the
        # ops (by index) that made one: their dim 0 is not the batch's samples.
        self.picked_rows: set[int] = set()
        self.picked_ops: set[int] = set()

    # -- module hooks
    def enter_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The module's first pre-hook: its call begins, so that the ops of the user's own
        pre-hooks (the old weight_norm's, prune's) are named after it (:meth:`post_hook`, an
        always-called hook, ends it)."""
        if self.running and self.offloaded:
            self._weights_swapped_in(self.running[-1])  # its weights, handed to this child
        self.stack.append(self.names.get(id(module), ("?", type(module).__name__)))
        self.running.append(module)
        info = self.infos.get(id(module))
        if info is not None and info.has_state and self.phase == "forward" \
                and any(t is not None and t.is_meta for group in
                        (info.weights._parameters, info.weights._buffers) for t in group.values()):
            self.offloaded.add(id(module))
        if self.phase == "backward":
            self.recomputing += 1  # its ops are named after it; no second forward frame

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The module's last pre-hook: its inputs as the forward gets them."""
        if self.phase == "backward":
            return
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
        if self.running:
            self.running.pop()
        swapped = self.swapped_in.pop(id(module), None)
        if self.recomputing:
            self.recomputing -= 1
            return
        if self.picked_rows:
            self._rows_back_in_place(args, kwargs, output)
        info = self.infos.get(id(module))
        if info is None:
            return
        measured = self.measured_inputs.get(id(module))
        self.paused = True
        try:
            entries, first_input, first_output = self.entries.forward_entries(
                info.weights, info.has_state, args, kwargs, output,
                measured.pop() if measured else None)
        finally:
            self.paused = False
        if swapped is not None:  # the weights its forward loaded, not the meta ones left
            loaded = swapped[1]
            entries[:first_input] = [loaded.get(entry.role, entry) if entry.note == "meta"
                                     else entry for entry in entries[:first_input]]
        self.record_frame(info, "forward", entries, first_output=first_output,
                          first_input=first_input)

    def _weights_swapped_in(self, module: nn.Module) -> None:
        """Measure and name the weights a module whose weights are on the meta device between
        calls (accelerate's ``cpu_offload``, ``disk_offload``, ``device_map`` with offloading)
        has loaded inside its forward: its frame shows them rather than the meta tensors left
        after it, and the lineage calls a NaN/Inf in one that weight's, not a tensor made
        outside the replay (nor the copy that loaded it, made from a file)."""
        key = id(module)
        if key not in self.offloaded:
            return
        info = self.infos[key]
        holder = info.weights
        loaded = [(name, tensor) for group in (holder._parameters, holder._buffers)
                  for name, tensor in group.items() if tensor is not None and not tensor.is_meta]
        seen = self.swapped_in.get(key)
        if not loaded or (seen is not None and all(id(t) in seen[0] for _, t in loaded)):
            return
        paused, self.paused = self.paused, True
        try:
            entries: list[Entry] = []
            self.entries.weight_entries(holder, entries, cache_weights=False)
        finally:
            self.paused = paused
        if seen is None:  # kept also once put back to meta (the last ops of its forward)
            seen = self.swapped_in[key] = (set(), {})
        seen[0].update(id(tensor) for _, tensor in loaded)
        seen[1].update((entry.role, entry) for entry in entries if entry.note != "meta")
        prefix = f"{info.name}." if info.name else ""
        for name, tensor in loaded:
            storage = storage_key(tensor)
            if storage is not None:
                self.source_names[storage] = ("weight", prefix + name)
                self.bad_writer.pop(storage, None)

    def record_frame(self, info: ModuleInfo, phase: str, entries: list[Entry],
                     batch: int | None = None, first_output: int | None = None,
                     first_input: int = 0, call: int | None = None) -> Frame:
        """Append a frame for ``info``'s module (call numbers count per module and phase,
        unless ``call`` says it: a backward frame's forward call)."""
        key = info.index if phase == "forward" else ~info.index
        counted = self.calls.get(key, 0)
        self.calls[key] = counted + 1
        if call is None:
            call = counted
        frame = Frame(self.rank, self.batch, len(self.frames), info.name, info.type_name, call,
                      phase, entries, first_output, first_input)
        self.frames.append(frame)
        return frame

    def forward_calls(self, info: ModuleInfo) -> int | None:
        """Forward frames of ``info``'s module recorded so far in this replay; None during its
        backward (a recomputation records no frames)."""
        if self.phase == "backward":
            return None
        return self.calls.get(info.index, 0)

    def resolve(self) -> None:
        """Measure the frames' queued tensors (after the replay ran, outside the tracer)."""
        self.pending.resolve()

    # -- ops
    def tag_nodes(self) -> None:
        """Label the autograd nodes of the last forward op, so its backward ops find their module."""
        for tensors, tag in self.to_tag:
            for tensor in tensors:
                try:
                    node = tensor.grad_fn
                except RuntimeError:
                    # A view made under no_grad whose base was then written in place with grad
                    # on (FSDP1's parameter views): autograd refuses to say. It cannot be
                    # differentiated through either, so there is no node to label.
                    continue
                if node is not None:
                    metadata = node.metadata
                    if _NODE_KEY not in metadata:
                        metadata[_NODE_KEY] = tag
        self.to_tag = []

    def before_op(self, func: Any, args: tuple, kwargs: dict) -> None:
        if self.to_tag:
            self.tag_nodes()
        if self.offloaded and self.running:
            self._weights_swapped_in(self.running[-1])
        name = func.overloadpacket.__name__
        if name[-1:] == "_" and name not in _OVERWRITING_IN_PLACE:
            self.before_write = self._range_before_write(func, args)
        if name in _DOMAIN_IN_PLACE:
            self.before_in_place = (func, self._describe_paused(func, args, kwargs, []))
        shadows = self.shadows
        if shadows is not None and shadows.protected:
            save_before_write(shadows, func, args, kwargs)

    def _range_before_write(self, func: Any, args: tuple) -> _BeforeWrite | None:
        """The range of the float tensor in-place op ``func`` reads and then writes (its
        ``self``), measured on its device: one reduction, no host sync."""
        target = args[0] if args else None
        if not isinstance(target, _Tensor) or 0 not in mutated_arguments(func)[0] \
                or not target.is_floating_point() or classify(target):
            return None
        paused, self.paused = self.paused, True
        try:
            with torch.no_grad():
                low, high = torch.aminmax(widen_float8(target.detach()))
                return _BeforeWrite(func, target, torch.stack((low, high)))
        except Exception:  # nested, sparse or subclass tensors: described after the write
            return None
        finally:
            self.paused = paused

    def after_op(self, func: Any, args: tuple, kwargs: dict, output: Any, caller: Any) -> None:
        before, self.before_write = self.before_write, None
        if before is not None and before.func is not func:
            before = None
        node = _current_autograd_node()
        if node is not None and self.recomputing:
            # A checkpointed module recomputed within the backward pass: its ops belong to it,
            # and so do the autograd nodes they make (reentrant checkpointing runs its backward
            # through those nodes).
            phase = "backward"
            module, module_type = self.stack[-1]
            source = user_source(caller)
            node = None
        elif node is not None:
            phase = "backward"
            tag = node.metadata.get(_NODE_KEY)
            module, module_type, forward_source = tag if tag else ("", "", "")
            # The line of the op whose gradient this is; a line in user Python only when it ran
            # the op itself (not the line calling torch.autograd.grad in a PINN's forward).
            source = python_backward_source(caller) or forward_source
        else:
            phase = self.phase
            module, module_type = self.stack[-1] if self.stack else ("", "")
            source = user_source(caller)
        tensors = tensors_in(output)
        if node is None and tensors:
            self.to_tag.append((tensors, (module, module_type, source)))
        name = func.overloadpacket.__name__
        reads_output = phase == "loss" and self._reads_output(name, args, kwargs, tensors)
        picked = node is None and (name in _GATHER_OPS or bool(self.picked_rows)) \
            and self._picks_rows(name, args, kwargs, tensors)
        if name in _UNMEASURED_OPS or func.is_view:
            # Nothing computed (views, detach) or nothing defined (empty) to measure; a copy
            # carries its input's lineage into its new storage.
            if self.bad_writer and (name in _COPY_OPS or name in _FRESH_OPS):
                self._carry(name, args, tensors)
            return
        measurable = [t for t in tensors if not classify(t)]
        low = high = math.nan
        nan = inf = False
        measured: list[TensorStats] = []
        if measurable:
            measured = [measure_tensor(t, self.op_pending) for t in measurable]
            for tensor, stats in zip(measurable, measured):
                if not stats.note:
                    self._remember(tensor, stats.nan, stats.inf)
            valid = [m for m in measured if not m.note]
            if valid:
                nan = any(m.nan for m in valid)
                inf = any(m.inf for m in valid)
                if not nan:
                    low = min(m.abs_min for m in valid)
                    high = max(m.abs_max for m in valid)
        first = tensors[0] if tensors else None
        index = len(self.rows)
        if reads_output:
            self.read_output.add(index)
        if picked:
            self.picked_ops.add(index)
        self.rows.append((index, phase, name, str(func), module, module_type,
                          str(first.dtype).replace("torch.", "") if first is not None else "",
                          () if first is None else nested_shape(first) if first.is_nested
                          else tuple(first.shape),
                          low, high, nan, inf, nan or inf, source))
        if nan or inf:
            self._link(index, func, args, kwargs, nan, measurable, before)
            if node is not None:  # which gradient formula it belongs to (LogBackward0 ...)
                self.grad_nodes[index] = node.name()
        if self.bad_writer or nan or inf:
            self._written(index, measurable, measured)
        if nan and self.first_nan is None:
            self.first_nan = index
        elif inf and self.first_inf is None:
            self.first_inf = index

    # -- loss_fn's data flow from the model's output
    def mark_output(self, leaves: Any) -> None:
        """Name the storages of the model's output tensors, before loss_fn runs on them; a
        ``torch.distributions`` object returned (a mixture density network's, a flow's) counts
        with the tensors it holds: its log_prob in loss_fn reads the model's output."""
        for leaf in leaves:
            for tensor in _held_by(leaf):
                key = storage_key(tensor)
                if key is not None:
                    self.from_output.add(key)

    def _reads_output(self, name: str, args: tuple, kwargs: dict,
                      outputs: list[torch.Tensor]) -> bool:
        """Whether a loss op reads the model's output or a tensor made from it; if so, what it
        writes is made from it too (a new allocation is not)."""
        derived = self.from_output
        if not derived or name in _FRESH_OPS:
            return False
        reads = any(storage_key(t) in derived for v in list(args) + list(kwargs.values())
                    for t in tensors_in(v))
        if reads:
            for tensor in outputs:
                key = storage_key(tensor)
                if key is not None:
                    derived.add(key)
        return reads

    def _picks_rows(self, name: str, args: tuple, kwargs: dict,
                    outputs: list[torch.Tensor]) -> bool:
        """Whether op ``name`` makes rows a gather picked (it is such a gather, or reads what
        one made, and does not put them back in place: ``index_add_`` into a tensor of the
        batch's rows); its outputs' storages are marked so, or unmarked (a storage reused)."""
        base = name.rstrip("_")
        gathers = False
        if name in _GATHER_OPS:
            paused, self.paused = self.paused, True  # its index read is none of the model's ops
            try:
                gathers = _picks_rows(name, args)
            finally:
                self.paused = paused
        if base in _SCATTER_OPS:  # its output keeps the rows of its input (self)
            picked = bool(args) and isinstance(args[0], torch.Tensor) \
                and storage_key(args[0]) in self.picked_rows
        elif gathers:
            picked = True
        else:  # made from picked rows that keep their place in it (not broadcast into it)
            shapes = {(t.dim(), t.shape[0]) for t in outputs if t.dim()}
            picked = bool(self.picked_rows) and any(
                storage_key(t) in self.picked_rows and (t.dim(), t.shape[:1].numel()) in shapes
                for v in list(args) + list(kwargs.values()) for t in tensors_in(v) if t.dim())
        for tensor in outputs:
            key = storage_key(tensor)
            if key is None:
                continue
            if picked:
                self.picked_rows.add(key)
            else:
                self.picked_rows.discard(key)
        return picked

    def _rows_back_in_place(self, args: tuple, kwargs: dict, output: Any) -> None:
        """A module given rows as the batch has them returns them so (a mixture of experts'
        block gathers each expert's tokens and puts the results back in place, also through a
        sort and its inverse): its outputs are no picked rows."""
        if any(storage_key(t) in self.picked_rows for v in list(args) + list(kwargs.values())
               for t in tensors_in(v)):
            return
        for tensor in tensors_in(output):
            self.picked_rows.discard(storage_key(tensor))

    def picks_rows(self, index: int | None) -> bool:
        """Whether op ``index`` made rows a gather picked (dim 0: not the batch's samples)."""
        return index is not None and index in self.picked_ops

    def reads_output(self, index: int | None) -> bool | None:
        """Whether loss op ``index`` read the model's output or a tensor loss_fn made from it
        (False: only the targets, anchors, weights loss_fn got besides it); None for an op
        that did not run in loss_fn."""
        if index is None or self.rows[index][1] != "loss":
            return None
        return index in self.read_output

    # -- lineage
    def _link(self, index: int, func: Any, args: tuple, kwargs: dict, nan: bool,
              outputs: list[torch.Tensor], before: _BeforeWrite | None = None) -> None:
        """Record where op ``index``'s NaN/Inf came from: the inputs that held one (a NaN
        explains a NaN; an Inf explains an Inf), or none (born here). An op turning an Inf
        into NaN (softmax of a fully masked row, inf - inf) is where that NaN was born.
        ``before``: the range of the tensor an in-place op wrote, as it was before."""
        positions, names = mutated_arguments(func)
        parents: list[int] = []
        outside: list[int] = []
        feeders: list[int] = []
        feeders_outside: list[int] = []
        skipped = _unread_argument(func, kwargs)
        values = [(p in positions, v) for p, v in enumerate(args) if p != skipped]
        values += [(False, v) for k, v in kwargs.items() if k not in names]  # out= is no input
        for mutated, value in values:
            for tensor in tensors_in(value):
                key = storage_key(tensor)
                if mutated:  # written by this op: its state before, as the lineage knows it
                    writer = self.bad_writer.get(key) if key is not None else None
                    if writer is not None:
                        row = self.rows[writer]
                        input_nan, input_inf = row[10], row[11]
                    elif before is not None and tensor is before.target:
                        # No op of the replay wrote a NaN/Inf there, yet it may have held one
                        # (a tensor no op made: a plain attribute, uninitialised memory).
                        input_nan, input_inf = before.nonfinite()
                    else:
                        continue
                else:
                    input_nan, input_inf, writer = self._input_state(tensor, key)
                if input_nan if nan else input_inf:
                    if writer is not None:
                        parents.append(writer)
                    elif key is not None:
                        outside.append(key)
                elif nan and input_inf:
                    if writer is not None:
                        feeders.append(writer)
                    elif key is not None:
                        feeders_outside.append(key)
        literal = not nan and _writes_literal_inf(args, kwargs)
        self.links[index] = (tuple(parents), tuple(outside), tuple(feeders),
                             tuple(feeders_outside), literal)
        if not parents and not outside:
            self._hold_birth(index, func, args, kwargs, outputs, before)

    def _input_state(self, tensor: torch.Tensor, key: int | None) -> tuple[bool, bool, int | None]:
        """(holds a NaN, holds an Inf, the op that wrote a NaN/Inf into its storage) of an
        input of a non-finite op. Exact when an op of this replay made this very tensor; a
        view of a storage an op wrote a NaN/Inf into takes that op's flags; weights and data
        are measured once per storage; anything else is measured now."""
        writer = self.bad_writer.get(key) if key is not None else None
        known = self.known.get(id(tensor))
        if known is not None and known[0]() is tensor and known[1] == version_of(tensor):
            return known[2], known[3], writer
        if writer is not None:
            row = self.rows[writer]
            return row[10], row[11], writer
        version = version_of(tensor)
        base = getattr(tensor, "_base", None)
        if base is not None:  # a view of a tensor measured finite holds finite values
            known = self.known.get(id(base))
            if known is not None and known[0]() is base and known[1] == version \
                    and not known[2] and not known[3]:
                return False, False, None
        cached = self.storage_flags.get(key) if key is not None else None
        if cached is not None and cached[0] == version:
            return cached[1], cached[2], None
        if classify(tensor):
            return False, False, None
        stats = measure_tensor(tensor, self.op_pending)
        self._remember(tensor, stats.nan, stats.inf)
        if key in self.source_names and _covers_storage(tensor):  # weights, data: alive throughout
            self.storage_flags[key] = (version, stats.nan, stats.inf)
        return stats.nan, stats.inf, None

    def _written(self, index: int, outputs: list[torch.Tensor], measured: list[TensorStats]) -> None:
        """Note which storages op ``index`` wrote a NaN/Inf into, and forget those it
        overwrote whole with finite values."""
        bad_writer = self.bad_writer
        for tensor, stats in zip(outputs, measured):
            if stats.note:
                continue
            key = storage_key(tensor)
            if key is None:
                continue
            if stats.nan or stats.inf:
                bad_writer[key] = index
            elif key in bad_writer and _covers_storage(tensor):
                del bad_writer[key]

    def _carry(self, name: str, args: tuple, outputs: list[torch.Tensor]) -> None:
        """A copy takes its input's lineage along; a new allocation holds nothing yet."""
        writer = None
        if name in _COPY_OPS and args and isinstance(args[0], _Tensor):
            key = storage_key(args[0])
            writer = self.bad_writer.get(key) if key is not None else None
        for tensor in outputs:
            key = storage_key(tensor)
            if key is None:
                continue
            if writer is not None:
                self.bad_writer[key] = writer
            else:
                self.bad_writer.pop(key, None)

    def _hold_birth(self, index: int, func: Any, args: tuple, kwargs: dict,
                    outputs: list[torch.Tensor], written: _BeforeWrite | None = None) -> None:
        """Keep what describing a birth needs: references while they are small (no host sync
        now: most births never reach the event), else its description, made now. ``written``:
        the range an in-place op's ``self`` had before the op wrote it."""
        before, self.before_in_place = self.before_in_place, None
        if before is not None and before[0] is func:  # its inputs as they were before it ran
            self.births[index] = before[1] + self._describe_paused(func, (), {}, outputs)
            return
        size = sum(t.numel() * t.element_size() for v in list(args) + list(kwargs.values())
                   + outputs for t in tensors_in(v))
        if self.held_bytes + size <= _HELD_BIRTH_BYTES:
            self.held_bytes += size
            self.births[index] = (func, args, kwargs, list(outputs),
                                  _versions_after(func, args, kwargs, outputs), written)
        else:
            self.births[index] = _as_read_before_write(self._name_weights(
                self._describe_paused(func, args, kwargs, outputs),
                _described_tensors(func, args, kwargs, outputs)), func, written)

    def _describe_paused(self, func: Any, args: tuple, kwargs: dict,
                         outputs: list[torch.Tensor]) -> list[dict]:
        paused, self.paused = self.paused, True
        try:
            return describe_op_tensors(func, args, kwargs, outputs)
        finally:
            self.paused = paused

    def describe_birth(self, index: int) -> list[dict]:
        """Signed ranges and non-finite counts of birth ``index``'s inputs and outputs."""
        held = self.births.get(index)
        if held is None:
            return []
        if isinstance(held, tuple):
            func, args, kwargs, outputs, versions, written = held
            now = [version_of(t) for t in _described_tensors(func, args, kwargs, outputs)]
            described = self._describe_paused(func, args, kwargs, outputs)
            for row, then, later in zip(described, versions, now):
                if later > then:  # written in place after the op: say so
                    row["role"] += " (written in place since)"
            self._name_weights(described, _described_tensors(func, args, kwargs, outputs))
            held = self.births[index] = _as_read_before_write(described, func, written)
        return held

    def _name_weights(self, described: list[dict], tensors: list[torch.Tensor]) -> list[dict]:
        """``described`` (rows of ``tensors``, in order) with ``weight`` set on each input that
        is a parameter or buffer of the model (or a view of one: its qualified name), so that
        a diagnosis can name it (exp of a learned logit_scale)."""
        for row, tensor in zip(described, tensors):
            key = storage_key(tensor) if row["role"].startswith("input") else None
            source = self.source_names.get(key) if key is not None else None
            if source is not None and source[0] == "weight":
                row["weight"] = source[1]
        return described

    def _frame_tensor(self, tensor: torch.Tensor, stats: TensorStats) -> None:
        if id(stats) not in self.frame_tensors:
            key = storage_key(tensor)
            self.frame_tensors[id(stats)] = (key, self.bad_writer.get(key) if key is not None else None)

    def name_sources(self, kind: str, named: Any) -> None:
        """Name the storages of tensors no traced op makes: ``named`` yields (name, tensor)."""
        for name, tensor in named:
            if isinstance(tensor, _Tensor):
                key = storage_key(tensor)
                if key is not None:
                    self.source_names.setdefault(key, (kind, name))

    def note_loss(self, loss: Any) -> None:
        """Remember where a non-finite loss was written (a replay with loss_fn)."""
        if isinstance(loss, _Tensor) and self.bad_writer:
            key = storage_key(loss)
            self.loss_writer = self.bad_writer.get(key) if key is not None else None

    def follow(self, stats: TensorStats | None) -> Lineage:
        """The lineage of the frame tensor measured into ``stats`` (an event's tensor)."""
        seen = self.frame_tensors.get(id(stats)) if stats is not None else None
        if seen is None:
            return Lineage()
        key, writer = seen
        if writer is not None:
            return self.follow_op(writer)
        name = self.source_names.get(key) if key is not None else None
        return Lineage(came_with=[name or ("unknown", "")], followed=True)

    def follow_op(self, start: int) -> Lineage:
        """Walk back from op ``start``'s non-finite output to where it came from. The earliest
        birth among the ops it flowed from is chosen; with none, what came from outside.

        A NaN an op made from Infs (inf - inf, 0 * inf, softmax of a row of -inf) is followed
        to those Infs: one an op made by accident (an overflow, log(0), x / 0) is the cause; one
        written on purpose (a mask) or brought by the data leaves the NaN's birth the cause; an
        Inf weight brings it with the weights."""
        links = self.links
        came_from: dict[int, int | None] = {start: None}
        births, outside = self._walk([start], came_from)
        chosen: list[int] = []
        infs_from_outside: dict[int, list[int]] = {}  # birth -> where its Infs came from
        for birth in births:
            _, _, feeders, feeders_outside, _ = links[birth]
            if not feeders and not feeders_outside:
                chosen.append(birth)
                continue
            for feeder in feeders:
                came_from.setdefault(feeder, birth)
            inf_births, inf_outside = self._walk(list(feeders), came_from)
            accidental = [b for b in inf_births if not links[b][4]]
            weights = [k for k in inf_outside + list(feeders_outside)
                       if self.source_names.get(k, ("unknown", ""))[0] == "weight"]
            if accidental:
                chosen.extend(accidental)
            elif weights:
                outside.extend(k for k in weights if k not in outside)
            else:
                chosen.append(birth)
                if not inf_births:  # no op made its Infs: they came with what it read
                    infs_from_outside[birth] = inf_outside + list(feeders_outside)
        came_with = list(dict.fromkeys(self.source_names.get(k, ("unknown", "")) for k in outside))
        if chosen:
            born: int | None = min(chosen)
            end = born
        else:
            born = None
            # The path from the first op that read the outside value.
            readers = [i for i in came_from if links.get(i) and (links[i][1] or links[i][3])]
            end = min(readers) if readers else start
        path = []
        step: int | None = end
        while step is not None:
            path.append(step)
            step = came_from.get(step)
        inf_came_with = list(dict.fromkeys(self.source_names.get(k, ("unknown", ""))
                                           for k in infs_from_outside.get(born, []))) \
            if born is not None else []
        return Lineage(born=born, path=path, came_with=came_with, reached=set(came_from),
                       followed=True, inf_came_with=inf_came_with)

    def _walk(self, starts: list[int], came_from: dict[int, int | None]) -> tuple[list[int], list[int]]:
        """The ops with no non-finite input (births) and the storages no op wrote (outside)
        that ``starts`` came from; every op passed is noted in ``came_from``."""
        links = self.links
        births: list[int] = []
        outside: list[int] = []
        stack = list(starts)
        seen: set[int] = set()
        while stack:
            index = stack.pop()
            if index in seen:
                continue
            seen.add(index)
            link = links.get(index)
            if link is None:
                continue
            parents, keys = link[0], link[1]
            if not parents and not keys:
                births.append(index)
            outside.extend(k for k in keys if k not in outside)
            for parent in parents:
                came_from.setdefault(parent, index)
                stack.append(parent)
        return births, outside

    def event_lineage(self, event: Any) -> Lineage:
        """Where the NaN/Inf of ``event`` (found in this replay's frames) came from. Without an
        event: the non-finite loss, else the last non-finite gradient op of the backward pass
        (a replay with a loss or output gradients), else nothing to follow."""
        if event is None:
            if self.loss_writer is not None:
                return self.follow_op(self.loss_writer)
            last = self.last_nonfinite("backward")
            return self.follow_op(last) if last is not None else Lineage()
        if not 0 <= event.frame < len(self.frames):
            return Lineage()
        frame = self.frames[event.frame]
        if event.origin == "weight":  # the event's tensor is the weight itself: no op made it
            prefix = f"{frame.module}." if frame.module else ""
            named = [("weight", prefix + role) for role, stats, *_ in frame.entries[:frame.first_output]
                     if not is_input_role(role) and stats is not None and (stats.nan or stats.inf)]
            return Lineage(came_with=named or [("weight", prefix + event.role)], followed=True)
        entry = next((e for e in frame.entries if e[0] == event.role), None)
        if event.origin == "input" and event.made_kind == "nan" and entry is not None \
                and entry[1] is not None and not entry[1].nan:
            # The input brought Inf (a mask) and a softmax or attention in the module made NaN
            # of a fully masked row (a fused encoder layer): that NaN was born in here. Any
            # other op (inf - inf in a matmul over -inf padding) leaves the Inf's writer first.
            made = next((e for e in frame.entries[frame.first_output:]
                         if e[1] is not None and e[1].nan), None)
            if made is not None:
                lineage = self.follow(made[1])
                if lineage.born is not None and masks_rows(str(self.rows[lineage.born][2])):
                    return lineage
        return self.follow(entry[1] if entry is not None else None)

    def last_nonfinite(self, phase: str) -> int | None:
        """The last op of ``phase`` whose output held a NaN/Inf."""
        for index in sorted(self.links, reverse=True):
            if self.rows[index][1] == phase:
                return index
        return None

    def first_unexplained_birth(self) -> int | None:
        """The first op that made a NaN/Inf from finite inputs, in program order, leaving out
        ops writing a literal ±inf, and those that made NaN of Infs a tensor no traced op made
        brought in (inf - inf of advantages computed before loss_fn ran: it came from outside
        too): the best guess when the event cannot be followed back."""
        for index in sorted(self.links):
            parents, keys, feeders, feeders_outside, literal = self.links[index]
            if not parents and not keys and not literal \
                    and not self._infs_read_from_outside(feeders, feeders_outside):
                return index
        return None

    def _infs_read_from_outside(self, feeders: tuple, feeders_outside: tuple) -> bool:
        """Whether the Infs a NaN birth was made of all came with tensors no traced op made,
        neither the batch's inputs nor weights (no op made any of them)."""
        if not feeders and not feeders_outside:
            return False
        births, outside = self._walk(list(feeders), {})
        sources = [self.source_names.get(k, ("unknown", ""))[0]
                   for k in outside + list(feeders_outside)]
        return not births and all(kind == "unknown" for kind in sources)

    def _remember(self, tensor: torch.Tensor, nan: bool, inf: bool) -> None:
        try:
            self.known[id(tensor)] = (weakref.ref(tensor), version_of(tensor), nan, inf)
        except TypeError:
            pass


def _unread_argument(func: Any, kwargs: dict) -> int | None:
    """The position of an argument the op does not read despite its schema: the input of
    ``baddbmm`` (``addmm`` ...) with ``beta=0``, whose contents, Inf or NaN included, the result
    ignores; None for every other op."""
    if func.overloadpacket.__name__.rstrip("_") in _SCALED_ACCUMULATE and kwargs.get("beta", 1) == 0:
        return 0
    return None


def _as_read_before_write(described: list[dict], func: Any,
                          written: _BeforeWrite | None) -> list[dict]:
    """``described`` with an in-place op's ``self`` as the op read it (its range before the
    write, finite there) instead of the output it holds since. A ``self`` that held a NaN/Inf
    already keeps its description after the write: the range alone cannot count them."""
    if written is None:
        return described
    low, high = written.read()
    if not (math.isfinite(low) and math.isfinite(high)):
        return described
    try:
        role = f"input {func._schema.arguments[0].name}"
    except (AttributeError, IndexError):
        return described
    for position, row in enumerate(described):
        if row["role"] == role or row["role"].startswith(role + " ("):
            described[position] = dict(row, role=role, min=low, max=high, nan_count=0,
                                       inf_count=0, pos_inf_count=0, neg_inf_rows=0,
                                       nonfinite_rows=[])
            break
    return described


def _writes_literal_inf(args: tuple, kwargs: dict) -> bool:
    """Whether an op got ±inf as a plain number (not through a tensor)."""
    for value in list(args) + list(kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, float) and item in (math.inf, -math.inf):
                return True
    return False


def _describe(role: str, tensor: torch.Tensor, dim: int = -1, rows: bool = False) -> dict:
    """Signed finite range and non-finite counts of one tensor (the first bad op's report). A
    complex tensor's range is its real part's (what exp overflows on); its counts are of
    values with a non-finite part. Its Inf are told apart: how many are +inf (an overflow;
    a mask writes -inf) and how many rows along ``dim`` are all -inf (fully masked rows).
    With ``rows``: the indices along dim 0 that hold a NaN/Inf (the first
    :data:`OP_ROWS_DESCRIBED`: the samples holding it, when dim 0 is the batch's)."""
    info = {"role": role, "dtype": str(tensor.dtype).replace("torch.", ""),
            "shape": () if tensor.is_nested else tuple(tensor.shape), "numel": tensor.numel(),
            "min": math.nan,
            "max": math.nan, "nan_count": 0, "inf_count": 0, "pos_inf_count": 0,
            "neg_inf_rows": 0, "nonfinite_rows": []}
    if tensor.numel() == 0:
        return info
    try:
        with torch.no_grad():
            values = tensor.detach()
            if values.is_nested:  # its components' values (boolean indexing refuses it)
                values = nested_values(values)
            values = widen_float8(values)  # float8 has no isinf, min or max
            if values.is_floating_point() or values.is_complex():
                nan_mask, inf_mask = torch.isnan(values), torch.isinf(values)
                real = values.real if values.is_complex() else values
                finite = real[~(nan_mask | inf_mask)]
                low = finite.min().double() if finite.numel() else torch.tensor(math.nan)
                high = finite.max().double() if finite.numel() else torch.tensor(math.nan)
                numbers = torch.stack((low.cpu(), high.cpu(), nan_mask.sum().double().cpu(),
                                       inf_mask.sum().double().cpu())).tolist()
                if numbers[3] and not values.is_complex():
                    numbers.append(float((real == math.inf).sum()))
                    numbers.append(float((real == -math.inf).all(dim).sum()) if real.dim() else 0.0)
            else:  # integers; a bool mask reads 0 to 1 (False to True)
                numbers = [float(values.min()), float(values.max()), 0, 0]
        info.update(min=numbers[0], max=numbers[1], nan_count=int(numbers[2]),
                    inf_count=int(numbers[3]))
        if len(numbers) > 4:
            info.update(pos_inf_count=int(numbers[4]), neg_inf_rows=int(numbers[5]))
        if rows and (numbers[2] or numbers[3]) and values.dim() and not values.is_nested:
            bad = (nan_mask | inf_mask).reshape(values.shape[0], -1).any(1)
            info["nonfinite_rows"] = bad.nonzero()[:OP_ROWS_DESCRIBED, 0].tolist()
    except Exception:
        pass
    return info


def _described_tensors(func: Any, args: tuple, kwargs: dict,
                      outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors :func:`describe_op_tensors` describes, in the order of its rows."""
    skipped = _unread_argument(func, kwargs)
    found = [t for position, value in enumerate(args) if position != skipped
             for t in tensors_in(value)]
    found += [t for value in kwargs.values() for t in tensors_in(value)]
    return found + list(outputs)


def _versions_after(func: Any, args: tuple, kwargs: dict,
                    outputs: list[torch.Tensor]) -> list[int]:
    """The versions :func:`_described_tensors` will have once op ``func`` has returned. Its
    own write bumps the tensors it writes in place only after its dispatch returns (autograd's
    in-place layer sits above the tracer): that bump is no write since."""
    positions, names = mutated_arguments(func)
    written = {storage_key(t) for position in positions if position < len(args)
               for t in tensors_in(args[position])}
    written |= {storage_key(t) for name in names for t in tensors_in(kwargs.get(name))}
    written.discard(None)
    return [version_of(t) + (storage_key(t) in written)
            for t in _described_tensors(func, args, kwargs, outputs)]


def describe_op_tensors(func: Any, args: tuple, kwargs: dict, outputs: list[torch.Tensor]) -> list[dict]:
    """Signed ranges and non-finite counts of the first bad op's inputs and outputs."""
    try:
        names = [a.name for a in func._schema.arguments]
    except AttributeError:
        names = []
    described = []
    skipped = _unread_argument(func, kwargs)
    # The rows a softmax runs over (all -inf there: a fully masked row); else the last dim (a mask's)
    dim = args[1] if "softmax" in func.overloadpacket.__name__ and len(args) > 1 \
        and isinstance(args[1], int) else -1
    for position, value in enumerate(args):
        if position == skipped:  # not read (beta=0): its garbage says nothing of the op
            continue
        name = names[position] if position < len(names) else f"arg{position}"
        tensors = tensors_in(value)
        for k, tensor in enumerate(tensors):
            described.append(_describe(f"input {name}" + (f"[{k}]" if len(tensors) > 1 else ""),
                                       tensor, dim))
    for name, value in kwargs.items():
        for tensor in tensors_in(value):
            described.append(_describe(f"input {name}", tensor, dim))
    for k, tensor in enumerate(outputs):
        described.append(_describe("output" + (f"[{k}]" if len(outputs) > 1 else ""), tensor,
                                   rows=True))
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


class WriteGuard(TorchDispatchMode):
    """A replay without the op trace (frames only): measures nothing, but saves each protected
    weight an op is about to write into (``embedding_renorm_`` in ``nn.Embedding(max_norm=...)``,
    any in-place write a forward makes into a parameter), so that the replay restores it."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, shadows: Shadows) -> None:
        super().__init__()
        self.shadows = shadows

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        save_before_write(self.shadows, func, args, kwargs)
        return func(*args, **kwargs)


def save_before_write(shadows: Shadows, func: Any, args: tuple, kwargs: dict) -> None:
    """Let ``shadows`` save each protected tensor ``func`` is about to write into."""
    positions, names = mutated_arguments(func)
    for position in positions:
        if position < len(args):
            for tensor in tensors_in(args[position]):
                shadows.before_write(tensor)
    for name in names:
        for tensor in tensors_in(kwargs.get(name)):
            shadows.before_write(tensor)

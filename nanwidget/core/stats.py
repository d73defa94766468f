"""Tensor statistics: which tensors get stats, and how they are measured without host syncs.

Every tensor a hook sees is measured *when the hook sees it*, so its stats describe the values
that module saw even if something writes into the tensor later:

- dense CPU float tensors (and contiguous CPU int32/int64 ones): the native kernel reads them
  once, right there (no device, so nothing to synchronise);
- everything else: two small reductions on the tensor's own device (|x| and one min/max over
  its bit patterns), kept as device scalars; :meth:`PendingStats.resolve` copies every result
  of the batch to the host at once, one transfer per device: the batch's single host sync.

A tensor that holds a NaN or an Inf gets a second look: whether it holds an Inf (a NaN hides
it from the max) and the range of its finite values. On CPU that happens at once; on a device
the tensor is held until the batch resolves (up to ``PENDING_BYTES_LIMIT`` bytes; past that the
second look is computed eagerly for each new tensor, still without a sync).

Integer, complex, sparse, nested, quantized and float8 tensors are measured too (their values,
magnitudes or stored values; an integer tensor holding both signs gets its smallest |x| read
when the batch resolves, one more host copy only then); functorch wrappers (``vmap``, ``grad``) and DTensors are read
through to the tensor underneath. Only bool, meta and empty tensors get a note instead.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from . import native
from .schema import CHANGED_LATER, PENDING

__all__ = ["TensorStats", "PendingStats", "AbsMeter", "classify", "dtype_max", "version_of",
           "widen_float8",
           "storage_holds", "measure_tensor", "PENDING_BYTES_LIMIT", "PLAIN_TENSOR_TYPES",
           "local_shard", "is_distributed_tensor", "plain_view", "nested_values", "stood_for",
           "functorch_unwrapped", "vmapped_samples", "growth_rate"]

# Tensors above this many elements are reduced in slices, so that the temporary |x| never
# needs more memory than one slice (an LLM's logits can be gigabytes).
_SLICE_ELEMENTS = 1 << 24

# Tensors held for a possible second look until the batch resolves, at most: past this every
# new tensor gets its second look computed at once (still no sync) and is not held.
PENDING_BYTES_LIMIT = 1 << 28
_SCRATCH_MIN_ELEMENTS = 1 << 18  # below this a fresh allocation is as cheap as a scratch view

# Integer types of the same width: the view under which |x| is reduced.
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}
# Unsigned integers wider than uint8, as what their magnitudes are read from: exact in int64
# (uint64 above 2**63 does not fit: float64, exact to 2**53, as every float stat is).
_WIDE_UNSIGNED = {torch.uint16: torch.int64, torch.uint32: torch.int64,
                  torch.uint64: torch.float64}
_SPARSE_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_INF = math.inf
_NAN = math.nan
_functorch = getattr(torch._C, "_functorch", None)


class TensorStats:
    """abs min / abs max (also over the finite values only) / NaN / Inf of one tensor.

    Filled when its batch resolves; ``note`` is "pending" until then, "" once measured, or why
    there are no stats. A tensor holding a NaN has ``abs_min`` and ``abs_max`` NaN (as
    transformers prints it); ``finite_abs_min`` / ``finite_abs_max`` are NaN when no value is
    finite.
    """

    __slots__ = ("abs_min", "abs_max", "finite_abs_min", "finite_abs_max", "nan", "inf", "note")

    def __init__(self, abs_min: float = _NAN, abs_max: float = _NAN, note: str = PENDING) -> None:
        # TensorStats(low, high, ""): the stats of a tensor whose values are all finite, made
        # in one call (the hooks' common case).
        self.abs_min: float = abs_min
        self.abs_max: float = abs_max
        self.finite_abs_min: float = abs_min
        self.finite_abs_max: float = abs_max
        self.nan: bool = False
        self.inf: bool = False
        self.note: str = note

    @property
    def nonfinite(self) -> bool:
        return self.nan or self.inf

    def set_finite(self, low: float, high: float) -> None:
        """Stats of a tensor whose values are all finite."""
        self.abs_min = self.finite_abs_min = low
        self.abs_max = self.finite_abs_max = high
        self.nan = self.inf = False
        self.note = ""

    def set_nonfinite(self, low: float, high: float, finite_low: float, finite_high: float,
                      has_inf: bool) -> None:
        """Stats of a tensor holding a NaN (``high`` NaN) or an Inf: ``finite_*`` over its
        finite values (inf / -inf when there is none), ``has_inf`` from the second look."""
        self.nan = high != high or low != low
        self.inf = has_inf or high == _INF
        self.abs_min, self.abs_max = (_NAN, _NAN) if self.nan else (low, high)
        if finite_low <= finite_high:
            self.finite_abs_min, self.finite_abs_max = finite_low, finite_high
        else:  # no finite value at all
            self.finite_abs_min = self.finite_abs_max = _NAN
        self.note = ""

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"TensorStats(abs_min={self.abs_min:.3g}, abs_max={self.abs_max:.3g}, "
                f"finite=({self.finite_abs_min:.3g}, {self.finite_abs_max:.3g}), "
                f"nan={self.nan}, inf={self.inf}, note={self.note!r})")


def classify(tensor: torch.Tensor) -> str:
    """Return "" when ``tensor`` gets stats, else the contract's note saying why not.

    Only reads metadata, so it is safe on meta, sparse and fake tensors and costs no kernel.
    """
    try:
        if tensor.is_meta:
            return "meta"
        if tensor.dtype is torch.bool:
            return "bool"
        if tensor.numel() == 0:
            return "empty"
    except Exception:  # a subclass that refuses even metadata: measuring will say why
        return ""
    return ""


# One check for every reader: the kernel's (native) and torch's.
storage_holds = native.storage_holds


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's version counter, or -1 for an inference tensor (``torch.inference_mode``),
    which has none: such tensors are then told apart by identity alone."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


def dtype_max(dtype: torch.dtype | str) -> float:
    """Largest finite value of a floating dtype (65504 for float16); inf for unknown names."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)  # type: ignore[assignment]
    if isinstance(dtype, torch.dtype) and dtype.is_complex:
        dtype = dtype.to_real()  # complex values overflow when a component passes its float's max
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        try:
            return float(torch.finfo(dtype).max)
        except Exception:  # float4_e2m1fn_x2 and other packed types: finfo has no max
            return math.inf
    return math.inf


def growth_rate(batches: list[int], logs: list[float]) -> float:
    """Theil-Sen slope of ``logs`` (natural log of abs max) against ``batches``: the median of
    the pairwise slopes, so that one odd batch does not make a trend. 0 with fewer than two
    batches."""
    slopes = sorted((logs[j] - logs[i]) / (batches[j] - batches[i])
                    for i in range(len(batches)) for j in range(i + 1, len(batches))
                    if batches[j] != batches[i])
    if not slopes:
        return 0.0
    middle = len(slopes) // 2
    return slopes[middle] if len(slopes) % 2 else (slopes[middle - 1] + slopes[middle]) / 2

def widen_float8(values: torch.Tensor) -> torch.Tensor:
    """A float8 tensor (or another format torch implements few ops for) as a float32 copy,
    which holds each of its values, NaN and Inf included; any other tensor as it is. For the
    event's slow paths (a diagnosis, a replay's op report): torch.isinf and torch.isneginf are
    not implemented for float8_e4m3fn and the fnuz formats, nor isneginf for float8_e5m2."""
    if values.is_floating_point() and values.dtype not in _BITS:
        return values.float()
    return values


def functorch_unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor under functorch wrappers (vmap's batched tensors, grad's tracking tensors:
    they refuse data pointers and host copies); a vmap'd tensor's values include its batch."""
    if _functorch is not None:
        while _functorch.is_functorch_wrapped_tensor(tensor):
            tensor = _functorch.get_unwrapped(tensor)
    return tensor


def vmapped_samples(tensor: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """A tensor a module got inside ``torch.func`` transforms (kept past their end: they can
    be read only through what they wrap) as the tensor under them, with the dimension of the
    outermost ``vmap``'s samples in it (None when no vmap batched it: the tensor as it is)."""
    dim = None
    if _functorch is not None:
        while _functorch.is_functorch_wrapped_tensor(tensor):
            if _functorch.is_batchedtensor(tensor):
                dim = _functorch.maybe_get_bdim(tensor)
            tensor = _functorch.get_unwrapped(tensor)
    return tensor, dim


def _unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`functorch_unwrapped`, and a DTensor's local shard (this rank's)."""
    tensor = functorch_unwrapped(tensor)
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        to_local = getattr(tensor, "to_local", None)
        if callable(to_local):
            tensor = to_local()
    return tensor


# Tensor classes read directly; any other class is a subclass that may need a closer look.
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_NO_DISPATCH = torch.Tensor.__torch_dispatch__  # what a class without __torch_dispatch__ has
_no_torch_function = torch._C.DisableTorchFunctionSubclass


def stood_for(tensor: Any) -> Any:
    """The parameter that a per-sample-gradient stand-in in a module's slot holds: torch's
    ``ExpandedWeight``, which ``torch.nn.utils._per_sample_grad.call_for_per_sample_grads``
    and Opacus' ``grad_sample_mode="ew"`` put in every parameter slot for the forward (it
    refuses every op but the layers' own, even ``.detach()`` and ``.grad``; its values, version
    counter and storage are the parameter's). Anything else is returned as it is."""
    if type(tensor).__name__ == "ExpandedWeight":
        original = getattr(tensor, "orig_weight", None)  # an instance attribute: no op runs
        if isinstance(original, torch.Tensor):
            return original
    return tensor


def plain_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """A tensor subclass's values as a plain ``torch.Tensor``, read without running the
    subclass's own code; the tensor itself when it needs no view (plain, nested); None when
    its values cannot be read.

    A ``__torch_function__`` subclass holds its data like a plain tensor: it is viewed as one
    (same storage and version counter), so that measuring it does not go through its
    ``__torch_function__`` on every metadata read. A ``__torch_dispatch__`` wrapper
    (``_make_wrapper_subclass``) has no data of its own: it is read through the one inner
    floating-point tensor of its shape that ``__tensor_flatten__`` names."""
    kind = type(tensor)
    if kind in PLAIN_TENSOR_TYPES:
        return tensor
    if getattr(kind, "__torch_dispatch__", _NO_DISPATCH) is _NO_DISPATCH:
        with _no_torch_function():
            return tensor.as_subclass(torch.Tensor)
    if tensor.is_nested:
        return tensor  # nested tensors are read as such (their packed values)
    if kind.__name__ == "AsyncCollectiveTensor" and hasattr(tensor, "trigger_wait"):
        # The result of a collective still running (tensor parallel's RowwiseParallel output):
        # its buffer holds this rank's partial values until the collective ends. Wait for it,
        # as the next op that uses it would (on a GPU: the stream waits, the host does not).
        return plain_view(tensor.trigger_wait())
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return None
    try:
        names = flatten()[0]
        inner = [getattr(tensor, name) for name in names]
        shape = tensor.shape
    except Exception:
        return None
    matching = [t for t in inner if isinstance(t, torch.Tensor) and t.dtype == tensor.dtype
                and t.shape == shape]
    if len(matching) != 1:
        return None
    return plain_view(matching[0])


def nested_values(tensor: torch.Tensor) -> torch.Tensor:
    """A nested tensor's values as one plain tensor: its buffer of every component (a jagged
    one's ``values()``, samples packed along its ragged dim), or its components flattened and
    joined when it has no such buffer."""
    try:
        return tensor.values()
    except Exception:
        return torch.cat([part.reshape(-1) for part in tensor.unbind()])


def is_distributed_tensor(tensor: torch.Tensor) -> bool:
    """A DTensor (FSDP2, tensor parallel): each rank holds a shard of it."""
    return type(tensor) not in PLAIN_TENSOR_TYPES and hasattr(tensor, "placements") \
        and hasattr(tensor, "to_local")


def sharded_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s own parameters that are DTensors now (read when a watch starts, between
    forwards). FSDP2 (``fully_shard``) puts a plain tensor gathered from every rank in their
    slots while the module's forward (and, with ``reshard_after_forward=False``, its backward)
    runs, cast to ``param_dtype`` under a ``MixedPrecisionPolicy``; the DTensor is the parameter
    the optimizer holds and steps, and a load or an in-place write between steps writes."""
    try:
        return {key: tensor for key, tensor in module._parameters.items()
                if isinstance(tensor, torch.Tensor) and is_distributed_tensor(tensor)}
    except Exception:  # a container that cannot tell (TorchScript)
        return {}


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2, tensor parallel), read without a collective; any
    other tensor as it is. Reducing a DTensor itself would run collectives (or fail) inside a
    hook, where every rank does not necessarily arrive."""
    if not is_distributed_tensor(tensor):
        return tensor
    with torch.no_grad():  # the local tensor itself, not an autograd view of it
        return tensor.to_local()


_FLOAT64_MAX = torch.finfo(torch.float64).max


def _complex_magnitudes(values: torch.Tensor) -> torch.Tensor:
    """|z| of a complex tensor, NaN where a component is NaN; float64 where |z| passes the
    largest value of the components' dtype.

    A finite value never overflows: |3e38 + 3e38j| = 4.2e38 passes float32's max although
    both components are finite, and torch.abs makes it inf (an Inf the tensor does not hold);
    such magnitudes are computed again in complex128 (one past even float64's max is kept at
    that max). Whether the tensor holds a NaN or an Inf is its components': |nan + inf*j| is
    inf to torch, NaN here (the value holds a NaN)."""
    parts = torch.view_as_real(values.resolve_conj())
    magnitudes = values.abs()
    if values.dtype == torch.complex128:
        magnitudes = torch.where(torch.isinf(magnitudes) & torch.isfinite(parts).all(-1),
                                 _FLOAT64_MAX, magnitudes)
    else:  # the same magnitudes wherever they fit (torch's, as |x| of a real tensor is)
        magnitudes = torch.where(torch.isinf(magnitudes), values.to(torch.complex128).abs(),
                                 magnitudes)
    return torch.where(torch.isnan(parts).any(-1), _NAN, magnitudes)


def _values_of(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The real tensor whose magnitudes are the tensor's, and whether implicit zeros exist
    (sparse tensors store only their non-zero values)."""
    values = _unwrapped(tensor)
    if type(values) not in PLAIN_TENSOR_TYPES:
        plain = plain_view(values)
        if plain is not None:
            values = plain
    implicit_zero = False
    if values.is_nested:
        values = nested_values(values)
    elif values.layout is torch.sparse_coo:
        if not values.is_coalesced():  # duplicate indices add up: their sums are the values
            values = values.coalesce()
        stored = values._values()
        implicit_zero = stored.numel() < values.numel()
        values = stored
    elif values.layout in _SPARSE_COMPRESSED:
        stored = values.values()
        implicit_zero = stored.numel() < values.numel()
        values = stored
    if values.is_complex():  # rare: its own branch, off the real floats' path
        values = _complex_magnitudes(values)
    elif values.is_quantized:
        values = values.dequantize()
    elif values.is_floating_point() and values.dtype not in _BITS:
        values = values.float()  # float8 and friends: reductions need a real float
    elif values.dtype in _WIDE_UNSIGNED:  # torch has no min/max for these on every device
        values = values.to(_WIDE_UNSIGNED[values.dtype])
    return values, implicit_zero


class AbsMeter:
    """abs min and abs max of a float tensor as device scalars (no sync).

    Two kernels per tensor: |x|, then one min/max pass over the *bit patterns* of |x| viewed
    as integers of the same width. For non-negative IEEE floats the integer order is the
    numeric order, with +Inf above every finite value and NaN above +Inf, so the integer
    min/max are exactly abs_min and abs_max and a NaN anywhere becomes the max; on CPU the
    integer reduction runs 2-4x faster than the float one (no NaN handling to vectorise).
    For tensors of 256K elements and more, |x| goes into a reusable scratch buffer (per device
    and dtype, at most 2**24 elements; bigger tensors go slice by slice). Callers run it under
    ``torch.no_grad()``; one meter per thread.
    """

    def __init__(self, use_scratch: bool = True) -> None:
        self.use_scratch = use_scratch
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def reduce_bits(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
        """(abs_min, abs_max) as integer bit patterns on the device, and the float dtype they
        encode: ``torch.stack((low, high)).view(dtype)`` gives the values."""
        if tensor.dtype not in _BITS:  # float8 and friends: reductions need a real float
            tensor = tensor.float()
        dtype = tensor.dtype
        bits = _BITS[dtype]
        count = tensor.numel()
        if count <= _SLICE_ELEMENTS:
            low, high = torch.aminmax(self._abs(tensor, count).view(bits))
            return low, high, dtype
        parts = [torch.stack(torch.aminmax(self._abs(part, part.numel()).view(bits)))
                 for part in tensor.reshape(-1).split(_SLICE_ELEMENTS)]
        stacked = torch.stack(parts)
        return stacked[:, 0].min(), stacked[:, 1].max(), dtype

    def reduce(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(abs_min, abs_max) as float device scalars; both NaN when the tensor holds a NaN."""
        low, high, dtype = self.reduce_bits(tensor)
        pair = torch.stack((low, high)).view(dtype)
        return torch.minimum(pair[0], pair[1]), pair[1]  # minimum() carries the NaN into abs_min

    def measure(self, tensor: torch.Tensor) -> tuple[float, float]:
        """(abs_min, abs_max) as floats, with a host sync (tests and one-off checks)."""
        with torch.no_grad():
            low, high = self.reduce(tensor.detach())
            return tuple(torch.stack((low, high)).tolist())  # type: ignore[return-value]

    def _abs(self, values: torch.Tensor, count: int) -> torch.Tensor:
        if not self.use_scratch or count < _SCRATCH_MIN_ELEMENTS:
            return values.abs()
        key = (values.device, values.dtype)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() < count:
            scratch = self._scratch[key] = torch.empty(count, dtype=values.dtype, device=values.device)
        target = scratch[:count].view(values.shape)
        torch.abs(values, out=target)
        return target


def _second_look(values: torch.Tensor) -> torch.Tensor:
    """float64 [finite abs min, finite abs max, has Inf] of a float tensor, on its device (no
    sync; inf / -inf bounds when no value is finite). Only for tensors holding a NaN or an Inf,
    or when a tensor cannot be held until the batch resolves."""
    lows, highs, infs = [], [], []
    flat = values.reshape(-1)
    for part in (flat.split(_SLICE_ELEMENTS) if flat.numel() > _SLICE_ELEMENTS else (flat,)):
        magnitude = part.abs()
        finite = torch.isfinite(magnitude)
        lows.append(torch.where(finite, magnitude, _INF).amin())
        highs.append(torch.where(finite, magnitude, -_INF).amax())
        infs.append(torch.isinf(magnitude).any())
    return torch.stack((torch.stack(lows).amin().double(), torch.stack(highs).amax().double(),
                        torch.stack(infs).any().double()))


class _Queued:
    """One tensor measured on its device, waiting for the batch's host copy."""

    __slots__ = ("stats", "low", "high", "dtype", "held", "version", "extra", "implicit_zero")

    def __init__(self, stats: TensorStats, low: torch.Tensor, high: torch.Tensor,
                 dtype: torch.dtype | None, implicit_zero: bool) -> None:
        self.stats = stats
        self.low = low
        self.high = high
        self.dtype = dtype  # the float dtype the bit patterns encode; None: integer values
        self.held: torch.Tensor | None = None  # kept for a possible second look
        self.version = -1
        self.extra: torch.Tensor | None = None  # an eager second look
        self.implicit_zero = implicit_zero


class _Seen(weakref.ref):
    """A weak reference to a tensor measured in this batch, with the version it was measured
    in and its stats: one object per tensor (a tuple beside the reference made one more for the
    garbage collector to count, on every module call)."""

    __slots__ = ("version", "stats")


class PendingStats:
    """The stats of one batch's tensors, measured as they are seen, read back once per batch.

    A tensor seen twice in the same version (a module's input that is the previous module's
    output) is measured once and its stats object shared: ``id`` plus ``_version`` identify
    it, and a weak reference keeps a reused ``id`` from being mistaken for it. Not thread-safe:
    callers hold the recorder's lock.
    """

    __slots__ = ("_meter", "_direct", "_result", "_read_floats", "_read_grads", "_read_ints",
                 "_seen", "_queued", "_held_bytes")

    def __init__(self) -> None:
        self._meter = AbsMeter()
        self._direct = native.available()  # builds or loads the kernel now, not in the first batch
        self._result = native.result_buffer()
        self._read_floats = native.contiguous_reader()
        self._read_grads = native.gradient_reader()
        self._read_ints = native.int_reader()
        # id -> weak reference (with version and stats) of every tensor measured this batch.
        self._seen: dict[int, _Seen] = {}
        self._queued: list[_Queued] = []
        self._held_bytes = 0

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, tensor: torch.Tensor, hold: bool = True,
            check_storage: bool = True) -> TensorStats:
        """Measure ``tensor`` (classified as measurable) now; its stats fill at :meth:`resolve`
        (at once for CPU float tensors). ``hold=False`` never keeps the tensor alive (gradients,
        which the backward pass frees as it goes): a device tensor then gets its second look
        computed at once. ``check_storage=False`` never asks for the tensor's storage (a
        gradient handed to a tensor hook, which autograd reads next anyway): see
        :func:`~nanwidget.core.native.gradient_range` for what asking would change."""
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor: no version counter
            version = -1
        key = id(tensor)
        seen = self._seen.get(key)
        if seen is not None and seen.version == version and seen() is tensor:
            return seen.stats
        found = None
        if self._direct:
            try:
                # The common case first, with nothing in between: a plain contiguous CPU float
                # tensor, checked and read by the kernel in one call; any other dense layout
                # after the full check (a functorch wrapper refuses its data pointer: general
                # path).
                found = (self._read_floats if check_storage else self._read_grads)(
                    tensor, self._result)
                if found is None and native.eligible(tensor, check_storage):
                    found = native.abs_range(tensor, self._result)
            except Exception:
                found = None
        if found is not None and found[1] < _INF:  # every value finite (a NaN fails the test)
            stats = TensorStats(found[0], found[1], "")
        else:  # not read by the kernel, or a NaN/Inf to look at again: the general path
            stats = TensorStats()
            try:
                with torch.no_grad():
                    self._measure(tensor, version, stats, hold, check_storage)
            except Exception as error:  # never break the forward; the cell says why
                stats.note = f"unsupported ({type(error).__name__})"
        try:
            seen = self._seen[key] = _Seen(tensor)
        except TypeError:  # no weak references to this kind of tensor: no reuse
            return stats
        seen.version, seen.stats = version, stats
        return stats

    def seen(self, tensor: torch.Tensor) -> TensorStats | None:
        """The stats :meth:`add` gave this very tensor in this batch, in its current version
        (a module's input that the previous module returned), or None."""
        seen = self._seen.get(id(tensor))
        if seen is None or seen() is not tensor:
            return None
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor: no version counter
            version = -1
        return seen.stats if seen.version == version else None

    def last_seen(self, tensor: torch.Tensor) -> tuple[int, TensorStats] | None:
        """(version, stats) of this very tensor's last measurement in this batch, or None."""
        seen = self._seen.get(id(tensor))
        if seen is None or seen() is not tensor:
            return None
        return seen.version, seen.stats

    def _measure(self, tensor: torch.Tensor, version: int, stats: TensorStats, hold: bool,
                 check_storage: bool = True) -> None:
        values, implicit_zero = _values_of(tensor.detach())
        if values.numel() == 0:  # a sparse tensor with no stored value: all zeros
            stats.set_finite(0.0, 0.0)
            return
        if not values.is_floating_point():  # integers: their signed range
            found = self._read_ints(values, self._result) if self._direct else None
            if found is not None:  # read at once by the kernel; what _resolve makes of it
                low, high = found
                if low < 0 < high:  # both signs (labels with -100): |x|.min() now, on CPU
                    stats.set_finite(float(_int_abs_min(values)), max(-low, high))
                else:
                    stats.set_finite(*_magnitudes(low, high))
                return
            low, high = torch.aminmax(values)  # read at resolve
            queued = _Queued(stats, low, high, None, implicit_zero)
            # Kept for the smallest |x|, should the range hold both signs (token ids do not:
            # nothing more for them); past the limit it is computed now (no sync either).
            size = values.numel() * values.element_size()
            if self._held_bytes + size <= PENDING_BYTES_LIMIT:
                queued.held, queued.version = values, version_of(values)
                self._held_bytes += size
            else:
                queued.extra = _int_abs_min(values)
            self._queued.append(queued)
            return
        if self._direct and native.eligible(values, check_storage):
            low, high = native.abs_range(values, self._result)
            if implicit_zero:
                low = 0.0
            if high == high and high != _INF:
                stats.set_finite(low, high)
            else:  # a NaN or an Inf: the second look now, on this CPU tensor (no device)
                finite_low, finite_high, has_inf = native.finite_range(values)
                if implicit_zero:
                    finite_low = 0.0
                stats.set_nonfinite(low, high, finite_low, finite_high, has_inf > 0)
            return
        if check_storage and not storage_holds(values):
            stats.note = "storage freed"
            return
        low_bits, high_bits, dtype = self._meter.reduce_bits(values)
        queued = _Queued(stats, low_bits, high_bits, dtype, implicit_zero)
        size = values.numel() * values.element_size()
        if hold and self._held_bytes + size <= PENDING_BYTES_LIMIT:
            queued.held, queued.version = values, version_of(values)
            self._held_bytes += size
        else:
            queued.extra = _second_look(values)
        self._queued.append(queued)

    def resolve(self) -> None:
        """Fill every queued tensor's stats: one host copy per device. Never raises."""
        self._direct = native.available()
        self._seen = {}
        queued, self._queued = self._queued, []
        self._held_bytes = 0
        if not queued:
            return
        try:
            with torch.no_grad():
                _resolve(queued)
        except Exception as error:  # an exotic device or subclass: say so, never break the run
            for item in queued:
                if item.stats.note == PENDING:
                    item.stats.note = f"unsupported ({type(error).__name__})"


def _magnitudes(low: float, high: float) -> tuple[float, float]:
    """(abs min, abs max) of integers whose signed range is ``low`` to ``high``, when that
    range does not hold both signs (then :func:`_int_abs_min` gives the abs min)."""
    return (0.0 if low <= 0 <= high else min(abs(low), abs(high)), max(abs(low), abs(high)))


def _int_abs_min(values: torch.Tensor) -> torch.Tensor:
    """The smallest |x| of signed integers, as a float64 scalar on their device (no sync): the
    smallest non-negative value against the largest negative one, each side read on its own
    (|x| of the type's minimum overflows: abs(-2**63) is -2**63)."""
    info = torch.iinfo(values.dtype)
    nonnegative = torch.where(values >= 0, values, info.max).amin().double()
    negative = torch.where(values < 0, values, info.min).amax().double()
    return torch.minimum(nonnegative, -negative)


def _resolve(queued: list[_Queued]) -> None:
    by_device: dict[torch.device, list[_Queued]] = {}
    for item in queued:
        by_device.setdefault(item.low.device, []).append(item)
    needs_look: list[_Queued] = []
    both_signs: list[_Queued] = []  # integers holding both signs
    for items in by_device.values():
        # float64 lows then highs per dtype (bit patterns viewed as their dtype), then the eager
        # second looks: one tensor, one host copy. One stack per dtype, not one per tensor: on
        # a GPU each op costs a launch, and a batch may hold hundreds of tensors.
        groups: dict[torch.dtype | None, list[_Queued]] = {}
        for item in items:
            groups.setdefault(item.dtype, []).append(item)
        parts, slots = [], []
        offset = 0
        for dtype, members in groups.items():
            count = len(members)
            stacked = torch.stack([m.low for m in members] + [m.high for m in members])
            parts.append((stacked if dtype is None else stacked.view(dtype)).double())
            slots.extend((m, offset + n, offset + count + n) for n, m in enumerate(members))
            offset += 2 * count
        # An integer's extra (its smallest |x|) is read below, with the other integers'.
        extras = [item for item in items if item.extra is not None and item.dtype is not None]
        parts.extend(item.extra for item in extras)
        values = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()  # the one host copy
        for item, low_slot, high_slot in slots:
            low, high = values[low_slot], values[high_slot]
            stats = item.stats
            if item.dtype is None:  # integers: magnitudes from the signed range
                if low < 0 < high:  # both signs: the smallest |x| is read below
                    stats.abs_min, stats.abs_max = low, high
                    both_signs.append(item)
                else:
                    stats.set_finite(*_magnitudes(low, high))
                continue
            if item.implicit_zero:
                low = 0.0
            if high == high and high != _INF:
                stats.set_finite(low, high)
            else:
                stats.abs_min, stats.abs_max = low, high  # finished below
                needs_look.append(item)
        for number, item in enumerate(extras):
            item.extra = values[offset + 3 * number: offset + 3 * number + 3]  # type: ignore[assignment]
    if both_signs:
        _resolve_int_abs_min(both_signs)
    if not needs_look:
        return
    # The second look of tensors that turned out to hold a NaN or an Inf (rare: bad batches).
    looks_by_device: dict[torch.device, list[_Queued]] = {}
    for item in needs_look:
        if item.extra is None:
            looks_by_device.setdefault(item.low.device, []).append(item)
    for items in looks_by_device.values():
        # Storage freed since (FSDP frees gathered weights after their forward): reading it
        # would crash the process; the values are gone, so the Inf and finite range are unknown.
        freed = [item for item in items if not storage_holds(item.held)]  # type: ignore[arg-type]
        for item in freed:
            item.extra = [_NAN, _NAN, 0.0]  # type: ignore[assignment]
            item.held = None
        items = [item for item in items if item.held is not None]
        if not items:
            continue
        found = torch.stack([_second_look(item.held) for item in items]).tolist()  # type: ignore[arg-type]
        for item, look in zip(items, found):
            item.extra = look  # type: ignore[assignment]
            if version_of(item.held) != item.version:  # type: ignore[arg-type]
                item.stats.note = CHANGED_LATER  # the second look saw later values
    for item in needs_look:
        finite_low, finite_high, has_inf = item.extra  # type: ignore[misc]
        if item.implicit_zero:
            finite_low = 0.0
        note = item.stats.note
        item.stats.set_nonfinite(item.stats.abs_min, item.stats.abs_max, finite_low, finite_high,
                                 has_inf > 0)
        if note == CHANGED_LATER:
            item.stats.note = note


def _resolve_int_abs_min(items: list[_Queued]) -> None:
    """The smallest |x| of integer tensors whose range holds both signs (labels marking
    ignored positions with -100): one more host copy per device, only for batches that have
    such tensors."""
    by_device: dict[torch.device, list[_Queued]] = {}
    for item in items:
        by_device.setdefault(item.low.device, []).append(item)
    for members in by_device.values():
        readable = []
        for item in members:
            if item.extra is None and not storage_holds(item.held):  # type: ignore[arg-type]
                item.extra = torch.zeros((), dtype=torch.float64)  # values gone: 0 bounds it
                item.held = None
            elif item.extra is None:
                readable.append(item)
                item.extra = _int_abs_min(item.held)  # type: ignore[arg-type]
        for item in readable:
            if version_of(item.held) != item.version:  # type: ignore[arg-type]
                item.stats.note = CHANGED_LATER  # read from values written after the hook
        found = torch.stack([item.extra.to(members[0].low.device)  # type: ignore[union-attr]
                             for item in members]).tolist()
        for item, abs_min in zip(members, found):
            note = item.stats.note
            low, high = item.stats.abs_min, item.stats.abs_max
            item.stats.set_finite(abs_min, max(-low, high))
            if note == CHANGED_LATER:
                item.stats.note = note


def measure_tensor(tensor: torch.Tensor, pending: PendingStats | None = None) -> TensorStats:
    """Stats of one tensor right now, with a host sync: the slow path for replays and tests,
    never for hooks. Bool, meta and empty tensors get their note."""
    note = classify(tensor)
    if note:
        stats = TensorStats()
        stats.note = note
        return stats
    pending = pending if pending is not None else PendingStats()
    stats = pending.add(tensor, hold=True)
    pending.resolve()
    return stats

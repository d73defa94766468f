"""Tensor statistics: which tensors get stats, and how they are measured without host syncs.

Hooks call :func:`classify` (attribute reads, no kernel) and hand each measurable tensor to a
:class:`PendingStats`. Dense CPU float tensors are read once by the native kernel right there
(no device, so nothing to synchronise; the values are still in cache). Every other tensor is
queued; once per batch :meth:`PendingStats.resolve` reduces them on their own device, stacks
the results and copies them to the host in one transfer per device: the batch's single host
synchronisation.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch

from . import native
from .schema import CHANGED_LATER, PENDING

__all__ = ["TensorStats", "PendingStats", "AbsMeter", "classify", "dtype_max", "version_of",
           "storage_holds", "measure_tensor", "inf_flags"]

# Tensors above this many elements are reduced in slices, so that the temporary |x| never
# needs more memory than one slice (an LLM's logits can be gigabytes).
_SLICE_ELEMENTS = 1 << 24

# Activations held for the end-of-batch reduction, at most: past this they are measured on
# their device right away (still no sync) and let go, so a large no-grad forward does not keep
# every layer's output alive until the batch ends.
PENDING_BYTES_LIMIT = 1 << 28
_SCRATCH_MIN_ELEMENTS = 1 << 18  # below this a fresh allocation is as cheap as a scratch view
_RECENT_TRANSIENT = 8  # transient tensors remembered, to measure one shared by two frames once

# Integer types of the same width: the view under which |x| is reduced.
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


class TensorStats:
    """abs min / abs max / NaN / Inf of one tensor, filled in when its batch is resolved."""

    __slots__ = ("abs_min", "abs_max", "nan", "inf", "note")

    def __init__(self) -> None:
        self.abs_min: float = math.nan
        self.abs_max: float = math.nan
        self.nan: bool = False
        self.inf: bool = False
        # "" once resolved; "pending" until then; otherwise why there are no stats.
        self.note: str = PENDING

    @property
    def nonfinite(self) -> bool:
        return self.nan or self.inf

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"TensorStats(abs_min={self.abs_min:.3g}, abs_max={self.abs_max:.3g}, "
                f"nan={self.nan}, inf={self.inf}, note={self.note!r})")


def classify(tensor: torch.Tensor) -> str:
    """Return "" when ``tensor`` gets stats, else the contract's note saying why not.

    Only reads metadata, so it is safe on meta, sparse and fake tensors and costs no kernel.
    """
    if getattr(tensor, "is_nested", False):  # before the layout: jagged ones are not strided
        return "nested"
    if tensor.layout is not torch.strided:
        return "sparse"
    if tensor.is_meta:
        return "meta"
    dtype = tensor.dtype
    if dtype.is_floating_point:
        return "empty" if tensor.numel() == 0 else ""
    if dtype.is_complex:
        return "complex"
    if dtype is torch.bool:
        return "bool"
    if tensor.is_quantized:
        return "quantized"
    return "int"


def storage_holds(tensor: torch.Tensor) -> bool:
    """False when the tensor's storage is smaller than the tensor (FSDP frees parameter storage
    between forwards; ``storage().resize_(0)`` does the same): reading it, even with torch's own
    ops, would crash the process."""
    try:
        if tensor.is_contiguous():
            span = tensor.numel()
        else:
            span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        needed = (tensor.storage_offset() + span) * tensor.element_size()
        return tensor.untyped_storage().nbytes() >= needed
    except Exception:  # no storage to look at (a wrapper subclass): its own ops decide
        return True


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
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return float(torch.finfo(dtype).max)
    return math.inf


def inf_flags(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor holds an Inf: the second look for tensors that hold a NaN, whose
    abs max (NaN) hides any Inf. One host copy for all of them; only NaN batches pay for it."""
    if not tensors:
        return []
    with torch.no_grad():
        found = [torch.isinf(tensor.detach()).any() for tensor in tensors]
        if len({flag.device for flag in found}) > 1:
            found = [flag.cpu() for flag in found]
        return [bool(flag) for flag in torch.stack(found).tolist()]


def measure_tensor(tensor: torch.Tensor, meter: AbsMeter | None = None) -> TensorStats:
    """Stats of one measurable tensor right now, with a host sync: the slow path for replays
    and tests, never for hooks. NaN hides Inf from the max, so a NaN tensor gets a second look."""
    stats = TensorStats()
    try:
        low, high = (meter or _PLAIN_METER).measure(tensor)
    except Exception as error:  # an exotic subclass: say so, never break the caller
        stats.note = f"unsupported ({type(error).__name__})"
        return stats
    stats.note = ""
    if high != high or low != low:
        stats.nan = True
        stats.inf = inf_flags([tensor])[0]
    else:
        stats.abs_min, stats.abs_max, stats.inf = low, high, high == math.inf
    return stats


class AbsMeter:
    """abs min and abs max of tensors, as device scalars (no sync) or floats (one sync).

    Two kernels per tensor: |x|, then one min/max pass over the *bit patterns* of |x| viewed
    as integers of the same width. For non-negative IEEE floats the integer order is the
    numeric order, with +Inf above every finite value and NaN above +Inf, so the integer
    min/max are exactly abs_min and abs_max and a NaN anywhere becomes the max; on CPU the
    integer reduction runs 2-4x faster than the float one (no NaN handling to vectorise).
    For tensors of 256K elements and more, |x| goes into a reusable scratch buffer (per device
    and dtype, at most 2**24 elements; bigger tensors go slice by slice): on CPU a fresh
    allocation the size of the logits costs more in page faults than the reduction itself.
    Callers run it under ``torch.no_grad()``; one meter per thread.
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
        """(abs_min, abs_max) as floats: the slow path (replay, tests); NaN as in reduce()."""
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


_PLAIN_METER = AbsMeter(use_scratch=False)


class PendingStats:
    """The stats of one batch's tensors: measured on the spot or queued until the batch ends.

    Dense CPU float tensors go to the native kernel (:mod:`.native`) as they are seen, while
    they are still in cache, and are not held afterwards. Every other tensor (GPU, odd
    layouts, or no kernel) is queued with the :class:`TensorStats` it will fill, and reduced
    on its device by :meth:`resolve` with one host copy per device.

    A tensor seen twice in the same version (a module's input that is the previous module's
    output) is measured once and its stats object shared: ``id`` plus ``_version`` identify
    it; a queued tensor's reference (a measured one's weak reference) keeps a reused ``id``
    from being mistaken for it.
    """

    __slots__ = ("tensors", "versions", "stats", "reduced", "_index", "_device", "_mixed_devices",
                 "_meter", "_bytes", "_direct", "_measured", "_nan_held", "_result", "_transient",
                 "_recent")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.stats: list[TensorStats] = []
        # Device results of tensors reduced early (before an in-place module overwrites them).
        self.reduced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._index: dict[int, int] = {}
        self._device: torch.device | None = None
        self._mixed_devices = False
        self._meter = AbsMeter()
        self._bytes = 0
        self._direct = native.available()  # builds or loads the kernel now, not in the first batch
        # id -> (weak reference, version, stats) of the tensors the kernel measured this batch.
        self._measured: dict[int, tuple[weakref.ref, int, TensorStats]] = {}
        # Measured tensors holding a NaN, kept to the batch end to look for an Inf it hides.
        self._nan_held: list[tuple[torch.Tensor, TensorStats]] = []
        self._result = native.result_buffer()  # callers hold the watch's lock: one is enough
        # Tensors not to be held (gradients): [abs_min, abs_max, has_inf] reduced on their
        # device at once, read back at resolve() with the rest.
        self._transient: list[tuple[TensorStats, torch.Tensor]] = []
        # id -> (weak reference, version, stats) of the last few transient tensors: a module's
        # grad_input is usually the next module's grad_output, measured once.
        self._recent: dict[int, tuple[weakref.ref, int, TensorStats]] = {}

    def __len__(self) -> int:
        return len(self.tensors) + len(self._measured) + len(self._transient)

    def add(self, tensor: torch.Tensor) -> TensorStats:
        """Measure or queue ``tensor`` (already classified as measurable); return its stats."""
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor: no version counter
            version = -1
        key = id(tensor)
        if self._direct:
            seen = self._measured.get(key)
            if seen is not None and seen[1] == version and seen[0]() is tensor:
                return seen[2]
        position = self._index.get(key)
        if position is not None and self.versions[position] == version \
                and self.tensors[position] is tensor:
            return self.stats[position]
        stats = TensorStats()
        # The kernel refuses freed storage (FSDP); such a tensor is queued and resolve() notes it.
        if self._direct and native.eligible(tensor):
            return self._measure(tensor, key, version, stats)
        if not self.tensors:
            self._device = tensor.device
        elif not self._mixed_devices and tensor.device != self._device:
            self._mixed_devices = True  # a model split across devices: one sync per device
        self._index[key] = len(self.tensors)
        self.tensors.append(tensor)
        self.versions.append(version)
        self.stats.append(stats)
        self._bytes += tensor.numel() * tensor.element_size()
        if self._bytes > PENDING_BYTES_LIMIT:
            self._measure_held()
        return stats

    def _measure(self, tensor: torch.Tensor, key: int, version: int, stats: TensorStats) -> TensorStats:
        try:
            low, high = native.abs_range(tensor, self._result)
        except Exception as error:  # never break the forward; the cell says why
            stats.note = f"unsupported ({type(error).__name__})"
            return stats
        stats.note = ""
        if high != high:  # the contract: abs_min and abs_max both NaN (they are already)
            stats.nan = True
            self._nan_held.append((tensor, stats))
        else:
            stats.abs_min, stats.abs_max, stats.inf = low, high, high == math.inf
        self._measured[key] = (weakref.ref(tensor), version, stats)
        return stats

    def _measure_held(self) -> None:
        """Measure every held tensor now, on its device (no sync), and let go of it."""
        with torch.no_grad():
            for position, tensor in enumerate(self.tensors):
                if tensor is None or position in self.reduced or not storage_holds(tensor):
                    continue
                try:
                    self.reduced[position] = self._meter.reduce(tensor)
                    self.tensors[position] = None
                except Exception:  # kept: resolve() reports it
                    pass
        self._index.clear()  # a released tensor seen again is simply measured again
        self._bytes = 0

    def add_transient(self, tensor: torch.Tensor) -> TensorStats:
        """Measure ``tensor`` (classified as measurable) without holding on to it.

        For gradients: the backward pass frees them as it goes, and holding them to the end
        would keep every activation gradient alive. CPU tensors go to the native kernel; others
        are reduced on their device now (no host sync) and only the three numbers are kept.
        """
        version = version_of(tensor)
        key = id(tensor)
        recent = self._recent.get(key)
        if recent is not None and recent[1] == version and recent[0]() is tensor:
            return recent[2]
        stats = TensorStats()
        with torch.no_grad():
            detached = tensor.detach()
            measured = None
            if self._direct and native.eligible(detached):
                try:
                    measured = native.abs_range(detached, self._result)
                except Exception:
                    measured = None
            try:
                if measured is not None and measured[1] == measured[1]:
                    stats.abs_min, stats.abs_max = measured
                    stats.inf, stats.note = measured[1] == math.inf, ""
                else:
                    low, high = _PLAIN_METER.reduce(detached)
                    result = torch.stack((low.double(), high.double(),
                                          torch.isinf(detached).any().double()))
                    self._transient.append((stats, result))
            except Exception as error:  # exotic tensor subclass: report, never break backward
                stats.note = f"unsupported ({type(error).__name__})"
        if len(self._recent) >= _RECENT_TRANSIENT:
            del self._recent[next(iter(self._recent))]
        try:
            self._recent[key] = (weakref.ref(tensor), version, stats)
        except TypeError:  # no weak references to this kind of tensor: no reuse
            pass
        return stats

    def reduce_now(self, tensor: torch.Tensor) -> TensorStats:
        """Queue ``tensor`` and reduce it on its device right away, without a host sync.

        Used just before a module that writes into its input (``inplace=True``), so the
        stats describe the values as they were, not as they will be.
        """
        stats = self.add(tensor)
        position = self._index.get(id(tensor))
        if position is not None and self.stats[position] is stats and position not in self.reduced \
                and storage_holds(tensor):
            with torch.no_grad():
                try:
                    self.reduced[position] = _PLAIN_METER.reduce(tensor)  # no scratch: kept to resolve
                except Exception:  # resolve() will report it
                    pass
        return stats

    def resolve(self) -> None:
        """Reduce every queued tensor and fill its stats; one host copy per device. Never raises."""
        self._direct = native.available()
        if self._measured:
            self._measured = {}
        if self._recent:
            self._recent = {}
        if self._nan_held:
            held, self._nan_held = self._nan_held, []
            for (_, stats), has_inf in zip(held, inf_flags([tensor for tensor, _ in held])):
                stats.inf = has_inf
        if self._transient:
            self._resolve_transient()
        if not self.tensors:
            return
        tensors, versions, stats, reduced = self.tensors, self.versions, self.stats, self.reduced
        self.tensors, self.versions, self.stats, self.reduced, self._index = [], [], [], {}, {}
        self._bytes = 0
        mixed, self._mixed_devices = self._mixed_devices, False
        with torch.no_grad():
            if not mixed:
                _resolve_group(self._meter, tensors, versions, stats, reduced, range(len(tensors)))
                return
            by_device: dict[torch.device, list[int]] = {}
            for position, tensor in enumerate(tensors):
                device = tensor.device if tensor is not None else reduced[position][0].device
                by_device.setdefault(device, []).append(position)
            for positions in by_device.values():
                _resolve_group(self._meter, tensors, versions, stats, reduced, positions)


    def _resolve_transient(self) -> None:
        transient, self._transient = self._transient, []
        by_device: dict[torch.device, list[int]] = {}
        for position, (_, result) in enumerate(transient):
            by_device.setdefault(result.device, []).append(position)
        for positions in by_device.values():
            values = torch.stack([transient[p][1] for p in positions]).tolist()
            for position, (low, high, has_inf) in zip(positions, values):
                stats = transient[position][0]
                stats.nan = high != high
                stats.abs_min, stats.abs_max = (math.nan, math.nan) if stats.nan else (low, high)
                stats.inf = high == math.inf or has_inf > 0
                stats.note = ""


def _resolve_group(meter: AbsMeter, tensors: list[torch.Tensor], versions: list[int], stats: list[TensorStats],
                   reduced: dict[int, tuple[torch.Tensor, torch.Tensor]], positions: Iterable[int]) -> None:
    # (position, abs_min, abs_max) per measured tensor; abs_max is NaN where a NaN is.
    results: list[tuple[int, float, float]] = []
    _reduce_with_torch(meter, tensors, versions, stats, reduced, positions, results)
    nan_positions: list[int] = []
    inf = math.inf
    for position, low, high in results:
        cell = stats[position]
        cell.nan = high != high or low != low
        # The contract: both are NaN where the tensor holds a NaN (the bit patterns would
        # still give the smallest finite |x| as abs_min).
        cell.abs_min, cell.abs_max = (math.nan, math.nan) if cell.nan else (low, high)
        cell.inf = high == inf
        tensor = tensors[position]
        cell.note = "" if tensor is None or version_of(tensor) == versions[position] \
            else CHANGED_LATER
        if cell.nan and position not in reduced:
            nan_positions.append(position)
    # A NaN hides any Inf from max(); only batches that hold a NaN pay for this second look.
    for position, has_inf in zip(nan_positions, inf_flags([tensors[p] for p in nan_positions])):
        stats[position].inf = has_inf


def _reduce_with_torch(meter: AbsMeter, tensors: list[torch.Tensor], versions: list[int],
                       stats: list[TensorStats], reduced: dict[int, tuple[torch.Tensor, torch.Tensor]],
                       positions: Iterable[int], results: list[tuple[int, float, float]]) -> None:
    """The portable path: torch reductions on each tensor's device, one host copy for all."""
    # Results grouped by the float dtype they encode: (positions, lows, highs). Tensors reduced
    # early already hold float values (key None).
    groups: dict[torch.dtype | None, tuple[list[int], list[torch.Tensor], list[torch.Tensor]]] = {}
    for position in positions:
        early = reduced.get(position) if reduced else None
        if early is not None:
            if tensors[position] is not None:
                versions[position] = version_of(tensors[position])  # measured before the change
            low, high, dtype = early[0], early[1], None
        elif not storage_holds(tensors[position]):  # freed since it was queued
            stats[position].note = "storage freed"
            continue
        else:
            try:
                low, high, dtype = meter.reduce_bits(tensors[position])
            except Exception as error:  # an exotic tensor subclass: report, never crash the forward
                stats[position].note = f"unsupported ({type(error).__name__})"
                continue
        group = groups.get(dtype)
        if group is None:
            group = groups[dtype] = ([], [], [])
        group[0].append(position)
        group[1].append(low)
        group[2].append(high)
    if not groups:
        return
    parts = []
    for dtype, (_, lows, highs) in groups.items():
        part = torch.stack(lows + highs)
        parts.append(part if dtype is None else part.view(dtype))
    # The one host sync; cat promotes mixed dtypes to one that holds every value exactly.
    values = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    offset = 0
    for members, _, _ in groups.values():
        count = len(members)
        for slot, position in enumerate(members):
            results.append((position, values[offset + slot], values[offset + count + slot]))
        offset += 2 * count

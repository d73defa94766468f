"""The sentinel's checks: does any float leaf of an output, or any gradient, hold a NaN or Inf?

One check covers a list of labelled tensors and answers with the labels of the non-finite ones,
exactly (``nan``/``inf`` flags as the frames would show them), at the cost of one small host
read at most:

- dense CPU tensors go to the native kernel (:mod:`nanwidget.core.native`), which reads each
  once where it lies: nothing is copied and nothing waits for a device;
- every other tensor (GPU, odd layouts, or no kernel) gets a device-side largest |x| (the
  infinity norm; gradients on a GPU: ``torch._foreach_norm``, one fused kernel per device and
  dtype, accumulated in float32 or float64). A NaN or Inf anywhere makes that number
  non-finite. The numbers of every device are stacked and copied to the host together:
  :meth:`NonFiniteCheck.read` is the one host read. A non-finite number is then confirmed
  exactly on its tensor (an overflowing norm is no false alarm).

Both ways measure the tensors' largest |x| on the way (both, for an unfused check, and the
smallest |x| too on CPU): :attr:`NonFiniteCheck.abs_max` gives what the sentinel checked
its magnitude, at no extra read.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from .. import native
from ..stats import (PLAIN_TENSOR_TYPES, functorch_unwrapped, local_shard, measure_tensor,
                     plain_view, storage_holds)
from ..walk import tensor_leaves

__all__ = ["NonFiniteCheck", "BadTensor", "float_leaves", "checkable", "device_numbers"]

_Tensor = torch.Tensor
_STRIDED = torch.strided


class BadTensor:
    """A checked tensor that holds a NaN or an Inf."""

    __slots__ = ("label", "nan", "inf", "position")

    def __init__(self, label: str, nan: bool, inf: bool, position: int = 0) -> None:
        self.label = label
        self.nan = nan
        self.inf = inf
        self.position = position  # in the order the tensors were given

    @property
    def kind(self) -> str:
        return "nan+inf" if self.nan and self.inf else ("nan" if self.nan else "inf")

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"BadTensor({self.label!r}, {self.kind})"


def checkable(tensor: torch.Tensor) -> torch.Tensor | None:
    """The dense real tensor whose values decide whether ``tensor`` holds a NaN/Inf, or None
    when it holds no floating-point values (integers, bools, meta or empty tensors), or when it
    is a tensor subclass whose values cannot be read (warned about once per class)."""
    if type(tensor) is _Tensor and tensor.layout is _STRIDED and not tensor.is_nested \
            and tensor.dtype.is_floating_point and not tensor.is_meta and tensor.numel():
        return tensor  # the usual one (every gradient, every batch): what the rules below return
    if type(tensor) not in PLAIN_TENSOR_TYPES:
        tensor = local_shard(tensor)  # a DTensor (FSDP2 gradients): this rank's shard
        plain = plain_view(tensor)  # other subclasses: their values, without their own code
        if plain is None:
            warnings.warn(f"nanwidget: values of {type(tensor).__name__} (a tensor subclass "
                          "nanwidget cannot read) are not checked for NaN/Inf", RuntimeWarning,
                          stacklevel=2)
            return None
        tensor = plain
    try:
        if getattr(tensor, "is_nested", False):
            try:
                packed = tensor.values()  # jagged: its packed values
            except Exception:
                packed = None
            if packed is None or packed.is_nested:  # strided nested: its components, joined
                packed = torch.cat([part.reshape(-1) for part in tensor.unbind()])
            tensor = packed
        elif tensor.layout is torch.sparse_coo:
            # duplicate indices add up (two finite values can make an Inf)
            tensor = (tensor if tensor.is_coalesced() else tensor.coalesce())._values()
        elif tensor.layout is not torch.strided:  # compressed sparse layouts
            tensor = tensor.values()
    except (RuntimeError, AttributeError):
        return None
    if tensor.is_meta or tensor.numel() == 0:
        return None
    if tensor.is_complex():
        return torch.view_as_real(tensor.resolve_conj())
    if not tensor.dtype.is_floating_point:
        return None
    return tensor


def float_leaves(output: Any, role: str = "output", unread: list[str] | None = None
                 ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(role, leaf, values)`` of every leaf of ``output`` (any structure) holding float
    values; ``values`` is :func:`checkable` of the leaf. A leaf whose storage was freed (or
    shrunk) holds no values to check: reading it would crash the process. ``unread``: gets
    ``"role (why)"`` of each leaf that cannot be read (an iterator)."""
    if type(output) is _Tensor and output.dtype.is_floating_point and output.layout is _STRIDED \
            and not output.is_meta and not output.is_nested and output.numel():
        # the common case: one dense float tensor (within vmap or grad: the values it wraps)
        values = functorch_unwrapped(output)
        return [(role, output, values)] if storage_holds(values) else []
    found = []
    for leaf_role, leaf in tensor_leaves(output, role, unread):
        values = checkable(functorch_unwrapped(leaf))
        if values is not None and storage_holds(values):
            found.append((leaf_role, leaf, values))
    return found


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class NonFiniteCheck:
    """A check of labelled tensors, started at once and read later (see the module docstring).

    ``items``: ``(label, values)`` with ``values`` from :func:`checkable` (or None to skip).
    ``fused``: reduce device tensors with one ``torch._foreach_norm`` per device and dtype
    (gradients); else one infinity norm per tensor (outputs, a few leaves). ``result``: a
    :func:`nanwidget.core.native.result_buffer` to reuse (one per thread).

    Once read, an unfused check with nothing bad knows its tensors' magnitude: ``abs_max``
    (the largest |x| of all, with ``abs_max_dtype`` its tensor's dtype) and ``abs_min`` (the
    smallest, NaN when only a device measured them); NaN otherwise.
    """

    __slots__ = ("bad", "pending", "numbers", "checked", "abs_max", "abs_min", "abs_max_dtype",
                 "_fused")

    def __init__(self, items: Iterable[tuple[str, torch.Tensor | None]], *, fused: bool = False,
                 result: Any = None) -> None:
        self.bad: list[BadTensor] = []
        # (position, label, tensor) whose verdict waits for read(), in the order of ``numbers``.
        self.pending: list[tuple[int, str, torch.Tensor]] = []
        self.numbers: torch.Tensor | None = None
        self.checked = 0
        self.abs_max = self.abs_min = math.nan
        self.abs_max_dtype: torch.dtype | None = None
        self._fused = fused
        direct = native.available()
        if direct and result is None:
            result = native.result_buffer()
        grouped: dict[tuple[torch.device, torch.dtype], list[tuple[int, str, torch.Tensor]]] = {}
        # Locals in the loop (one pass per gradient, every training step), stored once after it.
        contiguous_range = native.contiguous_reader()
        checked = 0
        abs_max = abs_min = math.nan
        abs_max_dtype = None
        for position, (label, values) in enumerate(items):
            if values is None:
                continue
            checked += 1
            found = contiguous_range(values, result) if direct else None  # the usual
            if found is None and direct and native.eligible(values):  # any dense layout
                found = native.abs_range(values, result)
            if found is not None:  # read by the kernel where it lies, no autograd
                low, high = found
                if high != high:
                    self.bad.append(BadTensor(label, True, _has_inf(values), position))
                elif high == math.inf:
                    self.bad.append(BadTensor(label, False, True, position))
                elif not high <= abs_max:  # also the first (abs_max NaN)
                    abs_max, abs_max_dtype = high, values.dtype
                if not low >= abs_min:
                    abs_min = low
                continue
            grouped.setdefault((values.device, values.dtype), []).append(
                (position, label, values.detach()))
        self.checked = checked
        self.abs_max, self.abs_min, self.abs_max_dtype = abs_max, abs_min, abs_max_dtype
        if grouped:
            with torch.no_grad():
                self._start_device(grouped, fused)

    def _start_device(self, grouped: dict, fused: bool) -> None:
        parts: list[torch.Tensor] = []
        for (device, dtype), members in grouped.items():
            # On a GPU one fused kernel for all the gradients; on CPU (the kernel refused them)
            # a loop of sums is faster than the foreach fallback.
            parts.append(device_numbers([t for _, _, t in members], dtype,
                                        fused=fused and device.type != "cpu"))
            self.pending.extend(members)
        if len(parts) > 1:  # several devices or dtypes: one float64 tensor on the first device
            target = parts[0].device
            parts = [p.to(target, dtype=torch.float64, non_blocking=True) for p in parts]
        self.numbers = parts[0] if len(parts) == 1 else torch.cat(parts)

    @property
    def on_device(self) -> bool:
        """Whether :meth:`read` will copy numbers from a device other than the CPU."""
        return self.numbers is not None and self.numbers.device.type != "cpu"

    @property
    def waiting(self) -> bool:
        """Whether :meth:`read` still has device numbers to copy."""
        return self.numbers is not None

    @staticmethod
    def read_together(checks: list[NonFiniteCheck]) -> None:
        """Copy the device numbers of several checks to the host in one read; each check's
        :meth:`read` then only confirms its suspects."""
        waiting = [check for check in checks if check.numbers is not None]
        if len(waiting) < 2:
            return
        parts = [check.numbers for check in waiting]
        target = parts[0].device
        values = torch.cat([p.to(target, non_blocking=True) for p in parts]).cpu()
        offset = 0
        for check, part in zip(waiting, parts):
            check.numbers = values[offset: offset + part.numel()]
            offset += part.numel()

    def read(self) -> list[BadTensor]:
        """The non-finite tensors (copies the device numbers to the host once, then confirms
        exactly the tensors whose number is not finite)."""
        numbers, self.numbers = self.numbers, None
        if numbers is not None:
            values = numbers.tolist()  # the one host read
            suspects = [self.pending[i] for i, value in enumerate(values) if not math.isfinite(value)]
            if not self._fused and not suspects:  # each number is its tensor's largest |x|
                largest = max(range(len(values)), key=values.__getitem__)
                if not values[largest] <= self.abs_max:
                    self.abs_max, self.abs_max_dtype = values[largest], self.pending[largest][2].dtype
                self.abs_min = math.nan  # a device measured some: no smallest |x| for them
            self.pending = []
            for position, label, tensor in suspects:
                stats = measure_tensor(tensor)
                if stats.nan or stats.inf:
                    self.bad.append(BadTensor(label, stats.nan, stats.inf, position))
            self.bad.sort(key=lambda bad: bad.position)
        if self.bad:
            self.abs_max = self.abs_min = math.nan
        return self.bad


_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def device_numbers(tensors: list[torch.Tensor], dtype: torch.dtype, *, fused: bool) -> torch.Tensor:
    """One number per tensor (all of ``dtype``, on one device), computed where they lie, as
    a 1-D tensor of a float dtype: non-finite whenever the tensor holds a NaN or an Inf.
    ``fused``: L2 norms by one ``torch._foreach_norm`` (non-finite, rarely, also when finite
    values overflow the accumulation); else each tensor's largest |x| (its infinity norm: a
    max keeps a NaN, and never overflows, so it is exact in the tensor's own dtype). A single
    tensor's number is a view of its norm: on a GPU every op costs a launch, and the sentinel
    checks one output per batch."""
    if fused and dtype in _NORM_DTYPES:
        numbers = torch._foreach_norm(tensors, 2, dtype=_accumulator(dtype))
    else:
        if dtype not in _NORM_DTYPES:  # float8 and friends: norms need a real float
            tensors = [t.float() for t in tensors]
        numbers = [torch.linalg.vector_norm(t, math.inf) if t.numel() else t.new_zeros(())
                   for t in tensors]
    return numbers[0].reshape(1) if len(numbers) == 1 else torch.stack(numbers)


def _has_inf(tensor: torch.Tensor) -> bool:
    with torch.no_grad():
        return bool(torch.isinf(tensor).any())

"""The sentinel's checks: does any float leaf of an output, or any gradient, hold a NaN or Inf?

One check covers a list of labelled tensors and answers with the labels of the non-finite ones,
exactly (``nan``/``inf`` flags as the frames would show them), at the cost of one small host
read at most:

- dense CPU tensors go to the native kernel (:mod:`nanwidget.core.native`), which reads each
  once where it lies: nothing is copied and nothing waits for a device;
- every other tensor (GPU, odd layouts, or no kernel) gets a device-side sum (gradients on a
  GPU: ``torch._foreach_norm``, one fused kernel per device and dtype), accumulated in float32
  or float64. A NaN or Inf anywhere makes that number non-finite; finite values make it finite
  unless they are large enough to overflow the sum. The numbers of every device are stacked and
  copied to the host together: :meth:`NonFiniteCheck.read` is the one host read. A non-finite
  number is then confirmed exactly on its tensor (an overflowing sum is no false alarm).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from .. import native
from ..stats import local_shard, measure_tensor
from ..walk import iter_leaves

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
    when it holds no floating-point values (integers, bools, meta or empty tensors)."""
    tensor = local_shard(tensor)  # a DTensor (FSDP2 gradients): this rank's shard, no collective
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
            tensor = tensor._values()
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


def float_leaves(output: Any, role: str = "output") -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(role, leaf, values)`` of every leaf of ``output`` (any structure) holding float
    values; ``values`` is :func:`checkable` of the leaf."""
    if type(output) is _Tensor and output.dtype.is_floating_point and output.layout is _STRIDED \
            and not output.is_meta and not output.is_nested and output.numel():
        return [(role, output, output)]  # the common case: one dense float tensor
    found = []
    for leaf_role, leaf in iter_leaves(output, role):
        if isinstance(leaf, _Tensor):
            values = checkable(leaf)
            if values is not None:
                found.append((leaf_role, leaf, values))
    return found


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class NonFiniteCheck:
    """A check of labelled tensors, started at once and read later (see the module docstring).

    ``items``: ``(label, values)`` with ``values`` from :func:`checkable` (or None to skip).
    ``fused``: reduce device tensors with one ``torch._foreach_norm`` per device and dtype
    (gradients); else one sum per tensor (outputs, a few leaves). ``result``: a
    :func:`nanwidget.core.native.result_buffer` to reuse (one per thread).
    """

    __slots__ = ("bad", "pending", "numbers", "checked")

    def __init__(self, items: Iterable[tuple[str, torch.Tensor | None]], *, fused: bool = False,
                 result: Any = None) -> None:
        self.bad: list[BadTensor] = []
        # (position, label, tensor) whose verdict waits for read(), in the order of ``numbers``.
        self.pending: list[tuple[int, str, torch.Tensor]] = []
        self.numbers: torch.Tensor | None = None
        self.checked = 0
        direct = native.available()
        if direct and result is None:
            result = native.result_buffer()
        grouped: dict[tuple[torch.device, torch.dtype], list[tuple[int, str, torch.Tensor]]] = {}
        for position, (label, values) in enumerate(items):
            if values is None:
                continue
            self.checked += 1
            if direct and native.eligible(values):
                _, high = native.abs_range(values, result)  # reads the data, no autograd
                if high != high:
                    self.bad.append(BadTensor(label, True, _has_inf(values), position))
                elif high == math.inf:
                    self.bad.append(BadTensor(label, False, True, position))
                continue
            grouped.setdefault((values.device, values.dtype), []).append(
                (position, label, values.detach()))
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
        if len(parts) > 1:
            target = parts[0].device
            parts = [p.to(target, non_blocking=True) for p in parts]
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
            self.pending = []
            for position, label, tensor in suspects:
                stats = measure_tensor(tensor)
                if stats.nan or stats.inf:
                    self.bad.append(BadTensor(label, stats.nan, stats.inf, position))
            self.bad.sort(key=lambda bad: bad.position)
        return self.bad


def device_numbers(tensors: list[torch.Tensor], dtype: torch.dtype, *, fused: bool) -> torch.Tensor:
    """One float64 number per tensor (all of ``dtype``, on one device), computed where they
    lie: non-finite whenever the tensor holds a NaN or an Inf (and, rarely, when finite values
    overflow the accumulation). ``fused``: L2 norms by one ``torch._foreach_norm``; else sums."""
    accumulator = _accumulator(dtype)
    if fused and dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        numbers = torch._foreach_norm(tensors, 2, dtype=accumulator)
    else:
        numbers = [t.sum(dtype=accumulator) for t in tensors]
    return torch.stack(numbers).double()


def _has_inf(tensor: torch.Tensor) -> bool:
    with torch.no_grad():
        return bool(torch.isinf(tensor).any())

"""Entries: what a frame says about each tensor a module call touched.

One :class:`EntryBuilder` turns a module's weights, inputs, outputs or gradients into entries
for every recording path (the live watch, a trace-mode replay, backward frames), so a replayed
frame equals the live frame by construction and a new tensor kind is handled in one place.
An entry is a plain tuple ``(role, stats, dtype, shape, note)`` to keep the hook cheap: ``stats``
is a :class:`~nanwidget.core.stats.TensorStats` filled when the batch resolves, or None with a
note saying why there are none.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .stats import PendingStats, TensorStats, classify, version_of
from .walk import iter_leaves

__all__ = ["Entry", "EntryBuilder", "non_tensor_entry"]

Entry = tuple[str, "TensorStats | None", Any, Any, str]

_Tensor = torch.Tensor
_STRIDED = torch.strided
_INPUT_ROLES = tuple(f"input[{i}]" for i in range(16))


def non_tensor_entry(role: str, leaf: Any) -> Entry:
    """The entry of a leaf that is not a tensor: no stats, a note saying what it is."""
    return (role, None, None, None, "None" if leaf is None else "not a tensor")


class EntryBuilder:
    """Builds entries whose stats come from one :class:`PendingStats` (one per recorder).

    Parameters are measured again only when their version counter moved (an optimizer step
    bumps it); buffers every call, since BatchNorm updates its running statistics without
    bumping theirs. Callers hold the recorder's lock.
    """

    def __init__(self, pending: PendingStats, cache_weights: bool = True) -> None:
        self.pending = pending
        self.cache_weights = cache_weights
        # id(parameter) -> (parameter, version, entry) of its last measurement.
        self._weight_cache: dict[int, tuple[torch.Tensor, int, Entry]] = {}

    # ------------------------------------------------------------------ one tensor
    def tensor_entry(self, role: str, tensor: torch.Tensor, early: bool = False) -> Entry:
        """Entry for one tensor: measured or queued when measurable, else with its note.

        ``early``: reduce it now (on its device, no sync), because an in-place module is about
        to overwrite it.
        """
        dtype = tensor.dtype
        # Fast path for the common case, in the order of the cheapest checks; classify() has
        # the full rules and runs only for tensors that fail one of them.
        if dtype.is_floating_point and tensor.layout is _STRIDED and not tensor.is_meta \
                and not tensor.is_nested and tensor.numel():
            pending = self.pending
            stats = pending.reduce_now(tensor) if early else pending.add(tensor)
            return (role, stats, dtype, tensor.shape, "")
        note = classify(tensor)  # not "": the fast path above takes every measurable tensor
        return (role, None, dtype, None if note == "nested" else tensor.shape, note)

    def leaf_entry(self, role: str, leaf: Any, early: bool = False) -> Entry:
        """Entry for any leaf of an input or output structure."""
        if isinstance(leaf, _Tensor):
            return self.tensor_entry(role, leaf, early)
        return non_tensor_entry(role, leaf)

    def grad_entry(self, role: str, grad: Any) -> Entry:
        """Entry for a gradient: measured without being held (see :meth:`PendingStats.add_transient`)."""
        if not isinstance(grad, _Tensor):
            return non_tensor_entry(role, grad)
        note = classify(grad)
        if note:
            return (role, None, grad.dtype, None if note == "nested" else grad.shape, note)
        return (role, self.pending.add_transient(grad), grad.dtype, grad.shape, "")

    # ------------------------------------------------------------------ a module call
    def input_entries(self, args: tuple, kwargs: dict | None, entries: list[Entry],
                      early: bool = False) -> None:
        """Append the entries of positional inputs (``input[i]...``) and keyword inputs
        (``kwarg:name...``)."""
        tensor_entry = self.tensor_entry
        for position, value in enumerate(args):
            role = _INPUT_ROLES[position] if position < 16 else f"input[{position}]"
            if isinstance(value, _Tensor):
                entries.append(tensor_entry(role, value, early))
            else:
                for leaf_role, leaf in iter_leaves(value, role):
                    entries.append(self.leaf_entry(leaf_role, leaf, early))
        if kwargs:
            for key, value in kwargs.items():
                for leaf_role, leaf in iter_leaves(value, "kwarg:" + key):
                    entries.append(self.leaf_entry(leaf_role, leaf, early))

    def output_entries(self, output: Any, entries: list[Entry]) -> None:
        """Append the entries of a module's output structure (``output``, ``output[1]`` ...)."""
        if isinstance(output, _Tensor):
            entries.append(self.tensor_entry("output", output))
            return
        for role, leaf in iter_leaves(output, "output"):
            entries.append(self.leaf_entry(role, leaf))

    def weight_entries(self, module: nn.Module, entries: list[Entry]) -> None:
        """Append the entries of a module's own parameters and buffers, by their names."""
        cache = self._weight_cache
        for group in (module._parameters, module._buffers):
            if not group:
                continue
            cacheable = self.cache_weights and group is module._parameters
            for name, tensor in group.items():
                if tensor is None:
                    continue
                if not cacheable:
                    entries.append(self.tensor_entry(name, tensor))
                    continue
                cached = cache.get(id(tensor))
                # Weights change once per optimizer step at most: re-measure only then,
                # and reuse the whole entry (same stats object) until then.
                if cached is not None and cached[0] is tensor and cached[1] == version_of(tensor) \
                        and cached[2][0] == name:
                    entries.append(cached[2])
                    continue
                entry = self.tensor_entry(name, tensor)
                if entry[1] is not None:
                    cache[id(tensor)] = (tensor, version_of(tensor), entry)
                entries.append(entry)

    def forward_entries(self, module: nn.Module, has_state: bool, args: tuple, kwargs: dict,
                        output: Any, measured_inputs: list[Entry] | None = None) -> tuple[list[Entry], int]:
        """Every entry of one forward call, and the position of its first output entry.

        ``measured_inputs``: input entries a pre-hook measured before an in-place module
        overwrote them (used instead of measuring the inputs now).
        """
        entries: list[Entry] = []
        if has_state:
            self.weight_entries(module, entries)
        if measured_inputs is not None:
            entries.extend(measured_inputs)
        elif len(args) == 1 and not kwargs and isinstance(args[0], _Tensor):
            entries.append(self.tensor_entry("input[0]", args[0]))  # the usual single input
        else:
            self.input_entries(args, kwargs, entries)
        first_output = len(entries)
        self.output_entries(output, entries)
        return entries, first_output

    def forget_weights(self) -> None:
        """Drop cached weight entries: the next call measures every parameter again."""
        self._weight_cache.clear()

"""Entries: what a frame says about each tensor a module call touched.

One :class:`EntryBuilder` turns a module's weights, inputs, outputs or gradients into entries
for every recording path (the live watch, a trace-mode replay, backward frames), so a replayed
frame equals the live frame by construction and a new tensor kind is handled in one place.
An :class:`Entry` is a tuple read by name, ``(role, stats, dtype, shape, note)``: ``stats`` is a
:class:`~nanwidget.core.stats.TensorStats` filled when the batch resolves, or None with a note
saying why there are none.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import torch
from torch import nn

from .schema import DEQUANTIZED, LOCAL_SHARD, WRITTEN_HERE
from .state import optimizer_steps
from .stats import (PLAIN_TENSOR_TYPES, PendingStats, TensorStats, classify, local_shard,
                    plain_view, version_of)
from .walk import (ATTRIBUTES, LEAF, MAPPING, SEQUENCE, Unread, data_items, iter_leaves,
                   kind_of)

__all__ = ["Entry", "EntryBuilder", "non_tensor_entry", "nested_shape"]

try:  # the C field reader namedtuple uses; a property where this Python has none
    from collections import _tuplegetter  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    def _tuplegetter(index: int, doc: str) -> Any:
        return property(itemgetter(index), doc=doc)


class Entry(tuple):
    """What a frame says about one tensor (or other value) a module call touched:
    ``(role, stats, dtype, shape, note)``, read by name.

    Made as ``Entry((role, stats, dtype, shape, note))``: a plain tuple underneath, built at
    C speed on every module call (a ``NamedTuple``'s Python ``__new__`` costs several times as
    much there).
    """

    __slots__ = ()

    role: str = _tuplegetter(0, "'weight', 'input[0]', 'kwarg:mask', 'output[1]', "
                                "'grad_input[0]' ...")  # type: ignore[assignment]
    stats: TensorStats | None = _tuplegetter(1, "filled when the batch resolves; None: see "
                                                "note")  # type: ignore[assignment]
    dtype: Any = _tuplegetter(2, "torch.dtype, or None for a value that is no tensor")
    shape: Any = _tuplegetter(3, "torch.Size, or None")
    note: str = _tuplegetter(4, "'' or why there are no stats (schema.NOTES)")  # type: ignore[assignment]

    @property
    def nonfinite(self) -> bool:
        """Whether the tensor holds a NaN or an Inf."""
        stats = self[1]
        return stats is not None and (stats.nan or stats.inf)

    def replace(self, *, stats: TensorStats | None | object = ..., role: str | None = None,
                note: str | None = None) -> Entry:
        """A copy with the role, stats or note changed."""
        return Entry((self[0] if role is None else role, self[1] if stats is ... else stats,
                      self[2], self[3], self[4] if note is None else note))

    def __repr__(self) -> str:
        return (f"Entry(role={self[0]!r}, stats={self[1]!r}, dtype={self[2]!r}, "
                f"shape={self[3]!r}, note={self[4]!r})")


_Tensor = torch.Tensor
_STRIDED = torch.strided
_STEPS = optimizer_steps()  # optimizer steps seen in this process (core.writes counts them)
_INPUT_ROLES = tuple(f"input[{i}]" for i in range(16))
_SCALARS = (str, bytes, int, float, bool, complex)  # leaves as iter_leaves yields them
_NOT_IN_OBJECTS = _SCALARS + (torch.device, torch.dtype)  # no entry inside a plain object
_MAX_DIRECT_DEPTH = 32  # structure_entries recurses; deeper structures go to iter_leaves
_MAX_SHARED_ENTRIES = 4096  # shared shapes and non-tensor entries (see below), at most


# One torch.Size object per distinct shape, shared by the entries that have it: reading
# ``tensor.shape`` makes a new object each time, and one kept per entry made the garbage
# collector run on most batches of a transformer (each collection costs more than the lookups
# of a whole batch). Bounded: emptied when full.
_SHAPES: dict[torch.Size, torch.Size] = {}


def _shared_shape(shape: torch.Size) -> torch.Size:
    try:
        found = _SHAPES.get(shape)
    except TypeError:  # symbolic sizes (a fake tensor): no hash, kept as they are
        return shape
    if found is None:
        if len(_SHAPES) >= _MAX_SHARED_ENTRIES:
            _SHAPES.clear()
        found = _SHAPES[shape] = shape
    return found


def _snapshot(attributes: dict) -> list[tuple[Any, int | None]]:
    """An object's attribute values, with the version counters of its tensors."""
    return [(value, version_of(value) if isinstance(value, _Tensor) else None)
            for value in list(attributes.values())]


def _unchanged(attributes: dict, snapshot: list[tuple[Any, int | None]]) -> bool:
    """Whether the object's attributes are the very values of ``snapshot``, its tensors in the
    same versions."""
    if len(attributes) != len(snapshot):
        return False
    for value, (then, version) in zip(attributes.values(), snapshot):
        if value is not then:
            return False
        if version is not None:
            try:  # version_of(), inlined
                now = value._version
            except RuntimeError:  # an inference tensor: no version counter
                now = -1
            if now != version:
                return False
    return True


def nested_shape(tensor: torch.Tensor) -> tuple[int | None, ...]:
    """A nested tensor's shape: the size of each dimension, None for a ragged one (no single
    size: the components differ there), e.g. (2, None, 4) for two rows of 2 and 3 vectors."""
    sizes: list[int | None] = []
    for dim in range(tensor.dim()):
        try:
            size = tensor.size(dim)  # a jagged layout's ragged dim: a symbolic size ("j1")
        except RuntimeError:  # a strided layout's ragged dim: "irregular", no size
            size = None
        sizes.append(size if type(size) is int else None)
    return tuple(sizes)


def _dequantized(tensor: torch.Tensor) -> torch.Tensor | None:
    """A quantized tensor subclass's values as a plain tensor (torchao's ``dequantize()``),
    or None when it has no such method or it fails. Runs the subclass's code: event time
    only (:meth:`EntryBuilder.measure_now`)."""
    dequantize = getattr(tensor, "dequantize", None)
    if not callable(dequantize) or local_shard(tensor) is not tensor:
        return None  # a DTensor's values are its shard's: never a collective here
    try:
        with torch.no_grad():
            plain = dequantize()
    except Exception:
        return None
    return plain if type(plain) in PLAIN_TENSOR_TYPES else None


def _shape_of(tensor: torch.Tensor) -> Any:
    """The tensor's shape (a nested tensor's with None for its ragged dimensions), or None
    where it has none."""
    if tensor.is_nested:
        try:
            return nested_shape(tensor)
        except Exception:
            return None
    try:
        return _shared_shape(tensor.shape)
    except Exception:
        return None


# Entries of leaves that are no tensors, by role, shared by every frame that has one (an Entry
# is immutable): a transformers model hands each block and attention call several such
# keyword inputs (None, flags, a cache object), and one new object per leaf per call made the
# garbage collector run on most batches. Bounded: emptied when full (roles of huge structures).
_NONE_ENTRIES: dict[str, Entry] = {}
_OTHER_ENTRIES: dict[str, Entry] = {}


def non_tensor_entry(role: str, leaf: Any) -> Entry:
    """The entry of a leaf that is not a tensor: no stats, a note saying what it is."""
    if isinstance(leaf, Unread):
        return Entry((role, None, None, None, "not read"))
    shared = _NONE_ENTRIES if leaf is None else _OTHER_ENTRIES
    entry = shared.get(role)
    if entry is None:
        if len(shared) >= _MAX_SHARED_ENTRIES:
            shared.clear()
        entry = shared[role] = Entry((role, None, None, None,
                                      "None" if leaf is None else "not a tensor"))
    return entry


class EntryBuilder:
    """Builds entries whose stats come from one :class:`PendingStats` (one per recorder).

    A parameter's measurement is reused until something may have written it: its version
    counter moved (any in-place write: foreach and for-loop optimizers, ``load_state_dict``,
    ``torch._foreach_*_``), its storage changed (``p.data = ...``), any optimizer stepped
    (fused kernels move no version counter: :mod:`~nanwidget.core.writes` counts the steps),
    or, for a parameter that requires grad, a new training forward began (grad enabled, model
    in training mode: :meth:`new_forward`), so that an update the watch cannot see, such as
    ``p.data -= lr * p.grad`` or a custom kernel, shows in the next training batch. A training
    loop re-measures those parameters after every optimizer step anyway; inference forwards
    reuse the measurements. Buffers are measured every call, since BatchNorm updates its
    running statistics without bumping theirs. Callers hold the recorder's lock.
    """

    def __init__(self, pending: PendingStats, cache_weights: bool = True) -> None:
        self.pending = pending
        self.cache_weights = cache_weights
        # id(parameter) -> (parameter, version, storage pointer, entry, requires grad,
        # generation) of its last measurement.
        self._weight_cache: dict[int, tuple[torch.Tensor, int, int, Entry, bool, int]] = {}
        # (id of a module's parameter dict, name) -> id of the parameter cached for that slot.
        self._cached_slots: dict[tuple[int, str], int] = {}
        # Generations: a measurement is reused while its own is current. Frozen parameters'
        # moves on at every optimizer step; trainable ones' also at every training forward.
        self._steps_seen = _STEPS.count
        self._generation = 0
        self._training_generation = 0
        self.unread_roles: list[str] = []  # leaves left unread (iterators), for one warning
        # Role -> (object, its attribute values and their versions, its entries) of the plain
        # objects of tensors walked this batch (a transformers cache's layers, walked again at
        # every block and attention call): unchanged since, their entries are reused. Emptied
        # at the end of each batch (end_batch()).
        self._walked: dict[str, tuple[Any, list[tuple[Any, int | None]], list[Entry]]] = {}

    def end_batch(self) -> None:
        """The batch's stats were resolved: forget the objects walked in it."""
        if self._walked:
            self._walked = {}

    def new_forward(self, training: bool) -> None:
        """A root forward begins; ``training``: grad enabled and the model in training mode
        (its parameters that require grad are measured once in it: see the class docstring)."""
        if training:
            self._training_generation += 1

    # ------------------------------------------------------------------ one tensor
    def tensor_entry(self, role: str, tensor: torch.Tensor) -> Entry:
        """Entry for one tensor: measured now when measurable, else with its note."""
        if type(tensor) in PLAIN_TENSOR_TYPES:
            stats = self.pending.seen(tensor)
            if stats is not None and not tensor.is_nested:  # measured already in this batch
                return Entry((role, stats, tensor.dtype, _shared_shape(tensor.shape), ""))
            dtype = tensor.dtype
            # Fast path for the common case, in the order of the cheapest checks; classify()
            # has the full rules and runs only for tensors that fail one of them.
            if dtype.is_floating_point and tensor.layout is _STRIDED and not tensor.is_meta \
                    and not tensor.is_nested and tensor.numel():
                return Entry((role, self.pending.add(tensor), dtype, _shared_shape(tensor.shape),
                              ""))
        else:
            local = local_shard(tensor)
            if local is not tensor:  # a DTensor: this rank's shard, its shape, said in the note
                return self.tensor_entry(role, local).replace(note=LOCAL_SHARD)
            plain = plain_view(tensor)  # a subclass: its values, without its own code running
            if plain is None:
                return self._unread_subclass(role, tensor)
            tensor = plain
            dtype = tensor.dtype
        note = classify(tensor)
        shape = _shape_of(tensor)
        if note:
            return Entry((role, None, dtype, shape, note))
        return Entry((role, self.pending.add(tensor), dtype, shape, ""))

    def _fresh_entry(self, role: str, tensor: torch.Tensor) -> Entry:
        """:meth:`tensor_entry` of a tensor seldom measured already in this batch (an output,
        a weight to measure again): the fast path's checks first, without the lookup that
        ``add()`` makes anyway (it gives a tensor measured already its stats)."""
        if type(tensor) in PLAIN_TENSOR_TYPES:
            dtype = tensor.dtype
            if dtype.is_floating_point and tensor.layout is _STRIDED and not tensor.is_meta \
                    and not tensor.is_nested and tensor.numel():
                return Entry((role, self.pending.add(tensor), dtype, _shared_shape(tensor.shape),
                              ""))
        return self.tensor_entry(role, tensor)

    def _unread_subclass(self, role: str, tensor: torch.Tensor) -> Entry:
        """The entry of a tensor subclass whose values cannot be read (no single inner tensor
        holds them): noted "not read", and named in the watch's one warning about such values."""
        self.unread_roles.append(f"{role} ({type(tensor).__name__}: a tensor subclass whose "
                                 "values nanwidget cannot read)")
        try:
            dtype, shape = tensor.dtype, _shape_of(tensor)
        except Exception:
            dtype = shape = None
        return Entry((role, None, dtype, shape, "not read"))

    def leaf_entry(self, role: str, leaf: Any) -> Entry:
        """Entry for any leaf of an input or output structure."""
        if isinstance(leaf, _Tensor):
            return self.tensor_entry(role, leaf)
        if isinstance(leaf, Unread):
            self.unread_roles.append(f"{role} ({leaf.why})")
        return non_tensor_entry(role, leaf)

    def grad_entry(self, role: str, grad: Any, hold: bool = False) -> Entry:
        """Entry for a gradient: measured without being held (the backward pass frees it), or
        with ``hold`` held until the pass resolves (a parameter's ``.grad``, alive anyway: on
        a device its second look then runs only if it holds a NaN/Inf). A gradient not held is
        one a tensor hook received: nothing of it outlives the call, its storage not even asked
        (autograd sums its next gradient into it in place only while nothing else owns it)."""
        if not isinstance(grad, _Tensor):
            return non_tensor_entry(role, grad)
        if type(grad) in PLAIN_TENSOR_TYPES:
            dtype = grad.dtype
            # The common case (the checks of _fresh_entry's fast path); classify() has the
            # full rules and runs only for gradients that fail one of them.
            if dtype.is_floating_point and grad.layout is _STRIDED and not grad.is_meta \
                    and not grad.is_nested and grad.numel():
                return Entry((role, self.pending.add(grad, hold=hold, check_storage=hold), dtype,
                              _shared_shape(grad.shape), ""))
        else:
            local = local_shard(grad)
            if local is not grad:  # a DTensor gradient: this rank's shard
                return self.grad_entry(role, local, hold).replace(note=LOCAL_SHARD)
            plain = plain_view(grad)
            if plain is None:
                return self._unread_subclass(role, grad)
            grad = plain
        note = classify(grad)
        shape = _shape_of(grad)
        if note:
            return Entry((role, None, grad.dtype, shape, note))
        return Entry((role, self.pending.add(grad, hold=hold, check_storage=hold), grad.dtype,
                      shape, ""))

    # ------------------------------------------------------------------ a module call
    def input_entries(self, args: tuple, kwargs: dict | None, entries: list[Entry]) -> None:
        """Append the entries of positional inputs (``input[i]...``) and keyword inputs
        (``kwarg:name...``)."""
        tensor_entry = self.tensor_entry
        for position, value in enumerate(args):
            role = _INPUT_ROLES[position] if position < 16 else f"input[{position}]"
            if isinstance(value, _Tensor):
                entries.append(tensor_entry(role, value))
            elif value is None or isinstance(value, _SCALARS):
                entries.append(non_tensor_entry(role, value))
            else:
                self.structure_entries(value, role, entries)
        if kwargs:
            for key, value in kwargs.items():
                # One tensor, None or a flag (most keyword inputs): no walk.
                if isinstance(value, _Tensor):
                    entries.append(tensor_entry("kwarg:" + key, value))
                elif value is None or isinstance(value, _SCALARS):
                    entries.append(non_tensor_entry("kwarg:" + key, value))
                else:
                    self.structure_entries(value, "kwarg:" + key, entries)

    def output_entries(self, output: Any, entries: list[Entry]) -> None:
        """Append the entries of a module's output structure (``output``, ``output[1]`` ...)."""
        if isinstance(output, _Tensor):
            entries.append(self.tensor_entry("output", output))
            return
        self.structure_entries(output, "output", entries)

    def structure_entries(self, value: Any, role: str, entries: list[Entry],
                          _open: set[int] | None = None, _depth: int = 0,
                          _in_object: bool = False) -> None:
        """Append the entries of every leaf of ``value``, as :func:`iter_leaves` yields them
        (same roles, same order; inside a plain object, its tensors only), walking tuples,
        lists, mappings and plain objects here without its bookkeeping: a transformers cache
        object is walked on every block and attention call, a ModelOutput at every model's
        return. Other containers, and anything nested deeper than a few levels, go to
        iter_leaves."""
        if isinstance(value, _Tensor):
            entries.append(self.tensor_entry(role, value))
            return
        if value is None or isinstance(value, _SCALARS):
            if not _in_object:
                entries.append(non_tensor_entry(role, value))
            return
        walked = self._walked.get(role) if self._walked else None
        if walked is not None and walked[0] is value:
            attributes = getattr(value, "__dict__", None)
            if isinstance(attributes, dict) and _unchanged(attributes, walked[1]):
                entries.extend(walked[2])
                return
        kind = kind_of(value)
        if kind == LEAF:
            items = data_items(value)
            if items is None:
                if not _in_object:
                    entries.append(non_tensor_entry(role, value))
                return
            kind, value = MAPPING, dict(items)  # PyG's Data: walked as its mapping
        object_root = False
        if kind == SEQUENCE:
            children = [(f"{role}[{index}]", item) for index, item in enumerate(value)]
        elif kind == ATTRIBUTES:
            attributes = getattr(value, "__dict__", None)
            if not isinstance(attributes, dict) or not attributes:
                if not _in_object:
                    entries.append(non_tensor_entry(role, value))
                return
            # Inside an object only its tensors count: its flags, Nones, devices and dtypes
            # are not walked (a transformers cache holds several per layer, walked at every
            # block and attention call).
            children = [(f"{role}.{name}", item) for name, item in list(attributes.items())
                        if not (item is None or isinstance(item, _NOT_IN_OBJECTS)
                                or name.startswith("_"))]
            object_root = not _in_object
        elif kind == MAPPING:  # dicts and ModelOutputs (a model's outputs)
            children = [(f"{role}.{key}" if isinstance(key, str) else f"{role}[{key!r}]", item)
                        for key, item in list(value.items())]
        else:
            kind = None
        key = id(value)
        if _open is None:
            _open = set()
        elif key in _open:
            entries.append(self.leaf_entry(role, Unread("contains itself")))
            return
        if kind is None or _depth > _MAX_DIRECT_DEPTH:
            for leaf_role, leaf in iter_leaves(value, role, _open, _in_object):
                entries.append(self.leaf_entry(leaf_role, leaf))
            return
        _open.add(key)
        before = len(entries)
        within = _in_object or object_root
        for child_role, child in children:
            self.structure_entries(child, child_role, entries, _open, _depth + 1, within)
        _open.discard(key)
        if object_root and len(entries) == before:  # a plain object without tensors: one leaf
            entries.append(non_tensor_entry(role, value))
        if kind == ATTRIBUTES and all(type(child) in PLAIN_TENSOR_TYPES for _, child in children):
            # Only tensors walked: the identities and versions of its attributes tell whether
            # it changed (a list or dict inside could change without either).
            self._walked[role] = (value, _snapshot(attributes), entries[before:])

    def buffer_entries(self, module: nn.Module) -> dict[str, tuple[Any, int, Entry]]:
        """A module's own buffers measured now, before its forward (see
        :meth:`weight_entries`' ``buffers``): name -> (the tensor, its version, its entry)."""
        measured: dict[str, tuple[Any, int, Entry]] = {}
        for name, tensor in module._buffers.items():
            if tensor is not None:
                try:
                    entry = self._fresh_entry(name, tensor)
                except Exception:
                    entry = self._uncached_weight_entry(name, tensor)
                measured[name] = (tensor, version_of(tensor), entry)
        return measured

    def weight_entries(self, module: nn.Module, entries: list[Entry],
                       cache_weights: bool = True,
                       buffers: dict[str, tuple[Any, int, Entry]] | None = None) -> None:
        """Append the entries of a module's own parameters and buffers, by their names.
        ``cache_weights=False``: measure the parameters on every call (FSDP2 gathers new values
        into the same tensors, version counters kept, and may reuse the same storage).
        ``buffers``: the buffers as :meth:`buffer_entries` measured them before the forward.
        A buffer still the same tensor at the same version is shown as measured then: a forward
        that rewrites it through ``.data`` keeps its version counter (an EMA codebook), and
        what it read is what counts. One whose version moved was written by the forward in
        place (BatchNorm's running statistics, a subclass of it from another library too) and
        is measured now, so that a NaN the forward wrote is this batch's."""
        cache, slots = self._weight_cache, self._cached_slots
        if _STEPS.count != self._steps_seen:  # an optimizer stepped since: measure again
            self._steps_seen = _STEPS.count
            self._generation += 1
            self._training_generation += 1
        generation, training_generation = self._generation, self._training_generation
        for group in (module._parameters, module._buffers):
            if not group:
                continue
            before = buffers if group is module._buffers else None
            cacheable = self.cache_weights and cache_weights and group is module._parameters
            for name, tensor in group.items():
                if tensor is None:
                    continue
                try:
                    if not cacheable:
                        measured = before.get(name) if before is not None else None
                        if measured is not None and measured[0] is tensor \
                                and measured[1] == version_of(tensor):
                            entries.append(measured[2])
                        else:
                            entries.append(self._fresh_entry(name, tensor))
                        continue
                    cached = cache.get(id(tensor))
                    try:
                        pointer = tensor.data_ptr()
                    except Exception:  # wrapper subclasses: never served from the cache
                        pointer = -1
                    # Weights change once per optimizer step at most: re-measure only when
                    # they may have (see the class docstring), and reuse the whole entry (same
                    # stats object) until then.
                    if cached is not None and cached[0] is tensor and cached[2] == pointer \
                            and pointer != -1 and cached[3][0] == name \
                            and cached[5] == (training_generation if cached[4] else generation):
                        try:  # version_of(), inlined
                            version = tensor._version
                        except RuntimeError:  # an inference tensor: no version counter
                            version = -1
                        if cached[1] == version:
                            entries.append(cached[3])
                            continue
                    entry = self._fresh_entry(name, tensor)
                    # Only the module's own Parameters are kept: a stand-in in the slot
                    # (torch.func.functional_call's tensors, opacus' ExpandedWeight) is made
                    # anew for each call, so keeping it would only hold every one alive.
                    if entry[1] is not None and pointer != -1 \
                            and isinstance(tensor, nn.Parameter):
                        # A slot given a new Parameter (a hook loading the weights afresh on
                        # each call) drops the one it held before: the cache keeps no weight
                        # the module no longer holds.
                        slot = (id(group), name)
                        before = slots.get(slot)
                        if before is not None and before != id(tensor):
                            cache.pop(before, None)
                        slots[slot] = id(tensor)
                        trainable = tensor.requires_grad
                        cache[id(tensor)] = (tensor, version_of(tensor), pointer, entry,
                                             trainable,
                                             training_generation if trainable else generation)
                    entries.append(entry)
                except Exception:  # never the module's whole frame for one weight
                    entries.append(self._uncached_weight_entry(name, tensor))

    def _uncached_weight_entry(self, name: str, tensor: torch.Tensor) -> Entry:
        """A weight whose cache bookkeeping failed (a tensor subclass refusing reads of its own
        attributes) measured on its own; when even that fails, its row says so."""
        try:
            return self._fresh_entry(name, tensor)
        except Exception as error:
            return self._unreadable_weight(name, tensor, error)

    def _unreadable_weight(self, name: str, tensor: torch.Tensor, error: Exception) -> Entry:
        """The entry of a weight that could not be read: noted with the error, and named in
        the watch's one warning about values left unchecked."""
        why = f"{type(error).__name__}: {error}"
        self.unread_roles.append(f"{name} ({type(tensor).__name__}: reading it failed, {why})")
        return Entry((name, None, None, None, "not read"))

    def forward_entries(self, module: nn.Module, has_state: bool, args: tuple, kwargs: dict,
                        output: Any, measured_inputs: list[Entry] | None = None,
                        cache_weights: bool = True,
                        measured_buffers: dict[str, tuple[Any, int, Entry]] | None = None
                        ) -> tuple[list[Entry], int, int]:
        """Every entry of one forward call (its own weights, then its inputs, then its
        outputs), and the positions of its first input and its first output entry.

        ``measured_inputs``: input entries a pre-hook measured before the module ran (used
        instead of measuring the inputs now). Without them, an input the module wrote into
        and returned (``x.mul_(s); return x``) is shown as it was handed over, when an earlier
        frame measured it then, noted "written in place here". ``cache_weights``: see
        :meth:`weight_entries`, as are ``measured_buffers``.
        """
        entries: list[Entry] = []
        if has_state:
            self.weight_entries(module, entries, cache_weights, measured_buffers)
        first_input = len(entries)
        if measured_inputs is not None:
            entries.extend(measured_inputs)
        elif len(args) == 1 and not kwargs and isinstance(args[0], _Tensor) \
                and args[0] is not output:
            entries.append(self.tensor_entry("input[0]", args[0]))  # the usual single input
        else:
            start = len(entries)
            handed_over = self._inputs_written_here(args, output)
            self.input_entries(args, kwargs, entries)
            if handed_over:
                for index in range(start, len(entries)):
                    entry = entries[index]
                    found = handed_over.get(entry.role)
                    if found is not None:
                        entries[index] = entry.replace(stats=found, note=WRITTEN_HERE)
        first_output = len(entries)
        if isinstance(output, _Tensor):  # output_entries(), inlined for the usual case
            entries.append(self._fresh_entry("output", output))
        else:
            self.output_entries(output, entries)
        return entries, first_input, first_output

    def _inputs_written_here(self, args: tuple, output: Any) -> dict[str, TensorStats]:
        """Stats, by role, of tensor inputs the module returned after writing into them: as an
        earlier frame of this batch measured them (the values the module was handed)."""
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        found: dict[str, TensorStats] = {}
        for position, value in enumerate(args):
            if isinstance(value, _Tensor) and any(value is out for out in outputs):
                seen = self.pending.last_seen(value)
                if seen is not None and seen[0] != version_of(value):
                    found[_INPUT_ROLES[position] if position < 16 else f"input[{position}]"] = seen[1]
        return found

    def measure_weights_now(self, module: nn.Module) -> list[Entry]:
        """The module's own parameters and buffers measured right now (a host sync: for event
        time, not hooks); the cached entries of its parameters are dropped."""
        return self.measure_now([(name, tensor)
                                 for group in (module._parameters, module._buffers)
                                 for name, tensor in group.items() if tensor is not None])

    def measure_now(self, named: list[tuple[str, torch.Tensor]], note: str = "") -> list[Entry]:
        """Weights measured right now by name (event time: a host sync), with ``note`` on
        each measured one (a packed weight's)."""
        fresh = PendingStats()
        entries: list[Entry] = []
        for name, tensor in named:
            self._weight_cache.pop(id(tensor), None)
            try:
                said = note
                if type(tensor) not in PLAIN_TENSOR_TYPES:
                    # A subclass is read as the tensor it holds, none of its own code
                    # running (ExpandedWeight refuses even reads of its attributes).
                    view = plain_view(tensor)
                    if view is None:  # no one tensor holds its values (torchao's Int8Tensor)
                        view, said = _dequantized(tensor), DEQUANTIZED
                    if view is not None:
                        tensor = view
                kind = classify(tensor)
                stats = None if kind else fresh.add(tensor)
                entries.append(Entry((name, stats, tensor.dtype, _shape_of(tensor),
                                      kind or said)))
            except Exception as error:
                entries.append(self._unreadable_weight(name, tensor, error))
        fresh.resolve()
        return entries

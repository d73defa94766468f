"""Walk the nested structures modules take and return, naming each leaf by its contract role.

Roles: ``input[0]``, ``input[0][1]``, ``kwarg:attention_mask``, ``output``, ``output[1][0]``,
``output.logits`` (dataclasses, ``ModelOutput``, other string-keyed mappings and the attributes
of plain objects), ``output[3]`` (lists, tuples, non-string keys), ``output{0}`` (the n-th item
of a set, in iteration order).

No depth or size limit hides a value: the walk is iterative (any depth) and visits every leaf.
Inside a plain object (walked by its attributes) only the tensors are leaves; one without
any is one leaf itself.
A structure that contains itself is walked once (the repeat is a leaf noted as a cycle).
Iterators and generators are not read, since reading would consume them: they come back as
:class:`Unread` leaves, which the caller notes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from types import FunctionType, MethodType, ModuleType
from typing import Any

import torch

__all__ = ["data_items", "iter_leaves", "tensor_leaves", "Unread", "kind_of", "SEQUENCE",
           "MAPPING", "ATTRIBUTES", "LEAF", "OTHER"]

_Tensor = torch.Tensor
_SCALARS = (str, bytes, int, float, bool, complex, type(None))
_OPAQUE = (FunctionType, MethodType, ModuleType, type, torch.nn.Module, torch.dtype,
           torch.device)


class Unread:
    """A leaf that cannot be read without changing the program: an iterator, or a repeat."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def iter_leaves(value: Any, role: str, inside: set[int] | frozenset[int] = frozenset(),
                in_object: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield ``(role, leaf)`` for every tensor, None or other leaf object inside ``value``.
    ``inside``: ids of the containers ``value`` sits in, when a caller walks the outer levels
    itself (a repeat of one of them is a leaf noted as a cycle, as here).

    Inside a plain object (one walked by its attributes: a key/value cache and its layers,
    a user's batch object) only tensors and unreadable leaves are yielded: its flags, devices
    and unset attributes are its own business, not data (a transformers cache would add some
    twenty of them to every attention call's frame). A plain object holding none of those is
    one leaf itself. ``in_object``: ``value`` sits inside such an object (a caller walked the
    outer levels)."""
    if isinstance(value, _Tensor) or isinstance(value, _SCALARS):  # no bookkeeping for a leaf
        if not in_object or isinstance(value, _Tensor):
            yield role, value
        return
    # A stack of iterators over (role, child) pairs keeps the leaves in document order; each
    # level says whether it lies inside a plain object. The outermost plain object (``root``:
    # its role, itself, and the leaves yielded inside it so far) is one leaf if none was.
    open_containers: set[int] = set(inside)
    stack: list[tuple[int | None, Iterator[tuple[str, Any]], bool]] = [
        (None, iter(((role, value),)), in_object)]
    root: list[Any] | None = None
    while stack:
        owner, children, within = stack[-1]
        step = next(children, None)
        if step is None:
            stack.pop()
            if owner is not None:
                open_containers.discard(owner)
            if root is not None and len(stack) == root[3]:  # the outermost object is done
                if not root[2]:
                    yield root[0], root[1]
                root = None
            continue
        child_role, child = step
        if isinstance(child, _Tensor) or isinstance(child, _SCALARS):
            if not within or isinstance(child, _Tensor):
                if root is not None:
                    root[2] += 1
                yield child_role, child
            continue
        expanded = _children(child, child_role)
        if expanded is None:
            if not within:
                yield child_role, child
            continue
        if isinstance(expanded, Unread):
            if root is not None:
                root[2] += 1
            yield child_role, expanded
            continue
        key = id(child)
        if key in open_containers:
            if root is not None:
                root[2] += 1
            yield child_role, Unread("contains itself")
            continue
        open_containers.add(key)
        if not within and _KINDS.get(type(child)) == _ATTRIBUTES and type(child) is child.__class__:
            root = [child_role, child, 0, len(stack)]  # role, object, leaves, depth
            within = True
        stack.append((key, expanded, within))


# How a value of each type is walked, decided once per type (the walk meets the same few
# types on every module call: a transformers cache object and its layers, tuples, devices).
_SEQUENCE, _MAPPING, _SET, _DATACLASS, _ITERATOR, _LEAF, _ATTRIBUTES = range(7)
_KINDS: dict[type, int] = {}


def _kind_of_type(kind: type) -> int:
    if issubclass(kind, (tuple, list)):
        return _SEQUENCE
    if issubclass(kind, Mapping):
        return _MAPPING
    if issubclass(kind, (set, frozenset)):
        return _SET
    if dataclasses.is_dataclass(kind) and not issubclass(kind, type):
        return _DATACLASS
    if issubclass(kind, Iterator):
        return _ITERATOR
    if issubclass(kind, _OPAQUE) or any("__call__" in vars(k) for k in kind.__mro__):
        return _LEAF
    return _ATTRIBUTES


# What kind_of() tells a caller that walks values itself: a tuple or list, a mapping, an
# object whose public attributes are its children (or a leaf, when it has none), a leaf, or
# anything else (ask iter_leaves).
SEQUENCE, MAPPING, ATTRIBUTES, LEAF, OTHER = _SEQUENCE, _MAPPING, _ATTRIBUTES, _LEAF, -1
_WALKED_BY_CALLERS = (_SEQUENCE, _MAPPING, _ATTRIBUTES, _LEAF)


def data_items(value: Any) -> list[tuple[Any, Any]] | None:
    """The (key, value) pairs of a callable object that keeps its data in a mapping among its
    attributes (PyG's ``Data``/``Batch``: ``data(*keys)`` is callable, its tensors sit in its
    ``_store``), walked as that mapping (``data.x``); None for a callable that holds no
    tensors there (a function object: a leaf)."""
    if isinstance(value, _OPAQUE):
        return None
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict):
        return None
    for item in list(attributes.values()):
        if isinstance(item, Mapping) and not isinstance(item, type):
            try:
                items = list(item.items())
            except Exception:  # a mapping that cannot list itself
                continue
            if any(isinstance(v, _Tensor) for _, v in items):
                return items
    return None


def _mapping_children(items: list[tuple[Any, Any]], role: str) -> Iterator[tuple[str, Any]]:
    return ((f"{role}.{key}" if isinstance(key, str) else f"{role}[{key!r}]", item)
            for key, item in items)


def kind_of(value: Any) -> int:
    """How :func:`iter_leaves` walks a value that is neither a tensor nor a scalar: one of
    :data:`SEQUENCE`, :data:`MAPPING` (children ``role.key``, or ``role[key!r]`` for a key that
    is not a string, in ``items()`` order), :data:`ATTRIBUTES`, :data:`LEAF`, or :data:`OTHER`
    (sets, dataclasses, iterators, proxies: walk it with :func:`iter_leaves`)."""
    kind = type(value)
    if kind is not value.__class__:  # a proxy that says it is something else
        return OTHER
    known = _KINDS.get(kind)
    if known is None:
        try:
            known = _KINDS[kind] = _kind_of_type(kind)
        except Exception:  # an odd metaclass: the long way
            known = OTHER
    return known if known in _WALKED_BY_CALLERS else OTHER


def _children(value: Any, role: str) -> Iterator[tuple[str, Any]] | Unread | None:
    """The (role, child) pairs of a container; Unread for iterators; None for a plain leaf."""
    kind = type(value)
    if kind is value.__class__:  # else a proxy that says it is something else: the long way
        known = _KINDS.get(kind)
        if known is None:
            try:
                known = _KINDS[kind] = _kind_of_type(kind)
            except Exception:  # an odd metaclass: the long way
                known = -1
        if known == _LEAF:
            items = data_items(value)
            return None if items is None else _mapping_children(items, role)
        if known == _ATTRIBUTES:
            attributes = getattr(value, "__dict__", None)
            if isinstance(attributes, dict) and attributes:
                return ((f"{role}.{name}", item) for name, item in list(attributes.items())
                        if not name.startswith("_"))
            return None
        if known == _SEQUENCE:
            return ((f"{role}[{index}]", item) for index, item in enumerate(value))
    return _children_by_checks(value, role)


def _children_by_checks(value: Any, role: str) -> Iterator[tuple[str, Any]] | Unread | None:
    """:func:`_children` by checking the value itself (every kind, in order)."""
    if isinstance(value, (tuple, list)):
        return ((f"{role}[{index}]", item) for index, item in enumerate(value))
    if isinstance(value, Mapping):
        return ((f"{role}.{key}" if isinstance(key, str) else f"{role}[{key!r}]", item)
                for key, item in list(value.items()))
    if isinstance(value, (set, frozenset)):
        return ((f"{role}{{{index}}}", item) for index, item in enumerate(list(value)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ((f"{role}.{field.name}", getattr(value, field.name, None))
                for field in dataclasses.fields(value))
    if isinstance(value, Iterator):
        return Unread(f"{type(value).__name__}: not read (reading would consume it)")
    if isinstance(value, _OPAQUE) or callable(value):
        items = data_items(value)
        return None if items is None else _mapping_children(items, role)
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and attributes:
        return ((f"{role}.{name}", item) for name, item in list(attributes.items())
                if not name.startswith("_"))
    return None


# Values of these exact types hold no tensor: tensor_leaves leaves them out at once (a cache
# layer's flags and device, a config's numbers); subclasses are looked at the long way.
_HOLD_NO_TENSOR = frozenset({*_SCALARS, torch.device, torch.dtype})
_MAX_DIRECT_DEPTH = 32  # tensor_leaves recurses; deeper structures go to iter_leaves


def tensor_leaves(value: Any, role: str, unread: list[str] | None = None
                  ) -> list[tuple[str, torch.Tensor]]:
    """``(role, tensor)`` of every tensor leaf of ``value``: what :func:`iter_leaves` yields
    for them (same roles, same order, cycles and iterators alike), without making the roles of
    the other leaves (a model's output every batch: a ``ModelOutput`` holding a key/value cache
    object, most of whose leaves are flags and devices). ``unread`` gets ``"role (why)"`` of
    each leaf that cannot be read."""
    found: list[tuple[str, torch.Tensor]] = []
    _collect_tensors(value, role, found, unread, None, 0)
    return found


def _collect_tensors(value: Any, role: str, found: list[tuple[str, torch.Tensor]],
                     unread: list[str] | None, open_containers: set[int] | None,
                     depth: int) -> None:
    if isinstance(value, _Tensor):
        found.append((role, value))
        return
    if isinstance(value, _SCALARS):
        return
    kind = kind_of(value)
    if kind == LEAF:
        items = data_items(value)
        if items is None:
            return
        kind, value = MAPPING, dict(items)  # PyG's Data: walked as its mapping
    if kind == SEQUENCE:
        children = [(f"{role}[{index}]", item) for index, item in enumerate(value)
                    if type(item) not in _HOLD_NO_TENSOR]
    elif kind == ATTRIBUTES:
        attributes = getattr(value, "__dict__", None)
        if not isinstance(attributes, dict) or not attributes:
            return
        children = [(f"{role}.{name}", item) for name, item in list(attributes.items())
                    if type(item) not in _HOLD_NO_TENSOR and not name.startswith("_")]
    elif kind == MAPPING:
        children = [(f"{role}.{key}" if isinstance(key, str) else f"{role}[{key!r}]", item)
                    for key, item in list(value.items()) if type(item) not in _HOLD_NO_TENSOR]
    else:
        children = None
    if open_containers is None:
        open_containers = set()
    elif id(value) in open_containers:
        if unread is not None:
            unread.append(f"{role} (contains itself)")
        return
    if children is None or depth > _MAX_DIRECT_DEPTH:  # sets, dataclasses, iterators, proxies
        for leaf_role, leaf in iter_leaves(value, role, open_containers):
            if isinstance(leaf, _Tensor):
                found.append((leaf_role, leaf))
            elif unread is not None and isinstance(leaf, Unread):
                unread.append(f"{leaf_role} ({leaf.why})")
        return
    key = id(value)
    open_containers.add(key)
    for child_role, child in children:
        if isinstance(child, _Tensor):
            found.append((child_role, child))
        else:
            _collect_tensors(child, child_role, found, unread, open_containers, depth + 1)
    open_containers.discard(key)

"""A replay's own copies of a forward's inputs that are neither tensors nor plain values.

A forward may change the objects it is given: a ``transformers`` cache grows with every call
(a ``DynamicCache`` appends each layer's keys and values), a dict or a list may be filled in.
A held batch keeps, for each such input, a copy of its structure made when the batch started:
containers and objects are copied, the tensors in them are shared (they are inputs like the
others: their version counters tell whether something wrote into them since). Each replay runs
on a fresh copy of that copy, so the caller's objects are never handed to a replay and the held
batch stays as it was. An input that cannot be copied makes its batch unreplayable, with the
reason (:class:`UncopiedInput`).

Kept as they are (not data, or never changed in place): tensors, numbers, strings, ``None``,
dtypes, devices, modules, classes, functions and other callables.
"""

from __future__ import annotations

import copy
import copyreg
from collections.abc import Iterator
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any

import torch
from torch import nn

from ..walk import data_items
from .static_cache import fresh_layer, hold_layer, is_static_layer

__all__ = ["copy_structure", "UncopiedInput", "needs_copy"]

_SHARED = (torch.Tensor, str, bytes, int, float, bool, complex, type(None), torch.dtype,
           torch.device, torch.layout, torch.memory_format, torch.Size, nn.Module, type,
           FunctionType, BuiltinFunctionType, MethodType, ModuleType, range, slice, frozenset)


class UncopiedInput(Exception):
    """An input that cannot be copied: ``where`` inside it (``.cache.lock``, ``[2]``; empty
    for the input itself) and ``why``."""

    def __init__(self, why: str, where: str = "") -> None:
        super().__init__(f"{where}: {why}" if where else why)
        self.why = why
        self.where = where

    def inside(self, step: str) -> UncopiedInput:
        """The same failure seen from the container one ``step`` up."""
        return UncopiedInput(self.why, step + self.where)


def needs_copy(value: Any) -> bool:
    """Whether ``value`` (an input of the forward) is held as a copy of its structure.
    Callables are kept, except objects that hold data and only happen to be callable (a
    PyG ``Data`` batch: ``data(*keys)``)."""
    return not (isinstance(value, _SHARED) or (callable(value) and not _holds_data(value)))


def _holds_data(value: Any) -> bool:
    """Whether a callable object keeps tensors in its attributes, or in a mapping there (PyG
    keeps a ``Data``'s in its ``_store``): data, not a function."""
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict):
        return False
    return any(isinstance(item, torch.Tensor) for item in list(attributes.values())) \
        or data_items(value) is not None


def copy_structure(value: Any, memo: dict[int, Any] | None = None, *,
                   written: list[tuple[torch.Tensor, Any, str]] | None = None,
                   replay: bool = False) -> Any:
    """``value`` with every container and object copied, tensors and the kinds listed in the
    module docstring shared. Raises :class:`UncopiedInput` for what cannot be copied
    (iterators, objects whose copy shares their state). A static KV cache's layer
    (:mod:`.static_cache`) is held as it was: with ``written`` (a batch held as it starts), its
    length is kept and the tensors its forward writes are added to ``written`` (see
    :func:`.static_cache.hold_layer`); with ``replay``
    (a held copy copied for a replay), the copy owns keys, values and length as they were."""
    if not needs_copy(value):
        return value
    memo = {} if memo is None else memo
    key = id(value)
    if key in memo:
        return memo[key]
    kind = type(value)
    if kind is list:
        made: Any = []
        memo[key] = made
        made.extend(_item(item, f"[{i}]", memo, written, replay) for i, item in enumerate(value))
        return made
    if kind is dict:
        made = {}
        memo[key] = made
        for name, item in value.items():
            made[name] = _item(item, f"[{name!r}]", memo, written, replay)
        return made
    if kind is tuple:
        made = tuple(_item(item, f"[{i}]", memo, written, replay) for i, item in enumerate(value))
        memo[key] = made
        return made
    if isinstance(value, Iterator):
        raise UncopiedInput(f"a {kind.__name__}, an iterator: a replay would find it consumed")
    if isinstance(value, tuple):  # named tuples and other tuple subclasses
        items = [_item(item, f"[{i}]", memo, written, replay) for i, item in enumerate(value)]
        made = kind._make(items) if hasattr(kind, "_make") else value
        memo[key] = made
        return made
    if isinstance(value, set):
        made = kind(value)  # members are hashable, so kept
        memo[key] = made
        return made
    return _copy_object(value, memo, written, replay)


def _item(value: Any, step: str, memo: dict[int, Any],
          written: list[tuple[torch.Tensor, Any, str]] | None, replay: bool) -> Any:
    """:func:`copy_structure` of a part of a container, failures said from the container."""
    try:
        return copy_structure(value, memo, written=written, replay=replay)
    except UncopiedInput as error:
        raise error.inside(step) from None


def _copy_object(value: Any, memo: dict[int, Any],
                 written: list[tuple[torch.Tensor, Any, str]] | None, replay: bool) -> Any:
    kind = type(value)
    try:
        made = copy.copy(value)
    except Exception as error:
        raise UncopiedInput(f"a {kind.__name__}, whose copy failed ({type(error).__name__}: "
                            f"{error})") from None
    if made is value:
        return value  # its own __copy__ says it is not copied (immutable)
    memo[id(value)] = made
    state = getattr(made, "__dict__", None)
    if state is not None:
        if state is getattr(value, "__dict__", None):
            raise UncopiedInput(f"a {kind.__name__}, whose copy shares its attributes")
        for name, item in list(state.items()):
            copied = _item(item, f".{name}", memo, written, replay)
            if copied is not item:
                state[name] = copied
    for name in copyreg._slotnames(kind):
        if name in ("__dict__", "__weakref__") or not hasattr(value, name):
            continue
        item = getattr(value, name)
        copied = _item(item, f".{name}", memo, written, replay)
        if copied is not item:
            setattr(made, name, copied)
    if isinstance(value, (list, dict)):  # subclasses: their items too
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for position, item in list(items):
            copied = _item(item, f"[{position!r}]", memo, written, replay)
            if copied is not item:
                made[position] = copied
    if (replay or written is not None) and state is not None \
            and "cumulative_length" in state and is_static_layer(value):
        if replay:
            fresh_layer(value, made)
        else:
            written.extend(hold_layer(value, made))
    return made

"""Walk the nested structures modules take and return, naming each leaf by its contract role.

Roles: ``input[0]``, ``input[0][1]``, ``kwarg:attention_mask``, ``output``, ``output[1][0]``,
``output.logits`` (dataclasses, ``ModelOutput`` and other string-keyed mappings), ``output[3]``
(lists, tuples, non-string keys). Depth and breadth are capped so that a huge or self-referencing
structure cannot stall a forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["iter_leaves", "MAX_DEPTH", "MAX_LEAVES"]

MAX_DEPTH = 6
MAX_LEAVES = 256

_Tensor = torch.Tensor
_SCALARS = (str, bytes, int, float, bool, complex, type(None))


def iter_leaves(value: Any, role: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(role, leaf)`` for every tensor, None or other leaf object inside ``value``."""
    if isinstance(value, _Tensor):  # the common case first: one check, no recursion
        yield role, value
        return
    budget = [MAX_LEAVES]
    yield from _walk(value, role, 0, budget)


def _walk(value: Any, role: str, depth: int, budget: list[int]) -> Iterator[tuple[str, Any]]:
    if budget[0] <= 0:
        return
    if isinstance(value, _Tensor) or isinstance(value, _SCALARS) or depth >= MAX_DEPTH:
        budget[0] -= 1
        yield role, value
        return
    if isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from _walk(item, f"{role}[{index}]", depth + 1, budget)
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            name = f"{role}.{key}" if isinstance(key, str) else f"{role}[{key!r}]"
            yield from _walk(item, name, depth + 1, budget)
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _walk(getattr(value, field.name, None), f"{role}.{field.name}", depth + 1, budget)
        return
    budget[0] -= 1
    yield role, value

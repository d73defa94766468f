"""Sentinel mode: a watch made to stay on (root outputs and gradients checked, no module hooks),
with full detail by an eager replay of the failing batch. See :mod:`.feature`."""

from __future__ import annotations

from .check import BadTensor, NonFiniteCheck, checkable, float_leaves
from .compiled import compiled_in_place, has_compiled_parts, is_compile_wrapper, rerun_compiled
from .feature import DEFER_CHOICES, Sentinel

__all__ = ["Sentinel", "DEFER_CHOICES", "NonFiniteCheck", "BadTensor", "checkable", "float_leaves",
           "is_compile_wrapper", "compiled_in_place", "has_compiled_parts", "rerun_compiled"]

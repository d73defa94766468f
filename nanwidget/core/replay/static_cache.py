"""A ``transformers`` static KV cache layer, held so that a replay can run its batch again.

A static cache (``generate(cache_implementation="static")``, a ``StaticCache`` passed as
``past_key_values``) preallocates each layer's keys and values and fills them in place: a
forward writes its tokens' keys and values at positions ``cumulative_length`` on and advances
``cumulative_length`` (a 0-d tensor) in place. A held batch shares the cache's tensors like any
input's, so without more it could not run again (its inputs were written while it ran).

What a replay needs is small: the layer's ``cumulative_length`` when the batch started
(copied then: one stack of the layers' 0-d lengths per batch), and the keys and values below
it, which later forwards leave as they were (they write from ``cumulative_length`` on). The
positions from it on hold what a new or ``reset()`` cache holds there, zeros (the batch's
causal mask hides them from its queries). The replay runs on its own copies of them; the
caller's cache is never written. A cache ``reset()`` or cropped after the batch rewrote what
the batch read: the replay is refused then (see ``capture``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_static_layer", "hold_layer", "keep_lengths", "as_it_was", "fresh_layer"]

_STATIC_TYPES: dict[type, bool] = {}  # type -> transformers' StaticLayer (not sliding)


def is_static_layer(value: Any) -> bool:
    """Whether ``value`` is a layer of a ``transformers`` static cache that fills its keys and
    values in place from its ``cumulative_length`` (a sliding window's rolls them: not one)."""
    kind = type(value)
    known = _STATIC_TYPES.get(kind)
    if known is None:
        known = _STATIC_TYPES[kind] = (
            any(c.__name__ == "StaticLayer" and c.__module__.startswith("transformers")
                for c in kind.__mro__) and getattr(kind, "is_sliding", True) is False)
    return known and isinstance(getattr(value, "cumulative_length", None), torch.Tensor)


def hold_layer(live: Any, made: Any) -> list[tuple[torch.Tensor, Any, str]]:
    """At batch start, for ``made``, the held copy of ``live``: for each live tensor the
    batch's forward writes, (that tensor, ``made``, its attribute name). :func:`keep_lengths`
    then keeps the lengths as they are now; :func:`as_it_was` gives each back as the batch
    found it."""
    return [(tensor, made, name) for name in ("cumulative_length", "keys", "values")
            if isinstance(tensor := getattr(live, name, None), torch.Tensor)]


def keep_lengths(written: list[tuple[torch.Tensor, Any, str]]) -> None:
    """The held layers of ``written`` (:func:`hold_layer`) keep their ``cumulative_length`` as
    it is now, in one copy for them all (a stack: about 2 us for 2 layers, 17 us for 32 on
    CPU, where a clone each took 5 and 74); no host sync."""
    layers = [(tensor, made) for tensor, made, name in written if name == "cumulative_length"]
    try:
        kept = torch.stack([tensor for tensor, _ in layers]).unbind()
    except RuntimeError:  # lengths on several devices (a model split over them)
        kept = tuple(tensor.clone() for tensor, _ in layers)
    for (_, made), length in zip(layers, kept):
        made.cumulative_length = length


def as_it_was(held: Any, name: str) -> torch.Tensor | None:
    """The tensor ``name`` of the held layer ``held`` as its batch found it, a copy of its
    own: the length then, the keys or values with the positions from it on zero (None for
    keys or values not laid out as (batch, heads, position, dim))."""
    length = held.cumulative_length
    if name == "cumulative_length":
        return length.clone()
    tensor = getattr(held, name, None)
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
        return None
    later = torch.arange(tensor.shape[2], device=tensor.device) >= length.to(tensor.device)
    return tensor.masked_fill(later[:, None], 0)


def fresh_layer(held: Any, made: Any) -> None:
    """For a replay: ``made`` (a copy of the held layer ``held``) gets tensors of its own as
    its batch found them (:func:`as_it_was`)."""
    for name in ("cumulative_length", "keys", "values"):
        if isinstance(getattr(held, name, None), torch.Tensor):
            setattr(made, name, as_it_was(held, name))

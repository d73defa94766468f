"""Which process this is under torch.distributed (or a launcher that set RANK / WORLD_SIZE)."""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

__all__ = ["current_rank", "world_size", "distributed_ready", "launched_rank", "launched_world_size"]


_dist = torch.distributed
_AVAILABLE = _dist.is_available()  # a property of the torch build


def distributed_ready() -> bool:
    """True when torch.distributed has an initialised default process group."""
    return _AVAILABLE and _dist.is_initialized()


# The default process group as torch keeps it (``_World._default_pg``, what is_initialized()
# reads through two properties), and the rank last read from it: the recorder asks every batch.
_WORLD = getattr(_dist.distributed_c10d, "_world", None) if _AVAILABLE else None
_last_rank: tuple[Any, int] = (None, 0)  # (a weak reference to the group, its rank)


def current_rank() -> int:
    """torch.distributed rank, 0 without an initialised process group (read every batch)."""
    global _last_rank
    if not _AVAILABLE:
        return 0
    try:
        group = _WORLD._default_pg  # type: ignore[union-attr]
    except AttributeError:  # a torch without that attribute: its public functions
        return _dist.get_rank() if _dist.is_initialized() else 0
    if group is None:
        return 0
    known, rank = _last_rank
    if known is None or known() is not group:  # a group's rank never changes; a new one is read
        rank = _dist.get_rank()
        try:  # weakly: a destroyed group is not kept alive
            _last_rank = (weakref.ref(group), rank)
        except TypeError:
            pass
    return rank


def world_size() -> int:
    """torch.distributed world size, 1 without an initialised process group."""
    return torch.distributed.get_world_size() if distributed_ready() else 1


def _env_int(name: str) -> int | None:
    try:
        value = int(os.environ.get(name, ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def launched_rank() -> int:
    """The rank: from the process group when there is one, else from a launcher's ``RANK``
    (torchrun sets it before ``init_process_group``); 0 when neither says (or ``RANK`` is not
    a non-negative integer)."""
    if distributed_ready():
        return current_rank()
    return _env_int("RANK") or 0


def launched_world_size() -> int:
    """Like :func:`launched_rank`, for the world size (at least 1)."""
    if distributed_ready():
        return world_size()
    return max(_env_int("WORLD_SIZE") or 1, 1)

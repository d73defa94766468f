"""Which process this is under torch.distributed (or a launcher that set RANK / WORLD_SIZE)."""

from __future__ import annotations

import os

import torch

__all__ = ["current_rank", "world_size", "distributed_ready", "launched_rank", "launched_world_size"]


_dist = torch.distributed
_AVAILABLE = _dist.is_available()  # a property of the torch build


def distributed_ready() -> bool:
    """True when torch.distributed has an initialised default process group."""
    return _AVAILABLE and _dist.is_initialized()


def current_rank() -> int:
    """torch.distributed rank, 0 without an initialised process group (read every batch)."""
    return _dist.get_rank() if _AVAILABLE and _dist.is_initialized() else 0


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

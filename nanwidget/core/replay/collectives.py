"""A replay runs on this process alone. A collective inside it (the all-reduce of a hand-written
tensor-parallel layer, a barrier, an all-gather of a sequence-parallel region) has no partner:
it would wait for the other ranks forever, or take the values of their next batch and leave
their training wrong. :func:`no_collectives` stops the replay at its first collective over more
than one rank, before it is issued, with :class:`ModelNotReplayableError`; the model is then
known not to be replayable here (:func:`refused_collective`), so no later replay starts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..state import ModuleMap
from .capture import ModelNotReplayableError

__all__ = ["no_collectives", "refused_collective"]

# The dispatcher namespaces of torch.distributed's collectives: the process-group ones
# (dist.all_reduce and friends, DDP's reducer) and the functional ones (DTensor, compiled code).
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "c10d_functional",
                          "_c10d_functional_autograd"})
# Their ops that exchange nothing: waiting for a collective issued before the replay began.
_NO_EXCHANGE = frozenset({"wait_tensor"})

# model -> why its replays are refused (a collective met by one of them)
_refused = ModuleMap()


def refused_collective(model: nn.Module) -> str:
    """Why ``model`` cannot be replayed on this process alone, as a replay of it found out (it
    ran a collective over other ranks); "" when none did."""
    return _refused.get(model, "")


def _other_ranks() -> bool:
    """Whether this process belongs to a process group with other ranks: only then can a
    collective wait for one."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _group_size(args: tuple, kwargs: dict) -> int | None:
    """The rank count of the process group a collective's arguments name (a process group
    object, or a functional collective's group name); None when none is recognised."""
    try:
        from torch._C._distributed_c10d import ProcessGroup
        from torch.distributed.distributed_c10d import _resolve_process_group
    except ImportError:  # a torch that names them otherwise: every group counts as spanning
        return None
    for value in (*args, *kwargs.values()):
        try:
            if isinstance(value, torch.ScriptObject):
                return ProcessGroup.unbox(value).size()
            if isinstance(value, ProcessGroup):
                return value.size()
            if isinstance(value, str):
                return _resolve_process_group(value).size()
        except Exception:  # a reduce op, a tag, a name of no group: not the group
            continue
    return None


class _CollectiveGuard(TorchDispatchMode):
    """Raises at the first collective over more than one rank, before it runs."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # a replay never runs under torch.compile (see OpTracer)

    def __init__(self, where: Callable[[], str]) -> None:
        super().__init__()
        self.where = where
        self.refusal = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVES and func.name().split("::")[-1] not in _NO_EXCHANGE:
            ranks = _group_size(args, kwargs)
            if ranks is None or ranks > 1:
                over = f"over {ranks} ranks" if ranks else "over other ranks"
                self.refusal = (
                    f"cannot replay a model whose forward or backward exchanges values with other "
                    f"ranks ({self.where()} ran the collective {func.name()} {over}): a replay "
                    "runs on this rank alone, so it would wait for the others forever (or take "
                    "their next batch's values). Replay an unsharded copy of the model on one "
                    "process instead")
                raise ModelNotReplayableError(self.refusal)
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_collectives(model: nn.Module, where: Callable[[], str]) -> Iterator[None]:
    """Run a replay of ``model`` that stops at its first collective over other ranks.
    ``where``: the module running now, in words, for the message. Costs nothing in a process
    without other ranks. Also refused when the model caught the error and went on: its replay
    left a collective out."""
    if not _other_ranks():
        yield
        return
    guard = _CollectiveGuard(where)
    try:
        with guard:
            yield
    finally:
        if guard.refusal:
            _refused[model] = guard.refusal
    if guard.refusal:  # raised inside the model, which went on without the collective
        raise ModelNotReplayableError(guard.refusal)

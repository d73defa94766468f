"""Loads of a watched model's state, told apart from optimizer steps and other writes.

``model.load_state_dict(...)`` and what calls it (torch.distributed.checkpoint's
``set_model_state_dict`` / ``set_state_dict``, a ``Stateful``'s ``load_state_dict`` that
``dcp.load`` runs, the recipe ``dcp.load(sd); model.load_state_dict(sd)``) write the weights
in place (or, with ``assign=True``, put other tensors in their slots): the version counters
say that something wrote them, not what. One hook on the watched model (torch's public
``register_load_state_dict_post_hook``, which runs also when a module holding the model is
loaded) notes, after each load, every parameter and buffer as the load left it (the tensor,
weakly, and its version counter), with the watch's batch count, the optimizer steps taken and
who loaded (the user's line, DCP's function). A weight that is the same tensor at the same
version later was written by nothing since that load. Cost: one walk over the named
parameters and buffers and one walk up the stack per load; nothing per batch or module call.
A ``dcp.load`` into ``model.state_dict()`` that no ``load_state_dict`` follows writes the
tensors in place with no hook to tell: it reads as any other write.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .sourcelines import user_source
from .stats import version_of
from .writes import steps_taken

__all__ = ["Load", "LoadLog"]

# Functions of torch.distributed.checkpoint that load a model's state through its
# load_state_dict, as users call them.
_DCP_LOADERS = ("set_model_state_dict", "set_state_dict")
_DCP_PATH = "/torch/distributed/checkpoint/"


@dataclass
class Load:
    """One load of the watched model's state."""

    batch: int  # the watch's batch count when it ran: after batch ``batch - 1``
    steps: int  # optimizer steps taken in this process by then (core.writes)
    caller: str  # "model.load_state_dict(...)", "torch.distributed.checkpoint's ..."
    where: str  # the user's file:line that loaded ("" when none is found)
    dcp: bool  # torch.distributed.checkpoint loaded (set_*_state_dict, or within dcp.load)
    number: int  # 1 for the watch's first load, 2 for the next ...


class LoadLog:
    """The loads of ``model``'s state while a watch is live (see the module docstring);
    ``batches()`` gives the watch's batch count. :meth:`close` removes the hook."""

    def __init__(self, model: nn.Module, batches: Callable[[], int]) -> None:
        self._model = weakref.ref(model)
        self._batches = batches
        self.count = 0
        # weight name -> (the load that last wrote it, its tensor then (weakly), its version)
        self._written: dict[str, tuple[Load, weakref.ref, int]] = {}
        try:
            self._handle: Any = model.register_load_state_dict_post_hook(self._after_load)
        except Exception:  # a module that takes no such hook (a TorchScript one): none told
            self._handle = None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._written.clear()

    def _after_load(self, module: nn.Module, incompatible: Any) -> None:
        try:
            self._note(module, incompatible)
        except Exception:  # only evidence for a diagnosis: never break the user's load
            pass

    def _note(self, module: nn.Module, incompatible: Any) -> None:
        frame = sys._getframe(2)
        caller, dcp, user = "model.load_state_dict(...)", False, frame
        while frame is not None:
            code = frame.f_code
            path = code.co_filename.replace("\\", "/")
            if _DCP_PATH in path:
                dcp = True
                if code.co_name in _DCP_LOADERS:
                    caller = f"torch.distributed.checkpoint's {code.co_name}(...)"
            frame = frame.f_back
        self.count += 1
        load = Load(batch=self._batches(), steps=steps_taken(), caller=caller,
                    where=user_source(user), dcp=dcp, number=self.count)
        missing = set(getattr(incompatible, "missing_keys", None) or ())
        for name, tensor in _named_state(module):
            if name in missing or any(key.endswith("." + name) for key in missing):
                continue  # the state dict had none for it: the load did not write it
            self._written[name] = (load, weakref.ref(tensor), version_of(tensor))

    def wrote(self, name: str, tensor: torch.Tensor | None) -> Load | None:
        """The load that last wrote weight ``name``, when ``tensor`` (what its slot holds now)
        is the tensor that load left there, at the same version: nothing wrote it since."""
        kept = self._written.get(name)
        if kept is None or tensor is None:
            return None
        load, reference, version = kept
        if reference() is not tensor or version_of(tensor) != version:
            return None
        return load


def _named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s parameters and buffers by qualified name (shared ones once)."""
    named: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    named.extend((name, buffer) for name, buffer in module.named_buffers() if buffer is not None)
    return named

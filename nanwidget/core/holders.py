"""Holders swapped for a stand-in: no change to the model a watch hooked.

A module that is never called (a ParameterDict, a ParameterList, a ModuleList, a plain
``nn.Module`` that only holds tensors) can be rebuilt around the very same tensors: Keras 3's
torch backend builds a new ``_torch_params`` ParameterDict on every ``fit()`` and
``evaluate()``. Its id changes, the model that runs does not. Compared at event or replay time
only (it walks the model), never per batch.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

__all__ = ["stand_ins", "has_no_forward"]


def has_no_forward(module: nn.Module) -> bool:
    """Whether ``module`` cannot be called: no forward set on it, and its class has none of its
    own (a ``ParameterDict``, ``ParameterList`` or plain holder whose weights others read).
    Looked up without running descriptors (a ScriptModule's class forward fails when read)."""
    if "forward" in vars(module):
        return False
    for klass in type(module).__mro__:
        if "forward" in vars(klass):
            return vars(klass)["forward"] is nn.Module.forward
    return False


def _same_objects(first: Mapping, second: Mapping) -> bool:
    return first.keys() == second.keys() and all(first[key] is second[key] for key in first)


def _stands_in_for(new: nn.Module, old: nn.Module) -> bool:
    """Whether ``new`` is ``old`` rebuilt: same class, no forward of its own (so neither was
    ever called: it only holds), the same parameters, buffers and children (the same objects)
    under the same names."""
    return (type(new) is type(old) and has_no_forward(new) and has_no_forward(old)
            and _same_objects(new._parameters, old._parameters)
            and _same_objects(new._buffers, old._buffers)
            and _same_objects(_inside(new), _inside(old)))


def _inside(module: nn.Module) -> dict[str, nn.Module]:
    """Every module below ``module`` by path, a module held twice at each of its paths."""
    return {name: sub for name, sub in module.named_modules(remove_duplicate=False) if name}


def stand_ins(added: list[tuple[str, nn.Module]], removed: list[tuple[str, nn.Module]]
              ) -> list[tuple[str, nn.Module, nn.Module]]:
    """(name, old, new) of each module in ``removed`` that a module of ``added`` at the same
    name stands in for (see :func:`_stands_in_for`)."""
    if not added or not removed:
        return []
    old_by_name = dict(removed)
    return [(name, old_by_name[name], new) for name, new in added
            if name in old_by_name and _stands_in_for(new, old_by_name[name])]

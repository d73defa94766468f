"""Layers whose fused fast path any hook turns off: ``nn.TransformerEncoderLayer``.

In eval mode, when autograd records nothing, ``nn.TransformerEncoderLayer`` runs one fused kernel
(``torch._transformer_encoder_layer_fwd``) unless a forward hook or pre-hook sits on it or on a
module inside it. The fused kernel's numbers differ from its modules' in the last bits, and a
sample whose keys are all padding comes out NaN there and finite through the modules: a hooked
layer would change what the model returns, and hide the very NaN a watch is for. So while a
watch hooks such a layer, its forward runs with nanwidget's hooks inside it (and on it) taken off
whenever the fused path can run: the layer is measured as one module (its frame comes from the
hooks around the forward), and the modules inside it have no frame of that call. In training,
under autocast, or when autograd records the layer, torch never takes the fused path, and
everything inside is hooked as usual.

The layer's ``forward`` is an instance attribute while the watch lasts (the check runs inside the
forward, after the layer's pre-hooks and before its forward hooks are read); copies leave it out
(core.copies).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from .copies import is_nanwidget_hook

__all__ = ["keep_fused_path", "release_fused_path", "FusedPathKeeper", "has_fused_path"]

_LAYERS = (nn.TransformerEncoderLayer,)


def has_fused_path(module: nn.Module) -> bool:
    """Whether ``module`` is a layer whose fused path hooks turn off."""
    return isinstance(module, _LAYERS)


def _fused_path_possible(layer: nn.Module, args: tuple, kwargs: dict) -> bool:
    """False when torch takes the modules' path anyway (hooks then change nothing); True when
    the fused path may run. Erring towards True costs only the inner modules' frames."""
    if layer.training or torch.is_autocast_enabled():
        return False
    enabled = getattr(torch.backends.mha, "get_fastpath_enabled", None)
    if enabled is not None and not enabled():
        return False
    if torch.is_grad_enabled():
        source = args[0] if args else kwargs.get("src")
        if getattr(source, "requires_grad", False):
            return False
        try:
            attention = layer.self_attn
            tensors = (attention.in_proj_weight, attention.in_proj_bias,
                       attention.out_proj.weight, attention.out_proj.bias,
                       layer.norm1.weight, layer.norm1.bias, layer.norm2.weight,
                       layer.norm2.bias, layer.linear1.weight, layer.linear1.bias,
                       layer.linear2.weight, layer.linear2.bias)
        except AttributeError:
            return True
        if any(getattr(t, "requires_grad", False) for t in tensors):
            return False
    return True


def _take_off_watch_hooks(layer: nn.Module) -> list[tuple[dict, list]]:
    """Remove nanwidget's forward hooks and pre-hooks from ``layer`` and every module inside it;
    what :func:`_put_back` needs to restore each table exactly (order included)."""
    taken = []
    for module in layer.modules():
        for table in (module._forward_hooks, module._forward_pre_hooks):
            if table and any(is_nanwidget_hook(hook) for hook in table.values()):
                before = list(table.items())
                for key, hook in before:
                    if is_nanwidget_hook(hook):
                        del table[key]
                taken.append((table, before))
    return taken


def _put_back(taken: list[tuple[dict, list]]) -> None:
    for table, before in taken:
        known = {key for key, _ in before}
        added = [(key, hook) for key, hook in table.items() if key not in known]
        table.clear()
        table.update(before)
        table.update(added)  # a hook the forward itself registered stays, after ours


class FusedPathKeeper:
    """A watched layer's ``forward`` (see the module docstring)."""

    __slots__ = ("layer", "previous", "users", "__weakref__")

    def __init__(self, layer: nn.Module, previous: Callable[..., Any] | None) -> None:
        self.layer = weakref.ref(layer)
        #: An instance-level forward that was there before (accelerate's hooks put one).
        self.previous = previous
        self.users = 1  # the watches hooking the layer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer = self.layer()
        forward = self.previous if self.previous is not None else \
            type(layer).forward.__get__(layer)
        if torch.compiler.is_compiling() or not _fused_path_possible(layer, args, kwargs):
            return forward(*args, **kwargs)
        taken = _take_off_watch_hooks(layer)
        try:
            return forward(*args, **kwargs)
        finally:
            _put_back(taken)


def keep_fused_path(layer: nn.Module) -> None:
    """Run ``layer``'s forward as :class:`FusedPathKeeper` does, until as many
    :func:`release_fused_path` calls (one per watch)."""
    current = layer.__dict__.get("forward")
    if isinstance(current, FusedPathKeeper):
        current.users += 1
    else:
        layer.__dict__["forward"] = FusedPathKeeper(layer, current)


def release_fused_path(layer: nn.Module) -> None:
    """One watch is done with ``layer``; the last restores its forward. A forward someone set
    after ours stays (it calls ours, which then finds no hooks of ours to take off)."""
    current = layer.__dict__.get("forward")
    if not isinstance(current, FusedPathKeeper):
        return
    current.users -= 1
    if current.users <= 0:
        if current.previous is None:
            del layer.__dict__["forward"]
        else:
            layer.__dict__["forward"] = current.previous

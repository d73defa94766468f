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

import copy
import operator
import types
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

    def _unwatched(self, layer: nn.Module) -> Callable[..., Any]:
        """The forward ``layer`` had before: the previous instance-level one, or its class's."""
        return self.previous if self.previous is not None else \
            types.MethodType(type(layer).forward, layer)

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # inspect.signature() reads the layer's own
        return self._unwatched(self.layer())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer = self.layer()
        forward = self._unwatched(layer)
        if self.users <= 0:  # released, and put back by whoever held it (accelerate's hooks)
            _unplug(layer, self)
            return forward(*args, **kwargs)
        if torch.compiler.is_compiling() or not _fused_path_possible(layer, args, kwargs):
            return forward(*args, **kwargs)
        taken = _take_off_watch_hooks(layer)
        try:
            return forward(*args, **kwargs)
        finally:
            _put_back(taken)


    # Someone may hold this forward where copies reach it (accelerate's hooks keep the forward
    # they wrap as ``_old_forward``): a copy or a pickle gets the forward the layer had without
    # the watch, bound to the copied layer.
    def __deepcopy__(self, memo: dict) -> Callable[..., Any]:
        layer = self.layer()
        if self.previous is not None:
            return copy.deepcopy(self.previous, memo)
        copied = memo.get(id(layer), layer)
        return types.MethodType(type(copied).forward, copied)

    def __reduce__(self) -> tuple:
        # Only torch's and Python's names: a pickle loads where nanwidget is not installed.
        if self.previous is not None:
            return operator.itemgetter(0), ([self.previous],)
        # Rebuilt before the layer's state is set: its class's forward, bound to it.
        return getattr, (self.layer(), "forward")


def _unplug(layer: nn.Module, keeper: FusedPathKeeper) -> None:
    """Take the released ``keeper`` out of ``layer``: as its forward, and where a wrapper set
    after it keeps it (accelerate's ``_old_forward``), the forward it stood for instead."""
    for key, value in list(layer.__dict__.items()):
        if value is keeper:
            if key == "forward" and keeper.previous is None:
                del layer.__dict__[key]
            else:
                layer.__dict__[key] = keeper._unwatched(layer)


def keep_fused_path(layer: nn.Module) -> FusedPathKeeper:
    """Run ``layer``'s forward as :class:`FusedPathKeeper` does, until as many
    :func:`release_fused_path` calls (one per watch); the keeper to release."""
    current = layer.__dict__.get("forward")
    if isinstance(current, FusedPathKeeper):
        current.users += 1
        return current
    keeper = layer.__dict__["forward"] = FusedPathKeeper(layer, current)
    return keeper


def release_fused_path(layer: nn.Module, keeper: FusedPathKeeper) -> None:
    """One watch is done with ``layer``; the last restores its forward. A forward someone set
    after ours stays, and one that wraps ours (accelerate's) keeps calling it: it then calls the
    layer's own forward and nothing more."""
    keeper.users -= 1
    if keeper.users <= 0:
        _unplug(layer, keeper)

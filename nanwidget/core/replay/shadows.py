"""Shadow weights: a replay runs on stand-ins for the model's parameters and buffers.

A replay never touches the model's own tensors: it runs on *shadow* parameters (new Parameter
objects over the same storage, so ``.grad``, ``requires_grad`` and version counters of the real
ones stay as they are; an in-place write into a parameter's storage is saved first and undone
afterwards) and on cloned buffers (BatchNorm running statistics). The modules' own Python
attributes (a call counter, a list a forward appends to, a cached tensor it rebinds) are put
back as they were afterwards too (:class:`ModuleAttributes`). Modules the replay runs outside
the model (a GAN's discriminator in the generator's loss) get stand-ins too, at their first
call (:mod:`.outside`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..stats import stood_for
from .capture import WeightSlots

__all__ = ["Shadows", "ModuleAttributes", "tensors_in", "mutated_arguments"]

_Tensor = torch.Tensor


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of an op's argument or output (a tensor or a flat list/tuple of them)."""
    if isinstance(value, _Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, _Tensor)]
    return []


_MUTATED: dict[Any, tuple[tuple[int, ...], tuple[str, ...]]] = {}


def mutated_arguments(func: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Positions and names of the arguments an op writes into (from its schema), cached."""
    found = _MUTATED.get(func)
    if found is None:
        positions, names = [], []
        try:
            for position, argument in enumerate(func._schema.arguments):
                alias = argument.alias_info
                if alias is not None and alias.is_write:
                    positions.append(position)
                    names.append(argument.name)
        except AttributeError:
            pass
        found = _MUTATED[func] = (tuple(positions), tuple(names))
    return found


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # tensor subclasses without a storage
        return None


class _Protected:
    """A tensor whose storage the replay must leave as it found it (copy on first write)."""

    __slots__ = ("write_through", "source", "saved")

    def __init__(self, write_through: torch.Tensor, source: torch.Tensor) -> None:
        self.write_through = write_through  # writes here reach the storage, not source's counter
        self.source = source
        self.saved: torch.Tensor | None = None


def _storage_alias(source: torch.Tensor) -> torch.Tensor:
    """A tensor over ``source``'s storage with a version counter of its own."""
    if type(source) in (_Tensor, nn.Parameter) and source.layout is torch.strided \
            and not source.is_meta:
        try:
            with torch.no_grad():
                return torch.empty(0, dtype=source.dtype, device=source.device).set_(
                    source.untyped_storage(), source.storage_offset(), source.size(), source.stride())
        except Exception:
            pass
    return source.detach()


class Shadows:
    """Swaps the model's parameters and buffers for replay-only stand-ins, and back."""

    def __init__(self) -> None:
        self.swaps: list[tuple[dict, str, torch.Tensor]] = []
        self.protected: dict[int, list[_Protected]] = {}
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.flat_weights: list[tuple[nn.Module, list]] = []
        # id(tensor stood in for) -> its stand-in: a module outside the model that holds one
        # of the model's tensors (tied weights) gets the same stand-in.
        self._stand_ins: dict[int, torch.Tensor] = {}
        # id(stand-in) -> (stand-in, original) given to modules run outside the model
        self._outside: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def install(self, slots: WeightSlots, sources: list[torch.Tensor | None]) -> None:
        """Put the stand-ins in place; every swap is recorded as it is made, so that
        :meth:`restore` undoes exactly what was done even if this stops half-way."""
        current = slots.read()
        made: dict[int, torch.Tensor] = {}
        for i, original in enumerate(current):
            if original is None:
                continue
            # A replay made while per-sample gradients run (an ExpandedWeight in each
            # parameter's slot, which refuses .detach()) runs on the parameters themselves;
            # the stand-ins go back into the slots after it.
            parameter = stood_for(original)
            source = stood_for(sources[i])
            if source is None or source.shape != parameter.shape or source.dtype != parameter.dtype:
                source = parameter
            shadow = made.get(id(source))
            if shadow is None:
                shadow = made[id(source)] = self._make(parameter, source, slots.is_buffer[i])
            self._stand_ins.setdefault(id(original), shadow)
            self._stand_ins.setdefault(id(parameter), shadow)
            self.swaps.append((slots.containers[i], slots.keys[i], original))
            slots.containers[i][slots.keys[i]] = shadow
        for module in slots.modules:
            self._swap_flat_weights(module)

    def install_module(self, module: nn.Module) -> None:
        """Put stand-ins in place of ``module``'s own parameters and buffers (not its
        children's), as :meth:`install` does for the model's, from their current values; a
        tensor that already has one (tied to the model's) gets that one."""
        for is_buffer, container in ((False, module._parameters), (True, module._buffers)):
            if not isinstance(container, dict):  # a TorchScript module's: left as it is
                continue
            for key, original in list(container.items()):
                if original is None:
                    continue
                shadow = self._stand_ins.get(id(original))
                if shadow is None:
                    shadow = self._stand_ins[id(original)] = self._make(original, original,
                                                                        is_buffer)
                self.swaps.append((container, key, original))
                self._outside[id(shadow)] = (shadow, original)
                container[key] = shadow
        self._swap_flat_weights(module)

    def _swap_flat_weights(self, module: nn.Module) -> None:
        """RNNs keep a list of their weights besides _parameters: the stand-ins' list."""
        if isinstance(getattr(module, "_flat_weights", None), list) \
                and hasattr(module, "_flat_weights_names"):
            self.flat_weights.append((module, module._flat_weights))
            module._flat_weights = [getattr(module, name, None)
                                    for name in module._flat_weights_names]

    def _make(self, original: torch.Tensor, source: torch.Tensor, is_buffer: bool) -> torch.Tensor:
        if is_buffer or not isinstance(original, nn.Parameter):
            with torch.no_grad():
                shadow = source.detach().clone()
            if original.requires_grad and shadow.is_floating_point():
                shadow.requires_grad_(True)
            return shadow
        alias = _storage_alias(source)
        shadow = nn.Parameter(alias, requires_grad=original.requires_grad)
        if original.__dict__:
            shadow.__dict__.update(original.__dict__)  # e.g. attributes libraries tag params with
        self._protect(shadow, source)
        # The shadow collects the replay's gradients; the original's .grad (or its None) stays,
        # even if some code reaches the original parameter through a reference of its own.
        self.grads.append((original, original.grad))
        if original.grad is not None:
            self._protect(original.grad, original.grad)
        return shadow

    def _protect(self, write_through: torch.Tensor, source: torch.Tensor) -> None:
        key = _storage_key(source)
        if key is not None:
            self.protected.setdefault(key, []).append(_Protected(write_through, source))

    def before_write(self, tensor: torch.Tensor) -> None:
        """Called for each tensor an op is about to write into: save protected ones first."""
        entries = self.protected.get(_storage_key(tensor))  # type: ignore[arg-type]
        if entries:
            for entry in entries:
                if entry.saved is None:
                    entry.saved = entry.source.detach().clone()

    def restore(self) -> None:
        for container, key, original in reversed(self.swaps):
            container[key] = original
        for module, weights in self.flat_weights:
            module._flat_weights = weights
        with torch.no_grad():
            for entries in self.protected.values():
                for entry in entries:
                    if entry.saved is not None:
                        entry.write_through.copy_(entry.saved)
        for original, grad in self.grads:
            if original.grad is not grad:
                original.grad = grad
        self._take_back_escaped()

    def _take_back_escaped(self) -> None:
        """A module outside the model gets its stand-ins at its first call, which may come
        inside code that swapped weights into it and copies them back out when done
        (tensordict's ``to_module``, in every torchrl loss): the stand-in then sits in that
        code's own container, and training after the replay would use it, not the parameter
        the optimizer holds. Put the original back in any dict or list still holding one.
        A search of the heap: only after a replay that ran modules outside the model."""
        if not self._outside:
            return
        outside, self._outside = self._outside, {}
        self._stand_ins.clear()
        for holder in gc.get_referrers(*(shadow for shadow, _ in outside.values())):
            if isinstance(holder, dict):
                for key, value in list(holder.items()):
                    pair = outside.get(id(value))
                    if pair is not None and pair[0] is value:
                        holder[key] = pair[1]
            elif isinstance(holder, list):
                for index, value in enumerate(holder):
                    pair = outside.get(id(value))
                    if pair is not None and pair[0] is value:
                        holder[index] = pair[1]


# What nn.Module keeps in every module's __dict__ (parameters, buffers, submodules, hook tables,
# the training flag): the replay's own machinery swaps and restores those.
_TORCH_OWN = frozenset(nn.Module().__dict__)
_MISSING = object()


class ModuleAttributes:
    """The modules' own Python attributes as they are now, to be put back after a replay: a
    forward that counts its calls, appends to a list, fills a dict or rebinds a cached tensor
    would otherwise leave the model changed by the replay, and the training after it would
    differ from a run without the watch. Bindings are put back, and the contents of lists and
    dicts held directly, and the state of a ``torch.Generator`` held directly (a forward drawing
    from it); objects deeper down are not copied."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.saved: list[tuple[dict, dict[str, Any], dict[str, Any]]] = []
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []
        for module in modules:
            state = module.__dict__
            bindings = {key: value for key, value in state.items() if key not in _TORCH_OWN}
            contents = {key: value.copy() for key, value in bindings.items()
                        if type(value) is list or type(value) is dict}
            self.saved.append((state, bindings, contents))
            self.generators.extend((value, value.get_state()) for value in bindings.values()
                                   if isinstance(value, torch.Generator))

    def restore(self) -> None:
        for generator, generator_state in self.generators:
            generator.set_state(generator_state)
        for state, bindings, contents in self.saved:
            for key in [key for key in state if key not in _TORCH_OWN and key not in bindings]:
                del state[key]  # added by the replay
            for key, value in bindings.items():
                if state.get(key, _MISSING) is not value:
                    state[key] = value
            for key, items in contents.items():
                container = bindings[key]
                try:
                    if type(container) is list:
                        if len(container) != len(items) or any(
                                now is not then for now, then in zip(container, items)):
                            container[:] = items
                    elif len(container) != len(items) or any(
                            container.get(k, _MISSING) is not v for k, v in items.items()):
                        container.clear()
                        container.update(items)
                except Exception:  # keys that cannot be compared: left as the replay left them
                    continue

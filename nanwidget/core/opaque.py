"""Modules whose inside no hook sees, and the weights their own frame stands for.

- A TorchScript module (``torch.jit.script``, ``torch.jit.trace``) runs compiled TorchScript
  code: the hooks of its submodules never run. It is watched as one module, measured at its
  boundary (its ``__call__`` runs hooks like any module's, though its ``register_*_hook``
  methods refuse them: the hooks go on through ``nn.Module``'s own), and its frame's weights
  are every parameter and buffer inside it, named from it (``0.weight``).
- An ``fx.GraphModule`` (``torch.export``'s ``ep.module()``, ``fx.symbolic_trace``) reads
  weights of submodules that never run a forward of their own (``get_attr``): its frame's
  weights include them, so a NaN there is named (``0.weight``) instead of blamed on the graph.
- A quantized module of ``torch.ao`` (``quantize_dynamic``'s Linear, a converted static Linear
  or Conv) keeps its weights packed (a TorchScript object, neither Parameter nor buffer): no
  frame measures them. At an event they are unpacked (:func:`packed_weights`), so a NaN there
  is named; :func:`holds_packed_weights` tells which modules keep such weights.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["is_torchscript", "inside_torchscript", "weights_of", "GatheredWeights",
           "add_forward_hook", "add_forward_pre_hook", "hookable_modules",
           "holds_packed_weights", "packed_weights", "own_call", "own_call_note"]

_SCRIPT = torch.jit.ScriptModule


def is_torchscript(module: nn.Module) -> bool:
    """Whether ``module`` runs TorchScript code (scripted or traced)."""
    return isinstance(module, _SCRIPT)


def inside_torchscript(named: list[tuple[str, nn.Module]]) -> set[str]:
    """Names of the modules strictly inside a TorchScript module (their hooks never run)."""
    scripted = [name for name, module in named if is_torchscript(module)]
    return {name for name, _ in named
            if any(name != outer and (outer == "" or name.startswith(outer + "."))
                   for outer in scripted)}


def own_call(module: nn.Module) -> str | None:
    """The ``__call__`` that ``module``'s class defines in place of ``nn.Module``'s, named
    (``pkg.mod.Class.__call__``), when it comes from outside torch: one that runs ``forward``
    itself (GPyTorch's modules do) never runs the module's hooks. None for a class that keeps
    ``nn.Module.__call__`` (torch's own classes, TorchScript's included, do run the hooks)."""
    for klass in type(module).__mro__:
        if klass is nn.Module:
            return None
        if "__call__" in vars(klass):
            where = getattr(klass, "__module__", "") or ""
            if where == "torch" or where.startswith("torch."):
                return None
            return f"{where}.{klass.__qualname__}.__call__"
    return None


def own_call_note(module: nn.Module) -> str:
    """What a note that a watch checked nothing says of a model whose class defines its own
    ``__call__`` ("" for one that does not)."""
    call = own_call(module)
    if call is None:
        return ""
    return (f"Its class defines its own __call__ ({call}), which may run forward without "
            "nn.Module's hooks: then no watch sees its calls, in any mode, nor those of its "
            "modules whose classes do the same. Check what you compute from it yourself "
            "(nw.detect_overflow(loss, 'loss'); torch.autograd.set_detect_anomaly(True) for "
            "the backward).")


def hookable_modules(root: nn.Module) -> list[nn.Module]:
    """``root``'s modules, each once, less those inside TorchScript code."""
    named = list(root.named_modules())
    hidden = inside_torchscript(named)
    return list({id(m): m for name, m in named if name not in hidden}.values())


def add_forward_hook(module: nn.Module, hook: Callable[..., Any], **options: Any) -> Any:
    """``module.register_forward_hook(hook, **options)``, for TorchScript modules too."""
    return _add_hook(module, "register_forward_hook", "_forward_hooks", hook, options)


def add_forward_pre_hook(module: nn.Module, hook: Callable[..., Any], **options: Any) -> Any:
    """``module.register_forward_pre_hook(hook, **options)``, for TorchScript modules too."""
    return _add_hook(module, "register_forward_pre_hook", "_forward_pre_hooks", hook, options)


def _add_hook(module: nn.Module, register: str, hooks: str, hook: Callable[..., Any],
              options: dict[str, Any]) -> Any:
    if is_torchscript(module):  # its own register_* methods refuse hooks
        handle = getattr(nn.Module, register)(module, hook, **options)
    else:
        handle = getattr(module, register)(hook, **options)
    if options.get("prepend"):
        _insertion_order_as_run(getattr(module, hooks))
    return handle


def _insertion_order_as_run(hooks: Any) -> None:
    """A prepended hook moves to the front of the ``OrderedDict`` the module runs its hooks
    from, while the plain dict order under it stays as inserted. Dynamo before torch 2.11
    (strict ``torch.export``, ``torch.compile``) runs hooks in the one order and names their
    guards by position in the other: the guards then fail to build (pytorch#170429).
    Inserted again in the order they run, both orders agree."""
    items = list(hooks.items())
    hooks.clear()
    hooks.update(items)


class GatheredWeights:
    """Stands in for a module where a frame reads its weights (``_parameters``, ``_buffers``):
    the tensors its forward uses from inside it, by their names from it, read fresh at every
    call (a replaced parameter is seen)."""

    __slots__ = ("parameter_slots", "buffer_slots")

    def __init__(self, parameter_slots: list[tuple[str, Any, str]],
                 buffer_slots: list[tuple[str, Any, str]]) -> None:
        self.parameter_slots = parameter_slots  # (name, owning module, attribute)
        self.buffer_slots = buffer_slots

    @property
    def _parameters(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(owner, key, None) for name, owner, key in self.parameter_slots}

    @property
    def _buffers(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(owner, key, None) for name, owner, key in self.buffer_slots}

    def __bool__(self) -> bool:
        return bool(self.parameter_slots or self.buffer_slots)


def weights_of(module: nn.Module) -> nn.Module | GatheredWeights:
    """What a frame of ``module`` reads its weights from: the module itself, or the
    :class:`GatheredWeights` of a TorchScript module or a GraphModule (module docstring)."""
    if is_torchscript(module):
        return _script_weights(module)
    if isinstance(module, torch.fx.GraphModule):
        gathered = _graph_weights(module)
        if gathered is not None:
            return gathered
    return module


def _script_weights(module: nn.Module) -> GatheredWeights:
    parameters: list[tuple[str, Any, str]] = []
    buffers: list[tuple[str, Any, str]] = []
    for prefix, owner in module.named_modules():
        for key, _ in owner.named_parameters(recurse=False):
            parameters.append((f"{prefix}.{key}" if prefix else key, owner, key))
        for key, _ in owner.named_buffers(recurse=False):
            buffers.append((f"{prefix}.{key}" if prefix else key, owner, key))
    return GatheredWeights(parameters, buffers)


def _graph_weights(module: nn.Module) -> GatheredWeights | None:
    """The GraphModule's own weights plus those its graph reads from submodules; None when
    it reads none of theirs (its own ``_parameters`` then say it all)."""
    parameters = [(key, module, key) for key, value in module._parameters.items()
                  if value is not None]
    buffers = [(key, module, key) for key, value in module._buffers.items() if value is not None]
    borrowed = False
    seen: set[str] = set()
    for node in module.graph.nodes:
        target = node.target
        if node.op != "get_attr" or not isinstance(target, str) or "." not in target \
                or target in seen:
            continue
        seen.add(target)
        path, _, key = target.rpartition(".")
        try:
            owner = module.get_submodule(path)
        except AttributeError:
            continue
        if owner._parameters.get(key) is not None:
            parameters.append((target, owner, key))
            borrowed = True
        elif owner._buffers.get(key) is not None:
            buffers.append((target, owner, key))
            borrowed = True
    return GatheredWeights(parameters, buffers) if borrowed else None


def holds_packed_weights(module: nn.Module) -> bool:
    """Whether ``module`` keeps packed weights itself: a TorchScript object attribute (torch.ao's
    quantized ``_packed_params``), which no frame measures."""
    return any(isinstance(value, torch.ScriptObject) for value in vars(module).values())


def packed_weights(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The packed weights of a torch.ao quantized module (one that keeps them, or whose
    ``_packed_params`` child does, and hands them out through its ``weight()`` and ``bias()``
    methods), unpacked now and dequantized, by name; empty for any other module. Event time
    only: it unpacks them."""
    if not holds_packed_weights(module) and not any(
            holds_packed_weights(child) for child in module.children()):
        return []
    found = []
    for name in ("weight", "bias"):
        method = getattr(type(module), name, None)
        if not callable(method) or isinstance(method, (nn.Module, torch.Tensor)):
            continue
        try:
            tensor = method(module)
        except Exception:  # a packed format these methods cannot unpack
            continue
        if isinstance(tensor, torch.Tensor):
            found.append((name, tensor.dequantize() if tensor.is_quantized else tensor))
    return found

"""Which modules PyTorch's full backward hooks refuse, found by watching one forward.

Full backward hooks wrap a module's inputs and outputs in views; PyTorch raises if such a view
is later modified in place. A replay that records backward frames first runs the batch's forward
once with this probe and hooks only the modules it finds safe. The rules are those of the live
watch's calibration pass (:mod:`nanwidget.core.grads.backward`), so a replayed backward frame
exists exactly where a live one would: ``inplace=True`` modules, modules that write into their
inputs, modules whose outputs are written in place before the root forward returns, and modules
whose output is neither a tensor nor a tuple are skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..recorder import ModuleInfo

__all__ = ["BackwardHookProbe"]


class BackwardHookProbe:
    """Version counters of every watched module's inputs and outputs during one forward."""

    def __init__(self, infos: list[ModuleInfo]) -> None:
        self.infos = infos
        # id(module) -> why it gets no backward hook
        self.unsafe: dict[int, str] = {id(info.module): "inplace=True" for info in infos
                                       if getattr(info.module, "inplace", False) is True}
        self._inputs: dict[int, list[list[tuple[torch.Tensor, int]]]] = {}
        self._outputs: list[tuple[int, torch.Tensor, int]] = []
        self._handles: list[Any] = []

    def install(self) -> None:
        for info in self.infos:
            module = info.module
            self._handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook, with_kwargs=True,
                                                              always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen = [(a, a._version) for a in args if isinstance(a, torch.Tensor)]
        self._inputs.setdefault(id(module), []).append(seen)

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        key = id(module)
        stack = self._inputs.get(key)
        seen = stack.pop() if stack else []
        if any(tensor._version != version for tensor, version in seen):
            self.unsafe.setdefault(key, "writes into its input in place")
        if isinstance(output, torch.Tensor):
            self._outputs.append((key, output, output._version))
        elif isinstance(output, tuple):
            for item in output:
                if isinstance(item, torch.Tensor):
                    self._outputs.append((key, item, item._version))
        elif output is not None:
            self.unsafe.setdefault(key, f"returns {type(output).__name__}")

    def finish(self) -> dict[int, str]:
        """After the forward returned: the unsafe modules (id -> reason)."""
        for key, tensor, version in self._outputs:
            if tensor._version != version:
                self.unsafe.setdefault(key, "its output is modified in place after it returns")
        self._outputs.clear()
        self._inputs.clear()
        return self.unsafe

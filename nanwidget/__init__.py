"""nanwidget: find the first NaN or Inf in a PyTorch model, from a notebook or a script.

    import nanwidget as nw
    with nw.watch(model) as w:
        train(...)          # raises nw.NanDetected at the first NaN/Inf
    print(w.report())

In a notebook: ``%load_ext nanwidget`` then ``%nanwatch model`` or a ``%%nanwatch model`` cell.
The core imports only torch, pandas and numpy; widgets, plots and magics load on first use.
"""

from __future__ import annotations

from typing import Any

from .core import (AbortAfterBatch, GradEvent, NanDetected, NanEvent, NanWarning, NanWatch,
                   detect_overflow)
from .core.watch import watch

__version__ = "0.1.0"

__all__ = [
    "watch", "NanWatch", "NanEvent", "GradEvent", "NanDetected", "NanWarning", "AbortAfterBatch",
    "detect_overflow", "load_run", "Run", "Trace", "FrameBrowser", "train_with_nan_guard",
    "load_ipython_extension", "unload_ipython_extension", "__version__",
]

# Names served lazily: they pull in optional layers (ipywidgets, pyarrow) or later modules.
_LAZY = {
    "FrameBrowser": ("nanwidget.widgets", "FrameBrowser"),
    "Trace": ("nanwidget.core.replay", "Trace"),
    "load_run": ("nanwidget.core.persist", "load_run"),
    "Run": ("nanwidget.core.persist", "Run"),
    "train_with_nan_guard": ("nanwidget.core.grads", "train_with_nan_guard"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        module_name, attribute = _LAZY[name]
        return getattr(importlib.import_module(module_name), attribute)
    raise AttributeError(f"module 'nanwidget' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nanwidget``: register the %nanwatch magics."""
    from .magics import load_ipython_extension as load
    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nanwidget``: remove the magics and every hook a watch added."""
    from .magics import unload_ipython_extension as unload
    unload(ipython)

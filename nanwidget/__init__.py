"""nanwidget: find the first NaN or Inf in a PyTorch model, from a notebook or a script.

    import nanwidget as nw
    with nw.watch(model) as w:
        train(...)          # raises nw.NanDetected at the first NaN/Inf
    print(w.report())

In a notebook: ``%load_ext nanwidget`` then ``%nanwatch model`` or a ``%%nanwatch model`` cell.

Layers, top to bottom: this package (the public names), ``cli`` (command line), ``magics``
(IPython), ``widgets`` (ipywidgets), ``plots`` (matplotlib), ``training`` (a guarded loop),
``core`` (torch, pandas and numpy only). The notebook layers load when first used (importing
ipywidgets and matplotlib takes seconds, and scripts and torchrun workers never need them);
that happens in the functions below (plain imports inside them) and nowhere else.
"""

from __future__ import annotations

from typing import Any

from .core.early_warning import EarlyWarning, EarlyWarningIssued
from .core.events import AbortAfterBatch, GradEvent, NanDetected, NanEvent, NanWarning, ScalerSkip
from .core.persist import Run, RunLoadError, load_run
from .core.recorder import CompiledCallError, ConcurrentForwardError
from .core.report import detect_overflow
from .core.trace import Trace
from .core.viewer import set_browser_opener
from .core.watch import NanWatch, live_watches, watch
from .training import train_with_nan_guard

__version__ = "0.1.0"

__all__ = [
    "watch", "NanWatch", "NanEvent", "GradEvent", "ScalerSkip", "NanDetected", "NanWarning",
    "AbortAfterBatch",
    "EarlyWarning", "EarlyWarningIssued",
    "ConcurrentForwardError", "CompiledCallError", "detect_overflow", "load_run", "Run", "RunLoadError", "Trace",
    "FrameBrowser", "train_with_nan_guard", "live_watches", "load_ipython_extension",
    "unload_ipython_extension", "__version__",
]


def _open_browser(source: Any) -> Any:
    from .widgets import FrameBrowser
    return FrameBrowser(source)


set_browser_opener(_open_browser)


def __getattr__(name: str) -> Any:
    if name == "FrameBrowser":
        from .widgets import FrameBrowser
        return FrameBrowser
    raise AttributeError(f"module 'nanwidget' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nanwidget``: register the %nanwatch magics."""
    from .magics import load_ipython_extension as load
    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nanwidget``: remove the magics and every hook a watch added."""
    from .magics import unload_ipython_extension as unload
    unload(ipython)

"""How core objects open their FrameBrowser without the core importing the widgets layer.

The widgets layer lives above the core (it needs ipywidgets and matplotlib); the package's top
level registers the opener, so ``watch.browse()`` and ``run.browse()`` work once ``nanwidget``
is imported, while a plain script never loads ipywidgets.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["set_browser_opener", "open_browser"]

_opener: Callable[[Any], Any] | None = None


def set_browser_opener(opener: Callable[[Any], Any] | None) -> None:
    """Register the function that builds a FrameBrowser for a source (None: unregister)."""
    global _opener
    _opener = opener


def open_browser(source: Any) -> Any:
    """The FrameBrowser for ``source`` (a NanWatch, Run, Trace, NanEvent or frames DataFrame)."""
    if _opener is None:
        raise RuntimeError("no FrameBrowser is available: import nanwidget (the package) or "
                           "nanwidget.widgets, which need ipywidgets and matplotlib")
    return _opener(source)

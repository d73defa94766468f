"""How core objects open their FrameBrowser without the core importing the widgets layer.

The widgets layer lives above the core (it needs ipywidgets and matplotlib); the package's top
level registers the opener (kept in :mod:`~nanwidget.core.state`), so ``watch.browse()`` and
``run.browse()`` work once ``nanwidget`` is imported, while a plain script never loads ipywidgets.
"""

from __future__ import annotations

from typing import Any

from .state import browser_opener, set_browser_opener

__all__ = ["set_browser_opener", "open_browser"]


def open_browser(source: Any) -> Any:
    """The FrameBrowser for ``source`` (a NanWatch, Run, Trace, NanEvent or frames DataFrame)."""
    opener = browser_opener()
    if opener is None:
        raise RuntimeError("no FrameBrowser is available: import nanwidget (the package) or "
                           "nanwidget.widgets, which need ipywidgets and matplotlib")
    return opener(source)

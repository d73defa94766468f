"""IPython magics: ``%load_ext nanwidget`` then ``%nanwatch MODEL`` / ``%%nanwatch MODEL``.

IPython is imported only here, when the extension loads; the rest of nanwidget runs without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_ipython_extension", "unload_ipython_extension"]

_MAGICS: dict[int, Any] = {}  # id(shell) -> the NanwatchMagics instance it holds


def load_ipython_extension(ipython: Any) -> None:
    """Register %nanwatch on ``ipython``; ``%config NanwatchMagics`` sets its defaults."""
    from ..core.events import NanDetected
    from .magic import NanwatchMagics, show_nan_detected
    if id(ipython) in _MAGICS:
        return
    magics = NanwatchMagics(shell=ipython, parent=ipython)
    ipython.register_magics(magics)
    ipython._nanwidget_magics = magics
    # NanDetected from any cell: one line and the browser. Only when no one else set a handler.
    magics.owns_custom_exc = not ipython.custom_exceptions
    if magics.owns_custom_exc:
        ipython.set_custom_exc((NanDetected,), show_nan_detected)
    if magics not in ipython.configurables:
        ipython.configurables.append(magics)
    _MAGICS[id(ipython)] = magics


def unload_ipython_extension(ipython: Any) -> None:
    """Remove %nanwatch and every hook any watch added (the notebook's own nw.watch ones too)."""
    magics = _MAGICS.pop(id(ipython), None)
    if magics is not None:
        magics.manager.close_all()
        for kind in ("line", "cell"):
            table = ipython.magics_manager.magics[kind]
            if getattr(table.get("nanwatch"), "__self__", None) is magics:
                del table["nanwatch"]
        ipython.magics_manager.registry.pop(type(magics).__name__, None)
        if magics in ipython.configurables:
            ipython.configurables.remove(magics)
        from ..core.events import NanDetected
        if getattr(magics, "owns_custom_exc", False) and ipython.custom_exceptions == (NanDetected,):
            ipython.set_custom_exc((), None)
        if getattr(ipython, "_nanwidget_magics", None) is magics:
            del ipython._nanwidget_magics
    else:
        from .manager import WatchManager
        WatchManager().close_all()

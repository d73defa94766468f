"""IPython magics: ``%load_ext nanwidget`` then ``%nanwatch MODEL`` / ``%%nanwatch MODEL``.

IPython is imported only here, when the extension loads; the rest of nanwidget runs without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_ipython_extension", "unload_ipython_extension"]

_MAGICS: dict[int, Any] = {}  # id(shell) -> the NanwatchMagics instance it holds


def load_ipython_extension(ipython: Any) -> None:
    """Register %nanwatch on ``ipython``; ``%config NanwatchMagics`` sets its defaults."""
    from .magic import NanwatchMagics
    if id(ipython) in _MAGICS:
        return
    magics = NanwatchMagics(shell=ipython, parent=ipython)
    ipython.register_magics(magics)
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
    else:
        from .manager import WatchManager
        WatchManager().close_all()

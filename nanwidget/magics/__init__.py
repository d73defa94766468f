"""IPython magics: ``%load_ext nanwidget`` then ``%nanwatch MODEL`` / ``%%nanwatch MODEL``.

IPython is imported only by this package, which ``nanwidget.load_ipython_extension`` loads; the
rest of nanwidget runs without it.
"""

from __future__ import annotations

from typing import Any

from .magic import NanwatchMagics, find_magics
from .manager import WatchManager

__all__ = ["load_ipython_extension", "unload_ipython_extension"]


def load_ipython_extension(ipython: Any) -> None:
    """Register %nanwatch on ``ipython``; ``%config NanwatchMagics`` sets its defaults."""
    if find_magics(ipython) is None:
        NanwatchMagics(shell=ipython, parent=ipython).attach()


def unload_ipython_extension(ipython: Any) -> None:
    """Remove %nanwatch and every hook any watch added (the notebook's own nw.watch ones too)."""
    magics = find_magics(ipython)
    if magics is not None:
        magics.detach()
    else:
        WatchManager().close_all()

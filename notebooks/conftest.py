"""nbval runs each notebook in a kernel subprocess: let it import this checkout's nanwidget."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
_paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
if ROOT not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, *_paths] if p)

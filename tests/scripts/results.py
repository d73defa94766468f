"""What the torchrun scripts here print for their tests: one ``RESULT {json}`` line per result."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def emit(result: dict[str, Any]) -> None:
    """Print ``result`` as one ``RESULT {json}`` line, written in one piece so that the lines of
    two ranks sharing the terminal cannot interleave."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(result, default=str) + "\n").encode())

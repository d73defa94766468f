"""The engine: hooks, stats, frames, events, history, replay, persistence.

Imports torch, pandas, numpy and the standard library only, so it runs in any script.
"""

from .events import AbortAfterBatch, GradEvent, NanDetected, NanEvent
from .frames import FRAME_COLUMNS, Frame, FrameBuffer, frames_to_dataframe
from .history import HISTORY_COLUMNS, History
from .report import detect_overflow
from .stats import PendingStats, TensorStats, classify, dtype_max
# The ``watch()`` function is exported by the top-level package; here ``nanwidget.core.watch``
# stays the module (re-exporting the function would shadow it).
from .watch import NanWarning, NanWatch

__all__ = [
    "AbortAfterBatch", "GradEvent", "NanDetected", "NanEvent", "FRAME_COLUMNS", "Frame",
    "FrameBuffer", "frames_to_dataframe", "HISTORY_COLUMNS", "History", "detect_overflow",
    "PendingStats", "TensorStats", "classify", "dtype_max", "NanWarning", "NanWatch",
]

"""The engine: hooks, stats, frames, events, history, replay, persistence.

Imports torch, pandas, numpy and the standard library only, so it runs in any script.
Layers, each importing only from those above it in this list:

- ``schema``, ``events``, ``ranks``: the shapes of the data, the events, which process this is;
- ``native``, ``stats``, ``walk``, ``entries``: measuring tensors without host syncs;
- ``frames``, ``history``, ``report``, ``detect``, ``trace``, ``sourcelines``, ``viewer``;
- ``recorder``: hooks, batch state, detection, the ring and history; the :class:`Feature` API;
- features: ``replay``, ``grads``, ``persist``, ``consensus``;
- ``watch``: the :class:`NanWatch` facade that composes them.
"""

from .events import AbortAfterBatch, GradEvent, NanDetected, NanEvent, NanWarning
from .frames import Frame, FrameBuffer, frames_to_dataframe
from .history import History
from .recorder import CompiledCallError, ConcurrentForwardError, Feature, Recorder
from .report import detect_overflow
from .schema import FRAME_COLUMNS, GRAD_HISTORY_COLUMNS, HISTORY_COLUMNS, OPS_COLUMNS
from .stats import PendingStats, TensorStats, classify, dtype_max
from .trace import Trace
# The ``watch()`` function is exported by the top-level package; here ``nanwidget.core.watch``
# stays the module (re-exporting the function would shadow it).
from .watch import NanWatch, live_watches

__all__ = [
    "AbortAfterBatch", "GradEvent", "NanDetected", "NanEvent", "NanWarning", "Frame",
    "FrameBuffer", "frames_to_dataframe", "History", "ConcurrentForwardError", "CompiledCallError", "Feature",
    "Recorder", "detect_overflow", "FRAME_COLUMNS", "GRAD_HISTORY_COLUMNS", "HISTORY_COLUMNS",
    "OPS_COLUMNS", "PendingStats", "TensorStats", "classify", "dtype_max", "Trace", "NanWatch",
    "live_watches",
]

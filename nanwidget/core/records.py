"""What finished batches leave behind: the frame ring, every frame of the trace batches, the
per-module history of output magnitudes, and the events.

The :class:`~nanwidget.core.recorder.Recorder` hands each batch's resolved frames to one
:class:`Records` (under its lock): the ring keeps the last ``max_frames`` frames, the history
one row per (batch, module), the trace batches all their frames; the verdict on the frames
(:class:`~nanwidget.core.detect.Detector`) is taken in the same pass. Frames a replay made are
taken the same way, without a verdict (the replay's owner took it).
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd
import torch

from .detect import Detector, Window
from .events import NanEvent
from .frames import Frame, FrameBuffer, frames_to_dataframe
from .history import History

__all__ = ["Records", "Finding", "QUANTIZED_DTYPES"]

# Quantized outputs (torch.ao after convert) hold real values, measured dequantized: they get
# history rows as float outputs do, unlike integers (token ids, an argmax).
QUANTIZED_DTYPES = frozenset(getattr(torch, name) for name in
                              ("quint8", "qint8", "qint32", "quint4x2", "quint2x4")
                              if hasattr(torch, name))


class Finding:
    """What a feature that checks batches on its own (the sentinel) found: its event (or None)
    and the frames its replays made, each group one batch, oldest first. The recorder takes
    the frames as if it had recorded them live, then reviews the event."""

    __slots__ = ("event", "frames")

    def __init__(self, event: NanEvent | None, frames: Iterable[list[Frame]] = ()) -> None:
        self.event = event
        self.frames = list(frames)


class Records:
    """The ring, the trace batches' frames, the history and the events of one recorder."""

    def __init__(self, module_names: list[str], module_types: list[str], *, max_frames: int,
                 trace_batches: frozenset[int], max_events: int, detector: Detector,
                 rank: int) -> None:
        self.max_frames = max_frames
        self.trace_batches = trace_batches
        self.max_events = max_events
        self.detector = detector
        self.ring = FrameBuffer(max_frames)
        self.history = History(module_names, module_types, rank=rank)
        self.trace_frames: dict[int, list[Frame]] = {}
        self.events: list[NanEvent] = []
        self.events_dropped = 0
        #: module name -> its column in the history
        self.name_index = {name: i for i, name in enumerate(module_names)}

    def take(self, frames: list[Frame], *, verdict: bool = True,
             window: Window | None = None, raised: Frame | None = None) -> NanEvent | None:
        """History, trace batches and the ring take resolved ``frames``. With ``verdict``, their
        first event (not recorded yet), whose report shows ``window(frames, position)`` (by
        default the ring's frames before them and theirs). ``raised``: among ``frames``, the
        root's frame of a forward that raised; with no other event, a NaN/Inf among its inputs
        is one (:meth:`Detector.raised_on_input`)."""
        event: NanEvent | None = None
        name_index = self.name_index
        record = self.history.record
        trace_batches = self.trace_batches
        window = window or self.ring.window_ending_with
        for position, frame in enumerate(frames):
            bad = False
            entries = frame.entries
            first_output = frame.first_output
            for slot in range(first_output):  # weights and inputs: only the verdict
                stats = entries[slot][1]
                if stats is not None and (stats.nan or stats.inf):
                    bad = True
            if first_output < len(entries):  # outputs (Frame.outputs(), inlined): their row
                column = None
                for slot in range(first_output, len(entries)):
                    entry = entries[slot]
                    stats = entry[1]
                    if stats is None:
                        continue
                    nonfinite = stats.nan or stats.inf
                    if nonfinite:
                        bad = True
                    dtype = entry[2]
                    if not (dtype.is_floating_point or dtype.is_complex) \
                            and dtype not in QUANTIZED_DTYPES:
                        continue  # token ids, a PackedSequence's batch_sizes: no magnitude
                    if column is None:
                        column = name_index[frame.module]
                    record(frame.batch, column, stats.abs_max, stats.abs_min, nonfinite)
            if bad and verdict and event is None:
                event = self.detector.event_at(frames, position, window)
            if trace_batches and frame.batch in trace_batches:
                self.trace_frames.setdefault(frame.batch, []).append(frame)
        if raised is not None and verdict and event is None:
            position = next((p for p in range(len(frames) - 1, -1, -1) if frames[p] is raised),
                            None)
            if position is not None:
                event = self.detector.raised_on_input(frames, position, window)
        self.ring.extend(frames)
        return event

    def add_event(self, event: NanEvent) -> bool:
        """Keep ``event`` (or count it past ``max_events``); False when it is kept already."""
        if any(known is event for known in self.events):
            return False
        if len(self.events) < self.max_events:
            self.events.append(event)
        else:
            self.events_dropped += 1
        return True

    def frames_table(self, batch: int | None = None) -> pd.DataFrame:
        """Frames in the ring, or every frame of trace batch ``batch``."""
        if batch is None:
            return frames_to_dataframe(list(self.ring))
        if batch not in self.trace_frames:
            held = sorted(self.trace_frames) or "none yet"
            raise KeyError(f"batch {batch} is not a recorded trace batch (trace_batches="
                           f"{sorted(self.trace_batches)}; recorded: {held})")
        return frames_to_dataframe(self.trace_frames[batch])

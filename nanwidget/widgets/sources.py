"""What a FrameBrowser can open, reduced to one shape: named frame tables plus context.

The browser never computes statistics: every number it shows comes from these DataFrames,
which the core made from its frames.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from ..core.early_warning import EarlyWarning
from ..core.events import NanEvent
from ..core.persist import Run
from ..core.trace import Trace
from ..core.watch import NanWatch

__all__ = ["BrowserSource", "open_source"]


@dataclass
class BrowserSource:
    """Frame tables by name (first one opens), plus what else the source offers."""

    views: dict[str, Callable[[], pd.DataFrame]]
    events: list[NanEvent] = field(default_factory=list)
    history: Callable[[], pd.DataFrame] | None = None
    watch: NanWatch | None = None
    trace: Trace | None = None
    refreshable: bool = False
    # Why re-running is not possible from this source ("" when it is).
    no_replay_reason: str = ""
    # Early warnings of the run (a watch's or a recording's), oldest first.
    warnings: list[EarlyWarning] = field(default_factory=list)


def _event_label(event: NanEvent, number: int) -> str:
    where = event.module or "<root>"
    rank = f", rank {event.rank}" if event.rank else ""
    return f"event {number}: {event.kind} at {where}, batch {event.batch}{rank}"


def _event_views(events: list[NanEvent]) -> dict[str, Callable[[], pd.DataFrame]]:
    views: dict[str, Callable[[], pd.DataFrame]] = {}
    for number, event in enumerate(events[:20], start=1):
        if isinstance(event.frames, pd.DataFrame) and not event.frames.empty:
            views[_event_label(event, number)] = (lambda e=event: e.frames)
    return views


def open_source(source: Any) -> BrowserSource:
    """Sort ``source`` (watch, loaded run, trace, event or frames DataFrame) into views."""
    if isinstance(source, NanWatch):
        watch = source
        events = watch.events
        views = _event_views(events)
        views["frames held (latest)"] = watch.frames
        for batch in sorted(watch.trace_batches):
            views[f"trace batch {batch}"] = (lambda b=batch: watch.frames(batch=b))
        return BrowserSource(views=views, events=events, history=watch.history, watch=watch,
                             refreshable=True, warnings=watch.warnings)
    if isinstance(source, pd.DataFrame):
        return BrowserSource(views={"frames": lambda: source},
                             no_replay_reason="re-running needs a live watch (this browser "
                                              "shows a DataFrame)")
    if isinstance(source, NanEvent):
        return BrowserSource(views={"event frames": lambda: source.frames}, events=[source],
                             trace=source.trace,
                             no_replay_reason="re-running needs a live watch (this browser shows "
                                              "one event); use watch.browse()")
    if isinstance(source, Trace):
        return BrowserSource(views={"trace": lambda: source.frames}, trace=source,
                             no_replay_reason="this browser already shows a trace")
    if isinstance(source, Run):
        events = list(source.events)
        views = _event_views(events)
        views["frames held (latest)"] = source.frames
        return BrowserSource(views=views, events=events, history=source.history,
                             refreshable=True, warnings=source.warnings,
                             no_replay_reason="re-running needs a live watch (a loaded run "
                                              "holds no model)")
    raise TypeError("FrameBrowser opens a NanWatch, a loaded Run, a Trace, a NanEvent or a frames "
                    f"DataFrame; got {type(source).__name__}")

"""The verdict: which frame of a resolved batch is its first NaN/Inf event, and where it came from.

Kept apart from the recorder so that the rules (what counts, which origin) live in one place
that the live watch, sentinel replays and tests all share.
"""

from __future__ import annotations

from collections.abc import Callable

from .entries import Entry
from .events import NanEvent
from .frames import Frame, frames_to_dataframe
from .schema import is_input_role, is_output_role

__all__ = ["first_event", "event_at", "make_event", "event_kind"]


def event_kind(nan: bool, inf: bool) -> str:
    """"nan", "inf" or "nan+inf"."""
    return "nan+inf" if nan and inf else ("nan" if nan else "inf")


def _origin(frame: Frame, bad: list[Entry]) -> tuple[str, Entry]:
    """The origin word and the entry an event names for a frame holding non-finite values."""
    if frame.phase == "backward":
        return "grad", bad[0]
    weights = [e for e in bad if not is_input_role(e[0]) and not is_output_role(e[0])]
    if weights:
        return "weight", weights[0]
    inputs = [e for e in bad if is_input_role(e[0])]
    if inputs:
        return "input", inputs[0]
    return "output", bad[0]


def make_event(frames: list[Frame], position: int, window: list[Frame]) -> NanEvent:
    """The event of ``frames[position]``; ``window`` is the frames its report shows."""
    frame = frames[position]
    origin, (role, stats, _dtype, _shape, _note) = _origin(frame, frame.nonfinite_entries())
    return NanEvent(batch=frame.batch, module=frame.module, module_type=frame.module_type,
                    call=frame.call, role=role, kind=event_kind(stats.nan, stats.inf),
                    origin=origin, is_backward=frame.phase == "backward",
                    frames=frames_to_dataframe(window), rank=frame.rank, frame=frame.index)


Window = Callable[[list[Frame], int], list[Frame]]


def event_at(frames: list[Frame], position: int, window: Window) -> NanEvent | None:
    """The event of ``frames[position]``, a frame holding a non-finite value, or None when
    that value is not an event. ``window(frames, position)`` gives the frames its report shows."""
    return make_event(frames, position, window(frames, position))


def first_event(frames: list[Frame], window: Window) -> NanEvent | None:
    """The first event among ``frames`` (resolved, in firing order), or None."""
    for position, frame in enumerate(frames):
        if frame.nonfinite_entries():
            event = event_at(frames, position, window)
            if event is not None:
                return event
    return None

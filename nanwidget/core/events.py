"""What a watch reports: events, and the exceptions and warnings that stop or flag a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pandas as pd

from .schema import EVENT_FIELDS, FRAME_COLUMNS

__all__ = ["NanEvent", "GradEvent", "ScalerSkip", "NanDetected", "NanWarning", "AbortAfterBatch",
           "ORIGIN_WORDS", "UNVERIFIED_NOTES", "LOSS_ROLE", "event_fields", "event_from_fields"]

ORIGIN_WORDS = {
    "output": "made here from finite inputs and weights",
    "input": "arrived through an input (from the data, an earlier module, or a functional op "
             "between modules)",
    "weight": "a parameter or buffer of this module is non-finite",
    "grad": "found in a gradient",
    "peer": "another rank found a NaN/Inf in this batch; this rank stops with it",
}

# The start of the ``note`` of an event whose origin nothing verified: a sentinel-mode event
# seen in the model's outputs that no replay explained (refused, failed, or met finite values),
# or an output event of a module inside which modules added after watch() run unwatched.
UNVERIFIED_NOTES = ("not replayed", "not reproduced", "not checked")
_UNVERIFIED_WORDS = "found in {where} outputs (where it was made was not checked)"
# The role of an event found in the loss computed from the model's outputs (outside the model:
# the loss a GradScaler scales, or the one a training callback checks).
LOSS_ROLE = "loss"
_LOSS_WORDS = "made outside the model, in the loss computed from its outputs"


@dataclass
class NanEvent:
    """The first non-finite value of one batch: where it was seen and where it came from.

    ``trace`` is a :class:`~nanwidget.core.trace.Trace` when the batch was replayed
    (``replay_on_nan=True``, and every sentinel-mode event), else None. ``peer_rank`` is set
    when ``origin == "peer"``: the rank whose NaN/Inf made this one stop; ``batch`` is then this
    rank's own batch, ``peer_batch`` the finder's (ranks that ran different numbers of forwards
    count batches differently), and the other fields describe the finder's event. ``note``:
    what could not be checked, "" when nothing; ``frames_note``: why earlier frames are
    missing from ``frames``, "" when none are.
    """

    batch: int
    module: str
    module_type: str
    call: int
    role: str
    kind: str  # "nan" | "inf" | "nan+inf"
    origin: str  # "output" | "input" | "weight" | "grad" | "peer"
    is_backward: bool = False
    frames: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=FRAME_COLUMNS),
                                 repr=False)
    rank: int = 0
    trace: Any = field(default=None, repr=False)
    frame: int = 0  # index of the event's own frame within its batch
    peer_rank: int | None = None
    peer_batch: int | None = None  # origin "peer": the batch number on the rank that found it
    # What could not be checked, in one sentence ("" when nothing): e.g. a sentinel-mode event
    # that the eager replay did not reproduce. Part of the summary.
    note: str = ""
    # Why ``frames`` holds fewer than ``max_frames`` frames although earlier ones ran (sentinel
    # mode: batches it did not record); "" otherwise. Shown in the report.
    frames_note: str = ""

    @property
    def module_label(self) -> str:
        """The module as a user reads it: its name, or "<root>" for the model itself."""
        return self.module or "<root>"

    @property
    def origin_words(self) -> str:
        """The origin in words; for an output event no replay explained, only where it was seen."""
        if self.origin == "output" and self.module == "" and self.role == LOSS_ROLE:
            return _LOSS_WORDS
        if self.origin == "output" and self.note.startswith(UNVERIFIED_NOTES):
            return _UNVERIFIED_WORDS.format(where="the model's" if self.module == "" else "its")
        return ORIGIN_WORDS.get(self.origin, self.origin)

    def summary(self) -> str:
        """One line naming batch, module, role, kind and origin."""
        phase = " (backward)" if self.is_backward else ""
        if self.origin == "peer":
            same = self.peer_batch is None or self.peer_batch == self.batch
            where = (f"in batch {self.batch} on rank {self.peer_rank}" if same
                     else f"on rank {self.peer_rank} in its batch {self.peer_batch}")
            own = "" if same else f" in its batch {self.batch}"
            return (f"{self.kind} {where}{phase} at module '{self.module_label}' "
                    f"({self.module_type}, call {self.call}), {self.role} (found on rank "
                    f"{self.peer_rank}; rank {self.rank} stops with it{own})")
        rank = f" on rank {self.rank}" if self.rank else ""
        text = (f"{self.kind} in batch {self.batch}{rank}{phase} at module '{self.module_label}' "
                f"({self.module_type}, call {self.call}), {self.role}: {self.origin_words}")
        first = getattr(self.trace, "first_bad", None)
        if first is not None:
            where = (f"at {first['source']}" if first["source"]
                     else "(no line of user code on the stack)")
            text += f"; first bad op {first['op']} {where}"
        if self.note:
            text += f" ({self.note})"
        return text

    def _repr_html_(self) -> str:  # pragma: no cover - notebook nicety
        import html
        return f"<b>NanEvent</b>: {html.escape(self.summary())}"


def event_fields(event: NanEvent) -> dict[str, Any]:
    """The plain fields of ``event`` (:data:`~nanwidget.core.schema.EVENT_FIELDS`, plus
    ``peer_rank``, ``peer_batch``, ``note`` and ``frames_note``): what is written to disk and
    sent to other ranks."""
    fields = {name: getattr(event, name) for name in EVENT_FIELDS}
    fields["peer_rank"] = event.peer_rank
    fields["peer_batch"] = event.peer_batch
    fields["note"] = event.note
    fields["frames_note"] = event.frames_note
    return fields


def event_from_fields(fields: dict[str, Any], frames: pd.DataFrame | None = None,
                      trace: Any = None) -> NanEvent:
    """Rebuild an event from :func:`event_fields` (already checked by the caller)."""
    values = {name: fields[name] for name in EVENT_FIELDS}
    return NanEvent(frames=frames if frames is not None else pd.DataFrame(columns=FRAME_COLUMNS),
                    trace=trace, peer_rank=fields.get("peer_rank"),
                    peer_batch=fields.get("peer_batch"),
                    note=fields.get("note") or "", frames_note=fields.get("frames_note") or "",
                    **values)


@dataclass
class GradEvent:
    """A parameter whose gradient norm is non-finite or above the threshold."""

    batch: int
    param: str
    norm: float
    threshold: float | None
    rank: int = 0


class ScalerSkip(NamedTuple):
    """An optimizer step a ``torch.amp.GradScaler`` skipped because the gradients overflowed
    (it lowered its scale): what the scaler is for, not an event."""

    batch: int
    scale_before: float
    scale_after: float


class NanDetected(FloatingPointError):
    """Raised with ``on_nan="raise"``; ``.event`` holds the :class:`NanEvent`."""

    def __init__(self, event: NanEvent) -> None:
        self.event = event
        super().__init__(f"nanwidget: {event.summary()}")


class NanWarning(RuntimeWarning):
    """Issued for each event when ``on_nan="warn"``."""


class AbortAfterBatch(RuntimeError):
    """Raised once the batch given as ``abort_after`` has finished."""

    def __init__(self, batch: int, abort_after: int | None = None) -> None:
        self.batch = batch
        self.abort_after = batch if abort_after is None else abort_after
        super().__init__(f"nanwidget: stopping after batch {batch} "
                         f"(abort_after={self.abort_after})")

"""What the watch reports: events, and the exceptions that stop a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pandas as pd

__all__ = ["NanEvent", "GradEvent", "NanDetected", "AbortAfterBatch", "ORIGIN_WORDS"]

if TYPE_CHECKING:  # pragma: no cover
    from .replay import Trace

ORIGIN_WORDS = {
    "output": "made here from finite inputs and weights",
    "input": "arrived through an input (from the data, an earlier module, or a functional op "
             "between modules)",
    "weight": "a parameter or buffer of this module is non-finite",
    "grad": "found in a gradient",
}


@dataclass
class NanEvent:
    """The first non-finite value of one batch: where it was seen and where it came from."""

    batch: int
    module: str
    module_type: str
    call: int
    role: str
    kind: str  # "nan" | "inf" | "nan+inf"
    origin: str  # "output" | "input" | "weight" | "grad"
    is_backward: bool = False
    frames: pd.DataFrame = field(default_factory=pd.DataFrame, repr=False)
    rank: int = 0
    trace: Trace | None = field(default=None, repr=False)
    frame: int = 0  # index of the event's own frame within its batch

    @property
    def module_label(self) -> str:
        """The module as a user reads it: its name, or "<root>" for the model itself."""
        return self.module or "<root>"

    def summary(self) -> str:
        """One line naming batch, module, role, kind and origin."""
        phase = " (backward)" if self.is_backward else ""
        rank = f" on rank {self.rank}" if self.rank else ""
        text = (f"{self.kind} in batch {self.batch}{rank}{phase} at module '{self.module_label}' "
                f"({self.module_type}, call {self.call}), {self.role}: "
                f"{ORIGIN_WORDS.get(self.origin, self.origin)}")
        if self.trace is not None and getattr(self.trace, "first_bad", None) is not None:
            first = self.trace.first_bad
            text += f"; first bad op {first['op']} at {first['source']}"
        return text

    def _repr_html_(self) -> str:  # pragma: no cover - notebook nicety
        return f"<b>NanEvent</b>: {self.summary()}"


@dataclass
class GradEvent:
    """A parameter whose gradient norm is non-finite or above the threshold."""

    batch: int
    param: str
    norm: float
    threshold: float | None
    rank: int = 0


class NanDetected(FloatingPointError):
    """Raised with ``on_nan="raise"``; ``.event`` holds the :class:`NanEvent`."""

    def __init__(self, event: NanEvent) -> None:
        self.event = event
        super().__init__(f"nanwidget: {event.summary()}")


class AbortAfterBatch(RuntimeError):
    """Raised once the batch given as ``abort_after`` has finished."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        super().__init__(f"nanwidget: stopping after batch {batch} (abort_after={batch})")

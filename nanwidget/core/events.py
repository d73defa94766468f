"""What a watch reports: events, and the exceptions and warnings that stop or flag a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pandas as pd

from .schema import EVENT_FIELDS, FRAME_COLUMNS, NO_USER_LINE

__all__ = ["NanEvent", "Diagnosis", "GradEvent", "ScalerSkip", "NanDetected", "NanWarning",
           "AbortAfterBatch", "ORIGIN_WORDS", "UNVERIFIED_NOTES", "NOT_REPLAYED", "REPEATED_NOTES",
           "NO_WEIGHTS_SEEN", "UNREAD_WEIGHTS", "PASS_THE_SCALER", "SCALER_IN_THE_LOOP",
           "weights_unchecked",
           "event_kind", "DIAGNOSIS_KINDS",
           "CONFIDENCES", "LOSS_WORDS", "LOSS_ROLE", "event_fields", "event_from_fields"]

ORIGIN_WORDS = {
    "output": "made here from finite inputs and weights",
    "input": "arrived through an input (from the data, an earlier module, or a functional op "
             "between modules)",
    "weight": "a parameter or buffer of this module is non-finite",
    "grad": "found in a gradient",
    "peer": "another rank found a NaN/Inf in this batch; this rank stops with it",
}

# An event whose gradient reached the model's output already non-finite: made in the loss.
LOSS_WORDS = ("the gradient reached the model's output already non-finite: made in the loss, "
              "outside the model")

# What a Diagnosis can say, in the contract's order; and how sure it is.
DIAGNOSIS_KINDS = ("overflow", "domain", "masked-row", "divergence", "corrupted-weight",
                   "bad-data", "loss", "unknown")
CONFIDENCES = ("high", "medium", "low")


@dataclass
class Diagnosis:
    """Why an event happened, not only where: ``kind`` (one of :data:`DIAGNOSIS_KINDS`),
    ``summary`` (one sentence naming the module or op), ``evidence`` (the numbers behind it),
    ``suggestion`` (the known fixes for that kind, the likeliest first), ``rows`` (batch rows,
    along dim 0, holding the first non-finite values, when they can be told) and ``confidence``
    ("high", "medium" or "low"). ``op``: the op that made the value and where ("log at
    train.py:12"), when a replay named it; when no op made it, the op of ``loss_fn`` it entered
    through from a tensor the loss reads ("" otherwise)."""

    kind: str
    summary: str
    evidence: list[str] = field(default_factory=list)
    suggestion: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    confidence: str = "medium"
    op: str = ""

    def headline(self) -> str:
        """One line: the kind and the summary."""
        return f"{self.kind}: {self.summary}"

    def brief(self) -> str:
        """What a stop message says: the kind, the summary and the first fix."""
        fix = f" Try: {self.suggestion[0]}" if self.suggestion else ""
        return f"Why ({self.kind}): {self.summary}{fix}"

    def lines(self) -> list[str]:
        """The diagnosis as ``report()`` prints it: a line for the kind and summary, then the
        evidence, the rows and the fixes, indented."""
        lines = [f"Diagnosis ({self.kind}, {self.confidence} confidence): {self.summary}"]
        lines.extend(f"  - {item}" for item in self.evidence)
        if self.rows:
            shown = ", ".join(map(str, self.rows[:20])) + (" ..." if len(self.rows) > 20 else "")
            lines.append(f"  Rows of the batch that hold it: {shown}")
        lines.extend(f"  Try: {item}" for item in self.suggestion)
        return lines

    def fields(self) -> dict[str, Any]:
        """Plain values (JSON): what recordings and other ranks receive."""
        return {"kind": self.kind, "summary": self.summary, "evidence": list(self.evidence),
                "suggestion": list(self.suggestion), "rows": [int(r) for r in self.rows],
                "confidence": self.confidence, "op": self.op}

    @classmethod
    def from_fields(cls, fields: Any) -> Diagnosis | None:
        """The diagnosis :meth:`fields` made, or None when ``fields`` is not one (an older
        recording has none)."""
        if not isinstance(fields, dict):
            return None
        texts = [fields.get(name) for name in ("kind", "summary", "confidence")]
        lists = [fields.get(name) for name in ("evidence", "suggestion")]
        rows = fields.get("rows")
        if not all(isinstance(text, str) for text in texts) \
                or not all(isinstance(items, list) and all(isinstance(i, str) for i in items)
                           for items in lists) \
                or not isinstance(rows, list) \
                or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows):
            return None
        op = fields.get("op")
        return cls(kind=texts[0], summary=texts[1], evidence=list(lists[0]),
                   suggestion=list(lists[1]), rows=list(rows), confidence=texts[2],
                   op=op if isinstance(op, str) else "")


# The start of the ``note`` of an event whose origin nothing verified: a sentinel-mode event
# seen in the model's outputs that no replay explained (refused, failed, or met finite values),
# or an output event of a module inside which modules added after watch() run unwatched.
UNVERIFIED_NOTES = ("not replayed", "not reproduced", "not checked")
# A sentinel event's note when its batch was not replayed, and the starts of those that repeat
# an earlier event's cause (that event holds the trace; the others say why none could run).
NOT_REPLAYED = "not replayed: "
REPEATED_NOTES = (NOT_REPLAYED + "its ", NOT_REPLAYED + "the weight ")


# The note of an "output" event of a module that, with every module inside it, holds no
# parameter or buffer, when no replayed op explains it: no weight it read was measured, so
# "made here from finite inputs and weights" would claim what nothing checked.
NO_WEIGHTS_SEEN = ("it has no parameters or buffers, so no weight it reads was checked: a tensor "
                   "attribute, or one its __getattr__ fetches or samples as Pyro's PyroSample "
                   "does")
# The start of the note of an "output" event of a module whose weights (or those of a module
# inside it) the watch could not read, whether or not a replayed op made it: packed ones it
# could not unpack, tensor subclasses it could not read (quantized ones). Like NO_WEIGHTS_SEEN,
# such an event is "made here from finite inputs", never "and weights".
UNREAD_WEIGHTS = "it reads weights the watch could not read"


# The note of an Inf gradient event of a float16 run (or of one with a GradScaler among the
# caller's variables) watched without ``grad_scaler``: an AMP loss scale overflows on purpose.
PASS_THE_SCALER = ("if a torch.amp.GradScaler scales this loss, pass it: "
                   "nw.watch(model, grad_scaler=scaler) (an overflow in a step the scaler skips "
                   "is then no event; a Keras model compiled under mixed_float16: "
                   "grad_scaler=model.optimizer)")
# Said before it when the training loop's variables hold an enabled GradScaler (or an object
# holding one): the Inf then most likely is that scale's, and the diagnosis leads with passing it.
SCALER_IN_THE_LOOP = "a GradScaler is among the training loop's variables: "


def weights_unchecked(note: str) -> bool:
    """Whether an event's note says that weights its module reads were not checked."""
    return NO_WEIGHTS_SEEN in note or UNREAD_WEIGHTS in note
_NO_WEIGHTS_WORDS = "made here from finite inputs"


# The roles of a frame's outputs: output, output[1], output[1][0], output.logits.
_OUTPUT_ROLE = r"output(?:$|[\[.])"


def event_kind(nan: bool, inf: bool) -> str:
    """"nan", "inf" or "nan+inf"."""
    return "nan+inf" if nan and inf else ("nan" if nan else "inf")
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
    missing from ``frames``, "" when none are. ``diagnosis``: why it happened (a
    :class:`Diagnosis`), made when the event is recorded.
    """

    batch: int
    module: str
    module_type: str
    call: int
    role: str
    kind: str  # "nan" | "inf" | "nan+inf": what the tensor ``role`` names holds (see made_kind)
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
    # Why it happened: set by the watch when the event is recorded (None for an event made by
    # hand or read from a recording that has none).
    diagnosis: Diagnosis | None = field(default=None, repr=False)
    # The watched model, named when other watches were live at the event (a model and its
    # assisted-generation assistant share their module names): "LlamaForCausalLM of 21.6K
    # parameters"; "" when this was the only watch. Part of the summary.
    model: str = ""

    @property
    def module_label(self) -> str:
        """The module as a user reads it: its name, or "<root>" for the model itself."""
        return self.module or "<root>"

    @property
    def qualified_role(self) -> str:
        """The role qualified by its module, as ``named_parameters()`` names a weight
        (``fc1.weight``; the role alone at the root)."""
        return f"{self.module}.{self.role}" if self.module else self.role

    def ran_in(self, dtype: str) -> bool:
        """Whether a tensor of the event's frames has ``dtype`` (e.g. "float16": its frames
        ran under float16 autocast)."""
        frames = self.frames
        return frames is not None and "dtype" in getattr(frames, "columns", ()) \
            and bool((frames["dtype"] == dtype).any())

    @property
    def origin_words(self) -> str:
        """The origin in words; for an output event no replay explained, only where it was seen."""
        if self.origin == "output" and self.module == "" and self.role == LOSS_ROLE:
            return _LOSS_WORDS
        if self.origin == "output" and self.note.startswith(UNVERIFIED_NOTES):
            return _UNVERIFIED_WORDS.format(where="the model's" if self.module == "" else "its")
        if self.made_in_loss:
            return LOSS_WORDS
        if self.origin == "output" and weights_unchecked(self.note):
            return _NO_WEIGHTS_WORDS
        words = ORIGIN_WORDS.get(self.origin, self.origin)
        if self.origin == "input":
            made = self._outputs_kind()
            if self.kind == "inf" and "nan" in made and self._named_mask():
                # A mask passed in holds -inf on purpose: no NaN "arrived" from the data.
                return (f"the module made {made} from its mask input {self.role} (-inf "
                        "where masked, on purpose): a row masked at every position gives 0/0 "
                        "in a softmax")
            if made and made != self.kind:
                # The kind is what arrived: say what the outputs hold when it differs (an Inf
                # that the module's matmul or softmax made NaN of).
                words += f"; the module made {made} of it"
        return words

    @property
    def made_kind(self) -> str:
        """"nan", "inf" or "nan+inf": what the event's module made. For an input event
        ``kind`` is what arrived (the input it names) and this is what its outputs hold (an
        Inf a softmax made NaN of; ``kind`` when its frame is not in ``frames``); for the
        other origins, ``kind``."""
        if self.origin != "input":
            return self.kind
        return self._outputs_kind() or self.kind

    def _outputs_kind(self) -> str:
        """"nan", "inf" or "nan+inf": what the outputs of the event's own frame hold, from
        ``frames`` ("" when the frame is not there or its outputs are finite)."""
        frames = self.frames
        if frames is None or not len(frames) or self.frame is None:
            return ""
        try:
            own = frames[(frames["frame"] == self.frame) & (frames["batch"] == self.batch)
                         & frames["role"].astype(str).str.match(_OUTPUT_ROLE)]
            nan, inf = bool(own["nan"].astype(bool).any()), bool(own["inf"].astype(bool).any())
        except (KeyError, IndexError, TypeError, ValueError):
            return ""
        return event_kind(nan, inf) if nan or inf else ""

    def _named_mask(self) -> bool:
        """Whether the event's own tensor is an additive mask by its frame: Inf and no NaN,
        named a mask or 0 wherever finite (only abs values are measured: the sign untold)."""
        frames = self.frames
        try:
            own = frames[(frames["frame"] == self.frame) & (frames["batch"] == self.batch)
                         & (frames["role"] == self.role)]
            if own.empty or bool(own["nan"].iloc[0]) or not bool(own["inf"].iloc[0]):
                return False
            zeros = own["finite_abs_max"].iloc[0] == 0 and own["abs_min"].iloc[0] == 0
        except (KeyError, IndexError, TypeError):
            return False
        return "mask" in self.role.lower() or bool(zeros)

    @property
    def made_in_loss(self) -> bool:
        """Whether the diagnosis found the gradient reaching the model's output non-finite:
        the value was made outside the model, in the loss."""
        return self.is_backward and getattr(self.diagnosis, "kind", None) == "loss"

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
        model = f" in {self.model}" if self.model else ""
        text = (f"{self.kind} in batch {self.batch}{rank}{phase} at module '{self.module_label}' "
                f"({self.module_type}, call {self.call}){model}, {self.role}: "
                f"{self.origin_words}")
        first = getattr(self.trace, "first_bad", None)
        if first is not None:
            where = (f"at {first['source']}" if first["source"]
                     else NO_USER_LINE)
            text += f"; first bad op {first['op']} {where}"
        elif self.diagnosis is not None and self.diagnosis.op:  # named by the diagnosis' replay
            text += f"; first bad op {self.diagnosis.op}"
        elif self.made_in_loss:
            text += (f"; to trace the loss's ops, watch with loss_fn=... or replay({self.batch}, "
                     "loss_fn=...)")
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
    fields["model"] = event.model
    fields["diagnosis"] = event.diagnosis.fields() if event.diagnosis is not None else None
    return fields


def event_from_fields(fields: dict[str, Any], frames: pd.DataFrame | None = None,
                      trace: Any = None) -> NanEvent:
    """Rebuild an event from :func:`event_fields` (already checked by the caller; a missing
    or malformed diagnosis leaves it None)."""
    values = {name: fields[name] for name in EVENT_FIELDS}
    return NanEvent(frames=frames if frames is not None else pd.DataFrame(columns=FRAME_COLUMNS),
                    trace=trace, peer_rank=fields.get("peer_rank"),
                    peer_batch=fields.get("peer_batch"),
                    note=fields.get("note") or "", frames_note=fields.get("frames_note") or "",
                    model=fields.get("model") or "",
                    diagnosis=Diagnosis.from_fields(fields.get("diagnosis")), **values)


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


def gradient_only_reduced(event: NanEvent) -> bool:
    """Whether ``event`` is at a parameter's gradient while every module gradient (grad_output,
    grad_input) of its batch's backward frames stayed finite: on one of several ranks, the
    rank's own gradient was finite and DDP's all-reduce averaged another rank's NaN/Inf in."""
    frames = event.frames
    if not event.is_backward or event.origin != "grad" or event.role.startswith("grad_") \
            or frames is None or frames.empty:
        return False
    own = frames[(frames["batch"] == event.batch) & (frames["phase"] == "backward")]
    flowing = own[own["role"].str.startswith("grad_")]
    return bool(len(flowing)) and not bool((flowing["nan"] | flowing["inf"]).any())


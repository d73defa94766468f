"""The verdict: which frame of a resolved batch is its first NaN/Inf event, and where it came from.

What is an event (the contract): a NaN or Inf in a module's **output**, in its **own parameter
or buffer**, or in a **gradient**. A non-finite value that only enters a module (an attention
mask of -inf) is flagged in the frames but is no event while the module's outputs stay finite;
when they do not, the origin is "input". NaN always counts; an Inf in the outputs (or own
buffers) of a module matched by ``allow_inf`` does not, nor one in an additive mask a module
keeps as a buffer: a buffer whose values are all 0 or ±inf, both present (the causal mask
``torch.full((n, n), -inf).triu(1)`` of openai-whisper's decoder and open_clip's text encoder,
``nn.Transformer.generate_square_subsequent_mask``). It is flagged in the frames; NaN in it,
or an Inf in a parameter, still counts.

Blame, in this order:

- "weight": the module's own parameter or buffer is non-finite. Before blaming an input or the
  module itself, the weights of the module and of every enclosing module are measured again
  (a write through ``p.data`` moves no version counter, so a cached measurement can be stale),
  and a non-finite parameter of an enclosing module used in its own forward
  (``x + self.pos``) is blamed on that module. Non-finite buffers of a module whose input is
  non-finite too are not blamed: its forward updated them from that input (running
  statistics, a spectral norm's power iteration, a fake quantizer's scale; also when that
  forward raised, leaving no outputs), so the input is, and a module around it whose own
  weight is non-finite (a QAT Linear whose weight its fake quantizer read) is blamed first;
- "input": a non-finite value arrived through an input; also a NaN (or an Inf not allowed)
  in the inputs of a root forward that raised, when nothing else in its frames is an event:
  the model's code refused it (a loss inside the forward checking the targets);
- "output": the module made it from finite inputs and weights, its inner modules' included
  (MultiheadAttention reads ``out_proj.weight`` without calling ``out_proj``: a non-finite
  one, measured at event time, is the module's "weight", named ``out_proj.weight``);
- "grad": found in a gradient (backward frames): in the frame of the module whose backward
  made it, when there is one (:func:`backward_birth`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .entries import Entry
from .events import NanEvent, event_kind
from .frames import Frame, frames_to_dataframe

__all__ = ["Detector", "Window", "event_kind", "first_event", "backward_birth"]

Window = Callable[[list[Frame], int], list[Frame]]
# Weights of the module with this qualified name, measured right now (None: not watched).
WeightsNow = Callable[[str], "list[Entry] | None"]
# Whether the module with this qualified name keeps a buffer (not a parameter) of this name.
IsBuffer = Callable[[str, str], bool]


def _counts(entry: Entry, inf_allowed: bool) -> bool:
    """Whether a non-finite value in this entry is an event: NaN always, Inf unless allowed."""
    stats = entry.stats
    return stats is not None and (stats.nan or (stats.inf and not inf_allowed))


def additive_mask(entry: Entry) -> bool:
    """Whether the entry's values are all 0 or ±inf, both present, and no NaN: an additive
    attention mask (finite values all 0: their largest |x| is 0, their smallest too)."""
    stats = entry.stats
    return stats is not None and stats.inf and not stats.nan \
        and stats.finite_abs_max == 0 and stats.abs_min == 0


def _is_ancestor(name: str, child: str) -> bool:
    return name != child and (name == "" or child.startswith(name + "."))


class Detector:
    """Applies the rules above to a batch's resolved frames.

    ``allow_inf``: qualified names of the modules whose outputs may hold ±inf on purpose.
    ``weights_now``: measures a module's own weights at event time (None: never re-measure).
    ``module_names``: every watched module's qualified name, and ``inner_weights_now`` (by
    default ``weights_now``): measures the weights of the modules inside an event's module.
    ``is_buffer(module, role)``: whether that weight is a buffer (an additive mask kept as a
    buffer is no event; None: every weight counts).
    """

    def __init__(self, allow_inf: Iterable[str] = (), weights_now: WeightsNow | None = None,
                 module_names: Iterable[str] = (),
                 inner_weights_now: WeightsNow | None = None,
                 is_buffer: IsBuffer | None = None) -> None:
        self.allow_inf = frozenset(allow_inf)
        self.weights_now = weights_now
        self.module_names = tuple(module_names)
        self.inner_weights_now = inner_weights_now or weights_now
        self.is_buffer = is_buffer

    def _bad_weights(self, module: str, entries: Iterable[Entry], allowed: bool) -> list[Entry]:
        """The weight entries of ``module`` whose NaN/Inf is an event (see the module
        docstring: ``allow_inf``, additive masks kept as buffers)."""
        bad = [e for e in entries if _counts(e, allowed)]
        if bad and self.is_buffer is not None:
            is_buffer = self.is_buffer
            bad = [e for e in bad if not (additive_mask(e) and is_buffer(module, e.role))]
        return bad

    def event_at(self, frames: list[Frame], position: int, window: Window) -> NanEvent | None:
        """The event of ``frames[position]`` (a frame holding a non-finite value), or None when
        that value is not an event."""
        frame = frames[position]
        if frame.phase == "backward":
            position = backward_birth(frames, position)
            bad = frames[position].nonfinite_entries()
            return self._event(frames, position, window, "grad", bad[0], bad)
        allowed = frame.module in self.allow_inf
        outputs = frame.outputs()
        bad_weights = self._bad_weights(frame.module, frame.weights(), allowed)
        bad_outputs = [e for e in outputs if _counts(e, allowed)]
        from_input = self._updated_from_input(frame, bad_weights, bad_outputs)
        if bad_weights and not from_input:
            return self._event(frames, position, window, "weight", bad_weights[0], bad_weights)
        if not bad_outputs and not from_input:
            return None  # finite outputs (or only an allowed Inf): flagged, not an event
        # A stale cached weight (written through .data) must not pass as "made here".
        if not from_input and self._refresh_weights(frame, allowed):
            bad_weights = self._bad_weights(frame.module, frame.weights(), allowed)
            return self._event(frames, position, window, "weight", bad_weights[0], bad_weights)
        bad_inputs = [e for e in frame.inputs() if e.nonfinite]
        if bad_inputs:
            owner = self._enclosing_with_bad_weights(frames, position)
            if owner is not None:
                culprits = self._blamed_weights(frames[owner])
                return self._event(frames, owner, window, "weight", culprits[0], culprits)
            # Name the input that brought it (a NaN before an Inf: masks carry -inf on purpose).
            named = next((e for e in bad_inputs if e.stats.nan), bad_inputs[0])
            # A call that raised has no outputs: the buffers it updated show what went wrong.
            return self._event(frames, position, window, "input", named,
                               bad_outputs or bad_weights)
        inner = self._inner_bad_weight(frame.module)
        if inner is not None:
            return self._event(frames, position, window, "weight", inner, [inner])
        return self._event(frames, position, window, "output", bad_outputs[0], bad_outputs)

    def raised_on_input(self, frames: list[Frame], position: int,
                        window: Window) -> NanEvent | None:
        """The event of ``frames[position]``, the root's frame of a forward that raised (no
        outputs to check), when its inputs hold a NaN, or an Inf its module is not allowed:
        what the model's code refused (a loss inside the forward checking the targets' box
        format), arrived through that input. None when they are finite. Sentinel mode checks
        the held inputs of such a forward the same way."""
        frame = frames[position]
        allowed = frame.module in self.allow_inf
        bad = [e for e in frame.inputs() if _counts(e, allowed)]
        if not bad:
            return None
        named = next((e for e in bad if e.stats.nan), bad[0])
        return self._event(frames, position, window, "input", named, [named])

    def _updated_from_input(self, frame: Frame, bad_weights: list[Entry],
                            bad_outputs: list[Entry]) -> bool:
        """Whether the frame's non-finite weights are buffers its forward updated from a
        non-finite input (running statistics, a spectral norm's power iteration, a fake
        quantizer's observed range and scale): all of them are buffers, an input is non-finite,
        and its outputs are non-finite too, or it raised (QAT's fused fake quantizer raises on
        the zero point a NaN range gives, and its kernel moves no version counter). Then the
        value arrived through the input, and the frames before (or the module around: the
        parameter a parametrization or a QAT module's fake quantizer reads) say where from."""
        return bool(bad_weights) and self.is_buffer is not None \
            and (bool(bad_outputs) or frame.first_output == len(frame.entries)) \
            and all(self.is_buffer(frame.module, e.role) for e in bad_weights) \
            and any(e.nonfinite for e in frame.inputs())

    def _blamed_weights(self, frame: Frame) -> list[Entry]:
        """The frame's non-finite weights that are an event of their own: none when they are
        buffers its forward updated from a non-finite input (:meth:`_updated_from_input`)."""
        allowed = frame.module in self.allow_inf
        bad = self._bad_weights(frame.module, frame.weights(), allowed)
        if bad and self._updated_from_input(
                frame, bad, [e for e in frame.outputs() if _counts(e, allowed)]):
            return []
        return bad

    def _inner_bad_weight(self, module: str) -> Entry | None:
        """A non-finite parameter or buffer of a module inside ``module``, measured now, as an
        entry named by its path under ``module``; None when all are finite. A module whose inner
        module's weight is bad without that module having had an event used the weight without
        calling it."""
        weights_now = self.inner_weights_now
        if weights_now is None:
            return None
        prefix = len(module) + 1 if module else 0
        for name in self.module_names:
            if not _is_ancestor(module, name):
                continue
            allowed = name in self.allow_inf
            for entry in self._bad_weights(name, weights_now(name) or (), allowed):
                return Entry((f"{name[prefix:]}.{entry.role}",) + tuple(entry[1:]))
        return None

    def _refresh_weights(self, frame: Frame, allowed: bool) -> bool:
        """Measure the frame's module's weights again; replace the frame's weight entries with
        the fresh ones (and add those no hook reads: a quantized module's packed weights);
        True when one of them is an event."""
        if self.weights_now is None:
            return False
        fresh = self.weights_now(frame.module)
        if not fresh:
            return False
        by_role = {entry.role: entry for entry in fresh}
        for slot in range(frame.first_input):
            entry = by_role.pop(frame.entries[slot].role, None)
            if entry is not None:
                frame.entries[slot] = entry
        if by_role:  # its weights come first in the frame, before its inputs and outputs
            at = frame.first_input
            frame.entries[at:at] = list(by_role.values())
            frame.first_input += len(by_role)
            frame.first_output += len(by_role)
        return bool(self._bad_weights(frame.module, fresh, allowed))

    def _enclosing_with_bad_weights(self, frames: list[Frame], position: int) -> int | None:
        """Position of the innermost enclosing module's frame (later in the batch: parents
        fire after their children) whose own weights are non-finite, or None."""
        child = frames[position].module
        seen: set[str] = set()
        for later in range(position + 1, len(frames)):
            frame = frames[later]
            if frame.phase != "forward" or frame.batch != frames[position].batch \
                    or frame.module in seen or not _is_ancestor(frame.module, child):
                continue
            seen.add(frame.module)
            # Its buffers updated from the same non-finite value (a QAT module's fake
            # quantizer around its observer) are no cause: the modules around it are asked.
            if self._blamed_weights(frame) or (
                    self._refresh_weights(frame, frame.module in self.allow_inf)
                    and self._blamed_weights(frame)):
                return later
        return None

    @staticmethod
    def _event(frames: list[Frame], position: int, window: Window, origin: str, named: Entry,
               bad: list[Entry]) -> NanEvent:
        frame = frames[position]
        if origin != "output":  # what the tensor it names holds (an input: what arrived)
            kind = event_kind(named.stats.nan, named.stats.inf)
        else:  # what went wrong in the outputs
            kind = event_kind(any(e.stats.nan for e in bad), any(e.stats.inf for e in bad))
        return NanEvent(batch=frame.batch, module=frame.module, module_type=frame.module_type,
                        call=frame.call, role=named.role, kind=kind, origin=origin,
                        is_backward=frame.phase == "backward",
                        frames=frames_to_dataframe(window(frames, position)), rank=frame.rank,
                        frame=frame.index)


def first_event(frames: list[Frame], detector: Detector,
                window: Window | None = None) -> NanEvent | None:
    """The first event among resolved ``frames`` (a replay's, say); its report shows
    ``window(frames, position)`` (by default up to 21 of ``frames`` ending with its own)."""
    window = window or (lambda batch_frames, position: batch_frames[max(0, position - 20): position + 1])
    for position, frame in enumerate(frames):
        if frame.nonfinite_entries():
            event = detector.event_at(frames, position, window)
            if event is not None:
                return event
    return None


def _born_in_backward(frame: Frame) -> bool:
    """Non-finite gradients only in the frame's ``grad_input`` roles: they were born in this
    module's backward, or reached its input tensor through another user of it."""
    bad = frame.nonfinite_entries()
    return bool(bad) and not any(entry.role.startswith("grad_output") for entry in bad)


def backward_birth(frames: list[Frame], position: int) -> int:
    """Where the first non-finite gradient of a backward pass was born.

    ``frames[position]`` is the pass's first frame holding one. Backward frames are ordered by
    the start of each module's backward, so a parent starts before its children; a parent whose
    input is also its child's input holds that child's non-finite ``grad_input`` too (it is the
    input's total gradient). When the first frame has finite ``grad_output`` and non-finite
    ``grad_input``, the innermost later frame of a module inside it that shows the same pattern
    is where the value was born. Unless a sibling that took the same input (an actor-critic's
    two heads on one body) received a non-finite ``grad_output``: the input's total gradient
    holds that sibling's share, so the value came in there (:func:`_entered_through_sibling`).
    """
    moved = _parameter_of_another_batch(frames, position)
    if moved is not None:
        position = moved
    chosen = frames[position]
    if not _born_in_backward(chosen):
        return position
    best = position
    for later in range(position + 1, len(frames)):
        frame = frames[later]
        if frame.phase == "backward" and frame.batch == chosen.batch \
                and _is_ancestor(chosen.module, frame.module) and _born_in_backward(frame):
            chosen, best = frame, later
    sibling = _entered_through_sibling(frames, best)
    return best if sibling is None else sibling


def _parameter_of_another_batch(frames: list[Frame], position: int) -> int | None:
    """The later frame of another batch holding a non-finite module gradient, when
    ``frames[position]``'s non-finite values are only parameter gradients; else None.

    A pass through the graphs of several batches' forwards (a gradient penalty's
    ``loss.backward()`` after a critic ran on the real, the fake and the interpolated batch)
    sums each parameter's gradient over all of them and puts it in the frame of its module
    opened last, whichever batch's that was: the module gradients say whose graph carried the
    value."""
    chosen = frames[position]
    if chosen.phase != "backward" or any(entry.role.startswith("grad_")
                                         for entry in chosen.nonfinite_entries()):
        return None
    for later in range(position + 1, len(frames)):
        frame = frames[later]
        if frame.phase == "backward" and frame.batch != chosen.batch and any(
                entry.role.startswith("grad_") for entry in frame.nonfinite_entries()):
            return later
    return None


def _entered_through_sibling(frames: list[Frame], position: int) -> int | None:
    """The later frame of a module beside ``frames[position]``'s (neither inside nor around
    it) that holds the same non-finite input gradient (one measurement: the same tensor's total
    gradient) and received a non-finite ``grad_output`` of its own; None when there is none.
    Its backward opened after this frame's, but the shared input's gradient is summed only
    once both ran, so this frame's non-finite ``grad_input`` says nothing of its own backward."""
    chosen = frames[position]
    shared = {id(entry.stats) for entry in chosen.nonfinite_entries()
              if entry.role.startswith(("grad_input", "grad_kwarg"))}
    if not shared:
        return None
    for later in range(position + 1, len(frames)):
        frame = frames[later]
        if frame.phase != "backward" or frame.batch != chosen.batch \
                or _is_ancestor(chosen.module, frame.module) \
                or _is_ancestor(frame.module, chosen.module) \
                or (frame.module == chosen.module and frame.call == chosen.call):
            continue
        bad = frame.nonfinite_entries()
        if any(e.role.startswith(("grad_input", "grad_kwarg")) and id(e.stats) in shared
               for e in bad) \
                and any(e.role.startswith("grad_output") and id(e.stats) not in shared
                        for e in bad):
            return later
    return None

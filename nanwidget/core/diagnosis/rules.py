"""The rules: :class:`~.facts.Facts` in, one :class:`~nanwidget.core.events.Diagnosis` out.

Where before how (the contract's precedence):

0. a backward event of a batch whose forward already made an event (``on_nan="record"`` or
   ``"warn"``) takes the forward event's diagnosis: the loss carried that NaN/Inf on (so does
   one whose gradient reached the output non-finite after an earlier backward pass of its batch,
   ``torch.autograd.grad(create_graph=True)``, made an event: that pass's diagnosis); the
   event of a GradScaler's ``scaler_patience``-th skipped step in a row on Inf gradients is an
   ``overflow`` of the scaled gradients (``divergence`` when the weights grew before), wherever
   the Inf was born: the scale made it, not a loss op;
1. a backward event made by a loss the model holds as a submodule and runs on its output
   (``self.loss(out, y)``): made there, inside the model: ``overflow`` (an Inf), else
   ``domain``, with what its frames show it was given (a distribution's scale near 0);
   ``loss``: a backward event whose gradient reached the model's output already non-finite
   (or whose first bad op ran in ``loss_fn``) was made outside the model, whatever op made it;
2. ``bad-data``: the batch's inputs hold NaN (or an Inf that no op of the model made);
   a non-finite loss computed outside the model from its finite outputs, with no op to name
   (role ``loss``: a GradScaler's, a training callback's, ``NanWatch.explain_loss``'s), is
   ``divergence`` when the weights grew over the batches before, else ``loss``;
3. a non-finite weight is ``divergence`` when the weights grew over the batches before (the
   optimizer drove them there), else ``corrupted-weight`` (a step, load or write broke it);
4. the op that made the value (the trace's first bad op, or the first NaN made from a -inf
   mask passed in): ``masked-row`` (softmax over a row that is all -inf), ``domain`` (log of <= 0, sqrt of < 0 or its gradient at 0, acos of
   |x| > 1, division by 0, inf - inf ...), ``overflow`` (a finite value grew past its dtype's
   largest), which becomes ``divergence`` when the weights also grew;
5. without an op, what the event's frame shows (an Inf from finite inputs: overflow; a
   softmax-like module with masked inputs: masked-row; a parameter's gradient that is Inf while
   the gradient its module received is finite: overflow);
6. ``unknown``.
"""

from __future__ import annotations

import linecache
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from ..events import LOSS_ROLE, Diagnosis, NanEvent
from ..schema import (DEQUANTIZED, INTENDED_INF_OPS, NO_USER_LINE, OP_ROWS_DESCRIBED, PACKED,
                      masks_rows, role_groups)
from ..sourcelines import locate_source, source_text
from ..stats import dtype_max, growth_rate
from . import fixes
from .facts import Facts, OpFacts, weight_names

__all__ = ["diagnose", "Growth", "growth_of"]

_LOG_OPS = ("log", "log2", "log10")
_INVERSE_TRIG = ("acos", "asin")
_DIVISIONS = ("div", "true_divide", "remainder", "fmod", "floor_divide")
_WEIGHT_NORMS = ("weight_norm_interface", "weight_norm")  # g * v / ||v||
_VARIANCES = ("var", "std", "var_mean", "std_mean")
_EXP_OPS = ("exp", "exp2", "expm1", "sinh", "cosh")
_DOMAIN_NAMES = _LOG_OPS + _INVERSE_TRIG + _DIVISIONS + _VARIANCES + (
    "log1p", "sqrt", "rsqrt", "atanh", "acosh", "reciprocal", "pow", "erfinv", "logit", "xlogy",
    "special_xlog1py", "lgamma", "digamma", "polygamma")
_LOG_DETERMINANTS = ("logdet", "linalg_slogdet")  # torch.logdet runs _linalg_slogdet
# Decompositions whose gradient divides by the differences of their (eigen/singular) values.
_SPECTRAL = {"linalg_eigh": "torch.linalg.eigh", "linalg_eig": "torch.linalg.eig",
             "linalg_svd": "torch.linalg.svd", "svd": "torch.svd"}
# Losses that average over the targets they count (ignore_index, class weights): with none
# counted, a mean divides 0 by 0.
_COUNTED_MEAN_LOSSES = ("nll_loss_forward", "nll_loss2d_forward")
_CTC_OPS = ("ctc_loss", "_ctc_loss", "_cudnn_ctc_loss", "_use_cudnn_ctc_loss")
# Normalisations: (x - mean) / sqrt(var + eps); their names as OpFacts.name gives them.
_NORMALISATIONS = ("native_group_norm", "native_layer_norm", "native_batch_norm",
                   "native_batch_norm_legit", "native_batch_norm_legit_no_training",
                   "batch_norm_with_update", "batch_norm_no_update")
_SOFTMAX_MODULES = ("Softmax", "LogSoftmax", "Softmin", "MultiheadAttention",
                    "TransformerEncoderLayer", "TransformerDecoderLayer")


def _g(value: float) -> str:
    """A number as evidence shows it (3 significant digits)."""
    return f"{value:.3g}"


def _g_edge(value: float) -> str:
    """A number at the edge of a domain: enough digits that 1.0000001 does not read as 1."""
    shown = _g(value)
    return f"{value:.9g}" if float(shown) != value and abs(float(shown)) == 1 else shown


def _limit_text(dtype: str) -> str:
    limit = dtype_max(dtype)
    return f"{dtype} max {limit:.5g}" if math.isfinite(limit) else dtype


def _kind_words(kind: str) -> str:
    return {"nan": "NaN", "inf": "Inf", "nan+inf": "NaN and Inf"}.get(kind, kind)


# ---------------------------------------------------------------------------- growth
@dataclass(frozen=True)
class Growth:
    """A climb that ends at the last point of a series: from ``start`` (batch, value) to
    ``end``; ``per_batch``: the mean factor per batch."""

    start: tuple[int, float]
    end: tuple[int, float]
    steps: int = 0  # counted by optimizer step (see _weights_growth): how many, else by batch
    # Sentinel mode's two measurements: when the watch began (``start``'s batch: the first
    # batch after it) and at the event (see _growth_since_start).
    since_start: bool = False
    # Every batch of the climb was a call of LBFGS's closure inside one step() (its
    # iterations, no step ended between them): see _weights_growth.
    in_lbfgs_step: bool = False
    # A climb since the watch began too slow on average over all its steps (a long healthy
    # stretch first: a warmup), dated by the root's outputs' climb into the event (see
    # _growth_since_start and _outputs_climb).
    outputs: Growth | None = None

    @property
    def ratio(self) -> float:
        return self.end[1] / self.start[1] if self.start[1] > 0 else math.inf

    @property
    def per_batch(self) -> float:
        """The mean factor per batch, or per optimizer step when counted so."""
        batches = max(1, self.steps or self.end[0] - self.start[0])
        return self.ratio ** (1.0 / batches) if math.isfinite(self.ratio) else math.inf

    @property
    def per(self) -> str:
        return "per closure call" if self.in_lbfgs_step else \
            "per optimizer step" if self.steps else "per batch"

    @property
    def diverged(self) -> str:
        return "LBFGS diverged inside one optimizer step" if self.in_lbfgs_step \
            else "Training diverged"

    @property
    def since(self) -> str:
        return "since the watch began" if self.since_start else f"since batch {self.start[0]}"

    @property
    def told(self) -> str:
        """How much it grew, for a summary: "2.5x per optimizer step since batch 3"."""
        if self.outputs is not None:
            return (f"{_g(self.ratio)}x {self.since} (the model's outputs "
                    f"{self.outputs.per_batch:.3g}x per optimizer step over the last "
                    f"{self.outputs.steps} steps before the event)")
        return f"{self.per_batch:.3g}x {self.per} {self.since}"

    def sure(self, confidence: str) -> str:
        """``confidence``, or medium for a climb told from two measurements only."""
        return "medium" if self.since_start else confidence


def growth_of(points: list[tuple[int, float]], least: float = 2.0,
              per_batch: float = 1.0) -> Growth | None:
    """The climb ending at the last point (dips of up to 10% allowed), when the last value is
    at least ``least`` times the value the climb started from, over at least two batches, and
    by at least ``per_batch`` per batch on average."""
    if len(points) < 3:
        return None
    start = len(points) - 1
    while start > 0 and points[start - 1][1] <= points[start][1] * 1.1:
        start -= 1
    base = points[start][1]
    # Where the climb left the level it started at (a long flat stretch is no climb).
    while start < len(points) - 2 and points[start + 1][1] <= base * 1.2:
        start += 1
    first, last = points[start], points[-1]
    if last[0] - first[0] < 2 or first[1] <= 0 or last[1] < least * first[1]:
        return None
    growth = Growth(start=first, end=last)
    return growth if growth.per_batch >= per_batch else None


# A module called this many times in one batch, its outputs' abs max growing this much from
# call to call to the overflow: values compounded within the forward (an ODE solver's steps).
_COMPOUNDING_CALLS = 4
_COMPOUNDED_GROWTH = 1e3
# A climb this steep in all is compounding however slowly it went per call: an adaptive
# solver (torchdiffeq's dopri5) takes thousands of small steps through a solution that grows
# past the dtype's largest, each step's calls ~1.03x above the last.
_LONG_CLIMB = 1e6


def _compounded_calls(facts: Facts, module: str) -> tuple[str, int, Growth] | None:
    """The event batch's forward calls of ``module`` in the trace, when its outputs' abs max
    climbed by at least ``_COMPOUNDED_GROWTH`` over at least ``_COMPOUNDING_CALLS`` calls up to
    the overflow: (module, calls, the climb by call). None otherwise (one call, or no climb)."""
    frames = getattr(facts.trace, "frames", None)
    if not module or frames is None or not len(frames):
        return None
    batch = frames[(frames["batch"] == facts.event.batch) & (frames["phase"] == "forward")]
    # A step of a solve or a recurrence holds weights (a field's layers, a cell's); a module
    # without any (an activation one model shares across its layers) is no such loop.
    inside = batch[(batch["module"] == module) | batch["module"].str.startswith(module + ".")]
    if not (role_groups(inside) == "weights").any():
        return None
    mine = batch[(batch["module"] == module) & batch["role"].str.startswith("output")]
    calls = mine.groupby("call").agg(abs_max=("finite_abs_max", "max"), bad=("nan", "any"),
                                     inf=("inf", "any"))
    bad = calls.index[calls["bad"] | calls["inf"]]
    if not len(bad):
        return None
    # The calls before the first one whose outputs held NaN/Inf (the replay goes on after it).
    before = calls[calls.index < bad[0]]["abs_max"].dropna()
    if len(before) < _COMPOUNDING_CALLS:
        return None
    points = [(int(call), float(value)) for call, value in before.items()]
    growth = growth_of(points, least=_COMPOUNDED_GROWTH)
    if growth is None or growth.end[0] - growth.start[0] + 1 < _COMPOUNDING_CALLS:
        return None
    if growth.per_batch < 1.05 and growth.ratio < _LONG_CLIMB:
        return None
    return module, int(bad[0]), growth


def _growth_line(what: str, growth: Growth) -> str:
    if growth.since_start:
        unit = "calls of LBFGS's closure" if growth.in_lbfgs_step else "optimizer steps"
        over = (f"over the {growth.steps} {unit} between: {_g(growth.ratio)}x in all, "
                f"{growth.per_batch:.3g}x {growth.per}" if growth.steps != 1 else
                f"across the one optimizer step between: {_g(growth.ratio)}x")
        return (f"{what} grew from {_g(growth.start[1])} when the watch began to "
                f"{_g(growth.end[1])} at batch {growth.end[0]} {over} "
                "(sentinel mode measured the weights at those two times only: the watch's start "
                "and this event)" + _dated_by_outputs(growth))
    return (f"{what} grew {growth.per_batch:.3g}x {growth.per} from batch {growth.start[0]} "
            f"({_g(growth.start[1])}) to batch {growth.end[0]} ({_g(growth.end[1])}): "
            f"{_g(growth.ratio)}x in all")


def _dated_by_outputs(growth: Growth) -> str:
    """What dates a climb since the watch began too slow on average over all its steps."""
    climb = growth.outputs
    if climb is None:
        return ""
    return (f"; that is too slow on average for a divergence, but the model's outputs then grew "
            f"{climb.per_batch:.3g}x per optimizer step from batch {climb.start[0]} "
            f"({_g(climb.start[1])}) to batch {climb.end[0]} ({_g(climb.end[1])}), and the "
            f"weights' growth, had it come in those {climb.steps} steps alone, would be "
            f"{growth.ratio ** (1.0 / climb.steps):.3g}x per step: the climb came after a slower "
            "stretch (a warmup), as far as the outputs tell")


def _no_history(facts: Facts) -> list[str]:
    """What sentinel mode could not check for lack of recorded batches."""
    if not _recorded_too_few(facts) or facts.event.batch == 0:
        return []  # as much as full mode would have had (at batch 0: no batch before it)
    recorded = len([b for b, _ in facts.weights.series if b <= facts.event.batch])
    if facts.sample_every:
        return [f"Sentinel mode (sample_every={facts.sample_every}) had measured the weights of "
                f"only {recorded} batch{'' if recorded == 1 else 'es'} up to batch "
                f"{facts.event.batch}, too few to check whether they grew over the batches before "
                "(a divergence); a smaller sample_every keeps more of that history."]
    return ["Sentinel mode records no batch in full without sample_every, so whether the weights "
            "grew over the batches before (a divergence) could not be checked; watch with "
            "sample_every=N to keep that history."]


# Weights that diverge grow fast before the NaN (at the learning rates that blow up, orders of
# magnitude per batch); healthy training moves them from their initialisation by a few percent
# per batch, which over many batches also adds up to 2x: no divergence.
_DIVERGING_PER_BATCH = 1.1
_JUMP = 100.0  # one optimizer step that multiplies the weights' abs max by this: diverged
# A climb whose every batch adds at least twice this (and twice the weights' scale where it began)
# to the weights' summed abs max diverged, even by steps that do not grow (see _multiplies).
_ADDED_FLOOR = 1.0


def _weights_growth(facts: Facts) -> Growth | None:
    """The weights' climb before the event (see :func:`_weights_climb`), marked as made by
    LBFGS's iterations when every batch of it was a call of its closure inside the step still
    in progress."""
    grew = _weights_climb(facts)
    lbfgs = facts.lbfgs
    if grew is not None and lbfgs is not None and not grew.in_lbfgs_step \
            and grew.start[0] >= lbfgs["first_batch"]:
        return replace(grew, in_lbfgs_step=True)
    return grew


def _divergence_evidence(facts: Facts, grew: Growth) -> list[str]:
    """The climb's line, and what the batches were when LBFGS's iterations made it."""
    lines = [_growth_line("The weights' abs max (summed over modules)", grew) + "."]
    lbfgs = facts.lbfgs
    if grew.in_lbfgs_step and lbfgs is not None:
        search = (f"with line_search_fn={lbfgs['line_search_fn']!r}" if lbfgs["line_search_fn"]
                  else "without a line search: every iteration after the first moved the "
                       f"weights by lr ({_lr(lbfgs['lr'])}) times its direction")
        lines.append(f"Batches {lbfgs['first_batch']} to {facts.event.batch} are calls of "
                     "LBFGS's closure inside one optimizer.step() (no step ended between them): "
                     f"its iterations (max_iter={lbfgs['max_iter']}) made the climb, {search}.")
    return lines


def _divergence_fixes(facts: Facts, grew: Growth, dtype: str) -> list[str]:
    lbfgs = facts.lbfgs
    if lbfgs is not None:  # inside its step (over several steps too: its options, not clipping)
        return fixes.lbfgs(lbfgs["lr"], lbfgs["max_iter"], lbfgs["line_search_fn"], dtype)
    return fixes.divergence(dtype)


def _weights_climb(facts: Facts) -> Growth | None:
    """The weights' climb over the batches before the event, or their jump by
    :data:`_JUMP` or more across one of the last optimizer steps (Adam at a learning rate of
    1e12 moves every weight by about that much at once; a write of the user's is no step)."""
    points = [(b, v) for b, v in facts.weights.series if b <= facts.event.batch]
    grew = growth_of(points, per_batch=_DIVERGING_PER_BATCH)
    if grew is not None and _multiplies(points, grew):
        return grew
    steps = facts.optimizer_steps
    for before, after in list(zip(points, points[1:]))[-3:][::-1]:
        stepped = steps.get(after[0], 0) > steps.get(before[0], math.inf)
        if stepped and before[1] > 0 and math.isfinite(after[1]) \
                and after[1] >= _JUMP * before[1]:
            return Growth(start=before, end=after)
    return _growth_by_step(facts) or _growth_since_start(facts)


def _multiplies(points: list[tuple[int, float]], grew: Growth) -> bool:
    """Whether the weights' climb ``grew`` (the end of ``points``) is a divergence's rather
    than healthy training's at a high learning rate. A divergence feeds on itself: each step
    adds in proportion to where the weights stand, so the steps grow as the weights do (here:
    at least half as fast, in orders of magnitude, by Theil-Sen fits of both), into the event
    (its last rise :data:`_DIVERGING_PER_BATCH` per batch or more). Or its steps are bounded
    but huge, as Adam's at a learning rate of 10: each batch adds at least twice the scale of the
    weights where the climb began (and of :data:`_ADDED_FLOOR`, for a start near zero). Bounded
    steps of healthy training add about the same each batch, and their rate falls as the
    weights grow: a zero-initialised head whose logits sharpen under SGD at lr=2 moved the
    weights from 0.7 to 2.4 in 7 batches (1.19x per batch) by 0.12 to 0.33 a batch; a climb
    that levelled off adds less and less. A climb with fewer than two rises to fit counts."""
    climb = [(b, v) for b, v in points if grew.start[0] <= b <= grew.end[0]]
    (first, base), (last, top) = climb[0], climb[-1]
    if top - base >= 2 * max(base, _ADDED_FLOOR) * (last - first):
        return True  # huge steps (Adam's at a huge learning rate): diverged, however it grew
    (before, was) = climb[-2]
    if top < was * _DIVERGING_PER_BATCH ** (last - before):
        return False  # it levelled off (or dipped) before the event
    # Each rise as a step per batch, at the middle of its batches (a sampled record's entries
    # are several batches apart); a dip (up to 10% within a climb) has no size to fit.
    rises = [((a + b) / 2, math.log((w - v) / (b - a)))
             for (a, v), (b, w) in zip(climb, climb[1:]) if w > v]
    if len(rises) < 2:
        return True
    weights = growth_rate([b for b, _ in climb], [math.log(v) for _, v in climb])
    steps = growth_rate([b for b, _ in rises], [size for _, size in rises])
    return steps >= weights / 2


def _growth_since_start(facts: Facts) -> Growth | None:
    """Sentinel mode, which records too few batches in full to see the climb (none without
    sample_every): its weights' abs max when the watch began against now, at the event, over
    the optimizer steps between (each module as it was then and is now, summed; a climb by
    the same measure as full mode's, at least 2x and :data:`_DIVERGING_PER_BATCH` per step),
    when the root's outputs, read every batch, climbed too, geometrically into the event (see
    :func:`_outputs_climb`: a checkpoint loaded after the watch began moves the weights with no
    climb of the outputs; healthy growth, logits sharpening, slows down). A climb too slow on
    average over all the steps is dated by a steep climb of the outputs (a long warmup before
    it). None otherwise."""
    start, event = facts.weights_at_start, facts.event
    if not start or facts.steps_since_start < 1 or not _recorded_too_few(facts):
        return None
    modules = [module for module in start if module in facts.weights_now]
    before = sum(start[module] for module in modules)
    now = sum(facts.weights_now[module] for module in modules)
    if before <= 0 or now < 2.0 * before:
        return None
    grew = Growth(start=(0, before), end=(event.batch, now), steps=facts.steps_since_start,
                  since_start=True, in_lbfgs_step=facts.calls_since_start)
    # In logs: _JUMP to the power of hundreds of steps is past a float's range.
    if math.isfinite(now) \
            and math.log(now / before) >= facts.steps_since_start * math.log(_JUMP):
        # Each step multiplied them by _JUMP or more (Adam at a learning rate of 1e6 moves
        # every weight by about that much at once): full mode's jump across a step, whatever
        # the outputs did (a LayerNorm before them keeps them bounded).
        return grew
    if facts.steps_since_start < 2:
        return None
    climb = None if grew.in_lbfgs_step else _outputs_climb(facts, least_steps=2, least=2.0)
    if grew.per_batch < _DIVERGING_PER_BATCH:
        # Too slow on average over every step since the watch began: a long healthy stretch
        # (a OneCycleLR warmup over hundreds of steps) before the climb dilutes it. The
        # outputs' steep climb into the event dates it, when the weights' growth put in that
        # climb's steps alone is a divergence's (a steep climb, as when the outputs alone
        # tell it).
        climb = _outputs_climb(facts) if climb is not None else None
        if climb is None or grew.ratio ** (1.0 / climb.steps) < _DIVERGING_PER_BATCH:
            return None
        grew = replace(grew, outputs=climb)
    elif climb is None and not grew.in_lbfgs_step:
        # Two measurements of the weights cannot tell a divergence from healthy growth (a
        # zero-initialised head whose logits sharpen at a high learning rate, then a NaN
        # written): the outputs' climb must be a divergence's too.
        return None
    outputs = [(b, v) for b, v in facts.series("") if b <= event.batch]
    if len(outputs) < 2 or outputs[-1][1] < 2.0 * outputs[0][1] \
            or outputs[-1][1] < max(v for _, v in outputs) / 1.1:
        return None  # the outputs did not climb into the event
    return grew


# The root's outputs, read every batch, in a climb that tells a divergence when the weights
# cannot: steep, over at least this many optimizer steps, at least this much in all, and
# geometric to the end (healthy growth, logits sharpening, slows down as it goes).
_OUTPUTS_CLIMB_STEPS = 3
_OUTPUTS_CLIMB_LEAST = 10.0


def _outputs_climb(facts: Facts, least_steps: int = _OUTPUTS_CLIMB_STEPS,
                   least: float = _OUTPUTS_CLIMB_LEAST) -> Growth | None:
    """Sentinel mode, which records no weights per batch: the root's outputs' abs max over
    the batches before the event (read every batch) in a climb into it, counted by optimizer
    step: from at least ``least_steps`` batches back to the last batch before the event, at
    least :data:`_DIVERGING_PER_BATCH` per step and ``least`` times in all (a lower bar where
    the weights were measured too), not slowing down (its second half at least
    :data:`_DIVERGING_PER_BATCH` per step and half its first half's rate, in orders of
    magnitude), with an optimizer step between each two held batches of it and the event, and
    as many steps since the watch began as batches from its start to the event. None
    otherwise."""
    event = facts.event
    if not facts.sentinel or event.is_backward or not _recorded_too_few(facts):
        return None
    before = [b for b in facts.history_batches if b < event.batch]
    points = [(b, v) for b, v in facts.series("") if b < event.batch]
    if not points or points[-1][0] != max(before):
        return None  # the batch before the event had no finite outputs: no climb into it
    grew = growth_of(points, least=least, per_batch=_DIVERGING_PER_BATCH)
    if grew is None:
        return None
    climb = [(b, v) for b, v in points if b >= grew.start[0]]
    if len(climb) <= least_steps or climb[0][1] <= 0:
        return None
    mid = len(climb) // 2
    first = math.log(climb[mid][1] / climb[0][1]) / (climb[mid][0] - climb[0][0])
    second = math.log(climb[-1][1] / climb[mid][1]) / (climb[-1][0] - climb[mid][0])
    if second < max(math.log(_DIVERGING_PER_BATCH), first / 2):
        return None  # it slowed down: no divergence, which climbs as fast or faster
    steps = facts.optimizer_steps
    held = sorted(b for b in steps if grew.start[0] <= b <= event.batch)
    if any(steps[b] <= steps[a] for a, b in zip(held, held[1:])) \
            or facts.steps_since_start < event.batch - grew.start[0]:
        return None  # no step between the batches: the outputs climbed for another reason
    return Growth(start=grew.start, end=grew.end, steps=grew.end[0] - grew.start[0])


def _weights_unmeasured_now(facts: Facts) -> bool:
    """Sentinel mode measured the weights when the watch began, and none of them holds a
    finite value now: no climb of theirs can be told."""
    start = facts.weights_at_start
    return bool(start) and not any(module in facts.weights_now for module in start)


def _diverged_by_outputs(facts: Facts, names: list[str], dtype: str,
                         climb: Growth) -> Diagnosis:
    """Every weight non-finite at the event, after the root's outputs climbed geometrically
    over the optimizer steps into it (see :func:`_outputs_climb`): a divergence told from the
    outputs alone."""
    event = facts.event
    kind = _kind_words(event.made_kind)
    one = len(names) == 1
    evidence = [_growth_line("The output abs max of '<root>'", climb) + ", an optimizer step "
                "between the batches, geometric to the end (no slowing down) into the event.",
                "The weights hold no finite value now, and sentinel mode measured them only when "
                "the watch began (it records no batch in full without sample_every): this rests "
                "on the outputs' climb alone, which inputs growing as steeply would make too; "
                "watch with sample_every=N to measure the weights' own climb.",
                f"At batch {event.batch} {', '.join(names)} {'is' if one else 'are'} {kind}."]
    if facts.lbfgs is not None:
        lbfgs = facts.lbfgs
        evidence.insert(2, f"The steps are torch.optim.LBFGS's (lr={_lr(lbfgs.get('lr'))}, "
                           f"max_iter={lbfgs.get('max_iter')}, line_search_fn="
                           f"{lbfgs.get('line_search_fn')!r}).")
    grew = replace(climb, in_lbfgs_step=False)
    return Diagnosis(
        "divergence",
        f"Training diverged, as the model's outputs tell: they grew {climb.per_batch:.3g}x per "
        f"optimizer step from batch {climb.start[0]} to batch {climb.end[0]} "
        f"({_g(climb.ratio)}x in all), until {', '.join(names[:2])} became {kind} (used at batch "
        f"{event.batch}).", evidence, _divergence_fixes(facts, grew, dtype),
        confidence="medium" if climb.ratio >= 1e3 else "low")


def _recorded_too_few(facts: Facts) -> bool:
    """Sentinel mode had measured the weights of fewer batches than full mode's climb needs."""
    recorded = len([b for b, _ in facts.weights.series if b <= facts.event.batch])
    return facts.sentinel and recorded < min(3, facts.event.batch + 1)


def _growth_by_step(facts: Facts) -> Growth | None:
    """The weights' climb counted by optimizer step, where steps are many batches apart (an
    RL loop's 64 rollout forwards between its updates: by batch, the weights look flat, and a
    log_std that Adam drove up 10 per update overflowed as a plain overflow)."""
    by_step = [(steps, b, v) for steps, b, v in facts.weights.by_step if b <= facts.event.batch]
    if len(by_step) < 3 or by_step[-1][1] - by_step[0][1] < 2 * (len(by_step) - 1):
        return None  # about a step per batch (or none): the climb by batch said it all
    # By the steps' own count (a sampled record's entries are several steps apart).
    points = [(steps, v) for steps, _, v in by_step]
    grew = growth_of(points, per_batch=_DIVERGING_PER_BATCH)
    if grew is None or not _multiplies(points, grew):
        return None
    batch_at = {steps: b for steps, b, _ in by_step}
    return Growth(start=(batch_at[grew.start[0]], grew.start[1]),
                  end=(batch_at[grew.end[0]], grew.end[1]), steps=grew.end[0] - grew.start[0])


def _grown_modules(facts: Facts) -> list[str]:
    """Modules whose weights grew most since the watch first measured them."""
    grown = []
    measured = dict(facts.weights.first)
    for module, value in facts.weights_at_start.items():  # sentinel mode's, at the start
        if measured.get(module, (facts.event.batch, 0.0))[0] >= facts.event.batch:
            measured[module] = (-1, value)
    for module, (batch, first) in measured.items():
        now = facts.weights_now.get(module)
        if now is None or first <= 0 or batch >= facts.event.batch:
            continue
        ratio = now / first
        if ratio >= 2:
            grown.append((ratio, module))
    grown.sort(reverse=True)
    return [f"'{module or '<root>'}' {_g(ratio)}x" for ratio, module in grown[:4]]


def _activation_lines(facts: Facts, modules: list[str]) -> list[str]:
    """The recent output abs max of the first of ``modules`` with a history, as evidence."""
    for module in modules:
        points = [(b, v) for b, v in facts.series(module) if b < facts.event.batch]
        if not points:
            continue
        label = module or "<root>"
        growth = growth_of(points + _event_point(facts, module), least=4.0)
        if growth is not None:
            return [_growth_line(f"The output abs max of '{label}'", growth) + "."]
        shown = ", ".join(f"{_g(v)} at batch {b}" for b, v in points[-3:][::-1])
        return [f"Output abs max of '{label}' in the batches before: {shown}."]
    return []


def _event_point(facts: Facts, module: str) -> list[tuple[int, float]]:
    """The event batch's own finite value of ``module``, when the history has one."""
    return [(b, v) for b, v in facts.series(module) if b == facts.event.batch]


# ---------------------------------------------------------------------------- the op
def _no_counted_target(op: OpFacts) -> tuple[str, str] | None:
    """A cross-entropy / NLL mean over a batch in which no target counted: every target is the
    ignore_index (or has class weight 0), so the mean is 0/0. None when that is not the case."""
    if op.name not in _COUNTED_MEAN_LOSSES or not op.nan or len(op.outputs) < 2:
        return None
    weight = op.outputs[1]  # the op's total weight: how many targets counted
    if weight.get("min") != 0 or weight.get("max") != 0:
        return None
    target = op.input_range(1)
    if target is not None and target[0] == target[1]:
        value = int(target[0])
        which = " (the default ignore_index)" if value == -100 else ""
        return (f"every target of the batch is {value}{which}, so no target counted and the mean "
                "over them is 0/0", "high")
    return "no target of the batch counted (ignore_index, or class weights of 0), so the mean " \
        "over them is 0/0", "medium"


def _no_counted_label(facts: Facts, op: OpFacts) -> str | None:
    """transformers' loss under the Trainer: the sum over the counted tokens divided by the
    ``num_items_in_batch`` the Trainer counted beforehand. A batch whose every label is the
    ignore_index makes it 0/0 in transformers' own loss_utils.py, not in the user's code:
    the data is at fault. The reason, or None when that is not the case."""
    if op.phase != "forward" or op.name not in ("div", "true_divide") \
            or not _zero_over_zero(op) or op.input_range(1) != (0.0, 0.0):
        return None
    counts = [i for i in facts.inputs if i.role.endswith("num_items_in_batch")]
    if not counts or any(i.value_range != (0, 0) for i in counts):
        return None
    labels = [i.value_range for i in facts.inputs
              if "label" in i.role.lower() and i.value_range is not None]
    if len(labels) == 1 and labels[0][0] == labels[0][1]:
        value = labels[0][0]
        which = " (the default ignore_index)" if value == -100 else ""
        why = f"every label of the batch is {value}{which}"
    else:
        why = "no label of the batch counted (every one the ignore_index)"
    return (f"{why}, so num_items_in_batch (the count of labels the loss averages over) is 0, "
            "and the loss's sum divided by it is 0/0")


def _no_alignment(op: OpFacts) -> tuple[str, str] | None:
    """CTC's Inf: a sample whose input is too short for its target has no alignment, and its
    loss is -log(0). None when the op is not a CTC loss that made an Inf."""
    if op.name not in _CTC_OPS or not op.inf or op.inputs_hold_inf():
        return None
    lengths = {row["role"].split()[-1]: (row.get("min", math.nan), row.get("max", math.nan))
               for row in op.inputs}
    given, wanted = lengths.get("input_lengths"), lengths.get("target_lengths")
    shown = ""
    sure = "medium"
    if given is not None and wanted is not None and not math.isnan(given[0] + wanted[1]):
        shown = (f" (input lengths {_g(given[0])} to {_g(given[1])}, target lengths "
                 f"{_g(wanted[0])} to {_g(wanted[1])})")
        sure = "high" if given[0] < wanted[1] else "medium"
    return (f"a sample has no alignment: its input is shorter than its target{shown}, counting "
            "a blank between repeated labels, so its loss is -log(0) = inf", sure)


def _unused_gradient(op: OpFacts) -> bool:
    """Whether a NaN made in the backward of an op with an infinite slope (log, sqrt, acos ...
    at the edge of its domain) came from a gradient of 0 meeting that slope: every input
    finite (a division can then only make NaN as 0/0), or a product of an Inf with an input
    holding 0 (0 x inf). A gradient of 0 there means the op's value was multiplied by 0 or
    dropped after it: ``p * torch.log(p)`` with p = 0, or ``torch.where(x > 0, torch.log(x),
    0)``, still passes log's backward a 0 where x is 0."""
    if op.phase != "backward" or not op.nan or op.forward_nan:
        return False  # (the forward made the NaN already, and it was used: no gradient of 0)
    if any(int(row.get("nan_count", 0) or 0) for row in op.inputs):
        return False  # a NaN arrived: not made here
    return any(not int(row.get("inf_count", 0) or 0)
               and row.get("min", math.nan) <= 0 <= row.get("max", math.nan) for row in op.inputs)


def _zero_over_zero(op: OpFacts) -> bool:
    """Whether a division made NaN from finite inputs (only 0/0 does), in the forward or, on
    the forward's numerator and denominator, again in its gradient (a Dice loss over a sample
    whose mask is empty, with no smoothing term)."""
    division = op.name in ("div", "true_divide")
    if op.phase == "backward":  # the forward's 0/0 went on into the loss: not a gradient of 0
        division = division and op.forward_nan and op.grad_of_name in ("div", "true_divide")
    if not division or not op.nan or op.inputs_hold_inf() \
            or any(int(row.get("nan_count", 0) or 0) for row in op.inputs):
        return False
    numerator, denominator = op.input_range(0), op.input_range(1)
    return numerator is not None and denominator is not None \
        and numerator[0] <= 0 <= numerator[1] and denominator[0] <= 0 <= denominator[1]


def _negative_running_var(op: OpFacts) -> dict | None:
    """The running_var input of a normalisation op when it holds a negative value (it was
    written or loaded so: BatchNorm's own updates keep it >= 0), else None."""
    if "norm" not in op.name:
        return None
    return next((row for row in op.inputs if str(row.get("role", "")).endswith("running_var")
                 and row.get("min", 0) < 0), None)


def _running_var(op: OpFacts) -> dict | None:
    return next((row for row in op.inputs if str(row.get("role", "")).endswith("running_var")),
                None)


def _zero_variance(op: OpFacts) -> tuple[str, bool] | None:
    """Why a normalisation made NaN/Inf from finite inputs when it divided by a variance of 0
    with eps=0 (a blank image, a constant channel), and whether that variance was the
    sample's own (not a running_var every sample shares); None when it did not."""
    if op.name not in _NORMALISATIONS or op.phase == "backward" or not (op.nan or op.inf) \
            or op.inputs_hold_inf():
        return None
    # Its saved 1 / sqrt(var + eps) came out Inf: var + eps was 0.
    if any(int(row.get("inf_count", 0) or 0) for row in op.outputs[1:]):
        what = {"native_group_norm": "a group", "native_layer_norm": "a row"}.get(op.name,
                                                                                 "a channel")
        return (f"{what} whose values are all equal (variance 0) normalised with eps=0: "
                "(x - mean) / sqrt(0 + 0) = 0/0"), True
    running = _running_var(op)
    if running is not None and running.get("min", math.nan) == 0:
        return ("its running_var holds 0 and eps=0: (x - mean) / sqrt(0 + 0) divides by 0",
                False)
    return None


def _domain_reason(op: OpFacts) -> tuple[str, str] | None:
    """Why the op's inputs were outside its domain, and how sure (None: they were not)."""
    name = op.name
    special = _no_counted_target(op) or _no_alignment(op)
    if special is not None:
        return special
    if op.nan and op.inputs and op.inputs[0].get("numel") == 0 and op.phase != "backward":
        shape = tuple(op.inputs[0].get("shape") or ())
        return (f"{name} over an empty tensor (shape {shape}): an average of no element is "
                "0/0 (a mask or a filter kept nothing)", "high")
    grad_of = op.grad_of_name
    if op.phase == "backward" and grad_of in _SPECTRAL:
        values = "singular values" if "svd" in grad_of else "eigenvalues"
        return (f"the gradient of {_SPECTRAL[grad_of]} divides by the differences of the "
                f"{values}, and two of them are equal (a repeated value: 1/0 = inf)", "high")
    if op.phase == "backward" and _zero_over_zero(op):
        return ("its numerator and denominator were both 0 in the forward already (0/0, so "
                f"the loss was NaN), and {grad_of}'s gradient divides by the same 0 denominator",
                "high")
    if op.phase == "backward" and grad_of in _DOMAIN_NAMES:
        edge = {"log1p": "-1", "logit": "0 and 1"}.get(
            grad_of, "0" if grad_of in ("sqrt", "rsqrt", "log", "pow", "div") else "±1")
        if _unused_gradient(op):
            return (f"the gradient of {grad_of} is infinite at the edge of its domain ({edge}), "
                    f"and the gradient reaching {grad_of} there was 0: that value of {grad_of} "
                    "was multiplied by 0 or dropped after it (p * log(p) with p = 0, "
                    "torch.where, a mask or a slice, a relu or hinge at 0), and 0 x inf = NaN",
                    "high")
        return f"the gradient of {grad_of} is infinite at the edge of its domain ({edge})", "high"
    variance = _negative_running_var(op)
    if variance is not None:
        return (f"its running_var holds negative values (down to {_g(variance['min'])}): a "
                "variance is never negative, and the square root of one is NaN", "high")
    zero_variance = _zero_variance(op)
    if zero_variance is not None:
        return zero_variance[0], "high"
    first = op.input_range(0)
    if first is None:
        return None
    low, high = first
    if name in _LOG_OPS and low <= 0:
        what = "log(0) = -inf" if low == 0 else "a negative value gives NaN"
        return f"{name} of values down to {_g(low)} ({what})", "high"
    if name in ("xlogy", "special_xlog1py"):
        other = op.input_range(1)
        edge = 0 if name == "xlogy" else -1
        if other is not None and other[0] <= edge:
            what = "log(0) = -inf where x != 0" if other[0] == edge else "a negative value gives NaN"
            arg = "y" if name == "xlogy" else "1 + y"
            return (f"{name}(x, y) with {arg} down to {_g(other[0] - edge)} ({what}: a rate or "
                    "probability that reached 0)", "high")
    if name in _LOG_DETERMINANTS and op.phase != "backward" and not op.inputs_hold_inf():
        if op.inf:
            return ("the log-determinant of a singular matrix (determinant 0: log 0 = -inf)",
                    "high")
        if op.nan:
            return ("the log-determinant of a matrix whose determinant is negative (NaN; "
                    "slogdet gives its sign)", "medium")
    if name in ("lgamma", "digamma", "polygamma") and low <= 0 and (op.inf or op.nan):
        return (f"{name} of values down to {_g(low)} (a pole at 0 and at each negative integer: "
                "a count or concentration parameter that reached 0)", "high")
    if name == "log1p" and low <= -1:
        return f"log1p of values down to {_g(low)} (log1p(-1) = -inf)", "high"
    if name == "sqrt" and low < 0:
        return f"sqrt of values down to {_g(low)} (a negative value gives NaN)", "high"
    if name == "rsqrt" and low <= 0:
        return f"rsqrt of values down to {_g(low)} (rsqrt(0) = inf)", "high"
    if name in _INVERSE_TRIG and (low < -1 or high > 1):
        return (f"{name} of values from {_g_edge(low)} to {_g_edge(high)} (outside [-1, 1] "
                "gives NaN)", "high")
    if name == "atanh" and (low <= -1 or high >= 1):
        return (f"atanh of values from {_g_edge(low)} to {_g_edge(high)} (at ±1 inf, beyond "
                "NaN)", "high")
    if name == "acosh" and low < 1:
        return f"acosh of values down to {_g_edge(low)} (below 1 gives NaN)", "high"
    if name == "erfinv" and (low <= -1 or high >= 1):
        return f"{name} of values from {_g(low)} to {_g(high)}, outside its domain", "high"
    if name == "logit" and (low <= 0 or high >= 1) and (op.inf or op.nan):
        # logit(0) = -inf and logit(1) = inf are no overflow: its domain is the open (0, 1)
        return (f"logit of values from {_g_edge(low)} to {_g_edge(high)} (logit(0) = -inf, "
                "logit(1) = inf, outside [0, 1] NaN)", "high")
    if name in _DIVISIONS or name == "reciprocal":
        denominator = op.input_range(1 if name != "reciprocal" else 0)
        if denominator is not None and denominator[0] <= 0 <= denominator[1]:
            zero = "0/0 = NaN" if op.nan and low <= 0 <= high else "x/0 = inf"
            where = " in the backward pass (a gradient)" if op.phase == "backward" else ""
            certain = "high" if 0 in denominator else "medium"
            return (f"a division by zero{where}: the denominator ranges from "
                    f"{_g(denominator[0])} to {_g(denominator[1])} ({zero})", certain)
    if name in _WEIGHT_NORMS and op.nan and not op.inputs_hold_inf():
        return ("weight normalisation divides v by its norm, and a slice of v is all zeros "
                "(norm 0: 0/0 = NaN)", "high")
    if name == "pow" and op.nan and low < 0:
        return f"pow of a negative base (down to {_g(low)}) with a fractional exponent", "high"
    if (name == "pow" and op.inf and low <= 0 <= high and not op.inputs_hold_inf()
            and max(-low, high) < op.limit ** 0.25):  # a large base overflows instead
        return "pow of 0 with a negative exponent", "medium"
    if name in _VARIANCES and op.nan and not op.inputs_hold_inf():
        return f"{name} over a single element (it divides by n - 1 = 0)", "high"
    return None


# What a density model's line of code says about the value an op got (its names): a predicted
# log-scale before exp, a logit transform of data in [0, 1], a spline's bins and derivatives.
_LOG_SCALE = re.compile(r"log_?(?:s|scale|std|sd|sigma|var)\b|logvar|\bexp\(\s*-?\s*s\b"
                        r"|(?<![\w.])-?s\.exp\(")
# log(x) - log(1 - x) on one line (a log1p(-p) alone is a log(1 - p), not a logit); a
# variable named logits is none, nor is a cross-entropy's sum y * log(p) + (1 - y) * log(1 - p).
_LOGIT_TRANSFORM = re.compile(
    r"\blogit\b|\blog\((?!\s*1\s*-)[^()]*\)\s*-\s*(?:torch\.)?(?:log1p\(\s*-|log\(\s*1\s*-)"
    r"|(?:log1p\(\s*-|log\(\s*1\s*-)[^()]*\)\s*-\s*(?:torch\.)?log\((?!\s*1\s*-)")
_SPLINE = re.compile(r"spline|derivative|bin_?width|bin_?height", re.IGNORECASE)
# A log of probabilities made by hand: log(softmax(x)), log(sigmoid(x)), a binary
# cross-entropy's log(1 - p); the fused forms on the logits are the fix.
_LOG_OF_PROBABILITIES = re.compile(r"(?:softmax|sigmoid)\s*\(|\blog\(\s*1\s*-|log1p\(\s*-")
# An exp whose result is divided by its own sum, on its line or the next (a softmax by hand:
# e = torch.exp(s); p = e / e.sum(-1, keepdim=True)): subtracting the max is the fix.
_DIVIDED_BY_SUM = re.compile(r"/\s*\(?\s*(?:torch\.sum\(|[\w.\[\]]+\.sum\()")


def _density_hint(op: OpFacts) -> str:
    """"log-scale", "logit" or "spline" when the op's line of code reads like one (""
    otherwise): the fixes a density model's author knows for it come first."""
    _, text = source_text(op.source) or (0, "")
    name = op.name
    if name in _EXP_OPS and _divided_by_sum(op, text):
        return "softmax"
    if name in _EXP_OPS and _LOG_SCALE.search(text):
        return "log-scale"
    if name == "logit" or (name in _LOG_OPS + ("log1p",) and _LOGIT_TRANSFORM.search(text)):
        return "logit"
    if name in _LOG_OPS + _DIVISIONS + ("reciprocal",) and _SPLINE.search(text):
        return "spline"
    if name in _LOG_OPS and _LOG_OF_PROBABILITIES.search(text):  # (log1p has its own)
        return "probabilities"
    return ""


def _divided_by_sum(op: OpFacts, text: str) -> bool:
    """Whether the exp's line, or the line after it, divides by a sum (a softmax by hand)."""
    if _DIVIDED_BY_SUM.search(text):
        return True
    located = locate_source(op.source) if op.source else None
    return located is not None and bool(
        _DIVIDED_BY_SUM.search(linecache.getline(located[0], located[1] + 1)))


def _masked_on_line(op: OpFacts) -> bool:
    """Whether the op's line selects with a mask (torch.where, masked_fill): where an unused
    gradient met an infinite slope, guarding the argument is the fix; elsewhere (a hinge, a
    product with 0) an eps inside the op is."""
    _, text = source_text(op.source) or (0, "")
    return bool(re.search(r"\bwhere\(|masked_fill|masked_scatter", text))


def _in_log_prob(op: OpFacts) -> bool:
    """Whether the op ran inside a ``torch.distributions`` ``log_prob`` (or ``entropy``,
    ``cdf``) called at its user line: that line names the call, not the op."""
    # (xlogy, lgamma: their own fixes speak of a rate or a count already)
    if op.name not in _LOG_OPS + ("log1p", "sqrt", "rsqrt", "div", "true_divide", "pow",
                                  "reciprocal"):
        return False
    _, text = source_text(op.source) or (0, "")
    return any(call in text for call in (".log_prob(", ".entropy(", ".cdf(", ".icdf("))


def _tiny_denominator(op: OpFacts) -> float | None:
    """The smallest |denominator| of a division that overflowed because of it (a learned
    temperature collapsed towards 0) while its numerators stayed moderate; None otherwise (a
    denominator reaching 0 is a domain error)."""
    if op.name in ("div", "true_divide"):
        denominator, numerator = op.input_range(1), op.input_range(0)
    elif op.name == "reciprocal":
        denominator, numerator = op.input_range(0), (1.0, 1.0)
    else:
        return None
    if denominator is None or numerator is None or denominator[0] <= 0 <= denominator[1]:
        return None
    smallest = min(abs(denominator[0]), abs(denominator[1]))
    largest = max(abs(numerator[0]), abs(numerator[1]))
    limit = op.limit
    if not math.isfinite(limit) or largest >= math.sqrt(limit) or smallest >= 1 \
            or largest < smallest * limit / 2:
        return None
    return smallest


# aten ops that convert values to another dtype (x.to(dtype), x.half(), y.copy_(x) into a
# narrower tensor): an overflow there is the cast itself, not arithmetic inside an op.
_CASTS = ("to_copy", "to", "copy", "to_dtype", "type")


def _cast_reason(op: OpFacts) -> tuple[str, str] | None:
    """A cast to a narrower dtype of values past its largest (NaN in the float8 formats
    without inf, inf in float16 and float8_e5m2)."""
    if op.name not in _CASTS or not any(row.get("dtype", op.dtype) != op.dtype
                                        for row in op.inputs):
        return None
    largest, limit = op.largest_input(), op.limit
    if largest <= limit:
        return None
    became = "NaN" if op.nan else "inf"
    no_inf = f" ({op.dtype} has no inf)" if op.nan and not op.inf else ""
    return (f"the cast of values up to {_g(largest)} passed {op.dtype}'s largest value "
            f"({limit:.5g}): past it a value becomes {became}{no_inf}", "high")


def _overflow_reason(op: OpFacts) -> tuple[str, str] | None:
    limit = op.limit
    if not math.isfinite(limit) or op.inputs_hold_inf():
        return None
    cast = _cast_reason(op)
    if cast is not None:
        return cast
    tiny = _tiny_denominator(op)
    if op.inf and tiny is not None:
        numerator = op.input_range(0) if op.name != "reciprocal" else (1.0, 1.0)
        return (f"its denominator is as small as {_g(tiny)}, and numerators up to "
                f"{_g(max(abs(numerator[0]), abs(numerator[1])))} divided by it pass "
                f"{op.dtype}'s largest value ({limit:.5g})", "high")
    largest = op.largest_input()
    if op.name in _EXP_OPS and largest > math.log(limit):
        learned = _exponentiated_weight(op)
        what = (f"the model's '{learned}', now {_g(largest)}" if learned
                else f"values up to {_g(largest)}")
        return (f"{op.name} of {what}: above {_g(math.log(limit))} it passes "
                f"{op.dtype}'s largest value ({limit:.5g})", "high")
    if op.inf:
        sure = "high" if largest >= math.sqrt(limit) else "medium"
        return f"a result passed {op.dtype}'s largest value ({limit:.5g})", sure
    if op.nan and largest >= math.sqrt(limit):
        return (f"its inputs reached {_g(largest)}, so a square or a sum inside it passed "
                f"{op.dtype}'s largest value ({limit:.5g}) and became NaN", "high")
    return None


def _exponentiated_weight(op: OpFacts) -> str:
    """The qualified name of the parameter or buffer an exp-like op overflowed on directly
    (a learned log-scale: CLIP's logit_scale.exp()), or ""."""
    if op.name not in _EXP_OPS:
        return ""
    found = op.input_weight()
    return found[0] if found is not None and found[1] > math.log(op.limit) else ""


def _learned_scale(op: OpFacts, evidence: list[str], suggestion: list[str]) -> list[str]:
    """``suggestion`` led by the clamp of the learned log-scale ``op`` exponentiated (an
    evidence line added), when it did."""
    learned = _exponentiated_weight(op)
    if not learned:
        return suggestion
    value = op.input_weight()[1]
    evidence.insert(0, f"{op.op} read the model's '{learned}' itself ({_g(value)}): a learned "
                       f"log-scale, whose {op.op} passes {op.dtype}'s largest value once it "
                       f"grows past {_g(math.log(op.limit))}.")
    return fixes.learned_log_scale(learned) + [  # exp of one learned value: no sum to steady
        line for line in suggestion if not line.startswith("Use a stable form")]


def _overflow_beside_mask(op: OpFacts) -> tuple[str, str] | None:
    """An op that got a -inf mask but overflowed on its finite values: a fully masked row
    gives NaN (0/0), never an Inf, and scores of moderate values do not overflow. A run whose
    weights blew up on a padded batch is an overflow (or divergence), not the padding's."""
    limit = op.limit
    if not math.isfinite(limit) or not op.inputs_hold_inf() \
            or op.inputs_fully_masked() is False:
        return None
    # A mask filled with the dtype's lowest value (finfo.min) beside the -inf is no growth.
    largest = max((abs(float(row[key])) for row in op.inputs for key in ("min", "max")
                   if row.get(key, math.nan) == row.get(key, math.nan)
                   and abs(float(row[key])) < limit * 0.99), default=0.0)
    huge = largest >= math.sqrt(limit)
    if op.inf:
        return (f"a result passed {op.dtype}'s largest value ({limit:.5g}) from inputs up to "
                f"{_g(largest)}: a fully masked row makes NaN, never an Inf",
                "high" if huge else "medium")
    if op.nan and huge:
        return (f"its inputs reached {_g(largest)}, so a product or a sum inside it passed "
                f"{op.dtype}'s largest value ({limit:.5g}) and became NaN (the -inf mask beside "
                "them is not needed to explain it)", "medium")
    return None


def _classify_op(op: OpFacts, earlier: object) -> tuple[str, str, str] | None:
    """(kind, reason, confidence) of the value the op made, or None."""
    name = op.name
    beside_mask = _overflow_beside_mask(op) if masks_rows(name) else None
    if beside_mask is not None:
        return ("overflow", *beside_mask)
    # Only -inf filling whole rows is a mask; a +inf (an overflow before it) is not.
    if masks_rows(name) and op.nan and op.inputs_hold_inf() \
            and op.inputs_fully_masked() is not False:
        return ("masked-row", "a row whose scores were all -inf (fully masked) gives 0/0 = NaN",
                "high")
    domain = _domain_reason(op)
    if domain is not None:
        return ("domain", *domain)
    if op.nan and op.inputs_hold_inf():  # a NaN from an Inf: where did the Inf come from?
        maker = str(earlier["op"]).lstrip("_") if earlier is not None else ""
        if maker in INTENDED_INF_OPS:
            return ("masked-row", f"an Inf written on purpose by {maker} (a -inf mask) met "
                                  f"{name}: a fully masked row gives inf - inf = NaN", "medium")
        if maker in _DOMAIN_NAMES:
            return ("domain", f"an Inf made by {maker} (outside its domain) turned into NaN in "
                              f"{name} (inf - inf or 0 x inf)", "medium")
        if maker:
            return ("overflow", f"an Inf made by {maker} (an overflow) turned into NaN in {name}",
                    "medium")
        return ("domain", f"{name} met an Inf (inf - inf or 0 x inf make NaN)", "medium")
    overflow = _overflow_reason(op)
    if overflow is not None:
        return ("overflow", *overflow)
    return None


def _op_evidence(op: OpFacts) -> list[str]:
    lines = []
    variance = _negative_running_var(op)
    zero_variance = _zero_variance(op)
    if variance is None and zero_variance is not None and not zero_variance[1]:
        variance = _running_var(op)  # a running_var of 0: the number behind it
    shown = op.inputs[:3] + ([variance] if variance is not None and variance not in op.inputs[:3]
                             else [])
    for row in shown:
        low, high = row.get("min", math.nan), row.get("max", math.nan)
        counts = [f"{n} {k}" for n, k in ((row.get("nan_count", 0), "NaN"),
                                           (row.get("inf_count", 0), "Inf")) if n]
        shown = (f"from {_g_edge(low)} to {_g_edge(high)}" if low == low else "no finite value")
        extra = f", {', '.join(counts)}" if counts else ""
        lines.append(f"{op.op} {row['role']} ({row.get('dtype', '')}): {shown}{extra}.")
    for row in op.outputs[:1]:
        counts = [f"{n} {k}" for n, k in ((row.get("nan_count", 0), "NaN"),
                                           (row.get("inf_count", 0), "Inf")) if n]
        numel = row.get("numel", 0)
        lines.append(f"{op.op} {row['role']}: {' and '.join(counts) or 'non-finite'} of "
                     f"{numel} values ({_limit_text(op.dtype)}).")
    if op.grad_of:
        lines.append(f"It ran in the backward of {op.grad_of}.")
    return lines


# ---------------------------------------------------------------------------- the kinds
def _carried(cause: Diagnosis, head: str, how: str, first: list[str] = (),
             last: list[str] = ()) -> Diagnosis:
    """An event whose value an earlier event's cause made (carried on by the loss, a gradient
    accumulation, a buffer a forward wrote): that cause's diagnosis, after ``head`` (the
    summary's start) and ``how`` (the first line of evidence), its fixes between ``first`` and
    ``last``."""
    why = cause.summary[0].lower() + cause.summary[1:] if cause.summary.startswith("The ") \
        else cause.summary
    return Diagnosis(cause.kind, f"{head}: {why}", [how] + list(cause.evidence),
                     list(first) + list(cause.suggestion) + list(last), rows=list(cause.rows),
                     confidence=cause.confidence, op=cause.op)


def _after_forward(facts: Facts) -> Diagnosis | None:
    """A backward event of a batch whose forward already made an event: the NaN/Inf of the
    forward went through the loss into its gradient; the forward's diagnosis says why."""
    event, forward = facts.event, facts.forward_event
    if forward is None or forward.diagnosis is None:
        return None
    return _carried(
        forward.diagnosis,
        f"The gradient of batch {event.batch} is {_kind_words(event.made_kind)} because its forward "
        f"already was (the event at module '{forward.module_label}' ({forward.module_type}), "
        f"{forward.role})",
        f"The forward of batch {event.batch} made an event first; the loss and its gradient "
        f"carried its {_kind_words(forward.made_kind)} into '{event.module_label}' "
        f"({event.module_type}), {event.role}.")


def _carried_state(facts: Facts) -> Diagnosis | None:
    """A forward whose only non-finite inputs are the state the model carried over from its
    previous steps (generate()'s KV cache, a recurrent hidden state), after steps that each
    made an event: the first of them wrote the NaN/Inf into that state, and its diagnosis
    says why; it did not come with the data."""
    event, cause = facts.event, facts.state_from
    if cause is None or cause.diagnosis is None:
        return None
    bad = [i for i in facts.inputs if i.nan or (i.inf and not i.mask)]
    roles = [i.role for i in bad]
    shown = ", ".join(roles[:3]) + (f" (and {len(roles) - 3} more)" if len(roles) > 3 else "")
    rows = sorted({r for i in bad for r in i.rows})
    steps = (f"Batch {cause.batch} made an event" if cause.batch == event.batch - 1
             else f"Each of batches {cause.batch} to {event.batch - 1} made an event, the first")
    found = _carried(
        cause.diagnosis,
        f"The batch's {shown} {'holds' if len(roles) == 1 else 'hold'} "
        f"{_kind_words(event.made_kind)}{fixes.in_rows(rows, 8)} that the model's own earlier "
        f"steps wrote into the state it carries over (a KV cache, a hidden state), since "
        f"batch {cause.batch}",
        f"{steps} at module '{cause.module_label}' "
        f"({cause.module_type}), {cause.role}, and passed on the state it wrote; batch "
        f"{event.batch}'s other inputs are finite: the NaN/Inf did not come with the data. "
        f"Batch {cause.batch}'s event says why, as below; fix that one.")
    found.rows = rows or found.rows
    return found


def _after_earlier_pass(facts: Facts) -> Diagnosis | None:
    """A backward event whose gradient reached the model's output non-finite, in a batch whose
    earlier backward pass already made an event (a PINN's ``torch.autograd.grad(u, x,
    create_graph=True)``, a gradient penalty's): the loss was made from that pass's result and
    its gradient carried the NaN/Inf on; that pass's diagnosis says why."""
    event, earlier = facts.event, facts.earlier_pass_event
    if earlier is None or earlier.diagnosis is None:
        return None
    return _carried(
        earlier.diagnosis,
        f"The gradient of batch {event.batch} is {_kind_words(event.made_kind)} because an earlier "
        f"backward pass of the batch already was (the event at module '{earlier.module_label}' "
        f"({earlier.module_type}), {earlier.role})",
        f"An earlier backward pass of batch {event.batch} (torch.autograd.grad with "
        f"create_graph=True: derivatives for the loss, a gradient penalty) made an event first; "
        f"the loss was made from its result, and its gradient carried the "
        f"{_kind_words(earlier.made_kind)} into '{event.module_label}' ({event.module_type}), "
        f"{event.role}.")


def _accumulated_gradient(facts: Facts) -> Diagnosis | None:
    """A backward event at a parameter whose ``.grad`` an earlier pass left non-finite and this
    pass only added to (gradient accumulation, no zero_grad() between): that pass's diagnosis
    says why; this one says where the value came from."""
    event, cause_event = facts.event, facts.accumulated_from
    if cause_event is None or cause_event.diagnosis is None:
        return None
    name = event.qualified_role
    return _carried(
        cause_event.diagnosis,
        f"The gradient of '{name}' in batch {event.batch} is {_kind_words(event.made_kind)} because "
        f"batch {cause_event.batch}'s backward left it so and the passes since only added to it "
        "(no zero_grad() between them: gradient accumulation)",
        f"'{name}'.grad is the tensor batch {cause_event.batch}'s backward made non-finite, only "
        "accumulated into since (zero_grad() replaces or zeroes it).",
        last=["Skip the optimizer step of an accumulation group whose gradients hold NaN/Inf "
              "(w.check_grad_norms() before optimizer.step(), then optimizer.zero_grad()), so "
              "one bad micro-batch does not reach the weights."])


def _from_another_rank(facts: Facts) -> Diagnosis | None:
    """A parameter's gradient that DDP's all-reduce made non-finite: this rank's own pass kept
    every module's gradient finite, so another rank's was not."""
    if not facts.from_another_rank:
        return None
    event = facts.event
    name = event.qualified_role
    return Diagnosis(
        "unknown",
        f"The gradient of '{name}' is {_kind_words(event.made_kind)} only after DDP averaged it over "
        f"the ranks: rank {event.rank}'s own gradients in batch {event.batch} stayed finite, so "
        "another rank's held it, and that rank's diagnosis says why.",
        [f"Every module gradient (grad_output, grad_input) of rank {event.rank}'s backward pass "
         f"in batch {event.batch} was finite; '{name}'.grad was written again after its own "
         "gradient had been measured (DDP's all-reduce)."],
        ["Read the other ranks' events: nw.load_run(log_dir).events (watch with log_dir=...) or "
         "each rank's w.report(); with on_nan='raise' every rank stops at the batch in which any "
         "rank found a NaN/Inf, and the finder's event is first."],
        confidence="medium")


# A value within this factor of its dtype's largest has about 4 doublings of room left.
_NEAR_LIMIT = 16.0


def _skipped_words(run: object) -> str:
    """The skipped steps of a GradScaler's patience event, in one sentence's words."""
    batches = (f"batch {run.first_batch}" if run.first_batch == run.last_batch
               else f"batches {run.first_batch}–{run.last_batch}")
    return (f"the {run.scaler} skipped {run.skipped} steps in a row ({batches}), lowering its "
            f"scale from {run.scale_first:.10g} to {run.scale_now:.10g}")


def _scaled_gradient(facts: Facts) -> Diagnosis | None:
    """The event of a GradScaler's ``scaler_patience``-th skipped step in a row with a
    non-finite gradient: the float16 gradients overflowed at every scale the scaler tried.
    With NaN as well, or NaN alone (an overflowed gradient that met 0 or another Inf further
    on), less sure; a NaN that an op outside its domain made is left to the other rules."""
    event, run, op = facts.event, facts.scaler_run, facts.op
    if run is None or (op is not None and op.in_loss):
        return None
    if "inf" not in event.made_kind and op is not None and _domain_reason(op) is not None:
        return None
    came = [name for kind, name in getattr(facts.trace, "came_with", None) or []
            if kind == "output-grad"]
    at_output = bool(facts.output_grad_bad or came) and op is None
    dtype = _event_dtype(event)
    limit = dtype_max(dtype)
    label = f"'{event.module_label}' ({event.module_type}), {event.role}"
    if at_output:
        what = f"the gradient reaching the model's output ({label})"
    elif event.role.startswith("grad_"):
        what = f"the gradient at {label}"
    else:
        what = f"the gradient of '{event.qualified_role}'"
    tried = run.scale_last
    kind = _kind_words(event.made_kind)
    still = (f"{op.op} {op.place}{op.at} still made {kind}" if op is not None
             else f"{what} was still {kind}")
    # With NaN as well, the event's gradient may be one the Inf spread to, not where it was born.
    sure_of_place = op is not None or event.made_kind == "inf"
    what_happened = (f"the gradients overflow {dtype} even at loss scale {tried:g}: "
                     f"{_skipped_words(run)}, and {still} at {tried:g} (batch {run.last_batch}).")
    evidence = []
    if run.scale_at_watch not in (None, run.scale_first):
        evidence.append(f"The scale was {run.scale_at_watch:.10g} when the watch began.")
    whose = ("the loss's gradient with respect to the model's output" if at_output
             else what if sure_of_place else "a gradient of the backward pass")
    evidence.append(f"At scale {tried:g} a {dtype} gradient overflows ({_limit_text(dtype)}) "
                    f"where its unscaled value passes {limit:.5g} / {tried:g} = "
                    f"{_g(limit / tried)}: {whose} is that large"
                    + (" even unscaled." if tried <= 1 else "."))
    if op is not None:
        evidence.extend(_op_evidence(op))
    if run.loss is not None:
        evidence.append(f"The loss was finite ({_g(run.loss)}), so no NaN/Inf came from the "
                        "loss itself.")
    near = ""
    points = [(b, v) for b, v in facts.series("") if b <= event.batch]
    if points:
        batch, largest = points[-1]
        evidence.append(f"The model's output reached abs max {_g(largest)} at batch {batch} "
                        f"({_limit_text(dtype)}).")
        if largest * _NEAR_LIMIT >= limit:
            near = f"abs max {_g(largest)} of {limit:.5g}"
    if run.steps_before:
        evidence.append(f"The scaler took {run.steps_before} step"
                        f"{'' if run.steps_before == 1 else 's'} since the watch began, before "
                        f"these skips (the gradients fit {dtype} then): they grew since.")
    else:
        evidence.append("The scaler took no step since the watch began: the gradients never "
                        f"fit {dtype} at the scales it tried.")
    if event.made_kind != "inf":
        evidence.append(f"It holds NaN{' too' if 'inf' in event.made_kind else ''}: an Inf that met "
                        "0 or another Inf further on in the "
                        "backward pass (inf x 0, inf - inf) makes NaN, but so does an op outside "
                        "its domain, which no scale helps; backward=True shows the first "
                        "non-finite gradient.")
    if at_output and op is None:
        evidence.append("An Inf at every scale can also be the loss's own gradient (sqrt or "
                        "log at 0): a watch with loss_fn=... checks the loss's ops.")
    suggestion = fixes.scaled_gradient_overflow(
        batch=event.batch, scale=tried,
        module=op.module if op is not None else event.module if sure_of_place else "",
        at_output=at_output, output_near_limit=near, stepped_before=bool(run.steps_before),
        op_known=op is not None, loss_scale_optimizer=run.scaler if run.scales_own_loss else "")
    grew = _weights_growth(facts)
    if grew is not None:
        evidence.insert(0, _growth_line("The weights' abs max (summed over modules)", grew) + ".")
        return Diagnosis("divergence", f"Training diverged: the weights grew "
                                       f"{grew.told}, until {what_happened}", evidence,
                         fixes.divergence(dtype) + suggestion[:1], confidence=grew.sure("high"))
    confidence = ("low" if event.made_kind != "inf" else
                  "high" if op is not None or not at_output else "medium")
    return Diagnosis("overflow", what_happened[0].upper() + what_happened[1:], evidence,
                     suggestion, confidence=confidence)


def _event_dtype(event: NanEvent) -> str:
    """The dtype of the event's own tensor, or float16 when the event's frames ran in it (a
    parameter's float32 gradient accumulates what autocast computed in float16)."""
    dtype = _weight_dtype(event)
    if dtype not in ("float16", "bfloat16") and event.ran_in("float16"):
        return "float16"
    frames = event.frames
    return dtype or ("float16" if frames is None or frames.empty else dtype)


def _loss(facts: Facts) -> Diagnosis | None:
    event, op = facts.event, facts.op
    if not event.is_backward:
        return None
    came = [name for kind, name in getattr(facts.trace, "came_with", None) or []
            if kind == "output-grad"]
    in_loss = op is not None and op.in_loss
    if not in_loss and not facts.output_grad_bad and not came:
        return None
    if op is not None and not in_loss:
        # The replay found the op of the model that made it from finite values: whatever
        # the output's gradient held (an output used inside the model too, such as a KV
        # cache, receives the NaN made inside), the loss did not make it.
        return None
    evidence = []
    rows: list[int] = []
    reader = None if in_loss else _read_in_loss(facts)
    # A loss op that read none of the model's output: the targets made it (a box encoding's
    # log of a zero target width), and fixes for a log of probabilities would not help.
    from_targets = bool(in_loss and op and op.phase == "loss" and op.reads_output is False)
    if in_loss:
        assert op is not None
        reason = _domain_reason(op) or _overflow_reason(op)
        why = f": {reason[0]}" if reason is not None else ""
        made = op.op if op.phase == "loss" else \
            f"{op.grad_of_name} and its gradient ({op.op})" if _zero_over_zero(op) else \
            f"{op.grad_of_name}'s gradient ({op.op})"
        rows = _op_rows(facts, op)  # a per-sample loss (CTC's own, any reduction='none')
        if op.inf_read:  # no op made the Inf it met: it came in with a tensor loss_fn reads
            summary = (f"Made in the loss, outside the model: {made} in loss_fn{op.at} received "
                       "an Inf from a tensor loss_fn reads that no op of the replay made (not "
                       "the model's output: it was computed before loss_fn ran) and made NaN of "
                       f"it{_rows_words(rows, facts.batch_size())}{why}; the gradient reached the "
                       "model's output already non-finite.")
        else:
            source = " from what loss_fn reads besides the model's output (targets, weights)" \
                if from_targets else ""
            summary = (f"Made in the loss, outside the model: {made} in loss_fn{op.at} made the "
                       f"first NaN/Inf{_rows_words(rows, facts.batch_size())}{source}{why}; the "
                       "gradient reached the model's output already non-finite.")
            if from_targets:
                evidence.append(f"No value of the model's output flowed into {op.op}: its inputs "
                                "come only from tensors loss_fn got besides it (targets, anchors, "
                                "weights).")
        evidence.extend(_op_evidence(op))
        if op.inf_read:
            evidence.append(f"No op of the model or of loss_fn made that Inf: a tensor {made} "
                            "reads held it already, made before loss_fn ran.")
        if rows:
            evidence.append(_rows_evidence(op, rows, facts.batch_size()))
    elif reader is not None:
        at = f" at {reader['source']}" if reader["source"] else ""
        summary = (f"Made in the loss, outside the model: {reader['op']} in loss_fn{at} received "
                   f"the {_kind_words(event.made_kind)} from a tensor loss_fn reads that no op of the "
                   "replay made (not the model's output): it was computed before loss_fn ran; "
                   "the gradient reached the model's output already non-finite.")
        line, text = source_text(str(reader["source"] or "")) or (0, "")
        if text:
            evidence.append(f"Line {line}: {text}")
        evidence.append(f"The replay ran loss_fn on the model's finite output, and no op of the "
                        f"model or of loss_fn made the {_kind_words(event.made_kind)}: a tensor "
                        f"{reader['op']} reads held {_held_words(reader)} already, made before "
                        "loss_fn ran.")
    else:
        summary = (f"Made in the loss, outside the model: the gradient reaching the model's "
                   f"output{' (' + ', '.join(came) + ')' if came else ''} in batch {event.batch} "
                   "was already non-finite, and no op of the model made it.")
    evidence.append(f"The first non-finite gradient is the one '{event.module_label}' "
                    f"({event.module_type}) received, {event.role}; the forward outputs of "
                    f"batch {event.batch} were finite.")
    if reader is not None:
        found = Diagnosis("loss", summary, evidence,
                          fixes.loss_input(str(reader["op"]), f" at {reader['source']}"
                                           if reader["source"] else "", _held_words(reader)),
                          confidence="high")
        found.op = f"{reader['op']} at {reader['source']}" if reader["source"] else ""
        return found
    if in_loss and op is not None and op.inf_read:
        return Diagnosis("loss", summary, evidence,
                         fixes.loss_input(op.op if op.phase == "loss" else op.grad_of_name,
                                          op.at, "an Inf"),
                         rows=_samples_at_fault(rows, facts.batch_size()), confidence="high")
    _, line = (source_text(op.source) or (0, "")) if in_loss and op else (0, "")
    # Box regression targets: a log of target widths or heights over the anchors' (a box
    # coder), in a detection library's code or the user's.
    boxes = from_targets and op is not None and (
        any(word in line.lower() for word in ("width", "height", "box"))
        or any(word in op.source.lower() for word in ("box", "detection")))
    suggestion = fixes.loss(event.batch, (op.op if op.phase == "loss" else op.grad_of_name)
                            if in_loss and op else "", traced=in_loss,
                            at=op.at if in_loss and op else "",
                            has_loss_fn=facts.has_loss_fn,
                            zero_over_zero=bool(in_loss and op and _zero_over_zero(op)),
                            snr="snr" in line.lower(), from_targets=from_targets,
                            boxes=boxes)
    if in_loss and op is not None and op.phase == "loss" and not from_targets \
            and _in_log_prob(op):  # the distribution the model returned: its parameter
        suggestion = fixes.distribution_parameter(op.at) + suggestion
    return Diagnosis("loss", summary, evidence, suggestion,
                     rows=_samples_at_fault(rows, facts.batch_size()), confidence="high")


def _loss_value(facts: Facts) -> Diagnosis | None:
    """A non-finite loss computed outside the model from its finite outputs, with no op to
    name (the loss a GradScaler scales, the one a training callback checks, or one given to
    ``NanWatch.explain_loss``): ``divergence`` when the weights climbed over the batches before
    (the optimizer drove the outputs up until the loss of them overflowed, as an MSE's square
    does first), else ``loss``. With the op of a replay that ran ``loss_fn``, the op rules
    tell it."""
    event = facts.event
    if event.is_backward or event.origin != "output" or event.role != LOSS_ROLE \
            or facts.op is not None:
        return None
    what = "inf" if event.made_kind == "inf" else "NaN" if event.made_kind == "nan" else "NaN/Inf"
    outputs = [(b, v) for b, v in facts.series(event.module) if b <= event.batch]
    at_event = next((v for b, v in reversed(outputs) if b == event.batch), None)
    evidence = [f"The loss of batch {event.batch} was {what}, while the model's outputs it was "
                "computed from were finite"
                + (f" (abs max {_g(at_event)})" if at_event is not None else "")
                + ": the loss made it, outside the model."]
    if event.made_kind == "inf" and at_event is not None and at_event > 1e4:
        evidence.append("A loss that squares the outputs (MSE) or exponentiates them passes its "
                        "dtype's largest value long before they do: the square of anything "
                        "above 1.84e19 overflows float32 (3.4e38), above 256 float16.")
    told = facts.loss_told
    if told is not None and told.function:
        evidence.append(f"The loss's grad_fn is {told.grad_fn}: torch's {told.function} made "
                        "it" + (", and a factor outside the graph scaled it." if told.scaled
                                else "."))
    if told is not None and told.targets_held is not None:
        evidence.append(f"The targets given held {told.targets_held}"
                        f"{fixes.in_rows(told.target_rows, 8)}." if told.targets_held
                        else "The targets given were finite.")
    grew = _weights_growth(facts)
    # A non-finite target makes the loss non-finite whatever the weights did: it comes first.
    if grew is not None and (told is None or not told.targets_held):
        climb = _divergence_evidence(facts, grew)
        grown = _grown_modules(facts)
        if grown:
            climb.append(f"Grown most since first measured: {', '.join(grown)}.")
        return Diagnosis(
            "divergence",
            f"{grew.diverged}: the weights grew {grew.per_batch:.3g}x {grew.per} {grew.since}, "
            f"until the loss computed from the model's outputs became {what} at batch "
            f"{event.batch} (the outputs themselves were still finite).",
            climb + _activation_lines(facts, [event.module]) + evidence,
            _divergence_fixes(facts, grew, _weight_dtype(event) or "float32"),
            confidence=grew.sure("high"))
    evidence += _activation_lines(facts, [event.module])
    if grew is not None:  # a non-finite target: the loss is non-finite whatever the weights do
        evidence.append(f"The weights also grew {grew.per_batch:.3g}x {grew.per} {grew.since}, "
                        f"but a target holding {told.targets_held if told else ''} makes the "
                        "loss non-finite whatever the outputs are.")
    elif len([b for b, _ in facts.weights.series if b <= event.batch]) >= 3:
        evidence.append("The weights did not climb over the batches before (no divergence): "
                        "what the loss reads besides the outputs (targets, weights, masks) or "
                        "its own ops made it.")
    evidence.extend(_no_history(facts))
    summary = (f"Made in the loss, outside the model: the loss of batch {event.batch} was {what}, "
               "while the model's outputs were finite; no op of the model made it.")
    if told is not None and told.targets_held:
        summary += (f" Its targets held {told.targets_held}"
                    f"{fixes.in_rows(told.target_rows, 8)}.")
    return Diagnosis(
        "loss", summary, evidence,
        fixes.loss(event.batch, "", traced=False, has_loss_fn=facts.has_loss_fn,
                   function=told.function if told else "", family=told.family if told else "",
                   targets_held=told.targets_held if told else None,
                   target_rows=told.target_rows if told else None, made=event.made_kind),
        rows=told.target_rows if told is not None and told.targets_held else [],
        confidence="high" if told is not None and told.targets_held else "medium")


# An input of a loss this close to 0 (not 0 itself: targets and masks hold zeros) makes its
# gradients, 1/x or 1/x**2 and more, pass float32's largest.
_NEAR_ZERO = 1e-6


def _loss_module(facts: Facts) -> Diagnosis | None:
    """A backward event made by a loss the model holds as a submodule and runs on its output
    (``loss = self.loss(self(x), y)`` in a LightningModule): its own frames say where (its
    backward turned a finite gradient non-finite) and what it was given (a distribution's scale
    near 0)."""
    event = facts.event
    if not facts.called_on_output or not event.role.startswith("grad_input") \
            or event.frames is None:
        return None
    frames = event.frames
    mine = frames[(frames["module"] == event.module) & (frames["batch"] == event.batch)]
    received = mine[(mine["frame"] == event.frame) & mine["role"].str.startswith("grad_output")]
    forward = mine[(mine["phase"] == "forward") & (mine["call"] == event.call)]
    given = forward[forward["role"].str.startswith(("input", "kwarg:"))]
    if received.empty or (received["nan"] | received["inf"]).any() \
            or (given["nan"] | given["inf"]).any():
        return None  # it received the NaN/Inf, or was given one: not made by it
    name, module_type = event.module_label, event.module_type
    what = _kind_words(event.made_kind)
    inf = event.made_kind == "inf"
    near = given[(given["abs_min"] > 0) & (given["abs_min"] < _NEAR_ZERO)]
    tiny = near.loc[near["abs_min"].idxmin()] if not near.empty else None
    summary = (f"Made in the loss '{name}' ({module_type}) that the model holds and runs on its "
               f"output after its forward: its backward turned the finite gradient it received "
               f"into {what} ({event.role}) in batch {event.batch}"
               + (", past float32's largest value" if inf else "") + ".")
    if tiny is not None:
        summary += (f" Its {tiny['role']} reached abs min {tiny['abs_min']:.3g}: a value that "
                    "close to 0 (a distribution's scale or variance, a denominator) makes the "
                    "loss's gradient, like 1/x², overflow.")
    first = received.iloc[0]
    evidence = [f"'{name}' received {first['role']} finite (abs max {first['abs_max']:.3g}) and "
                f"gave back {event.role} {what}; what the model gave it was finite."]
    output = forward[forward["role"].str.startswith("output")]
    if tiny is not None and not output.empty:
        evidence.append(f"Its {tiny['role']} ranged over {tiny['abs_min']:.3g} .. "
                        f"{tiny['abs_max']:.3g}; its output, the loss, was "
                        f"{output['abs_max'].max():.3g}.")
    distribution = any(word in module_type.lower() for word in ("distribution", "likelihood")) \
        or module_type in ("GaussianNLLLoss", "PoissonNLLLoss")
    suggestion = fixes.loss_module(name, module_type, event.batch,
                                   tiny_role=tiny["role"] if tiny is not None else "",
                                   tiny=float(tiny["abs_min"]) if tiny is not None else None,
                                   distribution=distribution)
    return Diagnosis("overflow" if inf else "domain", summary, evidence, suggestion,
                     confidence="high" if inf and tiny is not None else "medium")


def _loss_module_output(facts: Facts) -> Diagnosis | None:
    """A forward event made by a loss the model holds as a submodule and runs on its output
    after its forward (``loss = model.loss(model(x), y)``): its output went non-finite from
    finite inputs. A replay reruns the model's forward, not that call, so its own frame says
    what it was given (an exact 0 where it takes a log or divides)."""
    event = facts.event
    if event.is_backward or not facts.called_on_output or event.origin != "output" \
            or facts.op is not None or event.frames is None:
        return None
    frames = event.frames
    mine = frames[(frames["module"] == event.module) & (frames["batch"] == event.batch)
                  & (frames["frame"] == event.frame)]
    given = mine[mine["role"].str.startswith(("input", "kwarg:"))]
    if given.empty or (given["nan"] | given["inf"]).any():
        return None
    name, module_type, what = event.module_label, event.module_type, _kind_words(event.made_kind)
    zero = given[given["abs_min"] == 0]
    near = given[(given["abs_min"] > 0) & (given["abs_min"] < _NEAR_ZERO)]
    summary = (f"Made in the loss '{name}' ({module_type}) that the model holds and runs on its "
               f"output after its forward: its {event.role} became {what} in batch {event.batch} "
               "from finite inputs; the model's output was finite.")
    tiny_role, tiny = "", None
    if not zero.empty:
        tiny_role = str(zero["role"].iloc[0])
        summary += (f" Its {tiny_role} held exact zeros: a log or a division of 0 (a "
                    "probability that underflowed to 0) makes -inf, and 0 times that NaN.")
    elif not near.empty:
        closest = near.loc[near["abs_min"].idxmin()]
        tiny_role, tiny = str(closest["role"]), float(closest["abs_min"])
        summary += (f" Its {tiny_role} reached abs min {tiny:.3g}: a value that close to 0 "
                    "overflows a division or a log's slope.")
    ranges = "; ".join(f"{row['role']} {row['abs_min']:.3g} .. {row['abs_max']:.3g}"
                       for _, row in given.head(4).iterrows())
    evidence = [f"What '{name}' was given was finite (abs ranges: {ranges}); its {event.role} "
                f"was {what}.",
                f"'{name}' ran after the model's forward returned, on its output: a replay of "
                f"batch {event.batch} reruns the forward only, so its op is not traced."]
    suggestion = fixes.loss(event.batch, "", traced=False, given_finite=True)
    if tiny_role:
        suggestion.insert(0, f"Keep {tiny_role} of '{name}' away from 0 where the loss takes its "
                             "log or divides by it: x.clamp_min(eps), or x + eps.")
    suggestion += fixes.loss_module(name, module_type, event.batch, tiny_role="", tiny=None,
                                    distribution=False)
    return Diagnosis("loss", summary, evidence, suggestion, confidence="medium")


def _held_words(reader: Any) -> str:
    """What the tensor an op read from outside the replay held, told by that op's output (an op
    that turned an Inf into NaN would be a birth, not a reader): "a NaN", "an Inf"."""
    nan, inf = bool(reader["nan"]), bool(reader["inf"])
    return "NaN/Inf" if nan == inf else "a NaN" if nan else "an Inf"


def _read_in_loss(facts: Facts) -> Any:
    """The op of ``loss_fn`` (its ops row) where the NaN/Inf entered the replay from a tensor
    no traced op made (loss weights computed before the loss), or None."""
    trace = facts.trace
    reader = _read_from_outside(trace)
    if reader is None or not trace.ran_in_loss(reader):
        return None
    if reader["phase"] == "backward":  # the gradient of a loss op: name the op, as loss_fn ran it
        ops = trace.ops
        ran = ops[(ops["phase"] == "loss") & (ops["source"] == reader["source"])
                  & (ops["op"] == reader["op"])]
        if len(ran):
            return ran.iloc[0]
    return reader


def _bad_data(facts: Facts) -> Diagnosis | None:
    event = facts.event
    if facts.made_outside_forward:  # the model's own part made the inputs: the weight says why
        return None
    came = [name for kind, name in getattr(facts.trace, "came_with", None) or []
            if kind == "input"]
    bad = [i for i in facts.inputs if i.nan]
    if not bad:
        made_by_op = facts.op is not None and not facts.op.in_loss
        # A -inf mask passed in is no bad data: a row it masks everywhere is a masked row.
        inf_inputs = [i for i in facts.inputs if i.inf and not i.mask]
        if inf_inputs and (came or (not made_by_op and event.origin == "input"
                                    and not event.is_backward)):
            bad = [i for i in inf_inputs if not came or i.role in came] or inf_inputs
    if not bad and facts.bad_input_roles and not facts.inputs_held and facts.outside_pass:
        return _bad_data_of_a_part(facts)
    if not bad and facts.bad_input_roles and not facts.inputs_held:
        roles = facts.bad_input_roles
        return Diagnosis(
            "bad-data", f"The batch's {', '.join(roles)} already held NaN/Inf when the model "
                        "got it: it came with the data, not from the model.",
            [f"The root module's {role} in batch {event.batch} holds NaN/Inf." for role in roles],
            fixes.bad_data(roles, []), confidence="medium")
    if not bad:
        return None
    rows = sorted({r for i in bad for r in i.rows})
    roles = [i.role for i in bad]
    # Only -inf, no NaN, no +inf: what a log of 0 gives (a silent frame's log-mel energy).
    log_of_zero = all(not i.nan and i.inf and i.neg_inf == i.inf for i in bad)
    inf_word = "-Inf" if log_of_zero else "Inf"
    what = " and ".join(w for w, n in (("NaN", sum(i.nan for i in bad)),
                                       (inf_word, sum(i.inf for i in bad))) if n)
    if len(bad) == 1 and bad[0].sample_of:  # " in box 1 of sample 0": the image, then the box
        rows_text = f" in {_in_sample(bad[0])}"
    elif bad and all(i.sample_of for i in bad):
        rows_text = " in " + fixes.rows_named(rows, 8).replace("row", "sample")
    else:
        rows_text = fixes.in_rows(rows, 8)
    verb = "holds" if len(roles) == 1 else "hold"
    step = _sampling_step(facts, bad)
    came_from = ("the call's inputs (in a sampling loop: from the step after the previous call)"
                 if step is not None else "the data")
    summary = (f"The batch's {', '.join(roles)} {verb} {what}{rows_text}: it came with "
               f"{came_from}, not from the model.")
    evidence = []
    for item in bad:
        counts = ", ".join(f"{n} {k}" for n, k in ((item.nan, "NaN"), (item.inf, inf_word))
                           if n)
        shard = f", {item.note}" if item.note else ""
        if item.sample_of:
            inside = f" in {_inside_sample(item)} of {item.shape[0]}" \
                if item.within and item.shape else ""
            evidence.append(f"{item.role} ({item.dtype} {item.shape}{shard}): {counts}{inside}; "
                            f"it is sample {item.rows[0] if item.rows else '?'} of the list "
                            f"{item.sample_of}.")
            continue
        if item.packed_samples:
            evidence.append(f"{item.role} ({item.dtype} {item.shape}{shard}, the data of a "
                            f"PackedSequence of {item.packed_samples} samples): {counts}"
                            f"{fixes.in_rows(item.rows, 12).replace(' row', ' sample')}.")
            continue
        where = fixes.in_rows(item.rows, 12)
        along = f" along dim {item.batch_dim}" if item.batch_dim else ""
        evidence.append(f"{item.role} ({item.dtype} {item.shape}{shard}): {counts}{where} of "
                        f"{item.shape[item.batch_dim] if item.shape else 1}{along}.")
    samples = [f"{i.role} ({_in_sample(i)})" for i in bad if i.sample_of and i.rows]
    suggestion = fixes.bad_data(roles, rows, samples if len(samples) == len(bad) else None,
                                log_of_zero=log_of_zero and step is None)
    if step is not None:  # the step between the model's calls made it, not a dataset
        scalar, before = step
        evidence.append(f"The call took {scalar.role} = {_g(scalar.value_range[0])}, one value "
                        f"for the whole batch (a sampler's timestep or noise level), and the "
                        f"model's output at batch {event.batch - 1} was finite (abs max "
                        f"{_g(before)}): in a sampling loop that feeds its result back, the step "
                        "between the two calls made the NaN/Inf.")
        suggestion[:0] = fixes.sampling_step(", ".join(roles), event.batch - 1)
    if not any(i.nan for i in bad) and event.made_kind == "inf":  # NaN counts: allow_inf no help
        suggestion.append("If the Inf is meant (a -inf mask passed in), let its module hold it: "
                          f"nw.watch(model, allow_inf=['{event.module}']).")
    return Diagnosis("bad-data", summary, evidence, suggestion, rows=rows,
                     confidence="high" if facts.inputs_held else "medium")


def _bad_data_of_a_part(facts: Facts) -> Diagnosis:
    """NaN in what a part of the model called outside its forward got (DQN's ``q_net(obs)``,
    the encoder ``generate()`` runs on ``pixel_values``), read from that call's frame: the data,
    or, when other calls ran before it in the batch, possibly the code between those calls."""
    event, roles, part = facts.event, facts.bad_input_roles, facts.outside_pass
    earlier = facts.outside_earlier
    what = ", ".join(roles)
    if earlier == []:
        summary = (f"The {what} that module '{part}' was called with (outside the model's "
                   "forward, the batch's first call) already held NaN: it came with the data, "
                   "not from the model.")
        evidence = [f"The {role} of module '{part}' in batch {event.batch} holds NaN, and no "
                    "module of the model ran before it in the batch." for role in roles]
    else:
        before = (" and ".join(f"'{name}'" for name in earlier[:3]) if earlier
                  else "other modules of the model")
        summary = (f"The {what} that module '{part}' was called with (outside the model's "
                   f"forward) already held NaN: it came from outside the model, with the data "
                   f"or from the code between the call of {before} and this one.")
        evidence = [f"The {role} of module '{part}' in batch {event.batch} holds NaN."
                    for role in roles]
        evidence.append(f"The call{'s' if len(earlier or ()) > 1 else ''} of {before} ran before "
                        "it in the batch with finite outputs: if this input was computed from "
                        "them, the code between the calls made the NaN, not the data.")
    evidence.append(f"Module '{part}' ran outside the model's forward (called directly): its "
                    "inputs are not held, so their rows cannot be named.")
    suggestion = [f"Watch module '{part}' as a model of its own to have the rows named "
                  f"(w.close(), then nw.watch(model.get_submodule('{part}'))): its inputs are "
                  "then held, and its batches can be replayed."] + fixes.bad_data(roles, [])
    return Diagnosis("bad-data", summary, evidence, suggestion,
                     confidence="medium" if earlier == [] else "low")


# The one value a sampler passes per call: positional (UNet(sample, t)) or by a name that says
# so (timestep=, sigma=, t=); not a count such as the Trainer's num_items_in_batch.
_SAMPLER_STEP_ROLE = re.compile(r"input\[[1-9]\d*\]|kwarg:(t|\w*(timestep|sigma|noise_level)\w*)")


def _sampling_step(facts: Facts, bad: list[Any]) -> tuple[Any, float] | None:
    """A call of a sampling loop (a diffusion scheduler's, an ODE solver's) whose input came
    non-finite from the step after the previous call: a one-element input beside it (the
    timestep: a sampler passes one for the whole batch, training one per sample), and the
    root's output of the batch before finite. (that input, the previous output's abs max)."""
    event = facts.event
    if event.is_backward or event.batch < 1 or not facts.inputs_held:
        return None
    scalar = next((i for i in facts.inputs if i not in bad and i.value_range is not None
                   and math.prod(i.shape) == 1 and not i.nan and not i.inf
                   and _SAMPLER_STEP_ROLE.fullmatch(i.role)), None)
    if scalar is None or "" not in facts.history_modules \
            or event.batch - 1 not in facts.history_batches:
        return None
    before = float(facts.history[facts.history_batches.index(event.batch - 1),
                                 facts.history_modules.index("")])
    return (scalar, before) if math.isfinite(before) else None


def _inside_sample(item: Any) -> str:
    """Where in its sample an input that is one entry of a per-sample list holds the NaN/Inf,
    in the words of its data: "box 1" (a target's boxes), "channel 2" (a CHW image),
    "row 1" otherwise."""
    key = item.part.rpartition(".")[2]
    if key.endswith("boxes") and len(item.shape) == 2:
        one, many = "box", "boxes"
    elif not item.part and len(item.shape) == 3:
        one, many = "channel", "channels"
    else:
        one, many = "row", "rows"
    shown = ", ".join(map(str, item.within[:8])) + (" ..." if len(item.within) > 8 else "")
    return f"{one if len(item.within) == 1 else many} {shown}"


def _in_sample(item: Any) -> str:
    """"box 1 of sample 0" / "sample 0": the sample, and where in it when it can be told."""
    sample = f"sample {item.rows[0]}" if item.rows else "a sample"
    return f"{_inside_sample(item)} of {sample}" if item.within else sample


def _weights(facts: Facts) -> Diagnosis | None:
    event = facts.event
    came = [name for kind, name in getattr(facts.trace, "came_with", None) or []
            if kind == "weight" and not (facts.is_mask is not None and facts.is_mask(name))]
    if event.origin != "weight" and not came:
        return None
    names = came or weight_names(event, facts.is_mask)
    dtype = _weight_dtype(event)
    if names and all(n in facts.substituted for n in names):
        return _substituted(facts, names)
    if names and all(n in facts.replaced_modules for n in names):
        return _in_added_module(facts, names, dtype)
    if names and all(n in facts.loaded for n in names):
        return _loaded(facts, names, dtype)
    if names and all(n in facts.nonfinite_lr for n in names):
        return _stepped_with_nonfinite_lr(facts, names, dtype)
    if names and all(facts.written_outside_step.get(n) in ("SAM", "SAM step") for n in names):
        return _written_by_sam_first_step(facts, names, dtype)
    if names and all(n in facts.wrapper_state_nonfinite for n in names):
        return _wrapper_state_nonfinite(facts, names, dtype)
    grew = _weights_growth(facts)
    if grew is not None:
        evidence = _divergence_evidence(facts, grew)
        modules = _grown_modules(facts)
        if modules:
            evidence.append(f"Grown most since first measured: {', '.join(modules)}.")
        evidence.extend(_activation_lines(facts, [event.module, ""]))
        evidence.append(f"At batch {event.batch} {', '.join(names)} "
                        f"{'is' if len(names) == 1 else 'are'} {_kind_words(event.made_kind)}.")
        return Diagnosis(
            "divergence",
            f"{grew.diverged}: the weights grew {grew.told} "
            f"until {', '.join(names[:2])} became {_kind_words(event.made_kind)} "
            f"(used at batch {event.batch}).", evidence, _divergence_fixes(facts, grew, dtype),
            confidence=grew.sure("high"))
    if names and _weights_unmeasured_now(facts) and not any(
            n in facts.weights_replaced or n in facts.not_stepped or _buffer(facts, n)
            for n in names):
        climb = _outputs_climb(facts)
        if climb is not None:
            return _diverged_by_outputs(facts, names, dtype, climb)
    lbfgs = facts.lbfgs
    if lbfgs is not None and names and all(
            not _buffer(facts, n) and facts.weights_last_finite.get(n, -1) >= lbfgs["first_batch"]
            for n in names):
        return _lbfgs_outputs_climbed(facts, names, dtype) \
            or _written_inside_lbfgs_step(facts, names, dtype)
    largest_input = _inputs_largest(facts)
    # A forward whose inputs were finite and small (their squares too) updates a finite buffer
    # into a finite one: a non-finite one was so before it ran.
    tame = largest_input is not None and largest_input < math.sqrt(dtype_max(dtype or "float32"))
    if facts.poisoned_by is not None:
        return _poisoned_by_earlier_forward(facts, names)
    if names and all(n in facts.written_in_forward for n in names) \
            and not any(facts.weights_written.get(n) for n in names) and not tame:
        jump = _jump_into_batch(facts)
        if jump is not None:  # the step before the batch blew up the weights that fed it
            return _diverged_into_buffer(facts, names, dtype, jump, largest_input)
        return _written_by_forward(facts, names, dtype, largest_input)
    if names and (all(n in facts.finite_earlier_in_batch for n in names)
                  or all(n in facts.written_between_forwards for n in names)):
        return _written_within_batch(facts, names, dtype)
    last = [facts.weights_last_finite[n] for n in names if n in facts.weights_last_finite]
    batch = max(last) if last else None
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    verb = "holds" if len(names) == 1 else "hold"
    evidence = [f"{shown} {verb} {_kind_words(event.made_kind)} at batch {event.batch}"
                + (f" ({dtype})." if dtype else ".")]
    evidence.extend(_slices_lines(facts, names))
    before_watch = False  # non-finite already when the watch began
    likely = False  # the last finite batch known from its outputs alone (sentinel mode)
    # No optimizer step wrote them (buffers, an EMA copy's parameters, no step at all): a write,
    # average or load.
    unstepped = bool(names) and all(n in facts.not_stepped or _buffer(facts, n) for n in names)
    no_step = unstepped and any(facts.not_stepped.get(n) == "no step" for n in names)
    # Another tensor in their slots (a load with assign=True): no write in place made them.
    replaced = bool(names) and all(n in facts.weights_replaced for n in names)
    made_by = "the write, average or load" if unstepped else "the optimizer step, load or write"
    if replaced:
        made_by = f"the load or assignment that replaced {'it' if len(names) == 1 else 'them'}"
    idle: list[int] = []
    if batch is not None:
        one = len(names) == 1
        likely = all(n in facts.finite_by_outputs for n in names
                     if facts.weights_last_finite.get(n) == batch)
        if likely:
            evidence.append(f"Batch {batch}'s outputs were finite and "
                            f"{'it was' if one else 'they were'} written after it (sentinel mode "
                            f"measures no weights): {made_by} after batch "
                            f"{batch} likely made {'it' if one else 'them'} non-finite, unless "
                            f"batch {batch} did not read the bad values (an embedding row or an "
                            "expert it did not use).")
        else:
            evidence.append(f"{'It was' if one else 'They were'} finite when batch {batch} "
                            f"ran: {made_by} after batch {batch} made "
                            f"{'it' if one else 'them'} non-finite.")
        if unstepped:
            evidence.append(_not_stepped_line(facts, names))
        swapped = [n for n in names if n in facts.weights_replaced]
        if swapped:
            evidence.append(f"{swapped[0]} is another tensor than the one batch {batch} ran with: "
                            "it was replaced, not written in place (a load_state_dict(..., "
                            "assign=True), module.weight = nn.Parameter(...)).")
        written = [n for n in names if facts.weights_written.get(n) and n not in swapped]
        if written:
            how = ("copy_, lerp_, an EMA or AveragedModel update, load_state_dict" if unstepped
                   else "optimizer.step() or copy_")
            evidence.append(f"The version counter of {written[0]} moved after batch {batch} "
                            f"(an in-place write: {how}).")
        # Batches in between in which its module did not run (an idle expert) date nothing.
        idle = [b for b in facts.idle_batches if batch < b < event.batch]
        # A batch that ran in between used it first (on_nan="record": an event every batch).
        first = min([b for b in facts.history_batches if batch < b < event.batch
                     and b not in facts.idle_batches], default=event.batch)
        used = (f"batch {first} is the first to use it." if first == event.batch else
                f"batch {first} was the first to use it, and batch {event.batch} still does.")
        if likely:  # sentinel mode, an embedding or experts: not measured, only inferred
            if first != event.batch:  # which batches read it is not measured either
                used = (f"batch {event.batch} is the first whose outputs it made "
                        f"{_kind_words(event.made_kind)} (the batches between had finite outputs: "
                        "they may not have read it).")
            summary = (f"{shown} {verb} {_kind_words(event.made_kind)} at batch {event.batch}, likely "
                       f"since {made_by} after batch {batch} (or an "
                       f"earlier one, if the batches since did not read the bad values); {used}")
        elif idle:  # it sat unused in between: any step or write of those batches may have
            summary = (f"{shown} became {_kind_words(event.made_kind)} between batch {batch} and "
                       f"batch {first}: {made_by} after batch {batch} or after one of the "
                       f"batches that did not use it ({_numbers(idle)}) did it; {used}")
        else:
            summary = (f"{shown} became {_kind_words(event.made_kind)} between batch {batch} and "
                       f"batch {first}: {made_by} after batch {batch} did "
                       f"it; {used}")
    elif _cast_overflow(facts, dtype):
        return _cast_to_low_precision(facts, names, shown, verb, evidence, dtype)
    else:
        # The batches before this one that read the weights (an idle expert's read nothing).
        earlier = [b for b in facts.history_batches
                   if b < event.batch and b not in facts.idle_batches]
        since = [facts.unwritten_since[n] for n in names if n in facts.unwritten_since]
        # Sentinel mode: unwritten since a held batch, and no event read them before: the
        # batches before did not read the bad values (said below).
        unread = len(since) == len(names) > 0 \
            and not set(earlier) & set(facts.earlier_batches_here)
        # None of them ran with the weights finite: non-finite since the watch began (a
        # notebook cell run again after its first event), not since a step in between.
        all_along = bool(earlier) and set(earlier) <= set(facts.nonfinite_before) and not unread
        before_watch = all_along or not any(b < event.batch for b in facts.history_batches)
        made = "a write, an average or a load" if unstepped else \
            "an optimizer step, a load or a write"
        summary = (f"{shown} {verb} {_kind_words(event.made_kind)} before batch {event.batch} ran "
                   f"({made} made it), not this batch's forward.")
        if before_watch and not all_along:
            # The first batch watched: no step of this watch made it, so a load comes first (a
            # checkpoint resumed, from_pretrained), then what ran before the watch began.
            summary = (f"{shown} {verb} {_kind_words(event.made_kind)} when the watch began, "
                       f"before batch {event.batch} ran (a checkpoint loaded, a write, or a "
                       "training step before the watch made it), not this batch's forward.")
        if all_along:
            ran = f"batch {earlier[0]}" if len(earlier) == 1 else f"batches {_numbers(earlier)}"
            summary = (f"{shown} {verb} {_kind_words(event.made_kind)} since before the watch began, "
                       f"not since a step or write during it: every batch this watch ran "
                       f"before batch {event.batch} ({ran}) ran with "
                       f"{'it' if len(names) == 1 else 'them'} non-finite already.")
        if unstepped:  # (sentinel mode, which knows no last finite batch here)
            evidence.append(_not_stepped_line(facts, names))
        if since and len(since) == len(names) and not all_along:
            first_watched = min(facts.history_batches, default=min(since))
            start = max(since)
            before_watch = start <= first_watched
            when = "when the watch began" if before_watch else f"when batch {start} ran"
            held = "since before the watch began" if before_watch else \
                f"since batch {start} at least"
            summary = (f"{shown} {verb} {_kind_words(event.made_kind)} {held}; batch {event.batch} is "
                       "the first to read the bad values (no in-place write and no optimizer "
                       "step in between).")
            if before_watch and dtype in _CASTS_TO_INF and event.made_kind == "inf":
                # Sentinel mode: unread until now, but Inf since before the watch, as full
                # mode sees it at the first batch: a cast to float16 (or a checkpoint).
                return _cast_to_low_precision(facts, names, shown, verb, evidence, dtype,
                                              first_read=event.batch)
            unread_why = ("read none of the bad values (an embedding row or an expert they did "
                          "not use), and sentinel mode measures no weights")
            idle_before = [b for b in facts.idle_batches if b < event.batch]
            if not facts.sentinel and idle_before:  # full mode: its module did not run
                ran = "batch" if len(idle_before) == 1 else "batches"
                unread_why = (f"did not run '{event.module}' ({ran} {_numbers(idle_before)}: an "
                              "expert a router sent no token, a branch not taken), so none "
                              "measured or read it")
            evidence.append(
                f"The version counter of {names[0]} has not moved since batch {start}, nor have "
                f"the optimizer's steps: {'it' if len(names) == 1 else 'they'} held "
                f"{_kind_words(event.made_kind)} {when} already. The batches before {event.batch} "
                f"{unread_why} (a write through .data would not show).")
        if tame and any(n in facts.written_in_forward for n in names):
            evidence.append(f"Batch {event.batch}'s forward wrote into "
                            f"{'it' if len(names) == 1 else 'them'}, but from finite inputs of at "
                            f"most {_g(largest_input)}: such an update keeps a finite value "
                            "finite.")
        if all_along:
            one = len(names) == 1
            evidence.append(f"No batch under this watch ran with {'it' if one else 'them'} "
                            f"finite: {'it' if one else 'they'} held {_kind_words(event.made_kind)} "
                            "when the watch began (a checkpoint loaded, or a write before "
                            "nw.watch()), and running the batches again (a cell run twice) "
                            "reads the same weights.")
        elif before_watch and not since:
            evidence.append(f"No batch ran before batch {event.batch} under this watch: "
                            f"{'it' if len(names) == 1 else 'they'} held "
                            f"{_kind_words(event.made_kind)} when the watch began (a checkpoint "
                            "loaded, or a write before nw.watch()).")
    unmeasured = _no_history(facts)
    climb = None
    if unmeasured:
        # No weights measured before (sentinel mode): the model's output, read every batch, is
        # shown when it climbed (a divergence's sign; a healthy fresh model climbs too).
        climb = growth_of([(b, v) for b, v in facts.series("") if b < event.batch], least=4.0,
                          per_batch=_DIVERGING_PER_BATCH)
        if climb is not None:
            evidence.append(_growth_line("The output abs max of '<root>'", climb) + ": if no "
                            "write or load made the weight non-finite, training diverged.")
    evidence.extend(unmeasured)
    gradients_finite = _gradients_finite(facts)
    if gradients_finite and not before_watch:
        evidence.append(f"The watch checked the gradients of every backward pass before batch "
                        f"{event.batch}'s event (backward=True) and none was non-finite: no "
                        "backward pass handed the optimizer a NaN/Inf gradient.")
    elif _no_backward_pass(facts) and not before_watch:
        evidence.append("No backward pass ran through the watched model (backward=True saw "
                        "none): no gradient of it reached an optimizer.")
    return Diagnosis("corrupted-weight", summary, evidence,
                     fixes.corrupted_weight(names, dtype, batch, event.made_kind == "inf",
                                            before_watch=before_watch,
                                            stepped=not unstepped, no_step=no_step,
                                            replaced=replaced,
                                            gradients_checked=facts.checks_gradients
                                            and not _no_backward_pass(facts),
                                            gradients_finite=gradients_finite,
                                            optimizers=facts.optimizers,
                                            sharded_unchecked=facts.sharded_gradients_unchecked),
                     confidence="high" if batch is not None and climb is None and not likely
                     and not idle else "medium")


def _slices_lines(facts: Facts, names: list[str]) -> list[str]:
    """Which experts hold the non-finite values of a weight that keeps every expert of a
    mixture of experts (transformers' ``experts`` modules, one 3-D weight: dim 0 indexes the
    experts): only the tokens routed to those experts read them."""
    lines = []
    for name in names[:3]:
        if name not in facts.nonfinite_slices:
            continue
        slices, size = facts.nonfinite_slices[name]
        short = name.rpartition(".")[2]
        if len(slices) == size:
            lines.append(f"Its non-finite values lie in every one of its {size} experts "
                         f"({short}[0] to {short}[{size - 1}]).")
            continue
        where = ", ".join(f"{short}[{i}]" for i in slices[:8]) + (" ..." if len(slices) > 8 else "")
        one = len(slices) == 1
        lines.append(f"Its non-finite values lie in {where} only: "
                     f"{'expert' if one else 'experts'} {_numbers(slices)} of {size} (dim 0 "
                     f"indexes the experts); only the tokens routed to "
                     f"{'it' if one else 'them'} read them.")
    return lines


def _numbers(batches: list[int]) -> str:
    """"2, 3, 4" (at most 8 numbers)."""
    return ", ".join(map(str, batches[:8])) + (" ..." if len(batches) > 8 else "")


def _stepped_with_nonfinite_lr(facts: Facts, names: list[str], dtype: str) -> Diagnosis:
    """Parameters an optimizer step wrote with a NaN/Inf learning rate (a scheduler gone wrong):
    that step made them non-finite, whatever the gradients were."""
    event = facts.event
    one = len(names) == 1
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    kind, lr = facts.nonfinite_lr[names[0]]
    lrs = sorted({_g(facts.nonfinite_lr[n][1]) for n in names})
    kinds = sorted({facts.nonfinite_lr[n][0] for n in names})
    last = [facts.weights_last_finite[n] for n in names if n in facts.weights_last_finite]
    batch = max(last) if last else None
    after = f"after batch {batch}" if batch is not None else f"before batch {event.batch}"
    stepped = f"{'/'.join(kinds)} stepped with lr={'/'.join(lrs)} {after}"
    evidence = [f"{shown} {'holds' if one else 'hold'} {_kind_words(event.made_kind)} at batch "
                f"{event.batch}" + (f" ({dtype})." if dtype else "."),
                f"Optimizer {stepped}: its param group's learning rate was not finite, and the "
                f"step wrote {'it' if one else 'them'} (the update is multiplied by the lr, so "
                "every parameter of that group it updated became NaN/Inf)."]
    if batch is not None:
        evidence.append(f"{'It was' if one else 'They were'} finite when batch {batch} ran.")
    if facts.lr_step_in_progress:
        evidence.append(f"Batch {event.batch}'s forward ran inside that step, before it ended: "
                        "a closure the optimizer calls (LBFGS evaluates it several times per "
                        "step), so the step wrote the weights before its own end.")
    first = f"batch {event.batch} is the first to use {'it' if one else 'them'}"
    summary = (f"{shown} became {_kind_words(event.made_kind)} in the {'/'.join(kinds)} step {after}, "
               f"which ran with a non-finite learning rate (lr={'/'.join(lrs)}); {first}.")
    reload = (f"a checkpoint saved before that step (batch {batch} or earlier)"
              if batch is not None else "a checkpoint saved before that step")
    suggestion = [
        "Find what set the learning rate to "
        f"{'/'.join(lrs)}: a scheduler's formula (LambdaLR/MultiplicativeLR's lr_lambda dividing "
        "by zero or overflowing at some step, a warmup of step / warmup_steps with "
        "warmup_steps=0), OneCycleLR's or CosineAnnealingLR's parameters (total_steps, "
        "steps_per_epoch, T_max of 0), or a value written into optimizer.param_groups[i]['lr']; "
        "print [g['lr'] for g in optimizer.param_groups] each step to see when it turns.",
        "Guard the step: skip optimizer.step() when any param group's lr is not finite "
        "(math.isfinite(g['lr'])), and reload the weights from " + reload + ": that step wrote "
        "NaN/Inf into every parameter it updated."]
    return Diagnosis("corrupted-weight", summary, evidence, suggestion, confidence="high")


def _wrapper_state_nonfinite(facts: Facts, names: list[str], dtype: str) -> Diagnosis:
    """Weights an optimizer wrapper overwrote from its own non-finite state (Lookahead copies
    its slow weights into the parameters every k steps): the state was bad, not the gradient."""
    event = facts.event
    one = len(names) == 1
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    states = list(dict.fromkeys(s for n in names for s in facts.wrapper_state_nonfinite[n]))
    state = ", ".join(states[:3]) + (" ..." if len(states) > 3 else "")
    wrapper = states[0].partition(".")[0]
    last = [facts.weights_last_finite[n] for n in names if n in facts.weights_last_finite]
    batch = max(last) if last else None
    after = f"after batch {batch}" if batch is not None else f"before batch {event.batch}"
    kind = _kind_words(event.made_kind)
    summary = (f"{shown} became {kind} {after} from the optimizer state {state}, which is "
               f"{kind}: the {wrapper} step copies that state into the "
               f"{'parameter' if one else 'parameters'} (Lookahead: slow += alpha * (fast - "
               f"slow); p.copy_(slow) every k steps); batch {event.batch} is the first to use "
               f"{'it' if one else 'them'}.")
    evidence = [f"{shown} {'holds' if one else 'hold'} {kind} at batch {event.batch}"
                + (f" ({dtype})." if dtype else "."),
                f"{state} (p: {'that parameter' if one else 'each of them'}) holds {kind}; "
                f"{wrapper} wraps another optimizer and keeps it for p."]
    if batch is not None:
        evidence.append(f"{'It was' if one else 'They were'} finite when batch {batch} ran: a "
                        f"{wrapper} step after it wrote {'it' if one else 'them'}.")
    suggestion = [
        f"Find what made {state} {kind}: a checkpoint's optimizer state loaded with "
        f"{wrapper}.load_state_dict (check torch.isfinite on its tensors before loading), or "
        "slow weights copied from the parameters while they held NaN/Inf (an earlier bad "
        "step); the gradients did not make it.",
        f"Reset it from finite weights: for each p, {states[0]} = p.detach().clone() (after "
        "reloading the parameters from a checkpoint saved before the bad step)."]
    return Diagnosis("corrupted-weight", summary, evidence, suggestion, confidence="high")


def _written_by_sam_first_step(facts: Facts, names: list[str], dtype: str) -> Diagnosis:
    """Weights written in place outside any optimizer step by an optimizer whose param groups
    hold SAM's rho: SAM's first_step (p.add_(rho * p.grad / grad_norm)) is not a torch
    optimizer step, and a zero gradient norm makes it 0/0 = NaN."""
    event = facts.event
    one = len(names) == 1
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    last = [facts.weights_last_finite[n] for n in names if n in facts.weights_last_finite]
    batch = max(last) if last else None
    after = f"after batch {batch}" if batch is not None else f"before batch {event.batch}"
    kind = _kind_words(event.made_kind)
    summary = (f"{shown} became {kind} {after}, written outside optimizer.step(): by the SAM "
               "first step (e_w = rho * p.grad / grad_norm; p.add_(e_w)), which a zero gradient "
               f"norm makes 0/0 = NaN; batch {event.batch} is the first to use "
               f"{'it' if one else 'them'}.")
    evidence = [f"{shown} {'holds' if one else 'hold'} {kind} at batch {event.batch}"
                + (f" ({dtype})." if dtype else "."),
                f"{'Its' if one else 'Their'} version counter moved after batch {batch} (an "
                "in-place write), but no torch optimizer step wrote "
                f"{'it' if one else 'them'} since (the watch marks each parameter a step "
                f"updates), and batch {event.batch}'s forward ran "
                + ("inside SAM's step, as the closure it calls after first_step (before the "
                   "base optimizer's step)." if any(facts.written_outside_step[n] == "SAM step"
                                                    for n in names)
                   else "outside any step."),
                "The optimizer holding them has SAM's rho in its param groups: SAM's "
                "first_step perturbs the weights outside the base optimizer's step(). A "
                "gradient norm of 0 (a frozen or dead layer, a batch with zero loss) gives "
                "rho * 0 / 0 = NaN."]
    suggestion = [
        "Add a small constant to the gradient norm in SAM.first_step: scale = group['rho'] / "
        "(grad_norm + 1e-12), so that a zero gradient perturbs nothing instead of writing NaN.",
        "Or skip both SAM steps when the gradient norm is 0 (nothing to climb); reload the "
        "weights from a checkpoint saved before that step."]
    return Diagnosis("corrupted-weight", summary, evidence, suggestion,
                     confidence="high" if batch is not None else "medium")


def _gradients_finite(facts: Facts) -> bool:
    """The watch checked the gradients (backward=True) of at least one backward pass and none
    was non-finite before the event: no backward pass handed the optimizer a NaN/Inf."""
    return facts.checks_gradients and facts.gradient_event_before is None \
        and not _no_backward_pass(facts)


def _no_backward_pass(facts: Facts) -> bool:
    """The watch checks the gradients (backward=True), and no backward pass ran yet."""
    return facts.checks_gradients and facts.backward_passes == 0


def _lr(lr: Any) -> str:
    return f"{lr:g}" if isinstance(lr, float) else str(lr)


def _lbfgs_search(lbfgs: dict) -> str:
    search = lbfgs.get("line_search_fn")
    return (f"its line search ({search!r}) tried a step" if search else
            f"its update by lr ({_lr(lbfgs.get('lr'))}) times its direction, with no line "
            "search,")


def _lbfgs_outputs_climbed(facts: Facts, names: list[str], dtype: str) -> Diagnosis | None:
    """Weights gone non-finite inside LBFGS's step in progress after the model's outputs,
    on the same input tensors at every call held, climbed over its closure calls: its
    iterations diverged (what sentinel mode can tell of it: no weights measured between, and
    they are non-finite now). None when the outputs did not climb or the inputs differed."""
    event, lbfgs = facts.event, facts.lbfgs or {}
    if not lbfgs.get("same_inputs"):
        return None
    points = [(b, v) for b, v in facts.series("") if lbfgs["first_batch"] <= b < event.batch]
    grew = growth_of(points, least=4.0, per_batch=_DIVERGING_PER_BATCH)
    if grew is None:
        return None
    kind = _kind_words(event.made_kind)
    evidence = [_growth_line("The output abs max of '<root>'", grew).replace(
                    "per batch", "per closure call") + ", on the same input tensors (every "
                "call held ran on them, unchanged): only the weights changed between the calls.",
                f"Batches {lbfgs['first_batch']} to {event.batch} are calls of LBFGS's closure "
                "inside one optimizer.step() that has not ended (no step ended between them; "
                f"max_iter={lbfgs.get('max_iter')}): {_lbfgs_search(lbfgs)} after each call "
                "wrote the weights.",
                "The weights were not measured between the calls (sentinel mode records no "
                f"batch in full without sample_every) and are {kind} now.",
                f"At batch {event.batch} {', '.join(names)} "
                f"{'is' if len(names) == 1 else 'are'} {kind}."]
    return Diagnosis(
        "divergence",
        f"LBFGS diverged inside one optimizer step: the model's outputs grew "
        f"{grew.per_batch:.3g}x per closure call from batch {grew.start[0]} to batch "
        f"{grew.end[0]} on the same inputs, until {', '.join(names[:2])} became {kind} (used at "
        f"batch {event.batch}).", evidence,
        fixes.lbfgs(lbfgs.get("lr"), lbfgs.get("max_iter"), lbfgs.get("line_search_fn"), dtype),
        confidence="medium")


def _written_inside_lbfgs_step(facts: Facts, names: list[str], dtype: str) -> Diagnosis:
    """Parameters finite at an earlier call of LBFGS's closure inside the step still in
    progress, non-finite now, with no climb of the weights before: one of its iterations (an
    update by lr times its direction, or a line search's trial) stepped into NaN/Inf. No
    divergence over training: no step ended in between."""
    event, lbfgs = facts.event, facts.lbfgs or {}
    one = len(names) == 1
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    kind = _kind_words(event.made_kind)
    last = max(facts.weights_last_finite[n] for n in names)
    likely = all(n in facts.finite_by_outputs for n in names)
    search = lbfgs.get("line_search_fn")
    how = _lbfgs_search(lbfgs)
    evidence = [f"{shown} {'holds' if one else 'hold'} {kind} at batch {event.batch}"
                + (f" ({dtype})." if dtype else "."),
                f"{'It was' if one else 'They were'} finite when batch {last} ran"
                + (" (its outputs were finite; sentinel mode measures no weights)" if likely
                   else "")
                + f"; batches {lbfgs.get('first_batch')} to {event.batch} are calls of LBFGS's "
                "closure inside one optimizer.step() that has not ended (no step ended between "
                f"them; max_iter={lbfgs.get('max_iter')}): {how} after batch {last} wrote "
                f"{'it' if one else 'them'}."]
    points = [(b, v) for b, v in facts.weights.series
              if lbfgs.get("first_batch", 0) <= b <= last]
    if len(points) >= 2:
        shown_points = ", ".join(f"{_g(v)} at batch {b}" for b, v in points[-3:][::-1])
        (before, was), (_, then) = points[-2:]
        jumped = (f"the update after batch {before} alone multiplied them by {_g(then / was)}"
                  if was > 0 and then >= _JUMP * was else "no climb over the iterations")
        evidence.append("The weights' abs max (summed over modules) in the calls before: "
                        f"{shown_points} ({jumped}).")
    evidence.extend(_activation_lines(facts, [event.module, ""]))
    return Diagnosis(
        "corrupted-weight",
        f"{shown} became {kind} between batch {last} and batch {event.batch}, two calls of "
        "LBFGS's closure inside one optimizer.step(): one of its iterations stepped into "
        f"{kind} ({how} after batch {last}); no optimizer step ended in between, so this is "
        "no divergence over training steps.", evidence,
        fixes.lbfgs(lbfgs.get("lr"), lbfgs.get("max_iter"), search, dtype),
        confidence="medium" if likely or facts.sentinel else "high")  # sentinel: no weights


def _buffer(facts: Facts, name: str) -> bool:
    """Whether the weight ``name`` is a buffer: no optimizer steps it."""
    return facts.is_buffer is not None and facts.is_buffer(name)


def _not_stepped_line(facts: Facts, names: list[str]) -> str:
    """Why no optimizer step wrote these weights (see ``Facts.not_stepped``)."""
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    one = len(names) == 1
    buffers = [n for n in names if facts.not_stepped.get(n) == "buffer" or _buffer(facts, n)]
    if len(buffers) == len(names):
        return (f"{shown} {'is a buffer' if one else 'are buffers'}: no optimizer steps "
                f"{'it' if one else 'them'}; a write, an average (AveragedModel's "
                "update_parameters with use_buffers=True) or a load did.")
    if any(facts.not_stepped.get(n) == "no step" for n in names):
        return ("No optimizer step ran while the watch was live (it counts every torch.optim "
                "step), and no gradient was made for an update by hand (the batches since ran "
                f"under torch.no_grad(), or {'it needs' if one else 'they need'} none): a load, "
                "a copy_ or another write did it.")
    return (f"No optimizer step wrote {shown} while the watch was live: optimizer steps ran, "
            f"but none updated {'it' if one else 'them'} (the watch marks each parameter a "
            f"torch.optim step updates), and {'it has' if one else 'they have'} no gradient: "
            "a write did it, such as an EMA or AveragedModel update, a copy_ or a "
            "load_state_dict.")


def _inputs_largest(facts: Facts) -> float | None:
    """The largest |x| of the inputs of the event's own forward frame (NaN when one of them is
    non-finite); None when the frame or its inputs are not among the event's frames."""
    event = facts.event
    frames = event.frames
    if frames is None or frames.empty or event.is_backward:
        return None
    own = frames[(frames["frame"] == event.frame) & (frames["batch"] == event.batch)
                 & (frames["phase"] == "forward")]
    inputs = own[own["role"].str.startswith(("input", "kwarg:")) & own["abs_max"].notna()]
    if inputs.empty:
        return None
    if bool(inputs["nan"].any()) or bool(inputs["inf"].any()):
        return math.nan
    return float(inputs["abs_max"].max())


def _in_added_module(facts: Facts, names: list[str], dtype: str) -> Diagnosis:
    """Weights of a module added or replaced after watch() (a conv fused with its BatchNorm, a
    swapped layer): the watch measured the module it replaced, never this one, so neither its
    version counter nor an optimizer step dates them; whatever made the module (or wrote it
    since) made them non-finite."""
    event = facts.event
    one = len(names) == 1
    kind = _kind_words(event.made_kind)
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    modules = list(dict.fromkeys(facts.replaced_modules[n] for n in names))
    module = ", ".join(f"'{m}'" for m in modules[:3]) + (" ..." if len(modules) > 3 else "")
    last = [facts.weights_last_finite[n] for n in names if n in facts.weights_last_finite]
    batch = max(last) if last else None
    # Known from finite outputs alone (sentinel mode, or no module of that name was watched).
    fresh = any(m in facts.new_modules for m in modules)
    likely = fresh or any(n in facts.finite_by_outputs for n in names)
    added = "added" if all(m in facts.new_modules for m in modules) else "added or replaced"
    evidence = [f"{shown} {'holds' if one else 'hold'} {kind} at batch {event.batch}"
                + (f" ({dtype})." if dtype else "."),
                f"Module {module} is not one watch() hooked: it was {added} after watch() and "
                "runs unwatched, so no frame measured its own weights"
                + ("" if fresh else " (its frames before are those of the module it replaced)")
                + " and no version counter or optimizer step dates them."]
    if batch is None:
        when = f"after watch(), before batch {event.batch} ran"
        evidence.append(f"No batch before batch {event.batch} ran under this watch with "
                        f"finite outputs: it came in between watch() and batch {event.batch}.")
    elif likely:
        when = f"after watch(), likely after batch {batch}"
        evidence.append(f"Batch {batch}'s outputs were finite ("
                        + ("no frame measured the new module" if fresh else
                           "sentinel mode measures no weights")
                        + f"): the new module likely came in after it, unless batch {batch} "
                        "did not read the bad values.")
    else:
        when = f"after watch(), after batch {batch}"
        evidence.append(f"Batch {batch} ran with finite weights in {module} (the module it "
                        "replaced): the new one came in after it.")
    # The module runs unwatched: the earlier events at it, and the model's outputs, tell which
    # batch it first made non-finite.
    after = -1 if batch is None else batch
    finite = {b for b, _ in facts.series("")}
    bad = [b for b in facts.history_batches if "" in facts.history_modules and b not in finite]
    first = min([b for b in bad + facts.earlier_batches_here if after < b < event.batch],
                default=event.batch)
    used = (f"batch {first} is the first whose outputs it made {kind}" if first == event.batch
            else f"batch {first} was the first whose outputs it made {kind}, and batch "
            f"{event.batch} still reads it")
    summary = (f"{shown} {'holds' if one else 'hold'} {kind} in module {module}, {added} "
               f"{when}: what made it (a fusion, a load, a module swap), or a write to "
               f"it since, made {'it' if one else 'them'} {kind}; {used}.")
    return Diagnosis("corrupted-weight", summary, evidence, fixes.added_module(modules[0], kind),
                     confidence="medium" if likely or batch is None else "high")


def _loaded(facts: Facts, names: list[str], dtype: str) -> Diagnosis:
    """Weights a load of the model's state wrote non-finite (``Facts.loaded``): the state
    dict it loaded held the NaN/Inf, no step or write of the run."""
    event = facts.event
    one = len(names) == 1
    load = max((facts.loaded[n] for n in names), key=lambda item: item.number)
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    what = _kind_words(event.made_kind)
    it = "it" if one else "them"
    when = f"after batch {load.batch - 1}" if load.batch > 0 else "before batch 0 ran"
    by = load.caller + (f" at {load.where}" if load.where else "")
    first = min([b for b in facts.history_batches if load.batch <= b < event.batch
                 and b not in facts.idle_batches], default=event.batch)
    used = (f"batch {first} is the first to use {it}" if first == event.batch else
            f"batch {first} was the first to use {it}, and batch {event.batch} still does")
    evidence = [f"{shown} {'holds' if one else 'hold'} {what} at batch {event.batch}"
                + (f" ({dtype})." if dtype else ".")]
    evidence.extend(_slices_lines(facts, names))
    last = [facts.weights_last_finite[n] for n in names if n in facts.weights_last_finite]
    if last:
        evidence.append(f"{'It was' if one else 'They were'} finite when batch {max(last)} ran.")
    evidence.append(
        f"{by} wrote {it} {when} (load {load.number} of the watch), and nothing wrote {it} "
        f"since: the same tensor{'' if one else 's'}, the version counter where the load left "
        f"{it}, no optimizer step after it.")
    return Diagnosis(
        "corrupted-weight",
        f"{shown} {'holds' if one else 'hold'} {what} since {by} loaded {it} {when}: the state "
        f"dict it loaded held {what} there, no step or write of this run made {it}; {used}.",
        evidence, fixes.loaded_nonfinite(names, what, dcp=load.dcp), confidence="high")


def _substituted(facts: Facts, names: list[str]) -> Diagnosis:
    """Weights non-finite in the forward, whose slots held stand-ins for the module's
    parameters: the forward ran with other tensors in their place."""
    event = facts.event
    one = len(names) == 1
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    what = _kind_words(event.made_kind)
    return Diagnosis(
        "corrupted-weight",
        f"{shown} held {what} in batch {event.batch}'s forward, which ran with another "
        f"tensor in {'its' if one else 'their'} place (torch.func.functional_call, a stateless "
        "call, a meta-learning fast weight): that tensor held it, not the module's own "
        f"{'parameter' if one else 'parameters'}.",
        [f"While batch {event.batch} ran, the module's {'slot' if one else 'slots'} for "
         f"{shown} held a plain tensor, not its nn.Parameter: a stateless call puts its "
         "tensors there for the forward and puts the parameters back after it."],
        ["Check the tensors passed in the module's place (the parameters given to "
         "torch.func.functional_call, an inner step's fast weights): torch.isfinite(t).all() "
         "for each before the call.",
         "If an inner optimisation step made them (MAML), guard it: a smaller inner learning "
         "rate, inner gradients clamped (g.clamp(-c, c)), or the step skipped when a gradient "
         "is non-finite; clip_grad_norm_ on the model does not see them."],
        confidence="medium")


def _written_within_batch(facts: Facts, names: list[str], dtype: str) -> Diagnosis:
    """Weights an earlier call of their module in the same batch measured finite (full mode),
    or whose versions moved between two forwards of the batch (sentinel mode): something wrote
    them between two forwards of one batch (an optimizer step inside it)."""
    event = facts.event
    one = len(names) == 1
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    what = f"{'holds' if one else 'hold'} {_kind_words(event.made_kind)}"
    why = ("an optimizer step or a write between two forwards of the same batch did it (LBFGS "
           "evaluates its closure several times per step; SAM perturbs the weights between its "
           "two passes).")
    measured = all(n in facts.finite_earlier_in_batch for n in names)
    if measured:
        call = max(facts.finite_earlier_in_batch[n] for n in names)
        summary = (f"{shown} became {_kind_words(event.made_kind)} within batch {event.batch}, "
                   f"between call {call} and call {event.call} of module "
                   f"'{event.module_label}': {why}")
        where = f"call {event.call} of batch {event.batch}"
        seen = (f"Call {call} of module '{event.module_label}' in the same batch measured "
                f"{'it' if one else 'them'} finite.")
    else:  # sentinel mode: versions, not measurements
        forward = max(facts.written_between_forwards[n] for n in names)
        summary = (f"{shown} {'was' if one else 'were'} written within batch {event.batch}, "
                   f"before its forward {forward} (of the model's calls in the batch), and "
                   f"{what} now: likely {why}")
        where = f"batch {event.batch}"
        seen = (f"{'Its' if one else 'Their'} version counter or the optimizer's steps moved "
                f"between forward {forward - 1} and forward {forward} of batch {event.batch}; "
                "the replay ran every forward on the weights as they are now (sentinel mode "
                "measures no weights as the batch runs).")
    evidence = [f"{shown} {what} at {where}" + (f" ({dtype})." if dtype else "."), seen]
    fixes_ = [f"A step inside batch {event.batch} wrote {'it' if one else 'them'}: with LBFGS, "
              "pass line_search_fn='strong_wolfe' and a smaller lr so that no trial point "
              "overflows; with SAM, a smaller rho; else lower the learning rate."]
    fixes_ += fixes.corrupted_weight(names, dtype, event.batch, event.made_kind == "inf",
                                     gradients_checked=facts.checks_gradients,
                                     gradients_finite=_gradients_finite(facts),
                                     optimizers=facts.optimizers)[:2]
    return Diagnosis("corrupted-weight", summary, evidence, fixes_,
                     confidence="high" if measured else "medium")


def _poisoned_by_earlier_forward(facts: Facts, names: list[str]) -> Diagnosis:
    """Buffers an earlier batch's forward wrote while its values held NaN/Inf (BatchNorm
    updates its running statistics from every training batch): every batch since uses them."""
    event, cause_event = facts.event, facts.poisoned_by
    one = len(names) == 1
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    module = names[0].rpartition(".")[0] or "<root>"
    running = all(n.rpartition(".")[2] in ("running_mean", "running_var") for n in names)
    reset = (f"model.get_submodule('{module}').reset_running_stats()" if running
             else "recompute them")
    return _carried(
        cause_event.diagnosis,
        f"{shown} {'holds' if one else 'hold'} {_kind_words(event.made_kind)} since batch "
        f"{cause_event.batch}'s forward updated {'it' if one else 'them'} from its non-finite "
        f"values (module '{module}' updates {'its running statistics' if running else 'them'} "
        "from every training batch)",
        f"Batch {cause_event.batch}'s forward wrote into {'it' if one else 'them'} while its "
        f"values held {_kind_words(cause_event.made_kind)} (its event at module "
        f"'{cause_event.module_label}', {cause_event.role}); no optimizer step updates "
        f"{'it' if one else 'them'}, and every batch since runs with {'it' if one else 'them'}.",
        first=[f"Mend them: {reset}, or reload them from a checkpoint saved before batch "
               f"{cause_event.batch}. Skipping the optimizer step of a bad batch is too late for "
               "them: its forward already wrote them, so keep such a batch out of the training "
               "forward (check it before model(x)), or run it under model.eval()."])


def _jump_into_batch(facts: Facts) -> Growth | None:
    """The weights' jump by :data:`_JUMP` or more across the optimizer step just before the
    event's batch, told from the modules whose weights stayed finite in that batch: a buffer
    its forward wrote non-finite (BatchNorm's running_var overflowing) leaves the batch no
    finite sum, so :func:`_weights_growth` has no point for it. None when they did not jump."""
    part = facts.weights.finite_part
    if part is None or part[0] != facts.event.batch:
        return None
    before = [(b, v) for b, v in facts.weights.series if b < part[0]]
    if not before:
        return None
    last = before[-1]
    steps = facts.optimizer_steps
    stepped = steps.get(part[0], 0) > steps.get(last[0], math.inf)
    if stepped and last[1] > 0 and math.isfinite(part[1]) and part[1] >= _JUMP * last[1]:
        return Growth(start=last, end=part)
    return None


def _diverged_into_buffer(facts: Facts, names: list[str], dtype: str, jump: Growth,
                          largest_input: float | None) -> Diagnosis:
    """Buffers the event batch's own forward made non-finite from the huge values of weights
    that the optimizer step before the batch blew up: the step diverged, not the data."""
    event = facts.event
    one = len(names) == 1
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    module = event.module or "<root>"
    running = all(n.rpartition(".")[2] in ("running_mean", "running_var") for n in names)
    modules = _grown_modules(facts)
    most = f" (most: {modules[0]})" if modules else ""
    reached = ("" if largest_input is None or largest_input != largest_input
               else f" reached {_g(largest_input)} and")
    evidence = [f"The weights' abs max (summed over the modules whose weights are finite) "
                f"jumped from {_g(jump.start[1])} at batch {jump.start[0]} to "
                f"{_g(jump.end[1])} at batch {jump.end[0]} ({_g(jump.ratio)}x) across the "
                f"optimizer step after batch {jump.start[0]}."]
    if modules:
        evidence.append(f"Grown most since first measured: {', '.join(modules)}.")
    if largest_input is not None:
        evidence.append(f"Module '{module}''s inputs in batch {event.batch} reached "
                        f"{'NaN/Inf' if largest_input != largest_input else _g(largest_input)}"
                        f" ({_limit_text(dtype or 'float32')}); its forward wrote "
                        f"{shown} from them"
                        + (" (BatchNorm's running statistics: a running variance is a mean of "
                           "squares)." if running else "."))
    evidence.extend(_activation_lines(facts, [event.module]))
    reset = (f"model.get_submodule('{module}').reset_running_stats()" if running
             else "recompute them")
    suggestion = fixes.divergence(dtype) + [
        f"Then mend {shown}: reload {'it' if one else 'them'} from a checkpoint saved before "
        f"batch {jump.end[0]}, or {reset}, since evaluation uses "
        f"{'it' if one else 'them'}."]
    return Diagnosis(
        "divergence",
        f"Training diverged: the optimizer step after batch {jump.start[0]} made the weights "
        f"jump {_g(jump.ratio)}x{most}, so module '{module}''s inputs in batch {event.batch}"
        f"{reached} its forward wrote {shown} {_kind_words(event.made_kind)} from them.",
        evidence, suggestion, confidence="high")


def _written_by_forward(facts: Facts, names: list[str], dtype: str,
                        largest_input: float | None) -> Diagnosis:
    """Buffers that the event batch's own forward made non-finite (BatchNorm's running
    statistics, updated from the batch): no optimizer step or load did it."""
    event = facts.event
    one = len(names) == 1
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    what = _kind_words(event.made_kind)
    module = event.module or "<root>"
    running = all(n.rpartition(".")[2] in ("running_mean", "running_var") for n in names)
    updated = (f"module '{module}' updates {'it' if one else 'them'} from every training batch"
               + (" (BatchNorm's running statistics)" if running else ""))
    if all(facts.weights_last_finite.get(n) == event.batch - 1 for n in names):
        evidence = [f"{shown} {'was' if one else 'were'} finite when batch {event.batch} "
                    f"started, and its forward wrote into {'it' if one else 'them'}: {updated}, "
                    f"and nothing else wrote into {'it' if one else 'them'} since the last "
                    "finite batch."]
    else:
        evidence = [f"Batch {event.batch}'s forward wrote into {'it' if one else 'them'}: "
                    f"{updated}; no write or load moved {'it' if one else 'them'} since the "
                    "last batch that ran."]
    if largest_input is not None:
        evidence.append(f"Its inputs in batch {event.batch} reached "
                        f"{'NaN/Inf' if largest_input != largest_input else _g(largest_input)}"
                        f" ({_limit_text(dtype or 'float32')}).")
    evidence.extend(_activation_lines(facts, [event.module]))
    largest = "float16's 65504" if dtype == "float16" else f"{dtype or 'its dtype'}'s largest"
    reset = (f"reset it (model.get_submodule('{module}').reset_running_stats())" if running
             else "recompute it")
    fixes_ = [f"Look at what module '{module}' got in batch {event.batch}: a running variance "
              f"is a mean of squares, so inputs above the square root of {largest} overflow "
              "it (and a NaN input makes it NaN). Normalise or clamp them before the module, "
              "or drop the batch.",
              f"Then mend the buffer: reload it from a checkpoint, or {reset}, since evaluation "
              "uses it."]
    return Diagnosis("corrupted-weight",
                     f"{shown} became {what} in batch {event.batch}'s own forward: module "
                     f"'{module}' wrote it from this batch's values (no optimizer step or load "
                     "did it).", evidence, fixes_, confidence="high")


# Formats whose cast turns a value past their largest into inf (float8_e4m3fn and the fnuz
# formats have no inf: NaN or saturation).
_CASTS_TO_INF = ("float16", "float8_e5m2")


def _cast_overflow(facts: Facts, dtype: str) -> bool:
    """A float16 (or float8_e5m2) weight holding Inf (no NaN) at the first batch the watch saw:
    nothing the watch saw ran before it, and a float32 value past the format's largest turns
    into inf when a model is cast to it."""
    event = facts.event
    return dtype in _CASTS_TO_INF and event.made_kind == "inf" \
        and not any(b < event.batch for b in facts.history_batches)


def _cast_to_low_precision(facts: Facts, names: list[str], shown: str, verb: str,
                           evidence: list[str], dtype: str,
                           first_read: int | None = None) -> Diagnosis:
    event = facts.event
    largest = f"{dtype_max(dtype):.6g}"
    it = 'it' if len(names) == 1 else 'them'
    if first_read is None:
        evidence.append(f"No batch ran before batch {event.batch} under this watch: what made "
                        f"{it} Inf came before the watch (a cast to {dtype}, a load, or "
                        "training steps run before it).")
    else:
        evidence.append(f"No in-place write and no optimizer step since the watch began: what "
                        f"made {it} Inf came before the watch (a cast to {dtype}, a load, or "
                        f"training steps run before it); batch {first_read} is the first to "
                        "read the bad values (an embedding row the batches before did not use).")
    if dtype == "float16":
        how = ("when a model is cast to float16 (model.half(), .to(torch.float16), "
               "torch_dtype=torch.float16)")
        fixes_ = fixes.cast_to_float16(names)
    else:
        how = f"when a tensor is cast to {dtype} without a scale (.to(torch.{dtype}))"
        fixes_ = fixes.cast_to_float8(names, dtype, largest)
    return Diagnosis(
        "overflow",
        f"{shown} {verb} Inf in {dtype} from the first batch watched: a value above {dtype}'s "
        f"largest ({largest}) becomes inf {how}; a checkpoint holding inf reads the same.",
        evidence, fixes_, confidence="medium")


def _weight_dtype(event: NanEvent) -> str:
    frames = event.frames
    if frames is None or frames.empty:
        return ""
    rows = frames[(frames["frame"] == event.frame) & (frames["batch"] == event.batch)
                  & (frames["role"] == event.role)]
    return str(rows["dtype"].iloc[0]) if len(rows) else ""


def _op_rows(facts: Facts, op: OpFacts) -> list[int]:
    """The batch's samples whose values the op made non-finite, when they can be told: an op
    of the forward (or of loss_fn) whose first non-finite output has the batch's samples
    along dim 0 (its size is the batch size the inputs tell: not a seq-first tensor, not
    attention scores of batch x heads, not the tokens a router sent an expert); else none."""
    if (op.phase not in ("forward", "loss") or op.grad_of) and not _zero_over_zero(op):
        return []  # (a gradient's 0/0 divides the forward's values: the forward's shape)
    output = op.bad_output()
    size = facts.batch_size()
    if output is None or size is None:
        return []
    shape, rows = output.get("shape"), output.get("nonfinite_rows")
    if not isinstance(shape, (tuple, list)) or not shape or shape[0] != size \
            or not isinstance(rows, list):  # a recording made before the rows were kept
        return []
    if op.picked_rows:
        return []  # an expert's routed tokens: as many as the samples, by chance
    return [int(r) for r in rows]


def _samples_at_fault(rows: list[int], size: int | None) -> list[int]:
    """The rows a diagnosis names as its ``rows``: none when every sample holds the NaN/Inf
    (no sample is at fault: a weight, a buffer or the scale of them all is; the summary says
    "in every row")."""
    return [] if len(rows) == size else rows


def _rows_words(rows: list[int], size: int | None, limit: int = 8) -> str:
    """" in row 1" / " in every row" (of the batch's samples); "" without rows."""
    return " in every row" if rows and len(rows) == size else fixes.in_rows(rows, limit)


def _rows_evidence(op: OpFacts, rows: list[int], size: int | None) -> str:
    """The line naming the samples the op made non-finite."""
    output = op.bad_output() or {"role": "output"}
    head = f"{op.op}'s {output['role']} holds its NaN/Inf"
    if len(rows) == size:
        return f"{head} in every one of the batch's {size} rows (dim 0: its samples)."
    if len(rows) >= OP_ROWS_DESCRIBED:
        return (f"{head} in {fixes.rows_named(rows, 12)} (the first {OP_ROWS_DESCRIBED} named) "
                f"of the batch's {size} rows (dim 0: its samples).")
    return (f"{head} in {fixes.rows_named(rows, 12)} of the batch's {size} rows (dim 0: its "
            "samples); the other rows stayed finite.")


def _rows_masked(facts: Facts) -> list[int]:
    return sorted({r for i in facts.inputs for r in i.masked_rows})


def _left_padded(facts: Facts, rows: list[int]) -> str:
    """The line saying that the rows a masked softmax made NaN in are left-padded (their
    attention_mask starts with zeros): under a causal mask the query positions of the padding
    see no key at all, though the sequence holds tokens. "" when they are not."""
    for item in facts.inputs:
        padded = [r for r in rows if r in item.left_padding]
        if padded and len(padded) == len(rows):
            first = ", ".join(f"the first {item.left_padding[r]} positions of row {r}"
                              for r in padded[:8]) + (", ..." if len(padded) > 8 else "")
            if len(item.shape) > 2:  # a mask per query and key: generate()'s for a static cache
                return (f"{item.role} ({item.dtype} {item.shape}, per query and key) hides "
                        f"{first.replace('positions', 'key positions')} from every query (left "
                        "padding): under the causal mask, each padding position's query sees "
                        "no key at all, so its scores are all -inf though the sequence holds "
                        "tokens.")
            return (f"{item.role} is 0 at {first} (left padding): under a causal mask, each "
                    "padding position's query sees no key at all, so its scores are all -inf "
                    "though the sequence holds tokens.")
    return ""


def _writes_inf(op: OpFacts) -> bool:
    """Whether the op writes a value it was given (masked_fill, fill, full, where) and made an
    Inf from finite inputs: the value was inf (a mask), nothing overflowed."""
    return op.inf and not op.nan and op.name in INTENDED_INF_OPS and not op.inputs_hold_inf()


def _written_inf(facts: Facts, op: OpFacts) -> Diagnosis:
    """An Inf a mask op wrote on purpose that left the module in its outputs (DETR-style
    proposals masked with +inf before a sigmoid): a mask, not an overflow."""
    event = facts.event
    holding = facts.outputs_holding or list(dict.fromkeys([op.module, event.module]))
    evidence = _op_evidence(op) + [
        f"No input of {op.op} holds an Inf, so the Inf is the value it was told to write (inf, "
        f"or a number too large for {op.dtype}): nothing overflowed."]
    if facts.outputs_holding:
        shown = ", ".join(f"'{m or '<root>'}'" for m in holding[:8])
        evidence.append(f"Outputs that held it in batch {event.batch}: {shown}"
                        f"{', ...' if len(holding) > 8 else ''}.")
    module = event.module or "<root>"
    if "nan" in event.made_kind:  # the Inf went on into arithmetic: inf - inf or 0 x inf
        summary = (f"{op.op} {op.place}{op.at} wrote Inf on purpose (a mask or padding value), "
                   f"and module '{module}' made NaN of it (inf - inf or 0 x inf) from its "
                   f"{event.role}: nothing overflowed.")
        return Diagnosis("masked-row", summary, evidence,
                         fixes.written_inf_made_nan(module, op.op, op.at), confidence="high")
    summary = (f"{op.op} {op.place}{op.at} wrote Inf on purpose (a mask value), and module "
               f"'{module}' has it in its {event.role}: nothing overflowed.")
    return Diagnosis("masked-row", summary, evidence,
                     fixes.written_inf(holding, op.op, op.at), confidence="high")


def _from_op(facts: Facts) -> Diagnosis | None:
    op = facts.op
    if op is None or op.in_loss:
        return None
    if _writes_inf(op):
        return _written_inf(facts, op)
    found = _classify_op(op, getattr(facts.trace, "earlier_inf", None))
    if found is None:
        return None
    kind, reason, confidence = found
    evidence = _op_evidence(op)
    event = facts.event
    rows = _op_rows(facts, op) if kind != "masked-row" else []
    zero_variance = _zero_variance(op) if kind == "domain" else None
    if rows and zero_variance is not None and zero_variance[1]:
        evidence.append(f"The NaN/Inf is in {fixes.rows_named(rows, 12)} of the batch "
                        "(a sample whose values are all equal there).")
    elif rows:
        evidence.append(_rows_evidence(op, rows, facts.batch_size()))
    in_rows = _rows_words(rows, facts.batch_size())
    if kind == "masked-row":
        rows = _rows_masked(facts)
        suggestion = fixes.masked_row()
        if rows and not _left_padded(facts, rows):
            masks = [i.role for i in facts.inputs if i.masked_rows]
            evidence.append(f"Rows {', '.join(map(str, rows[:12]))} of the batch have a fully "
                            f"masked {', '.join(masks)}.")
        else:  # no sequence is all padding: the samples whose softmax rows came out NaN
            rows = _op_rows(facts, op)
            if rows:
                evidence.append(_rows_evidence(op, rows, facts.batch_size()))
                padded = _left_padded(facts, rows)
                if padded:
                    evidence.append(padded)
                    suggestion = fixes.masked_left_padding(op.at)
            rows = _samples_at_fault(rows, facts.batch_size())
        return Diagnosis("masked-row", f"{op.op} {op.place}{op.at} ran over rows that were "
                                       f"all -inf: {reason}.", evidence, suggestion,
                         rows=rows, confidence=confidence)
    if kind == "domain":
        # A mean over an empty selection (a loss over no counted target has its own fixes).
        empty = bool(op.inputs) and op.inputs[0].get("numel") == 0 \
            and op.name not in _COUNTED_MEAN_LOSSES
        suggestion = fixes.domain(op.grad_of_name or op.op,
                                  op.at, backward=op.phase == "backward", empty=empty,
                                  unused_gradient=bool(op.grad_of) and _unused_gradient(op),
                                  negative_running_var=_negative_running_var(op) is not None,
                                  hint=_density_hint(op) if op.phase != "backward" else "",
                                  masked_on_line=_masked_on_line(op))
        uncounted = _no_counted_label(facts, op)
        if uncounted is not None:  # the data's fixes, not an edit of transformers' loss
            reason, suggestion = uncounted, fixes.no_counted_label()
        if _in_log_prob(op):  # the op's line has no log of the user's: the parameter is at fault
            suggestion = fixes.distribution_parameter(op.at) + suggestion
        return Diagnosis("domain", f"{op.op} {op.place}{op.at} got values outside its domain"
                                   f"{in_rows}: {reason}.", evidence, suggestion,
                         rows=_samples_at_fault(rows, facts.batch_size()), confidence=confidence)
    masks = _masks_summed(op)
    if masks is not None:  # masks at the dtype's lowest: no growth made it
        return _summed_masks(facts, op, evidence, both=masks)
    # An overflow: divergence when the weights grew over the batches before.
    modules = [op.module, event.module, ""]
    grew = _weights_growth(facts)
    if grew is not None:
        climb = _divergence_evidence(facts, grew)
        evidence = climb + _activation_lines(facts, modules) + evidence
        grown = _grown_modules(facts)
        if grown:
            evidence.insert(len(climb), f"Grown most since first measured: {', '.join(grown)}.")
        suggestion = _divergence_fixes(facts, grew, op.dtype)
        hint = _density_hint(op) if op.phase != "backward" else ""
        if hint in ("log-scale", "softmax"):  # what keeps that exp finite while training moves
            suggestion[2:2] = fixes.overflow(op.module, op.dtype, op.at, op.name, hint=hint)[:1]
        return Diagnosis(
            "divergence",
            f"{grew.diverged}: the weights grew {grew.told}"
            f", until {op.op} {op.place}{op.at} overflowed at batch "
            f"{event.batch}{in_rows} ({reason}).", evidence,
            _learned_scale(op, evidence, suggestion),
            rows=_samples_at_fault(rows, facts.batch_size()), confidence=grew.sure("high"))
    evidence = evidence + _activation_lines(facts, modules)
    evidence.extend(_no_history(facts))
    suggestion = fixes.overflow(op.module, op.dtype, op.at, op.name,
                                tiny_denominator=_tiny_denominator(op) is not None,
                                hint=_density_hint(op) if op.phase != "backward" else "",
                                policy_dtype=facts.policy_dtype)
    compounded = _compounded_calls(facts, op.module or event.module)
    if compounded is not None and op.phase != "backward":
        module, calls, growth = compounded
        evidence.append(f"'{module}' ran {calls} times in batch {event.batch} before the call "
                        "whose outputs overflowed, and "
                        + _growth_line("its outputs' abs max", growth).replace(
                            "per batch from batch", "per call from call").replace(
                            "to batch", "to call")
                        + "; the values compounded over its calls within the forward.")
        suggestion = fixes.compounded(module, gradual=growth.per_batch < 1.05) + suggestion
    weight = _weight_gradient(facts) if op.phase == "backward" else None
    if weight is not None:  # a weight's gradient: what its frames tell comes too
        evidence.extend(weight.evidence)
        # Its fixes only: the op's (a stable form of its sum, scaled attention scores) are for
        # an op of the forward, not autograd's sum of a weight's gradient over the batch.
        suggestion = weight.suggestion
    suggestion = _learned_scale(op, evidence, suggestion)
    return Diagnosis("overflow", f"{op.op} {op.place}{op.at} overflowed {op.dtype}{in_rows}: "
                                 f"{reason}.", evidence, suggestion,
                     rows=_samples_at_fault(rows, facts.batch_size()), confidence=confidence)


def _first_nan_op(trace: object) -> object:
    """The first forward op row of the trace whose output holds NaN (None when none does)."""
    ops = getattr(trace, "ops", None)
    if ops is None or not len(ops):
        return None
    made = ops[(ops["phase"] == "forward") & ops["nan"]]
    return None if made.empty else made.iloc[0]


def _masked_by_input(facts: Facts) -> Diagnosis | None:
    """A NaN made from a -inf mask passed in (a float key_padding_mask, the causal mask of
    nn.Transformer.generate_square_subsequent_mask): a softmax over a row the masks block
    everywhere. The op that turned it into NaN is the trace's first NaN: its first_bad when
    the event's module made the NaN from the mask it received (the trace follows its output),
    else the replay followed the NaN back to the mask, which no op made (no first_bad)."""
    event = facts.event
    masks = [i for i in facts.inputs if i.mask]
    if event.is_backward or "nan" not in event.made_kind or not masks \
            or any(i.nan or (i.inf and not i.mask) for i in facts.inputs):
        return None
    roles = {i.role for i in masks}
    made = _first_nan_op(facts.trace)
    if made is None or not masks_rows(str(made["op"]).lstrip("_")):
        return None
    if facts.op is not None:
        if event.origin != "input" or facts.op.phase != "forward" \
                or facts.op.op != str(made["op"]) or facts.op.module != str(made["module"]):
            return None
    else:
        came = getattr(facts.trace, "came_with", None) or []
        if not came or any(kind != "input" or name not in roles for kind, name in came):
            return None  # the replay did not trace the value back to the masks alone
    module = str(made["module"]) or "<root>"
    kind = f" ({made['module_type']})" if made["module_type"] else ""
    at = f" at {made['source']}" if made["source"] else ""
    shown = ", ".join(sorted(roles))
    rows = _rows_masked(facts)
    fully = sorted({i.role for i in facts.inputs if i.masked_rows})
    evidence = [f"{i.role} ({i.dtype} {i.shape}): {i.inf} -inf and no NaN: a mask (-inf where "
                "masked), not data." for i in masks]
    if rows:
        named = fixes.rows_named(rows, 12)
        evidence.append(f"{named[0].upper()}{named[1:]} of the batch "
                        f"{'has' if len(rows) == 1 else 'have'} a fully masked "
                        f"{', '.join(fully)}.")
        why = (f"{fixes.rows_named(rows, 8)} of the batch {'is' if len(rows) == 1 else 'are'} "
               f"fully masked ({', '.join(fully)})")
    else:
        why = "the masks together block every position of a row"
    return Diagnosis("masked-row",
                     f"{made['op']} in module '{module}'{kind}{at} ran over rows that were all "
                     f"-inf: {why}, and a row whose scores are all -inf gives 0/0 = NaN. The "
                     f"-inf came with the mask passed in ({shown}), not with bad data.",
                     evidence, fixes.masked_row(), rows=rows,
                     confidence="high" if rows else "medium")


def _masks_summed(op: OpFacts) -> bool | None:
    """Whether an add overflowed to -inf because an operand is a mask filled with the dtype's
    lowest value (``torch.finfo(dtype).min``, within 1%) and the other is below 0:
    True when both are such masks (min + min is -inf in every dtype, as the mask follows the
    dtype), False when only one is; None for any other overflow."""
    if op.name != "add" or not op.inf or op.inputs_hold_inf() or len(op.inputs) < 2:
        return None
    limit = op.limit
    lows = [float(row.get("min", math.nan)) for row in op.inputs[:2]]
    if not math.isfinite(limit) or any(low != low for low in lows) or sum(lows) >= -limit:
        return None
    lowest = [low <= -limit * 0.99 for low in lows]  # activations rarely land right there
    return all(lowest) if any(lowest) else None


def _summed_masks(facts: Facts, op: OpFacts, evidence: list[str], both: bool) -> Diagnosis:
    """An add of masks filled with the dtype's lowest value (or of one such mask and scores
    below 0) that passed it: -inf, and a row whose every score became -inf gives NaN in the
    softmax after it. The fixes combine the masks without adding them."""
    lowest = -op.limit
    what = ("two operands at that value were added (masks combined by adding them): min + min "
            "is -inf" if both else "an operand at that value (a mask) was added to values "
                                   "below 0, which pushes it past the lowest: -inf")
    evidence = evidence + [
        f"Operands of {op.op} reach {op.dtype}'s lowest value ({lowest:.5g} = "
        f"torch.finfo(torch.{op.dtype}).min, what masks are filled with): {what}."]
    rows = _rows_masked(facts)
    if rows:
        fully = sorted({i.role for i in facts.inputs if i.masked_rows})
        named = fixes.rows_named(rows, 12)
        evidence.append(f"{named[0].upper()}{named[1:]} of the batch "
                        f"{'has' if len(rows) == 1 else 'have'} a fully masked "
                        f"{', '.join(fully)}: with every score -inf, a softmax over "
                        f"{'it' if len(rows) == 1 else 'them'} is 0/0 = NaN.")
    return Diagnosis(
        "overflow", f"{op.op} {op.place}{op.at} overflowed {op.dtype}: " + (
            f"it added masks filled with {op.dtype}'s lowest value ({lowest:.5g}), and min + "
            "min passed it: -inf." if both else
            f"it added a mask filled with {op.dtype}'s lowest value ({lowest:.5g}) to values "
            "below 0 (scores), and the sum passed it: -inf."),
        evidence, fixes.summed_masks(op.at, both), rows=rows, confidence="high")


def _from_frames(facts: Facts) -> Diagnosis | None:
    """Without the op: what the event's own frame shows."""
    event = facts.event
    frames = event.frames
    if event.is_backward or frames is None or frames.empty or event.origin not in ("output", "input"):
        return None
    own = frames[(frames["frame"] == event.frame) & (frames["batch"] == event.batch)
                 & (frames["phase"] == "forward")]
    outputs = own[own["role"].str.startswith("output")]
    inputs = own[own["role"].str.startswith(("input", "kwarg:"))]
    if outputs.empty:
        return None
    label = f"module '{event.module_label}' ({event.module_type})"
    softmax_like = (event.module_type in _SOFTMAX_MODULES or "Attention" in event.module_type)
    if softmax_like and bool(outputs["nan"].any()) and (bool(inputs["inf"].any())
                                                       or _rows_masked(facts)):
        rows = _rows_masked(facts)
        return Diagnosis("masked-row", f"{label} made NaN from masked inputs: a row whose "
                                       "scores are all -inf (fully masked) gives 0/0 = NaN in "
                                       "its softmax.",
                         [f"Rows {', '.join(map(str, rows[:12]))} of the batch are fully "
                          "masked."] if rows else [], fixes.masked_row(), rows=rows,
                         confidence="medium")
    if event.origin == "output" and bool(outputs["inf"].any()) and not bool(outputs["nan"].any()):
        dtype = str(outputs["dtype"].iloc[0])
        largest = float(inputs["finite_abs_max"].max()) if len(inputs) else math.nan
        evidence = []
        if largest == largest:
            evidence.append(f"Its inputs reached {_g(largest)} ({_limit_text(dtype)}).")
        # Its own parameters and buffers: a product of small inputs and huge weights overflows.
        weights = own[~own["role"].str.startswith(("input", "kwarg:", "output"))
                      & own["dtype"].astype(str).str.contains("float")]  # not a step count
        heaviest = float(weights["finite_abs_max"].max()) if len(weights) else math.nan
        if heaviest == heaviest:
            role = str(weights.loc[weights["finite_abs_max"].idxmax(), "role"])
            evidence.append(f"Its weights reached {_g(heaviest)} ({role}).")
        evidence += _activation_lines(facts, [event.module, ""])
        grew = _weights_growth(facts)
        if grew is not None:
            return Diagnosis(
                "divergence", f"{grew.diverged}: the weights grew {grew.told}, "
                              f"until {label} overflowed "
                              f"{dtype} at batch {event.batch}.",
                _divergence_evidence(facts, grew) + evidence,
                _divergence_fixes(facts, grew, dtype), confidence="medium")
        if facts.weights_unseen:  # an Inf in a weight nothing measured looks the same
            evidence.append(f"{facts.unseen_note[0].upper()}{facts.unseen_note[1:]}.")
        return Diagnosis("overflow", f"{label} made ±inf from finite inputs"
                                     f"{'' if facts.weights_unseen else ' and weights'}: a "
                                     f"result passed {dtype}'s largest value "
                                     f"({dtype_max(dtype):.5g}).",
                         evidence, (_unseen_fixes(facts) if facts.weights_unseen else [])
                         + fixes.overflow(event.module, dtype, "", "its op",
                                          policy_dtype=facts.policy_dtype),
                         confidence="low" if facts.weights_unseen else "medium")
    return None


def _weight_gradient(facts: Facts) -> Diagnosis | None:
    """Without the op: a parameter's gradient that overflowed while the gradient the module
    received stayed finite (a weight's gradient sums input x gradient over the whole batch, so
    it can pass the dtype's largest where no activation or ``grad_input`` does)."""
    event = facts.event
    frames = event.frames
    if not event.is_backward or event.origin != "grad" or event.made_kind != "inf" \
            or event.role.startswith("grad_") or frames is None or frames.empty:
        return None
    own = frames[(frames["frame"] == event.frame) & (frames["batch"] == event.batch)]
    mine = own[own["role"] == event.role]
    received = own[own["role"].str.startswith("grad_output")]
    if mine.empty or bool(received["nan"].any()) or bool(received["inf"].any()):
        return None
    dtype = stored = str(mine["dtype"].iloc[0])
    # Under autocast a float32 parameter's gradient is computed in the float16 the module's
    # gradients flow in, then accumulated as float32: it overflowed float16's largest.
    for received_dtype in received["dtype"].dropna().astype(str).unique():
        if dtype_max(received_dtype) < dtype_max(dtype):
            dtype = received_dtype
    name = event.qualified_role
    label = f"module '{event.module_label}' ({event.module_type})"
    evidence = []
    received_max = inputs_max = None
    if len(received) and received["abs_max"].notna().any():
        received_max = float(received["abs_max"].max())
        evidence.append(f"The gradient that {label} received was finite: abs max "
                        f"{_g(received_max)}.")
    forward = frames[(frames["batch"] == event.batch) & (frames["phase"] == "forward")
                     & (frames["module"] == event.module) & (frames["call"] == event.call)
                     & frames["role"].str.startswith(("input", "kwarg:"))]
    if len(forward) and forward["finite_abs_max"].notna().any():
        inputs_max = float(forward["finite_abs_max"].max())
        evidence.append(f"Its inputs in the forward reached {_g(inputs_max)}.")
    computed = f" (computed in {dtype}, stored as {stored})" if dtype != stored else ""
    evidence.append(f"The gradient of '{name}' sums over the batch (a weight's: input x "
                    f"gradient); it passed {dtype}'s largest value ({dtype_max(dtype):.5g})"
                    f"{computed}.")
    return Diagnosis("overflow", f"The gradient of '{name}' overflowed {dtype} in the backward "
                                 f"pass of batch {event.batch}: the gradient that {label} "
                                 "received was finite, its sum over the batch was not.",
                     evidence, fixes.weight_gradient_overflow(
                         event.module, dtype, received_max, inputs_max,
                         bias=event.role.rpartition(".")[2] == "bias",
                         policy_dtype=facts.policy_dtype),
                     confidence="medium")


def _unknown(facts: Facts, replayable: bool) -> Diagnosis:
    event, op = facts.event, facts.op
    evidence = []
    if op is not None and facts.unseen_quantized:  # the op read weights nothing measured
        summary = (f"{op.op} {op.place}{op.at} made {_kind_words(event.made_kind)} from finite "
                   f"inputs and weights the watch could not read, which may hold it.")
        evidence = _op_evidence(op) + [f"{facts.unseen_note[0].upper()}"
                                       f"{facts.unseen_note[1:]}."]
    elif op is not None:
        summary = (f"{op.op} {op.place}{op.at} made {_kind_words(event.made_kind)} from finite "
                   "inputs, in a way none of the known patterns explains.")
        evidence = _op_evidence(op)
    else:
        summary = (f"{_kind_words(event.made_kind)} first seen at module '{event.module_label}' "
                   f"({event.module_type}), {event.role}: {event.origin_words}; what made it "
                   "could not be told.")
        why = getattr(facts.trace, "why_not_reproduced", None)
        reason = why() if callable(why) else ""
        if reason:
            evidence.append(f"The replay did not reproduce it: {reason}.")
        elif event.note:
            evidence.append(event.note[0].upper() + event.note[1:] + ".")
        reader = _read_from_outside(facts.trace)
        if reader is not None:
            evidence.append(f"No op of the replay made it: {reader['op']} in module "
                            f"'{reader['module'] or '<root>'}'"
                            f"{' at ' + reader['source'] if reader['source'] else ''} read it from a "
                            "tensor made outside the replay, not the batch's input nor a "
                            "parameter or buffer (a plain tensor attribute, one kept from an "
                            "earlier batch, or memory never written).")
        if facts.replay_refused and facts.replay_refused not in event.note:  # said once
            evidence.append(f"No replay was made to name the op: {facts.replay_refused}.")
        if facts.replays_spent:
            evidence.append(f"No replay was made to name the op: a watch replays at most "
                            f"{facts.replays_spent} batches for its diagnoses, and earlier events "
                            "used them.")
        if facts.same_place is not None:
            earlier = facts.same_place
            evidence.append(f"The event of batch {earlier.batch} at the same module and role "
                            f"was diagnosed as {earlier.diagnosis.kind}: "
                            f"{earlier.diagnosis.summary}")
    if facts.outside_pass:
        outside = facts.outside_pass
        evidence.append(f"Module '{outside}' ran outside the model's forward (called directly): "
                        "its inputs are not held, and a replay runs the model's forward only.")
        suggestion = [f"Watch module '{outside}' as a model of its own, instead of this "
                      f"watch (w.close(), then nw.watch(model.get_submodule('{outside}'))): its "
                      "inputs are then held, bad data in them is named with its rows, and its "
                      "batches can be replayed."]
    else:
        # replay_on_nan=True already replayed it (a backward only with the loss): no replay
        # to suggest.
        traced = event.trace is not None and (not event.is_backward or facts.has_loss_fn)
        suggestion = fixes.unknown(event.batch, replayable, backward=event.is_backward,
                                   refused=bool(facts.replay_refused),
                                   sharded=facts.replay_refused_sharded, traced=traced,
                                   written=facts.replay_refused_written)
    if facts.weights_unseen:
        trace = facts.trace
        if trace is not None and trace.reproduced:
            evidence.append("The replay made it again, and no op made it from finite values: "
                            "it came with a tensor the watch does not measure.")
            suggestion = []  # a replay says no more
        suggestion = _unseen_fixes(facts) + suggestion
    return Diagnosis("unknown", summary, evidence, suggestion, confidence="low")


def _read_from_outside(trace: Any) -> Any:
    """The op row (of a trace with no first bad op) that read the NaN/Inf from a tensor no
    traced op made and the watch cannot name, or None."""
    reader = trace.first_reader() if hasattr(trace, "first_reader") else None
    if reader is None or not trace.came_with \
            or any(kind != "unknown" for kind, _ in trace.came_with):
        return None
    return reader


def _unseen_fixes(facts: Facts) -> list[str]:
    """The fixes of an event whose module reads weights the watch did not measure."""
    module = facts.event.module_label
    return fixes.unchecked_quantized_weights(module) if facts.unseen_quantized \
        else fixes.unseen_weights(module)


def _adapter_state(facts: Facts, found: Diagnosis) -> None:
    """A forward event in a batch run with the model's adapters switched off, or with other
    adapters than the ones it trains: say which forward it was (a trainer that calls the model
    twice per step numbers them only), and which adapters took part in it."""
    batch = facts.event.batch
    how = "".join([", under torch.no_grad()" if facts.ran_with_grad is False else "",
                   ", in eval mode" if facts.ran_in_train_mode is False else ""])
    if facts.adapters_disabled:
        found.summary += (f" Batch {batch} ran with the adapters disabled: the base model alone "
                          "(a reference forward).")
        found.evidence.insert(0, (
            f"Batch {batch} ran with the model's adapters disabled (peft's `with "
            f"model.disable_adapter():`{how}): the base model alone, the reference forward that "
            "DPO without a ref_model, or a KL term against the base model, runs each step. The "
            "adapter layers (LoRA's lora_A, lora_B) did not run in it: the value comes from the "
            "base model's weights or the batch."))
        return
    active = ", ".join(f"'{name}'" for name in facts.adapters_switched)
    watched = ", ".join(f"'{name}'" for name in facts.adapters_watched) or "none"
    found.summary += (f" Batch {batch} ran with adapter {active} active, not {watched} "
                      "(a reference forward).")
    found.evidence.insert(0, (
        f"Batch {batch} ran with adapter {active} active (peft's set_adapter(){how}), where "
        f"{watched} was active when the model was watched: the reference forward that TRL's "
        "DPO runs on a copy of the adapter named 'ref' when it trains an adapter the model "
        f"already had. The layers of {active} ran in it, not those of {watched}."))


def _quantized_weight(facts: Facts, found: Diagnosis) -> None:
    """A weight event whose weight no hook reads, measured at the event (a torch.ao module's
    packed weight, a torchao weight dequantized): where quantized weights come from leads the
    fixes."""
    event = facts.event
    frames = event.frames
    if event.origin != "weight" or frames is None or frames.empty or "note" not in frames:
        return
    own = frames[(frames["frame"] == event.frame) & (frames["batch"] == event.batch)
                 & (frames["role"] == event.role)]
    if own.empty or own["note"].iloc[0] not in (PACKED, DEQUANTIZED):
        return
    found.evidence.append(f"'{event.qualified_role}' is a quantized weight no hook reads: "
                          f"{'unpacked' if own['note'].iloc[0] == PACKED else 'dequantized'} "
                          "and measured at the event.")
    found.suggestion[:0] = fixes.quantized_weight(event.module_label, event.role)


def diagnose(facts: Facts, *, replayable: bool = True) -> Diagnosis:
    """The diagnosis of ``facts.event`` (see the module docstring for the order of the rules).
    ``replayable``: whether the event's batch can still be replayed (for the suggestions)."""
    event = facts.event
    if event.origin == "peer":
        if event.diagnosis is not None:
            return event.diagnosis
        return Diagnosis("unknown", f"Rank {event.peer_rank} found it; its own diagnosis is in "
                                    "its recording and its report.", [],
                         [f"Read rank {event.peer_rank}'s report (nw.load_run(log_dir).events)."],
                         confidence="low")
    found = None
    for rule in (_after_forward, _carried_state, _after_earlier_pass, _accumulated_gradient,
                 _from_another_rank,
                 _scaled_gradient, _loss_module, _loss_module_output, _loss, _bad_data,
                 _loss_value, _weights,
                 _masked_by_input, _from_op, _from_frames, _weight_gradient):
        found = rule(facts)
        if found is not None:
            break
    found = found or _unknown(facts, replayable)
    if facts.made_outside_forward:
        roles = [i.role for i in facts.inputs if i.nan or i.inf]
        held = ", ".join(roles[:2]) + (f" (and {len(roles) - 2} more)" if len(roles) > 2 else "")
        found.evidence.append(
            f"Module '{event.module}' did not run in the forward of batch {event.batch}, whose "
            f"{held} held NaN/Inf: a call of it outside the forward made them (generate() runs "
            "the encoder or the vision tower once, before the forwards), not the data.")
    run = facts.scaler_run
    if run is not None and found.kind not in ("overflow", "divergence") \
            and not any(line.startswith(f"The {run.scaler} skipped") for line in found.evidence):
        skipped = _skipped_words(run)
        found.evidence.append(f"{skipped[0].upper()}{skipped[1:]}: "
                              f"a {_kind_words(event.made_kind)} gradient at every scale does not "
                              "come from the scale.")
    _quantized_weight(facts, found)
    if facts.adapters_disabled or facts.adapters_switched:
        _adapter_state(facts, found)
    if facts.absorbed_in:
        _absorbed(facts, found)
    op = facts.op
    if op is not None and getattr(facts.trace, "first_bad", None) is not None:
        where = f"at {op.source}" if op.source else NO_USER_LINE
        found.op = f"{op.op} {where}"
    return found


def _absorbed(facts: Facts, found: Diagnosis) -> None:
    """A forward event whose model outputs stayed finite: say so (a run without a watch goes
    on, so this is what the user sees), and, for an Inf, how to let the model absorb it."""
    event, modules = facts.event, facts.absorbed_in
    what = "NaN" if event.made_kind == "nan" else ("Inf" if event.made_kind == "inf" else "NaN/Inf")
    shown = ", ".join(f"'{m}'" for m in modules[:8]) + (", ..." if len(modules) > 8 else "")
    # An exponential's slope at its overflow is inf: the gradient through it is NaN even
    # where a later op clamped the value, so a training step does not go on.
    exponential = facts.op.name if facts.op is not None and facts.op.name in _EXP_OPS else ""
    goes_on = ("so a run without a watch goes on, with those values changed" if not exponential
               else f"so the forward goes on; but {exponential}'s slope at its overflow is inf, "
                    "so the gradient through it is NaN and a training step writes NaN")
    found.evidence.append(
        f"The model's outputs stayed finite in batch {event.batch}: a later op clamped, masked "
        f"or replaced the {what} ({goes_on}). Outputs that held it: {shown}.")
    if event.made_kind == "inf" and not exponential:
        names = ", ".join(f"'{m}'" for m in modules)
        # Sentinel mode is this watch already; and a forward that absorbs an Inf can still
        # give NaN gradients (the slope of exp at its overflow times a 0 is NaN).
        sentinel = "" if facts.sentinel else \
            ", or mode='sentinel', which checks the model's outputs only"
        found.suggestion.append(
            "If the model absorbs this Inf on purpose (transformers' T5 clamps float16 "
            f"overflows after each block), let those outputs hold ±inf: nw.watch(model, "
            f"allow_inf=[{names}]) (NaN still counts; name globs work too){sentinel}. In "
            "training, a backward pass through the Inf can still make NaN gradients (exp's "
            "slope at the overflow times 0): keep backward=True to see them, and prefer "
            "keeping the value finite.")

"""Early warning: say, before a value overflows, which module's output is heading there.

Two reasons, each given once per module (a warning never stops the run):

- ``"near-limit"``: an output's largest finite |x| is within a factor :data:`NEAR_FACTOR` (4)
  of its dtype's largest value (``torch.finfo(dtype).max``: float16 65504, bfloat16 and float32
  3.4e38). A value at its dtype's very extreme is a mask written on purpose (``finfo.min``) and
  does not count.
- ``"growth"``: a module's output abs max has grown geometrically, so that at the fitted rate it
  would pass its dtype's largest within :data:`HORIZON` (50) batches. Healthy training also
  grows its activations (logits sharpen, early transients), but slower and not for long; what
  counts as growth here is what a blow-up looks like and healthy runs do not (the tuning is
  written up in the README):

  * the abs max rose in each of the last :data:`MIN_RISES` (3) measured batches;
  * the rate is a robust fit (the median of the pairwise slopes of log abs max against the
    batch number, Theil-Sen) over that run of rises, its last :data:`WINDOW` (8) batches at
    most, and is at least :data:`MIN_GROWTH` (2x) per batch. Slower growth is left to the
    near-limit check, which a value growing at under 2x per batch meets more than two batches
    before it overflows; in float32 a value growing that slowly needs over 100 batches from 1
    to the limit anyway;
  * the abs max is at least :data:`GROWTH_FLOOR` (1): a fresh model's outputs leaving a small
    initialisation climb at 2-4x per batch for a few batches, far below any limit; and the
    rate is fitted over the run's values of at least 1/16 only (a climb from near zero,
    2e-7 to 1 in three batches, is no rate), three of them at least;
  * growth counts from the highest value the series held in the :data:`RECENT` (32) to 64
    batches before the run began: a climb back to where it has been is no growth. An input
    whose scale changes from batch to batch (a diffusion model trained at one random noise
    level per batch) rises three batches in a row by chance, from a low batch to a high one;
  * the rate is the slower of the fit and the run's latest rise: a run that is slowing down
    (a jump out of the first batches' transient, 12 -> 184 -> 313 -> 360, or a fresh
    LayerScale gain's 0.4 -> 8 -> 16) is levelling off, not heading for the limit, and a
    blow-up keeps its pace;
  * the batches are of one mode: training and evaluation forwards (``model.train()``,
    ``model.eval()``) are two series, each with its own runs (BatchNorm's running statistics
    can put the first evaluation outputs far above the training ones: a step, not a growth);
  * of the forwards inside one optimizer step (a closure the optimizer calls, LBFGS up to
    ``max_iter`` times and more per step), the first only: it measures the model as the last
    step left it. The others try points the optimizer may turn away from (a strong-Wolfe line
    search lengthens its trial step up to tenfold per call), whose outputs grow fast in a
    healthy fit;
  * counted by optimizer step too, where the steps are many batches apart (an RL loop calls its
    policy once per rollout step, 64 or 2048 forwards between its updates: by batch, a policy
    whose actions grow 1000x per update of 4 steps grows 1.1x per batch and rises once per
    update). When a step has ended, each mode's batches since the last one that were two or
    more become one point, their largest abs max per module (read from the history then, not
    per batch), numbered by the optimizer steps taken, and the checks above run over these
    points: 3 rises, 2x per step, 50 steps to the limit. Such a warning says "per optimizer
    step" (``EarlyWarning.per``); a run with a step per batch has the series by batch alone.

Where the numbers come from: nothing is measured for this, and nothing is read from a device.
Full mode reads each finished batch's history row (the largest |x| of every module's outputs,
which the recorder folds anyway: a few Python comparisons per module) and looks in the batch's
frames only for a module that could warn (its exact value, output role and dtype); sentinel
mode reads the root's outputs, which the sentinel measures every batch, and every module on
the batches it records in full (``sample_every``). A batch whose outputs already hold a
NaN/Inf gets no warning: its event says more. Of a module and a container around it that warn
for the same reason in the same batch (the same values handed up), the innermost speaks.

The records are :class:`EarlyWarning` (``w.warnings``); each is also issued once as a Python
warning of category :class:`EarlyWarningIssued`, outside the recorder's lock, when the batch's
check ends (a filter that turns it into an error does not stop the run).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .frames import Frame
from .recorder import Feature, Recorder
from .sourcelines import user_stacklevel
from .state import optimizer_steps
from .stats import dtype_max, growth_rate
from .writes import step_in_progress

__all__ = ["EarlyWarning", "EarlyWarningIssued", "EarlyWarnings", "REASONS", "NEAR_FACTOR",
           "HORIZON", "WINDOW", "MIN_RISES", "FOLD_BATCHES", "MIN_GROWTH", "GROWTH_FLOOR", "RECENT", "growth_rate",
           "WARNING_FIELDS", "WARNING_DEFAULTS", "PERS", "warning_fields",
           "warning_from_fields"]

REASONS = ("near-limit", "growth")
# Growth is also counted by optimizer step where the steps are this many batches apart or more
# (an RL loop's rollout forwards between its updates): below that the dilution is small, and
# a fold (about 5 us in sentinel mode for two batches) would cost every step of a loop with
# two forwards per step.
FOLD_BATCHES = 8
NEAR_FACTOR = 4.0  # "near-limit": within this factor of the dtype's largest value
HORIZON = 50  # "growth": would pass the dtype's largest within this many batches
WINDOW = 8  # the most batches the growth rate is fitted over
MIN_RISES = 3  # rises in a row before a growth is fitted
MIN_GROWTH = 2.0  # slowest growth per batch that counts (slower: the near-limit check)
# Below this abs max no growth is warned about: a value under 1 is 16 doublings from float16's
# largest (128 from float32's), and a fresh model's outputs leaving a small initialisation
# climb there at 2-4x per batch for a few batches (faster at first under momentum). A blow-up
# passes 1 with at least 8 batches to go at 4x per batch.
GROWTH_FLOOR = 1.0
# Points of a run below this are left out of the fitted rate (see EarlyWarnings._rate).
_FIT_FLOOR = GROWTH_FLOOR / 16
# Growth counts from the highest value a module's series held in the RECENT to 2 * RECENT
# batches before its run of rises began (the peaks of its earlier runs, kept in two buckets of
# RECENT batches): values that vary from batch to batch (a diffusion model's input at a random
# noise level per batch, 0.002 to 80) rise three times in a row by chance, from a low batch
# back up to where the series has been, at a fitted 2-4x per batch.
RECENT = 32
# A value this close to its dtype's largest is that extreme written on purpose (a mask filled
# with finfo.min), not a value that grew there: a growing value passes through the near zone.
_EXTREME = 1.0 / 1.01

_LOG_MIN_GROWTH = math.log(MIN_GROWTH)
_LOG_LARGEST = math.log(sys.float_info.max)  # math.exp() past it raises OverflowError


class EarlyWarningIssued(UserWarning):
    """Issued once per :class:`EarlyWarning`: an output is near its dtype's largest value, or
    growing towards it (the run goes on)."""


@dataclass(frozen=True)
class EarlyWarning:
    """An output heading for overflow, seen at ``batch``.

    ``reason``: "near-limit" (``abs_max`` within a factor 4 of ``limit``) or "growth" (the abs
    max grows ``growth_per_batch``-fold per batch, so that it passes ``limit`` in about
    ``batches_to_limit`` batches). ``role`` names the output ("output", "output[0]",
    "output.logits", ...); ``limit`` is the largest finite value of its ``dtype``.
    ``growth_per_batch`` and ``batches_to_limit`` are NaN when the value is not growing (a
    near-limit warning on a value seen once). ``per``: "batch", or "optimizer step" for a growth
    counted by optimizer step (steps many batches apart, see the module docstring): then
    ``growth_per_batch`` is the growth per step and ``batches_to_limit`` the steps to go.
    ``pd.DataFrame(w.warnings)`` tabulates them.
    """

    batch: int
    module: str
    role: str
    reason: str
    abs_max: float
    limit: float
    growth_per_batch: float
    batches_to_limit: float
    dtype: str = ""
    rank: int = 0
    per: str = "batch"

    @property
    def module_label(self) -> str:
        """The module as a user reads it: its name, or "<root>" for the model itself."""
        return self.module or "<root>"

    def summary(self) -> str:
        """One line: where, what, and how soon."""
        dtype = self.dtype or "its dtype"
        # A complex limit is a component's: |z| may pass it while both components are finite.
        largest = f"the largest {dtype} component {self.limit:.6g}" \
            if dtype.startswith("complex") else f"{dtype}'s largest {self.limit:.6g}"
        where = f"batch {self.batch}" + (f" on rank {self.rank}" if self.rank else "")
        what = f"{self.role} of '{self.module_label}' ({self.dtype})" if self.dtype else \
            f"{self.role} of '{self.module_label}'"
        if self.reason == "growth" and self.per == "optimizer step":
            when = f"in about {_steps(self.batches_to_limit)}" \
                if self.batches_to_limit >= 0.5 else "within the next optimizer step"
            text = (f"{what} grows {self.growth_per_batch:.3g}x per optimizer step (abs max "
                    f"{self.abs_max:.3g}, the largest of the batches between two steps); at that "
                    f"rate it passes {largest} {when}")
        elif self.reason == "growth":
            when = f"in about {_batches(self.batches_to_limit)}" \
                if self.batches_to_limit >= 0.5 else "within the next batch"
            text = (f"{what} grows {self.growth_per_batch:.3g}x per batch (abs max "
                    f"{self.abs_max:.3g}); at that rate it passes {largest} {when}")
        else:
            text = (f"{what} reached abs max {self.abs_max:.3g}, within a factor "
                    f"{NEAR_FACTOR:g} of {largest}")
            if self.batches_to_limit == self.batches_to_limit:
                # Under half a batch to go read "about 0 batches left": the next batch passes it.
                left = f"about {_batches(self.batches_to_limit)} left" \
                    if self.batches_to_limit >= 0.5 else "the next batch may pass it"
                text += f" (growing {self.growth_per_batch:.3g}x per batch: {left})"
        return f"early warning, {where}: {text}"

    def __str__(self) -> str:
        return self.summary()


# The fields a recording stores, with their JSON kinds (floats may be written as integers).
WARNING_FIELDS: dict[str, type | tuple[type, ...]] = {
    "batch": int, "module": str, "role": str, "reason": str, "abs_max": (int, float),
    "limit": (int, float), "growth_per_batch": (int, float), "batches_to_limit": (int, float),
    "dtype": str, "rank": int, "per": str}
# Fields a recording written before they existed lacks, with the value they had then.
WARNING_DEFAULTS: dict[str, Any] = {"per": "batch"}
PERS = ("batch", "optimizer step")


def warning_fields(warning: EarlyWarning) -> dict[str, Any]:
    """The fields of ``warning`` as plain data (what a recording writes)."""
    return {name: getattr(warning, name) for name in WARNING_FIELDS}


def warning_from_fields(fields: dict[str, Any]) -> EarlyWarning:
    """An :class:`EarlyWarning` from :func:`warning_fields` (checked by the caller)."""
    values = {name: fields[name] if fields.get(name) is not None else WARNING_DEFAULTS[name]
              for name in WARNING_FIELDS}
    for name in ("abs_max", "limit", "growth_per_batch", "batches_to_limit"):
        values[name] = float(values[name])
    return EarlyWarning(**values)


# ---------------------------------------------------------------------------- the fit
def _batches(count: float) -> str:
    """"1 batch", "12 batches" (rounded)."""
    shown = f"{count:.0f}"
    return f"{shown} batch" if shown == "1" else f"{shown} batches"


def _steps(count: float) -> str:
    """"1 optimizer step", "12 optimizer steps" (rounded)."""
    shown = f"{count:.0f}"
    return f"{shown} optimizer step" if shown == "1" else f"{shown} optimizer steps"


# ---------------------------------------------------------------------------- the feature
class EarlyWarnings(Feature):
    """The early-warning part of a watch (see the module docstring).

    ``root_output``: what reports the root's output magnitude each batch
    (:meth:`on_output_magnitude`), the sentinel: its ``outputs_dtype`` is their dtype; None
    outside sentinel mode.

    Per batch it reads the history row the recorder just filled (one number per module: the
    largest |x| of its outputs) and keeps, per module, the current run of rises; only a module
    whose value could warn (near its dtype's limit, or three rises with a fast one) is looked up
    in the batch's frames for its exact output, role and dtype. Module dtypes are read from the
    frames of the first batch, of every :data:`_DTYPES_EVERY`-th one, and of a module seen for
    the first time.
    """

    def __init__(self, recorder: Recorder, *, root_output: Any = None) -> None:
        self.recorder = recorder
        self.root_output = root_output
        #: Every warning so far, oldest first (once per module and reason).
        self.warnings: list[EarlyWarning] = []
        self._unissued: list[EarlyWarning] = []
        self._warned: set[tuple[str, str]] = set()
        self._said: list[tuple[int, str, float, str]] = []  # (batch, reason, abs max, module)
        self._names = list(recorder.module_names)
        self._index = {name: i for i, name in enumerate(self._names)}
        self._inf_allowed = frozenset(self._index[name] for name in recorder.inf_allowed
                                      if name in self._index)
        self._history = recorder.records.history
        # Per module, by index (plain lists: the per-batch pass touches as little as it can).
        count = len(self._names)
        self._last_batch = [-1] * count
        self._last_value = [math.inf] * count
        self._rises = [0] * count  # batches in a row whose abs max rose
        # Whether a rise in the current run was at least MIN_GROWTH per batch: the fitted rate
        # (a median of pairwise slopes, each an average of the steps between its two batches)
        # cannot exceed the fastest step, so without one there is nothing to fit.
        self._fast = [False] * count
        # (batch, abs max) of the current run of rises, its last WINDOW at most.
        self._runs: list[deque[tuple[int, float]]] = [deque(maxlen=WINDOW) for _ in range(count)]
        # (largest, near-limit threshold, extreme threshold) of the tightest float dtype of the
        # module's outputs (None: none seen); _near holds the threshold alone (inf: none known).
        self._module_limits: list[tuple[float, float, float] | None] = [None] * count
        self._near = [math.inf] * count  # inf also once its near-limit warning is made
        self._growth_said = [False] * count
        self._looked_up = [False] * count  # whether its frames were read for their dtypes
        # The highest peak of the module's earlier runs of rises (see RECENT): in the bucket of
        # RECENT batches _high_bucket, and in the bucket before it.
        self._high = [0.0] * count
        self._high_before = [0.0] * count
        self._high_bucket = [-2] * count
        # The lists above in one attribute: the per-batch pass loads them at once.
        self._state = (self._last_batch, self._last_value, self._rises, self._fast, self._runs,
                       self._near, self._growth_said, self._looked_up, self._high,
                       self._high_bucket)
        self._series = (self._last_batch, self._last_value, self._rises, self._fast, self._runs,
                        self._high, self._high_before, self._high_bucket)
        # dtype -> (largest value, near-limit threshold, extreme threshold); None: not a float
        self._dtype_limits: dict[Any, tuple[float, float, float] | None] = {}
        self._batches_seen = 0
        self._latest = -1  # the latest batch looked at: an earlier one is a replay's
        # The model's training flag in the batches looked at (None: none yet). Outputs of a
        # training and an evaluation forward are not one series: BatchNorm's running
        # statistics (a fresh model's far from its batch statistics) can put an evaluation
        # output orders of magnitude above the training ones, and dropout scales them.
        self._model = recorder.model
        self._training: bool | None = None
        self._other_series: tuple[list, ...] | None = None  # the other mode's, while away
        # Frames resolved within a batch (a flush), looked at with the batch's own.
        self._early: list[Frame] = []
        # .stepping: the optimizer step running now (0: none; one that raised is found over
        # by step_in_progress())
        self._steps = optimizer_steps()
        self._step_seen = (0, -1)  # (step, the batch looked at in it)
        # Counted by optimizer step (see the module docstring): the steps taken when the
        # batches since the last fold ended, and those batches as stretches of one mode each,
        # (training flag, first batch); whether one of them ran inside a step (a closure
        # called again): such a stretch is no point. Per mode, the series of folded points.
        self._fold_count = self._steps.count
        self._group: list[tuple[bool, int]] = []
        self._group_in_step = False
        self._by_step: dict[bool, _StepSeries] = {}
        self._outer = [-_depth(name) for name in self._names]  # sorts the innermost first

    # ------------------------------------------------------------------ under the lock
    def on_frames_resolved(self, frames: list[Frame]) -> None:
        # A flush within a batch: its forward frames are looked at with the rest of the batch.
        # Frames of the batch looked at last (a loss the model holds, run on its output after
        # the forward ended the batch) are looked at now, for the modules it did not have.
        latest = self._latest
        forward = [frame for frame in frames if frame.phase == "forward"]
        if any(frame.batch <= latest for frame in forward):
            self._look_late([frame for frame in forward if frame.batch == latest])
            forward = [frame for frame in forward if frame.batch > latest]
        self._early.extend(forward)

    def _look_late(self, frames: list[Frame]) -> None:
        """Frames of the batch looked at last that came after it ended: their modules' outputs
        are points of that batch's series (modules it looked at already are left as they
        were)."""
        try:
            batch, index, last_batches = self._latest, self._index, self._last_batch
            row: dict[int, list] = {}
            for frame in frames:
                position = index.get(frame.module)
                if position is None or last_batches[position] >= batch:
                    continue
                slot = row.setdefault(position, [-math.inf, math.inf, False])
                for entry in frame.outputs():
                    stats = entry.stats
                    if stats is not None:
                        if stats.abs_max == stats.abs_max:
                            slot[0] = max(slot[0], stats.abs_max)
                        slot[1] = min(slot[1], stats.abs_min)
                        slot[2] = slot[2] or stats.nan or stats.inf
            if row:
                self._look(batch, row, frames, late=True)
        except Exception as error:  # a warning must never break the run
            self.recorder.internal_error(error)

    def on_batch_end(self, batch: int, frames: list[Frame]) -> None:
        if self._early:
            frames, self._early = self._early + frames, []
        if not frames:
            return  # sentinel mode between sampled batches: on_output_magnitude reads the root
        if self._steps.count != self._fold_count:
            self._fold(batch)  # a step ended since the last batch
        if self._steps.stepping and step_in_progress() and self._again_in_step(batch):
            return
        try:
            row = self._history.current_row(batch)
            if row is None:
                return
            if self._batches_seen % _DTYPES_EVERY == 0:
                self._learn_dtypes(frames)
            self._batches_seen += 1
            if batch <= self._latest:
                self._restart()  # numbered again from lower down (set_batch): a new series
            if self._model.training != self._training:
                self._switched_mode(batch)
            self._look(batch, row, frames)
        except Exception as error:  # a warning must never break the run
            self.recorder.internal_error(error)

    def on_frames_replayed(self, frames: list[Frame]) -> None:
        """Frames a sentinel replay made (a compiled model's sampled batch, the batches around
        an event): each batch's largest outputs, as a history row would hold them."""
        try:
            rows: dict[int, dict[int, list]] = {}
            index = self._index
            for frame in frames:
                if frame.phase != "forward" or frame.module not in index:
                    continue
                slot = rows.setdefault(frame.batch, {}).setdefault(
                    index[frame.module], [-math.inf, math.inf, False])
                for entry in frame.outputs():
                    stats = entry.stats
                    if stats is not None:
                        slot[0] = max(slot[0], stats.abs_max if stats.abs_max == stats.abs_max
                                      else -math.inf)
                        slot[2] = slot[2] or stats.nan or stats.inf
            self._learn_dtypes(frames)
            for batch in sorted(rows):
                self._look(batch, rows[batch], frames)
        except Exception as error:  # a warning must never break the run
            self.recorder.internal_error(error)

    def on_output_magnitude(self, batch: int, module: str, abs_max: float,
                            abs_min: float) -> None:
        if self._steps.count != self._fold_count:
            self._fold(batch)  # a step ended since the last batch
        if self._steps.stepping and step_in_progress() and self._again_in_step(batch):
            return
        try:
            index = self._index.get(module)
            dtype = getattr(self.root_output, "outputs_dtype", None)
            limits = self._dtype_limits.get(dtype) or self._limits_of(dtype)
            if limits is None or index is None:
                return
            if limits is not self._module_limits[index]:
                self._tighten(index, limits)
                self._looked_up[index] = True  # its dtype comes from the sentinel
            if self._model.training != self._training and batch > self._latest:
                self._switched_mode(batch)
            last = self._last_value[index]
            if batch > self._latest and not 0 < last < abs_max < math.inf \
                    and not self._near[index] <= abs_max < math.inf:
                # Most batches: no rise, far from the limit (what _look does then, without
                # building a row for it).
                if self._rises[index]:  # a run of rises ended: its peak is the last value
                    self._peaked(index, last, self._last_batch[index])
                    self._rises[index] = 0
                    self._fast[index] = False
                self._latest = self._last_batch[index] = batch
                self._last_value[index] = abs_max
                return
            self._look(batch, {index: [abs_max, abs_min, False]}, (), (dtype, limits))
        except Exception as error:  # a warning must never break the run
            self.recorder.internal_error(error)

    def _again_in_step(self, batch: int) -> bool:
        """Whether ``batch`` ran inside an optimizer step that an earlier batch ran in too: a
        closure called again, at a point the optimizer tries (see the module docstring)."""
        stepping = self._steps.stepping
        step, seen = self._step_seen
        if step == stepping and seen != batch:
            self._group_in_step = True  # no point by step either
            return True
        self._step_seen = (stepping, batch)
        return False

    def _restart(self) -> None:
        """Forget every module's run of rises (the batch numbers started again)."""
        self._forget_runs()
        self._other_series = None
        self._latest = -1
        self._by_step = {}
        self._group = []
        self._training = None  # (the next batch starts a stretch of its mode)

    def _switched_mode(self, batch: int) -> None:
        """The model went from training to evaluation or back at ``batch``: each mode's
        batches are a series of their own, so the runs of this mode go on where it left them
        (a loop that evaluates between steps still has its training series) and the other's
        wait."""
        training = bool(self._model.training)
        self._group.append((training, batch))
        if self._training is not None:
            lists = self._series
            left = tuple(list(values) for values in lists)
            resumed, self._other_series = self._other_series, left
            if resumed is None:
                self._forget_runs()
                self._runs[:] = [deque(maxlen=WINDOW) for _ in self._runs]
            else:
                for values, saved in zip(lists, resumed):
                    values[:] = saved
        self._training = training

    def _fold(self, batch: int) -> None:
        """An optimizer step ended since the last batch looked at, ``batch`` the first after
        it: of each mode, the batches since the last fold become one point of its series by
        optimizer step (their largest abs max per module, read from the history), numbered by
        the steps taken when they ended, when there are :data:`FOLD_BATCHES` of them or more
        (a step every batch or every few, gradient accumulation or a GAN's two passes: the
        series by batch tells it, and no step pays for a fold) and none ran inside a step (a
        closure called again)."""
        count, self._fold_count = self._fold_count, self._steps.count
        stretches, self._group = self._group, [(bool(self._model.training), batch)]
        in_step, self._group_in_step = self._group_in_step, False
        if in_step or not stretches or batch - stretches[0][1] < FOLD_BATCHES:
            return  # (a step per batch: the series by batch tells it)
        try:
            spans: dict[bool, list[tuple[int, int]]] = {}
            ends = [first for _, first in stretches[1:]] + [batch]
            for (training, first), end in zip(stretches, ends):
                if first < end:
                    spans.setdefault(training, []).append((first, end))
            for training, ranges in spans.items():
                if sum(end - first for first, end in ranges) < FOLD_BATCHES:
                    continue
                row: dict[int, list] = {}
                for first, end in ranges:
                    for index, (high, low, nonfinite) in \
                            self._history.row_between(first, end).items():
                        slot = row.setdefault(index, [high, low, nonfinite])
                        slot[0], slot[1] = max(slot[0], high), min(slot[1], low)
                        slot[2] = slot[2] or nonfinite
                if not row:
                    continue
                # The innermost module first: of a module and a container handing on its
                # output, it speaks (see _warn).
                row = {index: row[index] for index in sorted(row, key=self._outer.__getitem__)}
                series = self._by_step.get(training)
                if series is None:
                    series = self._by_step[training] = _StepSeries(self)
                series.look(count, row, batch)
        except Exception as error:  # a warning must never break the run
            self.recorder.internal_error(error)

    def _forget_runs(self) -> None:
        count = len(self._names)
        self._last_batch[:] = [-1] * count
        self._last_value[:] = [math.inf] * count
        self._rises[:] = [0] * count
        self._fast[:] = [False] * count
        self._high[:] = [0.0] * count
        self._high_before[:] = [0.0] * count
        self._high_bucket[:] = [-2] * count

    def _peaked(self, index: int, value: float, batch: int) -> None:
        """Module ``index``'s run of rises ended at ``value`` in ``batch`` (a peak of its
        series): kept if it is the highest of its bucket of RECENT batches."""
        bucket = batch // RECENT
        known = self._high_bucket[index]
        if bucket == known:
            if value > self._high[index]:
                self._high[index] = value
            return
        if bucket > known:
            self._high_before[index] = self._high[index] if bucket == known + 1 else 0.0
            self._high[index] = value
            self._high_bucket[index] = bucket

    def _recent_high(self, index: int, batch: int) -> float:
        """The highest peak of module ``index``'s series in the RECENT to 2 * RECENT batches
        up to ``batch`` (0: none)."""
        bucket = batch // RECENT
        known = self._high_bucket[index]
        if known == bucket:
            return max(self._high[index], self._high_before[index])
        return self._high[index] if known == bucket - 1 else 0.0

    def _limits_of(self, dtype: Any) -> tuple[float, float, float] | None:
        limits = self._dtype_limits.get(dtype, False)
        if limits is False:
            limits = None
            complex_ = isinstance(dtype, torch.dtype) and dtype.is_complex
            real = dtype.to_real() if complex_ else dtype
            largest = dtype_max(real) if isinstance(real, torch.dtype) \
                and real.is_floating_point and real.itemsize > 1 else math.inf
            # float8 / float4 values are scaled to fill their format on purpose (and e4m3fn
            # saturates): no near-limit zone for them.
            if math.isfinite(largest):
                # A complex |z| reaches sqrt(2) times its components' largest before one of
                # them overflows: past the largest it is no mask written on purpose.
                extreme = largest * (math.sqrt(2.0) if complex_ else 1.0) * _EXTREME
                limits = (largest, largest / NEAR_FACTOR, extreme)
            self._dtype_limits[dtype] = limits
        return limits

    def _tighten(self, index: int, limits: tuple[float, float, float]) -> None:
        known = self._module_limits[index]
        if known is None or limits[0] < known[0]:
            self._module_limits[index] = limits
            if (self._names[index], "near-limit") not in self._warned:
                self._near[index] = limits[1]

    def _learn_dtypes(self, frames: Iterable[Frame]) -> None:
        """Each module's tightest float output dtype (float16 over float32 under autocast)."""
        index = self._index
        for frame in frames:
            position = index.get(frame.module)
            if frame.phase != "forward" or position is None:
                continue
            self._looked_up[position] = True
            for entry in frame.outputs():
                limits = self._limits_of(entry.dtype)
                if limits is not None:
                    self._tighten(position, limits)

    def _look(self, batch: int, row: dict[int, list], frames: Iterable[Frame],
              known: tuple[Any, tuple[float, float, float]] | None = None,
              late: bool = False) -> None:
        """A finished batch's row (module index -> [abs max, abs min, non-finite], as the
        history holds it): extend each module's run of rises, and check the few modules that
        could warn against the batch's frames for their exact output (``known``: the dtype and
        limits of the values when no frames say it, the sentinel's root). A batch with a
        NaN/Inf output warns about nothing. ``late``: modules of the batch looked at last, whose
        frames came after it (see :meth:`_look_late`).

        This runs for every module after every batch, so it keeps to local lists and numbers:
        a module whose abs max did not rise costs a few comparisons.
        """
        if batch <= self._latest and not late:
            return  # an earlier batch seen again (a replay): its points are in already
        self._latest = batch
        candidates = None
        tainted = False
        allowed = self._inf_allowed
        last_batches, last_values, rises_of, fast, runs, near, growth_said, looked_up, highs, \
            high_buckets = self._state
        inf = math.inf
        for index, slot in row.items():
            value = slot[0]
            if slot[2] and index not in allowed:
                tainted = True
            if not looked_up[index]:
                self._learn_dtypes(frames)  # a module seen for the first time
            last = last_values[index]
            last_values[index] = value
            last_batch = last_batches[index]
            last_batches[index] = batch
            if not 0 < last < value < inf:  # no rise: zero, nothing finite, or not larger
                if rises_of[index]:  # a run of rises ended: its peak is the last value
                    rises_of[index] = 0
                    fast[index] = False
                    if last_batch // RECENT != high_buckets[index]:
                        self._peaked(index, last, last_batch)  # (a new bucket)
                    elif last > highs[index]:
                        highs[index] = last
                if near[index] <= value < inf:
                    candidates = (candidates or []) + [index]
                continue
            rises = rises_of[index] = rises_of[index] + 1
            run = runs[index]
            if rises == 1:  # a new run: it starts at the batch before
                run.clear()
                run.append((last_batch, last))
            run.append((batch, value))
            gap = batch - last_batch
            # Compared in logs past one batch: MIN_GROWTH ** gap overflows a float past 1023
            # batches (a module that runs rarely, batch numbers set far apart).
            if (value >= last * MIN_GROWTH) if gap == 1 else \
                    (math.log(value) - math.log(last) >= gap * _LOG_MIN_GROWTH):
                fast[index] = True
            if value >= near[index] or (rises >= MIN_RISES and fast[index]
                                        and not growth_said[index]):
                candidates = (candidates or []) + [index]
        if candidates is None or tainted:
            return
        for index in candidates:
            self._check(batch, index, row[index][0], frames, known)

    def _check(self, batch: int, index: int, value: float, frames: Iterable[Frame],
               known: tuple[Any, tuple[float, float, float]] | None) -> None:
        """Module ``index`` could warn in ``batch`` (its row's abs max ``value``): decide on
        its exact output, from ``known`` (dtype and limits) or the batch's frames."""
        if known is not None:
            self._decide(batch, index, value, "output", *known)
            return
        exact = _largest_output(frames, self._names[index], batch)
        if exact is not None:
            value, role, dtype = exact
            limits = self._limits_of(dtype)
            if limits is not None:
                self._decide(batch, index, value, role, dtype, limits,
                             _producer(frames, self._names[index], batch, value))

    def _rate(self, index: int) -> float:
        """Growth rate (log per batch) fitted over module ``index``'s run of rises; 0 (no
        estimate) for a run of one rise: one jump out of a noisy series is no rate."""
        run = self._runs[index]
        if self._rises[index] < 2 or len(run) < 3:
            return 0.0
        # A climb back to where the series has been lately is no growth: it counts from the
        # highest value held in the batches before the run (see RECENT).
        high = self._recent_high(index, run[0][0])
        # Values far below the growth floor are a start from near zero (a fresh layer, a
        # mean readout of centred features at 2e-7), not a rate: a climb from there to 1 in
        # three batches fitted 45x per batch.
        # As from zero, a run that begins below it counts its rises from its first value at or
        # above it (a LayerScale gain leaving 1e-6: 7e-7, 0.29, 2.4, 7.6, then levelling off).
        kept = [(batch, max(value, high)) for batch, value in run if value >= _FIT_FLOOR]
        if len(kept) < (3 if len(kept) == len(run) else MIN_RISES + 1):
            return 0.0
        logs = [math.log(value) for _, value in kept]
        batches = [batch for batch, _ in kept]
        # A run slowing down is levelling off (a jump out of the first batches' transient, then
        # smaller rises): the rate is no faster than the run's latest rise, nor than its last
        # two together. A blow-up keeps its pace.
        return min(growth_rate(batches, logs),
                   (logs[-1] - logs[-2]) / (batches[-1] - batches[-2]),
                   (logs[-1] - logs[-3]) / (batches[-1] - batches[-3]))

    def _decide(self, batch: int, index: int, value: float, role: str, dtype: Any,
                limits: tuple[float, float, float],
                producer: tuple[str, str] | None = None) -> None:
        """Warn about module ``index`` when its exact output (``value`` of ``dtype``) is near
        the limit or grows fast enough to pass it within the horizon. ``producer``: the module
        inside it that made that output, and its role there: the warning names it."""
        module = self._names[index]
        named = producer or (module, role)
        largest, near, extreme = limits
        if not 0 < value < extreme:
            return  # the dtype's extreme written on purpose (a mask)
        rate = self._rate(index)
        warned = self._warned
        if value >= near and (module, "near-limit") not in warned:
            if (named[0], "near-limit") not in warned:  # (its maker may have said it already)
                self._warn(batch, *named, "near-limit", value, dtype, largest, rate)
            warned.add((module, "near-limit"))  # said, for the container too
            self._near[index] = math.inf  # no longer a candidate for it
        if self._rises[index] >= MIN_RISES and self._fast[index] and value >= GROWTH_FLOOR \
                and (module, "growth") not in warned \
                and rate >= _LOG_MIN_GROWTH and math.log(largest / value) <= HORIZON * rate:
            if (named[0], "growth") not in warned:
                self._warn(batch, *named, "growth", value, dtype, largest, rate)
            warned.add((module, "growth"))
            self._growth_said[index] = True

    def _warn(self, batch: int, module: str, role: str, reason: str, value: float, dtype: Any,
              largest: float, rate: float, per: str = "batch") -> None:
        self._warned.add((module, reason))
        # A container whose output is (or is made of) what a module inside it already warned
        # about in this batch, or the same tensor handed on (a Sequential's output is its last
        # child's): one warning, for the innermost module (children's frames come first).
        said = [s for s in self._said if s[0] == batch]
        if any(r == reason and (v == value or _inside(m, module)) for _, r, v, m in said):
            self._said = said
            return
        self._said = said + [(batch, reason, value, module)]
        growing = rate > 0
        growth = math.exp(min(rate, _LOG_LARGEST)) if growing else math.nan
        warning = EarlyWarning(
            batch=batch, module=module, role=role, reason=reason, abs_max=float(value),
            limit=largest, growth_per_batch=growth,
            batches_to_limit=math.log(largest / value) / rate if growing else math.nan,
            dtype=str(dtype).replace("torch.", ""), rank=self.recorder.rank, per=per)
        self.warnings.append(warning)
        self._unissued.append(warning)

    # ------------------------------------------------------------------ outside the lock
    def review_event(self, batch: int, event: Any, reason: str) -> Any:
        if self._unissued:
            self.issue()
        return event

    def issue(self) -> None:
        """Issue the warnings recorded since the last call as Python warnings (once each)."""
        with self.recorder.lock:
            unissued, self._unissued = self._unissued, []
        if not unissued:
            return
        level = user_stacklevel()
        for warning in unissued:
            try:
                warnings.warn(f"nanwidget: {warning}", EarlyWarningIssued, stacklevel=level)
            except Exception:  # a filter that turns warnings into errors: the run goes on
                pass

    def close(self) -> None:
        try:
            self.issue()
        except Exception:  # closing must always succeed
            pass
        self._early = []


_DTYPES_EVERY = 64  # batches between two reads of the modules' output dtypes


class _StepSeries(EarlyWarnings):
    """One mode's outputs counted by optimizer step (see the module docstring): each point the
    batches between two steps, their largest abs max per module, numbered by the steps taken.
    The checks are the series by batch's, for growth only (near-limit is said by batch); a
    warning is the parent's, once per module and reason either way, at the batch that folded
    the point, and says "per optimizer step"."""

    def __init__(self, parent: EarlyWarnings) -> None:
        super().__init__(parent.recorder)
        self._parent = parent
        self._warned = parent._warned
        self._dtype_limits = parent._dtype_limits
        self._looked_up[:] = [True] * len(self._looked_up)  # the parent's frames tell dtypes
        self._at = -1

    def look(self, count: int, row: dict[int, list], batch: int) -> None:
        """The point of the batches that ended with ``count`` steps taken, folded at
        ``batch``."""
        self._at = batch
        self._look(count, row, ())

    def _check(self, batch: int, index: int, value: float, frames: Iterable[Frame],
               known: tuple[Any, tuple[float, float, float]] | None) -> None:
        limits = self._parent._module_limits[index]
        if limits is None:
            return
        dtype = next((d for d, known_limits in self._dtype_limits.items()
                      if known_limits is limits), None)
        # No near-limit zone here: the batch's own check says it.
        self._decide(batch, index, value, "output", dtype, (limits[0], math.inf, limits[2]))

    def _warn(self, batch: int, module: str, role: str, reason: str, value: float, dtype: Any,
              largest: float, rate: float, per: str = "batch") -> None:
        self._parent._warn(self._at, module, role, reason, value, dtype, largest, rate,
                           per="optimizer step")


def _depth(name: str) -> int:
    """How deep module ``name`` lies (the root -1)."""
    return name.count(".") if name else -1


def _inside(name: str, outer: str) -> bool:
    """Whether module ``name`` lies inside module ``outer`` ("" is the root)."""
    return name != outer and (outer == "" or name.startswith(outer + "."))


def _producer(frames: Iterable[Frame], container: str, batch: int,
              value: float) -> tuple[str, str] | None:
    """The innermost module inside ``container`` with an output in ``batch`` whose largest
    finite |x| is ``value``, and that output's role: what made the tensor a container hands on
    (router logits a model returns, a Sequential's last layer's output). None: none did."""
    best = None
    for frame in frames:
        if frame.batch != batch or frame.phase != "forward" \
                or not _inside(frame.module, container):
            continue
        for entry in frame.outputs():
            stats = entry.stats
            if stats is not None and stats.finite_abs_max == value:
                if best is None or frame.module.count(".") > best[0].count("."):
                    best = (frame.module, entry.role)
                break
    return best


def _largest_output(frames: Iterable[Frame], module: str,
                    batch: int) -> tuple[float, str, Any] | None:
    """The largest finite |x| among ``module``'s float and complex outputs in ``batch``: value,
    role, dtype."""
    best = None
    for frame in frames:
        if frame.module != module or frame.batch != batch or frame.phase != "forward":
            continue
        for entry in frame.outputs():
            stats = entry.stats
            dtype = entry.dtype
            if stats is None or not isinstance(dtype, torch.dtype) \
                    or not (dtype.is_floating_point or dtype.is_complex):
                continue
            value = stats.finite_abs_max
            if value > 0 and (best is None or value > best[0]):
                best = (value, entry.role, dtype)
    return best

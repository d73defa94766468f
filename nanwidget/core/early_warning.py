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
    to the limit anyway.

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
import os
import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .frames import Frame
from .recorder import Feature, Recorder

__all__ = ["EarlyWarning", "EarlyWarningIssued", "EarlyWarnings", "REASONS", "NEAR_FACTOR",
           "HORIZON", "WINDOW", "MIN_RISES", "MIN_GROWTH", "growth_rate", "WARNING_FIELDS",
           "warning_fields", "warning_from_fields"]

REASONS = ("near-limit", "growth")
NEAR_FACTOR = 4.0  # "near-limit": within this factor of the dtype's largest value
HORIZON = 50  # "growth": would pass the dtype's largest within this many batches
WINDOW = 8  # the most batches the growth rate is fitted over
MIN_RISES = 3  # rises in a row before a growth is fitted
MIN_GROWTH = 2.0  # slowest growth per batch that counts (slower: the near-limit check)
# A value this close to its dtype's largest is that extreme written on purpose (a mask filled
# with finfo.min), not a value that grew there: a growing value passes through the near zone.
_EXTREME = 1.0 / 1.01

_LOG_MIN_GROWTH = math.log(MIN_GROWTH)


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
    near-limit warning on a value seen once). ``pd.DataFrame(w.warnings)`` tabulates them.
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

    @property
    def module_label(self) -> str:
        """The module as a user reads it: its name, or "<root>" for the model itself."""
        return self.module or "<root>"

    def summary(self) -> str:
        """One line: where, what, and how soon."""
        dtype = self.dtype or "its dtype"
        where = f"batch {self.batch}" + (f" on rank {self.rank}" if self.rank else "")
        what = f"{self.role} of '{self.module_label}' ({self.dtype})" if self.dtype else \
            f"{self.role} of '{self.module_label}'"
        if self.reason == "growth":
            text = (f"{what} grows {self.growth_per_batch:.3g}x per batch (abs max "
                    f"{self.abs_max:.3g}); at that rate it passes {dtype}'s largest "
                    f"{self.limit:.6g} in about {self.batches_to_limit:.0f} batches")
        else:
            text = (f"{what} reached abs max {self.abs_max:.3g}, within a factor "
                    f"{NEAR_FACTOR:g} of {dtype}'s largest {self.limit:.6g}")
            if self.batches_to_limit == self.batches_to_limit:
                text += (f" (growing {self.growth_per_batch:.3g}x per batch: about "
                         f"{self.batches_to_limit:.0f} batches left)")
        return f"early warning, {where}: {text}"

    def __str__(self) -> str:
        return self.summary()


# The fields a recording stores, with their JSON kinds (floats may be written as integers).
WARNING_FIELDS: dict[str, type | tuple[type, ...]] = {
    "batch": int, "module": str, "role": str, "reason": str, "abs_max": (int, float),
    "limit": (int, float), "growth_per_batch": (int, float), "batches_to_limit": (int, float),
    "dtype": str, "rank": int}


def warning_fields(warning: EarlyWarning) -> dict[str, Any]:
    """The fields of ``warning`` as plain data (what a recording writes)."""
    return {name: getattr(warning, name) for name in WARNING_FIELDS}


def warning_from_fields(fields: dict[str, Any]) -> EarlyWarning:
    """An :class:`EarlyWarning` from :func:`warning_fields` (checked by the caller)."""
    values = {name: fields[name] for name in WARNING_FIELDS}
    for name in ("abs_max", "limit", "growth_per_batch", "batches_to_limit"):
        values[name] = float(values[name])
    return EarlyWarning(**values)


# ---------------------------------------------------------------------------- the fit
def growth_rate(batches: list[int], logs: list[float]) -> float:
    """Theil-Sen slope of ``logs`` (natural log of abs max) against ``batches``: the median of
    the pairwise slopes, so that one odd batch does not make a trend."""
    slopes = sorted((logs[j] - logs[i]) / (batches[j] - batches[i])
                    for i in range(len(batches)) for j in range(i + 1, len(batches))
                    if batches[j] != batches[i])
    if not slopes:
        return 0.0
    middle = len(slopes) // 2
    return slopes[middle] if len(slopes) % 2 else (slopes[middle - 1] + slopes[middle]) / 2


class _Series:
    """One module's recent output abs max: the batches of its current run of rises (the last
    :data:`WINDOW` at most) and the limits of its output dtype."""

    __slots__ = ("batches", "values", "rises", "fast", "last_batch", "last_value", "limits",
                 "looked_up")

    def __init__(self) -> None:
        self.batches: deque[int] = deque(maxlen=WINDOW)
        self.values: deque[float] = deque(maxlen=WINDOW)
        self.rises = 0  # batches in a row whose abs max rose
        # Whether a rise in the run was at least MIN_GROWTH per batch: the fitted rate (a median
        # of pairwise slopes, each an average of the steps between) cannot be larger than the
        # fastest step, so without one there is nothing to fit.
        self.fast = False
        self.last_batch = -1
        self.last_value = math.inf
        # (largest, near-limit threshold, extreme threshold) of the tightest float dtype its
        # outputs had; None until one is seen (or never: outputs that are no float tensors).
        self.limits: tuple[float, float, float] | None = None
        self.looked_up = False  # whether its frames were read for their dtypes

    def rate(self, points: int) -> float:
        """Growth rate (log per batch) fitted over the last ``points`` batches."""
        batches = list(self.batches)[-points:]
        logs = [math.log(v) for v in list(self.values)[-points:]]
        return growth_rate(batches, logs)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def _user_stacklevel() -> int:
    """The stacklevel of the first caller outside nanwidget, torch and installed packages (the
    user's forward call or ``trainer.train()`` line), so the warning points at their line; else
    the first outside nanwidget and torch."""
    frame, level = sys._getframe(1), 1
    outside_torch = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_PACKAGE_DIR, _TORCH_DIR)):
            if outside_torch is None:
                outside_torch = level
            if not any(part in path for part in _INSTALLED):
                return level
        frame, level = frame.f_back, level + 1
    return outside_torch or 1


# ---------------------------------------------------------------------------- the feature
class EarlyWarnings(Feature):
    """The early-warning part of a watch (see the module docstring).

    ``root_dtype``: the dtype of the root output whose magnitude the sentinel reports each batch
    (:meth:`on_output_magnitude`); None outside sentinel mode.

    Per batch it reads the history row the recorder just filled (one number per module: the
    largest |x| of its outputs) and keeps, per module, the current run of rises; only a module
    whose value could warn (near its dtype's limit, or three rises with a fast one) is looked up
    in the batch's frames for its exact output, role and dtype. Module dtypes are read from the
    frames of the first batch, of every :data:`_DTYPES_EVERY`-th one, and of a module seen for
    the first time.
    """

    def __init__(self, recorder: Recorder, *,
                 root_dtype: Callable[[], torch.dtype | None] | None = None) -> None:
        self.recorder = recorder
        self.root_dtype = root_dtype
        #: Every warning so far, oldest first (once per module and reason).
        self.warnings: list[EarlyWarning] = []
        self._unissued: list[EarlyWarning] = []
        self._warned: set[tuple[str, str]] = set()
        self._said: list[tuple[int, str, float, str]] = []  # (batch, reason, abs max, module)
        self._names = list(recorder.module_names)
        self._index = {name: i for i, name in enumerate(self._names)}
        self._series = [_Series() for _ in self._names]
        self._inf_allowed = frozenset(self._index[name] for name in recorder.inf_allowed
                                      if name in self._index)
        self._history = recorder.records.history
        # dtype -> (largest value, near-limit threshold, extreme threshold); None: not a float
        self._limits: dict[Any, tuple[float, float, float] | None] = {}
        self._batches_seen = 0
        # Frames resolved within a batch (a flush), looked at with the batch's own.
        self._early: list[Frame] = []

    # ------------------------------------------------------------------ under the lock
    def on_frames_resolved(self, frames: list[Frame]) -> None:
        # A flush within a batch: its forward frames are looked at with the rest of the batch.
        self._early.extend(frame for frame in frames if frame.phase == "forward")

    def on_batch_end(self, batch: int, frames: list[Frame]) -> None:
        if self._early:
            frames, self._early = self._early + frames, []
        if not frames:
            return  # sentinel mode between sampled batches: on_output_magnitude reads the root
        try:
            row = self._history.current_row(batch)
            if row is None:
                return
            if self._batches_seen % _DTYPES_EVERY == 0:
                self._learn_dtypes(frames)
            self._batches_seen += 1
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
        try:
            dtype = self.root_dtype() if self.root_dtype is not None else None
            limits = self._limits_of(dtype)
            index = self._index.get(module)
            if limits is None or index is None or not abs_max > 0:
                return
            series = self._series[index]
            series.limits = _tighter(series.limits, limits)
            if self._observe(series, batch, abs_max):
                self._decide(batch, index, abs_max, "output", dtype, limits)
        except Exception as error:  # a warning must never break the run
            self.recorder.internal_error(error)

    def _limits_of(self, dtype: Any) -> tuple[float, float, float] | None:
        limits = self._limits.get(dtype, False)
        if limits is False:
            limits = None
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                largest = float(torch.finfo(dtype).max)
                limits = (largest, largest / NEAR_FACTOR, largest * _EXTREME)
            self._limits[dtype] = limits
        return limits

    def _learn_dtypes(self, frames: Iterable[Frame]) -> None:
        """Each module's tightest float output dtype (float16 over float32 under autocast)."""
        index, series = self._index, self._series
        for frame in frames:
            position = index.get(frame.module)
            if frame.phase != "forward" or position is None:
                continue
            series[position].looked_up = True
            for entry in frame.outputs():
                limits = self._limits_of(entry.dtype)
                if limits is not None:
                    series[position].limits = _tighter(series[position].limits, limits)

    def _look(self, batch: int, row: dict[int, list], frames: list[Frame]) -> None:
        """A finished batch's history row: extend each module's run; check the few that could
        warn against the batch's frames. A batch with a NaN/Inf output warns about nothing."""
        candidates = None
        tainted = False
        series_of = self._series
        allowed = self._inf_allowed
        for index, slot in row.items():
            value = slot[0]
            if slot[2] and index not in allowed:
                tainted = True
            series = series_of[index]
            if series.limits is None:
                if not series.looked_up:
                    self._learn_dtypes(frames)  # a module seen for the first time
                if series.limits is None:
                    continue  # no float output (token ids, a mask of bools)
            if self._observe(series, batch, value):
                if candidates is None:
                    candidates = []
                candidates.append(index)
        if candidates is None or tainted:
            return
        for index in candidates:
            exact = _largest_output(frames, self._names[index], batch)
            if exact is not None:
                value, role, dtype = exact
                limits = self._limits_of(dtype)
                if limits is not None:
                    self._decide(batch, index, value, role, dtype, limits)

    @staticmethod
    def _observe(series: _Series, batch: int, value: float) -> bool:
        """Add ``value`` (a module's largest output in ``batch``) to its run; whether it could
        warn now (by the module's tightest dtype: the caller checks the exact one)."""
        if batch <= series.last_batch or not value > 0 or value == math.inf:
            if batch > series.last_batch:  # zero, or nothing finite: the run breaks
                series.rises = 0
                series.fast = False
                series.last_value = math.inf
                series.last_batch = batch
            return False  # an earlier batch seen again (a replay): its point is in already
        last = series.last_value
        if value > last:
            series.rises += 1
            gap = batch - series.last_batch
            if value >= last * (MIN_GROWTH if gap == 1 else MIN_GROWTH ** gap):
                series.fast = True
        else:
            series.rises = 0
            series.fast = False
        series.batches.append(batch)
        series.values.append(value)
        series.last_batch = batch
        series.last_value = value
        limits = series.limits
        return (value >= limits[1]) or (series.rises >= MIN_RISES and series.fast)

    def _decide(self, batch: int, index: int, value: float, role: str, dtype: Any,
                limits: tuple[float, float, float]) -> None:
        """Warn about module ``index`` when its exact output (``value`` of ``dtype``) is near
        the limit or grows fast enough to pass it within the horizon."""
        module = self._names[index]
        series = self._series[index]
        largest, near, extreme = limits
        if value >= extreme:
            return  # the dtype's extreme written on purpose (a mask)
        points = min(series.rises + 1, WINDOW)
        rate = series.rate(points) if series.rises else 0.0
        if value >= near and (module, "near-limit") not in self._warned:
            self._warn(batch, module, role, "near-limit", value, dtype, largest, rate)
        if series.rises >= MIN_RISES and series.fast and (module, "growth") not in self._warned \
                and rate >= _LOG_MIN_GROWTH and math.log(largest / value) <= HORIZON * rate:
            self._warn(batch, module, role, "growth", value, dtype, largest, rate)

    def _warn(self, batch: int, module: str, role: str, reason: str, value: float, dtype: Any,
              largest: float, rate: float) -> None:
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
        warning = EarlyWarning(
            batch=batch, module=module, role=role, reason=reason, abs_max=float(value),
            limit=largest, growth_per_batch=math.exp(rate) if growing else math.nan,
            batches_to_limit=math.log(largest / value) / rate if growing else math.nan,
            dtype=str(dtype).replace("torch.", ""), rank=self.recorder.rank)
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
        level = _user_stacklevel()
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


def _inside(name: str, outer: str) -> bool:
    """Whether module ``name`` lies inside module ``outer`` ("" is the root)."""
    return name != outer and (outer == "" or name.startswith(outer + "."))


def _tighter(limits: tuple[float, float, float] | None,
             other: tuple[float, float, float]) -> tuple[float, float, float]:
    return other if limits is None or other[0] < limits[0] else limits


def _largest_output(frames: Iterable[Frame], module: str,
                    batch: int) -> tuple[float, str, Any] | None:
    """The largest finite |x| among ``module``'s float outputs in ``batch``: value, role, dtype."""
    best = None
    for frame in frames:
        if frame.module != module or frame.batch != batch or frame.phase != "forward":
            continue
        for entry in frame.outputs():
            stats = entry.stats
            dtype = entry.dtype
            if stats is None or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                continue
            value = stats.finite_abs_max
            if value > 0 and (best is None or value > best[0]):
                best = (value, entry.role, dtype)
    return best

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

Where the numbers come from: nothing is measured for this. Full mode reads the stats the watch
resolved for every module's outputs at the end of each batch (a few Python comparisons per
module); sentinel mode reads the root's outputs, which the sentinel measures every batch, and
every module on the batches it records in full (``sample_every``). A batch whose outputs
already hold a NaN/Inf gets no warning: its event says more. The records are
:class:`EarlyWarning` (``w.warnings``); each is also issued once as a Python warning of
category :class:`EarlyWarningIssued`, outside the recorder's lock, when the batch's check ends.
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
    """The last :data:`WINDOW` measured batches of one module's output abs max."""

    __slots__ = ("batches", "values", "rises", "last_batch", "last_value")

    def __init__(self) -> None:
        self.batches: deque[int] = deque(maxlen=WINDOW)
        self.values: deque[float] = deque(maxlen=WINDOW)
        self.rises = 0  # batches in a row whose abs max rose
        self.last_batch = -1
        self.last_value = math.inf

    def add(self, batch: int, value: float) -> None:
        self.rises = self.rises + 1 if value > self.last_value else 0
        self.batches.append(batch)
        self.values.append(value)
        self.last_batch = batch
        self.last_value = value

    def rate(self, points: int) -> float:
        """Growth rate (log per batch) fitted over the last ``points`` batches."""
        batches = list(self.batches)[-points:]
        logs = [math.log(v) for v in list(self.values)[-points:]]
        return growth_rate(batches, logs)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _user_stacklevel() -> int:
    """The stacklevel of the first caller outside nanwidget and torch (the user's forward or
    training step), so the warning points at their line."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_PACKAGE_DIR, _TORCH_DIR)):
            return level
        frame, level = frame.f_back, level + 1
    return 1


# ---------------------------------------------------------------------------- the feature
class EarlyWarnings(Feature):
    """The early-warning part of a watch (see the module docstring).

    ``root_dtype``: the dtype of the root output whose magnitude the sentinel reports each batch
    (:meth:`on_output_magnitude`); None outside sentinel mode.
    """

    def __init__(self, recorder: Recorder, *,
                 root_dtype: Callable[[], torch.dtype | None] | None = None) -> None:
        self.recorder = recorder
        self.root_dtype = root_dtype
        #: Every warning so far, oldest first (once per module and reason).
        self.warnings: list[EarlyWarning] = []
        self._unissued: list[EarlyWarning] = []
        self._warned: set[tuple[str, str]] = set()
        self._said: set[tuple[int, str, float]] = set()  # (batch, reason, abs max) warned
        self._series: dict[str, _Series] = {}
        self._inf_allowed = recorder.inf_allowed
        # dtype -> (largest value, near-limit threshold, extreme threshold); None: not a float
        self._limits: dict[Any, tuple[float, float, float] | None] = {}
        # Frames resolved within a batch (a flush), folded in when the batch ends.
        self._early: list[Frame] = []

    # ------------------------------------------------------------------ under the lock
    def on_frames_resolved(self, frames: list[Frame]) -> None:
        if frames:
            self._early.extend(frames)

    def on_batch_end(self, batch: int, frames: list[Frame]) -> None:
        if self._early:
            frames, self._early = self._early + frames, []
        if frames:
            self._take(frames)

    def on_frames_replayed(self, frames: list[Frame]) -> None:
        self._take(frames)

    def on_output_magnitude(self, batch: int, module: str, abs_max: float,
                            abs_min: float) -> None:
        try:
            dtype = self.root_dtype() if self.root_dtype is not None else None
            limits = self._limits_of(dtype)
            if limits is not None and abs_max == abs_max:
                self._check(batch, module, "output", dtype, limits, abs_max)
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

    def _take(self, frames: Iterable[Frame]) -> None:
        """The largest finite output of each module in each batch of ``frames``, checked."""
        try:
            largest: dict[tuple[int, str], list] = {}
            tainted: set[int] = set()
            inf_allowed = self._inf_allowed
            limits_of = self._limits.get
            for frame in frames:
                if frame.phase != "forward":
                    continue
                entries = frame.entries
                for position in range(frame.first_output, len(entries)):
                    entry = entries[position]
                    stats = entry[1]
                    if stats is None:
                        continue
                    if stats.nan or (stats.inf and frame.module not in inf_allowed):
                        tainted.add(frame.batch)
                    value = stats.finite_abs_max
                    if not value > 0:
                        continue
                    dtype = entry[2]
                    limits = limits_of(dtype, False)
                    if limits is False:
                        limits = self._limits_of(dtype)
                    if limits is None:
                        continue
                    key = (frame.batch, frame.module)
                    slot = largest.get(key)
                    if slot is None:
                        largest[key] = [value, entry[0], dtype, limits]
                    elif value > slot[0]:
                        slot[:] = [value, entry[0], dtype, limits]
            for (batch, module), (value, role, dtype, limits) in sorted(
                    largest.items(), key=lambda item: item[0][0]):
                if batch not in tainted:
                    self._check(batch, module, role, dtype, limits, value)
        except Exception as error:  # a warning must never break the run
            self.recorder.internal_error(error)

    def _check(self, batch: int, module: str, role: str, dtype: Any,
               limits: tuple[float, float, float], value: float) -> None:
        """One module's largest finite output in ``batch``: add it to its series and warn."""
        series = self._series.get(module)
        if series is None:
            series = self._series[module] = _Series()
        if batch <= series.last_batch:
            return  # an earlier batch seen again (a replay of it): its trend point is there
        if not value > 0:
            series.rises = 0
            return
        series.add(batch, value)
        largest, near, extreme = limits
        if near <= value < extreme and (module, "near-limit") not in self._warned:
            rate = series.rate(min(series.rises + 1, WINDOW)) if series.rises else 0.0
            self._warn(batch, module, role, "near-limit", value, dtype, largest, rate)
        if series.rises >= MIN_RISES and (module, "growth") not in self._warned:
            rate = series.rate(min(series.rises + 1, WINDOW))
            if rate >= _LOG_MIN_GROWTH and value < extreme \
                    and math.log(largest / value) <= HORIZON * rate:
                self._warn(batch, module, role, "growth", value, dtype, largest, rate)

    def _warn(self, batch: int, module: str, role: str, reason: str, value: float, dtype: Any,
              largest: float, rate: float) -> None:
        self._warned.add((module, reason))
        # The same tensor handed up through its containers (a Sequential's output is its last
        # child's): one warning, for the innermost module (children's frames come first).
        said = (batch, reason, value)
        if said in self._said:
            return
        self._said = {s for s in self._said if s[0] == batch}
        self._said.add(said)
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

"""The result of a trace-mode replay: every module frame and every tensor op of one batch."""

from __future__ import annotations

import linecache
from dataclasses import dataclass, field

import pandas as pd

from .report import format_frames
from .schema import OPS_COLUMNS, OPS_DTYPES, empty_table
from .sourcelines import locate_source

__all__ = ["Trace", "TENSOR_COLUMNS", "empty_ops"]

# The first bad op's inputs and outputs, described (signed finite range, non-finite counts).
TENSOR_COLUMNS = ["role", "dtype", "shape", "numel", "min", "max", "nan_count", "inf_count"]


def empty_ops() -> pd.DataFrame:
    """An ops table with the contract's columns and no rows."""
    return empty_table(OPS_COLUMNS, OPS_DTYPES)


def _number(value: float) -> str:
    return "nan" if value != value else f"{value:.3e}"


@dataclass(repr=False)
class Trace:
    """A trace-mode replay of one batch: every module frame and every tensor op.

    ``frames``: the contract's frame DataFrame (every module frame, no ring limit). ``ops``: one
    row per aten op (:data:`~nanwidget.core.schema.OPS_COLUMNS`; ops that only make views or
    uninitialised memory are left out). ``first_bad``: the op row where the first non-finite value
    was *born*: finite inputs, non-finite output (an overflow to Inf counts; an op writing a
    literal ±inf on purpose, like ``masked_fill(mask, -inf)``, does not); None when no op made
    one (it came with the data or the weights). ``first_bad_tensors``: signed ranges and
    non-finite counts of that op's inputs and outputs. ``earlier_inf``: an op whose output held an
    Inf before that (a -inf mask, say). ``reproduced``: the replay met the batch's recorded event
    again (or, with none recorded, found none); ``expected`` / ``found`` describe both.
    ``changes``: everything that differs from when the batch ran (parameter values, dtypes,
    storage, modules), in words; empty only when nothing did. ``weights_changed`` /
    ``changed_weights``: the parameters and buffers among them.
    """

    batch: int
    frames: pd.DataFrame
    ops: pd.DataFrame
    first_bad: pd.Series | None = None
    first_bad_tensors: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=TENSOR_COLUMNS))
    earlier_inf: pd.Series | None = None
    lineage: list[int] = field(default_factory=list)
    came_with: list[tuple[str, str]] = field(default_factory=list)
    earlier_inf_reaches: bool = False
    weights_last_finite: dict[str, int] = field(default_factory=dict)
    weights_changed: bool = False
    changed_weights: list[str] = field(default_factory=list)
    buffers_updated: list[str] = field(default_factory=list)
    snapshot_used: bool = False
    loss: float | None = None
    forwards: int = 1
    seconds: float = 0.0
    reproduced: bool = True
    changes: list[str] = field(default_factory=list)
    expected: str = ""  # the recorded event the replay looked for ("" when none)
    found: str = ""  # the event the replay met ("" when none)

    def why_not_reproduced(self) -> str:
        """Why the replay did not meet the recorded event, in one sentence ("" if it did)."""
        if self.reproduced:
            return ""
        if not self.expected:
            return f"the replay found an event the run did not record: {self.found}"
        if self.changes:
            return ("the model differs from when the batch ran: " + "; ".join(self.changes[:3])
                    + (" ..." if len(self.changes) > 3 else ""))
        if self.found:
            return f"the replay met another event first: {self.found}"
        return ("the replay ran the same inputs, RNG states and weights and every value stayed "
                "finite: the NaN/Inf depends on something a replay cannot repeat "
                "(nondeterministic kernels, another thread or process writing the weights)")

    def summary(self) -> str:
        """One line: the first bad op and where, or that every op stayed finite."""
        if self.first_bad is None:
            if not self.reproduced:
                return (f"trace of batch {self.batch}: the event was not reproduced, because "
                        f"{self.why_not_reproduced()}")
            if self.ops["nonfinite"].any() if len(self.ops) else False:
                where = f": {self.found}" if self.found else ""
                return (f"trace of batch {self.batch}: no op made the first NaN/Inf; it came "
                        f"with the batch's data or the weights{where}")
            return f"trace of batch {self.batch}: all {len(self.ops)} ops produced finite values"
        first = self.first_bad
        where = f" in module '{first['module'] or '<root>'}'" if first["phase"] != "loss" else " in loss_fn"
        return (f"trace of batch {self.batch}: first non-finite op {first['op']} "
                f"({first['phase']}){where} at {first['source'] or 'an unknown line'}")

    def report(self) -> str:
        """The first bad op with its source line, the weights' state, then every frame."""
        lines = [f"Trace of batch_number={self.batch} (replayed in trace mode: {len(self.ops)} ops, "
                 f"{self._frame_count()} module frames, {self.seconds:.2f} s)"]
        first = self.first_bad
        if not self.reproduced:
            lines.append(f"Not reproduced: the recorded event ({self.expected or 'none'}) did not "
                         f"happen again, because {self.why_not_reproduced()}.")
        if first is None:
            if len(self.ops) and self.ops["nonfinite"].any():
                lines.append("No op made a non-finite value from finite inputs: the first NaN/Inf "
                             "came with the batch's data or the weights (see the frames below).")
            else:
                lines.append("No op produced a non-finite value in the replay.")
        else:
            kind = "+".join(k for k in ("nan", "inf") if first[k]) or "non-finite"
            module = first["module"] or "<root>"
            module_type = f" ({first['module_type']})" if first["module_type"] else ""
            place = "in loss_fn" if first["phase"] == "loss" else f"in module '{module}'{module_type}"
            lines.append(f"First non-finite op: {first['op']} ({first['aten']}, {first['phase']}) "
                         f"{place}: {kind}")
            source = first["source"]
            if source:
                lines.append(f"  at {source}")
                located = locate_source(source)
                text = linecache.getline(*located).strip() if located is not None else ""
                if text:
                    lines.append(f"  {located[1]:>6} | {text}")
            else:
                lines.append("  (no line of user code on the stack)")
            for row in self.first_bad_tensors.itertuples(index=False):
                counts = [f"{n} of {row.numel} {k}" for n, k in ((row.nan_count, "NaN"),
                                                                 (row.inf_count, "Inf")) if n]
                state = ", ".join(counts) if counts else "no NaN or Inf"
                finite_range = (f"finite values from {_number(row.min)} to {_number(row.max)}"
                                if row.min == row.min else "no finite values")
                lines.append(f"  {row.role}: {row.dtype} {tuple(row.shape)}, {finite_range}, {state}")
            earlier = self.earlier_inf
            if earlier is not None:
                place = ("loss_fn" if earlier["phase"] == "loss"
                         else f"module '{earlier['module'] or '<root>'}'")
                lines.append(f"  Before it, op {earlier['op']} in {place} held an Inf at "
                             f"{earlier['source'] or 'an unknown line'} (intended in masks filled "
                             "with -inf; an Inf reaching exp, softmax or a subtraction makes NaN).")
        if self.changes:
            lines.append(f"Changed since batch {self.batch} ran ({len(self.changes)}):")
            lines.extend(f"  - {change}" for change in self.changes[:12])
            if len(self.changes) > 12:
                lines.append(f"  ... and {len(self.changes) - 12} more")
            if not self.snapshot_used and self.weights_changed:
                lines.append("  Watch with nanwidget.watch(model, snapshot_weights=True) for "
                             "faithful replays after optimizer steps.")
        elif self.snapshot_used:
            lines.append("Weights: replayed with the snapshot taken when the batch started.")
        else:
            lines.append(f"Nothing changed since batch {self.batch} ran (weights, dtypes, modules); "
                         "writes through .data that bypass version counters cannot be seen.")
        if self.buffers_updated and not self.snapshot_used:
            names = ", ".join(self.buffers_updated[:6]) + (" ..." if len(self.buffers_updated) > 6 else "")
            lines.append(f"Buffers updated by batch {self.batch}'s own forward ({names}): the replay "
                         "started from their updated values (train-mode BatchNorm outputs do not "
                         "depend on its running statistics).")
        lines.append("")
        lines.append(f"All {self._frame_count()} forward frames of the replay:")
        lines.append(f"{'abs min':8} {'abs max':8} metadata")
        lines.extend(format_frames(self.frames))
        return "\n".join(lines)

    def _frame_count(self) -> int:
        return 0 if self.frames.empty else int(self.frames["frame"].nunique())

    def __repr__(self) -> str:
        return f"<Trace {self.summary()}>"

    def _repr_html_(self) -> str:  # pragma: no cover - notebook nicety
        import html
        return f"<pre>{html.escape(self.report())}</pre>"

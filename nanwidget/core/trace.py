"""The result of a trace-mode replay: every module frame and every tensor op of one batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from .events import NanEvent
from .report import format_frames
from .schema import INTENDED_INF_OPS, NO_USER_LINE, OPS_COLUMNS, OPS_DTYPES, empty_table
from .sourcelines import source_text

__all__ = ["Trace", "TENSOR_COLUMNS", "TENSOR_COLUMNS_REQUIRED", "empty_ops", "not_through_outputs"]


def not_through_outputs(batch: int) -> str:
    """Why a non-finite gradient can escape a replay of ``batch`` that starts from the model's
    outputs, and what traces it (the replay's and the sentinel's words for it)."""
    return ("the NaN/Inf entered the backward pass not through the model's outputs but through "
            "a loss term built from something else: a module attribute such as an aux loss, an "
            "intermediate tensor kept aside, or a gradient penalty whose "
            "torch.autograd.grad(create_graph=True) runs the modules' backward again (its double "
            "backward); give the watch loss_fn (the whole loss, those terms included) or run "
            f"w.replay({batch}, loss_fn=...) to trace it. A term that needs the batch's inputs "
            "(a gradient penalty, a PINN's derivatives) cannot be rebuilt from the outputs that "
            "loss_fn gets: look at its own ops (a norm or sqrt at 0 needs an eps, "
            "torch.sqrt((g ** 2).sum(1) + 1e-12)); full mode with backward=True names a module "
            "whose gradient went non-finite in any backward pass of the batch")


# The first bad op's inputs and outputs, described (signed finite range, non-finite counts).
# Of its Inf: how many are +inf, and how many rows (along a softmax's dim, else the last) are all
# -inf; of an output, the indices along dim 0 holding a NaN/Inf (recordings made before these
# were kept lack them: read as unknown). ``weight``: the qualified name of the model's parameter
# or buffer an input is (or a view of), else NaN.
TENSOR_COLUMNS = ["role", "dtype", "shape", "numel", "min", "max", "nan_count", "inf_count",
                  "pos_inf_count", "neg_inf_rows", "nonfinite_rows", "weight"]
TENSOR_COLUMNS_REQUIRED = TENSOR_COLUMNS[:8]


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
    uninitialised memory are left out). ``first_bad``: the op row where the non-finite value
    that reaches the event was *born*: finite inputs, non-finite output (an overflow to Inf
    counts), found by following the data flow back from the event's tensor, so an intended
    ±inf that never reaches it (a ``masked_fill(mask, -inf)``, T5's position buckets) is not
    it; None when no op made it (it came with the weights, the data or the gradient reaching
    the model's output: ``came_with``), or when the replay met no event. Without an event but
    with a backward pass (``loss_fn``), the non-finite loss or the last non-finite gradient is
    followed instead. ``first_bad_tensors``: signed ranges and non-finite counts of that op's
    inputs and outputs (of the Inf: how many are +inf, how many rows are all -inf; of an
    output, the indices along dim 0 that hold a NaN/Inf). ``first_bad_grad_of``: for a first bad op of the backward pass, the
    autograd node it ran in ("LogBackward0": the gradient of a log), else "".
    ``first_bad_reads_output``: for a first bad op of ``loss_fn``, whether it read the model's
    output or a tensor made from it (False: only the targets or other tensors ``loss_fn``
    holds, as a box encoding's log of target widths); None for any other op.
    ``first_bad_picked_rows``: its output's rows are ones a gather picked or reordered (the
    tokens a router sent an expert: ``x[idx]``, ``index_select``), so its dim 0 is not the
    batch's samples. ``lineage``: the op indices the value went through, from its birth (or
    the first op that read it from outside) to the op that wrote the event's tensor.
    ``came_with``: ``(kind, name)`` of the non-finite tensors no op made that reached the
    event: "weight" (a parameter or buffer, by qualified name), "input" (the batch's input, by
    role), "output-grad" (the gradient the model's output received: made in the loss) or
    "unknown". ``weights_last_finite``: for those weights, the last batch the event's frames
    show them finite (the optimizer step, load or write after it made them non-finite), when
    they show one.
    ``inf_came_with``: when ``first_bad`` made NaN of Infs no traced op made, ``(kind, name)``
    of the tensors that brought them (kinds as in ``came_with``; "unknown": a tensor computed
    before ``loss_fn`` ran, such as advantages from an Inf reward), else empty.
    ``earlier_inf``: an op whose output held an Inf before the first bad op (a -inf mask, say);
    ``earlier_inf_reaches``: whether that Inf flowed into the event's value.
    ``reproduced``: the replay met the batch's recorded event again (or, with none recorded,
    found none); ``expected`` / ``found`` describe both.
    ``changes``: everything that differs from when the batch ran (parameter values, dtypes,
    storage, modules, and module calls or outputs the batch measured otherwise: the model's
    Python state, like a disabled adapter, is not kept per batch), in words; empty only when
    nothing did. ``weights_changed`` / ``changed_weights``: the parameters and buffers among
    them. ``differs_from_batch``: the replay's module calls or outputs differ from those the
    batch measured (then a replay of a batch with no event that met none is not ``reproduced``).
    ``raised``: what the model's code raised in the replay, which stopped it there ("the forward
    raised ValueError (...)"; the ops before it are traced, none after); "" when it ran through.
    ``backward_from``: what the replay's backward pass started from: "loss" (a ``loss_fn``),
    "outputs" (the gradients the model's outputs received live) or "" (no backward pass).
    """

    batch: int
    frames: pd.DataFrame
    ops: pd.DataFrame
    first_bad: pd.Series | None = None
    first_bad_tensors: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=TENSOR_COLUMNS))
    earlier_inf: pd.Series | None = None
    first_bad_grad_of: str = ""
    first_bad_reads_output: bool | None = None
    first_bad_picked_rows: bool = False
    lineage: list[int] = field(default_factory=list)
    came_with: list[tuple[str, str]] = field(default_factory=list)
    inf_came_with: list[tuple[str, str]] = field(default_factory=list)
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
    differs_from_batch: bool = False  # module calls or outputs unlike the batch's (see changes)
    expected: str = ""  # the recorded event the replay looked for ("" when none)
    found: str = ""  # the event the replay met ("" when none)
    raised: str = ""  # what raised and stopped the replay ("" when it ran through)
    backward_from: str = ""  # "loss", "outputs" or "" (see the class docstring)

    def set_verdict(self, expected: NanEvent | None, found: NanEvent | None) -> None:
        """The replay looked for ``expected`` (the recorded event; None: none was recorded) and
        met ``found`` first (None: none): set :attr:`reproduced`, :attr:`expected` and
        :attr:`found`. Called once, by whoever took the replay's verdict."""
        if expected is None or found is None:
            # Nothing recorded and nothing met agrees only when the replay ran as the batch did.
            self.reproduced = expected is None and found is None and not self.differs_from_batch
        else:
            self.reproduced = (expected.module, expected.call, expected.origin, expected.role) \
                == (found.module, found.call, found.origin, found.role) \
                or _unseen_weight_found(expected, found)
        self.expected = expected.summary() if expected is not None else ""
        self.found = found.summary() if found is not None else ""

    def why_not_reproduced(self) -> str:
        """Why the replay did not meet the recorded event, in one sentence ("" if it did)."""
        if self.reproduced:
            return ""
        if not self.expected and not self.found:
            return "the replay did not run as the batch did: " + "; ".join(self.changes[:3]) \
                + (" ..." if len(self.changes) > 3 else "")
        if not self.expected:
            return f"the replay found an event the run did not record: {self.found}"
        if "(backward)" in self.expected and not self.backward_from and self.loss is None \
                and not self.found:
            return ("the recorded event is in the backward pass and this replay ran the forward "
                    f"only: replay({self.batch}, loss_fn=...) runs the loss and its backward too")
        if self.changes:
            return ("the replay differs from when the batch ran: " + "; ".join(self.changes[:3])
                    + (" ..." if len(self.changes) > 3 else ""))
        if self.raised and not self.found:
            return f"the replay stopped before it, where {self.raised}"
        if self.found:
            return f"the replay met another event first: {self.found}"
        if "(backward)" in self.expected and self.backward_from == "outputs":
            # Seeded with what the outputs received, it met nothing: those gradients were
            # finite, so the NaN came into the backward pass some other way. Not a kernel's or a
            # thread's doing, most likely: the loss had terms a replay from the outputs lacks.
            return ("the replay ran the batch's backward pass from the gradients the model's "
                    "outputs received, which were finite, and every gradient stayed finite: "
                    f"most likely {not_through_outputs(self.batch)}")
        loss = (", or the loss function this replay ran is not the one the batch ran"
                if "(backward)" in self.expected else "")
        return ("the replay ran the same inputs, RNG states and weights and every value stayed "
                "finite: the NaN/Inf depends on something a replay cannot repeat "
                f"(nondeterministic kernels, another thread or process writing the weights{loss})")

    def summary(self) -> str:
        """One line: the first bad op and where, where the value came from, or that every op
        stayed finite."""
        if self.first_bad is None:
            if not self.reproduced:
                what = "the event was" if self.expected else "the batch was"
                return (f"trace of batch {self.batch}: {what} not reproduced, because "
                        f"{self.why_not_reproduced()}")
            if self.came_with:
                found = f" (the event: {self.found})" if self.found else ""
                return (f"trace of batch {self.batch}: no op made the first NaN/Inf; "
                        f"{self._came_with_words()}{found}")
            if self.ops["nonfinite"].any() if len(self.ops) else False:
                if not self.found:
                    return (f"trace of batch {self.batch}: no NaN/Inf reached an event (the ops' "
                            "non-finite values were intended or allowed, like masks)")
                return (f"trace of batch {self.batch}: no op made the first NaN/Inf; it came "
                        f"with the batch's data or the weights: {self.found}")
            stopped = f" (it stopped where {self.raised})" if self.raised else ""
            return (f"trace of batch {self.batch}: all {len(self.ops)} ops produced finite "
                    f"values{stopped}")
        first = self.first_bad
        where = f" in module '{first['module'] or '<root>'}'" if first["phase"] != "loss" else " in loss_fn"
        return (f"trace of batch {self.batch}: first non-finite op {first['op']} "
                f"({first['phase']}){where} at {first['source'] or 'an unknown line'}")

    def _came_with_words(self) -> str:
        """Where the value that reached the event came from, when no op made it."""
        parts = []
        for kind in ("weight", "input", "output-grad", "unknown"):
            names = [name for k, name in self.came_with if k == kind]
            if not names:
                continue
            shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
            if kind == "weight":
                parts.append(f"it came with the weights {shown}")
            elif kind == "input":
                parts.append(f"it came with the batch's input {shown}")
            elif kind == "output-grad":
                parts.append(f"the gradient reaching the model's output ({shown}) was already "
                             "non-finite: it was made in the loss, outside the model")
            else:
                parts.append("it came with a tensor no traced op made")
        return "; ".join(parts)

    def _came_with_lines(self) -> list[str]:
        """The report's lines on where the value came from, when no op made it."""
        lines = [f"No op made the NaN/Inf that reached the event: {self._came_with_words()}."]
        by_batch: dict[int, list[str]] = {}
        for name, batch in self.weights_last_finite.items():
            by_batch.setdefault(batch, []).append(name)
        for batch, names in sorted(by_batch.items()):
            lines.append(f"  {', '.join(names)}: finite when batch {batch} ran; the optimizer step, "
                         f"load or write after batch {batch} made "
                         f"{'it' if len(names) == 1 else 'them'} non-finite.")
        reader = self.first_reader() if any(kind == "unknown" for kind, _ in self.came_with) \
            else None
        if reader is not None:
            if self.ran_in_loss(reader):
                place = "loss_fn" if reader["phase"] == "loss" else "the backward of loss_fn"
            else:
                place = f"module '{reader['module'] or '<root>'}'"
            lines.append(f"  It entered at op {reader['op']} in {place} at "
                         f"{reader['source'] or 'an unknown line'}: a tensor it reads was made "
                         "outside the replay (not the batch's input nor a weight: e.g. computed "
                         "before loss_fn ran, or kept from an earlier batch); check how it was "
                         "made.")
        if any(kind == "output-grad" for kind, _ in self.came_with):
            lines.append(f"  To trace the loss's ops too, replay with it: "
                         f"replay({self.batch}, loss_fn=...) runs the loss on the model's output "
                         "and its backward, and names the op that made the NaN/Inf.")
        return lines

    def first_reader(self) -> pd.Series | None:
        """With no ``first_bad``, the op row that read the NaN/Inf from a tensor no traced op
        made (the lineage's first op), else None."""
        if self.first_bad is not None or not self.lineage or not len(self.ops) \
                or not 0 <= self.lineage[0] < len(self.ops):
            return None
        return self.ops.iloc[self.lineage[0]]

    def ran_in_loss(self, row: pd.Series) -> bool:
        """Whether op ``row`` ran in ``loss_fn``, or in the backward of an op of ``loss_fn``
        (outside any module, at a line where ``loss_fn`` ran an op)."""
        if row["phase"] == "loss":
            return True
        ops = self.ops
        return row["phase"] == "backward" and not row["module"] and bool(row["source"]) \
            and bool(((ops["phase"] == "loss") & (ops["source"] == row["source"])).any())

    def _lineage_line(self) -> str:
        """The ops the bad value went through to the event, briefly."""
        if len(self.lineage) < 2 or not len(self.ops):
            return ""
        steps = [f"{row['op']} ({'loss_fn' if row['phase'] == 'loss' else row['module'] or '<root>'})"
                 for _, row in self.ops.iloc[self.lineage].iterrows()]
        if len(steps) > 6:
            steps = steps[:3] + [f"... {len(steps) - 5} more ..."] + steps[-2:]
        return (f"  From there it went through {len(self.lineage)} ops: "
                + " -> ".join(steps))

    def report(self) -> str:
        """The first bad op with its source line, the weights' state, then every frame."""
        lines = [f"Trace of batch_number={self.batch} (replayed in trace mode: {len(self.ops)} ops, "
                 f"{self._frame_count()} module frames, {self.seconds:.2f} s)"]
        first = self.first_bad
        if self.raised:
            lines.append(f"The replay stopped where {self.raised}: the ops before it are "
                         "traced, none after.")
        if not self.reproduced and not self.expected and not self.found:
            lines.append(f"Not reproduced: the batch recorded no event and the replay met none, "
                         f"but {self.why_not_reproduced()}.")
        elif not self.reproduced:
            lines.append(f"Not reproduced: the recorded event ({self.expected or 'none'}) did not "
                         f"happen again, because {self.why_not_reproduced()}.")
        if first is None:
            if self.came_with:
                lines.extend(self._came_with_lines())
            elif len(self.ops) and self.ops["nonfinite"].any():
                if not self.found:
                    lines.append("No NaN/Inf reached an event: the non-finite values some ops made "
                                 "were intended or allowed (masks filled with -inf, say).")
                else:
                    lines.append("No op made a non-finite value from finite inputs: the first "
                                 "NaN/Inf came with the batch's data or the weights (see the "
                                 "frames below).")
            else:
                lines.append("No op produced a non-finite value in the replay.")
        else:
            kind = "+".join(k for k in ("nan", "inf") if first[k]) or "non-finite"
            module = first["module"] or "<root>"
            module_type = f" ({first['module_type']})" if first["module_type"] else ""
            place = "in loss_fn" if first["phase"] == "loss" else f"in module '{module}'{module_type}"
            grad_of = f", in {self.first_bad_grad_of}" if self.first_bad_grad_of else ""
            lines.append(f"First non-finite op: {first['op']} ({first['aten']}, {first['phase']}"
                         f"{grad_of}) {place}: {kind}")
            source = first["source"]
            if source:
                lines.append(f"  at {source}")
                line, text = source_text(source) or (0, "")
                if text:
                    lines.append(f"  {line:>6} | {text}")
            else:
                lines.append(f"  {NO_USER_LINE}")
            for row in self.first_bad_tensors.itertuples(index=False):
                counts = [f"{n} of {row.numel} {k}" for n, k in ((row.nan_count, "NaN"),
                                                                 (row.inf_count, "Inf")) if n]
                state = ", ".join(counts) if counts else "no NaN or Inf"
                finite_range = (f"finite values from {_number(row.min)} to {_number(row.max)}"
                                if row.min == row.min else "no finite values")
                lines.append(f"  {row.role}: {row.dtype} {tuple(row.shape)}, {finite_range}, {state}")
            lineage = self._lineage_line()
            if lineage:
                lines.append(lineage)
            earlier = self.earlier_inf
            if earlier is not None:
                place = ("loss_fn" if earlier["phase"] == "loss"
                         else f"module '{earlier['module'] or '<root>'}'")
                if self.earlier_inf_reaches:
                    why = ("; that Inf flowed into it (an Inf reaching exp, softmax or a "
                           "subtraction makes NaN)")
                else:
                    why = (" that never reaches the event (intended, like masks filled with "
                           "-inf or T5's position buckets)")
                lines.append(f"  Before it, op {earlier['op']} in {place} held an Inf at "
                             f"{earlier['source'] or 'an unknown line'}{why}.")
            if any(kind == "unknown" for kind, _ in self.inf_came_with):
                lines.append("  Its Inf came with a tensor no traced op made (not the batch's "
                             "input nor a weight: e.g. computed before loss_fn ran, as advantages "
                             "from an Inf reward); check how that tensor was made.")
            masked = self._masked_row_line()
            if masked:
                lines.append(masked)
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

    def _masked_row_line(self) -> str:
        """With no event (whose diagnosis would say it), the first bad op's NaN made of rows a
        mask filled all with -inf, in words: a forward that raised on it before any module
        returned it (a Categorical over logits with every action masked). "" when not one."""
        first, earlier = self.first_bad, self.earlier_inf
        if self.found or first is None or not first["nan"] or earlier is None \
                or not self.earlier_inf_reaches \
                or str(earlier["op"]).lstrip("_") not in INTENDED_INF_OPS:
            return ""
        masked = [row for row in self.first_bad_tensors.itertuples(index=False)
                  if row.role.startswith("input") and row.neg_inf_rows and not row.pos_inf_count]
        if not masked:
            return ""
        row = masked[0]
        rows = f"1 row of its {row.role} is" if row.neg_inf_rows == 1 \
            else f"{row.neg_inf_rows} rows of its {row.role} are"
        return (f"  A fully masked row: {rows} all -inf (every entry masked: no valid action, "
                f"a sequence of padding only), and {first['op']} over such a row makes NaN "
                "(inf - inf, 0/0). Leave one entry of every row unmasked (or skip such rows), "
                "or mask with torch.finfo(dtype).min instead of -inf.")

    def _frame_count(self) -> int:
        return 0 if self.frames.empty else int(self.frames["frame"].nunique())

    def __repr__(self) -> str:
        return f"<Trace {self.summary()}>"

    def _repr_html_(self) -> str:  # pragma: no cover - notebook nicety
        import html
        return f"<pre>{html.escape(self.report())}</pre>"


def _unseen_weight_found(expected: NanEvent, found: NanEvent) -> bool:
    """Whether the replay met, at the recorded event's own module call, a non-finite weight
    that the batch could not see: one on the meta device when its frame was made (accelerate's
    offloading loads the weights inside the forward and puts them back before the hooks run),
    so that the batch's event was the output made from it."""
    if (expected.module, expected.call, expected.origin, found.origin) \
            != (found.module, found.call, "output", "weight"):
        return False
    frames = expected.frames
    if frames is None or not len(frames) or "note" not in frames:
        return False
    own = frames[(frames.module == expected.module) & (frames.role == found.role)]
    return bool(len(own)) and bool((own.note == "meta").all())

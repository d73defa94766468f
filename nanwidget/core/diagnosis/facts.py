"""What a diagnosis reads, as plain values: gathered once, when an event happens.

:class:`Facts` holds the event, the trace that names its op (the event's own, or a replay made
for the diagnosis), the batch's inputs (which rows hold NaN/Inf, which rows are fully masked),
whether the gradient reaching the model's output was already non-finite, the recent history of
module outputs, the weights' log across batches (:class:`WeightLog`) and, for a non-finite
weight, the last batch that ran with it finite. The rules (:mod:`.rules`) only read these.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..detect import additive_mask
from ..entries import Entry, nested_shape
from ..events import NanEvent
from ..frames import Frame
from ..schema import LOCAL_SHARD
from ..writes import steps_taken
from ..stats import (dtype_max, is_distributed_tensor, local_shard, nested_values, storage_holds,
                     widen_float8)

__all__ = ["Facts", "InputFacts", "LossTold", "OpFacts", "WeightLog", "describe_input",
           "loss_told", "op_facts", "output_grad_bad", "weight_names"]

# Batches of weight numbers kept (one float each) and recent history rows read per diagnosis.
WEIGHT_LOG_BATCHES = 64
HISTORY_BATCHES = 16


class WeightLog:
    """The weights across batches, from the frames the watch records anyway (every batch in full
    mode; sampled and replayed batches in sentinel mode): per batch one float, the sum of the
    weights' abs max; per module, its weights' abs max the first time it was seen (recorded
    once); per module, the latest batch that measured all its weights finite. Fed once per
    batch, never in a module hook."""

    def __init__(self, batches: int = WEIGHT_LOG_BATCHES,
                 is_buffer: Callable[[str, str], bool] | None = None) -> None:
        self.batches = batches
        # Whether a module keeps a buffer of that name: an additive mask kept as a buffer
        # (0 and ±inf on purpose: detect.additive_mask) adds nothing to the sums.
        self.is_buffer = is_buffer
        self.series: list[tuple[int, float]] = []  # (batch, sum of the weights' abs max)
        # The same by optimizer step, for a run whose steps are many batches apart (an RL
        # loop's rollout forwards, then its training passes): (optimizer steps taken when the
        # batches ended, the last of them, the largest of their sums); as many entries.
        self.by_step: list[tuple[int, int, float]] = []
        self.first: dict[str, tuple[int, float]] = {}  # module -> (batch, its weights' abs max)
        # module -> the latest batch whose frames measured its weights all finite: when a
        # weight is found non-finite, the batch after which it broke, also when that batch's
        # frames are long gone from the ring and the batch had an event of its own.
        self.last_finite: dict[str, int] = {}
        # The latest batch whose sum was not finite (a weight or buffer non-finite), with the
        # sum over the modules whose own weights were all finite: a lower bound of what the
        # sum would have been, so a jump of it across a step is a jump of the weights.
        self.finite_part: tuple[int, float] | None = None

    def _mask(self, module: str, entry: Entry) -> bool:
        return self.is_buffer is not None and additive_mask(entry) \
            and self.is_buffer(module, entry.role)

    def take(self, frames: list[Frame], held: Sequence[tuple[str, list[Entry]]] = (),
             batch: int = -1) -> None:
        """Fold a batch's resolved frames in (the weight entries of forward frames), and
        ``held``: (module, its weight entries) of the modules that keep weights but are never
        called (a ``ParameterDict`` the forward reads), measured at the end of ``batch``."""
        total = 0.0
        last_finite = self.last_finite
        inf = math.inf
        if not held:
            batch = -1  # the frames' own
        for module, entries in held:
            own = self._sum(module, entries)
            total += own
            if own == own and own != inf and last_finite.get(module, -1) < batch:
                last_finite[module] = batch
        for frame in frames:
            count = frame.first_input  # weights come first; backward frames have none
            if count:
                batch = frame.batch
                entries = frame.entries
                own = 0.0
                for slot in range(count):  # no slice built (every batch in full mode)
                    stats = entries[slot][1]
                    if stats is not None and _is_float_weight(entries[slot]):
                        value = stats.abs_max
                        if value == inf and self._mask(frame.module, entries[slot]):
                            continue
                        own += value
                total += own
                if own == own and own != math.inf and last_finite.get(frame.module, -1) < batch:
                    last_finite[frame.module] = batch
        if batch < 0:
            return
        if not self.first:
            self._first_seen(frames, held, batch)
        if total != total or total == math.inf:
            # A non-finite weight: no point of the climb. Summed again only here (an event's
            # batch), never on a batch whose weights are finite.
            self.finite_part = (batch, self._finite_sum(frames, held))
            return
        series = self.series
        if series and series[-1][0] == batch:  # the same batch again (a replayed context)
            series[-1] = (batch, max(series[-1][1], total))
        elif not series or series[-1][0] < batch:
            series.append((batch, total))
            if len(series) > self.batches:
                del series[0]
        steps, by_step = steps_taken(), self.by_step
        if by_step and by_step[-1][0] == steps:
            if by_step[-1][1] <= batch:
                by_step[-1] = (steps, batch, max(by_step[-1][2], total))
        else:
            by_step.append((steps, batch, total))
            if len(by_step) > self.batches:
                del by_step[0]

    def _finite_sum(self, frames: list[Frame],
                    held: Sequence[tuple[str, list[Entry]]] = ()) -> float:
        """The sum of the weights' abs max over the modules whose own weights are finite."""
        total = 0.0
        measured = [(frame.module, frame.entries[:frame.first_input]) for frame in frames]
        for module, entries in measured + list(held):
            own = self._sum(module, entries)
            if own == own and own != math.inf:
                total += own
        return total

    def _sum(self, module: str, entries: list[Entry]) -> float:
        """The sum of the abs max of a module's weight ``entries`` (floating point ones)."""
        own = 0.0
        for entry in entries:
            stats = entry[1]
            if stats is not None and _is_float_weight(entry):
                value = stats.abs_max
                if value == math.inf and self._mask(module, entry):
                    continue
                own += value
        return own

    def _first_seen(self, frames: list[Frame], held: Sequence[tuple[str, list[Entry]]],
                    batch: int) -> None:
        measured = [(frame.module, frame.batch, frame.entries[:frame.first_input])
                    for frame in frames if frame.first_input]
        measured += [(module, batch, entries) for module, entries in held]
        for module, at, entries in measured:
            if module in self.first:
                continue
            values = [e[1].abs_max for e in entries
                      if e[1] is not None and _is_float_weight(e) and not self._mask(module, e)]
            if values and all(v == v and v != math.inf for v in values):
                self.first[module] = (at, max(values))


def _is_float_weight(entry: Any) -> bool:
    """A floating-point parameter or buffer: integer buffers (BatchNorm's num_batches_tracked,
    step counters) count batches, not weight magnitudes, and are left out of the sums."""
    dtype = entry.dtype
    return not isinstance(dtype, torch.dtype) or dtype.is_floating_point or dtype.is_complex


@dataclass
class InputFacts:
    """One input tensor of the batch: non-finite counts and rows, fully masked rows."""

    role: str
    dtype: str
    shape: tuple
    nan: int = 0
    inf: int = 0
    neg_inf: int = 0  # of the ``inf``, those that are -inf (all of them: a log of 0)
    rows: list[int] = field(default_factory=list)  # samples (along batch_dim) with a NaN/Inf
    masked_rows: list[int] = field(default_factory=list)  # rows with a fully masked vector
    note: str = ""  # "local shard": a DTensor, read on this rank's shard (shape and rows too)
    sample_of: str = ""  # the list input it is one sample of (its rows: its index there)
    # A sample of a list: where in it, ".boxes" for a dict entry's tensor ("" for the entry
    # itself), and the rows of its own tensor (along dim 0: boxes, an image's channels) that
    # hold the NaN/Inf.
    part: str = ""
    within: list[int] = field(default_factory=list)
    batch_dim: int = 0  # the dim of the samples (1: a seq-first RNN's input, its hidden state)
    packed_samples: int = 0  # the data of a PackedSequence of this many samples (rows mapped)
    # An additive mask passed in (a float key_padding_mask, a causal mask): -inf on purpose,
    # no data (see :func:`_holds_a_mask`).
    mask: bool = False
    # (min, max) of an integer tensor (labels) or the value of a one-element one (a count such
    # as the Trainer's num_items_in_batch); None for others.
    value_range: tuple[float, float] | None = None
    # An attention_mask (1 = keep): its rows that start with padding and hold tokens after
    # it (a left-padded batch for generation), each with its count of leading zeros. Of a
    # mask over keys per query (batch, [heads,] queries, keys), the one generate() builds for
    # a static cache: the leading key positions that no query sees.
    left_padding: dict[int, int] = field(default_factory=dict)


# Masks by keyword: True (or nonzero) means "masked" for PyTorch's padding masks, "keep" for
# the attention_mask of transformers models.
_MASKED_WHEN_TRUE = ("key_padding_mask", "padding_mask")
_KEPT_WHEN_TRUE = ("attention_mask",)


_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _rows_where(flags: torch.Tensor, dim: int = 0) -> list[int]:
    """Rows along ``dim`` where any of ``flags`` is set."""
    if flags.dim() <= dim:
        return []
    if dim:
        flags = flags.movedim(dim, 0)
    per_row = flags.reshape(flags.shape[0], -1).any(dim=1) if flags.dim() > 1 else flags
    return [int(r) for r in torch.nonzero(per_row).flatten().tolist()]


def packed_samples(rows: list[int], batch_sizes: list[int],
                   sorted_indices: list[int] | None) -> list[int]:
    """The samples that rows of a PackedSequence's ``data`` belong to: the data holds time
    step after time step, each step the ``batch_sizes[t]`` samples still running, in sorted
    order (``sorted_indices`` maps that order back to the batch's)."""
    starts = list(itertools.accumulate(batch_sizes, initial=0))
    found = set()
    for row in rows:
        step = bisect.bisect_right(starts, row) - 1
        if 0 <= step < len(batch_sizes):
            position = row - starts[step]
            found.add(sorted_indices[position] if sorted_indices else position)
    return sorted(found)


def _holds_a_mask(role: str, values: torch.Tensor) -> bool:
    """Whether a float input holding -inf (and no NaN) is an additive mask, not data: no +inf,
    and its name says mask (``attn_mask``, ``src_key_padding_mask``) or every other value is
    0 or at the dtype's lowest (``torch.finfo(dtype).min``, as transformers fills masks)."""
    if bool(torch.isposinf(values).any()):
        return False
    if "mask" in role.lower():
        return True
    finite = values[torch.isfinite(values)]
    lowest = torch.finfo(values.dtype).min / 2
    return bool(((finite == 0) | (finite <= lowest)).all())


def describe_input(role: str, tensor: torch.Tensor, batch_dim: int = 0) -> InputFacts | None:
    """The facts of one input tensor (None for a tensor it cannot read: meta, sparse, storage
    freed ...), its rows along ``batch_dim``. Reads the tensor once (a diagnosis runs only at
    an event). A DTensor (tensor or sequence parallelism) is read on this rank's shard: only
    the rank with the event gets here, so nothing may ask the other ranks (and DTensor refuses
    ``nonzero``)."""
    note = ""
    if is_distributed_tensor(tensor):
        tensor, note = local_shard(tensor), LOCAL_SHARD
    if tensor.layout is torch.sparse_coo and not tensor.is_meta and tensor.is_floating_point():
        return _describe_sparse_input(role, tensor, batch_dim, note)
    if tensor.is_nested and not tensor.is_meta and tensor.is_floating_point():
        return _describe_nested_input(role, tensor, note)
    if tensor.is_meta or tensor.is_sparse or tensor.is_nested or tensor.numel() == 0 \
            or not storage_holds(tensor):
        return None
    batch_dim = batch_dim if tensor.dim() > batch_dim else 0
    facts = InputFacts(role=role, dtype=str(tensor.dtype).replace("torch.", ""),
                       shape=tuple(tensor.shape), note=note, batch_dim=batch_dim)
    with torch.no_grad():
        values = widen_float8(tensor.detach())
        if values.is_floating_point():
            nan, inf = torch.isnan(values), torch.isinf(values)
            facts.nan, facts.inf = int(nan.sum()), int(inf.sum())
            if facts.nan or facts.inf:
                facts.rows = _rows_where(nan | inf, batch_dim)
            if facts.inf:
                facts.neg_inf = int(torch.isneginf(values).sum())
            if values.dim() >= 2 and facts.inf:
                facts.masked_rows = _rows_where(torch.isneginf(values).all(dim=-1))
            facts.mask = bool(facts.inf) and not facts.nan and _holds_a_mask(role, values)
        if values.dtype in _INTEGER_DTYPES:
            facts.value_range = (int(values.min()), int(values.max()))
        elif values.numel() == 1 and values.is_floating_point():  # a count passed as a float
            facts.value_range = (float(values), float(values))
        if not values.is_floating_point() and values.dim() >= 2 \
                and values.dtype in (torch.bool, torch.int64, torch.int32, torch.int8, torch.uint8):
            name = role.lower()
            if any(key in name for key in _MASKED_WHEN_TRUE):
                facts.masked_rows = _rows_where((values != 0).all(dim=-1))
            elif any(key in name for key in _KEPT_WHEN_TRUE):
                facts.masked_rows = _rows_where((values == 0).all(dim=-1))
                unseen = values == 0
                if values.dim() > 2:  # keys no query sees
                    unseen = unseen.flatten(1, -2).all(dim=1)
                if values.dim() >= 2:
                    leading = unseen.int().cumprod(dim=-1).sum(dim=-1)
                    facts.left_padding = {int(r): int(leading[r]) for r in torch.nonzero(
                        (leading > 0) & (leading < values.shape[-1])).flatten()}
    return facts


def _describe_nested_input(role: str, tensor: torch.Tensor, note: str) -> InputFacts:
    """A nested tensor input (torch.nested: one component per sample): its values, the rows
    being the samples whose component holds NaN/Inf (a jagged one's packed values mapped to
    their samples through its offsets)."""
    facts = InputFacts(role=role, dtype=str(tensor.dtype).replace("torch.", ""),
                       shape=nested_shape(tensor), note=note)
    with torch.no_grad():
        values = nested_values(tensor.detach())
        nan, inf = torch.isnan(values), torch.isinf(values)
        facts.nan, facts.inf = int(nan.sum()), int(inf.sum())
        if not (facts.nan or facts.inf):
            return facts
        if tensor.layout is torch.jagged:
            # Samples lie along the values' ragged dim (the nested dim less the batch's).
            dim = getattr(tensor, "_ragged_idx", 1) - 1
            offsets = tensor.offsets().tolist()
            lengths = tensor.lengths()
            ends = ([start + n for start, n in zip(offsets, lengths.tolist())]
                    if lengths is not None else offsets[1:])
            found = set()
            for position in _rows_where(nan | inf, dim):
                sample = bisect.bisect_right(offsets, position) - 1
                if 0 <= sample < len(ends) and position < ends[sample]:
                    found.add(sample)
            facts.rows = sorted(found)
        else:
            facts.rows = [i for i, part in enumerate(tensor.detach().unbind())
                          if not bool(torch.isfinite(part).all())]
    return facts


def _describe_sparse_input(role: str, tensor: torch.Tensor, batch_dim: int,
                           note: str) -> InputFacts:
    """A sparse COO input: its stored values (duplicates of an uncoalesced one added up), the
    rows along ``batch_dim`` read from their indices."""
    batch_dim = batch_dim if tensor.dim() > batch_dim else 0
    facts = InputFacts(role=role, dtype=str(tensor.dtype).replace("torch.", ""),
                       shape=tuple(tensor.shape), note=note, batch_dim=batch_dim)
    with torch.no_grad():
        values = tensor.detach().coalesce()
        stored, indices = widen_float8(values._values()), values._indices()
        nan, inf = torch.isnan(stored), torch.isinf(stored)
        facts.nan, facts.inf = int(nan.sum()), int(inf.sum())
        if facts.nan or facts.inf:
            bad = nan | inf
            while bad.dim() > 1:  # hybrid sparse: dense dimensions after the sparse ones
                bad = bad.any(dim=-1)
            if batch_dim < indices.shape[0]:
                facts.rows = sorted(set(indices[batch_dim][bad].tolist()))
    return facts


@dataclass
class OpFacts:
    """The trace's first bad op, in plain values: name, where, and its tensors' ranges."""

    op: str
    phase: str  # "forward" | "backward" | "loss"
    module: str
    module_type: str
    source: str
    dtype: str
    nan: bool
    inf: bool
    # role, dtype, min, max, nan_count, inf_count, pos_inf_count, neg_inf_rows
    inputs: list[dict] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)
    grad_of: str = ""  # the autograd node a backward op ran in ("SqrtBackward0"), when known
    grad_of_loss: bool = False  # that node was made by an op of loss_fn (its gradient, e.g. log's)
    # That node's op made NaN already in the forward, at the same line, and the replay's loss is
    # NaN: the forward's value was used (a Dice loss's 0/0), no gradient of 0 met an Inf slope.
    forward_nan: bool = False
    # An op of loss_fn: whether it read the model's output or a tensor made from it (False:
    # only the targets, anchors, weights loss_fn got besides it); None for any other op.
    reads_output: bool | None = None
    # It made NaN of Infs that came with a tensor no traced op made, neither the batch's input
    # nor a weight: one computed before loss_fn ran (advantages from an Inf reward).
    inf_read: bool = False
    # Its output's rows are ones a gather picked (an expert's routed tokens): not samples.
    picked_rows: bool = False

    @property
    def in_loss(self) -> bool:
        """The op ran in ``loss_fn``, or in the backward of an op of ``loss_fn``."""
        return self.phase == "loss" or self.grad_of_loss

    @property
    def grad_of_name(self) -> str:
        """The op whose gradient a backward op computed ("log" for LogBackward0), or ""."""
        return node_op_name(self.grad_of)

    @property
    def name(self) -> str:
        """The op's name without leading underscores (``_softmax`` -> ``softmax``) nor the
        in-place variant's trailing one (``pow_`` -> ``pow``: the same domain)."""
        return self.op.lstrip("_").rstrip("_")

    @property
    def limit(self) -> float:
        """The largest finite value of the op's output dtype."""
        return dtype_max(self.dtype)

    @property
    def place(self) -> str:
        """Where it ran, in words: "in loss_fn", "in module 'x' (Linear)"."""
        if self.phase == "loss":
            return "in loss_fn"
        if self.grad_of_loss:
            return "in the backward of loss_fn"
        module = self.module or "<root>"
        kind = f" ({self.module_type})" if self.module_type else ""
        backward = " during the backward pass" if self.phase == "backward" else ""
        return f"in module '{module}'{kind}{backward}"

    @property
    def at(self) -> str:
        return f" at {self.source}" if self.source else ""

    def input_range(self, position: int = 0) -> tuple[float, float] | None:
        """(min, max) of the finite values of the op's ``position``-th tensor input."""
        if position >= len(self.inputs):
            return None
        row = self.inputs[position]
        low, high = row.get("min", math.nan), row.get("max", math.nan)
        if low != low or high != high:
            return None
        return float(low), float(high)

    def largest_input(self) -> float:
        """The largest |x| among the op's finite inputs (0 when none is known)."""
        largest = 0.0
        for row in self.inputs:
            for key in ("min", "max"):
                value = row.get(key, math.nan)
                if value == value and abs(value) > largest:
                    largest = abs(float(value))
        return largest

    def input_weight(self) -> tuple[str, float] | None:
        """(qualified name, largest |value|) of the first of the op's inputs that is a
        parameter or buffer of the model (CLIP's logit_scale read by exp), or None."""
        for row in self.inputs:
            name = row.get("weight")
            if isinstance(name, str) and name:
                values = [abs(float(row.get(k, math.nan))) for k in ("min", "max")]
                return name, max((v for v in values if v == v), default=math.nan)
        return None

    def inputs_hold_inf(self) -> bool:
        return any(int(row.get("inf_count", 0) or 0) for row in self.inputs)

    def bad_output(self) -> dict | None:
        """The op's first output that holds NaN/Inf (a CTC loss's per-sample losses, not its
        alphas, which hold -inf on purpose), or None."""
        return next((row for row in self.outputs
                     if int(row.get("nan_count", 0) or 0) or int(row.get("inf_count", 0) or 0)),
                    None)

    def inputs_fully_masked(self) -> bool | None:
        """Whether the op's inputs hold Inf as a mask does: only -inf, filling whole rows (a
        fully masked row). False when a +inf is among them (an overflow) or no row is all
        -inf; None when not known (a recording made before the signs were kept)."""
        holding = [row for row in self.inputs if int(row.get("inf_count", 0) or 0)]
        if not holding:
            return False
        positive = [row.get("pos_inf_count") for row in holding]
        rows = [row.get("neg_inf_rows") for row in holding]
        if any(v is None or v != v for v in positive + rows):
            return None
        return not any(positive) and any(rows)


def op_facts(trace: Any) -> OpFacts | None:
    """The first bad op of ``trace`` (None when no op made the value)."""
    first = getattr(trace, "first_bad", None)
    if first is None:
        return None
    tensors = getattr(trace, "first_bad_tensors", None)
    rows = tensors.to_dict("records") if tensors is not None and len(tensors) else []
    grad_of = str(getattr(trace, "first_bad_grad_of", "") or "")
    inf_kinds = [kind for kind, _ in getattr(trace, "inf_came_with", None) or []]
    return OpFacts(op=str(first["op"]), phase=str(first["phase"]), module=str(first["module"]),
                   module_type=str(first["module_type"] or ""), source=str(first["source"] or ""),
                   dtype=str(first["dtype"]), nan=bool(first["nan"]), inf=bool(first["inf"]),
                   inputs=[r for r in rows if str(r["role"]).startswith("input")],
                   outputs=[r for r in rows if str(r["role"]).startswith("output")],
                   grad_of=grad_of, grad_of_loss=_grad_of_loss(trace, first, grad_of),
                   forward_nan=_forward_nan(trace, first, grad_of),
                   reads_output=getattr(trace, "first_bad_reads_output", None),
                   picked_rows=bool(getattr(trace, "first_bad_picked_rows", False)),
                   inf_read=bool(inf_kinds) and all(kind == "unknown" for kind in inf_kinds))


_WORD_START = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def node_op_name(node: str) -> str:
    """The op an autograd node is the gradient of, as torch names it: "log" for LogBackward0,
    "linalg_eigh" for LinalgEighBackward0, "binary_cross_entropy" for
    BinaryCrossEntropyBackward0; "" for no node."""
    return _WORD_START.sub("_", node.split("Backward")[0]).lower() if node else ""


def _grad_of_loss(trace: Any, first: Any, grad_of: str) -> bool:
    """Whether a backward op ran in the gradient of an op of ``loss_fn``: the op its node
    belongs to (``log`` for LogBackward0) ran in the loss phase at the same line."""
    if str(first["phase"]) != "backward" or not grad_of or first["module"]:
        return False
    maker = _forward_makers(trace, first, grad_of)
    return maker is not None and bool(len(maker)) and bool((maker["phase"] == "loss").all())


def _forward_makers(trace: Any, first: Any, grad_of: str) -> Any:
    """The forward (or loss) ops of ``trace`` at the line of the backward op ``first`` whose
    gradient it computes (``grad_of``: its node, LogBackward0 for log); None: no ops traced."""
    ops = getattr(trace, "ops", None)
    if ops is None or not len(ops):
        return None
    name = node_op_name(grad_of)
    return ops[(ops["source"] == first["source"]) & (ops["phase"] != "backward")
               & (ops["op"].astype(str).str.lstrip("_") == name)]


def _forward_nan(trace: Any, first: Any, grad_of: str) -> bool:
    """Whether a backward op ran in the gradient of an op that made NaN in the forward (or in
    loss_fn) at the same line, while the replay's loss is NaN: that NaN was used, not dropped
    by a where or a mask, so its gradient is NaN for the same reason (a 0/0 of the forward's
    numerator and denominator), not for a gradient of 0."""
    loss = getattr(trace, "loss", None)
    if str(first["phase"]) != "backward" or not grad_of or loss is None or loss == loss:
        return False
    maker = _forward_makers(trace, first, grad_of)
    return maker is not None and bool(maker["nan"].astype(bool).any())


def output_grad_bad(frames: list[Frame], batch: int, root: str) -> bool | None:
    """Whether the root's backward frame of ``batch`` among ``frames`` holds a non-finite
    ``grad_output`` (the gradient that reached the model's output); None when there is none."""
    for frame in frames:
        if frame.module == root and frame.phase == "backward" and frame.batch == batch:
            return any(entry.nonfinite for entry in frame.entries
                       if entry.role.startswith("grad_output"))
    return None


def weight_names(event: NanEvent, is_mask: Callable[[str], bool] | None = None) -> list[str]:
    """The qualified names of the non-finite weights in the event's own frame, without those
    ``is_mask`` says are additive masks kept as buffers (no event:
    :func:`~nanwidget.core.detect.additive_mask`)."""
    frames = event.frames
    if frames is None or frames.empty:
        return [event.qualified_role]
    own = frames[(frames["frame"] == event.frame) & (frames["batch"] == event.batch)
                 & (frames["phase"] == "forward") & (frames["nan"] | frames["inf"])]
    roles = [r for r in own["role"] if not r.startswith(("input", "kwarg:", "output"))]
    roles = list(dict.fromkeys([event.role] + roles))
    names = [f"{event.module}.{role}" if event.module else role for role in roles]
    return [n for n in names if is_mask is None or n == names[0] or not is_mask(n)]


# torch's fused loss functions, by the autograd node that makes their result (a loss's
# grad_fn): name -> (the function, what it compares). A loss reduced or combined by hand
# (((out - y) ** 2).mean(), a sum of terms, l1_loss, label smoothing) ends in another node and
# tells nothing.
LOSS_FUNCTIONS = {
    "MseLossBackward0": ("mse_loss", "squared"),
    "SmoothL1LossBackward0": ("smooth_l1_loss", "regression"),
    "HuberLossBackward0": ("huber_loss", "regression"),
    "NllLossBackward0": ("nll_loss (cross_entropy)", "log-prob"),
    "NllLoss2DBackward0": ("nll_loss (cross_entropy)", "log-prob"),
    "BinaryCrossEntropyBackward0": ("binary_cross_entropy", "probability"),
    "BinaryCrossEntropyWithLogitsBackward0": ("binary_cross_entropy_with_logits", "logits"),
    "SoftMarginLossBackward0": ("soft_margin_loss", "logits"),
    "MultiMarginLossBackward0": ("multi_margin_loss", "logits"),
    "MultilabelMarginLossBackward0": ("multilabel_margin_loss", "logits"),
}


# A product or quotient: a loss scaled after its function (its other operand outside the graph).
_SCALINGS = ("MulBackward0", "DivBackward0")


@dataclass
class LossTold:
    """What can be told of a non-finite loss computed outside the model without a trace
    (``NanWatch.explain_loss``): the loss function, by its tensor's grad_fn, and the targets'
    finiteness, when they were given."""

    # The loss tensor's grad_fn class name ("" without one); for a loss function's result
    # scaled after it, the nodes down to the function's ("DivBackward0 over MseLossBackward0").
    grad_fn: str = ""
    scaled: bool = False  # ... scaled by a factor outside the graph after the function
    function: str = ""  # torch's loss function that made it ("mse_loss"; "": not told)
    family: str = ""  # what it compares (LOSS_FUNCTIONS)
    # What the targets held: None: not given; "": all finite; "an Inf", "a NaN", "NaN/Inf".
    targets_held: str | None = None
    target_rows: list[int] = field(default_factory=list)  # rows (dim 0) holding it


def loss_told(loss: Any, target: Any = None) -> LossTold:
    """What ``loss`` (its grad_fn, read now) and ``target`` (a tensor, or None) tell; one host
    read of the target. Event time only."""
    node = loss.grad_fn if isinstance(loss, torch.Tensor) else None
    grad_fn = type(node).__name__ if node is not None else ""
    told = LossTold(grad_fn=grad_fn)
    scalings = []
    while node is not None and len(scalings) < 4 and type(node).__name__ in _SCALINGS:
        # The loss scaled by what is outside the graph (Lightning's loss / accumulate_grad_batches,
        # 0.5 * loss): the node it scaled. A division's graph operand must be its numerator.
        graph = [i for i, (fn, _) in enumerate(node.next_functions) if fn is not None]
        if graph not in ([0], [1]) or (type(node).__name__ == "DivBackward0" and graph != [0]):
            break
        scalings.append(type(node).__name__)
        node = node.next_functions[graph[0]][0]
    name = type(node).__name__ if node is not None else ""
    if name in LOSS_FUNCTIONS:
        told.function, told.family = LOSS_FUNCTIONS[name]
        told.grad_fn = " over ".join(scalings + [name])
        told.scaled = bool(scalings)
    if target is None:
        return told
    values = target.detach()
    if not (values.is_floating_point() or values.is_complex()) or values.is_meta:
        told.targets_held = ""  # integers (class labels) hold no NaN/Inf
        return told
    bad = ~torch.isfinite(values)
    nan, inf = bool(torch.isnan(values).any()), bool(torch.isinf(values).any())
    told.targets_held = "NaN/Inf" if nan and inf else "a NaN" if nan else "an Inf" if inf else ""
    if told.targets_held and values.dim():
        told.target_rows = torch.nonzero(bad.reshape(len(values), -1).any(1)).flatten().tolist()
    return told


@dataclass
class Facts:
    """Everything a diagnosis reads (see the module docstring)."""

    event: NanEvent
    trace: Any = None  # a Trace: the event's own or one replayed for the diagnosis
    op: OpFacts | None = None
    # The gradient reaching the model's output held NaN/Inf (None: not seen).
    output_grad_bad: bool | None = None
    # The event needed a replay for its op, but this process alone cannot run the model (FSDP2,
    # tensor parallel): why ("": not refused).
    replay_refused: str = ""
    # The refusal is this process's alone (FSDP2, tensor parallel: the model is sharded).
    replay_refused_sharded: bool = False
    # The refusal is an input of the batch written in place since: "model" (its own forward
    # wrote it as the batch ran: a cache it fills in place, Mamba's states), "caller" (written
    # after the batch), "" (not this refusal).
    replay_refused_written: str = ""
    has_loss_fn: bool = False  # the watch was given loss_fn (its replays run the loss)
    # A loss computed outside the model, given to NanWatch.explain_loss: what it told.
    loss_told: LossTold | None = None
    # The dtype FSDP2's MixedPrecisionPolicy casts the model's sharded parameters to for the
    # forward (its param_dtype, as the event's frames show them), "" when none is cast: a fix
    # for that dtype names the policy, not torch.autocast.
    policy_dtype: str = ""
    inputs: list[InputFacts] = field(default_factory=list)
    inputs_held: bool = False  # the batch's inputs were read (rows can be told)
    # Root input entries of the batch's frames that held NaN/Inf (when the inputs were not held).
    bad_input_roles: list[str] = field(default_factory=list)
    history_batches: list[int] = field(default_factory=list)
    history_modules: list[str] = field(default_factory=list)
    history: np.ndarray = field(default_factory=lambda: np.empty((0, 0)))
    # Full mode: recent batches in which the event's module did not run (an idle expert).
    idle_batches: list[int] = field(default_factory=list)
    weights: WeightLog = field(default_factory=WeightLog)
    # Module -> its own weights' abs max now (finite values; measured at the event).
    weights_now: dict[str, float] = field(default_factory=dict)
    # Sentinel mode, which records no weights per batch: module -> its own weights' abs max
    # when the watch began (read at the event only), and the optimizer steps taken between
    # then and the event's batch (see rules._growth_since_start).
    weights_at_start: dict[str, float] = field(default_factory=dict)
    steps_since_start: int = 0
    # ... counted as calls of LBFGS's closure: no step ended since the watch began, the
    # step in progress made them all.
    calls_since_start: bool = False
    # The event's forward ran as a closure inside the step in progress of a torch.optim.LBFGS
    # (which calls it once per iteration, more with a line search, all inside one step()):
    # that step's lr, max_iter and line_search_fn, and its first batch (closure call) known.
    lbfgs: dict[str, Any] | None = None
    # Non-finite weight name -> the last batch that ran with it finite.
    weights_last_finite: dict[str, int] = field(default_factory=dict)
    # Non-finite weight name -> the last earlier call of its module in the event's own batch
    # whose frame measured it finite (a step inside the batch wrote it: LBFGS, SAM).
    finite_earlier_in_batch: dict[str, int] = field(default_factory=dict)
    # Sentinel mode: non-finite weight name -> the root forward of the event's batch before
    # which it was last written (a step between forwards of one batch; its frames unmeasured).
    written_between_forwards: dict[str, int] = field(default_factory=dict)
    # Sentinel mode: non-finite weight name -> the earliest held batch since which neither its
    # version counter nor the optimizer's steps moved (it held the value then already).
    unwritten_since: dict[str, int] = field(default_factory=dict)
    # Sentinel mode: the weights whose last finite batch is known only from that batch's finite
    # outputs (no frame measured them), a write after it: likely, not certain.
    finite_by_outputs: set[str] = field(default_factory=set)
    # Non-finite weight of a mixture of experts held as one 3-D weight -> the experts (indices
    # along dim 0) that hold its non-finite values, and how many experts it holds.
    nonfinite_slices: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    # Non-finite weight name -> True when its version counter moved after that batch.
    weights_written: dict[str, bool] = field(default_factory=dict)
    # The non-finite weights whose slot holds another tensor object than when their last finite
    # batch ran (a load_state_dict with assign=True, module.weight = nn.Parameter(...)): replaced,
    # not written in place.
    weights_replaced: set[str] = field(default_factory=set)
    # Non-finite weight name -> the module (qualified name) holding it that was added or
    # replaced after watch() (a fused conv, a swapped layer): the watch never measured it, only
    # the module it replaced.
    replaced_modules: dict[str, str] = field(default_factory=dict)
    # Those of these modules whose name held no module when watched (added, not replaced): no
    # frame ever measured a module of that name.
    new_modules: set[str] = field(default_factory=set)
    # The batches of this process's earlier forward events at the event's module and role (the
    # same non-finite weight, read batch after batch with on_nan="record").
    earlier_batches_here: list[int] = field(default_factory=list)
    # The batches before the event's that read these non-finite weights non-finite already: an
    # earlier forward event at the same module and role, or frames of the event's window that
    # measured every one of them non-finite.
    nonfinite_before: list[int] = field(default_factory=list)
    # The first event of the steps before, each with an event, when the batch's only
    # non-finite inputs are state the model carried over (a KV cache written by those steps).
    state_from: NanEvent | None = None
    # The earlier forward event whose batch's forward wrote these non-finite buffers after
    # they were last seen finite (BatchNorm's running statistics updated from NaN data).
    poisoned_by: NanEvent | None = None
    # Buffers the event batch's own forward wrote into (BatchNorm's running statistics).
    written_in_forward: set[str] = field(default_factory=set)
    # Optimizer steps taken when each held batch started (an optimizer step between two).
    optimizer_steps: dict[int, int] = field(default_factory=dict)
    # The optimizers that stepped while watches were live: class name -> whether it divides by
    # an eps (Adam, RMSprop ...; SGD does not). Empty: none seen.
    optimizers: dict[str, bool] = field(default_factory=dict)
    # Non-finite weight name -> (optimizer class name, lr) of the optimizer step after its last
    # finite batch that wrote it with a NaN/Inf learning rate (a scheduler gone wrong).
    nonfinite_lr: dict[str, tuple[str, float]] = field(default_factory=dict)
    # The event's forward ran inside the optimizer step in progress (a closure: LBFGS's) whose
    # param group had a NaN/Inf lr: that step wrote them before its own end.
    lr_step_in_progress: bool = False
    # Non-finite weight name -> the non-finite state tensors an optimizer wrapper keeps for it
    # ("Lookahead.state[p]['slow']"): the wrapper copies them into the weight.
    wrapper_state_nonfinite: dict[str, list[str]] = field(default_factory=dict)
    # Non-finite weight name -> what wrote it outside any torch optimizer step ("SAM": a param
    # group of the optimizer holding it has SAM's rho; "SAM step": the event's forward was a
    # closure inside sam.step(closure), after its first_step; "" when unknown): its version
    # counter moved after its last finite batch, and no optimizer step wrote it since.
    written_outside_step: dict[str, str] = field(default_factory=dict)
    # Non-finite weight name no optimizer step wrote -> "buffer" (in no optimizer), "parameter"
    # (one without a gradient that no step the watch saw updated, while optimizer steps were
    # seen: an EMA copy's, AveragedModel's) or "no step" (no optimizer step ran under the watch,
    # and no gradient for an update by hand: inference, a load mid-run): a write, an average or
    # a load did it.
    not_stepped: dict[str, str] = field(default_factory=dict)
    # Non-finite weight name -> the load of the model's state (core.loads.Load) that wrote it
    # after its last finite batch (or during the watch, before any batch ran with it), with
    # nothing written since: the state dict loaded held the NaN/Inf.
    loaded: dict[str, Any] = field(default_factory=dict)
    # Backward passes the watch checked (backward=True); None when it does not count them.
    backward_passes: int | None = None
    # The watch checks every backward pass's gradients (backward=True) ...
    checks_gradients: bool = False
    # Full mode: a non-finite weight is a parameter FSDP2 shards, whose gradient it does not
    # measure (checks_gradients is then False).
    sharded_gradients_unchecked: bool = False
    # ... and found a non-finite one before this event: its event (None: all were finite).
    gradient_event_before: NanEvent | None = None
    # The event's non-finite weights whose slots hold stand-ins, not parameters (the forward
    # runs with other tensors in their place: torch.func.functional_call).
    substituted: set[str] = field(default_factory=set)
    sentinel: bool = False
    sample_every: int | None = None  # sentinel mode's: one batch in N recorded in full
    # A backward event's batch already had a forward event (on_nan="record" or "warn"): the
    # loss and its gradient carried that NaN/Inf on.
    forward_event: NanEvent | None = None
    # A backward event whose gradient reached the model's output non-finite, in a batch whose
    # earlier backward pass (torch.autograd.grad(create_graph=True): a PINN's derivatives, a
    # gradient penalty) already made an event: the loss took that pass's result.
    earlier_pass_event: NanEvent | None = None
    # A backward event at a parameter whose .grad an earlier pass left non-finite and this one
    # only added to (no zero_grad() between: gradient accumulation): that pass's event.
    accumulated_from: NanEvent | None = None
    # A backward event at a parameter's gradient, under several ranks, whose pass on this rank
    # kept every module's gradient finite: DDP's all-reduce brought another rank's NaN in.
    from_another_rank: bool = False
    # The module called directly, outside the model's forward, whose pass the event is in (a
    # GAN's discriminator): its inputs are not held, and a replay does not run it. "" if none.
    outside_pass: str = ""
    # For a NaN/Inf the outside pass's call got with its inputs: the outermost modules whose
    # calls ran before it in the batch ([] when it was the batch's first call; None when the
    # frames to tell are gone): the code between their calls and it may have made it.
    outside_earlier: list[str] | None = None
    # A weight's event whose module did not run in the replayed forward of its batch, whose
    # inputs held the NaN/Inf: a call of that module outside the forward made them (generate()
    # runs the encoder or the vision tower once, before the forwards): no bad data.
    made_outside_forward: bool = False
    # An event at a module the model holds that ran after the model's forward returned, outside
    # it: a loss kept as a submodule and called on the output (loss = self.loss(out, y)).
    called_on_output: bool = False
    # The event needed a replay for its op, but the watch's diagnosis replays, this many, were
    # all spent on earlier events (0: not spent).
    replays_spent: int = 0
    # The latest earlier event at the same module, role and phase with a known cause.
    same_place: NanEvent | None = None
    # The event of a GradScaler's scaler_patience-th skipped step in a row: those steps
    # (a grads.scaler.SkipRun: batches, scales, steps taken before, the loss).
    scaler_run: Any = None
    # A forward event whose batch's model outputs stayed finite (something after it clamped,
    # masked or replaced the value): the modules whose outputs held NaN/Inf in that batch, in
    # the model's order. Empty when the outputs were not finite or cannot be told.
    absorbed_in: list[str] = field(default_factory=list)
    # Whether the weight of this qualified name is an additive mask kept as a buffer (no
    # event, so no non-finite weight to name; :func:`~nanwidget.core.detect.additive_mask`).
    is_mask: Callable[[str], bool] | None = None
    # Whether the weight of this qualified name is a buffer (BatchNorm's running statistics):
    # no optimizer steps it, whatever else is known about the batches before.
    is_buffer: Callable[[str], bool] | None = None
    # A forward event: every module whose outputs held NaN/Inf in its batch, the root's
    # included, in the model's order (empty when it cannot be told).
    outputs_holding: list[str] = field(default_factory=list)
    # An "output" event no replayed op explains, of a module that, with every module inside
    # it, holds no parameter or buffer: no weight it read was measured (a PyroSample's); or,
    # op or not, of a module whose weights are packed or tensor subclasses the watch could not
    # read (quantized ones). ``unseen_note`` says which (the note added to the event).
    weights_unseen: bool = False
    unseen_note: str = ""
    # Those weights are quantized (packed by torch.ao, or torchao tensor subclasses).
    unseen_quantized: bool = False
    # A forward event whose batch ran with the model's peft-style adapters switched off (``with
    # model.disable_adapter():``: the base model alone, a reference forward); with whether it
    # ran with gradients on and the model in train mode (None: not known, or neither case).
    adapters_disabled: bool = False
    # ... or with other adapters active than when the model was watched (their names; TRL's
    # "ref" copy of the trained adapter); empty otherwise. With its adapters then: ``watched``.
    adapters_switched: tuple[str, ...] = ()
    adapters_watched: tuple[str, ...] = ()
    ran_with_grad: bool | None = None
    ran_in_train_mode: bool | None = None

    def batch_size(self) -> int | None:
        """The number of samples in the batch: the size its inputs share along their sample
        dim (a PackedSequence's samples; a list's per-sample tensors left out). None when no
        input tells, or when they disagree (a seq-first input beside per-sample lengths: which
        size is the batch's cannot be told)."""
        sizes = {item.packed_samples or item.shape[item.batch_dim] for item in self.inputs
                 if not item.sample_of and (item.packed_samples or len(item.shape) > item.batch_dim)}
        return sizes.pop() if len(sizes) == 1 else None

    def series(self, module: str) -> list[tuple[int, float]]:
        """Recent (batch, output abs max) of ``module``, finite values only, oldest first."""
        if module not in self.history_modules or not len(self.history_batches):
            return []
        column = self.history[:, self.history_modules.index(module)]
        return [(b, float(v)) for b, v in zip(self.history_batches, column)
                if v == v and not math.isinf(v)]

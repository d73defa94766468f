"""The shapes of nanwidget's data, in one place: every table's columns and dtypes, the note
vocabulary, the role groups and the fields of an event.

Everything else (frames, history, gradients, replay, persistence, plots, widgets) reads these
names from here, so a column or a note is added once. Imports pandas and numpy only.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = [
    "FRAME_COLUMNS", "FRAME_DTYPES", "HISTORY_COLUMNS", "HISTORY_DTYPES",
    "GRAD_HISTORY_COLUMNS", "GRAD_HISTORY_DTYPES", "OPS_COLUMNS", "OPS_DTYPES",
    "OP_ROWS_DESCRIBED",
    "column_kinds", "empty_table", "NOTES", "NOTES_WITH_STATS", "NO_STATS_NOTES", "LEAF_NOTES",
    "note_has_stats", "PENDING", "NO_USER_LINE",
    "CHANGED_LATER", "LOCAL_SHARD", "PACKED", "DEQUANTIZED", "ROLE_GROUPS", "role_group", "role_groups", "is_input_role",
    "is_output_role", "EVENT_FIELDS", "ORIGINS", "KINDS",
]

# ---------------------------------------------------------------------------------- tables
# One row per tensor seen in one module call (the contract's frame DataFrame).
FRAME_COLUMNS = ["rank", "batch", "frame", "module", "module_type", "call", "phase", "role",
                 "dtype", "shape", "abs_min", "abs_max", "finite_abs_min", "finite_abs_max",
                 "nan", "inf", "note"]
FRAME_DTYPES = {"rank": "int64", "batch": "int64", "frame": "int64", "module": "object",
                "module_type": "object", "call": "int64", "phase": "object", "role": "object",
                "dtype": "object", "shape": "object", "abs_min": "float64", "abs_max": "float64",
                "finite_abs_min": "float64", "finite_abs_max": "float64", "nan": "bool",
                "inf": "bool", "note": "object"}

# One row per (batch or merged window of batches, module): the module's output magnitudes.
HISTORY_COLUMNS = ["rank", "batch", "batch_end", "module", "module_type", "abs_max", "abs_min",
                   "nonfinite"]
HISTORY_DTYPES = {"rank": "int64", "batch": "int64", "batch_end": "int64", "module": "object",
                  "module_type": "object", "abs_max": "float64", "abs_min": "float64",
                  "nonfinite": "bool"}

# One row per (batch or window, parameter): the gradient's L2 norm.
GRAD_HISTORY_COLUMNS = ["rank", "batch", "batch_end", "param", "norm", "nonfinite"]
GRAD_HISTORY_DTYPES = {"rank": "int64", "batch": "int64", "batch_end": "int64",
                       "param": "object", "norm": "float64", "nonfinite": "bool"}

# One row per tensor op of a trace-mode replay.
OPS_COLUMNS = ["index", "phase", "op", "aten", "module", "module_type", "dtype", "shape",
               "abs_min", "abs_max", "nan", "inf", "nonfinite", "source"]
OPS_DTYPES = {"index": "int64", "phase": "object", "op": "object", "aten": "object",
              "module": "object", "module_type": "object", "dtype": "object", "shape": "object",
              "abs_min": "float64", "abs_max": "float64", "nan": "bool", "inf": "bool",
              "nonfinite": "bool", "source": "object"}
# The first bad op's output rows (along dim 0) holding NaN/Inf that a trace names, at most.
OP_ROWS_DESCRIBED = 64

_KIND_OF_DTYPE = {"int64": "int", "float64": "float", "bool": "bool", "object": "str"}


def column_kinds(dtypes: dict[str, str]) -> dict[str, str]:
    """Plain kinds ("int", "float", "bool", "str") of a table's columns, as files store them."""
    return {name: _KIND_OF_DTYPE[dtype] for name, dtype in dtypes.items()}


def empty_table(columns: list[str], dtypes: dict[str, str]) -> pd.DataFrame:
    """A table with these columns, their dtypes, and no rows."""
    return pd.DataFrame({name: pd.Series(dtype=dtypes[name]) for name in columns})


# ---------------------------------------------------------------------------------- notes
PENDING = "pending"  # internal: stats not measured yet (never in a resolved frame)
CHANGED_LATER = "changed in place later"
# Where a first bad op ran when no line of the user's code is on its stack (an op inside a
# library's layer; a replay is called from nanwidget, not from the user's loop).
NO_USER_LINE = "(in library code, not a line of yours)"
WRITTEN_HERE = "written in place here"
LOCAL_SHARD = "local shard"
# Weights no hook reads, measured at an event: a torch.ao module's packed ones, a torchao one.
PACKED = "packed, read at the event"
DEQUANTIZED = "dequantized at the event"

# Every note a frame row can carry, with what it means. Rows with these notes have no stats
# (abs_min and abs_max NaN) unless the note is in the second dict.
NOTES: dict[str, str] = {
    "None": "the value was None",
    "not a tensor": "the value is some other Python object",
    "not read": "an iterator or generator (reading it would consume it), or a structure "
                "that contains itself",
    "empty": "a tensor with no elements",
    "bool": "a boolean tensor (no magnitudes)",
    "meta": "a meta tensor (no data)",
    "storage freed": "its storage was freed (FSDP between forwards) before it could be read",
    "unsupported": "reading it failed (an exotic tensor subclass); the note names the error",
}
# Notes on rows that still carry stats.
NOTES_WITH_STATS: dict[str, str] = {
    CHANGED_LATER: "the NaN/Inf look-up saw the tensor after a later in-place write",
    WRITTEN_HERE: "the module wrote into this input and returned it; shown as handed over",
    LOCAL_SHARD: "a DTensor (FSDP2, tensor parallel): stats and shape are this rank's shard",
    PACKED: "a quantized module's packed weight (weight(), bias()): unpacked and measured at "
            "the event, dequantized",
    DEQUANTIZED: "a quantized tensor subclass (torchao) no hook reads: measured at the event, "
                 "dequantized",
}
# Kinds that recordings made before nanwidget measured them noted instead of stats.
LEGACY_KIND_NOTES = ("int", "complex", "sparse", "nested", "quantized")
NO_STATS_NOTES = frozenset(NOTES) | frozenset(LEGACY_KIND_NOTES)
# Leaves that are not tensors: a text report prints them as transformers does ("None input[2]").
LEAF_NOTES = ("None", "not a tensor", "not read")


def note_has_stats(note: str) -> bool:
    """Whether a row with this note carries abs_min / abs_max ("unsupported (...)" does not)."""
    return not note or note in NOTES_WITH_STATS or (
        note not in NO_STATS_NOTES and not note.startswith("unsupported"))


# ---------------------------------------------------------------------------------- roles
ROLE_GROUPS = ("weights", "inputs", "outputs", "grads")


def is_input_role(role: str) -> bool:
    """``input[...]`` or ``kwarg:...``."""
    return role.startswith(("input", "kwarg:"))


def is_output_role(role: str) -> bool:
    """``output``, ``output[1]``, ``output.logits`` ..."""
    return role.startswith("output")


def role_group(role: str, phase: str = "forward") -> str:
    """"grads" (backward rows), "inputs", "outputs" or "weights" (own parameters and buffers)."""
    if phase == "backward" or role.startswith("grad"):
        return "grads"
    if is_input_role(role):
        return "inputs"
    if is_output_role(role):
        return "outputs"
    return "weights"


def role_groups(frames: pd.DataFrame) -> pd.Series:
    """:func:`role_group` of every row of a frames DataFrame, vectorised."""
    role = frames["role"].astype(str)
    groups = np.full(len(frames), "weights", dtype=object)
    groups[role.str.startswith(("input", "kwarg:")).to_numpy()] = "inputs"
    groups[role.str.startswith("output").to_numpy()] = "outputs"
    backward = (frames["phase"].astype(str) == "backward").to_numpy() | \
        role.str.startswith("grad").to_numpy()
    groups[backward] = "grads"
    return pd.Series(groups, index=frames.index, name="role_group")


# ---------------------------------------------------------------------------------- events
ORIGINS = ("output", "input", "weight", "grad", "peer")
KINDS = ("nan", "inf", "nan+inf")

# The plain fields of a NanEvent and their types: what files and other ranks exchange.
EVENT_FIELDS: dict[str, type] = {"batch": int, "module": str, "module_type": str, "call": int,
                                 "role": str, "kind": str, "origin": str, "is_backward": bool,
                                 "rank": int, "frame": int}


# Ops that write an Inf on purpose (masks); an Inf they made that turns into NaN later is a mask.
INTENDED_INF_OPS = ("masked_fill", "fill", "full", "where", "index_put", "copy", "masked_scatter")


def masks_rows(op_name: str) -> bool:
    """Whether an op of this name (leading underscores aside) normalises over rows that a mask
    can block everywhere, making NaN of a fully masked row: a softmax, an attention."""
    name = op_name.lstrip("_")
    return "softmax" in name or "scaled_dot_product" in name or "attention" in name \
        or name == "transformer_encoder_layer_fwd"  # nn.TransformerEncoderLayer's fused path

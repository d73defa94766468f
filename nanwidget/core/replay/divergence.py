"""Whether a replay ran as its batch did, told from what the watch kept of the batch anyway.

A batch holds its inputs, RNG states, modes and weights, not the model's Python attributes
(reading them every batch would cost every batch): a batch run under peft's
``with model.disable_adapter():``, or with a flag switching a branch, is replayed in the state
the model is in at replay time. What shows it, read after the replay only: the history row of
the batch (every watched module whose outputs it measured, and their abs max; in sentinel mode
the root's alone) against the replay's own frames. Modules that ran in one but not the other,
or outputs that differ beyond rounding, are changes in words.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from ..frames import Frame
from ..records import QUANTIZED_DTYPES

__all__ = ["ModuleOutputs", "replay_outputs", "ran_differently", "adapter_layer", "adapter_state"]

# Relative difference of two abs max values still taken for rounding (reduction order, a
# nondeterministic kernel): at least this, or a few units in the last place of the dtype.
_MIN_RELATIVE = 1e-3
_ULPS = 16
_SHOWN = 4


class ModuleOutputs:
    """One module's outputs over a replay, folded as the history folds them."""

    __slots__ = ("abs_max", "nonfinite", "dtype", "last_frame")

    def __init__(self, dtype: torch.dtype) -> None:
        self.abs_max = -math.inf
        self.nonfinite = False
        self.dtype = dtype
        self.last_frame = -1


def replay_outputs(frames: Iterable[Frame], watched: set[str]) -> dict[str, ModuleOutputs]:
    """The replay's forward frames folded per watched module as the history folds a live
    batch (float, complex and quantized outputs; abs max of the finite ones), in the order the
    modules first returned."""
    folded: dict[str, ModuleOutputs] = {}
    for frame in frames:
        if frame.phase != "forward" or frame.module not in watched:
            continue
        for _, stats, dtype, _, _ in frame.outputs():
            if stats is None or dtype is None or not (
                    dtype.is_floating_point or dtype.is_complex or dtype in QUANTIZED_DTYPES):
                continue
            outputs = folded.get(frame.module)
            if outputs is None:
                outputs = folded[frame.module] = ModuleOutputs(dtype)
            high = stats.abs_max
            if high == high and high > outputs.abs_max:
                outputs.abs_max = high
            outputs.nonfinite = outputs.nonfinite or stats.nan or stats.inf
            outputs.last_frame = frame.index
    return folded


def ran_differently(live: dict[str, tuple[float, bool]] | None, replayed: dict[str, ModuleOutputs],
                    root_name: str, *, replay_complete: bool, compare_values: bool,
                    model: nn.Module) -> list[str]:
    """How the replay's module calls and outputs differ from the batch's, in words (empty when
    they agree, or when the batch left nothing to compare). ``live``: the batch's history row
    (module -> abs max of its finite outputs, any non-finite); ``replayed``: from
    :func:`replay_outputs`. ``replay_complete``: the replay ran every call the batch ran (its
    forward did not raise, no call was left out), so a module missing from it is a difference.
    ``compare_values``: nothing already listed explains other values (changed weights, a
    generator whose state a batch does not keep)."""
    if not live or not replayed:
        return []
    differences: list[str] = []
    if any(name != root_name for name in live):  # the batch recorded every module (full)
        only_replayed = [name for name in replayed if name not in live]
        if root_name not in live and only_replayed:
            # The batch's forward did not return (it raised): what the replay ran after the
            # last module the batch returned from may simply not have been reached.
            reached = max(outputs.last_frame for name, outputs in replayed.items()
                          if name in live) if any(name in live for name in replayed) else -1
            only_replayed = [name for name in only_replayed
                             if replayed[name].last_frame < reached]
        only_live = [name for name in live if name not in replayed] if replay_complete else []
        if only_replayed:
            differences.append(f"modules ran in the replay that did not run in the batch "
                               f"({_names(only_replayed)}): {_state_words(model)}")
        if only_live:
            differences.append(f"modules ran in the batch that did not run in the replay "
                               f"({_names(only_live)}): {_state_words(model)}")
    if differences or not compare_values:
        return differences
    # A module whose outputs held a NaN/Inf on either side is the verdict's to compare (the
    # sentinel keeps the root's magnitude of clean forwards only).
    differing = [name for name, outputs in replayed.items()
                 if name in live and not live[name][1] and not outputs.nonfinite
                 and _differ(live[name][0], outputs)]
    if differing:
        first = differing[0]
        where = "the model's outputs" if first == root_name else f"the outputs of '{first}'"
        more = f" and {len(differing) - 1} more modules" if len(differing) > 1 else ""
        differences.append(
            f"{where}{more} differ from the batch's beyond rounding (abs max "
            f"{live[first][0]:.6g} in the batch, {replayed[first].abs_max:.6g} in the replay): "
            f"{_state_words(model, values=True)}")
    return differences


def _differ(live_max: float, outputs: ModuleOutputs) -> bool:
    replay_max = outputs.abs_max
    if not (math.isfinite(live_max) and math.isfinite(replay_max)):
        return False  # no finite output on one side
    dtype = outputs.dtype
    if dtype.is_complex:
        dtype = torch.empty((), dtype=dtype).real.dtype
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 1 / 256  # quantized: 8 bits
    tolerance = max(_MIN_RELATIVE, _ULPS * eps) * max(abs(live_max), abs(replay_max))
    return abs(live_max - replay_max) > tolerance + torch.finfo(torch.float32).tiny


def _names(names: list[str]) -> str:
    shown = ", ".join(name or "<root>" for name in names[:_SHOWN])
    return f"{shown} ... {len(names)} modules" if len(names) > _SHOWN else shown


def _state_words(model: nn.Module, *, values: bool = False) -> str:
    """Why a replay can run other code than its batch, with the adapter state now where the
    model has peft-style adapters."""
    words = ("the model's Python state differs from when the batch ran (an adapter "
             "enabled/disabled, a flag set)")
    if values:
        words += (", or something else a batch does not keep changed (a random generator of "
                  "the model's own, a nondeterministic kernel)")
    adapters = adapter_state(model)
    return f"{words}; {adapters}" if adapters else words


def adapter_layer(model: nn.Module) -> nn.Module | None:
    """The first module of ``model`` with peft-style adapters (None when it has none): one
    with ``active_adapters`` and a bool ``disable_adapters`` (peft's tuner layers, which
    ``with model.disable_adapter():`` switches off together). Peft is never imported here."""
    for module in model.modules():
        try:
            active = getattr(module, "active_adapters", None)
            disabled = getattr(module, "disable_adapters", None)
        except Exception:  # a property that cannot answer here
            continue
        if isinstance(disabled, bool) and isinstance(active, (list, tuple, str)):
            return module
    return None


def adapter_state(model: nn.Module) -> str:
    """The peft-style adapter state of ``model`` now, in words ("" when it has none): read from
    :func:`adapter_layer`, at a replay only."""
    layer = adapter_layer(model)
    if layer is None:
        return ""
    active = layer.active_adapters
    names = [active] if isinstance(active, str) else list(active)
    shown = ", ".join(f"'{name}'" for name in names) or "none"
    state = "disabled" if layer.disable_adapters else "enabled"
    return (f"the replay ran with adapters {state} (active: {shown}); a batch run under "
            "disable_adapter() or another set_adapter() differs")

"""Gradient norms (``check_grad_norms``): after ``loss.backward()``, the L2 norm of every parameter
gradient in one batched reduction (``torch._foreach_norm`` per device and dtype, accumulated in
float64) and one host copy. A :class:`GradEvent` is recorded for each non-finite norm and each
norm above ``grad_norm_warn``; norms go into a bounded history. With a ``grad_scaler`` a
non-finite norm is the scaler's to skip (an overflow of the scaled gradients): not flagged."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from ..events import GradEvent
from ..history import History
from ..recorder import Feature, Recorder
from ..schema import GRAD_HISTORY_COLUMNS, GRAD_HISTORY_DTYPES, empty_table
from ..stats import local_shard
from .scaler import scaling_enabled

__all__ = ["GradNorms", "grad_norms", "empty_grad_history", "MAX_GRAD_EVENTS",
           "GRAD_HISTORY_FULL_BATCHES", "GRAD_HISTORY_WINDOWS", "GRAD_HISTORY_WINDOW"]

MAX_GRAD_EVENTS = 1_000
# Gradient-norm history bounds (core.history.History): the last FULL batches one row each (plus
# the window about to be merged); older batches merged into at most WINDOWS windows that keep
# the largest norm and whether any was non-finite. 300 parameters cost about 10 MB.
GRAD_HISTORY_FULL_BATCHES = 2_000
GRAD_HISTORY_WINDOWS = 500
GRAD_HISTORY_WINDOW = 20


def empty_grad_history() -> pd.DataFrame:
    """A gradient-norm history with the contract's columns and no rows."""
    return empty_table(GRAD_HISTORY_COLUMNS, GRAD_HISTORY_DTYPES)


class GradNorms(Feature):
    """Gradient-norm checks, their events and history for one watch."""

    def __init__(self, recorder: Recorder, *, threshold: float | None,
                 scaler: Any = None) -> None:
        self.recorder = recorder
        self.threshold = threshold
        # A GradScaler (grad_scaler=): a non-finite norm is an overflow it skips the step for,
        # not flagged here (it is still in the history).
        self.scaler = scaler
        self.history: History | None = None  # created on the first check (parameter names)
        self._param_index: dict[str, int] = {}
        self.events: list[GradEvent] = []
        self.events_dropped = 0
        self._flagged_batch: int | None = None
        self._flagged: set[str] = set()  # parameters already flagged in _flagged_batch
        self._last_forward_batch: int | None = None

    def on_batch_start(self, batch: int, args: tuple, kwargs: dict) -> None:
        self._last_forward_batch = batch

    def check(self) -> bool:
        """See :meth:`nanwidget.NanWatch.check_grad_norms`."""
        recorder = self.recorder
        if recorder.closed:
            raise RuntimeError("this watch is closed; gradient norms are checked while it watches")
        # Backward frames the end of their pass did not resolve (it failed) are reported first.
        recorder.flush()
        named = [(name, p) for name, p in recorder.model.named_parameters() if p.grad is not None]
        if not named:
            return False
        # A DTensor gradient (FSDP2, tensor parallel) is measured on this rank's shard: no
        # collective here, the ranks agree through the consensus afterwards.
        norms = grad_norms([local_shard(p.grad) for _, p in named])
        batch = self._last_forward_batch if self._last_forward_batch is not None else recorder.batch
        threshold = self.threshold
        rank = recorder.rank
        flagged = False
        scaled = self.scaler is not None and scaling_enabled(self.scaler)
        with recorder.lock:
            if self.history is None:
                names = [name for name, _ in recorder.model.named_parameters()]
                self._param_index = {name: i for i, name in enumerate(names)}
                self.history = History(names, ["parameter"] * len(names), rank=rank,
                                       full_batches=GRAD_HISTORY_FULL_BATCHES,
                                       max_windows=GRAD_HISTORY_WINDOWS,
                                       window=GRAD_HISTORY_WINDOW)
            history, index = self.history, self._param_index
            added = [name for name, _ in named if name not in index]
            if added:  # parameters added to the model since the first check
                first = len(index)
                index.update({name: first + i for i, name in enumerate(added)})
                history.add_modules(added, ["parameter"] * len(added))
            for (name, _), norm in zip(named, norms):
                finite = math.isfinite(norm)
                position = index.get(name)
                if position is not None:
                    history.record(batch, position, norm, norm, not finite)
                if (finite or scaled) and (threshold is None or not finite or norm <= threshold):
                    continue
                flagged = True
                if self._flagged_batch != batch:
                    self._flagged_batch, self._flagged = batch, set()
                if name in self._flagged:
                    continue
                self._flagged.add(name)
                if len(self.events) < MAX_GRAD_EVENTS:
                    self.events.append(GradEvent(batch=batch, param=name, norm=norm,
                                                 threshold=threshold, rank=rank))
                else:
                    self.events_dropped += 1
        return flagged

    def history_table(self) -> pd.DataFrame:
        """Gradient norms per batch and parameter (:data:`GRAD_HISTORY_COLUMNS`)."""
        if self.history is None:
            return empty_grad_history()
        table = self.history.to_dataframe()
        if table.empty:
            return empty_grad_history()
        table = table.rename(columns={"module": "param", "abs_max": "norm"})
        return table[GRAD_HISTORY_COLUMNS].reset_index(drop=True)


def grad_norms(grads: list[torch.Tensor]) -> list[float]:
    """L2 norm of each gradient: one ``_foreach_norm`` per (device, dtype), one host copy."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    sparse: list[int] = []
    for position, grad in enumerate(grads):
        if grad.layout is not torch.strided:
            sparse.append(position)
        else:
            groups.setdefault((grad.device, grad.dtype), []).append(position)
    order: list[int] = []
    parts: list[torch.Tensor] = []
    with torch.no_grad():
        for (_, dtype), positions in groups.items():
            group = [grads[p] for p in positions]
            if dtype.is_floating_point:
                # Accumulate in float64: squares of finite float32 (or bfloat16) gradients above
                # ~1e19 overflow a float32 sum, which would report an exploding but finite
                # gradient as non-finite.
                norms = torch._foreach_norm(group, 2, dtype=torch.float64)
            else:  # complex (rare): no fused kernel needed
                norms = [torch.linalg.vector_norm(g.to(torch.complex128)) for g in group]
            parts.append(torch.stack([n.double() for n in norms]))
            order.extend(positions)
        for position in sparse:
            parts.append(grads[position].coalesce().values().double().norm().reshape(1))
            order.append(position)
        if not parts:
            return []
        target = parts[0].device
        values = torch.cat([part.to(target) for part in parts]).tolist()  # the one host sync
    result = [math.nan] * len(grads)
    for position, value in zip(order, values):
        result[position] = value
    return result

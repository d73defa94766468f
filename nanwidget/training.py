"""A guarded training loop: train under a watch and stop at the first NaN/Inf.

Application code built on the public API of :mod:`nanwidget.core` (a watch, its events and
gradient-norm check); it shows progress with tqdm when installed.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pandas as pd
import torch
from torch import nn

from .core.events import GradEvent, NanEvent
from .core.watch import NanWatch, watch

__all__ = ["train_with_nan_guard"]


def _to_device(value: Any, device: torch.device | str | None) -> Any:
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _split_batch(item: Any) -> tuple[Any, Any]:
    if isinstance(item, Mapping):
        return item, item
    if isinstance(item, (list, tuple)) and len(item) == 2:
        return item[0], item[1]
    raise TypeError("train_with_nan_guard: the loader must yield (inputs, targets) pairs or dicts, "
                    f"got {type(item).__name__}" + (f" of length {len(item)}"
                                                     if isinstance(item, (list, tuple)) else ""))


def _call_model(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


def _loss_value(loss: Any) -> torch.Tensor:
    if isinstance(loss, torch.Tensor):
        return loss
    value = getattr(loss, "loss", None)  # a transformers ModelOutput passed through
    if isinstance(value, torch.Tensor):
        return value
    raise TypeError(f"train_with_nan_guard: loss_fn must return a tensor, got {type(loss).__name__}")


def _tail_frames(guard: NanWatch) -> pd.DataFrame:
    frames = guard.frames()
    if len(frames):
        last = frames.drop_duplicates(["batch", "frame"]).tail(guard.max_frames)
        keep = set(zip(last["batch"], last["frame"]))
        frames = frames[[key in keep for key in zip(frames["batch"], frames["frame"])]]
    return frames.reset_index(drop=True)


def _loss_event(guard: NanWatch, batch: int, value: float, loss_fn: Any) -> NanEvent:
    frames = _tail_frames(guard)
    kind = "nan" if value != value else "inf"
    return NanEvent(batch=batch, module="<loss_fn>",
                    module_type=getattr(loss_fn, "__name__", type(loss_fn).__name__),
                    call=0, role="output", kind=kind, origin="output", is_backward=False,
                    frames=frames, rank=guard.rank,
                    frame=int(frames["frame"].iloc[-1]) if len(frames) else 0)


def _grad_norm_event(guard: NanWatch, model: nn.Module, grad: GradEvent) -> NanEvent:
    owner, _, leaf = grad.param.rpartition(".")
    modules = dict(model.named_modules())
    module = modules.get(owner)
    frames = _tail_frames(guard)
    kind = "nan" if grad.norm != grad.norm else "inf"
    return NanEvent(batch=grad.batch, module=owner,
                    module_type=type(module).__name__ if module is not None else "",
                    call=0, role=leaf, kind=kind, origin="grad", is_backward=True, frames=frames,
                    rank=grad.rank, frame=int(frames["frame"].iloc[-1]) if len(frames) else 0)


class _Progress:
    """tqdm when installed, else a throttled one-line stderr display; silent for short loaders."""

    def __init__(self, total: int | None, enabled: bool | None) -> None:
        if enabled is None:
            enabled = total is None or total >= 50
        self.enabled = enabled
        self.total = total
        self._bar = None
        self._last = 0.0
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            self._bar = tqdm(total=total, desc="nanwidget", unit="batch", leave=False)

    def update(self, batch: int, loss: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            return
        now = time.monotonic()
        if now - self._last >= 1.0:
            self._last = now
            total = f"/{self.total}" if self.total is not None else ""
            sys.stderr.write(f"\rnanwidget: batch {batch + 1}{total} loss {loss:.4g}   ")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self._last:
            sys.stderr.write("\n")


def train_with_nan_guard(model: nn.Module, loader: Iterable[Any],
                         loss_fn: Callable[[Any, Any], torch.Tensor],
                         optimizer: torch.optim.Optimizer, *,
                         device: torch.device | str | None = None, max_batches: int | None = None,
                         grad_norm_warn: float | None = None, progress: bool | None = None,
                         **watch_kwargs: Any) -> tuple[list[float], NanEvent | None]:
    """Train under a watch and stop at the first NaN/Inf: ``(losses, event)``.

    Each batch: forward, ``loss_fn(output, target)``, backward, :func:`check_grad_norms`,
    ``optimizer.step()``. ``loader`` yields ``(inputs, targets)`` pairs (``inputs`` a tensor, a
    tuple of positional arguments or a dict of keyword arguments) or dicts, which are passed as
    ``model(**batch)`` and also given to ``loss_fn`` as the target. ``device`` moves each batch
    there. The run stops at the first of:

    - a forward NaN/Inf in the model: that :class:`NanEvent`;
    - a non-finite loss: a NanEvent with ``module="<loss_fn>"``, ``role="output"``;
    - a backward NaN/Inf (``backward=True``, the default here): that NanEvent;
    - a non-finite parameter gradient norm: a NanEvent with ``origin="grad"``,
      ``is_backward=True``, ``module`` the parameter's owner and ``role`` its name
      (e.g. ``fc1`` / ``weight``).

    The optimizer step is skipped for the stopping batch, so weights are never updated from
    non-finite gradients. Norms above ``grad_norm_warn`` only warn (one warning per batch).
    ``losses`` holds the loss of every batch whose loss was computed (the last may be
    non-finite). Progress is shown for long (>= 50 batches) or unsized loaders unless
    ``progress=False``. Other keyword arguments go to :func:`nanwidget.watch`; ``on_nan`` is
    not accepted (the loop returns the event). Hooks are removed on every exit.
    """
    if "on_nan" in watch_kwargs:
        raise TypeError("train_with_nan_guard stops at the first event and returns it; "
                        "on_nan does not apply")
    if max_batches is not None and (not isinstance(max_batches, int) or max_batches < 0):
        raise ValueError(f"max_batches must be an integer >= 0 or None, got {max_batches!r}")
    watch_kwargs.setdefault("backward", True)

    try:
        total: int | None = len(loader)  # type: ignore[arg-type]
    except TypeError:
        total = None
    if max_batches is not None:
        total = max_batches if total is None else min(total, max_batches)
    losses: list[float] = []
    event: NanEvent | None = None
    bar = _Progress(total, progress)
    try:
        with watch(model, on_nan="record", grad_norm_warn=grad_norm_warn,
                         **watch_kwargs) as w:
            for index, item in enumerate(loader):
                if max_batches is not None and index >= max_batches:
                    break
                inputs, targets = _split_batch(item)
                inputs, targets = _to_device(inputs, device), _to_device(targets, device)
                seen = len(w.events)
                batch = w.batch
                optimizer.zero_grad(set_to_none=True)
                output = _call_model(model, inputs)
                if len(w.events) > seen:
                    event = w.events[seen]
                    break
                loss = _loss_value(loss_fn(output, targets))
                value = float(loss.detach())
                losses.append(value)
                if not math.isfinite(value):
                    event = _loss_event(w, batch, value, loss_fn)
                    break
                loss.backward()
                grads_before = len(w.grad_events)
                w.check_grad_norms()
                if len(w.events) > seen:
                    event = w.events[seen]
                    break
                flagged = w.grad_events[grads_before:]
                bad = [g for g in flagged if not math.isfinite(g.norm)]
                if bad:
                    event = _grad_norm_event(w, model, bad[0])
                    break
                if flagged:
                    worst = max(flagged, key=lambda g: g.norm)
                    warnings.warn(f"nanwidget: gradient norm of '{worst.param}' is {worst.norm:.3g} "
                                  f"> {grad_norm_warn:g} at batch {worst.batch} "
                                  f"({len(flagged)} parameter(s) above the threshold)",
                                  RuntimeWarning, stacklevel=2)
                optimizer.step()
                bar.update(index, value)
    finally:
        bar.close()
    return losses, event

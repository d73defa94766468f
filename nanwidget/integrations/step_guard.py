"""What the framework callbacks share: one watch, a look before every optimizer step, and one
decision that every rank takes together.

With the callbacks' default ``on_nan="stop"`` (and with ``"raise"``) the watch itself only
records (``on_nan="record"``), so a NaN never raises from inside the framework's forward pass,
where one rank would leave while the others wait in DDP's next all-reduce. The callback looks at
what the watch found at points that every rank reaches together (just before each optimizer
step, at the end of each evaluation), all-reduces one flag, and on a set flag every rank drops
the step's gradients (so the optimizer step that follows changes nothing) and stops, or raises,
at the same step.

Only nanwidget's public API is used: ``nw.watch``, ``NanWatch.events``, ``check_grad_norms``,
``grad_events``, ``frames``, ``report``, ``set_batch``, ``warnings``, ``explain_loss`` (at a
non-finite loss no module event explains: its diagnosis) and ``close``.

Early warnings (``NanWatch.warnings``) never stop anything: the callbacks pass the new ones on
to the framework's loggers as metrics (:func:`warning_metrics`) at the points they look.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

import nanwidget as nw
from nanwidget import EarlyWarning, GradEvent, NanDetected, NanEvent
from nanwidget.core.events import Diagnosis, event_fields, event_from_fields
from nanwidget.core.options import ON_NAN_CHOICES as WATCH_ON_NAN_CHOICES
from nanwidget.core.options import WatchOptions, check_option_names
from nanwidget.core.ranks import world_size
from nanwidget.core.state import training_guards

__all__ = ["ON_NAN_CHOICES", "TrainingStop", "Findings", "StepGuard", "BatchLog",
           "GuardedCallback", "RunResult", "check_callback_options", "fresh_run_dir", "recording_dir",
           "logger",
           "warning_metrics"]

logger = logging.getLogger("nanwidget.integrations")

# "stop": every rank stops training at the same step (the callbacks' default); the others are
# the watch's own.
ON_NAN_CHOICES = ("stop",) + WATCH_ON_NAN_CHOICES
# Rows kept by BatchLog: enough to describe any event of the steps still being decided.
BATCH_LOG_ROWS = 4096



def check_callback_options(on_nan: str, watch_options: dict[str, Any],
                           log_dir: Any = None) -> None:
    """Refuse a bad ``on_nan``, ``log_dir`` or ``nw.watch`` option when the callback is made
    (the checks that need the model run when it is watched), not at the start of training."""
    if on_nan not in ON_NAN_CHOICES:
        raise ValueError(f"on_nan must be one of {', '.join(ON_NAN_CHOICES)} for a training "
                         f"callback; got {on_nan!r}")
    check_option_names(watch_options, passed_by="the callback")
    # None: a fresh run folder; False: no recording. True is no folder (False is the off).
    if log_dir is not None and log_dir is not False:
        if not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError("log_dir must be a directory path (str or pathlib.Path), None (a "
                            "fresh folder under the trainer's output directory) or False (no "
                            f"recording); got {log_dir!r} ({type(log_dir).__name__})")
        WatchOptions.checked(None, log_dir=log_dir)  # a path to a file is refused too
    WatchOptions.checked(None, **watch_options)


@dataclass
class TrainingStop:
    """Where and why a callback stopped training: the same ``step`` on every rank.

    ``step`` counts optimizer steps from 1 (transformers' ``state.global_step`` and Lightning's
    ``trainer.global_step`` once the step is done): for ``phase="train"`` it is the step whose
    update was dropped; for ``phase="eval"`` the steps done when that evaluation ran.
    """

    step: int
    phase: str
    reason: str  # what was found: a module event when any rank has one (lowest rank first)
    found_on: list[int]  # every rank that found a problem at this step
    rank: int  # this process's rank
    event: NanEvent | None = field(default=None, repr=False)  # this rank's own first event
    grad_events: list[GradEvent] = field(default_factory=list, repr=False)  # this rank's non-finite norms
    diagnosis: Diagnosis | None = field(default=None, repr=False)  # why: of the reason's event

    def summary(self) -> str:
        """One line: the step, the phase, the first problem found on any rank, and why (its
        diagnosis' kind, summary and first fix)."""
        where = "before the optimizer step" if self.phase == "train" else "after evaluation"
        found = ", ".join(map(str, self.found_on))
        why = f". {self.diagnosis.brief()}" if self.diagnosis is not None else ""
        return (f"nanwidget stopped training at step {self.step} ({where}; found on rank "
                f"{found}): {self.reason}{why}")


@dataclass
class Findings:
    """What this rank found since the last look: new events, non-finite gradients, a bad loss."""

    events: list[NanEvent] = field(default_factory=list)
    grad_events: list[GradEvent] = field(default_factory=list)
    loss: str | None = None  # a non-finite loss that no module event explains
    # That loss as an event (role "loss", at the root, not in the watch's events) with its
    # diagnosis: divergence or loss (NanWatch.explain_loss); None without one, or when the
    # callback does not stop.
    loss_event: NanEvent | None = None
    grads_with_values: int = 0  # parameters that had a gradient when they were checked

    def __bool__(self) -> bool:
        return bool(self.events or self.grad_events or self.loss)

    def reason(self) -> str | None:
        """One line for the log, or None when nothing was found."""
        if self.events:
            return self.events[0].summary()
        if self.loss is not None:
            return self.loss
        if self.grad_events:
            first = self.grad_events[0]
            count = len(self.grad_events)
            text = (f"non-finite gradient norm in batch {first.batch}: '{first.param}' "
                    f"({first.norm})")
            if count > 1 and count >= self.grads_with_values:
                spread = "the loss and the backward pass" + (
                    ", or the DDP all-reduce" if world_size() > 1 else "")
                text += (f"; every one of the {count} gradients is non-finite (one NaN "
                         f"reaches them all through {spread}): watch with backward=True to "
                         "see where it began")
            elif count > 1:
                text += f" and {count - 1} more parameter(s)"
            return text
        return None


class BatchLog:
    """Which framework step each watch batch belonged to (bounded: the most recent rows)."""

    COLUMNS = ["batch", "phase", "step", "index"]

    def __init__(self, rows: int = BATCH_LOG_ROWS) -> None:
        self._rows: deque[tuple[int, str, int, int]] = deque(maxlen=rows)
        self.noted_until = 0  # batches below this number have a row (or were dropped)

    def note(self, batch: int, phase: str, step: int, index: int) -> None:
        """``batch`` was ``phase`` ("train" / "eval") number ``index`` of ``step``."""
        self._rows.append((batch, phase, step, index))
        self.noted_until = max(self.noted_until, batch + 1)

    def note_until(self, end: int, phase: str, step: int, first_index: int) -> int:
        """Note every batch from the last one noted up to ``end`` (excluded); next index."""
        index = first_index
        for batch in range(self.noted_until, end):
            self.note(batch, phase, step, index)
            index += 1
        self.noted_until = max(self.noted_until, end)
        return index

    def note_group(self, end: int, phase: str, step: int, index: int) -> None:
        """Note every batch from the last one noted up to ``end`` (excluded) as the forwards of
        one micro-batch (or evaluation batch) ``index``: a loss that calls the model more than
        once (a contrastive loss, R-Drop) makes several watch batches of one framework batch."""
        for batch in range(self.noted_until, end):
            self.note(batch, phase, step, index)

    def describe(self, batch: int, *, loss: bool = False) -> str:
        """``batch`` in the framework's words: "training step 3, micro-batch 1" (", forward 2
        of 2" when the micro-batch ran the model twice). ``loss``: for the loss of that
        micro-batch, which reads all its forwards: "..., the loss of its 2 forwards (batches 2
        to 3)"."""
        rows = list(self._rows)
        for position in range(len(rows) - 1, -1, -1):
            if rows[position][0] == batch:
                _, phase, step, index = rows[position]
                text = (f"training step {step}, micro-batch {index}" if phase == "train"
                        else f"evaluation after step {step}, batch {index}")
                first, count = self._forwards_of(rows, position)
                if count > 1 and loss:
                    text += (f", the loss of its {count} forwards (batches {rows[first][0]} "
                             f"to {rows[first + count - 1][0]})")
                elif count > 1:
                    text += f", forward {position - first + 1} of {count}"
                return text
        return f"batch {batch}"

    @staticmethod
    def _forwards_of(rows: list[tuple[int, str, int, int]], position: int) -> tuple[int, int]:
        """The first position and the count of the consecutive batches noted as the same
        micro-batch (or evaluation batch) as ``rows[position]``."""
        def same(a: int, b: int) -> bool:
            return rows[a][1:] == rows[b][1:] and rows[b][0] - rows[a][0] == b - a

        first = position
        while first > 0 and same(first - 1, position):
            first -= 1
        last = position
        while last + 1 < len(rows) and same(position, last + 1):
            last += 1
        return first, last - first + 1

    def step_of(self, batch: int) -> int | None:
        """The training step ``batch`` belonged to (None: not a noted training batch)."""
        for row in reversed(self._rows):
            if row[0] == batch:
                return row[2] if row[1] == "train" else None
        return None

    def batches_of(self, phase: str, step: int) -> list[int]:
        return [row[0] for row in self._rows if row[1] == phase and row[2] == step]

    def to_dataframe(self) -> pd.DataFrame:
        return pd.DataFrame(list(self._rows), columns=self.COLUMNS)


def warning_metrics(fresh: list[EarlyWarning], total: int) -> dict[str, float]:
    """New early warnings as numbers a logger plots: ``nanwidget/early_warnings`` (how many so
    far) and, per warning, ``nanwidget/early_warning/<module>/<reason>``: the abs max it saw."""
    metrics = {"nanwidget/early_warnings": float(total)}
    for warning in fresh:
        metrics[f"nanwidget/early_warning/{warning.module_label}/{warning.reason}"] = \
            float(warning.abs_max)
    return metrics


def _rank_and_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def recording_dir(log_dir: str | os.PathLike | bool | None,
                  output_dir: str | os.PathLike) -> Path | None:
    """Where a callback's watch records: ``log_dir`` as given; by default (None) a fresh
    ``<output_dir>/nanwidget/run-N`` (the Trainer's ``output_dir``, Lightning's
    ``default_root_dir``); ``False``: nowhere."""
    if log_dir is None:
        return fresh_run_dir(os.path.join(output_dir, "nanwidget"))
    if log_dir is False:
        return None
    return Path(log_dir)


def fresh_run_dir(base: str | os.PathLike) -> Path:
    """``base/run-N`` with the lowest N not yet used; rank 0 chooses, every rank gets its choice.

    A watch refuses a ``log_dir`` that already holds a recording, and a Trainer's
    ``output_dir`` is reused from run to run: each ``train()`` gets its own folder.
    """
    base = Path(base)
    rank, world = _rank_and_world()
    chosen: list[Any] = [None]
    if rank == 0:
        number = 0
        while (base / f"run-{number}").exists():
            number += 1
        chosen[0] = str(base / f"run-{number}")
    if world > 1:
        torch.distributed.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])


def _event_payload(event: NanEvent | None) -> dict[str, Any] | None:
    """An event as plain data for ``all_gather_object``: its fields and its frames."""
    if event is None:
        return None
    frames = event.frames if isinstance(event.frames, pd.DataFrame) else pd.DataFrame()
    return {"fields": event_fields(event), "frames": frames.to_dict("list")}


def _event_from_payload(payload: dict[str, Any]) -> NanEvent:
    return event_from_fields(payload["fields"], pd.DataFrame(payload["frames"]))


class StepGuard:
    """One watch on the unwrapped model (or on the ``torch.compile`` wrapper that the framework
    calls, which the watch runs in sentinel mode), looked at by a callback at step boundaries."""

    def __init__(self, model: nn.Module, *, on_nan: str, log_dir: str | os.PathLike | None,
                 watch_options: dict[str, Any], owner: object) -> None:
        ours = {id(module) for module in model.modules()}  # a compile wrapper holds the model
        for guard in list(training_guards()):
            # A run that raised leaves its watch behind (transformers has no exception
            # callback): close it, or the new watch would be refused on the same modules.
            if not guard.closed and (guard.model is model or id(guard.watch.model) in ours):
                warnings.warn("nanwidget: closing the watch a previous training run left on this "
                              "model (that run ended with an exception)", RuntimeWarning,
                              stacklevel=3)
                guard.close()
        self.model = model
        self.on_nan = on_nan
        self.owner = weakref.ref(owner)
        self.log_dir = None if log_dir is None else Path(log_dir)
        watch_on_nan = "record" if on_nan in ("stop", "raise") else on_nan
        self.watch = nw.watch(model, on_nan=watch_on_nan,
                              log_dir=None if log_dir is None else str(log_dir), **watch_options)
        self.rank, self.world_size = _rank_and_world()
        self.batches = BatchLog()
        self._events_seen = 0
        self._grads_seen = 0
        self._warnings_seen = 0
        self._losses: list[str] = []
        # The first non-finite loss (with its grad_fn), its batch and targets (None: not known).
        self._loss_values: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []
        self._loss_explained = False  # the first stop's loss is the one diagnosed
        self._flag: torch.Tensor | None = None
        self.exchanges = 0  # flag all-reduces done (the tests count them)
        training_guards().add(self)

    @property
    def stops(self) -> bool:
        """Whether a finding stops training (``on_nan`` "stop" or "raise")."""
        return self.on_nan in ("stop", "raise")

    @property
    def closed(self) -> bool:
        return self.watch.closed

    # ------------------------------------------------------------------ looking
    def note_loss(self, loss: torch.Tensor, batch: int, made_by: str | None = None,
                  target: Any = None) -> None:
        """Check a training loss (one host sync); remember it when non-finite. ``made_by``:
        what the framework knows made it, when no module event explains it (said instead of
        what the watch can tell). ``target``: the batch's targets, when the framework hands
        them over (the Trainer's labels): kept with a non-finite loss for its diagnosis."""
        value = loss.detach()
        if value.numel() and not bool(torch.isfinite(value).all()):
            kind = "nan" if bool(torch.isnan(value).any()) else "inf"
            self._losses.append(f"{kind} loss in batch {batch} "
                                f"({self.batches.describe(batch, loss=True)}); "
                                + (made_by or self._where_loss_was_made(batch)))
            if not self._loss_values:
                # The loss itself: its grad_fn tells the loss function (torch's mse_loss ...).
                self._loss_values.append(
                    (loss, batch, target if isinstance(target, torch.Tensor) else None))

    def _where_loss_was_made(self, batch: int) -> str:
        """What the watch can say about a non-finite loss that no event explains."""
        if self.watch.mode != "sentinel":
            return ("no watched module output was non-finite, so it was made by code outside "
                    "the modules (training_step, the loss function)")
        # The sentinel checks the root's output alone, and only when the root's forward runs:
        # a training_step that calls submodules directly (self.net(x)) is not checked at all.
        history = self.watch.history()
        root = self.watch.module_names[0]
        ran = bool(((history["module"] == root) & (history["batch"] == batch)).any())
        if not ran:
            return ("the sentinel (mode=\"sentinel\") checks the output of the model's own "
                    "forward (self(x) / model(x)) and saw none in this step, so where the NaN "
                    "was made is unknown: call the model through its forward in training_step, "
                    "or watch with mode=\"full\" to check every module")
        return ("the sentinel (mode=\"sentinel\") checks only the output of the model's own "
                "forward (self(x) / model(x)), which was finite in this step: the NaN was made "
                "after it (training_step, the loss function) or in a submodule that "
                "training_step called directly; watch with mode=\"full\" to check every module")

    def findings(self, *, check_grads: bool) -> Findings:
        """What this rank found since the last call (and, if asked, in the gradients now)."""
        watch = self.watch
        found = Findings()
        events = watch.events
        found.events = events[self._events_seen:]
        self._events_seen = len(events)
        if self._losses and not found.events:
            found.loss = self._losses[0]
            if self.stops and self._loss_values and not self._loss_explained \
                    and not watch.closed:
                # Why, at the first finding only: the weights' climb before it (divergence),
                # or the loss's own making (NanWatch.explain_loss).
                self._loss_explained = True
                value, batch, target = self._loss_values[0]
                found.loss_event = watch.explain_loss(value, batch=batch, target=target)
        self._losses = []
        self._loss_values = []
        if check_grads and not watch.closed:
            flagged = watch.check_grad_norms()
            grad_events = watch.grad_events
            fresh = grad_events[self._grads_seen:]
            self._grads_seen = len(grad_events)
            found.grad_events = [g for g in fresh if not math.isfinite(g.norm)]
            large = [g for g in fresh if math.isfinite(g.norm)]
            if large:
                worst = max(large, key=lambda g: g.norm)
                warnings.warn(f"nanwidget: gradient norm of '{worst.param}' is {worst.norm:.3g} > "
                              f"{worst.threshold:g} in batch {worst.batch} ({len(large)} "
                              "parameter(s) above grad_norm_warn)", RuntimeWarning, stacklevel=3)
            if flagged and not fresh and watch.grad_norm_warn is None:
                # The grad-event list is full (it is capped); a flag without a threshold can
                # only mean a non-finite norm.
                found.grad_events = [GradEvent(batch=watch.batch, param="(not listed: grad_events "
                                               "is full)", norm=math.nan, threshold=None,
                                               rank=self.rank)]
            if found.grad_events:
                found.grads_with_values = sum(p.grad is not None for p in self.model.parameters())
        return found

    def new_warnings(self) -> list[EarlyWarning]:
        """Early warnings the watch made since the last call (never a reason to stop)."""
        made = self.watch.warnings
        fresh = made[self._warnings_seen:]
        self._warnings_seen = len(made)
        return fresh

    def reason(self, found: Findings) -> str | None:
        """The finding in one line, with the framework step of its batch."""
        text = found.reason()
        if text is not None and found.events:
            batch = found.events[0].batch
            text = text.replace(f"in batch {batch}",
                                f"in batch {batch} ({self.batches.describe(batch)})", 1)
        elif text is not None and found.grad_events and found.loss is None:
            # Read before the optimizer step: the gradients of every micro-batch of the step.
            batch = found.grad_events[0].batch
            where = self.batches.describe(batch)
            step = self.batches.step_of(batch)
            group = self.batches.batches_of("train", step) if step is not None else []
            if len(group) > 1:
                where += (f"; the step's gradients accumulate batches {min(group)}-{max(group)}, "
                          "so any of them may hold it")
            text = text.replace(f"in batch {batch}", f"in batch {batch} ({where})", 1)
        return text

    # ------------------------------------------------------------------ deciding together
    def _flag_tensor(self) -> torch.Tensor:
        if self._flag is None:
            device = torch.device("cpu")
            if torch.distributed.get_backend() == "nccl":  # NCCL moves device memory only
                device = torch.device("cuda", torch.cuda.current_device())
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        return self._flag

    def agree(self, found: Findings) -> list[dict[str, Any]]:
        """Every rank's findings when any rank found something, else []. Call on every rank.

        One MAX all-reduce of a one-element flag per call; only when it is set, the ranks
        exchange what they found (``all_gather_object``).
        """
        mine = None
        if found:
            mine = {"rank": self.rank, "reason": self.reason(found),
                    "event": _event_payload(found.events[0] if found.events
                                            else found.loss_event)}
        rank, world = _rank_and_world()
        if world < 2:
            return [mine] if mine is not None else []
        dist = torch.distributed
        flag = self._flag_tensor()
        flag.fill_(1 if mine is not None else 0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.exchanges += 1
        if int(flag.item()) == 0:
            return []
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        return [entry for entry in gathered if entry is not None]

    # ------------------------------------------------------------------ stopping
    def drop_gradients(self, *, poison: bool = False) -> None:
        """Make the coming optimizer step change nothing.

        Gradients are set to None: torch optimizers skip parameters without a gradient. Under a
        gradient scaler that has not unscaled yet (``poison=True``) they are filled with NaN
        instead, so that the scaler itself skips the step (it refuses an optimizer without any
        gradient).
        """
        with torch.no_grad():
            for parameter in self.model.parameters():
                if parameter.grad is None:
                    continue
                if poison:
                    parameter.grad.fill_(math.nan)
                else:
                    parameter.grad = None

    def make_stop(self, step: int, phase: str, found: Findings,
                  decision: list[dict[str, Any]]) -> TrainingStop:
        # A module event says more than the NaN gradients DDP spread to the other ranks.
        first = min(decision, key=lambda entry: (entry["event"] is None, entry["rank"]))
        reason_event = _event_from_payload(first["event"]) if first["event"] is not None else None
        stop = TrainingStop(step=step, phase=phase, reason=first["reason"],
                            found_on=sorted(entry["rank"] for entry in decision), rank=self.rank,
                            event=found.events[0] if found.events else None,
                            grad_events=list(found.grad_events),
                            diagnosis=getattr(reason_event, "diagnosis", None))
        logger.warning(stop.summary())
        if stop.event is not None:
            logger.warning("nanwidget report (rank %d):\n%s", self.rank, self.watch.report(stop.event))
        self._write_stop_file(stop, found)
        return stop

    def report_on_error(self, error: BaseException) -> str | None:
        """When training ends with ``error`` before the callback's next look (a framework that
        raises on a non-finite loss, a backward that fails on the constant put in its place),
        warn once about what the watch found that nothing reported yet: the first finding, its
        step and its diagnosis. Returns that message, or None when there was nothing to tell.
        Never raises: the framework's own error must reach the user unchanged."""
        if not self.stops or self.closed:
            return None
        try:
            self.watch.flush()  # the frames of the batch that the error interrupted
            found = self.findings(check_grads=False)
            reason = self.reason(found)
            if reason is None:
                return None
            diagnosis = found.events[0].diagnosis if found.events else \
                found.loss_event.diagnosis if found.loss_event is not None else None
            why = f". {diagnosis.brief()}" if diagnosis is not None else ""
            said = (str(error).strip().splitlines() or [""])[0]
            said = said if len(said) <= 160 else said[:157] + "..."
            message = (f"nanwidget: training ended with {type(error).__name__} ({said}) after the "
                       f"watch found a NaN/Inf it had not reported yet: {reason}{why}"
                       + (" (callback.report() shows its frames)" if found.events else ""))
        except Exception as failure:  # noqa: BLE001 - the framework's error comes first
            logger.debug("nanwidget: could not read what the watch found (%s)", failure)
            return None
        logger.warning(message)
        return message

    def exception_for(self, stop: TrainingStop, decision: list[dict[str, Any]]) -> NanDetected:
        """The NanDetected to raise with ``on_nan="raise"``: this rank's event, else the first found."""
        if stop.event is not None:
            return NanDetected(stop.event)
        for entry in sorted(decision, key=lambda entry: entry["rank"]):
            if entry["event"] is not None:
                return NanDetected(_event_from_payload(entry["event"]))
        # Only gradients (or a loss outside the modules) were non-finite: name the first.
        grad = stop.grad_events[0] if stop.grad_events else None
        owner, _, leaf = grad.param.rpartition(".") if grad is not None else ("", "", "loss")
        return NanDetected(NanEvent(batch=grad.batch if grad is not None else self.watch.batch,
                                    module=owner, module_type="", call=0, role=leaf, kind="nan",
                                    origin="grad" if grad is not None else "output",
                                    is_backward=grad is not None, rank=min(stop.found_on)))

    def _write_stop_file(self, stop: TrainingStop, found: Findings) -> None:
        if self.log_dir is None:
            return
        record = {
            "step": stop.step, "phase": stop.phase, "reason": stop.reason,
            "found_on": stop.found_on, "rank": stop.rank, "summary": stop.summary(),
            "events": [event.summary() for event in found.events],
            "grad_events": [{"batch": g.batch, "param": g.param, "norm": g.norm}
                            for g in found.grad_events],
            "report": self.watch.report(stop.event) if stop.event is not None else "",
        }
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            path = self.log_dir / f"stop-rank-{self.rank:05d}.json"
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as error:  # a full disk must not hide the stop itself
            logger.warning("nanwidget: could not write the stop record in %s (%s)", self.log_dir, error)

    def close(self) -> None:
        """Remove the watch's hooks (idempotent); what it recorded stays readable."""
        self.watch.close()
        training_guards().discard(self)


class RunResult:
    """A callback attribute that holds what its run found (``watch``, ``stop``, the guard).

    Set on a deep copy of the callback, it is set on the callback the copy was made from as
    well (see :meth:`GuardedCallback.__deepcopy__`): the user holds that one.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_run_{name.lstrip('_')}"

    def __get__(self, callback: Any, owner: type | None = None) -> Any:
        if callback is None:
            return self
        return callback.__dict__.get(self.slot)

    def __set__(self, callback: Any, value: Any) -> None:
        callback.__dict__[self.slot] = value
        original = callback.__dict__.get(COPIED_FROM)
        original = original() if original is not None else None
        if original is not None:
            original.__dict__[self.slot] = value


# The attribute of a callback's deep copy that names (weakly) the callback it was copied from.
COPIED_FROM = "_copied_from"
# What no copy of a callback takes: its run's results (RunResult slots) and that link.
# _wrapped_step: the transformers callback's hold on the Trainer while train() runs
NOT_COPIED = frozenset({"_run_watch", "_run_stop", "_run_guard", "_wrapped_step", COPIED_FROM})


class GuardedCallback:
    """What every training callback offers once it watched a run: its event, the report, the
    batch-to-step table and ``close()``. The callback sets ``watch``, ``stop`` and ``_guard``;
    ``_UNWATCHED`` is the report before it watched anything.

    A copy of the callback carries its options, never its run: a deep copy starts unwatched and
    reports what it finds into the callback it was copied from (neuralforecast deep-copies each
    model with its trainer kwargs before fitting, so the callback that runs is a copy, while the
    user reads the one they made); a pickled one (a checkpoint of hyperparameters holding it)
    starts unwatched and reports nowhere.
    """

    watch = RunResult()
    stop = RunResult()
    _guard = RunResult()
    _UNWATCHED = "nanwidget: the callback has not watched a run yet"

    def __deepcopy__(self, memo: dict[int, Any]) -> GuardedCallback:
        """The same options, unwatched, reporting into this callback (or into the one this was
        copied from): after the copy's run, ``event``, ``stop``, ``watch`` and ``report()`` of
        the original are the copy's (those of the latest run, when several copies ran)."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        return self._copy_into(copied, lambda value: copy.deepcopy(value, memo))

    def __copy__(self) -> GuardedCallback:
        """As a deep copy, sharing the option values."""
        return self._copy_into(type(self).__new__(type(self)), lambda value: value)

    def _copy_into(self, copied: GuardedCallback, duplicate: Any) -> GuardedCallback:
        for key, value in self.__dict__.items():
            if key not in NOT_COPIED:
                copied.__dict__[key] = duplicate(value)
        earlier = self.__dict__.get(COPIED_FROM)
        original = earlier() if earlier is not None else None
        copied.__dict__[COPIED_FROM] = weakref.ref(original if original is not None else self)
        return copied

    def __getstate__(self) -> dict[str, Any]:
        """What pickling keeps: the options (a watch with its hooks cannot travel)."""
        framework = getattr(super(), "__getstate__", None)  # fastai's Stateful has its own
        state = framework() if framework is not None else self.__dict__
        return {key: value for key, value in state.items() if key not in NOT_COPIED}

    @property
    def event(self) -> NanEvent | None:
        """This rank's first event, or None."""
        return self.watch.event if self.watch is not None else None

    def report(self, event: NanEvent | None = None) -> str:
        """The transformers-style frame dump of an event (default: this rank's first)."""
        if self.watch is None:
            return self._UNWATCHED
        return self.watch.report(event)

    def batches(self) -> pd.DataFrame:
        """Which step each recent watch batch fed: ``batch``, ``phase`` ("train" or "eval"),
        ``step`` and ``index``, as the callback's docstring numbers them."""
        if self._guard is None:
            return pd.DataFrame(columns=["batch", "phase", "step", "index"])
        return self._guard.batches.to_dataframe()

    def close(self) -> None:
        """Remove the hooks now (the end of training does it too); idempotent."""
        if self._guard is not None:
            self._guard.close()

"""Writes to weights that no version counter shows: optimizer steps.

A watch re-measures a parameter when its version counter moves (every in-place write does
that: ``foreach`` and for-loop optimizers, ``load_state_dict``, ``torch._foreach_*_``, a write
under ``torch.no_grad()``) or its storage changes (``p.data = ...``). Fused optimizer kernels
(``SGD/Adam/AdamW/Adagrad(fused=True)``, transformers' ``adamw_torch_fused``) write the
parameters without moving the counters. So, while any watch is live, one process-wide hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``, run after the step of every
optimizer, subclasses included) counts steps and marks the parameters of the optimizer that
stepped (:class:`~nanwidget.core.state.StepLog`), those with a gradient (torch's optimizers skip
the others: frozen ones, a step before ``backward()``). A step the optimizer did not take (a
``GradScaler`` skipping it, or a fused step it handed ``found_inf``: one read of that flag per
such step) marks nothing; nor does a wrapper's step (accelerate's), whose inner optimizer's own
step counts. The class names of the optimizers that stepped are kept too
(whether each divides by an ``eps``: the diagnosis of a float16 weight gone Inf names the fix of
the optimizer that ran). A step whose param group had a non-finite learning rate (a
scheduler's ``lr_lambda`` returning NaN) is remembered for the parameters it wrote (a float lr,
or a tensor lr on the CPU: a GPU tensor's is never read, that would wait for the device).
A hook before every step numbers the step in progress (:func:`step_in_progress`) and keeps a
weak reference to its optimizer: a forward inside one is a closure the optimizer calls, LBFGS
many times per step, and meets what the step wrote before its post hook marks anything (a NaN
lr is read from that optimizer's param groups, at event time). A step that raised (Ctrl-C in
``opt.step()``, an optimizer's error) runs no post hook: the pre hook notes the step's frame,
and a step whose frame has left its thread's stack is over when read. The optimizers that
stepped, wrappers included, are kept weakly (:func:`optimizers_holding`): a diagnosis reads their param
groups (SAM's rho) and a wrapper's state (Lookahead's slow weights). Cost: about 0.3 us for
the pre-step hook; while a step runs (a closure's forward), a walk up the stack (about 2 us)
where it is read; one short loop over the optimizer's parameters, one finiteness check of
each group's lr and two dict lookups in the post-step hook (and, once per parameter, a weak
reference that drops its marks when it is collected: a watch left open while models are built
and dropped keeps nothing of them); nothing per module call.

An optimizer that is not a ``torch.optim.Optimizer`` (fastai's own ``Optimizer``, the default of
every fastai ``Learner``, writes through ``p.data``: no hook, no counter) is told to the watches
by whoever steps it: :func:`note_optimizer_step` after each of its steps does the same.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from functools import partial
from typing import Any

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from .graph_capture import run_eagerly_under_dynamo
from .state import optimizer_steps
from .stats import local_shard

__all__ = ["track_optimizer_steps", "StepTracking", "steps_taken", "step_in_progress",
           "written_since", "nonfinite_lr_in_step", "optimizer_state_nonfinite",
           "optimizers_holding", "stepping_optimizer", "param_group_of",
           "wraps_an_optimizer", "optimizers_stepped", "nonfinite_lr_step", "last_step_writing",
           "marks_kept_from", "note_optimizer_step"]

_LOG = optimizer_steps()
_MAX_MARKS = 1 << 20  # parameters remembered at most (ids of long-gone tensors are dropped)
_getframe = sys._getframe
_get_ident = threading.get_ident


def wraps_an_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` only wraps another one (accelerate's ``AcceleratedOptimizer`` is
    an Optimizer subclass whose ``step()`` hands over to the inner one, or to a GradScaler that
    may skip it): its step hooks say nothing, the inner optimizer's hooks do."""
    return isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)


@run_eagerly_under_dynamo  # a compiled train step may call the optimizer
def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    log = _LOG
    log.started += 1
    log.stepping = log.started
    log.optimizer = _ref(optimizer)  # weak: a step that raised must not keep it alive
    # The frame that runs the step (torch's wrapper calling the hooks), by id and code: a
    # step that raised (Ctrl-C, a fused kernel's error) runs no post hook, and is found ended
    # when read because that frame is no longer on its thread's stack (_step_ended).
    frame = _getframe(1)
    log.step_frame = id(frame)
    log.step_code = frame.f_code
    log.step_thread = _get_ident()


_ref = weakref.ref
_KEEP_OPTIMIZERS = 64  # optimizers remembered at most (the collected ones go first)


@run_eagerly_under_dynamo  # a compiled train step may call the optimizer
def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    log = _LOG
    log.stepping = 0
    log.optimizer = None
    log.step_code = None
    if id(optimizer) not in log.optimizers:
        _remember(optimizer)
    if wraps_an_optimizer(optimizer):
        return
    _mark_step(optimizer)


def _remember(optimizer: Any) -> None:
    """Keep a weak reference to an optimizer that stepped (once per optimizer)."""
    kept = _LOG.optimizers
    if len(kept) >= _KEEP_OPTIMIZERS:
        for key in [k for k, reference in kept.items() if reference() is None]:
            del kept[key]
        if len(kept) >= _KEEP_OPTIMIZERS:
            kept.pop(next(iter(kept)))
    key = id(optimizer)

    def forget(reference: weakref.ref[Any]) -> None:  # collected: its entry goes with it
        if kept.get(key) is reference:
            del kept[key]

    try:
        kept[key] = _ref(optimizer, forget)
    except TypeError:  # an object that takes no weak reference: not remembered
        pass


def note_optimizer_step(optimizer: Any) -> None:
    """Tell the live watches that ``optimizer`` has just stepped, when torch cannot: an
    optimizer-like object with torch's ``param_groups`` (each a dict with ``"params"`` and
    ``"lr"``) that is not a ``torch.optim.Optimizer``, such as fastai's ``Optimizer``. Its
    parameters with a gradient count as written by this step, so the next frames measure their
    new values and a diagnosis names a step with a NaN/Inf learning rate. Call it after each
    step the optimizer really took. A torch optimizer's steps are seen already (nothing is done
    for one), and nothing is done while no watch is live."""
    if _LOG.handle is None or isinstance(optimizer, torch.optim.Optimizer):
        return
    _mark_step(optimizer)


def _mark_step(optimizer: Any) -> None:
    """Count one step of ``optimizer`` and mark the parameters it wrote."""
    log = _LOG
    log.count += 1
    count = log.count
    kind = type(optimizer).__name__
    if kind not in log.kinds:
        log.kinds[kind] = _divides_by_eps(optimizer)
    # A fused step under a GradScaler gets the scaler's found_inf (as an attribute of the
    # optimizer while it steps): its kernel writes nothing when it is set.
    found_inf = getattr(optimizer, "found_inf", None)
    if isinstance(found_inf, torch.Tensor) and bool(found_inf.any()):
        return  # a fused step under a GradScaler that found Inf/NaN: its kernel wrote nothing
    marks = log.marks
    if len(marks) > _MAX_MARKS:
        marks.clear()  # forgetting marks only makes held batches look unchanged since
        log.bad_lr.clear()
        log.collected.clear()
        log.marks_from = count - 1  # the steps from this one on are all marked again
    try:
        for group in optimizer.param_groups:
            bad_lr = _nonfinite_lr(group.get("lr"))
            known = len(marks)
            for parameter in group["params"]:
                # torch's optimizers skip a parameter without a gradient (frozen, or a step
                # before backward): it was not written
                if getattr(parameter, "grad", None) is not None:
                    marks[id(parameter)] = count
                    if bad_lr is not None:  # rare: only a step with a NaN/Inf lr gets here
                        log.bad_lr[id(parameter)] = (count, kind, bad_lr)
            if len(marks) != known:  # parameters marked for the first time (once each)
                _forget_when_collected(group["params"])
    except Exception:  # an optimizer-like object without torch's param_groups: counted only
        pass


def _forget_when_collected(parameters: Any) -> None:
    """Drop the marks of each of ``parameters`` that has one when it is collected: a session
    that keeps a watch open while it builds, trains and drops model after model (a
    hyperparameter search) keeps no marks of the dropped ones."""
    log = _LOG
    for parameter in parameters:
        key = id(parameter)
        if key in log.collected or key not in log.marks:
            continue
        try:
            log.collected[key] = _ref(parameter, partial(_forget, key))
        except TypeError:  # takes no weak reference: kept until the marks are dropped
            pass


def _forget(key: int, reference: weakref.ref[Any]) -> None:
    """A marked parameter was collected: its marks go (not a newer one's under its id)."""
    log = _LOG
    if log.collected.get(key) is reference:
        del log.collected[key]
        log.marks.pop(key, None)
        log.bad_lr.pop(key, None)


def _nonfinite_lr(lr: Any) -> float | None:
    """A param group's learning rate when it is NaN or Inf, else None. A tensor lr is read only
    on the CPU (one on a GPU would make every step wait for the device: left unread)."""
    if isinstance(lr, torch.Tensor):
        if lr.device.type != "cpu" or lr.numel() != 1:
            return None
        lr = lr.item()  # on the CPU: no device sync
    if isinstance(lr, (int, float)) and not math.isfinite(lr):
        return float(lr)
    return None


def _divides_by_eps(optimizer: Any) -> bool:
    """Whether ``optimizer`` adds an ``eps`` to a denominator (Adam and its family, RMSprop,
    Adagrad, Adadelta: an ``eps`` in their defaults); True when it cannot be told."""
    defaults = getattr(optimizer, "defaults", None)
    return not isinstance(defaults, dict) or "eps" in defaults


class StepTracking:
    """One watch's wish for the step hook (:func:`track_optimizer_steps`); :meth:`release` it
    when the watch closes (or is collected unclosed); a second release does nothing."""

    __slots__ = ("released",)

    def __init__(self) -> None:
        self.released = False
        log = _LOG
        log.users += 1
        if log.handle is None:
            log.handle = register_optimizer_step_post_hook(_after_step)
            log.pre_handle = register_optimizer_step_pre_hook(_before_step)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        log = _LOG
        log.users = max(0, log.users - 1)
        if not log.users and log.handle is not None:  # the hook comes off with the last one
            log.handle.remove()
            log.handle = None
            if log.pre_handle is not None:
                log.pre_handle.remove()
                log.pre_handle = None
            log.stepping = 0
            log.optimizer = None
            log.step_code = None
            log.optimizers.clear()
            log.marks.clear()
            log.bad_lr.clear()
            log.collected.clear()
            log.kinds.clear()
            log.marks_from = log.count


def track_optimizer_steps() -> StepTracking:
    """A watch starts: the step hook is on while any watch wants it."""
    return StepTracking()


def step_in_progress() -> int:
    """A number for the optimizer step running now (a forward inside it is a closure the
    optimizer calls: LBFGS calls its closure many times per step), new for every step; 0 when
    none is. A step that raised (Ctrl-C in ``opt.step()``, an optimizer's error: no post hook
    runs) is over: it is found so here, and forgotten. Costs nothing while no step runs; inside
    one (a closure's forward), a walk up the stack."""
    log = _LOG
    if log.stepping and _step_ended(log):
        log.stepping = 0
        log.optimizer = None
        log.step_code = None
    return log.stepping


def _step_ended(log: Any) -> bool:
    """Whether the step numbered ``log.stepping`` ended without its post hook (it raised):
    its frame is no longer on its thread's stack. A frame of a later step at the same id
    would have numbered a new step."""
    thread = log.step_thread
    frame = _getframe(1) if thread == _get_ident() else sys._current_frames().get(thread)
    key, code = log.step_frame, log.step_code
    while frame is not None:
        if id(frame) == key and frame.f_code is code:
            return False
        frame = frame.f_back
    return True


def steps_taken() -> int:
    """Optimizer steps seen so far (while watches were live)."""
    return _LOG.count


def written_since(tensor: torch.Tensor, count: int) -> bool:
    """Whether an optimizer holding ``tensor`` stepped after :func:`steps_taken` was ``count``."""
    return _LOG.marks.get(id(tensor), 0) > count


def optimizers_stepped() -> dict[str, bool]:
    """The class names of the optimizers that stepped while watches were live (since the last
    one closed), each with whether it divides by an ``eps``."""
    return dict(_LOG.kinds)


def nonfinite_lr_step(tensor: torch.Tensor) -> tuple[int, str, float] | None:
    """The last step that wrote ``tensor`` with a NaN/Inf learning rate in its param group:
    (its :func:`steps_taken` count, the optimizer's class name, the lr); None if none did."""
    return _LOG.bad_lr.get(id(tensor))


def last_step_writing(tensor: torch.Tensor) -> int | None:
    """The :func:`steps_taken` count of the last optimizer step that wrote ``tensor``; None when
    no step did since :func:`marks_kept_from`."""
    return _LOG.marks.get(id(tensor))


def marks_kept_from() -> int:
    """Every step after this :func:`steps_taken` count is marked (marks are dropped when the
    last watch closes, or when too many are kept): a parameter without a mark was written by
    no optimizer step since then."""
    return _LOG.marks_from


def param_group_of(optimizer: Any, tensor: torch.Tensor) -> dict | None:
    """The param group of ``optimizer`` that holds ``tensor`` (by identity), or None. Event
    time only."""
    try:
        for group in optimizer.param_groups:
            if any(p is tensor for p in group["params"]):
                return group
    except Exception:  # not torch's param_groups
        pass
    return None


def nonfinite_lr_in_step(tensor: torch.Tensor) -> tuple[int, str, float] | None:
    """The optimizer step in progress, when the param group holding ``tensor`` has a NaN/Inf
    learning rate: (its :func:`step_in_progress` number, the optimizer's class name, the lr).
    A forward inside the step (LBFGS's closure) meets what the step wrote before its post hook
    marks it. None when no step is in progress or its lr is finite. Event time only."""
    log = _LOG
    optimizer = stepping_optimizer()
    group = param_group_of(optimizer, tensor) if optimizer is not None else None
    lr = _nonfinite_lr(group.get("lr")) if group is not None else None
    return None if lr is None else (log.stepping, type(optimizer).__name__, lr)


def stepping_optimizer() -> Any | None:
    """The optimizer whose step is in progress (:func:`step_in_progress`), None when none is."""
    log = _LOG
    return log.optimizer() if step_in_progress() and log.optimizer is not None else None


def optimizers_holding(tensor: torch.Tensor) -> list[tuple[Any, dict]]:
    """The optimizers that stepped while watches were live and hold ``tensor`` in a param
    group, each with that group (a wrapper shares its inner optimizer's groups: both come).
    Event time only."""
    found = []
    for reference in list(_LOG.optimizers.values()):
        optimizer = reference()
        group = param_group_of(optimizer, tensor) if optimizer is not None else None
        if group is not None:
            found.append((optimizer, group))
    return found


def optimizer_state_nonfinite(tensor: torch.Tensor) -> list[str]:
    """The non-finite state tensors that optimizer wrappers keep for ``tensor``, as a user
    would reach them: ``"Lookahead.state[p]['slow']"``. A wrapper is an optimizer whose step
    hands over to another one it holds (Lookahead keeps slow weights that it copies into the
    parameters every k steps); an optimizer's own moments (Adam's exp_avg) are left out: a
    non-finite gradient makes those, and so does SAM's perturbation (``state[p]['e_w']``,
    a SAM is told by its ``first_step``). None either when the inner optimizer's own state for
    ``tensor`` is non-finite too: a NaN gradient went through it, and the wrapper's state then
    follows the weights. Event time only."""
    found = []
    for optimizer, _ in optimizers_holding(tensor):
        bad = _nonfinite_state(optimizer, tensor)
        if not bad:
            continue
        if not _wraps(optimizer) and not hasattr(optimizer, "first_step"):
            return []  # the inner optimizer's moments: a NaN gradient
        if _wraps(optimizer) and not hasattr(optimizer, "first_step"):
            found.extend(f"{type(optimizer).__name__}.state[p][{key!r}]" for key in bad)
    return found


def _nonfinite_state(optimizer: Any, tensor: torch.Tensor) -> list[Any]:
    """The keys of ``optimizer.state[tensor]`` whose float tensors hold NaN/Inf. A DTensor's
    (FSDP2's sharded parameters' moments) is read on this rank's shard: reducing the DTensor
    itself is a collective that the other ranks, not diagnosing, never join."""
    state = getattr(optimizer, "state", None)
    try:
        entries = state.get(tensor) if state is not None else None
    except Exception:
        entries = None
    if not isinstance(entries, dict):
        return []
    return [key for key, value in entries.items()
            if isinstance(value, torch.Tensor) and value.is_floating_point()
            and not bool(torch.isfinite(local_shard(value)).all())]


def _wraps(optimizer: Any) -> bool:
    """Whether ``optimizer`` holds another torch optimizer in one of its attributes (its
    ``optimizer`` or ``base_optimizer``: Lookahead, SAM)."""
    return any(isinstance(value, torch.optim.Optimizer) and value is not optimizer
               for value in vars(optimizer).values()) if hasattr(optimizer, "__dict__") else False

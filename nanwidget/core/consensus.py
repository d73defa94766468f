"""DDP / FSDP2 consensus stop: when one rank finds a NaN/Inf, every rank stops at the same batch.

Without it, the rank that found the NaN raises and leaves, and the healthy ranks go on: they
apply the optimizer step, then wait in the next collective until the gloo/NCCL timeout (often
10-30 minutes) or fail with "Connection closed by peer". With it, each rank all-reduces one
small integer (MAX of "I have an event") at two boundaries every rank reaches in the same
order: the end of each training forward (the root forward returns) and, with
``backward=True``, the end of each backward pass (an autograd final callback that runs after
DDP's and FSDP2's own gradient reductions have finished, so no collective of theirs is left
pending). When the flag is set, the ranks exchange the offending event (only then, with
``all_gather_object``) and each raises :class:`NanDetected` at the same boundary: out of the
forward, or out of ``loss.backward()``, before any optimizer step. A healthy rank records and
raises an event with ``origin="peer"`` whose ``peer_rank`` names the rank that found it (its
``batch`` is this rank's own, ``peer_batch`` the finder's). No
rank leaves before the exchange, and after it every rank raises, so no collective is ever
issued towards a rank that has left.

NCCL: the same exchanges, on a one-element CUDA tensor; reading the flag synchronises with the
NCCL stream once per boundary. NCCL collectives block until every rank issues them, which is
why the exchanges sit only at boundaries every rank reaches: were a rank to skip one (a watch
on one rank only, different watch options per rank), the others would wait until the process
group's timeout, which NCCL enforces only with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (on by
default in recent PyTorch). The start-up check below covers the first case.

The flag is exchanged only for passes that every rank runs: forwards with grad enabled and the
model in training mode, their backward passes, and only with ``on_nan="raise"``. A validation
pass that only rank 0 runs (``model.eval()`` or ``torch.no_grad()``) therefore never waits for
the other ranks. :meth:`Consensus.any_rank` lets ``check_grad_norms()`` of an
``on_nan="raise"`` watch return the same answer on every rank (FSDP2 ranks measure different
gradient shards): call it on every rank.

Switch it off with ``NANWIDGET_CONSENSUS=0`` in the environment or :func:`set_consensus`.
Create the watch on every rank. Before the first exchange the ranks check, through the process
group's key-value store (no collective), that every rank watches; when one does not within
``NANWIDGET_CONSENSUS_WAIT`` seconds (default 30), all of them switch the consensus off with a
warning, so a watch on rank 0 alone never pairs its flag with somebody else's collective.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from typing import Any

import pandas as pd
import torch

from .events import NanEvent, event_fields, event_from_fields, gradient_only_reduced
from .ranks import distributed_ready
from .recorder import Feature, Recorder

__all__ = ["Consensus", "set_consensus", "consensus_enabled", "consensus_wanted"]

_override: bool | None = None
_serials = itertools.count()  # the nth watch of this process meets the nth watch of the others


def set_consensus(enabled: bool | None) -> None:
    """Turn the DDP consensus stop on or off for watches created from now on.

    ``None`` goes back to the environment (``NANWIDGET_CONSENSUS=0`` disables it; on by default).
    """
    global _override
    _override = None if enabled is None else bool(enabled)


def consensus_enabled() -> bool:
    """Whether new watches exchange the per-batch NaN flag across ranks."""
    if _override is not None:
        return _override
    return os.environ.get("NANWIDGET_CONSENSUS", "1").strip().lower() not in ("0", "false", "off", "no")


def consensus_wanted() -> bool:
    """Whether a watch created now should ride along with a consensus part: enabled, and
    several ranks (a process group, or a launcher's WORLD_SIZE before the group exists)."""
    if not consensus_enabled() or not torch.distributed.is_available():
        return False
    if distributed_ready():
        return torch.distributed.get_world_size() > 1
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def _unmeasured_parameter_gradient(event: NanEvent) -> bool:
    """Whether ``event`` is a parameter's gradient (its ``.grad`` after DDP's or FSDP's
    reduction) with no module gradient of its batch measured (sentinel mode checks the
    parameters' gradients and the model's output's, nothing between): whether this rank made
    it or the reduction brought it from another rank cannot be told from it."""
    frames = event.frames
    if not event.is_backward or event.origin != "grad" or event.role.startswith("grad_"):
        return False
    if frames is None or frames.empty:
        return True
    own = frames[(frames["batch"] == event.batch) & (frames["phase"] == "backward")]
    return not bool(own["role"].str.startswith("grad_").any())


def _payload(event: NanEvent) -> dict[str, Any]:
    payload = event_fields(event)
    payload["only_reduced"] = gradient_only_reduced(event)
    payload["unmeasured"] = _unmeasured_parameter_gradient(event)
    frames = event.frames if isinstance(event.frames, pd.DataFrame) else pd.DataFrame()
    payload["frames"] = frames.to_dict("list")
    return payload


class Consensus(Feature):
    """Per batch: one MAX all-reduce of a one-element flag; a gather only when it is set."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._flag: torch.Tensor | None = None
        self._serial = next(_serials)
        self._agreed: bool | None = None  # every rank watches: decided once, the same everywhere
        self.exchanges = 0  # flag all-reduces done (tests and benchmarks read it)

    def _every_rank_watches(self) -> bool:
        if self._agreed is None:
            self._agreed = _handshake(self._serial)
        return self._agreed

    def _flag_tensor(self) -> torch.Tensor:
        if self._flag is None:
            dist = torch.distributed
            device = torch.device("cpu")
            if dist.get_backend() == "nccl":  # NCCL only moves device memory
                device = torch.device("cuda", torch.cuda.current_device())
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        return self._flag

    def _exchanging(self) -> bool:
        """Whether the ranks exchange flags now: several ranks, each of them watching."""
        return distributed_ready() and torch.distributed.get_world_size() > 1 \
            and self._every_rank_watches()

    def _any_flag(self, mine: bool) -> bool:
        dist = torch.distributed
        flag = self._flag_tensor()
        flag.fill_(1 if mine else 0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.exchanges += 1
        return int(flag.item()) != 0

    def any_rank(self, flag: bool) -> bool:
        """``flag`` OR-ed over every rank (one all-reduce), or ``flag`` itself without a group
        to ask. Every rank must call it at the same point."""
        if not self._exchanging():
            return flag
        return self._any_flag(flag)

    def review_event(self, batch: int, event: NanEvent | None, reason: str) -> NanEvent | None:
        dist = torch.distributed
        if reason not in ("forward", "backward") or self.recorder.on_nan != "raise" \
                or not self.recorder.model.training:
            return event
        # Only passes every rank runs together (training forwards and their backward passes)
        # exchange the flag; a forward without grad (validation) does not.
        if reason == "forward" and not torch.is_grad_enabled():
            return event
        if not self._exchanging():
            return event
        if not self._any_flag(event is not None):
            return event
        # Rare path: somebody found a NaN. Tell everyone what and where.
        payloads: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(payloads, _payload(event) if event is not None else None)
        found = [p for p in payloads if p is not None]
        # A rank whose own gradients stayed finite and whose .grad the all-reduce made NaN
        # takes the finder's event, as a rank that found nothing does.
        made = [p for p in found if not p["only_reduced"]]
        # In sentinel mode a rank sees only its .grad after the reduction: when another rank
        # met the NaN in a gradient flowing through the model in the same backward pass (made
        # in its loss or a module's backward there), that rank made it, and this one takes its
        # event, as in full mode.
        flowing = [p for p in made if p["is_backward"] and p["role"].startswith("grad_")
                   and p["rank"] != dist.get_rank()]
        secondhand = event is not None and (gradient_only_reduced(event) or (
            _unmeasured_parameter_gradient(event) and bool(flowing) and reason == "backward"))
        if secondhand and not gradient_only_reduced(event):
            made = flowing
        if event is not None and (not made or not secondhand):
            return event
        first = min(made or found, key=lambda p: (p["batch"], p["rank"]))
        first.pop("only_reduced")
        first.pop("unmeasured")
        frames = pd.DataFrame(first.pop("frames"))
        # This rank's own batch number: ranks that ran different numbers of forwards (extra
        # validation batches on one) count batches differently; the finder's is peer_batch.
        fields = dict(first, origin="peer", peer_rank=first["rank"], peer_batch=first["batch"],
                      batch=batch, rank=dist.get_rank())
        return event_from_fields(fields, frames)


def _handshake(serial: int) -> bool:
    """Whether every rank runs this (nth) watch; the same answer on every rank that asks."""
    dist = torch.distributed
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        store = _get_default_store()
    except Exception:  # no store to ask: trust the documented use (a watch on every rank)
        return True
    rank, world = dist.get_rank(), dist.get_world_size()
    prefix = f"nanwidget/consensus/{serial}/"
    store.set(f"{prefix}{rank}", "1")
    keys = [f"{prefix}{r}" for r in range(world)]
    try:
        wait = float(os.environ.get("NANWIDGET_CONSENSUS_WAIT", "30"))
    except ValueError:
        wait = 30.0
    deadline = time.monotonic() + wait
    # Poll with check() rather than wait(): a timed-out wait leaves a reply pending on the socket.
    while not store.check(keys):
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    proposal = "on" if store.check(keys) else "off"
    # The first rank to decide decides for all, so a rank arriving late cannot disagree.
    decision = store.compare_set(f"{prefix}decision", "", proposal)
    agreed = (decision.decode() if isinstance(decision, bytes) else str(decision)) == "on"
    if not agreed:
        seen = [r for r in range(world) if store.check([f"{prefix}{r}"])]
        warnings.warn(f"nanwidget: DDP consensus stop is off for this watch: not every rank "
                      f"watched the model within {wait:g} s (ranks watching: {seen} of {world}). "
                      "Watch the model on every rank, or set NANWIDGET_CONSENSUS=0 to skip this "
                      "check", RuntimeWarning, stacklevel=2)
    return agreed



"""DDP consensus stop: when one rank finds a NaN/Inf, every rank stops at the same batch.

Without it, the rank that found the NaN raises and leaves, and the healthy ranks wait in the
next collective (DDP's gradient all-reduce) until the NCCL/gloo timeout, often 10-30 minutes.
With it, at every batch end each rank all-reduces one small integer (MAX of "I have an event");
when it is set, the ranks exchange the offending event (only then, with ``all_gather_object``)
and each raises :class:`NanDetected` at the same boundary; a healthy rank's event names the
rank that found the NaN.

The flag is exchanged only for forwards that DDP itself synchronises: grad enabled and the
model in training mode, with ``on_nan="raise"``. A validation pass that only rank 0 runs
(``model.eval()`` or ``torch.no_grad()``) therefore never waits for the other ranks.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from .events import NanEvent
from .watch import WatchExtension

if TYPE_CHECKING:  # pragma: no cover
    from .watch import NanWatch

__all__ = ["make_extension", "ConsensusExtension", "RemoteNanEvent", "set_consensus",
           "consensus_enabled"]

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


@dataclass
class RemoteNanEvent(NanEvent):
    """The event another rank found, raised on a healthy rank so it stops too."""

    stopped_rank: int = 0

    def summary(self) -> str:
        base = super().summary()
        if f"on rank {self.rank}" not in base:
            base = base.replace(f"in batch {self.batch}", f"in batch {self.batch} on rank {self.rank}", 1)
        return f"{base} (found on rank {self.rank}; rank {self.stopped_rank} stops with it)"


def _event_payload(event: NanEvent) -> dict[str, Any]:
    fields = ("batch", "module", "module_type", "call", "role", "kind", "origin", "is_backward",
              "rank", "frame")
    payload = {name: getattr(event, name) for name in fields}
    frames = event.frames if isinstance(event.frames, pd.DataFrame) else pd.DataFrame()
    payload["frames"] = frames.to_dict("list")
    return payload


class ConsensusExtension(WatchExtension):
    """Per batch: one MAX all-reduce of a one-element flag; a gather only when it is set."""

    kind = "distributed"

    def __init__(self) -> None:
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

    def after_batch(self, watch: NanWatch, batch: int, event: NanEvent | None) -> NanEvent | None:
        dist = torch.distributed
        if watch.on_nan != "raise" or not dist.is_initialized() or dist.get_world_size() < 2:
            return event
        # Only forwards every rank runs together (DDP training steps) exchange the flag.
        if not (torch.is_grad_enabled() and watch.model.training):
            return event
        if not self._every_rank_watches():
            return event
        flag = self._flag_tensor()
        flag.fill_(1 if event is not None else 0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.exchanges += 1
        if int(flag.item()) == 0:
            return event
        # Rare path: somebody found a NaN. Tell everyone what and where.
        payloads: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(payloads, _event_payload(event) if event is not None else None)
        if event is not None:
            return event
        found = [p for p in payloads if p is not None]
        first = min(found, key=lambda p: (p["batch"], p["rank"]))
        frames = pd.DataFrame(first.pop("frames"))
        return RemoteNanEvent(frames=frames, stopped_rank=dist.get_rank(), **first)


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


def make_extension(watch: NanWatch) -> ConsensusExtension | None:
    """The consensus part of a watch under torch.distributed with several ranks, else None."""
    if not consensus_enabled():
        return None
    dist = torch.distributed
    if not dist.is_available():
        return None
    if dist.is_initialized():
        return ConsensusExtension() if dist.get_world_size() > 1 else None
    # Under torchrun the group may be created after the watch: decide at each batch end.
    try:
        launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        launched = False
    return ConsensusExtension() if launched else None

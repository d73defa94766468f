"""Modules added, replaced or removed after ``watch()``: named in the event they affect.

A watch hooks the modules the model has when it is watched. A module assigned later
(``model.b = nn.Linear(...)``, a layer swapped for a patched one) runs unwatched: it records no
frames, so a NaN it makes would surface as made, from finite inputs and weights, by the watched
module around it. At an event (rare: the walk over the model happens only then) this feature
looks at what changed:

- a new module (inside the event's module for an "output" event; anywhere for an "input" one,
  and for the sentinel's root events) whose own parameter or buffer is non-finite, measured now,
  becomes the event: that module, that tensor, origin "weight";
- otherwise an "output" event of a module with new modules inside says that where the value was
  made was not checked, and names them; an "input" event names them too.
"""

from __future__ import annotations

from torch import nn

from .detect import event_kind
from .events import NanEvent
from .recorder import Feature, Recorder
from .stats import measure_tensor

__all__ = ["ModelChanges"]

_SHOWN = 4  # modules named in a note, at most


def _within(name: str, outer: str) -> bool:
    return outer == "" or name == outer or name.startswith(outer + ".")


def _listed(modules: list[tuple[str, nn.Module]]) -> str:
    shown = ", ".join(f"'{name}' ({type(module).__name__})" for name, module in modules[:_SHOWN])
    return shown + (f" and {len(modules) - _SHOWN} more" if len(modules) > _SHOWN else "")


def _first_non_finite(module: nn.Module) -> tuple[str, str] | None:
    """(name, kind) of the module's first own parameter or buffer holding a NaN or Inf."""
    for group in (module._parameters, module._buffers):
        for name, tensor in group.items():
            if tensor is None or not (tensor.is_floating_point() or tensor.is_complex()) \
                    or tensor.is_meta or not tensor.numel():
                continue
            stats = measure_tensor(tensor.detach())
            if stats.nan or stats.inf:
                return name, event_kind(stats.nan, stats.inf)
    return None


class ModelChanges(Feature):
    """Names modules added, replaced or removed after ``watch()`` in the events they affect."""

    reviews_without_event = False  # its review only adds to an event

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def review_event(self, batch: int, event: NanEvent | None, reason: str) -> NanEvent | None:
        if event is None or event.origin == "peer":
            return event
        added, removed = self.recorder.structure_changes()
        if not added and not removed:
            return event
        moved = self.recorder.moved_modules().get(event.module)
        if moved is not None:  # the name it had when watched may now be another module's
            said = (f"module '{event.module}' now sits at '{moved}' (moved after watch(); "
                    "frames keep the name it had when watched)")
            event.note = f"{event.note}; {said}" if event.note else said
        if event.origin not in ("output", "input") or event.is_backward:
            return event
        inside = [(n, m) for n, m in added if _within(n, event.module)]
        suspects = inside if event.origin == "output" else added
        for name, module in suspects:
            found = _first_non_finite(module)
            if found is not None:
                role, kind = found
                event.module, event.module_type, event.call = name, type(module).__name__, 0
                event.role, event.kind, event.origin = role, kind, "weight"
                event.note = ("added or replaced after watch(): it runs unwatched, with no "
                              "frames of its own; close the watch and watch the model again to "
                              "record it")
                return event
        changes = []
        if added:
            changes.append("added or replaced after watch(), running unwatched: "
                           + _listed(added))
        if removed:
            changes.append(f"removed or replaced after watch(): {', '.join(removed[:_SHOWN])}")
        said = "; ".join(changes) + "; watch the model again to record them"
        if event.note.startswith("not replayed"):
            return event  # the sentinel's refusal to replay a changed model names them already
        if event.origin == "output" and inside and not event.note.startswith("not "):
            event.note = f"not checked: modules {said}"
        elif event.note:
            event.note += f"; modules {said}"
        else:
            event.note = f"modules {said}"
        return event

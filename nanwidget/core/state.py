"""Process-wide state: every registry nanwidget keeps, in one place, each with why it exists.

Everything else lives in objects the user holds (a watch, its recorder and features, a magics
instance). Nothing here keeps a user's model or watch alive: the registries hold weak
references, so a model the user drops is collected with its watch.

The one other process-wide thing is :mod:`~nanwidget.core.native`'s loaded kernel: a compiled
library, loaded once per process, kept beside the code that calls it on the hot path.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover - names for the annotations only
    from .recorder import Recorder

__all__ = ["ModuleMap", "watched_modules", "watching_recorders", "set_browser_opener", "browser_opener",
           "training_guards", "use_parquet", "parquet_wanted", "StepLog", "optimizer_steps"]

class ModuleMap:
    """A mapping keyed by modules, by identity, holding each module weakly (its entry goes
    when the module is collected).

    Why not ``weakref.WeakKeyDictionary``: it finds a key by ``==``, and some modules define
    ``==`` elementwise (tensordict's ``TensorDictParams``, a torchrl loss's parameters, is a
    Module and a TensorDict: comparing two raises), so a lookup of a watched one raised.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def get(self, module: Any, default: Any = None) -> Any:
        entry = self._entries.get(id(module))
        if entry is None or entry[0]() is not module:  # a collected module's id reused
            return default
        return entry[1]

    def __setitem__(self, module: Any, value: Any) -> None:
        key = id(module)
        entries = self._entries

        def forget(reference: weakref.ref[Any]) -> None:
            if entries.get(key, (None,))[0] is reference:  # not a newer module's entry
                del entries[key]

        entries[key] = (weakref.ref(module, forget), value)

    def __delitem__(self, module: Any) -> None:
        if self.get(module, _MISSING) is _MISSING:
            raise KeyError(module)
        del self._entries[id(module)]

    def __contains__(self, module: Any) -> bool:
        return self.get(module, _MISSING) is not _MISSING

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> list[Any]:
        """The values of the modules still alive (a list: safe to iterate while the map changes)."""
        while True:
            try:
                entries = list(self._entries.values())
            except RuntimeError:  # a module collected meanwhile removed its entry: read again
                continue
            return [value for reference, value in entries if reference() is not None]


_MISSING = object()

# Every module hooked by a live recorder. Why: a second watch on the same module would record
# every call twice, so it is refused (AlreadyWatchedError); and the live watches
# (nw.live_watches(), %unload_ext) are found from here, so that a watch whose variable was lost
# can still be closed. Weak on both sides: hooks keep a recorder alive, and a recorder its model.
_WATCHED = ModuleMap()  # nn.Module -> weakref.ref[Recorder]


def watched_modules() -> ModuleMap:
    """module -> weak reference to the recorder whose hooks are on it (the recorder adds and
    removes its modules)."""
    return _WATCHED


def watching_recorders() -> list[Recorder]:
    """Every recorder that still has hooks on some module, each once, oldest first."""
    seen: dict[int, Recorder] = {}
    for reference in list(_WATCHED.values()):
        recorder = reference()
        if recorder is not None and not recorder.closed:
            seen.setdefault(id(recorder), recorder)
    return list(seen.values())


# How core objects open a FrameBrowser. Why: the widgets layer sits above the core (it needs
# ipywidgets and matplotlib), so the package's top level registers the function that builds
# one, and ``watch.browse()`` works without the core importing the widgets.
_browser_opener: Callable[[Any], Any] | None = None


def set_browser_opener(opener: Callable[[Any], Any] | None) -> None:
    """Register the function that builds a FrameBrowser for a source (None: unregister)."""
    global _browser_opener
    _browser_opener = opener


def browser_opener() -> Callable[[Any], Any] | None:
    """The registered FrameBrowser builder, or None."""
    return _browser_opener


# Step guards the training callbacks made. Why: transformers has no callback for a run that
# ended with an exception, so its watch stays on the model; the next run on that model finds
# and closes it here instead of being refused. Weak: a guard lives as long as its callback.
_TRAINING_GUARDS: weakref.WeakSet[Any] = weakref.WeakSet()


def training_guards() -> weakref.WeakSet[Any]:
    """The training callbacks' step guards still alive (they add and discard themselves)."""
    return _TRAINING_GUARDS


# Whether recordings write parquet tables (when pyarrow is there) or JSON. Why: one switch for
# the process, so that tests and users without a working pyarrow can turn parquet off once.
_parquet_wanted = True


def use_parquet(enabled: bool) -> None:
    """Write parquet tables (when pyarrow is installed) or always JSON tables."""
    global _parquet_wanted
    _parquet_wanted = bool(enabled)


def parquet_wanted() -> bool:
    """Whether :func:`use_parquet` left parquet on."""
    return _parquet_wanted


# Optimizer steps taken while a watch is live. Why: fused optimizer kernels (``fused=True``)
# write the parameters without moving their version counters, and any watch must learn of a
# step whoever made the optimizer: one process-wide optimizer-step hook (core.writes) counts
# the steps here and marks the parameters each step's optimizer holds. Ids, not references
# (the marks of a parameter go when it is collected, through a weak reference to it).
class StepLog:
    """``count``: optimizer steps seen; ``marks``: id(parameter) -> ``count`` after the last
    step of an optimizer holding it; ``kinds``: class name of each optimizer that stepped ->
    whether it divides by an ``eps`` (what a diagnosis of a float16 weight gone Inf may
    suggest); ``users``: watches that asked for the hook (``handle``: the hook while any does);
    ``marks_from``: every step after this ``count`` is in ``marks`` (they are dropped when the
    last watch closes, or when too many are kept); ``bad_lr``: id(parameter) -> (``count``,
    optimizer class name, lr) of the last step that wrote it with a NaN/Inf learning rate;
    ``stepping``: a number for the optimizer step in progress (0: none), new for each step
    (``started`` counts them; ``pre_handle``: the hook that numbers them); ``optimizer``: the
    optimizer whose step is in progress, as its hook handed it (kept while ``stepping``: a
    forward inside that step, LBFGS's closure, is told by its param groups); ``step_frame``,
    ``step_code``, ``step_thread``: the id and code of that step's own frame (torch's wrapper
    that calls the hooks) and its thread, so that a step that raised (no post hook runs) is
    found ended when read (:func:`~nanwidget.core.writes.step_in_progress`); ``optimizers``: id -> weak
    reference of every optimizer that stepped, wrappers included (Lookahead: a diagnosis reads
    their param groups and state); ``collected``: id(parameter) -> a weak reference that drops
    its ``marks`` and ``bad_lr`` when the parameter is collected (an optimizer's entry in
    ``optimizers`` goes with it too), so that models built and dropped while a watch stays open
    leave nothing behind."""

    __slots__ = ("count", "marks", "kinds", "users", "handle", "bad_lr", "marks_from",
                 "stepping", "started", "pre_handle", "optimizer", "optimizers", "collected",
                 "step_frame", "step_code", "step_thread")

    def __init__(self) -> None:
        self.count = 0
        self.marks_from = 0
        self.bad_lr: dict[int, tuple[int, str, float]] = {}
        self.marks: dict[int, int] = {}
        self.kinds: dict[str, bool] = {}
        self.users = 0
        self.handle: Any = None
        self.stepping = 0
        self.started = 0
        self.pre_handle: Any = None
        self.optimizer: Any = None
        self.step_frame = 0
        self.step_code: Any = None
        self.step_thread = 0
        self.optimizers: dict[int, Any] = {}
        self.collected: dict[int, Any] = {}


_OPTIMIZER_STEPS = StepLog()


def optimizer_steps() -> StepLog:
    """The process's :class:`StepLog` (core.writes keeps it)."""
    return _OPTIMIZER_STEPS

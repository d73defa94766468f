"""The work behind %nanwatch, in plain classes: no IPython here, so it is testable alone.

:class:`WatchManager` holds the watches started by ``%nanwatch`` by variable name;
:class:`LiveStatus` rides along a ``%%nanwatch`` cell's watch and reports progress at most a
few times a second. The magics only translate user input into these calls.
"""

from __future__ import annotations

import collections
import contextlib
import math
import re
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn

from ..core.events import NanEvent
from ..core.frames import Frame
from ..core.stats import dtype_max
from ..core.recorder import AlreadyWatchedError, Feature
from ..core.options import OPTIONS, SkipTypesWarning, WatchOptions
from ..core.persist.writer import prepare_log_dir
from ..core.watch import NanWatch, live_watches, watch

__all__ = ["WatchManager", "LiveStatus", "MagicUsageError", "describe_magnitude"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class MagicUsageError(ValueError):
    """Misuse of %nanwatch; the magic shows it as IPython's UsageError."""


def describe_magnitude(value: float, dtype: str) -> str:
    """"3.2e+02 (float16: 2.3 decades below its max 65504)"."""
    if not math.isfinite(value) or value <= 0:
        return f"{value:.3g}"
    limit = dtype_max(dtype) if dtype else math.inf
    if not math.isfinite(limit):
        return f"{value:.3g}" + (f" ({dtype})" if dtype else "")
    decades = math.log10(limit / value)
    return f"{value:.3g} ({dtype}: {decades:.1f} decades below its max {limit:.6g})"


class LiveStatus(Feature):
    """Counts batches and tracks the largest finite output magnitude; reports, throttled.

    ``emit(text)`` is called at most once per ``interval`` seconds (plus once at the end
    through :meth:`finish`), never once per batch. With ``sentinel`` (the watch's sentinel
    part, sentinel mode) the magnitude is what the sentinel checks each batch: the model's
    outputs. ``early_warnings`` returns the watch's early warnings, which the line counts.
    """

    def __init__(self, name: str, emit: Callable[[str], None], interval: float = 0.3,
                 clock: Callable[[], float] = time.monotonic, sentinel: Any = None,
                 early_warnings: Callable[[], list] | None = None) -> None:
        self.name = name
        self.early_warnings = early_warnings
        self.emit = emit
        self.interval = interval
        self.clock = clock
        self.sentinel = sentinel
        self.batches = 0
        self.largest = 0.0
        self.largest_dtype = ""
        self.largest_module = ""
        self.events = 0
        self.emitted = 0
        self._last = -math.inf

    def on_event(self, event: NanEvent) -> None:
        self.events += 1

    def on_batch_end(self, batch: int, frames: list[Frame]) -> None:
        self.batches += 1
        largest = self.largest
        sentinel = self.sentinel
        if sentinel is not None:
            # The latest batch the sentinel read (on a GPU it may be the one before): only
            # the model's outputs, the same in every batch, sampled or not. A batch recorded
            # in full (sample_every) is checked by its frames, not the sentinel: its root's.
            checked = sentinel.outputs_abs_max
            if checked > largest:
                largest = checked
                self.largest_dtype = str(sentinel.outputs_dtype).replace("torch.", "")
                self.largest_module = ""
            frames = [frame for frame in frames if frame.module == ""]
        for frame in frames:
            if frame.phase != "forward":
                continue
            for entry in frame.outputs():
                # Reads the stats the watch already resolved; no tensor is touched here.
                stats = entry.stats
                if stats is not None and stats.abs_max > largest and stats.abs_max != math.inf:
                    largest = stats.abs_max
                    self.largest_dtype = str(entry.dtype).replace("torch.", "")
                    self.largest_module = frame.module
        self.largest = largest
        now = self.clock()
        if now - self._last >= self.interval:
            self._last = now
            self.emitted += 1
            self.emit(self.line())

    def line(self) -> str:
        """One line: batches seen, the largest finite |x| among module outputs (with its dtype's
        headroom and the module), events.

        It measures outputs only (weights and inputs are in the FrameBrowser), and says so.
        In sentinel mode it says what the sentinel checks (the model's outputs) and, when it
        does not check gradients, what it cannot see: a loss made outside the model.
        """
        events = f"{self.events} event{'s' if self.events != 1 else ''}" + self._warnings_words()
        seen = f"nanwatch {self.name}: {self.batches} batch{'es' if self.batches != 1 else ''} seen"
        if self.sentinel is not None:
            size = describe_magnitude(self.largest, self.largest_dtype) if self.largest \
                else "none measured yet"
            blind = "" if self.sentinel.backward else \
                (" · a loss made outside the model is checked only with backward=True (the "
                 "gradients; loss_fn then traces the loss's own ops)")
            return (f"{seen} · sentinel mode checks the model's outputs each batch, largest |x| "
                    f"so far: {size}{blind} · {events}")
        where = f" in {self.largest_module or '<root>'!r}" if self.largest else ""
        size = describe_magnitude(self.largest, self.largest_dtype) if self.largest \
            else "none measured yet"
        return f"{seen} · largest |x| among module outputs: {size}{where} · {events}"

    def _warnings_words(self) -> str:
        """" · 2 early warnings (first: 'fc2' growth at batch 9)", or "" when none."""
        early = self.early_warnings() if self.early_warnings is not None else []
        if not early:
            return ""
        first = early[0]
        count = len(early)
        return (f" · {count} early warning{'s' if count != 1 else ''} (first: "
                f"{first.module_label!r} {first.reason} at batch {first.batch})")

    def finish(self, outcome: str = "done") -> None:
        """The last update: the same line, saying how the cell ended."""
        self.emitted += 1
        self.emit(self.line().replace(f"nanwatch {self.name}:", f"nanwatch {self.name} {outcome}:", 1))


def _in_flag_words(message: str) -> str:
    """An option's error as the magic's user reads it: "max_frames must be ..." becomes
    "--frames must be ..." (the flag they typed)."""
    for name, declared in OPTIONS.items():
        if declared.flag is not None and message.startswith(name + " "):
            return declared.flag.names[-1] + message[len(name):]
    return message


def _refuse_forwardless(model: nn.Module, name: str) -> None:
    """A container without a forward of its own (ModuleDict, ModuleList) is never called, so
    no batch of it ever ends and nothing would be checked: the magic refuses it, naming the fix."""
    if type(model).forward is not nn.Module.forward or "forward" in vars(model):
        return  # (a torch.compile wrapper sets its forward on the instance)
    what = name or "the model"
    first = next(iter(model.named_children()), ("", None))[0]
    inside = ""
    if name and first.isidentifier():
        inside = f" (%nanwatch {name}.{first})"
    elif name and first.isdigit():
        inside = f" (part = {name}[{first}], then %nanwatch part)"
    raise MagicUsageError(
        f"{what} is a {type(model).__name__}, which has no forward of its own: its batches never "
        f"end, so %nanwatch would check nothing. Watch a model inside it{inside}, or use "
        f"w = nw.watch({name or 'container'}) and call w.step() after each batch")


class WatchManager:
    """The watches started by %nanwatch, by the variable name of their model."""

    def __init__(self, browsers_kept: int = 4) -> None:
        self.watches: dict[str, NanWatch] = {}
        # The FrameBrowsers the magics showed, oldest first: ipywidgets keeps a widget (and the
        # watch, model and batches a browser shows) until it is closed, so only the latest
        # ``browsers_kept`` stay live; older ones are closed (their output keeps its static copy).
        self.browsers: collections.deque[Any] = collections.deque()
        self.browsers_kept = browsers_kept
        # name -> the object the name named when its watch started: for a torch.compile or
        # DistributedDataParallel wrapper that is the wrapper, not the watch's model (inside it)
        self._named: dict[str, weakref.ref[nn.Module]] = {}
        # name -> id of the object it named when the rebinding was last reported
        self._rebound_reported: dict[str, int | None] = {}

    # ------------------------------------------------------------------ lookup
    @staticmethod
    def lookup(namespace: Mapping[str, Any], name: str, magic: str = "%nanwatch") -> nn.Module:
        """The nn.Module that ``name`` (a variable, or a dotted path like ``trainer.model``) names.
        ``magic``: how the user called it ("%nanwatch" or "%%nanwatch"), for the messages."""
        if not name or not _NAME.match(name):
            raise MagicUsageError(f"{magic} needs the variable name of a model, got {name!r}")
        value = WatchManager.lookup_value(namespace, name, "", what="the model", magic=magic)
        if not isinstance(value, nn.Module):
            kind = type(value).__name__
            article = "an" if kind[:1].lower() in "aeiou" else "a"
            raise MagicUsageError(f"{name!r} is {article} {kind}, not a torch.nn.Module; "
                                  f"{magic} watches a model")
        return value

    @staticmethod
    def lookup_value(namespace: Mapping[str, Any], name: str, flag: str,
                     what: str = "it", magic: str = "%nanwatch") -> Any:
        """The value that ``name`` (a variable, or a dotted path like ``losses.bce``) names in
        the notebook, for ``flag`` ("" for the model)."""
        given = f"{flag} {name}" if flag else name
        if not name or not _NAME.match(name):
            raise MagicUsageError(f"{flag} takes the name of a variable of the notebook, got "
                                  f"{name!r}")
        head, *rest = name.split(".")
        if head not in namespace:
            raise MagicUsageError(f"no variable named {head!r} in the notebook; define {what} "
                                  f"first, then {magic} {'MODEL ' if flag else ''}{given}")
        value = namespace[head]
        for position, attribute in enumerate(rest):
            try:
                value = getattr(value, attribute)
            except AttributeError:
                path = ".".join([head, *rest[:position]])
                raise MagicUsageError(f"{path} has no attribute {attribute!r}") from None
        return value

    # ------------------------------------------------------------------ watches
    def make_watch(self, model: nn.Module, options: dict[str, Any], name: str = "") -> NanWatch:
        """``nw.watch(model, **options)``; its errors become one usage sentence (``name``, the
        variable the user typed, only shapes the messages).

        A ``--skip`` class the model does not use is an error here (``nw.watch`` only warns):
        in a magic line it is a typo to fix before anything is hooked.
        """
        _refuse_forwardless(model, name)
        with self._usage_errors(options):
            try:
                return watch(model, **options)
            except AlreadyWatchedError as error:
                raise MagicUsageError(self._already_watched(model, name, error)) from None

    def check(self, model: nn.Module, options: dict[str, Any], name: str = "") -> None:
        """Check ``options`` for ``model`` as :meth:`make_watch` would, hooking nothing (the
        log directory is made, as the watch would make it)."""
        _refuse_forwardless(model, name)
        with self._usage_errors(options):
            checked = WatchOptions.checked(model, **options)
            if checked.log_dir is not None:
                prepare_log_dir(checked.log_dir)

    @staticmethod
    @contextlib.contextmanager
    def _usage_errors(options: dict[str, Any]) -> Iterator[None]:
        """Misuse inside, as one usage sentence."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", SkipTypesWarning)
                # A compiled model's "watched in sentinel mode" note: describe() says it.
                warnings.filterwarnings("ignore", message="nanwidget: watching .* in sentinel mode")
                yield
        except SkipTypesWarning as warning:
            raise MagicUsageError(str(warning).replace("skip_types:", "--skip:", 1)) from None
        except (TypeError, ValueError) as error:
            raise MagicUsageError(_in_flag_words(str(error))) from None
        except OSError as error:  # the log directory: a used recording, no permission
            raise MagicUsageError(f"--log-dir {options.get('log_dir')}: "
                                  f"{error.strerror or error}"
                                  + (f" ({error.filename})" if error.filename else "")) from None

    def _already_watched(self, model: nn.Module, name: str, error: Exception) -> str:
        """Say which watch holds the model and the exact line that stops it."""
        # The holder may watch a part of this model, or a model this one is a part of.
        modules = set(map(id, model.modules()))
        holder = next((held for held, watched in self.watches.items()
                       if not watched.closed and (id(watched.model) in modules or any(
                           part is model for part in watched.model.modules()))), None)
        what = name or "this model"
        if holder is not None:
            return (f"{what} is already watched by %nanwatch {holder}; stop that watch first "
                    f"with: %nanwatch --off {holder}")
        return (f"{what} is already watched by a watch made with nw.watch() ({error}); close it "
                "with its close() method, or find it with nw.live_watches()")

    def start(self, name: str, model: nn.Module, options: dict[str, Any]) -> tuple[NanWatch, bool]:
        """Watch ``model`` under ``name``; a watch already held under that name is replaced.

        Returns the watch and whether it replaced one. Options are checked first: a typo
        leaves the watch already held as it was.
        """
        self.check(model, options, name)
        previous = self.watches.pop(name, None)
        if previous is not None:
            previous.close()
        try:
            started = self.make_watch(model, options, name)
        except MagicUsageError as error:
            if previous is not None:
                raise MagicUsageError(f"{error} (the earlier watch on {name} was stopped)") from None
            raise
        self.watches[name] = started
        self._named[name] = weakref.ref(model)
        self._rebound_reported.pop(name, None)
        return started, previous is not None

    def stop(self, name: str | None = None, namespace: Mapping[str, Any] | None = None) -> list[str]:
        """Close the watch on ``name`` (or all); returns the names stopped.

        A model that ``nw.watch()`` watches (not %nanwatch) is stopped too when ``namespace``
        holds it under ``name``.
        """
        if name is None:
            names = list(self.watches)
        elif name in self.watches:
            names = [name]
        else:
            other = self._live_watch_of(namespace, name)
            if other is None:
                held = ", ".join(self.watches) or "nothing"
                raise MagicUsageError(f"%nanwatch --off {name}: there is no such watch (%nanwatch "
                                      f"is watching: {held}; nw.live_watches() lists every watch)")
            other.close()
            return [name]
        for key in names:
            self.watches.pop(key).close()
            self._named.pop(key, None)
            self._rebound_reported.pop(key, None)
        return names

    @staticmethod
    def _live_watch_of(namespace: Mapping[str, Any] | None, name: str) -> NanWatch | None:
        if namespace is None or not _NAME.match(name):
            return None
        try:
            model = WatchManager.lookup(namespace, name)
        except MagicUsageError:
            return None
        return next((w for w in live_watches() if w.model is model), None)

    def rebound_names(self, namespace: Mapping[str, Any]) -> list[str]:
        """One sentence per watched variable that now names another object (or nothing).

        A line watch follows the object, not the name: after ``model = Net()`` it still watches
        the old model. Each rebinding is reported once.
        """
        sentences = []
        for name, watched in self.watches.items():
            try:
                current: Any = self.lookup(namespace, name)
            except MagicUsageError:
                current = None
            named = self._named.get(name)
            if current is not None and current is (named() if named else watched.model):
                self._rebound_reported.pop(name, None)
                continue
            key = id(current) if current is not None else None
            if self._rebound_reported.get(name, -1) == key:
                continue
            self._rebound_reported[name] = key
            now = "no longer names a model" if current is None else "now names another object"
            sentences.append(
                f"nanwidget: {name} {now}; %nanwatch is still watching the model it named "
                f"before. Watch the new one with %nanwatch {name}, or stop with "
                f"%nanwatch --off {name}")
        return sentences

    def rebound_in_cell(self, namespace: Mapping[str, Any], name: str, model: nn.Module) -> str:
        """The sentence to say after a ``%%nanwatch`` cell whose code rebound ``name`` (``model =
        Net()`` inside the cell): the watch was on ``model``, what the name named when the cell
        started, so it saw none of the new model's batches. "" when ``name`` still names it."""
        try:
            current: Any = self.lookup(namespace, name)
        except MagicUsageError:
            current = None
        if current is model:
            return ""
        now = "no longer names a model" if current is None else "was rebound inside the cell"
        head, _, attribute = name.rpartition(".")
        if head and current is not None:
            # An attribute a call in the cell set anew: a training wrapper's fit() built a new
            # model (skorch's net.fit(X, y) makes a new net.module_), so an earlier cell
            # cannot build the one that trains.
            return (f"nanwidget: {name} {now} (a call set a new {attribute} on {head}), so "
                    "%%nanwatch watched the model it named before and saw none of the new "
                    "model's batches. Train with a call that keeps it (skorch builds a new "
                    f"module_ in fit(): {head}.initialize() in an earlier cell, then "
                    f"{head}.partial_fit(X, y) under %%nanwatch {name}), or call "
                    f"nw.watch({name}) inside the cell once it is built.")
        return (f"nanwidget: {name} {now}, so %%nanwatch watched the model it named before and "
                "saw none of the new model's batches. Build the model in an earlier cell and "
                f"train it under %%nanwatch {name}, or call nw.watch({name}) inside the cell "
                "after building it.")

    def shown(self, browser: Any) -> Any:
        """Keep ``browser`` (just shown) among the live ones; close the oldest past
        ``browsers_kept``. Returns ``browser``."""
        self.browsers.append(browser)
        while len(self.browsers) > max(self.browsers_kept, 1):
            self._close_browser(self.browsers.popleft())
        return browser

    def close_browsers(self) -> None:
        """Close every FrameBrowser the magics showed."""
        while self.browsers:
            self._close_browser(self.browsers.popleft())

    @staticmethod
    def _close_browser(browser: Any) -> None:
        try:
            browser.close()
        except Exception:  # a widget the frontend already closed: nothing left to free
            pass

    def close_all(self) -> int:
        """Close every watch this manager holds and every other live NanWatch; returns the count."""
        closed = 0
        for key in list(self.watches):
            self.watches.pop(key).close()
            closed += 1
        self._named.clear()
        # Watches made with nw.watch() in the notebook too: unloading removes every hook.
        for other in live_watches():
            other.close()
            closed += 1
        return closed

    @staticmethod
    def describe(name: str, watched: NanWatch) -> str:
        """One status line for a started watch."""
        trace = f", tracing batches {sorted(watched.trace_batches)}" if watched.trace_batches else ""
        backward = ", backward too" if watched.backward else ""
        if watched.mode == "sentinel":
            compiled = ", compiled" if watched.compiled else ""
            sample = (f", 1 batch in {watched.sample_every} recorded in full"
                      if watched.sample_every else "")
            what = (f"in sentinel mode ({type(watched.model).__name__}{compiled}: outputs"
                    f"{' and gradients' if watched.backward else ''} checked each batch, a failing "
                    f"batch replayed in full{sample})")
            return (f"nanwidget: watching {name} {what}{trace}, on NaN/Inf: {watched.on_nan}. "
                    f"Stop with %nanwatch --off {name}")
        return (f"nanwidget: watching {name} ({type(watched.model).__name__}, "
                f"{len(watched.module_names)} modules hooked), keeping {watched.max_frames} frames"
                f"{trace}{backward}, on NaN/Inf: {watched.on_nan}. Stop with %nanwatch --off {name}")


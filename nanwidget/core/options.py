"""Every option of :func:`nanwidget.watch`, declared once.

Each option is one field of :class:`WatchOptions`, made with :func:`option`: its default, what it
takes (the check that normalises a value or raises a sentence naming the option), one line of
help, and, when the notebook offers it, its ``%nanwatch`` flag. Everything else is derived from
these fields:

- ``nw.watch()``'s signature and help (:func:`signature_of_options`, :func:`options_help`);
- the checks a watch runs before hooking anything (:meth:`WatchOptions.checked`);
- ``%nanwatch``'s flags and its ``%nanwatch?`` help (the magics read :data:`OPTIONS`);
- the keyword arguments the training callbacks accept (:func:`check_option_names`);
- the options a recording's manifest stores (:meth:`WatchOptions.manifest`).

Adding an option: a field here, the feature that reads ``options.<name>``, and a test.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import inspect
import math
import numbers
import operator
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from torch import nn

__all__ = ["WatchOptions", "Option", "Flag", "Needs", "OPTIONS", "OPTION_NAMES", "option",
           "ON_NAN_CHOICES", "MODES", "MAX_EVENTS", "MAX_FRAMES_LIMIT", "SkipTypesWarning",
           "check_option_names", "signature_of_options", "options_help", "split_classes",
           "batch_number", "name_matches", "wrapper_names", "is_loss_scale_optimizer",
           "loss_function"]

ON_NAN_CHOICES = ("raise", "warn", "record")
MODES = ("full", "sentinel")
MAX_EVENTS = 100
MAX_FRAMES_LIMIT = 10_000_000  # a ring beyond this would not fit in memory anyway


class SkipTypesWarning(UserWarning):
    """A ``skip_types`` class name that no module of the model has: it skips nothing."""


# ---------------------------------------------------------------------------- declarations
@dataclass(frozen=True)
class Flag:
    """How ``%nanwatch`` spells an option. ``parse`` turns the flag's text into a value (then
    the option's own check runs); a flag without ``parse`` is a switch that sets ``value``.
    ``lookup``: the flag's text names a variable of the notebook (``loss`` or ``losses.bce``,
    found like the model), whose value is the option's value."""

    names: tuple[str, ...]
    parse: Callable[[str], Any] | None = None
    value: Any = True
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    help: str | None = None  # when the notebook's wording differs from the option's help
    lookup: bool = False


@dataclass(frozen=True)
class Needs:
    """A rule between options: this one is for ``option`` set to ``value`` (``words`` names that
    case for the notebook, ``why`` says why)."""

    option: str
    value: Any
    words: str
    why: str


@dataclass(frozen=True)
class Option:
    """One option: what :func:`option` declared, with its field name."""

    name: str
    default: Any
    help: str
    check: Callable[[Any, nn.Module | None], Any]
    flag: Flag | None
    needs: Needs | None
    manifest: Callable[[Any], Any]


def option(default: Any, help: str, check: Callable[[str, Any, nn.Module | None], Any], *,
           flag: Flag | None = None, needs: Needs | None = None,
           manifest: Callable[[Any], Any] | None = None) -> Any:
    """A :class:`WatchOptions` field. ``check(name, value, model)`` returns the value normalised
    or raises TypeError/ValueError naming the option (``model`` is None when the model is not
    known yet: checks that need it are skipped). ``manifest``: the value as a recording's
    manifest stores it (JSON); the default stores it as it is."""
    return field(default=default, metadata={"help": help, "check": check, "flag": flag,
                                            "needs": needs, "manifest": manifest})


# ---------------------------------------------------------------------------- checks
def _whole_number(name: str, value: Any, *, least: int, most: int | None = None,
                  why: str = "") -> int:
    """``value`` as an int (numpy and torch integers too); bools, floats and text refused."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a whole number, got {value!r} (a bool)")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a whole number, got {_described(value)}") from None
    if number < least or (most is not None and number > most):
        bound = f"at least {least}" + (f" and at most {most:,}" if most is not None else "")
        raise ValueError(f"{name} must be {bound}{why}, got {number}")
    return number


def batch_number(value: Any, name: str = "batch") -> int:
    """``value`` as a batch number: a whole number >= 0, numpy and torch integers too (a loop's
    step counter is often one); bools, floats and text refused."""
    return _whole_number(name, value, least=0, why=" (batches count from 0)")


def whole(least: int, most: int | None = None, *, optional: bool = False,
          why: str = "") -> Callable[[str, Any, Any], int | None]:
    """The check of a whole-number option (``optional``: None allowed)."""
    def check(name: str, value: Any, model: Any) -> int | None:
        if value is None and optional:
            return None
        return _whole_number(name, value, least=least, most=most, why=why)
    return check


def switch(name: str, value: Any, model: Any) -> bool:
    """The check of a True/False option."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {_described(value)}")


def one_of(choices: tuple[Any, ...], *, optional: bool = False) -> Callable[[str, Any, Any], Any]:
    """The check of an option that takes one of ``choices`` (``optional``: None allowed)."""
    def check(name: str, value: Any, model: Any) -> Any:
        if value is None and optional:
            return None
        if not isinstance(value, str) or value not in choices:
            if len(choices) == 2:
                raise ValueError(f"{name} must be {choices[0]!r} or {choices[1]!r}, got {value!r}")
            raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
        return value
    return check


def _batch_numbers(name: str, value: Any, model: Any) -> frozenset[int]:
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} takes batch numbers, got the text {value!r}; write a "
                        f"list such as [1, 3]")
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} takes batch numbers, got {value!r}")
    try:
        if not hasattr(value, "__iter__") or getattr(value, "ndim", 1) == 0:
            return frozenset({operator.index(value)})
        items = list(value)
    except TypeError:
        raise TypeError(f"{name} takes batch numbers (e.g. [1, 3]), got {value!r}") from None
    bad, batches = [], set()
    for item in items:
        try:
            batches.add(_whole_number(name, item, least=0))
        except (TypeError, ValueError):
            bad.append(item)
    if bad:
        raise ValueError(f"{name} takes batch numbers, whole and >= 0 (batches count from "
                         f"0); these are not: {', '.join(repr(b) for b in bad)}")
    return frozenset(batches)


def _one_or_many(value: Any, takes: str) -> list:
    """The items of an option that takes one string or class, or several."""
    if isinstance(value, (str, type)):
        return [value]
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{takes}, got {value!r}") from None


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _warn_caller(message: str, category: type[Warning]) -> None:
    """A warning pointing at the first frame outside nanwidget (the user's watch() call)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _skip_types(name: str, value: Any, model: nn.Module | None) -> tuple[type | str, ...]:
    """Module classes or class names; one class or one name alone is accepted too. A name
    that no module of ``model`` has warns with the closest one."""
    items = _one_or_many(value, f"{name} takes nn.Module classes or class names (e.g. "
                                "[nn.Dropout] or ['Dropout'])")
    for item in items:
        if not isinstance(item, str) and not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(f"{name} takes nn.Module classes or class names, got {item!r}")
    if model is not None:
        present = {type(m).__name__ for m in model.modules()}
        for missing in sorted({i for i in items if isinstance(i, str)} - present):
            close = difflib.get_close_matches(missing, sorted(present), n=1, cutoff=0.6) or [
                p for p in sorted(present) if p.lower() == missing.lower()]
            hint = f"; did you mean {close[0]!r}?" if close else ""
            _warn_caller(f"{name}: this model has no module of class {missing!r}, so it skips "
                         f"nothing{hint}", SkipTypesWarning)
    return tuple(dict.fromkeys(items))


# Modules that wrap the user's module and put their attribute in its name: FSDP1's units,
# activation checkpointing's wrapper, a submodule compiled with torch.compile. A user names the
# module as they wrote it ('blocks.1.mask', not 'blocks.1._checkpoint_wrapped_module.mask').
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def name_matches(name: str, pattern: str) -> bool:
    """Whether the module name glob ``pattern`` matches the module named ``name``, as written
    or as the user wrote it (without the wrappers' segments: FSDP1, checkpoint_wrapper,
    torch.compile'd submodules)."""
    if fnmatch.fnmatchcase(name, pattern):
        return True
    parts = name.split(".")
    if not _WRAPPER_SEGMENTS.intersection(parts):
        return False
    return fnmatch.fnmatchcase(".".join(p for p in parts if p not in _WRAPPER_SEGMENTS), pattern)


def wrapper_names(names: list[str], chosen: set[str]) -> set[str]:
    """The modules of ``names`` that wrap one of ``chosen`` (its name is theirs plus a wrapper's
    segment, as FSDP1 and checkpoint_wrapper make): they return what it returns."""
    return {name for name in names
            if any((f"{name}.{segment}" if name else segment) in chosen
                   for segment in _WRAPPER_SEGMENTS)}


def _allow_inf(name: str, value: Any, model: nn.Module | None) -> tuple[str | type, ...]:
    """Module name globs and nn.Module classes whose outputs may hold ±inf (one, or several);
    one that matches no module of ``model`` warns (it would allow nothing). "" is the root."""
    items = _one_or_many(value, f"{name} takes module name globs (e.g. 'encoder.*.mask') or "
                                "nn.Module classes")
    for item in items:
        if not isinstance(item, str) and not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(f"{name} takes module name globs (e.g. 'encoder.*.mask') or "
                            f"nn.Module classes, got {item!r}")
    if model is not None:
        named = dict(model.named_modules())
        unmatched = [p for p in items if isinstance(p, str)
                     and not any(name_matches(n, p) for n in named)]
        unmatched += [c.__name__ for c in items if isinstance(c, type)
                      and not any(isinstance(m, c) for m in named.values())]
        if unmatched:
            examples = ", ".join(repr(n) for n in list(named)[1:4])
            examples = f"module names look like {examples}; '' is the root" if examples \
                else "'' is the root"
            classes = {type(m).__name__ for m in named.values()}
            given = [p for p in unmatched if p in classes]
            hint = (f"; {', '.join(repr(p) for p in given)} is a class name: pass the class "
                    f"itself, {name}=[{given[0]}]") if given else ""
            _warn_caller(f"nanwidget: {name}={', '.join(unmatched)} matches no module of this "
                         f"model, so it allows nothing ({examples}{hint})", RuntimeWarning)
    return tuple(dict.fromkeys(items))


def _grad_scaler(name: str, value: Any, model: Any) -> Any:
    """A ``torch.amp.GradScaler`` (or any scaler with its ``scale`` / ``update`` /
    ``get_scale`` methods), an object holding one as ``.scaler`` (accelerate's
    ``Accelerator``, Lightning's mixed-precision plugin), ``._scaler`` (timm's
    ``NativeScaler``) or ``.strategy.precision.scaler`` (Lightning's ``Fabric``), or an
    optimizer that scales the loss itself (:func:`is_loss_scale_optimizer`: Keras'
    ``LossScaleOptimizer``): the scaler, or None when it holds none (no float16 loss scaling
    to watch)."""
    if value is None:
        return None
    if is_loss_scale_optimizer(value):
        return value
    if not _is_scaler(value) and not hasattr(value, "scaler"):
        # Lightning Fabric holds its precision plugin (whose .scaler it is) in its strategy
        precision = getattr(getattr(value, "strategy", None), "precision", None)
        if precision is not None:
            value = precision
            if not hasattr(value, "scaler"):  # "32-true", "bf16-true": no loss scaling
                return None
    if not _is_scaler(value):
        # accelerate and Lightning hold theirs as .scaler, timm's NativeScaler as ._scaler
        for holder in ("scaler", "_scaler"):
            if hasattr(value, holder):
                held = getattr(value, holder)
                if held is None:
                    return None
                value = held
                break
    if not _is_scaler(value):
        kind = type(value)
        # An optimizer's repr is many lines (its parameter groups): name its type instead.
        shown = repr(value)
        got = f"{shown} ({kind.__name__})" if len(shown) <= 60 and "\n" not in shown \
            else f"a {_public_name(kind)}"
        hint = (": an optimizer, not the scaler; pass the GradScaler whose scaler.step() "
                "steps it") if hasattr(value, "param_groups") and callable(
                    getattr(value, "zero_grad", None)) else ""
        raise TypeError(f"{name} takes a torch.amp.GradScaler (or an object holding one, such "
                        f"as accelerate's Accelerator, Lightning's Fabric or timm's NativeScaler, "
                        f"or Keras' LossScaleOptimizer), got {got}{hint}")
    return value


def _public_name(kind: type) -> str:
    """A class's name as users import it: "torch.optim.Adam", not "torch.optim.adam.Adam"."""
    parts = kind.__module__.split(".")
    for end in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:end]))
        if module is not None and getattr(module, kind.__qualname__, None) is kind:
            return f"{'.'.join(parts[:end])}.{kind.__qualname__}"
    return f"{kind.__module__}.{kind.__qualname__}"


def _is_scaler(value: Any) -> bool:
    return all(callable(getattr(value, method, None))
               for method in ("scale", "update", "get_scale", "is_enabled"))


def is_loss_scale_optimizer(value: Any) -> bool:
    """Whether ``value`` is an optimizer that does dynamic loss scaling itself, as Keras'
    ``LossScaleOptimizer`` does (told by its methods, nothing imported): ``scale_loss(loss)``
    multiplies the loss by its ``dynamic_scale`` (``initial_scale`` until it is built), and
    ``apply(grads, ...)`` skips a step whose gradients are not all finite, halving that
    scale."""
    return callable(getattr(value, "scale_loss", None)) \
        and callable(getattr(value, "apply", None)) \
        and (hasattr(value, "dynamic_scale") or hasattr(value, "initial_scale")) \
        and not isinstance(value, nn.Module)


def split_classes(items: tuple[str | type, ...]) -> tuple[tuple[str, ...], tuple[type, ...]]:
    """The strings and the classes of a ``skip_types`` or ``allow_inf`` value, apart."""
    return (tuple(i for i in items if isinstance(i, str)),
            tuple(i for i in items if isinstance(i, type)))


def _threshold(name: str, value: Any, model: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating)):
        raise TypeError(f"{name} must be a positive number or None, got {_described(value)}")
    number = float(value)
    if not (0 < number < math.inf):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return number


def _directory(name: str, value: Any, model: Any) -> str | os.PathLike | None:
    if value is None or (isinstance(value, str) and value == ""):
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a directory path (str or pathlib.Path), got "
                        f"{_described(value)}")
    path = os.fspath(value)
    if isinstance(path, bytes) or (os.path.exists(path) and not os.path.isdir(path)):
        raise ValueError(f"{name} must be a directory; {path!r} is a file (pass a new folder: "
                         "it is created when missing)")
    return value


def _loss_function(name: str, value: Any, model: Any) -> Callable[[Any], Any] | None:
    """A callable taking the model's output and returning the loss (a scalar tensor), or None."""
    if value is None:
        return None
    if isinstance(value, type):
        raise TypeError(f"{name} must be a function of the model's output that returns the loss, "
                        f"got the class {value.__name__}; pass a function such as "
                        f"lambda out: criterion(out, targets)")
    if not callable(value):
        raise TypeError(f"{name} must be a function of the model's output that returns the loss "
                        f"(e.g. lambda out: criterion(out, targets)), got {_described(value)}")
    needs = _arguments_besides_the_first(value)
    if needs is not None:
        shown = getattr(value, "__name__", None) or f"{type(value).__name__}()"
        what = f"also needs {', '.join(needs)}" if needs else "does not take it"
        raise TypeError(f"{name} is called with the model's output alone, and {shown} {what}: "
                        f"pass a function of the output, such as lambda out: criterion(out, "
                        f"targets)")
    return value


def loss_function(value: Any, name: str = "loss_fn") -> Callable[[Any], Any] | None:
    """``value`` checked as a ``loss_fn`` (a function of the model's output returning the
    loss, or None); a TypeError that says what is wrong otherwise."""
    return _loss_function(name, value, None)


def _arguments_besides_the_first(function: Any) -> list[str] | None:
    """None when ``function`` (a module: its forward) can be called with the model's output
    alone, or its signature cannot be read (a builtin: left to the call); else the required
    arguments it has besides that one (a criterion such as ``nn.MSELoss()`` or
    ``F.cross_entropy`` needs its target; empty: it takes no argument at all)."""
    target = function.forward if isinstance(function, nn.Module) else function
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(None)
        return None
    except TypeError:
        pass
    return [parameter.name for parameter in list(signature.parameters.values())[1:]
            if parameter.default is parameter.empty
            and parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD,
                                   parameter.KEYWORD_ONLY)]


def _described(value: Any) -> str:
    """A wrong value as an error quotes it: its repr and type on one line, or just its type when
    the repr spans lines or runs long (an optimizer's lists every param group)."""
    try:
        text = repr(value)
    except Exception:
        text = ""
    if not text or "\n" in text or len(text) > 80:
        kind = type(value).__name__
        return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind} object"
    return f"{text} ({type(value).__name__})"


def _function_name(value: Any) -> str | None:
    """A function as a recording's manifest names it (None for None)."""
    if value is None:
        return None
    return getattr(value, "__qualname__", None) or type(value).__name__


# ---------------------------------------------------------------------------- flag parsers
def parse_number(kind: type) -> Callable[[str], Any]:
    """A flag's text as a number of ``kind`` (int or float); the option's check does the rest."""
    def parse(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise ValueError(f"expected {what}, got {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


def parse_batches(text: str) -> tuple[int, ...]:
    """"1,3" -> (1, 3). Raises ValueError with a sentence on anything else, an empty part
    ("1,,2", "1,", "") too."""
    parts = [p.strip() for p in text.split(",")]
    try:
        batches = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected batch numbers separated by commas (e.g. 1,3), got {text!r}") \
            from None
    if any(b < 0 for b in batches):
        raise ValueError(f"batch numbers start at 0, got {text!r}")
    return batches


def parse_class_names(text: str) -> tuple[str, ...]:
    """"Dropout,ReLU" -> ("Dropout", "ReLU"). An empty part ("Dropout,,ReLU", "") is an error."""
    names = tuple(p.strip() for p in text.split(","))
    if not all(n.isidentifier() for n in names):
        raise ValueError(f"expected module class names separated by commas (e.g. Dropout,ReLU), "
                         f"got {text!r}")
    return names


def _names(items: Any) -> list[str]:
    return [i if isinstance(i, str) else i.__name__ for i in items]


# ---------------------------------------------------------------------------- the options
@dataclass(frozen=True)
class WatchOptions:
    """The options of one watch, checked and normalised. Make it with :meth:`checked`."""

    max_frames: int = option(
        21, "frames kept in the ring buffer (transformers' default)",
        whole(1, MAX_FRAMES_LIMIT),
        flag=Flag(("-n", "--frames"), parse_number(int),
                  help="frames kept in the ring buffer (default 21; %%config "
                       "NanwatchMagics.frames)"))
    trace_batches: frozenset[int] = option(
        frozenset(), "batches whose every frame is kept and reported, e.g. [1, 3]",
        _batch_numbers, flag=Flag(("--trace-batches",), parse_batches,
                                  help="batches whose every frame is kept, e.g. 1,3"),
        manifest=sorted)
    abort_after: int | None = option(
        None, "stop (raise nw.AbortAfterBatch) once this batch has finished",
        whole(0, optional=True, why=" (batch numbers start at 0)"),
        flag=Flag(("--abort-after",), parse_number(int),
                  help="stop once this batch has finished (raises AbortAfterBatch)"))
    skip_types: tuple[type | str, ...] = option(
        (), "module classes (or class names) not hooked, e.g. [nn.Dropout]", _skip_types,
        flag=Flag(("--skip",), parse_class_names,
                  help="module classes not hooked, e.g. Dropout,ReLU"), manifest=_names)
    backward: bool = option(
        False, "also record gradient frames (grad_input / grad_output)", switch,
        flag=Flag(("--backward",), help="also record gradient frames"))
    grad_norm_warn: float | None = option(
        None, "flag parameters whose gradient norm exceeds this", _threshold,
        flag=Flag(("--grad-norm",), parse_number(float),
                  help="flag parameters whose gradient norm exceeds this"))
    on_nan: str = option(
        "raise", "at a NaN/Inf: 'raise' (stop), 'warn', or 'record' only", one_of(ON_NAN_CHOICES),
        flag=Flag(("--on-nan",), str, choices=ON_NAN_CHOICES,
                  help="at a NaN/Inf: raise (stop), warn, or only record (default raise)"))
    keep_batches: int = option(
        4, "recent batches whose inputs and RNG state are held for replay()", whole(0))
    replay_on_nan: bool = option(
        False, "on an event, replay its batch in trace mode (event.trace)", switch)
    log_dir: str | os.PathLike | None = option(
        None, "directory: spool frames, history and events to disk as they are made",
        _directory, flag=Flag(("--log-dir",), os.path.expanduser,
                             help="directory to spool the records to"),
        manifest=lambda value: None if value is None else os.fspath(value))
    max_events: int = option(
        MAX_EVENTS, "events kept, the first ones, in memory and in log_dir alike (later ones are "
                    "counted in events_dropped)", whole(1))
    snapshot_weights: bool = option(
        False, "copy the weights of held batches, so replays stay exact after optimizer steps",
        switch)
    allow_inf: tuple[str | type, ...] = option(
        (), "module names (globs; '' is the root) or classes whose outputs may hold ±inf on "
            "purpose (NaN always counts)", _allow_inf, manifest=_names)
    mode: str | None = option(
        None, "'full' (every module, every batch) or 'sentinel' (the outputs each batch, a "
              "failing batch replayed in full; made to stay on). None: full for an eager "
              "model, sentinel for a compiled one", one_of(MODES, optional=True),
        flag=Flag(("--sentinel",), value="sentinel",
                  help="sentinel mode: check only the outputs (and with --backward the "
                       "gradients) each batch, replay a failing batch for the detail; made to "
                       "stay on"))
    sample_every: int | None = option(
        None, "sentinel mode: record every Nth batch in full (history, trends, FrameBrowser)",
        whole(1, optional=True),
        needs=Needs("mode", "sentinel", "sentinel mode", "full mode records every batch already"),
        flag=Flag(("--sample-every",), parse_number(int),
                  help="with --sentinel: record every Nth batch in full (trends, FrameBrowser)"))
    loss_fn: Callable[[Any], Any] | None = option(
        None, "loss_fn(output) -> scalar loss, as in replay(): automatic replays also run the "
              "loss and its backward, so a NaN made in the loss is traced to its line (they run "
              "within the failing step: a closure sees that step's targets)",
        _loss_function, manifest=_function_name,
        flag=Flag(("--loss-fn",), str, lookup=True, metavar="NAME",
                  help="a function of the notebook, loss_fn(output) -> loss: automatic replays "
                       "run it and its backward, so a NaN made in the loss is traced"))
    grad_scaler: Any = option(
        None, "a torch.amp.GradScaler (or an Accelerator or Fabric holding one, or Keras' "
              "LossScaleOptimizer: found by itself in a model compiled with one): a gradient "
              "NaN/Inf in a step it skips (lowering its scale) is not an event; skips are listed "
              "in w.scaler_skips", _grad_scaler,
        manifest=lambda value: None if value is None else type(value).__name__)
    scaler_patience: int = option(
        8, "with grad_scaler: this many skipped steps in a row are an event", whole(1))
    early_warning: bool = option(
        True, "warn (never stop) when an output nears its dtype's largest value or grows "
              "towards it geometrically: w.warnings, nw.EarlyWarningIssued", switch,
        flag=Flag(("--no-early-warning",), value=False,
                  help="no early warnings (an output near its dtype's largest value, or "
                       "growing towards it)"))

    def __post_init__(self) -> None:
        for declared in OPTIONS.values():  # rules between options, as declared
            needs = declared.needs
            if needs is None or getattr(self, declared.name) == declared.default:
                continue
            other = getattr(self, needs.option)
            if other is not None and other != needs.value:
                raise ValueError(f"{declared.name} is for {needs.option}={needs.value!r} "
                                 f"({needs.why})")

    @classmethod
    def checked(cls, model: nn.Module | None = None, **values: Any) -> WatchOptions:
        """Every option checked before anything is hooked: misuse raises TypeError (wrong kind
        of value) or ValueError (out of range) naming the option; an unknown name raises
        TypeError with the closest one. ``model`` (None: not known yet) is what name-based
        options are matched against (a ``skip_types`` name no module has warns)."""
        check_option_names(values)
        checked = {name: OPTIONS[name].check(name, value, model) for name, value in values.items()}
        return cls(**checked)

    def replace(self, **values: Any) -> WatchOptions:
        """A copy with ``values`` changed (checked again, without a model)."""
        return dataclasses.replace(self, **{name: OPTIONS[name].check(name, value, None)
                                            for name, value in values.items()})

    def manifest(self) -> dict[str, Any]:
        """The options as a recording's manifest stores them (JSON values)."""
        return {declared.name: declared.manifest(getattr(self, declared.name))
                for declared in OPTIONS.values()}


def _declared() -> dict[str, Option]:
    declared = {}
    for spec in dataclasses.fields(WatchOptions):
        meta = spec.metadata
        check = meta["check"]
        declared[spec.name] = Option(name=spec.name, default=spec.default, help=meta["help"],
                                     check=check, flag=meta["flag"], needs=meta["needs"],
                                     manifest=meta["manifest"] or (lambda value: value))
    return declared


OPTIONS: dict[str, Option] = _declared()
OPTION_NAMES: tuple[str, ...] = tuple(OPTIONS)


def check_option_names(values: dict[str, Any], *, passed_by: str = "") -> None:
    """Refuse a name that is no option, with the closest one (``passed_by``: who passes the
    options on to ``nw.watch``, for the message)."""
    unknown = [name for name in values if name not in OPTIONS]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        via = f" ({passed_by} passes its options on to nw.watch)" if passed_by else ""
        raise TypeError(f"unknown nw.watch option {name!r}{hint}{via}; the options are: "
                        f"{', '.join(OPTION_NAMES)}")


def signature_of_options(leading: list[inspect.Parameter]) -> inspect.Signature:
    """A signature: ``leading`` parameters, then every option as a keyword with its default."""
    return inspect.Signature(leading + [
        inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY,
                          default=() if o.default == frozenset() else o.default)
        for o in OPTIONS.values()])


def options_help(indent: str = "    ") -> str:
    """One line per option: its name, default and what it does (for docstrings)."""
    lines = []
    for declared in OPTIONS.values():
        default = declared.default
        shown = "()" if default in ((), frozenset()) else repr(default)
        lines.append(f"{indent}{declared.name}={shown}: {declared.help}")
    return "\n".join(lines)

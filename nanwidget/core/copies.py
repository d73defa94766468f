"""Copies of a watched model are not watched: ``copy.deepcopy``, ``pickle``, ``torch.save(model)``.

A watch's hooks are methods of its recorder, which holds locks and the native kernel's buffers:
none of that can be copied or pickled, and a copy should not be watched anyway (an EMA copy or a
best-model checkpoint is another model). So every module a watch hooks gets, for as long as the
watch lasts, an ``__getstate__`` of its own (``copy`` and ``pickle`` look it up on the instance,
whose ``__dict__`` comes before the class): the module's state as its class gives it, less
nanwidget's hook entries and less itself. A copy made from that state has the user's own hooks
and none of ours, and unpickles where nanwidget is not installed. The original keeps its hooks.
A module whose class copies itself (``__deepcopy__``: a parametrized module's) gets an
``__deepcopy__`` of its own too, which cleans what the class's copy took.

``torch.jit.script`` compiles every hook on a module, and ours cannot be compiled. It asks each
module for ``__prepare_scriptable__`` first: a watched module's gives it a twin of its subtree
without the watch (new module objects around the same parameters, buffers and attributes, with
the user's own hooks), so the scripted model is the unwatched one and shares its weights with the
model, as a script of the unwatched model does. The watched model itself is left as it was.

Helpers that put a new module in a watched one's place in the model (``torch.ao.quantization``'s
``quantize_dynamic``, ``convert`` and ``fuse_modules`` with ``inplace=True``) register the old
module's forward hooks on the new one again, as plain hooks: without ``with_kwargs``, so torch
calls them with one argument fewer. The watch registers every module hook of its own with
``with_kwargs`` (keep it so); a nanwidget hook without it is such a copy. The hooks take that missing
argument as :data:`COPIED` and then only :func:`drop_copied_hooks` (the new module is one added
after the watch: unhooked, named in the events it affects); a watched module being copied or
pickled drops its children's, and ``close()`` drops them from the whole model.
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any

from torch import nn

__all__ = ["copy_without_watch", "stop_copying_without_watch", "is_nanwidget_hook",
           "unwatched_twin", "drop_copied_hooks", "COPIED"]

_KEY = "__getstate__"
_PACKAGE = __name__.split(".")[0]

#: The default of a watch hook's last argument: torch called a copy of the hook that a helper
#: registered without ``with_kwargs`` (see :func:`drop_copied_hooks`).
COPIED: Any = object()

_WITH_KWARGS = (("_forward_hooks", "_forward_hooks_with_kwargs"),
                ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"))


def drop_copied_hooks(module: nn.Module) -> None:
    """Remove from ``module`` the nanwidget forward hooks registered without ``with_kwargs``:
    copies a torch helper made when it put ``module`` in place of a watched module."""
    state = module.__dict__
    for table_name, flags_name in _WITH_KWARGS:
        table = state.get(table_name)
        if not table:
            continue
        flags = state.get(flags_name) or {}
        copied = [key for key, hook in table.items()
                  if key not in flags and is_nanwidget_hook(hook)]
        for key in copied:
            del table[key]
            always = state.get("_forward_hooks_always_called")
            if isinstance(always, dict):
                always.pop(key, None)


def is_nanwidget_hook(hook: Any) -> bool:
    """Whether ``hook`` (a function, bound method, ``functools.partial`` or a wrapper made with
    ``functools.wraps``, e.g. ``torch._dynamo.disable``) is nanwidget's own."""
    for _ in range(8):  # partials of wrappers of methods: a few layers at most
        if isinstance(hook, functools.partial):
            hook = hook.func
            continue
        inner = getattr(hook, "__wrapped__", None)
        owner = getattr(hook, "__module__", None) or ""
        if owner == _PACKAGE or owner.startswith(_PACKAGE + "."):
            return True
        if inner is None:
            return False
        hook = inner
    return False


class _StateWithoutWatch:
    """A watched module's ``__getstate__``: its class's state, without nanwidget's hooks."""

    __slots__ = ("module", "__weakref__")

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)  # the module holds this object: no cycle through it

    def __call__(self) -> Any:
        module = self.module()
        if module is None:  # pragma: no cover - called through the module, so it is alive
            return {}
        for child in module.children():  # pickled after it: without copied hooks
            drop_copied_hooks(child)
        state = type(module).__getstate__(module)
        if isinstance(state, dict):
            return _without_watch(state, module)
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
            return (_without_watch(state[0], module), state[1])  # (__dict__, __slots__ state)
        return state


def _without_watch(state: dict, module: nn.Module) -> dict:
    """``state`` (``module``'s ``__dict__`` copy) without nanwidget's hook entries (and their
    flags in the ``*_with_kwargs`` / ``*_always_called`` tables) and without this mechanism."""
    state = dict(state)
    for key in _KEYS:
        if isinstance(state.get(key), _OURS):
            del state[key]
    forward = state.get("forward")
    if isinstance(forward, types.MethodType) and forward.__self__ is module \
            and forward.__func__ is getattr(type(module), "forward", None):
        # The class's own forward, bound: the same without it (core.graph_capture sets it on a
        # watched torch.nn container).
        del state["forward"]
        forward = None
    if forward is not None and is_nanwidget_hook(forward):  # core.fastpath's, while watched
        previous = getattr(forward, "previous", None)
        if previous is None:
            del state["forward"]
        else:
            state["forward"] = previous
    tables = [name for name, value in state.items() if "hooks" in name and isinstance(value, dict)]
    ours = {key for name in tables for key, hook in state[name].items()
            if callable(hook) and is_nanwidget_hook(hook)}
    if ours:
        for name in tables:
            table = state[name]
            if any(key in ours for key in table):
                cleaned = table.copy()
                for key in ours:
                    cleaned.pop(key, None)
                state[name] = cleaned
    return state


class _DeepcopyWithoutWatch:
    """The ``__deepcopy__`` of a watched module whose class has one of its own (a
    parametrized module's class copies ``__dict__`` directly, never asking ``__getstate__``):
    the class's copy, made while nanwidget's objects copy as themselves (a hook that is a
    recorder's method is never copied into), then cleaned of them."""

    __slots__ = ("module", "__weakref__")

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)

    def __call__(self, memo: dict) -> Any:
        module = self.module()
        copied = memo.get(id(module))
        if copied is not None:
            return copied
        own = [value for name, value in module.__dict__.items()
               if name in _KEYS and isinstance(value, _OURS)]
        own += [hook for name, table in module.__dict__.items()
                if "hooks" in name and isinstance(table, dict)
                for hook in table.values() if callable(hook) and is_nanwidget_hook(hook)]
        for value in own:
            memo[id(value)] = value
        for child in module.children():
            drop_copied_hooks(child)
        replica = type(module).__deepcopy__(module, memo)
        state = getattr(replica, "__dict__", None)
        if isinstance(state, dict):
            cleaned = _without_watch(state, replica)
            state.clear()
            state.update(cleaned)
        return replica


class _ScriptableWithoutWatch:
    """A watched module's ``__prepare_scriptable__`` (what ``torch.jit.script`` asks for before
    it compiles a module and its hooks): the module's :func:`unwatched_twin`, prepared as its
    class prepares it."""

    __slots__ = ("module", "__weakref__")

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)

    def __call__(self) -> Any:
        module = self.module()
        if module is None:  # pragma: no cover - called through the module, so it is alive
            return None
        twin = unwatched_twin(module)
        own = getattr(type(twin), _SCRIPTABLE, None)
        return own(twin) if callable(own) else twin


def unwatched_twin(module: nn.Module, memo: dict[int, nn.Module] | None = None) -> nn.Module:
    """``module`` as it is without any watch: for it and every module under it a new object of
    its class whose ``__dict__`` is the module's less nanwidget's hooks, ``forward`` and copy
    hooks. Parameters, buffers and every other attribute are the module's own objects (no tensor
    is copied); the ``_parameters``, ``_buffers``, ``_modules`` and hook tables are new, so what
    is done to the twin's structure (``torch.jit.script`` writes the modules it prepares into it,
    a class's ``__prepare_scriptable__`` may remove a hook) leaves the module's alone. A module
    met twice in the tree is one twin."""
    memo = {} if memo is None else memo
    twin = memo.get(id(module))
    if twin is not None:
        return twin
    twin = object.__new__(type(module))
    memo[id(module)] = twin
    state = _without_watch(module.__dict__, module)
    for name, table in state.items():  # a class's __prepare_scriptable__ may edit them
        if isinstance(table, dict) and (name in ("_parameters", "_buffers") or "hooks" in name):
            state[name] = table.copy()
    children = state.get("_modules")
    if isinstance(children, dict):
        state["_modules"] = type(children)(
            (name, None if child is None else unwatched_twin(child, memo))
            for name, child in children.items())
    twin.__dict__.update(state)
    return twin


_DEEPCOPY = "__deepcopy__"
_SCRIPTABLE = "__prepare_scriptable__"
_KEYS = (_KEY, _DEEPCOPY, _SCRIPTABLE)
_OURS = (_StateWithoutWatch, _DeepcopyWithoutWatch, _ScriptableWithoutWatch)


def copy_without_watch(module: nn.Module) -> None:
    """From now on, copies, pickles and ``torch.jit.script`` of ``module`` leave nanwidget's hooks
    out (idempotent; a module with an instance-level ``__getstate__`` of its own keeps it)."""
    if _KEY not in module.__dict__:
        module.__dict__[_KEY] = _StateWithoutWatch(module)
    if getattr(type(module), _DEEPCOPY, None) is not None and _DEEPCOPY not in module.__dict__:
        module.__dict__[_DEEPCOPY] = _DeepcopyWithoutWatch(module)
    if _SCRIPTABLE not in module.__dict__:
        module.__dict__[_SCRIPTABLE] = _ScriptableWithoutWatch(module)


def stop_copying_without_watch(module: nn.Module) -> None:
    """Undo :func:`copy_without_watch` (the watch closed)."""
    for key in _KEYS:
        if isinstance(module.__dict__.get(key), _OURS):
            del module.__dict__[key]

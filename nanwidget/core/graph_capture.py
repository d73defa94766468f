"""Others that run a watched model to capture or compile it, as the recorder's hooks see them.

- Graph capturers (``torch.export``, strict or not; ``torch.jit.trace`` and the check run it
  makes; ``torch.fx.symbolic_trace``) run the model to record a graph of it: the watch stands
  aside (:func:`tracing`), so that none of its measuring lands in the graph and the capture is no
  batch. Every probe here is a flag read or a call or two, cheap enough for the root's hook.
- A data-less pass on meta tensors (Keras 3 builds a model so before ``fit()``): no data, no
  batch; the watch stands aside too (:func:`meta_only`).
- ``torch.compile`` wrappers (``OptimizedModule``) around a watched module: when the module is
  a ``torch.nn`` container (``nn.Sequential`` ...), Dynamo compiles its whole call, hooks
  included, and never guards on hooks; code it compiled before the watch keeps running without
  them. :func:`compile_wrappers_of` finds such wrappers, so that the recorder can refuse their
  calls as it refuses the other orders. Code compiled later, or for another container of the
  same class, may run the model too; the forward marks below make Dynamo compile that call
  afresh, meet the hooks, and the recorder refuses it then.
- A compiled *function* that calls a watched model (``@torch.compile def step(x): ...``): Dynamo
  traces the model's call where the function calls it, hooks included. The watch's hooks are
  marked (:func:`run_eagerly_under_dynamo`) so that Dynamo stops at each (a graph break) and
  runs it as plain Python, with nothing it calls compiled; ``torch.export`` still traces them
  (they return at once there).
- Code compiled *before* the watch, for any caller that inlined a watched module's call (a
  compiled function, a wrapper of a submodule, a re-run notebook cell): Dynamo guards on a
  module's class and its ``__dict__``, never on its hooks, so that code would keep running
  without them, the watch blind. While the watch lasts, each module it hooks for the whole
  watch has its class's ``forward``, bound to it, as an instance attribute
  (:func:`mark_forward_as_watched`): it runs exactly as before, no slower, but Dynamo's guard
  "no ``forward`` in this module's ``__dict__``" fails, so that Dynamo compiles the caller
  afresh and meets the hooks (code compiled during an earlier watch met that watch's hooks
  and broke its graph there: it runs whatever hooks the module has when it runs).
"""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from .walk import tensor_leaves

__all__ = ["tracing", "captured", "meta_only", "is_exporting", "dynamo_compiling", "export_flag",
           "fx_tracing", "checking_a_trace", "compile_wrappers_of", "compiled_module_of",
           "mark_forward_as_watched", "unmark_forward", "run_eagerly_under_dynamo",
           "never_compiled"]

#: ``torch.compiler.is_exporting()``: True while ``torch.export`` traces, under Dynamo too.
is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)
#: True while Dynamo traces the code that asks (a strict export, ``torch.compile``).
dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", lambda: False)
#: Holds ``_is_exporting_flag`` (what :data:`is_exporting` returns), read as an attribute where
#: a function call would cost too much (every module call).
export_flag: Any = torch.compiler if hasattr(torch.compiler, "_is_exporting_flag") else \
    types.SimpleNamespace(_is_exporting_flag=False)
_jit_tracing_state = getattr(torch._C, "_get_tracing_state", lambda: None)


def _fx_flag_reader() -> Callable[[], bool]:
    """The cheapest read of "``torch.fx.symbolic_trace`` runs now" this torch offers: a module
    flag up to torch 2.14, a thread-local one from 2.15 on (read through the public function
    where neither is there; "never" where fx is missing)."""
    fx = sys.modules.get("torch.fx._symbolic_trace")
    if fx is None:
        return lambda: False
    # Each a C call, no Python frame: the root's pre-hook asks on every batch.
    if hasattr(fx, "_is_fx_tracing_flag"):
        return partial(getattr, fx, "_is_fx_tracing_flag", False)
    local = getattr(fx, "_is_fx_tracing_tls", None)
    if local is not None:
        return partial(getattr, local, "flag", False)
    return getattr(fx, "_get_is_fx_tracing", None) or (lambda: False)


#: True while ``torch.fx.symbolic_trace`` (or an export through fx) runs, as torch says it.
fx_tracing = _fx_flag_reader()
# The module whose state says that torch.jit.trace runs (it comes with torch; the stand-in says
# "never" for a torch that moved it).
_jit: Any = sys.modules.get("torch.jit._trace") or types.SimpleNamespace(_trace_module_map=None)


def tracing() -> bool:
    """Whether a graph capturer runs the model now (``torch.export``, ``torch.jit.trace``,
    ``torch.fx.symbolic_trace``). ``is_exporting`` comes first: under a strict export Dynamo
    traces the caller, reads it as a constant and never looks at the rest. Never raises (a
    torch that moved what it reads must not break the user's forward: then "no")."""
    try:
        return is_exporting() or _jit_tracing_state() is not None \
            or (fx_tracing() and not dynamo_compiling())
    except Exception:
        return False


def captured() -> bool:
    """For the root's pre-hook (called from it), once :data:`export_flag` said no: whether
    ``torch.jit.trace`` (its check run included, see :func:`checking_a_trace`) or ``torch.fx``
    runs the model. A few flag reads: it runs every batch. Never raises (see :func:`tracing`)."""
    try:
        return _jit_tracing_state() is not None \
            or (_jit._trace_module_map is not None and checking_a_trace(sys._getframe(2))) \
            or (fx_tracing() and not dynamo_compiling())
    except Exception:
        return False


def meta_only(args: tuple, kwargs: dict) -> bool:
    """Whether a root call's tensor inputs are all on the meta device: a data-less pass that
    only builds the model or checks shapes (Keras 3 runs one before ``fit()``), no batch. For
    the root's pre-hook, every batch: ``model(x)`` reads one flag, and elsewhere the first
    tensor found on a device ends the look. Never raises (then "no")."""
    try:
        first = args[0] if len(args) == 1 and not kwargs else None
        if type(first) is torch.Tensor:  # model(x): the usual call
            return first.is_meta
        first = _first_tensor(args, kwargs)
        if first is None or not _on_meta(first):
            return False
        return all(_on_meta(tensor) for _, tensor in tensor_leaves((args, kwargs), "input"))
    except Exception:
        return False


def _on_meta(tensor: torch.Tensor) -> bool:
    if type(tensor) in (torch.Tensor, nn.Parameter):
        return tensor.is_meta
    with torch._C.DisableTorchFunctionSubclass():  # runs no tensor subclass's own code
        return tensor.is_meta


_LOOKED_INTO = 64  # containers looked into for a call's first tensor, at most


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A tensor among the arguments, in lists, tuples and dicts (not in other objects); None
    when there is none there."""
    pending: list[Any] = [kwargs.values(), args]
    looked = 0
    while pending and looked < _LOOKED_INTO:
        looked += 1
        for value in pending.pop():
            if isinstance(value, torch.Tensor):
                return value
            if isinstance(value, (list, tuple)):
                pending.append(value)
            elif isinstance(value, dict):
                pending.append(value.values())
    return None


_trace_check: list[Any] = []  # the code object of torch.jit.trace's check run, once looked up


def checking_a_trace(caller: Any) -> bool:
    """Whether ``torch.jit.trace`` (``check_trace=True``) runs the model eagerly to compare it
    with the trace it just made: part of tracing, not a batch. ``caller``: the frame that
    called the root module's hooks."""
    if _jit._trace_module_map is None:
        return False  # set while torch.jit.trace runs, its check included
    if not _trace_check:
        check = getattr(_jit, "_check_trace", None)
        check = getattr(check, "__wrapped__", check)  # under torch.no_grad()'s decorator
        constants = getattr(getattr(check, "__code__", None), "co_consts", ())
        _trace_check.append(next((c for c in constants if getattr(c, "co_name", "") ==
                                  "run_mod_and_filter_tensor_outputs"), None))
    code = _trace_check[0]
    frame = caller
    for _ in range(4):  # the hooks' caller, Module.__call__, then the check's own function
        if frame is None or code is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _inlined_with_its_hooks(model: nn.Module) -> bool:
    """Whether a ``torch.compile`` wrapper of ``model`` compiles the model's whole call, hooks
    included (a ``torch.nn`` container; else only its forward compiles and the hooks run
    eagerly), and compiled code of that kind exists in this process."""
    try:
        from torch._dynamo import config, eval_frame, external_utils, trace_rules
    except ImportError:  # pragma: no cover - a torch without Dynamo
        return False
    if getattr(config, "wrap_top_frame", False):
        return True
    forward = getattr(model, "forward", None)
    try:
        if not (isinstance(forward, types.MethodType) and trace_rules.check(forward)):
            return False
        # Such calls compile one shared code object: without cache entries, nothing is
        # compiled yet (the first compiled call will trace the hooks, and be refused then).
        shared = external_utils.wrap_inline(_nothing).__code__
        return bool(eval_frame._debug_get_cache_entry_list(shared))
    except Exception:  # Dynamo's internals moved: look for wrappers anyway
        return True


def _nothing() -> None:
    return None


def compiled_module_of(candidate: Any) -> nn.Module | None:
    """The module that ``candidate``, a ``torch.compile`` wrapper (``OptimizedModule``),
    compiles; None for anything else. Read without importing Dynamo."""
    if not (isinstance(candidate, nn.Module) and type(candidate).__name__ == "OptimizedModule"):
        return None
    wrapped = candidate.__dict__.get("_modules", {}).get("_orig_mod")
    return wrapped if isinstance(wrapped, nn.Module) else None


def _is_wrapper_of(candidate: Any, model: nn.Module) -> bool:
    return compiled_module_of(candidate) is model


def compile_wrappers_of(model: nn.Module) -> list[nn.Module]:
    """The live ``torch.compile`` wrappers of ``model`` whose compiled code may run it without
    its hooks (see the module docstring); empty at no cost when Dynamo was never loaded or no
    such code exists. Otherwise searches the heap (a wrapper holds the model in its
    ``_modules``, and nothing leads from the model to it): tens of milliseconds, at watch time."""
    if "torch._dynamo" not in sys.modules or not _inlined_with_its_hooks(model):
        return []
    found: dict[int, nn.Module] = {}
    for holder in gc.get_referrers(model):
        if not isinstance(holder, dict) or holder.get("_orig_mod") is not model:
            continue
        for owner in gc.get_referrers(holder):
            if isinstance(owner, dict):  # the wrapper's __dict__, when Python made one
                owners = [o for o in gc.get_referrers(owner) if getattr(o, "__dict__", None)
                          is owner]
            else:
                owners = [owner]
            for wrapper in owners:
                if _is_wrapper_of(wrapper, model):
                    found[id(wrapper)] = wrapper
    return list(found.values())


def _own_forward(module: nn.Module) -> types.FunctionType | None:
    """The plain function ``module``'s class defines as its forward (looked up without running
    descriptors), or None: no forward of its own (a holder: ``nn.Module.forward``), one that is
    no plain function (a staticmethod, a callable object), or a TorchScript module's."""
    if isinstance(module, torch.jit.ScriptModule):
        return None
    for klass in type(module).__mro__:
        forward = vars(klass).get("forward")
        if forward is not None:
            if type(forward) is not types.FunctionType or forward is nn.Module.forward:
                return None
            return forward
    return None


def mark_forward_as_watched(module: nn.Module) -> types.MethodType | None:
    """Give ``module``, when it has no instance-level forward of its own, its class's forward,
    bound to it, as an instance attribute (see the module docstring): it runs as before (a
    bound method either way; read from the instance it is not even bound anew at each call),
    and code Dynamo compiled while its ``__dict__`` had no ``forward``, or had another watch's,
    is not run for it. What to give :func:`unmark_forward`; None: left as it was (a module
    compiled in place keeps its compiled code: the watch promises no recompile there)."""
    if "forward" in vars(module) or getattr(module, "_compiled_call_impl", None) is not None:
        return None
    forward = _own_forward(module)
    if forward is None:
        return None
    marked = module.__dict__["forward"] = types.MethodType(forward, module)
    return marked


def unmark_forward(model: nn.Module, marked: types.MethodType) -> None:
    """Undo :func:`mark_forward_as_watched` (a forward set since, someone else's, stays)."""
    if model.__dict__.get("forward") is marked:
        del model.__dict__["forward"]


class _UnlessExporting:
    """What Dynamo reads as a hook's ``_torchdynamo_disable`` (``torch.compiler.disable``'s
    mark) when it is about to trace into it: "do not", except while ``torch.export`` traces
    (a strict export must not break its graph: there the hooks are traced and return at once)."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return not is_exporting()

    def __repr__(self) -> str:
        return "True (unless torch.export traces)"


_NOT_TRACED = _UnlessExporting()
_WHY_NOT_TRACED = "nanwidget's hooks run eagerly, outside compiled code"


def _code_skipper() -> Callable[[types.CodeType], None]:
    """A function that makes Dynamo's frame callback run a code object's frames as plain
    Python, and every frame they call too (as ``torch._dynamo.disable`` does, but kept on the
    code object: nothing runs per call). From the C extension: Dynamo itself is not imported.
    A no-op on a torch without it."""
    try:
        from torch._C._dynamo import eval_frame as c_eval_frame
        action = c_eval_frame._FrameAction
        skip_all = c_eval_frame._FrameExecStrategy(action.SKIP, action.SKIP)
        set_strategy = c_eval_frame.set_code_exec_strategy
    except (ImportError, AttributeError, TypeError):
        return lambda code: None
    return partial(_set_strategy, set_strategy, skip_all)


def _set_strategy(set_strategy: Callable[..., None], strategy: Any,
                  code: types.CodeType) -> None:
    try:
        set_strategy(code, strategy)
    except Exception:  # Dynamo's internals moved: compiled callers trace the hook, as before
        return None


_skip_code = _code_skipper()


def _function_of(hook: Any) -> Any:
    """The plain function a hook runs (a bound method's, a ``functools.partial``'s)."""
    while True:
        inner = getattr(hook, "__func__", None) or getattr(hook, "func", None)
        if inner is None or inner is hook:
            return hook
        hook = inner


def never_compiled(function: Any) -> Any:
    """Mark ``function`` (a hook: a function, bound method or partial) so that when Dynamo's
    frame callback meets its frame (compiled code called it after a graph break), the frame
    and everything it calls run as plain Python, never compiled. Costs nothing per call.
    Returns ``function``."""
    code = getattr(_function_of(function), "__code__", None)
    if isinstance(code, types.CodeType):
        _skip_code(code)
    return function


def run_eagerly_under_dynamo(function: Any) -> Any:
    """Mark the hook ``function`` so that Dynamo, compiling a caller of the watched model (a
    compiled train step), never traces it: a graph break at its call, the hook runs as plain
    Python (:func:`never_compiled`), exactly as in an eager call. Unlike wrapping it in
    ``torch._dynamo.disable``, no call pays for it, and Dynamo is not imported. Under
    ``torch.export`` the hook is traced as before. Returns ``function``."""
    target = _function_of(function)
    try:
        target._torchdynamo_disable = _NOT_TRACED
        target._torchdynamo_disable_msg = _WHY_NOT_TRACED
    except (AttributeError, TypeError):  # a builtin: Dynamo does not trace into it anyway
        pass
    return never_compiled(function)

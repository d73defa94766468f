"""Where in the user's code something happened: the innermost line outside torch, the standard
library, IPython, frameworks' op layers over torch (Keras' backend) and nanwidget itself.

Used by the trace-mode replay (the line that called each op) and by the notebook layer (the
line a NaN/Inf was raised from), so both name the same place the same way.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
from types import FrameType, TracebackType

import torch

__all__ = ["user_source", "python_backward_source", "traceback_source", "format_source", "locate_source", "source_text",
           "user_stacklevel"]

_USER, _SKIP, _STOP = 0, 1, 2


def _directory(path: str) -> str:
    return os.path.normcase(os.path.abspath(path)) + os.sep


_TORCH_DIR = _directory(os.path.dirname(torch.__file__))
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nanwidget/
_CORE_DIR = _directory(os.path.dirname(__file__))  # nanwidget/core/
# nanwidget's own layers that call the model for the user (examples and the demo's model are
# user code as far as a report is concerned).
_LIBRARY_PATHS = tuple(os.path.normcase(os.path.join(_PACKAGE, part)) for part in (
    "magics" + os.sep, "widgets" + os.sep, "plots" + os.sep, "integrations" + os.sep,
    "training.py"))
_STDLIB_DIRS = tuple({_directory(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib")})
_TOOL_PARTS = (os.sep + "IPython" + os.sep, os.sep + "ipykernel" + os.sep,
               os.sep + "ipykernel_launcher")
# Frameworks' op layers that only pass each op on to torch: every op of every model runs
# through the same few lines there, so they say nothing about where a value was made; the
# caller's line does (the user's, or a model-definition file: keras/src/layers/...,
# transformers' modeling_*.py, which stay sources).
# PyTorch Geometric's are its functional ops (scatter, softmax, degree), its aggregation
# modules, MessagePassing's plumbing (and the decorator around it), the global pools and its
# Linear (F.linear, as torch.nn.Linear): every conv's scatter runs through the same line of
# utils/_scatter.py; the conv's ``self.propagate(...)`` line or the model's
# ``global_add_pool(...)`` line says where.
# Opacus' GradSampleModule only calls the model it wraps (``return self._module(...)``): every
# op of a wrapped nn.Sequential was said to be made at that line of Opacus. accelerate's hooks
# (cpu_offload, disk_offload, device_map's offloading) replace each module's forward with one
# that loads its weights and calls the old forward (``module._old_forward(...)``): every op of an
# offloaded Linear was said to be made at that line of accelerate's hooks.py.
_SHIM_DIRS = (("keras", "src", "backend"), ("keras", "src", "ops"), ("torch_geometric", "utils"),
              ("torch_geometric", "nn", "aggr"), ("opacus", "grad_sample"))
_SHIM_FILES = (("torch_geometric", "nn", "conv", "message_passing.py"),
               ("torch_geometric", "nn", "pool", "glob.py"),
               ("torch_geometric", "nn", "dense", "linear.py"),
               ("torch_geometric", "experimental.py"), ("accelerate", "hooks.py"))
_SHIM_PARTS = tuple(os.sep + os.sep.join(parts) + os.sep for parts in _SHIM_DIRS) \
    + tuple(os.sep + os.sep.join(parts) for parts in _SHIM_FILES)
# The ``propagate`` / ``edge_updater`` that PyTorch Geometric renders from a template for each
# MessagePassing class and imports from a temporary file (``<tmp>/<module>_<Class>_propagate_
# <random>.py``): the same plumbing, in a file the user never wrote.
_GENERATED_PLUMBING = re.compile(r"_(?:propagate|edge_updater)_[a-z0-9_]{8}\.py$")
_KINDS: dict[str, int] = {}


def _file_kind(filename: str) -> int:
    """_USER, _SKIP (library code) or _STOP (nanwidget's engine: what called it is not the
    model, e.g. the replay running the model for the user's ``replay()`` call)."""
    kind = _KINDS.get(filename)
    if kind is not None:
        return kind
    if filename.startswith("<"):
        kind = _SKIP if filename.startswith("<frozen") else _USER
    else:
        path = os.path.normcase(os.path.abspath(filename))
        if path.startswith(_CORE_DIR):
            kind = _STOP
        elif path.startswith((_TORCH_DIR,) + _LIBRARY_PATHS) \
                or any(p in path for p in _TOOL_PARTS + _SHIM_PARTS) \
                or _GENERATED_PLUMBING.search(os.path.basename(path)) is not None:
            kind = _SKIP
        elif path.startswith(_STDLIB_DIRS) and "site-packages" not in path \
                and "dist-packages" not in path:
            kind = _SKIP
        else:
            kind = _USER
    _KINDS[filename] = kind
    return kind


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_PATH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def user_stacklevel() -> int:
    """The ``stacklevel`` for a warning issued by the caller (from a hook, at a batch's end)
    that points at the first frame outside nanwidget, torch and installed packages (the
    user's forward call or ``trainer.train()`` line); else the first outside nanwidget and
    torch."""
    frame, level = sys._getframe(1), 1
    outside_torch = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_PACKAGE_DIR, _TORCH_PATH)):
            if outside_torch is None:
                outside_torch = level
            if not any(part in path for part in _INSTALLED):
                return level
        frame, level = frame.f_back, level + 1
    return outside_torch or 1


_IPYTHON_INPUT = re.compile(r"^<ipython-input-(\d+)-[0-9a-f]+>$")  # terminal IPython's cell names
# "cell In[5], line 12" -> the file and line it names (a cell's file name is a temporary path or
# a "<ipython-input-...>" key of the line cache, not something the text can carry).
_CELL_LOCATIONS: dict[str, tuple[str, int]] = {}


def _cell_number(filename: str) -> int | None:
    """The execution count of the IPython/Jupyter cell compiled under ``filename``, if it is one.

    Read from the running shell's compiler when IPython is loaded (it is never imported from
    here): ipykernel names cells ``/tmp/ipykernel_<pid>/<hash>.py``, terminal IPython
    ``<ipython-input-5-...>``; only the shell knows which number each file got.
    """
    ipython = sys.modules.get("IPython")
    get_shell = getattr(ipython, "get_ipython", None) if ipython is not None else None
    shell = get_shell() if get_shell is not None else None
    numbers = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if isinstance(numbers, dict):
        number = numbers.get(filename)
        if isinstance(number, int):
            return number
    match = _IPYTHON_INPUT.match(filename)
    return int(match.group(1)) if match else None


def format_source(filename: str, line: int) -> str:
    """A source location as the contract shows it: ``file:line``, or for a notebook cell
    ``cell In[5], line 12`` (as IPython's own tracebacks name it)."""
    number = _cell_number(filename)
    if number is None:
        return f"{filename}:{line}"
    text = f"cell In[{number}], line {line}"
    _CELL_LOCATIONS[text] = (filename, line)
    return text


def locate_source(source: str) -> tuple[str, int] | None:
    """The ``(filename, line)`` a :func:`format_source` text names (for the line cache), or
    None when it names nothing readable."""
    found = _CELL_LOCATIONS.get(source)
    if found is not None:
        return found
    filename, _, line = source.rpartition(":")
    return (filename, int(line)) if filename and line.isdigit() else None


def source_text(source: str) -> tuple[int, str] | None:
    """The line number and the text (stripped) of the line a :func:`format_source` text names,
    from the line cache; None when it names nothing readable."""
    located = locate_source(source) if source else None
    if located is None:
        return None
    return located[1], linecache.getline(*located).strip()


def user_source(frame: FrameType | None) -> str:
    """Innermost user ``file:line`` from ``frame`` outwards; "" when nanwidget's engine (or
    nothing) is reached first."""
    while frame is not None:
        filename = frame.f_code.co_filename
        kind = _file_kind(filename)
        if kind == _USER:
            return format_source(filename, frame.f_lineno)
        if kind == _STOP:
            return ""
        frame = frame.f_back
    return ""


def python_backward_source(frame: FrameType | None) -> str:
    """The user ``file:line`` of an op run within a backward pass when user Python issued it
    (a custom Function's ``backward``, a hook); "" when autograd's engine did, whose innermost
    user frame is only the line that called ``backward()`` or ``torch.autograd.grad()``."""
    while frame is not None:
        code = frame.f_code
        kind = _file_kind(code.co_filename)
        if kind == _USER:
            return format_source(code.co_filename, frame.f_lineno)
        if kind == _STOP or code.co_name in _ENGINE_ENTRIES:
            return ""
        frame = frame.f_back
    return ""


# torch.autograd's Python entry into the engine (torch.autograd.graph).
_ENGINE_ENTRIES = frozenset({"_engine_run_backward"})


def traceback_source(tb: TracebackType | None) -> tuple[str, int] | None:
    """``(filename, line)`` of the innermost user frame of a traceback (nanwidget's own frames
    skipped), or None."""
    found = None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if _file_kind(filename) == _USER:
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    return found

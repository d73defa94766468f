"""The optional native kernel for CPU tensors: exact abs min/max in one read, no temporary.

torch has no single op for min and max of |x|: the portable path (:class:`~nanwidget.core.stats.AbsMeter`)
writes |x| into a buffer and reduces it, two kernels and a write pass per tensor plus the
dispatch cost of each op. ``_native/absrange.c`` reads the tensor once (4-8x faster here). Its
real gain is *when* it runs: in the module's hook, while the tensor is still in cache, so the
watch holds no activations until the batch ends (holding them made every later allocation of
the forward land on fresh, page-faulting memory). On CPU there is no device to synchronise
with, so measuring at once costs no sync.

The C file is compiled on first use with the system C compiler (``$CC``, Python's own
compiler, ``cc``, ``gcc`` or ``clang``) into a per-user cache (``$NANWIDGET_CACHE_DIR`` or
``~/.cache/nanwidget``); later processes load the cached library in about a millisecond. Where
Python's headers are installed it is built as a Python extension (``_native/entry.c``): the
hooks' readers (:func:`contiguous_reader`, :func:`int_reader`, :func:`gradient_reader`) then
check and read a tensor in
one C call, about 1.3 µs less per tensor than through :mod:`ctypes`, which loads the same
kernels otherwise (and always for the other functions here). Without a compiler, or with ``NANWIDGET_NATIVE=0``, everything takes
the torch path: same numbers, only slower. A self-test against the torch path runs at load;
a library that disagrees is not used. :func:`status` says which path is active and why.

Only dense CPU tensors of float16/bfloat16/float32/float64 of at most ``MAX_ELEMENTS``
elements (and, for their signed range, contiguous int32/int64 ones: :func:`int_range`),
exactly ``torch.Tensor`` or ``nn.Parameter`` (no subclasses that could hide their storage),
are handed to the kernel; the caller keeps them alive during the call.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["abs_range", "finite_range", "available", "eligible", "result_buffer", "status",
           "MAX_ELEMENTS", "contiguous_range", "int_range", "contiguous_reader", "int_reader",
           "gradient_range", "gradient_reader",
           "storage_holds", "weight_state_reader", "grads_clean", "grads_clean_reader"]

_SOURCE = Path(__file__).with_name("_native") / "absrange.c"
_ENTRY_SOURCE = _SOURCE.with_name("entry.c")  # absrange.c as a Python extension
_ENTRY_MODULE = "_nanwidget_entry"
_ABI_VERSION = 6

# The kernel runs on one thread. Up to 4M elements it beats torch's path on any thread count
# we could measure; above that, torch's path (|x| and min/max on all of torch's threads) wins
# once it has more than 2 threads, and above MAX_ELEMENTS it always takes over.
MAX_ELEMENTS = 1 << 24
_ONE_THREAD_ELEMENTS = 1 << 22

_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_INT_KINDS = {torch.int32: 0, torch.int64: 1}
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_Triple = ctypes.c_double * 3
_INF = float("inf")


class _Pair(ctypes.c_double * 2):  # type: ignore[misc]
    """Two doubles the kernel writes, with their address at hand: handing the kernel a plain
    integer spares ctypes a conversion on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.address = ctypes.addressof(self)


_lock = threading.Lock()
_kernel: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
_finite_kernel: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
_int_kernel: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
# The extension's readers (contiguous_range and int_range in one C call, weight_state and
# grads_clean), where it was built.
_entry_readers: tuple[Callable[..., Any], ...] | None = None
_state = "not loaded"  # why the kernel is or is not in use, for status()


def status() -> str:
    """One line: whether the native kernel is in use, and where from or why not."""
    _load()
    return _state


def available() -> bool:
    """True when the native kernel is loaded and passed its self-test (loads it on first call)."""
    return _load() is not None


def eligible(tensor: torch.Tensor, check_storage: bool = True) -> bool:
    """Whether :func:`abs_range` may read ``tensor``: a dense CPU float tensor, no subclass,
    with its storage allocated. ``check_storage=False``: its storage is not asked whether it
    holds every element (a gradient autograd passes on: see :func:`gradient_range`)."""
    if type(tensor) not in _PLAIN_TYPES or not tensor.is_cpu or tensor.dtype not in _KINDS:
        return False
    count = tensor.numel()
    if count == 0 or count > MAX_ELEMENTS:
        return False
    if count > _ONE_THREAD_ELEMENTS and torch.get_num_threads() > 2:
        return False
    if not tensor.is_contiguous() and not _is_dense(tensor.shape, tensor.stride()):
        return False
    # 0: storage freed (FSDP between forwards), nothing to read. A dense tensor spans `count`
    # elements from its offset, in any order.
    return tensor.data_ptr() != 0 and (not check_storage or storage_holds(tensor, count))


def storage_holds(tensor: torch.Tensor, span: int | None = None) -> bool:
    """False when the tensor's storage is smaller than what the tensor spans (FSDP frees
    parameter storage between forwards; ``untyped_storage().resize_()`` shrinks it): reading it,
    even with torch's own ops, would crash the process. ``span``: the elements it spans from its
    offset, where the caller knows it (a dense tensor: its numel).

    Asking leaves torch's Python storage object on the tensor's storage for as long as it
    lives, where it counts as one more owner: autograd then sums a gradient's next
    contribution out of place (see :func:`gradient_range`)."""
    try:
        if span is None:
            span = tensor.numel() if tensor.is_contiguous() else 1 + sum(
                (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        needed = (tensor.storage_offset() + span) * tensor.element_size()
        return tensor.untyped_storage().nbytes() >= needed
    except Exception:  # no storage to look at (a wrapper subclass): its own ops decide
        return True


def _is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True when the elements fill one gap-free span (any dimension order, no overlap): then
    the span starting at ``data_ptr()`` holds exactly the tensor's elements."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(strides, shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def abs_range(tensor: torch.Tensor, out: ctypes.Array | None = None) -> tuple[float, float]:
    """(abs_min, abs_max) of an :func:`eligible` tensor, read once on the calling thread.

    A NaN anywhere makes abs_max NaN (abs_min is then the smallest non-NaN magnitude).
    ``out``: a :func:`result_buffer` the caller reuses (one per thread), saving an allocation
    per call. Raises RuntimeError when the kernel is not available.
    """
    kernel = _kernel if _kernel is not None else _load()
    if kernel is None:
        raise RuntimeError(f"the native kernel is not available: {_state}")
    if out is None:
        out = _Pair()
    kernel(tensor.data_ptr(), tensor.numel(), _KINDS[tensor.dtype], getattr(out, "address", out))
    return out[0], out[1]


def contiguous_range(tensor: torch.Tensor, out: ctypes.Array) -> tuple[float, float] | None:
    """:func:`abs_range` of a contiguous dense CPU float tensor (no subclass, at most
    ``2**22`` elements), eligibility and read in one call (every module call); None when the
    kernel is not loaded yet or the tensor is not such a tensor: :func:`eligible` and
    :func:`abs_range` then have the full rules. ``out``: a :func:`result_buffer`."""
    return _read_contiguous(_kernel, _KINDS, tensor, out)


def gradient_range(tensor: torch.Tensor, out: ctypes.Array) -> tuple[float, float] | None:
    """:func:`contiguous_range` of a gradient handed to a tensor hook: the same, without asking
    its storage whether it holds every element (autograd reads the gradient right after the
    hook anyway). Asking would leave a Python storage object on it, which counts as one more
    owner: autograd then sums the tensor's next gradient out of place, into new memory of
    another layout, and the ops after it (BatchNorm's backward) add in another order, so the
    watched run's gradients would differ in their last bits."""
    return _read_contiguous(_kernel, _KINDS, tensor, out, check_storage=False)


def gradient_reader() -> Callable[[torch.Tensor, ctypes.Array], tuple[float, float] | None]:
    """:func:`gradient_range`, in one C call where the kernel was built as a Python extension
    (see :func:`contiguous_reader`)."""
    _load()
    return _entry_readers[4] if _entry_readers is not None else gradient_range


def contiguous_reader() -> Callable[[torch.Tensor, ctypes.Array], tuple[float, float] | None]:
    """:func:`contiguous_range`, or the same check and read in one C call where the kernel was
    built as a Python extension: for hot paths, which take it once (loads the kernel)."""
    _load()
    return _entry_readers[0] if _entry_readers is not None else contiguous_range


def int_reader() -> Callable[[torch.Tensor, ctypes.Array], tuple[float, float] | None]:
    """:func:`int_range`, or the same in one C call (see :func:`contiguous_reader`)."""
    _load()
    return _entry_readers[1] if _entry_readers is not None else int_range


def weight_state_reader() -> Callable[[list, list, list], tuple[list, list, list, list] | None] | None:
    """Where the kernel was built as a Python extension, its ``weight_state(containers, keys,
    modules)``: in one C call, the tensors ``containers[i][keys[i]]``, their version counters,
    their ``(data_ptr(), dtype)`` layouts and the modules' ``training`` flags, as four lists;
    None (nothing read) when a container is not exactly a dict, a slot is missing or not exactly
    a Tensor or Parameter, or an attribute raises: the caller's Python path then reads them (and
    raises) as it always does. None without the extension (loads the kernel)."""
    _load()
    return _entry_readers[2] if _entry_readers is not None else None


def grads_clean_reader() -> Callable[[list, list, list], bool | None] | None:
    """Where the kernel was built as a Python extension, its ``grads_clean(containers, keys,
    indices)``: :func:`grads_clean` of the parameters ``containers[i].get(keys[i])`` with the
    extension's reader, in one C call (the sentinel's gradient check, every backward pass). It
    returns None (nothing read) when an argument is not exactly a list, the lists' lengths
    differ, an index is not a plain int within them or a container it names is not exactly a
    dict, for the caller's Python path to decide. None without the extension (loads the
    kernel)."""
    _load()
    return _entry_readers[3] if _entry_readers is not None else None


def grads_clean(slots: list, indices: list, read: Callable[..., Any], out: ctypes.Array) -> bool:
    """Whether the ``.grad`` of every ``slots[i]`` (``i`` in ``indices``; None slots and None
    gradients skipped) is read by ``read`` (:func:`contiguous_reader`'s) and finite: False at
    the first one it does not take (None) or whose abs max is not below +inf."""
    for i in indices:
        param = slots[i]
        grad = param.grad if param is not None else None
        if grad is None:
            continue
        found = read(grad, out)
        if found is None or not found[1] < _INF:
            return False
    return True


def int_range(tensor: torch.Tensor, out: ctypes.Array) -> tuple[float, float] | None:
    """(min, max) of a contiguous CPU int32 or int64 tensor (no subclass, at most ``2**22``
    elements), signed and as floats (rounded to nearest, as torch converts them), read once;
    None when the kernel is not loaded or the tensor is not such a tensor (torch then
    reduces it). ``out``: a :func:`result_buffer`."""
    return _read_contiguous(_int_kernel, _INT_KINDS, tensor, out)


def _read_contiguous(kernel: Any, kinds: dict[torch.dtype, int], tensor: torch.Tensor,
                     out: ctypes.Array, check_storage: bool = True) -> tuple[float, float] | None:
    """``kernel``'s two results for a contiguous plain CPU tensor of a dtype in ``kinds`` (at
    most ``2**22`` elements, storage allocated, and with ``check_storage`` holding every
    element), or None for any other tensor."""
    if kernel is None or type(tensor) not in _PLAIN_TYPES or not tensor.is_cpu:
        return None
    kind = kinds.get(tensor.dtype)
    count = tensor.numel()
    if kind is None or not 0 < count <= _ONE_THREAD_ELEMENTS or not tensor.is_contiguous():
        return None
    pointer = tensor.data_ptr()
    if not pointer or check_storage and not storage_holds(tensor, count):
        return None
    kernel(pointer, count, kind, out.address)
    return out[0], out[1]


def finite_range(tensor: torch.Tensor) -> tuple[float, float, bool]:
    """(finite abs min, finite abs max, holds an Inf) of an :func:`eligible` tensor, read once:
    the second look at a tensor holding a NaN or an Inf (inf and -inf bounds when no value is
    finite). Raises RuntimeError when the kernel is not available."""
    if _load() is None or _finite_kernel is None:
        raise RuntimeError(f"the native kernel is not available: {_state}")
    out = _Triple()
    _finite_kernel(tensor.data_ptr(), tensor.numel(), _KINDS[tensor.dtype], out)
    return out[0], out[1], out[2] > 0


def result_buffer() -> ctypes.Array:
    """A buffer for :func:`abs_range`'s ``out``; not to be shared between threads."""
    return _Pair()


# ------------------------------------------------------------------------------- building
def _load() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _kernel, _finite_kernel, _int_kernel, _entry_readers, _state
    if _state != "not loaded":
        return _kernel
    with _lock:
        if _state != "not loaded":
            return _kernel
        if os.environ.get("NANWIDGET_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
            _state = "off (NANWIDGET_NATIVE=0): torch path"
            return None
        try:
            library, not_extension = _build_or_find()
            kernel, finite_kernel, int_kernel = _bind(library)
            problem = _self_test(kernel) or _self_test_finite(finite_kernel) \
                or _self_test_int(int_kernel)
        except _Unavailable as reason:
            _state = f"unavailable ({reason}): torch path"
            return None
        except Exception as error:  # a broken toolchain must never break recording
            _state = f"unavailable ({type(error).__name__}: {error}): torch path"
            return None
        if problem:
            _state = f"disabled, self-test failed ({problem}): torch path"
            return None
        readers = None
        if not not_extension:
            try:
                readers = _import_entry(library)
                not_extension = _self_test_entry(readers, kernel, int_kernel)
            except Exception as error:  # e.g. a library built for another Python
                not_extension = f"{type(error).__name__}: {error}"
            if not_extension:
                readers = None
                not_extension = f"its Python entry points are not used: {not_extension}"
        _kernel, _finite_kernel, _int_kernel = kernel, finite_kernel, int_kernel
        _entry_readers = readers
        how = "read in one C call" if readers is not None else f"called through ctypes ({not_extension})"
        _state = f"native kernel in use ({library}): {how}"
        return _kernel


def _import_entry(library: Path) -> tuple[Callable[..., Any], ...]:
    """The readers of the library built from entry.c, imported as a Python extension."""
    loader = importlib.machinery.ExtensionFileLoader(_ENTRY_MODULE, str(library))
    spec = importlib.util.spec_from_loader(_ENTRY_MODULE, loader)
    if spec is None:
        raise _Unavailable(f"cannot import {library.name}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    module.setup(torch.Tensor, torch.nn.Parameter, _KINDS, _INT_KINDS, _ONE_THREAD_ELEMENTS)
    return (module.contiguous_range, module.int_range, module.weight_state, module.grads_clean,
            module.gradient_range)


class _Subclass(torch.Tensor):
    """A tensor subclass: the readers must decline it, as contiguous_range does."""


def _self_test_entry(readers: tuple[Callable[..., Any], ...],
                     kernel: ctypes._CFuncPtr, int_kernel: ctypes._CFuncPtr) -> str:  # type: ignore[name-defined]
    """Compare the extension's readers with the ctypes path on tensors they must read and on
    tensors they must decline, its weight_state with the Python reads and its grads_clean with
    :func:`grads_clean`; "" when they agree."""
    generator = torch.Generator().manual_seed(0)
    floats = [torch.randn(33, generator=generator, dtype=torch.float64).to(dtype) for dtype in _KINDS]
    ints = [torch.randint(-1000, 1000, (7,), generator=generator, dtype=dtype) for dtype in _INT_KINDS]
    declined = [torch.arange(12.0).reshape(3, 4).t(), torch.empty(0), torch.empty(3, device="meta"),
                torch.ones(3).as_subclass(_Subclass), torch.ones(2, dtype=torch.bool)]
    cases = floats + ints + declined + [torch.nn.Parameter(floats[2])]
    read_floats, read_ints, weight_state, clean, read_grads = readers
    out = _Pair()
    for tensor in cases:
        for read, (path, kinds, check) in ((read_floats, (kernel, _KINDS, True)),
                                          (read_ints, (int_kernel, _INT_KINDS, True)),
                                          (read_grads, (kernel, _KINDS, False))):
            expected = _read_contiguous(path, kinds, tensor, out, check)
            found = read(tensor, out)
            if found != expected:
                return f"{tensor.dtype} {tuple(tensor.shape)}: {found} != {expected}"
    return _self_test_weight_state(weight_state) or _self_test_grads_clean(clean, kernel)


def _self_test_grads_clean(clean: Callable[..., Any], kernel: ctypes._CFuncPtr) -> str:  # type: ignore[name-defined]
    """grads_clean against :func:`grads_clean` through the ctypes path, on gradients it must
    take (finite, in every float width), find non-finite (NaN, Inf) or decline (not contiguous,
    a subclass), and on arguments it must leave to the Python path; "" when they agree. Made
    without random numbers: loading the kernel must not move the user's RNG."""
    def parameter(grad: torch.Tensor | None) -> torch.nn.Parameter:
        param = torch.nn.Parameter(torch.zeros(1))
        if grad is not None:
            param.data = torch.zeros(grad.shape, dtype=grad.dtype)
            param.grad = grad
        return param

    finite = [torch.linspace(-3.0, 5.0, 37, dtype=dtype) for dtype in _KINDS]
    nan, inf = finite[2].clone(), finite[3].clone()
    nan[11] = float("nan")
    inf[30] = float("-inf")
    cases: list[list] = [[parameter(g) for g in finite], [None, parameter(None), parameter(finite[0])],
                         [parameter(finite[1]), parameter(nan)], [parameter(inf)],
                         [parameter(torch.arange(12.0).reshape(3, 4).t())],
                         [parameter(torch.ones(3).as_subclass(_Subclass))], []]
    out = _Pair()

    def read(tensor: torch.Tensor, buffer: ctypes.Array) -> tuple[float, float] | None:
        return _read_contiguous(kernel, _KINDS, tensor, buffer)

    for number, slots in enumerate(cases):
        containers = [{"w": param} for param in slots]
        keys = ["w"] * len(slots)
        indices = list(range(len(slots)))
        expected = grads_clean(slots, indices, read, out)
        found = clean(containers, keys, indices)
        if found is not expected:
            return f"grads_clean, case {number}: {found} != {expected}"
    finite_slot = [{"w": parameter(finite[2])}]
    if clean(finite_slot + [{}], ["w", "w"], [0, 1]) is not True:  # missing: dict.get's None
        return "grads_clean: a missing parameter is not skipped"
    for number, (containers, keys, indices) in enumerate((
            (finite_slot, ["w"], [1]), (finite_slot, ["w"], [-1]), (finite_slot, ["w"], (0,)),
            (tuple(finite_slot), ["w"], [0]), (finite_slot, ["w", "w"], [0]),
            ([OrderedDict(finite_slot[0])], ["w"], [0]), (finite_slot, ["w"], [True]))):
        if clean(containers, keys, indices) is not None:
            return f"grads_clean took declined case {number}"
    return ""


def _self_test_weight_state(weight_state: Callable[..., Any]) -> str:
    """weight_state against the Python reads on parameters, a half-precision buffer and a
    module in eval mode, and on containers it must decline; "" when they agree. Made without
    random numbers: loading the kernel must not move the user's RNG."""
    parameter = torch.nn.Parameter(torch.zeros(2, 3))
    bias = torch.nn.Parameter(torch.ones(2))
    buffer = torch.zeros(2, dtype=torch.float16)
    buffer.add_(1)
    modules = [torch.nn.Module(), torch.nn.Module().eval()]
    containers: list[dict] = [{"weight": parameter, "bias": bias}, {"running_mean": buffer}]
    containers = [containers[0], containers[0], containers[1]]
    keys = ["weight", "bias", "running_mean"]
    weights = [container.get(key) for container, key in zip(containers, keys)]
    expected = (weights, [t._version for t in weights], [(t.data_ptr(), t.dtype) for t in weights],
                [m.training for m in modules])
    found = weight_state(containers, keys, modules)
    if found is None or len(found[0]) != len(weights) or any(
            a is not b for a, b in zip(found[0], weights)) or tuple(found[1:]) != expected[1:]:
        return f"weight_state: {found} != {expected}"
    declined = [([{"w": None}], ["w"]), ([{}], ["w"]), ([OrderedDict(w=weights[0])], ["w"]),
                ([{"w": torch.ones(1).as_subclass(_Subclass)}], ["w"])]
    with torch.inference_mode():
        declined.append(([{"w": torch.ones(1)}], ["w"]))  # no version counter
    for containers, keys in declined:
        if weight_state(containers, keys, modules) is not None:
            return f"weight_state took {containers}"
    return ""


class _Unavailable(Exception):
    pass


def _cache_dir() -> Path:
    configured = os.environ.get("NANWIDGET_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nanwidget"


def _compilers() -> list[str]:
    names = [os.environ.get("CC", ""), (sysconfig.get_config_var("CC") or "").split(" ")[0],
             "cc", "gcc", "clang"]
    found: list[str] = []
    for name in names:
        path = shutil.which(name) if name else None
        if path and path not in found:
            found.append(path)
    return found


def _python_include() -> str | None:
    """The directory of this Python's ``Python.h``, or None where its headers are not
    installed (then only the plain library is built)."""
    include = sysconfig.get_paths().get("include") or ""
    return include if include and os.path.exists(os.path.join(include, "Python.h")) else None


def _build_or_find() -> tuple[Path, str]:
    """The cached library for this source, platform (and Python), compiled first when there
    is none; and "" when it is the Python extension, else why not."""
    # target_clones picks AVX2 at load time where the CPU has it; compilers or platforms
    # without it (macOS has no ifunc) get the portable build.
    attempts = [["-O3", "-shared", "-fPIC", "-DNANWIDGET_TARGET_CLONES"], ["-O3", "-shared", "-fPIC"]]
    plain = (_SOURCE, "absrange", [], _SOURCE.read_bytes())
    flavours = [plain]
    include = _python_include()
    if include is not None:
        # The extension: entry.c includes absrange.c; built for this Python's ABI.
        link = ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []
        key = _ENTRY_SOURCE.read_bytes() + plain[3] + (
            f"|{sysconfig.get_config_var('EXT_SUFFIX')}|{sys.version_info[:2]}".encode())
        flavours.insert(0, (_ENTRY_SOURCE, "entry", ["-I", include, *link], key))
    fallback = Path(tempfile.gettempdir()) / f"nanwidget-{getattr(os, 'getuid', lambda: 'user')()}"
    errors: list[str] = []
    compilers: list[str] | None = None
    for source, stem, extra, content in flavours:
        candidates = []
        for directory in (_cache_dir(), fallback):
            for flags in attempts:
                key = hashlib.sha256(content)
                key.update(f"{sys.platform}|{platform.machine()}|{_ABI_VERSION}|{flags}".encode())
                target = directory / f"{stem}-{key.hexdigest()[:16]}.so"
                if target.exists():
                    return target, _why_not_extension(source, include, errors)
                candidates.append((target, flags))
        if compilers is None:
            compilers = _compilers()
            if not compilers:
                raise _Unavailable("no C compiler found")
        # The extension is tried with the first compiler in the first writable directory only:
        # where it does not build, every process would otherwise pay for the failed attempts.
        extension = source is _ENTRY_SOURCE
        written = None
        for target, flags in candidates:
            if extension and written not in (None, target.parent):
                break
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                errors.append(f"{target.parent}: {error.strerror}")
                continue
            written = target.parent
            for compiler in compilers[:1] if extension else compilers:
                if _compile(compiler, [*flags, *extra], source, target, errors):
                    return target, _why_not_extension(source, include, errors)
        if extension:
            errors = [f"Python extension: {e}" for e in errors[-2:]]
    raise _Unavailable("could not compile: " + "; ".join(errors[-3:]))


def _why_not_extension(source: Path, include: str | None, errors: list[str]) -> str:
    """"" for the extension; for the plain library, why it is in use: no headers, or the
    extension did not compile."""
    if source is _ENTRY_SOURCE:
        return ""
    if include is None:
        return "Python's headers were not found"
    return "the Python extension did not compile: " + ("; ".join(errors[-1:]) or "?")


def _compile(compiler: str, flags: list[str], source: Path, target: Path,
             errors: list[str]) -> bool:
    # Compile next to the target and rename: ranks starting together never load a
    # half-written library.
    partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        result = subprocess.run([compiler, *flags, str(source), "-o", str(partial)],
                                capture_output=True, text=True, timeout=120)
        if result.returncode == 0:
            os.replace(partial, target)
            return True
        errors.append(f"{Path(compiler).name}: {result.stderr.strip()[:200]}")
    except (OSError, subprocess.SubprocessError) as error:
        errors.append(f"{Path(compiler).name}: {error}")
    finally:
        if partial.exists():
            partial.unlink()
    return False


def _bind(library: Path) -> tuple[ctypes._CFuncPtr, ...]:  # type: ignore[name-defined]
    handle = ctypes.CDLL(str(library))
    handle.nanwidget_abi_version.restype = ctypes.c_int
    if handle.nanwidget_abi_version() != _ABI_VERSION:
        raise _Unavailable(f"{library.name} has another ABI version")
    kernels = []
    for name in ("nanwidget_abs_range", "nanwidget_finite_range", "nanwidget_int_range"):
        kernel = getattr(handle, name)
        kernel.restype = ctypes.c_int
        kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        kernels.append(kernel)
    return tuple(kernels)


def _self_test_int(kernel: ctypes._CFuncPtr) -> str:  # type: ignore[name-defined]
    """Compare the integer kernel with torch (min, max, converted to float as torch does)."""
    generator = torch.Generator().manual_seed(0)
    for dtype in _INT_KINDS:
        info = torch.iinfo(dtype)
        for length in (1, 7, 33, 1000):
            values = torch.randint(-1000, 1000, (length,), generator=generator, dtype=dtype)
            for row in (values, values.abs(), values.neg() - 1):
                extremes = row.clone()
                extremes[(length * 5) // 7] = info.min
                extremes[(length * 3) // 7] = info.max
                for tensor in (row, extremes):
                    out = _Pair()
                    kernel(tensor.data_ptr(), tensor.numel(), _INT_KINDS[dtype], out)
                    low, high = torch.aminmax(tensor)
                    expected = tuple(torch.stack((low, high)).double().tolist())
                    if (out[0], out[1]) != expected:
                        return f"{dtype} x{length}: {(out[0], out[1])} != {expected}"
    return ""


def _self_test_finite(kernel: ctypes._CFuncPtr) -> str:  # type: ignore[name-defined]
    """Compare the finite-values kernel with torch on tensors holding NaN and Inf."""
    nan, inf = float("nan"), float("inf")
    rows = [[nan, 1.5, -3.0, 0.0], [inf, -inf, 2.0], [nan, inf], [nan, nan], [-inf, 5e-39, nan],
            [6.0e4, -6.5e4, nan], [1e-45, -2.0, inf]]
    for dtype in _KINDS:
        for row in rows:
            tensor = torch.tensor(row, dtype=torch.float64).to(dtype)
            out = _Triple()
            kernel(tensor.data_ptr(), tensor.numel(), _KINDS[dtype], out)
            magnitude = tensor.double().abs()
            finite = magnitude[torch.isfinite(magnitude)]
            expected = (finite.min().item() if finite.numel() else inf,
                        finite.max().item() if finite.numel() else -inf,
                        1.0 if bool(torch.isinf(magnitude).any()) else 0.0)
            if (out[0], out[1], out[2]) != expected:
                return f"finite range {dtype} {row}: {(out[0], out[1], out[2])} != {expected}"
    return ""


def _self_test(kernel: ctypes._CFuncPtr) -> str:  # type: ignore[name-defined]
    """Compare the kernel with torch on awkward values of every width; "" when they agree."""
    special = [0.0, -0.0, 1.0, -2.5, 3e-39, -1e-45, 6.0e4, -7.0e4, float("inf"), float("-inf")]
    generator = torch.Generator().manual_seed(0)
    cases: list[torch.Tensor] = []
    for dtype in _KINDS:
        for length in (1, 7, 33, 1000):
            values = torch.randn(length, generator=generator, dtype=torch.float64) * 1e3
            values[: min(length, len(special))] = torch.tensor(special[:length], dtype=torch.float64)
            values = values[torch.randperm(length, generator=generator)]
            cases.append(values.to(dtype))
            cases.append(values.to(dtype).neg())
    cases.append(torch.arange(12, dtype=torch.float32).reshape(3, 4).t())  # dense, not contiguous
    for tensor in cases:
        out = _Pair()
        kernel(tensor.data_ptr(), tensor.numel(), _KINDS[tensor.dtype], out)
        low, high = out[0], out[1]
        magnitudes = tensor.double().abs()
        expected = (magnitudes.min().item(), magnitudes.max().item())
        if (low, high) != expected:
            return f"{tensor.dtype} x{tensor.numel()}: {(low, high)} != {expected}"
    return ""

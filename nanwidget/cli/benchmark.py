"""Benchmark harness: step-time ratios of NaN-hunting tools against an unwatched baseline.

Every row is one (model, mode) case; every column one *variant* of instrumentation. A round
runs every variant once, in a freshly shuffled order, on the same model restored to the same
weights and RNG state: attach the variant's hooks, run a few warm-up steps, time a block of
``steps`` steps, remove the hooks and check that none is left behind. A variant's ratio is the
median over rounds of its block time divided by the baseline's block time *of the same round*,
so slow drifts of a shared machine cancel out instead of landing on one variant.

With ``compare=REF`` the watch variants of another git revision of nanwidget run in the same
rounds too (its ``nanwidget`` package is loaded under another name from ``git archive REF``),
and each row gets the median over rounds of new / REF block time: a regression shows before it
lands, with the machine's drift cancelled as for the ratios.

Used by ``python -m nanwidget bench`` (:mod:`nanwidget.cli.bench`); importable so notebooks
can run it too.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core import native
from ..core.watch import watch

__all__ = ["MODELS", "COMPILED_MODELS", "MODES", "VARIANTS", "TARGETS", "SENTINEL_TARGET",
           "REPLAY_TARGET_SECONDS", "BenchRow", "BenchResult", "run_benchmark", "build_case",
           "available_variants", "transformers_available", "HookLeak", "environment",
           "hook_count", "ReplayTiming", "replay_timing", "load_revision", "WATCH_VARIANTS",
           "FLOOR_VARIANTS"]

# "gpt2-compiled": the GPT-2 model under torch.compile; its baseline is the compiled model
# alone, and only the sentinel watch can ride along (the other tools need module hooks).
# "gpt2-small": the same GPT-2 with a 2000-token vocabulary (about 15x less work per step, the
# LM head no longer dominating): per-module costs weigh there as on a GPU.
MODELS = ("mlp", "transformer", "gpt2-small", "gpt2", "gpt2-compiled")
COMPILED_MODELS = ("gpt2-compiled",)
MODES = ("forward", "train")
# Column order of the table; "dbg" and "anomaly" drop out when they cannot run.
VARIANTS = ("baseline", "nanwidget", "nanwidget_backward", "sentinel", "isnan_hook",
            "debug_underflow", "anomaly")
VARIANT_LABELS = {
    "baseline": "baseline ms",
    "nanwidget": "nanwidget",
    "nanwidget_backward": "nw backward=True",
    "sentinel": "sentinel",
    "isnan_hook": "isnan hook",
    "debug_underflow": "DebugUnderflowOverflow",
    "anomaly": "detect_anomaly",
    "floor_full": "full floor",
    "floor_sentinel": "sentinel floor",
}
# Stand-ins for the leanest full and sentinel watches we can build (``floors=True``,
# ``bench --floors``): what the targets are measured against when a target looks out of reach.
FLOOR_VARIANTS = ("floor_full", "floor_sentinel")
# Targets for nanwidget's ratio, per (model, mode); forward rows share one.
TARGETS = {("mlp", "train"): 1.25, ("transformer", "train"): 1.10, ("gpt2", "train"): 1.10,
           ("gpt2-small", "train"): 1.25}
FORWARD_TARGET = 1.30
# The sentinel watch (outputs, and gradients on train rows) on every row, compiled ones too.
SENTINEL_TARGET = 1.03
# nanwidget's overhead (ratio - 1) may be at most this share of DebugUnderflowOverflow's.
OVERHEAD_SHARE_TARGET = 0.10
# A failing batch of the GPT-2 model replayed into full detail (frames and op trace).
REPLAY_TARGET_SECONDS = 2.0
GPT2_INPUT = (4, 64)
GPT2_SMALL_VOCAB = 2000


def target_ratio(model: str, mode: str) -> float | None:
    """nanwidget's (full mode) ratio target for one row; None for compiled rows."""
    if model in COMPILED_MODELS:
        return None
    return FORWARD_TARGET if mode == "forward" else TARGETS[(model, mode)]


# ---------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    """A model in one mode, with the closure that runs one step of it."""

    model_name: str
    mode: str
    model: nn.Module
    step: Callable[[], None]
    state: dict[str, torch.Tensor]
    description: str
    module_calls: int = 0  # module forward calls per step (what full mode hooks)


def _mlp(device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, ...],
                                      Callable[..., torch.Tensor], str]:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    x = torch.randn(64, 64)
    y = torch.randint(0, 10, (64,)).to(device)  # the loss's targets, on the model's device
    return model, (x,), lambda out: nn.functional.cross_entropy(out, y), \
        "MLP 64->256->256->10, batch 64, cross-entropy"


def _transformer(device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, ...],
                                              Callable[..., torch.Tensor], str]:
    layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    x = torch.randn(8, 64, 128)
    target = torch.randn(8, 64, 128).to(device)
    return model, (x,), lambda out: nn.functional.mse_loss(out, target), \
        "nn.TransformerEncoder 4 layers, d_model 128, nhead 4, ffn 512, batch 8x64, MSE"


def _gpt2(device: str = "cpu", vocab_size: int | None = None
          ) -> tuple[nn.Module, tuple[torch.Tensor, ...], Callable[..., torch.Tensor], str]:
    from transformers import GPT2Config, GPT2LMHeadModel
    small = {} if vocab_size is None else {"vocab_size": vocab_size, "bos_token_id": vocab_size - 1,
                                           "eos_token_id": vocab_size - 1}
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, **small)
    model = GPT2LMHeadModel(config)  # random weights, nothing downloaded
    tokens = torch.randint(0, config.vocab_size, GPT2_INPUT)
    targets = tokens[:, 1:].reshape(-1).to(device)

    def loss(out: Any) -> torch.Tensor:
        logits = out.logits[:, :-1]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)

    return model, (tokens,), loss, (f"GPT-2 (n_layer 4, n_embd 128, n_head 4, vocab "
                                    f"{config.vocab_size}, random weights), tokens "
                                    f"{GPT2_INPUT[0]}x{GPT2_INPUT[1]}, LM loss")


_BUILDERS = {"mlp": _mlp, "transformer": _transformer,
             "gpt2-small": lambda device="cpu": _gpt2(device, vocab_size=GPT2_SMALL_VOCAB),
             "gpt2": _gpt2,
             "gpt2-compiled": _gpt2}


def build_case(model_name: str, mode: str, device: str = "cpu", seed: int = 0) -> Case:
    """Build the seeded model and the closure of one forward or train step (a compiled
    model compiles on its first steps, which the harness runs before timing anything)."""
    torch.manual_seed(seed)
    model, inputs, loss_fn, description = _BUILDERS[model_name](device)
    model.to(device)
    module_calls = _module_calls(model, tuple(t.to(device) for t in inputs))
    if model_name in COMPILED_MODELS:
        model = torch.compile(model)
        description = "torch.compile'd " + description
    inputs = tuple(t.to(device) for t in inputs)
    if mode == "forward":
        model.eval()

        def step() -> None:
            with torch.no_grad():
                model(*inputs)
    elif mode == "train":
        model.train()
        # lr small enough that a few hundred steps on a fixed batch stay finite; weights are
        # restored before every measured block anyway.
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(*inputs))
            loss.backward()
            optimizer.step()
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Case(model_name, mode, model, step, state, description, module_calls)


def _module_calls(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """How many module forward calls one forward of ``model`` makes (eager, no_grad, eval
    mode: nothing changes, not even BatchNorm's running statistics; the caller sets the mode)."""
    calls = [0]
    model.eval()

    def count(module: nn.Module, args: tuple) -> None:
        calls[0] += 1

    handles = [m.register_forward_pre_hook(count) for m in model.modules()]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return calls[0]


# ------------------------------------------------------------------------------------- variants
def hook_count(model: nn.Module) -> int:
    """Hooks on any module of ``model`` plus global module hooks (all kinds)."""
    from torch.nn.modules import module as module_mod
    count = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                + len(getattr(m, "_backward_pre_hooks", {})) for m in model.modules())
    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        count += len(getattr(module_mod, name, {}))
    return count


_HOLD_NO_TENSOR = (str, bytes, int, float, bool, type(None), torch.device, torch.dtype)


def _tensors(value: Any, objects: bool = False, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor in an output: tensors, tuples, lists, dicts and ModelOutput-like objects;
    with ``objects``, also those in other objects' public attributes (the key/value cache
    object of a transformers model's output, which the sentinel reads)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 8 or isinstance(value, _HOLD_NO_TENSOR):
        return
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item, objects, depth + 1)
    elif isinstance(value, dict):  # transformers' ModelOutput is an OrderedDict
        for item in value.values():
            yield from _tensors(item, objects, depth + 1)
    elif objects and isinstance(getattr(value, "__dict__", None), dict):
        for name, item in vars(value).items():
            if not name.startswith("_"):
                yield from _tensors(item, objects, depth + 1)


def _isnan_recipe_hook(module: nn.Module, args: tuple, output: Any) -> None:
    """The hook found in forum answers: two host syncs per floating-point output tensor."""
    for tensor in _tensors(output):
        if tensor.is_floating_point():
            if torch.isnan(tensor).any() or torch.isinf(tensor).any():
                raise RuntimeError(f"NaN/Inf in the output of {type(module).__name__}")


@contextlib.contextmanager
def _baseline(case: Case) -> Iterator[None]:
    yield


def _watch_options(variant: str, case: Case) -> dict[str, Any]:
    """The ``nw.watch`` options of a watch variant."""
    if variant == "nanwidget":
        return {"on_nan": "record"}
    if variant == "nanwidget_backward":  # gradient hooks on every module's tensors too
        return {"on_nan": "record", "backward": True}
    # sentinel, as it would be left on in training: outputs every batch, gradients after
    # each backward pass.
    return {"on_nan": "record", "mode": "sentinel", "backward": case.mode == "train"}


def _watching(variant: str, watch_fn: Callable[..., Any]) -> Callable[[Case], Any]:
    @contextlib.contextmanager
    def attach(case: Case) -> Iterator[None]:
        with watch_fn(case.model, **_watch_options(variant, case)):
            yield
    return attach


_nanwidget = _watching("nanwidget", watch)
_nanwidget_backward = _watching("nanwidget_backward", watch)
_sentinel = _watching("sentinel", watch)


@contextlib.contextmanager
def _removed_after(handles: list[Any]) -> Iterator[None]:
    """Hold the block, then take these hook handles off."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _isnan_hook(case: Case) -> Iterator[None]:
    with _removed_after([m.register_forward_hook(_isnan_recipe_hook)
                         for m in case.model.modules()]):
        yield


@contextlib.contextmanager
def _debug_underflow(case: Case) -> Iterator[None]:
    from transformers.debug_utils import DebugUnderflowOverflow
    # DebugUnderflowOverflow keeps no handles and has no way to remove its hooks: note which
    # forward hooks each module had, and take off the ones it added after its block.
    modules = list(case.model.modules())
    before = [set(m._forward_hooks) for m in modules]
    DebugUnderflowOverflow(case.model)
    added = [(m, key) for m, old in zip(modules, before) for key in m._forward_hooks
             if key not in old]
    try:
        yield
    finally:
        for module, key in added:
            for table in (module._forward_hooks, module._forward_hooks_with_kwargs,
                          module._forward_hooks_always_called):
                table.pop(key, None)


@contextlib.contextmanager
def _anomaly(case: Case) -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Anomaly Detection has been enabled", UserWarning)
        anomaly = torch.autograd.detect_anomaly(check_nan=True)
    with anomaly:
        yield


def _floor_reader() -> Callable[[torch.Tensor], Any]:
    """What the watches read a CPU float tensor with: the C reader, else (a tensor above its
    size, the logits of a large vocabulary) the kernel through ctypes when it takes the tensor,
    else torch's largest |x|."""
    read, result = native.contiguous_reader(), native.result_buffer()

    def read_any(tensor: torch.Tensor) -> Any:
        found = read(tensor, result)
        if found is None and native.eligible(tensor):
            found = native.abs_range(tensor, result)
        if found is None and tensor.is_floating_point():
            with torch.no_grad():
                found = torch.linalg.vector_norm(tensor, float("inf"))
        return found
    return read_any


@contextlib.contextmanager
def _floor_full(case: Case) -> Iterator[None]:
    """The leanest full watch: one plain forward hook per module, the C reader on each weight
    whose version moved and on every input and output tensor not read yet in this batch (a
    module's input is usually the previous module's output), a tuple per tensor into a list
    cleared at each batch. No frames, no verdict, no replay, no history."""
    read = _floor_reader()
    weights: dict[int, tuple[int, Any]] = {}
    # id -> (weak reference, version, numbers): activations are not held past their use
    batch: dict[int, tuple[Any, int, Any]] = {}
    rows: list[Any] = []

    def measure(tensor: torch.Tensor) -> Any:
        known = batch.get(id(tensor))
        if known is not None and known[0]() is tensor and known[1] == tensor._version:
            return known[2]
        numbers = read(tensor)
        batch[id(tensor)] = (weakref.ref(tensor), tensor._version, numbers)
        return numbers

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        for parameter in module._parameters.values():
            if parameter is not None:
                version = parameter._version
                known = weights.get(id(parameter))
                if known is None or known[0] != version:
                    weights[id(parameter)] = (version, read(parameter))
        for value in args:
            if type(value) is torch.Tensor:
                rows.append(measure(value))
        for tensor in _tensors(output):
            rows.append(measure(tensor))

    def new_batch(module: nn.Module, args: tuple) -> None:
        rows.clear()
        batch.clear()

    handles = [case.model.register_forward_pre_hook(new_batch)]
    with _removed_after(handles + [m.register_forward_hook(hook) for m in case.model.modules()]):
        yield


@contextlib.contextmanager
def _floor_sentinel(case: Case) -> Iterator[None]:
    """The leanest sentinel: the root's forward wrapped (no module hook), its inputs held by
    reference with the CPU RNG state (what an exact replay of dropout needs), the C reader on
    every output tensor (a key/value cache object's too: the sentinel checks them); on train
    rows a hook on the first output queues one read of every parameter's gradient at the end
    of the backward pass. No verdict, no history, no events."""
    model, read = case.model, _floor_reader()
    # The sentinel's own way to keep the RNG state (a clone of the generator, no tensor).
    forward = model.forward
    rng_state = getattr(torch.default_generator, "clone_state", torch.default_generator.get_state)
    parameters = [p for p in model.parameters() if p.requires_grad]
    held: list[Any] = [None]
    queue_callback = torch.autograd.Variable._execution_engine.queue_callback

    def read_gradients() -> None:
        for parameter in parameters:
            if parameter.grad is not None:
                read(parameter.grad)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        held[0] = (args, kwargs, rng_state())
        output = forward(*args, **kwargs)
        first = None
        for tensor in _tensors(output, objects=True):
            read(tensor)
            first = tensor if first is None else first
        if first is not None and first.requires_grad and torch.is_grad_enabled():
            # On the node that made it, as the sentinel does (a tensor hook costs more).
            if first.grad_fn is not None:
                first.grad_fn.register_prehook(lambda grads: queue_callback(read_gradients))
            else:
                first.register_hook(lambda grad: queue_callback(read_gradients))
        return output

    model.forward = wrapped
    try:
        yield
    finally:
        del model.forward
        held[0] = None


def transformers_available() -> bool:
    try:
        import transformers.debug_utils  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Variant:
    name: str
    attach: Callable[[Case], contextlib.AbstractContextManager[None]]
    modes: tuple[str, ...] = MODES
    compiled: bool = False  # can ride along a compiled model

    def runs_on(self, model_name: str, mode: str) -> bool:
        return mode in self.modes and (self.compiled or model_name not in COMPILED_MODELS)


ALL_VARIANTS = {
    "baseline": Variant("baseline", _baseline, compiled=True),
    "nanwidget": Variant("nanwidget", _nanwidget),
    # Backward frames only add work where there is a backward pass.
    "nanwidget_backward": Variant("nanwidget_backward", _nanwidget_backward, modes=("train",)),
    "sentinel": Variant("sentinel", _sentinel, compiled=True),
    "isnan_hook": Variant("isnan_hook", _isnan_hook),
    "debug_underflow": Variant("debug_underflow", _debug_underflow),
    # Anomaly mode only checks backward; under no_grad it would time the baseline again.
    "anomaly": Variant("anomaly", _anomaly, modes=("train",)),
    "floor_full": Variant("floor_full", _floor_full),
    "floor_sentinel": Variant("floor_sentinel", _floor_sentinel),
}


# The variants that run nanwidget itself (timed against another revision with ``compare``).
WATCH_VARIANTS = ("nanwidget", "nanwidget_backward", "sentinel")


def load_revision(ref: str, repo: str | os.PathLike | None = None) -> tuple[Any, str]:
    """The ``nanwidget`` package of git revision ``ref`` (of the repository holding this
    file, or ``repo``), imported under another name so it runs beside this one; and the
    revision's short hash. Its core imports only relatively, so nothing of this tree leaks in."""
    repo = os.fspath(repo) if repo is not None else os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "--short", ref], check=True,
                                capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as error:
        raise ValueError(f"--compare {ref}: not a git revision of {repo} ({error})") from None
    name = f"nanwidget_rev_{commit}"
    if name in sys.modules:
        return sys.modules[name], commit
    folder = tempfile.mkdtemp(prefix="nanwidget-compare-")
    # Its modules may still import lazily while the bench runs: the copy goes at exit.
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    archive = subprocess.run(["git", "-C", repo, "archive", commit, "nanwidget"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    shutil.move(os.path.join(folder, "nanwidget"), os.path.join(folder, name))
    _rename_absolute_imports(os.path.join(folder, name), name)
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name), commit
    finally:
        sys.path.remove(folder)


def _rename_absolute_imports(package: str, name: str) -> None:
    """Point an old tree's absolute references to its own package (``import nanwidget``,
    ``from nanwidget.x``, ``__import__("nanwidget.core.x")``) at ``name``, so that it never
    reaches into this tree's modules."""
    dotted = re.compile(r"(?<![\w/.-])nanwidget(?=\.[A-Za-z_])")
    statement = re.compile(r"\b(import|from) nanwidget\b")
    for folder, _, files in os.walk(package):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
            renamed = statement.sub(rf"\1 {name}", dotted.sub(name, text))
            if renamed != text:
                with open(path, "w", encoding="utf-8") as handle:
                    handle.write(renamed)


def available_variants(floors: bool = False) -> list[str]:
    """Variant names that can run here (DebugUnderflowOverflow needs transformers; the floors,
    with ``floors``, the native kernel)."""
    names = list(VARIANTS)
    if not transformers_available():
        names.remove("debug_underflow")
    if floors and native.available():
        names.extend(FLOOR_VARIANTS)
    return names


# --------------------------------------------------------------------------------------- running
def _cost_cell(cost: float | None, form: str) -> str:
    """A cost column's cell: a cost measured below zero is the noise of the rounds (the watch
    cannot make the step faster), shown as "~0" rather than a negative number."""
    if cost is None:
        return "-"
    return "~0" if cost < 0 else form.format(cost)


@dataclass
class BenchRow:
    """One (model, mode): baseline step time and every variant's ratio to it."""

    model: str
    mode: str
    description: str
    steps_per_block: int
    rounds: int
    baseline_ms: float
    ratios: dict[str, float]  # variant -> median ratio; missing when not applicable
    block_seconds: dict[str, list[float]] = field(default_factory=dict, repr=False)
    # variant -> median over rounds of its block time / the compared revision's ("compare")
    versus: dict[str, float] = field(default_factory=dict)
    module_calls: int = 0  # module forward calls per step

    @property
    def target(self) -> float | None:
        return target_ratio(self.model, self.mode)

    def overhead_us(self, variant: str) -> float | None:
        """Microseconds ``variant`` adds to one step (median ratio - 1, times the baseline)."""
        ratio = self.ratios.get(variant)
        return None if ratio is None else (ratio - 1.0) * self.baseline_ms * 1e3

    def us_per_module_call(self, variant: str = "nanwidget") -> float | None:
        """Microseconds ``variant`` adds per module forward call of a step."""
        added = self.overhead_us(variant)
        return None if added is None or not self.module_calls else added / self.module_calls

    def sentinel_verdict(self) -> str:
        """PASS or MISS against :data:`SENTINEL_TARGET`."""
        ratio = self.ratios.get("sentinel")
        if ratio is None:
            return "-"
        return "PASS" if ratio <= SENTINEL_TARGET else f"MISS (ratio>{SENTINEL_TARGET:.2f})"

    def share_of_debug_underflow(self, variant: str) -> float | None:
        """``variant``'s overhead (ratio - 1) over DebugUnderflowOverflow's, or None."""
        ours, theirs = self.ratios.get(variant), self.ratios.get("debug_underflow")
        if ours is None or theirs is None or theirs <= 1.0:
            return None
        return (ours - 1.0) / (theirs - 1.0)

    @property
    def overhead_share(self) -> float | None:
        """nanwidget's overhead (ratio - 1) over DebugUnderflowOverflow's, or None."""
        return self.share_of_debug_underflow("nanwidget")

    @property
    def floor_share(self) -> float | None:
        """The full-mode floor's overhead over DebugUnderflowOverflow's, or None."""
        return self.share_of_debug_underflow("floor_full")

    def verdict(self) -> str:
        """PASS, or MISS with the target(s) missed."""
        missed = []
        ratio = self.ratios.get("nanwidget")
        if ratio is None or self.target is None:
            return "-"
        if ratio > self.target:
            missed.append(f"ratio>{self.target:.2f}")
        share = self.overhead_share
        if share is not None and share > OVERHEAD_SHARE_TARGET:
            missed.append(f"share>{OVERHEAD_SHARE_TARGET:.2f}")
        return "PASS" if not missed else "MISS (" + ", ".join(missed) + ")"

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "mode": self.mode, "description": self.description,
                "steps_per_block": self.steps_per_block, "rounds": self.rounds,
                "baseline_ms": self.baseline_ms, "ratios": self.ratios,
                "target": self.target, "overhead_share": self.overhead_share,
                "verdict": self.verdict(), "sentinel_target": SENTINEL_TARGET,
                "sentinel_verdict": self.sentinel_verdict(), "block_seconds": self.block_seconds,
                "versus": self.versus, "module_calls": self.module_calls,
                "sentinel_us_per_batch": self.overhead_us("sentinel"),
                "nanwidget_us_per_module_call": self.us_per_module_call(),
                "floor_share": self.floor_share,
                "floor_sentinel_us_per_batch": self.overhead_us("floor_sentinel")}


def environment(device: str = "cpu") -> dict[str, Any]:
    """What the numbers depend on: versions, threads, processor."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "device": device,
        "mha_fastpath": "disabled (every variant runs the same MultiheadAttention path)",
        "native_kernel": native.status(),
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = "not installed (no DebugUnderflowOverflow column)"
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def _mha_fastpath_disabled() -> Iterator[None]:
    """nn.TransformerEncoderLayer's eval fast path runs attention as one fused op, which
    would let variants differ in the work done; switch it off for the whole run."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        yield
        return
    before = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(before)


class HookLeak(AssertionError):
    """A variant left hooks or anomaly mode behind; its neighbours' numbers would be wrong."""


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _measure(case: Case, variant: Variant, steps: int, warmup: int, seed: int,
             device: str, clock: Callable[[], float] = time.perf_counter) -> float:
    """Restore weights and RNG, attach the variant, warm up, time ``steps`` steps; seconds."""
    hooks_before = hook_count(case.model)
    with torch.no_grad():
        case.model.load_state_dict(case.state)
    torch.manual_seed(seed)
    with variant.attach(case):
        for _ in range(warmup):
            case.step()
        _synchronize(device)
        start = clock()
        for _ in range(steps):
            case.step()
        _synchronize(device)
        elapsed = clock() - start
    left = hook_count(case.model) - hooks_before
    if left or torch.is_anomaly_enabled():
        raise HookLeak(f"{variant.name} left {left} hook(s) on the {case.model_name} model"
                       f"{' and anomaly mode on' if torch.is_anomaly_enabled() else ''}")
    return elapsed


def _steps_per_block(case: Case, block_seconds: float, warmup: int, seed: int, device: str) -> int:
    """How many baseline steps make a block of about ``block_seconds``.

    From the median of several single-step timings, so that one slow first call or a
    scheduling hiccup on a shared machine does not set the block size.
    """
    with torch.no_grad():
        case.model.load_state_dict(case.state)
    torch.manual_seed(seed)
    for _ in range(warmup):
        case.step()
    single: list[float] = []
    probe_start = time.perf_counter()
    while len(single) < 3 or (len(single) < 15 and time.perf_counter() - probe_start < block_seconds):
        _synchronize(device)
        start = time.perf_counter()
        case.step()
        _synchronize(device)
        single.append(time.perf_counter() - start)
    return max(1, round(block_seconds / max(statistics.median(single), 1e-7)))


def run_benchmark(models: Sequence[str] = MODELS, modes: Sequence[str] = MODES, *,
                  rounds: int = 15, block_seconds: float = 0.1, warmup: int = 2, seed: int = 0,
                  device: str = "cpu", variants: Sequence[str] | None = None,
                  progress: Callable[[str], None] | None = None,
                  compare: str | None = None,
                  compare_repo: str | os.PathLike | None = None,
                  clock: str = "wall", floors: bool = False) -> BenchResult:
    """Measure every (model, mode) against every variant; see the module docstring.
    ``compare``: a git revision (of ``compare_repo``, by default this tree's repository)
    whose watch variants run in the same rounds; one it cannot run is skipped with a line.
    ``clock``: "wall" (elapsed time) or "cpu" (this process's CPU time: on a shared machine
    it leaves out the time other processes take; CPU device only). ``floors``: also time the
    stand-ins of :data:`FLOOR_VARIANTS` (CPU with the native kernel only)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    if clock == "cpu" and not device.startswith("cpu"):
        raise ValueError("clock='cpu' times CPU work only; use the wall clock on a GPU")
    timer = CLOCKS[clock]
    unknown = [m for m in models if m not in _BUILDERS]
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if floors and not device.startswith("cpu"):
        raise ValueError("floors=True times CPU stand-ins (the native kernel reads CPU tensors); "
                         "leave it out on a GPU")
    names = list(variants) if variants is not None else available_variants(floors)
    if "baseline" not in names:
        names.insert(0, "baseline")
    if any(m.startswith("gpt2") for m in models) and not transformers_available():
        raise ValueError("the gpt2 model needs transformers (pip install 'nanwidget[bench]')")
    extra: dict[str, Variant] = {}
    compared = ""
    skipped: list[str] = []  # one line per variant of the compared revision left out

    def skip(line: str) -> None:
        skipped.append(line)
        if progress:
            progress(line)

    if floors and not native.available():
        skip(f"floors: skipped, the native kernel is not in use ({native.status()})")
    if compare is not None:
        try:
            revision, compared = load_revision(compare, compare_repo)
        except ValueError:  # not a revision: the user's mistake, said as such
            raise
        except Exception as error:  # an old tree that does not import beside this one
            revision = None
            skip(f"--compare {compare}: skipped, that revision's nanwidget does not import "
                 f"here ({type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''})")
        for name in WATCH_VARIANTS if hasattr(revision, "watch") else ():
            if name in names:
                base = ALL_VARIANTS[name]
                extra[f"{name}@ref"] = Variant(f"{name}@ref", _watching(name, revision.watch),
                                               modes=base.modes, compiled=base.compiled)
    order_rng = random.Random(seed)
    rows: list[BenchRow] = []
    with _mha_fastpath_disabled():
        for model_name in models:
            for mode in modes:
                case = build_case(model_name, mode, device=device, seed=seed)
                runnable = [v for v in [ALL_VARIANTS[n] for n in names] + list(extra.values())
                            if v.runs_on(model_name, mode)]
                for variant in [v for v in runnable if v.name in extra]:
                    if not _builds(case, variant, seed, device, compared, skip):
                        del extra[variant.name]  # said once; not tried on later rows
                runnable = [v for v in runnable if not v.name.endswith("@ref") or v.name in extra]
                steps = _steps_per_block(case, block_seconds, warmup, seed, device)
                if progress:
                    progress(f"{model_name}/{mode}: {len(runnable)} variants x {rounds} rounds, "
                             f"{steps} steps per block")
                times: dict[str, list[float]] = {v.name: [] for v in runnable}
                for _ in range(rounds):
                    order = list(runnable)
                    order_rng.shuffle(order)
                    for variant in order:
                        times[variant.name].append(_measure(case, variant, steps, warmup, seed,
                                                            device, timer))
                base = times["baseline"]
                ratios = {name: statistics.median(t / b for t, b in zip(block, base))
                          for name, block in times.items() if name != "baseline"}
                versus = {name[:-4]: statistics.median(
                              n / r for n, r in zip(times[name[:-4]], block))
                          for name, block in times.items() if name.endswith("@ref")}
                rows.append(BenchRow(model_name, mode, case.description, steps, rounds,
                                     statistics.median(base) / steps * 1e3, ratios, times,
                                     versus, case.module_calls))
                del case
    info = environment(device)
    info["clock"] = clock
    return BenchResult(rows, info, names, compared, skipped)


def _builds(case: Case, variant: Variant, seed: int, device: str, compared: str,
            skip: Callable[[str], None]) -> bool:
    """Whether ``variant`` (of an older revision, whose tree may lack a module or an option
    this one has) attaches to ``case`` and runs a step; else one line says it is skipped."""
    try:
        _measure(case, variant, 1, 0, seed, device)
    except HookLeak:
        raise
    except Exception as error:  # an old tree: a missing option, module or feature
        reason = str(error).splitlines()[0] if str(error) else ""
        skip(f"--compare {compared}: skipping {variant.name[:-4]} (that revision cannot run it "
             f"on {case.model_name}/{case.mode}: {type(error).__name__}"
             f"{': ' + reason[:120] if reason else ''})")
        return False
    return True


@dataclass
class ReplayTiming:
    """Seconds from a failing GPT-2 batch to its full detail (frames and op trace)."""

    forward_seconds: float
    backward_seconds: float
    forward_summary: str
    backward_summary: str
    ops: tuple[int, int]


def replay_timing(device: str = "cpu", seed: int = 0) -> ReplayTiming:
    """Plant a NaN in the GPT-2 bench model under a sentinel watch and time its replays: a
    forward event (a NaN weight in the token embedding: frame 0, so the previous batch is
    replayed too to fill the report's window) and a backward-only event (the loss's gradient
    is NaN where its forward is finite: forward and backward replayed)."""
    case = build_case("gpt2", "train", device=device, seed=seed)
    model = case.model
    inputs = torch.randint(0, model.config.vocab_size, GPT2_INPUT, device=device)

    def nan_grad_loss(out: Any) -> torch.Tensor:
        logits = out.logits.float()
        # log(0) in the branch where() discards: a finite loss whose gradient is NaN.
        return torch.where(logits > 1e9, (logits * 0).log(), logits).mean()

    timings = []
    summaries = []
    ops = []
    for plant in ("forward", "backward"):
        with watch(model, mode="sentinel", backward=True, on_nan="record",
                   snapshot_weights=plant == "forward") as w:
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            for step in range(3):
                optimizer.zero_grad(set_to_none=True)
                if plant == "forward" and step == 2:
                    with torch.no_grad():
                        model.transformer.wte.weight[int(inputs[0, 0]), 0] = float("nan")
                out = model(inputs)
                loss = nan_grad_loss(out) if plant == "backward" and step == 2 \
                    else out.logits.float().mean()
                loss.backward()
                if w.events:
                    break
                optimizer.step()
            sentinel = w.parts.sentinel
            event = w.event
            if event is None or sentinel is None:
                raise RuntimeError(f"the planted {plant} NaN was not caught")
            timings.append(sentinel.last_replay_seconds)
            summaries.append(event.summary())
            ops.append(len(event.trace.ops) if event.trace is not None else 0)
        with torch.no_grad():
            model.load_state_dict(case.state)
    return ReplayTiming(timings[0], timings[1], summaries[0], summaries[1], (ops[0], ops[1]))


# ---------------------------------------------------------------------------------------- tables
@dataclass
class BenchResult:
    """Rows of a run plus the environment they were measured in."""

    rows: list[BenchRow]
    environment: dict[str, Any]
    variants: list[str]
    compared: str = ""  # the revision timed beside this tree ("" when none)
    skipped: list[str] = field(default_factory=list)  # compared variants left out, and why

    def columns(self) -> list[str]:
        """Table header: case, baseline ms, one ratio per variant, share, verdict."""
        ratio_columns = [VARIANT_LABELS[v] for v in self.variants if v != "baseline"]
        share = ["nw/DUO overhead"] if "debug_underflow" in self.variants else []
        if "debug_underflow" in self.variants and "floor_full" in self.variants:
            share.append("floor/DUO overhead")
        sentinel = ["sentinel vs 1.03x"] if "sentinel" in self.variants else []
        costs = (["nw µs/call"] if "nanwidget" in self.variants else []) + \
            (["sentinel µs/batch"] if "sentinel" in self.variants else []) + \
            (["sentinel floor µs/batch"] if "floor_sentinel" in self.variants else [])
        return ["model/mode", "baseline ms", *ratio_columns, *share, *costs, "target",
                "nanwidget vs target", *sentinel]

    def table_cells(self) -> list[list[str]]:
        cells = []
        for row in self.rows:
            line = [f"{row.model}/{row.mode}", f"{row.baseline_ms:.2f}"]
            for variant in self.variants:
                if variant == "baseline":
                    continue
                ratio = row.ratios.get(variant)
                line.append("-" if ratio is None else f"{ratio:.2f}x")
            if "debug_underflow" in self.variants:
                line.append(_cost_cell(row.overhead_share, "{:.2f}"))
                if "floor_full" in self.variants:
                    line.append(_cost_cell(row.floor_share, "{:.2f}"))
            if "nanwidget" in self.variants:
                line.append(_cost_cell(row.us_per_module_call(), "{:.2f}"))
            if "sentinel" in self.variants:
                line.append(_cost_cell(row.overhead_us("sentinel"), "{:.1f}"))
            if "floor_sentinel" in self.variants:
                line.append(_cost_cell(row.overhead_us("floor_sentinel"), "{:.1f}"))
            line.append("-" if row.target is None else f"<={row.target:.2f}x")
            line.append(row.verdict())
            if "sentinel" in self.variants:
                line.append(row.sentinel_verdict())
            cells.append(line)
        return cells

    def format_table(self, markdown: bool = False) -> str:
        header, cells = self.columns(), self.table_cells()
        if markdown:
            lines = ["| " + " | ".join(header) + " |",
                     "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
            lines += ["| " + " | ".join(line) + " |" for line in cells]
            return "\n".join(lines)
        widths = [max(len(header[i]), *(len(line[i]) for line in cells)) for i in range(len(header))]
        def fmt(line: list[str]) -> str:
            return "  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                             for i, (v, w) in enumerate(zip(line, widths)))
        return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, cells)])

    def format_versus(self, markdown: bool = False) -> str:
        """This tree against the compared revision: per row and watch variant, the median over
        rounds of new / old block time (below 1: faster now)."""
        names = [n for n in WATCH_VARIANTS if any(n in row.versus for row in self.rows)]
        header = ["model/mode"] + [f"{VARIANT_LABELS[n]} new/{self.compared}" for n in names]
        cells = [[f"{row.model}/{row.mode}"] + [
            f"{row.versus[n]:.3f}" if n in row.versus else "-" for n in names] for row in self.rows]
        if markdown:
            return "\n".join(["| " + " | ".join(header) + " |",
                              "|" + "|".join(["---"] + ["---:"] * len(names)) + "|"]
                             + ["| " + " | ".join(line) + " |" for line in cells])
        widths = [max(len(header[i]), *(len(line[i]) for line in cells)) for i in range(len(header))]
        return "\n".join("  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                                   for i, (v, w) in enumerate(zip(line, widths)))
                         for line in [header, ["-" * w for w in widths], *cells])

    def format_environment(self) -> str:
        env = self.environment
        parts = [f"torch {env['torch']}", f"python {env['python']}",
                 f"transformers {env['transformers']}", f"{env['threads']} torch threads",
                 f"{env['cpu_count']} CPUs ({env['cpu']})", f"device {env['device']}"]
        if "gpu" in env:
            parts.append(env["gpu"])
        if env.get("clock") == "cpu":
            parts.append("timed by CPU time")
        if "native_kernel" in env:  # which reduction path the CPU numbers measured
            parts.append("native kernel " + ("in use" if env["native_kernel"].startswith("native kernel in use")
                                             else "not in use (torch path)"))
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"environment": self.environment, "variants": self.variants,
                "compared": self.compared, "compare_skipped": self.skipped,
                "targets": {"forward": FORWARD_TARGET,
                            **{f"{m}/{mode}": t for (m, mode), t in TARGETS.items()},
                            "overhead_share": OVERHEAD_SHARE_TARGET,
                            "sentinel": SENTINEL_TARGET, "replay_seconds": REPLAY_TARGET_SECONDS},
                "rows": [row.to_dict() for row in self.rows]}

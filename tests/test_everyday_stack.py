"""The stack people use around a watched model: copies and checkpoints, caches passed to the
forward and replayed, exporters and tracers, TorchScript parts, tensor subclasses, compiled
wrappers, recordings that outlive the watch (issue 23). Each in full and sentinel mode where
both apply."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import nanwidget as nw
from nanwidget.core.copies import is_nanwidget_hook
from nanwidget.core.replay import ReplayError

from conftest import TinyMLP, hook_count

MODES = ["full", "sentinel"]


def _nanwidget_hooks(model: nn.Module) -> int:
    """Hooks of nanwidget's own on any module of ``model``."""
    return sum(is_nanwidget_hook(hook) for module in model.modules()
               for table in (module._forward_hooks, module._forward_pre_hooks)
               for hook in table.values())


# ------------------------------------------------------------------ copies (item 6)
def _users_own_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    return None


def _copies(model: nn.Module) -> dict[str, nn.Module]:
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    return {"deepcopy": copy.deepcopy(model), "pickle": pickle.loads(pickle.dumps(model)),
            "torch.save": torch.load(saved, weights_only=False)}


@pytest.mark.parametrize("mode", MODES)
def test_a_watched_model_copies_pickles_and_saves_unwatched_and_stays_watched(mode):
    model = TinyMLP()
    model.fc2.register_forward_hook(_users_own_hook)
    x = torch.randn(4, 16)
    with nw.watch(model, mode=mode, backward=True, on_nan="record") as w:
        model(x).sum().backward()
        copies = _copies(model)
        for how, twin in copies.items():
            assert _nanwidget_hooks(twin) == 0, how
            assert list(twin.fc2._forward_hooks.values()) == [_users_own_hook], how
            assert not {"__getstate__", "__prepare_scriptable__"} & set(twin.__dict__), how
            assert torch.equal(twin(x), model(x)), how
            with torch.no_grad():
                twin.fc2.bias[0] = float("nan")  # the copy is not watched: no event
            twin(x)
        assert w.events == [] and _nanwidget_hooks(model) > 0
        with torch.no_grad():
            model.fc2.bias[0] = float("nan")
        model(x)
    assert (w.event.module, w.event.role) == ("fc2", "bias")
    assert hook_count(model) == 1 and "__getstate__" not in model.__dict__


def test_an_ema_copy_every_step_and_a_best_model_checkpoint_under_a_watch():
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    with nw.watch(model, mode="sentinel", backward=True) as w:
        ema = torch.optim.swa_utils.AveragedModel(model)  # deep-copies the watched model
        for _ in range(3):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
            ema.update_parameters(model)
            best = copy.deepcopy(model)
        assert w.batch == 3 and _nanwidget_hooks(ema) == 0 and _nanwidget_hooks(best) == 0
        assert torch.equal(best(x), model(x))


@pytest.mark.parametrize("mode", MODES)
def test_a_deepcopy_of_a_watched_model_with_parametrized_layers_is_not_watched(mode):
    # A parametrized module's class copies its __dict__ itself (parametrize's __deepcopy__):
    # the copy kept the watch's hooks and reported into it, and a parametrized root, whose
    # hooks are the recorder's methods, could not be copied at all (a lock).
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), weight_norm(nn.Linear(6, 3)),
                          spectral_norm(nn.Linear(3, 3)))
    root = weight_norm(nn.Linear(4, 3))
    x = torch.randn(3, 4)
    with nw.watch(model, mode=mode, backward=True) as w, \
            nw.watch(root, mode=mode, backward=True) as w_root:
        model(x).sum().backward()
        root(x).sum().backward()
        ema, root_copy = copy.deepcopy(model), copy.deepcopy(root)
        for twin, original in ((ema, model), (root_copy, root)):
            assert _nanwidget_hooks(twin) == 0
            assert not any(key in m.__dict__ for m in twin.modules()
                           for key in ("__getstate__", "__deepcopy__", "__prepare_scriptable__"))
            assert torch.equal(twin(x), original(x))
        with torch.no_grad():  # the copies' own NaN: nothing reaches the watches
            ema[2].parametrizations.weight.original0.fill_(float("nan"))
            root_copy.parametrizations.weight.original1.fill_(float("inf"))
        assert torch.isnan(ema(x)).all() and not torch.isfinite(root_copy(x)).all()
        assert w.events == [] and w_root.events == [] and w.batch == 2  # its own two only
        assert torch.equal(copy.deepcopy(ema)(x).isnan(), ema(x).isnan())
    assert hook_count(model) == 0 and hook_count(root) == 0
    assert not any(key in m.__dict__ for m in model.modules()
                   for key in ("__getstate__", "__deepcopy__"))


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 8),
                         nn.ReLU(inplace=True), nn.Linear(8, 2)).eval()


_SWAPS_IN_PLACE = {
    "quantize_dynamic": lambda model: torch.ao.quantization.quantize_dynamic(model, inplace=True),
    "fuse_modules": lambda model: torch.ao.quantization.fuse_modules(
        model, [["0", "1", "2"], ["5", "6"]], inplace=True),
}


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("swap", sorted(_SWAPS_IN_PLACE))
def test_torch_ao_swapping_watched_modules_in_place_keeps_the_forward_and_the_copies(swap,
                                                                                    backward):
    # torch.ao's swap_module and fuse_modules register the old module's hooks on the new one
    # without with_kwargs: the next forward raised TypeError ("_forward_hook() missing 1
    # required positional argument: 'output'"), a copy or pickle of the model carried or choked
    # on the watch's hooks, and close() left them on the model (torch.save failed after it).
    x = torch.randn(2, 3, 8, 8)
    unwatched = _conv_net()
    _SWAPS_IN_PLACE[swap](unwatched)
    model = _conv_net()
    with nw.watch(model, backward=backward, on_nan="record") as w:
        with torch.no_grad():
            model(x)
        _SWAPS_IN_PLACE[swap](model)
        twin = copy.deepcopy(model)  # before any forward: the copied hooks still there
        pickle.loads(pickle.dumps(model))
        assert _nanwidget_hooks(twin) == 0
        with torch.no_grad():
            assert torch.equal(model(x), unwatched(x))
        assert w.events == []
        target = "0" if swap == "quantize_dynamic" else "7"  # a module the swap left as it was
        with torch.no_grad():
            model.get_submodule(target).bias[1] = float("nan")
            with contextlib.suppress(RuntimeError):  # a dynamic quantized Linear refuses NaN
                model(x)
        assert (w.event.module, w.event.role, w.event.origin) == (target, "bias", "weight")
    assert _nanwidget_hooks(model) == 0 and hook_count(model) == 0
    torch.save(model, io.BytesIO())


def test_a_saved_watched_model_loads_where_nanwidget_is_not_imported(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with nw.watch(model, backward=True):
        torch.save(model, tmp_path / "model.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        model = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)
        out = model(torch.ones(1, 4))
        assert "nanwidget" not in sys.modules, "unpickling imported nanwidget"
        print(sum(len(m._forward_hooks) for m in model.modules()), tuple(out.shape))
        """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "(1,", "2)"]


# ------------------------------------------------------------------ tracers (item 8)
_CAPTURERS = {
    "export strict": lambda model, x: len(torch.export.export(model, (x,), strict=True)
                                          .graph.nodes),
    "export": lambda model, x: len(torch.export.export(model, (x,)).graph.nodes),
    "fx": lambda model, x: len(torch.fx.symbolic_trace(model).graph.nodes),
    "jit": lambda model, x: len(list(torch.jit.trace(model, (x,)).graph.nodes())),
}


def _graph_sizes(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Each capturer's graph size; a strict export first, as a user's first capture."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace's deprecation and tracer notes
        return {name: capture(model, x) for name, capture in _CAPTURERS.items()}


class _InplaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("mode", MODES)
def test_exporters_and_tracers_see_the_unwatched_model(mode):
    model = _InplaceNet()
    x = torch.randn(2, 16)
    unwatched = _graph_sizes(model, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, mode=mode, backward=True) as w:
            assert _graph_sizes(model, x) == unwatched
            assert w.batch == 0 and w.frames().empty and w.held_batches() == []
            for name in ("export", "export strict"):
                _CAPTURERS[name](model, x)
                assert not w.recorder.suspended, name  # it stood aside for the capture only
            model(x).sum().backward()  # the watch records again once the tracers are done
            assert w.batch == 1 and w.held_batches() == [0]
            assert not w.frames().empty or mode == "sentinel"
    nanwidget_notes = [str(c.message) for c in caught if "nanwidget" in str(c.message)]
    assert nanwidget_notes == []  # no internal error, no GuardOnDataDependentSymNode



@pytest.mark.parametrize("mode", MODES)
def test_tracing_one_module_of_a_watched_model_sees_it_unwatched(mode):
    # torch.jit.trace(model.block) runs no root forward: with backward=True the gradient
    # feature hooked the traced outputs, the tracer named their values after its locals, and
    # the trace's check run failed ("Graphs differed across invocations").
    torch.manual_seed(0)
    model = nn.Sequential(_InplaceNet(), nn.Linear(4, 4))
    x = torch.randn(2, 16)
    unwatched = _graph_sizes(model[0], x)
    with nw.watch(model, mode=mode, backward=True, on_nan="record") as w:
        assert _graph_sizes(model[0], x) == unwatched
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(model[0], (x,))
        assert torch.equal(traced(x), model[0](x).detach())
        assert w.events == [] and w.held_batches() == []
        with torch.no_grad():
            model[1].bias[2] = float("nan")
        model(x).sum().backward()
        assert (w.event.module, w.event.role, w.event.origin) == ("1", "bias", "weight")


def test_the_fx_probe_reads_torch_2_15s_thread_local_flag(monkeypatch):
    # torch 2.15 keeps "fx.symbolic_trace runs" in a thread-local (its module flag is gone):
    # reading the old flag raised in the root's pre-hook, so every watched forward failed.
    import threading
    import types

    from nanwidget.core import graph_capture
    local = threading.local()
    moved = types.SimpleNamespace(_is_fx_tracing_tls=local)
    monkeypatch.setitem(sys.modules, "torch.fx._symbolic_trace", moved)
    reads = graph_capture._fx_flag_reader()
    assert reads() is False
    local.flag = True
    assert reads() is True
    flagged = types.SimpleNamespace(_is_fx_tracing_flag=True)  # torch up to 2.14
    monkeypatch.setitem(sys.modules, "torch.fx._symbolic_trace", flagged)
    assert graph_capture._fx_flag_reader()() is True


@pytest.mark.parametrize("mode", MODES)
def test_a_tracer_probe_that_fails_never_breaks_the_forward(mode, monkeypatch):
    # A torch that moves what the probes read must not break the user's forward: the probes
    # then say "no tracer" and the watch records as usual.
    from nanwidget.core import graph_capture

    def moved():
        raise AttributeError("module 'torch.fx._symbolic_trace' has no attribute 'flag'")

    monkeypatch.setattr(graph_capture, "fx_tracing", moved)
    model = TinyMLP()
    x = torch.randn(2, 16)
    with nw.watch(model, mode=mode) as w:
        out = model(x)
    assert torch.equal(out, model(x)) and w.batch == 1
    assert not w.frames().empty or mode == "sentinel"


# ------------------------------------------------------------------ compiled wrappers (item 11)
def test_watching_the_original_of_an_already_compiled_container_refuses_the_compiled_call():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    compiled_model = torch.compile(model, backend="eager")  # Dynamo's part only: fast
    x = torch.randn(4, 16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled_model(x)  # compiled before the watch: Dynamo inlined the container's call
        bad = x.clone()
        bad[0, 0] = float("nan")
        for mode in MODES:
            with nw.watch(model, mode=mode) as w:
                with pytest.raises(nw.CompiledCallError, match=r"you watched cm._orig_mod"):
                    compiled_model(bad)  # would run compiled code with no hook: NaN unseen
                assert w.events == [] and w.batch == 0
                assert _nanwidget_hooks(copy.deepcopy(compiled_model)) == 0
                with torch.compiler.set_stance("force_eager"):
                    compiled_model(x)  # run eagerly: the hooks run, the batch counts
                assert w.batch == 1
            assert hook_count(compiled_model) == 0 and "__getstate__" not in vars(compiled_model)
            assert torch.isnan(compiled_model(bad)).any()  # closed: the compiled call runs


# ------------------------------------------------------------------ TorchScript, exported (item 9)
class _SqrtBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.shift = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.lin(x).square() + self.shift)  # NaN once shift is very negative


class _WithChild(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.a, self.child, self.b = nn.Linear(16, 16), child, nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.child(self.a(x)))


def _torchscript(kind: str, x: torch.Tensor) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation notes
        block = _SqrtBlock()
        return torch.jit.script(block) if kind == "script" else torch.jit.trace(block, (x,))


@pytest.mark.parametrize("kind", ["script", "trace"])
@pytest.mark.parametrize("mode", MODES)
def test_a_torchscript_child_is_watched_as_one_module_and_replayed(kind, mode):
    x = torch.randn(4, 16)
    model = _WithChild(_torchscript(kind, x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, mode=mode, backward=True, on_nan="record") as w:
            model(x).sum().backward()
            assert w.module_names == ["", "a", "child", "b"] and w.events == []
            with torch.no_grad():
                model.child.shift.fill_(-100.0)  # sqrt of negative numbers, inside TorchScript
            model(x).sum().backward()
            trace = w.replay(1)
    assert [str(c.message) for c in caught if "nanwidget" in str(c.message)] == []
    event = w.event
    assert (event.batch, event.module, event.role, event.origin) == (1, "child", "output",
                                                                      "output")
    assert (trace.first_bad["op"], trace.first_bad["module"]) == ("sqrt", "child")
    child_frame = w.frames().query("module == 'child' and phase == 'forward'")
    assert {"lin.weight", "lin.bias", "shift", "input[0]", "output"} <= set(child_frame["role"])
    assert hook_count(model) == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_weight_inside_a_torchscript_child_is_named(mode):
    x = torch.randn(4, 16)
    model = _WithChild(_torchscript("trace", x))
    with torch.no_grad():
        model.child.lin.bias[3] = float("nan")
    with nw.watch(model, mode=mode, on_nan="record") as w:
        model(x)
    assert (w.event.module, w.event.role, w.event.origin) == ("child", "lin.bias", "weight")


def _add_one(module: nn.Module, args: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    return output + 1.0  # a user's own hook, as TorchScript compiles it


def _small_cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    model[5].register_forward_hook(_add_one)
    return model


@pytest.mark.parametrize("mode", MODES)
def test_torch_jit_script_of_a_watched_model_scripts_the_unwatched_model(mode):
    # TorchScript compiles every hook on a module: scripting a watched model failed on the
    # watch's hooks ("try blocks aren't supported: recorder.py"). Now the script is the
    # unwatched model's (the user's hook compiled, none of the watch's), sharing its weights as
    # a script of the unwatched model does, and the model stays watched.
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation note
        unwatched = torch.jit.script(_small_cnn())
        model = _small_cnn()
        with nw.watch(model, mode=mode, backward=True, on_nan="record") as w:
            model(x).sum().backward()
            unwatched(x).sum().backward()  # the same BatchNorm statistics update
            children = list(model.modules())
            scripted = torch.jit.script(model)
            assert list(model.modules()) == children and w.events == []
            with torch.no_grad():
                assert torch.equal(scripted(x), unwatched(x))
                assert torch.equal(scripted(x), model(x))
            assert sum(len(m._c._get_forward_hooks()) + len(m._c._get_forward_pre_hooks())
                       for m in scripted.modules()) == 1  # the user's
            # no code of nanwidget's in it (its files' paths would show in the graph's comments)
            assert os.path.dirname(nw.__file__) + os.sep not in str(scripted.graph)
            assert all(a is b for a, b in zip(scripted.parameters(), model.parameters()))
            with torch.no_grad():
                model[5].weight[1, 2] = float("nan")
                model(x)
            assert (w.event.module, w.event.role, w.event.origin) == ("5", "weight", "weight")
        assert not any("__prepare_scriptable__" in vars(m) for m in model.modules())
        assert torch.isnan(scripted(x)).any()  # the shared weight; it runs with the watch closed
        assert len(w.events) == 1


class _WeightNormConv(nn.Module):
    """As torchaudio's wav2vec2 positional convolution: a weight-normed conv whose class takes
    the weight norm off for TorchScript, which cannot compile its hook."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.utils.weight_norm(nn.Conv1d(4, 4, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)

    def __prepare_scriptable__(self) -> nn.Module:
        torch.nn.utils.remove_weight_norm(self.conv)
        return self


@pytest.mark.parametrize("mode", MODES)
def test_a_class_that_prepares_itself_for_torchscript_edits_the_script_not_the_model(mode):
    # The class's own __prepare_scriptable__ runs on what is scripted; the watched model keeps
    # its weight norm (its hook and weight_g / weight_v) and its watch.
    torch.manual_seed(0)
    model = nn.Sequential(_WeightNormConv(), nn.Tanh())
    x = torch.randn(2, 4, 8)
    with nw.watch(model, mode=mode, on_nan="record") as w, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model(x)
        scripted = torch.jit.script(model)
        assert torch.allclose(scripted(x), expected, rtol=0, atol=1e-6)
        conv = model[0].conv
        assert {"weight_g", "weight_v"} <= dict(conv.named_parameters()).keys()
        assert len(conv._forward_pre_hooks) == 1 and torch.equal(model(x), expected)
        with torch.no_grad():
            conv.weight_g[1] = float("nan")
        model(x)
    assert (w.event.module, w.event.role, w.event.origin) == ("0.conv", "weight_g", "weight")


@pytest.mark.parametrize("mode", MODES)
def test_an_exported_programs_module_names_the_nan_parameter(mode):
    x = torch.randn(4, 16)
    exported = torch.export.export(TinyMLP(), (x,)).module()
    with torch.no_grad():
        exported.get_submodule("fc2").bias[1] = float("nan")
    with nw.watch(exported, mode=mode, on_nan="record") as w:
        exported(x)
    assert (w.event.module, w.event.role, w.event.origin) == ("", "fc2.bias", "weight")


# ------------------------------------------------------------------ tensor subclasses (item 10)
class _Wrapped(torch.Tensor):
    """A ``__torch_dispatch__`` wrapper subclass (no data of its own) around ``inner`` tensors;
    ops run on the first one."""

    @staticmethod
    def __new__(cls, *inner: torch.Tensor) -> _Wrapped:
        first = inner[0]
        return torch.Tensor._make_wrapper_subclass(cls, first.shape, dtype=first.dtype,
                                                   device=first.device)

    def __init__(self, *inner: torch.Tensor) -> None:
        # Not ``names``: torch 2.10 reads that as the tensor's dimension names.
        self.part_names = [f"part{i}" for i in range(len(inner))]
        for name, tensor in zip(self.part_names, inner):
            setattr(self, name, tensor)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return self.part_names, None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.part0 if isinstance(t, _Wrapped) else t  # noqa: E731
        out = func(*torch.utils._pytree.tree_map(unwrap, args),
                   **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        return torch.utils._pytree.tree_map(
            lambda t: _Wrapped(t) if type(t) is torch.Tensor else t, out)


class _Wrapping(nn.Module):
    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        made = torch.sqrt(x)  # NaN where x < 0
        return _Wrapped(made, *[made * 2 for _ in range(self.parts - 1)])


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_in_a_dispatch_wrapper_subclass_is_read_through_it(mode):
    model = nn.Sequential(nn.Linear(16, 8), _Wrapping(parts=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, mode=mode, on_nan="record") as w:
            model(torch.randn(4, 16))
    assert [str(c.message) for c in caught if "nanwidget" in str(c.message)] == []
    assert (w.event.module, w.event.role, w.event.origin) == ("1", "output", "output")
    output = w.event.frames.query("module == '1' and role == 'output'").iloc[-1]
    assert output["nan"] and output["note"] == ""


@pytest.mark.parametrize("mode", MODES)
def test_a_subclass_whose_values_cannot_be_read_is_noted_and_warned_once(mode):
    model = nn.Sequential(nn.Linear(16, 8), _Wrapping(parts=2))  # two inner tensors: which one?
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        with nw.watch(model, mode=mode, on_nan="record") as w:
            for _ in range(3):
                model(torch.randn(4, 16))
    notes = [str(c.message) for c in caught if "nanwidget" in str(c.message)]
    assert len(notes) == 1 and "_Wrapped" in notes[0] and "internal error" not in notes[0]
    if mode == "full":
        output = w.frames().query("module == '1' and role == 'output'").iloc[-1]
        assert output["note"] == "not read"


class _Counting(torch.Tensor):
    """A ``__torch_function__`` subclass that counts the calls it sees."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        _Counting.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("mode", MODES)
def test_measuring_a_torch_function_subclass_runs_none_of_its_code(mode):
    model = TinyMLP()
    x = torch.randn(4, 16).as_subclass(_Counting)
    _Counting.calls = 0
    model(x)
    unwatched = _Counting.calls
    with nw.watch(model, mode=mode, on_nan="record") as w:
        _Counting.calls = 0
        model(x)
        assert _Counting.calls == unwatched  # the model's own ops only
        with torch.no_grad():
            model.fc2.bias[0] = float("inf")
        model(x)
    assert (w.event.batch, w.event.module) == (1, "fc2")


def _nanwidget_warnings(caught: list) -> list[str]:
    return [str(c.message) for c in caught if "nanwidget" in str(c.message)]


def test_expanded_weights_are_measured_through_the_tensor_they_hold():
    # opacus' grad_sample_mode="ew" runs the model with torch's ExpandedWeight in every
    # parameter slot; it refuses reads of its own attributes, which dropped every Linear's frame
    # (an internal error) and blamed the data's NaN on the ReLU after the first Linear.
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(4, 8)
    x[2, 1] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, on_nan="record") as w:
            call_for_per_sample_grads(model, batch_size=4)(x)
    assert _nanwidget_warnings(caught) == []
    assert (w.event.module, w.event.role, w.event.origin) == ("0", "input[0]", "input")
    weights = w.frames(batch=None).query("role == 'weight'").set_index("module")
    assert list(weights.index) == ["0", "2"]
    assert weights.loc["0", "abs_max"] == pytest.approx(model[0].weight.abs().max().item())


class _RefusesAttributes(nn.Parameter):
    """A parameter subclass whose ``__torch_function__`` refuses reads of its attributes
    (``requires_grad``, ``_version``), as ExpandedWeight does."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "__get__":
            raise RuntimeError("cannot handle function __get__")
        with torch._C.DisableTorchFunctionSubclass():  # plain results, as ExpandedWeight's
            return func(*args, **(kwargs or {}))


def test_a_weight_refusing_reads_of_its_attributes_keeps_the_modules_frame():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    # Put in the slot as functional_call would (registering it reads its attributes).
    model[0]._parameters["weight"] = _RefusesAttributes(model[0].weight.detach())
    with torch.no_grad():
        model[0].bias[1] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, on_nan="record") as w:
            model(torch.randn(3, 8))
    assert _nanwidget_warnings(caught) == []
    frame = w.event.frames.query("module == '0'")
    assert list(frame.role) == ["weight", "bias", "input[0]", "output"]
    assert not frame.query("role == 'weight'").nan.any()
    assert (w.event.module, w.event.role, w.event.origin) == ("0", "bias", "weight")


def test_a_functional_call_stand_in_is_not_kept_alive_by_the_watch():
    # Each inner step of a meta-learning loop (torch.func.functional_call) puts new tensors in
    # the parameter slots: the watch kept every one of them (and its autograd graph) alive.
    import gc
    import weakref

    from torch.func import functional_call

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(6, 4)
    with nw.watch(model, on_nan="record"):
        fast = {name: p * 1.0 for name, p in model.named_parameters()}
        functional_call(model, fast, (x,))
        left = weakref.ref(fast["0.weight"])
        del fast
        for _ in range(5):  # past the batches held for replay (keep_batches=4)
            model(x)
        gc.collect()
        assert left() is None


# ------------------------------------------------------------------ replays on copies (item 7)
def _tiny_gpt2(tied: bool) -> nn.Module:
    """A 2-layer GPT-2 from a config (random weights) with a NaN in the unused vocabulary row
    99: tied, every logit 99 is NaN (an event per forward); untied, only the input embedding
    holds it (a weight event per forward in full mode)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                     n_positions=64, bos_token_id=98, eos_token_id=98,
                                     initializer_range=0.5, tie_word_embeddings=tied)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight[99] = float("nan")
    return model


@pytest.mark.parametrize("beams, options, tied", [
    (1, {"mode": "sentinel"}, True), (1, {"replay_on_nan": True}, True),
    (2, {"mode": "sentinel"}, True), (2, {"replay_on_nan": True}, False)],
    ids=["greedy-sentinel", "greedy-replay_on_nan", "beam-sentinel", "beam-replay_on_nan"])
def test_generation_is_the_same_with_and_without_a_watch_that_replays(beams, options, tied):
    prompt = torch.tensor([[1, 2, 3, 4]])
    settings = dict(max_new_tokens=10, do_sample=False, num_beams=beams, pad_token_id=0,
                    remove_invalid_values=True, return_dict_in_generate=True, output_scores=True)
    unwatched = _tiny_gpt2(tied).generate(prompt, **settings)
    model = _tiny_gpt2(tied)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw.watch(model, on_nan="record", **options) as w:
            watched = model.generate(prompt, **settings)
    assert torch.equal(watched.sequences, unwatched.sequences)
    assert all(torch.equal(a, b) for a, b in zip(watched.scores, unwatched.scores))
    assert watched.past_key_values.get_seq_length() == unwatched.past_key_values.get_seq_length()
    replayed = [e for e in w.events if e.trace is not None]
    assert replayed and all(e.trace.reproduced for e in replayed)  # the replays did run


def test_generation_frames_hold_the_caches_tensors_and_none_of_its_flags():
    # The key/value cache object reaches every block and attention call: its keys and values
    # are rows of their frames (a NaN in a cache shows there), its flags, devices and unfilled
    # layers are not (some twenty rows a frame before).
    model = _tiny_gpt2(tied=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw.watch(model, on_nan="record", max_frames=400) as w:
            model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=2, do_sample=False,
                           pad_token_id=0)
            frames = w.frames()
    attention = frames[frames.module == "transformer.h.1.attn"]
    cached = attention[attention.role.str.contains(r"\.layers\[")]
    assert len(cached) and (cached.note == "").all()
    assert set(cached.role.str.extract(r"\.(keys|values)$")[0]) == {"keys", "values"}
    assert cached.abs_max.notna().all()
    noted = frames[frames.note != ""]
    assert not noted.role.str.contains(r"\.layers\[|offloading|layer_class").any()

@pytest.mark.parametrize("mode", MODES)
def test_each_step_of_static_cache_generation_replays_as_it_ran_and_leaves_the_cache_alone(mode):
    # generate() fills a static cache in place at every step: batch 0's own forward wrote it,
    # and each later step wrote it again. The replay refused ("modified in place by the
    # model's own forward while the batch ran, and again after it"); it now runs each step
    # on the cache as that step found it, on copies of its own.
    transformers = pytest.importorskip(
        "transformers", reason="the static cache is transformers': pip install -e .[transformers]")
    model = _tiny_gpt2(tied=False)
    cache = transformers.StaticCache(config=model.config, max_cache_len=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw.watch(model, on_nan="record", mode=mode, trace_batches=(0, 1, 2)) as w:
            model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=3, do_sample=False,
                           pad_token_id=0, past_key_values=cache)
            ran = w.frames(batch=2) if mode == "full" else None
            before = [t.clone() for layer in cache.layers
                      for t in (layer.keys, layer.values, layer.cumulative_length)]
            traces = [w.replay(batch) for batch in (0, 1, 2)]
    after = [t for layer in cache.layers for t in (layer.keys, layer.values,
                                                   layer.cumulative_length)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(trace.changes == [] for trace in traces)
    if ran is not None:
        logits = [f[(f.module == "") & (f.role == "output.logits")][["abs_min", "abs_max"]]
                  for f in (ran, traces[2].frames)]
        assert len(logits[0]) == 1 and logits[0].values.tolist() == logits[1].values.tolist()



class _Notebook(nn.Module):
    """Writes into the objects it is given: appends to a list, counts in a dict, and keeps
    a running total on an object (as caches do)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, seen: list, counts: dict, state: object) -> torch.Tensor:
        out = self.fc(x)
        seen.append(out.detach())
        counts["calls"] = counts.get("calls", 0) + 1
        state.total = state.total + out.detach().sum()
        return torch.log(out)  # NaN where fc's output is negative


class _State:
    def __init__(self) -> None:
        self.total = torch.zeros(())


@pytest.mark.parametrize("options", [{"mode": "sentinel"}, {"replay_on_nan": True}],
                         ids=["sentinel", "replay_on_nan"])
def test_a_replay_leaves_the_callers_lists_dicts_and_objects_as_they_were(options):
    model = _Notebook()
    seen, counts, state = [], {}, _State()
    x = torch.randn(4, 16)
    with nw.watch(model, on_nan="record", keep_batches=2, **options) as w:
        model(x, seen, counts, state)
        model(x, seen, counts, state)
        w.replay(0)
        w.replay(1)
    assert w.event is not None and w.event.trace is not None
    assert len(seen) == 2 and counts == {"calls": 2}
    assert torch.equal(state.total, 2 * model.fc(x).detach().sum())


class _Locked:
    """An input whose copy fails (it holds a lock)."""

    def __init__(self) -> None:
        import threading
        self.lock = threading.Lock()


class _TakesAnything(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, extra: object) -> torch.Tensor:
        return torch.log(self.fc(x))


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_whose_input_cannot_be_copied_is_refused_with_the_reason(mode):
    model = _TakesAnything()
    with nw.watch(model, on_nan="record", keep_batches=1, mode=mode) as w:
        model(torch.randn(4, 16), _Locked())
        with pytest.raises(ReplayError, match=r"input\[1\].lock \(a lock, whose copy failed "
                                              r".*could not be copied"):
            w.replay(0)
    if mode == "sentinel":
        assert "could not be copied" in w.event.note


# ------------------------------------------------------------------ recordings (item 12)
_TRAIN_THREE_BATCHES = """
import torch
from torch import nn
import nanwidget as nw
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
w = nw.watch(model, log_dir={log_dir!r}, backward=True, mode={mode!r})
for _ in range(3):
    model(torch.randn(8, 16)).square().mean().backward()
    w.check_grad_norms()
    model.zero_grad()
"""


def _complete(log_dir, mode: str) -> None:
    """Nothing lost: every batch's history (full mode records one), every gradient norm, and
    the manifest finalised."""
    run = nw.load_run(log_dir)
    if mode == "full":
        assert sorted(run.history()["batch"].unique()) == [0, 1, 2]
    assert sorted(run.grad_history()["batch"].unique()) == [0, 1, 2]
    manifest = run.manifests[0]
    assert manifest.get("closed") and manifest.get("batches") == 3


@pytest.mark.parametrize("mode", MODES)
def test_a_recording_is_complete_at_interpreter_exit_without_close(tmp_path, mode):
    script = _TRAIN_THREE_BATCHES.format(log_dir=str(tmp_path / "run"), mode=mode)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert done.returncode == 0, done.stderr
    _complete(tmp_path / "run", mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_recording_is_complete_when_a_dropped_watch_is_collected(tmp_path, mode):
    import gc
    namespace: dict = {}
    exec(_TRAIN_THREE_BATCHES.format(log_dir=str(tmp_path / "run"), mode=mode), namespace)
    namespace.clear()  # the model and the watch dropped, never closed
    gc.collect()
    _complete(tmp_path / "run", mode)


# ------------------------------------------------------------------ smaller ones (item 15)
class _MaskedScores(nn.Module):
    """Returns scores with -inf where masked, on purpose (as attention scores are)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.fc(x)
        return scores.masked_fill(torch.arange(8) >= 6, float("-inf"))


@pytest.mark.parametrize("mode", MODES)
def test_allow_inf_with_the_roots_name_lets_the_root_return_inf(mode):
    model = _MaskedScores()
    x = torch.randn(4, 16)
    with nw.watch(model, mode=mode, on_nan="record", allow_inf=[""]) as allowed:
        model(x)
        assert allowed.events == []
        with torch.no_grad():
            model.fc.bias[0] = float("nan")
        model(x)  # a NaN is still an event
    assert (allowed.event.batch, allowed.event.kind) == (1, "nan")
    with torch.no_grad():
        model.fc.bias[0] = 0.0
    with nw.watch(model, mode=mode, on_nan="record") as strict:
        model(x)
    assert strict.event.kind == "inf"


class _OddNames(nn.Module):
    """Module names holding a terminal escape and matplotlib mathtext."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("\x1b[31mred\x1b[0m", nn.Linear(16, 8))
        self.add_module("$\\frac{a}{$", nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "$\\frac{a}{$")(getattr(self, "\x1b[31mred\x1b[0m")(x))


def _odd_recording(log_dir) -> nw.NanWatch:
    model = _OddNames()
    with torch.no_grad():
        getattr(model, "$\\frac{a}{$").bias[0] = float("nan")
    with nw.watch(model, log_dir=log_dir, on_nan="record") as w:
        model(torch.randn(4, 16))
    return w


def test_a_recordings_report_escapes_control_characters_in_module_names(tmp_path):
    _odd_recording(tmp_path)
    report = nw.load_run(tmp_path).report()
    assert "\x1b" not in report and "\\x1b[31mred\\x1b[0m" in report


def test_the_browser_shows_module_names_that_look_like_mathtext(tmp_path):
    from nanwidget.widgets import FrameBrowser
    w = _odd_recording(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for source in (w, nw.load_run(tmp_path)):
            browser = FrameBrowser(source)
            browser.plot_choice.value = "history"
            assert bytes(browser.frames_image.value).startswith(b"\x89PNG")
            assert bytes(browser.history_image.value).startswith(b"\x89PNG")
    assert not [c for c in caught if "Glyph" in str(c.message)]  # the escape is written out


def test_load_run_reads_events_without_the_optional_fields(tmp_path):
    import json
    _odd_recording(tmp_path)
    path = tmp_path / "rank-00000" / "event-000000.json"
    meta = json.loads(path.read_text())
    for optional in ("frame", "is_backward", "rank", "peer_rank", "note", "frames_note"):
        meta.pop(optional)
    meta["written_by_a_newer_nanwidget"] = {"anything": 1}
    path.write_text(json.dumps(meta))
    event = nw.load_run(tmp_path).event
    assert (event.module, event.role, event.frame, event.rank) == ("$\\frac{a}{$", "bias", 0, 0)


def test_grad_history_takes_in_parameters_added_after_the_first_check():
    model = TinyMLP()
    x = torch.randn(4, 16)
    with nw.watch(model) as w:
        model(x).sum().backward()
        w.check_grad_norms()
        model.extra = nn.Linear(4, 4)
        (model(x).sum() + model.extra(model(x)).sum()).backward()
        w.check_grad_norms()
        history = w.grad_history()
    assert set(history.query("batch == 2")["param"]) >= {"extra.weight", "extra.bias",
                                                          "fc1.weight"}
    assert "extra.weight" not in set(history.query("batch == 0")["param"])


def test_bad_data_under_vmap_is_told_and_its_replay_refused_plainly():
    # torch.func.vmap runs the watched model on its own batched tensors: they can be read
    # outside it only through what they wrap (the diagnosis said "unknown", then named no
    # sample) nor replayed (a raw functorch error). The vmap's samples are the rows.
    from torch.func import vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(6, 4)
    x[3, 0] = float("nan")
    with nw.watch(model, on_nan="record") as w:
        vmap(model)(x)
        assert w.event.diagnosis.kind == "bad-data" and w.event.diagnosis.rows == [3]
        assert w.event.diagnosis.summary.startswith("The batch's input[0] holds NaN in row 3")
        with pytest.raises(ReplayError, match="ran inside a torch.func transform"):
            w.replay(w.event.batch)
    with nw.watch(model, on_nan="record") as w:
        vmap(model, in_dims=1)(x.T.contiguous())  # samples along the columns
    assert w.event.diagnosis.kind == "bad-data" and w.event.diagnosis.rows == [3]


def test_per_sample_gradients_name_the_sample_with_bad_data():
    # The torch.func recipe for per-sample gradients: vmap over grad of a functional_call,
    # each sample run as a batch of one.
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    x[4, 2] = float("inf")
    params = {name: p.detach() for name, p in model.named_parameters()}

    def sample_loss(params, sample, target):
        out = functional_call(model, params, (sample.unsqueeze(0),))
        return nn.functional.mse_loss(out, target.unsqueeze(0))

    with nw.watch(model, on_nan="record") as w:
        vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
    diagnosis = w.event.diagnosis
    assert (w.event.module, diagnosis.kind, diagnosis.rows) == ("0", "bad-data", [4])


def test_a_nan_fast_weight_of_functional_call_is_not_blamed_on_the_models_parameter():
    # MAML's inner step runs the watched model through torch.func.functional_call with fast
    # weights: a NaN in one of them read "the optimizer step, load or write after batch 0"
    # made the (finite, never written) parameter non-finite.
    from torch.func import functional_call

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(6, 4)
    with nw.watch(model, on_nan="record") as w:
        model(x)
        fast = {name: p.detach() - 0.1 for name, p in model.named_parameters()}
        fast["2.weight"][1, 1] = float("nan")
        functional_call(model, fast, (x,))
    event = w.event
    assert (event.batch, event.module, event.role, event.origin) == (1, "2", "weight", "weight")
    assert "ran with another tensor in its place (torch.func.functional_call" \
        in event.diagnosis.summary
    assert "optimizer step" not in event.diagnosis.summary
    assert torch.isfinite(model[2].weight).all()


# ------------------------------------------------- nn.TransformerEncoderLayer's fused fast path
def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 3:] = True
    return x, padding


@pytest.mark.parametrize("mode", MODES)
def test_an_eval_encoder_layer_returns_the_same_bits_watched_and_its_padded_row_is_told(mode):
    # Any hook on the layer or inside it turns torch's fused path off: the watched layer
    # returned other bits, and a fully padded sample finite where unwatched it is NaN (no event).
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    x, padding = _padded_batch()
    padding[1] = True  # sample 1 is all padding
    with torch.no_grad():
        expected = layer(x, src_key_padding_mask=padding)
    assert expected[1].isnan().all() and not expected[0].isnan().any()
    with nw.watch(layer, mode=mode, on_nan="record") as w, torch.no_grad():
        out = layer(x, src_key_padding_mask=padding)
    assert torch.equal(out.nan_to_num(7.0), expected.nan_to_num(7.0))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "masked-row" and diagnosis.rows == [1]
    assert "forward" not in layer.__dict__ and _nanwidget_hooks(layer) == 0


def test_the_trace_of_a_fused_encoder_layer_names_the_op_that_made_the_nan():
    # The NaN arrives as the padding mask's -inf (made by torch's own masked_fill_) and the
    # fused layer makes NaN of it: the trace named the mask's masked_fill_ as the first bad op.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x, padding = _padded_batch()
    padding[1] = True
    with nw.watch(model, on_nan="record") as w, torch.no_grad():
        model(x, src_key_padding_mask=padding)
        trace = w.replay(0)
    assert (w.event.module, w.event.origin, w.event.kind, w.event.made_kind) == \
        ("layers.0", "input", "inf", "nan")
    assert trace.first_bad["op"] == "_transformer_encoder_layer_fwd"
    assert trace.first_bad["module"] == "layers.0"
    assert "first bad op _transformer_encoder_layer_fwd" in w.report()
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "masked-row" and diagnosis.rows == [1]


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x), src_key_padding_mask=padding))


def test_encoder_layers_inside_a_model_keep_their_fused_path_and_are_hooked_in_training():
    model = _Encoder().eval()
    x, padding = _padded_batch()
    with torch.no_grad():
        expected = model(x, padding)
    with nw.watch(model, max_frames=1000) as w:
        with torch.no_grad():
            out = model(x, padding)  # fused: each layer measured as one module
        assert torch.equal(out, expected)
        copied = copy.deepcopy(model)
        model(x, padding)  # autograd records: torch takes the modules' path, all hooked
        model.train()
        model(x, padding).sum().backward()
        frames = w.frames()
    fused = set(frames[frames.batch == 0].module)
    assert {"encoder.layers.0", "encoder.layers.1", "head"} <= fused
    assert not any(name.startswith("encoder.layers.0.") for name in fused)
    for batch in (1, 2):
        assert "encoder.layers.1.linear2" in set(frames[frames.batch == batch].module)
    # Copies and the model after close keep no forward of ours.
    assert not any("forward" in module.__dict__ for module in copied.modules())
    assert not any("forward" in module.__dict__ for module in model.modules())
    with torch.no_grad():
        assert torch.equal(copied.eval()(x, padding), expected)


def _wrap_forward_as_accelerate_does(module: nn.Module) -> None:
    """accelerate's add_hook_to_module: the current forward kept as ``_old_forward``, an
    instance-level forward calling it."""
    module._old_forward = module.forward
    module.forward = functools.partial(_new_forward, module)


def _new_forward(module: nn.Module, *args, **kwargs):
    return module._old_forward(*args, **kwargs)


def test_a_forward_wrapper_set_while_watched_keeps_no_watch_in_copies_nor_after_close():
    # A wrapper set after watch() kept the watch's stand-in forward: its deep copy computed
    # with the original's weights, and after close torch.save(layer) failed (a weakref).
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    x, padding = _padded_batch()
    w = nw.watch(layer)
    _wrap_forward_as_accelerate_does(layer)
    copied = copy.deepcopy(layer)
    with torch.no_grad():
        copied.linear2.bias.add_(1.0)
        assert not torch.equal(copied(x, src_key_padding_mask=padding),
                               layer(x, src_key_padding_mask=padding))
        expected = layer(x, src_key_padding_mask=padding)
    w.close()
    layer.forward = layer._old_forward  # accelerate's remove_hook_from_module
    del layer._old_forward
    # What accelerate leaves unwatched too: the layer's own forward, bound.
    assert layer.forward.__func__ is nn.TransformerEncoderLayer.forward
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(x, src_key_padding_mask=padding), expected)


def test_sentinel_replays_an_encoder_layer_on_its_fused_path_and_tells_the_masked_row():
    # The replay hooked every module without keeping the layers' fused path: it took the
    # modules' path, which stays finite, and the event read "unknown ... not reproduced".
    model = _Encoder().eval()
    x, padding = _padded_batch()
    padding[1] = True
    with nw.watch(model, mode="sentinel", on_nan="record") as w, torch.no_grad():
        model(x, padding)
    assert w.event.diagnosis.kind == "masked-row"
    assert not any("forward" in module.__dict__ for module in model.modules())

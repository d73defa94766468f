"""torch.compile'd models: watched in sentinel mode with no graph break and no recompile, replayed
eagerly on a NaN, and the two ways of watching them wrongly refused with a pointer to the right
one. Compiling is slow on 2 CPU cores: one small transformer is compiled once for the module
(forward and train step), and one small MLP in place."""

from __future__ import annotations

import copy
import warnings

import pandas as pd
import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import nanwidget as nw

from conftest import TinyMLP, hook_count

pytestmark = pytest.mark.slow


class SmallTransformer(nn.Module):
    """A transformer block between two linears; ``compiled_scale`` (a plain tensor attribute,
    not a buffer) multiplies only in compiled code (``torch.compiler.is_compiling()``): a
    stand-in for compiled kernels that compute differently from eager PyTorch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 4)
        self.compiled_scale = torch.ones(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(x))
        if torch.compiler.is_compiling():
            h = h * self.compiled_scale
        return self.head(h)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def _dynamo_state() -> dict:
    """What changes when Dynamo compiles, recompiles or breaks a graph."""
    return {"graphs": counters["stats"].get("unique_graphs", 0),
            "frames": counters["frames"].get("total", 0),
            "breaks": sum(counters["graph_break"].values())}


@pytest.fixture(scope="module")
def compiled():
    """(eager model, compiled model, input, optimizer), compiled for a no-grad forward and a
    train step before any test watches it."""
    torch.manual_seed(0)
    model = SmallTransformer()
    compiled_model = torch.compile(model)
    x = torch.randn(2, 5, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with torch.no_grad():
        compiled_model(x)
    _train_step(compiled_model, optimizer, x)
    _train_step(compiled_model, optimizer, x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    yield model, compiled_model, x, optimizer
    model.load_state_dict(state)


@pytest.fixture
def fresh(compiled):
    """The compiled model with its weights as compiled, restored after each test."""
    model, compiled_model, x, optimizer = compiled
    state = {k: v.clone() for k, v in model.state_dict().items()}
    yield model, compiled_model, x, optimizer
    with torch.no_grad():
        model.load_state_dict(state)
    assert hook_count(compiled_model) == 0


def test_a_compiled_model_is_watched_in_sentinel_mode_with_a_one_line_note(fresh):
    _, compiled_model, _, _ = fresh
    with pytest.warns(UserWarning, match="watching a torch.compile'd model in sentinel mode"):
        w = nw.watch(compiled_model)
    with w:
        assert w.mode == "sentinel" and w.compiled == "wrapper"
        # The user's own names (no "_orig_mod." prefix); hooks on the wrapper only.
        assert w.module_names[:3] == ["", "embed", "block"]
        assert hook_count(compiled_model._orig_mod) == 0


def test_the_watch_adds_no_graph_break_and_no_recompile_forward_and_train(fresh):
    model, compiled_model, x, optimizer = fresh
    before = _dynamo_state()
    with nw.watch(compiled_model, mode="sentinel", backward=True, sample_every=3) as w:
        for _ in range(4):
            _train_step(compiled_model, optimizer, x)
            with torch.no_grad():
                compiled_model(x)
        assert w.parts.sentinel.checks == 8 and w.parts.sentinel.grad_checks == 4
        history = w.history()
        # every batch: the root's outputs as the check read them; sampled ones by eager replays
        assert sorted(set(history["batch"])) == list(range(8))
        assert sorted(set(history.loc[history["module"] != "", "batch"])) == [0, 3, 6]
        assert not history.duplicated(["batch", "module"]).any()
    assert _dynamo_state() == before


def test_a_nan_is_replayed_eagerly_and_named_as_full_mode_names_it_on_the_eager_model(fresh):
    model, compiled_model, x, _ = fresh
    before = _dynamo_state()
    with nw.watch(compiled_model, mode="sentinel", on_nan="record") as w:
        with torch.no_grad():
            compiled_model(x)
            model.block.linear1.weight[3, 2] = float("nan")
            compiled_model(x)
    assert _dynamo_state() == before
    event = w.event
    with torch.no_grad(), nw.watch(model, on_nan="record") as eager:
        model(x)
    expected = eager.event
    for field in ("module", "module_type", "call", "role", "kind", "origin"):
        assert getattr(event, field) == getattr(expected, field), field
    assert (event.batch, event.module, event.origin) == (1, "block.linear1", "weight")
    own = event.frames[event.frames["batch"] == 1].drop(columns="batch").reset_index(drop=True)
    pd.testing.assert_frame_equal(own, expected.frames.drop(columns="batch").reset_index(drop=True))
    # The NaN came with a weight, so no op made it; the replay met the event again.
    assert event.trace.first_bad is None and event.trace.reproduced


def test_a_backward_nan_in_a_compiled_train_step_is_replayed_from_the_output_gradients(fresh):
    model, compiled_model, x, optimizer = fresh
    with nw.watch(compiled_model, mode="sentinel", backward=True) as w:
        _train_step(compiled_model, optimizer, x)
        optimizer.zero_grad()
        out = compiled_model(x)
        # log(0) in the branch where() discards: a finite loss whose gradient is NaN.
        loss = torch.where(out > 1e9, (out * 0).log(), out).mean()
        with pytest.raises(nw.NanDetected) as caught:
            loss.backward()
    event = caught.value.event
    assert event.is_backward and event.origin == "grad" and event.batch == 1
    # As full mode names it: the innermost module whose output received the NaN gradient.
    assert event.module == "head" and event.role == "grad_output[0]"
    assert set(event.trace.frames["phase"]) == {"forward", "backward"}
    assert set(event.frames["batch"]) == {1}
    assert event.frames_note.endswith("with backward=True its backward frames would be needed too")
    assert w.parts.sentinel.replays == 1


def test_a_nan_only_the_compiled_kernels_make_is_reported_as_not_reproduced(fresh):
    model, compiled_model, x, _ = fresh
    before = _dynamo_state()
    with nw.watch(compiled_model, mode="sentinel", on_nan="record") as w:
        with torch.no_grad():
            compiled_model(x)
            model.compiled_scale.fill_(float("inf"))
            compiled_model(x)
            model.compiled_scale.fill_(1.0)
            compiled_model(x)  # the re-run restored everything: the next batch is clean
    assert _dynamo_state() == before
    assert len(w.events) == 1
    event = w.event
    assert (event.batch, event.module, event.role, event.origin) == (1, "", "output", "output")
    assert event.note.startswith("not reproduced by an eager replay of batch 1: its ")
    assert ("the compiled model, re-run on the same batch, makes it again (output: nan), so its "
            "compiled kernels compute differently from eager PyTorch") in event.note
    assert event.note in w.report() and event.trace.first_bad is None
    assert not event.trace.reproduced and "Not reproduced: the recorded event" in w.report()


def test_direct_calls_of_the_original_module_count_only_while_their_hooks_are_attached(fresh):
    model, compiled_model, x, optimizer = fresh
    before = _dynamo_state()
    with nw.watch(compiled_model, mode="sentinel", on_nan="record") as w:
        recorder = w.recorder
        with torch.no_grad():
            compiled_model(x)
            model(x)  # a direct call: unseen, as before
            assert (w.batch, w.parts.sentinel.checks) == (1, 1)
            assert recorder.attach_direct_call_hooks() and recorder.attach_direct_call_hooks()
            assert hook_count(model) == 2  # the root's two hooks, once
            model(x)
            assert (w.batch, recorder.direct_call, w.parts.sentinel.checks) == (2, True, 2)
            saved = model.block.linear1.weight[3, 2].item()
            model.block.linear1.weight[3, 2] = float("nan")
            model(x)
            model.block.linear1.weight[3, 2] = saved
        # Named by the eager replay exactly as a compiled call's NaN is.
        event = w.event
        assert (event.batch, event.module, event.origin, event.role) == (2, "block.linear1",
                                                                         "weight", "weight")
        # Replayed: batch 2, and the direct call of batch 1 for the frames before it, whose
        # weights changed since (the NaN was written in between), as for compiled calls.
        assert event.trace.reproduced and w.parts.sentinel.replays == 2
        assert event.frames_note.endswith("batch 1 was not recorded and its weights changed "
                                          "since it ran; snapshot_weights=True keeps copies")
        recorder.detach_direct_call_hooks()
        assert hook_count(model) == 0 and not recorder.direct_call_hooks_attached
        with torch.no_grad():
            model(x)
        assert w.batch == 3
        # The wrapper's next call takes them off before its compiled code runs.
        recorder.attach_direct_call_hooks()
        _train_step(compiled_model, optimizer, x)
        assert hook_count(model) == 0 and (w.batch, recorder.direct_call) == (4, False)
        recorder.attach_direct_call_hooks()
    assert hook_count(model) == 0  # close() removed them
    assert len(w.events) == 1 and _dynamo_state() == before


class _Flaky(nn.Sequential):
    """NaN out of one call once ``poisoned`` is set: state that an eager replay does not restore."""

    poisoned = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.poisoned:
            self.poisoned = False
            return out * float("nan")
        return out


def test_compiling_while_direct_call_hooks_are_attached_neither_traces_nor_reruns_them():
    model = _Flaky(nn.Linear(16, 8), nn.ReLU())  # a class of its own: compiled afresh here
    compiled_model = torch.compile(model, backend="eager")
    x = torch.randn(4, 16)
    before = _dynamo_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sentinel-mode note
        w = nw.watch(compiled_model, on_nan="record")
    with w, torch.no_grad():
        w.recorder.attach_direct_call_hooks()
        model(x)
        compiled_model(x)  # compiles now: the hooks on the model came off first
        assert _dynamo_state()["graphs"] > before["graphs"]
        assert _dynamo_state()["breaks"] == before["breaks"]
        assert hook_count(model) == 0 and w.batch == 2 and w.event is None
        # A direct call's NaN that the eager replay does not meet again: no compiled re-run.
        w.recorder.attach_direct_call_hooks()
        model.poisoned = True
        model(x)
    event = w.event
    assert (event.batch, event.module, event.origin) == (2, "", "output")
    assert event.note.endswith("the batch ran eagerly (a direct call of the original module), "
                               "so no compiled re-run applies")
    assert hook_count(compiled_model) == 0


def test_watching_the_original_module_of_a_compiled_model_is_refused_at_the_first_call(fresh):
    model, compiled_model, x, _ = fresh
    with nw.watch(compiled_model._orig_mod) as w:
        with pytest.raises(nw.CompiledCallError, match=r"you watched cm._orig_mod .*nw.watch\("
                                                       r"compiled_model\)"):
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Dynamo's own notes on the hook it met
                compiled_model(x)
        assert w.events == []
    assert hook_count(model) == 0


def test_watching_before_compiling_is_refused_before_dynamo_traces_the_hooks():
    torch.manual_seed(0)
    model = TinyMLP()
    w = nw.watch(model)
    try:
        compiled_model = torch.compile(model)
        before = _dynamo_state()
        with pytest.raises(nw.CompiledCallError, match="compiled the model after nw.watch"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled_model(torch.randn(2, 16))
        assert _dynamo_state()["graphs"] == before["graphs"]  # the model's forward never compiled
    finally:
        w.close()


def _counting_backend(runs: list[int]):
    """A Dynamo backend whose compiled graphs count their runs in ``runs[0]``."""
    def compile_graph(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        def run(*args: object) -> object:
            runs[0] += 1
            return graph.forward(*args)
        return run
    return compile_graph


def _small_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def test_a_refused_compile_of_a_watched_sequential_leaves_later_compiles_compiled():
    runs = [0]
    x = torch.randn(6, 5)
    model = _small_sequential()
    w = nw.watch(model)
    compiled_model = torch.compile(model, backend=_counting_backend(runs))
    try:
        with pytest.raises(nw.CompiledCallError, match=r"compiled the model after nw.watch\(\)"
                                                       r".*w = nw.watch\(compiled_model\)"):
            compiled_model(x)
    finally:
        w.close()
    # The advice followed: the compiled model watched itself runs its compiled graph.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sentinel-mode note
        with nw.watch(compiled_model) as advised:
            compiled_model(x)
    assert runs == [1] and advised.batch == 1
    # And a container never watched, compiled afterwards, is compiled too.
    other = torch.compile(_small_sequential(), backend=_counting_backend(runs))
    other(x)
    assert runs == [2]


def test_compiling_after_the_watch_is_refused_when_another_sequential_was_compiled_before():
    x = torch.randn(6, 5)
    earlier = torch.compile(_small_sequential(), backend="eager")
    earlier(x)  # compiled code the watched model's compiled call could reuse, hooks unseen
    model = _small_sequential()
    w = nw.watch(model, on_nan="record")
    try:
        assert "forward" not in vars(copy.deepcopy(model))  # a copy is not marked as watched
        compiled_model = torch.compile(model, backend="eager")
        bad = x.clone()
        bad[0, 0] = float("nan")
        with pytest.raises(nw.CompiledCallError, match="compiled the model after nw.watch"):
            compiled_model(bad)
    finally:
        w.close()
    assert "forward" not in vars(model) and hook_count(model) == 0


def test_a_model_compiled_in_place_is_watched_without_recompiling_and_replayed():
    torch.manual_seed(0)
    model = TinyMLP()
    model.compile()
    x = torch.randn(4, 16)
    with torch.no_grad():
        model(x)
    before = _dynamo_state()
    with pytest.warns(UserWarning, match=r"compiled in place \(module.compile\(\)\)"):
        w = nw.watch(model, on_nan="record")
    with w, torch.no_grad():
        model(x)
        model.fc2.bias[1] = float("inf")
        model(x)
    assert _dynamo_state() == before
    assert (w.event.batch, w.event.module, w.event.role, w.event.origin) == (1, "fc2", "bias",
                                                                              "weight")
    assert hook_count(model) == 0
    # compile() after nw.watch(): the hooks would run inside compiled code.
    other = TinyMLP()
    with nw.watch(other) as late:
        other.compile()
        with pytest.raises(nw.CompiledCallError, match="module.compile\\(\\) after nw.watch"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                other(x)
        assert late.events == []



def _train_step_of(model: nn.Module):
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss
    return step


def _train_steps(step, model: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each batch's loss and parameter gradients, in one list."""
    results = []
    for x in batches:
        model.zero_grad()
        results.append(step(x).detach())
        results.extend(p.grad.clone() for p in model.parameters())
    return results


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_compiled_function_calling_a_watched_model_runs_the_hooks_eagerly(mode):
    # A compiled train step calling the watched model made Dynamo trace the hooks: dozens
    # of graphs, breaks inside nanwidget and warnings about its internals ("Dynamo does not
    # know how to trace the builtin `_nanwidget_entry.contiguous_range`", `_thread.get_ident`).
    torch.manual_seed(0)
    # A class of its own per test: Dynamo reuses code compiled for another model of the class.
    model = type(f"MLP_{mode}", (TinyMLP,), {})()
    unwatched = copy.deepcopy(model)
    batches = [torch.randn(4, 16) for _ in range(3)]
    batches[2][1, 3] = float("nan")
    expected = _train_steps(_train_step_of(unwatched), unwatched, batches)  # eager, no watch
    graphs, breaks_before = _dynamo_state()["graphs"], dict(counters["graph_break"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, mode=mode, backward=True, on_nan="record") as w:
            # A train step compiled as a function (what Keras 3's jit_compile=True makes):
            # Dynamo traces the model's call where the step calls it.
            step = torch.compile(_train_step_of(model), backend="eager")
            results = _train_steps(step, model, batches)
            assert w.batch == 3
    assert [str(c.message) for c in caught] == []
    # Bit-identical to the unwatched model's, NaN batch included.
    for got, want in zip(results, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # Dynamo breaks its graph where it meets a hook (and at the step's own backward call),
    # never inside nanwidget's code.
    breaks = {reason: count - breaks_before.get(reason, 0)
              for reason, count in counters["graph_break"].items()
              if count > breaks_before.get(reason, 0)}
    assert [reason for reason in breaks if "nanwidget's hooks run eagerly" not in reason
            and "backward" not in reason] == []
    assert _dynamo_state()["graphs"] - graphs <= (5 if mode == "full" else 2)
    # The events an eager run of the model gives.
    with nw.watch(unwatched, mode=mode, backward=True, on_nan="record") as eager:
        _train_steps(_train_step_of(unwatched), unwatched, batches)

    def described(events: list) -> list[tuple]:
        return [(e.batch, e.module, e.call, e.role, e.kind, e.origin) for e in events]
    assert described(w.events) == described(eager.events)
    assert described(w.events)[0] == (2, "fc1", 0, "input[0]", "nan", "input")
    assert hook_count(model) == 0


def _weights_written_nan(model: nn.Module) -> None:
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("nan")


def _described(events: list) -> list[tuple]:
    return [(e.batch, e.module, e.role, e.origin) for e in events]


@pytest.mark.parametrize("mode, backward", [("full", False), ("sentinel", True)])
def test_a_function_compiled_before_the_watch_runs_the_model_with_its_hooks(mode, backward):
    # A notebook cell compiled the train step, then the model was watched: Dynamo's code,
    # compiled without hooks and never guarding on them, kept running, and the watch saw
    # nothing (0 batches) of a NaN weight.
    torch.manual_seed(0)
    model = type(f"EarlyMLP_{mode}", (TinyMLP,), {})()
    unwatched = copy.deepcopy(model)
    batches = [torch.randn(4, 16) for _ in range(2)]
    step = torch.compile(_train_step_of(model), backend="eager")
    expected = _train_steps(_train_step_of(unwatched), unwatched, batches)
    _train_steps(step, model, batches[:1])  # compiled before the watch, without hooks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's notes on the graph breaks at the hooks
        with nw.watch(model, mode=mode, backward=backward, on_nan="record") as w:
            results = _train_steps(step, model, batches)
            assert "forward" not in vars(copy.deepcopy(model))  # a copy is not watched
            _weights_written_nan(model)
            step(batches[0])
        # Watched again after close: code compiled during the first watch calls the hooks
        # of this one, not the first's.
        with nw.watch(model, mode=mode, backward=backward, on_nan="record") as again:
            step(batches[1])
    assert w.batch == 3 and again.batch == 1
    for got, want in zip(results, expected, strict=True):  # bit-identical to an unwatched run
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _described(w.events)[0] == (2, "fc1", "weight", "weight")
    assert _described(again.events)[0] == (0, "fc1", "weight", "weight")
    assert hook_count(model) == 0
    assert [name for name, module in model.named_modules() if "forward" in vars(module)] == []


def test_a_function_compiled_before_the_watch_calling_a_submodule_runs_its_hooks():
    # A function calling model.fc1, compiled before the watch, ran fc1 without its hooks: the
    # watch stayed blind to its NaN weight.
    torch.manual_seed(0)
    model = type("EarlySubmoduleMLP", (TinyMLP,), {})()
    x = torch.randn(4, 16)
    compiled = torch.compile(lambda inputs: model.fc1(inputs).sum(), backend="eager")
    with torch.no_grad():
        compiled(x)
    _weights_written_nan(model)
    for run in (compiled, lambda inputs: model.fc1(inputs).sum()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with nw.watch(model, on_nan="record") as w, torch.no_grad():
                run(x)
        # What an eager call of the submodule gives: a pass of its own, the NaN weight found.
        assert _described(w.events) == [(0, "fc1", "weight", "weight")]
    assert hook_count(model) == 0


@pytest.mark.parametrize("compiled_when", ["before", "after"])
def test_a_compiled_submodule_is_watched_as_that_module(compiled_when):
    # torch.compile(model.fc1) was taken for another model sharing fc1 (its calls none of the
    # watch's business): a NaN weight in fc1 went unseen, compiled before the watch or after.
    torch.manual_seed(0)
    model = type(f"CompiledPartMLP_{compiled_when}", (TinyMLP,), {})()
    x = torch.randn(4, 16)
    compiled_fc1 = None
    if compiled_when == "before":
        compiled_fc1 = torch.compile(model.fc1, backend="eager")
        with torch.no_grad():
            compiled_fc1(x)
    _weights_written_nan(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw.watch(model, on_nan="record") as w, torch.no_grad():
            if compiled_fc1 is None:
                compiled_fc1 = torch.compile(model.fc1, backend="eager")
            compiled_fc1(x)
    # As an eager call of fc1 gives it.
    assert _described(w.events) == [(0, "fc1", "weight", "weight")]
    assert hook_count(model) == 0

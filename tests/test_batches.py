"""Batch boundaries: every frame in its own batch (checkpointing, recursion, threads, numbering)."""

from __future__ import annotations

import contextlib
import warnings
import threading

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import nanwidget as nw
from nanwidget.core.replay import BatchNotHeldError
from tests.conftest import TinyMLP, hook_count


class CheckpointedEncoder(nn.Module):
    """A small transformer encoder whose layers run under torch.utils.checkpoint."""

    def __init__(self, reentrant: bool | None, sqrt_trap: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant  # None: no checkpointing (the reference)
        self.embed = nn.Linear(6, 16)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.trap = SqrtOfRelu() if sqrt_trap else nn.Identity()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h) if self.reentrant is None else \
                checkpoint(layer, h, use_reentrant=self.reentrant)
        h = h if self.reentrant is None else checkpoint(self.trap, h, use_reentrant=self.reentrant)
        return self.head(h if self.reentrant is not None else self.trap(h))


class SqrtOfRelu(nn.Module):
    """relu then sqrt: finite forward, infinite gradient at ReLU's exact zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()
        self.sqrt = Sqrt()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sqrt(self.act(x))


class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


def _train(model: nn.Module, batches: int, **watch_options) -> tuple[nw.NanWatch, pd.DataFrame]:
    torch.manual_seed(1)
    data = [torch.randn(3, 5, 6) for _ in range(batches)]
    with nw.watch(model, max_frames=10_000, on_nan="record", **watch_options) as w:
        for x in data:
            model.zero_grad()
            model(x).pow(2).mean().backward()
        frames = w.frames()
    return w, frames


def _calls(frames: pd.DataFrame, phase: str) -> list[tuple]:
    rows = frames[frames.phase == phase].drop_duplicates(["batch", "frame"])
    return sorted(map(tuple, rows[["batch", "module", "call"]].values.tolist()))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint_recomputation_stays_out_of_the_next_batch(reentrant: bool) -> None:
    torch.manual_seed(0)
    reference = CheckpointedEncoder(reentrant=None)
    model = CheckpointedEncoder(reentrant=reentrant)
    model.load_state_dict(reference.state_dict())
    w, frames = _train(model, 3)
    _, expected = _train(reference, 3)
    assert w.batch == 3 and w.interrupted_batches == []
    # Recomputed forwards (during each batch's backward) are not recorded again: every batch
    # holds exactly the forward calls of the unchecked model, each module's first call is 0.
    assert _calls(frames, "forward") == _calls(expected, "forward")
    first = frames[(frames.batch == 1) & (frames.phase == "forward")].sort_values("frame").iloc[0]
    assert (first.module, first.call, first.frame) == ("embed", 0, 0)
    # And the values are those of the real forward.
    columns = ["batch", "module", "call", "role", "abs_max"]
    pd.testing.assert_frame_equal(
        frames[frames.phase == "forward"][columns].reset_index(drop=True),
        expected[expected.phase == "forward"][columns].reset_index(drop=True), rtol=1e-5)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_modules_get_one_backward_frame_in_the_batch_that_built_the_graph(
        reentrant: bool) -> None:
    torch.manual_seed(0)
    reference = CheckpointedEncoder(reentrant=None)
    model = CheckpointedEncoder(reentrant=reentrant)
    model.load_state_dict(reference.state_dict())
    w, frames = _train(model, 2, backward=True)
    _, expected = _train(reference, 2, backward=True)
    assert _calls(frames, "backward") == _calls(expected, "backward")
    backward = frames[frames.phase == "backward"]
    forward = frames[frames.phase == "forward"]
    for batch in (0, 1):  # numbered after the forward frames of their own batch
        assert backward[backward.batch == batch].frame.min() > \
            forward[forward.batch == batch].frame.max()
    # A layer inside the checkpoint: its output gradient is the real one.
    key = ["batch", "module", "call", "role"]
    mine = backward.set_index(key)["abs_max"].sort_index()
    theirs = expected[expected.phase == "backward"].set_index(key)["abs_max"].sort_index()
    pd.testing.assert_series_equal(mine, theirs, rtol=1e-5)
    assert w.events == []


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_nan_born_in_a_checkpointed_backward_is_blamed_in_its_own_batch(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = CheckpointedEncoder(reentrant=reentrant, sqrt_trap=True)
    with nw.watch(model, backward=True) as w:
        with pytest.raises(nw.NanDetected) as caught:
            model(torch.randn(3, 5, 6)).sum().backward()
        assert w.batch == 1
    event = caught.value.event
    assert (event.batch, event.module, event.role, event.origin) == (
        0, "trap.sqrt", "grad_input[0]", "grad")
    assert event.call == 0
    assert hook_count(model) == 0


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_replay_through_checkpointed_modules_records_each_forward_once_and_blames_the_maker(
        reentrant: bool) -> None:
    def replayed(model: nn.Module) -> nw.Trace:
        with nw.watch(model, backward=True, on_nan="record", replay_on_nan=True,
                      loss_fn=lambda output: output.sum()) as w:
            model(x).sum().backward()
        return w.event.trace

    torch.manual_seed(0)
    reference = CheckpointedEncoder(reentrant=None, sqrt_trap=True)
    model = CheckpointedEncoder(reentrant=reentrant, sqrt_trap=True)
    model.load_state_dict(reference.state_dict())
    x = torch.randn(3, 5, 6)
    trace, expected = replayed(model), replayed(reference)
    # The replay's backward recomputes the checkpointed layers: no second forward frame.
    assert _calls(trace.frames, "forward") == _calls(expected.frames, "forward")
    assert _calls(trace.frames, "backward") == _calls(expected.frames, "backward")
    # Reentrant checkpointing backpropagates through the recomputed graph: still the sqrt.
    assert trace.reproduced
    assert (trace.first_bad["op"], trace.first_bad["module"]) == ("div", "trap.sqrt")


class RecursiveTree(nn.Module):
    """Applies itself to its own output ``depth`` times: a root module that calls itself."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(8, 8)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor, depth: int = 3) -> torch.Tensor:
        h = self.act(self.cell(x))
        return h if depth == 0 else self(h, depth - 1)


def test_a_root_module_calling_itself_is_one_batch_per_outer_call() -> None:
    model = RecursiveTree()
    with nw.watch(model, max_frames=1000, abort_after=1) as w:
        model(torch.randn(2, 8))
        with pytest.raises(nw.AbortAfterBatch):
            model(torch.randn(2, 8))
        frames = w.frames()
    assert w.batch == 2
    kept = frames.drop_duplicates(["batch", "frame"])
    for batch in (0, 1):
        rows = kept[kept.batch == batch]
        assert sorted(rows[rows.module == ""].call) == [0, 1, 2, 3]
        assert sorted(rows[rows.module == "cell"].call) == [0, 1, 2, 3]
        # The outermost call returns last: its frame closes the batch.
        assert rows.sort_values("frame").iloc[-1][["module", "call"]].tolist() == ["", 3]


def test_one_model_from_two_threads_never_mixes_their_frames_in_a_batch() -> None:
    model = TinyMLP()
    done = {2: 0, 3: 0}  # batch size -> forwards recorded (each thread uses its own size)
    refused = {2: 0, 3: 0}
    errors: list[BaseException] = []
    target = 500

    def run(size: int) -> None:
        x = torch.randn(size, 16)
        try:
            while done[size] < target:
                try:
                    model(x)
                    done[size] += 1
                except nw.ConcurrentForwardError:
                    refused[size] += 1
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    with nw.watch(model, max_frames=6 * 2 * target) as w:
        threads = [threading.Thread(target=run, args=(size,)) for size in (2, 3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        frames = w.frames()
    assert not errors
    assert w.batch == 2 * target == frames.batch.nunique()
    inputs = frames[frames.role == "input[0]"]
    sizes = inputs.assign(size=inputs["shape"].map(lambda shape: shape[0]))
    per_batch = sizes.groupby("batch")["size"].nunique()
    assert (per_batch == 1).all()  # one thread's frames per batch, never both
    assert set(frames.groupby("batch")["frame"].nunique()) == {6}  # whole forwards only
    assert sizes.drop_duplicates("batch")["size"].value_counts().to_dict() == {2: target, 3: target}


def test_abort_after_fires_at_the_first_forward_past_it_with_set_batch() -> None:
    model = TinyMLP()
    x = torch.randn(4, 16)
    with nw.watch(model, abort_after=5, max_frames=1000) as w:
        started = []
        with pytest.raises(nw.AbortAfterBatch) as caught:
            for batch in (0, 4, 8, 12):  # gradient accumulation numbering: 4 forwards a batch
                w.set_batch(batch)
                started.append(batch)
                for _ in range(4):
                    model(x)
        frames = w.frames()
    # Batch 4 is not past 5: its four forwards ran; the first forward of batch 8 is past it.
    assert caught.value.batch == 8 and caught.value.abort_after == 5
    assert started == [0, 4, 8] and w.batch == 8
    assert frames.groupby("batch")["frame"].nunique().to_dict() == {0: 24, 4: 24, 8: 6}


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_abort_after_fires_at_the_end_of_a_forward_numbered_past_it(mode) -> None:
    model = TinyMLP()
    x = torch.randn(4, 16)
    with nw.watch(model, abort_after=1, mode=mode) as w:
        w.set_batch(0)
        model(x)
        w.set_batch(2)  # batch 0 ended, below 1: no abort at this boundary
        with pytest.raises(nw.AbortAfterBatch) as caught:
            model(x)  # a forward in batch 2, past 1: transformers stops here too
        assert caught.value.batch == 2 and caught.value.abort_after == 1
        model(x)  # raised once


def test_abort_after_a_set_batch_boundary_at_or_past_it_still_fires() -> None:
    model = TinyMLP()
    with nw.watch(model, abort_after=1) as w:
        w.set_batch(1)
        model(torch.randn(4, 16))  # batch 1 is not past 1: it may have more forwards
        with pytest.raises(nw.AbortAfterBatch) as caught:
            w.set_batch(2)
    assert caught.value.batch == 1


def test_step_after_each_forward_numbers_batches_without_a_gap_and_aborts() -> None:
    model = TinyMLP()
    with nw.watch(model, abort_after=3, max_frames=100) as w:
        with pytest.raises(nw.AbortAfterBatch) as caught:
            for _ in range(10):
                model(torch.randn(4, 16))
                w.step()
        frames = w.frames()
    assert caught.value.batch == 3
    assert sorted(frames.batch.unique()) == [0, 1, 2, 3]
    assert w.batch == 4


@pytest.mark.parametrize("counter", [np.int64(3), torch.tensor(3)], ids=["numpy", "torch"])
def test_batch_numbers_from_a_loops_counter_are_taken_as_they_come(counter) -> None:
    # A step counter is often a numpy or torch integer (an optimizer's 'step' state is a tensor).
    torch.manual_seed(0)
    model, x = TinyMLP(), torch.randn(2, 16)
    with nw.watch(model, mode="sentinel", on_nan="record") as watched:
        watched.set_batch(counter)
        model(x)
        assert watched.held_batches() == [3]
        trace = watched.replay(counter)
    assert type(watched.batch) is int and watched.batch == 3
    assert trace.frames.batch.unique().tolist() == [3]
    assert watched.history().batch.tolist() == [3]


@pytest.mark.parametrize("value, error, words", [
    (True, TypeError, "a bool"), (1.5, TypeError, "float"), ("3", TypeError, "str"),
    (-1, ValueError, r"at least 0 \(batches count from 0\), got -1")])
def test_a_batch_number_that_is_not_one_is_refused_in_one_line(value, error, words) -> None:
    model = TinyMLP()
    with nw.watch(model) as watched:
        model(torch.randn(2, 16))
        for call in (watched.set_batch, watched.replay):
            with pytest.raises(error, match=words if error is ValueError else f".*{words}"):
                call(value)
        assert watched.batch == 1


class FeaturesAndHead(nn.Module):
    """A model also driven without its forward, as timm's are (model.forward_features(x)):
    each pass calls two watched children directly."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))


def test_a_nan_in_a_pass_without_the_root_forward_stops_that_pass() -> None:
    # model.forward_features(x) never calls the root: the pass is checked when the outermost
    # module running returns (it was only looked at by step(), frames() or close()).
    torch.manual_seed(0)
    model = FeaturesAndHead()
    with torch.no_grad():
        model.blocks[2].weight[0, 0] = float("nan")
    x = torch.randn(4, 6)
    with nw.watch(model, on_nan="raise") as w:
        with pytest.raises(nw.NanDetected, match="module 'blocks.2'"):
            model.forward_features(x)
    with nw.watch(model, on_nan="record") as w:
        for _ in range(3):
            model.forward_features(x)
            assert w.events and w.events[-1].batch == w.batch  # seen at once, in its own pass
        assert [(e.batch, e.module, e.role) for e in w.events] == \
            [(b, "blocks.2", "weight") for b in range(3)]  # one event per pass


class EncodedFirst(nn.Module):
    """An encoder the caller runs once before the forward, which takes its output (what
    generate() does with an encoder-decoder's encoder)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.decoder = nn.Linear(8, 2)

    def forward(self, memory: torch.Tensor) -> torch.Tensor:
        return self.decoder(memory)


def test_a_root_forward_joining_a_pass_that_made_an_event_makes_no_second_one() -> None:
    # The forward got the pass's NaN through its input: a second event of the batch, read
    # "bad-data: it came with the data, not from the model" (on_nan "record" or "warn").
    torch.manual_seed(0)
    model = EncodedFirst()
    with torch.no_grad():
        model.encoder.weight[1, 2] = float("nan")
    with nw.watch(model, on_nan="warn") as w, pytest.warns(nw.NanWarning) as warned:
        model(model.encoder(torch.randn(3, 4)))
    assert [(e.batch, e.module, e.role) for e in w.events] == [(0, "encoder", "weight")]
    assert len([x for x in warned if issubclass(x.category, nw.NanWarning)]) == 1
    assert w.event.diagnosis.kind == "corrupted-weight"


def test_a_replay_of_a_pass_without_the_root_forward_says_why_it_cannot_run() -> None:
    # Such a pass's inputs were never held (they are taken when the root's forward starts):
    # the error advised keep_batches=N, and replay_on_nan left no trace without a word.
    torch.manual_seed(0)
    model = FeaturesAndHead()
    with torch.no_grad():
        model.blocks[2].weight[0, 0] = float("nan")
    with nw.watch(model, on_nan="record", replay_on_nan=True, keep_batches=8) as w:
        model.forward_features(torch.randn(4, 6))
        event = w.event
        assert event.trace is None and event.note.startswith("not replayed: the batch ran "
                                                             "through another method")
        with pytest.raises(BatchNotHeldError, match="another method than the watched "
                                                       "model's forward") as refused:
            w.replay(event.batch)
        assert "keep_batches" not in str(refused.value)


def test_passes_without_the_root_forward_are_batches_of_their_own() -> None:
    torch.manual_seed(0)
    model = FeaturesAndHead()
    with nw.watch(model) as w:
        with torch.no_grad():
            for scale in (1.0, 10.0, 100.0):
                model.forward_features(torch.full((4, 6), scale))
            model(torch.ones(4, 6))  # a root forward afterwards counts as usual
        history = w.history()
    stem = history[history.module == "stem"].sort_values("batch")
    assert stem.batch.tolist() == [0, 1, 2]
    assert stem.abs_max.is_monotonic_increasing and stem.abs_max.iloc[2] > 50 * stem.abs_max.iloc[0]
    assert set(history[history.module == "head"].batch) == {2}  # the forward ended batch 2
    assert w.batch == 3


class SharedActBlock(nn.Module):
    """ultralytics' ``Conv``: every instance calls the one activation it is handed (its
    ``Conv.default_act`` is a single nn.SiLU shared by every model of the process)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Linear(6, 6)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x))


def _two_models_sharing(act: nn.Module) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return (nn.Sequential(SharedActBlock(act), SharedActBlock(act)),
            nn.Sequential(SharedActBlock(act), SharedActBlock(act)))


def _with_a_nan(x: torch.Tensor) -> torch.Tensor:
    bad = x.clone()
    bad[1, 2] = float("nan")
    return bad


@pytest.mark.parametrize("act", [nn.SiLU, lambda: nn.ReLU(inplace=True)],
                         ids=["silu", "inplace-relu"])
def test_another_models_calls_of_a_shared_module_are_none_of_the_watchs_business(act) -> None:
    # Each call of the shared activation by the unwatched model counted as a batch of the
    # watched one, filled its frames, and a NaN there raised out of the unwatched forward.
    watched, other = _two_models_sharing(act())
    x = torch.randn(4, 6)
    with nw.watch(watched) as w:
        watched(x)
        frames = w.frames()
        other(x)
        other(_with_a_nan(x))  # runs as it would without the watch
        assert w.batch == 1 and w.events == []
        pd.testing.assert_frame_equal(w.frames(), frames)
        assert set(w.history().batch) == {0}
        # The watched model's own calls count as before: its forward, and a part called
        # directly (a pass without the root's forward), NaN included.
        watched(x)
        with pytest.raises(nw.NanDetected, match="batch 2 at module '1.conv'"):
            watched[1](_with_a_nan(x))
        assert w.batch == 2
        # (the shared activation goes by its first name in named_modules(): "0.act")
        assert set(w.frames().query("batch == 2").module) == {"1.conv", "0.act", "1"}


def test_another_models_backward_through_a_shared_module_opens_no_pass_of_the_watch() -> None:
    watched, other = _two_models_sharing(nn.SiLU())
    x = torch.randn(4, 6)
    with nw.watch(watched, backward=True) as w:
        watched(x).sum().backward()
        frames = w.frames()
        (other(x).sum() * float("nan")).backward()  # the other model's NaN gradients
        assert w.batch == 1 and w.events == []
        pd.testing.assert_frame_equal(w.frames(), frames)
        watched(x).sum().backward()
        backward = w.frames().query("batch == 1 and phase == 'backward'")
    assert sorted(backward.query("module == '0.act'").call.unique()) == [0, 1]  # both blocks'


def test_another_model_on_another_thread_may_call_a_shared_module_during_the_forward() -> None:
    # It was refused with ConcurrentForwardError, as if it ran the watched model.
    watched, other = _two_models_sharing(nn.SiLU())
    inside, release = threading.Event(), threading.Event()

    def hold(module, args, output):
        if threading.current_thread() is threading.main_thread():
            inside.set()
            release.wait(10)

    handle = watched[1].conv.register_forward_hook(hold)
    outcome: list[object] = []

    def run_the_other_model():
        inside.wait(10)
        try:
            outcome.append(other(torch.randn(4, 6)).shape)
        except BaseException as error:  # reported below
            outcome.append(error)
        finally:
            release.set()

    with nw.watch(watched) as w:
        thread = threading.Thread(target=run_the_other_model)
        thread.start()
        watched(torch.randn(4, 6))
        thread.join()
        handle.remove()
        frames = w.frames()
    assert outcome == [torch.Size([4, 6])]
    assert w.batch == 1 and sorted(frames.query("module == '0.act'").call.unique()) == [0, 1]


class HoldsTheWatchedModel(nn.Module):
    """A wrapper that drives the watched model's parts itself (not through its forward)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner[1](self.inner[0](x))


def test_a_module_holding_the_watched_model_drives_it_when_it_calls_its_parts() -> None:
    watched, _ = _two_models_sharing(nn.SiLU())
    wrapper = HoldsTheWatchedModel(watched)
    x = torch.randn(4, 6)
    with nw.watch(watched) as w:
        wrapper(x)
        assert w.batch == 0 and set(w.frames().module) >= {"0.conv", "0.act", "1"}
        with pytest.raises(nw.NanDetected, match="at module '0.conv'"):
            wrapper(_with_a_nan(x))


def _shape_pass_on_meta(model: nn.Module) -> torch.Tensor:
    """A data-less pass on meta tensors, weights included (Keras 3 builds its models so before
    fit()): shapes only."""
    weights = {name: tensor.to("meta") for name, tensor in model.state_dict().items()}
    return torch.func.functional_call(model, weights, (torch.empty(8, 16, device="meta"),))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_pass_on_meta_tensors_is_no_batch(mode) -> None:
    torch.manual_seed(0)
    model = TinyMLP()
    x = torch.randn(8, 16)
    x[2, 0] = float("nan")
    with nw.watch(model, mode=mode, on_nan="record", trace_batches=(0,)) as w:
        assert _shape_pass_on_meta(model).is_meta
        assert w.batch == 0 and w.event is None
        model(x)
        model(torch.randn(8, 16))
        assert w.batch == 2
        assert w.event.batch == 0 and w.event.diagnosis.rows == [2]
        traced = w.frames(batch=0)
    assert len(traced) and not (traced["note"] == "meta").any()  # the batch with data


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_abort_after_counts_no_pass_on_meta_tensors(mode) -> None:
    model = TinyMLP()
    with nw.watch(model, mode=mode, abort_after=0) as w:
        _shape_pass_on_meta(model)
        with pytest.raises(nw.AbortAfterBatch):
            model(torch.randn(8, 16))
        assert w.batch == 1


class LogLikelihood(nn.Module):
    def forward(self, probabilities: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return -(targets * torch.log(probabilities)).sum(-1).mean()


class HoldsItsLoss(nn.Module):
    """A classifier holding its loss as a submodule, run on its output in a hand loop
    (``out = model(x); loss = model.loss(out, y)``), as a LightningModule's training_step does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.loss = LogLikelihood()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(x), -1)


def _loss_on(out: torch.Tensor, how: str) -> torch.Tensor:
    return out.clamp(1e-6, 1.0) if how == "derived" else out


@pytest.mark.parametrize("how", ["output", "derived", "no_grad"])
def test_a_loss_the_model_holds_run_on_its_output_is_in_that_forwards_batch(how) -> None:
    # The root's return counts the next batch, so the loss's frames (and its backward's) went
    # to the next batch, and a NaN it made was "batch 3" for the step of batch 2.
    torch.manual_seed(0)
    model = HoldsItsLoss()
    targets = torch.eye(3)[torch.tensor([0, 1, 2, 0])]
    with nw.watch(model, backward=how != "no_grad") as w:
        for batch in range(3):
            with torch.no_grad() if how == "no_grad" else contextlib.nullcontext():
                out = model(torch.randn(4, 4))
                loss = model.loss(_loss_on(out, how), targets)
            if how != "no_grad":
                loss.backward()
            assert w.batch == batch + 1
        model.fc(torch.randn(2, 4))  # not on an output: the next batch's, as before
        frames = w.frames()
    loss_frames = frames[frames.module == "loss"].drop_duplicates(["batch", "frame"])
    phases = ["forward"] if how == "no_grad" else ["forward", "backward"]
    assert list(zip(loss_frames.batch, loss_frames.phase)) == \
        [(batch, phase) for batch in range(3) for phase in phases]
    for batch in range(3):  # after the batch's root forward, in recording order
        mine = frames[(frames.batch == batch) & (frames.phase == "forward")]
        assert mine[mine.module == "loss"].frame.min() > mine[mine.module == ""].frame.max()
    assert set(frames[(frames.module == "fc") & (frames.batch == 3)].phase) == {"forward"}


def test_step_after_a_loss_the_model_holds_numbers_batches_without_a_gap() -> None:
    torch.manual_seed(0)
    model = HoldsItsLoss()
    targets = torch.eye(3)[torch.tensor([0, 1, 2, 0])]
    with nw.watch(model) as w:
        for _ in range(3):
            model.loss(model(torch.randn(4, 4)), targets).backward()
            w.step()
        frames = w.frames()
    assert sorted(set(frames[frames.module == "loss"].batch)) == [0, 1, 2]
    assert sorted(set(frames[frames.module == ""].batch)) == [0, 1, 2]


class OddOutputs(nn.Module):
    """Returns an odd structure (a sparse tensor, an int, None, an empty tensor, a dense one)
    and holds a module that takes anything, called on it after the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.after = TakesAnything()

    def forward(self, x: torch.Tensor) -> dict:
        dense = self.fc(x)
        return {"sparse": dense.detach().to_sparse(), "count": 3, "none": None,
                "empty": dense[:0], "dense": dense}


class TakesAnything(nn.Module):
    def forward(self, *args, **kwargs) -> torch.Tensor:
        return torch.ones(1)


@pytest.mark.parametrize("given", ["sparse", "detached", "meta", "odd"])
def test_calls_after_the_forward_on_odd_values_never_break_and_follow_the_output(given) -> None:
    torch.manual_seed(0)
    model = OddOutputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an internal error would warn
        with nw.watch(model, backward=True) as w:
            out = model(torch.randn(2, 3))
            args = {"sparse": (out["sparse"],), "detached": (out["dense"].detach(),),
                    "meta": (torch.empty(2, device="meta"),),
                    "odd": (None, 3, "text", {"k": [1, 2]}, torch.zeros(0))}[given]
            model.after(*args, flag=True)
            frames = w.frames()
    after = frames[frames.module == "after"]
    # The output's own tensors (its memory, a sparse tensor it holds) follow it; others do not.
    assert set(after.batch) == ({0} if given in ("sparse", "detached") else {1})


class ValuesRaise(dict):
    def values(self):
        raise RuntimeError("a mapping that will not list its values")


class ReturnsAnOddMapping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> dict:
        return ValuesRaise(out=self.fc(x))


def test_an_output_that_cannot_be_followed_after_the_forward_never_breaks_it() -> None:
    # The output's tensors are kept (weakly) for calls made on them after the forward: an
    # output that refuses to list them raised out of the user's forward.
    torch.manual_seed(0)
    model = ReturnsAnOddMapping()
    with nw.watch(model) as w:
        out = model(torch.randn(2, 3))
        assert isinstance(out, ValuesRaise) and w.batch == 1


class ActorCritic(nn.Module):
    """A policy driven as Stable-Baselines3 drives its ``ActorCriticPolicy``: rollouts call
    the forward under no_grad, training calls the parts directly (``evaluate_actions``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.action_net = nn.Linear(8, 2)
        self.value_net = nn.Linear(8, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latent = self.body(obs)
        return self.action_net(latent).argmax(-1), self.value_net(latent)

    def evaluate_actions(self, obs: torch.Tensor, actions: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        latent = self.body(obs)
        log_prob = torch.log_softmax(self.action_net(latent), -1).gather(-1, actions[:, None])
        return self.value_net(latent), log_prob


def _a2c_steps(policy: nn.Module, updates: int, nan_at: int | None) -> None:
    """One rollout step, then one A2C update on it, ``updates`` times; the advantages of
    update ``nan_at`` are normalised over a batch of one (std() of one value: NaN)."""
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    for update in range(updates):
        obs = torch.randn(1, 4)
        with torch.no_grad():
            actions, _ = policy(obs)
        values, log_prob = policy.evaluate_actions(obs, actions)
        advantages = torch.ones(1) - values.detach().flatten()
        if update == nan_at:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        loss = -(advantages * log_prob.flatten()).mean() + (values.flatten() - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_forward_after_a_training_pass_and_its_step_starts_a_batch_of_its_own() -> None:
    # The next rollout's forward joined the training pass's batch, so a weight the step made
    # NaN was told as written "within batch 2, between call 0 and call 1 ... (LBFGS evaluates
    # its closure several times per step; SAM ...)", and its replay ran another forward.
    torch.manual_seed(0)
    policy = ActorCritic()
    with nw.watch(policy, on_nan="record") as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's std() of one value
        _a2c_steps(policy, updates=3, nan_at=1)
        # batches: rollout 0 | training pass 0 | rollout 1 | training pass 1 (NaN loss, NaN
        # step) | rollout 2, the first forward of the NaN weights | training pass 2 (open)
        assert w.batch == 5
        event = w.event
        assert (event.batch, event.module, event.role) == (4, "body.0", "weight")
        diagnosis = event.diagnosis
        assert diagnosis.kind == "corrupted-weight"
        assert "between batch 3 and batch 4" in diagnosis.summary
        assert "LBFGS" not in " ".join([diagnosis.summary, *diagnosis.suggestion])
        trace = w.replay(4)
        assert trace.reproduced  # (the step after it wrote the NaN weights again: changes say so)


def test_a_pass_before_the_step_still_joins_the_forward_after_it() -> None:
    # No optimizer step between them (the critic's values for the advantages, then the
    # training forward): one batch, as before.
    torch.manual_seed(0)
    policy = ActorCritic()
    with nw.watch(policy) as w:
        for _ in range(3):
            obs = torch.randn(2, 4)
            with torch.no_grad():
                policy.value_net(policy.body(obs))
            policy(obs)
        assert w.batch == 3

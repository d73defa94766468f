"""Sentinel mode (``nw.watch(model, mode="sentinel")``): what it checks, what it costs per batch
(hooks, host reads), and that every option works in it as in full mode."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nanwidget as nw
from nanwidget.core import native

from conftest import hook_count


def _batches(count: int = 6, nan_at: int | None = None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 16, generator=generator) for _ in range(count)]
    if nan_at is not None:
        xs[nan_at][2, 5] = float("nan")
    return xs


class HookSpy(nn.Module):
    """Counts the forward hooks on itself each time it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(len(self.fc._forward_hooks))
        return self.fc(x)


def test_normal_batches_run_with_the_two_root_hooks_only(tiny_mlp):
    with nw.watch(tiny_mlp, mode="sentinel") as w:
        assert hook_count(tiny_mlp) == 2  # the root's pre-hook and forward hook
        assert not w.recorder.module_hooks_attached
        outputs = [tiny_mlp(x) for x in _batches()]
        assert w.events == [] and w.batch == 6
        assert w.frames().empty
        history = w.history()
    assert hook_count(tiny_mlp) == 0
    # What the sentinel checked is in the history: the root's outputs, one row per batch.
    assert list(history["module"]) == [""] * 6 and list(history["batch"]) == list(range(6))
    expected = [float(out.detach().abs().max()) for out in outputs]
    assert list(history["abs_max"]) == pytest.approx(expected)
    assert w.parts.sentinel.outputs_abs_max == pytest.approx(expected[-1])
    assert w.parts.sentinel.outputs_dtype == torch.float32 and not history["nonfinite"].any()


def test_a_recording_holds_the_root_rows_the_sentinel_checked(tiny_mlp, tmp_path):
    with nw.watch(tiny_mlp, mode="sentinel", log_dir=str(tmp_path)) as w:
        for x in _batches():
            tiny_mlp(x)
        live = w.history()
    recorded = nw.load_run(str(tmp_path)).history()
    assert list(recorded["batch"]) == list(live["batch"]) == list(range(6))
    assert list(recorded["abs_max"]) == pytest.approx(list(live["abs_max"]))


def test_batches_replayed_for_an_event_keep_one_history_row_per_module(tiny_mlp):
    with nw.watch(tiny_mlp, mode="sentinel", on_nan="record") as w:
        for x in _batches(5, nan_at=4):  # the data goes bad: earlier batches replay as they ran
            tiny_mlp(x)
        history = w.history()
    assert w.event.batch == 4 and set(w.event.frames["batch"]) >= {2, 3, 4}  # replayed context
    assert not history.duplicated(["batch", "module"]).any()
    root = history[history["module"] == ""].set_index("batch")
    assert list(root.index) == [0, 1, 2, 3, 4] and bool(root.loc[4, "nonfinite"])


def test_a_loss_made_outside_the_model_is_seen_only_with_backward():
    """The limit the status line and the README state: a NaN made in the loss reaches no
    output of the model; the gradient check (backward=True) finds it before the step."""
    def train_steps(watch_options):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        with nw.watch(model, mode="sentinel", on_nan="record", **watch_options) as w:
            for step in range(3):
                prediction = model(torch.randn(8, 4))
                loss = (prediction - 1).pow(2).mean().log() if step == 1 else \
                    (prediction - 1).pow(2).mean()
                if step == 1:
                    loss = loss * float("inf")  # the loss alone goes non-finite
                model.zero_grad()
                loss.backward()
        return w
    assert train_steps({}).events == []  # the outputs stayed finite: nothing to see
    caught = train_steps({"backward": True}).events
    assert caught and caught[0].batch == 1 and caught[0].is_backward


class LazyDensity:
    """What a normalizing flow's forward returns (zuko's): no tensor that requires grad, only
    the network and its conditioning input, which log_prob runs later."""

    def __init__(self, net: nn.Module, context: torch.Tensor) -> None:
        self.net = net
        self.context = context

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return -(self.net(self.context) - x).pow(2).sum(-1)


class LazyFlow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, context: torch.Tensor) -> LazyDensity:
        return LazyDensity(self.net, context)


def _parameter_hooks(model: nn.Module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or ()) for p in model.parameters())


def test_gradients_are_checked_before_the_step_when_the_outputs_require_no_grad():
    """A model returning an object whose later use runs its modules (a flow's distribution):
    no output of it receives a gradient, yet its NaN gradients are caught when backward()
    ends, before the optimizer step could spread them into the weights."""
    torch.manual_seed(0)
    flow = LazyFlow()
    optimizer = torch.optim.SGD(flow.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    event = None
    with nw.watch(flow, mode="sentinel", backward=True) as w:
        for step in range(4):
            x, context = torch.randn(8, 3, generator=generator), torch.randn(8, 2,
                                                                           generator=generator)
            if step == 2:
                x[1, 0] = float("nan")  # bad data: only the loss and the gradients see it
            optimizer.zero_grad()
            loss = -flow(context).log_prob(x).mean()
            try:
                loss.backward()
            except nw.NanDetected as error:
                event = error.event
                break
            optimizer.step()
        assert w.parts.sentinel.grad_checks == 3  # one per backward pass
    assert event is not None and (event.batch, event.is_backward, event.origin) == \
        (2, True, "grad")
    assert event.note.startswith("not replayed: no gradient reached the model's outputs")
    assert "loss_fn" in event.note  # what to do to see the op
    assert all(bool(torch.isfinite(p).all()) for p in flow.parameters())  # no step took it
    assert hook_count(flow) == 0  # the parameters' hooks went with the watch


def test_outputs_that_require_grad_need_no_parameter_hooks(tiny_mlp):
    with nw.watch(tiny_mlp, mode="sentinel", backward=True) as w:
        for x in _batches(3):
            tiny_mlp(x).square().mean().backward()
        assert _parameter_hooks(tiny_mlp) == 0 and w.parts.sentinel.grad_checks == 3


def test_sampled_batches_get_module_hooks_for_that_batch_only():
    model = nn.Sequential(HookSpy(), nn.ReLU(), nn.Linear(16, 4))
    with nw.watch(model, mode="sentinel", sample_every=3) as w:
        for x in _batches(7):
            model(x)
        assert model[0].seen == [1, 0, 0, 1, 0, 0, 1]
        history = w.history()
        # every batch has the root's row (what the sentinel checked); sampled ones every module
        assert sorted(history["batch"].unique()) == list(range(7))
        assert sorted(history.loc[history["module"] != "", "batch"].unique()) == [0, 3, 6]
        assert not history.duplicated(["batch", "module"]).any()
        assert set(w.frames()["batch"]) == {0, 3, 6}  # 5 frames each: all in the ring of 21
        assert not w.recorder.module_hooks_attached
    assert hook_count(model) == 0


def test_a_nan_is_caught_and_replayed_into_full_detail(tiny_mlp):
    with nw.watch(tiny_mlp, mode="sentinel") as w:
        with pytest.raises(nw.NanDetected) as caught:
            for x in _batches(nan_at=4):
                tiny_mlp(x)
    event = caught.value.event
    assert (event.batch, event.module, event.role, event.origin) == (4, "fc1", "input[0]", "input")
    assert event.trace is not None and event.trace.batch == 4
    # The event is frame 0 of batch 4: its window of 21 frames reaches back into the batches
    # before it, replayed (frames only) as full mode would have recorded them, as far as
    # they are held (keep_batches=4: batches 1 to 4), and the event says what is missing.
    assert sorted(set(event.frames["batch"])) == [1, 2, 3, 4]
    assert event.frames.groupby(["batch", "frame"]).ngroups == 1 + 3 * 6
    assert w.parts.sentinel.replays == 4  # batch 4 with op tracing, then 3, 2 and 1
    assert event.frames_note == ("sentinel mode: frames before batch 4 not shown; batch 0 "
                                 "was not recorded and it is no longer held for replay")
    assert event.note == "" and f"({event.frames_note})" in w.report()
    assert "Detected inf/nan during batch_number=4" in w.report()


def test_replays_leave_the_model_rng_and_grads_exactly_as_they_were(tiny_mlp):
    optimizer = torch.optim.SGD(tiny_mlp.parameters(), lr=0.1)
    xs = _batches(nan_at=3)
    with nw.watch(tiny_mlp, mode="sentinel", backward=True, on_nan="record") as w:
        for x in xs[:3]:
            optimizer.zero_grad()
            tiny_mlp(x).square().mean().backward()
            optimizer.step()
        state = {k: v.clone() for k, v in tiny_mlp.state_dict().items()}
        grads = [p.grad.clone() for p in tiny_mlp.parameters()]
        rng = torch.get_rng_state()
        tiny_mlp(xs[3])
        assert w.event is not None and w.parts.sentinel.replays >= 1
        assert torch.equal(torch.get_rng_state(), rng)
        for key, value in tiny_mlp.state_dict().items():
            assert torch.equal(value, state[key]), key
        assert all(torch.equal(p.grad, g) for p, g in zip(tiny_mlp.parameters(), grads))


@dataclasses.dataclass
class Pair:
    value: torch.Tensor
    extra: dict


class Structured(nn.Module):
    """Outputs every kind of leaf; the NaN sits deep in the structure."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        h = self.fc(x)
        deep = torch.log(h.amin() + 10.0 - x.abs().amax() * (x.abs().amax() > 100))
        return (h.argmax(-1), h > 0, Pair(value=h, extra={"scores": [h.tanh(), deep.expand(3)]}),
                torch.complex(h, h))


def test_every_float_leaf_of_any_structure_is_checked_and_others_are_skipped():
    model = Structured()
    xs = _batches(4)
    xs[2] = xs[2] * 1000
    with nw.watch(model, mode="sentinel", on_nan="record") as w:
        for x in xs:
            model(x)
    event = w.event
    assert event.batch == 2 and event.module == "" and event.role == "output[2].extra.scores[1]"
    assert event.kind == "nan" and event.origin == "output"


class _CacheLayer:  # a transformers cache layer's shape: tensors beside flags and a device
    def __init__(self, keys: torch.Tensor) -> None:
        self.keys, self.values = keys, keys * 2
        self.is_initialized, self.device, self.dtype = True, keys.device, keys.dtype
        self._hidden = torch.full((2,), float("nan"))  # private: not a leaf


class _Cache:
    def __init__(self, layers: int) -> None:
        self.layers = [_CacheLayer(torch.randn(2, 3)) for _ in range(layers)]
        self.offloading, self.layer_class_to_replicate, self.empty = False, None, []


class _IntFlag(int):  # a subclass of a scalar type: still no tensor in it
    pass


def _walked_by_iter_leaves(output, unread):
    """float_leaves written with the general walk, as the reference."""
    from nanwidget.core.sentinel import checkable
    from nanwidget.core.stats import functorch_unwrapped
    from nanwidget.core.walk import Unread, iter_leaves
    found = []
    for role, leaf in iter_leaves(output, "output"):
        if isinstance(leaf, torch.Tensor):
            values = checkable(functorch_unwrapped(leaf))
            if values is not None and native.storage_holds(values):
                found.append((role, leaf))
        elif isinstance(leaf, Unread):
            unread.append(f"{role} ({leaf.why})")
    return found


def test_the_output_walk_finds_the_leaves_of_the_general_walk_in_its_order():
    from nanwidget.core.sentinel import float_leaves
    t = torch.randn(3)
    loop: list = [t]
    loop.append(loop)
    deep: object = t
    for _ in range(40):  # past the walk's direct depth
        deep = [deep, {"d": torch.ones(1)}]
    freed = torch.randn(4)
    freed.untyped_storage().resize_(0)
    structures = [
        {"logits": t, "cache": _Cache(3), "flag": _IntFlag(1)},
        (t, [None, "s", 2.0, torch.device("cpu"), torch.float16, torch.arange(3)],
         {1: t * 2, (2, 3): [torch.zeros(0), torch.zeros(2, device="meta")], "x": freed}),
        Pair(value=t, extra={"s": {t}, "it": iter([t])}),
        loop, deep, [_Cache(0), torch.complex(t, t), torch.tensor([True])],
    ]
    for structure in structures:
        unread: list[str] = []
        reference_unread: list[str] = []
        walked = [(role, leaf) for role, leaf, _ in float_leaves(structure, unread=unread)]
        reference = _walked_by_iter_leaves(structure, reference_unread)
        assert [role for role, _ in walked] == [role for role, _ in reference]
        assert all(a is b for (_, a), (_, b) in zip(walked, reference))
        assert unread == reference_unread
    roles = [role for role, _, _ in float_leaves(structures[0])]
    assert roles == ["output.logits"] + [f"output.cache.layers[{i}].{name}" for i in range(3)
                                         for name in ("keys", "values")]


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_tensor_output_is_checked(layout):
    class Ragged(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            small = x[1, :2].abs().amax() < 50
            parts = [x[0] * (0.0 if small else float("nan")), x[1, :2] / small]
            return torch.nested.nested_tensor(parts, layout=layout)

    model = Ragged()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, mode="sentinel", on_nan="record") as w:
            model(torch.randn(2, 3))
            model(torch.full((2, 3), 100.0))
    assert [(e.batch, e.kind) for e in w.events] == [(1, "nan+inf")]
    assert not [c for c in caught if "internal error" in str(c.message)]


def test_a_complex_leaf_is_checked_too():
    class Complex(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.complex(x, x / (x.abs().amax() < 50))

    model = Complex()
    with nw.watch(model, mode="sentinel", on_nan="record") as w:
        model(torch.randn(3))
        model(torch.full((3,), 100.0))
    assert [(e.batch, e.kind) for e in w.events] == [(1, "inf")]


def test_gradients_are_checked_after_backward_and_the_step_never_sees_them():
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nw.watch(model, mode="sentinel", backward=True) as w:
        for batch, x in enumerate(_batches(4)):
            optimizer.zero_grad()
            loss = model(x).mean()
            if batch == 2:
                loss = loss * torch.tensor(float("inf"))  # finite forward, Inf gradients
            before = [p.detach().clone() for p in model.parameters()]
            try:
                loss.backward()
            except nw.NanDetected as error:
                event = error.event
                break
            optimizer.step()
    assert event.is_backward and event.origin == "grad" and event.batch == 2
    # As full mode names it: the innermost module whose output received the Inf gradient.
    assert event.module == "1" and event.role == "grad_output[0]"
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # no step taken
    assert w.parts.sentinel.grad_checks == 3


def test_every_backward_end_is_reviewed_also_when_nothing_was_found():
    # The DDP consensus exchanges its flag there on every rank: a rank whose own gradients are
    # finite (FSDP2 shards, no_sync micro-steps) must still reach the exchange.
    from nanwidget.core.recorder import Feature

    class Reviews(Feature):
        def __init__(self) -> None:
            self.reasons: list[tuple[int, str, bool]] = []

        def review_event(self, batch, event, reason):
            self.reasons.append((batch, reason, event is not None))
            return event

    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 1))
    with nw.watch(model, mode="sentinel", backward=True) as w:
        reviews = w.add_feature(Reviews())
        for x in _batches(3):
            model(x).mean().backward()
    assert [r for r in reviews.reasons if r[1] == "backward"] == [
        (0, "backward", False), (1, "backward", False), (2, "backward", False)]


def test_a_feature_that_only_adds_to_events_is_not_asked_about_batches_without_one():
    from nanwidget.core.recorder import Feature

    class Reviews(Feature):
        def __init__(self, without_event: bool) -> None:
            self.reviews_without_event = without_event
            self.seen: list[tuple[int, bool]] = []

        def review_event(self, batch, event, reason):
            self.seen.append((batch, event is not None))
            return event

    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 1))
    with nw.watch(model, mode="sentinel", on_nan="record") as w:
        every, events_only = w.add_feature(Reviews(True)), w.add_feature(Reviews(False))
        model(torch.randn(4, 16))
        model(torch.full((4, 16), float("nan")))
    assert every.seen == [(0, False), (1, True)]
    assert events_only.seen == [(1, True)]


def test_a_nan_that_never_reaches_outputs_or_gradients_is_not_an_event_in_sentinel_mode():
    class BlowUp(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / 0.0

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.blowup = nn.Linear(16, 16), BlowUp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.blowup(self.fc(x))  # Inf inside, dropped before the output
            return torch.where(h.isfinite(), h, torch.zeros_like(h))

    model = Masked()
    with torch.no_grad(), nw.watch(model, mode="sentinel", on_nan="record") as sentinel:
        model(torch.randn(2, 16))
    with torch.no_grad(), nw.watch(model, on_nan="record") as full:
        model(torch.randn(2, 16))
    assert sentinel.events == [] and full.event.module == "blowup"


def test_on_nan_warn_and_record_and_abort_after_work_as_in_full_mode(tiny_mlp):
    with nw.watch(tiny_mlp, mode="sentinel", on_nan="warn") as w:
        with pytest.warns(nw.NanWarning, match="nan in batch 2 at module 'fc1'"):
            for x in _batches(4, nan_at=2):
                tiny_mlp(x)
    assert [e.batch for e in w.events] == [2]
    with nw.watch(tiny_mlp, mode="sentinel", on_nan="record") as w:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for x in _batches(4, nan_at=1):
                tiny_mlp(x)
    assert [e.batch for e in w.events] == [1]
    with nw.watch(tiny_mlp, mode="sentinel", abort_after=2) as w:
        with pytest.raises(nw.AbortAfterBatch):
            for x in _batches(6):
                tiny_mlp(x)
        assert w.batch == 3


def test_trace_batches_keep_every_frame_in_sentinel_mode(tiny_mlp):
    with nw.watch(tiny_mlp, mode="sentinel", trace_batches=[1, 3]) as w:
        for x in _batches(5):
            tiny_mlp(x)
        assert w.recorder.recorded_trace_batches == [1, 3]
        frames = w.frames(batch=3)
        assert list(frames.drop_duplicates("frame")["module"]) == ["fc1", "act", "fc2", "act",
                                                                   "head", ""]


def test_log_dir_holds_the_event_its_trace_and_the_sampled_history(tiny_mlp, tmp_path):
    with nw.watch(tiny_mlp, mode="sentinel", sample_every=2, log_dir=tmp_path / "run",
                  on_nan="record") as w:
        for x in _batches(6, nan_at=5):
            tiny_mlp(x)
        assert w.event is not None
    run = nw.load_run(tmp_path / "run")
    assert [(e.batch, e.module, e.origin) for e in run.events] == [(5, "fc1", "input")]
    assert run.event.trace is not None and not run.event.trace.ops.empty
    # Every module of the sampled batches, of the replayed event batch and of batch 3 (replayed
    # to fill the event's window: the weights had not changed since); the root alone of batch 1,
    # whose outputs the sentinel checked.
    history = run.history()
    assert set(history["batch"]) == {0, 1, 2, 3, 4, 5}
    assert set(history.loc[history["batch"] == 1, "module"]) == {""}
    assert len(set(history.loc[history["batch"] == 3, "module"])) > 1
    assert run.manifests[0]["options"]["mode"] == "sentinel"


class NanOnThirdCall(nn.Module):
    """NaN on its third call only; with ``raise_later``, every later call raises (a replay is
    one of them)."""

    def __init__(self, raise_later: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.calls = 0
        self.raise_later = raise_later

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.raise_later and self.calls > 3:
            raise RuntimeError("external state\nis gone")
        return self.fc(x) * (float("nan") if self.calls == 3 else 1.0)


def test_an_event_the_replay_does_not_reproduce_says_so_plainly():
    model = NanOnThirdCall()
    with nw.watch(model, mode="sentinel", on_nan="record") as w:
        for x in _batches(4):
            model(x)
    event = w.event
    assert (event.batch, event.module, event.role, event.kind) == (2, "", "output", "nan")
    assert event.note.startswith("not reproduced by an eager replay of batch 2: its 2 module "
                                 "frames and ")
    assert "stayed finite" in event.note
    assert event.note in event.summary() and event.note in w.report()
    assert "made here" not in event.summary()
    assert not event.frames.empty and not event.frames["nan"].any()
    assert not event.trace.reproduced and event.trace.expected.startswith("nan in batch 2")


def test_a_replay_that_raises_keeps_the_event_it_was_asked_to_explain_and_says_where_it_stopped():
    model = NanOnThirdCall(raise_later=True)
    with nw.watch(model, mode="sentinel") as w:
        xs = _batches(4)
        model(xs[0])
        model(xs[1])
        with pytest.raises(nw.NanDetected) as caught:
            model(xs[2])
        assert hook_count(model) == 2  # the root's own two: the replay's hooks came off
    event = caught.value.event
    assert w.events == [event]
    assert (event.batch, event.module, event.role, event.kind, event.origin) == \
        (2, "", "output", "nan", "output")
    # The replay ran until the model's code raised: what it checked before that is said.
    assert event.note == ("not reproduced by an eager replay of batch 2: it stopped where the "
                          "forward raised RuntimeError (external state is gone), and its 1 module "
                          "frames and 0 ops before that stayed finite")
    assert event.trace.raised == "the forward raised RuntimeError (external state is gone)"
    assert event.note in w.report()
    # Nothing checked where it was made: the summary does not say "made here".
    assert "output: found in the model's outputs (where it was made was not checked)" \
        in event.summary()


def test_a_backward_replay_that_raises_keeps_the_gradient_event():
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 1))
    calls = []

    def refuse_replays(module: nn.Module, args: tuple) -> None:
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("no second run")

    model[0].register_forward_pre_hook(refuse_replays)
    with nw.watch(model, mode="sentinel", backward=True) as w:
        for batch, x in enumerate(_batches(3)):
            loss = model(x).mean()
            if batch == 2:
                loss = loss * torch.tensor(float("inf"))
            try:
                loss.backward()
            except nw.NanDetected as error:
                event = error.event
                break
    assert w.events == [event]
    assert (event.batch, event.origin, event.is_backward) == (2, "grad", True)
    assert event.note == ("not reproduced by an eager replay of batch 2 (it stopped where the "
                          "forward raised RuntimeError (no second run), and 2 module frames and 0 "
                          "ops before that stayed finite)")


def test_a_forward_nan_in_training_can_be_read_with_the_gradients_in_one_read(tiny_mlp,
                                                                               monkeypatch):
    monkeypatch.setattr(native, "available", lambda: False)  # the device path, as on a GPU
    optimizer = torch.optim.SGD(tiny_mlp.parameters(), lr=0.1)
    w = nw.watch(tiny_mlp, mode="sentinel", backward=True)
    w.parts.sentinel.defer_reads = "always"
    try:
        xs = _batches(4, nan_at=3)
        for x in xs[:3]:
            optimizer.zero_grad()
            tiny_mlp(x).square().mean().backward()
            optimizer.step()
        assert w.parts.sentinel.reads == 3  # one per batch: outputs and gradients together
        loss = tiny_mlp(xs[3]).square().mean()  # the forward's NaN is not read yet ...
        with pytest.raises(nw.NanDetected) as caught:
            loss.backward()  # ... but before any step could use the gradients
        assert caught.value.event.batch == 3 and not caught.value.event.is_backward
        assert caught.value.event.module == "fc1"
    finally:
        w.close()


def test_inference_batches_read_once_on_the_device_path_and_never_on_cpu(tiny_mlp, monkeypatch):
    with torch.no_grad(), nw.watch(tiny_mlp, mode="sentinel") as w:
        for x in _batches(5):
            tiny_mlp(x)
        if native.available():
            assert w.parts.sentinel.reads == 0  # the kernel reads the outputs where they lie
    monkeypatch.setattr(native, "available", lambda: False)
    with torch.no_grad(), nw.watch(tiny_mlp, mode="sentinel") as w:
        for x in _batches(5):
            tiny_mlp(x)
        assert w.parts.sentinel.reads == 5 and w.parts.sentinel.checks == 5


def test_keep_batches_zero_still_holds_the_running_batch(tiny_mlp):
    with nw.watch(tiny_mlp, mode="sentinel", keep_batches=0, on_nan="record") as w:
        for x in _batches(3, nan_at=2):
            tiny_mlp(x)
    assert w.event is not None and w.event.trace is not None


def test_browser_on_a_sentinel_watch_shows_sampled_and_replayed_batches(tiny_mlp):
    with nw.watch(tiny_mlp, mode="sentinel", sample_every=2, on_nan="record") as w:
        for x in _batches(6, nan_at=5):
            tiny_mlp(x)
        browser = w.browse()
        latest = w.frames()
        assert {4, 5} <= set(latest["batch"])
        assert 5 in set(w.history()["batch"])
        assert "batch 5" in browser.status.value


def test_repr_and_options_name_the_mode(tiny_mlp):
    with nw.watch(tiny_mlp, mode="sentinel", sample_every=10) as w:
        assert "sentinel mode" in repr(w)
        assert (w.mode, w.sample_every) == ("sentinel", 10)
    with nw.watch(tiny_mlp) as w:
        assert w.mode == "full" and "sentinel" not in repr(w)


@pytest.mark.parametrize("fused", [False, True])
def test_device_numbers_are_non_finite_exactly_where_a_nan_or_inf_is(fused):
    from nanwidget.core.sentinel.check import device_numbers
    tensors = [torch.ones(5), torch.tensor([1.0, float("nan")]), torch.tensor([float("-inf"), 2.0]),
               torch.tensor([3e38, 3e38]), torch.zeros(0)]
    numbers = device_numbers(tensors, torch.float32, fused=fused).tolist()
    # 3e38 and 3e38 overflow float32 in an L2 norm (a suspect, confirmed later); an unfused
    # check takes the largest |x|, which never overflows, and is each tensor's magnitude.
    assert [n == n and abs(n) != float("inf") for n in numbers] == \
        [True, False, False, not fused, True]
    if not fused:
        assert numbers[0] == 1.0 and numbers[3] == pytest.approx(3e38)


def test_a_suspect_that_only_overflowed_is_confirmed_finite(monkeypatch):
    from nanwidget.core.sentinel.check import NonFiniteCheck
    monkeypatch.setattr(native, "available", lambda: False)
    big = torch.full((4,), 3e38)  # its float32 L2 norm overflows to inf, its values are finite
    check = NonFiniteCheck([("big", big), ("bad", torch.tensor([0.0, float("inf")]))], fused=True)
    assert check.waiting and [(b.label, b.kind) for b in check.read()] == [("bad", "inf")]


@pytest.mark.parametrize("kernel", [True, False], ids=["native kernel", "device numbers"])
def test_a_clean_check_knows_the_largest_value_it_read(monkeypatch, kernel):
    from nanwidget.core.sentinel.check import NonFiniteCheck
    if not kernel:
        monkeypatch.setattr(native, "available", lambda: False)
    elif not native.available():
        pytest.skip("the native kernel is not available here")
    small, large = torch.tensor([0.5, -2.0]), torch.tensor([-3e4, 1e-3], dtype=torch.float64)
    check = NonFiniteCheck([("small", small), ("large", large)])
    assert check.read() == []
    assert (check.abs_max, check.abs_max_dtype) == (3e4, torch.float64)
    if kernel:  # read where it lies: the smallest |x| comes with it
        assert check.abs_min == pytest.approx(1e-3)
    bad = NonFiniteCheck([("small", small), ("bad", torch.tensor([1.0, float("nan")]))])
    assert [b.label for b in bad.read()] == ["bad"] and bad.abs_max != bad.abs_max  # NaN


def test_allow_inf_on_the_root_lets_its_inf_outputs_pass_but_not_a_nan():
    class LogProbs(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x.clamp(min=0))  # log(0) = -inf on purpose; log of NaN is NaN

    model = LogProbs()
    with nw.watch(model, mode="sentinel", allow_inf=[LogProbs], on_nan="record") as w:
        model(torch.tensor([0.0, 1.0]))
        assert w.events == [] and w.parts.sentinel.replays == 0
        model(torch.tensor([float("nan"), 1.0]))
    assert [(e.batch, e.kind) for e in w.events] == [(1, "nan")]


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_a_forward_within_vmap_or_grad_is_checked_and_its_nan_found(tiny_mlp, reduction_path,
                                                                      transform):
    from torch.func import functional_call, grad, vmap
    x = torch.randn(5, 16)

    def run() -> torch.Tensor:
        if transform == "vmap":
            return vmap(tiny_mlp)(x)
        params = {name: p.detach() for name, p in tiny_mlp.named_parameters()}
        return grad(lambda p: functional_call(tiny_mlp, p, (x,)).sum())(params)["fc1.weight"]

    expected = run()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no internal error: the wrapped output is read
        with nw.watch(tiny_mlp, mode="sentinel", on_nan="record") as w:
            assert torch.equal(run(), expected)
            assert w.events == [] and w.history().abs_max.notna().all()
            with torch.no_grad():
                tiny_mlp.fc2.weight[0, 0] = float("nan")
            run()
    assert [(e.batch, e.kind) for e in w.events] == [(1, "nan")]


def test_an_output_the_sentinel_cannot_read_is_said_once_not_passed_silently():
    class Streaming(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor):
            return {"logits": self.linear(x), "steps": (t for t in [x.log()])}

    model = Streaming()
    with nw.watch(model, mode="sentinel", on_nan="record"), \
            pytest.warns(RuntimeWarning, match=r"not checked for NaN/Inf: output\.steps") \
            as caught:
        for _ in range(2):
            output = model(torch.randn(3, 4))
    assert len([c for c in caught if "not read" in str(c.message)]) == 1
    assert next(output["steps"]).shape == (3, 4)  # not consumed


# -- a cause that persists (on_nan "record" or "warn" let the run go on): told once in full,
# then at every batch without a replay, in the place full mode names.
def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _places(events):
    return [(e.batch, e.module, e.role, e.origin, e.is_backward) for e in events]


def test_a_weight_that_stays_non_finite_is_replayed_once_then_told_as_before():
    inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    runs = {}
    for mode in ("full", "sentinel"):
        model = _small_model()
        with nw.watch(model, mode=mode, on_nan="record", backward=True) as w:
            with torch.no_grad():
                model[0].weight[1, 2] = float("nan")
            for x in inputs[:4]:
                model(x).sum().backward()
            replays_while_broken = w.parts.sentinel.replays if mode == "sentinel" else None
            with torch.no_grad():  # mended: the next NaN is a new cause, looked at again
                model[0].weight[1, 2] = 0.0
                model.zero_grad()
            model(inputs[4]).sum().backward()
            bad = inputs[5].clone()
            bad[0, 0] = float("nan")
            model(bad).sum().backward()
            runs[mode] = (w.events, replays_while_broken, w.parts.sentinel.replays
                          if mode == "sentinel" else None)
    full, (events, replays_while_broken, replays) = runs["full"][0], runs["sentinel"]
    assert _places(events) == _places(full)  # the same events, in the same places
    assert _places(events)[:2] == [(0, "0", "weight", "weight", False),
                                   (0, "2", "weight", "grad", True)]
    assert replays_while_broken == 2  # batch 0's forward and backward, not batches 1-3
    for event in events[2:8]:
        assert event.note.startswith("not replayed:"), event
        assert event.diagnosis.kind == "corrupted-weight"
    assert "0.weight found non-finite in batch 0 still is" in events[6].note
    assert events[-2].batch == 5 and events[-2].origin == "input"  # batch 5, replayed again
    assert not events[-2].note.startswith("not replayed") and replays > replays_while_broken


def test_a_weight_event_after_the_nan_spread_to_other_weights_names_the_first_of_them():
    # A NaN written into the last layer; the optimizer step after that batch makes every
    # weight NaN (its gradients were). The next batch's first bad weight is the first layer's:
    # the sentinel replays it instead of repeating the last layer, then repeats it unreplayed.
    inputs = [torch.randn(16, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    runs = {}
    for mode in ("full", "sentinel"):
        model = _small_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with nw.watch(model, mode=mode, on_nan="record", backward=True) as w:
            with torch.no_grad():
                model[2].weight[1, 2] = float("nan")
            for x in inputs:
                optimizer.zero_grad()
                model(x).sum().backward()
                optimizer.step()
            runs[mode] = [e for e in w.events if not e.is_backward]
    full, sentinel = runs["full"], runs["sentinel"]
    assert _places(sentinel) == _places(full)
    assert [(e.batch, e.module) for e in sentinel[:2]] == [(0, "2"), (1, "0")]
    assert "became NaN between batch 0 and batch 1" in sentinel[1].diagnosis.summary
    assert not sentinel[1].note.startswith("not replayed")
    assert sentinel[2].note.startswith("not replayed: the weight 0.weight")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_accumulated_into_a_non_finite_grad_are_not_replayed_again(set_to_none):
    model = _small_model()
    inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    inputs[0][0, 0] = float("nan")
    inputs[4][1, 1] = float("nan")
    with nw.watch(model, mode="sentinel", on_nan="record", backward=True) as w:
        for step in range(2):  # two optimizer steps of four accumulated micro-batches
            for x in inputs[4 * step: 4 * step + 4]:
                model(x).sum().backward()
            if step == 0:
                replays_after_first_step = w.parts.sentinel.replays
            model.zero_grad(set_to_none=set_to_none)
    grads = [e for e in w.events if e.is_backward]
    assert [e.batch for e in grads] == list(range(8))  # every pass with a NaN gradient
    repeats = [e.batch for e in grads if e.note.startswith("not replayed")]
    # Batches 1-3 and 5-7 only accumulated into the NaN of batches 0 and 4; zero_grad() in
    # between (cleared, or zeroed in place) made batch 4's a new one, looked at again.
    assert repeats == [1, 2, 3, 5, 6, 7]
    assert "accumulated into since batch 4" in grads[-1].note
    assert w.parts.sentinel.replays > replays_after_first_step


def test_a_gradient_written_between_passes_is_a_new_cause():
    """Anything besides the accumulation (here a clip that writes the NaN gradient in place)
    makes the next pass's gradient event a new one: replayed."""
    model = _small_model()
    inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    inputs[0][0, 0] = float("nan")
    with nw.watch(model, mode="sentinel", on_nan="record", backward=True) as w:
        model(inputs[0]).sum().backward()
        first = w.parts.sentinel.replays
        with torch.no_grad():
            model[2].weight.grad.mul_(0.5)
        model(inputs[1]).sum().backward()
    second = [e for e in w.events if e.is_backward][-1]
    assert second.batch == 1 and not second.note.startswith("not replayed")
    assert w.parts.sentinel.replays > first


class PolicyRefusingNanLogits(nn.Module):
    """A policy whose forward builds its action distribution: torch refuses NaN logits
    (validate_args) with a ValueError inside the root forward, so no output is returned."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, width: int = 16) -> torch.distributions.Categorical:
        if x.shape[1] != width:
            raise RuntimeError("shape mismatch")  # an error of its own, NaN or not
        return torch.distributions.Categorical(logits=self.lin(x), validate_args=True)


def test_a_root_forward_that_raises_on_a_nan_input_is_an_event_as_in_full_mode():
    xs = _batches(3, nan_at=1)
    events = {}
    for mode in ("full", "sentinel"):
        torch.manual_seed(0)
        model = PolicyRefusingNanLogits()
        with nw.watch(model, mode=mode) as w:
            model(xs[0])
            # The forward raised, so the event is warned about (as full mode does), not raised.
            with pytest.warns(nw.NanWarning), pytest.raises(ValueError, match="logits"):
                model(xs[1])
            model(xs[2])
        events[mode] = [(e.batch, e.module, e.role, e.origin, e.diagnosis.kind) for e in w.events]
    assert events["full"] == [(1, "lin", "input[0]", "input", "bad-data")]
    assert events["sentinel"] == events["full"]  # found by a replay up to the exception
    assert w.event.trace.raised.startswith("the forward raised ValueError")


def test_a_root_forward_that_raises_on_a_nan_weight_is_an_event_as_in_full_mode():
    # Finite inputs, a NaN written into the policy's weight: the forward raised with no event
    # in sentinel mode (only its inputs were checked), where full mode names the weight.
    events = {}
    for mode in ("full", "sentinel"):
        torch.manual_seed(0)
        model = PolicyRefusingNanLogits()
        xs = _batches(3)
        with nw.watch(model, mode=mode) as w:
            model(xs[0])
            with torch.no_grad():
                model.lin.weight[1, 2] = float("nan")
            with pytest.warns(nw.NanWarning), pytest.raises(ValueError, match="logits"):
                model(xs[1])
        events[mode] = [(e.batch, e.module, e.role, e.origin, e.diagnosis.kind) for e in w.events]
    assert events["full"] == [(1, "lin", "weight", "weight", "corrupted-weight")]
    assert events["sentinel"] == events["full"]


def test_a_fake_quantizer_refusing_a_nan_weight_is_blamed_on_the_weight_not_its_scale():
    # x86 QAT: the fused fake quantizer computes its scale from the NaN weight (moving no
    # version counter), then raises on the zero point; the replay starts from that NaN scale.
    tq = pytest.importorskip("torch.ao.quantization")
    if "x86" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no x86 quantized engine")
    events = {}
    for mode in ("full", "sentinel"):
        torch.manual_seed(0)
        model = nn.Sequential(tq.QuantStub(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4),
                              tq.DeQuantStub()).train()
        model.qconfig = tq.get_default_qat_qconfig("x86")
        tq.prepare_qat(model, inplace=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            w = nw.watch(model, mode=mode, backward=True)
        for step in range(3):
            if step == 2:
                with torch.no_grad():
                    model[1].weight[2, 3] = float("nan")
            try:
                loss = model(torch.randn(4, 8)).square().mean()
            except RuntimeError as error:
                assert "zero_point" in str(error) or "NaN" in str(error)
                break
            except nw.NanDetected:
                break
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        w.close()
        event = w.event
        events[mode] = (event.batch, event.module, event.role, event.origin,
                        event.diagnosis.kind)
    assert events["full"] == (2, "1", "weight", "weight", "corrupted-weight")
    assert events["sentinel"] == events["full"]
    assert "met 1.weight_fake_quant.scale first" in event.note


class DetrLikeRefusingNanBoxes(nn.Module):
    """Takes images and per-image targets as DETR does (labels=[{"boxes": ...}]) and checks the
    boxes' format in its own forward, as transformers' DETR loss does: a NaN coordinate fails
    the check, and no module ever sees the targets."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, 4, 3)
        self.box_head = nn.Linear(4, 4)

    def forward(self, pixel_values: torch.Tensor,
                labels: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        predicted = self.box_head(self.backbone(pixel_values).mean((2, 3))).sigmoid()
        for target in labels:
            boxes = target["boxes"]
            if not (boxes[:, 2:] >= boxes[:, :2]).all():
                raise ValueError(f"boxes must be in [x0, y0, x1, y1] format, got {boxes}")
        return (predicted - torch.stack([t["boxes"].mean(0) for t in labels])).abs().mean()


def test_a_root_forward_that_raises_on_a_nan_its_modules_never_see_is_the_same_event_in_both_modes():
    # Full mode's frames flagged the NaN input of the root, whose frame has no outputs (it
    # raised): no event, where sentinel mode gives one from its held inputs.
    events = {}
    for mode in ("full", "sentinel"):
        torch.manual_seed(0)
        model = DetrLikeRefusingNanBoxes()
        images = torch.rand(2, 3, 8, 8)
        labels = [{"boxes": torch.tensor([[0.1, 0.1, 0.5, 0.5], [0.2, 0.3, 0.6, 0.9]])},
                  {"boxes": torch.tensor([[0.2, 0.2, 0.4, 0.4]])}]
        with nw.watch(model, mode=mode) as w:
            model(images, labels=labels)
            labels[0]["boxes"][1, 1] = float("nan")
            with pytest.warns(nw.NanWarning), pytest.raises(ValueError, match="format"):
                model(images, labels=labels)
        events[mode] = [(e.batch, e.module, e.role, e.kind, e.origin, e.diagnosis.kind,
                         e.diagnosis.rows) for e in w.events]
    assert events["full"] == [(1, "", "kwarg:labels[0].boxes", "nan", "input", "bad-data", [0])]
    assert events["sentinel"] == events["full"]


def test_a_root_forward_that_raises_on_finite_inputs_is_no_event_and_no_replay():
    torch.manual_seed(0)
    model = PolicyRefusingNanLogits()
    with nw.watch(model, mode="sentinel") as w:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no NanWarning either
            with pytest.raises(RuntimeError, match="shape mismatch"):
                model(torch.randn(4, 16), width=8)
        model(torch.randn(4, 16))  # the watch goes on
        assert w.events == [] and w.parts.sentinel.replays == 0 and w.batch == 2


def test_a_nan_gradient_that_came_in_past_the_outputs_names_the_module_nearest_to_it():
    # An aux loss kept as an attribute (mix.aux) made the NaN inside the model's backward,
    # past its outputs: the sentinel named 'inp', the first parameter in the model's order,
    # which that NaN reaches last.
    from test_diagnosis import _aux_attribute_event

    event = _aux_attribute_event("sentinel")
    assert (event.batch, event.module, event.role, event.origin) == \
        (1, "mix.router", "weight", "grad")
    assert "4 parameters have non-finite gradients (mix.router.weight, mix.router.bias, " \
        "inp.weight, inp.bias)" in event.note


class Decoder(nn.Module):
    """A tiny decoder whose calls take a cache of the keys seen so far and return the next
    logits and the cache grown by one step (new tensors: a DynamicCache's way); with
    ``static=True`` it writes its keys into a preallocated cache tensor in place instead."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, cache: list | None = None,
                slots: torch.Tensor | None = None, step: int = 0) -> tuple:
        key = self.embed(x)
        if slots is not None:  # a static cache: written in place
            slots[step] = key
            context = slots[:step + 1].mean(0)
        else:
            cache = (cache or []) + [key]
            context = torch.stack(cache).mean(0)
        return self.head(torch.tanh(self.mix(context))), cache


class WrapsADecoder(nn.Module):
    """A wrapper as peft's PeftModel is one: get_base_model() gives the model it wraps, its
    forward calls that model (a training forward), and its generate() calls that model step
    by step, never the wrapper's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = Decoder()

    def get_base_model(self) -> nn.Module:
        return self.decoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x)[0]

    def generate(self, x: torch.Tensor, steps: int = 3, static: bool = False,
                 between: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        cache, slots, logits = None, (torch.zeros(steps, *x.shape[:-1], 16) if static
                                      else None), []
        with torch.no_grad():
            for step in range(steps):
                if between is not None:
                    between(step)
                out, cache = self.decoder(x, cache, slots=slots, step=step)
                logits.append(out)
                x = torch.softmax(out, -1)
        return logits


def _generating(mode: str | None, steps: int = 3, nan_at: int | None = None,
                static: bool = False, on_nan: str = "record") -> tuple[Any, list, int]:
    """A training forward, then a generate() whose step ``nan_at`` meets a NaN weight made
    between steps (as an optimizer step or a load would): (the watch, the logits, its hooks)."""
    torch.manual_seed(0)
    model = WrapsADecoder()
    x = torch.randn(2, 8)

    def between(step: int) -> None:
        if step == nan_at:
            with torch.no_grad():
                model.decoder.mix.weight[0, 0] = float("nan")

    if mode is None:
        model(x).sum().backward()
        return None, model.generate(x, steps, static, between), 0
    with nw.watch(model, mode=mode, on_nan=on_nan) as w:
        model(x).sum().backward()  # the training forward: the wrapper calls the decoder
        logits = model.generate(x, steps, static, between)
        hooks = hook_count(model)
    assert hook_count(model) == 0 and "forward" not in vars(model.decoder)
    return w, logits, hooks


def test_generation_steps_outside_the_root_are_checked_as_batches_of_their_own():
    # peft's PeftModel.generate() (GRPO's sampling with a LoRA peft_config) calls the model
    # the wrapper wraps, never the wrapper's forward: sentinel mode checked none of its steps.
    w, logits, hooks = _generating("sentinel")
    _, unwatched, _ = _generating(None)
    assert all(torch.equal(a, b) for a, b in zip(logits, unwatched))  # bit-identical
    assert hooks == 2  # the root's two: the decoder gets no hook, only a forward of its own
    assert w.events == [] and w.batch == 4  # the training forward, then one per step
    assert not w.recorder.module_hooks_attached and w.parts.sentinel.checks == 4
    history = w.history()
    assert list(zip(history["batch"], history["module"])) == \
        [(0, ""), (1, "decoder"), (2, "decoder"), (3, "decoder")]
    assert not history["nonfinite"].any()


def test_a_nan_met_in_a_generation_step_is_replayed_to_the_module_full_mode_names():
    full, _, _ = _generating("full", steps=4, nan_at=2)
    w, _, _ = _generating("sentinel", steps=4, nan_at=2)
    event = w.event
    assert (event.batch, event.module, event.role, event.origin) == (3, "decoder.mix", "weight",
                                                                     "weight")
    first = full.event
    assert (first.batch, first.module, first.role, first.origin) == \
        (event.batch, event.module, event.role, event.origin)
    # Step 2's held inputs (its cache as step 2 saw it, grown since) replayed that step alone.
    assert event.trace.reproduced and event.trace.changes == []
    assert event.diagnosis.kind == "corrupted-weight"
    assert w.events[1].note.startswith("not replayed: the weight decoder.mix.weight found "
                                       "non-finite in batch 3 still is")
    with pytest.raises(nw.NanDetected, match="batch 3 at module 'decoder.mix'"):
        _generating("sentinel", steps=4, nan_at=2, on_nan="raise")


def test_a_nan_in_a_generation_step_that_cannot_be_replayed_says_why():
    # A static cache the decoder writes in place at every step: a replay would start from the
    # cache as the later steps left it, so the event is what the check saw, and says so.
    # The NaN weight is there to read at event time: the event names it (it named the
    # decoder's output), as full mode does, and the diagnosis is full mode's.
    full, _, _ = _generating("full", steps=4, nan_at=2, static=True)
    w, _, _ = _generating("sentinel", steps=4, nan_at=2, static=True)
    event = w.event
    assert (event.batch, event.module, event.role, event.origin, event.kind) == \
        (3, "decoder.mix", "weight", "weight", "nan")
    assert (event.module, event.role, event.origin) == \
        (full.event.module, full.event.role, full.event.origin)
    assert event.trace is None
    assert event.note.startswith("not replayed: cannot replay batch 3: its kwarg:slots")
    assert "modified in place by the model's own forward while the batch ran" in event.note
    assert event.diagnosis.kind == full.event.diagnosis.kind == "corrupted-weight"
    assert event.diagnosis.summary == full.event.diagnosis.summary
    # The NaN stays in the weight: the later steps repeat that event without a replay.
    assert w.events[1].note.startswith("not replayed: the weight decoder.mix.weight found "
                                       "non-finite in batch 3 still is")


class ScaledNet(nn.Module):
    """Linear, BatchNorm (running stats: buffers its forward writes), Linear; its input is
    only scaled by a number before the first layer, so autograd keeps no reference to it
    and the caller may change it in place before the backward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.fc(x * 2.0))))


def _changed_after_the_forward(monkeypatch, nan_in: str) -> tuple[Any, Any]:
    """Two training batches of a ScaledNet in sentinel mode, batch 1's outputs read only at
    the end of its backward pass (as on a GPU), each input changed in place between the
    forward and the backward pass (as a loop reusing its buffer may): (the first event, the
    model). ``nan_in``: "weight"
    (head.weight made NaN before batch 1) or "input" (a NaN in batch 1's input)."""
    monkeypatch.setattr(native, "available", lambda: False)  # the device path, as on a GPU
    torch.manual_seed(0)
    model = ScaledNet()
    xs = list(torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(1)))
    if nan_in == "input":
        xs[1][2, 1] = float("nan")
    with nw.watch(model, mode="sentinel", backward=True, on_nan="record") as w:
        w.parts.sentinel.defer_reads = "always"
        for batch, x in enumerate(xs):
            if batch == 1 and nan_in == "weight":
                with torch.no_grad():
                    model.head.weight[1, 3] = float("nan")
            out = model(x)
            x.mul_(0.5)  # its buffer reused before the backward pass: the read sees this
            out.square().mean().backward()
    assert w.events
    return w.events[0], model


def test_a_nan_weight_is_named_when_its_batch_cannot_be_replayed(monkeypatch):
    event, _ = _changed_after_the_forward(monkeypatch, "weight")
    assert (event.batch, event.module, event.role, event.origin, event.kind) == \
        (1, "head", "weight", "weight", "nan")
    assert event.note.startswith("not replayed: cannot replay batch 1: its input[0]")
    assert "modified in place after the batch ran" in event.note
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert diagnosis.summary.startswith("'head.weight' became NaN between batch 0 and batch 1")
    # No replay ran: nothing claims the op or the line that made it.
    told = " ".join([diagnosis.summary, *diagnosis.evidence, *diagnosis.suggestion])
    assert " op " not in told and "line" not in told and event.trace is None


def test_a_batch_that_cannot_be_replayed_with_finite_weights_names_the_output(monkeypatch):
    # A NaN input: the forward wrote it into BatchNorm's running stats (buffers), which are
    # no cause of it; the event stays what the check saw, the model's output.
    event, model = _changed_after_the_forward(monkeypatch, "input")
    assert not model.norm.running_mean.isfinite().all()
    assert all(p.isfinite().all() for p in model.parameters())
    assert (event.batch, event.module, event.role, event.origin) == (1, "", "output", "output")
    assert event.note.startswith("not replayed: cannot replay batch 1: its input[0]")


class _EncodedOnce(nn.Module):
    """An encoder-decoder whose encoder the caller runs once, outside the forward, and whose
    forward takes its output (what generate() does with BART's encoder, Llava's vision tower)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.decoder = nn.Linear(8, 3)

    def forward(self, memory: torch.Tensor) -> torch.Tensor:
        return self.decoder(memory)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_weight_of_a_part_run_outside_the_forward_is_the_weight_s_not_bad_data(mode):
    # Sentinel mode checks the root's outputs: the NaN came into the forward with its input,
    # and the event read "bad-data: it came with the data, not from the model". Full mode,
    # whose hooks see the encoder's call, named the encoder's weight.
    torch.manual_seed(0)
    model = _EncodedOnce()
    x = torch.randn(5, 4)
    with nw.watch(model, on_nan="record", mode=mode) as w:
        with torch.no_grad():
            model(model.encoder(x))
            model.encoder[0].weight[2, 1] = float("nan")  # a bad write between the batches
            model(model.encoder(x))
    event = w.event
    assert (event.batch, event.module, event.role, event.origin) == (1, "encoder.0", "weight", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight" and "'encoder.0.weight'" in diagnosis.summary
    assert "came with the data" not in diagnosis.summary


def test_a_nan_input_made_by_a_part_run_outside_the_forward_from_bad_data_stays_bad_data():
    # The part's weights are finite: its input was bad, so the forward's input is the data's.
    torch.manual_seed(0)
    model = _EncodedOnce()
    x = torch.randn(5, 4)
    x[3, 0] = float("nan")
    with nw.watch(model, on_nan="record", mode="sentinel") as w:
        with torch.no_grad():
            model(model.encoder(x))
    assert w.event.origin == "input" and w.event.diagnosis.kind == "bad-data"


class _GaussianPolicy(nn.Module):
    """An RL policy as Stable-Baselines3 makes one: ``forward`` for the rollouts, and a
    training pass (``evaluate``) that calls its parts without its forward and hands their mean
    to a ``Normal`` that validates its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))

    def evaluate(self, x: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        mean = self.head(torch.tanh(self.body(x)))
        return torch.distributions.Normal(mean, 1.0, validate_args=True).log_prob(actions)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("backward", [False, True])
def test_a_step_that_writes_nan_before_a_pass_outside_the_forward_raises_is_named(mode, backward):
    # The step of update 2 writes NaN (its loss is NaN); the next training pass, which calls
    # the policy's parts without its forward, raises in Normal(loc=NaN) before any rollout
    # forward: sentinel mode, which checks the root's calls, recorded nothing.
    torch.manual_seed(0)
    policy = _GaussianPolicy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.NanWarning)
        with pytest.raises(ValueError, match="loc"):  # torch's own error, unchanged
            with nw.watch(policy, mode=mode, backward=backward, on_nan="record") as w:
                for update in range(4):
                    with torch.no_grad():
                        obs = torch.randn(8, 4)
                        actions = policy(obs) + torch.randn(8, 1)  # a rollout forward
                    for _ in range(2):  # two training passes per update
                        loss = -policy.evaluate(obs, actions).mean()
                        if update == 2:
                            loss = loss * float("nan")
                        optimizer.zero_grad()
                        loss.backward()
                        optimizer.step()
    assert w.events, "no event for the NaN weights the step wrote"
    event = w.events[0] if mode == "full" else w.event
    if backward and mode == "full":  # the NaN gradient is seen before the step
        assert event.is_backward
    else:
        assert (event.module, event.role, event.origin) == ("body", "weight", "weight")
        assert event.diagnosis.kind == "corrupted-weight"
        assert "optimizer step" in event.diagnosis.summary

"""Sentinel mode gives the event full mode gives: the same run, seeded, watched both ways.

Each scenario plants one bug in a small seeded model and runs the same batches twice: once in
full mode (every module hooked, ``replay_on_nan=True`` for the trace) and once in sentinel
mode (only the root's outputs and the gradients checked, the failing batch replayed). The
event (batch, module, call, role, kind, origin, frames), ``report()`` and the trace must agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Callable
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

import nanwidget as nw

from conftest import TinyMLP, hook_count

EVENT_FIELDS = ("batch", "module", "module_type", "call", "role", "kind", "origin", "is_backward",
                "rank", "frame")


@dataclasses.dataclass
class Scenario:
    """A seeded model, its batches, and one step of the loop (``step(model, x, batch)``)."""

    build: Callable[[], nn.Module]
    batches: Callable[[], list[Any]]
    step: Callable[[nn.Module, Any, int, Any], None]
    train: bool = False
    watch: dict = dataclasses.field(default_factory=dict)
    sentinel: dict = dataclasses.field(default_factory=dict)


def run(scenario: Scenario, mode: str) -> tuple[nw.NanWatch, nw.NanEvent]:
    """Run the scenario's loop under a watch in ``mode`` until NanDetected; the watch and event."""
    torch.manual_seed(0)
    model = scenario.build()
    model.train(scenario.train)
    batches = scenario.batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01) if scenario.train else None
    options = dict(scenario.watch)
    if mode == "full":
        options["replay_on_nan"] = True
    else:
        options.update(mode="sentinel", **scenario.sentinel)
    torch.manual_seed(1)  # the loop's own RNG (dropout) starts the same in both runs
    watch = nw.watch(model, **options)
    try:
        with pytest.raises(nw.NanDetected) as caught:
            for batch, x in enumerate(batches):
                scenario.step(model, x, batch, optimizer)
    finally:
        watch.close()
    assert hook_count(model) == 0
    return watch, caught.value.event


def _without_timing(text: str) -> str:
    return re.sub(r", \d+\.\d+ s\)", ", <t> s)", text)


def assert_same_event(full: nw.NanEvent, sentinel: nw.NanEvent) -> None:
    assert {f: getattr(sentinel, f) for f in EVENT_FIELDS} == \
        {f: getattr(full, f) for f in EVENT_FIELDS}
    assert sentinel.note == "" and sentinel.frames_note == ""
    pd.testing.assert_frame_equal(sentinel.frames, full.frames)


def assert_same_trace(full: nw.NanEvent, sentinel: nw.NanEvent) -> None:
    assert full.trace is not None and sentinel.trace is not None
    pd.testing.assert_frame_equal(sentinel.trace.frames, full.trace.frames)
    pd.testing.assert_frame_equal(sentinel.trace.ops, full.trace.ops)
    assert _without_timing(sentinel.trace.report()) == _without_timing(full.trace.report())


def compare(scenario: Scenario) -> tuple[nw.NanEvent, nw.NanEvent]:
    full_watch, full = run(scenario, "full")
    sentinel_watch, sentinel = run(scenario, "sentinel")
    assert_same_event(full, sentinel)
    if not full.is_backward:
        assert_same_trace(full, sentinel)
    assert _without_timing(sentinel_watch.report()) == _without_timing(full_watch.report())
    return full, sentinel


# ----------------------------------------------------------------------------------- models
def _infer(model: nn.Module, x: Any, batch: int, optimizer: Any) -> None:
    with torch.no_grad():
        model(x)


def _train(model: nn.Module, x: Any, batch: int, optimizer: Any) -> None:
    optimizer.zero_grad()
    out = model(x)
    out = out.logits if hasattr(out, "logits") else out
    out.float().square().mean().backward()
    optimizer.step()


def _data(count: int = 5, shape: tuple = (4, 16), bad: int | None = None,
          change: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Callable[[], list]:
    def make() -> list:
        generator = torch.Generator().manual_seed(7)
        xs = [torch.randn(*shape, generator=generator) for _ in range(count)]
        if bad is not None and change is not None:
            xs[bad] = change(xs[bad])
        return xs
    return make


class Between(nn.Module):
    """sqrt between two modules: NaN born in functional code, not in a module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.sqrt(self.act(self.fc1(x)) + 0.999))


class SqrtLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


class Shared(nn.Module):
    """One block called twice: the second call gets a negative input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.root = SqrtLayer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.root(x.abs() + 1.0)
        return self.root(self.fc(h) - 0.5 * x.abs().amax() * (x.abs().amax() > 10))


class Attention(nn.Module):
    """Masked softmax attention with a boolean ``mask`` keyword: a fully masked row is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ self.v(x)


class MaskedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.attention = Attention()
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.attention(self.embed(x), mask=mask))


@dataclasses.dataclass
class Output:
    """A ModelOutput-like result."""

    logits: torch.Tensor
    aux: torch.Tensor


class WithOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = TinyMLP()

    def forward(self, x: torch.Tensor) -> Output:
        logits = self.body(x)
        return Output(logits=logits, aux=torch.log(40 - x.abs().amax(-1)))  # NaN once |x| > 40


class SafeLog(nn.Module):
    """where(x > 0, log(x), 0): finite forward, NaN gradient wherever x == 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x))


class BackwardOnly(nn.Module):
    """Large inputs switch the gate off: log gets exact zeros, its gradient is NaN there."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.log, self.fc2 = nn.Linear(16, 16), nn.Sigmoid(), SafeLog(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = (x.abs().amax() < 50).float()
        return self.fc2(self.log(self.act(self.fc1(x)) * gate))


class Dropped(nn.Module):
    """The NaN depends on the dropout mask (a row whose two units are both dropped divides 0
    by 0): the replay must draw the same masks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(16, 2), nn.Dropout(0.5), nn.Linear(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc1(x))
        return self.fc2(h / h.abs().sum(-1, keepdim=True))


def _fp16_model() -> nn.Module:
    model = TinyMLP().half()
    with torch.no_grad():
        model.fc1.weight.mul_(16)  # large inputs overflow float16 (65504) in fc1's matmul
    return model


def _plant_weight_inf(model: nn.Module, x: Any, batch: int, optimizer: Any) -> None:
    if batch == 3:
        with torch.no_grad():
            model.fc2.weight[0, 0] = float("inf")
    _train(model, x, batch, optimizer)


def _masked_batches() -> list:
    generator = torch.Generator().manual_seed(3)
    batches = []
    for batch in range(4):
        x = torch.randn(2, 5, 16, generator=generator)
        mask = torch.ones(2, 5, 5, dtype=torch.bool)
        mask[:, :, 0] = True
        if batch == 2:
            mask[1, 3] = False  # row 3 of sample 1 sees nothing: softmax of all -inf
        batches.append((x, mask))
    return batches


# -------------------------------------------------------------------------------- scenarios
SCENARIOS = {
    # A parameter set to Inf before batch 3 of a training loop (weights change every step, so
    # the sentinel replays the earlier batches from weight snapshots).
    "weight_inf": Scenario(TinyMLP, _data(), _plant_weight_inf, train=True,
                           watch=dict(snapshot_weights=True)),
    "data_nan": Scenario(TinyMLP, _data(bad=2, change=lambda x: x.index_put_(
        (torch.tensor([1]), torch.tensor([3])), torch.tensor(float("nan")))), _infer),
    "functional_op_between_modules": Scenario(Between, _data(bad=2, change=lambda x: x * 40),
                                              _infer),
    "fp16_overflow": Scenario(_fp16_model, _data(bad=1, change=lambda x: x.clamp(-3, 3) * 2e4),
                              lambda m, x, b, o: _infer(m, x.half(), b, o)),
    "shared_module_second_call": Scenario(Shared, _data(bad=2, change=lambda x: x * 20), _infer),
    "kwarg_mask": Scenario(MaskedNet, _masked_batches,
                           lambda m, xm, b, o: _infer_kwargs(m, xm)),
    "model_output_leaf": Scenario(WithOutput, _data(bad=1, change=lambda x: x * 50), _infer),
    "dropout_dependent": Scenario(Dropped, _data(count=12), _train, train=True,
                                  watch=dict(snapshot_weights=True)),
}


def _infer_kwargs(model: nn.Module, batch: tuple) -> None:
    x, mask = batch
    with torch.no_grad():
        model(x, mask=mask)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_sentinel_event_report_and_trace_equal_full_mode(name):
    full, sentinel = compare(SCENARIOS[name])
    assert sentinel.trace is not None


def test_planted_bugs_land_where_expected():
    # The scenarios plant what their names say (so the equality above means something).
    expected = {"weight_inf": ("fc2", "weight", "inf"),
                "data_nan": ("fc1", "input", "nan"),
                "functional_op_between_modules": ("fc2", "input", "nan"),
                "fp16_overflow": ("fc1", "output", "inf"),
                "shared_module_second_call": ("root", "output", "nan"),
                "kwarg_mask": ("attention", "output", "nan"),
                "model_output_leaf": ("", "output", "nan")}
    for name, (module, origin, kind) in expected.items():
        _, event = run(SCENARIOS[name], "sentinel")
        assert (event.module, event.origin, event.kind) == (module, origin, kind), name
    _, event = run(SCENARIOS["shared_module_second_call"], "sentinel")
    assert event.call == 1
    _, event = run(SCENARIOS["model_output_leaf"], "sentinel")
    assert event.role == "output.aux"
    _, event = run(SCENARIOS["kwarg_mask"], "sentinel")
    assert event.trace.first_bad["op"] == "_softmax"


BACKWARD = Scenario(BackwardOnly, _data(bad=2, change=lambda x: x * 100), _train, train=True,
                    watch=dict(backward=True, max_frames=8))


def _without_diagnosis(text: str) -> str:
    return "\n".join(line for line in text.split("\n")
                     if not line.startswith(("Diagnosis (", "  - ", "  Try: ", "  Rows of")))


def test_backward_only_nan_gives_the_same_backward_event():
    full_watch, full = run(BACKWARD, "full")
    sentinel_watch, sentinel = run(BACKWARD, "sentinel")
    assert full.is_backward and full.origin == "grad" and full.batch == 2
    assert_same_event(full, sentinel)
    # Both replay the backward pass from the gradient the output received (full mode needed a
    # loss function and said "unknown"): the same report, trace and diagnosis.
    assert _without_timing(full_watch.report()) == _without_timing(sentinel_watch.report())
    assert sentinel.summary() == full.summary()
    assert full.summary().endswith(f"first bad op div at {full.trace.first_bad['source']}")
    assert full.diagnosis == sentinel.diagnosis and full.diagnosis.kind == "domain"
    assert full.trace.first_bad.equals(sentinel.trace.first_bad)
    # The sentinel's trace ran the backward from the gradients the outputs received: the NaN
    # that reaches the event is born in log's gradient (0 / 0 where where() passed a zero
    # gradient to log(0)), at the log's line; the forward's log(0) = -inf never reaches it.
    first = sentinel.trace.first_bad
    assert first["module"] == "log" and first["phase"] == "backward" and sentinel.trace.reproduced
    assert first["source"].endswith(f":{SafeLog.forward.__code__.co_firstlineno + 1}")
    assert sentinel.trace.first_bad_grad_of == "LogBackward0"
    assert not sentinel.trace.earlier_inf_reaches  # the forward's -inf stayed out
    ops = sentinel.trace.ops
    assert ops[(ops["phase"] == "backward") & ops["nan"]]["module"].iloc[0] == "log"
    assert set(sentinel.trace.frames["phase"]) == {"forward", "backward"}


def test_without_snapshots_a_training_run_shows_the_failing_batch_and_says_why_not_more():
    scenario = dataclasses.replace(SCENARIOS["weight_inf"], watch={})
    _, full = run(scenario, "full")
    _, sentinel = run(scenario, "sentinel")
    assert {f: getattr(sentinel, f) for f in EVENT_FIELDS} == {f: getattr(full, f) for f in EVENT_FIELDS}
    own = full.frames[full.frames["batch"] == full.batch].reset_index(drop=True)
    pd.testing.assert_frame_equal(sentinel.frames, own)
    assert "frames before batch 3 not shown" in sentinel.frames_note
    assert "weights changed since it ran; snapshot_weights=True keeps copies" in sentinel.frames_note
    assert sentinel.note == "" and sentinel.frames_note not in sentinel.summary()


def _record_forward_nan_then_backward(mode: str, on_nan: str, loss: Callable) -> tuple[list, int]:
    """One training batch whose forward meets a NaN bias (recorded or warned, so its backward
    runs): the events recorded and the NanWarnings issued."""
    torch.manual_seed(0)
    model = TinyMLP()
    with torch.no_grad():
        model.fc1.bias[0] = float("nan")
    x = torch.randn(4, 16)
    with nw.watch(model, mode=mode, on_nan=on_nan, backward=True) as watch:
        with pytest.warns() if on_nan == "warn" else contextlib.nullcontext() as caught:
            loss(model(x)).backward()
    warned = sum(issubclass(w.category, nw.NanWarning) for w in caught) if caught else 0
    return [tuple(getattr(e, f) for f in EVENT_FIELDS) for e in watch.events], warned


@pytest.mark.parametrize("on_nan", ["record", "warn"])
@pytest.mark.parametrize("loss", ["sum", "square"])
def test_a_recorded_forward_event_is_not_recorded_again_by_the_backward_check(on_nan, loss):
    # The NaN bias makes NaN weight gradients: the sentinel's gradient check meets them at the
    # end of the backward pass. Full mode records the forward event once, then the backward
    # event where the NaN first shows in the gradients: the head's weight gradient (its input
    # is NaN) with a sum loss, the gradient the head's output receives with a square loss. The
    # sentinel must record the same two, nothing more.
    loss_fn = (lambda out: out.sum()) if loss == "sum" else (lambda out: out.square().sum())
    full = _record_forward_nan_then_backward("full", on_nan, loss_fn)
    sentinel = _record_forward_nan_then_backward("sentinel", on_nan, loss_fn)
    assert sentinel == full
    events, warned = full
    assert [(e[1], e[4], e[6], e[7]) for e in events] == [
        ("fc1", "bias", "weight", False),
        ("head", "weight" if loss == "sum" else "grad_output[0]", "grad", True)]
    assert warned == (len(events) if on_nan == "warn" else 0)


class _Scaled(nn.Module):
    """A parametrization: the weight as stored, times 2."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2.0


def _parametrized_run(mode: str) -> tuple[nw.NanEvent, bool]:
    """Batches under ``parametrize.cached()``; before the third a NaN is written into the
    stored weight, so the third batch's cached weight is NaN. The event, and whether the
    weight cached by the live forward was still the cached one after the automatic replay."""
    parametrize = torch.nn.utils.parametrize
    torch.manual_seed(0)
    model = TinyMLP()
    parametrize.register_parametrization(model.fc2, "weight", _Scaled())
    x = torch.randn(4, 16)
    seen: list[torch.Tensor] = []  # the weight fc2 used, per call (live ones first)
    model.fc2.register_forward_hook(lambda module, args, output: seen.append(module.weight))
    options = {"mode": "sentinel"} if mode == "sentinel" else {"replay_on_nan": True}
    with nw.watch(model, on_nan="record", snapshot_weights=True, **options) as watch:
        for _ in range(2):
            with parametrize.cached():  # one block per step, as the docs use it
                model(x)
        with torch.no_grad():
            model.fc2.parametrizations.weight.original[3, 5] = float("nan")
        with parametrize.cached():
            model(x)  # batch 2, replayed at its end
            kept = model.fc2.weight is seen[2]  # the weight cached by the live forward
    return watch.event, kept


def test_parametrize_cached_weights_are_recomputed_by_the_replay_as_full_mode_names_them():
    full, full_kept = _parametrized_run("full")
    sentinel, sentinel_kept = _parametrized_run("sentinel")
    assert (full.batch, full.module, full.role, full.origin) == (
        2, "fc2.parametrizations.weight", "original", "weight")
    assert_same_event(full, sentinel)
    assert full.trace.reproduced and sentinel.trace.reproduced
    assert full_kept and sentinel_kept


# A model that returns a tensor it also uses inside (a key/value cache, hidden states): the
# gradient a hook on that output holds is all of it, the inner part included. The sentinel's
# backward replay must not send the inner part through twice.
class _NanInBackward(torch.autograd.Function):
    active = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan") if _NanInBackward.active else grad


class _ReturnsWhatItUses(nn.Module):
    def __init__(self, nan_below: bool) -> None:
        super().__init__()
        self.nan_below = nan_below
        self.lin0, self.lin1, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.lin0(x)
        if self.nan_below:  # the NaN is made in the backward pass below lin1
            h = _NanInBackward.apply(h)
        h = self.lin1(h)
        out = self.head(h if self.nan_below else _NanInBackward.apply(h))
        return out, h  # h is returned and used by head


def _run_returning_model(mode: str, nan_below: bool, aux: str) -> nw.Watch:
    torch.manual_seed(0)
    model = _ReturnsWhatItUses(nan_below)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw.watch(model, mode=mode, backward=True, on_nan="record") as w:
            for step in range(3):
                _NanInBackward.active = step == 2 and aux != "nan"
                out, h = model(torch.randn(3, 4))
                loss = out.sum()
                if aux == "square":
                    loss = loss + h.square().sum()
                elif aux == "nan" and step == 2:
                    loss = loss + (h * float("nan")).sum()
                loss.backward()
    _NanInBackward.active = False
    return w


def _rows(event, module: str) -> list[tuple[str, float]]:
    frames = event.frames
    rows = frames[frames.module.eq(module) & frames.batch.eq(event.batch)
                  & frames.role.str.startswith("grad")]
    return [(role, round(float(value), 6)) for role, value in zip(rows.role, rows.abs_max)]


@pytest.mark.parametrize("aux", ["none", "square"])
def test_a_replay_from_an_output_the_model_also_used_gives_the_live_gradients(aux):
    full = _run_returning_model("full", nan_below=True, aux=aux).event
    sentinel = _run_returning_model("sentinel", nan_below=True, aux=aux).event
    assert (sentinel.batch, sentinel.module, sentinel.role) == (full.batch, full.module, full.role)
    assert _rows(sentinel, "lin1") == _rows(full, "lin1") != []
    assert sentinel.trace is not None and sentinel.trace.reproduced


def test_a_nan_made_inside_the_backward_is_not_blamed_on_the_returned_tensors_gradient():
    full = _run_returning_model("full", nan_below=False, aux="none").event
    sentinel = _run_returning_model("sentinel", nan_below=False, aux="none").event
    assert (sentinel.module, sentinel.role, sentinel.origin) == (full.module, full.role, "grad")
    trace = sentinel.trace
    # the op that made it (the multiplication in _NanInBackward's backward), not the gradient
    # held for the returned h
    assert trace.first_bad is not None and trace.first_bad["op"].startswith("mul")
    assert ("output-grad", "output[1]") not in trace.came_with
    assert sentinel.diagnosis.kind != "loss"


def test_a_nan_sent_into_a_returned_tensor_by_the_loss_is_the_loss_in_both_modes():
    full = _run_returning_model("full", nan_below=False, aux="nan").event
    sentinel = _run_returning_model("sentinel", nan_below=False, aux="nan").event
    assert full.diagnosis.kind == sentinel.diagnosis.kind == "loss"
    assert "made in the loss" in str(sentinel.trace)


class _NormOfRow(nn.Module):
    """sqrt of each row's sum of squares: its gradient is 0/0 = NaN at a row of zeros."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((h ** 2).sum(-1, keepdim=True))


def _siamese_first_event(mode: str, bad_branch: str) -> tuple[nw.NanWatch, nw.NanEvent]:
    """A siamese step: model(a), model(b) (two batches, numbered automatically), one loss, one
    backward; step 1's ``bad_branch`` input holds a zero row (0/0 in the backward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), _NormOfRow())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw.watch(model, mode=mode, backward=True, on_nan="record") as w:
            for step in range(3):
                a, b = torch.randn(4, 8), torch.randn(4, 8)
                if step == 1:
                    (a if bad_branch == "a" else b)[2] = 0.0
                optimizer.zero_grad()
                (model(a) - model(b)).pow(2).mean().backward()
                optimizer.step()
    return w, w.events[0]


@pytest.mark.parametrize("bad_branch", ["a", "b"])
def test_one_backward_through_two_batches_names_the_batch_whose_graph_made_the_nan(bad_branch):
    # The sentinel replayed the batch whose output the pass reached first (the second) only:
    # a NaN born in the first batch's graph read "unknown", not reproduced, at batch 3.
    _, full = _siamese_first_event("full", bad_branch)
    _, sentinel = _siamese_first_event("sentinel", bad_branch)
    assert full.batch == (2 if bad_branch == "a" else 3)
    assert (sentinel.batch, sentinel.module, sentinel.role, sentinel.diagnosis.kind) == \
        (full.batch, full.module, full.role, full.diagnosis.kind) == \
        (full.batch, "2", "grad_input[0]", "domain")
    assert sentinel.trace.reproduced


class SparseCritic(nn.Module):
    """A WGAN critic whose units are mostly off: for some inputs every ReLU is, and the
    critic's gradient with respect to them is exactly 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 3), nn.ReLU(), nn.Linear(3, 1)
        with torch.no_grad():
            self.fc1.bias.fill_(-0.7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x))).squeeze(-1)


def _gradient_penalty_event(mode: str, one_batch_per_step: bool) -> nw.NanEvent:
    """One WGAN-GP critic step: critic(real), critic(fake), and a gradient penalty whose norm,
    sqrt(sum(g ** 2)) without an eps, is taken where g == 0: its backward makes NaN, which
    reaches fc1.weight.grad only through the penalty's double backward."""
    torch.manual_seed(0)
    critic = SparseCritic()
    real, fake = torch.randn(8, 16), torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw.watch(critic, mode=mode, backward=True, on_nan="record") as w:
            if one_batch_per_step:
                w.set_batch(0)
            on_real, on_fake = critic(real), critic(fake)
            mix = torch.rand(8, 1)
            between = (mix * real + (1 - mix) * fake).requires_grad_(True)
            slope, = torch.autograd.grad(critic(between).sum(), between, create_graph=True)
            penalty = (torch.sqrt((slope ** 2).sum(dim=1)) - 1).pow(2).mean()
            (on_fake.mean() - on_real.mean() + 10 * penalty).backward()
            assert not torch.isfinite(critic.fc1.weight.grad).all()
    return w.event


@pytest.mark.parametrize("one_batch_per_step", [False, True])
def test_a_gradient_penalty_nan_is_the_same_event_in_both_modes_and_says_how_it_came_in(
        one_batch_per_step):
    # Three batches per step: full mode said batch 0, the sentinel batch 1. With set_batch
    # the sentinel said no output required grad (a pass before, the penalty's
    # torch.autograd.grad, had taken the gradients its outputs received); both blamed
    # "nondeterministic kernels, another thread".
    full = _gradient_penalty_event("full", one_batch_per_step)
    sentinel = _gradient_penalty_event("sentinel", one_batch_per_step)
    assert (sentinel.batch, sentinel.module, sentinel.role, sentinel.origin) == \
        (full.batch, full.module, full.role, full.origin) == (0, "fc1", "weight", "grad")
    for event in (full, sentinel):
        said = " ".join(event.diagnosis.evidence)
        assert "nondeterministic" not in said and "requires grad" not in said
        assert "not through the model's outputs" in said and "gradient penalty" in said
        assert "w.replay(0, loss_fn=...)" in said
        # loss_fn gets the outputs only: the penalty's own sqrt is what to look at.
        assert "cannot be rebuilt from the outputs" in said and "+ 1e-12" in said


class ShiftedSqrt(nn.Module):
    """sqrt(|x| + 1 - shift): finite while ``shift`` stays at 0."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x.abs() + 1 - self.shift)


class CheckpointedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.bad, self.l2 = nn.Linear(16, 32), ShiftedSqrt(), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.l2(self.bad(self.l1(x)))


class CheckpointedNet(nn.Module):
    """Blocks run under activation checkpointing: their backward recomputes their forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([CheckpointedBlock() for _ in range(2)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.head(h)


def _train_changing_an_attribute_before_backward(mode: str) -> tuple[nw.NanWatch, list[bool]]:
    """Three steps; in step 1 an attribute the forward reads changes after the forward and
    before loss.backward(), so only the checkpoint's recompute makes a NaN."""
    torch.manual_seed(0)
    model = CheckpointedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = nw.watch(model, mode=mode, backward=True, on_nan="record")
    outputs_finite = []
    for step in range(3):
        out = model(torch.randn(3, 8))
        outputs_finite.append(bool(out.isfinite().all()))
        model.blocks[1].bad.shift = 101.0 if step == 1 else 0.0
        out.pow(2).mean().backward()
        model.blocks[1].bad.shift = 0.0
        optimizer.step()
        optimizer.zero_grad()
    watch.close()
    return watch, outputs_finite


def test_a_nan_only_the_checkpoint_recompute_makes_is_a_gradient_event_as_in_full_mode():
    full_watch, full_finite = _train_changing_an_attribute_before_backward("full")
    sentinel_watch, sentinel_finite = _train_changing_an_attribute_before_backward("sentinel")
    assert full_finite == sentinel_finite == [True, True, False]
    full, sentinel = full_watch.event, sentinel_watch.event
    assert (full.batch, full.module, full.role, full.origin, full.is_backward) == \
        (1, "blocks.1.l2", "weight", "grad", True)
    # Batch 1's live forward was finite (the sentinel checked its outputs): the replay's
    # forward NaN is not that forward's; the event is the gradient one, as in full mode.
    assert (sentinel.batch, sentinel.module, sentinel.role, sentinel.origin,
            sentinel.is_backward) == (1, "blocks.1.l2", "weight", "grad", True)
    assert sentinel.note.startswith("its live forward stayed finite, but the replay's forward "
                                    "made a NaN ('blocks.1.bad' output: nan)")
    trace = sentinel.trace
    assert not trace.reproduced
    assert any("'blocks.1.bad' output" in change and "live forward" in change
               for change in trace.changes)
    assert trace.first_bad["op"] == "sqrt"
    # No frame of batch 1 was recorded as it ran; the report says so and shows the replay's.
    assert sentinel.frames.empty
    report = sentinel_watch.report()
    assert "No frames of batch 1 were recorded as it ran (the replay's frames are below)." in report
    assert "Last 0" not in report
    assert "All 22 forward frames of the replay:" in report

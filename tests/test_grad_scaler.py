"""AMP loss scaling: a GradScaler's skipped steps are not events (float16 autocast on CPU).

``torch.amp.GradScaler("cpu")`` with ``torch.autocast("cpu", dtype=torch.float16)`` behaves as
on a GPU: a large initial scale overflows the float16 gradients, the scaler skips the optimizer
step and halves its scale, until the gradients fit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nanwidget as nw

from conftest import hook_count

MODES = ["full", "sentinel"]


class RootMeanSquare(nn.Module):
    """x * sqrt(mean(x**2)) per row: finite forward; a row of zeros gives a NaN gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sqrt((x * x).mean(dim=-1, keepdim=True))


class Net(nn.Module):
    def __init__(self, trap: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.rms = RootMeanSquare() if trap else nn.Identity()
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.rms(self.fc1(x))))


def _train(model: nn.Module, scaler: torch.amp.GradScaler | None, batches: int, *,
           bad_input_at: int | None = None, loss_fn=None, fused: bool = False) -> list[float]:
    """An AMP loop (float16 autocast on CPU); the scale after each step. ``fused``: Adam with
    fused=True, which the scaler calls even on a step it skips (the kernel skips it)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True) if fused else \
        torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1)
    scales = []
    for batch in range(batches):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        if batch == bad_input_at:
            x[2, 3] = float("nan")
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            loss = (loss_fn or nn.functional.mse_loss)(out.float(), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        scales.append(scaler.get_scale() if scaler is not None else 1.0)
    return scales


def _scaler(init_scale: float = 2.0 ** 24) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=init_scale)


@pytest.mark.parametrize("mode", MODES)
def test_without_grad_scaler_the_first_overflow_stops_the_run_and_says_to_pass_it(mode):
    torch.manual_seed(0)
    model, scaler = Net(), _scaler()
    with nw.watch(model, backward=True, mode=mode) as watch:
        with pytest.raises(nw.NanDetected) as caught:
            _train(model, scaler, 3)
    assert watch.event.batch == 0 and watch.event.is_backward and "inf" in watch.event.kind
    assert "pass it: nw.watch(model, grad_scaler=scaler)" in str(caught.value)
    # The diagnosis too leads with the loss scale (it led with naming the loss's op; an
    # overflow's with scaling the targets down).
    diagnosis = watch.event.diagnosis
    assert diagnosis.kind == "loss" and diagnosis.suggestion[0].startswith(
        "A GradScaler is among the training loop's variables: if it scales this loss (its "
        "scale starts at 65536), pass it: nw.watch(model, grad_scaler=scaler).")


class _Amp:
    """A training loop's own holder of its GradScaler (as accelerate's Accelerator holds it)."""

    def __init__(self) -> None:
        self.scaler = _scaler()


def test_the_fix_names_the_loops_own_variable_that_holds_the_scaler():
    # It said grad_scaler=scaler whatever the loop called it (accelerator, fabric, amp).
    torch.manual_seed(0)
    model, amp = Net(), _Amp()
    with nw.watch(model, backward=True) as watch:
        with pytest.raises(nw.NanDetected) as caught:
            _train(model, amp.scaler, 1)               # _train's own variable is "scaler"
        assert "grad_scaler=scaler)" in str(caught.value)
    with nw.watch(model, backward=True) as watch:
        with pytest.raises(nw.NanDetected) as caught:
            x, y = torch.randn(8, 16), torch.randn(8, 4)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            amp.scaler.scale(loss).backward()          # only "amp" holds it here
    assert "pass it: nw.watch(model, grad_scaler=amp)" in str(caught.value)
    assert "pass it: nw.watch(model, grad_scaler=amp)." in watch.event.diagnosis.suggestion[0]


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
@pytest.mark.parametrize("mode", MODES)
def test_steps_the_scaler_skips_are_listed_not_events(mode, fused):
    torch.manual_seed(0)
    reference = Net()
    expected_scales = _train(reference, _scaler(), 12, fused=fused)  # unwatched
    torch.manual_seed(0)
    model, scaler = Net(), _scaler()
    with nw.watch(model, backward=True, mode=mode, grad_scaler=scaler) as watch:
        scales = _train(model, scaler, 12, fused=fused)
        report = watch.report()
        skips = watch.scaler_skips
    assert scales == expected_scales  # the run itself is unchanged
    assert not watch.events
    # Every halving of the scale is one skipped step, listed with its batch and both scales.
    halvings = [(batch, before, after) for batch, (before, after) in
                enumerate(zip([2.0 ** 24] + scales, scales)) if after < before]
    assert [tuple(s) for s in skips] == halvings and len(halvings) >= 3
    assert skips[0] == nw.ScalerSkip(batch=0, scale_before=2.0 ** 24, scale_after=2.0 ** 23)
    assert report.splitlines()[-1] == (
        f"GradScaler skipped {len(skips)} steps on overflow (batches {skips[0].batch}–"
        f"{skips[-1].batch}; scale 16777216 → {skips[-1].scale_after:.10g}): not events")
    assert "scale" not in scaler.__dict__ and "update" not in scaler.__dict__  # put back
    assert hook_count(model) == 0


@pytest.mark.parametrize("mode", MODES)
def test_the_patience_th_skipped_step_in_a_row_is_an_event(mode):
    # A row of zeros through the trap: a NaN gradient at every step, whatever the scale.
    torch.manual_seed(0)
    model, scaler = Net(trap=True), _scaler(init_scale=256.0)
    original = model.fc1.forward
    model.fc1.forward = lambda x: original(x) * (torch.arange(8)[:, None] != 5)  # row 5: zeros
    with nw.watch(model, backward=True, mode=mode, grad_scaler=scaler,
                  scaler_patience=3) as watch:
        with pytest.raises(nw.NanDetected) as caught:
            _train(model, scaler, 6)
    assert len(watch.scaler_skips) == 3 and watch.scaler_skips[-1].batch == 2
    event = caught.value.event
    assert (event.batch, event.module, event.role, event.origin, event.is_backward) == (
        2, "rms", "grad_input[0]", "grad", True)
    assert "the GradScaler skipped 3 steps in a row (scale now 32)" in str(caught.value)
    assert watch.events == [event]


# A NaN loss made outside the model from its finite outputs: log(-1) gives zero gradients
# (the scaler steps), sqrt(-1) NaN ones (the scaler skips).
BAD_LOSSES = {"finite gradients": lambda out, y: torch.log(out.sum() * 0.0 - 1.0),
              "nan gradients": lambda out, y: torch.sqrt(out.sum() * 0.0 - 1.0)}


@pytest.mark.parametrize("loss", sorted(BAD_LOSSES))
@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_a_non_finite_loss_from_finite_outputs_is_an_event(mode, backward, loss):
    torch.manual_seed(0)
    model, scaler = Net(), _scaler(init_scale=256.0)
    before = [p.detach().clone() for p in model.parameters()]
    with nw.watch(model, backward=backward, mode=mode, grad_scaler=scaler) as watch:
        with pytest.raises(nw.NanDetected) as caught:
            _train(model, scaler, 3, loss_fn=BAD_LOSSES[loss])
    event = caught.value.event
    assert event.batch == 0 and watch.events == [event]
    assert "the loss handed to grad_scaler.scale() is nan: no overflow the scaler can skip" \
        in str(caught.value)
    if backward and loss == "nan gradients":  # the gradient frames' event, with the loss said
        # The loss's NaN gradient reached the model's output (the root's and fc2's).
        assert (event.module, event.role, event.origin, event.is_backward) == (
            "fc2", "grad_output[0]", "grad", True)
    else:  # the loss itself is the event
        assert (event.module, event.role, event.origin) == ("", "loss", "output")
        assert "made outside the model, in the loss computed from its outputs" \
            in str(caught.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step applied
    assert watch.scaler_skips == ([nw.ScalerSkip(0, 256.0, 128.0)] if loss == "nan gradients"
                                  and not backward else [])


@pytest.mark.parametrize("mode", MODES)
def test_a_non_finite_forward_is_an_event_as_without_a_scaler(mode):
    torch.manual_seed(0)
    model, scaler = Net(), _scaler(init_scale=256.0)
    with nw.watch(model, backward=True, mode=mode, grad_scaler=scaler):
        with pytest.raises(nw.NanDetected) as caught:
            _train(model, scaler, 4, bad_input_at=2)
    event = caught.value.event
    assert (event.batch, event.module, event.origin, event.is_backward) == (2, "fc1", "input",
                                                                            False)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
def test_a_gradient_event_the_scaler_does_not_skip_is_raised_before_the_step(fused):
    # An Inf gradient between modules that never reaches a parameter: the scaler sees finite
    # gradients and steps; the backward frames saw the Inf, so the step is stopped.
    class SquareRoot(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), SquareRoot(), nn.Linear(32, 4))
    scaler = _scaler(init_scale=1.0)
    with nw.watch(model, backward=True, grad_scaler=scaler) as watch:
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(nw.NanDetected) as caught:
            _train(model, scaler, 2, fused=fused)
    event = caught.value.event
    assert (event.batch, event.module, event.role, event.kind) == (0, "2", "grad_input[0]", "inf")
    assert "the GradScaler did not skip this step" in str(caught.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # never applied
    assert watch.scaler_skips == []


class _TwoParts(nn.Module):
    """Two heads, one optimizer each, one GradScaler for both (torch's AMP docs)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.b = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def _train_two_parts(model: _TwoParts, scaler: torch.amp.GradScaler, *, fused: bool = False,
                     b_through_the_scaler: bool = True) -> list[float]:
    """Four batches; at batch 2 b's loss is 3000 times larger: b's float16 gradients overflow,
    a's stay finite. ``b_through_the_scaler=False``: b's optimizer steps by itself."""
    optimizers = [torch.optim.Adam(part.parameters(), lr=1e-3, fused=fused)
                  for part in (model.a, model.b)]
    data = torch.Generator().manual_seed(1)
    scales = []
    for batch in range(4):
        x = torch.randn(16, 4, generator=data)
        for optimizer in optimizers:
            optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            ya, yb = model(x)
            loss = ya.float().pow(2).mean() + yb.float().pow(2).mean() * (3e3 if batch == 2 else 1)
        scaler.scale(loss).backward()
        scaler.step(optimizers[0])
        if b_through_the_scaler:
            scaler.step(optimizers[1])
        else:
            scaler.unscale_(optimizers[1])
            optimizers[1].step()
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
@pytest.mark.parametrize("mode", MODES)
def test_one_scaler_for_two_optimizers_skips_only_the_overflowed_one_and_that_is_no_event(
        mode, fused):
    # The scaler steps a (finite gradients), skips b and lowers its scale: a's step is no sign
    # that the scaler failed to skip.
    torch.manual_seed(0)
    expected_scales = _train_two_parts(_TwoParts(), _scaler(init_scale=65536.0), fused=fused)
    torch.manual_seed(0)
    model, scaler = _TwoParts(), _scaler(init_scale=65536.0)
    with nw.watch(model, backward=True, mode=mode, grad_scaler=scaler) as watch:
        scales = _train_two_parts(model, scaler, fused=fused)
    assert scales == expected_scales and watch.events == []
    assert watch.scaler_skips == [nw.ScalerSkip(2, 65536.0, 32768.0)]


@pytest.mark.parametrize("mode", MODES)
def test_the_optimizer_holding_the_overflow_stepping_past_the_scaler_is_an_event(mode):
    # b's optimizer steps by itself, not through scaler.step(): unwatched, its Inf gradients
    # apply and b's weights go NaN; watched, the step is stopped before it applies.
    torch.manual_seed(0)
    unwatched = _TwoParts()
    _train_two_parts(unwatched, _scaler(init_scale=65536.0), b_through_the_scaler=False)
    assert not all(p.isfinite().all() for p in unwatched.b.parameters())
    torch.manual_seed(0)
    model, scaler = _TwoParts(), _scaler(init_scale=65536.0)
    with nw.watch(model, backward=True, mode=mode, grad_scaler=scaler) as watch:
        with pytest.raises(nw.NanDetected) as caught:
            _train_two_parts(model, scaler, b_through_the_scaler=False)
    event = caught.value.event
    assert (event.batch, event.is_backward, event.module.split(".")[0]) == (2, True, "b")
    assert "the GradScaler did not skip this step: this optimizer was about to step with " \
        "non-finite gradients" in str(caught.value)
    assert all(p.isfinite().all() for p in model.parameters())  # the bad step never applied
    assert watch.events == [event] and watch.scaler_skips == []


def test_the_hint_is_given_for_a_float32_run_with_a_scaler_in_the_callers_variables():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    scaler = _scaler(init_scale=2.0 ** 127)  # float32 gradients overflow too
    with nw.watch(model, backward=True) as watch:
        x = torch.randn(8, 16)
        with pytest.raises(nw.NanDetected) as caught:
            scaler.scale(model(x).square().sum() * 1e4).backward()
    assert "grad_scaler=scaler" in str(caught.value)
    del scaler  # no scaler anywhere: a float32 Inf gradient gets no hint
    with nw.watch(model, backward=True) as watch:
        with pytest.raises(nw.NanDetected) as caught:
            (model(x).square().mean() * 2.0 ** 127 * 4).backward()
    assert "grad_scaler" not in str(caught.value) and watch.event.is_backward


def test_grad_scaler_takes_an_object_holding_one_and_refuses_anything_else():
    class Holder:
        def __init__(self, scaler):
            self.scaler = scaler

    model = Net()
    scaler = _scaler()
    with nw.watch(model, grad_scaler=Holder(scaler)) as watch:
        assert watch.grad_scaler is scaler
    with nw.watch(model, grad_scaler=Holder(None)) as watch:
        assert watch.grad_scaler is None and watch.parts.scaler is None

    class NativeScaler:  # timm's train.py loss_scaler: its GradScaler at ._scaler (was refused)
        def __init__(self, scaler):
            self._scaler = scaler

        def __call__(self, loss, optimizer):
            self._scaler.scale(loss).backward()
            self._scaler.step(optimizer)
            self._scaler.update()

    with nw.watch(model, grad_scaler=NativeScaler(scaler)) as watch:
        assert watch.grad_scaler is scaler
    with pytest.raises(TypeError, match="grad_scaler takes a torch.amp.GradScaler"):
        nw.watch(model, grad_scaler="scaler")
    # An optimizer passed by mistake is named by its type, not by its many-line repr.
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(TypeError) as caught:
        nw.watch(model, grad_scaler=optimizer)
    message = str(caught.value)
    assert "\n" not in message and "Parameter Group" not in message
    assert message.endswith("got a torch.optim.Adam: an optimizer, not the scaler; pass the "
                            "GradScaler whose scaler.step() steps it")
    with pytest.raises(ValueError, match="scaler_patience must be at least 1"):
        nw.watch(model, grad_scaler=scaler, scaler_patience=0)
    assert hook_count(model) == 0


class LossScalingSGD:
    """An optimizer that scales its loss itself, as Keras' LossScaleOptimizer does (the same
    methods, in plain torch): ``scale_loss(loss)`` multiplies by ``dynamic_scale``;
    ``apply(grads, params)`` divides the gradients by it and steps, or, when one is not finite,
    skips the step and halves the scale."""

    def __init__(self, params: list[nn.Parameter], lr: float = 0.01,
                 initial_scale: float = 2.0 ** 24) -> None:
        self.params, self.lr, self.initial_scale = params, lr, initial_scale
        self.dynamic_scale = torch.tensor(initial_scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.dynamic_scale

    def apply(self, grads: list[torch.Tensor], params: list[nn.Parameter]) -> None:
        with torch.no_grad():
            if not all(bool(torch.isfinite(g).all()) for g in grads):
                self.dynamic_scale /= 2
                return
            for g, p in zip(grads, params):
                p -= self.lr * g / self.dynamic_scale


def _train_scaling_itself(model: nn.Module, optimizer: LossScalingSGD, batches: int) -> None:
    """The loop Keras' fit() runs on the torch backend, under float16 autocast on CPU."""
    data = torch.Generator().manual_seed(1)
    params = list(model.parameters())
    for _ in range(batches):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        model.zero_grad()
        optimizer.scale_loss(loss).backward()
        optimizer.apply([p.grad for p in params], params)


@pytest.mark.parametrize("found", ["passed", "held by the model"])
@pytest.mark.parametrize("mode", MODES)
def test_an_optimizer_scaling_its_loss_itself_skips_steps_that_are_no_events(mode, found):
    # grad_scaler= refused it (a TypeError), and its skipped steps stopped the run.
    torch.manual_seed(0)
    model = Net()
    optimizer = LossScalingSGD(list(model.parameters()))
    if found == "passed":
        options = {"grad_scaler": optimizer}
    else:  # as a compiled Keras model holds it
        model.optimizer, options = optimizer, {}
    with nw.watch(model, backward=True, mode=mode, **options) as watch:
        _train_scaling_itself(model, optimizer, 12)
        report = watch.report()
        skips = watch.scaler_skips
    assert watch.grad_scaler is optimizer
    assert not watch.events
    assert len(skips) >= 3 and skips[0] == nw.ScalerSkip(0, 2.0 ** 24, 2.0 ** 23)
    assert skips[-1].scale_after == float(optimizer.dynamic_scale)
    assert report.splitlines()[-1].startswith(
        f"LossScalingSGD skipped {len(skips)} steps on overflow (batches 0–")
    assert "scale_loss" not in vars(optimizer) and "apply" not in vars(optimizer)  # put back
    assert hook_count(model) == 0
    with nw.watch(model, grad_scaler=None) as without:  # turned off
        assert without.grad_scaler is None and without.parts.scaler is None


def test_the_browser_status_mentions_the_skips():
    torch.manual_seed(0)
    model, scaler = Net(), _scaler()
    with nw.watch(model, backward=True, grad_scaler=scaler) as watch:
        _train(model, scaler, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            status = watch.browse().status.value
    assert "GradScaler skipped 4 steps on overflow (batches 0–3" in status


@pytest.mark.parametrize("mode", MODES)
def test_check_grad_norms_leaves_an_overflow_to_the_scaler(mode):
    # A loop that skips scaler.step() on a flagged norm would break the scaler (update() with
    # no inf check recorded): an overflow is the scaler's, not flagged; the history keeps it.
    torch.manual_seed(0)
    model, scaler = Net(), _scaler()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    flags = []
    with nw.watch(model, mode=mode, grad_scaler=scaler, grad_norm_warn=1e30) as watch:
        for _ in range(3):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().square().mean()
            scaler.scale(loss).backward()
            flags.append(watch.check_grad_norms())
            if not flags[-1]:
                scaler.step(optimizer)
            scaler.update()
        history = watch.grad_history()
    assert flags == [False, False, False] and watch.grad_events == []
    assert history["nonfinite"].any() and len(watch.scaler_skips) == 3


def test_a_watch_dropped_unclosed_lets_go_of_the_scaler_when_collected():
    import gc
    from torch.optim import optimizer as torch_optimizer
    scaler = _scaler()
    hooks = len(torch_optimizer._global_optimizer_pre_hooks)
    nw.watch(Net(), backward=True, grad_scaler=scaler)  # model and watch dropped at once
    # the scaler's own, and every watch's numbering of the step in progress
    assert "scale" in scaler.__dict__ and len(torch_optimizer._global_optimizer_pre_hooks) == \
        hooks + 2
    gc.collect()
    assert "scale" not in scaler.__dict__ and "update" not in scaler.__dict__
    assert len(torch_optimizer._global_optimizer_pre_hooks) == hooks
    _train(Net(), scaler, 2)  # the scaler works as ever


def test_a_copy_of_a_watched_scaler_acts_on_itself_and_pickles():
    import copy
    import pickle
    scaler = _scaler()
    model = Net()
    loss = torch.tensor(3.0)
    with nw.watch(model, backward=True, grad_scaler=scaler) as watch:
        twin = copy.deepcopy(scaler)  # e.g. a checkpoint helper copying the training state
        restored = pickle.loads(pickle.dumps(scaler))  # failed while watched, before
        for copied in (twin, restored):
            assert copied.scale(loss).item() == 3.0 * 2.0 ** 24  # its own (lazily made) scale
            copied.update(new_scale=8.0)
            assert copied.get_scale() == 8.0
            assert copied.scale(loss).item() == 24.0
        # the watched scaler is untouched by its copies, and still watched
        assert scaler.get_scale() == 2.0 ** 24
        _train(model, scaler, 3)
        assert len(watch.scaler_skips) >= 1
    assert "scale" not in scaler.__dict__ and "update" not in scaler.__dict__
    pickle.dumps(twin)  # a copy made while watched pickles after the watch too


# Gradients that overflow float16 at every scale the scaler tries: the model's output is
# ~1e4 ("output": the loss's gradient there passes 65504 / scale), or its inputs are ~3e3
# ("weight": a weight's gradient sums them over the batch).
def _too_large_for_float16(model: nn.Module, where: str) -> None:
    with torch.no_grad():
        if where == "output":
            model.fc2.weight.mul_(25000.0)
        else:
            model.fc1.weight.mul_(1e-3)
            original = model.fc1.forward
            model.fc1.forward = lambda x: original(x * 3000.0)


@pytest.mark.parametrize("where", ["output", "weight"])
@pytest.mark.parametrize("mode", MODES)
def test_the_patience_event_of_an_overflow_says_the_scale_and_what_overflowed(mode, where):
    torch.manual_seed(0)
    model, scaler = Net(), _scaler(init_scale=65536.0)
    _too_large_for_float16(model, where)
    with nw.watch(model, backward=True, mode=mode, grad_scaler=scaler) as watch:
        with pytest.raises(nw.NanDetected) as caught:
            _train(model, scaler, 20)
    event, skips = caught.value.event, watch.scaler_skips
    tried, now = skips[-1].scale_before, skips[-1].scale_after
    diagnosis = event.diagnosis
    assert event.kind == "inf" and diagnosis.kind == "overflow"  # was "loss" (made outside)
    assert diagnosis.summary.startswith(
        f"The gradients overflow float16 even at loss scale {tried:g}: the GradScaler skipped 8 "
        f"steps in a row (batches {skips[-8].batch}–{event.batch}), lowering its scale from "
        f"{skips[-8].scale_before:g} to {now:g}, and ")
    evidence = "\n".join(diagnosis.evidence)
    assert f"where its unscaled value passes 65504 / {tried:g} = {65504 / tried:.3g}" in evidence
    assert "The loss was finite" in evidence
    assert diagnosis.suggestion[0].startswith("Autocast in bfloat16 instead of float16")
    if where == "output":
        assert (event.module, event.role) == ("fc2", "grad_output[0]")
        assert "the gradient reaching the model's output ('fc2' (Linear), grad_output[0]) was " \
            "still Inf" in diagnosis.summary
        assert "the loss's gradient with respect to the model's output is that large" in evidence
        assert "The scaler took no step since the watch began" in evidence
        assert any("The model's output itself nearly overflows float16" in fix
                   for fix in diagnosis.suggestion)
    else:
        assert (event.module, event.role) == ("fc1", "weight")
        assert "the gradient of 'fc1.weight' is that large" in evidence
        assert any(fix.startswith("Run module 'fc1' in float32") for fix in diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
def test_the_patience_event_of_an_optimizer_scaling_its_loss_advises_in_its_users_words(mode):
    # Keras' LossScaleOptimizer (mixed_float16): its user sets precision by policy and layer
    # dtype; the fixes said torch.autocast and "needs no GradScaler".
    torch.manual_seed(0)
    model = Net()
    _too_large_for_float16(model, "weight")
    optimizer = LossScalingSGD(list(model.parameters()), initial_scale=65536.0)
    with nw.watch(model, backward=True, mode=mode, grad_scaler=optimizer) as watch:
        with pytest.raises(nw.NanDetected) as caught:
            _train_scaling_itself(model, optimizer, 20)
    diagnosis = caught.value.event.diagnosis
    assert diagnosis.kind == "overflow" and len(watch.scaler_skips) == 8
    assert "the LossScalingSGD skipped 8 steps in a row" in diagnosis.summary
    fixes = "\n".join(diagnosis.suggestion)
    assert diagnosis.suggestion[0] == (
        "Train in bfloat16 instead of float16: keras.mixed_precision.set_global_policy("
        "'mixed_bfloat16') has float32's range, so gradients this large fit, and it needs no "
        "LossScalingSGD.")
    assert "Run module 'fc1' in float32: give that layer dtype='float32'" in fixes
    assert "torch.autocast" not in fixes and "GradScaler" not in fixes


def test_without_backward_frames_the_patience_event_is_a_less_sure_overflow():
    # No backward frames: the event is the first parameter (in order) whose gradient holds
    # the Inf and the NaN it spread into, so where it overflowed is not told.
    torch.manual_seed(0)
    model, scaler = Net(), _scaler(init_scale=65536.0)
    _too_large_for_float16(model, "output")
    with nw.watch(model, grad_scaler=scaler):
        with pytest.raises(nw.NanDetected) as caught:
            _train(model, scaler, 20)
    event = caught.value.event
    diagnosis = event.diagnosis
    assert (event.module, event.role, event.kind) == ("fc1", "weight", "nan+inf")
    assert (diagnosis.kind, diagnosis.confidence) == ("overflow", "low")  # was "unknown"
    assert "the gradient of 'fc1.weight' was still NaN and Inf at 512 (batch 7)" \
        in diagnosis.summary
    assert "65504 / 512 = 128: a gradient of the backward pass is that large" \
        in "\n".join(diagnosis.evidence)
    assert diagnosis.suggestion[-1].startswith("Run the module whose gradient overflows")


class _SmallHeadContrastive(nn.Module):
    """SimCLR's shape with a projection head started small: float16 gradients through
    F.normalize's backward overflow at a large loss scale (Inf, then NaN further on) until the
    GradScaler has lowered it enough."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))
        self.head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
        for layer in self.head:
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=1e-3)
                nn.init.zeros_(layer.bias)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        z = nn.functional.normalize(self.head(self.enc(torch.cat([x1, x2]))), dim=-1)
        similarity = z @ z.t() / 0.07
        return similarity - 1e4 * torch.eye(similarity.shape[0], dtype=similarity.dtype)


def test_a_scaler_whose_overflowed_gradients_turn_nan_is_told_an_overflow():
    # At the patience-th skipped step the gradients held NaN alone (the Inf met 0 or another
    # Inf on the way): read "unknown", with "non-finite whatever the scale" as evidence.
    torch.manual_seed(0)
    model = _SmallHeadContrastive()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.Generator().manual_seed(1)
    prototypes = torch.randn(6, 16, generator=data) * 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw.watch(model, on_nan="record", grad_scaler=scaler) as w:
            for _ in range(12):
                x = prototypes[torch.randint(0, 6, (16,), generator=data)]
                views = [x + 0.5 * torch.randn(16, 16, generator=data) for _ in range(2)]
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = model(*views).float()
                n = logits.shape[0] // 2
                loss = nn.functional.cross_entropy(
                    logits, torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]))
                optimizer.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                if w.events:
                    break
    event = w.event
    assert event.kind == "nan" and len(w.scaler_skips) == 8
    assert event.diagnosis.kind == "overflow"
    assert event.diagnosis.summary.startswith("The gradients overflow float16 even at loss scale")
    assert event.diagnosis.suggestion[0].startswith("Autocast in bfloat16")
    assert "at every scale it tried" in event.note and "whatever the scale" not in event.note

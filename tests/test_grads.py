"""Gradients: backward frames, refused hooks, gradient norms and the guarded training loop."""

from __future__ import annotations

import math
import threading
import warnings

import pandas as pd
import pytest
import torch
from torch import nn

import nanwidget as nw
from nanwidget.core.grads import norms as grads_module
from nanwidget.core.schema import GRAD_HISTORY_COLUMNS
from tests.conftest import hook_count
from tests.test_hot_path import count_syncs


class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


class SqrtNet(nn.Module):
    """fc -> ReLU -> sqrt -> head: ReLU's exact zeros make sqrt's gradient infinite, forward finite."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.sqrt = Sqrt()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.sqrt(self.act(self.fc(x))))


class ResidualAddInPlace(nn.Module):
    """``h = fc(x); h += x``: writes into a submodule's output in the parent's ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)
        self.write_in_place_into_out = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h += x
        y = self.out(h)
        if self.write_in_place_into_out:  # a data-dependent branch
            y.mul_(2.0)
        return y * 1.0


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()


def _grads(frames: pd.DataFrame, batch: int, module: str) -> pd.Series:
    """abs_max of each gradient role of one module's backward frame."""
    rows = frames[(frames.phase == "backward") & (frames.batch == batch) & (frames.module == module)]
    return rows.set_index("role")["abs_max"]


def test_nan_born_in_backward_in_the_first_batch_is_an_event_naming_the_sqrt_module() -> None:
    model = SqrtNet()
    x = torch.randn(16, 4)
    with nw.watch(model, backward=True, on_nan="record") as w:
        _step(model, x)  # the very first batch: no calibration, no blind batch
        frames = w.frames()
    forward = frames[frames.phase == "forward"]
    assert not forward[["nan", "inf"]].any().any()
    assert len(w.events) == 1
    event = w.events[0]
    assert (event.batch, event.module, event.module_type) == (0, "sqrt", "Sqrt")
    assert (event.role, event.kind, event.origin, event.is_backward) == (
        "grad_input[0]", "inf", "grad", True)
    backward = frames[frames.phase == "backward"]
    assert set(backward.batch) == {0}
    # Backward frames continue the numbering after the forward frames of their batch, in
    # backward execution order: the last layer first (with the root, which returns its output:
    # the child is listed first, as in forward frames), the first layer last.
    assert backward.frame.min() > forward.frame.max()
    order = backward.drop_duplicates("frame").sort_values("frame").module.tolist()
    assert order == ["head", "", "sqrt", "act", "fc"]
    sqrt = backward[backward.module == "sqrt"].set_index("role")
    assert not sqrt.loc["grad_output[0]", "inf"] and sqrt.loc["grad_input[0]", "inf"]


class GradientInForward(nn.Module):
    """A PINN's forward: its output's gradient with respect to the input, taken inside."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_(True)
        u = self.net(x)
        du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        return torch.cat([u, du], -1)


def test_a_gradient_taken_inside_the_forward_is_no_backward_pass_of_the_batch() -> None:
    # Its frames were a second backward pass, recorded in the middle of the forward frames.
    torch.manual_seed(0)
    model = GradientInForward()
    with nw.watch(model, backward=True) as w:
        model(torch.randn(6, 2)).square().mean().backward()
        frames = w.frames()
        assert w.parts.backward.passes == 1
    forward = frames[frames.phase == "forward"]
    backward = frames[frames.phase == "backward"].drop_duplicates("frame")
    # One backward frame per module call, all from loss.backward(), after the forward's.
    assert sorted(backward.module) == ["", "net", "net.0", "net.1", "net.2"]
    assert backward.frame.min() > forward.frame.max()


def test_the_forwards_own_backward_pass_is_told_from_autograds_own_thread_too() -> None:
    # On a GPU autograd runs a pass on a thread of its own, while the forward's thread waits.
    seen: list[bool] = []

    class AskFromAnotherThread(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            worker = threading.Thread(target=lambda: seen.append(w.recorder.root_forward_running))
            worker.start()
            worker.join()
            return x * 2

    model = AskFromAnotherThread()
    with nw.watch(model, backward=True) as w:
        model(torch.ones(2, requires_grad=True)).sum().backward()
        seen.append(w.recorder.root_forward_running)  # after the forward: the batch's pass
    assert seen == [True, False]


def test_backward_nan_raises_nan_detected_out_of_loss_backward() -> None:
    model = SqrtNet()
    x = torch.randn(16, 4)
    with nw.watch(model, backward=True) as w:
        loss = model(x).sum()
        with pytest.raises(nw.NanDetected) as caught:
            loss.backward()
    assert caught.value.event.is_backward
    assert caught.value.event.module == "sqrt"
    assert caught.value.event.batch == 0
    assert "backward" in str(caught.value)
    assert w.event is caught.value.event


def test_backward_nan_with_on_nan_warn_warns_and_training_goes_on() -> None:
    model = SqrtNet()
    x = torch.randn(16, 4)
    with nw.watch(model, backward=True, on_nan="warn") as w:
        with pytest.warns(nw.NanWarning, match="grad_input"):
            _step(model, x)
        assert model.fc.weight.grad is not None
    assert w.event.origin == "grad"


def test_relu_inplace_and_the_linear_it_overwrites_get_their_true_gradients() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    x = torch.randn(8, 4)
    # Reference gradients, without nanwidget: of the Linear's output and of the ReLU's output.
    h = model[0](x)
    h.retain_grad()
    r = torch.relu(h)
    r.retain_grad()
    model[2](r).sum().backward()
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: no module is skipped any more
        with nw.watch(model, backward=True, on_nan="record", max_frames=50) as w:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            model(x).sum().backward()
            frames = w.frames()
            optimizer.step()
    assert set(frames[frames.phase == "backward"].module) == {"", "0", "1", "2"}
    # The Linear's output gradient is the one of the value it returned (before ReLU wrote on
    # it): ReLU's mask is in it. The ReLU's input gradient is the same; its output's is not.
    linear, relu = _grads(frames, 0, "0"), _grads(frames, 0, "1")
    assert linear["grad_output[0]"] == h.grad.abs().max().item()
    assert relu["grad_input[0]"] == h.grad.abs().max().item()
    assert relu["grad_output[0]"] == r.grad.abs().max().item()
    rows = frames[(frames.phase == "backward") & (frames.module == "1")].set_index("role")
    assert rows.loc["grad_input[0]", "abs_min"] == 0.0 < rows.loc["grad_output[0]", "abs_min"]
    assert w.events == []


def test_residual_add_in_place_is_recorded_from_the_first_batch_with_the_fc_gradient() -> None:
    model = ResidualAddInPlace()
    x = torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nw.watch(model, backward=True, on_nan="record", max_frames=50) as w:
            h = model.fc(x)
            h.retain_grad()
            out = model.out(h + x)
            out.sum().backward()  # the reference gradient of fc's output, through the residual
            expected = h.grad.abs().max().item()
            model.zero_grad()
            w.step()
            _step(model, x)
            frames = w.frames()
    assert set(frames[(frames.phase == "backward") & (frames.batch == 1)].module) == {"", "fc", "out"}
    assert _grads(frames, 1, "fc")["grad_output[0]"] == pytest.approx(expected)


def test_in_place_write_in_a_data_dependent_branch_never_breaks_the_forward() -> None:
    model = ResidualAddInPlace()
    x = torch.randn(8, 4)
    with nw.watch(model, backward=True, on_nan="record", max_frames=50) as w:
        _step(model, x)
        model.write_in_place_into_out = True
        _step(model, x)  # no "BackwardHookFunction" error: nothing is wrapped
        frames = w.frames()
        # 'out' returned y before the write: its gradient is the value it produced (x2 later).
        before, after = _grads(frames, 0, "out"), _grads(frames, 1, "out")
        assert after["grad_output[0]"] == pytest.approx(2 * before["grad_output[0]"])
        assert _grads(frames, 1, "")["grad_output[0]"] == before["grad_output[0]"]
    assert hook_count(model) == 0


@pytest.mark.parametrize("depth", [1, 8])
def test_backward_frames_cost_one_host_sync_per_backward_pass(depth: int) -> None:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(8, 8), nn.GELU()]
    model = nn.Sequential(*layers)
    x = torch.randn(4, 8)
    with nw.watch(model, backward=True, on_nan="record") as w:
        with count_syncs() as counts:
            loss = model(x).sum()
            loss.backward()
        # One for the backward; one for the forward on the torch path (the native CPU kernel
        # reads the forward's tensors without going through torch).
        from nanwidget.core import native
        assert counts["total"] == (1 if native.available() else 2), counts
        frames = w.frames()
        assert (frames.phase == "backward").sum() > 0
        with count_syncs() as counts:
            w.check_grad_norms()
        assert counts["total"] == 1, counts  # every parameter's norm in one copy


def test_hooks_all_removed_after_close_keeping_the_users_own() -> None:
    model = SqrtNet()
    model.head.register_full_backward_hook(lambda m, gi, go: None)
    model.fc.register_forward_hook(lambda m, i, o: None)
    before = hook_count(model)
    w = nw.watch(model, backward=True, on_nan="record")
    _step(model, torch.randn(4, 4))
    assert hook_count(model) > before
    w.close()
    assert hook_count(model) == before
    w.close()  # idempotent
    assert hook_count(model) == before


def test_backward_false_adds_no_backward_hooks_but_grad_norms_work() -> None:
    model = SqrtNet()
    with nw.watch(model, on_nan="record") as w:
        _step(model, torch.randn(4, 4))
        assert sum(len(m._backward_hooks) for m in model.modules()) == 0
        assert w.check_grad_norms() is False
        assert len(w.grad_history()) == 4
    assert (w.frames().phase == "forward").all()


def test_check_grad_norms_names_the_parameter_with_a_nonfinite_gradient() -> None:
    model = SqrtNet()
    with nw.watch(model, on_nan="record") as w:
        _step(model, torch.randn(4, 4))
        model.head.bias.grad[0] = float("nan")
        model.fc.weight.grad[0, 0] = float("inf")
        assert w.check_grad_norms() is True
        events = w.grad_events
    assert {(e.param, e.batch) for e in events} == {("head.bias", 0), ("fc.weight", 0)}
    by_param = {e.param: e for e in events}
    assert math.isnan(by_param["head.bias"].norm) and by_param["fc.weight"].norm == math.inf
    assert by_param["fc.weight"].threshold is None
    history = w.grad_history()
    assert list(history.columns) == GRAD_HISTORY_COLUMNS
    assert history.set_index("param").loc["fc.weight", "nonfinite"]


def test_check_grad_norms_matches_torch_norms_and_flags_above_threshold() -> None:
    model = SqrtNet()
    with nw.watch(model, grad_norm_warn=1.0, on_nan="record") as w:
        _step(model, torch.randn(8, 4) + 3)
        assert w.check_grad_norms() is True
        history = w.grad_history().set_index("param")
        for name, parameter in model.named_parameters():
            assert history.loc[name, "norm"] == pytest.approx(parameter.grad.norm().item(), rel=1e-5)
        flagged = {e.param for e in w.grad_events}
        expected = {n for n, p in model.named_parameters() if p.grad.norm().item() > 1.0}
        assert flagged == expected and flagged
        assert all(e.threshold == 1.0 for e in w.grad_events)


def test_half_precision_gradients_do_not_overflow_their_norm() -> None:
    layer = nn.Linear(4, 4).half()
    with nw.watch(layer, on_nan="record") as w:
        layer.weight.grad = torch.full_like(layer.weight, 60000.0)
        assert w.check_grad_norms() is False
        assert w.grad_history().set_index("param").loc["weight", "norm"] == pytest.approx(240000.0)


def _diverging_regression() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    x = torch.randn(32, 4) * 3
    y = x.sum(dim=1, keepdim=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, optimizer, x, y


def test_exploding_gradients_are_flagged_the_batch_before_the_forward_nan() -> None:
    model, optimizer, x, y = _diverging_regression()
    with nw.watch(model, grad_norm_warn=1e4, on_nan="record") as w:
        for _ in range(200):
            optimizer.zero_grad()
            out = model(x)
            if w.events:
                break
            nn.functional.mse_loss(out, y).backward()
            w.check_grad_norms()
            optimizer.step()
    assert w.events, "the model should diverge within 200 steps"
    nan_batch = w.events[0].batch
    flagged_batches = {e.batch for e in w.grad_events}
    assert nan_batch - 1 in flagged_batches
    assert min(flagged_batches) < nan_batch
    history = w.grad_history()
    assert history.batch.max() == nan_batch - 1


def test_grad_history_is_bounded_and_keeps_early_batches_merged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grads_module, "GRAD_HISTORY_FULL_BATCHES", 10)
    monkeypatch.setattr(grads_module, "GRAD_HISTORY_WINDOWS", 4)
    monkeypatch.setattr(grads_module, "GRAD_HISTORY_WINDOW", 2)
    model = nn.Linear(3, 1)
    x = torch.randn(4, 3)
    with nw.watch(model, on_nan="record") as w:
        for step in range(80):
            model.zero_grad()
            (model(x).sum() * (step + 1)).backward()
            w.check_grad_norms()
        history = w.grad_history()
        window = w.parts.grads.history.window  # doubles as the windows merge
    n_params = 2
    # At most the full-resolution batches (plus one window about to be merged) and 4 windows.
    assert len(history) <= (10 + window + 4) * n_params
    assert len(history) < 80 * n_params / 2  # far fewer rows than batches x parameters
    assert history.batch.min() == 0 and history.batch_end.max() == 79
    weight = history[history.param == "bias"].sort_values("batch")
    # bias grad norm = 4 * (step + 1): a merged window keeps its largest norm.
    first = weight.iloc[0]
    assert first.batch_end > first.batch
    assert first.norm == pytest.approx(4.0 * (first.batch_end + 1))
    assert (weight.tail(10).batch == list(range(70, 80))).all()


def test_guard_loop_on_a_diverging_model_returns_the_losses_and_the_event() -> None:
    model, optimizer, x, y = _diverging_regression()
    loader = [(x, y)] * 200
    before = hook_count(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        losses, event = nw.train_with_nan_guard(model, loader, nn.functional.mse_loss, optimizer,
                                                progress=False)
    assert event is not None
    assert 2 < len(losses) < 200
    assert all(math.isfinite(v) for v in losses[:-1])
    assert losses[0] > 0 and max(losses[:-1]) > losses[0] * 100  # it did diverge first
    assert event.batch >= len(losses) - 1
    assert hook_count(model) == before


def test_guard_loop_skips_the_step_on_a_nonfinite_gradient_norm() -> None:
    torch.manual_seed(0)
    model = SqrtNet()
    parameters_before = [p.detach().clone() for p in model.parameters()]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).pow(2).mean() + model.fc.weight.abs().sqrt().sum() * 0.0

    model.fc.weight.data[0, 0] = 0.0  # sqrt'(0) = inf: a non-finite weight gradient
    parameters_before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(8, 4), torch.randn(8, 1))] * 5
    losses, event = nw.train_with_nan_guard(model, loader, loss_fn, optimizer, backward=False,
                                            progress=False)
    assert len(losses) == 1 and math.isfinite(losses[0])
    assert (event.module, event.role, event.origin, event.is_backward) == ("fc", "weight", "grad", True)
    assert event.kind == "nan"  # 0 * inf
    for before, after in zip(parameters_before, model.parameters()):
        assert torch.equal(before, after)


def test_guard_loop_on_a_healthy_model_runs_max_batches_with_dict_batches() -> None:
    class KeywordModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, features: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return self.fc(features)

    model = KeywordModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 4)
    loader = [{"features": x, "target": x.sum(1, keepdim=True)}] * 10
    losses, event = nw.train_with_nan_guard(
        model, loader, lambda out, batch: nn.functional.mse_loss(out, batch["target"]), optimizer,
        max_batches=6, progress=False)
    assert event is None and len(losses) == 6
    assert losses[-1] < losses[0]
    assert hook_count(model) == 0


def test_guard_loop_reports_a_nonfinite_loss() -> None:
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = [(torch.randn(4, 4), torch.randn(4, 1))] * 3
    losses, event = nw.train_with_nan_guard(
        model, loader, lambda out, target: (out - target).mean() / 0.0 * 0.0, optimizer,
        progress=False)
    assert len(losses) == 1 and math.isnan(losses[0])
    assert (event.module, event.role, event.batch, event.origin) == ("<loss_fn>", "output", 0, "output")


def test_guard_loop_rejects_on_nan_and_bad_batches_and_removes_hooks() -> None:
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(TypeError, match="on_nan"):
        nw.train_with_nan_guard(model, [], nn.functional.mse_loss, optimizer, on_nan="raise")
    with pytest.raises(TypeError, match="pairs or dicts"):
        nw.train_with_nan_guard(model, [torch.randn(2, 4)], nn.functional.mse_loss, optimizer,
                                progress=False)
    assert hook_count(model) == 0


def test_guard_loop_progress_line_on_stderr_without_tqdm(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import builtins
    real_import = builtins.__import__

    def no_tqdm(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("tqdm"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = [(torch.randn(4, 4), torch.randn(4, 1))] * 3
    nw.train_with_nan_guard(model, loader, nn.functional.mse_loss, optimizer, progress=True)
    assert "nanwidget: batch 1/3" in capsys.readouterr().err


def test_plot_grad_norms_draws_one_line_per_parameter_and_marks_nonfinite() -> None:
    from matplotlib.figure import Figure

    from nanwidget.plots.grads import plot_grad_norms

    model = nn.Linear(3, 1)
    with nw.watch(model, grad_norm_warn=5.0, on_nan="record") as w:
        for step in range(5):
            model.zero_grad()
            (model(torch.ones(2, 3)).sum() * (step + 1)).backward()
            if step == 4:
                model.bias.grad.fill_(float("inf"))
            w.check_grad_norms()
        history = w.grad_history()
    figure = plot_grad_norms(history, threshold=5.0)
    assert isinstance(figure, Figure)
    axes = figure.axes[0]
    labels = [line.get_label() for line in axes.get_lines()]
    assert "weight" in labels and "bias" in labels
    assert any("non-finite" in str(c.get_label()) for c in axes.collections)
    empty = plot_grad_norms(pd.DataFrame(columns=GRAD_HISTORY_COLUMNS))
    assert isinstance(empty, Figure)


def test_backward_frame_stats_are_the_gradients_abs_min_and_max(reduction_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    seen: dict[str, torch.Tensor] = {}
    model[2].register_full_backward_hook(lambda m, gi, go: seen.update(out=go[0].detach().clone(),
                                                                        inp=gi[0].detach().clone()))
    x = torch.randn(5, 4)
    with nw.watch(model, backward=True, on_nan="record") as w:
        model(x).pow(2).sum().backward()
        frames = w.frames()
    rows = frames[(frames.phase == "backward") & (frames.batch == 0) & (frames.module == "2")]
    rows = rows.set_index("role")
    for role, tensor in (("grad_output[0]", seen["out"]), ("grad_input[0]", seen["inp"])):
        assert rows.loc[role, "abs_max"] == tensor.abs().max().item()
        assert rows.loc[role, "abs_min"] == tensor.abs().min().item()


class _NanGradientAtStep(torch.autograd.Function):
    """Identity forward; the gradient of step ``bad`` (only) turns NaN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, step: int, bad: int) -> torch.Tensor:
        ctx.poisoned = step == bad
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad * math.nan if ctx.poisoned else grad), None, None


class _StepCell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, step: int) -> torch.Tensor:
        return torch.tanh(_NanGradientAtStep.apply(self.linear(h), step, 1))


class _Unrolled(nn.Module):
    """One cell called four times per forward, as an RNN written as a Python loop."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = _StepCell()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for step in range(4):
            h = self.cell(h, step)
        return h


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_reused_modules_backward_frame_carries_the_call_whose_gradient_it_holds(mode):
    # Backward runs the cell's calls last to first; the NaN is born in step 1's gradient.
    model = _Unrolled()
    seen: dict[int, float] = {}
    h = torch.randn(2, 8)

    def keep_output_grad(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: seen.__setitem__(args[1], grad.abs().max().item()))

    with nw.watch(model, mode=mode, backward=True, on_nan="record") as w:
        handle = model.cell.register_forward_hook(keep_output_grad)
        model(h).sum().backward()
        handle.remove()
    event = w.event
    assert (event.module, event.call, event.role, event.origin) == ("cell", 1, "grad_input[0]",
                                                                      "grad")
    frames = event.frames
    cell = frames[(frames.module == "cell") & (frames.phase == "backward")
                  & (frames.role == "grad_output[0]")]
    assert sorted(cell.call) == [1, 2, 3]  # the window ends at the event: call 0 comes later
    for call, largest in zip(cell.call, cell.abs_max):
        assert largest == pytest.approx(seen[call])


class _NanGradient(torch.autograd.Function):
    """Passes its input on; its backward makes NaN (a backward op that breaks)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class _BreaksInBackward(nn.Module):
    def forward(self, x):
        return _NanGradient.apply(x)


class _ReturnsWhatItUsesInside(nn.Module):
    """Returns a tensor it also uses further on (as a KV cache, or a seq2seq model's encoder
    output, is returned and used inside): that output's gradient comes from inside too."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.breaks, self.decoder = nn.Linear(4, 4), _BreaksInBackward(), nn.Linear(4, 4)

    def forward(self, x):
        hidden = self.encoder(x)
        return self.decoder(self.breaks(hidden)), hidden


@pytest.mark.parametrize("mode", ["full", "sentinel", "sentinel without loss_fn"])
def test_a_nan_made_inside_is_not_blamed_on_an_output_it_reaches_later(mode):
    # The loss only uses the first output; the NaN that 'breaks' makes in backward reaches the
    # second output's gradient late in the pass. It was filed in the model's first backward
    # frame (opened when the loss's gradient arrived), so the event was the root's
    # grad_output[1] and the diagnosis "made in the loss, outside the model".
    # Without a loss_fn the sentinel replays the backward from the gradients its outputs
    # received: the second one's holds the NaN made inside, which the replay brings in from
    # outside too; the replay still finds the op that made it, so the loss is not blamed.
    torch.manual_seed(0)
    model = _ReturnsWhatItUsesInside()
    options = {"full": {}, "sentinel": {"mode": "sentinel", "loss_fn": lambda out: out[0].sum()},
               "sentinel without loss_fn": {"mode": "sentinel"}}[mode]
    with nw.watch(model, on_nan="record", backward=True, **options) as w:
        out, _ = model(torch.randn(2, 4))
        out.sum().backward()
    event = w.event
    assert event is not None and event.is_backward
    assert event.module == "breaks" and event.role.startswith("grad_input"), event
    assert event.diagnosis is not None and event.diagnosis.kind != "loss"


class Cache:
    """Stands for transformers' key/value cache base class (the watch knows it by its name)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []


class DynamicCache(Cache):
    pass


class _CachingLayer(nn.Module):
    def __init__(self, breaks: bool) -> None:
        super().__init__()
        self.key = nn.Linear(4, 4)
        self.breaks = _BreaksInBackward() if breaks else nn.Identity()
        self.out = nn.Linear(4, 4)

    def forward(self, x, cache=None):
        key = self.key(x)
        cache.keys.append(key)
        return self.out(self.breaks(key) + x)


class _CachingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_CachingLayer(breaks=True), _CachingLayer(breaks=False)])

    def forward(self, x):
        cache = DynamicCache()
        for layer in self.layers:
            x = layer(x, cache=cache)
        return x


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_kv_cache_handed_to_a_layer_is_no_input_of_its_backward_frame(mode):
    # Every layer gets the whole cache: layer 1's backward frame (opened first) took the
    # gradient of layer 0's keys as its 'grad_kwarg:cache.keys[0]', which arrives late in the
    # pass, after layer 0's backward made the NaN: the event named layer 1.
    torch.manual_seed(0)
    model = _CachingModel()
    options = {"mode": "sentinel", "loss_fn": lambda out: out.sum()} if mode == "sentinel" \
        else {}
    with nw.watch(model, on_nan="record", backward=True, **options) as w:
        model(torch.randn(2, 4)).sum().backward()
    event = w.event
    assert event is not None and event.is_backward
    assert event.module == "layers.0.breaks" and event.role.startswith("grad_input"), event
    if mode == "full":
        roles = w.frames().query("phase == 'backward'").role
        assert not roles.str.startswith("grad_kwarg:cache").any()


class _WideInput(nn.Module):
    """Linear -> ReLU -> Linear whose first weight is tiny: inputs of 1e20 keep every activation
    and every ``grad_input`` finite, but the first weight's gradient (input x gradient, summed
    over the batch) passes float32's largest."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight.mul_(1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))


def _train_wide(mode: str, **options) -> tuple[list[nw.NanEvent], pd.DataFrame, list[bool]]:
    model = _WideInput()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.full((8, 4), 1e20)
    finite_weight_grad = []
    with nw.watch(model, mode=mode, backward=True, on_nan="record", **options) as w:
        for _ in range(2):
            (model(x) * 1e19).sum().backward()
            finite_weight_grad.append(bool(torch.isfinite(model.fc.weight.grad).all()))
            optimizer.step()
            optimizer.zero_grad()
        frames = w.frames()
    return w.events, frames, finite_weight_grad


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_weight_gradient_that_overflows_is_an_event_in_its_own_batch(mode, reduction_path) -> None:
    # Every grad_input stays finite; only fc.weight's gradient overflows. Full mode saw it one
    # batch late, as a weight the optimizer step made non-finite ("corrupted weight"); the
    # sentinel saw it but its replay called it "not reproduced" (frames held no weight
    # gradient).
    events, frames, finite_weight_grad = _train_wide(mode)
    assert finite_weight_grad[0] is False
    first = events[0]
    assert (first.batch, first.module, first.role, first.kind, first.origin, first.is_backward) \
        == (0, "fc", "weight", "inf", "grad", True)
    assert "not reproduced" not in str(first.note or "")
    own = frames[(frames.batch == 0) & (frames.phase == "backward") & (frames.module == "fc")]
    row = own.set_index("role").loc["weight"]
    assert bool(row["inf"]) and not bool(row["nan"])
    assert not own.set_index("role").loc["grad_output[0]", ["nan", "inf"]].any()


def test_a_weight_gradient_overflow_is_diagnosed_as_an_overflow_with_the_loss() -> None:
    events, _, _ = _train_wide("full", loss_fn=lambda output: (output * 1e19).sum())
    diagnosis = events[0].diagnosis
    assert diagnosis.kind == "overflow"
    assert "backward" in diagnosis.summary and "'fc'" in diagnosis.summary


def test_a_weight_gradient_overflow_without_the_loss_is_replayed_from_the_output_gradient():
    # No loss_fn: the diagnosis replays the backward pass from the gradient the output received
    # (it said "overflow, medium" from the frames alone, without the op).
    events, _, _ = _train_wide("full")
    diagnosis = events[0].diagnosis
    assert (diagnosis.kind, diagnosis.confidence) == ("overflow", "high")
    assert diagnosis.summary.startswith("mm in module 'fc' (Linear) during the backward pass at ")
    assert "It ran in the backward of AddmmBackward0." in diagnosis.evidence
    assert any("sums over the batch" in line for line in diagnosis.evidence)  # its frames' word
    assert any("mean over the batch" in line for line in diagnosis.suggestion)


def test_a_weight_gradient_overflow_without_a_replay_is_told_from_its_frames() -> None:
    # No batch held (keep_batches=0), so no replay: the frames must say it.
    events, _, _ = _train_wide("full", keep_batches=0)
    diagnosis = events[0].diagnosis
    assert (diagnosis.kind, diagnosis.confidence) == ("overflow", "medium")
    assert "'fc.weight'" in diagnosis.summary and "float32" in diagnosis.summary
    assert any("1e+20" in line for line in diagnosis.evidence)  # the inputs' scale
    assert any("mean over the batch" in line for line in diagnosis.suggestion)


def test_a_weight_gradient_overflow_under_autocast_is_told_in_the_dtype_it_was_computed_in():
    # float32 parameters, float16 autocast: the weight's gradient is computed in float16 (it
    # overflows at 65504) and only stored as float32; the words must say float16, and the
    # fixes must name the GradScaler.
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x = torch.full((64, 4), 100.0)
    with nw.watch(model, backward=True, on_nan="record") as w:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        (out.float().sum() * 1000).backward()
    assert torch.isinf(model.weight.grad).any() and model.weight.grad.dtype == torch.float32
    event = w.events[0]
    assert (event.module, event.role, event.origin) == ("", "weight", "grad")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "overflow" and "overflowed float16" in diagnosis.summary
    assert any("computed in float16, stored as float32" in line for line in diagnosis.evidence)
    assert any("GradScaler" in line for line in diagnosis.suggestion)


class _Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 32), nn.ReLU())
        self.v = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v(self.body(x)).squeeze(-1)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_weight_gradient_overflow_from_targets_on_a_large_scale_says_to_scale_them(mode):
    # A float16 critic regressing on returns of ~1e5 with a mean loss: 'v' receives a gradient
    # of ~1.25e4 per row, its inputs are small, and its bias's gradient sums that over the
    # batch. The fixes led with "normalise the inputs of 'v'" and "use a mean instead of a
    # sum": neither can help.
    torch.manual_seed(0)
    critic = _Critic().half()
    observations = torch.randn(16, 4).half()
    returns = 1e5 + 1000 * torch.rand(16)
    with nw.watch(critic, mode=mode, backward=True, on_nan="record") as w:
        (critic(observations).float() - returns).pow(2).mean().backward()
    event = w.events[0]
    assert (event.module, event.role, event.origin, event.is_backward) == ("v", "bias", "grad",
                                                                            True)
    diagnosis = event.diagnosis
    assert diagnosis.kind == "overflow"
    assert diagnosis.suggestion[0].startswith("Scale down the gradient module 'v' receives (abs "
                                              "max 1.2")
    assert "float32" in diagnosis.suggestion[1]
    assert not any(fix.startswith(("Normalise the inputs", "Reduce the loss with a mean"))
                   for fix in diagnosis.suggestion)


class _SharedBodyActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.pi = nn.Linear(16, 2)
        self.v = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.pi(h), self.v(h).squeeze(-1)


@pytest.mark.filterwarnings(r"ignore:std\(\)")  # of one element: the NaN wanted here
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_that_enters_through_one_of_two_heads_on_a_shared_body_names_that_head(mode):
    # The policy term's advantage is normalised by the std of one element (NaN): only 'pi'
    # receives a NaN gradient. 'v' ran its backward first, and its grad_input (the body's
    # output's total gradient, pi's NaN share included) made the event name 'v', which
    # received a finite gradient.
    torch.manual_seed(0)
    model = _SharedBodyActorCritic()
    with nw.watch(model, mode=mode, backward=True, on_nan="record") as w:
        logits, value = model(torch.randn(1, 4))
        advantage = (1.0 - value).detach()
        advantage = (advantage - advantage.mean()) / advantage.std()  # std of one element: NaN
        policy_loss = -(torch.log_softmax(logits, -1)[:, 0] * advantage).mean()
        (policy_loss + (1.0 - value).pow(2).mean()).backward()
    event = w.events[0]
    assert (event.module, event.role, event.is_backward) == ("pi", "grad_output[0]", True)
    assert event.diagnosis.kind == "loss"
    assert "the one 'pi' (Linear) received, grad_output[0]" in event.diagnosis.evidence[-1]
    if mode == "full":
        frames = w.frames()
        received = frames[(frames.module == "v") & (frames.role == "grad_output[0]")]
        assert not (received.nan | received.inf).any()  # 'v' received a finite gradient


def test_backward_frames_hold_each_trainable_parameters_gradient_once() -> None:
    torch.manual_seed(0)
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight  # tied: the embedding owns it (first in named_modules)
    frozen = nn.Linear(4, 4)
    frozen.requires_grad_(False)
    attention = nn.MultiheadAttention(4, 1, batch_first=True)
    model = nn.ModuleDict({"embed": embed, "frozen": frozen, "attn": attention, "head": head})

    def run(tokens: torch.Tensor) -> torch.Tensor:
        h = frozen(embed(tokens))
        h = attention(h, h, h, need_weights=False)[0]
        return head(h)

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return run(tokens)

    wrapper = Wrapper()
    tokens = torch.randint(0, 10, (2, 3))
    with nw.watch(wrapper, backward=True, on_nan="record") as w:
        wrapper(tokens).square().sum().backward()
        frames = w.frames()
    grads = frames[(frames.phase == "backward") & ~frames.role.str.startswith("grad_")]
    by_module = grads.groupby("module")["role"].apply(sorted).to_dict()
    assert by_module == {
        "inner.embed": ["weight"],  # the tied weight, once, with its summed gradient
        # out_proj's forward never runs (MultiheadAttention reads its weight): no call of its
        # own, its gradients are in the frame of the module that used them
        "inner.attn": ["in_proj_bias", "in_proj_weight", "out_proj.bias", "out_proj.weight"],
    }
    weight = grads[(grads.module == "inner.embed")].iloc[0]
    assert weight["abs_max"] == embed.weight.grad.abs().max().item()
    assert weight["abs_min"] == embed.weight.grad.abs().min().item()


class WeightsInAParameterDict(nn.Module):
    """Keeps its weights in a ParameterDict it never calls (as Keras' torch backend does); its
    bias gets a NaN gradient (the gradient of sqrt at 0 times 0) while every value stays
    finite."""

    def __init__(self) -> None:
        super().__init__()
        self.params = nn.ParameterDict({"kernel": nn.Parameter(torch.randn(4, 2)),
                                        "bias": nn.Parameter(torch.zeros(2))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.params["bias"]
        return x @ self.params["kernel"] + bias + torch.sqrt(bias - bias)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_event_of_a_parameter_dict_never_called_names_the_module_that_ran(mode):
    # The event named "'params' (ParameterDict, call 0)": a container never called made no
    # call; its gradients arrive during the backward of the module that read it.
    torch.manual_seed(0)
    model = WeightsInAParameterDict()
    with nw.watch(model, mode=mode, backward=True, on_nan="record") as w:
        model(torch.randn(3, 4)).sum().backward()
    event = w.event
    assert (event.batch, event.module, event.module_type, event.call, event.role, event.kind,
            event.origin) == (0, "", "WeightsInAParameterDict", 0, "params.bias", "nan", "grad")
    assert "'params' (ParameterDict" not in event.summary()
    backward = event.frames[event.frames.phase == "backward"]
    assert "params" not in set(backward.module)
    assert {"params.kernel", "params.bias"} <= set(backward[backward.module == ""].role)


def test_a_parameter_unfrozen_while_watched_has_its_gradient_entries_and_stays_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model[0].requires_grad_(False)  # gradual unfreezing: the first layer trains later
    x = torch.randn(3, 4)
    with nw.watch(model, backward=True, on_nan="record") as w:
        assert not model[0].weight.requires_grad and model[0].weight.grad is None
        model(x).sum().backward()
        model[0].requires_grad_(True)
        model(x).sum().backward()
        frames = w.frames()
    grads = frames[(frames.phase == "backward") & ~frames.role.str.startswith("grad_")]
    first = grads[grads.module == "0"]
    assert list(first.batch) == [1, 1] and sorted(first.role) == ["bias", "weight"]
    assert first.set_index("role").loc["weight", "abs_max"] == \
        model[0].weight.grad.abs().max().item()
    assert hook_count(model) == 0


def _dropped_backward_watch() -> tuple:
    """Weak references to a model and its backward watch, both dropped without ``close()``
    after a step that makes an event (a helper: the event's GradScaler hint reads its callers'
    locals, and a frame's snapshot of them lives as long as the frame)."""
    import weakref
    model = SqrtNet()
    watch = nw.watch(model, backward=True, on_nan="record")
    _step(model, torch.randn(4, 4))
    return weakref.ref(model), weakref.ref(watch)


def test_a_watch_with_backward_dropped_unclosed_lets_its_model_be_collected() -> None:
    # The parameters' gradient hooks must not hold the model: the garbage collector does not
    # see a tensor's hooks, so such a cycle would never be freed.
    import gc
    alive = _dropped_backward_watch()
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True]


def test_a_model_saved_or_copied_under_a_backward_watch_carries_no_hook() -> None:
    import copy
    import io
    model = SqrtNet()
    with nw.watch(model, backward=True, on_nan="record"):
        _step(model, torch.randn(4, 4))
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        twin = copy.deepcopy(model)
    for copied in (loaded, twin):
        assert hook_count(copied) == 0
        _step(copied, torch.randn(4, 4))  # trains on its own


class RefusesNonFiniteGradient(torch.autograd.Function):
    """Identity whose backward raises on a non-finite gradient (an adjoint ODE solver's
    'non-finite values in state' assert): the backward pass raises after the NaN is made."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if not torch.isfinite(grad).all():
            raise FloatingPointError("non-finite gradient in the state")
        return grad


class SqrtAtZero(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(h - h) + h  # value h, gradient 0 * inf: NaN


class StateNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.act, self.head = nn.Linear(4, 4), SqrtAtZero(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(RefusesNonFiniteGradient.apply(self.first(x))))


def test_a_backward_pass_that_raises_after_its_nan_gradient_shows_its_event() -> None:
    torch.manual_seed(0)
    model = StateNet()
    with nw.watch(model, backward=True) as w:
        loss = model(torch.randn(8, 4)).sum()
        with pytest.raises(FloatingPointError):
            loss.backward()  # autograd runs no end-of-pass callback: nothing resolved it
        with pytest.warns(nw.NanWarning):  # the pass raised already: warned, not raised
            events = w.events
        assert [(e.batch, e.module, e.role, e.is_backward) for e in events] == \
            [(0, "act", "grad_input[0]", True)]
        assert not w.report().startswith("No inf/nan detected")
        # Its diagnosis replays the batch's backward, up to the same exception.
        assert events[0].diagnosis.kind == "domain" and "sqrt" in events[0].diagnosis.summary
        model(torch.randn(8, 4))  # the next batch: no second event for the old pass
        assert len(w.events) == 1


class _SkipBlock(nn.Module):
    """``x + bn(conv(x))``: ``x`` is used twice, so autograd sums two gradients for it."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.conv(x))


class _ShrinksToOnePixel(nn.Module):
    """A small CIFAR-style conv net whose last stage is 1x1: two skip blocks there, then a
    1x1 conv, BatchNorm and a pooled head (an EfficientNet's tail on 32x32 inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(16), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.Conv2d(32, 32, 2, stride=2, bias=False), nn.BatchNorm2d(32))
        self.blocks = nn.Sequential(_SkipBlock(32), _SkipBlock(32))
        self.tail = nn.Sequential(nn.Conv2d(32, 64, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tail(self.blocks(self.down(self.stem(x))))
        return self.head(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


def _channels_last_gradients(watch_mode: str | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = _ShrinksToOnePixel().train().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    x = x.contiguous(memory_format=torch.channels_last)
    watch = nw.watch(model, mode=watch_mode, backward=True, on_nan="record") if watch_mode else None
    try:
        model(x).square().mean().backward()
    finally:
        if watch is not None:
            watch.close()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_backward_watch_leaves_every_gradient_bit_identical_in_a_channels_last_net(
        mode, reduction_path) -> None:
    # A tensor used twice at 1x1 gets two gradients; autograd sums them in place into the
    # first one's memory unless something else owns that memory. Measuring a gradient must
    # not, or the sum gets another memory layout and BatchNorm's backward another order.
    unwatched = _channels_last_gradients(None)
    watched = _channels_last_gradients(mode)
    differing = [name for name in unwatched if not torch.equal(unwatched[name], watched[name])]
    assert differing == []


class PowFeature(nn.Module):
    """``(x, |x|^1.5)``: finite value and first derivative at 0; its second derivative is
    infinite there, so the double backward of a derivative taken through it makes NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.abs().pow(1.5)], -1)


class PINN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = PowFeature()
        self.body = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.features(x))


def _pinn_points() -> tuple[PINN, torch.Tensor]:
    torch.manual_seed(0)
    return PINN(), torch.linspace(-1, 1, 9).unsqueeze(1).requires_grad_(True)  # holds 0


def test_a_pinn_nan_made_by_the_backward_of_its_first_derivative_is_raised_at_its_module() -> None:
    # loss(du/dx).backward() is the batch's second pass; the input's hook was gone after the
    # first, so the NaN (in x.grad only) went unseen.
    model, x = _pinn_points()
    with nw.watch(model, backward=True) as w:
        du = torch.autograd.grad(model(x).sum(), x, create_graph=True)[0]
        assert du.isfinite().all()
        with pytest.raises(nw.NanDetected) as raised:
            (du - 1).square().mean().backward()
        assert w.parts.backward.passes == 2
    event = raised.value.event
    assert (event.batch, event.module, event.module_type, event.role, event.is_backward) == \
        (0, "features", "PowFeature", "grad_input[0]", True)
    # The NaN is in x.grad only: a backward pass that leaves it uncomputed is quiet.
    model, x = _pinn_points()
    with nw.watch(model, backward=True) as w:
        du = torch.autograd.grad(model(x).sum(), x, create_graph=True)[0]
        (du - 1).square().mean().backward(inputs=list(model.parameters()))
    assert w.events == [] and x.grad is None
    assert all(p.grad is None or p.grad.isfinite().all() for p in model.parameters())


def test_a_pinn_second_derivative_nan_is_raised_at_its_module_not_blamed_on_the_loss() -> None:
    model, x = _pinn_points()
    with nw.watch(model, backward=True) as w:
        u = model(x)
        du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        with pytest.raises(nw.NanDetected) as raised:  # the pass of d2u made it
            torch.autograd.grad(du.sum(), x, create_graph=True)
        assert w.parts.backward.passes == 2
    event = raised.value.event
    assert (event.batch, event.module, event.role, event.kind) == \
        (0, "features", "grad_input[0]", "nan")
    assert event.diagnosis.kind != "loss"


def test_the_loss_pass_after_a_pinn_second_derivative_nan_takes_that_passes_diagnosis() -> None:
    model, x = _pinn_points()
    with nw.watch(model, backward=True, on_nan="record") as w:
        u = model(x)
        du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        d2u = torch.autograd.grad(du.sum(), x, create_graph=True)[0]
        (d2u + u).square().mean().backward()
        events = w.events
    assert [(e.batch, e.module, e.role) for e in events] == \
        [(0, "features", "grad_input[0]"), (0, "body.2", "grad_output[0]")]
    made, carried = events[0].diagnosis, events[1].diagnosis
    assert carried.kind == made.kind != "loss"
    assert "earlier backward pass" in carried.summary and "'features'" in carried.summary
    assert carried.evidence[1:] == made.evidence


class _AbsPow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().pow(1.5)


class _PowCritic(nn.Module):
    """A WGAN critic whose input gradient is exactly 0 at the origin (|x|^1.5 there)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = _AbsPow()
        self.body = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.features(x))


def test_a_gradient_penalty_nan_names_the_batch_of_the_interpolated_samples() -> None:
    torch.manual_seed(0)
    critic = _PowCritic()
    real, fake = torch.randn(4, 2), torch.randn(4, 2)
    interp = torch.lerp(fake, real, torch.rand(4, 1))
    interp[0] = 0.0  # its gradient is 0: the penalty's sqrt without eps has a NaN gradient
    interp.requires_grad_(True)
    with nw.watch(critic, backward=True) as w:
        g = torch.autograd.grad(critic(interp).sum(), interp, create_graph=True)[0]  # batch 0
        penalty = ((g.square().sum(1).sqrt() - 1) ** 2).mean()
        loss = critic(fake).mean() - critic(real).mean() + 10 * penalty  # batches 1 and 2
        with pytest.raises(nw.NanDetected) as raised:
            loss.backward()
    # The parameters' NaN gradients sum over all three graphs: the interpolated batch's
    # module gradients say whose graph carried it.
    event = raised.value.event
    assert (event.batch, event.is_backward) == (0, True)
    assert event.role.startswith("grad_")


def test_the_inputs_gradient_hook_lives_for_every_pass_of_its_batch_then_goes() -> None:
    model, x = _pinn_points()
    with nw.watch(model, backward=True, on_nan="record") as w:
        du = torch.autograd.grad(model(x).sum(), x, create_graph=True)[0]
        assert len(x._backward_hooks) == 1  # the first pass ended: still there for the next
        (du - 1).square().mean().backward()
        assert len(x._backward_hooks) == 1
        x.grad = None
        with torch.no_grad():
            model(x)  # the next root forward: the batch's hooks go
        assert not x._backward_hooks
        model(x)
        assert len(x._backward_hooks) == 1
    assert not x._backward_hooks and hook_count(model) == 0  # close removes it

    # A pass that fails (raises inside autograd) removes it too.
    torch.manual_seed(0)
    failing = StateNet()
    points = torch.randn(8, 4, requires_grad=True)
    with nw.watch(failing, backward=True) as w:
        loss = failing(points).sum()
        assert len(points._backward_hooks) == 1
        with pytest.raises(FloatingPointError):
            loss.backward()
        with pytest.warns(nw.NanWarning):
            assert len(w.events) == 1  # ends the failed pass
        assert not points._backward_hooks
    assert hook_count(failing) == 0


def _pinn_step_closed() -> tuple:
    """A PINN step under a watch closed after it, the step's points and loss graph kept."""
    import weakref
    model, x = _pinn_points()
    watch = nw.watch(model, backward=True, on_nan="record")
    du = torch.autograd.grad(model(x).sum(), x, create_graph=True)[0]
    loss = (du - 1).square().mean()
    loss.backward()
    watch.close()
    return x, du, weakref.ref(watch)


def test_a_closed_watch_is_collected_while_a_pinn_keeps_its_points_and_graph() -> None:
    import gc
    x, du, watch = _pinn_step_closed()
    gc.collect()
    assert watch() is None
    assert du.requires_grad and not x._backward_hooks

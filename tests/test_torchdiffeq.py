"""nanwidget on torchdiffeq's neural ODEs: training through odeint and odeint_adjoint (dopri5) is
silent and bit for bit the same watched, whether the watch is on the ODE function or on the
module that calls odeint; a trial step whose stages overflow and that the solver rejects and
retries is no event in sentinel mode (full mode tells it with the evidence that the model's
outputs stayed finite, as for T5's clamped infs); a solution that grows past float32 is told
as compounded over the field's calls, a NaN weight is named."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

torchdiffeq = pytest.importorskip(
    "torchdiffeq", reason="torchdiffeq is optional (CI's extras job installs it): pip install torchdiffeq")

import nanwidget as nw  # noqa: E402

MODES = ["full", "sentinel"]


def watch(model: nn.Module, mode: str, **options) -> nw.NanWatch:
    if mode == "sentinel":
        options["mode"] = "sentinel"
    return nw.watch(model, on_nan="record", **options)


class Field(nn.Module):
    """A learned vector field dy/dt = net(y)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(y)


class _IdentityField(nn.Module):
    """A vector field around lin, an identity Linear, scaled by k."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.lin, self.k = nn.Linear(2, 2), k
        nn.init.eye_(self.lin.weight)
        nn.init.zeros_(self.lin.bias)


class Cubic(_IdentityField):
    """dy/dt = -k * lin(y)**3 (lin the identity): stiff for a large k; an explicit trial step
    that is far too long overflows in its stages."""

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -self.k * self.lin(y) ** 3


class Exponential(_IdentityField):
    """dy/dt = k * lin(y): the solution e^(k t) passes float32's largest before t = 1 for k=100."""

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.k * self.lin(y)


class OdeBlock(nn.Module):
    """A module that solves its field from 0 to ``end`` in its forward."""

    def __init__(self, f: nn.Module, adjoint: bool = False, method: str = "dopri5",
                 end: float = 1.0, rtol: float = 1e-5, atol: float = 1e-6, **options) -> None:
        super().__init__()
        self.f, self.adjoint, self.method, self.end, self.options = f, adjoint, method, end, options
        self.rtol, self.atol = rtol, atol

    def forward(self, y0: torch.Tensor) -> torch.Tensor:
        solve = torchdiffeq.odeint_adjoint if self.adjoint else torchdiffeq.odeint
        t = torch.tensor([0.0, self.end])
        return solve(self.f, y0, t, method=self.method, rtol=self.rtol, atol=self.atol,
                     options=self.options or None)[-1]


def train(adjoint: bool, target: str | None, mode: str = "full", steps: int = 3):
    torch.manual_seed(0)
    block = OdeBlock(Field(), adjoint=adjoint)
    y0 = torch.randn(8, 2, generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.Adam(block.parameters(), lr=1e-2)
    w = None if target is None else watch(block if target == "block" else block.f, mode,
                                          backward=True)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            optimizer.zero_grad()
            loss = (block(y0) ** 2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        events = [] if w is None else list(w.events)
        if w is not None:
            w.close()
    return torch.stack(losses), [p.detach().clone() for p in block.parameters()], events, caught


@pytest.mark.parametrize("adjoint", [False, True], ids=["odeint", "odeint_adjoint"])
@pytest.mark.parametrize("target", ["block", "func"])
@pytest.mark.parametrize("mode", MODES)
def test_training_a_neural_ode_is_silent_and_unchanged(adjoint, target, mode):
    ref_losses, ref_params, _, _ = train(adjoint, None)
    losses, params, events, caught = train(adjoint, target, mode)
    assert events == []
    assert [str(c.message) for c in caught if "nanwidget" in str(c.message)] == []
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert torch.isfinite(losses).all()


def rejected_trial_step() -> OdeBlock:
    # first_step=10 overflows the stages of the first trial (the field's output holds Inf, then
    # inf - inf makes NaN); the error ratio is not finite, so dopri5 rejects the step and falls
    # back on min_step, and the solve ends finite.
    return OdeBlock(Cubic(1e4), first_step=10.0, min_step=1e-6)


def test_a_trial_step_the_solver_rejects_is_no_event_in_sentinel_mode():
    y0 = torch.tensor([[1.0, 0.5]])
    expected = rejected_trial_step()(y0)
    assert torch.isfinite(expected).all()
    block = rejected_trial_step()
    with watch(block, "sentinel") as w:
        got = block(y0)
    assert w.events == [] and torch.equal(got, expected)


def test_a_trial_step_the_solver_rejects_is_told_as_absorbed_in_full_mode():
    y0 = torch.tensor([[1.0, 0.5]])
    expected = rejected_trial_step()(y0)
    block = rejected_trial_step()
    with watch(block, "full") as w:
        got = block(y0)
    assert torch.equal(got, expected)  # recording changes nothing
    event = w.event
    assert event.batch == 0 and event.module == "f" and event.kind == "inf"
    assert event.diagnosis.kind == "overflow"
    assert any(line.startswith("The model's outputs stayed finite in batch 0")
               for line in event.diagnosis.evidence)


def test_a_solution_that_outgrows_float32_under_dopri5_is_told_compounded():
    # torchdiffeq's default tolerances: ~2900 small steps, each call ~1.03x above the last.
    block = OdeBlock(Exponential(100.0), rtol=1e-7, atol=1e-9)
    with watch(block, "full") as w, pytest.raises(AssertionError, match="underflow in dt"):
        block(torch.tensor([[1.0, 0.5]]))  # torchdiffeq gives up once its step is NaN
    event = w.event
    assert (event.module, event.role, event.kind, event.origin) == ("f", "output", "inf", "output")
    assert event.call > 1000  # dopri5 took many small steps
    diagnosis = event.diagnosis
    assert diagnosis.kind == "overflow"
    compounded = [line for line in diagnosis.evidence if "compounded over its calls" in line]
    assert len(compounded) == 1 and compounded[0].startswith(f"'f' ran {event.call} times")
    # Each call a little above the last: the solution grew, smaller steps would not help.
    assert diagnosis.suggestion[0].startswith("'f' climbed a little at each of many calls")
    assert "shorter time span" in diagnosis.suggestion[0]


def test_a_fixed_step_solve_that_blows_up_is_told_compounded_with_the_step_fix():
    block = OdeBlock(Exponential(100.0), method="rk4", step_size=0.01)
    with watch(block, "full") as w:
        out = block(torch.tensor([[1.0, 0.5]]))
    assert not torch.isfinite(out).all()
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow"
    assert any("compounded over its calls" in line for line in diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith("If 'f.lin' runs in a loop on its own results")


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_weight_of_the_field_is_named(mode):
    torch.manual_seed(0)
    block = OdeBlock(Field())
    with torch.no_grad():
        block.f.net[2].weight[0, 0] = float("nan")
    # Sentinel mode checks the outputs of the module it watches: the field's (the solve raises
    # before the block's forward returns).
    with watch(block if mode == "full" else block.f, mode) as w, pytest.raises(AssertionError):
        block(torch.randn(4, 2))  # torchdiffeq's own check stops the solve
    event = w.event
    assert event.batch == 0 and event.kind == "nan"
    assert (event.module, event.role, event.origin) == (
        ("f.net.2" if mode == "full" else "net.2"), "weight", "weight")

"""event.diagnosis: why, not only where, on real small models in full and sentinel mode.

One scenario per kind (at least two per kind), each run in both modes; the loss_fn option;
the diagnosis shown in the report and kept by recordings.
"""

from __future__ import annotations

import contextlib
import copy
import html
import json
import functools
import math
import re
import warnings

import pytest
import torch
from torch import nn

import nanwidget as nw
from nanwidget.core.diagnosis import MAX_DIAGNOSIS_REPLAYS
from test_replay import AdaptedNet, line_of
from test_report_golden import Overflowing  # exact weights: overflows float16 at scale 1e4
from test_trace_lineage import bce_by_hand, saturated_model  # a loss outside the model
from test_batches import HoldsItsLoss  # a loss held as a submodule, run on the output

MODES = ["full", "sentinel"]


def watch(model: nn.Module, mode: str, **options) -> nw.NanWatch:
    if mode == "sentinel":
        options["mode"] = "sentinel"
    return nw.watch(model, on_nan="record", **options)


# ---------------------------------------------------------------------------- overflow
@pytest.mark.parametrize("mode", MODES)
def test_a_float16_linear_past_65504_is_an_overflow_with_its_numbers(mode):
    model = Overflowing().half()
    x = (torch.arange(8.0).reshape(2, 4) / 4).half()
    with watch(model, mode) as w:
        model(x)
        model(x, 10.0)
        model(x, 1e4)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow" and diagnosis.confidence == "high"
    assert diagnosis.summary.startswith("addmm in module 'out' (Linear) at ")
    assert line_of(Overflowing.forward, "self.out(") in diagnosis.summary
    evidence = "\n".join(diagnosis.evidence)
    assert "float16 max 65504" in evidence and "4.44e+04" in evidence
    assert "228 at batch 1, 22.8 at batch 0" in evidence  # the history before it
    assert "bfloat16" in diagnosis.suggestion[0] and "'out'" in diagnosis.suggestion[0]
    assert diagnosis.op.startswith("addmm at ") and w.event.summary().endswith(diagnosis.op)
    # A layer's product: its inputs and weights, not attention scores (what a bmm gets)
    said = " ".join(diagnosis.suggestion)
    assert "a LayerNorm or BatchNorm before it" in said and "attention" not in said


class Exponent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.fc(x))


@pytest.mark.parametrize("mode", MODES)
def test_exp_of_a_large_value_overflows_float32(mode):
    model = Exponent()
    with watch(model, mode) as w:
        model(torch.randn(3, 4))
        model(torch.randn(3, 4) * 200)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow"
    assert "exp of values up to" in diagnosis.summary and "88.7" in diagnosis.summary
    assert any("logsumexp" in fix for fix in diagnosis.suggestion)
    # One call per batch: no loop's fixes.
    assert not any("compounded" in line for line in diagnosis.evidence + diagnosis.suggestion)


class LearnedTemperature(nn.Module):
    """Cosine similarities scaled by exp of a learned log-scale, as CLIP's logits are."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = nn.functional.normalize(self.proj(x), dim=-1)
        return self.log_scale.exp() * z @ z.t()


@pytest.mark.parametrize("mode", MODES)
def test_exp_of_a_learned_log_scale_names_it_and_its_clamp(mode):
    # exp read a parameter: it read "exp of values up to 92" with a clamp of the op's argument
    # and logsumexp, not the parameter to clamp after each step.
    model = LearnedTemperature()
    with watch(model, mode) as w:
        model(torch.randn(3, 4))
        with torch.no_grad():
            model.log_scale.fill_(92.0)  # grown without CLIP's clamp
        model(torch.randn(3, 4))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow" and "exp of the model's 'log_scale', now 92" in diagnosis.summary
    assert diagnosis.evidence[0].startswith("exp read the model's 'log_scale' itself (92)")
    assert "model.log_scale.clamp_(0, math.log(100))" in diagnosis.suggestion[0]
    assert not any("logsumexp" in fix for fix in diagnosis.suggestion)  # one value: no sum


@pytest.mark.parametrize("mode", MODES)
def test_gpt2_whose_feed_forward_weights_were_scaled_up_overflows_float32(mode):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).eval()  # random weights: nothing downloaded
    tokens = torch.randint(0, 50, (2, 8))
    with watch(model, mode) as w:
        model(tokens)
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight.mul_(1e36)
        model(tokens)
    event = w.event
    assert (event.batch, event.module, event.origin) == (1, "transformer.ln_f", "output")
    diagnosis = event.diagnosis
    # Values near 1e35 leave the feed-forward: x ** 3 in its GELU and the final layer norm's
    # variance pass float32's largest value. An overflow, not a domain error of pow.
    assert diagnosis.kind == "overflow" and "overflowed float32" in diagnosis.summary
    assert "(the weights grew" not in diagnosis.summary  # one write, no climb: no divergence


class QuadraticField(nn.Module):
    """dy/dt = 3 y^2 + a small learned term: from y0 the solution blows up at t = 1 / (3 y0)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, t: float, y: torch.Tensor) -> torch.Tensor:
        return 0.01 * self.net(y) + 3.0 * y * y


class NeuralOde(nn.Module):
    """A fixed-step RK4 solve of ``field`` (what torchdiffeq's odeint does with method='rk4')."""

    def __init__(self, steps: int = 40, dt: float = 0.1) -> None:
        super().__init__()
        self.field, self.head = QuadraticField(), nn.Linear(4, 1)
        self.steps, self.dt = steps, dt

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        f, dt = self.field, self.dt
        for i in range(self.steps):
            t = i * dt
            k1 = f(t, y)
            k2 = f(t + dt / 2, y + dt / 2 * k1)
            k3 = f(t + dt / 2, y + dt / 2 * k2)
            k4 = f(t + dt, y + dt * k3)
            y = y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return self.head(y)


class UnrolledCell(nn.Module):
    """A plain recurrent cell unrolled by hand whose recurrent weights scale the state up."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(8, 8, bias=False)
        with torch.no_grad():
            self.cell.weight.copy_(torch.eye(8) * 6.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(60):
            h = self.cell(h) + x
        return h


@pytest.mark.parametrize("mode", MODES)
def test_an_ode_solve_that_blows_up_is_told_compounded_over_its_steps(mode):
    torch.manual_seed(0)
    model = NeuralOde()
    with watch(model, mode) as w:
        model(torch.randn(16, 4) * 0.01)  # a small state stays finite over the solve
        model(torch.randn(16, 4))
    event = w.event
    assert (event.batch, event.module, event.role) == (1, "field", "output")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "overflow" and diagnosis.summary.startswith("mul in module 'field'")
    compounded = [line for line in diagnosis.evidence if "compounded over its calls" in line]
    assert len(compounded) == 1
    assert compounded[0].startswith(f"'field' ran {event.call} times in batch 1 before the call "
                                    "whose outputs overflowed, and its outputs' abs max grew ")
    assert "per call from call " in compounded[0]
    # The solver's fixes first, then the op's own.
    assert diagnosis.suggestion[0].startswith("If 'field' runs in a loop on its own results")
    assert "odeint" in diagnosis.suggestion[0] and "LSTMCell" in diagnosis.suggestion[1]
    assert any(fix.startswith("Keep the values smaller before mul") for fix in diagnosis.suggestion)


def test_an_unrolled_recurrent_cell_that_blows_up_is_told_compounded():
    model = UnrolledCell()
    with watch(model, "full") as w:
        model(torch.full((2, 8), 0.5))
    diagnosis = w.event.diagnosis
    assert w.event.module == "cell" and diagnosis.kind == "overflow"
    assert any("'cell' ran " in line and "6.02x per call from call 0 (3)" in line for line in diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith("If 'cell' runs in a loop")


class Amplify(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1000.0


class SharedAmplifierStack(nn.Module):
    """Layers with one weightless module instance shared by all (ultralytics shares one
    nn.SiLU across its models), whose outputs grow layer after layer: many growing calls of a
    module, but no loop of a step on its own results."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(16))
        for layer in self.layers:
            nn.init.eye_(layer.weight)
        self.amplify = Amplify()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.amplify(layer(x))
        return x


def test_a_shared_weightless_module_s_growing_calls_are_not_told_a_loop():
    model = SharedAmplifierStack()
    with watch(model, "full") as w:
        model(torch.ones(2, 8))
    diagnosis = w.event.diagnosis
    assert (w.event.module, w.event.call) == ("amplify", 12) and diagnosis.kind == "overflow"
    assert not any("compounded" in line for line in diagnosis.evidence + diagnosis.suggestion)


# ---------------------------------------------------------------------------- domain
class LogOfRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.relu(self.fc(x)))


class AcosOfTanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.acos(torch.tanh(self.fc(x)) * 1.01)


@pytest.mark.parametrize("mode", MODES)
def test_log_of_zero_is_a_domain_error_at_its_line(mode):
    model = LogOfRelu()
    with watch(model, mode) as w:
        model(torch.randn(8, 4))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain" and diagnosis.confidence == "high"
    assert "log of values down to 0 (log(0) = -inf)" in diagnosis.summary
    assert line_of(LogOfRelu.forward, "torch.log") in diagnosis.summary
    assert "clamp_min(eps)" in diagnosis.suggestion[0]


@pytest.mark.parametrize("mode", MODES)
def test_acos_past_one_is_a_domain_error(mode):
    model = AcosOfTanh()
    with watch(model, mode) as w:
        model(torch.randn(5, 4) * 5)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain"
    assert "acos of values from -1.01 to 1.01" in diagnosis.summary
    assert "clamp(-1 + eps, 1 - eps)" in diagnosis.suggestion[0]


class LogOfOneMinusSigmoid(nn.Module):
    """log(1 - p) written as log1p(-p): a saturated sigmoid gives p = 1, log1p(-1) = -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(-torch.sigmoid(self.fc(x)))


@pytest.mark.parametrize("mode", MODES)
def test_log1p_at_minus_one_is_told_to_stay_above_minus_one(mode):
    model = LogOfOneMinusSigmoid()
    with watch(model, mode) as w:
        model(torch.randn(5, 4) * 100)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain" and "log1p(-1) = -inf" in diagnosis.summary
    # Its argument's edge is -1: a clamp at +eps would turn every log(1 - p) into log1p(eps)
    said = " ".join(diagnosis.suggestion)
    assert "clamp_min(-1 + eps)" in diagnosis.suggestion[0] and "F.logsigmoid(-x)" in said
    assert "clamp_min(eps))" not in said


class LogitOfProbabilities(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.logit(x))


@pytest.mark.parametrize("mode", MODES)
def test_logit_of_an_exact_0_is_a_domain_error_not_an_overflow(mode):
    model = LogitOfProbabilities()
    x = torch.rand(6, 4, generator=torch.Generator().manual_seed(0))
    x[4, 2] = 0.0
    with watch(model, mode) as w:
        model(x)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain" and diagnosis.rows == [4]
    assert "logit of values from 0 to" in diagnosis.summary
    assert "logit(0) = -inf" in diagnosis.summary
    said = " ".join(diagnosis.suggestion)
    assert "torch.logit(x, eps=1e-6)" in said and "-1 + eps" not in said
    assert "runaway growth" not in said


class CountHead(nn.Module):
    """A Poisson / negative binomial head whose rate (total_count) comes from softplus: at a
    very negative logit it underflows to exactly 0, and log_prob takes xlogy(y, 0) / lgamma(0)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.kind = kind
        with torch.no_grad():
            self.fc.bias.fill_(-200.0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = self.fc(x)
        rate = nn.functional.softplus(p[:, 0])
        if self.kind == "poisson":
            return -torch.distributions.Poisson(rate, validate_args=False).log_prob(y).mean()
        return -torch.distributions.NegativeBinomial(
            rate, logits=p[:, 1], validate_args=False).log_prob(y).mean()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind, op", [("poisson", "xlogy"), ("nb", "lgamma")])
def test_a_count_likelihood_at_a_zero_rate_is_a_domain_error_not_an_overflow(mode, kind, op):
    model = CountHead(kind)
    with watch(model, mode) as w:
        model(torch.randn(4, 4), torch.tensor([0.0, 2.0, 1.0, 3.0]))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain" and diagnosis.confidence == "high"
    assert diagnosis.summary.startswith(op)
    assert "clamp_min(eps)" in diagnosis.suggestion[0]
    assert "x.clamp(-1e4" not in " ".join(diagnosis.suggestion)


class _AngleOfSelf(nn.Module):
    """acos of a unit vector's dot product with itself, a hair above 1 by rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unit = nn.functional.normalize(self.fc(x), dim=-1)
        return torch.acos((unit * unit).sum(-1) * 1.0000001)


def test_acos_a_rounding_past_one_shows_the_digits_that_pass_it():
    torch.manual_seed(0)
    model = _AngleOfSelf()
    with watch(model, "full") as w:
        model(torch.randn(4, 4))
    summary = w.event.diagnosis.summary
    assert "to 1.0000001" in summary and "to 1 (" not in summary
    # The evidence shows the same digits (it read "to 1.").
    assert any("acos input self (float32): from" in line and "to 1.0000001" in line
               for line in w.event.diagnosis.evidence)


class NormOf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.sqrt((h * h).sum(-1))  # its gradient is infinite where h is 0


@pytest.mark.parametrize("mode", MODES)
def test_the_gradient_of_sqrt_at_zero_is_a_domain_error_in_the_backward_pass(mode):
    model = NormOf()
    x = torch.randn(5, 4)
    x[2] = 0
    options = {"loss_fn": lambda out: out.sum()} if mode == "full" else {}
    with watch(model, mode, backward=True, **options) as w:
        model(x).sum().backward()
    diagnosis = w.event.diagnosis
    assert w.event.is_backward and diagnosis.kind == "domain"
    assert "during the backward pass" in diagnosis.summary
    # The NaN/Inf that reaches the event is born in sqrt's gradient (a division by 0).
    assert "the gradient of sqrt is infinite at the edge of its domain (0)" in diagnosis.summary
    assert line_of(NormOf.forward, "torch.sqrt") in diagnosis.summary
    assert "torch.sqrt(x + eps)" in diagnosis.suggestion[0]


class RadialPinn(nn.Module):
    """A PINN whose forward takes its output's gradient with respect to the inputs: the NaN is
    born in sqrt's gradient at the origin, computed by the autograd.grad call two lines on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_(True)
        radius = torch.sqrt((x * x).sum(-1, keepdim=True))  # infinite gradient at 0
        u = self.net(torch.cat([radius, x], -1))
        du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        return torch.cat([u, du], -1)


@pytest.mark.parametrize("mode", MODES)
def test_a_gradient_taken_in_the_forward_names_the_line_of_its_op(mode):
    # It named the line calling torch.autograd.grad, and told to add an eps inside a sqrt there.
    torch.manual_seed(0)
    model = RadialPinn()
    x = torch.rand(6, 2)
    x[4] = 0
    with watch(model, mode) as w:
        model(x)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain"
    assert "the gradient of sqrt is infinite at the edge of its domain (0)" in diagnosis.summary
    sqrt_line = line_of(RadialPinn.forward, "torch.sqrt")
    assert sqrt_line in diagnosis.summary and sqrt_line in diagnosis.suggestion[0]
    assert line_of(RadialPinn.forward, "autograd.grad") not in diagnosis.summary


class RadialLaplacianPinn(RadialPinn):
    """Its second derivative too: that gradient runs back through the network's own gradient,
    which holds sqrt's infinite one, so its modules' gradients go non-finite inside it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_(True)
        radius = torch.sqrt((x * x).sum(-1, keepdim=True))  # infinite gradient at 0
        u = self.net(torch.cat([radius, x], -1))
        du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        ddu = torch.autograd.grad(du[:, 0].sum(), x, create_graph=True)[0]
        return torch.cat([u, ddu], -1)


@pytest.mark.parametrize("mode", MODES)
def test_a_gradient_taken_in_the_forward_is_diagnosed_alike_with_backward_frames(mode):
    # Full mode took the forward's own autograd.grad for the batch's backward pass: a backward
    # event at the Tanh's grad_output, diagnosed 'unknown', with no trace.
    torch.manual_seed(0)
    model = RadialLaplacianPinn()
    x = torch.rand(6, 2)
    x[4] = 0
    with watch(model, mode, backward=True, replay_on_nan=True) as w:
        model(x).square().mean().backward()
    event = w.events[0]
    assert (event.module, event.role, event.is_backward) == ("", "output", False)
    assert event.diagnosis.kind == "domain" and event.trace is not None
    assert "the gradient of sqrt is infinite at the edge of its domain (0)" in \
        event.diagnosis.summary
    assert line_of(RadialLaplacianPinn.forward, "torch.sqrt") in event.diagnosis.summary


class SingularLogdet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        covariance = torch.ones(4, 4) * h.mean()  # rank one: determinant 0
        return h * torch.logdet(covariance)


@pytest.mark.parametrize("mode", MODES)
def test_the_logdet_of_a_singular_matrix_is_a_domain_error(mode):
    # It read "overflow" with fixes about attention scores, for a matrix of 0.06s.
    torch.manual_seed(0)
    model = SingularLogdet()
    with watch(model, mode) as w:
        model(torch.randn(8, 4))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain"
    assert "log-determinant of a singular matrix" in diagnosis.summary
    assert line_of(SingularLogdet.forward, "torch.logdet") in diagnosis.summary
    assert "A + eps * torch.eye(n)" in diagnosis.suggestion[0]


class Decomposed(nn.Module):
    """Eigenvectors (or singular vectors) of a matrix with one value repeated everywhere: their
    gradient divides by the differences of the values."""

    def __init__(self, decomposition: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.decomposition = decomposition

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        matrix = torch.eye(4) * h.mean()
        if self.decomposition == "svd":
            vectors = torch.linalg.svd(matrix)[0]
        else:
            vectors = torch.linalg.eigh(matrix)[1]
        return h @ vectors


@pytest.mark.parametrize("decomposition", ["eigh", "svd"])
def test_a_repeated_eigenvalue_in_a_gradient_gets_fixes_that_separate_them(decomposition):
    # The fix read "Keep the input of linalgeigh inside its domain (clamp it, or add an eps)",
    # which leaves equal eigenvalues equal.
    torch.manual_seed(0)
    model = Decomposed(decomposition)
    with watch(model, "full", backward=True) as w:
        model(torch.randn(8, 4)).sum().backward()
    diagnosis = w.event.diagnosis
    values = "singular values" if decomposition == "svd" else "eigenvalues"
    assert w.event.is_backward and diagnosis.kind == "domain"
    assert f"the gradient of torch.linalg.{decomposition} divides by the differences of the " \
        f"{values}" in diagnosis.summary
    assert f"Separate the repeated {values}" in diagnosis.suggestion[0]
    assert "linalgeigh" not in " ".join(diagnosis.suggestion)
    assert ("svdvals" if decomposition == "svd" else "eigvalsh") in diagnosis.suggestion[1]


class GaussianDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loc, self.scale = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        likelihood = torch.distributions.Normal(self.loc(z), self.scale(z), validate_args=False)
        return -likelihood.log_prob(x).sum(-1)  # a scale below 0: log of a negative


@pytest.mark.parametrize("mode", MODES)
def test_a_log_inside_a_distributions_log_prob_names_its_parameter(mode):
    # The fix told to clamp the argument of log at the log_prob line, which has no log in it.
    torch.manual_seed(0)
    model = GaussianDecoder()
    with watch(model, mode) as w:
        model(torch.randn(8, 4), torch.randn(8, 4))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain"
    assert line_of(GaussianDecoder.forward, "log_prob") in diagnosis.suggestion[0]
    assert "F.softplus(raw) + 1e-4" in diagnosis.suggestion[0]


class LogWhereUsed(nn.Module):
    """The where trap: the result of log is masked where its argument is 0, its gradient is
    not (where passes log a gradient of 0 there, and log's backward divides it by 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc(x) * (x > 0)  # 0 wherever x is not positive
        return torch.where(z > 0, torch.log(z), 0.0).sum(-1)


@pytest.mark.parametrize("mode", MODES)
def test_a_log_masked_by_where_is_told_to_guard_its_argument(mode):
    torch.manual_seed(0)
    model = LogWhereUsed()
    x = torch.randn(6, 4)
    with watch(model, mode, backward=True) as w:
        out = model(x)
        assert torch.isfinite(out).all()  # the forward is clean: only the gradient is NaN
        out.sum().backward()
    diagnosis = w.event.diagnosis
    assert w.event.is_backward and diagnosis.kind == "domain"
    assert "the gradient reaching log there was 0" in diagnosis.summary
    assert line_of(LogWhereUsed.forward, "torch.log") in diagnosis.summary
    assert "torch.log(torch.where(mask, x, 1))" in diagnosis.suggestion[0]
    # Following it: no NaN gradient.
    fixed = LogWhereUsed()
    fixed.load_state_dict(model.state_dict())
    z = fixed.fc(x) * (x > 0)
    torch.where(z > 0, torch.log(torch.where(z > 0, z, 1.0)), 0.0).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in fixed.parameters())


@pytest.mark.parametrize("replay_on_nan", [False, True])
def test_full_mode_tells_a_backward_nan_without_a_loss_fn(replay_on_nan):
    # The backward pass is replayed from the gradient the output received (it said "unknown:
    # replay with loss_fn=..."); that gradient is held only while the pass runs.
    model = NormOf()
    x = torch.randn(5, 4)
    x[2] = 0
    with watch(model, "full", backward=True, replay_on_nan=replay_on_nan) as w:
        model(x).sum().backward()
        assert w.parts.backward.output_grads(0) is None  # let go with the pass
    event = w.event
    assert event.is_backward and event.diagnosis.kind == "domain"
    assert "the gradient of sqrt is infinite at the edge of its domain (0)" in \
        event.diagnosis.summary
    assert line_of(NormOf.forward, "torch.sqrt") in event.diagnosis.summary
    if replay_on_nan:  # the event's own trace, reproduced from that gradient
        assert event.trace.reproduced and event.trace.first_bad["phase"] == "backward"
    else:
        assert event.trace is None


def test_a_loss_nan_replayed_from_a_single_outputs_gradient_names_it_as_the_frames_do():
    # A root returning one tensor: its forward role is 'output'. The held gradient was kept
    # under 'output[0]' too (its backward frame's grad_output[0]), and the replay named it
    # that way: "(output[0])", where the frames and sentinel mode say "(output)".
    model = saturated_model()
    with watch(model, "full", backward=True, replay_on_nan=True) as w:
        bce_by_hand(model(torch.full((6, 4), 3.0).half())).backward()
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "loss"
    assert "the gradient reaching the model's output (output) in batch 0" in diagnosis.summary
    assert set(w.frames().query("module == '' and phase == 'forward'").role) == {"input[0]",
                                                                                 "output"}


class EntropyRouter(nn.Module):
    """Keeps a router-entropy aux loss as an attribute, which the user adds to the loss (the
    fairseq / DeepSpeed ``l_aux`` pattern). A pruned choice has p = 0: p * log(p)'s backward
    makes 0/0 = NaN, while the module's outputs and their gradients stay finite."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 3)
        self.pruned: torch.Tensor | None = None
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        if self.pruned is not None:
            logits = logits.masked_fill(self.pruned, float("-inf"))
        p = logits.softmax(-1)
        self.aux = (p * p.log()).sum(-1).mean()
        return x * p.max(-1, keepdim=True).values


class AuxAttributeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.mix = EntropyRouter()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.inp(x)))


def _aux_attribute_event(mode: str, whole_loss_fn: bool = False) -> nw.NanEvent:
    torch.manual_seed(0)
    model = AuxAttributeNet()
    x = torch.randn(6, 4)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean() + 0.01 * model.mix.aux

    options = {"loss_fn": loss_fn} if whole_loss_fn else {}
    with watch(model, mode, backward=True, **options) as w:
        loss_fn(model(x)).backward()  # a healthy step
        model.zero_grad()
        model.mix.pruned = torch.tensor([False, True, False])
        loss_fn(model(x)).backward()
    return w.event


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_gradient_from_an_aux_loss_kept_as_an_attribute_says_to_pass_the_loss(mode):
    # The replay from the outputs' finite gradients cannot meet it; the evidence blamed
    # "nondeterministic kernels, another thread or process writing the weights".
    event = _aux_attribute_event(mode)
    diagnosis = event.diagnosis
    assert (event.batch, event.is_backward, diagnosis.kind) == (1, True, "unknown")
    said = " ".join(diagnosis.evidence)
    assert "nondeterministic" not in said and "requires grad" not in said
    assert "the gradients the model's outputs received, which were finite" in said
    assert "not through the model's outputs" in said and "aux loss" in said
    assert "w.replay(1, loss_fn=...)" in said
    assert any("loss_fn" in line for line in diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
def test_with_the_whole_loss_an_aux_attributes_log_of_zero_is_a_domain_error(mode):
    # Its text said the log's value "is not used after it" while p * log(p) used it (times 0).
    event = _aux_attribute_event(mode, whole_loss_fn=True)
    assert event.diagnosis.kind == "domain"
    assert "multiplied by 0 or dropped after it" in event.diagnosis.summary + " ".join(
        event.diagnosis.evidence)


def test_output_gradients_past_the_limit_are_not_held(monkeypatch):
    from nanwidget.core.grads import backward as backward_frames
    monkeypatch.setattr(backward_frames, "MAX_HELD_OUTPUT_GRAD_BYTES", 16)  # the output's: 20
    model = NormOf()
    x = torch.randn(5, 4)
    x[2] = 0
    with watch(model, "full", backward=True) as w:
        model(x).sum().backward()
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "unknown" and "loss_fn" in diagnosis.suggestion[0]
    with watch(model, "full", backward=True, loss_fn=lambda out: out.sum()) as w:
        assert not w.parts.backward.hold_output_grads  # the loss replays it: nothing held


# ---------------------------------------------------------------------------- masked-row
class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(-1, -2)
        scores = scores.masked_fill(key_padding_mask[:, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1) @ x


@pytest.mark.parametrize("mode", MODES)
def test_softmax_over_a_fully_masked_row_names_the_rows(mode):
    model = MaskedAttention()
    padding = torch.zeros(4, 5, dtype=torch.bool)
    padding[:, 3:] = True
    padding[2] = True  # sequence 2 is all padding
    with watch(model, mode) as w:
        model(torch.randn(4, 5, 8), key_padding_mask=padding)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "masked-row" and diagnosis.confidence == "high"
    assert diagnosis.summary.startswith("_softmax in module '<root>'")
    assert line_of(MaskedAttention.forward, "torch.softmax") in diagnosis.summary
    assert diagnosis.rows == [2]
    assert "torch.finfo(scores.dtype).min" in diagnosis.suggestion[0]


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        # With its weights asked for, attention runs an explicit softmax: NaN over the row.
        return self.attn(x, x, x, key_padding_mask=key_padding_mask)[0]


@pytest.mark.parametrize("mode", MODES)
def test_multihead_attention_with_an_all_padding_sequence_is_a_masked_row(mode):
    model = SelfAttention()
    padding = torch.zeros(3, 4, dtype=torch.bool)
    padding[1] = True
    with watch(model, mode) as w:
        model(torch.randn(3, 4, 8), key_padding_mask=padding)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "masked-row"
    assert diagnosis.rows == [1]


def _padding_with_an_empty_sequence() -> torch.Tensor:
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 3:] = True
    padding[1] = True  # sequence 1 is all padding
    return padding


@pytest.mark.parametrize("mode", MODES)
def test_a_float_minus_inf_key_padding_mask_is_a_masked_row_not_bad_data(mode):
    # A float key_padding_mask (-inf where padded) was called bad data "in rows 0, 1 ...: a
    # corrupt file", with allow_inf as a fix (NaN always counts).
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(16, 2, batch_first=True)
    padding = torch.zeros(3, 5).masked_fill(_padding_with_an_empty_sequence(), -math.inf)
    with watch(attention, mode) as w, torch.no_grad():
        x = torch.randn(3, 5, 16)
        attention(x, x, x, key_padding_mask=padding)
    event, diagnosis = w.event, w.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows, diagnosis.confidence) == ("masked-row", [1], "high")
    assert diagnosis.summary.startswith("_softmax in module '<root>' (MultiheadAttention) ran "
                                        "over rows that were all -inf: row 1 of the batch is "
                                        "fully masked (kwarg:key_padding_mask)")
    assert not any("allow_inf" in fix for fix in diagnosis.suggestion)
    assert "torch.finfo(scores.dtype).min" in diagnosis.suggestion[0]
    # The event's line says the module made the NaN from the mask; none arrived with the data
    # (the kind is what arrived: the mask's -inf).
    assert event.summary().startswith(
        "inf in batch 0 at module '<root>' (MultiheadAttention, call 0), kwarg:key_padding_mask: "
        "the module made nan from its mask input kwarg:key_padding_mask (-inf where masked, on "
        "purpose)")


@pytest.mark.parametrize("mode", MODES)
def test_a_causal_mask_beside_a_fully_padded_sequence_is_a_masked_row_not_bad_data(mode):
    # The causal mask's -inf was "bad data in rows 0, 1, 2, 3" (rows of the 5x5 mask).
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    with watch(encoder, mode) as w, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: bool padding beside a float mask is deprecated
        encoder(torch.randn(3, 5, 16), mask=causal,
                src_key_padding_mask=_padding_with_an_empty_sequence())
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("masked-row", [1])
    assert "row 1 of the batch is fully masked (kwarg:src_key_padding_mask)" in diagnosis.summary
    assert "came with the mask passed in (kwarg:mask)" in diagnosis.summary


class MaskAddedToScores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(-1, -2) + mask[:, None, :]
        return torch.softmax(scores, dim=-1) @ x


@pytest.mark.parametrize("mode", MODES)
def test_an_additive_mask_passed_to_a_users_attention_names_its_softmax_line(mode):
    torch.manual_seed(0)
    model = MaskAddedToScores()
    # Positional and unnamed: its values (0 and -inf) tell it is a mask.
    mask = torch.zeros(3, 5).masked_fill(_padding_with_an_empty_sequence(), -math.inf)
    with watch(model, mode) as w:
        model(torch.randn(3, 5, 8), mask)
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("masked-row", [1])
    assert diagnosis.summary.startswith("_softmax in module '<root>' (MaskAddedToScores) at ")
    assert line_of(MaskAddedToScores.forward, "torch.softmax") in diagnosis.summary


@pytest.mark.parametrize("mode", MODES)
def test_nan_data_beside_a_causal_mask_is_still_bad_data_of_the_data_alone(mode):
    torch.manual_seed(0)
    model = MaskAddedToScores()
    causal = nn.Transformer.generate_square_subsequent_mask(5)[:3]  # (3, 5): one per sample
    x = torch.randn(3, 5, 8)
    x[2, 1, 4] = math.nan
    with watch(model, mode) as w:
        model(x, causal)
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("bad-data", [2])
    assert diagnosis.summary.startswith("The batch's input[0] holds NaN in row 2:")


class TwoMasksAdded(nn.Module):
    """float16 attention whose padding mask, filled with torch.finfo(dtype).min as advised, is
    added twice (the padding mask and an extended copy of it): min + min = -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4
        mask = (1.0 - attention_mask[:, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
        scores = scores + mask + (torch.zeros_like(scores) + mask)
        return scores.softmax(-1) @ self.v(x)


@pytest.mark.parametrize("mode", MODES)
def test_float16_masks_at_finfo_min_added_together_get_the_mask_fixes_not_bfloat16(mode):
    # The fixes were bfloat16/float32 (min + min is -inf in every dtype: the mask follows the
    # dtype) and scaling the scores; no rows were named.
    torch.manual_seed(0)
    model = TwoMasksAdded().half()
    attention_mask = torch.ones(4, 5, dtype=torch.long)
    attention_mask[1, 3:] = 0
    attention_mask[2] = 0  # sample 2 attends nothing
    with watch(model, mode) as w, torch.no_grad():
        model(torch.randn(4, 5, 16, dtype=torch.float16), attention_mask=attention_mask)
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows, diagnosis.confidence) == ("overflow", [2], "high")
    assert diagnosis.summary.startswith("add in module '<root>' (TwoMasksAdded) at ")
    assert line_of(TwoMasksAdded.forward, "torch.zeros_like") in diagnosis.summary
    assert diagnosis.summary.endswith("it added masks filled with float16's lowest value "
                                      "(-65504), and min + min passed it: -inf.")
    assert diagnosis.suggestion[0].startswith("Combine the masks without adding them at ")
    assert "torch.minimum(mask_a, mask_b)" in diagnosis.suggestion[0]
    assert "clamp_min(torch.finfo(scores.dtype).min)" in diagnosis.suggestion[1]
    assert diagnosis.suggestion[2].startswith("Running it in bfloat16 or float32 does not help")
    assert "Row 2 of the batch has a fully masked kwarg:attention_mask" in \
        "\n".join(diagnosis.evidence)


class ScoresPlusOneMask(nn.Module):
    """float16 attention with large scores (a weight grown 300x) and one padding mask filled
    with torch.finfo(dtype).min, added to them: score + min passes the lowest value."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        mask = (1.0 - attention_mask[:, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
        return scores + mask  # the -inf it made is the event (its softmax would hide it)


def test_one_finfo_min_mask_added_to_large_scores_is_not_told_as_masks_added_together():
    # One mask and the scores: it said "it added masks filled with float16's lowest value" and
    # led with torch.minimum(mask_a, mask_b), dropping the float32 advice that fixes it.
    torch.manual_seed(0)
    model = ScoresPlusOneMask()
    with torch.no_grad():
        model.q.weight.mul_(60)
        model.k.weight.mul_(60)
    model.half()
    attention_mask = torch.ones(2, 5, dtype=torch.long)
    attention_mask[1, 3:] = 0
    x = torch.randn(2, 5, 16, dtype=torch.float16)
    with watch(model, "full", replay_on_nan=True) as w, torch.no_grad():
        model(x, attention_mask=attention_mask)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow", diagnosis.summary
    assert diagnosis.summary.endswith("it added a mask filled with float16's lowest value "
                                      "(-65504) to values below 0 (scores), and the sum passed "
                                      "it: -inf.")
    assert diagnosis.suggestion[0].startswith("Apply the mask without adding it at ")
    assert "float32" in diagnosis.suggestion[2] and "mask_b" not in " ".join(diagnosis.suggestion)


class _Proposals(nn.Module):
    """Two-stage DETR style: box logits whose padded positions are set to +inf on purpose (a
    sigmoid later reads them as 1, a top-k never picks them)."""

    def __init__(self) -> None:
        super().__init__()
        self.box = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.box(x).masked_fill(padding[..., None], float("inf"))


class _TwoStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proposals = _Proposals()

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> dict:
        logits = self.proposals(x, padding)
        return {"proposal_logits": logits, "boxes": torch.sigmoid(logits)}


@pytest.mark.parametrize("mode", MODES)
def test_an_inf_a_mask_writes_into_an_output_is_no_overflow_and_names_its_allow_inf(mode):
    torch.manual_seed(0)
    model = _TwoStage()
    x, padding = torch.randn(2, 6, 8), torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    unwatched = model(x, padding)
    with watch(model, mode) as w:
        model(x, padding)
    event = w.event
    assert (event.module, event.kind) == ("proposals", "inf")
    diagnosis = event.diagnosis
    assert (diagnosis.kind, diagnosis.confidence) == ("masked-row", "high")
    assert diagnosis.summary.startswith("masked_fill in module 'proposals' (_Proposals) at ")
    assert line_of(_Proposals.forward, "masked_fill") in diagnosis.summary
    assert diagnosis.summary.endswith("wrote Inf on purpose (a mask value), and module "
                                      "'proposals' has it in its output: nothing overflowed.")
    evidence = "\n".join(diagnosis.evidence)
    assert "masked_fill input mask (bool): from 0 to 1." in evidence
    assert "masked_fill output: 8 Inf of 48 values" in evidence
    assert "Outputs that held it in batch 0: '<root>', 'proposals'." in evidence
    assert "allow_inf=['', 'proposals']" in diagnosis.suggestion[0]
    assert "torch.finfo(x.dtype).max" in diagnosis.suggestion[1]
    # Following the suggestion: no event, the same outputs.
    with nw.watch(model, mode=mode, allow_inf=["", "proposals"]) as w:
        watched = model(x, padding)
    assert w.events == []
    assert all(torch.equal(watched[key], unwatched[key]) for key in unwatched)


def test_a_real_overflow_in_a_mask_op_s_input_stays_an_overflow():
    # masked_fill over an input that already overflowed: the Inf came in, it was not written.
    model = nn.Sequential(nn.Linear(4, 4)).half()
    with torch.no_grad():
        model[0].weight.fill_(3e4)

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x).masked_fill(x < -100, 0.0)

    masked = Masked()
    with watch(masked, "full") as w:
        masked(torch.ones(2, 4).half())
    assert w.event.diagnosis.kind == "overflow"
    assert w.event.diagnosis.summary.startswith("addmm in module 'inner.0' (Linear)")


class ScoresOverUninitialised(nn.Module):
    """diffusers' classic attention: baddbmm(torch.empty(...), q, k^T, beta=0) then softmax. With
    beta=0 baddbmm ignores its first input, whatever garbage (Inf, NaN) it holds."""

    def __init__(self, garbage: float) -> None:
        super().__init__()
        self.garbage = garbage
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unread = torch.full((x.shape[0], x.shape[1], x.shape[1]), self.garbage, dtype=x.dtype)
        scores = torch.baddbmm(unread, self.q(x), self.k(x).transpose(1, 2), beta=0, alpha=1.0)
        return scores.softmax(-1) @ x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("garbage", [math.inf, math.nan])
def test_float16_attention_scores_overflowing_in_baddbmm_with_beta_0_are_an_overflow(mode, garbage):
    # The Inf in the unread input was taken for the scores' Inf: softmax became the first bad
    # op, and the verdict a masked row with mask fixes.
    torch.manual_seed(0)
    model = ScoresOverUninitialised(garbage).half()
    with torch.no_grad():
        model.q.weight.mul_(400)
        model.k.weight.mul_(400)
    with watch(model, mode) as w:
        model(torch.randn(2, 6, 8).half())
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow"
    assert diagnosis.summary.startswith("baddbmm in module '<root>' (ScoresOverUninitialised) at ")
    assert line_of(ScoresOverUninitialised.forward, "torch.baddbmm") in diagnosis.summary
    assert "float16's largest value" in diagnosis.summary
    evidence = "\n".join(diagnosis.evidence)
    assert "baddbmm input self" not in evidence  # not read: its garbage is no evidence
    assert "attention scores divided by sqrt(d)" in " ".join(diagnosis.suggestion)


class OverflowedBiasAttention(nn.Module):
    """Attention adding a position bias kept as a plain attribute (no buffer) that overflowed
    float16 when it was made: +inf in the scores, no mask anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.position_bias = (torch.linspace(0, 1, 6) * 1e5).half().expand(6, 6).clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2) + self.position_bias
        return scores.softmax(-1) @ x


def test_a_softmax_over_plus_inf_scores_is_no_masked_row():
    # Any Inf reaching a softmax was called a fully masked row; a +inf is no mask.
    torch.manual_seed(0)
    model = OverflowedBiasAttention().half()
    with watch(model, "full") as w:
        model(torch.randn(2, 6, 8).half())
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow"
    assert "all -inf" not in diagnosis.summary
    assert not any("finfo" in fix for fix in diagnosis.suggestion)


# ---------------------------------------------------------------------------- divergence
def _mlp_at_a_huge_learning_rate(mode: str, **options) -> nw.NanWatch:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 1))
    return train_until_an_event(model, torch.optim.SGD(model.parameters(), lr=5.0),
                                torch.randn(16, 8), torch.randn(16, 1), 20, mode, **options)


def train_until_an_event(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                         y: torch.Tensor, steps: int, mode: str, **options) -> nw.NanWatch:
    """Steps of mean squared error on one batch, watched, until the first event."""
    with watch(model, mode, **options) as w:
        for _ in range(steps):
            loss = ((model(x) - y) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if w.events:
                break
    return w


@pytest.mark.parametrize("mode", MODES)
def test_an_mlp_at_a_huge_learning_rate_diverges(mode):
    w = _mlp_at_a_huge_learning_rate(mode, **({"sample_every": 1} if mode == "sentinel" else {}))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "divergence" and diagnosis.confidence == "high"
    assert "Training diverged: the weights grew" in diagnosis.summary
    assert "addmm in module '2' (Linear)" in diagnosis.summary
    evidence = "\n".join(diagnosis.evidence)
    assert "The weights' abs max (summed over modules) grew" in evidence
    assert "The output abs max of '2' grew" in evidence
    assert "Lower the learning rate" in diagnosis.suggestion[0]
    assert any("clip_grad_norm_" in fix for fix in diagnosis.suggestion)


def test_a_model_keeping_an_additive_mask_as_a_buffer_can_still_diverge():
    # Its -inf mask buffer made every batch's sum of the weights' abs max inf: no climb could
    # be told, so a divergence read "overflow".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 1))
    model.register_buffer("mask", torch.full((4, 4), -math.inf).triu(1))
    w = train_until_an_event(model, torch.optim.SGD(model.parameters(), lr=5.0),
                             torch.randn(16, 8), torch.randn(16, 1), 20, "full")
    assert w.event.diagnosis.kind == "divergence"
    assert "addmm in module '2' (Linear)" in w.event.diagnosis.summary


class WeightsInAParameterDict(nn.Module):
    """An MLP whose weights sit in a ParameterDict it never calls, read by its own forward (how
    Keras' torch backend keeps every weight of a model)."""

    def __init__(self) -> None:
        super().__init__()
        layers = [nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)]
        self.params = nn.ParameterDict({f"{kind}{i}": getattr(layer, kind)
                                        for i, layer in enumerate(layers)
                                        for kind in ("weight", "bias")})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.params
        h = torch.relu(nn.functional.linear(x, p["weight0"], p["bias0"]))
        h = torch.relu(nn.functional.linear(h, p["weight1"], p["bias1"]))
        return nn.functional.linear(h, p["weight2"], p["bias2"])


@pytest.mark.parametrize("mode", MODES)
def test_weights_kept_in_a_parameter_dict_never_called_still_show_a_divergence(mode):
    # No frame of the ParameterDict measured its weights (it is never called): the climb of
    # the weights went unseen and the blow-up read "overflow".
    torch.manual_seed(0)
    model = WeightsInAParameterDict()
    w = train_until_an_event(model, torch.optim.SGD(model.parameters(), lr=5.0),
                             torch.randn(16, 8), torch.randn(16, 1), 20, mode,
                             **({"sample_every": 1} if mode == "sentinel" else {}))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "divergence"
    assert "Training diverged: the weights grew" in diagnosis.summary
    evidence = "\n".join(diagnosis.evidence)
    assert "The weights' abs max (summed over modules) grew" in evidence
    assert "Grown most since first measured: 'params'" in evidence


class DottedParams(nn.Module):
    """Keeps a network's parameters under their dotted names straight in ``_parameters``
    (as tensordict's TensorDictParams does, in every torchrl loss): never called."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        for name, parameter in network.named_parameters():
            self._parameters[name] = parameter  # "0.weight": a key nn.Module would refuse


class FunctionalLoss(nn.Module):
    """A torchrl-style loss module: it runs its network functionally on the weights
    ``DottedParams`` keeps (the network itself is no submodule) and returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        network = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
        self.actor_params = DottedParams(network)
        object.__setattr__(self, "network", network)  # hidden, as the loss keeps it

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        weights = dict(self.actor_params.named_parameters())
        out = torch.func.functional_call(self.network, weights, (x,))
        return (out - target).square().mean()


@pytest.mark.parametrize("mode", MODES)
def test_weights_kept_under_dotted_names_name_the_step_after_the_bad_data_batch(mode):
    # Batch 2's NaN observation is bad data; its optimizer step writes NaN into the weights,
    # and batch 3 meets them. The weights' last finite batch was looked up under the name
    # cut at its last dot ('actor_params.0'), which holds no weights: the diagnosis said
    # "between batch 1 and batch 2" although batch 2 ran with finite weights.
    torch.manual_seed(0)
    loss_module = FunctionalLoss()
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=1e-2)
    x, y = torch.randn(16, 3), torch.randn(16, 1)
    with watch(loss_module, mode) as w:
        for batch in range(4):
            observation = x.clone()
            if batch == 2:
                observation[4, 0] = math.nan  # from the environment
            loss = loss_module(observation, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    first, second = w.events[:2]
    assert (first.batch, first.diagnosis.kind) == (2, "bad-data")
    assert (second.batch, second.diagnosis.kind) == (3, "corrupted-weight")
    assert "became NaN between batch 2 and batch 3" in second.diagnosis.summary
    assert "finite when batch 2 ran" in "\n".join(second.diagnosis.evidence)


_SINCE_START = ("sentinel mode measured the weights at those two times only: the watch's start "
                "and this event")


def test_sentinel_without_samples_tells_an_mlp_at_a_huge_learning_rate_diverged_as_full_does():
    # Without sample_every no batch's weights were measured before the event: the blow-up
    # read "overflow" with a line asking for sample_every=N, where full mode said divergence.
    # The weights' abs max when the watch began, against the event's, over the optimizer
    # steps between (the root's outputs climbing too) tells it.
    full = _mlp_at_a_huge_learning_rate("full").event.diagnosis
    diagnosis = _mlp_at_a_huge_learning_rate("sentinel").event.diagnosis
    assert full.kind == diagnosis.kind == "divergence"
    assert diagnosis.confidence == "medium"  # two measurements, not a recorded climb
    assert "addmm in module '2' (Linear)" in diagnosis.summary
    assert "per optimizer step since the watch began" in diagnosis.summary
    evidence = "\n".join(diagnosis.evidence)
    assert "The weights' abs max (summed over modules) grew from " in evidence
    assert "when the watch began to " in evidence and _SINCE_START in evidence
    assert "The output abs max of '<root>' grew" in evidence
    assert "sample_every=N" not in evidence
    assert "Lower the learning rate" in diagnosis.suggestion[0]


def test_sentinel_without_samples_tells_a_warmed_up_learning_rate_diverged_into_a_nan_weight():
    # A learning rate warmed up to too high: the weights go NaN in a step after the outputs
    # climbed 1e12x. It read corrupted-weight ("the optimizer step, load or write after batch
    # 38 did it"); full mode says divergence, and so does the sentinel now.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 4))
    teacher = torch.randn(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with watch(model, "sentinel") as w:
        for step in range(60):
            optimizer.param_groups[0]["lr"] = min(2.0, 0.05 * (step + 1))
            x = torch.randn(32, 16)
            loss = nn.functional.mse_loss(model(x), x @ teacher)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if w.events:
                break
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.origin, diagnosis.kind, diagnosis.confidence) == ("weight", "divergence",
                                                                    "medium")
    assert diagnosis.summary.startswith("Training diverged: the weights grew ")
    evidence = "\n".join(diagnosis.evidence)
    assert f"over the {event.batch} optimizer steps between" in evidence
    assert _SINCE_START in evidence
    # Which Linear grew most depends on the CPU's matrix kernels (the climb is chaotic: '2' with
    # AVX2 paths, '4' with AVX-512 ones); that a Linear is named, with its growth, does not.
    grown = re.search(r"Grown most since first measured: '([024])' ([0-9.e+]+)x", evidence)
    assert grown is not None and float(grown.group(2)) > 1e3, evidence


class ReluRNN(nn.Module):
    """A vanilla RNN written out, with no tanh to bound its state."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.rec = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 16)
        for t in range(x.shape[1]):
            h = torch.relu(self.inp(x[:, t]) + self.rec(h))
        return self.head(h)


def _relu_rnn_at(lr: float, mode: str) -> nw.NanWatch:
    torch.manual_seed(0)
    model = ReluRNN()
    return train_until_an_event(model, torch.optim.SGD(model.parameters(), lr=lr),
                                torch.randn(8, 6, 4), torch.randn(8, 1), 40, mode)


@pytest.mark.parametrize("lr, origin, old", [(1.0, "weight", "corrupted-weight"),
                                             (3.0, "output", "overflow")])
def test_a_vanilla_rnn_blown_up_by_its_learning_rate_diverges_in_sentinel_mode_as_in_full(
        lr, origin, old):
    # The weights grew step by step until one went NaN (lr=1) or the recurrence overflowed
    # (lr=3): full mode says divergence; sentinel mode without sample_every said `old`.
    full = _relu_rnn_at(lr, "full").event
    event = _relu_rnn_at(lr, "sentinel").event
    assert (full.batch, full.origin, full.diagnosis.kind) == (event.batch, origin, "divergence")
    assert event.diagnosis.kind == "divergence" != old
    assert "since the watch began" in event.diagnosis.summary
    assert _SINCE_START in "\n".join(event.diagnosis.evidence)
    assert event.diagnosis.suggestion == full.diagnosis.suggestion


def test_sentinel_without_samples_tells_no_divergence_from_a_checkpoint_loaded_after_the_watch():
    # The watch began on a fresh model; a checkpoint with 20x larger weights was loaded, then
    # a few healthy steps, then a write of NaN: the weights are 20x what they were at the
    # start after 4 steps (over 2x per step), but the outputs did not climb: no divergence.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    trained = {k: v * 20 for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(16, 8)
    with watch(model, "sentinel") as w:
        model.load_state_dict(trained)
        for step in range(6):
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step == 4:
                with torch.no_grad():
                    model[2].weight[0, 0] = math.nan
    diagnosis = w.event.diagnosis
    assert (w.event.batch, diagnosis.kind) == (5, "corrupted-weight")
    assert "sample_every=N" in "\n".join(diagnosis.evidence)  # what it could not check


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_written_nan_after_a_few_healthy_steps_is_no_divergence(mode):
    # Five AdamW steps on a fresh model: the weights moved a little; sentinel mode compares
    # them with the watch's start and must not call that a climb.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    teacher = torch.randn(8, 4) * 5
    with watch(model, mode) as w:
        for step in range(7):
            x = torch.randn(16, 8)
            loss = nn.functional.mse_loss(model(x), x @ teacher)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step == 5:
                with torch.no_grad():
                    model[2].weight[0, 0] = math.nan
    assert (w.event.batch, w.event.diagnosis.kind) == (6, "corrupted-weight")


_OUTPUTS_ALONE = "this rests on the outputs' climb alone"


def _tiny_linear_at_lr_1(mode: str) -> nw.NanWatch:
    """SGD at lr=1 on one Linear whose inputs are large: each step multiplies the weights by
    about 30, and the last one makes every weight Inf at once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1))
    return train_until_an_event(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                torch.randn(16, 4) * 3, torch.randn(16, 1), 60, mode)


def test_sentinel_tells_a_step_that_made_every_weight_inf_after_a_climb_diverged_as_full_does():
    # The last step made every weight Inf: sentinel mode had no finite weight to compare with
    # the watch's start, and said corrupted-weight ("the optimizer step, load or write after
    # batch 26 did it") with clipping's fixes. The root's outputs, read every batch, climbed
    # 30x per step into the event: a divergence, told from them alone.
    full = _tiny_linear_at_lr_1("full").event
    event = _tiny_linear_at_lr_1("sentinel").event
    assert (full.batch, full.origin, full.diagnosis.kind) == (27, "weight", "divergence")
    assert (event.batch, event.origin) == (full.batch, full.origin)
    assert (event.diagnosis.kind, event.diagnosis.confidence) == ("divergence", "medium")
    assert event.diagnosis.summary.startswith(
        "Training diverged, as the model's outputs tell: they grew 30.3x per optimizer step "
        "from batch 12 to batch 26")
    evidence = "\n".join(event.diagnosis.evidence)
    assert "an optimizer step between the batches, geometric to the end" in evidence
    assert _OUTPUTS_ALONE in evidence and "0.weight, 0.bias are Inf" in evidence
    assert event.diagnosis.suggestion == full.diagnosis.suggestion


def _lbfgs_steps_of_one_iteration(mode: str) -> nw.NanWatch:
    """torch.optim.LBFGS with max_iter=1 at lr=10 (no line search): one closure call per
    step, the weights climbing step after step until NaN."""
    return _lbfgs_fit(mode, 10.0, steps=40, max_iter=1)


def test_sentinel_tells_lbfgs_diverging_over_its_steps_into_nan_weights_as_full_does():
    # Every weight NaN at the event after 19 LBFGS steps: it read corrupted-weight with
    # clipping's fixes; full mode says divergence with LBFGS's own.
    full = _lbfgs_steps_of_one_iteration("full").event
    event = _lbfgs_steps_of_one_iteration("sentinel").event
    assert (full.batch, full.diagnosis.kind) == (event.batch, "divergence") == (19, "divergence")
    assert (event.diagnosis.kind, event.diagnosis.confidence) == ("divergence", "medium")
    assert "as the model's outputs tell" in event.diagnosis.summary
    evidence = "\n".join(event.diagnosis.evidence)
    assert _OUTPUTS_ALONE in evidence
    assert "The steps are torch.optim.LBFGS's (lr=10, max_iter=1" in evidence
    assert event.diagnosis.suggestion == full.diagnosis.suggestion
    assert event.diagnosis.suggestion[0].startswith("Give LBFGS a line search")


@pytest.mark.parametrize("how", ["load_state_dict", "fill_"])
@pytest.mark.parametrize("mode", MODES)
def test_every_weight_made_nan_after_healthy_steps_is_no_divergence(mode, how):
    # A NaN checkpoint loaded (or every weight written NaN by hand) after six healthy steps:
    # no finite weight is left to measure, and the outputs did not climb.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    bad = {name: torch.full_like(value, math.nan) for name, value in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    with watch(model, mode) as w:
        for step in range(8):
            loss = ((model(x) - y) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step == 6:
                if how == "load_state_dict":
                    model.load_state_dict(bad)
                else:
                    with torch.no_grad():
                        for parameter in model.parameters():
                            parameter.fill_(math.nan)
    assert (w.event.batch, w.event.diagnosis.kind) == (7, "corrupted-weight")
    assert _OUTPUTS_ALONE not in "\n".join(w.event.diagnosis.evidence)


@pytest.mark.parametrize("head, lr", [(0.01, 1.0), (0.0, 2.0)], ids=["small head", "zero head"])
@pytest.mark.parametrize("written", ["every weight", "one weight"])
@pytest.mark.parametrize("mode", MODES)
def test_logits_that_sharpen_and_then_a_nan_written_are_no_divergence(mode, written, head, lr):
    # A small head at lr=1: the logits grow 259x in 7 steps (2.2x per step), fast at first and
    # slower after, as cross-entropy sharpens them; then NaN is written. Sentinel mode said
    # "Training diverged: the weights grew 1.15x per optimizer step since the watch began" for
    # one weight written. A zero head at lr=2: full mode said "Training diverged: the weights
    # grew 1.19x per batch since batch 0" (high), from 0.70 to 2.39 in 7 batches, by about the
    # same each batch (0.12 to 0.33): cross-entropy's bounded gradient adds, a divergence
    # multiplies. A divergence's climb does not slow down.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[2].weight.mul_(head)
        model[2].bias.zero_()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=generator)
    y = x[:, :4].argmax(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with watch(model, mode) as w:
        for step in range(9):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step == 7:
                with torch.no_grad():
                    if written == "every weight":
                        for parameter in model.parameters():
                            parameter.fill_(math.nan)
                    else:
                        model[2].weight[0, 0] = math.nan
    root = w.history().query("module == ''")["abs_max"].tolist()
    assert root[7] > max(200 * root[0], 2)  # a steep climb (from 0 for the zero head), slowing
    assert (w.event.batch, w.event.diagnosis.kind) == (8, "corrupted-weight")


@pytest.mark.parametrize("mode", MODES)
def test_a_transformer_encoder_at_learning_rate_20_diverges(mode):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                          nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=20.0)
    x, y = torch.randn(8, 6, 16), torch.randint(0, 4, (8, 6))
    with watch(model, mode, **({"sample_every": 1} if mode == "sentinel" else {})) as w:
        for _ in range(12):
            loss = nn.functional.cross_entropy(model(x).reshape(-1, 4), y.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if w.events:
                break
    event = w.event
    assert event.module == "0.layers.0.norm2"
    diagnosis = event.diagnosis
    assert diagnosis.kind == "divergence"
    assert "native_layer_norm in module '0.layers.0.norm2'" in diagnosis.summary
    assert "a square or a sum inside it passed float32's largest value" in diagnosis.summary
    assert any(line.startswith("Grown most since first measured: ") for line in diagnosis.evidence)


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update, as peft's LoRA layer adds one."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * 2.0


def _lora_llama_blown_up_by_its_learning_rate(left_pad: bool) -> nw.NanWatch:
    """A tiny Llama with LoRA on q_proj and v_proj, AdamW's lr raised to 1e4 at batch 2; with
    ``left_pad`` one prompt of every batch is left-padded (fully masked rows, harmless)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config).requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    with watch(model, "full", backward=True) as w:
        for step in range(24):
            ids = torch.randint(3, 500, (4, 12), generator=generator)
            attention_mask = torch.ones(4, 12, dtype=torch.long)
            if left_pad:
                attention_mask[0, :3] = 0
            if step == 2:
                optimizer.param_groups[0]["lr"] = 1e4
            model(input_ids=ids, attention_mask=attention_mask, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if w.events:
                break
    return w


@pytest.mark.parametrize("left_pad", [False, True])
def test_a_lora_llama_blown_up_by_its_learning_rate_diverges_with_or_without_padding(left_pad):
    # With one left-padded prompt (fully masked rows in every batch) the blow-up read
    # "masked-row (high)", with finfo.min masks as the fix: the attention's backward got the
    # -inf mask beside queries of 3e13 and made Inf, which a masked row never makes. Where the
    # climb overflows first depends on the CPU's matrix kernels (that backward on AVX2 paths,
    # LoRA's lora_B matmul a few batches later on AVX-512 ones): either way, a divergence.
    diagnosis = _lora_llama_blown_up_by_its_learning_rate(left_pad).event.diagnosis
    assert (diagnosis.kind, diagnosis.confidence) == ("divergence", "high")
    assert "Training diverged: the weights grew" in diagnosis.summary
    assert re.search(r"until (_scaled_dot_product\w*|mm) in module 'model\.layers\.",
                     diagnosis.summary), diagnosis.summary
    assert "all -inf" not in diagnosis.summary
    assert "Lower the learning rate" in diagnosis.suggestion[0]
    assert not any("finfo" in fix for fix in diagnosis.suggestion)


# ---------------------------------------------------------------------------- corrupted-weight
def _reference_forward_after_a_nan_base_weight(mode: str, *, adapters_off: bool
                                              ) -> nw.NanEvent:
    """A training forward, then a base weight written NaN, then a forward under no_grad: with
    the adapter switched off (DPO's reference forward without a ref_model), or on in eval
    mode (an evaluation or generation pass)."""
    torch.manual_seed(0)
    model = AdaptedNet()
    with watch(model, mode) as w:
        model(torch.randn(4, 8))
        with torch.no_grad():
            model.layer.base.weight[0, 0] = float("nan")
            model.layer.disable_adapters = adapters_off
            model.eval()
            model(torch.randn(4, 8))
        model.layer.disable_adapters = False
    return w.event


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_first_met_in_a_forward_with_the_adapters_disabled_is_said_to_be_there(mode):
    # The event said "batch 1" (under a trainer: "forward 1 of 2") and nothing told that the
    # forward was the reference one, run with the adapters off.
    event = _reference_forward_after_a_nan_base_weight(mode, adapters_off=True)
    assert (event.batch, event.module, event.role) == (1, "layer.base", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert diagnosis.summary.endswith(" Batch 1 ran with the adapters disabled: the base model "
                                      "alone (a reference forward).")
    assert diagnosis.evidence[0].startswith(
        "Batch 1 ran with the model's adapters disabled (peft's `with model.disable_adapter():`"
        ", under torch.no_grad(), in eval mode): the base model alone")
    assert "Batch 1 ran with the adapters disabled" in "\n".join(diagnosis.lines())


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_under_no_grad_in_eval_mode_with_the_adapters_on_is_no_reference_forward(mode):
    event = _reference_forward_after_a_nan_base_weight(mode, adapters_off=False)
    assert (event.batch, event.module, event.diagnosis.kind) == (1, "layer.base",
                                                                 "corrupted-weight")
    assert "adapters disabled" not in "\n".join(event.diagnosis.lines())


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_first_met_in_a_forward_with_another_adapter_active_is_said_to_be_there(mode):
    torch.manual_seed(0)
    model = AdaptedNet()
    with watch(model, mode) as w:
        model(torch.randn(4, 8))
        with torch.no_grad():
            model.layer.base.weight[0, 0] = float("nan")
            model.layer.active_adapters = ["ref"]  # peft's set_adapter("ref")
            model(torch.randn(4, 8))
        model.layer.active_adapters = ["default"]
    diagnosis = w.event.diagnosis
    assert (w.event.batch, diagnosis.kind) == (1, "corrupted-weight")
    assert "Batch 1 ran with adapter 'ref' active, not 'default'" in diagnosis.summary
    assert "adapters disabled" not in diagnosis.summary


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_adapter_weight_spares_the_reference_forward_and_is_met_in_the_next(mode):
    torch.manual_seed(0)
    model = AdaptedNet()
    with watch(model, mode) as w:
        model(torch.randn(4, 8))
        with torch.no_grad():
            model.layer.lora_A.weight[0, 0] = float("nan")
            model.layer.disable_adapters = True
            model(torch.randn(4, 8))  # the adapter does not run: clean
            model.layer.disable_adapters = False
        assert not w.events
        model(torch.randn(4, 8))
    event = w.event
    assert (event.batch, event.module, event.origin) == (2, "layer.lora_A", "weight")
    assert event.diagnosis.kind == "corrupted-weight"
    assert "adapters disabled" not in "\n".join(event.diagnosis.lines())


class GaussianPolicy(nn.Module):
    """A Gaussian policy driven as an RL loop drives it: its forward samples a rollout's
    action (scaled by exp(log_std)) and returns the squared deviation a log-prob takes; the
    training pass reads the parts directly, between rollouts of many forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.log_std = nn.Parameter(torch.zeros(4))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        mean = self.body(obs)
        action = mean + self.log_std.exp() * torch.ones_like(mean)
        return (action - mean).pow(2).sum(-1)


@pytest.mark.parametrize("healthy_updates", [0, 80], ids=["at-once", "after-80-updates"])
def test_weights_grown_by_updates_many_rollout_batches_apart_are_a_divergence(healthy_updates):
    # 16 rollout forwards per update: counted by batch the weights grew 1.07x per batch, no
    # divergence, and the overflow of the squared deviation was told as a plain "overflow"
    # with fixes for the op's line (a stable form of pow) instead of the learning rate. (After
    # 80 healthy updates the record of each is full.)
    torch.manual_seed(0)
    policy = GaussianPolicy()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-4)
    with nw.watch(policy, on_nan="record") as w:
        for update in range(healthy_updates + 40):
            if update == healthy_updates:
                opt.param_groups[0]["lr"] = 10.0
            obs = torch.randn(16, 4)
            with torch.no_grad():
                for row in obs:
                    policy(row[None])
            loss = -(policy.log_std.sum() + policy.body(obs).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if w.events:
                break
        diagnosis = w.event.diagnosis
    assert (w.event.module, w.event.role) == ("", "output")
    assert diagnosis.kind == "divergence"
    assert "per optimizer step" in diagnosis.summary
    assert diagnosis.suggestion[0].startswith("Lower the learning rate")


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_written_nan_after_healthy_training_is_no_divergence(mode):
    # 50 AdamW steps move the weights' abs max from their initialisation by a few percent per
    # batch (over 2x in all): that climb is training, not a divergence.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    teacher = torch.randn(8, 4) * 5
    options = {"sample_every": 5} if mode == "sentinel" else {}
    losses = []
    with watch(model, mode, **options) as w:
        for step in range(52):
            x = torch.randn(16, 8)
            loss = nn.functional.mse_loss(model(x), x @ teacher)
            losses.append(loss.item())
            if w.events:
                break
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step == 50:
                with torch.no_grad():
                    model[2].weight[0, 0] = math.nan
    assert min(losses) < losses[0] / 10  # it trained
    diagnosis = w.event.diagnosis
    assert (w.event.batch, diagnosis.kind) == (51, "corrupted-weight")
    assert diagnosis.summary.startswith("'2.weight' became NaN between batch 50 and batch 51")


def _weight_written_nan(mode: str, batches: int, after: int):
    """A watched run whose last Linear's weight is written NaN after batch ``after``."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(6, 4)
    with watch(model, mode) as w:
        for batch in range(batches):
            model(x)
            if batch == after:
                with torch.no_grad():
                    model[2].weight[0, 0] = math.nan
    return w


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_written_nan_between_batches_names_the_batch_after_which(mode):
    w = _weight_written_nan(mode, batches=4, after=2)
    diagnosis = w.event.diagnosis
    assert (w.event.batch, diagnosis.kind, diagnosis.confidence) == (3, "corrupted-weight", "high")
    assert diagnosis.summary.startswith("'2.weight' became NaN between batch 2 and batch 3")
    evidence = "\n".join(diagnosis.evidence)
    assert "finite" in evidence and "when batch 2 ran" in evidence
    assert "version counter of 2.weight moved after batch 2" in evidence


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_still_nan_batches_later_names_the_first_batch_that_used_it(mode):
    # on_nan="record": the weight written NaN after batch 1 makes an event in every batch after;
    # batch 2 used it first, not batch 4.
    w = _weight_written_nan(mode, batches=5, after=1)
    assert [e.batch for e in w.events] == [2, 3, 4]
    assert w.events[0].diagnosis.summary.endswith("batch 2 is the first to use it.")
    assert w.events[2].diagnosis.summary == (
        "'2.weight' became NaN between batch 1 and batch 2: the optimizer step, load or write "
        "after batch 1 did it; batch 2 was the first to use it, and batch 4 still does.")


class _ConvBatchNorm(nn.Module):
    """A conv with its BatchNorm, fused for deployment after it was watched."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


@pytest.mark.parametrize("mode", MODES)
def test_a_conv_fused_after_watch_from_a_bad_batch_norm_is_blamed_on_the_fusion(mode):
    # fuse_conv_bn_eval after batch 0 from a negative running_var puts a new, NaN conv in the
    # model. Sentinel mode said its weight "holds NaN since before the watch began" (the old
    # conv's unchanged version counter), and both modes led their fixes with the optimizer step.
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    torch.manual_seed(0)
    model = _ConvBatchNorm().eval()
    x = torch.randn(2, 1, 8, 8)
    with watch(model, mode) as w, torch.no_grad():
        model(x)
        model.bn.running_var[1] = -2.0
        model.conv, model.bn = fuse_conv_bn_eval(model.conv, model.bn), nn.Identity()
        model(x)
        model(x)
    assert [(e.batch, e.module, e.role) for e in w.events] == [(1, "conv", "weight"),
                                                                 (2, "conv", "weight")]
    first, later = (e.diagnosis for e in w.events)
    assert first.kind == "corrupted-weight"
    after = "likely after batch 0" if mode == "sentinel" else "after batch 0"
    assert first.summary.startswith(
        f"'conv.weight' holds NaN in module 'conv', added or replaced after watch(), {after}: "
        "what made it (a fusion, a load, a module swap)")
    assert first.summary.endswith("batch 1 is the first whose outputs it made NaN.")
    assert later.summary.endswith(
        "batch 1 was the first whose outputs it made NaN, and batch 2 still reads it.")
    assert "before the watch" not in first.summary
    assert first.confidence == ("medium" if mode == "sentinel" else "high")
    assert "fuse_conv_bn_eval" in first.suggestion[0] and "running_var" in first.suggestion[0]
    assert not any("optimizer.step()" in fix or "clip" in fix for fix in first.suggestion)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("assign", [False, True])
def test_a_bad_checkpoint_loaded_during_inference_leads_with_the_load_not_the_optimizer(
        mode, assign):
    # No optimizer ever stepped: the diagnosis led its fixes with "catch the bad step ...
    # before optimizer.step()" and gradient clipping, and said of a load with assign=True (a new
    # Parameter) that "the version counter moved (an in-place write: optimizer.step() or copy_)".
    # Then it said "the write, average or load after batch 1 did it"; the load is named now.
    torch.manual_seed(0)
    state = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).state_dict()
    state["2.weight"][1, 2] = math.nan
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    with watch(model, mode) as w, torch.no_grad():
        for batch in range(3):
            if batch == 2:
                model.load_state_dict(state, assign=assign)
            model(torch.randn(5, 4))
    event = w.event
    assert (event.batch, event.module, event.role) == (2, "2", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight" and diagnosis.confidence == "high"
    assert diagnosis.summary.startswith(
        "'2.weight' holds NaN since model.load_state_dict(...) at ")
    assert diagnosis.summary.endswith(
        " loaded it after batch 1: the state dict it loaded held NaN there, no step or write of "
        "this run made it; batch 2 is the first to use it.")
    assert "It was finite when batch 1 ran." in diagnosis.evidence
    assert "torch.isfinite(v).all()" in diagnosis.suggestion[0]
    assert not any("optimizer.step()" in fix or "clip" in fix for fix in diagnosis.suggestion)


class _WithExtra(nn.Module):
    """A model with a keyword input added to the data (bad data can come in through it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.body(x + extra)


@pytest.mark.parametrize("mode", MODES)
def test_weights_stepped_nan_after_a_bad_data_batch_name_that_batch(mode):
    # Batch 3 runs with finite weights on NaN data; its NaN gradients are stepped, so the
    # weights are NaN from batch 4: the step after batch 3 did it, whatever batch 3's event was.
    torch.manual_seed(0)
    model = _WithExtra()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, mode) as w:
        for batch in range(5):
            extra = torch.zeros(4, 8)
            if batch == 3:
                extra[3, 1] = math.nan
            loss = model(torch.randn(4, 8), extra=extra).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    first, second = w.events[:2]
    assert (first.batch, first.diagnosis.kind) == (3, "bad-data")
    diagnosis = second.diagnosis
    assert (second.batch, second.origin, diagnosis.kind) == (4, "weight", "corrupted-weight")
    assert "became NaN between batch 3 and batch 4" in diagnosis.summary
    assert "when batch 3 ran" in "\n".join(diagnosis.evidence)


def test_weights_stepped_nan_after_an_event_whose_frames_left_the_ring_name_that_batch():
    # Batch 2 meets a NaN weight in layer 2, so its loss and every gradient are NaN, and the
    # step after it makes every weight NaN. Layer 0's weights were measured finite in batch 2,
    # but the ring (2 frames) no longer holds that frame, and batch 2 had an event: the weight
    # log says so (it said "between batch 1 and batch 2"). Full mode: sentinel mode tells
    # batch 3 as the persisting layer-2 weight, which it also is.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    with watch(model, "full", max_frames=2) as w:
        for batch in range(4):
            if batch == 2:
                with torch.no_grad():
                    model[2].weight[0, 0] = math.nan
            loss = (model(x) - y).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    first, second = w.events[:2]
    assert (first.batch, first.module, second.batch, second.module) == (2, "2", 3, "0")
    assert first.diagnosis.summary.startswith("'2.weight' became NaN between batch 1 and batch 2")
    assert second.diagnosis.summary.startswith(
        "'0.weight', '0.bias' became NaN between batch 2 and batch 3")
    assert "finite when batch 2 ran" in "\n".join(second.diagnosis.evidence)


def _weight_written_nan_after_batch_3(mode: str, **options) -> nw.NanWatch:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, mode, **options) as w:
        for batch in range(6):
            loss = model(torch.randn(4, 8)).square().mean()
            if w.events:
                break
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if batch == 3:
                with torch.no_grad():
                    model[2].weight[1, 3] = math.nan
    return w


@pytest.mark.parametrize("mode, sample_every", [("full", None), ("sentinel", 2)])
def test_a_weight_written_nan_after_an_unsampled_batch_names_that_batch(mode, sample_every):
    # Sentinel mode samples batches 0 and 2 in full; batch 3 is held and ran without an event,
    # so it is the last batch that ran with the weight finite, not the sampled batch 2.
    w = _weight_written_nan_after_batch_3(
        mode, **({"sample_every": sample_every} if mode == "sentinel" else {}))
    diagnosis = w.event.diagnosis
    assert (w.event.batch, diagnosis.kind, diagnosis.confidence) == (4, "corrupted-weight", "high")
    assert diagnosis.summary.startswith("'2.weight' became NaN between batch 3 and batch 4")
    assert "version counter of 2.weight moved after batch 3" in "\n".join(diagnosis.evidence)


def test_sentinel_mode_with_too_few_samples_says_how_many_not_that_it_had_no_sample_every():
    evidence = _weight_written_nan_after_batch_3("sentinel", sample_every=2).event.diagnosis.evidence
    assert not any("without sample_every" in line for line in evidence)
    assert ("Sentinel mode (sample_every=2) had measured the weights of only 2 batches up to "
            "batch 4, too few to check whether they grew") in "\n".join(evidence)


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_written_in_place_while_gradients_are_checked_points_at_the_write(mode):
    # backward=True checked every gradient and none was non-finite (a target-network style
    # write under no_grad made the NaN): the first fix said "watch with backward=True (a
    # non-finite gradient stops there)", already on, and with no non-finite gradient to stop at.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(6, 4)
    with watch(model, mode, backward=True) as w:
        for batch in range(4):
            if batch == 2:
                with torch.no_grad():
                    model[2].weight[0, 0] = math.nan
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    event = w.events[0]
    assert (event.batch, event.origin, event.is_backward) == (2, "weight", False)
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert "none was non-finite" in "\n".join(diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith("The watch checked every gradient (backward=True) "
                                              "and none was non-finite")
    assert "target-network, EMA or Polyak update" in diagnosis.suggestion[0]
    assert not any("watch with backward=True" in fix for fix in diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad_lr, tensor_lr", [(math.nan, False), (math.inf, True)])
def test_a_scheduler_that_sets_a_nonfinite_learning_rate_is_named(mode, bad_lr, tensor_lr):
    # LambdaLR's lambda gives NaN (or Inf) at step 3: the step after batch 3 writes NaN into
    # every weight from finite gradients. It was told as a write or a step with "catch the bad
    # step: backward=True" and "clip the gradients", which cannot help; the lr went unread.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    lr = torch.tensor(0.1) if tensor_lr else 0.1  # a tensor lr on the CPU is read too
    optimizer = torch.optim.Adam(model.parameters(), lr=lr) if tensor_lr \
        else torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: bad_lr if step == 3 else 1.0)
    generator = torch.Generator().manual_seed(1)
    with watch(model, mode, backward=True) as w:
        for _ in range(6):
            x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            scheduler.step()
    event = w.event
    diagnosis = event.diagnosis
    shown = "nan" if math.isnan(bad_lr) else "inf"
    kind = "Adam" if tensor_lr else "SGD"
    assert (event.batch, event.origin, diagnosis.kind, diagnosis.confidence) == \
        (4, "weight", "corrupted-weight", "high")
    assert f"in the {kind} step after batch 3, which ran with a non-finite learning rate " \
        f"(lr={shown})" in diagnosis.summary
    assert f"Optimizer {kind} stepped with lr={shown} after batch 3" in "\n".join(
        diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith(f"Find what set the learning rate to {shown}: ")
    assert not any("clip" in fix or "backward=True" in fix for fix in diagnosis.suggestion)


def test_a_nonfinite_learning_rate_of_a_step_that_wrote_nothing_is_not_blamed():
    # A step with lr=nan that wrote no parameter (none had a gradient) marks none of them.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, "full") as w:
        for batch in range(4):
            model(torch.randn(3, 4))
            if batch == 1:
                optimizer.param_groups[0]["lr"] = math.nan
                optimizer.step()  # no backward: no gradient, nothing written
                with torch.no_grad():
                    model[2].weight[0, 0] = math.nan
    diagnosis = w.event.diagnosis
    assert (w.event.batch, diagnosis.kind) == (2, "corrupted-weight")
    assert "learning rate" not in diagnosis.summary


class _StepRaisingOnce(torch.optim.SGD):
    """An SGD whose first step raises before writing anything: a Ctrl-C in ``opt.step()``, or
    a fused optimizer's kernel refusing its inputs."""

    def __init__(self, params, lr, error: BaseException) -> None:
        super().__init__(params, lr=lr)
        self.error: BaseException | None = error

    def step(self, closure=None):
        error, self.error = self.error, None
        if error is not None:
            raise error
        return super().step(closure)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("fused kernel failed")],
                         ids=["ctrl-c", "error"])
def test_an_optimizer_step_that_raised_is_over_for_a_later_nan(mode, error):
    # A step that raised runs no post-step hook: it stayed "in progress", so a weight made
    # NaN by a write after it was blamed on that step's lr=nan ("Batch 3's forward ran inside
    # that step"), though it wrote nothing and ended long before.
    from nanwidget.core.writes import step_in_progress
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, mode) as w:
        for _ in range(2):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        flaky = _StepRaisingOnce(model.parameters(), math.nan, error)  # its lr: never used
        flaky.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(type(error)):
            flaky.step()
        assert step_in_progress() == 0
        with torch.no_grad():
            model[2].weight[0, 3] = math.nan  # a write between batches
        model(x)
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.module, event.origin, diagnosis.kind) == \
        (3, "2", "weight", "corrupted-weight")
    text = " ".join([diagnosis.summary] + diagnosis.evidence + diagnosis.suggestion)
    assert "learning rate" not in text and "_StepRaisingOnce" not in text
    assert "inside that step" not in text


def _ema_copy_broken_by_its_student(mode: str, **options) -> nw.NanWatch:
    """An EMA copy updated with torch._foreach_lerp_ (as timm's and diffusers' are), watched;
    the student it follows gets an Inf bias after batch 2, which the next update brings in."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(student.parameters(), lr=0.05)
    ema = copy.deepcopy(student).eval()
    generator = torch.Generator().manual_seed(1)
    with watch(ema, mode, **options) as w:
        for batch in range(4):
            x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
            optimizer.zero_grad()
            nn.functional.mse_loss(student(x), y).backward()
            optimizer.step()
            if batch == 2:
                with torch.no_grad():
                    student[2].bias[1] = math.inf
            with torch.no_grad():
                torch._foreach_lerp_(list(ema.parameters()), list(student.parameters()), 0.1)
                ema(x)
    return w


@pytest.mark.parametrize("mode", MODES)
def test_an_ema_copy_no_optimizer_steps_is_told_written_not_stepped(mode):
    # No optimizer holds the EMA's parameters (the step hook marked only the student's), and no
    # backward pass ran through it: it said "the optimizer step, load or write ... did it", led
    # with "watch with backward=True / check_grad_norms()" and "clip the gradients", and with
    # backward=True claimed it "checked the gradients of every backward pass".
    w = _ema_copy_broken_by_its_student(mode, backward=True)
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.origin, diagnosis.kind) == (2, "weight", "corrupted-weight")
    assert diagnosis.summary.startswith("'2.bias' became Inf between batch 1 and batch 2: the "
                                        "write, average or load after batch 1 did it")
    evidence = "\n".join(diagnosis.evidence)
    assert "No optimizer step wrote '2.bias' while the watch was live" in evidence
    assert "No backward pass ran through the watched model" in evidence
    assert "every backward pass" not in evidence
    assert diagnosis.suggestion[0].startswith("No optimizer step wrote 2.bias: look for what "
                                              "else wrote it after batch 1: an EMA")
    assert not any("clip" in fix or "backward=True" in fix or "check_grad_norms" in fix
                   for fix in diagnosis.suggestion)


def test_an_averaged_models_buffer_gone_nan_is_told_written_not_stepped():
    # AveragedModel(use_buffers=True) averages the BatchNorm's running_var too: a buffer is in
    # no optimizer, yet the fixes were those of a bad optimizer step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averaged = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9), use_buffers=True)
    generator = torch.Generator().manual_seed(1)
    with watch(averaged, "full") as w:
        for batch in range(4):
            x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if batch == 2:
                with torch.no_grad():
                    model[1].running_var.fill_(math.nan)
            averaged.update_parameters(model)
            with torch.no_grad():
                averaged.eval()(x)
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.module, event.role, diagnosis.kind) == \
        (2, "module.1", "running_var", "corrupted-weight")
    assert "the write, average or load after batch 1 did it" in diagnosis.summary
    assert "'module.1.running_var' is a buffer: no optimizer steps it" in "\n".join(
        diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith("No optimizer step wrote module.1.running_var")
    assert not any("clip" in fix or "backward=True" in fix for fix in diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_norm_buffer_written_nan_before_an_eval_forward_gets_no_optimizer_fixes(mode):
    # A bad write into running_var between training and evaluation. Full mode said no
    # optimizer steps a buffer; sentinel mode, which knows no last finite batch here, said "Or
    # the optimizer step made it from finite gradients: a learning rate too large" and "Clip
    # the gradients before the step".
    model = _batch_norm_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, mode, backward=True) as w:
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(4, 3, 16, 16)).square().mean().backward()
            optimizer.step()
        with torch.no_grad():
            model[1].running_var[3] = math.nan  # a bad write, or a bad checkpoint
            model.eval()(torch.randn(4, 3, 16, 16))
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.module, event.role, diagnosis.kind) == \
        (2, "1", "running_var", "corrupted-weight")
    assert "optimizer step" not in diagnosis.summary
    assert "'1.running_var' is a buffer: no optimizer steps it" in "\n".join(diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith("No optimizer step wrote 1.running_var")
    assert not any("learning rate" in fix or "clip" in fix.lower() or "backward=True" in fix
                   for fix in diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
def test_an_sgd_step_that_writes_inf_into_float16_weights_gets_no_adam_eps_advice(mode):
    # The optimizer is SGD: the first fix was Adam's eps=1e-8 (0 in float16), which it has not.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    x = torch.randn(16, 4).half()
    y = torch.full((16, 1), 1e5)  # the bias's gradient, summed over the batch, passes 65504
    w = train_until_an_event(model, optimizer, x, y, 4, mode)
    event = w.event
    assert (event.batch, event.origin, event.kind) == (1, "weight", "inf")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert diagnosis.suggestion[0].startswith("SGD on float16 weights: a gradient that overflowed "
                                              "float16")
    assert not any("eps=" in fix or "Adam" in fix for fix in diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
def test_adam_with_a_tiny_eps_in_float16_corrupts_the_weights(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    w = train_until_an_event(model, optimizer, torch.randn(16, 8).half(),
                             torch.randn(16, 1).half(), 5, mode)
    event = w.event
    assert (event.batch, event.origin, event.kind) == (1, "weight", "inf")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert "between batch 0 and batch 1" in diagnosis.summary
    assert diagnosis.suggestion[0].startswith("Adam on float16 weights: an eps of 1e-8 (the "
                                              "default of Adam, AdamW and RMSprop) is 0")


class ExpertsSkippedWhenIdle(nn.Module):
    """Two experts; ``idle`` names one the router sends no token (skipped, as hand-written
    mixtures of experts do with ``if not rows.numel(): continue``)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.idle: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(expert(x) for i, expert in enumerate(self.experts) if i != self.idle)


def test_a_corrupted_expert_that_got_no_tokens_is_dated_by_the_batches_it_ran_in():
    # Expert 1's weight was written NaN after batch 1 and the expert sat idle in batches 2 and
    # 3: "finite when batch 3 ran ... the write after batch 3" was said with high confidence.
    torch.manual_seed(0)
    model = ExpertsSkippedWhenIdle()
    w = nw.watch(model, on_nan="record")
    for batch in range(5):
        if batch == 2:
            with torch.no_grad():
                model.experts[1].weight[0, 0] = math.nan
            model.idle = 1
        if batch == 4:
            model.idle = None
        model(torch.randn(3, 4))
    w.close()
    event = w.event
    assert (event.batch, event.module, event.role) == (4, "experts.1", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert "between batch 1 and batch 4" in diagnosis.summary
    assert "or after one of the batches that did not use it (2, 3)" in diagnosis.summary
    assert "batch 4 is the first to use it" in diagnosis.summary
    assert diagnosis.confidence == "medium"  # the write may have come while it sat idle
    assert "It was finite when batch 1 ran" in " ".join(diagnosis.evidence)


@pytest.mark.parametrize("mode", MODES)
def test_a_float16_cast_that_overflowed_a_weight_is_named_as_such(mode):
    # model.half() of weights past 65504: it said "corrupted weight (an optimizer step, a load
    # or a write)", with Adam's eps and clipping as fixes, on a model that never trained under
    # the watch. (The running variance alone would turn its channel to 0 without any NaN/Inf in
    # the outputs; the Linear's weight makes the sentinel look, and its replay finds both.)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).eval()
    with torch.no_grad():
        model[1].running_var[3] = 1e5
        model[3].weight[0, 1] = 7e4
    model.half()
    with watch(model, mode) as w, torch.no_grad():
        model(torch.randn(3, 4).half())
    event = w.event
    assert (event.module, event.role, event.origin, event.kind) == ("1", "running_var", "weight",
                                                                    "inf")
    diagnosis = event.diagnosis
    assert (diagnosis.kind, diagnosis.confidence) == ("overflow", "medium")
    assert diagnosis.summary.startswith("'1.running_var' holds Inf in float16 from the first "
                                        "batch watched: a value above float16's largest (65504)")
    assert "torch.autocast" in diagnosis.suggestion[0] and "bfloat16" in diagnosis.suggestion[1]
    assert not any("clip" in line.lower() for line in diagnosis.suggestion)


# ---------------------------------------------------------------------------- bad-data
@pytest.mark.parametrize("mode", MODES)
def test_nan_in_some_rows_of_the_data_names_the_rows(mode):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(6, 4)
    x[2, 1] = x[4, 0] = math.nan
    with watch(model, mode) as w:
        model(torch.randn(6, 4))
        model(x)
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.confidence, diagnosis.rows) == ("bad-data", "high", [2, 4])
    assert diagnosis.summary == ("The batch's input[0] holds NaN in rows 2, 4: it came with the "
                                 "data, not from the model.")
    assert diagnosis.evidence == ["input[0] (float32 (6, 4)): 2 NaN in rows 2, 4 of 6."]
    assert diagnosis.suggestion[0].startswith("Look at how rows 2, 4 of input[0] were made")


class Denoiser(nn.Module):
    """A noise predictor called as a diffusion sampler calls its UNet: model(x, t)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.body = nn.Linear(1, 8), nn.Linear(8, 8)

    def forward(self, x, t):
        return self.body(x + self.embed(t.float().reshape(1, 1) / 100))


def sample_with_a_zero_alpha(model: nn.Module) -> None:
    """A DDIM-like loop whose schedule reaches alpha_bar = 0 at its first timestep (a zero
    terminal SNR with epsilon prediction): x0 = (x - sqrt(1 - a) * eps) / sqrt(a) is inf."""
    alphas = {99: 0.0, 66: 0.3, 33: 0.6, 0: 0.99}
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for t in alphas:
            eps = model(x, torch.tensor(t))
            x = (x - (1 - alphas[t]) ** 0.5 * eps) / alphas[t] ** 0.5


@pytest.mark.parametrize("mode", MODES)
def test_inf_fed_back_by_a_sampling_loop_names_the_step_between_the_calls(mode):
    # The loop's second call got the inf the step after the first made: it was "bad-data ...
    # it came with the data" with a dataset's fixes only (preprocessing, the collate_fn).
    torch.manual_seed(0)
    model = Denoiser()
    with watch(model, mode) as w:
        sample_with_a_zero_alpha(model)
    diagnosis = w.event.diagnosis
    assert (w.event.batch, diagnosis.kind, diagnosis.rows) == (1, "bad-data", [0, 1, 2])
    assert diagnosis.summary.endswith("it came with the call's inputs (in a sampling loop: from "
                                      "the step after the previous call), not from the model.")
    assert "input[1] = 66" in diagnosis.evidence[-1]
    assert "model's output at batch 0 was finite" in diagnosis.evidence[-1]
    assert diagnosis.suggestion[0].startswith("If the model runs in a sampling loop, input[0] "
                                              "is the previous step's result: look at the step "
                                              "after batch 0")
    assert "rescale_betas_zero_snr" in diagnosis.suggestion[1]


@pytest.mark.parametrize("mode", MODES)
def test_nan_data_in_a_training_batch_with_a_timestep_per_sample_is_no_sampling_step(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    class PerSampleTime(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x, t):
            return self.net(x + t[:, None].float() / 100)

    wrapped = PerSampleTime()
    x = torch.randn(6, 4)
    x[2, 1] = math.nan
    with watch(wrapped, mode) as w:
        wrapped(torch.randn(6, 4), torch.randint(0, 100, (6,)))
        wrapped(x, torch.randint(0, 100, (6,)))
    diagnosis = w.event.diagnosis
    assert diagnosis.summary.endswith("it came with the data, not from the model.")
    assert not any("sampling loop" in fix for fix in diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
def test_a_padding_mask_built_as_zero_times_minus_inf_gets_the_fixes_of_a_mask(mode):
    # padding * -inf is NaN wherever a token is kept (0 x -inf): the fixes were those of
    # feature data (assert torch.isfinite, nan_to_num, normalise features), which would break
    # any valid -inf mask.
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(16, 2, batch_first=True)
    padding = torch.zeros(3, 5)
    padding[0, 3:] = 1
    with watch(attention, mode) as w, torch.no_grad():
        x = torch.randn(3, 5, 16)
        attention(x, x, x, key_padding_mask=padding * -math.inf)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "bad-data"
    assert diagnosis.summary.startswith("The batch's kwarg:key_padding_mask holds NaN")
    assert diagnosis.suggestion[0].startswith("Build kwarg:key_padding_mask without arithmetic "
                                              "on -inf: (1 - keep) * -inf is NaN")
    assert "masked_fill" in diagnosis.suggestion[0]
    fixes = "\n".join(diagnosis.suggestion)
    assert "isfinite" not in fixes and "nan_to_num" not in fixes and "Normalise" not in fixes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_nan_in_one_sample_of_a_nested_tensor_is_bad_data_naming_that_sample(layout, mode):
    # A jagged batch was "unknown: native_layer_norm made NaN from finite inputs" (its input
    # unread), and the replay named native_layer_norm as the NaN's birth.
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 4)).eval()
    samples = [torch.randn(length, 16) for length in (3, 5, 2)]
    samples[1][2, 3] = math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: the strided layout is a prototype
        batch = torch.nested.nested_tensor(samples, layout=layout)
    with watch(model, mode) as w, torch.no_grad():
        model(batch)
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows, diagnosis.confidence) == ("bad-data", [1], "high")
    assert diagnosis.summary.startswith("The batch's input[0] holds NaN in row 1:")
    assert diagnosis.evidence == ["input[0] (float32 (3, None, 16)): 1 NaN in row 1 of 3."]
    trace = w.replay(0)
    assert trace.first_bad is None  # a NaN that flowed in is no birth
    assert trace.came_with == [("input", "input[0]")]


class SqrtBetweenLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.sqrt(self.a(x)))


def test_a_nan_born_in_an_op_on_a_jagged_tensor_is_told_from_the_ops_inputs():
    # The op's nested input read as "no finite value": "unknown ... made NaN from finite inputs".
    torch.manual_seed(0)
    model = SqrtBetweenLinears()
    batch = torch.nested.nested_tensor([torch.randn(n, 16) for n in (3, 5)], layout=torch.jagged)
    with watch(model, "full") as w, torch.no_grad():
        model(batch)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain"
    assert diagnosis.summary.startswith("sqrt in module '<root>' (SqrtBetweenLinears) at ")
    assert "sqrt of values down to -1.73 (a negative value gives NaN)" in diagnosis.summary


def test_one_bad_row_of_the_data_is_named_as_one_row():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(6, 4)
    x[3, 1] = math.inf
    with watch(model, "full") as w:
        model(x)
    diagnosis = w.event.diagnosis
    assert diagnosis.summary == ("The batch's input[0] holds Inf in row 3: it came with the "
                                 "data, not from the model.")
    assert diagnosis.evidence == ["input[0] (float32 (6, 4)): 1 Inf in row 3 of 6."]
    assert diagnosis.suggestion[0].startswith("Look at how row 3 of input[0] was made")


@pytest.mark.parametrize("mode", MODES)
def test_the_backward_event_of_a_batch_whose_forward_had_one_takes_its_diagnosis(mode):
    # on_nan="record" with backward=True: the NaN data of batch 1 makes a forward event, then
    # the loss carries it into the gradient. That gradient was not made in the loss.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with watch(model, mode, backward=True) as w:
        for batch in range(2):
            x = torch.randn(6, 4)
            if batch == 1:
                x[3, 0] = math.nan
            model(x).square().mean().backward()
    forward, backward = w.events
    assert (forward.is_backward, backward.is_backward, backward.batch) == (False, True, 1)
    assert (backward.diagnosis.kind, backward.diagnosis.rows) == ("bad-data", [3])
    assert backward.diagnosis.summary.startswith(
        "The gradient of batch 1 is NaN because its forward already was")
    assert "forward outputs of batch 1 were finite" not in "\n".join(backward.diagnosis.evidence)


@pytest.mark.parametrize("mode", MODES)
def test_with_gradient_accumulation_a_later_micro_batch_keeps_the_forwards_cause(mode):
    # set_batch(i) and three forwards per batch: the second holds NaN data; the third's finite
    # outputs do not make its batch's outputs finite.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with watch(model, mode, backward=True) as w:
        w.set_batch(0)
        for micro in range(3):
            x = torch.randn(6, 4)
            if micro == 1:
                x[2, 0] = math.nan
            model(x).square().mean().backward()
    forward, backward = w.events[:2]
    assert (forward.is_backward, backward.is_backward) == (False, True)
    assert backward.diagnosis.kind == "bad-data"
    assert backward.diagnosis.summary.startswith(
        "The gradient of batch 0 is NaN because its forward already was")


@pytest.mark.parametrize("mode", MODES)
def test_accumulation_blames_the_step_after_the_micro_batch_whose_gradient_went_nan(mode):
    # Four micro-batches per step: micro-batch 6 makes a NaN gradient (sqrt at 0), micro-batch
    # 7 adds to it, the step after 7 writes it into the weights, batch 8 runs on them. Batch 7's
    # only events were in its backward: its forward ran on finite weights (sentinel said
    # "between batch 6 and batch 7").
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(10)]
    with watch(model, mode, backward=True) as w:
        for i, (x, y) in enumerate(data):
            scale = 0.0 if i == 6 else 1.0
            (torch.sqrt(((model(x) - y) * scale).pow(2).sum()) / 4).backward()
            if i % 4 == 3:
                optimizer.step()
                optimizer.zero_grad()
    event = next(e for e in w.events if e.origin == "weight")
    assert event.batch == 8 and event.diagnosis.kind == "corrupted-weight"
    assert "between batch 7 and batch 8" in event.diagnosis.summary


def _accumulate_with_a_zero_gradient(mode: str, zero_after: set[int], zero_at: set[int]
                                     ) -> nw.NanWatch:
    """Micro-batches of sqrt(0 * error): a NaN gradient where ``zero_at`` has them, zero_grad()
    (in place) after those in ``zero_after``, on_nan="record"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(8)]
    with watch(model, mode, backward=True) as w:
        for i, (x, y) in enumerate(data):
            scale = 0.0 if i in zero_at else 1.0
            (torch.sqrt(((model(x) - y) * scale).pow(2).sum()) / 4).backward()
            if i in zero_after:
                model.zero_grad(set_to_none=False)
    return w


@pytest.mark.parametrize("mode", MODES)
def test_a_gradient_only_accumulated_into_since_a_nan_pass_names_that_pass(mode):
    # Micro-batch 6 makes NaN gradients (sqrt at 0 in the loss); micro-batch 7 only adds to
    # them. Its event read "unknown", in full mode after a replay that "did not reproduce it"
    # (the replay starts from fresh gradients).
    w = _accumulate_with_a_zero_gradient(mode, zero_after={3}, zero_at={6})
    first, later = w.events[0], w.events[1]
    assert (first.batch, later.batch, later.is_backward) == (6, 7, True)
    assert first.diagnosis.kind == later.diagnosis.kind == "loss"
    assert f"'{later.qualified_role}' in batch 7 is NaN because batch 6's backward left it so" \
        in later.diagnosis.summary
    assert "reproduce" not in " ".join(later.diagnosis.evidence)
    assert any("zero_grad()" in fix for fix in later.diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
def test_a_gradient_zeroed_in_place_between_two_nan_passes_is_not_carried_over(mode):
    # zero_grad(set_to_none=False) keeps the tensor but zeroes it: batch 7 made its own NaN.
    w = _accumulate_with_a_zero_gradient(mode, zero_after={3, 6}, zero_at={6, 7})
    later = next(e for e in w.events if e.batch == 7 and e.is_backward)
    assert "left it so" not in later.diagnosis.summary


class _Huge(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e39  # Inf in float32: an event


class _InfClampedAway(nn.Module):
    """An Inf inside the model, clamped before the output: the model's output stays finite."""

    def __init__(self) -> None:
        super().__init__()
        self.huge = _Huge()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.huge(x).clamp(-1e3, 1e3))


def test_a_saturated_gan_loss_through_a_wrapper_driven_without_its_forward_is_the_loss():
    # One watch on a ModuleDict of G and D (its forward never runs): D's sigmoid gives exactly
    # 1.0 on a real batch, so log(1 - D(x)) is -inf in the loss. Watching D alone says "loss";
    # through the wrapper the same event read "unknown" (it looked for the wrapper's gradient).
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1),
                                  nn.Sigmoid())
    with torch.no_grad():
        discriminator[2].bias.fill_(40.0)  # saturated: sigmoid(40) is 1.0 in float32
    gan = nn.ModuleDict({"G": generator, "D": discriminator})
    with watch(gan, "full", backward=True) as w:
        fake = generator(torch.randn(8, 4))
        real = torch.randn(8, 8)
        loss = -(torch.log(discriminator(fake.detach())) + torch.log(1 - discriminator(real)))
        loss.mean().backward()
    event = w.events[0]
    assert (event.module, event.role, event.is_backward) == ("D.3", "grad_output[0]", True)
    assert event.diagnosis.kind == "loss"
    assert "BCEWithLogitsLoss" in " ".join(event.diagnosis.suggestion)


def test_a_loss_nan_after_a_forward_event_whose_output_stayed_finite_is_the_loss():
    # The forward's Inf never reached the output (full mode sees it; sentinel mode does not);
    # the NaN gradient came from log(1 - p) of a saturated sigmoid in the loss.
    torch.manual_seed(0)
    model = _InfClampedAway()
    with watch(model, "full", backward=True) as w:
        p = torch.sigmoid(model(torch.randn(6, 4)) * 100)
        (-torch.log(1 - p)).mean().backward()
    forward, backward = w.events
    assert (forward.module, forward.is_backward, backward.is_backward) == ("huge", False, True)
    assert backward.diagnosis.kind == "loss"


def _t5_whose_feed_forward_overflows() -> tuple[nn.Module, dict]:
    """A float16 T5 encoder whose second block's feed-forward overflows: T5 clamps the Inf
    after the block ("to enable fp16 training"), so its outputs stay finite."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0)
    model = transformers.T5EncoderModel(config).half().eval()
    with torch.no_grad():
        feed_forward = model.encoder.block[1].layer[1].DenseReluDense
        feed_forward.wi.weight.mul_(100.0)
        feed_forward.wo.weight.mul_(600.0)
    return model, {"input_ids": torch.randint(0, 64, (2, 12))}


_T5_CARRIERS = ["encoder.block.1.layer.1", "encoder.block.1.layer.1.DenseReluDense",
                "encoder.block.1.layer.1.DenseReluDense.wo", "encoder.block.1.layer.1.dropout"]


def test_an_inf_the_model_clamps_away_says_the_outputs_stayed_finite_and_how_to_allow_it():
    model, inputs = _t5_whose_feed_forward_overflows()
    with torch.no_grad():
        unwatched = model(**inputs).last_hidden_state
        assert torch.isfinite(unwatched).all()
        with watch(model, "full") as w:
            model(**inputs)
    event = w.event
    assert (event.module, event.kind, event.diagnosis.kind) == (
        "encoder.block.1.layer.1.DenseReluDense.wo", "inf", "overflow")
    absorbed = [line for line in event.diagnosis.evidence if "stayed finite" in line]
    assert len(absorbed) == 1 and "clamped, masked or replaced the Inf" in absorbed[0]
    assert all(f"'{name}'" in absorbed[0] for name in _T5_CARRIERS)
    allow = event.diagnosis.suggestion[-1]
    assert f"allow_inf={_T5_CARRIERS!r}" in allow.replace('"', "'")
    # Following it: no event, the same outputs (sentinel mode never saw it either).
    for options in ({"allow_inf": _T5_CARRIERS}, {"mode": "sentinel"}):
        with torch.no_grad(), nw.watch(model, **options) as w:
            watched = model(**inputs).last_hidden_state
        assert w.events == [] and torch.equal(watched, unwatched)


class _SaturatedDensity(nn.Module):
    """A NeRF-style density: sigma = exp(raw) overflows, alpha = 1 - exp(-sigma) saturates at
    1, so the output stays finite; exp's backward there is inf x 0 = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = nn.Linear(3, 1)
        self.density = _Exp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1 - torch.exp(-self.density(self.raw(x)))


class _Exp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


@pytest.mark.parametrize("mode", MODES)
def test_an_exp_overflow_the_model_absorbs_is_not_told_to_be_allowed(mode):
    # It said "a run without a watch goes on" and suggested allow_inf (or mode='sentinel', in
    # sentinel mode): following it, the NaN gradient of the overflowed exp broke the weights.
    torch.manual_seed(0)
    model = _SaturatedDensity()
    with torch.no_grad():
        model.raw.bias.fill_(95.0)  # past log(float32's largest)
    with watch(model, "full" if mode == "full" else "sentinel", backward=True) as w:
        out = model(torch.randn(8, 3) * 0.1)
        assert torch.isfinite(out).all()
        out.sum().backward()
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow"
    assert not any("allow_inf=" in fix or "mode='sentinel'" in fix for fix in diagnosis.suggestion)
    assert any("the gradient through it is NaN" in line for line in diagnosis.evidence) \
        or w.event.is_backward
    assert not torch.isfinite(model.raw.weight.grad).all()  # what the advice would have hidden


def test_deformable_detr_s_padding_proposals_are_a_mask_not_an_overflow():
    """transformers' two-stage Deformable DETR sets the proposals of padded pixels to +inf on
    purpose and returns them (enc_outputs_coord_logits): the event says so, and its
    allow_inf lets the model run on unchanged."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    backbone = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1], layer_type="basic",
        out_features=["stage2", "stage3", "stage4"])
    config = transformers.DeformableDetrConfig(
        use_timm_backbone=False, backbone_config=backbone, d_model=32, encoder_layers=1,
        decoder_layers=1, encoder_ffn_dim=16, decoder_ffn_dim=16, encoder_attention_heads=2,
        decoder_attention_heads=2, num_queries=4, num_labels=2, two_stage=True,
        with_box_refine=True, num_feature_levels=3, two_stage_num_proposals=4)
    model = transformers.DeformableDetrForObjectDetection(config).eval()
    pixels = torch.randn(2, 3, 96, 96)
    mask = torch.ones(2, 96, 96, dtype=torch.long)
    mask[1, :, 64:] = 0  # the second image is narrower: padded on the right
    with torch.no_grad():
        unwatched = model(pixel_values=pixels, pixel_mask=mask)
        with watch(model, "full") as w:
            model(pixel_values=pixels, pixel_mask=mask)
    event = w.event
    assert (event.module, event.role, event.kind) == ("model", "output.enc_outputs_coord_logits",
                                                      "inf")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "masked-row" and diagnosis.summary.endswith("nothing overflowed.")
    assert diagnosis.summary.startswith("masked_fill in module 'model' (DeformableDetrModel) at ")
    assert "modeling_deformable_detr.py:" in diagnosis.summary
    assert "allow_inf=['', 'model']" in diagnosis.suggestion[0]
    with torch.no_grad(), nw.watch(model, allow_inf=["", "model"]) as w:
        watched = model(pixel_values=pixels, pixel_mask=mask)
    assert w.events == []
    assert torch.equal(watched.logits, unwatched.logits)
    assert torch.equal(watched.pred_boxes, unwatched.pred_boxes)


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN where x < 0


class _NanReplaced(nn.Module):
    """A NaN made inside (log of a negative), replaced before the output by nan_to_num."""

    def __init__(self) -> None:
        super().__init__()
        self.log = _Log()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(self.log(x), nan=0.0)


def test_a_nan_replaced_before_the_output_says_so_and_offers_no_allow_inf():
    model = _NanReplaced()
    with watch(model, "full") as w:
        out = model(torch.tensor([[1.0, -2.0, 3.0]]))
    assert torch.isfinite(out).all()
    diagnosis = w.event.diagnosis
    assert (w.event.module, w.event.kind, diagnosis.kind) == ("log", "nan", "domain")
    absorbed = [line for line in diagnosis.evidence if "stayed finite" in line]
    assert len(absorbed) == 1 and "replaced the NaN" in absorbed[0]
    assert absorbed[0].endswith("Outputs that held it: 'log'.")
    assert not any("allow_inf" in fix for fix in diagnosis.suggestion)  # NaN always counts


def test_an_inf_that_reaches_the_output_gets_no_word_of_being_absorbed():
    model = Overflowing().half()
    x = (torch.arange(8.0).reshape(2, 4) / 4).half()
    with watch(model, "full") as w:
        model(x, 1e4)
    assert not any("stayed finite" in line for line in w.event.diagnosis.evidence)


class _ScoresWithLoss(nn.Module):
    """Computes its loss inside forward when given labels, as transformers' models do."""

    def __init__(self, pixels: bool = False, ignore_index: int = -100) -> None:
        super().__init__()
        self.head = nn.Conv2d(4, 3, 1) if pixels else nn.Linear(4, 3)
        self.ignore_index = ignore_index

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.head(x)
        loss = None if labels is None else nn.functional.cross_entropy(
            logits, labels, ignore_index=self.ignore_index)
        return {"logits": logits, "loss": loss}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pixels, ignore_index", [(False, -100), (True, 255)],
                         ids=["tokens", "pixels"])
def test_a_batch_whose_labels_are_all_ignored_is_a_mean_over_no_target(mode, pixels,
                                                                       ignore_index):
    # A prompt truncated before its answer, a crop with no labelled pixel: cross-entropy's mean
    # over no counted target is 0/0, a NaN loss from finite logits (it was "unknown").
    torch.manual_seed(0)
    model = _ScoresWithLoss(pixels, ignore_index)
    x = torch.randn(2, 4, 3, 3) if pixels else torch.randn(6, 4)
    labels = torch.full((2, 3, 3) if pixels else (6,), ignore_index)
    with watch(model, mode) as w:
        model(x, labels=torch.zeros_like(labels))
        model(x, labels=labels)
    event = w.event
    assert (event.batch, event.module, event.role) == (1, "", "output.loss")
    diagnosis = event.diagnosis
    assert (diagnosis.kind, diagnosis.confidence) == ("domain", "high")
    default = " (the default ignore_index)" if ignore_index == -100 else ""
    assert (f"every target of the batch is {ignore_index}{default}, so no target counted and "
            "the mean over them is 0/0") in diagnosis.summary
    assert diagnosis.suggestion[0].startswith("The batch has no target to learn from")


@pytest.mark.parametrize("mode", MODES)
def test_a_trainer_batch_whose_labels_are_all_ignored_blames_the_labels_not_transformers(mode):
    # The Trainer passes num_items_in_batch (a float count of the labels that count): with
    # every label -100, transformers' loss divides 0 by 0 in its own loss_utils.py, and the
    # advice was to guard the denominator there, with no word of the labels.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(3, 50, (2, 6))
    prompt_masked, all_ignored = ids.clone(), torch.full_like(ids, -100)
    prompt_masked[:, :3] = -100
    with watch(model, mode) as w:
        for labels in (prompt_masked, all_ignored):
            counted = (labels[:, 1:] != -100).sum().float()
            model(input_ids=ids, labels=labels, num_items_in_batch=counted)
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.role, diagnosis.kind, diagnosis.confidence) == (
        1, "output.loss", "domain", "high")
    assert ("every label of the batch is -100 (the default ignore_index), so "
            "num_items_in_batch (the count of labels the loss averages over) is 0"
            ) in diagnosis.summary
    assert diagnosis.suggestion[0].startswith("The batch has no label to learn from")
    assert not any("Guard the denominator" in fix for fix in diagnosis.suggestion)


class _Speech(nn.Module):
    """A CTC head: log-probabilities (T, N, C) and the CTC loss of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
                target_lengths: torch.Tensor) -> torch.Tensor:
        return nn.functional.ctc_loss(self.head(x).log_softmax(-1), targets, input_lengths,
                                      target_lengths)


@pytest.mark.parametrize("mode", MODES)
def test_a_ctc_target_longer_than_its_input_is_no_alignment_not_an_overflow(mode):
    # 3 frames cannot spell 6 labels: CTC's loss is inf (it said "overflowed float32: keep the
    # values smaller").
    torch.manual_seed(0)
    model = _Speech()
    with watch(model, mode) as w:
        model(torch.randn(3, 2, 4), torch.randint(1, 5, (2, 6)), torch.tensor([3, 3]),
              torch.tensor([6, 2]))
    diagnosis = w.event.diagnosis
    assert (w.event.kind, diagnosis.kind, diagnosis.confidence) == ("inf", "domain", "high")
    assert ("a sample has no alignment: its input is shorter than its target (input lengths 3 "
            "to 3, target lengths 2 to 6)") in diagnosis.summary
    assert diagnosis.suggestion[0].startswith("Pass zero_infinity=True to F.ctc_loss")
    # Seq-first features (3 frames of 2 samples) beside per-sample targets: the inputs disagree
    # on the batch's size, so no row is named rather than a guessed one.
    assert diagnosis.rows == [] and " row" not in diagnosis.summary


class _LogMel(nn.Module):
    """A log-mel front end without an eps (an STFT, a non-negative filterbank, a log) and a
    classifier: a silent clip gives log(0) = -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(64))
        self.filterbank = nn.Linear(33, 8, bias=False)
        with torch.no_grad():
            self.filterbank.weight.uniform_(0.0, 1.0)
        self.classifier = nn.Linear(8, 4)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        power = torch.stft(wav, 64, 32, window=self.window, return_complex=True).abs().pow(2)
        mel = torch.log(self.filterbank(power.transpose(1, 2)))
        return self.classifier(mel).mean(dim=1)


@pytest.mark.parametrize("mode", MODES)
def test_a_silent_clip_in_a_log_mel_front_end_is_named_by_its_row(mode):
    # The domain verdict said where (log) but not which sample: rows were [].
    torch.manual_seed(0)
    model = _LogMel()
    wav = torch.randn(4, 800) * 0.3
    wav[1] = 0.0
    with watch(model, mode) as w:
        model(wav)
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("domain", [1])
    assert "got values outside its domain in row 1: log of values down to 0" in diagnosis.summary
    assert ("log's output holds its NaN/Inf in row 1 of the batch's 4 rows (dim 0: its "
            "samples); the other rows stayed finite.") in diagnosis.evidence
    assert "  Rows of the batch that hold it: 1" in diagnosis.lines()


@pytest.mark.parametrize("mode", MODES)
def test_log_mel_features_with_a_silent_tail_are_bad_data_with_the_floor_before_the_log(mode):
    # Features made outside the model by a log without a floor: only -inf, the mark of log(0).
    # The fix that fits is a floor under that log, not "normalise with an epsilon".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(8, 8, 3, padding=1), nn.GELU(), nn.Conv1d(8, 4, 1))
    power = torch.rand(3, 8, 20)
    power[2, :, 12:] = 0.0  # a silent tail
    with watch(model, mode) as w:
        model(torch.log10(power))
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("bad-data", [2])
    assert "holds -Inf in row 2" in diagnosis.summary
    assert "input[0] (float32 (3, 8, 20)): 64 -Inf in row 2 of 3." in diagnosis.evidence
    assert diagnosis.suggestion[0].startswith("Only -Inf, no NaN and no +Inf: the mark of a log "
                                              "of 0")
    assert "torch.clamp(mel, min=1e-10)" in diagnosis.suggestion[0]


@pytest.mark.parametrize("mode", MODES)
def test_data_with_inf_of_both_signs_gets_no_log_of_zero_fix(mode):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    x[1, 0], x[1, 1] = -math.inf, math.inf
    with watch(model, mode) as w:
        model(x)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "bad-data" and "holds Inf in row 1" in diagnosis.summary
    assert not any("log of 0" in fix for fix in diagnosis.suggestion)


class _CTCRecognizer(nn.Module):
    """An encoder and nn.CTCLoss inside the model: the forward returns the loss."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, 5)
        self.ctc = nn.CTCLoss(reduction=reduction)

    def forward(self, features: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
                target_lengths: torch.Tensor) -> torch.Tensor:
        log_probs = self.encoder(features).log_softmax(-1).transpose(0, 1)  # (T, N, C)
        return self.ctc(log_probs, targets, input_lengths, target_lengths)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_a_ctc_sample_without_alignment_is_named_by_its_row(mode, reduction):
    # Sample 2 has 4 frames for 6 labels. With reduction='mean' the loss is a scalar, but the
    # op that made the Inf (_ctc_loss) made one loss per sample.
    torch.manual_seed(0)
    model = _CTCRecognizer(reduction)
    targets = torch.tensor([[1, 2, 3, 4, 1, 2], [2, 3, 4, 0, 0, 0], [1, 2, 3, 4, 1, 2]])
    with watch(model, mode) as w:
        model(torch.randn(3, 8, 6), targets, torch.tensor([8, 8, 4]), torch.tensor([6, 3, 6]))
    diagnosis = w.event.diagnosis
    assert (w.event.module, diagnosis.kind, diagnosis.rows) == ("ctc", "domain", [2])
    assert diagnosis.summary.startswith("_ctc_loss in module 'ctc' (CTCLoss)")
    assert "got values outside its domain in row 2: a sample has no alignment" in diagnosis.summary


class _DistanceKernel(nn.Module):
    """Attention-like scores of (batch x heads, T, T) and their square root (no clamp): dim 0
    of the scores is no sample dim."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = x.shape
        q, k = (t.reshape(batch, steps, 4, 2).transpose(1, 2).reshape(batch * 4, steps, 2)
                for t in self.qk(x).chunk(2, dim=-1))
        return torch.sqrt(q @ k.transpose(1, 2))


@pytest.mark.parametrize("mode", MODES)
def test_a_domain_error_over_batch_times_heads_names_no_row(mode):
    # Rows 0..7 of the scores are (sample, head) pairs, not samples: naming them would mislead.
    torch.manual_seed(0)
    model = _DistanceKernel()
    with watch(model, mode, replay_on_nan=True) as w:
        model(torch.randn(2, 5, 8))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain" and diagnosis.summary.startswith("sqrt in module '<root>'")
    assert diagnosis.rows == [] and " row" not in diagnosis.summary
    scores = w.event.trace.first_bad_tensors.set_index("role").loc["output"]
    assert scores["shape"] == (8, 5, 5) and scores["nonfinite_rows"]  # its rows are known, and not samples


def test_a_per_sample_loss_in_loss_fn_is_named_by_its_row():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LogSoftmax(-1))
    targets = torch.tensor([[1, 2, 3, 4, 1, 2], [2, 3, 4, 0, 0, 0], [1, 2, 3, 4, 1, 2]])

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.ctc_loss(out.transpose(0, 1), targets, torch.tensor([8, 8, 4]),
                                      torch.tensor([6, 3, 6]), reduction="none").sum()

    for mode in MODES:
        with watch(model, mode, backward=True, loss_fn=loss_fn) as w:
            loss_fn(model(torch.randn(3, 8, 6))).backward()
        diagnosis = w.event.diagnosis
        assert (diagnosis.kind, diagnosis.rows) == ("loss", [2]), mode
        assert "made the first NaN/Inf in row 2: a sample has no alignment" in diagnosis.summary


def test_a_transformers_ctc_model_without_alignment_is_told_its_config_switch():
    # Wav2Vec2ForCTC computes the CTC loss itself: the fix is its config, not F.ctc_loss's flag.
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0)
    model = transformers.Wav2Vec2ForCTC(config)
    audio, labels = torch.randn(2, 400), torch.randint(1, 12, (2, 60))  # 39 frames, 60 labels
    for mode in MODES:
        with watch(model, mode) as w:
            model(audio, labels=labels)
        diagnosis = w.event.diagnosis
        assert (w.event.role, diagnosis.kind) == ("output.loss", "domain"), mode
        assert diagnosis.suggestion[0].startswith("Set ctc_zero_infinity=True in the model's "
                                                  "config"), mode
    model.config.ctc_zero_infinity = True  # following it: no event, a finite loss
    with nw.watch(model) as w:
        loss = model(audio, labels=labels).loss
    assert w.events == [] and torch.isfinite(loss)


class _SelectedMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[keep].square().mean()


@pytest.mark.parametrize("mode", MODES)
def test_a_mean_over_an_empty_selection_is_0_over_0(mode):
    torch.manual_seed(0)
    model = _SelectedMean()
    with watch(model, mode) as w:
        model(torch.randn(5, 4), torch.ones(5, dtype=torch.bool))
        model(torch.randn(5, 4), torch.zeros(5, dtype=torch.bool))  # nothing selected
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, diagnosis.kind, diagnosis.confidence) == (1, "domain", "high")
    assert "mean over an empty tensor (shape (0, 3)): an average of no element is 0/0" in \
        diagnosis.summary
    assert diagnosis.suggestion[0].startswith("Guard the reduction")


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(extra)


@pytest.mark.parametrize("mode", MODES)
def test_inf_in_a_keyword_input_is_bad_data(mode):
    model = TwoInputs()
    extra = torch.randn(5, 3)
    extra[3, 2] = math.inf
    with watch(model, mode) as w:
        model(torch.randn(5, 4), extra=extra)
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("bad-data", [3])
    assert "kwarg:extra" in diagnosis.summary
    assert any("allow_inf" in fix for fix in diagnosis.suggestion)  # an Inf may be a mask


def test_without_held_batches_bad_data_names_the_input_but_not_the_rows():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(6, 4)
    x[1, 1] = math.nan
    with nw.watch(model, on_nan="record", keep_batches=0) as w:
        model(x)
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.confidence, diagnosis.rows) == ("bad-data", "medium", [])
    assert "input[0]" in diagnosis.summary


# ---------------------------------------------------------------------------- loss
@pytest.mark.parametrize("mode", MODES)
def test_a_loss_made_outside_the_model_says_so_and_how_to_trace_it(mode):
    model = saturated_model()
    with watch(model, mode, backward=True) as w:
        bce_by_hand(model(torch.full((6, 4), 3.0).half())).backward()
        traced = w.replay(0, loss_fn=bce_by_hand)
    event = w.event
    assert event.is_backward and event.diagnosis.kind == "loss"
    assert "made in the loss, outside the model" in event.summary()
    assert "watch with loss_fn=... or replay(0, loss_fn=...)" in event.summary()
    assert event.diagnosis.summary.startswith("Made in the loss, outside the model: the gradient "
                                              "reaching the model's output")
    assert "w.replay(0, loss_fn=...)" in event.diagnosis.suggestion[0]
    # Replayed with the loss, the trace names log's gradient (as the automatic replay below)
    # at the log's line.
    first = traced.first_bad
    assert traced.reproduced and (first["op"], first["phase"]) == ("div", "backward")
    assert first["source"] == line_of(bce_by_hand, "torch.log")


class NormalLikelihood(nn.Module):
    """pytorch-forecasting's NormalDistributionLoss: -log N(y; loc, scale), the parameters
    stacked on the last dim of its first input."""

    def forward(self, params, target):
        loc, scale = params[..., 0], params[..., 1]
        return -torch.distributions.Normal(loc, scale).log_prob(target).mean()


class CollapsedScaleForecaster(nn.Module):
    """A DeepAR-like head (loc, softplus scale) holding its loss as a submodule, as a
    LightningModule does (training_step: loss = self.loss(self(x), y)); the scale's bias at -30
    makes it ~1e-13, so the loss's gradient passes float32's largest."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)
        self.loss = NormalLikelihood()
        with torch.no_grad():
            self.head.bias[1] = -30.0
            self.head.weight[1].zero_()

    def forward(self, x):
        raw = self.head(self.body(x))
        return torch.stack([raw[..., 0], nn.functional.softplus(raw[..., 1])], -1)


@pytest.mark.parametrize("numbering", ["set_batch", "automatic"])
def test_a_loss_the_model_holds_whose_distribution_scale_collapsed_is_named_with_the_scale(
        numbering):
    # It said "Made in the loss, outside the model" with classification fixes (BCEWithLogitsLoss,
    # CrossEntropyLoss, clamp probabilities), though the loss is a watched submodule whose
    # frames show the scale it got near 0.
    torch.manual_seed(0)
    model = CollapsedScaleForecaster()
    x, y = torch.randn(8, 6), torch.randn(8) * 3
    with watch(model, "full", backward=True) as w:
        if numbering == "set_batch":
            w.set_batch(0)  # as the Lightning callback numbers batches
        model.loss(model(x), y).backward()
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.module, event.role, event.kind) == ("loss", "grad_input[0]", "inf")
    assert diagnosis.kind == "overflow"
    said = " ".join([event.summary(), diagnosis.summary] + diagnosis.evidence
                    + diagnosis.suggestion)
    assert "outside the model" not in said
    assert not any(fix in said for fix in ("BCEWithLogits", "CrossEntropy", "Clamp probabilities"))
    assert diagnosis.summary.startswith("Made in the loss 'loss' (NormalLikelihood) that the "
                                        "model holds")
    assert "input[0] reached abs min 9.36e-14" in diagnosis.summary
    assert diagnosis.suggestion[0].startswith("A parameter of the distribution that 'loss' "
                                              "(NormalLikelihood) scores left its domain")
    assert "F.softplus(raw) + 1e-4" in diagnosis.suggestion[0]


class EikonalInside(nn.Module):
    """An SDF whose forward returns its spatial gradient (the normals) and an eikonal term made
    from it: the gradient that output receives holds what the model's own sqrt made."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 16), nn.Linear(16, 1)
        with torch.no_grad():
            self.l1.bias.fill_(-1.0)
            self.l1.weight.mul_(0.1)  # every ReLU dead: the SDF is flat, its gradient 0

    def forward(self, x):
        x = x.requires_grad_(True)
        y = self.l2(torch.relu(self.l1(x)))[..., 0]
        g = torch.autograd.grad(y.sum(), x, create_graph=True)[0]
        norm = (g * g).sum(-1).sqrt()  # its gradient at 0 is inf
        return y, g, (norm - 1).square().mean()


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_the_model_made_in_an_output_it_also_used_is_not_the_loss(mode):
    # Full mode said "loss: made outside the model ... no op of the model made it" without a
    # replay, because the root's grad_output[1] was NaN; sentinel mode's replay named sqrt.
    torch.manual_seed(0)
    model = EikonalInside()
    with watch(model, mode, backward=True) as w:
        y, _, eikonal = model(torch.randn(8, 3))
        (y.abs().mean() + 0.1 * eikonal).backward()
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain"
    assert "the gradient of sqrt is infinite at the edge of its domain (0)" in diagnosis.summary
    assert line_of(EikonalInside.forward, ".sqrt()") in diagnosis.summary


@pytest.mark.parametrize("mode", MODES)
def test_with_loss_fn_the_automatic_replay_names_the_loss_op(mode):
    model = saturated_model()
    with watch(model, mode, backward=True, loss_fn=bce_by_hand) as w:
        bce_by_hand(model(torch.full((6, 4), 3.0).half())).backward()
    event = w.event
    diagnosis = event.diagnosis
    assert diagnosis.kind == "loss" and diagnosis.confidence == "high"
    where = line_of(bce_by_hand, "torch.log")
    # The gradient that reaches the model is born in log's gradient (1 / 0), at the log's line.
    assert diagnosis.summary.startswith(
        f"Made in the loss, outside the model: log's gradient (div) in loss_fn at {where} made "
        "the first NaN/Inf: the gradient of log is infinite at the edge of its domain (0)")
    assert event.summary().endswith(f"; first bad op div at {where}")
    assert "BCEWithLogitsLoss" in diagnosis.suggestion[0]
    if mode == "sentinel":  # its own replay ran the loss: the event's trace shows it
        trace = event.trace
        assert (trace.first_bad["op"], trace.first_bad["phase"]) == ("div", "backward")
        assert trace.first_bad_grad_of == "LogBackward0"


def encode_boxes(boxes: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Box regression targets of (x1, y1, x2, y2) boxes against anchors, as torchvision's
    BoxCoder.encode_single computes them: the log of a target's width over its anchor's."""
    widths, anchor_widths = boxes[:, 2] - boxes[:, 0], anchors[:, 2] - anchors[:, 0]
    heights, anchor_heights = boxes[:, 3] - boxes[:, 1], anchors[:, 3] - anchors[:, 1]
    dx = (boxes[:, 0] + widths / 2 - anchors[:, 0] - anchor_widths / 2) / anchor_widths
    dy = (boxes[:, 1] + heights / 2 - anchors[:, 1] - anchor_heights / 2) / anchor_heights
    dw = torch.log(widths / anchor_widths)
    dh = torch.log(heights / anchor_heights)
    return torch.stack([dx, dy, dw, dh], dim=1)


class GaussianMixtureHead(nn.Module):
    """Returns a MixtureSameFamily (its components sit in private attributes) whose scale is
    the layer's raw output: a negative scale makes log_prob NaN in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 6)

    def forward(self, x: torch.Tensor) -> torch.distributions.Distribution:
        logits, mu, scale = self.fc(x).chunk(3, -1)
        return torch.distributions.MixtureSameFamily(
            torch.distributions.Categorical(logits=logits),
            torch.distributions.Normal(mu, scale, validate_args=False))


@pytest.mark.parametrize("mode", MODES)
def test_a_log_prob_of_a_returned_mixture_reads_the_model_output_not_the_targets(mode):
    torch.manual_seed(0)
    model = GaussianMixtureHead()
    x, y = torch.randn(16, 2), torch.randn(16)
    with watch(model, mode, backward=True, replay_on_nan=True,
               loss_fn=lambda mixture: -mixture.log_prob(y).mean()) as w:
        (-model(x).log_prob(y).mean()).backward()
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "loss"
    assert "besides the model's output" not in diagnosis.summary
    assert "Check the targets" not in " ".join(diagnosis.suggestion)
    assert "torch.distributions" in diagnosis.suggestion[0]


@pytest.mark.parametrize("mode", MODES)
def test_a_zero_width_target_box_is_told_as_the_targets_not_the_logits(mode):
    # log(0) of a target width over its anchor's, in loss_fn: the fixes were those of a log of
    # probabilities (BCEWithLogitsLoss, clamp probabilities), though no value of the model's
    # output reached that log.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4))  # box deltas for one anchor per image
    anchors = torch.tensor([[0.0, 0.0, 32.0, 32.0]]).repeat(4, 1)
    boxes = torch.tensor([[4.0, 4.0, 20.0, 24.0], [2.0, 3.0, 30.0, 12.0],
                          [6.0, 6.0, 6.0, 30.0], [1.0, 1.0, 15.0, 15.0]])  # box 2: x2 == x1

    def loss_fn(deltas: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(deltas, encode_boxes(boxes, anchors))

    with watch(model, mode, backward=True, loss_fn=loss_fn) as w:
        loss_fn(model(torch.randn(4, 3, 16, 16))).backward()
    diagnosis = w.event.diagnosis
    where = line_of(encode_boxes, "dw = torch.log")
    assert diagnosis.kind == "loss" and diagnosis.rows == [2]
    assert diagnosis.summary.startswith(
        f"Made in the loss, outside the model: log in loss_fn at {where} made the first "
        "NaN/Inf in row 2 from what loss_fn reads besides the model's output (targets, weights)")
    assert "No value of the model's output flowed into log" in diagnosis.evidence[0]
    assert "x2 <= x1 or y2 <= y1" in diagnosis.suggestion[0]
    assert diagnosis.suggestion[1].startswith("Check the targets where the data loader makes them")
    assert not any("BCEWithLogitsLoss" in fix or "Clamp probabilities" in fix
                   for fix in diagnosis.suggestion)


def test_a_log_of_the_targets_alone_gets_the_targets_fixes_without_boxes():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    targets = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.0, 2.0]])  # a count of 0: log(0)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, torch.log(targets))

    with watch(model, "full", backward=True, loss_fn=loss_fn) as w:
        loss_fn(model(torch.randn(2, 4))).backward()
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "loss" and "besides the model's output" in diagnosis.summary
    assert diagnosis.suggestion[0].startswith("Check the targets where the data loader makes them")
    assert not any("box" in fix or "BCEWithLogitsLoss" in fix for fix in diagnosis.suggestion)


class MinSnrLoss:
    """A diffusion loss weighted per sample by min(snr, 5) / snr (min-SNR): 0/0 at snr = 0."""

    def __init__(self) -> None:
        self.snr = torch.tensor([2.0, 1.0])
        self.noise = torch.zeros(2, 3, 4, 4)

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        weights = torch.clamp(self.snr, max=5.0) / self.snr
        return (weights * ((out - self.noise) ** 2).mean(dim=(1, 2, 3))).mean()


@pytest.mark.parametrize("mode", MODES)
def test_a_division_by_zero_in_loss_fn_gets_the_fixes_of_its_denominator(mode):
    # A 0/0 in the loss got only the fixes of a log of probabilities (BCEWithLogitsLoss,
    # clamp probabilities before a log).
    torch.manual_seed(0)
    model = nn.Conv2d(3, 3, 3, padding=1)
    loss_fn = MinSnrLoss()
    with watch(model, mode, backward=True, loss_fn=loss_fn) as w:
        loss_fn(model(torch.randn(2, 3, 4, 4))).backward()
        loss_fn.snr = torch.tensor([2.0, 0.0])  # a zero-terminal-SNR timestep
        loss_fn(model(torch.randn(2, 3, 4, 4))).backward()
    diagnosis = w.event.diagnosis
    where = line_of(MinSnrLoss.__call__, "torch.clamp")
    assert diagnosis.kind == "loss"
    # The weights are made from the SNR alone, none of the model's output.
    assert diagnosis.summary.startswith(f"Made in the loss, outside the model: div in loss_fn "
                                        f"at {where} made the first NaN/Inf in row 1 from what "
                                        "loss_fn reads besides the model's output (targets, "
                                        "weights): a division by zero")
    assert diagnosis.rows == [1]  # the sample at snr = 0
    assert diagnosis.suggestion[0].startswith(f"Guard the denominator at {where}: ")
    assert "weights[snr == 0] = 1.0" in diagnosis.suggestion[-1]
    assert not any("BCEWithLogitsLoss" in fix or "before a log" in fix
                   for fix in diagnosis.suggestion)


class GeneralizedDiceLoss:
    """A generalised Dice loss without smoothing terms (MONAI's with smooth_nr=smooth_dr=0):
    a sample whose mask is empty has a weight of 0, so its numerator and denominator are both
    0 and its loss is 0/0 = NaN in the forward."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        p, t = torch.sigmoid(out).flatten(1), self.target.flatten(1)
        weight = 1.0 / t.sum(1) ** 2
        weight = torch.where(torch.isinf(weight), torch.zeros_like(weight), weight)
        numerator = 2 * (p * t).sum(1) * weight
        denominator = (p + t).sum(1) * weight
        return (1 - numerator / denominator).mean()


def test_a_dice_loss_over_an_empty_mask_is_told_as_the_forwards_zero_over_zero():
    # The summary said the gradient reaching div was 0 ("multiplied by 0 or dropped after it,
    # and 0 x inf = NaN"): it was -0.5; the loss itself was 0/0 for the empty-mask sample.
    # The last fix spoke of diffusers' min-SNR weighting.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 1, 1))
    target = (torch.rand(2, 1, 6, 6, 6) > 0.7).float()
    target[1] = 0.0  # sample 1's mask is empty
    loss_fn = GeneralizedDiceLoss(target)
    with watch(model, "full", backward=True, loss_fn=loss_fn) as w:
        loss = loss_fn(model(torch.randn(2, 1, 6, 6, 6)))
        assert loss.isnan()
        loss.backward()
    diagnosis = w.event.diagnosis
    where = line_of(GeneralizedDiceLoss.__call__, "numerator / denominator")
    assert diagnosis.kind == "loss" and diagnosis.rows == [1]
    assert diagnosis.summary.startswith(
        f"Made in the loss, outside the model: div and its gradient (div) in loss_fn at {where} "
        "made the first NaN/Inf in row 1: its numerator and denominator were both 0 in the "
        "forward already (0/0, so the loss was NaN)")
    assert "multiplied by 0 or dropped" not in diagnosis.summary
    assert diagnosis.suggestion[0].startswith(f"Guard the denominator at {where}: numerator and "
                                              "denominator are both 0")
    assert "(x + eps) / (d + eps)" in diagnosis.suggestion[0]
    assert not any("snr" in fix.lower() for fix in diagnosis.suggestion)


def test_a_division_masked_by_where_in_loss_fn_is_still_told_as_a_gradient_of_zero():
    # The forward's 0/0 is dropped by where (the loss is finite): its gradient's NaN is a
    # gradient of 0 meeting div's infinite slope, not the forward's 0/0.
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    target = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        hits, counts = (torch.sigmoid(out) * target).sum(1), target.sum(1)
        return torch.where(counts == 0, 0.0, hits / counts).mean()

    with watch(model, "full", backward=True, loss_fn=loss_fn) as w:
        loss = loss_fn(model(torch.randn(2, 4)))
        assert loss.isfinite()
        loss.backward()
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "loss"
    assert "the gradient reaching div there was 0" in diagnosis.summary
    assert "torch.where(d == 0, 1, d)" in diagnosis.suggestion[1]


class WeightedLoss:
    """diffusers' train_text_to_image.py: the per-sample weights are made before the loss
    (min-SNR, 0/0 at snr = 0), and loss_fn reads them."""

    def __init__(self) -> None:
        self.weights = torch.ones(2)
        self.noise = torch.zeros(2, 3, 4, 4)

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        per_sample = ((out - self.noise) ** 2).mean(dim=(1, 2, 3))
        return (per_sample * self.weights).mean()


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_that_loss_fn_reads_from_weights_made_before_it_names_that_op(mode):
    # With loss_fn given, the event and the first fix still said "watch with loss_fn=...", and
    # the trace blamed the batch's data or the weights.
    torch.manual_seed(0)
    model = nn.Conv2d(3, 3, 3, padding=1)
    loss_fn = WeightedLoss()
    with watch(model, mode, backward=True, loss_fn=loss_fn, replay_on_nan=True) as w:
        loss_fn(model(torch.randn(2, 3, 4, 4))).backward()
        snr = torch.tensor([2.0, 0.0])
        loss_fn.weights = torch.stack([snr, 5.0 * torch.ones_like(snr)], 1).min(1)[0] / snr
        loss_fn(model(torch.randn(2, 3, 4, 4))).backward()
    event = w.event
    diagnosis = event.diagnosis
    where = line_of(WeightedLoss.__call__, "per_sample * self.weights")
    assert diagnosis.kind == "loss"
    assert diagnosis.summary.startswith(f"Made in the loss, outside the model: mul in loss_fn at "
                                        f"{where} received the NaN from a tensor loss_fn reads")
    assert "computed before loss_fn ran" in diagnosis.summary
    assert event.summary().endswith(f"; first bad op mul at {where}")
    assert "loss_fn=" not in event.summary()
    assert not any("loss_fn=" in fix for fix in diagnosis.suggestion)
    assert diagnosis.suggestion[0].startswith(f"Check the tensors mul at {where} reads")
    report = event.trace.report()
    assert "came with the batch's data or the weights" not in report
    assert f"It entered at op mul in the backward of loss_fn at {where}" in report


class ActorCritic(nn.Module):
    """A CleanRL-style agent: a policy over two actions and a value head."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
        self.critic = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, action: torch.Tensor):
        dist = torch.distributions.Categorical(logits=self.actor(x))
        return dist.log_prob(action), self.critic(x)


class PpoLoss:
    """CleanRL's PPO loss: the advantages and returns are made from the rewards before the loss
    (here without bootstrapping), and loss_fn reads them."""

    def __init__(self, agent: ActorCritic, x: torch.Tensor, value_loss: bool = True) -> None:
        self.agent, self.x, self.value_loss = agent, x, value_loss
        self.old_log_prob = torch.full((16,), -0.69)
        self.set_rewards(torch.randn(16))

    def set_rewards(self, rewards: torch.Tensor) -> None:
        with torch.no_grad():
            self.advantages = rewards - self.agent.critic(self.x).view(-1)
        self.returns = rewards

    def __call__(self, out) -> torch.Tensor:
        log_prob, value = out
        advantages = (self.advantages - self.advantages.mean()) / (self.advantages.std() + 1e-8)
        ratio = (log_prob - self.old_log_prob).exp()
        loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2)).mean()
        if self.value_loss:
            loss = loss + 0.5 * ((value.view(-1) - self.returns) ** 2).mean()
        return loss


def _ppo_with_an_inf_reward(mode: str, value_loss: bool):
    torch.manual_seed(0)
    agent = ActorCritic()
    x, action = torch.randn(16, 4), torch.randint(0, 2, (16,))
    loss_fn = PpoLoss(agent, x, value_loss)
    with watch(agent, mode, backward=True, loss_fn=loss_fn) as w:
        for batch in range(3):
            rewards = torch.randn(16)
            if batch == 2:
                rewards[5] = math.inf  # the environment's reward
            loss_fn.set_rewards(rewards)
            loss_fn(agent(x, action)).backward()
    return w


@pytest.mark.parametrize("mode", MODES)
def test_an_inf_reward_in_the_returns_loss_fn_reads_says_to_check_how_they_were_made(mode):
    # The trace's first NaN made of an Inf no op made (the normalised advantages') stood in for
    # a birth: "sub ... made the first NaN/Inf", and the fix said to find "the report's earlier
    # op" that made the Inf; none did, it came with the returns made before loss_fn ran.
    w = _ppo_with_an_inf_reward(mode, value_loss=True)
    diagnosis = w.event.diagnosis
    where = line_of(PpoLoss.__call__, "self.returns) ** 2")
    assert (w.event.batch, w.event.module, diagnosis.kind) == (2, "critic.2", "loss")
    assert diagnosis.summary.startswith(f"Made in the loss, outside the model: sub in loss_fn at "
                                        f"{where} received the Inf from a tensor loss_fn reads")
    assert "made before loss_fn ran" in "\n".join(diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith(f"Check the tensors sub at {where} reads")
    assert "the returns and advantages" in diagnosis.suggestion[0]
    assert "one held an Inf before loss_fn ran. Check how it was made" in diagnosis.suggestion[0]
    text = " ".join([diagnosis.summary] + diagnosis.suggestion)
    assert "earlier op" not in text and "snr" not in text.lower()


@pytest.mark.parametrize("mode", MODES)
def test_advantages_normalised_over_an_inf_reward_name_the_op_it_entered_through(mode):
    # The advantages' own sub makes NaN of the Inf they came with: it is the first bad op, but
    # the Inf was made before loss_fn ran, and the fixes must say to check how.
    w = _ppo_with_an_inf_reward(mode, value_loss=False)
    diagnosis = w.event.diagnosis
    where = line_of(PpoLoss.__call__, "advantages = (self.advantages")
    assert (w.event.batch, diagnosis.kind) == (2, "loss")
    assert diagnosis.summary.startswith(
        f"Made in the loss, outside the model: sub in loss_fn at {where} received an Inf from a "
        "tensor loss_fn reads that no op of the replay made (not the model's output: it was "
        "computed before loss_fn ran) and made NaN of it in every row")
    assert "sub input self (float32): from" in diagnosis.evidence[0]
    assert diagnosis.suggestion[0].startswith(f"Check the tensors sub at {where} reads")
    assert "earlier op" not in " ".join(diagnosis.suggestion)


def test_replay_on_nan_with_loss_fn_replays_a_backward_event_through_the_loss():
    model = saturated_model()
    with nw.watch(model, on_nan="record", backward=True, replay_on_nan=True,
                  loss_fn=bce_by_hand) as w:
        bce_by_hand(model(torch.full((6, 4), 3.0).half())).backward()
    trace = w.event.trace
    assert trace is not None and trace.reproduced
    assert (trace.first_bad["op"], trace.first_bad["phase"]) == ("div", "backward")
    assert trace.first_bad_grad_of == "LogBackward0"
    assert trace.first_bad["source"] == line_of(bce_by_hand, "torch.log")


def test_an_evaluation_forward_is_replayed_without_the_training_loss():
    # loss_fn's closure fits the training batches; an evaluation batch of another size must
    # still be replayed (without the loss) when its output is NaN.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    targets = torch.zeros(8, 1)
    with watch(model, "sentinel", loss_fn=lambda out: ((out - targets) ** 2).mean()) as w:
        model(torch.randn(8, 4))
        x = torch.randn(3, 4)
        x[1, 0] = math.nan
        with torch.no_grad():
            model(x)
    event = w.event
    assert event.note == "" and event.trace is not None and event.trace.reproduced
    assert event.diagnosis.kind == "bad-data" and event.diagnosis.rows == [1]


def test_loss_fn_must_be_a_function():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="loss_fn must be a function of the model's output"):
        nw.watch(model, loss_fn=3)
    with pytest.raises(TypeError, match="got the class MSELoss"):
        nw.watch(model, loss_fn=nn.MSELoss)


def test_a_loss_fn_that_needs_the_targets_too_is_refused_in_one_line():
    # loss_fn gets the model's output alone: a criterion needs its target as well, and would
    # fail only in the replay at the first NaN, where the trace was wanted.
    model = nn.Linear(2, 2)
    for criterion, needs in ((nn.MSELoss(), "MSELoss() also needs target"),
                             (nn.functional.cross_entropy, "cross_entropy also needs target"),
                             (lambda out, y: (out - y).sum(), "also needs y"),
                             (lambda: 0, "does not take it")):
        with pytest.raises(TypeError, match="called with the model's output alone") as raised:
            nw.watch(model, loss_fn=criterion)
        assert needs in str(raised.value) and "lambda out: criterion(out, targets)" in \
            str(raised.value)
    with nw.watch(model, keep_batches=2) as w:
        model(torch.randn(3, 2))
        with pytest.raises(TypeError, match="MSELoss\\(\\) also needs target"):
            w.replay(0, loss_fn=nn.MSELoss())
        assert not w.replay(0, loss_fn=lambda out, *rest: out.sum()).ops.empty
    # one argument with defaults after it, or a partial with the target bound: accepted
    targets = torch.zeros(3, 2)
    nw.watch(model, loss_fn=functools.partial(nn.functional.mse_loss, target=targets)).close()
    nw.watch(model, loss_fn=lambda out, weight=1.0: out.sum() * weight).close()


def test_a_wrong_loss_fn_is_quoted_in_one_line():
    # an optimizer's repr lists every param group over a dozen lines
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError) as raised:
        nw.watch(model, loss_fn=torch.optim.Adam(model.parameters()))
    assert "\n" not in str(raised.value) and "got an Adam object" in str(raised.value)


# ---------------------------------------------------------------------------- unknown
def test_without_a_replay_a_nan_from_finite_inputs_stays_unknown_and_says_how_to_see_more():
    model = AcosOfTanh()
    with nw.watch(model, on_nan="record", keep_batches=0) as w:
        model(torch.randn(5, 4) * 5)
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.confidence) == ("unknown", "low")
    assert "keep_batches >= 1" in diagnosis.suggestion[0]


class RunningStateSqrt(nn.Module):
    """Keeps a recurrent state in a cache the caller passes and the forward writes in place (as
    Mamba's conv and SSM states are written at every generate() step); the sqrt of a
    negative state between its layers makes NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc1(x)
        if cache is not None:
            cache.add_(h.detach())
            h = h + cache
        return self.fc2(torch.sqrt(h))


def test_an_input_the_model_writes_in_place_is_not_answered_with_a_replay_that_refuses():
    torch.manual_seed(0)
    model = RunningStateSqrt()
    x = torch.randn(3, 4)
    cache = torch.zeros(3, 4)
    with nw.watch(model, on_nan="record") as w:
        model(x, cache=cache)  # batch 0: NaN, and the cache written
        diagnosis = w.event.diagnosis
        suggestion = " ".join(diagnosis.suggestion)
        assert diagnosis.kind == "unknown"
        assert "w.replay(0)" not in suggestion and "replay_on_nan" not in suggestion
        assert "use_cache=False" in suggestion
        assert any("by the model's own forward" in line for line in diagnosis.evidence)
        with pytest.raises(nw.core.replay.InputModifiedError):
            w.replay(0)  # what the old suggestion said to do
        model(x)  # the suggestion followed: the same input without the cache
        assert w.replay(w.batch - 1).first_bad["op"] == "sqrt"


class NanOnce(nn.Module):
    """Makes NaN on its second call only: a replay cannot repeat it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x) * (math.nan if self.calls == 2 else 1.0)


def test_an_event_after_the_replays_are_spent_says_so_and_names_the_earlier_cause():
    # A log of negative values in every batch, on_nan="record": the first events use the
    # watch's diagnosis replays; a later one cannot name its op, and says why and what the
    # same place was before.
    class LogOfLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(self.fc(x)).sum(-1)

    torch.manual_seed(0)
    model = LogOfLinear()
    with watch(model, "full") as w:
        for _ in range(MAX_DIAGNOSIS_REPLAYS + 1):
            model(torch.randn(4, 8))
    *first, last = w.events
    assert [e.diagnosis.kind for e in first] == ["domain"] * len(first)
    assert last.diagnosis.kind == "unknown"
    evidence = "\n".join(last.diagnosis.evidence)
    assert "a watch replays at most 4 batches for its diagnoses" in evidence
    assert (f"The event of batch {first[-1].batch} at the same module and role was diagnosed "
            f"as domain: {first[-1].diagnosis.summary}") in evidence


def test_a_nan_the_replay_does_not_meet_again_is_unknown_and_says_why():
    model = NanOnce()
    with watch(model, "sentinel") as w:
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.confidence) == ("unknown", "low")
    assert diagnosis.evidence[0].startswith("The replay did not reproduce it: the replay ran "
                                            "the same inputs, RNG states and weights")


def test_without_a_replay_an_inf_from_finite_inputs_is_read_from_the_frame_as_an_overflow():
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1e30)
    with nw.watch(model, on_nan="record", keep_batches=0) as w:
        model(torch.full((2, 4), 1e10))
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.confidence) == ("overflow", "medium")
    assert "made ±inf from finite inputs and weights" in diagnosis.summary
    assert "Its inputs reached 1e+10 (float32 max 3.4028e+38)." in diagnosis.evidence


def test_without_a_replay_an_overflow_of_small_inputs_names_the_weights_that_made_it():
    # A float16 projection whose weights grew huge, its input small (Mamba2's in_proj under
    # generate(), whose cache written in place allows no replay): "its inputs reached 2" alone
    # hid the cause.
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)).half()
    with torch.no_grad():
        model[0].weight.fill_(3e4)
    with nw.watch(model, on_nan="record", keep_batches=0) as w:
        model(torch.full((2, 4), 1.0, dtype=torch.float16))
    diagnosis = w.event.diagnosis
    assert (w.event.module, diagnosis.kind) == ("0", "overflow")
    assert "Its inputs reached 1 (float16 max 65504)." in diagnosis.evidence
    assert "Its weights reached 3e+04 (weight)." in diagnosis.evidence


class StoredWeightLinear(nn.Module):
    """A linear layer whose weight is no parameter: ``__getattr__`` fetches it from a store
    (as Pyro's PyroModule draws a PyroSample weight), so no frame measures it."""

    def __init__(self, store: dict) -> None:
        super().__init__()
        self.__dict__["store"] = store

    def __getattr__(self, name: str):
        if name == "weight":
            return self.__dict__["store"]["weight"]
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


@pytest.mark.parametrize("keep_batches", [0, 4])  # without a replay; with one that finds no op
def test_a_nan_weight_no_frame_measured_is_not_said_to_be_finite(keep_batches):
    # It read "made here from finite inputs and weights": no weight had been measured at all.
    torch.manual_seed(0)
    store = {"weight": torch.randn(2, 3)}
    store["weight"][1, 1] = float("nan")
    model = nn.Sequential(nn.Linear(4, 3), StoredWeightLinear(store))
    with nw.watch(model, on_nan="record", keep_batches=keep_batches) as w:
        model(torch.randn(5, 4))
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.module, event.role, event.origin) == ("1", "output", "output")
    assert "finite inputs and weights" not in w.report()
    assert "output: made here from finite inputs (it has no parameters or buffers, so no " \
           "weight it reads was checked" in event.summary()
    assert diagnosis.kind == "unknown"
    assert diagnosis.suggestion[0].startswith("Check the tensors module '1' reads besides its "
                                              "inputs")
    replayed = "The replay made it again, and no op made it from finite values: it came with " \
               "a tensor the watch does not measure." in diagnosis.evidence
    assert replayed == bool(keep_batches)


def test_a_weightless_module_whose_op_a_replay_names_is_not_said_to_hide_weights():
    class Root(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x)

    model = Root()
    with nw.watch(model, on_nan="record") as w:
        model(-torch.ones(2, 3))
    assert w.event.diagnosis.kind == "domain"
    assert w.event.note == "" and "finite inputs and weights" in w.event.summary()


class _TimesTensorAttribute(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight  # a plain tensor attribute, set by the parent


class _TiedByHand(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(4, 4))
        self.scaled = _TimesTensorAttribute()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scaled.weight = self.base * 2
        return self.head(self.scaled(x))


@pytest.mark.parametrize("keep_batches", [0, 4])
def test_a_weight_computed_from_another_modules_parameter_is_not_said_to_be_finite(
        keep_batches):
    # The module's weight is a tensor attribute made from the root's parameter: the event read
    # "made here from finite inputs and weights" ('unknown'); a weightless module (x / norm)
    # makes no such claim (its weights: none), and keeps its words.
    torch.manual_seed(0)
    model = _TiedByHand()
    with torch.no_grad():
        model.base[0, 0] = float("nan")
    with nw.watch(model, on_nan="record", keep_batches=keep_batches) as w:
        model(torch.randn(3, 4))
    event = w.events[0]
    assert (event.module, event.origin) == ("scaled", "output")
    assert "finite inputs and weights" not in event.summary()
    if keep_batches:  # the replay reads the parameter the attribute came from
        assert event.diagnosis.kind == "corrupted-weight"
        assert "'base' holds NaN" in event.diagnosis.summary
    else:
        assert event.diagnosis.suggestion[0].startswith("Check the tensors module 'scaled' reads")


# ---------------------------------------------------------------------------- where it shows
def test_report_prints_the_diagnosis_after_the_summary_line():
    model = LogOfRelu()
    with watch(model, "full") as w:
        model(torch.randn(8, 4))
    lines = w.report().split("\n")
    assert lines[0].startswith("nanwidget: inf in batch 0")
    assert lines[1].startswith("Diagnosis (domain, high confidence): log in module '<root>'")
    assert lines[2].startswith("  - log input self (float32): from 0 to ")
    # Every sample has a negative pre-activation: the summary says so, and names no sample.
    assert "got values outside its domain in every row: " in lines[1]
    assert not any(line.startswith("  Rows of the batch") for line in lines)
    assert any(line.startswith("  Try: Keep the argument of log") for line in lines[2:7])


def test_recordings_keep_the_diagnosis_and_older_ones_load_without_it(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(6, 4)
    x[3, 0] = math.nan
    with nw.watch(model, on_nan="record", log_dir=tmp_path / "run") as w:
        model(x)
    loaded = nw.load_run(tmp_path / "run").events[0]
    assert loaded.diagnosis == w.event.diagnosis and loaded.diagnosis.rows == [3]
    assert "Diagnosis (bad-data, high confidence)" in nw.load_run(tmp_path / "run").report(loaded)
    for path in (tmp_path / "run").rglob("event-[0-9]*[0-9].json"):  # as an older version wrote it
        meta = json.loads(path.read_text())
        del meta["diagnosis"]
        path.write_text(json.dumps(meta))
    assert nw.load_run(tmp_path / "run").events[0].diagnosis is None


def test_the_command_line_report_prints_the_diagnosis(tmp_path, capsys):
    from nanwidget.cli import main
    model = LogOfRelu()
    with nw.watch(model, on_nan="record", log_dir=tmp_path / "run"):
        model(torch.randn(8, 4))
    assert main(["report", str(tmp_path / "run")]) == 0
    assert "Diagnosis (domain, high confidence): log in module '<root>'" in capsys.readouterr().out


def test_the_browser_status_names_the_kind_and_the_first_fix():
    model = LogOfRelu()
    with watch(model, "full") as w:
        model(torch.randn(8, 4))
    status = nw.FrameBrowser(w).status.value
    assert "<span class='nw-diagnosis'><b>domain</b>: log in module" in status
    # and the first fix to try, as the %%nanwatch stop message gives it
    first_fix = w.event.diagnosis.suggestion[0]
    assert first_fix.startswith("Keep the argument of log")
    assert f"<span class='nw-fix'><b>Try:</b> {html.escape(first_fix, quote=False)}</span>" in status


def test_a_clean_run_pays_no_diagnosis(tiny_mlp):
    with nw.watch(tiny_mlp, on_nan="record") as w:
        for _ in range(3):
            tiny_mlp(torch.randn(2, 16))
    diagnoser = w.parts.diagnoser
    assert diagnoser.replays == 0 and not w.events
    assert [b for b, _ in diagnoser.weights.series] == [0, 1, 2]  # one float per batch


def test_a_weight_non_finite_for_many_batches_is_diagnosed_at_the_same_cost_each_time(
        monkeypatch):
    """Each corrupted-weight event reads the earlier events' windows for the last batch its
    weight was finite: once per window, not again at every later event (that made each
    diagnosis slower than the last, 10x after 70 batches)."""
    from nanwidget.core.diagnosis import feature
    reads = []
    real = feature.weights_finite_last
    monkeypatch.setattr(feature, "weights_finite_last",
                        lambda *args: reads.append(1) or real(*args))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(3, 4))
        with torch.no_grad():
            model[0].weight[1, 2] = float("nan")
        for _ in range(30):
            model(torch.randn(3, 4))
    assert len(w.events) == 30
    assert all(e.diagnosis.kind == "corrupted-weight" for e in w.events)
    # The last finite batch stays the one before the corruption, for the last event too.
    assert "batch 0" in w.events[-1].diagnosis.evidence[0] or any(
        "batch 0" in line for line in w.events[-1].diagnosis.evidence)
    assert len(reads) <= 2 * len(w.events)  # own window + the previous event's, each time


class ImagesList(nn.Module):
    """Takes a list of CHW images, as torchvision's detection models do."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([self.conv(image) for image in images]).mean((1, 2, 3))


@pytest.mark.parametrize("mode", MODES)
def test_the_bad_sample_of_a_list_of_images_is_its_place_in_the_list(mode):
    torch.manual_seed(0)
    model = ImagesList()
    images = [torch.rand(3, 16, 16) for _ in range(4)]
    images[1][2, 5, 5] = float("nan")  # image 1, channel 2
    with watch(model, mode) as w:
        model(images)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "bad-data" and diagnosis.rows == [1]
    assert "input[0][1]" in diagnosis.summary
    assert any("sample 1 of the list input[0]" in line for line in diagnosis.evidence)
    # Inside the image the NaN is in channel 2: "row 1" would name a row of the image.
    assert "channel 2 of sample 1" in diagnosis.summary and "row" not in diagnosis.summary


class TinyDetector(nn.Module):
    """Takes a list of CHW images and a list of per-image targets ({"boxes": (N, 4),
    "labels": (N,)}) and returns a dict of losses, as torchvision's detection models do."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, 4, 3)
        self.box_head = nn.Linear(4, 4)

    def forward(self, images: list[torch.Tensor],
                targets: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        features = torch.stack([self.backbone(image).mean((1, 2)) for image in images])
        boxes = torch.stack([target["boxes"].mean(0) for target in targets])
        return {"loss_box": nn.functional.smooth_l1_loss(self.box_head(features), boxes)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("as_keyword", [False, True])
def test_a_nan_box_in_a_detection_target_names_its_image_then_the_box(mode, as_keyword):
    # targets[0]["boxes"][1]: image 0's box 1. The rows said [1] ("row 1"), read as image 1.
    torch.manual_seed(0)
    model = TinyDetector()
    images = [torch.rand(3, 16, 16) for _ in range(3)]
    targets = [{"boxes": torch.tensor([[1.0, 2.0, 8.0, 9.0], [3.0, 3.0, 12.0, 14.0]]),
                "labels": torch.tensor([1, 2])} for _ in range(3)]
    targets[0]["boxes"][1, 2] = float("nan")
    with watch(model, mode) as w:
        model(images, targets=targets) if as_keyword else model(images, targets)
    diagnosis = w.event.diagnosis
    role = "kwarg:targets[0].boxes" if as_keyword else "input[1][0].boxes"
    assert diagnosis.kind == "bad-data" and diagnosis.rows == [0]
    assert f"The batch's {role} holds NaN in box 1 of sample 0:" in diagnosis.summary
    parent = role[:-len("[0].boxes")]
    assert any(f"sample 0 of the list {parent}" in line for line in diagnosis.evidence)
    assert "Rows of the batch that hold it: 0" in w.report()
    assert f"Look at how {role} (box 1 of sample 0) was made" in diagnosis.suggestion[0]


@pytest.mark.parametrize("mode", MODES)
def test_a_negative_running_var_is_named_as_the_domain_error_of_batch_norm(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_var[2] = -1.0  # a bad write: the channel's sqrt(var + eps) is NaN
    with watch(model, mode) as w, torch.no_grad():
        model(torch.randn(2, 3, 8, 8))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain" and diagnosis.confidence == "high"
    assert "running_var holds negative values (down to -1)" in diagnosis.summary
    assert any("running_var (float32): from -1 to 1" in line for line in diagnosis.evidence)
    assert "running_var.clamp_(min=0)" in diagnosis.suggestion[0]


def _batch_norm_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)).train()


def test_a_running_var_overflowed_by_the_batch_is_blamed_on_that_forward():
    # Inputs of 1e19 square past float32's largest: BatchNorm's running_var becomes Inf in
    # the forward itself (the outputs, normalised by the batch, stay finite). No optimizer
    # step or load ran: the diagnosis said one did.
    model = _batch_norm_net()
    with watch(model, "full") as w:
        model(torch.randn(4, 3, 16, 16))
        assert torch.isfinite(model(torch.randn(4, 3, 16, 16) * 1e19)).all()
    event = w.event
    assert (event.batch, event.module, event.role) == (1, "1", "running_var")
    assert event.diagnosis.summary.startswith(
        "'1.running_var' became Inf in batch 1's own forward: module '1' wrote it")
    assert "reset_running_stats()" in event.diagnosis.suggestion[1]


def test_a_running_var_overflowed_by_a_conv_one_step_blew_up_is_a_divergence():
    # One SGD step blew the conv's weight up ~1e33x (a garbage gradient); the next batch's
    # inputs were ordinary, but the conv made values of ~1e33 from them and the BatchNorm's
    # running_var overflowed. The diagnosis blamed the data ("normalise or clamp them, or drop
    # the batch") and never named the conv whose weight jumped.
    model = _batch_norm_net()
    model[0].weight.register_hook(lambda grad: grad * 1e36)  # stands for a bad backward kernel
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, "full", backward=True) as w:
        for _ in range(2):
            loss = model(torch.randn(4, 3, 16, 16)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.module, event.role) == (1, "1", "running_var")
    assert diagnosis.kind == "divergence" and diagnosis.confidence == "high"
    assert diagnosis.summary.startswith("Training diverged: the optimizer step after batch 0 "
                                        "made the weights jump")
    assert "(most: '0' " in diagnosis.summary  # the conv whose weight jumped
    assert "'1.running_var' Inf" in diagnosis.summary
    assert any("across the optimizer step after batch 0" in line for line in diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith("Lower the learning rate")
    assert any("clip_grad_norm_" in fix for fix in diagnosis.suggestion)
    assert not any("drop the batch" in fix for fix in diagnosis.suggestion)
    assert "reset_running_stats()" in diagnosis.suggestion[-1]


# (A training BatchNorm's outputs stay finite with a NaN running_mean: the sentinel, which
# checks the outputs, sees nothing there.)
@pytest.mark.parametrize("layer, mode", [("batch_norm", "full"), ("spectral_norm", "full"),
                                         ("spectral_norm", "sentinel")])
def test_a_buffer_non_finite_before_the_watch_is_not_blamed_on_the_first_forward(layer, mode):
    # The first batch's forward writes into these buffers (running statistics, the power
    # iteration's vectors), but from finite inputs: it cannot have made them NaN. The diagnosis
    # said they were finite when batch 0 started and that batch 0 wrote NaN into them.
    if layer == "batch_norm":
        model = _batch_norm_net()
        with torch.no_grad():
            model[1].running_mean[1] = float("nan")  # a bad checkpoint, say
        names = "'1.running_mean'"
    else:
        torch.manual_seed(0)
        model = nn.Sequential(torch.nn.utils.parametrizations.spectral_norm(nn.Linear(4, 6)),
                              nn.Tanh(), nn.Linear(6, 3))
        with torch.no_grad():
            model[0].parametrizations.weight[0]._v[1] = float("nan")
        names = "'0.parametrizations.weight.0._u', '0.parametrizations.weight.0._v'"
    with watch(model, mode) as w:
        model(torch.randn(4, 3, 16, 16) if layer == "batch_norm" else torch.randn(5, 4))
    diagnosis = w.event.diagnosis
    assert w.event.batch == 0 and diagnosis.kind == "corrupted-weight"
    assert diagnosis.summary.startswith(f"{names} hold")
    assert "before batch 0 ran" in diagnosis.summary and "own forward" not in diagnosis.summary
    assert not any("finite when batch 0 started" in line for line in diagnosis.evidence)
    assert any("held NaN when the watch began" in line for line in diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith("It was non-finite before the first batch watched")
    assert not any("reset_running_stats" in fix for fix in diagnosis.suggestion)
    # No step of this run wrote it: the steps' advice is for the run that saved it.
    assert all(fix.startswith(("It was", "In the run that saved it")) for fix in diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_nan_since_the_watch_began_is_not_blamed_on_a_step_when_the_cell_runs_again(mode):
    # A notebook line watch stays on; the training cell stops at a weight that was NaN before
    # the watch, and is run again. The second event said "holds NaN before batch 1 ran (an
    # optimizer step, a load or a write made it)" with the optimizer's fixes, although no batch
    # under the watch ever ran with the weight finite and no step ran in between.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan  # an earlier diverged run, a bad checkpoint
    x = torch.randn(4, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"mode": "sentinel"} if mode == "sentinel" else {}
    with nw.watch(model, **options) as w:
        for _ in range(2):  # the cell, run twice: each stops at its first batch
            with pytest.raises(nw.NanDetected):
                for _ in range(3):
                    loss = model(x).pow(2).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
    first, second = (event.diagnosis for event in w.events)
    assert [e.batch for e in w.events] == [0, 1]
    assert second.kind == "corrupted-weight"
    assert second.summary.startswith("'0.weight' holds NaN since before the watch began")
    assert "(batch 0) ran with it non-finite already" in second.summary
    assert any("held NaN when the watch began" in line for line in second.evidence)
    # The fixes of the first event: what the weight came from, not this run's steps.
    assert second.suggestion == first.suggestion
    assert second.suggestion[0].startswith("It was non-finite before the first batch watched")
    assert all(fix.startswith(("It was", "In the run that saved it")) for fix in second.suggestion)


def test_a_running_var_loaded_non_finite_is_still_blamed_on_the_load():
    model = _batch_norm_net()
    with watch(model, "full") as w:
        model(torch.randn(4, 3, 16, 16))
        state = {k: v.clone() for k, v in model.state_dict().items()}
        state["1.running_var"][3] = float("inf")
        model.load_state_dict(state)
        model(torch.randn(4, 3, 16, 16))
    summary = w.event.diagnosis.summary
    assert "'1.running_var' holds Inf since model.load_state_dict(...)" in summary
    assert "loaded it after batch 0" in summary and "own forward" not in summary


@pytest.mark.parametrize("api", ["pre_hook", "parametrization"])
def test_a_zero_direction_in_weight_norm_is_a_domain_error_of_that_layer(api):
    # The old weight_norm computes the weight in a forward pre-hook of the layer: its op was
    # named after the model around it (the replay's module hooks ran after the user's), and
    # the 0/0 of a zero-norm slice of v read "unknown".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old API is deprecated
        if api == "pre_hook":
            torch.nn.utils.weight_norm(model[0])
            direction, module = model[0].weight_v, "0"
        else:
            torch.nn.utils.parametrizations.weight_norm(model[0])
            direction, module = (model[0].parametrizations.weight.original1,
                                 "0.parametrizations.weight.0")
    with torch.no_grad():
        direction[2].zero_()
    with nw.watch(model, on_nan="record", replay_on_nan=True) as w:
        model(torch.randn(5, 4))
    event = w.event
    assert event.module == module and event.trace.first_bad["module"] == module
    assert event.trace.first_bad["op"] == "_weight_norm_interface"
    assert event.diagnosis.kind == "domain" and event.diagnosis.confidence == "high"
    assert "a slice of v is all zeros" in event.diagnosis.summary
    assert "is all zeros, so its norm is 0" in event.diagnosis.suggestion[0]


class ConvThenNorm(nn.Module):
    """A UNet's first block: conv_in, then a normalisation (diffusers' norm_eps=0)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = norm
        with torch.no_grad():
            self.conv.bias.zero_()  # a blank image stays all zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm, op", [(nn.GroupNorm(4, 8, eps=0.0), "native_group_norm"),
                                      (nn.LayerNorm([8, 6, 6], eps=0.0), "native_layer_norm")],
                         ids=["group_norm", "layer_norm"])
def test_a_norm_with_eps_0_over_a_blank_image_is_a_domain_error_naming_its_sample(mode, norm, op):
    # Its 0/0 was called an overflow past float32's largest value, with overflow fixes.
    torch.manual_seed(0)
    model = ConvThenNorm(norm)
    x = torch.zeros(3, 3, 6, 6)
    x[1] = torch.randn(3, 6, 6)  # rows 0 and 2: blank images
    with watch(model, mode) as w:
        model(x)
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.confidence) == ("domain", "high")
    assert diagnosis.summary.startswith(f"{op} in module 'norm'")
    assert line_of(ConvThenNorm.forward, "self.norm(") in diagnosis.summary
    assert "(variance 0) normalised with eps=0" in diagnosis.summary
    assert "largest" not in diagnosis.summary
    assert diagnosis.rows == [0, 2]
    assert "eps > 0" in diagnosis.suggestion[0] and "eps=1e-5" in diagnosis.suggestion[0]


def test_a_batch_norm_with_eps_0_and_a_running_var_of_0_is_a_domain_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, eps=0.0)).eval()
    with torch.no_grad():  # channel 1 was constant in training: its running_var decayed to 0
        model[0].weight[1] = 0.0
        model[0].bias[1] = model[1].running_mean[1]
        model[1].running_var[1] = 0.0
    with watch(model, "full") as w:
        model(torch.randn(2, 3, 5, 5))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain"
    assert "its running_var holds 0 and eps=0" in diagnosis.summary
    assert "running_var (float32): from 0 to 1." in "\n".join(diagnosis.evidence)
    assert diagnosis.rows == []  # every sample meets that channel's running_var
    assert "eps > 0" in diagnosis.suggestion[0]


class _InPlaceAfterLinear(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.op == "pow_":
            return h.pow_(-0.5)  # PyG's gcn_norm: deg.pow_(-0.5)
        if self.op == "sqrt_":
            return h.sqrt_()
        return h.div_(h - h)


@pytest.mark.parametrize("op, reason", [("pow_", "pow of a negative base"),
                                        ("sqrt_", "sqrt of values down to"),
                                        ("div_", "a division by zero")])
def test_an_in_place_op_outside_its_domain_is_a_domain_error(op, reason):
    # An in-place op's input is its output once it ran: its domain was read from the NaN it
    # made ("unknown"; div_ read "overflow"), and its name (pow_) matched no rule.
    torch.manual_seed(0)
    model = _InPlaceAfterLinear(op)
    with nw.watch(model, on_nan="record", replay_on_nan=True) as w:
        model(torch.randn(5, 4))
    diagnosis = w.event.diagnosis
    assert w.event.trace.first_bad["op"] == op
    assert diagnosis.kind == "domain" and reason in diagnosis.summary


class DenseGcn(nn.Module):
    """A GCN layer on a dense adjacency: D^-1/2 A D^-1/2 X W, the degree from the adjacency."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
        d = adjacency.sum(1).pow(-0.5)
        return d.unsqueeze(1) * (adjacency @ (d.unsqueeze(1) * self.lin(x)))


def test_a_zero_degree_raised_to_a_negative_power_gets_gcn_s_own_fix():
    torch.manual_seed(0)
    adjacency = torch.ones(5, 5)
    adjacency[3] = adjacency[:, 3] = 0  # node 3 has no edge, not even to itself
    model = DenseGcn()
    with watch(model, "full") as w:
        model(torch.randn(5, 4), adjacency)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain" and diagnosis.summary.startswith("pow ")
    assert any("d.masked_fill_(d == float('inf'), 0)" in fix and "deg.clamp(min=1)" in fix
               for fix in diagnosis.suggestion)


class _SumsInPlace(nn.Module):
    """Node features summed in place, as graph libraries pool them (PyG's scatter_add_ behind
    every aggregation and pooling, DGL's index_add_), or a residual, scale or running sum
    written in place."""

    def __init__(self, op: str, initial: torch.Tensor | None = None) -> None:
        super().__init__()
        self.op = op
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.initial = initial  # a plain attribute, no buffer: the watch measures it nowhere

    def forward(self, x: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.op == "scatter_add_":
            pooled = torch.zeros(2, 4, dtype=h.dtype).scatter_add_(
                0, graph.unsqueeze(1).expand_as(h), h)
        elif self.op == "index_add_":
            start = torch.zeros(2, 4, dtype=h.dtype) if self.initial is None \
                else self.initial.clone()
            pooled = start.index_add_(0, graph, h)
        elif self.op == "add_":
            pooled = h.add_(x)
        elif self.op == "mul_":
            pooled = h.mul_(2.0)
        else:
            pooled = h.cumsum_(0)
        return self.head(pooled)


def _sums_in_place(op: str, dtype: torch.dtype, scale: float = 0.6,
                   initial: torch.Tensor | None = None) -> tuple[nn.Module, tuple]:
    """The model above with an identity first layer, and 4 nodes of 2 graphs at ``scale``
    times ``dtype``'s largest value (finite: two of them sum past it)."""
    torch.manual_seed(0)
    model = _SumsInPlace(op, initial).to(dtype)
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(4))
        model.lin.bias.zero_()
    x = torch.full((4, 4), scale * torch.finfo(dtype).max).to(dtype)
    return model, (x, torch.tensor([0, 0, 1, 1]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["scatter_add_", "index_add_", "add_", "mul_", "cumsum_"])
def test_an_overflow_in_an_in_place_sum_is_an_overflow_of_the_values_it_read(op, dtype):
    # An in-place op's self is its output once it ran: its inputs were described after the
    # write (self "written in place since", holding the Inf the op made), so the overflow
    # rule saw an Inf come in and the verdict read "unknown", with advice to replay a batch
    # replay_on_nan=True had replayed (a float16 PyG GAT summing raw features of 56000).
    model, inputs = _sums_in_place(op, dtype)
    with nw.watch(model, on_nan="record", replay_on_nan=True) as w:
        model(*inputs)
    event = w.event
    diagnosis = event.diagnosis
    name = str(dtype).replace("torch.", "")
    assert event.trace.first_bad["op"] == op
    assert (diagnosis.kind, diagnosis.confidence) == ("overflow", "high")
    assert diagnosis.summary.startswith(f"{op} in module '<root>' (_SumsInPlace) at ")
    assert f"overflowed {name}" in diagnosis.summary
    evidence = "\n".join(diagnosis.evidence)
    held = "0 to 0" if op in ("scatter_add_", "index_add_") else "{0:.3g} to {0:.3g}".format(
        0.6 * torch.finfo(dtype).max)
    assert f"{op} input self ({name}): from {held}." in evidence
    assert "written in place" not in evidence
    assert f"{op} output: " in evidence and f"({name} max " in evidence
    assert not any("w.replay(" in fix for fix in diagnosis.suggestion)


class _SumPool(nn.Module):
    """A graph's sum pool by hand: every node's features added into its graph's row."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
        pooled = torch.zeros(2, 4, dtype=x.dtype)
        if self.op == "scatter_add_":
            pooled = pooled.scatter_add_(0, graph.unsqueeze(1).expand_as(x), x)
        else:
            pooled = pooled.index_add_(0, graph, x)
        return self.head(pooled)


@pytest.mark.parametrize("op", ["scatter_add_", "index_add_"])
def test_a_float16_sum_pool_over_many_moderate_values_is_told_to_accumulate_in_float32(op):
    # 4096 nodes of 20 each sum to 81920 in one graph's row: the fix said "keep the values
    # smaller before scatter_add: divide attention scores by sqrt(d)", of values at most 20.
    torch.manual_seed(0)
    model = _SumPool(op).half()
    x = torch.full((4097, 4), 20.0, dtype=torch.float16)
    graph = torch.zeros(4097, dtype=torch.long)
    graph[-1] = 1
    with nw.watch(model, on_nan="record", replay_on_nan=True) as w:
        model(x, graph)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow" and w.event.trace.first_bad["op"] == op
    fixes = "\n".join(diagnosis.suggestion)
    assert "sums the values that share an index" in fixes and "accumulate in float32" in fixes.lower()
    assert "reduce='mean'" in fixes and "attention scores" not in fixes


def test_an_in_place_sum_whose_result_is_written_again_later_says_so():
    # The evidence describes the output when the diagnosis runs: a later in-place write into it
    # (a mean dividing the sum) shows values the op did not make, and must say so.
    class MeanInPlace(nn.Module):
        def forward(self, x: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
            pooled = torch.zeros(2, 4, dtype=x.dtype).index_add_(0, graph, x)
            return pooled.div_(torch.tensor([[2.0], [2.0]], dtype=x.dtype))

    model = MeanInPlace()
    x = torch.full((4, 4), 40000.0, dtype=torch.float16)
    with nw.watch(model, on_nan="record", replay_on_nan=True) as w:
        model(x, torch.tensor([0, 0, 1, 1]))
    diagnosis = w.event.diagnosis
    assert w.event.trace.first_bad["op"] == "index_add_" and diagnosis.kind == "overflow"
    evidence = "\n".join(diagnosis.evidence)
    assert "index_add_ input self (float16): from 0 to 0." in evidence
    assert "index_add_ output (written in place since): 8 Inf of 8 values" in evidence


def test_an_inf_an_in_place_op_s_self_already_held_is_not_made_there():
    # The linear overflowed first; the in-place add only carried its Inf on.
    model, inputs = _sums_in_place("add_", torch.float16, scale=2.0 ** 0.5 / 2)
    with torch.no_grad():
        model.lin.weight.mul_(2.0)
    with nw.watch(model, on_nan="record", replay_on_nan=True) as w:
        model(*inputs)
    diagnosis = w.event.diagnosis
    assert w.event.trace.first_bad["op"] == "addmm"
    assert diagnosis.kind == "overflow" and diagnosis.summary.startswith("addmm in module 'lin'")


def test_an_inf_a_plain_attribute_held_before_an_in_place_sum_is_not_made_there():
    # A starting tensor kept as a plain attribute (no buffer) held an Inf: index_add_ read it
    # and wrote it back. No traced op made it, so the trace was blamed on index_add_ "from
    # finite inputs" (its self described after the write).
    initial = torch.zeros(2, 4, dtype=torch.float16)
    initial[1, 2] = math.inf
    model, (x, graph) = _sums_in_place("index_add_", torch.float16, initial=initial)
    with nw.watch(model, on_nan="record", replay_on_nan=True) as w:
        model(x / 1e4, graph)
    event, diagnosis = w.event, w.event.diagnosis
    assert event.trace.first_bad is None
    assert event.trace.first_reader()["op"] == "index_add_"
    assert "index_add_" not in diagnosis.summary and diagnosis.kind == "unknown"
    assert any(line.startswith("No op of the replay made it: index_add_ in module '<root>' at ")
               and "a plain tensor attribute" in line for line in diagnosis.evidence)
    # The replay is in event.trace already: the advice reads it, it does not ask for another.
    assert not any("w.replay(" in fix or "replay_on_nan" in fix for fix in diagnosis.suggestion)
    assert "event.trace.report()" in diagnosis.suggestion[0]


class _ScaledLogits(nn.Module):
    """CLIP's logits: a learnable log-scale, exponentiated."""

    def __init__(self, log_scale: float, clamp: float | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.logit_scale = nn.Parameter(torch.tensor(log_scale))
        self.clamp = clamp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.logit_scale if self.clamp is None else self.logit_scale.clamp(max=self.clamp)
        return torch.exp(scale) * self.proj(x)


def test_an_exp_overflow_is_told_a_clamp_below_log_of_the_largest():
    # The fix said x.clamp(-1e4, 1e4) before exp: exp(1e4) is still inf.
    torch.manual_seed(0)
    model = _ScaledLogits(100.0)
    x = torch.randn(3, 4)
    with nw.watch(model, on_nan="record", replay_on_nan=True) as w:
        model(x)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow" and w.event.trace.first_bad["op"] == "exp"
    # First the clamp of the learned log-scale itself (test_exp_of_a_learned_log_scale_...)
    assert "model.logit_scale.clamp_(0, math.log(100))" in diagnosis.suggestion[0]
    assert "torch.exp(x.clamp(max=80))" in diagnosis.suggestion[1]
    assert not any("clamp(-1e4, 1e4)" in fix for fix in diagnosis.suggestion)
    fixed = _ScaledLogits(100.0, clamp=80.0)
    fixed.load_state_dict(model.state_dict())
    with nw.watch(fixed, on_nan="raise"):
        assert torch.isfinite(fixed(x)).all()


def test_weights_that_one_optimizer_step_blew_up_are_a_divergence():
    # Adam at a learning rate of 1e12 moves every weight by about 1e12 in its first step: the
    # next steps' NaN weights read "corrupted weight" with no word of the learning rate (a
    # climb needed two batches). One user write that scales a weight stays no divergence (the
    # GPT-2 test above). (Sentinel mode measures no weights of the batches before: it says so.)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e12)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with watch(model, "full") as w:
        for _ in range(4):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if w.events:
                break
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "divergence"
    assert any("from batch 0" in line and "to batch 1" in line for line in diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith("Lower the learning rate")


def test_batch_norms_batch_counter_is_no_weight_growth():
    # num_batches_tracked (an integer buffer) counted 4.3 -> 15.3 as "the weights grew 1.12x
    # per batch": a NaN written into a weight at batch 12 read "Training diverged".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, "full") as w:
        for _ in range(12):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            model[2].weight[0, 0] = math.nan
        model(torch.randn(4, 8))
    assert w.events[0].diagnosis.kind == "corrupted-weight"
    assert "between batch 11 and batch 12" in w.events[0].diagnosis.summary


class _Float8Weight(nn.Module):
    """A weight-only low-precision layer: its weight kept as a buffer in ``dtype``."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.float().t()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e5m2], ids=str)
def test_a_finite_weight_cast_past_its_formats_largest_is_an_overflow_at_the_cast(dtype):
    # 1e5 in a finite float32 checkpoint is inf in float8_e5m2 (largest 57344): float8 read
    # "corrupted-weight ... check the checkpoint (all(v.isfinite()...)", which passes.
    torch.manual_seed(0)
    weight = torch.randn(8, 8)
    weight[2, 3] = 1e5
    model = nn.Sequential(nn.Linear(8, 8), _Float8Weight(weight, dtype))
    with watch(model, "full") as w:
        model(torch.randn(2, 8))
    diagnosis = w.events[0].diagnosis
    name = str(dtype).replace("torch.", "")
    assert diagnosis.kind == "overflow"
    assert f"Inf in {name} from the first batch watched: a value above {name}'s largest " \
        f"({torch.finfo(dtype).max:.6g}) becomes inf" in diagnosis.summary
    if dtype != torch.float16:
        assert diagnosis.suggestion[0].startswith("Scale the values into float8_e5m2's range")


class _Float8Batch(nn.Module):
    """A linear layer fed float8 data (a float8 dataloader), widened before the matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x8: torch.Tensor) -> torch.Tensor:
        return self.fc(x8.float())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype, bits, what", [(torch.float8_e4m3fn, 0x7F, "NaN"),
                                               (torch.float8_e5m2, 0x7C, "Inf"),
                                               (torch.float8_e5m2, 0x7F, "NaN")],
                         ids=["e4m3fn-nan", "e5m2-inf", "e5m2-nan"])
def test_a_float8_batch_holding_nan_or_inf_is_bad_data_with_its_row(mode, dtype, bits, what):
    # torch.isinf is not implemented for float8_e4m3fn (nor isneginf for e5m2): the rows were
    # lost (rows=[], generic evidence), and an e5m2 Inf gave kind "unknown" with no evidence.
    torch.manual_seed(0)
    x = torch.randn(4, 8).to(dtype).view(torch.uint8).clone()
    x[2, 3] = bits
    model = _Float8Batch()
    with watch(model, mode) as w, torch.no_grad():
        model(x.view(dtype))
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("bad-data", [2])
    assert f"1 {what} in row 2 of 4" in " ".join(diagnosis.evidence)


class _Float8Activations(nn.Module):
    """Activations stored in float8_e4m3fnuz between two layers, cast without a scale."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stored = self.fc1(x).to(torch.float8_e4m3fnuz)
        return self.fc2(stored.float())


@pytest.mark.parametrize("mode", MODES)
def test_an_overflowing_cast_to_float8_is_explained_as_a_cast_with_its_formats_limits(mode):
    # The cast to float8_e4m3fnuz (largest 240) was "a square or a sum inside it passed ...",
    # its fixes clamp(-1e4, 1e4) (still NaN in that format) and "a float32 value past 3.4e38",
    # and the evidence "non-finite of 32 values" had no count.
    torch.manual_seed(0)
    model = _Float8Activations()
    x = torch.randn(4, 8) * 1000
    with watch(model, mode) as w:
        model(x)
    diagnosis = w.event.diagnosis
    fixes = " ".join(diagnosis.suggestion)
    stored = model.fc1(x).detach()
    past = int((stored.abs() > 240).sum())
    assert diagnosis.kind == "overflow" and "square or a sum" not in diagnosis.summary
    assert "cast" in diagnosis.summary and "float8_e4m3fnuz's largest value (240)" \
        in diagnosis.summary
    assert line_of(_Float8Activations.forward, ".to(torch.float8_e4m3fnuz)") in diagnosis.summary
    assert f"{past} NaN of 32 values (float8_e4m3fnuz max 240)" in " ".join(diagnosis.evidence)
    assert "clamp(-1e4, 1e4)" not in fixes and "3.4e38" not in fixes
    assert "x.clamp(-240, 240)" in fixes and "amax" in fixes
    assert (stored.clamp(-240, 240).to(torch.float8_e4m3fnuz).float().isfinite()).all()


class _ComplexKernel(nn.Module):
    """An S4D-style kernel: exp of a complex parameter, its real part summed."""

    def __init__(self) -> None:
        super().__init__()
        self.log_a = nn.Parameter(torch.complex(-0.5 * torch.ones(4, 8), torch.ones(4, 8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.exp(2.0 * self.log_a).real.sum(-1)


def test_an_exp_of_a_complex_value_that_overflows_names_the_op_and_its_real_part():
    # The trace found exp (complex64) but described its input as having no range: the
    # diagnosis fell back to "made ±inf from finite inputs and weights".
    torch.manual_seed(0)
    model = nn.Sequential(_ComplexKernel(), nn.Linear(4, 2))
    with nw.watch(model, on_nan="record", replay_on_nan=True) as w:
        model(torch.randn(3, 4))
        with torch.no_grad():
            model[0].log_a[1, 2] = complex(200.0, 1.0)
        model(torch.randn(3, 4))
    diagnosis = w.events[0].diagnosis
    assert diagnosis.kind == "overflow"
    assert "exp of values up to 400: above 88.7" in diagnosis.summary


class _TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def _rare_token_nan(train: bool) -> nw.NanEvent:
    """A checkpoint whose embedding row of token 15 holds NaN, loaded before a sentinel watch;
    batches 0-2 do not use token 15, batch 3 does."""
    torch.manual_seed(0)
    model = _TokenModel()
    with torch.no_grad():
        model.embed.weight[15] = math.nan
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, "sentinel") as w:
        for batch in range(4):
            tokens = torch.randint(0, 15, (2, 5))
            if batch == 3:
                tokens[1, 2] = 15
            if train:
                model(tokens).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            else:
                with torch.no_grad():
                    model(tokens)
    return w.events[0]


def test_a_rare_tokens_nan_row_unused_until_now_is_not_blamed_on_the_batch_before():
    # Sentinel mode measures no weights: batches 0-2 had finite outputs because they did not
    # look token 15 up. It said "became NaN between batch 2 and batch 3: the optimizer step,
    # load or write after batch 2 did it" (high confidence) in an inference loop.
    event = _rare_token_nan(train=False)
    diagnosis = event.diagnosis
    assert (event.batch, event.module, diagnosis.kind) == (3, "embed", "corrupted-weight")
    assert diagnosis.summary == (
        "'embed.weight' holds NaN since before the watch began; batch 3 is the first to read "
        "the bad values (no in-place write and no optimizer step in between).")
    assert diagnosis.suggestion[0].startswith("It was non-finite before the first batch watched")
    assert not any("finite when batch" in line for line in diagnosis.evidence)


def test_a_rare_tokens_nan_row_with_optimizer_steps_between_is_only_likely_the_step():
    # Written by every step after it: the step after batch 2 may have made it NaN, or batch 2
    # may not have read it. Not said as a certainty.
    diagnosis = _rare_token_nan(train=True).diagnosis
    assert diagnosis.kind == "corrupted-weight" and diagnosis.confidence == "medium"
    assert any("likely made it non-finite, unless batch 2 did not read the bad values" in line
               for line in diagnosis.evidence)
    assert diagnosis.summary.startswith(
        "'embed.weight' holds NaN at batch 3, likely since the optimizer step, load or write "
        "after batch 2 (or an earlier one")


class _WritesItsCache(nn.Module):
    """Writes each step into a cache passed in (a static key/value cache): a batch's inputs
    change after it ran, so it cannot be replayed."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.add_(x)
        return self.layer(cache).log()  # NaN where the layer's output is negative


def test_a_sentinel_event_whose_batch_cannot_be_replayed_does_not_suggest_replaying_it():
    # It suggested w.replay(1) and replay_on_nan=True: the first raises, the second is what the
    # sentinel did already.
    torch.manual_seed(0)
    model = _WritesItsCache()
    cache = torch.zeros(2, 4)
    with watch(model, "sentinel") as w:
        with torch.no_grad():
            model(torch.randn(2, 4), cache=cache)
    event = w.events[0]
    assert event.note.startswith("not replayed: ")
    assert event.diagnosis.kind == "unknown"
    assert event.diagnosis.suggestion[0].startswith("Watch in full mode")
    assert not any("w.replay(" in fix or "replay_on_nan" in fix for fix in event.diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
def test_running_statistics_a_bad_batch_wrote_are_blamed_on_that_batchs_data(mode):
    # Batch 1 holds a NaN; the loop skips its optimizer step (the usual guard), but its forward
    # had updated BatchNorm's running statistics already. The later events read "became NaN
    # between batch 0 and batch 1: the optimizer step ... after batch 0" (sentinel: "They were
    # finite when batch 2 ran"), with gradient clipping as the fix.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    with watch(model, mode) as w:
        for step in range(4):
            x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 1, generator=generator)
            if step == 1:
                x[2, 3] = math.nan
            if step == 3:
                model.eval()
            loss = nn.functional.mse_loss(model(x), y)
            if not torch.isfinite(loss):
                optimizer.zero_grad()
                continue
            if model.training:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    first, later = w.events[0], w.events[-1]
    assert (first.batch, first.diagnosis.kind, first.diagnosis.rows) == (1, "bad-data", [2])
    assert (later.batch, later.module, later.role) == (3, "1", "running_mean")
    diagnosis = later.diagnosis
    assert diagnosis.kind == "bad-data" and diagnosis.rows == [2]
    assert diagnosis.summary.startswith(
        "'1.running_mean', '1.running_var' hold NaN since batch 1's forward updated them")
    assert "finite when batch" not in " ".join(diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith(
        "Mend them: model.get_submodule('1').reset_running_stats()")


class _StepWithCache(nn.Module):
    """A decoding step: adds its input into a cache it is handed (written in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.add_(x)
        return self.layer(cache)


@pytest.mark.parametrize("mode", MODES)
def test_bad_data_beside_a_cache_written_in_place_is_still_read_with_its_rows(mode):
    # The cache changed, so the batch cannot be replayed: the diagnosis read none of the
    # inputs (sentinel "unknown", full mode bad-data without rows), not even the data beside it.
    torch.manual_seed(0)
    model = _StepWithCache()
    cache = torch.zeros(3, 4)
    with watch(model, mode) as w:
        with torch.no_grad():
            x = torch.randn(3, 4)
            x[1, 2] = math.nan
            model(x, cache=cache)
    diagnosis = w.events[0].diagnosis
    assert (diagnosis.kind, diagnosis.rows, diagnosis.confidence) == ("bad-data", [1], "high")
    assert "input[0] holds NaN in row 1" in diagnosis.summary


def _lbfgs_fit(mode: str, lr: float, steps: int = 10, **options) -> nw.NanWatch:
    """A least-squares fit by torch.optim.LBFGS (closure, float32, no line search unless given),
    its closure watched (each call a batch), until the first event."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x, y = torch.randn(64, 8), torch.randn(64, 1) * 1e3
    optimizer = torch.optim.LBFGS(model.parameters(), lr=lr, **options)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    with watch(model, mode) as w:
        for _ in range(steps):
            optimizer.step(closure)
            if w.events:
                break
    return w


_NOT_LBFGS_FIXES = ("clip_grad_norm_", "lr_scheduler", "GradScaler", "load_state_dict")


@pytest.mark.parametrize("mode", MODES)
def test_lbfgs_iterations_that_climb_inside_one_step_are_its_divergence_with_its_fixes(mode):
    # lr=10, no line search: LBFGS's 20 iterations of its first step() (its closure called 20
    # times: batches 0 to 19) grew the weights 11x per call until they went NaN. Full mode
    # said "Training diverged ... per batch" and to clip the gradients and warm the lr up
    # with a scheduler; sentinel mode said corrupted-weight ("the optimizer step, load or write
    # after batch 18"). No step ended: the climb is LBFGS's iterations, fixed by its options.
    w = _lbfgs_fit(mode, lr=10.0)
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.origin, diagnosis.kind) == (19, "weight", "divergence")
    assert diagnosis.summary.startswith("LBFGS diverged inside one optimizer step: ")
    assert "per closure call" in diagnosis.summary
    evidence = "\n".join(diagnosis.evidence)
    assert "calls of LBFGS's closure inside one optimizer.step()" in evidence
    assert "with no line search" in evidence or "without a line search" in evidence
    if mode == "sentinel":  # no weights measured between the calls: the outputs tell it
        assert diagnosis.confidence == "medium" and "on the same input tensors" in evidence
    assert diagnosis.suggestion[0].startswith("Give LBFGS a line search")
    assert "line_search_fn='strong_wolfe'" in diagnosis.suggestion[0]
    assert any(fix.startswith("Lower lr (now 10;") for fix in diagnosis.suggestion)
    assert any("max_iter, now 20" in fix for fix in diagnosis.suggestion)
    assert not any(word in fix for fix in diagnosis.suggestion for word in _NOT_LBFGS_FIXES)


@pytest.mark.parametrize("mode", MODES)
def test_an_lbfgs_update_that_jumps_into_nan_in_one_iteration_is_no_divergence(mode):
    # lr=1e30: the first full iteration of the first step() jumps the weights 1e29x, the next
    # makes them NaN; no climb, no step ended. It read "became NaN between batch 1 and batch 2:
    # the optimizer step, load or write after batch 1" with clipping's and a load's fixes.
    w = _lbfgs_fit(mode, lr=1e30)
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.origin, diagnosis.kind) == (2, "weight", "corrupted-weight")
    assert "two calls of LBFGS's closure inside one optimizer.step()" in diagnosis.summary
    assert "no divergence over training steps" in diagnosis.summary
    if mode == "full":
        assert "the update after batch 0 alone multiplied them by" in "\n".join(diagnosis.evidence)
    assert diagnosis.confidence == ("high" if mode == "full" else "medium")
    assert diagnosis.suggestion[0].startswith("Give LBFGS a line search")
    assert not any(word in fix for fix in diagnosis.suggestion for word in _NOT_LBFGS_FIXES)


def test_lbfgs_with_a_strong_wolfe_line_search_at_a_huge_lr_makes_no_event():
    # Pinned: its line search meets an infinite loss at lr=1e30 and backs off; the weights
    # stay finite, so there is nothing to diagnose (the loss is computed outside the model).
    w = _lbfgs_fit("full", lr=1e30, steps=3, line_search_fn="strong_wolfe")
    assert not w.events


@pytest.mark.parametrize("mode", MODES)
def test_weights_an_lbfgs_step_wrote_inside_a_batch_are_not_blamed_on_a_checkpoint(mode):
    # set_batch(step) numbers batches by optimizer step; LBFGS runs its closure four times per
    # step, and a trial point whose exp(loss) overflows leaves NaN weights for the fourth. It
    # said they "held NaN when the watch began (a checkpoint loaded ...)".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=50, max_iter=4, history_size=4)
    x, y = torch.randn(32, 8), torch.randn(32, 1) * 3

    def closure():
        optimizer.zero_grad()
        loss = torch.exp(nn.functional.mse_loss(model(x), y))
        loss.backward()
        return loss

    with watch(model, mode) as w:
        for step in range(3):
            w.set_batch(step)
            optimizer.step(closure)
            if w.events:
                break
    event = w.events[0]
    diagnosis = event.diagnosis
    assert (event.batch, event.origin, diagnosis.kind) == (0, "weight", "corrupted-weight")
    assert "within batch 0" in diagnosis.summary
    assert "when the watch began" not in " ".join(diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith("A step inside batch 0 wrote them: with LBFGS")
    if mode == "full":
        assert "between call 2 and call 3 of module '0'" in diagnosis.summary


class _GanWithItsGenerator(nn.Module):
    """A GAN whose forward is the generator's; the discriminator is called directly."""

    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.G(z)


def test_nan_data_into_a_module_called_outside_the_forward_points_at_watching_that_module():
    # D(real) with a NaN row, D called directly after the model's forward in the same batch:
    # it suggested w.replay(2), whose replay runs the forward only and "did not reproduce it:
    # ... nondeterministic kernels", and said the model's outputs "stayed finite".
    torch.manual_seed(0)
    model = _GanWithItsGenerator()
    with nw.watch(model, on_nan="record") as w:
        for batch in range(3):
            w.set_batch(batch)
            real = torch.randn(8, 8)
            if batch == 2:
                real[2, 1] = math.nan
            model.D(model(torch.randn(8, 4)))
            model.D(real)
    event = w.event
    diagnosis = event.diagnosis
    assert (event.batch, event.module, event.origin) == (2, "D.0", "input")
    assert diagnosis.suggestion[0].startswith("Watch module 'D' as a model of its own")
    evidence = " ".join(diagnosis.evidence)
    assert "nondeterministic" not in evidence and "stayed finite" not in evidence
    assert "ran outside the model's forward" in evidence


@pytest.mark.parametrize("on_nan", ["record", "raise"])
def test_a_module_dicts_discriminator_called_once_is_named_for_watching_not_its_first_layer(
        on_nan):
    # nn.ModuleDict({'G', 'D'}) watched whole, D(real) called once with a NaN sample: the
    # advice named D's first Linear ('D.0'), the frame of D's own call being past the event's.
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    real = torch.randn(8, 8)
    real[3, 5] = math.nan
    with nw.watch(nn.ModuleDict({"G": generator, "D": discriminator}), on_nan=on_nan) as w:
        discriminator(generator(torch.randn(8, 4)))  # batch 0: clean
        w.step()
        with pytest.raises(nw.NanDetected) if on_nan == "raise" else contextlib.nullcontext():
            discriminator(real)
    event = w.event
    diagnosis = event.diagnosis
    assert (event.batch, event.module, event.origin) == (1, "D.0", "input")
    # D's call opened the batch: what it was given came with the data (it said "what made it
    # could not be told", a verdict of "unknown").
    assert diagnosis.kind == "bad-data"
    assert diagnosis.summary.startswith("The input[0] that module 'D' was called with")
    assert "nw.watch(model.get_submodule('D'))" in diagnosis.suggestion[0]
    assert "Module 'D' ran outside the model's forward" in " ".join(diagnosis.evidence)


class _EncoderFirst(nn.Module):
    """An encoder-decoder whose forward is the decoder's: the encoder runs first, called
    directly (what ``generate()`` of an encoder-decoder does with its ``pixel_values``)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.decoder = nn.Linear(8, 4)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(hidden)


@pytest.mark.parametrize("between", [False, True])
def test_nan_data_into_an_encoder_called_before_the_forward_is_bad_data_unless_code_came_between(
        between):
    torch.manual_seed(0)
    model = _EncoderFirst()
    with nw.watch(model, on_nan="record") as w:
        for batch in range(3):
            pixels = torch.randn(2, 8)
            if batch == 2 and not between:
                pixels[1, 3] = math.nan
            hidden = model.encoder(pixels)
            if batch == 2 and between:  # the user's code between two calls made it: no data
                hidden = torch.log(hidden - 10)
                model.decoder(hidden)
            else:
                model(hidden)
    event, diagnosis = w.event, w.event.diagnosis
    if between:  # the data, or the code between the two calls: both are said
        assert (event.batch, event.module, event.role) == (2, "decoder", "input[0]")
        assert (diagnosis.kind, diagnosis.confidence) == ("bad-data", "low")
        assert "from the code between the call of 'encoder' and this one" in diagnosis.summary
        assert "Module 'decoder' ran outside the model's forward" in " ".join(diagnosis.evidence)
    else:
        assert (event.batch, event.module, event.role) == (2, "encoder.0", "input[0]")
        assert (diagnosis.kind, diagnosis.confidence) == ("bad-data", "medium")
        assert "came with the data, not from the model" in diagnosis.summary
        assert "no module of the model ran before it in the batch" in diagnosis.evidence[0]


class _QPolicy(nn.Module):
    """A DQN policy as Stable-Baselines3 builds one: its forward is never called; the loop
    calls its Q-network and the target copy directly."""

    def __init__(self) -> None:
        super().__init__()
        self.q_net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.q_net_target = copy.deepcopy(self.q_net)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.q_net(obs).argmax(-1)


def test_a_nan_observation_handed_to_a_part_called_directly_is_bad_data():
    # q_net(obs) with a NaN observation, no root forward in the batch: "unknown", "what made
    # it could not be told", though the frame of q_net's own call says its input held NaN.
    torch.manual_seed(0)
    policy = _QPolicy()
    optimizer = torch.optim.Adam(policy.q_net.parameters(), lr=1e-3)
    with nw.watch(policy, on_nan="record") as w:
        for step in range(4):
            obs, next_obs = torch.randn(8, 4), torch.randn(8, 4)
            if step == 3:
                obs[5, 1] = math.nan
            with torch.no_grad():
                target = policy.q_net_target(next_obs).max(-1).values
            loss = (policy.q_net(obs)[:, 0] - target).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    event = w.event
    diagnosis = event.diagnosis
    assert (event.module, event.role, diagnosis.kind) == ("q_net.0", "input[0]", "bad-data")
    # q_net_target(next_obs) ran first: the code between the calls is named beside the data
    assert diagnosis.summary.startswith("The input[0] that module 'q_net' was called with")
    assert "the code between the call of 'q_net_target' and this one" in diagnosis.summary
    assert "The input[0] of module 'q_net'" in diagnosis.evidence[0]
    assert diagnosis.suggestion[0].startswith("Watch module 'q_net' as a model of its own")
    assert any("Guard the data" in fix for fix in diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
def test_adam_with_a_tiny_eps_in_float16_that_writes_nan_gets_the_eps_fix(mode):
    # A feature that is always 0 gives its weights a gradient of 0: Adam's step there is
    # 0 / (0 + eps), and eps=1e-8 is 0 in float16: NaN (next to the Inf of tiny gradients).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    x = torch.randn(16, 8)
    x[:, 7] = 0
    w = train_until_an_event(model, optimizer, x.half(), torch.randn(16, 1).half(), 5, mode)
    event = w.event
    assert (event.batch, event.origin) == (1, "weight") and "nan" in event.kind
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert diagnosis.suggestion[0].startswith("Adam on float16 weights: an eps of 1e-8 (the "
                                              "default of Adam, AdamW and RMSprop) is 0")


def test_sentinel_mode_does_not_claim_which_batch_first_used_an_idle_corrupted_expert():
    # Sentinel mode sees outputs only: it said "batch 2 was the first to use it" of an expert
    # that sat idle in batches 2 and 3. The batch it names is the first it made NaN.
    torch.manual_seed(0)
    model = ExpertsSkippedWhenIdle()
    w = nw.watch(model, mode="sentinel", on_nan="record")
    for batch in range(5):
        if batch == 2:
            with torch.no_grad():
                model.experts[1].weight[0, 0] = math.nan
            model.idle = 1
        if batch == 4:
            model.idle = None
        model(torch.randn(3, 4))
    w.close()
    event = w.event
    assert (event.batch, event.module, event.role) == (4, "experts.1", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert "likely since the optimizer step, load or write after batch 1" in diagnosis.summary
    assert "first to use it" not in diagnosis.summary
    assert "batch 4 is the first whose outputs it made NaN (the batches between had finite " \
        "outputs: they may not have read it)" in diagnosis.summary



@pytest.mark.parametrize("mode", MODES)
def test_an_idle_expert_non_finite_since_before_the_watch_is_not_blamed_on_a_step(mode):
    # An expert loaded NaN (no training, no optimizer) that the router sent no token in batch 0
    # and one in batch 1: full mode said "an optimizer step, a load or a write made it", with
    # "watch with backward=True" and gradient clipping as fixes, where sentinel mode said it was
    # non-finite since the watch began and batch 1 is the first to read it.
    torch.manual_seed(0)
    model = ExpertsSkippedWhenIdle().eval()
    with torch.no_grad():
        model.experts[1].weight[0, 0] = math.nan
    model.idle = 1
    options = {"mode": "sentinel"} if mode == "sentinel" else {}
    w = nw.watch(model, on_nan="record", **options)
    with torch.no_grad():
        for batch in range(3):
            if batch == 2:
                model.idle = None
            model(torch.randn(3, 4))
    w.close()
    event = w.event
    assert (event.batch, event.module, event.role) == (2, "experts.1", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert "since before the watch began; batch 2 is the first to read the bad values" \
        in diagnosis.summary
    assert "optimizer step, a load or a write made it" not in diagnosis.summary
    assert diagnosis.suggestion[0].startswith("It was non-finite before the first batch watched")
    assert all(fix.startswith("In the run that saved it") for fix in diagnosis.suggestion[1:])
    evidence = " ".join(diagnosis.evidence)
    if mode != "sentinel":  # full mode knows why: the module did not run
        assert "did not run 'experts.1' (batches 0, 1: an expert a router sent no token" in evidence
        assert "sentinel mode" not in evidence



class GroupedExperts(nn.Module):
    """Four experts kept in one 3-D weight, as transformers' grouped-GEMM ``experts`` modules
    keep them; top-1 routing by a linear router."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 4)
        self.experts_weight = nn.Parameter(torch.randn(4, 4, 4) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.router(x).argmax(dim=-1)
        return torch.einsum("ti,tio->to", x, self.experts_weight[chosen])


@pytest.mark.parametrize("mode", MODES)
def test_a_corrupted_expert_in_a_3d_experts_weight_is_named_by_its_index(mode):
    # An expert of a mixture that keeps all of them in one 3-D weight went NaN: the event names
    # the whole weight; which expert (the index along dim 0) was nowhere.
    torch.manual_seed(0)
    model = GroupedExperts()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    w = watch(model, mode)
    for batch in range(3):
        x = torch.randn(8, 4)
        if batch == 2:
            with torch.no_grad():
                expert = int(model.router(x[0]).argmax())  # token 0 goes there
                model.experts_weight[expert, 1, 3] = math.inf
                model.experts_weight[expert, 0, 0] = math.nan
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    w.close()
    event = w.event
    assert (event.batch, event.role, event.origin) == (2, "experts_weight", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert f"Its non-finite values lie in experts_weight[{expert}] only: expert {expert} of 4 " \
        "(dim 0 indexes the experts); only the tokens routed to it read them." \
        in diagnosis.evidence


def test_a_non_finite_convolution_weight_is_not_told_as_experts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.ReLU())
    with torch.no_grad():
        model[0].weight[1, 0, 0] = math.nan
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(2, 2, 8))
    assert not any("expert" in line for line in w.event.diagnosis.evidence)



class RoutedTokens(nn.Module):
    """A top-1 mixture of two Linear experts over a (batch, positions, features) input: each
    expert gets the tokens routed to it (``h[tokens]``) and its results go back in place
    (``index_add_``). Feature 0 routes: above 0 to expert 1. Then an ``exp`` after the block."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        with torch.no_grad():
            self.gate.weight.zero_()
            self.gate.weight[:, 0] = torch.tensor([-1.0, 1.0])
            self.experts[1].weight.fill_(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, positions, features = x.shape
        h = x.reshape(-1, features)
        chosen = self.gate(h).argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            tokens = torch.where(chosen == e)[0]
            out.index_add_(0, tokens, expert(h[tokens]))
        return (out.reshape(batch, positions, features) + x).exp()


@pytest.mark.parametrize("mode", MODES)
def test_an_experts_routed_tokens_are_not_told_as_the_batchs_samples(mode):
    # Expert 1 gets tokens 4 and 5 (positions 0 and 1 of sample 1): as many rows as the batch
    # has samples. Token 4 overflowed float16 there, and the diagnosis said "row 0 of the
    # batch's 2 rows (dim 0: its samples)", rows [0]: sample 0, which holds no bad value.
    torch.manual_seed(0)
    model = RoutedTokens().half()
    x = -torch.rand(2, 4, 8) - 0.1
    x[1, :2, 0] = 1.0
    x[1, 0, 1:] = 100.0
    with watch(model, mode) as w:
        model(x.half())
    event = w.event
    assert (event.module, event.role) == ("experts.1", "output")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "overflow"
    assert diagnosis.rows == []
    assert "in row 0" not in diagnosis.summary
    assert not any("dim 0: its samples" in line for line in diagnosis.evidence)


@pytest.mark.parametrize("mode", MODES)
def test_rows_after_a_mixture_of_experts_block_are_still_the_samples(mode):
    # The experts' results went back in place: an exp that overflows in sample 1 after the
    # block still names row 1.
    torch.manual_seed(0)
    model = RoutedTokens()
    with torch.no_grad():
        model.experts[1].weight.fill_(0.1)
    x = -torch.rand(2, 4, 8) - 0.1
    x[1, 2, 3] = 30.0  # exp(30) passes float16's largest
    with watch(model.half(), mode) as w:
        model(x.half())
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("overflow", [1])


# ------------------------------------------------------- optimizers and optimizer wrappers
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("on_nan", ["raise", "record"])
def test_an_lbfgs_step_with_a_nan_learning_rate_names_the_lr(mode, on_nan):
    # LBFGS refuses lr=nan when made; a scheduler (or a write) sets it later. The step writes
    # NaN into every weight, and its next closure call (a forward inside the step, before the
    # post-step hook marks anything) meets them. It was a write "after batch 0" with gradient
    # clipping advice; the lr went unread.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    optimizer.param_groups[0]["lr"] = math.nan

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    options = {"mode": "sentinel"} if mode == "sentinel" else {}
    w = nw.watch(model, on_nan=on_nan, **options)
    try:
        with contextlib.suppress(nw.NanDetected):
            optimizer.step(closure)
        event = w.event
        diagnosis = event.diagnosis
    finally:
        w.close()
    assert (event.batch, event.origin, diagnosis.kind, diagnosis.confidence) == \
        (1, "weight", "corrupted-weight", "high")
    assert "in the LBFGS step after batch 0, which ran with a non-finite learning rate " \
        "(lr=nan)" in diagnosis.summary
    assert diagnosis.suggestion[0].startswith("Find what set the learning rate to nan: ")
    assert not any("clip" in fix or "backward=True" in fix for fix in diagnosis.suggestion)


class _Sam(torch.optim.Optimizer):
    """Sharpness-aware minimization as it is usually written (davda54/sam): first_step climbs
    to w + rho * g / |g|, second_step comes back and lets the base optimizer step."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = torch.norm(torch.stack([p.grad.norm(p=2) for group in self.param_groups
                                            for p in group["params"] if p.grad is not None]))
        for group in self.param_groups:
            scale = group["rho"] / grad_norm
            for p in group["params"]:
                if p.grad is None:
                    continue
                e_w = p.grad * scale.to(p)
                p.add_(e_w)
                self.state[p]["e_w"] = e_w
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(self.state[p]["e_w"])
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure):
        self.first_step(zero_grad=True)
        torch.enable_grad()(closure)()
        self.second_step()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", ["two steps", "closure"])
def test_a_sam_first_step_with_a_zero_gradient_norm_is_told_as_written_outside_the_step(
        mode, form):
    # A batch whose loss is zero (its targets are the model's own outputs) gives every
    # gradient 0: SAM's first_step writes rho * 0 / 0 = NaN into the weights, outside any torch
    # optimizer step. It was told as "the optimizer step, load or write" with clipping advice.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    optimizer = _Sam(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1)
    with watch(model, mode) as w:
        for step in range(5):
            target = model(x).detach() if step == 3 else y
            nn.functional.mse_loss(model(x), target).backward()
            if form == "closure":  # sam.step(closure): the closure's forward is inside it
                optimizer.step(lambda: nn.functional.mse_loss(model(x), target).backward())
                optimizer.zero_grad()
                continue
            optimizer.first_step(zero_grad=True)
            nn.functional.mse_loss(model(x), target).backward()
            optimizer.second_step(zero_grad=True)
            if w.events:
                break
    event = w.event
    diagnosis = event.diagnosis
    assert (event.batch, event.origin, diagnosis.kind, diagnosis.confidence) == \
        (8, "weight", "corrupted-weight", "high")
    assert "'0.weight', '0.bias' became NaN after batch 7, written outside optimizer.step(): " \
        "by the SAM first step" in diagnosis.summary
    assert "no torch optimizer step wrote them since" in "\n".join(diagnosis.evidence)
    assert "(grad_norm + 1e-12)" in diagnosis.suggestion[0]
    assert not any("clip" in fix for fix in diagnosis.suggestion)


class _Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al. 2019) as it is usually written: slow weights in
    self.state[p]['slow'], pulled toward the fast ones and copied back every k steps."""

    def __init__(self, optimizer, k=3, alpha=0.5):
        self.optimizer, self.k, self.alpha, self.steps = optimizer, k, alpha, 0
        super().__init__(optimizer.param_groups, dict(k=k, alpha=alpha))
        self.param_groups = optimizer.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.steps += 1
        if self.steps % self.k == 0:
            for group in self.param_groups:
                for p in group["params"]:
                    slow = self.state[p].setdefault("slow", p.detach().clone())
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss


@pytest.mark.parametrize("mode", MODES)
def test_lookahead_slow_weights_that_hold_nan_are_named(mode):
    # The slow weights of the first layer come from a checkpoint that held NaN: the third
    # step copies them into the weight. It was told as a step's write with gradient clipping
    # advice; the gradients were finite.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    optimizer = _Lookahead(torch.optim.Adam(model.parameters(), lr=1e-2), k=3)
    optimizer.state[model[0].weight]["slow"] = torch.full_like(model[0].weight, math.nan)
    with watch(model, mode) as w:
        for _ in range(5):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if w.events:
                break
    event = w.event
    diagnosis = event.diagnosis
    assert (event.batch, event.origin, diagnosis.kind, diagnosis.confidence) == \
        (3, "weight", "corrupted-weight", "high")
    assert "'0.weight' became NaN after batch 2 from the optimizer state " \
        "_Lookahead.state[p]['slow'], which is NaN" in diagnosis.summary
    assert not any("clip" in fix or "backward=True" in fix for fix in diagnosis.suggestion)


def test_lookahead_slow_weights_made_nan_by_a_nan_gradient_are_not_blamed():
    # The third step's loss is NaN: Adam writes NaN into the weights and its own moments, and
    # Lookahead's slow weights follow them. The NaN came with the gradient, not from the slow
    # weights: they are not named.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    optimizer = _Lookahead(torch.optim.Adam(model.parameters(), lr=1e-2), k=3)
    with watch(model, "full") as w:
        for step in range(5):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            (loss * math.nan if step == 2 else loss).backward()
            optimizer.step()
            if w.events:
                break
    diagnosis = w.event.diagnosis
    assert (w.event.batch, diagnosis.kind) == (3, "corrupted-weight")
    assert "state[p]" not in diagnosis.summary


@pytest.mark.parametrize("backward", [False, True])
def test_a_nan_made_by_a_loss_the_model_holds_after_its_forward_is_that_steps_and_the_losss(
        backward):
    # A loss held as a submodule, run on the output in a hand loop without set_batch(): its NaN
    # was "batch 3" for the step of batch 2, and "unknown: what made it could not be told" (the
    # replay reruns the forward only, which does not run the loss).
    torch.manual_seed(0)
    model = HoldsItsLoss()
    targets = torch.eye(3)[torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nw.watch(model, backward=backward) as w:  # on_nan="raise"
        for batch in range(3):
            # batch 2's softmax underflows to exact zeros, and 0 * log(0) is NaN
            out = model(torch.randn(8, 4) * (1e4 if batch == 2 else 1.0))
            if batch < 2:
                model.loss(out, targets).backward()
                optimizer.step()
                continue
            with pytest.raises(nw.NanDetected):
                model.loss(out, targets)
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.module, event.role, event.is_backward) == (2, "loss", "output",
                                                                          False)
    assert diagnosis.kind == "loss"
    assert diagnosis.summary.startswith("Made in the loss 'loss' (LogLikelihood) that the model "
                                        "holds and runs on its output after its forward: its "
                                        "output became NaN in batch 2 from finite inputs")
    assert "Its input[0] held exact zeros" in diagnosis.summary
    said = " ".join(diagnosis.evidence + diagnosis.suggestion)
    assert "stayed finite" not in said  # nothing after the loss absorbed it
    assert "ref_model" not in said  # what it was given was finite: it read nothing bad
    assert "F.log_softmax" in said and "w.replay(2, loss_fn=lambda out: model.loss(out, " \
        "targets))" in said
    assert w.frames().query("module == 'loss'").batch.unique().tolist() == [0, 1, 2]


def test_the_gradient_of_a_loss_the_model_holds_that_made_a_nan_is_told_as_its_forwards():
    torch.manual_seed(0)
    model = HoldsItsLoss()
    targets = torch.eye(3)[torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])]
    with watch(model, "full", backward=True) as w:
        for batch in range(3):
            out = model(torch.randn(8, 4) * (1e4 if batch == 2 else 1.0))
            model.loss(out, targets).backward()
    forward, backward = w.events
    assert (backward.batch, backward.module, backward.is_backward) == (2, "loss", True)
    assert backward.diagnosis.kind == "loss"
    assert backward.diagnosis.summary.startswith("The gradient of batch 2 is NaN and Inf "
                                                 "because its forward already was (the event "
                                                 "at module 'loss' (LogLikelihood), output)")


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.head = nn.Linear(8, 12)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens)).log_softmax(-1)


def _sequence_logps(logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logps[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1).sum(-1)


@pytest.mark.parametrize("mode", MODES)
def test_a_dpo_loss_reading_a_nan_reference_model_suggests_watching_that_model(mode):
    # DPO by hand, as TRL computes it: the policy's log-ratio against a frozen reference copy.
    # The reference model (not watched) holds a NaN weight, so its log-probs are NaN and the
    # loss's gradient reaches the policy's output NaN: "loss", and the fixes must not be only
    # about stable losses, since no op of the loss made it.
    policy = TinyLM()
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        reference.head.weight[0, 0] = math.nan
    chosen, rejected = torch.randint(0, 12, (4, 6)), torch.randint(0, 12, (4, 6))
    with watch(policy, mode, backward=True) as w:
        with torch.no_grad():
            ref_chosen = _sequence_logps(reference(chosen), chosen)
            ref_rejected = _sequence_logps(reference(rejected), rejected)
        logits = 0.1 * ((_sequence_logps(policy(chosen), chosen) - ref_chosen)
                        - (_sequence_logps(policy(rejected), rejected) - ref_rejected))
        (-nn.functional.logsigmoid(logits)).mean().backward()
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "loss"
    assert any("reference" in fix and "nw.watch(ref_model)" in fix
               for fix in diagnosis.suggestion), diagnosis.suggestion


def test_every_text_a_training_wrappers_words_replace_is_one_that_a_fix_says():
    # in_wrapper_terms rewrites fixes by their text: a fix reworded here must not silently keep
    # torch.autocast / clip_grad_norm_ words for a model that Lightning Fabric or skorch runs.
    from nanwidget.core.diagnosis import fixes
    said = " ".join(
        fixes.overflow("m", "float16", "", "addmm") + fixes.divergence("float16")
        + fixes.weight_gradient_overflow("m", "float16")
        + fixes.scaled_gradient_overflow(batch=3, scale=512.0, module="m", at_output=False,
                                         output_near_limit="", stepped_before=True,
                                         op_known=False)
        + fixes.cast_to_float16(["m.weight"])
        + fixes.corrupted_weight(["m.weight"], "float16", 3, False)
        + fixes.corrupted_weight(["m.weight"], "float32", None, False, before_watch=True))
    for plain, theirs in (fixes.FABRIC_TERMS + fixes.SKORCH_TERMS + fixes.LIGHTNING_TERMS
                          + fixes.LIGHTNING_MANUAL_TERMS + fixes.TIMM_TERMS
                          + fixes.ST_FIT_TERMS):
        assert plain in said, plain
    # timm's NativeScaler clips inside loss_scaler(...) and manages the loss scale already.
    worded = fixes.in_wrapper_terms(fixes.divergence("float16"), "timm")
    assert not any("clip_grad_norm_" in fix or "torch.amp.GradScaler" in fix for fix in worded)
    assert any("clip_grad=1.0" in fix for fix in worded), worded
    # sentence-transformers' model.fit takes its own keywords, not TrainingArguments.
    worded = fixes.in_wrapper_terms(fixes.divergence("float16")
                                    + fixes.corrupted_weight(["m.weight"], "float16", 3, False),
                                    "st-fit")
    assert not any("clip_grad_norm_" in fix or "TrainingArguments" in fix
                   or "torch.amp.GradScaler" in fix for fix in worded), worded
    worded = fixes.in_wrapper_terms(fixes.divergence("float16")
                                   + fixes.overflow("m", "float16", "", "addmm"), "fabric")
    assert not any("clip_grad_norm_" in fix or "dtype=torch.bfloat16" in fix for fix in worded)
    for wrapper in ("lightning", "lightning-manual"):
        worded = fixes.in_wrapper_terms(fixes.divergence("float16")
                                        + fixes.overflow("m", "float16", "", "addmm"), wrapper)
        assert not any("clip_grad_norm_" in fix or "dtype=torch.bfloat16" in fix
                       or "torch.amp.GradScaler" in fix for fix in worded), worded
    # Stable-Baselines3's words: for the data's fixes and the untraced loss's too.
    data_and_loss = fixes.bad_data(["input[0]"], [0]) + fixes.loss(3, "mul", traced=False)
    for plain, _ in fixes.SB3_TERMS:
        assert plain in said + " ".join(data_and_loss), plain
    for begins, _ in fixes.SB3_WHOLE_FIXES:
        assert any(fix.startswith(begins) for fix in data_and_loss), begins
    worded = fixes.in_wrapper_terms(fixes.divergence("float32") + data_and_loss, "sb3")
    assert not any("clip_grad_norm_" in fix or "collate_fn" in fix or "loss_fn=" in fix
                   for fix in worded)


class LeftPaddedDecoder(nn.Module):
    """Causal self-attention over a left-padded batch, masked with -inf, then an output
    projection: the padding positions of a padded row see no key at all."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        keep = causal[None] & attention_mask[:, None, :].bool()
        scores = (q @ k.transpose(-1, -2)).masked_fill(~keep, -math.inf)
        return self.out(torch.softmax(scores, dim=-1) @ v)


@pytest.mark.parametrize("mode", MODES)
def test_a_left_padded_row_under_a_causal_mask_is_a_masked_row_that_names_its_row(mode):
    # No sequence is all padding, and the NaN reaches the output projection first: the
    # masked-row diagnosis named no row (its fixes said "check the rows named here") and
    # told to drop sequences that are all padding.
    torch.manual_seed(0)
    model = LeftPaddedDecoder()
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with watch(model, mode) as w:
        model(torch.randn(3, 5, 8), attention_mask=mask)
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.module, event.role) == ("out", "input[0]")
    assert (diagnosis.kind, diagnosis.rows) == ("masked-row", [1])
    assert "in row 1 of the batch's 3 rows" in " ".join(diagnosis.evidence)
    assert "kwarg:attention_mask is 0 at the first 2 positions of row 1 (left padding)" in \
        " ".join(diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith(
        f"Fill the mask of the softmax at {line_of(LeftPaddedDecoder.forward, 'torch.softmax')}"
        " with torch.finfo(scores.dtype).min")
    assert not any("all padding" in fix for fix in diagnosis.suggestion)


class RecurrentStep(nn.Module):
    """One step of a recurrent model: takes the hidden state it returned the step before."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.fc(torch.log(x)) + hidden)
        return self.head(hidden), hidden


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_the_model_carries_over_in_its_hidden_state_is_told_as_the_first_steps(mode):
    # Step 0's log of a negative value left row 1 of the hidden state NaN; each later step's
    # event read it back and was "bad-data: it came with the data, not from the model".
    torch.manual_seed(0)
    model = RecurrentStep()
    with watch(model, mode) as w, torch.no_grad():
        hidden = torch.zeros(3, 4)
        for step in range(3):
            x = torch.rand(3, 4) + 0.5
            if step == 0:
                x[1, 2] = -1.0
            _, hidden = model(x, hidden=hidden)
    first, later = w.events[0].diagnosis, w.events[2].diagnosis
    assert (first.kind, first.rows) == ("domain", [1])
    assert (later.kind, later.rows) == ("domain", [1])
    assert later.summary.startswith(
        "The batch's kwarg:hidden holds NaN in row 1 that the model's own earlier steps wrote "
        "into the state it carries over (a KV cache, a hidden state), since batch 0: log in "
        "module '<root>'")
    assert "came with the data" not in later.summary
    assert later.evidence[0].startswith("Each of batches 0 to 1 made an event, the first at "
                                        "module 'fc' (Linear), input[0]")
    assert later.suggestion == first.suggestion


def test_nan_data_in_a_hidden_state_after_finite_steps_is_still_bad_data():
    # The state is carried only when the steps before it made events.
    torch.manual_seed(0)
    model = RecurrentStep()
    with watch(model, "full") as w, torch.no_grad():
        model(torch.rand(3, 4) + 0.5, hidden=torch.zeros(3, 4))
        hidden = torch.zeros(3, 4)
        hidden[2, 0] = math.nan
        model(torch.rand(3, 4) + 0.5, hidden=hidden)
    diagnosis = w.event.diagnosis
    assert (w.event.batch, diagnosis.kind, diagnosis.rows) == (1, "bad-data", [2])
    assert diagnosis.summary.startswith("The batch's kwarg:hidden holds NaN in row 2: it came "
                                        "with the data")


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_loaded_nan_before_the_first_batch_watched_leads_with_the_load(mode):
    # A checkpoint with a NaN weight, loaded, then watched: the first batch's event said "holds
    # NaN before batch 0 ran (an optimizer step, a load or a write made it)", an optimizer step
    # first, although no step ran under the watch; the load comes first now.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["0.weight"][3, 1] = math.nan
    model.load_state_dict(state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, mode) as w:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
    diagnosis = w.event.diagnosis
    assert w.event.batch == 0 and diagnosis.kind == "corrupted-weight"
    assert diagnosis.summary == ("'0.weight' holds NaN when the watch began, before batch 0 ran "
                                 "(a checkpoint loaded, a write, or a training step before the "
                                 "watch made it), not this batch's forward.")


def _mlp_at_a_learning_rate_too_high(amp: bool):
    """SGD at lr=3 on a ReLU MLP (float32 weights; the forward under bfloat16 autocast when
    ``amp``) until the watch stops it: its diverged event."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=3.0)
    data = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(), nw.watch(model, on_nan="record") as watch:
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        for _ in range(50):
            x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                out = model(x)
            if watch.events:
                break
            loss = nn.functional.mse_loss(out.float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return watch.event


def test_a_float32_run_that_diverged_gets_no_amp_fix():
    # No float16, bfloat16, autocast or GradScaler anywhere: the fixes said 'Under AMP, let
    # torch.amp.GradScaler manage the loss scale ...; a fixed large scale diverges.'
    diagnosis = _mlp_at_a_learning_rate_too_high(amp=False).diagnosis
    assert diagnosis.kind == "divergence", diagnosis.summary
    fixes = " ".join(diagnosis.suggestion)
    for amp_word in ("GradScaler", "AMP", "autocast", "float16"):
        assert amp_word not in fixes, fixes
    assert diagnosis.suggestion[0].startswith("Lower the learning rate")
    assert any(fix.startswith("Clip the gradients before the step") for fix in
               diagnosis.suggestion)


def test_a_run_under_bfloat16_autocast_that_diverged_keeps_the_amp_fix():
    diagnosis = _mlp_at_a_learning_rate_too_high(amp=True).diagnosis
    assert diagnosis.kind == "divergence", diagnosis.summary
    assert any(fix.startswith("Under AMP, let torch.amp.GradScaler manage the loss scale")
               for fix in diagnosis.suggestion), diagnosis.suggestion


def test_every_text_the_precision_and_dp_rewordings_replace_is_one_that_a_fix_says():
    # in_full_precision and in_dp_terms rewrite fixes by their text, as in_wrapper_terms does:
    # a fix reworded must not silently keep AMP's or clip_grad_norm_'s words.
    from nanwidget.core.diagnosis import fixes
    plain = (fixes.divergence("float32") + fixes.corrupted_weight(["m.weight"], "float32", 3, False)
             + fixes.corrupted_weight(["m.weight"], "float32", None, False, before_watch=True))
    assert any("GradScaler" in fix for fix in plain)
    assert not any("GradScaler" in fix for fix in fixes.in_full_precision(plain))
    for kind in ("divergence", "corrupted-weight"):
        worded = fixes.in_dp_terms(plain, kind, 1.0, 1.1)
        assert not any(fix.startswith(("Clip the gradients", "In the run that saved it: clip"))
                       for fix in worded), worded
        assert sum("Opacus' DPOptimizer clips each sample's gradient" in fix
                   for fix in worded) == 1, worded
    trainer = fixes.in_wrapper_terms(fixes.divergence("float32"), "trainer")
    assert not any("GradScaler" in fix for fix in fixes.in_full_precision(trainer)), trainer


def test_a_float16_weight_gradient_overflow_under_fsdp2_s_policy_names_the_policy():
    # Under MixedPrecisionPolicy(param_dtype=torch.float16) a weight's gradient overflow was
    # told to wrap the module in torch.autocast(enabled=False) and to use a GradScaler, in a
    # run with no autocast (the forward overflow's fixes name the policy already).
    from nanwidget.core.diagnosis import fixes
    told = " ".join(fixes.weight_gradient_overflow("0", "float16", 10.0, 3e4,
                                                   policy_dtype="float16"))
    assert "autocast" not in told and "GradScaler" not in told, told
    assert "MixedPrecisionPolicy(param_dtype=torch.float16) computes its gradients" in told
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in told
    assert "torch.autocast(device_type, enabled=False)" in " ".join(
        fixes.weight_gradient_overflow("0", "float16", 10.0, 3e4))


# ---------------------------------------------------------------- a loss outside the model
def _regression(lr: float, inf_target_at: int | None = None):
    """Two Linear layers, SGD, MSE: at lr=0.1 the weights climb until the MSE of the (still
    finite) outputs overflows to inf at batch 5; at lr=0.01 they stay put."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=generator) * 3
    y = torch.randn(256, 1, generator=generator) * 3
    if inf_target_at is not None:
        y[inf_target_at] = math.inf
    return model, torch.optim.SGD(model.parameters(), lr=lr), x.split(8), y.split(8)


def _first_non_finite_loss(watch, model, optimizer, xs, ys, scaler=None):
    for x, y in zip(xs, ys):
        loss = nn.functional.mse_loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()               # raises at an inf loss
            scaler.step(optimizer)
            scaler.update()
        elif not torch.isfinite(loss):                  # the user's own check
            return loss
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
    raise AssertionError("the loss stayed finite")


@pytest.mark.parametrize("mode", MODES)
def test_explain_loss_tells_a_loss_that_overflowed_as_the_weights_climbed_a_divergence(mode):
    # The watch saw no event (every output finite) and had nothing to say of the inf loss.
    model, optimizer, xs, ys = _regression(lr=0.1)
    with nw.watch(model, mode=mode) as watch:
        loss = _first_non_finite_loss(watch, model, optimizer, xs, ys)
        event = watch.explain_loss(loss)
        assert watch.explain_loss(torch.tensor(2.5)) is None           # a finite loss: nothing
    assert watch.events == []                                          # not recorded
    assert (event.batch, event.module, event.role, event.kind, event.origin) == (
        5, "", "loss", "inf", "output")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "divergence"
    assert diagnosis.summary.startswith("Training diverged: the weights grew ")
    assert "until the loss computed from the model's outputs became inf at batch 5 (the " \
           "outputs themselves were still finite)." in diagnosis.summary
    assert any(line.startswith("The loss of batch 5 was inf, while the model's outputs it was "
                               "computed from were finite (abs max ")
               for line in diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith("Lower the learning rate")
    assert not any("GradScaler" in fix for fix in diagnosis.suggestion)   # float32 throughout
    assert diagnosis.confidence == ("high" if mode == "full" else "medium")


@pytest.mark.parametrize("mode", MODES)
def test_explain_loss_tells_an_inf_target_with_steady_weights_a_loss(mode):
    model, optimizer, xs, ys = _regression(lr=0.01, inf_target_at=5 * 8 + 2)
    with nw.watch(model, mode=mode) as watch:
        event = watch.explain_loss(_first_non_finite_loss(watch, model, optimizer, xs, ys))
    assert event.batch == 5 and event.diagnosis.kind == "loss"
    assert event.diagnosis.summary == (
        "Made in the loss, outside the model: the loss of batch 5 was inf, while the model's "
        "outputs were finite; no op of the model made it.")
    assert any("targets" in fix for fix in event.diagnosis.suggestion)
    assert not any("learning rate" in fix for fix in event.diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
def test_explain_loss_of_an_mse_leads_with_its_targets_not_log_probability_fixes(mode):
    # An MSE regression with an Inf target led with "watch with loss_fn=" and got the fixes of
    # a log of probabilities (BCEWithLogitsLoss, log_softmax, clamp probabilities); the targets
    # came last. The loss's grad_fn (MseLossBackward0) tells torch's mse_loss made it.
    model, optimizer, xs, ys = _regression(lr=0.01, inf_target_at=5 * 8 + 2)
    with nw.watch(model, mode=mode) as watch:
        diagnosis = watch.explain_loss(
            _first_non_finite_loss(watch, model, optimizer, xs, ys)).diagnosis
    assert diagnosis.kind == "loss"
    assert "The loss's grad_fn is MseLossBackward0: torch's mse_loss made it." \
        in diagnosis.evidence
    assert diagnosis.suggestion[0].startswith("Check the targets: mse_loss of the model's finite "
                                              "outputs is NaN/Inf when a target is.")
    assert diagnosis.suggestion[-1].startswith("Name the loss's op and line: watch with loss_fn=")
    said = " ".join(diagnosis.suggestion)
    assert not any(fix in said for fix in ("BCEWithLogits", "log_softmax", "Clamp probabilities"))


@pytest.mark.parametrize("mode", MODES)
def test_explain_loss_given_the_targets_names_their_inf_rows_first(mode):
    model, optimizer, xs, ys = _regression(lr=0.01, inf_target_at=5 * 8 + 2)
    with nw.watch(model, mode=mode) as watch:
        event = watch.explain_loss(_first_non_finite_loss(watch, model, optimizer, xs, ys),
                                   target=ys[5])
    diagnosis = event.diagnosis
    assert (diagnosis.kind, diagnosis.rows, diagnosis.confidence) == ("loss", [2], "high")
    assert diagnosis.summary.endswith("no op of the model made it. Its targets held an Inf in "
                                      "row 2.")
    assert diagnosis.suggestion[0].startswith("Fix the targets: they held an Inf in row 2, and "
                                              "mse_loss of finite outputs against a non-finite "
                                              "target is NaN/Inf.")
    assert not any("Check the targets" in fix or "squared difference" in fix
                   for fix in diagnosis.suggestion)
    with nw.watch(model) as watch, pytest.raises(TypeError, match="target= takes the targets"):
        watch.explain_loss(float("inf"), target=[1.0])


def test_explain_loss_given_finite_targets_still_tells_a_divergence():
    model, optimizer, xs, ys = _regression(lr=0.1)
    with nw.watch(model) as watch:
        loss = _first_non_finite_loss(watch, model, optimizer, xs, ys)
        diagnosis = watch.explain_loss(loss, target=ys[5]).diagnosis
    assert diagnosis.kind == "divergence" and "The targets given were finite." in diagnosis.evidence


@pytest.mark.parametrize("mode", MODES)
def test_explain_loss_of_nll_over_a_log_of_zero_probabilities_leads_with_log_softmax(mode):
    # nll_loss(torch.log(probs)) over a softmax output that underflowed to 0: the fixes led
    # with "watch with loss_fn=".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Softmax(-1))
    with torch.no_grad():
        model[0].weight.mul_(200)
    x, labels = torch.randn(6, 4), torch.randint(0, 8, (6,))
    with nw.watch(model, mode=mode) as watch:
        loss = nn.functional.nll_loss(torch.log(model(x)), labels)
        diagnosis = watch.explain_loss(loss, target=labels).diagnosis
    assert diagnosis.kind == "loss" and "The targets given were finite." in diagnosis.evidence
    assert diagnosis.suggestion[0].startswith("nll_loss takes log-probabilities: a log of a "
                                              "probability of 0 is -inf. Pass F.log_softmax(")
    assert not any("0/0" in fix or "Check the targets" in fix for fix in diagnosis.suggestion)


def test_a_grad_scalers_inf_loss_after_a_climb_is_a_divergence_not_an_unreproduced_unknown():
    # The loss handed to scaler.scale() was an event diagnosed 'unknown: the replay did not
    # reproduce it' (the replay runs the forward only, whose outputs were finite).
    model, optimizer, xs, ys = _regression(lr=0.1)
    with nw.watch(model, grad_scaler=torch.amp.GradScaler("cpu")) as watch:
        with pytest.raises(nw.NanDetected) as caught:
            _first_non_finite_loss(watch, model, optimizer, xs, ys,
                                   scaler=watch.options.grad_scaler)
    event = caught.value.event
    assert (event.batch, event.role) == (5, "loss")
    assert event.diagnosis.kind == "divergence"
    assert not any("replay did not reproduce" in line for line in event.diagnosis.evidence)


def test_explain_loss_refuses_what_is_no_loss_and_passes_over_values_it_cannot_read() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with nw.watch(model) as watch:
        model(torch.randn(3, 4))
        with pytest.raises(TypeError, match="explain_loss takes the loss"):
            watch.explain_loss("inf")
        assert watch.explain_loss(torch.empty(3, device="meta")) is None
        assert watch.explain_loss(torch.tensor(3)) is None  # an integer holds no NaN/Inf
        assert watch.explain_loss(1.5) is None
        assert watch.explain_loss(float("inf")).kind == "inf"

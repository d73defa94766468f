"""nanwidget on normalizing flows and density models: an affine coupling flow (RealNVP), a
rational-quadratic spline coupling, a logit-transformed image flow and a mixture density
network, written in plain torch; zuko's flows when it is installed. Training one is bit for bit
the same watched; the NaN/Inf they make (a log-scale whose exp overflows, data at 0 or 1 before
a logit, a spline's bin that collapsed) is diagnosed with the fix a flow's author uses."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributions as D
import torch.nn.functional as F
from torch import nn

import nanwidget as nw

MODES = ["full", "sentinel"]


def watch(model: nn.Module, mode: str, **options) -> nw.NanWatch:
    if mode == "sentinel":
        options["mode"] = "sentinel"
    return nw.watch(model, on_nan="record", backward=True, **options)


def moons(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * math.pi
    upper = torch.rand(n, generator=g) < 0.5
    x = torch.where(upper, torch.cos(t), 1 - torch.cos(t))
    y = torch.where(upper, torch.sin(t), 0.5 - torch.sin(t))
    return torch.stack([x, y], 1) + 0.05 * torch.randn(n, 2, generator=g)


class Coupling(nn.Module):
    """RealNVP's affine coupling; ``soft_clamp=False`` leaves the log-scale unbounded."""

    def __init__(self, mask: torch.Tensor, soft_clamp: bool = True) -> None:
        super().__init__()
        self.register_buffer("mask", mask)
        self.net = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4))
        self.soft_clamp = soft_clamp

    def scale_shift(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, t = self.net(x * self.mask).chunk(2, -1)
        s = torch.tanh(s) if self.soft_clamp else s
        return s * (1 - self.mask), t * (1 - self.mask)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, t = self.scale_shift(x)
        z = x * self.mask + (1 - self.mask) * (x * torch.exp(s) + t)
        return z, s.sum(-1)

    def inverse(self, z: torch.Tensor) -> torch.Tensor:
        s, t = self.scale_shift(z)
        return z * self.mask + (1 - self.mask) * ((z - t) * torch.exp(-s))


class RealNVP(nn.Module):
    def __init__(self, soft_clamp: bool = True) -> None:
        super().__init__()
        masks = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])] * 2
        self.layers = nn.ModuleList(Coupling(m, soft_clamp) for m in masks)
        self.base = D.Independent(D.Normal(torch.zeros(2), torch.ones(2)), 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logdet = x.new_zeros(x.shape[0])
        for layer in self.layers:
            x, ld = layer(x)
            logdet = logdet + ld
        return x, logdet

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        z, logdet = self(x)
        return self.base.log_prob(z) + logdet

    def inverse(self, z: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            z = layer.inverse(z)
        return z

    def sample(self, n: int) -> torch.Tensor:
        return self.inverse(self.base.sample((n,)))


def rq_spline(x, w, h, d, bound=3.0, min_bin=1e-3):
    """A monotone rational-quadratic spline on [-bound, bound] (Durkan et al. 2019), identity
    outside; ``min_bin=0`` lets a bin collapse."""
    k = w.shape[-1]
    w = min_bin + (1 - min_bin * k) * F.softmax(w, -1)
    h = min_bin + (1 - min_bin * k) * F.softmax(h, -1)
    d = F.pad(1e-3 + F.softplus(d), (1, 1), value=1.0)
    cw = F.pad(torch.cumsum(w, -1), (1, 0)) * 2 * bound - bound
    ch = F.pad(torch.cumsum(h, -1), (1, 0)) * 2 * bound - bound
    w, h = cw[..., 1:] - cw[..., :-1], ch[..., 1:] - ch[..., :-1]
    inside = (x > -bound) & (x < bound)
    xc = x.clamp(-bound, bound)
    i = torch.searchsorted(cw[..., 1:].contiguous(), xc[..., None]).clamp(max=k - 1)
    pick = lambda t: t.gather(-1, i)[..., 0]  # noqa: E731
    xk, wk, yk, hk, dk, dk1 = (pick(cw[..., :-1]), pick(w), pick(ch[..., :-1]), pick(h),
                               pick(d[..., :-1]), pick(d[..., 1:]))
    sk, th = hk / wk, (xc - xk) / wk
    tt = th * (1 - th)
    den = sk + (dk1 + dk - 2 * sk) * tt
    y = yk + hk * (sk * th ** 2 + dk * tt) / den
    derivative_numerator = sk ** 2 * (dk1 * th ** 2 + 2 * sk * tt + dk * (1 - th) ** 2)
    ld = torch.log(derivative_numerator) - 2 * torch.log(den)
    return torch.where(inside, y, x), torch.where(inside, ld, torch.zeros_like(ld))


class SplineFlow(nn.Module):
    """One neural-spline coupling on 2-D data: x0 conditions the spline of x1."""

    def __init__(self, bins: int = 8, min_bin: float = 1e-3) -> None:
        super().__init__()
        self.bins, self.min_bin = bins, min_bin
        self.net = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 3 * bins - 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p, k = self.net(x[:, :1]), self.bins
        y, ld = rq_spline(x[:, 1], p[:, :k], p[:, k:2 * k], p[:, 2 * k:], min_bin=self.min_bin)
        return torch.stack([x[:, 0], y], 1), ld

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        z, ld = self(x)
        return D.Normal(0.0, 1.0).log_prob(z).sum(-1) + ld


class LogitFlow(nn.Module):
    """An image flow on dequantized [0, 1] pixels: logit with RealNVP's alpha squeeze, then an
    affine coupling. ``alpha=0`` is the logit without it."""

    def __init__(self, dim: int = 8, alpha: float = 0.05) -> None:
        super().__init__()
        self.alpha = alpha
        self.net = nn.Sequential(nn.Linear(dim // 2, 16), nn.ReLU(), nn.Linear(16, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.alpha + (1 - 2 * self.alpha) * x
        y = torch.log(x) - torch.log1p(-x)
        logdet = (-torch.log(x) - torch.log1p(-x)).sum(-1) + x.shape[-1] * math.log(
            1 - 2 * self.alpha)
        a, b = y.chunk(2, -1)
        s, t = self.net(a).chunk(2, -1)
        s = torch.tanh(s)
        return torch.cat([a, b * torch.exp(s) + t], -1), logdet + s.sum(-1)

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        z, logdet = self(x)
        return D.Normal(0.0, 1.0).log_prob(z).sum(-1) + logdet


def pixels(n: int = 16, dim: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, dim), generator=g).float()
    return (q + torch.rand(n, dim, generator=g)) / 256  # uniform dequantization


class MDN(nn.Module):
    """A mixture density network: returns a torch.distributions object."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 9))

    def forward(self, x: torch.Tensor) -> D.Distribution:
        logits, mu, raw = self.net(x).chunk(3, -1)
        return D.MixtureSameFamily(D.Categorical(logits=logits),
                                   D.Normal(mu, F.softplus(raw) + 1e-3))


def train(model: nn.Module, loss_of, steps: int = 4) -> list[torch.Tensor]:
    """Adam on the negative log-likelihood; everything a run gives back."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_of(model)
        loss.backward()
        seen += [loss.detach().clone()] + [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return seen + [p.detach().clone() for p in model.parameters()]


def healthy_runs():
    x = torch.rand(32, 1, generator=torch.Generator().manual_seed(1)) * 2 - 1
    y = torch.sin(3 * x[:, 0])
    return {
        "realnvp": (RealNVP, lambda m: -m.log_prob(moons(64)).mean(),
                    lambda m: [m.sample(8), m.inverse(torch.randn(4, 2))]),
        "spline": (SplineFlow, lambda m: -m.log_prob(moons(64)).mean(), lambda m: []),
        "logit": (LogitFlow, lambda m: -m.log_prob(pixels()).mean(), lambda m: []),
        "mdn": (MDN, lambda m: -m(x).log_prob(y).mean(), lambda m: [m(x).sample((2,))]),
    }


@pytest.mark.parametrize("name", ["realnvp", "spline", "logit", "mdn"])
@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}, {"backward": True},
                                     {"mode": "sentinel", "backward": True}],
                         ids=["full", "sentinel", "full-backward", "sentinel-backward"])
def test_a_healthy_flow_trains_the_same_watched_and_quietly(name, options, recwarn):
    make, loss_of, afterwards = healthy_runs()[name]

    def run(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = make()
        w = nw.watch(model, **options) if watched else None
        seen = train(model, loss_of)
        with torch.no_grad():  # sampling and the inverse pass, called outside forward
            seen += afterwards(model) + [torch.random.get_rng_state()]
        if w is not None:
            assert not w.events and not w.warnings
            w.close()
            assert all(not m._forward_hooks and not m._forward_pre_hooks
                       and not m._backward_hooks for m in model.modules())
        return seen

    plain, watched = run(False), run(True)
    assert len(plain) == len(watched)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))
    assert not [r for r in recwarn if "nanwidget" in str(r.message)]


@pytest.mark.parametrize("mode", MODES)
def test_an_unbounded_log_scale_whose_exp_overflows_gets_the_soft_clamp(mode):
    torch.manual_seed(0)
    model = RealNVP(soft_clamp=False)
    with torch.no_grad():  # a log-scale grown to 95: exp passes float32's largest at 88.7
        model.layers[1].net[2].bias[:2] = 95.0
    with watch(model, mode) as w:
        model(moons(32))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow" and w.event.module == "layers.1"
    assert diagnosis.summary.startswith("exp in module 'layers.1' (Coupling)")
    assert "above 88.7" in diagnosis.summary
    assert "s = c * torch.tanh(s / c)" in diagnosis.suggestion[0]
    assert not any("logsumexp" in fix for fix in diagnosis.suggestion)  # not a softmax by hand


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("edge", [0.0, 1.0])
def test_a_pixel_at_0_or_1_before_a_logit_without_alpha_gets_the_squeeze(mode, edge):
    torch.manual_seed(0)
    model = LogitFlow(alpha=0.0)
    x = pixels()
    x[3, 5] = edge
    with watch(model, mode) as w:
        model(x)
    diagnosis = w.event.diagnosis
    op = "log" if edge == 0 else "log1p"
    assert diagnosis.kind == "domain" and diagnosis.rows == [3]
    assert diagnosis.summary.startswith(f"{op} in module '<root>' (LogitFlow)")
    assert "x = alpha + (1 - 2 * alpha) * x" in diagnosis.suggestion[0]
    if edge == 1.0:  # log1p's edge is -1: clamping its argument at +eps would change every value
        assert "clamp_min(-1 + eps)" in diagnosis.suggestion[1]
        assert "log1p(x.clamp_min(eps))" not in " ".join(diagnosis.suggestion)


@pytest.mark.parametrize("mode", MODES)
def test_a_spline_bin_that_collapsed_gets_the_minimum_bin_size(mode):
    torch.manual_seed(0)
    model = SplineFlow(min_bin=0.0)
    with torch.no_grad():  # one bin takes the whole height: the others' heights underflow to 0
        model.net[2].bias[8:16] = torch.tensor([200.0] + [0.0] * 7)
    with watch(model, mode) as w:
        model(moons(32))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain" and "log of values down to 0" in diagnosis.summary
    assert "min_bin_width" in diagnosis.suggestion[0]


def test_zuko_flows_train_the_same_watched():
    zuko = pytest.importorskip(
        "zuko", reason="zuko is optional (CI's extras job installs it): pip install zuko")

    def run(watched: bool, mode: str | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        flow = zuko.flows.NSF(2, 0, transforms=2, hidden_features=[16])
        w = nw.watch(flow, mode=mode, backward=True) if watched else None
        seen = train(flow, lambda f: -f().log_prob(moons(64)).mean(), steps=3)
        with torch.no_grad():
            seen += [flow().sample((8,)), torch.random.get_rng_state()]
        if w is not None:
            assert not w.events and not w.warnings
            w.close()
        return seen

    plain = run(False, None)
    for mode in ("full", "sentinel"):
        assert all(torch.equal(a, b) for a, b in zip(plain, run(True, mode)))


class MDNWithRawScale(MDN):
    """The scale straight from the layer, without softplus: negative for some inputs."""

    def forward(self, x: torch.Tensor) -> D.Distribution:
        logits, mu, raw = self.net(x).chunk(3, -1)
        return D.MixtureSameFamily(D.Categorical(logits=logits),
                                   D.Normal(mu, raw, validate_args=False))


@pytest.mark.parametrize("mode", MODES)
def test_a_mixture_whose_scale_went_negative_blames_the_scale_not_the_targets(mode):
    torch.manual_seed(0)
    model = MDNWithRawScale()
    x = torch.rand(32, 1, generator=torch.Generator().manual_seed(1)) * 2 - 1
    y = torch.sin(3 * x[:, 0])
    with watch(model, mode, loss_fn=lambda mixture: -mixture.log_prob(y).mean(),
               replay_on_nan=True) as w:
        loss = -model(x).log_prob(y).mean()
        loss.backward()
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "loss" and "log of values down to -" in diagnosis.summary
    # The log read the scale the model returned inside the distribution, not the targets
    assert "besides the model's output" not in diagnosis.summary
    assert not any("targets" in fix for fix in diagnosis.suggestion[:1])
    assert "F.softplus(raw) + 1e-4" in diagnosis.suggestion[0]

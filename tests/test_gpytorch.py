"""nanwidget on GPyTorch: an ExactGP trained with Adam on its marginal log likelihood, then
predicting under fast_pred_var; a nearly singular kernel matrix whose Cholesky GPyTorch retries
with jitter; a variational ApproximateGP. Watched runs are bit for bit the same as unwatched
ones and raise no event. GPyTorch's modules define their own ``__call__``, which runs
``forward`` without nn.Module's hooks, so the watch sees none of their calls: at close it says
so, naming that ``__call__``, rather than staying silent (full mode) or saying the model was
never called (sentinel mode)."""
from __future__ import annotations

import warnings

import pytest
import torch

gpytorch = pytest.importorskip(
    "gpytorch", reason="gpytorch is optional (CI's extras job installs it): pip install gpytorch")

import nanwidget as nw  # noqa: E402


class ExactGP(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood) -> None:
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


class VariationalGP(gpytorch.models.ApproximateGP):
    def __init__(self, inducing: torch.Tensor) -> None:
        distribution = gpytorch.variational.CholeskyVariationalDistribution(inducing.size(0))
        strategy = gpytorch.variational.VariationalStrategy(self, inducing, distribution,
                                                            learn_inducing_locations=True)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def data(n: int = 20):
    x = torch.linspace(0, 1, n)
    y = torch.sin(6 * x) + 0.05 * torch.randn(n, generator=torch.Generator().manual_seed(0))
    return x, y


def nanwidget_warnings(caught) -> list[str]:
    return [str(c.message) for c in caught if str(c.message).startswith("nanwidget")]


def fit_exact(watch_options: dict | None, steps: int = 8):
    torch.manual_seed(0)
    x, y = data()
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGP(x, y, likelihood)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    w = None if watch_options is None else nw.watch(model, on_nan="record", **watch_options)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.train()
        likelihood.train()
        for _ in range(steps):
            optimizer.zero_grad()
            loss = -mll(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        model.eval()
        likelihood.eval()
        with torch.no_grad(), gpytorch.settings.fast_pred_var():
            predicted = likelihood(model(torch.linspace(0, 1, 7)))
            mean, variance = predicted.mean.clone(), predicted.variance.clone()
        events = [] if w is None else list(w.events)
        if w is not None:
            w.close()
    params = [p.detach().clone() for p in model.parameters()]
    return torch.stack(losses), params, mean, variance, events, caught


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_exact_gp_trains_and_predicts_unchanged_and_the_watch_says_it_saw_nothing(mode, backward):
    ref_losses, ref_params, ref_mean, ref_variance, _, _ = fit_exact(None)
    losses, params, mean, variance, events, caught = fit_exact(dict(mode=mode, backward=backward))
    assert events == []
    assert torch.equal(losses, ref_losses) and torch.equal(mean, ref_mean)
    assert torch.equal(variance, ref_variance)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert losses[-1] < losses[0]  # it trained
    said = nanwidget_warnings(caught)
    assert len(said) == 1 and "checked nothing" in said[0]
    assert "(gpytorch.models.exact_gp.ExactGP.__call__)" in said[0]
    assert "was never called" not in said[0]  # it was: its calls bypass the hooks


def nearly_singular_prediction(watched: bool):
    # Every input three times and a noise of 1e-9: the kernel matrix is singular to float32,
    # psd_safe_cholesky's first Cholesky fails and it retries with jitter on the diagonal.
    x = torch.linspace(0, 1, 10).repeat(3)
    likelihood = gpytorch.likelihoods.GaussianLikelihood(
        noise_constraint=gpytorch.constraints.GreaterThan(1e-10))
    likelihood.noise = 1e-9
    model = ExactGP(x, torch.sin(6 * x), likelihood).eval()
    likelihood.eval()
    w = nw.watch(model) if watched else None  # on_nan="raise": an event would stop it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), gpytorch.settings.fast_pred_var():
            predicted = likelihood(model(torch.linspace(0, 1, 5)))
            mean, variance = predicted.mean.clone(), predicted.variance.clone()
        events = [] if w is None else list(w.events)
        if w is not None:
            w.close()
    return mean, variance, events, caught


def test_a_cholesky_retried_with_jitter_is_no_event_and_unchanged():
    ref_mean, ref_variance, _, ref_caught = nearly_singular_prediction(False)
    assert any("added jitter" in str(c.message) for c in ref_caught)  # the retry happened
    mean, variance, events, caught = nearly_singular_prediction(True)
    assert events == [] and nanwidget_warnings(caught) == []
    assert torch.equal(mean, ref_mean) and torch.equal(variance, ref_variance)
    assert torch.isfinite(mean).all()


def fit_variational(watched: bool):
    torch.manual_seed(0)
    x, y = data(30)
    model = VariationalGP(torch.linspace(0, 1, 5))
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=30)
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
    w = nw.watch(model, on_nan="record", backward=True) if watched else None
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            optimizer.zero_grad()
            loss = -mll(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        events = [] if w is None else list(w.events)
        if w is not None:
            w.close()
    return torch.stack(losses), events, caught


def test_a_variational_gp_trains_unchanged():
    ref_losses, _, _ = fit_variational(False)
    losses, events, caught = fit_variational(True)
    assert events == [] and torch.equal(losses, ref_losses)
    said = nanwidget_warnings(caught)
    assert len(said) == 1 and "ApproximateGP.__call__" in said[0]


@pytest.mark.xfail(strict=True, reason="GPyTorch's __call__ runs forward without nn.Module's "
                   "hooks: the watch never sees the kernel; the first event it records is a "
                   "Softplus constraint of the likelihood, called outside the model, one step "
                   "after the NaN lengthscale spread to every parameter")
def test_a_nan_lengthscale_is_named():
    x, y = data()
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGP(x, y, likelihood)
    with torch.no_grad():
        model.covar_module.base_kernel.raw_lengthscale.fill_(float("nan"))
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    with nw.watch(model, on_nan="record") as w:
        try:
            for _ in range(3):
                optimizer.zero_grad()
                (-mll(model(x), y)).backward()
                optimizer.step()
        except Exception:  # GPyTorch's own NanError once the noise is NaN too
            pass
    assert w.event is not None and w.event.module.startswith("covar_module")

"""Differentially private training (Opacus' DP-SGD) and torch.func's ensembles and per-sample
gradients under a watch: results bit-identical, no false alarm, planted NaNs named and
diagnosed. The Opacus tests skip without it (pip install opacus); the torch.func ones always run."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

import nanwidget as nw

NAN = float("nan")
WATCHES = [{}, {"mode": "sentinel"}, {"backward": True, "replay_on_nan": True},
           {"mode": "sentinel", "backward": True, "replay_on_nan": True}]


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
                                    and torch.equal(x.isnan(), y.isnan()) for x, y in zip(a, b))


# ------------------------------------------------------------------------------ torch.func
def _ensemble_and_per_sample_steps(model, steps=3, nan_at=None):
    """The PyTorch tutorials' two uses of torch.func on a model: an ensemble of its copies
    (stack_module_state + functional_call + vmap) and DP-style per-sample gradients
    (vmap(grad(...)), clipped per sample, noised), then an optimizer step."""
    members = [_mlp(seed) for seed in range(1, 4)]
    stacked, buffers = stack_module_state(members)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(2)
    made = []
    for step in range(steps):
        x = torch.randn(8, 8, generator=generator)
        y = torch.randint(0, 3, (8,), generator=generator)
        if step == nan_at:
            x[5, 0] = NAN
        made.append(vmap(lambda p, b: functional_call(model, (p, b), (x,)))(stacked, buffers))

        def loss(p, xi, yi):
            return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

        params = {k: v.detach() for k, v in model.named_parameters()}
        per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.reshape(8, -1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
        factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
        optimizer.zero_grad()
        for name, p in model.named_parameters():
            p.grad = torch.einsum("i,i...->...", factor, per_sample[name]) + 0.01 * torch.randn_like(p)
        optimizer.step()
        made += [*per_sample.values(), norms]
    return made + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("options", WATCHES, ids=str)
def test_ensembles_and_per_sample_gradients_are_unchanged_and_quiet(options):
    torch.manual_seed(5)
    baseline = _ensemble_and_per_sample_steps(_mlp())
    rng = torch.get_rng_state()
    model = _mlp()
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nw.watch(model, **options) as w:
            made = _ensemble_and_per_sample_steps(model)
    assert _same(baseline, made) and torch.equal(rng, torch.get_rng_state())  # no RNG drawn
    assert not w.events and not w.warnings


@pytest.mark.parametrize("options", WATCHES, ids=str)
def test_a_nan_sample_in_per_sample_gradients_is_bad_data_in_its_row(options):
    model = _mlp()
    with nw.watch(model, on_nan="raise", **options) as w:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a vmap'd batch cannot be replayed: said so
            with pytest.raises(nw.NanDetected):
                _ensemble_and_per_sample_steps(model, nan_at=1)
    event = w.event
    assert event.batch == 2 and event.diagnosis.kind == "bad-data"  # step 1's ensemble
    assert event.diagnosis.rows == [5]


# ---------------------------------------------------------------------------------- Opacus
def _private(mode, *, watch=None, order="after", steps=10, batch_size=4, plant=None,
             watch_wrapper=False):
    """DP-SGD on a small seeded model with Opacus (Poisson sampling); returns what it made
    and the watch."""
    opacus = pytest.importorskip(
        "opacus",
        reason="the DP-SGD tests need Opacus (CI's extras job installs it): pip install opacus")
    from torch.utils.data import DataLoader, TensorDataset
    logging.getLogger("opacus").setLevel(logging.ERROR)  # its 'first batch is empty' notice
    model = _mlp()
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 8, generator=generator),
                         torch.randint(0, 3, (40,), generator=generator))
    if plant == "nan-sample":
        data.tensors[0][[5, 20, 33], 2] = NAN
    if plant == "huge-sample":
        data.tensors[0][[5, 20, 33], 2] = 1e30
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nw.watch(model, on_nan="record", **watch) if watch is not None and order == "before" \
        else None
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' secure-RNG notice
        wrapped, optimizer, loader = opacus.PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=batch_size),
            noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode)
    if watch is not None and order == "after":
        w = nw.watch(wrapped if watch_wrapper else model, on_nan="record", **watch)
    torch.manual_seed(7)
    made = []
    for step, (x, y) in zip(range(steps), loader):
        if plant == "weight" and step == 3:
            with torch.no_grad():
                model[3].weight[1, 2] = NAN
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(wrapped(x), y)  # NaN on an empty batch: the user's
        loss.backward()
        made += [loss.detach()] + [p.grad_sample.clone() for p in model.parameters()
                                   if p.grad_sample is not None]
        optimizer.step()
        made += [p.grad.clone() for p in model.parameters()]  # clipped and noised
    return made + [p.detach().clone() for p in model.parameters()], w


@pytest.mark.parametrize("options", WATCHES, ids=str)
@pytest.mark.parametrize("mode,batch_size", [("hooks", 1), ("hooks", 4), ("functorch", 4),
                                             ("ew", 4)])
def test_dp_sgd_is_bit_identical_and_quiet_under_a_watch(mode, batch_size, options):
    """Per-sample gradients, clipped and noised gradients (the noise drawn from the global
    RNG) and weights; batch size 1 gives empty Poisson batches."""
    baseline, _ = _private(mode, batch_size=batch_size)
    for order, on_wrapper in (("before", False), ("after", False), ("after", True)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # Opacus' own hooks on a first layer whose input needs no gradient (also unwatched)
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            made, w = _private(mode, watch=options, order=order, batch_size=batch_size,
                               watch_wrapper=on_wrapper)
        assert _same(baseline, made), (order, on_wrapper)
        assert not w.events and not w.warnings
        w.close()


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew"])
def test_dp_sgd_a_nan_sample_is_bad_data_in_its_row(mode):
    _, w = _private(mode, watch={"mode": "sentinel", "replay_on_nan": True}, plant="nan-sample")
    event = w.event
    assert event.origin == "input" and event.diagnosis.kind == "bad-data", event.diagnosis.summary
    assert len(event.diagnosis.rows) == 1
    assert event.trace is not None and event.trace.reproduced
    w.close()


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew"])
@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}], ids=str)
def test_dp_sgd_a_weight_written_nan_is_a_corrupted_weight(mode, options):
    """With grad_sample_mode="ew" the diagnosis failed ('Expanded Weights encountered but
    cannot handle function __get__') and the batch was not held for replay."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no internal-error warning
        warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus'
        _, w = _private(mode, watch=options, plant="weight", steps=5)
    event = w.event
    assert (event.batch, event.module, event.role) == (3, "3", "weight")
    assert event.diagnosis.kind == "corrupted-weight", event.diagnosis.summary
    trace = w.replay(3)
    assert trace.frames["nan"].any()
    w.close()


def test_dp_sgd_an_overflow_in_the_wrapped_model_names_no_line_of_opacus():
    """Watching the GradSampleModule: a LayerNorm of a huge sample overflows; the diagnosis
    said it was made 'at .../opacus/grad_sample/grad_sample_module.py:549' (the wrapper's
    ``self._module(...)``) and its fix was to keep the values smaller there."""
    _, w = _private("hooks", watch={"mode": "sentinel", "replay_on_nan": True},
                    plant="huge-sample", watch_wrapper=True)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow", diagnosis.summary
    told = " ".join([diagnosis.summary, *diagnosis.suggestion])
    assert "opacus" not in told, told
    w.close()


def _private_diverging(*, lr=0.1, noise_multiplier=1.0, watch=None):
    """DP-SGD (Opacus, hooks mode) on a ReLU MLP until the watch stops it; returns the watch."""
    opacus = pytest.importorskip(
        "opacus",
        reason="the DP-SGD tests need Opacus (CI's extras job installs it): pip install opacus")
    from torch.utils.data import DataLoader, TensorDataset
    logging.getLogger("opacus").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(400, 8, generator=generator),
                         torch.randint(0, 3, (400,), generator=generator))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' secure-RNG notice
        wrapped, optimizer, loader = opacus.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
            data_loader=DataLoader(data, batch_size=8), noise_multiplier=noise_multiplier,
            max_grad_norm=1.0)
    w = nw.watch(model, on_nan="record", **(watch or {}))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus'
        for x, y in loader:
            loss = nn.functional.cross_entropy(wrapped(x), y)
            if w.events:
                break
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    w.close()
    return w


def test_dp_sgd_that_diverged_is_told_in_max_grad_norm_s_terms_not_clip_grad_norm():
    # A DPOptimizer clips each sample's gradient itself (max_grad_norm): the divergence's fix
    # said 'Clip the gradients before the step: torch.nn.utils.clip_grad_norm_(...)'.
    w = _private_diverging(lr=1e37)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "divergence", diagnosis.summary
    fixes = " ".join(diagnosis.suggestion)
    assert "torch.nn.utils.clip_grad_norm_" not in fixes and "Clip the gradients" not in fixes
    assert "DPOptimizer clips each sample's gradient to max_grad_norm=1 already" in fixes
    assert "noise_multiplier x max_grad_norm = 1 x 1" in fixes
    assert "lower the learning rate of the optimizer given to make_private" in fixes
    assert diagnosis.suggestion[0].startswith("Lower the learning rate")


def test_dp_sgd_whose_noise_made_a_weight_inf_is_told_to_lower_noise_multiplier():
    # Noise of std 1e39 x 1.0 passes float32's largest: the step writes Inf. The corrupted
    # weight's fix said to clip with clip_grad_norm_ (and spoke of float16's GradScaler).
    w = _private_diverging(noise_multiplier=1e39)
    event = w.event
    assert (event.batch, event.origin) == (1, "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight", diagnosis.summary
    fixes = " ".join(diagnosis.suggestion)
    assert "clip_grad_norm_" not in fixes.replace("so clip_grad_norm_ adds nothing", ""), fixes
    assert "GradScaler" not in fixes, fixes
    assert "lower noise_multiplier" in fixes, fixes

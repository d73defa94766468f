"""diffusers models, watched: a tiny seeded UNet2DModel trained on noise prediction under a
DDPMScheduler, sampled with a DDIMScheduler (one UNet call per step), and through a
DDPMPipeline, with an EMAModel of its weights.

diffusers is no dependency of nanwidget: these run only where diffusers is installed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

diffusers = pytest.importorskip("diffusers", reason="diffusers models: pip install diffusers")

from diffusers import DDIMScheduler, DDPMPipeline, DDPMScheduler, UNet2DModel  # noqa: E402
from diffusers.training_utils import EMAModel  # noqa: E402

import nanwidget as nw  # noqa: E402
from conftest import hook_count  # noqa: E402

WATCHES = [{}, {"mode": "sentinel"}, {"backward": True}]


def tiny_unet() -> UNet2DModel:
    torch.manual_seed(0)
    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(8, 16), norm_num_groups=4, attention_head_dim=4,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"))


def train_and_sample(watch_kwargs):
    """Noise-prediction training with an EMA, then DDIM sampling with the EMA weights and a
    DDPMPipeline: what changes (losses, gradients, weights, samples, RNG) and what the watch
    said."""
    model = tiny_unet()
    scheduler = DDPMScheduler(num_train_timesteps=100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema = EMAModel(model.parameters(), decay=0.9)
    images = torch.rand(8, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    torch.manual_seed(1)
    watch = nw.watch(model, **watch_kwargs) if watch_kwargs is not None else None
    losses, grads = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            clean = images[step % 4 * 2:step % 4 * 2 + 2]
            noise = torch.randn_like(clean)
            timesteps = torch.randint(0, 100, (2,))
            loss = F.mse_loss(model(scheduler.add_noise(clean, noise, timesteps), timesteps).sample,
                              noise)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ema.step(model.parameters())
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in model.parameters()])
        model.eval()
        ema.store(model.parameters())
        ema.copy_to(model.parameters())
        ddim = DDIMScheduler(num_train_timesteps=100)
        ddim.set_timesteps(4)
        generator = torch.Generator().manual_seed(3)
        x = torch.randn(2, 3, 8, 8, generator=generator)
        with torch.no_grad():
            for t in ddim.timesteps:
                x = ddim.step(model(x, t).sample, t, x, eta=0.5, generator=generator).prev_sample
        ema.restore(model.parameters())
        pipe = DDPMPipeline(unet=model, scheduler=DDPMScheduler(num_train_timesteps=5))
        pipe.set_progress_bar_config(disable=True)
        images_out = pipe(batch_size=1, generator=torch.Generator().manual_seed(4),
                          num_inference_steps=5, output_type="pt").images
    said = []
    if watch is not None:
        said = [*watch.events, *watch.warnings, *(str(c.message) for c in caught
                                                  if "nanwidget" in str(c.message))]
        watch.close()
    return dict(losses=losses, grads=grads, weights=[p.detach().clone() for p in model.parameters()],
                shadow=[p.clone() for p in ema.shadow_params], sample=x, images=images_out,
                rng=torch.rand(3)), said, hook_count(model)


def same(a, b) -> bool:
    def equal(x, y):
        if isinstance(x, list):
            return len(x) == len(y) and all(equal(p, q) for p, q in zip(x, y))
        return torch.equal(x, y)
    return all(equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("watch_kwargs", WATCHES, ids=["full", "sentinel", "backward"])
def test_training_ema_and_sampling_are_bit_identical_and_quiet(watch_kwargs):
    unwatched, _, _ = train_and_sample(None)
    watched, said, hooks_left = train_and_sample(watch_kwargs)
    assert same(unwatched, watched)
    assert said == [] and hooks_left == 0


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_zero_terminal_snr_sampler_names_its_step_not_the_data(mode):
    # With rescale_betas_zero_snr=True, DDIM's first step divides the epsilon prediction by
    # sqrt(alphas_cumprod[99]) = 0: the UNet's second call gets Inf. It was "it came with the
    # data" with a dataset's fixes only.
    model = tiny_unet().eval()
    ddim = DDIMScheduler(num_train_timesteps=100, rescale_betas_zero_snr=True,
                         timestep_spacing="trailing", clip_sample=False)
    ddim.set_timesteps(4)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    with nw.watch(model, on_nan="record", **({"mode": "sentinel"} if mode == "sentinel" else {})) as w:
        with torch.no_grad():
            for t in ddim.timesteps:
                x = ddim.step(model(x, t).sample, t, x).prev_sample
    event = w.event
    diagnosis = event.diagnosis
    assert (event.batch, event.module, event.role) == (1, "conv_in", "input[0]")
    assert (diagnosis.kind, diagnosis.rows) == ("bad-data", [0, 1])
    assert "from the step after the previous call" in diagnosis.summary
    assert "input[1] = 74" in diagnosis.evidence[-1]
    assert diagnosis.suggestion[0].startswith("If the model runs in a sampling loop")
    assert "prediction_type='v_prediction'" in diagnosis.suggestion[1]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_image_in_training_is_bad_data_of_its_row(mode):
    model = tiny_unet()
    scheduler = DDPMScheduler(num_train_timesteps=100)
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    images[3] = float("nan")
    torch.manual_seed(1)
    with nw.watch(model, on_nan="record", **({"mode": "sentinel"} if mode == "sentinel" else {})) as w:
        for step in range(2):
            clean = images[step * 2:step * 2 + 2]
            noise = torch.randn_like(clean)
            timesteps = torch.randint(0, 100, (2,))
            model(scheduler.add_noise(clean, noise, timesteps), timesteps)
    diagnosis = w.event.diagnosis
    assert (w.event.batch, w.event.module, diagnosis.kind, diagnosis.rows) == \
        (1, "conv_in", "bad-data", [1])
    assert diagnosis.summary.endswith("it came with the data, not from the model.")
    assert not any("sampling loop" in fix for fix in diagnosis.suggestion)

"""NanWatchCallback under Lightning's training features: manual optimization with two optimizers
(a GAN), gradient clipping, accumulation, bf16-mixed and StochasticWeightAveraging; a watched fit
is the unwatched one bit for bit, and a diagnosis's fixes speak the Trainer's flags."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip(
    "lightning.pytorch", reason="the Lightning callback needs the lightning extra: pip install -e .[lightning]")

import nanwidget as nw  # noqa: E402
from nanwidget.integrations.lightning import NanWatchCallback  # noqa: E402

MODES = {"full": {}, "full-backward": {"backward": True}, "sentinel": {"mode": "sentinel"},
         "sentinel-backward": {"mode": "sentinel", "backward": True}}


@pytest.fixture(autouse=True)
def _quiet_lightning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        yield


def loader(rows: int = 32, scale: float = 1.0) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(rows, 8, generator=generator) * scale,
                                          torch.randn(rows, 1, generator=generator) * scale)
    return torch.utils.data.DataLoader(data, batch_size=8)


class Regressor(pl.LightningModule):
    def __init__(self, lr: float = 1e-2, sgd: bool = False, lr_growth: float = 1.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr, self.sgd, self.lr_growth, self.losses = lr, sgd, lr_growth, []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        optimizer = (torch.optim.SGD if self.sgd else torch.optim.Adam)(self.parameters(), lr=self.lr)
        if self.lr_growth == 1.0:
            return optimizer
        growth = self.lr_growth  # a schedule gone wrong: the rate grows every step
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: growth ** step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Gan(Regressor):
    """Manual optimization with two optimizers: a generator (``net``) and a discriminator."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__(lr)
        self.automatic_optimization = False
        self.critic = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        generator, critic = self.optimizers()
        self.toggle_optimizer(generator)
        fake = self(x)
        loss_g = self.critic(fake).mean() + nn.functional.mse_loss(fake, y)
        self.manual_backward(loss_g)
        generator.step()
        generator.zero_grad()
        self.untoggle_optimizer(generator)
        self.toggle_optimizer(critic)
        loss_d = (nn.functional.softplus(self.critic(fake.detach())).mean()
                  + nn.functional.softplus(-self.critic(y)).mean())
        self.manual_backward(loss_d)
        critic.step()
        critic.zero_grad()
        self.untoggle_optimizer(critic)
        self.losses.append(torch.stack([loss_g.detach(), loss_d.detach()]))

    def configure_optimizers(self):
        return (torch.optim.SGD(self.net.parameters(), lr=self.lr),
                torch.optim.Adam(self.critic.parameters(), lr=1e-2))


class NanRowAt(pl.Callback):
    """Row 1 of training batch ``at`` (its index in the epoch) turned NaN."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            batch[0][1, 2] = float("nan")


def fit(model, callbacks, data=None, **options):
    settings = dict(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, num_sanity_val_steps=0)
    settings.update(options)
    trainer = pl.Trainer(callbacks=callbacks, **settings)
    trainer.fit(model, data or loader())
    return trainer


def run(model_type, callback, extra=(), **options):
    torch.manual_seed(0)
    model = model_type()
    callbacks = list(extra) + ([callback] if callback is not None else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(model, callbacks, **options)
        predictions = trainer.predict(model, loader(16)) if not isinstance(model, Gan) else []
    ours = [str(w.message) for w in caught
            if issubclass(w.category, nw.EarlyWarningIssued) or "nanwidget" in str(w.message)]
    return model, predictions, ours


FEATURES = {
    # accumulation, clipping by norm, bf16-mixed and SWA in one fit; then predict()
    "accumulate-clip-bf16-swa": (Regressor, dict(
        max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5, precision="bf16-mixed"),
        lambda: [pl.callbacks.StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)]),
    "clip-by-value": (Regressor, dict(max_steps=4, gradient_clip_val=0.01,
                                      gradient_clip_algorithm="value"), lambda: []),
    "manual-two-optimizers": (Gan, dict(max_epochs=1), lambda: []),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_a_watched_fit_is_the_unwatched_one_bit_for_bit_and_quiet(feature):
    model_type, options, extra = FEATURES[feature]
    plain, plain_predictions, _ = run(model_type, None, extra(), **options)
    for mode, watch_options in MODES.items():
        callback = NanWatchCallback(log_dir=False, **watch_options)
        watched, predictions, ours = run(model_type, callback, extra(), **options)
        assert callback.stop is None and callback.watch.events == [], mode
        assert ours == [] and callback.watch.warnings == [], mode
        assert len(watched.losses) == len(plain.losses) and all(
            torch.equal(a, b) for a, b in zip(watched.losses, plain.losses)), mode
        assert all(torch.equal(a, b) for a, b in zip(watched.state_dict().values(),
                                                     plain.state_dict().values())), mode
        assert all(torch.equal(a, b) for a, b in zip(predictions, plain_predictions)), mode


@pytest.mark.parametrize("mode", MODES)
def test_a_gan_stopped_at_its_generators_step_leaves_the_discriminator_unwritten(mode):
    # The stop dropped the generator's gradients, but training_step went on to the
    # discriminator's step, which wrote the NaN its batch made into every critic weight.
    model, callback = Gan(), NanWatchCallback(log_dir=False, **MODES[mode])
    trainer = fit(model, [NanRowAt(2), callback])
    assert trainer.should_stop and callback.event.batch == 2
    assert callback.stop.reason.startswith("nan in batch 2 (training step 5, micro-batch 0)")
    assert callback.event.diagnosis.rows == [1]
    assert [name for name, p in model.named_parameters() if not p.isfinite().all()] == []


def _diverged(model, **options):
    callback = NanWatchCallback(log_dir=False, backward=True)
    torch.manual_seed(0)
    fit(model, [callback], data=loader(256, scale=3.0), max_steps=30, **options)
    assert callback.event is not None, callback.stop
    diagnosis = callback.event.diagnosis
    assert diagnosis.kind == "divergence"
    assert not any("clip_grad_norm_" in fix or "OneCycleLR" in fix
                   or "torch.amp.GradScaler" in fix for fix in diagnosis.suggestion)
    return diagnosis.suggestion


def test_a_divergence_under_the_trainer_is_told_in_its_flags():
    # The fixes said torch.optim.lr_scheduler.LinearLR, clip_grad_norm_ and GradScaler, which a
    # Lightning user sets through configure_optimizers() and the Trainer's flags.
    torch.manual_seed(0)
    fixes = _diverged(Regressor(lr=5.0, sgd=True))
    assert fixes[0].startswith("Lower the learning rate (try 10x lower: the lr of the optimizer "
                               "that configure_optimizers() returns; Tuner(trainer).lr_find")
    assert '"interval": "step"}} from configure_optimizers().' in fixes[0]
    assert "Clip the gradients before the step: Trainer(gradient_clip_val=1.0) (it clips the " \
           "total norm)." in fixes
    # A float32 run: no AMP fix, in torch's words or Lightning's.
    assert not any("GradScaler" in fix or "16-mixed" in fix for fix in fixes)


class L1Regressor(Regressor):
    """ReLU between the layers and an L1 loss: weights that grow make the output overflow in
    the forward, before any loss or gradient does."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.net[1] = nn.ReLU()

    def training_step(self, batch, batch_idx):
        return nn.functional.l1_loss(self(batch[0]), batch[1])


def test_a_divergence_with_the_trainer_clipping_does_not_say_to_clip():
    torch.manual_seed(0)
    fixes = _diverged(L1Regressor(lr=0.1, sgd=True, lr_growth=10.0), gradient_clip_val=0.5)
    assert any(fix.startswith("The Trainer already clips the gradients (Trainer("
                              "gradient_clip_val=0.5)), and the weights grew anyway")
               for fix in fixes)
    assert not any(fix.startswith("Clip the gradients") for fix in fixes)


def test_a_divergence_under_manual_optimization_clips_with_self_clip_gradients():
    class Manual(Regressor):
        def __init__(self):
            super().__init__(lr=5.0, sgd=True)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            loss = nn.functional.mse_loss(self(batch[0]), batch[1])
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    torch.manual_seed(0)
    fixes = _diverged(Manual())
    assert "Clip the gradients before the step: self.clip_gradients(optimizer, " \
           "gradient_clip_val=1.0, gradient_clip_algorithm=\"norm\") in training_step, after " \
           "self.manual_backward(loss) and before optimizer.step() (under manual optimization " \
           "the Trainer's gradient_clip_val does not apply)." in fixes
    assert not any("Trainer(gradient_clip_val" in fix for fix in fixes)


class LinearRegressor(Regressor):
    """Two Linear layers, no squashing between them: at an SGD learning rate that drives the
    weights up step after step, the outputs climb until their MSE overflows to inf while the
    outputs themselves are still finite (about 1e19 to 1e38 in float32)."""

    def __init__(self, lr: float) -> None:
        super().__init__(lr=lr, sgd=True)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))


def _stopped_on_a_loss(model, data, **callback_options):
    callback = NanWatchCallback(log_dir=False, **callback_options)
    torch.manual_seed(0)
    fit(model, [callback], data=data, max_steps=30)
    assert callback.stop is not None and callback.event is None      # no module event
    assert callback.stop.reason.startswith("inf loss in batch 5 (training step 6")
    return callback


def test_a_loss_that_overflows_as_the_weights_climb_stops_with_a_divergence():
    # The stop said only "inf loss ... made by code outside the modules" (its diagnosis was
    # None), although the weights had climbed 1e12x: the MSE of outputs near 1e24 overflowed.
    torch.manual_seed(0)
    callback = _stopped_on_a_loss(LinearRegressor(lr=0.1), loader(256, scale=3.0))
    diagnosis = callback.stop.diagnosis
    assert diagnosis is not None and diagnosis.kind == "divergence"
    assert diagnosis.summary.startswith("Training diverged: the weights grew ")
    assert "until the loss computed from the model's outputs became inf at batch 5" \
        in diagnosis.summary
    assert any(line.startswith("The weights' abs max (summed over modules) grew ")
               for line in diagnosis.evidence)
    assert any(line.startswith("The loss of batch 5 was inf, while the model's outputs it was "
                               "computed from were finite (abs max ")
               for line in diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith("Lower the learning rate (try 10x lower: the lr of "
                                              "the optimizer that configure_optimizers() returns")
    assert "Clip the gradients before the step: Trainer(gradient_clip_val=1.0) (it clips the " \
           "total norm)." in diagnosis.suggestion
    assert "Why (divergence): Training diverged" in callback.stop.summary()
    assert callback.watch.events == []                                # the watch's own: none


def test_a_loss_overflow_raised_out_of_fit_carries_its_diagnosis():
    torch.manual_seed(0)
    with pytest.raises(nw.NanDetected) as raised:
        _stopped_on_a_loss(LinearRegressor(lr=0.1), loader(256, scale=3.0), on_nan="raise")
    event = raised.value.event
    assert (event.role, event.kind, event.batch) == ("loss", "inf", 5)
    assert event.diagnosis is not None and event.diagnosis.kind == "divergence"


def test_an_inf_target_with_steady_weights_is_a_loss_not_a_divergence():
    torch.manual_seed(0)
    data = loader(256, scale=3.0)
    data.dataset.tensors[1][5 * 8 + 2] = float("inf")                 # batch 5, row 2
    callback = _stopped_on_a_loss(LinearRegressor(lr=0.01), data)
    diagnosis = callback.stop.diagnosis
    assert diagnosis is not None and diagnosis.kind == "loss"
    assert diagnosis.summary.startswith("Made in the loss, outside the model: the loss of batch "
                                        "5 was inf, while the model's outputs were finite")
    assert any(line.startswith("The weights did not climb over the batches before")
               for line in diagnosis.evidence)
    assert any("targets" in fix for fix in diagnosis.suggestion)
    assert not any("learning rate" in fix for fix in diagnosis.suggestion)


def test_an_inf_targets_fixes_fit_an_mse_and_name_the_callbacks_loss_fn():
    # The fixes led with "watch with loss_fn=lambda out: criterion(out, targets)" (a watch the
    # Lightning user never makes) and gave the log-probability fixes (BCEWithLogitsLoss,
    # log_softmax) to an MSE regression. The loss on_before_backward gets tells mse_loss made
    # it (its grad_fn): the targets come first, then the callback's own loss_fn=.
    torch.manual_seed(0)
    data = loader(256, scale=3.0)
    data.dataset.tensors[1][5 * 8 + 2] = float("inf")                 # batch 5, row 2
    diagnosis = _stopped_on_a_loss(LinearRegressor(lr=0.01), data).stop.diagnosis
    assert "The loss's grad_fn is DivBackward0 over MseLossBackward0: torch's mse_loss made it, " \
           "and a factor outside the graph scaled it." in diagnosis.evidence  # Lightning's / 1
    fixes = diagnosis.suggestion
    assert fixes[0].startswith("Check the targets: mse_loss of the model's finite outputs is "
                               "NaN/Inf when a target is.")
    assert fixes[-1].startswith("Name the loss's op and line: give the callback the loss as a "
                                "function of the model's output, callbacks=[NanWatchCallback("
                                "loss_fn=lambda out: ...)] (from nanwidget.integrations."
                                "lightning): it returns the loss training_step computes")
    said = " ".join(fixes)
    assert "watch with loss_fn" not in said and "w.replay(" not in said
    assert not any(fix in said for fix in ("BCEWithLogits", "log_softmax", "Clamp probabilities"))


class _PoisonAfterBatch(pl.Callback):
    """Writes a NaN into a weight after batch 1's step, as a bad in-place write would."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 1:
            with torch.no_grad():
                module.net[0].weight[0, 0] = float("nan")


@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}], ids=["full", "sentinel"])
def test_a_weight_written_under_the_callback_is_not_told_to_add_the_callback(options):
    # The first fix said "Catch the bad step ... train with Trainer(callbacks=[NanWatchCallback()])"
    # to a fit that used it already, and whose gradient check before each step had passed.
    callback = NanWatchCallback(log_dir=False, **options)
    torch.manual_seed(0)
    fit(Regressor(), [_PoisonAfterBatch(), callback], max_steps=4)
    diagnosis = callback.event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert not any("NanWatchCallback()" in fix for fix in diagnosis.suggestion)
    assert any("in-place write" in fix for fix in diagnosis.suggestion)

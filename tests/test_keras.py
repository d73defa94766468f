"""Keras 3 models on the torch backend, watched: small seeded models trained with fit().

Keras is no dependency of nanwidget: these run only where keras is installed (with
KERAS_BACKEND=torch, set here before keras is imported).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = pytest.importorskip("keras", reason="Keras models: pip install keras")
if keras.backend.backend() != "torch":
    pytest.skip("nanwidget watches Keras on its torch backend (KERAS_BACKEND=torch)",
                allow_module_level=True)

import nanwidget as nw  # noqa: E402
from conftest import hook_count  # noqa: E402

MODES = ["full", "sentinel"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        yield


@pytest.fixture
def mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    yield
    keras.config.set_dtype_policy("float32")


def _mixed_float16_model(sqrt_at_zero: bool = False):
    """8 -> 32 (relu) -> 1 (float32 head), compiled with Adam under the global dtype policy
    (under mixed_float16 Keras wraps Adam in its LossScaleOptimizer). ``sqrt_at_zero``: a
    sqrt(h * h) after the relu, whose gradient is NaN wherever the relu gave 0."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    if sqrt_at_zero:
        hidden = keras.layers.Lambda(lambda h: keras.ops.sqrt(h * h))(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def _regression_data(rows: int = 64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 8)).astype("float32")
    return x, (x.sum(1, keepdims=True) * 30).astype("float32")


# ---------------------------------------------------------------------------- loss scaling
@pytest.mark.parametrize("mode", MODES)
def test_a_mixed_float16_fit_whose_loss_scale_optimizer_skips_overflowing_steps_is_no_event(
        mixed_float16, mode):
    # Keras' LossScaleOptimizer starts at 32768, overflows the float16 gradients on purpose and
    # skips those steps while it halves its scale: the watch stopped the healthy fit at its
    # first step, blaming '_torch_params' (ParameterDict).
    model = _mixed_float16_model()
    x, y = _regression_data()
    with nw.watch(model, mode=mode, backward=True) as w:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        assert w.options.grad_scaler is model.optimizer  # found by itself
        skips = w.scaler_skips
        report = w.report()
    assert not w.events
    assert skips and skips[0].scale_before == 32768.0
    assert [s.scale_after for s in skips] == [s.scale_before / 2 for s in skips]
    assert skips[-1].scale_after == float(model.optimizer.dynamic_scale)
    assert f"LossScaleOptimizer skipped {len(skips)} steps on overflow" in report


def test_grad_scaler_takes_a_keras_loss_scale_optimizer_and_gives_it_back_at_close(
        mixed_float16):
    model = _mixed_float16_model()
    optimizer = model.optimizer
    x, y = _regression_data()
    with nw.watch(model, backward=True, grad_scaler=optimizer) as w:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not w.events and w.scaler_skips
    # Its own scale_loss and apply again, and no hook left on the model.
    assert "scale_loss" not in vars(optimizer) and "apply" not in vars(optimizer)
    assert hook_count(model) == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_loss_under_a_loss_scale_optimizer_is_still_an_event(mixed_float16, mode):
    model = _mixed_float16_model()
    x, y = _regression_data()
    y[20] = np.nan  # batch 1 of the fit (16 rows a batch)
    with nw.watch(model, mode=mode, backward=True, on_nan="record") as w:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    event = w.event
    assert event is not None and event.is_backward and event.kind == "nan"
    assert "the loss handed to optimizer.scale_loss() is nan" in event.note
    assert event.diagnosis.kind == "loss"


def test_a_nan_gradient_at_every_loss_scale_is_an_event_naming_the_model_not_its_parameter_dict(
        mixed_float16):
    model = _mixed_float16_model(sqrt_at_zero=True)
    x, y = _regression_data(192)
    with nw.watch(model, backward=True, on_nan="record") as w:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    event = w.event
    assert event is not None and event.is_backward and event.origin == "grad"
    assert "the LossScaleOptimizer skipped 8 steps in a row" in event.note
    # Keras keeps every weight in the root's '_torch_params', a ParameterDict never called.
    assert (event.module, event.module_type, event.call) == ("", "Functional", 0)
    assert event.role.startswith("_torch_params.")
    assert "(ParameterDict" not in event.summary()


# ---------------------------------------------------------------------------- divergence
def test_a_keras_model_at_too_high_a_learning_rate_is_a_divergence():
    # Its weights climb 3.8 -> 18 -> 1.1e4 -> 8e15 over four SGD steps, all kept in the root's
    # '_torch_params', which no frame measures: the blow-up read "overflow".
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32") * 3
    y = (x.sum(1, keepdims=True) * 10).astype("float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(32, activation="relu")(
        keras.layers.Dense(32, activation="relu")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    with nw.watch(model, on_nan="record") as w:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "divergence"
    assert "Training diverged: the weights grew" in diagnosis.summary
    assert any(line.startswith("The weights' abs max (summed over modules) grew")
               for line in diagnosis.evidence)

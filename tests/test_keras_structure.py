"""Keras 3 models on the torch backend, as Keras builds and trains them: small seeded models,
no downloads. Keras is optional: these tests skip without it."""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = pytest.importorskip("keras", reason="Keras 3 with KERAS_BACKEND=torch")
if keras.backend.backend() != "torch":
    pytest.skip("these tests need KERAS_BACKEND=torch", allow_module_level=True)

from keras import layers, ops  # noqa: E402

import nanwidget as nw  # noqa: E402


def _log_of_inputs_model(seed: int = 0) -> keras.Model:
    """log of the inputs, then two Dense layers: a negative input value gives NaN."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8,))
    x = layers.Lambda(lambda t: ops.log(t), name="log")(inp)
    x = layers.Dense(16, name="hidden")(x)
    out = layers.Dense(3, name="head")(x)
    return keras.Model(inp, out)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_fit_and_evaluate_rebuilding_keras_torch_params_leave_the_model_replayable(mode):
    # Every fit() and evaluate() builds a new `_torch_params` ParameterDict around the same
    # Parameters: the model the watch hooked has not changed.
    model = _log_of_inputs_model()
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 2.0, size=(16, 8)).astype("float32")
    y = np.zeros((16, 3), "float32")
    with nw.watch(model, mode=mode, on_nan="record") as watch:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert watch.event is None
        x[3, 5] = -1.0  # log(-1): NaN in row 3
        model.evaluate(x, y, batch_size=16, verbose=0)
        event = watch.event
        report = watch.report()
        trace = watch.replay(event.batch)
    assert "replaced" not in report and "not the one this watch hooked" not in report
    assert event.diagnosis.kind == "domain" and event.diagnosis.rows == [3]
    assert trace.reproduced and trace.changes == [] and trace.first_bad["op"] == "log"


def _users_log(t):
    return ops.log(t)  # the user's log of negatives


def test_a_keras_op_is_named_at_the_users_line_not_in_keras_backend():
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    x = layers.Lambda(_users_log)(layers.Dense(16)(inp))
    model = keras.Model(inp, layers.Dense(3)(x))
    with nw.watch(model, on_nan="record") as watch:
        model(torch.from_numpy(np.random.default_rng(0).normal(size=(4, 8)).astype("float32")))
        trace = watch.replay(watch.event.batch)
    _, first = inspect.getsourcelines(_users_log)
    user_line = f"{inspect.getsourcefile(_users_log)}:{first + 1}"
    assert trace.first_bad["op"] == "log" and trace.first_bad["source"] == user_line
    assert user_line in watch.event.diagnosis.suggestion[0]
    sources = trace.ops["source"]
    assert not sources.str.contains("keras/src/backend").any()
    assert sources.str.contains("keras/src/layers/core/dense.py").any()  # Dense's own lines stay


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_keras_symbolic_build_before_fit_is_no_batch(mode):
    # fit() first runs the model once on meta tensors (no data): batch 0 is its first step.
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    model = keras.Model(inp, layers.Dense(3)(layers.Dense(16)(inp)))
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    x[2, 0] = np.nan  # in the first step, row 2
    y = np.zeros((16, 3), "float32")
    with nw.watch(model, mode=mode, on_nan="record", trace_batches=(0,)) as watch:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        assert watch.batch == 2  # two steps
        assert watch.event.batch == 0 and watch.event.diagnosis.rows == [2]
        traced = watch.frames(batch=0)
    assert len(traced) and not (traced["note"] == "meta").any()

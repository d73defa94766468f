"""skorch: NeuralNetClassifier builds the module itself (net.module_) and runs its own loop."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch
from torch import nn

skorch = pytest.importorskip("skorch", reason="skorch is not installed: pip install skorch")

import nanwidget as nw  # noqa: E402
from tests.conftest import hook_count  # noqa: E402


class MLP(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, X):
        return self.fc2(torch.relu(self.fc1(X)))


def _data(rows: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(0)
    return rs.randn(rows, 8).astype("float32"), rs.randint(0, 3, rows).astype("int64")


def _net(**options) -> skorch.NeuralNetClassifier:
    torch.manual_seed(0)
    settings = dict(max_epochs=2, lr=0.1, batch_size=16, verbose=0, train_split=None,
                    criterion=nn.CrossEntropyLoss)
    return skorch.NeuralNetClassifier(MLP, **{**settings, **options})


def test_watching_net_module_then_calling_fit_says_at_close_that_it_checked_nothing():
    # fit() re-initializes: a new net.module_ trained while the watch sat on the old one, and
    # close() said nothing.
    X, y = _data()
    net = _net()
    net.initialize()
    watch = nw.watch(net.module_)
    net.fit(X, y)
    assert watch.model is not net.module_
    with pytest.warns(UserWarning, match=r"checked nothing: its MLP was never called while 8 "
                                         r"optimizer steps ran.*skorch's net.fit\(X, y\) makes "
                                         r"a new net.module_.*net.partial_fit\(X, y\)"):
        watch.close()


def test_a_watched_module_trained_by_partial_fit_trains_and_pickles_as_unwatched(recwarn):
    X, y = _data()
    plain = _net()
    plain.initialize()
    plain.partial_fit(X, y)
    net = _net()
    net.initialize()
    with nw.watch(net.module_, backward=True) as watch:
        net.partial_fit(X, y)
        copy = pickle.loads(pickle.dumps(net))
    assert watch.batch == 8 and watch.event is None
    assert [h["train_loss"] for h in net.history] == [h["train_loss"] for h in plain.history]
    assert np.array_equal(net.predict_proba(X), plain.predict_proba(X))
    assert np.array_equal(copy.predict_proba(X), plain.predict_proba(X))
    assert hook_count(net.module_) == 0 and hook_count(copy.module_) == 0
    assert not [w for w in recwarn if "nanwidget" in str(w.message)]


def test_a_nan_in_the_data_names_the_batch_and_row():
    X, y = _data()
    X[37, 2] = np.nan                                   # batch 2 (16 rows a batch), row 5
    net = _net()
    net.initialize()
    with nw.watch(net.module_) as watch, pytest.raises(nw.NanDetected):
        net.partial_fit(X, y)
    event = watch.event
    assert (event.batch, event.module, event.role) == (2, "fc1", "input[0]")
    assert event.diagnosis.kind == "bad-data" and event.diagnosis.rows == [5]


def test_nanwatch_cell_around_fit_says_once_that_fit_built_a_new_module_and_how_to_watch_it():
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output
    X, y = _data()
    net = _net()
    net.initialize()
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nanwidget")
    shell.user_ns.update(net=net, X=X, y=y)
    try:
        with capture_output() as captured, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shell.run_cell("%%nanwatch net.module_\nnet.fit(X, y)\n")
    finally:
        shell.run_line_magic("unload_ext", "nanwidget")
        for name in ("net", "X", "y"):
            shell.user_ns.pop(name, None)
    assert "net.initialize() in an earlier cell, then net.partial_fit(X, y) under " \
           "%%nanwatch net.module_" in captured.stdout
    assert not [w for w in caught if "nanwidget" in str(w.message)]     # said once, not twice


def test_a_learning_rate_too_high_is_fixed_in_the_nets_own_parameters_and_callbacks():
    # The fixes said torch.optim.lr_scheduler and clip_grad_norm_(model.parameters()), which a
    # skorch loop sets through the net's lr= and its callbacks.
    rs = np.random.RandomState(0)
    X, y = (rs.randn(160, 8) * 3).astype("float32"), rs.randn(160, 1).astype("float32")
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                           nn.Linear(32, 1))
    net = skorch.NeuralNetRegressor(module, lr=2.0, max_epochs=10, batch_size=16, verbose=0,
                                    train_split=None)
    net.initialize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(net.module_) as watch, pytest.raises(nw.NanDetected):
            net.partial_fit(X, y)
    diagnosis = watch.event.diagnosis
    assert diagnosis.kind == "divergence"
    assert diagnosis.suggestion[0].startswith(
        "Lower the net's learning rate (try 10x lower: lr= when you make the net, or "
        "net.set_params(lr=...))")
    assert "Clip the gradients before the step: callbacks=[skorch.callbacks."\
           "GradientNormClipping(gradient_clip_value=1.0)]." in diagnosis.suggestion
    assert not any("clip_grad_norm_" in fix for fix in diagnosis.suggestion)

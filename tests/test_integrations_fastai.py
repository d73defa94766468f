"""NanWatchCallback in fastai: a seeded tabular learner on 256 rows (6 training batches of 32,
then 2 validation batches), with fastai's own optimizer (not a torch one) and with to_fp16()."""

from __future__ import annotations

import copy
import math
import warnings
from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("fastai", reason="the fastai callback needs fastai: pip install fastai")

from fastai.callback.core import Callback  # noqa: E402
from fastai.callback.fp16 import MixedPrecision  # noqa: E402
from fastai.optimizer import Adam, OptimWrapper  # noqa: E402
from fastai.tabular.all import (Categorify, CategoryBlock, FillMissing, L, Normalize,  # noqa: E402
                                TabularDataLoaders, set_seed, tabular_learner)
from torch.amp import GradScaler, autocast  # noqa: E402

import nanwidget as nw  # noqa: E402
from nanwidget.integrations.fastai import NanWatchCallback  # noqa: E402

from conftest import hook_count  # noqa: E402

TRAIN_BATCHES = 6  # 192 rows of 32; batches 6 and 7 are the validation of epoch 0


@pytest.fixture(autouse=True)
def _quiet_fastai():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="fastai")
        warnings.filterwarnings("ignore", module="fastcore")
        yield


def _learner(opt_func=Adam):
    rows = np.random.RandomState(0)
    n = 256
    df = pd.DataFrame({"a": rows.randn(n), "b": rows.randn(n), "c": rows.choice(["x", "y", "z"], n)})
    df["y"] = ((df.a + df.b) > 0).astype(int)
    set_seed(1, reproducible=True)
    dls = TabularDataLoaders.from_df(df, procs=[Categorify, FillMissing, Normalize], cat_names=["c"],
                                     cont_names=["a", "b"], y_names="y", y_block=CategoryBlock(),
                                     bs=32, valid_idx=list(range(192, 256)), num_workers=0)
    return tabular_learner(dls, layers=[16, 8], n_out=2, opt_func=opt_func)


def _fit(learn, lr, *cbs, epochs=1):
    with learn.no_bar(), learn.no_logging():
        learn.fit(epochs, lr, cbs=list(cbs))


class CPUMixedPrecision(MixedPrecision):
    """fastai's MixedPrecision with autocast and GradScaler on the CPU (fastai hard-codes
    'cuda'); everything else, the scaler made in before_fit and dropped in after_fit included,
    is fastai's own."""

    def before_fit(self):
        self.kwargs["enabled"] = True
        self.autocast = autocast("cpu", dtype=torch.float16)
        self.learn.scaler, self.scales = GradScaler("cpu", **self.kwargs), L()
        self.seen = []

    def after_step(self):
        before = self.learn.scaler.get_scale()
        super().after_step()
        self.seen.append((before, self.learn.scaler.get_scale()))


def test_a_clean_fit_with_fastais_optimizer_runs_to_the_end_and_leaves_no_hooks():
    learn = _learner()
    callback = NanWatchCallback(log_dir=False)
    _fit(learn, 1e-2, callback, epochs=2)
    assert callback.event is None and callback.stop is None
    assert callback.watch.closed and hook_count(learn.model) == 0
    batches = callback.batches()
    assert len(batches) == 2 * (TRAIN_BATCHES + 2)
    assert list(batches.phase[:TRAIN_BATCHES + 2]) == ["train"] * TRAIN_BATCHES + ["eval"] * 2
    assert list(batches.step[:TRAIN_BATCHES]) == list(range(1, TRAIN_BATCHES + 1))
    assert list(batches["index"][TRAIN_BATCHES:TRAIN_BATCHES + 2]) == [0, 1]


@pytest.mark.parametrize("opt_func", ["fastai Adam", "OptimWrapper(torch Adam)"])
def test_validation_frames_show_the_weights_of_the_epochs_last_step(opt_func):
    # fastai's Adam writes through p.data: no torch step hook, no version bump. The validation
    # batch after the epoch's last step showed the weights from before that step.
    learn = _learner(Adam if opt_func == "fastai Adam"
                     else partial(OptimWrapper, opt=torch.optim.Adam))
    callback = NanWatchCallback(log_dir=False, trace_batches=(TRAIN_BATCHES,), max_frames=500)
    _fit(learn, 1e-1, callback)
    frames = callback.watch.frames(batch=TRAIN_BATCHES)
    assert callback.batches().phase[TRAIN_BATCHES] == "eval"
    shown = frames[(frames.module == "layers.0.0") & (frames.role == "weight")].abs_max.iloc[0]
    used = learn.model.layers[0][0].weight.abs().max().item()  # unchanged since the last step
    assert shown == pytest.approx(used, rel=0, abs=1e-7)


@pytest.mark.parametrize("mode", ["sentinel", "full"])
def test_a_nan_learning_rate_of_fastais_optimizer_is_named_and_stops_the_fit(mode):
    # lr=nan (fit_one_cycle(div=0.) does the same): the first step writes NaN into every weight.
    # It was told as "holds NaN since before the watch began ... no optimizer step in between"
    # (sentinel) or a generic write (full): fastai's optimizer steps were never seen.
    learn = _learner()
    assert all(bool(p.isfinite().all()) for p in learn.model.parameters())
    callback = NanWatchCallback(log_dir=False, mode=mode)
    _fit(learn, math.nan, callback)
    event, diagnosis = callback.event, callback.event.diagnosis
    assert (event.batch, event.origin, diagnosis.kind) == (1, "weight", "corrupted-weight")
    assert "step after batch 0, which ran with a non-finite learning rate (lr=nan)" \
        in diagnosis.summary
    assert "before the watch began" not in diagnosis.summary
    assert callback.stop is not None and callback.stop.step == 2
    assert len(callback.batches()) == 2  # the fit ended at the batch that found it
    assert callback.watch.closed and hook_count(learn.model) == 0


def test_to_fp16_steps_the_scaler_skips_are_no_event():
    # MixedPrecision makes its GradScaler in before_fit and drops it in after_fit: a user cannot
    # pass it as grad_scaler=. The callback does; a step skipped on overflow is the scaler's job.
    unwatched = CPUMixedPrecision(init_scale=2.0 ** 20)
    _fit(_learner(), 1e-2, unwatched)
    skipped = sum(after < before for before, after in unwatched.seen)
    assert skipped >= 1, "no step skipped: a useless test"

    learn, precision = _learner(), CPUMixedPrecision(init_scale=2.0 ** 20)
    callback = NanWatchCallback(log_dir=False, backward=True)
    _fit(learn, 1e-2, precision, callback)
    assert callback.event is None and callback.stop is None
    assert len(callback.watch.scaler_skips) == skipped
    assert precision.seen == unwatched.seen  # training went on exactly as unwatched
    assert learn.scaler is None and callback.watch.closed


def test_a_fit_that_raises_takes_the_hooks_off():
    learn = _learner()
    callback = NanWatchCallback(log_dir=False, on_nan="raise")
    with pytest.raises(nw.NanDetected):
        _fit(learn, math.nan, callback)
    assert callback.watch.closed and hook_count(learn.model) == 0
    assert nw.live_watches() == [] or all(w.model is not learn.model for w in nw.live_watches())


class _FailAtBatch(Callback):
    def before_batch(self):
        if self.learn.training and self.learn.iter == 2:
            raise RuntimeError("the data loader broke")


def test_a_fit_that_fails_elsewhere_takes_the_hooks_off():
    # fastai runs no after_fit when fit raises; it takes a fit(cbs=...) callback off the learner.
    learn = _learner()
    callback = NanWatchCallback(log_dir=False)
    with pytest.raises(RuntimeError, match="the data loader broke"):
        _fit(learn, 1e-2, _FailAtBatch(), callback)
    assert callback.watch.closed and hook_count(learn.model) == 0


class _RaiseOnNanLoss(Callback):
    """A loss check of the user's that raises (as neuralforecast's training_step does), after ours."""

    order = NanWatchCallback.order + 1

    def after_loss(self):
        if not bool(torch.isfinite(self.learn.loss_grad).all()):
            raise RuntimeError("Loss is NaN, training stopped.")


def test_a_fit_that_fails_on_a_nan_the_watch_found_tells_the_user_what_it_found(caplog):
    # The fit ends before the callback's look at the step: the user saw only the RuntimeError.
    learn = _learner()
    callback = NanWatchCallback(log_dir=False)
    with caplog.at_level("WARNING", logger="nanwidget.integrations"), \
            pytest.raises(RuntimeError, match="Loss is NaN"):
        _fit(learn, math.nan, _RaiseOnNanLoss(), callback)
    told = [r.getMessage() for r in caplog.records if r.name.startswith("nanwidget")]
    assert len(told) == 1, told
    assert told[0].startswith("nanwidget: training ended with RuntimeError (")
    assert "in batch 1 (training step 2, micro-batch 0) at module" in told[0]
    assert "Why (corrupted-weight): " in told[0] and "(lr=nan)" in told[0]
    assert callback.stop is None and callback.event.batch == 1
    assert callback.watch.closed and hook_count(learn.model) == 0


def test_a_deep_copy_that_ran_the_fit_reports_into_the_callback_the_user_holds():
    learn = _learner()
    callback = NanWatchCallback(log_dir=False)
    _fit(learn, math.nan, copy.deepcopy(callback))
    assert callback.stop is not None and callback.stop.step == 2
    assert callback.event.batch == 1 and callback.watch.closed
    assert hook_count(learn.model) == 0

"""NanWatchCallback in Lightning: a tiny LightningModule, single process and 2-process DDP (gloo)."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

pl = pytest.importorskip(
    "lightning.pytorch", reason="the Lightning callback needs the lightning extra: pip install -e .[lightning]")
import lightning.fabric  # noqa: E402  (the Fabric tests below; the same package)

import nanwidget as nw  # noqa: E402
from nanwidget.integrations.lightning import NanWatchCallback  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "scripts"))
from lightning_nan import (POISONED, PoisonAtStep, TinyRegressor, changed_parameters,  # noqa: E402
                           hook_count, loader, trainer)


@pytest.fixture(autouse=True)
def _quiet_lightning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        yield


def _fit(tmp_path, model, callbacks, **options):
    fit = trainer(str(tmp_path / "root"), callbacks, **options)
    fit.fit(model, loader(), loader(16))
    return fit


def test_poisoned_at_step_3_stops_at_step_3_before_the_nan_step(tmp_path):
    model = TinyRegressor()
    poison, callback = PoisonAtStep(3), NanWatchCallback()
    fit = _fit(tmp_path, model, [poison, callback])
    assert fit.global_step == 3 and fit.should_stop                   # of 8 steps in the epoch
    assert callback.stop.step == 3 and callback.stop.phase == "train"
    assert (callback.event.module, callback.event.origin) == (POISONED, "weight")
    assert "training step 3, micro-batch 0" in callback.stop.reason
    assert f"Why (corrupted-weight): '{POISONED}.weight' became NaN " in callback.stop.summary()
    assert changed_parameters(model, poison.snapshot) == [f"{POISONED}.weight"]
    assert hook_count(model) == 0 and callback.watch.closed
    run = nw.load_run(tmp_path / "root" / "nanwidget" / "run-0")
    assert run.event.module == POISONED


def test_clean_fit_runs_to_the_end_numbers_validation_batches_and_leaves_no_hooks(tmp_path):
    model = TinyRegressor()
    callback = NanWatchCallback(log_dir=False)
    fit = _fit(tmp_path, model, [callback], max_epochs=2, val_check_interval=4)
    assert fit.global_step == 16 and callback.stop is None and callback.event is None
    assert hook_count(model) == 0
    table = callback.batches()
    train, val = table[table.phase == "train"], table[table.phase == "eval"]
    assert list(train["step"]) == list(range(1, 17))
    assert len(val) == 4 * 2 and set(val["step"]) == {4, 8, 12, 16}    # 2 val batches each
    assert list(table["batch"]) == list(range(len(table)))


def test_a_nan_loss_made_in_training_step_is_caught_there(tmp_path):
    model = TinyRegressor(nan_loss_at=2)
    callback = NanWatchCallback(log_dir=False)
    fit = _fit(tmp_path, model, [callback])
    assert fit.global_step == 2 and callback.event is None
    assert callback.stop.reason.startswith("nan loss in batch 1 (training step 2, micro-batch 0)")


class ThroughForward(TinyRegressor):
    """TinyRegressor whose training_step calls the model's own forward, self(x)."""

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.nan_loss_at is not None and self.trainer.global_step == self.nan_loss_at - 1:
            loss = loss * torch.log(torch.tensor(-1.0))
        return loss


def test_a_nan_loss_in_sentinel_mode_says_what_the_sentinel_saw_not_that_no_module_did(tmp_path):
    # TinyRegressor's training_step calls self.net(x): the root forward never runs, so the
    # sentinel checked nothing and cannot tell where the NaN came from.
    callback = NanWatchCallback(log_dir=False, mode="sentinel")
    fit = _fit(tmp_path / "direct", TinyRegressor(nan_loss_at=2), [callback])
    assert fit.global_step == 2 and callback.event is None
    reason = callback.stop.reason
    assert reason.startswith("nan loss in batch 1 (training step 2, micro-batch 0); ")
    assert "no watched module output" not in reason and "saw none in this step" in reason
    assert "where the NaN was made is unknown" in reason and "self(x)" in reason
    # Through self(x) the sentinel saw the model's output finite: the NaN came after it.
    callback = NanWatchCallback(log_dir=False, mode="sentinel")
    fit = _fit(tmp_path / "forward", ThroughForward(nan_loss_at=2), [callback])
    assert fit.global_step == 2 and callback.event is None
    reason = callback.stop.reason
    assert "no watched module output" not in reason and "which was finite in this step" in reason


def test_gradient_accumulation_counts_micro_batches(tmp_path):
    model = TinyRegressor()
    poison, callback = PoisonAtStep(3), NanWatchCallback(log_dir=False)
    fit = _fit(tmp_path, model, [poison, callback], accumulate_grad_batches=2)
    assert fit.global_step == 3 and callback.stop.step == 3
    table = callback.batches()
    train = table[table.phase == "train"]  # Lightning validates once more when it stops
    assert list(train["step"]) == [1, 1, 2, 2, 3, 3] and list(train["index"]) == [0, 1] * 3
    assert callback.event.batch == 4
    assert changed_parameters(model, poison.snapshot) == [f"{POISONED}.weight"]


def test_bf16_mixed_stops_before_the_nan_step(tmp_path):
    model = TinyRegressor()
    poison, callback = PoisonAtStep(3), NanWatchCallback(log_dir=False)
    fit = _fit(tmp_path, model, [poison, callback], precision="bf16-mixed")
    assert fit.global_step == 3 and callback.event.module == POISONED
    assert changed_parameters(model, poison.snapshot) == [f"{POISONED}.weight"]


def test_log_trends_writes_per_module_abs_max_to_the_csv_logger(tmp_path):
    logger = pl.loggers.CSVLogger(str(tmp_path / "logs"))
    callback = NanWatchCallback(log_dir=False, log_trends=True, trends_every=2,
                                trend_modules=["net.*"])
    _fit(tmp_path, TinyRegressor(), [callback], logger=logger)
    import pandas as pd
    metrics = pd.read_csv(Path(logger.log_dir) / "metrics.csv")
    columns = sorted(c for c in metrics.columns if c.startswith("nanwidget/"))
    assert columns == ["nanwidget/abs_max/net.0", "nanwidget/abs_max/net.1", "nanwidget/abs_max/net.2"]
    rows = metrics.dropna(subset=["nanwidget/abs_max/net.0"])
    assert list(rows["step"]) == [2, 4, 6, 8]
    assert (rows["nanwidget/abs_max/net.1"] <= 1.0).all()               # tanh outputs


def test_on_nan_raise_raises_out_of_fit_and_on_exception_removes_the_hooks(tmp_path):
    model = TinyRegressor()
    callback = NanWatchCallback(on_nan="raise", log_dir=False)
    with pytest.raises(nw.NanDetected) as raised:
        _fit(tmp_path, model, [PoisonAtStep(3), callback])
    assert raised.value.event.module == POISONED and hook_count(model) == 0


def test_an_exception_in_training_step_removes_the_hooks(tmp_path):
    class Failing(TinyRegressor):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise ValueError("user code failed")
            return super().training_step(batch, batch_idx)

    model = Failing()
    with pytest.raises(ValueError, match="user code failed"):
        _fit(tmp_path, model, [NanWatchCallback(log_dir=False)])
    assert hook_count(model) == 0


class RaisesOnNonFiniteLoss(TinyRegressor):
    """neuralforecast's training_step: a non-finite loss raises before backward; pytorch-forecasting's
    swaps it for a constant without grad_fn, so that backward raises instead."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if not torch.isfinite(loss):
            if self.style == "raise":
                raise RuntimeError("Loss is NaN, training stopped.")
            loss = torch.tensor(1e9)
        return loss


@pytest.mark.parametrize("style", ["raise", "constant"])
def test_a_fit_that_fails_on_a_nan_the_watch_found_tells_the_user_what_it_found(
        tmp_path, caplog, style):
    model = RaisesOnNonFiniteLoss(style)
    callback = NanWatchCallback(log_dir=False)
    with caplog.at_level("WARNING", logger="nanwidget.integrations"), \
            pytest.raises(RuntimeError, match="Loss is NaN|does not require grad"):
        _fit(tmp_path, model, [PoisonAtStep(3), callback])
    told = [r.getMessage() for r in caplog.records if r.name.startswith("nanwidget")]
    assert len(told) == 1, told
    assert told[0].startswith("nanwidget: training ended with RuntimeError (")
    assert f"nan in batch 2 (training step 3, micro-batch 0) at module '{POISONED}'" in told[0]
    assert f"Why (corrupted-weight): '{POISONED}.weight' became NaN " in told[0]
    assert callback.stop is None and callback.event.module == POISONED
    assert hook_count(model) == 0 and callback.watch.closed


def test_a_fit_that_fails_with_nothing_found_adds_no_nanwidget_message(tmp_path, caplog):
    class Failing(TinyRegressor):
        def training_step(self, batch, batch_idx):
            raise ValueError("user code failed")

    with caplog.at_level("WARNING", logger="nanwidget.integrations"), \
            pytest.raises(ValueError, match="user code failed"):
        _fit(tmp_path, Failing(), [NanWatchCallback(log_dir=False)])
    assert not [r for r in caplog.records if r.name.startswith("nanwidget")]


def test_a_deep_copy_that_ran_the_fit_reports_into_the_callback_the_user_holds(tmp_path):
    # neuralforecast deep-copies each model with its trainer kwargs, callbacks included: the
    # copy ran the fit, and the user's callback said nothing (event, stop, watch all None).
    model, callback = TinyRegressor(), NanWatchCallback()
    copied = copy.deepcopy(copy.deepcopy(callback))            # a copy of a copy, as well
    fit = _fit(tmp_path, model, [PoisonAtStep(3), copied])
    assert fit.global_step == 3 and fit.should_stop
    assert callback.stop.step == 3 and callback.event.module == POISONED
    assert callback.watch is copied.watch and callback.stop is copied.stop
    assert f"at module '{POISONED}'" in callback.report()
    assert list(callback.batches()["step"][:3]) == [1, 2, 3]
    assert callback.watch.log_dir == str(tmp_path / "root" / "nanwidget" / "run-0")
    assert hook_count(model) == 0


def test_copies_and_pickles_of_a_callback_that_ran_carry_its_options_not_its_run(tmp_path):
    callback = NanWatchCallback(log_dir=False, backward=True)
    _fit(tmp_path, TinyRegressor(), [PoisonAtStep(3), callback])
    for duplicate in (copy.deepcopy(callback), pickle.loads(pickle.dumps(callback))):
        assert duplicate.watch is None and duplicate.stop is None and duplicate.event is None
        assert duplicate.watch_options == {"backward": True} and duplicate.log_dir is False
    assert callback.stop.step == 3                              # the original keeps its own


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="trends_every"):
        NanWatchCallback(trends_every=0)
    with pytest.raises(TypeError, match="unknown nw.watch option"):
        NanWatchCallback(frames=3)


@pytest.mark.slow
def test_ddp_with_two_cpu_processes_stops_both_at_step_3(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    finished = subprocess.run(
        [sys.executable, str(REPO / "tests" / "scripts" / "lightning_nan.py"), "--out",
         str(tmp_path / "out"), "--devices", "2", "--poison-rank", "1", "--poison-step", "3"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    decoder = json.JSONDecoder()
    results = {r["rank"]: r for r in (decoder.raw_decode(chunk)[0]
                                      for chunk in finished.stdout.split("RESULT ")[1:])}
    assert sorted(results) == [0, 1] and results[0]["world"] == 2
    for rank in (0, 1):
        result = results[rank]
        assert (result["global_step"], result["stop_step"], result["phase"]) == (3, 3, "train")
        assert result["hooks"] == 0 and result["exchanges"] == 3      # one flag per step
        assert POISONED in result["reason"] and "on rank 1" in result["reason"]
    assert results[1]["event_module"] == POISONED and results[0]["event_module"] is None
    assert results[1]["changed"] == [f"{POISONED}.weight"] and results[0]["changed"] == []
    run = nw.load_run(results[0]["log_dir"])
    assert run.ranks == [0, 1] and run.event.rank == 1 and run.event.module == POISONED


def test_16_mixed_gradient_overflows_the_plugins_scaler_skips_do_not_stop_the_fit(tmp_path):
    # Lightning makes no GradScaler on CPU: the precision plugin is given the one it makes on
    # a GPU. The scale starts at 2**22 and overflows float16 gradients a few times.
    from lightning.pytorch.plugins.precision import MixedPrecision
    import torch
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22)
    model = TinyRegressor()
    callback = NanWatchCallback(log_dir=False, backward=True)
    fit = _fit(tmp_path, model, [callback],
               plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert callback.stop is None and fit.global_step == 8
    assert callback.watch.grad_scaler is scaler  # found by the callback
    skips = callback.watch.scaler_skips
    assert skips and skips[0].scale_before == 2.0 ** 22
    assert skips[-1].scale_after == scaler.get_scale()
    assert not callback.watch.events and hook_count(model) == 0


class GrowWeight(pl.Callback):
    """Multiplies ``net.0``'s weight by 10 at each training batch: its output grows 10x a step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import torch
        with torch.no_grad():
            pl_module.net[0].weight.mul_(10.0)


def test_early_warnings_go_to_the_trainer_loggers(tmp_path):
    logger = pl.loggers.CSVLogger(str(tmp_path / "logs"))
    callback = NanWatchCallback(log_dir=False)
    with pytest.warns(nw.EarlyWarningIssued, match="'net.0'"):
        fit = _fit(tmp_path, TinyRegressor(), [GrowWeight(), callback], logger=logger,
                   max_steps=6)
    assert fit.global_step == 6 and callback.stop is None  # a warning never stops training
    warning = callback.watch.warnings[0]
    assert (warning.module, warning.reason) == ("net.0", "growth")
    import pandas as pd
    metrics = pd.read_csv(Path(logger.log_dir) / "metrics.csv")
    rows = metrics.dropna(subset=["nanwidget/early_warning/net.0/growth"])
    assert list(rows["nanwidget/early_warning/net.0/growth"]) == pytest.approx([warning.abs_max])
    assert list(rows["nanwidget/early_warnings"]) == [len(callback.watch.warnings)]


class SqrtOfZeroAtBatch(pl.LightningModule):
    """A regulariser sqrt(sum(out²)) whose output is zeroed at one batch: its gradient is NaN
    (0/0), its loss finite."""

    def __init__(self, bad_batch: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.bad_batch = bad_batch

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, index):
        x, y = batch
        out = self(x)
        regulariser = out * 0 if index == self.bad_batch else out
        return nn.functional.mse_loss(out, y) + 0.01 * torch.sqrt(regulariser.pow(2).sum())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_nan_gradient_in_an_accumulated_step_names_the_steps_micro_batches(tmp_path):
    # Checked before the optimizer step, at its last micro-batch: it said "in batch 7" alone
    # and blamed "gradient clipping or the DDP all-reduce" in a one-process run without either.
    callback = NanWatchCallback(log_dir=False)
    _fit(tmp_path, SqrtOfZeroAtBatch(bad_batch=5), [callback], accumulate_grad_batches=4)
    reason = callback.stop.reason
    assert callback.stop.step == 2
    assert reason.startswith("non-finite gradient norm in batch 7 (training step 2, micro-batch "
                             "3; the step's gradients accumulate batches 4-7, so any of them "
                             "may hold it)")
    assert "clipping" not in reason and "DDP" not in reason


# Lightning Fabric: fabric.setup(model) wraps the model in a _FabricModule that casts the
# inputs for the precision plugin and calls the model (or the strategy's wrapper around it).


def _fabric_setup(model, precision="32-true"):
    fabric = lightning.fabric.Fabric(accelerator="cpu", devices=1, precision=precision)
    fabric_model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    return fabric, fabric_model, optimizer


def test_watching_what_fabric_setup_returns_names_the_users_modules_and_its_own_lines():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    fabric, fabric_model, optimizer = _fabric_setup(model)
    watch = nw.watch(fabric_model)
    # It named them '_forward_module.0', ... and gave Fabric's wrappers.py as the op's line.
    assert watch.model is model and watch.module_names == ["", "0", "1", "2"]
    with torch.no_grad():
        model[2].weight.mul_(1e30)
    with pytest.raises(nw.NanDetected) as raised:
        fabric_model(torch.full((4, 8), 1e10))
    event = raised.value.event
    assert (event.batch, event.module, event.role) == (0, "2", "output")
    assert "_forward_module" not in event.diagnosis.summary
    assert "wrappers.py" not in event.diagnosis.summary
    with pytest.raises(RuntimeError, match="already watched"):
        nw.watch(model)        # the same model: refused, not hooked twice
    watch.close()
    assert hook_count(fabric_model) == 0


def _fabric_16_mixed():
    """A model and a Fabric whose "16-mixed" GradScaler (on CPU: float16 autocast)."""
    from lightning.fabric.plugins import MixedPrecision
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    return model, lightning.fabric.Fabric(accelerator="cpu", devices=1,
                                          plugins=[MixedPrecision("16-mixed", "cpu")])


def _train_with_fabric(fabric, fabric_model, optimizer, steps: int = 3) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):                              # float16 gradients overflow at 65536
        x = torch.randn(16, 8, generator=generator) * 100
        y = torch.randn(16, 1, generator=generator)
        fabric.backward(nn.functional.mse_loss(fabric_model(x), y * 1000))
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("placement", ["watch what setup returns", "grad_scaler=fabric"])
def test_steps_that_fabrics_grad_scaler_skips_under_16_mixed_are_no_events(placement):
    # Watching the fabric model, every skipped step was an event; grad_scaler=fabric was refused.
    model, fabric = _fabric_16_mixed()
    if placement == "grad_scaler=fabric":
        watch = nw.watch(model, backward=True, grad_scaler=fabric)
    fabric_model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    if placement != "grad_scaler=fabric":
        watch = nw.watch(fabric_model, backward=True)
    _train_with_fabric(fabric, fabric_model, optimizer)
    assert watch.event is None
    assert [(s.batch, s.scale_before) for s in watch.scaler_skips] == [
        (0, 65536.0), (1, 32768.0), (2, 16384.0)]
    watch.close()
    full_precision = lightning.fabric.Fabric(accelerator="cpu", devices=1)
    with nw.watch(model, grad_scaler=full_precision) as unscaled:
        assert unscaled.grad_scaler is None                 # "32-true": nothing to skip


def test_a_fabric_scaler_overflow_without_grad_scaler_says_to_pass_fabric_not_scaler():
    # The loop has no variable named scaler (it is inside fabric): it said grad_scaler=scaler.
    model, fabric = _fabric_16_mixed()
    watch = nw.watch(model, backward=True)
    fabric_model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    with pytest.raises(nw.NanDetected) as raised:
        _train_with_fabric(fabric, fabric_model, optimizer, steps=1)
    watch.close()
    assert "pass it: nw.watch(model, grad_scaler=fabric)" in str(raised.value)
    assert "pass it: nw.watch(model, grad_scaler=fabric)." in watch.event.diagnosis.suggestion[0]


def test_fixes_under_fabric_name_its_precision_flag_and_clip_gradients():
    # They said "autocast with dtype=torch.bfloat16" and torch.nn.utils.clip_grad_norm_, which a
    # Fabric loop sets through Fabric(precision=...) and fabric.clip_gradients.
    model, fabric = _fabric_16_mixed()
    with torch.no_grad():
        model[2].weight.abs_().mul_(2000.0)
    watch = nw.watch(model)
    fabric_model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    with pytest.raises(nw.NanDetected):
        fabric_model(torch.full((4, 8), 300.0))         # '2' passes float16's 65504
    watch.close()
    diagnosis = watch.event.diagnosis
    assert (watch.event.module, diagnosis.kind) == ("2", "overflow")
    assert diagnosis.suggestion[0].endswith(
        '; or train in bfloat16: Fabric(precision="bf16-mixed").')

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    fabric, fabric_model, optimizer = _fabric_setup(model)
    optimizer.param_groups[0]["lr"] = 2.0               # diverges in a few steps
    watch = nw.watch(fabric_model)
    generator = torch.Generator().manual_seed(1)
    with pytest.raises(nw.NanDetected):
        for _ in range(30):
            x = torch.randn(16, 8, generator=generator) * 3
            y = torch.randn(16, 1, generator=generator)
            fabric.backward(nn.functional.mse_loss(fabric_model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    watch.close()
    diagnosis = watch.event.diagnosis
    assert diagnosis.kind == "divergence"
    assert "Clip the gradients before the step: fabric.clip_gradients(model, optimizer, " \
           "max_norm=1.0)." in diagnosis.suggestion
    assert not any("clip_grad_norm_" in fix or "torch.amp.GradScaler" in fix
                   for fix in diagnosis.suggestion)


def test_a_fabric_loops_inf_loss_after_a_climb_is_explained_as_a_divergence_in_fabrics_terms():
    # A Fabric loop has no callback: its own torch.isfinite(loss) check asks the watch why.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    fabric, fabric_model, optimizer = _fabric_setup(model)
    optimizer.param_groups[0]["lr"] = 0.1               # the weights climb until the MSE is inf
    generator = torch.Generator().manual_seed(1)
    with nw.watch(fabric_model) as watch:
        for _ in range(30):
            x = torch.randn(8, 8, generator=generator) * 3
            y = torch.randn(8, 1, generator=generator) * 3
            loss = nn.functional.mse_loss(fabric_model(x), y)
            if not torch.isfinite(loss):
                break
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        event = watch.explain_loss(loss)
    assert watch.events == [] and (event.batch, event.role) == (5, "loss")
    assert event.diagnosis.kind == "divergence"
    assert "Clip the gradients before the step: fabric.clip_gradients(model, optimizer, " \
           "max_norm=1.0)." in event.diagnosis.suggestion

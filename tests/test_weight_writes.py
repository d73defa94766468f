"""A frame's weight numbers are those of the weights the forward used, whatever wrote them.

Fused optimizer kernels (``fused=True``) write parameters without moving their version
counters; the watch learns of their steps from an optimizer-step hook. Every ``torch.optim``
optimizer is trained here in each form it supports on CPU (fused, foreach, for-loop), and after
every step the next forward's frames must show the new weights, in full mode and in sentinel
mode (sampled batches recorded live, and earlier batches replayed for an event's window).
"""

from __future__ import annotations

import inspect
import math
import os

import pytest
import torch
from torch import nn

import nanwidget as nw

from conftest import hook_count

BATCHES = 3
# Optimizers whose fused=True runs on CPU (torch 2.13); test_the_fused_list_is_complete keeps
# this list honest when torch adds more.
FUSED_ON_CPU = ("SGD", "Adam", "AdamW", "Adagrad")
OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop",
              "ASGD", "Adadelta", "Adafactor", "LBFGS", "Muon")
LEARNING_RATES = {"SGD": 0.5, "Adadelta": 50.0, "ASGD": 0.5, "LBFGS": 0.5, "Muon": 0.5,
                  "Rprop": 0.5}


def _forms(name: str) -> list[str]:
    parameters = inspect.signature(getattr(torch.optim, name).__init__).parameters
    forms = ["fused"] if name in FUSED_ON_CPU else []
    if "foreach" in parameters:
        forms += ["foreach", "for-loop"]
    return forms or ["for-loop"]


CASES = [(name, form) for name in OPTIMIZERS if hasattr(torch.optim, name)
         for form in _forms(name)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _optimizer(name: str, form: str, model: nn.Module) -> torch.optim.Optimizer:
    cls = getattr(torch.optim, name)
    options = {"lr": LEARNING_RATES.get(name, 0.1)}
    if form == "fused":
        options["fused"] = True
    elif "foreach" in inspect.signature(cls.__init__).parameters:
        options["foreach"] = form == "foreach"
    params = [p for p in model.parameters() if p.ndim == 2] if name == "Muon" else \
        model.parameters()  # Muon takes matrices only
    return cls(params, **options)


def _expected(model: nn.Module) -> dict[tuple[str, str], tuple[float, float]]:
    """(module, role) -> (abs min, abs max) of every parameter, now."""
    found = {}
    for module_name, module in model.named_modules():
        for role, parameter in module.named_parameters(recurse=False):
            values = parameter.detach().abs()
            found[(module_name, role)] = (values.min().item(), values.max().item())
    return found


def _frame_weights(watch: nw.NanWatch, batch: int) -> dict[tuple[str, str], tuple[float, float]]:
    frames = watch.frames(batch=batch)
    weights = frames[frames["role"].isin(["weight", "bias"]) & (frames["phase"] == "forward")]
    return {(row.module, row.role): (row.abs_min, row.abs_max)
            for row in weights.itertuples(index=False)}


def _assert_shown(shown: dict, expected: dict, where: str = "") -> None:
    """The frames' (abs min, abs max) per (module, role) equal the weights the forward used."""
    assert shown.keys() == expected.keys()
    for key, numbers in expected.items():
        assert shown[key] == pytest.approx(numbers, rel=1e-6, abs=1e-12), \
            f"{where}{key}: the frame shows {shown[key]}, the forward used {numbers}"


def _watch_options(mode: str) -> dict:
    options = {"trace_batches": range(BATCHES + 2), "on_nan": "record"}
    if mode == "sentinel":
        options.update(mode="sentinel", sample_every=1)  # every batch recorded live
    return options


def _train_and_compare(model: nn.Module, step, mode: str, batches: int = BATCHES) -> None:
    """Each batch: note the weights, run forward and backward, then ``step(batch)``; the
    frames of every batch must show the weights noted before its forward."""
    data = torch.Generator().manual_seed(1)
    expected = []
    with nw.watch(model, **_watch_options(mode)) as watch:
        for batch in range(batches):
            expected.append(_expected(model))
            x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
            model.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            step(batch, x, y)
        seen = [_frame_weights(watch, batch) for batch in range(batches)]
    assert not watch.events
    for batch in range(1, batches):
        assert expected[batch] != expected[batch - 1], "the step changed nothing: a useless test"
    for batch in range(batches):
        _assert_shown(seen[batch], expected[batch], f"batch {batch}, ")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("name,form", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_every_optimizer_in_every_form_shows_the_weights_each_forward_used(name, form, mode):
    model = _model()
    optimizer = _optimizer(name, form, model)

    def step(batch, x, y):
        if name == "LBFGS":
            def closure():
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            with nw.live_watches()[0].suspended():  # its extra forwards are not batches
                optimizer.step(closure)
        else:
            optimizer.step()
    _train_and_compare(model, step, mode)


def test_the_fused_list_is_complete():
    # Every optimizer that takes fused=True and runs it on CPU is tested in its fused form.
    runs_fused = []
    for name in OPTIMIZERS:
        cls = getattr(torch.optim, name, None)
        if cls is None or "fused" not in inspect.signature(cls.__init__).parameters:
            continue
        parameter = nn.Parameter(torch.randn(4, 4))
        try:
            optimizer = cls([parameter], lr=0.1, fused=True)
            parameter.grad = torch.randn(4, 4)
            optimizer.step()
        except (RuntimeError, ValueError, TypeError):
            continue
        runs_fused.append(name)
    assert tuple(runs_fused) == FUSED_ON_CPU


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_transformers_adafactor_shows_the_weights_each_forward_used(mode):
    optimization = pytest.importorskip("transformers.optimization")
    model = _model()
    optimizer = optimization.Adafactor(model.parameters(), lr=0.3, relative_step=False,
                                       scale_parameter=False)
    _train_and_compare(model, lambda batch, x, y: optimizer.step(), mode)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("how", ["load_state_dict", "load_state_dict(assign=True)",
                                 "torch._foreach_mul_", "p.data -= lr * p.grad",
                                 "fused step, then p.data.clamp_"])
def test_other_writers_between_batches_show_in_the_next_frames(how, mode):
    model = _model()
    fused = torch.optim.Adam(model.parameters(), lr=0.5, fused=True)

    def step(batch, x, y):
        with torch.no_grad():
            if how.startswith("load_state_dict"):
                state = {k: v * 1.5 + 0.01 for k, v in model.state_dict().items()}
                model.load_state_dict(state, assign="assign" in how)
            elif how == "torch._foreach_mul_":
                torch._foreach_mul_(list(model.parameters()), 1.5)
            elif how == "p.data -= lr * p.grad":  # no version counter moves
                for parameter in model.parameters():
                    parameter.data -= 0.5 * parameter.grad
            else:  # an update nothing sees after a step that moved no counter either
                fused.step()
                for parameter in model.parameters():
                    parameter.data.clamp_(-0.05 * (batch + 1), 0.05 * (batch + 1))
    _train_and_compare(model, step, mode)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_validation_forward_after_a_fused_step_shows_the_stepped_weights(mode):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    data = torch.Generator().manual_seed(1)
    with nw.watch(model, **_watch_options(mode)) as watch:
        model(torch.randn(8, 16, generator=data)).square().mean().backward()  # batch 0
        optimizer.step()
        after_step = _expected(model)
        model.eval()
        with torch.no_grad():
            model(torch.randn(8, 16, generator=data))  # batch 1: validation, no backward
        seen = _frame_weights(watch, 1)
    _assert_shown(seen, after_step)


@pytest.mark.parametrize("inference", ["eval", "no_grad"])
def test_inference_forwards_measure_the_weights_once(inference):
    # Nothing wrote them and no training forward ran: the measurements are reused.
    from nanwidget.core.stats import PendingStats
    model = _model()
    parameters = {id(p) for p in model.parameters()}
    measured = []
    original = PendingStats.add

    def counting(self, tensor, hold=True):
        if id(tensor) in parameters:
            measured.append(tensor)
        return original(self, tensor, hold)
    with nw.watch(model):
        PendingStats.add = counting
        try:
            for _ in range(4):
                if inference == "eval":
                    model.eval()(torch.randn(2, 16))
                else:
                    with torch.no_grad():
                        model(torch.randn(2, 16))
        finally:
            PendingStats.add = original
    assert len(measured) == 4  # two Linear layers, weight and bias, once


def test_a_sentinel_event_after_fused_steps_never_replays_an_earlier_batch_on_newer_weights():
    # The event's window wants the batches before it; they ran on weights that fused steps
    # changed since (no version counter moved), so replaying them now would show other
    # numbers: they are left out, and said so; with snapshot_weights they are replayed right.
    for snapshots in (False, True):
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.5, fused=True)
        data = torch.Generator().manual_seed(1)
        expected = []
        with nw.watch(model, mode="sentinel", on_nan="record", max_frames=100,
                      snapshot_weights=snapshots) as watch:
            for batch in range(3):
                expected.append(_expected(model))
                x = torch.randn(8, 16, generator=data)
                if batch == 2:
                    x[1, 3] = float("nan")
                model.zero_grad()
                model(x).square().mean().backward()
                optimizer.step()
            event = watch.event
        assert (event.batch, event.module, event.role, event.origin) == (2, "0", "input[0]",
                                                                         "input")
        frames = event.frames
        if not snapshots:
            assert set(frames["batch"]) == {2}
            assert "batch 1 was not recorded and its weights changed since it ran" \
                in event.frames_note
            continue
        assert set(frames["batch"]) == {0, 1, 2} and event.frames_note == ""
        for batch in (0, 1):
            weights = frames[(frames["batch"] == batch) & frames["role"].isin(["weight", "bias"])]
            shown = {(r.module, r.role): (r.abs_min, r.abs_max) for r in weights.itertuples()}
            _assert_shown(shown, expected[batch], f"batch {batch}, ")


def test_a_replay_after_a_fused_step_says_the_weights_changed():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, fused=True)
    with nw.watch(model) as watch:
        model(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()
        trace = watch.replay(0)
    assert trace.weights_changed
    assert sorted(trace.changed_weights) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert "0.weight: values changed since the batch ran (optimizer step or in-place write); " \
           "the replay used the current values" in trace.changes


def test_the_step_hook_is_on_while_a_watch_is_and_off_after():
    import gc
    from torch.optim import optimizer as torch_optimizer
    from nanwidget.core.state import optimizer_steps
    log = optimizer_steps()
    gc.collect()  # watches earlier tests dropped unclosed let go when collected
    users = log.users

    def registered() -> bool:
        hooks = torch_optimizer._global_optimizer_post_hooks.values()
        return any(hook is log_hook for hook in hooks)
    first, second = _model(), _model()
    with nw.watch(first):
        log_hook = next(iter(torch_optimizer._global_optimizer_post_hooks.values()))
        with nw.watch(second):
            assert log.users == users + 2 and registered()
        assert log.users == users + 1 and registered()
    assert log.users == users and registered() == (users > 0)
    nw.watch(_model())  # model and watch dropped without close(): let go when collected
    gc.collect()
    assert log.users == users
    assert hook_count(first) == 0


def test_the_trainers_default_fused_adamw_frames_show_each_steps_weights(tmp_path):
    # transformers' default optimizer is adamw_torch_fused: a user's Trainer run showed the
    # embedding's batch-0 numbers in every later frame.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
    from trainer_nan import TokenDataset, tiny_gpt2, training_args
    from nanwidget.integrations.transformers import NanWatchCallback

    class WeightsAtStepBegin(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.seen: list[float] = []

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            self.seen.append(model.transformer.wte.weight.detach().abs().max().item())

    model = tiny_gpt2()
    noted, callback = WeightsAtStepBegin(), NanWatchCallback(log_dir=False,
                                                             trace_batches=range(4))
    arguments = training_args(str(tmp_path / "out"), max_steps=4, learning_rate=0.05)
    assert arguments.optim == "adamw_torch_fused"  # the default: nothing chosen here
    transformers.Trainer(model=model, args=arguments, train_dataset=TokenDataset(32),
                         callbacks=[noted, callback]).train()
    shown = []
    for batch in range(4):
        frames = callback.watch.frames(batch=batch)
        row = frames[(frames["module"] == "transformer.wte") & (frames["role"] == "weight")]
        shown.append(float(row["abs_max"].iloc[0]))
    assert len(set(noted.seen)) == 4  # every step changed the embedding
    assert shown == pytest.approx(noted.seen, rel=1e-6)


@pytest.mark.parametrize("how", ["no gradient", "frozen", "scaler skipped a fused step"])
def test_a_step_that_wrote_no_parameter_is_no_change(how):
    # The step hook marks only what a step writes: torch's optimizers skip a parameter without
    # a gradient (a step before backward, a frozen parameter passed with model.parameters()),
    # and a fused step under a GradScaler that found Inf/NaN writes nothing.
    model = _model()
    if how == "frozen":
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        model[2].weight.requires_grad_(True)
    fused = how == "scaler skipped a fused step"
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    with nw.watch(model, backward=fused, grad_scaler=scaler if fused else None) as watch:
        with torch.autocast("cpu", dtype=torch.float16, enabled=fused):
            loss = model(torch.randn(8, 16)).float().square().mean()
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        if how == "frozen":
            loss.backward()
            optimizer.step()
        elif fused:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            assert len(watch.scaler_skips) == 1
        else:
            optimizer.step()  # before backward: no gradient yet
        trace = watch.replay(0)
    unchanged = sorted(n for n, p in model.named_parameters() if torch.equal(p, before[n]))
    assert sorted(trace.changed_weights) == sorted(set(before) - set(unchanged))


def test_a_frozen_weight_bad_in_the_checkpoint_is_not_blamed_on_a_step():
    # Sentinel mode: a frozen embedding row NaN since the load, first read at batch 4. The
    # optimizer holds it (model.parameters()) but skipped it every step (no gradient).
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = nn.Embedding(10, 8), nn.Linear(8, 2)

        def forward(self, t):
            return self.fc(self.emb(t).mean(1))

    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.emb.weight[7] = float("nan")
    model.emb.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nw.watch(model, mode="sentinel", on_nan="record") as watch:
        for batch in range(6):
            t = torch.randint(0, 7, (4, 5)) if batch < 4 else torch.full((4, 5), 7)
            optimizer.zero_grad()
            model(t).square().mean().backward()
            optimizer.step()
    diagnosis = watch.event.diagnosis
    assert (watch.event.batch, watch.event.module, diagnosis.kind) == (4, "emb", "corrupted-weight")
    assert "no in-place write and no optimizer step in between" in diagnosis.summary
    assert "likely since the optimizer step" not in diagnosis.summary


class _DataWritingSGD:
    """An optimizer-like object as fastai's Optimizer is one: torch's ``param_groups``, but no
    ``torch.optim.Optimizer`` (no step hook) and writes through ``p.data`` (no version bump)."""

    def __init__(self, params, lr: float) -> None:
        self.param_groups = [{"params": list(params), "lr": lr}]

    def step(self) -> None:
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    parameter.data.add_(parameter.grad, alpha=-group["lr"])
        nw.core.writes.note_optimizer_step(self)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_validation_forward_after_a_step_outside_torch_shows_the_stepped_weights(mode):
    model = _model()
    optimizer = _DataWritingSGD(model.parameters(), lr=0.5)
    data = torch.Generator().manual_seed(1)
    with nw.watch(model, **_watch_options(mode)) as watch:
        model(torch.randn(8, 16, generator=data)).square().mean().backward()  # batch 0
        optimizer.step()
        after_step = _expected(model)
        model.eval()
        with torch.no_grad():
            model(torch.randn(8, 16, generator=data))  # batch 1: validation, no backward
        seen = _frame_weights(watch, 1)
    _assert_shown(seen, after_step)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_learning_rate_of_an_optimizer_outside_torch_is_named(mode):
    model = _model()
    optimizer = _DataWritingSGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    options = {"on_nan": "record"} if mode == "full" else {"on_nan": "record", "mode": "sentinel"}
    with nw.watch(model, **options) as watch:
        for batch in range(4):
            x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
            model.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.param_groups[0]["lr"] = math.nan if batch == 1 else 0.1
            optimizer.step()
    diagnosis = watch.event.diagnosis
    assert (watch.event.batch, diagnosis.kind) == (2, "corrupted-weight")
    assert "_DataWritingSGD step after batch 1, which ran with a non-finite learning rate " \
        "(lr=nan)" in diagnosis.summary
    assert "before the watch began" not in diagnosis.summary


def test_the_capture_tells_a_closure_forward_from_a_plain_one():
    # LBFGS calls its closure (a forward) several times inside one step; a validation forward
    # after it runs outside any step. The diagnosis reads which is which.
    import gc
    import weakref
    from nanwidget.core.state import optimizer_steps
    torch.manual_seed(0)
    model = _model()
    x = torch.randn(8, 16)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)

    def closure():
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    with nw.watch(model, keep_batches=8) as w:
        model(x)  # batch 0: before any step
        optimizer.step(closure)  # batches 1.. : inside the step
        model(x)  # the last batch: after it
        capture = w.parts.capture
        inside = [capture.steps_in_progress(b) for b in capture.held_batches()]
        assert optimizer_steps().optimizer is None  # the step ended: no optimizer held
        assert weakref.ref(optimizer) in {r for r in optimizer_steps().optimizers.values()}
    assert inside[0] == [0] and inside[-1] == [0]
    closures = inside[1:-1]
    assert len(closures) >= 2 and all(s == closures[0] and s[0] > 0 for s in closures)
    assert not optimizer_steps().optimizers  # the last watch closed: none remembered
    ref = weakref.ref(optimizer)
    del optimizer, closure
    gc.collect()
    assert ref() is None


class _LibraryBatchNorm(nn.BatchNorm1d):
    """A BatchNorm subclass defined outside torch, as timm's BatchNormAct2d is."""


def test_running_statistics_a_library_batchnorm_s_forward_writes_inf_are_that_forward_s() -> None:
    # Buffers of modules from outside torch are measured before their forward too (an EMA
    # codebook rewritten through .data); running statistics written by that forward must still
    # be told as written in this batch's own forward, not by a load after it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _LibraryBatchNorm(8), nn.Linear(8, 2))
    with nw.watch(model, on_nan="record") as watch:
        model(torch.randn(16, 4))
        x = torch.randn(16, 4)
        x[0] = 1e20  # its square overflows float32 in the running statistics
        model(x)
    event = watch.event
    assert (event.batch, event.module) == (1, "1")
    assert "in batch 1's own forward" in event.diagnosis.summary

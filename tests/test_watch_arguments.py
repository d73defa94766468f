"""nw.watch() checks every option before it hooks anything: misuse gets one clear error that
names the option, a likely typo gets a warning with the close match."""

from __future__ import annotations

import gc
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import nanwidget as nw
from nanwidget.core.watch import SkipTypesWarning

from conftest import TinyMLP, hook_count


@pytest.mark.parametrize("options, error, message", [
    (dict(trace_batches="12"), TypeError, "trace_batches takes batch numbers, got the text '12'"),
    (dict(trace_batches=[-1, 2.7]), ValueError, "these are not: -1, 2.7"),
    (dict(trace_batches=[True]), ValueError, "these are not: True"),
    (dict(trace_batches=None), TypeError, "trace_batches takes batch numbers"),
    (dict(abort_after=True), TypeError, "abort_after must be a whole number, got True"),
    (dict(abort_after=2.0), TypeError, "abort_after must be a whole number, got 2.0"),
    (dict(abort_after=-1), ValueError, "abort_after must be at least 0"),
    (dict(backward="no"), TypeError, "backward must be True or False, got 'no'"),
    (dict(replay_on_nan=1), TypeError, "replay_on_nan must be True or False"),
    (dict(snapshot_weights="yes"), TypeError, "snapshot_weights must be True or False"),
    (dict(grad_norm_warn="x"), TypeError, "grad_norm_warn must be a positive number or None, got 'x'"),
    (dict(grad_norm_warn=0), ValueError, "grad_norm_warn must be a positive finite number"),
    (dict(grad_norm_warn=float("nan")), ValueError, "grad_norm_warn must be a positive finite"),
    (dict(log_dir=123), TypeError, "log_dir must be a directory path (str or pathlib.Path), got 123"),
    (dict(max_frames=99999999999999999999), ValueError, "max_frames must be at least 1 and at most"),
    (dict(max_frames=0), ValueError, "max_frames must be at least 1"),
    (dict(max_events=0), ValueError, "max_events must be at least 1"),
    (dict(keep_batches=-1), ValueError, "keep_batches must be at least 0"),
    (dict(on_nan="sometimes"), ValueError, "on_nan must be one of raise, warn, record"),
    (dict(on_nan=None), ValueError, "on_nan must be one of"),
    (dict(skip_types=[3]), TypeError, "skip_types takes nn.Module classes or class names, got 3"),
    (dict(skip_types=5), TypeError, "skip_types takes nn.Module classes or class names"),
    (dict(mode="fast"), ValueError, "mode must be 'full' or 'sentinel', got 'fast'"),
    (dict(mode="sentinel", sample_every=0), ValueError, "sample_every must be at least 1"),
    (dict(mode="sentinel", sample_every=2.5), TypeError, "sample_every must be a whole number"),
    (dict(sample_every=5), ValueError, "sample_every is for mode='sentinel'"),
    (dict(mode="full", sample_every=5), ValueError, "sample_every is for mode='sentinel'"),
])
def test_misuse_names_the_option_and_hooks_nothing(tiny_mlp, options, error, message):
    with pytest.raises(error) as raised:
        nw.watch(tiny_mlp, **options)
    assert message in str(raised.value)
    assert hook_count(tiny_mlp) == 0 and nw.live_watches() == []


@pytest.mark.parametrize("container", [nn.ModuleDict, nn.ModuleList])
def test_sentinel_mode_refuses_a_root_without_a_forward(container):
    """A GAN watched as ModuleDict({'G': G, 'D': D}) calls G and D, never the root: a sentinel
    watch (it checks the root's calls only) would check nothing and say nothing."""
    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 1)]
    model = container({"G": parts[0], "D": parts[1]} if container is nn.ModuleDict else parts)
    with pytest.raises(ValueError, match=f"this {container.__name__} has no forward"):
        nw.watch(model, mode="sentinel", backward=True)
    assert hook_count(model) == 0 and nw.live_watches() == []
    with nw.watch(model, on_nan="record") as w:  # full mode checks the modules' own calls
        parts[1](parts[0](torch.full((2, 4), float("nan"))))
    assert w.event is not None and w.event.module.endswith("0")


def test_sentinel_mode_takes_a_forward_set_on_the_instance():
    model = nn.Module()
    model.body = nn.Linear(4, 2)
    model.forward = lambda x: model.body(x)
    with nw.watch(model, mode="sentinel", on_nan="record") as w:
        model(torch.full((2, 4), float("nan")))
    assert w.event is not None and w.event.diagnosis.kind == "bad-data"


class GeneratorAndCritic(nn.Module):
    """A GAN kept in one module with a forward, trained by calling ``G`` and ``D`` directly."""

    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Linear(4, 4)
        self.D = nn.Linear(4, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.D(self.G(z))


@pytest.mark.parametrize("fused", [False, True])
def test_sentinel_mode_says_it_checked_nothing_when_the_model_is_trained_without_being_called(
        fused):
    # The loop calls model.G and model.D, never model(z): sentinel mode checked nothing and
    # said nothing, NaN loss included. Fused optimizers move no version counter.
    torch.manual_seed(0)
    model = GeneratorAndCritic()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
    w = nw.watch(model, mode="sentinel")
    for step in range(3):
        loss = model.D(model.G(torch.randn(2, 4))).mean() * (math.nan if step == 2 else 1.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert w.event is None
    said = "Sentinel mode checked nothing: this GeneratorAndCritic was never called while " \
        "the weights of its modules G, D were updated"
    assert said in w.report()
    assert "(nw.watch(model.G, mode='sentinel'), one watch each)" in w.report()
    with pytest.warns(UserWarning, match=said):
        w.close()
    assert hook_count(model) == 0


class GraphAutoEncoder(nn.Module):
    """Trained through its methods (``encode``, ``decode``), as PyG's GAE is: its forward is
    never called."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 3)
        self.decoder = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


@pytest.mark.parametrize("holder", ["methods", "sequential"])
def test_the_checked_nothing_note_names_a_module_of_this_model(holder):
    # It said "nw.watch(model.G, ...)" (the README's GAN) to a GAE user, whose model has no G.
    torch.manual_seed(0)
    model = GraphAutoEncoder() if holder == "methods" else nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nw.watch(model, mode="sentinel")
    (model.decoder(model.encode(torch.randn(2, 4))) if holder == "methods"
     else model[0](torch.randn(2, 4))).square().mean().backward()
    optimizer.step()
    example = "model.encoder" if holder == "methods" else "model[0]"
    assert f"(nw.watch({example}, mode='sentinel'), one watch each)" in w.report()
    assert "model.G" not in w.report()
    with pytest.warns(UserWarning, match="checked nothing"):
        w.close()


def test_sentinel_mode_says_nothing_of_a_model_it_checked_or_that_was_not_trained():
    torch.manual_seed(0)
    model = GeneratorAndCritic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nw.watch(model, mode="sentinel") as idle:
            pass
        with nw.watch(model, mode="sentinel") as called:
            model(torch.randn(2, 4)).mean().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert "checked nothing" not in idle.report() + called.report()


def test_log_dir_at_a_file_is_refused_and_the_file_left_alone(tiny_mlp, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    with pytest.raises(ValueError, match="log_dir must be a directory; .*notes.txt' is a file"):
        nw.watch(tiny_mlp, log_dir=target)
    assert target.read_text() == "mine" and hook_count(tiny_mlp) == 0


def test_batch_numbers_may_be_numpy_or_torch_integers_or_one_number(tiny_mlp):
    with nw.watch(tiny_mlp, trace_batches=np.array([1, 3]), abort_after=np.int64(4)) as w:
        assert w.trace_batches == {1, 3} and w.abort_after == 4 and type(w.abort_after) is int
    with nw.watch(tiny_mlp, trace_batches=torch.tensor([2])) as w:
        assert w.trace_batches == {2}
    with nw.watch(tiny_mlp, trace_batches=3) as w:
        assert w.trace_batches == {3}


def test_one_class_or_one_class_name_is_skipped_like_a_list_of_them(tiny_mlp):
    for skip in (nn.ReLU, "ReLU", [nn.ReLU], ("ReLU",)):
        with nw.watch(tiny_mlp, skip_types=skip) as w:
            assert "act" not in w.module_names and "fc1" in w.module_names, skip


def test_a_misspelt_class_name_warns_with_the_close_match(tiny_mlp):
    with pytest.warns(SkipTypesWarning, match="no module of class 'Relu', so it skips nothing; "
                                              "did you mean 'ReLU'") as caught:
        w = nw.watch(tiny_mlp, skip_types=["Relu"])
    w.close()
    assert caught[0].filename == __file__  # points at the user's call, not into nanwidget


def test_a_class_name_far_from_any_warns_without_a_guess(tiny_mlp):
    with pytest.warns(SkipTypesWarning) as caught:
        nw.watch(tiny_mlp, skip_types=["Dropout"]).close()
    assert "did you mean" not in str(caught[0].message)


def test_a_class_the_model_uses_does_not_warn(tiny_mlp):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nw.watch(tiny_mlp, skip_types=["ReLU", nn.Dropout]).close()


def test_max_events_is_an_option(tiny_mlp):
    with torch.no_grad():
        tiny_mlp.fc2.weight[0, 0] = float("nan")
    with nw.watch(tiny_mlp, on_nan="record", max_events=2) as w:
        for _ in range(5):
            tiny_mlp(torch.randn(2, 16))
    assert len(w.events) == 2 and w.events_dropped == 3 and w.max_events == 2


def test_detect_overflow_refuses_what_is_not_a_tensor(capsys):
    with pytest.raises(TypeError, match="detect_overflow needs a tensor, got NoneType"):
        nw.detect_overflow(None, "layer.3 output")
    assert nw.detect_overflow(torch.arange(3), "ids") is False  # integers hold no NaN/Inf
    assert capsys.readouterr().out == ""


def test_a_lost_watch_is_found_by_live_watches_and_named_in_the_error(tiny_mlp):
    def start() -> None:
        nw.watch(tiny_mlp)  # the watch object is dropped; its hooks stay

    start()
    gc.collect()
    with pytest.raises(RuntimeError, match=r"already watched .*live_watches\(\)"):
        nw.watch(tiny_mlp)
    lost = nw.live_watches()
    assert len(lost) == 1 and lost[0].model is tiny_mlp
    for w in lost:
        w.close()
    assert hook_count(tiny_mlp) == 0 and nw.live_watches() == []
    nw.watch(tiny_mlp).close()


def test_a_dropped_model_takes_its_watch_with_it():
    import weakref
    model = TinyMLP()
    nw.watch(model)
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None and nw.live_watches() == []

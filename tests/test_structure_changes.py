"""A module added, replaced or removed after watch() is named in the event it affects."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwidget as nw

MADE_HERE = "made here from finite inputs and weights"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inner(x))
        extra = getattr(self, "extra", None)
        return extra(x) if extra is not None else x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.block = Block()
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.block(torch.relu(self.a(x))))


class NegativeSqrt(nn.Module):
    """Finite weights, NaN output: sqrt of a negative number."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(8, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.proj(x) - 10.0)


def _run(mode: str, change) -> nw.NanEvent:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 8)
    with nw.watch(model, mode=mode, on_nan="record") as watch:
        model(x)
        change(model)
        model(x)
    assert len(watch.events) == 1
    return watch.event


def _nan_bias_b(model: Net) -> None:
    model.b = nn.Linear(8, 4)
    with torch.no_grad():
        model.b.bias[2] = float("nan")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_replaced_module_with_a_nan_bias_is_named_with_its_bias(mode):
    event = _run(mode, _nan_bias_b)
    assert (event.batch, event.module, event.module_type, event.role, event.kind,
            event.origin) == (1, "b", "Linear", "bias", "nan", "weight")
    assert "added or replaced after watch(): it runs unwatched" in event.summary()
    assert MADE_HERE not in event.summary()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_new_module_with_finite_weights_making_a_nan_is_named_never_made_here(mode):
    event = _run(mode, lambda model: setattr(model, "b", NegativeSqrt()))
    assert (event.batch, event.module, event.origin) == (1, "", "output")
    text = event.summary()
    assert MADE_HERE not in text
    assert ("'b' (NegativeSqrt)" if mode == "full" else "modules added or replaced: b") in text
    assert "found in the model's outputs (where it was made was not checked)" in text


def test_a_module_added_inside_a_watched_block_is_named_in_that_blocks_event():
    event = _run("full", lambda model: setattr(model.block, "extra", NegativeSqrt(8)))
    assert (event.module, event.origin) == ("block", "output")
    text = event.summary()
    assert "found in its outputs (where it was made was not checked)" in text
    assert "added or replaced after watch(), running unwatched: 'block.extra' (NegativeSqrt)" \
        in text and MADE_HERE not in text


def test_a_new_nan_module_upstream_is_named_in_the_input_event_it_causes():
    def poison_a(model: Net) -> None:
        model.a = nn.Linear(8, 8)
        with torch.no_grad():
            model.a.weight[0, 0] = float("inf")
            model.a.weight[1, 0] = -float("inf")
    event = _run("full", poison_a)
    assert (event.module, event.role, event.kind, event.origin) == (
        "a", "weight", "inf", "weight")


def test_an_unchanged_model_gets_no_note():
    def poison(model: Net) -> None:
        with torch.no_grad():
            model.b.bias[0] = float("nan")
    event = _run("full", poison)
    assert (event.module, event.role, event.origin, event.note) == ("b", "bias", "weight", "")


class Adapter(nn.Module):
    """What peft's get_peft_model() puts in a layer's place: the layer moves to base_layer."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora(x)


def test_a_watched_module_moved_after_watch_is_told_to_sit_elsewhere():
    # The event keeps the name the layer had when watched ('b'), which now names the adapter
    # around it, a module that is not even watched: the note says where it sits now. (The
    # sentinel does not replay a changed model: its root event names the added modules.)
    def wrap_b(model: Net) -> None:
        model.b = Adapter(model.b)
        with torch.no_grad():
            model.b.base_layer.bias[1] = float("nan")
    event = _run("full", wrap_b)
    assert (event.batch, event.module, event.role, event.origin) == (1, "b", "bias", "weight")
    assert "module 'b' now sits at 'b.base_layer' (moved after watch()" in event.note
    assert "now sits at 'b.base_layer'" in event.summary()


class LogOfHeldWeights(nn.Module):
    """Its weights live in a ParameterDict (as Keras 3's torch backend keeps them in
    ``_torch_params``); log() of a negative pre-activation is NaN."""

    def __init__(self) -> None:
        super().__init__()
        # Positive weights: positive inputs give finite outputs, negative ones NaN.
        self.params = nn.ParameterDict({"kernel": nn.Parameter(torch.rand(8, 4)),
                                        "bias": nn.Parameter(torch.full((4,), 0.1))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x @ self.params["kernel"] + self.params["bias"])


def _rebuild_holder(model: LogOfHeldWeights) -> None:
    # What every Keras fit() does: a new ParameterDict around the same Parameter objects.
    model.params = nn.ParameterDict(dict(model.params.items()))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_parameter_dict_rebuilt_around_the_same_parameters_is_no_change(mode):
    torch.manual_seed(0)
    model = LogOfHeldWeights()
    x = torch.rand(3, 8)
    with nw.watch(model, mode=mode, on_nan="record") as watch:
        model(x)  # a finite batch before the rebuild
        _rebuild_holder(model)
        model(-x)
        event = watch.event
        assert event.batch == 1
        assert "replaced" not in watch.report() and "not the one" not in watch.report()
        assert event.diagnosis.kind == "domain"
        trace = watch.replay(1)
    assert trace.reproduced and trace.changes == []
    assert trace.first_bad["op"] == "log"


def test_a_replay_after_a_parameter_dict_rebuild_uses_the_weights_the_batch_ran_with():
    # The replay puts the held weights where the forward reads them: in the new ParameterDict,
    # not in the one the watch saw first (whose entries the forward no longer reads).
    torch.manual_seed(0)
    model = LogOfHeldWeights()
    x = torch.rand(3, 8)
    with nw.watch(model, on_nan="record", snapshot_weights=True, trace_batches=(0,)) as watch:
        model(x)
        _rebuild_holder(model)
        with torch.no_grad():
            model.params["kernel"].mul_(-1.0)  # the step after batch 0: log of negatives now
        model(x)
        ran = watch.frames(batch=0)
        trace = watch.replay(0)
    assert trace.first_bad is None and not trace.frames["nan"].any()
    live = ran[ran["role"] == "output"]["abs_max"].tolist()
    replayed = trace.frames[trace.frames["role"] == "output"]["abs_max"].tolist()
    assert replayed == live


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_parameter_dict_rebuilt_with_a_new_parameter_is_still_a_change(mode):
    torch.manual_seed(0)
    model = LogOfHeldWeights()
    x = torch.rand(3, 8)
    with nw.watch(model, mode=mode, on_nan="record") as watch:
        model(x)
        model.params = nn.ParameterDict({"kernel": nn.Parameter(model.params["kernel"].clone()),
                                         "bias": model.params["bias"]})
        model(-x)
        assert "params" in watch.event.summary()
        with pytest.raises(RuntimeError, match="modules added or replaced: params"):
            watch.replay(1)

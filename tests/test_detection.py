"""Detection: the first non-finite frame is the event, and its origin says where it came from."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nanwidget as nw
from nanwidget.core.watch import MAX_EVENTS


class Between(nn.Module):
    """A NaN made by a functional op between two modules: hooks see it arrive as an input."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.log(h - 100.0))


class MakesNan(nn.Module):
    def forward(self, x):
        return torch.sqrt(x - 10.0)


def test_corrupted_weight_is_origin_weight(tiny_mlp):
    with torch.no_grad():
        tiny_mlp.fc2.weight[3, 1] = float("inf")
    with nw.watch(tiny_mlp) as w, pytest.raises(nw.NanDetected) as info:
        tiny_mlp(torch.randn(2, 16))
    event = info.value.event
    assert (event.module, event.role, event.origin, event.kind) == ("fc2", "weight", "weight", "inf")
    assert event.batch == 0 and event.module_type == "Linear" and event.call == 0
    assert not event.is_backward and event.rank == 0
    assert w.event is event


def test_nan_in_the_data_is_origin_input_at_the_first_module(tiny_mlp):
    x = torch.randn(3, 16)
    x[1, 2] = float("nan")
    with nw.watch(tiny_mlp), pytest.raises(nw.NanDetected) as info:
        tiny_mlp(x)
    event = info.value.event
    assert (event.module, event.role, event.origin, event.kind) == ("fc1", "input[0]", "input", "nan")
    message = str(info.value)
    for word in ("batch 0", "'fc1'", "input[0]", "nan", "arrived through an input"):
        assert word in message
    assert "\n" not in message


def test_functional_op_between_modules_is_origin_input_of_the_next_module():
    model = Between()
    with nw.watch(model), pytest.raises(nw.NanDetected) as info:
        model(torch.randn(2, 4))
    event = info.value.event
    assert (event.module, event.origin, event.role) == ("b", "input", "input[0]")


def test_module_that_makes_nan_from_finite_input_is_origin_output():
    model = nn.Sequential(nn.Linear(4, 4), MakesNan(), nn.Linear(4, 2))
    with nw.watch(model), pytest.raises(nw.NanDetected) as info:
        model(torch.randn(2, 4))
    event = info.value.event
    assert (event.module, event.module_type, event.origin, event.role) == ("1", "MakesNan", "output", "output")


def test_fp16_overflow_is_inf_made_by_the_linear_that_overflows():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).half()
    with torch.no_grad():
        model[1].weight.fill_(300.0)
    x = torch.full((2, 8), 1.0, dtype=torch.float16)
    with nw.watch(model, on_nan="record") as w:
        model(x)  # 8 * 300 * |h| overflows 65504 only if |h| is large: make it so
        with torch.no_grad():
            model[0].weight.fill_(30.0)
        model(x)
    event = w.event
    assert event is not None
    assert (event.batch, event.module, event.origin, event.kind) == (1, "1", "output", "inf")
    frames = event.frames
    assert frames[(frames.module == "0") & (frames.role == "output")].dtype.iloc[-1] == "float16"


def test_nan_and_inf_in_one_tensor_is_kind_nan_plus_inf():
    x = torch.randn(2, 4)
    x[0, 0], x[1, 1] = float("nan"), float("-inf")
    model = nn.Linear(4, 4)
    with nw.watch(model, on_nan="record") as w:
        model(x)
    assert w.event.kind == "nan+inf"
    row = w.event.frames.set_index("role").loc["input[0]"]
    assert row.nan and row.inf


def test_event_frames_are_the_max_frames_ending_with_the_event_frame(tiny_mlp):
    with nw.watch(tiny_mlp, max_frames=8) as w:
        tiny_mlp(torch.randn(2, 16))
        with torch.no_grad():
            tiny_mlp.fc2.bias[0] = float("nan")
        with pytest.raises(nw.NanDetected):
            tiny_mlp(torch.randn(2, 16))
    frames = w.event.frames.drop_duplicates(["batch", "frame"])
    assert len(frames) == 8
    # Ends with the event's own frame, although the check ran at the end of the batch.
    assert frames.iloc[-1][["batch", "module"]].tolist() == [1, "fc2"]
    assert frames.batch.tolist() == [0] * 5 + [1] * 3  # fc1, act, fc2 of batch 1


def test_watch_keeps_working_after_an_event_and_clean_batches_do_not_raise(tiny_mlp):
    x = torch.randn(2, 16)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with nw.watch(tiny_mlp) as w:
        with pytest.raises(nw.NanDetected):
            tiny_mlp(bad)
        tiny_mlp(x)  # must not raise: the flag is per batch
        with pytest.raises(nw.NanDetected):
            tiny_mlp(bad)
        assert [e.batch for e in w.events] == [0, 2]
        assert w.batch == 3


def test_warn_mode_warns_once_per_event_and_record_mode_is_silent(tiny_mlp):
    bad = torch.full((2, 16), float("nan"))
    with nw.watch(tiny_mlp, on_nan="warn") as w:
        with pytest.warns(nw.NanWarning, match="batch 0"):
            tiny_mlp(bad)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tiny_mlp(torch.randn(2, 16))
        assert not caught
    with nw.watch(tiny_mlp, on_nan="record") as w:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tiny_mlp(bad)
        assert w.event.origin == "input"


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_that_repeats_in_the_same_place_is_warned_twice_then_recorded_quietly(
        tiny_mlp, mode):
    """A weight left non-finite makes an event at every batch: the first two warn (the
    second says it repeats), the rest are recorded without burying the first in warnings; a
    NaN in another place warns again."""
    with nw.watch(tiny_mlp, on_nan="warn", mode=mode) as w:
        with torch.no_grad():
            tiny_mlp.fc1.weight[0, 0] = float("nan")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(6):
                tiny_mlp(torch.randn(2, 16))
            with torch.no_grad():
                tiny_mlp.fc1.weight[0, 0] = 0.0
            tiny_mlp(torch.full((2, 16), float("nan")))
        texts = [str(c.message) for c in caught if issubclass(c.category, nw.NanWarning)]
    assert [e.batch for e in w.events] == list(range(7))
    assert len(texts) == 3, texts
    assert "batch 0" in texts[0] and "same place as in batch 0" in texts[1]
    assert "batch 6" in texts[2] and "input[0]" in texts[2]


def test_events_are_capped(tiny_mlp):
    bad = torch.full((1, 16), float("nan"))
    with nw.watch(tiny_mlp, on_nan="record") as w:
        for _ in range(MAX_EVENTS + 5):
            tiny_mlp(bad)
        assert len(w.events) == MAX_EVENTS
        assert w.events_dropped == 5


def test_nan_detected_is_a_floating_point_error(tiny_mlp):
    assert issubclass(nw.NanDetected, FloatingPointError)
    assert issubclass(nw.AbortAfterBatch, RuntimeError)


def test_report_uses_the_transformers_layout(tiny_mlp):
    with torch.no_grad():
        tiny_mlp.head.weight[0, 0] = float("nan")
    with nw.watch(tiny_mlp, max_frames=3) as w, pytest.raises(nw.NanDetected):
        tiny_mlp(torch.randn(2, 16))
    lines = w.report().splitlines()
    assert lines[0].startswith("nanwidget: nan in batch 0 at module 'head' (Linear, call 0), weight")
    assert "Detected inf/nan during batch_number=0" in lines
    assert "Last 3 forward frames:" in lines
    assert "abs min  abs max  metadata" in lines
    assert " " * 17 + " fc2 Linear" in lines
    assert " " * 17 + " head Linear" in lines
    weight_line = next(line for line in lines if line.endswith("weight  <-- nan"))
    assert weight_line.startswith("     nan      nan")
    bias_line = next(line for line in lines if line.endswith(" bias"))
    assert len(bias_line.split()[0]) == 8 and "e" in bias_line.split()[0]


def test_report_without_event_dumps_the_frames_held(tiny_mlp):
    with nw.watch(tiny_mlp, max_frames=2) as w:
        tiny_mlp(torch.randn(2, 16))
        text = w.report()
    assert "No inf/nan detected" in text and "Last 2 forward frames:" in text


def test_report_before_any_batch_says_none_ran(tiny_mlp):
    with nw.watch(tiny_mlp) as w:
        text = w.report()
    assert text.splitlines()[0] == "No inf/nan detected: no batch has run under this watch yet"
    assert "batch_number=-1" not in text


def test_detect_overflow_prints_like_transformers(capsys):
    t = torch.tensor([1.0, float("nan"), float("inf")])
    assert nw.detect_overflow(t, "layer.3 output") is True
    assert capsys.readouterr().out.splitlines() == ["layer.3 output has nans", "layer.3 output has infs"]
    assert nw.detect_overflow(torch.ones(3), "fine") is False
    assert capsys.readouterr().out == ""


def test_report_header_names_both_phases_when_backward_frames_are_held():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    with nw.watch(model, backward=True, max_frames=50) as w:
        model(torch.randn(3, 4)).sum().backward()
        text = w.report()
    assert "forward and backward frames:" in text

"""The trace follows the data to the cause: ``first_bad`` is where the NaN/Inf that reaches the
event was born, not the first ±inf some op made on purpose; a non-finite weight, input or
output gradient is no birth, and the trace names it instead.

Real models, built from configs with random weights (no downloads), in float16 on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanwidget as nw

from conftest import hook_count
from test_replay import line_of

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

T5_SOURCE = "modeling_t5.py"


def tiny_t5(feed_forward_proj: str = "relu", layers: int = 2) -> nn.Module:
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=layers, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.1, feed_forward_proj=feed_forward_proj)
    return transformers.T5EncoderModel(config).half()


def t5_inputs() -> dict:
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # padding: T5 adds finfo.min to those scores
    return {"input_ids": ids, "attention_mask": mask}


def replay_event(model: nn.Module, inputs: dict, **options):
    with nw.watch(model, on_nan="record", **options) as w:
        model(**inputs)
        event = w.event
        trace = w.replay(0)
    assert hook_count(model) == 0
    return event, trace


# ------------------------------------------------------------------ T5 and mT5 in float16
def test_t5_feed_forward_overflow_names_the_matmul_not_the_bucketing_log():
    model = tiny_t5().eval()
    wo = model.encoder.block[1].layer[1].DenseReluDense.wo
    with torch.no_grad():
        wo.weight.fill_(5000.0)  # the feed-forward's output passes float16's 65504
    event, trace = replay_event(model, t5_inputs())
    assert (event.module, event.origin) == ("encoder.block.1.layer.1.DenseReluDense.wo", "output")
    first = trace.first_bad
    assert first["op"] in ("mm", "addmm", "linear") and first["module"] == event.module
    assert first["inf"] and not first["nan"] and T5_SOURCE in first["source"]
    # T5's bucketing took log(0) = -inf earlier, on purpose, and where() dropped it.
    earlier = trace.earlier_inf
    assert earlier["op"] == "log" and earlier["index"] < first["index"]
    assert not trace.earlier_inf_reaches
    assert trace.lineage[-1] == first["index"] and trace.came_with == []
    assert "that never reaches the event" in trace.report()


def test_mt5_gated_gelu_overflow_names_the_gating_mul():
    model = tiny_t5("gated-gelu", layers=1).train()  # mT5's feed-forward, dropout on
    dense = model.encoder.block[0].layer[1].DenseReluDense
    with torch.no_grad():
        dense.wi_0.weight.fill_(30.0)
        dense.wi_1.weight.fill_(40.0)  # gelu(h) * linear(h) passes 65504; each factor does not
    event, trace = replay_event(model, t5_inputs())
    assert trace.reproduced
    first = trace.first_bad
    assert first["op"] == "mul" and first["module"] == "encoder.block.0.layer.1.DenseReluDense"
    assert first["inf"] and not first["nan"]
    # Not the bucketing log, and not gelu_new's x ** 3, which overflows inside the activation
    # while tanh() brings the output back to finite values.
    ops = trace.ops
    intended = ops[ops["nonfinite"] & (ops["index"] < first["index"])]
    assert {"log", "pow"} <= set(intended["op"])
    assert not set(intended["index"]) & set(trace.lineage)
    inputs = trace.first_bad_tensors.set_index("role")
    assert (inputs.filter(like="input", axis=0)["inf_count"] == 0).all()


def test_a_healthy_t5_batch_blames_no_op():
    model = tiny_t5().eval()
    event, trace = replay_event(model, t5_inputs())
    assert event is None and trace.reproduced
    assert trace.ops["nonfinite"].any()  # the bucketing's log(0), at least
    assert trace.first_bad is None and trace.came_with == []
    assert "no NaN/Inf reached an event" in trace.summary()


# ------------------------------------------------------------------ intended infs, hand-written
class MaskedThenWide(nn.Module):
    """Attention with a -inf mask (``masked_fill``) or a ``finfo.min`` additive mask, every row
    keeping some keys; then a feed-forward that overflows float16."""

    def __init__(self, mask_kind: str) -> None:
        super().__init__()
        self.mask_kind = mask_kind
        self.query = nn.Linear(8, 8)
        self.key = nn.Linear(8, 8)
        self.up = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        scores = self.query(x) @ self.key(x).transpose(1, 2) * 40.0
        if self.mask_kind == "masked_fill":
            scores = scores.masked_fill(~keep, float("-inf"))
        else:  # finfo.min plus a negative score overflows to -inf: harmless under softmax
            scores = scores + (1.0 - keep.to(scores.dtype)) * torch.finfo(scores.dtype).min
        h = torch.softmax(scores.float(), dim=-1).to(x.dtype) @ x
        return self.up(h) * 30000.0  # the real bug: float16 overflows here


@pytest.mark.parametrize("mask_kind", ["masked_fill", "finfo_min"])
def test_intended_infs_in_masks_are_not_blamed_for_an_overflow_elsewhere(mask_kind):
    torch.manual_seed(1)
    model = MaskedThenWide(mask_kind).half()
    keep = torch.ones(2, 6, 6, dtype=torch.bool).tril()  # causal: every row keeps its diagonal
    x = torch.randn(2, 6, 8).half() * 4
    with nw.watch(model, on_nan="record") as w:
        model(x, keep)
        trace = w.replay(0)
    ops = trace.ops
    mask_op = "masked_fill" if mask_kind == "masked_fill" else "add"
    assert ops[ops["nonfinite"]]["op"].iloc[0] == mask_op  # the mask's -inf came first
    first = trace.first_bad
    assert first["op"] == "mul" and first["inf"] and not first["nan"]
    assert first["source"] == line_of(MaskedThenWide.forward, "* 30000.0")
    assert trace.earlier_inf["op"] == mask_op and not trace.earlier_inf_reaches


class AdditiveMask(nn.Module):
    """An additive mask built with masked_fill(-inf), added to the scores, then softmax."""

    def forward(self, scores: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(scores).masked_fill(blocked, float("-inf"))
        return torch.softmax(scores + mask, dim=-1)


def test_a_fully_masked_row_blames_softmax_and_says_the_mask_reached_it():
    blocked = torch.zeros(2, 4, 4, dtype=torch.bool)
    blocked[1, 2, :] = True  # one row may attend nothing
    with nw.watch(AdditiveMask(), on_nan="record") as w:
        w.model(torch.randn(2, 4, 4), blocked)
        trace = w.replay(0)
    first = trace.first_bad
    assert "softmax" in first["op"] and first["nan"]
    assert first["source"] == line_of(AdditiveMask.forward, "torch.softmax")
    # The NaN was born in softmax from the -inf the mask carried through the addition.
    assert trace.earlier_inf["op"] == "masked_fill" and trace.earlier_inf_reaches
    assert "that Inf flowed into it" in trace.report()


# ------------------------------------------------------------------ NaN made from an Inf
def entropy(h: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(h, -1) * (h > 0)
    return (p * torch.log(p)).sum(-1, keepdim=True)  # 0 * log(0) = 0 * -inf = NaN


def exp_normalised(h: torch.Tensor) -> torch.Tensor:
    e = torch.exp(h * 100)  # overflows to inf
    return e / e.sum(-1, keepdim=True)  # inf / inf = NaN


def norm_without_eps(h: torch.Tensor) -> torch.Tensor:
    c = torch.ones_like(h)
    centred = c - c.mean(-1, keepdim=True)
    return centred * torch.rsqrt((centred ** 2).mean(-1, keepdim=True))  # 0 * rsqrt(0) = NaN


class Around(nn.Module):
    def __init__(self, function) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.function = function
        self.out = nn.Linear(4 if function is not entropy else 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.function(self.fc(x)))


@pytest.mark.parametrize("function, op, marker", [(entropy, "log", "torch.log"),
                                                  (exp_normalised, "exp", "torch.exp"),
                                                  (norm_without_eps, "rsqrt", "torch.rsqrt")])
def test_a_nan_made_from_an_accidental_inf_names_where_the_inf_was_made(function, op, marker):
    model = Around(function)
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(3, 4))
        trace = w.replay(0)
    first = trace.first_bad
    assert (first["op"], first["inf"], first["nan"]) == (op, True, False)
    assert first["source"] == line_of(function, marker)
    later_nan = trace.ops.loc[trace.lineage]
    assert later_nan["nan"].iloc[-1]  # the path ends at the NaN the event holds


def where_log(h: torch.Tensor) -> torch.Tensor:
    return torch.where(h > 100, torch.log(h * 0), h)  # finite forward, NaN gradient


def test_a_where_gradient_trap_names_the_gradient_of_log_at_its_line():
    model = Around(where_log)
    with nw.watch(model, on_nan="record", backward=True) as w:
        model(torch.randn(3, 4)).sum().backward()
        event = w.event
        trace = w.replay(0, loss_fn=lambda out: out.sum())
    assert event.is_backward
    first = trace.first_bad
    assert (first["op"], first["phase"], first["nan"]) == ("div", "backward", True)
    assert trace.first_bad_grad_of == "LogBackward0"
    assert first["source"] == line_of(where_log, "torch.log")
    # The forward's log(0) = -inf, dropped by where(), is not what reached the gradient.
    assert trace.earlier_inf["op"] == "log" and not trace.earlier_inf_reaches


class InPlaceOverflow(nn.Module):
    """An intended -inf kept out by where(), then an in-place multiply that overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        safe = torch.where(h > 0, torch.log(h.clamp(min=0)), torch.zeros_like(h))  # log(0) dropped
        h = h + safe
        h.mul_(4000.0)  # in place: its input is finite before the op, Inf after
        return h


def test_an_in_place_overflow_is_its_own_birth():
    model = InPlaceOverflow().half()
    with torch.no_grad():
        model.fc.weight.fill_(5.0)
    x = torch.tensor([[1.0, 1.0, -2.0, 1.0], [-1.0, -1.0, -1.0, -1.0]]).half()
    with nw.watch(model, on_nan="record") as w:
        model(x)
        trace = w.replay(0)
    assert (w.event.module, w.event.origin) == ("", "output")
    first = trace.first_bad
    assert first["op"] == "mul_" and first["inf"]
    assert trace.earlier_inf["op"] == "log" and not trace.earlier_inf_reaches


# ------------------------------------------------------------------ no birth: weights, data
class WithAdapter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.adapter = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x)
        return self.head(h + self.adapter(h))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_weights_made_infinite_by_an_adam_step_are_no_birth(mode):
    # pytorch #147437: Adam's eps=1e-8 is 0 in float16, so a gradient whose square underflows
    # divides by zero and the step writes ±inf into the adapter.
    torch.manual_seed(0)
    model = WithAdapter().half()
    model.base.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                                 eps=1e-8)
    x = torch.randn(16, 8).half()
    options = {"replay_on_nan": True} if mode == "full" else {"mode": "sentinel"}
    with nw.watch(model, on_nan="record", **options) as w:
        for _ in range(3):
            optimizer.zero_grad()
            out = model(x)
            if w.events:
                break
            (out.float().sum() * 1e-4).backward()
            optimizer.step()
        event = w.event
    assert (event.batch, event.module, event.origin) == (1, "adapter.0", "weight")
    assert not torch.isnan(model.adapter[0].weight).any()  # only ±inf: the case addmm hid
    trace = event.trace
    assert trace.first_bad is None and trace.lineage == []
    assert ("weight", "adapter.0.weight") in trace.came_with
    assert all(kind == "weight" for kind, _ in trace.came_with)
    assert "first bad op" not in event.summary()
    assert "came with the weights adapter.0.weight" in trace.summary()
    report = trace.report()
    assert "No op made the NaN/Inf that reached the event" in report
    if mode == "full":  # the watch saw batch 0's frames, with the weights still finite
        assert trace.weights_last_finite["adapter.0.weight"] == 0
        assert "finite when batch 0 ran; the optimizer step" in report


def test_a_nan_in_the_data_is_no_birth_and_names_the_input():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    x[1, 2] = math.nan
    with nw.watch(model, on_nan="record") as w:
        model(x)
        trace = w.replay(0)
    assert (w.event.module, w.event.origin) == ("0", "input")
    assert trace.first_bad is None and trace.came_with == [("input", "input[0]")]
    assert "came with the batch's input input[0]" in trace.summary()


# ------------------------------------------------------------------ a loss outside the model
def bce_by_hand(out: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(out)
    return -torch.log(1 - p).mean()  # float16: sigmoid rounds to 1, log(0) = -inf


def saturated_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).half()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[2].weight.fill_(3.0)
        model[2].bias.fill_(0.0)
    return model


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loss_made_outside_the_model_is_named_as_such(mode):
    model = saturated_model()
    x = torch.full((6, 4), 3.0).half()
    options = {"backward": True} if mode == "full" else {"mode": "sentinel", "backward": True}
    with nw.watch(model, on_nan="record", **options) as w:
        bce_by_hand(model(x)).backward()
        event = w.event
        with_loss = w.replay(0, loss_fn=bce_by_hand)
    assert event.is_backward and event.origin == "grad"
    # With the loss replayed (and its backward, where the event was), the NaN gradient is
    # born in the backward of its log, named at its line.
    assert with_loss.reproduced
    first = with_loss.first_bad
    assert (first["op"], first["phase"]) == ("div", "backward")
    assert first["source"] == line_of(bce_by_hand, "torch.log")
    if mode == "sentinel":  # the automatic replay had no loss: it says where to look instead
        trace = event.trace
        assert trace.first_bad is None
        assert [kind for kind, _ in trace.came_with] == ["output-grad"]
        report = trace.report()
        assert "made in the loss, outside the model" in report
        assert "replay(0, loss_fn=...)" in report

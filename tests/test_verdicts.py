"""Trustworthy verdicts on real models: no false alarm on intended ±inf, no silent miss on any
tensor kind, the blame on the right module and origin, and a replay that says what it checked."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import nanwidget as nw
from nanwidget.core import stats as stats_module

NAN, INF = float("nan"), float("inf")


# ----------------------------------------------------------------------- intended ±inf
def _inputs_flagged(frames, role):
    rows = frames[frames.role == role]
    return bool(len(rows)) and bool(rows.inf.any())


def test_causal_transformer_encoder_layer_is_no_false_alarm():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0,
                                       batch_first=True)
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    with nw.watch(layer, max_frames=100) as w:  # on_nan="raise": a false alarm would raise
        out = layer(torch.randn(2, 6, 16), src_mask=mask, is_causal=True)
        frames = w.frames()
    assert torch.isfinite(out).all() and w.events == []
    assert _inputs_flagged(frames, "kwarg:src_mask")  # the mask is recorded and flagged


def test_multihead_attention_with_a_minus_inf_mask_is_no_false_alarm():
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(16, 2, batch_first=True)
    mask = torch.triu(torch.full((5, 5), -INF), diagonal=1)
    x = torch.randn(2, 5, 16)
    with nw.watch(attention) as w:
        attention(x, x, x, attn_mask=mask)
    assert w.events == []


def test_full_transformer_with_a_target_mask_is_no_false_alarm():
    torch.manual_seed(0)
    model = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                           dim_feedforward=32, dropout=0.0, batch_first=True)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(4)
    with nw.watch(model) as w:
        model(torch.randn(2, 5, 16), torch.randn(2, 4, 16), tgt_mask=tgt_mask)
    assert w.events == []


class UserAttention(nn.Module):
    """The usual hand-written attention: scores.masked_fill(mask, -inf), then an nn.Softmax."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        scores = self.query(x) @ self.key(x).transpose(1, 2)
        scores = scores.masked_fill(blocked, float("-inf"))
        return self.softmax(scores) @ x


def test_masked_fill_before_a_softmax_module_is_no_false_alarm(reduction_path):
    torch.manual_seed(0)
    model = UserAttention()
    blocked = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1).expand(2, 5, 5)
    with nw.watch(model) as w:
        model(torch.randn(2, 5, 8), blocked)
        frames = w.frames()
    assert w.events == []
    assert _inputs_flagged(frames[frames.module == "softmax"], "input[0]")


def test_a_fully_masked_row_turning_softmax_to_nan_is_an_input_event(reduction_path):
    torch.manual_seed(0)
    model = UserAttention()
    blocked = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1).expand(2, 5, 5).clone()
    blocked[1, 2, :] = True  # query 2 of sample 1 may attend nothing
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(2, 5, 8), blocked)
    event = w.event
    assert (event.module, event.origin, event.kind, event.role) == ("softmax", "input", "inf",
                                                                     "input[0]")
    assert event.made_kind == "nan"
    # The kind is what arrived, input[0]'s; the headline says what the module made of it.
    assert event.summary().startswith(
        "inf in batch 0 at module 'softmax' (Softmax, call 0), input[0]: arrived through an "
        "input (from the data, an earlier module, or a functional op between modules); the "
        "module made nan of it")


class ScoresOverTemperature(nn.Module):
    """Scores divided by a temperature between modules, then a softmax module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.softmax = nn.Softmax(-1)

    def forward(self, x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return self.softmax(self.fc(x) / temperature)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_kind_of_an_input_event_is_what_arrived_not_what_the_module_made(mode):
    # A temperature of 1e-39 overflows the scores to +Inf between modules; the softmax makes
    # NaN of them (inf - inf). The event names softmax's input[0], which holds Inf, but its
    # kind was the outputs' "nan" (and NanDetected said "nan ... input[0]").
    torch.manual_seed(0)
    model = ScoresOverTemperature()
    x = torch.randn(3, 4)
    with nw.watch(model, mode=mode) as w:
        with torch.no_grad():
            model(x)
            with pytest.raises(nw.NanDetected) as raised:
                model(x, temperature=1e-39)
    event = w.event
    assert (event.batch, event.module, event.role, event.origin) == \
        (1, "softmax", "input[0]", "input")
    own = event.frames[(event.frames.frame == event.frame) & (event.frames.batch == 1)
                       & (event.frames.role == "input[0]")]
    assert bool(own.inf.iloc[0]) and not bool(own.nan.iloc[0])
    assert event.kind == "inf"
    assert str(raised.value).startswith(
        "nanwidget: inf in batch 1 at module 'softmax' (Softmax, call 0), input[0]: arrived "
        "through an input")
    assert "; the module made nan of it" in event.summary()
    assert event.made_kind == "nan"  # what the softmax made of it


class MaskBuilder(nn.Module):
    """Makes an additive mask: -inf where blocked. Its output holds -inf on purpose."""

    def forward(self, blocked: torch.Tensor) -> torch.Tensor:
        return torch.zeros(blocked.shape).masked_fill(blocked, float("-inf"))


class WithMaskBuilder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask_builder = MaskBuilder()
        self.scores = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.scores(x) + self.mask_builder(blocked), dim=-1)


@pytest.mark.parametrize("allow", [None, "mask_*", "*.mask_builder", MaskBuilder, ["nothing", MaskBuilder]])
def test_allow_inf_names_modules_whose_outputs_may_hold_inf(allow):
    model = WithMaskBuilder()
    blocked = torch.triu(torch.ones(3, 5, dtype=torch.bool), diagonal=1)
    options = {} if allow is None else {"allow_inf": allow}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = nw.watch(model, on_nan="record", **options)
    with w:
        model(torch.randn(3, 5), blocked)
    unmatched = [str(c.message) for c in caught if "matches no module" in str(c.message)]
    # A glob that matches nothing ("*.mask_builder": no parent prefix; "nothing") warns.
    assert len(unmatched) == (1 if allow == "*.mask_builder" or isinstance(allow, list) else 0)
    if allow is None or allow == "*.mask_builder":
        assert (w.event.module, w.event.origin, w.event.kind) == ("mask_builder", "output", "inf")
    else:
        assert w.events == []


def test_allow_inf_given_a_class_name_says_to_pass_the_class():
    with pytest.warns(RuntimeWarning, match="matches no module") as caught:
        nw.watch(WithMaskBuilder(), allow_inf="MaskBuilder").close()
    message = str(caught[0].message)
    assert "'' is the root" in message
    assert "'MaskBuilder' is a class name: pass the class itself, allow_inf=[MaskBuilder]" \
        in message


def test_allow_inf_takes_the_name_as_written_inside_a_checkpoint_wrapper():
    """Activation checkpointing's wrapper (as FSDP1's units and a compiled submodule do) puts
    its attribute into the names of what it wraps: 'mask_builder' is watched as
    'mask_builder._checkpoint_wrapped_module'. allow_inf='mask_builder' matched only the
    wrapper, and the wrapped mask stopped the model (under FSDP1, where no module is named as
    written, it also warned "matches no module"); it now matches the module the user named. The wrapped name allows the wrapper too, which returns the
    same tensor (it stopped the model at the wrapper)."""
    mode = "full"  # the sentinel reads the root's outputs only: this softmax's are finite
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    blocked = torch.triu(torch.ones(3, 5, dtype=torch.bool), diagonal=1)
    for allow in ("mask_builder", "mask_builder._checkpoint_wrapped_module", "mask_*"):
        model = WithMaskBuilder()
        model.mask_builder = checkpoint_wrapper(model.mask_builder)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # "matches no module" would raise
            w = nw.watch(model, on_nan="record", allow_inf=allow, mode=mode)
        with w:
            model(torch.randn(3, 5), blocked)
        assert w.events == [], allow
    model = WithMaskBuilder()
    model.mask_builder = checkpoint_wrapper(model.mask_builder)
    with nw.watch(model, on_nan="record", mode=mode) as w:
        model(torch.randn(3, 5), blocked)
    assert (w.event.kind, w.event.origin) == ("inf", "output")
    assert w.event.module == "mask_builder._checkpoint_wrapped_module"


def test_allow_inf_drops_only_whole_wrapper_segments_anywhere_in_a_name():
    from nanwidget.core.options import name_matches
    assert name_matches("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.attn", "layers.0.attn")
    assert name_matches("encoder._orig_mod.mask", "encoder.mask")
    assert not name_matches("my_fsdp_wrapped_module_x.attn", "attn")
    assert not name_matches("encoder.mask", "decoder.*")


def test_nan_always_counts_even_in_an_allowed_module():
    class NanMask(MaskBuilder):
        def forward(self, blocked):
            return super().forward(blocked) * 0.0  # -inf * 0 = NaN

    model = WithMaskBuilder()
    model.mask_builder = NanMask()
    with nw.watch(model, on_nan="record", allow_inf=MaskBuilder) as w:
        model(torch.randn(3, 5), torch.triu(torch.ones(3, 5, dtype=torch.bool), diagonal=1))
    assert (w.event.module, w.event.kind) == ("mask_builder", "nan")


def test_report_and_browser_follow_the_event_not_the_mask():
    torch.manual_seed(0)
    model = UserAttention()
    blocked = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1).expand(2, 5, 5).clone()
    blocked[0, 1, :] = True
    with nw.watch(model, on_nan="record", max_frames=50) as w:
        model(torch.randn(2, 5, 8), blocked)  # masked (-inf) inputs in every batch, a NaN here
    event = w.event
    report_lines = w.report().splitlines()
    assert report_lines[0].startswith("nanwidget: inf in batch 0 at module 'softmax'")
    browser = nw.FrameBrowser(w)
    browser.frame.value = 1
    assert browser.jump_to_first_bad()
    shown = browser.index.table.iloc[browser.index.first_rows[browser.current_frame]]
    assert (shown["module"], shown["frame"]) == (event.module, event.frame)


class CausalDecoder(nn.Module):
    """Keeps its causal mask as a buffer of 0 and -inf, as openai-whisper's TextDecoder and
    open_clip's text transformer do."""

    def __init__(self, n: int = 6, d: int = 8) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.register_buffer("mask", torch.full((n, n), -INF).triu(1), persistent=False)
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x, x, x, attn_mask=self.mask, need_weights=False)[0])


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_additive_mask_kept_as_a_buffer_is_no_false_alarm(mode, reduction_path):
    # It said: corrupted-weight, "'mask' holds Inf before batch 0 ran (an optimizer step, a
    # load or a write made it)".
    torch.manual_seed(0)
    model = CausalDecoder()
    with nw.watch(model, mode=mode, sample_every=1 if mode == "sentinel" else None) as w:
        out = model(torch.randn(2, 6, 8))
        frames = w.frames()
    assert torch.isfinite(out).all() and w.events == []
    mask = frames[(frames.module == "") & (frames.role == "mask")]
    assert len(mask) == 1 and bool(mask.inf.iloc[0])  # recorded and flagged


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_event_beside_a_mask_buffer_is_blamed_on_its_cause(mode):
    torch.manual_seed(0)
    model = CausalDecoder()
    with torch.no_grad():
        model.out.weight[1, 2] = NAN
    with nw.watch(model, mode=mode, on_nan="record") as w:
        model(torch.randn(2, 6, 8))
    event = w.event
    assert (event.module, event.role, event.origin) == ("out", "weight", "weight")


@pytest.mark.parametrize("write", ["nan", "inf in a finite buffer", "inf in a parameter"])
def test_what_is_no_mask_still_counts(write):
    # A NaN in the mask; an Inf in a buffer whose finite values are not all 0 (a running
    # variance); a parameter of 0 and -inf values: each is an event.
    torch.manual_seed(0)
    model = CausalDecoder()
    with torch.no_grad():
        if write == "nan":
            model.mask[0, 3] = NAN
            expected = ("", "mask")
        elif write == "inf in a finite buffer":
            model.register_buffer("scale", torch.tensor([1.0, INF]))
            expected = ("", "scale")
        else:
            model.out.bias.zero_()[0] = -INF
            expected = ("out", "bias")
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(2, 6, 8))
    event = w.event
    assert (event.module, event.role, event.origin) == (*expected, "weight")


# ----------------------------------------------------------------------- no silent miss
class Complexify(nn.Module):
    def forward(self, x):
        return torch.complex(x, x * 0.5)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_outputs_are_measured_and_a_nan_is_found(dtype, reduction_path):
    model = nn.Sequential(nn.Linear(4, 4), Complexify())
    x = torch.randn(2, 4)
    with nw.watch(model.to(torch.float64 if dtype is torch.complex128 else torch.float32),
                  on_nan="record") as w:
        out = model(x.to(model[0].weight.dtype))
        with torch.no_grad():
            model[0].bias[0] = NAN
        model(x.to(model[0].weight.dtype))
    row = w.frames().query("module == '1' and role == 'output' and batch == 0").iloc[0]
    assert row.abs_max == pytest.approx(out.abs().max().item()) and row.note == ""
    assert (w.event.module, w.event.origin) == ("0", "weight")


def test_vmap_over_a_watched_model_is_measured_on_both_paths(reduction_path):
    model = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    x[1, 0] = NAN
    with nw.watch(model, on_nan="record") as w:
        torch.func.vmap(model)(x)  # must not crash the forward
    assert w.event is not None and (w.event.module, w.event.kind) == ("", "nan")


def test_torch_func_grad_with_a_nan_parameter_is_found(reduction_path):
    model = nn.Linear(4, 1)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    params["weight"][0, 0] = NAN

    def loss(p, x):
        return torch.func.functional_call(model, p, (x,)).sum()

    with nw.watch(model, on_nan="record") as w:
        torch.func.grad(loss)(params, torch.randn(2, 4))
    assert (w.event.module, w.event.origin, w.event.role) == ("", "weight", "weight")


# ----------------------------------------------------------------------- the right blame
def _data_nan_write(p):
    p.data[0, 0] = NAN


def _data_fill_inf(p):
    p.data.fill_(INF)


def _data_swap(p):
    p.data = torch.full_like(p, NAN)


def _data_ema(p):
    p.data.mul_(0.5).add_(torch.full_like(p, INF))


@pytest.mark.parametrize("write", [_data_nan_write, _data_fill_inf, _data_swap, _data_ema])
def test_weight_written_through_data_is_blamed_as_weight_with_fresh_stats(write, tiny_mlp,
                                                                           reduction_path):
    x = torch.randn(2, 16)
    with nw.watch(tiny_mlp, on_nan="record") as w:
        tiny_mlp(x)  # measures and caches every weight
        write(tiny_mlp.fc2.weight)  # no version bump
        tiny_mlp(x)
    event = w.event
    assert (event.batch, event.module, event.origin, event.role) == (1, "fc2", "weight", "weight")
    weight = event.frames.query("batch == 1 and module == 'fc2' and role == 'weight'").iloc[0]
    assert weight.nan or weight.inf  # the frame shows the weight as it was, not the cached one


class WithPosition(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(4))
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x + self.pos)  # the parent's own parameter, used in its own forward


def test_nan_in_a_parents_own_parameter_is_blamed_on_the_parent(reduction_path):
    model = nn.Sequential(WithPosition(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].pos[1] = NAN
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(3, 4))
    event = w.event
    assert (event.module, event.module_type, event.origin, event.role) == ("0", "WithPosition",
                                                                          "weight", "pos")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_weight_of_an_inner_module_used_without_being_called_is_a_weight_event(mode):
    # MultiheadAttention reads out_proj.weight itself; out_proj never runs as a module.
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    with torch.no_grad():
        attention.out_proj.weight[0, 0] = NAN
    x = torch.randn(2, 5, 8)
    with nw.watch(attention, mode=mode, on_nan="record", replay_on_nan=True) as w, \
            torch.no_grad():
        attention(x, x, x, need_weights=False)
    event = w.event
    assert (event.module, event.origin, event.role, event.kind) == (
        "", "weight", "out_proj.weight", "nan")
    assert event.trace.reproduced


def test_vit_position_embeddings_nan_is_blamed_on_the_embeddings():
    transformers = pytest.importorskip("transformers", reason="transformers is the bench extra")
    transformers.logging.set_verbosity_error()
    config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32)
    model = transformers.ViTModel(config).eval()
    with torch.no_grad():
        model.embeddings.position_embeddings[0, 1, 3] = NAN
    with nw.watch(model, on_nan="record") as w:
        model(pixel_values=torch.randn(1, 3, 8, 8))
    event = w.event
    assert (event.module, event.origin, event.role) == ("embeddings", "weight",
                                                        "position_embeddings")


class InPlaceInf(nn.Module):
    """Writes an Inf into its input and returns it (no ``inplace`` attribute to warn us)."""

    def forward(self, x):
        x.mul_(INF)
        return x


def test_a_custom_in_place_module_is_blamed_as_the_maker_on_both_paths(reduction_path):
    model = nn.Sequential(nn.Linear(4, 4), InPlaceInf(), nn.Linear(4, 2))
    with torch.no_grad(), nw.watch(model, on_nan="record") as w:
        model(torch.randn(2, 4))
    event = w.event
    assert (event.module, event.origin, event.kind) == ("1", "output", "inf")
    handed = event.frames.query("module == '1' and role == 'input[0]'").iloc[0]
    assert not handed.inf and handed.note == "written in place here"


class NanAndInf(nn.Module):
    def forward(self, x):
        y = x.clone()
        y[0, 0], y[0, 1] = NAN, -INF
        return y


def test_nan_plus_inf_is_kept_past_the_pending_byte_limit(reduction_path, monkeypatch):
    monkeypatch.setattr(stats_module, "PENDING_BYTES_LIMIT", 0)  # nothing may be held
    model = nn.Sequential(nn.Linear(4, 4), NanAndInf())
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(2, 4))
    assert (w.event.module, w.event.kind) == ("1", "nan+inf")


# ----------------------------------------------------------------------- finite range
class PartlyNan(nn.Module):
    def forward(self, x):
        return torch.tensor([1.0, NAN, -3.0]) + x.sum() * 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_range_of_a_partly_nan_tensor(dtype, reduction_path):
    model = PartlyNan()
    with nw.watch(model, on_nan="record") as w:
        model(torch.ones(2, dtype=dtype))
    row = w.frames().query("role == 'output'").iloc[0]
    assert row.nan and math.isnan(row.abs_max)
    assert (row.finite_abs_min, row.finite_abs_max) == (1.0, 3.0)


def test_finite_range_equals_the_range_for_finite_tensors_and_is_nan_without_finite_values():
    model = nn.Identity()
    with nw.watch(model, on_nan="record") as w:
        model(torch.tensor([0.5, -2.0]))
        model(torch.tensor([NAN, INF]))
    rows = w.frames().query("role == 'output'")
    first, second = rows.iloc[0], rows.iloc[1]
    assert (first.finite_abs_min, first.finite_abs_max) == (first.abs_min, first.abs_max) == (0.5, 2.0)
    assert second.nan and second.inf and math.isnan(second.finite_abs_max)


# ----------------------------------------------------------------------- an honest replay
class DropoutOverflow(nn.Module):
    """fp16: a large activation, doubled by Dropout's 1/(1-p) scaling, overflows to Inf; the next
    Linear then mixes +Inf and -Inf into NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.down = nn.Linear(4, 4)
        with torch.no_grad():
            self.up.weight.fill_(0.0)
            self.up.bias.copy_(torch.tensor([40000.0, -40000.0, 1.0, 1.0]))
            self.down.weight.fill_(1.0)

    def forward(self, x):
        return self.down(self.drop(self.up(x)))


def test_first_bad_is_where_the_inf_was_born_not_where_nan_appeared_later():
    torch.manual_seed(3)
    model = DropoutOverflow().half()
    x = torch.ones(8, 4, dtype=torch.float16)
    with nw.watch(model, on_nan="record") as w:
        model(x)
    assert w.event is not None and w.event.module == "drop"
    trace = w.replay(0)
    first = trace.first_bad
    assert first["module"] == "drop" and first["inf"] and not first["nan"]
    later_nan = trace.ops[trace.ops.nan]
    assert len(later_nan) and later_nan.index[0] > first["index"]  # NaN came after, elsewhere
    assert trace.reproduced


def test_ops_writing_a_literal_inf_are_not_first_bad():
    torch.manual_seed(0)
    model = UserAttention()
    blocked = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1).expand(2, 5, 5)
    with nw.watch(model) as w:
        model(torch.randn(2, 5, 8), blocked)
        trace = w.replay(0)
    assert trace.first_bad is None and trace.earlier_inf["op"] == "masked_fill"
    assert trace.reproduced and trace.changes == []


class CastsItsInput(nn.Module):
    """Casts its input to its weights' dtype, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x.to(self.fc.weight.dtype))


def test_changes_list_a_dtype_change_and_the_replay_does_not_claim_unchanged():
    torch.manual_seed(0)
    model = CastsItsInput().half()
    with nw.watch(model) as w:
        model(torch.randn(2, 4))
        assert w.replay(0).changes == []
        model.float()
        trace = w.replay(0)
    assert {c for c in trace.changes if "dtype float16 -> float32" in c} == {
        "fc.weight: dtype float16 -> float32 (the replay runs the current dtype)",
        "fc.bias: dtype float16 -> float32 (the replay runs the current dtype)"}
    assert "Nothing changed" not in trace.report()


def test_a_replay_that_fails_on_a_changed_model_names_the_change():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).half()
    with nw.watch(model) as w:
        model(torch.randn(2, 4, dtype=torch.float16))
        model.float()  # the held float16 input no longer fits
        with pytest.raises(nw.core.replay.ReplayError, match="dtype float16 -> float32"):
            w.replay(0)


def test_changes_after_reset_parameters_as_in_the_quickstart():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with nw.watch(model) as w:
        model(torch.randn(2, 4))
        for layer in model:
            layer.reset_parameters()
        trace = w.replay(0)
    assert {change.split(":")[0] for change in trace.changes} == {
        "0.weight", "0.bias", "1.weight", "1.bias"}


def test_a_replay_that_does_not_meet_the_event_says_why():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = NAN
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(2, 4))
        assert w.replay(0).reproduced
        with torch.no_grad():
            model[1].weight[0, 0] = 0.5  # the user fixed the weight since
        trace = w.replay(0)
    assert not trace.reproduced
    assert "1.weight" in trace.why_not_reproduced()
    assert "Not reproduced" in trace.report() and "not reproduced" in trace.summary()
    browser = nw.FrameBrowser(w)
    browser._show_trace(trace)
    assert "not reproduced</b>, because" in browser.trace.value


def test_snapshot_weights_keeps_replays_exact_after_optimizer_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with nw.watch(model, snapshot_weights=True, max_frames=100) as w:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(6, 4)).pow(2).mean().backward()
            optimizer.step()
        recorded = w.frames()
        trace = w.replay(1)
    columns = ["module", "role", "abs_min", "abs_max"]
    assert trace.snapshot_used and trace.changes == [] and trace.reproduced
    assert trace.frames[columns].equals(recorded[recorded.batch == 1][columns].reset_index(drop=True))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_buffers_a_forward_updates_from_a_bad_input_are_not_blamed(mode):
    # A spectral norm's power iteration writes its _u/_v buffers from the weight it is handed
    # (the parametrization's 'original' parameter): a NaN there made them NaN in the forward,
    # and the event blamed _u/_v, "written after batch 1", never naming 'original'.
    torch.manual_seed(0)
    model = nn.Sequential(torch.nn.utils.parametrizations.spectral_norm(nn.Linear(4, 8)),
                          nn.Tanh(), nn.Linear(8, 3))
    with nw.watch(model, on_nan="record", mode=mode) as w:
        for batch in range(3):
            if batch == 2:
                with torch.no_grad():
                    model[0].parametrizations.weight.original[3, 1] = float("nan")
            model(torch.randn(5, 4))
    event = w.event
    assert (event.batch, event.module, event.role, event.origin) == (
        2, "0.parametrizations.weight", "original", "weight")
    assert event.diagnosis.summary.startswith("'0.parametrizations.weight.original' became NaN")
    # The same for BatchNorm's running statistics updated from NaN data: the input is named.
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2))
    x = torch.randn(6, 4)
    x[3, 0] = float("nan")
    with nw.watch(model, on_nan="record", mode=mode) as w:
        model(x)
    assert (w.event.role, w.event.origin, w.event.diagnosis.kind, w.event.diagnosis.rows) == (
        "input[0]", "input", "bad-data", [3])


class _QatMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torch.ao import quantization as tq
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.fc1, self.relu, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)

    def forward(self, x):
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


def _qat_model(qconfig: str) -> nn.Module:
    from torch.ao import quantization as tq
    torch.manual_seed(0)
    model = _QatMlp().train()
    model.qconfig = tq.default_qat_qconfig if qconfig == "default" \
        else tq.get_default_qat_qconfig(qconfig)
    return tq.prepare_qat(model)


def _qat_train(model: nn.Module, *, nan_weight: bool, mode: str):
    """Three QAT steps; a NaN written into fc1.weight after batch 1, or in batch 2's data."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw.watch(model, backward=True, mode=mode) as w:
            for batch in range(3):
                torch.manual_seed(100 + batch)
                x, y = torch.randn(4, 8), torch.randn(4, 4)
                if batch == 2 and not nan_weight:
                    x[1, 2] = NAN
                try:
                    loss = (model(x) - y).pow(2).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                except (nw.NanDetected, RuntimeError):
                    break  # x86's fused fake quantizer raises on the NaN range's zero point
                if batch == 1 and nan_weight:
                    with torch.no_grad():
                        model.fc1.weight[2, 3] = NAN
    return w.event


# (x86's fake quantizer raises in the forward: sentinel mode, which checks the root's outputs,
# has none to check there.)
@pytest.mark.parametrize("qconfig, mode", [("x86", "full"), ("qnnpack", "full"),
                                           ("default", "full"), ("default", "sentinel")])
def test_a_qat_weight_gone_nan_is_blamed_on_the_weight_not_its_fake_quantizers_scale(
        qconfig, mode):
    # The fake quantizer of fc1.weight recomputes its scale from that weight in every training
    # forward: a NaN written into the weight made the scale NaN in batch 2's own forward, and
    # the event blamed 'fc1.weight_fake_quant.scale', "written after batch 1" (an EMA's doing).
    event = _qat_train(_qat_model(qconfig), nan_weight=True, mode=mode)
    assert (event.batch, event.module, event.role, event.origin) == (2, "fc1", "weight", "weight")
    assert event.diagnosis.kind == "corrupted-weight"
    assert event.diagnosis.summary.startswith("'fc1.weight' became NaN between batch 1 and batch 2")


@pytest.mark.parametrize("qconfig", ["x86", "default"])
def test_qat_nan_data_is_told_arrived_with_the_data_not_in_a_fake_quantizers_scale(qconfig):
    event = _qat_train(_qat_model(qconfig), nan_weight=False, mode="full")
    assert (event.batch, event.role, event.origin) == (2, "input[0]", "input")
    assert (event.diagnosis.kind, event.diagnosis.rows) == ("bad-data", [1])


# ----------------------------------------------------------------------- quantized weights
class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _first_event(model: nn.Module, x: torch.Tensor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw.watch(model, on_nan="record", replay_on_nan=True) as w, torch.no_grad():
            model(x)
    return w.event, w.report()


def test_a_nan_in_a_dynamic_quantized_linears_packed_bias_is_named():
    # quantize_dynamic's Linear keeps weight and bias packed (no Parameter): the event said
    # "made here from finite inputs and weights" of weights nothing had read.
    from torch.ao.quantization import quantize_dynamic
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = quantize_dynamic(_Mlp().eval(), {nn.Linear}, dtype=torch.qint8)
        bias = model.fc1.bias().clone()
        bias[3] = NAN
        model.fc1.set_weight_bias(model.fc1.weight(), bias)
    event, report = _first_event(model, torch.randn(4, 8))
    assert (event.module, event.role, event.origin) == ("fc1", "bias", "weight")
    assert "finite inputs and weights" not in report
    assert event.trace.reproduced
    assert event.diagnosis.kind == "corrupted-weight"
    assert "float model's fc1.bias before quantizing" in event.diagnosis.suggestion[0]


def test_weights_packed_beyond_reach_are_never_called_finite():
    # A dynamic quantized LSTM's packed weights have no weight()/bias() to read them by.
    from torch.ao.quantization import quantize_dynamic
    torch.manual_seed(0)
    lstm = nn.Sequential(nn.LSTM(4, 6, batch_first=True))
    with torch.no_grad():
        lstm[0].bias_ih_l0[2] = NAN
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = quantize_dynamic(lstm.eval(), {nn.LSTM}, dtype=torch.qint8)
    event, report = _first_event(model, torch.randn(2, 3, 4))
    assert (event.module, event.origin) == ("0", "output")
    first = report.splitlines()[0]
    assert "made here from finite inputs;" in first and "and weights" not in first
    assert "packed by torch.ao quantization" in event.note
    assert "weights the watch could not read" in event.diagnosis.summary
    assert "the float model's, before quantizing it" in event.diagnosis.suggestion[0]


@pytest.mark.parametrize("config", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"])
def test_a_nan_in_a_torchao_weights_scale_is_named(config):
    # torchao's weights are tensor subclasses no hook reads: the frames noted the weight "not
    # read" and the event still said "made here from finite inputs and weights".
    quantization = pytest.importorskip(
        "torchao.quantization", reason="torchao is optional, not in the dev extra")
    torch.manual_seed(0)
    model = _Mlp().eval()
    quantization.quantize_(model, getattr(quantization, config)())
    model.fc1.weight.scale.view(-1)[3] = NAN
    event, report = _first_event(model, torch.randn(4, 8))
    assert (event.module, event.role, event.origin) == ("fc1", "weight", "weight")
    assert "finite inputs and weights" not in report
    assert event.trace.reproduced
    assert "float model's fc1.weight before quantizing" in event.diagnosis.suggestion[0]


# ----------------------------------------------- per-sample gradients with ExpandedWeights
def _expanded_weights_steps(model, steps, plant=None):
    """Steps of per-sample-gradient training through torch's ExpandedWeights (what
    ``call_for_per_sample_grads`` and Opacus' ``grad_sample_mode="ew"`` run); ``plant(step)``
    corrupts something before a step. Returns what the steps made."""
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads
    generator = torch.Generator().manual_seed(1)
    made = []
    for step in range(steps):
        x = torch.randn(6, 8, generator=generator)
        y = torch.randint(0, 3, (6,), generator=generator)
        if plant is not None:
            plant(step, model, x)
        out = call_for_per_sample_grads(model)(x)
        nn.functional.cross_entropy(out, y).backward()
        made += [out.detach()] + [p.grad_sample.clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad_sample.mean(0)
                p.grad_sample = None
    return made


def _expanded_weights_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_weight_written_nan_under_expanded_weights_is_a_corrupted_weight(mode, reduction_path):
    """During call_for_per_sample_grads' forward every parameter slot holds an ExpandedWeight
    (it refuses .detach() and .grad): the diagnosis failed ('Expanded Weights encountered but
    cannot handle function __get__') with an internal-error warning, and the replay said every
    parameter had been replaced by another tensor."""
    def plant(step, model, x):
        if step == 2:
            with torch.no_grad():
                model[3].weight[0, 0] = NAN

    model = _expanded_weights_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no internal-error warning
        with nw.watch(model, mode=mode, on_nan="raise") as w:
            with pytest.raises(nw.NanDetected):
                _expanded_weights_steps(model, 4, plant)
            event = w.event
            assert (event.batch, event.module, event.role, event.origin) == (2, "3", "weight", "weight")
            assert event.diagnosis.kind == "corrupted-weight", event.diagnosis.summary
            assert "between batch 1 and batch 2" in event.diagnosis.summary
            trace = w.replay(2)
            assert trace.reproduced and trace.changes == []


def test_expanded_weights_training_is_unchanged_and_quiet_under_a_watch(reduction_path):
    baseline = _expanded_weights_steps(_expanded_weights_model(), 3)
    for options in ({}, {"mode": "sentinel", "backward": True, "replay_on_nan": True},
                    {"backward": True, "snapshot_weights": True}):
        model = _expanded_weights_model()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with nw.watch(model, **options) as w:
                made = _expanded_weights_steps(model, 3)
        assert all(torch.equal(a, b) for a, b in zip(baseline, made)), options
        assert not w.events and not w.warnings


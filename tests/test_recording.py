"""Frames: one per module call, with weights, inputs, kwargs and outputs under contract roles."""

from __future__ import annotations

import dataclasses
import sys
import warnings

import pandas as pd
import pytest
import torch
from torch import nn

import nanwidget as nw
from nanwidget.core.frames import FRAME_COLUMNS


def test_frames_have_contract_columns_and_one_frame_per_module_call(tiny_mlp):
    with nw.watch(tiny_mlp, max_frames=100) as w:
        tiny_mlp(torch.randn(5, 16))
        frames = w.frames()
    assert list(frames.columns) == FRAME_COLUMNS
    # fc1, act, fc2, act (second call), head, root: children before parents.
    order = frames.drop_duplicates("frame")[["module", "call"]].values.tolist()
    assert order == [["fc1", 0], ["act", 0], ["fc2", 0], ["act", 1], ["head", 0], ["", 0]]
    fc1 = frames[frames.module == "fc1"].set_index("role")
    assert list(fc1.index) == ["weight", "bias", "input[0]", "output"]
    assert fc1.loc["weight", "shape"] == (32, 16)
    assert fc1.loc["weight", "dtype"] == "float32"
    assert fc1.loc["weight", "abs_max"] == pytest.approx(tiny_mlp.fc1.weight.abs().max().item())
    assert fc1.loc["weight", "abs_min"] == pytest.approx(tiny_mlp.fc1.weight.abs().min().item())
    assert frames.loc[frames.module == "", "module_type"].iloc[0] == "TinyMLP"


def test_stats_match_torch_for_inputs_and_outputs(tiny_mlp):
    x = torch.randn(7, 16) * 3
    with nw.watch(tiny_mlp) as w:
        out = tiny_mlp(x)
        frames = w.frames()
    root = frames[frames.module == ""].set_index("role")
    assert root.loc["input[0]", "abs_max"] == pytest.approx(x.abs().max().item())
    assert root.loc["input[0]", "abs_min"] == pytest.approx(x.abs().min().item())
    assert root.loc["output", "abs_max"] == pytest.approx(out.abs().max().item())
    assert not frames[["nan", "inf"]].any().any()
    assert (frames.note == "").all()


def test_batch_counts_root_forward_returns(tiny_mlp):
    with nw.watch(tiny_mlp, max_frames=1000) as w:
        for _ in range(3):
            tiny_mlp(torch.randn(2, 16))
        assert w.batch == 3
        assert sorted(w.frames().batch.unique()) == [0, 1, 2]


def test_set_batch_and_step_take_over_counting(tiny_mlp):
    with nw.watch(tiny_mlp, max_frames=1000) as w:
        w.set_batch(10)
        tiny_mlp(torch.randn(2, 16))
        tiny_mlp(torch.randn(2, 16))  # gradient accumulation: same batch
        assert w.batch == 10
        w.step()
        assert w.batch == 11
        tiny_mlp.fc1(torch.randn(2, 16))  # a submodule called directly
        w.step()
        frames = w.frames()
    assert set(frames.batch) == {10, 11}
    batch10 = frames[frames.batch == 10]
    assert batch10[batch10.module == "fc1"].call.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert frames[frames.batch == 11].module.unique().tolist() == ["fc1"]


def test_ring_buffer_keeps_only_the_last_max_frames(tiny_mlp):
    with nw.watch(tiny_mlp, max_frames=4) as w:
        for _ in range(5):
            tiny_mlp(torch.randn(2, 16))
        frames = w.frames()
    kept = frames.drop_duplicates(["batch", "frame"])
    assert len(kept) == 4
    assert kept.batch.tolist() == [4, 4, 4, 4]
    assert kept.module.tolist() == ["fc2", "act", "head", ""]


def test_trace_batches_keep_every_frame(tiny_mlp):
    with nw.watch(tiny_mlp, max_frames=2, trace_batches=[1]) as w:
        for _ in range(3):
            tiny_mlp(torch.randn(2, 16))
        traced = w.frames(batch=1)
        with pytest.raises(KeyError, match="not a recorded trace batch"):
            w.frames(batch=2)
        report = w.report()
    assert traced.drop_duplicates("frame").shape[0] == 6
    assert set(traced.batch) == {1}
    assert "*** Starting batch number=1 ***" in report


def test_report_with_an_event_keeps_the_trace_batches_recorded_before_it(tiny_mlp):
    with nw.watch(tiny_mlp, max_frames=3, trace_batches=[1, 3], on_nan="record") as w:
        for batch in range(4):
            x = torch.randn(2, 16)
            if batch == 2:
                x[0, 0] = float("nan")
            tiny_mlp(x)
    text = w.report()
    assert w.event.batch == 2
    # Trace batch 1 in full, as transformers prints it before its dump; batch 3 came later.
    assert text.count("*** Starting batch number=1 ***") == 1
    assert text.index("Starting batch number=1") < text.index("Detected inf/nan during batch_number=2")
    assert "batch number=3" not in text
    assert text.split("Detected inf/nan")[0].count(" fc1 Linear") == 1  # batch 1's frames


def test_abort_after_raises_once_that_batch_finished(tiny_mlp):
    with nw.watch(tiny_mlp, abort_after=2) as w:
        tiny_mlp(torch.randn(2, 16))
        tiny_mlp(torch.randn(2, 16))
        with pytest.raises(nw.AbortAfterBatch) as info:
            tiny_mlp(torch.randn(2, 16))
        assert info.value.batch == 2
        assert isinstance(info.value, RuntimeError)
        assert w.batch == 3


def test_skip_types_by_class_and_by_name(tiny_mlp):
    with nw.watch(tiny_mlp, skip_types=[nn.ReLU]) as w:
        tiny_mlp(torch.randn(2, 16))
        assert "act" not in set(w.frames().module)
    with nw.watch(tiny_mlp, skip_types=["Linear"]) as w:
        tiny_mlp(torch.randn(2, 16))
        assert set(w.frames().module) == {"act", ""}


class KwargsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, *, mask=None, scale=1.0, extras=None):
        y = self.proj(x) * scale
        if mask is not None:
            y = y.masked_fill(~mask, 0.0)
        return {"hidden": y, "pair": (y, [y.sum()]), "count": 3, "none": None}


def test_kwargs_and_nested_outputs_get_contract_roles():
    model = KwargsModel()
    mask = torch.ones(2, 4, dtype=torch.bool)
    with nw.watch(model) as w:
        model(torch.randn(2, 4), mask=mask, scale=2.0, extras={"ids": torch.arange(3)})
        frames = w.frames()
    root = frames[frames.module == ""].set_index("role")
    assert root.loc["kwarg:mask", "note"] == "bool"
    assert root.loc["kwarg:scale", "note"] == "not a tensor"
    # Integer tensors get their range (token ids against the vocabulary), as transformers shows.
    assert root.loc["kwarg:extras.ids", ["note", "abs_min", "abs_max"]].tolist() == ["", 0.0, 2.0]
    assert root.loc["output.hidden", "note"] == ""
    assert root.loc["output.pair[0]", "abs_max"] == root.loc["output.hidden", "abs_max"]
    assert root.loc["output.pair[1][0]", "shape"] == ()
    assert root.loc["output.count", "note"] == "not a tensor"
    assert root.loc["output.none", "note"] == "None"


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    aux: tuple | None = None


class DataclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return Output(logits=self.lin(x), aux=(x, None))


def test_dataclass_outputs_use_attribute_roles():
    model = DataclassModel()
    with nw.watch(model) as w:
        model(torch.randn(2, 3))
        roles = w.frames().query("module == ''").role.tolist()
    assert roles == ["input[0]", "output.logits", "output.aux[0]", "output.aux[1]"]


def test_transformers_model_output_roles():
    transformers = pytest.importorskip("transformers", reason="transformers is the bench extra")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50, (2, 8))
    with nw.watch(model) as w:
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
        frames = w.frames()
    root = frames[frames.module == ""]
    assert "output.logits" in set(root.role)
    ids = root.set_index("role").loc["kwarg:input_ids"]
    assert ids.note == "" and ids.abs_max < 50 and ids["dtype"] == "int64"  # token ids, vocab 50


def test_shared_module_called_twice_gives_two_calls(tiny_mlp):
    with nw.watch(tiny_mlp) as w:
        tiny_mlp(torch.randn(2, 16))
        acts = w.frames().query("module == 'act'").drop_duplicates("frame")
    assert acts.call.tolist() == [0, 1]


def test_inplace_module_input_measured_before_it_is_overwritten():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    x = torch.randn(16, 4)
    expected = model[0](x).detach()
    with nw.watch(model) as w:
        model(x)
        frames = w.frames()
    relu = frames[frames.module == "1"].set_index("role")
    linear_out = frames[(frames.module == "0") & (frames.role == "output")].iloc[0]
    assert relu.loc["input[0]", "abs_max"] == pytest.approx(expected.abs().max().item())
    assert relu.loc["input[0]", "abs_min"] == pytest.approx(expected.abs().min().item())
    assert relu.loc["output", "abs_min"] == 0.0
    # Measured by the ReLU pre-hook before the overwrite, so the Linear output is exact too.
    assert linear_out.abs_max == pytest.approx(expected.abs().max().item())


def test_inference_mode_forward_is_recorded_and_replayed(tiny_mlp):
    # Inference tensors have no version counter: they are told apart by identity.
    x = torch.randn(5, 16) * 2
    with nw.watch(tiny_mlp, on_nan="record") as w:
        with torch.inference_mode():
            out = tiny_mlp(x)
            tiny_mlp(x)
        frames = w.frames()
        trace = w.replay(1)
    assert len(frames[frames.batch == 1]) == len(frames[frames.batch == 0]) > 0
    root = frames[(frames.module == "") & (frames.batch == 1)].set_index("role")
    assert root.loc["output", "abs_max"] == pytest.approx(out.abs().max().item())
    assert root.loc["input[0]", "abs_min"] == pytest.approx(x.abs().min().item())
    assert (frames.note == "").all()
    replayed = trace.frames[trace.frames.module == ""].set_index("role")
    assert replayed.loc["output", "abs_max"] == root.loc["output", "abs_max"]


def test_in_place_change_after_a_hook(reduction_path):
    class Scales(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            h = self.first(x)
            h.mul_(float("inf"))  # after first's hook, before second
            return self.second(h)

    model = Scales()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(3, 4))
        event = w.event
        frames = w.frames()
    first_out = frames[(frames.module == "first") & (frames.role == "output")].iloc[0]
    # Both paths measure a tensor when its hook runs: one answer, the values first returned,
    # and the event where the bad tensor arrives next (the in-place op sits between modules).
    assert (event.module, event.origin, event.role) == ("second", "input", "input[0]")
    assert first_out.note == "" and not first_out.inf


def test_history_has_one_row_per_batch_and_module(tiny_mlp):
    with nw.watch(tiny_mlp) as w:
        outs = [tiny_mlp(torch.randn(2, 16)) for _ in range(3)]
        history = w.history()
    assert len(history) == 3 * 5  # five distinct modules (act is shared)
    root = history[history.module == ""].sort_values("batch")
    assert root.abs_max.tolist() == pytest.approx([o.abs().max().item() for o in outs])
    assert (history.batch == history.batch_end).all()
    assert not history.nonfinite.any()


class _QuantizedMLP(nn.Module):
    """An MLP for torch.ao eager static quantization, with an argmax head (integer output)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.fc1 = nn.Linear(8, 16)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))
        return scores, scores.argmax(-1)


def test_history_has_rows_for_modules_with_quantized_outputs():
    # After torch.ao convert, quant, fc1, relu and fc2 return quint8 tensors: their frames had
    # abs_max, but history() (what trend plots read) had rows for '' and dequant only.
    torch.manual_seed(0)
    quantization = torch.ao.quantization
    model = _QuantizedMLP().eval()
    model.qconfig = quantization.get_default_qconfig("x86")
    quantization.prepare(model, inplace=True)
    for _ in range(3):
        model(torch.randn(4, 8))
    quantization.convert(model, inplace=True)
    with nw.watch(model) as w, torch.no_grad():
        outs = [model(torch.randn(4, 8)) for _ in range(2)]
        history, frames = w.history(), w.frames()
    assert str(frames.query("module == 'fc2' and role == 'output'")["dtype"].iloc[0]) == "quint8"
    assert sorted(set(history.module)) == ["", "dequant", "fc1", "fc2", "quant", "relu"]
    fc2 = history[history.module == "fc2"].sort_values("batch")
    assert fc2.abs_max.tolist() == pytest.approx([o[0].abs().max().item() for o in outs])
    # The root's row is its scores' alone: the argmax (token-id-like integers) adds nothing.
    root = history[history.module == ""].sort_values("batch")
    assert root.abs_min.tolist() == pytest.approx([o[0].abs().min().item() for o in outs])


def test_frames_dataframe_types_are_stable_when_empty(tiny_mlp):
    with nw.watch(tiny_mlp) as w:
        frames = w.frames()
        history = w.history()
    assert frames.empty and list(frames.columns) == FRAME_COLUMNS
    assert history.empty and "abs_max" in history.columns
    assert isinstance(frames, pd.DataFrame)


class _State:
    """A cache-like plain object of tensors that every block reads and updates."""

    def __init__(self) -> None:
        self.k = torch.ones(3)
        self.v = torch.zeros(3)
        self.ready = False


class _UpdatingBlock(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor, state: _State) -> torch.Tensor:
        if self.how == "replace":
            state.k = state.k * 2  # a new tensor in the slot (DynamicCache's torch.cat)
        elif self.how == "in place":
            state.v.add_(1.5)  # the same tensor, a new version (StaticCache's index_copy_)
        elif self.how == "new attribute":
            state.extra = torch.full((3,), 7.0)
        return x + 1


class _CacheModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_UpdatingBlock(how) for how in
                                    ("none", "replace", "none", "in place", "new attribute",
                                     "none", "replace"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = _State()
        for block in self.blocks:
            x = block(x, state=state)
        return x


def test_a_cache_object_walked_at_every_block_shows_its_values_at_each_call():
    # Plain objects of tensors seen again in a batch reuse their entries while their
    # attributes are the same tensors in the same versions: a replaced, written or added
    # tensor must show at once.
    model = _CacheModel()
    seen: list[dict[str, float]] = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, kwargs, output: seen.append(
            {f"kwarg:state.{name}": float(value.abs().max())
             for name, value in vars(kwargs["state"]).items() if isinstance(value, torch.Tensor)}),
            with_kwargs=True)
    with nw.watch(model, trace_batches=[1]) as w:
        for _ in range(2):
            seen.clear()
            model(torch.zeros(2, 3))
        frames = w.frames(batch=1)
    for position, expected in enumerate(seen):
        own = frames[(frames.module == f"blocks.{position}") & frames.role.str.startswith("kwarg:")]
        assert dict(zip(own.role, own.abs_max)) == expected, position
    assert seen[-1] == {"kwarg:state.k": 4.0, "kwarg:state.v": 1.5, "kwarg:state.extra": 7.0}


def test_a_nan_warning_points_at_the_line_that_called_the_model():
    # on_nan="warn": the warning pointed inside torch (module.py, "return self._call_impl").
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, on_nan="warn"):
            line = sys._getframe().f_lineno + 1
            model(torch.randn(2, 4))
    said = [c for c in caught if issubclass(c.category, nw.NanWarning)]
    assert len(said) == 1 and (said[0].filename, said[0].lineno) == (__file__, line)

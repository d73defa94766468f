"""Bad input never crashes a forward pass: odd dtypes, layouts and nested structures get notes."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

import nanwidget as nw
from nanwidget.core.walk import iter_leaves


class Echo(nn.Module):
    """Returns whatever it is given, so any structure becomes an output."""

    def forward(self, *args, **kwargs):
        return args if not kwargs else (args, kwargs)


@pytest.mark.parametrize("tensor, note", [
    (torch.ones(3, dtype=torch.bool), "bool"),
    (torch.arange(4), "int"),
    (torch.ones(2, dtype=torch.uint8), "int"),
    (torch.ones(2, dtype=torch.complex64), "complex"),
    (torch.empty(0, 5), "empty"),
    (torch.ones(2, 2).to_sparse(), "sparse"),
    (torch.empty(2, 2, device="meta"), "meta"),
    (torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)], layout=torch.jagged), "nested"),
])
def test_tensors_without_stats_get_a_note(tensor, note):
    model = Echo()
    with nw.watch(model) as w:
        model(tensor)
        frames = w.frames()
    row = frames.set_index("role").loc["input[0]"]
    assert row.note == note
    assert math.isnan(row.abs_max) and not row.nan and not row.inf


def test_float8_bfloat16_and_float64_tensors_are_measured():
    model = Echo()
    values = [torch.tensor([0.5, -2.0], dtype=d) for d in (torch.bfloat16, torch.float64)]
    if hasattr(torch, "float8_e4m3fn"):
        values.append(torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn))
    with nw.watch(model) as w:
        model(*values)
        frames = w.frames().query("role.str.startswith('input')", engine="python")
    assert frames.abs_max.tolist() == [2.0] * len(values)
    assert frames.abs_min.tolist() == [0.5] * len(values)


def test_float64_values_beyond_float32_range_are_not_reported_as_inf():
    model = Echo()
    with nw.watch(model) as w:
        model(torch.tensor([1e300], dtype=torch.float64))
        row = w.frames().iloc[0]
    assert row.abs_max == 1e300 and not row.inf


def test_none_and_non_tensor_inputs_and_kwargs():
    model = Echo()
    with nw.watch(model) as w:
        model(None, 3, "text", mask=None, flag=True)
        frames = w.frames().set_index("role")
    assert frames.loc["input[0]", "note"] == "None"
    assert frames.loc["input[1]", "note"] == "not a tensor"
    assert frames.loc["kwarg:mask", "note"] == "None"
    assert frames.loc["kwarg:flag", "note"] == "not a tensor"


def test_self_referencing_structure_is_cut_off_not_recursed_forever():
    loop: list = []
    loop.append(loop)
    leaves = list(iter_leaves(loop, "output"))
    assert len(leaves) == 1 and leaves[0][0] == "output" + "[0]" * 6


def test_huge_structures_are_capped():
    many = [torch.ones(1)] * 10_000
    assert len(list(iter_leaves(many, "output"))) == 256


# A strategy for the structures forward passes return: tensors of many dtypes, nested in
# tuples, lists and dicts, with None and plain objects among them.
_dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64,
                           torch.int64, torch.bool, torch.complex64])
_special = st.sampled_from([None, 0.0, float("nan"), float("inf"), -float("inf")])


@st.composite
def _tensors(draw):
    dtype = draw(_dtypes)
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    tensor = torch.randn(tuple(shape)).to(dtype) if dtype.is_floating_point or dtype.is_complex \
        else torch.randint(0, 3, tuple(shape)).to(dtype)
    special = draw(_special)
    if special is not None and tensor.numel() and dtype.is_floating_point:
        tensor.view(-1)[0] = special
    return tensor


_leaves = st.one_of(_tensors(), st.none(), st.integers(), st.text(max_size=3))
_structures = st.recursive(
    _leaves,
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.tuples(children, children),
                               st.dictionaries(st.text("abc", min_size=1, max_size=2), children, max_size=3)),
    max_leaves=8)


def _expected_leaves(value, role):
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple, dict)):
        return [(role, value)]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _expected_leaves(v, f"{role}.{k}")]
    return [leaf for i, v in enumerate(value) for leaf in _expected_leaves(v, f"{role}[{i}]")]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_structures)
def test_any_nested_output_is_recorded_with_exact_stats(structure):
    model = Echo()
    with nw.watch(model, on_nan="record") as w:
        model(structure)
        frames = w.frames()
    expected = _expected_leaves(structure, "input[0]")
    rows = frames[frames.role.str.startswith("input[0]")]
    assert rows.role.tolist() == [role for role, _ in expected]
    for (role, value), row in zip(expected, rows.itertuples()):
        if not isinstance(value, torch.Tensor):
            assert row.note == ("None" if value is None else "not a tensor")
            continue
        if not value.dtype.is_floating_point or value.numel() == 0:
            assert row.note != "" and math.isnan(row.abs_max)
            continue
        data = value.double()
        assert row.nan == bool(torch.isnan(data).any())
        assert row.inf == bool(torch.isinf(data).any())
        if not row.nan:
            assert row.abs_max == data.abs().max().item()
            assert row.abs_min == data.abs().min().item()
    # A NaN anywhere in the input is an event, with the right kind.
    bad = [(r, v) for r, v in expected if isinstance(v, torch.Tensor) and v.dtype.is_floating_point
           and v.numel() and not torch.isfinite(v.double()).all()]
    if bad:
        assert w.event is not None and w.event.role == bad[0][0]
    else:
        assert w.event is None


def test_a_tensor_whose_storage_was_freed_gets_a_note_not_a_crash(reduction_path):
    # FSDP frees parameter storage between forwards; reading such a tensor would crash.
    class Freed(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            y = x * 2
            self.scale.data.untyped_storage().resize_(0)  # gone before the hook runs
            return y

    model = nn.Sequential(Freed(), nn.ReLU())
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(3, 4))
        frames = w.frames()
    scale = frames[(frames.module == "0") & (frames.role == "scale")].iloc[0]
    assert scale.note == "storage freed" and scale.abs_max != scale.abs_max
    assert (frames[frames.role != "scale"].note == "").all()

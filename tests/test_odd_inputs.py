"""Bad input never crashes a forward pass: odd dtypes, layouts and nested structures get notes."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

import nanwidget as nw
from nanwidget.core.walk import Unread, iter_leaves


class Echo(nn.Module):
    """Returns whatever it is given, so any structure becomes an output."""

    def forward(self, *args, **kwargs):
        return args if not kwargs else (args, kwargs)


@pytest.mark.parametrize("tensor, note", [
    (torch.ones(3, dtype=torch.bool), "bool"),
    (torch.empty(0, 5), "empty"),
    (torch.empty(2, 2, device="meta"), "meta"),
])
def test_tensors_without_magnitudes_get_a_note(tensor, note):
    model = Echo()
    with nw.watch(model) as w:
        model(torch.zeros(2), tensor)  # beside data: a call on meta tensors alone is no batch
        frames = w.frames()
    row = frames.set_index("role").loc["input[1]"]
    assert row.note == note
    assert math.isnan(row.abs_max) and not row.nan and not row.inf


def _jagged(*rows):
    return torch.nested.nested_tensor(list(rows), layout=torch.jagged)


@pytest.mark.parametrize("tensor, low, high", [
    (torch.arange(-3, 5), 0.0, 4.0),                               # token ids, signed ints
    (torch.tensor([7, 200], dtype=torch.uint8), 7.0, 200.0),
    (torch.tensor([3 + 4j, 0.6 + 0.8j], dtype=torch.complex64), 1.0, 5.0),  # magnitudes
    (torch.tensor([[0.0, -2.0], [0.0, 0.0]]).to_sparse(), 0.0, 2.0),  # implicit zeros count
    (torch.tensor([[1.5, 0.0], [0.0, -2.0]]).to_sparse_csr(), 0.0, 2.0),
    (_jagged(torch.full((2, 4), 0.5), torch.full((3, 4), -3.0)), 0.5, 3.0),
    (torch.nested.nested_tensor([torch.full((2,), 0.25), torch.full((3,), 4.0)]), 0.25, 4.0),
])
def test_int_complex_sparse_and_nested_tensors_are_measured(tensor, low, high):
    model = Echo()
    with nw.watch(model) as w:
        model(tensor)
        row = w.frames().set_index("role").loc["input[0]"]
    assert row.note == "" and (row.abs_min, row.abs_max) == (low, high)
    assert (row.finite_abs_min, row.finite_abs_max) == (low, high)


class ScaleNested(nn.Module):
    """Takes a nested tensor and returns one (a weight times each component)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.scale(x))


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_a_nested_tensor_has_its_shape_with_none_for_the_ragged_dimension(layout, tmp_path):
    # Its shape was () in every frame, as if it were a scalar: two rows of 2 and 3 vectors of 4
    # are (2, None, 4), in the frames, a replay's ops and a recording alike.
    torch.manual_seed(0)
    model = ScaleNested()
    rows = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=layout)
    with nw.watch(model, log_dir=tmp_path / "log", trace_batches=[0]) as watch:
        out = model(rows)
        frames = watch.frames(batch=0)
        ops = watch.replay(0).ops
    assert out.is_nested and [t.shape for t in out.unbind()] == [(2, 4), (3, 4)]
    nested = frames[frames["role"].isin(["input[0]", "output"])]
    assert len(nested) == 4 and set(nested["shape"]) == {(2, None, 4)}
    assert set(frames.loc[frames["role"] == "weight", "shape"]) == {(4, 4)}
    assert (2, None, 4) in set(ops["shape"])
    stored = nw.load_run(tmp_path / "log").frames(batch=0)
    assert stored["shape"].tolist() == frames["shape"].tolist()


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_a_module_taking_and_returning_a_nested_tensor_runs_backward_under_the_watch(layout):
    # backward=True read a strided nested tensor's .shape, which raises: an internal error, and
    # no gradient frames for the nested tensors.
    torch.manual_seed(0)
    model = ScaleNested()
    rows = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=layout,
                                      requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, backward=True, trace_batches=[0]) as watch:
            out = model(rows)
            torch.cat([part.reshape(-1) for part in out.unbind()]).sum().backward()
            frames = watch.frames(batch=0)
    assert not [w for w in caught if "internal error" in str(w.message)]
    assert model.scale.weight.grad is not None and rows.grad is not None
    backward = frames[frames["phase"] == "backward"]
    grads = backward[backward["role"].isin(["grad_output[0]", "grad_input[0]"])]
    assert len(grads) == 4 and set(grads["shape"]) == {(2, None, 4)}
    root = grads[grads["module"] == ""].set_index("role")["abs_max"]
    largest = torch.cat([part.reshape(-1) for part in rows.grad.unbind()]).abs().max()
    assert (root["grad_output[0]"], root["grad_input[0]"]) == (1.0, float(largest))


@pytest.mark.parametrize("make", [
    lambda: torch.tensor([1.0, float("nan"), 2.0]).to(torch.complex64),
    lambda: torch.sparse_coo_tensor([[0, 1]], [1.0, float("nan")], (4,)),
    lambda: _jagged(torch.ones(2, 2), torch.tensor([[1.0, float("nan")]])),
    lambda: torch.tensor([0.5, float("nan")]).to(torch.float8_e4m3fn),
])
def test_a_nan_in_any_tensor_kind_is_an_event_and_never_crashes_the_forward(make):
    model = Echo()
    with nw.watch(model, on_nan="record") as w:
        model(make())
    assert w.event is not None and w.event.kind == "nan" and w.event.role == "input[0]"


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


def test_self_referencing_structure_is_walked_once_not_recursed_forever():
    loop: list = [torch.ones(1)]
    loop.append(loop)
    leaves = list(iter_leaves(loop, "output"))
    assert [role for role, _ in leaves] == ["output[0]", "output[1]"]
    assert isinstance(leaves[1][1], Unread) and "contains itself" in leaves[1][1].why


def test_no_limit_on_size_or_depth_hides_a_value():
    many = [torch.ones(1) for _ in range(10_000)]
    many[9_999] = torch.tensor([float("nan")])
    deep: object = torch.tensor([float("nan")])
    for _ in range(2_000):
        deep = [deep]
    assert len(list(iter_leaves(many, "output"))) == 10_000
    (role, leaf), = iter_leaves(deep, "output")
    assert role == "output" + "[0]" * 2_000 and torch.isnan(leaf).all()
    model = Echo()
    for structure, role in ((many, "input[0][9999]"), ((deep,), "input[0][0]" + "[0]" * 2_000)):
        with nw.watch(model, on_nan="record") as w:
            model(structure)
        assert w.event is not None and w.event.role == role


class _Holder:
    """A plain object with tensors as attributes (no dataclass, no mapping)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.logits = torch.ones(2)
        self.extra = {"hidden": hidden}


def test_sets_and_plain_objects_are_walked_and_iterators_are_noted_not_consumed():
    model = Echo()
    nan = torch.tensor([float("nan")])
    stream = iter([torch.ones(1)])
    with nw.watch(model, on_nan="record") as w, \
            pytest.warns(RuntimeWarning, match="not read") as caught:
        model(_Holder(nan), {torch.ones(1)}, stream)
        frames = w.frames().set_index("role")
    assert caught[0].filename == __file__  # it points at the line that called the model
    assert frames.loc["input[0].extra.hidden", "nan"]
    assert frames.loc["input[1]{0}", "abs_max"] == 1.0
    assert frames.loc["input[2]", "note"] == "not read"
    assert next(stream).item() == 1.0  # the user's iterator was not consumed
    assert w.event is not None and w.event.role == "input[0].extra.hidden"


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
        if value.dtype is torch.bool or value.numel() == 0:
            assert row.note != "" and math.isnan(row.abs_max)
            continue
        data = value.abs().double()  # magnitudes (of complex values too)
        finite = data[torch.isfinite(data)]
        assert row.nan == bool(torch.isnan(data).any())
        assert row.inf == bool(torch.isinf(data).any())
        if not row.nan:
            assert row.abs_max == data.max().item()
            assert row.abs_min == data.min().item()
        if finite.numel():
            assert (row.finite_abs_min, row.finite_abs_max) == (finite.min().item(),
                                                                finite.max().item())
        else:
            assert math.isnan(row.finite_abs_max)
    # Echo returns what it gets, so a NaN/Inf anywhere reaches its outputs: an event whose
    # origin is the input that brought it (one with a NaN first).
    bad = [(r, v) for r, v in expected if isinstance(v, torch.Tensor) and v.dtype is not torch.bool
           and v.numel() and not torch.isfinite(v.abs().double()).all()]
    with_nan = [r for r, v in bad if torch.isnan(v.abs().double()).any()]
    if bad:
        assert w.event is not None and w.event.origin == "input"
        assert w.event.role == (with_nan[0] if with_nan else bad[0][0])
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


def test_an_output_whose_storage_was_freed_or_shrunk_is_left_unread(reduction_path):
    # Such an output holds no values (or fewer than it claims): reading it crashed the process
    # (segmentation fault) on the sentinel's torch path (freed) and on the kernel (shrunk). One
    # process runs every case (a crash ends it: the last line printed names the case).
    code = textwrap.dedent(f"""
        import torch, nanwidget as nw
        from nanwidget.core import native
        if {reduction_path == "torch"!r}:
            native.available = lambda: False
        class PassOn(torch.nn.Module):
            def forward(self, x, y):
                return x, y * 2
        model = PassOn()
        for storage in (0, 4):  # freed, shrunk
            for mode, backward in (("full", False), ("sentinel", False), ("sentinel", True)):
                print("case", storage, mode, backward, flush=True)
                held = torch.randn(1_000_000)
                held.untyped_storage().resize_(storage)
                with nw.watch(model, mode=mode, backward=backward, on_nan="record") as w:
                    for _ in range(2):
                        model(held, torch.ones(3))
                    history = w.history()
                    notes = sorted(set(w.frames().query("role == 'output[0]'").note))
                    print(w.event, history[history.module == ""]["abs_max"].tolist(), notes)
                    model(held, torch.tensor([1.0, float("nan")]))  # the diagnosis reads inputs
                    print(w.event.diagnosis.kind)
        # A weight whose storage is freed after each forward (FSDP1 does so): the diagnosis
        # measures the weights at an event after three batches.
        class Frees(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = torch.nn.Parameter(torch.ones(3))
            def forward(self, x):
                storage = self.scale.data.untyped_storage()
                storage.resize_(12)  # gathered back before use (FSDP allocates it again)
                self.scale.data.fill_(1.0)
                y = x * self.scale
                storage.resize_(0)
                return y
        model = Frees()
        with nw.watch(model, on_nan="record") as w:
            for batch in range(4):
                model(torch.tensor([1.0, float("nan") if batch == 3 else 2.0, 3.0]))
            print("freed weight", w.event.diagnosis.kind)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, (result.stdout[-300:], result.stderr[-2000:])
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 19
    # y * 2 checked, the freed or shrunk x skipped (full mode notes it)
    assert lines[1:18:3] == ["None [2.0, 2.0] ['storage freed']", "None [2.0, 2.0] []",
                             "None [2.0, 2.0] []"] * 2
    assert lines[2:18:3] == ["bad-data"] * 6  # the NaN in y, with x left unread
    assert lines[18] == "freed weight bad-data"


def test_structures_walked_directly_give_the_entries_iter_leaves_gives():
    # EntryBuilder walks tuples, lists, mappings and plain objects itself (a transformers cache
    # object on every call, a ModelOutput at every return): same roles, order, notes and cycle
    # marks as the generic walk.
    import dataclasses
    from collections import OrderedDict

    from nanwidget.core.entries import EntryBuilder
    from nanwidget.core.stats import PendingStats
    from nanwidget.core.walk import iter_leaves

    class Layer:
        def __init__(self) -> None:
            self.keys, self.values, self._hidden = torch.ones(2), None, torch.zeros(1)
            self.is_initialized, self.device = True, torch.device("cpu")

    class Cache:
        def __init__(self) -> None:
            self.layers = [Layer(), Layer()]
            self.extra = {"k": torch.ones(1), 2: [1]}

    @dataclasses.dataclass
    class Pair:
        x: torch.Tensor
        y: int = 0

    class Slotted:
        __slots__ = ("q",)

    loop: list = [1]
    loop.append(loop)
    itself = Cache()
    itself.again = itself
    mapping: dict = {"a": [1]}
    mapping["me"] = mapping
    deep = inner = []
    for _ in range(60):
        nested = [torch.ones(1)]
        inner.append(nested)
        inner = nested
    class Settings:  # a plain object without tensors
        def __init__(self) -> None:
            self.size, self.name, self.device, self.sizes = 4, "s", torch.device("cpu"), [1, 2]

    class Batch:  # tensors beside flags, lists of numbers, an iterator and an inner object
        def __init__(self) -> None:
            self.ids, self.lengths, self.settings = torch.arange(3), [3, 1], Settings()
            self.parts = [Settings(), {"mask": torch.ones(2), "n": 2}]
            self.pending = iter([1])

    for value in (Cache(), Settings(), Batch(), [Settings(), torch.ones(1), Batch()],
                  {"config": Settings(), "batch": Batch()},
                  [Pair(torch.ones(2)), Slotted(), torch.float32, len, iter([1])],
                  loop, itself, [mapping], deep, (torch.ones(1), None, "s"),
                  OrderedDict(a=torch.ones(1)), {1, 2},
                  OrderedDict(logits=torch.ones(2), past_key_values=Cache()),
                  {3: (torch.ones(1), iter([2])), "nested": {"deeper": [mapping]}}):
        generic, direct = EntryBuilder(PendingStats()), EntryBuilder(PendingStats())
        expected = [generic.leaf_entry(role, leaf) for role, leaf in iter_leaves(value, "output")]
        got: list = []
        direct.structure_entries(value, "output", got)
        assert [(e.role, e.dtype, e.shape, e.note) for e in got] == \
            [(e.role, e.dtype, e.shape, e.note) for e in expected]
        assert direct.unread_roles == generic.unread_roles


class _TakesObjects(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, batch: Any, settings: Any) -> Any:
        out = self.fc(batch.x)
        batch.seen = out.detach()  # an object the forward writes into, as caches do
        return out


class _Settings:
    def __init__(self) -> None:
        self.width, self.name, self.device, self.scales = 4, "wide", torch.device("cpu"), [1.0]


class _Batch:
    def __init__(self) -> None:
        self.x, self.lengths, self.is_padded, self.settings = torch.ones(2, 4), [4, 4], False, \
            _Settings()
        self.extra = {"mask": torch.ones(2, dtype=torch.bool), "count": 2}


@pytest.mark.parametrize("options", [{}, {"mode": "sentinel", "sample_every": 1}],
                         ids=["full", "sentinel"])
def test_a_plain_objects_tensors_get_rows_its_flags_and_settings_do_not(options):
    # A plain object's attributes are walked for the tensors they hold; its numbers, flags,
    # devices and inner settings are no data (a transformers cache would put some twenty such
    # rows in every attention call's frame). An object with no tensor at all is one row.
    model = _TakesObjects()
    with nw.watch(model, on_nan="record", **options) as w:
        model(_Batch(), settings=_Settings())
        frames = w.frames()
    root = frames[frames.module == ""]
    roles = dict(zip(root.role, root.note))
    assert roles == {"input[0].x": "", "input[0].extra.mask": "bool",
                     "kwarg:settings": "not a tensor", "output": ""}
    assert root.set_index("role").loc["input[0].x", "abs_max"] == 1.0


class _PassOn(nn.Module):
    def forward(self, x):
        return x


def test_an_uncoalesced_sparse_tensor_is_measured_as_its_dense_values(reduction_path):
    # Duplicate indices add up: 1 + 2 at one place is a 3, and two large finite values there
    # are an Inf (the raw stored values said 2 and "finite").
    model = nn.Sequential(_PassOn())
    index = torch.tensor([[0, 0], [1, 1]])
    sums_to_three = torch.sparse_coo_tensor(index, torch.tensor([1.0, 2.0]), (3, 3))
    overflows = torch.sparse_coo_tensor(index, torch.tensor([3e38, 3e38]), (3, 3))
    with nw.watch(model, on_nan="record") as w:
        model(sums_to_three)
        measured = w.frames().iloc[-1]
        model(overflows)
        overflowed = w.frames().iloc[-1]
    assert (measured.abs_min, measured.abs_max, bool(measured.inf)) == (0.0, 3.0, False)
    assert bool(overflowed.inf) and w.event is not None and w.event.kind == "inf"
    with nw.watch(model, mode="sentinel", on_nan="record") as w:
        model(overflows)
    assert w.event is not None and w.event.kind == "inf"


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_wide_unsigned_integers_get_their_range(reduction_path, dtype):
    model = nn.Sequential(_PassOn())
    with nw.watch(model) as w:
        model(torch.tensor([7, 3, 250], dtype=dtype))
        frame = w.frames().iloc[-1]
    assert (frame.abs_min, frame.abs_max, frame.note) == (3.0, 250.0, "")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_in_a_float8_output_is_found_in_both_modes(reduction_path, mode):
    model = nn.Sequential(_PassOn())
    values = torch.tensor([1.0, float("nan"), -2.0]).to(torch.float8_e5m2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "internal error" warning either
        with nw.watch(model, mode=mode, on_nan="record") as w:
            model(values)
    assert w.event is not None and w.event.kind == "nan"


class _SpectralGain(nn.Module):
    """Scales a complex spectrum by a learned real gain (an FNO-style spectral layer's step)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, spectrum: torch.Tensor) -> torch.Tensor:
        return spectrum * self.gain.to(spectrum.real.dtype)


@pytest.mark.parametrize("dtype, component", [(torch.complex64, 3e38), (torch.complex32, 5e4)],
                         ids=str)
def test_a_finite_complex_tensor_whose_magnitude_passes_its_float_max_is_no_event(
        reduction_path, dtype, component):
    # |3e38 + 3e38j| = 4.2e38 is past float32's max although both components are finite:
    # full mode raised "inf ... input[0]" where torch.isfinite, the sentinel and
    # detect_overflow all said finite. Magnitudes are now computed in float64.
    real = torch.full((4,), component, dtype=dtype.to_real())
    spectrum = torch.complex(real, real)
    assert torch.isfinite(spectrum).all()
    model = _SpectralGain()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is experimental
        with nw.watch(model, on_nan="record") as w:
            model(spectrum)
            row = w.frames().set_index("role").loc["input[0]"]
    assert w.event is None and not row.inf and not row.nan and row.note == ""
    assert row.abs_max == pytest.approx(component * math.sqrt(2), rel=1e-3)


@pytest.mark.parametrize("part, kind", [("real", "inf"), ("imag", "nan")])
def test_a_non_finite_component_of_a_complex_tensor_is_still_an_event(reduction_path, part,
                                                                       kind):
    spectrum = torch.complex(torch.ones(4), torch.ones(4))
    getattr(spectrum, part)[1] = math.inf if kind == "inf" else math.nan
    model = nn.Sequential(_PassOn())
    with nw.watch(model, on_nan="record") as w:
        model(spectrum)
        row = w.frames().query("module == ''").set_index("role").loc["input[0]"]
    assert w.event is not None and (w.event.kind, w.event.role) == (kind, "input[0]")
    assert (bool(row.nan), bool(row.inf)) == (kind == "nan", kind == "inf")
    assert (row.finite_abs_min, row.finite_abs_max) == pytest.approx((2 ** 0.5, 2 ** 0.5))


class _LabelledEmbedding(nn.Module):
    """Token ids in, the loss over labels that mark ignored positions with -100 (as
    transformers' data collators do)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten().long(),
                                           ignore_index=-100)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16], ids=str)
@pytest.mark.parametrize("contiguous", [True, False])
def test_integers_of_both_signs_get_their_smallest_magnitude(reduction_path, dtype, contiguous):
    # abs_min was 0 for labels [17, 42, -100] (the signed range -100 to 42 holds 0), where the
    # same values as float32 gave 17.
    torch.manual_seed(0)
    model = _LabelledEmbedding()
    ids = torch.tensor([[5, 17, 42]])
    labels = torch.tensor([[17, 42, -100]], dtype=dtype)
    if not contiguous:
        labels = torch.stack([labels, labels], -1)[..., 0]
    with nw.watch(model) as w:
        model(ids, labels)
        rows = w.frames().query("module == ''").set_index("role")
    assert (rows.loc["input[1]", "abs_min"], rows.loc["input[1]", "abs_max"]) == (17.0, 100.0)
    assert (rows.loc["input[0]", "abs_min"], rows.loc["input[0]", "abs_max"]) == (5.0, 42.0)


@pytest.mark.parametrize("values, low", [
    ([-(2 ** 63), 5], 5.0),     # |x| of the type's minimum overflows in int64
    ([-(2 ** 63), -3], 3.0),
    ([-7, 0, 9], 0.0),
    ([-2, 3], 2.0),
])
def test_the_smallest_magnitude_of_signed_integers_is_exact_at_the_types_edge(reduction_path,
                                                                               values, low):
    model = nn.Sequential(_PassOn())
    with nw.watch(model) as w:
        model(torch.tensor(values))
        frame = w.frames().iloc[-1]
    assert frame.abs_min == low and frame.note == ""


class _GraphBatch:
    """PyG's Data/Batch in miniature: its tensors in a private mapping, read and written as
    attributes, and callable (``data(*keys)``), so that it looked like a function."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.__dict__["_store"] = dict(tensors)

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self.__dict__["_store"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: torch.Tensor) -> None:
        self.__dict__["_store"][name] = value

    def __call__(self, *keys: str):
        yield from ((key, self._store[key]) for key in keys or self._store)

    def __copy__(self) -> "_GraphBatch":
        return _GraphBatch(**self._store)


class _WritesBack(nn.Module):
    """A PyG-style forward that writes its results back into the batch it got."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, data: _GraphBatch) -> torch.Tensor:
        data.x = torch.relu(self.a(data.x))
        data.x = torch.log(data.x - 0.5)  # NaN where x < 0.5
        return self.head(data.x)


def test_a_callable_data_batch_is_read_held_and_copied_like_data():
    # A PyG Data batch is callable: it was kept as a function (a leaf, "not a tensor"), so
    # its NaN data read "unknown", and replays ran on the caller's own object (after the
    # forward had written its results into it) and rebound its attributes.
    torch.manual_seed(0)
    model = _WritesBack()
    x = torch.randn(6, 8)
    x[4, 1] = float("nan")
    with nw.watch(model, on_nan="record") as w:
        model(_GraphBatch(x=x, batch=torch.zeros(6, dtype=torch.long)))
    diagnosis = w.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("bad-data", [4])
    assert diagnosis.summary.startswith("The batch's input[0].x holds NaN in row 4")

    clean = _GraphBatch(x=torch.randn(6, 8))
    given = clean.x
    with nw.watch(model, on_nan="record", replay_on_nan=True) as w:
        model(clean)
        trace = w.event.trace
        assert trace.reproduced and trace.first_bad["op"] == "log"
        clean.x = given  # the caller puts its batch back; a replay must not touch it
        again = w.replay(0)
    assert again.reproduced and clean.x is given
    root_inputs = again.frames[(again.frames.module == "") & (again.frames.role == "input[0].x")]
    assert float(root_inputs.abs_max.iloc[0]) == float(given.abs().max())


@pytest.mark.parametrize("native_kernel", ["1", "0"])
def test_a_forward_that_frees_its_input_then_raises_does_not_crash_the_sentinel(native_kernel):
    # Sentinel mode checks the held inputs of a forward that raised (it left no output): an
    # input whose storage an offloading hook freed before the error was read anyway, and the
    # process died of a segmentation fault (torch's own norm reads freed memory). A subprocess:
    # a crash must fail this test, not end the run.
    code = textwrap.dedent("""
        import torch, nanwidget as nw
        class Frees(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.l = torch.nn.Linear(4, 4)
            def forward(self, x, fail=False):
                y = self.l(x)
                x.untyped_storage().resize_(0)
                if fail:
                    raise RuntimeError("boom")
                return y
        model = Frees()
        with nw.watch(model, mode="sentinel", on_nan="record") as w:
            model(torch.randn(256, 4))
            with torch.no_grad():
                model.l.weight[0, 0] = float("nan")
            try:
                model(torch.randn(256, 4), fail=True)
            except RuntimeError as error:
                print("raised", error)
            print([(e.batch, e.module, e.role, e.origin) for e in w.events])
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "NANWIDGET_NATIVE": native_kernel})
    assert result.returncode == 0, (result.stdout[-300:], result.stderr[-2000:])
    assert result.stdout.strip().splitlines() == ["raised boom", "[(1, 'l', 'weight', 'weight')]"]

"""The native CPU kernel: same numbers as the torch path, used only where it may read memory,
built or found on first use, and never required."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import nanwidget as nw
from nanwidget.core import native
from nanwidget.core.stats import AbsMeter

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]

needs_kernel = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.status()}")


def test_kernel_is_in_use_wherever_a_c_compiler_is_installed():
    if not any(shutil.which(name) for name in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler on this machine: the torch path is the only one")
    assert native.available(), native.status()
    assert native.status().startswith("native kernel in use")


def _torch_path(tensor: torch.Tensor) -> tuple[float, float]:
    low, high = AbsMeter(use_scratch=False).measure(tensor)
    return low, high


@needs_kernel
@settings(max_examples=120, deadline=None)
@given(dtype=st.sampled_from(DTYPES),
       shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       layout=st.sampled_from(["contiguous", "transposed", "offset"]),
       specials=st.lists(st.sampled_from([0.0, -0.0, 1e-42, -1e-42, 7e4, -7e4, float("inf"),
                                          float("-inf"), float("nan")]), max_size=3),
       seed=st.integers(0, 2**16))
def test_kernel_agrees_with_the_torch_path(dtype, shape, layout, specials, seed):
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=generator, dtype=torch.float64) * 10 ** (seed % 7 - 3)
    flat = base.view(-1)
    for index, value in enumerate(specials[: flat.numel()]):
        flat[(index * 7919) % flat.numel()] = value
    tensor = base.to(dtype)
    if layout == "transposed":
        tensor = tensor.t() if tensor.dim() == 2 else tensor.permute(*reversed(range(tensor.dim())))
    elif layout == "offset":  # a contiguous view that starts inside a bigger storage
        tensor = torch.cat([torch.ones(3, dtype=dtype), tensor.reshape(-1)])[3:].view(tensor.shape)
    assert native.eligible(tensor)
    low, high = native.abs_range(tensor)
    expected_low, expected_high = _torch_path(tensor)
    if expected_high != expected_high:  # a NaN: the torch path reports NaN for both
        assert high != high
    else:
        assert (low, high) == (expected_low, expected_high)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_finds_the_extremes_at_every_position_of_its_blocks_and_tail(dtype):
    # The kernel keeps several running min/max pairs side by side (a block of 4 to 64
    # elements) and reads the elements past the last whole block one by one.
    for length in (3, 31, 63, 64, 65, 129, 130):
        values = torch.linspace(1.0, 2.0, length, dtype=torch.float64).to(dtype)
        for position in range(length):
            tensor = values.clone()
            tensor[position] = -1e-3  # smallest magnitude, negative
            tensor[length - 1 - position] = -3.0  # largest magnitude (wins a collision)
            expected = _torch_path(tensor)
            assert native.abs_range(tensor) == expected, (length, position)


def test_only_dense_plain_cpu_float_tensors_are_eligible():
    grid = torch.randn(6, 8)
    assert native.eligible(grid) and native.eligible(grid.t()) and native.eligible(grid[2:4])
    assert native.eligible(nn.Parameter(torch.randn(3)))
    assert not native.eligible(grid[:, ::2])  # gaps between elements
    assert not native.eligible(torch.randn(4, 1).expand(4, 5))  # stride 0: overlapping
    assert not native.eligible(grid.to(torch.int32))
    assert not native.eligible(torch.randn(2, dtype=torch.complex64))
    assert not native.eligible(torch.empty(0))
    assert not native.eligible(torch.empty(3, device="meta"))

    class Tagged(torch.Tensor):
        pass

    assert not native.eligible(grid.as_subclass(Tagged))


@needs_kernel
def test_contiguous_range_reads_what_abs_range_reads_and_leaves_the_rest_to_it():
    out = native.result_buffer()
    grid = torch.randn(6, 8)
    grid[1, 2] = -7.5
    for tensor in (grid, nn.Parameter(grid.clone()), grid.half(), grid[2:4]):
        assert native.contiguous_range(tensor, out) == native.abs_range(tensor, out)
    nan = grid.clone()
    nan[0, 0] = float("nan")
    assert native.contiguous_range(nan, out)[1] != native.contiguous_range(nan, out)[1]

    class Tagged(torch.Tensor):
        pass

    # the general rules decide these: transposed, strided with gaps, integers, empty, meta,
    # a subclass
    for other in (grid.t(), grid[:, ::2], grid.to(torch.int32), torch.empty(0),
                  torch.empty(3, device="meta"), grid.as_subclass(Tagged)):
        assert native.contiguous_range(other, out) is None


def _has_python_headers() -> bool:
    import sysconfig
    return Path(sysconfig.get_paths()["include"], "Python.h").exists()


def test_where_pythons_headers_are_installed_the_hooks_read_in_one_c_call():
    if not native.available():
        pytest.skip(native.status())
    if not _has_python_headers():
        assert native.status().endswith("called through ctypes (Python's headers were not found)")
        assert native.contiguous_reader() is native.contiguous_range
        pytest.skip("no Python headers here: the ctypes path is the one in use")
    assert native.status().endswith("read in one C call"), native.status()
    assert native.contiguous_reader() is not native.contiguous_range
    assert native.int_reader() is not native.int_range
    assert native.gradient_reader() is not native.gradient_range


@needs_kernel
def test_the_extensions_readers_take_and_decline_what_contiguous_range_does():
    out = native.result_buffer()
    read_floats, read_ints = native.contiguous_reader(), native.int_reader()
    read_grads = native.gradient_reader()
    generator = torch.Generator().manual_seed(5)
    grid = torch.randn(6, 8, generator=generator)
    grid[4, 1] = -9.25
    nan = grid.clone()
    nan[5, 7] = float("nan")
    freed = torch.randn(4)
    freed.untyped_storage().resize_(0)  # FSDP frees storage between forwards: nothing to read
    shrunk = torch.randn(1_000_000, generator=generator)
    shrunk_view, shrunk_first = shrunk[10:], shrunk[:1]  # views made while the storage held them
    shrunk.untyped_storage().resize_(4)  # would be read 4 MB past its end

    class Tagged(torch.Tensor):
        pass

    floats = [grid, grid[2:4], nn.Parameter(grid.clone()), grid.half(), grid.bfloat16(),
              grid.double(), nan, torch.randn(70_000, generator=generator),  # GIL let go
              grid.t(), grid[:, ::2], torch.empty(0), torch.empty(3, device="meta"),
              grid.as_subclass(Tagged), grid.to(torch.int64), freed, shrunk, shrunk_view,
              torch.empty(native._ONE_THREAD_ELEMENTS + 1)]  # past the one-thread limit
    ints = [torch.arange(-5, 9), torch.tensor([torch.iinfo(torch.int64).min, 3]),
            torch.arange(7, dtype=torch.int32), torch.arange(6).reshape(2, 3).t(),
            torch.arange(4, dtype=torch.int16), torch.empty(0, dtype=torch.int64), grid]
    for tensor in floats + ints:
        # The gradient reader never asks the storage: a shrunk one is never handed to it.
        unchecked = [] if tensor is shrunk or tensor is shrunk_view \
            else [(read_grads, native.gradient_range)]
        for read, reference in ((read_floats, native.contiguous_range),
                                (read_ints, native.int_range), *unchecked):
            expected = reference(tensor, out)
            found = read(tensor, out)
            if expected is not None and expected[1] != expected[1]:  # NaN: compare as text
                assert repr(found) == repr(expected)
            else:
                assert found == expected, (tensor.dtype, tuple(tensor.shape))
    assert read_floats(grid, out) == (grid.abs().min().item(), 9.25)
    assert read_grads(grid, out) == read_floats(grid, out)
    assert read_floats(shrunk, out) is None and not native.eligible(shrunk)
    assert read_floats(shrunk_first, out) == native.abs_range(shrunk_first)  # what it holds
    with pytest.raises(TypeError):
        read_floats()


def test_without_pythons_headers_the_ctypes_path_reads_the_same(tmp_path):
    if not any(shutil.which(name) for name in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler on this machine")
    cache = tmp_path / "cache"
    no_headers = ("import sysconfig; paths = sysconfig.get_paths; "
                  "sysconfig.get_paths = lambda *a, **k: {**paths(*a, **k), 'include': '/nowhere'}")
    result = _run_python(no_headers + "\n" + textwrap.dedent(_RECORD),
                         NANWIDGET_CACHE_DIR=str(cache))
    assert result.returncode == 0, result.stderr
    status, values = result.stdout.strip().splitlines()[-2:]
    assert status.endswith("called through ctypes (Python's headers were not found)"), status
    assert values == "0.5 8.0"
    assert [p.name.split("-")[0] for p in cache.iterdir()] == ["absrange"]  # no extension built


def test_big_tensors_go_to_torchs_threads_when_it_has_more_than_two():
    big = torch.empty(native._ONE_THREAD_ELEMENTS + 1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert native.eligible(big)
        torch.set_num_threads(4)
        assert not native.eligible(big) and native.eligible(big[:1000])
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(params=["native", "torch"])
def measuring_path(request, monkeypatch):
    """Each test runs once per path: the native kernel (skipped, saying why, where it cannot be
    built here) and the torch ops a machine without a C compiler uses."""
    if request.param == "native" and not native.available():
        pytest.skip(native.status())
    if request.param == "torch":
        monkeypatch.setattr(native, "available", lambda: False)
    return request.param


def test_both_paths_record_the_same_frames(measuring_path):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4).to(torch.float64))

    class Cast(nn.Module):
        def forward(self, x):
            return x.double()

    model.insert(2, Cast())
    x = torch.randn(5, 8)
    x[0, 0] = float("inf")
    with nw.watch(model, on_nan="record", max_frames=100) as w:
        model(x)
        frames = w.frames()
    reference = []
    with torch.no_grad():
        reference.append(_torch_path(x))
        h = model[0](x)
        reference.append(_torch_path(h))
    rows = frames[(frames.module == "0") & frames.role.isin(["input[0]", "output"])]
    assert list(zip(rows.abs_min, rows.abs_max)) == reference
    assert bool(rows.inf.iloc[0]) and not bool(rows.nan.iloc[0])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_kernel_gives_torchs_signed_range(dtype):
    out = native.result_buffer()
    info = torch.iinfo(dtype)
    generator = torch.Generator().manual_seed(0)
    for length in (1, 5, 31, 32, 33, 100):
        values = torch.randint(-50, 50, (length,), generator=generator, dtype=dtype)
        for position in range(length):
            tensor = values.clone()
            tensor[position] = info.min
            tensor[length - 1 - position] = info.max
            for case in (tensor, values, values.abs() + 3):
                low, high = torch.aminmax(case)
                expected = tuple(torch.stack((low, high)).double().tolist())
                assert native.int_range(case, out) == expected, (length, position)
    # not read here: torch reduces them
    for other in (torch.arange(6, dtype=dtype).reshape(2, 3).t(), torch.arange(4, dtype=torch.int16),
                  torch.empty(0, dtype=dtype)):
        assert native.int_range(other, out) is None


def test_both_paths_record_the_same_integer_entries(measuring_path):
    model = nn.Embedding(100, 4)
    rows = []
    for ids in (torch.tensor([[3, 7], [99, 12]]), torch.tensor([0, 5]),
                torch.tensor([64], dtype=torch.int32)):
        with nw.watch(model, on_nan="record") as w:
            model(ids)
            frame = w.frames()
        rows.append(frame[frame.role == "input[0]"][["abs_min", "abs_max", "note"]].values.tolist())
    # the magnitudes of the ids, whichever path read them
    assert rows == [[[3.0, 99.0, ""]], [[0.0, 5.0, ""]], [[64.0, 64.0, ""]]]


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=300, cwd=ROOT)


_RECORD = """
    import torch, nanwidget as nw
    from nanwidget.core import native
    model = torch.nn.Linear(4, 3)
    x = torch.tensor([[1.0, -2.0, 0.5, -8.0]])
    with nw.watch(model) as w:
        model(x)
        frames = w.frames()
    row = frames[frames.role == "input[0]"].iloc[0]
    print(native.status())
    print(row.abs_min, row.abs_max)
"""


def test_without_a_compiler_the_torch_path_records_the_same_numbers(tmp_path):
    result = _run_python(_RECORD, PATH="", CC="", NANWIDGET_CACHE_DIR=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    status, values = result.stdout.strip().splitlines()[-2:]
    assert status.startswith("unavailable (no C compiler found)"), status
    assert values == "0.5 8.0"


def test_switched_off_by_environment(tmp_path):
    result = _run_python(_RECORD, NANWIDGET_NATIVE="0", NANWIDGET_CACHE_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "off (NANWIDGET_NATIVE=0)" in result.stdout and result.stdout.endswith("0.5 8.0\n")
    assert not list(tmp_path.iterdir())  # nothing compiled


@pytest.mark.skipif(not any(shutil.which(n) for n in ("cc", "gcc", "clang")), reason="no C compiler")
def test_built_once_into_the_cache_then_loaded_from_it(tmp_path):
    cache = tmp_path / "cache"
    first = _run_python(_RECORD, NANWIDGET_CACHE_DIR=str(cache))
    assert first.returncode == 0, first.stderr
    built = sorted(p.name for p in cache.iterdir())
    assert len(built) == 1 and built[0].endswith(".so"), built
    assert f"native kernel in use ({cache / built[0]})" in first.stdout
    # The second process finds the library: even with no compiler on PATH it is used.
    second = _run_python(_RECORD, NANWIDGET_CACHE_DIR=str(cache), PATH="", CC="")
    assert second.returncode == 0, second.stderr
    assert "native kernel in use" in second.stdout and second.stdout.endswith("0.5 8.0\n")
    assert sorted(p.name for p in cache.iterdir()) == built  # no temporary files left


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_range_reads_what_the_torch_second_look_computes(dtype):
    from nanwidget.core import native
    from nanwidget.core.stats import _second_look
    if not native.available():
        pytest.skip(native.status())
    generator = torch.Generator().manual_seed(1)
    for nonfinite in ([float("nan")], [float("inf")], [float("-inf"), float("nan")],
                      [float("nan")] * 5):
        values = (torch.randn(999, generator=generator, dtype=torch.float64) * 100).to(dtype)
        values[torch.randperm(999, generator=generator)[:len(nonfinite)]] = \
            torch.tensor(nonfinite, dtype=torch.float64).to(dtype)
        assert native.finite_range(values) == tuple(
            v if i < 2 else v > 0 for i, v in enumerate(_second_look(values).tolist()))
    nothing_finite = torch.tensor([float("nan"), float("inf")], dtype=dtype)
    assert native.finite_range(nothing_finite) == (float("inf"), float("-inf"), True)


def test_weight_state_reads_what_the_capture_reads_in_python_or_declines():
    """The extension's weight_state (the held batch's weights, versions, layouts and train
    flags in one call) gives the Python reads' results, or None where those must decide."""
    from nanwidget.core.replay.capture import WeightSlots, layouts_of, versions_of
    weight_state = native.weight_state_reader()
    if weight_state is None:
        pytest.skip(native.status())
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2).double())
    model[1].eval()
    with torch.no_grad():
        model[0].weight.add_(1)
    slots = WeightSlots(model)
    weights, versions, layout, training = weight_state(slots.containers, slots.keys, slots.modules)
    read = slots.read()
    assert all(a is b for a, b in zip(weights, read)) and len(weights) == len(read)
    assert versions == versions_of(read) and layout == layouts_of(read)
    assert training == [m.training for m in slots.modules]
    model[2].bias = None  # a slot set to None since: the Python path reads it
    assert weight_state(slots.containers, slots.keys, slots.modules) is None
    assert weight_state([model[0]._parameters], ["missing"], []) is None
    with pytest.raises(TypeError):
        weight_state([], [])


def test_grads_clean_in_one_c_call_agrees_with_the_python_loop():
    """The extension's grads_clean (the sentinel's gradient check in one call, on the weight
    slots' containers and keys) says what native.grads_clean says with the C reader on the
    slots, raises what it raises, and leaves to it (None) what is not its usual input."""
    from nanwidget.core.replay.capture import WeightSlots
    clean = native.grads_clean_reader()
    if clean is None:
        pytest.skip(native.status())
    read, out = native.contiguous_reader(), native.result_buffer()
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2).double(),
                          nn.Linear(2, 2).half())
    model.float()
    model(torch.randn(5, 4)).sum().backward()
    slots = WeightSlots(model)
    indices = [i for i, is_buffer in enumerate(slots.is_buffer) if not is_buffer]
    params = [slots.read()[i] for i in indices]
    assert len(params) == 8

    def both() -> bool:
        expected = native.grads_clean(slots.read(), indices, read, out)
        assert clean(slots.containers, slots.keys, indices) is expected
        return expected

    assert both() is True
    params[4].grad = None  # no gradient: skipped
    assert both() is True
    params[2].grad[1] = float("nan")
    assert both() is False
    params[2].grad[1] = float("-inf")
    assert both() is False
    params[2].grad[1] = 0.5
    params[0].grad = params[0].grad.t().contiguous().t()  # not contiguous: the general check
    assert both() is False
    params[0].grad = params[0].grad.contiguous()
    params[7].grad = torch.zeros(2).as_subclass(torch.Tensor)
    assert both() is True
    model[3].bias = None  # a slot set to None since
    assert both() is True
    storage = params[5].grad.untyped_storage()
    storage.resize_(0)  # shrunk under the gradient: never read
    assert both() is False
    containers, keys = slots.containers, slots.keys
    assert clean(containers, keys, [0, len(keys)]) is None and clean(containers, keys, [-1]) is None
    assert clean(tuple(containers), keys, indices) is None and clean(containers, keys, (0,)) is None
    assert clean(containers, keys[:-1], indices) is None and clean(containers, keys, [True]) is None

    class Raising(nn.Parameter):
        @property
        def grad(self):
            raise RuntimeError("no gradient here")

    model[0].bias = Raising(torch.ones(3))
    with pytest.raises(RuntimeError, match="no gradient here"):
        native.grads_clean(slots.read(), indices, read, out)
    with pytest.raises(RuntimeError, match="no gradient here"):
        clean(containers, keys, indices)
    with pytest.raises(TypeError):
        clean(containers, keys)


def test_loading_the_kernel_leaves_the_global_rng_where_it_was():
    """The self-tests at load make their tensors without the global generator: a watch
    that loads the kernel must not change the user's random numbers."""
    code = textwrap.dedent("""
        import torch
        torch.manual_seed(3)
        expected = torch.rand(4)
        torch.manual_seed(3)
        from nanwidget.core import native
        native.available()
        print(torch.equal(torch.rand(4), expected), native.status())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True "), done.stdout

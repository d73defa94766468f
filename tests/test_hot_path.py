"""The hot path: no host synchronisation per module call, weights measured only when changed."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn

import nanwidget as nw

# Every way a tensor's value reaches the host.
_SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy",
                 "__repr__", "__format__")


@contextmanager
def count_syncs():
    """Count host reads of tensor values; yields a dict that fills while the block runs."""
    counts = {"total": 0}
    originals = {name: getattr(torch.Tensor, name) for name in _SYNC_METHODS}

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            counts["total"] += 1
            counts[name] = counts.get(name, 0) + 1
            return original(self, *args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _deep_mlp(depth: int) -> nn.Sequential:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)]
    return nn.Sequential(*layers)


def spy_measured(monkeypatch) -> list[torch.Tensor]:
    """Every tensor reduced from now on, whichever path reduced it."""
    from nanwidget.core import native
    from nanwidget.core.stats import AbsMeter
    measured: list[torch.Tensor] = []
    reduce_bits, abs_range = AbsMeter.reduce_bits, native.abs_range
    read_floats = native.contiguous_reader()  # what the hooks call (bound when a watch starts)

    def spy_bits(self, tensor):
        measured.append(tensor)
        return reduce_bits(self, tensor)

    def spy_range(tensor, out=None):
        measured.append(tensor)
        return abs_range(tensor, out)

    def spy_contiguous(tensor, out):
        found = read_floats(tensor, out)
        if found is not None:  # read; None: not such a tensor, abs_range or torch reads it
            measured.append(tensor)
        return found

    monkeypatch.setattr(AbsMeter, "reduce_bits", spy_bits)
    monkeypatch.setattr(native, "abs_range", spy_range)
    monkeypatch.setattr(native, "contiguous_reader", lambda: spy_contiguous)
    return measured


@pytest.mark.parametrize("depth", [1, 4, 16])
def test_one_host_sync_per_batch_whatever_the_number_of_modules(depth, reduction_path):
    model = _deep_mlp(depth)
    x = torch.randn(4, 16)
    with nw.watch(model) as w:
        model(x)  # first batch measures the weights too; still one sync
        with count_syncs() as counts:
            for _ in range(3):
                model(x)
        # torch path: one copy to the host per batch, for 3 to 48 modules. The native kernel
        # reads CPU memory directly: no tensor value is read through torch at all.
        assert counts["total"] == (3 if reduction_path == "torch" else 0), counts
        assert len(w.frames(batch=None)) > 0


def test_no_sync_inside_module_hooks():
    model = _deep_mlp(4)
    syncs_inside_forward = []

    class Probe(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with count_syncs() as counts:
                y = self.inner(x)  # every child's hook runs in here
            syncs_inside_forward.append(counts["total"])
            return y

    probe = Probe(model)
    with nw.watch(probe):
        probe(torch.randn(2, 16))
        probe(torch.randn(2, 16))
    assert syncs_inside_forward == [0, 0]


def test_weights_are_measured_only_when_their_version_changes(reduction_path, monkeypatch):
    model = nn.Linear(8, 8).eval()  # inference: a training forward measures them once each
    measured = spy_measured(monkeypatch)
    with nw.watch(model, max_frames=100) as w:
        x = torch.randn(2, 8)
        model(x)
        first = len(measured)  # weight, bias, input, output
        model(x)
        second = len(measured) - first  # input and output only
        with torch.no_grad():
            model.weight.mul_(2.0)  # an optimizer step bumps the version
        model(x)
        third = len(measured) - first - second
        frames = w.frames()
    assert (first, second, third) == (4, 2, 3)
    weights = frames[frames.role == "weight"].abs_max.tolist()
    assert weights[0] == weights[1] and weights[2] == pytest.approx(2 * weights[0])


def test_input_that_is_the_previous_output_is_reduced_once(reduction_path, monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    for p in model.parameters():
        p.requires_grad_(False)
    spied = spy_measured(monkeypatch)  # before the watch: its hooks take the reader then
    with nw.watch(model):
        model(torch.randn(2, 8))
        first = len(spied)
        model(torch.randn(2, 8))
    measured = spied[first:]
    # x, linear0 out, tanh out, linear2 out: the root's input/output and each module's input
    # are the same tensors as outputs already queued.
    assert len(measured) == 4 and len({t.data_ptr() for t in measured}) == 4


def test_large_tensors_reuse_one_scratch_buffer_and_stay_exact():
    from nanwidget.core.stats import AbsMeter
    meter = AbsMeter()
    first = torch.randn(600, 600)
    second = torch.randn(800, 800)[:, ::2]  # non-contiguous
    second[5, 7] = -123.0
    with torch.no_grad():
        results = [torch.stack(meter.reduce(t)).tolist() for t in (first, second)]
    assert results[0] == [first.abs().min().item(), first.abs().max().item()]
    assert results[1] == [second.abs().min().item(), 123.0]
    assert len(meter._scratch) == 1  # one float32 CPU buffer served both


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_bit_pattern_reduction_is_exact_for_zeros_subnormals_and_infinities(dtype):
    from nanwidget.core.stats import AbsMeter
    tiny = torch.finfo(dtype).smallest_normal / 4  # a subnormal
    values = torch.tensor([-0.0, 3.0, -tiny, 2.5], dtype=dtype)
    meter = AbsMeter()
    with torch.no_grad():
        assert meter.measure(values) == (0.0, 3.0)
        assert meter.measure(values[1:]) == (torch.tensor(tiny, dtype=dtype).item(), 3.0)
        assert meter.measure(torch.tensor([-float("inf"), 1.0], dtype=dtype)) == (1.0, float("inf"))
        low, high = meter.measure(torch.tensor([float("nan"), -5.0], dtype=dtype))
        assert low != low and high != high


def test_activations_past_the_byte_limit_are_measured_early_and_released(monkeypatch):
    import weakref

    from nanwidget.core import stats as stats_module
    monkeypatch.setattr(stats_module, "PENDING_BYTES_LIMIT", 3000)  # about two 16x16 outputs
    released = []

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

        def forward(self, x):
            refs = []
            for layer in self.layers:
                x = layer(x)
                refs.append(weakref.ref(x))
            # Still inside the forward: only the watch could be keeping intermediates alive.
            released.append(sum(ref() is None for ref in refs))
            return x * 2.0

    model = Chain()
    x = torch.randn(16, 16)
    expected = []
    with torch.no_grad():
        h = x
        for layer in model.layers:
            h = layer(h)
            expected.append(h.abs().max().item())
        with nw.watch(model) as w:
            model(x)
            frames = w.frames()
    outputs = frames[(frames.role == "output") & (frames.module != "")]
    assert outputs.abs_max.tolist() == pytest.approx(expected)
    assert (outputs.note == "").all()
    # The watch held no more than the limit: the early layers' outputs were let go.
    assert released[0] >= 3


class _KeywordBlock(nn.Module):
    """A block called the way transformers calls its layers: keyword inputs that are None or
    flags beside the tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, attention_mask=None, use_cache=False, position=0):
        return self.linear(x), None


class _KeywordModel(nn.Module):
    def __init__(self, blocks: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_KeywordBlock() for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x, _ = block(x, attention_mask=None, use_cache=True, position=3)
        return x


def test_frames_share_their_shapes_and_non_tensor_entries():
    # Every object a frame keeps counts towards the garbage collector's next run (a transformer
    # made it run on most batches): an entry of None or of a flag, and a shape, are the same
    # object in every frame that has them.
    model = _KeywordModel().eval()
    with nw.watch(model, max_frames=200) as w, torch.no_grad():
        model(torch.randn(2, 8))
        model(torch.randn(2, 8))
        frames = [f for f in w.recorder.held_frames() if f.module.startswith("blocks.")
                  and "linear" not in f.module]
    assert len(frames) == 12
    for role in ("kwarg:attention_mask", "kwarg:use_cache", "kwarg:position", "output[1]"):
        entries = [e for f in frames for e in f.entries if e.role == role]
        assert len(entries) == 12 and len({id(e) for e in entries}) == 1, role
    assert [e.note for e in frames[0].entries if e.role.startswith("kwarg:")] == \
        ["None", "not a tensor", "not a tensor"]
    shapes = [e.shape for f in frames for e in f.entries if e.stats is not None]
    assert len(shapes) == 24 and all(s == (2, 8) for s in shapes)
    assert len({id(s) for s in shapes}) == 1


def test_a_watched_forward_keeps_few_objects_per_module_call():
    # What the garbage collector counts when a forward in full mode returns, per module call:
    # the frame, its list, its new entries, stats and weak references (under eight here, about
    # ten on the torch path, which also keeps each tensor's pending reduction until the batch
    # resolves); a new entry per keyword and a new shape per entry made it about twelve (14).
    import gc

    from nanwidget.core import native
    model = _KeywordModel(blocks=16).eval()  # 33 module calls per forward
    x = torch.randn(2, 8)
    at_return = []
    with nw.watch(model) as w, torch.no_grad():
        # Runs before the watch's own hook resolves the batch (which lets older frames go).
        model.register_forward_hook(lambda *_: at_return.append(gc.get_count()[0]),
                                    prepend=True)
        for _ in range(3):
            model(x)
        assert len([f for f in w.recorder.held_frames() if f.batch == 2]) == 21  # max_frames
        gc.collect()
        gc.disable()
        try:
            before = gc.get_count()[0]
            model(x)
        finally:
            gc.enable()
    assert at_return[-1] - before < (9 if native.available() else 12) * 33


def test_a_hook_loading_fresh_weights_on_every_call_keeps_no_call_s_weights_alive():
    # A pre-hook that puts a newly loaded Parameter in each call (weights streamed in from a
    # store, as offloading does) made a new weight-cache entry per call, each holding its
    # weight: 200 batches kept 200 copies of every weight alive.
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
    store = {name: p.detach().clone() for name, p in model.named_parameters()}

    def load(module, args):
        prefix = "0" if module is model[0] else "2"
        for name in ("weight", "bias"):
            module._parameters[name] = nn.Parameter(store[f"{prefix}.{name}"].clone())

    for layer in (model[0], model[2]):
        layer.register_forward_pre_hook(load)
    x = torch.randn(8, 64)
    with torch.no_grad():
        expected = model(x)
    refs = []
    with nw.watch(model) as watch, torch.no_grad():
        for _ in range(200):
            out = model(x)
            refs.append(weakref.ref(model[0].weight))
        gc.collect()
        alive = sum(ref() is not None for ref in refs)
    assert torch.equal(out, expected) and watch.events == []
    assert alive <= 6, alive  # the 4 batches held for replay (keep_batches) and the last

"""timm, watched as its users train it: a loop like timm's train.py (timm.optim's AdamW, bfloat16
autocast, a ModelEmaV3 updated after every step, torch.save of the model mid-run, the EMA copy
evaluated at the end; NativeScaler under float16), on tiny models of four families (a ViT, a
ResNet, a ConvNeXt, an EfficientNet whose BatchNormAct2d layers are timm's own), with the faults
such a run meets, and the models driven through forward_features / forward_head.

timm is no dependency of nanwidget: this file runs only where it imports (it needs torchvision
built for the torch installed, as fastai does: .ci/run's torch job installs both).
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn.functional as F

import nanwidget as nw
from conftest import hook_count

try:  # timm imports torchvision, which fails to load against another torch build
    import timm
    from timm.optim import create_optimizer_v2
    from timm.utils import ModelEmaV3, NativeScaler
except ImportError:
    pytest.skip("timm: pip install timm (with the torchvision built for this torch)",
                allow_module_level=True)
except RuntimeError as error:
    pytest.skip(f"timm does not import here: {error}", allow_module_level=True)

WATCHES = [{}, {"backward": True}, {"mode": "sentinel"}, {"mode": "sentinel", "backward": True}]
WATCH_IDS = ["full", "full-backward", "sentinel", "sentinel-backward"]

# Tiny configurations, no download (pretrained=False); dropout and drop_path draw random numbers.
MODELS = {
    "vit": lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5,
                                     img_size=32, patch_size=8, depth=2, drop_rate=0.1,
                                     drop_path_rate=0.1),
    "resnet": lambda: timm.create_model("resnet10t", pretrained=False, num_classes=5,
                                        drop_rate=0.1, drop_path_rate=0.1),
    "convnext": lambda: timm.create_model("convnext_atto", pretrained=False, num_classes=5,
                                          drop_path_rate=0.1),
    "efficientnet": lambda: timm.create_model("test_efficientnet", pretrained=False,
                                              num_classes=5, drop_rate=0.1, drop_path_rate=0.2),
}
# The module each family's first layer is: where a NaN pixel is first met.
STEMS = {"vit": "patch_embed.proj", "resnet": "conv1.0"}


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 32, 32, generator=data), torch.randint(0, 5, (4,), generator=data))
            for _ in range(count)]


def _train_py_loop(name: str, watch_kwargs: dict | None, *, half: bool = False):
    """Three steps as timm's train.py takes them, watched with ``watch_kwargs`` (None:
    unwatched): what the run left (weights, buffers, the EMA copy's state, the outputs of the
    EMA copy and the model in eval mode), what the watch said, and the hooks left."""
    torch.manual_seed(0)
    model = MODELS[name]()
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    loss_scaler = NativeScaler(device="cpu") if half else None
    ema = ModelEmaV3(model, decay=0.9)
    if watch_kwargs is not None and half:
        watch_kwargs = dict(watch_kwargs, grad_scaler=loss_scaler)
    batches = _batches(3)
    saved = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch = nw.watch(model, **watch_kwargs) if watch_kwargs is not None else None
        for step, (x, y) in enumerate(batches):
            model.train()
            with torch.autocast("cpu", dtype=torch.float16 if half else torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            if loss_scaler is not None:
                loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())
            else:
                loss.backward()
                optimizer.step()
            ema.update(model, step=step)
            if step == 1:  # a checkpoint mid-run, whole and as a state dict
                for obj in (model, model.state_dict()):
                    buffer = io.BytesIO()
                    torch.save(obj, buffer)
                    saved.append(buffer.getbuffer().nbytes > 0)
        ema.eval()
        model.eval()
        with torch.no_grad():
            outputs = [ema.module(batches[0][0]), model(batches[0][0])]
        if watch is not None:
            watch.close()
    said = [] if watch is None else [*watch.events, *watch.warnings,
                                     *(str(c.message) for c in caught
                                       if "nanwidget" in c.filename or "nanwidget" in str(c.message))]
    left = dict(weights=list(model.parameters()), buffers=list(model.buffers()),
                ema=list(ema.module.state_dict().values()), outputs=outputs, saved=saved,
                rng=torch.rand(2))
    return left, said, hook_count(model)


def _assert_same(unwatched: dict, watched: dict) -> None:
    assert unwatched.keys() == watched.keys()
    for key, tensors in unwatched.items():
        assert len(tensors) == len(watched[key]), key
        for i, (a, b) in enumerate(zip(tensors, watched[key])):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"{key}[{i}] differs under the watch"
            else:
                assert a == b, f"{key}[{i}]"


@pytest.mark.parametrize("watch_kwargs", WATCHES, ids=WATCH_IDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_train_py_loop_is_bit_identical_and_quiet(name, watch_kwargs):
    unwatched, _, _ = _train_py_loop(name, None)
    watched, said, hooks_left = _train_py_loop(name, watch_kwargs)
    assert said == []
    assert hooks_left == 0
    _assert_same(unwatched, watched)


@pytest.mark.parametrize("watch_kwargs", [{"backward": True}, {"mode": "sentinel"}],
                         ids=["full-backward", "sentinel"])
def test_native_scaler_in_float16_skips_steps_quietly(watch_kwargs):
    # NativeScaler passed as grad_scaler=loss_scaler: the watch takes the GradScaler it holds.
    unwatched, _, _ = _train_py_loop("vit", None, half=True)
    watched, said, _ = _train_py_loop("vit", watch_kwargs, half=True)
    assert said == []
    _assert_same(unwatched, watched)


def _train_until_event(model, optimizer, batches, watch_kwargs) -> nw.NanWatch:
    """A bf16-autocast training loop under a watch that records, stopped at its first event."""
    with nw.watch(model, on_nan="record", **watch_kwargs) as w:
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if w.event:
                break
    return w


@pytest.mark.parametrize("watch_kwargs", WATCHES[:3], ids=WATCH_IDS[:3])
def test_a_learning_rate_blown_up_is_divergence(watch_kwargs):
    torch.manual_seed(0)
    model = MODELS["vit"]()
    optimizer = create_optimizer_v2(model, "sgd", lr=100.0, weight_decay=0.05)
    w = _train_until_event(model, optimizer, _batches(12), watch_kwargs)
    assert w.event is not None, "the blow-up went unseen"
    # Which layer overflows first in a chaotic climb depends on the CPU's kernels: the kind is
    # what holds.
    assert w.event.diagnosis.kind == "divergence"
    assert "grew" in w.event.diagnosis.summary


@pytest.mark.parametrize("watch_kwargs", [{}, {"backward": True}], ids=["full", "full-backward"])
def test_a_blow_up_under_native_scaler_gets_its_fixes_in_timms_words(watch_kwargs):
    # loss_scaler(loss, optimizer) runs the backward, the clipping and the step in one call:
    # no place for a clip_grad_norm_ of one's own, and its GradScaler manages the loss scale.
    torch.manual_seed(0)
    model = MODELS["vit"]()
    optimizer = create_optimizer_v2(model, "sgd", lr=100.0)
    loss_scaler = NativeScaler(device="cpu")
    with nw.watch(model, on_nan="record", grad_scaler=loss_scaler, **watch_kwargs) as w:
        for x, y in _batches(12):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss_scaler(loss, optimizer)
            if w.event:
                break
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "divergence"
    fixes = "\n".join(diagnosis.suggestion)
    assert "create_optimizer_v2(model, lr=...)" in fixes and "warmup_t=" in fixes
    assert "loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())" in fixes
    assert "clip_grad_norm_" not in fixes and "let torch.amp.GradScaler manage" not in fixes


@pytest.mark.parametrize("watch_kwargs", WATCHES[:3], ids=WATCH_IDS[:3])
@pytest.mark.parametrize("name", list(STEMS))
def test_a_nan_pixel_is_bad_data_at_the_stem(name, watch_kwargs):
    torch.manual_seed(0)
    model = MODELS[name]()
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3)
    batches = _batches(3)
    batches[2][0][1, 0, 3, 3] = float("nan")
    w = _train_until_event(model, optimizer, batches, watch_kwargs)
    event = w.event
    assert (event.batch, event.module, event.origin) == (2, STEMS[name], "input")
    assert (event.diagnosis.kind, event.diagnosis.rows) == ("bad-data", [1])


@pytest.mark.parametrize("watch_kwargs", WATCHES[:3], ids=WATCH_IDS[:3])
def test_a_nan_the_ema_update_wrote_into_the_ema_copy_is_told_as_a_write(watch_kwargs):
    # The student's head goes NaN after a step; ModelEmaV3.update lerps it into the EMA copy
    # (torch._foreach_lerp_), and the student is mended before its next forward. The watched
    # EMA copy is never stepped by an optimizer: its verdict is a write, not a step.
    torch.manual_seed(0)
    model = MODELS["vit"]()
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3)
    ema = ModelEmaV3(model, decay=0.9)
    with nw.watch(ema.module, on_nan="record", **watch_kwargs) as w:
        for step, (x, y) in enumerate(_batches(4)):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step == 2:
                model.head.weight.data[0, 0] = float("nan")
            ema.update(model, step=step)
            if step == 2:
                model.head.weight.data[0, 0] = 0.0
            ema.eval()
            with torch.no_grad():
                ema.module(x)
            if w.event:
                break
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.module, event.role, event.origin) == (2, "head", "weight", "weight")
    assert diagnosis.kind == "corrupted-weight"
    assert "write, average or load after batch 1" in diagnosis.summary
    assert any("No optimizer step wrote 'head.weight'" in line for line in diagnosis.evidence)
    assert "EMA" in diagnosis.suggestion[0]
    assert not any("learning rate" in line or "clip_grad" in line
                   for line in diagnosis.suggestion)
    assert torch.isfinite(model.head.weight).all()


@pytest.mark.parametrize("watch_kwargs", WATCHES[:3], ids=WATCH_IDS[:3])
def test_a_nan_running_var_of_a_batchnormact2d_is_corrupted_weight(watch_kwargs):
    torch.manual_seed(0)
    model = MODELS["efficientnet"]()
    norm_name, norm = next((name, module) for name, module in model.named_modules()
                           if type(module).__name__ == "BatchNormAct2d")
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3)
    with nw.watch(model, on_nan="record", **watch_kwargs) as w:
        for step, (x, y) in enumerate(_batches(4)):
            model.train(step < 2)  # evaluation from batch 2: the running statistics are read
            out = model(x)
            if step < 2:
                optimizer.zero_grad()
                F.cross_entropy(out, y).backward()
                optimizer.step()
            if step == 1:
                norm.running_var[1] = float("nan")
            if w.event:
                break
    event = w.event
    assert (event.batch, event.module, event.module_type, event.role) == \
        (2, norm_name, "BatchNormAct2d", "running_var")
    assert event.diagnosis.kind == "corrupted-weight"
    assert any("is a buffer: no optimizer steps it" in line for line in event.diagnosis.evidence)


def _forward_features_loop(watch_kwargs, *, nan_at=None):
    torch.manual_seed(0)
    model = MODELS["vit"]()
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3)
    batches = _batches(4)
    if nan_at is not None:
        batches[nan_at][0][2, 0, 1, 1] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, on_nan="record", **watch_kwargs) as w:
            for x, y in batches:
                loss = F.cross_entropy(model.forward_head(model.forward_features(x)), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    return w, [str(c.message) for c in caught if "nanwidget" in str(c.message)]


@pytest.mark.parametrize("watch_kwargs", [{}, {"backward": True}], ids=["full", "full-backward"])
def test_forward_features_and_forward_head_are_one_batch_per_step_in_full_mode(watch_kwargs):
    w, said = _forward_features_loop(watch_kwargs)
    assert (w.events, said) == ([], [])
    assert w.batch == 3  # passes 0 to 3: each step's forward_features starts the next batch
    w, _ = _forward_features_loop(watch_kwargs, nan_at=2)
    event = w.event
    assert (event.batch, event.module, event.origin) == (2, "patch_embed.proj", "input")
    assert event.diagnosis.kind == "bad-data"
    assert "outside the model's forward" in event.diagnosis.summary


def test_forward_features_in_sentinel_mode_says_it_checked_nothing_and_what_to_do():
    w, said = _forward_features_loop({"mode": "sentinel"}, nan_at=2)
    assert w.events == []  # sentinel mode checks model(x) calls only
    [note] = [text for text in said if "Sentinel mode checked nothing" in text]
    assert "this VisionTransformer was never called" in note
    # the way out for timm's pass: its call inside a module's forward, that module watched
    assert "model.forward_features(x) is such a loop" in note
    assert "return self.model.forward_features(x)" in note


class _Features(torch.nn.Module):
    """What the sentinel's note says to write: forward_features as a module's forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(x)


def test_forward_features_in_a_watched_module_is_checked_in_sentinel_mode():
    torch.manual_seed(0)
    model = MODELS["vit"]()
    features = _Features(model)
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3)
    batches = _batches(4)
    batches[2][0][1, 0, 2, 2] = float("nan")
    with nw.watch(features, mode="sentinel", on_nan="record") as w:
        for x, y in batches:
            loss = F.cross_entropy(model.forward_head(features(x)), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if w.event:
                break
    event = w.event
    assert (event.batch, event.module, event.origin) == (2, "model.patch_embed.proj", "input")
    assert (event.diagnosis.kind, event.diagnosis.rows) == ("bad-data", [1])

"""lucidrains' pure-PyTorch libraries, watched: x-transformers (a Decoder trained through its
AutoregressiveWrapper with its own -finfo.max masking, generate() with a KV cache and with a
padded prompt, an Encoder under a padding mask, rotary and ALiBi positions, flash=True's SDPA,
XTransformer), vector-quantize-pytorch (VectorQuantize writing its EMA codebook in the forward,
ResidualVQ, FSQ, LFQ's entropy loss) and denoising-diffusion-pytorch (GaussianDiffusion
trained with an ema-pytorch EMA, then sample(): one Unet call per timestep).

None is a dependency of nanwidget: each part runs only where its library is installed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwidget as nw
from conftest import hook_count

WATCHES = [{}, {"backward": True}, {"mode": "sentinel"}, {"mode": "sentinel", "backward": True}]
WATCH_IDS = ["full", "full-backward", "sentinel", "sentinel-backward"]


def _x_transformers():
    return pytest.importorskip("x_transformers", reason="x-transformers: pip install x-transformers")


def _vector_quantize():
    return pytest.importorskip("vector_quantize_pytorch",
                               reason="vector-quantize-pytorch: pip install vector-quantize-pytorch")


def _diffusion():
    pytest.importorskip("ema_pytorch", reason="ema-pytorch: pip install ema-pytorch")
    try:  # it imports torchvision, which fails to load against another torch build
        import denoising_diffusion_pytorch
    except ImportError:
        pytest.skip("denoising-diffusion-pytorch: pip install denoising-diffusion-pytorch")
    except RuntimeError as error:
        pytest.skip(f"denoising-diffusion-pytorch does not import here: {error}")
    return denoising_diffusion_pytorch


def _run(scenario, watch_kwargs):
    """Run ``scenario(watch)`` unwatched (watch_kwargs None) or watched: what it returned, what
    the watch said (events, early warnings, nanwidget's Python warnings) and the hooks left."""
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results, model, watch = scenario(watch_kwargs)
        if watch is not None:
            watch.close()
    said = [] if watch is None else [*watch.events, *watch.warnings,
                                     *(str(c.message) for c in caught
                                       if "nanwidget" in c.filename or "nanwidget" in str(c.message))]
    return results, said, hook_count(model) + sum("forward" in vars(m) for m in model.modules())


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b)


def _assert_bit_identical_and_quiet(scenario, watch_kwargs):
    unwatched, _, _ = _run(scenario, None)
    watched, said, left = _run(scenario, watch_kwargs)
    assert _same(unwatched, watched)
    assert said == [] and left == 0


# ----------------------------------------------------------------------------- x-transformers
def _decoder(**attn):
    xt = _x_transformers()
    torch.manual_seed(0)
    return xt.TransformerWrapper(num_tokens=64, max_seq_len=16,
                                 attn_layers=xt.Decoder(dim=32, depth=2, heads=2, **attn))


def _autoregressive(watch_kwargs, **attn):
    AutoregressiveWrapper = _x_transformers().AutoregressiveWrapper
    model = AutoregressiveWrapper(_decoder(**attn))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)
    watch = nw.watch(model, **watch_kwargs) if watch_kwargs is not None else None
    losses = []
    for _ in range(3):  # lens=: x-transformers pads the shorter sequence with its ignore_index
        loss = model(torch.randint(0, 64, (2, 12), generator=data), lens=torch.tensor([12, 7]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    model.eval()
    prompts = torch.randint(0, 64, (2, 4), generator=data)
    cached = model.generate(prompts, 4, cache_kv=True)
    padded = model.generate(prompts, 4, cache_kv=False, prompt_lens=torch.tensor([4, 2]))
    ragged = model.generate([prompts[0], prompts[1, :2]], 3, cache_kv=True)
    return (dict(losses=losses, weights=list(model.parameters()), cached=cached, padded=padded,
                 ragged=ragged, rng=torch.rand(2)), model, watch)


def _encoder(watch_kwargs, flash):
    xt = _x_transformers()
    torch.manual_seed(0)
    model = xt.TransformerWrapper(num_tokens=64, max_seq_len=16, attn_layers=xt.Encoder(
        dim=32, depth=2, heads=2, attn_flash=flash, alibi_pos_bias=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)
    watch = nw.watch(model, **watch_kwargs) if watch_kwargs is not None else None
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, 6:] = mask[2, 3:] = False
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, 64, (3, 10), generator=data)
        loss = F.cross_entropy(model(tokens, mask=mask)[mask], tokens[mask])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return dict(losses=losses, weights=list(model.parameters())), model, watch


def _encoder_decoder(watch_kwargs):
    xt = _x_transformers()
    torch.manual_seed(0)
    model = xt.XTransformer(dim=32, enc_num_tokens=64, enc_depth=2, enc_heads=2,
                            enc_max_seq_len=16, dec_num_tokens=64, dec_depth=2, dec_heads=2,
                            dec_max_seq_len=16, tie_token_emb=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)
    watch = nw.watch(model, **watch_kwargs) if watch_kwargs is not None else None
    source_mask = torch.ones(2, 10, dtype=torch.bool)
    source_mask[1, 5:] = False
    losses = []
    for _ in range(2):
        source = torch.randint(0, 64, (2, 10), generator=data)
        loss = model(source, torch.randint(0, 64, (2, 8), generator=data), mask=source_mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    model.eval()
    out = model.generate(source, torch.zeros(2, 1, dtype=torch.long), 4, mask=source_mask)
    return dict(losses=losses, weights=list(model.parameters()), out=out), model, watch


@pytest.mark.parametrize("watch_kwargs", WATCHES, ids=WATCH_IDS)
def test_x_transformers_train_and_generate_bit_identical_and_quiet(watch_kwargs):
    _assert_bit_identical_and_quiet(lambda kw: _autoregressive(kw, rotary_pos_emb=True),
                                    watch_kwargs)
    _assert_bit_identical_and_quiet(lambda kw: _encoder(kw, flash=True), watch_kwargs)
    _assert_bit_identical_and_quiet(_encoder_decoder, watch_kwargs)


@pytest.mark.parametrize("watch_kwargs", WATCHES[:1] + WATCHES[2:3], ids=["full", "sentinel"])
def test_x_transformers_alibi_and_eager_attention_quiet(watch_kwargs):
    _assert_bit_identical_and_quiet(lambda kw: _autoregressive(kw, alibi_pos_bias=True),
                                    watch_kwargs)
    _assert_bit_identical_and_quiet(lambda kw: _encoder(kw, flash=False), watch_kwargs)


@pytest.mark.parametrize("watch_kwargs", WATCHES, ids=WATCH_IDS)
def test_a_nan_weight_met_in_generate_is_caught_in_every_mode(watch_kwargs):
    # AutoregressiveWrapper.generate() calls its net once per token, never the wrapper's
    # forward: sentinel mode checked none of those calls (no event, no warning) where full
    # mode names the weight.
    AutoregressiveWrapper = _x_transformers().AutoregressiveWrapper
    model = AutoregressiveWrapper(_decoder(rotary_pos_emb=True))
    layer = model.net.attn_layers.layers[1][1].ff[-1]
    with nw.watch(model, on_nan="record", **watch_kwargs) as w:
        model(torch.randint(0, 64, (2, 8))).backward()
        model.eval()
        with torch.no_grad():
            layer.weight[0, 0] = float("inf")
        with pytest.raises(RuntimeError, match="probability tensor"):
            model.generate(torch.randint(0, 64, (2, 4)), 4, cache_kv=True)
    event = w.event
    assert event is not None, "generate()'s NaN went unseen"
    assert (event.batch, event.module, event.role, event.kind) == \
        (1, "net.attn_layers.layers.1.1.ff.2", "weight", "inf")
    assert event.diagnosis.kind == "corrupted-weight"
    assert hook_count(model) == 0 and "forward" not in vars(model.net)


def test_a_nan_token_embedding_row_is_named():
    model = _decoder()
    with torch.no_grad():
        model.token_emb.emb.weight[5] = float("nan")
    tokens = torch.randint(6, 64, (2, 8))
    tokens[1, 3] = 5
    for mode in ("full", "sentinel"):
        with nw.watch(model, on_nan="record", mode=mode) as w:
            model(tokens)
        assert (w.event.module, w.event.role, w.event.origin) == \
            ("token_emb.emb", "weight", "weight"), mode
        assert w.event.diagnosis.kind == "corrupted-weight"


# --------------------------------------------------------------------- vector-quantize-pytorch
class _Autoencoder(nn.Module):
    def __init__(self, quantizer: nn.Module) -> None:
        super().__init__()
        self.encode, self.quantize, self.decode = nn.Linear(8, 32), quantizer, nn.Linear(32, 8)

    def forward(self, x):
        out = self.quantize(self.encode(x))
        return self.decode(out[0]), out[-1].sum()


def _quantizers():
    vq = _vector_quantize()
    return {
        "ema": lambda: vq.VectorQuantize(dim=32, codebook_size=16, decay=0.8,
                                         kmeans_init=True, kmeans_iters=2,
                                         threshold_ema_dead_code=2),
        "residual": lambda: vq.ResidualVQ(dim=32, codebook_size=16, num_quantizers=3, decay=0.8,
                                          threshold_ema_dead_code=1),
        "fsq": lambda: vq.FSQ(levels=[8, 5, 5], dim=32),
        "lfq": lambda: vq.LFQ(dim=32, codebook_size=16, entropy_loss_weight=0.1),
    }


def _vq_training(watch_kwargs, make):
    torch.manual_seed(0)
    model = _Autoencoder(make())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)
    watch = nw.watch(model, **watch_kwargs) if watch_kwargs is not None else None
    losses = []
    for _ in range(5):
        x = torch.randn(4, 5, 8, generator=data)
        out, aux = model(x)
        loss = F.mse_loss(out, x) + aux
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return (dict(losses=losses, state={k: v.clone() for k, v in model.state_dict().items()}),
            model, watch)


@pytest.mark.parametrize("watch_kwargs", WATCHES, ids=WATCH_IDS)
def test_quantizers_train_bit_identical_and_quiet(watch_kwargs):
    # VectorQuantize's EMA writes its codebook buffers in the forward (through .data, no
    # version bump): never told as a corruption, a load or a write.
    for make in _quantizers().values():
        _assert_bit_identical_and_quiet(lambda kw: _vq_training(kw, make), watch_kwargs)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("kind", ["ema", "residual"])
def test_a_nan_codebook_entry_is_named_in_full_mode(kind, backward):
    # The EMA update rewrites the codebook from embed_avg in the forward (through .data: no
    # version bump), and the frame measured it after that: VectorQuantize's read "made here
    # from finite inputs and weights ... could not be told", ResidualVQ's blamed the next
    # layer's codebook, which its own forward had filled from the NaN it was handed.
    model = _Autoencoder(_quantizers()[kind]())
    codebook = model.quantize.layers[0] if kind == "residual" else model.quantize
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)
    with nw.watch(model, on_nan="record", backward=backward) as w:
        for step in range(3):
            if step == 2:
                with torch.no_grad():
                    codebook._codebook.embed[0, 3] = float("nan")
            x = torch.randn(4, 5, 8, generator=data)
            out, aux = model(x)
            optimizer.zero_grad()
            (F.mse_loss(out, x) + aux).backward()
            optimizer.step()
            if w.event is not None:
                break
    name = "quantize.layers.0._codebook" if kind == "residual" else "quantize._codebook"
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.module, event.role, event.origin) == (2, name, "embed", "weight")
    assert diagnosis.kind == "corrupted-weight" and diagnosis.confidence == "high"
    assert diagnosis.summary.startswith(f"'{name}.embed' became NaN between batch 1 and batch 2")
    assert hook_count(model) == 0


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_input_to_an_ema_codebook_is_bad_data(mode):
    model = _Autoencoder(_quantizers()["residual"]())
    x = torch.randn(4, 5, 8)
    x[1, 2, 0] = float("nan")
    with nw.watch(model, on_nan="record", mode=mode) as w:
        model(x)
    assert (w.event.module, w.event.role, w.event.diagnosis.kind, w.event.diagnosis.rows) == \
        ("encode", "input[0]", "bad-data", [1])


# ------------------------------------------------------------------ denoising-diffusion-pytorch
def _gaussian_diffusion():
    ddp = _diffusion()
    torch.manual_seed(0)
    unet = ddp.Unet(dim=8, dim_mults=(1, 2), channels=3, attn_dim_head=8, attn_heads=2,
                    full_attn=(False, True))
    return ddp.GaussianDiffusion(unet, image_size=8, timesteps=6, sampling_timesteps=6)


def _diffusion_training(watch_kwargs):
    diffusion = _gaussian_diffusion()
    from ema_pytorch import EMA
    ema = EMA(diffusion, beta=0.9, update_after_step=0, update_every=1)
    optimizer = torch.optim.Adam(diffusion.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)
    watch = nw.watch(diffusion, **watch_kwargs) if watch_kwargs is not None else None
    losses = []
    for _ in range(3):
        loss = diffusion(torch.rand(2, 3, 8, 8, generator=data))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ema.update()
        losses.append(loss.detach())
    with _quiet_progress():
        samples = diffusion.sample(batch_size=2)
    return (dict(losses=losses, weights=list(diffusion.parameters()),
                 ema=list(ema.ema_model.parameters()), samples=samples, rng=torch.rand(2)),
            diffusion, watch)


def _quiet_progress():
    import contextlib
    import io
    return contextlib.redirect_stderr(io.StringIO())  # sample()'s tqdm bar


@pytest.mark.parametrize("watch_kwargs", WATCHES, ids=WATCH_IDS)
def test_diffusion_training_ema_and_sampling_bit_identical_and_quiet(watch_kwargs):
    _assert_bit_identical_and_quiet(_diffusion_training, watch_kwargs)


@pytest.mark.parametrize("watch_kwargs", WATCHES, ids=WATCH_IDS)
def test_a_nan_weight_met_in_sample_is_caught_in_every_mode(watch_kwargs):
    # GaussianDiffusion.sample() calls its Unet once per timestep, never its own forward:
    # sentinel mode checked none of them and the NaN samples came back unremarked.
    diffusion = _gaussian_diffusion()
    with nw.watch(diffusion, on_nan="record", **watch_kwargs) as w:
        diffusion(torch.rand(2, 3, 8, 8)).backward()
        with torch.no_grad():
            diffusion.model.final_conv.weight[0, 0, 0, 0] = float("nan")
        with _quiet_progress():
            samples = diffusion.sample(batch_size=2)
    assert samples.isnan().all()
    event = w.event
    assert event is not None, "sample()'s NaN went unseen"
    assert (event.batch, event.module, event.role, event.kind) == \
        (1, "model.final_conv", "weight", "nan")
    assert event.diagnosis.kind == "corrupted-weight"
    assert hook_count(diffusion) == 0 and "forward" not in vars(diffusion.model)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_bad_training_image_is_bad_data(mode):
    diffusion = _gaussian_diffusion()
    images = torch.rand(2, 3, 8, 8)
    images[1, 0, 2, 2] = float("nan")
    with nw.watch(diffusion, on_nan="record", mode=mode) as w:
        diffusion(images)
    assert (w.event.module, w.event.diagnosis.kind, w.event.diagnosis.rows) == \
        ("model.init_conv", "bad-data", [1])

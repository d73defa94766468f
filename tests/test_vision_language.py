"""Contrastive image-text models, vision-language generation and beam search (transformers):
tiny models built from configs, random weights, inputs made by hand; full and sentinel mode."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip(
    "transformers", reason="these models come with the transformers extra: pip install -e .[transformers]")

import nanwidget as nw  # noqa: E402

MODES = ["full", "sentinel"]


def watch(model: torch.nn.Module, mode: str, **options) -> nw.NanWatch:
    if mode == "sentinel":
        options["mode"] = "sentinel"
    return nw.watch(model, on_nan="record", **options)


def tiny_clip() -> transformers.CLIPModel:
    torch.manual_seed(0)
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=8),
        projection_dim=8)
    return transformers.CLIPModel(config)


def clip_batch(seed: int, size: int = 4) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 60, (size, 7), generator=generator)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                pixel_values=torch.randn(size, 3, 16, 16, generator=generator))


@pytest.mark.parametrize("mode", MODES)
def test_clip_whose_logit_scale_grew_past_exp_s_range_is_told_to_clamp_it(mode):
    # exp of CLIPModel's logit_scale overflowed: the diagnosis read "exp of values up to 102"
    # and told to clamp the exponent at a line of transformers, which the user cannot edit.
    model = tiny_clip()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = clip_batch(0)
    with watch(model, mode, backward=True) as w, pytest.warns(nw.EarlyWarningIssued):
        for _ in range(12):
            out = model(**batch, return_loss=True)
            optimizer.zero_grad()
            out.loss.backward()
            if w.event is not None:
                break
            optimizer.step()
            with torch.no_grad():
                model.logit_scale.mul_(1.5)  # grown without the clamp CLIP's training has
        event = w.event
        assert (event.batch, event.module, event.role) == (9, "", "output.loss")
        diagnosis = event.diagnosis
        assert diagnosis.kind == ("divergence" if mode == "full" else "overflow")
        assert "exp of the model's 'logit_scale', now 102" in diagnosis.summary
        assert "model.logit_scale.clamp_(0, math.log(100))" in diagnosis.suggestion[0]
        assert w.replay(event.batch).reproduced


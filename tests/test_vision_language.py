"""Contrastive image-text models, vision-language generation and beam search (transformers):
tiny models built from configs, random weights, inputs made by hand; full and sentinel mode."""

from __future__ import annotations

import math
import os
import warnings

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
        assert diagnosis.kind == "divergence"  # sentinel mode too, from the weights at its start
        assert "exp of the model's 'logit_scale', now 102" in diagnosis.summary
        assert "model.logit_scale.clamp_(0, math.log(100))" in diagnosis.suggestion[0]
        assert w.replay(event.batch).reproduced


def tiny_bart() -> transformers.BartForConditionalGeneration:
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None)
    return transformers.BartForConditionalGeneration(config)


def bart_batch(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (2, 8), generator=generator)
    ids[1, 6:] = 1  # padding: a -inf in the attention masks, on purpose
    return dict(input_ids=ids, attention_mask=(ids != 1).long(),
                labels=torch.randint(3, 60, (2, 5), generator=generator))


@pytest.mark.parametrize("mode", MODES)
def test_beam_search_after_a_bad_write_to_the_encoder_names_that_weight_not_bad_data(mode):
    # generate() runs BART's encoder once, outside the forward, and hands each beam step its
    # output (encoder_outputs=). Sentinel mode read the NaN there as "bad-data: it came with
    # the data, not from the model"; full mode, whose hooks see the encoder's call, named
    # the weight.
    model = tiny_bart()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(model, mode, backward=True) as w:
        for step in range(2):
            model(**bart_batch(step)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            model.model.encoder.layers[0].fc1.weight[3, 2] = float("nan")
            batch = bart_batch(7)
            del batch["labels"]
            model.generate(**batch, num_beams=3, max_new_tokens=4, no_repeat_ngram_size=2,
                           length_penalty=2.0)
        event = w.event
        assert (event.batch, event.module, event.role, event.origin) == (
            2, "model.encoder.layers.0.fc1", "weight", "weight")
        # The decoder forward that joined the encoder's pass made no second event of its own
        # (full mode read it "bad-data" in kwarg:encoder_outputs).
        assert [(e.batch, e.module) for e in w.events] == [(2, "model.encoder.layers.0.fc1")]
        diagnosis = event.diagnosis
        assert diagnosis.kind == "corrupted-weight"
        assert "'model.encoder.layers.0.fc1.weight' became NaN between batch 1 and batch 2" \
            in diagnosis.summary


def test_beam_search_with_its_inf_scores_and_masks_is_quiet_and_unchanged():
    # Beam scores start at -1e9/-inf, no_repeat_ngram_size and the padding mask write -inf:
    # all on purpose. Same beams, same scores, no event, no warning, with the watch.
    def run(watched: bool) -> list[torch.Tensor]:
        model = tiny_bart().eval()
        batch = bart_batch(3)
        del batch["labels"]
        w = nw.watch(model, mode="full", backward=True) if watched else None
        with torch.no_grad():
            out = model.generate(**batch, num_beams=3, num_return_sequences=3, max_new_tokens=5,
                                 no_repeat_ngram_size=2, length_penalty=2.0,
                                 output_scores=True, return_dict_in_generate=True)
        if w is not None:
            assert not w.events and not w.warnings
            w.close()
        return [out.sequences, out.sequences_scores, *out.scores]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of the watch's
        watched = run(True)
    plain = run(False)
    assert len(watched) == len(plain) and all(torch.equal(a, b) for a, b in zip(watched, plain))


def tiny_llava() -> transformers.LlavaForConditionalGeneration:
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=16, patch_size=8)
    text = transformers.LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, max_position_embeddings=64)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=99,
                                      image_seq_length=4, vision_feature_layer=-1,
                                      vision_feature_select_strategy="default")
    return transformers.LlavaForConditionalGeneration(config)


def llava_batch(seed: int, size: int = 3) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((size, 4), 99), torch.randint(1, 90, (size, 6), generator=generator)], 1)
    labels = ids.clone()
    labels[:, :4] = -100
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                pixel_values=torch.randn(size, 3, 16, 16, generator=generator))


@pytest.mark.parametrize("mode", MODES)
def test_llava_nan_pixels_in_one_image_are_bad_data_in_that_row(mode):
    model = tiny_llava()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(model, mode, backward=True) as w:
        for step in range(3):
            batch = llava_batch(step)
            if step == 2:
                batch["pixel_values"][1, 0, 5, 7] = float("nan")
            model(**batch).loss.backward()
            if w.event is not None:
                break
            optimizer.step()
            optimizer.zero_grad()
        event = w.event
        assert (event.batch, event.module, event.origin) == (
            2, "model.vision_tower.embeddings.patch_embedding", "input")
        diagnosis = event.diagnosis
        assert (diagnosis.kind, diagnosis.rows) == ("bad-data", [1])
        assert "kwarg:pixel_values holds NaN in row 1" in diagnosis.summary
        assert w.replay(event.batch).reproduced


@pytest.mark.parametrize("mode", MODES)
def test_llava_generate_after_a_bad_write_to_the_vision_tower_names_that_weight(mode):
    # generate() runs the vision tower once (get_image_features), outside the forward, and
    # hands the forwards its output (mm_encoder_outputs=): not the data's NaN/Inf.
    model = tiny_llava().eval()
    batch = llava_batch(1, size=2)
    del batch["labels"]
    with watch(model, mode) as w, torch.no_grad():
        model.generate(**batch, max_new_tokens=2, do_sample=False)
        model.get_parameter("model.vision_tower.encoder.layers.0.mlp.fc2.weight")[0, 0] = math.inf
        model.generate(**batch, max_new_tokens=2, do_sample=False)
        event = w.event
        assert (event.batch, event.module, event.role, event.origin) == (
            2, "model.vision_tower.encoder.layers.0.mlp.fc2", "weight", "weight")
        assert event.diagnosis.kind == "corrupted-weight"


def tiny_image_captioner() -> transformers.VisionEncoderDecoderModel:
    torch.manual_seed(0)
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, image_size=16, patch_size=8),
        transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=40, n_positions=16,
                                bos_token_id=1, eos_token_id=2))
    model = transformers.VisionEncoderDecoderModel(config).eval()
    for holder in (model.config, model.generation_config):
        holder.decoder_start_token_id, holder.pad_token_id = 1, 0
    return model


def test_image_captioner_generate_with_a_nan_image_is_bad_data_in_full_mode():
    # generate() runs the ViT encoder on pixel_values outside the model's forward, then the
    # decoder's: full mode said "what made it could not be told" (an "unknown" verdict).
    model = tiny_image_captioner()
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    pixels[1, 0, 3, 4] = math.nan
    with watch(model, "full") as w, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generate(pixel_values=pixels, max_new_tokens=3, do_sample=False)
    event = w.events[0]
    assert (event.batch, event.module, event.origin) == (
        0, "encoder.embeddings.patch_embeddings.projection", "input")
    assert event.diagnosis.kind == "bad-data"
    assert event.diagnosis.summary.startswith(
        "The kwarg:pixel_values that module 'encoder' was called with")

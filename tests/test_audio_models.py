"""Speech and state-space models of transformers (Wav2Vec2, Whisper, Mamba): tiny, from
configs, random weights, no downloads."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip(
    "transformers", reason="the audio and state-space models need the transformers extra")

import nanwidget as nw  # noqa: E402
from nanwidget.core.replay import InputModifiedError  # noqa: E402


def tiny_mamba() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=50, hidden_size=16, state_size=4,
                                      num_hidden_layers=2, expand=2, conv_kernel=3,
                                      time_step_rank=4, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)
    return transformers.MambaForCausalLM(config)


def test_mamba_generate_in_float16_suggests_a_replay_that_runs():
    # Mamba's cache (conv and SSM states) is written in place at every generate() step, so no
    # step can run again as it ran: the diagnosis must not send the user to w.replay(0), which
    # refuses, but to the same prompt without the cache, whose replay names the op.
    model = tiny_mamba().half().eval()
    with torch.no_grad():
        model.backbone.layers[1].mixer.in_proj.weight.mul_(300)  # its SSM state passes 65504
    prompt = torch.randint(3, 50, (2, 4), generator=torch.Generator().manual_seed(0))
    with nw.watch(model, on_nan="record") as w:
        model.generate(prompt, max_new_tokens=2)
        event = w.event
        assert (event.batch, event.module) == (0, "backbone.layers.1.mixer.out_proj")
        suggestion = " ".join(event.diagnosis.suggestion)
        assert "w.replay(0)" not in suggestion and "use_cache=False" in suggestion
        with pytest.raises(InputModifiedError, match="by the model's own forward"):
            w.replay(0)
        with torch.no_grad():
            model(prompt, use_cache=False)  # the suggestion, followed
        first_bad = w.replay(w.batch - 1).first_bad
    assert first_bad["module"] == "backbone.layers.1.mixer"
    assert "modeling_mamba.py" in first_bad["source"]


def tiny_whisper() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=60, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=40,
        decoder_ffn_dim=40, max_source_positions=20, max_target_positions=32, pad_token_id=1,
        bos_token_id=2, eos_token_id=3, decoder_start_token_id=2)
    return transformers.WhisperForConditionalGeneration(config)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_whisper_log_mel_of_a_silent_tail_is_bad_data_with_a_floor_under_the_log(mode):
    # A user's own log-mel without the feature extractor's clamp: log10(0) = -inf where the
    # clip is silent. Whisper's conv front end turns it into NaN; the diagnosis names the
    # features, their row, and the floor the feature extractor puts under the log.
    model = tiny_whisper()
    generator = torch.Generator().manual_seed(0)
    power = torch.rand(2, 8, 40, generator=generator)
    power[1, :, 10:] = 0.0
    labels = torch.randint(4, 60, (2, 6), generator=generator)
    with nw.watch(model, mode=mode, on_nan="record") as w:
        model(input_features=torch.log10(power), labels=labels)
    event = w.event
    assert (event.batch, event.module, event.role) == (0, "model.encoder.conv1", "input[0]")
    diagnosis = event.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("bad-data", [1])
    assert "kwarg:input_features holds -Inf in row 1" in diagnosis.summary
    assert "torch.log10(torch.clamp(mel, min=1e-10))" in diagnosis.suggestion[0]


def test_mamba2_generate_overflow_without_a_replay_names_the_weights_too():
    # Mamba2's cache is written in place, so the generate() step cannot be replayed and the
    # diagnosis reads the module's frame: its input was small, its weights were not.
    torch.manual_seed(0)
    config = transformers.Mamba2Config(vocab_size=50, hidden_size=16, state_size=8, num_heads=4,
                                       head_dim=8, n_groups=1, num_hidden_layers=2, expand=2,
                                       conv_kernel=3, chunk_size=4, pad_token_id=0,
                                       bos_token_id=1, eos_token_id=2)
    model = transformers.Mamba2ForCausalLM(config).half().eval()
    with torch.no_grad():
        model.backbone.layers[1].mixer.in_proj.weight.mul_(1e5)
    prompt = torch.randint(3, 50, (2, 4), generator=torch.Generator().manual_seed(0))
    with nw.watch(model, on_nan="record") as w:
        model.generate(prompt, max_new_tokens=1)
    event = w.event
    assert (event.batch, event.module, event.role) == (0, "backbone.layers.1.mixer.in_proj",
                                                       "output")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "overflow"
    assert any(line.startswith("Its weights reached 3.") and line.endswith("(weight).")
               for line in diagnosis.evidence), diagnosis.evidence

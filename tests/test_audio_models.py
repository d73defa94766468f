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

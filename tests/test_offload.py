"""accelerate's big-model inference: weights offloaded to CPU memory or to disk, loaded into
each module inside its forward and put back on the meta device after it (cpu_offload,
disk_offload, from_pretrained(device_map=..., offload_folder=...))."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import nanwidget as nw

accelerate = pytest.importorskip("accelerate", reason="offloading is accelerate's: pip install accelerate")
transformers = pytest.importorskip("transformers", reason="the offloaded LM is transformers': pip install transformers")

TARGET = "model.layers.1.mlp.down_proj"
MODES = [{}, {"mode": "sentinel"}, {"replay_on_nan": True}]


def _llama_dir(tmp_path, poison: bool = False) -> str:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    if poison:  # a bad checkpoint: one NaN in a weight
        with torch.no_grad():
            model.get_submodule(TARGET).weight[3, 5] = float("nan")
    folder = str(tmp_path / ("bad" if poison else "good"))
    model.save_pretrained(folder)
    return folder


def _on_disk(folder: str, tmp_path) -> nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, device_map="auto", max_memory={"cpu": "20KB"},
        offload_folder=str(tmp_path / "offload")).eval()
    assert set(model.hf_device_map.values()) == {"disk"}
    return model


@pytest.fixture(autouse=True)
def _quiet_loading():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*meta device.*offloaded.*")
        yield


@pytest.mark.parametrize("options", MODES, ids=["full", "sentinel", "replay_on_nan"])
def test_a_disk_offloaded_llama_gives_the_same_logits_and_tokens_and_stays_offloaded(tmp_path, options):
    model = _on_disk(_llama_dir(tmp_path), tmp_path)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nw.EarlyWarningIssued)
        with nw.watch(model, **options) as watch, torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False,
                                              pad_token_id=0), tokens)
    assert watch.events == [] and watch.warnings == []
    assert all(p.is_meta for p in model.model.layers.parameters())  # still offloaded
    assert hasattr(model.get_submodule(TARGET), "_hf_hook")  # accelerate's hooks kept
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)  # and they still work after close()


@pytest.mark.parametrize("options", MODES, ids=["full", "sentinel", "replay_on_nan"])
def test_a_nan_in_a_disk_offloaded_checkpoint_is_a_corrupted_weight_named_and_replayed_loaded(
        tmp_path, options):
    model = _on_disk(_llama_dir(tmp_path, poison=True), tmp_path)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with nw.watch(model, on_nan="record", **options) as watch, torch.no_grad():
        model(ids)
        event = watch.event
        trace = watch.replay(0)
    assert (event.batch, event.module) == (0, TARGET)
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight", diagnosis.summary
    assert f"'{TARGET}.weight'" in diagnosis.summary
    assert any("checkpoint" in fix for fix in diagnosis.suggestion)
    weight = trace.frames[(trace.frames.module == TARGET) & (trace.frames.role == "weight")]
    assert bool(weight.nan.iloc[0]) and weight.note.iloc[0] == ""  # loaded, not "meta"
    assert trace.reproduced and trace.changes == []
    assert all(p.is_meta for p in model.model.layers.parameters())


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_written_into_disk_offload_s_dat_file_names_the_weight(tmp_path, mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    folder = str(tmp_path / "dk")
    model = accelerate.disk_offload(model, folder, execution_device=torch.device("cpu"))
    x = torch.randn(4, 8)
    with nw.watch(model, mode=mode, on_nan="record") as watch, torch.no_grad():
        model(x)
        stored = np.memmap(os.path.join(folder, "2.weight.dat"), dtype="float32", mode="r+",
                           shape=(4, 16))
        stored[1, 3] = np.nan  # the file on disk goes bad between batches
        stored.flush()
        del stored
        model(x)
        event = watch.event
    assert (event.batch, event.module) == (1, "2")
    assert event.diagnosis.kind == "corrupted-weight", event.diagnosis.summary
    assert "'2.weight'" in event.diagnosis.summary
    assert all(p.is_meta for p in model.parameters())


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h)  # the overflow's line


@pytest.mark.parametrize("offload", ["cpu", "disk"])
@pytest.mark.parametrize("options", MODES, ids=["full", "sentinel", "replay_on_nan"])
def test_an_overflow_in_an_offloaded_linear_names_the_model_s_line_not_accelerate_s_hooks(
        tmp_path, offload, options):
    # accelerate's hooks call each offloaded module's old forward from hooks.py: the overflow's
    # summary and its first fix said 'addmm in module 'fc2' (Linear) at .../accelerate/
    # hooks.py:185' and 'Keep the values smaller before addmm at .../accelerate/hooks.py:185'.
    torch.manual_seed(0)
    model = _TwoLayers().eval()
    with torch.no_grad():
        model.fc2.weight.mul_(1e37)
    device = torch.device("cpu")
    model = accelerate.cpu_offload(model, execution_device=device) if offload == "cpu" \
        else accelerate.disk_offload(model, str(tmp_path / "dk"), execution_device=device)
    with nw.watch(model, on_nan="record", **options) as watch, torch.no_grad():
        model(torch.randn(4, 8) * 100)
    diagnosis = watch.event.diagnosis
    assert diagnosis.kind == "overflow", diagnosis.summary
    told = " ".join([diagnosis.summary, *diagnosis.suggestion])
    assert "accelerate" not in told, told
    assert f"addmm in module 'fc2' (Linear) at {__file__}:" in diagnosis.summary, diagnosis.summary
    line = diagnosis.summary.split(f"{__file__}:")[1].split()[0]
    assert "the overflow's line" in open(__file__).read().splitlines()[int(line) - 1]
    assert all(p.is_meta for p in model.parameters())

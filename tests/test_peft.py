"""nanwidget on peft (LoRA) models: tiny Llamas made from configs, random weights, nothing
downloaded. Skipped where peft is not installed."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
peft = pytest.importorskip("peft", reason="the peft tests need peft (pip install peft)")
transformers = pytest.importorskip(
    "transformers", reason="peft wraps transformers models: pip install -e .[transformers]")

import nanwidget as nw  # noqa: E402

MODES = ["full", "sentinel"]


def _lora_llama() -> tuple[torch.nn.Module, torch.Tensor]:
    """A 2-layer Llama with LoRA on q_proj and v_proj, and a batch of token ids."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, max_position_embeddings=32)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    return model, torch.randint(0, 64, (2, 8))


def _v_proj(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model().model.layers[1].self_attn.v_proj


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_base_weight_met_in_the_reference_forward_is_said_to_be_there(mode):
    # DPO with ref_model=None: the reference log-probs come from the same model with its
    # adapters disabled. The event said "batch 1" ("forward 1 of 2" under a trainer) and
    # nothing told that it was that forward.
    model, ids = _lora_llama()
    with nw.watch(model, on_nan="record", mode=mode) as w:
        model(input_ids=ids)  # the policy forward, adapters on
        with torch.no_grad():
            _v_proj(model).base_layer.weight[0, 0] = float("nan")
        with torch.no_grad(), model.disable_adapter():
            model(input_ids=ids)
    event = w.event
    assert event.batch == 1 and event.origin == "weight"
    assert event.module.endswith("layers.1.self_attn.v_proj.base_layer")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert "Batch 1 ran with the adapters disabled: the base model alone" in diagnosis.summary
    assert diagnosis.evidence[0].startswith(
        "Batch 1 ran with the model's adapters disabled (peft's `with model.disable_adapter():`"
        ", under torch.no_grad()): the base model alone")


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_lora_weight_is_met_in_the_policy_forward_at_its_lora_layer(mode):
    model, ids = _lora_llama()
    with nw.watch(model, on_nan="record", mode=mode) as w:
        model(input_ids=ids)
        with torch.no_grad():
            _v_proj(model).lora_A["default"].weight[0, 0] = float("nan")
        with torch.no_grad(), model.disable_adapter():
            model(input_ids=ids)  # the adapters do not run: clean
        assert not w.events
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)  # adapters on (generation, evaluation): not a reference forward
    event = w.event
    assert event.batch == 2 and event.origin == "weight"
    assert event.module.endswith("layers.1.self_attn.v_proj.lora_A.default")
    assert event.diagnosis.kind == "corrupted-weight"
    assert "adapters disabled" not in "\n".join(event.diagnosis.lines())


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_met_in_the_reference_forward_on_a_ref_adapter_is_said_to_be_there(mode):
    # TRL's DPO, training an adapter the model already had, keeps a copy of it named "ref" and
    # runs the reference forward with set_adapter("ref") (trl.trainer.utils.use_adapter).
    model, ids = _lora_llama()
    model.add_adapter("ref", model.peft_config["default"])
    with nw.watch(model, on_nan="record", mode=mode) as w:
        model(input_ids=ids)
        with torch.no_grad():
            _v_proj(model).base_layer.weight[0, 0] = float("nan")
            model.set_adapter("ref")
            model(input_ids=ids)
        model.set_adapter("default")
    diagnosis = w.event.diagnosis
    assert w.event.batch == 1 and diagnosis.kind == "corrupted-weight"
    assert diagnosis.summary.endswith(" Batch 1 ran with adapter 'ref' active, not 'default' "
                                      "(a reference forward).")
    assert diagnosis.evidence[0].startswith("Batch 1 ran with adapter 'ref' active (peft's "
                                            "set_adapter(), under torch.no_grad()), where "
                                            "'default' was active when the model was watched")


def _generate(model: torch.nn.Module, ids: torch.Tensor, **options) -> object:
    return model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, **options)


def _down_proj(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model().model.layers[1].mlp.down_proj


def test_sentinel_mode_checks_the_steps_of_peft_generate_as_batches_of_their_own():
    # PeftModel.generate() calls the model it wraps, not the PeftModel's forward: GRPO with a
    # LoRA peft_config sampled from NaN logits and sentinel mode saw nothing.
    model, ids = _lora_llama()
    unwatched = _generate(model, ids)
    with nw.watch(model, on_nan="record", mode="sentinel") as w:
        model(input_ids=ids, labels=ids).loss.backward()  # a training forward: one batch
        assert w.batch == 1 and w.parts.sentinel.checks == 1
        out = _generate(model, ids)
        assert w.events == [] and w.batch == 4 and w.parts.sentinel.checks == 4
        assert list(w.history()["module"]) == ["", "base_model.model", "base_model.model",
                                               "base_model.model"]
        assert not w.recorder.module_hooks_attached
        with torch.no_grad():
            _down_proj(model).weight[0, 0] = float("nan")
        _generate(model, ids)
        event = w.event
    assert torch.equal(out.sequences, unwatched.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, unwatched.logits))
    assert (event.batch, event.module, event.role, event.origin) == \
        (4, "base_model.model.model.layers.1.mlp.down_proj", "weight", "weight")
    assert event.trace.reproduced and event.diagnosis.kind == "corrupted-weight"
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
    assert "forward" not in vars(model.get_base_model())


def test_a_nan_in_peft_generate_with_a_static_cache_is_replayed_from_the_cache_as_it_was():
    model, ids = _lora_llama()
    with nw.watch(model, on_nan="record", mode="sentinel") as w:
        with torch.no_grad():
            _down_proj(model).weight[0, 0] = float("nan")
        _generate(model, ids, cache_implementation="static")
    event = w.event
    # The static cache the step wrote in place is replayed as the step found it (it was "not
    # replayed: cannot replay batch 0 ... modified in place by the model's own forward").
    assert (event.batch, event.module, event.role, event.origin) == \
        (0, "base_model.model.model.layers.1.mlp.down_proj", "weight", "weight")
    assert not event.note.startswith("not replayed")
    assert event.diagnosis.kind == "corrupted-weight"

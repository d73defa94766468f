"""nanwidget on mixture-of-experts models from transformers: tiny Mixtral and Switch
Transformers made from configs, random weights, nothing downloaded."""

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


def _mixtral() -> torch.nn.Module:
    """A 2-layer Mixtral, 4 experts, top-2, with router jitter and the router's aux loss."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1,
        output_router_logits=True)
    return transformers.MixtralForCausalLM(config)


def _switch() -> torch.nn.Module:
    """A Switch Transformer (T5 with top-1 experts, 4 of them, capacity 4) of 2 + 2 layers."""
    torch.manual_seed(0)
    config = transformers.SwitchTransformersConfig(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, num_experts=4, expert_capacity=4, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.SwitchTransformersForConditionalGeneration(config)


def _ids(batch: int) -> torch.Tensor:
    return torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(100 + batch))


def _train_mixtral(watch_options: dict | None) -> tuple[list[torch.Tensor], nw.NanWatch | None]:
    model = _mixtral()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = nw.watch(model, **watch_options) if watch_options is not None else None
    torch.manual_seed(1)  # the router's jitter draws from it
    seen = []
    for batch in range(2):
        out = model(input_ids=_ids(batch), labels=_ids(batch))
        out.loss.backward()
        seen += [out.loss.detach(), out.aux_loss.detach()]
        seen += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        seen.append(model.generate(_ids(5)[:, :4], max_new_tokens=3, do_sample=True,
                                   pad_token_id=0))
    seen += [p.detach().clone() for p in model.parameters()] + [torch.rand(2)]
    return seen, w


@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}, {"backward": True}],
                         ids=["full", "sentinel", "backward"])
def test_a_watched_mixtral_trains_and_generates_bit_identically_without_a_false_alarm(options):
    unwatched, _ = _train_mixtral(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nw.EarlyWarningIssued)
        watched, w = _train_mixtral(options)
    w.close()
    assert len(watched) == len(unwatched)
    assert all(torch.equal(a, b) for a, b in zip(watched, unwatched))
    assert not w.events and not w.warnings


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_expert_of_mixtrals_3d_experts_weight_is_named_by_its_index(mode):
    # Mixtral keeps its 4 experts in one 3-D down_proj: the event names that weight, and
    # which expert holds the NaN was nowhere.
    model = _mixtral()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    options = {"mode": "sentinel"} if mode == "sentinel" else {}
    w = nw.watch(model, on_nan="record", **options)
    for batch in range(3):
        if batch == 2:
            with torch.no_grad():
                model.model.layers[1].mlp.experts.down_proj[2, 3, 5] = math.nan
        model(input_ids=_ids(batch), labels=_ids(batch)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    w.close()
    event = w.event
    assert (event.batch, event.module, event.role, event.origin) == (
        2, "model.layers.1.mlp.experts", "down_proj", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert "Its non-finite values lie in down_proj[2] only: expert 2 of 4 (dim 0 indexes the " \
        "experts); only the tokens routed to it read them." in diagnosis.evidence


def _experts_run(model: torch.nn.Module, inputs: list[dict]) -> list[set[str]]:
    """The Switch experts each forward ran (hooks on a model no watch is on)."""
    ran: set[str] = set()
    names = {module: name for name, module in model.named_modules()
             if name.rpartition(".")[2].startswith("expert_")}
    hooks = [module.register_forward_hook(lambda m, i, o: ran.add(names[m])) for module in names]
    runs = []
    with torch.no_grad():
        for kwargs in inputs:
            ran.clear()
            model(**kwargs)
            runs.append(set(ran))
    for hook in hooks:
        hook.remove()
    return runs


@pytest.mark.parametrize("mode", MODES)
def test_a_switch_expert_loaded_nan_and_idle_until_routed_to_is_not_blamed_on_a_step(mode):
    # No training, no optimizer: an expert holds a NaN from its checkpoint, batch 0 routes it
    # no token, batch 1 does. Full mode said "an optimizer step, a load or a write made it"
    # with backward=True and gradient clipping as fixes (sentinel mode had it right).
    model = _switch().eval()
    inputs = [{"input_ids": _ids(b), "decoder_input_ids": _ids(b)[:, :5].contiguous()}
              for b in range(2)]
    first, second = _experts_run(model, inputs)
    expert = sorted(second - first)[0]  # runs in batch 1 only
    with torch.no_grad():
        model.get_submodule(expert).wo.weight[0, 0] = math.nan
    options = {"mode": "sentinel"} if mode == "sentinel" else {}
    with nw.watch(model, on_nan="record", **options) as w, torch.no_grad():
        for kwargs in inputs:
            model(**kwargs)
    event = w.event
    assert (event.batch, event.module, event.role) == (1, expert + ".wo", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert "since before the watch began; batch 1 is the first to read the bad values" \
        in diagnosis.summary
    assert diagnosis.suggestion[0].startswith("It was non-finite before the first batch watched")


@pytest.mark.parametrize("mode", MODES)
def test_mixtral_experts_routed_tokens_are_not_told_as_the_batchs_samples(mode):
    # Mixtral's eager experts loop runs each expert on the tokens routed to it. One that got
    # 2 tokens (as many as the batch has samples) overflowed float16, and the diagnosis named
    # rows of that gather as the batch's samples ("dim 0: its samples").
    model = _mixtral()
    model.set_experts_implementation("eager")
    model = model.half().eval()
    experts = model.model.layers[1].mlp.experts
    counts = []
    hook = experts.register_forward_hook(
        lambda m, args, out: counts.append(torch.bincount(args[1].flatten(), minlength=4)))
    with torch.no_grad():
        for batch in range(30):
            model(input_ids=_ids(batch)[:, :3])
            if 2 in counts[-1].tolist():
                break
    hook.remove()
    expert = counts[-1].tolist().index(2)
    with torch.no_grad():
        experts.down_proj[expert].mul_(1000.0)
        experts.gate_up_proj[expert].mul_(1000.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        options = {"mode": "sentinel"} if mode == "sentinel" else {}
        with nw.watch(model, on_nan="record", **options) as w, torch.no_grad():
            model(input_ids=_ids(batch)[:, :3])
    event = w.event
    assert (event.module, event.role) == ("model.layers.1.mlp.experts", "output")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "overflow"
    assert diagnosis.rows == []
    assert not any("dim 0: its samples" in line for line in diagnosis.evidence)

"""generate() beyond greedy, sampling and beam search: assisted generation (one watch on the
model, one on its assistant, or both), logits processors that write -inf on purpose, cache
variants, and left-padded batches. Tiny models built from configs (random weights, nothing
downloaded)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import nanwidget as nw
from nanwidget.core.replay import ReplayError

transformers = pytest.importorskip(
    "transformers", reason="the generation tests need transformers (pip install transformers)")
transformers.logging.set_verbosity_error()

MASKED_SOFTMAX = "nanwidget_tests_masked_softmax"


def _masked_softmax_attention(module, query, key, value, attention_mask, scaling=None,
                              dropout=0.0, **kwargs):
    """A user's own attention: -inf where the mask says no, then softmax, with no guard for a
    row that sees no key (the left padding of a padded row, under the causal mask)."""
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scores = query @ key.transpose(2, 3) * scaling
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    return (probs @ value).transpose(1, 2).contiguous(), probs


transformers.AttentionInterface.register(MASKED_SOFTMAX, _masked_softmax_attention)
transformers.AttentionMaskInterface.register(MASKED_SOFTMAX, transformers.masking_utils.sdpa_mask)


def _llama(layers: int = 2, seed: int = 0, **config) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **config)).eval()


PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10]])
LEFT_PADDED = torch.tensor([[0, 0, 0, 5, 6, 7], [11, 12, 13, 14, 15, 16]])
SCORES = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)


def _hooks(*models: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
               for model in models for m in model.modules())


def _same(a, b) -> bool:
    return (torch.equal(a.sequences, b.sequences)
            and all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))
            and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
            and len(a.scores) == len(b.scores))


def _generate(model, watched=(), options=None, **settings):
    """generate() under a watch of each of ``watched`` (none: unwatched), from one seed;
    (output, the next random number, the watches, nanwidget's warnings)."""
    torch.manual_seed(123)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watches = [nw.watch(m, on_nan="record", **(options or {})) for m in watched]
        try:
            out = model.generate(pad_token_id=0, **settings)
        finally:
            for w in watches:
                w.close()
    ours = [str(c.message) for c in caught
            if "nanwidget" in c.filename or issubclass(c.category, nw.EarlyWarningIssued)]
    return out, torch.rand(1), watches, ours


@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}], ids=["full", "sentinel"])
def test_assisted_generation_with_both_models_watched_is_unchanged_and_quiet(options):
    settings = dict(input_ids=PROMPT, max_new_tokens=8, do_sample=True, **SCORES)
    base, base_rng, _, _ = _generate(_llama(), assistant_model=_llama(1, seed=1), **settings)
    model, assistant = _llama(), _llama(1, seed=1)
    out, rng, (w_model, w_assistant), said = _generate(
        model, (model, assistant), options, assistant_model=assistant, **settings)
    assert _same(out, base) and torch.equal(rng, base_rng)
    assert said == [] and w_model.events == [] and w_assistant.events == []
    assert w_model.batch > 0 and w_assistant.batch > 0  # both checked their own calls
    assert _hooks(model, assistant) == 0


@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}], ids=["full", "sentinel"])
def test_a_nan_weight_in_the_assistant_is_named_by_its_watch_alone(options):
    # The main model checks the assistant's drafts: its output stays finite and unchanged.
    base, _, _, _ = _generate(_llama(), assistant_model=_llama(1, seed=1), input_ids=PROMPT,
                              max_new_tokens=6, do_sample=False)
    model, assistant = _llama(), _llama(1, seed=1)
    with torch.no_grad():
        assistant.model.layers[0].mlp.down_proj.weight[3, 5] = math.nan
    out, _, (w_model, w_assistant), _ = _generate(
        model, (model, assistant), options, assistant_model=assistant, input_ids=PROMPT,
        max_new_tokens=6, do_sample=False)
    assert torch.equal(out, base) and w_model.events == []
    event = w_assistant.event
    assert (event.batch, event.module, event.role, event.origin) == (
        0, "model.layers.0.mlp.down_proj", "weight", "weight")
    assert event.diagnosis.kind == "corrupted-weight"


@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}], ids=["full", "sentinel"])
def test_a_nan_in_the_assistant_stops_generate_naming_the_assistant_not_the_model(options):
    # The model and its assistant share every module name: the message said "nan in batch 0
    # at module 'model.layers.0.mlp.down_proj'" of either.
    model, assistant = _llama(), _llama(1, seed=1)
    with torch.no_grad():
        assistant.model.layers[0].mlp.down_proj.weight[3, 5] = math.nan
    size = sum(p.numel() for p in assistant.parameters())
    assert size != sum(p.numel() for p in model.parameters())
    with nw.watch(model, **options) as w_model, nw.watch(assistant, **options):
        with pytest.raises(nw.NanDetected) as raised:
            model.generate(PROMPT, assistant_model=assistant, max_new_tokens=4,
                           do_sample=False, pad_token_id=0)
    assert w_model.events == []
    assert (f"at module 'model.layers.0.mlp.down_proj' (Linear, call 0) in LlamaForCausalLM "
            f"of {size / 1e3:.3g}K parameters, weight") in str(raised.value)
    assert _hooks(model, assistant) == 0


@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}], ids=["full", "sentinel"])
def test_logits_processors_that_write_minus_inf_are_quiet_and_leave_the_scores_as_they_were(
        options):
    settings = dict(input_ids=LEFT_PADDED, attention_mask=(LEFT_PADDED != 0).long(),
                    max_new_tokens=6, min_new_tokens=4, bad_words_ids=[[3], [4, 5]],
                    suppress_tokens=[6], begin_suppress_tokens=[7], forced_eos_token_id=2,
                    sequence_bias={(8,): -10.0}, renormalize_logits=True, do_sample=True,
                    top_k=8, top_p=0.9, num_return_sequences=2, **SCORES)
    base, base_rng, _, _ = _generate(_llama(), **settings)
    assert any(torch.isneginf(s).any() for s in base.scores)  # the processors did write -inf
    model = _llama()
    out, rng, (w,), said = _generate(model, (model,), options, **settings)
    assert _same(out, base) and torch.equal(rng, base_rng)
    assert said == [] and w.events == [] and _hooks(model) == 0


def _left_padded_nan(options: dict, cache: str = "dynamic",
                     prompt: torch.Tensor = LEFT_PADDED) -> nw.NanWatch:
    """generate() of a left-padded batch through the masked softmax under a watch: the
    default DynamicCache, cache_implementation="static", or a StaticCache passed in."""
    model = _llama(attn_implementation=MASKED_SOFTMAX)
    settings = dict(input_ids=prompt, attention_mask=(prompt != 0).long(), max_new_tokens=3,
                    do_sample=False, pad_token_id=0, **SCORES)
    if cache == "static":
        settings["cache_implementation"] = "static"

    def static_cache() -> dict:
        return {"past_key_values": transformers.StaticCache(config=model.config,
                                                            max_cache_len=16)
                } if cache == "StaticCache" else {}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # past_key_values= is deprecated for cache=
        base = model.generate(**settings, **static_cache()) if cache != "dynamic" else None
        settings.update(static_cache())
        with nw.watch(model, on_nan="record", **options) as w:
            out = model.generate(**settings)
    assert out.scores[0][0].isnan().all() and not out.scores[0][1].isnan().any()
    if base is not None:  # the replays left the cache as generate() had written it
        assert torch.equal(out.sequences, base.sequences)
        assert all(torch.equal(a.nan_to_num(), b.nan_to_num())
                   for a, b in zip(out.scores, base.scores))
    return w


@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}, {"replay_on_nan": True}],
                         ids=["full", "sentinel", "replay_on_nan"])
def test_a_left_padded_row_whose_padding_sees_no_key_is_a_masked_row_naming_that_row(options):
    # No sequence is all padding: the padding positions' queries of row 0 see no key under
    # the causal mask. The diagnosis named no row (its fixes said "check the rows named here")
    # and told to drop sequences that are all padding.
    w = _left_padded_nan(options)
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.module, event.role) == (
        0, "model.layers.0.self_attn.o_proj", "input[0]")
    assert (diagnosis.kind, diagnosis.rows) == ("masked-row", [0])
    assert diagnosis.summary.startswith("_softmax in module 'model.layers.0.self_attn'")
    evidence = " ".join(diagnosis.evidence)
    assert "in row 0 of the batch's 2 rows" in evidence
    assert "kwarg:attention_mask is 0 at the first 3 positions of row 0 (left padding)" in evidence
    assert "torch.finfo(scores.dtype).min instead of -inf" in diagnosis.suggestion[0]
    assert not any("all padding" in fix for fix in diagnosis.suggestion)
    trace = w.replay(0)
    assert trace.reproduced and trace.first_bad.op == "_softmax"


@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}], ids=["full", "sentinel"])
def test_later_steps_that_read_the_nan_the_first_wrote_into_the_kv_cache_are_not_bad_data(
        options):
    # Each later step's NaN came from the cache the first step wrote: it was "bad-data ... it
    # came with the data, not from the model", with a Dataset's fixes.
    w = _left_padded_nan(options)
    first, later = w.events[0], w.events[1]
    assert later.batch == 1
    diagnosis = later.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("masked-row", [0])
    assert diagnosis.summary.startswith("The batch's kwarg:cache.layers[1].keys")
    assert "that the model's own earlier steps wrote into the state it carries over" in \
        diagnosis.summary and "since batch 0" in diagnosis.summary
    assert "came with the data" not in diagnosis.summary
    assert diagnosis.evidence[0].startswith(
        "Batch 0 made an event at module 'model.layers.0.self_attn.o_proj'")
    assert diagnosis.suggestion == first.diagnosis.suggestion
    assert w.events[2].diagnosis.evidence[0].startswith(
        "Each of batches 0 to 1 made an event, the first at module")


@pytest.mark.parametrize("cache", ["static", "StaticCache"])
@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}], ids=["full", "sentinel"])
def test_a_left_padded_row_under_a_static_cache_is_a_masked_row_naming_that_row(options, cache):
    # The static cache is written in place by each step, so the replay refused ("its
    # kwarg:cache.layers[0].cumulative_length ... was modified in place by the model's own
    # forward") and the diagnosis was "unknown: what made it could not be told" (in sentinel
    # mode at the root's logits). generate() hands the model a mask per query and key here.
    w = _left_padded_nan(options, cache)
    event, diagnosis = w.event, w.event.diagnosis
    assert (event.batch, event.module, event.role) == (
        0, "model.layers.0.self_attn.o_proj", "input[0]")
    assert (diagnosis.kind, diagnosis.rows) == ("masked-row", [0])
    assert diagnosis.summary.startswith("_softmax in module 'model.layers.0.self_attn'")
    evidence = " ".join(diagnosis.evidence)
    assert "in row 0 of the batch's 2 rows" in evidence
    assert "hides the first 3 key positions of row 0 from every query (left padding)" in evidence
    assert "torch.finfo(scores.dtype).min instead of -inf" in diagnosis.suggestion[0]
    assert not any("all padding" in fix for fix in diagnosis.suggestion)
    later = w.events[1].diagnosis  # the next step read the NaN back from the cache
    assert (later.kind, later.rows) == ("masked-row", [0])
    assert "that the model's own earlier steps wrote into the state it carries over" in \
        later.summary and "came with the data" not in later.summary
    trace = w.replay(0)
    assert trace.reproduced and trace.first_bad.op == "_softmax" and trace.changes == []


@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}], ids=["full", "sentinel"])
def test_a_row_all_padding_under_a_static_cache_is_a_masked_row_naming_that_row(options):
    prompt = torch.tensor([[0, 0, 0, 0, 0, 0], [11, 12, 13, 14, 15, 16]])
    diagnosis = _left_padded_nan(options, "static", prompt).event.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("masked-row", [0])
    assert "Rows 0 of the batch have a fully masked kwarg:attention_mask." in diagnosis.evidence
    assert any("drop sequences that are all padding" in fix for fix in diagnosis.suggestion)


@pytest.mark.parametrize("cache", ["static", "no-cache"])
def test_left_padded_sampling_with_a_static_cache_or_none_is_unchanged_and_quiet(cache):
    settings = dict(input_ids=LEFT_PADDED, attention_mask=(LEFT_PADDED != 0).long(),
                    max_new_tokens=5, do_sample=True, num_return_sequences=2, **SCORES)
    settings.update({"cache_implementation": "static"} if cache == "static"
                    else {"use_cache": False})
    base, base_rng, _, _ = _generate(_llama(), **settings)
    model = _llama()
    out, rng, (w,), said = _generate(model, (model,), {"mode": "sentinel"}, **settings)
    assert _same(out, base) and torch.equal(rng, base_rng)
    assert said == [] and w.events == [] and w.batch == 5


def test_a_step_whose_static_cache_was_reset_since_is_refused_saying_so():
    # A StaticCache reset and filled again by the next generate(): the step's replay ran on the
    # new prompt's keys and values and said its outputs "differ from the batch's beyond
    # rounding: the model's Python state differs ...". The prefill read none of the cache.
    model = _llama(attn_implementation=MASKED_SOFTMAX)
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    other = torch.tensor([[21, 22, 23, 24, 25, 26], [11, 12, 13, 14, 15, 16]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw.watch(model, on_nan="record", keep_batches=8) as w:
            for prompt in (LEFT_PADDED, other):
                cache.reset()
                model.generate(prompt, attention_mask=(prompt != 0).long(), max_new_tokens=3,
                               do_sample=False, pad_token_id=0, past_key_values=cache)
            assert w.replay(0).reproduced
            with pytest.raises(ReplayError) as refused:
                w.replay(1)
    assert str(refused.value).startswith(
        "cannot replay batch 1: the static KV cache it read (kwarg:cache.layers[0]) was reset "
        "or cropped since (its cumulative_length was written 6 times by 5 forwards)")

"""nanwidget under Hugging Face TRL's trainers (SFT, DPO, GRPO): tiny models made from configs,
a word-level tokenizer built here, nothing downloaded. Skipped where TRL is not installed."""

from __future__ import annotations

import copy
import math
import os
import random

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
trl = pytest.importorskip("trl", reason="the TRL tests need trl (pip install trl)")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import nanwidget as nw  # noqa: E402
from nanwidget.integrations.transformers import NanWatchCallback  # noqa: E402

WORDS = "the a cat dog sat ran on mat log red blue big small is was and".split()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "<bos>": 3}
    vocab.update({word: 4 + i for i, word in enumerate(WORDS)})
    tokens = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokens.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokens, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        bos_token="<bos>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


def _gpt2(tokenizer):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
        pad_token_id=0, eos_token_id=1, bos_token_id=3))
    model.generation_config.pad_token_id = 0
    return model


def _sentences(rows: int, seed: int) -> list[str]:
    pick = random.Random(seed)
    return [" ".join(pick.choice(WORDS) for _ in range(pick.randint(3, 9))) for _ in range(rows)]


def _common(tmp_path, steps: int) -> dict:
    return dict(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
                logging_steps=1, use_cpu=True, report_to=[], save_strategy="no", seed=0,
                dataloader_num_workers=0, disable_tqdm=True)


def _reward_length(completions, **kwargs):
    return [len(completion) / 10 for completion in completions]


class CorruptAfterStep(transformers.TrainerCallback):
    """A NaN written into the final LayerNorm's weight after optimizer step ``step`` (a bad
    load or write between steps): the next step's generation samples from NaN logits."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                model.transformer.ln_f.weight.fill_(math.nan)


def _grpo(tmp_path, callbacks, steps: int = 3):
    tokenizer = _tokenizer()
    config = trl.GRPOConfig(num_generations=4, max_completion_length=8, beta=0.0,
                            **_common(tmp_path, steps))
    return trl.GRPOTrainer(model=_gpt2(tokenizer), reward_funcs=_reward_length, args=config,
                           train_dataset=datasets.Dataset.from_dict({"prompt": _sentences(16, 4)}),
                           processing_class=tokenizer, callbacks=callbacks)


def _no_time(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if "time" not in k and "per_second" not in k
             and "runtime" not in k} for row in history]


def test_grpo_generation_that_samples_nan_logits_first_says_what_the_watch_found(tmp_path, caplog):
    callback = NanWatchCallback(log_dir=False)
    trainer = _grpo(tmp_path, [CorruptAfterStep(1), callback])
    with caplog.at_level("WARNING", logger="nanwidget.integrations"), \
            pytest.raises(RuntimeError, match="probability tensor contains"):
        trainer.train()  # TRL's own error, unchanged
    said = [r.getMessage() for r in caplog.records if "training ended with" in r.getMessage()]
    assert len(said) == 1
    assert "'transformer.ln_f'" in said[0] and "corrupted-weight" in said[0]
    assert "(training step 2, micro-batch 0" in said[0]  # the generation of step 2
    event = callback.event
    assert (event.module, event.role, event.origin) == ("transformer.ln_f", "weight", "weight")
    assert event.diagnosis.kind == "corrupted-weight"
    assert "training_step" not in vars(trainer)
    callback.close()


def test_a_healthy_grpo_run_is_unchanged_and_raises_no_alarm(tmp_path):
    plain = _grpo(tmp_path, [], steps=2)
    plain.train()
    callback = NanWatchCallback(log_dir=False)
    watched = _grpo(tmp_path, [callback], steps=2)
    watched.train()
    assert _no_time(watched.state.log_history) == _no_time(plain.state.log_history)
    assert all(torch.equal(a, b) for a, b in zip(plain.model.state_dict().values(),
                                                 watched.model.state_dict().values()))
    assert not callback.watch.events and not callback.watch.warnings
    assert callback.watch.closed and "training_step" not in vars(watched)


def test_dpo_with_a_copied_reference_model_watches_only_the_policy(tmp_path):
    tokenizer = _tokenizer()
    data = datasets.Dataset.from_dict({"prompt": _sentences(8, 1), "chosen": _sentences(8, 2),
                                       "rejected": _sentences(8, 3)})

    def train(watched: bool):
        model = _gpt2(tokenizer)
        reference = copy.deepcopy(model)
        trainer = trl.DPOTrainer(model=model, ref_model=reference, processing_class=tokenizer,
                                 args=trl.DPOConfig(max_length=32, **_common(tmp_path, 2)),
                                 train_dataset=data)
        watch = nw.watch(trainer.model, backward=True) if watched else None
        trainer.train()
        return trainer, watch

    plain, _ = train(False)
    trainer, watch = train(True)
    assert watch.batch == 2 and not watch.events and not watch.warnings  # one forward per step
    assert _no_time(trainer.state.log_history) == _no_time(plain.state.log_history)
    reference = trainer.ref_model
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in reference.modules()
               if m is not reference.transformer.wte)  # TRL's own input-grad hook is on wte
    watch.close()


def test_dpo_whose_reference_model_holds_a_nan_points_at_the_reference(tmp_path):
    # The reference (a copy the watch does not see) makes NaN log-probs; the DPO loss reads
    # them, so the gradient reaches the policy's output NaN: "loss", and the fixes name the
    # reference model, not only stable losses.
    tokenizer = _tokenizer()
    data = datasets.Dataset.from_dict({"prompt": _sentences(8, 1), "chosen": _sentences(8, 2),
                                       "rejected": _sentences(8, 3)})
    model = _gpt2(tokenizer)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.transformer.h[1].mlp.c_fc.weight[0, 0] = math.nan
    callback = NanWatchCallback(log_dir=False, backward=True)
    trainer = trl.DPOTrainer(model=model, ref_model=reference, processing_class=tokenizer,
                             args=trl.DPOConfig(max_length=32, **_common(tmp_path, 2)),
                             train_dataset=data, callbacks=[callback])
    trainer.train()
    assert callback.stop is not None and callback.stop.step == 1
    event = callback.event
    assert (event.module, event.origin, event.is_backward) == ("", "grad", True)
    assert event.diagnosis.kind == "loss"
    assert any("nw.watch(ref_model)" in fix for fix in event.diagnosis.suggestion)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # no NaN step applied

"""NanWatchCallback with Trainer features beyond the plain loop: optimizers and their
arguments, resume_from_checkpoint, label smoothing. Tiny GPT-2 from a config, no downloads."""

from __future__ import annotations

import math
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip(
    "transformers", reason="the Trainer callback needs the transformers extra: pip install -e .[transformers]")

from nanwidget.integrations.transformers import NanWatchCallback  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "scripts"))
from trainer_nan import (GPT2_POISONED, PoisonAtStep, TokenDataset, hook_count,  # noqa: E402
                         tiny_gpt2, training_args)

MODES = [("full", False), ("full", True), ("sentinel", False), ("sentinel", True)]


def _train(out, callbacks, model=None, dataset=None, resume=None, **args):
    trainer = transformers.Trainer(model=model or tiny_gpt2(), args=training_args(str(out), **args),
                                   train_dataset=dataset or TokenDataset(32), callbacks=callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    return trainer, [str(w.message) for w in caught if "nanwidget" in str(w.message)]


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# ------------------------------------------------------------------ fixes in TrainingArguments
def test_sgd_diverging_without_clipping_is_fixed_with_training_arguments(tmp_path):
    # The fixes said torch.optim.lr_scheduler.LinearLR and torch.nn.utils.clip_grad_norm_(...),
    # calls in a loop the Trainer writes; its user sets learning_rate, warmup_steps and
    # max_grad_norm (0 here: clipping off).
    callback = NanWatchCallback(log_dir=False)
    trainer, _ = _train(tmp_path, [callback], optim="sgd", learning_rate=1e4, max_grad_norm=0.0,
                        logging_nan_inf_filter=False)
    assert callback.stop.step == 3 and trainer.state.global_step == 3
    diagnosis = callback.event.diagnosis
    assert diagnosis.kind == "divergence"
    assert diagnosis.suggestion[0].startswith(
        "Lower the learning rate (try 10x lower: TrainingArguments(learning_rate=...)) or warm "
        "it up over the first steps (TrainingArguments(warmup_steps=...)")
    assert ("Clip the gradients before the step: TrainingArguments(max_grad_norm=1.0) (its "
            "default; max_grad_norm=0 turns it off).") in diagnosis.suggestion
    assert not any("torch.optim.lr_scheduler" in fix or "clip_grad_norm_" in fix
                   or "torch.amp.GradScaler" in fix for fix in diagnosis.suggestion)


def test_adafactor_diverging_with_the_trainers_clipping_on_is_not_told_to_clip(tmp_path):
    # max_grad_norm=1.0 (the default) clipped every step already: "Clip the gradients" was no fix.
    callback = NanWatchCallback(log_dir=False)
    _train(tmp_path, [callback], optim="adafactor", learning_rate=1e6,
           logging_nan_inf_filter=False)
    diagnosis = callback.event.diagnosis
    assert diagnosis.kind == "divergence" and callback.stop.step == 2
    assert diagnosis.suggestion[0].startswith(
        "Lower the learning rate (try 10x lower: TrainingArguments(learning_rate=...))")
    assert diagnosis.suggestion[1].startswith(
        "The Trainer already clips the gradients' total norm (TrainingArguments(max_grad_norm=1))")
    assert not any(fix.startswith("Clip the gradients") for fix in diagnosis.suggestion)


# ------------------------------------------------------------------ resume_from_checkpoint
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint-2 of a 4-step run (save_steps=2), and that run's losses and weights."""
    out = tmp_path_factory.mktemp("saved")
    trainer, _ = _train(out, [], max_steps=4, save_strategy="steps", save_steps=2)
    return out / "checkpoint-2", _losses(trainer), trainer.model.state_dict()


def _resumed_from(checkpoint, tmp_path, nan_weight=False):
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, folder)
    if nan_weight:
        from safetensors.torch import load_file, save_file
        state = load_file(folder / "model.safetensors")
        state[f"{GPT2_POISONED}.weight"][0, 0] = math.nan
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize("mode, backward", MODES)
def test_a_resumed_checkpoint_with_a_nan_weight_is_blamed_on_the_load(checkpoint, tmp_path,
                                                                      mode, backward):
    # The summary said "(an optimizer step, a load or a write made it)" and the fixes "a write
    # ... before nw.watch()", "call w.check_grad_norms() before optimizer.step()" and
    # "torch.nn.utils.clip_grad_norm_(...)": none of them the Trainer's.
    callback = NanWatchCallback(mode=mode, backward=backward, log_dir=False)
    folder = _resumed_from(checkpoint[0], tmp_path, nan_weight=True)
    trainer, _ = _train(tmp_path, [callback], max_steps=4, resume=folder)
    event = callback.event
    assert (event.batch, event.module, event.origin) == (0, GPT2_POISONED, "weight")
    assert callback.stop.step == 3 and trainer.state.global_step == 3
    assert list(callback.batches()["step"]) == [3]
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert diagnosis.summary.startswith(
        f"'{GPT2_POISONED}.weight' holds NaN when the watch began, before batch 0 ran (a "
        "checkpoint loaded")
    assert "train(resume_from_checkpoint=...)" in diagnosis.suggestion[0]
    assert any("callbacks=[NanWatchCallback()]" in fix for fix in diagnosis.suggestion)
    assert not any("check_grad_norms" in fix or "clip_grad_norm_" in fix
                   for fix in diagnosis.suggestion)
    assert hook_count(trainer.model) == 0 and callback.watch.closed


# ------------------------------------------------------------------ a loss made outside the model
class _AllIgnoredAtCall:
    """A collator whose second batch has every label -100 (prompt-only rows)."""

    def __init__(self, call: int = 1, encoded: bool = False) -> None:
        self.call, self.calls, self.encoded = call, 0, encoded

    def __call__(self, rows):
        batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
        if self.calls == self.call:
            batch["labels"][:] = -100
        self.calls += 1
        # transformers' own collators hand over a BatchEncoding (a mapping, not a dict)
        return transformers.BatchEncoding(batch) if self.encoded else batch


@pytest.mark.parametrize("mode, backward, encoded", [("full", False, False),
                                                     ("sentinel", True, False),
                                                     ("full", False, True)])
def test_label_smoothing_over_a_batch_of_ignored_labels_stops_at_that_step(tmp_path, mode,
                                                                           backward, encoded):
    # label_smoothing_factor has the Trainer compute the loss outside the model (LabelSmoother):
    # 0/0 = NaN over a batch whose labels are all -100. Every module output stayed finite (and
    # the gradients are 0), so the callback saw nothing and training went on with NaN losses.
    callback = NanWatchCallback(mode=mode, backward=backward, log_dir=False)
    trainer = transformers.Trainer(
        model=tiny_gpt2(), args=training_args(str(tmp_path), label_smoothing_factor=0.1,
                                              logging_nan_inf_filter=False),
        train_dataset=TokenDataset(32), data_collator=_AllIgnoredAtCall(encoded=encoded), callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == 2 and callback.stop.step == 2
    assert callback.event is None  # no module made it
    reason = callback.stop.reason
    assert reason.startswith("nan loss in batch 1 (training step 2, micro-batch 0)")
    assert "label_smoothing_factor=0.1" in reason and "LabelSmoother" in reason
    assert "every label of this micro-batch is -100: 0/0" in reason
    assert hook_count(trainer.model) == 0 and callback.watch.closed


def test_a_nan_loss_is_called_a_loss_when_backward_frames_fill_the_window(tmp_path):
    # With backward=True the root's output frame had left the frames window by the step's
    # check, and the warning about logging_nan_inf_filter said "the gradient of step 3".
    callback = NanWatchCallback(backward=True, log_dir=False)
    _, caught = _train(tmp_path, [PoisonAtStep(GPT2_POISONED, 3), callback])
    assert callback.stop.step == 3
    hidden = [text for text in caught if "logging_nan_inf_filter" in text]
    assert len(hidden) == 1 and hidden[0].startswith("nanwidget: the loss of step 3 is not finite")

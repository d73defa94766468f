"""NanWatchCallback in transformers' Trainer: tiny GPT-2 and BERT from configs, no downloads."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip(
    "transformers", reason="the Trainer callback needs the transformers extra: pip install -e .[transformers]")

import nanwidget as nw  # noqa: E402
from nanwidget.integrations.transformers import NanWatchCallback  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "scripts"))
from trainer_nan import (BERT_POISONED, GPT2_POISONED, PoisonAtStep, TokenDataset,  # noqa: E402
                         changed_parameters, hook_count, tiny_bert, tiny_gpt2, training_args)


def _train(tmp_path, model, callbacks, dataset=None, eval_dataset=None, **args):
    trainer = transformers.Trainer(model=model, args=training_args(str(tmp_path / "out"), **args),
                                   train_dataset=dataset or TokenDataset(32),
                                   eval_dataset=eval_dataset, callbacks=callbacks)
    trainer.train()
    return trainer


def _optimizer_steps(trainer) -> int:
    return max((int(s["step"]) for s in trainer.optimizer.state.values() if "step" in s), default=0)


def test_gpt2_poisoned_at_step_3_stops_at_step_3_and_no_step_used_the_nan(tmp_path):
    model = tiny_gpt2()
    poison, callback = PoisonAtStep(GPT2_POISONED, 3), NanWatchCallback()
    trainer = _train(tmp_path, model, [poison, callback], logging_nan_inf_filter=False)
    assert trainer.state.global_step == 3                     # not the 6 asked for
    assert callback.stop.step == 3 and callback.stop.phase == "train"
    event = callback.event
    assert (event.module, event.origin, event.kind) == (GPT2_POISONED, "weight", "nan")
    assert GPT2_POISONED in callback.stop.reason and "training step 3" in callback.stop.reason
    # The stop message says why: the weight broke between steps, not in the forward.
    assert (f"Why (corrupted-weight): '{GPT2_POISONED}.weight' became NaN "
            in callback.stop.summary())
    # The optimizer never stepped with the NaN gradients: only the poisoned weight differs from
    # the copy taken when step 3 began, and Adam counted two steps, not three.
    assert changed_parameters(model, poison.snapshot) == [f"{GPT2_POISONED}.weight"]
    assert _optimizer_steps(trainer) == 2
    assert all(torch.isfinite(p).all() for n, p in model.named_parameters()
               if n != f"{GPT2_POISONED}.weight")
    assert hook_count(model) == 0 and callback.watch.closed
    assert trainer.state.log_history[-3]["nanwidget_stop"] == callback.stop.summary()


def test_the_recording_under_output_dir_loads_with_the_event_and_the_stop(tmp_path):
    model = tiny_gpt2()
    callback = NanWatchCallback()
    _train(tmp_path, model, [PoisonAtStep(GPT2_POISONED, 3), callback], logging_nan_inf_filter=False)
    run_dir = tmp_path / "out" / "nanwidget" / "run-0"
    assert Path(callback.watch.log_dir) == run_dir
    run = nw.load_run(run_dir)
    assert run.ranks == [0] and run.event.module == GPT2_POISONED
    stop = json.loads((run_dir / "stop-rank-00000.json").read_text())
    assert stop["step"] == 3 and stop["found_on"] == [0] and GPT2_POISONED in stop["report"]
    # A second train() with the same output_dir gets a folder of its own.
    second = NanWatchCallback()
    _train(tmp_path, tiny_gpt2(), [second], max_steps=1)
    assert Path(second.watch.log_dir) == tmp_path / "out" / "nanwidget" / "run-1"


def test_a_report_that_opens_where_the_batch_starts_has_no_empty_block_first(tmp_path):
    """With a window that begins at the batch's first frame, the report goes from "Last N
    forward frames:" straight into that batch's start, with one column header."""
    probe_model = tiny_gpt2()
    with nw.watch(probe_model, max_frames=200) as probe:
        probe_model(torch.randint(1, 50, (2, 8)))
        frames = probe.frames()
    window = int(frames.loc[frames["module"] == GPT2_POISONED, "frame"].iloc[0]) + 1
    callback = NanWatchCallback(max_frames=window)
    _train(tmp_path, tiny_gpt2(), [PoisonAtStep(GPT2_POISONED, 3), callback],
           logging_nan_inf_filter=False)
    report = callback.report()
    batch = callback.event.batch
    assert (f"Last {window} forward frames:\n{' ' * 18}*** Starting batch number={batch} ***\n"
            "abs min  abs max  metadata\n") in report
    assert "metadata\n\n" not in report and report.count("abs min  abs max  metadata") == 1


def test_clean_gpt2_run_trains_to_the_end_and_leaves_no_hooks(tmp_path):
    model = tiny_gpt2()
    callback = NanWatchCallback(log_dir=False)
    trainer = _train(tmp_path, model, [callback], eval_dataset=TokenDataset(8),
                     eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4)
    assert trainer.state.global_step == 6 and callback.stop is None and callback.event is None
    assert hook_count(model) == 0 and callback.watch.closed
    table = callback.batches()
    # One watch batch per forward pass: 6 training micro-batches, 2 evaluation batches after
    # steps 3 and 6 each.
    assert list(table[table.phase == "train"]["step"]) == [1, 2, 3, 4, 5, 6]
    assert list(table[table.phase == "eval"]["step"]) == [3, 3, 6, 6]
    assert list(table["batch"]) == list(range(10))
    assert set(callback.watch.history()["batch"]) == set(range(10))


def test_bert_with_gradient_accumulation_numbers_micro_batches_and_stops_at_step_3(tmp_path):
    model = tiny_bert()
    poison, callback = PoisonAtStep(BERT_POISONED, 3), NanWatchCallback(log_dir=False)
    trainer = _train(tmp_path, model, [poison, callback], dataset=TokenDataset(64, classify=True),
                     gradient_accumulation_steps=2, per_device_train_batch_size=2,
                     logging_nan_inf_filter=False)
    assert trainer.state.global_step == 3 and callback.stop.step == 3
    assert callback.event.module == BERT_POISONED and callback.event.batch == 4
    table = callback.batches()
    assert list(table["step"]) == [1, 1, 2, 2, 3, 3] and list(table["index"]) == [0, 1] * 3
    assert "training step 3, micro-batch 0" in callback.stop.reason
    assert changed_parameters(model, poison.snapshot) == [f"{BERT_POISONED}.weight"]
    assert _optimizer_steps(trainer) == 2 and hook_count(model) == 0


class PairDataset(torch.utils.data.Dataset):
    """Anchor and positive token rows, as a contrastive loss reads them; every positive ends
    with ``positive_last`` (the BAD_TOKEN to make the positives' embedding NaN)."""

    def __init__(self, rows: int = 32, positive_last: int | None = None) -> None:
        generator = torch.Generator().manual_seed(1)
        self.anchors = torch.randint(1, 49, (rows, 8), generator=generator)
        self.positives = torch.randint(1, 49, (rows, 8), generator=generator)
        if positive_last is not None:
            self.positives[:, -1] = positive_last

    def __len__(self) -> int:
        return len(self.anchors)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.anchors[index], "positive_ids": self.positives[index]}


class TwoForwardTrainer(transformers.Trainer):
    """A contrastive compute_loss: the model runs twice per micro-batch (anchors, then
    positives), as sentence-transformers' MultipleNegativesRankingLoss or R-Drop do."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        anchors = model(input_ids=inputs["input_ids"]).logits
        positives = model(input_ids=inputs["positive_ids"]).logits
        scores = anchors @ positives.T
        loss = torch.nn.functional.cross_entropy(scores, torch.arange(len(scores)))
        return (loss, None) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        with torch.no_grad():
            return self.compute_loss(model, inputs).detach(), None, None


BAD_TOKEN = 49


def _train_two_forwards(tmp_path, callback, dataset, eval_dataset=None, **args):
    model = tiny_bert()
    # A faulty embedding path: BAD_TOKEN embeds to NaN (any data-dependent NaN would do).
    model.bert.embeddings.word_embeddings.register_forward_hook(
        lambda module, args, out: out.masked_fill((args[0] == BAD_TOKEN)[..., None], math.nan))
    trainer = TwoForwardTrainer(model=model, args=training_args(
        str(tmp_path / "out"), gradient_accumulation_steps=2, per_device_train_batch_size=2,
        logging_nan_inf_filter=False, remove_unused_columns=False, **args),
        train_dataset=dataset, eval_dataset=eval_dataset, callbacks=[callback])
    trainer.train()
    return trainer


def test_a_compute_loss_calling_the_model_twice_numbers_micro_batches_as_the_trainer_does(tmp_path):
    callback = NanWatchCallback(log_dir=False)
    trainer = _train_two_forwards(tmp_path, callback, PairDataset(), PairDataset(8),
                                  max_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
    trainer_eval = [row for row in trainer.state.log_history if "eval_loss" in row]
    assert callback.stop is None and len(trainer_eval) == 1
    table = callback.batches()
    train, evaluation = table[table.phase == "train"], table[table.phase == "eval"]
    # Two forwards per micro-batch, two micro-batches per optimizer step.
    assert list(train["step"]) == [1, 1, 1, 1, 2, 2, 2, 2]
    assert list(train["index"]) == [0, 0, 1, 1] * 2
    # Evaluation batches likewise: 8 rows, 2 per batch, 2 forwards each.
    assert list(evaluation["index"]) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_nan_in_the_second_forward_of_a_micro_batch_is_named_as_such(tmp_path):
    callback = NanWatchCallback(log_dir=False)
    trainer = _train_two_forwards(tmp_path, callback, PairDataset(positive_last=BAD_TOKEN))
    assert trainer.state.global_step == 1 and callback.stop.step == 1
    event = callback.event
    assert event.batch == 1 and event.module == "bert.embeddings.word_embeddings"
    assert ("in batch 1 (training step 1, micro-batch 0, forward 2 of 2)"
            in callback.stop.reason)
    assert list(callback.batches()["index"]) == [0, 0, 1, 1]


def test_bf16_mixed_precision_stops_before_the_nan_step(tmp_path):
    model = tiny_gpt2()
    poison, callback = PoisonAtStep(GPT2_POISONED, 3), NanWatchCallback(log_dir=False)
    trainer = _train(tmp_path, model, [poison, callback], bf16=True, logging_nan_inf_filter=False)
    assert trainer.state.global_step == 3 and callback.event.module == GPT2_POISONED
    # Under autocast the poisoned Conv1D computes in bfloat16: the frames say so.
    frames = callback.event.frames
    assert "bfloat16" in set(frames[frames.module == GPT2_POISONED]["dtype"])
    assert changed_parameters(model, poison.snapshot) == [f"{GPT2_POISONED}.weight"]


def test_a_nan_met_in_evaluation_stops_training_after_that_evaluation(tmp_path):
    model = tiny_gpt2()
    poison = PoisonAtStep(GPT2_POISONED, 3, when="eval")  # poisoned when step 2 ends
    callback = NanWatchCallback(log_dir=False)
    trainer = _train(tmp_path, model, [poison, callback], eval_dataset=TokenDataset(8),
                     eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    assert trainer.state.global_step == 2
    assert callback.stop.phase == "eval" and callback.stop.step == 2
    assert "evaluation after step 2, batch 0" in callback.stop.reason
    assert hook_count(model) == 0


def test_warns_when_logging_nan_inf_filter_hides_the_nan_loss(tmp_path):
    with pytest.warns(RuntimeWarning, match="logging_nan_inf_filter=True"):
        _train(tmp_path, tiny_gpt2(), [PoisonAtStep(GPT2_POISONED, 3), NanWatchCallback(log_dir=False)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(tmp_path, tiny_gpt2(), [PoisonAtStep(GPT2_POISONED, 3), NanWatchCallback(log_dir=False)],
               logging_nan_inf_filter=False)
    assert not [w for w in caught if "logging_nan_inf_filter" in str(w.message)]


def test_on_nan_raise_raises_out_of_train_with_the_hooks_removed(tmp_path):
    model = tiny_gpt2()
    poison, callback = PoisonAtStep(GPT2_POISONED, 3), NanWatchCallback(on_nan="raise", log_dir=False)
    with pytest.raises(nw.NanDetected) as raised:
        _train(tmp_path, model, [poison, callback])
    assert raised.value.event.module == GPT2_POISONED and callback.stop.step == 3
    assert hook_count(model) == 0
    assert changed_parameters(model, poison.snapshot) == [f"{GPT2_POISONED}.weight"]


def test_on_nan_record_leaves_training_alone(tmp_path):
    model = tiny_gpt2()
    callback = NanWatchCallback(on_nan="record", log_dir=False)
    trainer = _train(tmp_path, model, [PoisonAtStep(GPT2_POISONED, 3), callback],
                     logging_nan_inf_filter=False)
    assert trainer.state.global_step == 6 and callback.stop is None
    assert callback.event.batch == 2 and len(callback.watch.events) >= 4


def test_abort_after_raises_after_that_batch_with_the_hooks_removed(tmp_path):
    model = tiny_gpt2()
    with pytest.raises(nw.AbortAfterBatch):
        _train(tmp_path, model, [NanWatchCallback(abort_after=1, log_dir=False)])
    assert hook_count(model) == 0


def test_a_run_that_raised_leaves_hooks_until_the_next_train_closes_them(tmp_path):
    model = tiny_gpt2()
    callback = NanWatchCallback(log_dir=False)

    class Boom(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path, model, [callback, Boom()])
    assert hook_count(model) > 0  # transformers calls no callback on an exception
    with pytest.warns(RuntimeWarning, match="previous training run left"):
        _train(tmp_path, model, [NanWatchCallback(log_dir=False)], max_steps=1)
    assert hook_count(model) == 0


def _dynamo_state() -> dict:
    """What grows when Dynamo compiles a frame, breaks a graph or recompiles."""
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"].get("unique_graphs", 0),
            "frames": counters["frames"].get("total", 0),
            "breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(counters["recompiles"].values())}


# torch_compile_backend="eager": Dynamo traces, guards and breaks graphs as with inductor, without
# the code generation that would take minutes on 2 cores.
COMPILED = {"torch_compile": True, "torch_compile_backend": "eager",
            "logging_nan_inf_filter": False}


@pytest.fixture(scope="module")
def compiled_baseline(tmp_path_factory):
    """The Dynamo counters that a torch_compile=True run without the callback adds (from cold),
    with the same weight poisoned at step 3; the later runs of the same model code then reuse
    its compiled graphs, so whatever they add, the watch added."""
    before = _dynamo_state()
    model = tiny_gpt2()
    trainer = _train(tmp_path_factory.mktemp("baseline"), model,
                     [PoisonAtStep(GPT2_POISONED, 3)], max_steps=3, **COMPILED)
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    after = _dynamo_state()
    return {key: after[key] - before[key] for key in after}


@pytest.mark.slow
def test_torch_compile_is_watched_in_sentinel_mode_and_stops_at_the_poisoned_step(
        tmp_path, compiled_baseline, caplog):
    assert compiled_baseline["graphs"] > 0  # the baseline run did compile
    model = tiny_gpt2()
    poison, callback = PoisonAtStep(GPT2_POISONED, 3), NanWatchCallback()
    before = _dynamo_state()
    with warnings.catch_warnings(record=True) as caught, \
            caplog.at_level("INFO", logger="nanwidget.integrations"):
        warnings.simplefilter("always")
        trainer = _train(tmp_path, model, [poison, callback], **COMPILED)
    # The watch added no compiled frame, graph, graph break or recompile to the Trainer's own.
    assert _dynamo_state() == before
    assert not [str(w.message) for w in caught]  # no "running eagerly" warning, none at all
    assert any("watching it in sentinel mode" in r.getMessage() for r in caplog.records)
    compiled_model = trainer.model_wrapped
    assert type(compiled_model).__name__ == "OptimizedModule" and compiled_model._orig_mod is model
    watch = callback.watch
    assert (callback.compiled, watch.mode, watch.compiled) == ("wrapper", "sentinel", "wrapper")
    # Stopped at step 3, the module named by the sentinel's eager replay of the failing batch.
    assert trainer.state.global_step == 3 and callback.stop.step == 3
    event = callback.event
    assert (event.batch, event.module, event.origin, event.kind) == (2, GPT2_POISONED, "weight",
                                                                     "nan")
    assert event.trace is not None and event.trace.reproduced
    assert watch.parts.sentinel.replays >= 1 and watch.parts.sentinel.checks == 3
    assert GPT2_POISONED in callback.stop.reason and "training step 3" in callback.stop.reason
    # The stop message says why: the weight broke between steps, not in the forward.
    assert (f"Why (corrupted-weight): '{GPT2_POISONED}.weight' became NaN "
            in callback.stop.summary())
    # No optimizer step used the NaN: only the poisoned weight changed since step 3 began.
    assert changed_parameters(model, poison.snapshot) == [f"{GPT2_POISONED}.weight"]
    assert _optimizer_steps(trainer) == 2
    assert hook_count(compiled_model) == 0 and watch.closed
    # The event in the log history and on disk, readable by load_run.
    assert trainer.state.log_history[-3]["nanwidget_stop"] == callback.stop.summary()
    run_dir = Path(watch.log_dir)
    assert nw.load_run(run_dir).event.module == GPT2_POISONED
    stop = json.loads((run_dir / "stop-rank-00000.json").read_text())
    assert stop["step"] == 3 and GPT2_POISONED in stop["report"]


@pytest.mark.slow
def test_torch_compile_checks_gradient_norms_before_the_optimizer_step(tmp_path, compiled_baseline):
    class PoisonGradient(transformers.TrainerCallback):
        """A NaN written into one gradient just before step 3's optimizer step: only the
        gradient check before the step can see it (the forward and backward were finite)."""

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                self.snapshot = {k: v.detach().clone() for k, v in model.named_parameters()}
                with torch.no_grad():
                    model.lm_head.weight.grad[0, 0] = float("nan")  # tied: wte

    model = tiny_gpt2()
    poison, callback = PoisonGradient(), NanWatchCallback(log_dir=False, backward=True)
    before = _dynamo_state()
    trainer = _train(tmp_path, model, [poison, callback], **COMPILED)
    assert _dynamo_state() == before
    assert callback.watch.mode == "sentinel" and callback.watch.parts.sentinel.grad_checks == 3
    assert trainer.state.global_step == 3 and callback.stop.step == 3 and callback.event is None
    assert "non-finite gradient norm in batch 2 (training step 3, micro-batch 0): 'transformer.wte.weight'" in callback.stop.reason
    assert changed_parameters(model, poison.snapshot) == [] and _optimizer_steps(trainer) == 2


class PromptRowDataset(TokenDataset):
    """Token rows whose row 0 holds token 0 (which no other row holds) and is left out of the
    loss (labels -100, like a masked prompt): a NaN in token 0's embedding makes that row's
    logits NaN while the loss stays finite."""

    def __init__(self, rows: int = 8) -> None:
        super().__init__(rows)
        self.ids = self.ids.clone()
        self.ids[0, 3] = 0
        self.targets = self.ids.clone()
        self.targets[0] = -100

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "attention_mask": torch.ones_like(self.ids[index]),
                "labels": self.targets[index]}


@pytest.mark.slow
def test_torch_compile_evaluation_runs_uncompiled_and_its_nan_logits_stop_training_named(
        tmp_path, compiled_baseline):
    model = tiny_gpt2(tie_word_embeddings=False)  # lm_head is not the poisoned embedding
    poison = PoisonAtStep("transformer.wte", 3, when="eval")  # token 0's row, when step 2 ends
    callback = NanWatchCallback(log_dir=False)
    before = _dynamo_state()
    trainer = _train(tmp_path, model, [poison, callback], eval_dataset=PromptRowDataset(),
                     eval_strategy="steps", eval_steps=1, eval_on_start=True,
                     per_device_eval_batch_size=4, **COMPILED)
    # Evaluated eagerly between compiled steps: the watch added no graph break.
    assert _dynamo_state()["breaks"] == before["breaks"]
    eval_losses = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(eval_losses) == 3 and all(math.isfinite(loss) for loss in eval_losses)
    # The NaN logits of the evaluation after step 2 stopped training, the module named by the
    # eager replay of that evaluation batch.
    assert trainer.state.global_step == 2
    assert callback.stop.phase == "eval" and callback.stop.step == 2
    event = callback.event
    assert (event.batch, event.module, event.origin, event.role) == (6, "transformer.wte",
                                                                     "weight", "weight")
    assert event.trace is not None and event.trace.reproduced
    assert "evaluation after step 2, batch 0" in callback.stop.reason
    # Every forward is a batch: evaluation at the start and after steps 1 and 2, each of 2 batches.
    table = callback.batches()
    assert list(table["batch"]) == list(range(8))
    assert list(zip(table["phase"], table["step"])) == [
        ("eval", 0), ("eval", 0), ("train", 1), ("eval", 1), ("eval", 1), ("train", 2),
        ("eval", 2), ("eval", 2)]
    assert callback.watch.parts.sentinel.checks == 8
    assert hook_count(trainer.model_wrapped) == 0


def _begin_as_trainer(self):
    """Call on_train_begin the way Trainer does: from a frame whose ``self`` is the Trainer
    (the callback finds the compiled model_wrapped there)."""
    return self.callback_handler.on_train_begin(self.args, self.state, self.control)


@pytest.mark.parametrize("evaluated", ["unseen", "watched"])
def test_torch_compile_a_nan_eval_metric_stops_training_only_when_no_eval_batch_was_watched(
        tmp_path, evaluated):
    model = tiny_gpt2()
    callback = NanWatchCallback(log_dir=False)
    trainer = transformers.Trainer(model=model, args=training_args(str(tmp_path / "out")),
                                   train_dataset=TokenDataset(8), callbacks=[callback])
    # As accelerate's prepare() leaves it with torch_compile=True (nothing is compiled here:
    # the wrapper is never called).
    trainer.model_wrapped = torch.compile(model, backend="eager")
    handler, args, state, control = trainer.callback_handler, trainer.args, trainer.state, \
        trainer.control
    _begin_as_trainer(trainer)
    try:
        assert callback.compiled == "wrapper"
        # Open for eval_on_start; closed when a step begins, open again when it ends.
        assert callback.watch.recorder.direct_call_hooks_attached and hook_count(model) == 2
        handler.on_step_begin(args, state, control)
        assert hook_count(model) == 0
        handler.on_step_end(args, state, control)
        assert hook_count(model) == 2
        if evaluated == "watched":
            batch = TokenDataset(4)[0]
            with torch.no_grad():
                model.eval()(**{k: v[None] for k, v in batch.items()})
            handler.on_prediction_step(args, state, control)
        handler.on_evaluate(args, state, control, metrics={"eval_loss": float("nan")})
    finally:
        handler.on_train_end(args, state, control)
    assert hook_count(model) == 0
    if evaluated == "watched":
        # The batch the metric came from was checked and finite: judged as an eager model's
        # evaluation is (a metric of compute_metrics may be NaN on its own).
        assert callback.stop is None and list(callback.batches()["phase"]) == ["eval"]
    else:
        assert callback.stop.phase == "eval" and callback.event is None
        assert ("eval_loss is nan in the evaluation after step 0 (the watch on the compiled model "
                "saw none of its batches") in callback.stop.reason


def test_a_model_given_to_the_trainer_compiled_is_watched_in_sentinel_mode(tmp_path):
    compiled_model = torch.compile(tiny_gpt2(), backend="eager")
    callback = NanWatchCallback(log_dir=False)
    # Only the attaching is under test: the callback as a Trainer calls it, without training.
    args = training_args(str(tmp_path / "out"))
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.on_train_begin(args, state, control, model=compiled_model)
    try:
        assert (callback.compiled, callback.watch.mode) == ("wrapper", "sentinel")
        assert callback.watch.model is compiled_model._orig_mod
    finally:
        callback.on_train_end(args, state, control)
    assert hook_count(compiled_model) == 0
    with pytest.raises(ValueError, match="mode='full' cannot watch a torch.compile'd model"):
        NanWatchCallback(log_dir=False, mode="full").on_train_begin(args, state, control,
                                                                    model=compiled_model)


def test_bad_options_are_refused_when_the_callback_is_made():
    with pytest.raises(ValueError, match="on_nan must be one of stop, raise, warn, record"):
        NanWatchCallback(on_nan="explode")
    with pytest.raises(TypeError, match="unknown nw.watch option.*'max_frame'"):
        NanWatchCallback(max_frame=3)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_ddp_under_torchrun_stops_both_ranks_at_step_3(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), str(REPO / "tests" / "scripts" / "trainer_nan.py"),
               "--out", str(tmp_path / "out"), "--poison-rank", "0", "--poison-step", "3",
               "--accumulation", "2"]
    finished = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=240)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    decoder = json.JSONDecoder()
    results = {r["rank"]: r for r in (decoder.raw_decode(chunk)[0]
                                      for chunk in finished.stdout.split("RESULT ")[1:])}
    assert sorted(results) == [0, 1] and results[0]["world"] == 2
    for rank in (0, 1):
        result = results[rank]
        assert result["global_step"] == 3 and result["stop_step"] == 3
        assert result["optimizer_steps"] == 2 and result["hooks"] == 0
        assert GPT2_POISONED in result["reason"] and result["found_on"][0] == 0
    # Rank 0 found the poisoned weight; rank 1 saw only the NaN gradients DDP averaged in.
    assert (results[0]["event_module"], results[0]["event_origin"]) == (GPT2_POISONED, "weight")
    assert results[0]["changed"] == [f"{GPT2_POISONED}.weight"] and results[1]["changed"] == []
    run = nw.load_run(results[0]["log_dir"])
    assert run.ranks == [0, 1] and run.event.module == GPT2_POISONED
    assert (Path(results[0]["log_dir"]) / "stop-rank-00001.json").is_file()


def test_fp16_gradient_overflows_the_accelerators_scaler_skips_do_not_stop_training(tmp_path):
    # accelerate does no float16 loss scaling on CPU: the Trainer's accelerator is given the
    # GradScaler (and autocast) it makes on a GPU. The scale starts at 2**24 and overflows.
    model = tiny_gpt2()
    callback = NanWatchCallback(log_dir=False, backward=True)
    trainer = transformers.Trainer(model=model, args=training_args(str(tmp_path / "out"),
                                                                   max_steps=6, fp16=True),
                                   train_dataset=TokenDataset(32), callbacks=[callback])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    trainer.accelerator.scaler, trainer.accelerator.native_amp = scaler, True
    trainer.train()
    assert callback.stop is None and trainer.state.global_step == 6
    assert callback.watch.grad_scaler is scaler  # found by the callback
    skips = callback.watch.scaler_skips
    assert skips and [s.batch for s in skips] == list(range(len(skips)))
    assert skips[-1].scale_after == scaler.get_scale() < 2.0 ** 24
    assert not callback.watch.events and hook_count(model) == 0


class GrowWeight(transformers.TrainerCallback):
    """Multiplies a module's weight by ``factor`` when each optimizer step begins: its output
    grows geometrically, as under a learning rate that is too high."""

    def __init__(self, module: str, factor: float = 10.0) -> None:
        self.module, self.factor = module, factor

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            dict(model.named_modules())[self.module].weight.mul_(self.factor)


class SeenLogs(transformers.TrainerCallback):
    """What a ``report_to`` integration receives: it sits before the user's callbacks."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_early_warnings_reach_what_report_to_integrations_see(tmp_path):
    grown = "transformer.h.1.mlp.c_proj"
    seen, callback = SeenLogs(), NanWatchCallback(log_dir=False)
    with pytest.warns(nw.EarlyWarningIssued, match=grown):
        trainer = _train(tmp_path, tiny_gpt2(), [seen, GrowWeight(grown), callback])
    assert trainer.state.global_step == 6 and callback.stop is None  # a warning never stops
    warning = callback.watch.warnings[0]
    assert (warning.module, warning.reason) == (grown, "growth")
    key = f"nanwidget/early_warning/{grown}/growth"
    logged = [logs for logs in seen.logs if key in logs]
    assert len(logged) == 1 and logged[0][key] == pytest.approx(warning.abs_max)
    assert logged[0]["nanwidget/early_warnings"] == len(callback.watch.warnings)
    texts = [e["nanwidget_early_warning"] for e in trainer.state.log_history
             if "nanwidget_early_warning" in e]
    assert texts == [str(w) for w in callback.watch.warnings]


def test_early_warning_false_logs_none(tmp_path):
    seen, callback = SeenLogs(), NanWatchCallback(log_dir=False, early_warning=False)
    _train(tmp_path, tiny_gpt2(), [seen, GrowWeight("transformer.h.1.mlp.c_proj"), callback])
    assert callback.watch.warnings == []
    assert not any(key.startswith("nanwidget") for logs in seen.logs for key in logs)


class SampleInStepTrainer(transformers.Trainer):
    """Generation inside the training step, as TRL's GRPO, RLOO and online DPO run it: the
    step samples from the model's logits first, and torch.multinomial raises on NaN ones."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        with torch.no_grad():
            logits = model(input_ids=inputs["input_ids"]).logits[:, -1]
            torch.multinomial(logits.softmax(-1), 1)
        return super().training_step(model, inputs, num_items_in_batch)


def test_an_error_the_nan_causes_inside_the_step_first_says_what_the_watch_found(tmp_path, caplog):
    model = tiny_gpt2()
    callback = NanWatchCallback(log_dir=False)
    trainer = SampleInStepTrainer(model=model, args=training_args(str(tmp_path / "out")),
                                  train_dataset=TokenDataset(32),
                                  callbacks=[PoisonAtStep(GPT2_POISONED, 2), callback])
    with caplog.at_level("WARNING", logger="nanwidget.integrations"), \
            pytest.raises(RuntimeError, match="probability tensor contains"):
        trainer.train()  # the user's own error, unchanged
    said = [r.getMessage() for r in caplog.records if "training ended with" in r.getMessage()]
    assert len(said) == 1 and "RuntimeError" in said[0]
    assert GPT2_POISONED in said[0] and "corrupted-weight" in said[0]
    assert "(training step 2, micro-batch 0)" in said[0]
    assert callback.event.module == GPT2_POISONED and callback.stop is None
    assert "training_step" not in vars(trainer)  # the wrapper came off with the error


def test_a_clean_run_leaves_the_trainers_training_step_as_it_was(tmp_path):
    model = tiny_gpt2()
    trainer = SampleInStepTrainer(model=model, args=training_args(str(tmp_path / "out"), max_steps=2),
                                  train_dataset=TokenDataset(32), callbacks=[NanWatchCallback(log_dir=False)])
    trainer.train()
    assert "training_step" not in vars(trainer) and hook_count(model) == 0


class RegressionRows(torch.utils.data.Dataset):
    """8 features and a target per row (seeded); ``inf_at``: a row whose target is inf."""

    def __init__(self, rows: int = 256, inf_at: int | None = None) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(rows, 8, generator=generator) * 3
        self.y = torch.randn(rows, 1, generator=generator) * 3
        if inf_at is not None:
            self.y[inf_at] = math.inf

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict:
        return {"x": self.x[index], "labels": self.y[index]}


class LinearRegression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))

    def forward(self, x, labels=None):
        return {"logits": self.net(x)}


def _mse(outputs, labels, num_items_in_batch=None):
    return torch.nn.functional.mse_loss(outputs["logits"], labels)


def _train_regression(tmp_path, dataset, learning_rate):
    torch.manual_seed(0)
    callback = NanWatchCallback(log_dir=False)
    trainer = transformers.Trainer(
        model=LinearRegression(), callbacks=[callback], train_dataset=dataset,
        compute_loss_func=_mse,                 # the loss is made by the Trainer, past the model
        args=training_args(str(tmp_path / "out"), max_steps=32, per_device_train_batch_size=8,
                           optim="sgd", learning_rate=learning_rate, max_grad_norm=0.0,
                           lr_scheduler_type="constant", logging_nan_inf_filter=False))
    trainer.train()
    assert callback.stop is not None and callback.event is None and callback.watch.events == []
    assert callback.stop.reason.startswith("inf loss in batch ")
    return callback.stop.diagnosis


def test_a_loss_that_overflows_as_the_weights_climb_stops_with_a_divergence(tmp_path):
    # The stop said only that the Trainer's compute_loss made the inf (no diagnosis), while
    # SGD had driven the weights up 1e12x: the MSE of outputs near 1e24 overflowed.
    diagnosis = _train_regression(tmp_path, RegressionRows(), learning_rate=0.1)
    assert diagnosis is not None and diagnosis.kind == "divergence"
    assert "until the loss computed from the model's outputs became inf at batch 4" \
        in diagnosis.summary                    # training step 5: the Trainer shuffles the rows
    assert any(line.startswith("The loss of batch 4 was inf, while the model's outputs it was "
                               "computed from were finite") for line in diagnosis.evidence)
    assert diagnosis.suggestion[0].startswith("Lower the learning rate (try 10x lower: "
                                              "TrainingArguments(learning_rate=")


def test_an_inf_target_with_steady_weights_is_a_loss_not_a_divergence(tmp_path):
    diagnosis = _train_regression(tmp_path, RegressionRows(inf_at=5 * 8 + 2), learning_rate=0.01)
    assert diagnosis is not None and diagnosis.kind == "loss"
    assert any(line.startswith("The weights did not climb over the batches before")
               for line in diagnosis.evidence)


def test_an_inf_label_is_named_by_its_row_first_and_loss_fn_in_the_callbacks_words(tmp_path):
    # The fixes led with "watch with loss_fn=" (not the callback's keyword) and gave the
    # log-probability fixes (BCEWithLogitsLoss, log_softmax) to an MSE regression; the
    # targets came last. The callback holds the micro-batch's labels: their Inf row leads.
    diagnosis = _train_regression(tmp_path, RegressionRows(inf_at=5 * 8 + 2), learning_rate=0.01)
    assert diagnosis.kind == "loss" and diagnosis.confidence == "high" and len(diagnosis.rows) == 1
    row = diagnosis.rows[0]
    assert diagnosis.summary.endswith(f"Its targets held an Inf in row {row}.")
    assert diagnosis.suggestion[0].startswith(f"Fix the targets: they held an Inf in row {row}")
    assert diagnosis.suggestion[1].startswith(
        "Name the loss's op and line: give the callback the loss as a function of the model's "
        "output, callbacks=[NanWatchCallback(loss_fn=lambda outputs: ...)] (from "
        "nanwidget.integrations.transformers): it returns the loss your compute_loss_func")
    said = " ".join(diagnosis.suggestion)
    assert "watch with loss_fn" not in said
    assert not any(fix in said for fix in ("BCEWithLogits", "log_softmax", "Clamp probabilities"))

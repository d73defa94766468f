"""Tiny transformers Trainer runs with a weight poisoned at a chosen step (tests and torchrun).

Under torchrun each rank prints one ``RESULT {json}`` line::

    torchrun --nproc_per_node 2 tests/scripts/trainer_nan.py --out DIR --poison-rank 0 --poison-step 3

The models are built from configs with random weights (no download): GPT-2 and BERT.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from results import close_process_group_and_exit, emit  # noqa: E402

GPT2_POISONED = "transformer.h.0.mlp.c_fc"
BERT_POISONED = "bert.encoder.layer.0.intermediate.dense"


def tiny_gpt2(tie_word_embeddings: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                     tie_word_embeddings=tie_word_embeddings)
    return transformers.GPT2LMHeadModel(config)


def tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=16, num_labels=2)
    return transformers.BertForSequenceClassification(config)


class TokenDataset(torch.utils.data.Dataset):
    """Random token rows; language-model labels (GPT-2) or a class label (BERT)."""

    def __init__(self, rows: int = 32, length: int = 8, classify: bool = False) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 50, (rows, length), generator=generator)
        self.labels = torch.randint(0, 2, (rows,), generator=generator)
        self.classify = classify

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        item = {"input_ids": self.ids[index], "attention_mask": torch.ones_like(self.ids[index])}
        item["labels"] = self.labels[index] if self.classify else self.ids[index]
        return item


def module_named(model: torch.nn.Module, name: str) -> torch.nn.Module:
    return dict(model.named_modules())[name]


class PoisonAtStep(TrainerCallback):
    """Writes a NaN into ``module``'s weight when optimizer step ``step`` (from 1) begins.

    Keeps a copy of every parameter taken just before, so a test can tell whether any optimizer
    step ran afterwards. ``when="eval"`` poisons at the end of step ``step - 1`` instead, so
    that the evaluation run right after it meets the NaN first.
    """

    def __init__(self, module: str, step: int, rank: int | None = None, when: str = "train") -> None:
        self.module, self.step, self.rank, self.when = module, step, rank, when
        self.snapshot: dict[str, torch.Tensor] | None = None

    def _poison(self, model: torch.nn.Module) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.snapshot = {k: v.detach().clone() for k, v in model.named_parameters()}
        if self.rank is None or rank == self.rank:
            with torch.no_grad():
                module_named(model, self.module).weight[0, 0] = float("nan")

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.when == "train" and state.global_step == self.step - 1 and self.snapshot is None:
            self._poison(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.when == "eval" and state.global_step == self.step - 1 and self.snapshot is None:
            self._poison(model)


def changed_parameters(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> list[str]:
    """Parameters that differ from the snapshot (NaN compares equal to NaN)."""
    changed = []
    for name, value in model.named_parameters():
        before = snapshot[name]
        same = torch.equal(torch.isnan(value), torch.isnan(before)) and torch.equal(
            torch.nan_to_num(value, nan=0.0), torch.nan_to_num(before, nan=0.0))
        if not same:
            changed.append(name)
    return changed


def training_args(out: str, **overrides) -> transformers.TrainingArguments:
    options = dict(output_dir=out, max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3,
                   report_to=[], logging_steps=1, save_strategy="no", use_cpu=True,
                   disable_tqdm=True, seed=0, dataloader_num_workers=0)
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(getattr(m, "_backward_pre_hooks", {})) for m in model.modules())


def main() -> None:
    from nanwidget.integrations.transformers import NanWatchCallback

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", choices=["gpt2", "bert"], default="gpt2")
    parser.add_argument("--poison-rank", type=int, default=0)
    parser.add_argument("--poison-step", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=1)
    options = parser.parse_args()

    model = tiny_gpt2() if options.model == "gpt2" else tiny_bert()
    poisoned = GPT2_POISONED if options.model == "gpt2" else BERT_POISONED
    poison = PoisonAtStep(poisoned, options.poison_step, rank=options.poison_rank)
    callback = NanWatchCallback()
    args = training_args(options.out, gradient_accumulation_steps=options.accumulation,
                         ddp_backend="gloo")
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=TokenDataset(64, classify=options.model == "bert"),
                                   callbacks=[poison, callback])
    trainer.train()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    stop = callback.stop
    result = {
        "rank": rank, "world": int(os.environ.get("WORLD_SIZE", "1")),
        "global_step": trainer.state.global_step,
        "stop_step": stop.step if stop else None, "found_on": stop.found_on if stop else None,
        "reason": stop.reason if stop else None,
        "event_module": callback.event.module if callback.event else None,
        "event_origin": callback.event.origin if callback.event else None,
        "changed": changed_parameters(model, poison.snapshot) if poison.snapshot else None,
        "hooks": hook_count(model), "log_dir": str(callback.watch.log_dir),
        "optimizer_steps": max((int(s["step"]) for s in trainer.optimizer.state.values()
                                if "step" in s), default=0),
    }
    emit(result)


if __name__ == "__main__":
    main()
    close_process_group_and_exit()

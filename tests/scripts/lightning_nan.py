"""A tiny LightningModule with a weight poisoned at a chosen step (tests, and a 2-process DDP run).

    python tests/scripts/lightning_nan.py --out DIR --devices 2   # Lightning starts the 2nd process

Each process prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn

import lightning.pytorch as pl

from results import close_process_group_and_exit, emit

POISONED = "net.2"


class TinyRegressor(pl.LightningModule):
    """8 -> 16 -> 1 MLP; ``nan_loss_at`` makes training_step return log(-1) at that step."""

    def __init__(self, nan_loss_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.nan_loss_at = nan_loss_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.nan_loss_at is not None and self.trainer.global_step == self.nan_loss_at - 1:
            loss = loss * torch.log(torch.tensor(-1.0))  # NaN made outside any module
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def loader(rows: int = 64, batch_size: int = 8) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(rows, 8, generator=generator),
                                          torch.randn(rows, 1, generator=generator))
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


class PoisonAtStep(pl.Callback):
    """NaN into ``module``'s weight when optimizer step ``step`` (from 1) begins, on ``rank``."""

    def __init__(self, step: int, module: str = POISONED, rank: int | None = None) -> None:
        self.step, self.module, self.rank = step, module, rank
        self.snapshot: dict[str, torch.Tensor] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step - 1 and self.snapshot is None:
            self.snapshot = {k: v.detach().clone() for k, v in pl_module.named_parameters()}
            if self.rank is None or trainer.global_rank == self.rank:
                with torch.no_grad():
                    dict(pl_module.named_modules())[self.module].weight[0, 0] = float("nan")


def changed_parameters(model: nn.Module, snapshot: dict[str, torch.Tensor]) -> list[str]:
    changed = []
    for name, value in model.named_parameters():
        before = snapshot[name]
        if not (torch.equal(torch.isnan(value), torch.isnan(before))
                and torch.equal(torch.nan_to_num(value), torch.nan_to_num(before))):
            changed.append(name)
    return changed


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(getattr(m, "_backward_pre_hooks", {})) for m in model.modules())


def trainer(root: str, callbacks: list, **options) -> pl.Trainer:
    settings = dict(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, default_root_dir=root, num_sanity_val_steps=0)
    settings.update(options)
    return pl.Trainer(callbacks=callbacks, **settings)


def main() -> None:
    from nanwidget.integrations.lightning import NanWatchCallback

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--poison-rank", type=int, default=1)
    parser.add_argument("--poison-step", type=int, default=3)
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = TinyRegressor()
    poison = PoisonAtStep(options.poison_step, rank=options.poison_rank)
    callback = NanWatchCallback()
    fit = trainer(options.out, [poison, callback], devices=options.devices, strategy="ddp",
                  max_epochs=2)
    fit.fit(model, loader(), loader(16))
    stop = callback.stop
    result = {
        "rank": fit.global_rank, "world": fit.world_size, "global_step": fit.global_step,
        "stop_step": stop.step if stop else None, "phase": stop.phase if stop else None,
        "found_on": stop.found_on if stop else None, "reason": stop.reason if stop else None,
        "event_module": callback.event.module if callback.event else None,
        "changed": changed_parameters(model, poison.snapshot) if poison.snapshot else None,
        "hooks": hook_count(model), "log_dir": str(callback.watch.log_dir),
        "exchanges": callback._guard.exchanges,
    }
    emit(result)


if __name__ == "__main__":
    main()
    close_process_group_and_exit()

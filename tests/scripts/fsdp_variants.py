"""FSDP2 variants under torchrun (2 ranks, gloo): a MixedPrecisionPolicy (bfloat16 parameters,
float32 reductions), reshard_after_forward=False, activation checkpointing inside the blocks.
Each trains 3 steps without a watch and under each watch (results must be bit-identical, with
no event and no warning), then with rank 1's gradient shard of the first layer NaN at step 1
(the optimizer writes NaN into its shard; the next forward gathers it on every rank). Prints
one ``RESULT {json}`` line per variant, watch and scenario."""

from __future__ import annotations

import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

import nanwidget as nw

sys.path.insert(0, os.path.dirname(__file__))
from results import close_process_group_and_exit, emit  # noqa: E402

WATCHES = {"none": None, "full": {}, "sentinel": {"mode": "sentinel"},
           "sentinel-backward": {"mode": "sentinel", "backward": True}}
WRONG = ("No optimizer step wrote", "before the watch began", "no optimizer step in between",
         "has not moved")


class Block(nn.Module):
    def __init__(self, width: int, recompute: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()
        self.recompute = recompute

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Net(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(16, recompute) for _ in range(2)])
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(variant: str) -> nn.Module:
    torch.manual_seed(0)
    model = Net(recompute=variant == "checkpoint")
    options: dict = {}
    if variant == "mixed-precision":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    if variant == "no-reshard":
        options["reshard_after_forward"] = False
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def train(variant: str, watch: str, bad_grad: bool) -> dict:
    rank = dist.get_rank()
    model = build(variant)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + rank)
    result: dict = {"rank": rank, "variant": variant, "watch": watch, "bad_grad": bad_grad,
                    "losses": [], "error": ""}
    options = WATCHES[watch]
    w = None if options is None else nw.watch(model, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(3):
                x, y = torch.randn(8, 8, generator=data), torch.randn(8, 2, generator=data)
                loss = nn.functional.mse_loss(model(x).float(), y)
                optimizer.zero_grad()
                loss.backward()
                if bad_grad and step == 1 and rank == 1:
                    model.inp.weight.grad.to_local()[0, 0] = float("nan")
                optimizer.step()
                result["losses"].append(loss.item().hex())
        except nw.NanDetected as error:
            result["stopped"] = step
            event = error.event
            diagnosis = event.diagnosis
            result["event"] = [event.batch, event.module, event.role, event.origin]
            result["kind"] = diagnosis.kind if diagnosis else None
            told = " ".join([diagnosis.summary, *diagnosis.evidence, *diagnosis.suggestion]) \
                if diagnosis else ""
            result["summary"] = diagnosis.summary if diagnosis else ""
            result["wrong"] = [phrase for phrase in WRONG if phrase in told]
        except Exception as error:  # noqa: BLE001 - reported to the test
            result["error"] = f"{type(error).__name__}: {error}"
        if w is not None:
            result["events"] = len(w.events)
            result["early"] = len(w.warnings)
            w.close()
    result["warnings"] = [str(c.message) for c in caught if "nanwidget" in str(c.message)]
    if "stopped" not in result:
        with torch.no_grad():
            result["weights"] = [p.full_tensor().sum().item().hex() for p in model.parameters()]
    return result


def main() -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    for variant in ("mixed-precision", "no-reshard", "checkpoint"):
        for watch in WATCHES:
            emit(train(variant, watch, bad_grad=False))
        for watch in ("full", "sentinel"):
            emit(train(variant, watch, bad_grad=True))
    dist.barrier()
    return 0


if __name__ == "__main__":
    main()
    close_process_group_and_exit()

"""Two ranks under torchrun (gloo), DDP, ``backward=True`` in full and sentinel mode: rank 1's
batch 2 holds a zero row that ``x * sqrt(mean(x²))`` turns into a NaN gradient (its forward
stays finite). Both ranks raise NanDetected out of ``loss.backward()``; the loop skips the batch
and trains on. The sentinel's end-of-backward check ran before DDP's own final callback, so its
raise left DDP's reducer mid-pass and the next backward failed inside it. Each rank prints one
``RESULT {json}`` line per mode. Used by tests/test_distributed.py.
"""

import datetime

import torch
import torch.distributed as dist
from torch import nn

import nanwidget as nw
from results import close_process_group_and_exit, emit


class RootMeanSquareScale(nn.Module):
    """x * sqrt(mean(x²)): a row of zeros has a NaN gradient, a finite output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sqrt((x * x).mean(-1, keepdim=True))


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    for mode in ("full", "sentinel"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8, bias=False), RootMeanSquareScale(), nn.Linear(8, 4))
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        data = torch.Generator().manual_seed(rank)
        skipped, error = [], ""
        with nw.watch(ddp, mode=mode, backward=True) as watch:
            for batch in range(5):
                x = torch.randn(4, 8, generator=data)
                if batch == 2 and rank == 1:
                    x[0] = 0.0
                try:
                    loss = ddp(x).square().mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                except nw.NanDetected:
                    optimizer.zero_grad()  # skip the bad batch, train on
                    skipped.append(batch)
                except RuntimeError as failure:
                    error = str(failure)[:200]
                    break
            events = [(e.rank, e.batch, e.origin) for e in watch.events]
        emit({"rank": rank, "mode": mode, "skipped": skipped, "error": error, "events": events})
        del ddp, model, optimizer
        if error:
            break


if __name__ == "__main__":
    main()
    close_process_group_and_exit()

"""2-rank DDP under a sentinel watch with backward=True: rank 1's loss makes a NaN gradient in
backward at batch 2 (sqrt at 0); rank 0's own gradients stay finite and DDP's all-reduce
averages the NaN into its .grad. Each rank prints one ``RESULT {json}`` line."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import nanwidget as nw

sys.path.insert(0, os.path.dirname(__file__))
from results import close_process_group_and_exit, emit  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    result: dict = {"rank": rank}
    with nw.watch(ddp, mode="sentinel", backward=True) as watch:
        try:
            for step in range(4):
                output = ddp(torch.randn(8, 8, generator=data))
                loss = output.pow(2).mean()
                if rank == 1 and step == 2:
                    loss = loss + torch.sqrt(output * 0).sum() * 0  # finite, NaN gradient
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        except nw.NanDetected as error:
            event = error.event
            result.update(stopped=step, event=[event.batch, event.module, event.role,
                                               event.origin, event.peer_rank],
                          kind=event.diagnosis.kind if event.diagnosis else None,
                          recorded=[(e.rank, e.origin) for e in watch.events],
                          message=str(error))
    emit(result)
    del ddp, model


if __name__ == "__main__":
    main()
    close_process_group_and_exit()

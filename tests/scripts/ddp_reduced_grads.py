"""Two ranks under torchrun (gloo), DDP, ``backward=True``, ``on_nan="record"`` (no consensus):
rank 1's batch 2 holds a NaN, and DDP's all-reduce averages it into every rank's ``.grad``.
Rank 0's backward frames of batch 2 must hold the ``.grad`` the optimizer uses (they held its
own gradient, measured before the all-reduce: finite), and its event must say the NaN came from
another rank. Each rank prints one ``RESULT {json}`` line. Used by tests/test_distributed.py.
"""

import datetime

import torch
import torch.distributed as dist
from torch import nn

import nanwidget as nw
from results import close_process_group_and_exit, emit


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)
    result: dict = {"rank": rank}
    with nw.watch(ddp, backward=True, on_nan="record", max_frames=200) as watch:
        for batch in range(3):
            x, y = torch.randn(6, 8, generator=data), torch.randn(6, 4, generator=data)
            if rank == 1 and batch == 2:
                x[4, 1] = float("nan")
            loss = nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            if batch == 2:
                result["grad_nan"] = {name: bool(p.grad.isnan().any())
                                      for name, p in model.named_parameters()}
                frames = watch.frames()
                grads = frames[(frames["batch"] == 2) & (frames["phase"] == "backward")
                               & frames["role"].isin(["weight", "bias"])]
                result["frame_nan"] = {f"{m}.{r}": bool(n) for m, r, n in
                                       zip(grads["module"], grads["role"], grads["nan"])}
            optimizer.step()
        first = watch.events[0]
        result["event"] = [first.batch, first.origin, first.diagnosis.summary]
    emit(result)
    del ddp, model, optimizer


if __name__ == "__main__":
    main()
    close_process_group_and_exit()

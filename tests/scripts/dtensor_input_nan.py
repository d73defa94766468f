"""Two ranks under torchrun (gloo): the model's input is a DTensor sharded by rows (as sequence
or tensor parallelism passes it), and rank 1's shard holds a NaN in batch ``NAN_BATCH``.

Only rank 1 has the event (``on_nan="record"``: no consensus exchange either), so whatever its
diagnosis reads must stay on rank 1: rank 0 waits (through the store, no collective) until rank 1
is done, so a collective would hang until the group's timeout. Reading the DTensor itself also
fails outright (its sharding rules refuse ``nonzero``), which left the diagnosis "unknown". Each rank prints one ``RESULT {json}`` line. Used by tests/test_distributed.py.
"""

import datetime
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import nanwidget as nw
from results import emit

NAN_BATCH = 2


class RowwiseNet(nn.Module):
    """Works on this rank's rows of a row-sharded DTensor input (no collective in its forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x: DTensor) -> torch.Tensor:
        return self.fc(x.to_local())


def main() -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = RowwiseNet()
    data = torch.Generator().manual_seed(100 + rank)
    store = dist.distributed_c10d._get_default_store()
    started = time.monotonic()
    with nw.watch(model, on_nan="record") as watch:
        for batch in range(4):
            rows = torch.randn(3, 6, generator=data)
            if rank == 1 and batch == NAN_BATCH:
                rows[1, 2] = float("nan")
            x = DTensor.from_local(rows, mesh, [Shard(0)], run_check=False)
            model(x).sum().backward()
    result: dict = {"rank": rank, "seconds": round(time.monotonic() - started, 1),
                    "events": [(e.rank, e.batch, e.module, e.origin) for e in watch.events]}
    if watch.events:
        diagnosis = watch.events[0].diagnosis
        result.update(diagnosis=diagnosis.kind, rows=list(diagnosis.rows),
                      evidence=list(diagnosis.evidence))
    if rank == 1:
        store.set("rank 1 done", "1")
    else:
        store.wait(["rank 1 done"])
    emit(result)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

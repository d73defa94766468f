"""Two ranks under torchrun (gloo): a model made tensor parallel with ``parallelize_module``
(``fc1`` ColwiseParallel, ``fc2`` RowwiseParallel: DTensor weights, an all-reduce inside
``fc2``'s forward), and a NaN that only rank 1 sees: before batch ``NAN_BATCH`` rank 1 zeroes its
copy of ``head`` (a plain layer after the all-reduce), so ``norm`` divides 0/0 there alone.

The same scenarios run again (``hand-`` names) on a tensor-parallel model written by hand, the
way Megatron-style layers are: plain tensors, each rank its shard of ``fc2``'s weight, and a
``dist.all_reduce`` of the partial sums inside ``fc2``'s forward (no DTensor to see beforehand).
``solo-full`` runs that model with the all-reduce over a group of this rank alone: no rank waits
for another, so its replay is made.

Each scenario (a watch option set, see ``SCENARIOS``) watches a fresh model with
``on_nan="record"`` (no consensus exchange). A replay of the batch on rank 1 alone would run the
forward's all-reduce with no partner: it takes rank 0's next batch's values, then waits until the
group's timeout (``--timeout``). Between scenarios the ranks meet through the store (no
collective). Scenario ``measure`` (no NaN) compares what the watch measured of a RowwiseParallel
output, whose all-reduce may still run when the hooks see it, with the finished output. Each rank
prints one ``RESULT {json}`` line per scenario. Used by tests/test_distributed.py.
"""

import argparse
import datetime
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import nanwidget as nw
from results import emit

NAN_BATCH = 2


class Normalize(nn.Module):
    """Scales each row to unit length: a row of zeros comes out 0/0 = NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)


class TensorParallelNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 6)
        self.head = nn.Linear(6, 2)
        self.norm = Normalize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.head(torch.relu(self.fc2(torch.relu(self.fc1(x))))))


class _SumOverRanks(torch.autograd.Function):
    """A row-parallel layer's all-reduce of its partial sums; its backward passes the gradient
    on (Megatron's reduce-from-tensor-parallel region)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class RowParallelLinear(nn.Module):
    """``nn.Linear(8, 6)`` split by input features over the ranks of ``group``: each holds its
    columns of the weight as a plain tensor and sums its partial products with the others'."""

    def __init__(self, group) -> None:
        super().__init__()
        full = nn.Linear(8, 6)  # the same seeded layer on every rank
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        width = 8 // ranks
        self.columns = slice(rank * width, (rank + 1) * width)
        self.weight = nn.Parameter(full.weight[:, self.columns].detach().clone())
        self.bias = nn.Parameter(full.bias.detach().clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = x[:, self.columns] @ self.weight.t()
        return _SumOverRanks.apply(partial, self.group) + self.bias


class HandParallelNet(TensorParallelNet):
    def __init__(self, group) -> None:
        super().__init__()
        self.fc2 = RowParallelLinear(group)


SCENARIOS = {  # name: the watch's options
    "full": dict(),
    "full-replay": dict(replay_on_nan=True),
    "sentinel": dict(mode="sentinel"),
    "sentinel-backward": dict(mode="sentinel", backward=True),
}


def build_model(name: str, mesh, own_group):
    """The scenario's model: ``name``'s prefix says which (see the module's docstring)."""
    torch.manual_seed(0)
    if name.startswith("hand-"):
        return HandParallelNet(dist.group.WORLD)
    if name.startswith("solo-"):
        return HandParallelNet(own_group)
    return parallelize_module(TensorParallelNet(), mesh,
                              {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def run_scenario(name: str, rank: int, mesh, store, own_group) -> dict:
    options = SCENARIOS[name.split("-", 1)[1] if name.startswith(("hand-", "solo-")) else name]
    model = build_model(name, mesh, own_group)
    data = torch.Generator().manual_seed(100)  # the same batches on every rank (replicated input)
    started = time.monotonic()
    error = ""
    with warnings.catch_warnings(record=True) as caught, \
            nw.watch(model, on_nan="record", **options) as watch:
        warnings.simplefilter("always")
        try:
            for batch in range(4):
                x = torch.randn(5, 6, generator=data)
                if rank == 1 and batch == NAN_BATCH:
                    with torch.no_grad():  # finite: norm makes the NaN, on rank 1 alone
                        model.head.weight.zero_()
                        model.head.bias.zero_()
                model(x).sum().backward()
        except Exception as failure:  # a collective that timed out
            error = f"{type(failure).__name__}: {failure}"[:300]
    result = {"scenario": name, "rank": rank, "seconds": round(time.monotonic() - started, 1),
              "error": error,
              "warnings": [str(w.message) for w in caught
                           if str(w.message).startswith("nanwidget")],
              "events": [(e.batch, e.module, e.role, e.origin) for e in watch.events],
              "notes": [e.note for e in watch.events],
              "traced": [e.trace is not None for e in watch.events],
              "diagnosis": [e.diagnosis.kind if e.diagnosis else None for e in watch.events],
              "summary": [e.diagnosis.summary if e.diagnosis else None for e in watch.events],
              "evidence": [list(e.diagnosis.evidence) if e.diagnosis else None
                           for e in watch.events],
              "suggestion": [list(e.diagnosis.suggestion) if e.diagnosis else None
                             for e in watch.events]}
    # The ranks start the next scenario together (through the store: no collective).
    store.set(f"{name} {rank}", "done")
    store.wait([f"{name} {other}" for other in (0, 1)])
    return result


def measure_scenario(rank: int, mesh) -> dict:
    """No NaN: what the watch measured of a RowwiseParallel layer's output (the result of an
    all-reduce still running when the hooks see it) against that output once it is complete."""
    torch.manual_seed(0)
    model = parallelize_module(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 1024)), mesh,
                               {"0": ColwiseParallel(), "1": RowwiseParallel()})
    data = torch.Generator().manual_seed(200)
    actual = []
    with torch.no_grad(), nw.watch(model, on_nan="record", max_frames=100) as watch:
        for _ in range(16):
            actual.append(model(torch.randn(64, 256, generator=data)).abs().max().item())
    frames = watch.frames()
    measured = frames[(frames.module == "1") & (frames.role == "output")].abs_max
    return {"scenario": "measure", "rank": rank, "measured": [float(v) for v in measured],
            "actual": actual}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="*",
                        help=f"of {', '.join(SCENARIOS)}, each also with hand-, solo-full, measure (default: all)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds before a collective counts as hung (default 10)")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    store = dist.distributed_c10d._get_default_store()
    # every rank makes every group: each rank's own group is the one it keeps
    own_group = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    everything = [*SCENARIOS, *(f"hand-{name}" for name in SCENARIOS), "solo-full", "measure"]
    for name in args.scenarios or everything:
        result = (measure_scenario(rank, mesh) if name == "measure"
                  else run_scenario(name, rank, mesh, store, own_group))
        emit(result)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

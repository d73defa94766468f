"""Cost of the DDP consensus flag per batch (run under torchrun; not part of the test suite).

    torchrun --nproc_per_node 2 tests/scripts/consensus_cost.py [--steps 300]

Times DDP training steps of the example ToyNet watched with the consensus on and off
(interleaved rounds, so background load hits both alike), and the bare flag all-reduce.
Rank 0 prints the medians in milliseconds.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import nanwidget as nw
from nanwidget.core import consensus as distributed
from nanwidget.examples.ddp_nan import ToyNet

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--rounds", type=int, default=5)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
ddp = nn.parallel.DistributedDataParallel(ToyNet())
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
x, target = torch.randn(8, 16), torch.randn(8, 4)


def timed_steps(consensus: bool) -> float:
    distributed.set_consensus(consensus)
    with nw.watch(ddp) as watch:
        assert (watch.parts.consensus is not None) == consensus
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = nn.functional.mse_loss(ddp(x), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        elapsed = time.perf_counter() - start
    return 1000 * elapsed / args.steps


def timed_flag() -> float:
    flag = torch.zeros(1, dtype=torch.int32)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        int(flag.item())
    return 1000 * (time.perf_counter() - start) / args.steps


timed_steps(True), timed_steps(False)  # warm up
on, off, flag = [], [], []
for _ in range(args.rounds):
    on.append(timed_steps(True))
    off.append(timed_steps(False))
    flag.append(timed_flag())
if rank == 0:
    med_on, med_off = statistics.median(on), statistics.median(off)
    print(f"step with consensus {med_on:.3f} ms, without {med_off:.3f} ms, "
          f"difference {med_on - med_off:+.3f} ms/batch ({100 * (med_on / med_off - 1):+.1f}%); "
          f"bare flag all-reduce {statistics.median(flag):.3f} ms "
          f"(medians of {args.rounds} rounds x {args.steps} steps)", flush=True)
dist.destroy_process_group()

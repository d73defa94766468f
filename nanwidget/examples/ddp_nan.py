"""A two-rank DDP job whose rank 1 meets a bad batch: every rank stops at the same batch.

Run it under torchrun (CPU and gloo are enough)::

    torchrun --nproc_per_node 2 -m nanwidget.examples.ddp_nan --log-dir runs/ddp

At batch ``--nan-batch`` rank ``--nan-rank`` receives a batch whose rows are all equal, so the
model's ``norm`` layer (standardise by the batch's standard deviation) divides 0 by 0. That rank
raises :class:`nanwidget.NanDetected` for its own event; thanks to the consensus stop the other
ranks raise at the same batch with an event naming the rank that found it, instead of hanging in
DDP's next gradient all-reduce. Each rank prints one ``RESULT {json}`` line; the recording in
``--log-dir`` loads with ``nanwidget.load_run``.

``--nan-in backward`` (implies ``--backward``, which watches with ``backward=True``): the model
starts with ``fc0`` and ``rms`` (scale each row by its root mean square), and the bad batch has
one row of zeros. The forward stays finite (0 * sqrt(0) = 0), but the gradient of sqrt at 0 is
infinite and meets a zero: NaN is born in ``rms``'s backward, and ``fc0``'s weight gradient
turns NaN through DDP's all-reduce on every rank. Every rank raises out of ``loss.backward()``
at that batch, before the optimizer step.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import nanwidget as nw


class Standardize(nn.Module):
    """(x - mean) / std over the batch: a batch of identical rows gives 0 / 0 = NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(dim=0)) / x.std(dim=0)


class RootMeanSquareScale(nn.Module):
    """x * sqrt(mean(x**2)) per row: finite forward, NaN gradient for a row of zeros."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sqrt((x * x).mean(dim=-1, keepdim=True))


class ToyNet(nn.Module):
    def __init__(self, features: int = 16, width: int = 32, backward_trap: bool = False) -> None:
        super().__init__()
        if backward_trap:
            self.fc0 = nn.Linear(features, features, bias=False)  # a zero row stays zero
            self.rms = RootMeanSquareScale()
        self.norm = Standardize()
        self.fc1 = nn.Linear(features, width)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "rms"):
            x = self.rms(self.fc0(x))
        return self.head(self.act(self.fc2(self.act(self.fc1(self.norm(x))))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default=None, help="record to this directory")
    parser.add_argument("--batches", type=int, default=8, help="training steps (default 8)")
    parser.add_argument("--nan-rank", type=int, default=1, help="rank that gets the bad batch")
    parser.add_argument("--nan-batch", type=int, default=3, help="batch that is bad (-1: none)")
    parser.add_argument("--nan-in", choices=("forward", "backward"), default="forward",
                        help="where the NaN is born (default forward)")
    parser.add_argument("--backward", action="store_true", help="watch with backward=True")
    parser.add_argument("--trace-batches", default="0", help="comma-separated trace batches")
    parser.add_argument("--watch-ranks", default="all",
                        help="ranks that watch the model: 'all' (the right way) or e.g. '0'")
    parser.add_argument("--mode", default="full", choices=["full", "sentinel"],
                        help="the watch's mode (default full)")
    parser.add_argument("--extra-evals", type=int, default=0,
                        help="evaluation forwards (no grad) that rank --nan-rank runs before "
                             "training and the others do not: uneven batch numbers per rank")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds before a collective counts as hung (default 60)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    in_backward = args.nan_in == "backward"
    torch.manual_seed(0)  # same initial weights on every rank
    model = ToyNet(backward_trap=in_backward).to(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard
    trace = [int(b) for b in args.trace_batches.split(",") if b.strip()]
    result: dict = {"rank": rank, "world": world, "stopped_at": None, "last_step": None}
    watching = args.watch_ranks == "all" or str(rank) in args.watch_ranks.split(",")
    with (nw.watch(ddp, log_dir=args.log_dir, trace_batches=trace, mode=args.mode,
                   backward=args.backward or in_backward) if watching
          else contextlib.nullcontext()) as watch:
        try:
            if rank == args.nan_rank and args.extra_evals:
                model.eval()  # validation on this rank only: no collective, no consensus
                with torch.no_grad():
                    for _ in range(args.extra_evals):
                        model(torch.randn(8, 16, generator=data).to(device))
                model.train()
            for batch in range(args.batches):
                x = torch.randn(8, 16, generator=data)
                if rank == args.nan_rank and batch == args.nan_batch:
                    if in_backward:
                        x[0] = 0.0  # a row of zeros: sqrt's gradient at 0 meets a 0
                    else:
                        x = x[:1].repeat(8, 1)  # eight identical rows: std 0
                x, target = x.to(device), torch.randn(8, 4, generator=data).to(device)
                loss = nn.functional.mse_loss(ddp(x), target)
                optimizer.zero_grad()
                loss.backward()
                if watching:
                    watch.check_grad_norms()  # recorded too: run.grad_history()
                optimizer.step()
                result["last_step"] = result["last_batch"] = batch
        except nw.NanDetected as error:
            event = error.event
            result.update(stopped_at=batch, exception="NanDetected",
                          event_batch=event.batch, event_rank=event.rank,
                          peer_rank=event.peer_rank, peer_batch=event.peer_batch,
                          watch_batch=watch.batch, module=event.module, origin=event.origin,
                          role=event.role, is_backward=event.is_backward,
                          recorded=[(e.rank, e.origin) for e in watch.events], message=str(error),
                          traced=event.trace is not None)
        result["module_names"] = watch.module_names if watching else None
    with torch.no_grad():
        weights = torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])
    result["weights_finite"] = bool(torch.isfinite(weights).all())
    result["weights_sum"] = float(weights.sum())
    # One write call: the ranks share stdout, and a single short write is not interleaved.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(result) + "\n").encode())
    # Leave together: a rank tearing gloo down while its peer still talks to it can abort
    # ("terminate called without an active exception"), seen once in our CI runs.
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    # torch keeps a DDP or FSDP model's process group, and gloo's threads, alive past
    # destroy_process_group (2.13: even once the model is collected); torn down at interpreter
    # exit, they abort a rank now and then after its work is done ("terminate called without
    # an active exception", exit -6). Everything is written and closed by now: leave without
    # that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

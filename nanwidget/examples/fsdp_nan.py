"""A two-rank FSDP2 job (``fully_shard``) whose rank 1 holds a NaN in its shard of a weight.

Run it under torchrun (CPU and gloo are enough)::

    torchrun --nproc_per_node 2 -m nanwidget.examples.fsdp_nan --log-dir runs/fsdp

Every Linear layer and the model are sharded with ``fully_shard``: between forwards each rank
holds half of every weight as a DTensor, and the forward of a layer sees the whole weight,
gathered from every rank and freed again when the layer returns. Before batch ``--nan-batch``,
rank ``--nan-rank`` writes a NaN into its own shard of ``fc2.weight`` (as a bad optimizer step
would). The next forward gathers it: the watch finds it in ``fc2``'s weight (origin "weight"),
and every rank stops at that batch, before its optimizer step. ``--nan-in backward`` plants a
row of zeros in that rank's batch instead (see :mod:`nanwidget.examples.ddp_nan`): the NaN is
born in ``rms``'s backward and every rank raises out of ``loss.backward()``. ``--nan-in loss``
adds ``sqrt(-1)`` to that rank's loss: a NaN made outside the model, whose gradient reaches
the model's outputs already NaN.

``--torch-path-ranks 1`` makes rank 1 measure with torch ops instead of the native CPU kernel
(as on a GPU, where tensors are read at the batch end, after FSDP has freed the gathered
weights). Each rank prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import nanwidget as nw
from nanwidget.examples.ddp_nan import ToyNet


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default=None, help="record to this directory")
    parser.add_argument("--batches", type=int, default=6, help="training steps (default 6)")
    parser.add_argument("--nan-rank", type=int, default=1, help="rank whose shard turns NaN")
    parser.add_argument("--nan-batch", type=int, default=3, help="batch that is bad (-1: none)")
    parser.add_argument("--nan-in", choices=("weight", "backward", "loss"), default="weight",
                        help="a NaN in a weight shard (default), born in backward, or in the loss")
    parser.add_argument("--torch-path-ranks", default="",
                        help="comma-separated ranks that measure with torch ops (NANWIDGET_NATIVE=0)")
    parser.add_argument("--mode", default="full", choices=["full", "sentinel"],
                        help="the watch's mode (default full)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds before a collective counts as hung (default 60)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if str(rank) in args.torch_path_ranks.split(","):
        os.environ["NANWIDGET_NATIVE"] = "0"  # read when the watch loads the kernel
    in_backward = args.nan_in == "backward"
    torch.manual_seed(0)  # same initial weights on every rank
    model = ToyNet(backward_trap=in_backward)
    for layer in (model.fc1, model.fc2, model.head):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + rank)
    result: dict = {"rank": rank, "world": world, "stopped_at": None, "last_step": None,
                    "sharded_type": type(model.fc2.weight).__name__,
                    "shard_shape": list(model.fc2.weight.to_local().shape)}
    with nw.watch(model, log_dir=args.log_dir, backward=True, max_frames=200,
                  mode=args.mode) as watch:
        try:
            for batch in range(args.batches):
                x = torch.randn(8, 16, generator=data)
                target = torch.randn(8, 4, generator=data)
                bad = rank == args.nan_rank and batch == args.nan_batch
                if bad and args.nan_in != "loss":
                    if in_backward:
                        x[0] = 0.0
                    else:
                        with torch.no_grad():  # this rank's half of fc2.weight only
                            model.fc2.weight.to_local()[0, 0] = float("nan")
                output = model(x)
                loss = nn.functional.mse_loss(output, target)
                if bad and args.nan_in == "loss":  # finite outputs, a NaN loss and gradient
                    loss = loss + torch.sqrt(output.sum() * 0.0 - 1.0)
                optimizer.zero_grad()
                loss.backward()
                if watch.check_grad_norms():
                    result["skipped_step"] = batch
                    continue
                optimizer.step()
                result["last_step"] = batch
        except nw.NanDetected as error:
            event = error.event
            result.update(stopped_at=batch, exception="NanDetected", event_batch=event.batch,
                          event_rank=event.rank, peer_rank=event.peer_rank, module=event.module,
                          origin=event.origin, role=event.role, is_backward=event.is_backward,
                          recorded=[(e.rank, e.origin) for e in watch.events], message=str(error),
                          note=event.note,
                          diagnosis=event.diagnosis.kind if event.diagnosis else None,
                          summary=event.diagnosis.summary if event.diagnosis else None)
        frames = watch.frames()
        weights = frames[(frames.module == "fc2") & (frames.role == "weight")]
        result["fc2_weight_rows"] = weights[["batch", "shape", "nan", "note"]].values.tolist()
        result["notes"] = sorted(set(frames.note))
        try:
            watch.replay(0)
        except RuntimeError as refusal:  # nanwidget.core.replay.ReplayError
            result["replay"] = str(refusal)
    with torch.no_grad():
        shards = [p.to_local().reshape(-1) for p in model.parameters()]
        result["shards_finite"] = [bool(torch.isfinite(s).all()) for s in shards]
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(result, default=str) + "\n").encode())
    # NanDetected left the backward pass before FSDP waited for its gradient reduce-scatter:
    # a barrier on the same group runs after it, so no collective is in flight at teardown
    # (one was, now and then, and the process aborted as it exited).
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

"""Under torchrun (gloo, CPU): a model sharded with FSDP2 trains three steps under a watch,
then torch.distributed.checkpoint loads a checkpoint holding a NaN in '2.weight'
(dcp.load, then set_model_state_dict); the next batch meets it. Prints one
"RESULT {json}" per watch mode: the event and its diagnosis."""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard

import nanwidget as nw


def run(mode: str, directory: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    with nw.watch(model, on_nan="record", mode=mode) as w:
        for _ in range(3):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=directory)
        set_model_state_dict(model, state)
        model(x)
    event = w.event
    return {"mode": mode, "rank": dist.get_rank(),
            "event": None if event is None else [event.batch, event.module, event.role],
            "kind": None if event is None else event.diagnosis.kind,
            "summary": None if event is None else event.diagnosis.summary,
            "suggestion": None if event is None else event.diagnosis.suggestion}


def main() -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    directory = tempfile.mkdtemp() if dist.get_rank() == 0 else ""
    shared = [directory]
    dist.broadcast_object_list(shared, src=0)
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    state = {k: v.clone() for k, v in source.state_dict().items()}
    state["2.weight"][0, 1] = float("nan")
    dcp.save(state, checkpoint_id=shared[0])
    for mode in ("full", "sentinel"):
        print("RESULT " + json.dumps(run(mode, shared[0])), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

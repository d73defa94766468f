"""Records a tiny model to LOG_DIR forever (until killed); prints "batch N" after each batch.

Used by tests/test_persist.py to SIGKILL a recording process mid-run. Batch 3 carries a NaN
(on_nan="record", so the run goes on) so the directory also holds an event.
"""

import sys
import time

import torch
from torch import nn

import nanwidget as nw

log_dir = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
watch = nw.watch(model, log_dir=log_dir, on_nan="record", trace_batches=[1])
batch = 0
while True:
    x = torch.randn(8, 16)
    if batch == 3:
        x[0, 0] = float("nan")
    model(x)
    print(f"batch {batch}", flush=True)
    batch += 1
    time.sleep(0.01)

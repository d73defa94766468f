"""nanwidget on a CUDA GPU, checked by hand where one is at hand (CI has none): training steps
give bit-identical losses and weights with and without each watch, the host syncs per step are
counted (torch.cuda.set_sync_debug_mode), and planted NaNs get their verdicts. Prints PASS/FAIL
per check; exits 1 when any failed.

    python scripts/gpu_check.py          # on the GPU
    python scripts/gpu_check.py cpu      # the same checks on the CPU (no sync counts)
"""
import os
import sys
import time
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nanwidget as nw  # noqa: E402

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
if dev == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device here (run it with 'cpu' for the same checks on the CPU)")
CUDA = dev == "cuda"
results = []

def check(name, ok, detail=""):
    results.append((name, ok))
    print(("PASS " if ok else "FAIL ") + name + (f"  [{detail}]" if detail else ""), flush=True)

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10)).to(dev)

def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64,
                     bos_token_id=499, eos_token_id=499)
    return GPT2LMHeadModel(cfg).to(dev)

def batches(kind, n):
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return [(torch.randn(32, 64, generator=g).to(dev), torch.randint(0, 10, (32,), generator=g).to(dev)) for _ in range(n)]
    return [(torch.randint(0, 500, (4, 32), generator=g).to(dev), None) for _ in range(n)]

def loss_of(kind, model, x, y):
    if kind == "mlp":
        return nn.functional.cross_entropy(model(x), y)
    return model(input_ids=x, labels=x).loss

def train(kind, watch_kw, steps=3, count_syncs=False):
    model = mlp() if kind == "mlp" else gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = nw.watch(model, **watch_kw) if watch_kw is not None else None
    rec, syncs = [], []
    data = batches(kind, steps)
    torch.manual_seed(2)
    for i, (x, y) in enumerate(data):
        if count_syncs and CUDA:
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    loss = loss_of(kind, model, x, y)
                    loss.backward()
                    opt.step(); opt.zero_grad()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs.append(sum("synchroniz" in str(c.message) for c in caught))
        else:
            loss = loss_of(kind, model, x, y)
            loss.backward()
            opt.step(); opt.zero_grad()
        rec.append(loss.detach().clone())
    rec += [p.detach().clone() for p in model.parameters()]
    info = None
    if w is not None:
        info = (len(w.events), len(w.warnings) if hasattr(w, "warnings") else 0)
        w.close()
    return rec, info, syncs

torch.backends.cudnn.deterministic = True
if CUDA:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)

MODES = {"full": {}, "full+backward": {"backward": True}, "sentinel": {"mode": "sentinel"},
         "sentinel+backward": {"mode": "sentinel", "backward": True}}
for kind in ("mlp", "gpt2"):
    base, _, base_syncs = train(kind, None, count_syncs=True)
    print(f"{kind} unwatched: host syncs per step {base_syncs}", flush=True)
    for name, kw in MODES.items():
        t = time.time()
        rec, info, syncs = train(kind, kw, count_syncs=True)
        same = len(rec) == len(base) and all(torch.equal(a, b) for a, b in zip(rec, base))
        check(f"{kind} {name}: bit-identical losses and weights, no event", same and info[0] == 0,
              f"events {info[0]}, host syncs per step {syncs} (unwatched {base_syncs}), {time.time() - t:.1f}s")

# Planted: a weight set to NaN between steps.
for name, kw in (("full", {}), ("sentinel", {"mode": "sentinel"})):
    model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = batches("mlp", 3)
    with nw.watch(model, on_nan="record", **kw) as w:
        for i, (x, y) in enumerate(data):
            if i == 2:
                with torch.no_grad():
                    model[2].weight[3, 5] = float("nan")
            nn.functional.cross_entropy(model(x), y).backward(); opt.step(); opt.zero_grad()
        e = w.event
    ok = e is not None and e.batch == 2 and e.module == "2" and e.origin == "weight" \
        and e.diagnosis is not None and e.diagnosis.kind == "corrupted-weight"
    check(f"planted NaN weight, {name}: batch 2, module 2, origin weight, corrupted-weight", ok,
          e.summary() if e else "no event")

# Planted: NaN in one sample of the input.
for name, kw in (("full", {}), ("sentinel", {"mode": "sentinel"})):
    model = mlp()
    x, y = batches("mlp", 1)[0]
    x = x.clone(); x[7, 3] = float("nan")
    with nw.watch(model, on_nan="record", **kw) as w:
        model(x)
        e = w.event
    d = e.diagnosis if e else None
    ok = e is not None and d is not None and d.kind == "bad-data" and list(getattr(d, "rows", []) or []) == [7]
    check(f"NaN in sample 7, {name}: bad-data, rows [7]", ok, (d.summary if d else "no event"))

# Planted: float16 overflow in a Linear.
for name, kw in (("full", {}), ("sentinel", {"mode": "sentinel"})):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(dev).half()
    with torch.no_grad():
        model[2].weight.mul_(6000.0)
    x = (torch.randn(16, 64) * 30).to(dev).half()
    with nw.watch(model, on_nan="record", **kw) as w:
        model(x)
        e = w.event
    d = e.diagnosis if e else None
    ok = e is not None and e.module == "2" and d is not None and d.kind == "overflow"
    check(f"float16 overflow in module 2, {name}: overflow", ok, (d.summary if d else "no event"))

# The everyday GPU stack: float16 autocast, a GradScaler (its first steps overflow float16 at
# the initial scale and are skipped, by design: no event) and the fused AdamW the HF Trainer
# uses by default. Results bit-identical with and without each watch; then a weight written NaN.
def amp_run(watch_kw, steps=12, plant_at=None, init_scale=2.0 ** 16):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(dev, init_scale=init_scale)
    w = nw.watch(model, on_nan="record", grad_scaler=scaler, **watch_kw) \
        if watch_kw is not None else None
    losses, scales = [], []
    for i, (x, y) in enumerate(batches("mlp", steps)):
        if i == plant_at:
            with torch.no_grad():
                model[4].weight[1, 2] = float("nan")
        with torch.autocast(dev, dtype=torch.float16 if CUDA else torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.detach().float().clone())
        scales.append(scaler.get_scale())
    weights = [p.detach().clone() for p in model.parameters()]
    events = list(w.events) if w is not None else []
    if w is not None:
        w.close()
    return losses + weights, scales, events


base_amp, base_scales, _ = amp_run(None)
for name, kw in MODES.items():
    rec, scales, events = amp_run(kw)
    same = all(torch.equal(a, b) for a, b in zip(rec, base_amp))
    check(f"AMP + GradScaler + fused AdamW, {name}: bit-identical, no event", same and not events,
          f"events {len(events)}, scales {scales[:4]}... (unwatched {base_scales[:4]}...)")
# A scale so high that float16 gradients overflow: the scaler skips those steps and lowers it,
# by design (no event). On the CPU (bfloat16) nothing overflows and nothing is skipped.
base_high, high_scales, _ = amp_run(None, init_scale=2.0 ** 40)
skipped = sum(later < earlier for earlier, later in zip(high_scales, high_scales[1:]))
for name, kw in (("full", {}), ("sentinel+backward", {"mode": "sentinel", "backward": True})):
    rec, _, events = amp_run(kw, init_scale=2.0 ** 40)
    same = all(torch.equal(a, b) for a, b in zip(rec, base_high))
    check(f"AMP at scale 2**40, {name}: steps the scaler skipped are no event", same and not events,
          f"{skipped} steps skipped, events {len(events)}")
for name, kw in (("full", {}), ("sentinel", {"mode": "sentinel"})):
    _, _, events = amp_run(kw, plant_at=6)
    e = events[0] if events else None
    ok = e is not None and e.batch == 6 and e.module == "4" and e.origin == "weight" \
        and e.diagnosis is not None and e.diagnosis.kind == "corrupted-weight"
    check(f"AMP, weight written NaN before step 6, {name}: corrupted-weight at module 4", ok,
          (e.summary() + " / " + e.diagnosis.summary) if e is not None and e.diagnosis else
          "no event")

print(f"{sum(ok for _, ok in results)}/{len(results)} passed", flush=True)
sys.exit(0 if all(ok for _, ok in results) else 1)

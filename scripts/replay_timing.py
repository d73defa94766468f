"""Measure trace-mode replay on GPT-2 4x128 (4x64 tokens) and the cost of capturing batches.

    PYTHONPATH=. python scripts/replay_timing.py [--device cuda] [--steps 30]

Prints: replay seconds (forward, and forward+backward), ops traced, whether the replay's
frames equal the recorded ones, and the median step time with keep_batches=0 vs 4
(interleaved runs, so machine noise hits both alike).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import nanwidget as nw


def build(device: str):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4)
    model = transformers.GPT2LMHeadModel(config).to(device).train()
    tokens = torch.randint(0, config.vocab_size, (4, 64), device=device)
    return model, tokens


def step_times(model, tokens, keep: int, steps: int) -> list[float]:
    times = []
    with nw.watch(model, keep_batches=keep, on_nan="record") as w:
        for _ in range(steps):
            start = time.perf_counter()
            with torch.no_grad():
                model(input_ids=tokens)
            if tokens.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=30)
    options = parser.parse_args()
    model, tokens = build(options.device)

    with nw.watch(model, trace_batches=[2], on_nan="record") as w:
        for _ in range(3):
            model(input_ids=tokens)
        recorded = w.frames(batch=2)
        for label, loss_fn in (("forward", None),
                               ("forward+backward", lambda out: out.logits.float().mean())):
            timings = []
            for _ in range(3):
                start = time.perf_counter()
                trace = w.replay(2, loss_fn=loss_fn)
                timings.append(time.perf_counter() - start)
            print(f"replay {label}: best {min(timings):.3f} s, median {statistics.median(timings):.3f} s "
                  f"({len(trace.ops)} ops, {trace.frames['frame'].nunique()} frames)")
        trace = w.replay(2)
        same = (trace.frames[["module", "role", "abs_min", "abs_max"]].reset_index(drop=True)
                .equals(recorded[["module", "role", "abs_min", "abs_max"]].reset_index(drop=True)))
        print(f"replayed frames equal recorded frames (dropout on): {same}")

    for _ in range(2):  # warm-up
        step_times(model, tokens, 0, 3)
        step_times(model, tokens, 4, 3)
    off, on = [], []
    for _ in range(5):
        off += step_times(model, tokens, 0, options.steps)
        on += step_times(model, tokens, 4, options.steps)
    print(f"step (no_grad forward) keep_batches=0: median {statistics.median(off) * 1e3:.2f} ms; "
          f"keep_batches=4: median {statistics.median(on) * 1e3:.2f} ms "
          f"({(statistics.median(on) / statistics.median(off) - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()

"""Measure trace-mode replay on GPT-2 4x128 (4x64 tokens) and the cost of capturing batches.

    PYTHONPATH=. python scripts/replay_timing.py [--device cuda] [--steps 30]

Prints: replay seconds (forward, and forward+backward), ops traced, whether the replay's
frames equal the recorded ones, and what capturing batches for replay costs a normal step.
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


def capture_cost(model, tokens, steps: int) -> tuple[float, float, float]:
    """Fastest step time without and with the replay capture, alternating step by step on one
    watch (so that load on a shared machine hits both alike), and the capture's own time."""
    off, on = [], []
    with nw.watch(model, keep_batches=4, on_nan="record") as w:
        capture = w._extension("replay")
        for step in range(2 * steps):
            with_capture = step % 2 == 1
            w.extensions = [e for e in w.extensions if e is not capture] + ([capture] if with_capture else [])
            start = time.perf_counter()
            with torch.no_grad():
                model(input_ids=tokens)
            if tokens.is_cuda:
                torch.cuda.synchronize()
            (on if with_capture else off).append(time.perf_counter() - start)
        calls = 2000
        start = time.perf_counter()
        for batch in range(10_000, 10_000 + calls):
            capture.on_batch_start(w, batch, (), {"input_ids": tokens})
            capture.on_batch_end(w, batch, [], None)
        own = (time.perf_counter() - start) / calls
    return min(off), min(on), own


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

    off, on, own = capture_cost(model, tokens, options.steps)
    print(f"step (no_grad forward, watched): fastest {off * 1e3:.2f} ms without capture, "
          f"{on * 1e3:.2f} ms with keep_batches=4 ({(on / off - 1) * 100:+.1f}%, alternating steps); "
          f"the capture itself: {own * 1e6:.1f} us per batch ({own / off * 100:.3f}% of a step)")

if __name__ == "__main__":
    main()

"""``python -m nanwidget bench``: step-time ratios against the unwatched baseline and the peers.

Columns: nanwidget's default watch (``on_nan="record"``), the same with backward frames
(``backward=True``, train steps only), its sentinel mode (``mode="sentinel"``, with
``backward=True`` on train rows), the forum recipe of a forward hook on
every module checking ``isnan().any() or isinf().any()``, transformers' DebugUnderflowOverflow
(when transformers is installed) and ``torch.autograd.detect_anomaly`` (train steps only: it
checks nothing in a no-grad forward). The harness lives in :mod:`nanwidget.cli.benchmark`.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import benchmark


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=",".join(benchmark.MODELS),
                        help="comma-separated: mlp, transformer, gpt2-small, gpt2, gpt2-compiled "
                             "(default: all five; gpt2-small has a 2000-token vocabulary; "
                             "gpt2-compiled compiles GPT-2 with torch.compile first)")
    parser.add_argument("--modes", default="forward,train",
                        help="comma-separated: forward, train (default: both)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds per row; the ratio is their median (default 15, "
                             "3 with --quick)")
    parser.add_argument("--block-ms", type=float, default=None,
                        help="length of one timed block of baseline steps in ms (default 100, "
                             "20 with --quick)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each block")
    parser.add_argument("--quick", action="store_true",
                        help="few short rounds: checks that everything runs, numbers are rough")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) first")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    parser.add_argument("--compare", metavar="REF",
                        help="also time the watch variants of git revision REF (e.g. main, "
                             "HEAD~1) in the same rounds, and print new/REF per row")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed time (default); cpu: this process's CPU time, which "
                             "leaves out what other processes take on a shared machine (CPU only)")
    parser.add_argument("--floors", action="store_true",
                        help="also time stand-ins of the leanest full and sentinel watches "
                             "(columns floor/DUO overhead and sentinel floor µs/batch): what "
                             "the targets are up against on this machine")
    parser.add_argument("--no-replay", action="store_true",
                        help="skip timing the replay of a failing GPT-2 batch into full detail")


def _split(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [item.strip() for item in value.split(",")]
    unknown = [item for item in items if item and item not in allowed]
    if unknown or not any(items):
        raise SystemExit(f"nanwidget bench: unknown {what} {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(allowed)}")
    if not all(items) or len(set(items)) < len(items):
        # a typo such as "mlp,,gpt2" or "mlp,mlp": say so rather than time something else
        raise SystemExit(f"nanwidget bench: --{what}s {value!r} has an empty or repeated part; "
                         f"give each {what} once, separated by commas (e.g. "
                         f"{','.join(allowed[:2])})")
    return items


def run(args: argparse.Namespace) -> int:
    models = _split(args.models, benchmark.MODELS, "model")
    modes = _split(args.modes, benchmark.MODES, "mode")
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 15)
    block_ms = args.block_ms if args.block_ms is not None else (20.0 if args.quick else 100.0)
    warmup = min(args.warmup, 1) if args.quick else args.warmup
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("nanwidget bench: --device cuda asked for, but torch sees no CUDA device")
    gpt2 = [m for m in models if m.startswith("gpt2")]
    if gpt2 and not benchmark.transformers_available():
        print(f"nanwidget bench: transformers is not installed; skipping {', '.join(gpt2)} "
              "(pip install 'nanwidget[bench]')", file=sys.stderr)
        models = [m for m in models if m not in gpt2]
        if not models:
            return 1

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    if args.clock == "cpu" and not args.device.startswith("cpu"):
        raise SystemExit("nanwidget bench: --clock cpu times CPU work only; use the wall clock "
                         "on a GPU")
    print(f"nanwidget bench: {rounds} interleaved rounds, blocks of ~{block_ms:g} ms, "
          f"{warmup} warm-up step(s); ratio = median over rounds of variant / baseline time",
          file=sys.stderr, flush=True)
    result = benchmark.run_benchmark(models, modes, rounds=rounds, block_seconds=block_ms / 1e3,
                                     warmup=warmup, seed=args.seed, device=args.device,
                                     progress=progress, compare=args.compare,
                                     clock=args.clock, floors=args.floors)
    print(f"Environment: {result.format_environment()}")
    print("MultiheadAttention fast path disabled so every variant runs the same kernels; "
          f"GPT-2 input {benchmark.GPT2_INPUT[0]}x{benchmark.GPT2_INPUT[1]} tokens.")
    print()
    print(result.format_table(markdown=args.markdown))
    print()
    for line in result.skipped:
        print(line)
    if result.compared and any(row.versus for row in result.rows):
        print(f"This tree against {args.compare} ({result.compared}), timed in the same rounds "
              "(median of new/old block time; below 1.000: faster now):")
        print(result.format_versus(markdown=args.markdown))
        print()
    print(f"Targets: nanwidget <= 1.10x on transformer/gpt2 train, <= 1.25x on mlp train, "
          f"<= {benchmark.FORWARD_TARGET:.2f}x on every forward; nanwidget's overhead (ratio-1) at most "
          f"{benchmark.OVERHEAD_SHARE_TARGET:.2f} of DebugUnderflowOverflow's (nw/DUO overhead column); "
          f"sentinel mode <= {benchmark.SENTINEL_TARGET:.2f}x on every row (on train rows it also "
          "checks the gradients; on compiled rows the baseline is the compiled model).")
    print("nw µs/call: what nanwidget's full watch adds per module forward call of a step; "
          "sentinel µs/batch: what sentinel mode adds per step (both from the median ratio "
          "and the baseline time).")
    data = result.to_dict()
    if "gpt2" in models and not args.no_replay:
        progress("replaying a failing GPT-2 batch (sentinel mode)")
        timing = benchmark.replay_timing(device=args.device, seed=args.seed)
        target = benchmark.REPLAY_TARGET_SECONDS
        print()
        for label, seconds, ops in (("forward NaN (frames + op trace, and the previous batch's "
                                     "frames)", timing.forward_seconds, timing.ops[0]),
                                    ("backward-only NaN (frames and op trace of "
                                     "forward and backward)", timing.backward_seconds,
                                     timing.ops[1])):
            verdict = "PASS" if seconds < target else "MISS"
            print(f"Replay of a failing GPT-2 batch into full detail, {label}: {seconds:.2f} s, "
                  f"{ops} ops traced (target < {target:g} s: {verdict})")
        data["replay"] = {"forward_seconds": timing.forward_seconds,
                          "backward_seconds": timing.backward_seconds,
                          "forward_event": timing.forward_summary,
                          "backward_event": timing.backward_summary, "ops": list(timing.ops)}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2)
        print(f"Measurements written to {args.json}")
    return 0

"""``python -m nanwidget demo``: train a small model until it diverges and catch the first NaN/Inf.

A seeded MLP regresses a noisy linear target with plain SGD at a learning rate too high for
the target's scale. Nothing is planted: the weights grow step after step until one layer's
output overflows float32, and the watch stops that forward pass and names the module. The
demo then prints the report and writes the recorded frames, the per-batch history, the report
and two abs-max plots into a folder.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.events import NanDetected
from ..core.watch import watch as start_watch
from ..plots import plot_frames, plot_history

DEFAULT_OUT = "nanwidget-demo"
NOTEBOOK_HINT = "jupyter lab notebooks/01_quickstart.ipynb"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"folder for frames, history, report and plots (default ./{DEFAULT_OUT}/)")
    parser.add_argument("--lr", type=float, default=0.1,
                        help="SGD learning rate; the default is too high on purpose (default 0.1)")
    parser.add_argument("--steps", type=int, default=200,
                        help="give up after this many steps (default 200)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the model's initial weights, the data and the order of the "
                             "mini-batches: the same seed gives the same run (default 0)")


def build_demo(seed: int = 0) -> tuple[Any, Any, Any]:
    """The seeded model and its synthetic data: inputs (512, 16), targets (512, 1)."""
    class DemoRegressor(nn.Module):
        """16 -> 64 -> 64 -> 1 with ReLUs: small enough to train in milliseconds."""

        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(16, 64)
            self.act1 = nn.ReLU()
            self.fc2 = nn.Linear(64, 64)
            self.act2 = nn.ReLU()
            self.head = nn.Linear(64, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.act2(self.fc2(self.act1(self.fc1(x)))))

    torch.manual_seed(seed)
    model = DemoRegressor()
    inputs = torch.randn(512, 16)
    # Targets of scale ~20: with lr=0.1 every SGD step overshoots by more than it corrects.
    targets = inputs @ torch.randn(16, 1) * 5 + torch.randn(512, 1)
    return model, inputs, targets


def train_until_nan(model: Any, inputs: Any, targets: Any, *, lr: float, steps: int,
                    seed: int) -> tuple[Any, list[float], Any]:
    """SGD on random mini-batches of 32 under ``nw.watch``; stops at the first NaN/Inf.

    Returns the (closed) watch, the losses of the finished steps, and the NanDetected (or None).
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses: list[float] = []
    caught = None
    with start_watch(model) as watch:
        try:
            for _ in range(steps):
                index = torch.randint(0, len(inputs), (32,), generator=generator)
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(inputs[index]), targets[index])
                loss.backward()
                optimizer.step()
                losses.append(loss.item())  # the demo prints it; a sync per step is fine here
        except NanDetected as error:
            caught = error
    return watch, losses, caught


_ROOT_HEADER = re.compile(r"^(?P<indent> {17}) {2}(?P<type>\S.*)$")  # "<17 spaces> <empty name> Type"
_BATCH_START = re.compile(r"^ {17} \*\*\* Starting batch number=(?P<batch>\d+) \*\*\*$")


def readable_report(report: str, frames: Any) -> str:
    """``report`` (transformers' layout) with a line between batches and the root as ``<root>``.

    The report has one header per frame, in the order of ``frames`` (the event's frames), and
    transformers' "*** Starting batch number=N ***" line where a batch starts. A
    "--- batch N ---" line goes right before that line, or, for a batch whose start is not
    in the dump (the first one, cut by the window), before its first header. The root module,
    whose name is empty, reads "<root> Type" as it does in the plots.
    """
    keys = frames.groupby(["rank", "batch", "phase", "frame"], sort=False).size().index
    batches = [key[1] for key in keys]
    lines, frame, previous = [], 0, None
    for line in report.splitlines():
        start = _BATCH_START.match(line)
        if start is not None:  # a batch starts: not a frame's header
            batch = int(start["batch"])
            if batch != previous:
                lines.append(_separator(batch))
                previous = batch
            lines.append(line)
            continue
        is_header = line.startswith(" " * 17) and not line[:17].strip() and frame < len(batches)
        if is_header:
            batch = batches[frame]
            if batch != previous:
                lines.append(_separator(batch))
                previous = batch
            frame += 1
            root = _ROOT_HEADER.match(line)
            if root:
                line = f"{root['indent']} <root> {root['type']}"
        lines.append(line)
    return "\n".join(lines)


def _separator(batch: int) -> str:
    return f"--- batch {batch} " + "-" * 30


def _write_table(frame: Any, folder: Path, stem: str) -> Path:
    """Parquet when pyarrow is there, else CSV."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        path = folder / f"{stem}.csv"
        frame.to_csv(path, index=False)
        return path
    path = folder / f"{stem}.parquet"
    frame.to_parquet(path, index=False)
    return path


def _write_plots(frames: Any, history: Any, folder: Path) -> list[Path]:
    paths = []
    every_module = int(history["module"].nunique())
    figures = (("frames", plot_frames(frames, title="abs max / abs min of the last frames")),
               ("history", plot_history(history, count=every_module, dtype="float32",
                                        title="abs max of outputs per batch (float32 limit dashed)")))
    for stem, figure in figures:
        path = folder / f"{stem}.png"
        figure.savefig(path, dpi=100)
        paths.append(path)
    return paths


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.lr <= 0 or args.steps < 1:
        raise SystemExit("nanwidget demo: --lr must be > 0 and --steps >= 1")
    model, inputs, targets = build_demo(args.seed)
    watch, losses, caught = train_until_nan(model, inputs, targets, lr=args.lr, steps=args.steps,
                                            seed=args.seed)
    if caught is None:
        print(f"nanwidget demo: no NaN/Inf in {len(losses)} steps at lr={args.lr:g}: the loss "
              f"went {losses[0]:.3g} -> {losses[-1]:.3g}. This learning rate trains; a larger "
              f"one (the default, 0.1) makes the run diverge and shows the catch")
        return 1
    event = caught.event
    growth = f"{losses[0]:.3g} -> {max(losses):.3g}" if losses else "n/a"
    print(f"nanwidget demo: loss diverged at lr={args.lr:g} ({growth} in {len(losses)} steps); "
          f"caught {event.kind} in batch {event.batch} at module '{event.module_label}' "
          f"({event.module_type}): {event.origin_words}")
    print()
    print("losses: " + ", ".join(f"{loss:.3g}" for loss in losses))
    print()
    report = readable_report(watch.report(), event.frames)
    print(report)
    print()

    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    frames, history = watch.frames(), watch.history()
    written = [_write_table(frames, folder, "frames"), _write_table(history, folder, "history")]
    report_path = folder / "report.txt"
    report_path.write_text(report + "\n", encoding="utf-8")
    written.append(report_path)
    written.extend(_write_plots(frames, history, folder))
    print(f"Wrote to {folder.resolve()}/:")
    for path in written:
        print(f"  {path.name}")
    print()
    reader = "read_parquet" if written[0].suffix == ".parquet" else "read_csv"
    print("What to try next:")
    print(f"  - a learning rate 20 times smaller: `python -m nanwidget demo --lr "
          f"{args.lr / 20:g}`; the loss falls instead of exploding, and no NaN/Inf comes")
    print("  - in your own loop: clip gradients before the step "
          "(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)), or a learning-rate warmup")
    print(f"  - the guided tour in a notebook: from the repository's folder (after "
          f"`bash scripts/setup.sh`) run `{NOTEBOOK_HINT}`")
    print(f"  - the recorded tables in pandas: pandas.{reader}('{written[0]}')")
    print(f"Done in {time.perf_counter() - started:.1f} s.")
    return 0

"""``python -m nanwidget demo``: train a small model until it diverges and catch the first NaN/Inf.

A seeded MLP regresses a noisy linear target with plain SGD at a learning rate too high for
the target's scale. Nothing is planted: the weights grow step after step until one layer's
output overflows float32, and the watch stops that forward pass and names the module. The
demo then prints the report and writes the recorded frames, the per-batch history, the report
and two abs-max plots into a folder.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.events import ORIGIN_WORDS, NanDetected
from ..core.watch import watch as start_watch
from ..plots import plot_frames, plot_history

DEFAULT_OUT = "nanwidget-demo"
NOTEBOOK_HINT = "jupyter lab notebooks/01_quickstart.ipynb"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"folder for frames, history, report and plots (default ./{DEFAULT_OUT}/)")
    parser.add_argument("--lr", type=float, default=0.1,
                        help="SGD learning rate; the default is too high on purpose (default 0.1)")
    parser.add_argument("--steps", type=int, default=200, help="give up after this many steps")
    parser.add_argument("--seed", type=int, default=0)


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
        print(f"nanwidget demo: no NaN/Inf in {len(losses)} steps at lr={args.lr:g} "
              f"(last loss {losses[-1]:.3g}); try a larger --lr")
        return 1
    event = caught.event
    growth = f"{losses[0]:.3g} -> {max(losses):.3g}" if losses else "n/a"
    print(f"nanwidget demo: loss diverged at lr={args.lr:g} ({growth} in {len(losses)} steps); "
          f"caught {event.kind} in batch {event.batch} at module '{event.module_label}' "
          f"({event.module_type}): {ORIGIN_WORDS.get(event.origin, event.origin)}")
    print()
    print("losses: " + ", ".join(f"{loss:.3g}" for loss in losses))
    print()
    report = watch.report()
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
    print(f"Take the guided tour in a notebook: from the repository's folder (after "
          f"`bash scripts/setup.sh`) run `{NOTEBOOK_HINT}`")
    print(f"(read the tables back with pandas.read_parquet('{written[0]}')). "
          f"Done in {time.perf_counter() - started:.1f} s.")
    return 0

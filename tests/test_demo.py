"""`python -m nanwidget demo`: a real divergence caught, reported and written to disk."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODULES = {"fc1", "act1", "fc2", "act2", "head"}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    completed = subprocess.run([sys.executable, "-m", "nanwidget", "demo", "--out", str(out)],
                               capture_output=True, text=True, env=env, timeout=60,
                               cwd=out.parent)
    assert completed.returncode == 0, completed.stderr
    return completed.stdout, out


def test_demo_headline_names_the_module_where_training_overflowed(demo_run):
    stdout, _ = demo_run
    headline = stdout.splitlines()[0]
    match = re.search(r"caught (nan|inf|nan\+inf) in batch (\d+) at module '([^']+)' \((\w+)\)",
                      headline)
    assert match, headline
    kind, batch, module, module_type = match.groups()
    assert module in DEMO_MODULES
    # the loss grew over several real SGD steps before the overflow: nothing was planted
    losses = [float(v) for v in stdout.splitlines()[2].removeprefix("losses: ").split(", ")]
    assert int(batch) == len(losses) >= 3
    assert losses[-1] > 1e6 * losses[0]
    # the report's transformers-style dump ends with that module's frame, flagged
    assert f"Detected inf/nan during batch_number={batch}" in stdout
    assert re.search(rf"^\s+{module} {module_type}$", stdout, re.MULTILINE)
    assert f"<-- {kind}" in stdout


def test_demo_writes_frames_history_report_and_plots(demo_run):
    stdout, out = demo_run
    suffix = "parquet" if (out / "frames.parquet").exists() else "csv"
    read = pd.read_parquet if suffix == "parquet" else pd.read_csv
    frames, history = read(out / f"frames.{suffix}"), read(out / f"history.{suffix}")
    assert {"module", "role", "abs_max", "nan", "inf"} <= set(frames.columns)
    assert frames["inf"].any() or frames["nan"].any()
    assert set(history["module"]) >= DEMO_MODULES
    assert history["batch"].max() == frames["batch"].max()
    for png in ("frames.png", "history.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Detected inf/nan" in (out / "report.txt").read_text()
    assert str(out.resolve()) in stdout
    assert "jupyter lab notebooks/01_quickstart.ipynb" in stdout


def test_demo_report_separates_batches_and_calls_the_root_root(demo_run):
    stdout, _ = demo_run
    report = stdout[stdout.index("Detected inf/nan"):stdout.index("Wrote to")]
    separators = re.findall(r"^--- batch (\d+) -+$", report, re.MULTILINE)
    assert len(separators) >= 2 and separators == sorted(separators, key=int)
    assert int(separators[-1]) == int(re.search(r"batch_number=(\d+)", report).group(1))
    # each separator sits right where its batch starts: before transformers' "*** Starting
    # batch number=N ***" line, or (the first batch, cut by the window) before its first frame
    lines = report.splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith("--- batch ")]
    for position, batch in zip(marks, separators):
        start = f"{' ' * 18}*** Starting batch number={batch} ***"
        after = lines[position + 1]
        assert after == start or (position == marks[0] and start not in lines), (batch, after)
    assert all(lines[i - 1].startswith("--- batch ") for i, line in enumerate(lines)
               if "*** Starting batch number=" in line)
    assert re.search(r"^ {18}<root> DemoRegressor$", report, re.MULTILINE)
    assert not re.search(r"^ {19}DemoRegressor$", report, re.MULTILINE)
    # every frame header still reads "name Type", as transformers prints them
    headers = [line for line in report.splitlines() if line.startswith(" " * 18)]
    assert all(len(line.split()) >= 2 for line in headers)


def test_demo_ends_with_what_to_try_next(demo_run):
    stdout, _ = demo_run
    advice = stdout[stdout.index("What to try next:"):]
    assert "--lr 0.005" in advice and "clip_grad_norm_" in advice
    assert "jupyter lab notebooks/01_quickstart.ipynb" in advice


def test_the_suggested_learning_rate_trains_without_a_nan():
    from nanwidget.cli.demo import build_demo, train_until_nan
    model, inputs, targets = build_demo(seed=0)
    watch, losses, caught = train_until_nan(model, inputs, targets, lr=0.005, steps=200, seed=0)
    assert caught is None and not watch.events
    assert losses[-1] < losses[0] / 100  # falls, as the advice says


def test_every_demo_option_has_help():
    from nanwidget.cli import build_parser
    parser = build_parser()
    demo = parser._subparsers._group_actions[0].choices["demo"]
    for action in demo._actions:
        if action.dest != "help":
            assert action.help, action.dest
    assert "same seed gives the same run" in demo.format_help()

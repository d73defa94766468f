"""Plots read frame / history DataFrames of real recorded watches and return Figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.collections import LineCollection
from torch import nn

import nanwidget as nw
from nanwidget.core.history import History
from nanwidget.plots import largest_modules, plot_frames, plot_history
from nanwidget.plots.common import figure_png

from conftest import TinyMLP

ROOT = Path(__file__).resolve().parents[1]


def _record(model: nn.Module, batches: int, nan_at: int | None, scale: float = 1.0,
            dtype: torch.dtype = torch.float32, **options) -> nw.NanWatch:
    watch = nw.watch(model, on_nan="record", **options)
    for batch in range(batches):
        if batch == nan_at:
            with torch.no_grad():
                model.fc2.weight[0, 0] = float("nan")
        model(torch.randn(4, 16, dtype=dtype) * scale ** batch)
    return watch


def _hlines_at(ax, value: float) -> list:
    return [line for line in ax.lines
            if len(line.get_ydata()) == 2 and np.allclose(line.get_ydata(), value)
            and line.get_xdata()[0] == 0 and line.get_xdata()[1] == 1]


def test_frames_plot_draws_float16_limit_and_marks_first_bad_frame():
    model = TinyMLP().half()
    with _record(model, batches=4, nan_at=3, dtype=torch.float16, max_frames=12) as watch:
        frames = watch.event.frames
    figure = plot_frames(frames)
    ax = figure.axes[0]
    assert ax.get_yscale() == "log"
    assert len(_hlines_at(ax, 65504.0)) == 1
    # The red vertical line sits at the first frame holding a NaN, counted in buffer order.
    keys = frames.groupby(["rank", "batch", "phase", "frame"], sort=False)
    first_bad = [i for i, (_, rows) in enumerate(keys) if (rows["nan"] | rows["inf"]).any()][0]
    verticals = [line for line in ax.lines if line.get_color() == "red"
                 and len(line.get_xdata()) == 2 and line.get_xdata()[0] == line.get_xdata()[1]]
    assert verticals and verticals[0].get_xdata()[0] == first_bad
    assert "first NaN/Inf: fc2" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert figure_png(figure).startswith(b"\x89PNG")


def test_frames_plot_one_point_per_frame_from_the_chosen_roles():
    model = TinyMLP()
    with _record(model, batches=2, nan_at=None, max_frames=10) as watch:
        frames = watch.frames()
    figure = plot_frames(frames, roles="outputs")
    abs_max_line = figure.axes[0].lines[0]
    outputs = frames[frames["role"].str.startswith("output")]
    expected = outputs.groupby(["batch", "frame"], sort=False)["abs_max"].max().to_numpy()
    np.testing.assert_allclose(abs_max_line.get_ydata(), expected)


def test_frames_plot_of_no_rows_says_so():
    model = TinyMLP()
    with _record(model, batches=1, nan_at=None) as watch:
        frames = watch.frames()
    figure = plot_frames(frames, roles="grads")  # forward-only watch: no gradient rows
    assert "no frames to plot" in [t.get_text() for t in figure.axes[0].texts]


def test_history_plot_defaults_to_largest_modules_and_limit_line():
    model = TinyMLP()
    with _record(model, batches=5, nan_at=None, scale=3.0) as watch:
        history = watch.history()
    figure = plot_history(history, dtype="float16", count=2)
    ax = figure.axes[0]
    peaks = history.groupby("module")["abs_max"].max().sort_values(ascending=False)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    top_two = ["<root>" if m == "" else m for m in peaks.index[:2]]
    assert labels[:2] == top_two
    assert _hlines_at(ax, 65504.0)
    assert ax.get_yscale() == "log"


def test_history_plot_marks_the_batch_where_outputs_went_bad():
    model = TinyMLP()
    with _record(model, batches=5, nan_at=3) as watch:
        history = watch.history()
    went_bad = set(history.loc[history["nonfinite"] & (history["batch"] == 3), "module"]) - {""}
    assert largest_modules(history, count=1)[-1] in went_bad  # a module that went bad joins
    figure = plot_history(history, ["fc1", "fc2"])
    labels = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert "first NaN/Inf (batch 3)" in labels


def test_history_plot_draws_merged_windows_as_bars():
    # A real History with tiny bounds: old batches merge into windows of 2.
    history = History(["", "fc"], ["Net", "Linear"], full_batches=3, max_windows=10, window=2)
    for batch in range(9):
        history.record(batch, 0, float(batch + 1), 0.1, False)
        history.record(batch, 1, 2.0 * (batch + 1), 0.1, False)
    table = history.to_dataframe()
    assert (table["batch_end"] > table["batch"]).any()
    figure = plot_history(table, ["fc"])
    bars = [c for c in figure.axes[0].collections if isinstance(c, LineCollection)]
    assert bars
    spans = {(round(seg[0][0]), round(seg[1][0])) for seg in bars[0].get_segments()}
    windows = table[(table["module"] == "fc") & (table["batch_end"] > table["batch"])]
    assert spans == set(zip(windows["batch"], windows["batch_end"]))


def test_returned_figures_display_as_png_in_ipython_without_pyplot():
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    model = TinyMLP()
    with _record(model, batches=1, nan_at=None) as watch:
        figure = plot_frames(watch.frames())
    data, _ = shell.display_formatter.format(figure)
    assert data["image/png"].startswith(b"\x89PNG")


def test_plots_work_in_a_script_without_pyplot_or_ipython():
    code = ("import sys, torch, nanwidget as nw\n"
            "from nanwidget.plots import plot_frames, plot_history\n"
            "m = torch.nn.Sequential(torch.nn.Linear(3, 3))\n"
            "w = nw.watch(m)\n"
            "m(torch.randn(2, 3))\n"
            "plot_frames(w.frames()).savefig(sys.argv[1])\n"
            "plot_history(w.history())\n"
            "assert 'matplotlib.pyplot' not in sys.modules\n"
            "assert 'IPython' not in sys.modules, 'the core and plots must not need IPython'\n")
    out = ROOT / "artifacts"
    out.mkdir(exist_ok=True)
    target = out / "plot_frames_script.png"
    subprocess.run([sys.executable, "-c", code, str(target)], check=True, cwd=ROOT,
                   env={"PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "PATH": "/usr/bin:/bin"},
                   timeout=120)
    assert target.read_bytes().startswith(b"\x89PNG")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))

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
from nanwidget.plots import largest_modules, neighbour_modules, plot_frames, plot_history
from nanwidget.plots.common import HIDPI_SCALE, display_width, figure_png

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


def _first_bad_number(frames) -> int:
    """1-based number, in buffer order, of the first frame holding a NaN/Inf."""
    keys = frames.groupby(["rank", "batch", "phase", "frame"], sort=False)
    return [i for i, (_, rows) in enumerate(keys, start=1) if (rows["nan"] | rows["inf"]).any()][0]


def _red_verticals(ax) -> list:
    return [line for line in ax.lines if line.get_color() == "red"
            and len(line.get_xdata()) == 2 and line.get_xdata()[0] == line.get_xdata()[1]]


def _drawn(figure):
    """Lay the figure out as savefig would (an Agg canvas), so that text extents are real."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(figure).draw()
    return figure


def _legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_frames_plot_draws_float16_limit_and_marks_first_bad_frame():
    model = TinyMLP().half()
    with _record(model, batches=4, nan_at=3, dtype=torch.float16, max_frames=12) as watch:
        frames = watch.event.frames
    figure = plot_frames(frames)
    ax = figure.axes[0]
    assert ax.get_yscale() == "log"
    assert len(_hlines_at(ax, 65504.0)) == 1
    # The red vertical line sits at the first frame holding a NaN (the Nth frame of the table
    # is drawn at x = N); the legend names it by its batch and frame columns.
    first_bad = _first_bad_number(frames)
    verticals = _red_verticals(ax)
    assert verticals and verticals[0].get_xdata()[0] == first_bad
    row = frames[frames["nan"] | frames["inf"]].iloc[0]
    assert f"first NaN/Inf:\nbatch {row['batch']}, frame {row['frame']}\nfc2" in _legend_texts(ax)
    assert figure_png(figure).startswith(b"\x89PNG")


def test_non_finite_frame_is_marked_at_the_top_not_drawn_as_a_dip():
    model = TinyMLP()
    with _record(model, batches=4, nan_at=3, max_frames=12) as watch:
        frames = watch.event.frames
    ax = plot_frames(frames).axes[0]
    first_bad = _first_bad_number(frames)
    abs_max_line = ax.lines[0]
    x, y = abs_max_line.get_xdata(), abs_max_line.get_ydata()
    # The bad frame has finite weights (bias) beside its NaN: no point may be drawn for it.
    assert np.isnan(y[list(x).index(first_bad)])
    triangles = [line for line in ax.lines if line.get_marker() == "v"]
    assert triangles and first_bad in list(triangles[0].get_xdata())
    assert np.allclose(triangles[0].get_ydata(), 0.965)  # axes fraction: along the top
    assert "NaN/Inf frame" in _legend_texts(ax)


def test_frames_carrying_finite_abs_max_show_the_finite_part_of_a_bad_frame():
    model = TinyMLP()
    with _record(model, batches=2, nan_at=1, max_frames=12) as watch:
        frames = watch.event.frames.copy()
    if "finite_abs_max" not in frames.columns:  # the contract's column, before the core has it
        finite = np.isfinite(frames["abs_max"])
        frames["finite_abs_max"] = frames["abs_max"].where(finite, np.nan)
        frames.loc[frames["role"] == "output", "finite_abs_max"] = 7.5
    ax = plot_frames(frames).axes[0]
    circles = [line for line in ax.lines if line.get_marker() == "o"]
    assert circles, "a bad frame's largest finite value is drawn as a hollow circle"
    first_bad = _first_bad_number(frames)
    assert list(circles[0].get_xdata()) == [first_bad]
    bad_rows = frames.groupby(["rank", "batch", "phase", "frame"], sort=False)
    expected = [rows["finite_abs_max"].max() for i, (_, rows) in enumerate(bad_rows, start=1)
                if i == first_bad][0]
    assert circles[0].get_ydata()[0] == pytest.approx(expected)


def test_legend_sits_beside_the_axes_not_on_the_data():
    model = TinyMLP()
    with _record(model, batches=5, nan_at=3, max_frames=21) as watch:
        frames, history = watch.event.frames, watch.history()
    for figure in (plot_frames(frames, current=3), plot_history(history, dtype="float32")):
        _drawn(figure)
        ax = figure.axes[0]
        legend = ax.get_legend().get_window_extent()
        assert legend.x0 >= ax.get_window_extent().x1
        assert legend.x1 <= figure.bbox.x1 + 1  # and still inside the figure


def test_figures_are_drawn_at_twice_their_display_width():
    model = TinyMLP()
    with _record(model, batches=1, nan_at=None) as watch:
        figure = plot_frames(watch.frames())
    png = figure_png(figure)
    width = int.from_bytes(png[16:20], "big")  # IHDR
    assert width == HIDPI_SCALE * display_width(figure)


def test_batch_boundaries_are_dotted_lines_labelled_along_the_top():
    model = TinyMLP()
    with _record(model, batches=3, nan_at=None, max_frames=18) as watch:
        frames = watch.frames()
    ax = plot_frames(frames).axes[0]
    dotted = [line for line in ax.lines if line.get_linestyle() == ":"]
    assert len(dotted) == frames["batch"].nunique() - 1
    labels = {t.get_text() for t in ax.texts}
    assert {f"batch {b}" for b in frames["batch"].unique()} <= labels
    # each boundary sits between the last frame of one batch and the first of the next
    per_frame = frames.groupby(["rank", "batch", "phase", "frame"], sort=False)["batch"].first()
    changes = [i + 0.5 for i in range(1, len(per_frame)) if per_frame.iat[i] != per_frame.iat[i - 1]]
    assert sorted(line.get_xdata()[0] for line in dotted) == changes


def test_hundreds_of_frames_are_drawn_as_a_window_around_the_current_one():
    model = TinyMLP()
    with _record(model, batches=70, nan_at=None, max_frames=400) as watch:
        frames = watch.frames()
    n_frames = frames.groupby(["rank", "batch", "phase", "frame"]).ngroups
    assert n_frames == 400
    ax = plot_frames(frames, current=200, window=40).axes[0]
    low, high = ax.get_xlim()
    assert (low, high) == (180 - 0.5, 219 + 0.5)
    per_frame = frames.groupby(["rank", "batch", "phase", "frame"], sort=False)["batch"].first()
    shown = per_frame.iloc[179:219]
    assert f"(40 of 400 frames: batches {shown.iat[0]}–{shown.iat[-1]})" in ax.get_title(loc="left")
    # too many frames to name each module: the ticks carry the frame column's numbers
    _drawn(ax.figure)
    numbers = per_frame.index.get_level_values("frame")
    for tick, label in zip(ax.get_xticks(), ax.get_xticklabels()):
        if low < tick < high:
            assert label.get_text() == str(numbers[int(tick) - 1])
    assert ax.get_xlabel() == "frame (hook order within its batch)"
    assert len(ax.lines[0].get_xdata()) == 40
    # a current frame at the end keeps a full window
    assert plot_frames(frames, current=400, window=40).axes[0].get_xlim() == (360.5, 400.5)
    # window=None draws everything
    assert len(plot_frames(frames, window=None).axes[0].lines[0].get_xdata()) == 400


def test_frames_plot_one_point_per_frame_from_the_chosen_roles():
    model = TinyMLP()
    with _record(model, batches=2, nan_at=None, max_frames=10) as watch:
        frames = watch.frames()
    figure = plot_frames(frames, roles="outputs")
    abs_max_line = figure.axes[0].lines[0]
    outputs = frames[frames["role"].str.startswith("output")]
    expected = outputs.groupby(["batch", "frame"], sort=False)["abs_max"].max().to_numpy()
    np.testing.assert_allclose(abs_max_line.get_ydata(), expected)


def test_frames_plot_of_a_parameters_name_draws_its_values_not_its_gradient():
    # With backward=True a backward frame holds the weight's gradient under the role "weight":
    # roles="weight" must draw the weights only, and "grads" the gradients.
    model = TinyMLP()
    with nw.watch(model, backward=True, on_nan="record") as watch:
        model(torch.randn(4, 16)).square().sum().backward()
        frames = watch.frames()
    weights = frames[(frames["role"] == "weight") & (frames["phase"] == "forward")]
    assert ((frames["role"] == "weight") & (frames["phase"] == "backward")).any()
    line = plot_frames(frames, roles="weight", window=None).axes[0].lines[0]
    np.testing.assert_allclose(line.get_ydata(), weights["abs_max"].to_numpy())
    grads = frames[frames["phase"] == "backward"]
    line = plot_frames(frames, roles="grads", window=None).axes[0].lines[0]
    assert len(line.get_ydata()) == grads.groupby(["batch", "frame"]).ngroups


def test_frames_plot_of_no_rows_says_so_without_empty_axes():
    model = TinyMLP()
    with _record(model, batches=1, nan_at=None) as watch:
        frames = watch.frames()
    figure = plot_frames(frames, roles="grads")  # forward-only watch: no gradient rows
    ax = figure.axes[0]
    assert "no frames with these roles" in [t.get_text() for t in ax.texts]
    assert not ax.axison


def test_history_plot_without_nan_defaults_to_largest_modules_and_limit_line():
    model = TinyMLP()
    with _record(model, batches=5, nan_at=None, scale=3.0) as watch:
        history = watch.history()
    figure = plot_history(history, dtype="float16", count=2)
    ax = figure.axes[0]
    peaks = history.groupby("module")["abs_max"].max().sort_values(ascending=False)
    top_two = ["<root>" if m == "" else m for m in peaks.index[:2]]
    assert _legend_texts(ax)[:2] == top_two
    assert _hlines_at(ax, 65504.0)
    assert ax.get_yscale() == "log"


class Deep(nn.Module):
    """Twelve named layers after an embedding-like first layer: a NaN from the data enters at
    `inp` and spreads to every later layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
                                    for _ in range(12))
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def test_history_plot_shows_the_event_module_and_its_neighbours():
    model = Deep()
    with torch.no_grad():  # the largest values live far from where the NaN enters
        model.layers[11][0].weight.mul_(100.0)
        model.out.weight.mul_(1e4)
    with nw.watch(model, on_nan="record") as watch:
        for batch in range(4):
            data = torch.randn(2, 8)
            if batch == 3:
                data[0, 0] = float("nan")  # from the data
            model(data)
        history, event = watch.history(), watch.event
    assert event.module == "inp" and event.origin == "input"
    expected = neighbour_modules(history, "inp", 5)
    assert expected[0] == "inp" and len(expected) == 5 and "" not in expected
    labels = _legend_texts(plot_history(history, around=event.module).axes[0])
    assert labels[:5] == expected
    # the five largest modules would not have included the event's module
    assert "inp" not in largest_modules(history.assign(
        nonfinite=False), count=5)
    # neighbours of a module in the middle lie on both sides of it
    middle = neighbour_modules(history, "layers.5.0", 5)
    assert middle.index("layers.5.0") == 2


def test_history_plot_of_one_batch_has_sane_limits_and_labels():
    model = TinyMLP()
    with _record(model, batches=1, nan_at=None) as watch:
        history = watch.history()
    ax = plot_history(history).axes[0]
    assert ax.get_xlim() == (-0.5, 0.5)
    assert [t for t in ax.get_xticks() if -0.5 <= t <= 0.5] == [0.0]
    assert ax.get_ylabel() == "abs max of outputs" and ax.get_xlabel() == "batch"
    _drawn(ax.figure)
    label = ax.yaxis.label.get_window_extent()
    assert label.x0 >= 0, "the y label is inside the figure, not pushed off by tick labels"


def test_history_plot_of_modules_that_do_not_exist_says_so():
    model = TinyMLP()
    with _record(model, batches=2, nan_at=None) as watch:
        history = watch.history()
    ax = plot_history(history, ["no.such.module"]).axes[0]
    assert not ax.axison
    assert any("none matches" in t.get_text() for t in ax.texts)


def test_history_plot_marks_the_batch_where_outputs_went_bad():
    model = TinyMLP()
    with _record(model, batches=5, nan_at=3) as watch:
        history = watch.history()
    went_bad = set(history.loc[history["nonfinite"] & (history["batch"] == 3), "module"]) - {""}
    assert largest_modules(history, count=1)[-1] in went_bad  # a module that went bad joins
    figure = plot_history(history, ["fc1", "fc2"])
    assert "first NaN/Inf: batch 3" in _legend_texts(figure.axes[0])


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


def test_returned_figures_display_in_ipython_without_pyplot_and_follow_a_dark_theme():
    import base64
    import io

    from IPython.core.interactiveshell import InteractiveShell
    from matplotlib.image import imread
    shell = InteractiveShell.instance()
    model = TinyMLP()
    with _record(model, batches=1, nan_at=None) as watch:
        figure = plot_frames(watch.frames())
    data, metadata = shell.display_formatter.format(figure)
    assert data["image/png"].startswith(b"\x89PNG")
    # drawn at twice the size, shown at the figure's size: sharp on HiDPI screens
    assert metadata["image/png"]["width"] == display_width(figure)
    html = data["text/html"]
    # JupyterLab shows the HTML: transparent, turned light by a dark theme's rule ...
    assert "body[data-jp-theme-light='false'] img.nw-figure" in html and "invert(1)" in html
    themed = imread(io.BytesIO(base64.b64decode(html.split("base64,")[1].split("'")[0])))
    assert themed.shape[2] == 4 and themed[0, 0, 3] == 0
    # ... on white where that rule is stripped, and plain PNG is the same drawing on white
    assert "style='background:#fff'" in html
    plain = imread(io.BytesIO(data["image/png"]))
    assert plain.shape[:2] == themed.shape[:2] and (plain[0, 0, :3] == 1).all()


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


# ---------------------------------------------------------------------------- long names, edges
class LongNames(nn.Module):
    """Module names as deep as a transformer's: "encoder.layers.0.self_attn.out_proj"."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.classification_head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classification_head(self.encoder(x))


def _ink_at_the_edges(png: bytes, border: int = 2) -> bool:
    """Whether anything is drawn in the outermost pixels of a transparent PNG: a text cut by
    the figure's edge leaves ink there."""
    import io

    from matplotlib.image import imread
    alpha = imread(io.BytesIO(png))[..., 3]
    edges = np.concatenate([alpha[:border].ravel(), alpha[-border:].ravel(),
                            alpha[:, :border].ravel(), alpha[:, -border:].ravel()])
    return bool((edges > 0).any())


def _inside(figure) -> bool:
    _drawn(figure)
    box = figure.get_tightbbox(figure.canvas.get_renderer())
    width, height = figure.get_size_inches()
    return box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height


def test_long_module_names_keep_their_start_and_end():
    from nanwidget.plots.common import short_label
    for name, limit in (("transformer.h.0.mlp.c_fc", 20), ("encoder.layers.0.norm2", 16),
                        ("encoder.layers.1.self_attn.out_proj", 16), ("x" * 40, 12)):
        label = short_label(name, limit)
        assert len(label) == limit and "…" in label
        start, end = label.split("…")
        assert name.startswith(start) and name.endswith(end) and len(start) >= 4
    assert short_label("encoder.layers.0.norm2", 16).endswith("0.norm2")  # which layer stays
    assert short_label("fc1") == "fc1" and short_label("") == "<root>"


def test_every_text_of_every_plot_stays_inside_the_figure():
    torch.manual_seed(0)
    model = LongNames()
    with nw.watch(model, on_nan="record", max_frames=21, backward=True) as watch:
        for batch in range(4):
            if batch == 3:  # outputs near float32's largest: its limit line shows
                with torch.no_grad():
                    model.classification_head.weight.mul_(1e33)
            model(torch.randn(2, 5, 8)).sum().backward()
            watch.check_grad_norms()
        frames, history, grads = watch.frames(), watch.history(), watch.grad_history()
    frames = frames[frames["phase"] == "forward"]
    figures = {
        "frames, named ticks": plot_frames(frames.iloc[:60], window=None),
        "frames, numbered ticks": plot_frames(frames, window=None),
        "history, long names and the float32 limit": plot_history(
            history, ["classification_head", "encoder.layers.1.linear2", "encoder.layers.0.norm2",
                      "encoder.layers.1.self_attn", "encoder.layers.1.dropout2"], dtype="float32"),
        "gradient norms": nw.plots.plot_grad_norms(grads, threshold=1.0),
    }
    legends = _legend_texts(figures["history, long names and the float32 limit"].axes[0])
    assert "float32 max 3.4e+38" in legends
    assert any(label.startswith("encoder.") and "…" in label for label in legends)
    for what, figure in figures.items():
        assert _inside(figure), what
        assert not _ink_at_the_edges(figure_png(figure, transparent=True)), what


def test_module_names_under_ticks_never_overlap():
    torch.manual_seed(0)
    model = LongNames()
    with nw.watch(model, on_nan="record", max_frames=40) as watch:
        for _ in range(2):
            model(torch.randn(2, 5, 8))
        frames = watch.frames()
    named = []
    for count in (8, 21, 30):
        keys = frames.groupby(["rank", "batch", "phase", "frame"], sort=False).ngroup()
        figure = _drawn(plot_frames(frames[keys >= keys.max() + 1 - count], window=None))
        ax = figure.axes[0]
        labels = [label for label in ax.get_xticklabels() if label.get_text()]
        if not ax.get_xlabel().startswith("frames: the module"):  # no room: frame numbers
            assert count > 8 and all(label.get_text().isdigit() for label in labels)
            continue
        named.append(count)
        assert len(labels) == count
        renderer = figure.canvas.get_renderer()
        _, height, _ = renderer.get_text_width_height_descent(
            "Mg", labels[0].get_fontproperties(), ismath=False)
        ticks = ax.transData.transform([(x, 1) for x in ax.get_xticks()[:2]])
        spacing = ticks[1][0] - ticks[0][0]
        slant = np.radians(labels[0].get_rotation())
        # neighbouring labels are parallel: they clear each other, with a gap that reads as
        # one, when their distance across the text is a line of text and a bit
        assert spacing * np.sin(slant) >= 1.15 * height, (count, spacing, labels[0].get_rotation())
    assert named[:2] == [8, 21]  # names wherever they fit


def test_gradient_norms_of_exactly_zero_are_shown_on_the_log_axis():
    from nanwidget.plots import plot_grad_norms

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.gate = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + 0 * self.gate(x)  # the gate gets gradients of exactly zero

    torch.manual_seed(0)
    model = Gated()
    with nw.watch(model, on_nan="record") as watch:
        for step in range(4):
            model.zero_grad()
            model(torch.randn(2, 3)).sum().backward()
            watch.check_grad_norms()
        history = watch.grad_history()
    zero = history[history["norm"] == 0]
    assert set(zero["param"]) == {"gate.weight", "gate.bias"}
    ax = plot_grad_norms(history).axes[0]
    (marks,) = [c for c in ax.collections if str(c.get_label()).startswith("norm 0")]
    assert marks.get_label() == "norm 0: gate.weight, gate.bias"
    assert sorted(marks.get_offsets()[:, 0]) == sorted(zero["batch"].astype(float))
    assert "norm 0: gate.weight, gate.bias" in _legend_texts(ax)

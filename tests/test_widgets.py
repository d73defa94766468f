"""FrameBrowser driven like a user would: click, type, choose; assert what it shows."""

from __future__ import annotations

import html
import time

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import nanwidget as nw
from nanwidget.widgets import FrameBrowser

from conftest import TinyMLP



def _watch_with_nan(model: nn.Module, *, nan_at: int = 3, batches: int = 4,
                    dtype: torch.dtype = torch.float32, **options) -> nw.NanWatch:
    """Record ``batches`` batches; fc2's weight becomes NaN before batch ``nan_at``."""
    options.setdefault("max_frames", 12)
    watch = nw.watch(model, on_nan="record", **options)
    for batch in range(batches):
        if batch == nan_at:
            with torch.no_grad():
                model.fc2.weight[0, 0] = float("nan")
        model(torch.randn(4, 16, dtype=dtype))
    return watch


@pytest.fixture
def recorded(tiny_mlp):
    watch = _watch_with_nan(tiny_mlp)
    yield watch
    watch.close()


def _head(browser: FrameBrowser) -> str:
    return browser.table.value.split("</div>")[0]


def _marker_centre(browser: FrameBrowser) -> float:
    """Where the current-frame band sits over the frames plot, as a fraction of its width."""
    style = browser.frame_marker.value.split("style='")[1].split("'")[0]
    values = dict(part.split(":", 1) for part in style.split(";") if part)
    return (float(values["left"].rstrip("%")) + float(values["width"].rstrip("%")) / 2) / 100


def test_browser_opens_at_the_event_frame_and_names_it_in_status(recorded):
    browser = FrameBrowser(recorded, plots=False)
    assert "<b>fc2</b> (Linear)" in _head(browser)
    assert "<b>batch 3, frame 2</b>" in _head(browser)  # fc2 is the third hook of batch 3
    assert browser.frame.value == browser.frame.max == 12  # the last of the 12 frames held
    assert "nw-nonfinite" in browser.table.value
    status = browser.status.value
    assert "12 frames" in status and "batches 1–3" in status
    assert "nan in batch 3 at module 'fc2'" in status


def test_every_part_carries_its_contract_css_class(recorded):
    browser = FrameBrowser(recorded)
    found: set[str] = set()

    def walk(widget):
        found.update(widget._dom_classes)
        for child in getattr(widget, "children", ()):
            walk(child)
    walk(browser)
    assert browser._view_name == "VBoxView"  # our own attributes must not shadow widget traits
    contract = {"nw-browser", "nw-status", "nw-prev", "nw-next", "nw-first-bad", "nw-frame",
                "nw-frame-table", "nw-filter-layer", "nw-filter-type", "nw-filter-role",
                "nw-only-bad", "nw-plot", "nw-batch", "nw-rerun", "nw-trace", "nw-export"}
    assert contract <= found


def test_step_back_and_forward_with_buttons_and_slider(recorded):
    browser = FrameBrowser(recorded, plots=False)
    at_event = browser.frame.value
    browser.prev.click()
    assert browser.frame.value == at_event - 1
    assert "<b>act</b> (ReLU)" in _head(browser)
    browser.next.click()
    assert "<b>fc2</b>" in _head(browser)
    browser.frame.value = 1  # the slider's first position: the oldest frame held
    first = browser.filtered_frames.iloc[0]
    name = f"batch {first['batch']}, frame {first['frame']}"
    assert f"<b>{name}</b>" in _head(browser) and name in browser.frame_label.value
    browser.prev.click()  # clamped at the first frame
    assert browser.frame.value == 1


def test_frames_are_named_as_the_exported_table_names_them(recorded):
    """One numbering: the label, the heading and the marker name each frame by the batch and
    frame columns of the CSV that "export" downloads."""
    import base64
    import io
    browser = FrameBrowser(recorded)
    browser.export.click()
    encoded = browser.export_link.value.split("href='data:text/csv;base64,")[1].split("'")[0]
    exported = pd.read_csv(io.BytesIO(base64.b64decode(encoded)))
    frames = exported.drop_duplicates(["rank", "batch", "phase", "frame"])
    assert len(frames) == browser.frame.max == 12
    for number, row in enumerate(frames.itertuples(), start=1):
        browser.frame.value = number
        name = f"batch {row.batch}, frame {row.frame}"
        assert name in browser.frame_label.value
        module = html.escape(row.module if isinstance(row.module, str) else "<root>")
        assert f"<b>{name}</b> · <b>{module}</b>" in _head(browser)
        assert f"title='{name}: {module}'" in browser.frame_marker.value
    assert "hook" not in browser.table.value  # no second word for the same number


def test_jump_to_first_bad_frame_from_anywhere(recorded):
    browser = FrameBrowser(recorded, plots=False)
    browser.frame.value = 1
    assert "nw-nonfinite" not in browser.table.value
    browser.first_bad.click()
    assert "<b>fc2</b>" in _head(browser) and "nw-nonfinite" in browser.table.value


def test_first_bad_says_so_when_nothing_is_bad(tiny_mlp):
    with nw.watch(tiny_mlp) as watch:
        tiny_mlp(torch.randn(2, 16))
        browser = FrameBrowser(watch, plots=False)
    assert "no NaN/Inf seen" in browser.status.value
    before = browser.frame.value
    assert browser.jump_to_first_bad() is False
    assert browser.frame.value == before
    assert "no NaN/Inf frame under these filters" in browser.status.value


def test_layer_filter_takes_substring_then_regex(recorded):
    browser = FrameBrowser(recorded, plots=False)
    browser.filter_layer.value = "fc"
    modules = set(browser.filtered_frames["module"])
    assert modules == {"fc1", "fc2"}
    assert "match the filters" in browser.status.value
    browser.filter_layer.value = r"^fc\d$"
    assert set(browser.filtered_frames["module"]) == {"fc1", "fc2"}
    browser.filter_layer.value = "h.ad"  # a regex: '.' matches the 'e'
    assert set(browser.filtered_frames["module"]) == {"head"}
    browser.filter_layer.value = ""
    assert len(browser.filtered_frames) == len(browser.index.table)


def test_an_invalid_layer_pattern_is_called_invalid(recorded):
    browser = FrameBrowser(recorded)
    browser.filter_layer.value = "fc["  # not a valid regex: taken literally, matches nothing
    assert browser.filtered_frames.empty
    for shown in (browser.table.value, browser.status.value, browser.plot_note.value):
        assert "No frames match the filters" in shown or "match the filters" in shown
        assert "&#x27;fc[&#x27; is not a valid regular expression" in shown
        assert "matched as plain text" in shown
    assert "nw-invalid" in browser.filter_layer._dom_classes
    browser.filter_layer.value = "fc"  # valid again: the message and the red border go
    assert "not a valid" not in browser.status.value + browser.table.value
    assert "nw-invalid" not in browser.filter_layer._dom_classes


def test_type_role_and_only_bad_filters_narrow_the_table(recorded):
    browser = FrameBrowser(recorded, plots=False)
    browser.filter_type.value = "ReLU"
    assert set(browser.filtered_frames["module_type"]) == {"ReLU"}
    assert "(ReLU)" in _head(browser)
    browser.filter_type.value = "(all types)"
    browser.filter_role.value = "weights"
    assert set(browser.filtered_frames["role"]) == {"weight", "bias"}
    assert "input[0]" not in browser.table.value
    browser.filter_role.value = ""
    browser.only_bad.value = True
    rows = browser.filtered_frames
    assert len(rows) and (rows["nan"] | rows["inf"]).all()
    browser.frame.value = 1
    assert "nw-nonfinite" in browser.table.value


def test_the_frames_plot_marks_the_current_frame_and_follows_every_step(recorded):
    from nanwidget.plots import plot_frames
    browser = FrameBrowser(recorded)
    # The band sits where the plot draws frame N, for the frame number the slider shows.
    figure = plot_frames(browser.filtered_frames)
    ax = figure.axes[0]
    width = figure.get_figwidth() * figure.dpi

    def plotted_at(number: int) -> float:
        return ax.transData.transform((number, 1.0))[0] / width

    assert browser.frame.value == 12
    assert _marker_centre(browser) == pytest.approx(plotted_at(12), abs=1e-3)
    browser.prev.click()
    assert _marker_centre(browser) == pytest.approx(plotted_at(11), abs=1e-3)
    browser.frame.value = 3  # the slider
    assert _marker_centre(browser) == pytest.approx(plotted_at(3), abs=1e-3)
    assert "title='batch 1, frame 5: &lt;root&gt;'" in browser.frame_marker.value  # names it
    browser.next.click()
    assert _marker_centre(browser) == pytest.approx(plotted_at(4), abs=1e-3)
    browser.first_bad.click()
    assert _marker_centre(browser) == pytest.approx(plotted_at(browser.frame.value), abs=1e-3)


def test_hundreds_of_frames_plot_a_window_that_follows_the_current_frame():
    model = DeepLinear(20)
    with nw.watch(model, on_nan="record", max_frames=420) as watch:
        for _ in range(20):
            model(torch.randn(2, 4))
        browser = FrameBrowser(watch)
    assert browser.frame.max == 420
    first, last = browser._frames_window
    assert last - first + 1 == 40 and first <= browser.frame.value <= last
    before = bytes(browser.frames_image.value)
    browser.prev.click()  # inside the window: the plot stays, only the band moves
    assert bytes(browser.frames_image.value) == before
    browser.frame.value = 1  # far outside: the window moves to it
    first, last = browser._frames_window
    assert first == 1 and last == 40
    assert bytes(browser.frames_image.value) != before
    assert 0 < _marker_centre(browser) < 0.2


def test_a_filter_with_no_match_says_so_instead_of_drawing_empty_plots(recorded):
    browser = FrameBrowser(recorded)
    browser.filter_layer.value = "no_such_layer"
    assert browser.frames_plot.layout.display == "none"
    assert "no frames match the filters" in browser.plot_note.value
    browser.plot_choice.value = "history"
    assert browser.history_image.layout.display == "none"
    assert "no module matches the filters" in browser.plot_note.value
    browser.filter_layer.value = ""
    assert browser.history_image.layout.display is None and browser.plot_note.value == ""
    browser.plot_choice.value = "frames"
    assert browser.frames_plot.layout.display is None


def test_history_plot_opens_on_the_event_module_and_its_neighbours(recorded):
    browser = FrameBrowser(recorded)
    assert recorded.event.module == "fc2"
    assert browser.history_modules() == ["fc1", "act", "fc2", "head"]
    browser.filter_type.value = "Linear"  # a filter narrows it, the event's module first
    assert browser.history_modules() == ["fc2", "fc1", "head"]
    browser.plot_choice.value = "history"
    assert bytes(browser.history_image.value).startswith(b"\x89PNG")


def test_static_copy_holds_the_event_line_the_frame_table_and_both_plots(recorded):
    import base64
    browser = FrameBrowser(recorded)
    browser.prev.click()
    copy = browser.static_html()
    assert "nan in batch 3 at module 'fc2'" in copy
    assert "<b>batch 3, frame 1</b>" in copy and "nw-static-table" in copy
    assert "class='nw-frame-table'" not in copy  # the contract's classes stay unique
    images = copy.split("src='data:image/png;base64,")[1:]
    assert len(images) == 2
    for image in images:
        assert base64.b64decode(image.split("'")[0]).startswith(b"\x89PNG")
    assert "class='nw-marker'" in copy  # the current frame is marked in the copy too
    # hidden exactly while this browser's live view is on the page
    assert f"body:has(.nw-live-{browser.model_id}) .nw-static-{browser.model_id}" in copy
    assert f"nw-live-{browser.model_id}" in browser._dom_classes


def test_displaying_the_browser_leaves_the_widget_and_its_static_copy(recorded):
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.display import display
    from IPython.utils.capture import capture_output
    InteractiveShell.instance()
    browser = FrameBrowser(recorded)
    with capture_output() as captured:
        display(browser)
    kinds = [set(output.data) for output in captured.outputs]
    assert len(kinds) == 2
    assert "application/vnd.jupyter.widget-view+json" in kinds[0]
    assert "text/html" in kinds[1] and "nw-static" in captured.outputs[1].data["text/html"]
    with capture_output() as captured:
        display(FrameBrowser(recorded, static_copy=False))
    assert len(captured.outputs) == 1


def test_the_text_a_viewer_without_widgets_shows_is_the_status_in_words(recorded):
    text = FrameBrowser(recorded)._repr_mimebundle_()["text/plain"]
    assert text.startswith("nanwidget FrameBrowser: 12 frames (")
    assert recorded.event.summary() in text and recorded.event.diagnosis.kind in text
    assert "<" not in text and "&#" not in text and "children=" not in text
    empty = nw.watch(TinyMLP())
    assert FrameBrowser(empty)._repr_mimebundle_()["text/plain"] == (
        "nanwidget FrameBrowser: no frames held · no NaN/Inf seen")
    empty.close()


def test_colours_come_from_the_jupyterlab_theme_with_a_dark_variant(recorded):
    browser = FrameBrowser(recorded, plots=False)
    sheet = browser.style.value
    assert "var(--jp-error-color0" in sheet and "var(--jp-error-color2" in sheet
    assert 'body[data-jp-theme-light="false"]' in sheet
    assert 'body[data-jp-theme-light="false"] .nw-browser .nw-plot-image' in sheet
    # the event text and bad rows use the alert colour, not a fixed red
    assert "#b00000" not in browser.status.value.replace("var(--nw-alert-fg,#b00000)", "")
    assert "nw-alert" in browser.status.value and "var(--nw-alert-bg" in browser.table.value


def test_a_trace_without_a_user_line_says_so_instead_of_a_dangling_at():
    from nanwidget.core.trace import Trace, empty_ops
    first_bad = pd.Series({"op": "log", "aten": "aten.log.default", "phase": "forward",
                           "module": "fc2", "module_type": "Linear", "nan": True, "inf": False,
                           "source": ""})  # the op ran with no user frame on the stack
    trace = Trace(batch=0, frames=pd.DataFrame(), ops=empty_ops(), first_bad=first_bad)
    browser = FrameBrowser(trace, plots=False)
    head = browser.trace.value.split("</div>")[0]
    assert "first bad op: log</b> in module fc2" in head
    assert " at " not in head.replace("first bad op", "") and "no line of your code" in head


def test_filters_apply_to_the_frames_plot(recorded):
    browser = FrameBrowser(recorded)
    everything = bytes(browser.frames_image.value)
    assert everything.startswith(b"\x89PNG")
    browser.filter_layer.value = "fc1"
    assert bytes(browser.frames_image.value).startswith(b"\x89PNG")
    assert bytes(browser.frames_image.value) != everything


def test_values_near_float16_limit_are_marked():
    model = TinyMLP().half()
    with nw.watch(model, on_nan="record") as watch:
        with torch.no_grad():
            model.head.weight.mul_(10000.0)
        model(torch.ones(2, 16, dtype=torch.float16) * 8)
        frames = watch.frames()
    head_out = frames[(frames["module"] == "head") & (frames["role"] == "output")]["abs_max"].iat[0]
    assert 6550.4 < head_out < 65504  # the model really comes near the limit, still finite
    browser = FrameBrowser(frames, plots=False)
    browser.filter_layer.value = "^head$"
    assert "nw-near-limit" in browser.table.value
    assert "near float16 max" in browser.table.value


def test_plots_are_drawn_on_a_transparent_background_for_the_theme(recorded):
    import io

    from matplotlib.image import imread
    browser = FrameBrowser(recorded)
    browser.plot_choice.value = "history"
    for image in (browser.frames_image, browser.history_image):
        assert "nw-plot-image" in image._dom_classes  # the class the dark theme inverts
        pixels = imread(io.BytesIO(bytes(image.value)))
        assert pixels.shape[2] == 4 and pixels[0, 0, 3] == 0  # the corner shows the page
        assert (pixels[..., 3] > 0).mean() > 0.02  # the drawing itself is there
    assert browser.static_html().count("class='nw-plot-image'") == 2


def test_export_downloads_the_filtered_frames_in_one_click(recorded):
    import base64
    import io
    browser = FrameBrowser(recorded, plots=False)
    browser.filter_layer.value = "fc2"
    browser.export.click()
    link = browser.export_link.value
    assert "<a class='nw-download' download='nanwidget-frames-" in link and ".csv'" in link
    encoded = link.split("href='data:text/csv;base64,")[1].split("'")[0]
    written = pd.read_csv(io.BytesIO(base64.b64decode(encoded)))
    assert len(written) == len(browser.filtered_frames)
    assert set(written["module"]) == {"fc2"} and bool(written["nan"].any())
    assert f"downloading {len(written)} rows" in link
    # The click itself starts the download: a script in the page saves the same file.
    (script,) = browser.download_script.outputs
    source = script["data"]["application/javascript"]
    name = link.split("download='")[1].split("'")[0]
    assert f'link.download = "{name}"' in source and encoded in source and "link.click()" in source
    browser.export.click()  # a second click: one script again, not two
    assert len(browser.download_script.outputs) == 1


def test_save_writes_the_filtered_frames_to_a_chosen_path(recorded, tmp_path):
    browser = FrameBrowser(recorded, plots=False, export_dir=tmp_path / "default")
    browser.filter_layer.value = "fc2"
    for name, read in (("chosen.csv", pd.read_csv), ("sub/chosen.parquet", pd.read_parquet)):
        browser.save_path.value = str(tmp_path / name)
        browser.save.click()
        assert browser.last_export == (tmp_path / name).resolve()
        assert str(browser.last_export) in browser.export_link.value
        written = read(browser.last_export)
        assert len(written) == len(browser.filtered_frames) and set(written["module"]) == {"fc2"}
    browser.save_path.value = str(tmp_path / "folder")  # a folder: a timestamped file in it
    browser.save.click()
    assert browser.last_export.parent == (tmp_path / "folder").resolve()
    before = browser.last_export
    browser.save_path.value = "  "  # nothing typed: asks for a path, writes nothing
    browser.save.click()
    assert "type where to save first" in browser.export_link.value
    assert browser.last_export == before and not (tmp_path / "default").exists()
    browser.save_path.value = str(tmp_path / "frames.xlsx")
    before = browser.last_export
    browser.save.click()  # refused in words, nothing written, no exception into the notebook
    assert "could not save" in browser.export_link.value and ".csv or .parquet" in \
        browser.export_link.value
    assert browser.last_export == before and not (tmp_path / "frames.xlsx").exists()


def test_rerun_replays_the_chosen_batch_and_shows_the_trace(tiny_mlp):
    watch = _watch_with_nan(tiny_mlp, keep_batches=4)
    try:
        browser = FrameBrowser(watch, plots=False)
        assert browser.batch.value == 3
        browser.rerun.click()
        assert browser.last_trace is not None, browser.trace.value
        # fc2's weight is NaN: no op of the replay made it, and the headline says where it was.
        assert "no op made the first NaN/Inf" in browser.trace.value
        assert "module &#x27;fc2&#x27;" in browser.trace.value and "weight" in browser.trace.value
        assert any(name.startswith("trace of re-run batch 3") for name in browser.view.options)
    finally:
        watch.close()


def test_rerun_of_an_event_made_in_the_loss_runs_the_watchs_loss_fn():
    # The button replayed the forward only: "all 3 ops produced finite values" for a NaN that
    # the watch's own loss_fn made.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8)

    def loss_fn(out):
        return torch.sqrt(out[:, 0]).mean()  # NaN made in the loss

    with nw.watch(model, backward=True, loss_fn=loss_fn) as watch:
        with pytest.raises(nw.NanDetected):
            loss_fn(model(x)).backward()
    browser = FrameBrowser(watch, plots=False)
    trace = browser.rerun_batch()
    assert trace.reproduced and trace.first_bad["op"] == "sqrt"
    head = browser.trace.value.split("</div>")[0]
    assert "first bad op: sqrt</b> in loss_fn at" in head


def test_sources_other_than_a_watch_cannot_rerun(recorded):
    for source in (recorded.frames(), recorded.event):
        browser = FrameBrowser(source, plots=False)
        assert browser.rerun.disabled
        assert "needs a live watch" in browser.trace.value


def test_event_source_opens_at_its_frame(recorded):
    browser = FrameBrowser(recorded.event, plots=False)
    assert "<b>fc2</b>" in _head(browser)
    assert recorded.event.summary().split(",")[0] in browser.status.value


def test_views_switch_between_event_and_latest_frames(tiny_mlp):
    watch = _watch_with_nan(tiny_mlp, nan_at=1, batches=4, trace_batches=[0])
    try:
        browser = FrameBrowser(watch, plots=False)
        options = list(browser.view.options)
        assert options[0].startswith("event 1: nan at fc2, batch 1")
        assert "frames held (latest)" in options and "trace batch 0" in options
        browser.view.value = "trace batch 0"
        assert set(browser.filtered_frames["batch"]) == {0}
        browser.view.value = "frames held (latest)"
        assert max(browser.index.batches) == 3
    finally:
        watch.close()


def test_refresh_reads_frames_the_live_watch_recorded_since(tiny_mlp):
    with nw.watch(tiny_mlp, on_nan="record", max_frames=30) as watch:
        tiny_mlp(torch.randn(2, 16))
        browser = FrameBrowser(watch, plots=False)
        assert browser.index.batches == [0]
        tiny_mlp(torch.randn(2, 16))
        browser.refresh.click()
        assert browser.index.batches == [0, 1]
        assert "batches 0–1" in browser.status.value
        with torch.no_grad():
            tiny_mlp.fc2.weight[0, 0] = float("nan")
        tiny_mlp(torch.randn(2, 16))
        browser.refresh.click()  # the new event appears and its view opens
        assert "nan in batch 2 at module 'fc2'" in browser.status.value
        assert browser.view.options[0].startswith("event 1: nan at fc2, batch 2")


def test_gradient_frames_are_found_with_the_grads_filter(tiny_mlp):
    with nw.watch(tiny_mlp, on_nan="record", backward=True, max_frames=30) as watch:
        for batch in range(3):
            output = tiny_mlp(torch.randn(4, 16))
            if batch == 2:
                output = output * float("inf")  # finite forward, infinite gradient
            output.sum().backward()
        browser = FrameBrowser(watch, plots=False)
    assert "(backward)" in browser.status.value
    assert "backward" in _head(browser) and "nw-nonfinite" in browser.table.value
    browser.filter_role.value = "grads"
    rows = browser.filtered_frames
    assert len(rows) and set(rows["phase"]) == {"backward"}
    # the gradients modules received, and their own parameters' gradients by name
    assert set(rows["role"]) == {"grad_output[0]", "grad_input[0]", "weight", "bias"}


def test_loaded_run_opens_at_its_event(tmp_path):
    model = TinyMLP()
    watch = _watch_with_nan(model, log_dir=str(tmp_path / "run"))
    watch.close()
    run = nw.load_run(str(tmp_path / "run"))
    browser = FrameBrowser(run, plots=False)
    assert "<b>fc2</b>" in _head(browser)
    assert "nan in batch 3 at module 'fc2'" in browser.status.value
    assert browser.rerun.disabled and "loaded run" in browser.trace.value


def test_watch_browse_gives_a_browser(recorded):
    assert isinstance(recorded.browse(), FrameBrowser)
    assert isinstance(nw.FrameBrowser(recorded.frames()), FrameBrowser)


def test_unknown_source_is_refused_with_a_clear_message():
    with pytest.raises(TypeError, match="FrameBrowser opens a NanWatch"):
        FrameBrowser([1, 2, 3])


class DeepLinear(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_ten_thousand_rows_build_fast_and_step_fast():
    model = DeepLinear(50)
    with nw.watch(model, on_nan="record", max_frames=2600) as watch:
        for batch in range(52):
            if batch == 50:
                with torch.no_grad():
                    model.layers[30].weight[0, 0] = float("nan")
            model(torch.randn(2, 4))
        started = time.perf_counter()
        browser = FrameBrowser(watch)
        build = time.perf_counter() - started
    assert len(browser.index.table) >= 10_000
    steps = []
    for _ in range(30):
        started = time.perf_counter()
        browser.prev.click()
        steps.append(time.perf_counter() - started)
    print(f"\n10k rows: build {build:.3f} s, step median {np.median(steps) * 1e3:.1f} ms, "
          f"max {max(steps) * 1e3:.1f} ms")
    # Targets are 1 s and 100 ms; the margins absorb a busy shared CI machine.
    assert build < 3.0
    assert np.median(steps) < 0.1


def test_one_frame_held_is_said_in_the_singular():
    model = nn.Linear(4, 2)
    with nw.watch(model, max_frames=1) as w:
        model(torch.randn(3, 4))
    text = FrameBrowser(w)._repr_mimebundle_()["text/plain"]
    assert text.startswith("nanwidget FrameBrowser: 1 frame (")

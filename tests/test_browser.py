"""The FrameBrowser in real browsers: JupyterLab and Voila on 127.0.0.1, driven by headless Chromium.

JupyterLab (one server for the module) covers what a notebook user meets: the compact layout at
1280x800, the current-frame marker following ◀/▶ and the slider, the export reaching the
browser as a download, the dark theme's contrast, Kernel > Interrupt on a %%nanwatch cell, and
a saved notebook reopened without its widgets. Voila covers the widget's controls end to end.
Screenshots go to artifacts/ (NANWIDGET_UPDATE_SCREENSHOT=1 also copies them to docs/).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import time
from pathlib import Path

import pandas as pd
import pytest

from jupyter_servers import (CHROMIUM, CHROMIUM_ARGS, ROOT, lab_command, open_in_lab,
                             run_all_cells, start_lab, start_voila, write_notebook)

TIMEOUT_MS = 120_000  # a kernel start and a page load on a busy 2-core machine
ARTIFACTS = ROOT / "artifacts"

pytestmark = [pytest.mark.browser, pytest.mark.slow]

_missing = [name for name in ("voila", "playwright", "jupyterlab")
            if importlib.util.find_spec(name) is None]
if not os.path.exists(CHROMIUM):
    _missing.append(CHROMIUM)
if _missing:
    pytestmark.append(pytest.mark.skip(reason=f"real-browser tests need {', '.join(_missing)}"))


RECORDED = """\
import torch
from torch import nn
import nanwidget as nw

torch.manual_seed(0)

class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        self.shift = 0.0

    def forward(self, x):
        hidden = self.act(self.fc1(x))
        hidden = torch.sqrt(hidden - self.shift)  # NaN once shifted: made between modules
        return self.head(self.act(self.fc2(hidden)))

model = TinyMLP()
watch = nw.watch(model, on_nan="record", max_frames={frames})
for batch in range(4):
    if batch == 3:
        model.shift = 0.5
    model(torch.randn(4, 16))
browser = nw.FrameBrowser(watch)
browser
"""

INTERRUPT_SETUP = """\
import time
import torch
from torch import nn
import nanwidget as nw
%load_ext nanwidget
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
"""
INTERRUPT_CELL = """\
%%nanwatch model
for step in range(100_000):
    model(torch.randn(4, 16))
    time.sleep(0.02)
"""
AFTER_INTERRUPT = "print('this cell ran after the interrupt')"

# WCAG contrast of an element's text against what is really behind it (backgrounds composited
# up the tree until an opaque one).
CONTRAST_JS = """(element) => {
  const parse = (text) => {
    const parts = text.match(/rgba?\\(([^)]+)\\)/)[1].split(',').map(Number);
    return {r: parts[0], g: parts[1], b: parts[2], a: parts.length > 3 ? parts[3] : 1};
  };
  const over = (top, bottom) => ({
    r: top.r * top.a + bottom.r * (1 - top.a), g: top.g * top.a + bottom.g * (1 - top.a),
    b: top.b * top.a + bottom.b * (1 - top.a), a: 1});
  const layers = [];
  for (let node = element; node && node.nodeType === 1; node = node.parentElement) {
    const background = parse(getComputedStyle(node).backgroundColor);
    if (background.a > 0) layers.push(background);
    if (background.a >= 1) break;
  }
  let background = {r: 255, g: 255, b: 255, a: 1};
  for (let i = layers.length - 1; i >= 0; i--) background = over(layers[i], background);
  const text = over(parse(getComputedStyle(element).color), background);
  const channel = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
  const luminance = (c) => 0.2126 * channel(c.r) + 0.7152 * channel(c.g) + 0.0722 * channel(c.b);
  const [a, b] = [luminance(text), luminance(background)];
  return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
}"""

README_PICTURES = {"framebrowser.png", "lab-1280x800.png", "lab-dark.png", "lab-reopened.png"}

ALERT_PARTS = {"event line": ".nw-status .nw-alert",
               "frame heading flag": ".nw-frame-head .nw-alert",
               "non-finite table row": ".nw-frame-table tr.nw-nonfinite td",
               "first bad op header": ".nw-trace-head .nw-alert"}


def _save_screenshot(page_or_locator, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page_or_locator.screenshot(path=str(path))
    if os.environ.get("NANWIDGET_UPDATE_SCREENSHOT") and name in README_PICTURES:  # on request
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copyfile(path, ROOT / "docs" / name)
    return path


# ---------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def chromium():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from jupyter_client.kernelspec import find_kernel_specs
    assert "python3" in find_kernel_specs(), (
        "JupyterLab needs a python3 kernelspec; install one with: python -m ipykernel install --user")
    folder = tmp_path_factory.mktemp("lab")
    write_notebook(folder / "recorded.ipynb", RECORDED.format(frames=21))
    write_notebook(folder / "reopened.ipynb", RECORDED.format(frames=21))
    write_notebook(folder / "interrupt.ipynb", INTERRUPT_SETUP, INTERRUPT_CELL, AFTER_INTERRUPT)
    server = start_lab(folder)
    server.folder = folder
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def recorded_page(lab, chromium):
    """recorded.ipynb run in JupyterLab at 1280x800 (the default layout: file browser open)."""
    context = chromium.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    open_in_lab(page, lab, "recorded.ipynb")
    run_all_cells(page)
    page.locator(".nw-browser").wait_for(state="visible")
    page.wait_for_function("() => { const i = document.querySelector('.nw-plot-frames');"
                           " return i && i.complete && i.naturalWidth > 500; }")
    try:
        yield page
    finally:
        context.close()


def _box(page, selector: str) -> dict:
    element = page.locator(selector).first
    # A theme swap or a re-render can hide it for a moment: give it the time a user would.
    element.wait_for(state="visible", timeout=15_000)
    box = element.bounding_box()
    assert box is not None, f"{selector} is not displayed"
    return box


def _heading(page) -> str:
    return page.locator(".nw-browser .nw-frame-head").inner_text()


def _marker_centre(page) -> float:
    box = _box(page, ".nw-browser .nw-marker")
    return box["x"] + box["width"] / 2


# ---------------------------------------------------------------------------------- JupyterLab
def test_lab_compact_layout_shows_controls_plot_and_table_together(recorded_page):
    page = recorded_page
    page.locator(".nw-browser").evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(300)
    widget = _box(page, ".nw-browser")
    notebook = _box(page, ".jp-NotebookPanel-notebook")
    visible_bottom = notebook["y"] + notebook["height"]
    assert widget["height"] <= 600, widget
    for part in (".nw-status", ".nw-prev", ".nw-next", ".nw-frame", ".nw-first-bad",
                 ".nw-filter-layer", ".nw-rerun", ".nw-export", ".nw-plot-frames",
                 ".nw-frame-head", ".nw-frame-table tr.nw-nonfinite"):
        box = _box(page, part)
        assert notebook["y"] - 1 <= box["y"] and box["y"] + box["height"] <= visible_bottom + 1, \
            f"{part} is off screen at 1280x800: {box}"
    # side by side: the plot is right of the controls, not under them
    controls, plot = _box(page, ".nw-controls"), _box(page, ".nw-plot-frames")
    assert plot["x"] >= controls["x"] + controls["width"]
    assert plot["y"] < controls["y"] + controls["height"]
    assert plot["width"] >= 500
    _save_screenshot(page, "lab-1280x800.png")


def _shown_frame(page, number: int) -> float:
    """Wait until the heading and the plot's marker both show frame ``number``; seconds waited."""
    started = time.perf_counter()
    page.wait_for_function(
        """(n) => {
          const head = document.querySelector('.nw-browser .nw-frame-head');
          const marker = document.querySelector('.nw-browser .nw-marker');
          return head && head.textContent.startsWith(`frame ${n} of`) && marker
                 && marker.title.startsWith(`frame ${n}:`) && marker.offsetWidth > 0;
        }""", arg=number)
    return time.perf_counter() - started


def test_lab_frame_marker_follows_buttons_and_slider(recorded_page):
    page = recorded_page
    assert _heading(page).startswith("frame 21 of 21")
    marker = page.locator(".nw-browser .nw-marker")
    image = _box(page, ".nw-plot-frames")
    at_event = _marker_centre(page)
    band = _box(page, ".nw-browser .nw-marker")["width"]
    assert image["x"] < at_event < image["x"] + image["width"]
    timings = []
    page.locator(".nw-prev").click()
    timings.append(_shown_frame(page, 20))
    assert marker.get_attribute("title") == "frame 20: act"
    assert _marker_centre(page) == pytest.approx(at_event - band, abs=2)
    page.locator(".nw-next").click()
    timings.append(_shown_frame(page, 21))
    assert _marker_centre(page) == pytest.approx(at_event, abs=2)
    # the slider: keyboard on its handle, as a user would after clicking it
    handle = page.locator(".nw-frame .noUi-handle")
    handle.focus()
    handle.press("Home")
    timings.append(_shown_frame(page, 1))
    assert marker.get_attribute("title") == "frame 1: fc1"
    assert _marker_centre(page) == pytest.approx(at_event - 20 * band, abs=3)
    handle.press("End")
    timings.append(_shown_frame(page, 21))
    assert _marker_centre(page) == pytest.approx(at_event, abs=2)
    print(f"\nclick to heading and marker redrawn: {', '.join(f'{t:.3f}' for t in timings)} s")


def test_lab_dark_theme_keeps_alert_text_readable(recorded_page):
    page = recorded_page
    page.locator(".nw-rerun").click()
    head = page.locator(".nw-browser .nw-trace-head").filter(has_text="first bad op")
    head.wait_for()
    # the source in a notebook reads as IPython names it, not /tmp/ipykernel_<pid>/<hash>.py
    line = next(number for number, text in enumerate(RECORDED.splitlines(), start=1)
                if "torch.sqrt" in text)
    assert f"first bad op: sqrt in module <root> at cell In[1], line {line}" in head.inner_text()
    light = {name: page.locator(".nw-browser " + selector).first.evaluate(CONTRAST_JS)
             for name, selector in ALERT_PARTS.items()}
    lab_command(page, "apputils:change-theme", {"theme": "JupyterLab Dark"})
    page.wait_for_selector('body[data-jp-theme-light="false"]', state="attached")
    page.wait_for_timeout(1000)  # the theme's stylesheet swaps in
    dark = {name: page.locator(".nw-browser " + selector).first.evaluate(CONTRAST_JS)
            for name, selector in ALERT_PARTS.items()}
    page.locator(".nw-browser").evaluate("e => e.scrollIntoView({block: 'start'})")
    _save_screenshot(page, "lab-dark.png")
    print(f"\ncontrast light: { {k: round(v, 1) for k, v in light.items()} }"
          f"\ncontrast dark:  { {k: round(v, 1) for k, v in dark.items()} }")
    for name in ALERT_PARTS:  # WCAG AA for normal text
        assert light[name] >= 4.5, (name, light[name])
        assert dark[name] >= 4.5, (name, dark[name])
    lab_command(page, "apputils:change-theme", {"theme": "JupyterLab Light"})
    page.wait_for_selector('body[data-jp-theme-light="true"]', state="attached")
    page.locator(".nw-browser .nw-export").wait_for(state="visible")


def test_lab_export_reaches_the_browser_as_a_download(recorded_page, lab):
    page = recorded_page
    export_width = _box(page, ".nw-export")["width"]
    page.locator(".nw-export").click()
    link = page.locator(".nw-export-link a.nw-download")
    link.wait_for(state="visible")
    rows = int(re.search(r"\((\d+) rows", page.locator(".nw-export-link").inner_text()).group(1))
    with page.expect_download() as info:
        link.click()
    download = info.value
    assert re.fullmatch(r"nanwidget-frames-\d{8}-\d{6}\.csv", download.suggested_filename)
    table = pd.read_csv(download.path())
    assert len(table) == rows == 64
    assert {"batch", "frame", "module", "role", "abs_max", "nan", "inf"} <= set(table.columns)
    assert table["nan"].any()
    # the chosen-path option writes on the kernel's side
    target = lab.folder / "exports" / "chosen.parquet"
    page.locator(".nw-save-path input").fill(str(target))
    page.locator(".nw-save").click()
    page.locator(".nw-export-link").filter(has_text="wrote 64 rows").wait_for()
    assert len(pd.read_parquet(target)) == 64
    # the message sits on its own line: the buttons keep their size
    assert _box(page, ".nw-export")["width"] == pytest.approx(export_width, abs=1)
    assert _box(page, ".nw-save")["width"] >= 60


def test_lab_interrupting_a_nanwatch_cell_prints_one_line_and_shows_the_browser(lab, chromium):
    page = chromium.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(TIMEOUT_MS)
    try:
        open_in_lab(page, lab, "interrupt.ipynb")
        run_all_cells(page)
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        watched = cells.nth(1)
        watched.locator(".jp-OutputArea").filter(has_text=re.compile(r"[3-9]\d* batches seen")) \
            .wait_for()
        page.locator("[data-command='notebook:interrupt-kernel']").first.click()
        watched.locator(".nw-browser").wait_for(state="visible")
        errors = watched.locator(".jp-OutputArea-output[data-mime-type="
                                 "'application/vnd.jupyter.stderr']")
        errors.first.wait_for()
        text = watched.locator(".jp-OutputArea").inner_text()
        error_lines = [line for line in errors.first.inner_text().splitlines() if line.strip()]
        assert len(error_lines) == 1, error_lines
        assert re.match(r"KeyboardInterrupt: %%nanwatch model interrupted \(\d+ batches seen\)",
                        error_lines[0])
        assert "Traceback" not in text and "magic.py" not in text and "Cell In[" not in text
        assert re.search(r"nanwatch model interrupted: \d+ batches seen", text)
        assert "frames" in watched.locator(".nw-browser .nw-status").inner_text()
        # "Run All" stopped at the interrupted cell, as it does without the magic
        page.wait_for_timeout(1500)
        assert "this cell ran" not in cells.nth(2).locator(".jp-OutputArea").inner_text()
        assert cells.nth(2).locator(".jp-InputPrompt").inner_text().strip() in ("[ ]:", "[*]:")
        _save_screenshot(page, "lab-interrupted.png")
    finally:
        page.close()


def test_lab_reopened_notebook_shows_the_static_copy(lab, chromium):
    page = chromium.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(TIMEOUT_MS)
    try:
        open_in_lab(page, lab, "reopened.ipynb")
        run_all_cells(page)
        page.locator(".nw-browser").wait_for(state="visible")
        page.locator(".nw-static").wait_for(state="attached")  # the output after the widget's
        assert page.locator(".nw-static").count() == 1
        assert not page.locator(".nw-static").is_visible()  # hidden while the widget is live
        lab_command(page, "docmanager:save")
        page.wait_for_function("() => !document.querySelector('.jp-mod-dirty')")
    finally:
        page.close()
    for session in lab.api("api/sessions"):  # the kernel goes: its widget models with it
        lab.api(f"api/sessions/{session['id']}", method="DELETE")
    context = chromium.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    try:
        open_in_lab(page, lab, "reopened.ipynb")
        copy = page.locator(".nw-static")
        copy.wait_for(state="visible")
        text = copy.inner_text()
        assert "nan in batch 3 at module 'fc2'" in text
        assert "frame 21 of 21" in text and "weight" in text and "NaN" in text
        page.wait_for_function("() => [...document.querySelectorAll('.nw-static img')]"
                               ".filter(i => i.complete && i.naturalWidth > 500).length == 2")
        assert page.locator(".nw-browser").count() == 0
        assert not page.get_by_text("Error displaying widget").first.is_visible()
        copy.evaluate("e => e.scrollIntoView({block: 'start'})")
        _save_screenshot(page, "lab-reopened.png")
    finally:
        context.close()


# ---------------------------------------------------------------------------------- Voila
def test_frame_browser_works_in_voila(tmp_path, chromium):
    from playwright.sync_api import expect

    write_notebook(tmp_path / "browser.ipynb", RECORDED.format(frames=12))
    server = start_voila(tmp_path, "browser.ipynb")
    try:
        page = chromium.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(server.url, timeout=TIMEOUT_MS)
        table = page.locator(".nw-frame-table")
        status = page.locator(".nw-status")

        # Renders, and the status line names the event in words.
        expect(page.locator(".nw-browser")).to_be_visible(timeout=TIMEOUT_MS)
        expect(status).to_contain_text("12 frames")
        expect(status).to_contain_text("nan in batch 3 at module 'fc2'")
        expect(table).to_contain_text("fc2")
        expect(page.locator(".nw-static")).to_be_hidden()

        # Step back twice, then jump to the first bad frame.
        page.locator(".nw-prev").click()
        expect(table.locator(".nw-frame-head")).to_contain_text("act")
        page.locator(".nw-prev").click()
        expect(table.locator(".nw-frame-head")).to_contain_text("fc1")
        expect(table.locator("tr.nw-nonfinite")).to_have_count(0)
        page.locator(".nw-first-bad").click()
        expect(table.locator(".nw-frame-head")).to_contain_text("fc2")
        expect(table.locator("tr.nw-nonfinite").first).to_be_visible()

        # Step back one frame from the bad one; the marker names it.
        page.locator(".nw-prev").click()
        expect(table.locator(".nw-frame-head")).to_contain_text("act")
        expect(page.locator(".nw-browser .nw-marker")).to_have_attribute("title", re.compile("act"))

        # Plots are drawn: the frames plot, then the history plot.
        page.wait_for_function(
            "() => { const i = document.querySelector('.nw-plot-frames');"
            " return i && i.complete && i.naturalWidth > 500; }")
        page.locator(".nw-plot-choice button", has_text="history").click()
        page.wait_for_function(
            "() => { const i = document.querySelector('.nw-plot-history');"
            " return i && i.complete && i.naturalWidth > 500 && i.offsetParent !== null; }")
        page.locator(".nw-plot-choice button", has_text="frames").click()

        # Re-run in trace mode.
        trace = page.locator(".nw-trace")
        page.locator(".nw-batch select").select_option(label="batch 3")
        page.locator(".nw-rerun").click()
        expect(trace).to_contain_text("first bad op")

        # Filter by layer: only fc1's frames remain; a filter with no match says so.
        layer = page.locator(".nw-filter-layer input")
        layer.fill("fc1")
        layer.press("Enter")
        expect(status).to_contain_text("match the filters")
        expect(table.locator(".nw-frame-head")).to_contain_text("fc1")
        layer.fill("nothing_matches")
        layer.press("Enter")
        expect(page.locator(".nw-plot-note")).to_contain_text("no frames match the filters")
        layer.fill("")
        layer.press("Enter")
        expect(status).not_to_contain_text("match the filters")
        page.locator(".nw-first-bad").click()
        expect(table.locator(".nw-frame-head")).to_contain_text("fc2")
        expect(page.locator(".nw-plot-note")).to_have_text("")  # the plot is back
        page.wait_for_function(
            "() => { const i = document.querySelector('.nw-plot-frames');"
            " return i && i.complete && i.naturalWidth > 500 && i.offsetParent !== null; }")

        shot = _save_screenshot(page.locator(".nw-browser"), "framebrowser.png")
        assert shot.stat().st_size > 10_000
        page.close()
    finally:
        server.stop()

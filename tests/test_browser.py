"""The FrameBrowser in real browsers: JupyterLab and Voila on 127.0.0.1, driven by headless Chromium.

JupyterLab (one server for the module) covers what a notebook user meets: the compact layout at
1280x800, the current-frame marker following ◀/▶ and the slider, frames named as the exported
CSV names them, the export reaching the browser as a download in one click, the dark theme's
contrast and plots, long module names, an invalid layer pattern, controls inside their column,
Kernel > Interrupt on a %%nanwatch cell, a sentinel cell's status, the quickstart under Run All,
the demo's and the Trainer callback's reports, the gradient-norm plot, an option typo that leaves
the running %nanwatch as it was, the help texts (nw.watch?, %nanwatch?), the way from a NaN to
its module, op, line and why (early warnings, diagnosis, first fix, replay), and a saved notebook
reopened without its widgets. Voila covers the widget's controls end to end. Screenshots go to
artifacts/ (NANWIDGET_UPDATE_SCREENSHOT=1 also copies them to docs/).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
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

LONG_NAMES = """\
import torch
from torch import nn
import nanwidget as nw
from nanwidget.plots import plot_history

torch.manual_seed(0)

class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.classification_head = nn.Linear(16, 3)

    def forward(self, x):
        return self.classification_head(self.encoder(x))

model = Classifier()
watch = nw.watch(model, on_nan="record")
for batch in range(3):
    if batch == 2:
        with torch.no_grad():
            model.encoder.layers[1].linear2.weight[0, 0] = float("nan")
    model(torch.randn(2, 5, 16))
nw.FrameBrowser(watch)
"""
LONG_NAMES_HISTORY = "plot_history(watch.history(), dtype='float32')"

SENTINEL_SETUP = """\
from collections import OrderedDict
import torch
from torch import nn
import nanwidget as nw
%load_ext nanwidget
torch.manual_seed(0)
model = nn.Sequential(OrderedDict(feature_extractor=nn.Linear(16, 32), activation=nn.ReLU(),
                                  classification_head=nn.Linear(32, 4)))
"""
SENTINEL_CELL = """\
%%nanwatch model --sentinel
for step in range(6):
    if step == 4:
        with torch.no_grad():
            model.classification_head.weight[0, 0] = float("nan")
    model(torch.randn(8, 16))
"""

DEMO_REPORT = """\
import subprocess, sys
demo = subprocess.run([sys.executable, "-m", "nanwidget", "demo", "--out", "demo-out"],
                      capture_output=True, text=True, check=True).stdout
print(demo[demo.index("Detected"):demo.index("Wrote to")])
"""
# The Trainer callback's report, with a window that begins where the event's batch begins.
TRAINER_REPORT = """\
import os
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
import tempfile
import torch
import transformers
import nanwidget as nw
from nanwidget.integrations.transformers import NanWatchCallback

POISONED = "transformer.h.0.mlp.c_fc"

def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)

class Tokens(torch.utils.data.Dataset):
    ids = torch.randint(1, 50, (32, 8), generator=torch.Generator().manual_seed(1))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

class PoisonAtStep3(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2:
            with torch.no_grad():
                model.get_submodule(POISONED).weight[0, 0] = float("nan")

probe_model = tiny_gpt2()
with nw.watch(probe_model, max_frames=200) as probe:
    probe_model(torch.randint(1, 50, (2, 8)))
    frames = probe.frames()
window = int(frames.loc[frames["module"] == POISONED, "frame"].iloc[0]) + 1
callback = NanWatchCallback(max_frames=window)
args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=6,
                                      per_device_train_batch_size=4, learning_rate=1e-3,
                                      save_strategy="no", report_to=[], use_cpu=True,
                                      disable_tqdm=True, logging_strategy="no")
transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(),
                     callbacks=[PoisonAtStep3(), callback]).train()
print(callback.report())
"""
GRAD_NORMS = """\
import torch
from torch import nn
import nanwidget as nw
from nanwidget.plots import plot_grad_norms

class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.gate = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x) + 0 * self.gate(x)  # the gate's gradients are exactly zero

torch.manual_seed(0)
gated = Gated()
with nw.watch(gated) as grad_watch:
    for step in range(5):
        gated.zero_grad()
        gated(torch.randn(2, 3)).sum().backward()
        grad_watch.check_grad_norms()
figure = plot_grad_norms(grad_watch.grad_history())
print([text.get_text() for text in figure.axes[0].get_legend().get_texts()])
figure
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

# Issue 27 items 5 and 9 as a notebook user meets them: a typo in the options of a running
# %nanwatch (the cell is tagged raises-exception so that Run All goes on), then the help texts.
TYPO_SETUP = """\
import torch
from torch import nn
import nanwidget as nw
%load_ext nanwidget
torch.manual_seed(0)
seq = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
%nanwatch seq -n 7
seq(torch.randn(2, 16));
"""
TYPO_CELL = "%nanwatch seq --skip Relu"
AFTER_TYPO = """\
seq(torch.randn(2, 16))
%nanwatch
print(f"closed={_nanwatch.closed} max_frames={_nanwatch.max_frames} batches={_nanwatch.batch}")
"""
WATCH_HELP = "nw.watch?"
MAGIC_HELP = "%nanwatch?"

# From a NaN to the module, op, line and why: a float16 model whose sum pooling overflows as
# its inputs grow 1.5x per batch, trained under %%nanwatch (the first cell's line 10 is the sum).
DIAGNOSIS_SETUP = """\
from collections import OrderedDict
import torch
from torch import nn
import nanwidget as nw
%load_ext nanwidget


class SumPool(nn.Module):
    def forward(self, x):
        return x.sum(dim=1)  # over the 512 positions


torch.manual_seed(0)
model = nn.Sequential(OrderedDict(project=nn.Linear(16, 64), act=nn.GELU(), pool=SumPool(),
                                  head=nn.Linear(64, 4))).half().eval()
signal = torch.randn(8, 512, 16)
"""
DIAGNOSIS_CELL = """\
%%nanwatch model
with torch.no_grad():
    for batch in range(20):
        model((signal * 1.5 ** batch).half())
"""
DIAGNOSIS_SUM_LINE = next(number for number, text in enumerate(DIAGNOSIS_SETUP.splitlines(), 1)
                          if "x.sum(dim=1)" in text)

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

README_PICTURES = {"framebrowser.png", "lab-1280x800.png", "lab-dark.png", "lab-reopened.png",
                   "lab-diagnosis.png"}

# Whether anything is drawn in the outermost pixels of a plot picture (a label cut by the
# figure's edge leaves ink there): the image as the page has it, read back through a canvas.
EDGE_INK_JS = """(img) => {
  const canvas = document.createElement('canvas');
  canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
  const context = canvas.getContext('2d');
  context.drawImage(img, 0, 0);
  const {data} = context.getImageData(0, 0, canvas.width, canvas.height);
  const ink = (x, y) => {
    const i = 4 * (y * canvas.width + x);
    return data[i + 3] > 0 && (data[i] < 250 || data[i + 1] < 250 || data[i + 2] < 250);
  };
  for (let x = 0; x < canvas.width; x++)
    for (const y of [0, 1, canvas.height - 2, canvas.height - 1]) if (ink(x, y)) return true;
  for (let y = 0; y < canvas.height; y++)
    for (const x of [0, 1, canvas.width - 2, canvas.width - 1]) if (ink(x, y)) return true;
  return false;
}"""

# How many pixels of a plot picture are drawn in the early warnings' orange (matplotlib's
# "darkorange", 255/140/0; the module lines' orange is 255/127/14), read back through a canvas.
WARNING_INK_JS = """(img) => {
  const canvas = document.createElement('canvas');
  canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
  const context = canvas.getContext('2d');
  context.drawImage(img, 0, 0);
  const {data} = context.getImageData(0, 0, canvas.width, canvas.height);
  let count = 0;
  for (let i = 0; i < data.length; i += 4)
    if (data[i + 3] > 200 && data[i] > 250 && Math.abs(data[i + 1] - 140) <= 3 && data[i + 2] <= 3)
      count++;
  return count;
}"""

# Every part of the controls column inside that column (a clipped border, a button pushed out).
OUTSIDE_CONTROLS_JS = """(controls) => {
  const column = controls.getBoundingClientRect();
  return [...controls.querySelectorAll('.jupyter-widgets, input, select, button')]
    .filter(e => { const r = e.getBoundingClientRect(); return r.width > 0 &&
      (r.left < column.left - 0.5 || r.right > column.right + 0.5); })
    .map(e => `${e.tagName}.${[...e.classList].join('.')} ${e.getBoundingClientRect().right}`
              + ` > ${column.right}`);
}"""

ALERT_PARTS = {"event line": ".nw-status .nw-alert",
               "frame heading flag": ".nw-frame-head .nw-alert",
               "non-finite table row": ".nw-frame-table tr.nw-nonfinite td",
               "first bad op header": ".nw-trace-head .nw-alert"}


def _set_theme(page, dark: bool) -> None:
    """Switch JupyterLab's theme and wait until its stylesheet is in."""
    theme, light = ("JupyterLab Dark", "false") if dark else ("JupyterLab Light", "true")
    lab_command(page, "apputils:change-theme", {"theme": theme})
    page.wait_for_selector(f'body[data-jp-theme-light="{light}"]', state="attached")
    page.wait_for_timeout(1000)  # the theme's stylesheet swaps in


def _luminance(locator) -> float:
    """Mean luminance (0 black .. 1 white) of an element as the page shows it."""
    from matplotlib.image import imread
    pixels = imread(io.BytesIO(locator.screenshot()))[..., :3]
    return float((pixels @ np.array([0.2126, 0.7152, 0.0722])).mean())


def _wait_until_idle(page) -> None:
    """Until every cell has run (no "[*]" prompt left)."""
    page.wait_for_function("() => { const p = [...document.querySelectorAll('.jp-InputPrompt')];"
                           " return p.length && p.every(e => !e.textContent.includes('*')); }",
                           timeout=TIMEOUT_MS * 3)


def _wait_until_every_cell_ran(page) -> None:
    """Until every code cell has its number (Run All leaves a cell queued later as "[ ]")."""
    page.wait_for_function("() => { const p = [...document.querySelectorAll("
                           "'.jp-CodeCell .jp-InputPrompt')];"
                           " return p.length && p.every(e => /\\[\\d+\\]/.test(e.textContent)); }",
                           timeout=TIMEOUT_MS * 3)


@contextlib.contextmanager
def _lab_notebook(lab, chromium, notebook: str):
    """``notebook`` opened alone in JupyterLab at 1280x800 with every cell started; the theme
    (a server-wide setting) is light again afterwards."""
    page = chromium.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(TIMEOUT_MS)
    try:
        open_in_lab(page, lab, notebook)
        run_all_cells(page)
        yield page
    finally:
        _set_theme(page, dark=False)
        page.close()


def _save_screenshot(page_or_locator, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page_or_locator.screenshot(path=str(path))
    if os.environ.get("NANWIDGET_UPDATE_SCREENSHOT") and name in README_PICTURES:  # on request
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copyfile(path, ROOT / "docs" / name)
    return path


def _tag_raises_exception(path: Path, cell: int) -> None:
    """Tag a cell ``raises-exception``: JupyterLab's Run All goes on past its error."""
    notebook = json.loads(path.read_text())
    notebook["cells"][cell]["metadata"]["tags"] = ["raises-exception"]
    path.write_text(json.dumps(notebook))


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
    write_notebook(folder / "long_names.ipynb", LONG_NAMES, LONG_NAMES_HISTORY)
    write_notebook(folder / "sentinel.ipynb", SENTINEL_SETUP, SENTINEL_CELL)
    write_notebook(folder / "reports.ipynb", DEMO_REPORT, TRAINER_REPORT, GRAD_NORMS)
    _tag_raises_exception(write_notebook(folder / "typo_and_help.ipynb", TYPO_SETUP, TYPO_CELL,
                                         AFTER_TYPO, WATCH_HELP, MAGIC_HELP), cell=1)
    write_notebook(folder / "diagnosis.ipynb", DIAGNOSIS_SETUP, DIAGNOSIS_CELL)
    for tour in ("01_quickstart.ipynb", "08_why_nan.ipynb"):
        shutil.copyfile(ROOT / "notebooks" / tour, folder / tour)
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


def _label(page) -> str:
    return page.locator(".nw-browser .nw-frame-label").inner_text().strip()


def _shown_frame(page, name: str) -> float:
    """Wait until the label, the heading and the plot's marker all name frame ``name``
    ("batch 3, frame 2"); seconds waited."""
    started = time.perf_counter()
    page.wait_for_function(
        """(name) => {
          const label = document.querySelector('.nw-browser .nw-frame-label');
          const head = document.querySelector('.nw-browser .nw-frame-head');
          const marker = document.querySelector('.nw-browser .nw-marker');
          return label && label.textContent.trim() === name && head
                 && head.textContent.startsWith(name + ' ·') && marker
                 && marker.title.startsWith(name + ':') && marker.offsetWidth > 0;
        }""", arg=name)
    return time.perf_counter() - started


def test_lab_frame_marker_follows_buttons_and_slider(recorded_page):
    page = recorded_page
    assert _label(page) == "batch 3, frame 2"  # the event: fc2, the third hook of batch 3
    marker = page.locator(".nw-browser .nw-marker")
    image = _box(page, ".nw-plot-frames")
    at_event = _marker_centre(page)
    band = _box(page, ".nw-browser .nw-marker")["width"]
    assert image["x"] < at_event < image["x"] + image["width"]
    timings = []
    page.locator(".nw-prev").click()
    timings.append(_shown_frame(page, "batch 3, frame 1"))
    assert marker.get_attribute("title") == "batch 3, frame 1: act"
    assert _marker_centre(page) == pytest.approx(at_event - band, abs=2)
    page.locator(".nw-next").click()
    timings.append(_shown_frame(page, "batch 3, frame 2"))
    assert _marker_centre(page) == pytest.approx(at_event, abs=2)
    # the slider: keyboard on its handle, as a user would after clicking it
    handle = page.locator(".nw-frame .noUi-handle")
    handle.focus()
    handle.press("Home")
    timings.append(_shown_frame(page, "batch 0, frame 0"))  # 21 frames back: batch 0's first
    assert marker.get_attribute("title") == "batch 0, frame 0: fc1"
    assert _marker_centre(page) == pytest.approx(at_event - 20 * band, abs=3)
    handle.press("End")
    timings.append(_shown_frame(page, "batch 3, frame 2"))
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
    plot = page.locator(".nw-browser .nw-plot-frames")
    assert plot.evaluate("e => getComputedStyle(e).filter") == "none"
    assert _luminance(plot) > 0.8  # dark ink on the light page
    _set_theme(page, dark=True)
    dark = {name: page.locator(".nw-browser " + selector).first.evaluate(CONTRAST_JS)
            for name, selector in ALERT_PARTS.items()}
    # the plots follow: turned light on the dark page, not a white block
    assert "invert(1)" in plot.evaluate("e => getComputedStyle(e).filter")
    assert _luminance(plot) < 0.3
    page.locator(".nw-browser").evaluate("e => e.scrollIntoView({block: 'start'})")
    _save_screenshot(page, "lab-dark.png")
    print(f"\ncontrast light: { {k: round(v, 1) for k, v in light.items()} }"
          f"\ncontrast dark:  { {k: round(v, 1) for k, v in dark.items()} }")
    for name in ALERT_PARTS:  # WCAG AA for normal text
        assert light[name] >= 4.5, (name, light[name])
        assert dark[name] >= 4.5, (name, dark[name])
    _set_theme(page, dark=False)
    page.locator(".nw-browser .nw-export").wait_for(state="visible")


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
def test_lab_export_downloads_in_one_click_and_names_frames_as_the_csv(recorded_page, lab, dark):
    page = recorded_page
    _set_theme(page, dark)
    try:
        export_width = _box(page, ".nw-export")["width"]
        with page.expect_download(timeout=30_000) as info:
            page.locator(".nw-export").click()  # one click: the download starts
        download = info.value
        assert re.fullmatch(r"nanwidget-frames-\d{8}-\d{6}\.csv", download.suggested_filename)
        table = pd.read_csv(download.path())
        shown = page.locator(".nw-export-link")
        shown.filter(has_text="downloading").wait_for()
        rows = int(re.search(r"downloading (\d+) rows", shown.inner_text()).group(1))
        assert len(table) == rows == 64
        assert {"batch", "frame", "module", "role", "abs_max", "nan", "inf"} <= set(table.columns)
        # one numbering: the frame shown is named by the batch and frame columns of the CSV
        first_bad = table[table["nan"]].iloc[0]
        name = f"batch {first_bad['batch']}, frame {first_bad['frame']}"
        assert _label(page) == name and _heading(page).startswith(f"{name} · fc2")
        # the link under the button offers the same file again
        with page.expect_download() as again:
            shown.locator("a.nw-download").click()
        assert again.value.suggested_filename == download.suggested_filename
        assert _box(page, ".nw-export")["width"] == pytest.approx(export_width, abs=1)
    finally:
        _set_theme(page, dark=False)


def test_lab_save_writes_where_asked_and_asks_for_a_path(recorded_page, lab):
    page = recorded_page
    export_width = _box(page, ".nw-export")["width"]
    page.locator(".nw-save-path input").fill("")
    page.locator(".nw-save").click()  # no path typed: no file nobody asked for
    page.locator(".nw-export-link").filter(has_text="type where to save first").wait_for()
    assert not list(lab.folder.rglob("nanwidget-frames-*"))
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


def test_lab_an_invalid_layer_pattern_is_called_invalid(recorded_page):
    page = recorded_page
    layer = page.locator(".nw-filter-layer input")
    try:
        for dark in (False, True):
            _set_theme(page, dark)
            layer.fill("fc[")
            layer.press("Enter")
            status = page.locator(".nw-browser .nw-status")
            status.filter(has_text="is not a valid regular expression").wait_for()
            assert "'fc[' is not a valid regular expression" in status.inner_text()
            assert "No frames match the filters" in page.locator(".nw-frame-table").inner_text()
            alert = page.locator(".nw-browser .nw-status .nw-alert").last
            assert alert.evaluate(CONTRAST_JS) >= 4.5
            # the box says it too: its border takes the alert colour
            border = layer.evaluate("e => getComputedStyle(e).borderTopColor")
            assert border == alert.evaluate("e => getComputedStyle(e).color")
            layer.fill("")
            layer.press("Enter")
            page.wait_for_function("() => !document.querySelector('.nw-browser .nw-status')"
                                   ".textContent.includes('not a valid')")
    finally:
        _set_theme(page, dark=False)


def test_lab_controls_stay_inside_their_column(recorded_page, lab, chromium):
    with _lab_notebook(lab, chromium, "sentinel.ipynb") as sentinel:
        sentinel.locator(".nw-browser").wait_for(state="visible")
        sentinel.locator(".nw-refresh").wait_for(state="visible")
        # a long view name: "event 1: nan at classification_head, batch 4"
        assert "classification_head" in sentinel.locator(".nw-view select").input_value()
        try:
            for page in (recorded_page, sentinel):
                for dark in (False, True):
                    _set_theme(page, dark)
                    page.locator(".nw-browser").evaluate(
                        "e => e.scrollIntoView({block: 'start'})")
                    outside = page.locator(".nw-browser .nw-controls").evaluate(
                        OUTSIDE_CONTROLS_JS)
                    assert outside == [], outside
            _save_screenshot(sentinel.locator(".nw-browser"), "lab-sentinel-browser-dark.png")
        finally:
            _set_theme(recorded_page, dark=False)


def test_lab_sentinel_cell_status_says_what_it_checks(lab, chromium):
    with _lab_notebook(lab, chromium, "sentinel.ipynb") as page:
        watched = page.locator(".jp-Notebook .jp-CodeCell").nth(1)
        watched.locator(".nw-browser").wait_for(state="visible")
        text = watched.locator(".jp-Cell-outputArea").inner_text()
        status = next(line for line in text.splitlines() if line.startswith("nanwatch model"))
        assert "n/a" not in status
        largest = re.search(r"sentinel mode checks the model's outputs each batch, largest \|x\| "
                            r"so far: (\S+) \(float32: [\d.]+ decades below", status)
        assert largest and 0 < float(largest.group(1)) < 1e3, status
        assert "a loss made outside the model is checked only with backward=True" in status
        assert "loss_fn" in status and "5 batches seen" in status  # the NaN came in the 5th
        for dark in (False, True):
            _set_theme(page, dark)
            watched.locator(".nw-status").evaluate("e => e.scrollIntoView({block: 'center'})")
            _save_screenshot(page, f"lab-sentinel-status-{'dark' if dark else 'light'}.png")


def test_lab_long_module_names_and_every_plot_label_fit_in_light_and_dark(lab, chromium):
    with _lab_notebook(lab, chromium, "long_names.ipynb") as page:
        page.locator(".nw-browser").wait_for(state="visible")
        page.wait_for_function("() => { const i = document.querySelector('img.nw-figure');"
                               " return i && i.complete && i.naturalWidth > 500; }")
        frames_plot, history_plot = page.locator(".nw-plot-frames"), page.locator("img.nw-figure")
        for dark in (False, True):
            _set_theme(page, dark)
            page.locator(".nw-browser").evaluate("e => e.scrollIntoView({block: 'start'})")
            # beside the controls, whole: nothing cut at the pictures' edges
            controls, plot = _box(page, ".nw-controls"), _box(page, ".nw-plot-frames")
            assert plot["x"] >= controls["x"] + controls["width"], (controls, plot)
            for picture in (frames_plot, history_plot):
                assert not picture.evaluate(EDGE_INK_JS)
                assert (_luminance(picture) < 0.3) if dark else (_luminance(picture) > 0.8)
            _save_screenshot(page, f"lab-long-names-{'dark' if dark else 'light'}.png")
            history_plot.evaluate("e => e.scrollIntoView({block: 'center'})")
            _save_screenshot(page, f"lab-history-figure-{'dark' if dark else 'light'}.png")


def test_lab_quickstart_run_all_then_the_first_browser_reruns_its_event(lab, chromium):
    with _lab_notebook(lab, chromium, "01_quickstart.ipynb") as page:
        _wait_until_idle(page)
        first = page.locator(".nw-browser").first
        first.locator(".nw-rerun").click()
        head = first.locator(".nw-trace-head")
        head.wait_for()
        text = first.locator(".nw-trace").inner_text()
        assert "not reproduced" not in text and "values changed" not in text, text[:400]
        assert head.inner_text().startswith("first bad op:")
        # The report wraps between words (JupyterLab's own pre style broke words mid-way).
        wrap = first.locator(".nw-trace pre").evaluate(
            "e => [getComputedStyle(e).wordBreak, getComputedStyle(e).whiteSpace]")
        assert wrap == ["normal", "pre-wrap"], wrap
        _set_theme(page, dark=True)
        assert first.locator(".nw-trace-head .nw-alert").evaluate(CONTRAST_JS) >= 4.5
        first.locator(".nw-trace").evaluate("e => e.scrollIntoView({block: 'center'})")
        _save_screenshot(page, "lab-quickstart-rerun-dark.png")


def test_lab_reports_and_the_gradient_norm_plot_read_as_they_should(lab, chromium):
    from matplotlib.image import imread
    with _lab_notebook(lab, chromium, "reports.ipynb") as page:
        _wait_until_idle(page)
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        # the demo: each "--- batch N ---" right where transformers' start of batch N is
        demo = cells.nth(0).locator(".jp-Cell-outputArea").inner_text().splitlines()
        starts = [i for i, line in enumerate(demo) if "*** Starting batch number=" in line]
        assert len(starts) >= 2
        for i in starts:
            batch = re.search(r"number=(\d+)", demo[i]).group(1)
            assert demo[i - 1].startswith(f"--- batch {batch} "), demo[i - 1:i + 1]
        for picture in ("frames.png", "history.png"):  # nothing cut at their edges
            pixels = imread(lab.folder / "demo-out" / picture)[..., :3]
            edges = np.concatenate([pixels[:2].reshape(-1, 3), pixels[-2:].reshape(-1, 3),
                                    pixels[:, :2].reshape(-1, 3), pixels[:, -2:].reshape(-1, 3)])
            assert (edges > 0.98).all(), picture
        # the Trainer callback's report: straight from "Last N ... frames:" into the batch
        report = cells.nth(1).locator(".jp-Cell-outputArea").inner_text()
        last = re.search(r"Last (\d+) forward frames:\n(.*)\n(.*)\n", report)
        assert last, report[:600]
        assert last.group(2).strip().startswith("*** Starting batch number=")
        assert last.group(3) == "abs min  abs max  metadata"
        # the gradient norms: the parameter whose norm is exactly 0 is on the plot
        grads = cells.nth(2)
        assert "norm 0: gate.weight, gate.bias" in grads.locator(".jp-Cell-outputArea").inner_text()
        figure = grads.locator("img.nw-figure")
        for dark in (False, True):
            _set_theme(page, dark)
            figure.evaluate("e => e.scrollIntoView({block: 'center'})")
            assert not figure.evaluate(EDGE_INK_JS)
            assert (_luminance(figure) < 0.3) if dark else (_luminance(figure) > 0.8)
            _save_screenshot(page, f"lab-grad-norms-{'dark' if dark else 'light'}.png")


@pytest.fixture(scope="module")
def typo_and_help_page(lab, chromium):
    """typo_and_help.ipynb run to the end in JupyterLab at 1280x800."""
    with _lab_notebook(lab, chromium, "typo_and_help.ipynb") as page:
        _wait_until_every_cell_ran(page)
        yield page


def _output_text(page, cell: int) -> str:
    return page.locator(".jp-Notebook .jp-CodeCell").nth(cell).locator(
        ".jp-Cell-outputArea").inner_text()


def _readable_in_both_themes(page, cell: int, screenshot: str) -> None:
    """Every output of the cell keeps WCAG AA contrast in the light and the dark theme."""
    code_cell = page.locator(".jp-Notebook .jp-CodeCell").nth(cell)
    outputs = code_cell.locator(".jp-OutputArea-output pre")
    outputs.first.wait_for()
    try:
        for dark in (False, True):
            _set_theme(page, dark)
            code_cell.evaluate("e => e.scrollIntoView({block: 'start'})")
            for number in range(outputs.count()):
                contrast = outputs.nth(number).evaluate(CONTRAST_JS)
                assert contrast >= 4.5, (screenshot, dark, number, contrast)
            _save_screenshot(page, f"{screenshot}-{'dark' if dark else 'light'}.png")
    finally:
        _set_theme(page, dark=False)


def test_lab_an_option_typo_leaves_the_running_watch_as_it_was(typo_and_help_page):
    page = typo_and_help_page
    answer = [line for line in _output_text(page, 1).splitlines() if line.strip()]
    assert answer == ["UsageError: --skip: this model has no module "
                      "of class 'Relu', so it skips nothing; did you mean 'ReLU'?"], answer
    # the watch started in the first cell still records, with its options
    after = _output_text(page, 2)
    assert re.search(r"^seq: <NanWatch watching", after, re.M), after
    assert "closed=False max_frames=7 batches=2" in after, after
    _readable_in_both_themes(page, 1, "lab-option-typo")


def test_lab_help_texts_speak_the_users_words(typo_and_help_page):
    page = typo_and_help_page
    watch_help = _output_text(page, 3)
    assert "Docstring:" in watch_help, watch_help[:400]
    assert "contract" not in watch_help.lower() and ":class:" not in watch_help, watch_help
    documented = watch_help[watch_help.index("Docstring:"):]
    for option in nw_watch_options():
        assert f"{option}=" in documented, option  # each option, with its default and one line
    magic_help = _output_text(page, 4).splitlines()
    docstring = magic_help.index("Docstring:")
    assert magic_help[docstring + 1].startswith("%nanwatch MODEL [options]"), magic_help[:8]
    assert "::" not in [line.strip() for line in magic_help], magic_help[:8]
    assert any("--no-early-warning" in line for line in magic_help)
    _readable_in_both_themes(page, 3, "lab-watch-help")
    _readable_in_both_themes(page, 4, "lab-nanwatch-help")


def nw_watch_options() -> list[str]:
    """The options nw.watch takes, as this checkout declares them (the kernel runs the same)."""
    import nanwidget
    return [name for name in inspect.signature(nanwidget.watch).parameters if name != "model"]


def test_lab_from_a_nan_to_module_op_line_and_why(lab, chromium):
    with _lab_notebook(lab, chromium, "diagnosis.ipynb") as page:
        ran_all = time.perf_counter()
        _wait_until_every_cell_ran(page)
        watched = page.locator(".jp-Notebook .jp-CodeCell").nth(1)
        browser = watched.locator(".nw-browser")
        browser.wait_for(state="visible")
        browser.locator(".nw-status .nw-diagnosis").wait_for(state="visible")
        to_why = time.perf_counter() - ran_all
        output = watched.locator(".jp-Cell-outputArea").inner_text()
        where = f"cell In[1], line {DIAGNOSIS_SUM_LINE}"
        # warned while it ran, batches before the NaN; then the stop says where and why
        warned = re.search(r"early warning, batch (\d+): output of '(\w+)' \(float16\)", output)
        assert warned, output[:1500]
        stop = output.index("NanDetected: inf in batch 15 at module 'pool' (SumPool, call 0), "
                            "output")
        assert output.index(warned.group(0)) < stop and int(warned.group(1)) <= 13
        why = re.search(r"Why \(overflow\): sum in module 'pool' \(SumPool\) at (.+?) "
                        r"overflowed float16.*? Try: (.+)", output[stop:])
        assert why and why.group(1) == where, output[stop:stop + 800]
        assert "bfloat16" in why.group(2)
        # the FrameBrowser's status line says the same: module, op, line, why, the fix to try
        status = browser.locator(".nw-status")
        text = status.inner_text()
        assert "inf in batch 15 at module 'pool'" in text and f"first bad op sum at {where}" in text
        diagnosis = status.locator(".nw-diagnosis")
        assert diagnosis.inner_text().startswith(
            f"overflow: sum in module 'pool' (SumPool) at {where}")
        assert "Try: " in diagnosis.inner_text() and "bfloat16" in diagnosis.inner_text()
        # the why on its own line, the status's lines set close (not 28 px apart)
        starts = diagnosis.evaluate("e => e.getClientRects()[0].left")  # its first line's start
        assert starts == pytest.approx(status.bounding_box()["x"], abs=2)
        line_height, font_size = status.locator(".widget-html-content").evaluate(
            "e => [getComputedStyle(e).lineHeight, getComputedStyle(e).fontSize]"
            ".map(parseFloat)")
        assert line_height <= 1.5 * font_size, (line_height, font_size)
        early = status.locator(".nw-warning")
        assert early.inner_text().startswith(f"early warning, batch {warned.group(1)}:")
        # one click more: the replay names the op and the line in the trace pane
        started = time.perf_counter()
        browser.locator(".nw-rerun").click()
        head = browser.locator(".nw-trace-head").filter(has_text="first bad op")
        head.wait_for()
        replayed = time.perf_counter() - started
        # Run All to "where and why" on screen, then one click to the op's line: well under
        # the minute a new user should need (the rest of that minute is reading)
        assert to_why + replayed < 30, (to_why, replayed)
        assert head.inner_text() == f"first bad op: sum in module pool at {where}"
        # the history plot marks the early warnings (orange rings, a dotted line at the first)
        browser.locator(".nw-plot-choice button", has_text="history").click()
        history = browser.locator(".nw-plot-history")
        page.wait_for_function("(i) => i.complete && i.naturalWidth > 400 && i.offsetParent",
                               arg=history.element_handle())
        assert history.evaluate(WARNING_INK_JS) >= 50
        browser.locator(".nw-plot-choice button", has_text="frames").click()
        try:
            for dark in (False, True):
                _set_theme(page, dark)
                browser.evaluate("e => e.scrollIntoView({block: 'start'})")
                notebook = _box(page, ".jp-NotebookPanel-notebook")
                for part in (diagnosis, early, head):
                    box = part.bounding_box()
                    assert box and notebook["y"] - 1 <= box["y"] and \
                        box["y"] + box["height"] <= notebook["y"] + notebook["height"] + 1, box
                    assert part.evaluate(CONTRAST_JS) >= 4.5, (dark, part)
                _save_screenshot(page, f"lab-diagnosis-{'dark' if dark else 'light'}.png")
        finally:
            _set_theme(page, dark=False)
        # the README's picture: the lines printed above the FrameBrowser, then the browser
        browser.evaluate("e => { e.scrollIntoView({block: 'start'});"
                         " e.closest('.jp-WindowedPanel-outer').scrollBy(0, -110); }")
        _save_screenshot(page, "lab-diagnosis.png")
        print(f"\nRun All to the diagnosis on screen: {to_why:.1f} s;"
              f" re-run click to the trace headline: {replayed:.2f} s")


def test_lab_why_nan_notebook_under_run_all_says_why_and_warned_before(lab, chromium):
    with _lab_notebook(lab, chromium, "08_why_nan.ipynb") as page:
        _wait_until_every_cell_ran(page)
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        texts = [cells.nth(i).locator(".jp-Cell-outputArea").inner_text()
                 for i in range(cells.count())]
        stopped = [i for i, text in enumerate(texts) if "NanDetected" in text]
        assert len(stopped) == 1, stopped  # the %%nanwatch cell, tagged raises-exception
        for i, text in enumerate(texts):
            assert "Traceback" not in text, (i, text[-800:])
        divergence = texts[stopped[0]]
        # warned at batch 15 (stdout and stderr arrive as two blocks: the batch numbers tell)
        assert "early warning, batch 15: output of 'fc1'" in divergence
        assert "3 early warnings (first: 'fc1'" in divergence  # the cell's live status line
        # the batch it goes NaN in depends on the CPU's float rounding (39 or 40 on the
        # machines we ran it on): the rest of the test follows it
        found = re.search(r"NanDetected: nan in batch (\d+) at module 'fc1'", divergence)
        assert found, divergence[-800:]
        nan_batch = int(found.group(1))
        assert 30 <= nan_batch <= 50, nan_batch
        assert "Why (divergence): Training diverged" in divergence
        browser = cells.nth(stopped[0]).locator(".nw-browser")
        status = browser.locator(".nw-status")
        assert status.locator(".nw-diagnosis").inner_text().startswith(
            "divergence: Training diverged: the weights grew")
        assert "Try: Lower the learning rate" in status.locator(".nw-fix").inner_text()
        assert status.locator(".nw-warning").inner_text().startswith(
            "early warning, batch 15: output of 'fc1'")
        # the cells after it leave the diverged model alone: its batch replays as it ran
        browser.locator(".nw-rerun").click()
        head = browser.locator(".nw-trace-head")
        head.filter(has_text=f"trace of batch {nan_batch}").wait_for()
        assert "it came with the weights fc1.weight, fc1.bias" in head.inner_text()
        line_height, font_size = head.evaluate(
            "e => [getComputedStyle(e).lineHeight, getComputedStyle(e).fontSize].map(parseFloat)")
        assert line_height <= 1.5 * font_size, (line_height, font_size)  # a paragraph, not a list
        assert "not reproduced" not in browser.locator(".nw-trace").inner_text()
        # every figure of the notebook is drawn
        pictures = page.locator(".jp-OutputArea-output img")
        assert pictures.count() >= 3  # the browser's plot, plot_history, ...
        page.wait_for_function("() => [...document.querySelectorAll('.jp-OutputArea-output img')]"
                               ".every(i => i.complete && i.naturalWidth > 100)")
        browser.evaluate("e => e.scrollIntoView({block: 'start'})")
        _save_screenshot(page, "lab-why-nan-notebook.png")


def test_lab_reopened_notebook_shows_the_static_copy(lab, chromium):
    # Last of the JupyterLab tests: it shuts every kernel down (the other pages' too).
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
        assert "batch 3, frame 2 · fc2" in text and "weight" in text and "NaN" in text
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

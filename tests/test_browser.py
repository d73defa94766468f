"""The FrameBrowser in a real browser: Voila serves a notebook, headless Chromium clicks it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
TIMEOUT_MS = 120_000  # Voila starts a kernel first: slow on a busy 2-core machine

pytestmark = [pytest.mark.browser, pytest.mark.slow]

_missing = [name for name in ("voila", "playwright") if importlib.util.find_spec(name) is None]
if not os.path.exists(CHROMIUM):
    _missing.append(CHROMIUM)
if _missing:
    pytestmark.append(pytest.mark.skip(reason=f"real-browser test needs {', '.join(_missing)}"))


NOTEBOOK_CODE = """\
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

    def forward(self, x):
        return self.head(self.act(self.fc2(self.act(self.fc1(x)))))

model = TinyMLP()
watch = nw.watch(model, on_nan="record", max_frames=12)
for batch in range(4):
    if batch == 3:
        with torch.no_grad():
            model.fc2.weight[0, 0] = float("nan")
    model(torch.randn(4, 16))
browser = nw.FrameBrowser(watch)
browser
"""


def _notebook(path: Path) -> None:
    cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
            "source": NOTEBOOK_CODE}
    notebook = {"cells": [cell], "metadata": {"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(notebook))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_server(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"voila exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "api", timeout=5):
                return
        except urllib.error.HTTPError:
            return  # any HTTP answer means the server is up
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"voila did not answer within {TIMEOUT_MS / 1000:.0f} s:\n"
                         f"{log.read_text()[-3000:]}")


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is not None:
        return
    # Our own process group: voila and the kernel it started.
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)


def test_frame_browser_works_in_a_real_browser(tmp_path):
    from jupyter_client.kernelspec import find_kernel_specs
    from playwright.sync_api import expect, sync_playwright

    assert "python3" in find_kernel_specs(), (
        "Voila needs a python3 kernelspec; install one with: python -m ipykernel install --user")

    _notebook(tmp_path / "browser.ipynb")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    log = tmp_path / "voila.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        MPLBACKEND="Agg")
    artifacts = ROOT / "artifacts"
    artifacts.mkdir(exist_ok=True)
    with open(log, "w") as log_file:
        server = subprocess.Popen(
            [sys.executable, "-m", "voila", "browser.ipynb", "--no-browser", f"--port={port}",
             "--Voila.ip=127.0.0.1", "--Voila.open_browser=False",
             "--VoilaConfiguration.show_tracebacks=True"],
            cwd=tmp_path, env=env, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        _wait_for_server(url, server, log)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"])
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1500})
                page.set_default_timeout(TIMEOUT_MS)
                page.goto(url, timeout=TIMEOUT_MS)
                table = page.locator(".nw-frame-table")
                status = page.locator(".nw-status")

                # Renders, and the status line names the event in words.
                expect(page.locator(".nw-browser")).to_be_visible(timeout=TIMEOUT_MS)
                expect(status).to_contain_text("12 frames")
                expect(status).to_contain_text("nan in batch 3 at module 'fc2'")
                expect(table).to_contain_text("fc2")

                # Step back twice, then jump to the first bad frame.
                page.locator(".nw-prev").click()
                expect(table.locator(".nw-frame-head")).to_contain_text("act")
                page.locator(".nw-prev").click()
                expect(table.locator(".nw-frame-head")).to_contain_text("fc1")
                expect(table.locator("tr.nw-nonfinite")).to_have_count(0)
                page.locator(".nw-first-bad").click()
                expect(table.locator(".nw-frame-head")).to_contain_text("fc2")
                expect(table.locator("tr.nw-nonfinite").first).to_be_visible()

                # Step back one frame from the bad one.
                page.locator(".nw-prev").click()
                expect(table.locator(".nw-frame-head")).to_contain_text("act")

                # A plot image is drawn.
                image = page.locator(".nw-plot img").first
                expect(image).to_be_visible()
                page.wait_for_function(
                    "() => { const i = document.querySelector('.nw-plot img');"
                    " return i && i.complete && i.naturalWidth > 100; }")

                # Re-run in trace mode.
                trace = page.locator(".nw-trace")
                page.locator(".nw-batch select").select_option(label="batch 3")
                page.locator(".nw-rerun").click()
                expect(trace).to_contain_text("no op made the first NaN/Inf")

                # Filter by layer: only fc1's frames remain.
                layer = page.locator(".nw-filter-layer input")
                layer.fill("fc1")
                layer.press("Enter")
                expect(status).to_contain_text("match the filters")
                expect(table.locator(".nw-frame-head")).to_contain_text("fc1")
                layer.fill("")
                layer.press("Enter")
                expect(status).not_to_contain_text("match the filters")
                page.locator(".nw-first-bad").click()
                expect(table.locator(".nw-frame-head")).to_contain_text("fc2")

                shot = artifacts / "framebrowser.png"
                page.locator(".nw-browser").screenshot(path=str(shot))
            finally:
                browser.close()
        if os.environ.get("NANWIDGET_UPDATE_SCREENSHOT"):  # the README's picture, on request only
            (ROOT / "docs").mkdir(exist_ok=True)
            shutil.copyfile(shot, ROOT / "docs" / "framebrowser.png")
        assert shot.stat().st_size > 10_000
    finally:
        _stop(server)

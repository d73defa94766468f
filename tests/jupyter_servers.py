"""Start JupyterLab or Voila on 127.0.0.1 for the real-browser tests, and stop them again.

Each server runs in its own process group (kernels included), with its settings, workspaces
and notebook signatures in a temporary folder so that nothing of the user's setup leaks in.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
START_TIMEOUT_S = 120  # a kernel and a page load on a busy 2-core machine


def write_notebook(path: Path, *cells: str) -> Path:
    """A notebook of code cells with the python3 kernel, never run."""
    notebook = {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {},
                           "id": f"cell-{number}", "outputs": [], "source": source}
                          for number, source in enumerate(cells)],
                "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                            "language": "python"}},
                "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(notebook))
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def kernel_env() -> dict[str, str]:
    """This checkout's nanwidget in every kernel; figures without a display."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p), MPLBACKEND="Agg")


class Server:
    """A Jupyter server process (Lab or Voila) in its own process group."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str], log: Path,
                 url: str) -> None:
        self.url = url
        self.log = log
        with open(log, "w") as log_file:
            self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log_file,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def wait_until_up(self, probe: str = "api") -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n"
                                     f"{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + probe, timeout=5):
                    return
            except urllib.error.HTTPError:
                return  # any HTTP answer means the server is up
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"server did not answer within {START_TIMEOUT_S} s:\n"
                             f"{self.log.read_text()[-3000:]}")

    def api(self, path: str, method: str = "GET") -> object:
        request = urllib.request.Request(self.url + path, method=method)
        with urllib.request.urlopen(request, timeout=30) as answer:
            body = answer.read()
        return json.loads(body) if body else None

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # our own group: the server and its kernels
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


def start_lab(folder: Path) -> Server:
    """JupyterLab serving ``folder``, light theme, no news, every cell rendered (no windowing),
    and ``window.jupyterapp`` exposed so tests can run commands (theme, save, run all)."""
    settings = folder / ".lab-settings"
    for plugin, values in {
        "@jupyterlab/apputils-extension/themes": {"theme": "JupyterLab Light"},
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                        "checkForUpdates": False},
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none",
                                                   "autoStartDefaultKernel": True},
    }.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = kernel_env()
    env.update(JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(folder / ".lab-workspaces"),
               JUPYTER_CONFIG_DIR=str(folder / ".jupyter-config"),
               JUPYTER_DATA_DIR=str(folder / ".jupyter-data"),
               JUPYTER_RUNTIME_DIR=str(folder / ".jupyter-runtime"))
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
               "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=", "--allow-root",
               "--ServerApp.disable_check_xsrf=True", f"--ServerApp.root_dir={folder}",
               "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
               "--ServerApp.open_browser=False", "--ContentsManager.allow_hidden=False",
               "--ServerApp.jpserver_extensions=voila.server_extension=False"]
    server = Server(command, folder, env, folder / "lab.log", url)
    server.wait_until_up()
    return server


def start_voila(folder: Path, notebook: str, *extra: str) -> Server:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    command = [sys.executable, "-m", "voila", notebook, "--no-browser", f"--port={port}",
               "--Voila.ip=127.0.0.1", "--Voila.open_browser=False",
               "--VoilaConfiguration.show_tracebacks=True", *extra]
    server = Server(command, folder, kernel_env(), folder / "voila.log", url)
    server.wait_until_up()
    return server


# ---------------------------------------------------------------------------------- JupyterLab pages
KERNEL_READY_JS = """() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session
                 && panel.sessionContext.session.kernel;
  return !!kernel && kernel.connectionStatus === 'connected' && kernel.status === 'idle';
}"""


_workspaces = iter(range(1_000_000))


def open_in_lab(page, server: Server, notebook: str) -> None:
    """Open ``notebook`` alone in a fresh JupyterLab workspace (no tabs restored from an earlier
    page) and wait until its kernel is connected and idle."""
    page.goto(server.url + f"lab/workspaces/test-{next(_workspaces)}/tree/{notebook}")
    page.wait_for_selector(".jp-Notebook")
    page.wait_for_function(KERNEL_READY_JS, timeout=START_TIMEOUT_S * 1000)


def lab_command(page, command: str, args: dict | None = None) -> None:
    """Run a JupyterLab command without waiting for it to finish (run-all resolves only at the
    end of the last cell)."""
    page.evaluate("([command, args]) => { window.jupyterapp.commands.execute(command, args); }",
                  [command, args or {}])


def run_all_cells(page) -> None:
    """Run > Run All Cells, and make sure it started (a command sent before the kernel is
    fully attached can be dropped: send it again)."""
    for _ in range(5):
        lab_command(page, "notebook:run-all-cells")
        try:
            page.wait_for_function("() => [...document.querySelectorAll('.jp-InputPrompt')]"
                                   ".some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))",
                                   timeout=10_000)
            return
        except Exception:  # playwright's TimeoutError: not started yet
            continue
    raise AssertionError("the notebook's cells did not start running")

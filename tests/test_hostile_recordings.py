"""Recordings from elsewhere are data, never a hang: load_run and `report` on hostile folders.

Each case starts from a real recording and damages it the way a hostile or broken folder
would. load_run must raise a RunLoadError naming the file at once, without reading outside
the folder or past a size limit; `python -m nanwidget report` must exit 2 with one line.

The cases run in one child process with a memory limit and a per-case alarm, so a loader
that reads /dev/zero or blocks on a FIFO fails these tests instead of the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import nanwidget as nw

from conftest import TinyMLP

REPO = Path(__file__).resolve().parents[1]

SECONDS = 1.0  # "at once": each load and each report answers within this


def _record(folder: Path, model: nn.Module | None = None) -> Path:
    """A real recording: trace batch 0, a NaN in batch 1, recorded (not raised)."""
    model = model or TinyMLP()
    with nw.watch(model, log_dir=str(folder), trace_batches=[0], on_nan="record"):
        for batch in range(3):
            x = torch.randn(4, 16)
            if batch == 1:
                x[0, 0] = float("nan")
            model(x)
    return folder / "rank-00000"


def _chunk(rank_dir: Path, kind: str) -> Path:
    return sorted(rank_dir.glob(f"{kind}-*.*"))[0]


def _dev_zero_chunk(folder: Path) -> str:
    rank_dir = _record(folder)
    os.symlink("/dev/zero", rank_dir / "history-000099.json")
    return "history-000099.json"


def _fifo_chunk(folder: Path) -> str:
    rank_dir = _record(folder)
    os.mkfifo(rank_dir / "frames-000099.parquet")
    return "frames-000099.parquet"


def _deeply_nested_event(folder: Path) -> str:
    rank_dir = _record(folder)
    (rank_dir / "event-000000.json").write_text("[" * 200_000 + "]" * 200_000)
    return "event-000000.json"


def _shape_a_b(folder: Path) -> str:
    import pyarrow.parquet as pq
    rank_dir = _record(folder)
    path = _chunk(rank_dir, "frames")
    table = pq.read_table(path)
    column = table.schema.get_field_index("shape")
    table = table.set_column(column, "shape", [["a,b"] * table.num_rows])
    pq.write_table(table, path)
    return path.name


def _event_symlinked_outside(folder: Path) -> str:
    rank_dir = _record(folder)
    outside = folder.parent / f"{folder.name}-outside"
    outside.mkdir()
    event = rank_dir / "event-000000.json"
    frames = rank_dir / json.loads(event.read_text())["frames_file"]
    (outside / event.name).write_text(event.read_text())
    (outside / frames.name).write_bytes(frames.read_bytes())
    event.unlink()
    os.symlink(outside / event.name, event)
    return "event-000000.json"


def _rank_folder_symlinked_outside(folder: Path) -> str:
    rank_dir = _record(folder.parent / f"{folder.name}-elsewhere")
    folder.mkdir()
    os.symlink(rank_dir, folder / "rank-00000")
    return "rank-00000"


def _world_size_zero(folder: Path) -> str:
    manifest = _record(folder) / "manifest.json"
    data = json.loads(manifest.read_text())
    data["world_size"] = 0
    manifest.write_text(json.dumps(data))
    return "manifest.json"


def _manifest_is_a_fifo(folder: Path) -> str:
    manifest = _record(folder) / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    return "manifest.json"


def _oversized_chunk(folder: Path) -> str:
    rank_dir = _record(folder)
    with open(rank_dir / "history-000099.json", "wb") as handle:
        handle.truncate(3 << 30)  # sparse: 3 GiB that take no disk
    return "history-000099.json"


HOSTILE = {
    "dev_zero_chunk": _dev_zero_chunk,
    "fifo_chunk": _fifo_chunk,
    "deeply_nested_event": _deeply_nested_event,
    "shape_a_b": _shape_a_b,
    "event_symlinked_outside": _event_symlinked_outside,
    "rank_folder_symlinked_outside": _rank_folder_symlinked_outside,
    "world_size_zero": _world_size_zero,
    "manifest_is_a_fifo": _manifest_is_a_fifo,
    "oversized_chunk": _oversized_chunk,
}

# Runs in the child: every case once through load_run, once through the report command. One
# JSON line per case; a watchdog thread ends the child when a case hangs in C code (pyarrow
# opening a FIFO retries through signals), so the parent reports that case as stuck.
_CHILD = r"""
import contextlib, io, json, os, resource, sys, threading, time
from nanwidget.cli import main as cli_main
from nanwidget.core.persist import RunLoadError, load_run
# 3 GiB of address space beyond what the imports mapped: a CUDA build of torch maps more than
# 3 GiB of libraries before any case runs, a CPU build far less.
with open("/proc/self/statm") as statm:
    mapped = int(statm.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + (3 << 30), mapped + (3 << 30)))

current = {"name": None, "since": time.monotonic()}

def watchdog():
    while True:
        time.sleep(0.2)
        if current["name"] is not None and time.monotonic() - current["since"] > 5:
            print(json.dumps({"stuck": current["name"]}), flush=True)
            os._exit(3)

threading.Thread(target=watchdog, daemon=True).start()
for name, argv in json.loads(sys.argv[1]).items():
    current.update(name=name, since=time.monotonic())
    outcome = {}
    start = time.monotonic()
    try:
        load_run(argv[0])
        outcome["load"] = ["loaded", ""]
    except RunLoadError as error:
        outcome["load"] = ["RunLoadError", str(error)]
    except BaseException as error:
        outcome["load"] = [type(error).__name__, str(error)[:300]]
    outcome["load_seconds"] = time.monotonic() - start
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            outcome["status"] = cli_main(["report", *argv])
    except BaseException as error:
        outcome["status"] = f"{type(error).__name__}: {str(error)[:300]}"
    outcome["report_seconds"] = time.monotonic() - start
    outcome["stdout"], outcome["stderr"] = out.getvalue(), err.getvalue()
    current["name"] = None
    print(json.dumps({"name": name, "outcome": outcome}), flush=True)
"""


def _run_child(cases: dict[str, list[str]]) -> dict[str, dict]:
    """Outcome per case; a case that hangs is marked stuck and the rest run in a new child."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    results: dict[str, dict] = {}
    while len(results) < len(cases):
        remaining = {name: argv for name, argv in cases.items() if name not in results}
        done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(remaining)],
                              capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
        before = len(results)
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if "stuck" in record:
                    results[record["stuck"]] = {"load": ["stuck", "no answer after 5 s"]}
                else:
                    results[record["name"]] = record["outcome"]
        if len(results) == before:
            raise AssertionError(f"the child process failed:\n{done.stderr[-3000:]}")
    return results


@pytest.fixture(scope="module")
def hostile_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    cases, culprits = {}, {}
    for name, make in HOSTILE.items():
        folder = root / name
        culprits[name] = make(folder)
        cases[name] = [str(folder)]
    return _run_child(cases), culprits


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_load_run_refuses_a_hostile_folder_at_once_naming_the_file(hostile_results, name):
    results, culprits = hostile_results
    outcome = results[name]
    kind, message = outcome["load"]
    assert kind == "RunLoadError", f"{kind}: {message}"
    assert culprits[name] in message
    assert outcome["load_seconds"] < SECONDS


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_report_on_a_hostile_folder_exits_2_with_one_line(hostile_results, name):
    results, culprits = hostile_results
    outcome = results[name]
    assert outcome.get("status") == 2, outcome
    assert outcome["stdout"] == ""
    lines = outcome["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanwidget report: ")
    assert culprits[name] in lines[0]
    assert outcome["report_seconds"] < SECONDS


def test_python_m_nanwidget_report_on_a_fifo_returns_status_2(tmp_path):
    _fifo_chunk(tmp_path / "run")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "nanwidget", "report", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=30, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "frames-000099.parquet" in done.stderr
    assert time.monotonic() - start < 30  # interpreter start and imports included


# ---------------------------------------------------------------------------- readable, but odd
class Evil(nn.Module):
    """A child whose name holds terminal control sequences (add_module allows them)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("ok", nn.Linear(16, 16))
        self.add_module("evil\x1b[2J\x1b]0;owned\x07\rname\u202e", nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "evil\x1b[2J\x1b]0;owned\x07\rname\u202e")(self.ok(x))


def test_report_escapes_control_characters_in_module_names(tmp_path, capsys):
    from nanwidget.cli import main as cli_main
    _record(tmp_path, Evil())
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Detected inf/nan during batch_number=1" in out
    printed = set(out) - {"\n"}
    assert not any(ord(c) < 32 or ord(c) == 127 or c == "\u202e" for c in printed)
    assert r"evil\x1b[2J\x1b]0;owned\x07\rname\u202e" in out


def test_report_says_so_when_the_rank_is_not_in_the_recording(tmp_path, capsys):
    from nanwidget.cli import main as cli_main
    _record(tmp_path)
    assert cli_main(["report", str(tmp_path), "--rank", "7"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"nanwidget report: rank 7 is not in the recording {tmp_path} (it holds rank 0)"]

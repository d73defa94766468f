"""log_dir recording and load_run: round trips, crash safety, damaged directories, report CLI."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import nanwidget as nw
from nanwidget.cli import main as cli_main
from nanwidget.core import persist
from nanwidget.core.persist import tables as persist_tables
from nanwidget.core.persist import RunLoadError, load_run

from conftest import TinyMLP

REPO = Path(__file__).resolve().parents[1]


def _train_with_nan(model: torch.nn.Module, log_dir: Path, batches: int = 5, nan_batch: int = 3,
                    **options) -> nw.NanWatch:
    """Run ``batches`` forwards with a NaN input at ``nan_batch`` (recorded, not raised)."""
    watch = nw.watch(model, log_dir=str(log_dir), on_nan="record", **options)
    for batch in range(batches):
        x = torch.randn(8, 16)
        if batch == nan_batch:
            x[0, 0] = float("nan")
        model(x)
    return watch


def _sorted_history(table: pd.DataFrame) -> pd.DataFrame:
    return table.sort_values(["rank", "batch", "module"]).reset_index(drop=True)


def test_single_process_recording_round_trips_frames_history_and_events(tiny_mlp, tmp_path):
    watch = _train_with_nan(tiny_mlp, tmp_path, trace_batches=[1])
    watch.close()
    run = load_run(tmp_path)

    assert run.ranks == [0] and run.world_size == 1 and run.model_class == "TinyMLP"
    assert run.module_names == watch.module_names
    pd.testing.assert_frame_equal(_sorted_history(run.history()), _sorted_history(watch.history()))
    pd.testing.assert_frame_equal(run.frames(batch=1), watch.frames(batch=1))
    assert [(e.batch, e.module, e.role, e.kind, e.origin) for e in run.events] == \
        [(e.batch, e.module, e.role, e.kind, e.origin) for e in watch.events]
    pd.testing.assert_frame_equal(run.event.frames, watch.event.frames)
    assert run.report() == watch.report()
    assert "Detected inf/nan during batch_number=3" in run.report()
    assert run.finished and run.notes == [] and run.events_dropped == 0
    # The last frames held at close are kept too, so frames() reaches the final batch.
    assert run.frames()["batch"].max() == 4
    assert isinstance(run.frames().loc[0, "shape"], tuple)


def test_loaded_report_without_events_equals_the_watch_report(tiny_mlp, tmp_path):
    # The frames held at the end reach back into trace batch 1: both reports say so alike.
    with nw.watch(tiny_mlp, log_dir=str(tmp_path), trace_batches=[1], max_frames=8) as watch:
        for _ in range(3):
            tiny_mlp(torch.randn(4, 16))
    text = watch.report()
    assert "*** Starting batch number=1 ***" in text and "No inf/nan detected (batch_number=2)" in text
    assert load_run(tmp_path).report() == text


@pytest.fixture
def json_tables():
    """Tables written as JSON, as on a machine without pyarrow."""
    persist.use_parquet(False)
    try:
        yield
    finally:
        persist.use_parquet(True)


def test_recording_without_pyarrow_falls_back_to_json_tables(tiny_mlp, tmp_path, json_tables):
    watch = _train_with_nan(tiny_mlp, tmp_path, trace_batches=[0])
    watch.close()
    files = sorted(p.name for p in (tmp_path / "rank-00000").iterdir())
    assert not any(name.endswith(".parquet") for name in files)
    assert "history-000000.json" in files and "event-000000.frames.json" in files

    run = load_run(tmp_path)
    pd.testing.assert_frame_equal(_sorted_history(run.history()), _sorted_history(watch.history()))
    pd.testing.assert_frame_equal(run.frames(batch=0), watch.frames(batch=0))
    pd.testing.assert_frame_equal(run.event.frames, watch.event.frames)


def test_event_is_on_disk_as_soon_as_it_is_found(tiny_mlp, tmp_path):
    watch = _train_with_nan(tiny_mlp, tmp_path, batches=4)
    try:
        run = load_run(tmp_path)  # the watch is still open: nothing closed, nothing at exit
        assert [(e.batch, e.module) for e in run.events] == [(3, "fc1")]
        assert set(run.history()["batch"]) == {0, 1, 2, 3}
    finally:
        watch.close()


def test_chunks_are_flushed_every_n_batches(tiny_mlp, tmp_path, monkeypatch):
    monkeypatch.setenv("NANWIDGET_FLUSH_BATCHES", "2")
    with nw.watch(tiny_mlp, log_dir=str(tmp_path)):
        for _ in range(5):
            tiny_mlp(torch.randn(4, 16))
        chunks = sorted(p.name for p in (tmp_path / "rank-00000").glob("history-*"))
        assert len(chunks) == 2  # batches 0-1 and 2-3; batch 4 waits for the next flush
    assert set(load_run(tmp_path).history()["batch"]) == set(range(5))


def test_one_batch_split_over_two_chunks_is_folded_back(tiny_mlp, tmp_path, monkeypatch):
    monkeypatch.setenv("NANWIDGET_FLUSH_BATCHES", "1")
    with nw.watch(tiny_mlp, log_dir=str(tmp_path)) as watch:
        watch.set_batch(0)
        tiny_mlp(torch.randn(4, 16))
        tiny_mlp(torch.randn(4, 16) * 100)  # same batch, second micro-batch, larger values
        watch.step()
    run = load_run(tmp_path)
    pd.testing.assert_frame_equal(_sorted_history(run.history()), _sorted_history(watch.history()))


def test_sigkilled_recording_leaves_a_directory_that_loads(tmp_path):
    log_dir = tmp_path / "log"
    env = dict(os.environ, PYTHONPATH=str(REPO), NANWIDGET_FLUSH_BATCHES="2")
    process = subprocess.Popen([sys.executable, str(REPO / "tests/scripts/record_until_killed.py"),
                                str(log_dir)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        for line in process.stdout:
            if line.strip() == "batch 12" or time.monotonic() > deadline:
                break
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
    assert process.returncode == -signal.SIGKILL

    run = load_run(log_dir)
    batches = set(run.history()["batch"])
    assert set(range(12)) <= batches  # only the unflushed tail of the run may be missing
    assert [(e.batch, e.module, e.rank) for e in run.events] == [(3, "0", 0)]
    assert set(run.frames(batch=1)["module"]) == {"", "0", "1", "2"}
    manifest = json.loads((log_dir / "rank-00000" / "manifest.json").read_text())
    assert "closed" not in manifest  # it really died without closing
    # ... and the loaded run says so, with the last batch it has on disk.
    last = int(run.history()["batch"].max())
    assert not run.finished and "not closed" in repr(run)
    assert run.notes == [
        "recording not closed: its process is still running, or it ended before closing the "
        f"watch (killed, or a hard crash); the last batch on disk is {last}; records made after "
        "the last flush may be missing"]
    report = subprocess.run([sys.executable, "-m", "nanwidget", "report", str(log_dir)],
                            capture_output=True, text=True, env=env, timeout=60)
    assert report.returncode == 0, report.stderr
    assert report.stdout.splitlines()[1] == run.notes[0]


def test_each_rank_says_whether_its_recording_was_closed(tiny_mlp, tmp_path, monkeypatch,
                                                         capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with nw.watch(tiny_mlp, log_dir=str(tmp_path)):
        tiny_mlp(torch.randn(4, 16))
    monkeypatch.setenv("RANK", "1")
    still_open = nw.watch(tiny_mlp, log_dir=str(tmp_path), on_nan="record")
    try:
        for _ in range(3):
            tiny_mlp(torch.randn(4, 16))
        tiny_mlp(torch.full((4, 16), float("nan")))  # an event: batches 0-3 flushed
        run = load_run(tmp_path)
        assert run.ranks == [0, 1] and not run.finished
        assert len(run.notes) == 1 and run.notes[0].startswith(
            "rank 1: recording not closed: its process is still running, or it ended before "
            "closing the watch") and "the last batch on disk is 3;" in run.notes[0]
        assert cli_main(["report", str(tmp_path)]) == 0
        assert run.notes[0] in capsys.readouterr().out.splitlines()
    finally:
        still_open.close()
    run = load_run(tmp_path)
    assert run.finished and run.notes == []


def test_disk_keeps_the_events_the_watch_keeps_and_counts_the_rest(tiny_mlp, tmp_path,
                                                                   monkeypatch, capsys):
    monkeypatch.setenv("NANWIDGET_FLUSH_BATCHES", "1")
    watch = _train_with_nan(tiny_mlp, tmp_path, batches=3, nan_batch=0, max_events=2)
    try:
        for _ in range(4):
            tiny_mlp(torch.full((4, 16), float("nan")))  # one event each batch
        tiny_mlp(torch.randn(4, 16))  # a batch end flushes (the last event came after one)
        assert len(watch.events) == 2 and watch.events_dropped == 3
        run = load_run(tmp_path)  # still open: the count of the last flush
        assert [e.batch for e in run.events] == [e.batch for e in watch.events] == [0, 3]
        assert run.events_dropped == 3
        assert "at least 3 later event(s) past max_events were counted but not kept " \
               "(the first 2 are)" in run.notes
    finally:
        watch.close()
    manifest = json.loads((tmp_path / "rank-00000" / "manifest.json").read_text())
    assert (manifest["events"], manifest["events_dropped"]) == (2, 3)
    assert len(list((tmp_path / "rank-00000").glob("event-[0-9]*[0-9].json"))) == 2
    run = load_run(tmp_path)
    assert run.finished and run.events_dropped == 3 == watch.events_dropped
    assert run.notes == ["3 later event(s) past max_events were counted but not kept "
                         "(the first 2 are)"]
    assert cli_main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == run.notes[0]


def test_a_recording_where_an_older_writer_kept_every_event_counts_none_missing(tiny_mlp,
                                                                                  tmp_path):
    # Older nanwidget wrote every event and counted those past max_events in the manifest.
    watch = _train_with_nan(tiny_mlp, tmp_path, batches=4, nan_batch=0, max_events=1)
    tiny_mlp(torch.full((4, 16), float("nan")))
    watch.close()
    rank_dir = tmp_path / "rank-00000"
    event = json.loads((rank_dir / "event-000000.json").read_text())
    for suffix in (".json", ".frames.parquet"):
        (rank_dir / f"event-000001{suffix}").write_bytes(
            (rank_dir / f"event-000000{suffix}").read_bytes())
    (rank_dir / "event-000001.json").write_text(
        json.dumps(dict(event, frames_file="event-000001.frames.parquet")))
    run = load_run(tmp_path)
    assert len(run.events) == 2 and run.events_dropped == 0 and run.notes == []


def test_leftover_temporary_files_are_ignored(tiny_mlp, tmp_path):
    _train_with_nan(tiny_mlp, tmp_path).close()
    (tmp_path / "rank-00000" / ".history-000009.parquet.123.tmp").write_bytes(b"PAR1 half")
    assert len(load_run(tmp_path).events) == 1


def _recorded_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    _train_with_nan(TinyMLP(), tmp_path).close()
    return tmp_path / "rank-00000"


@pytest.mark.parametrize("damage, culprit", [
    ("truncated parquet", "history-000000.parquet"),
    ("manifest not json", "manifest.json"),
    ("manifest from the future", "manifest.json"),
    ("event frames missing", "event-000000.frames.parquet"),
    ("event field wrong type", "event-000000.json"),
    ("column of the wrong type", "history-000001.parquet"),
    ("manifest events_dropped negative", "manifest.json"),
    ("manifest closed not text", "manifest.json"),
])
def test_damaged_recording_raises_run_load_error_naming_the_file(tmp_path, damage, culprit):
    rank_dir = _recorded_dir(tmp_path)
    if damage == "truncated parquet":
        data = (rank_dir / culprit).read_bytes()
        (rank_dir / culprit).write_bytes(data[: len(data) // 2])
    elif damage == "manifest not json":
        (rank_dir / culprit).write_text('{"format": "nanwidget-log", ')
    elif damage == "manifest from the future":
        manifest = json.loads((rank_dir / culprit).read_text())
        manifest["version"] = 99
        (rank_dir / culprit).write_text(json.dumps(manifest))
    elif damage == "event frames missing":
        (rank_dir / culprit).unlink()
    elif damage == "event field wrong type":
        meta = json.loads((rank_dir / culprit).read_text())
        meta["batch"] = "three"
        (rank_dir / culprit).write_text(json.dumps(meta))
    elif damage.startswith("manifest "):
        manifest = json.loads((rank_dir / culprit).read_text())
        if damage.endswith("negative"):
            manifest["events_dropped"] = -1
        else:
            manifest["closed"] = 1
        (rank_dir / culprit).write_text(json.dumps(manifest))
    elif damage == "column of the wrong type":
        persist_tables.write_table(rank_dir / "history-000001", {"batch": ["a"], "module": ["x"]})
    with pytest.raises(RunLoadError, match=culprit.replace(".", r"\.")) as caught:
        load_run(tmp_path)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("layout", ["missing", "empty", "foreign", "file"])
def test_foreign_or_empty_directory_raises_a_clear_error(tmp_path, layout):
    target = tmp_path / "logs"
    if layout == "empty":
        target.mkdir()
    elif layout == "foreign":
        target.mkdir()
        (target / "events.out.tfevents.1").write_bytes(b"\x00\x01")
        (target / "rank-00000").mkdir()  # looks like ours, but no manifest
    elif layout == "file":
        target.write_text("not a directory")
    with pytest.raises(RunLoadError, match="logs"):
        load_run(target)


def test_loading_never_unpickles_what_the_directory_holds(tmp_path):
    rank_dir = _recorded_dir(tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (rank_dir / "history-000007.parquet").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(RunLoadError, match="history-000007.parquet"):
        load_run(tmp_path)
    assert not marker.exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only: the test forks a child")
def test_a_forked_child_writes_nothing_into_the_parents_recording(tiny_mlp, tmp_path):
    # Hogwild or DataLoader workers calling the watched model: the folder, its rank and batch
    # numbers are the parent's; the child's watch records in its own memory only.
    w = nw.watch(tiny_mlp, log_dir=str(tmp_path), on_nan="record")
    for _ in range(3):
        tiny_mlp(torch.randn(4, 16))
    pid = os.fork()
    if pid == 0:  # the child: a NaN batch of its own, then close, as a worker would
        code = 1
        try:
            # GNU OpenMP's thread pool does not survive a fork: a matmul the parent ran on it
            # hangs the child's (unwatched too); one thread takes no pool.
            torch.set_num_threads(1)
            tiny_mlp(torch.randn(4, 16))
            tiny_mlp(torch.full((4, 16), float("nan")))
            code = 0 if len(w.events) == 1 and w.batch == 5 else 3
            w.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # the child recorded its event in memory
    tiny_mlp(torch.randn(4, 16))
    w.close()
    run = load_run(tmp_path)
    manifest = json.loads((tmp_path / "rank-00000" / "manifest.json").read_text())
    assert run.events == [] and manifest["events"] == 0 and manifest["batches"] == 4
    assert sorted(run.history().batch.unique()) == [0, 1, 2, 3]
    assert not list((tmp_path / "rank-00000").glob("event-*"))


def test_second_watch_refuses_to_mix_two_runs_in_one_log_dir(tiny_mlp, tmp_path):
    nw.watch(tiny_mlp, log_dir=str(tmp_path)).close()
    with pytest.raises(FileExistsError, match="already holds a nanwidget recording"):
        nw.watch(tiny_mlp, log_dir=str(tmp_path))
    from conftest import hook_count
    assert hook_count(tiny_mlp) == 0  # the failed watch left no hooks behind


def test_gradient_norms_are_recorded_and_load_back(tiny_mlp, tmp_path, monkeypatch):
    monkeypatch.setenv("NANWIDGET_FLUSH_SECONDS", "0")  # every batch end writes new norms
    optimizer = torch.optim.SGD(tiny_mlp.parameters(), lr=0.1)
    with nw.watch(tiny_mlp, log_dir=str(tmp_path)) as watch:
        for _ in range(4):
            optimizer.zero_grad()
            tiny_mlp(torch.randn(8, 16)).pow(2).mean().backward()
            watch.check_grad_norms()
            optimizer.step()
        chunks = list((tmp_path / "rank-00000").glob("grads-*"))
        assert len(chunks) == 3  # batches 0, 1, 2 at the next batch ends; 3 waits for close
    expected = watch.grad_history()
    loaded = load_run(tmp_path).grad_history()
    assert len(expected) == 4 * 6  # 4 batches x 6 parameters
    pd.testing.assert_frame_equal(loaded[expected.columns].sort_values(["batch", "param"])
                                  .reset_index(drop=True),
                                  expected.sort_values(["batch", "param"]).reset_index(drop=True),
                                  check_dtype=False)


def test_run_without_grad_norms_has_an_empty_grad_history(tiny_mlp, tmp_path):
    nw.watch(tiny_mlp, log_dir=str(tmp_path)).close()
    assert load_run(tmp_path).grad_history().empty


def test_load_run_and_run_are_served_from_the_package(tmp_path, tiny_mlp):
    nw.watch(tiny_mlp, log_dir=str(tmp_path)).close()
    assert isinstance(nw.load_run(tmp_path), nw.Run)
    assert nw.load_run is persist.load_run


def test_report_command_prints_each_event(tiny_mlp, tmp_path, capsys):
    _train_with_nan(tiny_mlp, tmp_path).close()
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 event(s)" in out
    assert "=== event 1 of 1: rank 0, batch 3 ===" in out
    assert "Detected inf/nan during batch_number=3" in out


def test_report_command_on_a_run_without_events_says_so(tiny_mlp, tmp_path, capsys):
    with nw.watch(tiny_mlp, log_dir=str(tmp_path)):
        tiny_mlp(torch.randn(4, 16))
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "No NaN/Inf recorded." in out and "No inf/nan detected (batch_number=0)" in out


def test_report_command_on_an_empty_directory_fails_clearly(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "holds no nanwidget recording" in captured.err and captured.out == ""


def test_browse_opens_the_frame_browser_on_a_loaded_run(tiny_mlp, tmp_path):
    _train_with_nan(tiny_mlp, tmp_path).close()
    browser = load_run(tmp_path).browse()
    assert type(browser).__name__ == "FrameBrowser"
    assert "nw-browser" in browser._dom_classes
    assert "nan in batch 3 at module 'fc1'" in browser.status.value


class _SqrtBetweenLayers(torch.nn.Module):
    """A functional op between two modules makes the NaN: only a replay names it."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 8)
        self.second = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.sqrt(self.first(x) - 5))


def test_a_replay_on_nan_event_is_written_with_its_trace(tmp_path):
    torch.manual_seed(0)
    model = _SqrtBetweenLayers()
    watch = nw.watch(model, log_dir=str(tmp_path), replay_on_nan=True, on_nan="record")
    with watch:
        model(torch.randn(4, 6))
    live = watch.event.trace
    assert live is not None and live.first_bad["op"] == "sqrt"
    run = load_run(tmp_path)
    loaded = run.event.trace
    assert loaded is not None
    assert loaded.first_bad["op"] == "sqrt" and loaded.first_bad["source"] == live.first_bad["source"]
    pd.testing.assert_frame_equal(loaded.ops, live.ops, check_dtype=False)
    pd.testing.assert_frame_equal(loaded.frames, live.frames)
    pd.testing.assert_frame_equal(loaded.first_bad_tensors, live.first_bad_tensors,
                                  check_dtype=False)
    assert loaded.summary() == live.summary()
    assert "first bad op sqrt" in run.event.summary()
    assert "First non-finite op: sqrt" in run.report()


def _recorded_sqrt_event(tmp_path):
    """A recording of one sqrt-of-negative event with its trace: the model, the event's file
    and its parsed contents (for tests that damage or age the file)."""
    torch.manual_seed(0)
    model = _SqrtBetweenLayers()
    with nw.watch(model, log_dir=str(tmp_path), replay_on_nan=True, on_nan="record"):
        model(torch.randn(4, 6))
    event_file = tmp_path / "rank-00000" / "event-000000.json"
    return model, event_file, json.loads(event_file.read_text())


def test_a_trace_recorded_before_the_inf_signs_were_kept_still_loads(tmp_path):
    model, event_file, meta = _recorded_sqrt_event(tmp_path)
    for row in meta["trace"]["first_bad_tensors"]:
        del row["pos_inf_count"], row["neg_inf_rows"]
    event_file.write_text(json.dumps(meta))
    run = load_run(tmp_path)
    loaded = run.event.trace
    assert loaded.first_bad["op"] == "sqrt"
    assert loaded.first_bad_tensors["neg_inf_rows"].isna().all()  # unknown, not 0
    assert "First non-finite op: sqrt" in run.report()


class _SqrtOfFeatures(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


def _recorded_sqrt_trace(folder: Path) -> tuple[nw.NanWatch, Path]:
    """A recording whose trace's first bad op is a sqrt that only sample 2 made NaN."""
    model = _SqrtOfFeatures()
    x = torch.linspace(0.1, 1.0, 24).reshape(4, 6)
    x[2, 3] = -1.0
    watch = nw.watch(model, log_dir=str(folder), replay_on_nan=True, on_nan="record")
    with watch:
        model(x)
    return watch, folder / "rank-00000" / "event-000000.json"


def test_the_first_bad_ops_rows_and_the_diagnosis_rows_are_read_back(tmp_path):
    watch, _ = _recorded_sqrt_trace(tmp_path)
    live = watch.event
    rows = live.trace.first_bad_tensors.set_index("role").loc["output", "nonfinite_rows"]
    assert rows == [2] and live.diagnosis.rows == [2]  # (4, 6): dim 0 is the batch's samples
    loaded = load_run(tmp_path).event
    assert loaded.trace.first_bad_tensors.set_index("role").loc["output", "nonfinite_rows"] == rows
    assert loaded.diagnosis.rows == rows


def test_a_trace_recorded_before_the_rows_were_kept_still_loads(tmp_path):
    _, event_file = _recorded_sqrt_trace(tmp_path)
    meta = json.loads(event_file.read_text())
    for row in meta["trace"]["first_bad_tensors"]:
        del row["nonfinite_rows"]  # what a recording written before the outputs' rows holds
    event_file.write_text(json.dumps(meta))
    loaded = load_run(tmp_path).event.trace
    assert loaded.first_bad["op"] == "sqrt"
    assert loaded.first_bad_tensors["nonfinite_rows"].isna().all()  # unknown, not none
    assert "First non-finite op: sqrt" in loaded.report()


@pytest.mark.parametrize("rows", ["0,1", [0.5], [[1]]])
def test_a_trace_whose_rows_are_not_row_numbers_is_refused(tmp_path, rows):
    _, event_file = _recorded_sqrt_trace(tmp_path)
    meta = json.loads(event_file.read_text())
    meta["trace"]["first_bad_tensors"][-1]["nonfinite_rows"] = rows
    event_file.write_text(json.dumps(meta))
    with pytest.raises(RunLoadError, match="first_bad_tensors"):
        load_run(tmp_path)


def test_a_trace_that_stopped_where_the_forward_raised_is_read_back_so(tmp_path):
    class RaisesOnNan(_SqrtBetweenLayers):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = super().forward(x)
            if not torch.isfinite(h).all():
                raise ValueError("non-finite state")
            return h

    torch.manual_seed(0)
    model = RaisesOnNan()
    with nw.watch(model, log_dir=str(tmp_path), replay_on_nan=True, on_nan="record"):
        with pytest.raises(ValueError):
            model(torch.randn(4, 6))
    loaded = load_run(tmp_path).event.trace
    assert loaded.raised == "the forward raised ValueError (non-finite state)"
    assert loaded.first_bad["op"] == "sqrt"


def test_an_event_whose_trace_file_points_elsewhere_is_refused(tmp_path):
    model, event_file, meta = _recorded_sqrt_event(tmp_path)
    meta["trace"]["ops_file"] = "../../elsewhere.parquet"
    event_file.write_text(json.dumps(meta))
    with pytest.raises(RunLoadError, match="ops_file"):
        load_run(tmp_path)


def test_a_recording_from_before_the_finite_range_columns_still_loads(tiny_mlp, tmp_path,
                                                                      json_tables):
    watch = _train_with_nan(tiny_mlp, tmp_path, trace_batches=[0])
    watch.close()
    for path in (tmp_path / "rank-00000").glob("*frames*.json"):
        data = json.loads(path.read_text())
        for column in ("finite_abs_min", "finite_abs_max"):
            data["columns"].pop(column)
        path.write_text(json.dumps(data))
    run = load_run(tmp_path)
    frames = run.frames()
    finite = ~(frames["nan"] | frames["inf"])
    assert (frames.loc[finite, "finite_abs_max"] == frames.loc[finite, "abs_max"]).all()
    assert frames.loc[~finite, "finite_abs_max"].isna().all()


@pytest.mark.parametrize("rank", ["-1", "", "two", None], ids=["negative", "empty", "text", "missing"])
def test_recording_made_with_an_unusual_rank_is_written_where_load_run_finds_it(
        tiny_mlp, tmp_path, monkeypatch, rank):
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with nw.watch(tiny_mlp, log_dir=str(tmp_path), on_nan="record") as watch:
        tiny_mlp(torch.randn(4, 16))
        tiny_mlp(torch.full((4, 16), float("nan")))
    assert [p.name for p in tmp_path.iterdir()] == ["rank-00000"]
    run = load_run(tmp_path)
    assert run.ranks == [0]
    assert [(e.rank, e.batch, e.module) for e in run.events] == [(0, 1, "fc1")]
    assert set(run.history()["batch"]) == {0, 1} == set(watch.history()["batch"])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_reading_a_recording_starts_no_arrow_thread(tiny_mlp, tmp_path):
    # A short process that read parquet with arrow's thread pool could abort as it exited, its
    # work done ("terminate called without an active exception": `python -m nanwidget report`
    # exited -6 in CI). The reader decodes on the calling thread.
    pytest.importorskip("pyarrow")
    _train_with_nan(tiny_mlp, tmp_path).close()
    assert list(tmp_path.rglob("*.parquet"))
    script = ("import os, sys, nanwidget as nw\n"
              "count = lambda: len(os.listdir('/proc/self/task'))\n"
              "before = count()\n"
              "run = nw.load_run(sys.argv[1])\n"
              "run.frames(); run.history(); run.report()\n"
              "print(before, count())\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = map(int, done.stdout.split())
    assert after == before, (before, after)

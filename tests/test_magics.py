"""%nanwatch and %%nanwatch through a real IPython InteractiveShell."""

from __future__ import annotations

import gc
import re
import sys
import warnings
import weakref

import ipywidgets
import pytest
import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import nanwidget as nw
from nanwidget.core.events import NanDetected
from nanwidget.magics.manager import LiveStatus

from conftest import TinyMLP, hook_count


@pytest.fixture
def ip():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nanwidget")
    shell.user_ns.update(torch=torch, nw=nw, model=TinyMLP())
    yield shell
    shell.run_line_magic("unload_ext", "nanwidget")
    for name in ("model", "other", "trainer", "not_a_model", "_nanwatch", "w2", "torch", "nw",
                 "TinyMLP", "interrupt_at", "x"):
        shell.user_ns.pop(name, None)


def run(shell: InteractiveShell, code: str):
    """Run a cell like a notebook would; re-raise what it raised so tests can assert on it."""
    result = shell.run_cell(code)
    if result.error_before_exec is not None:
        raise result.error_before_exec
    if result.error_in_exec is not None:
        raise result.error_in_exec
    return result.result


PLANT_NAN = ("with torch.no_grad():\n"
             "    model.fc2.weight[0, 0] = float('nan')\n")


def test_line_magic_starts_a_watch_and_prints_one_status_line(ip):
    model = ip.user_ns["model"]
    with capture_output() as captured:
        run(ip, "%nanwatch model -n 7")
    lines = captured.stdout.strip().splitlines()
    assert len(lines) == 1
    assert "watching model (TinyMLP" in lines[0] and "keeping 7 frames" in lines[0]
    assert hook_count(model) > 0
    watch = ip.user_ns["_nanwatch"]
    assert watch.max_frames == 7 and not watch.closed


def test_a_line_watch_stopping_again_shows_the_new_event_not_the_first(ip):
    run(ip, "%nanwatch model")
    with capture_output():
        ip.run_cell(PLANT_NAN + "model(torch.randn(2, 16))")
    with capture_output() as captured:
        ip.run_cell("with torch.no_grad():\n    model.fc2.weight[0, 0] = 0.5\n"
                    "    model.head.bias[1] = float('inf')\nmodel(torch.randn(2, 16))")
    assert "NanDetected: inf in batch 1 at module 'head'" in captured.stderr
    shown = [o.data["text/plain"] for o in captured.outputs
             if "application/vnd.jupyter.widget-view+json" in o.data]
    assert len(shown) == 1 and "inf in batch 1 at module 'head'" in shown[0]
    assert "nan in batch 0" not in shown[0]


def test_a_line_watch_abort_after_reads_as_one_line_not_a_traceback(ip):
    run(ip, "%nanwatch model --abort-after 0")
    with capture_output() as captured:
        result = ip.run_cell("for _ in range(3):\n    model(torch.randn(2, 16))")
    assert isinstance(result.error_in_exec, nw.AbortAfterBatch)
    lines = captured.stderr.splitlines()
    assert lines[0] == "AbortAfterBatch: nanwidget: stopping after batch 0 (abort_after=0)"
    assert re.fullmatch(r"  raised at cell In\[\d+\], line 2: model\(torch.randn\(2, 16\)\)",
                        lines[1])
    assert lines[2:] == ["(full traceback: %tb)"]
    assert "Traceback" not in captured.stdout + captured.stderr


def test_line_watch_catches_a_nan_in_a_later_cell(ip):
    run(ip, "%nanwatch model --on-nan record")
    run(ip, "for _ in range(2):\n    model(torch.randn(2, 16))\n" + PLANT_NAN
        + "model(torch.randn(2, 16))")
    event = ip.user_ns["_nanwatch"].event
    assert event is not None and event.module == "fc2" and event.batch == 2


def test_nan_in_a_line_watched_cell_reads_as_one_line_and_a_browser(ip):
    run(ip, "%nanwatch model")
    cell = ("def train():\n    for _ in range(2):\n        model(torch.randn(2, 16))\n"
            "    " + PLANT_NAN.replace("\n    ", "\n        ") + "    model(torch.randn(2, 16))\n"
            "train()\n")
    with capture_output() as captured:
        result = ip.run_cell(cell)
    assert isinstance(result.error_in_exec, NanDetected)
    text = captured.stdout + captured.stderr
    assert "NanDetected: nan in batch 2 at module 'fc2'" in text
    assert "raised at" in text and "model(torch.randn(2, 16))" in text
    assert "_forward_hook" not in text and "Traceback" not in text
    assert any("application/vnd.jupyter.widget-view+json" in o.data for o in captured.outputs)
    with capture_output() as captured:
        ip.run_line_magic("tb", "")
    assert "_forward_hook" in captured.stdout  # the full traceback is one %tb away


def test_every_option_reaches_the_watch(ip, tmp_path):
    run(ip, "%nanwatch model -n 5 --trace-batches 1,3 --abort-after 7 --skip ReLU "
            f"--backward --grad-norm 2.5 --on-nan warn --log-dir {tmp_path / 'run'}")
    watch = ip.user_ns["_nanwatch"]
    assert watch.max_frames == 5
    assert watch.trace_batches == {1, 3}
    assert watch.abort_after == 7
    assert "act" not in watch.module_names and "fc1" in watch.module_names
    assert watch.backward is True
    assert watch.grad_norm_warn == 2.5
    assert watch.on_nan == "warn"
    assert watch.log_dir == str(tmp_path / "run")


def test_loss_fn_is_a_function_of_the_notebook_named_by_loss_fn(ip):
    run(ip, "def criterion(out):\n    return out.square().mean()\n")
    run(ip, "%nanwatch model --loss-fn criterion")
    assert ip.user_ns["_nanwatch"].loss_fn is ip.user_ns["criterion"]
    with pytest.raises(UsageError, match="no variable named 'nope' in the notebook"):
        run(ip, "%nanwatch model --loss-fn nope")
    with pytest.raises(UsageError, match="--loss-fn must be a function of the model's output"):
        run(ip, "%nanwatch model --loss-fn model.fc1.weight")
    ip.user_ns.pop("criterion")


def test_off_stops_one_model_or_all(ip):
    ip.user_ns["other"] = TinyMLP()
    run(ip, "%nanwatch model")
    run(ip, "%nanwatch other")
    with capture_output() as captured:
        run(ip, "%nanwatch --off model")
    assert "stopped watching model" in captured.stdout
    assert hook_count(ip.user_ns["model"]) == 0 and hook_count(ip.user_ns["other"]) > 0
    run(ip, "%nanwatch --off")
    assert hook_count(ip.user_ns["other"]) == 0


def test_starting_again_replaces_the_watch_instead_of_doubling_hooks(ip):
    run(ip, "%nanwatch model")
    hooks = hook_count(ip.user_ns["model"])
    with capture_output() as captured:
        run(ip, "%nanwatch model -n 3")
    assert captured.stdout.startswith("(restarted)")
    assert hook_count(ip.user_ns["model"]) == hooks


def test_dotted_names_reach_a_model_inside_an_object(ip):
    run(ip, "class Trainer:\n    pass\ntrainer = Trainer()\ntrainer.model = model")
    run(ip, "%nanwatch trainer.model")
    assert hook_count(ip.user_ns["model"]) > 0


@pytest.mark.parametrize("line, message", [
    ("%nanwatch missing", "no variable named 'missing'"),
    ("%nanwatch not_a_model", "'not_a_model' is a list, not a torch.nn.Module"),
    ("%nanwatch model.nothing", "model has no attribute 'nothing'"),
    ("%nanwatch model -n many", "expected a whole number, got 'many'"),
    ("%nanwatch model -n 0", "--frames must be at least 1"),  # the flag, not max_frames
    ("%nanwatch count", "'count' is an int, not a torch.nn.Module"),
    ("%nanwatch model --on-nan sometimes", "invalid choice: 'sometimes'"),
    ("%nanwatch model --trace-batches 1,x", "batch numbers separated by commas"),
    # An empty part was dropped silently: "1,,2" watched batches 1 and 2, "" none.
    ("%nanwatch model --trace-batches 1,,2", "batch numbers separated by commas .*got '1,,2'"),
    ("%nanwatch model --trace-batches ,1", "batch numbers separated by commas .*got ',1'"),
    ("%nanwatch model --trace-batches 1,", "batch numbers separated by commas .*got '1,'"),
    ('%nanwatch model --trace-batches ""', "batch numbers separated by commas .*got ''"),
    ("%nanwatch model --skip ReLU,,Dropout", "class names separated by commas .*'ReLU,,Dropout'"),
    ("%nanwatch model --skip ReLU,", "class names separated by commas .*got 'ReLU,'"),
    ("%nanwatch model --abort-after -2", "--abort-after must be at least 0.*batch numbers start at 0"),
    ("%nanwatch model --grad-norm -1", "positive finite number"),
    ("%nanwatch model --skip Relu", "--skip: this model has no module of class 'Relu', so it "
                                   "skips nothing; did you mean 'ReLU'?"),
    ("%nanwatch --off model", "%nanwatch --off model: there is no such watch"),
    ("%nanwatch --off nosuch", "%nanwatch --off nosuch: there is no such watch"),
    ('%nanwatch model --log-dir "abc', "could not read its options (No closing quotation)"),
    ("%nanwatch model -n 99999999999999999999", "--frames must be at least 1 and at most"),
    ("%nanwatch model --bogus", "unrecognized arguments: --bogus"),
    ("%nanwatch --off -n 3", "--off stops a watch and takes no watch options (got --frames)"),
    ("%nanwatch model --off --sentinel", "--off .* no watch options (got --sentinel)"),
    # argparse keeps the last of a repeated option: --frames 5 --frames 7 watched with 7.
    ("%nanwatch model --frames 5 --frames 7", "--frames is given twice; give each option once"),
    ("%nanwatch model -n 5 --frames=7", "--frames is given twice"),
    ("%nanwatch model --sentinel --backward --sentinel", "--sentinel is given twice"),
])
def test_misuse_raises_usage_error_with_a_sentence(ip, line, message):
    ip.user_ns["not_a_model"] = [1, 2]
    ip.user_ns["count"] = 3
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run(ip, line)
    assert hook_count(ip.user_ns["model"]) == 0


def test_a_cell_naming_a_missing_model_says_the_cell_magic(ip):
    with pytest.raises(UsageError, match="define the model first, then %%nanwatch missing$"):
        ip.run_cell_magic("nanwatch", "missing", "1 + 1")
    with pytest.raises(UsageError, match="'count' is an int, not a torch.nn.Module; %%nanwatch"):
        ip.user_ns["count"] = 3
        ip.run_cell_magic("nanwatch", "count", "1 + 1")


def test_log_dir_at_a_file_is_a_usage_error(ip, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    with pytest.raises(UsageError, match="--log-dir must be a directory; .*notes.txt. is a file"):
        run(ip, f"%nanwatch model --log-dir {target}")
    assert target.read_text() == "mine" and hook_count(ip.user_ns["model"]) == 0


def test_log_dir_holding_a_recording_is_a_usage_error(ip, tmp_path):
    nw.watch(TinyMLP(), log_dir=str(tmp_path)).close()
    with pytest.raises(UsageError, match="already holds a nanwidget recording"):
        run(ip, f"%nanwatch model --log-dir {tmp_path}")
    assert hook_count(ip.user_ns["model"]) == 0


def test_quoted_option_values_lose_their_quotes_as_in_a_shell(ip, tmp_path, monkeypatch):
    spaced = tmp_path / "runs" / "a b"
    run(ip, f'%nanwatch model --log-dir "{spaced}" --skip \'ReLU\'')
    watched = ip.user_ns["_nanwatch"]
    assert str(watched.log_dir) == str(spaced) and watched.skip_types == ("ReLU",)
    run(ip, "%nanwatch --off")
    assert (spaced / "rank-00000" / "manifest.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # no folder named '"'
    monkeypatch.setenv("HOME", str(tmp_path))
    run(ip, "%nanwatch model --log-dir ~/home-runs")
    run(ip, "%nanwatch --off")
    assert (tmp_path / "home-runs" / "rank-00000" / "manifest.json").exists()


def test_a_log_dir_that_cannot_be_used_leaves_the_running_watch_as_it_was(ip, tmp_path):
    nw.watch(TinyMLP(), log_dir=str(tmp_path / "used")).close()
    (tmp_path / "notes.txt").write_text("mine")
    run(ip, "%nanwatch model -n 7")
    watched = ip.user_ns["_nanwatch"]
    hooks = hook_count(ip.user_ns["model"])
    for bad in (tmp_path / "used", tmp_path / "notes.txt" / "sub"):
        with pytest.raises(UsageError, match=f"--log-dir {bad}") as raised:
            run(ip, f"%nanwatch model --log-dir {bad}")
        assert "stopped" not in str(raised.value)
        assert not watched.closed and hook_count(ip.user_ns["model"]) == hooks
        assert ip.user_ns["_nanwatch"] is watched


def test_a_wrapped_model_is_not_reported_as_rebound(ip):
    run(ip, "compiled = torch.compile(model)")
    with capture_output() as captured:
        ip.run_cell("%nanwatch compiled")
    assert "watching compiled in sentinel mode" in captured.stdout
    assert "names another object" not in captured.stdout
    with capture_output() as captured:
        ip.run_cell("compiled = 1")
    assert "compiled no longer names a model" in captured.stdout
    ip.user_ns.pop("compiled")


@pytest.mark.parametrize("container, advice", [
    ("torch.nn.ModuleDict({'net': model})", "(%nanwatch models.net)"),
    ("torch.nn.ModuleList([model])", "(part = models[0], then %nanwatch part)"),
])
def test_a_container_without_a_forward_is_refused_not_watched_blind(ip, container, advice):
    # Its own forward never runs, so no batch would end: a NaN passed unseen, "0 events".
    run(ip, f"models = {container}")
    for magic in ("%nanwatch models", "%%nanwatch models\nmodel(torch.randn(2, 16))"):
        with pytest.raises(UsageError, match="has no forward of its own") as raised:
            run(ip, magic)
        assert advice in str(raised.value) and "w.step()" in str(raised.value)
        assert hook_count(ip.user_ns["model"]) == 0
    ip.user_ns.pop("models")


def test_a_part_of_a_model_the_magic_watches_names_that_watch(ip):
    run(ip, "%nanwatch model")
    with pytest.raises(UsageError, match=r"model\.fc1 is already watched by %nanwatch model; stop "
                                         r"that watch first with: %nanwatch --off model"):
        run(ip, "%nanwatch model.fc1")


def test_off_stops_a_watch_made_with_nw_watch_on_that_model(ip):
    run(ip, "def start():\n    nw.watch(model)\nstart()")  # the watch object is lost
    assert hook_count(ip.user_ns["model"]) > 0
    with capture_output() as captured:
        run(ip, "%nanwatch --off model")
    assert "stopped watching model" in captured.stdout
    assert hook_count(ip.user_ns["model"]) == 0


ASYNC_CELL = ("%%nanwatch model\n"
              "import asyncio\n"
              "for _ in range(3):\n"
              "    await asyncio.sleep(0)\n"
              "    out = model(torch.randn(2, 16))\n")


def test_cell_with_top_level_await_runs_as_ipython_runs_it(ip):
    with capture_output() as captured:
        value = run(ip, ASYNC_CELL + "await asyncio.sleep(0, result=tuple(out.shape))\n")
    assert value == (2, 4)
    assert captured.outputs[-1].data["text/plain"].startswith("nanwatch model done: 3 batches seen")
    assert hook_count(ip.user_ns["model"]) == 0


def test_cell_with_top_level_await_stops_at_a_nan(ip):
    cell = ASYNC_CELL + PLANT_NAN + "await asyncio.sleep(0)\nmodel(torch.randn(2, 16))\n"
    with capture_output():
        with pytest.raises(NanDetected) as raised:
            run(ip, cell)
    assert raised.value._render_traceback_()[0].startswith("NanDetected: nan in batch 3 at module 'fc2'")
    assert hook_count(ip.user_ns["model"]) == 0


def test_cell_with_top_level_await_called_as_a_magic_function(ip):
    body = ASYNC_CELL.split("\n", 1)[1] + "out.shape[0]\n"
    with capture_output():
        assert ip.run_cell_magic("nanwatch", "model", body) == 2
    assert ip.user_ns["_nanwatch"].batch == 3


def test_without_autoawait_top_level_await_is_a_syntax_error_as_in_ipython(ip):
    ip.autoawait = False
    try:
        with pytest.raises(SyntaxError), capture_output():
            run(ip, ASYNC_CELL)
    finally:
        ip.autoawait = True
    assert hook_count(ip.user_ns["model"]) == 0


@pytest.mark.parametrize("body, line, message", [
    ("for _ in range(2)\n    model(torch.randn(2, 16))\n", 2, "SyntaxError: expected ':'"),
    ("x = 1\nawait f()\n", 3, "SyntaxError: 'await' outside function"),
])
def test_a_cell_that_does_not_compile_reads_as_ipython_shows_it_and_starts_no_watch(
        ip, body, line, message):
    ip.autoawait = False
    try:
        with capture_output() as captured:
            result = ip.run_cell("%%nanwatch model\n" + body)
    finally:
        ip.autoawait = True
    assert isinstance(result.error_in_exec, SyntaxError)
    text = re.sub(r"\x1b\[[0-9;]*m", "", captured.stdout + captured.stderr)
    # IPython 8.0 (the minimum) heads it "Input In [n]" and quotes the line without its number.
    assert re.search(rf"(Cell In\[\d+\], line {line}|Input In \[\d+\])\n", text)
    assert text.rstrip().endswith(message)
    assert "nanwidget" not in text and "Traceback" not in text
    assert not captured.outputs  # no "nanwatch model: starting" line: no watch was made
    assert hook_count(ip.user_ns["model"]) == 0


def test_cell_stops_at_nan_shows_browser_and_one_line_error(ip):
    cell = ("%%nanwatch model\n"
            "for _ in range(3):\n    model(torch.randn(2, 16))\n" + PLANT_NAN
            + "model(torch.randn(2, 16))\nprint('not reached')\n")
    with capture_output() as captured:
        with pytest.raises(NanDetected) as raised:
            run(ip, cell)
    assert "not reached" not in captured.stdout
    lines = raised.value._render_traceback_()
    assert len(lines) <= 3 and lines[0].startswith("NanDetected: nan in batch 3 at module 'fc2'")
    # Why, in one line: the diagnosis' kind, summary and first fix.
    assert lines[1].startswith("Why (corrupted-weight): 'fc2.weight' became NaN between batch 2 "
                               "and batch 3") and " Try: " in lines[1]
    shown = [o.data.get("text/plain", "") for o in captured.outputs]
    assert any(text.startswith("nanwidget FrameBrowser: ") for text in shown)
    browser_outputs = [o for o in captured.outputs
                       if "application/vnd.jupyter.widget-view+json" in o.data]
    assert browser_outputs
    assert hook_count(ip.user_ns["model"]) == 0
    assert ip.user_ns["_nanwatch"].event.module == "fc2"


def test_cell_traceback_is_short_in_the_shell_output(ip):
    cell = "%%nanwatch model\n" + PLANT_NAN + "model(torch.randn(2, 16))\n"
    with capture_output() as captured:
        result = ip.run_cell(cell)
    assert isinstance(result.error_in_exec, NanDetected)
    text = captured.stdout + captured.stderr
    assert "NanDetected: nan in batch 0 at module 'fc2'" in text
    assert "Traceback" not in text and "_forward_hook" not in text


def test_cell_without_nan_ends_with_a_summary_and_returns_its_value(ip):
    cell = "%%nanwatch model\nfor _ in range(4):\n    model(torch.randn(2, 16))\n41 + 1\n"
    with capture_output() as captured:
        value = run(ip, cell)
    assert value == 42
    final = captured.outputs[-1].data["text/plain"]
    assert final.startswith("nanwatch model done: 4 batches seen")
    assert "largest |x| among module outputs:" in final and "float32" in final
    assert "0 events" in final
    assert hook_count(ip.user_ns["model"]) == 0


def test_a_cell_that_rebuilds_its_model_says_the_watch_saw_none_of_the_new_ones_batches(ip):
    # The watch is on the model the name held when the cell started: a NaN through the new
    # model passed unseen, and the cell said only "0 batches seen ... 0 events".
    old = ip.user_ns["model"]
    cell = ("%%nanwatch model\n"
            "model = TinyMLP()  # the cell that builds and trains the model, run again\n"
            "x = torch.randn(2, 16)\n"
            "x[0, 0] = float('nan')\n"
            "out = model(x)\n")
    ip.user_ns["TinyMLP"] = TinyMLP
    with capture_output() as captured:
        run(ip, cell)
    assert ip.user_ns["model"] is not old and ip.user_ns["out"].isnan().any()
    assert captured.outputs[-1].data["text/plain"].startswith("nanwatch model done: 0 batches")
    lines = [line for line in captured.stdout.splitlines() if "rebound" in line]
    assert lines == ["nanwidget: model was rebound inside the cell, so %%nanwatch watched the "
                     "model it named before and saw none of the new model's batches. Build the "
                     "model in an earlier cell and train it under %%nanwatch model, or call "
                     "nw.watch(model) inside the cell after building it."]
    with capture_output() as captured:  # a cell that keeps its model says nothing of it
        run(ip, "%%nanwatch model\nmodel(torch.randn(2, 16))\n")
    assert "rebound" not in captured.stdout


class _BuildsItsModelInFit:
    """As skorch's NeuralNet: fit() builds a new module_ and trains it."""

    def __init__(self) -> None:
        self.module_ = TinyMLP()

    def fit(self, x):
        self.module_ = TinyMLP()
        optimizer = torch.optim.SGD(self.module_.parameters(), lr=0.1)
        for _ in range(2):
            self.module_(x).sum().backward()
            optimizer.step()


def test_a_cell_whose_call_rebuilds_the_watched_attribute_says_so_once_with_the_fit_fix(ip):
    # It printed "Build the model in an earlier cell" (the user had: fit() rebuilt it) and
    # close() warned the same thing again in other words.
    ip.user_ns["net"] = _BuildsItsModelInFit()
    try:
        with capture_output() as captured, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(ip, "%%nanwatch net.module_\nnet.fit(torch.randn(2, 16))\n")
    finally:
        ip.user_ns.pop("net")
    lines = [line for line in captured.stdout.splitlines() if "rebound" in line]
    assert lines == ["nanwidget: net.module_ was rebound inside the cell (a call set a new "
                     "module_ on net), so %%nanwatch watched the model it named before and saw "
                     "none of the new model's batches. Train with a call that keeps it (skorch "
                     "builds a new module_ in fit(): net.initialize() in an earlier cell, then "
                     "net.partial_fit(X, y) under %%nanwatch net.module_), or call "
                     "nw.watch(net.module_) inside the cell once it is built."]
    assert not [w for w in caught if "nanwidget" in str(w.message)]


def test_sentinel_cell_status_shows_what_the_sentinel_checks_and_what_it_cannot_see(ip):
    cell = ("%%nanwatch model --sentinel\noutputs = [model(torch.randn(2, 16)) for _ in range(4)]\n"
            "largest = max(float(out.abs().max()) for out in outputs)\n")
    with capture_output() as captured:
        run(ip, cell)
    final = captured.outputs[-1].data["text/plain"]
    assert final.startswith("nanwatch model done: 4 batches seen")
    assert "n/a" not in final and "sentinel mode checks the model's outputs each batch" in final
    shown = float(re.search(r"largest \|x\| so far: (\S+) \(float32", final).group(1))
    assert shown == pytest.approx(ip.user_ns["largest"], rel=1e-2)  # as printed, 3 digits
    assert "a loss made outside the model is checked only with backward=True" in final
    assert "loss_fn" in final
    with capture_output() as captured:  # with the gradient check, no such warning
        run(ip, "%%nanwatch model --sentinel --backward\nmodel(torch.randn(2, 16)).sum().backward()\n")
    final = captured.outputs[-1].data["text/plain"]
    assert "largest |x| so far:" in final and "loss made outside" not in final


def test_sentinel_status_counts_the_batches_recorded_in_full_too(ip):
    # With --sample-every the sampled batches are checked by their frames, not the sentinel:
    # the status line left them out (batch 0's 1e12 read 1e9).
    cell = ("%%nanwatch model --sentinel --sample-every 2\n"
            "outputs = [model(torch.randn(2, 16) * scale) for scale in (1e12, 1e9, 1.0, 1.0)]\n"
            "largest = max(float(out.abs().max()) for out in outputs)\n")
    with capture_output() as captured:
        run(ip, cell)
    final = captured.outputs[-1].data["text/plain"]
    shown = float(re.search(r"largest \|x\| so far: (\S+) \(float32", final).group(1))
    assert shown == pytest.approx(ip.user_ns["largest"], rel=1e-2)


def test_cell_removes_hooks_when_the_cell_fails_for_another_reason(ip):
    with pytest.raises(ZeroDivisionError):
        run(ip, "%%nanwatch model\nmodel(torch.randn(2, 16))\n1 / 0\n")
    assert hook_count(ip.user_ns["model"]) == 0


def test_cell_with_abort_after_stops_quietly(ip):
    cell = "%%nanwatch model --abort-after 1\nfor _ in range(5):\n    model(torch.randn(2, 16))\n"
    with capture_output() as captured:
        run(ip, cell)
    assert "stopped after batch 1" in captured.stdout
    assert ip.user_ns["_nanwatch"].batch == 2


def test_cell_in_record_mode_shows_events_and_browser(ip):
    cell = ("%%nanwatch model --on-nan record\n" + PLANT_NAN
            + "for _ in range(3):\n    model(torch.randn(2, 16))\n")
    with capture_output() as captured:
        run(ip, cell)
    assert "3 NaN/Inf event(s)" in captured.stderr
    assert any("application/vnd.jupyter.widget-view+json" in o.data for o in captured.outputs)


def test_live_status_updates_are_throttled_not_one_per_batch(ip):
    cell = "%%nanwatch model\nfor _ in range(60):\n    model(torch.randn(2, 16))\n"
    ip.run_line_magic("config", "NanwatchMagics.refresh_seconds = 60.0")
    try:
        with capture_output() as captured:
            run(ip, cell)
    finally:
        ip.run_line_magic("config", "NanwatchMagics.refresh_seconds = 0.3")
    # One "starting" line, the first batch, the final summary: 60 batches, three outputs.
    assert len(captured.outputs) == 3
    assert "60 batches seen" in captured.outputs[-1].data["text/plain"]


def test_live_status_reports_at_most_once_per_interval():
    now = [0.0]
    lines: list[str] = []
    status = LiveStatus("m", lines.append, interval=0.25, clock=lambda: now[0])
    model = TinyMLP()
    with nw.watch(model) as watch:
        watch.add_feature(status)
        for _ in range(20):
            model(torch.randn(2, 16))
            now[0] += 0.05  # 20 batches over one second
    assert status.batches == 20
    assert 4 <= len(lines) <= 5
    assert "largest |x| among module outputs" in lines[-1]
    assert "decades below its max" in lines[-1]


def test_config_sets_the_default_frames(ip):
    run(ip, "%config NanwatchMagics.frames = 9")
    run(ip, "%nanwatch model")
    assert ip.user_ns["_nanwatch"].max_frames == 9
    run(ip, "%config NanwatchMagics.frames = 21")


def test_unload_removes_the_magic_and_every_watch_hook(ip):
    run(ip, "%nanwatch model")
    run(ip, "w2 = nw.watch(torch.nn.Linear(2, 2))")
    w2 = ip.user_ns["w2"]
    with capture_output() as captured:
        ip.run_line_magic("unload_ext", "nanwidget")
    # Said, so that after %reload_ext no one trusts a watch that is gone.
    assert captured.stdout == ("nanwidget: unloaded; stopped watching model, 1 watch made with "
                               "nw.watch()\n")
    assert hook_count(ip.user_ns["model"]) == 0
    assert w2.closed and hook_count(w2.model) == 0
    with pytest.raises(UsageError, match="not found"):
        run(ip, "%nanwatch model")
    assert ip.custom_exceptions == ()
    assert not any("rewrite_async_cell" in getattr(t, "__name__", "")
                   for t in ip.input_transformers_cleanup)
    ip.run_line_magic("load_ext", "nanwidget")  # the fixture unloads again


def test_help_lists_the_options(ip):
    doc = ip.find_line_magic("nanwatch").__doc__
    for option in ("-n FRAMES", "--trace-batches", "--abort-after", "--skip", "--backward",
                   "--grad-norm", "--on-nan", "--log-dir", "--off"):
        assert option in doc



def test_help_usage_puts_the_model_first(ip):
    doc = ip.find_line_magic("nanwatch").__doc__
    usage = [line.strip() for line in doc.split("Watch a PyTorch model")[0].splitlines()
             if line.strip() and line.strip() != "::"]
    assert usage == ["%nanwatch MODEL [options]", "%nanwatch --off [MODEL]", "%nanwatch",
                     "%%nanwatch MODEL [options]   (cell magic)"]


INTERRUPTING_MODEL = """
import torch
interrupt_at = [4]
def _interrupt(module, args, output):
    # stands for Kernel > Interrupt arriving in the middle of batch 4's forward
    interrupt_at[0] -= 1
    if interrupt_at[0] < 0:
        raise KeyboardInterrupt
model.fc2.register_forward_hook(_interrupt)
"""


def test_interrupting_a_cell_prints_one_line_and_shows_the_browser(ip):
    run(ip, INTERRUPTING_MODEL)
    cell = "%%nanwatch model\nfor _ in range(100):\n    model(torch.randn(2, 16))\n"
    with capture_output() as captured:
        result = ip.run_cell(cell)
    error = result.error_in_exec
    assert isinstance(error, KeyboardInterrupt), error  # "Run All" still stops here
    lines = error._render_traceback_()
    assert len(lines) == 1
    seen = re.match(r"KeyboardInterrupt: %%nanwatch model interrupted \((\d+) batches seen\); "
                    r"the FrameBrowser above shows what was recorded", lines[0])
    assert seen, lines[0]
    # four batches finished; whether the interrupted fifth counts is the core's batch policy
    assert int(seen.group(1)) in (4, 5)
    text = captured.stdout + captured.stderr
    assert "Traceback" not in text and "magic.py" not in text and "ended by an error" not in text
    assert any("application/vnd.jupyter.widget-view+json" in o.data for o in captured.outputs)
    status = [o.data.get("text/plain", "") for o in captured.outputs]
    assert any(t.startswith(f"nanwatch model interrupted: {seen.group(1)} batches seen")
               for t in status)
    watch = ip.user_ns["_nanwatch"]
    assert watch.closed and hook_count(ip.user_ns["model"]) == 1  # only the user's own hook
    assert set(watch.frames()["batch"]) >= {0, 1, 2, 3}


def _traceback_text(ip, cell):
    """Run ``cell`` as cell In[N] of a session; (N, what IPython printed, colours removed)."""
    with capture_output() as captured:
        result = ip.run_cell(cell, store_history=True)
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    return result.execution_count, re.sub(r"\x1b\[[0-9;]*m", "", captured.stdout + captured.stderr)


def _cells_named(text):
    """The cell numbers a traceback names: "Cell In[5], line 3" (IPython 8.5+), "Input In [5]"."""
    return set(re.findall(r"In ?\[(\d+)\]", text))


@pytest.mark.parametrize("body", ["model(torch.randn(2, 16))\n1 / 0\n",
                                  "await asyncio.sleep(0)\n1 / 0\n"], ids=["plain", "await"])
def test_tracebacks_in_a_cell_name_the_cell_and_the_line_as_ipython_does(ip, body):
    ip.run_cell("import asyncio")
    # How this IPython names the line of a cell in a traceback (its format changed within 8.x)
    plain, plain_text = _traceback_text(ip, "x = 1\nx\n1 / 0\n")
    ipython_header = next(line for line in plain_text.splitlines() if f"[{plain}]" in line)
    number, text = _traceback_text(ip, "%%nanwatch model\n" + body)
    assert ipython_header.replace(f"[{plain}]", f"[{number}]") in text
    assert "----> 3 1 / 0" in text  # the line as numbered in the cell the user sees
    # IPython 9 counts a cell before running it: no frame may name the next cell (or In[0])
    assert _cells_named(text) == {str(number)}
    assert "magic.py" not in text  # the magic's own frames are hidden, as IPython's are


def test_a_second_watch_on_a_watched_model_names_the_line_that_stops_the_first(ip):
    run(ip, "%nanwatch model")
    with pytest.raises(UsageError, match=r"already watched by %nanwatch model; stop that watch "
                                         r"first with: %nanwatch --off model"):
        run(ip, "%%nanwatch model\nmodel(torch.randn(2, 16))\n")
    run(ip, "%nanwatch --off model")
    run(ip, "w2 = nw.watch(model)")
    with pytest.raises(UsageError, match=r"nw\.live_watches\(\)"):
        run(ip, "%nanwatch model")
    run(ip, "w2.close()")


def test_rebinding_a_watched_variable_is_reported_once(ip):
    ip.user_ns["TinyMLP"] = TinyMLP
    run(ip, "%nanwatch model")
    old = ip.user_ns["model"]
    with capture_output() as captured:
        ip.run_cell("model = TinyMLP()")
    assert ("nanwidget: model now names another object; %nanwatch is still watching the model "
            "it named before. Watch the new one with %nanwatch model") in captured.stdout
    with capture_output() as captured:
        ip.run_cell("x = 1")
    assert "nanwidget" not in captured.stdout  # said once, not after every cell
    with capture_output() as captured:
        ip.run_cell("%nanwatch model")
    assert "(restarted)" in captured.stdout and "names another object" not in captured.stdout
    assert hook_count(old) == 0 and hook_count(ip.user_ns["model"]) > 0
    with capture_output() as captured:
        ip.run_cell("del model")
    assert "model no longer names a model" in captured.stdout


def test_line_magic_sentinel_mode_hooks_the_root_only_and_says_so(ip):
    model = ip.user_ns["model"]
    with capture_output() as captured:
        run(ip, "%nanwatch model --sentinel --sample-every 2 --backward --on-nan record")
    line = captured.stdout.strip()
    assert line.startswith("nanwidget: watching model in sentinel mode (TinyMLP: outputs and "
                           "gradients checked each batch, a failing batch replayed in full, "
                           "1 batch in 2 recorded in full), on NaN/Inf: record.")
    watch = ip.user_ns["_nanwatch"]
    assert (watch.mode, watch.sample_every, watch.backward) == ("sentinel", 2, True)
    assert hook_count(model) == 2
    run(ip, "for _ in range(3):\n    model(torch.randn(2, 16))\n" + PLANT_NAN
        + "model(torch.randn(2, 16))")
    assert (watch.event.batch, watch.event.module, watch.event.origin) == (3, "fc2", "weight")
    history = watch.history()
    assert sorted(set(history["batch"])) == [0, 1, 2, 3]  # the root's outputs: every batch
    assert sorted(set(history.loc[history["module"] != "", "batch"])) == [0, 2, 3]  # sampled


def test_cell_magic_sentinel_mode_stops_at_the_nan_with_the_replayed_detail(ip):
    cell = ("%%nanwatch model --sentinel\n"
            "for _ in range(3):\n    model(torch.randn(2, 16))\n" + PLANT_NAN
            + "model(torch.randn(2, 16))\nprint('not reached')\n")
    with capture_output() as captured:
        with pytest.raises(NanDetected) as raised:
            run(ip, cell)
    assert "not reached" not in captured.stdout
    assert raised.value._render_traceback_()[0].startswith(
        "NanDetected: nan in batch 3 at module 'fc2' (Linear, call 0), weight")
    assert any("application/vnd.jupyter.widget-view+json" in o.data for o in captured.outputs)
    watch = ip.user_ns["_nanwatch"]
    assert watch.mode == "sentinel" and watch.event.trace is not None
    assert hook_count(ip.user_ns["model"]) == 0


def test_sample_every_without_sentinel_is_a_usage_error(ip):
    with pytest.raises(UsageError, match="--sample-every is for sentinel mode: add --sentinel"):
        run(ip, "%nanwatch model --sample-every 3")


@pytest.mark.parametrize("line", ["%nanwatch model --skip Relu", "%nanwatch model -n 0",
                                  "%nanwatch model --sample-every 2"])
def test_a_bad_option_leaves_the_running_watch_as_it_was(ip, line):
    run(ip, "%nanwatch model -n 7")
    watched = ip.user_ns["_nanwatch"]
    hooks = hook_count(ip.user_ns["model"])
    with pytest.raises(UsageError) as raised:
        run(ip, line)
    assert "stopped" not in str(raised.value)
    assert not watched.closed and watched.max_frames == 7
    assert hook_count(ip.user_ns["model"]) == hooks
    with capture_output() as captured:
        run(ip, "%nanwatch")
    assert captured.stdout.startswith("model: <NanWatch watching")


def test_help_texts_speak_the_users_words(ip):
    magic_help = ip.find_line_magic("nanwatch").__doc__
    assert magic_help.startswith("%nanwatch MODEL [options]") and "::" not in magic_help
    watch_help = nw.watch.__doc__
    assert "contract" not in watch_help
    assert ":class:" not in watch_help  # Sphinx roles are noise in nw.watch?
    for option in nw.watch.__signature__.parameters:
        if option != "model":
            assert f"{option}=" in watch_help  # every option, with its default and one line


def test_no_early_warning_flag_turns_the_warnings_off(ip):
    run(ip, "%nanwatch model --no-early-warning")
    watch = ip.user_ns["_nanwatch"]
    assert watch.early_warning is False and watch.parts.early_warning is None
    run(ip, "%nanwatch --off model")
    run(ip, "%nanwatch model")
    assert ip.user_ns["_nanwatch"].early_warning is True
    assert "--no-early-warning" in ip.find_line_magic("nanwatch").__doc__


def test_the_live_status_counts_early_warnings(ip):
    cell = ("%%nanwatch model\n"
            "for _ in range(6):\n"
            "    model(torch.randn(2, 16))\n"
            "    with torch.no_grad():\n"
            "        model.head.weight.mul_(10.0)\n")
    with capture_output() as captured, pytest.warns(nw.EarlyWarningIssued, match="'head'"):
        run(ip, cell)
    watch = ip.user_ns["_nanwatch"]
    assert [w.module for w in watch.warnings] == ["head"]
    lines = [o.data["text/plain"] for o in captured.outputs if "text/plain" in o.data]
    assert any("1 early warning (first: 'head' growth at batch 3)" in line for line in lines)


def test_a_trailing_comment_is_a_comment_as_in_the_readme(ip, tmp_path):
    """README's notebook lines end in `# ...`: IPython hands the comment to the magic."""
    with capture_output():
        run(ip, "%nanwatch model --frames 50 --skip ReLU   # start watching; one status line")
    watched = ip.user_ns["_nanwatch"]
    assert watched.max_frames == 50 and watched.skip_types == ("ReLU",)
    hashed = tmp_path / "runs#1"
    with capture_output():
        run(ip, f'%nanwatch model --log-dir {hashed} # a "#" inside a word is no comment')
    assert str(ip.user_ns["_nanwatch"].log_dir) == str(hashed)
    with capture_output():
        run(ip, "%nanwatch --off model                        # stop")
    assert nw.live_watches() == []


def _live_widgets() -> dict:
    """ipywidgets' registry of the widgets not closed yet (Widget._active_widgets in 8.0)."""
    registry = getattr(ipywidgets.widgets.widget, "_instances", None)
    return registry if registry is not None else ipywidgets.Widget._active_widgets


def test_cells_stopped_by_a_nan_with_new_models_keep_no_more_than_a_few_models_alive(ip):
    # A long session: each cell builds a model and runs a %%nanwatch cell that stops at a NaN
    # (or is interrupted); the browser each shows must not keep every model alive forever.
    shown = _live_widgets()
    widgets_before = len(shown)
    models = []
    ip.user_ns["TinyMLP"] = TinyMLP
    for cell in range(12):
        run(ip, "model = TinyMLP()\n" + (PLANT_NAN if cell % 2 else INTERRUPTING_MODEL))
        models.append(weakref.ref(ip.user_ns["model"]))
        with capture_output():
            ip.run_cell("%%nanwatch model\nfor _ in range(8):\n    model(torch.randn(2, 16))\n")
    ip.user_ns["model"] = TinyMLP()
    ip.user_ns.pop("_nanwatch")
    gc.collect()
    alive = sum(model() is not None for model in models)
    kept = 4  # NanwatchMagics.browsers_kept
    assert alive <= kept, f"{alive} of 12 models still alive"
    assert models[-1]() is not None  # the latest cell's browser still works
    ip.run_line_magic("unload_ext", "nanwidget")  # closes the browsers left
    # What IPython keeps of the last error (%tb, %debug) holds that cell's frames: let it go.
    sys.last_type = sys.last_value = sys.last_traceback = None
    run(ip, "pass")  # (and its last_execution_result)
    gc.collect()
    assert all(model() is None for model in models)
    assert len(shown) == widgets_before  # every widget of every browser closed
    ip.run_line_magic("load_ext", "nanwidget")  # the fixture unloads again


def test_nans_caught_by_line_watches_on_new_models_keep_no_more_than_a_few_models_alive(ip):
    # The same with %nanwatch: a later cell's NaN shows a browser through the error handler.
    models = []
    ip.user_ns["TinyMLP"] = TinyMLP
    for _ in range(10):
        with capture_output():
            run(ip, "model = TinyMLP()\n%nanwatch model")
            models.append(weakref.ref(ip.user_ns["model"]))
            result = ip.run_cell(PLANT_NAN + "model(torch.randn(2, 16))\n")
        assert isinstance(result.error_in_exec, NanDetected)
    with capture_output():
        run(ip, "%nanwatch --off model")
    ip.user_ns.pop("_nanwatch", None)
    sys.last_type = sys.last_value = sys.last_traceback = None  # %tb's: the last cell's frames
    run(ip, "model = TinyMLP()")
    gc.collect()
    assert sum(model() is not None for model in models) <= 4  # NanwatchMagics.browsers_kept

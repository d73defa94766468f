"""The notebooks as committed: the tour is complete, and stored without run-to-run noise.

Running them is nbval's job (``bash scripts/test.sh`` passes ``--nbval-lax notebooks``); these
tests guard what nbval cannot see: a notebook committed with its outputs (widget state, images,
timings that change on every run) or a checked cell with no reference output to compare with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TOUR = ["01_quickstart.ipynb", "02_fp16_overflow.ipynb", "03_trace_replay.ipynb",
        "04_gradients.ipynb", "05_distributed_offline.ipynb", "07_sentinel_compiled.ipynb",
        "08_why_nan.ipynb"]
CHECK_MARKER = "# NBVAL_CHECK_OUTPUT"


def _code_cells_of(notebook: dict) -> list[dict]:
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def _source(cell: dict) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def _is_checked(cell: dict) -> bool:
    return any(line.strip() == CHECK_MARKER for line in _source(cell).splitlines())


def test_the_demo_points_at_a_notebook_that_exists():
    from nanwidget.cli.demo import NOTEBOOK_HINT

    hinted = NOTEBOOK_HINT.split()[-1]
    assert (ROOT / hinted).is_file(), hinted


def storage_problem(name: str, notebook: dict) -> str | None:
    """What is wrong with how notebooks/<name> is stored, said with the command that fixes it;
    None when it is stored as committed."""
    refresh = f"python scripts/refresh_notebooks.py notebooks/{name}"
    saved = (f"Jupyter stores them when a notebook is saved after a run. Store it stripped: "
             f"{refresh} --strip-only (or without --strip-only to re-run it and refresh the "
             "checked outputs), or git checkout the file")
    if "widgets" in notebook["metadata"]:
        return f"notebooks/{name} stores widget state; {saved}"
    cells = _code_cells_of(notebook)
    if not any(_is_checked(cell) for cell in cells):
        return (f"notebooks/{name}: no cell is checked by nbval; mark deterministic ones "
                f"{CHECK_MARKER}")
    for cell in cells:
        where = f"notebooks/{name}, cell {_source(cell)[:60]!r}"
        if _is_checked(cell):
            # the stored text is nbval's reference; nbval skips comparing a cell stored as unrun
            if not cell["outputs"] or cell["execution_count"] is None:
                return (f"{where} is checked by nbval but stored without its reference output "
                        f"or execution count; run {refresh}")
            kinds = {output["output_type"] for output in cell["outputs"]}
            if not kinds <= {"stream", "execute_result"}:
                return f"{where} is checked by nbval but stores {sorted(kinds)}; only text compares"
        elif cell["outputs"] or cell["execution_count"] is not None:
            return (f"{where} stores its outputs or execution count "
                    f"({cell['execution_count']}); {saved}")
    return None


@pytest.mark.parametrize("name", TOUR)
def test_tour_notebook_is_stored_without_outputs_except_checked_cells(name):
    path = NOTEBOOKS / name
    if not path.exists():
        pytest.fail(f"notebooks/{name} is missing")
    problem = storage_problem(name, json.loads(path.read_text(encoding="utf-8")))
    if problem is not None:
        pytest.fail(problem, pytrace=False)


def test_a_tour_notebook_saved_after_a_run_is_told_how_to_refresh():
    name = TOUR[0]
    notebook = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))
    unchecked = next(cell for cell in _code_cells_of(notebook) if not _is_checked(cell))
    unchecked["execution_count"] = 1  # what saving after a run stores, outputs or not
    problem = storage_problem(name, notebook)
    assert problem is not None
    assert "stores its outputs or execution count (1)" in problem
    assert f"python scripts/refresh_notebooks.py notebooks/{name} --strip-only" in problem
    notebook["metadata"]["widgets"] = {"state": {}}
    assert "stores widget state" in storage_problem(name, notebook)


def test_refresh_script_strips_everything_but_checked_outputs(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import refresh_notebooks
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    checked = new_code_cell(f"{CHECK_MARKER}\nprint(1)", execution_count=3,
                            outputs=[new_output("stream", name="stdout", text="1\n")])
    plain = new_code_cell("x = 1\nx", execution_count=4,
                          outputs=[new_output("execute_result", data={"text/plain": "1"},
                                              execution_count=4)])
    notebook = new_notebook(cells=[checked, plain])
    notebook.metadata["widgets"] = {"state": {}}

    stripped = refresh_notebooks.strip(notebook)
    nbformat.validate(stripped)
    assert "widgets" not in stripped.metadata
    assert [cell.execution_count for cell in stripped.cells] == [3, None]
    assert stripped.cells[0].outputs[0]["text"] == "1\n"
    assert stripped.cells[1].outputs == []


def test_quickstart_run_top_to_bottom_leaves_its_first_event_replayable():
    """"Run All", then "re-run in trace mode" on the first FrameBrowser: the later cells train
    a model of their own, so the event's batch replays with the weights it ran with."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    before = set(shell.user_ns)
    first_watch = None
    try:
        with capture_output():
            for cell in _code_cells_of(json.loads((NOTEBOOKS / "01_quickstart.ipynb").read_text())):
                source = _source(cell).replace("%matplotlib inline", "")
                shell.run_cell(source)  # the %%nanwatch cell stops at the NaN, as it should
                if first_watch is None and "_nanwatch" in shell.user_ns:
                    first_watch = shell.user_ns["_nanwatch"]
        event = first_watch.event
        assert event is not None and shell.user_ns["_nanwatch"] is not first_watch
        trace = first_watch.browse().rerun_batch(event.batch)
        assert trace.reproduced and not trace.changes, trace.changes
    finally:
        shell.run_line_magic("unload_ext", "nanwidget")
        for name in set(shell.user_ns) - before:
            shell.user_ns.pop(name, None)

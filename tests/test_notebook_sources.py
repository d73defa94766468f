"""Source locations read in a notebook: "cell In[5], line 12", as IPython's tracebacks say it.

Run through a real IPython InteractiveShell (its cells are compiled under names such as
``<ipython-input-5-...>``; ipykernel's are temporary paths): the trace-mode replay and the
one-line NaN message name the cell and line, and a trace with no user line says so.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import nanwidget as nw
from nanwidget.core.events import NanEvent
from nanwidget.core.sourcelines import format_source, locate_source
from nanwidget.core.trace import Trace, empty_ops

from conftest import TinyMLP

SQRT_NET = """\
class SqrtNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.sqrt(self.fc(x) - 10.0)

net = SqrtNet()
"""


@pytest.fixture
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nanwidget")
    ip.user_ns.update(torch=torch, nw=nw, model=TinyMLP())
    yield ip
    ip.run_line_magic("unload_ext", "nanwidget")
    for name in ("model", "net", "SqrtNet", "w", "trace", "torch", "nw", "_nanwatch"):
        ip.user_ns.pop(name, None)


def _run(shell: InteractiveShell, code: str):
    """Run a cell as a notebook does (it gets the next In[N]); return its result."""
    result = shell.run_cell(code, store_history=True)
    if result.error_before_exec is not None:
        raise result.error_before_exec
    return result


def test_trace_names_the_cell_and_line_of_the_op_that_made_the_nan(shell):
    defined = _run(shell, SQRT_NET).execution_count
    _run(shell, "w = nw.watch(net, on_nan='record')\nnet(torch.randn(2, 4))\n"
                "trace = w.replay(0)\nw.close()")
    trace = shell.user_ns["trace"]
    assert trace.first_bad["op"] == "sqrt"
    assert trace.first_bad["source"] == f"cell In[{defined}], line 7"
    report = trace.report()
    assert f"at cell In[{defined}], line 7" in report
    assert "7 | return torch.sqrt(self.fc(x) - 10.0)" in report  # the cell's own line


def test_nan_raised_under_a_line_watch_names_the_cell_and_line(shell):
    _run(shell, "%nanwatch model")
    cell = ("x = torch.randn(2, 16)\n"
            "with torch.no_grad():\n"
            "    model.fc2.weight[0, 0] = float('nan')\n"
            "model(x)\n")
    with capture_output() as captured:
        result = shell.run_cell(cell, store_history=True)
    assert isinstance(result.error_in_exec, nw.NanDetected)
    text = captured.stdout + captured.stderr
    assert f"raised at cell In[{result.execution_count}], line 4: model(x)" in text
    assert "ipython-input" not in text and "ipykernel_" not in text


def test_files_keep_file_and_line_and_both_forms_can_be_located(tmp_path):
    path = str(tmp_path / "train.py")
    assert format_source(path, 12) == f"{path}:12"
    assert locate_source(f"{path}:12") == (path, 12)
    assert locate_source("") is None and locate_source("no line here") is None


def test_a_trace_with_no_user_line_says_so_in_the_event_line():
    first_bad = pd.Series({"op": "log", "aten": "aten.log.default", "phase": "forward",
                           "module": "2", "module_type": "Linear", "nan": True, "inf": False,
                           "source": ""})
    trace = Trace(batch=0, frames=pd.DataFrame(), ops=empty_ops(), first_bad=first_bad)
    event = NanEvent(batch=0, module="2", module_type="Linear", call=0, role="output",
                     kind="nan", origin="output", trace=trace)
    summary = event.summary()
    assert summary.endswith("first bad op log (in library code, not a line of yours)")
    assert not summary.rstrip().endswith(" at")
    assert "(in library code, not a line of yours)" in trace.report()

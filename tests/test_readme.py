"""The README's Python snippets run, in order, and print what the README says they print."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def _python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def test_readme_api_tour_runs_and_its_printed_line_is_true(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the log_dir snippet writes runs/exp1
    blocks = _python_blocks()
    assert len(blocks) >= 5
    namespace: dict = {}
    printed = io.StringIO()
    for block in blocks:
        with contextlib.redirect_stdout(printed):
            exec(compile(block, "README.md", "exec"), namespace)
    # the first snippet's comment quotes the message it prints
    first = blocks[0]
    quoted = " ".join(line.lstrip("# ").strip() for line in first.splitlines()[-3:])
    # (the snippet is saved as example.py; here it runs as README.md)
    assert quoted.replace("example.py", "README.md") in printed.getvalue().replace("\n", " ")
    assert namespace["norms"]["param"].nunique() == 4       # 2 weights, 2 biases
    assert len(namespace["losses"]) == 10 and namespace["event"] is None  # a healthy model
    assert namespace["run"].events == [] and namespace["run"].ranks == [0]
    assert namespace["why"].kind == "divergence"  # explain_loss: an MSE that overflowed
    assert namespace["trace"].first_bad["op"] == "sqrt"  # the op the comment blames
    assert "2 0 input[0] input True" in printed.getvalue()  # the sentinel snippet's comment
    # The early-warning snippet: the warning comes long before the NaN, as its comment shows.
    warned = re.search(r"early warning, batch (\d+): output of '0' \(float32\) grows",
                       printed.getvalue())
    nan_batch = re.search(r"first NaN/Inf: batch (\d+)", printed.getvalue())
    assert warned and nan_batch and int(warned.group(1)) <= int(nan_batch.group(1)) - 10

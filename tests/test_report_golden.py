"""report() pinned line by line: a fixed model with exact weights, compared with a golden file.

Run with NANWIDGET_UPDATE_GOLDEN=1 to rewrite the files after a deliberate layout change (then
read the diff before committing it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import nanwidget as nw

GOLDEN = Path(__file__).with_name("golden")
# Source lines name files by their full path: the golden files hold them relative to the repo.
_REPO = str(Path(__file__).resolve().parent.parent) + os.sep


class Overflowing(nn.Module):
    """Two layers with exact weights; the second overflows float16 on the third batch."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.out = nn.Linear(4, 2)
        with torch.no_grad():
            self.up.weight.copy_(torch.arange(16.0).reshape(4, 4) / 8 - 1)
            self.up.bias.fill_(0.5)
            self.out.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0], [-4.0, 3.0, -2.0, 1.0]]))
            self.out.bias.zero_()

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.out(self.act(self.up(x)) * scale)


def _check_against(name: str, text: str) -> None:
    path = GOLDEN / name
    text = text.replace(_REPO, "")
    if os.environ.get("NANWIDGET_UPDATE_GOLDEN") == "1" or not path.exists():
        path.write_text(text + "\n", encoding="utf-8")
        if os.environ.get("NANWIDGET_UPDATE_GOLDEN") != "1":
            pytest.fail(f"{path} did not exist and was written now; review it and commit it")
    assert text + "\n" == path.read_text(encoding="utf-8")


def test_event_report_matches_the_golden_file():
    model = Overflowing().half()
    x = (torch.arange(8.0).reshape(2, 4) / 4).half()
    with nw.watch(model, max_frames=6, on_nan="record") as w:
        model(x)
        model(x, 10.0)
        model(x, 1e4)  # 1e4 * (hidden ~3) * weights up to 4 > 65504: Inf in out's output
    assert w.event is not None and w.event.module == "out"
    _check_against("report_event_fp16.txt", w.report())


def test_report_without_event_shows_held_and_trace_batches():
    model = Overflowing()
    x = torch.arange(8.0).reshape(2, 4) / 4
    with nw.watch(model, max_frames=4, trace_batches=[0]) as w:
        model(x)
        model(-x)
    _check_against("report_no_event_trace_batch.txt", w.report())

"""report() against transformers' DebugUnderflowOverflow, line by line, on fixed models.

Each scenario runs both tools on the same seeded model and batches. The texts must be equal
except for nanwidget's listed additions (see :func:`_without_our_additions`); our own text is
also pinned by a golden file under ``tests/golden/`` (next to the transformers text it was
compared with), so a layout change shows up even where transformers is not installed.

Rewrite the golden files with ``NANWIDGET_UPDATE_GOLDEN=1 pytest tests/test_report_parity.py``
(after checking the new texts by eye).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import nanwidget as nw
from nanwidget.core.report import format_frames

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("NANWIDGET_UPDATE_GOLDEN") == "1"
# Source lines name files by their full path: the golden files hold them relative to the repo.
_REPO = str(Path(__file__).resolve().parent.parent) + os.sep

# transformers' detect_overflow prints "<ctx> has infs" from inside its hook: not part of a dump.
_HOOK_PRINT = re.compile(r"^\S+ has (nans|infs)$")
_FRAME_HEADER = " " * 18  # module headers and batch separators; tensor lines start otherwise
_LEAF_LINE = re.compile(r"^\s+(?:None|not a tensor) (?P<role>\S+)$")
_TENSOR_LINE = re.compile(r"^ *\S+ +\S+ (?P<role>\S+)")
_MARK = re.compile(r"  <-- (nan|inf|nan\+inf)$")
_COLUMNS_HEADER = "abs min  abs max  metadata"
_DIAGNOSIS_LINES = ("Diagnosis (", "  - ", "  Rows of the batch", "  Try: ")


# ---------------------------------------------------------------------------- the scenarios
class Fp16MLP(nn.Module):
    """fc2's weights are 40x too large: its fp16 output overflows once inputs reach ~1e4."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.fc2(self.act(self.fc1(x)))))


def _fp16_mlp() -> nn.Module:
    torch.manual_seed(0)
    model = Fp16MLP()
    with torch.no_grad():
        model.fc2.weight.mul_(40)
    return model.half().eval()


def _mlp_batches(model: nn.Module, batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(3, 8, generator=generator) * 8 ** (n + 1) for n in range(batch + 1)]
    return inputs[batch].half()  # growing inputs: batch 3 overflows inside fc2


def _tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                        use_cache=False, bos_token_id=49, eos_token_id=49,
                        attn_implementation="sdpa")
    return GPT2LMHeadModel(config).eval()  # random weights: nothing is downloaded


def _token_batch(model: nn.Module, batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1 + batch)
    return torch.randint(0, 50, (2, 8), generator=generator)


def _plant_inf_in_ln_2(model: nn.Module, batch: int) -> None:
    # Before batch 2 (as an optimizer step would): h.1.ln_2 is the 21st module called in a
    # batch, so both tools dump exactly batch 2's frames up to it (transformers keeps every
    # frame since its last trace batch, nanwidget the last max_frames=21).
    if batch == 2:
        with torch.no_grad():
            model.get_parameter("transformer.h.1.ln_2.weight")[0] = float("inf")


@dataclass(frozen=True)
class Scenario:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[nn.Module, int], torch.Tensor]
    batches: int
    trace_batches: tuple[int, ...] = ()
    abort_after: int | None = None
    before_batch: Callable[[nn.Module, int], None] | None = None
    needs_transformers_model: bool = False


SCENARIOS = {
    "mlp_fp16": Scenario("mlp_fp16", _fp16_mlp, _mlp_batches, batches=4),
    "gpt2_trace": Scenario("gpt2_trace", _tiny_gpt2, _token_batch, batches=5, trace_batches=(1, 3),
                           abort_after=3, before_batch=_plant_inf_in_ln_2,
                           needs_transformers_model=True),
    "gpt2_no_event": Scenario("gpt2_no_event", _tiny_gpt2, _token_batch, batches=5,
                              trace_batches=(1, 3), abort_after=3, needs_transformers_model=True),
}


def _run(scenario: Scenario, model: nn.Module, stops: tuple[type[BaseException], ...]) -> None:
    with torch.no_grad():
        for batch in range(scenario.batches):
            if scenario.before_batch is not None:
                scenario.before_batch(model, batch)
            try:
                model(scenario.make_batch(model, batch))
            except stops:
                return


@functools.lru_cache(maxsize=None)  # each scenario runs once per session (the tests only read)
def run_transformers(scenario: Scenario) -> str:
    """What DebugUnderflowOverflow prints on the scenario (it raises ValueError to stop)."""
    from transformers.debug_utils import DebugUnderflowOverflow
    model = scenario.make_model()
    DebugUnderflowOverflow(model, trace_batch_nums=list(scenario.trace_batches),
                           abort_after_batch_num=scenario.abort_after)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _run(scenario, model, (ValueError,))
    return printed.getvalue()


@functools.lru_cache(maxsize=None)
def run_nanwidget(scenario: Scenario) -> tuple[str, nw.NanWatch]:
    """report() after the same run; events are recorded so that trace batch 3 happens too."""
    model = scenario.make_model()
    with nw.watch(model, trace_batches=scenario.trace_batches, abort_after=scenario.abort_after,
                  on_nan="record") as watch:
        _run(scenario, model, (nw.AbortAfterBatch,))
    return watch.report().replace(_REPO, ""), watch


# ---------------------------------------------------------------------------- comparing
def _role(line: str) -> str | None:
    if line.startswith(_FRAME_HEADER) or not line.strip():
        return None
    match = _LEAF_LINE.match(line) or _TENSOR_LINE.match(line)
    return match.group("role") if match else None


def _without_our_additions(text: str) -> list[str]:
    """Our report less what we add on purpose: the summary line and the diagnosis after it,
    `<-- inf` marks, keyword inputs, and ModelOutput leaves (transformers prints a ModelOutput
    as `not a tensor`); and with the one part we leave out put back: where the dump opens with
    a batch's start, transformers first prints the column header and two empty lines (an
    empty block)."""
    lines = text.rstrip("\n").split("\n")
    if lines and lines[0].startswith("nanwidget: "):
        lines = lines[1:]
        while lines and lines[0].startswith(_DIAGNOSIS_LINES):
            lines = lines[1:]
    out: list[str] = []
    for position, line in enumerate(lines):
        if position and lines[position - 1].startswith("Last ") and \
                line.lstrip().startswith("*** Starting batch number="):
            out.extend([_COLUMNS_HEADER, "", ""])
        line = _MARK.sub("", line)
        role = _role(line) or ""
        if role.startswith("kwarg:"):
            continue
        if role.startswith("output."):
            leaf = f"{'not a tensor':>17} output"
            if not out or out[-1] != leaf:
                out.append(leaf)
            continue
        out.append(line)
    return out


def _transformers_lines(text: str) -> list[str]:
    lines = [line for line in text.split("\n") if not _HOOK_PRINT.match(line)]
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def _assert_same(ours: list[str], expected: list[str], watch: nw.NanWatch, what: str) -> None:
    if ours == expected:
        return
    diff = "\n".join(difflib.unified_diff(expected, ours, what, "nanwidget", lineterm=""))
    raise AssertionError(f"report() differs from {what}:\n{diff}")


def _golden(name: str) -> Path:
    return GOLDEN / name


def _requires_transformers() -> None:
    pytest.importorskip("transformers", reason="transformers (the [bench] extra) runs the "
                                               "reference tool and builds the GPT-2 model")


# ---------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_report_equals_transformers_except_our_additions(name):
    _requires_transformers()
    scenario = SCENARIOS[name]
    theirs = run_transformers(scenario)
    ours, watch = run_nanwidget(scenario)
    if UPDATE:
        _golden(f"report_{name}.transformers.txt").write_text(theirs)
        _golden(f"report_{name}.nanwidget.txt").write_text(ours + "\n")
    expected = _transformers_lines(theirs)
    if not watch.events:
        # With no event transformers prints only the traced batches; report() prints them
        # too, then the frames it holds ("No inf/nan detected ...").
        assert "No inf/nan detected (batch_number=3)" in ours
        ours = ours.split("\nNo inf/nan detected")[0]
    _assert_same(_without_our_additions(ours), expected, watch, "transformers")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_report_equals_its_golden_file(name):
    scenario = SCENARIOS[name]
    if scenario.needs_transformers_model:
        _requires_transformers()
    ours, watch = run_nanwidget(scenario)
    golden = _golden(f"report_{name}.nanwidget.txt").read_text().rstrip("\n").split("\n")
    _assert_same(ours.split("\n"), golden, watch, f"tests/golden/report_{name}.nanwidget.txt")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden_files_differ_only_by_our_additions(name):
    """The pair of golden files alone (no transformers needed) keeps the parity readable."""
    ours = _golden(f"report_{name}.nanwidget.txt").read_text()
    theirs = _golden(f"report_{name}.transformers.txt").read_text()
    if "\nNo inf/nan detected" in ours:
        ours = ours.split("\nNo inf/nan detected")[0]
    assert _without_our_additions(ours) == _transformers_lines(theirs)


def test_gpt2_report_keeps_the_trace_batch_recorded_before_the_event():
    _requires_transformers()
    text, watch = run_nanwidget(SCENARIOS["gpt2_trace"])
    assert watch.event.batch == 2 and watch.event.module == "transformer.h.1.ln_2"
    assert sorted(watch.trace_batches) == [1, 3] and watch.batch == 4  # batch 3 ran and aborted
    starts = re.findall(r"\*\*\* Starting batch number=(\d+) \*\*\*", text)
    assert starts == ["1", "2"]  # the trace batch before the event, then the event's batch
    assert text.index("Starting batch number=1") < text.index("Detected inf/nan during batch_number=2")
    assert "Finished batch number" not in text  # transformers prints no such line


# ---------------------------------------------------------------------------- single lines
def _frames(rows: list[dict]) -> pd.DataFrame:
    base = {"rank": 0, "phase": "forward", "module_type": "Embedding", "call": 0,
            "dtype": "float32", "shape": (2,), "abs_min": float("nan"), "abs_max": float("nan"),
            "nan": False, "inf": False, "note": ""}
    return pd.DataFrame([{**base, **row} for row in rows])


def test_integer_tensor_with_a_range_prints_it_like_transformers():
    frames = _frames([{"batch": 0, "frame": 0, "module": "wte", "role": "input[0]",
                       "dtype": "int64", "abs_min": 0.0, "abs_max": 49.0},
                      {"batch": 0, "frame": 0, "module": "wte", "role": "kwarg:ids",
                       "dtype": "int64", "abs_min": 0.0, "abs_max": 7.0, "note": "int"}])
    lines = format_frames(frames)
    assert lines[1:] == ["0.00e+00 4.90e+01 input[0]", "0.00e+00 7.00e+00 kwarg:ids"]


def test_none_and_non_tensor_leaves_print_as_transformers_prints_them():
    frames = _frames([{"batch": 0, "frame": 0, "module": "attn", "role": "output[1]", "note": "None",
                       "dtype": ""},
                      {"batch": 0, "frame": 0, "module": "attn", "role": "input[1]",
                       "note": "not a tensor", "dtype": ""}])
    assert format_frames(frames)[1:] == ["             None output[1]",
                                         "     not a tensor input[1]"]


def test_dump_spanning_batches_says_where_each_starts():
    frames = _frames([{"batch": 0, "frame": 1, "module": "b", "role": "output", "abs_min": 1.0,
                       "abs_max": 2.0},
                      {"batch": 1, "frame": 0, "module": "a", "role": "output", "abs_min": 1.0,
                       "abs_max": 2.0}])
    lines = format_frames(frames, separators=True)
    # Mid-batch at the top: no separator (transformers has none there either).
    assert lines[0] == " " * 18 + "b Embedding"
    assert lines[2:6] == ["", "", " " * 18 + "*** Starting batch number=1 ***",
                          "abs min  abs max  metadata"]
    assert format_frames(frames) == [line for line in lines if line not in lines[2:6]]


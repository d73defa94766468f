"""A load of a watched model's state that brings a NaN is named as that load: model.load_state_dict
and what calls it, torch.distributed.checkpoint's set_model_state_dict and set_state_dict (its
Stateful recipe under dcp.load), on one process without a process group. Where an optimizer
step ran after the last finite batch too, the verdict was 'the optimizer step, load or write
after batch N did it' with the step's fixes (catch the bad step, clip the gradients)."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import nanwidget as nw

dcp = pytest.importorskip(
    "torch.distributed.checkpoint",
    reason="this torch build has no torch.distributed (a build without distributed support)")
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_state_dict, set_model_state_dict, set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402

MODES = ["full", "sentinel"]


class _AppState(Stateful):
    """The DCP recipe's wrapper: dcp.load fills its state dict, then calls load_state_dict."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optimizer}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _save(directory, how: str, nan: bool) -> None:
    """A checkpoint of the model (with a NaN in '2.weight' when ``nan``), saved by DCP as
    ``how`` loads it: through the recipe's Stateful, or as a plain state dict."""
    source = _model()
    if nan:
        with torch.no_grad():
            source[2].weight[0, 1] = float("nan")
    optimizer = torch.optim.SGD(source.parameters(), lr=0.05)
    state = {"app": _AppState(source, optimizer)} if how == "stateful" else \
        dict(source.state_dict())
    dcp.save(state, checkpoint_id=str(directory))


def _train_then_load(mode: str, how: str, directory, *, nan: bool = True) -> nw.NanWatch:
    """Three SGD steps under a watch (batches 0 to 2), the checkpoint loaded ``how``, then
    batch 3, whose forward meets its NaN. With a finite checkpoint: batch 3's step is handed
    a NaN gradient, and batch 4 meets what it wrote."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group warns
        _save(directory, how, nan)
        with nw.watch(model, on_nan="record", mode=mode) as w:
            for _ in range(3):
                optimizer.zero_grad()
                model(x).pow(2).mean().backward()
                optimizer.step()
            if how == "stateful":  # dcp.load calls its load_state_dict: set_state_dict
                dcp.load({"app": _AppState(model, optimizer)}, checkpoint_id=str(directory))
            else:
                state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
                dcp.load(state, checkpoint_id=str(directory))
                if how == "set_model_state_dict":
                    set_model_state_dict(model, state)
                else:  # the plain recipe: dcp.load into a state dict, then load_state_dict
                    model.load_state_dict(state)
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            if not nan:
                model[2].weight.grad[0, 1] = float("nan")
                optimizer.step()
                model(x)
    return w


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how, caller", [
    ("set_model_state_dict", "torch.distributed.checkpoint's set_model_state_dict(...)"),
    ("stateful", "torch.distributed.checkpoint's set_state_dict(...)"),
    ("load_state_dict", "model.load_state_dict(...)")])
def test_a_nan_weight_a_checkpoint_load_brought_is_named_as_that_load(how, caller, mode,
                                                                       tmp_path):
    w = _train_then_load(mode, how, tmp_path)
    event = w.event
    assert (event.batch, event.module, event.role) == (3, "2", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight" and diagnosis.confidence == "high"
    assert diagnosis.summary.startswith(f"'2.weight' holds NaN since {caller} at ")
    assert f"{__file__}:" in diagnosis.summary
    assert diagnosis.summary.endswith(
        " loaded it after batch 2: the state dict it loaded held NaN there, no step or write of "
        "this run made it; batch 3 is the first to use it.")
    assert "It was finite when batch 2 ran." in diagnosis.evidence
    assert any(line.endswith("nothing wrote it since: the same tensor, the version counter "
                             "where the load left it, no optimizer step after it.")
               for line in diagnosis.evidence)
    fixes = diagnosis.suggestion
    assert "torch.isfinite(v).all()" in fixes[0] and "names 2.weight" in fixes[0]
    assert ("dcp.load filled" in fixes[0]) is (how != "load_state_dict")
    assert fixes[1].startswith("Load an earlier checkpoint")
    assert not any("clip" in fix or "optimizer.step()" in fix for fix in fixes)


@pytest.mark.parametrize("mode", MODES)
def test_a_step_after_a_finite_load_is_not_blamed_on_the_load(mode, tmp_path):
    w = _train_then_load(mode, "set_model_state_dict", tmp_path, nan=False)
    event = w.event
    assert (event.batch, event.module, event.role) == (4, "2", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight"
    assert "loaded" not in diagnosis.summary and "set_model_state_dict" not in diagnosis.summary
    assert "optimizer step" in diagnosis.summary


def test_closing_the_watch_removes_its_load_hook_and_copies_have_none():
    model = _model()
    with nw.watch(model):
        assert len(model._load_state_dict_post_hooks) == 1
        copied = copy.deepcopy(model)
        assert len(copied._load_state_dict_post_hooks) == 0
    assert len(model._load_state_dict_post_hooks) == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_loaded_under_the_watch_before_any_batch_is_named_as_that_load(mode):
    # It read "holds NaN when the watch began, before batch 0 ran (a checkpoint loaded, a
    # write, or a training step before the watch made it)": the load ran under the watch.
    model = _model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["0.weight"][1, 1] = float("nan")
    with nw.watch(model, on_nan="record", mode=mode) as w:
        model.load_state_dict(state)
        model(torch.randn(2, 4))
    diagnosis = w.event.diagnosis
    assert diagnosis.summary.startswith("'0.weight' holds NaN since model.load_state_dict(...) at ")
    assert diagnosis.summary.endswith(" loaded it before batch 0 ran: the state dict it loaded "
                                      "held NaN there, no step or write of this run made it; "
                                      "batch 0 is the first to use it.")


@pytest.mark.slow
def test_a_nan_that_dcp_loads_into_an_fsdp2_model_is_named_as_that_load():
    # FSDP2's parameters are DTensors: set_model_state_dict loads them through the sharded
    # model's load_state_dict (one rank, gloo).
    from test_distributed import REPO, _torchrun
    finished = _torchrun([str(REPO / "tests/scripts/dcp_load_fsdp.py")], nproc=1)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    decoder = json.JSONDecoder()
    results = [decoder.raw_decode(chunk)[0] for chunk in finished.stdout.split("RESULT ")[1:]]
    assert [r["mode"] for r in results] == ["full", "sentinel"], finished.stdout
    for result in results:
        assert result["event"] == [3, "2", "weight"] and result["kind"] == "corrupted-weight"
        assert result["summary"].startswith(
            "'2.weight' holds NaN since torch.distributed.checkpoint's set_model_state_dict(...)"
            " at "), result["summary"]
        assert "loaded it after batch 2" in result["summary"]
        assert "dcp.load filled" in result["suggestion"][0]


def test_a_failure_inside_the_load_note_never_breaks_the_users_load(monkeypatch) -> None:
    # The note is evidence only: if reading the stack fails, the load goes through unchanged.
    import nanwidget.core.loads as loads

    def broken(*args, **kwargs):
        raise RuntimeError("stack unreadable")

    monkeypatch.setattr(loads, "user_source", broken)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    state = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    with nw.watch(model) as watch:
        model(torch.randn(2, 4))
        model.load_state_dict(state)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        model(torch.randn(2, 4))
    assert watch.event is None

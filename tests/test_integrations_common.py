"""What the framework callbacks share, and the promise that nanwidget imports no framework."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanwidget.integrations.step_guard import BatchLog, Findings, StepGuard, check_callback_options

from conftest import hook_count

REPO = Path(__file__).resolve().parents[1]


def test_importing_nanwidget_and_its_integrations_package_imports_no_framework():
    code = ("import sys, nanwidget, nanwidget.integrations, nanwidget.integrations.step_guard\n"
            "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate',"
            " 'fastai')"
            " if m in sys.modules))")
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              cwd=REPO, timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.strip() == "[]"


def test_callback_options_are_checked_against_nw_watch():
    check_callback_options("stop", {"max_frames": 5, "backward": True})
    with pytest.raises(ValueError, match="on_nan"):
        check_callback_options("halt", {})
    with pytest.raises(TypeError, match="'model'"):
        check_callback_options("stop", {"model": 1})


@pytest.mark.parametrize("framework", ["transformers", "lightning", "fastai"])
@pytest.mark.parametrize("log_dir", [True, 3])
def test_a_callback_given_a_log_dir_that_is_no_folder_refuses_it_when_made(framework, log_dir,
                                                                           tmp_path):
    # NanWatchCallback(log_dir=True) was accepted, then trainer.train() died in pathlib with
    # "expected str, bytes or os.PathLike object, not bool", no word of log_dir.
    pytest.importorskip(framework)
    module = pytest.importorskip(f"nanwidget.integrations.{framework}")
    with pytest.raises(TypeError, match=r"^log_dir must be a directory path .* or False \(no "
                                        rf"recording\); got {log_dir!r}"):
        module.NanWatchCallback(log_dir=log_dir)
    for accepted in (None, False, str(tmp_path / "run"), tmp_path / "run"):
        module.NanWatchCallback(log_dir=accepted)


def test_batch_log_describes_train_and_eval_batches():
    log = BatchLog(rows=8)
    assert log.note_until(2, "train", 1, 0) == 2
    log.note_until(3, "eval", 1, 0)
    assert log.describe(1) == "training step 1, micro-batch 1"
    assert log.describe(2) == "evaluation after step 1, batch 0"
    assert log.describe(99) == "batch 99"
    assert log.batches_of("train", 1) == [0, 1]
    # A loss that runs the model twice per micro-batch: two batches, one micro-batch each.
    log.note_group(5, "train", 2, 0)
    log.note_group(7, "train", 2, 1)
    assert log.describe(3) == "training step 2, micro-batch 0, forward 1 of 2"
    assert log.describe(6) == "training step 2, micro-batch 1, forward 2 of 2"
    for batch in range(7, 20):
        log.note(batch, "train", batch, 0)
    assert len(log.to_dataframe()) == 8  # bounded


def test_guard_finds_a_weight_event_and_drops_the_gradients(tiny_mlp):
    guard = StepGuard(tiny_mlp, on_nan="stop", log_dir=None, watch_options={}, owner=tiny_mlp)
    try:
        tiny_mlp(torch.randn(4, 16)).sum().backward()
        assert not guard.findings(check_grads=True)
        with torch.no_grad():
            tiny_mlp.fc2.weight[0, 0] = float("nan")
        tiny_mlp(torch.randn(4, 16)).sum().backward()
        found = guard.findings(check_grads=True)
        assert found.events[0].module == "fc2" and found.grad_events
        assert guard.agree(found)[0]["reason"].startswith("nan in batch 1")
        guard.drop_gradients()
        assert all(p.grad is None for p in tiny_mlp.parameters())
    finally:
        guard.close()
    assert hook_count(tiny_mlp) == 0


def test_a_new_guard_closes_the_one_a_failed_run_left_on_the_same_model(tiny_mlp):
    first = StepGuard(tiny_mlp, on_nan="stop", log_dir=None, watch_options={}, owner=tiny_mlp)
    with pytest.warns(RuntimeWarning, match="previous training run left"):
        second = StepGuard(tiny_mlp, on_nan="stop", log_dir=None, watch_options={}, owner=tiny_mlp)
    assert first.closed and not second.closed
    second.close()
    assert hook_count(tiny_mlp) == 0


def test_findings_reason_says_when_every_gradient_is_non_finite():
    from nanwidget import GradEvent
    grads = [GradEvent(batch=2, param=f"p{i}", norm=float("nan"), threshold=None) for i in range(3)]
    text = Findings(grad_events=grads, grads_with_values=3).reason()
    assert "every one of the 3 gradients is non-finite" in text and "backward=True" in text
    assert "and 1 more" in Findings(grad_events=grads[:2], grads_with_values=5).reason()

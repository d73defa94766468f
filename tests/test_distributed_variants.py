"""FSDP2 variants under torchrun (CPU, gloo, 127.0.0.1): a MixedPrecisionPolicy,
reshard_after_forward=False, activation checkpointing (tests/scripts/fsdp_variants.py)."""

from __future__ import annotations

import json

import pytest

from test_distributed import REPO, _torchrun


@pytest.fixture(scope="module")
def fsdp_variants_run():
    """(variant, watch, bad_grad, rank) -> that run's result."""
    finished = _torchrun([str(REPO / "tests/scripts/fsdp_variants.py")])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "internal error" not in finished.stderr
    decoder = json.JSONDecoder()
    results = (decoder.raw_decode(chunk)[0] for chunk in finished.stdout.split("RESULT ")[1:])
    return {(r["variant"], r["watch"], r["bad_grad"], r["rank"]): r for r in results}


VARIANTS = ["mixed-precision", "no-reshard", "checkpoint"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_fsdp2_variant_trains_bit_identical_and_quiet_under_each_watch(fsdp_variants_run,
                                                                       variant):
    for rank in (0, 1):
        unwatched = fsdp_variants_run[variant, "none", False, rank]
        assert unwatched["error"] == "" and len(unwatched["losses"]) == 3, unwatched
        for watch in ("full", "sentinel", "sentinel-backward"):
            watched = fsdp_variants_run[variant, watch, False, rank]
            assert watched["error"] == "", (watch, watched)
            assert watched["losses"] == unwatched["losses"], (watch, rank)
            assert watched["weights"] == unwatched["weights"], (watch, rank)
            assert (watched["events"], watched["early"], watched["warnings"]) == (0, 0, []), \
                (watch, rank, watched)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_fsdp2_variant_weight_an_optimizer_step_made_nan_on_one_rank_stops_both(
        fsdp_variants_run, variant):
    # Rank 1's gradient shard of inp.weight is NaN at step 1: its AdamW step writes NaN into
    # its shard, and batch 2 gathers it on both ranks. The diagnosis read the gathered tensor,
    # which no step writes: "holds NaN since before the watch began" (sentinel), "No optimizer
    # step wrote 'inp.weight'" (full, under the bfloat16 policy).
    for watch in ("full", "sentinel"):
        for rank in (0, 1):
            result = fsdp_variants_run[variant, watch, True, rank]
            assert result["error"] == "" and result["stopped"] == 2, (watch, rank, result)
            assert result["event"] == [2, "inp", "weight", "weight"], (watch, rank, result)
            assert result["kind"] == "corrupted-weight", (watch, rank, result)
            assert result["summary"].startswith(
                "'inp.weight' became NaN between batch 1 and batch 2: the optimizer step, load "
                "or write after batch 1 did it"), (watch, rank, result["summary"])
            assert result["wrong"] == [], (watch, rank, result["wrong"])

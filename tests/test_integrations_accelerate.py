"""The README's Accelerate recipe, run as written: one process, then two (gloo on CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="the recipe needs accelerate: pip install -e .[accelerate]")
pytest.importorskip("transformers", reason="the recipe's model is a tiny GPT-2: pip install -e .[transformers]")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "accelerate_recipe.py"
POISONED = "transformer.h.0.mlp.c_fc"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(command: list[str]) -> dict[int, dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               ACCELERATE_USE_CPU="1")  # what `accelerate launch --cpu` sets
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    finished = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    decoder = json.JSONDecoder()
    return {r["rank"]: r for r in (decoder.raw_decode(chunk)[0]
                                   for chunk in finished.stdout.split("RESULT ")[1:])}


def test_recipe_in_one_process_leaves_the_loop_at_step_3_before_the_nan_step():
    results = _run([sys.executable, str(SCRIPT)])
    result = results[0]
    assert (result["left_at_step"], result["optimizer_steps"]) == (3, 3)
    assert result["event_module"] == POISONED and result["report_printed"]
    assert result["changed"] == [f"{POISONED}.weight"] and result["hooks_left"] == 0


@pytest.mark.slow
def test_recipe_on_two_processes_every_process_leaves_at_step_3():
    results = _run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                    "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                    "--master_port", str(_free_port()), str(SCRIPT)])
    assert sorted(results) == [0, 1] and results[0]["world"] == 2
    for rank in (0, 1):
        assert (results[rank]["left_at_step"], results[rank]["optimizer_steps"]) == (3, 3)
        assert results[rank]["hooks_left"] == 0
    # Rank 0 met the poisoned weight; rank 1 left with it, with none of its weights stepped.
    assert results[0]["event_module"] == POISONED and results[1]["event_module"] is None
    assert results[0]["changed"] == [f"{POISONED}.weight"] and results[1]["changed"] == []

"""DDP under torchrun (CPU, gloo, 127.0.0.1): consensus stop, merged recordings, distcheck."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nanwidget as nw
from nanwidget.core import consensus as distributed

from conftest import TinyMLP, hook_count

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_TIMEOUT = 240


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _torchrun(args: list[str], nproc: int = 2, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(extra_env or {}))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=TORCHRUN_TIMEOUT)


def _results(output: str) -> dict[int, dict]:
    # Each rank writes its line in one write, but two ranks can still share a line of the
    # merged output: decode every "RESULT {...}" wherever it starts.
    decoder = json.JSONDecoder()
    results = [decoder.raw_decode(chunk)[0] for chunk in output.split("RESULT ")[1:]]
    return {r["rank"]: r for r in results}


@pytest.fixture(scope="module")
def ddp_nan_run(tmp_path_factory):
    """One 2-rank DDP job: rank 1 gets a constant batch at batch 3, the norm layer divides 0/0."""
    log_dir = tmp_path_factory.mktemp("ddp") / "log"
    finished = _torchrun(["-m", "nanwidget.examples.ddp_nan", "--log-dir", str(log_dir),
                          "--nan-rank", "1", "--nan-batch", "3", "--batches", "8"])
    return finished, log_dir


@pytest.mark.slow
def test_nan_on_rank_1_stops_both_ranks_at_the_same_batch(ddp_nan_run):
    finished, _ = ddp_nan_run
    assert finished.returncode == 0, finished.stdout + finished.stderr
    results = _results(finished.stdout)
    assert sorted(results) == [0, 1]
    for rank in (0, 1):
        assert results[rank]["exception"] == "NanDetected"
        assert results[rank]["stopped_at"] == 3 and results[rank]["last_batch"] == 2
        assert (results[rank]["event_rank"], results[rank]["event_batch"]) == (rank, 3)
        assert results[rank]["module"] == "norm"
    # Rank 1 found it; rank 0 stopped with it, and each recorded the event it raised.
    assert (results[1]["origin"], results[1]["peer_rank"]) == ("output", None)
    assert (results[0]["origin"], results[0]["peer_rank"]) == ("peer", 1)
    assert results[0]["recorded"] == [[0, "peer"]] and results[1]["recorded"] == [[1, "output"]]
    assert "found on rank 1; rank 0 stops with it" in results[0]["message"]
    assert "on rank 1" in results[1]["message"] and "stops with it" not in results[1]["message"]
    # DDP's wrapper is unwrapped: the user's names, no "module." prefix.
    assert results[0]["module_names"] == ["", "norm", "fc1", "act", "fc2", "head"]


@pytest.mark.slow
def test_load_run_merges_both_ranks_and_finds_the_event_on_rank_1(ddp_nan_run):
    _, log_dir = ddp_nan_run
    run = nw.load_run(log_dir)
    assert run.ranks == [0, 1] and run.world_size == 2
    assert [(e.rank, e.batch, e.module, e.kind, e.origin, e.peer_rank) for e in run.events] == [
        (1, 3, "norm", "nan", "output", None), (0, 3, "norm", "nan", "peer", 1)]
    assert run.event.rank == 1
    history = run.history()
    assert set(history["rank"]) == {0, 1}
    assert set(history.loc[history["rank"] == 0, "batch"]) == {0, 1, 2, 3}
    grads = run.grad_history()
    assert set(grads["rank"]) == {0, 1} and set(grads["batch"]) == {0, 1, 2}
    bad = history[history["nonfinite"]]
    assert set(bad["rank"]) == {1} and set(bad["batch"]) == {3}
    trace = run.frames(batch=0)
    assert set(trace["rank"]) == {0, 1} and "module.norm" not in set(trace["module"])
    # The two ranks saw different shards, so their trace frames differ.
    inputs = trace[(trace["module"] == "norm") & (trace["role"] == "input[0]")]
    assert inputs["abs_max"].nunique() == 2


@pytest.fixture(scope="module")
def ddp_backward_nan_run(tmp_path_factory):
    """2-rank DDP, backward=True: rank 1's batch 5 has a row of zeros, whose gradient through
    rms (x * sqrt(mean(x**2))) is 0 * inf: NaN born in backward, forward finite."""
    log_dir = tmp_path_factory.mktemp("ddp-backward") / "log"
    finished = _torchrun(["-m", "nanwidget.examples.ddp_nan", "--log-dir", str(log_dir),
                          "--nan-in", "backward", "--nan-rank", "1", "--nan-batch", "5",
                          "--batches", "8", "--trace-batches", ""])
    return finished, log_dir


@pytest.mark.slow
def test_nan_born_in_backward_on_rank_1_stops_every_rank_before_the_optimizer_step(
        ddp_backward_nan_run):
    finished, _ = ddp_backward_nan_run
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "Connection closed" not in finished.stderr and "Traceback" not in finished.stderr
    results = _results(finished.stdout)
    assert sorted(results) == [0, 1]
    for rank in (0, 1):
        result = results[rank]
        # Both raised out of loss.backward() of batch 5: the last optimizer step was batch 4's.
        assert (result["exception"], result["stopped_at"], result["last_step"]) == (
            "NanDetected", 5, 4)
        assert (result["event_batch"], result["module"], result["role"], result["is_backward"]) \
            == (5, "rms", "grad_input[0]", True)
        assert result["weights_finite"]
    assert results[0]["weights_sum"] == results[1]["weights_sum"]  # still in step
    assert (results[1]["origin"], results[1]["peer_rank"]) == ("grad", None)
    assert (results[0]["origin"], results[0]["peer_rank"]) == ("peer", 1)
    assert results[0]["recorded"] == [[0, "peer"]] and results[1]["recorded"] == [[1, "grad"]]
    assert "(backward)" in results[0]["message"] and "rank 0 stops with it" in results[0]["message"]


@pytest.mark.slow
def test_load_run_lists_the_backward_event_of_rank_1_then_rank_0s_peer_event(
        ddp_backward_nan_run):
    _, log_dir = ddp_backward_nan_run
    run = nw.load_run(log_dir)
    assert [(e.rank, e.batch, e.module, e.role, e.origin, e.peer_rank, e.is_backward)
            for e in run.events] == [(1, 5, "rms", "grad_input[0]", "grad", None, True),
                                     (0, 5, "rms", "grad_input[0]", "peer", 1, True)]
    assert run.event.rank == 1
    bad = run.events[0].frames
    assert "backward" in set(bad["phase"])


@pytest.fixture(scope="module")
def fsdp_nan_run(tmp_path_factory):
    """2-rank FSDP2 (fully_shard per layer and the root), gloo: rank 1 writes a NaN into its
    own shard of fc2.weight before batch 3; rank 1 measures with torch ops (as on a GPU)."""
    log_dir = tmp_path_factory.mktemp("fsdp") / "log"
    finished = _torchrun(["-m", "nanwidget.examples.fsdp_nan", "--log-dir", str(log_dir),
                          "--nan-rank", "1", "--nan-batch", "3", "--torch-path-ranks", "1"])
    return finished, log_dir


@pytest.mark.slow
def test_fsdp2_nan_in_one_ranks_shard_is_blamed_on_its_weight_and_every_rank_stops(fsdp_nan_run):
    finished, log_dir = fsdp_nan_run
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "Traceback" not in finished.stderr
    assert "internal error" not in finished.stderr  # the diagnosis reads DTensor weights
    results = _results(finished.stdout)
    assert sorted(results) == [0, 1]
    for rank in (0, 1):
        result = results[rank]
        assert result["sharded_type"] == "DTensor" and result["shard_shape"] == [16, 32]
        assert (result["exception"], result["stopped_at"], result["last_step"]) == (
            "NanDetected", 3, 2)
        assert (result["event_batch"], result["module"], result["role"], result["origin"]) == (
            3, "fc2", "weight", "weight")
        assert result["diagnosis"] == "corrupted-weight", result["diagnosis"]
        # The forward's view of the weight: gathered from both shards, measured before FSDP
        # frees it, on the native path (rank 0) and the torch path (rank 1) alike.
        assert result["fc2_weight_rows"] == [[b, [32, 32], b == 3, ""] for b in range(4)]
        assert "storage freed" not in result["notes"]
        assert "cannot replay a model sharded with FSDP2" in result["replay"]
    assert results[1]["event_rank"] == 1 and results[1]["recorded"] == [[1, "weight"]]
    # Only rank 1's shard of fc2.weight holds the NaN (fc1 weight, bias, fc2 weight, ...).
    assert results[1]["shards_finite"] == [True, True, False, True, True, True]
    assert all(results[0]["shards_finite"])
    run = nw.load_run(log_dir)
    assert sorted((e.rank, e.batch, e.module, e.origin) for e in run.events) == [
        (0, 3, "fc2", "weight"), (1, 3, "fc2", "weight")]


@pytest.mark.slow
def test_fsdp2_in_sentinel_mode_stops_every_rank_before_the_step_without_a_replay():
    # A replay would run FSDP's forward on one rank (waiting for the others' all-gathers): the
    # event says it was not replayed, and the gradient check reads each rank's own shard.
    finished = _torchrun(["-m", "nanwidget.examples.fsdp_nan", "--mode", "sentinel",
                          "--nan-in", "backward", "--nan-rank", "1", "--nan-batch", "3"])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "internal error" not in finished.stderr
    results = _results(finished.stdout)
    for rank in (0, 1):
        result = results[rank]
        assert (result["stopped_at"], result["last_step"], result["is_backward"]) == (3, 2, True)
        assert result["origin"] in ("grad", "peer")
        if result["origin"] == "grad":
            assert result["note"].startswith("not replayed: cannot replay a model sharded with "
                                             "FSDP2")
    assert all(results[rank]["shards_finite"] for rank in (0, 1))


@pytest.mark.slow
def test_fsdp2_sentinel_names_the_weight_on_the_rank_whose_shard_holds_the_nan():
    # No replay under FSDP2: the event was the model's output on both ranks. Rank 1's own
    # shard of fc2.weight holds the NaN, read at event time: its event names that weight.
    finished = _torchrun(["-m", "nanwidget.examples.fsdp_nan", "--mode", "sentinel",
                          "--nan-rank", "1", "--nan-batch", "3"])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "internal error" not in finished.stderr
    results = _results(finished.stdout)
    for rank in (0, 1):
        assert (results[rank]["stopped_at"], results[rank]["last_step"]) == (3, 2)
        assert "not replayed: cannot replay a model sharded with FSDP2" in \
            results[rank]["message"]
    assert (results[1]["module"], results[1]["role"], results[1]["origin"]) == (
        "fc2", "weight", "weight")
    assert results[1]["diagnosis"] == "corrupted-weight", results[1]["summary"]
    # Rank 0's shard is finite (the gathered weight is freed after the forward): its event
    # stays what its check saw.
    assert (results[0]["module"], results[0]["origin"]) == ("", "output")


@pytest.mark.slow
def test_fsdp2_sentinel_blames_a_nan_made_in_the_loss_on_the_loss_without_a_replay():
    # Rank 1 adds sqrt(-1) to its loss: its outputs were finite and the gradient they received
    # NaN. No replay under FSDP2, but the sentinel held that gradient: the event is the
    # root's grad_output, diagnosed "loss" as in full mode (it was "unknown", at fc1.weight).
    finished = _torchrun(["-m", "nanwidget.examples.fsdp_nan", "--mode", "sentinel",
                          "--nan-in", "loss", "--nan-rank", "1", "--nan-batch", "2",
                          "--batches", "3"])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "internal error" not in finished.stderr
    result = _results(finished.stdout)[1]
    assert (result["stopped_at"], result["last_step"], result["is_backward"]) == (2, 1, True)
    assert (result["module"], result["role"], result["origin"]) == ("", "grad_output[0]", "grad")
    assert result["note"].startswith("not replayed: cannot replay a model sharded with FSDP2")
    assert result["diagnosis"] == "loss", result["summary"]
    assert result["summary"] == ("Made in the loss, outside the model: the gradient reaching "
                                 "the model's output in batch 2 was already non-finite, and no "
                                 "op of the model made it.")


@pytest.mark.slow
def test_fsdp2_nan_born_in_backward_stops_every_rank_out_of_loss_backward(tmp_path):
    finished = _torchrun(["-m", "nanwidget.examples.fsdp_nan", "--nan-in", "backward",
                          "--nan-rank", "1", "--nan-batch", "2", "--batches", "4"])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    results = _results(finished.stdout)
    for rank in (0, 1):
        assert (results[rank]["stopped_at"], results[rank]["last_step"]) == (2, 1)
        assert (results[rank]["module"], results[rank]["is_backward"]) == ("rms", True)
        assert all(results[rank]["shards_finite"])
    assert (results[0]["origin"], results[0]["peer_rank"]) == ("peer", 1)
    assert results[1]["origin"] == "grad"


@pytest.mark.slow
def test_sentinel_mode_stops_both_ranks_at_the_same_batch_with_the_replayed_event(tmp_path):
    finished = _torchrun(["-m", "nanwidget.examples.ddp_nan", "--mode", "sentinel",
                          "--log-dir", str(tmp_path / "log"), "--nan-rank", "1",
                          "--nan-batch", "3", "--batches", "8"])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    results = _results(finished.stdout)
    for rank in (0, 1):
        assert results[rank]["exception"] == "NanDetected"
        assert results[rank]["stopped_at"] == 3 and results[rank]["last_batch"] == 2
        assert results[rank]["module"] == "norm"
    assert (results[1]["origin"], results[1]["traced"]) == ("output", True)  # replayed on rank 1
    assert (results[0]["origin"], results[0]["peer_rank"]) == ("peer", 1)
    run = nw.load_run(tmp_path / "log")
    assert [(e.rank, e.batch, e.module, e.origin) for e in run.events] == [
        (1, 3, "norm", "output"), (0, 3, "norm", "peer")]
    assert run.event.trace is not None
    # Sentinel mode records frames of its trace batch (0) and the replayed batch only; of the
    # batches between, the root's outputs it checked.
    history = run.history()
    history = history[history["rank"] == 1]
    assert set(history.loc[history["module"] != "", "batch"]) == {0, 3}
    assert set(history.loc[history["module"] == "", "batch"]) == {0, 1, 2, 3}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_uneven_forwards_per_rank_give_each_rank_its_own_batch_and_the_finders_as_peer_batch(
        tmp_path, mode):
    # Rank 1 runs 3 validation forwards (no grad, no exchange) first: its training batch 3 is
    # its watch batch 6, while rank 0 is at its own batch 3 when both stop.
    finished = _torchrun(["-m", "nanwidget.examples.ddp_nan", "--mode", mode,
                          "--log-dir", str(tmp_path / "log"), "--nan-rank", "1",
                          "--nan-batch", "3", "--batches", "6", "--extra-evals", "3"])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    results = _results(finished.stdout)
    assert [results[rank]["stopped_at"] for rank in (0, 1)] == [3, 3]
    assert (results[1]["origin"], results[1]["event_batch"], results[1]["peer_batch"]) == (
        "output", 6, None)
    assert (results[0]["origin"], results[0]["event_batch"], results[0]["peer_batch"]) == (
        "peer", 3, 6)
    assert results[0]["event_batch"] == results[0]["watch_batch"] - 1  # its own count
    assert "nan on rank 1 in its batch 6 at module 'norm'" in results[0]["message"]
    assert "(found on rank 1; rank 0 stops with it in its batch 3)" in results[0]["message"]
    run = nw.load_run(tmp_path / "log")
    assert sorted((e.rank, e.batch, e.origin, e.peer_batch) for e in run.events) == [
        (0, 3, "peer", 6), (1, 6, "output", None)]


@pytest.mark.slow
def test_watch_on_rank_0_alone_turns_the_consensus_off_instead_of_hanging():
    # Rank 0's flag all-reduce would otherwise pair with rank 1's gradient all-reduce.
    finished = _torchrun(["-m", "nanwidget.examples.ddp_nan", "--watch-ranks", "0",
                          "--nan-batch", "-1", "--batches", "4"],
                         extra_env={"NANWIDGET_CONSENSUS_WAIT": "2"})
    assert finished.returncode == 0, finished.stdout + finished.stderr
    results = _results(finished.stdout)
    assert [results[r]["last_batch"] for r in (0, 1)] == [3, 3]
    assert "consensus stop is off for this watch" in finished.stderr
    assert "ranks watching: [0] of 2" in finished.stderr


@pytest.mark.slow
def test_distcheck_prints_ok_for_both_ranks_in_turn():
    finished = _torchrun(["-m", "nanwidget", "distcheck", "--timeout", "60"])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    host = socket.gethostname()
    lines = [line for line in finished.stdout.splitlines() if "is OK" in line or "torch " in line]
    assert lines[0].startswith(f"torch {torch.__version__}, CUDA ")
    assert "NCCL" in lines[0] and "world size 2" in lines[0]
    assert lines[1:] == [f"[{host}-0] is OK (global rank: 0/2)",
                         f"[{host}-1] is OK (global rank: 1/2)"]


def test_distcheck_names_the_step_that_hangs(tmp_path):
    # A world of 2 with only one process started: the rendezvous never completes.
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    finished = subprocess.run([sys.executable, "-m", "nanwidget", "distcheck", "--timeout", "3"],
                              capture_output=True, text=True, env=env, timeout=120)
    assert finished.returncode != 0
    assert "distcheck FAILED" in finished.stderr
    assert "init_process_group(gloo)" in finished.stderr


@pytest.fixture
def single_rank_group(tmp_path):
    """An in-process gloo group of world size 1 (enough to build a DDP wrapper)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_watching_ddp_records_the_users_module_names(single_rank_group):
    model = TinyMLP()
    ddp = nn.parallel.DistributedDataParallel(model)
    with nw.watch(ddp, trace_batches=[0]) as watch:
        ddp(torch.randn(4, 16))
        assert watch.module_names == ["", "fc1", "act", "fc2", "head"]
        assert set(watch.frames(batch=0)["module"]) == {"", "fc1", "act", "fc2", "head"}
        # World size 1: nothing to agree on, so no per-batch all-reduce rides along.
        assert watch.parts.consensus is None
    assert hook_count(model) == 0 and hook_count(ddp) == 0


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_fsdp1_batch_replays_to_the_module_that_met_the_nan(single_rank_group, mode):
    """FSDP1 (FullyShardedDataParallel, use_orig_params) makes its parameters' views under
    no_grad and writes their flat base with grad on; asking such a view for its grad_fn
    raises, and the trace's labelling of autograd nodes did, so every replay failed: the
    sentinel's event stayed at the root's output with "not replayed: ... A view was created in
    no_grad mode ...". Now both modes name the first module that met the NaN, with a trace."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation notice
        sharded = FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                           use_orig_params=True)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    with nw.watch(sharded, mode=mode, backward=True, replay_on_nan=True) as watch:
        with pytest.raises(nw.NanDetected) as raised:
            for batch in range(4):
                x = torch.randn(4, 8)
                if batch == 2:
                    x[1, 3] = float("nan")
                sharded(x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    event = raised.value.event
    assert (event.batch, event.module, event.role, event.origin) == (
        2, "_fsdp_wrapped_module.0", "input[0]", "input")
    assert "not replayed" not in event.note
    assert event.trace is not None and event.trace.reproduced
    assert event.diagnosis.kind == "bad-data"


def test_data_parallel_is_refused_with_a_pointer_to_ddp():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        nw.watch(nn.DataParallel(TinyMLP()))


def test_consensus_can_be_switched_off(tiny_mlp, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun, before init_process_group
    with nw.watch(tiny_mlp) as watch:
        assert watch.parts.consensus is not None
    monkeypatch.setenv("NANWIDGET_CONSENSUS", "0")
    with nw.watch(tiny_mlp) as watch:
        assert watch.parts.consensus is None
    monkeypatch.delenv("NANWIDGET_CONSENSUS")
    distributed.set_consensus(False)
    try:
        with nw.watch(tiny_mlp) as watch:
            assert watch.parts.consensus is None
    finally:
        distributed.set_consensus(None)
    assert distributed.consensus_enabled()


def test_consensus_waits_for_nothing_without_a_process_group(tiny_mlp, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with nw.watch(tiny_mlp) as watch:
        tiny_mlp(torch.randn(4, 16))  # no group initialised: the flag exchange is skipped
        assert watch.parts.consensus.exchanges == 0


def test_peer_event_names_the_rank_that_found_it():
    event = nw.NanEvent(batch=3, module="norm", module_type="Standardize", call=0,
                        role="output", kind="nan", origin="peer", rank=1, peer_rank=0)
    text = event.summary()
    assert text.startswith("nan in batch 3 on rank 0 at module 'norm'")
    assert text.endswith("(found on rank 0; rank 1 stops with it)")
    assert str(nw.NanDetected(event)).count("rank 0") == 2
    # Ranks that ran different numbers of forwards: this rank's batch, and the finder's.
    uneven = nw.NanEvent(batch=12, module="norm", module_type="Standardize", call=0,
                         role="output", kind="nan", origin="peer", rank=0, peer_rank=1,
                         peer_batch=15)
    assert uneven.summary() == ("nan on rank 1 in its batch 15 at module 'norm' (Standardize, "
                                "call 0), output (found on rank 1; rank 0 stops with it in its "
                                "batch 12)")


class _ShardedScale(nn.Module):
    """Multiplies by a DTensor parameter (as tensor parallelism holds them during the forward)."""

    def __init__(self, mesh) -> None:
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor
        self.scale = nn.Parameter(distribute_tensor(torch.full((4, 3), 2.0), mesh, [Shard(0)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to_local()


def test_dtensor_parameters_are_measured_on_this_ranks_shard_without_collectives(
        single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1,))
    model = nn.Sequential(nn.Linear(3, 3), _ShardedScale(mesh))
    with nw.watch(model, backward=True, on_nan="record", max_frames=50) as watch:
        model(torch.randn(4, 3)).sum().backward()
        assert watch.check_grad_norms() is False  # the DTensor gradient: its local shard
        frames = watch.frames()
        weight = frames[(frames.module == "1") & (frames.role == "scale")].iloc[0]
        assert (weight["note"], weight["shape"], weight["abs_max"]) == ("local shard", (4, 3), 2.0)
        assert set(watch.grad_history()["param"]) == {"0.weight", "0.bias", "1.scale"}
        with torch.no_grad():
            model[1].scale.to_local()[1, 2] = float("nan")  # the wrapper's version stays put
        model(torch.randn(4, 3))
    event = watch.event
    assert (event.batch, event.module, event.role, event.origin) == (1, "1", "scale", "weight")


def test_diagnosis_reads_dtensor_weights_on_this_ranks_shard_and_names_bad_data(
        single_rank_group):
    # After three batches the diagnosis measures each module's weights; a DTensor weight
    # (FSDP2) indexed as a whole failed in torch's sharding rules, so NaN in the data came out
    # "unknown" ("the diagnosis failed") with an internal-error warning.
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), _ShardedScale(mesh))
    with nw.watch(model, on_nan="record") as watch:
        for _ in range(3):
            model(torch.randn(4, 3))
        bad = torch.randn(4, 3)
        bad[2, 1] = float("nan")
        model(bad)
    event = watch.event
    assert (event.batch, event.module, event.origin) == (3, "0", "input")
    assert event.diagnosis.kind == "bad-data", event.diagnosis
    assert event.diagnosis.rows == [2]


def test_a_model_with_dtensor_weights_on_a_one_rank_mesh_is_still_replayed(single_rank_group):
    # Only a DTensor over more than one rank makes a replay wait for others; one rank's is local.
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1,))
    model = nn.Sequential(nn.Linear(3, 3), _ShardedScale(mesh))
    with nw.watch(model, on_nan="record", replay_on_nan=True) as watch:
        bad = torch.randn(4, 3)
        bad[1, 0] = float("inf")
        model(bad - bad)  # inf - inf: NaN made by the sub, outside the modules
    event = watch.event
    assert event.trace is not None and event.trace.reproduced, event.note


class _RowsOfShard(nn.Module):
    """Takes a row-sharded DTensor (sequence or tensor parallelism) and works on this rank's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.to_local())


def test_diagnosis_reads_a_dtensor_input_on_this_ranks_shard_and_names_its_bad_rows(
        single_rank_group):
    # Read as a whole, a DTensor input failed in torch's sharding rules (nonzero): the input was
    # dropped and NaN in the data came out "unknown".
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = _RowsOfShard()
    with nw.watch(model, on_nan="record") as watch:
        rows = torch.randn(3, 6)
        rows[1, 2] = float("nan")
        model(DTensor.from_local(rows, mesh, [Shard(0)], run_check=False))
    diagnosis = watch.event.diagnosis
    assert (diagnosis.kind, diagnosis.rows) == ("bad-data", [1]), diagnosis
    assert diagnosis.evidence[0] == "input[0] (float32 (3, 6), local shard): 1 NaN in row 1 of 3."


@pytest.mark.slow
def test_dtensor_input_nan_on_rank_1_is_diagnosed_there_without_a_collective():
    # Rank 0 waits for rank 1 through the store (no collective): a collective in rank 1's
    # diagnosis would hang until the group's 20 s timeout, and a failed read says "unknown".
    finished = _torchrun([str(REPO / "tests/scripts/dtensor_input_nan.py")])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "internal error" not in finished.stderr
    results = _results(finished.stdout)
    assert results[0]["events"] == []
    assert results[1]["events"] == [[1, 2, "fc", "input"]]
    assert (results[1]["diagnosis"], results[1]["rows"]) == ("bad-data", [1]), results[1]
    assert results[1]["evidence"] == ["input[0] (float32 (3, 6), local shard): 1 NaN in row 1 "
                                      "of 3."]
    assert results[1]["seconds"] < 15  # no wait for a collective rank 0 never joins


@pytest.fixture(scope="module")
def tensor_parallel_run():
    """One 2-rank job running tests/scripts/tp_nan.py's scenarios: (scenario, rank) -> result."""
    finished = _torchrun([str(REPO / "tests/scripts/tp_nan.py"), "--timeout", "10"])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "internal error" not in finished.stderr
    decoder = json.JSONDecoder()
    return {(r["scenario"], r["rank"]): r for r in
            (decoder.raw_decode(chunk)[0] for chunk in finished.stdout.split("RESULT ")[1:])}


def _assert_replays_refused(results: dict, prefix: str, refusal: str) -> None:
    """tp_nan.py's four scenarios named ``prefix`` + option set: rank 1's events kept, each
    replay refused with ``refusal`` before it ran, no rank waiting; rank 0 has no event in any
    scenario, so none of its ops waits for rank 1."""
    for scenario in ("full", "full-replay", "sentinel", "sentinel-backward"):
        first, second = results[prefix + scenario, 0], results[prefix + scenario, 1]
        assert first["error"] == second["error"] == "", (scenario, first, second)
        assert first["events"] == [] and first["seconds"] < 5, (scenario, first)
        assert second["seconds"] < 5 and not any(second["traced"]), (scenario, second)
        # Not w.replay(2), which would be refused the same way.
        assert second["suggestion"][0][0].startswith(
            "Run batch 2 through an unsharded copy of the model"), second
        if scenario.startswith("full"):
            assert second["events"] == [[2, "norm", "output", "output"],
                                        [3, "norm", "output", "output"]], second
            assert second["notes"] == ["", ""]
            # The diagnosis says what it can without the replay, and why none was made.
            assert "made here from finite inputs and weights" in second["summary"][0]
            assert second["evidence"][0] == [f"No replay was made to name the op: {refusal}."]
        else:
            assert second["events"][0] == [2, "", "output", "output"], second
            assert second["notes"][0] == f"not replayed: {refusal}", second
            assert second["evidence"][0] == [f"Not replayed: {refusal}."], second  # said once
    backward = results[prefix + "sentinel-backward", 1]
    assert backward["events"][1] == [2, "fc1", "weight", "grad"], backward
    assert backward["notes"][1] == f"not replayed: {refusal}"
    assert results[prefix + "full-replay", 1]["warnings"] == [
        f"nanwidget: replay_on_nan could not replay batch {batch} (ModelNotReplayableError: "
        f"{refusal})" for batch in (2, 3)]


@pytest.mark.slow
def test_tensor_parallel_nan_on_one_rank_is_kept_without_a_replay_that_would_hang(
        tensor_parallel_run):
    # parallelize_module puts an all-reduce inside the forward. A replay on rank 1 alone ran it
    # with no partner: it took rank 0's next batch, then rank 1 hung until the group's timeout
    # (a gloo RuntimeError out of the training loop). Now each replay is refused before it runs.
    _assert_replays_refused(tensor_parallel_run, "", (
        "cannot replay a tensor-parallel model ('fc1.weight' is a DTensor over 2 ranks): its "
        "forward exchanges values with the other ranks, and a replay runs on this rank alone, so "
        "it would wait for the others forever (or take their next batch's values). Replay an "
        "unsharded copy of the model on one process instead"))


@pytest.mark.slow
def test_a_hand_written_parallel_layers_all_reduce_stops_the_replay_before_it_waits(
        tensor_parallel_run):
    # Megatron-style layers hold plain tensors: nothing seen before a replay says that fc2's
    # forward all-reduces. A replay on rank 1 alone ran that all-reduce: it took rank 0's next
    # batch's partial sums, then waited until the group's timeout (a gloo RuntimeError out of
    # rank 1's training loop, and rank 0 gone). Now the replay stops at the collective, before
    # it is issued, and later replays of the model are refused at once.
    _assert_replays_refused(tensor_parallel_run, "hand-", (
        "cannot replay a model whose forward or backward exchanges values with other ranks "
        "('fc2' ran the collective c10d::allreduce_ over 2 ranks): a replay runs on this rank "
        "alone, so it would wait for the others forever (or take their next batch's values). "
        "Replay an unsharded copy of the model on one process instead"))
    # The same layer all-reducing over a group of its own rank alone waits for no one: its
    # replay runs, and names the op.
    solo = tensor_parallel_run["solo-full", 1]
    assert solo["error"] == "" and solo["seconds"] < 5, solo
    assert solo["events"] == [[2, "norm", "output", "output"], [3, "norm", "output", "output"]]
    assert solo["evidence"][0][2] == "div output: 10 NaN of 10 values (float32 max 3.4028e+38).", \
        solo


@pytest.mark.slow
def test_a_rowwise_parallel_output_is_measured_once_its_all_reduce_has_ended(tensor_parallel_run):
    # The hooks read the output (an AsyncCollectiveTensor) while its all-reduce still ran: 3 in 4
    # batches measured this rank's partial sums, so a NaN arriving from the other rank was
    # blamed on the next module.
    for rank in (0, 1):
        measure = tensor_parallel_run["measure", rank]
        assert len(measure["measured"]) == 16
        assert measure["measured"] == pytest.approx(measure["actual"], rel=1e-6), measure


@pytest.mark.slow
def test_training_goes_on_under_ddp_after_a_backward_nan_was_raised_and_its_batch_skipped():
    # The sentinel's check at the end of the backward pass ran before DDP's final callback: its
    # raise left the reducer mid-pass ("INTERNAL ASSERT FAILED ... unmarked_param_indices" at
    # the next backward). Full mode's check runs after DDP's reductions, and now so does it.
    finished = _torchrun([str(REPO / "tests/scripts/ddp_skip_after_nan.py")])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    decoder = json.JSONDecoder()
    results = {(r["rank"], r["mode"]): r for r in
               (decoder.raw_decode(chunk)[0] for chunk in finished.stdout.split("RESULT ")[1:])}
    assert sorted(results) == [(0, "full"), (0, "sentinel"), (1, "full"), (1, "sentinel")]
    for (rank, mode), result in results.items():
        assert result["error"] == "", (rank, mode, result["error"])
        assert result["skipped"] == [2], (rank, mode)


@pytest.mark.slow
def test_parameter_gradient_frames_under_ddp_hold_the_all_reduced_grad():
    # The frames held each rank's own gradient, measured before DDP's all-reduce: rank 0 read
    # finite where its .grad (what the optimizer used) was NaN, and recorded no event for it.
    finished = _torchrun([str(REPO / "tests/scripts/ddp_reduced_grads.py")])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    first = _results(finished.stdout)[0]
    assert all(first["grad_nan"].values())
    assert first["frame_nan"] == first["grad_nan"]
    batch, origin, summary = first["event"]
    assert (batch, origin) == (2, "grad")
    assert "only after DDP averaged it over the ranks: rank 0's own gradients in batch 2 " \
        "stayed finite" in summary


def test_a_nan_gradient_accumulated_under_ddp_no_sync_names_the_micro_batch_that_made_it(
        single_rank_group):
    # DDP names parameters "module.2.bias" while events say "2.bias", and its all-reduce at the
    # group's last micro-batch writes .grad more than once: batch 7's carried NaN read "unknown".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(8)]
    with nw.watch(ddp, backward=True, on_nan="record") as watch:
        for micro, (x, y) in enumerate(data):
            scale = 0.0 if micro == 6 else 1.0  # sqrt(0): a NaN gradient made in the loss
            context = ddp.no_sync() if micro % 4 != 3 else contextlib.nullcontext()
            with context:
                (torch.sqrt(((ddp(x) - y) * scale).pow(2).sum()) / 4).backward()
            if micro == 3:
                ddp.zero_grad(set_to_none=False)
    first, later = watch.events[0], watch.events[1]
    assert (first.batch, later.batch, later.qualified_role) == (6, 7, "2.bias")
    assert first.diagnosis.kind == later.diagnosis.kind == "loss"
    assert "because batch 6's backward left it so" in later.diagnosis.summary


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_fsdp2_weight_an_optimizer_step_made_nan_is_told_as_written_by_that_step(
        single_rank_group, mode, param_dtype):
    # FSDP2 puts the gathered tensor in a parameter's slot while the forward runs (cast to
    # bfloat16 under a MixedPrecisionPolicy); the optimizer steps the sharded DTensor. The
    # diagnosis read the gathered one: full mode said "No optimizer step wrote '0.weight' ...:
    # a write did", sentinel mode "holds NaN since before the watch began (no in-place write
    # and no optimizer step in between)".
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                          nn.Linear(16, 2))
    policy = {} if param_dtype is None else {"mp_policy": MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32)}
    fully_shard(model[2], **policy)
    fully_shard(model, **policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    hooks = hook_count(model)  # FSDP's own
    with nw.watch(model, mode=mode, on_nan="record") as watch:
        for step in range(3):
            x, y = torch.randn(8, 8, generator=data), torch.randn(8, 2, generator=data)
            loss = nn.functional.mse_loss(model(x).float(), y)
            optimizer.zero_grad()
            loss.backward()
            if step == 1:  # a NaN gradient: the step writes NaN into every weight
                for parameter in model.parameters():
                    parameter.grad.to_local().fill_(float("nan"))
            optimizer.step()
    event = watch.event
    assert (event.batch, event.module, event.role, event.origin) == (2, "0", "weight", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight", diagnosis
    assert "became NaN between batch 1 and batch 2: the optimizer step, load or write after " \
        "batch 1 did it" in diagnosis.summary, diagnosis.summary
    told = " ".join([diagnosis.summary, *diagnosis.evidence, *diagnosis.suggestion])
    for wrong in ("No optimizer step wrote", "before the watch began", "no optimizer step in "
                  "between", "has not moved"):
        assert wrong not in told, told
    assert hook_count(model) == hooks


def test_fsdp2_float16_overflow_fix_names_the_mixed_precision_policy_not_autocast(
        single_rank_group):
    # MixedPrecisionPolicy(param_dtype=torch.float16) runs the forward in float16 with no
    # torch.autocast anywhere: the fix said to wrap the module in torch.autocast(enabled=False)
    # or to autocast in bfloat16.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                          nn.Linear(16, 2))
    nn.init.constant_(model[0].weight, 0.5)
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    fully_shard(model[2], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    with nw.watch(model, on_nan="record") as watch:
        model(torch.randn(8, 8))
        model(torch.full((8, 8), 3e4))  # finite in float16; 8 x 3e4 is not
    event = watch.event
    assert (event.batch, event.module, event.origin) == (1, "0", "output")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "overflow", diagnosis
    assert "passed float16's largest value" in diagnosis.summary
    fixes = " ".join(diagnosis.suggestion)
    assert "autocast" not in fixes, fixes
    assert "MixedPrecisionPolicy(param_dtype=torch.float16) casts it to float16" in fixes
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in fixes


def test_a_float16_overflow_without_fsdp_still_gets_the_autocast_fix():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    nn.init.constant_(model[0].weight, 0.5)
    model.half()
    with nw.watch(model, on_nan="record") as watch:
        model(torch.full((8, 8), 3e4, dtype=torch.float16))
    fixes = " ".join(watch.event.diagnosis.suggestion)
    assert "torch.autocast(device_type, enabled=False)" in fixes
    assert "MixedPrecisionPolicy" not in fixes


def test_fsdp2_full_mode_does_not_claim_it_checked_the_sharded_gradients(single_rank_group):
    # Full mode measures no gradient of a parameter FSDP2 shards, yet with backward=True a
    # weight a NaN gradient shard made NaN read "The watch checked the gradients of every
    # backward pass ... and none was non-finite", and its fix sent the user to look for a load.
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nw.watch(model, backward=True, on_nan="record") as watch:
        for step in range(3):
            loss = model(torch.randn(8, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            if step == 1:
                model[0].weight.grad.to_local()[0, 0] = float("nan")  # a bad gradient shard
            optimizer.step()
    event = watch.event
    assert (event.batch, event.module, event.role, event.origin) == (2, "0", "weight", "weight")
    diagnosis = event.diagnosis
    assert diagnosis.kind == "corrupted-weight", diagnosis
    told = " ".join([*diagnosis.evidence, *diagnosis.suggestion])
    assert "none was non-finite" not in told, told
    assert diagnosis.suggestion[0].startswith(
        "Catch the bad step before it writes the weights: full mode does not measure the "
        "gradients of parameters FSDP2 shards, so watch with mode='sentinel', backward=True"), \
        diagnosis.suggestion


@pytest.mark.slow
def test_sentinel_rank_whose_grad_only_ddp_made_nan_stops_as_the_finders_peer():
    # Sentinel mode sees only .grad after DDP's all-reduce: rank 0, whose own gradients stayed
    # finite, raised its own event at '2.weight' ("found in a gradient; what made it could not
    # be told"), where full mode gives it rank 1's event as a peer.
    finished = _torchrun([str(REPO / "tests/scripts/ddp_sentinel_reduced_grad.py")])
    assert finished.returncode == 0, finished.stdout + finished.stderr
    results = _results(finished.stdout)
    assert results[1]["event"] == [2, "2", "grad_output[0]", "grad", None], results[1]
    assert results[1]["kind"] == "loss" and results[1]["recorded"] == [[1, "grad"]]
    assert results[0]["stopped"] == 2
    assert results[0]["event"] == [2, "2", "grad_output[0]", "peer", 1], results[0]
    assert results[0]["kind"] == "loss" and results[0]["recorded"] == [[0, "peer"]]
    assert "found on rank 1; rank 0 stops with it" in results[0]["message"]

"""``python -m nanwidget distcheck``: is this torchrun job able to talk? Run it under torchrun::

    torchrun --nproc_per_node 8 -m nanwidget distcheck

Every rank initialises the process group (NCCL when CUDA is available, else gloo), allocates
on its device, all-reduces, and passes a barrier; then the ranks print, in turn, one line each:
``[host-local_rank] is OK (global rank: r/world)``. Rank 0 first prints the torch, CUDA and
NCCL versions. A step that does not finish within ``--timeout`` seconds ends the process with
a message naming that step, instead of hanging. Outside torchrun it checks a single process.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import threading
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="process group backend (auto: nccl with CUDA, else gloo)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds one step may take before it counts as hung (default 120)")


class _Watchdog:
    """Ends the process with a clear message when a step outlives its time."""

    def __init__(self, label: str, timeout: float) -> None:
        self.label = label
        self.timeout = timeout
        self.step = "starting"
        self.started = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nanwidget-distcheck-watchdog",
                                        daemon=True)
        self._thread.start()

    def enter(self, step: str) -> None:
        self.step, self.started = step, time.monotonic()

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            if time.monotonic() - self.started > self.timeout:
                print(f"{self.label} distcheck FAILED: step '{self.step}' did not finish within "
                      f"{self.timeout:g} s (hung: another rank is missing, unreachable, or "
                      "stuck). Check MASTER_ADDR/MASTER_PORT, the network interface "
                      "(NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME) and that every rank started.",
                      file=sys.stderr, flush=True)
                os._exit(3)

    def stop(self) -> None:
        self._done.set()


def _ensure_launcher_env() -> bool:
    """Fill in a one-process group's variables when not under torchrun; True if we did."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return False
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    return True


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    alone = _ensure_launcher_env()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    label = f"[{socket.gethostname()}-{local_rank}]"
    if not dist.is_available():
        print(f"{label} distcheck FAILED: this torch build has no torch.distributed", file=sys.stderr)
        return 2
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        print(f"{label} distcheck FAILED: --backend nccl needs CUDA, which torch does not see",
              file=sys.stderr)
        return 2
    watchdog = _Watchdog(label, args.timeout)
    try:
        if backend == "nccl":
            watchdog.enter(f"cuda.set_device({local_rank})")
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        watchdog.enter(f"init_process_group({backend})")
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
        rank, world = dist.get_rank(), dist.get_world_size()
        label_rank = f"{label} rank {rank}/{world}"
        watchdog.label = label_rank

        watchdog.enter(f"allocate on {device}")
        probe = torch.ones(1 << 20, device=device)
        expected_probe = float(probe.sum().item())  # forces the allocation and a kernel
        if expected_probe != float(1 << 20):
            raise RuntimeError(f"device {device} computed {expected_probe}, expected {1 << 20}")

        watchdog.enter("all_reduce")
        value = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(value)
        total = float(value.item())
        expected = world * (world + 1) / 2
        if total != expected:
            raise RuntimeError(f"all_reduce gave {total}, expected {expected}")

        watchdog.enter("barrier")
        _barrier(dist, device)

        watchdog.enter("printing in turn")
        for turn in range(world):
            if turn == rank:
                if rank == 0:
                    _print_versions(torch, backend, world, alone)
                print(f"{label} is OK (global rank: {rank}/{world})", flush=True)
            _barrier(dist, device)

        watchdog.enter("destroy_process_group")
        dist.destroy_process_group()
    except Exception as error:  # a failing step: say which, never a bare traceback
        print(f"{watchdog.label} distcheck FAILED at step '{watchdog.step}': "
              f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        watchdog.stop()
    return 0


def _barrier(dist: object, device: object) -> None:
    """A barrier that has really finished on return, on every backend."""
    import torch
    dist.barrier()  # type: ignore[attr-defined]
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def _print_versions(torch: object, backend: str, world: int, alone: bool) -> None:
    cuda = getattr(torch.version, "cuda", None) or "none"  # type: ignore[attr-defined]
    nccl = "none"
    try:
        if torch.cuda.is_available():  # type: ignore[attr-defined]
            version = torch.cuda.nccl.version()  # type: ignore[attr-defined]
            nccl = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
    except Exception:
        nccl = "unknown"
    note = " (not under torchrun: checking this one process)" if alone else ""
    print(f"torch {torch.__version__}, CUDA {cuda}, NCCL {nccl}; backend {backend}, "  # type: ignore[attr-defined]
          f"world size {world}{note}", flush=True)

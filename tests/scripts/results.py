"""What the torchrun scripts here print for their tests: one ``RESULT {json}`` line per result."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def emit(result: dict[str, Any]) -> None:
    """Print ``result`` as one ``RESULT {json}`` line, written in one piece so that the lines of
    two ranks sharing the terminal cannot interleave."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(result, default=str) + "\n").encode())



def close_process_group_and_exit() -> None:
    """Close the process group, if any, once the script's models are gone (call it after
    main() returns): left to the interpreter's exit, gloo's teardown once aborted a rank
    ("terminate called without an active exception") after its result was out; closed while a
    DDP model still lived, a rank hung in the model's teardown. Then leave without the
    interpreter's teardown: torch keeps the group's gloo threads alive past
    destroy_process_group once DDP used it, and tearing them down at exit still aborted a rank
    now and then. The examples' scripts leave the same way (nanwidget/examples/ddp_nan.py)."""
    import gc

    import torch.distributed as dist
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # leave together: no peer still talks to a rank tearing gloo down
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

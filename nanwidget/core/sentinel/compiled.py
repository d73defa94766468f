"""Compiled models: where a watch attaches to one, and the compiled re-run of a held batch.

A model compiled with ``torch.compile(model)`` is an ``OptimizedModule`` wrapping the original
module (``_orig_mod``): hooks on the wrapper run outside compiled code, before and after it,
so a sentinel watch puts its two root hooks there and records under the original module's
names. A model compiled in place (``model.compile()``) runs its own hooks under Dynamo's frame
callback: the recorder wraps its root hooks with ``torch._dynamo.disable`` so that Dynamo never
traces them. Either way the compiled graph is left exactly as Dynamo made it: no graph break,
no recompile. Replays run the original module eagerly (``torch.compiler.set_stance
("force_eager")``, see :func:`nanwidget.core.replay.run.eager_calls`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..recorder import Recorder
from ..replay.capture import HeldBatch, WeightSlots
from ..replay.run import forward_arguments, forward_modes, set_forward_state
from .check import BadTensor, NonFiniteCheck, float_leaves

__all__ = ["is_compile_wrapper", "compiled_in_place", "has_compiled_parts", "rerun_compiled"]


def is_compile_wrapper(module: Any) -> bool:
    """``torch.compile(module)``'s result (an ``OptimizedModule`` holding ``_orig_mod``)."""
    return isinstance(module, nn.Module) and type(module).__name__ == "OptimizedModule" \
        and isinstance(getattr(module, "_orig_mod", None), nn.Module)


def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called on it."""
    return getattr(module, "_compiled_call_impl", None) is not None


def has_compiled_parts(module: nn.Module) -> list[str]:
    """Names of the submodules that run compiled code (wrappers or compiled in place)."""
    return [name or "<root>" for name, sub in module.named_modules()
            if is_compile_wrapper(sub) or compiled_in_place(sub)]


def rerun_compiled(recorder: Recorder, held: HeldBatch, slots: WeightSlots) -> list[BadTensor]:
    """Run the compiled model once more on ``held`` (same inputs, RNG states, modes and
    flags, so Dynamo's cached graph is used: nothing recompiles) and return its non-finite
    output leaves. Buffers, RNG states and train/eval flags are put back afterwards; the
    watch records nothing meanwhile."""
    saved_cpu_rng = torch.get_rng_state()
    saved_cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    saved_training = [m.training for m in slots.modules]
    buffers = [(t, t.detach().clone()) for t, is_buffer in zip(slots.read(), slots.is_buffer)
               if is_buffer and t is not None]
    bad: list[BadTensor] = []
    try:
        with recorder.suspend():
            for capture in held.forwards:
                set_forward_state(capture, slots)
                args, kwargs = forward_arguments(capture)
                with forward_modes(capture):
                    output = recorder.entry(*args, **kwargs)
                leaves = float_leaves(output)
                bad.extend(NonFiniteCheck((role, values) for role, _, values in leaves).read())
                del output
    finally:
        with torch.no_grad():
            for tensor, saved in buffers:
                with contextlib.suppress(RuntimeError):
                    tensor.copy_(saved)
        for module, flag in zip(slots.modules, saved_training):
            module.training = flag
        torch.set_rng_state(saved_cpu_rng)
        if saved_cuda_rng is not None:
            torch.cuda.set_rng_state_all(saved_cuda_rng)
    return bad

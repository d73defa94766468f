"""Runs the README's Accelerate recipe, as written there, on a tiny GPT-2 poisoned at step 3.

    accelerate launch --cpu --num_processes 2 tests/scripts/accelerate_recipe.py
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 tests/scripts/accelerate_recipe.py  # the same
    python tests/scripts/accelerate_recipe.py                                            # 1 process

The README block after ``<!-- recipe: accelerate -->`` is executed with ``model``, ``optimizer``
and ``loader`` defined here. Each process prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import close_process_group_and_exit, emit  # noqa: E402
from trainer_nan import GPT2_POISONED, TokenDataset, hook_count, module_named, tiny_gpt2  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


def recipe() -> str:
    text = README.read_text(encoding="utf-8")
    found = re.search(r"<!-- recipe: accelerate -->\s*```py\n(.*?)^```", text,
                      flags=re.MULTILINE | re.DOTALL)
    if found is None:
        raise SystemExit("README.md has no <!-- recipe: accelerate --> block")
    return found.group(1)


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    model = tiny_gpt2()
    poisoned = module_named(model, GPT2_POISONED)
    calls = {"training": 0}
    snapshot: dict[str, torch.Tensor] = {}

    def poison_at_step_3(module, args):
        # The model's 4th training forward (step 3, counted from 0) meets a NaN weight on rank 0.
        if module.training:
            if calls["training"] == 3:
                snapshot.update({k: v.detach().clone() for k, v in model.named_parameters()})
                if rank == 0:
                    with torch.no_grad():
                        poisoned.weight[0, 0] = float("nan")
            calls["training"] += 1

    user_hook = model.register_forward_pre_hook(poison_at_step_3)
    namespace = {"model": model,
                 "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
                 "loader": torch.utils.data.DataLoader(TokenDataset(64), batch_size=4)}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(recipe(), "README.md (accelerate recipe)", "exec"), namespace)
    watch = namespace["watch"]
    changed = [name for name, value in model.named_parameters()
               if not torch.equal(torch.nan_to_num(value), torch.nan_to_num(snapshot[name]))]
    optimizer = namespace["optimizer"]
    steps = max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)
    hooks_left = hook_count(model) - 1  # the poisoning hook above is the user's own
    user_hook.remove()
    result = {
        "rank": rank, "world": int(os.environ.get("WORLD_SIZE", "1")),
        "left_at_step": namespace["step"], "optimizer_steps": steps, "changed": changed,
        "event_module": watch.event.module if watch.event else None,
        "hooks_left": hooks_left, "report_printed": "Detected inf/nan" in printed.getvalue(),
    }
    emit(result)


if __name__ == "__main__":
    main()
    close_process_group_and_exit()

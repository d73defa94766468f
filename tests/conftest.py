"""Shared fixtures: seeded small models, and a guard that every test leaves no hooks behind."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


class TinyMLP(nn.Module):
    """64 -> 32 -> 32 -> 4, small enough for 2 CPU cores."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc2(self.act(self.fc1(x)))))


@pytest.fixture
def tiny_mlp() -> TinyMLP:
    return TinyMLP()


def hook_count(model: nn.Module) -> int:
    """Forward/backward hooks currently registered on any module of ``model``, and the
    gradient hooks on its parameters."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(getattr(m, "_backward_pre_hooks", {})) for m in model.modules()) + \
        sum(len(p._post_accumulate_grad_hooks or ()) for p in model.parameters())


@pytest.fixture(params=["native", "torch"])
def reduction_path(request, monkeypatch):
    """Run a test on both reduction paths: the native CPU kernel and the portable torch one."""
    from nanwidget.core import native
    if request.param == "native":
        if not native.available():
            pytest.skip(f"native kernel: {native.status()}")
    else:
        monkeypatch.setattr(native, "available", lambda: False)
    return request.param

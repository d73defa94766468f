"""Gradients: backward frames (:mod:`.backward`) and the gradient-norm check (:mod:`.norms`)."""

from .backward import BackwardFrames
from .norms import (GRAD_HISTORY_FULL_BATCHES, GRAD_HISTORY_WINDOW, GRAD_HISTORY_WINDOWS,
                    MAX_GRAD_EVENTS, GradNorms, empty_grad_history, grad_norms)

__all__ = ["BackwardFrames", "GradNorms", "grad_norms", "empty_grad_history", "MAX_GRAD_EVENTS",
           "GRAD_HISTORY_FULL_BATCHES", "GRAD_HISTORY_WINDOWS",
           "GRAD_HISTORY_WINDOW"]

"""Gradients: backward frames (:mod:`.backward`), the gradient-norm check (:mod:`.norms`) and
AMP loss scaling (:mod:`.scaler`)."""

from .backward import BackwardFrames
from .norms import (GRAD_HISTORY_FULL_BATCHES, GRAD_HISTORY_WINDOW, GRAD_HISTORY_WINDOWS,
                    MAX_GRAD_EVENTS, GradNorms, empty_grad_history, grad_norms)
from .scaler import ScalerHint, ScalerWatch, skips_summary

__all__ = ["BackwardFrames", "GradNorms", "ScalerWatch", "ScalerHint", "skips_summary",
           "grad_norms", "empty_grad_history", "MAX_GRAD_EVENTS", "GRAD_HISTORY_FULL_BATCHES",
           "GRAD_HISTORY_WINDOWS", "GRAD_HISTORY_WINDOW"]

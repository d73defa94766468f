"""Plots of recorded frames and history: functions taking DataFrames, returning Figures.

The figures are made without pyplot (no global figure list, nothing to close, works with the
Agg backend in scripts); in a notebook display one with ``display(fig)`` or save it with
``fig.savefig(path)``. They are laid out for the screen and drawn at twice the resolution
(``figure_png``), with legends beside the axes rather than over the data.
"""

from .frames import plot_frames
from .grads import plot_grad_norms
from .history import largest_modules, neighbour_modules, plot_history

__all__ = ["plot_frames", "plot_history", "largest_modules", "neighbour_modules",
           "plot_grad_norms"]

"""ipywidgets views over recorded frames. They read the core's DataFrames, never compute stats."""

from .browser import FrameBrowser

__all__ = ["FrameBrowser"]

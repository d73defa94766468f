"""Recordings on disk: :mod:`.writer` spools a watch's records (``watch(..., log_dir=DIR)``),
:mod:`.reader` reads them back (:func:`load_run`), :mod:`.tables` is the file format."""

from .reader import Run, RunLoadError, load_run
from .tables import FORMAT_NAME, FORMAT_VERSION, use_parquet
from .writer import RecordingWriter

__all__ = ["Run", "RunLoadError", "load_run", "RecordingWriter", "FORMAT_NAME", "FORMAT_VERSION",
           "use_parquet"]

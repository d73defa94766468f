"""Run the notebooks and store them the way they are committed.

    python scripts/refresh_notebooks.py                 # every notebook in notebooks/
    python scripts/refresh_notebooks.py notebooks/02_fp16_overflow.ipynb

Each notebook is executed top to bottom in its own folder (cells tagged ``raises-exception``
may raise). Then every output is removed except those of cells marked ``# NBVAL_CHECK_OUTPUT``:
their text output (and execution count, which nbval requires with it) is the reference that
``pytest --nbval-lax`` compares against, so it is kept. Widget state is always removed. ``--strip-only`` skips running
and only strips (it keeps whatever the checked cells hold).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
CHECK_MARKER = "# NBVAL_CHECK_OUTPUT"


def is_checked(cell: nbformat.NotebookNode) -> bool:
    """Whether nbval compares this cell's output with the stored one."""
    return cell.cell_type == "code" and any(
        line.strip() == CHECK_MARKER for line in cell.source.splitlines())


def strip(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Outputs only on checked cells; no execution counts, no widget state."""
    notebook.metadata.pop("widgets", None)
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        if not is_checked(cell):
            # nbval treats a cell with an execution count as run and one without as unrun, and
            # refuses an unrun cell that holds outputs: checked cells keep both.
            cell.execution_count = None
            cell.outputs = []
    return notebook


def execute(notebook: nbformat.NotebookNode, folder: Path) -> None:
    from nbclient import NotebookClient

    # The kernel must import this checkout's nanwidget whether or not it is installed.
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    NotebookClient(notebook, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(folder)}}).execute()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--strip-only", action="store_true", help="do not run, only strip")
    args = parser.parse_args(argv)
    paths = args.paths or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        notebook = nbformat.read(path, as_version=4)
        if not args.strip_only:
            print(f"running {path} ...", flush=True)
            execute(notebook, path.resolve().parent)
        nbformat.write(strip(notebook), path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``python -m nanwidget demo|report|bench|distcheck``.

Each subcommand lives in its own module of this package exposing ``add_arguments(parser)``
and ``run(args) -> int``; this file only dispatches.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from . import bench, demo, distcheck, report

COMMANDS: dict[str, tuple[ModuleType, str]] = {
    "demo": (demo, "train a built-in model until it diverges, catch the NaN, print the report"),
    "report": (report, "print the events and reports recorded in a log_dir"),
    "bench": (bench, "step-time ratios against the unwatched baseline and the peers"),
    "distcheck": (distcheck, "under torchrun: all-reduce, barrier and device check on every rank"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nanwidget",
                                     description="Find the first NaN/Inf in a PyTorch model.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m nanwidget`` and the ``nanwidget`` script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

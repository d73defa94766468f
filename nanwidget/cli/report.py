"""``python -m nanwidget report LOG_DIR``: print the early warnings, events and reports a log_dir
holds.

A recording may come from elsewhere: everything printed has its control characters escaped
(module names are whatever ``add_module`` accepted), and a folder that cannot be read ends
the command with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from ..core.persist import RunLoadError, load_run
from ..core.report import printable


def _say(text: str = "") -> None:
    print(printable(text))


def _fail(message: str) -> int:
    print(f"nanwidget report: {printable(message, keep_newlines=False)}", file=sys.stderr)
    return 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log_dir", metavar="LOG_DIR", help="directory given to watch(log_dir=...)")
    parser.add_argument("--rank", type=int, default=None, help="only this rank's events")


def run(args: argparse.Namespace) -> int:
    try:
        recording = load_run(args.log_dir)
    except RunLoadError as error:
        return _fail(str(error))
    if args.rank is not None and args.rank not in recording.ranks:
        held = ", ".join(str(r) for r in recording.ranks)
        return _fail(f"rank {args.rank} is not in the recording {recording.log_dir} (it holds "
                     f"rank{'s' if len(recording.ranks) > 1 else ''} {held})")
    events = [e for e in recording.events if args.rank is None or e.rank == args.rank]
    history = recording.history()
    batches = int(history["batch_end"].max()) + 1 if not history.empty else 0
    _say(f"nanwidget recording {recording.log_dir}: model {recording.model_class}, "
         f"ranks {recording.ranks} of world size {recording.world_size}, "
         f"{batches} batch(es) recorded, {len(events)} event(s)")
    for note in recording.notes:  # a rank not closed, events not kept: said, not an error
        _say(note)
    for warning in recording.warnings:  # early warnings: what came before the events
        if args.rank is None or warning.rank == args.rank:
            _say(str(warning))
    if not events:
        _say("No NaN/Inf recorded.")
        frames = recording.frames(rank=args.rank)
        if not frames.empty:
            _say()
            _say(recording.report())
        return 0
    for number, event in enumerate(events):
        _say()
        _say(f"=== event {number + 1} of {len(events)}: rank {event.rank}, batch {event.batch} ===")
        _say(recording.report(event))
    return 0

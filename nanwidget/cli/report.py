"""``python -m nanwidget report LOG_DIR``: print the events and reports a log_dir holds."""

from __future__ import annotations

import argparse
import sys

from ..core.persist import RunLoadError, load_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log_dir", metavar="LOG_DIR", help="directory given to watch(log_dir=...)")
    parser.add_argument("--rank", type=int, default=None, help="only this rank's events")


def run(args: argparse.Namespace) -> int:
    try:
        recording = load_run(args.log_dir)
    except RunLoadError as error:
        print(f"nanwidget report: {error}", file=sys.stderr)
        return 2
    events = [e for e in recording.events if args.rank is None or e.rank == args.rank]
    history = recording.history()
    batches = int(history["batch_end"].max()) + 1 if not history.empty else 0
    print(f"nanwidget recording {recording.log_dir}: model {recording.model_class}, "
          f"ranks {recording.ranks} of world size {recording.world_size}, "
          f"{batches} batch(es) recorded, {len(events)} event(s)")
    if not events:
        print("No NaN/Inf recorded.")
        frames = recording.frames(rank=args.rank)
        if not frames.empty:
            print()
            print(recording.report())
        return 0
    for number, event in enumerate(events):
        print()
        print(f"=== event {number + 1} of {len(events)}: rank {event.rank}, batch {event.batch} ===")
        print(recording.report(event))
    return 0

"""``packed-formats join``: write the index of a set whose parts were converted separately (``--part``)."""

from __future__ import annotations

import argparse

from ..writing.parts import join

HELP = "write the index of a sharded set whose parts were converted by separate tasks (convert --part)"
EXAMPLES = """examples:
  packed-formats join train.zip        # after: packed-formats convert images/ train.zip --shard-size N --part I/M

Each task of the set seals its parts; the last task to finish joins them itself, so join is needed
only when that task could not (it was cancelled after its parts were sealed).  Join refuses, naming
the part and the task to re-run, when a part is missing or not sealed, or was written from another
source, with other options or by another library version; nothing is written at DST then."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dst", metavar="DST", help="the set's index: the DST given to convert --part")
    parser.add_argument("--quiet", action="store_true", help="no summary line")


def run(args: argparse.Namespace) -> int:
    path = join(args.dst)
    if not args.quiet:
        print(f"joined {path}")
    return 0

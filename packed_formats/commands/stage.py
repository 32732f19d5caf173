"""``packed-formats stage``: copy an archive to node-local disk once per node, verified."""

from __future__ import annotations

import argparse
import os
import sys

from ..stage import default_stage_dir, stage_archive
from ..storage.urls import redact

HELP = "copy an archive to node-local disk (once per node, verified) and print its local path"

EXAMPLES = """\
examples:
  packed-formats stage /lustre/me/train.zip --to $TMPDIR
  LOCAL=$(packed-formats stage /lustre/me/train.zip)     # default --to: $SLURM_TMPDIR, $TMPDIR or /tmp
  srun --ntasks-per-node=4 packed-formats stage train.h5 --to /tmp   # 4 ranks, one copy per node

The local path is printed on stdout (progress on stderr), so scripts can capture it.
A --to folder that does not exist is created, and a note on stderr says so.
Concurrent calls wait for the one that copies; an identical existing copy is reused.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("archive", help="the archive to copy (file, or memmap directory)")
    parser.add_argument(
        "--to", metavar="DIR", default=None, help="node-local directory (default: $SLURM_TMPDIR, $TMPDIR or /tmp)"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS", help="give up waiting for another stager after this"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print only the local path")


def run(args: argparse.Namespace) -> int:
    directory = args.to or default_stage_dir()
    existed = os.path.isdir(directory)
    if not args.quiet:
        print(f"staging {redact(args.archive)} to {directory} ...", file=sys.stderr)
    result = stage_archive(args.archive, directory, timeout=args.timeout)
    if not existed and os.path.isdir(directory):  # a mistyped --to is a new folder: say so, even with --quiet
        print(f"packed-formats stage: note: {directory} did not exist: it was created", file=sys.stderr)
    if not args.quiet:
        if result.copied:
            rate = result.nbytes / max(result.seconds, 1e-9) / 1e6
            done = f"copied and verified {result.nbytes / 1e6:.1f} MB in {result.seconds:.1f} s ({rate:.0f} MB/s)"
        else:
            done = "reused the identical copy already there"
        print(done, file=sys.stderr)
    print(result.path)
    return 0

"""``packed-formats doctor``: what matters for loading speed and safety on this machine."""

from __future__ import annotations

import argparse
import json

from ..doctor import DEFAULT_BATCH, diagnose, format_report

HELP = "check this machine and a path for data-loading speed and safety, with advice"

EXAMPLES = """\
examples:
  packed-formats doctor                          # the current directory's file system and this machine
  packed-formats doctor /lustre/me/train.zip     # plus the archive's summary and page-cache fit
  packed-formats doctor $TMPDIR --json           # machine-readable, for scripts

It reports the file system (Lustre, GPFS, NFS, local, tmpfs, overlay) with staging
advice, usable CPUs and a suggested num_workers, libjpeg-turbo in Pillow and
torchvision, whether the C module that parts an image's channels was built,
/dev/shm against worker batches, free memory against the archive size, and
torch/CUDA versions.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", nargs="?", default=None, help="an archive or directory (default: current directory)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH, metavar="N", help="batch size to size /dev/shm needs for"
    )


def run(args: argparse.Namespace) -> int:
    if args.batch_size <= 0:
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
    report = diagnose(args.path, batch_size=args.batch_size)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0

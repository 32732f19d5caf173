"""``packed-formats verify``: check every sample of an archive."""

from __future__ import annotations

import argparse

from ..storage.urls import redact
from ..verify import verify_archive

HELP = ("check every sample's checksum, its ZIP records in a ZIP archive, and with --decode that every "
        "image decodes; exit 1 if any is bad")
EXAMPLES = """examples:
  packed-formats verify train.zip
  packed-formats verify train.lmdb --decode          # also decode every encoded sample
  packed-formats verify train.h5 --max-report 50 --quiet

exit status: 0 all samples good, 1 bad samples found (the first ones are listed by index and key),
2 the archive cannot be opened at all."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="archive to check")
    parser.add_argument("--decode", action="store_true",
                        help="also decode every encoded sample and image field (a mask) strictly, and check that "
                             "each image field is its image's size")
    parser.add_argument("--max-report", type=int, default=10, metavar="N", help="list at most N bad samples")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    report = verify_archive(args.path, decode=args.decode, max_report=max(0, args.max_report), progress=not args.quiet)
    for line in report.lines():
        print(redact(line))  # a URL is named without its credentials
    return 0 if report.ok else 1

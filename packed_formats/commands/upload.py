"""``packed-formats upload``: put a local archive or sharded set into object storage, readable by its URL."""

from __future__ import annotations

import argparse

from ..storage.upload import upload
from ..storage.urls import redact

HELP = "upload an archive or a sharded set to object storage (s3://, gs://...), its index last"

EXAMPLES = """\
examples:
  packed-formats upload train.zip s3://bucket/sets/train.zip     # a set: its parts, sample index, then index
  packed-formats upload val.h5 gs://bucket/val.h5

Each object is printed once it is in place (URLs without credentials); the set's index
comes last, so a reader never sees half a set.  Credentials come from the protocol's usual
configuration (AWS_ACCESS_KEY_ID..., a profile); AWS_ENDPOINT_URL points at another S3 store.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="the local archive, or a sharded set's index")
    parser.add_argument("url", help="where it goes (the set's index's URL for a set)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing")


def run(args: argparse.Namespace) -> int:
    def written(url: str) -> None:
        if not args.quiet:
            print(redact(url), flush=True)

    upload(args.source, args.url, on_object=written)
    return 0

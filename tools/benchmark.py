#!/usr/bin/env python
"""Same as ``packed-formats bench``: python tools/benchmark.py ARCHIVE_OR_FOLDER... [options]."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from packed_formats.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench"] + sys.argv[1:]))

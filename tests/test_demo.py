"""The demo (``python tools/demo.py``, the README's first archive) runs and prints a row for every archive."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import packed_formats as pf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"^(\w+)\s+(raw|encoded)\s+.+?\s+[\d.]+ MiB\s+(\d+)\s+(\d+|-)\s+[\d.]+x$")


def test_the_demo_packs_every_format_and_times_every_archive_batched(tmp_path):
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "demo.py"), "--root", str(tmp_path),
         "--images-per-class", "3", "--workers", "0", "--size", "48", "--batch-size", "4"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    rows = {(m[1], m[2]): m[4] for m in map(ROW.match, run.stdout.splitlines()) if m}
    expected = {("folder", "encoded")} | {(f, mode) for f in pf.PACKED_FORMATS for mode in ("raw", "encoded")}
    assert set(rows) == expected, run.stdout
    assert rows.pop(("folder", "encoded")) == "-"
    assert all(rate.isdigit() and int(rate) > 0 for rate in rows.values()), run.stdout
    assert "decoded to 48x48" in run.stdout

"""The free-space check covers what each format really writes: with 20% more room than the estimate a
conversion succeeds; with less than the estimate, the check refuses it before anything is written.

The room is real: a tmpfs of the wanted size, mounted in a private mount namespace (``unshare``) that
goes away with the conversion's process.  Where that is not allowed the tests are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.sources import open_source
from packed_formats.writing.convert import _recipe, estimated_archive_bytes

from .conftest import CLASSES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = (40, 40)

CONVERT = """
import json, sys
import packed_formats as pf
src, dst, fmt, mode, shard = sys.argv[1:6]
size = (40, 40) if mode == "raw" else None
try:
    pf.convert(src, dst, format=fmt, mode=mode, size=size, workers=1, quiet=True, shard_size=int(shard) or None)
    result = {"ok": len(pf.PackedDataset(dst))}
except pf.PackedFormatError as exc:
    result = {"error": type(exc).__name__, "message": str(exc)}
print("RESULT " + json.dumps(result))
"""


def convert_with_room(tmp_path, src: str, fmt: str, mode: str, room: int, shard: int = 0) -> dict:
    """Convert ``src`` onto a file system of ``room`` bytes (a tmpfs, rounded up to pages), in a child."""
    mount = tmp_path / "room"
    mount.mkdir(exist_ok=True)
    kib = -(-room // 4096) * 4
    script = (f'mount -t tmpfs -o size={kib}k tmpfs "$1" && shift && exec "$@"')
    command = ["unshare", "-Urm", "sh", "-c", script, "sh", str(mount), sys.executable, "-c", CONVERT,
               src, str(mount / f"out.{fmt}"), fmt, mode, str(shard)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def can_mount(tmp_path_factory):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare command to mount a small file system with")
    where = tmp_path_factory.mktemp("probe")
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", f'mount -t tmpfs -o size=64k tmpfs "{where}"'],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private namespace here: {probe.stderr.strip()}")


def estimate(src: str, fmt: str, mode: str, shard: int = 0) -> int:
    source = open_source(src)
    try:
        recipe = _recipe(source, mode, SIZE if mode == "raw" else None, None, None, None)
        return estimated_archive_bytes(source, recipe, fmt, shard or None)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


@pytest.mark.slow
@pytest.mark.parametrize("mode, shard", [("raw", 0), ("encoded", 0), ("raw", 10)], ids=["raw", "encoded", "sharded"])
@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_the_space_check_is_what_refuses_and_its_room_suffices(can_mount, tmp_path, image_folder, fmt, mode, shard):
    needed = estimate(image_folder, fmt, mode, shard)
    assert convert_with_room(tmp_path, image_folder, fmt, mode, needed * 6 // 5, shard) == {"ok": 8 * len(CLASSES)}
    refused = convert_with_room(tmp_path, image_folder, fmt, mode, needed * 9 // 10, shard)
    assert refused["error"] == "InsufficientSpaceError", refused
    assert "not enough space to write" in refused["message"] and f"({needed} bytes)" in refused["message"], refused


def test_the_estimate_covers_the_archive_written(tmp_path, image_folder, packed_kind):
    """Without a space limit: the estimate is at least the archive's size, in whole blocks."""
    fmt, mode = packed_kind
    dst = tmp_path / f"out.{fmt}"
    pf.convert(image_folder, dst, format=fmt, mode=mode, size=SIZE if mode == "raw" else None, workers=1, quiet=True)
    taken = sum(-(-size // 4096) * 4096 for _, size in pf.space.archive_files(str(dst)))
    assert taken <= estimate(image_folder, fmt, mode) <= 4 * taken + (1 << 20)


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_the_space_estimate_counts_the_bytes_of_every_samples_fields(tmp_path, fmt):
    from PIL import Image

    from packed_formats.space import disk_usage

    root = tmp_path / "tree"
    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
            (root / name / f"{i}.bin").write_bytes(rng.bytes(100_000))  # what the images alone would never cover
    source = open_source(str(root), fields=["bin=bytes"])
    try:
        recipe = _recipe(source, "encoded", None, "stretch", "jpeg", 90)
        estimate = estimated_archive_bytes(source, recipe, fmt)
        without = estimated_archive_bytes(open_source(str(root)), recipe, fmt)
    finally:
        source.close()
    out = tmp_path / f"out.{fmt}"
    pf.convert(root, out, format=fmt, fields=["bin=bytes"], quiet=True, workers=1)
    assert estimate - without >= 8 * 100_000
    assert disk_usage(str(out)) <= estimate

"""Writers hold about one index's bytes at any number of samples, and never import torch.

Each check runs in a fresh interpreter: what a process has imported, and its
peak resident memory (VmHWM, restarted with /proc/self/clear_refs), are only
meaningful in a process of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import packed_formats as pf
from packed_formats.bench import scale

MIB = 2**20


def run_python(code: str, *args: str, timeout: float = 600) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def peak_can_be_reset() -> bool:
    return run_python("from packed_formats.bench.scale import reset_peak; print(reset_peak())").strip() == "True"


NO_TORCH = """
    import importlib.abc, os, sys

    attempts = []

    class NoTorch(importlib.abc.MetaPathFinder):  # inherited by the conversion's forked workers
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "torchvision"):
                attempts.append(name)
                raise ImportError(f"{name} imported on the writing side")
            return None

    sys.meta_path.insert(0, NoTorch())

    import numpy as np

    import packed_formats as pf
    from packed_formats.cli import main
    from packed_formats.synthetic import make_image_folder

    root = sys.argv[1]
    src = make_image_folder(os.path.join(root, "src"), images_per_class=3, classes=("a", "b"), sizes=(20, 40))
    for fmt in pf.PACKED_FORMATS:
        for mode in ("raw", "encoded"):
            dst = os.path.join(root, f"{mode}.{fmt}")
            pf.convert(src, dst, mode=mode, size=16 if mode == "raw" else None, workers=2, quiet=True)
            with pf.open_archive(dst) as reader:
                reader.read(0)
                reader.read(len(reader) - 1)
                batch = reader.read_many([len(reader) - 1, 0, 0])  # raw: gathered from the map, with numpy
                assert np.array_equal(batch[1], reader.read(0)) if mode == "raw" else batch[1] == reader.read(0)
            assert pf.verify_archive(dst).ok
            assert main(["info", dst]) == 0 and main(["verify", dst]) == 0
    sharded = os.path.join(root, "set.zip")
    assert main(["convert", src, sharded, "--size", "24", "--shard-size", "4", "--workers", "2", "--quiet"]) == 0
    raw_set = os.path.join(root, "raw-set.zip")
    assert main(["convert", src, raw_set, "--mode", "raw", "--size", "24", "--shard-size", "4", "--quiet"]) == 0
    with pf.open_archive(raw_set) as reader:
        assert reader.read_many([len(reader) - 1, 0]).shape == (2, 24, 24, 3)
    with pf.open_writer(os.path.join(root, "written.lmdb"), mode="raw", shape=(4, 4, 3)) as writer:
        writer.add(np.zeros((4, 4, 3), np.uint8), 0)
    assert not attempts, attempts
    assert "torch" not in sys.modules
    print("torch was never imported")
"""


def test_converting_writing_and_reading_never_import_torch(tmp_path):
    """torch costs ~0.5 GiB of resident memory and seconds to import: writers, the converter and
    its workers, the decode check, info/verify, single reads and ``read_many`` (a numpy batch,
    gathered from a map with numpy where torch is not loaded) must work without it."""
    assert "torch was never imported" in run_python(NO_TORCH, str(tmp_path))


BUILDER_PEAK = """
    import sys
    from packed_formats.bench.scale import reset_peak, status_bytes
    from packed_formats.index import IndexBuilder

    count = int(sys.argv[1])
    builder = IndexBuilder(offsets=True, positions=True)
    before = status_bytes("VmRSS")
    assert reset_peak()
    for i in range(count):
        builder.append(i % 10, f"class{i % 10}/img_{i:08d}.png", i, 48, 100 * i)
    index = builder.build()
    peak = status_bytes("VmHWM") - before
    print(peak, sum(a.nbytes for a in index.arrays().values()))
"""


def test_the_index_builder_peaks_at_about_the_bytes_of_the_index_it_builds():
    """Blocks, never a copy to grow, and each array made once as the blocks are released: about
    1.1-1.4x the index at its peak (doubling numpy columns, then copying them, took 2.7-3.8x)."""
    if not peak_can_be_reset():
        pytest.skip("this kernel does not let a process restart its peak RSS (/proc/self/clear_refs)")
    peak, index_bytes = map(int, run_python(BUILDER_PEAK, "200000").split())
    assert index_bytes == 200_000 * (8 + 23 + 4 + 8 + 8) + 8
    assert peak <= 1.6 * index_bytes + 4 * MIB, f"peak {peak / MIB:.1f} MiB for an index of {index_bytes / MIB:.1f} MiB"


WRITE_COUNT = 500_000


@pytest.mark.slow
@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_a_writer_peaks_at_about_its_index_not_at_python_objects_per_sample(tmp_path, fmt):
    """WRITE_COUNT tiny samples written in a fresh process (``bench --scale``'s write probe): the
    peak above the process's size before writing stays within 1.5x the index plus a fixed 32 MiB
    (HDF5's metadata cache, LMDB's map of the pages just written).  A Python object per sample,
    a second copy of the index or the writer's columns growing by doubling would exceed it."""
    if not peak_can_be_reset():
        pytest.skip("this kernel does not let a process restart its peak RSS (/proc/self/clear_refs)")
    path = str(tmp_path / f"a.{fmt}")
    args = {"format": fmt, "path": path, "count": WRITE_COUNT, "shape": [4, 4, 3], "shards": None}
    written = scale.run_probe("write", args, timeout=900)
    with pf.open_archive(path) as reader:
        assert len(reader) == WRITE_COUNT
        index_bytes = sum(a.nbytes for a in reader.index.arrays().values())
    growth = written["peak_growth_bytes"]
    assert growth <= 1.5 * index_bytes + 32 * MIB, (
        f"{fmt}: the writer's peak grew {growth / MIB:.1f} MiB for an index of {index_bytes / MIB:.1f} MiB "
        f"({json.dumps(written)})")
    assert written["baseline_rss_bytes"] < 256 * MIB, "the writing process imported torch (or more)"

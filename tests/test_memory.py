"""Copy-on-read: forked workers that touch the whole index must not copy it."""

from __future__ import annotations

import json
import multiprocessing
import os
import zlib

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.index import encode_keys

N = 2_000_000
LIMIT_MIB = 20


def private_dirty_mib() -> float:
    with open("/proc/self/smaps_rollup") as file:
        for line in file:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no Private_Dirty in smaps_rollup")


@pytest.fixture(scope="module")
def huge_index_archive(tmp_path_factory):
    """A 2M-sample memmap archive (1x1x1 images) laid out with plain numpy: the format is just .npy files."""
    path = tmp_path_factory.mktemp("huge") / "huge.memmap"
    path.mkdir()
    pixels = (np.arange(N) % 251).astype(np.uint8).reshape(N, 1, 1, 1)
    np.save(path / "images.npy", pixels)
    np.save(path / "labels.npy", np.arange(N, dtype=np.int64) % 1000)
    np.save(path / "keys.npy", encode_keys([f"class_{i % 1000}/img_{i:08d}.jpg" for i in range(N)]))
    np.save(path / "crc32.npy", np.array([zlib.crc32(bytes([v])) for v in range(251)], np.uint32)[np.arange(N) % 251])
    manifest = pf.ArchiveManifest(
        format="memmap", mode="raw", count=N, classes=tuple(str(c) for c in range(1000)), shape=(1, 1, 1)
    )
    (path / "manifest.json").write_text(manifest.to_json())
    # Written back now: a mapped index page still dirty in the page cache counts as the mapping
    # process's Private_Dirty, though it is the file's, not a private copy.
    os.sync()
    return str(path)


def touch_everything(dataset, use_list, queue):
    keys = [dataset.key(i) for i in range(len(dataset))] if use_list else None
    labels = dataset.targets.tolist() if use_list else None
    before = private_dirty_mib()
    total = 0
    for i in range(len(dataset)):
        if use_list:
            total += labels[i] + len(keys[i])
        else:
            total += int(dataset.targets[i]) + len(dataset.reader.index.keys[i])
    queue.put(private_dirty_mib() - before)


def growth_in_forked_child(dataset, use_list: bool) -> float:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=touch_everything, args=(dataset, use_list, queue))
    child.start()
    growth = queue.get(timeout=300)
    child.join()
    return growth


@pytest.mark.slow
def test_forked_worker_touching_a_2m_index_stays_small(huge_index_archive):
    dataset = pf.PackedDataset(huge_index_archive)
    assert len(dataset) == N and dataset.key(N - 1) == f"class_999/img_{N - 1:08d}.jpg"
    assert dataset[N - 1][1] == (N - 1) % 1000
    growth = growth_in_forked_child(dataset, use_list=False)
    assert growth < LIMIT_MIB, json.dumps({"private_dirty_growth_mib": growth})


@pytest.mark.slow
def test_the_measurement_sees_copy_on_read_of_python_lists(huge_index_archive):
    """Control: the same scan over Python lists built before the fork does copy pages."""
    dataset = pf.PackedDataset(huge_index_archive)
    ctx = multiprocessing.get_context("fork")
    keys = [dataset.key(i) for i in range(N)]
    queue = ctx.Queue()

    def scan():
        before = private_dirty_mib()
        total = sum(len(k) for k in keys)
        queue.put((private_dirty_mib() - before, total))

    child = ctx.Process(target=scan)
    child.start()
    growth, _ = queue.get(timeout=300)
    child.join()
    assert growth > LIMIT_MIB


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux smaps_rollup")
def test_smaps_rollup_is_available():
    assert private_dirty_mib() > 0

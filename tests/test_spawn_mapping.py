"""A reader sent to a spawn or forkserver worker maps its index again instead of pickling it.

Under fork a worker shares the parent's index pages; under spawn and
forkserver (Python 3.14's default) it receives the Reader by pickle, and a
pickled index would be a private copy of every array in every worker.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.errors import ArchiveChangedError

MAPPED_FORMATS = ("zip", "hdf5", "lmdb", "memmap")


def _write(path, fmt: str, count: int, overwrite: bool = False) -> str:
    rng = np.random.default_rng(count)
    options = dict(format=fmt, mode="raw", shape=(2, 2, 1), classes=("a", "b"), overwrite=overwrite)
    with pf.open_writer(path, **options) as writer:
        for i in range(count):
            writer.add(rng.integers(0, 256, (2, 2, 1), dtype=np.uint8), i % 2, f"class/{i:07d}.png")
    return os.fspath(path)


@pytest.mark.parametrize("fmt", MAPPED_FORMATS)
def test_pickled_reader_does_not_grow_with_the_index(tmp_path, fmt):
    small = pf.open_archive(_write(tmp_path / f"small.{fmt}", fmt, 50))
    large = pf.open_archive(_write(tmp_path / f"large.{fmt}", fmt, 20_000))
    assert large.index.mapped(), "the index should be a map of the archive file"
    sizes = len(pickle.dumps(small)), len(pickle.dumps(large))
    assert sizes[1] < sizes[0] + 1024, f"pickled size grows with the index: {sizes}"
    copy = pickle.loads(pickle.dumps(large))
    assert copy.index.mapped()
    for i in (0, 7, 19_999):
        assert np.array_equal(copy.read(i), large.read(i)) and copy.key(i) == large.key(i)
    assert np.array_equal(copy.labels, large.labels)


@pytest.mark.parametrize("fmt", MAPPED_FORMATS)
def test_a_replaced_archive_is_not_mapped_in_its_place(tmp_path, fmt):
    path = _write(tmp_path / f"a.{fmt}", fmt, 30)
    state = pickle.dumps(pf.open_archive(path))
    _write(path, fmt, 40, overwrite=True)  # what `convert --overwrite` does
    with pytest.raises(ArchiveChangedError, match="replaced or modified"):
        pickle.loads(state)


def _sum_in_child(reader, queue) -> None:
    queue.put((len(reader), int(reader.read_many(np.arange(len(reader))).sum())))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_spawned_child_reads_through_the_mapped_index(tmp_path, method):
    reader = pf.open_archive(_write(tmp_path / "a.zip", "zip", 500))
    context = multiprocessing.get_context(method)
    queue = context.Queue()
    child = context.Process(target=_sum_in_child, args=(reader, queue))
    child.start()
    try:
        got = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
    assert got == (500, int(reader.read_many(np.arange(500)).sum()))


# ---- a sharded archive: its index is its parts' own, joined, never concatenated --------------------------
def _write_sharded(path, fmt: str, count: int, parts: int) -> str:
    from packed_formats.backends.sharded import ShardedWriter

    rng = np.random.default_rng(count)
    size = -(-count // parts)
    with ShardedWriter(path, fmt, shard_size=size, mode="raw", shape=(2, 2, 1), classes=("a", "b")) as writer:
        for i in range(count):
            writer.add(rng.integers(0, 256, (2, 2, 1), dtype=np.uint8), i % 2, f"class/{'x' * (i // size)}{i:07d}.png")
    return os.fspath(path)


@pytest.mark.parametrize("fmt", ["zip", "memmap"])
def test_a_pickled_sharded_reader_does_not_grow_with_the_index(tmp_path, fmt):
    small = pf.open_archive(_write_sharded(tmp_path / f"small.{fmt}", fmt, 40, parts=4))
    large = pf.open_archive(_write_sharded(tmp_path / f"large.{fmt}", fmt, 20_000, parts=4))
    assert all(part.index.mapped() for part in large.backend.parts)
    sizes = len(pickle.dumps(small)), len(pickle.dumps(large))
    assert sizes[1] < sizes[0] + 2048, f"pickled size grows with the index: {sizes}"
    copy = pickle.loads(pickle.dumps(large))
    for i in (0, 4_999, 5_000, 19_999):
        assert np.array_equal(copy.read(i), large.read(i)) and copy.key(i) == large.key(i)
    assert np.array_equal(copy.labels, large.labels) and np.array_equal(copy.index.crc32, large.index.crc32)


def test_a_sharded_index_holds_no_copy_of_its_parts_arrays(tmp_path):
    reader = pf.open_archive(_write_sharded(tmp_path / "a.zip", "zip", 3_000, parts=3))
    for name in ("labels", "keys", "crc32"):
        joined = getattr(reader.index, name)
        assert joined.nbytes >= 3_000 and len(joined) == 3_000
        assert all(a is b for a, b in zip(joined.parts, (getattr(p.index, name) for p in reader.backend.parts)))
    # keys are as wide as each part's longest: the joined keys read back whole in every part
    assert [reader.key(i) for i in (0, 999, 1_000, 2_999)] == [
        "class/0000000.png", "class/0000999.png", "class/x0001000.png", "class/xx0002999.png"]
    dataset = pf.PackedDataset(reader)
    assert np.array_equal(np.asarray(dataset.loader("class/xx0002500.png")), np.asarray(dataset.loader(2_500)))


@pytest.mark.parametrize("method", ["spawn"])
def test_spawned_workers_of_a_sharded_archive_read_right_samples_and_labels(tmp_path, method):
    path = _write_sharded(tmp_path / "a.lmdb", "lmdb", 600, parts=5)
    reader = pf.open_archive(path)
    loader = pf.make_loader(reader, batch_size=64, num_workers=2, shuffle=True, multiprocessing_context=method)
    seen = []
    for images, labels in loader:
        for image, label in zip(images.permute(0, 2, 3, 1).numpy(), labels.tolist()):
            seen.append((image.tobytes(), label))
    expected = sorted((reader.read(i).tobytes(), i % 2) for i in range(600))
    assert sorted(seen) == expected

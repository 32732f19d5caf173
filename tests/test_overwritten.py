"""An archive rewritten in place under a live reader (same file, same size) is caught, never read as the other.

``cp other.zip train.zip`` while a notebook or a job reads ``train.zip`` keeps the file (its inode) and, for
two raw archives of one count and shape, its size: only its modification time tells.  Each read and each
batch checks it first (``Reader.check_unchanged``), in the main process and in DataLoader workers alike.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

import packed_formats as pf
from packed_formats import codecs
from packed_formats.backends.sharded import file_digest, index_text
from packed_formats.manifest import part_of_set

FORMATS = ("zip", "hdf5", "lmdb", "memmap")
SHAPE = (8, 8, 3)
COUNT = 12
CLASSES = ("a", "b", "c")
HOUR_NS = 3_600 * 10**9
SET_ID = "0123456789abcdef"

_rng = np.random.default_rng(0)
PIXELS = [_rng.integers(0, 256, SHAPE, dtype=np.uint8) for _ in range(COUNT)]
PNGS = [codecs.encode(pixels, "png") for pixels in PIXELS]


def write(path: str, fmt: str, mode: str, samples, first_key: int = 0, part=None) -> str:
    """An archive of the given samples (indices into PIXELS, each keeping its label), keyed by place
    (``part``: part ``part`` of the set SET_ID)."""
    with part_of_set(SET_ID, part) if part is not None else contextlib.nullcontext():
        with pf.open_writer(path, fmt, mode=mode, shape=SHAPE, classes=CLASSES) as writer:
            for k, j in enumerate(samples, start=first_key):
                writer.add(PIXELS[j] if mode == "raw" else PNGS[j], int(j) % len(CLASSES), f"k{k}")
    return path


def archive_files(path: str):
    with pf.open_archive(path) as reader:
        return reader.files()


def sizes(path: str):
    return [os.path.getsize(f) for f in archive_files(path)]


PARTS = {0: [range(COUNT)], 4: [range(0, 4), range(4, 8), range(8, COUNT)]}  # samples of each part


def same_size_pair(root, fmt: str, mode: str, shard_size: int = 0):
    """Archives A and B, both at .../train, B's files each the size of A's and its samples those of A in
    another order (with their labels): an archive of one file, or a sharded set (parts train-00000...).
    The manifest's checksums are decimal numbers whose length varies: a few orders are tried for each file."""
    a, b = os.fspath(root / "a" / "train"), os.fspath(root / "b" / "train")
    names = []
    for p, samples in enumerate(PARTS[shard_size]):
        name = f"train-{p:05d}" if shard_size else "train"
        names.append((name, len(samples)))
        place = p if shard_size else None
        write(os.path.join(root, "a", name), fmt, mode, list(samples), samples.start, place)
        for seed in range(1, 100):
            order = [samples.start + int(j) for j in np.random.default_rng(seed).permutation(len(samples))]
            if order == list(samples):
                continue
            candidate = write(os.path.join(root, "b", f"{seed}-{name}"), fmt, mode, order, samples.start, place)
            if sizes(candidate) == sizes(os.path.join(root, "a", name)):
                os.rename(candidate, os.path.join(root, "b", name))
                break
        else:
            raise AssertionError(f"no {fmt} {mode} archive the size of {name} found")
    if shard_size:  # each set's index records its own parts' content digests
        for path in (a, b):
            folder = os.path.dirname(path)
            with open(path, "w") as file:
                file.write(index_text(fmt, [(n, c, file_digest(os.path.join(folder, n), fmt)) for n, c in names],
                                      SET_ID))
    return a, b


@pytest.fixture
def root(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    return tmp_path


def backdate(path: str) -> None:
    """Set the archive's files an hour back, as an archive written well before it is read (and so that the
    rewrite below changes their modification time on any file system's clock granularity)."""
    for name in archive_files(path):
        st = os.stat(name)
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns - HOUR_NS))


def overwrite_in_place(a: str, b: str) -> None:
    """Write each file of B over the same file of A, as ``cp`` does: same inode, same size."""
    for target, source in zip(archive_files(a), archive_files(b)):
        with open(source, "rb") as src, open(target, "r+b") as dst:
            dst.write(src.read())
            dst.truncate()


def everything(dataset):
    return [(np.asarray(image).tobytes(), int(label)) for image, label in dataset.__getitems__(range(len(dataset)))]


SHARDING = [0, 4]


@pytest.mark.parametrize("shard_size", SHARDING, ids=["one-file", "sharded"])
@pytest.mark.parametrize("mode", ["raw", "encoded"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_archive_rewritten_in_place_is_caught_at_the_next_read(root, fmt, mode, shard_size):
    a, b = same_size_pair(root, fmt, mode, shard_size)
    backdate(a)
    files, other = archive_files(a), everything(pf.PackedDataset(b, output="numpy"))
    dataset = pf.PackedDataset(a, output="numpy")
    before = everything(dataset)  # every part opened and mapped
    assert before != other
    overwrite_in_place(a, b)
    assert [os.path.getsize(f) for f in files] == sizes(b)
    with pytest.raises(pf.ArchiveChangedError, match=r"train.*rewritten in place.*same size") as caught:
        everything(dataset)
    assert "train" in caught.value.path and "open the dataset again" in str(caught.value)
    with pytest.raises(pf.ArchiveChangedError):
        dataset[COUNT - 1]
    with pytest.raises(pf.ArchiveChangedError):
        dataset.reader.read_bytes(0)
    # a dataset opened now, in this process (the old one still alive), reads the archive as it is
    assert everything(pf.PackedDataset(a, output="numpy")) == other


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_archive_grown_or_truncated_in_place_is_caught(root, fmt):
    a = write(os.fspath(root / "a" / "train"), fmt, "raw", range(COUNT))
    data_file = pf.open_archive(a).backend.data_file()
    for change in ("grow", "truncate"):
        dataset = pf.PackedDataset(a, output="numpy")
        before = everything(dataset)
        size = os.path.getsize(data_file)
        with open(data_file, "r+b") as file:
            if change == "grow":
                file.seek(0, os.SEEK_END)
                file.write(b"\0" * 4096)
            else:
                file.truncate(size - 1)
        with pytest.raises(pf.ArchiveChangedError, match="its size went from"):
            everything(dataset)
        with open(data_file, "r+b") as file:  # back as it was, for the next change
            file.truncate(size)
        if change == "grow":
            assert everything(pf.PackedDataset(a, output="numpy")) == before


def test_one_memmap_index_file_rewritten_in_place_is_caught_and_named(root):
    """memmap is a directory of files mapped separately: the labels alone rewritten must not pass."""
    a = write(os.fspath(root / "a" / "train"), "memmap", "raw", range(COUNT))
    backdate(a)
    dataset = pf.PackedDataset(a, output="numpy")
    everything(dataset)
    labels = os.path.join(a, "labels.npy")
    np.save(labels + ".new.npy", (np.load(labels) + 1) % len(CLASSES))
    with open(labels + ".new.npy", "rb") as src, open(labels, "r+b") as dst:
        dst.write(src.read())
    with pytest.raises(pf.ArchiveChangedError, match=r"its file labels\.npy was rewritten in place"):
        everything(dataset)


@pytest.mark.parametrize("fmt", FORMATS)
def test_changes_that_leave_the_bytes_alone_do_not_stop_a_reader(root, fmt):
    """chmod, a hard link or a rename change a file's status-change time, not what it holds: no error;
    nor a move of the whole archive (the reader keeps the files it has open or mapped, as after os.replace)."""
    a = write(os.fspath(root / "a" / "train"), fmt, "raw", range(COUNT))
    dataset = pf.PackedDataset(a, output="numpy")
    before = everything(dataset)
    for name in archive_files(a):
        os.chmod(name, 0o444)
        os.link(name, name + ".link")
    assert everything(dataset) == before
    os.rename(a, a + ".moved")
    assert everything(dataset) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_change_is_caught_by_a_reader_that_has_not_read_yet(root, fmt):
    """Opened, rewritten, then read for the first time (a worker's first batch): the handle is not opened."""
    a, b = same_size_pair(root, fmt, "raw")
    backdate(a)
    dataset = pf.PackedDataset(a, output="numpy")
    overwrite_in_place(a, b)
    with pytest.raises(pf.ArchiveChangedError):
        everything(dataset)


# ---- in DataLoader workers -------------------------------------------------------------------------------------
def error_of(loader):
    """(class, message, path) of the error an epoch of ``loader`` raises, or None; the exception itself is not
    kept (its traceback would hold the loader's iterator, and its workers, alive)."""
    try:
        for _ in loader:
            pass
    except pf.PackedFormatError as exc:
        return type(exc), str(exc), exc.path
    return None


@pytest.mark.slow
@pytest.mark.parametrize("shard_size", SHARDING, ids=["one-file", "sharded"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_persistent_workers_catch_an_archive_rewritten_between_epochs(root, fmt, shard_size):
    a, b = same_size_pair(root, fmt, "raw", shard_size)
    backdate(a)
    dataset = pf.PackedDataset(a, output="tensor")
    loader = torch.utils.data.DataLoader(dataset, batch_size=3, num_workers=2, persistent_workers=True,
                                         multiprocessing_context="fork")
    first = [batch[1].tolist() for batch in loader]  # each worker has opened (and mapped) the archive
    assert sum(first, []) == [i % len(CLASSES) for i in range(COUNT)]
    overwrite_in_place(a, b)
    kind, message, path = error_of(loader)
    assert kind is pf.ArchiveChangedError and "rewritten in place" in message and "train" in path


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["zip", "memmap"])  # a descriptor to fstat; files stat'ed by path (~10 s each)
def test_spawned_workers_and_make_loader_catch_an_archive_rewritten_in_place(root, fmt):
    a, b = same_size_pair(root, fmt, "raw", shard_size=4)
    backdate(a)
    loader = pf.make_loader(a, batch_size=4, shuffle=False, num_workers=1, multiprocessing_context="spawn")
    assert sum((labels.tolist() for _, labels in loader), []) == [i % len(CLASSES) for i in range(COUNT)]
    overwrite_in_place(a, b)
    kind, message, _ = error_of(loader)
    assert kind is pf.ArchiveChangedError and "rewritten in place" in message

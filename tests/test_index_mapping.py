"""HDF5, LMDB and memmap archives open with their index mapped from the file, never loaded.

Opening costs the same at any number of samples and no process holds a
private copy of the index: its arrays are maps of the archive's own file
(HDF5's contiguous datasets, LMDB's records, memmap's .npy files), checked
against the manifest like loaded ones.  HDF5 raw archives store each
image's chunk address at write time, so readers never list HDF5's chunks.
"""

from __future__ import annotations

import os
import pickle
import tracemalloc

import h5py
import lmdb
import numpy as np
import pytest

import packed_formats as pf
from packed_formats import codecs
from packed_formats.backends import hdf5, mapped
from packed_formats.checksum import crc32

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's maps (Linux)")

FORMATS = ("hdf5", "lmdb", "memmap")
MODES = ("raw", "encoded")
SHAPE = (2, 3, 3)
COUNT = 1000  # enough that LMDB keeps every index record on overflow pages


def samples(count: int, mode: str, shape=SHAPE, key_width: int = 0):
    """(stored bytes, label, key) of ``count`` distinct small samples: raw pixels or PNG files."""
    rng = np.random.default_rng(count)
    out = []
    for i in range(count):
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        stored = pixels.tobytes() if mode == "raw" else codecs.encode(pixels, "png")
        out.append((stored, i % 3, f"class{i % 3}/{'k' * key_width}{i:06d}.png"))
    return out


def write(path, fmt: str, mode: str, written, shape=SHAPE) -> str:
    with pf.open_writer(path, format=fmt, mode=mode, shape=shape, classes=("a", "b", "c")) as writer:
        for stored, label, key in written:
            writer.add(np.frombuffer(stored, np.uint8).reshape(shape) if mode == "raw" else stored, label, key)
    return os.fspath(path)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{(format, mode): (path, samples)} of COUNT samples each."""
    root = tmp_path_factory.mktemp("mapped-index")
    made = {}
    for mode in MODES:
        contents = samples(COUNT, mode)
        for fmt in FORMATS:
            made[(fmt, mode)] = (write(root / f"a-{mode}.{fmt}", fmt, mode, contents), contents)
    return made


def mapped_file(array: np.ndarray) -> "str | None":
    """The file whose map holds ``array``'s memory, from this process's maps (None: not file-backed)."""
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return os.path.realpath(fields[5].strip()) if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def index_file(reader: pf.Reader, name: str) -> str:
    """The file that holds index array ``name``: the data file, or memmap's own .npy per array."""
    if reader.format_name == "memmap":
        return os.path.realpath(os.path.join(reader.path, f"{name}.npy"))
    return os.path.realpath(reader.backend.data_file())


def check_index(reader: pf.Reader, contents) -> None:
    """The index arrays hold what was written."""
    np.testing.assert_array_equal(reader.index.labels, [label for _, label, _ in contents])
    assert [reader.key(i) for i in range(len(reader))] == [key for _, _, key in contents]
    np.testing.assert_array_equal(reader.index.crc32, [crc32(stored) for stored, _, _ in contents])
    if reader.mode == "encoded":
        np.testing.assert_array_equal(np.diff(reader.index.offsets), [len(stored) for stored, _, _ in contents])


# ---- every index array is a map of the archive's file ------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_index_arrays_are_maps_of_the_archive_file(written, fmt, mode):
    path, contents = written[(fmt, mode)]
    with pf.open_archive(path) as reader:
        arrays = reader.index.arrays()
        assert {"labels", "keys", "crc32"} <= set(arrays)
        for name, array in arrays.items():
            assert mapped_file(array) == index_file(reader, name), f"{name} is not mapped from its file"
            assert not array.flags.writeable
        check_index(reader, contents)
        batch = reader.read_many([COUNT - 1, 0])
        assert [bytes(sample) for sample in batch] == [contents[-1][0], contents[0][0]]


@pytest.mark.parametrize(
    "depth, count, shape, key_width",
    [(1, 40, (1, 1, 1), 120), (2, COUNT, (1, 1, 1), 0), (3, COUNT, (32, 32, 1), 0)],
    ids=["1-level", "2-levels", "3-levels"],
)
def test_lmdb_index_records_are_found_at_every_depth_of_the_b_tree(tmp_path, depth, count, shape, key_width):
    contents = samples(count, "raw", shape, key_width)
    path = write(tmp_path / "a.lmdb", "lmdb", "raw", contents, shape)
    env = lmdb.open(path, subdir=False, readonly=True, lock=False)
    try:
        assert env.stat()["depth"] == depth  # the premise: a tree of this many levels
        page = env.stat()["psize"]
    finally:
        env.close()
    with pf.open_archive(path) as reader:
        check_index(reader, contents)
        arrays = reader.index.arrays()
        assert max(a.nbytes for a in arrays.values()) > page  # on overflow pages: more than one
        if depth == 1:  # few samples: small records sit in the leaf page, beside the samples
            assert min(a.nbytes for a in arrays.values()) < page // 4
        for name, array in arrays.items():
            assert mapped_file(array) == index_file(reader, name), f"{name} is not mapped from its file"


# ---- HDF5: chunk addresses stored at write time -----------------------------------------------------------
def count_chunk_listings(monkeypatch) -> list:
    """Record every listing of an HDF5 dataset's chunks (a pass over its whole chunk index)."""
    listings: list = []
    original = hdf5._chunk_positions

    def counted(data):
        listings.append(data.name)
        return original(data)

    monkeypatch.setattr(hdf5, "_chunk_positions", counted)
    return listings


def test_hdf5_raw_reads_map_the_stored_positions_without_listing_chunks(written, monkeypatch):
    path, contents = written[("hdf5", "raw")]
    listings = count_chunk_listings(monkeypatch)
    with pf.open_archive(path) as reader:
        assert reader.index.positions is not None and len(reader.index.positions) == COUNT
        batch = reader.read_many([COUNT - 1, 0, 500])
        assert isinstance(reader.handle().rows, mapped.MappedRows)
        assert [row.tobytes() for row in batch] == [contents[i][0] for i in (COUNT - 1, 0, 500)]
    assert listings == []


def test_hdf5_raw_archives_without_stored_positions_are_listed_and_still_mapped(tmp_path, monkeypatch):
    """Archives written before positions were stored (here: a writer without the hook)."""
    monkeypatch.setattr(hdf5.HDF5Writer, "final_positions", lambda writer: None)
    contents = samples(200, "raw")
    path = write(tmp_path / "old.h5", "hdf5", "raw", contents)
    listings = count_chunk_listings(monkeypatch)
    with pf.open_archive(path) as reader:
        assert reader.index.positions is None
        batch = reader.read_many([199, 0, 7])
        assert isinstance(reader.handle().rows, mapped.MappedRows)
        assert [row.tobytes() for row in batch] == [contents[i][0] for i in (199, 0, 7)]
    assert listings == []  # HDF5 listed the chunks in a guarded child: nothing of HDF5's runs in the reader


def test_damaged_hdf5_positions_are_caught_by_the_index_checksum(written, tmp_path):
    path, _ = written[("hdf5", "raw")]
    copy = tmp_path / "damaged.h5"
    copy.write_bytes(open(path, "rb").read())
    with h5py.File(copy, "r") as file:
        where = file["positions"].id.get_offset() + 8 * 500 + 1  # a byte inside sample 500's position
    with open(copy, "r+b") as file:
        file.seek(where)
        byte = file.read(1)
        file.seek(where)
        file.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(pf.CorruptArchiveError, match=r"damaged\.h5.*'positions' is damaged"):
        pf.open_archive(copy)


def exit_status_of_child(run) -> int:
    """Run ``run()`` in a forked child and return its exit code (failing if a signal killed it)."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, only an exit status
        code = 2
        try:
            code = run()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"the child died of signal {os.WTERMSIG(status)}"
    return os.WEXITSTATUS(status)


@pytest.mark.parametrize("mode", MODES)
def test_an_hdf5_index_cut_off_under_a_live_reader_is_a_named_error_not_a_signal(written, tmp_path, mode):
    path, _ = written[("hdf5", mode)]
    copy = tmp_path / "cut.h5"
    copy.write_bytes(open(path, "rb").read())
    with h5py.File(copy, "r") as file:
        cut = min(file[name].id.get_offset() for name in ("labels", "keys", "crc32"))

    def read_after_the_cut() -> int:
        reader = pf.open_archive(copy)
        reader.read_many(range(COUNT))
        os.truncate(copy, cut)  # the mapped index is gone from the file
        try:
            for i in range(COUNT):  # each read checks its sample against the mapped crc32
                reader.read(i)
        except pf.ArchiveChangedError as exc:
            return 0 if "cut.h5" in str(exc) else 3
        return 4

    assert exit_status_of_child(read_after_the_cut) == 0


# ---- files that are not ours -------------------------------------------------------------------------------
def foreign_hdf5(path) -> str:
    with h5py.File(path, "w") as file:  # common names, another tool's layout
        file.create_dataset("images", data=np.zeros((4, 8, 8, 3), dtype=np.uint8))
        file.create_dataset("labels", data=np.arange(4))
    return os.fspath(path)


def foreign_lmdb(path) -> str:
    env = lmdb.open(os.fspath(path), subdir=False, lock=False, map_size=1 << 20)
    with env.begin(write=True) as txn:
        for i in range(4):
            txn.put(b"%010d" % i, pickle.dumps((b"\xff\xd8", i)))
    env.close()
    return os.fspath(path)


def unsealed(path, fmt: str, written) -> str:
    """An archive of ours whose manifest is gone: its writer died before the seal."""
    source, _ = written[(fmt, "raw")]
    with open(source, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read())
    if fmt == "hdf5":
        with h5py.File(path, "r+") as file:
            del file.attrs[hdf5.MANIFEST_ATTR]
        hdf5.seal_metadata(os.fspath(path))  # an edit, not damage: what HDF5 parses is checked against its seal
    else:
        env = lmdb.open(os.fspath(path), subdir=False, lock=False)
        with env.begin(write=True) as txn:
            txn.delete(b"__manifest__")
        env.close()
    return os.fspath(path)


@pytest.mark.parametrize("fmt, make", [("hdf5", foreign_hdf5), ("lmdb", foreign_lmdb)], ids=["hdf5", "lmdb"])
def test_a_foreign_file_is_not_a_packed_formats_archive_and_ours_unsealed_is(written, tmp_path, fmt, make):
    path = make(tmp_path / f"theirs.{fmt}")
    with pytest.raises(pf.UnknownFormatError, match="not a packed_formats archive") as error:
        pf.open_archive(path)
    assert "theirs" in str(error.value) and "packed-formats convert SRC DST" in str(error.value)
    assert not isinstance(error.value, pf.IncompleteArchiveError)
    with pytest.raises(pf.IncompleteArchiveError, match="never sealed"):
        pf.open_archive(unsealed(tmp_path / f"ours.{fmt}", fmt, written))


# ---- processes ---------------------------------------------------------------------------------------------
def test_a_forked_child_that_closes_the_inherited_lmdb_environment_still_reads_the_index(written):
    path, contents = written[("lmdb", "encoded")]
    reader = pf.open_archive(path)
    reader.read(0)  # this process's environment is open when it forks
    expected = sum(crc32(stored) for stored, _, _ in contents)

    def read_in_the_child() -> int:
        reader.read(1)  # closes the inherited environment and opens its own
        reader.close()  # and closes that one too
        arrays = reader.index.arrays()
        mapped_here = all(mapped_file(a) == os.path.realpath(path) for a in arrays.values())
        same = int(reader.index.crc32.astype(np.int64).sum()) == expected and len(arrays["keys"]) == COUNT
        return 0 if mapped_here and same else 3

    try:
        assert exit_status_of_child(read_in_the_child) == 0
    finally:
        reader.close()


def open_peak(path) -> int:
    """The most memory (bytes, traced by tracemalloc) that opening the archive at ``path`` held at once."""
    tracemalloc.start()
    try:
        reader = pf.open_archive(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    reader.close()
    return peak


@pytest.mark.parametrize(
    "fmt, count",
    [("memmap", 200_000), ("lmdb", 200_000), ("hdf5", 10_000), pytest.param("hdf5", 200_000, marks=pytest.mark.slow)],
)
def test_opening_allocates_far_less_than_the_index(tmp_path, fmt, count):
    path = tmp_path / f"big.{fmt}"
    pixel = np.zeros((1, 1, 1), dtype=np.uint8)
    with pf.open_writer(path, format=fmt, mode="raw", shape=(1, 1, 1), classes=("a", "b")) as writer:
        for i in range(count):
            writer.add(pixel, i & 1)
    with pf.open_archive(path) as reader:
        index_bytes = sum(a.nbytes for a in reader.index.arrays().values())
    assert index_bytes >= 20 * count
    assert open_peak(path) < index_bytes / 10 + 32 * 1024  # a loaded index would take all of it

"""The ZIP layout: written record by record, read from its tail in O(1), still a ZIP for every tool.

Our ZIP writer writes the records itself and keeps the index in numpy blocks, not an
object per member; the end record's comment locates the manifest and the
index, which a reader maps instead of parsing the central directory.
Archives of the earlier layout (written by ``zipfile``, no locator) still open.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tracemalloc
import zipfile

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.backends import zip_records
from packed_formats.backends.zip import ZipWriter
from packed_formats.checksum import array_crc32, crc32
from packed_formats.index import SampleIndex, encode_keys, file_backed, npy_bytes
from packed_formats.manifest import new_manifest

TINY = (2, 2, 1)  # 4-byte raw samples: archives of many samples in little time
CLASSES = ("a", "b", "c")
BIG = 200_000  # more than 65,535 entries: ZIP64 end records, and enough to see per-member work
SMALL_LIMIT = 1024  # a ZIP64 limit the small archives pass, so their ZIP64 branch is written and read


class SmallLimitZipWriter(ZipWriter):
    """The ZIP writer with its ZIP64 threshold lowered: sizes and offsets from SMALL_LIMIT on are ZIP64."""

    zip64_limit = SMALL_LIMIT


def tiny_pixels(i: int) -> np.ndarray:
    return np.full(TINY, i % 251, dtype=np.uint8)


def write_tiny(path, count: int, writer=ZipWriter) -> str:
    with writer(path, mode="raw", shape=TINY, classes=CLASSES) as archive:
        for i in range(count):
            archive.add(tiny_pixels(i), i % 3)
    return os.fspath(path)


def write_jpegs(path, image_folder, writer=ZipWriter) -> str:
    source = pf.open_archive(image_folder)
    with writer(path, mode="encoded", classes=source.classes) as archive:
        for i in range(len(source)):
            archive.add(source.read(i), int(source.labels[i]), source.key(i))
    source.close()
    return os.fspath(path)


@pytest.fixture(scope="module")
def written(tmp_path_factory, image_folder):
    """{kind: path} of archives of each kind the writer makes."""
    root = tmp_path_factory.mktemp("zip-layout")
    return {
        "raw": write_tiny(root / "raw.zip", 300),
        "encoded": write_jpegs(root / "encoded.zip", image_folder),
        "empty": write_tiny(root / "empty.zip", 0),
        "zip64-raw": write_tiny(root / "zip64-raw.zip", 3000, SmallLimitZipWriter),
        "zip64-encoded": write_jpegs(root / "zip64-encoded.zip", image_folder, SmallLimitZipWriter),
    }


KINDS = ["raw", "encoded", "empty", "zip64-raw", "zip64-encoded"]


@pytest.fixture(scope="module")
def big_archive(tmp_path_factory):
    """A raw archive of BIG tiny samples."""
    return write_tiny(tmp_path_factory.mktemp("zip-big") / "big.zip", BIG)


def end_comment(path) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.comment


def data_offset(path, name: str) -> int:
    """Where member ``name``'s bytes start, from its local header (found through zipfile)."""
    with zipfile.ZipFile(path) as archive:
        at = archive.getinfo(name).header_offset
    with open(path, "rb") as file:
        file.seek(at)
        header = file.read(30)
    return at + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")


def header_offset(path, name: str) -> int:
    with zipfile.ZipFile(path) as archive:
        return archive.getinfo(name).header_offset


def is_mapped(array: np.ndarray) -> bool:
    """Whether the array's memory is a map of a file (as the index says, and as /proc/self/maps shows)."""
    if not file_backed(array):
        return False
    address = array.ctypes.data
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return len(fields) >= 6 and fields[5].startswith("/")  # a file's pages, not anonymous memory
    return False


# ---- still a ZIP for every tool ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_written_archives_read_back_through_zipfile_and_carry_a_locator(written, kind):
    path = written[kind]
    with pf.open_archive(path) as reader:
        samples = [reader.read_bytes(i) for i in range(len(reader))]
        labels, arrays = reader.labels.copy(), list(reader.index.arrays())
    extension = "jpg" if "encoded" in kind else "raw"
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
        names = archive.namelist()
        members = [f"samples/{i:09d}.{extension}" for i in range(len(samples))]
        assert names == members + [f"index/{a}.npy" for a in arrays] + ["manifest.json"]
        assert all(archive.getinfo(n).compress_type == zipfile.ZIP_STORED for n in names)
        assert [archive.read(n) for n in members] == samples
        assert json.loads(archive.read("manifest.json"))["count"] == len(samples)
        with archive.open("index/labels.npy") as member:
            np.testing.assert_array_equal(np.load(member), labels)
        assert archive.comment.startswith(zip_records.LOCATOR_MAGIC)


@pytest.mark.skipif(shutil.which("unzip") is None or shutil.which("zipinfo") is None,
                    reason="unzip/zipinfo are not installed")
@pytest.mark.parametrize("kind", KINDS)
def test_written_archives_pass_unzip_t_and_zipinfo(written, kind):
    path = written[kind]
    tested = subprocess.run(["unzip", "-t", path], capture_output=True, text=True)
    assert tested.returncode == 0 and "No errors detected" in tested.stdout, tested.stdout + tested.stderr
    listed = subprocess.run(["zipinfo", "-1", path], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    with pf.open_archive(path) as reader:
        expected = len(reader) + len(reader.index.arrays()) + 1
    assert len(listed.stdout.split()) == expected
    assert zip_records.LOCATOR_MAGIC in end_comment(path)


@pytest.mark.parametrize("kind", ["zip64-raw", "zip64-encoded"])
def test_past_the_zip64_limit_members_and_the_directory_get_zip64_records(written, kind):
    path, plain = written[kind], written[kind[len("zip64-"):]]
    data = open(path, "rb").read()
    end = data.rfind(zip_records.END.signature)
    assert data[end - 20 : end - 16] == zip_records.ZIP64_LOCATOR.signature
    assert data.rfind(zip_records.ZIP64_END.signature) == end - 20 - 56
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
        late = [i for i in infos if i.header_offset >= SMALL_LIMIT]
        assert late and all(int.from_bytes(i.extra[:2], "little") == 1 for i in late)  # a ZIP64 extra field
        big = [i for i in infos if i.file_size >= SMALL_LIMIT]
        for info in big:  # local headers too: sizes in a ZIP64 extra field
            header = data[info.header_offset : info.header_offset + 30]
            assert int.from_bytes(header[22:26], "little") == zip_records.ZIP64_LIMIT
        if kind == "zip64-raw":  # the index arrays, aligned after their ZIP64 fields
            assert {i.filename for i in infos if i.filename.startswith("index/")} <= {i.filename for i in big}
        else:  # most JPEGs: their data lies past a longer local header
            assert len(big) > len(infos) // 2
    with pf.open_archive(path) as wide:
        with pf.open_archive(plain) as narrow:
            if kind == "zip64-encoded":
                assert [wide.read(i) for i in range(len(wide))] == [narrow.read(i) for i in range(len(narrow))]
            else:
                assert len(wide) == 3000 and wide.read(2999).ravel().tolist() == [2999 % 251] * 4


@pytest.mark.parametrize("kind", ["raw", "encoded", "zip64-encoded"])
def test_the_same_input_writes_the_same_bytes(tmp_path, image_folder, monkeypatch, kind):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    writer = SmallLimitZipWriter if kind.startswith("zip64") else ZipWriter
    made = []
    for name in ("one.zip", "two.zip"):
        path = tmp_path / name
        if kind == "raw":
            write_tiny(path, 500, writer)
        else:
            write_jpegs(path, image_folder, writer)
        made.append(path.read_bytes())
    assert made[0] == made[1]
    assert zip_records.LOCATOR_MAGIC in made[0][-4096:]
    assert kind != "zip64-encoded" or zip_records.ZIP64_END.signature in made[0][-4096:]


@pytest.mark.parametrize("kind", KINDS)
def test_index_arrays_are_mapped_and_their_data_aligned_to_64_bytes(written, kind):
    with pf.open_archive(written[kind]) as reader:
        arrays = {name: array for name, array in reader.index.arrays().items() if array.nbytes}  # empty: nothing to map
        assert arrays and all(is_mapped(a) for a in arrays.values())
        assert all(a.ctypes.data % 64 == 0 for a in arrays.values())  # a map starts on a page: file offsets too
    for name, array in arrays.items():
        npy_start = data_offset(written[kind], f"index/{name}.npy")
        assert (npy_start + len(npy_bytes(array)) - array.nbytes) % 64 == 0


# ---- opening costs the same at any size; writing takes bounded memory ----------------------------------------
def test_opening_200k_samples_reads_the_tail_and_maps_the_index_without_zipfile(big_archive, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the central directory was parsed")

    monkeypatch.setattr(zipfile.ZipFile, "__init__", refuse)
    monkeypatch.setattr(zipfile.ZipInfo, "__init__", refuse)
    read = []
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: read.append(n) or pread(fd, n, at))
    tracemalloc.start()
    try:
        reader = pf.open_archive(big_archive)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    with reader:
        index_bytes = sum(a.nbytes for a in reader.index.arrays().values())
        assert len(reader) == BIG and all(is_mapped(a) for a in reader.index.arrays().values())
        assert sum(read) < 256 << 10 and len(read) < 40  # the tail, the manifest, a few headers: no member list
        assert peak < 1 << 20 < index_bytes // 4, f"opening allocated {peak} bytes"
        np.testing.assert_array_equal(reader.read_many([BIG - 1, 0])[:, 0, 0, 0], [(BIG - 1) % 251, 0])


def test_writing_200k_samples_keeps_no_object_per_member(tmp_path):
    """The writer's own memory, driven directly (the Writer's index builder is not measured): numpy
    columns and a bounded central directory chunk, far below one ZipInfo per member."""
    blob = bytes(4)
    crc = crc32(blob)
    index = SampleIndex(
        labels=np.zeros(BIG, np.int64), keys=encode_keys([f"{i:08d}" for i in range(BIG)]),
        crc32=np.full(BIG, crc, np.uint32), offsets=np.arange(BIG + 1, dtype=np.int64) * 4,
        positions=np.zeros(BIG, np.int64),
    )
    manifest = new_manifest("zip", "raw", BIG, CLASSES, TINY, None,
                            [(n, array_crc32(a)) for n, a in index.arrays().items()])
    index_bytes = sum(a.nbytes for a in index.arrays().values())
    writer = ZipWriter(tmp_path / "w.zip", mode="raw", shape=TINY, classes=CLASSES)
    tracemalloc.start()
    try:
        for i in range(BIG):
            writer.append(blob, i, crc)
        writer.finish(index, manifest)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    try:
        assert peak < 2 * index_bytes + (16 << 20), f"writing {BIG} samples took {peak >> 20} MiB"
        size = os.path.getsize(writer.temp_path)
        assert size > BIG * (30 + 21 + 4 + 46 + 21)  # every member's local header, data and directory entry
    finally:
        writer.abort()


@pytest.mark.skipif(shutil.which("unzip") is None, reason="the unzip program is not installed")
def test_more_than_65535_entries_pass_unzip_t(big_archive):
    tested = subprocess.run(["unzip", "-tq", big_archive], capture_output=True, text=True)
    assert tested.returncode == 0 and "No errors detected" in tested.stdout, tested.stdout + tested.stderr
    tail = open(big_archive, "rb").read()[-4096:]
    assert zip_records.ZIP64_END.signature in tail


@pytest.mark.slow
def test_more_than_65535_entries_read_back_through_zipfile(big_archive):
    with zipfile.ZipFile(big_archive) as archive:
        names = archive.namelist()
        assert len(names) == BIG + 6 and names[BIG - 1] == f"samples/{BIG - 1:09d}.raw"
        assert archive.read(names[BIG - 1]) == tiny_pixels(BIG - 1).tobytes()
        assert archive.read(names[0]) == tiny_pixels(0).tobytes()


# ---- archives of the earlier layout ----------------------------------------------------------------------
def write_old_layout(path, count: int) -> str:
    """A raw archive as earlier versions wrote it: members through ``zipfile``, no locator."""
    positions, blobs = [], [tiny_pixels(i).tobytes() for i in range(count)]
    with zipfile.ZipFile(path, "w") as archive:
        for i, blob in enumerate(blobs):
            info = zipfile.ZipInfo(f"samples/{i:09d}.raw", date_time=(1980, 1, 1, 0, 0, 0))
            with archive.open(info, "w") as member:
                positions.append(archive.fp.tell())  # the local header is written: data starts here
                member.write(blob)
        index = SampleIndex(
            labels=np.arange(count, dtype=np.int64) % 3, keys=encode_keys([f"old/{i}.png" for i in range(count)]),
            crc32=np.array([crc32(b) for b in blobs], np.uint32),
            offsets=np.arange(count + 1, dtype=np.int64) * len(blobs[0]), positions=np.array(positions, np.int64),
        )
        for name, array in index.arrays().items():
            archive.writestr(f"index/{name}.npy", npy_bytes(array))
        checksums = [(n, array_crc32(a)) for n, a in index.arrays().items()]
        archive.writestr("manifest.json", new_manifest("zip", "raw", count, CLASSES, TINY, None, checksums).to_json())
    return os.fspath(path)


def test_an_archive_of_the_earlier_layout_still_opens(tmp_path):
    path = write_old_layout(tmp_path / "old.zip", 40)
    assert end_comment(path) == b""
    with pf.open_archive(path) as reader:
        assert len(reader) == 40 and reader.key(39) == "old/39.png"
        np.testing.assert_array_equal(reader.labels, np.arange(40) % 3)
        np.testing.assert_array_equal(reader.read_many([39, 0, 7])[:, 0, 0, 0], [39, 0, 7])


@pytest.mark.parametrize("members, error", [
    (["readme.txt"], pf.UnknownFormatError), (["samples/000000000.raw"], pf.IncompleteArchiveError),
])
def test_a_zip_without_locator_or_manifest_is_named_foreign_or_unsealed(tmp_path, members, error):
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w") as archive:
        for name in members:
            archive.writestr(name, b"data")
    with pytest.raises(error, match="other.zip"):
        pf.open_archive(path)


# ---- damage gives its named error -------------------------------------------------------------------------
@pytest.fixture
def copy(written, tmp_path):
    """A fresh copy of the small raw archive, to damage."""
    path = tmp_path / "damaged.zip"
    shutil.copyfile(written["raw"], path)
    return os.fspath(path)


def write_at(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def flip_at(path: str, offset: int) -> None:
    with open(path, "rb") as file:
        file.seek(offset)
        byte = file.read(1)
    write_at(path, offset, bytes([byte[0] ^ 0x55]))


def test_an_archive_cut_inside_its_end_record_is_incomplete(copy):
    os.truncate(copy, os.path.getsize(copy) - len(end_comment(copy)) // 2)
    with pytest.raises(pf.IncompleteArchiveError, match=r"damaged\.zip.*ends inside its ZIP end record"):
        pf.open_archive(copy)


def test_bytes_after_the_end_record_are_named(copy):
    with open(copy, "ab") as file:
        file.write(b"appended")
    with pytest.raises(pf.CorruptArchiveError, match=r"damaged\.zip.*bytes follow the ZIP end record"):
        pf.open_archive(copy)


def test_a_damaged_locator_is_named(copy):
    comment = end_comment(copy)
    flip_at(copy, os.path.getsize(copy) - len(comment) + comment.index(b'"members"') + 3)
    with pytest.raises(pf.CorruptArchiveError, match=r"damaged\.zip.*locator is damaged"):
        pf.open_archive(copy)


def test_an_end_record_pointing_elsewhere_is_named(copy):
    end = os.path.getsize(copy) - len(end_comment(copy)) - 22
    with open(copy, "rb") as file:
        file.seek(end + 16)
        directory = int.from_bytes(file.read(4), "little")
    write_at(copy, end + 16, (directory + 46).to_bytes(4, "little"))
    with pytest.raises(pf.CorruptArchiveError, match=r"damaged\.zip.*central directory does not end") as error:
        pf.open_archive(copy)
    assert type(error.value) is pf.CorruptArchiveError


@pytest.mark.parametrize("member, damage", [
    ("samples/000000000.raw", "name"), ("samples/000000299.raw", "signature"),
    ("manifest.json", "signature"), ("index/labels.npy", "name"),
])
def test_an_overwritten_local_header_is_named(copy, member, damage):
    at = header_offset(copy, member)
    write_at(copy, at + 30 + 2, b"X") if damage == "name" else write_at(copy, at, b"\0\0\0\0")
    with pytest.raises(pf.CorruptArchiveError, match=r"damaged\.zip.*(local header|do not match the ZIP layout)") as e:
        pf.open_archive(copy)
    assert type(e.value) is pf.CorruptArchiveError


def test_a_flipped_byte_in_an_index_array_fails_its_checksum(copy):
    with zipfile.ZipFile(copy) as archive:
        npy_header = archive.getinfo("index/labels.npy").file_size - 8 * 300
    flip_at(copy, data_offset(copy, "index/labels.npy") + npy_header + 8 * 17)  # label 17
    with pytest.raises(pf.CorruptArchiveError, match=r"damaged\.zip.*index array 'labels' is damaged"):
        pf.open_archive(copy)


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_each_sample_checksum_is_computed_once_while_writing(tmp_path, monkeypatch, fmt):
    """The CRC32 a sample's bytes get for the index is the one ZIP's local header records: adding
    a sample computes it once in every format (ZIP computed it a second time for its header)."""
    import importlib

    from packed_formats import checksum

    calls = []

    def counted(data, value=0):
        calls.append(len(data))
        return crc32(data, value)

    for name in ("reader", "writer", "zip", "hdf5", "lmdb", "memmap", "sharded"):
        module = importlib.import_module(f"packed_formats.backends.{name}")
        if getattr(module, "crc32", None) is checksum.crc32:
            monkeypatch.setattr(module, "crc32", counted)
    with pf.open_writer(tmp_path / f"a.{fmt}", fmt, mode="raw", shape=TINY, classes=CLASSES) as writer:
        for i in range(10):
            writer.add(tiny_pixels(i), i % 3)
        assert calls == [4] * 10  # once per sample, of its 4 bytes
    with pf.open_archive(tmp_path / f"a.{fmt}") as reader:  # and the one CRC32 is what every check reads
        assert [int(reader.index.crc32[i]) for i in range(10)] == [crc32(tiny_pixels(i).tobytes()) for i in range(10)]
        assert pf.verify_archive(reader.path).ok

"""verify checks a ZIP's own records of each sample, which our reader never needs but every ZIP tool does.

Samples are read at the positions our index gives, so a damaged local header
or central directory entry reads back fine through packed_formats while
``unzip`` or ``zipfile`` would read a wrong or broken archive; ``verify``
names such a sample like one whose bytes fail their checksum.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zipfile

import numpy as np
import pytest

import packed_formats as pf
from packed_formats import cli, codecs, verify
from packed_formats.backends.zip import ZipWriter

from .conftest import ARCHIVE_KINDS, kind_id
from .test_zip_layout import write_old_layout

N = 12
SHAPE = (6, 5, 3)
MODES = ("encoded", "raw")


class SmallLimitZipWriter(ZipWriter):
    """Sizes and offsets from 256 bytes on get ZIP64 fields: small archives go through that branch."""

    zip64_limit = 256


def samples(mode: str):
    """N samples: JPEGs and PNGs of varied sizes, or raw pixels."""
    rng = np.random.default_rng(0)
    for i in range(N):
        pixels = rng.integers(0, 256, (4 + i, 3 + i, 3) if mode == "encoded" else SHAPE, dtype=np.uint8)
        yield codecs.encode(pixels, "png" if i % 3 == 2 else "jpeg") if mode == "encoded" else pixels


def write(path, mode: str, writer=ZipWriter) -> str:
    with writer(path, mode=mode, shape=SHAPE, classes=("a", "b")) as archive:
        for i, sample in enumerate(samples(mode)):
            archive.add(sample, i % 2, f"key-{i}")
    return os.fspath(path)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("zip-structure")
    made = {mode: write(root / f"{mode}.zip", mode) for mode in MODES}
    made.update({f"{mode}-zip64": write(root / f"{mode}-zip64.zip", mode, SmallLimitZipWriter) for mode in MODES})
    return made


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


@pytest.fixture
def copy(tmp_path, pristine, mode):
    path = tmp_path / "damaged.zip"
    shutil.copyfile(pristine[mode], path)
    return os.fspath(path)


# ---- finding and damaging records, independently of the code under test ----------------------------------
def name_of(path, i: int) -> str:
    with zipfile.ZipFile(path) as archive:
        return archive.namelist()[i]


def local_header_at(path, i: int) -> int:
    with zipfile.ZipFile(path) as archive:
        return archive.infolist()[i].header_offset


def central_entry_at(path, i: int) -> int:
    """Where sample i's central directory entry starts: its name's last occurrence is in the directory."""
    with open(path, "rb") as file:
        data = file.read()
    at = data.rfind(name_of(path, i).encode()) - 46
    assert data[at : at + 4] == b"PK\x01\x02"
    return at


def read_at(path, at: int, size: int) -> bytes:
    with open(path, "rb") as file:
        file.seek(at)
        return file.read(size)


def write_at(path, at: int, data: bytes) -> None:
    with open(path, "r+b") as file:
        file.seek(at)
        file.write(data)


def add_to_field(path, at: int, delta: int = 1) -> None:
    """Add ``delta`` to the 32-bit little-endian field at byte ``at``."""
    (value,) = struct.unpack("<I", read_at(path, at, 4))
    write_at(path, at, struct.pack("<I", (value + delta) % 2**32))


# (damage to the first or last sample's local header is found when the archive is opened: test_zip_layout)
def only_bad(report, i: int, *words: str) -> str:
    """The one bad sample of ``report``, checked to be sample i and described with ``words``."""
    assert not report.ok and report.bad_count == 1, report.lines()
    (bad,) = report.bad
    assert (bad.index, bad.key) == (i, f"key-{i}"), report.lines()
    for word in words:
        assert word in bad.problem, bad.problem
    return bad.problem


def zipfile_finds(path) -> "str | None":
    """The member ``zipfile`` finds bad (``testzip``), or None."""
    with zipfile.ZipFile(path) as archive:
        return archive.testzip()


# ---- intact archives ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["", "-zip64"])
def test_an_intact_archive_verifies_ok(pristine, mode, variant):
    path = pristine[mode + variant]
    report = pf.verify_archive(path)
    assert report.ok and report.checked == N, report.lines()
    assert zipfile_finds(path) is None
    with pf.open_archive(path) as reader:
        assert reader.structure_problems(0, N) == {}
        assert reader.structure_problems(5, 7) == {}  # any range, in any order


def test_the_zip64_variant_has_zip64_records(pristine, mode):
    """The lowered limit really writes ZIP64 fields (local ones for large samples, central ones for late offsets)."""
    with zipfile.ZipFile(pristine[f"{mode}-zip64"]) as archive:
        infos = archive.infolist()[:N]
    assert any(info.header_offset >= SmallLimitZipWriter.zip64_limit for info in infos)
    if mode == "encoded":
        assert any(info.file_size >= SmallLimitZipWriter.zip64_limit for info in infos)


# ---- local headers --------------------------------------------------------------------------------------
def test_a_local_header_naming_another_member_is_named(copy):
    at = local_header_at(copy, 4) + 30 + len("samples/00000000")
    write_at(copy, at, b"9")  # samples/000000004.xxx -> samples/000000009.xxx
    problem = only_bad(pf.verify_archive(copy), 4, "ZIP local header", "names", name_of(copy, 4))
    assert name_of(copy, 4).replace("4.", "9.") in problem
    assert zipfile_finds(copy) == name_of(copy, 4)  # zipfile compares the names too


def test_a_wrong_crc_in_a_local_header_is_named(copy):
    at = local_header_at(copy, 7) + 14
    stored = struct.unpack("<I", read_at(copy, at, 4))[0]
    add_to_field(copy, at)
    only_bad(pf.verify_archive(copy), 7, "ZIP local header", f"stored CRC {stored + 1:08x}", f"index says {stored:08x}")


@pytest.mark.parametrize("field, what", [(18, "compressed size"), (22, "size")])
def test_a_wrong_size_in_a_local_header_is_named(copy, field, what):
    at = local_header_at(copy, 6) + field
    size = struct.unpack("<I", read_at(copy, at, 4))[0]
    add_to_field(copy, at, 3)
    only_bad(pf.verify_archive(copy), 6, "ZIP local header", f"stored {what} {size + 3}, index says {size}")


def test_a_local_header_whose_extra_length_moves_the_data_is_named(copy):
    write_at(copy, local_header_at(copy, 3) + 28, struct.pack("<H", 4))
    only_bad(pf.verify_archive(copy), 3, "ZIP local header", "data would start at byte")


def test_an_overwritten_local_header_signature_is_named(copy):
    write_at(copy, local_header_at(copy, 10), b"XXXX")
    only_bad(pf.verify_archive(copy), 10, f"ZIP local header at byte {local_header_at(copy, 10)}: not found")


@pytest.mark.skipif(shutil.which("unzip") is None, reason="unzip is not installed")
@pytest.mark.parametrize("field", [8, 14, 18, 22], ids=["method", "crc", "compressed-size", "size"])
def test_unzip_fails_on_the_local_header_damage_zipfile_overlooks(copy, field):
    """``zipfile`` reads CRC, sizes and method from the central directory; ``unzip`` from the local header."""
    add_to_field(copy, local_header_at(copy, 5) + field, 3)
    assert zipfile_finds(copy) is None
    assert subprocess.run(["unzip", "-tq", copy], capture_output=True).returncode != 0
    only_bad(pf.verify_archive(copy), 5, "ZIP local header")


def test_a_compressed_method_in_a_local_header_is_named(copy):
    write_at(copy, local_header_at(copy, 2) + 8, struct.pack("<H", 8))
    only_bad(pf.verify_archive(copy), 2, "ZIP local header", "method 8")


# ---- central directory ------------------------------------------------------------------------------------
def test_a_wrong_crc_in_the_central_directory_is_named(copy):
    at = central_entry_at(copy, 5) + 16
    stored = struct.unpack("<I", read_at(copy, at, 4))[0]
    add_to_field(copy, at)
    only_bad(pf.verify_archive(copy), 5, "central directory", f"stored CRC {stored + 1:08x}")
    assert zipfile_finds(copy) == name_of(copy, 5)  # zipfile checks the data against this CRC


def test_a_central_directory_entry_pointing_at_another_local_header_is_named(copy):
    own, other = local_header_at(copy, 6), local_header_at(copy, 8)
    write_at(copy, central_entry_at(copy, 6) + 42, struct.pack("<I", other))
    only_bad(pf.verify_archive(copy), 6, "central directory",
             f"local header offset {other}, but the sample's local header is at byte {own}")
    assert zipfile_finds(copy) == name_of(copy, 6)  # it finds sample 8's header there


def test_a_central_directory_entry_naming_another_member_is_named(copy):
    at = central_entry_at(copy, 1)
    name = name_of(copy, 1)
    write_at(copy, at + 46 + len("samples/00000000"), b"X")
    only_bad(pf.verify_archive(copy), 1, "central directory", f"names {name.replace('1.', 'X.')!r} instead of {name!r}")
    assert zipfile_finds(copy) == name.replace("1.", "X.")  # the local header it finds names sample 1


def test_a_wrong_size_in_the_central_directory_is_named(copy):
    at = central_entry_at(copy, 9) + 24
    size = struct.unpack("<I", read_at(copy, at, 4))[0]
    add_to_field(copy, at, 2)
    only_bad(pf.verify_archive(copy), 9, "central directory", f"stored size {size + 2}, index says {size}")


def test_a_central_directory_that_cannot_be_read_past_an_entry_names_every_sample_after(copy):
    write_at(copy, central_entry_at(copy, 8), b"XXXX")
    report = pf.verify_archive(copy)
    assert report.bad_count == N - 8 and [b.index for b in report.bad] == list(range(8, N)), report.lines()
    assert all("central directory" in b.problem for b in report.bad)
    with pytest.raises(zipfile.BadZipFile):
        zipfile_finds(copy)


# ---- both, ZIP64, reports, other formats -------------------------------------------------------------------
def test_damage_to_both_records_and_to_the_bytes_is_reported_once_per_sample(copy):
    add_to_field(copy, local_header_at(copy, 3) + 14)
    add_to_field(copy, central_entry_at(copy, 3) + 16)
    with pf.open_archive(copy) as reader:
        middle = int(reader.index.positions[3]) + reader.index.nbytes(3) // 2
    write_at(copy, middle, bytes([read_at(copy, middle, 1)[0] ^ 1]))
    problem = only_bad(pf.verify_archive(copy), 3, "checksum mismatch", "ZIP local header", "central directory")
    assert problem.count("; ") == 2


def test_a_wrong_zip64_size_in_a_local_header_is_named(tmp_path, pristine):
    """(Encoded samples only: raw ones are too small for a ZIP64 local header even at the lowered limit.)"""
    path = tmp_path / "zip64.zip"
    shutil.copyfile(pristine["encoded-zip64"], path)
    with zipfile.ZipFile(path) as archive:
        i, info = next((i, info) for i, info in enumerate(archive.infolist()[1 : N - 1], 1)
                       if info.file_size >= SmallLimitZipWriter.zip64_limit)
    header = local_header_at(path, i)
    assert read_at(path, header + 22, 4) == b"\xff\xff\xff\xff"
    name_length = struct.unpack("<H", read_at(path, header + 26, 2))[0]
    write_at(path, header + 30 + name_length + 4, struct.pack("<Q", info.file_size + 5))  # the ZIP64 size
    only_bad(pf.verify_archive(path), i, "ZIP local header", f"stored size {info.file_size + 5}")


def test_a_wrong_zip64_offset_in_the_central_directory_is_named(tmp_path, pristine, mode):
    path = tmp_path / "zip64.zip"
    shutil.copyfile(pristine[f"{mode}-zip64"], path)
    at = central_entry_at(path, N - 1)
    assert read_at(path, at + 42, 4) == b"\xff\xff\xff\xff"  # the offset is in the ZIP64 field
    name_length = struct.unpack("<H", read_at(path, at + 28, 2))[0]
    offset_at = at + 46 + name_length + 4 + 16
    write_at(path, offset_at, struct.pack("<Q", local_header_at(path, 0)))
    only_bad(pf.verify_archive(path), N - 1, "central directory", "local header offset 0")
    assert zipfile_finds(path) == name_of(path, N - 1)


def test_records_are_checked_a_chunk_at_a_time_reading_the_directory_on(copy, monkeypatch):
    monkeypatch.setattr(verify, "STRUCTURE_CHUNK", 5)  # chunks 0:5, 5:10, 10:12
    for i in (4, 5, 11):
        add_to_field(copy, central_entry_at(copy, i) + 16)
    add_to_field(copy, local_header_at(copy, 9) + 14)
    report = pf.verify_archive(copy)
    assert [(b.index, b.problem.split(" at byte")[0]) for b in report.bad] == [
        (4, "central directory entry"), (5, "central directory entry"), (9, "ZIP local header"),
        (11, "central directory entry")], report.lines()


def test_an_archive_of_the_earlier_layout_is_checked_too(tmp_path):
    """Written through ``zipfile``, without a locator: its records are laid out the same way."""
    path = write_old_layout(tmp_path / "old.zip", 20)
    assert pf.verify_archive(path).ok
    add_to_field(path, central_entry_at(path, 13) + 16)
    assert [b.index for b in pf.verify_archive(path).bad] == [13]
    assert zipfile_finds(path) == name_of(path, 13)


def test_the_cli_prints_the_damaged_sample_and_fails(copy, capsys):
    add_to_field(copy, local_header_at(copy, 10) + 14)
    assert cli.main(["verify", copy, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "[sample index 10, key 'key-10']: ZIP local header" in out and "FAILED: 1 bad sample" in out


def test_a_sharded_zip_set_is_checked_part_by_part(tmp_path, image_folder):
    dst = tmp_path / "set.zip"
    summary = pf.convert(image_folder, dst, shard_size=10, workers=1, quiet=True)
    part = summary.parts[1]
    add_to_field(part, central_entry_at(part, 2) + 16)
    with pf.open_archive(dst) as reader:
        key = reader.key(12)
    report = pf.verify_archive(dst)
    assert report.bad_count == 1 and (report.bad[0].index, report.bad[0].key) == (12, key), report.lines()
    assert "central directory" in report.bad[0].problem


@pytest.mark.parametrize("kind", [k for k in ARCHIVE_KINDS if k[0] != "zip"], ids=kind_id)
def test_formats_without_such_records_have_no_structure_problems(archives, kind):
    with pf.open_archive(archives[kind]) as reader:
        assert reader.structure_problems(0, len(reader)) == {}


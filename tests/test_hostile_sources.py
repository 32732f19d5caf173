"""Hostile source containers: links out of the container, devices and FIFOs are left out with one
warning listing them; names with control characters are refused naming the container and member;
a name found twice reads as the last one (as extracting keeps it), with one warning."""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
import warnings
import zipfile

import pytest

import packed_formats as pf
from packed_formats.sources import SourceMemberWarning, open_source
from packed_formats.writing.convert import convert

from .conftest import CLASSES, PER_CLASS
from .test_sources import folder_samples, nested_members, tar_bytes, tree_members, write_zip

N = len(CLASSES) * PER_CLASS


def file_info(name: str, data: bytes) -> tuple:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 0
    return info, io.BytesIO(data)


def special_info(name: str, kind: bytes, linkname: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info, None


def write_tar(path, entries, fmt=tarfile.GNU_FORMAT, compress: bool = False) -> str:
    """A tar of (TarInfo, data or None) entries, gzipped when ``compress``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for info, data in entries:
            tar.addfile(info, data)
    content = buffer.getvalue()
    path.write_bytes(gzip.compress(content) if compress else content)
    return str(path)


def tree(image_folder) -> list:
    return [file_info(name, data) for name, data in tree_members(folder_samples(image_folder))]


def member_warnings(caught) -> list:
    return [str(w.message) for w in caught if issubclass(w.category, SourceMemberWarning)]


def keys_of(path) -> list:
    with pf.open_archive(path) as reader:
        return [reader.key(i) for i in range(len(reader))]


# ---- left out: links out of the container, devices, FIFOs ------------------------------------------------
HOSTILE = [
    special_info("dataset/boxes/up.jpg", tarfile.SYMTYPE, "../../../etc/passwd"),
    special_info("dataset/boxes/abs.jpg", tarfile.SYMTYPE, "/etc/passwd"),
    special_info("dataset/circles/hard.jpg", tarfile.LNKTYPE, "/etc/shadow"),
    special_info("dataset/circles/hardup.jpg", tarfile.LNKTYPE, "../outside.jpg"),
    special_info("dataset/stripes/nowhere.jpg", tarfile.SYMTYPE, "missing.jpg"),
    special_info("dataset/stripes/tty.jpg", tarfile.CHRTYPE),
    special_info("dataset/stripes/disk.jpg", tarfile.BLKTYPE),
    special_info("dataset/stripes/pipe.jpg", tarfile.FIFOTYPE),
]


@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tar.gz"])
def test_links_out_devices_and_fifos_are_left_out_with_one_warning(tmp_path, image_folder, compress):
    src = write_tar(tmp_path / "hostile.tar", tree(image_folder) + HOSTILE, compress=compress)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = convert(src, tmp_path / "out.zip", workers=1, quiet=True)
    found = member_warnings(caught)
    assert len(found) == 1, found
    assert src in found[0] and "left out 8 member(s)" in found[0]
    for info, _ in HOSTILE:
        assert repr(info.name) in found[0]
    assert "outside the tar" in found[0] and "a character device" in found[0] and "a FIFO" in found[0]
    assert summary.samples == N
    assert keys_of(tmp_path / "out.zip") == [key for key, _, _ in folder_samples(image_folder)]


def test_a_clean_tar_gives_no_member_warning(tmp_path, image_folder):
    src = write_tar(tmp_path / "clean.tar", tree(image_folder))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        open_source(src).close()
    assert member_warnings(caught) == []


def test_zip_links_and_devices_are_left_out_with_one_warning(tmp_path, image_folder):
    src = tmp_path / "hostile.zip"
    with zipfile.ZipFile(src, "w") as archive:
        for name, data in tree_members(folder_samples(image_folder)):
            archive.writestr(name, data)
        for name, mode in [("dataset/boxes/link.jpg", stat.S_IFLNK | 0o777), ("dataset/boxes/pipe.jpg",
                                                                              stat.S_IFIFO | 0o644)]:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            archive.writestr(info, b"/etc/passwd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with open_source(src) as source:
            assert len(source) == N
    found = member_warnings(caught)
    assert len(found) == 1 and "'dataset/boxes/link.jpg' (a symbolic link" in found[0]
    assert "'dataset/boxes/pipe.jpg' (a FIFO)" in found[0]


# ---- control characters in names ----------------------------------------------------------------------
def pax_named(name: str, data: bytes) -> tuple:
    info, content = file_info("placeholder.jpg", data)
    info.pax_headers = {"path": name}
    return info, content


@pytest.mark.parametrize("name, fmt", [
    ("dataset/boxes/new\nline.jpg", tarfile.GNU_FORMAT),
    ("dataset/boxes/tab\there.jpg", tarfile.USTAR_FORMAT),
    ("dataset/boxes/" + "x" * 100 + "\x00.jpg", tarfile.GNU_FORMAT),  # a GNU long name keeps the NUL
    ("dataset/boxes/nul\x00.jpg", tarfile.PAX_FORMAT),  # so does a pax path record
    ("dataset/cir\ncles/a.jpg", tarfile.GNU_FORMAT),  # a class name with a newline
    ("dataset/boxes/esc\x1b[31m.jpg", tarfile.GNU_FORMAT),
])
def test_a_tar_member_name_with_a_control_character_is_refused(tmp_path, image_folder, name, fmt):
    data = folder_samples(image_folder)[0][2]
    extra = pax_named(name, data) if fmt == tarfile.PAX_FORMAT else file_info(name, data)
    src = write_tar(tmp_path / "names.tar", tree(image_folder) + [extra], fmt=fmt)
    dst = tmp_path / "out.zip"
    with pytest.raises(pf.InvalidSourceError, match="control character") as error:
        convert(src, dst, workers=1, quiet=True)
    assert src in str(error.value) and repr(name) in str(error.value)
    assert not dst.exists()
    summary = convert(src, dst, workers=1, on_error="skip", quiet=True)
    assert summary.samples == N and len(summary.failed) == 1 and repr(name) in summary.failed[0]


def test_a_zip_member_name_with_a_control_character_is_refused(tmp_path, image_folder):
    samples = folder_samples(image_folder)
    src = write_zip(tmp_path / "names.zip", tree_members(samples) + [("dataset/boxes/a\nb.jpg", samples[0][2])])
    with pytest.raises(pf.InvalidSourceError, match=r"'dataset/boxes/a\\nb.jpg' has a control character"):
        convert(src, tmp_path / "out.zip", workers=1, quiet=True)


@pytest.mark.parametrize("where", ["file", "class"])
def test_a_folder_key_or_class_with_a_control_character_is_refused(tmp_path, image_folder, where):
    root = tmp_path / "images"
    data = folder_samples(image_folder)[0][2]
    for c in ("boxes", "circles"):
        os.makedirs(root / c)
        for i in range(3):
            (root / c / f"{i}.jpg").write_bytes(data)
    odd = root / "boxes" / "new\nline.jpg" if where == "file" else root / "str\nipes" / "0.jpg"
    os.makedirs(odd.parent, exist_ok=True)
    odd.write_bytes(data)
    with pytest.raises(pf.InvalidSourceError, match="control character") as error:
        convert(root, tmp_path / "out.zip", workers=1, quiet=True)
    shown = "'boxes/new\\nline.jpg'" if where == "file" else "'str\\nipes'"
    assert shown in str(error.value) and str(root) in str(error.value)
    assert not (tmp_path / "out.zip").exists()


def test_a_webdataset_class_name_with_a_control_character_is_refused(tmp_path, image_folder):
    data = folder_samples(image_folder)[0][2]
    entries = []
    for i, label in enumerate([b"cat", b"dog", b"b\x07ell"]):
        entries += [file_info(f"{i:06d}.jpg", data), file_info(f"{i:06d}.cls", label)]
    src = write_tar(tmp_path / "shard.tar", entries)
    with pytest.raises(pf.InvalidSourceError, match=r"class name 'b\\x07ell' has a control character"):
        open_source(src)


# ---- names found twice ----------------------------------------------------------------------------------
@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tar.gz"])
def test_a_name_found_twice_in_a_tar_reads_as_the_last_with_one_warning(tmp_path, image_folder, compress):
    samples = folder_samples(image_folder)
    first, last = samples[0][2], samples[-1][2]
    name = "dataset/" + samples[0][0]
    rest = [entry for entry in tree(image_folder) if entry[0].name != name]
    entries = [file_info(name, first)] + rest + [file_info(name, last)]
    src = write_tar(tmp_path / "twice.tar", entries, compress=compress)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with open_source(src) as source:
            by_key = {source.key(i): sample.data for i, sample in enumerate(source)}
    found = member_warnings(caught)
    assert len(found) == 1 and "found more than once" in found[0] and repr(name) in found[0]
    assert len(by_key) == N and by_key[samples[0][0]] == last


def test_a_name_found_twice_in_a_zip_reads_as_the_last_with_one_warning(tmp_path, image_folder):
    samples = folder_samples(image_folder)
    name = "dataset/" + samples[0][0]
    members = [m for m in tree_members(samples) if m[0] != name] + [(name, samples[1][2]), (name, samples[2][2])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile's own "Duplicate name" warning
        src = write_zip(tmp_path / "twice.zip", members)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with open_source(src) as source:
            by_key = {source.key(i): source.load(i) for i in range(len(source))}
    found = member_warnings(caught)
    assert len(found) == 1 and repr(name) in found[0]
    assert len(by_key) == N and by_key[samples[0][0]] == samples[2][2]


def test_a_name_found_twice_in_a_webdataset_shard_reads_as_the_last(tmp_path, image_folder):
    samples = folder_samples(image_folder)
    entries = []
    for i in range(3):
        entries += [file_info(f"{i:06d}.jpg", samples[i][2]), file_info(f"{i:06d}.cls", b"%d" % (i % 2))]
    entries.append(file_info("000000.jpg", samples[5][2]))
    src = write_tar(tmp_path / "shard.tar", entries)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with open_source(src) as source:
            by_key = {source.key(i): sample.data for i, sample in enumerate(source)}
    assert len(member_warnings(caught)) == 1
    assert len(by_key) == 3 and by_key["000000.jpg"] == samples[5][2]


def test_a_member_tar_found_twice_reads_as_the_last_one_and_only_its_members(tmp_path, image_folder):
    samples = folder_samples(image_folder)
    members = nested_members(samples)
    stale = tar_bytes([("old.jpg", samples[0][2])])
    src = write_tar(tmp_path / "nested.tar", [file_info("boxes.tar", stale)] + [file_info(n, d) for n, d in members])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with open_source(src) as source:
            keys = [source.key(i) for i in range(len(source))]
    assert len(member_warnings(caught)) == 1 and "'boxes.tar'" in member_warnings(caught)[0]
    assert len(keys) == N and "boxes/old.jpg" not in keys


# ---- the Hub importer: files that are no regular file ------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("where", ["image", "card", "shard", "state", "arrow"])
def test_a_fifo_in_a_hub_folder_is_refused_not_opened_for_good(tmp_path, image_folder, where):
    """A FIFO (or a folder) where a file is read: reading one waits for a writer that never comes."""
    pytest.importorskip("pyarrow")
    from .test_hub_sources import bad_rows, sample_rows, write_hub, write_saved

    src = tmp_path / "dataset"
    if where == "image":
        files = write_hub(src, bad_rows(image_folder, 17, image=(None, "pipe.jpg")))
        os.mkfifo(src / "pipe.jpg")
        with open_source(src) as source:
            with pytest.raises(pf.CorruptSampleError, match=r"'pipe.jpg' cannot be read: .*not a regular file") \
                    as error:
                source.load(17)
        assert f"{files[2]}:row 1" in str(error.value)
        summary = convert(src, tmp_path / "out.zip", workers=1, on_error="skip", quiet=True)
        assert summary.samples == N - 1 and "pipe.jpg" in summary.failed[0]
        return
    if where in ("state", "arrow"):
        files = write_saved(src / "train", sample_rows(image_folder), files=1)
        (src / "dataset_dict.json").write_text('{"splits": ["train"]}')
        named = src / "train" / "state.json" if where == "state" else files[0]
    else:
        files = write_hub(src, sample_rows(image_folder))
        named = src / "README.md" if where == "card" else files[1]
    os.unlink(named)
    os.mkfifo(named)
    with pytest.raises(pf.PackedFormatError, match="not a regular file") as error:
        open_source(src)
    assert str(named) in str(error.value)

"""Bad input gets a PackedFormatError naming the path (and sample), never a bare crash."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import zipfile

import h5py
import lmdb
import numpy as np
import pytest

import packed_formats as pf
from packed_formats import codecs
from packed_formats.backends import hdf5, memmap
from packed_formats.backends import lmdb as lmdb_backend
from packed_formats.backends import zip as zip_backend
from packed_formats.manifest import FORMAT_VERSION


def copy_archive(src: str, dst_dir) -> str:
    dst = os.path.join(dst_dir, os.path.basename(src))
    (shutil.copytree if os.path.isdir(src) else shutil.copyfile)(src, dst)
    return dst


def data_file(path: str, mode: str) -> str:
    """The file that holds the sample bytes, as the archive's backend says."""
    with pf.open_archive(path) as reader:
        assert reader.mode == mode
        return reader.backend.data_file()


def flip_byte_inside_sample(path: str, mode: str, i: int) -> None:
    """Flip one byte in the middle of sample i's stored bytes, wherever the format keeps them.

    (LMDB's copy-on-write pages may keep stale copies of a record: all are flipped.)
    """
    with pf.open_archive(path) as reader:
        payload = reader.read_bytes(i)
    target = data_file(path, mode)
    with open(target, "r+b") as file:
        content = file.read()
        start = content.find(payload)
        assert start >= 0, "the sample's bytes must be stored contiguously"
        while start >= 0:
            where = start + len(payload) // 2
            file.seek(where)
            file.write(bytes([content[where] ^ 0xFF]))
            start = content.find(payload, start + 1)


def rewrite_manifest(path: str, fmt: str, **changes) -> None:
    """Change fields of the manifest stored in the archive at ``path``, in place, as its format stores it."""
    def changed(text) -> str:
        return json.dumps(dict(json.loads(text), **changes))

    def memmap_manifest() -> None:
        name = os.path.join(path, memmap.MANIFEST)
        with open(name) as file:
            text = changed(file.read())
        with open(name, "w") as file:
            file.write(text)

    def hdf5_manifest() -> None:
        with h5py.File(path, "r+") as file:
            file.attrs[hdf5.MANIFEST_ATTR] = changed(file.attrs[hdf5.MANIFEST_ATTR])
        hdf5.seal_metadata(path)  # an edit, not damage: what HDF5 parses is checked against its seal

    def lmdb_manifest() -> None:
        env = lmdb.open(path, subdir=False, lock=False)
        try:
            with env.begin(write=True) as txn:
                txn.put(lmdb_backend.MANIFEST_KEY, changed(txn.get(lmdb_backend.MANIFEST_KEY)).encode())
        finally:
            env.close()

    def zip_manifest() -> None:  # rebuild with the same members in the same order (the manifest is the last one)
        with zipfile.ZipFile(path) as old:
            members = [(info, old.read(info)) for info in old.infolist()]
        with zipfile.ZipFile(path, "w") as new:
            for info, data in members:
                new.writestr(info, changed(data) if info.filename == zip_backend.MANIFEST else data)

    rewriters = {"memmap": memmap_manifest, "hdf5": hdf5_manifest, "lmdb": lmdb_manifest, "zip": zip_manifest}
    if fmt not in rewriters:
        pytest.fail(f"rewrite_manifest does not know where format {fmt!r} keeps its manifest: add it here")
    rewriters[fmt]()


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.zip"
    with pytest.raises(pf.ArchiveNotFoundError, match="nope.zip"):
        pf.PackedDataset(missing)
    with pytest.raises(FileNotFoundError):  # also catchable as the builtin
        pf.open_archive(missing)


@pytest.mark.parametrize("content", ["empty", "text-files", "garbage-file", "empty-file"])
def test_paths_that_are_no_archive(tmp_path, content):
    path = tmp_path / "thing"
    if content == "empty":
        path.mkdir()
    elif content == "text-files":
        (path / "a").mkdir(parents=True)
        (path / "a" / "notes.txt").write_text("hello")
    elif content == "garbage-file":
        path.write_bytes(os.urandom(4096))
    else:
        path.write_bytes(b"")
    with pytest.raises(pf.UnknownFormatError, match="thing"):
        pf.PackedDataset(path)


@pytest.mark.parametrize("asked", pf.PACKED_FORMATS)
def test_an_archive_opened_as_another_format(archives, packed_kind, asked):
    path = archives[packed_kind]
    if asked == packed_kind[0]:
        assert pf.PackedDataset(path, format=asked).manifest.format == asked
        return
    with pytest.raises(pf.FormatMismatchError, match=f"{packed_kind[0]} archive, not {asked}") as error:
        pf.PackedDataset(path, format=asked)
    assert error.value.path == os.fspath(path)


def test_foreign_files_of_a_known_container_type(tmp_path):
    import zipfile

    import h5py
    import lmdb

    with zipfile.ZipFile(tmp_path / "other.zip", "w") as archive:
        archive.writestr("readme.txt", "not ours")
    with h5py.File(tmp_path / "other.h5", "w") as file:
        file["x"] = np.arange(3)
    env = lmdb.open(str(tmp_path / "other.lmdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    for name in ("other.zip", "other.h5", "other.lmdb"):
        with pytest.raises(pf.PackedFormatError, match=name):
            pf.open_archive(tmp_path / name)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.02])
def test_truncated_archives(archives, packed_kind, tmp_path, keep):
    fmt, mode = packed_kind
    path = copy_archive(archives[packed_kind], tmp_path)
    target = data_file(path, mode)
    os.truncate(target, int(os.path.getsize(target) * keep))
    with pytest.raises(pf.PackedFormatError, match=os.path.basename(path)):
        reader = pf.open_archive(path)
        reader.read_many(range(len(reader)))


def test_a_corrupted_sample_is_named_by_index_and_key(archives, packed_kind, tmp_path):
    path = copy_archive(archives[packed_kind], tmp_path)
    flip_byte_inside_sample(path, packed_kind[1], 5)
    dataset = pf.PackedDataset(path)
    key = dataset.key(5)
    with pytest.raises(pf.CorruptSampleError, match="checksum mismatch") as error:
        dataset[5]
    assert error.value.index == 5 and error.value.key == key
    assert key in str(error.value) and os.path.basename(path) in str(error.value)
    with pytest.raises(pf.CorruptSampleError):
        dataset.__getitems__([4, 5])
    dataset[4]  # the neighbours are fine
    dataset[6]


def test_a_manifest_that_says_complete_false_is_an_unsealed_archive(archives, packed_kind, tmp_path):
    path = copy_archive(archives[packed_kind], tmp_path)
    rewrite_manifest(path, packed_kind[0], complete=False)
    with pytest.raises(pf.IncompleteArchiveError, match="never sealed") as error:
        pf.open_archive(path)
    assert os.fspath(path) in str(error.value)


def test_an_archive_of_a_newer_format_version_asks_to_upgrade(archives, packed_kind, tmp_path):
    path = copy_archive(archives[packed_kind], tmp_path)
    newer = FORMAT_VERSION + 1
    rewrite_manifest(path, packed_kind[0], format_version=newer, a_field_from_the_future=1)
    with pytest.raises(pf.UnsupportedVersionError, match=f"format version {newer}") as error:
        pf.open_archive(path)
    assert "upgrade packed_formats" in str(error.value) and os.fspath(path) in str(error.value)
    assert isinstance(error.value, pf.PackedFormatError)


@pytest.mark.parametrize(
    "change", [{"complete": False}, {"format_version": FORMAT_VERSION + 1}], ids=["unsealed", "newer"]
)
def test_manifest_errors_name_the_archive(change):
    text = json.dumps(dict(json.loads(pf.ArchiveManifest("zip", "raw", 1, ("a",), (2, 2, 3)).to_json()), **change))
    with pytest.raises(pf.PackedFormatError) as error:
        pf.ArchiveManifest.from_json(text, path="data/train.zip")
    assert error.value.path == "data/train.zip" and str(error.value).startswith("data/train.zip: ")


def test_a_rewritten_but_unchanged_manifest_still_opens(archives, packed_kind, tmp_path):
    path = copy_archive(archives[packed_kind], tmp_path)
    rewrite_manifest(path, packed_kind[0])
    with pf.open_archive(path) as reader:
        assert len(reader) == len(reader.read_many(range(len(reader))))


def test_verify_false_skips_checksums(archives, tmp_path):
    path = copy_archive(archives[("memmap", "raw")], tmp_path)
    flip_byte_inside_sample(path, "raw", 2)
    pf.PackedDataset(path, verify=False)[2]


def test_undecodable_sample_with_a_valid_checksum(tmp_path, image_folder):
    """A JPEG that was already truncated when packed: decoding fails, naming the sample."""
    good = pf.open_archive(image_folder).read(0)
    path = tmp_path / "broken.zip"
    with pf.open_writer(path, format="zip", mode="encoded", classes=["a"]) as writer:
        writer.add(good, 0, "good.jpg")
        writer.add(good[: len(good) // 3], 0, "cut.jpg")
    dataset = pf.PackedDataset(path)
    dataset[0]
    with pytest.raises(pf.CorruptSampleError, match="cut.jpg") as error:
        dataset[1]
    assert error.value.index == 1


@pytest.mark.parametrize("index", [24, -25, 10**9, "3", 1.5])
def test_out_of_range_and_non_integer_indices(archives, kind, index):
    dataset = pf.PackedDataset(archives[kind])
    with pytest.raises(pf.SampleIndexError, match=os.path.basename(archives[kind])):
        dataset[index]
    with pytest.raises(IndexError):  # plain iteration protocols still work
        dataset.reader.read_many([0, 24])


def test_iterating_a_dataset_stops_at_its_end(archives):
    dataset = pf.PackedDataset(archives[("zip", "raw")])
    assert len(list(iter(dataset))) == len(dataset)


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_writers_reject_bad_samples_and_keep_nothing(tmp_path, fmt):
    path = tmp_path / f"bad.{fmt}"
    with pytest.raises(pf.InvalidSampleError, match=r"img-1.*8x8x3.*4x4x3"):
        with pf.open_writer(path, format=fmt, mode="raw", shape=(4, 4, 3)) as writer:
            writer.add(np.zeros((4, 4, 3), np.uint8), 0, "img-0")
            writer.add(np.zeros((8, 8, 3), np.uint8), 0, "img-1")
    with pytest.raises(pf.InvalidSampleError, match="not a JPEG or PNG"):
        with pf.open_writer(path, format=fmt, mode="encoded") as writer:
            writer.add(b"hello world", 0, "notes.txt")
    with pytest.raises(pf.InvalidSampleError, match="out of range for 2 classes"):
        with pf.open_writer(path, format=fmt, mode="raw", shape=(4, 4, 3), classes=["a", "b"]) as writer:
            writer.add(np.zeros((4, 4, 3), np.uint8), 2, "x")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_writers_never_overwrite_unless_asked(archives, tmp_path, fmt):
    path = copy_archive(archives[(fmt, "raw")], tmp_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(pf.ArchiveExistsError, match=os.path.basename(path)):
        pf.open_writer(path, format=fmt, mode="raw", shape=(4, 4, 3))
    assert len(pf.open_archive(path)) == 24
    with pf.open_writer(path, format=fmt, mode="raw", shape=(4, 4, 3), overwrite=True) as writer:
        writer.add(np.ones((4, 4, 3), np.uint8), 0)
    assert len(pf.open_archive(path)) == 1
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_a_failed_write_leaves_no_temporary_files(tmp_path, fmt):
    with pytest.raises(RuntimeError):
        with pf.open_writer(tmp_path / f"x.{fmt}", format=fmt, mode="encoded") as writer:
            writer.add(codecs.encode(np.zeros((4, 4, 3), np.uint8), "png"), 0)
            raise RuntimeError("user code failed mid-way")
    assert os.listdir(tmp_path) == []


KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import packed_formats as pf
    writer = pf.open_writer(sys.argv[1], format=sys.argv[2], mode="raw", shape=(8, 8, 3))
    for i in range(700):
        writer.add(np.full((8, 8, 3), i % 256, np.uint8), 0)
    print(writer.temp_path, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_a_killed_writer_leaves_nothing_that_opens(tmp_path, fmt):
    """Nothing at the destination, and its partial output refuses to open as a smaller archive."""
    destination = tmp_path / f"killed.{fmt}"
    run = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(destination), fmt], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert not destination.exists()
    partial = run.stdout.strip()
    assert os.path.exists(partial)
    with pytest.raises(pf.PackedFormatError, match=os.path.basename(partial)):
        pf.open_archive(partial, format=fmt)
    with pytest.raises(pf.PackedFormatError):
        pf.open_archive(partial)


def test_an_lmdb_map_that_does_not_fit_the_address_space_is_no_damage(archives):
    """Under ``ulimit -v`` (or a process already holding most of its limit) LMDB cannot map the file: the
    error must say so, not send the user to re-create an intact archive."""
    path = archives[("lmdb", "raw")]
    script = textwrap.dedent(f"""
        import mmap, resource
        import packed_formats as pf
        from packed_formats.errors import CorruptArchiveError
        statm = open("/proc/self/statm").read()
        used = int(statm.split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + (8 << 20), used + (8 << 20)))
        spare = mmap.mmap(-1, 7 << 20)  # what is left is less than the archive's map
        try:
            reader = pf.open_archive({path!r})
            reader.read(0)
        except CorruptArchiveError as exc:
            print("DAMAGE", exc)
        except pf.PackedFormatError as exc:
            print("REFUSED", exc)
        else:
            print("READ")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120).stdout
    if out.startswith("READ"):
        pytest.skip("the archive's map fitted in the room left (LMDB mapped less than the file)")
    assert out.startswith("REFUSED") and "address-space" in out and path in out, out

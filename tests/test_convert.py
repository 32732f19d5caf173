"""The conversion pipeline through its Python API: sources, resizing, determinism, sharding, safety."""

from __future__ import annotations

import collections
import errno
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

import packed_formats as pf
from packed_formats import codecs
from packed_formats.backends.zip import ZipWriter
from packed_formats.sources import open_source
from packed_formats.verify import verify_archive
from packed_formats.writing import parallel
from packed_formats.writing.convert import (
    clean_stale_temp_files,
    convert,
    estimated_archive_bytes,
    estimated_output_bytes,
)
from packed_formats.writing.parallel import ordered_map
from packed_formats.writing.prepare import Recipe, parse_size

from .conftest import CLASSES, PER_CLASS

SIZE = (24, 32)
N = len(CLASSES) * PER_CLASS


def archive_files(path):
    """Every file of an archive (a directory's files, sorted, or the file itself)."""
    if os.path.isdir(path):
        return sorted(os.path.join(path, name) for name in os.listdir(path))
    return [path]


def archive_contents(path):
    """{relative name: bytes} of every file of an archive ("" for a one-file archive)."""
    if not os.path.isdir(path):
        return {"": open(path, "rb").read()}
    return {
        os.path.relpath(os.path.join(root, name), path): open(os.path.join(root, name), "rb").read()
        for root, _, names in os.walk(path)
        for name in names
    }


def tree(root):
    """Every path under ``root``, relative and sorted."""
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files)


Usage = collections.namedtuple("Usage", "total used free")


def pretend_free(monkeypatch, free, total=10**12):
    """Make every file system look as if it had ``free`` bytes free."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(total, total - free, free))


def temp_files(directory):
    return [name for name in os.listdir(directory) if ".pf-tmp-" in name]


def read_all(path):
    with pf.open_archive(path) as reader:
        return [reader.read_bytes(i) for i in range(len(reader))], list(reader.labels), [
            reader.key(i) for i in range(len(reader))
        ]


@pytest.fixture
def corrupt_folder(tmp_path, image_folder):
    """The image folder plus one truncated JPEG and one non-image file."""
    root = tmp_path / "src"
    shutil.copytree(image_folder, root)
    good = (root / "boxes" / "boxes_00000.jpg").read_bytes()
    (root / "boxes" / "broken.jpg").write_bytes(good[: len(good) // 2])
    (root / "circles" / "notes.txt").write_text("not an image")
    return root


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_encoded_without_size_stores_the_source_files_bytes(tmp_path, image_folder, fmt):
    dst = tmp_path / f"out.{fmt}"
    convert(image_folder, dst, format=fmt, mode="encoded", workers=2, quiet=True)
    blobs, labels, keys = read_all(dst)
    source = pf.open_archive(image_folder)
    assert keys == [source.key(i) for i in range(len(source))]
    assert labels == list(source.labels)
    assert blobs == [source.read(i) for i in range(len(source))]


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_raw_conversion_stores_resized_pixels_close_to_a_plain_resize(tmp_path, image_folder, fmt):
    dst = tmp_path / f"out.{fmt}"
    convert(image_folder, dst, format=fmt, mode="raw", size=SIZE, workers=2, quiet=True)
    source = pf.open_archive(image_folder)
    with pf.open_archive(dst) as reader:
        assert reader.manifest.shape == SIZE + (3,)
        assert reader.classes == source.classes
        for i in range(len(source)):
            plain = np.asarray(codecs.open_image(source.read(i)).convert("RGB").resize(SIZE[::-1], Image.BILINEAR))
            difference = np.abs(reader.read(i).astype(int) - plain.astype(int)).mean()
            assert difference < 6, (i, difference)


def test_encoded_with_size_reencodes_at_that_size(tmp_path, image_folder):
    dst = tmp_path / "out.zip"
    convert(image_folder, dst, mode="encoded", size="20x30", encoding="png", workers=1, quiet=True)
    with pf.open_archive(dst) as reader:
        assert reader.manifest.encoding == "png"
        assert {codecs.decode(reader.read(i)).shape for i in range(len(reader))} == {(20, 30, 3)}


def test_shorter_side_center_crop_keeps_the_middle_and_the_aspect(tmp_path):
    root = tmp_path / "src" / "bands"
    root.mkdir(parents=True)
    pixels = np.zeros((40, 120, 3), dtype=np.uint8)
    pixels[:, :40, 0] = 255  # red left third, green middle, blue right third
    pixels[:, 40:80, 1] = 255
    pixels[:, 80:, 2] = 255
    Image.fromarray(pixels).save(root / "a.png")
    crop, stretch = tmp_path / "crop.zip", tmp_path / "stretch.zip"
    convert(root.parent, crop, mode="raw", size=20, resize_mode="shorter-side-center-crop", workers=1, quiet=True)
    convert(root.parent, stretch, mode="raw", size=20, resize_mode="stretch", workers=1, quiet=True)
    cropped, stretched = pf.open_archive(crop).read(0), pf.open_archive(stretch).read(0)
    assert cropped[:, :, 1].min() > 200 and cropped[:, :, [0, 2]].max() < 60
    assert stretched[:, 0, 0].min() > 200 and stretched[:, -1, 2].min() > 200


@pytest.mark.parametrize(
    "fmt", [f if f == "zip" else pytest.param(f, marks=pytest.mark.slow) for f in pf.PACKED_FORMATS]
)  # one format in the quick tier: the others write through the same pipeline
@pytest.mark.parametrize("mode,size", [("raw", SIZE), ("encoded", None), ("encoded", SIZE)], ids=["r", "e", "e2"])
def test_same_input_gives_byte_identical_archives_whatever_the_worker_count_and_time(
    tmp_path, image_folder, monkeypatch, fmt, mode, size
):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    outputs = []
    for workers in (1, 2):
        if outputs:
            time.sleep(1.1)  # a wall-clock time stored anywhere would now differ
        dst = tmp_path / f"w{workers}.{fmt}"
        convert(image_folder, dst, format=fmt, mode=mode, size=size, workers=workers, quiet=True)
        outputs.append(archive_contents(dst))
    assert sorted(outputs[0]) == sorted(outputs[1])
    for name in outputs[0]:
        assert outputs[0][name] == outputs[1][name], name


def test_the_manifest_records_the_creating_version_but_no_time(tmp_path, image_folder, monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    convert(image_folder, tmp_path / "out.zip", workers=1, quiet=True)
    manifest = pf.open_archive(tmp_path / "out.zip").manifest
    assert manifest.created_with == f"packed_formats {pf.__version__}" and manifest.created_at == ""


def test_source_date_epoch_sets_the_recorded_creation_time(tmp_path, image_folder, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    convert(image_folder, tmp_path / "out.zip", workers=1, quiet=True)
    assert pf.open_archive(tmp_path / "out.zip").manifest.created_at == "2023-11-14T22:13:20Z"


def test_raw_mode_without_size_is_refused(tmp_path, image_folder):
    with pytest.raises(ValueError, match="--size"):
        convert(image_folder, tmp_path / "out.zip", mode="raw", quiet=True)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "name, fmt", [("a.zip", "zip"), ("a.h5", "hdf5"), ("a.hdf5", "hdf5"), ("a.lmdb", "lmdb"), ("a.memmap", "memmap")]
)
def test_format_is_taken_from_the_destination_extension(tmp_path, image_folder, name, fmt):
    convert(image_folder, tmp_path / name, mode="encoded", quiet=True)
    with pf.open_archive(tmp_path / name) as reader:
        assert reader.format_name == fmt and len(reader) == N


def test_unknown_extension_asks_for_a_format(tmp_path, image_folder):
    with pytest.raises(ValueError, match="give --format"):
        convert(image_folder, tmp_path / "out.data", mode="encoded", quiet=True)
    assert os.listdir(tmp_path) == []


def test_archive_source_converts_to_another_format_and_mode(tmp_path, archives):
    source_path = archives[("zip", "encoded")]
    dst = tmp_path / "out.lmdb"
    summary = convert(source_path, dst, format="lmdb", mode="raw", size=SIZE, workers=2, quiet=True)
    source = pf.open_archive(source_path)
    with pf.open_archive(dst) as reader:
        assert summary.samples == len(reader) == len(source)
        assert [reader.key(i) for i in range(len(reader))] == [source.key(i) for i in range(len(source))]
        assert list(reader.labels) == list(source.labels)
        assert reader.classes == source.classes


def test_raw_archive_source_keeps_its_size_when_none_is_given(tmp_path, archives):
    dst = tmp_path / "out.memmap"
    convert(archives[("hdf5", "raw")], dst, format="memmap", mode="raw", workers=1, quiet=True)
    source = pf.open_archive(archives[("hdf5", "raw")])
    with pf.open_archive(dst) as reader:
        assert all(np.array_equal(reader.read(i), source.read(i)) for i in range(len(source)))


def flat_folder(tmp_path, image_folder):
    """Every image of the fixture folder copied flat into one folder; (root, sorted names, labels)."""
    root = tmp_path / "flat"
    root.mkdir()
    source = pf.open_archive(image_folder)
    names = []
    for i in range(len(source)):
        name = f"img_{i:03d}.jpg"
        (root / name).write_bytes(source.read(i))
        names.append(name)
    return root, names, [int(x) for x in source.labels]


def test_flat_folder_with_one_integer_label_per_line(tmp_path, image_folder):
    root, names, labels = flat_folder(tmp_path, image_folder)
    label_file = tmp_path / "labels.txt"
    label_file.write_text("".join(f"{label}\n" for label in labels))
    convert(root, tmp_path / "out.zip", labels=label_file, workers=1, quiet=True)
    with pf.open_archive(tmp_path / "out.zip") as reader:
        assert list(reader.labels) == labels
        assert [reader.key(i) for i in range(len(reader))] == names
        assert reader.classes == [str(c) for c in range(max(labels) + 1)]


def test_flat_folder_with_csv_labels_and_a_header(tmp_path, image_folder):
    root, names, labels = flat_folder(tmp_path, image_folder)
    label_file = tmp_path / "labels.csv"
    rows = [f"{name},{CLASSES[label]}" for name, label in zip(names, labels)]
    label_file.write_text("filename,label\n" + "\n".join(reversed(rows)) + "\n")
    convert(root, tmp_path / "out.zip", labels=label_file, workers=1, quiet=True)
    with pf.open_archive(tmp_path / "out.zip") as reader:
        assert reader.classes == sorted(CLASSES)
        assert [reader.classes[c] for c in reader.labels] == [CLASSES[label] for label in labels]


def test_flat_folder_with_too_few_labels_is_refused_naming_the_label_file(tmp_path, image_folder):
    root, names, labels = flat_folder(tmp_path, image_folder)
    label_file = tmp_path / "labels.txt"
    label_file.write_text("0\n1\n")
    with pytest.raises(pf.PackedFormatError, match="labels.txt.*2 labels.*24 images"):
        convert(root, tmp_path / "out.zip", labels=label_file, quiet=True)


def test_flat_folder_without_labels_says_to_give_them(tmp_path, image_folder):
    root, _, _ = flat_folder(tmp_path, image_folder)
    with pytest.raises(pf.UnknownFormatError, match="--labels"):
        convert(root, tmp_path / "out.zip", quiet=True)


def test_non_image_files_are_skipped_and_counted(tmp_path, corrupt_folder):
    os.remove(corrupt_folder / "boxes" / "broken.jpg")
    (corrupt_folder / "stripes" / "README").write_text("hi")
    summary = convert(corrupt_folder, tmp_path / "out.zip", workers=2, quiet=True)
    assert summary.skipped == 2
    assert summary.samples == N
    assert "2 files skipped" in summary.line() and "circles/notes.txt, stripes/README" in summary.line()


def test_corrupt_image_stops_the_conversion_naming_its_path(tmp_path, corrupt_folder):
    dst = tmp_path / "out.zip"
    with pytest.raises(pf.CorruptSampleError) as info:
        convert(corrupt_folder, dst, mode="raw", size=SIZE, workers=2, quiet=True)
    assert os.path.join("boxes", "broken.jpg") in str(info.value)
    assert info.value.path == os.path.join(corrupt_folder, "boxes", "broken.jpg")
    assert not dst.exists() and temp_files(tmp_path) == []


@pytest.mark.parametrize("mode,size", [("raw", SIZE), ("encoded", None)])
def test_corrupt_image_is_left_out_and_reported_with_on_error_skip(tmp_path, corrupt_folder, mode, size):
    dst = tmp_path / "out.zip"
    summary = convert(corrupt_folder, dst, mode=mode, size=size, workers=2, on_error="skip", quiet=True)
    assert summary.samples == N and len(summary.failed) == 1
    assert os.path.join("boxes", "broken.jpg") in summary.failed[0]
    with pf.open_archive(dst) as reader:
        assert "boxes/broken.jpg" not in [reader.key(i) for i in range(len(reader))]


def test_existing_destination_is_kept_without_overwrite(tmp_path, image_folder):
    dst = tmp_path / "out.zip"
    dst.write_bytes(b"precious")
    with pytest.raises(pf.ArchiveExistsError):
        convert(image_folder, dst, quiet=True)
    assert dst.read_bytes() == b"precious"


def test_overwrite_replaces_the_destination(tmp_path, image_folder):
    dst = tmp_path / "out.memmap"
    dst.mkdir()
    (dst / "old").write_text("old")
    convert(image_folder, dst, format="memmap", overwrite=True, workers=1, quiet=True)
    assert len(pf.open_archive(dst)) == N and not (dst / "old").exists()


@pytest.mark.parametrize("dst", [".", ".."], ids=["same", "parent"])
def test_destination_that_is_or_contains_the_source_is_refused(tmp_path, image_folder, dst):
    before = sorted(os.listdir(image_folder))
    with pytest.raises(pf.PackedFormatError, match="is the source"):
        convert(image_folder, os.path.join(image_folder, dst), format="memmap", overwrite=True, quiet=True)
    assert sorted(os.listdir(image_folder)) == before


@pytest.mark.parametrize("fmt", ["memmap", "zip"])
def test_destination_inside_the_source_is_refused_and_nothing_is_created(tmp_path, image_folder, fmt):
    source = tmp_path / "images"
    shutil.copytree(image_folder, source)
    before = tree(source)
    with pytest.raises(pf.PackedFormatError, match="inside the source"):
        convert(source, source / f"out.{fmt}", format=fmt, workers=1, quiet=True)
    assert tree(source) == before


# ---- disk space -----------------------------------------------------------------------


def zip_raw_estimate(image_folder) -> int:
    """The space a raw ZIP conversion of ``image_folder`` at SIZE checks for: its pixels and what ZIP adds."""
    source = open_source(image_folder)
    return estimated_archive_bytes(source, Recipe(mode="raw", size=SIZE), "zip")


def test_conversion_without_room_for_the_output_is_refused_before_writing(tmp_path, image_folder, monkeypatch):
    needed = zip_raw_estimate(image_folder)
    assert needed > N * SIZE[0] * SIZE[1] * 3  # the pixels, and the headers, index and manifest besides
    pretend_free(monkeypatch, needed - 1)
    with pytest.raises(pf.PackedFormatError) as error:
        convert(image_folder, tmp_path / "out.zip", mode="raw", size=SIZE, workers=1, quiet=True)
    message = str(error.value)
    assert message.startswith(f"{tmp_path}: not enough space to write {tmp_path / 'out.zip'}")
    assert f"({needed} bytes)" in message and f"({needed - 1} bytes) free" in message
    assert os.listdir(tmp_path) == []


def test_conversion_with_room_for_the_output_goes_ahead(tmp_path, image_folder, monkeypatch):
    pretend_free(monkeypatch, zip_raw_estimate(image_folder))
    convert(image_folder, tmp_path / "out.zip", mode="raw", size=SIZE, workers=1, quiet=True)
    assert len(pf.open_archive(tmp_path / "out.zip")) == N


def test_a_file_system_that_reports_no_size_is_not_refused(tmp_path, image_folder, monkeypatch):
    pretend_free(monkeypatch, 0, total=0)  # like sysfs or some FUSE mounts: statvfs says nothing
    convert(image_folder, tmp_path / "out.zip", workers=1, quiet=True)
    assert len(pf.open_archive(tmp_path / "out.zip")) == N


def test_encoded_output_is_estimated_as_the_source_files_bytes(image_folder):
    files = [os.path.join(d, n) for d, _, names in os.walk(image_folder) for n in names]
    source = open_source(image_folder)
    assert estimated_output_bytes(source, Recipe(mode="encoded")) == sum(map(os.path.getsize, files))


def test_a_full_disk_during_conversion_names_the_destination_and_leaves_nothing(tmp_path, image_folder, monkeypatch):
    def full(self, blob, i, crc):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ZipWriter, "append", full)
    with pytest.raises(pf.PackedFormatError, match="cannot write the archive: No space left on device") as error:
        convert(image_folder, tmp_path / "out.zip", workers=1, quiet=True)
    assert error.value.path == str(tmp_path / "out.zip") and str(tmp_path) in error.value.hint
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_sharded_conversion_opens_as_one_dataset(tmp_path, image_folder, fmt):
    single, sharded = tmp_path / f"one.{fmt}", tmp_path / f"many.{fmt}"
    convert(image_folder, single, format=fmt, mode="raw", size=SIZE, workers=1, quiet=True)
    summary = convert(image_folder, sharded, format=fmt, mode="raw", size=SIZE, shard_size=10, workers=2, quiet=True)
    assert [os.path.basename(p) for p in summary.parts] == [f"many-0000{k}.{fmt}" for k in range(3)]
    whole, parts = pf.PackedDataset(single), pf.PackedDataset(sharded)
    assert len(parts) == N and list(parts.targets) == list(whole.targets) and parts.classes == whole.classes
    batch, expected = parts.__getitems__([23, 0, 9, 10]), whole.__getitems__([23, 0, 9, 10])
    assert all(np.array_equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(batch, expected))
    assert [parts.key(i) for i in range(N)] == [whole.key(i) for i in range(N)]


def test_sharded_overwrite_removes_the_old_parts(tmp_path, image_folder):
    dst = tmp_path / "data.zip"
    convert(image_folder, dst, shard_size=5, workers=1, quiet=True)
    convert(image_folder, dst, shard_size=20, workers=1, quiet=True, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["data-00000.zip", "data-00001.zip", "data-samples.npz", "data.zip"]
    assert len(pf.open_archive(dst)) == N


def test_stale_temp_files_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".out.zip.pf-tmp-{dead_pid}-0123abcd"
    stale_part = tmp_path / f".out-00003.zip.pf-tmp-{dead_pid}-0123abcd"
    live = tmp_path / f".out.zip.pf-tmp-{os.getpid()}-0123abcd"
    other = tmp_path / f".other.zip.pf-tmp-{dead_pid}-0123abcd"
    for path in (stale, stale_part, live, other):
        path.write_bytes(b"x")
    removed = clean_stale_temp_files(tmp_path / "out.zip")
    assert sorted(removed) == sorted([str(stale), str(stale_part)])
    assert live.exists() and other.exists()


def test_parse_size_reads_n_and_height_x_width():
    assert parse_size("256") == (256, 256)
    assert parse_size("256x192") == (256, 192)
    assert parse_size(64) == (64, 64)
    for bad in ("0", "12x", "axb", "-3"):
        with pytest.raises(ValueError):
            parse_size(bad)


def _record_start(counter, i):
    with counter.get_lock():
        counter.value += 1
    return i


def test_ordered_map_returns_results_in_order_with_a_bounded_number_in_flight():
    counter = multiprocessing.get_context("fork").Value("i", 0)
    with ordered_map(_record_start, counter, 1000, workers=2, chunk_size=4) as results:
        first = next(results)
        time.sleep(0.5)  # give the workers every chance to run ahead
        started = counter.value
        rest = list(results)
    assert [first] + rest == list(range(1000))
    assert started <= (2 * 2 + 1 + 1) * 4


def _with_pid(_, i):
    return i, os.getpid()


@pytest.mark.slow
def test_ordered_map_hands_each_run_to_one_worker_and_still_returns_every_index_once_in_order():
    runs = list(range(0, 600, 40))  # runs of 40: whole chunks (at most a worker's share, 600 // 4)
    with ordered_map(_with_pid, None, 600, workers=2, runs=runs) as results:
        found = list(results)
    assert [i for i, _ in found] == list(range(600))
    assert all(len({pid for _, pid in found[r:r + 40]}) == 1 for r in runs)
    for odd in ([0, 700, 5, 5, 3, 90], [], [599], [0, 1, 2, 3]):  # whatever runs say, every index once, in order
        with ordered_map(_with_pid, None, 100, workers=2, runs=odd) as results:
            assert [i for i, _ in results] == list(range(100))


def _pixels_of(seed, i):
    """A result shaped like a raw conversion's: (True, decoded pixels), with one small array too."""
    pixels = np.random.default_rng(seed + i).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return True, pixels, pixels[:2, :2].copy(), f"key-{i}"


def _spill_dirs():
    """This process's spill folders (another test process may be converting at the same time)."""
    root, mine = parallel.SPILL_ROOT, f"{parallel.SPILL_PREFIX}{os.getpid()}-"
    return sorted(n for n in os.listdir(root) if n.startswith(mine)) if os.path.isdir(root) else []


@pytest.mark.parametrize("spill", [True, False], ids=["through-shared-memory", "through-the-pipe"])
def test_ordered_map_returns_large_arrays_intact_and_writable_and_leaves_no_spill_files(spill, monkeypatch):
    if not spill:
        monkeypatch.setattr(parallel, "SPILL_ROOT", "/nonexistent")
    spilled, restore = [], parallel._restore
    monkeypatch.setattr(parallel, "_restore", lambda path, results: spilled.append(path) or restore(path, results))
    before = _spill_dirs()
    with ordered_map(_pixels_of, 7, 40, workers=2, chunk_size=3) as results:
        got = list(results)
    for i, (ok, pixels, corner, key) in enumerate(got):
        _, expected, expected_corner, expected_key = _pixels_of(7, i)
        assert ok and key == expected_key and np.array_equal(corner, expected_corner)
        assert np.array_equal(pixels, expected)
        pixels[0, 0, 0] ^= 1  # the consumer may write into what it got
    assert _spill_dirs() == before
    assert len(spilled) == 14 and all(spilled) == (spill and os.path.isdir(parallel.SPILL_ROOT))


@pytest.mark.skipif(not os.path.isdir(parallel.SPILL_ROOT), reason="no /dev/shm here")
def test_ordered_map_removes_spill_directories_of_dead_conversions():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = os.path.join(parallel.SPILL_ROOT, f"{parallel.SPILL_PREFIX}{int(dead.stdout)}-x")
    os.makedirs(orphan)
    open(os.path.join(orphan, "chunk-0"), "wb").close()
    with ordered_map(_pixels_of, 1, 4, workers=2) as results:
        list(results)
    assert not os.path.exists(orphan)


def test_a_failed_spill_sends_the_results_through_the_pipe(tmp_path):
    results = [(True, np.zeros((128, 128, 3), np.uint8))]
    path, out = parallel._spill(results, os.fspath(tmp_path / "missing-dir" / "chunk-0"))
    assert path is None and out is results


def flip_zip_sample_byte(path, i):
    """Flip one byte in the middle of sample i of a ZIP archive (located through its index)."""
    with pf.open_archive(path) as reader:
        position = int(reader.index.positions[i]) + reader.index.nbytes(i) // 2
    with open(path, "r+b") as file:
        file.seek(position)
        byte = file.read(1)
        file.seek(position)
        file.write(bytes([byte[0] ^ 0x40]))


def test_verify_archive_finds_a_flipped_byte_in_a_later_shard(tmp_path, image_folder):
    dst = tmp_path / "data.zip"
    summary = convert(image_folder, dst, mode="raw", size=SIZE, shard_size=10, workers=1, quiet=True)
    flip_zip_sample_byte(summary.parts[1], 3)
    report = verify_archive(dst)
    assert report.bad_count == 1 and report.bad[0].index == 13
    assert report.bad[0].key == pf.open_archive(dst).key(13)


def test_verify_archive_counts_every_bad_sample_but_describes_at_most_max_report(tmp_path, image_folder):
    dst = tmp_path / "data.zip"
    convert(image_folder, dst, mode="raw", size=SIZE, workers=1, quiet=True)
    for i in (2, 7, 11):
        flip_zip_sample_byte(dst, i)
    report = verify_archive(dst, max_report=2)
    assert not report.ok and report.bad_count == 3
    assert [b.index for b in report.bad] == [2, 7]
    assert "... and 1 more bad samples" in report.lines()


def test_overwriting_a_sharded_archive_with_a_single_one_removes_its_parts(tmp_path, image_folder):
    dst = tmp_path / "data.zip"
    convert(image_folder, dst, shard_size=10, workers=1, quiet=True)
    convert(image_folder, dst, workers=1, quiet=True, overwrite=True)
    assert os.listdir(tmp_path) == ["data.zip"]
    assert pf.detect_format(dst) == "zip"


def test_sharded_dataset_pickles_as_a_description_and_reads_the_same(tmp_path, image_folder):
    dst = tmp_path / "data.hdf5"
    convert(image_folder, dst, mode="raw", size=SIZE, shard_size=7, workers=1, quiet=True)
    dataset = pf.PackedDataset(dst, output="numpy")
    dataset[20]  # opens handles in this process; they must not travel
    clone = pickle.loads(pickle.dumps(dataset))
    assert all(np.array_equal(clone[i][0], dataset[i][0]) for i in range(N))


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.2)  # where the handler would have raised


@pytest.mark.parametrize("name,exitcode", [("SIGINT", 0), ("SIGTERM", -signal.SIGTERM)])
def test_a_signal_reaching_a_worker_forked_before_its_handlers_are_set_is_no_traceback(name, exitcode):
    """A Ctrl-C reaches the whole process group, also a conversion worker forked that instant: before its
    initializer runs it still has the conversion's handler.  There the handler does what the worker's own
    would: SIGINT ignored (the main process stops the conversion), the others end it, no traceback."""
    import multiprocessing

    from packed_formats.writing.convert import _signals_interrupt

    with _signals_interrupt():
        child = multiprocessing.get_context("fork").Process(target=_signal_self, args=(getattr(signal, name),))
        child.start()
        child.join(30)
    assert child.exitcode == exitcode

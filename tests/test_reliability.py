"""Known ways image datasets fail under DataLoader workers and odd archives, each checked on real archives on disk."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import random
import threading
import zipfile
import zlib

import numpy as np
import pytest
import torch
from PIL import ImageFile
from torch.utils.data import ConcatDataset, DataLoader, Subset

import packed_formats as pf
from packed_formats import codecs, handles
from packed_formats.backends import lmdb as lmdb_backend
from packed_formats.backends import zip as zip_backend
from packed_formats.checksum import array_crc32
from packed_formats.index import npy_bytes
from packed_formats.verify import verify_archive

from .probe import Pair, as_list


@pytest.fixture(autouse=True)
def every_handle_is_released():
    """Each test closes what it opened: this process's handle table ends as it began."""
    gc.collect()
    before = handles.open_handles()
    yield
    gc.collect()  # a reader a test dropped inside a reference cycle (an exception's traceback keeps its frame)
    assert handles.open_handles() == before


# ---- truncated images, whatever PIL.ImageFile.LOAD_TRUNCATED_IMAGES says ---------------


@pytest.fixture
def pillow_loads_truncated_images(monkeypatch):
    """What many training scripts do at import time; restored after the test."""
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)


def archive_with_a_truncated_sample(tmp_path, image_folder, fmt: str, encoding: str) -> str:
    """Samples: 0 intact, 1 "1-cut.<ext>" cut after two thirds of its bytes (its CRC matches), 2 intact."""
    with pf.open_archive(image_folder) as source:
        good = source.read(0)
    if encoding == "png":
        good = codecs.encode(codecs.decode(good), "png")
    cut = good[: len(good) * 2 // 3]
    name = f"1-cut.{'jpg' if encoding == 'jpeg' else 'png'}"
    if fmt == "folder":
        root = tmp_path / "images"
        (root / "a").mkdir(parents=True)
        for key, data in (("0.jpg", good), (name, cut), ("2.jpg", good)):
            (root / "a" / key).write_bytes(data)
        return os.fspath(root)
    path = tmp_path / f"cut.{fmt}"
    with pf.open_writer(path, format=fmt, mode="encoded", classes=["a"]) as writer:
        for key, data in (("0.jpg", good), (name, cut), ("2.jpg", good)):
            writer.add(data, 0, key)
    return os.fspath(path)


@pytest.mark.parametrize("encoding", ["jpeg", "png"])
@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS + ("folder",))
def test_truncated_images_are_refused_even_when_pillow_is_told_to_load_them(
    tmp_path, image_folder, pillow_loads_truncated_images, fmt, encoding
):
    path = archive_with_a_truncated_sample(tmp_path, image_folder, fmt, encoding)
    for output in ("tensor", "pil", "numpy"):
        dataset = pf.PackedDataset(path, output=output)
        dataset[0]
        dataset[2]  # its neighbours decode
        with pytest.raises(pf.CorruptSampleError, match="truncated") as error:
            dataset[1]
        assert error.value.index == 1 and error.value.path == path
        assert os.path.basename(path) in str(error.value) and "index 1" in str(error.value)
        assert error.value.key.endswith("1-cut." + ("jpg" if encoding == "jpeg" else "png"))
        with pytest.raises(pf.CorruptSampleError):
            dataset.__getitems__([0, 1])
        dataset.close()
    report = verify_archive(path, decode=True)
    assert not report.ok and [bad.index for bad in report.bad] == [1]
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # the user's setting is left as it was


@pytest.mark.parametrize("size", [None, 16], ids=["stored-size", "draft-decoded"])
def test_make_loader_refuses_truncated_images_even_when_pillow_is_told_to_load_them(
    tmp_path, image_folder, pillow_loads_truncated_images, size
):
    path = archive_with_a_truncated_sample(tmp_path, image_folder, "zip", "jpeg")
    loader = pf.make_loader(path, batch_size=3, shuffle=False, num_workers=0, size=size)
    with pytest.raises(pf.CorruptSampleError, match="truncated") as error:
        next(iter(loader))
    assert error.value.index == 1 and error.value.key.endswith("1-cut.jpg")
    loader.reader.close()


@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_convert_refuses_truncated_images_even_when_pillow_is_told_to_load_them(
    tmp_path, image_folder, pillow_loads_truncated_images, mode
):
    source = archive_with_a_truncated_sample(tmp_path, image_folder, "folder", "jpeg")
    target = tmp_path / "out.zip"
    options = dict(format="zip", mode=mode, size=16, workers=1, quiet=True)
    with pytest.raises(pf.PackedFormatError, match="truncated") as error:
        pf.convert(source, target, **options)
    assert "1-cut.jpg" in str(error.value) and not target.exists()


def test_intact_images_decode_the_same_whatever_pillow_is_told(archives, monkeypatch):
    dataset = pf.PackedDataset(archives[("zip", "encoded")], output="tensor")
    strict = [dataset[i][0] for i in range(len(dataset))]
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    assert all(torch.equal(dataset[i][0], strict[i]) for i in range(len(dataset)))
    dataset.close()


# ---- LMDB map growth ----------------------------------------------------------------------


def test_lmdb_writer_grows_its_map_when_it_fills_up(tmp_path, monkeypatch):
    initial = 64 << 10
    monkeypatch.setattr(lmdb_backend, "_INITIAL_MAP_SIZE", initial)
    shape = (16, 16, 3)
    pixels = np.random.default_rng(5).integers(0, 256, (600,) + shape, dtype=np.uint8)  # 450 KiB
    path = tmp_path / "grown.lmdb"
    with pf.open_writer(path, format="lmdb", mode="raw", shape=shape) as writer:
        for image in pixels:
            writer.add(image, 0)
    assert os.path.getsize(path) > 4 * initial  # LMDB never writes beyond its map: the map grew
    with pf.open_archive(path) as reader:
        assert len(reader) == len(pixels)
        assert np.array_equal(reader.read_many(range(len(pixels))), pixels)


# ---- more members than a plain ZIP holds --------------------------------------------------


@pytest.mark.slow
def test_zip_with_more_than_65535_members_uses_zip64_and_reads_back(tmp_path):
    count = 70_000
    values = [np.full((1, 1, 1), v, np.uint8) for v in range(256)]
    path = tmp_path / "many.zip"
    with pf.open_writer(path, format="zip", mode="raw", shape=(1, 1, 1)) as writer:
        for i in range(count):
            writer.add(values[i % 256], 0)
    with zipfile.ZipFile(path) as archive:  # the standard library reads it too
        samples = [n for n in archive.namelist() if n.startswith("samples/")]
        assert len(samples) == count
        assert archive.read(samples[65_536]) == bytes([65_536 % 256])
    with pf.open_archive(path) as reader:
        assert len(reader) == count
        picks = [0, 65_534, 65_535, 65_536, count - 1]
        assert [int(reader.read(i)[0, 0, 0]) for i in picks] == [i % 256 for i in picks]
        assert reader.read_many(picks)[:, 0, 0, 0].tolist() == [i % 256 for i in picks]


# ---- an archive replaced under its reader -------------------------------------------------


def write_filled(path, fmt: str, value: int, count: int, overwrite: bool = False) -> None:
    with pf.open_writer(path, format=fmt, mode="raw", shape=(4, 4, 3), overwrite=overwrite) as writer:
        for _ in range(count):
            writer.add(np.full((4, 4, 3), value, np.uint8), 0)


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_an_archive_replaced_under_its_dataset_is_refused_not_misread(tmp_path, fmt):
    path = tmp_path / f"moving.{fmt}"
    write_filled(path, fmt, 1, count=4)
    touched, untouched = pf.PackedDataset(path, output="tensor"), pf.PackedDataset(path)
    touched[0]  # holds the old file open
    write_filled(path, fmt, 2, count=6, overwrite=True)  # published by os.replace
    assert int(touched[3][0][0, 0, 0]) == 1  # an open handle keeps reading the old file, whole
    touched.close()  # now nothing holds the old file
    with pytest.raises(pf.ArchiveChangedError, match=f"moving.{fmt}") as error:
        untouched[0]  # opens now: the file is not the one its index came from
    assert error.value.path == os.fspath(path)
    assert len(pf.PackedDataset(path)) == 6


# ---- ZIP layouts the offset index cannot trust --------------------------------------------


def rewrite_zip(src: str, dst, *, compression=zipfile.ZIP_STORED, force_zip64=False, fix_positions=True) -> None:
    """Copy our ZIP member by member, changing how samples are stored.

    force_zip64 gives each sample's *local* header a zip64 extra field that the
    central directory does not have; fix_positions rewrites the index to the
    new data positions (else the old ones stay, now wrong).
    """
    with zipfile.ZipFile(src) as source, zipfile.ZipFile(dst, "w") as target:
        positions = []
        for info in source.infolist():
            data = source.read(info)
            if info.filename == zip_backend.INDEX_DIR + "positions.npy" and fix_positions:
                data = npy_bytes(np.asarray(positions, dtype=np.int64))
            if info.filename == zip_backend.MANIFEST and fix_positions:  # re-sealed by the rewriting tool
                manifest = pf.ArchiveManifest.from_json(data)
                crcs = dict(manifest.index_crc32, positions=array_crc32(np.asarray(positions, dtype=np.int64)))
                data = dataclasses.replace(manifest, index_crc32=tuple(sorted(crcs.items()))).to_json().encode()
            copy = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            copy.compress_type = compression if info.filename.startswith("samples/") else zipfile.ZIP_STORED
            is_sample = info.filename.startswith("samples/")
            with target.open(copy, "w", force_zip64=force_zip64 and is_sample) as member:
                if is_sample:
                    positions.append(target.fp.tell())  # the local header is written: data starts here
                member.write(data)


def test_zip_data_positions_follow_the_local_header_not_the_central_directory(archives, tmp_path):
    src = archives[("zip", "encoded")]
    path = tmp_path / "local-extra.zip"
    rewrite_zip(src, path, force_zip64=True)
    with zipfile.ZipFile(path) as archive:
        info = archive.infolist()[0]
        header = path.read_bytes()[info.header_offset : info.header_offset + 30]
        assert int.from_bytes(header[28:30], "little") != len(info.extra)  # the two extra fields differ
    with pf.open_archive(src) as original, pf.open_archive(path) as rewritten:
        assert [rewritten.read(i) for i in range(len(rewritten))] == [original.read(i) for i in range(len(original))]


def test_zip_index_positions_that_miss_the_data_are_refused(archives, tmp_path):
    path = tmp_path / "shifted.zip"
    rewrite_zip(archives[("zip", "encoded")], path, force_zip64=True, fix_positions=False)
    with pytest.raises(pf.CorruptArchiveError, match=r"shifted\.zip.*positions in the index do not match"):
        pf.open_archive(path)


def test_zip_with_compressed_samples_is_refused_with_a_clear_error(archives, tmp_path):
    path = tmp_path / "deflated.zip"
    rewrite_zip(archives[("zip", "raw")], path, compression=zipfile.ZIP_DEFLATED)
    with pytest.raises(pf.CorruptArchiveError, match=r"deflated\.zip.*compressed; samples must be STORED"):
        pf.PackedDataset(path)


# ---- two datasets on one LMDB path inside one worker ---------------------------------------


def test_two_lmdb_datasets_on_one_path_share_one_environment_inside_a_forked_worker(archives, tmp_path):
    path = archives[("lmdb", "raw")]
    alias = tmp_path / "same.lmdb"
    os.symlink(path, alias)  # another spelling of the same file
    train, val = pf.PackedDataset(path, output="tensor"), pf.PackedDataset(alias, output="tensor")
    expected = [zlib.crc32(train[i][0].numpy().tobytes()) for i in range(len(train))]
    val[0]  # the parent holds the environment when the workers fork
    loader = DataLoader(
        Pair(train, val),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context("fork"),
        collate_fn=as_list,
    )
    items = [item for batch in loader for item in batch]
    assert sorted(item["index"] for item in items) == list(range(len(train)))
    for item in items:
        assert item["pid"] != os.getpid()
        assert item["crcs"] == [expected[item["index"]]] * 2
        assert item["users"] == 2  # one environment per process, used by both datasets
    train.close()
    val.close()


# ---- Subset and ConcatDataset around a PackedDataset --------------------------------------


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_subset_and_concat_dataset_deliver_the_right_samples_with_workers(archives, fmt):
    dataset = pf.PackedDataset(archives[(fmt, "raw")], output="tensor")
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    picks = [23, 5, 5, 0, 17, 2, 9]  # unsorted, with a repeat: Subset hands these to __getitems__
    subset = Subset(dataset, picks)
    for wrapped, wanted in ((subset, picks), (ConcatDataset([dataset, subset]), list(range(len(dataset))) + picks)):
        batches = list(DataLoader(wrapped, batch_size=4, num_workers=2))
        got_images = torch.cat([batch[0] for batch in batches])
        got_labels = torch.cat([batch[1] for batch in batches])
        assert torch.equal(got_images, images[wanted])
        assert got_labels.tolist() == dataset.targets[wanted].tolist()
    dataset.close()


# ---- many threads reading one reader -------------------------------------------------------


def test_threads_reading_one_reader_at_once_get_every_sample_exact(archives, packed_kind):
    path = archives[packed_kind]
    with pf.open_archive(path) as reader:
        expected = [reader.read_bytes(i) for i in range(len(reader))]
    reader = pf.open_archive(path)  # nothing open yet: the threads race to open it
    opens = handles.opens_in_this_process()
    start = threading.Barrier(8)
    failures = []

    def read_shuffled(seed: int) -> None:
        try:
            order = list(range(len(expected)))
            random.Random(seed).shuffle(order)
            start.wait()
            for _ in range(15):
                for i in order:
                    assert reader.read_bytes(i) == expected[i], f"sample {i} differs"
                batch = reader.read_many(order[:9])
                got = [bytes(b) for b in batch] if packed_kind[1] == "encoded" else [b.tobytes() for b in batch]
                assert got == [expected[i] for i in order[:9]], "a batch differs"
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)
            start.abort()

    threads = [threading.Thread(target=read_shuffled, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []
    assert handles.opens_in_this_process() == opens + 1  # one handle, opened once, shared
    reader.close()
    assert reader.handle_key not in handles.open_handles()  # and closed with it

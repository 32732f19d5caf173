"""Each encoded image's (width, height) in the index, so that grouping by aspect ratio reads no image."""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
from PIL import Image

import packed_formats as pf
from packed_formats.backends.set_samples import npz_arrays
from packed_formats.checksum import array_crc32
from packed_formats.manifest import canonical_json
from packed_formats.verify import verify_archive
from packed_formats.writing import parts
from packed_formats.writing.convert import convert

from .test_copied_sets import copy_with_boto3, reseal, sample_arrays_of

SHARD = 10  # 24 samples: parts of 10, 10, 4


def source_sizes(image_folder: str, reader) -> np.ndarray:
    """int64 [N,2]: the (width, height) of each of ``reader``'s samples, from the source image of its key."""
    sizes = []
    for i in range(len(reader)):
        with Image.open(os.path.join(image_folder, reader.key(i))) as image:
            sizes.append(image.size)
    return np.asarray(sizes, dtype=np.int64)


def encoded(image_folder: str, dst: str, fmt: str = "memmap", **options) -> str:
    convert(image_folder, dst, format=fmt, mode="encoded", workers=1, quiet=True, **options)
    return dst


def reseal_memmap(path: str, **arrays) -> None:
    """Replace (or, given None, remove) index arrays of the memmap archive at ``path`` and seal its manifest
    again over them, as one who edits both would: only the arrays' own checks can tell."""
    with open(os.path.join(path, "manifest.json")) as file:
        data = json.load(file)
    for name, array in arrays.items():
        target = os.path.join(path, f"{name}.npy")
        if array is None:
            os.unlink(target)
            del data["index_crc32"][name]
        else:
            np.save(target, array, allow_pickle=False)
            data["index_crc32"][name] = array_crc32(array)
    data.pop("manifest_crc32", None)
    data["manifest_crc32"] = zlib.crc32(canonical_json(data).encode())
    with open(os.path.join(path, "manifest.json"), "w") as file:
        file.write(canonical_json(data))


def destroy_images(path: str) -> None:
    """Zero every stored byte of the memmap archive's images (its index left as it is)."""
    data = np.load(os.path.join(path, "data.npy"), mmap_mode="r+")
    data[:] = 0
    data.flush()
    del data


# ---- recorded at write time --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_every_format_records_each_encoded_images_size_and_a_raw_archive_none(image_folder, tmp_path, fmt):
    path = encoded(image_folder, str(tmp_path / f"a.{fmt}"), fmt)
    with pf.open_archive(path) as reader:
        assert reader.index.widths.dtype == np.int32 and reader.index.heights.dtype == np.int32
        np.testing.assert_array_equal(reader.index.image_sizes(), source_sizes(image_folder, reader))
    convert(image_folder, str(tmp_path / f"raw.{fmt}"), format=fmt, mode="raw", size=16, workers=1, quiet=True)
    with pf.open_archive(str(tmp_path / f"raw.{fmt}")) as reader:
        assert reader.index.image_sizes() is None and "widths" not in reader.index.arrays()


def test_a_resized_conversion_and_one_archive_into_another_record_the_stored_sizes(image_folder, tmp_path):
    resized = encoded(image_folder, str(tmp_path / "small.zip"), "zip", size=(12, 20))
    again = encoded(resized, str(tmp_path / "again.lmdb"), "lmdb")
    for path in (resized, again):
        with pf.open_archive(path) as reader:
            assert reader.index.image_sizes().tolist() == [[20, 12]] * len(reader)


def test_a_set_of_parts_its_join_and_its_sample_index_record_the_sizes(image_folder, tmp_path):
    whole = encoded(image_folder, str(tmp_path / "whole.zip"), "zip", shard_size=SHARD)
    joined = str(tmp_path / "tasks.hdf5")
    for i in range(3):
        convert(image_folder, joined, format="hdf5", mode="encoded", shard_size=SHARD, workers=1, quiet=True,
                part=(i, 3), overwrite=False)
    assert parts.join(joined) == joined
    for path in (whole, joined):
        with pf.open_archive(path) as reader:
            expected = source_sizes(image_folder, reader)
            np.testing.assert_array_equal(reader.index.image_sizes(), expected)
        with open(path) as file:
            samples = os.path.join(os.path.dirname(path), json.load(file)["samples"]["name"])
        with open(samples, "rb") as file:  # what upload copies beside the set: a remote set reads it
            arrays = npz_arrays(samples, file.read())
        np.testing.assert_array_equal(np.stack([arrays["widths"], arrays["heights"]], axis=1), expected)
        assert verify_archive(path, decode=True).ok


def test_bytes_whose_header_does_not_read_are_stored_with_an_unknown_size(tmp_path):
    path = str(tmp_path / "odd.memmap")
    good = pf.codecs.encode(np.zeros((6, 9, 3), dtype=np.uint8), "png", 90)
    with pf.open_writer(path, format="memmap", mode="encoded", classes=["a"]) as writer:
        writer.add(good, 0)
        writer.add(b"\xff\xd8\xff" + bytes(20), 0)  # a JPEG's first bytes, then nothing of a header
    with pf.open_archive(path) as reader:
        assert reader.index.image_sizes().tolist() == [[9, 6], [0, 0]]
        grouping = pf.GroupByAspectRatio(k=3)
        assert grouping.sizes_of(reader, skip_bad=True).tolist() == [[9, 6], [1, 1]]  # read, and counted square
        with pytest.raises(pf.CorruptSampleError, match="sample index 1"):
            grouping.sizes_of(reader, skip_bad=False)


# ---- read without reading a sample --------------------------------------------------------------------------
def test_grouping_by_aspect_ratio_reads_no_image_when_the_index_records_the_sizes(image_folder, tmp_path):
    path = encoded(image_folder, str(tmp_path / "a.memmap"))
    with pf.open_archive(path) as reader:
        expected = source_sizes(image_folder, reader)
    destroy_images(path)  # any image read now fails its checksum
    with pf.open_archive(path) as reader:
        with pytest.raises(pf.CorruptSampleError):
            reader.read(0)
        np.testing.assert_array_equal(pf.GroupByAspectRatio(k=3).sizes_of(reader, skip_bad=False), expected)
    pf.make_loader(path, batch_size=4, shuffle=pf.GroupByAspectRatio(k=3), num_workers=0)  # reads none to start


def test_an_index_without_sizes_still_opens_and_groups_by_reading_the_headers(image_folder, tmp_path):
    path = encoded(image_folder, str(tmp_path / "old.memmap"))
    reseal_memmap(path, widths=None, heights=None)  # as written before sizes were recorded
    with pf.open_archive(path) as reader:
        assert reader.index.image_sizes() is None
        np.testing.assert_array_equal(pf.GroupByAspectRatio(k=3).sizes_of(reader, skip_bad=False),
                                      source_sizes(image_folder, reader))
    destroy_images(path)  # now the headers must be read, and cannot be
    with pf.open_archive(path) as reader, pytest.raises(pf.CorruptSampleError):
        pf.GroupByAspectRatio(k=3).sizes_of(reader, skip_bad=False)


# ---- forged or damaged ----------------------------------------------------------------------------------------
FORGED = {
    "a negative width": (dict(widths=np.array([-5] * 24, dtype=np.int32)), r"sample 0's image size as -5 x"),
    "one side unknown": (dict(heights=np.zeros(24, dtype=np.int32)), r"sample 0's image size as \d+ x 0"),
    "of another dtype": (dict(widths=np.ones(24, dtype=np.int64)), r"'widths' is int64 .*not int32"),
    "widths without heights": (dict(heights=None), "image widths or heights, not both"),
    "one entry short": (dict(widths=np.ones(23, dtype=np.int32)), "'widths' has 23 entries"),
}


@pytest.mark.parametrize("forged", FORGED, ids=list(FORGED))
def test_a_forged_size_array_is_refused_on_open_naming_the_archive(image_folder, tmp_path, forged):
    arrays, message = FORGED[forged]
    path = encoded(image_folder, str(tmp_path / "a.memmap"))
    reseal_memmap(path, **arrays)
    with pytest.raises(pf.CorruptArchiveError, match=message) as caught:
        pf.open_archive(path)
    assert path in str(caught.value)


def test_a_damaged_size_array_fails_its_checksum(image_folder, tmp_path):
    path = encoded(image_folder, str(tmp_path / "a.memmap"))
    widths = np.load(os.path.join(path, "widths.npy"))
    np.save(os.path.join(path, "widths.npy"), widths[::-1].copy(), allow_pickle=False)
    with pytest.raises(pf.CorruptArchiveError, match=r"'widths' is damaged"):
        pf.open_archive(path)


def test_verify_decode_names_a_sample_whose_recorded_size_is_not_its_images(image_folder, tmp_path):
    path = encoded(image_folder, str(tmp_path / "a.memmap"))
    with pf.open_archive(path) as reader:
        widths, heights = np.array(reader.index.widths), np.array(reader.index.heights)
        key = reader.key(3)
    widths[3], heights[3] = heights[3] + 1, widths[3]  # a plausible size, not the image's
    reseal_memmap(path, widths=widths, heights=heights)
    assert verify_archive(path).ok  # checksums alone cannot tell
    report = verify_archive(path, decode=True)
    assert [(b.index, b.key) for b in report.bad] == [(3, key)]
    assert f"records its size as {widths[3]}x{heights[3]}" in report.bad[0].problem


def fetched_parts(cache) -> list:
    return [name for _, _, names in os.walk(cache) for name in names if name.startswith("train-0")
            and name.endswith(".zip")]


# ---- a set in a store -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_set_in_a_store_groups_from_its_sample_index_and_refuses_a_forged_size(image_folder, s3_env, tmp_path):
    pytest.importorskip("s3fs")
    os.makedirs(tmp_path / "set")
    dst = encoded(image_folder, str(tmp_path / "set" / "train.zip"), "zip", shard_size=SHARD)
    with pf.open_archive(dst) as reader:
        expected = source_sizes(image_folder, reader)
    bucket = s3_env.bucket()
    copy_with_boto3(s3_env, str(tmp_path / "set"), bucket)
    cache = tmp_path / "cache"
    with pf.open_archive(f"s3://{bucket}/copied/train.zip", cache_dir=cache) as remote:
        np.testing.assert_array_equal(pf.GroupByAspectRatio(k=3).sizes_of(remote, skip_bad=False), expected)
        assert fetched_parts(cache) == []  # no part fetched: the sizes are the sample index's
        remote.read(len(remote) - 1)  # a part fetched agrees with the sample index's sizes
        assert len(fetched_parts(cache)) == 1
    arrays = sample_arrays_of(dst)
    arrays["widths"][7] = -1
    reseal(dst, arrays)
    copy_with_boto3(s3_env, str(tmp_path / "set"), bucket)
    refused = r"copied/train\.zip: .*field 'widths' gives sample 7 the size -1"
    with pytest.raises(pf.CorruptArchiveError, match=refused):
        pf.open_archive(f"s3://{bucket}/copied/train.zip", cache_dir=tmp_path / "other-cache")

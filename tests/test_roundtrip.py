"""What was written is what is read, for every format and mode."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

import packed_formats as pf
from packed_formats import codecs

from .conftest import CLASSES, RAW_SHAPE, expected_samples, write_archive


def assert_same_sample(stored, expected, mode):
    if mode == "encoded":
        assert isinstance(stored, bytes)
        assert stored == expected
    else:
        assert stored.dtype == np.uint8 and stored.shape == RAW_SHAPE
        np.testing.assert_array_equal(stored, expected)


def test_every_sample_label_and_key_round_trips(archives, image_folder, kind):
    fmt, mode = kind
    expected = expected_samples(image_folder, mode)
    with pf.open_archive(archives[kind]) as reader:
        assert reader.manifest.format == fmt
        assert reader.manifest.mode == mode
        assert len(reader) == len(expected)
        assert reader.classes == list(CLASSES)
        for i, (stored, label, key) in enumerate(expected):
            assert_same_sample(reader.read(i), stored, mode)
            assert int(reader.labels[i]) == label
            assert reader.key(i) == key


def test_stored_checksums_are_crc32_of_the_stored_bytes(archives, packed_kind):
    with pf.open_archive(archives[packed_kind]) as reader:
        assert reader.manifest.checksum == "crc32"
        for i in range(len(reader)):
            assert zlib.crc32(reader.read_bytes(i)) == int(reader.index.crc32[i])


def test_manifest_describes_the_layout(archives, packed_kind):
    fmt, mode = packed_kind
    manifest = pf.open_archive(archives[packed_kind]).manifest
    assert manifest.complete
    assert manifest.created_with.startswith("packed_formats ")
    if mode == "raw":
        assert manifest.shape == RAW_SHAPE and manifest.encoding is None
    else:
        assert manifest.shape is None and manifest.encoding == "jpeg"


@pytest.mark.parametrize("indices", [[7, 3, 7, 20], [20, 19, 0], [-1, 0, -1], []], ids=str)
def test_read_many_accepts_any_order_and_repeats(archives, kind, indices):
    with pf.open_archive(archives[kind]) as reader:
        batch = reader.read_many(indices)
        assert len(batch) == len(indices)
        for got, i in zip(batch, indices):
            assert_same_sample(got, reader.read(i), kind[1])


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_raw_read_many_fills_a_given_buffer(archives, fmt):
    with pf.open_archive(archives[(fmt, "raw")]) as reader:
        out = np.zeros((3,) + RAW_SHAPE, dtype=np.uint8)
        assert reader.read_many([5, 1, 5], out=out) is out
        np.testing.assert_array_equal(out[1], reader.read(1))
        with pytest.raises(ValueError, match="out must be"):
            reader.read_many([1], out=np.zeros((2,) + RAW_SHAPE, dtype=np.uint8))


def test_dataset_matches_torchvision_image_folder_order(image_folder, archives, kind):
    from torchvision.datasets import ImageFolder

    reference = ImageFolder(image_folder)
    dataset = pf.PackedDataset(archives[kind])
    assert dataset.classes == reference.classes
    assert dataset.class_to_idx == reference.class_to_idx
    assert dataset.targets.tolist() == reference.targets
    keys = [os.path.relpath(path, image_folder) for path, _ in reference.samples]
    assert [dataset.key(i) for i in range(len(dataset))] == keys


@pytest.mark.parametrize("output", ["tensor", "numpy", "pil"])
def test_dataset_outputs(archives, kind, output):
    dataset = pf.PackedDataset(archives[kind], output=output)
    stored = dataset.reader.read(4)
    pixels = stored if kind[1] == "raw" else codecs.decode(stored)
    image, label = dataset[4]
    assert label == int(dataset.targets[4])
    if output == "tensor":
        assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8
        assert image.is_contiguous()
        np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), pixels)
    elif output == "numpy":
        assert image.flags.writeable
        np.testing.assert_array_equal(image, pixels)
    else:
        assert isinstance(image, Image.Image) and image.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(image), pixels)


def test_getitems_returns_what_getitem_would(archives, kind):
    dataset = pf.PackedDataset(archives[kind], output="tensor")
    indices = [9, 2, 9, 23]
    batch = dataset.__getitems__(indices)
    assert len(batch) == len(indices)
    for (image, label), i in zip(batch, indices):
        single, single_label = dataset[i]
        assert torch.equal(image, single) and label == single_label


def test_transforms_apply_to_image_and_label(archives):
    dataset = pf.PackedDataset(
        archives[("memmap", "raw")], output="tensor", transform=lambda x: x.float() / 255,
        target_transform=lambda y: y + 100,
    )
    image, label = dataset[0]
    assert image.dtype == torch.float32 and float(image.max()) <= 1.0
    assert label == int(dataset.targets[0]) + 100


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_arrays_written_to_png_archives_decode_losslessly(tmp_path, fmt):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size=(10 + i, 12, 3), dtype=np.uint8) for i in range(4)]
    path = tmp_path / f"png.{fmt}"
    with pf.open_writer(path, format=fmt, mode="encoded", encoding="png", classes=["a"]) as writer:
        for image in images:
            writer.add(image, 0)
    dataset = pf.PackedDataset(path, output="numpy")
    assert dataset.manifest.encoding == "png"
    for i, image in enumerate(images):
        np.testing.assert_array_equal(dataset[i][0], image)
        assert dataset.key(i) == f"{i:08d}"


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_single_channel_raw_archives(tmp_path, fmt):
    images = [np.full((6, 5), i, dtype=np.uint8) for i in range(3)]
    path = tmp_path / f"gray.{fmt}"
    with pf.open_writer(path, format=fmt, mode="raw", shape=(6, 5, 1)) as writer:
        for i, image in enumerate(images):
            writer.add(image, i)
    dataset = pf.PackedDataset(path, output="tensor")
    image, label = dataset[2]
    assert image.shape == (1, 6, 5) and label == 2 and int(image[0, 0, 0]) == 2


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_empty_archive_opens_with_no_samples(tmp_path, fmt, mode):
    path = write_archive(tmp_path / f"empty.{fmt}", fmt, mode, [])
    with pf.open_archive(path) as reader:
        assert len(reader) == 0
        assert len(reader.read_many([])) == 0


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_pil_images_and_tensors_are_accepted_by_raw_writers(tmp_path, fmt):
    pixels = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3)
    path = tmp_path / f"mixed.{fmt}"
    with pf.open_writer(path, format=fmt, mode="raw", shape=(4, 4, 3)) as writer:
        writer.add(Image.fromarray(pixels), 0)
        writer.add(torch.from_numpy(pixels).permute(2, 0, 1), 0)
        writer.add(codecs.encode(pixels, "png"), 0)
    with pf.open_archive(path) as reader:
        for i in range(3):
            np.testing.assert_array_equal(reader.read(i), pixels)

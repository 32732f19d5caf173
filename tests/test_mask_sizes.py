"""A mask (or a second view) of another size than its image is a CorruptSampleError naming the sample and the
field on every read path, told from its header before it is decoded; ``verify --decode`` finds it too.

torchvision's v2 transforms refuse a sample whose mask is not its image's size with a bare ``ValueError``
("Found multiple HxW dimensions"), and without a transform such a mask was served as it is: here every path
names it first, and a mask whose header says 13,000 x 13,000 is refused without decoding its 169 MB.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

import packed_formats as pf
from packed_formats import cli

from .test_short_images import short_png

pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # a header read, then refused
SHAPE = (20, 24, 3)  # the images' (height, width, channels)


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def huge_mask_png(side: int = 13_000) -> bytes:
    """A grey PNG whose header says ``side`` x ``side`` (chunk CRCs right), with a few rows of data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    rows = zlib.compress(b"\x00" * (side + 1) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def write(path, mode: str, bad_mask: bytes, bad: int = 2, count: int = 4) -> None:
    """Samples s0.. of SHAPE, each with a mask of its size but sample ``bad``, whose mask is ``bad_mask``."""
    with pf.open_writer(path, format="zip", mode=mode, classes=["a"], shape=SHAPE, encoding="png",
                        fields=["mask=image", "grid=array:uint8[N,24]"]) as writer:
        for i in range(count):
            mask = np.full(SHAPE[:2], i % 3, np.uint8)
            grid = np.zeros((SHAPE[0] if i != bad else SHAPE[0] - 1, SHAPE[1]), np.uint8)
            writer.add(np.full(SHAPE, 9 * i, np.uint8), 0, key=f"s{i}",
                       fields={"mask": bad_mask if i == bad else png(mask), "grid": grid})


BAD_MASKS = {"wider": lambda: png(np.zeros((20, 25), np.uint8)), "huge": huge_mask_png}


def crop():
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomCrop((16, 16)), v2.RandomHorizontalFlip()])


@pytest.mark.parametrize("mode", ["raw", "encoded"])
@pytest.mark.parametrize("bad", list(BAD_MASKS))
def test_the_dataset_names_a_mask_of_another_size(tmp_path, mode, bad):
    path = tmp_path / "a.zip"
    write(path, mode, BAD_MASKS[bad]())
    side = "25x20" if bad == "wider" else "13000x13000"
    for transform in (None, crop()):
        dataset = pf.PackedDataset(path, output="tensor", fields={"mask": "mask"}, transform=transform)
        assert dataset[1]["mask"].shape[-2:] == (16, 16) if transform else (20, 24)
        with pytest.raises(pf.CorruptSampleError, match=rf"s2.*field 'mask': a mask of {side} for an image of 24x20"):
            dataset[2]


@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_the_dataset_names_an_array_mask_of_another_shape(tmp_path, mode):
    path = tmp_path / "a.zip"
    write(path, mode, png(np.zeros((20, 24), np.uint8)))
    for transform in (None, crop()):
        dataset = pf.PackedDataset(path, output="tensor", fields={"grid": "mask"}, transform=transform)
        dataset[1]
        with pytest.raises(pf.CorruptSampleError, match=r"s2.*field 'grid': a mask of shape \[19, 24\]"):
            dataset[2]


@pytest.mark.parametrize("mode", ["raw", "encoded"])
@pytest.mark.parametrize("bad", list(BAD_MASKS))
def test_make_loader_names_a_mask_of_another_size_with_or_without_a_transform(tmp_path, mode, bad):
    path = tmp_path / "a.zip"
    write(path, mode, BAD_MASKS[bad]())
    side = "25x20" if bad == "wider" else "13000x13000"
    for options in ({}, {"transform": crop()}):
        for field in ("mask", "grid"):
            with pytest.raises(pf.CorruptSampleError, match=rf"s2.*field '{field}': a mask of"):
                list(pf.make_loader(path, batch_size=4, num_workers=0, shuffle=False, fields={field: "mask"},
                                    **options))
        with pytest.raises(pf.CorruptSampleError, match=rf"field 'mask': a mask of {side} for an image of 24x20"):
            list(pf.make_loader(path, batch_size=4, num_workers=0, fields={"mask": "mask"}, **options))
        with pytest.warns(pf.SkippedSampleWarning, match="s2"):
            batches = list(pf.make_loader(path, batch_size=4, num_workers=0, shuffle=False, fields={"mask": "mask"},
                                          on_error="skip", return_index=True, **options))
        assert [b["index"].tolist() for b in batches] == [[0, 1, 3]]


@pytest.mark.slow
def test_a_mask_of_another_size_is_named_from_a_worker(tmp_path):
    path = tmp_path / "a.zip"
    write(path, "raw", huge_mask_png(), bad=5, count=8)
    with pytest.raises(pf.CorruptSampleError, match=r"s5.*field 'mask': a mask of 13000x13000"):
        list(pf.make_loader(path, batch_size=4, num_workers=2, shuffle=False, fields={"mask": "mask"},
                            transform=crop()))


@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_verify_decode_checks_image_fields_as_it_checks_images(tmp_path, capsys, mode):
    path = tmp_path / "a.zip"
    masks = {1: png(np.zeros((20, 25), np.uint8)), 2: huge_mask_png(), 3: png(np.zeros((20, 24, 3), np.uint8)),
             4: short_png(20, 24, rows=11)}
    with pf.open_writer(path, format="zip", mode=mode, classes=["a"], shape=SHAPE, encoding="png",
                        fields=["mask=image"]) as writer:
        for i in range(6):
            mask = masks.get(i, png(np.full(SHAPE[:2], i, np.uint8)))
            writer.add(np.full(SHAPE, 9 * i, np.uint8), 0, key=f"s{i}", fields={"mask": mask})
    assert pf.verify_archive(path).ok  # the checksums are right
    report = pf.verify_archive(path, decode=True)
    assert [b.key for b in report.bad] == ["s1", "s2", "s3", "s4"], report.lines()
    wider, huge, colour, short_mask = (b.problem for b in report.bad)
    assert "field 'mask': an image of 25x20 for a sample image of 24x20" in wider
    assert "an image of 13000x13000" in huge
    assert "field 'mask': a colour (RGB) image where the field's first is one-channel (L)" in colour
    assert "field 'mask' does not decode" in short_mask and "ends after 11 of 20 rows" in short_mask
    assert cli.main(["verify", str(path), "--decode", "--quiet"]) == 1
    assert "FAILED: 4 bad samples" in capsys.readouterr().out

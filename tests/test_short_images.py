"""Images and masks whose pixel data ends early are refused, not filled.

A PNG whose image data (IDAT) holds fewer rows than its header says, with every chunk's CRC right and
its end chunk there, and a JPEG cut short with its end marker (EOI) put back, are both files that
Pillow reads without a word: the missing rows come out 0 (PNG) or grey (JPEG), whatever
``LOAD_TRUNCATED_IMAGES`` says.  The converter and ``verify --decode`` decode strictly: such a file
is a ``CorruptSampleError`` naming it (or left out with ``on_error="skip"``).
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

import packed_formats as pf
from packed_formats import codecs, native, policy
from packed_formats.synthetic import draw_image

needs_native = pytest.mark.skipif(native.simplejpeg is None, reason="no native JPEG decoder on this platform")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def short_png(height: int = 16, width: int = 16, rows: int = 8, channels: int = 1) -> bytes:
    """A well-formed PNG (chunk CRCs right, IEND there) whose IDAT holds only ``rows`` of its ``height``."""
    colour = {1: 0, 3: 2}[channels]
    line = bytes((x * 13) % 256 for x in range(width * channels))
    pixels = b"".join(b"\x00" + line for _ in range(rows))  # filter type 0, then the row
    header = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(pixels))
            + _chunk(b"IEND", b""))


def photo_jpeg(size=(96, 64), seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    draw_image("circles", size, np.random.default_rng(seed)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def half_jpeg(size=(96, 64), seed: int = 0) -> bytes:
    """A JPEG cut in half, its end-of-image marker put back."""
    data = photo_jpeg(size, seed)
    return data[: len(data) // 2] + b"\xff\xd9"


def test_pillow_fills_what_these_files_lack():
    """What the tests here stand on: Pillow alone serves both files, with the missing rows filled."""
    assert np.asarray(Image.open(io.BytesIO(short_png())))[8:].max() == 0
    assert (np.asarray(Image.open(io.BytesIO(half_jpeg())))[-4:] == 128).all()


@pytest.mark.parametrize("fill", [False, True])
def test_a_short_png_is_refused_whatever_pillow_is_told(monkeypatch, fill):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", fill)
    for data in (short_png(), short_png(20, 30, 19, channels=3)):
        with pytest.raises(codecs.DecodeError, match="image data ends after"):
            policy.check_decodes(data)
    whole = short_png(rows=16)
    policy.check_decodes(whole)
    assert codecs.png_problem(whole) is None


@pytest.mark.parametrize("width, height", [(13, 7), (1, 1), (5, 9)])
def test_an_interlaced_png_is_counted_pass_by_pass(width, height):
    """Adam7 stores seven reduced images, some empty for a small image: their rows add up to the whole."""
    pixels = (np.arange(width * height).reshape(height, width) * 7 % 256).astype(np.uint8)
    passes = [pixels[y::dy, x::dx] for x, y, dx, dy in
              ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))]
    data = b"".join(b"\x00" + row.tobytes() for image in passes if image.size for row in image)

    def interlaced(data: bytes) -> bytes:
        header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 1)
        return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(data))
                + _chunk(b"IEND", b""))

    assert np.array_equal(np.asarray(Image.open(io.BytesIO(interlaced(data)))), pixels)
    policy.check_decodes(interlaced(data))
    with pytest.raises(codecs.DecodeError, match=f"ends after {len(data) - 1} of {len(data)} bytes"):
        policy.check_decodes(interlaced(data[:-1]))


@needs_native
@pytest.mark.parametrize("fill", [False, True])
@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_a_jpeg_cut_short_with_its_end_marker_put_back_is_refused(monkeypatch, fill, mode):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", fill)
    buffer = io.BytesIO()
    draw_image("circles", (96, 64), np.random.default_rng(0)).convert(mode).save(buffer, "JPEG", quality=90)
    data = buffer.getvalue()
    policy.check_decodes(data)
    with pytest.raises(codecs.DecodeError, match="premature end"):
        policy.check_decodes(data[: len(data) // 2] + b"\xff\xd9")


@needs_native
def test_extraneous_bytes_before_the_end_marker_are_no_damage():
    """libjpeg warns of bytes between the last block and EOI (common in real photos): the pixels are all there."""
    data = photo_jpeg()
    padded = data[:-2] + b"\x00" * 16 + b"\xff\xd9"
    policy.check_decodes(padded)
    assert np.array_equal(codecs.decode(padded), codecs.decode(data))


def short_folder(root) -> dict:
    """An image folder with a short PNG and a half JPEG among good photos: {bad file name: problem}."""
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for i in range(3):
            (root / name / f"{name}{i}.jpg").write_bytes(photo_jpeg(seed=i))
    (root / "a" / "short.png").write_bytes(short_png())
    (root / "b" / "half.jpg").write_bytes(half_jpeg())
    return {"short.png": "image data ends after", "half.jpg": "premature end"}


@needs_native
@pytest.mark.parametrize("options", [{"mode": "encoded"}, {"mode": "raw", "size": 32},
                                     {"mode": "encoded", "size": 32}])
def test_the_converter_refuses_or_skips_short_images_naming_them(tmp_path, monkeypatch, options):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)  # as training scripts often set it
    bad = short_folder(tmp_path / "src")
    with pytest.raises(pf.CorruptSampleError, match=r"(short\.png|half\.jpg)") as error:
        pf.convert(tmp_path / "src", tmp_path / "out.zip", workers=1, quiet=True, **options)
    name = "short.png" if "short.png" in str(error.value) else "half.jpg"
    assert bad[name] in str(error.value)
    summary = pf.convert(tmp_path / "src", tmp_path / "skip.zip", workers=1, quiet=True, on_error="skip", **options)
    assert summary.samples == 6 and len(summary.failed) == 2
    for name, problem in bad.items():
        assert any(name in line and problem in line for line in summary.failed), summary.failed


def test_the_converter_refuses_a_short_mask_naming_the_sample_and_field(tmp_path):
    root = tmp_path / "tree"
    for c, name in enumerate(["a", "b"]):
        (root / name).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(root / name / f"{name}{i}.png")
            mask = short_png() if (c, i) == (0, 1) else short_png(rows=16)
            (root / name / f"{name}{i}.seg.png").write_bytes(mask)
    for options in ({}, {"mode": "raw", "size": 8}):
        with pytest.raises(pf.CorruptSampleError, match=r"a1\.png.*field 'seg'.*image data ends after"):
            pf.convert(root, tmp_path / "out.zip", fields=["seg=image"], workers=1, quiet=True, **options)
    summary = pf.convert(root, tmp_path / "skip.zip", fields=["seg=image"], workers=1, quiet=True, on_error="skip")
    assert summary.samples == 5 and len(summary.failed) == 1 and "a1.png" in summary.failed[0]


@needs_native
def test_verify_decode_finds_short_images_and_short_masks(tmp_path):
    path = tmp_path / "short.zip"
    good_mask = short_png(64, 96, rows=64)
    with pf.open_writer(path, format="zip", mode="encoded", classes=["a"], fields=["seg=image"]) as writer:
        writer.add(photo_jpeg(), 0, key="good", fields={"seg": good_mask})
        writer.add(half_jpeg(), 0, key="half", fields={"seg": good_mask})
        writer.add(photo_jpeg(seed=1), 0, key="masked", fields={"seg": short_png(64, 96, rows=30)})
    assert pf.verify_archive(path).ok  # the checksums are right: the damage came in with the source
    report = pf.verify_archive(path, decode=True)
    assert report.bad_count == 2
    half, masked = report.bad
    assert (half.key, masked.key) == ("half", "masked")
    assert "premature end" in half.problem
    assert "field 'seg'" in masked.problem and "image data ends after 30 of 64 rows" in masked.problem


@needs_native
def test_readers_refuse_a_jpeg_cut_short_instead_of_serving_grey(tmp_path, monkeypatch):
    """An archive written with such a file (its CRC32 right) reads as a named error where the native decoder
    would hand it to Pillow: whole, resized, or cut while decoding."""
    from torchvision.transforms import v2

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    path = tmp_path / "half.zip"
    with pf.open_writer(path, format="zip", mode="encoded", classes=["a"]) as writer:
        for i in range(4):
            writer.add(half_jpeg(seed=i) if i == 2 else photo_jpeg(seed=i), 0, key=f"s{i}")
    dataset = pf.PackedDataset(path, output="tensor")
    dataset[1]
    with pytest.raises(pf.CorruptSampleError, match="s2.*premature end"):
        dataset[2]
    for options in ({}, {"size": 32}, {"transform": v2.RandomResizedCrop(24)}):
        with pytest.raises(pf.CorruptSampleError, match="s2.*premature end"):
            list(pf.make_loader(path, batch_size=4, num_workers=0, shuffle=False, **options))

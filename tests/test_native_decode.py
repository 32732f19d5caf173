"""Readers decode JPEGs natively and resize with torch, with the Pillow path's guarantees.

The same decoded pixels as Pillow, greyscale and CMYK as Pillow converts them,
truncated files refused whatever ``LOAD_TRUNCATED_IMAGES`` says, large JPEGs
decoded at a reduced DCT scale, and the Pillow path whenever the native
decoder is missing or refuses a file.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageFile

from packed_formats import codecs, native, policy
from packed_formats.synthetic import draw_image

pytestmark = pytest.mark.skipif(native.simplejpeg is None, reason="no native JPEG decoder on this platform")


def _jpeg(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, **options)
    return buffer.getvalue()


def _photo(size=(400, 300), kind="circles", seed=0) -> Image.Image:
    return draw_image(kind, size, np.random.default_rng(seed))


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
@pytest.mark.parametrize("channels", [1, 3])
def test_decoded_pixels_equal_pillows(mode, channels):
    data = _jpeg(_photo().convert(mode))
    assert np.array_equal(policy.decode(data, channels), codecs.decode(data, channels))


@pytest.mark.parametrize("cut", [2, 300])
def test_a_truncated_jpeg_is_refused_even_when_pillow_is_told_to_fill_it(monkeypatch, cut):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    data = _jpeg(_photo())[:-cut]
    with pytest.raises(codecs.DecodeError, match="truncated"):
        policy.decode(data, 3, (64, 64))


@pytest.mark.parametrize("resize_mode", policy.RESIZE_MODES)
@pytest.mark.parametrize("size", [(256, 256), (96, 128), (500, 300)])
def test_resized_images_match_pillows_bilinear_filter(size, resize_mode):
    data = _jpeg(_photo(kind="stripes", seed=3))
    fast = policy.decode(data, 3, size, resize_mode)
    draft = policy.decode_size((400, 300), size, resize_mode, 1.0)  # Pillow's DCT scaling, as the reader's
    pillow = np.asarray(policy.resize(codecs.open_image(data, draft=("RGB", draft)), size, resize_mode))
    assert fast.shape == pillow.shape == size + (3,)
    difference = np.abs(fast.astype(int) - pillow)
    if resize_mode == "stretch":
        assert difference.mean() < 0.05 and difference.max() <= 1  # the same filter, rounded alike
    else:  # the crop box is whole pixels here, fractional in Pillow's: at most a sub-pixel shift
        assert difference.mean() < 8


def test_a_large_jpeg_is_decoded_at_a_reduced_dct_scale(monkeypatch):
    asked = []
    decode = native.simplejpeg.decode_jpeg

    def spy(data, **options):
        image = decode(data, **options)
        asked.append(image.shape)
        return image

    monkeypatch.setattr(native.simplejpeg, "decode_jpeg", spy)
    data = _jpeg(_photo(size=(1600, 1200)))
    assert policy.decode(data, 3, (224, 224), "shorter-side-center-crop").shape == (224, 224, 3)
    assert asked == [(300, 400, 3)]  # 1/4 scale: still covers 224 on the shorter side


def test_without_the_native_decoder_pillow_decodes(monkeypatch):
    data = _jpeg(_photo())
    fast = policy.decode(data, 3, (64, 64))
    monkeypatch.setattr(native, "simplejpeg", None)
    assert np.array_equal(policy.decode(data, 3), codecs.decode(data, 3))
    assert np.abs(policy.decode(data, 3, (64, 64)).astype(int) - fast).max() <= 2


def test_png_is_decoded_by_pillow_and_resized_by_torch():
    buffer = io.BytesIO()
    _photo().save(buffer, "PNG")
    data = buffer.getvalue()
    assert np.array_equal(policy.decode(data, 3), codecs.decode(data, 3))
    assert policy.decode(data, 1, (30, 40)).shape == (30, 40, 1)


def test_an_unknown_resize_mode_is_refused():
    with pytest.raises(ValueError, match="resize mode"):
        policy.decode(_jpeg(_photo()), 3, (32, 32), "squash")


@pytest.mark.parametrize("cut", [2, 300])
def test_the_converters_cheap_check_refuses_truncated_jpegs(monkeypatch, cut):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    data = _jpeg(_photo())
    policy.check_decodes(data)
    assert native.jpeg_decodes(data)
    assert not native.jpeg_decodes(data[:-cut])
    with pytest.raises(codecs.DecodeError, match="truncated"):
        policy.check_decodes(data[:-cut])


def test_the_cheap_check_leaves_cmyk_to_pillow():
    data = _jpeg(_photo().convert("CMYK"))
    policy.check_decodes(data)  # native refuses the colour space; Pillow reads it

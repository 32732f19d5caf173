"""The policies every read and write path shares, each in one place.

* verify: check a sample's CRC32 on every read (True), the first time each
  process reads it ("once"), or never (False); applied by ``Reader``.
* on_error: "raise" at the first bad sample, or "skip" it with a
  ``SkippedSampleWarning`` naming it; used by convert, make_loader and verify.
* decode: encoded bytes -> pixels, at an optional size, the one function the
  dataset, the loader and the converter call.
"""

from __future__ import annotations

import io
import math
import warnings
from typing import Callable, NamedTuple, Optional, Tuple, Union

import numpy as np
from PIL import Image

from . import codecs, native

VerifyPolicy = Union[bool, str]
VERIFY_POLICIES: Tuple[VerifyPolicy, ...] = (True, False, "once")
ON_ERROR = ("raise", "skip")
RESIZE_MODES = ("stretch", "shorter-side-center-crop")
_CHANNEL_MODE = {1: "L", 3: "RGB"}


def check_choice(name: str, value: object, choices: Tuple[object, ...]) -> None:
    """ValueError naming ``name`` and the choices unless ``value`` is one of them."""
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_verify(value: object) -> None:
    check_choice("verify", value, VERIFY_POLICIES)


def check_on_error(value: object) -> None:
    check_choice("on_error", value, ON_ERROR)


class SkippedSampleWarning(UserWarning):
    """Bad samples were left out (``on_error="skip"``)."""


class Skipped(NamedTuple):
    """One sample left out: where it is and what was wrong."""

    path: str
    index: int  # type: ignore[assignment]  # the sample's index (shadows tuple.index, by design)
    key: str
    problem: str


# ---- decode ------------------------------------------------------------------------------------------
def decode(
    data: bytes,
    channels: int = 3,
    size: Optional[Tuple[int, int]] = None,
    resize_mode: str = "stretch",
    reducing_gap: Optional[float] = None,
) -> np.ndarray:
    """Encoded bytes -> HxWxC uint8 pixels, resized to ``size`` (height, width) if given.

    Readers (``reducing_gap=None``) decode JPEGs natively (libjpeg-turbo, at
    the smallest DCT scale 1/2, 1/4, 1/8 that still covers what the resize
    keeps) and resize with torch's antialiased uint8 kernel (``native.py``:
    2-3x faster than Pillow's resize, same decoded pixels).  The converter
    passes ``reducing_gap`` (a margin of detail for the final filter, 2 there)
    and gets Pillow's filter throughout, which decides what archives store.
    Raises codecs.DecodeError for a bad or truncated image.
    """
    if reducing_gap is None:
        pixels = _decode_natively(data, channels, size, resize_mode)
        if pixels is not None:
            return pixels
    mode = _CHANNEL_MODE[channels]
    if size is None:
        image = codecs.open_image(data)
    else:
        gap = 1.0 if reducing_gap is None else reducing_gap
        image = codecs.open_image(data, draft=lambda stored: (mode, decode_size(stored, size, resize_mode, gap)))
    image = codecs.to_8bit(image)
    if image.mode != mode:
        image = image.convert(mode)
    if size is not None:
        if reducing_gap is None:
            return _resized(codecs.pil_to_array(image, channels), size, resize_mode)
        image = resize(image, size, resize_mode, reducing_gap)
    return codecs.pil_to_array(image, channels)


def check_decodes(data: bytes) -> None:
    """codecs.DecodeError unless ``data`` decodes completely (what a converter keeping the file's
    own bytes proves of each one): natively and cheaply for JPEG, by Pillow otherwise or when
    the native check fails for another reason than missing pixel data (Pillow then decodes it,
    e.g. a CMYK JPEG, or says why not).  Strict: pixel data that ends early or is skipped, which
    Pillow fills with grey or zeros whatever ``LOAD_TRUNCATED_IMAGES`` says, is an error
    (``check_complete``)."""
    if codecs.sniff(data) == "jpeg":
        refusal = native.jpeg_refusal(data)
        if refusal is None:
            return
        _refuse_missing(refusal if native.lacks_pixel_data(refusal) else None, "grey")
    else:
        _refuse_missing(codecs.png_problem(data), "0")
    codecs.open_image(data)


def check_complete(data: bytes) -> None:
    """codecs.DecodeError when encoded image bytes lack pixel data their header promises: a JPEG
    whose data ends early or is skipped (libjpeg's warnings, from a cheap strict native decode), a
    PNG whose image data holds fewer rows than it declares (``codecs.png_problem``).  What a
    converter checks before it decodes and resizes a file, where the decode itself would fill the
    gap; no proof that the rest decodes (the decode that follows is)."""
    kind = codecs.sniff(data)
    if kind == "jpeg":
        _refuse_missing_jpeg(data)
    elif kind == "png":
        _refuse_missing(codecs.png_problem(data), "0")


def _refuse_missing_jpeg(data: bytes) -> None:
    """codecs.DecodeError when a JPEG's pixel data is missing (``native.lacks_pixel_data``), which Pillow
    would fill with grey.  Readers ask only of a JPEG the native decoder would not read, before Pillow
    gets it: a good file never pays for the check."""
    refusal = native.jpeg_refusal(data)
    _refuse_missing(refusal if native.lacks_pixel_data(refusal) else None, "grey")


def _refuse_missing(problem: Optional[str], fill: str) -> None:
    if problem is not None:
        raise codecs.DecodeError(f"cannot decode image: truncated or damaged, its pixel data is missing ({problem}): "
                                 f"a decoder would fill the rest with {fill}")


def _decode_natively(
    data: bytes, channels: int, size: Optional[Tuple[int, int]], resize_mode: str
) -> Optional[np.ndarray]:
    """A JPEG decoded natively (at the smallest DCT scale still covering what the resize keeps) and
    resized by torch, or None where Pillow should do it: other formats, and JPEGs the native decoder
    refuses or leaves to Pillow (see native.py)."""
    if codecs.sniff(data) != "jpeg":
        return None
    rgb = native.decode_jpeg(data, None if size is None else _dct_size_for(size, resize_mode))
    if rgb is None:
        _refuse_missing_jpeg(data)
        return None
    pixels = native.to_grey(rgb) if channels == 1 else rgb
    return pixels if size is None else _resized(pixels, size, resize_mode)


def _dct_size_for(size: Tuple[int, int], resize_mode: str) -> Callable[[Tuple[int, int]], Tuple[int, int]]:
    """The (width, height) to decode a JPEG of a given stored size at, for a resize to ``size``."""
    return lambda stored: dct_scaled(stored, decode_size(stored, size, resize_mode, 1.0))


def _resized(pixels: np.ndarray, size: Tuple[int, int], resize_mode: str) -> np.ndarray:
    """HxWxC uint8 resized by torch's antialiased bilinear kernel (native.resize, which checks the mode);
    torch loads here, on the reading side, never for a writer or the converter (Pillow's filter)."""
    import torch

    with warnings.catch_warnings():  # Pillow's arrays are read-only; the resize only reads them
        warnings.simplefilter("ignore", UserWarning)
        image = torch.from_numpy(pixels).permute(2, 0, 1)
    return native.resize(image, size, resize_mode).permute(1, 2, 0).numpy()


def resize(
    image: Image.Image, size: Tuple[int, int], resize_mode: str = "stretch", reducing_gap: Optional[float] = None,
    resample: Image.Resampling = Image.Resampling.BILINEAR,
) -> Image.Image:
    """``image`` at (height, width), bilinear: stretched, or scaled so the shorter side fits and center-cropped.
    With ``resample`` NEAREST (a mask: its values are classes, never blended) its mode is kept as it is."""
    height, width = size
    if image.mode not in ("RGB", "L") and resample != Image.Resampling.NEAREST:
        image = image.convert("RGB")
    box = kept_box(image.size, size, resize_mode)
    if image.size == (width, height) and box == (0, 0, width, height):
        return image
    if resample == Image.Resampling.NEAREST:
        return _nearest(image, (height, width), box)
    return image.resize((width, height), resample, box=box, reducing_gap=reducing_gap)


def nearest_indices(start: float, length: float, out: int) -> np.ndarray:
    """The source pixels (along one side) that ``out`` output pixels take from the ``length`` pixels from
    ``start`` by torchvision's nearest-neighbour rule, torch's ``interpolate(mode="nearest")``: output pixel d
    takes ``floor(d * length / out)``, worked out in float32 as torch does, kept inside the span (PIL's
    NEAREST takes the pixel under d's centre instead, another one on a share of a mask's edges)."""
    scale = np.float32(length) / np.float32(out)
    steps = np.floor(np.arange(out, dtype=np.float32) * scale).astype(np.int64)
    first = math.floor(start)
    if start != first:  # a box of fractional corners (a centre crop at conversion)
        steps = np.floor(start + np.arange(out, dtype=np.float64) * float(scale)).astype(np.int64) - first
    return first + np.clip(steps, 0, max(0, math.ceil(start + length) - 1 - first))


def _nearest(image: Image.Image, size: Tuple[int, int], box: Tuple[float, float, float, float]) -> Image.Image:
    """``image``'s ``box`` (left, top, right, bottom) at ``size`` (height, width) by ``nearest_indices``, in
    its own mode (a palette mask keeps its indices and palette)."""
    left, top, right, bottom = box
    pixels = np.asarray(image)
    rows = nearest_indices(top, bottom - top, size[0])
    cols = nearest_indices(left, right - left, size[1])
    taken = np.ascontiguousarray(np.take(np.take(pixels, rows, axis=0), cols, axis=1))
    out = Image.fromarray(taken, image.mode if image.mode in ("P", "L", "1") else None)
    if image.mode == "P":
        out.putpalette(image.getpalette() or [])
    if out.mode != image.mode:
        out = image.resize((size[1], size[0]), Image.Resampling.NEAREST, box=box)  # a mode numpy does not keep
    out.info.update({k: v for k, v in image.info.items() if k == "transparency"})
    return out


def kept_box(source: Tuple[int, int], size: Tuple[int, int], resize_mode: str
             ) -> Tuple[float, float, float, float]:
    """The (left, top, right, bottom) of a ``source`` (width, height) image that ``resize`` scales to ``size``
    (height, width): all of it when stretched, the centred box of the target's aspect when the shorter side is
    fitted and the rest cropped."""
    height, width = size
    if resize_mode == "stretch":
        return (0, 0, source[0], source[1])
    if resize_mode == "shorter-side-center-crop":
        scale = max(width / source[0], height / source[1])
        crop_w, crop_h = width / scale, height / scale
        left, top = max(0.0, (source[0] - crop_w) / 2), max(0.0, (source[1] - crop_h) / 2)
        return (left, top, min(source[0], left + crop_w), min(source[1], top + crop_h))  # float rounding
    raise ValueError(f"resize mode must be one of {RESIZE_MODES}, got {resize_mode!r}")


def dct_scaled(stored: Tuple[int, int], wanted: Tuple[int, int]) -> Tuple[int, int]:
    """(width, height) at the smallest of the scales 1, 1/2, 1/4, 1/8 (Pillow's draft scales) still
    at least ``wanted``: libjpeg-turbo's other M/8 scales would save little and blur a little."""
    for divisor in (8, 4, 2):
        w, h = math.ceil(stored[0] / divisor), math.ceil(stored[1] / divisor)
        if w >= wanted[0] and h >= wanted[1]:
            return w, h
    return stored


def decode_size(source: Tuple[int, int], size: Tuple[int, int], resize_mode: str, gap: float) -> Tuple[int, int]:
    """The smallest (width, height) worth decoding ``source`` (width, height) to: ``gap`` times what the resize keeps.

    Like Pillow's ``thumbnail``: the JPEG decoder's own 1/2, 1/4, 1/8 scaling
    is used only while a margin of detail remains for the final filter, so
    large photos decode several times faster at no visible cost.
    """
    (w, h), (height, width) = source, size
    if resize_mode == "stretch":
        return math.ceil(width * gap), math.ceil(height * gap)
    scale = max(width / w, height / h) * gap
    return math.ceil(w * scale), math.ceil(h * scale)


# ---- crop at decode ----------------------------------------------------------------------------------
def image_size(data: bytes) -> Tuple[int, int]:
    """Encoded bytes' stored (width, height), from the header alone; codecs.DecodeError if unreadable."""
    if codecs.sniff(data) == "jpeg":
        size = native.jpeg_size(data)
        if size is not None:
            return size
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise codecs.DecodeError(f"cannot read the image header: {exc}") from None


def decode_crop(
    data: bytes, channels: int, box: Tuple[int, int, int, int], size: Tuple[int, int],
    stored: Optional[Tuple[int, int]] = None,
) -> np.ndarray:
    """The ``box`` (top, left, height, width, in the stored image's pixels) of an encoded image,
    resized to ``size`` (height, width): HxWxC uint8.  ``stored`` is the image's (width, height)
    where the caller has read it already (``image_size``); the native decoder still reads the
    header's colour space for itself (a header costs microseconds, a decode a millisecond).

    A JPEG is decoded at the smallest DCT scale whose pixels still cover the box at ``size``
    (natively, else by Pillow's draft) and only the box is resized, by torch's antialiased
    bilinear kernel.
    Corrupt or truncated data raises codecs.DecodeError, as ``decode`` does.
    """
    top, left, height, width = box

    def least(stored: Tuple[int, int]) -> Tuple[int, int]:
        factor = min(1.0, max(size[1] / width, size[0] / height))  # decoded pixels per stored pixel needed
        return dct_scaled(stored, (math.ceil(stored[0] * factor), math.ceil(stored[1] * factor)))

    stored = image_size(data) if stored is None else stored
    pixels = native.decode_jpeg(data, least) if codecs.sniff(data) == "jpeg" else None
    if pixels is None:
        if codecs.sniff(data) == "jpeg":
            _refuse_missing_jpeg(data)
        image = codecs.to_8bit(codecs.open_image(data, draft=lambda s: ("RGB", least(s))))
        pixels = codecs.pil_to_array(image if image.mode == "RGB" else image.convert("RGB"), 3)
    scale_y, scale_x = pixels.shape[0] / stored[1], pixels.shape[1] / stored[0]
    y0, x0 = round(top * scale_y), round(left * scale_x)  # the box's edges at the decoded scale
    y1 = max(y0 + 1, min(pixels.shape[0], round((top + height) * scale_y)))
    x1 = max(x0 + 1, min(pixels.shape[1], round((left + width) * scale_x)))
    cropped = np.ascontiguousarray(pixels[y0:y1, x0:x1])  # numpy copies rows fast; torch's strided copy does not
    if channels == 1:
        cropped = native.to_grey(cropped)
    return _resized(cropped, size, "stretch")

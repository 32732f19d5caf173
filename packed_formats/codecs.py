"""Turning images into bytes and back: sniff, decode, encode, normalise arrays."""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any, Callable, Optional, Tuple

import numpy as np
from PIL import Image, ImageFile

ENCODINGS = ("jpeg", "png")
_PIL_FORMAT = {"jpeg": "JPEG", "png": "PNG"}
_CHANNEL_MODE = {1: "L", 3: "RGB"}


class DecodeError(ValueError):
    """The bytes are not a readable image (callers add the path and key)."""


def sniff(data: bytes) -> Optional[str]:
    """'jpeg' or 'png' from the magic bytes, else None."""
    head = bytes(data[:8])
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head == b"\x89PNG\r\n\x1a\n":
        return "png"
    return None


class _EncodedBytes(io.BytesIO):
    """Encoded image bytes that note when the decoder asks for data past their end.

    ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES = True`` (a process-wide switch that
    training scripts often set) makes Pillow fill a truncated image with gray
    instead of raising.  Watching our own stream detects the truncation
    whatever that switch says, without touching it (other threads may rely on it).
    """

    watching = False
    ran_dry = False

    def read(self, size: Optional[int] = -1) -> bytes:
        chunk = super().read(size)
        if self.watching and not chunk and size != 0:
            self.ran_dry = True
        return chunk


# Formats whose pixel decoding never reads past the end of a complete file.
_STRICT_FORMATS = ("JPEG", "MPO", "PNG")


Draft = Tuple[str, Tuple[int, int]]


def open_image(data: bytes, draft: "Draft | Callable[[Tuple[int, int]], Draft] | None" = None) -> Image.Image:
    """A fully loaded PIL image from encoded bytes, or DecodeError.

    A truncated JPEG or PNG raises DecodeError even when
    ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` is set.  ``draft=(mode, (width,
    height))`` lets a JPEG decode at a reduced scale still covering that size
    (``Image.draft``); a callable gets the stored (width, height) and returns it.
    """
    stream = _EncodedBytes(data)
    try:
        image = Image.open(stream)
        if draft is not None and image.format == "JPEG":
            image.draft(*(draft(image.size) if callable(draft) else draft))
        _load_strictly(image, stream)  # Image.open is lazy: truncation only shows up here
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise DecodeError(_describe(exc, data)) from None
    return image


def _load_strictly(image: ImageFile.ImageFile, stream: _EncodedBytes) -> None:
    """image.load(), raising OSError if the pixel data ran out before the decoder finished."""
    if image.format not in _STRICT_FORMATS:
        image.load()
        return
    # Pixel data is read between load_prepare() and load_end(); what load_end()
    # reads afterwards (e.g. PNG chunks after the image data) is no pixel data.
    load_end = image.load_end

    def stop_watching() -> None:
        stream.watching = False
        load_end()

    image.load_end = stop_watching  # type: ignore[method-assign]  # on this instance only, deleted below
    stream.watching = True
    try:
        image.load()
    finally:
        stream.watching = False
        del image.load_end
    if stream.ran_dry:
        raise OSError(f"image file is truncated: its {len(stream.getbuffer())} bytes end before the image data")


_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def png_problem(data: bytes) -> Optional[str]:
    """What a PNG's image data lacks, or None when it holds every row its header declares.

    Pillow ends a PNG's decode where its compressed data (IDAT) ends, and serves the rows it
    never got as zeros, with or without ``LOAD_TRUNCATED_IMAGES``.  This inflates the image
    data once more, counting bytes (never holding them), against what the header's size, bit
    depth, colour type and interlacing need.  Bytes that are no PNG, or a PNG whose chunks do
    not parse, are left to the decoder (None)."""
    view = memoryview(data)
    if bytes(view[:8]) != b"\x89PNG\r\n\x1a\n" or len(view) < 33 or bytes(view[12:16]) != b"IHDR":
        return None
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", view[16:29])
    if colour not in _PNG_CHANNELS or depth not in (1, 2, 4, 8, 16) or not 0 < width * height:
        return None
    bits = depth * _PNG_CHANNELS[colour]

    def rows(w: int, h: int) -> Tuple[int, int]:  # (rows, bytes of each with its filter byte) of a w x h image
        return (h, 1 + (w * bits + 7) // 8) if w and h else (0, 0)

    passes = [rows(width, height)] if interlace == 0 else [
        rows((width - x + dx - 1) // dx, (height - y + dy - 1) // dy) for x, y, dx, dy in _ADAM7]
    needed = sum(n * size for n, size in passes)
    got, inflate, position = 0, zlib.decompressobj(), 8
    while position + 8 <= len(view) and got < needed and not inflate.eof:
        length, kind = struct.unpack(">I4s", view[position : position + 8])
        if kind == b"IDAT":
            pending = bytes(view[position + 8 : position + 8 + length])
            try:
                while pending and got < needed and not inflate.eof:
                    got += len(inflate.decompress(pending, 1 << 20))
                    pending = inflate.unconsumed_tail
            except zlib.error:
                return None  # damaged compressed data: the decoder says so itself
        elif kind == b"IEND":
            break
        position += 12 + length
    if got >= needed:
        return None
    if interlace == 0:
        return f"its image data ends after {got // passes[0][1]} of {height} rows"
    return f"its interlaced image data ends after {got} of {needed} bytes"


def decode(data: bytes, channels: int = 3) -> np.ndarray:
    """Encoded bytes -> HxWxC uint8 array (converted to RGB, or L for 1 channel)."""
    image = open_image(data)
    return pil_to_array(image, channels)


def image_header(data: bytes) -> Tuple[Tuple[int, int], str]:
    """Encoded bytes' stored (width, height) and Pillow mode, from the header alone (no pixel decoded,
    however large it says the image is); DecodeError when they are no readable image."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size, image.mode
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise DecodeError(_describe(exc, data)) from None


_HIGH_BIT_DEPTH = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def has_alpha(data: bytes) -> bool:
    """Whether encoded image bytes carry transparency (an alpha channel or a transparent palette entry).

    Reads the header only; False for bytes that are not an image."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.mode in _ALPHA_MODES or "transparency" in image.info
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return False


def to_8bit(image: Image.Image) -> Image.Image:
    """A 16-bit (or 32-bit integer) greyscale image scaled to 8 bits ("L"); other images unchanged.

    Pillow's own ``convert`` clips such values at 255 instead of scaling them,
    which turns a 16-bit PNG almost white.
    """
    if image.mode not in _HIGH_BIT_DEPTH:
        return image
    values = np.asarray(image)
    top = 65535 if image.mode != "I" or values.max(initial=0) <= 65535 else int(values.max())
    scaled = (values.astype(np.float64) * (255.0 / top) + 0.5).astype(np.uint8)
    return Image.fromarray(scaled, "L")


def pil_to_array(image: Image.Image, channels: int = 3) -> np.ndarray:
    mode = _CHANNEL_MODE[channels]
    image = to_8bit(image)
    if image.mode != mode:
        image = image.convert(mode)
    array = np.asarray(image, dtype=np.uint8)
    return array.reshape(array.shape[0], array.shape[1], channels)


def encode(array: np.ndarray, encoding: str = "jpeg", quality: int = 90) -> bytes:
    """HxWxC uint8 array -> JPEG or PNG bytes."""
    if encoding not in _PIL_FORMAT:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    image = Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array)
    buffer = io.BytesIO()
    options = {"quality": int(quality)} if encoding == "jpeg" else {}
    image.save(buffer, format=_PIL_FORMAT[encoding], **options)
    return buffer.getvalue()


def to_array(sample: Any, channels: int = 3) -> np.ndarray:
    """An image given as bytes, PIL image, HxW / HxWxC array or CxHxW tensor -> HxWxC uint8."""
    if isinstance(sample, (bytes, bytearray, memoryview)):
        return decode(bytes(sample), channels)
    if isinstance(sample, Image.Image):
        return pil_to_array(sample, channels)
    if type(sample).__module__.startswith("torch"):
        sample = sample.detach().cpu().numpy()
        if sample.ndim == 3 and sample.shape[0] in (1, 3) and sample.shape[2] not in (1, 3):
            sample = sample.transpose(1, 2, 0)
    array = np.asarray(sample)
    if array.dtype != np.uint8:
        raise DecodeError(f"pixel arrays must be uint8, got {array.dtype}")
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3:
        raise DecodeError(f"expected an HxWxC image array, got shape {array.shape}")
    if array.shape[2] != channels:
        if array.shape[2] == 1 and channels == 3:
            array = np.repeat(array, 3, axis=2)
        elif array.shape[2] == 4 and channels == 3:
            array = array[:, :, :3]
        else:
            raise DecodeError(f"image has {array.shape[2]} channels, expected {channels}")
    return array


def _describe(exc: BaseException, data: bytes) -> str:
    if len(data) == 0:
        return "empty file, not an image"
    if isinstance(exc, Image.UnidentifiedImageError):
        return "not a recognisable image (JPEG, PNG, ...)"
    return f"cannot decode image: {exc}"

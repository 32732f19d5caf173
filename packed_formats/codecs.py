"""Turning images into bytes and back: sniff, decode, encode, normalise arrays."""

from __future__ import annotations

import io
from typing import Any, Optional

import numpy as np
from PIL import Image

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


def open_image(data: bytes) -> Image.Image:
    """A fully loaded PIL image from encoded bytes, or DecodeError."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # Image.open is lazy: truncation only shows up here
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise DecodeError(_describe(exc, data)) from None
    return image


def decode(data: bytes, channels: int = 3) -> np.ndarray:
    """Encoded bytes -> HxWxC uint8 array (converted to RGB, or L for 1 channel)."""
    image = open_image(data)
    return pil_to_array(image, channels)


def pil_to_array(image: Image.Image, channels: int = 3) -> np.ndarray:
    mode = _CHANNEL_MODE[channels]
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

"""The per-sample work of a conversion: decode, resize, re-encode (runs in worker processes)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Tuple

import numpy as np
from PIL import Image

from . import codecs

RESIZE_MODES = ("stretch", "shorter-side-center-crop")
_REDUCING_GAP = 2.0  # shrink cheaply (JPEG draft, integer reduce) only down to twice the target size


def parse_size(text: "str | int | Tuple[int, int]") -> Tuple[int, int]:
    """``256``, ``"256"`` or ``"256x192"`` (height x width) -> (height, width)."""
    if isinstance(text, int):
        text = str(text)
    if isinstance(text, (tuple, list)):
        values = tuple(int(x) for x in text)
    else:
        match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?", str(text))
        if match is None:
            raise ValueError(f"size must be N or HxW (e.g. 256 or 256x192), got {text!r}")
        values = tuple(int(x) for x in match.groups() if x is not None)
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or min(values) <= 0:
        raise ValueError(f"size must be N or HxW with positive numbers, got {text!r}")
    return values


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one stored sample becomes what the destination archive stores.

    raw: HxWx3 uint8 pixels of ``size``.  encoded: the source bytes unchanged
    when ``size`` is None (decoded once to prove they are readable), else
    resized and re-encoded with ``encoding``/``quality``.
    """

    mode: str
    size: Optional[Tuple[int, int]] = None  # (height, width)
    resize_mode: str = "stretch"
    encoding: str = "jpeg"
    quality: int = 90

    def apply(self, stored: "bytes | np.ndarray") -> "bytes | np.ndarray":
        """The destination's sample (raises codecs.DecodeError for a bad image)."""
        if self.mode == "encoded" and self.size is None:
            if isinstance(stored, bytes) and codecs.sniff(stored) is not None:
                codecs.open_image(stored)  # full decode: truncated or corrupt files fail here
                return stored
            return codecs.encode(self._pixels(stored), self.encoding, self.quality)
        pixels = self._pixels(stored)
        if self.mode == "raw":
            return pixels
        return codecs.encode(pixels, self.encoding, self.quality)

    def _pixels(self, stored: "bytes | np.ndarray") -> np.ndarray:
        if isinstance(stored, np.ndarray):
            if self.size is None or stored.shape[:2] == self.size:
                return codecs.to_array(stored, 3)
            image = Image.fromarray(codecs.to_array(stored, 3))
        else:
            image = _open_for_size(stored, self.size, self.resize_mode)
        if self.size is not None:
            image = resize(image, self.size, self.resize_mode)
        return codecs.pil_to_array(image, 3)


def resize(image: Image.Image, size: Tuple[int, int], resize_mode: str) -> Image.Image:
    """``image`` at (height, width): stretched, or scaled so the shorter side fits and center-cropped."""
    height, width = size
    if image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    if resize_mode == "stretch":
        box = (0, 0, image.width, image.height)
    elif resize_mode == "shorter-side-center-crop":
        scale = max(width / image.width, height / image.height)
        crop_w, crop_h = width / scale, height / scale
        left, top = max(0.0, (image.width - crop_w) / 2), max(0.0, (image.height - crop_h) / 2)
        box = (left, top, min(image.width, left + crop_w), min(image.height, top + crop_h))  # float rounding
    else:
        raise ValueError(f"resize mode must be one of {RESIZE_MODES}, got {resize_mode!r}")
    if image.size == (width, height) and box == (0, 0, width, height):
        return image
    return image.resize((width, height), Image.BILINEAR, box=box, reducing_gap=_REDUCING_GAP)


def _open_for_size(data: bytes, size: Optional[Tuple[int, int]], resize_mode: str) -> Image.Image:
    """Decode ``data``; a JPEG is decoded at a reduced scale (draft) when that still covers ``size``."""
    if size is None:
        return codecs.open_image(data)
    return codecs.open_image(data, draft=lambda stored: ("RGB", _decode_size(stored, size, resize_mode)))


def _decode_size(source: Tuple[int, int], size: Tuple[int, int], resize_mode: str) -> Tuple[int, int]:
    """The smallest (width, height) worth decoding to: ``_REDUCING_GAP`` times what the resize keeps.

    Like Pillow's ``thumbnail``: the JPEG decoder's own 1/2, 1/4, 1/8 scaling
    is used only while a margin of detail remains for the final filter, so
    large photos decode several times faster at no visible cost.
    """
    (w, h), (height, width) = source, size
    if resize_mode == "stretch":
        return math.ceil(width * _REDUCING_GAP), math.ceil(height * _REDUCING_GAP)
    scale = max(width / w, height / h) * _REDUCING_GAP
    return math.ceil(w * scale), math.ceil(h * scale)

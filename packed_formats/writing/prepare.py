"""The per-sample work of a conversion: decode, resize, re-encode (runs in worker processes)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional, Tuple

import numpy as np
from PIL import Image

from .. import codecs, policy
from ..fields import FieldSpec, move_boxes

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
    boxes: Tuple[Tuple[str, str], ...] = ()  # (array field, its box format): boxes a resize moves with the image
    raw_layout: str = "hwc"  # how a raw archive stores the pixels: interleaved ("hwc") or planar ("chw")

    def apply(self, stored: "bytes | np.ndarray") -> "bytes | np.ndarray":
        """The destination's sample (raises codecs.DecodeError for a bad image)."""
        if self.mode == "encoded" and self.size is None:
            if isinstance(stored, bytes) and codecs.sniff(stored) is not None:
                policy.check_decodes(stored)  # a whole decode: truncated or corrupt files fail here
                return stored
            return codecs.encode(self._pixels(stored), self.encoding, self.quality)
        pixels = self._pixels(stored)
        if self.mode == "raw":
            return pixels
        return codecs.encode(pixels, self.encoding, self.quality)

    def field(self, spec: FieldSpec, value: Any, stored: Callable[[], Any]) -> Any:
        """A field's value as the destination stores it: an image field (a mask) resized as the image is, with
        nearest-neighbour sampling (its values are classes, never blended) and stored as PNG (its mode kept);
        boxes (``boxes``) moved, scaled and clamped as the resize takes the sample's image (``stored()``, as the
        source stores it); anything else as it is.  codecs.DecodeError when an image field does not decode, or
        lacks pixel data, checked as strictly as images (``policy.check_decodes``)."""
        if spec.kind == "image" and isinstance(value, bytes):  # checked as strictly as images
            try:
                (policy.check_decodes if self.size is None else policy.check_complete)(value)
            except codecs.DecodeError as exc:
                raise codecs.DecodeError(f"field {spec.name!r}: {exc}") from None
        if self.size is None:
            return value
        if spec.kind == "image":
            image = codecs.open_image(value) if isinstance(value, bytes) else Image.fromarray(np.asarray(value))
            return spec.encode(policy.resize(image, self.size, self.resize_mode, resample=Image.Resampling.NEAREST))
        fmt = dict(self.boxes).get(spec.name)
        if fmt is None:
            return value
        array = np.asarray(value)
        if array.ndim != len(spec.shape or ()) or array.shape[-1:] != (4,):
            return value  # not boxes of its declaration: the writer refuses it by name
        source = _image_size(stored())
        left, top, right, bottom = policy.kept_box(source, self.size, self.resize_mode)
        moved = move_boxes(array, fmt, (top, left, bottom - top, right - left), self.size).reshape(array.shape)
        dtype = np.dtype(spec.dtype)
        return (np.rint(moved) if dtype.kind in "iu" else moved).astype(dtype)

    def drops_alpha(self, stored: "bytes | np.ndarray") -> bool:
        """Whether making this sample drops a transparency (alpha) channel the source has."""
        if self.mode == "encoded" and self.size is None and isinstance(stored, bytes):
            return False  # the file's own bytes are kept
        if isinstance(stored, np.ndarray):
            return stored.ndim == 3 and stored.shape[2] == 4
        return codecs.has_alpha(stored)

    def _pixels(self, stored: "bytes | np.ndarray") -> np.ndarray:
        if isinstance(stored, np.ndarray):
            if self.size is None or stored.shape[:2] == self.size:
                return codecs.to_array(stored, 3)
            image = Image.fromarray(codecs.to_array(stored, 3))
        else:
            policy.check_complete(stored)  # Pillow's decode would fill what a cut-short file lacks
            return policy.decode(stored, 3, self.size, self.resize_mode, reducing_gap=_REDUCING_GAP)
        if self.size is not None:
            image = policy.resize(image, self.size, self.resize_mode, reducing_gap=_REDUCING_GAP)
        return codecs.pil_to_array(image, 3)


def _image_size(stored: "bytes | np.ndarray") -> Tuple[int, int]:
    """(width, height) of a source's stored image: an array's shape, or the file's header (nothing decoded)."""
    if isinstance(stored, np.ndarray):
        return int(stored.shape[1]), int(stored.shape[0])
    return policy.image_size(stored)

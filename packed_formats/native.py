"""Decoding and resizing in native code: libjpeg-turbo through ``simplejpeg``, and torch's uint8 resize.

On ~400 px photos (one core) Pillow decodes ~2,500 JPEGs/s, but Pillow's
bilinear resize to 256x256 costs about three decodes, so decode + resize ran
at ~800/s; a native decode and torch's antialiased uint8 ``interpolate``
together run at ~2,000/s.  ``simplejpeg`` (libjpeg-turbo) decodes straight
into numpy and scales in the DCT (1/2, 1/4, 1/8) when asked for a minimum
size, so a large photo bound for 224 px is never decoded whole.
(torchvision's own ``decode_jpeg`` is deprecated from torchvision 0.29 on.)

The guarantees are the Pillow path's: RGB pixels equal to Pillow's decode of
the same JPEG, greyscale by Pillow's own ITU-R 601-2 weights, CMYK and YCCK
JPEGs left to Pillow's conversion, and a JPEG the native decoder refuses
(truncated, damaged: it runs strict) goes back to Pillow, whose strict
decode either reads it or raises ``DecodeError`` -- unless libjpeg's own
warning says pixel data is missing (``lacks_pixel_data``: a file cut short
with its end marker put back, which Pillow would fill with grey), which is a
``DecodeError`` at once.  Without ``simplejpeg``
(a platform without its wheels) everything decodes through Pillow.

Parting an image's channels, HxWxC into CxHxW (an NCHW batch of an
interleaved archive), and joining them back (a channels-last batch of a
planar one) is one vectorised pass in the package's one C module
(``_pixels``, built at install where a C compiler is): ~20 us for a 256x256x3
image on one core, about what a plain copy of it costs, where numpy's
transposing copy, moving a byte at a time, takes ~65 us to part and ~340 us
to join.  Without the module (``planar_copy()`` is then "numpy") numpy copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Tuple

import numpy as np

if TYPE_CHECKING:
    import torch

try:
    import simplejpeg
except ImportError:  # pragma: no cover - a dependency wherever wheels exist
    simplejpeg = None

try:
    from . import _pixels
except ImportError:  # pragma: no cover - built wherever pip found a C compiler
    _pixels = None  # type: ignore[assignment]

_NATIVE_COLORSPACES = ("YCbCr", "Gray")


def planar_copy() -> str:
    """What parts and joins an image's channels here: "native" (the C module) or "numpy"."""
    return "numpy" if _pixels is None else "native"


def to_planar(pixels: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """``out`` [..., C, H, W] = ``pixels`` [..., H, W, C] (uint8): each image's channels parted in one
    pass, natively where both arrays are C-contiguous (a sample of a map and a row of a contiguous
    batch are), else numpy's transposing copy.  Without ``out``, into a new array."""
    if out is None:
        out = np.empty(pixels.shape[:-3] + (pixels.shape[-1],) + pixels.shape[-3:-1], np.uint8)
    return _copy(pixels, out, planar=True)


def to_interleaved(planar: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out`` [..., H, W, C] = ``planar`` [..., C, H, W] (uint8), the inverse of ``to_planar``."""
    return _copy(planar, out, planar=False)


def gather(data: np.ndarray, starts: np.ndarray, out: np.ndarray, places: np.ndarray, planar: bool) -> None:
    """``out[places[j]]`` = the image at byte ``starts[j]`` of ``data`` (a 1-D uint8 array: a file's map),
    its channels parted (``planar``: H x W x C into ``out`` [R, C, H, W]) or joined (C x H x W into ``out``
    [R, H, W, C]): one call of the C module for the batch, the GIL released.  ``out``: C-contiguous uint8;
    ValueError for an image outside ``data`` or a place outside ``out``."""
    assert _pixels is not None, "gather needs the C module (planar_copy() is 'native')"
    channels = out.shape[1] if planar else out.shape[3]
    _pixels.gather(data, np.ascontiguousarray(starts, np.int64), out, np.ascontiguousarray(places, np.int64),
                   out[0].nbytes, channels, planar)


def _copy(src: np.ndarray, out: np.ndarray, planar: bool) -> np.ndarray:
    """``to_planar`` (``planar``) or ``to_interleaved``: the shapes checked, then the C module or numpy."""
    if src.ndim < 3 or src.ndim != out.ndim:
        raise ValueError(f"cannot copy {src.shape} into {out.shape}: images of three axes, as many in both")
    axes = src.ndim - 3
    src_image, out_image = src.shape[axes:], out.shape[axes:]
    moved = (src_image[2], src_image[0], src_image[1]) if planar else (src_image[1], src_image[2], src_image[0])
    if src.shape[:axes] != out.shape[:axes] or out_image != moved:
        raise ValueError(f"cannot copy {src.shape} into {out.shape} with its channels "
                         f"{'parted' if planar else 'joined'}")
    channels = src_image[2] if planar else src_image[0]
    native = (_pixels is not None and src.dtype == out.dtype == np.uint8 and src.flags.c_contiguous
              and out.flags.c_contiguous and src.size > 0)
    if native:
        nbytes = src_image[0] * src_image[1] * src_image[2]
        rows = np.arange(src.size // nbytes, dtype=np.int64)
        _pixels.gather(src.reshape(-1), rows * nbytes, out.reshape(-1), rows, nbytes, channels, planar)
    elif planar:
        np.copyto(out, np.moveaxis(src, -1, -3))
    else:
        for c in range(channels):  # a channel at a time: ~4x faster than numpy's one transposing copy
            out[..., c] = src[..., c, :, :]
    return out


def decode_jpeg(
    data: bytes, min_size: Optional[Callable[[Tuple[int, int]], Tuple[int, int]]] = None
) -> Optional[np.ndarray]:
    """A JPEG as HxWx3 uint8 RGB, or None when the native decoder should not or cannot decode it
    (the caller then asks Pillow, which decodes it or says why not).

    ``min_size`` gets the stored (width, height), read from the header (``jpeg_size``), and gives
    the (width, height) to decode at least: the smallest DCT scale still that large is used.
    """
    stored = jpeg_size(data)
    if stored is None:
        return None
    least_width, least_height = (0, 0) if min_size is None else min_size(stored)
    try:
        return simplejpeg.decode_jpeg(
            data, colorspace="RGB", min_width=least_width, min_height=least_height, strict=True
        )
    except (ValueError, RuntimeError, OSError):
        return None


# libjpeg's warnings for pixel data that is missing (ends early, or is skipped to the next marker): it fills
# what it lacks with grey and carries on, and Pillow never says so.  Other warnings (extraneous bytes before
# a marker, a bad ICC profile) leave every pixel decoded.
_MISSING_DATA = ("premature end", "bad huffman code", "bad arithmetic code", "instead of rst")


def jpeg_refusal(data: bytes) -> Optional[str]:
    """Why the native decoder, reading strictly at the cheapest setting that still decodes every
    entropy-coded block (1/8 scale, grey: no inverse DCT to speak of, no colour conversion), refuses a
    JPEG, in libjpeg's words; None when it reads it whole, about three times faster than a full decode."""
    if simplejpeg is None:
        return "no native JPEG decoder"
    try:
        simplejpeg.decode_jpeg(data, colorspace="GRAY", min_width=1, min_height=1, strict=True)
    except (ValueError, RuntimeError, OSError) as exc:
        return str(exc) or type(exc).__name__
    return None


def lacks_pixel_data(refusal: Optional[str]) -> bool:
    """Whether a ``jpeg_refusal`` says pixel data is missing ("Corrupt JPEG data: premature end of data
    segment", "Premature end of JPEG file", a bad Huffman code...): what Pillow would fill with grey."""
    return refusal is not None and any(words in refusal.lower() for words in _MISSING_DATA)


def jpeg_decodes(data: bytes) -> bool:
    """Whether the native decoder reads the whole JPEG strictly (``jpeg_refusal`` is None).
    False also where there is no native decoder or it leaves the file to Pillow."""
    return jpeg_refusal(data) is None


def to_grey(rgb: np.ndarray) -> np.ndarray:
    """HxWx3 uint8 RGB -> HxWx1 "L", bit for bit as Pillow's ``convert("L")``."""
    r, g, b = (rgb[:, :, c].astype(np.uint32) for c in range(3))
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)[:, :, None]


def resize(image: "torch.Tensor", size: Tuple[int, int], resize_mode: str = "stretch") -> "torch.Tensor":
    """CxHxW uint8 to (height, width), bilinear with antialiasing: stretched, or scaled so the shorter
    side fits and center-cropped ("shorter-side-center-crop").  A channels-last view of an HxWxC
    array (``permute(2, 0, 1)``) is the fast kernel's own layout: no copy before it.  torch is
    imported here, where readers resize, not by the decode and the converter's decode check."""
    import torch
    import torch.nn.functional as F

    height, width = size
    top, left, crop_h, crop_w = kept_box(int(image.shape[-2]), int(image.shape[-1]), size, resize_mode)
    image = image[:, top : top + crop_h, left : left + crop_w]
    if tuple(image.shape[-2:]) == (height, width):
        return image
    # the fast uint8 kernel's layout, with the batch stride of a real NHWC tensor: given unsqueeze(0)'s
    # stride of 3 there, interpolate returns NCHW, and every later HxWxC copy of the image is strided
    batch = image.permute(1, 2, 0).unsqueeze(0).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    return F.interpolate(batch, size=(height, width), mode="bilinear", antialias=True, align_corners=False)[0]


def kept_box(h: int, w: int, size: Tuple[int, int], resize_mode: str = "stretch") -> Tuple[int, int, int, int]:
    """(top, left, height, width) of an h x w image that ``resize`` keeps for ``size`` (height, width):
    all of it ("stretch"), or its centre at the output's aspect ("shorter-side-center-crop")."""
    if resize_mode == "stretch":
        return 0, 0, h, w
    if resize_mode != "shorter-side-center-crop":
        raise ValueError(f"resize mode must be 'stretch' or 'shorter-side-center-crop', got {resize_mode!r}")
    height, width = size
    scale = max(width / w, height / h)
    crop_h, crop_w = min(h, max(1, round(height / scale))), min(w, max(1, round(width / scale)))
    return (h - crop_h) // 2, (w - crop_w) // 2, crop_h, crop_w


def jpeg_size(data: bytes) -> Optional[Tuple[int, int]]:
    """A JPEG's stored (width, height) from its header, or None where the native decoder would not
    decode it (no native decoder, an unreadable header, CMYK/YCCK: Pillow's then)."""
    if simplejpeg is None:
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except (ValueError, RuntimeError, OSError):
        return None
    return (width, height) if colorspace in _NATIVE_COLORSPACES else None

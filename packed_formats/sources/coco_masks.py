"""COCO's instance masks, without pycocotools: run-length encodings decoded and polygons rasterised with numpy and PIL.

A COCO annotation's ``segmentation`` is a list of polygons (``[[x1, y1, x2, y2, ...], ...]``, in pixels of
the image), or a run-length encoding (RLE) ``{"size": [h, w], "counts": ...}`` whose counts are a list of
integers or the compressed string pycocotools writes.  The runs alternate background and foreground, from
background, over the mask in column-major order (down each column, then the next), and sum to ``h * w``.

Everything here is read from an untrusted file: each function raises ``MaskError`` (a ValueError) saying
what is wrong, which the source turns into an error naming the file, image and annotation.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, List, Sequence

import numpy as np

_MAX_CHUNKS = 13  # 5-bit chunks of one compressed count at most: 65 bits, past any count of an image's pixels


class MaskError(ValueError):
    """A segmentation that is no mask of its image (the message says why)."""


def compressed_counts(text: str) -> List[int]:
    """The run lengths of a compressed RLE string (pycocotools' ``rleFrString``): each count in 5-bit chunks
    from the character ``'0'`` on, the 6th bit saying another chunk follows, the last chunk's 5th bit its
    sign; from the third count on, each is stored as its difference to the count two before."""
    counts: List[int] = []
    p, size = 0, len(text)
    while p < size:
        value, chunk, more = 0, 0, True
        while more:
            if p >= size:
                raise MaskError("the compressed RLE string ends inside a count")
            c = ord(text[p]) - 48
            if not 0 <= c < 64:
                raise MaskError(f"the compressed RLE string has the character {text[p]!r}, which is no count "
                                "character ('0' to 'o')")
            if chunk >= _MAX_CHUNKS:
                raise MaskError("the compressed RLE string holds a count too long for any image")
            value |= (c & 0x1F) << (5 * chunk)
            more = bool(c & 0x20)
            p, chunk = p + 1, chunk + 1
            if not more and c & 0x10:
                value |= -1 << (5 * chunk)
        if len(counts) > 2:
            value += counts[-2]
        counts.append(value)
    return counts


def rle_mask(rle: Any, height: int, width: int) -> np.ndarray:
    """The [height, width] bool mask of an RLE dict whose ``size`` must be the image's."""
    if not isinstance(rle, dict) or "counts" not in rle or "size" not in rle:
        raise MaskError("an RLE segmentation is an object with 'size' and 'counts'")
    size = rle["size"]
    if not (isinstance(size, list) and len(size) == 2 and all(_is_int(v) for v in size)):
        raise MaskError(f"an RLE's size is [height, width], got {size!r:.80}")
    if list(size) != [height, width]:
        raise MaskError(f"the RLE's size {size} is not the image's [{height}, {width}] (height, width)")
    raw = rle["counts"]
    if isinstance(raw, str):
        counts = compressed_counts(raw)
    elif isinstance(raw, list) and all(_is_int(v) for v in raw):
        counts = list(raw)
    else:
        raise MaskError("an RLE's counts are a list of integers or a compressed string")
    if any(c < 0 for c in counts):
        raise MaskError("an RLE's counts are never negative")
    if sum(counts) != height * width:
        raise MaskError(f"the RLE's counts sum to {sum(counts)}, not the image's {height} x {width} = "
                        f"{height * width} pixels")
    values = np.zeros(len(counts), dtype=bool)
    values[1::2] = True
    flat = np.repeat(values, np.asarray(counts, dtype=np.int64))
    return flat.reshape(width, height).T


def check_polygons(polygons: Any, height: int, width: int, slack: float) -> None:
    """MaskError unless ``polygons`` is a list of polygons of finite coordinates, each an even number of them
    (at least 2 points), lying in the image (``slack`` pixels past its edges allowed)."""
    if not isinstance(polygons, list) or not polygons:
        raise MaskError("a polygon segmentation is a non-empty list of polygons")
    for polygon in polygons:
        if not isinstance(polygon, list) or len(polygon) < 4 or len(polygon) % 2:
            raise MaskError("a polygon is a list of x, y coordinates: an even number of them, at least 4")
        if not all(_is_number(v) and math.isfinite(v) for v in polygon):
            raise MaskError("a polygon's coordinates are finite numbers (no NaN, no infinity)")
        xs, ys = polygon[0::2], polygon[1::2]
        if min(xs) < -slack or min(ys) < -slack or max(xs) > width + slack or max(ys) > height + slack:
            raise MaskError(f"a polygon reaches past the image's {width} x {height} pixels (width x height)")


def polygon_mask(polygons: Sequence[Sequence[float]], height: int, width: int) -> np.ndarray:
    """The [height, width] bool mask of ``polygons`` (checked by ``check_polygons``), filled by PIL, as the
    union of their insides and outlines."""
    from PIL import Image, ImageDraw

    canvas = Image.new("1", (width, height), 0)
    draw = ImageDraw.Draw(canvas)
    for polygon in polygons:
        draw.polygon([(float(x), float(y)) for x, y in zip(polygon[0::2], polygon[1::2])], fill=1, outline=1)
    return np.asarray(canvas, dtype=bool)


def instance_map(masks: Iterable[np.ndarray], height: int, width: int, dtype: Any = np.uint16) -> np.ndarray:
    """One [height, width] map of the image's instances (``dtype``: uint8 holds 255 of them, uint16 65,535): 0
    where none is, k + 1 where instance k is; where instances overlap, the smallest of them (the one that would
    be hidden otherwise; of equal ones, the later) is kept.  One mask at a time is held, whatever their number."""
    out = np.zeros((height, width), dtype=dtype)
    owner = np.full((height, width), np.iinfo(np.int64).max, dtype=np.int64)  # the area of each pixel's instance
    most = int(np.iinfo(dtype).max)
    for k, mask in enumerate(masks):
        if k >= most:
            raise MaskError(f"more than {most} instances: more than a {np.dtype(dtype).name} map holds")
        area = int(np.count_nonzero(mask))
        there = mask & (owner >= area)
        out[there] = k + 1
        owner[there] = area
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

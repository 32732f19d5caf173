"""The part of a transform that an encoded archive can do while decoding: its first crop.

``train(224)`` on an encoded archive would otherwise decode every image whole,
resize it to one size (so that the images make a batch) and only then crop
224 pixels out of that.  Drawn in the source image's own coordinates instead,
the crop tells the decoder how little it needs: a JPEG is decoded at the
smallest DCT scale (1/2, 1/4, 1/8) whose pixels still cover the crop at the
output size, and only the crop is resized, straight to 224.  No ``size=`` is
needed, since each image is cut to the output size on its own.

``split_at_decode(transform)`` finds such a crop at the front of a transform:
``RandomResizedCrop`` (alone, first in a ``Compose``, or in ``train``'s fused
``CropFlipNormalize``) and ``Resize(shorter side) + CenterCrop`` (``val``).
The random crops are drawn with ``RandomResizedCrop.get_params`` from the
batch's generator, per image, in that image's own size: the distribution of
torchvision's ``RandomResizedCrop`` on the whole image, and the same draws
the batch transform makes from the same generator on a batch of one size.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Tuple, Union

import numpy as np
import torch

from .ops import (
    CenterCrop,
    Compose,
    CropFlipNormalize,
    FlipNormalize,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToFloat,
)

Boxes = np.ndarray  # int64 [B, 4]: top, left, height, width of each crop in its source image


class CropAtDecode(Protocol):
    size: Tuple[int, int]  # (height, width) every crop is resized to

    def boxes(self, heights: np.ndarray, widths: np.ndarray, generator: Optional[torch.Generator]) -> Boxes:
        """Each image's crop box, from its stored size (int64 [B] each)."""


class RandomCropAtDecode:
    """``RandomResizedCrop`` drawn in each source image's own size."""

    def __init__(self, crop: RandomResizedCrop) -> None:
        self.crop, self.size = crop, crop.size

    def boxes(self, heights: np.ndarray, widths: np.ndarray, generator: Optional[torch.Generator]) -> Boxes:
        tops, lefts, h, w = self.crop.get_params(
            len(heights), torch.from_numpy(heights), torch.from_numpy(widths), generator=self.crop._rng(generator)
        )
        return torch.stack([tops, lefts, h, w], dim=1).numpy()


class CenterCropAtDecode:
    """``Resize(shorter side to resize)`` then ``CenterCrop(size)``, as a box in each source image."""

    def __init__(self, resize: int, crop: CenterCrop) -> None:
        self.resize, self.size = resize, crop.size

    def boxes(self, heights: np.ndarray, widths: np.ndarray, generator: Optional[torch.Generator]) -> Boxes:
        h, w = heights.astype(np.float64), widths.astype(np.float64)
        scale = self.resize / np.minimum(h, w)  # Resize's rounding of the resized size, then the central window
        resized_h, resized_w = np.rint(h * scale), np.rint(w * scale)
        crop_h, crop_w = self.size
        if np.any(resized_h < crop_h) or np.any(resized_w < crop_w):
            raise ValueError(f"CenterCrop{self.size} does not fit an image resized to shorter side {self.resize}")
        top, left = (resized_h - crop_h) // 2, (resized_w - crop_w) // 2
        box = np.stack([top / scale, left / scale, crop_h / scale, crop_w / scale], axis=1)
        box = np.rint(box).astype(np.int64)
        box[:, 2:] = np.maximum(box[:, 2:], 1)
        box[:, 2] = np.minimum(box[:, 2], heights - box[:, 0])
        box[:, 3] = np.minimum(box[:, 3], widths - box[:, 1])
        return box


def split_at_decode(transform: Optional[Callable]) -> Optional[Tuple[CropAtDecode, Optional[Callable]]]:
    """(the crop to make while decoding, what of ``transform`` remains after it), or None when
    ``transform`` does not start with a crop that can be drawn in the source image (or asks
    for no antialiasing: the crop is always resized with it)."""
    if isinstance(transform, CropFlipNormalize):
        crop, flip, normalize = transform._parts
        rest = FlipNormalize(flip, normalize, transform.generator)  # flip, float and NCHW in one pass
        return (RandomCropAtDecode(crop), rest) if crop.antialias else None
    if isinstance(transform, RandomResizedCrop):
        return (RandomCropAtDecode(transform), None) if transform.antialias else None
    if not isinstance(transform, Compose) or not transform.transforms:
        return None
    ops = transform.transforms
    first: Union[RandomResizedCrop, Resize, None] = None
    if isinstance(ops[0], (RandomResizedCrop, Resize)) and ops[0].antialias:
        first = ops[0]
    if isinstance(first, RandomResizedCrop):
        return RandomCropAtDecode(first), _remaining(transform, ops[1:])
    if isinstance(first, Resize) and isinstance(first.size, int) and len(ops) >= 2 and isinstance(ops[1], CenterCrop):
        return CenterCropAtDecode(first.size, ops[1]), _remaining(transform, ops[2:])
    return None


def _remaining(transform: Compose, ops: list) -> Optional[Callable]:
    """What follows the crop: [flip,] normalise fused into one pass (``FlipNormalize``), else as it is."""
    if not ops:
        return None
    flip = ops[0] if len(ops) == 2 and isinstance(ops[0], RandomHorizontalFlip) else None
    if len(ops) == 1 + (flip is not None) and isinstance(ops[-1], (Normalize, ToFloat)):
        return FlipNormalize(flip, ops[-1], transform.generator)
    return Compose(ops, transform.generator)

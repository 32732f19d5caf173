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
``CropFlipNormalize``) and ``Resize(shorter side) + CenterCrop`` (``val``), ours
or torchvision's (bilinear, antialiased), first in a ``Compose`` of ours or of
torchvision's, however nested: ``Compose([train(224), RandomChoice([MixUp(...),
CutMix(...)])])`` crops while decoding and mixes the finished batch.
The random crops are drawn with ``RandomResizedCrop.get_params`` from the
batch's generator, per image, in that image's own size: the distribution of
torchvision's ``RandomResizedCrop`` on the whole image, and the same draws
the batch transform makes from the same generator on a batch of one size.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Protocol, Tuple

import numpy as np
import torch

from . import functional as F
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
    is_batch_transform,
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
    """``Resize(shorter side to resize)`` then ``CenterCrop(size)``, as a box in each source image.

    The window is torchvision's, to the nearest source pixel: the resized size and the
    window's place in it by torchvision's arithmetic (``functional.shorter_side_sizes``,
    ``functional.center_offsets``), each edge then taken back to the source image (which the
    resize stretches by ``source / resized`` along each side) and rounded there.
    """

    def __init__(self, resize: int, crop: CenterCrop) -> None:
        self.resize, self.size = resize, crop.size

    def boxes(self, heights: np.ndarray, widths: np.ndarray, generator: Optional[torch.Generator]) -> Boxes:
        heights, widths = np.asarray(heights, dtype=np.int64), np.asarray(widths, dtype=np.int64)
        resized_h, resized_w = F.shorter_side_sizes(heights, widths, self.resize)
        crop_h, crop_w = self.size
        if np.any(resized_h < crop_h) or np.any(resized_w < crop_w):
            raise ValueError(f"CenterCrop{self.size} does not fit an image resized to shorter side {self.resize}")
        tops, bottoms = _source_edges(F.center_offsets(resized_h, crop_h), crop_h, heights, resized_h)
        lefts, rights = _source_edges(F.center_offsets(resized_w, crop_w), crop_w, widths, resized_w)
        return np.stack([tops, lefts, bottoms - tops, rights - lefts], axis=1)


def _source_edges(starts: np.ndarray, crop: int, lengths: np.ndarray, resized: np.ndarray
                  ) -> Tuple[np.ndarray, np.ndarray]:
    """(first, past the last), int64: the source pixels of the resized pixels ``starts`` to ``starts + crop``
    along sides of ``lengths`` source and ``resized`` resized pixels, each edge rounded to the nearest
    source pixel (at least one pixel, within the side)."""
    first = np.rint(starts * lengths / resized).astype(np.int64)
    last = np.rint((starts + crop) * lengths / resized).astype(np.int64)
    first = np.minimum(first, lengths - 1)
    return first, np.clip(last, first + 1, lengths)


def split_at_decode(transform: Optional[Callable]) -> Optional[Tuple[CropAtDecode, Optional[Callable]]]:
    """(the crop to make while decoding, what of ``transform`` remains after it), or None when
    ``transform`` does not start with a crop that can be drawn in the source image (or asks
    for no antialiasing, or another interpolation than bilinear: the crop is always resized
    bilinearly with antialiasing).

    Containers are seen through: a ``Compose`` (ours, or torchvision's ``transforms.Compose``
    and ``transforms.v2.Compose``) starts with a crop when its first step does, however deeply
    nested (``Compose([train(224), MixUp(...)])``), and what remains is the same kind of
    container holding the first step's remainder and the steps after it.
    """
    if isinstance(transform, CropFlipNormalize):
        crop, flip, normalize = transform._parts
        rest = FlipNormalize(flip, normalize, transform.generator)  # flip, float and NCHW in one pass
        return (RandomCropAtDecode(crop), rest) if crop.antialias else None
    if isinstance(transform, RandomResizedCrop):
        return (RandomCropAtDecode(transform), None) if transform.antialias else None
    if isinstance(transform, Compose):
        ours = transform
        return _split_steps(transform.transforms, lambda steps: _remaining(ours, steps))
    if _is_torchvision(transform, "Compose"):
        theirs: Any = transform
        return _split_steps(list(theirs.transforms), lambda steps: type(theirs)(steps) if steps else None)
    torchvision_crop = _torchvision_random_crop(transform)
    return None if torchvision_crop is None else (RandomCropAtDecode(torchvision_crop), None)


def _split_steps(steps: list, remaining: Callable[[list], Optional[Callable]]
                 ) -> Optional[Tuple[CropAtDecode, Optional[Callable]]]:
    """``split_at_decode`` of a list of steps: its first crop, and ``remaining`` of the steps after it."""
    if not steps:
        return None
    resize = _shorter_side_resize(steps[0])
    if resize is not None and len(steps) >= 2:
        center = _center_crop(steps[1])
        if center is not None:
            return CenterCropAtDecode(resize, center), remaining(steps[2:])
    first = split_at_decode(steps[0])
    if first is None:
        return None
    crop, rest = first
    return crop, remaining(([rest] if rest is not None else []) + steps[1:])


def _shorter_side_resize(step: Any) -> Optional[int]:
    """The shorter side ``step`` resizes to, where it is a bilinear, antialiased shorter-side Resize
    (ours, or torchvision's with no ``max_size``), else None."""
    if isinstance(step, Resize):
        return step.size if isinstance(step.size, int) and step.antialias else None
    if not _is_torchvision(step, "Resize") or not _bilinear(step) or getattr(step, "max_size", None) is not None:
        return None
    size = step.size
    if isinstance(size, (list, tuple)) and len(size) == 1:
        size = size[0]
    return size if isinstance(size, int) else None


def _center_crop(step: Any) -> Optional[CenterCrop]:
    """``step`` as our CenterCrop, where it is one (or torchvision's), else None."""
    if isinstance(step, CenterCrop):
        return step
    if _is_torchvision(step, "CenterCrop"):
        size = step.size
        return CenterCrop(tuple(size) if len(size) == 2 else size[0])
    return None


def _torchvision_random_crop(step: Any) -> Optional[RandomResizedCrop]:
    """torchvision's (bilinear, antialiased) ``RandomResizedCrop`` as ours, same size, scale and ratio."""
    if not _is_torchvision(step, "RandomResizedCrop") or not _bilinear(step):
        return None
    return RandomResizedCrop(tuple(step.size), scale=tuple(step.scale), ratio=tuple(step.ratio))


def _is_torchvision(step: Any, name: str) -> bool:
    """Whether ``step`` is torchvision's ``transforms.<name>`` or ``transforms.v2.<name>`` (when torchvision
    has been imported: a torchvision object exists only then)."""
    for module in ("torchvision.transforms", "torchvision.transforms.v2"):
        kind = getattr(sys.modules.get(module), name, None)
        if isinstance(kind, type) and isinstance(step, kind):
            return True
    return False


def _bilinear(step: Any) -> bool:
    """Whether a torchvision resizing step interpolates bilinearly with antialiasing, as the decoder does."""
    interpolation = getattr(step, "interpolation", None)
    return getattr(interpolation, "value", interpolation) == "bilinear" and getattr(step, "antialias", True) is True


def _remaining(transform: Compose, ops: list) -> Optional[Callable]:
    """What follows the crop: [flip,] normalise fused into one pass (``FlipNormalize``), else as it is."""
    if not ops:
        return None
    flip = ops[0] if len(ops) == 2 and isinstance(ops[0], RandomHorizontalFlip) else None
    if len(ops) == 1 + (flip is not None) and isinstance(ops[-1], (Normalize, ToFloat)):
        return FlipNormalize(flip, ops[-1], transform.generator)
    if len(ops) == 1 and transform.generator is None and is_batch_transform(ops[0]):
        return ops[0]  # a nested step's remainder (train's FlipNormalize) needs no Compose around it
    return Compose(ops, transform.generator)

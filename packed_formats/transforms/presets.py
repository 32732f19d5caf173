"""The usual ImageNet recipes: ``train(size)`` and ``val(size)``."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from .ops import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CenterCrop,
    Compose,
    CropFlipNormalize,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    Size,
    _pair,
)


def train(
    size: Size, scale: Tuple[float, float] = (0.08, 1.0), mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> CropFlipNormalize:
    """ImageNet-style training: RandomResizedCrop(size), RandomHorizontalFlip, Normalize (fused on the CPU)."""
    return CropFlipNormalize(RandomResizedCrop(size, scale=scale), RandomHorizontalFlip(), Normalize(mean, std))


def val(
    size: Size, resize: Optional[int] = None, mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> Compose:
    """ImageNet-style evaluation: Resize(shorter side to size/0.875), CenterCrop(size), Normalize."""
    if resize is None:
        resize = int(round(max(_pair(size)) / 0.875))
    return Compose([Resize(resize), CenterCrop(size), Normalize(mean, std)])

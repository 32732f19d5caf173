"""The usual ImageNet recipes: ``train(size)`` and ``val(size)``."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .augment import RandAugment, RandomErasing, TrivialAugmentWide
from .ops import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BatchTransform,
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
    std: Sequence[float] = IMAGENET_STD, *, auto_augment: Optional[str] = None, ra_magnitude: int = 9,
    random_erase: float = 0.0, memory_format: Optional[torch.memory_format] = None,
) -> Compose:
    """ImageNet-style training: RandomResizedCrop(size), RandomHorizontalFlip, Normalize (fused on the CPU).

    The settings of torchvision's classification reference (``ClassificationPresetTrain``)
    carry over: an automatic augmentation between the flip and ``Normalize``, and
    ``RandomErasing`` after it.

    Args:
        size: the output size, an int (square) or (height, width).
        scale: the crop's share of the image area, as for ``RandomResizedCrop``.
        mean, std: ``Normalize``'s per-channel mean and standard deviation, in [0, 1] units.
        auto_augment: None, "ta_wide" (``TrivialAugmentWide``) or "ra" (``RandAugment``), both
            with bilinear interpolation (the reference's ``--auto-augment``; its "augmix" and
            AutoAugment policies are not supported: ValueError).
        ra_magnitude: ``RandAugment``'s magnitude (the reference's ``--ra-magnitude``).
        random_erase: ``RandomErasing``'s probability per image; 0 for none (``--random-erase``).
        memory_format: the layout ``Normalize`` writes its result in (``torch.channels_last`` for a
            channels-last model: no copy after it); None: contiguous NCHW from the fused CPU pass,
            the batch's own layout elsewhere.  ``make_loader`` sets it to its own ``memory_format``.
    """
    crop, flip = RandomResizedCrop(size, scale=scale), RandomHorizontalFlip()
    normalize = Normalize(mean, std, memory_format=memory_format)
    augment = _auto_augment(auto_augment, ra_magnitude)
    if augment is None and not random_erase:
        return CropFlipNormalize(crop, flip, normalize)
    steps = [crop, flip] + ([augment] if augment is not None else []) + [normalize]
    return Compose(steps + ([RandomErasing(p=random_erase)] if random_erase else []))


AUTO_AUGMENTS = (None, "ta_wide", "ra")  # the reference's --auto-augment values train() takes


def _auto_augment(policy: Optional[str], ra_magnitude: int) -> Optional[BatchTransform]:
    """The augmentation the reference's ``--auto-augment policy`` names; ValueError for one not supported."""
    if policy == "ta_wide":
        return TrivialAugmentWide(interpolation="bilinear")
    if policy == "ra":
        return RandAugment(magnitude=ra_magnitude, interpolation="bilinear")
    if policy is not None:
        raise ValueError(f"auto_augment must be one of {AUTO_AUGMENTS}, got {policy!r} "
                         "(AugMix and the AutoAugment policies are not supported)")
    return None


def val(
    size: Size, resize: Optional[int] = None, mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD, memory_format: Optional[torch.memory_format] = None,
) -> Compose:
    """ImageNet-style evaluation: Resize(shorter side to ``resize``), CenterCrop(size), Normalize.

    Args:
        size: the output size, an int (square) or (height, width).
        resize: the shorter side images are resized to first (default: size / 0.875; the
            reference's ``--val-resize-size``).
        mean, std: ``Normalize``'s per-channel mean and standard deviation, in [0, 1] units.
        memory_format: the layout ``Normalize`` writes its result in (None: the batch's own).
    """
    if resize is None:
        resize = int(round(max(_pair(size)) / 0.875))
    return Compose([Resize(resize), CenterCrop(size), Normalize(mean, std, memory_format=memory_format)])

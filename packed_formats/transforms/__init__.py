"""Batched image transforms: ``nn.Module``s over whole ``[B,C,H,W]`` batches.

They take uint8 or float batches on any device and keep the batch's memory
format (channels-last batches stay channels-last).  Crops come before the
conversion to float, so the float work is done on the output size only.
Random parameters are drawn per sample on the CPU, from the ``generator``
passed to ``forward`` (or given to the constructor), so a seed gives the same
crops and flips whether the batch lives on the CPU or a GPU.  A caller that
has memory for the result (a DataLoader worker's shared-memory slot) passes
``allocate=`` to ``forward``.

``train(size)`` and ``val(size)`` are the usual ImageNet recipes (``train``
also takes the ``auto_augment``, ``ra_magnitude`` and ``random_erase`` settings of
torchvision's classification reference).  The ops
live in ``ops``, the kernels they call in ``functional``.  ``RandomErasing``,
``TrivialAugmentWide`` and ``RandAugment`` (``augment``, kernels in
``adjust``) draw per sample, as torchvision's do per image.

A transform may take ``(images, labels)`` and return both (``labels``):
torchvision's ``MixUp`` and ``CutMix`` as they are, any callable wrapped in
``WithLabels``.  ``make_loader`` runs it on each batch and its labels, last in
a ``Compose`` after ``Normalize``; ``apply_with_labels`` does so by hand.

``with_memory_format(transform, torch.channels_last)`` makes a transform's
normalisation write channels-last batches directly (no float copy after it);
``batchwise(transform)`` makes ``train``'s fused per-sample CPU passes one
vectorised pass per step, as they run on a GPU (what follows a decode on the
device).
"""

from .augment import RandAugment, RandomErasing, TrivialAugmentWide
from .functional import UINT8_TO_UNIT, gathered_crops, resized_crops
from .labels import WithLabels, takes_labels
from .ops import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Batched,
    BatchTransform,
    CenterCrop,
    Compose,
    CropFlipNormalize,
    FlipNormalize,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    Size,
    ToFloat,
    apply_transform,
    apply_with_labels,
    batchwise,
    is_batch_transform,
    per_sample,
    with_memory_format,
)
from .presets import train, val

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "UINT8_TO_UNIT",
    "BatchTransform",
    "Batched",
    "CenterCrop",
    "Compose",
    "CropFlipNormalize",
    "FlipNormalize",
    "Normalize",
    "RandAugment",
    "RandomCrop",
    "RandomErasing",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "Size",
    "ToFloat",
    "TrivialAugmentWide",
    "WithLabels",
    "apply_transform",
    "apply_with_labels",
    "batchwise",
    "gathered_crops",
    "is_batch_transform",
    "per_sample",
    "resized_crops",
    "takes_labels",
    "train",
    "val",
    "with_memory_format",
]

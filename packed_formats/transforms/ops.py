"""The batch transforms: ``nn.Module``s that draw per-sample parameters and call the kernels.

Every op is called as ``op(batch, generator=None, allocate=None)`` on a
``[B,C,H,W]`` batch.  ``generator`` is the CPU generator random parameters are
drawn from (else the one given to the constructor).  ``allocate(shape, dtype,
memory_format)``, when given, is asked first for the memory of a CPU result
the op allocates, such as a DataLoader worker's shared-memory slot; it may
answer None.  Ops whose result is a view of their input (``CenterCrop``) or
made by a torch kernel (``Resize``) have nothing to place and ignore it.
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union, cast

import numpy as np
import torch
from torch import nn

from ..memory import Allocate
from . import functional as F
from .labels import check_images_only, mix, takes_labels

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

Size = Union[int, Tuple[int, int]]


def _pair(size: Size) -> Tuple[int, int]:
    if isinstance(size, int):
        size = (size, size)
    h, w = (int(s) for s in size)
    if h <= 0 or w <= 0:
        raise ValueError(f"size must be positive, got {size}")
    return h, w


def _check_batch(batch: torch.Tensor) -> None:
    if not isinstance(batch, torch.Tensor) or batch.dim() != 4:
        shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(f"expected a [B,C,H,W] tensor batch, got {shape}")


def _check_fits(transform: nn.Module, h: int, w: int, height: int, width: int) -> None:
    if h > height or w > width:
        raise ValueError(f"{type(transform).__name__} of {h}x{w} does not fit images of {height}x{width}")


class BatchTransform(nn.Module):
    """Base class: ``forward(batch, generator=None, allocate=None)`` on a ``[B,C,H,W]`` batch.

    Args:
        generator: CPU ``torch.Generator`` used when ``forward`` gets none.
    """

    def __init__(self, generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        self.generator = generator

    def _rng(self, generator: Optional[torch.Generator]) -> Optional[torch.Generator]:
        return generator if generator is not None else self.generator

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        """``Name(argument=value, ...)`` as torchvision prints its transforms (``extra_repr`` gives the arguments)."""
        return f"{type(self).__name__}({self.extra_repr()})"


def _arguments(*required: str, **optional: object) -> str:
    """``extra_repr``'s text: the ``required`` ``name=value`` parts, then those of ``optional`` set (not None)."""
    return ", ".join(list(required) + [f"{name}={value}" for name, value in optional.items() if value is not None])


def _indented(transform: object) -> str:
    """``repr(transform)`` as a line of a container's listing: indented by four spaces, its own lines too."""
    return "    " + repr(transform).replace("\n", "\n    ")


class Batched:
    """Marks a callable as taking whole ``[B,C,H,W]`` batches: ``make_loader(transform=Batched(fn))``.

    Without it, a callable that is not a ``BatchTransform`` (a torchvision
    pipeline, say) is applied to each image of the batch on its own, so that
    its random crop or flip is drawn per image, never once for a whole batch.

    Args:
        function: the callable, ``function(batch) -> batch`` on ``[B,C,H,W]`` tensors.
    """

    is_batch_transform = True

    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.function = function

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return self.function(batch)

    def __repr__(self) -> str:
        return f"Batched({self.function!r})"


def is_batch_transform(transform: Callable) -> bool:
    """Whether ``transform`` takes whole batches: one of ours, or marked ``is_batch_transform = True`` (``Batched``)."""
    return isinstance(transform, BatchTransform) or getattr(transform, "is_batch_transform", False) is True


def apply_transform(
    transform: Callable, batch: torch.Tensor, generator: Optional[torch.Generator] = None,
    allocate: Optional[Allocate] = None,
) -> torch.Tensor:
    """``transform`` on a batch: a batch transform gets the whole batch (and ``generator`` and
    ``allocate`` where its ``forward`` takes them); any other callable gets one image at a time
    (its randomness then per image, at the cost of a Python call per image).

    Raises TypeError for a transform that takes labels too (MixUp, CutMix): see ``apply_with_labels``."""
    check_images_only(transform)
    if not isinstance(transform, BatchTransform):
        if getattr(transform, "is_batch_transform", False) is True:
            return transform(batch)
        return per_sample(transform, batch)
    if allocate is None or not _takes_allocate(transform):
        return transform(batch, generator=generator)
    return transform(batch, generator=generator, allocate=allocate)


def apply_with_labels(
    transform: Callable, images: torch.Tensor, labels: torch.Tensor, generator: Optional[torch.Generator] = None,
    allocate: Optional[Allocate] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``transform`` on a batch and its labels: ``(images, labels)`` after it.

    A transform that takes labels (``labels.takes_labels``: MixUp, CutMix,
    ``WithLabels``) gets both; a ``Compose`` holding one passes both along its
    steps; any other transform gets the images as in ``apply_transform``, the
    labels staying as they are.  ``generator`` and ``allocate`` are passed on as
    ``apply_transform`` does.
    """
    if isinstance(transform, Compose) and transform.takes_labels:
        return transform.with_labels(images, labels, generator, allocate)
    if takes_labels(transform):
        return mix(transform, images, labels, generator)
    return apply_transform(transform, images, generator, allocate), labels


def each_image(transform: Callable, images: Iterable[torch.Tensor], then: str) -> List[torch.Tensor]:
    """``transform`` applied to each [C,H,W] image of ``images`` on its own: what it gave for each.  TypeError
    saying why for a transform that fails on an image or gives no tensor (``then``: what is done with them)."""
    check_images_only(transform)
    outputs = []
    for image in images:
        try:
            output = transform(image)
        except TypeError as exc:
            raise TypeError(_per_image_failure(transform, image, exc)) from exc
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"the transform {transform!r} returned {type(output).__name__}, not a tensor: {then}")
        outputs.append(output)
    return outputs


def per_sample(transform: Callable, batch: torch.Tensor) -> torch.Tensor:
    """``transform`` applied to each [C,H,W] image of ``batch``, the results stacked into a batch."""
    outputs = each_image(transform, batch, "make_loader stacks each image's result into a batch")
    if not outputs:
        return batch
    shapes = {tuple(o.shape) for o in outputs}
    if len(shapes) > 1:
        raise ValueError(
            f"the transform {transform!r} gave images of different shapes {sorted(shapes)}: end it with a crop or "
            "resize to one size so that they stack into a batch"
        )
    return torch.stack(outputs)


def _per_image_failure(transform: Callable, image: torch.Tensor, error: TypeError) -> str:
    """Why ``transform`` failed on one image of a batch (a TypeError it raised), and what to give instead."""
    got = f"one {str(image.dtype).replace('torch.', '')} [C,H,W] image of shape {tuple(image.shape)}"
    if _needs_two_arguments(transform):
        return (
            f"the transform {transform!r} failed on {got} ({error}); it seems to take (images, labels), as "
            "MixUp or CutMix do, but was given images only, one at a time: wrap it as "
            "pf.transforms.WithLabels(fn), so that it gets each whole batch and its labels, and returns both "
            "(make_loader and pf.transforms.apply_with_labels pass the labels along)"
        )
    return (
        f"the transform {transform!r} failed on {got} ({error}); make_loader gives each image as a tensor, "
        "so use tensor transforms (pf.transforms, or torchvision.transforms.v2 with ToDtype instead of ToTensor), "
        "wrap a callable that takes whole batches in pf.transforms.Batched, or one that takes (images, labels) "
        "in pf.transforms.WithLabels"
    )


def _needs_two_arguments(transform: Callable) -> bool:
    """Whether calling ``transform`` needs at least two positional arguments (as ``fn(images, labels)``)."""
    try:
        parameters = inspect.signature(transform.forward if isinstance(transform, nn.Module) else transform
                                       ).parameters.values()
    except (TypeError, ValueError):  # a builtin or extension without a signature
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is inspect.Parameter.empty for p in parameters) >= 2


def _takes_allocate(transform: BatchTransform) -> bool:
    """Whether ``transform.forward`` accepts ``allocate`` (a subclass may define only ``batch, generator``)."""
    parameters = inspect.signature(transform.forward).parameters.values()
    return any(p.name == "allocate" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class Compose(BatchTransform):
    """Apply transforms in order; batch transforms share one generator.

    ``allocate`` goes to the last transform, the one that makes the result.
    Transforms that take labels too (MixUp, CutMix: ``labels.takes_labels``)
    may be among them, after the ones that make float images; the Compose then
    takes labels itself, and runs through ``with_labels`` (``apply_with_labels``).
    """

    def __init__(self, transforms: Sequence[Callable], generator: Optional[torch.Generator] = None) -> None:
        super().__init__(generator)
        self.transforms: List[Callable] = list(transforms)
        for i, t in enumerate(self.transforms):
            if isinstance(t, nn.Module):
                self.add_module(str(i), t)

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        generator = self._rng(generator)
        last = len(self.transforms) - 1
        for i, t in enumerate(self.transforms):
            batch = apply_transform(t, batch, generator, allocate if i == last else None)
        return batch

    @property
    def takes_labels(self) -> bool:
        """Whether one of the transforms takes ``(images, labels)``."""
        return any(takes_labels(t) for t in self.transforms)

    def with_labels(
        self, images: torch.Tensor, labels: torch.Tensor, generator: Optional[torch.Generator] = None,
        allocate: Optional[Allocate] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The transforms in order on ``images`` and ``labels``; those that take no labels get the images."""
        generator = self._rng(generator)
        last = len(self.transforms) - 1
        for i, t in enumerate(self.transforms):
            images, labels = apply_with_labels(t, images, labels, generator, allocate if i == last else None)
        return images, labels

    def __repr__(self) -> str:
        """torchvision's listing: the name, then one transform a line, indented (a nested one's lines too)."""
        settings = self.extra_repr()
        lines = ([f"    {settings}"] if settings else []) + [_indented(t) for t in self.transforms]
        if not lines:
            return f"{type(self).__name__}()"
        return "\n".join([f"{type(self).__name__}("] + lines + [")"])


class CenterCrop(BatchTransform):
    """The central ``size`` window of every image (a view, no copy), placed as torchvision's
    ``CenterCrop`` places it (``functional.center_offsets``: an odd margin rounded half to even)."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.size = _pair(size)

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        _check_batch(batch)
        (h, w), (height, width) = self.size, batch.shape[-2:]
        _check_fits(self, h, w, height, width)
        top, left = int(F.center_offsets(height, h)), int(F.center_offsets(width, w))  # torchvision's rounding
        return batch[:, :, top : top + h, left : left + w]

    def extra_repr(self) -> str:
        return f"size={self.size}"


class RandomCrop(BatchTransform):
    """A ``size`` window at a random position, drawn independently per sample (``generator``:
    the CPU generator used when ``forward`` gets none)."""

    def __init__(self, size: Size, generator: Optional[torch.Generator] = None) -> None:
        super().__init__(generator)
        self.size = _pair(size)

    def get_params(
        self, batch_size: int, height: int, width: int, generator: Optional[torch.Generator] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(tops, lefts): int64 [B] crop offsets, as forward would draw them."""
        h, w = self.size
        _check_fits(self, h, w, height, width)
        tops = torch.randint(0, height - h + 1, (batch_size,), generator=generator)
        lefts = torch.randint(0, width - w + 1, (batch_size,), generator=generator)
        return tops, lefts

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        _check_batch(batch)
        b, _, height, width = batch.shape
        tops, lefts = self.get_params(b, height, width, generator=self._rng(generator))
        return F.crops(batch, tops, lefts, self.size, allocate)

    def extra_repr(self) -> str:
        return f"size={self.size}"


class RandomResizedCrop(BatchTransform):
    """A random area/aspect crop per sample, resized (bilinear) to one ``size``.

    Parameters follow torchvision: ``scale`` is the crop's share of the image
    area, ``ratio`` its width/height range; after 10 failed draws a sample gets
    the central crop of clamped aspect.  uint8 batches stay uint8.  ``antialias``
    filters when shrinking (as torchvision's ``antialias=True``, and as crops made while
    decoding always do); ``generator`` is the CPU generator used when ``forward`` gets none.
    """

    def __init__(
        self,
        size: Size,
        scale: Tuple[float, float] = (0.08, 1.0),
        ratio: Tuple[float, float] = (3 / 4, 4 / 3),
        antialias: bool = True,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        super().__init__(generator)
        self.size = _pair(size)
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        if not (0 < self.scale[0] <= self.scale[1] and 0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"need 0 < scale[0] <= scale[1] and 0 < ratio[0] <= ratio[1], got {scale}, {ratio}")
        self.antialias = antialias

    def get_params(
        self, batch_size: int, height: Union[int, torch.Tensor], width: Union[int, torch.Tensor],
        generator: Optional[torch.Generator] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tops, lefts, heights, widths): int64 [B] crop boxes, as forward would draw them.

        ``height`` and ``width`` are the images' size: one for the batch, or int64 [B] tensors,
        one per image (crops drawn in each source image before it is decoded); the draws from
        ``generator`` are the same either way."""
        tries = 10
        sizes = [torch.as_tensor(side, dtype=torch.int64).reshape(-1, 1) for side in (height, width)]
        height_, width_ = sizes  # [1,1] or [B,1]
        area = (height_ * width_) * torch.empty(batch_size, tries).uniform_(*self.scale, generator=generator)
        log_ratio = torch.empty(batch_size, tries).uniform_(
            math.log(self.ratio[0]), math.log(self.ratio[1]), generator=generator
        )
        # the arithmetic in numpy: on tensors this small, torch's per-op overhead dominates
        areas, aspects = area.numpy(), np.exp(log_ratio.numpy())
        w = torch.from_numpy(np.sqrt(areas * aspects).round().astype(np.int64))
        h = torch.from_numpy(np.sqrt(areas / aspects).round().astype(np.int64))
        ok = (w > 0) & (w <= width_) & (h > 0) & (h <= height_)
        first = ok.int().argmax(dim=1, keepdim=True)
        h, w = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)
        fallback_h, fallback_w = self._fallback(height_.squeeze(1), width_.squeeze(1))
        found = ok.any(dim=1)
        h = torch.where(found, h, fallback_h.expand(batch_size))
        w = torch.where(found, w, fallback_w.expand(batch_size))
        u = torch.rand(2, batch_size, generator=generator)
        height_, width_ = height_.squeeze(1), width_.squeeze(1)
        tops = torch.where(found, torch.minimum((u[0] * (height_ - h + 1)).long(), height_ - h), (height_ - h) // 2)
        lefts = torch.where(found, torch.minimum((u[1] * (width_ - w + 1)).long(), width_ - w), (width_ - w) // 2)
        return tops, lefts, h, w

    def _fallback(self, height: torch.Tensor, width: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The central crop of clamped aspect, per image (torchvision's after 10 failed draws)."""
        heights, widths = height.numpy().astype(np.float64), width.numpy().astype(np.float64)
        in_ratio = widths / heights
        low, high = in_ratio < self.ratio[0], in_ratio > self.ratio[1]  # np.rint rounds halves as round() does
        h = np.where(low, np.minimum(heights, np.rint(widths / self.ratio[0])), heights)
        w = np.where(high, np.minimum(widths, np.rint(heights * self.ratio[1])), widths)
        return torch.from_numpy(h.astype(np.int64)), torch.from_numpy(w.astype(np.int64))

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        _check_batch(batch)
        b, _, height, width = batch.shape
        boxes = self.get_params(b, height, width, generator=self._rng(generator))
        if batch.device.type != "cpu":
            return F.resized_crops(batch, boxes, self.size, self.antialias)
        return F.crop_and_resize(batch, boxes, self.size, self.antialias, allocate)

    def extra_repr(self) -> str:
        ratio = tuple(round(r, 4) for r in self.ratio)  # (0.75, 1.3333), as torchvision prints it
        return (f"size={self.size}, scale={self.scale}, ratio={ratio}, interpolation=bilinear, "
                f"antialias={self.antialias}")


class RandomHorizontalFlip(BatchTransform):
    """Mirror each image left-right with probability ``p``, independently per sample (``generator``:
    the CPU generator used when ``forward`` gets none)."""

    def __init__(self, p: float = 0.5, generator: Optional[torch.Generator] = None) -> None:
        super().__init__(generator)
        self.p = float(p)

    def get_params(self, batch_size: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """bool [B]: which samples forward would flip."""
        return torch.rand(batch_size, generator=generator) < self.p

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        _check_batch(batch)
        return F.flip_samples(batch, self.get_params(batch.shape[0], self._rng(generator)), allocate)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Resize(BatchTransform):
    """Bilinear resize of the whole batch: shorter side to ``size`` (int; the longer one to
    torchvision's ``int(size * long / short)``, ``functional.shorter_side_sizes``) or exactly
    (h, w), filtered when shrinking unless ``antialias`` is False."""

    def __init__(self, size: Size, antialias: bool = True) -> None:
        super().__init__()
        self.size = size if isinstance(size, int) else _pair(size)
        self.antialias = antialias

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        _check_batch(batch)
        height, width = batch.shape[-2:]
        if isinstance(self.size, int):
            heights, widths = F.shorter_side_sizes(height, width, self.size)  # torchvision's rounding
            h, w = int(heights), int(widths)
        else:
            h, w = self.size
        return F.resize(batch, h, w, self.antialias)

    def extra_repr(self) -> str:
        return f"size={self.size}, interpolation=bilinear, antialias={self.antialias}"


class ToFloat(BatchTransform):
    """uint8 [0, 255] -> float [0, 1]; a float batch is only cast to ``dtype``.

    Args:
        dtype: the floating point type of the result.
        memory_format: the result's layout (``torch.channels_last`` or ``torch.contiguous_format``);
            None: the batch's own (see ``with_memory_format``).
    """

    def __init__(self, dtype: torch.dtype = torch.float32, memory_format: Optional[torch.memory_format] = None) -> None:
        super().__init__()
        self.dtype, self.memory_format = dtype, memory_format

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        _check_batch(batch)
        return F.to_float(batch, self.dtype, allocate, self.memory_format)

    def extra_repr(self) -> str:
        return _arguments(f"dtype={self.dtype}", memory_format=self.memory_format)


class Normalize(BatchTransform):
    """``(x - mean) / std`` per channel, with mean/std in [0, 1] units (torchvision's).

    A uint8 batch is first scaled to [0, 1]; both steps happen in one pass.

    Args:
        mean, std: one value per channel, in [0, 1] units (std > 0).
        dtype: the floating point type of the result.
        memory_format: the result's layout (``torch.channels_last`` or ``torch.contiguous_format``),
            written as it is made; None: the batch's own (see ``with_memory_format``).
    """

    def __init__(
        self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
        dtype: torch.dtype = torch.float32, memory_format: Optional[torch.memory_format] = None,
    ) -> None:
        super().__init__()
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        if len(self.mean) != len(self.std) or min(self.std) <= 0:
            raise ValueError(f"mean and std need one value per channel and std > 0, got {mean}, {std}")
        self.dtype, self.memory_format = dtype, memory_format

    def check_channels(self, batch: torch.Tensor) -> None:
        """ValueError unless ``batch`` has one channel per mean."""
        if batch.shape[1] != len(self.mean):
            raise ValueError(f"batch has {batch.shape[1]} channels, Normalize has {len(self.mean)}")

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        _check_batch(batch)
        self.check_channels(batch)
        return F.normalize(batch, self.mean, self.std, self.dtype, allocate, self.memory_format)

    def extra_repr(self) -> str:
        dtype = None if self.dtype == torch.float32 else self.dtype
        return _arguments(f"mean={self.mean}", f"std={self.std}", dtype=dtype, memory_format=self.memory_format)


class CropFlipNormalize(Compose):
    """``RandomResizedCrop``, optionally ``RandomHorizontalFlip``, then ``Normalize`` or ``ToFloat``,
    in one pass per sample on CPU uint8 batches.

    Bit-identical to the three ops one after the other, which is what it runs
    on other batches (float, GPU): it draws their parameters from their
    generators in the same order and does their arithmetic, but resizes,
    flips, casts and normalises each sample while it is in cache, with no
    intermediate batches (see ``functional.crop_flip_to_float``).  Its result
    is contiguous NCHW, whatever the input's layout, or in the normalisation's
    ``memory_format`` when it has one (channels-last written directly, no copy after).

    Args:
        crop: the crop (its size, scale, ratio, antialias and generator are used).
        flip: the flip, or None for none.
        normalize: a ``Normalize`` or ``ToFloat`` (its dtype, mean, std and memory_format are used).
        generator: CPU generator used when ``forward`` gets none.
        batchwise: run each step in one vectorised pass over the batch on the CPU too, as on
            other devices (a few operator calls per batch), instead of one sample at a time.
    """

    def __init__(
        self,
        crop: RandomResizedCrop,
        flip: Optional[RandomHorizontalFlip],
        normalize: Union[Normalize, ToFloat],
        generator: Optional[torch.Generator] = None,
        batchwise: bool = False,
    ) -> None:
        if not isinstance(crop, RandomResizedCrop):
            raise TypeError(f"crop must be a RandomResizedCrop, got {type(crop).__name__}")
        _check_flip_and_normalize(flip, normalize)
        super().__init__([crop] + ([flip] if flip is not None else []) + [normalize], generator)
        self._parts = (crop, flip, normalize)  # a tuple: registered once, as the items of Compose
        self.batchwise = batchwise

    def extra_repr(self) -> str:
        return "batchwise=True" if self.batchwise else ""

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        crop, flip, normalize = self._parts
        if self.batchwise:
            _check_batch(batch)
            generator = self._rng(generator)
            b, _, height, width = batch.shape
            boxes = crop.get_params(b, height, width, generator=crop._rng(generator))
            return _flip_normalize(F.resized_crops(batch, boxes, crop.size, crop.antialias), flip, normalize,
                                   generator, allocate)
        if not _fuses(batch, normalize):
            return super().forward(batch, generator, allocate)
        generator = self._rng(generator)
        b, _, height, width = batch.shape
        boxes = crop.get_params(b, height, width, generator=crop._rng(generator))
        flips = flip.get_params(b, flip._rng(generator)) if flip is not None else None
        channels_last = normalize.memory_format == torch.channels_last
        scale, shift = _scale_shift(normalize, batch, crop.size[1], channels_last)
        return F.crop_flip_to_float(
            batch, boxes, flips, crop.size, crop.antialias, normalize.dtype, scale, shift, allocate, channels_last
        )


class FlipNormalize(Compose):
    """Optionally ``RandomHorizontalFlip``, then ``Normalize`` or ``ToFloat``, in one pass per sample
    on CPU uint8 batches: what is left of ``CropFlipNormalize`` once an encoded archive has made
    the crop while decoding.

    Bit-identical to the ops one after the other (which it runs on other batches), and its result
    is contiguous NCHW (or in the normalisation's ``memory_format`` when it has one): the flip, the
    cast and the turn from the batch's channels-last layout happen while each sample is in cache,
    instead of in three passes over the batch.

    Args:
        flip: the flip, or None for none.
        normalize: a ``Normalize`` or ``ToFloat`` (its dtype, mean, std and memory_format are used).
        generator: CPU generator used when ``forward`` gets none.
        batchwise: flip and normalise in one vectorised pass each on the CPU too, as on other
            devices (what follows a decode on the device: a few operator calls per batch).
    """

    def __init__(
        self, flip: Optional[RandomHorizontalFlip], normalize: Union[Normalize, ToFloat],
        generator: Optional[torch.Generator] = None, batchwise: bool = False,
    ) -> None:
        _check_flip_and_normalize(flip, normalize)
        super().__init__(([flip] if flip is not None else []) + [normalize], generator)
        self._parts = (flip, normalize)
        self.batchwise = batchwise

    def extra_repr(self) -> str:
        return "batchwise=True" if self.batchwise else ""

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        flip, normalize = self._parts
        if self.batchwise:
            _check_batch(batch)
            return _flip_normalize(batch, flip, normalize, self._rng(generator), allocate)
        if not _fuses(batch, normalize):
            return super().forward(batch, generator, allocate)
        generator = self._rng(generator)
        b, _, height, width = batch.shape
        flips = flip.get_params(b, flip._rng(generator)) if flip is not None else None
        channels_last = normalize.memory_format == torch.channels_last
        scale, shift = _scale_shift(normalize, batch, width, channels_last)
        return F.crop_flip_to_float(batch, None, flips, (height, width), True, normalize.dtype, scale, shift, allocate,
                                    channels_last)


def _flip_normalize(batch: torch.Tensor, flip: Optional[RandomHorizontalFlip], normalize: "Normalize | ToFloat",
                    generator: Optional[torch.Generator], allocate: Optional[Allocate]) -> torch.Tensor:
    """The flip (drawn from ``generator`` as ``RandomHorizontalFlip`` draws it) and the normalisation,
    each in one vectorised pass over the batch, whatever its device."""
    if flip is not None:
        batch = F.flip_samples(batch, flip.get_params(batch.shape[0], flip._rng(generator)), batchwise=True)
    if isinstance(normalize, Normalize):
        normalize.check_channels(batch)
        return F.normalize(batch, normalize.mean, normalize.std, normalize.dtype, allocate, normalize.memory_format,
                           batchwise=True)
    return F.to_float(batch, normalize.dtype, allocate, normalize.memory_format)


def _check_flip_and_normalize(flip: object, normalize: object) -> None:
    """TypeError unless ``flip`` is a RandomHorizontalFlip or None and ``normalize`` a Normalize or ToFloat."""
    if flip is not None and not isinstance(flip, RandomHorizontalFlip):
        raise TypeError(f"flip must be a RandomHorizontalFlip or None, got {type(flip).__name__}")
    if not isinstance(normalize, (Normalize, ToFloat)):
        raise TypeError(f"normalize must be a Normalize or ToFloat, got {type(normalize).__name__}")


def _fuses(batch: torch.Tensor, normalize: "Normalize | ToFloat") -> bool:
    """Whether ``batch`` takes a fused pass: a CPU uint8 [B,C,H,W] batch (with as many
    channels as Normalize has means; otherwise the ops one by one say what is wrong)."""
    if not (isinstance(batch, torch.Tensor) and batch.dim() == 4):
        return False
    if batch.dtype != torch.uint8 or batch.device.type != "cpu":
        return False
    return not isinstance(normalize, Normalize) or batch.shape[1] == len(normalize.mean)


def _scale_shift(normalize: "Normalize | ToFloat", batch: torch.Tensor, width: int, channels_last: bool
                 ) -> Tuple[F.Scale, Optional[torch.Tensor]]:
    """The fused passes' scale and shift, shaped for the result's rows of ``width`` (NHWC rows when
    ``channels_last``, else contiguous NCHW ones)."""
    if isinstance(normalize, Normalize):
        return F.normalize_scale_shift(
            normalize.mean, normalize.std, normalize.dtype, batch.dtype, width, channels_last, batch.device
        )
    return F.UINT8_TO_UNIT, None


# ---- a transform prepared for where it runs ---------------------------------------------------------
def with_memory_format(transform: Optional[Callable], memory_format: Optional[torch.memory_format]
                       ) -> Optional[Callable]:
    """``transform`` with its final normalisation (``Normalize`` or ``ToFloat``, alone, last in a
    ``Compose`` of ours, or in ``train``'s fused passes) writing ``memory_format`` directly: a
    channels-last batch needs no copy after it.  A copy where something changes, the transform
    itself otherwise (one that ends otherwise is returned as it is)."""
    if memory_format is None:
        return transform

    def laid_out(step: Callable) -> Optional[Callable]:
        if isinstance(step, (Normalize, ToFloat)):
            if step.memory_format == memory_format:
                return step
            changed = copy.copy(step)
            changed.memory_format = memory_format
            return changed
        return None

    return _rebuilt(transform, laid_out, last_only=True)


def batchwise(transform: Optional[Callable]) -> Optional[Callable]:
    """``transform`` with ``train``'s fused passes (``CropFlipNormalize``, ``FlipNormalize``, alone or in
    a ``Compose`` of ours) made ``batchwise``: one vectorised pass per step on the CPU too, as on a
    GPU.  What runs after a decode on the device, whatever the device: a few operator calls per
    batch.  A copy where something changes, the transform itself otherwise."""
    return _rebuilt(transform, lambda step: None, last_only=False, batchwise_=True)


def _rebuilt(transform: Optional[Callable], change: Callable[[Callable], Optional[Callable]], last_only: bool,
             batchwise_: bool = False) -> Optional[Callable]:
    """``transform`` rebuilt with ``change(step)`` (None: unchanged) applied to its normalisation
    steps (the last one only where ``last_only``) and fused passes made batchwise if ``batchwise_``."""
    if transform is None:
        return None
    changed = change(transform)
    if changed is not None:
        return changed
    if isinstance(transform, (CropFlipNormalize, FlipNormalize)):
        normalize = transform._parts[-1]
        new_normalize = cast(Union[Normalize, ToFloat], change(normalize) or normalize)
        batched = transform.batchwise or batchwise_
        if new_normalize is normalize and batched == transform.batchwise:
            return transform
        if isinstance(transform, CropFlipNormalize):
            crop, flip, _ = transform._parts
            return CropFlipNormalize(crop, flip, new_normalize, transform.generator, batched)
        return FlipNormalize(transform._parts[0], new_normalize, transform.generator, batched)
    if type(transform) is Compose:
        steps = list(transform.transforms)
        chosen = [len(steps) - 1] if last_only and steps else range(len(steps))
        new_steps = list(steps)
        for k in chosen:
            new_steps[k] = cast(Callable, _rebuilt(steps[k], change, last_only, batchwise_))
        if all(a is b for a, b in zip(new_steps, steps)):
            return transform
        return Compose(new_steps, transform.generator)
    return transform

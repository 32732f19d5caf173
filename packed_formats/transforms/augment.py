"""Per-sample random augmentations over whole batches: RandomErasing, TrivialAugmentWide, RandAugment.

Each draws its random parameters for every sample on its own (never one draw
for the batch), from the CPU generator passed to ``forward`` like the other
ops, with the distributions of torchvision's per-image transforms of the same
names.  The pixel work is batched: the erased boxes in one pass (one copy on
the CPU), and the auto-augment ops once per op for the samples that drew it
(``adjust``), each with its own magnitude.  They take uint8 batches in
[0, 255] or float batches in [0, 1] (put them before ``Normalize``), like
torchvision's.  ``get_params`` gives the draws, ``apply_ops`` applies chosen
ops and magnitudes.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..memory import Allocate, memory_format_of
from . import adjust
from . import functional as F
from .functional import to_device
from .ops import BatchTransform, _check_batch

Magnitudes = Callable[[int, int, int], torch.Tensor]  # (bins, height, width) -> magnitude of each bin
Space = Dict[str, Tuple[Optional[Magnitudes], bool]]  # op name -> (its magnitudes or None, whether signed)


def _up_to(top: float) -> Magnitudes:
    return lambda bins, height, width: torch.linspace(0.0, top, bins)


def _bits_down_to(fewest: int) -> Magnitudes:
    """Posterize: 8 bits kept at bin 0, down to ``fewest`` at the last bin."""
    return lambda bins, height, width: (8 - torch.arange(bins) / ((bins - 1) / (8 - fewest))).round().int()


def _threshold(bins: int, height: int, width: int) -> torch.Tensor:
    """Solarize: the share of white from which values are inverted, 1 (nothing) down to 0 (everything)."""
    return torch.linspace(1.0, 0.0, bins)


def _share_of(side: int) -> Magnitudes:
    """Translate by up to 150/331 of the image's width (side 1) or height (side 0)."""
    return lambda bins, height, width: torch.linspace(0.0, 150.0 / 331.0 * (height, width)[side], bins)


def _space(shear: float, translate: Tuple[Magnitudes, Magnitudes], rotate: float, colour: float,
           fewest_bits: int) -> Space:
    return {
        "Identity": (None, False),
        "ShearX": (_up_to(shear), True),
        "ShearY": (_up_to(shear), True),
        "TranslateX": (translate[0], True),
        "TranslateY": (translate[1], True),
        "Rotate": (_up_to(rotate), True),
        "Brightness": (_up_to(colour), True),
        "Color": (_up_to(colour), True),
        "Contrast": (_up_to(colour), True),
        "Sharpness": (_up_to(colour), True),
        "Posterize": (_bits_down_to(fewest_bits), False),
        "Solarize": (_threshold, False),
        "AutoContrast": (None, False),
        "Equalize": (None, False),
    }


WIDE_SPACE = _space(0.99, (_up_to(32.0), _up_to(32.0)), 135.0, 0.99, 2)  # TrivialAugment's "wide" ranges
RAND_SPACE = _space(0.3, (_share_of(1), _share_of(0)), 30.0, 0.9, 4)  # RandAugment's (AutoAugment's) ranges


def _interpolation_name(interpolation: object) -> str:
    """"nearest" or "bilinear", from a string or torchvision's InterpolationMode."""
    name = str(getattr(interpolation, "value", interpolation)).lower()
    if name not in ("nearest", "bilinear"):
        raise ValueError(f"interpolation must be 'nearest' or 'bilinear', got {interpolation!r}")
    return name


class _AutoAugment(BatchTransform):
    """Ops of a ``Space`` applied per sample, each sample with its own op and magnitude."""

    def __init__(self, space: Space, num_magnitude_bins: int, interpolation: object = "nearest",
                 fill: adjust.Fill = None, generator: Optional[torch.Generator] = None) -> None:
        super().__init__(generator)
        if num_magnitude_bins < 2:
            raise ValueError(f"num_magnitude_bins must be at least 2, got {num_magnitude_bins}")
        self.space = space
        self.op_names: Tuple[str, ...] = tuple(space)
        self.num_magnitude_bins = int(num_magnitude_bins)
        self.interpolation = _interpolation_name(interpolation)
        self.fill = fill

    def magnitude_table(self, height: int, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(table, signed): float64 [ops, bins] magnitudes (0 for ops without one) and
        bool [ops], whether each op's magnitude may be negated."""
        table = torch.zeros(len(self.op_names), self.num_magnitude_bins, dtype=torch.float64)
        signed = torch.zeros(len(self.op_names), dtype=torch.bool)
        for i, (magnitudes, sign) in enumerate(self.space.values()):
            if magnitudes is not None:
                table[i] = magnitudes(self.num_magnitude_bins, height, width).double()
            signed[i] = sign
        return table, signed

    def _signed(self, magnitudes: torch.Tensor, ops: torch.Tensor, signed: torch.Tensor,
                generator: Optional[torch.Generator]) -> torch.Tensor:
        """``magnitudes`` negated with probability 1/2 per sample where the op is signed."""
        negate = (torch.rand(ops.shape, generator=generator) <= 0.5) & signed[ops]
        return torch.where(negate, -magnitudes, magnitudes)

    def get_params(self, batch_size: int, height: int, width: int,
                   generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(ops, magnitudes) for a batch: each subclass draws its own way."""
        raise NotImplementedError

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        _check_images(batch)
        b, _, height, width = batch.shape
        ops, magnitudes = self.get_params(b, height, width, self._rng(generator))
        return self.apply_ops(batch, ops, magnitudes, allocate)

    def apply_ops(self, batch: torch.Tensor, ops: torch.Tensor, magnitudes: torch.Tensor,
                  allocate: Optional[Allocate] = None) -> torch.Tensor:
        """``batch`` with op ``ops[r, b]`` (an index into ``op_names``) of magnitude ``magnitudes[r, b]``
        applied to sample b, for round r = 0, 1, ... in turn ([B] tensors: one round).

        Each op runs once per round, on the samples that drew it, and each
        sample's result is written once per round.
        """
        _check_images(batch)
        height, width = batch.shape[-2:]
        out = F.output_like(batch, height, width, allocate=allocate)
        ops, magnitudes = ops.view(-1, batch.shape[0]), magnitudes.view(-1, batch.shape[0]).double()
        source = batch  # the first round reads the input, later ones the result so far
        for round_ops, round_magnitudes in zip(ops, magnitudes):
            for op in torch.unique(round_ops).tolist():
                chosen = (round_ops == op).nonzero().flatten()
                name = self.op_names[op]
                if name == "Identity":
                    if source is not out:
                        _place(out, chosen, _pick(source, chosen))
                    continue
                kernel = adjust.KERNELS[name]
                _place(out, chosen, kernel(_pick(source, chosen), round_magnitudes[chosen], self.interpolation,
                                           self.fill))
            source = out
        return out if len(ops) else out.copy_(batch)

    def extra_repr(self) -> str:
        return f"num_magnitude_bins={self.num_magnitude_bins}, interpolation={self.interpolation}, fill={self.fill!r}"


def _pick(batch: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The samples ``chosen`` (int64 CPU indices) of ``batch``, copied into a batch of their own.

    On the CPU one sample at a time, in the batch's layout: a channels-last
    ``index_select`` there strides through memory and is several times slower.
    """
    if batch.device.type != "cpu":
        return batch.index_select(0, to_device(chosen, batch.device))
    picked = torch.empty((len(chosen),) + tuple(batch.shape[1:]), dtype=batch.dtype,
                         memory_format=memory_format_of(batch))
    for j, i in enumerate(chosen.tolist()):
        picked[j].copy_(batch[i])
    return picked


def _place(out: torch.Tensor, chosen: torch.Tensor, results: torch.Tensor) -> None:
    """``out[chosen] = results``: sample by sample on the CPU (as ``_pick``), in one pass elsewhere."""
    if out.device.type != "cpu":
        out.index_copy_(0, to_device(chosen, out.device), results)
        return
    for j, i in enumerate(chosen.tolist()):
        out[i].copy_(results[j])


def _check_images(batch: torch.Tensor) -> None:
    _check_batch(batch)
    if batch.dtype != torch.uint8 and not batch.is_floating_point():
        raise ValueError(f"expected uint8 images in [0, 255] or float images in [0, 1], got {batch.dtype}")
    if batch.shape[1] not in (1, 3):
        raise ValueError(f"auto-augment ops take images of 1 or 3 channels, got {batch.shape[1]}")


class TrivialAugmentWide(_AutoAugment):
    """TrivialAugment (wide ranges), per sample: one op drawn uniformly, at a magnitude bin drawn uniformly.

    As torchvision's ``TrivialAugmentWide``, each image of the batch with its
    own draw.  ``interpolation`` ("nearest" or "bilinear") and ``fill`` (None
    for black, a value, or one per channel) are for the geometric ops;
    ``num_magnitude_bins`` is the number of magnitude steps, ``generator`` the CPU
    generator used when ``forward`` gets none.
    """

    def __init__(self, num_magnitude_bins: int = 31, interpolation: object = "nearest", fill: adjust.Fill = None,
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__(WIDE_SPACE, num_magnitude_bins, interpolation, fill, generator)

    def get_params(self, batch_size: int, height: int, width: int,
                   generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(ops, magnitudes): int64 and float64 [B], as forward would draw them."""
        table, signed = self.magnitude_table(height, width)
        ops = torch.randint(len(self.op_names), (batch_size,), generator=generator)
        bins = torch.randint(self.num_magnitude_bins, (batch_size,), generator=generator)
        return ops, self._signed(table[ops, bins], ops, signed, generator)


class RandAugment(_AutoAugment):
    """RandAugment, per sample: ``num_ops`` ops in turn, each drawn uniformly, all of bin ``magnitude``.

    As torchvision's ``RandAugment``, each image of the batch with its own
    draws (ops and signs).  ``interpolation`` and ``fill`` as for ``TrivialAugmentWide``;
    ``num_magnitude_bins`` the number of magnitude steps, ``generator`` the CPU generator
    used when ``forward`` gets none.
    """

    def __init__(self, num_ops: int = 2, magnitude: int = 9, num_magnitude_bins: int = 31,
                 interpolation: object = "nearest", fill: adjust.Fill = None,
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__(RAND_SPACE, num_magnitude_bins, interpolation, fill, generator)
        if not isinstance(num_ops, int) or num_ops < 0:
            raise ValueError(f"num_ops must be a non-negative integer, got {num_ops}")
        if not 0 <= magnitude < num_magnitude_bins:
            raise ValueError(f"magnitude must be a bin in [0, {num_magnitude_bins}), got {magnitude}")
        self.num_ops, self.magnitude = num_ops, int(magnitude)

    def get_params(self, batch_size: int, height: int, width: int,
                   generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(ops, magnitudes): int64 and float64 [num_ops, B], as forward would draw them."""
        table, signed = self.magnitude_table(height, width)
        ops = torch.randint(len(self.op_names), (self.num_ops, batch_size), generator=generator)
        return ops, self._signed(table[ops, self.magnitude], ops, signed, generator)

    def extra_repr(self) -> str:
        return f"num_ops={self.num_ops}, magnitude={self.magnitude}, {super().extra_repr()}"


class RandomErasing(BatchTransform):
    """Erase a random box of each sample with probability ``p``, drawn independently per sample.

    Parameters follow torchvision's ``RandomErasing``: the box covers a share
    ``scale`` of the image area, with height/width in ``ratio`` (log-uniform);
    after 10 draws that do not fit, the sample is left as it is.  ``value`` is
    one value, one per channel (in the batch's units: 0..255 for uint8), or
    "random" for standard normal noise (float batches only: it is meant for
    normalised ones).  ``generator`` is the CPU generator used when ``forward`` gets none.
    """

    def __init__(
        self,
        p: float = 0.5,
        scale: Tuple[float, float] = (0.02, 0.33),
        ratio: Tuple[float, float] = (0.3, 3.3),
        value: Union[float, Sequence[float], str] = 0.0,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        super().__init__(generator)
        self.p = float(p)
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        if not (0.0 <= self.p <= 1.0):
            raise ValueError(f"p must be in [0, 1], got {p}")
        if not (0 <= self.scale[0] <= self.scale[1] <= 1 and 0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"need 0 <= scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1], got {scale}, {ratio}")
        if isinstance(value, str) and value != "random":
            raise ValueError(f"value must be a number, one number per channel, or 'random', got {value!r}")
        self.value: Union[List[float], str] = (
            value if isinstance(value, str) else [float(v) for v in (value if isinstance(value, Sequence) else [value])]
        )

    def get_params(
        self, batch_size: int, height: int, width: int, generator: Optional[torch.Generator] = None
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(erased, tops, lefts, heights, widths): bool and int64 [B] boxes, as forward would draw them."""
        applied = torch.rand(batch_size, generator=generator) < self.p
        tries = 10
        share = torch.empty(batch_size, tries).uniform_(*self.scale, generator=generator)
        log_ratio = torch.empty(batch_size, tries).uniform_(
            math.log(self.ratio[0]), math.log(self.ratio[1]), generator=generator
        )
        area, aspect = share.double() * (height * width), log_ratio.exp().double()
        h = (area * aspect).sqrt().round().long()
        w = (area / aspect).sqrt().round().long()
        fits = (h < height) & (w < width)
        first = fits.int().argmax(dim=1, keepdim=True)
        h, w = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)
        erased = applied & fits.any(dim=1)
        h, w = h.masked_fill(~erased, 0), w.masked_fill(~erased, 0)
        u = torch.rand(2, batch_size, generator=generator)
        tops = torch.minimum((u[0] * (height - h + 1)).long(), height - h)
        lefts = torch.minimum((u[1] * (width - w + 1)).long(), width - w)
        return erased, tops, lefts, h, w

    def forward(
        self, batch: torch.Tensor, generator: Optional[torch.Generator] = None, allocate: Optional[Allocate] = None
    ) -> torch.Tensor:
        _check_batch(batch)
        generator = self._rng(generator)
        b, channels, height, width = batch.shape
        erased, *boxes = self.get_params(b, height, width, generator)
        out = F.output_like(batch, height, width, allocate=allocate)
        if self.value == "random":
            return adjust.erase(batch, boxes, erased, None, self._noise(batch, generator), out)
        if len(self.value) not in (1, channels):
            raise ValueError(f"value needs 1 or {channels} numbers for this batch, got {len(self.value)}")
        value = torch.tensor(self.value, dtype=torch.float32).view(-1, 1, 1).to(batch.dtype)
        return adjust.erase(batch, boxes, erased, to_device(value, batch.device), None, out)

    def _noise(self, batch: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Generator:
        """The generator of the noise: ``generator`` on the CPU, one seeded from it on other devices."""
        if not batch.is_floating_point():
            raise ValueError(
                f"RandomErasing(value='random') draws standard normal noise, meant for normalised float batches, "
                f"got {batch.dtype}: put it after Normalize, or give uint8 batches a value"
            )
        if batch.device.type == "cpu":
            return generator if generator is not None else torch.default_generator
        seed = int(torch.randint(2**62, (), generator=generator))
        return torch.Generator(batch.device).manual_seed(seed)

    def extra_repr(self) -> str:
        return f"p={self.p}, scale={self.scale}, ratio={self.ratio}, value={self.value!r}"

"""Batch kernels behind ``pf.transforms``: crops, resampling, flips and the float conversion.

Functions of a ``[B,C,H,W]`` batch and parameters already drawn (crop boxes,
flip choices, scale and shift): no randomness and no modules.  They keep the
batch's memory format.  CPU kernels work sample by sample, while a sample is
in cache; other devices get one batched pass, since per-sample launches cost
more there than the arithmetic.  A kernel that allocates its result takes it
from ``allocate`` when one is given (see ``memory.output_buffer``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union, cast

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import ArrayLike

from .. import memory
from ..memory import Allocate, memory_format_of

UINT8_TO_UNIT = 1 / 255

Boxes = Sequence[torch.Tensor]  # (tops, lefts, heights, widths): int64 [B] each


def output_like(
    batch: torch.Tensor, h: int, w: int, dtype: Optional[torch.dtype] = None, allocate: Optional[Allocate] = None
) -> torch.Tensor:
    """A [B,C,h,w] result like ``batch`` (dtype, device, memory format); huge pages on the CPU."""
    b, c = batch.shape[:2]
    return memory.output_buffer((b, c, h, w), dtype or batch.dtype, batch.device, memory_format_of(batch), allocate)


def float_output(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, channels_last: bool,
    allocate: Optional[Allocate] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, rows): memory for a [B,C,H,W] float result, laid out as its samples lie in memory
    ([B,H,W,C] when ``channels_last``), and the same memory as rows along which the
    per-channel scale repeats: [B, H, W*C] (NHWC) or [B, C, H*W] (NCHW)."""
    b, c, h, w = shape
    if channels_last:
        out = memory.output_buffer((b, h, w, c), dtype, device, allocate=allocate)
        return out, out.view(b, h, w * c)
    out = memory.output_buffer((b, c, h, w), dtype, device, allocate=allocate)
    return out, out.view(b, c, h * w)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU parameter tensor on ``device``, copied to CUDA from pinned memory without stalling the host.

    A plain ``.to("cuda")`` from pageable memory waits for the GPU to finish
    the work queued before it, so the host could not run ahead of the GPU.
    """
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


# ---- sizes and windows ------------------------------------------------------------------------------
def shorter_side_sizes(heights: ArrayLike, widths: ArrayLike, size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(heights, widths), int64: the images' sizes once their shorter side is resized to ``size``.

    torchvision's arithmetic for ``Resize(size)``: the shorter side (the width
    when the sides are equal) becomes ``size``, the longer one ``int(size *
    long / short)``, truncated.  Elementwise over arrays of image sizes."""
    heights, widths = np.asarray(heights, dtype=np.int64), np.asarray(widths, dtype=np.int64)
    portrait = widths <= heights
    short, long = np.where(portrait, widths, heights), np.where(portrait, heights, widths)
    longer = (size * long / short).astype(np.int64)  # one float64 division, truncated as int() does
    sized = np.full_like(longer, size)
    return np.where(portrait, longer, sized), np.where(portrait, sized, longer)


def center_offsets(lengths: ArrayLike, crop: int) -> np.ndarray:
    """int64: where a central window of ``crop`` pixels starts along sides of ``lengths`` pixels.

    torchvision's ``CenterCrop`` arithmetic: ``int(round((length - crop) / 2.0))``, an odd
    margin rounded half to even (as Python's ``round`` and ``np.rint`` do)."""
    return np.rint((np.asarray(lengths, dtype=np.int64) - crop) / 2.0).astype(np.int64)


# ---- crops ------------------------------------------------------------------------------------------
def gathered_crops(batch: torch.Tensor, tops: torch.Tensor, lefts: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """The ``size`` window at (tops[b], lefts[b]) of every sample b of ``batch``, in one gather
    (channels-last result)."""
    h, w = size
    rows = to_device(tops.view(-1, 1) + torch.arange(h), batch.device)
    cols = to_device(lefts.view(-1, 1) + torch.arange(w), batch.device)
    samples = torch.arange(batch.shape[0], device=batch.device).view(-1, 1, 1)
    return batch.permute(0, 2, 3, 1)[samples, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


def crops(
    batch: torch.Tensor, tops: torch.Tensor, lefts: torch.Tensor, size: Tuple[int, int],
    allocate: Optional[Allocate] = None,
) -> torch.Tensor:
    """The ``size`` window at (tops[b], lefts[b]) of every sample b: copied sample by sample
    on the CPU, gathered in one pass elsewhere."""
    h, w = size
    out = output_like(batch, h, w, allocate=allocate)
    if batch.device.type != "cpu":
        return out.copy_(gathered_crops(batch, tops, lefts, size))
    for b, (top, left) in enumerate(zip(tops.tolist(), lefts.tolist())):
        out[b].copy_(batch[b, :, top : top + h, left : left + w])
    return out


# ---- resampling -------------------------------------------------------------------------------------
def resize(image: torch.Tensor, h: int, w: int, antialias: bool) -> torch.Tensor:
    """Bilinear resize of a [N,C,h,w] tensor, keeping uint8 as uint8.

    The CPU resizes uint8 directly (torch's fast path); other devices resize
    in float and round back.
    """
    if image.shape[-2:] == (h, w):
        return image
    if image.dtype == torch.uint8 and image.device.type != "cpu":
        out = F.interpolate(image.float(), size=(h, w), mode="bilinear", antialias=antialias, align_corners=False)
        return out.round_().clamp_(0, 255).to(torch.uint8)
    return F.interpolate(image, size=(h, w), mode="bilinear", antialias=antialias, align_corners=False)


def resize_weights(offsets: torch.Tensor, lengths: torch.Tensor, size: int, extent: int,
                   antialias: bool) -> torch.Tensor:
    """float [B, size, extent]: row i of sample b resamples source pixels offsets[b] + [0, lengths[b]) to output i.

    The weights of torch's bilinear ``interpolate`` (``align_corners=False``) on
    each sample's window alone: a triangle filter centred on each output pixel,
    widened by the downscale factor when ``antialias``, normalised to sum to 1.
    """
    device = offsets.device
    scale = lengths.double().div(size).view(-1, 1, 1)  # [B,1,1] source pixels per output pixel
    stretch = scale.clamp(min=1.0) if antialias else torch.ones_like(scale)
    centre = scale * (torch.arange(size, device=device, dtype=torch.float64).view(1, -1, 1) + 0.5)
    local = torch.arange(extent, device=device, dtype=torch.float64).view(1, 1, -1) - offsets.view(-1, 1, 1)
    weights = (1.0 - ((local + 0.5 - centre) / stretch).abs()).clamp_(min=0.0)
    weights *= (local >= 0) & (local < lengths.view(-1, 1, 1))
    return (weights / weights.sum(dim=2, keepdim=True)).float()


def resampling_lines(lengths: np.ndarray, size: int, antialias: bool) -> Tuple[np.ndarray, np.ndarray]:
    """(slopes [B], intercepts [B,size]), float64: the weight of source pixel k of window b for output
    pixel i is ``triangle(slopes[b] * k + intercepts[b, i])`` (see ``triangle_weights``).

    The weights of torch's bilinear ``interpolate`` (``align_corners=False``) of each window of
    ``lengths[b]`` pixels to ``size``: a triangle centred on each output pixel, widened by the
    downscale factor when ``antialias`` (torchvision's antialiased resize), normalised to sum to 1.
    Computed here, on the host, from a few numbers per window: a device then needs two small
    tensors and a handful of operator calls for the whole batch."""
    scale = np.asarray(lengths, dtype=np.float64) / size  # source pixels per output pixel
    stretch = np.maximum(scale, 1.0) if antialias else np.ones_like(scale)
    centres = scale[:, None] * (np.arange(size, dtype=np.float64) + 0.5)
    return 1.0 / stretch, (0.5 - centres) / stretch[:, None]


def triangle_weights(slopes: torch.Tensor, intercepts: torch.Tensor, lengths: torch.Tensor,
                     taps: torch.Tensor) -> torch.Tensor:
    """float [B, size, extent]: resampling weights of B windows in one pass (8 operator calls).

    ``slopes`` [B] and ``intercepts`` [B,size] as ``resampling_lines`` gives them, ``lengths`` [B]
    each window's length and ``taps`` [extent] the source offsets 0, 1, ... (float, on the device):
    taps at or past a window's length weigh nothing, whatever the pixels there."""
    distance = torch.addcmul(intercepts[:, :, None], slopes[:, None, None], taps)
    weights = (1.0 - distance.abs_()).clamp_(min=0.0)
    weights.mul_(taps < lengths[:, None, None])
    return weights.div_(weights.sum(dim=2, keepdim=True))


def resized_crops(batch: torch.Tensor, boxes: Boxes, size: Tuple[int, int], antialias: bool = True,
                  allocate: Optional[Allocate] = None) -> torch.Tensor:
    """Crop box b of every sample b and resize it to ``size``, for the whole batch at once.

    ``boxes`` is (tops, lefts, heights, widths), int64 [B] each.  Bilinear
    resizing is separable, so each sample's output is Wy[b] @ image[b] @ Wx[b]^T
    with the resampling weights as matrices: two batched matrix products, the
    same result as cropping and ``interpolate``-ing sample by sample (to within
    float rounding).  Made for GPUs, where per-sample launches cost more than
    the arithmetic; uint8 stays uint8 (rounded).  ``antialias`` filters when shrinking;
    ``allocate`` is asked for the result's memory first (it may answer None).
    """
    tops, lefts, heights, widths = (to_device(t, batch.device) for t in boxes)
    rows = resize_weights(tops, heights, size[0], batch.shape[-2], antialias)  # [B,h,H]
    cols = resize_weights(lefts, widths, size[1], batch.shape[-1], antialias)  # [B,w,W]
    resized = rows.unsqueeze(1) @ batch.float() @ cols.transpose(1, 2).unsqueeze(1)  # [B,C,h,w]
    out = output_like(batch, size[0], size[1], allocate=allocate)
    if batch.dtype == torch.uint8:
        resized = resized.round_().clamp_(0, 255)
    return out.copy_(resized)


def crop_and_resize(batch: torch.Tensor, boxes: Boxes, size: Tuple[int, int], antialias: bool = True,
                    allocate: Optional[Allocate] = None) -> torch.Tensor:
    """Crop box b of every sample b and resize it to ``size``, one sample at a time.

    What the CPU does: it resizes uint8 directly (torch's fast path), so the
    result is exactly per-sample ``interpolate``.
    """
    out = output_like(batch, size[0], size[1], allocate=allocate)
    for b, (top, left, h, w) in enumerate(zip(*(t.tolist() for t in boxes))):
        crop = batch[b : b + 1, :, top : top + h, left : left + w]
        out[b : b + 1].copy_(resize(crop, *size, antialias=antialias))
    return out


# ---- flips ------------------------------------------------------------------------------------------
def flip_samples(batch: torch.Tensor, flips: torch.Tensor, allocate: Optional[Allocate] = None,
                 batchwise: bool = False) -> torch.Tensor:
    """``batch`` with the samples where ``flips`` (bool [B]) is set mirrored left-right (``batchwise``:
    in one vectorised pass on the CPU too, as on other devices)."""
    if batchwise or batch.device.type != "cpu":  # one vectorised pass suits a GPU
        return torch.where(to_device(flips, batch.device).view(-1, 1, 1, 1), batch.flip(-1), batch)
    # On the CPU, copy sample by sample in the memory order: for a channels-last
    # batch, flipping its [H,W,C] view moves whole pixels (~9x faster than
    # clone + gather/scatter of the chosen samples, measured on 64x3x224x224).
    height, width = batch.shape[-2:]
    out = output_like(batch, height, width, allocate=allocate)
    channels_last = memory_format_of(batch) == torch.channels_last
    source, target = (batch.permute(0, 2, 3, 1), out.permute(0, 2, 3, 1)) if channels_last else (batch, out)
    width_dim = 1 if channels_last else 2  # W within one sample's view
    for b, mirrored in enumerate(flips.tolist()):
        target[b].copy_(source[b].flip(width_dim) if mirrored else source[b])
    return out


# ---- to float ---------------------------------------------------------------------------------------
Scale = Union[float, torch.Tensor]


def scale_and_shift(rows: torch.Tensor, scale: Scale, shift: Optional[torch.Tensor]) -> None:
    """rows = rows * scale + shift in place; without ``shift``, rows *= scale.  ``scale`` is a
    tensor wherever there is a ``shift``.

    On the CPU, in float32 or float64, numpy's multiply and add in place: about twice as fast as
    torch's ``addcmul`` (0.06 against 0.12 ms on a 3x224x224 float image, one thread), each
    result within an ulp of the fused multiply-add.  Elsewhere ``addcmul``, in one pass."""
    if rows.device.type == "cpu" and rows.dtype in (torch.float32, torch.float64) and not rows.requires_grad:
        values = rows.numpy()
        np.multiply(values, scale.numpy() if isinstance(scale, torch.Tensor) else scale, out=values,
                    casting="same_kind")
        if shift is not None:
            np.add(values, shift.numpy(), out=values, casting="same_kind")
    elif shift is None:
        rows.mul_(scale)
    else:
        torch.addcmul(shift, rows, cast(torch.Tensor, scale), out=rows)


def normalize_scale_shift(
    mean: Sequence[float], std: Sequence[float], dtype: torch.dtype, input_dtype: torch.dtype, width: int,
    channels_last: bool, device: torch.device,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) so that ``x * scale + shift`` is ``(x / unit - mean) / std`` for a batch of
    ``input_dtype`` (unit 255 for uint8), shaped for the rows of ``float_output``:
    [W*C] for channels-last samples, [C,1] for contiguous ones."""
    unit = 255.0 if input_dtype == torch.uint8 else 1.0
    scale = torch.tensor([1 / (s * unit) for s in std], dtype=dtype)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)], dtype=dtype)
    if channels_last:
        scale, shift = scale.repeat(width), shift.repeat(width)
    else:
        scale, shift = scale.view(-1, 1), shift.view(-1, 1)
    return to_device(scale, device), to_device(shift, device)


def to_float(batch: torch.Tensor, dtype: torch.dtype = torch.float32, allocate: Optional[Allocate] = None,
             memory_format: Optional[torch.memory_format] = None) -> torch.Tensor:
    """uint8 [0, 255] -> ``dtype`` [0, 1]; a float batch is only cast.  The result is laid out in
    ``memory_format`` (None: the batch's own)."""
    layout = memory_format_of(batch) if memory_format is None else memory_format
    out = memory.output_buffer(batch.shape, dtype, batch.device, layout, allocate)
    out.copy_(batch)
    return out.mul_(UINT8_TO_UNIT) if batch.dtype == torch.uint8 else out


def normalize(batch: torch.Tensor, mean: Sequence[float], std: Sequence[float], dtype: torch.dtype = torch.float32,
              allocate: Optional[Allocate] = None, memory_format: Optional[torch.memory_format] = None,
              batchwise: bool = False) -> torch.Tensor:
    """``(x - mean) / std`` per channel in ``dtype``, a uint8 batch first scaled to [0, 1], in one pass,
    written in ``memory_format`` (None: the batch's own); ``batchwise``: in one pass over the batch
    on the CPU too, as on other devices."""
    b, _, _, w = batch.shape
    channels_last = (memory_format_of(batch) if memory_format is None else memory_format) == torch.channels_last
    out, rows = float_output(batch.shape, dtype, batch.device, channels_last, allocate)
    scale, shift = normalize_scale_shift(mean, std, dtype, batch.dtype, w, channels_last, batch.device)
    source = batch.permute(0, 2, 3, 1) if channels_last else batch
    # cast, scale and shift one sample at a time on the CPU, while it is in cache
    # (~1.5x faster than three passes over the batch); in one pass on a GPU
    step = 1 if batch.device.type == "cpu" and not batchwise else b
    for start in range(0, b, step):
        part = slice(start, start + step)
        out[part].copy_(source[part])
        scale_and_shift(rows[part], scale, shift)
    return out.permute(0, 3, 1, 2) if channels_last else out


def crop_flip_to_float(
    batch: torch.Tensor,
    boxes: Optional[Boxes],
    flips: Optional[torch.Tensor],
    size: Tuple[int, int],
    antialias: bool,
    dtype: torch.dtype,
    scale: Scale,
    shift: Optional[torch.Tensor],
    allocate: Optional[Allocate] = None,
    channels_last: bool = False,
) -> torch.Tensor:
    """Crop and resize, flip where ``flips`` says, cast and ``scale_and_shift`` a CPU uint8 batch, one sample at a time.

    Each sample is resized, then flipped, cast, scaled and shifted straight
    into the float result while it is in cache: no separate flip pass, and no
    uint8 intermediate batches (fresh memory every time).  Measured for
    ``train(224)`` on a [256,3,256,256] channels-last batch, one thread, into a
    reused output: crop ~34 ms, flip ~9-12 ms and Normalize ~15 ms as separate
    passes (~60 ms in all), ~43-46 ms fused.  The result is contiguous NCHW
    whatever the input's layout (what models and DDP expect), or channels-last
    (NHWC in memory) when ``channels_last``: each sample is turned from the
    batch's layout as it is copied, while in cache, instead of in another pass
    over the batch.  The arithmetic is that of
    ``crop_and_resize``, ``flip_samples`` and ``normalize``/``to_float`` (cast,
    then ``scale_and_shift``), so the result is bit-identical to theirs.  The
    scale and shift are shaped as ``normalize_scale_shift`` gives them, for the
    output ``size``; ``UINT8_TO_UNIT`` and no shift is ``to_float``.

    With ``boxes`` None every sample is taken whole (``size`` is then the
    batch's own): the flip, cast and layout turn of a batch already cropped
    (an encoded archive crops at decode) in one pass instead of three.
    """
    b, c = batch.shape[:2]
    h, w = size
    out, rows = float_output((b, c, h, w), dtype, batch.device, channels_last, allocate)
    mirrored = flips.tolist() if flips is not None else [False] * b
    windows = zip(*(t.tolist() for t in boxes)) if boxes is not None else [None] * b
    for i, box in enumerate(windows):
        if box is None:
            sample = batch[i]
        else:
            top, left, height, width = box
            sample = resize(batch[i : i + 1, :, top : top + height, left : left + width], h, w, antialias)[0]
        sample = sample.flip(2) if mirrored[i] else sample
        out[i].copy_(sample.permute(1, 2, 0) if channels_last else sample)  # layout turned while in cache
        scale_and_shift(rows[i], scale, shift)
    return out.permute(0, 3, 1, 2) if channels_last else out

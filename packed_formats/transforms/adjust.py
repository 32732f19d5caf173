"""Batch kernels whose parameters differ per sample: affine warps, colour adjustments, erasing.

The per-image ops of torchvision's auto-augment policies and RandomErasing,
done for a whole ``[k,C,H,W]`` group of images at once, each image with its
own magnitude (a float64 [k] CPU tensor).  Each gives what torchvision's
functional op gives for that image and magnitude, to within float rounding
(uint8 results may differ by one where a value lies on a rounding boundary).
uint8 images are in [0, 255], float images in [0, 1]; the result has the
dtype of the input.  No randomness here: the modules of ``augment`` draw.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .functional import to_device

Fill = Optional[Union[float, Sequence[float]]]
Kernel = Callable[[torch.Tensor, torch.Tensor, str, Fill], torch.Tensor]  # (images, magnitudes, interpolation, fill)


def bound(dtype: torch.dtype) -> float:
    """The value of white: 1.0 for float images, 255 for uint8."""
    return 1.0 if dtype.is_floating_point else 255.0


def _finish(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float results clamped to the valid range, then cast (truncated) back to an integer ``dtype``."""
    values = values.clamp_(0, bound(dtype))
    return values if dtype.is_floating_point else values.to(dtype)


def _per_sample(values: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """float64 [k] CPU values as a [k,1,1,1] tensor of the images' float dtype, on their device."""
    dtype = images.dtype if images.is_floating_point() else torch.float32
    return to_device(values.to(dtype).view(-1, 1, 1, 1), images.device)


def _float(images: torch.Tensor) -> torch.Tensor:
    return images if images.is_floating_point() else images.float()


# ---- affine warps -----------------------------------------------------------------------------------
def inverse_affine(
    angle: torch.Tensor, translate: Tuple[torch.Tensor, torch.Tensor], shear: Tuple[torch.Tensor, torch.Tensor],
    centre: Tuple[float, float],
) -> torch.Tensor:
    """float64 [k,2,3]: for each sample, the map from an output pixel to the input pixel it shows.

    The forward map moves ``centre`` to the origin, applies R(angle) SHy(shear y)
    SHx(shear x) (angles in radians, coordinates relative to the image centre,
    y down), moves back and translates; the inverse undoes those steps in
    reverse order.  This is torchvision's ``affine`` convention.
    """
    sx, sy = shear
    tan_sx = torch.tan(sx)
    a = torch.cos(angle - sy) / torch.cos(sy)  # [[a, b], [c, d]] = R SHy SHx, whose determinant is 1
    b = -(a * tan_sx + torch.sin(angle))
    c = torch.sin(angle - sy) / torch.cos(sy)
    d = torch.cos(angle) - c * tan_sx
    cx, cy = centre
    moved_x, moved_y = cx + translate[0], cy + translate[1]
    ia, ib, ic, id_ = d, -b, -c, a  # the inverse of R SHy SHx
    offset_x = cx - ia * moved_x - ib * moved_y
    offset_y = cy - ic * moved_x - id_ * moved_y
    return torch.stack([torch.stack([ia, ib, offset_x], 1), torch.stack([ic, id_, offset_y], 1)], 1)


def warp(images: torch.Tensor, matrices: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Each image resampled through its own ``inverse_affine`` matrix, in one ``grid_sample``.

    Output pixel centres, relative to the image centre, go through the matrix
    and are scaled by half the image size to grid_sample's [-1, 1] coordinates.
    Pixels that map outside the image get ``fill`` (None: zeros, as torch pads).
    """
    k, channels, height, width = images.shape
    values = _float(images)
    theta = to_device(matrices.to(values.dtype), images.device)
    half = torch.tensor([0.5 * width, 0.5 * height], dtype=values.dtype, device=images.device)
    xs = torch.linspace((1.0 - width) * 0.5, (width - 1.0) * 0.5, width, device=images.device, dtype=values.dtype)
    ys = torch.linspace((1.0 - height) * 0.5, (height - 1.0) * 0.5, height, device=images.device, dtype=values.dtype)
    centres = torch.stack([xs.expand(height, width), ys.view(-1, 1).expand(height, width),
                           torch.ones(height, width, device=images.device, dtype=values.dtype)], -1)
    grid = centres.view(1, height * width, 3) @ (theta.transpose(1, 2) / half)  # [k, H*W, 2]
    grid = grid.view(k, height, width, 2)
    if fill is not None:  # a channel of ones tells which output pixels came from inside the image
        values = torch.cat([values, values.new_ones(k, 1, height, width)], 1)
    out = F.grid_sample(values, grid, mode=interpolation, padding_mode="zeros", align_corners=False)
    if fill is not None:
        out, inside = out[:, :channels], out[:, channels:]
        colour = torch.tensor(_fill_list(fill, channels), dtype=out.dtype, device=out.device).view(1, -1, 1, 1)
        if interpolation == "nearest":
            out = torch.where(inside < 0.5, colour, out)
        else:
            out = (out - colour).mul_(inside).add_(colour)
    return out if images.is_floating_point() else out.round_().to(images.dtype)


def _fill_list(fill: Union[float, Sequence[float]], channels: int) -> Sequence[float]:
    values = [float(fill)] if isinstance(fill, (int, float)) else [float(v) for v in fill]
    if len(values) not in (1, channels):
        raise ValueError(f"fill needs 1 or {channels} values, got {len(values)}")
    return values


def _no_turn(magnitudes: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(magnitudes)


def _shear_angle(magnitudes: torch.Tensor) -> torch.Tensor:
    """atan(magnitude) in radians, through degrees and back, in Python floats: torchvision's exact float64
    angle (torch's atan may differ from the C library's by an ulp, which can move a warped pixel)."""
    return torch.tensor([math.radians(math.degrees(math.atan(m))) for m in magnitudes.tolist()], dtype=torch.float64)


def shear_x(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Shear along x by ``magnitudes`` (x moves by magnitude * y), about the top-left corner."""
    angle = _shear_angle(magnitudes)
    corner = (-0.5 * images.shape[-1], -0.5 * images.shape[-2])
    zero = _no_turn(magnitudes)
    return warp(images, inverse_affine(zero, (zero, zero), (angle, zero), corner), interpolation, fill)


def shear_y(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Shear along y by ``magnitudes`` (y moves by magnitude * x), about the top-left corner."""
    angle = _shear_angle(magnitudes)
    corner = (-0.5 * images.shape[-1], -0.5 * images.shape[-2])
    zero = _no_turn(magnitudes)
    return warp(images, inverse_affine(zero, (zero, zero), (zero, angle), corner), interpolation, fill)


def translate_x(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Shift right by ``magnitudes`` pixels, truncated to whole pixels."""
    zero = _no_turn(magnitudes)
    return warp(images, inverse_affine(zero, (magnitudes.trunc(), zero), (zero, zero), (0.0, 0.0)), interpolation, fill)


def translate_y(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Shift down by ``magnitudes`` pixels, truncated to whole pixels."""
    zero = _no_turn(magnitudes)
    return warp(images, inverse_affine(zero, (zero, magnitudes.trunc()), (zero, zero), (0.0, 0.0)), interpolation, fill)


def rotate(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Rotate counter-clockwise by ``magnitudes`` degrees about the image centre, keeping the size.

    Images turned by a whole number of turns are kept as they are (as torchvision does, where
    resampling would blur them by float rounding).
    """
    degrees = torch.remainder(magnitudes, 360.0)
    zero = _no_turn(magnitudes)
    turned = warp(images, inverse_affine(torch.deg2rad(-degrees), (zero, zero), (zero, zero), (0.0, 0.0)),
                  interpolation, fill)
    unturned = to_device((degrees == 0).view(-1, 1, 1, 1), images.device)
    return torch.where(unturned, images, turned)


# ---- colour -----------------------------------------------------------------------------------------
def _check_colour_channels(images: torch.Tensor) -> None:
    if images.shape[1] not in (1, 3):
        raise ValueError(f"colour adjustments take images of 1 or 3 channels, got {images.shape[1]}")


def _blend(images: torch.Tensor, other: torch.Tensor, ratios: torch.Tensor) -> torch.Tensor:
    """images * ratio + other * (1 - ratio) per sample (ratios float64 [k]), clamped and cast back."""
    # addcmul: a fused multiply-add, as torch's add with a scalar alpha does it (bit-identical to torchvision)
    blended = images.mul(_per_sample(ratios, images)).addcmul_(other, _per_sample(1.0 - ratios, images))
    return _finish(blended, images.dtype)


def grey(images: torch.Tensor) -> torch.Tensor:
    """float [k,1,H,W] luma (ITU-R 601-2 weights); whole levels for integer images."""
    r, g, b = images.unbind(1)
    luma = r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(1)
    return luma if images.is_floating_point() else luma.floor_()


def brightness(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Pixel values times 1 + magnitude."""
    _check_colour_channels(images)
    return _finish(images.mul(_per_sample(1.0 + magnitudes, images)), images.dtype)


def saturation(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Blend with the grey image by 1 + magnitude (more or less colourful); grey images stay as they are."""
    _check_colour_channels(images)
    if images.shape[1] == 1:
        return images
    return _blend(images, grey(images), 1.0 + magnitudes)


def contrast(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Blend with the image's mean grey level by 1 + magnitude."""
    _check_colour_channels(images)
    levels = grey(images) if images.shape[1] == 3 else _float(images)
    return _blend(images, levels.mean(dim=(1, 2, 3), keepdim=True), 1.0 + magnitudes)


def sharpness(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Blend the inner pixels with a 3x3 smoothed image by 1 + magnitude (the border is kept)."""
    _check_colour_channels(images)
    k, channels, height, width = images.shape
    if height <= 2 or width <= 2:
        return images
    values = images.to(images.dtype if images.is_floating_point() else torch.float32, copy=True)
    kernel = torch.ones(3, 3, dtype=values.dtype, device=values.device)
    kernel[1, 1] = 5.0
    smooth = F.conv2d(values, (kernel / 13.0).expand(channels, 1, 3, 3), groups=channels)
    if not images.is_floating_point():
        smooth = smooth.round_()
    inner = values[:, :, 1:-1, 1:-1]
    inner.addcmul_(smooth.sub_(inner), _per_sample(1.0 - (1.0 + magnitudes), images))
    return _finish(values, images.dtype)


def posterize(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Keep the top ``int(magnitude)`` bits of each value (float images: as many levels)."""
    bits = magnitudes.long()
    if images.is_floating_point():
        levels = _per_sample(torch.pow(2.0, bits.double()), images)
        return images.mul(levels).floor_().clamp_(min=torch.zeros_like(levels), max=levels - 1).div_(levels)
    masks = ((1 << bits) - 1) << (8 - bits)
    return images & to_device(masks.to(torch.uint8).view(-1, 1, 1, 1), images.device)


def _invert(images: torch.Tensor) -> torch.Tensor:
    return 1.0 - images if images.is_floating_point() else images.bitwise_not()


def solarize(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Invert the values at or above magnitude * white."""
    threshold = _per_sample(bound(images.dtype) * magnitudes, images)
    return torch.where(images >= threshold, _invert(images), images)


def autocontrast(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Stretch each channel's range of values to black..white (a flat channel stays as it is)."""
    _check_colour_channels(images)
    values = _float(images)
    low = values.amin(dim=(2, 3), keepdim=True)
    span = values.amax(dim=(2, 3), keepdim=True).sub_(low).mul_(1.0 / bound(images.dtype))
    flat = span == 0
    low = low.masked_fill(flat, 0.0)
    span = span.masked_fill(flat, 1.0)
    return values.sub(low).div_(span).clamp_(0, bound(images.dtype)).to(images.dtype)


def equalize(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    """Histogram equalisation of each channel, with PIL's lookup table; float images through 256 levels."""
    pixels = images if images.dtype == torch.uint8 else images.mul(256.0 - 1e-3).to(torch.uint8)
    k, channels, height, width = pixels.shape
    flat = pixels.reshape(k * channels, height * width).long()
    counts = torch.zeros(k * channels, 256, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(1, flat, torch.ones_like(flat))
    # PIL leaves out the pixels of the brightest level present, then spreads the rest over 255 steps
    brightest = counts.gather(1, flat.amax(1, keepdim=True))
    step = (height * width - brightest) // 255
    below = counts.cumsum(1)[:, :-1]  # pixels darker than each level from 1 on
    table = (below + step // 2).div_(step.clamp(min=1), rounding_mode="floor").clamp_(0, 255)
    table = torch.cat([torch.zeros_like(table[:, :1]), table], 1)
    equalised = torch.where(step > 0, table.gather(1, flat), flat).to(torch.uint8).view(k, channels, height, width)
    return equalised if images.dtype == torch.uint8 else equalised.to(images.dtype).mul_(1.0 / 255)


def identity(images: torch.Tensor, magnitudes: torch.Tensor, interpolation: str, fill: Fill) -> torch.Tensor:
    return images


KERNELS: Dict[str, Kernel] = {
    "Identity": identity,
    "ShearX": shear_x,
    "ShearY": shear_y,
    "TranslateX": translate_x,
    "TranslateY": translate_y,
    "Rotate": rotate,
    "Brightness": brightness,
    "Color": saturation,
    "Contrast": contrast,
    "Sharpness": sharpness,
    "Posterize": posterize,
    "Solarize": solarize,
    "AutoContrast": autocontrast,
    "Equalize": equalize,
}


# ---- erasing ----------------------------------------------------------------------------------------
def erase(batch: torch.Tensor, boxes: Sequence[torch.Tensor], erased: torch.Tensor, value: Optional[torch.Tensor],
          noise: Optional[torch.Generator], out: torch.Tensor) -> torch.Tensor:
    """``batch`` into ``out``, with box (tops, lefts, heights, widths)[b] of each ``erased`` sample b
    set to ``value`` ([C,1,1] on the batch's device, of its dtype) or, when it is None, to standard
    normal noise drawn from ``noise`` (a generator of the batch's device).

    CPU: copy, then fill the boxes sample by sample; elsewhere one masked pass.
    """
    if batch.device.type == "cpu":
        return _erase_each(batch, boxes, erased, value, noise, out)
    height, width = batch.shape[-2:]
    tops, lefts, heights, widths, chosen = (to_device(x, batch.device) for x in (*boxes, erased))
    rows = torch.arange(height, device=batch.device).view(1, -1)
    cols = torch.arange(width, device=batch.device).view(1, -1)
    in_rows = (rows >= tops.view(-1, 1)) & (rows < (tops + heights).view(-1, 1))
    in_cols = (cols >= lefts.view(-1, 1)) & (cols < (lefts + widths).view(-1, 1))
    mask = (in_rows[:, :, None] & in_cols[:, None, :] & chosen.view(-1, 1, 1)).unsqueeze(1)
    if value is None:
        value = torch.randn(batch.shape, generator=noise, device=batch.device, dtype=batch.dtype)
    return out.copy_(torch.where(mask, value, batch))


def _erase_each(batch: torch.Tensor, boxes: Sequence[torch.Tensor], erased: torch.Tensor,
                value: Optional[torch.Tensor], noise: Optional[torch.Generator], out: torch.Tensor) -> torch.Tensor:
    out.copy_(batch)
    channels = batch.shape[1]
    for b in erased.nonzero().flatten().tolist():
        top, left, h, w = (int(t[b]) for t in boxes)
        patch = value if value is not None else torch.randn(channels, h, w, generator=noise, dtype=batch.dtype)
        out[b, :, top : top + h, left : left + w] = patch
    return out

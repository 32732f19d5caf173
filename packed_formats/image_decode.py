"""Encoded images to uint8 CxHxW tensors by PyTorch's own decoders: the one place that picks them.

TorchCodec now holds PyTorch's image decoding (``torchcodec.decoders``: libjpeg-turbo,
libpng and libwebp on the CPU, batched nvJPEG on CUDA; images need no FFmpeg).  It is
used where it imports and has them (``pip install packed_formats[torchcodec]``, the
release that pairs with the installed torch).  Elsewhere ``torchvision.io``'s decoders
are used: the same libraries and the same pixels, deprecated from torchvision 0.29 on
(its warning, left as it is, says so).  ``decode="device"`` (``loading.device_decode``),
the benchmarks' references and ``doctor`` decode through ``decode``.
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

DECODERS = ("torchcodec", "torchvision")
MODES = ("RGB", "UNCHANGED")


def decode(blobs: Sequence[torch.Tensor], mode: str = "RGB", device: Union[torch.device, str] = "cpu",
           using: Optional[str] = None) -> List[torch.Tensor]:
    """Each of ``blobs`` (an image's encoded bytes, a 1-D uint8 CPU tensor) as uint8 CxHxW on ``device``.

    ``mode`` "RGB" gives three channels, "UNCHANGED" the stored ones (one for a greyscale
    mask).  On the CPU each image is decoded alone, in any format the decoder reads (JPEG,
    PNG, WebP, GIF); on a GPU the blobs must be JPEGs, decoded in one batched call (nvJPEG).
    ``using`` is one of ``DECODERS`` (default: ``decoder()``).  RuntimeError or ValueError
    when the decoder refuses an image; ImportError when ``using`` is not installed.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    using = using or decoder()
    device = torch.device(device)
    blobs = list(blobs)
    if using == "torchcodec":
        decoders, error = _torchcodec()
        if decoders is None:
            raise ImportError(f"TorchCodec cannot decode images here ({error}); pip install packed_formats[torchcodec]")
        if device.type == "cpu":
            return [decoders.decode_image(blob, mode=mode) for blob in blobs]
        return list(decoders.decode_jpeg(blobs, mode=mode, device=device)) if blobs else []
    if using != "torchvision":
        raise ValueError(f"using must be one of {DECODERS}, got {using!r}")
    from torchvision import io

    read_mode = getattr(io.ImageReadMode, mode)
    if device.type == "cpu":
        return [io.decode_image(blob, mode=read_mode) for blob in blobs]
    return list(io.decode_jpeg(blobs, mode=read_mode, device=device)) if blobs else []


def decoder() -> str:
    """The decoder ``decode`` uses by default: "torchcodec" where it imports with its image decoders,
    else "torchvision"."""
    return "torchcodec" if _torchcodec()[0] is not None else "torchvision"


def describe() -> str:
    """The default decoder and its version, for a report ("torchcodec 0.17.0"); with TorchCodec unusable,
    torchvision's and why not TorchCodec."""
    name = decoder()
    if name == "torchcodec":
        return f"torchcodec {_version('torchcodec')}"
    return f"torchvision {_version('torchvision')} (torchcodec unusable: {_torchcodec()[1]})"


def torchcodec_error() -> Optional[str]:
    """Why TorchCodec cannot decode images here (missing, a release without image decoders, or built
    for another torch), or None when it can."""
    return _torchcodec()[1]


@functools.lru_cache(maxsize=None)
def _torchcodec() -> Tuple[Any, Optional[str]]:
    """(``torchcodec.decoders``, None), or (None, why not): tried once a process."""
    try:
        from torchcodec import decoders

        decoders.decode_image, decoders.decode_jpeg  # noqa: B018 (before 0.16 it has no image decoders)
    except Exception as exc:  # ImportError, or OSError/RuntimeError from a build for another torch
        return None, repr(exc)
    return decoders, None


def _version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None

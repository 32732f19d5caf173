"""Encoded batches decoded on the loader's device: batched nvJPEG on a GPU.

With ``make_loader(..., decode="device")`` the workers stop decoding.  Each
reads its batch's stored bytes (checked as ever: their CRC, and a strict
decode of every JPEG at 1/8 scale the first time any worker reads it, so a
truncated or damaged image is refused by name before a device decoder could
fill it in silently), reads the images' sizes from their headers, draws the
transform's first crop in those sizes (``transforms.at_decode``) and sends the
bytes on as an ``EncodedBatch``.  On photographs the strict check costs about
half a decode; made once per loader, a worker prepares ~2,900 images/s a core
in the first epoch and ~40,000 after.

The main process decodes the batch's JPEGs in one call to torchvision's
batched decoder on the device (nvJPEG on CUDA), cuts each image's box out and
resizes it there (bilinear, antialiased) into one uint8 [B,3,H,W] batch.  The
rest of the transform then runs on the device with the batch's random
generator as the worker left it: the crops and flips are those the workers
would have drawn decoding on the CPU.

What the device's decoder does not take (PNG, WebP, CMYK JPEGs, JPEGs the
native decoder leaves to Pillow) the worker decodes, cuts and resizes itself,
and sends as pixels; a JPEG the device decoder refuses in the main process is
decoded there on the CPU.  With ``device="cpu"`` the same steps run in the main
process with torchvision's CPU decoder: the same code path, testable anywhere.
(torchvision marks its decoders deprecated from 0.29 on, for TorchCodec's;
they are what this module calls while torchvision ships them.)
"""

from __future__ import annotations

import warnings
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from . import codecs, native, policy
from .backends.base import Reader
from .errors import PackedFormatError


class EncodedBatch(NamedTuple):
    """A batch as a worker sends it for decoding on the device."""

    data: torch.Tensor  # uint8 [N]: the stored bytes of the images the device decodes, one after another
    offsets: torch.Tensor  # int64 [B+1]: image j's bytes are data[offsets[j]:offsets[j+1]] (none: in ``host``)
    boxes: torch.Tensor  # int64 [B,4]: (top, left, height, width) of each image to keep; [0,4]: images whole
    size: torch.Tensor  # int64 [2]: the (height, width) every box is resized to; [0] with images whole
    host: torch.Tensor  # uint8 [k,H,W,3]: the images the worker decoded (boxes cut and resized already)
    host_at: torch.Tensor  # int64 [k]: their places in the batch
    indices: torch.Tensor  # int64 [B]: the images' dataset indices (to name one in an error)
    state: torch.Tensor  # uint8: the batch generator's state once the crops are drawn (empty: no transform)


def takes(data: bytes) -> bool:
    """Whether the device decodes these stored bytes: a YCbCr or greyscale JPEG that the native decoder
    reads whole and strictly (the check a truncated or damaged file fails; ~1/3 of a decode)."""
    return codecs.sniff(data) == "jpeg" and native.jpeg_size(data) is not None and native.jpeg_decodes(data)


def resize_boxes(sizes: np.ndarray, size: Tuple[int, int], resize_mode: str) -> np.ndarray:
    """int64 [B,4] boxes of images of stored (width, height) ``sizes`` that ``resize_mode`` keeps
    when it resizes them to ``size``: each whole ("stretch"), or its centre at the output's aspect."""
    boxes = np.zeros((len(sizes), 4), dtype=np.int64)
    for j, (width, height) in enumerate(sizes.tolist()):
        boxes[j] = native.kept_box(height, width, size, resize_mode)
    return boxes


def pack(
    blobs: Sequence[Optional[bytes]], boxes: Optional[np.ndarray], size: Optional[Tuple[int, int]],
    host_at: Sequence[int], host: "Sequence[np.ndarray] | torch.Tensor", indices: np.ndarray,
    generator: Optional[torch.Generator],
) -> EncodedBatch:
    """An ``EncodedBatch``: ``blobs[j]`` the bytes the device decodes, None for the images decoded
    here, ``host`` (HxWx3 uint8 each, or all in one [k,H,W,3] tensor), at places ``host_at``;
    ``boxes`` and ``size`` None for images taken whole."""
    lengths = [0 if blob is None else len(blob) for blob in blobs]
    ends = np.cumsum(lengths, dtype=np.int64)
    data = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.uint8)
    for blob, end in zip(blobs, ends.tolist()):
        if blob:
            data[end - len(blob) : end] = np.frombuffer(blob, dtype=np.uint8)
    if isinstance(host, torch.Tensor):
        pixels = host
    else:
        pixels = torch.from_numpy(np.stack(host) if len(host) else np.zeros((0, 0, 0, 3), dtype=np.uint8))
    return EncodedBatch(
        data=torch.from_numpy(data),
        offsets=torch.from_numpy(np.concatenate([np.zeros(1, dtype=np.int64), ends])),
        boxes=torch.from_numpy(np.zeros((0, 4), dtype=np.int64) if boxes is None else np.asarray(boxes, np.int64)),
        size=torch.tensor([] if size is None else list(size), dtype=torch.int64),
        host=pixels,
        host_at=torch.tensor(list(host_at), dtype=torch.int64),
        indices=torch.from_numpy(np.asarray(indices, dtype=np.int64)),
        state=torch.zeros(0, dtype=torch.uint8) if generator is None else generator.get_state(),
    )


class DeviceDecoder:
    """Turns ``EncodedBatch``es of ``reader`` into uint8 [B,3,H,W] batches on a device (see the module)."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def __call__(self, batch: EncodedBatch, device: torch.device) -> Tuple[torch.Tensor, Optional[torch.Generator]]:
        """(the batch's images on ``device``, its generator as the worker left it, or None)."""
        offsets, indices = batch.offsets.tolist(), batch.indices.tolist()
        places = [j for j in range(len(offsets) - 1) if offsets[j + 1] > offsets[j]]
        blobs = [batch.data[offsets[j] : offsets[j + 1]] for j in places]
        decoded = self._decode(blobs, [indices[j] for j in places], device)
        boxes, size = batch.boxes.tolist(), tuple(int(v) for v in batch.size.tolist())
        host = batch.host.to(device, non_blocking=True).permute(0, 3, 1, 2)
        if size:
            shape: Tuple[int, ...] = (3,) + size
        else:
            shape = tuple(decoded[0].shape) if decoded else tuple(host.shape[1:])
        out = self.assemble(decoded, places, boxes, shape, indices, device)
        if len(host):
            self._check_shape(host[0], shape, indices[int(batch.host_at[0])])
            out[batch.host_at.to(device)] = host
        generator = None
        if batch.state.numel():
            generator = torch.Generator()
            generator.set_state(batch.state.cpu())
        return out, generator

    def assemble(self, images: List[torch.Tensor], places: List[int], boxes: List[List[int]], shape: Tuple[int, ...],
                 indices: List[int], device: torch.device, exact: Optional[bool] = None) -> torch.Tensor:
        """uint8 [B, *shape] on ``device`` (B: ``len(indices)``) with each of ``images`` at its place, its
        box cut out and resized where there are boxes: by torch's uint8 kernel when ``exact`` (None: on
        the CPU), else into one float batch rounded back to uint8 in one pass (a few kernels per image,
        not six)."""
        exact = (device.type == "cpu" if exact is None else exact) or not boxes
        count = len(indices)
        out = torch.empty((count,) + shape, dtype=torch.uint8, device=device)
        staged = None if exact else torch.empty((count,) + shape, dtype=torch.float32, device=device)
        for j, image in zip(places, images):
            if boxes:
                image = cut(image, boxes[j], shape[1:]) if exact else cut_in_float(image, boxes[j], shape[1:])
            self._check_shape(image, shape, indices[j])
            if staged is None:
                out[j] = image
            else:
                staged[j] = image
        if staged is not None and places:
            rows = torch.tensor(places, device=device)
            out[rows] = staged[rows].round_().clamp_(0, 255).to(torch.uint8)
        return out

    def _decode(self, blobs: List[torch.Tensor], indices: List[int], device: torch.device) -> List[torch.Tensor]:
        """The images of ``blobs`` as 3xHxW uint8 on ``device``: in one batched call, else one by one, an
        image the device refuses decoded on the CPU (or named in a CorruptSampleError)."""
        if not blobs:
            return []
        try:
            return decode_jpegs(blobs, device)
        except RuntimeError:
            return [self._decode_one(blob, i, device) for blob, i in zip(blobs, indices)]

    def _decode_one(self, blob: torch.Tensor, i: int, device: torch.device) -> torch.Tensor:
        try:
            return decode_jpegs([blob], device)[0]
        except RuntimeError:
            pass
        try:  # the CPU's strict decode, which the worker's check passed: it reads it, or says why not
            pixels = policy.decode(blob.numpy().tobytes(), 3)
        except codecs.DecodeError as exc:
            raise self.reader.sample_error(i, str(exc)) from None
        return torch.from_numpy(pixels).permute(2, 0, 1).to(device)

    def _check_shape(self, image: torch.Tensor, shape: Tuple[int, ...], i: int) -> None:
        if tuple(image.shape) != shape:
            raise mixed_sizes(self.reader, i, tuple(image.shape[1:]), shape[1:])


def mixed_sizes(reader: Reader, i: int, size: Sequence[int], batch_size: Sequence[int]) -> PackedFormatError:
    """The error for sample i, of (height, width) ``size``, in a batch of images of ``batch_size``."""
    return PackedFormatError(
        reader.path,
        f"image is {size[0]}x{size[1]}, other images of the batch are {batch_size[0]}x{batch_size[1]}",
        index=i,
        key=reader.key(i),
        hint="images of different sizes need make_loader(..., size=(height, width)) or a transform "
        "that starts with a crop (pf.transforms.train or val)",
    )


def decoder_error() -> Optional[str]:
    """Why torchvision's JPEG decoder cannot decode here (missing, built without its image extension,
    or no longer shipped), or None when it decodes a small JPEG."""
    try:
        jpeg = codecs.encode(np.zeros((8, 8, 3), dtype=np.uint8), "jpeg", 90)
        decode_jpegs([torch.frombuffer(bytearray(jpeg), dtype=torch.uint8)], torch.device("cpu"))
    except Exception as exc:  # ImportError, or RuntimeError from a build without its image ops
        return repr(exc)
    return None


def check_decoder() -> None:
    """ValueError unless torchvision's JPEG decoder works here: without it every image would go to
    the CPU fallback, one at a time."""
    error = decoder_error()
    if error is not None:
        raise ValueError(f"decode='device' needs torchvision's JPEG decoder, which fails here ({error}); "
                         "use decode='workers'")


def decode_jpegs(blobs: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    """JPEG bytes (1-D uint8 CPU tensors) as 3xHxW uint8 RGB on ``device``, in one call of
    torchvision's decoder (batched nvJPEG on CUDA); RuntimeError when it refuses one."""
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():  # its deprecation in favour of TorchCodec (see the module)
        warnings.simplefilter("ignore", DeprecationWarning)
        return list(decode_jpeg(blobs, mode=ImageReadMode.RGB, device=device))


def _box(image: torch.Tensor, box: Sequence[int]) -> torch.Tensor:
    """The ``box`` (top, left, height, width) of a CxHxW image, kept inside it and at least one pixel."""
    top, left, height, width = box
    bottom, right = max(top + 1, min(image.shape[1], top + height)), max(left + 1, min(image.shape[2], left + width))
    return image[:, top:bottom, left:right]


def cut(image: torch.Tensor, box: Sequence[int], size: Tuple[int, ...]) -> torch.Tensor:
    """The ``box`` of a 3xHxW uint8 image, resized to ``size`` (height, width) by torch's antialiased
    uint8 kernel (as a worker's decode does)."""
    crop = _box(image, box)
    if tuple(crop.shape[1:]) == tuple(size):
        return crop
    return native.resize(crop, (int(size[0]), int(size[1])))


def cut_in_float(image: torch.Tensor, box: Sequence[int], size: Tuple[int, ...]) -> torch.Tensor:
    """The ``box`` of a 3xHxW uint8 image resized to ``size`` (bilinear, antialiased) in float32, for
    devices without torch's uint8 kernel: rounded, it is within one level of ``cut``."""
    crop = _box(image, box)[None].float()
    if tuple(crop.shape[2:]) == tuple(size):
        return crop[0]
    return F.interpolate(crop, size=(int(size[0]), int(size[1])), mode="bilinear", antialias=True,
                         align_corners=False)[0]

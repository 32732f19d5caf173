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

The main process decodes the batch's JPEGs in one call to PyTorch's batched
decoder on the device (``image_decode``: TorchCodec's, else torchvision's;
nvJPEG on CUDA; it takes the bytes on the host, as views of the batch's one
buffer, and copies them itself), then resizes every
image's box at once (``resample``: bilinear, antialiased, within a level of
torchvision's antialiased resize) into one uint8 [B,3,H,W] batch, laid out in
the loader's memory format: a few operator calls per batch, none per image.
The rest of the transform then runs on the device with the batch's random
generator as the worker left it: the crops and flips are those the workers
would have drawn decoding on the CPU.

What the device's decoder does not take (PNG, WebP, CMYK JPEGs, JPEGs the
native decoder leaves to Pillow) the worker decodes, cuts and resizes itself,
and sends as pixels; a JPEG the device decoder refuses in the main process is
decoded there on the CPU.  With ``device="cpu"`` the same steps run in the main
process with the same decoder on the CPU: the same code path, testable anywhere.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import codecs, image_decode, native, policy
from ..backends.reader import Reader
from ..errors import PackedFormatError
from ..transforms import functional as F


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
    """Turns ``EncodedBatch``es of ``reader`` into uint8 [B,3,H,W] batches on a device (see the module),
    laid out in ``memory_format``."""

    def __init__(self, reader: Reader, memory_format: torch.memory_format = torch.contiguous_format) -> None:
        self.reader, self.memory_format = reader, memory_format

    def __call__(self, batch: EncodedBatch, device: torch.device) -> Tuple[torch.Tensor, Optional[torch.Generator]]:
        """(the batch's images on ``device``, its generator as the worker left it, or None)."""
        offsets, indices = batch.offsets.tolist(), batch.indices.tolist()
        places = [j for j in range(len(offsets) - 1) if offsets[j + 1] > offsets[j]]
        blobs = [batch.data[offsets[j] : offsets[j + 1]] for j in places]
        decoded = self._decode(blobs, [indices[j] for j in places], device)
        size = tuple(int(v) for v in batch.size.tolist())
        if size:
            shape: Tuple[int, ...] = (3,) + size
        else:
            shape = tuple(decoded[0].shape) if decoded else (3,) + tuple(batch.host.shape[1:3])
        out = self.assemble(decoded, places, batch.boxes.numpy() if size else None, shape, indices, device)
        if len(batch.host):
            self._check_shape(batch.host[0].permute(2, 0, 1), shape, indices[int(batch.host_at[0])])
            host = batch.host.to(device, non_blocking=True).permute(0, 3, 1, 2)
            out[batch.host_at.to(device, non_blocking=True)] = host
        return out, restored(batch.state)

    def assemble(self, images: List[torch.Tensor], places: List[int], boxes: Optional[np.ndarray],
                 shape: Tuple[int, ...], indices: List[int], device: torch.device) -> torch.Tensor:
        """uint8 [B, *shape] on ``device`` (B: ``len(indices)``, laid out in ``memory_format``) with each
        of ``images`` at its place: whole (all of ``shape``), or its box of ``boxes`` (int64 [B,4], one
        row per place) resized to ``shape`` in a few batched operator calls (``resample``)."""
        out = torch.empty((len(indices),) + shape, dtype=torch.uint8, device=device, memory_format=self.memory_format)
        if not images:
            return out
        if boxes is None:
            for j, image in zip(places, images):
                self._check_shape(image, shape, indices[j])
            _write(out, places, torch.stack(images))
        else:
            resample(images, boxes[places], shape[1:], out, places)
        return out

    def _decode(self, blobs: List[torch.Tensor], indices: List[int], device: torch.device) -> List[torch.Tensor]:
        """The images of ``blobs`` as 3xHxW uint8 on ``device``: in one batched call, else one by one, an
        image the device refuses decoded on the CPU (or named in a CorruptSampleError)."""
        if not blobs:
            return []
        try:
            return decode_jpegs(blobs, device)
        except (RuntimeError, ValueError):
            return [self._decode_one(blob, i, device) for blob, i in zip(blobs, indices)]

    def _decode_one(self, blob: torch.Tensor, i: int, device: torch.device) -> torch.Tensor:
        try:
            return decode_jpegs([blob], device)[0]
        except (RuntimeError, ValueError):
            pass
        try:  # the CPU's strict decode, which the worker's check passed: it reads it, or says why not
            pixels = policy.decode(blob.numpy().tobytes(), 3)
        except codecs.DecodeError as exc:
            raise self.reader.sample_error(i, str(exc)) from None
        return torch.from_numpy(pixels).permute(2, 0, 1).to(device)

    def _check_shape(self, image: torch.Tensor, shape: Tuple[int, ...], i: int) -> None:
        if tuple(image.shape) != shape:
            raise mixed_sizes(self.reader, i, tuple(image.shape[1:]), shape[1:])


# ---- the batched resize -----------------------------------------------------------------------------
GATHER_LIMIT = 1 << 27  # pixel values one resampling pass gathers at most (~0.6 GiB with their float copy)


def resample(images: List[torch.Tensor], boxes: np.ndarray, size: Sequence[int], out: torch.Tensor,
             places: Sequence[int], limit: int = GATHER_LIMIT) -> None:
    """Box j of ``images[j]`` (3xHxW uint8 of any sizes, on ``out``'s device) resized to ``size``
    (bilinear, antialiased: torchvision's antialiased resize, to within a level) into ``out[places[j]]``.

    A few operator calls for the whole batch, whatever its size: the images are
    concatenated into one flat buffer (one call); each crop's rows are gathered
    from it into one padded [B, Hc, 3, Wc] batch (one call: every row is a
    window of that buffer), made float (one call) and resampled by two batched
    matrix products with each image's own antialiased bilinear weights
    (``functional.triangle_weights``: zero past its crop, so padding and the
    pixels beyond weigh nothing), rounded back once and written.  The weights'
    few numbers per image reach the device in one copy (pinned on CUDA).  Batches
    whose padded crops exceed ``limit`` values are done in groups of similar
    heights, each within it (one image alone where it is larger).
    """
    h, w = int(size[0]), int(size[1])
    images = _one_layout(images)
    heights_, widths_ = (np.array([int(image.shape[k]) for image in images], dtype=np.int64) for k in (1, 2))
    boxes = np.asarray(boxes, dtype=np.int64).reshape(-1, 4)
    tops = np.clip(boxes[:, 0], 0, heights_ - 1)  # each box kept inside its image, at least a pixel
    lefts = np.clip(boxes[:, 1], 0, widths_ - 1)
    heights = np.maximum(1, np.minimum(heights_ - tops, boxes[:, 2]))
    widths = np.maximum(1, np.minimum(widths_ - lefts, boxes[:, 3]))
    planar = images[0].stride(2) == 1
    step = 1 if planar else 3  # between neighbouring pixels of a row
    channel = heights_ * widths_ if planar else np.ones_like(heights_)
    row = widths_ if planar else 3 * widths_
    ends = np.cumsum(3 * heights_ * widths_)
    bases = ends - 3 * heights_ * widths_
    groups = _groups(heights, widths, limit)
    pad = (int(widths.max()) - 1) * step + 1  # past the last image: its last rows' windows stay in the buffer
    flat = torch.empty(int(ends[-1]) + pad, dtype=torch.uint8, device=out.device)
    torch.cat([_flat(image) for image in images], out=flat[: int(ends[-1])])

    arrays: List[np.ndarray] = []
    for group in groups:
        hc, wc = int(heights[group].max()), int(widths[group].max())
        lines = np.minimum(np.arange(hc)[None, :], heights[group, None] - 1)  # rows past a crop repeat its last
        starts = bases[group, None] + (tops[group, None] + lines) * row[group, None] + lefts[group, None] * step
        offsets = channel[group, None] * np.arange(3)[None, :]
        row_slopes, row_intercepts = F.resampling_lines(heights[group], h, antialias=True)
        col_slopes, col_intercepts = F.resampling_lines(widths[group], w, antialias=True)
        arrays += [starts, offsets, np.asarray(places, dtype=np.int64)[group]] + [
            a.astype(np.float32) for a in (row_slopes, row_intercepts, heights[group], col_slopes, col_intercepts,
                                           widths[group], np.arange(max(hc, wc)))]
    staged = _to_device(arrays, out.device)
    for k, group in enumerate(groups):
        at, rows, taps = staged[10 * k : 10 * k + 10], staged[10 * k + 2], staged[10 * k + 9]
        n, hc, wc = len(group), int(heights[group].max()), int(widths[group].max())
        windows = flat.as_strided((flat.numel() - (wc - 1) * step, wc), (1, step))
        crops = windows[at[0][:, :, None] + at[1][:, None, :]].to(torch.float32)  # [n, hc, 3, wc]
        along_y = F.triangle_weights(at[3], at[4], at[5], taps[:hc])  # [n, h, hc]
        along_x = F.triangle_weights(at[6], at[7], at[8], taps[:wc])  # [n, w, wc]
        resized = torch.bmm(along_y, crops.view(n, hc, 3 * wc)).view(n, h * 3, wc)
        resized = torch.bmm(resized, along_x.transpose(1, 2)).view(n, h, 3, w).permute(0, 2, 1, 3)
        _write(out, [int(places[j]) for j in group], resized.round_().clamp_(0, 255), rows)


def _write(out: torch.Tensor, rows: List[int], values: torch.Tensor, on_device: Optional[torch.Tensor] = None) -> None:
    """out[rows] = values (cast to out's dtype): one copy into a view when ``rows`` are consecutive,
    else one indexed write (``on_device``: the rows already on out's device)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        out[rows[0] : rows[0] + len(rows)].copy_(values)
        return
    index = on_device if on_device is not None else torch.tensor(rows, device=out.device)
    out[index] = values.to(out.dtype)


def _one_layout(images: List[torch.Tensor]) -> List[torch.Tensor]:
    """``images`` (3xHxW) all planar (CxHxW in memory, nvJPEG's) or all interleaved (HxWxC, the CPU
    decoders'), as the first is: the odd ones out (a CPU fallback among nvJPEG's) copied."""
    planar = images[0].is_contiguous()

    def fits(image: torch.Tensor) -> bool:
        return image.is_contiguous() if planar else image.permute(1, 2, 0).is_contiguous()

    if all(fits(image) for image in images):
        return images
    if planar:
        return [image if fits(image) else image.contiguous() for image in images]
    return [image if fits(image) else image.permute(1, 2, 0).contiguous().permute(2, 0, 1) for image in images]


def _flat(image: torch.Tensor) -> torch.Tensor:
    """A 3xHxW image's pixel values in memory order, as a 1-D view (planar or interleaved)."""
    return image.reshape(-1) if image.is_contiguous() else image.permute(1, 2, 0).reshape(-1)


def _groups(heights: np.ndarray, widths: np.ndarray, limit: int) -> List[np.ndarray]:
    """The images resampled together: all at once when their padded crops hold at most ``limit``
    values, else runs of similar heights (tallest first) that each do."""
    if len(heights) * int(heights.max()) * int(widths.max()) * 3 <= limit:
        return [np.arange(len(heights))]
    groups: List[np.ndarray] = []
    current: List[int] = []
    widest = 0
    for j in np.argsort(-heights, kind="stable").tolist():
        wider = max(widest, int(widths[j]))
        if current and (len(current) + 1) * int(heights[current[0]]) * wider * 3 > limit:
            groups.append(np.array(current))
            current, wider = [], int(widths[j])
        current.append(j)
        widest = wider
    groups.append(np.array(current))
    return groups


def _to_device(arrays: List[np.ndarray], device: torch.device) -> List[torch.Tensor]:
    """int64 and float32 host arrays on ``device`` in one copy (from pinned memory on CUDA), as views
    of one buffer with their shapes and dtypes."""
    spans, total = [], 0
    for array in arrays:
        words = array.size if array.dtype == np.int64 else (array.size + 1) // 2  # float32s, two a word
        spans.append((total, words))
        total += words
    host = torch.empty(total, dtype=torch.int64, pin_memory=device.type == "cuda")
    words_ = host.numpy()
    for array, (start, words) in zip(arrays, spans):
        if array.dtype == np.int64:
            words_[start : start + words] = array.ravel()
        else:
            words_[start : start + words].view(np.float32)[: array.size] = array.ravel()
    moved = host.to(device, non_blocking=True)
    views = []
    for array, (start, words) in zip(arrays, spans):
        part = moved[start : start + words]
        if array.dtype != np.int64:
            part = part.view(torch.float32)[: array.size]
        views.append(part.view(array.shape))
    return views


def restored(state: torch.Tensor) -> Optional[torch.Generator]:
    """The CPU generator of a batch's ``state`` (None: empty).  Copied first: ``set_state`` reads a
    tensor's storage from its start, so a view into a larger buffer (a worker's slot) would give
    it the bytes before the state."""
    if not state.numel():
        return None
    generator = torch.Generator()
    generator.set_state(torch.from_numpy(state.cpu().numpy().copy()))
    return generator


def mixed_sizes(reader: Reader, i: int, size: Sequence[int], batch_size: Sequence[int],
                fields: bool = False) -> PackedFormatError:
    """The error for sample i, of (height, width) ``size``, in a batch of images of ``batch_size``
    (``fields``: of a loader with fields, whose transform is a torchvision v2 one: ``one_size_hint``)."""
    return PackedFormatError(
        reader.path,
        f"image is {size[0]}x{size[1]}, other images of the batch are {batch_size[0]}x{batch_size[1]}",
        index=i,
        key=reader.key(i),
        hint=one_size_hint(fields),
    )


def one_size_hint(fields: bool) -> str:
    """What gives a batch of images of one size, or lists of images each of its own size: the ways that fit
    a loader with fields (a torchvision v2 transform of each sample's dict) or one without."""
    crop = ("a torchvision v2 transform that starts with RandomResizedCrop (cut while decoding) or ends at one "
            "size (Resize + CenterCrop)" if fields else
            "a transform that starts with a crop (pf.transforms.train or val, cut while decoding), or a "
            "per-image torchvision transform that ends at one size")
    return (f"resize every image at decode with make_loader(..., size=(height, width)), use {crop}, or pass "
            "size='own' for batches of images each of its own size (as lists)")


def decoder_error() -> Optional[str]:
    """Why the JPEG decoder (``image_decode.decoder()``) cannot decode here (missing, built without its
    image extension, or no longer shipped), or None when it decodes a small JPEG."""
    try:
        jpeg = codecs.encode(np.zeros((8, 8, 3), dtype=np.uint8), "jpeg", 90)
        decode_jpegs([torch.frombuffer(bytearray(jpeg), dtype=torch.uint8)], torch.device("cpu"))
    except Exception as exc:  # ImportError, or RuntimeError from a build without its image ops
        return repr(exc)
    return None


def check_decoder() -> None:
    """ValueError unless the JPEG decoder works here: without it every image would go to the CPU
    fallback, one at a time."""
    error = decoder_error()
    if error is not None:
        raise ValueError(f"decode='device' needs a JPEG decoder ({image_decode.describe()}), which fails here "
                         f"({error}); pip install packed_formats[torchcodec], or use decode='workers'")


def decode_jpegs(blobs: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    """JPEG bytes (1-D uint8 CPU tensors) as 3xHxW uint8 RGB on ``device``, in one call of the
    decoder (``image_decode``; batched nvJPEG on CUDA); RuntimeError or ValueError when it refuses one."""
    return image_decode.decode(blobs, "RGB", device)

"""One whole batch per DataLoader item: read, decode, and (for the CPU) transform.

A worker reads a batch's samples with one ``Reader.read_many`` straight into a
uint8 [B,H,W,C] buffer, whose [B,C,H,W] view is channels-last; encoded samples
are decoded into the same buffer.  It hands back the batch in the loader's
memory format (contiguous NCHW unless channels-last is asked for: converted
once, here, into the memory the batch is sent in), an int64 label tensor and
the samples' indices.  The Reader applies the verify policy.  Batches leave a
worker in a shared-memory slot it reuses once the main process has dropped the batch
(``slots.BatchSlots``: images, labels and indices in one slot, which the main process
maps once; or ``memory.SlotPool``): the read (archive -> slot), or the transform's
result, is written once and sent without a copy.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, cast

import numpy as np
import torch

from .. import codecs, memory, policy
from ..backends.reader import Reader
from ..errors import CorruptSampleError, PackedFormatError
from ..handles import ProcessLocal
from ..memory import SentBatch, SlotPool
from ..policy import Skipped
from ..transforms import apply_with_labels
from ..transforms.at_decode import CropAtDecode, split_at_decode
from ..transforms.labels import takes_labels
from ..transforms.ops import each_image, is_batch_transform
from . import device_decode
from .device_decode import EncodedBatch
from .field_batches import BatchFields, Where, apply_per_sample
from .image_lists import join
from .mixture import mixture_of, raw_reads
from .sampling import BatchPlan, batch_seed, seed_globals
from .slots import BatchSlots

# (images, labels, left out, indices), and with fields the batch's fields (``BatchFields.pack``); with
# own_sizes, (images joined, labels, left out, indices, the fields or None, the images' shapes) (``image_lists``)
Item = Tuple[Any, ...]


class FailedBatch(NamedTuple):
    """A worker's batch that failed with one of this library's errors, returned instead of raised.

    torch re-raises a worker's exception in the main process by calling its class on the
    message, so ``.path``, ``.index`` and ``.key`` of a ``CorruptSampleError`` would be lost;
    returned, the error is pickled whole, and the loader raises it (``raised``).
    """

    error: PackedFormatError
    trace: str  # the worker's traceback

    def raised(self) -> PackedFormatError:
        """The error, its cause the worker's traceback (as ``raise ... from`` would set it)."""
        self.error.__cause__ = WorkerTraceback(f"raised in a DataLoader worker:\n{self.trace.rstrip()}")
        return self.error


class WorkerTraceback(Exception):
    """The cause shown under an error a worker raised: its traceback there, as text."""


Bad = List[Tuple[int, Skipped]]  # (position in the batch, what was wrong), for on_error="skip"


class BatchReader(torch.utils.data.Dataset):
    """Reads (and on the CPU transforms) one whole batch per ``BatchPlan``.

    Args:
        reader: the archive, opened with the loader's verify policy.
        size: (height, width) encoded images are resized to at decode.
        resize_mode: how they are resized ("stretch" or "shorter-side-center-crop").
        transform: batch transform run on the read batch (None: none).
        on_error: "raise" at a bad sample, or "skip" it (reported with the batch).
        seed, rank: where each batch's random generator comes from (``sampling.batch_seed``).
        pin: read into pinned memory (for a CUDA copy from this process).
        pool: the workers' shared-memory slots (None without workers): ``slots.BatchSlots`` (a batch
            leaves as the numbers of the slots it lies in) or ``memory.SlotPool`` (as shared tensors).
        memory_format: the layout of the [B,C,H,W] batches handed back (None: as read or
            transformed, a channels-last view for reads; another device converts them there).
        send: what an encoded archive's batches leave as: "batches" (finished: decoded, and on the
            CPU transformed), "bytes" (``EncodedBatch``es of checked JPEG bytes with their crops
            drawn, for the main process to decode on its device, ``device_decode``; other images
            decoded and cut here) or "crops" (``EncodedBatch``es of images decoded and cut here,
            for a device that does the rest).  With "bytes" or "crops" the transform is only
            read for its first crop.
        fields: the sample fields each batch carries too (``field_batches``): read for the samples
            the batch keeps, cut with their images, and transformed with them per sample (the
            transform then a torchvision v2 transform of a sample's dict).
        own_sizes: each image keeps its own size (``make_loader(size="own")``): decoded whole (or cut by
            a crop-first transform), transformed on its own, and sent joined (``image_lists``).

    An encoded archive read with neither ``size`` nor a first crop, whose transform takes one image (or
    one sample's dict) at a time, is decoded image by image at each one's size, so that the transform
    may bring images of different sizes to one (``_each_batch``).

    Pickles as its reader's description (path, index), never an open handle.
    """

    def __init__(
        self,
        reader: Reader,
        *,
        size: Optional[Tuple[int, int]] = None,
        resize_mode: str = "stretch",
        transform: Optional[Callable] = None,
        on_error: str = "raise",
        seed: int = 0,
        rank: int = 0,
        pin: bool = False,
        pool: "SlotPool | BatchSlots | None" = None,
        memory_format: Optional[torch.memory_format] = None,
        send: str = "batches",
        fields: Optional[BatchFields] = None,
        own_sizes: bool = False,
    ) -> None:
        self.reader, self.size, self.transform, self.memory_format = reader, size, transform, memory_format
        self.resize_mode, self.fields = resize_mode, fields
        self.on_error, self.seed, self.rank, self.pin, self.pool = on_error, seed, rank, pin, pool
        # an encoded archive with no decode size does the transform's first crop while decoding
        self.at_decode = split_at_decode(transform) if reader.mode != "raw" and size is None else None
        self.send = send if reader.mode != "raw" else "batches"
        self.own_sizes = own_sizes
        # images read one by one at their own sizes (``_each_batch``)
        self.each = self.send == "batches" and (own_sizes or decodes_each(reader, size, transform, fields is not None))
        # which samples the device may decode, found once per loader (1: a JPEG the strict check read
        # whole): a byte each, in memory every worker shares, so that no sample is checked twice
        self.taken = torch.zeros(len(reader) if self.send == "bytes" else 0, dtype=torch.uint8).share_memory_()
        shape = reader.manifest.shape
        self.channels = 3 if shape is None else shape[2]
        self._buffers = ProcessLocal(memory.ReusedBuffers)  # this process's read buffers

    def __len__(self) -> int:
        return len(self.reader)

    def keep_buffers(self, keep: int) -> None:
        """Keep up to ``keep`` read buffers for reuse in each process (batches read side by side by threads
        each need one, besides those their caller still holds)."""
        self._buffers = ProcessLocal(functools.partial(memory.ReusedBuffers, keep))

    def __getitem__(self, plan: BatchPlan) -> "Item | FailedBatch":
        try:
            if self.pool is None:
                return self._batch(plan)
            try:
                if isinstance(self.pool, BatchSlots):  # the whole batch in this worker's slots, sent as their numbers
                    return self.pool.hand_back(self._batch(plan), self.reader.path)
                images, labels, skipped, indices, *fields = self._batch(plan)
                sent: "SentBatch | EncodedBatch"
                if isinstance(images, torch.Tensor):
                    sent = self.pool.send(images)
                else:  # the JPEG bytes and the crops cut here go in slots too (a slot unpickles as its tensor)
                    data, host = (cast(torch.Tensor, self.pool.send(t)) for t in (images.data, images.host))
                    sent = images._replace(data=data, host=host)
                return memory.hand_back((sent, labels, skipped, indices, *fields), self.reader.path)
            finally:
                self.pool.end_batch()
        except PackedFormatError as exc:
            if torch.utils.data.get_worker_info() is None:
                raise
            return FailedBatch(exc, traceback.format_exc())

    def _batch(self, plan: BatchPlan) -> Item:
        idx = self.reader.check_indices(plan.indices)
        transform, seed, generator = self.transform, 0, None
        if transform is not None:  # the batch's randomness: crops at decode draw from it first
            seed = batch_seed(self.seed, plan.epoch, self.rank, plan.number)
            generator = torch.Generator().manual_seed(seed)
        if self.send != "batches":
            encoded, kept, skipped = self._for_device(idx, generator)
            labels = torch.from_numpy(np.ascontiguousarray(self.reader.labels[idx[kept]]))
            return encoded, labels, tuple(s[1] for s in skipped), encoded.indices
        if self.each:
            return self._each_batch(idx, transform, seed, generator)
        wheres: List[Optional[Where]] = [None] * len(idx)
        if self.reader.mode == "raw":
            images, skipped = self._read_raw(idx)
        elif self.at_decode is not None:
            crop, transform = self.at_decode
            images, skipped, wheres = self._read_encoded(idx, crop, generator)
        else:
            images, skipped, wheres = self._read_encoded(idx)
        if self.fields is not None:  # their values next, a sample whose fields fail left out as one whose image does
            values = self._read_fields(idx, wheres, [(int(images.shape[1]), int(images.shape[2]))] * len(idx),
                                       skipped)
        keep = np.setdiff1d(np.arange(len(idx)), [s[0] for s in skipped]) if skipped else None
        images = images.permute(0, 3, 1, 2)  # [B,C,H,W] view, channels last in memory
        if keep is not None:
            images = images[torch.from_numpy(keep)]
            idx = idx[keep]
        labels = torch.from_numpy(np.ascontiguousarray(self.reader.labels[idx]))
        if self.fields is not None:
            kept_values = [values[j] for j in (range(len(values)) if keep is None else keep.tolist())]
            return self._with_fields(images, labels, idx, kept_values, skipped, transform, seed)
        if transform is not None and generator is not None:
            images, labels = self._transform(transform, images, labels, seed, generator)
        images = self._in_layout(images)
        return images, labels, tuple(s[1] for s in skipped), torch.from_numpy(np.array(idx, dtype=np.int64))

    def _read_fields(self, idx: np.ndarray, wheres: Sequence[Optional[Where]], canvases: Sequence[Tuple[int, int]],
                     skipped: Bad) -> List[Any]:
        """Each sample's fields (``BatchFields.read``; ``canvases``: the (height, width) of each image as
        read, what a field taken as stored must be), None for a sample already left out; with on_error="skip"
        one whose fields fail is left out too (noted in ``skipped``)."""
        fields, left_out = cast(BatchFields, self.fields), {j for j, _ in skipped}
        values: List[Any] = []
        for j, (i, where) in enumerate(zip(idx.tolist(), wheres)):
            value = None
            if j not in left_out:
                try:
                    value = fields.read(self.reader, i, where, canvases[j])
                except CorruptSampleError as exc:
                    if self.on_error == "raise":
                        raise
                    skipped.append((j, self._skipped(exc, i)))
            values.append(value)
        skipped.sort(key=lambda s: s[0])
        return values

    def _with_fields(self, images: torch.Tensor, labels: torch.Tensor, idx: np.ndarray, values: List[Any],
                     skipped: Bad, transform: Optional[Callable], seed: int) -> Item:
        """The batch with its fields: the transform (a v2 transform of each sample's dict) run on each
        sample, then the fields packed to leave as few tensors (``BatchFields.pack``)."""
        fields = cast(BatchFields, self.fields)
        if transform is not None:  # v2 transforms draw from torch's global generator: seeded by the batch
            each, values = self._seeded(seed, lambda: apply_per_sample(transform, fields, images, labels, values,
                                                                       stack=False))
            images = self._stacked(each, idx) if each else images
        try:
            packed = fields.pack(values)
        except ValueError as exc:
            raise PackedFormatError(self.reader.path, str(exc)) from None
        return (self._in_layout(images), labels, tuple(s[1] for s in skipped),
                torch.from_numpy(np.array(idx, dtype=np.int64)), packed)

    def _each_batch(self, idx: np.ndarray, transform: Optional[Callable], seed: int,
                    generator: Optional[torch.Generator]) -> Item:
        """The batch read image by image at each one's size (a crop-first transform still cuts while
        decoding), the transform run on each image (or sample's dict, with fields) on its own; then the
        images listed (``own_sizes``: joined, with their shapes) or stacked, which needs one size."""
        wheres: List[Optional[Where]] = [None] * len(idx)
        pictures: List[Optional[torch.Tensor]]
        if self.reader.mode == "raw":
            read, skipped = self._read_raw(idx)
            pictures = list(read)
        elif self.at_decode is not None:
            crop, transform = self.at_decode
            read, skipped, wheres = self._read_encoded(idx, crop, generator)
            pictures = list(read)
        else:
            pictures, skipped = self._decode_each(idx)
        canvases = [(1, 1) if p is None else (int(p.shape[0]), int(p.shape[1])) for p in pictures]
        values = self._read_fields(idx, wheres, canvases, skipped) if self.fields is not None else None
        left_out = {j for j, _ in skipped}
        kept = [j for j in range(len(idx)) if j not in left_out]
        images = [cast(torch.Tensor, pictures[j]).permute(2, 0, 1) for j in kept]  # [C,H,W] views
        idx = idx[np.array(kept, dtype=np.int64)]
        labels = torch.from_numpy(np.ascontiguousarray(self.reader.labels[idx]))
        kept_values = None if values is None else [values[j] for j in kept]
        if transform is not None:
            images, kept_values = self._seeded(seed, functools.partial(
                _per_image, transform, self.fields, images, labels, kept_values))
        left = tuple(s[1] for s in sorted(skipped))
        indices = torch.from_numpy(np.array(idx, dtype=np.int64))
        batch: Optional[torch.Tensor] = None
        if not self.own_sizes:  # one size, or an error naming each sample's
            batch = self._stacked(images, idx) if images else torch.empty((0, self.channels, 0, 0), dtype=torch.uint8)
        packed: Any = None
        try:
            if kept_values is not None:
                packed = cast(BatchFields, self.fields).pack(kept_values, own_sizes=self.own_sizes)
            if batch is None:
                flat, shapes = join([image.contiguous() for image in images])
                return flat, labels, left, indices, packed, shapes
        except ValueError as exc:
            raise PackedFormatError(self.reader.path, str(exc)) from None
        return (self._in_layout(batch), labels, left, indices) + (() if self.fields is None else (packed,))

    def _decode_each(self, idx: np.ndarray) -> Tuple[List[Optional[torch.Tensor]], Bad]:
        """Each image of the batch decoded whole at its own size (HxWxC), None for one left out."""
        found, skipped = self._encoded_blobs(idx)
        pictures: List[Optional[torch.Tensor]] = []
        for j, (i, blob) in enumerate(zip(idx.tolist(), found)):
            pixels = None if blob is None else self._decoded(blob, i, j, None, skipped)
            if pixels is not None and not pixels.flags.writeable:  # a decoder's read-only array: torch needs its own
                pixels = pixels.copy()
            pictures.append(None if pixels is None else torch.from_numpy(pixels))
        return pictures, skipped

    def _seeded(self, seed: int, run: Callable[[], Any]) -> Any:
        """``run()``, the per-sample transforms in it drawing from torch's global generator seeded by the
        batch (in the main process without touching its own generator's state)."""
        if torch.utils.data.get_worker_info() is not None:
            seed_globals(seed ^ 0x5EED)
            return run()
        with torch.random.fork_rng(devices=[]), one_torch_thread():
            torch.manual_seed(seed ^ 0x5EED)
            return run()

    def _stacked(self, images: Sequence[torch.Tensor], idx: np.ndarray) -> torch.Tensor:
        """The transformed images as one batch; a PackedFormatError naming each sample's size when they
        differ, with the ways that give a batch of one size (or lists)."""
        if len({tuple(image.shape) for image in images}) <= 1:
            return torch.stack(list(images))
        sizes = ", ".join(f"{i} ({self.reader.key(i)!r}): {'x'.join(map(str, image.shape))}"
                          for i, image in zip(idx.tolist(), images))
        raise PackedFormatError(
            self.reader.path, f"the transform gave the batch's images different sizes (sample: [C,H,W]) {sizes}; "
                              "a batch of one tensor needs one size",
            hint=device_decode.one_size_hint(self.fields is not None))

    def _transform(self, transform: Callable, images: torch.Tensor, labels: torch.Tensor, seed: int,
                   generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        """``transform`` on the batch (and its labels, for MixUp/CutMix), its randomness from the batch's
        seed and generator, its result in reused memory."""
        if torch.utils.data.get_worker_info() is not None:  # workers run one torch thread already
            seed_globals(seed ^ 0x5EED)
            return apply_with_labels(transform, images, labels, generator, self._result_memory(images))
        with one_torch_thread():
            return apply_with_labels(transform, images, labels, generator, self._buffers.get().take)

    def _result_memory(self, images: torch.Tensor) -> Optional[memory.Allocate]:
        """Where a worker's transform puts its result: in a slot when the batches are contiguous
        NCHW (the fused train pass writes that itself; a transform that keeps its input's
        channels-last layout is converted into a second slot) or when the input is already in
        the batches' layout, else in a reused buffer that ``_in_layout`` converts into a slot from."""
        if self.pool is None:
            return None
        if self.memory_format in (None, torch.contiguous_format) or images.is_contiguous(
            memory_format=self.memory_format
        ):  # the fused train pass writes contiguous NCHW itself: its result is the batch sent
            return self.pool.take
        return self._buffers.get().take

    def _in_layout(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` in ``memory_format``: as they are when already so, else copied once, into a
        shared-memory slot in a worker (so that the batch still leaves without another copy)."""
        layout = self.memory_format
        if layout is None or images.dim() != 4 or images.is_contiguous(memory_format=layout):
            return images
        shape = tuple(images.shape)
        out = None if self.pool is None else self.pool.take(shape, images.dtype, layout)
        if out is None:
            out = self._buffers.get().take(shape, images.dtype, layout)
        return copy_between_layouts(out, images)

    def _reads_in_layout(self) -> bool:
        """Whether a read batch (a channels-last view of [B,H,W,C]) is already in ``memory_format``."""
        return self.memory_format in (None, torch.channels_last) or self.channels == 1

    def _new_buffer(self, shape: Tuple[int, ...]) -> torch.Tensor:
        """A uint8 [B,H,W,C] tensor to read a batch into.

        In a worker with nothing to do after the read (no transform, no layout
        to change), a reused shared-memory slot (the batch then reaches the
        main process without a copy); pinned
        when a GPU waits for it; otherwise one of this process's reused
        buffers (``memory.ReusedBuffers``: never one a batch still in use lives in).
        """
        if self.transform is None and self._reads_in_layout():
            return self._sent_buffer(shape)
        if self.pin:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        return self._buffers.get().take(shape)

    def _sent_buffer(self, shape: Tuple[int, ...]) -> torch.Tensor:
        """A uint8 tensor that leaves as it is: a shared-memory slot in a worker (else pinned for a
        GPU, else one of this process's reused buffers)."""
        slot = None if self.pool is None else self.pool.take(shape)
        if slot is not None:
            return slot
        if self.pin:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        return self._buffers.get().take(shape)

    # ---- raw ----
    def _read_raw(self, idx: np.ndarray) -> Tuple[torch.Tensor, Bad]:
        """The batch's samples as a [B,H,W,C] tensor: read as stored, or (``_reads_planar``) parted into
        channels on the way into the memory the batch is sent in, the tensor then a view of it."""
        mixture = raw_reads(self.reader, idx)  # a mixture's: each source reads its samples, at its shape
        if mixture is not None:
            (h, w, c), read_many, read_planar = mixture
        else:
            (h, w, c), read_many, read_planar = self._raw_shape(), self.reader.read_many, self.reader.read_many_planar
        if self._reads_planar():
            planar = self._sent_buffer((len(idx), c, h, w))
            return planar.permute(0, 2, 3, 1), self._read_raw_into(idx, planar.numpy(), read_planar)
        buffer = self._new_buffer((len(idx), h, w, c))
        return buffer, self._read_raw_into(idx, buffer.numpy(), read_many)

    def _read_raw_into(self, idx: np.ndarray, out: np.ndarray, read: Callable[..., Any]) -> Bad:
        """``read(idx, out=out)``; with on_error="skip", sample by sample once a sample fails (those left out)."""
        try:
            read(idx, out=out)
            return []
        except CorruptSampleError:
            if self.on_error == "raise":
                raise
        skipped = []
        for j, i in enumerate(idx.tolist()):  # slow path: find the bad ones
            try:
                read(idx[j : j + 1], out=out[j : j + 1])
            except CorruptSampleError as exc:
                skipped.append((j, self._skipped(exc, i)))
        return skipped

    def _reads_planar(self) -> bool:
        """Whether a raw batch is read straight into contiguous NCHW: the batch as sent, when it is
        sent as read (no transform, no fields) in that layout.  Its one copy out of the archive then
        parts the channels too, where a read as stored would need a second pass to transpose it.  A
        planar archive's batch (``raw_layout`` "chw") is read so also for a device that takes it as
        read (no ``memory_format``): a plain copy, and already the NCHW batch the device wants."""
        if self.channels == 1 or self.transform is not None or self.fields is not None:
            return False
        planar = self.reader.manifest.raw_layout == "chw"
        return self.memory_format == torch.contiguous_format or (planar and self.memory_format is None)

    def _raw_shape(self) -> Tuple[int, int, int]:
        shape = self.reader.manifest.shape
        if shape is None:
            raise PackedFormatError(self.reader.path, "a raw archive whose manifest gives no sample shape")
        return shape

    # ---- encoded ----
    def _read_encoded(
        self, idx: np.ndarray, crop: Optional[CropAtDecode] = None, generator: Optional[torch.Generator] = None
    ) -> Tuple[torch.Tensor, Bad, List[Optional[Where]]]:
        """Decode the batch: each image whole (resized to ``size`` if given), or only ``crop``'s box of it.
        With fields, also where each image came from (the box of its stored image, its stored size, the
        output size: the same cut applies to its masks), None for an image taken as stored."""
        found, skipped = self._encoded_blobs(idx)
        blobs = list(found)
        crops = None if crop is None else self._crop_plan(crop, idx, blobs, skipped, generator)
        wheres: List[Optional[Where]] = [None] * len(idx)
        if self.fields is not None and (crops is not None or self.size is not None):
            if crops is not None:
                boxes, sizes, out = crops
            else:  # resized whole: the box its resize mode keeps
                sizes, out = self._stored_sizes(idx, blobs, skipped), cast(Tuple[int, int], self.size)
                boxes = device_decode.resize_boxes(sizes, out, self.resize_mode)
            wheres = [((b[0], b[1], b[2], b[3]), (s[0], s[1]), out) for b, s in zip(boxes.tolist(), sizes.tolist())]
        buffer = None
        for j, (i, blob) in enumerate(zip(idx.tolist(), blobs)):
            pixels = None if blob is None else self._decoded(blob, i, j, crops, skipped)
            if pixels is None:
                continue
            if buffer is None:
                buffer = self._new_buffer((len(idx),) + pixels.shape)
            self._put(buffer, j, pixels, i)
        if buffer is None:  # every sample was bad
            h, w = self.size or (0, 0)
            buffer = self._new_buffer((len(idx), h, w, self.channels))
        return buffer, sorted(skipped), wheres

    def _encoded_blobs(self, idx: np.ndarray) -> Tuple[Sequence[Optional[bytes]], Bad]:
        """The stored bytes of idx; with on_error="skip", None where a read fails."""
        try:
            return cast(List[bytes], self.reader.read_many(idx)), []
        except CorruptSampleError:
            if self.on_error == "raise":
                raise
        blobs: List[Optional[bytes]] = []
        skipped = []
        for j, i in enumerate(idx.tolist()):
            try:
                blobs.append(self.reader.read_bytes(i))
            except CorruptSampleError as exc:
                blobs.append(None)
                skipped.append((j, self._skipped(exc, i)))
        return blobs, skipped

    def _crop_plan(self, crop: CropAtDecode, idx: np.ndarray, blobs: List[Optional[bytes]], skipped: Bad,
                   generator: Optional[torch.Generator]) -> Tuple[np.ndarray, np.ndarray, Tuple[int, int]]:
        """(each image's crop box, its stored (width, height), the output size): the boxes drawn in
        the sizes read from the images' headers."""
        sizes = self._stored_sizes(idx, blobs, skipped)
        return crop.boxes(sizes[:, 1].copy(), sizes[:, 0].copy(), generator), sizes, crop.size

    def _stored_sizes(self, idx: np.ndarray, blobs: List[Optional[bytes]], skipped: Bad) -> np.ndarray:
        """int64 [B,2]: each image's stored (width, height), from its header.  An image whose header
        does not read is skipped or raises here, as a failed decode would (1x1 for those left out)."""
        sizes = np.ones((len(idx), 2), dtype=np.int64)
        for j, (i, blob) in enumerate(zip(idx.tolist(), blobs)):
            if blob is None:
                continue
            try:
                sizes[j] = policy.image_size(blob)
            except codecs.DecodeError as exc:
                error = self.reader.sample_error(i, str(exc))
                if self.on_error == "raise":
                    raise error from None
                blobs[j] = None
                skipped.append((j, self._skipped(error, i)))
        return sizes

    def _for_device(self, idx: np.ndarray, generator: Optional[torch.Generator]
                    ) -> Tuple[EncodedBatch, np.ndarray, Bad]:
        """(the batch for the device, the places in ``idx`` of the images it holds, those left out): the
        bytes of the JPEGs the device decodes (``device_decode.takes``; none when sending "crops"), the
        others decoded here; each image's box drawn or computed in its stored size."""
        found, skipped = self._encoded_blobs(idx)
        blobs = list(found)
        boxes: Optional[np.ndarray] = None
        size: Optional[Tuple[int, int]] = None
        if self.at_decode is not None or self.size is not None:
            sizes = self._stored_sizes(idx, blobs, skipped)
            if self.at_decode is not None:
                crop = self.at_decode[0]
                boxes, size = crop.boxes(sizes[:, 1].copy(), sizes[:, 0].copy(), generator), crop.size
            else:
                size = self.size
                boxes = device_decode.resize_boxes(sizes, cast(Tuple[int, int], size), self.resize_mode)
        kept: List[int] = []
        sent: List[Optional[bytes]] = []
        taken = self.taken.numpy()
        host_at: List[int] = []
        host: "List[np.ndarray] | torch.Tensor" = []
        if self.send == "crops" and size is not None:  # every image is cut here: straight into what is sent
            host = self._sent_buffer((len(idx), size[0], size[1], 3))
        for j, (i, blob) in enumerate(zip(idx.tolist(), blobs)):
            if blob is None:
                continue
            if self.send == "bytes" and not taken[i] and device_decode.takes(blob):
                taken[i] = 1  # its CRC holds it to these bytes from now on
            if self.send == "crops" or not taken[i]:
                pixels = self._decoded(blob, i, j, None if boxes is None or size is None else (boxes, sizes, size),
                                       skipped)
                if pixels is None:
                    continue
                if isinstance(host, torch.Tensor):
                    host.numpy()[len(host_at)] = pixels
                else:
                    host.append(pixels)
                host_at.append(len(kept))
                blob = None
            kept.append(j)
            sent.append(blob)
        places = np.array(kept, dtype=np.int64)
        if isinstance(host, torch.Tensor):
            host = host[: len(host_at)]
        encoded = device_decode.pack(sent, None if boxes is None else boxes[places], size, host_at, host,
                                     idx[places], generator)
        return encoded, places, sorted(skipped)

    def _decoded(self, blob: bytes, i: int, j: int, crops: Optional[Tuple[np.ndarray, np.ndarray, Tuple[int, int]]],
                 skipped: Bad) -> Optional[np.ndarray]:
        """Image j of the batch (sample i) decoded, only its box where ``crops`` (boxes, stored sizes,
        output size) are given; None when it is bad and skipped (noted in ``skipped``)."""
        try:
            if crops is None:
                return self._decode(blob, i)
            boxes, sizes, out_size = crops
            return self._decode_crop(blob, i, boxes[j], out_size, (int(sizes[j, 0]), int(sizes[j, 1])))
        except CorruptSampleError as exc:
            if self.on_error == "raise":
                raise
            skipped.append((j, self._skipped(exc, i)))
            return None

    def _decode_crop(self, blob: bytes, i: int, box: np.ndarray, size: Tuple[int, int],
                     stored: Tuple[int, int]) -> np.ndarray:
        """One image's crop box, decoded at the least scale that covers it and resized to ``size``."""
        try:
            top, left, height, width = (int(v) for v in box)
            return policy.decode_crop(blob, self.channels, (top, left, height, width), size, stored)
        except codecs.DecodeError as exc:
            raise self.reader.sample_error(i, str(exc)) from None

    def _decode(self, blob: bytes, i: int) -> np.ndarray:
        """Encoded bytes -> HxWxC uint8, resized to ``size`` if given; CorruptSampleError if they do not decode."""
        try:
            return policy.decode(blob, self.channels, self.size, self.resize_mode)
        except codecs.DecodeError as exc:
            raise self.reader.sample_error(i, str(exc)) from None

    def _put(self, buffer: torch.Tensor, j: int, pixels: np.ndarray, i: int) -> None:
        if pixels.shape != tuple(buffer.shape[1:]):
            raise device_decode.mixed_sizes(self.reader, i, pixels.shape[:2], tuple(buffer.shape[1:3]),
                                            fields=self.fields is not None)
        buffer.numpy()[j] = pixels

    def _skipped(self, exc: CorruptSampleError, i: int) -> Skipped:
        """What was left out: a mixture's sample by its source's file and its index and key there (as
        its error says, and ``return_index`` gives it), any other by the archive's."""
        if exc.path is not None and exc.index is not None and mixture_of(self.reader) is not None:
            return Skipped(exc.path, exc.index, exc.key or self.reader.key(i), exc.problem)
        return Skipped(self.reader.path, i, self.reader.key(i), exc.problem)


def decodes_each(reader: Reader, size: Optional[Tuple[int, int]], transform: Optional[Callable],
                 fields: bool) -> bool:
    """Whether an encoded archive's images are decoded one by one, each at its own size, for ``transform`` to
    run on each (``BatchReader._each_batch``): no decode size, no first crop (that one is cut while
    decoding), and a transform of one image at a time (with ``fields``, any: it gets each sample's dict)."""
    return (reader.mode != "raw" and size is None and transform is not None and split_at_decode(transform) is None
            and (fields or not (is_batch_transform(transform) or takes_labels(transform))))


def _per_image(transform: Callable, fields: Optional[BatchFields], images: List[torch.Tensor], labels: torch.Tensor,
               values: Optional[List[Any]]) -> Tuple[List[torch.Tensor], Optional[List[Any]]]:
    """``transform`` on each image on its own (with fields, on each sample's dict: ``apply_per_sample``):
    the images it gave, and the fields.  TypeError for a result that is not a tensor."""
    if fields is not None and values is not None:
        return apply_per_sample(transform, fields, images, labels, values, stack=False)
    outputs = each_image(transform, images, "make_loader takes each image's result as a [C,H,W] tensor")
    return [output.as_subclass(torch.Tensor) for output in outputs], values


def copy_between_layouts(out: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``out[...] = source`` for tensors of one shape in different memory layouts, through numpy where
    it can: uint8 NHWC -> NCHW ran ~7x faster than torch's ``copy_`` (~10 ms against ~75 ms for
    128x3x256x256 on one thread), float32 about as fast."""
    try:
        np.copyto(out.numpy(), source.numpy())
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), or a tensor that needs grad
        out.copy_(source)
    return out


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the per-sample CPU transforms of the main process on one intra-op thread.

    Their ops are small (one image each), and splitting each over threads costs
    more than it gains: train(224) on 256x256 batches ran at ~2,700 images/s
    with one thread and ~1,900 with two on a 2-core machine.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

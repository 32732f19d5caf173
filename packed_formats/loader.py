"""make_loader: whole-batch reads, batched transforms, device prefetch, ranks.

Each DataLoader item is a whole batch.  A sampler in the main process yields
``(epoch, batch number, sample indices)``; a worker reads those samples with
one ``Reader.read_many`` straight into a uint8 [B,H,W,C] buffer, and hands back
its [B,C,H,W] channels-last view plus an int64 label tensor.  Encoded archives
decode each sample into the same buffer.  Batches leave a worker in a shared
memory slot that the worker reuses once the main process has dropped the batch
(``memory.SlotPool``): the read (archive -> slot) is the one copy, and no batch
pays for faulting in fresh shared pages.

On the CPU the transform runs in the workers; on a GPU it runs on the device
after a ``non_blocking`` copy from pinned memory on a side stream, ``prefetch``
batches ahead.  Randomness comes from a generator seeded by (seed, epoch, rank,
batch number): reproducible, distinct per batch, worker, epoch and rank, and
independent of ``num_workers``.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import warnings
from collections import deque
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image

from . import codecs, memory
from .backends import open_archive
from .backends.base import Reader
from .errors import CorruptSampleError, PackedFormatError
from .memory import SlotPool
from .transforms import BatchTransform

VERIFY_POLICIES = (True, False, "once")
ON_ERROR = ("raise", "skip")


class SkippedSampleWarning(UserWarning):
    """Bad samples were dropped from a batch (``on_error="skip"``)."""


class Skipped(NamedTuple):
    """One sample dropped from a batch: where it is and what was wrong."""

    path: str
    index: int
    key: str
    problem: str


class BatchPlan(NamedTuple):
    epoch: int
    number: int
    indices: np.ndarray


# ---- which samples, in which order, on which rank -----------------------------------------
def shard_indices(
    n: int, *, epoch: int = 0, seed: int = 0, shuffle: bool = True, rank: int = 0, world_size: int = 1,
    drop_last: bool = False,
) -> np.ndarray:
    """This rank's sample order for one epoch, exactly as ``DistributedSampler`` splits it.

    Every rank draws the same permutation (``torch.randperm`` seeded with
    ``seed + epoch``).  With several ranks and ``drop_last=False`` the order is
    padded by repeating its first samples until it divides evenly, so up to
    ``world_size - 1`` samples are seen twice per epoch; with ``drop_last=True``
    the tail is dropped instead.  Rank r takes every world_size-th sample from r.
    """
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).numpy()
    else:
        order = np.arange(n, dtype=np.int64)
    if world_size > 1:
        if drop_last:
            order = order[: (n // world_size) * world_size]
        else:
            total = math.ceil(n / world_size) * world_size
            order = np.concatenate([order, np.resize(order, total - n)]) if total > n else order
        order = order[rank::world_size]
    return order


class BatchSampler(torch.utils.data.Sampler):
    """Yields one ``BatchPlan`` per batch of this rank's share of an epoch."""

    def __init__(self, n: int, batch_size: int, shuffle: bool, drop_last: bool, seed: int, rank: int, world_size: int):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.n, self.batch_size, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch = 0

    def _order(self) -> np.ndarray:
        return shard_indices(
            self.n, epoch=self.epoch, seed=self.seed, shuffle=self.shuffle, rank=self.rank,
            world_size=self.world_size, drop_last=self.drop_last,
        )

    def __iter__(self) -> Iterator[BatchPlan]:
        order, bs = self._order(), self.batch_size
        stop = len(order) - len(order) % bs if self.drop_last else len(order)
        return iter([BatchPlan(self.epoch, k, order[s : s + bs]) for k, s in enumerate(range(0, stop, bs))])

    def __len__(self) -> int:
        per_rank = len(self._order())
        return per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)


def batch_seed(seed: int, epoch: int, rank: int, number: int) -> int:
    """A 64-bit seed for one batch, mixed from (seed, epoch, rank, batch number)."""
    state = np.random.SeedSequence([seed, epoch, rank, number]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 32 | int(state[1])


def batch_generator(seed: int, epoch: int, rank: int, number: int) -> torch.Generator:
    """The CPU generator for one batch's random transforms."""
    return torch.Generator().manual_seed(batch_seed(seed, epoch, rank, number))


def _seed_globals(seed: int) -> None:
    """Seed this process's global RNGs (random, numpy, torch) for user callables."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---- the worker side: one batch -----------------------------------------------------------------
class BatchReader(torch.utils.data.Dataset):
    """Reads (and on the CPU transforms) one whole batch per ``BatchPlan``.

    Pickles as its reader's description (path, index), never an open handle.
    """

    def __init__(
        self,
        reader: Reader,
        *,
        verify: Union[bool, str] = "once",
        size: Optional[Tuple[int, int]] = None,
        transform: Optional[Callable] = None,
        on_error: str = "raise",
        seed: int = 0,
        rank: int = 0,
        pin: bool = False,
        pool: Optional[SlotPool] = None,
    ) -> None:
        self.reader, self.verify, self.size, self.transform = reader, verify, size, transform
        self.on_error, self.seed, self.rank, self.pin, self.pool = on_error, seed, rank, pin, pool
        shape = reader.manifest.shape
        self.channels = 3 if shape is None else shape[2]
        self._verified: Optional[np.ndarray] = None
        self._verified_pid: Optional[int] = None
        self._buffers: Optional[Tuple[int, memory.ReusedBuffers]] = None  # (pid, this process's read buffers)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_buffers"] = None  # memory of this process only
        return state

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, plan: BatchPlan) -> Tuple[torch.Tensor, torch.Tensor, Tuple[Skipped, ...]]:
        if self.pool is None:
            return self._batch(plan)
        try:
            images, labels, skipped = self._batch(plan)
            return self.pool.send(images), labels, skipped
        finally:
            self.pool.end_batch()

    def _batch(self, plan: BatchPlan) -> Tuple[torch.Tensor, torch.Tensor, Tuple[Skipped, ...]]:
        idx = self.reader.check_indices(plan.indices)
        if self.reader.mode == "raw":
            images, skipped = self._read_raw(idx)
        else:
            images, skipped = self._read_encoded(idx)
        keep = np.setdiff1d(np.arange(len(idx)), [s[0] for s in skipped]) if skipped else None
        images = images.permute(0, 3, 1, 2)  # [B,C,H,W] view, channels last in memory
        if keep is not None:
            images = images[torch.from_numpy(keep)]
            idx = idx[keep]
        labels = torch.from_numpy(np.ascontiguousarray(self.reader.labels[idx]))
        if self.transform is not None:
            images = self._transform(images, plan)
        return images, labels, tuple(s[1] for s in skipped)

    def _transform(self, images: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
        seed = batch_seed(self.seed, plan.epoch, self.rank, plan.number)
        generator = torch.Generator().manual_seed(seed)
        if torch.utils.data.get_worker_info() is not None:  # workers run one torch thread already
            _seed_globals(seed ^ 0x5EED)
            with memory.outputs_in(None if self.pool is None else self.pool.take):
                return apply_transform(self.transform, images, generator)  # float results born in a slot
        with _one_torch_thread(), memory.outputs_in(self._process_buffers().take):
            return apply_transform(self.transform, images, generator)

    def _new_buffer(self, shape: Tuple[int, ...]) -> torch.Tensor:
        """A uint8 [B,H,W,C] tensor to read a batch into.

        In a worker with nothing to do after the read, a reused shared-memory
        slot (the batch then reaches the main process without a copy); pinned
        when a GPU waits for it; otherwise one of this process's reused
        buffers (``memory.ReusedBuffers``: never one a batch still in use lives in).
        """
        if self.pool is not None and self.transform is None:
            slot = self.pool.take(shape)
            if slot is not None:
                return slot
        if self.pin:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        return self._process_buffers().take(shape)

    def _process_buffers(self) -> memory.ReusedBuffers:
        if self._buffers is None or self._buffers[0] != os.getpid():
            self._buffers = (os.getpid(), memory.ReusedBuffers())
        return self._buffers[1]

    # ---- raw ----
    def _read_raw(self, idx: np.ndarray) -> Tuple[torch.Tensor, list]:
        buffer = self._new_buffer((len(idx),) + tuple(self.reader.manifest.shape))
        out = buffer.numpy()
        try:
            self.reader.read_many(idx, out=out)
            for j, i in enumerate(idx):
                self._check(int(i), out[j])
            return buffer, []
        except CorruptSampleError:
            if self.on_error == "raise":
                raise
        skipped = []
        for j, i in enumerate(idx):  # slow path: find the bad ones
            try:
                self.reader.read_many(idx[j : j + 1], out=out[j : j + 1])
                self._check(int(i), out[j])
            except CorruptSampleError as exc:
                skipped.append((j, self._skipped(exc, int(i))))
        return buffer, skipped

    # ---- encoded ----
    def _read_encoded(self, idx: np.ndarray) -> Tuple[torch.Tensor, list]:
        blobs, skipped = self._encoded_blobs(idx)
        buffer = None
        for j, (i, blob) in enumerate(zip(idx.tolist(), blobs)):
            if blob is None:
                continue
            try:
                self._check(i, blob)
                pixels = self._decode(blob, i)
            except CorruptSampleError as exc:
                if self.on_error == "raise":
                    raise
                skipped.append((j, self._skipped(exc, i)))
                continue
            if buffer is None:
                buffer = self._new_buffer((len(idx),) + pixels.shape)
            self._put(buffer, j, pixels, i)
        if buffer is None:  # every sample was bad
            h, w = self.size or (0, 0)
            buffer = self._new_buffer((len(idx), h, w, self.channels))
        return buffer, sorted(skipped)

    def _encoded_blobs(self, idx: np.ndarray) -> Tuple[list, list]:
        """The stored bytes of idx; with on_error="skip", None where a read fails."""
        try:
            return self.reader.read_many(idx), []
        except CorruptSampleError:
            if self.on_error == "raise":
                raise
        blobs, skipped = [], []
        for j, i in enumerate(idx.tolist()):
            try:
                blobs.append(self.reader.read_bytes(i))
            except CorruptSampleError as exc:
                blobs.append(None)
                skipped.append((j, self._skipped(exc, i)))
        return blobs, skipped

    def _decode(self, blob: bytes, i: int) -> np.ndarray:
        """Encoded bytes -> HxWxC uint8, resized to ``size`` if given (JPEG draft mode first)."""
        mode = "L" if self.channels == 1 else "RGB"
        size = None if self.size is None else (self.size[1], self.size[0])  # PIL's (width, height)
        try:
            image = codecs.open_image(blob, draft=None if size is None else (mode, size))  # DCT scaling first
        except codecs.DecodeError as exc:
            raise self.reader._corrupt(str(exc), i) from None
        if size is not None and image.size != size:
            image = image.convert(mode).resize(size, Image.BILINEAR)
        return codecs.pil_to_array(image, self.channels)

    def _put(self, buffer: torch.Tensor, j: int, pixels: np.ndarray, i: int) -> None:
        if pixels.shape != tuple(buffer.shape[1:]):
            h, w = pixels.shape[:2]
            raise PackedFormatError(
                self.reader.path,
                f"image is {h}x{w}, other images of the batch are {buffer.shape[1]}x{buffer.shape[2]}",
                index=i,
                key=self.reader.index.key(i),
                hint="images of different sizes need make_loader(..., size=(height, width))",
            )
        buffer.numpy()[j] = pixels

    # ---- checks ----
    def _check(self, i: int, blob: Any) -> None:
        """Checksum sample i per the verify policy ("once": first read in this process)."""
        if self.verify is False:
            return
        if self.verify == "once":
            if self._verified_pid != os.getpid():
                self._verified, self._verified_pid = np.zeros(len(self.reader), dtype=bool), os.getpid()
            if self._verified[i]:
                return
            self.reader._check_crc(i, blob)
            self._verified[i] = True
        else:
            self.reader._check_crc(i, blob)

    def _skipped(self, exc: CorruptSampleError, i: int) -> Skipped:
        return Skipped(self.reader.path, i, self.reader.index.key(i), exc.problem)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
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


def apply_transform(transform: Callable, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Call a batch transform, passing the generator to ours."""
    if isinstance(transform, BatchTransform):
        return transform(images, generator=generator)
    return transform(images)


def _keep(item: Any) -> Any:
    """collate_fn: a worker's batch is already a batch."""
    return item


class _WorkerInit:
    """Picklable worker_init_fn (spawn/forkserver need one)."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank = seed, rank

    def __call__(self, worker_id: int) -> None:
        """Give each worker distinct global RNG states before its first batch."""
        _seed_globals(int(np.random.SeedSequence([self.seed, self.rank, worker_id, 0x5EED]).generate_state(1)[0]))


# ---- the main-process side ------------------------------------------------------------------------
def copy_then_transform(host: Iterator, device: torch.device, transform: Optional[Callable],
                        generators: Callable[[int], torch.Generator]) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Host batches moved with a plain (blocking, unpinned) ``.to(device)``, then transformed there.

    What a device other than CUDA gets, and the benchmark's reference for what
    pinned memory and side-stream prefetch buy on CUDA.
    """
    for k, (images, labels) in enumerate(host):
        images, labels = images.to(device), labels.to(device)
        if transform is not None:
            images = apply_transform(transform, images, generators(k))
        yield images, labels


class CudaPrefetcher:
    """Copies pinned host batches to a CUDA device on a side stream, ``prefetch`` ahead.

    Each batch's copy is followed by an event; the consumer's stream waits on
    that event, and the device tensors are marked as used by the consumer's
    stream (record_stream) so the caching allocator never reuses them early.
    """

    def __init__(self, batches: Iterator, device: torch.device, prefetch: int, transform=None, seeds=None) -> None:
        self.batches, self.device, self.prefetch = batches, device, max(1, prefetch)
        self.transform, self.seeds = transform, seeds
        self.stream = torch.cuda.Stream(device=device)
        self.queue: deque = deque()
        self.number = 0

    def _issue(self) -> bool:
        try:
            images, labels = next(self.batches)
        except StopIteration:
            return False
        with torch.cuda.stream(self.stream):
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.queue.append((images, labels, done))
        return True

    def __iter__(self) -> "CudaPrefetcher":
        return self

    def __next__(self) -> Tuple[torch.Tensor, torch.Tensor]:
        while len(self.queue) < self.prefetch and self._issue():
            pass
        if not self.queue:
            raise StopIteration
        images, labels, done = self.queue.popleft()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        images.record_stream(current)
        labels.record_stream(current)
        self._issue()
        if self.transform is not None:
            images = apply_transform(self.transform, images, self.seeds(self.number))
        self.number += 1
        return images, labels


class PackedLoader:
    """An iterable of ``(images, labels)`` batches on ``device``; see ``make_loader``."""

    def __init__(self, reader_ds: BatchReader, sampler: BatchSampler, loader: torch.utils.data.DataLoader,
                 device: torch.device, transform: Optional[Callable], prefetch: int) -> None:
        self.batch_reader, self.sampler, self.dataloader = reader_ds, sampler, loader
        self.device, self.transform, self.prefetch = device, transform, prefetch
        self.skipped: List[Skipped] = []
        self._next_epoch: Optional[int] = None

    @property
    def reader(self) -> Reader:
        return self.batch_reader.reader

    @property
    def classes(self) -> List[str]:
        return self.reader.classes

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Use this epoch for the next iteration (otherwise each iteration adds one)."""
        self._next_epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        if self._next_epoch is not None:
            self.sampler.epoch = self._next_epoch
        self._next_epoch = self.sampler.epoch + 1
        if self.dataloader.num_workers and not self.dataloader.persistent_workers:
            # new workers: a new pool, so that states left by the last ones (batches still
            # in flight when they stopped) neither block nor mislead them
            self.batch_reader.pool = SlotPool(self.dataloader.num_workers, min_bytes=self.batch_reader.pool.min_bytes)
        host = self._host_batches(iter(self.dataloader))
        if self.device.type == "cuda":
            epoch, seed, rank = self.sampler.epoch, self.batch_reader.seed, self.batch_reader.rank
            return CudaPrefetcher(
                host, self.device, self.prefetch, self.transform, lambda k: batch_generator(seed, epoch, rank, k)
            )
        if self.device.type != "cpu":
            return self._plain_copy(host)
        return host

    def _host_batches(self, batches: Iterator) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        for images, labels, skipped in batches:
            if skipped:
                self._warn(skipped)
            if len(labels):
                yield images, labels

    def _plain_copy(self, host: Iterator) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        epoch, seed, rank = self.sampler.epoch, self.batch_reader.seed, self.batch_reader.rank
        return copy_then_transform(host, self.device, self.transform, lambda k: batch_generator(seed, epoch, rank, k))

    def _warn(self, skipped: Sequence[Skipped]) -> None:
        self.skipped.extend(skipped)
        where = "; ".join(f"[sample index {s.index}, key {s.key!r}] {s.problem}" for s in skipped)
        warnings.warn(
            SkippedSampleWarning(f"{skipped[0].path}: skipped {len(skipped)} bad sample(s) of a batch: {where}"),
            stacklevel=3,
        )

    def __repr__(self) -> str:
        return (f"PackedLoader({self.reader!r}, batch_size={self.batch_size}, batches={len(self)}, "
                f"device={self.device}, workers={self.dataloader.num_workers})")


# ---- building one ---------------------------------------------------------------------------------------
def _open_reader(source: Any, format: Optional[str]) -> Reader:
    """A Reader with per-read checks off (the loader applies its own verify policy)."""
    reader = getattr(source, "reader", source)
    if isinstance(reader, Reader):
        if getattr(source, "transform", None) is not None:
            raise ValueError("make_loader applies batch transforms: pass transform= to make_loader, not the dataset")
        return open_archive(reader.path, format=reader.format_name, verify=False)
    if isinstance(source, (str, os.PathLike)):
        return open_archive(source, format=format, verify=False)
    raise TypeError(f"make_loader needs an archive path, a PackedDataset or a Reader, got {type(source).__name__}")


def _rank_and_world(distributed: Optional[bool]) -> Tuple[int, int]:
    ready = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed is None:
        distributed = ready
    if not distributed:
        return 0, 1
    if not ready:
        raise ValueError("distributed=True needs torch.distributed.init_process_group() to be called first")
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def resolve_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` as a torch.device with its CUDA index; ValueError when CUDA is asked for but absent."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but torch.cuda.is_available() is False")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def make_loader(
    source: Any,
    batch_size: int = 256,
    shuffle: bool = True,
    num_workers: int = 2,
    device: Union[str, torch.device] = "cpu",
    transform: Optional[Callable] = None,
    drop_last: bool = False,
    distributed: Optional[bool] = None,
    seed: int = 0,
    prefetch: int = 2,
    *,
    size: Optional[Union[int, Tuple[int, int]]] = None,
    on_error: str = "raise",
    verify: Union[bool, str] = "once",
    format: Optional[str] = None,
    persistent_workers: bool = True,
    multiprocessing_context: Any = None,
) -> PackedLoader:
    """A fast loader of whole ``(images, labels)`` batches from an archive.

    Args:
        source: archive path (any format, auto-detected), a PackedDataset or a Reader.
        batch_size, shuffle, drop_last: as for DataLoader (drop_last drops the short last batch).
        num_workers: worker processes, each reading whole batches (0: read in this process).
        device: where batches end up; "cuda" pins host batches and copies them on a side stream.
        transform: a batch transform (``pf.transforms``) or any callable on a uint8
            [B,C,H,W] batch; runs in the workers for the CPU, on the device otherwise.
        distributed: split samples over torch.distributed ranks (None: when initialised);
            see ``shard_indices`` for the split and its padding.
        seed: base seed of shuffling and of the transforms' randomness.
        prefetch: batches copied to a CUDA device ahead of use.
        size: (height, width) every encoded image is resized to at decode (bilinear, aspect
            ratio not kept; JPEGs are first decoded at a reduced DCT scale when that is still
            at least ``size``, which is much cheaper); needed when an encoded archive's images
            differ in size.  Raw archives keep their stored shape (use a transform).
        on_error: "raise" (default) or "skip": drop samples that fail their checksum or
            decode from their batch, with a SkippedSampleWarning naming them.
        verify: CRC32-check each sample the first time a process reads it ("once", the
            default: full safety on the first epoch, and persistent workers then skip the
            ~50% extra cost a CRC adds to a raw read), on every read (True) or never (False).
        format: insist on this archive format.
        persistent_workers: keep workers (and their open handles) across epochs.
        multiprocessing_context: "fork", "spawn", "forkserver" or None (torch's default).

    Images are uint8 [B,C,H,W] (channels-last in memory) unless the transform
    changes them; labels are int64 [B].  ``len(loader)`` is the number of
    batches per epoch on this rank.  Raises PackedFormatError for bad archives.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    if verify not in VERIFY_POLICIES:
        raise ValueError(f"verify must be one of {VERIFY_POLICIES}, got {verify!r}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    device = resolve_device(device)
    reader = _open_reader(source, format)
    size = _check_size(reader, size)
    rank, world = _rank_and_world(distributed)
    on_cpu = device.type == "cpu"
    sampler = BatchSampler(len(reader), batch_size, shuffle, drop_last, seed, rank, world)
    batch_reader = BatchReader(
        reader, verify=verify, size=size, transform=transform if on_cpu else None, on_error=on_error,
        seed=seed, rank=rank, pin=device.type == "cuda" and num_workers == 0,
        pool=SlotPool(num_workers) if num_workers > 0 else None,
    )
    loader = torch.utils.data.DataLoader(
        batch_reader,
        batch_size=None,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=_keep,
        pin_memory=device.type == "cuda" and num_workers > 0,
        persistent_workers=persistent_workers and num_workers > 0,
        multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
        worker_init_fn=_WorkerInit(seed, rank),
    )
    return PackedLoader(batch_reader, sampler, loader, device, None if on_cpu else transform, prefetch)


def _check_size(reader: Reader, size: Optional[Union[int, Tuple[int, int]]]) -> Optional[Tuple[int, int]]:
    if size is None:
        return None
    h, w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    if h <= 0 or w <= 0:
        raise ValueError(f"size must be positive, got {size}")
    if reader.mode == "raw" and (h, w) != tuple(reader.manifest.shape[:2]):
        raise ValueError(
            f"{reader.path}: a raw archive holds {reader.manifest.shape[0]}x{reader.manifest.shape[1]} images; "
            "size= only applies to encoded archives (use a Resize transform)"
        )
    return h, w

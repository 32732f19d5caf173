"""make_loader: whole-batch reads, batched transforms, device prefetch, ranks.

Each DataLoader item is a whole batch.  A sampler in the main process plans
``(epoch, batch number, sample indices)`` (``sampling``); a worker reads those
samples in one go and, for the CPU, transforms them (``worker``); the main
process moves batches to a GPU ahead of use and transforms them there
(``device``).  This module puts the three together, and saves and restores
where an epoch stands (``PackedLoader.state_dict``) to resume it exactly.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import warnings
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .. import storage
from ..archives import open_archive
from ..backends.reader import Reader
from ..backends.sharded import given_max_open_parts
from ..checksum import array_crc32
from ..errors import DataLoaderWorkerError, PackedFormatError
from ..memory import SlotPool
from ..policy import (
    ON_ERROR,
    RESIZE_MODES,
    VERIFY_POLICIES,
    Skipped,
    SkippedSampleWarning,
    VerifyPolicy,
    check_choice,
    check_on_error,
    check_verify,
)
from ..tracebacks import release_frames
from ..transforms import apply_transform, batchwise, with_memory_format
from ..transforms.at_decode import split_at_decode
from ..transforms.labels import takes_labels
from ..transforms.ops import is_batch_transform
from . import slots, temp_dir
from .aspect_groups import GroupByAspectRatio
from .dataset import PackedDataset
from .device import CudaPrefetcher, copy_then_transform, resolve_device
from .device_decode import DeviceDecoder, check_decoder
from .field_batches import BatchFields, refuse_batch_transforms
from .image_lists import OWN, split
from .mixture import Mixture, MixtureBackend, check_source, mixture_of
from .resume import (
    STATE_VERSION,
    StateSpec,
    archive_identity,
    position_state,
    read_state,
    saved_settings,
    window_settings,
)
from .sampling import (
    DEFAULT_WINDOW,
    BatchPlan,
    BatchSampler,
    EpochPosition,
    Shuffle,
    WorkerInit,
    batch_count,
    batch_generator,
    batch_seed,
    check_shuffle,
    rank_and_world_size,
    shard_indices,
    share_length,
)
from .slots import BatchSlots
from .threads import GatherThreads, gathers_in_threads
from .worker import BatchReader, FailedBatch, decodes_each
from .worker_context import worker_context

__all__ = [
    "ON_ERROR",
    "VERIFY_POLICIES",
    "BatchPlan",
    "BatchReader",
    "BatchSampler",
    "CudaPrefetcher",
    "PackedLoader",
    "Skipped",
    "SkippedSampleWarning",
    "apply_transform",
    "batch_generator",
    "batch_seed",
    "copy_then_transform",
    "make_loader",
    "resolve_device",
    "shard_indices",
]

Batch = Tuple[torch.Tensor, torch.Tensor]  # (images, labels)
MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last)
DECODE_PLACES = ("workers", "device")


class PackedLoader:
    """An iterable of ``(images, labels)`` batches on ``device``; see ``make_loader``.

    ``state_dict()`` / ``load_state_dict()`` save and restore where the epoch
    stands, so that a new process continues it exactly (see ``state_dict``).

    It stands in for a ``DataLoader`` in code written for one: ``len(loader)``,
    ``loader.dataset`` (a ``PackedDataset`` of the archive, with ``classes`` and
    ``targets``), ``batch_size``, ``num_workers``, ``drop_last`` and
    ``loader.sampler.set_epoch(epoch)``.  It is no DataLoader subclass, so
    Lightning leaves it as it is (no DistributedSampler put in): it splits
    itself over the ranks of torch.distributed when each epoch starts.

    Build it with ``make_loader``; the constructor takes the parts that puts together:

    Args:
        batch_reader: the ``BatchReader`` the workers read (and transform) whole batches with.
        sampler: the ``BatchSampler`` that plans each epoch's batches.
        loader: the DataLoader over ``batch_reader`` and ``sampler`` (or the ``GatherThreads`` in its place).
        device: where batches end up.
        transform: what runs on ``device`` after the copy (None: nothing, or all done in the workers).
        prefetch: batches copied to a CUDA device ahead of use.
        distributed: split over torch.distributed's ranks (None: when initialised).
        placement: (rank, world size) given to ``make_loader``, or None.
        memory_format, return_index: as for ``make_loader``.
        dataset: the ``PackedDataset`` given to ``make_loader``, if one was (else made on first use).
        decoder: the ``DeviceDecoder`` of ``decode="device"`` and of crops made in the workers for a GPU.
    """

    KIND = "PackedLoader"

    def __init__(self, batch_reader: BatchReader, sampler: BatchSampler,
                 loader: "torch.utils.data.DataLoader | GatherThreads", device: torch.device,
                 transform: Optional[Callable], prefetch: int,
                 distributed: Optional[bool] = None, placement: Optional[Tuple[int, int]] = None, *,
                 memory_format: torch.memory_format = torch.contiguous_format, return_index: bool = False,
                 dataset: Optional[PackedDataset] = None, decoder: Optional[DeviceDecoder] = None) -> None:
        self.batch_reader, self.sampler, self.dataloader = batch_reader, sampler, loader
        self.decoder = decoder
        self._device, self.transform, self.prefetch = device, transform, prefetch
        self.distributed, self.placement = distributed, placement
        self.memory_format, self.return_index, self._dataset = memory_format, return_index, dataset
        sampler.call_on_set_epoch(self.set_epoch)  # loader.sampler.set_epoch, as code written for DataLoader calls it
        self.skipped: List[Skipped] = []
        self._next_epoch: Optional[int] = None
        self._resume: Optional[EpochPosition] = None  # loaded: where the next pass starts
        self._pass: Optional[EpochPosition] = None  # the pass in progress: ``done`` counts batches handed out
        self._identity: Optional[Dict[str, Any]] = None
        # each pass's DataLoader iterator -> the slots its workers send in (kept while they may still send)
        self._pass_slots: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_pass_slots", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pass_slots = weakref.WeakKeyDictionary()
        if isinstance(self.batch_reader.pool, BatchSlots):  # slots of this process's own, received here
            self.batch_reader.pool = self.batch_reader.pool.renewed()
        self.sampler.call_on_set_epoch(self.set_epoch)

    @property
    def device(self) -> torch.device:
        """Where batches end up.  "cuda" with no index is the current CUDA device when each pass starts,
        as for ``tensor.to("cuda")``: a loader built before ``torch.cuda.set_device(local_rank)`` (at
        module level, or handed to Lightning before it sets each rank's device) follows it."""
        return resolve_device(self._device)

    @property
    def reader(self) -> Reader:
        return self.batch_reader.reader

    @property
    def classes(self) -> List[str]:
        """The class names labels number: the archive's, or a ``Mixture``'s (merged, or each source's own
        after the previous sources', as its ``classes`` says)."""
        return self.reader.classes

    @property
    def mixture(self) -> Optional[MixtureBackend]:
        """The sources of a ``Mixture`` this loader reads (``names``, ``parts``: their readers, ``draw``,
        ``class_offsets``), or None for one archive."""
        return mixture_of(self.reader)

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress (after ``load_state_dict``: the one the next pass resumes)."""
        return self.sampler.epoch

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    @property
    def drop_last(self) -> bool:
        return self.sampler.drop_last

    @property
    def num_workers(self) -> int:
        return self.dataloader.num_workers

    @property
    def worker_kind(self) -> Optional[str]:
        """What makes the batches besides this process's own thread: "processes" (DataLoader's workers),
        "threads" (``num_workers`` threads of this process, for batches that are only a copy:
        ``threads``), or None (``num_workers=0``: this thread, batch by batch)."""
        if not self.dataloader.num_workers:
            return None
        return "threads" if isinstance(self.dataloader, GatherThreads) else "processes"

    @property
    def dataset(self) -> PackedDataset:
        """The archive as a Dataset (the one make_loader was given, else one over this loader's reader):
        what code written for a DataLoader reads ``len``, ``classes`` and ``targets`` from."""
        if self._dataset is None:
            self._dataset = PackedDataset(self.reader, output="tensor")
        return self._dataset

    def set_epoch(self, epoch: int) -> None:
        """Use this epoch for the next iteration (otherwise each iteration adds one).

        After ``load_state_dict`` the same epoch keeps the resume; another starts
        that epoch from its beginning (and ``state_dict`` then says so).
        """
        self._next_epoch = int(epoch)
        if self._resume is not None and self._resume.epoch != self._next_epoch:
            self._resume = None
        if self._pass is not None and self._pass.epoch != self._next_epoch:
            self._pass = None

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank."""
        self._find_rank()
        return self.sampler.split_batches()

    def _find_rank(self) -> None:
        """Take this process's rank and world size now, not when the loader was built: a loader made
        before the process group (at module level, or handed to Lightning before ``fit``) is sharded too."""
        rank, world = self.placement or rank_and_world_size(self.distributed)
        if (rank, world) != (self.sampler.rank, self.sampler.world_size):
            self.sampler.rank, self.sampler.world_size = rank, world
            self.batch_reader.rank = rank
            init = self.dataloader.worker_init_fn
            if isinstance(init, WorkerInit):
                init.rank = rank

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, ...]]:
        """This pass's batches.  The pass (its epoch, ranks and order) begins with the first batch
        asked for, so ``set_epoch`` between ``iter()`` and it still counts: Lightning calls
        ``iter`` before ``sampler.set_epoch`` when it starts or resumes training."""
        try:
            yield from self._pass_batches()
        except PackedFormatError as error:  # kept by its catcher, it must not keep the loader and its workers
            release_frames(error)
            del self
            raise

    def _pass_batches(self) -> Iterator[Tuple[torch.Tensor, ...]]:
        position = self._begin_pass()
        pool = self.batch_reader.pool
        if isinstance(pool, BatchSlots):
            self._slots_for_pass(pool)
        elif pool is not None and self.dataloader.num_workers and not self.dataloader.persistent_workers:
            # new workers: a new pool, so that states left by the last ones (batches still
            # in flight when they stopped) neither block nor mislead them
            self.batch_reader.pool = SlotPool(self.dataloader.num_workers, min_bytes=pool.min_bytes)
        numbers: List[int] = []  # the place in this rank's share of each batch handed on
        # the sample indices of the batches not yet handed out, their fields (``BatchFields.pack``) or None,
        # and with size="own" their images' shapes (``image_lists``)
        indices: Deque[Tuple[Any, ...]] = deque()
        workers = iter(self.dataloader)
        if isinstance(self.batch_reader.pool, BatchSlots):
            self._pass_slots[workers] = self.batch_reader.pool
        host = self._host_batches(workers, position.done, numbers, indices)
        target = self.device
        if target.type == "cpu" and self.decoder is None:
            return self._handed_out(host, position, numbers, indices)
        epoch, seed, rank, first = position.epoch, self.batch_reader.seed, self.batch_reader.rank, position.first_batch

        def generators(k: int) -> torch.Generator:  # the k-th batch of the pass: seeded by its batch number
            return batch_generator(seed, epoch, rank, first + numbers[k])

        device: Iterator[Batch]
        if target.type == "cuda":
            device = CudaPrefetcher(host, target, self.prefetch, self.transform, generators, self.memory_format,
                                    self.decoder)
        else:
            device = copy_then_transform(host, target, self.transform, generators, self.memory_format, self.decoder)
        return self._handed_out(device, position, numbers, indices)

    def _slots_for_pass(self, pool: BatchSlots) -> None:
        """Make ready the slots this pass's workers send in.  The same slots serve pass after pass (the
        main process maps each once), fresh workers or not; those whose batches were lost with workers
        that stopped are freed first.  While workers of another pass still run with them (an unfinished
        pass of fresh workers, or those left of a pass a worker died in), this pass gets slots of its own."""
        loader = self.dataloader
        assert isinstance(loader, torch.utils.data.DataLoader)  # slots are worker processes' only
        current = getattr(loader, "_iterator", None)
        if current is not None and getattr(current, "_shutdown", False):
            loader._iterator = current = None  # its workers stopped: fresh ones, not a reset of those
        if current is not None:
            return  # the same persistent workers go on: what they sent last pass torch receives (and drops) first
        passes = list(self._pass_slots.items())
        if any(used is pool and not getattr(workers, "_shutdown", True) for workers, used in passes):
            self.batch_reader.pool = pool.renewed()
            return
        pool.reclaim()

    def _pass_left(self, workers: Iterator) -> None:
        """A pass ended (its last batch, a ``break``, an error): fresh workers stop now, and the slots of
        batches they sent that never arrived are freed.  After a worker died, the others stop when torch
        lets their iterator go (not here: the dead one may hold the lock of their stop event), and the
        next pass starts fresh workers."""
        pool = self._pass_slots.get(workers)
        if pool is None:
            return
        loader = self.dataloader
        assert isinstance(loader, torch.utils.data.DataLoader)  # slots are worker processes' only
        if any(not process.is_alive() for process in getattr(workers, "_workers", ())):
            if getattr(loader, "_iterator", None) is workers:
                loader._iterator = None
            return
        if not loader.persistent_workers and not getattr(workers, "_shutdown", True):
            workers._shutdown_workers()  # type: ignore[attr-defined]
        if getattr(workers, "_shutdown", False):
            pool.reclaim()

    def _begin_pass(self) -> EpochPosition:
        """Where the pass now starting begins: a loaded state's position, or the next epoch's start."""
        self._find_rank()
        if self._resume is not None:
            position, self._resume = self._resume, None
        else:
            epoch = self._next_epoch if self._next_epoch is not None else self.sampler.epoch
            position = EpochPosition(epoch, world_size=self.sampler.world_size)
        self.sampler.place(position)
        self._next_epoch = position.epoch + 1
        self._pass = dataclasses.replace(position)
        return self._pass

    def _host_batches(self, batches: Iterator, first: int, numbers: List[int],
                      indices: Deque[Tuple[Any, ...]]) -> Iterator[Batch]:
        try:
            for number, item in enumerate(_naming_dead_workers(batches, self.reader.path), first):
                if isinstance(item, FailedBatch):
                    error = item.raised()
                    del item
                    try:
                        raise error
                    finally:  # no reference from this frame to the error, whose traceback holds the frame: a
                        del error  # cycle would keep the DataLoader and its workers alive until the collector runs
                images, labels, skipped, index, *fields = item
                del item
                if skipped:
                    self._warn(skipped)
                if len(labels):
                    numbers.append(number)
                    indices.append((index, *(fields or [None])))
                    yield images, labels
                del images, labels, index  # a batch the caller dropped gives its slot back at once
        finally:
            self._pass_left(batches)

    def _handed_out(self, batches: Iterator[Batch], position: EpochPosition, numbers: List[int],
                    indices: Deque[Tuple[Any, ...]]) -> Iterator[Any]:
        """``batches``, counting in ``position`` those handed to the caller (not those merely prefetched),
        with their samples' indices (on the CPU) when ``return_index``; with size="own", the images as a
        list of views of the joined tensor they came in (``image_lists``).

        A pass left early (a ``break``) keeps its count: its state is the rest of its epoch.
        """
        fields = self.batch_reader.fields
        for k, batch in enumerate(batches):
            position.done = numbers[k] + 1  # batches left empty by skipped samples count as done
            index, packed, *shapes = indices.popleft()  # batches come out in the order they went in, prefetched or not
            if self.mixture is not None:  # (source, index in it) of each sample
                index = torch.from_numpy(self.mixture.source_and_index(index.numpy()))
            out: Tuple[Any, ...] = batch
            if shapes:  # size="own": the images as the list of their views
                out = (split(batch[0], shapes[0]), *batch[1:])
            if fields is not None:
                yield self._as_dict(fields, out, packed, index)
            else:
                yield (*out, index) if self.return_index else out
        position.done = self.sampler.split_batches(position.start)

    def _as_dict(self, fields: BatchFields, batch: Tuple[torch.Tensor, ...], packed: Any,
                 index: torch.Tensor) -> Dict[str, Any]:
        """A batch with fields as the dict it is handed out as: ``image``, ``label``, each field (on the
        batch's device; see ``field_batches``), and ``index`` when ``return_index``."""
        images, labels = batch[0], batch[1]
        out: Dict[str, Any] = {"image": images, "label": labels}
        if isinstance(images, list):  # size="own": each image's own canvas
            canvases = [(int(image.shape[-2]), int(image.shape[-1])) for image in images]
            out.update(fields.unpack(packed, canvases, labels.device))
        else:
            out.update(fields.unpack(packed, (int(images.shape[-2]), int(images.shape[-1])), images.device))
        if self.return_index:
            out["index"] = index
        return out

    def _warn(self, skipped: Sequence[Skipped]) -> None:
        self.skipped.extend(skipped)
        files = {s.path for s in skipped}  # more than one: a mixture's sources, each entry says its own
        where = "; ".join(f"[{'' if len(files) == 1 else f'{s.path}, '}sample index {s.index}, key {s.key!r}] "
                          f"{s.problem}" for s in skipped)
        source = skipped[0].path if len(files) == 1 else f"{len(files)} files"
        warnings.warn(
            SkippedSampleWarning(f"{source}: skipped {len(skipped)} bad sample(s) of a batch: {where}"),
            stacklevel=4,
        )

    # ---- resuming ---------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Where this rank's epoch stands: a small JSON-serialisable dict to save with the model.

        It counts the batches handed to the caller so far in this epoch (batches
        the workers or the CUDA prefetch made ahead are not counted: they will
        be made again), with the epoch, the split of the epoch over the ranks,
        the seed, shuffle, drop_last, batch size, number of samples, the
        archive's identity (count, classes, CRC32 of its labels) and a format
        version.  Saved after the last batch of an epoch, or between epochs,
        it points at the start of the next epoch; saved after a ``break`` out
        of an epoch, at the rest of that epoch.  In a distributed run every
        rank's state is the same when taken at the same step, so rank 0's is enough.
        """
        self._find_rank()
        state: Dict[str, Any] = {"kind": self.KIND, "version": STATE_VERSION,
                                 **position_state(self._position(), "batches")}
        state.update(saved_settings(self._settings()), rank=self.sampler.rank, archive=self._archive())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next pass continue the epoch ``state`` was taken in, exactly.

        On as many ranks as when it was saved, each rank continues its own share
        with the batches it had left, in the same order, with the same batch
        numbers and so the same random transform draws, and later epochs are
        those of an uninterrupted run.  On another number of ranks, the
        positions of the epoch's global order that no rank had delivered
        (after k batches of B on each of W ranks: all from k*B*W on) are split
        over the new ranks like ``DistributedSampler`` splits an epoch: every
        remaining sample once (with drop_last=False plus up to world_size - 1
        repeated to even the ranks out, with drop_last=True less the tail
        drop_last leaves out); later epochs are those of a run on that many
        ranks.  Not reproduced then: which rank sees which sample, the batches'
        composition, and so the augmentation draws and batch statistics.

        After it, ``loader.epoch`` is the epoch the next ``iter(loader)`` resumes.

        Raises:
            ValueError: ``state`` is not a PackedLoader state, was saved by a newer
                version, for another archive, or with another batch size, seed,
                shuffle, window or drop_last, or a field is missing, unknown, of another
                type or out of range (the message names it).
        """
        self._find_rank()
        n, world = self.sampler.n, self.sampler.world_size
        spec = StateSpec(self.KIND, "batches", self._settings(), self.batch_size, world, self._archive())
        saved = read_state(state, spec)
        started = 0 < saved.done < batch_count(share_length(n - saved.start, saved.world_size, self.drop_last),
                                               self.batch_size, self.drop_last)
        if isinstance(self.sampler.shuffle, GroupByAspectRatio) and saved.world_size != world and started:
            raise ValueError(
                f"cannot resume: the state was saved on {saved.world_size} rank(s), this loader runs on {world}; "
                f"with shuffle={self.sampler.shuffle!r} the batches done are not the first positions of each "
                "rank's share, so the rest of the epoch cannot be split anew (resume on as many ranks, or start "
                "the epoch over)")
        position = saved.moved_to(world, n, self.batch_size)
        if position.done >= self.sampler.split_batches(position.start):
            position = EpochPosition(position.epoch + 1, world_size=world)
        self._resume, self._pass, self._next_epoch = position, None, position.epoch
        self.sampler.epoch = position.epoch

    def _position(self) -> EpochPosition:
        if self._resume is not None:
            return dataclasses.replace(self._resume)
        if self._pass is not None and self._pass.done < self.sampler.split_batches(self._pass.start):
            return dataclasses.replace(self._pass)
        epoch = self._next_epoch if self._next_epoch is not None else self.sampler.epoch
        return EpochPosition(epoch, world_size=self.sampler.world_size)

    def _settings(self) -> Dict[str, Any]:
        s = self.sampler
        grouped = isinstance(s.shuffle, GroupByAspectRatio)  # a shuffled order, cut into batches bin by bin
        return {"samples": s.n, "batch_size": s.batch_size, "shuffle": True if grouped else s.shuffle,
                "aspect_groups": s.shuffle.k if isinstance(s.shuffle, GroupByAspectRatio) else None,
                "groups_crc32": None if s.groups is None else array_crc32(s.groups),
                **window_settings(s.shuffle, s.window, s.starts), "seed": s.seed, "drop_last": s.drop_last,
                "mixture_crc32": None if self.mixture is None else self.mixture.mixture_crc32}

    def _archive(self) -> Dict[str, Any]:
        if self._identity is None:
            self._identity = archive_identity(self.reader)
        return self._identity

    def __repr__(self) -> str:
        return (f"PackedLoader({self.reader!r}, batch_size={self.batch_size}, batches={len(self)}, "
                f"device={self.device}, workers={self.dataloader.num_workers})")


def make_loader(
    source: Any,
    batch_size: int = 256,
    shuffle: Shuffle = True,
    num_workers: int = 2,
    device: Union[str, torch.device] = "cpu",
    transform: Optional[Callable] = None,
    drop_last: bool = False,
    distributed: Optional[bool] = None,
    seed: int = 0,
    prefetch: int = 2,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    *,
    size: Optional[Union[int, Tuple[int, int]]] = None,
    resize_mode: str = "stretch",
    on_error: str = "raise",
    verify: VerifyPolicy = "once",
    format: Optional[str] = None,
    persistent_workers: bool = True,
    multiprocessing_context: Any = None,
    memory_format: torch.memory_format = torch.contiguous_format,
    return_index: bool = False,
    decode: str = "workers",
    window: int = DEFAULT_WINDOW,
    cache_dir: "str | os.PathLike[str] | None" = None,
    cache_limit: "int | str | None" = None,
    storage_options: Optional[Dict[str, Any]] = None,
    registered_slots: bool = False,
    fields: "Sequence[str] | Mapping[str, str] | None" = None,
) -> PackedLoader:
    """A fast loader of whole ``(images, labels)`` batches from an archive.

    Args:
        source: archive path (any format, auto-detected), a PackedDataset, a Reader, or a
            ``Mixture`` of several archives (each epoch a weighted draw from them; see ``Mixture``).
        batch_size, shuffle, drop_last: as for DataLoader (drop_last drops the short last batch).
            shuffle="window" is for a sharded archive read through a cache of parts smaller
            than the set: the parts are shuffled, then the samples of each ``window`` of
            parts together, window after window (``sampling.window_order``), so each part is
            read in one window of the epoch and a cache of ``window`` parts fetches it once
            an epoch.  An archive of one part, or ``window`` >= its parts, is shuffled whole.
            shuffle=pf.GroupByAspectRatio(k=3): shuffled, each batch of one aspect-ratio bin
            (torchvision's ``GroupedBatchSampler``: bin edges ``2 ** linspace(-1, 1, 2k + 1)`` of
            width / height; the samples left in part-filled bins at the end of an epoch batched
            together; see ``GroupByAspectRatio``).  Not for a ``Mixture``.
        window: parts whose samples shuffle="window" mixes (default 8); batches mix
            fewer parts with a smaller one, so keep it as large as the cache allows.
        num_workers: worker processes, each reading whole batches (0: read in this process).
            Raw batches that are only a copy (a local raw archive of one file read to the CPU
            with no transform and no fields) are gathered by as many threads of this process instead,
            unless ``multiprocessing_context`` is given: the copy releases the GIL, and no
            batch is handed between processes (``threads``).
        device: where batches end up; "cuda" pins host batches and copies them on a side stream.
        transform: a batch transform (``pf.transforms``, or a callable wrapped in
            ``pf.transforms.Batched``) gets each uint8 [B,C,H,W] batch; any other callable
            (a torchvision pipeline) gets each [C,H,W] image on its own, so its random
            draws are per image (at the cost of one Python call per image).  Runs in the
            workers for the CPU, on the device otherwise.  A transform that takes
            ``(images, labels)`` (torchvision's MixUp/CutMix, ``pf.transforms.WithLabels``),
            alone or last in a ``pf.transforms.Compose`` after ``Normalize``, gets each batch
            with its labels, which then come out as it returns them (soft float [B, classes]).
            On an encoded archive with no ``size``, a transform that starts with a crop
            (``RandomResizedCrop``, as ``pf.transforms.train`` does, or ``Resize`` + ``CenterCrop``,
            as ``val`` does; alone or first in a ``Compose``, ours or torchvision's, however
            nested, with MixUp/CutMix after it or not) makes it while decoding: drawn in each
            image's own size, from a JPEG decoded at the least DCT scale that covers it, only
            the crop resized (in the workers, also for a GPU, which then runs the rest of the
            transform).
        distributed: split samples over torch.distributed ranks (None: when initialised);
            see ``shard_indices`` for the split and its padding.  The rank is taken when
            each epoch starts, so a loader built before ``init_process_group`` is split too.
        rank, world_size: split samples as this rank of so many, without torch.distributed
            (both or neither; like DistributedSampler's ``rank`` and ``num_replicas``).
        seed: base seed of shuffling and of the transforms' randomness.
        prefetch: batches copied to a CUDA device ahead of use.
        size: (height, width) every encoded image is resized to at decode (bilinear with
            antialiasing; JPEGs are first decoded at a reduced DCT scale when that still
            covers what the resize keeps, which is much cheaper); needed when an encoded
            archive's images differ in size, unless the transform starts with a crop (above) or
            is one of each image (a torchvision transform; with fields, a v2 transform of each
            sample's dict) that ends at one size: that one then runs in the workers on each image
            at its own size.  Raw archives keep their stored shape (use a transform).
            size="own": each image keeps the size it has after the transform (detection's
            batches): images, masks and second views come as lists of [C,H_i,W_i] tensors,
            boxes on each image's own canvas (``(images, labels)`` without fields, ``images``
            a list).  The transform then runs in the workers on each image (with fields, each
            sample's dict of tv_tensors); batch transforms and ``decode="device"`` are refused.
        resize_mode: "stretch" (the default: the aspect ratio is not kept) or
            "shorter-side-center-crop" (scaled until the shorter side fits, then the centre
            cut out: what ``packed-formats convert --resize-mode`` does for raw archives).
        on_error: "raise" (default) or "skip": drop samples that fail their checksum or
            decode from their batch, with a SkippedSampleWarning naming them.
        verify: CRC32-check each sample the first time a process reads it ("once", the
            default: full safety on the first epoch, and persistent workers then skip the
            ~50% extra cost a CRC adds to a raw read), on every read (True) or never (False).
        format: insist on this archive format.
        persistent_workers: keep workers (and their open handles) across epochs.
        multiprocessing_context: "fork", "spawn", "forkserver" or None (torch's default, and
            threads for batches that are only a copy).  Given, the workers are processes.
        memory_format: the layout of the image batches: contiguous NCHW (the default:
            what ``x.view(B, -1)`` and DDP's gradient buckets expect) or ``torch.channels_last``
            (what the archive holds: no conversion at all, and the faster layout for a
            channels-last model).  A CPU batch is converted once, in the worker, into the
            memory it is sent in; another device converts it there.
        return_index: batches are ``(images, labels, indices)``, ``indices`` the int64 [B]
            dataset indices of the batch's samples (on the CPU, for bookkeeping); of a
            ``Mixture``, int64 [B, 2]: each sample's source and its index in that source.
        decode: where an encoded archive's JPEGs are decoded: "workers" (the default: on their
            CPUs, cropped while decoding) or "device": in this process on ``device``, batched
            (nvJPEG on a GPU), the workers only reading, checking and sending bytes; images the
            device's decoder does not take (PNG, WebP, CMYK) the workers still decode.  The
            crops and flips drawn are the same either way.  On the CPU, "device" decodes in
            this process with the same decoder (TorchCodec's, else torchvision's: ``image_decode``).
        cache_dir, cache_limit, storage_options: for a URL (``s3://``, ``gs://``, ``https://``): the
            node-local cache its parts are read through, its bound ("200GB"), and fsspec's options
            (see ``open_archive``).  The parts the next batches read are fetched ahead, four at a
            time.  With a cache smaller than the set, use ``shuffle="window"`` with a window of at
            most half the parts the cache holds: each part is then fetched once an epoch.
        registered_slots: on CUDA with workers, register the shared-memory slots the workers send
            their batches in as pinned memory (once each, ``cudaHostRegister``) and copy batches to
            the GPU straight from them, instead of through DataLoader's pin-memory thread (a
            host copy of every batch).  Off by default.  For the CPU, batches always arrive in
            such slots (``slots``): the main process maps each once and receives a batch as its
            slot's number, the tensors it hands on views of the slot.
        fields: sample fields each batch carries besides images and labels (``PackedDataset``'s
            ``fields``: names, or ``{name: role}`` with roles "value", "mask", "instances" (an
            instance map as a ``Mask`` [N,H,W], one mask per box of the boxes field), "image" and
            "boxes:XYXY"/"XYWH"/"CXCYWH").  Batches are then dicts: ``image`` and ``label`` as
            always, masks and other fixed-shape fields stacked (``[B,H,W]``), variable-length ones
            (boxes, points, instance masks) as lists of each sample's tensor, text and JSON as lists, and ``index``
            with ``return_index``.  Masks, second views and boxes are cut with their image: by the
            crop a crop-first transform makes while decoding, and by ``size``.  The transform is
            then a torchvision v2 transform given each sample's dict of tv_tensors after that crop
            (what follows the crop: flips, colour), so that it moves masks and boxes with the image;
            it runs in the workers whatever the device, which then gets finished batches.
            Without ``fields`` no field byte is read.

    Images are uint8 [B,C,H,W] unless the transform changes them; labels are
    int64 [B] unless a transform that takes labels changes them.
    ``len(loader)`` is the number of batches per epoch on this rank; the loader
    also has DataLoader's ``dataset``, ``batch_size``, ``num_workers``,
    ``drop_last`` and ``sampler.set_epoch``.
    ``loader.state_dict()`` saved with a checkpoint and
    ``loader.load_state_dict(state)`` in a new process continue an
    interrupted epoch exactly.  Raises PackedFormatError for bad archives.
    """
    check_on_error(on_error)
    check_verify(verify)
    check_choice("resize_mode", resize_mode, RESIZE_MODES)
    check_choice("decode", decode, DECODE_PLACES)
    shuffle, window = check_shuffle(shuffle, window)
    check_source(source, shuffle)
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"memory_format must be torch.contiguous_format or torch.channels_last, got {memory_format}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if not isinstance(registered_slots, bool):
        raise ValueError(f"registered_slots must be True or False, got {registered_slots!r}")
    if isinstance(size, str):
        _check_own(size, transform, decode, memory_format)
    if memory_format == torch.channels_last and fields is None:  # the final normalisation writes it: no second
        transform = with_memory_format(transform, memory_format)  # float copy
    asked = torch.device(device)
    device = resolve_device(asked)  # ValueError now when CUDA is asked for and absent
    reader = _open_reader(source, format, verify, cache_dir=cache_dir, cache_limit=cache_limit,
                          storage_options=storage_options)
    own = isinstance(size, str) and size == OWN
    decode_size = None if own else _check_size(reader, size)
    mixture = mixture_of(reader)
    groups = None
    if isinstance(shuffle, GroupByAspectRatio):
        if mixture is not None:
            raise ValueError(f"shuffle={shuffle!r} does not apply to a Mixture: each epoch is a draw from its "
                             "sources (use shuffle=True)")
        groups = shuffle.groups(shuffle.sizes_of(reader, on_error == "skip"))
    if mixture is not None:
        mixture.plan(batch_size, shuffle, window)  # whole batches per source, windows of parts: the draw's
    if mixture is not None and fields is not None:
        mixture.check_fields(fields)
    batch_fields = _batch_fields(reader, fields, transform, decode)
    if transform is not None and takes_labels(transform) and not reader.manifest.labelled:
        raise PackedFormatError(reader.path, f"{type(transform).__name__} mixes the batch's labels (MixUp, CutMix), "
                                             "but the archive's samples have no label",
                                hint="leave MixUp/CutMix out, or convert the data with its labels")
    if (rank is None) != (world_size is None):
        raise ValueError("give both rank and world_size, or neither")
    placement = None if rank is None or world_size is None else (int(rank), int(world_size))
    if placement is not None and not 0 <= placement[0] < placement[1]:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    rank, world = placement or (0, 1)  # torch.distributed's is taken when an epoch starts: PackedLoader._find_rank
    # the workers make the batches whole with fields, lists of images, or a per-image transform of
    # encoded images of any sizes, for any device
    each = decode == "workers" and decodes_each(reader, decode_size, transform, fields=False)
    whole = batch_fields is not None or own or each
    send = "batches" if whole else _what_workers_send(reader, decode, device, transform, decode_size)
    if send == "bytes":
        check_decoder()
    on_cpu = (device.type == "cpu" or whole) and send == "batches"
    sampler = BatchSampler(len(reader) if mixture is None else mixture.draw.samples, batch_size, shuffle, drop_last,
                           seed, rank, world, window=window, starts=reader.part_starts,
                           draw=None if mixture is None else mixture.draw, groups=groups)
    if isinstance(reader.backend, storage.RemoteSetBackend):
        if shuffle == "window" and given_max_open_parts(reader) is None:  # a batch reads up to a window and one
            reader.backend.limit_open_parts(window + 1)  # parts: closing one mid-batch only to open it again
        sampler.prefetcher = storage.Prefetcher(reader.backend, lag=max(1, 2 * num_workers))  # prefetch_factor 2
        storage.warn_if_cache_thrashes(reader.backend, shuffle, window, batch_size)
    elif mixture is not None:  # its sources in object storage: their parts fetched ahead, across sources
        sampler.prefetcher = mixture.prefetcher(shuffle, window, batch_size, lag=max(1, 2 * num_workers))
    batch_reader = BatchReader(
        reader, size=decode_size, resize_mode=resize_mode, transform=transform if on_cpu or send != "batches" else None,
        on_error=on_error, seed=seed, rank=rank, pin=device.type == "cuda" and num_workers == 0,
        memory_format=memory_format if on_cpu and not own else None,  # another device converts the batch there
        send=send, fields=batch_fields, own_sizes=own,
    )
    rest = transform  # what runs on the device: all of it, or what follows a crop the workers draw
    if send != "batches" and batch_reader.at_decode is not None:
        rest = batch_reader.at_decode[1]
    loader: "torch.utils.data.DataLoader | GatherThreads"
    if gathers_in_threads(reader, batch_reader, num_workers, device, multiprocessing_context):
        loader = GatherThreads(batch_reader, sampler, num_workers)  # batches that are only a copy: threads
    else:
        if num_workers > 0:
            temp_dir.check()  # the workers pass their batch slots' descriptors through a socket under $TMPDIR
        batch_reader.pool = _worker_slots(num_workers, device, registered_slots, reader.path)
        loader = _worker_processes(batch_reader, sampler, num_workers, device, persistent_workers,
                                   multiprocessing_context, seed, rank)
    return PackedLoader(
        batch_reader, sampler, loader, asked, None if on_cpu else batchwise(rest), prefetch, distributed, placement,
        memory_format=memory_format, return_index=return_index,
        dataset=source if isinstance(source, PackedDataset) else None,
        decoder=DeviceDecoder(reader, memory_format) if send != "batches" else None,
    )


def _worker_processes(batch_reader: BatchReader, sampler: BatchSampler, num_workers: int, device: torch.device,
                      persistent_workers: bool, multiprocessing_context: Any, seed: int,
                      rank: int) -> torch.utils.data.DataLoader:
    """The DataLoader whose worker processes (none: this process) make the batches."""
    return torch.utils.data.DataLoader(
        batch_reader,
        batch_size=None,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=_already_a_batch,
        pin_memory=device.type == "cuda" and num_workers > 0 and not isinstance(batch_reader.pool, BatchSlots),
        persistent_workers=persistent_workers and num_workers > 0,
        multiprocessing_context=worker_context(multiprocessing_context) if num_workers > 0 else None,
        worker_init_fn=WorkerInit(seed, rank),
    )


def _batch_fields(reader: Reader, fields: "Sequence[str] | Mapping[str, str] | None", transform: Optional[Callable],
                  decode: str) -> Optional[BatchFields]:
    """The fields ``make_loader`` was asked for (None: none); ValueError for what cannot take them."""
    if fields is None:
        return None
    if decode == "device":
        raise ValueError("fields are read, cut and transformed in the workers: decode='device' does not take them")
    split = split_at_decode(transform) if reader.mode != "raw" else None
    refuse_batch_transforms(transform if split is None else split[1])
    return BatchFields(reader.fields, fields)


def _check_own(size: str, transform: Optional[Callable], decode: str, memory_format: torch.memory_format) -> None:
    """ValueError for what size="own" (lists of images each of its own size) does not take."""
    if size != OWN:
        raise ValueError(f"size must be an int, (height, width), or 'own' (each image keeps its own size), "
                         f"got {size!r}")
    if decode == "device":
        raise ValueError("size='own' decodes and transforms each image in the workers: decode='device' does not "
                         "take it")
    if memory_format != torch.contiguous_format:
        raise ValueError("size='own' gives each image as a contiguous [C,H,W] tensor: memory_format does not apply")
    if transform is not None and (is_batch_transform(transform) or takes_labels(transform)):
        raise ValueError(
            f"size='own' gives images of different sizes, which no batch transform takes: "
            f"{type(transform).__name__} takes whole batches. Give a transform of one image (a torchvision v2 "
            "transform; with fields, of each sample's dict)")


def _worker_slots(num_workers: int, device: torch.device, registered: bool,
                  path: str) -> "SlotPool | BatchSlots | None":
    """The shared memory the workers send batches in: slots the main process maps once (``BatchSlots``),
    registered as pinned memory on CUDA, where asked; else (the default on CUDA, whose pin-memory
    thread takes the batches, or where no shared-memory directory is at hand) a ``SlotPool``."""
    if num_workers == 0:
        return None
    if (device.type == "cuda" and not registered) or not slots.available():
        return SlotPool(num_workers)
    pool = BatchSlots(num_workers, path=path)
    if device.type == "cuda":
        pool.pin(device)
    return pool


def _what_workers_send(reader: Reader, decode: str, device: torch.device, transform: Optional[Callable],
                       size: Optional[Tuple[int, int]]) -> str:
    """What the workers send (``BatchReader``'s ``send``): "bytes" of an encoded archive decoded on the
    device; "crops" where another device gets an encoded archive whose transform starts with a crop
    (cut while decoding, as on the CPU, the rest of the transform on the device); else "batches"."""
    if reader.mode == "raw":
        return "batches"  # nothing to decode
    if decode == "device":
        return "bytes"
    if device.type != "cpu" and size is None and split_at_decode(transform) is not None:
        return "crops"
    return "batches"



def _naming_dead_workers(batches: Iterator, path: str) -> Iterator:
    """``batches``, with the failure a killed worker causes (torch's RuntimeError, or a
    ConnectionResetError or a slot's lost handover when it died while handing a batch over) named as a
    ``DataLoaderWorkerError``: which worker, its pid and the signal."""
    while True:
        try:
            item = next(batches)
        except StopIteration:
            return
        except (RuntimeError, ConnectionError, EOFError, slots.HandoverError) as exc:
            looks_dead = not isinstance(exc, RuntimeError) or "DataLoader worker" in str(exc)
            dead = _killed_workers(batches) if looks_dead else []
            if not dead:
                raise
            what = "; ".join(f"worker {k}, pid {pid}, killed by {_signal_name(-code)}" for k, pid, code in dead)
            raise DataLoaderWorkerError(
                path, f"a DataLoader worker died: {what}",
                hint="SIGKILL is often the out-of-memory killer: try fewer workers or a smaller batch",
            ) from exc
        yield item


def _killed_workers(batches: Iterator, wait: float = 2.0) -> List[Tuple[int, int, int]]:
    """(worker id, pid, exit code) of the iterator's workers a signal ended, waiting up to ``wait``
    seconds for a dying one to be reaped.  torch's SIGCHLD handler may raise meanwhile: ignored."""
    workers = list(getattr(batches, "_workers", ()))
    deadline = time.monotonic() + wait
    while True:
        try:
            dead = [(k, p.pid, p.exitcode) for k, p in enumerate(workers) if (p.exitcode or 0) < 0]
            if dead or not workers or time.monotonic() > deadline:
                return dead
            time.sleep(0.02)
        except RuntimeError:  # the handler reporting the same death in this thread
            continue


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _already_a_batch(item: Any) -> Any:
    """collate_fn: a worker's item is already a whole batch."""
    return item


def _open_reader(source: Any, format: Optional[str], verify: VerifyPolicy, **remote: Any) -> Reader:
    """A Reader of ``source`` of its own, applying ``verify`` (and, for a URL, the cache options ``remote``)."""
    if isinstance(source, Mixture):
        return source.open(verify, format=format, **remote)
    reader = getattr(source, "reader", source)
    if isinstance(reader, Reader) and mixture_of(reader) is not None:  # a PackedDataset of a Mixture
        return mixture_of(reader).reopen(verify)  # type: ignore[union-attr]
    if isinstance(reader, Reader):
        if getattr(source, "transform", None) is not None or getattr(source, "_joint", None) is not None:
            raise ValueError("make_loader applies batch transforms: pass transform= to make_loader, not the dataset "
                             "(its transform or transforms)")
        return open_archive(reader.path, format=reader.format_name, verify=verify,
                            max_open_parts=given_max_open_parts(reader), **storage.reopen_options(reader))
    if isinstance(source, (str, os.PathLike)):
        return open_archive(source, format=format, verify=verify, **remote)
    raise TypeError(f"make_loader needs an archive path, a PackedDataset, a Reader or a Mixture, got "
                    f"{type(source).__name__}")


def _check_size(reader: Reader, size: Optional[Union[int, Tuple[int, int]]]) -> Optional[Tuple[int, int]]:
    """``size`` as (height, width); ValueError unless positive, or when a raw archive's images are another size."""
    if size is None:
        return None
    h, w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    if h <= 0 or w <= 0:
        raise ValueError(f"size must be positive, got {size}")
    shape = reader.manifest.shape
    if reader.mode == "raw" and shape is not None and (h, w) != tuple(shape[:2]):
        raise ValueError(
            f"{reader.path}: a raw archive holds {shape[0]}x{shape[1]} images; "
            "size= only applies to encoded archives (use a Resize transform)"
        )
    return h, w

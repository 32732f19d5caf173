"""Big CPU batch buffers without paying for fresh pages on every batch.

A fresh 256x3x224x224 float batch is 154 MB: the kernel faults in and zeroes
~37,000 small pages the first time it is written, which costs as much as the
augmentation itself (measured: filling a fresh batch ~80 ms, a reused one ~7 ms).
Two remedies, one per situation:

* In the process that uses a buffer, ``empty`` asks the kernel for huge pages
  (``madvise(MADV_HUGEPAGE)``): 512x fewer faults (~16 ms for the same fill
  where transparent huge pages are in ``madvise`` or ``always`` mode).
* Between a DataLoader worker and the main process, batches travel in shared
  memory, where huge pages are usually off.  ``SlotPool`` gives each worker a
  few shared buffers that it reuses, and lets a buffer be written again only
  after the main process has dropped every reference to the batch it carried
  (a finalizer on the received storage flips the slot's state back).  A batch
  the user keeps is never overwritten: the worker then takes another slot or a
  fresh buffer.  A worker passes ``pool.take`` to its transform as
  ``allocate``, so the augmented batch is written once, straight into a slot,
  and sent without a copy.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import sys
import threading
import uuid
import warnings
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, TypeVar, Union, cast

import numpy as np
import torch

from .errors import TooManyOpenFilesError
from .handles import ProcessLocal

HUGE_PAGE = 2 << 20
MIN_ADVISED_BYTES = 4 * HUGE_PAGE  # below this the saving is small
MADV_HUGEPAGE = 14
POOLED_MIN_BYTES = 1 << 20  # smaller batches are cheap to send the ordinary way
SLOTS_PER_WORKER = 4  # DataLoader's 2 batches in flight, one being made, one the training step holds
FREE, SENT = 0, 1


# ---- huge pages in this process ------------------------------------------------------------------
def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for transparent huge pages under a large CPU tensor's storage; True if the kernel agreed.

    Only the 2 MiB-aligned inside of the storage is advised, so no memory
    outside the tensor is touched.  A no-op elsewhere than Linux.
    """
    if _madvise is None or tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    if storage.nbytes() < MIN_ADVISED_BYTES:
        return False
    start = storage.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
    return last > first and _madvise(first, last - first, MADV_HUGEPAGE) == 0


def empty(
    shape: Sequence[int],
    dtype: torch.dtype = torch.uint8,
    device: torch.device = torch.device("cpu"),
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor:
    """``torch.empty``, on huge pages when it is a large CPU tensor."""
    tensor = torch.empty(tuple(shape), dtype=dtype, device=device, memory_format=memory_format)
    advise_huge_pages(tensor)
    return tensor


class ReusedBuffers:
    """Big CPU buffers that this process hands out again once nothing uses them.

    ``take(shape, dtype)`` returns a tensor over one of ``keep`` buffers that no
    tensor (nor a view of one, nor a numpy array made from one) refers to any
    more, else over a new buffer, kept if there is room.  Each hand-out is a
    fresh numpy view whose weak reference says whether it is still in use: the
    tensor's storage holds that view until the last tensor over it dies.  So a
    batch the caller keeps is never overwritten, and a loop that drops its
    batches reads each new one into memory whose pages are already there
    (a fresh 50 MB batch costs ~6 ms of page faults, ~as much as reading it).
    Not shared between processes: make one per process.  Threads may share
    one: a buffer is handed to one taker at a time.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._buffers: List[Tuple[np.ndarray, Optional[weakref.ref]]] = []
        self._lock = threading.Lock()

    def take(
        self,
        shape: Sequence[int],
        dtype: torch.dtype = torch.uint8,
        memory_format: torch.memory_format = torch.contiguous_format,
    ) -> torch.Tensor:
        """A ``shape`` tensor of ``dtype`` (channels-last in memory when asked for a [B,C,H,W] one)."""
        shape = tuple(int(n) for n in shape)
        layout = _layout(shape, memory_format)
        nbytes = math.prod(layout) * dtype.itemsize
        with self._lock:
            free = [k for k, (base, user) in enumerate(self._buffers)
                    if (user is None or user() is None) and base.nbytes >= nbytes]
            if free:  # the smallest that fits, so that a small read does not take a big result's buffer
                k = min(free, key=lambda k: self._buffers[k][0].nbytes)
                return self._hand_out(k, self._buffers[k][0], nbytes, layout, dtype, shape)
            if len(self._buffers) < self.keep:
                self._buffers.append((empty((max(nbytes, 1),)).numpy(), None))
                return self._hand_out(len(self._buffers) - 1, self._buffers[-1][0], nbytes, layout, dtype, shape)
        return _typed(empty((max(nbytes, 1),))[:nbytes], layout, dtype, shape)

    def _hand_out(self, k: int, base: np.ndarray, nbytes: int, layout, dtype, shape) -> torch.Tensor:
        view = base[:nbytes]
        self._buffers[k] = (base, weakref.ref(view))
        return _typed(torch.from_numpy(view), layout, dtype, shape)


def _layout(shape: Tuple[int, ...], memory_format: torch.memory_format) -> Tuple[int, ...]:
    """How a ``shape`` tensor lies in memory: [B,H,W,C] for a channels-last [B,C,H,W] one."""
    if memory_format == torch.channels_last and len(shape) == 4:
        b, c, h, w = shape
        return (b, h, w, c)
    return shape


def worker_row(states: torch.Tensor) -> Optional[int]:
    """This DataLoader worker's row of a pool's slot states (its id), None outside a worker (or one the
    pool has no row for)."""
    info = torch.utils.data.get_worker_info()
    if info is None or info.id >= states.shape[0]:
        return None
    return info.id


def choose_slot(states: np.ndarray, reserved: "Set[int]", capacity: Callable[[int], int], nbytes: int
                ) -> Optional[Tuple[int, bool]]:
    """One worker's slot for a batch of ``nbytes``: (the first free one that holds it, False), else (the
    first free one, True: it must grow); None when the main process holds every one."""
    free = [int(s) for s in np.flatnonzero(states == FREE) if int(s) not in reserved]
    if not free:
        return None
    fits = [s for s in free if capacity(s) >= nbytes]
    return (fits[0], False) if fits else (free[0], True)


def _typed(raw: torch.Tensor, layout: Tuple[int, ...], dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
    """Contiguous bytes viewed as ``dtype`` in ``layout``, permuted to ``shape`` when the layout is channels-last."""
    tensor = raw.view(dtype).view(layout)
    return tensor.permute(0, 3, 1, 2) if layout != shape else tensor


# allocate(shape, dtype, memory_format): memory for a result, or None to let the caller allocate
Allocate = Callable[[Tuple[int, ...], torch.dtype, torch.memory_format], Optional[torch.Tensor]]


def output_buffer(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device = torch.device("cpu"),
    memory_format: torch.memory_format = torch.contiguous_format,
    allocate: Optional[Allocate] = None,
) -> torch.Tensor:
    """Memory for a transform's result: from ``allocate`` on the CPU when it gives some
    (a worker's ``SlotPool.take``, a process's ``ReusedBuffers.take``), else ``empty``."""
    if allocate is not None and torch.device(device).type == "cpu":
        tensor = allocate(tuple(shape), dtype, memory_format)
        if tensor is not None:
            return tensor
    return empty(shape, dtype, device, memory_format)


# ---- shared buffers a worker reuses ----------------------------------------------------------------
def storage_lifetime_is_tracked() -> bool:
    """Whether a finalizer on a tensor's storage object waits for the tensor and no longer (torch
    keeps one Python object per storage), for a storage made here and for one received from
    another process.  Pooling relies on it and is off where it does not hold."""
    global _LIFETIME_TRACKED
    if _LIFETIME_TRACKED is None:
        tensor = torch.empty(4)
        fired: List[bool] = []
        weakref.finalize(tensor.untyped_storage(), fired.append, True)
        view = tensor[1:]
        del tensor
        alive_while_viewed = not fired
        del view
        _LIFETIME_TRACKED = alive_while_viewed and bool(fired) and _received_storage_is_tracked()
    return _LIFETIME_TRACKED


class _Descriptor:
    """A file descriptor as torch's receiving side of a shared storage takes it (``detach()``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return os.dup(self.fd)


def _received_storage_is_tracked() -> bool:
    """Whether a shared storage received as the main process receives a worker's batch lets its
    Python object go with its last tensor.  Some torch releases (2.8, for one) keep that object
    while torch's cache of received storages holds a weak reference to it, so a pooled slot
    would never be given back.  Checked within this process, through the current sharing
    strategy's own receiving code, without pickling (which would start a thread here)."""
    from torch.multiprocessing import get_sharing_strategy, reductions

    cache = reductions.shared_cache
    known = set(cache.keys())
    sent = shared_storage(8)
    try:
        if get_sharing_strategy() == "file_descriptor":
            fd, size = sent._share_fd_cpu_()
            received = reductions.rebuild_storage_fd(type(sent), _Descriptor(fd), size)
        else:
            rebuild, arguments = reductions.reduce_storage(sent)
            for key in set(cache.keys()) - known:  # as another process would: map it anew
                cache.pop(key, None)
            received = rebuild(*arguments)
        tensor = torch.empty(0, dtype=torch.uint8).set_(received)
        del received
        fired: List[bool] = []
        weakref.finalize(tensor.untyped_storage(), fired.append, True)
        alive_while_used = not fired
        del tensor
        return alive_while_used and bool(fired)
    finally:
        for key in set(cache.keys()) - known:
            cache.pop(key, None)


def _warn_pooling_off() -> None:
    """Say once per process that this torch turns batch slot pooling off."""
    global _WARNED_OFF
    if not _WARNED_OFF:
        _WARNED_OFF = True
        warnings.warn(PoolingOffWarning(
            f"packed_formats: torch {torch.__version__} keeps a received batch's shared memory referenced after "
            "its last tensor is gone, so DataLoader workers do not reuse batch slots here: each batch gets fresh "
            "shared memory (correct, a little slower)"), stacklevel=3)


class PoolingOffWarning(RuntimeWarning):
    """This torch does not let the main process give batch slots back, so ``SlotPool`` is off."""


_LIFETIME_TRACKED: Optional[bool] = None
_WARNED_OFF = False
# token -> states of the pools created in this process (the main process's side)
_POOLS: Dict[str, torch.Tensor] = {}


def _forget(token: str) -> None:
    _POOLS.pop(token, None)


def _release(states: torch.Tensor, worker: int, slot: int) -> None:
    states[worker, slot] = FREE


def _claim(tensor: torch.Tensor, token: str, worker: int, slot: int) -> torch.Tensor:
    """Unpickling a pooled batch in the main process: free its slot when its storage dies."""
    states = _POOLS.get(token)
    if states is not None:
        weakref.finalize(tensor.untyped_storage(), _release, states, worker, slot)
    return tensor


class _Pooled:
    """A batch in a pool slot, on its way to the main process (pickles as the plain tensor)."""

    __slots__ = ("tensor", "token", "worker", "slot")

    def __init__(self, tensor: torch.Tensor, token: str, worker: int, slot: int) -> None:
        self.tensor, self.token, self.worker, self.slot = tensor, token, worker, slot

    def __reduce__(self):
        return _claim, (self.tensor, self.token, self.worker, self.slot)


# a batch as a worker hands it back: the tensor, or the tensor wrapped so that its slot is freed once received
SentBatch = Union[torch.Tensor, _Pooled]


def shared_storage(nbytes: int) -> torch.UntypedStorage:
    """``nbytes`` of fresh shared memory as a CPU storage, mapped by whichever process unpickles it.

    torch has no public call for this: ``Tensor.share_memory_()`` allocates
    ordinary memory first and then copies it into a new shared segment, an
    extra buffer and copy per slot.  The private ``UntypedStorage._new_shared``
    makes the shared segment directly, under the current sharing strategy
    (file descriptor or file system), as torch's own DataLoader collation does;
    this is the one place that calls it.
    """
    return torch.UntypedStorage._new_shared(nbytes)


class SlotPool:
    """Shared-memory batch buffers that each DataLoader worker reuses.

    Create it in the main process with the number of workers; workers get it
    inside the dataset (fork, spawn or forkserver alike).  In a worker,
    ``take(shape, dtype)`` gives a tensor over a free slot (None outside a
    worker, for small batches, or when every slot is held by the main process),
    and ``send(tensor)`` returns what the worker should hand back: the batch
    wrapped so that, once unpickled in the main process, its slot is freed
    when the batch's storage is garbage.  A batch outside the pool is first
    copied into a free slot.  ``end_batch()`` forgets what ``take`` reserved.
    Each worker keeps at most ``slots`` buffers; batches under ``min_bytes``
    go the ordinary way.
    """

    def __init__(self, workers: int, slots: int = SLOTS_PER_WORKER, min_bytes: int = POOLED_MIN_BYTES) -> None:
        self.token, self.min_bytes = uuid.uuid4().hex, min_bytes
        self.states = torch.zeros((max(1, workers), slots), dtype=torch.uint8).share_memory_()
        self.enabled = storage_lifetime_is_tracked()
        if not self.enabled:
            _warn_pooling_off()
        # this process's buffers: made on first use, never inherited through fork nor pickled
        self._buffers = ProcessLocal(functools.partial(_Buffers, slots))
        _POOLS[self.token] = self.states
        weakref.finalize(self, _forget, self.token)

    def _worker(self) -> Optional[int]:
        return worker_row(self.states) if self.enabled else None

    def take(
        self,
        shape: Sequence[int],
        dtype: torch.dtype = torch.uint8,
        memory_format: torch.memory_format = torch.contiguous_format,
    ) -> Optional[torch.Tensor]:
        """A ``shape`` tensor over a free slot of this worker (contiguous, or channels-last
        when asked for a [B,C,H,W] one), or None."""
        shape = tuple(int(n) for n in shape)
        layout = _layout(shape, memory_format)
        nbytes = math.prod(layout) * dtype.itemsize
        worker = self._worker()
        if worker is None or nbytes < self.min_bytes:
            return None
        buffers = self._buffers.get()
        chosen = choose_slot(self.states[worker].numpy(), buffers.reserved, buffers.nbytes, nbytes)
        if chosen is None:
            return None  # the main process holds every slot: an ordinary batch this time
        index, grow = chosen
        if grow:
            buffers.renew(index, nbytes)
        buffers.reserved.add(index)
        raw = torch.empty(0, dtype=torch.uint8).set_(buffers.storage(index), 0, (nbytes,), (1,))
        return _typed(raw, layout, dtype, shape)

    def _slot_of(self, tensor: torch.Tensor) -> Optional[int]:
        pointer, buffers = tensor.untyped_storage().data_ptr(), self._buffers.get()
        for index in buffers.reserved:
            if buffers.storage(index).data_ptr() == pointer:
                return index
        return None

    def send(self, tensor: torch.Tensor) -> SentBatch:
        """What a worker returns for ``tensor`` (a batch it will not touch again)."""
        worker = self._worker()
        if worker is None or tensor.device.type != "cpu":
            return tensor
        index = self._slot_of(tensor)
        if index is None:
            pooled = self._copy_into_slot(tensor)
            index = None if pooled is None else self._slot_of(pooled)
            if pooled is None or index is None:
                return tensor
            tensor = pooled
        self.states[worker, index] = SENT
        self._buffers.get().reserved.discard(index)
        return _Pooled(tensor, self.token, worker, index)

    def _copy_into_slot(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """A copy of ``tensor`` in a free slot, in the same memory format; None if none is free."""
        memory_format = memory_format_of(tensor) if tensor.dim() == 4 else torch.contiguous_format
        pooled = self.take(tensor.shape, tensor.dtype, memory_format)
        if pooled is not None:
            pooled.copy_(tensor)
        return pooled

    def end_batch(self) -> None:
        """Close this batch: slots it took but did not send are let go, not reused, since
        something other than the main process might still hold them."""
        if self._worker() is None:
            return
        buffers = self._buffers.get()
        for index in buffers.reserved:
            buffers.storages[index] = None
        buffers.reserved.clear()


class _Buffers:
    """One process's shared buffers of a pool, and the slots its current batch has taken."""

    def __init__(self, slots: int) -> None:
        self.storages: List[Optional[torch.UntypedStorage]] = [None] * slots
        self.reserved: Set[int] = set()

    def nbytes(self, slot: int) -> int:
        """The size of the slot's buffer (0 before it has one)."""
        storage = self.storages[slot]
        return 0 if storage is None else storage.nbytes()

    def storage(self, slot: int) -> torch.UntypedStorage:
        """The slot's buffer; LookupError before it has one."""
        storage = self.storages[slot]
        if storage is None:
            raise LookupError(f"slot {slot} has no buffer")
        return storage

    def renew(self, slot: int, nbytes: int) -> None:
        """Give the slot a new ``nbytes`` buffer, letting the old one go first."""
        self.storages[slot] = None
        self.storages[slot] = shared_storage(nbytes)


def memory_format_of(batch: torch.Tensor) -> torch.memory_format:
    """channels_last when a [B,C,H,W] batch has its channels innermost (e.g. a view of NHWC pixels)."""
    if batch.shape[1] > 1 and batch.stride(1) == 1:
        return torch.channels_last
    return torch.contiguous_format


# ---- handing a batch back ---------------------------------------------------------------------------
T = TypeVar("T")


class _HandedBack:
    """A worker's item, pickled already (see ``hand_back``); it unpickles as the item itself."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self):
        return _unpickled, (self.data,)


def _unpickled(data: bytes) -> Any:
    return ForkingPickler.loads(data)


def hand_back(item: T, path: str) -> T:
    """``item`` as a DataLoader worker returns it: pickled now, in the worker's own thread.

    The DataLoader pickles what a worker returns in its queue's feeder thread,
    where a failure (sharing a tensor's memory takes a file descriptor, and the
    worker may have none left) is printed and the batch dropped: the main
    process would then wait for that batch forever.  Pickled here, a failure is
    the worker's own exception, which the DataLoader raises in the main process;
    ``path`` (the archive) names it.  The main process unpickles ``item`` itself.
    """
    if torch.utils.data.get_worker_info() is None:
        return item
    return cast(T, _HandedBack(pickled(path, lambda: bytes(ForkingPickler.dumps(item)))))


def pickled(path: str, dump: Callable[[], bytes]) -> bytes:
    """``dump()``, a worker's batch pickled; a failure for want of a file descriptor (sharing a tensor's
    memory takes one) raised as ``TooManyOpenFilesError`` naming ``path``."""
    try:
        return dump()
    except Exception as exc:
        if TooManyOpenFilesError.describes(exc) or _out_of_descriptors():
            raise TooManyOpenFilesError(
                path, f"a DataLoader worker has no file descriptor left to hand a batch back with "
                      f"({type(exc).__name__}: {exc}; {TooManyOpenFilesError.usage()})",
                hint=f"{TooManyOpenFilesError.HINT}, or let the workers hold fewer files open "
                     "(for a sharded archive, a lower max_open_parts)",
            ) from None
        raise


def _out_of_descriptors() -> bool:
    """Whether this process cannot open one more file now (some libraries hide EMFILE: Python's
    ``tempfile`` reports it as no usable temporary directory)."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        return TooManyOpenFilesError.describes(exc)
    return False

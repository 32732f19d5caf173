"""Batches from DataLoader workers as slot numbers: shared buffers the main process maps once.

torch hands a worker's tensors to the main process through a file descriptor
per tensor (a connection to the worker's resource sharer, a new mapping each
time): ~5 ms a batch on the main process's side, where it limits every worker
count.  Here each worker writes its batch (images, then labels and indices
after them) into one of a few shared-memory files of its own in ``/dev/shm``
(a *slot*; a new generation of it when it must grow).  The worker unlinks each
file as soon as it has made and mapped it: the memory lives on only in the
processes that map it (or hold its descriptor), so nothing is left in
``/dev/shm`` whichever process is killed, and when.  The first batch sent in a
slot's generation carries its descriptor (``multiprocessing``'s resource
sharer: once per slot, never per batch); otherwise what travels through
torch's queue is a small message: which slots, and where each tensor lies in
them.  The main process maps a slot the first time a message names it and
keeps its mapping while the worker uses the slot: persistent workers' slots
for the loader's life, fresh workers' for their epoch (each new worker process
makes its slots anew).  The tensors it hands on are views of the mapping.

A slot goes back to its worker when the user drops every tensor of the batch:
each batch's tensors share one storage over a fresh numpy view of the
mapping, and a finalizer on that view sets the slot's byte in a shared state
array back to FREE (the worker sets it to SENT).  A batch the user keeps is
never overwritten: the worker then takes another slot, or sends its batch the
ordinary way.  On CUDA the main process can register each mapping once as
pinned memory (``cudaHostRegister``), so that batches are copied to the GPU
straight from the slot, with no pin-memory thread and no host copy.

A slot whose batch never arrived (its worker stopped first) goes with that
worker; ``reclaim`` frees the slots of batches that were lost so.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import pickle
import sys
import threading
import uuid
import warnings
import weakref
from multiprocessing import ProcessError
from multiprocessing.reduction import ForkingPickler
from multiprocessing.resource_sharer import DupFd
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from ..errors import PackedFormatError, TooManyOpenFilesError
from ..handles import ProcessLocal
from ..memory import FREE, SENT, SLOTS_PER_WORKER, _layout, _typed, choose_slot, memory_format_of, pickled, worker_row

SHARED_DIRECTORY = "/dev/shm"
ALIGN = 64  # where each tensor after the first starts in a slot
INLINE_MAX = 64 << 10  # smaller tensors outside any slot travel in the message itself
PAGE = mmap.PAGESIZE
PREFIX = "packed_formats-"
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context

# (slot, generation, capacity, its descriptor with the generation's first batch, else None) of each slot a
# message uses
SlotUse = Tuple[int, int, int, Optional[DupFd]]


def available(directory: str = SHARED_DIRECTORY) -> bool:
    """Whether batch slots can be made here: Linux, with a writable shared-memory directory, and not turned
    off with ``PF_BATCH_SLOTS=0`` (workers then send shared tensors, ``memory.SlotPool``)."""
    if os.environ.get("PF_BATCH_SLOTS", "1").strip() == "0":
        return False
    return sys.platform.startswith("linux") and os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)


def slot_file(directory: str, token: str, worker: int, slot: int, generation: int) -> str:
    """The path of one generation of a worker's slot."""
    return os.path.join(directory, f"{PREFIX}{token}-{worker}-{slot}-{generation}")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def capacity_for(nbytes: int) -> int:
    """A slot's size for a first tensor of ``nbytes``: room after it for the labels and indices (and
    soft labels) of the batch, in whole pages."""
    return _round_up(_round_up(nbytes, ALIGN) + max(INLINE_MAX, nbytes >> 5), PAGE)


class HandoverError(PackedFormatError):
    """A slot's memory could not be taken over from its worker: the worker died while its batch was on the
    way, or its descriptor sharer refused.  The loader names a dead worker instead (``DataLoaderWorkerError``)."""


class BatchSlots:
    """The shared-memory slots DataLoader workers send their batches in, and the main process's mappings.

    Made in the main process with the number of workers; workers get it inside
    the dataset (fork, spawn or forkserver alike).  In a worker, ``take(shape,
    dtype)`` gives a tensor over a free slot of this worker (None outside a
    worker, below ``min_bytes``, or when the main process holds every slot),
    ``hand_back(item, path)`` turns a batch into the message the worker returns,
    and ``end_batch()`` lets go of the slots the batch took and did not send
    (they are never written again: something in the worker may still hold them).

    Args:
        workers: the loader's worker count.
        slots: slots per worker.
        min_bytes: smaller results are not given a slot of their own (they still
            travel in the tail of the batch's slot, or in the message).
        path: the archive, to name in errors.
        directory: where the slot files are made, and at once unlinked (a tmpfs: ``/dev/shm``).
    """

    def __init__(self, workers: int, slots: int = SLOTS_PER_WORKER, min_bytes: int = 0, path: str = "",
                 directory: str = SHARED_DIRECTORY) -> None:
        self.token, self.min_bytes, self.path, self.directory = uuid.uuid4().hex[:16], min_bytes, path, directory
        self.enabled = True
        self.cuda: Optional[torch.device] = None  # the device the main process registers its mappings for
        shape = (max(1, workers), slots)
        self.states = torch.zeros(shape, dtype=torch.uint8).share_memory_()
        self.generations = torch.zeros(shape, dtype=torch.int64).share_memory_()
        self.closing = torch.zeros(1, dtype=torch.uint8).share_memory_()  # set once the main process leaves
        self._local = ProcessLocal(_WorkerSlots)  # a worker's mappings: made on first use in each process
        self.receiver: Optional[Receiver] = Receiver(self.token, directory, self.states, self.closing, path)
        _RECEIVERS[self.token] = self.receiver
        weakref.finalize(self, self.receiver.close)

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["receiver"] = None  # the main process's side stays there
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def renewed(self) -> "BatchSlots":
        """A pool like this one with slots of its own (for workers that run beside this pool's)."""
        other = BatchSlots(self.states.shape[0], self.states.shape[1], self.min_bytes, self.path, self.directory)
        other.pin(self.cuda)
        return other

    def pin(self, device: Optional[torch.device]) -> None:
        """Register every slot the main process maps as pinned memory for CUDA ``device``, once (None: not)."""
        self.cuda = device
        if self.receiver is not None:
            self.receiver.cuda = device

    def reclaim(self) -> int:
        """Free the slots that no batch in the main process uses (their batches were lost with workers
        that stopped); only while none of this pool's workers runs.  Returns how many."""
        return 0 if self.receiver is None else self.receiver.reclaim()

    def close(self) -> None:
        """Drop the main process's mappings (batches still used keep their memory until they go) and
        sweep any slot file left of this pool.  Done when the pool goes; a worker must not run meanwhile."""
        if self.receiver is not None:
            self.receiver.close()

    # ---- in a worker ----------------------------------------------------------------------------------------
    def _worker(self) -> Optional[int]:
        return worker_row(self.states)

    def take(
        self,
        shape: Sequence[int],
        dtype: torch.dtype = torch.uint8,
        memory_format: torch.memory_format = torch.contiguous_format,
    ) -> Optional[torch.Tensor]:
        """A ``shape`` tensor over a free slot of this worker (contiguous, or channels-last when asked
        for a [B,C,H,W] one), or None."""
        shape = tuple(int(n) for n in shape)
        layout = _layout(shape, memory_format)
        nbytes = int(np.prod(layout, dtype=np.int64)) * dtype.itemsize
        worker = self._worker()
        if worker is None or nbytes < max(1, self.min_bytes):
            return None
        local = self._local.get()
        chosen = choose_slot(self.states[worker].numpy(), local.reserved,
                             lambda s: local.capacity(self, worker, s), nbytes)
        if chosen is None:
            return None  # the main process holds every slot: this batch goes the ordinary way
        index, grow = chosen
        if grow:
            self._renew(local, worker, index, capacity_for(nbytes))
        local.reserved.add(index)
        local.tails[index] = _round_up(nbytes, ALIGN)
        raw = local.raw[index][:nbytes]
        return _typed(raw, layout, dtype, shape)

    def _renew(self, local: "_WorkerSlots", worker: int, slot: int, capacity: int) -> None:
        """Give the slot a new generation: memory of ``capacity`` bytes (whoever maps the old one keeps it)."""
        local.forget(slot)
        generation = int(self.generations[worker, slot]) + 1
        try:
            local.make(slot, slot_file(self.directory, self.token, worker, slot, generation), generation, capacity)
        except OSError as exc:
            raise self._slot_error(exc, capacity) from None
        if self.closing[0]:  # the main process is leaving: no batch is received any more
            local.forget(slot)
            raise PackedFormatError(self.path, "the loader's batch slots were closed while a worker ran")
        self.generations[worker, slot] = generation

    def _slot_error(self, exc: OSError, capacity: int) -> PackedFormatError:
        if TooManyOpenFilesError.describes(exc):
            return TooManyOpenFilesError(
                self.path, f"a DataLoader worker has no file descriptor left to hand a batch back with "
                           f"({type(exc).__name__}: {exc}; {TooManyOpenFilesError.usage()})",
                hint=f"{TooManyOpenFilesError.HINT}, or let the workers hold fewer files open "
                     "(for a sharded archive, a lower max_open_parts)")
        if exc.errno == errno.ENOSPC:
            return PackedFormatError(
                self.path, f"{self.directory} has no room left for a {capacity / 2**20:.1f} MiB batch slot of a "
                           f"DataLoader worker ({exc})",
                hint="give the shared-memory file system more room (e.g. `docker run --shm-size=8g`), or use "
                     "fewer workers or smaller batches")
        return PackedFormatError(self.path, f"cannot make a batch slot in {self.directory}: {exc}",
                                 hint=f"check that {self.directory} is a writable tmpfs")

    def hand_back(self, item: Any, path: str) -> Any:
        """What a worker returns for ``item`` (a batch it will not touch again): a ``SlotBatch`` whose
        tensors lie in this worker's slots (those outside one are copied into the tail of the batch's
        slot, or into a free slot, or, when small, carried in the message); only a large tensor with
        no free slot left is handed over the ordinary way.  Outside a worker: ``item``."""
        worker = self._worker()
        if worker is None:
            return item
        local = self._local.get()
        used: Dict[int, int] = {}  # slot -> its place in the message

        def dump() -> bytes:
            buffer = io.BytesIO()
            _SlotPickler(buffer, self, local, worker, used).dump(item)
            return buffer.getvalue()

        payload = pickled(path, dump)
        slots = [(s, local.generation[s], local.capacity(self, worker, s), self._handover(local, s)) for s in used]
        for s in used:  # sent: the main process frees it
            self.states[worker, s] = SENT
            local.reserved.discard(s)
        return SlotBatch(self.token, worker, slots, payload)

    def _handover(self, local: "_WorkerSlots", slot: int) -> Optional[DupFd]:
        try:
            return local.handover(slot)
        except OSError as exc:  # no descriptor left to copy, or no socket for the resource sharer
            raise self._slot_error(exc, int(local.raw[slot].numel())) from None

    def end_batch(self) -> None:
        """Close this batch: slots it took but did not send are let go, not written again."""
        if self._worker() is None:
            return
        local = self._local.get()
        for s in local.reserved:
            local.stale.add(s)
        local.reserved.clear()
        local.tails.clear()


class _WorkerSlots:
    """One worker process's mappings of its slots, and what its current batch has taken."""

    def __init__(self) -> None:
        self.raw: Dict[int, torch.Tensor] = {}  # slot -> uint8 tensor over its whole file
        self.generation: Dict[int, int] = {}
        self.reserved: Set[int] = set()
        self.tails: Dict[int, int] = {}  # slot -> where the next tensor of this batch may go
        self.stale: Set[int] = set()  # let go: renewed before any further use
        self.fds: Dict[int, int] = {}  # slot -> its descriptor, until the first batch sent in it carries it

    def capacity(self, pool: BatchSlots, worker: int, slot: int) -> int:
        """The slot's size in bytes: 0 before this process made it, once let go, or when another
        process of this worker's number (fresh workers of an earlier epoch) made its current generation."""
        if slot in self.stale or self.generation.get(slot) != int(pool.generations[worker, slot]):
            return 0
        raw = self.raw.get(slot)
        return 0 if raw is None else raw.numel()

    def make(self, slot: int, name: str, generation: int, capacity: int) -> None:
        """Make the slot's memory: a file ``capacity`` bytes long, mapped, unlinked at once (no name is
        left to outlive the processes that use it), its descriptor kept for the main process."""
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.unlink(name)
            os.posix_fallocate(fd, 0, capacity)  # a full tmpfs fails here, not with SIGBUS on a write
            mapping = mmap.mmap(fd, capacity)
        except BaseException:
            os.close(fd)
            raise
        self.fds[slot] = fd
        self.raw[slot] = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
        self.generation[slot] = generation
        self.stale.discard(slot)

    def handover(self, slot: int) -> Optional[DupFd]:
        """The slot's descriptor, for the main process to take with the first batch sent in it (None
        after that): a copy held by this process's resource sharer until it is taken."""
        fd = self.fds.pop(slot, None)
        if fd is None:
            return None
        try:
            return DupFd(fd)
        finally:
            os.close(fd)

    def forget(self, slot: int) -> None:
        self.raw.pop(slot, None)
        self.generation.pop(slot, None)
        fd = self.fds.pop(slot, None)
        if fd is not None:  # never sent: nobody else holds this memory
            os.close(fd)

    def slot_of(self, tensor: torch.Tensor) -> Optional[int]:
        """The slot this batch took that ``tensor`` lies in, if any."""
        pointer = tensor.untyped_storage().data_ptr()
        for s in self.reserved:
            if self.raw[s].data_ptr() == pointer:
                return s
        return None


class _SlotPickler(ForkingPickler):
    """Pickles a batch with each CPU tensor as its place in a slot (or its bytes, when small)."""

    def __init__(self, file: io.BytesIO, pool: BatchSlots, local: _WorkerSlots, worker: int,
                 used: Dict[int, int]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.pool, self.local, self.worker, self.used = pool, local, worker, used

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.requires_grad:
            return None
        slot = self.local.slot_of(obj)
        if slot is None and obj.numel():
            slot, obj = self._placed(obj)
        if slot is None:
            if obj.numel() and obj.numel() * obj.element_size() > INLINE_MAX:
                return None  # no free slot left: the ordinary way (a fresh shared buffer)
            if not obj.numel():  # a batch whose samples were all skipped: its shape alone (an empty
                return ("value", obj.dtype, tuple(obj.shape), b"")  # tensor's stride may not view as bytes)
            return ("value", obj.dtype, tuple(obj.shape), obj.contiguous().reshape(-1).view(torch.uint8).numpy()
                    .tobytes())
        place = self.used.setdefault(slot, len(self.used))
        offset = obj.storage_offset() * obj.element_size()
        return ("slot", place, offset, obj.dtype, tuple(obj.shape), tuple(obj.stride()))

    def _placed(self, tensor: torch.Tensor) -> Tuple[Optional[int], torch.Tensor]:
        """(slot, copy) of a tensor outside the slots: in the tail of a slot this batch sends, else in a
        free slot when it is large; (None, tensor) when it stays where it is."""
        nbytes = tensor.numel() * tensor.element_size()
        for slot in self.used:
            start = self.local.tails[slot]
            if start + nbytes <= self.local.raw[slot].numel():
                self.local.tails[slot] = _round_up(start + nbytes, ALIGN)
                copy = self.local.raw[slot][start : start + nbytes].view(tensor.dtype).view(tensor.shape)
                return slot, copy.copy_(tensor)
        if nbytes <= INLINE_MAX:
            return None, tensor
        memory_format = memory_format_of(tensor) if tensor.dim() == 4 else torch.contiguous_format
        taken = self.pool.take(tensor.shape, tensor.dtype, memory_format)
        if taken is None:
            return None, tensor
        taken.copy_(tensor)
        return self.local.slot_of(taken), taken


class SlotBatch:
    """A worker's batch on its way to the main process: the slots it lies in and its pickled form
    (tensors as places in those slots).  It unpickles as the batch itself, its tensors views of the
    main process's mappings."""

    __slots__ = ("token", "worker", "slots", "payload")

    def __init__(self, token: str, worker: int, slots: List[SlotUse], payload: bytes) -> None:
        self.token, self.worker, self.slots, self.payload = token, worker, slots, payload

    def __reduce__(self):
        return _received, (self.token, self.worker, self.slots, self.payload)


# token -> the receiving side of each pool made in this process
_RECEIVERS: "weakref.WeakValueDictionary[str, Receiver]" = weakref.WeakValueDictionary()


def _received(token: str, worker: int, slots: List[SlotUse], payload: bytes) -> Any:
    receiver = _RECEIVERS.get(token)
    if receiver is None:
        raise PackedFormatError(
            None, "a DataLoader worker's batch arrived in a process that does not hold its loader's batch slots",
            hint="receive the batches of make_loader's workers through the PackedLoader it returns")
    return receiver.receive(worker, slots, payload)


class _Mapping:
    """The main process's mapping of one generation of a slot."""

    __slots__ = ("generation", "array", "registered")

    def __init__(self, generation: int, array: np.ndarray, registered: bool) -> None:
        self.generation, self.array, self.registered = generation, array, registered


def _free(states: np.ndarray, held: np.ndarray, lock: threading.RLock, worker: int, slot: int) -> None:
    """A batch's last tensor is gone: its slot is the worker's again."""
    with lock:
        held[worker, slot] -= 1
        if held[worker, slot] <= 0:
            held[worker, slot] = 0
            states[worker, slot] = FREE


class Receiver:
    """The main process's side of a ``BatchSlots``: a mapping per slot, made the first time a batch
    names it, and kept (and, on CUDA, registered as pinned memory) until ``close``."""

    def __init__(self, token: str, directory: str, states: torch.Tensor, closing: torch.Tensor, path: str) -> None:
        self.token, self.directory, self.path, self.owner = token, directory, path, os.getpid()
        self.closing = closing.numpy()
        self.states = states.numpy()
        self.held = np.zeros(self.states.shape, dtype=np.int64)  # batches in this process per slot
        self.lock = threading.RLock()
        self.maps: Dict[Tuple[int, int], _Mapping] = {}
        self.mapped = 0  # slots mapped so far (what a test counts)
        self.cuda: Optional[torch.device] = None
        self.closed = False

    def receive(self, worker: int, slots: List[SlotUse], payload: bytes) -> Any:
        """The batch a ``SlotBatch`` carries, its tensors views of the slots it names."""
        with self.lock:
            if self.closed:
                raise PackedFormatError(self.path, "a batch arrived after its loader's batch slots were closed")
            storages = []
            for slot, generation, capacity, handover in slots:
                view = self._mapping(worker, slot, generation, capacity, handover)[:capacity]  # this batch's own
                self.held[worker, slot] += 1
                weakref.finalize(view, _free, self.states, self.held, self.lock, worker, slot)
                storages.append(torch.from_numpy(view).untyped_storage())
        return _SlotUnpickler(io.BytesIO(payload), storages).load()

    def _mapping(self, worker: int, slot: int, generation: int, capacity: int, handover: Optional[DupFd]
                 ) -> np.ndarray:
        known = self.maps.get((worker, slot))
        if known is not None and known.generation == generation:
            return known.array
        where = f"DataLoader worker {worker}'s batch slot {slot} (generation {generation})"
        if handover is None:
            raise PackedFormatError(self.path, f"{where} arrived without its memory's descriptor",
                                    hint="receive the batches of make_loader's workers through the PackedLoader "
                                         "it returns, each once")
        if known is not None:  # the worker renewed the slot: the old generation is used by nothing now
            self._let_go(known)
        try:
            fd = handover.detach()  # from the worker's resource sharer, once per slot
            try:
                if os.fstat(fd).st_size < capacity:  # a mapping past its end would kill this process at a read
                    raise OSError(errno.EINVAL, f"its memory is smaller than the {capacity} bytes the batch names")
                array = np.frombuffer(mmap.mmap(fd, capacity), dtype=np.uint8)
            finally:
                os.close(fd)
        except (OSError, EOFError, ProcessError) as exc:  # the worker gone, or its sharer refusing us
            raise HandoverError(
                self.path, f"cannot map {where}: {type(exc).__name__}: {exc}",
                hint="the worker may have stopped while its batch was on the way: start the pass again") from None
        registered = self.cuda is not None and _register(array, self.cuda)
        self.maps[(worker, slot)] = _Mapping(generation, array, registered)
        self.mapped += 1
        return array

    def _let_go(self, mapping: _Mapping) -> None:
        if mapping.registered:
            _unregister(mapping.array)
            mapping.registered = False

    def reclaim(self) -> int:
        with self.lock:
            lost = (self.states == SENT) & (self.held == 0)
            self.states[lost] = FREE
            return int(lost.sum())

    def close(self) -> None:
        """Drop the mappings (batches still in use keep theirs) and sweep any file a worker had not
        unlinked yet (one killed between making and unlinking it)."""
        if os.getpid() != self.owner:  # a forked worker's inherited copy: not its to clean up
            return
        self.closing[0] = 1
        with self.lock:
            self.closed = True
            for mapping in self.maps.values():
                self._let_go(mapping)
            self.maps.clear()
        sweep(self.directory, self.token)


def sweep(directory: str, token: str) -> None:
    """Unlink every slot file of the pool ``token``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    start = f"{PREFIX}{token}-"
    for name in names:
        if name.startswith(start):
            _unlink(os.path.join(directory, name))


def _unlink(name: str) -> None:
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def _register(array: np.ndarray, device: torch.device) -> bool:
    """Register a mapping as pinned memory for CUDA copies; False (with a warning) when CUDA refuses."""
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device):
        result = cudart.cudaHostRegister(array.ctypes.data, array.nbytes, CUDA_HOST_REGISTER_PORTABLE)
    if int(getattr(result, "value", result)) != 0:
        warnings.warn(f"packed_formats: cudaHostRegister refused a batch slot ({result}); its batches are "
                      "copied from pageable memory", RuntimeWarning, stacklevel=2)
        return False
    return True


def _unregister(array: np.ndarray) -> None:
    torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)


class _SlotUnpickler(pickle.Unpickler):
    """Unpickles a batch, its tensors views of the slots' storages (in the message's order)."""

    def __init__(self, file: io.BytesIO, storages: List[torch.UntypedStorage]) -> None:
        super().__init__(file)
        self.storages = storages

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if pid[0] == "value":
            _, dtype, shape, data = pid
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape) if data else \
                torch.empty(shape, dtype=dtype)
        _, place, offset, dtype, shape, stride = pid
        size = dtype.itemsize
        return torch.empty(0, dtype=dtype).set_(self.storages[place], offset // size, shape, stride)

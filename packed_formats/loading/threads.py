"""Raw batches that are only a copy, gathered by threads of the loading process instead of worker processes.

A raw archive read with nothing to run on its batches (no transform on the
CPU, no fields) needs one thing per batch: a gather of the samples' stored
bytes into the batch (``mapped``'s ``numpy.take``, a ``memcpy`` per sample
with the GIL released).  Worker processes add to that copy what they cost to
run: a batch handed over through a slot and torch's queues, a Python pass
over the batch in the worker and again in the main process, a process's
start-up and memory.  On 2 cores, with batches of 64 samples of 3x256x256,
that hand-over took as long as the copy itself (a worker spent ~1.5 ms a
batch on it against ~2 ms of copying, and the main process ~0.5 ms).  Here
``num_workers`` threads gather the batches, ``2 * num_workers`` ahead as
DataLoader's default ``prefetch_factor`` would, into buffers this process
reuses once nothing refers to them (``memory.ReusedBuffers``), and hand them
on in order: the batches, their order and their seeds are the workers'.

Threads are taken only where nothing but this library's own copy runs per
batch (``gathers_in_threads``); a transform, fields, a mixture, object
storage, a set of parts, or an explicit ``multiprocessing_context``
keep worker processes.  What threads give up: a file truncated in place while
it is gathered ends the process, as with ``num_workers=0`` (archives are only
ever replaced whole, see ``mapped``).
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Deque, Iterator

import torch

from ..backends.hdf5 import HDF5Backend
from ..backends.lmdb import LMDBBackend
from ..backends.memmap import MemmapBackend
from ..backends.reader import Reader
from ..backends.zip import ZipBackend
from ..handles import ProcessLocal
from .worker import BatchReader

# one archive, read from a map (or by pread, h5py under its lock, or an LMDB read transaction per batch, which
# py-lmdb lets any thread open): safe from threads
BACKENDS = (MemmapBackend, ZipBackend, HDF5Backend, LMDBBackend)
AHEAD = 2  # batches in flight per thread (DataLoader's prefetch_factor)
THREAD_NAME = "packed_formats-gather"


def gathers_in_threads(reader: Reader, batch_reader: BatchReader, num_workers: int, device: torch.device,
                       context: Any) -> bool:
    """Whether ``make_loader``'s batches are only a copy that threads make as well as worker processes:
    a local raw archive of a format read from a map, nothing run on its batches on the CPU, a CPU
    target, and no start method asked for."""
    return (num_workers > 0 and context is None and device.type == "cpu" and reader.mode == "raw"
            and type(reader.backend) in BACKENDS and batch_reader.transform is None and batch_reader.fields is None
            and not batch_reader.own_sizes and batch_reader.send == "batches")


class GatherThreads:
    """Where a DataLoader would stand in ``PackedLoader``: ``iter()`` gives one pass's batches,
    ``dataset[plan]`` for each of ``sampler``'s plans, made by ``num_workers`` threads and handed out
    in order.  A pass left early waits for the batches still being gathered (nothing writes into a
    buffer after its pass ends); the threads end with this object."""

    persistent_workers = True  # nothing to start again between passes
    pin_memory = False
    worker_init_fn = None

    def __init__(self, dataset: BatchReader, sampler: Any, num_workers: int) -> None:
        self.dataset, self.sampler, self.num_workers = dataset, sampler, num_workers
        dataset.keep_buffers(self.buffers_kept(num_workers))
        # this process's threads: a forked child inherits the pool but not its threads, and makes its own
        self._pool = ProcessLocal(functools.partial(ThreadPoolExecutor, num_workers, thread_name_prefix=THREAD_NAME))

    @staticmethod
    def buffers_kept(num_workers: int) -> int:
        """Read buffers kept for reuse: those of the batches in flight, the one handed out, the caller's last."""
        return AHEAD * num_workers + 2

    def __len__(self) -> int:
        return len(self.sampler)

    def _threads(self) -> ThreadPoolExecutor:
        """This process's threads, which end with this object."""
        made = self._pool.made_here()
        pool = self._pool.get()
        if not made:
            weakref.finalize(self, pool.shutdown, wait=False)
        return pool

    def __iter__(self) -> Iterator[Any]:
        pool, plans = self._threads(), iter(self.sampler)
        pending: Deque[Future] = deque()
        try:
            for plan in plans:
                pending.append(pool.submit(self.dataset.__getitem__, plan))
                if len(pending) >= AHEAD * self.num_workers:
                    break
            while pending:
                item = pending.popleft().result()
                plan = next(plans, None)
                if plan is not None:
                    pending.append(pool.submit(self.dataset.__getitem__, plan))
                yield item
                del item
        finally:
            for future in pending:
                future.cancel()
            wait(pending)

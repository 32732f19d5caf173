"""An ordered, memory-bounded map over worker processes, for conversions.

Work is sent in chunks of indices and results come back in index order, with
at most ``2 * workers + 1`` chunks in flight, so memory stays bounded however
large the input.  Large numpy arrays in the results (decoded pixels) travel
through one file per chunk in shared memory (/dev/shm) rather than a pickle
through a pipe: two copies instead of four, which is what let raw conversions
scale with workers.  Workers ignore SIGINT (the main process decides what an
interrupt means and terminates them) and exit by themselves if the main process
dies, even by SIGKILL.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import mmap
import multiprocessing
import os
import shutil
import signal
import tempfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..handles import leave_with_parent

_STATE: Optional[Tuple[Callable[[Any, int], Any], Any]] = None
SPILL_ROOT = "/dev/shm"
SPILL_PREFIX = "packed-formats-convert-"
_SPILL_BYTES = 1 << 15  # arrays at least this large skip the pipe
_RUN_CHUNK = 128  # the most indices sent as one chunk along runs (a parquet row group: 100)


def available_cores() -> int:
    """CPU cores this process may run on (respects affinity masks, e.g. under Slurm)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _start_method() -> str:
    # fork starts workers in milliseconds; elsewhere (macOS, Windows) use spawn.
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def _init_worker(function: Callable[[Any, int], Any], context: Any, parent: int) -> None:
    global _STATE
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    _STATE = (function, context)
    leave_with_parent(parent)  # ends with the main process, a forkserver's children too


def _run_chunk(
    number: int, arguments: Sequence[Any], spill_dir: Optional[str] = None
) -> Tuple[Optional[str], List[Any]]:
    """``function(context, a)`` for each ``a`` of chunk ``number``, in a worker."""
    assert _STATE is not None, "_init_worker runs first in every worker"
    function, context = _STATE
    results = [function(context, a) for a in arguments]
    if spill_dir is None:
        return None, results
    return _spill(results, os.path.join(spill_dir, f"chunk-{number}"))


class _Spilled(NamedTuple):
    """Where an array of a result lies in its chunk's spill file."""

    offset: int
    shape: Tuple[int, ...]
    dtype: str


def _spill(results: List[Any], path: str) -> Tuple[Optional[str], List[Any]]:
    """Write the large arrays of tuple results to ``path``, leaving _Spilled in their place.

    Where the file cannot be written (a small /dev/shm is full), the results go
    through the pipe as they are.
    """
    out, offset = [], 0
    try:
        with open(path, "wb") as file:
            for result in results:
                if isinstance(result, tuple):
                    items: List[Any] = []
                    for item in result:
                        if isinstance(item, np.ndarray) and item.nbytes >= _SPILL_BYTES:
                            file.write(np.ascontiguousarray(item).data)
                            items.append(_Spilled(offset, item.shape, item.dtype.str))
                            offset += item.nbytes
                        else:
                            items.append(item)
                    result = tuple(items)
                out.append(result)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None, results
    return path, out


def _restore(path: Optional[str], results: List[Any]) -> List[Any]:
    """The results of one chunk with their spilled arrays mapped back, without a copy.

    The mapping is private (writes stay in this process) and outlives the
    unlinked file until the last array on it is gone.
    """
    if path is None:
        return results
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        data = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) if size else bytearray()
    os.unlink(path)
    out = []
    for result in results:
        if isinstance(result, tuple):
            result = tuple(
                np.frombuffer(data, item.dtype, int(np.prod(item.shape)), item.offset).reshape(item.shape)
                if isinstance(item, _Spilled) else item
                for item in result
            )
        out.append(result)
    return out


@contextlib.contextmanager
def _spill_directory() -> Iterator[Optional[str]]:
    """A private directory in shared memory for this map's chunks (None where there is none), removed after."""
    if not os.path.isdir(SPILL_ROOT) or not os.access(SPILL_ROOT, os.W_OK):
        yield None
        return
    _remove_orphaned_spills()
    directory = tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{os.getpid()}-", dir=SPILL_ROOT)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _remove_orphaned_spills() -> None:
    """Remove spill directories of conversions whose process is gone (killed by SIGKILL, say)."""
    for name in os.listdir(SPILL_ROOT):
        if not name.startswith(SPILL_PREFIX):
            continue
        pid = name[len(SPILL_PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(SPILL_ROOT, name), ignore_errors=True)


@contextlib.contextmanager
def ordered_map(
    function: Callable[[Any, Any], Any], context: Any, count: int, workers: int, chunk_size: int = 0,
    items: Optional[Iterator[Any]] = None, start_method: Optional[str] = None, runs: Optional[Sequence[int]] = None,
) -> Iterator[Iterator[Any]]:
    """Yield an iterator of ``function(context, i)`` for i in range(count), in order.

    ``function`` must be a module-level function; ``context`` is handed to each
    worker once.  With ``items`` (``count`` values this process reads in order,
    such as the members of a compressed tar), call i gets the i-th item instead
    of i.  With ``runs`` (the first index of each run of indices that the
    function reads together, ascending from 0: a row group of a parquet file)
    a chunk is a whole run where it can be (``_run_chunks``), so no two workers
    read the same run.  At most ``2 * workers + 1`` chunks are in flight.  With ``workers <= 1``
    everything runs in this process.  The workers are started on entry (before
    the caller opens any output file, so they inherit none) and are gone on
    leaving the block, however it is left.  ``start_method``: how they start
    (fork, spawn, forkserver; default: fork where there is fork).

    Raises:
        WorkerDiedError: a worker process was killed (e.g. by the out-of-memory killer).
    """
    arguments: Iterator[Any] = iter(range(count)) if items is None else items
    if workers <= 1 or count <= 1:
        yield (function(context, a) for a in arguments)
        return
    if runs is not None and items is None:
        pieces: Iterator[List[Any]] = _run_chunks(runs, count, workers)
    else:
        chunk_size = chunk_size or max(1, min(16, count // (16 * workers)))  # small chunks: even finish
        pieces = iter(lambda: list(itertools.islice(arguments, chunk_size)), [])
    with _spill_directory() as spill_dir:
        executor = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context(start_method or _start_method()),
            initializer=_init_worker,
            initargs=(function, context, os.getpid()),
        )
        try:
            chunks = enumerate(pieces)
            pending: collections.deque = collections.deque()
            for number, chunk in itertools.islice(chunks, 2 * workers + 1):
                pending.append(_submit(executor, number, chunk, spill_dir))
            yield _drain(executor, chunks, pending, spill_dir)
        finally:
            executor.shutdown(wait=True, cancel_futures=True)


def _run_chunks(runs: Sequence[int], count: int, workers: int) -> Iterator[List[int]]:
    """The chunks of indices 0 .. count - 1 along ``runs``: whole runs, short ones together, up to ``longest``
    indices; a longer run is cut in even pieces.  ``longest`` is at least the plain chunks' 16, at most
    ``_RUN_CHUNK`` (what is in flight stays bounded) and a share of two chunks per worker (a few long runs
    must not leave workers idle).  Every index comes once, in order, whatever ``runs`` holds."""
    longest = max(16, min(_RUN_CHUNK, count // (2 * workers)))
    start = stop = 0  # the chunk being gathered: start .. stop - 1
    for bound in itertools.chain((int(r) for r in runs), [count]):
        bound = min(bound, count)
        if bound <= stop:
            continue
        if bound - start > longest and stop > start:  # the next run does not fit beside what is gathered
            yield list(range(start, stop))
            start = stop
        pieces = -(-(bound - start) // longest)
        for k in range(pieces - 1):  # a run longer than a chunk: even pieces, the last one kept gathering
            yield list(range(start + (bound - start) * k // pieces, start + (bound - start) * (k + 1) // pieces))
        start, stop = start + (bound - start) * (pieces - 1) // pieces, bound
    if stop > start:
        yield list(range(start, stop))


class WorkerDiedError(RuntimeError):
    """A worker process ended abruptly (killed by a signal or the out-of-memory killer)."""


def _drain(executor: ProcessPoolExecutor, chunks: Iterator[Tuple[int, list]], pending: collections.deque,
           spill_dir: Optional[str]) -> Iterator[Any]:
    while pending:
        future = pending[0][0]
        try:
            results = _restore(*future.result())
        except BrokenProcessPool:
            held = [(a, b) for _, a, b in pending if a is not None]
            which = f" while it held one of samples {held[0][0]}-{max(b for _, b in held)}" if held else ""
            raise WorkerDiedError(f"a conversion worker process died{which} (killed, out of memory, or a crash "
                                  "in the code it ran)") from None
        pending.popleft()
        following = next(chunks, None)
        if following is not None:
            pending.append(_submit(executor, following[0], following[1], spill_dir))
        yield from results


def _submit(executor: ProcessPoolExecutor, number: int, chunk: list, spill_dir: Optional[str]
            ) -> Tuple[Any, Optional[int], Optional[int]]:
    """(the future of chunk ``number``, its first and last sample index when its arguments are indices)."""
    future = executor.submit(_run_chunk, number, chunk, spill_dir)
    indices = [a if isinstance(a, int) else a[0] if isinstance(a, tuple) and a and isinstance(a[0], int) else None
               for a in (chunk[0], chunk[-1])]
    return future, indices[0], indices[1]

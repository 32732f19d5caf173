"""An ordered, memory-bounded map over worker processes, for conversions.

Work is sent in chunks of indices and results come back in index order, with
at most ``2 * workers + 1`` chunks in flight, so memory stays bounded however
large the input.  Workers ignore SIGINT (the main process decides what an interrupt
means and terminates them) and exit by themselves if the main process dies,
even by SIGKILL.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterator, List, Optional, Tuple

_STATE: Optional[Tuple[Callable[[Any, int], Any], Any]] = None
_WATCH_SECONDS = 0.5


def available_cores() -> int:
    """CPU cores this process may run on (respects affinity masks, e.g. under Slurm)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
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
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCH_SECONDS)
    os._exit(1)


def _run_chunk(indices: range) -> List[Any]:
    function, context = _STATE
    return [function(context, i) for i in indices]


@contextlib.contextmanager
def ordered_map(
    function: Callable[[Any, int], Any], context: Any, count: int, workers: int, chunk_size: int = 0
) -> Iterator[Iterator[Any]]:
    """Yield an iterator of ``function(context, i)`` for i in range(count), in order.

    ``function`` must be a module-level function; ``context`` is handed to each
    worker once.  With ``workers <= 1`` everything runs in this process.  The
    workers are started on entry (before the caller opens any output file, so
    they inherit none) and are gone on leaving the block, however it is left.

    Raises:
        WorkerDiedError: a worker process was killed (e.g. by the out-of-memory killer).
    """
    if workers <= 1 or count <= 1:
        yield (function(context, i) for i in range(count))
        return
    chunk_size = chunk_size or max(1, min(16, count // (16 * workers)))  # small chunks: even finish
    executor = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context(_start_method()),
        initializer=_init_worker,
        initargs=(function, context, os.getpid()),
    )
    try:
        chunks = (range(s, min(count, s + chunk_size)) for s in range(0, count, chunk_size))
        pending: collections.deque = collections.deque()
        for chunk in itertools.islice(chunks, 2 * workers + 1):
            pending.append(executor.submit(_run_chunk, chunk))
        yield _drain(executor, chunks, pending)
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


class WorkerDiedError(RuntimeError):
    """A worker process ended abruptly (killed by a signal or the out-of-memory killer)."""


def _drain(executor: ProcessPoolExecutor, chunks: Iterator[range], pending: collections.deque) -> Iterator[Any]:
    while pending:
        try:
            results = pending.popleft().result()
        except BrokenProcessPool:
            raise WorkerDiedError("a conversion worker process died (out of memory?)") from None
        chunk = next(chunks, None)
        if chunk is not None:
            pending.append(executor.submit(_run_chunk, chunk))
        yield from results

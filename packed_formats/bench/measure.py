"""Honest timing of a data loader, epoch by epoch, and peak memory while it runs.

Per epoch: ``first_batch_s`` is the time from asking for an iterator to holding
the first batch (worker start-up included).  The first ``warmup`` batches of
every epoch are then excluded; images/s is the number of samples actually
delivered after them divided by the time from the end of the last warm-up
batch to the arrival of the last batch.  Epochs are timed separately and
summarised by median, min and max.
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Sized

from .pagecache import evict, warm


class Beside(Protocol):
    """A reference measured beside each epoch of a loader (``references.BoundBeside``), in a process of its own."""

    pid: Optional[int]

    def rates(self, seconds: float) -> Dict[str, float]: ...


def batch_size_of(batch: Any) -> int:
    """Samples in one delivered batch: ``(images, labels)`` with images a tensor or a list."""
    images: Any = batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch
    images = getattr(images, "images", images)
    if hasattr(images, "shape"):
        return int(images.shape[0])
    return len(images)


def wait_for(batch: Any) -> None:
    """Wait until a batch on a CUDA device is ready (its copy and transform ran on the current stream).

    CUDA work is asynchronous; without this a GPU loader would be timed by how
    fast it queues work, not by when its batches exist.
    """
    images = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if getattr(images, "is_cuda", False):
        import torch

        torch.cuda.current_stream(images.device).synchronize()


def read_pss(pid: int) -> Optional[int]:
    """Proportional set size of ``pid`` in bytes from /proc/PID/smaps_rollup, or None."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as file:
            for line in file:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def child_pids() -> set:
    """The process ids of this process's children now (a loader's are those that come after)."""
    import psutil

    try:
        return {child.pid for child in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


class MemorySampler:
    """Samples the memory of this process and of its child processes in a background thread.

    Children are the DataLoader workers (under forkserver also the fork
    server).  PSS is used where /proc/PID/smaps_rollup exists, so pages shared
    by workers (a memory-mapped archive) are not counted once per worker;
    otherwise RSS from psutil.

    Reading smaps_rollup walks a process's page tables: ~20 ms for a process
    that maps a 576 MiB archive.  Sampling three such processes every 50 ms
    would keep most of a core busy and slow the very loader being timed (on a
    2-core machine, loaders that map large archives most of all), so the
    sampler waits at least ``1 / MAX_SHARE - 1`` times as long as its last
    sample took: it uses at most ~MAX_SHARE of one core.
    """

    MAX_SHARE = 0.03

    def __init__(self, interval: float = 0.05, ignore: Iterable[Optional[int]] = ()) -> None:
        self.interval = interval
        self.ignore = set(ignore)  # child processes that are not the loader's (a reference measured beside it,
        # processes this one had before the loader: a fork server or a pool another part of the program left)
        self.last_cost = 0.0
        self.metric = "pss" if read_pss(os.getpid()) is not None else "rss"
        self.peak_main = 0
        self.peak_workers_total = 0
        self.peak_worker = 0
        self.max_workers_seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)

    def _measure(self, process) -> int:
        if self.metric == "pss":
            value = read_pss(process.pid)
            if value is not None:
                return value
        try:
            return int(process.memory_info().rss)
        except Exception:
            return 0

    def sample(self) -> None:
        import psutil

        started = time.perf_counter()
        me = psutil.Process()
        self.peak_main = max(self.peak_main, self._measure(me))
        try:
            children = [c for c in me.children(recursive=True) if c.pid not in self.ignore]
        except psutil.Error:
            children = []
        sizes = [self._measure(c) for c in children]
        self.max_workers_seen = max(self.max_workers_seen, len(sizes))
        self.peak_workers_total = max(self.peak_workers_total, sum(sizes))
        self.peak_worker = max([self.peak_worker] + sizes)
        self.last_cost = time.perf_counter() - started

    def pause(self) -> float:
        """Seconds to wait before the next sample."""
        return max(self.interval, self.last_cost * (1 / self.MAX_SHARE - 1))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.pause())

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> Dict[str, Any]:
        mib = 2**20
        return {
            "metric": self.metric,
            "peak_main_mib": round(self.peak_main / mib, 1),
            "peak_workers_total_mib": round(self.peak_workers_total / mib, 1),
            "peak_worker_mib": round(self.peak_worker / mib, 1),
            "child_processes_seen": self.max_workers_seen,
        }


def time_epoch(loader: Iterable, warmup: int, max_batches: Optional[int] = None,
               after_last_batch: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """Iterate ``loader`` once and time it (see the module docstring).

    ``after_last_batch`` runs once the last batch has arrived, outside the timed span, while the
    loader's workers still run (before the iterator is asked for more, when the loader has a length:
    torch ends workers that are not persistent once their iterator is exhausted).  It ran at the
    first batch once: a loader that prefetches went on reading meanwhile, untimed, and a memory
    sample of ~25 ms there let threads gathering batches of 256 of a 2,048-sample set have four of
    its seven timed batches ready (1.8x their rate).
    """
    total = len(loader) if isinstance(loader, Sized) else None
    if max_batches is not None:
        total = max_batches if total is None else min(total, max_batches)
    start = time.perf_counter()
    iterator = iter(loader)
    images = batches = timed_images = 0
    first_batch_s = None
    timed_from = None
    last = start
    for batch in iterator:
        wait_for(batch)
        last = time.perf_counter()
        n = batch_size_of(batch)
        batches += 1
        images += n
        if first_batch_s is None:
            first_batch_s = last - start
        if batches == warmup:
            timed_from = last
        elif batches > warmup:
            timed_images += n
        del batch
        if batches == total and after_last_batch is not None:
            after_last_batch()
            after_last_batch = None
        if max_batches is not None and batches >= max_batches:
            break
    if after_last_batch is not None:  # no length, or fewer batches than it said
        after_last_batch()
    del iterator  # shuts the workers down before the next epoch starts
    gc.collect()
    if warmup == 0:
        timed_from, timed_images = start, images
    seconds = (last - timed_from) if timed_from is not None else 0.0
    return {
        "batches": batches,
        "images": images,
        "warmup_batches": min(warmup, batches),
        "timed_images": timed_images,
        "timed_seconds": seconds,
        "images_per_s": timed_images / seconds if seconds > 0 and timed_images else None,
        "first_batch_s": first_batch_s,
        "epoch_seconds": last - start,
    }


def summarise(values: List[Optional[float]]) -> Dict[str, Optional[float]]:
    """Median, min, max and relative spread ((max - min) / median) of the defined values."""
    defined = [v for v in values if v is not None]
    if not defined:
        return {"median": None, "min": None, "max": None, "spread": None, "n": 0}
    median = statistics.median(defined)
    spread = (max(defined) - min(defined)) / median if median else None
    return {"median": median, "min": min(defined), "max": max(defined), "spread": spread, "n": len(defined)}


def time_loader(
    make_loader: Callable[[], Iterable],
    epochs: int,
    warmup: int,
    max_batches: Optional[int] = None,
    cold_path: Optional[str] = None,
    warm_path: Optional[str] = None,
    beside: Optional["Beside"] = None,
) -> Dict[str, Any]:
    """Time ``epochs`` passes over the loader that ``make_loader()`` builds.

    ``beside.rates(seconds)``, when given, is measured after each epoch, outside its timing, for as long as
    the epoch was timed (a reference met in the same state of the machine), and kept as the epoch's
    ``beside``; its process is not the loader's (left out of the memory measured).

    Warm runs read ``warm_path`` (when given) into the page cache, then build
    the loader once and reuse it.  Cold runs (``cold_path`` given) drop the
    previous loader, evict ``cold_path`` from the page cache and build a fresh
    loader before each epoch, so that no process still maps the archive
    (mapped pages cannot be evicted).
    """
    records = []
    warmed = warm(warm_path) if warm_path and not cold_path else None
    others = child_pids() | ({beside.pid} if beside is not None else set())  # processes before the loader's
    loader: Optional[Iterable] = None if cold_path else make_loader()
    with MemorySampler(ignore=others) as sampler:
        for epoch in range(epochs):
            eviction = None
            if cold_path:
                loader = None
                gc.collect()
                eviction = evict(cold_path)
                loader = make_loader()
            assert loader is not None  # built once above, or just now for a cold epoch
            record = time_epoch(loader, warmup, max_batches, after_last_batch=sampler.sample)
            record["epoch"] = epoch
            if beside is not None:
                record["beside"] = beside.rates(record["timed_seconds"] or record["epoch_seconds"])
            if eviction is not None:
                record["eviction"] = eviction
            records.append(record)
        sampler.sample()
    if not any(r["timed_images"] for r in records):
        raise ValueError(
            f"no batches were left to time after {warmup} warm-up batches per epoch; "
            "lower --warmup or --batch-size, or raise --max-batches"
        )
    result = {
        "epochs": records,
        "images_per_s": summarise([r["images_per_s"] for r in records]),
        "first_batch_s": summarise([r["first_batch_s"] for r in records]),
        "memory": sampler.result(),
    }
    if warmed is not None:
        result["warmed"] = warmed
    if getattr(loader, "worker_kind", None) is not None:  # make_loader's: "processes" or "threads"
        result["worker_kind"] = loader.worker_kind  # type: ignore[union-attr]
    return result

"""Fetch the parts that the next batches read before the workers ask for them, and keep them.

The loader's sampler runs in the main process, a few batches ahead of the workers (DataLoader
asks for ``prefetch_factor`` batches per worker).  For a remote set it hands each plan's
look-ahead (the sample order of the next few batches) to a ``Prefetcher``, which
downloads the parts those samples live in, in the order they are first read, into the
node-local cache with at most ``concurrency`` downloads at once.  A worker that needs a part
being downloaded waits for it (the part's lock); one in the cache is read at once.

A part fetched ahead is *pinned* (the prefetcher holds its lease) from when it is fetched until
``lag`` plans after it left the look-ahead, by when the workers hold it themselves: a bounded
cache never evicts a part between its download and its reading (which would fetch it twice).

Its threads exist only while there is something to fetch, and end when the queue is empty, so
no thread of ours is alive when a DataLoader forks its workers.  A failed prefetch is left to
the worker that needs the part, which raises the named error itself.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Deque, Dict, List, Set

import numpy as np

DEFAULT_CONCURRENCY = 4  # small parts are latency-bound: a few requests in flight
MOST_AHEAD_PARTS = 4


class Prefetcher:
    """Fetches and pins parts of ``backend`` (a RemoteSetBackend) ahead of the reading, ``concurrency`` at a time.

    ``lag``: how many plans a part stays pinned after it left the look-ahead (the batches the
    DataLoader has planned but its workers not yet read: ``prefetch_factor * num_workers``).
    """

    def __init__(self, backend: Any, concurrency: int = DEFAULT_CONCURRENCY, lag: int = 2) -> None:
        self.backend, self.concurrency, self.lag = backend, max(1, int(concurrency)), max(1, int(lag))
        fits = backend.parts_that_fit()
        # parts queued past the one the look-ahead starts in: a bounded cache must keep what is read now
        self.most_ahead = MOST_AHEAD_PARTS if fits is None else min(MOST_AHEAD_PARTS, fits // 4)
        # parts pinned at once: the look-ahead's first, then the latest plans' (the workers hold their own)
        self.most_pinned = 4 * MOST_AHEAD_PARTS if fits is None else max(1, fits // 4)
        self._lock = threading.Lock()
        self._queue: Deque[int] = collections.deque()
        self._wanted: Set[int] = set()  # parts to hold: in the look-ahead, or in it within the last `lag` plans
        self._recent: Deque[List[int]] = collections.deque()
        self._pinned: Dict[int, Any] = {}  # part -> its Lease
        self._queued: Set[int] = set()
        self._running = 0
        self.fetched = 0  # parts this prefetcher fetched or found in place

    def __getstate__(self) -> Dict[str, Any]:
        return {"backend": self.backend, "concurrency": self.concurrency, "lag": self.lag}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["backend"], state["concurrency"], state["lag"])  # type: ignore[misc]

    def new_epoch(self) -> None:
        """Forget the look-ahead and let every pinned part go (a new pass reads them again)."""
        with self._lock:
            self._queue.clear()
            self._queued.clear()
            self._recent.clear()
            self._wanted.clear()
            released, self._pinned = list(self._pinned.values()), {}
        for lease in released:
            lease.release()

    close = new_epoch

    def ahead(self, order: np.ndarray, current: int = 0) -> None:
        """A plan's look-ahead: pin the parts of the samples ``order`` (first read first), and fetch
        those past its first ``current`` samples (the batch about to be read, which fetches its own)."""
        starts = self.backend.starts
        owners = np.searchsorted(starts, np.asarray(order), side="right") - 1 if len(order) else np.zeros(0, int)
        parts, first = np.unique(owners, return_index=True)
        ordered = parts[np.argsort(first, kind="stable")].tolist()
        reading = set(owners[:current].tolist())
        now = [p for p in ordered if p in reading] + [p for p in ordered if p not in reading][: 1 + self.most_ahead]
        with self._lock:
            self._recent.append(now)
            while len(self._recent) > self.lag + 1:
                self._recent.popleft()
            wanted: List[int] = []
            for plan in reversed(self._recent):  # this plan's parts first, then the latest plans' before it
                wanted.extend(p for p in plan if p not in wanted)
            self._wanted = set(wanted[: self.most_pinned + len(reading)])
            released = [self._pinned.pop(p) for p in list(self._pinned) if p not in self._wanted]
            for p in now:
                if p not in reading and p in self._wanted and p not in self._pinned and p not in self._queued:
                    self._queued.add(p)
                    self._queue.append(p)
            while self._running < self.concurrency and self._queue:
                self._running += 1
                threading.Thread(target=self._drain, name="packed_formats-prefetch", daemon=True).start()
        for lease in released:
            lease.release()

    def pinned(self) -> List[int]:
        with self._lock:
            return sorted(self._pinned)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running -= 1
                    return
                p = self._queue.popleft()
                if p not in self._wanted:  # the reading went past it before its turn
                    self._queued.discard(p)
                    continue
            try:
                lease = self.backend.pin(p)
            except Exception:  # noqa: BLE001 - the worker that reads the part raises the named error
                with self._lock:
                    self._queued.discard(p)
                continue
            with self._lock:
                self._queued.discard(p)
                self.fetched += 1
                keep = p in self._wanted and p not in self._pinned
                if keep:
                    self._pinned[p] = lease
            if not keep:
                lease.release()

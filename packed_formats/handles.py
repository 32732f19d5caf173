"""The one place that knows about processes.

Two primitives, both made lazily in each process and never carried across one:

* ``ProcessLocal``: a value of this process only (read buffers, the verified
  bitmap of a reader, a worker's shared-memory slots).  It is made by a
  picklable factory on first use, dropped when pickled (spawn, forkserver) and
  made anew in a forked child.
* ``SharedHandle``: this process's use of an open resource (HDF5 file, LMDB
  environment, file descriptor, memory map), one per key per process, shared
  by every reader of that key in the process (LMDB >= 2 refuses a second
  environment on one file; HDF5 silently merges a second open of one file
  anyway).  Keys name the file *and its identity* (device, inode, size,
  mtime), so an archive replaced in place gets a fresh handle, never the old one.

When a process forks, the child inherits the parent's table.  The first
request in the child notices that the table's pid is not its own, *discards*
every inherited handle (``Handle.discard_inherited``: closed where the library
requires that, since h5py and lmdb reuse or reject an inherited handle
otherwise) and opens fresh ones.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generic, Hashable, Optional, Tuple, TypeVar

log = logging.getLogger("packed_formats")

Key = Tuple[Hashable, ...]
T = TypeVar("T")


@dataclass
class _Entry:
    handle: Any
    close: Callable[[Any], None]
    discard: Callable[[Any], None]
    users: int = 0
    worker_id: Optional[int] = None
    pid: int = field(default_factory=os.getpid)  # the process that opened it


@dataclass
class _Table:
    pid: int = field(default_factory=os.getpid)
    entries: Dict[Key, _Entry] = field(default_factory=dict)
    opens: int = 0  # handles opened by this process, for diagnostics and tests


# Re-entrant: opening a handle can run the garbage collector, whose Reader.__del__
# releases another handle from inside acquire() on the same thread.
_lock = threading.RLock()
_table = _Table()


def _worker_id() -> Optional[int]:
    """The DataLoader worker id of this process, if it is one (which has imported torch.utils.data:
    a process that has not is no worker, and opening an archive in it never imports torch)."""
    data = sys.modules.get("torch.utils.data")
    info = None if data is None else data.get_worker_info()
    return None if info is None else info.id


def _own_table() -> _Table:
    """This process's table, after discarding what a fork left behind."""
    global _table
    if _table.pid != os.getpid():
        inherited = _table
        _table = _Table()
        for key, entry in inherited.entries.items():
            try:
                entry.discard(entry.handle)
            except Exception as exc:  # an inherited handle is dropped whatever happens
                log.debug("discarding inherited handle %s failed: %r", key, exc)
            log.debug("pid %d discarded handle %s inherited from pid %d", _table.pid, key, inherited.pid)
    return _table


def acquire(
    key: Key,
    open: Callable[[], Any],
    close: Callable[[Any], None],
    discard: Optional[Callable[[Any], None]] = None,
) -> Any:
    """This process's handle for ``key``, opened with ``open()`` on first use.

    ``close`` releases a handle of this process; ``discard`` (default: forget it
    without touching it) deals with one inherited through fork.  Each acquire
    must be paired with one ``release``.
    """
    with _lock:
        table = _own_table()
        entry = table.entries.get(key)
        if entry is None:
            handle = open()
            entry = _Entry(handle, close, discard or _forget, worker_id=_worker_id())
            table.entries[key] = entry
            table.opens += 1
            log.debug("pid %d (worker %s) opened %s", table.pid, entry.worker_id, key)
        entry.users += 1
        return entry.handle


def release(key: Key) -> None:
    """Give back one use of this process's handle; close it when unused."""
    with _lock:
        table = _own_table()
        entry = table.entries.get(key)
        if entry is None:
            return
        entry.users -= 1
        if entry.users <= 0:
            del table.entries[key]
            entry.close(entry.handle)


def _forget(handle: Any) -> None:
    """Default discard: leave an inherited handle alone (the parent owns it)."""


def open_handles() -> Dict[Key, Tuple[int, Optional[int], int]]:
    """Diagnostics: this process's open handles as key -> (opening pid, worker id, users).

    The pid is the one recorded when the handle was opened, so a handle that
    crossed a fork without being discarded shows its parent's pid.
    """
    with _lock:
        table = _own_table()
        return {k: (e.pid, e.worker_id, e.users) for k, e in table.entries.items()}


def opens_in_this_process() -> int:
    """How many handles this process has opened itself (not inherited)."""
    with _lock:
        return _own_table().opens


class ProcessLocal(Generic[T]):
    """A value of this process only, made by ``factory()`` on first use in each process.

    Pickles as its factory (which must be picklable); a forked child that
    inherits the parent's value makes its own on first ``get()``.
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._pid: Optional[int] = None
        self._value: Optional[T] = None

    def get(self) -> T:
        """This process's value."""
        if self._pid != os.getpid():
            with _lock:  # threads racing to the first use must share one value
                if self._pid != os.getpid():
                    self._value, self._pid = self._factory(), os.getpid()
        return self._value  # type: ignore[return-value]  # set above for this pid

    def made_here(self) -> bool:
        """Whether this process has made its value already."""
        return self._pid == os.getpid()

    def clear(self) -> None:
        """Forget this process's value (the next ``get()`` makes a new one)."""
        self._pid, self._value = None, None

    def __getstate__(self) -> Dict[str, Any]:
        return {"_factory": self._factory, "_pid": None, "_value": None}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)


class SharedHandle:
    """One user's claim on this process's shared handle for ``key``.

    ``get(open)`` acquires the handle on first use in each process (fresh,
    forked or unpickled owner), opening it with ``open()`` if no user in the
    process holds it yet, and returns it; ``release()`` gives the use back.
    It pickles as its key and callables, never the handle.

    The opener is given to each ``get`` rather than kept: an owner that kept
    one of its own bound methods here would hold itself in a reference cycle,
    and its handle would stay open after its last user dropped it, until the
    garbage collector ran (HDF5 and LMDB then refuse other opens of the file).
    """

    def __init__(
        self,
        key: Key,
        close: Callable[[Any], None],
        discard: Optional[Callable[[Any], None]] = None,
    ) -> None:
        self.key, self._close, self._discard = key, close, discard
        self._held_in_pid: Optional[int] = None

    def get(self, open: Callable[[], Any]) -> Any:
        """This process's handle (opened with ``open()`` on first use)."""
        pid = os.getpid()
        if self._held_in_pid != pid:
            with _lock:  # threads racing to the first use must take one use, not one each
                if self._held_in_pid != pid:
                    handle = acquire(self.key, open, self._close, self._discard)
                    self._held_in_pid = pid
                    return handle
        return _table.entries[self.key].handle

    def held(self) -> bool:
        """Whether this process holds a use of the handle."""
        return self._held_in_pid == os.getpid()

    def release(self) -> None:
        """Give back this process's use (closing the handle when it was the last)."""
        with _lock:
            if self._held_in_pid == os.getpid():
                release(self.key)
            self._held_in_pid = None

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_held_in_pid"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)


def borrowed(key: Key, open: Callable[[], Any], close: Callable[[Any], None]) -> "_Borrowed":
    """A context manager giving this process's handle for ``key`` for one block: the open
    one if some user holds it, else one opened for the block and closed after it."""
    return _Borrowed(SharedHandle(key, close), open)


class _Borrowed:
    def __init__(self, claim: SharedHandle, open: Callable[[], Any]) -> None:
        self.claim, self.open = claim, open

    def __enter__(self) -> Any:
        return self.claim.get(self.open)

    def __exit__(self, *exc: Any) -> None:
        self.claim.release()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended: a process that ended (killed, say) stays a zombie,
    which ``pid_alive`` still finds, until its parent reaps it."""
    if not pid_alive(pid):
        return False
    if not os.path.isdir("/proc/self"):  # no /proc here: alive is all that can be known
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except FileNotFoundError:  # gone since
        return False
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


# ---- a worker ends with its main process ------------------------------------------------------------------
# A worker process (the loader's DataLoader workers, the conversion's pool) looks for its parent only between
# tasks, and then leaves the ordinary way, which waits for each queue's feeder thread.  When the main process is
# killed, a feeder may be blocked for good writing into a full pipe whose read end the sibling workers hold, so
# the workers stay orphans, with their memory, until someone kills them.  Each therefore watches its parent (and
# the main process: a forkserver's children's grandparent) from a thread of its own, and once either is gone
# ends at once, waiting for nothing (``os._exit``).
WATCH_INTERVAL = 0.2  # seconds between two looks at the parent

_watched_in: Optional[int] = None  # the process whose watcher runs (a forked child starts its own)


def leave_with_parent(owner: Optional[int] = None, interval: float = WATCH_INTERVAL) -> None:
    """Start this process's watcher of its parent and of ``owner`` (by default the process that made this
    one, ``multiprocessing.parent_process()``), once per process: a worker calls it as it starts."""
    global _watched_in
    if _watched_in == os.getpid():
        return
    _watched_in = os.getpid()
    parent = os.getppid()
    if owner is None:
        import multiprocessing

        creator = multiprocessing.parent_process()
        owner = parent if creator is None or creator.pid is None else creator.pid
    threading.Thread(target=_watch, args=(parent, owner, interval), name="packed_formats-parent-watch",
                     daemon=True).start()


def _watch(parent: int, owner: int, interval: float) -> None:
    import time

    while os.getppid() == parent and running(owner):  # a killed main process may not be reaped yet (a zombie):
        time.sleep(interval)  # a worker that starts watching only then would otherwise watch it forever
    os._exit(0)  # no parent to report to: the ordinary exit could wait forever on a feeder thread

"""The one place that knows about processes.

A reader's open file (HDF5 file, LMDB environment, file descriptor, memory map)
belongs to the process that opened it.  This module hands out such handles
lazily, one per (kind, path) per process, shared by every reader of that path
in the process (LMDB >= 2 refuses a second environment on one path; HDF5
silently merges a second open of one file anyway).

When a process forks, the child inherits the parent's table.  The first
request in the child notices that the table's pid is not its own, *discards*
every inherited handle (closing it where the library requires that: h5py and
lmdb reuse or reject an inherited handle otherwise) and opens fresh ones.
Handles never travel through pickle: readers drop them in ``__getstate__``
and reopen on first use on the other side (spawn, forkserver).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

log = logging.getLogger("packed_formats")

Key = Tuple[str, str]


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
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    info = get_worker_info()
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


class ProcessLocalHandle:
    """Mixin for readers: ``self._handle()`` is this process's open handle.

    Subclasses define ``_handle_key()``, ``_open_handle()`` and optionally
    ``_close_handle(h)`` and ``_discard_inherited(h)``.  State that crosses a
    process boundary is a description (path, index arrays), never a handle.
    """

    _held_in_pid: Optional[int] = None

    def _handle_key(self) -> Key:  # pragma: no cover - abstract
        raise NotImplementedError

    def _open_handle(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def _close_handle(handle: Any) -> None:
        handle.close()

    @staticmethod
    def _discard_inherited(handle: Any) -> None:
        """Default: forget it.  h5py and lmdb override this to close it."""

    def _handle(self) -> Any:
        pid = os.getpid()
        if self._held_in_pid != pid:
            with _lock:  # threads racing to a reader's first read must take one use, not one each
                if self._held_in_pid != pid:
                    # First use in this process (fresh, forked or unpickled reader).
                    handle = acquire(self._handle_key(), self._open_handle, self._close_handle, self._discard_inherited)
                    self._held_in_pid = pid
                    return handle
        return _table.entries[self._handle_key()].handle

    def _release_handle(self) -> None:
        if self._held_in_pid == os.getpid():
            release(self._handle_key())
        self._held_in_pid = None

    def _drop_handle_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        state.pop("_held_in_pid", None)
        return state

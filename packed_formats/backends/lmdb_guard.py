"""Read-only LMDB environments that no damaged file can crash.

LMDB trusts its pages.  A value's size (32 bits in its leaf node) and the page
its overflow run starts on are used as written, and the ``lmdb`` binding touches
every page of a value as soon as LMDB finds it (to fault the pages in with the
GIL released), before Python sees its length.  One flipped bit in a size puts
the value past the end of the file, and a page of a file's map past its end
ends the process with SIGBUS: a DataLoader worker dies, ``verify`` dies, a
conversion sniffing a third-party LMDB dies.

LMDB does check that every page number lies below the meta page's last page,
and every other number it reads is at most 32 bits (sizes) or 16 (offsets in a
page, key sizes).  So nothing it touches lies further than ``REACH`` bytes past
the file's last page.  An environment opened here maps that much more than the
file, and the part of the map past the file's end is mapped over with zero
pages (anonymous, read-only, reserving no memory): a read there gives zeros,
never a signal.  A value is then checked before it is copied
(``Guard.outside``): one of up to ``EXACT_FROM`` bytes must be no longer than the
file's pages, and any zeros it reads past them fail its CRC32 like any other
damage; a larger one must lie inside the file's pages, found from its address
(3 us, nothing beside copying it), so a damaged size is refused by name and
never copied at 4 GiB.

The guard finds LMDB's map in ``/proc/self/maps``.  Where there is none (macOS,
Windows), or where the process may not reserve the address space (``ulimit
-v``: a warning says so), environments open as before, unguarded, and
``outside`` checks sizes only.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import warnings
from typing import Any, Optional, Tuple

import lmdb
import numpy as np

from ..errors import CorruptArchiveError
from . import index_map

# The furthest LMDB or the binding reads past a page it may read: a value of up to 4 GiB, a node
# up to 64 KiB into its page, a key of up to 64 KiB, with room to spare.
REACH = (1 << 32) + (256 << 10)
EXACT_FROM = 1 << 20  # bytes of a value from which its place in the file is checked, not only its size
_MAPS = "/proc/self/maps"


class Guard:
    """What an open environment's values must lie inside: the first ``end`` bytes of its file (the
    pages LMDB says it has), mapped at ``base`` (None where the map was not found: nothing guarded)."""

    def __init__(self, base: Optional[int], end: int) -> None:
        self.base, self.end = base, end

    @property
    def active(self) -> bool:
        return self.base is not None

    def outside(self, value: Any) -> Optional[str]:
        """Why ``value`` (a buffer that a transaction with ``buffers=True`` gave) may not be copied, or
        None: it must be no longer than the file's first ``end`` bytes and, from ``EXACT_FROM`` bytes
        where the map is known, lie inside them."""
        size = len(value)
        if size <= EXACT_FROM or self.base is None:
            inside = size <= self.end
        else:
            start = np.frombuffer(value, np.uint8).__array_interface__["data"][0] - self.base
            inside = 0 <= start and start + size <= self.end
        return None if inside else f"claims {size} bytes that lie outside the file's {self.end} bytes of pages"


def open_readonly(path: str, **options: Any) -> Tuple["lmdb.Environment", Guard]:
    """``lmdb.open(path, readonly=True, lock=False, **options)``, guarded, and its ``Guard``.  Raises
    ``lmdb.Error`` as ``lmdb.open`` does, and CorruptArchiveError for a file shorter than its pages.

    Where the process may not reserve ``REACH`` bytes of address space more (``ulimit -v``), or the
    map is not found, the environment opens unguarded, with an ``UnguardedLMDBWarning`` (once a process)."""
    subdir = os.path.isdir(path)
    data_file = os.path.join(path, "data.mdb") if subdir else path
    size = os.path.getsize(data_file)
    try:
        env = lmdb.open(path, subdir=subdir, readonly=True, lock=False, map_size=_round_up(size + REACH), **options)
    except lmdb.Error as exc:
        if not (isinstance(exc, lmdb.MemoryError) or "Cannot allocate memory" in str(exc)):
            raise
        env = lmdb.open(path, subdir=subdir, readonly=True, lock=False, **options)  # the file's map may fit
        _warn_unguarded(path, f"this process may not reserve the {REACH >> 20} MiB past the file that guard it",
                        ": raise its address-space limit (ulimit -v)")
        guarded = False
    else:
        guarded = True
    try:
        info = env.info()
        needed = (info["last_pgno"] + 1) * env.stat()["psize"]
        if size < needed:  # LMDB would read past the end of the file, and further than the guard reaches
            raise CorruptArchiveError(path, f"the file is truncated ({size} bytes, LMDB needs {needed})")
        base = _cover_past_the_end(data_file, info["map_size"], size) if guarded else None
    except BaseException:
        env.close()
        raise
    return env, Guard(base, needed)


class UnguardedLMDBWarning(RuntimeWarning):
    """An LMDB file is read without the guard: a damaged one can end the process with SIGBUS."""


_warned = False


def _warn_unguarded(path: str, why: str, hint: str = "") -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(UnguardedLMDBWarning(
            f"{path}: read unguarded ({why}): a damaged LMDB file can end this process with SIGBUS{hint}"
        ), stacklevel=4)


def _cover_past_the_end(data_file: str, map_size: int, size: int) -> Optional[int]:
    """Map zero pages over the environment's map past the file's end; the map's address, or None
    (with a warning on Linux) where the map is not found or cannot be covered."""
    if _libc is None:  # not Linux: no listing to find the map in
        return None
    base = _find_map(data_file, _round_up(map_size))
    if base is None:
        _warn_unguarded(data_file, "LMDB's map of it is not in /proc/self/maps")
        return None
    start, end = _round_up(size), _round_up(map_size)
    if end > start:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
        if _libc.mmap(base + start, end - start, mmap.PROT_READ, flags, -1, 0) != base + start:
            # A failed mmap leaves the range as it was (ENOMEM: vm.max_map_count reached, say).
            _warn_unguarded(data_file, f"cannot cover its map: {os.strerror(ctypes.get_errno())}")
            return None
    return base


def _find_map(data_file: str, length: int) -> Optional[int]:
    """The address of the one map of ``data_file`` from its start, ``length`` bytes long, found by its
    inode or, where a file system shows another one in the listing (overlayfs), by its path.  The
    listing is read a line at a time: a process with torch has a thousand maps."""
    inode, path = str(os.stat(data_file).st_ino).encode(), os.fsencode(os.path.realpath(data_file))
    found = []
    try:
        with open(_MAPS, "rb") as maps:
            for line in maps:
                fields = line.split(None, 5)  # start-end perms offset dev inode path
                if len(fields) == 6 and (fields[4] == inode or fields[5].rstrip(b"\n") == path):
                    start, end = (int(x, 16) for x in fields[0].split(b"-"))
                    if end - start == length and int(fields[2], 16) == 0:
                        found.append(start)
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


def _round_up(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


# Only on Linux: /proc/self/maps to find the map in, and MAP_FIXED's value below.
_libc = index_map.load_libc() if sys.platform.startswith("linux") else None
_MAP_FIXED = 0x10  # Linux's, on every architecture (Python's mmap module does not name it)

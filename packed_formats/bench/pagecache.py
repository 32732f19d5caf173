"""Page-cache control: warm a file's pages for warm runs, evict them for cold ones, count them.

Warm runs read every file of the target once before timing (``warm``): on a
machine that reclaims page cache in the background, or after other targets
pushed it out, a "warm" measurement would otherwise read from disk in its
first epochs and swing by an order of magnitude.

Eviction uses ``posix_fadvise(POSIX_FADV_DONTNEED)`` (after ``fdatasync``, since
dirty pages cannot be dropped), which needs no root but is only advice: the
kernel keeps pages that some process has mapped, and some file
systems (tmpfs, where the page cache *is* the storage, and several network
file systems) ignore it.  Residency is measured with ``mincore(2)`` so the
report can say whether eviction actually happened.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from typing import Any, Dict, List, Optional

from .environment import archive_paths

_libc = None


def _load_libc():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc = libc
    return _libc


def resident_bytes(path: str) -> Optional[int]:
    """Bytes of ``path`` currently in the page cache (via mincore), or None if unknown."""
    try:
        libc = _load_libc()
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vector = ctypes.create_string_buffer(pages)
            if libc.mincore(address, size, vector) != 0:
                return None
            resident = sum(b & 1 for b in vector.raw)
        finally:
            libc.munmap(address, size)
        return min(size, resident * mmap.PAGESIZE)
    except (OSError, AttributeError):
        return None
    finally:
        os.close(fd)


def _total_resident(files: List[str]) -> Optional[int]:
    total = 0
    for name in files:
        amount = resident_bytes(name)
        if amount is None:
            return None
        total += amount
    return total


def warm(path: str, chunk: int = 8 << 20) -> Dict[str, object]:
    """Read every file of ``path`` once so that its pages are in the page cache.

    Returns ``files``, ``bytes_read`` and ``resident_before``/``resident_after``
    bytes (None when mincore is unavailable).
    """
    files = archive_paths(path)
    resident_before = _total_resident(files)
    bytes_read = 0
    buffer = bytearray(chunk)
    for name in files:
        with open(name, "rb", buffering=0) as file:
            while True:
                n = file.readinto(buffer)
                if not n:
                    break
                bytes_read += n
    return {
        "files": len(files),
        "bytes_read": bytes_read,
        "resident_before": resident_before,
        "resident_after": _total_resident(files),
    }


def evict(path: str) -> Dict[str, object]:
    """Ask the kernel to drop every file of ``path`` from the page cache; say how it went.

    Returns a record with ``attempted``, ``files``, ``advised`` (files the advice
    was accepted for), ``errors``, ``resident_before``/``resident_after`` bytes
    (None when mincore is unavailable) and ``evicted`` (True, False, or None
    when residency could not be measured).
    """
    files = archive_paths(path)
    errors: List[str] = []
    record: Dict[str, object] = {"attempted": True, "files": len(files), "advised": 0, "errors": errors}
    if not hasattr(os, "posix_fadvise"):
        record.update(attempted=False, evicted=False, errors=["os.posix_fadvise is not available on this platform"])
        return record
    record["resident_before"] = _total_resident(files)
    advised = 0
    for name in files:
        try:
            fd = os.open(name, os.O_RDONLY)
            try:
                _flush(fd)  # dirty pages (a freshly written archive) cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            advised += 1
        except OSError as exc:
            errors.append(f"{name}: {exc.strerror}")
    record["advised"] = advised
    after = _total_resident(files)
    record["resident_after"] = after
    record["evicted"] = None if after is None else after == 0 or after <= 0.05 * max(1, _apparent(files))
    return record


def _flush(fd: int) -> None:
    try:
        os.fdatasync(fd)
    except OSError:
        pass


def _apparent(files: List[str]) -> int:
    return sum(os.path.getsize(f) for f in files)


def eviction_note(records: List[Dict[str, Any]]) -> Optional[str]:
    """One line for the report when eviction failed or could not be confirmed, else None."""
    if not records:
        return None
    if any(not r.get("attempted") for r in records):
        return "cold run requested but eviction is unavailable here: reads were warm"
    if any(r.get("errors") for r in records):
        return "eviction failed for some files: " + "; ".join(str(e) for r in records for e in r["errors"][:2])
    if any(r.get("evicted") is False for r in records):
        left = max(int(r.get("resident_after") or 0) for r in records)
        return f"eviction was not effective (up to {left / 2**20:.1f} MiB stayed cached, e.g. tmpfs): reads were warm"
    if any(r.get("evicted") is None for r in records):
        return "eviction was advised but could not be confirmed (mincore unavailable)"
    return None

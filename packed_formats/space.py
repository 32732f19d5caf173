"""Disk space: the files an archive is made of, how much is free where one is written, byte counts for people."""

from __future__ import annotations

import os
import shutil
from typing import List, Optional, Tuple

from .errors import InsufficientSpaceError


def human_bytes(n: Optional[float]) -> str:
    """``1.5 GiB``-style text (binary units); "unknown" for None."""
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def archive_files(path: str, follow_links: bool = False) -> List[Tuple[str, int]]:
    """(name relative to ``path``, size) of every regular file of an archive or folder, sorted.

    A one-file archive gives ``[("", size)]``.  ``follow_links`` descends into
    linked directories too (an image folder may be assembled from links).
    """
    if not os.path.isdir(path):
        return [("", os.path.getsize(path))]
    found = []
    for directory, _subdirs, names in os.walk(path, followlinks=follow_links):
        for name in names:
            full = os.path.join(directory, name)
            if os.path.isfile(full):
                found.append((os.path.relpath(full, path), os.path.getsize(full)))
    return sorted(found)


def disk_usage(path: "str | os.PathLike[str]", parts: bool = True) -> int:
    """Bytes of the archive at ``path``: every file of a directory; with ``parts``, every part of a sharded archive."""
    from .backends.sharded import is_shard_index, read_shard_index  # not at import: backends may import this module

    path = os.fspath(path)
    total = sum(size for _name, size in archive_files(path))
    if not parts or os.path.isdir(path):
        return total
    with open(path, "rb") as file:
        if not is_shard_index(file.read(64)):
            return total
    directory = os.path.dirname(os.path.abspath(path))
    return total + sum(disk_usage(os.path.join(directory, n)) for n in read_shard_index(path)["names"])


def free_bytes(directory: str) -> Optional[int]:
    """Bytes this user may still write in ``directory``'s file system (None: it reports no size, e.g. sysfs)."""
    usage = shutil.disk_usage(directory)
    return usage.free if usage.total else None


def check_free_space(directory: str, needed: int, purpose: str, hint: Optional[str] = None) -> None:
    """Raise InsufficientSpaceError naming ``directory`` when it has fewer than ``needed`` bytes free."""
    free = free_bytes(directory)
    if free is not None and free < needed:
        raise InsufficientSpaceError(
            directory,
            f"not enough space to {purpose}: needs about {human_bytes(needed)} ({needed} bytes), "
            f"{human_bytes(free)} ({free} bytes) free",
            hint=hint,
        )


# ---- how much an archive takes --------------------------------------------------------------------
BLOCK = 4096  # a file system block: a file's last one is allocated whole
_FILES_PER_PART = 8  # files a part has at most (memmap: a manifest and 6 arrays), each rounded up to a block
_INDEX_BYTES = 8 + 4 + 8 + 8  # a sample's label (int64), CRC32, offset and position in the index arrays
_MANIFEST_BYTES = 4096  # a manifest's fields, less its class names
_FIELD_INDEX_BYTES = 8 + 4 + 8  # a field value's offset, CRC32 and position in its field's index arrays
_MEMBER_BYTES = 128  # what a format adds per sample besides two copies of its key (ZIP: local and central headers)


def archive_bytes(
    fmt: str, mode: str, count: int, payload: int, *, sample_bytes: Optional[int] = None, key_bytes: int = 32,
    class_bytes: int = 0, parts: int = 1, fields: int = 0, field_payload: int = 0,
) -> int:
    """A high estimate of the disk space (whole blocks) an archive of format ``fmt`` takes: ``count``
    samples of ``payload`` bytes in all (each ``sample_bytes`` when they are all one size), keys of
    ``key_bytes`` at most, class names of ``class_bytes`` in all, in ``parts`` parts; each sample with
    ``fields`` field values, of ``field_payload`` bytes in all (each a record and index entries of its own).

    The format's writer says what it adds to the samples' bytes (its ``size_bound``, where it has one:
    pages, chunk indexes, metadata); every format also stores the index arrays and a manifest (in every
    part), and each file ends in a partly used block.  A conversion checks this much free space first.
    """
    from .backends import spec  # not at import: backends import this module

    writer = spec(fmt).writer
    bound = getattr(writer, "size_bound", None)
    if bound is None:
        stored = payload + count * (_MEMBER_BYTES + 2 * key_bytes)
    else:
        stored = bound(mode, count, payload, sample_bytes, key_bytes, parts)
    index = count * (_INDEX_BYTES + key_bytes) + parts * (_MANIFEST_BYTES + 2 * class_bytes)
    stored += field_payload + count * fields * (_MEMBER_BYTES + 2 * key_bytes + _FIELD_INDEX_BYTES)
    return stored + index + parts * _FILES_PER_PART * BLOCK

"""The checked bytes in front of an HDF5 archive: what HDF5 parses is checked before HDF5 parses it.

HDF5 trusts its metadata: some damage to an object header (the root group's,
which holds the manifest attribute) makes opening the file hang forever inside
HDF5, where no Python code runs to stop it.  So a writer reserves a user block
(``USERBLOCK`` bytes at the start of the file, which HDF5 and its tools skip:
``h5ls``, ``h5dump`` and h5py read the file as before), records which byte
ranges HDF5 reads while a reader opens the archive and reads its metadata, and
stores those ranges with their CRC32 in the user block.  A reader checks the
user block and every range before HDF5 sees the file: HDF5 then parses only the
bytes that were written, and a damaged file is refused with a named error.

Samples are checked by their own CRC32 after reading.  Archives written
before the user block (the HDF5 signature at offset 0) open unchecked, as before.

A checksum a writer can recompute does not make HDF5's parser safe: a file
damaged and re-sealed still parses as it is.  So readers of archives written
since no longer let HDF5 parse them at all: the block also holds a *locator*
(``LOCATOR_ROOM`` bytes at ``LOCATOR_AT``, read by ``hdf5_layout``) of the
byte spans they read themselves; the ranges still tell damage to the metadata
that other HDF5 tools read, and guard the child process that describes an
archive written without a locator.
"""

from __future__ import annotations

import bisect
import io
import os
import struct
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import h5py

from ..checksum import crc32
from ..errors import CorruptArchiveError, IncompleteArchiveError

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
MAGIC = b"\x89PFHDF5\n"  # our user block's first 8 bytes
USERBLOCK = 4096  # bytes HDF5 leaves to the user at the start of the file (a power of 2, >= 512)
_VERSION = 1
_HEAD = struct.Struct("<8sII")  # magic, version, number of ranges
_RANGE = struct.Struct("<QII")  # offset, length, CRC32
_TAIL = struct.Struct("<I")  # CRC32 of the user block before it
LOCATOR_ROOM = 512  # bytes before the tail kept for the locator (``hdf5_layout``): where readers find what they read
LOCATOR_AT = USERBLOCK - _TAIL.size - LOCATOR_ROOM
MAX_RANGES = (LOCATOR_AT - _HEAD.size) // _RANGE.size  # what a writer stores now
_READ_RANGES = (USERBLOCK - _HEAD.size - _TAIL.size) // _RANGE.size  # what one stored before the locator
MAX_GAP = 0  # metadata spans this close are checked as one (0: only touching ones; a gap may hold a sample)
DAMAGED_HINT = "the archive is damaged: re-create it (or restore it from a copy)"

Range = Tuple[int, int]  # (offset, length)


class _RecordingFile(io.FileIO):
    """A read-only file that notes (offset, length) of every read HDF5 makes through it."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "r")
        self.reads: List[Range] = []

    def readinto(self, buffer) -> int:
        at = self.tell()
        n = super().readinto(buffer) or 0
        self.reads.append((at, n))
        return n

    def read(self, size: int = -1) -> bytes:  # type: ignore[override]
        at = self.tell()
        data = super().read(size)
        self.reads.append((at, len(data)))
        return data


def record_reads(path: str, visit: Callable[[h5py.File], None]) -> List[Range]:
    """The byte ranges HDF5 reads from ``path`` while ``visit`` runs on it, open read-only."""
    recording = _RecordingFile(path)
    try:
        with h5py.File(recording, "r") as file:
            visit(file)
    finally:
        recording.close()
    return recording.reads


def merge(ranges: List[Range], payload: Sequence[Range] = (), limit: int = MAX_RANGES) -> List[Range]:
    """The metadata HDF5 read, as at most ``limit`` spans to check: ``ranges`` (in the order HDF5 read
    them; the user block excluded) less the ``payload`` spans (samples and index arrays, which HDF5
    does not parse and which their own CRC32s check, so a damaged sample stays one sample's error),
    joined where they touch and across gaps of at most ``MAX_GAP`` bytes.  Were there still more than
    ``limit``, the spans HDF5 read first (the root group, the manifest, the datasets' headers) are kept."""
    cut = _subtract([(max(a, USERBLOCK), a + n) for a, n in ranges if n > 0 and a + n > USERBLOCK],
                    sorted((a, a + n) for a, n in payload if n > 0))
    joined: List[List[int]] = []
    for start, stop in sorted(cut):
        if joined and start - joined[-1][1] <= MAX_GAP:
            joined[-1][1] = max(joined[-1][1], stop)
        else:
            joined.append([start, stop])
    if len(joined) > limit:
        first_read: Dict[int, int] = {}
        for order, (start, _stop) in enumerate(cut):
            span = next(k for k, (a, b) in enumerate(joined) if a <= start < b)
            first_read.setdefault(span, order)
        keep = sorted(sorted(first_read, key=first_read.__getitem__)[:limit])
        joined = [joined[k] for k in keep]
    return [(start, stop - start) for start, stop in joined]


def _subtract(spans: List[Tuple[int, int]], holes: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """``spans`` (start, stop), in their order, less every (sorted) ``holes`` span."""
    starts = [a for a, _b in holes]
    out: List[Tuple[int, int]] = []
    for start, stop in spans:
        k = max(bisect.bisect_right(starts, start) - 1, 0)
        while start < stop and k < len(holes):
            a, b = holes[k]
            if a >= stop:
                break
            if b > start:
                if a > start:
                    out.append((start, a))
                start = max(start, b)
            k += 1
        if start < stop:
            out.append((start, stop))
    return out


def write_userblock(path: str, ranges: List[Range], locator: bytes = b"") -> None:
    """Store ``ranges`` of the file at ``path`` and their CRC32 in its (reserved, zero) user block, and
    ``locator`` (at most ``LOCATOR_ROOM`` bytes) at ``LOCATOR_AT``, under the block's own CRC32.  A
    reader that knows no locator reads that room as the block's zero padding."""
    if len(ranges) > MAX_RANGES or len(locator) > LOCATOR_ROOM:
        raise ValueError(f"{len(ranges)} ranges and a locator of {len(locator)} bytes do not fit a user block")
    with open(path, "r+b") as file:
        table = []
        for offset, length in ranges:
            file.seek(offset)
            table.append(_RANGE.pack(offset, length, crc32(file.read(length))))
        block = (_HEAD.pack(MAGIC, _VERSION, len(ranges)) + b"".join(table)).ljust(LOCATOR_AT, b"\0")
        block = (block + locator).ljust(USERBLOCK - _TAIL.size, b"\0")
        file.seek(0)
        file.write(block + _TAIL.pack(crc32(block)))
        file.flush()
        os.fsync(file.fileno())


def check(path: str, fd: int) -> bool:
    """Check the file open as ``fd`` before HDF5 reads it: True when its user block and every range
    it lists are intact, False for an archive written without one (HDF5's signature at offset 0);
    raises as ``checked_block``."""
    return checked_block(path, fd) is not None


def stored_ranges(block: bytes) -> List[Range]:
    """The (offset, length) ranges a user block that ``checked_block`` returned lists."""
    count = _HEAD.unpack_from(block)[2]
    return [_RANGE.unpack_from(block, _HEAD.size + k * _RANGE.size)[:2] for k in range(count)]


def locator_of(block: bytes) -> bytes:
    """The locator room of a user block that ``checked_block`` returned (zeros where none was written;
    empty where, written before the locator, its ranges fill that room)."""
    if _HEAD.unpack_from(block)[2] > MAX_RANGES:
        return b""
    return block[LOCATOR_AT : LOCATOR_AT + LOCATOR_ROOM]


def checked_block(path: str, fd: int) -> Optional[bytes]:
    """The user block of the file open as ``fd``, once it and every range it lists are checked;
    None for an archive written without one (HDF5's signature at offset 0).

    Raises:
        CorruptArchiveError: the user block or a byte range HDF5 would parse is damaged.
        IncompleteArchiveError: the file ends before a range it lists (truncated).
    """
    block = os.pread(fd, USERBLOCK + len(HDF5_SIGNATURE), 0)
    if block[:8] != MAGIC and block[USERBLOCK:] != HDF5_SIGNATURE:
        return None  # written before the user block (or not by us): HDF5 says what it is
    block = block[:USERBLOCK]
    if len(block) < USERBLOCK:
        raise IncompleteArchiveError(path, f"the file is only {len(block)} bytes long", hint="the file is truncated")
    if _TAIL.unpack_from(block, USERBLOCK - _TAIL.size)[0] != crc32(block[: USERBLOCK - _TAIL.size]):
        raise CorruptArchiveError(path, "its header (the HDF5 user block) is damaged", hint=DAMAGED_HINT)
    magic, version, count = _HEAD.unpack_from(block)
    if magic != MAGIC or version != _VERSION or count > _READ_RANGES:
        raise CorruptArchiveError(path, "its HDF5 user block is not one this packed_formats wrote", hint=DAMAGED_HINT)
    for k in range(count):
        offset, length, expected = _RANGE.unpack_from(block, _HEAD.size + k * _RANGE.size)
        data = os.pread(fd, length, offset)
        if len(data) < length:
            raise IncompleteArchiveError(
                path, f"the file ends at byte {offset + len(data)}, inside its HDF5 metadata",
                hint="the file is truncated: re-create it or copy it again",
            )
        if crc32(data) != expected:
            raise CorruptArchiveError(
                path, f"its HDF5 metadata (bytes {offset} to {offset + length}) does not match its checksum",
                hint=DAMAGED_HINT,
            )
    return block


def has_userblock(path: str, head: bytes) -> bool:
    """Whether the file at ``path``, starting with ``head``, is an HDF5 archive of ours with a user
    block: our magic, or (the block damaged) HDF5's signature where the block ends."""
    if head[:8] == MAGIC:
        return True
    with open(path, "rb") as file:
        file.seek(USERBLOCK)
        return file.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE

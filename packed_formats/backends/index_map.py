"""Index arrays read in place: read-only views of one memory map of the archive's file.

Loaded, an archive's index (labels, keys, checksums, offsets, positions:
40-80 bytes a sample, 0.6-1 GiB at 14M samples) is a private copy in every
process that opens it.  Mapped, its pages are the file's, shared through the
page cache by every process on the node, and opening costs the same at any
number of samples.  Each format finds where its arrays' bytes lie in its
file (HDF5: a contiguous dataset's address; LMDB: a record's overflow pages)
and checks what it mapped against what its library reads; this module only
maps.

One map per archive spans all its arrays.  It is never closed explicitly: it
lives as long as an array over it, and it belongs to the process that made
it, not to HDF5 or LMDB, so closing their files or environments (as a forked
child does with inherited ones) leaves the arrays readable.  On Python 3.13
and later the map holds no file descriptor; before, it holds one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import io
import math
import mmap
import os
import sys
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class ArrayAt:
    """Where the bytes of a C-ordered array lie in a file."""

    offset: int
    dtype: np.dtype
    shape: Tuple[int, ...]

    @property
    def count(self) -> int:
        return math.prod(self.shape)  # not np.prod: ~10x faster, and a sharded set maps thousands of these

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def aligned(self) -> bool:
        """Whether the array starts at a multiple of its dtype's alignment (numpy reads misaligned data slowly)."""
        return self.offset % self.dtype.alignment == 0


def map_arrays(fd: int, where: Dict[str, ArrayAt]) -> Dict[str, np.ndarray]:
    """Read-only arrays over one map of the open file ``fd`` that spans every array of ``where``.

    Raises ValueError when an array lies past the end of the file (mapping
    it would crash the reader with SIGBUS), OSError when mapping fails.
    """
    stored = {name: at for name, at in where.items() if at.nbytes}
    arrays = {name: np.empty(at.shape, dtype=at.dtype) for name, at in where.items() if not at.nbytes}
    if not stored:
        return arrays
    first = min(at.offset for at in stored.values())
    end = max(at.offset + at.nbytes for at in stored.values())
    size = os.fstat(fd).st_size
    if first < 0 or end > size:
        raise ValueError(f"an index array lies outside the file ({size} bytes, arrays end at {end})")
    start = first // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY  # where a map may begin
    region = _map(fd, start, end - start)
    for name, at in stored.items():
        array = np.frombuffer(region, dtype=at.dtype, count=at.count, offset=at.offset - start).reshape(at.shape)
        array.setflags(write=False)  # the map is read-only: a write would crash, not raise
        arrays[name] = array
    return arrays


def npy_layout(read: Callable[[int], bytes]) -> Optional[Tuple[int, np.dtype, Tuple[int, ...]]]:
    """(header bytes, dtype, shape) of a .npy array whose first bytes ``read(n)`` gives, or None
    when it is not one that can be mapped as it lies (Fortran order, objects, a damaged header)."""
    head = read(NPY_HEADER_MAX)
    length = _npy_header_length(head)
    return None if length is None else _parse_npy_header(head[:length])


def _npy_header_length(head: bytes) -> Optional[int]:
    """The length of the .npy header at the start of ``head`` (None: not a .npy header, or cut short)."""
    if head[:6] != b"\x93NUMPY" or len(head) < 12:
        return None
    if head[6] == 1:
        length = 10 + int.from_bytes(head[8:10], "little")
    else:
        length = 12 + int.from_bytes(head[8:12], "little")
    return length if length <= len(head) else None


@functools.lru_cache(maxsize=256)
def _parse_npy_header(header: bytes) -> Optional[Tuple[int, np.dtype, Tuple[int, ...]]]:
    """(header bytes, dtype, shape) of a whole .npy header, parsed once for each distinct header: the
    parts of a sharded set have the same few, and numpy parses each with ``ast.literal_eval``
    (~75 us: 0.5 s for the index arrays of 1,400 parts)."""
    head = io.BytesIO(header)
    try:
        version = np.lib.format.read_magic(head)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(head)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(head)
        else:
            return None
    except (ValueError, TypeError, SyntaxError):
        return None
    if dtype.hasobject or (fortran and len(shape) > 1):
        return None
    return head.tell(), dtype, tuple(int(n) for n in shape)


NPY_HEADER_MAX = 16384  # bytes read to parse a .npy header (numpy writes 64-4096)


def _map(fd: int, start: int, length: int) -> Any:
    """A read-only map of ``length`` bytes of ``fd`` from ``start`` that keeps no file descriptor.

    Python's ``mmap`` duplicates the descriptor for as long as the map lives
    (before 3.13, where ``trackfd=False`` stops it): a sharded archive of 1,000
    parts would hold 1,000 descriptors for its indexes alone.  Where libc is
    at hand the map is made through it instead, and unmapped when the last
    array over it is gone."""
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, length, access=mmap.ACCESS_READ, offset=start, trackfd=False)
    if _libc is None:  # pragma: no cover - every Linux and macOS libc has mmap
        return mmap.mmap(fd, length, access=mmap.ACCESS_READ, offset=start)
    address = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot map the index: {os.strerror(code)}")
    region = FileMap.over(address, length)
    weakref.finalize(region, _libc.munmap, address, length)
    return region


class FileMap(ctypes.Array):
    """Bytes of a file mapped by ``_map`` (a ctypes array over the map): ``index.file_backed`` knows them."""

    _type_ = ctypes.c_char
    _length_ = 0
    maps_a_file = True  # what index.file_backed looks for

    @classmethod
    def over(cls, address: int, length: int) -> "FileMap":
        sized: Any = type(cls.__name__, (cls,), {"_type_": ctypes.c_char, "_length_": length})
        return sized.from_address(address)


def load_libc() -> Optional[ctypes.CDLL]:
    """The C library with ``mmap`` and ``munmap`` typed for 64-bit addresses and offsets (None without one)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int64]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):  # pragma: no cover - no C library to load
        return None
    return libc


_libc = load_libc() if sys.version_info < (3, 13) else None
_MAP_FAILED = ctypes.c_void_p(-1).value

"""An HDF5 archive's fields: one contiguous uint8 dataset, ``fields``, that readers read without HDF5.

The locator in the user block has room for a few spans, not three per field,
so every field lives in one *bundle*: a header, each field's index arrays
(``field.NAME.offsets``, ``field.NAME.crc32``, aligned for mapping), then each
field's values end to end.  The header is ``PFFIELD1``, its length, and JSON
giving each array's (offset, bytes, dtype) and each field's values' (offset,
bytes), relative to the bundle's start; the locator's ``fields`` entry gives
the bundle's span and the header's CRC32.  A reader checks the header's CRC32,
then that every span lies inside the bundle and every array is of the dtype a
field array has; the arrays are then checked by the manifest's CRC32s like the
rest of the index, and each value by its own CRC32.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, Tuple

import h5py
import numpy as np

from ..checksum import crc32
from ..errors import CorruptArchiveError
from ..fields import FIELD_ARRAY
from . import hdf5_layout, index_map

NAME = hdf5_layout.FIELDS  # the dataset, and its locator entry
MAGIC = b"PFFIELD1"
_HEAD = struct.Struct("<8sI")  # magic, header length
_ALIGN = 64
_MAX_HEADER = 1 << 20
_DTYPES = {"offsets": "<i8", "crc32": "<u4"}
_COPY = 1 << 20  # bytes of values copied into the bundle at a time

Span = Tuple[int, int]  # (offset in the file, bytes)


def write(file: h5py.File, arrays: Dict[str, np.ndarray], values: Dict[str, str]) -> None:
    """The bundle of ``arrays`` (the fields' index arrays) and ``values`` (each field's values, in a file of
    their own) as the contiguous dataset ``fields`` of ``file``."""
    at, placed_arrays, placed_values = 0, {}, {}
    for name, array in arrays.items():
        placed_arrays[name] = [at, int(array.nbytes), np.dtype(_DTYPES[name.rsplit(".", 1)[1]]).str]
        at = _aligned(at + array.nbytes)
    for name, path in values.items():
        placed_values[name] = [at, os.path.getsize(path)]
        at += placed_values[name][1]
    # the data starts after the header, whose spans count from the bundle's start: room for them to grow
    start = _aligned(_HEAD.size + len(_header(placed_arrays, placed_values, 0)) + _ALIGN)
    header = _header(placed_arrays, placed_values, start)
    dataset = file.create_dataset(NAME, shape=(start + at,), dtype=np.uint8)  # contiguous: no chunks
    dataset[:start] = np.frombuffer((_HEAD.pack(MAGIC, len(header)) + header).ljust(start, b"\0"), dtype=np.uint8)
    for name, array in arrays.items():
        offset = start + placed_arrays[name][0]
        data = np.ascontiguousarray(array, dtype=_DTYPES[name.rsplit(".", 1)[1]]).view(np.uint8).reshape(-1)
        dataset[offset : offset + data.size] = data
    for name, path in values.items():
        offset = start + placed_values[name][0]
        with open(path, "rb") as source:
            while True:
                chunk = source.read(_COPY)
                if not chunk:
                    break
                dataset[offset : offset + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
                offset += len(chunk)


def _header(arrays: Dict[str, list], values: Dict[str, list], start: int) -> bytes:
    """The header's JSON, every span moved by ``start`` (where the data begins in the bundle)."""
    moved = {"arrays": {name: [at + start, *rest] for name, (at, *rest) in arrays.items()},
             "values": {name: [at + start, size] for name, (at, size) in values.items()}}
    return json.dumps(moved, sort_keys=True).encode()


def header_crc32(path: str, offset: int) -> int:
    """The CRC32 of the bundle header starting at byte ``offset`` of the file at ``path``."""
    with open(path, "rb") as file:
        file.seek(offset)
        magic, length = _HEAD.unpack(file.read(_HEAD.size))
        return crc32(file.read(length), crc32(_HEAD.pack(magic, length)))


def read(path: str, fd: int, offset: int, nbytes: int, expected_crc: int, wanted: Tuple[str, ...],
         fields: Tuple[str, ...]) -> Tuple[Dict[str, np.ndarray], Dict[str, Span]]:
    """The field arrays ``wanted`` (mapped) and each of ``fields``' values' span, from the bundle at
    ``offset`` (``nbytes`` long) of the file open as ``fd``.  CorruptArchiveError naming the archive when
    the header is damaged or places anything outside the bundle or as another dtype."""
    head = os.pread(fd, _HEAD.size, offset)
    if len(head) != _HEAD.size or _HEAD.unpack(head)[0] != MAGIC:
        raise _damaged(path, "its fields' header is missing")
    length = _HEAD.unpack(head)[1]
    if length > min(_MAX_HEADER, nbytes - _HEAD.size):
        raise _damaged(path, f"its fields' header claims {length} bytes")
    header = os.pread(fd, length, offset + _HEAD.size)
    if len(header) != length or crc32(header, crc32(head)) != expected_crc:
        raise _damaged(path, "its fields' header does not match its checksum")
    try:
        document = json.loads(header)
        arrays, values = document["arrays"], document["values"]
        where = {}
        for name in wanted:
            if name not in arrays:
                continue
            at, size, dtype = arrays[name]
            if not FIELD_ARRAY.match(name) or dtype != _DTYPES[name.rsplit(".", 1)[1]]:
                raise ValueError(f"array {name!r} as {dtype!r}")
            where[name] = index_map.ArrayAt(offset + _inside(at, size, nbytes), np.dtype(dtype),
                                            (size // np.dtype(dtype).itemsize,))
        spans = {}
        for name in fields:
            at, size = values[name]
            spans[name] = (offset + _inside(at, size, nbytes), int(size))
    except (KeyError, TypeError, ValueError) as exc:
        raise _damaged(path, f"its fields' header is not one this packed_formats wrote ({exc})") from None
    try:
        return index_map.map_arrays(fd, where), spans
    except (OSError, ValueError) as exc:
        raise _damaged(path, f"cannot map its fields' index: {exc}") from None


def _inside(at: object, size: object, nbytes: int) -> int:
    if type(at) is not int or type(size) is not int or not 0 <= at <= at + size <= nbytes:
        raise ValueError(f"a span {at!r}+{size!r} outside the bundle's {nbytes} bytes")
    return at


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _damaged(path: str, problem: str) -> CorruptArchiveError:
    return CorruptArchiveError(path, problem, hint="the archive is damaged: re-create it")

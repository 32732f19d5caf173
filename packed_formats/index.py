"""Per-sample index data (labels, keys, checksums, byte offsets) as numpy arrays.

Never Python lists of per-sample objects: a forked DataLoader worker that
touches every entry of a list dirties every page through reference counts and
its memory grows over an epoch; numpy arrays stay shared.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
from typing import Dict, Optional, Sequence

import numpy as np


@dataclasses.dataclass
class SampleIndex:
    """Arrays describing the samples of one archive.

    labels int64[N]; keys 'S'[N] (UTF-8 relative paths); crc32 uint32[N] or None;
    offsets int64[N+1] or None: sample i has ``offsets[i+1] - offsets[i]`` bytes,
    at ``offsets[i]`` in a flat byte store, or at ``positions[i]`` in the file
    when ``positions`` (int64[N]) is given.
    """

    labels: np.ndarray
    keys: np.ndarray
    crc32: Optional[np.ndarray] = None
    offsets: Optional[np.ndarray] = None
    positions: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        for name in ("labels", "keys", "crc32", "offsets", "positions"):
            array = getattr(self, name)
            if array is not None:
                array.setflags(write=False)

    def __len__(self) -> int:
        return len(self.labels)

    def key(self, i: int) -> str:
        return decode_key(self.keys[i])

    def arrays(self) -> Dict[str, np.ndarray]:
        """The arrays to store, by name (absent ones left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_arrays(cls, arrays: Dict[str, np.ndarray]) -> "SampleIndex":
        return cls(
            labels=np.asarray(arrays["labels"], dtype=np.int64),
            keys=np.asarray(arrays["keys"]),
            crc32=_optional(arrays, "crc32", np.uint32),
            offsets=_optional(arrays, "offsets", np.int64),
            positions=_optional(arrays, "positions", np.int64),
        )

    def mapped(self) -> bool:
        """Whether every array is a map of the archive's file (see ``file_backed``)."""
        return all(file_backed(array) for array in self.arrays().values())

    def nbytes(self, i: int) -> int:
        if self.offsets is None:
            raise TypeError("this index stores no offsets, so no sample sizes")
        return int(self.offsets[i + 1] - self.offsets[i])


def _optional(arrays: Dict[str, np.ndarray], name: str, dtype) -> Optional[np.ndarray]:
    return None if name not in arrays else np.asarray(arrays[name], dtype=dtype)


def file_backed(array: np.ndarray) -> bool:
    """Whether an array's memory is a map of a file (``np.memmap``, a view of an ``mmap``, or of
    a map that says ``maps_a_file``, as ``backends.index_map`` makes):
    such an index costs a process page cache, not private memory, and is mapped again, not pickled."""
    base: object = array
    while base is not None:
        if isinstance(base, (np.memmap, mmap.mmap)) or getattr(base, "maps_a_file", False):
            return True
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return False


def decode_key(raw: bytes) -> str:
    """A stored key as the file system gave it (bytes that are not UTF-8 surrogate-escaped, as ``os.listdir``)."""
    return raw.decode("utf-8", "surrogateescape")


def encode_keys(keys: Sequence[str]) -> np.ndarray:
    """UTF-8 keys as a fixed-width bytes array (at least 1 byte wide).

    A name that is not valid UTF-8 (surrogate-escaped by Python, as ``os.listdir``
    returns it) is stored as its original bytes, so the key round-trips.
    """
    encoded = [k.encode("utf-8", "surrogateescape") for k in keys]
    width = max([1] + [len(k) for k in encoded])
    return np.array(encoded, dtype=f"S{width}")


def npy_bytes(array: np.ndarray) -> bytes:
    """An array in .npy format (never pickled)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def from_npy_bytes(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


class IndexBuilder:
    """Grows the index while a writer appends samples (amortised numpy growth)."""

    def __init__(self) -> None:
        self._columns: Dict[str, np.ndarray] = {
            "labels": np.empty(1024, dtype=np.int64),
            "crc32": np.empty(1024, dtype=np.uint32),
            "sizes": np.empty(1024, dtype=np.int64),
            "positions": np.empty(1024, dtype=np.int64),
        }
        self._key_bytes = bytearray()  # every key's UTF-8 bytes, one after the other
        self._key_ends = np.empty(1024, dtype=np.int64)  # never a str object per sample
        self.count = 0

    def append(self, label: int, key: str, crc: int, size: int, position: int = -1) -> None:
        if self.count == len(self._columns["labels"]):
            for name, column in self._columns.items():
                self._columns[name] = np.resize(column, 2 * self.count)
            self._key_ends = np.resize(self._key_ends, 2 * self.count)
        row = self.count
        self._columns["labels"][row] = label
        self._columns["crc32"][row] = crc
        self._columns["sizes"][row] = size
        self._columns["positions"][row] = position
        self._key_bytes += key.encode("utf-8", "surrogateescape")
        self._key_ends[row] = len(self._key_bytes)
        self.count += 1

    def build(self, offsets: bool = False, positions: bool = False) -> SampleIndex:
        n = self.count
        column = {name: values[:n].copy() for name, values in self._columns.items()}
        offset_array = None
        if offsets or positions:
            offset_array = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(column["sizes"], out=offset_array[1:])
        return SampleIndex(
            labels=column["labels"],
            keys=self._keys(),
            crc32=column["crc32"],
            offsets=offset_array,
            positions=column["positions"] if positions else None,
        )

    def _keys(self, rows_per_step: int = 1 << 16) -> np.ndarray:
        """The keys as a fixed-width bytes array, made from the flat buffer a slice of rows at a time."""
        n = self.count
        ends = self._key_ends[:n]
        starts = np.concatenate(([0], ends[:-1])) if n else ends
        width = max(1, int((ends - starts).max())) if n else 1
        keys = np.empty(n, dtype=f"S{width}")
        with memoryview(self._key_bytes) as data:  # no copy of the whole buffer
            for first in range(0, n, rows_per_step):
                last = min(n, first + rows_per_step)
                pairs = zip(starts[first:last].tolist(), ends[first:last].tolist())
                keys[first:last] = [bytes(data[a:b]) for a, b in pairs]
        return keys

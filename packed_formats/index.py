"""Per-sample index data (labels, keys, checksums, byte offsets) as numpy arrays.

Never Python lists of per-sample objects: a forked DataLoader worker that
touches every entry of a list dirties every page through reference counts and
its memory grows over an epoch; numpy arrays stay shared.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import operator
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import numpy as np
import numpy.typing as npt


@dataclasses.dataclass
class SampleIndex:
    """Arrays describing the samples of one archive.

    labels int64[N]; keys 'S'[N] (UTF-8 relative paths); crc32 uint32[N] or None;
    offsets int64[N+1] or None: sample i has ``offsets[i+1] - offsets[i]`` bytes,
    at ``offsets[i]`` in a flat byte store, or at ``positions[i]`` in the file
    when ``positions`` (int64[N]) is given.  widths, heights int32[N] or None: each encoded
    image's stored size in pixels, read from its header when it was written (0 and 0: its header
    did not read); a raw archive's images are all its manifest's shape, and an older archive has none.
    """

    labels: np.ndarray
    keys: np.ndarray
    crc32: Optional[np.ndarray] = None
    offsets: Optional[np.ndarray] = None
    positions: Optional[np.ndarray] = None
    widths: Optional[np.ndarray] = None
    heights: Optional[np.ndarray] = None
    # each field's arrays, by name: "field.NAME.offsets" int64[N+1] (into its flat store, or sizes when
    # "field.NAME.positions" int64[N] says where each value starts in the file), "field.NAME.crc32" uint32[N]
    fields: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for array in [self.labels, self.keys, self.crc32, self.offsets, self.positions, self.widths, self.heights,
                      *self.fields.values()]:
            if isinstance(array, np.ndarray):  # a JoinedArray is read-only already
                array.setflags(write=False)

    def __len__(self) -> int:
        return len(self.labels)

    def key(self, i: int) -> str:
        return decode_key(self.keys[i])

    def arrays(self) -> Dict[str, np.ndarray]:
        """The arrays to store, by name (absent ones left out)."""
        named = {name: getattr(self, name) for name in SAMPLE_ARRAYS if getattr(self, name) is not None}
        return {**named, **self.fields}

    @classmethod
    def from_arrays(cls, arrays: Dict[str, np.ndarray], fields: Sequence[str] = ()) -> "SampleIndex":
        """The index of ``arrays``; ``fields``: the names of the field arrays to take (the manifest's)."""
        return cls(
            labels=np.asarray(arrays["labels"], dtype=np.int64),
            keys=np.asarray(arrays["keys"]),
            crc32=_optional(arrays, "crc32", np.uint32),
            offsets=_optional(arrays, "offsets", np.int64),
            positions=_optional(arrays, "positions", np.int64),
            widths=_as_stored(arrays, "widths"),  # their dtype as stored: the reader checks it (``image_sizes``)
            heights=_as_stored(arrays, "heights"),
            fields={name: np.asarray(arrays[name], dtype=np.uint32 if name.endswith(".crc32") else np.int64)
                    for name in fields if name in arrays},
        )

    def field_crc32s(self, names: Sequence[str]) -> Optional[List[np.ndarray]]:
        """The CRC32 array of each field of ``names``, in order; None when any is missing (no checksums)."""
        rows = [self.fields.get(field_array(name, "crc32")) for name in names]
        return None if any(row is None for row in rows) else cast(List[np.ndarray], rows)

    def field_bytes(self, name: str, i: int) -> Tuple[int, int]:
        """(start, size) of field ``name``'s value of sample i: its offset in the field's flat store, or its
        file position when the field's values lie among the file's records."""
        offsets = self.fields[field_array(name, "offsets")]
        start, size = int(offsets[i]), int(offsets[i + 1] - offsets[i])
        positions = self.fields.get(field_array(name, "positions"))
        return (start if positions is None else int(positions[i])), size

    def image_sizes(self) -> Optional[np.ndarray]:
        """int64 [N,2]: each sample's recorded (width, height) (0, 0: unknown), or None when the index
        records none (a raw archive, or one written before they were recorded)."""
        if self.widths is None or self.heights is None:
            return None
        return np.stack([np.asarray(self.widths, dtype=np.int64), np.asarray(self.heights, dtype=np.int64)], axis=1)

    def mapped(self) -> bool:
        """Whether every array is a map of the archive's file (see ``file_backed``)."""
        return all(file_backed(array) for array in self.arrays().values())

    def nbytes(self, i: int) -> int:
        if self.offsets is None:
            raise TypeError("this index stores no offsets, so no sample sizes")
        return int(self.offsets[i + 1] - self.offsets[i])


SAMPLE_ARRAYS = ("labels", "keys", "crc32", "offsets", "positions", "widths", "heights")
IMAGE_SIZE_ARRAYS = ("widths", "heights")  # int32[N] each, an encoded archive's only


def field_array(field: str, what: str) -> str:
    """The name of field ``field``'s index array ``what`` ("offsets", "crc32" or "positions")."""
    return f"field.{field}.{what}"


class JoinedArray(np.lib.mixins.NDArrayOperatorsMixin):
    """A read-only 1-D array that is its parts one after another, never copied whole unless asked.

    A sharded archive's index is its parts' indexes end to end.  Concatenated,
    it would be a private copy in every process that opens the archive (tens of
    bytes a sample: ~0.45 GiB at 14M samples), and a spawn or forkserver worker
    would receive it pickled.  Joined, each part's array stays where its part
    keeps it (mapped from the part's file), and the join pickles as the parts.

    What readers do with an index array, it does without a copy of the whole:
    ``len``, ``dtype``, ``shape``, ``nbytes``, an element, a slice, and an
    array of indices (a batch's labels: each part's rows gathered in place).
    Anything else (``np.asarray``, ``np.bincount``, ``tolist()``, ``==``,
    ``+``...) works on the whole concatenation, made for that call.  Parts of one field may differ
    in width (keys are as wide as each part's longest): the join has the widest.

    ``source`` gives the parts' arrays (asked once in each process: a pickled
    join asks again where it is unpickled, its parts mapped there anew),
    ``starts`` the first row of each part and the total at the end.
    """

    ndim = 1

    def __init__(self, source: "Callable[[], Sequence[np.ndarray]]", starts: np.ndarray, dtype: np.dtype) -> None:
        self.source, self.starts, self.dtype = source, starts, np.dtype(dtype)
        self._parts: Optional[Sequence[np.ndarray]] = None

    def __getstate__(self) -> Dict[str, Any]:
        return {"source": self.source, "starts": self.starts, "dtype": self.dtype, "_parts": None}

    @classmethod
    def of(cls, source: "Callable[[], Sequence[np.ndarray]]") -> "JoinedArray":
        parts = source()
        starts = np.cumsum([0] + [len(a) for a in parts]).astype(np.int64)
        joined = cls(source, starts, np.result_type(*parts) if parts else np.dtype(np.int64))
        joined._parts = parts
        return joined

    @property
    def parts(self) -> Sequence[np.ndarray]:
        if self._parts is None:
            self._parts = self.source()
        return self._parts

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> Tuple[int]:
        return (len(self),)

    @property
    def size(self) -> int:
        return len(self)

    @property
    def nbytes(self) -> int:
        return len(self) * self.dtype.itemsize

    def chunks(self) -> Iterator[np.ndarray]:
        """The parts in order, each in the join's dtype: the whole array, piece by piece."""
        for part in self.parts:
            yield part if part.dtype == self.dtype else part.astype(self.dtype)

    def __array__(self, dtype: "Optional[npt.DTypeLike]" = None, copy: Optional[bool] = None) -> np.ndarray:
        whole = np.concatenate(list(self.chunks())) if len(self.starts) > 1 else np.empty(0, self.dtype)
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            return self[np.arange(start, stop, step, dtype=np.int64)]
        if np.ndim(key) == 0:
            i = operator.index(key)
            i = i + len(self) if i < 0 else i
            if not 0 <= i < len(self):
                raise IndexError(f"index {key} is out of bounds for a joined array of {len(self)}")
            p, j = part_of(self.starts, i)
            return self.parts[p][j]
        idx = np.asarray(key)
        if idx.dtype == bool:
            if idx.shape != self.shape:
                raise IndexError(f"a mask of {idx.shape} for a joined array of {len(self)}")
            idx = np.flatnonzero(idx)
        elif idx.size == 0:
            idx = idx.astype(np.int64)
        elif not np.issubdtype(idx.dtype, np.integer) or idx.ndim != 1:
            raise IndexError("a joined array takes an integer, a slice, or a 1-D array of integers or a mask")
        return self._gather(np.where(idx < 0, idx + len(self), idx))

    def _gather(self, idx: np.ndarray) -> np.ndarray:
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"an index is out of bounds for a joined array of {len(self)}")
        out = np.empty(len(idx), dtype=self.dtype)
        parts = self.parts
        for p, mask, local in by_part(self.starts, idx):
            out[mask] = parts[p][local]
        return out

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """Operators and ufuncs (``labels == 3``, ``np.add``...) on the concatenation; it is read-only."""
        if any(isinstance(o, JoinedArray) for o in kwargs.get("out", ())):
            raise ValueError("a joined index array is read-only")
        arrays = tuple(np.asarray(x) if isinstance(x, JoinedArray) else x for x in inputs)
        return getattr(ufunc, method)(*arrays, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        for chunk in self.chunks():
            yield from chunk

    def __getattr__(self, name: str) -> Any:  # the rest of numpy's array API, on the whole
        if name.startswith("__") or name in ("source", "starts", "dtype", "_parts"):
            raise AttributeError(name)
        return getattr(np.asarray(self), name)

    def __repr__(self) -> str:
        return f"JoinedArray({len(self)} rows of {self.dtype} in {len(self.starts) - 1} parts)"


def part_of(starts: np.ndarray, i: int) -> Tuple[int, int]:
    """(the part holding row i, i's row in it), for parts whose first rows are ``starts``
    (with the total at the end)."""
    p = int(np.searchsorted(starts, i, side="right")) - 1
    return p, i - int(starts[p])


def by_part(starts: np.ndarray, idx: np.ndarray) -> Iterator[Tuple[int, np.ndarray, np.ndarray]]:
    """(part, mask of ``idx`` in it, those rows in the part) for each part that rows ``idx`` touch."""
    owner = np.searchsorted(starts, idx, side="right") - 1
    for p in np.unique(owner).tolist():
        mask = owner == p
        yield p, mask, idx[mask] - starts[p]


def chunks(array: "np.ndarray | JoinedArray") -> Iterator[np.ndarray]:
    """An index array piece by piece, each contiguous, in the array's dtype (one piece unless joined)."""
    if isinstance(array, JoinedArray):
        for chunk in array.chunks():
            yield np.ascontiguousarray(chunk)
    else:
        yield np.ascontiguousarray(array)


def _optional(arrays: Dict[str, np.ndarray], name: str, dtype) -> Optional[np.ndarray]:
    return None if name not in arrays else np.asarray(arrays[name], dtype=dtype)


def _as_stored(arrays: Dict[str, np.ndarray], name: str) -> Optional[np.ndarray]:
    return None if name not in arrays else np.asarray(arrays[name])


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


def npy_header(dtype: "npt.DTypeLike", shape: Tuple[int, ...]) -> bytes:
    """The .npy (version 1.0) header of a C-ordered array, padded as numpy pads it (data 64-byte aligned)."""
    header = io.BytesIO()
    fields = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(header, fields)
    return header.getvalue()


def npy_array(dtype: "npt.DTypeLike", rows: int) -> np.ndarray:
    """An uninitialised 1-D array that lies right after its own .npy header in one buffer, so that
    ``npy_record`` gives the .npy bytes of it without a copy (the builder's index arrays are these)."""
    dtype = np.dtype(dtype)
    header = npy_header(dtype, (rows,))
    buffer = np.empty(len(header) + rows * dtype.itemsize, dtype=np.uint8)
    buffer[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    return buffer[len(header) :].view(dtype)


def npy_record(array: np.ndarray) -> "bytes | memoryview":
    """The .npy bytes of ``array``: the buffer it lies in when ``npy_array`` made it, else a copy (``npy_bytes``)."""
    base = array.base
    if isinstance(base, np.ndarray) and base.dtype == np.uint8 and base.ndim == 1 and array.ndim == 1:
        header = npy_header(array.dtype, array.shape)
        start = array.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        if start == len(header) and base.nbytes == start + array.nbytes and base[:start].tobytes() == header:
            return base.data
    return npy_bytes(array)


BLOCK_ROWS = 1 << 16  # rows per block of a growing column


def anonymous_array(dtype: "npt.DTypeLike", rows: int) -> np.ndarray:
    """An uninitialised array over a private anonymous map of its own: its pages cost memory once
    written, and all of it goes back to the system the moment the array is dropped (a block from
    the C allocator may stay in the heap, as part of the process, after it is freed)."""
    dtype = np.dtype(dtype)
    region = mmap.mmap(-1, max(1, rows * dtype.itemsize), flags=mmap.MAP_PRIVATE)
    return np.frombuffer(region, dtype=dtype, count=rows)


class Column:
    """Values of one dtype kept in blocks of ``BLOCK_ROWS`` (``anonymous_array``): growing never
    copies what is stored, and ``take`` makes the whole array once, releasing each block as it is
    copied, so that the column and its array never both exist in full."""

    def __init__(self, dtype: "npt.DTypeLike") -> None:
        self.dtype = np.dtype(dtype)
        self.blocks: List[np.ndarray] = []
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def new_block(self) -> np.ndarray:
        """A new block at the end, to be filled from its first row (the caller counts the rows)."""
        self.blocks.append(anonymous_array(self.dtype, BLOCK_ROWS))
        return self.blocks[-1]

    def append(self, value: object) -> None:
        slot = self.count % BLOCK_ROWS
        block = self.new_block() if slot == 0 else self.blocks[-1]
        block[slot] = value
        self.count += 1

    def take(self, rows: Optional[int] = None) -> np.ndarray:
        """The first ``rows`` values (all appended ones by default) as one array; the column is empty after."""
        rows = self.count if rows is None else rows
        out = npy_array(self.dtype, rows)
        for at, part in _drain(self.blocks, rows):
            out[at : at + len(part)] = part
        self.count = 0
        return out


def _drain(blocks: List[np.ndarray], rows: int) -> Iterator[Tuple[int, np.ndarray]]:
    """(first row, rows) of each block in order, covering ``rows`` rows; each block leaves ``blocks``
    as it is handed out, so that it is released once the caller has copied it."""
    at = 0
    blocks.reverse()  # popped from the end, in order
    while blocks:
        block = blocks.pop()
        part = block[: max(0, min(len(block), rows - at))]
        del block
        yield at, part
        at += len(part)
    if at != rows:
        raise ValueError(f"the column holds {at} rows, not {rows}")


class IndexBuilder:
    """Grows the index while a writer appends samples, in blocks (``Column``): never a copy to grow,
    and never a Python object per sample (keys wait as bytes only until their block of rows is full).

    ``offsets``, ``positions`` and ``image_sizes`` (widths and heights) say whether the index will store
    them (sizes are kept only for the offsets).  ``build`` makes each array of the index once and releases
    the blocks as it goes: at its peak the builder holds about one index's bytes, plus a block.  Each
    array lies after its own .npy header (``npy_array``), so a writer that stores .npy bytes copies none
    of them.
    """

    def __init__(self, offsets: bool = False, positions: bool = False, image_sizes: bool = False) -> None:
        self.count = 0
        self._labels, self._crc32 = Column(np.int64), Column(np.uint32)
        self._sizes = Column(np.int64) if offsets else None
        self._positions = Column(np.int64) if positions else None
        self._widths = Column(np.int32) if image_sizes else None
        self._heights = Column(np.int32) if image_sizes else None
        self._numeric = [c for c in (self._labels, self._crc32, self._sizes, self._positions, self._widths,
                                     self._heights) if c is not None]
        places = {id(c): k for k, c in enumerate(self._numeric)}  # each column's place in ``_current``
        self._position_at = places.get(id(self._positions), -1)
        self._width_at = places.get(id(self._widths), -1)
        self._current: List[np.ndarray] = []  # the block being filled, per numeric column
        self._slot = BLOCK_ROWS  # rows filled in the current blocks (none yet: the first append makes them)
        self._key_blocks: List[np.ndarray] = []  # full blocks of keys, each fixed-width ('S') as wide as its longest
        self._pending_keys: List[bytes] = []  # the keys of the current block of rows

    def append(self, label: int, key: str, crc: int, size: int, position: int = -1,
               image_size: Tuple[int, int] = (0, 0)) -> None:
        """One more sample; ``image_size``: its image's (width, height), (0, 0) when unknown."""
        slot = self._slot
        if slot == BLOCK_ROWS:
            self._next_blocks()
            slot = 0
        current = self._current
        current[0][slot] = label
        current[1][slot] = crc
        if self._sizes is not None:
            current[2][slot] = size
        if self._position_at >= 0:
            current[self._position_at][slot] = position
        if self._width_at >= 0:  # the heights' column follows
            current[self._width_at][slot], current[self._width_at + 1][slot] = image_size
        self._pending_keys.append(key.encode("utf-8", "surrogateescape"))
        self._slot = slot + 1
        self.count += 1

    def _next_blocks(self) -> None:
        self._seal_keys()
        self._current = [column.new_block() for column in self._numeric]

    def _seal_keys(self) -> None:
        """The pending keys as one more fixed-width block."""
        if not self._pending_keys:
            return
        keys = np.array(self._pending_keys)  # 'S' as wide as the longest (at least 1), not a copy per key
        self._pending_keys = []
        block = anonymous_array(keys.dtype, len(keys))
        block[...] = keys
        self._key_blocks.append(block)

    def build(self) -> SampleIndex:
        """The index of every sample appended (once: the builder is empty after)."""
        n = self.count
        self._seal_keys()
        self._current = []  # the blocks are the columns' alone now, released as they are copied
        labels, crc = self._labels.take(n), self._crc32.take(n)
        offsets = None if self._sizes is None else offsets_of(self._sizes, n)
        positions = None if self._positions is None else self._positions.take(n)
        widths = None if self._widths is None else self._widths.take(n)
        heights = None if self._heights is None else self._heights.take(n)
        width = max([1] + [block.dtype.itemsize for block in self._key_blocks])
        keys = npy_array(f"S{width}", n)
        for at, part in _drain(self._key_blocks, n):
            keys[at : at + len(part)] = part
        return SampleIndex(labels=labels, keys=keys, crc32=crc, offsets=offsets, positions=positions,
                           widths=widths, heights=heights)


def offsets_of(sizes: Column, n: int) -> np.ndarray:
    """int64[n+1]: the running total of the first n sizes in ``sizes``, from 0 (the column is empty after)."""
    offsets = npy_array(np.int64, n + 1)
    offsets[0] = 0
    for at, part in _drain(sizes.blocks, n):
        np.cumsum(part, out=offsets[at + 1 : at + 1 + len(part)])
        offsets[at + 1 : at + 1 + len(part)] += offsets[at]
    sizes.count = 0
    return offsets


class FieldIndexBuilder:
    """The index arrays of a writer's fields (``field.NAME.offsets``, ``.crc32``, and ``.positions`` for a
    format that records where each value lies in its file), grown in blocks as ``IndexBuilder``."""

    def __init__(self, names: Sequence[str], positions: bool = False) -> None:
        self.names = list(names)
        self._columns = {name: (Column(np.int64), Column(np.uint32), Column(np.int64) if positions else None)
                         for name in self.names}

    def append(self, name: str, crc: int, size: int, position: int = -1) -> None:
        sizes, crcs, places = self._columns[name]
        sizes.append(size)
        crcs.append(crc)
        if places is not None:
            places.append(position)

    def build(self, n: int) -> Dict[str, np.ndarray]:
        """Every field's arrays for n samples (once: the builder is empty after)."""
        arrays: Dict[str, np.ndarray] = {}
        for name, (sizes, crcs, places) in self._columns.items():
            arrays[field_array(name, "offsets")] = offsets_of(sizes, n)
            arrays[field_array(name, "crc32")] = crcs.take(n)
            if places is not None:
                arrays[field_array(name, "positions")] = places.take(n)
        return arrays

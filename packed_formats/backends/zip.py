"""ZIP: one STORED member per sample plus .npy index members and manifest.json.

Readable by ``unzip``/``zipinfo``/``zipfile``.  The writer writes the ZIP
records itself (``zip_records``): besides the index it keeps one byte per
sample (its member's extension), and the central directory is streamed out
from the index at the end, a chunk at a time, so writing holds no more than
the index at any sample count.  The end record's comment
is a locator naming where the manifest and each index array lie: opening
reads the file's tail, the manifest, a few local headers to check them, and
maps the index arrays (each aligned to 64 bytes) instead of reading them, so
it costs the same at a thousand samples or fourteen million and every process
shares the index through the page cache.  Archives without a locator (written
by earlier versions, or rewritten by other tools) are read through
``zipfile``, which parses the whole central directory.

Reads never look at a sample's local header or central directory entry
(opening checks the first and last sample's local headers), but every other
ZIP tool does: ``verify`` checks them all against the index
(``ZipBackend.structure_problems``), reading the central directory once.

The index stores each sample's absolute byte position, so a read is one
``os.pread`` on a per-process file descriptor: no shared ``ZipFile`` seek
state, nothing to corrupt across fork.  Raw batches are gathered from a
per-process map of the file (``mapped.py``); equal member names give equal
local headers, so raw samples are evenly spaced.

A mapped index, like mapped samples, must not be truncated in place under a
reader: every read first checks that the file kept its size (one ``fstat``);
a truncation between that check and the read can still end the process.
"""

from __future__ import annotations

import io
import mmap
import os
import shutil
import zipfile
from typing import BinaryIO, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..checksum import crc32
from ..codecs import sniff
from ..errors import (
    ArchiveNotFoundError,
    ArchivePermissionError,
    CorruptArchiveError,
    IncompleteArchiveError,
    UnknownFormatError,
)
from ..fields import FIELD_ARRAY, field_arrays
from ..index import Column, SampleIndex, field_array, from_npy_bytes
from ..manifest import ArchiveManifest
from . import index_map, mapped
from .base import Backend, FormatSpec, Handle
from .files import DAMAGED_HINT
from .writer import Writer
from .zip_records import (
    CENTRAL_HEADER,
    LOCAL_HEADER,
    STORED,
    TAIL,
    ZIP64_LIMIT,
    CentralEntries,
    End,
    LayoutError,
    LocalHeader,
    Locator,
    Place,
    central_headers,
    end_overhangs,
    end_records,
    find_end,
    local_header,
    local_header_size,
    padding,
    parse_local_header,
    read_central_entries,
    with_zip64,
)

MANIFEST = "manifest.json"
INDEX_DIR = "index/"
EXTENSIONS = ("raw", "jpg", "png", "bin")  # a sample member's extension, by the code the writer keeps
ARRAY_ALIGNMENT = 64  # index arrays' data starts at a multiple of this: mapped, they are aligned
_CENTRAL_CHUNK = 1 << 14  # central directory entries built at a time
_LOCAL_HEADER_MAX = LOCAL_HEADER.size + 2 * 0xFFFF  # with the longest name and extra fields


def member_name(i: int, extension: str) -> str:
    return f"samples/{i:09d}.{extension}"


FIELD_EXTENSIONS = ("bin", "jpg", "png", "txt", "json")  # a field member's extension, by its code


def field_member_name(name: str, i: int, extension: str) -> str:
    return f"fields/{name}/{i:010d}.{extension}"


def field_extension_code(kind: str, blob) -> int:
    """The FIELD_EXTENSIONS code of a field value's member: what an image's bytes are, else by its kind."""
    if kind == "image":
        return {"jpeg": 1, "png": 2}.get(sniff(blob) or "", 0)
    return {"text": 3, "json": 4}.get(kind, 0)


def extension_code(mode: str, blob) -> int:
    """The EXTENSIONS code of a sample's member name: raw, else what its bytes are (``sniff``)."""
    return 0 if mode == "raw" else {"jpeg": 1, "png": 2}.get(sniff(blob) or "", 3)


def sample_names(first: int, kinds: np.ndarray) -> np.ndarray:
    """``member_name(i, EXTENSIONS[kinds[j]])`` for i = first + j, as one fixed-width bytes array
    (every i of one number of digits)."""
    numbers = np.arange(first, first + len(kinds), dtype=np.int64)
    width = max(9, len(str(first + len(kinds) - 1)))
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    digits = (numbers[:, None] // powers % 10 + ord("0")).astype(np.uint8)
    extensions = np.frombuffer(b"".join(e.encode() for e in EXTENSIONS), dtype=np.uint8).reshape(len(EXTENSIONS), -1)
    prefix = np.broadcast_to(np.frombuffer(b"samples/", dtype=np.uint8), (len(kinds), 8))
    dot = np.full((len(kinds), 1), ord("."), dtype=np.uint8)
    rows = np.ascontiguousarray(np.concatenate([prefix, digits, dot, extensions[kinds]], axis=1))
    return rows.view(f"S{rows.shape[1]}").reshape(-1)


def sample_directory(index: SampleIndex, kinds: np.ndarray, limit: int) -> Iterator[np.ndarray]:
    """The samples' central directory entries, a bounded chunk at a time, in order, made from the
    index and each member's extension code (``kinds``)."""
    crc = index.crc32
    assert crc is not None, "the writer's index has checksums"
    first, count = 0, len(index)
    while first < count:
        last = min(count, first + _CENTRAL_CHUNK, _next_power_of_ten(first))
        names, size, offset = _members(index, kinds, first, last, limit)
        yield from central_headers(names, crc[first:last], size, offset, limit)
        first = last


def _members(index: SampleIndex, kinds: np.ndarray, first: int, last: int, limit: int
             ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Names, sizes and local header offsets of the sample members ``first:last`` (names of one
    width), from the index's offsets and data positions: a local header starts its own size
    before its member's data."""
    offsets, positions = index.offsets, index.positions
    assert offsets is not None and positions is not None, "the writer's index has them"
    names = sample_names(first, kinds[first:last])
    size = np.diff(offsets[first : last + 1])
    return names, size, positions[first:last] - local_header_size(names.dtype.itemsize, size, limit)


def _next_power_of_ten(i: int) -> int:
    """The first number above i with one more digit (member names change width there, from 10**9 on)."""
    return 10 ** max(9, len(str(i)))


class ZipWriter(Writer):
    """Writes the ZIP records itself: samples, then the index arrays and manifest.json, then the
    central directory streamed from the index (``sample_directory``) and the end record with its
    locator.  Besides the index, all it keeps per sample is one byte: its extension's code."""

    format_name = "zip"
    stores_positions = True
    stores_fields = True
    zip64_limit = ZIP64_LIMIT  # sizes and offsets from this on get ZIP64 fields (tests lower it)

    def begin(self, temp_path: str) -> None:
        self._file: BinaryIO = open(temp_path, "wb", buffering=1 << 20)
        self._at = 0  # bytes written so far
        self._kinds = Column(np.uint8)  # each sample's EXTENSIONS code
        self._metadata: Dict[str, Tuple[Place, int]] = {}  # the index and manifest members: place, CRC32
        # Field members wait in a file of their own until the last sample (between the samples, they would
        # break the even spacing raw batches are gathered by), each with its local header; then they follow.
        self._aside: Optional[BinaryIO] = None
        self._aside_at = 0
        self._field_kinds = {spec.name: Column(np.uint8) for spec in self.fields}  # FIELD_EXTENSIONS codes
        self._field_kind = {spec.name: spec.kind for spec in self.fields}

    def append(self, blob: bytes, i: int, crc: int) -> int:
        if i != len(self._kinds):
            raise ValueError(f"sample {i} appended after {len(self._kinds)} samples: samples come in order")
        kind = extension_code(self.mode, blob)
        header = local_header(member_name(i, EXTENSIONS[kind]).encode(), len(blob), crc, limit=self.zip64_limit)
        offset = self._write(header, blob)
        self._kinds.append(kind)
        return offset + len(header)

    def append_field(self, name: str, blob: bytes, i: int, crc: int) -> int:
        """Kept aside with its local header: where its data starts in the aside file (moved by ``place_fields``)."""
        if self._aside is None:
            self._aside = open(self.temp_path + ".fields", "w+b", buffering=1 << 20)
        code = field_extension_code(self._field_kind[name], blob)
        header = local_header(field_member_name(name, i, FIELD_EXTENSIONS[code]).encode(), len(blob), crc,
                              limit=self.zip64_limit)
        start = self._aside_at
        self._aside_at += self._aside.write(header) + self._aside.write(blob)
        self._field_kinds[name].append(code)
        return start + len(header)

    def place_fields(self, arrays: Dict[str, np.ndarray]) -> None:
        """The field members after the samples; their positions in ``arrays`` made absolute."""
        if self._aside is None:
            return
        base = self._at
        self._aside.seek(0)
        shutil.copyfileobj(self._aside, self._file, 1 << 20)
        self._at += self._aside_at
        self._close_aside()
        for spec in self.fields:
            arrays[field_array(spec.name, "positions")] += base

    def _close_aside(self) -> None:
        if self._aside is not None:
            self._aside.close()
            self._aside = None
            os.unlink(self.temp_path + ".fields")

    def finish(self, index: SampleIndex, manifest: ArchiveManifest) -> None:
        for name, array in index.arrays().items():
            self._write_array(f"{INDEX_DIR}{name}.npy", array)
        text = manifest.to_json().encode()
        self._write_metadata(MANIFEST, [text], crc32(text), len(text))
        self._write_central_directory(index)
        self._file.close()

    def discard(self) -> None:
        try:
            self._file.close()
        except Exception:
            pass
        try:
            self._close_aside()
        except Exception:
            pass

    # ---- helpers ----
    def _write(self, *parts) -> int:
        """Write ``parts`` one after the other; where the first starts."""
        start = self._at
        for part in parts:
            self._at += self._file.write(part)
        return start

    def _write_array(self, name: str, array: np.ndarray) -> None:
        """An index array as a .npy member whose array data starts at a multiple of ARRAY_ALIGNMENT
        (written from the array itself: no copy of it is made)."""
        array = np.ascontiguousarray(array)
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
        npy_header, data = header.getvalue(), array.reshape(-1).view(np.uint8)
        self._write_metadata(name, [npy_header, data], crc32(data, crc32(npy_header)), len(npy_header) + data.size,
                             align=len(npy_header))

    def _write_metadata(self, name: str, parts: list, crc: int, size: int, align: Optional[int] = None) -> None:
        """A metadata member; with ``align``, padded so that its byte ``align`` starts at a multiple
        of ARRAY_ALIGNMENT."""
        encoded = name.encode()
        header = local_header(encoded, size, crc, limit=self.zip64_limit)
        if align is not None:
            extra = padding(self._at + len(header) + align, ARRAY_ALIGNMENT)
            header = local_header(encoded, size, crc, extra, limit=self.zip64_limit)
        offset = self._write(header, *parts)
        self._metadata[name] = (Place(offset, offset + len(header), size), crc)

    def _write_central_directory(self, index: SampleIndex) -> None:
        start = self._at
        kinds = self._kinds.take()
        for entries in sample_directory(index, kinds, self.zip64_limit):
            self._write(entries.view(np.uint8))
        for spec in self.fields:
            for entries in self._field_directory(index, spec.name):
                self._write(entries.view(np.uint8))
        for name, (place, crc) in self._metadata.items():
            fields = (np.array([name.encode()]), np.array([crc], np.uint32), np.array([place.size]),
                      np.array([place.header]))
            for entries in central_headers(*fields, limit=self.zip64_limit):
                self._write(entries.view(np.uint8))
        n = len(index)
        places = {name: place for name, (place, _) in self._metadata.items()}
        first_and_last = (0, n - 1) if n else ()  # their local headers, which readers check
        edges = tuple(int(_members(index, kinds, i, i + 1, self.zip64_limit)[2][0]) for i in first_and_last)
        locator = Locator(places, edges)
        count = n * (1 + len(self.fields)) + len(self._metadata)
        self._write(end_records(count, start, self._at - start, locator.encode(), self.zip64_limit))

    def _field_directory(self, index: SampleIndex, name: str) -> Iterator[np.ndarray]:
        """The central directory entries of field ``name``'s members, a chunk at a time."""
        codes = self._field_kinds[name].take()
        offsets, crcs = index.fields[field_array(name, "offsets")], index.fields[field_array(name, "crc32")]
        positions = index.fields[field_array(name, "positions")]
        for first in range(0, len(index), _CENTRAL_CHUNK):
            last = min(len(index), first + _CENTRAL_CHUNK)
            names = np.array([field_member_name(name, i, FIELD_EXTENSIONS[c]).encode()
                              for i, c in zip(range(first, last), codes[first:last])])
            size = np.diff(offsets[first : last + 1])
            # one name length per run of entries (an image field's jpg and png have the same)
            header_at = positions[first:last] - local_header_size(names.dtype.itemsize, size, self.zip64_limit)
            yield from central_headers(names, crcs[first:last], size, header_at, self.zip64_limit)


class ZipHandle(Handle):
    """A per-process file descriptor and, after the first raw batch, the file's mapped sample rows;
    for structure checks, a map of the whole file and how far its central directory was read."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size  # the index may be mapped from the file: it must keep this size
        self.rows: "Optional[mapped.MappedRows | bool]" = None  # False: not mappable (shorter than its index)
        self.map: Optional[mmap.mmap] = None
        self.directory: Optional[np.ndarray] = None  # the file's bytes up to its central directory's end
        self.directory_offset = 0  # where the central directory starts
        self.next_entry = (0, 0)  # (sample, byte): the entry the last structure check stopped before

    def mapped_rows(self, positions: np.ndarray, nbytes: int) -> "Optional[mapped.MappedRows]":
        if self.rows is None:
            self.rows = mapped.MappedRows.of(self.fd, positions, nbytes) or False
        return self.rows if isinstance(self.rows, mapped.MappedRows) else None

    def check_size(self) -> None:
        """FileTruncatedError when the file shrank since it was opened (its mapped index would SIGBUS)."""
        mapped.check_file_size(self.fd, self.size)

    def fileno(self) -> int:
        """The descriptor reads use: ``Reader`` checks the file through it before each read or batch."""
        return self.fd

    def file_bytes(self) -> np.ndarray:
        """The whole file as read-only uint8, from a map made on first use (the size checked first)."""
        self.check_size()
        if self.map is None:
            self.map = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ)
        return np.frombuffer(self.map, dtype=np.uint8)

    def close(self) -> None:
        if isinstance(self.rows, mapped.MappedRows):
            self.rows.close()
        self.rows = self.directory = None
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a view still lives somewhere; unmapped when it dies
                pass
            self.map = None
        os.close(self.fd)

    def discard_inherited(self) -> None:
        self.close()  # the child's copies of the parent's mapping and descriptor


class ZipBackend(Backend[ZipHandle]):
    format_name = "zip"

    @classmethod
    def read_metadata(cls, path: str) -> Tuple[ArchiveManifest, SampleIndex]:
        """From the locator in the end record when there is one (O(1)), else through ``zipfile``."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ArchiveNotFoundError(path, "no such file") from None
        except PermissionError:
            raise ArchivePermissionError.denied(path) from None
        except OSError as exc:
            raise CorruptArchiveError(path, f"cannot read the archive index: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            tail, end = _end_record(fd, size)
            if end is None or not Locator.marks(end.comment):
                _check_cut_locator(path, tail, end)
                return _read_with_zipfile(path)
            return _read_located(path, fd, with_zip64(tail, size, end))
        except LayoutError as exc:
            raise CorruptArchiveError(path, str(exc), hint=DAMAGED_HINT) from None
        except OSError as exc:
            raise CorruptArchiveError(path, f"cannot read the archive index: {exc}") from None
        finally:
            os.close(fd)

    def open(self) -> ZipHandle:
        try:
            return ZipHandle(os.open(self.path, os.O_RDONLY))
        except FileNotFoundError:
            raise ArchiveNotFoundError(self.path, "no such file") from None
        except PermissionError:
            raise ArchivePermissionError.denied(self.path) from None

    def read(self, handle: ZipHandle, i: int) -> bytes:
        handle.check_size()
        offsets = self.offsets
        size = int(offsets[i + 1] - offsets[i])
        data = os.pread(handle.fd, size, int(self.positions[i]))
        if len(data) != size:
            raise self.corrupt(f"read {len(data)} of {size} bytes: the file is truncated", i)
        return data

    def read_field(self, handle: ZipHandle, name: str, i: int) -> bytes:
        handle.check_size()
        if field_array(name, "positions") not in self.index.fields:
            raise CorruptArchiveError(self.path, f"the index does not say where field {name!r} lies",
                                      hint=DAMAGED_HINT)
        start, size = self.index.field_bytes(name, i)
        if start < 0 or size < 0 or start + size > handle.size:
            raise self.corrupt(f"field {name!r}: bytes {start}:{start + size} lie outside the file", i)
        data = os.pread(handle.fd, size, start)
        if len(data) != size:
            raise self.corrupt(f"field {name!r}: read {len(data)} of {size} bytes: the file is truncated", i)
        return data

    def rows_of(self, handle: ZipHandle) -> "Optional[mapped.MappedRows]":
        return handle.mapped_rows(self.positions, self.sample_nbytes)

    def read_batch(self, handle: ZipHandle, idx: np.ndarray, out: np.ndarray) -> None:
        """One gather from the mapped file (see mapped.py); one ``pread`` per sample into a
        non-contiguous ``out``, or when the file is shorter than its index says."""
        handle.check_size()
        size = self.sample_nbytes
        rows = self.rows_of(handle) if out.flags.c_contiguous else None
        if rows is not None:
            rows.gather(idx, out)
            return
        for j, i in enumerate(idx):
            got = os.preadv(handle.fd, [memoryview(out[j]).cast("B")], int(self.positions[i]))
            if got != size:
                raise self.corrupt(f"read {got} of {size} bytes: the file is truncated", int(i))

    def sample_location(self, i: int) -> Tuple[str, int]:
        return self.path, int(self.positions[i])

    def structure_problems(self, handle: ZipHandle, first: int, last: int) -> Dict[int, str]:
        """Samples first:last whose local header or central directory entry is not that of their member
        (see ``_StructureCheck``): what ZIP tools read, which our reads never look at."""
        problems: Dict[int, str] = {}
        while first < last:
            stop = min(last, _next_power_of_ten(first))  # member names of one width
            problems.update(_StructureCheck(self, handle, first, stop).problems())
            first = stop
        return problems


# ---- checking the samples' ZIP records (verify) -----------------------------------------------------------
class _StructureCheck:
    """The local headers and central directory entries of samples first:last (member names of one
    width) against the index, each field of many samples compared at once.

    Samples are the archive's first members and its central directory's first entries, in order,
    each local header right after the previous sample's bytes (the first at byte 0): so the writer
    lays them out, and so did ``zipfile`` for archives of the earlier layout.  Each sample's member
    must be STORED, named ``member_name(i, extension)`` for what its bytes are, with the index's
    CRC32 and size.  Fields that tools need not read a member right (times, attributes) are not
    compared.  The central directory is read on from where the previous check of the same handle
    stopped, so checking a whole archive in order reads it once.
    """

    def __init__(self, backend: ZipBackend, handle: ZipHandle, first: int, last: int) -> None:
        self.backend, self.handle, self.first = backend, handle, first
        self.data = handle.file_bytes()
        self.positions = backend.positions[first:last].astype(np.int64)
        self.sizes = np.diff(backend.offsets[first : last + 1]).astype(np.int64)
        self.crc = backend._required(backend.index.crc32, "crc32")[first:last].astype(np.int64)
        previous_end = int(backend.positions[first - 1]) + backend.index.nbytes(first - 1) if first else 0
        self.headers = np.concatenate(([previous_end], self.positions[:-1] + self.sizes[:-1])).astype(np.int64)
        self.names = sample_names(first, self._extension_codes())

    def problems(self) -> Dict[int, str]:
        """Sample index -> what is wrong with its local header and central directory entry."""
        local, central = self._local_problems(), self._central_problems()
        return {i: "; ".join(p for p in (local.get(i), central.get(i)) if p) for i in sorted({*local, *central})}

    def _extension_codes(self) -> np.ndarray:
        """``extension_code`` of each sample, from its first 8 bytes (all ``sniff`` reads): once per
        distinct head, and for each sample shorter than that."""
        if self.backend.manifest.mode == "raw":
            return np.zeros(len(self.positions), np.uint8)
        heads = _rows(self.data, self.positions, 8).view(np.uint64).reshape(-1)
        distinct, which = np.unique(heads, return_inverse=True)
        codes = np.array([extension_code("encoded", head.tobytes()) for head in distinct], np.uint8)[which]
        for j in np.flatnonzero(self.sizes < 8):
            codes[j] = extension_code("encoded", self.data[self.positions[j] : self.positions[j] + self.sizes[j]])
        return codes

    def _local_problems(self) -> Dict[int, str]:
        dtype = np.dtype([("header", LOCAL_HEADER.dtype), ("name", self.names.dtype)])
        at = self.headers
        fields = _rows(self.data, at, dtype.itemsize).view(dtype).reshape(-1)
        header = fields["header"]
        lengths = header["name_length"].astype(np.int64), header["extra_length"].astype(np.int64)
        name_at = at + LOCAL_HEADER.size
        data_at = name_at + lengths[0] + lengths[1]
        size, compressed = header["size"].astype(np.int64), header["compressed"].astype(np.int64)
        for j in np.flatnonzero((size == ZIP64_LIMIT) | (compressed == ZIP64_LIMIT)):  # sizes in a ZIP64 field
            try:
                wide = parse_local_header(bytes(self.data[at[j] : data_at[j]]), int(at[j]))
                size[j], compressed[j] = wide.size, wide.compressed
            except LayoutError:
                pass  # none: the sizes read as wrong
        stored_crc = header["crc32"]
        return self._first_failures("ZIP local header", at, [
            (header["signature"] != int.from_bytes(LOCAL_HEADER.signature, "little"),
             lambda j: "not found (no signature where this sample's member should start)"),
            ((lengths[0] != self.names.dtype.itemsize) | (fields["name"] != self.names),
             lambda j: f"names {_shown(self.data[name_at[j] : name_at[j] + min(lengths[0][j], 200)])} "
                       f"instead of {_shown(self.names[j])}"),
            (header["method"] != STORED, lambda j: f"compression method {header['method'][j]}, not STORED"),
            (stored_crc != self.crc, lambda j: f"stored CRC {stored_crc[j]:08x}, index says {self.crc[j]:08x}"),
            (size != self.sizes, lambda j: f"stored size {size[j]}, index says {self.sizes[j]}"),
            (compressed != self.sizes, lambda j: f"stored compressed size {compressed[j]}, index says {self.sizes[j]}"),
            (data_at != self.positions,
             lambda j: f"the sample's data would start at byte {data_at[j]}, index says {self.positions[j]}"),
        ])

    def _central_problems(self) -> Dict[int, str]:
        entries = self._central_entries()
        found = len(entries.at)
        names, crc, sizes, headers = self.names[:found], self.crc[:found], self.sizes[:found], self.headers[:found]
        method, stored_crc = entries.header["method"], entries.header["crc32"]
        problems = self._first_failures("central directory entry", entries.at, [
            ((entries.header["name_length"] != self.names.dtype.itemsize) | (entries.name != names),
             lambda j: f"names {_shown(entries.name[j])} instead of {_shown(names[j])}"),
            (method != STORED, lambda j: f"compression method {method[j]}, not STORED"),
            (stored_crc != crc, lambda j: f"stored CRC {stored_crc[j]:08x}, index says {crc[j]:08x}"),
            (entries.size != sizes, lambda j: f"stored size {entries.size[j]}, index says {sizes[j]}"),
            (entries.compressed != sizes,
             lambda j: f"stored compressed size {entries.compressed[j]}, index says {sizes[j]}"),
            (entries.offset != headers,
             lambda j: f"local header offset {entries.offset[j]}, "
                       f"but the sample's local header is at byte {headers[j]}"),
        ])
        for i in range(self.first + found, self.first + len(self.names)):
            problems[i] = (f"the central directory cannot be read from byte {entries.end} on, "
                           f"where the entry of sample {self.first + found} should start")
        return problems

    def _central_entries(self) -> CentralEntries:
        """Entries first:last of the central directory, fewer when it cannot be read that far."""
        handle, first, last = self.handle, self.first, self.first + len(self.names)
        if handle.directory is None:
            end = _directory_end(self.backend.path, handle)
            handle.directory = self.data[: end.directory_offset + end.directory_size]
            handle.directory_offset = end.directory_offset
            handle.next_entry = (0, end.directory_offset)
        sample, at = handle.next_entry
        if sample > first:  # checked out of order: from the directory's start again
            sample, at = 0, handle.directory_offset
        if sample < first:
            skipped = read_central_entries(handle.directory, at, first - sample)
            if len(skipped.at) < first - sample:
                return read_central_entries(handle.directory, skipped.end, 0)
            at = skipped.end
        entries = read_central_entries(handle.directory, at, last - first)
        handle.next_entry = (first + len(entries.at), entries.end)
        return entries

    def _first_failures(self, record: str, at: np.ndarray, checks: List[Tuple[np.ndarray, Callable[[int], str]]]
                        ) -> Dict[int, str]:
        """Sample index -> "<record> at byte <at>: <problem>" of the first of the ``checks`` (the samples
        failing it, what to say of the j-th) that the sample fails."""
        problems: Dict[int, str] = {}
        for bad, describe in checks:
            for j in np.flatnonzero(bad).tolist():
                if self.first + j not in problems:
                    problems[self.first + j] = f"{record} at byte {at[j]}: {describe(j)}"
        return problems


def _rows(data: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """``data[s : s + width]`` for each of ``starts``, as one [len(starts), width] array (a start too near
    the end reads the last ``width`` bytes instead: they fail whatever check reads them)."""
    windows = np.lib.stride_tricks.as_strided(data, (len(data) - width + 1, width), (1, 1), writeable=False)
    return windows[np.clip(starts, 0, len(windows) - 1)]


def _shown(name: "bytes | np.ndarray") -> str:
    """A member name as quoted in a problem: 'samples/000000001.jpg', bytes outside ASCII escaped."""
    return repr(bytes(name))[1:]


def _directory_end(path: str, handle: ZipHandle) -> End:
    """Where the archive's central directory lies (CorruptArchiveError when that cannot be read)."""
    try:
        tail, end = _end_record(handle.fd, handle.size)
        if end is None:
            raise LayoutError("no ZIP end record closes the file")
        return with_zip64(tail, handle.size, end)
    except LayoutError as exc:
        raise CorruptArchiveError(path, str(exc), hint=DAMAGED_HINT) from None


# ---- opening through the locator -------------------------------------------------------------------------
def _pread(fd: int, size: int, offset: int) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise LayoutError(f"read {len(data)} of {size} bytes at byte {offset}: the file is truncated")
    return data


def _end_record(fd: int, size: int) -> Tuple[bytes, Optional[End]]:
    """The last bytes of a file of ``size`` bytes (where its end record must lie) and the end record
    closing it there (``find_end``: its 32-bit values), or None."""
    tail = _pread(fd, min(size, TAIL), size - min(size, TAIL))
    return tail, find_end(tail, size)


def _check_cut_locator(path: str, tail: bytes, end: Optional[End]) -> None:
    """An end record carrying our locator that does not close the file: say so, rather than let ``zipfile``
    guess at a cut or extended archive."""
    overhang = end_overhangs(tail) if end is None else None
    if overhang is True:
        raise IncompleteArchiveError(
            path, "the file ends inside its ZIP end record", hint="the file is truncated or its writer was killed"
        )
    if overhang is False:
        raise CorruptArchiveError(path, "bytes follow the ZIP end record", hint=DAMAGED_HINT)


def _read_located(path: str, fd: int, end: End) -> Tuple[ArchiveManifest, SampleIndex]:
    """Manifest and mapped index from the places the locator gives, each checked against its local header."""
    if end.directory_offset + end.directory_size != end.directory_end:
        raise LayoutError("the central directory does not end where the end record says")
    if _pread(fd, 4, end.directory_offset) != CENTRAL_HEADER.signature:
        raise LayoutError(f"no central directory at byte {end.directory_offset}, where the end record says")
    locator = Locator.decode(end.comment)
    for name, place in locator.members.items():
        if not place.header < place.data <= place.data + place.size <= end.directory_offset:
            raise LayoutError(f"the locator places {name} outside the archive's members")
    if MANIFEST not in locator.members:
        raise LayoutError("the locator names no manifest.json")
    text = _read_member(fd, MANIFEST, locator.members[MANIFEST])
    try:
        manifest = ArchiveManifest.from_json(text, path=path)
    except ValueError as exc:
        raise LayoutError(f"the manifest is damaged ({exc})") from None
    members = manifest.count * (1 + len(manifest.fields))
    if end.entries != members + len(locator.members):
        raise LayoutError(f"the central directory has {end.entries} entries, the manifest says {members} samples "
                          f"and field values and the locator {len(locator.members)} other members")
    arrays = {name[len(INDEX_DIR) : -len(".npy")]: place for name, place in locator.members.items() if name != MANIFEST}
    try:
        index = SampleIndex.from_arrays(_map_arrays(fd, arrays), field_arrays(manifest.fields))
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"cannot read the archive index: {exc}") from None
    _check_samples(fd, locator, manifest, index, end.directory_offset)
    return manifest, index


def _local_header(fd: int, name: str, place: Place) -> LocalHeader:
    """The member's local header, checked to be a STORED ``name`` of ``place.size`` bytes starting at ``place.data``."""
    header = _parse_local_header(fd, place.header, place.data)
    if header.name != name.encode() or header.method != 0 or header.data != place.data or header.size != place.size:
        raise LayoutError(f"the local header at byte {place.header} is not that of {name} where the locator says")
    return header


def _parse_local_header(fd: int, at: int, data: int) -> LocalHeader:
    """The local header at byte ``at`` of a member whose data should start at byte ``data``."""
    if not 0 <= data - at - LOCAL_HEADER.size <= _LOCAL_HEADER_MAX:
        raise LayoutError(f"no ZIP local header of a member whose data starts at byte {data} can start at byte {at}")
    return parse_local_header(_pread(fd, data - at, at), at)


def _read_member(fd: int, name: str, place: Place) -> bytes:
    """A small member's bytes, checked against the CRC32 of its local header."""
    header = _local_header(fd, name, place)
    data = _pread(fd, place.size, place.data)
    if crc32(data) != header.crc32:
        raise LayoutError(f"{name} is damaged (its CRC-32 does not match)")
    return data


def _map_arrays(fd: int, places: Dict[str, Place]) -> Dict[str, np.ndarray]:
    """Each index member's array as a read-only view of one map of the file (``index_map``)."""
    where = {}
    for array, place in places.items():
        if not (array.isidentifier() or FIELD_ARRAY.match(array)):
            raise LayoutError(f"the locator names an unexpected index member {array!r}")
        _local_header(fd, f"{INDEX_DIR}{array}.npy", place)
        where[array] = _npy_layout(fd, array, place)
    try:
        return index_map.map_arrays(fd, where)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None


def _npy_layout(fd: int, array: str, place: Place) -> index_map.ArrayAt:
    """Where an index member's array data lies, from its .npy header."""
    layout = index_map.npy_layout(lambda n: _pread(fd, min(place.size, n), place.data))
    if layout is None:
        raise LayoutError(f"the index member {array}.npy is damaged (not a plain .npy header)")
    header_size, dtype, shape = layout
    at = index_map.ArrayAt(place.data + header_size, dtype, shape)
    if header_size + at.nbytes != place.size:
        raise LayoutError(f"the index member {array}.npy is damaged (its header does not describe its data)")
    return at


def _check_samples(fd: int, locator: Locator, manifest: ArchiveManifest, index: SampleIndex,
                   directory_offset: int) -> None:
    """The first and last samples' local headers agree with the index: name, size, CRC32 and data position."""
    n = manifest.count
    if n == 0:
        return
    if len(locator.samples) != 2 or index.positions is None or index.crc32 is None or index.offsets is None:
        raise LayoutError("the locator or the index does not say where the samples are")
    if min(len(array) for array in index.arrays().values()) < n or len(index.offsets) <= n:
        raise LayoutError(f"the index has fewer entries than the manifest's {n} samples")
    for i, header_at in zip((0, n - 1), locator.samples):
        position, size = int(index.positions[i]), index.nbytes(i)
        if not header_at < position <= position + size <= directory_offset:
            raise LayoutError(f"sample {i}'s local header and data lie outside the archive's members")
        header = _parse_local_header(fd, header_at, position)
        if (not header.name.startswith(member_name(i, "").encode()) or header.method != 0
                or header.data != position or header.size != size or header.crc32 != int(index.crc32[i])):
            raise LayoutError("sample positions in the index do not match the ZIP layout")


# ---- opening through zipfile (archives without a locator) ----------------------------------------------------
def _read_with_zipfile(path: str) -> Tuple[ArchiveManifest, SampleIndex]:
    """Parse the whole central directory with ``zipfile``: archives of earlier versions, foreign ZIPs."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            if MANIFEST not in names:
                if any(n.startswith("samples/") for n in names):
                    raise IncompleteArchiveError(path, "the ZIP has samples but no manifest: it was never sealed")
                raise UnknownFormatError(path, "a ZIP file, but not a packed_formats archive (no manifest.json)")
            manifest = ArchiveManifest.from_json(archive.read(MANIFEST), path=path)
            arrays = {
                n[len(INDEX_DIR) : -len(".npy")]: from_npy_bytes(archive.read(n))
                for n in names
                if n.startswith(INDEX_DIR) and n.endswith(".npy")
            }
            index = SampleIndex.from_arrays(arrays, field_arrays(manifest.fields))
            if manifest.count:
                _check_first_member(path, archive, index)
    except zipfile.BadZipFile as exc:
        if "CRC" in str(exc):  # a metadata member fails ZIP's own checksum: damaged, not unfinished
            raise CorruptArchiveError(path, f"the archive index is damaged ({exc})", hint=DAMAGED_HINT) from None
        raise IncompleteArchiveError(
            path, f"not a complete ZIP file ({exc})", hint="the file is truncated or its writer was killed"
        ) from None
    except (KeyError, ValueError, OSError, EOFError) as exc:
        raise CorruptArchiveError(path, f"cannot read the archive index: {exc}") from None
    return manifest, index


def _check_first_member(path: str, archive: zipfile.ZipFile, index: SampleIndex) -> None:
    """The stored position must be where the member's data starts (STORED only)."""
    info = next(i for i in archive.infolist() if i.filename.startswith("samples/"))
    if info.compress_type != zipfile.ZIP_STORED:
        raise CorruptArchiveError(path, f"member {info.filename} is compressed; samples must be STORED")
    with open(path, "rb") as file:
        head = os.pread(file.fileno(), LOCAL_HEADER.size, info.header_offset)
    fields = LOCAL_HEADER.unpack(head)
    start = -1 if fields is None else info.header_offset + len(head) + fields["name_length"] + fields["extra_length"]
    if index.positions is None or start != int(index.positions[0]):
        raise CorruptArchiveError(path, "sample positions in the index do not match the ZIP layout")


def _sniff(path: str, head: Optional[bytes]) -> bool:
    return head is not None and head[:4] in (b"PK\x03\x04", b"PK\x05\x06")


SPEC = FormatSpec("zip", ZipBackend, ZipWriter, (".zip",), _sniff)

"""HDF5: raw samples in one uint8 [N,H,W,C] dataset chunked one image per chunk;
encoded samples in a flat uint8 byte dataset of 64 KiB chunks plus an offsets dataset.

Readable by ``h5ls``/``h5dump``/plain h5py.  HDF5 writes the archive; it never
reads one in a reading process.  HDF5 trusts the metadata it parses: damage
there, or a file made to look sealed, can make it hang forever or crash the
process (a damaged chunk index is read at every sample), and no checksum a
writer can recompute makes its parser safe.  So the writer stores in the
file's user block (``hdf5_guard``) the CRC32 of every byte range HDF5 reads
when it opens the archive and a locator of the manifest's stored text, the
index arrays and (encoded) a chunk table: each chunk's file address, listed
once at write time (``hdf5_layout``).  A reader checks the user block, reads
the manifest and maps the index from the located spans (each checked against
the file's size; the index then by the manifest's CRC32s), and reads each raw
image with ``pread`` at the index's ``positions`` (a batch: gathered from a map
of the file) and encoded bytes at the chunk table's addresses: every offset it
reads at lies in its own checked index, and is checked against the file before
use.  Archives written before the locator are described by HDF5 in a child
process under a time limit (``hdf5_probe``): a crash or a hang there ends that
process and names the file damaged.

Opening costs the same at any number of samples: the index arrays are written
contiguous and unfiltered and mapped from the file (``index_map``).  The index
lives in the data file: a file truncated under a reader is caught before each
read (``check_size``), as reading a mapped page it no longer has would end the
process with SIGBUS.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Dict, List, Optional, Tuple

import h5py
import numpy as np

from ..checksum import crc32
from ..errors import ArchiveNotFoundError, ArchivePermissionError, ClosedArchiveError, CorruptArchiveError
from ..fields import field_arrays
from ..index import SampleIndex
from ..manifest import ArchiveManifest
from . import hdf5_fields, hdf5_guard, hdf5_layout, index_map, mapped
from .base import Backend, FormatSpec, Handle
from .files import DAMAGED_HINT
from .writer import Writer

MANIFEST_ATTR = "packed_formats_manifest"
_ENCODED_CHUNK = 1 << 16
_INDEX_NAMES = ("labels", "keys", "crc32", "offsets", "positions", "widths", "heights")
CHUNKS_NAME = "chunk_table"  # encoded: the file address of each chunk of "data", which readers read from
_SAMPLE_NAMES = ("images", "data")
_AGREE_ROWS = 16  # index entries HDF5 reads at each end of an index array when the seal is recorded


class HDF5Handle(Handle):
    """This process's descriptor of the archive's file, the size the file must keep (the index
    arrays are mapped from it), and a map of its images (raw archives, made on first batch)."""

    def __init__(self, fd: int, needed: int = 0) -> None:
        self.fd: Optional[int] = fd
        self.needed = needed
        self.rows: "Optional[mapped.MappedRows | bool]" = None  # False: not mappable
        self._mapping = threading.Lock()  # threads reading batches at once make one map

    def check_size(self) -> None:
        """FileTruncatedError when the file became shorter than when it was opened: its mapped
        index (and images) may lie in what was cut off, and touching that is SIGBUS."""
        if self.fd is None:
            raise ClosedArchiveError(None, "the archive's handle is closed")
        mapped.check_file_size(self.fd, self.needed)

    def fileno(self) -> Optional[int]:
        """The file's descriptor: ``Reader`` checks the file through it before each read or batch."""
        return self.fd

    def mapped_rows(self, positions: np.ndarray, nbytes: int) -> "Optional[mapped.MappedRows]":
        """The images at ``positions`` in a map of the file (made once), or None when one lies outside it."""
        with self._mapping:
            if self.rows is None and self.fd is not None:
                inside = len(positions) > 0 and int(np.min(positions)) >= 0
                self.rows = (mapped.MappedRows.of(self.fd, positions, nbytes) if inside else None) or False
        return self.rows if isinstance(self.rows, mapped.MappedRows) else None

    def close(self) -> None:
        if isinstance(self.rows, mapped.MappedRows):
            self.rows.close()
        self.rows = None
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def discard_inherited(self) -> None:
        self.close()  # this process's copies of the parent's descriptor and map; the parent keeps its own


class HDF5Writer(Writer):
    format_name = "hdf5"
    stores_fields = True

    @staticmethod
    def size_bound(mode: str, count: int, payload: int, sample_bytes: Optional[int], key_bytes: int,
                   parts: int = 1) -> int:
        """A high estimate of the bytes HDF5 stores for ``count`` samples of ``payload`` bytes in ``parts``
        files (``space.archive_bytes`` adds the index and manifest): the samples' chunks (encoded: the last
        chunk of each file allocated whole), their chunk index (B-tree nodes at least half full), each
        file's user block and object headers, and the room ``_ensure_room`` asks for beyond the last block."""
        if mode == "raw":
            chunks, stored, per_entry = count, payload, 2 * 56  # a rank-4 chunk key (48 bytes) and its address
        else:
            chunks = payload // _ENCODED_CHUNK + parts
            # a rank-1 key (24 bytes) and its address, and the chunk's address in the chunk table
            stored, per_entry = chunks * _ENCODED_CHUNK, 2 * 32 + 8
        return stored + chunks * per_entry + parts * (hdf5_guard.USERBLOCK + _FILE_METADATA) + _room_margin(
            _BLOCK_SAMPLES)

    def begin(self, temp_path: str) -> None:
        # each field's values wait in a file of their own, then go into one bundle (hdf5_fields)
        self._field_paths = {spec.name: f"{temp_path}.field-{spec.name}" for spec in self.fields}
        self._field_files = {name: open(path, "wb") for name, path in self._field_paths.items()}
        self._file = h5py.File(temp_path, "w", userblock_size=hdf5_guard.USERBLOCK)  # filled by finish
        self._capacity = 0
        self._filled = 0  # samples (raw) or bytes (encoded) written to the dataset
        self._pending: List[np.ndarray] = []
        self._pending_bytes = 0
        if self.mode == "raw":
            self._data = self._file.create_dataset(
                "images",
                shape=(0,) + self.stored_shape,
                maxshape=(None,) + self.stored_shape,
                dtype=np.uint8,
                chunks=(1,) + self.stored_shape,
            )
        else:
            self._data = self._file.create_dataset(
                "data", shape=(0,), maxshape=(None,), dtype=np.uint8, chunks=(_ENCODED_CHUNK,)
            )

    def _grow(self, needed: int) -> None:
        if needed > self._capacity:
            self._capacity = max(needed, 2 * self._capacity, 64 if self.mode == "raw" else 1 << 20)
            self._data.resize(self._capacity, axis=0)

    def append(self, blob: bytes, i: int, crc: int) -> int:
        """Keep the sample until a block is full: h5py costs ~0.5 ms a call, so one write per
        sample made HDF5 20-30x slower to write than the other formats on small images."""
        self._pending.append(np.frombuffer(blob, dtype=np.uint8))
        self._pending_bytes += len(blob)
        if len(self._pending) >= _BLOCK_SAMPLES or self._pending_bytes >= _BLOCK_BYTES:
            self._write_pending()
        return -1

    def append_field(self, name: str, blob: bytes, i: int, crc: int) -> int:
        self._field_files[name].write(blob)
        return -1

    def _write_pending(self) -> None:
        """Write the kept samples as one block."""
        if not self._pending:
            return
        _ensure_room(self.temp_path, self._pending_bytes, len(self._pending))
        if self.mode == "raw":
            start = self._filled
            self._grow(start + len(self._pending))
            self._data[start : start + len(self._pending)] = np.stack(self._pending).reshape((-1,) + self.stored_shape)
            self._filled += len(self._pending)
        else:
            block = np.concatenate(self._pending)
            self._grow(self._filled + len(block))
            self._data[self._filled : self._filled + len(block)] = block
            self._filled += len(block)
        self._file.flush()  # nothing left in HDF5's caches: the next _ensure_room sees what the file takes
        self._pending, self._pending_bytes = [], 0

    def final_positions(self) -> Optional[np.ndarray]:
        """Each image's chunk address (raw mode), listed once here so that readers never list them."""
        self._write_pending()
        if self.mode != "raw" or not len(self):
            return None
        self._data.resize(len(self), axis=0)
        self._file.flush()  # a chunk still in HDF5's cache has no address yet
        return _chunk_positions(self._data)

    def finish(self, index: SampleIndex, manifest: ArchiveManifest) -> None:
        self._write_pending()
        table = (self._filled // _ENCODED_CHUNK + 1) * 8 if self.mode == "encoded" else 0  # the chunk table
        _ensure_room(self.temp_path, sum(a.nbytes for a in index.arrays().values()) + len(manifest.to_json()) + table,
                     0)
        self._data.resize(len(index) if self.mode == "raw" else self._filled, axis=0)
        if self.mode == "encoded" and self._filled:
            self._file.flush()  # a chunk still in HDF5's cache has no address yet
            chunks = _chunk_positions(self._data)
            if chunks is not None:  # else readers ask HDF5 for them, in a child process
                self._file.create_dataset(CHUNKS_NAME, data=chunks)  # contiguous: located in the user block
        for name, array in index.arrays().items():
            if name not in index.fields:
                self._file.create_dataset(name, data=array)  # contiguous and unfiltered: readers map it
        if self.fields:
            self._close_field_files()
            hdf5_fields.write(self._file, dict(index.fields), self._field_paths)
            self._remove_field_files()
        self._file.attrs[MANIFEST_ATTR] = manifest.to_json()  # the seal, written last
        self._file.close()
        seal_metadata(self.temp_path)

    def discard(self) -> None:
        try:
            self._file.close()
        except Exception:
            pass
        self._close_field_files()
        self._remove_field_files()

    def _close_field_files(self) -> None:
        for file in getattr(self, "_field_files", {}).values():
            file.close()

    def _remove_field_files(self) -> None:
        for path in getattr(self, "_field_paths", {}).values():
            if os.path.exists(path):
                os.unlink(path)


_BLOCK_SAMPLES = 256  # samples written to HDF5 in one call at most
_BLOCK_BYTES = 8 << 20  # and at most this many bytes kept for it
_FILE_METADATA = 64 << 10  # a file's object headers, heaps and symbol table, with room to spare


def _room_margin(samples: int) -> int:
    """What HDF5 may write besides a block's bytes: chunk index entries for its ``samples`` (nodes half
    full), two partly filled encoded chunks, and the metadata of a file (the writer flushes after each
    block, so nothing else waits in HDF5's caches)."""
    return _FILE_METADATA + samples * 2 * 56 + 2 * _ENCODED_CHUNK


def _ensure_room(path: str, nbytes: int, samples: int) -> None:
    """OSError(ENOSPC) before HDF5 writes ``nbytes`` (of ``samples`` samples) where they no longer fit:
    HDF5 itself, when the disk fills up under it, can leave objects that crash the process when they
    are collected.  What it asks beyond them is in ``size_bound``, so an estimate's room suffices."""
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return
    if st.f_bavail * st.f_frsize < nbytes + _room_margin(samples):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _open_fd(path: str) -> int:
    """A read-only descriptor of the file at ``path`` (named errors when it is missing or unreadable)."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ArchiveNotFoundError(path, "no such file") from None
    except PermissionError:
        raise ArchivePermissionError.denied(path) from None


_PROBE_SETTINGS = {"manifest": MANIFEST_ATTR, "samples": _SAMPLE_NAMES, "index": _INDEX_NAMES,
                   "extra": (CHUNKS_NAME,), "chunk": _ENCODED_CHUNK}


def read_layout(path: str) -> hdf5_layout.Layout:
    """Where the archive at ``path`` keeps its manifest, index and samples, read without HDF5 from the
    locator in its checked user block, or (an archive written without one) from HDF5 in a child
    process under a time limit (``hdf5_layout``)."""
    fd = _open_fd(path)
    try:
        block = hdf5_guard.checked_block(path, fd)
        entries = None if block is None else hdf5_layout.unpack(path, hdf5_guard.locator_of(block))
        located = entries is not None and hdf5_layout.MANIFEST in entries and bool(
            {"positions", hdf5_layout.CHUNKS} & set(entries))  # a sealed archive, its samples located
        if entries is not None and located:
            return hdf5_layout.from_locator(path, fd, entries, _INDEX_NAMES)
        return hdf5_layout.probe(path, fd, _PROBE_SETTINGS)
    finally:
        os.close(fd)


class HDF5Backend(Backend[HDF5Handle]):
    """Reads an archive with plain reads from the byte offsets its layout gives (``read_layout``):
    HDF5's parser never runs in the reading process."""

    format_name = "hdf5"
    chunks: Optional[np.ndarray] = None  # the flat sample dataset's chunk addresses (see Layout)
    field_spans: Dict[str, Tuple[int, int]] = {}  # each field's values: (file offset, bytes)
    chunk_bytes = 0
    data_nbytes = 0
    file_size = 0  # when the layout was read: no sample holds more bytes

    @classmethod
    def load(cls, path: str) -> "HDF5Backend":
        layout = read_layout(path)
        try:
            manifest = ArchiveManifest.from_json(layout.manifest, path=path)
            index = SampleIndex.from_arrays(layout.arrays)
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise CorruptArchiveError(path, f"cannot read the archive index: {exc}", hint=DAMAGED_HINT) from None
        backend = cls(path, manifest, index)
        backend.chunks, backend.chunk_bytes, backend.data_nbytes = layout.chunks, layout.chunk_bytes, layout.data_nbytes
        if manifest.fields:
            backend._read_fields(layout)
        backend._check_layout()
        return backend

    def _read_fields(self, layout: hdf5_layout.Layout) -> None:
        """The fields' index arrays into the index, and where each field's values lie, from their bundle."""
        if layout.fields is None:
            raise self._damaged("its manifest declares fields, but its locator places none")
        fd = _open_fd(self.path)
        try:
            entry = layout.fields
            arrays, self.field_spans = hdf5_fields.read(
                self.path, fd, entry.offset, entry.nbytes, entry.crc32, tuple(field_arrays(self.manifest.fields)),
                tuple(spec.name for spec in self.manifest.fields))
        finally:
            os.close(fd)
        self.index = SampleIndex.from_arrays({**layout.arrays, **arrays}, field_arrays(self.manifest.fields))

    def read_field(self, handle: HDF5Handle, name: str, i: int) -> bytes:
        handle.check_size()
        assert handle.fd is not None
        start, size = self.index.field_bytes(name, i)
        offset, nbytes = self.field_spans[name]
        if not 0 <= start <= start + size <= nbytes:
            raise self.corrupt(f"field {name!r}: bytes {start} to {start + size} lie outside its {nbytes}", i)
        return self._pread(handle.fd, offset + start, size, i)

    @classmethod
    def read_metadata(cls, path: str) -> Tuple[ArchiveManifest, SampleIndex]:
        backend = cls.load(path)
        return backend.manifest, backend.index

    def _check_layout(self) -> None:
        """CorruptArchiveError when the manifest, index and chunk table cannot describe one archive."""
        size = self.file_size = os.path.getsize(self.path)
        if self.manifest.mode == "raw":
            if self.index.positions is None and (self.chunks is None or len(self.chunks) != self.manifest.count):
                raise self._damaged("a raw archive whose index has no positions, and HDF5 listed none")
            if not 0 < self.sample_nbytes <= size:
                raise self._damaged(f"its manifest gives raw samples the shape {self.manifest.shape}, "
                                    f"in a file of {size} bytes")
            return
        if self.chunks is None or self.chunk_bytes <= 0 or (len(self.chunks) and self.chunk_bytes > size):
            raise self._damaged("an encoded archive without the addresses of its sample bytes")
        if len(self.chunks) != -(-self.data_nbytes // self.chunk_bytes):
            raise self._damaged(f"its chunk table lists {len(self.chunks)} chunks for {self.data_nbytes} bytes "
                                f"of samples in chunks of {self.chunk_bytes}")

    def _damaged(self, problem: str) -> CorruptArchiveError:
        return CorruptArchiveError(self.path, problem, hint=DAMAGED_HINT)

    @property
    def image_positions(self) -> np.ndarray:
        """Each raw image's byte offset in the file: the index's (checked by its CRC32), or HDF5's listing."""
        positions = self.index.positions if self.index.positions is not None else self.chunks
        assert positions is not None  # _check_layout
        return positions

    def open(self) -> HDF5Handle:
        return HDF5Handle(_open_fd(self.path), needed=0 if self.identity is None else self.identity[2])

    def read(self, handle: HDF5Handle, i: int) -> "np.ndarray | bytes":
        handle.check_size()
        assert handle.fd is not None
        if self.manifest.mode == "raw":
            return self._pread(handle.fd, int(self.image_positions[i]), self.sample_nbytes, i)
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        if not 0 <= start <= stop <= self.data_nbytes or stop - start > self.file_size:
            raise self.corrupt(f"its bytes {start} to {stop} lie outside the {self.data_nbytes} stored", i)
        assert self.chunks is not None
        size, pieces = self.chunk_bytes, []
        while start < stop:
            k, within = divmod(start, size)
            n = min(stop - start, size - within)
            pieces.append(self._pread(handle.fd, int(self.chunks[k]) + within, n, i))
            start += n
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _pread(self, fd: int, offset: int, n: int, i: int) -> bytes:
        """``n`` bytes at ``offset`` for sample i, or CorruptSampleError where the file has not got them."""
        try:
            data = os.pread(fd, n, offset) if offset >= 0 else b""
        except (OSError, OverflowError) as exc:
            raise self.corrupt(f"cannot read its {n} bytes at offset {offset}: {exc}", i) from None
        if len(data) != n:
            raise self.corrupt(f"its {n} bytes at offset {offset} lie past the end of the file", i)
        return data

    def rows_of(self, handle: HDF5Handle) -> "Optional[mapped.MappedRows]":
        return handle.mapped_rows(self.image_positions, self.sample_nbytes)

    def read_batch(self, handle: HDF5Handle, idx: np.ndarray, out: np.ndarray) -> None:
        handle.check_size()
        rows = self.rows_of(handle) if out.flags.c_contiguous else None
        if rows is not None:
            rows.gather(idx, out)
            return
        for j, i in enumerate(idx):
            out[j] = self.as_stored(self.read(handle, int(i)), int(i))

    def sample_location(self, i: int) -> Optional[Tuple[str, int]]:
        if self.manifest.mode == "raw":
            return self.path, int(self.image_positions[i])
        assert self.chunks is not None
        k, within = divmod(int(self.offsets[i]), self.chunk_bytes)
        return self.path, int(self.chunks[min(k, len(self.chunks) - 1)]) + within


def seal_metadata(path: str) -> None:
    """Record what HDF5 parses when it opens the archive at ``path`` and where readers find its manifest,
    index and samples, and store both, checksummed, in the file's user block (``hdf5_guard``,
    ``hdf5_layout``).  The writer calls it last; after an edit by another tool (h5py in ``r+`` mode),
    the archive reads as damaged until this is called again."""
    with h5py.File(path, "r") as file:
        payload = _payload_spans(file)
        entries = _located(file)
    reads = hdf5_guard.record_reads(path, _visit_as_reader)
    manifest = _manifest_span(path, reads)
    if manifest is not None:
        entries[hdf5_layout.MANIFEST] = manifest
    hdf5_guard.write_userblock(path, hdf5_guard.merge(reads, payload), hdf5_layout.pack(entries))


def _located(file: h5py.File) -> Dict[str, hdf5_layout.Entry]:
    """The locator's entries for the index arrays and (encoded) the chunk table of the file: each where
    HDF5 stores it as plain bytes."""
    entries = {}
    for name in _INDEX_NAMES:
        at = _stored_at(file[name]) if name in file else None
        if at is not None:
            entries[name] = hdf5_layout.Entry(at.offset, at.nbytes, 0, at.dtype.str)
    bundle = file.get(hdf5_fields.NAME)
    at = _stored_at(bundle) if isinstance(bundle, h5py.Dataset) else None
    if at is not None:
        entries[hdf5_layout.FIELDS] = hdf5_layout.Entry(at.offset, at.nbytes,
                                                        hdf5_fields.header_crc32(file.filename, at.offset), "|u1")
    data, table = file.get("data"), file.get(CHUNKS_NAME)
    at = _stored_at(table) if isinstance(table, h5py.Dataset) else None
    samples = file.get("images", data)
    if isinstance(samples, h5py.Dataset) and samples.chunks is not None and samples.shape[0] == 0:
        entries[hdf5_layout.CHUNKS] = hdf5_layout.Entry(hdf5_guard.USERBLOCK, 0, crc32(b""), "<i8")  # no chunks
        entries[hdf5_layout.DATA] = hdf5_layout.Entry(int(np.prod(samples.chunks)), 0)
    elif isinstance(data, h5py.Dataset) and at is not None and data.chunks is not None:
        with open(file.filename, "rb") as raw:
            raw.seek(at.offset)
            entries[hdf5_layout.CHUNKS] = hdf5_layout.Entry(at.offset, at.nbytes, crc32(raw.read(at.nbytes)), "<i8")
        entries[hdf5_layout.DATA] = hdf5_layout.Entry(data.chunks[0], data.shape[0])
    return entries


def _manifest_span(path: str, reads: List[Tuple[int, int]]) -> Optional[hdf5_layout.Entry]:
    """Where the manifest's stored text lies among the bytes HDF5 read to read it, or None."""
    with h5py.File(path, "r") as file:
        text = file.attrs.get(MANIFEST_ATTR)
    if text is None:
        return None
    wanted = text.encode() if isinstance(text, str) else bytes(text)
    with open(path, "rb") as raw:
        for offset, length in hdf5_guard.merge(reads, (), limit=len(reads) + 1):
            raw.seek(offset)
            at = raw.read(length).find(wanted)
            if at >= 0:
                return hdf5_layout.Entry(offset + at, len(wanted), crc32(wanted))
    return None


def _payload_spans(file: h5py.File) -> List[Tuple[int, int]]:
    """(offset, length) of the stored bytes ``_visit_as_reader`` has HDF5 hand over unparsed: the index
    arrays (contiguous) and the images it reads, which the archive's own CRC32s check (a few spans,
    however many samples: listing every chunk would cost the writer memory per sample)."""
    spans: List[Tuple[int, int]] = []
    for name in _INDEX_NAMES + (CHUNKS_NAME,):
        if name in file and file[name].id.get_offset() is not None:
            spans.append((file[name].id.get_offset(), file[name].id.get_storage_size()))
    images = file["images"] if "images" in file else None
    if images is not None and images.ndim == 4 and images.shape[0] and images.compression is None:
        for i in sorted({0, images.shape[0] // 2, images.shape[0] - 1}):
            info = images.id.get_chunk_info_by_coord(_chunk_of(i, 4))
            if info.byte_offset is not None:
                spans.append((info.byte_offset, info.size))
    return spans


_CHECKED_CHUNKS = 4096  # up to this many chunks, a sample dataset's whole chunk index is checked at open


def _visit_as_reader(file: h5py.File) -> None:
    """Have HDF5 parse what a reader of the archive through HDF5 has it parse (``hdf5_guard`` records
    the bytes, checked before a reader uses the file, and before ``hdf5_probe`` opens one written
    without a locator): the manifest, every dataset's header and layout, the index arrays' ends, three
    images and, for a small archive, the sample dataset's whole chunk index.  A larger chunk index is
    not checked: readers never have HDF5 parse it (raw images lie at the index's positions, encoded
    chunks at the chunk table's addresses)."""
    if MANIFEST_ATTR in file.attrs:
        file.attrs[MANIFEST_ATTR]
    names = list(file.keys())
    for name in _SAMPLE_NAMES + _INDEX_NAMES + (CHUNKS_NAME,):
        if name not in names:
            continue
        dataset = file[name]
        plist = dataset.id.get_create_plist()
        plist.get_layout(), plist.get_nfilters(), plist.get_external_count()
        dataset.dtype, dataset.shape, dataset.chunks, dataset.id.get_offset()
        if name not in _SAMPLE_NAMES and dataset.ndim == 1:
            n, k = len(dataset), min(len(dataset), _AGREE_ROWS)
            dataset[:k], dataset[n - k : n]  # contiguous data: HDF5 parses no more metadata for all of it
    data = file["images"] if "images" in names else file["data"] if "data" in names else None
    if data is None or not data.shape[0]:
        return
    if data.ndim == 4:
        image = np.empty(data.shape[1:], dtype=np.uint8)
        for i in sorted({0, data.shape[0] // 2, data.shape[0] - 1}):
            data.read_direct(image, np.s_[i])
            data.id.read_direct_chunk(_chunk_of(i, 4))
    chunks = -(-data.shape[0] // data.chunks[0]) if data.chunks else 0
    if chunks <= _CHECKED_CHUNKS and hasattr(data.id, "chunk_iter"):
        data.id.chunk_iter(lambda chunk: None)


def _chunk_positions(data: h5py.Dataset) -> Optional[np.ndarray]:
    """Each chunk's address (raw: each image's), listed by HDF5 in one pass over the dataset's chunk
    index; None when this h5py cannot list chunks (before 3.8) or a chunk is not in the file."""
    if data.shape[0] == 0 or not hasattr(data.id, "chunk_iter") or data.chunks is None:
        return None
    step = data.chunks[0]
    positions = np.full(-(-data.shape[0] // step), -1, dtype=np.int64)

    def note(chunk) -> None:
        k = chunk.chunk_offset[0] // step
        if k < len(positions):
            positions[k] = chunk.byte_offset

    try:
        data.id.chunk_iter(note)
    except (OSError, ValueError, RuntimeError):
        return None
    if positions.min() < 0:  # unwritten chunks read as fill values: not in the file (no N-byte temporary)
        return None
    return positions


# ---- where datasets lie -------------------------------------------------------------------------
def _stored_at(dataset: h5py.Dataset) -> Optional[index_map.ArrayAt]:
    """Where a 1-D dataset's elements lie in the file, when they are its plain bytes there: one
    contiguous block in this file, unfiltered, of a numpy integer or fixed-width bytes dtype."""
    plist = dataset.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters() or plist.get_external_count():
        return None
    if dataset.ndim != 1 or dataset.dtype.kind not in "iuS" or dataset.dtype.hasobject:
        return None
    offset = dataset.id.get_offset()  # None until HDF5 has allocated the data
    return None if offset is None else index_map.ArrayAt(int(offset), dataset.dtype, dataset.shape)


def _chunk_of(i: int, ndim: int) -> tuple:
    return (i,) + (0,) * (ndim - 1)


def _sniff(path: str, head: Optional[bytes]) -> bool:
    return head is not None and (head[:8] == hdf5_guard.HDF5_SIGNATURE or hdf5_guard.has_userblock(path, head))


SPEC = FormatSpec("hdf5", HDF5Backend, HDF5Writer, (".h5", ".hdf5"), _sniff)

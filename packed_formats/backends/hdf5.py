"""HDF5: raw samples in one uint8 [N,H,W,C] dataset chunked one image per chunk;
encoded samples in a flat uint8 byte dataset plus an offsets dataset.

Readable by ``h5ls``/``h5dump``/plain h5py.  Files are opened read-only with
file locking off (safe for sealed archives, and needed on Lustre/NFS), and a
handle inherited through fork is closed in the child before reopening: HDF5
would otherwise hand the child the parent's file id.

Opening costs the same at any number of samples.  The index datasets are
written contiguous and unfiltered, so readers map them from the file
(``index_map``) instead of loading them; a raw archive stores each image's
chunk address in the index (``positions``) at write time, so readers map the
images without listing HDF5's chunks (one pass over its chunk B-tree, ~1 s
per million images, in every process) -- archives written before that are
still listed.  Raw images are read from the map or with ``read_direct_chunk``,
neither of which uses HDF5's chunk cache, so raw archives are opened with
none; encoded ones keep a small one (see ``ENCODED_CACHE_BYTES``).  The
index lives in the data file: a file truncated under a reader is caught
before each read (``check_size``), as reading a mapped page it no longer has
would end the process with SIGBUS.

HDF5 trusts the metadata it parses (damage there can make it hang), so the
writer stores in the file's user block the CRC32 of every byte range HDF5
reads when a reader opens the archive, and readers check them before HDF5
opens it (``hdf5_guard``).
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import h5py
import numpy as np

from ..errors import (
    ArchiveNotFoundError,
    ArchivePermissionError,
    CorruptArchiveError,
    IncompleteArchiveError,
    PackedFormatError,
    UnknownFormatError,
)
from ..index import SampleIndex
from ..manifest import ArchiveManifest
from . import hdf5_guard, index_map, mapped
from .base import Backend, FormatSpec, Handle, Identity, Writer, fd_identity

MANIFEST_ATTR = "packed_formats_manifest"
_ENCODED_CHUNK = 1 << 16
# Encoded reads slice the flat byte dataset through HDF5's chunk cache.  Without one, a
# random read reads just its bytes (measured as fast as with 4 MiB); a few chunks let a
# sequential read take its first chunk from the previous sample's.  The cache is per open
# file and per process (a 1,000-part sharded set opens 1,000), so it is kept this small.
ENCODED_CACHE_BYTES = 4 * _ENCODED_CHUNK
_ENCODED_CACHE_SLOTS = 101  # a prime well above the chunks the cache holds, as HDF5 advises
_INDEX_NAMES = ("labels", "keys", "crc32", "offsets", "positions")
_SAMPLE_NAMES = ("images", "data")
_AGREE_ROWS = 16  # index entries compared, at each end, between a mapped index array and HDF5's read
CONVERT_HINT = "convert it into one first: `packed-formats convert SRC DST`"


# HDF5 runs one call at a time in a process anyway (h5py's global lock): ours costs nothing, and keeps
# threads reading one file at once safe with h5py before 3.15, whose chunk reads corrupt the heap then
_H5_CALLS = threading.RLock()


class HDF5Handle(Handle):
    """An open file and its sample dataset (looked up once, not per read), and the size the
    file must keep: the index arrays are mapped from it."""

    def __init__(self, file: h5py.File, data: h5py.Dataset, needed: int = 0) -> None:
        self.file, self.data, self.needed = file, data, needed
        plist = data.id.get_create_plist()
        self.whole_chunks = data.ndim == 4 and data.chunks == (1,) + data.shape[1:] and plist.get_nfilters() == 0
        self.rows: "Optional[mapped.MappedRows | bool]" = None  # False: not mappable
        # HDF5's descriptor of the file, asked once: it lives as long as the file is open, and h5py before
        # 3.15 corrupts its heap when threads ask for it at once
        fd = file.id.get_vfd_handle()
        self.fd: Optional[int] = fd if isinstance(fd, int) else None

    def check_size(self) -> None:
        """FileTruncatedError when the file became shorter than when it was opened: its mapped
        index (and images) may lie in what was cut off, and touching that is SIGBUS."""
        mapped.check_file_size(self.fd if self.fd is not None else self.file.id.get_vfd_handle(), self.needed)

    def fileno(self) -> Optional[int]:
        """HDF5's descriptor of the file: ``Reader`` checks the file through it before each read or batch."""
        return self.fd

    def mapped_rows(
        self, path: str, identity: Optional[Identity], positions: Optional[np.ndarray]
    ) -> "Optional[mapped.MappedRows]":
        """The images' chunks in a map of the file (made once), when every image is one
        unfiltered chunk at a known address (the index's ``positions``, else listed by
        HDF5 >= h5py 3.8), else None."""
        if self.rows is None:
            with _H5_CALLS:
                if self.rows is None:
                    self.rows = _map_chunks(path, identity, self.data, positions) or False
        return self.rows if isinstance(self.rows, mapped.MappedRows) else None

    def close(self) -> None:
        if isinstance(self.rows, mapped.MappedRows):
            self.rows.close()
        self.rows = None
        self.file.close()

    def discard_inherited(self) -> None:
        self.close()  # else the child's reopen returns the parent's file id (h5py#934)


class HDF5Writer(Writer):
    format_name = "hdf5"

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
            stored, per_entry = chunks * _ENCODED_CHUNK, 2 * 32  # a rank-1 key (24 bytes) and its address
        return stored + chunks * per_entry + parts * (hdf5_guard.USERBLOCK + _FILE_METADATA) + _room_margin(
            _BLOCK_SAMPLES)

    def begin(self, temp_path: str) -> None:
        self._file = h5py.File(temp_path, "w", userblock_size=hdf5_guard.USERBLOCK)  # filled by finish
        self._capacity = 0
        self._filled = 0  # samples (raw) or bytes (encoded) written to the dataset
        self._pending: List[np.ndarray] = []
        self._pending_bytes = 0
        if self.mode == "raw":
            self._data = self._file.create_dataset(
                "images",
                shape=(0,) + self.raw_shape,
                maxshape=(None,) + self.raw_shape,
                dtype=np.uint8,
                chunks=(1,) + self.raw_shape,
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

    def _write_pending(self) -> None:
        """Write the kept samples as one block."""
        if not self._pending:
            return
        _ensure_room(self.temp_path, self._pending_bytes, len(self._pending))
        if self.mode == "raw":
            start = self._filled
            self._grow(start + len(self._pending))
            self._data[start : start + len(self._pending)] = np.stack(self._pending).reshape((-1,) + self.raw_shape)
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
        _ensure_room(self.temp_path, sum(a.nbytes for a in index.arrays().values()) + len(manifest.to_json()), 0)
        self._data.resize(len(index) if self.mode == "raw" else self._filled, axis=0)
        for name, array in index.arrays().items():
            self._file.create_dataset(name, data=array)  # contiguous and unfiltered: readers map it
        self._file.attrs[MANIFEST_ATTR] = manifest.to_json()  # the seal, written last
        self._file.close()
        seal_metadata(self.temp_path)

    def discard(self) -> None:
        try:
            self._file.close()
        except Exception:
            pass


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


def _open_file(path: str, cache_bytes: int = 0, cache_slots: int = 1) -> h5py.File:
    """The archive open read-only in HDF5, once what HDF5 will parse of it is checked (``hdf5_guard``)."""
    if not os.path.exists(path):
        raise ArchiveNotFoundError(path, "no such file")
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        raise ArchivePermissionError.denied(path) from None
    try:
        hdf5_guard.check(path, fd)
    finally:
        os.close(fd)
    try:
        return h5py.File(path, "r", locking=False, rdcc_nbytes=cache_bytes, rdcc_nslots=cache_slots)
    except OSError as exc:
        raise IncompleteArchiveError(
            path, f"HDF5 cannot open it ({exc})", hint="the file is truncated, damaged or its writer was killed"
        ) from None


class HDF5Backend(Backend[HDF5Handle]):
    format_name = "hdf5"

    @classmethod
    def read_metadata(cls, path: str) -> Tuple[ArchiveManifest, SampleIndex]:
        with _open_file(path) as file:
            if MANIFEST_ATTR not in file.attrs:
                raise _missing_manifest(path, file)
            try:
                manifest = ArchiveManifest.from_json(file.attrs[MANIFEST_ATTR], path=path)
                index = SampleIndex.from_arrays(_index_arrays(file))
            except (OSError, KeyError, ValueError) as exc:
                raise CorruptArchiveError(path, f"cannot read the archive index: {exc}") from None
        return manifest, index

    def open(self) -> HDF5Handle:
        raw = self.manifest.mode == "raw"
        file = _open_file(self.path, *((0, 1) if raw else (ENCODED_CACHE_BYTES, _ENCODED_CACHE_SLOTS)))
        name = "images" if "images" in file else "data"
        if name not in file:
            file.close()
            raise UnknownFormatError(
                self.path, "an HDF5 file, but not a packed_formats archive (no images/data dataset)"
            )
        return HDF5Handle(file, file[name], needed=0 if self.identity is None else self.identity[2])

    def read(self, handle: HDF5Handle, i: int) -> "np.ndarray | bytes":
        handle.check_size()
        with _H5_CALLS:
            if self.manifest.mode != "raw":
                start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
                return self._h5_call(i, handle.data.__getitem__, slice(start, stop))
            if handle.whole_chunks:
                return self._h5_call(i, handle.data.id.read_direct_chunk, _chunk_of(i, handle.data.ndim))[1]
            return self._h5_call(i, handle.data.__getitem__, i).reshape(-1)

    def read_batch(self, handle: HDF5Handle, idx: np.ndarray, out: np.ndarray) -> None:
        handle.check_size()
        whole = handle.whole_chunks and out.flags.c_contiguous
        rows = handle.mapped_rows(self.path, self.identity, self.index.positions) if whole else None
        if rows is not None:  # ~2.5x faster than the chunk reads below once the pages are mapped
            rows.gather(idx, out)
            return
        with _H5_CALLS:
            if not whole:
                for j, i in enumerate(idx):
                    self._h5_call(int(i), handle.data.read_direct, out, np.s_[int(i)], np.s_[j])
                return
            # One unfiltered chunk per image (our layout): copy each chunk's bytes straight
            # into the batch, skipping HDF5's selection machinery (about 3x faster).
            for j, i in enumerate(idx):
                self._h5_call(int(i), _read_chunk_into, handle.data.id, _chunk_of(int(i), out.ndim), out[j].reshape(-1))

    def sample_location(self, i: int) -> Optional[Tuple[str, int]]:
        if self.manifest.mode == "raw" and self.index.positions is not None:
            return self.path, int(self.index.positions[i])
        with h5py.File(self.path, "r", locking=False) as file:
            if self.manifest.mode == "raw":
                info = file["images"].id.get_chunk_info_by_coord(_chunk_of(i, 4))
                return self.path, int(info.byte_offset)
            data, start = file["data"], int(self.offsets[i])
            chunk = data.chunks[0]
            info = data.id.get_chunk_info_by_coord((start // chunk * chunk,))
            return self.path, int(info.byte_offset) + start % chunk

    def _h5_call(self, i: int, function: Callable[..., Any], *args: Any) -> Any:
        try:
            with _H5_CALLS:
                return function(*args)
        except OSError as exc:
            raise self.corrupt(f"HDF5 read failed: {exc}", i) from None


def seal_metadata(path: str) -> None:
    """Record what HDF5 parses when a reader opens the archive at ``path`` and store it, checksummed,
    in the file's user block (``hdf5_guard``).  The writer calls it last; after an edit by another
    tool (h5py in ``r+`` mode), the archive reads as damaged until this is called again."""
    with h5py.File(path, "r") as file:
        payload = _payload_spans(file)
    hdf5_guard.write_userblock(path, hdf5_guard.merge(hdf5_guard.record_reads(path, _visit_as_reader), payload))


def _payload_spans(file: h5py.File) -> List[Tuple[int, int]]:
    """(offset, length) of the stored bytes ``_visit_as_reader`` has HDF5 hand over unparsed: the index
    arrays (contiguous) and the images it reads, which the archive's own CRC32s check (a few spans,
    however many samples: listing every chunk would cost the writer memory per sample)."""
    spans: List[Tuple[int, int]] = []
    for name in _INDEX_NAMES:
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
    """Have HDF5 parse what a reader of this archive has it parse (``hdf5_guard`` records the bytes):
    the manifest, every dataset's header and layout, the index arrays' ends, the three images
    ``_rows_agree`` reads and, for a small archive, the sample dataset's whole chunk index."""
    if MANIFEST_ATTR in file.attrs:
        file.attrs[MANIFEST_ATTR]
    names = list(file.keys())
    for name in _SAMPLE_NAMES + _INDEX_NAMES:
        if name not in names:
            continue
        dataset = file[name]
        plist = dataset.id.get_create_plist()
        plist.get_layout(), plist.get_nfilters(), plist.get_external_count()
        dataset.dtype, dataset.shape, dataset.chunks, dataset.id.get_offset()
        if name in _INDEX_NAMES and dataset.ndim == 1:
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
    """Each image's chunk address, listed by HDF5 in one pass over the dataset's chunk index;
    None when this h5py cannot list chunks (before 3.8) or an image has none in the file."""
    if data.shape[0] == 0 or not hasattr(data.id, "chunk_iter"):
        return None
    positions = np.full(data.shape[0], -1, dtype=np.int64)

    def note(chunk) -> None:
        positions[chunk.chunk_offset[0]] = chunk.byte_offset

    try:
        data.id.chunk_iter(note)
    except (OSError, ValueError, RuntimeError):
        return None
    if positions.min() < 0:  # unwritten chunks read as fill values: not in the file (no N-byte temporary)
        return None
    return positions


def _map_chunks(
    path: str, identity: Optional[Identity], data: h5py.Dataset, positions: Optional[np.ndarray]
) -> "Optional[mapped.MappedRows]":
    """Map the file at ``path`` with each image's chunk at ``positions`` (listed by HDF5 when the
    index has none: archives written before they were stored); None where that cannot be trusted."""
    if positions is None:
        positions = _chunk_positions(data)
    if positions is None or len(positions) != data.shape[0] or not len(positions):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        if identity not in (None, fd_identity(fd)):
            return None  # not the file the handle has open
        rows = mapped.MappedRows.of(fd, positions, int(np.prod(data.shape[1:])))
    finally:
        os.close(fd)
    if rows is not None and not _rows_agree(rows, data, positions):
        rows.close()
        return None
    return rows


def _rows_agree(rows: mapped.MappedRows, data: h5py.Dataset, positions: np.ndarray) -> bool:
    """Whether the first, middle and last images read through HDF5 equal their mapped bytes: a
    cheap check that the positions are this file's (a file rewritten by another tool, or
    chunk addresses relative to a user block, would fail it); each sample's CRC32 checks the rest."""
    if rows.data is None:
        return False
    image = np.empty(data.shape[1:], dtype=np.uint8)
    n = len(positions)
    for i in sorted({0, n // 2, n - 1}):
        data.read_direct(image, np.s_[i])
        start = int(positions[i])
        if not np.array_equal(rows.data[start : start + image.size], image.ravel()):
            return False
    return True


# ---- the index, mapped ------------------------------------------------------------------------
def _index_arrays(file: h5py.File) -> Dict[str, np.ndarray]:
    """The index datasets, each a map of the file where HDF5 stores it as plain bytes (how this
    writer stores them), else read into memory (or where the map disagrees with HDF5's read)."""
    datasets = {name: file[name] for name in _INDEX_NAMES if name in file}
    where = {}
    for name, dataset in datasets.items():
        at = _stored_at(dataset)
        if at is not None:
            where[name] = at
    try:
        arrays = index_map.map_arrays(file.id.get_vfd_handle(), where) if where else {}
    except (OSError, ValueError):  # e.g. a truncated file: HDF5's own reads below say what is wrong
        arrays = {}
    for name, dataset in datasets.items():
        if name not in arrays or not _agrees(arrays[name], dataset):
            arrays[name] = dataset[()]
    return arrays


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


def _agrees(array: np.ndarray, dataset: h5py.Dataset) -> bool:
    """Whether a mapped index array reads as HDF5 reads the dataset, at both ends (a cheap
    check that the address is right; the manifest's checksum of the whole array follows)."""
    n = len(array)
    k = min(n, _AGREE_ROWS)
    return bool(np.array_equal(array[:k], dataset[:k]) and np.array_equal(array[n - k :], dataset[n - k : n]))


def _missing_manifest(path: str, file: h5py.File) -> PackedFormatError:
    """Why a file without a manifest cannot be read: an archive of ours whose writer never sealed
    it (our sample dataset, as this writer lays it out), or some other HDF5 file."""
    if _written_here(file):
        return IncompleteArchiveError(path, "no manifest: the archive was never sealed")
    return UnknownFormatError(
        path, "an HDF5 file, but not a packed_formats archive (no manifest attribute)", hint=CONVERT_HINT
    )


def _written_here(file: h5py.File) -> bool:
    """Whether the file holds only our datasets, with the sample dataset laid out as HDF5Writer makes it."""
    names = set(file.keys())
    if not names <= set(_SAMPLE_NAMES + _INDEX_NAMES):
        return False
    images, data = file.get("images"), file.get("data")
    if isinstance(images, h5py.Dataset):
        return images.ndim == 4 and images.dtype == np.uint8 and images.chunks == (1,) + images.shape[1:]
    if isinstance(data, h5py.Dataset):
        return data.ndim == 1 and data.dtype == np.uint8 and data.chunks == (_ENCODED_CHUNK,)
    return False


def _chunk_of(i: int, ndim: int) -> tuple:
    return (i,) + (0,) * (ndim - 1)


def _read_chunk_into(dataset_id, offsets: tuple, row: np.ndarray) -> None:
    try:
        dataset_id.read_direct_chunk(offsets, out=row)
    except TypeError:  # h5py before 3.8 has no out=
        row[:] = np.frombuffer(dataset_id.read_direct_chunk(offsets)[1], dtype=np.uint8)


def _sniff(path: str, head: Optional[bytes]) -> bool:
    return head is not None and (head[:8] == hdf5_guard.HDF5_SIGNATURE or hdf5_guard.has_userblock(path, head))


SPEC = FormatSpec("hdf5", HDF5Backend, HDF5Writer, (".h5", ".hdf5"), _sniff)

"""LMDB: one record per sample under a fixed-width decimal key, plus index records.

A single data file (``subdir=False``), readable by plain ``lmdb``/``mdb_stat``.
Sealed archives are opened ``readonly=True, lock=False``: no lock file, no
reader-slot table to exhaust, safe on read-only and shared file systems.  An
environment inherited through fork is closed in the child before reopening
(lmdb >= 2 refuses a second environment on one path in a process).

The index records (``.npy`` bytes, large ones on LMDB's overflow pages) are
mapped from the data file rather than copied out, so opening costs the same at
any number of samples and the index pages are shared by every process.  The
map is this module's own (``index_map``), never a view into the environment:
a forked child closes the environment it inherited, and an array into that
would then crash it.  Where the record lies is found in LMDB's B-tree
(``lmdb_pages``) and checked against the record read through lmdb; a record
that does not check is copied.
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
from typing import Dict, List, Optional, Tuple

import lmdb
import numpy as np

from .. import handles
from ..errors import (
    ArchiveInUseError,
    ArchiveNotFoundError,
    ArchivePermissionError,
    CorruptArchiveError,
    IncompleteArchiveError,
    PackedFormatError,
    UnknownFormatError,
)
from ..fields import field_arrays
from ..index import SampleIndex, from_npy_bytes, npy_record
from ..manifest import ArchiveManifest
from . import index_map, lmdb_guard, lmdb_pages
from .base import Backend, FormatSpec, Handle
from .files import file_identity, handle_key
from .mapped import check_file_size
from .writer import Writer

MANIFEST_KEY = b"__manifest__"
_INDEX_PREFIX = b"__index__/"
_PAGE_HEADER = 16  # bytes of an LMDB page's (or overflow run's) header
_NODE_HEADER = 8  # bytes of a leaf node's header
# Pages a file has besides its values' and keys': 2 meta pages, branch pages, the manifest's, the free
# list, and the path from root to leaf that each of the last two commits copied; a page more per index
# record (5 at most), whose bytes ``space.archive_bytes`` counts.
_FIXED_PAGES = 32
_INDEX_RECORDS = 5
_COMPARED_BYTES = 4096  # of a mapped record, compared with lmdb's read at its start, middle and end
CONVERT_HINT = "convert it into one first: `packed-formats convert SRC DST`"
_COMMIT_EVERY = 256
_INITIAL_MAP_SIZE = 1 << 30
_REMAP_BYTES = 16 << 20  # file growth after which the writer maps the file afresh (~1 ms; see _unmap_written_pages)


def sample_key(i: int) -> bytes:
    return b"%010d" % i


def field_key(name: str, i: int) -> bytes:
    """The record of field ``name`` of sample i."""
    return b"field/%s/%010d" % (name.encode(), i)


class LMDBWriter(Writer):
    format_name = "lmdb"
    stores_fields = True

    @staticmethod
    def size_bound(mode: str, count: int, payload: int, sample_bytes: Optional[int], key_bytes: int,
                   parts: int = 1) -> int:
        """A high estimate of the bytes LMDB stores for ``count`` values of ``payload`` bytes in ``parts``
        files (``space.archive_bytes`` adds the index and manifest).  A value too big for a leaf page
        takes whole overflow pages (a 16-byte header, the rest rounded up to a page: a 2,304-byte image
        takes 4 KiB); a small one sits in a leaf page that sequential puts leave half full.  Its key
        takes a leaf node; every file has its meta and branch pages, its index records' overflow
        pages and the pages copied on write by the last commits."""
        page = mmap.PAGESIZE
        node_max = (page - _PAGE_HEADER) // 2 - 2  # LMDB's largest leaf node (MDB_MINKEYS = 2 per page)
        if sample_bytes is not None:
            need = _NODE_HEADER + len(sample_key(0)) + sample_bytes
            per_value = 2 * (need + 2) if need <= node_max else -(-(sample_bytes + _PAGE_HEADER) // page) * page
            values = count * per_value
        else:  # sizes vary: at most one page more than each value
            values = payload + count * (page + _PAGE_HEADER)
        keys = count * 2 * (_NODE_HEADER + len(sample_key(0)) + 8 + 2)  # a leaf node with an overflow page number
        return values + keys + parts * page * (_FIXED_PAGES + _INDEX_RECORDS)

    def begin(self, temp_path: str) -> None:
        self._env = self._open(_INITIAL_MAP_SIZE)
        self._pending: list = []
        self._mapped_from = 0  # the file's pages when the environment was opened

    def _open(self, map_size: int) -> "lmdb.Environment":
        return lmdb.open(
            self.temp_path, subdir=False, map_size=map_size, lock=False, sync=False, metasync=False, max_dbs=0
        )

    def _unmap_written_pages(self) -> None:
        """Open the environment again once the file has grown by ``_REMAP_BYTES``.  Every
        transaction reads the pages it appends to through LMDB's map of the file, and the kernel
        maps the neighbouring pages just written with each (fault-around): a map held open
        for the whole write would keep about the whole file in this process's resident memory."""
        info = self._env.info()
        if (info["last_pgno"] - self._mapped_from) * self._env.stat()["psize"] >= _REMAP_BYTES:
            self._env.close()
            self._env = self._open(info["map_size"])
            self._mapped_from = info["last_pgno"]

    def append(self, blob: bytes, i: int, crc: int) -> int:
        return self._put(sample_key(i), blob)

    def append_field(self, name: str, blob: bytes, i: int, crc: int) -> int:
        return self._put(field_key(name, i), blob)

    def _put(self, key: bytes, value: bytes) -> int:
        self._pending.append((key, value))
        if len(self._pending) >= _COMMIT_EVERY:
            self._commit(self._pending)
            self._pending = []
            self._unmap_written_pages()
        return -1

    def _commit(self, records: list) -> None:
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in records:
                        txn.put(key, value)
                return
            except lmdb.MapFullError:  # grow outside any transaction and retry the batch
                self._env.set_mapsize(2 * self._env.info()["map_size"])
            except lmdb.Error as exc:  # LMDB reports a full disk as an I/O error: say which
                raise _write_failure(self.temp_path, exc) from None

    def finish(self, index: SampleIndex, manifest: ArchiveManifest) -> None:
        self._commit(self._pending)
        for name, array in index.arrays().items():  # one transaction each: LMDB copies one array at a time
            self._commit([(_INDEX_PREFIX + name.encode(), npy_record(array))])  # no copy of ours (npy_array)
        self._commit([(MANIFEST_KEY, manifest.to_json().encode())])  # the seal, last transaction
        self._env.sync(True)
        self._env.close()

    def discard(self) -> None:
        try:
            self._env.close()
        except Exception:
            pass


READAHEAD_MIN_BYTES = 64 << 10


def _write_failure(path: str, exc: "lmdb.Error") -> OSError:
    """An OSError for a failed LMDB write: ENOSPC when the file system is (nearly) full, else EIO."""
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        full = st.f_bavail * st.f_frsize < (4 << 20)
    except OSError:
        full = False
    code = errno.ENOSPC if full else errno.EIO
    return OSError(code, f"{os.strerror(code)} (LMDB: {exc})", path)


def wants_readahead(manifest: Optional[ArchiveManifest]) -> bool:
    """OS readahead for archives of large records only.

    Without it (MADV_RANDOM) every 4 KiB page of a record faults on its own:
    raw 256x256x3 records (196 KB) read at ~3,700 images/s on first touch and
    ~30,000 once mapped, against ~31,000 and ~50,000 with it.  Small records
    (CIFAR-sized, or on an archive far larger than RAM) keep it off, where
    reading around each record would mostly read pages nobody asked for.
    """
    return manifest is not None and manifest.mode == "raw" and (manifest.sample_nbytes or 0) >= READAHEAD_MIN_BYTES


class LMDBHandle(Handle):
    """An open read-only environment, its guard, and a descriptor of its data file to check its size
    with: LMDB reads the file's first ``guard.end`` bytes, and a page the file no longer has is SIGBUS."""

    def __init__(self, env: "lmdb.Environment", guard: lmdb_guard.Guard, data_file: str) -> None:
        self.env, self.guard = env, guard
        self.fd = os.open(data_file, os.O_RDONLY)

    def check_size(self) -> None:
        check_file_size(self.fd, self.guard.end)

    def fileno(self) -> int:
        """The data file's descriptor: ``Reader`` checks the file through it before each read or batch."""
        return self.fd

    def close(self) -> None:
        os.close(self.fd)
        self.env.close()

    def discard_inherited(self) -> None:
        self.close()  # lmdb >= 2 refuses to reopen a file whose environment a fork left open


def _data_file(path: str) -> str:
    return os.path.join(path, "data.mdb") if os.path.isdir(path) else path


def _open_env(path: str, readahead: bool) -> LMDBHandle:
    if not os.path.exists(path):
        raise ArchiveNotFoundError(path, "no such file")
    try:
        env, guard = lmdb_guard.open_readonly(path, readahead=readahead, meminit=False, max_spare_txns=0)
    except lmdb.Error as exc:
        if "already open" in str(exc):
            raise ArchiveInUseError(
                path,
                "this process already has the LMDB environment open outside packed_formats",
                hint="lmdb allows one environment per file per process: close the other one first",
            ) from None
        if not os.access(_data_file(path), os.R_OK):  # lmdb says only "Permission denied"
            raise ArchivePermissionError.denied(path, _data_file(path)) from None
        if isinstance(exc, lmdb.MemoryError) or "Cannot allocate memory" in str(exc):
            raise PackedFormatError(  # the map did not fit this process's address space: nothing is damaged
                path, f"LMDB cannot map it ({exc})",
                hint="this process may not map the file: raise its address-space limit (ulimit -v) or free memory",
            ) from None
        raise CorruptArchiveError(path, f"LMDB cannot open it ({exc})", hint="the file is damaged") from None
    return LMDBHandle(env, guard, _data_file(path))


class LMDBBackend(Backend[LMDBHandle]):
    format_name = "lmdb"

    @classmethod
    def read_metadata(cls, path: str) -> Tuple[ArchiveManifest, SampleIndex]:
        # Through the shared handle table: lmdb refuses a second environment on a file
        # that another reader of this process holds open.
        key = handle_key(cls.format_name, path, file_identity(_data_file(path)))
        with handles.borrowed(key, lambda: _open_env(path, readahead=False), LMDBHandle.close) as handle:
            try:
                with handle.env.begin(buffers=True) as txn:  # views of the map, valid inside the transaction
                    raw_manifest = txn.get(MANIFEST_KEY)
                    if raw_manifest is None:
                        raise _missing_manifest(path, txn)
                    records = _index_records(txn)
                    named = [("the manifest", raw_manifest)] + [(f"index array {n!r}", v) for n, v in records.items()]
                    for what, value in named:
                        outside = handle.guard.outside(value)
                        if outside:
                            raise CorruptArchiveError(path, f"the record of {what} {outside}")
                    manifest = ArchiveManifest.from_json(bytes(raw_manifest), path=path)
                    arrays = _index_arrays(handle, records)
            except (lmdb.Error, KeyError, ValueError) as exc:
                raise CorruptArchiveError(path, f"cannot read the archive index: {exc}") from None
        return manifest, SampleIndex.from_arrays(arrays, field_arrays(manifest.fields))

    def open(self) -> LMDBHandle:
        return _open_env(self.path, wants_readahead(self.manifest))

    def data_file(self) -> str:
        return _data_file(self.path)

    def files(self) -> List[str]:
        return [self.data_file()]

    def read(self, handle: LMDBHandle, i: int) -> bytes:
        return self._record(handle, sample_key(i), i, "the sample's record")

    def read_field(self, handle: LMDBHandle, name: str, i: int) -> bytes:
        return self._record(handle, field_key(name, i), i, f"the record of field {name!r}")

    def _record(self, handle: LMDBHandle, key: bytes, i: int, what: str) -> bytes:
        handle.check_size()
        try:
            with handle.env.begin(buffers=True) as txn:  # a view of the map, checked before it is copied
                return bytes(self._checked(handle, txn.get(key), i, what))
        except lmdb.Error as exc:
            raise self.corrupt(f"LMDB read failed: {exc}", i) from None

    def _checked(self, handle: LMDBHandle, value: Optional[memoryview], i: int, what: str) -> memoryview:
        """A record's value, refused by name when it is missing or lies outside the file's pages."""
        if value is None:
            raise self.corrupt(f"{what} is missing", i)
        outside = handle.guard.outside(value)
        if outside:
            raise self.corrupt(f"{what} {outside}", i)
        return value

    def read_batch(self, handle: LMDBHandle, idx: np.ndarray, out: np.ndarray) -> None:
        handle.check_size()
        try:
            with handle.env.begin(buffers=True) as txn:  # copy out inside the transaction
                for j, i in enumerate(idx):
                    value = self._checked(handle, txn.get(sample_key(int(i))), int(i), "the sample's record")
                    out[j] = self.as_stored(value, int(i))
        except lmdb.Error as exc:
            raise CorruptArchiveError(self.path, f"LMDB read failed: {exc}") from None


def _index_records(txn: "lmdb.Transaction") -> Dict[str, memoryview]:
    """The index records by array name, as views into the environment's map."""
    records = {}
    cursor = txn.cursor()
    if cursor.set_range(_INDEX_PREFIX):
        for key, value in cursor:
            key = bytes(key)
            if not key.startswith(_INDEX_PREFIX):
                break
            records[key[len(_INDEX_PREFIX) :].decode()] = memoryview(value)
    return records


def _index_arrays(handle: LMDBHandle, records: Dict[str, memoryview]) -> Dict[str, np.ndarray]:
    """Each index record's array, mapped from the data file where it can be found and checked, else copied."""
    where = _records_in_file(handle, records)
    try:
        mapped = index_map.map_arrays(handle.fd, where) if where else {}
    except (OSError, ValueError):  # cannot map: the copies below are the index
        mapped = {}
    arrays = {}
    for name, record in records.items():
        array = mapped.get(name)
        if array is None or not _same_data(array, record):
            array = from_npy_bytes(bytes(record))  # not found, large and misaligned, or not what lmdb reads
        arrays[name] = array
    return arrays


def _records_in_file(handle: LMDBHandle, records: Dict[str, memoryview]) -> Dict[str, index_map.ArrayAt]:
    """Where each record's array lies in the data file, for the records found there by the B-tree
    walk (on the same meta page lmdb reads: its statistics must agree) with the same .npy header."""
    tree = lmdb_pages.read_main_tree(handle.fd)
    stat, info = handle.env.stat(), handle.env.info()
    if tree is None or (tree.page_size, tree.depth, tree.entries, tree.txnid) != (
        stat["psize"], stat["depth"], stat["entries"], info["last_txnid"]
    ):
        return {}
    where = {}
    for name, record in records.items():
        found = lmdb_pages.value_position(handle.fd, tree, _INDEX_PREFIX + name.encode())
        if found is None or found[1] != len(record):
            continue
        layout = index_map.npy_layout(functools.partial(_head, record))
        if layout is None or os.pread(handle.fd, layout[0], found[0]) != bytes(record[: layout[0]]):
            continue
        header_size, dtype, shape = layout
        at = index_map.ArrayAt(found[0] + header_size, dtype, shape)
        # A large value starts 16 bytes into an overflow page and np.save pads its header to a
        # multiple of 64: aligned.  One in a leaf page (under 2 KiB) may be misaligned, which numpy
        # reads correctly, if slower; a large misaligned one (another writer's) is copied.
        if header_size + at.nbytes == len(record) and (at.aligned() or len(record) < tree.page_size):
            where[name] = at
    return where


def _head(record: memoryview, n: int) -> bytes:
    """The first ``n`` bytes of a record."""
    return bytes(record[:n])


def _same_data(array: np.ndarray, record: memoryview) -> bool:
    """Whether a mapped array's bytes equal the record's data as lmdb reads it, at its start, middle
    and end (a cheap check of the place found; the manifest's checksum of every array follows)."""
    data = array.reshape(-1).view(np.uint8)
    start = len(record) - len(data)
    n = _COMPARED_BYTES
    for at in sorted({0, max(0, len(data) // 2 - n // 2), max(0, len(data) - n)}):
        if data[at : at + n].tobytes() != bytes(record[start + at : start + at + n]):
            return False
    return True


def _missing_manifest(path: str, txn: "lmdb.Transaction") -> PackedFormatError:
    """Why an LMDB without a manifest record cannot be read: an archive of ours whose writer
    never sealed it (its records are our samples or index), or some other LMDB."""
    cursor = txn.cursor()
    if cursor.first():
        first_key, first_value = bytes(cursor.key()), bytes(cursor.value()[:2])
        if first_key.startswith(_INDEX_PREFIX) or (_is_sample_key(first_key) and not _pickled(first_value)):
            return IncompleteArchiveError(path, "no manifest record: the archive was never sealed")
    return UnknownFormatError(
        path, "an LMDB file, but not a packed_formats archive (no manifest record)", hint=CONVERT_HINT
    )


def _is_sample_key(key: bytes) -> bool:
    return len(key) == len(sample_key(0)) and key.isdigit()


def _pickled(head: bytes) -> bool:
    """Whether a value starts as a pickle does (protocol 2 and later), as other tools' LMDBs hold."""
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


_LMDB_MAGIC = (0xBEEFC0DE).to_bytes(4, "little")


def _sniff(path: str, head: Optional[bytes]) -> bool:
    if head is None:
        return os.path.exists(os.path.join(path, "data.mdb"))
    return head[16:20] == _LMDB_MAGIC


SPEC = FormatSpec("lmdb", LMDBBackend, LMDBWriter, (".lmdb", ".mdb"), _sniff)

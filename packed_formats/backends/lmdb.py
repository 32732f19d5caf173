"""LMDB: one record per sample under a fixed-width decimal key, plus index records.

A single data file (``subdir=False``), readable by plain ``lmdb``/``mdb_stat``.
Sealed archives are opened ``readonly=True, lock=False``: no lock file, no
reader-slot table to exhaust, safe on read-only and shared file systems.  An
environment inherited through fork is closed in the child before reopening
(lmdb >= 2 refuses a second environment on one path in a process).
"""

from __future__ import annotations

import errno
import os
from typing import List, Optional, Tuple

import lmdb
import numpy as np

from .. import handles
from ..errors import ArchiveInUseError, ArchiveNotFoundError, CorruptArchiveError, IncompleteArchiveError
from ..index import SampleIndex, from_npy_bytes, npy_bytes
from ..manifest import ArchiveManifest
from .base import Backend, FormatSpec, Handle, Writer, file_identity, handle_key
from .mapped import FileTruncatedError

MANIFEST_KEY = b"__manifest__"
_INDEX_PREFIX = b"__index__/"
_COMMIT_EVERY = 256
_INITIAL_MAP_SIZE = 1 << 30


def sample_key(i: int) -> bytes:
    return b"%010d" % i


class LMDBWriter(Writer):
    format_name = "lmdb"

    def begin(self, temp_path: str) -> None:
        self._env = lmdb.open(
            temp_path, subdir=False, map_size=_INITIAL_MAP_SIZE, lock=False, sync=False, metasync=False, max_dbs=0
        )
        self._pending: list = []

    def append(self, blob: bytes, i: int) -> int:
        self._pending.append((sample_key(i), blob))
        if len(self._pending) >= _COMMIT_EVERY:
            self._commit(self._pending)
            self._pending = []
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
        self._commit([(_INDEX_PREFIX + name.encode(), npy_bytes(a)) for name, a in index.arrays().items()])
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
    """An open read-only environment, and a descriptor of its data file to check its size with:
    the environment maps ``needed`` bytes, and reading a page the file no longer has is SIGBUS."""

    def __init__(self, env: "lmdb.Environment", data_file: str, needed: int) -> None:
        self.env, self.needed = env, needed
        self.fd = os.open(data_file, os.O_RDONLY)

    def check_size(self) -> None:
        size = os.fstat(self.fd).st_size
        if size < self.needed:
            raise FileTruncatedError(f"the file was truncated to {size} bytes while mapped ({self.needed} bytes)")

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
        env = lmdb.open(
            path, subdir=os.path.isdir(path), readonly=True, lock=False, readahead=readahead,
            meminit=False, max_spare_txns=0,
        )
    except lmdb.Error as exc:
        if "already open" in str(exc):
            raise ArchiveInUseError(
                path,
                "this process already has the LMDB environment open outside packed_formats",
                hint="lmdb allows one environment per file per process: close the other one first",
            ) from None
        raise CorruptArchiveError(path, f"LMDB cannot open it ({exc})", hint="the file is damaged") from None
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.path.getsize(_data_file(path))
    if size < needed:
        env.close()  # reading past the end of a mapped file would crash with SIGBUS
        raise CorruptArchiveError(path, f"the file is truncated ({size} bytes, LMDB needs {needed})")
    return LMDBHandle(env, _data_file(path), needed)


class LMDBBackend(Backend[LMDBHandle]):
    format_name = "lmdb"

    @classmethod
    def read_metadata(cls, path: str) -> Tuple[ArchiveManifest, SampleIndex]:
        # Through the shared handle table: lmdb refuses a second environment on a file
        # that another reader of this process holds open.
        key = handle_key(cls.format_name, path, file_identity(_data_file(path)))
        with handles.borrowed(key, lambda: _open_env(path, readahead=False), LMDBHandle.close) as handle:
            try:
                with handle.env.begin() as txn:
                    raw_manifest = txn.get(MANIFEST_KEY)
                    if raw_manifest is None:
                        raise IncompleteArchiveError(path, "no manifest record: the archive was never sealed")
                    manifest = ArchiveManifest.from_json(raw_manifest, path=path)
                    arrays = {}
                    cursor = txn.cursor()
                    if cursor.set_range(_INDEX_PREFIX):
                        for key, value in cursor:
                            if not key.startswith(_INDEX_PREFIX):
                                break
                            arrays[key[len(_INDEX_PREFIX) :].decode()] = from_npy_bytes(value)
            except (lmdb.Error, KeyError, ValueError) as exc:
                raise CorruptArchiveError(path, f"cannot read the archive index: {exc}") from None
        return manifest, SampleIndex.from_arrays(arrays)

    def open(self) -> LMDBHandle:
        return _open_env(self.path, wants_readahead(self.manifest))

    def data_file(self) -> str:
        return _data_file(self.path)

    def files(self) -> List[str]:
        return [self.data_file()]

    def read(self, handle: LMDBHandle, i: int) -> bytes:
        handle.check_size()
        try:
            with handle.env.begin(buffers=False) as txn:
                value = txn.get(sample_key(i))
        except lmdb.Error as exc:
            raise self.corrupt(f"LMDB read failed: {exc}", i) from None
        if value is None:
            raise self.corrupt("the sample's record is missing", i)
        return value

    def read_batch(self, handle: LMDBHandle, idx: np.ndarray, out: np.ndarray) -> None:
        handle.check_size()
        try:
            with handle.env.begin(buffers=True) as txn:  # copy out inside the transaction
                for j, i in enumerate(idx):
                    value = txn.get(sample_key(int(i)))
                    if value is None:
                        raise self.corrupt("the sample's record is missing", int(i))
                    out[j] = self.as_pixels(value, int(i))
        except lmdb.Error as exc:
            raise CorruptArchiveError(self.path, f"LMDB read failed: {exc}") from None


_LMDB_MAGIC = (0xBEEFC0DE).to_bytes(4, "little")


def _sniff(path: str, head: Optional[bytes]) -> bool:
    if head is None:
        return os.path.exists(os.path.join(path, "data.mdb"))
    return head[16:20] == _LMDB_MAGIC


SPEC = FormatSpec("lmdb", LMDBBackend, LMDBWriter, (".lmdb", ".mdb"), _sniff)

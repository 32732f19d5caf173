"""LMDB: one record per sample under a fixed-width decimal key, plus index records.

A single data file (``subdir=False``), readable by plain ``lmdb``/``mdb_stat``.
Sealed archives are opened ``readonly=True, lock=False``: no lock file, no
reader-slot table to exhaust, safe on read-only and shared file systems.  An
environment inherited through fork is closed in the child before reopening
(lmdb >= 2 refuses a second environment on one path in a process).
"""

from __future__ import annotations

import os
from typing import Tuple

import lmdb
import numpy as np

from ..errors import ArchiveNotFoundError, CorruptArchiveError, IncompleteArchiveError, PackedFormatError
from ..index import SampleIndex, from_npy_bytes, npy_bytes
from ..manifest import ArchiveManifest
from .base import Reader, Writer

MANIFEST_KEY = b"__manifest__"
_INDEX_PREFIX = b"__index__/"
_COMMIT_EVERY = 256
_INITIAL_MAP_SIZE = 1 << 30


def sample_key(i: int) -> bytes:
    return b"%010d" % i


class LMDBWriter(Writer):
    format_name = "lmdb"

    def _begin(self, temp_path: str) -> None:
        self._env = lmdb.open(
            temp_path, subdir=False, map_size=_INITIAL_MAP_SIZE, lock=False, sync=False, metasync=False, max_dbs=0
        )
        self._pending: list = []

    def _append(self, blob: bytes, i: int) -> int:
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

    def _finish(self, index: SampleIndex, manifest: ArchiveManifest) -> None:
        self._commit(self._pending)
        self._commit([(_INDEX_PREFIX + name.encode(), npy_bytes(a)) for name, a in index.arrays().items()])
        self._commit([(MANIFEST_KEY, manifest.to_json().encode())])  # the seal, last transaction
        self._env.sync(True)
        self._env.close()

    def _abort(self) -> None:
        try:
            self._env.close()
        except Exception:
            pass


READAHEAD_MIN_BYTES = 64 << 10


class LMDBReader(Reader):
    format_name = "lmdb"

    def _wants_readahead(self) -> bool:
        """OS readahead for archives of large records only.

        Without it (MADV_RANDOM) every 4 KiB page of a record faults on its own:
        raw 256x256x3 records (196 KB) read at ~3,700 images/s on first touch and
        ~30,000 once mapped, against ~31,000 and ~50,000 with it.  Small records
        (CIFAR-sized, or on an archive far larger than RAM) keep it off, where
        reading around each record would mostly read pages nobody asked for.
        """
        manifest = getattr(self, "manifest", None)  # unknown while the metadata itself is read
        return manifest is not None and manifest.mode == "raw" and manifest.sample_nbytes >= READAHEAD_MIN_BYTES

    def _open(self) -> "lmdb.Environment":
        if not os.path.exists(self.path):
            raise ArchiveNotFoundError(self.path, "no such file")
        subdir = os.path.isdir(self.path)
        try:
            env = lmdb.open(
                self.path, subdir=subdir, readonly=True, lock=False, readahead=self._wants_readahead(),
                meminit=False, max_spare_txns=0,
            )
        except lmdb.Error as exc:
            if "already open" in str(exc):
                raise PackedFormatError(
                    self.path,
                    "this process already has the LMDB environment open outside packed_formats",
                    hint="lmdb allows one environment per file per process: close the other one first",
                ) from None
            raise CorruptArchiveError(self.path, f"LMDB cannot open it ({exc})", hint="the file is damaged") from None
        data_file = os.path.join(self.path, "data.mdb") if subdir else self.path
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        if os.path.getsize(data_file) < needed:
            env.close()  # reading past the end of a mapped file would crash with SIGBUS
            raise CorruptArchiveError(
                self.path, f"the file is truncated ({os.path.getsize(data_file)} bytes, LMDB needs {needed})"
            )
        return env

    @staticmethod
    def _discard_inherited(env: "lmdb.Environment") -> None:
        env.close()

    def _read_metadata(self, env: "lmdb.Environment") -> Tuple[ArchiveManifest, SampleIndex]:
        try:
            with env.begin() as txn:
                raw_manifest = txn.get(MANIFEST_KEY)
                if raw_manifest is None:
                    raise IncompleteArchiveError(self.path, "no manifest record: the archive was never sealed")
                manifest = ArchiveManifest.from_json(raw_manifest, path=self.path)
                arrays = {}
                cursor = txn.cursor()
                if cursor.set_range(_INDEX_PREFIX):
                    for key, value in cursor:
                        if not key.startswith(_INDEX_PREFIX):
                            break
                        arrays[key[len(_INDEX_PREFIX) :].decode()] = from_npy_bytes(value)
        except lmdb.Error as exc:
            raise CorruptArchiveError(self.path, f"cannot read the archive index: {exc}") from None
        except (KeyError, ValueError) as exc:
            raise CorruptArchiveError(self.path, f"cannot read the archive index: {exc}") from None
        return manifest, SampleIndex.from_arrays(arrays)

    def _read_blob(self, env: "lmdb.Environment", i: int) -> bytes:
        try:
            with env.begin(buffers=False) as txn:
                value = txn.get(sample_key(i))
        except lmdb.Error as exc:
            raise self._corrupt(f"LMDB read failed: {exc}", i) from None
        if value is None:
            raise self._corrupt("the sample's record is missing", i)
        return value

    def _read_raw_batch(self, env: "lmdb.Environment", idx: np.ndarray, out: np.ndarray) -> None:
        try:
            with env.begin(buffers=True) as txn:  # copy out inside the transaction
                for j, i in enumerate(idx):
                    value = txn.get(sample_key(int(i)))
                    if value is None:
                        raise self._corrupt("the sample's record is missing", int(i))
                    out[j] = self._as_pixels(value, int(i))
        except lmdb.Error as exc:
            raise CorruptArchiveError(self.path, f"LMDB read failed: {exc}") from None

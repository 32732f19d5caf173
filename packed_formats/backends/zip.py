"""ZIP: one STORED member per sample plus .npy index members and manifest.json.

Readable by ``unzip``/``zipinfo``/``zipfile``.  The central directory is parsed
once (in the process that opens the dataset); the index stores each sample's
absolute byte position, so a read is one ``os.pread`` on a per-process file
descriptor: no shared ``ZipFile`` seek state, nothing to corrupt across fork.
Raw batches are gathered from a per-process map of the file (``mapped.py``).
"""

from __future__ import annotations

import os
import struct
import zipfile
from typing import Any, Optional, Tuple

import numpy as np

from ..errors import CorruptArchiveError, IncompleteArchiveError, UnknownFormatError
from ..index import SampleIndex, from_npy_bytes, npy_bytes
from ..manifest import ArchiveManifest
from . import mapped
from .base import Reader, Writer

MANIFEST = "manifest.json"
INDEX_DIR = "index/"
_FIXED_DATE = (1980, 1, 1, 0, 0, 0)  # same input -> byte-identical archive
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile's structFileHeader


def member_name(i: int, extension: str) -> str:
    return f"samples/{i:09d}.{extension}"


class ZipWriter(Writer):
    format_name = "zip"

    def _begin(self, temp_path: str) -> None:
        self._zip = zipfile.ZipFile(temp_path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def _stores_positions(self) -> bool:
        return True

    def _write_member(self, name: str, data: bytes) -> int:
        info = zipfile.ZipInfo(name, date_time=_FIXED_DATE)
        info.compress_type = zipfile.ZIP_STORED
        info.external_attr = 0o644 << 16
        with self._zip.open(info, "w", force_zip64=len(data) >= zipfile.ZIP64_LIMIT) as member:
            position = self._zip.fp.tell()  # the local header is written: data starts here
            member.write(data)
        return position

    def _append(self, blob: bytes, i: int) -> int:
        from ..codecs import sniff

        extension = "raw" if self.mode == "raw" else {"jpeg": "jpg", "png": "png"}[sniff(blob)]
        return self._write_member(member_name(i, extension), blob)

    def _finish(self, index: SampleIndex, manifest: ArchiveManifest) -> None:
        for name, array in index.arrays().items():
            self._write_member(f"{INDEX_DIR}{name}.npy", npy_bytes(array))
        self._write_member(MANIFEST, manifest.to_json().encode())
        self._zip.close()  # writes the central directory: without it nothing opens

    def _abort(self) -> None:
        try:
            self._zip.close()
        except Exception:
            pass


class _Descriptor(int):
    """A per-process file descriptor (an int to every ``os`` call) that can carry the file's
    mapped sample rows, made on the first batch read."""

    rows: "Optional[mapped.MappedRows | bool]" = None  # False: not mapped (the file is shorter than its index)

    def __reduce__(self):
        return int, (int(self),)  # a number elsewhere, never its map

    def forget_rows(self) -> None:
        if self.rows:
            self.rows.close()
        self.rows = None


class ZipReader(Reader):
    format_name = "zip"

    def _open(self) -> int:
        try:
            return _Descriptor(os.open(self.path, os.O_RDONLY))
        except FileNotFoundError:
            from ..errors import ArchiveNotFoundError

            raise ArchiveNotFoundError(self.path, "no such file") from None

    @staticmethod
    def _close_handle(fd: _Descriptor) -> None:
        fd.forget_rows()
        os.close(fd)

    @staticmethod
    def _discard_inherited(fd: _Descriptor) -> None:
        fd.forget_rows()  # the child's copies of the parent's mapping
        os.close(fd)  # and descriptor

    def _read_metadata(self, fd: Any) -> Tuple[ArchiveManifest, SampleIndex]:
        try:
            with zipfile.ZipFile(self.path) as archive:
                names = set(archive.namelist())
                if MANIFEST not in names:
                    if any(n.startswith("samples/") for n in names):
                        raise IncompleteArchiveError(
                            self.path, "the ZIP has samples but no manifest: it was never sealed"
                        )
                    raise UnknownFormatError(
                        self.path, "a ZIP file, but not a packed_formats archive (no manifest.json)"
                    )
                manifest = ArchiveManifest.from_json(archive.read(MANIFEST), path=self.path)
                arrays = {
                    n[len(INDEX_DIR) : -len(".npy")]: from_npy_bytes(archive.read(n))
                    for n in names
                    if n.startswith(INDEX_DIR) and n.endswith(".npy")
                }
                index = SampleIndex.from_arrays(arrays)
                if manifest.count:
                    self._check_first_member(archive, fd, index)
        except zipfile.BadZipFile as exc:
            raise IncompleteArchiveError(
                self.path, f"not a complete ZIP file ({exc})", hint="the file is truncated or its writer was killed"
            ) from None
        except (KeyError, ValueError, OSError, EOFError) as exc:
            raise CorruptArchiveError(self.path, f"cannot read the archive index: {exc}") from None
        return manifest, index

    def _check_first_member(self, archive: zipfile.ZipFile, fd: int, index: SampleIndex) -> None:
        """The stored position must be where the member's data starts (STORED only)."""
        info = next(i for i in archive.infolist() if i.filename.startswith("samples/"))
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptArchiveError(self.path, f"member {info.filename} is compressed; samples must be STORED")
        header = os.pread(fd, _LOCAL_HEADER.size, info.header_offset)
        fields = _LOCAL_HEADER.unpack(header)
        start = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
        if fields[0] != b"PK\x03\x04" or start != int(index.positions[0]):
            raise CorruptArchiveError(self.path, "sample positions in the index do not match the ZIP layout")

    def _read_blob(self, fd: int, i: int) -> bytes:
        size = self.index.nbytes(i)
        data = os.pread(fd, size, int(self.index.positions[i]))
        if len(data) != size:
            raise self._corrupt(f"read {len(data)} of {size} bytes: the file is truncated", i)
        return data

    def _read_raw_batch(self, fd: _Descriptor, idx: np.ndarray, out: np.ndarray) -> None:
        """One gather from the mapped file (see mapped.py); one ``pread`` per sample into a
        non-contiguous ``out``, or when the file is shorter than its index says."""
        size = self.manifest.sample_nbytes
        if out.flags.c_contiguous:
            if fd.rows is None:
                fd.rows = mapped.MappedRows.of(fd, self.index.positions, size) or False
            if fd.rows:
                fd.rows.gather(idx, out)
                return
        for j, i in enumerate(idx):
            got = os.preadv(fd, [memoryview(out[j]).cast("B")], int(self.index.positions[i]))
            if got != size:
                raise self._corrupt(f"read {got} of {size} bytes: the file is truncated", int(i))

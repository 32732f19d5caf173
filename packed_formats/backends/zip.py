"""ZIP: one STORED member per sample plus .npy index members and manifest.json.

Readable by ``unzip``/``zipinfo``/``zipfile``.  The central directory is parsed
once, when the metadata is read; the index stores each sample's absolute byte
position, so a read is one ``os.pread`` on a per-process file descriptor: no
shared ``ZipFile`` seek state, nothing to corrupt across fork.  Raw batches
are gathered from a per-process map of the file (``mapped.py``).
"""

from __future__ import annotations

import os
import struct
import zipfile
from typing import Optional, Tuple

import numpy as np

from ..errors import ArchiveNotFoundError, CorruptArchiveError, IncompleteArchiveError, UnknownFormatError
from ..index import SampleIndex, from_npy_bytes, npy_bytes
from ..manifest import ArchiveManifest
from . import mapped
from .base import DAMAGED_HINT, Backend, FormatSpec, Handle, Writer

MANIFEST = "manifest.json"
INDEX_DIR = "index/"
_FIXED_DATE = (1980, 1, 1, 0, 0, 0)  # same input -> byte-identical archive
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile's structFileHeader


def member_name(i: int, extension: str) -> str:
    return f"samples/{i:09d}.{extension}"


class ZipWriter(Writer):
    format_name = "zip"
    stores_positions = True

    def begin(self, temp_path: str) -> None:
        self._zip = zipfile.ZipFile(temp_path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def _write_member(self, name: str, data: bytes) -> int:
        info = zipfile.ZipInfo(name, date_time=_FIXED_DATE)
        info.compress_type = zipfile.ZIP_STORED
        info.external_attr = 0o644 << 16
        with self._zip.open(info, "w", force_zip64=len(data) >= zipfile.ZIP64_LIMIT) as member:
            assert self._zip.fp is not None, "the ZIP file is open for writing"
            position = self._zip.fp.tell()  # the local header is written: data starts here
            member.write(data)
        return position

    def append(self, blob: bytes, i: int) -> int:
        from ..codecs import sniff

        extension = "raw" if self.mode == "raw" else {"jpeg": "jpg", "png": "png"}.get(sniff(blob) or "", "bin")
        return self._write_member(member_name(i, extension), blob)

    def finish(self, index: SampleIndex, manifest: ArchiveManifest) -> None:
        for name, array in index.arrays().items():
            self._write_member(f"{INDEX_DIR}{name}.npy", npy_bytes(array))
        self._write_member(MANIFEST, manifest.to_json().encode())
        self._zip.close()  # writes the central directory: without it nothing opens

    def discard(self) -> None:
        try:
            self._zip.close()
        except Exception:
            pass


class ZipHandle(Handle):
    """A per-process file descriptor and, after the first raw batch, the file's mapped sample rows."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.rows: "Optional[mapped.MappedRows | bool]" = None  # False: not mappable (shorter than its index)

    def mapped_rows(self, positions: np.ndarray, nbytes: int) -> "Optional[mapped.MappedRows]":
        if self.rows is None:
            self.rows = mapped.MappedRows.of(self.fd, positions, nbytes) or False
        return self.rows if isinstance(self.rows, mapped.MappedRows) else None

    def close(self) -> None:
        if isinstance(self.rows, mapped.MappedRows):
            self.rows.close()
        self.rows = None
        os.close(self.fd)

    def discard_inherited(self) -> None:
        self.close()  # the child's copies of the parent's mapping and descriptor


class ZipBackend(Backend[ZipHandle]):
    format_name = "zip"

    @classmethod
    def read_metadata(cls, path: str) -> Tuple[ArchiveManifest, SampleIndex]:
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
                index = SampleIndex.from_arrays(arrays)
                if manifest.count:
                    _check_first_member(path, archive, index)
        except FileNotFoundError:
            raise ArchiveNotFoundError(path, "no such file") from None
        except zipfile.BadZipFile as exc:
            if "CRC" in str(exc):  # a metadata member fails ZIP's own checksum: damaged, not unfinished
                raise CorruptArchiveError(path, f"the archive index is damaged ({exc})", hint=DAMAGED_HINT) from None
            raise IncompleteArchiveError(
                path, f"not a complete ZIP file ({exc})", hint="the file is truncated or its writer was killed"
            ) from None
        except (KeyError, ValueError, OSError, EOFError) as exc:
            raise CorruptArchiveError(path, f"cannot read the archive index: {exc}") from None
        return manifest, index

    def open(self) -> ZipHandle:
        try:
            return ZipHandle(os.open(self.path, os.O_RDONLY))
        except FileNotFoundError:
            raise ArchiveNotFoundError(self.path, "no such file") from None

    def read(self, handle: ZipHandle, i: int) -> bytes:
        offsets = self.offsets
        size = int(offsets[i + 1] - offsets[i])
        data = os.pread(handle.fd, size, int(self.positions[i]))
        if len(data) != size:
            raise self.corrupt(f"read {len(data)} of {size} bytes: the file is truncated", i)
        return data

    def read_batch(self, handle: ZipHandle, idx: np.ndarray, out: np.ndarray) -> None:
        """One gather from the mapped file (see mapped.py); one ``pread`` per sample into a
        non-contiguous ``out``, or when the file is shorter than its index says."""
        size = self.sample_nbytes
        rows = handle.mapped_rows(self.positions, size) if out.flags.c_contiguous else None
        if rows is not None:
            rows.gather(idx, out)
            return
        for j, i in enumerate(idx):
            got = os.preadv(handle.fd, [memoryview(out[j]).cast("B")], int(self.positions[i]))
            if got != size:
                raise self.corrupt(f"read {got} of {size} bytes: the file is truncated", int(i))

    def sample_location(self, i: int) -> Tuple[str, int]:
        return self.path, int(self.positions[i])


def _check_first_member(path: str, archive: zipfile.ZipFile, index: SampleIndex) -> None:
    """The stored position must be where the member's data starts (STORED only)."""
    info = next(i for i in archive.infolist() if i.filename.startswith("samples/"))
    if info.compress_type != zipfile.ZIP_STORED:
        raise CorruptArchiveError(path, f"member {info.filename} is compressed; samples must be STORED")
    with open(path, "rb") as file:
        header = os.pread(file.fileno(), _LOCAL_HEADER.size, info.header_offset)
    fields = _LOCAL_HEADER.unpack(header)
    start = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
    if fields[0] != b"PK\x03\x04" or index.positions is None or start != int(index.positions[0]):
        raise CorruptArchiveError(path, "sample positions in the index do not match the ZIP layout")


def _sniff(path: str, head: Optional[bytes]) -> bool:
    return head is not None and head[:4] in (b"PK\x03\x04", b"PK\x05\x06")


SPEC = FormatSpec("zip", ZipBackend, ZipWriter, (".zip",), _sniff)

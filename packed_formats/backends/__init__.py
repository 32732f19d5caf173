"""The format registry: names -> Reader/Writer classes, and format detection."""

from __future__ import annotations

import os
from typing import Dict, Optional, Type

from ..errors import ArchiveNotFoundError, FormatMismatchError, UnknownFormatError
from .base import Reader, Writer
from .folder import FolderReader, looks_like_image_folder
from .hdf5 import HDF5Reader, HDF5Writer
from .lmdb import LMDBReader, LMDBWriter
from .memmap import MANIFEST as MEMMAP_MANIFEST
from .memmap import MemmapReader, MemmapWriter
from .sharded import ShardedReader, is_shard_index
from .zip import ZipReader, ZipWriter

READERS: Dict[str, Type[Reader]] = {
    "zip": ZipReader,
    "hdf5": HDF5Reader,
    "lmdb": LMDBReader,
    "memmap": MemmapReader,
    "folder": FolderReader,
}
WRITERS: Dict[str, Type[Writer]] = {
    "zip": ZipWriter,
    "hdf5": HDF5Writer,
    "lmdb": LMDBWriter,
    "memmap": MemmapWriter,
}
FORMATS = tuple(READERS)
PACKED_FORMATS = tuple(WRITERS)
READERS["sharded"] = ShardedReader  # an index over parts in one of the formats above

_LMDB_MAGIC = (0xBEEFC0DE).to_bytes(4, "little")


def reader_class(format: str) -> Type[Reader]:
    try:
        return READERS[format]
    except KeyError:
        raise ValueError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}") from None


def writer_class(format: str) -> Type[Writer]:
    try:
        return WRITERS[format]
    except KeyError:
        raise ValueError(f"cannot write format {format!r}; choose one of {', '.join(PACKED_FORMATS)}") from None


def sniff_format(path: str) -> Optional[str]:
    """The format of ``path`` from its content, or None if it is none of ours."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, MEMMAP_MANIFEST)) or any(
            os.path.exists(os.path.join(path, n)) for n in ("images.npy", "data.npy")
        ):
            return "memmap"
        if os.path.exists(os.path.join(path, "data.mdb")):
            return "lmdb"
        return "folder" if looks_like_image_folder(path) else None
    with open(path, "rb") as file:
        head = file.read(64)
    if is_shard_index(head):
        return "sharded"
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[:8] == b"\x89HDF\r\n\x1a\n":
        return "hdf5"
    if head[16:20] == _LMDB_MAGIC:
        return "lmdb"
    return None


def detect_format(path: "str | os.PathLike[str]", expected: Optional[str] = None) -> str:
    """The format of the archive at ``path``; checks it against ``expected`` if given."""
    path = os.fspath(path)
    if expected is not None:
        reader_class(expected)
    if not os.path.lexists(path):
        raise ArchiveNotFoundError(path, "no such file or directory", hint="check the path")
    try:
        found = sniff_format(path)
    except OSError as exc:
        raise UnknownFormatError(path, f"cannot read it: {exc.strerror}") from None
    if found is None:
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            raise UnknownFormatError(path, "empty file, not an archive")
        raise UnknownFormatError(
            path,
            "not an archive this library reads",
            hint=f"expected one of {', '.join(FORMATS)}; create one with `packed-formats convert`",
        )
    if expected is not None and found != expected:
        raise FormatMismatchError(
            path, f"this is a {found} archive, not {expected}", hint=f"open it as format={found!r}"
        )
    return found


def open_archive(path: "str | os.PathLike[str]", format: Optional[str] = None, verify: bool = True) -> Reader:
    """Open any archive (format auto-detected) as a Reader."""
    return reader_class(detect_format(path, format))(path, verify=verify)


def open_writer(path: "str | os.PathLike[str]", format: str = "zip", **options) -> Writer:
    """A Writer for a new archive at ``path`` (see Writer for options)."""
    return writer_class(format)(path, **options)

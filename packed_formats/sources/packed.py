"""packed: an archive written by packed_formats (any format, sharded or not), to convert to another.

Read through its Reader (checksums verified), at random: the Reader pickles
as its path, so each conversion worker opens its own.  The archive's fields
come along, all of them unless some are named (``--field NAME=KIND`` as the
archive declares it) or ``--field none`` leaves them out.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..archives import open_archive
from ..backends import sniff_format
from ..backends.reader import Reader
from ..errors import CorruptArchiveError, InvalidSourceError
from .base import Data, Source, SourceOptions

_OUR_FIRST_MEMBER = re.compile(r"^(samples/\d{9}\.\w+|index/\w+\.npy|manifest\.json)$")
_OUR_HDF5_NAMES = {"images", "data", "labels", "keys", "crc32", "offsets"}


class PackedSource(Source):
    """A packed_formats archive."""

    kind = "packed"
    random_access = True
    reads_fields = True

    def __init__(self, path: str, reader: Reader) -> None:
        keys = np.asarray(reader.index.keys)  # a sharded archive's, joined: the converter holds the whole index
        super().__init__(path, reader.classes, keys, reader.labels, layout=f"{reader.format_name} archive")
        self.reader = reader

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        try:
            found = sniff_format(path)
        except OSError:
            return False
        if found in (None, "folder"):
            return False
        if found == "zip":
            return _first_zip_member(path) is None or bool(_OUR_FIRST_MEMBER.match(_first_zip_member(path) or ""))
        if found == "hdf5":
            return _ours_hdf5(path)
        if found == "lmdb":
            return _ours_lmdb(path)
        return True

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "PackedSource":
        for name in ("subdir", "label_key", "image_key"):
            if getattr(options, name) is not None:
                raise InvalidSourceError(path, f"a packed_formats archive takes no {name} option")
        source = cls(path, open_archive(path, verify=True))
        source.fields = () if options.no_fields else source.reader.fields
        source.labelled = source.reader.manifest.labelled  # an archive without labels stays one
        declared = options.declared_fields
        if declared and not options.auto_fields:
            unknown = [spec.describe() for spec in declared if spec not in source.fields]
            if unknown:
                source.close()
                there = ", ".join(spec.describe() for spec in source.fields) or "none"
                raise InvalidSourceError(path, f"the archive has no field {unknown[0]} (its fields: {there})")
            source.fields = declared
        return source

    @property
    def raw_shape(self) -> Optional[Tuple[int, int, int]]:
        return self.reader.manifest.shape if self.reader.mode == "raw" else None

    def location(self, i: int) -> str:
        return self.path

    def load(self, i: int) -> Data:
        return self.reader.read(i)

    def load_fields(self, i: int) -> Dict[str, Any]:
        return {spec.name: self.reader.read_field(i, spec.name) for spec in self.fields}

    def close(self) -> None:
        self.reader.close()


def _first_zip_member(path: str) -> Optional[str]:
    """The name in the first local header of a ZIP file (None if there is none)."""
    with open(path, "rb") as file:
        header = file.read(30)
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            return None
        length = int.from_bytes(header[26:28], "little")
        return file.read(length).decode("utf-8", "replace")


def _ours_hdf5(path: str) -> bool:
    import h5py

    from ..backends.hdf5 import MANIFEST_ATTR

    try:
        with h5py.File(path, "r", locking=False) as file:
            if MANIFEST_ATTR in file.attrs:
                return True
            names = set(file.keys())
    except OSError:
        return True  # damaged: the archive reader says how
    return bool(names) and names <= _OUR_HDF5_NAMES and "labels" not in names


def _ours_lmdb(path: str) -> bool:
    import lmdb

    from ..backends.lmdb import MANIFEST_KEY
    from ..backends.lmdb_guard import open_readonly

    try:
        env, guard = open_readonly(path, max_spare_txns=0)
    except (lmdb.Error, CorruptArchiveError):
        return True  # damaged: the archive reader says how
    try:
        with env.begin(buffers=True) as txn:
            if txn.get(MANIFEST_KEY) is not None:
                return True
            cursor = txn.cursor()
            if not cursor.first():
                return True
            key, value = cursor.item()
            if guard.outside(key) or guard.outside(value):
                return True  # damaged: the archive reader says how
            return len(key) == 10 and bytes(key).isdigit() and not bytes(value[:1]) == b"\x80"
    finally:
        env.close()

"""zip: a ZIP file holding an ImageFolder tree, or images plus a stylegan2-ada dataset.json.

The central directory is read once; then any process reads any member with
one ``os.pread`` of its local header and data, inflated (stored, deflate and
bzip2 members) and checked against its CRC32.  Random access, so the
conversion workers read their own samples, in parallel.
"""

from __future__ import annotations

import bz2
import os
import stat
import struct
import zipfile
import zlib
from typing import List, Optional

import numpy as np

from ..checksum import crc32
from ..errors import CorruptArchiveError, CorruptSampleError, InvalidSourceError
from ..index import decode_key, encode_keys
from .base import FilePool, Source, SourceOptions, UnsafeName, keep_last, member_path, unsafe_name_error, warn_members
from .layout import DATASET_JSON, dataset_json_layout, dataset_json_member, image_folder_layout, looks_like_dataset_json

_LOCAL = struct.Struct("<4s5H3L2H")  # local file header: signature ... name length, extra length
_SLACK = 512  # bytes read past the name for the local extra field, to read a member in one pread
_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2"}


class ZipSource(Source):
    """Members of a foreign ZIP file (one that ``packed_formats`` did not write)."""

    kind = "zip"
    random_access = True

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        return head[:4] in (b"PK\x03\x04", b"PK\x05\x06")

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "ZipSource":
        try:
            with zipfile.ZipFile(path) as archive:
                infos = archive.infolist()
                names: List[str] = []
                dirs: List[str] = []
                failed: List[str] = []
                left_out: List[str] = []
                for info in infos:
                    name = _clean(path, info.filename, options, failed)
                    other = _not_a_file(info)
                    if info.is_dir() or other:
                        names.append("")
                        if info.is_dir() and name:
                            dirs.append(name)
                        elif other and name:
                            left_out.append(f"{name!r} ({other})")
                        continue
                    names.append(name)
                replaced = _keep_last(names)
                warn_members(path, left_out, replaced, "ZIP file")
                where = dataset_json_member(names, options.subdir)
                if where == -1:
                    raise InvalidSourceError(path, f"has several {DATASET_JSON} files", hint="choose one with --subdir")
                content = archive.read(infos[where]) if where is not None else b""
        except zipfile.BadZipFile as exc:
            raise truncated_zip_error(path, exc) from None
        if where is not None and looks_like_dataset_json(content):
            layout = dataset_json_layout(path, names, where, content)
        else:
            layout = image_folder_layout(path, names, dirs, options.subdir)
        chosen = [infos[j] for j in layout.members]
        source = cls(path, layout.classes, layout.keys, layout.labels, chosen, layout.skipped, failed,
                     layout.description)
        source.skipped_names = layout.skipped_names
        return source

    def __init__(self, path, classes, keys, labels, infos: List[zipfile.ZipInfo], skipped, failed, layout) -> None:
        super().__init__(path, classes, keys, labels, skipped, failed, layout)
        self.names = encode_keys([info.filename for info in infos])
        self.header_offsets = np.asarray([info.header_offset for info in infos], dtype=np.int64)
        self.compressed_sizes = np.asarray([info.compress_size for info in infos], dtype=np.int64)
        self.sizes = np.asarray([info.file_size for info in infos], dtype=np.int64)
        self.crcs = np.asarray([info.CRC for info in infos], dtype=np.uint32)
        self.methods = np.asarray([info.compress_type for info in infos], dtype=np.int32)
        self.encrypted = np.asarray([bool(info.flag_bits & 0x1) for info in infos], dtype=bool)
        self.files = FilePool(1)

    def location(self, i: int) -> str:
        return f"{self.path}:{decode_key(self.names[i])}"

    def stored_size(self, i: int) -> Optional[int]:
        return int(self.sizes[i])

    def notes(self) -> List[str]:
        return ["read at random: each worker reads (and inflates) its own members"]

    def load(self, i: int) -> bytes:
        fail = self._failure(i)
        method = int(self.methods[i])
        if self.encrypted[i]:
            raise fail("the member is encrypted")
        if method not in _METHODS:
            raise fail(f"compression method {method} is not supported (only {', '.join(_METHODS.values())})")
        stored = int(self.compressed_sizes[i])
        offset = int(self.header_offsets[i])
        wanted = _LOCAL.size + len(self.names[i]) + _SLACK + stored
        try:
            block = self.files.pread(self.path, wanted, offset)
            fields = _LOCAL.unpack_from(block)
            if fields[0] != b"PK\x03\x04":
                raise fail("no local header where the central directory points: the file is damaged")
            start = _LOCAL.size + fields[-2] + fields[-1]
            if start + stored > len(block):
                block += self.files.pread(self.path, start + stored - len(block), offset + len(block))
        except (OSError, struct.error) as exc:
            raise fail(f"cannot read it ({exc})") from None
        data = block[start:start + stored]
        if len(data) != stored:
            raise fail(f"read {len(data)} of {stored} bytes: the file is truncated")
        try:
            if method == zipfile.ZIP_DEFLATED:
                data = zlib.decompress(data, -15)
            elif method == zipfile.ZIP_BZIP2:
                data = bz2.decompress(data)
        except (zlib.error, OSError, ValueError) as exc:
            raise fail(f"cannot inflate it ({exc})") from None
        if crc32(data) != int(self.crcs[i]) or len(data) != int(self.sizes[i]):
            raise fail("the member fails its CRC32 check: the file is damaged")
        return data

    def _failure(self, i: int):
        def error(problem: str) -> CorruptSampleError:
            return CorruptSampleError(self.location(i), problem, index=i, key=self.key(i))

        return error

    def close(self) -> None:
        self.files.close()


def _clean(path: str, name: str, options: SourceOptions, failed: List[str]) -> str:
    """The member's clean path, or "" for an unsafe one (refused, or left out with on_error="skip")."""
    try:
        return member_path(name)
    except UnsafeName:
        error = unsafe_name_error(path, name)
        if options.on_error == "raise":
            raise error from None
        failed.append(str(error))
        return ""


_OTHER_TYPES = {stat.S_IFLNK: "a symbolic link; ZIP links are not followed", stat.S_IFCHR: "a character device",
                stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


def _not_a_file(info: zipfile.ZipInfo) -> str:
    """What a member is when its Unix mode says it is no file or directory (a link, a device...), else ""."""
    return _OTHER_TYPES.get(stat.S_IFMT(info.external_attr >> 16), "")


def _keep_last(names: List[str]) -> List[str]:
    """Blank the earlier of members with the same name (the last is the one unzip leaves); them, as shown."""
    before = list(names)
    return [repr(before[j]) for j in keep_last(names)]


def truncated_zip_error(path: str, exc: Exception) -> CorruptArchiveError:
    """The error for a ZIP file without a readable central directory, naming the member it ends in."""
    last = _last_local_member(path)
    where = f" (the file ends inside or after member {last!r})" if last else ""
    return CorruptArchiveError(
        path, f"not a complete ZIP file: {exc}{where}", hint="the file is truncated: download or copy it again"
    )


def _last_local_member(path: str) -> Optional[str]:
    """The name of the last member whose local header is in the file, walking the headers from the start."""
    last = None
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            offset = 0
            while offset + _LOCAL.size <= size:
                file.seek(offset)
                fields = _LOCAL.unpack(file.read(_LOCAL.size))
                if fields[0] != b"PK\x03\x04":
                    break
                flags, stored, name_length, extra_length = fields[2], fields[7], fields[-2], fields[-1]
                last = file.read(name_length).decode("utf-8" if flags & 0x800 else "cp437", "replace")
                if flags & 0x8:
                    break  # sizes follow the data: the next header cannot be found without inflating
                offset += _LOCAL.size + name_length + extra_length + stored
    except (OSError, struct.error):
        pass
    return last

"""The ZIP records the zip format writes and reads, declared once as data (PKWARE APPNOTE 4.3).

Each record is a list of little-endian fields, from which come both a
``struct.Struct`` (to pack or parse one record) and a numpy structured dtype
(to build the central directory of many members at once, or read it back for
``verify``, without a Python object per member).  ZIP64 is used wherever a value reaches its 32-bit field's
limit (``limit``, lowered by tests to reach that branch with small files) or
there are more than 65,535 entries.

Our archives' end record carries a *locator* as its comment: where the
manifest and the index arrays lie, so that a reader finds them from the file's
last bytes alone, never parsing the central directory.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

ZIP64_LIMIT = 0xFFFFFFFF  # a 32-bit size or offset field holding this means "see the ZIP64 field"
MAX_ENTRIES = 0xFFFF  # entries an end record counts without ZIP64
MAX_COMMENT = 0xFFFF
DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01: same input -> byte-identical archive
DOS_TIME = 0
STORED = 0
VERSION = 20  # "version needed to extract" of a STORED member
VERSION_ZIP64 = 45
MADE_ON_UNIX = 3 << 8  # external attributes hold Unix permissions
FILE_ATTRIBUTES = 0o100644 << 16  # a regular file, rw-r--r--
ZIP64_TAG = 0x0001
PADDING_TAG = 0xD935  # an alignment extra field (uint16 alignment, then zero bytes), ignored by unzip
PADDING_MIN = 6  # the smallest padding field: tag, length, alignment


_NUMPY_CODES = {"H": "<u2", "I": "<u4", "Q": "<u8"}


class Layout:
    """One ZIP record: its fields as (name, struct code) pairs, little-endian, unpadded."""

    def __init__(self, signature: bytes, fields: Sequence[Tuple[str, str]]) -> None:
        self.signature = signature
        self.fields = tuple(name for name, _ in fields)
        self.struct = struct.Struct("<" + "".join(code for _, code in fields))
        self.dtype = np.dtype([(name, _NUMPY_CODES[code]) for name, code in fields])
        self.size = self.struct.size

    def pack(self, **values: int) -> bytes:
        """The record with ``values`` (fields left out are 0; the signature is filled in)."""
        values.setdefault("signature", int.from_bytes(self.signature, "little"))
        return self.struct.pack(*(values.get(name, 0) for name in self.fields))

    def unpack(self, data: bytes, offset: int = 0) -> Optional[Dict[str, int]]:
        """The fields at ``offset``, or None when the bytes there are not this record (too few, wrong signature)."""
        if offset < 0 or len(data) < offset + self.size or data[offset : offset + 4] != self.signature:
            return None
        return dict(zip(self.fields, self.struct.unpack_from(data, offset)))


def _fields(spec: str) -> List[Tuple[str, str]]:
    """"name:code name:code ..." as (name, code) pairs."""
    return [(name, code) for name, code in (item.split(":") for item in spec.split())]


LOCAL_HEADER = Layout(b"PK\x03\x04", _fields(
    "signature:I version:H flags:H method:H time:H date:H crc32:I compressed:I size:I name_length:H extra_length:H"
))
CENTRAL_HEADER = Layout(b"PK\x01\x02", _fields(
    "signature:I made_by:H version:H flags:H method:H time:H date:H crc32:I compressed:I size:I "
    "name_length:H extra_length:H comment_length:H disk:H internal:H external:I offset:I"
))
END = Layout(b"PK\x05\x06", _fields(
    "signature:I disk:H directory_disk:H disk_entries:H entries:H directory_size:I directory_offset:I "
    "comment_length:H"
))
ZIP64_END = Layout(b"PK\x06\x06", _fields(
    "signature:I record_size:Q made_by:H version:H disk:I directory_disk:I disk_entries:Q entries:Q "
    "directory_size:Q directory_offset:Q"
))
ZIP64_LOCATOR = Layout(b"PK\x06\x07", _fields("signature:I end_disk:I end_offset:Q disks:I"))
_LOCAL_HEADER_PACK = LOCAL_HEADER.struct.pack
_LOCAL_SIGNATURE = int.from_bytes(LOCAL_HEADER.signature, "little")
ZIP64_LOCAL_EXTRA = struct.Struct("<HHQQ")  # tag, length, size, compressed size
ZIP64_CENTRAL_EXTRA = np.dtype([("tag", "<u2"), ("length", "<u2"), ("size", "<u8"), ("compressed", "<u8"),
                                ("offset", "<u8")])


class LayoutError(ValueError):
    """The bytes are not the ZIP records they should be (the caller names the file)."""


# ---- writing ------------------------------------------------------------------------------------------------
def local_header(name: bytes, size: int, crc: int, extra: bytes = b"", limit: int = ZIP64_LIMIT) -> bytes:
    """The local header of a STORED member of ``size`` bytes, a ZIP64 extra field first when ``size`` needs it."""
    wide = size >= limit
    if wide:
        extra = ZIP64_LOCAL_EXTRA.pack(ZIP64_TAG, 16, size, size) + extra
    stored_size = ZIP64_LIMIT if wide else size
    return _LOCAL_HEADER_PACK(  # positionally: this runs once per sample
        _LOCAL_SIGNATURE, VERSION_ZIP64 if wide else VERSION, 0, STORED, DOS_TIME, DOS_DATE, crc,
        stored_size, stored_size, len(name), len(extra),
    ) + name + extra


def local_header_size(name_length: int, size: np.ndarray, limit: int = ZIP64_LIMIT) -> np.ndarray:
    """The bytes of the local headers ``local_header`` writes for members of ``size`` bytes with names of
    ``name_length`` bytes and no other extra field (the ZIP64 one where the size needs it)."""
    return LOCAL_HEADER.size + name_length + np.where(size >= limit, ZIP64_LOCAL_EXTRA.size, 0)


def padding(start: int, alignment: int) -> bytes:
    """An extra field that moves ``start`` (where the extra fields would end without it) to a multiple of
    ``alignment``; empty when it is one already."""
    missing = -start % alignment
    if missing == 0:
        return b""
    while missing < PADDING_MIN:
        missing += alignment
    return struct.pack("<HHH", PADDING_TAG, missing - 4, alignment) + bytes(missing - PADDING_MIN)


def central_headers(names: np.ndarray, crc: np.ndarray, size: np.ndarray, offset: np.ndarray,
                    limit: int = ZIP64_LIMIT) -> List[np.ndarray]:
    """Central directory entries of STORED members as structured arrays (write their bytes in order).

    ``names`` is a fixed-width bytes array; members whose size or local header
    offset reaches ``limit`` get a ZIP64 extra field with all three values.
    """
    wide = (size >= limit) | (offset >= limit)
    breaks = np.flatnonzero(np.diff(wide.astype(np.int8))) + 1
    runs = zip(np.concatenate(([0], breaks)), np.concatenate((breaks, [len(names)])))
    return [_central_run(names[a:b], crc[a:b], size[a:b], offset[a:b], bool(wide[a])) for a, b in runs if b > a]


def _central_run(names: np.ndarray, crc: np.ndarray, size: np.ndarray, offset: np.ndarray, wide: bool) -> np.ndarray:
    """Entries that all have the same name length and all (or none) a ZIP64 field."""
    fields = [("header", CENTRAL_HEADER.dtype), ("name", names.dtype)]
    if wide:
        fields.append(("zip64", ZIP64_CENTRAL_EXTRA))
    entries = np.zeros(len(names), dtype=fields)
    header = entries["header"]
    version = VERSION_ZIP64 if wide else VERSION
    header["signature"] = int.from_bytes(CENTRAL_HEADER.signature, "little")
    header["made_by"], header["version"], header["method"] = MADE_ON_UNIX | version, version, STORED
    header["time"], header["date"], header["external"] = DOS_TIME, DOS_DATE, FILE_ATTRIBUTES
    header["crc32"], header["name_length"] = crc, names.dtype.itemsize
    if wide:
        header["compressed"] = header["size"] = header["offset"] = ZIP64_LIMIT
        header["extra_length"] = ZIP64_CENTRAL_EXTRA.itemsize
        zip64 = entries["zip64"]
        zip64["tag"], zip64["length"] = ZIP64_TAG, ZIP64_CENTRAL_EXTRA.itemsize - 4
        zip64["size"] = zip64["compressed"] = size
        zip64["offset"] = offset
    else:
        header["compressed"] = header["size"] = size
        header["offset"] = offset
    entries["name"] = names
    return entries


def end_records(entries: int, directory_offset: int, directory_size: int, comment: bytes,
                limit: int = ZIP64_LIMIT) -> bytes:
    """What follows the central directory: the ZIP64 end record and its locator when needed, then the end record."""
    if len(comment) > MAX_COMMENT:
        raise ValueError(f"a ZIP comment holds at most {MAX_COMMENT} bytes, not {len(comment)}")
    wide = entries >= MAX_ENTRIES or directory_offset >= limit or directory_size >= limit
    records = b""
    if wide:
        end64_offset = directory_offset + directory_size
        records = ZIP64_END.pack(
            record_size=ZIP64_END.size - 12, made_by=MADE_ON_UNIX | VERSION_ZIP64, version=VERSION_ZIP64,
            disk_entries=entries, entries=entries, directory_size=directory_size, directory_offset=directory_offset,
        ) + ZIP64_LOCATOR.pack(end_offset=end64_offset, disks=1)
    count = min(entries, MAX_ENTRIES)
    return records + END.pack(
        disk_entries=count, entries=count,
        directory_size=ZIP64_LIMIT if directory_size >= limit else directory_size,
        directory_offset=ZIP64_LIMIT if directory_offset >= limit else directory_offset,
        comment_length=len(comment),
    ) + comment


# ---- reading ------------------------------------------------------------------------------------------------
class End(NamedTuple):
    """Where the central directory lies, from the end record (and the ZIP64 end record when there is one)."""

    position: int  # of the end record
    entries: int
    directory_offset: int
    directory_size: int
    directory_end: int  # where the central directory must end: the ZIP64 end record, else the end record
    comment: bytes


TAIL = END.size + MAX_COMMENT  # the end record lies in the file's last TAIL bytes


def find_end(tail: bytes, file_size: int) -> Optional[End]:
    """The end record closing a file of ``file_size`` bytes whose last bytes are ``tail`` (its 32-bit
    values: see ``with_zip64``), or None when no end record's comment reaches exactly the end of the file."""
    start = file_size - len(tail)
    at = tail.rfind(END.signature)
    while at >= 0:
        fields = END.unpack(tail, at)
        if fields is not None and at + END.size + fields["comment_length"] == len(tail):
            return End(start + at, fields["entries"], fields["directory_offset"], fields["directory_size"],
                       start + at, tail[at + END.size :])
        at = tail.rfind(END.signature, 0, at)
    return None


def with_zip64(tail: bytes, file_size: int, end: End) -> End:
    """``end`` with the values of the ZIP64 end record that precedes it, when there is one.

    Raises:
        LayoutError: the ZIP64 records are missing or not where they should be.
    """
    start = file_size - len(tail)
    locator = ZIP64_LOCATOR.unpack(tail, end.position - start - ZIP64_LOCATOR.size)
    if locator is None:
        if ZIP64_LIMIT in (end.directory_offset, end.directory_size):
            raise LayoutError("the end record asks for a ZIP64 end record that is not there")
        return end
    record_at = locator["end_offset"]
    record = ZIP64_END.unpack(tail, record_at - start)
    if record is None or record_at + ZIP64_END.size + ZIP64_LOCATOR.size != end.position:
        raise LayoutError("the ZIP64 end record is missing or not where its locator says")
    return end._replace(entries=record["entries"], directory_offset=record["directory_offset"],
                        directory_size=record["directory_size"], directory_end=record_at)


def end_overhangs(tail: bytes) -> Optional[bool]:
    """For a tail that ``find_end`` found no end record in: True when an end record with our locator
    runs past the end of the file (truncated), False when bytes follow it, None when there is none."""
    at = tail.rfind(LOCATOR_MAGIC)
    while at >= END.size:
        fields = END.unpack(tail, at - END.size)
        if fields is not None:
            return at + fields["comment_length"] > len(tail)
        at = tail.rfind(LOCATOR_MAGIC, 0, at)
    return None


class LocalHeader(NamedTuple):
    name: bytes
    method: int
    crc32: int
    size: int
    data: int  # where the member's bytes start
    compressed: int  # its compressed size (a STORED member's is its size)


def parse_local_header(data: bytes, offset: int) -> LocalHeader:
    """The local header at ``offset`` of a file whose bytes from ``offset`` on are ``data``.

    Raises:
        LayoutError: no local header there, or its ZIP64 field is missing.
    """
    fields = LOCAL_HEADER.unpack(data)
    if fields is None:
        raise LayoutError(f"no ZIP local header at byte {offset}")
    name_end = LOCAL_HEADER.size + fields["name_length"]
    extra_end = name_end + fields["extra_length"]
    if len(data) < extra_end:
        raise LayoutError(f"the ZIP local header at byte {offset} is cut short")
    sizes = widen((fields["size"], fields["compressed"]), data[name_end:extra_end])
    if sizes is None:
        raise LayoutError(f"the ZIP local header at byte {offset} has no ZIP64 size")
    size, compressed = sizes
    return LocalHeader(data[LOCAL_HEADER.size : name_end], fields["method"], fields["crc32"], size, offset + extra_end,
                       compressed)


def widen(values: Sequence[int], extra: bytes) -> Optional[Tuple[int, ...]]:
    """A member's ``values`` (size, compressed size, then, in the central directory, its local header
    offset), each one that is ZIP64_LIMIT replaced, in turn, by the next value of the ZIP64 field among
    the extra fields ``extra``; None when that field is missing or holds too few values."""
    wanted = sum(value == ZIP64_LIMIT for value in values)
    if not wanted:
        return tuple(values)
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if tag == ZIP64_TAG and length >= 8 * wanted and at + 4 + length <= len(extra):
            wide = iter(struct.unpack_from(f"<{wanted}Q", extra, at + 4))
            return tuple(next(wide) if value == ZIP64_LIMIT else value for value in values)
        at += 4 + length
    return None


class CentralEntries(NamedTuple):
    """Consecutive central directory entries as columns, their ZIP64 values filled in."""

    at: np.ndarray  # int64: where each entry starts
    header: np.ndarray  # CENTRAL_HEADER.dtype, as stored
    name: np.ndarray  # fixed-width bytes
    size: np.ndarray  # size, compressed size and local header offset: int64, with the ZIP64 field's
    compressed: np.ndarray  # values where the entry's are ZIP64_LIMIT (left so when it has no such field)
    offset: np.ndarray
    end: int  # where the entry after the last one starts (or would: bytes there may be no entry)


_RUN_FIRST, _RUN_MOST = 64, 1 << 14  # entries viewed at a time: at first after a change of length, at most
_WIDE_VALUES = ("size", "compressed", "offset")  # a central directory entry's values a ZIP64 field holds, in order


def read_central_entries(data: np.ndarray, at: int, count: int) -> CentralEntries:
    """Up to ``count`` central directory entries from byte ``at`` of ``data`` (a file's bytes, uint8,
    up to the end of its central directory); fewer when bytes that are not an entry come first.

    Entries are read a run of equally long ones at a time (ours are one or two runs: entries
    get a ZIP64 field from some offset on), each run one structured view of the bytes, checked
    to hold entries as long as its first; only ZIP64 fields laid out otherwise than ours are
    read one entry at a time.
    """
    runs, step = [], _RUN_FIRST
    while count > 0:
        first = CENTRAL_HEADER.unpack(bytes(data[at : at + CENTRAL_HEADER.size]))
        if first is None:
            break
        shape = first["name_length"], first["extra_length"], first["comment_length"]
        dtype = _central_entry(*shape)
        take = min(count, step, (len(data) - at) // dtype.itemsize)
        if take == 0:
            break
        header = data[at : at + take * dtype.itemsize].view(dtype)["header"]
        same = header["signature"] == int.from_bytes(CENTRAL_HEADER.signature, "little")
        for field, length in zip(("name_length", "extra_length", "comment_length"), shape):
            same &= header[field] == length
        taken = take if same.all() else int(np.argmin(same))
        runs.append(_central_columns(data, at, data[at : at + taken * dtype.itemsize].view(dtype), shape[0]))
        at, count = at + taken * dtype.itemsize, count - taken
        step = min(2 * step, _RUN_MOST) if taken == take else _RUN_FIRST
    if not runs:
        empty = np.zeros(0, np.int64)
        runs.append((empty, np.zeros(0, CENTRAL_HEADER.dtype), np.zeros(0, "S1"), empty, empty, empty))
    starts, header, name, size, compressed, offset = (np.concatenate(column) for column in zip(*runs))
    return CentralEntries(starts, header, name, size, compressed, offset, at)


def _central_entry(name_length: int, extra_length: int, comment_length: int) -> np.dtype:
    """A central directory entry with a name, extra fields and comment of these lengths, with a view
    of its first extra field as our ZIP64 field when there is room for one."""
    fields = {"header": (CENTRAL_HEADER.dtype, 0)}
    if name_length:
        fields["name"] = (np.dtype(f"S{name_length}"), CENTRAL_HEADER.size)
    if extra_length >= ZIP64_CENTRAL_EXTRA.itemsize:
        fields["zip64"] = (ZIP64_CENTRAL_EXTRA, CENTRAL_HEADER.size + name_length)
    size = CENTRAL_HEADER.size + name_length + extra_length + comment_length
    return np.dtype({"names": list(fields), "formats": [f for f, _ in fields.values()],
                     "offsets": [o for _, o in fields.values()], "itemsize": size})


def _central_columns(data: np.ndarray, at: int, entries: np.ndarray, name_length: int) -> Tuple[np.ndarray, ...]:
    """The columns of CentralEntries (but ``end``) for a run of equally long entries starting at byte ``at``."""
    header, count = entries["header"], len(entries)
    starts = at + np.arange(count, dtype=np.int64) * entries.dtype.itemsize
    names = entries["name"] if name_length else np.zeros(count, "S1")
    values = np.stack([header[field].astype(np.int64) for field in _WIDE_VALUES])
    wide = (values == ZIP64_LIMIT).any(axis=0)
    if wide.any():
        ours = np.zeros(count, bool)  # the ZIP64 field the writer writes: first, holding all three
        if "zip64" in (entries.dtype.names or ()):
            zip64 = entries["zip64"]
            ours = (values == ZIP64_LIMIT).all(axis=0) & (zip64["tag"] == ZIP64_TAG)
            ours &= zip64["length"] >= ZIP64_CENTRAL_EXTRA.itemsize - 4
            values[:, ours] = np.stack([zip64[field][ours] for field in _WIDE_VALUES])
        extra_at = CENTRAL_HEADER.size + name_length
        for j in np.flatnonzero(wide & ~ours):  # any other layout, one entry at a time
            extra = bytes(data[starts[j] + extra_at : starts[j] + extra_at + header["extra_length"][j]])
            values[:, j] = widen(values[:, j].tolist(), extra) or values[:, j]
    return starts, header, names, values[0], values[1], values[2]


# ---- the locator: our end record's comment ----------------------------------------------------------------
LOCATOR_MAGIC = b"packed_formats zip locator 1 "


class Place(NamedTuple):
    """A member: where its local header starts, where its bytes start, how many there are."""

    header: int
    data: int
    size: int


class Locator(NamedTuple):
    """Where our metadata members lie, and the local headers of the first and last sample."""

    members: Dict[str, Place]  # manifest.json and index/<name>.npy
    samples: Tuple[int, ...]  # local header offsets of sample 0 and sample N-1 (empty without samples)

    def encode(self) -> bytes:
        """The comment: magic, the CRC32 of the JSON as 8 hex digits, a space, compact JSON."""
        text = json.dumps({"members": {k: list(v) for k, v in self.members.items()},
                           "samples": list(self.samples)}, separators=(",", ":"), sort_keys=True).encode()
        return LOCATOR_MAGIC + b"%08x " % zlib.crc32(text) + text

    @staticmethod
    def marks(comment: bytes) -> bool:
        return comment.startswith(LOCATOR_MAGIC)

    @classmethod
    def decode(cls, comment: bytes) -> "Locator":
        """The locator in an end record's comment (one that ``marks`` says is ours).

        Raises:
            LayoutError: it is damaged (checksum, JSON or values).
        """
        body = comment[len(LOCATOR_MAGIC) :]
        checksum, text = body[:8], body[9:]
        try:
            if body[8:9] != b" " or int(checksum, 16) != zlib.crc32(text):
                raise ValueError("its checksum does not match")
            data = json.loads(text)
            members = {str(name): Place(*(_count(v) for v in place)) for name, place in data["members"].items()}
            samples = tuple(_count(v) for v in data["samples"])
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise LayoutError(f"the archive's locator is damaged ({exc})") from None
        if len(samples) not in (0, 2):
            raise LayoutError("the archive's locator is damaged (it must name two sample headers or none)")
        return cls(members, samples)


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a byte count")
    return value

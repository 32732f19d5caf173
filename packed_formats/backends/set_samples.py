"""A set's sample index: every sample's label, key and CRC32s, and each part's count, in one file.

A sharded conversion, a join and ``upload`` write it beside the set's parts as ``<stem>-samples.npz``
(an uncompressed .npz of ``SAMPLE_FIELDS`` only, byte for byte the same for the same parts), and the
set's index records its name, size and CRC32 and the set's manifest, sealed with the rest of the
index.  A set copied into a store by any tool then opens there without fetching a part
(``storage.remote_set``).  A local reader reads the parts' own indexes, never this file.

The file is untrusted like any other: ``npz_arrays`` reads only its known fields, stored and without
pickle, and ``check_sample_index`` compares every field with what the parts hold; a field the parts
have and the file leaves out is refused, never skipped.
"""

from __future__ import annotations

import io
import os
import zipfile
import zlib
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..errors import CorruptArchiveError
from .sharded import index_text, read_shard_index

SAMPLES_SUFFIX = "-samples.npz"
# its arrays: nothing else is read or written (field_crc32: one row of CRC32s a field of the manifest;
# widths and heights: the images' sizes, where the parts record them)
SAMPLE_FIELDS = ("labels", "keys", "crc32", "counts", "field_crc32", "widths", "heights")
REWRITE_HINT = "write it again: join the set again, or convert it again"


def samples_name(index_name: str) -> str:
    """The sample index's file name beside the set's index ``index_name`` (train.zip -> train-samples.npz)."""
    return f"{os.path.splitext(index_name)[0]}{SAMPLES_SUFFIX}"


def sample_index(index_path: str, name: str) -> Tuple[bytes, str]:
    """The sample index of the set whose index is at ``index_path`` (its parts beside it), built from
    the parts, and the text of the set's index sealed again over its record of it: ``name`` (the file
    name it is to have beside the index), its size and CRC32, and the set's manifest.

    Raises:
        PackedFormatError: the set does not open (its parts disagree with each other or the index).
    """
    from . import open_local

    index = read_shard_index(index_path)
    with open_local(index_path, verify=False) as reader:
        data = npz_bytes(sample_arrays(reader))
        manifest_text = reader.manifest.to_json()
    text = index_text(index["format"], list(zip(index["names"], index["counts"], index["contents"])),
                      index["set_id"], samples={"name": name, "size": len(data), "crc32": zlib.crc32(data)},
                      manifest=manifest_text)
    return data, text


def sample_arrays(reader: Any) -> Dict[str, np.ndarray]:
    """The sample index's arrays of the open set ``reader`` (a Reader of a sharded set)."""
    arrays: Dict[str, np.ndarray] = {
        "labels": np.asarray(reader.index.labels, dtype=np.int64),
        "keys": _plain(np.asarray(reader.index.keys)),
        "counts": np.asarray([len(p) for p in reader.backend.parts], dtype=np.int64),
    }
    if reader.index.crc32 is not None:
        arrays["crc32"] = np.asarray(reader.index.crc32, dtype=np.uint32)
    if reader.index.widths is not None and reader.index.heights is not None:
        arrays["widths"] = np.asarray(reader.index.widths, dtype=np.int32)
        arrays["heights"] = np.asarray(reader.index.heights, dtype=np.int32)
    rows = reader.index.field_crc32s([spec.name for spec in reader.fields])
    if reader.fields and rows is not None:  # each field's CRC32s, a row a field
        arrays["field_crc32"] = np.stack([np.asarray(row, dtype=np.uint32) for row in rows])
    return arrays


def _plain(keys: np.ndarray) -> np.ndarray:
    """Keys as a plain fixed-width bytes array (HDF5's carry dtype metadata that .npy cannot keep)."""
    return keys.astype(f"S{max(1, keys.dtype.itemsize)}") if keys.dtype.kind == "S" else keys


def npz_bytes(arrays: Dict[str, np.ndarray]) -> bytes:
    """``arrays`` as the bytes of an uncompressed .npz that ``numpy.load`` reads, the same bytes for the same
    arrays (``numpy.savez`` stamps each member with the time it is written)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name in sorted(arrays):
            assert name in SAMPLE_FIELDS, name
            member = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with archive.open(member, "w", force_zip64=True) as file:
                np.lib.format.write_array(file, np.ascontiguousarray(arrays[name]), allow_pickle=False)
    return buffer.getvalue()


def npz_arrays(where: str, data: bytes, hint: str = REWRITE_HINT) -> Dict[str, np.ndarray]:
    """The arrays of a sample index's .npz bytes: only SAMPLE_FIELDS, stored (not compressed), no pickle
    (CorruptArchiveError naming ``where``, the file or URL, and the field otherwise)."""
    try:
        npz = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes are, they are not a sample index
        raise CorruptArchiveError(where, f"the sample index is not an .npz file ({type(exc).__name__}: {exc})",
                                  hint=hint) from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise CorruptArchiveError(where, "the sample index is a single array, not an .npz file of named arrays",
                                  hint=hint)
    arrays = {}
    with npz:
        for member in npz.zip.infolist() if npz.zip is not None else ():
            name = member.filename[:-4] if member.filename.endswith(".npy") else member.filename
            if name not in SAMPLE_FIELDS:
                raise CorruptArchiveError(where, f"the sample index holds a field {member.filename!r}; it may hold "
                                                 f"only {', '.join(SAMPLE_FIELDS)}", hint=hint)
            if member.compress_type != zipfile.ZIP_STORED:
                raise CorruptArchiveError(where, f"the sample index's field {name!r} is compressed (it is stored "
                                                 "as is)", hint=hint)
            try:
                arrays[name] = npz[name]
            except Exception as exc:  # noqa: BLE001 - a pickled array, a damaged header...
                raise CorruptArchiveError(where, f"the sample index's field {name!r} cannot be read ("
                                                 f"{type(exc).__name__}: {exc})", hint=hint) from None
    return arrays


def recorded_samples(index_path: str) -> Optional[Dict[str, Any]]:
    """The record (name, size, CRC32) of the sample index that the set's index at ``index_path`` keeps
    beside it; None when it records none (CorruptArchiveError naming the field when it is not valid:
    its name must be a plain file name beside the index)."""
    import json

    with open(index_path, "rb") as file:
        record = json.loads(file.read()).get("samples")
    if record is None:
        return None
    checks = {"name": lambda v: isinstance(v, str) and 0 < len(v) <= 255 and v not in (".", "..")
              and "/" not in v and "\\" not in v and "\0" not in v,
              "size": lambda v: type(v) is int and v >= 0,
              "crc32": lambda v: type(v) is int and 0 <= v < 1 << 32}
    for field, valid in checks.items():
        value = record.get(field) if isinstance(record, dict) else None
        if not valid(value):
            raise CorruptArchiveError(index_path, f"the set's index records its sample index's {field} as "
                                                  f"{value!r}, which is not valid", hint=REWRITE_HINT)
    return record


def check_sample_index(index_path: str) -> Optional[Tuple[str, bytes]]:
    """Check the sample index that the set's index at ``index_path`` records against the set's parts:
    its size and CRC32 as recorded, and each of its fields equal to the parts' (a field the parts hold
    must be there, and no other).  Returns its path and bytes (None when the index records none).

    Raises:
        CorruptArchiveError: the file is missing, damaged or disagrees with the parts (naming the file
            and the field).
    """
    from . import open_local

    record = recorded_samples(index_path)
    if record is None:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(index_path)), record["name"])
    try:
        with open(path, "rb") as file:
            data = file.read(record["size"] + 1)
    except OSError as exc:
        raise CorruptArchiveError(path, f"the set's sample index cannot be read ({exc.strerror or exc})",
                                  hint=REWRITE_HINT) from None
    if len(data) != record["size"] or zlib.crc32(data) != record["crc32"]:
        raise CorruptArchiveError(path, f"the set's sample index is not the one its index records (size "
                                        f"{len(data)}, CRC32 {zlib.crc32(data)}; recorded {record['size']}, "
                                        f"{record['crc32']})", hint=REWRITE_HINT)
    arrays = npz_arrays(path, data)
    with open_local(index_path, verify=False) as reader:
        expected = sample_arrays(reader)
    for field in SAMPLE_FIELDS:
        if (field in arrays) != (field in expected):
            problem = "is missing" if field in expected else "is there, but the parts hold no such field"
            raise CorruptArchiveError(path, f"the set's sample index's field {field!r} {problem}", hint=REWRITE_HINT)
        if field in arrays:
            mine, theirs = arrays[field], expected[field]
            if mine.dtype != theirs.dtype or mine.shape != theirs.shape or not np.array_equal(mine, theirs):
                raise CorruptArchiveError(path, f"the set's sample index's field {field!r} differs from what the "
                                                "set's parts hold", hint=REWRITE_HINT)
    return path, data

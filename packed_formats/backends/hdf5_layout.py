"""Where an HDF5 archive's manifest, index and samples lie in its file, found without HDF5's parser.

HDF5 trusts the metadata it parses: damage there (or a file made to look
sealed) can make it hang or crash the process, and no checksum a writer can
recompute makes its parser safe.  So readers never hand an archive to HDF5.
The writer stores a *locator* in the user block (``hdf5_guard``, under the
block's CRC32): for the manifest's stored text, each index array and the
encoded samples' chunk table, the byte span, dtype and (manifest, chunk table)
CRC32.  A reader reads those spans with plain reads and maps, each checked
against the file's size before it is touched; the index arrays are then checked
by the manifest's CRC32s, and samples by theirs.  Raw images lie at the index's
``positions``, encoded bytes in 64 KiB chunks at the chunk table's addresses.

Archives written before the locator (format versions 1-3 without it) are
described by HDF5 in a child process under a time limit (``probe``): a damaged
file then ends that child, not the reader, and becomes a CorruptArchiveError.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import struct
import subprocess
import sys
from typing import Any, Dict, Optional

import numpy as np

from ..checksum import crc32
from ..errors import CorruptArchiveError, IncompleteArchiveError, PackedFormatError, UnknownFormatError
from . import hdf5_guard, index_map

MAGIC = b"PFLOCAT1"
_HEAD = struct.Struct("<8sI")  # magic, number of entries
_ENTRY = struct.Struct("<16sQQI8s")  # name, offset, bytes, CRC32 (0: checked elsewhere), dtype
MAX_ENTRIES = (hdf5_guard.LOCATOR_ROOM - _HEAD.size) // _ENTRY.size
MANIFEST, CHUNKS, DATA = "manifest", "chunk_table", "data"  # DATA: offset = chunk bytes, bytes = stored bytes
FIELDS = "fields"  # the bundle of the samples' fields (hdf5_fields): its span, and its header's CRC32
MAX_MANIFEST = 64 << 20  # bytes: far above any real manifest (ImageNet-21k's class names take ~0.5 MiB)
PROBE_SECONDS = 10.0  # the child's time limit, plus one second per PROBE_BYTES_PER_SECOND of file
PROBE_BYTES_PER_SECOND = 256 << 20
_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hdf5_probe.py")
DAMAGED_HINT = hdf5_guard.DAMAGED_HINT


@dataclasses.dataclass(frozen=True)
class Entry:
    """One span of the file: ``nbytes`` bytes at ``offset`` holding ``dtype`` values (CRC32 0: unchecked here)."""

    offset: int
    nbytes: int
    crc32: int = 0
    dtype: str = "|u1"


@dataclasses.dataclass
class Layout:
    """What a reader needs of an archive's file: the manifest's text, the index arrays (mapped
    where they lie as plain bytes), and the flat sample dataset's chunk addresses (encoded; raw
    ones only when the index has no positions), its chunk size and stored bytes."""

    manifest: "str | bytes"
    arrays: Dict[str, np.ndarray]
    chunks: Optional[np.ndarray] = None
    chunk_bytes: int = 0
    data_nbytes: int = 0
    fields: Optional[Entry] = None  # where the fields' bundle lies (archives with fields)


def pack(entries: Dict[str, Entry]) -> bytes:
    """The locator of ``entries`` (at most ``MAX_ENTRIES``), as stored in the user block."""
    if len(entries) > MAX_ENTRIES:
        raise ValueError(f"{len(entries)} locator entries, at most {MAX_ENTRIES} fit")
    return _HEAD.pack(MAGIC, len(entries)) + b"".join(
        _ENTRY.pack(name.encode(), e.offset, e.nbytes, e.crc32, e.dtype.encode()) for name, e in entries.items()
    )


def unpack(path: str, raw: bytes) -> Optional[Dict[str, Entry]]:
    """The entries of the locator ``raw`` (a checked user block's room); None where none was written."""
    if raw[: len(MAGIC)] != MAGIC:
        if raw.strip(b"\0"):
            raise _damaged(path, "its HDF5 user block holds a locator this packed_formats does not know")
        return None
    count = _HEAD.unpack_from(raw)[1]
    if count > MAX_ENTRIES:
        raise _damaged(path, f"its locator lists {count} entries, at most {MAX_ENTRIES} fit")
    entries = {}
    for k in range(count):
        name, offset, nbytes, crc, dtype = _ENTRY.unpack_from(raw, _HEAD.size + k * _ENTRY.size)
        entries[name.rstrip(b"\0").decode("ascii", "replace")] = Entry(
            offset, nbytes, crc, dtype.rstrip(b"\0").decode("ascii", "replace"))
    return entries


def from_locator(path: str, fd: int, entries: Dict[str, Entry], array_names: tuple) -> Layout:
    """The layout the locator ``entries`` of the file open as ``fd`` describes, every span checked
    against the file's size (and the manifest's and chunk table's bytes against their CRC32).

    Raises:
        CorruptArchiveError: a span lies outside the file, a CRC32 or a dtype is wrong.
    """
    size = os.fstat(fd).st_size
    for name, entry in entries.items():
        outside = entry.offset < hdf5_guard.USERBLOCK or entry.offset + entry.nbytes > size
        if name != DATA and entry.nbytes and outside:
            raise _damaged(path, f"its locator puts {name!r} at bytes {entry.offset} to "
                                 f"{entry.offset + entry.nbytes}, outside the file ({size} bytes)")
    manifest = entries[MANIFEST]
    if manifest.nbytes > MAX_MANIFEST:
        raise _damaged(path, f"its locator gives the manifest {manifest.nbytes} bytes")
    text = _read_checked(path, fd, MANIFEST, manifest)
    where = {name: _array_at(path, name, entries[name]) for name in array_names if name in entries}
    try:
        arrays = index_map.map_arrays(fd, where)
    except (OSError, ValueError) as exc:
        raise _damaged(path, f"cannot map the archive index: {exc}") from None
    layout = Layout(text, arrays, fields=entries.get(FIELDS))
    if CHUNKS in entries:
        data = entries.get(DATA, Entry(0, 0))
        table = _read_checked(path, fd, CHUNKS, entries[CHUNKS])
        if entries[CHUNKS].nbytes % 8 or data.offset <= 0:
            raise _damaged(path, "its locator's chunk table is not one of 8-byte addresses of whole chunks")
        layout.chunks = np.frombuffer(table, dtype="<i8")
        layout.chunk_bytes, layout.data_nbytes = int(data.offset), int(data.nbytes)
    return layout


def _read_checked(path: str, fd: int, name: str, entry: Entry) -> bytes:
    data = os.pread(fd, entry.nbytes, entry.offset)
    if len(data) != entry.nbytes or crc32(data) != entry.crc32:
        raise _damaged(path, f"its {name.replace('_', ' ')} (bytes {entry.offset} to {entry.offset + entry.nbytes}) "
                             "does not match its checksum")
    return data


def _array_at(path: str, name: str, entry: Entry) -> index_map.ArrayAt:
    """Where the locator puts index array ``name``: a 1-D array of plain integers or fixed-width bytes."""
    try:
        dtype = np.dtype(entry.dtype)
    except (TypeError, ValueError, SyntaxError):
        dtype = None
    if dtype is None or dtype.kind not in "iuS" or not dtype.itemsize or entry.nbytes % dtype.itemsize:
        raise _damaged(path, f"its locator gives the index array {name!r} the layout {entry.dtype!r}, "
                             f"{entry.nbytes} bytes")
    return index_map.ArrayAt(entry.offset, dtype, (entry.nbytes // dtype.itemsize,))


def _damaged(path: str, problem: str) -> CorruptArchiveError:
    return CorruptArchiveError(path, problem, hint=DAMAGED_HINT)


# ---- archives without a locator: HDF5, in a child process --------------------------------------------------
def probe_seconds(size: int) -> float:
    """How long HDF5 may take to describe a file of ``size`` bytes (listing a million chunks takes ~1 s)."""
    return PROBE_SECONDS + size / PROBE_BYTES_PER_SECOND


def probe(path: str, fd: int, settings: Dict[str, Any]) -> Layout:
    """The layout of the archive open as ``fd`` at ``path``, as HDF5 describes it in a child process
    (``hdf5_probe``; ``settings`` names what it looks for), which a crash or a hang ends, not us.

    Raises:
        CorruptArchiveError: HDF5 crashed or did not answer in time (the file is damaged or
            crafted), or describes a damaged archive.
        IncompleteArchiveError: HDF5 cannot open the file, or it is ours but was never sealed.
        UnknownFormatError: an HDF5 file, but not a packed_formats archive.
    """
    seconds = probe_seconds(os.fstat(fd).st_size)
    # the probe runs as a script, not the package (no import of torch & co.); the working directory's
    # modules must not shadow h5py's (``-c`` puts it first on sys.path, unless Python runs with -P)
    code = ("import runpy, sys; getattr(sys.flags, 'safe_path', False) or sys.path.pop(0); sys.argv.pop(0); "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    try:
        done = subprocess.run([sys.executable, "-c", code, _PROBE, path, repr(settings)],
                              capture_output=True, timeout=seconds, check=False)
    except subprocess.TimeoutExpired:
        raise _refused(path, f"HDF5 did not answer within {seconds:.0f} s") from None
    except OSError as exc:
        raise CorruptArchiveError(path, f"cannot start a process to read its HDF5 metadata: {exc}") from None
    if done.returncode < 0:
        raise _refused(path, f"HDF5 crashed with signal {_signal_name(-done.returncode)}")
    try:
        found = pickle.loads(done.stdout) if done.returncode == 0 else None
    except Exception:  # what the child wrote is not its answer: it failed some other way
        found = None
    if not isinstance(found, dict):
        error = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"status {done.returncode}"]
        raise CorruptArchiveError(path, f"HDF5 failed to read its metadata: {error[0]}", hint=DAMAGED_HINT)
    return _layout_of(path, fd, found)


def _layout_of(path: str, fd: int, found: Dict[str, Any]) -> Layout:
    """The Layout of a probe's answer (plain values, checked here as any read bytes are)."""
    error = found.get("error")
    if error is not None:
        kind, problem = error
        raise _PROBE_ERRORS.get(kind, CorruptArchiveError)(path, problem, hint=_PROBE_HINTS.get(kind, DAMAGED_HINT))
    where, arrays = {}, {}
    for name, (how, value) in found["arrays"].items():
        if how == "at":
            offset, dtype, count = value
            where[name] = index_map.ArrayAt(int(offset), np.dtype(dtype), (int(count),))
        else:
            arrays[name] = np.asarray(value)
    try:
        arrays.update(index_map.map_arrays(fd, where))
    except (OSError, ValueError) as exc:
        raise _damaged(path, f"cannot map the archive index: {exc}") from None
    chunks = found.get("chunks")
    return Layout(found["manifest"], arrays, None if chunks is None else np.asarray(chunks, dtype=np.int64),
                  int(found.get("chunk_bytes", 0)), int(found.get("data_nbytes", 0)))


_PROBE_ERRORS = {"unsealed": IncompleteArchiveError, "unopenable": IncompleteArchiveError,
                 "foreign": UnknownFormatError, "layout": UnknownFormatError}
_PROBE_HINTS = {"unsealed": "its writer was killed or failed; re-create it",
                "unopenable": "the file is truncated, damaged or its writer was killed",
                "foreign": "convert it into one first: `packed-formats convert SRC DST`",
                "layout": "convert it into a new archive: `packed-formats convert SRC DST`"}


def _refused(path: str, what: str) -> PackedFormatError:
    return CorruptArchiveError(path, f"{what} reading its metadata: the file is damaged or crafted",
                               hint=DAMAGED_HINT)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)

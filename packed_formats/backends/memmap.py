"""memmap: a directory of plain .npy files plus manifest.json (written last).

``images.npy`` is uint8 [N,H,W,C] (raw) or ``data.npy`` a flat uint8 byte store
with ``offsets.npy`` (encoded); ``labels.npy``, ``keys.npy``, ``crc32.npy`` hold
the index.  Each field NAME of the samples is a flat uint8 ``field.NAME.npy``
with ``field.NAME.offsets.npy`` and ``field.NAME.crc32.npy`` in the index.
Every file opens with ``numpy.load(..., mmap_mode="r")``.  Readers map the data
per process and pickle as their path, never their pages.  The index files are
mapped too, when the metadata is read, so no process holds a private copy of
the index; as with any map, an index file truncated in place
under a reader would end it with SIGBUS (archives are replaced whole, never
rewritten: the sample data's size is checked before each read).
"""

from __future__ import annotations

import mmap
import os
from typing import BinaryIO, Dict, List, Optional, Tuple

import numpy as np

from ..errors import (
    ArchiveChangedError,
    ArchivePermissionError,
    CorruptArchiveError,
    IncompleteArchiveError,
    UnknownFormatError,
)
from ..fields import field_arrays
from ..index import SampleIndex
from ..manifest import ArchiveManifest
from . import index_map, mapped
from .base import Backend, FormatSpec, Handle
from .writer import Writer

MANIFEST = "manifest.json"
_HEADER_BYTES = 128  # reserved .npy header, rewritten with the final shape at close
_INDEX_NAMES = ("labels", "keys", "crc32", "offsets", "widths", "heights")


def data_file_name(mode: str) -> str:
    return "images.npy" if mode == "raw" else "data.npy"


def field_file_name(name: str) -> str:
    return f"field.{name}.npy"


def _npy_header(shape: Tuple[int, ...]) -> bytes:
    """A version 1.0 .npy header for uint8 C-order data, padded to _HEADER_BYTES."""
    text = "{'descr': '|u1', 'fortran_order': False, 'shape': %r, }" % (tuple(shape),)
    room = _HEADER_BYTES - 10 - 1
    if len(text) > room:
        raise ValueError(f"shape {shape} does not fit the reserved .npy header")
    body = text.ljust(room) + "\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin1")


def _read_npy_header(file: BinaryIO) -> Tuple[Tuple[int, ...], bool, np.dtype, int]:
    """(shape, Fortran order, dtype, data offset) of the .npy file open at its start: parsed once for
    each distinct header (``index_map.npy_layout``; the parts of a sharded set share a few), numpy's
    own parse where that declines (Fortran order, objects, damage), for its precise error."""
    layout = index_map.npy_layout(file.read)
    if layout is not None:
        offset, dtype, shape = layout
        return shape, False, dtype, offset
    file.seek(0)
    version = np.lib.format.read_magic(file)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read_header(file)
    return shape, fortran, dtype, file.tell()


class MappedNpy(Handle):
    """A read-only memory map of one .npy file and the array over it (memmap's per-process handle)."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as file:
            shape, fortran, dtype, offset = _read_npy_header(file)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            st = os.fstat(file.fileno())
            self.identity, size = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), st.st_size
            if size < offset + nbytes:
                raise CorruptArchiveError(path, f"the file is truncated ({size} bytes, needs {offset + nbytes})")
            self.map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        if fortran or dtype != np.uint8:
            raise CorruptArchiveError(path, f"expected C-order uint8 data, found {dtype} fortran={fortran}")
        buffer = self.map if self.map is not None else b""
        self.array: Optional[np.ndarray] = np.frombuffer(buffer, dtype=np.uint8, count=nbytes, offset=offset).reshape(
            shape
        )
        self.fields: Dict[str, "MappedNpy"] = {}  # the field files this process has mapped, by field name
        self.rows: Optional[mapped.MappedRows] = None  # raw images as rows of the map, for batch gathers
        if self.map is not None and len(shape) == 4:
            row_bytes = int(np.prod(shape[1:], dtype=np.int64))
            self.rows = mapped.MappedRows(self.map, row_bytes, start=offset, count=int(shape[0]))

    def check_size(self) -> None:
        """FileTruncatedError when the file no longer holds what is mapped (reading it would SIGBUS)."""
        if self.map is not None and self.map.size() < len(self.map):
            raise mapped.FileTruncatedError(f"the file was truncated to {self.map.size()} bytes while mapped")

    def close(self) -> None:
        for field in self.fields.values():
            field.close()
        self.fields = {}
        self.array = None
        if self.rows is not None:
            self.rows.close()  # and the map under them
        elif self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a view is still alive somewhere; unmapped when it dies
                pass
        self.rows = None


class MemmapWriter(Writer):
    format_name = "memmap"
    stores_fields = True

    def begin(self, temp_path: str) -> None:
        os.mkdir(temp_path)
        self._data_path = os.path.join(temp_path, data_file_name(self.mode))
        self._file = open(self._data_path, "wb")
        self._file.write(b"\0" * _HEADER_BYTES)
        self._bytes = 0
        self._field_files: Dict[str, BinaryIO] = {}
        self._field_bytes: Dict[str, int] = {}
        for spec in self.fields:
            self._field_files[spec.name] = open(os.path.join(temp_path, field_file_name(spec.name)), "wb")
            self._field_files[spec.name].write(b"\0" * _HEADER_BYTES)
            self._field_bytes[spec.name] = 0

    def append(self, blob: bytes, i: int, crc: int) -> int:
        self._file.write(blob)
        self._bytes += len(blob)
        return -1

    def append_field(self, name: str, blob: bytes, i: int, crc: int) -> int:
        self._field_files[name].write(blob)
        self._field_bytes[name] += len(blob)
        return -1

    def finish(self, index: SampleIndex, manifest: ArchiveManifest) -> None:
        shape = (len(index),) + self.stored_shape if self.mode == "raw" else (self._bytes,)
        self._file.seek(0)
        self._file.write(_npy_header(shape))
        self._file.close()
        for name, file in self._field_files.items():
            file.seek(0)
            file.write(_npy_header((self._field_bytes[name],)))
            file.close()
        for name, array in index.arrays().items():
            np.save(os.path.join(self.temp_path, f"{name}.npy"), array, allow_pickle=False)
        with open(os.path.join(self.temp_path, MANIFEST), "w") as seal:  # the seal, last
            seal.write(manifest.to_json())

    def discard(self) -> None:
        for file in [self._file, *getattr(self, "_field_files", {}).values()]:
            try:
                file.close()
            except Exception:
                pass


class MemmapBackend(Backend[MappedNpy]):
    format_name = "memmap"

    @classmethod
    def read_metadata(cls, path: str) -> Tuple[ArchiveManifest, SampleIndex]:
        _check_folder(path)
        manifest_path = os.path.join(path, MANIFEST)
        if not _present(path, manifest_path):
            if any(os.path.exists(os.path.join(path, data_file_name(m))) for m in ("raw", "encoded")):
                raise IncompleteArchiveError(path, "no manifest.json: the archive was never sealed")
            raise UnknownFormatError(path, "not a packed_formats memmap archive (no manifest.json)")
        try:
            with open(manifest_path, "rb") as file:  # bytes: from_json reads them without a decoded copy
                manifest = ArchiveManifest.from_json(file.read(), path=path)
            arrays = {}
            for name in _INDEX_NAMES + tuple(field_arrays(manifest.fields)):
                array_path = os.path.join(path, f"{name}.npy")
                if os.path.exists(array_path):
                    arrays[name] = _load_mapped(array_path)
        except PermissionError as exc:
            raise ArchivePermissionError.denied(path, exc.filename) from None
        except (OSError, ValueError) as exc:
            raise CorruptArchiveError(path, f"cannot read the archive index: {exc}") from None
        data = _map_data(path, manifest.mode)  # the data file is checked now, in this process
        try:
            _check_stored_shape(path, manifest, data)
        finally:
            data.close()
        return manifest, SampleIndex.from_arrays(arrays, field_arrays(manifest.fields))

    def data_file(self) -> str:
        return os.path.join(self.path, data_file_name(self.manifest.mode))

    def files(self) -> List[str]:
        names = [MANIFEST, data_file_name(self.manifest.mode)] + [f"{n}.npy" for n in self.index.arrays()]
        names += [field_file_name(spec.name) for spec in self.manifest.fields]
        return [os.path.join(self.path, n) for n in names]

    def open(self) -> MappedNpy:
        _check_folder(self.path)
        data = _map_data(self.path, self.manifest.mode)
        if self.identity not in (None, data.identity):  # replaced between the check and the open
            data.close()
            raise ArchiveChangedError(self.path, "the archive was replaced or modified after it was opened")
        return data

    def read(self, handle: MappedNpy, i: int) -> np.ndarray:
        handle.check_size()
        array = _array(handle)
        if self.manifest.mode == "raw":
            return array[i].reshape(-1)
        return array[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def read_field(self, handle: MappedNpy, name: str, i: int) -> np.ndarray:
        field = handle.fields.get(name)
        if field is None:
            field = handle.fields[name] = _map_file(self.path, field_file_name(name))
        field.check_size()
        values = _array(field)
        start, size = self.index.field_bytes(name, i)
        if size < 0 or start < 0 or start + size > len(values):
            raise self.corrupt(f"field {name!r}: bytes {start}:{start + size} lie outside its {len(values)}", i)
        return values[start : start + size]

    def rows_of(self, handle: MappedNpy) -> Optional[mapped.MappedRows]:
        return handle.rows

    def read_batch(self, handle: MappedNpy, idx: np.ndarray, out: np.ndarray) -> None:
        if handle.rows is None or not out.flags.c_contiguous:
            handle.check_size()
            out[...] = _array(handle)[idx]
            return
        handle.rows.gather(idx, out)  # one gather from the map: see mapped.py

    def sample_location(self, i: int) -> Tuple[str, int]:
        data = np.load(self.data_file(), mmap_mode="r")
        start = i * self.sample_nbytes if self.manifest.mode == "raw" else int(self.offsets[i])
        return self.data_file(), int(data.offset) + start


def _check_stored_shape(path: str, manifest: ArchiveManifest, data: MappedNpy) -> None:
    """CorruptArchiveError when the raw images' .npy array says its samples are of another shape than the
    manifest's stored shape: a planar archive whose manifest lost its layout (or an interleaved one that
    claims one) is never read with its channels taken for rows."""
    shape = None if data.array is None else data.array.shape
    if manifest.mode != "raw" or shape is None or len(shape) != 4 or tuple(shape[1:]) == manifest.stored_shape:
        return
    raise CorruptArchiveError(
        path, f"{data_file_name('raw')} holds samples of shape {tuple(shape[1:])}, but the manifest's raw_layout "
              f"{manifest.raw_layout!r} stores {manifest.shape} (HxWxC) images as {manifest.stored_shape}",
        hint="the manifest was damaged or edited: re-create the archive from its source")


def _load_mapped(path: str) -> np.ndarray:
    """An index .npy file as a read-only map: its pages are the file's, shared by every process,
    never a private copy in each.  Mapped as ``numpy.load(path, mmap_mode="r")`` would, but
    through ``index_map``, whose maps keep no file descriptor where Python allows (3.13+)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        layout = index_map.npy_layout(lambda n: os.pread(fd, n, 0))
        at = None if layout is None else index_map.ArrayAt(*layout)  # the data follows the header
        if at is not None and at.aligned():
            return index_map.map_arrays(fd, {"array": at})["array"]
    except ValueError:  # a truncated file: mapping it would be SIGBUS, reading it says what is wrong
        pass
    finally:
        os.close(fd)
    return np.load(path, allow_pickle=False)


def _check_folder(path: str) -> None:
    """Raise unless ``path`` is a folder: ArchiveNotFoundError, or ArchivePermissionError naming the
    folder on the way to it that this user may not search (where that is why it cannot be found)."""
    if os.path.isdir(path):
        return
    from . import not_found  # here: the registry imports this module

    raise not_found(path, "no such directory")


def _present(path: str, file: str) -> bool:
    """Whether ``file`` of the archive folder ``path`` exists (ArchivePermissionError naming the
    folder where this user may not search it: the file may be there, unseen)."""
    try:
        os.stat(file)
    except PermissionError:
        from . import folder_denied

        raise folder_denied(path, path) from None
    except OSError:
        return False
    return True


def _array(handle: MappedNpy) -> np.ndarray:
    if handle.array is None:
        raise ArchiveChangedError(None, "the archive's map was closed")
    return handle.array


def _map_data(path: str, mode: str) -> MappedNpy:
    return _map_file(path, data_file_name(mode))


def _map_file(path: str, name: str) -> MappedNpy:
    """The archive ``path``'s uint8 .npy file ``name``, mapped."""
    try:
        return MappedNpy(os.path.join(path, name))
    except FileNotFoundError:
        raise CorruptArchiveError(path, f"{name} is missing") from None
    except CorruptArchiveError as exc:
        raise CorruptArchiveError(path, f"{name}: {exc.problem}") from None
    except PermissionError as exc:
        raise ArchivePermissionError.denied(path, exc.filename) from None
    except (OSError, ValueError) as exc:
        raise CorruptArchiveError(path, f"cannot map the sample data: {exc}") from None


def _sniff(path: str, head: Optional[bytes]) -> bool:
    return head is None and any(os.path.exists(os.path.join(path, n)) for n in (MANIFEST, "images.npy", "data.npy"))


SPEC = FormatSpec("memmap", MemmapBackend, MemmapWriter, (".memmap", ".mmap"), _sniff)

"""memmap: a directory of plain .npy files plus manifest.json (written last).

``images.npy`` is uint8 [N,H,W,C] (raw) or ``data.npy`` a flat uint8 byte store
with ``offsets.npy`` (encoded); ``labels.npy``, ``keys.npy``, ``crc32.npy`` hold
the index.  Every file opens with ``numpy.load(..., mmap_mode="r")``.  Readers
map the data per process and pickle as their path, never their pages.
"""

from __future__ import annotations

import mmap
import os
from typing import Tuple

import numpy as np
import torch

from ..errors import (
    ArchiveChangedError,
    ArchiveNotFoundError,
    CorruptArchiveError,
    IncompleteArchiveError,
    UnknownFormatError,
)
from ..index import SampleIndex
from ..manifest import ArchiveManifest
from . import mapped
from .base import Reader, Writer

MANIFEST = "manifest.json"
_HEADER_BYTES = 128  # reserved .npy header, rewritten with the final shape at close
_INDEX_NAMES = ("labels", "keys", "crc32", "offsets")


def data_file_name(mode: str) -> str:
    return "images.npy" if mode == "raw" else "data.npy"


def _npy_header(shape: Tuple[int, ...]) -> bytes:
    """A version 1.0 .npy header for uint8 C-order data, padded to _HEADER_BYTES."""
    text = "{'descr': '|u1', 'fortran_order': False, 'shape': %r, }" % (tuple(shape),)
    room = _HEADER_BYTES - 10 - 1
    if len(text) > room:
        raise ValueError(f"shape {shape} does not fit the reserved .npy header")
    body = text.ljust(room) + "\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin1")


class _Mapped:
    """A read-only memory map of one .npy file and the array over it."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as file:
            version = np.lib.format.read_magic(file)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(file)
            offset = file.tell()
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            st = os.fstat(file.fileno())
            self.identity, size = (st.st_ino, st.st_size, st.st_mtime_ns), st.st_size
            if size < offset + nbytes:
                raise CorruptArchiveError(path, f"the file is truncated ({size} bytes, needs {offset + nbytes})")
            self.map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        if fortran or dtype != np.uint8:
            raise CorruptArchiveError(path, f"expected C-order uint8 data, found {dtype} fortran={fortran}")
        buffer = self.map if self.map is not None else b""
        self._tensor = None
        self.array = np.frombuffer(buffer, dtype=np.uint8, count=nbytes, offset=offset).reshape(shape)

    def tensor(self) -> torch.Tensor:
        """The mapped array as a (read-only) tensor, made once."""
        if self._tensor is None:
            self._tensor = mapped.as_tensor(self.array)
        return self._tensor

    def close(self) -> None:
        self.array = self._tensor = None
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a view is still alive somewhere; unmapped when it dies
                pass


class MemmapWriter(Writer):
    format_name = "memmap"
    is_directory = True

    def _begin(self, temp_path: str) -> None:
        os.mkdir(temp_path)
        self._data_path = os.path.join(temp_path, data_file_name(self.mode))
        self._file = open(self._data_path, "wb")
        self._file.write(b"\0" * _HEADER_BYTES)
        self._bytes = 0

    def _append(self, blob: bytes, i: int) -> int:
        self._file.write(blob)
        self._bytes += len(blob)
        return -1

    def _finish(self, index: SampleIndex, manifest: ArchiveManifest) -> None:
        shape = (len(index),) + self.shape if self.mode == "raw" else (self._bytes,)
        self._file.seek(0)
        self._file.write(_npy_header(shape))
        self._file.close()
        for name, array in index.arrays().items():
            np.save(os.path.join(self.temp_path, f"{name}.npy"), array, allow_pickle=False)
        with open(os.path.join(self.temp_path, MANIFEST), "w") as file:  # the seal, last
            file.write(manifest.to_json())

    def _abort(self) -> None:
        try:
            self._file.close()
        except Exception:
            pass


class MemmapReader(Reader):
    format_name = "memmap"

    def _data_file(self) -> str:
        manifest = getattr(self, "manifest", None)
        if manifest is None:
            return os.path.join(self.path, MANIFEST)
        return os.path.join(self.path, data_file_name(manifest.mode))

    def _open(self) -> "_Mapped | None":
        if not os.path.isdir(self.path):
            raise ArchiveNotFoundError(self.path, "no such directory")
        if not hasattr(self, "manifest"):
            return None  # metadata is read from the small .npy files directly
        data = self._map_data()
        if self._fingerprint not in (None, data.identity):  # replaced between the check and the open
            data.close()
            raise ArchiveChangedError(self.path, "the archive was replaced or modified after it was opened")
        return data

    def _map_data(self) -> _Mapped:
        try:
            return _Mapped(self._data_file())
        except FileNotFoundError:
            raise CorruptArchiveError(self.path, f"{data_file_name(self.manifest.mode)} is missing") from None
        except CorruptArchiveError as exc:
            raise CorruptArchiveError(self.path, f"{os.path.basename(exc.path)}: {exc.problem}") from None
        except (OSError, ValueError) as exc:
            raise CorruptArchiveError(self.path, f"cannot map the sample data: {exc}") from None

    @staticmethod
    def _close_handle(handle: "_Mapped | None") -> None:
        if handle is not None:
            handle.close()

    def _read_metadata(self, _handle: None) -> Tuple[ArchiveManifest, SampleIndex]:
        manifest_path = os.path.join(self.path, MANIFEST)
        if not os.path.exists(manifest_path):
            if os.path.exists(os.path.join(self.path, "images.npy")) or os.path.exists(
                os.path.join(self.path, "data.npy")
            ):
                raise IncompleteArchiveError(self.path, "no manifest.json: the archive was never sealed")
            raise UnknownFormatError(self.path, "not a packed_formats memmap archive (no manifest.json)")
        try:
            with open(manifest_path) as file:
                manifest = ArchiveManifest.from_json(file.read(), path=self.path)
            arrays = {}
            for name in _INDEX_NAMES:
                path = os.path.join(self.path, f"{name}.npy")
                if os.path.exists(path):
                    arrays[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CorruptArchiveError(self.path, f"cannot read the archive index: {exc}") from None
        self.manifest = manifest  # lets the data file be checked now, in this process
        self._map_data().close()
        return manifest, SampleIndex.from_arrays(arrays)

    def _read_blob(self, handle: _Mapped, i: int) -> np.ndarray:
        if self.manifest.mode == "raw":
            return handle.array[i].reshape(-1)
        return handle.array[int(self.index.offsets[i]) : int(self.index.offsets[i + 1])]

    def _read_raw_batch(self, handle: _Mapped, idx: np.ndarray, out: np.ndarray) -> None:
        if not out.flags.c_contiguous:
            out[...] = handle.array[idx]
            return
        mapped.gather(handle.tensor(), idx, out)  # one gather from the map: see mapped.py

"""The Reader and Writer contracts every backend fulfils.

A backend says how to open its per-process handle, how to read its metadata,
and how to read (and write) the bytes of sample ``i``.  Worker safety,
checksums, index checks, batching, atomic publication and error wording live
here, once, for every format.
"""

from __future__ import annotations

import operator
import os
import shutil
import uuid
from typing import Any, ClassVar, List, Optional, Sequence, Tuple

import numpy as np

from .. import codecs
from ..checksum import crc32
from ..errors import (
    ArchiveChangedError,
    ArchiveExistsError,
    ClosedArchiveError,
    CorruptSampleError,
    InvalidSampleError,
    PackedFormatError,
    SampleIndexError,
)
from ..handles import ProcessLocalHandle
from ..index import IndexBuilder, SampleIndex
from ..manifest import MODES, ArchiveManifest, new_manifest

Blob = Any  # bytes, memoryview or a 1-D uint8 numpy array

DAMAGED_HINT = "the archive is damaged: run `packed-formats verify` on it and re-create it"


class Reader(ProcessLocalHandle):
    """Read-only access to one archive; safe to share with DataLoader workers.

    ``read(i)`` returns a raw sample as an HxWxC uint8 array, an encoded one as
    its stored bytes; ``read_many(idx)`` returns one [B,H,W,C] array (raw) or a
    list of bytes (encoded).  With ``verify=True`` every read is checked
    against its stored CRC32.
    """

    format_name: ClassVar[str] = ""

    def __init__(self, path: "str | os.PathLike[str]", verify: bool = True) -> None:
        self.path = os.fspath(path)
        self.verify = verify
        self._closed = False
        self._key = (self.format_name, os.path.realpath(self.path))
        self._fingerprint: Optional[Tuple[int, int, int]] = None
        try:
            self.manifest, self.index = self._read_metadata(self._handle())
        finally:
            self._release_handle()  # the main process holds nothing open
        self._fingerprint = self._stat_fingerprint()
        if self.manifest.format != self.format_name:
            raise PackedFormatError(
                self.path, f"manifest says format {self.manifest.format!r}, expected {self.format_name!r}"
            )
        self._check_index_consistent()

    # ---- what a backend provides -------------------------------------------------
    def _open(self) -> Any:
        """Open this process's handle (raise PackedFormatError subclasses)."""
        raise NotImplementedError

    def _read_metadata(self, handle: Any) -> Tuple[ArchiveManifest, SampleIndex]:
        raise NotImplementedError

    def _read_blob(self, handle: Any, i: int) -> Blob:
        """The stored bytes of sample i."""
        raise NotImplementedError

    def _read_raw_batch(self, handle: Any, idx: np.ndarray, out: np.ndarray) -> None:
        """Fill out[j] with raw sample idx[j]; backends override when they can do better."""
        for j, i in enumerate(idx):
            out[j] = self._as_pixels(self._read_blob(handle, int(i)), int(i))

    def _data_file(self) -> str:
        """The file whose identity must not change while the archive is in use."""
        return self.path

    # ---- process-local handle ----------------------------------------------------
    def _handle_key(self) -> Tuple[str, str]:
        return self._key

    def _open_handle(self) -> Any:
        if self._fingerprint is not None and self._stat_fingerprint() != self._fingerprint:
            raise ArchiveChangedError(
                self.path,
                "the archive was replaced or modified after it was opened",
                hint="re-create the dataset; never rewrite an archive that is being read",
            )
        return self._open()

    def _stat_fingerprint(self) -> Optional[Tuple[int, int, int]]:
        try:
            st = os.stat(self._data_file())
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _live_handle(self) -> Any:
        if self._closed:
            raise ClosedArchiveError(self.path, "the reader is closed")
        return self._handle()

    def __getstate__(self):
        return self._drop_handle_state(self.__dict__.copy())

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)

    def close(self) -> None:
        """Release this process's handle; further reads raise ClosedArchiveError."""
        self._release_handle()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._release_handle()
        except Exception:
            pass

    # ---- the public reading API --------------------------------------------------
    def __len__(self) -> int:
        return self.manifest.count

    def __repr__(self) -> str:
        m = getattr(self, "manifest", None)
        if m is None:
            return f"{type(self).__name__}({self.path!r}, not opened)"
        layout = f"shape={m.shape}" if m.mode == "raw" else f"encoding={m.encoding}"
        return f"{type(self).__name__}({self.path!r}, mode={m.mode}, count={m.count}, {layout})"

    @property
    def mode(self) -> str:
        return self.manifest.mode

    @property
    def labels(self) -> np.ndarray:
        return self.index.labels

    @property
    def classes(self) -> List[str]:
        return list(self.manifest.classes)

    def key(self, i: int) -> str:
        return self.index.key(self.check_index(i))

    def check_index(self, i: int) -> int:
        """i as a non-negative int, or SampleIndexError."""
        n = len(self)
        try:
            j = operator.index(i)
        except TypeError:
            raise SampleIndexError(self.path, f"sample index must be an integer, got {i!r}") from None
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise SampleIndexError(self.path, f"index {i} is out of range for {n} samples")
        return j

    def check_indices(self, idx: Sequence[int]) -> np.ndarray:
        arr = np.asarray(idx)
        if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise SampleIndexError(self.path, "indices must be a 1-D sequence of integers")
        arr = arr.astype(np.int64, copy=True)
        n = len(self)
        arr[arr < 0] += n
        bad = (arr < 0) | (arr >= n)
        if bad.any():
            first = int(np.asarray(idx)[np.argmax(bad)])
            raise SampleIndexError(self.path, f"index {first} is out of range for {n} samples")
        return arr

    def read_bytes(self, i: int) -> bytes:
        """The stored bytes of sample i (pixels for raw, file bytes for encoded)."""
        i = self.check_index(i)
        blob = self._read_checked(self._live_handle(), i)
        return bytes(blob)

    def read(self, i: int) -> "np.ndarray | bytes":
        """Sample i: HxWxC uint8 array (raw) or its encoded bytes (encoded)."""
        i = self.check_index(i)
        blob = self._read_checked(self._live_handle(), i)
        if self.manifest.mode == "raw":
            return self._as_pixels(blob, i).copy()
        return bytes(blob)

    def read_many(self, idx: Sequence[int], out: Optional[np.ndarray] = None) -> "np.ndarray | List[bytes]":
        """Samples idx, any order, repeats allowed: [B,H,W,C] array or list of bytes.

        For raw archives ``out`` may be a preallocated [B,H,W,C] uint8 array
        (e.g. a view of a pinned tensor) to read into.
        """
        idx = self.check_indices(idx)
        handle = self._live_handle()
        if self.manifest.mode != "raw":
            return [bytes(self._read_checked(handle, int(i))) for i in idx]
        shape = (len(idx),) + tuple(self.manifest.shape)
        if out is None:
            out = np.empty(shape, dtype=np.uint8)
        elif out.shape != shape or out.dtype != np.uint8:
            raise ValueError(f"out must be uint8 {shape}, got {out.dtype} {out.shape}")
        if len(idx):
            self._read_raw_batch(handle, idx, out)
            if self.verify:
                for j, i in enumerate(idx):
                    self._check_crc(int(i), out[j])
        return out

    # ---- checks --------------------------------------------------------------------
    def _read_checked(self, handle: Any, i: int) -> Blob:
        blob = self._read_blob(handle, i)
        if self.verify:
            self._check_crc(i, blob)
        return blob

    def _check_crc(self, i: int, blob: Blob) -> None:
        if self.index.crc32 is None:
            return
        actual = crc32(blob)
        expected = int(self.index.crc32[i])
        if actual != expected:
            raise CorruptSampleError(
                self.path,
                f"checksum mismatch (stored crc32 {expected:08x}, read {actual:08x})",
                index=i,
                key=self.index.key(i),
                hint=DAMAGED_HINT,
            )

    def _as_pixels(self, blob: Blob, i: int) -> np.ndarray:
        shape = self.manifest.shape
        array = np.frombuffer(blob, dtype=np.uint8) if not isinstance(blob, np.ndarray) else blob
        if array.size != self.manifest.sample_nbytes:
            raise CorruptSampleError(
                self.path,
                f"raw sample has {array.size} bytes, expected {self.manifest.sample_nbytes}",
                index=i,
                key=self.index.key(i),
                hint=DAMAGED_HINT,
            )
        return array.reshape(shape)

    def _check_index_consistent(self) -> None:
        n = self.manifest.count
        for name, array in self.index.arrays().items():
            expected = n + 1 if name == "offsets" else n
            if len(array) != expected:
                raise PackedFormatError(
                    self.path,
                    f"index array {name!r} has {len(array)} entries, manifest says {n} samples",
                    hint=DAMAGED_HINT,
                )

    def _corrupt(self, problem: str, i: int) -> CorruptSampleError:
        return CorruptSampleError(self.path, problem, index=i, key=self.index.key(i), hint=DAMAGED_HINT)


class WriteTransaction:
    """As a context manager: ``close()`` (publish) on success, ``abort()`` on error."""

    def close(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def abort(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Writer(WriteTransaction):
    """Appends samples to a new archive; nothing appears at ``path`` until close().

    The archive is written under a temporary name beside ``path``, sealed
    (manifest last), re-opened and spot-checked, then moved into place with
    ``os.replace``.  On error or abort() the temporary output is removed.
    """

    format_name: ClassVar[str] = ""
    is_directory: ClassVar[bool] = False

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        *,
        mode: str = "encoded",
        shape: Optional[Sequence[int]] = None,
        classes: Sequence[str] = (),
        encoding: str = "jpeg",
        quality: int = 90,
        overwrite: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.shape = _check_shape(shape) if mode == "raw" else None
        if mode == "raw" and self.shape is None:
            raise ValueError("mode='raw' needs shape=(height, width, channels)")
        if encoding not in codecs.ENCODINGS:
            raise ValueError(f"encoding must be one of {codecs.ENCODINGS}, got {encoding!r}")
        self.classes = tuple(str(c) for c in classes)
        self.encoding = encoding
        self.quality = quality
        self.overwrite = overwrite
        self._encodings_seen: set = set()
        self._builder = IndexBuilder()
        self._closed = False
        if os.path.lexists(self.path) and not overwrite:
            raise ArchiveExistsError(self.path, "already exists", hint="pass overwrite=True to replace it")
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise PackedFormatError(self.path, f"the destination directory {parent} does not exist")
        self.temp_path = temp_path_for(self.path)
        self._pid = os.getpid()  # a forked child must never clean up its parent's output
        self._begin(self.temp_path)

    # ---- what a backend provides -------------------------------------------------
    def _begin(self, temp_path: str) -> None:
        raise NotImplementedError

    def _append(self, blob: bytes, i: int) -> int:
        """Store sample i's bytes; return its absolute file position or -1."""
        raise NotImplementedError

    def _finish(self, index: SampleIndex, manifest: ArchiveManifest) -> None:
        """Write the index, then the manifest (the seal) last, and close."""
        raise NotImplementedError

    def _abort(self) -> None:
        """Close whatever is open, quietly."""
        raise NotImplementedError

    # ---- the public writing API --------------------------------------------------
    def __len__(self) -> int:
        return self._builder.count

    def add(self, sample: Any, label: int, key: Optional[str] = None) -> int:
        """Append one sample (encoded bytes, HxWxC uint8 array or PIL image); return its index."""
        if self._closed:
            raise ClosedArchiveError(self.path, "the writer is closed")
        i = self._builder.count
        key = f"{i:08d}" if key is None else str(key)
        label = self._check_label(label, i, key)
        blob = self._to_blob(sample, i, key)
        position = self._append(blob, i)
        self._builder.append(label, key, crc32(blob), len(blob), position)
        return i

    def close(self) -> None:
        """Seal, spot-check and publish the archive at ``path``."""
        if self._closed:
            return
        self._closed = True
        try:
            index = self._builder.build(offsets=self.mode == "encoded", positions=self._stores_positions())
            manifest = new_manifest(
                self.format_name, self.mode, len(index), self.classes, self.shape, self._manifest_encoding()
            )
            self._finish(index, manifest)
            self._spot_check(manifest.count)
            publish(self.temp_path, self.path, overwrite=self.overwrite)
        except BaseException:
            self._abort()
            remove_path(self.temp_path)
            raise

    def abort(self) -> None:
        """Discard everything written; ``path`` is left as it was."""
        if not self._closed:
            self._closed = True
            self._abort()
        remove_path(self.temp_path)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_pid", None) == os.getpid():
            try:
                self.abort()
            except Exception:
                pass

    # ---- helpers -------------------------------------------------------------------
    def _stores_positions(self) -> bool:
        return False

    def _manifest_encoding(self) -> Optional[str]:
        if self.mode == "raw":
            return None
        if len(self._encodings_seen) == 1:
            return next(iter(self._encodings_seen))
        return "mixed" if self._encodings_seen else self.encoding

    def _check_label(self, label: Any, i: int, key: str) -> int:
        try:
            value = int(label)
        except (TypeError, ValueError):
            raise InvalidSampleError(self.path, f"label {label!r} is not an integer", index=i, key=key) from None
        if self.classes and not 0 <= value < len(self.classes):
            raise InvalidSampleError(
                self.path, f"label {value} is out of range for {len(self.classes)} classes", index=i, key=key
            )
        return value

    def _to_blob(self, sample: Any, i: int, key: str) -> bytes:
        try:
            if self.mode == "encoded":
                if isinstance(sample, (bytes, bytearray, memoryview)):
                    data = bytes(sample)
                    kind = codecs.sniff(data)
                    if kind is None:
                        raise codecs.DecodeError("not a JPEG or PNG file")
                else:
                    data, kind = codecs.encode(codecs.to_array(sample), self.encoding, self.quality), self.encoding
                self._encodings_seen.add(kind)
                return data
            pixels = codecs.to_array(sample, channels=self.shape[2])
        except codecs.DecodeError as exc:
            raise InvalidSampleError(self.path, f"cannot store sample: {exc}", index=i, key=key) from None
        if pixels.shape != self.shape:
            h, w, c = pixels.shape
            raise InvalidSampleError(
                self.path,
                f"image is {h}x{w}x{c} (HxWxC), the raw archive holds {'x'.join(map(str, self.shape))}",
                index=i,
                key=key,
                hint="resize it first, e.g. packed-formats convert --size",
            )
        return np.ascontiguousarray(pixels).tobytes()

    def _spot_check(self, count: int) -> None:
        from . import reader_class

        with reader_class(self.format_name)(self.temp_path, verify=True) as reader:
            if len(reader) != count:
                raise PackedFormatError(self.path, f"wrote {count} samples but the archive holds {len(reader)}")
            for i in {0, count - 1} if count else ():
                reader.read(i)


def _check_shape(shape: Optional[Sequence[int]]) -> Optional[Tuple[int, int, int]]:
    if shape is None:
        return None
    shape = tuple(int(x) for x in shape)
    if len(shape) == 2:
        shape = shape + (3,)
    if len(shape) != 3 or min(shape) <= 0 or shape[2] not in (1, 3):
        raise ValueError(f"shape must be (height, width, channels) with 1 or 3 channels, got {shape}")
    return shape


def temp_path_for(path: str) -> str:
    """A unique temporary name beside ``path`` (same file system, so os.replace works)."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.pf-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def publish(temp: str, path: str, overwrite: bool) -> None:
    """Atomically move a finished archive (file or directory) into place."""
    _fsync_tree(temp)
    if os.path.isdir(temp) and os.path.lexists(path):
        if not overwrite:
            raise ArchiveExistsError(path, "already exists", hint="pass overwrite=True to replace it")
        trash = temp_path_for(path) + "-old"
        os.replace(path, trash)
        os.replace(temp, path)
        remove_path(trash)
    else:
        if os.path.lexists(path) and not overwrite:
            raise ArchiveExistsError(path, "already exists", hint="pass overwrite=True to replace it")
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        os.replace(temp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _fsync_tree(path: str) -> None:
    files = [path]
    if os.path.isdir(path):
        files = [os.path.join(path, name) for name in os.listdir(path)]
    for name in files:
        if os.path.isfile(name):
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    if os.path.isdir(path):
        _fsync_dir(path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

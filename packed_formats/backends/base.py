"""The contracts every format fulfils, and the one Reader that composes them.

A format is a ``Backend`` (how its samples are stored: metadata without a
handle, a per-process ``Handle``, reading sample ``i`` or a batch into
``out``) and a ``Writer``, registered with one ``FormatSpec``.  Worker safety
(``handles.SharedHandle``), checksums and their policy, index checks and error
wording live in ``Reader``, once, for every format; atomic publication lives
in ``Writer``.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import operator
import os
import shutil
import uuid
from typing import Any, Callable, ClassVar, Dict, Generic, Iterator, List, Optional, Sequence, Tuple, Type, TypeVar

import numpy as np

from .. import codecs
from ..checksum import array_crc32, crc32
from ..errors import (
    ArchiveChangedError,
    ArchiveExistsError,
    ArchiveNotFoundError,
    ClosedArchiveError,
    CorruptArchiveError,
    CorruptSampleError,
    DestinationError,
    FormatMismatchError,
    InvalidSampleError,
    PackedFormatError,
    SampleIndexError,
    TooManyOpenFilesError,
)
from ..fields import FieldSpec, FieldValueError, check_fields
from ..handles import ProcessLocal, SharedHandle
from ..index import FieldIndexBuilder, IndexBuilder, SampleIndex, anonymous_array, field_array
from ..manifest import MODES, ArchiveManifest, new_manifest
from ..policy import VerifyPolicy, check_verify
from ..tracebacks import drops_frames
from .mapped import FileTruncatedError

Blob = Any  # bytes, memoryview or a 1-D uint8 numpy array
Identity = Tuple[int, int, int, int]  # (device, inode, size, mtime_ns) of a file (why no ctime: Reader.check_unchanged)

DAMAGED_HINT = "the archive is damaged: run `packed-formats verify` on it and re-create it"


def file_identity(path: str) -> Optional[Identity]:
    """(device, inode, size, mtime_ns) of the file at ``path``, or None if it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def fd_identity(fd: int) -> Identity:
    """The identity of an open file (as ``file_identity``)."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def handle_key(format_name: str, path: str, identity: Optional[Identity]) -> tuple:
    """The key under which processes share a handle: the format, the real path, and the file's identity,
    so that an archive replaced at the same path never gets the old one's handle."""
    return (format_name, os.path.realpath(path)) + (identity or ())


# ---- what a format provides ---------------------------------------------------------------------------
class Handle(abc.ABC):
    """One process's open resource for one archive (file, environment, map)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what this process opened."""

    def discard_inherited(self) -> None:  # noqa: B027 - a default, not an abstract method
        """Drop a handle inherited through fork.  Default: forget it (the parent owns it);
        formats whose library misbehaves with inherited handles (h5py, lmdb) close it."""

    def fileno(self) -> Optional[int]:
        """A descriptor of the archive's data file that this handle holds open, through which
        ``Reader`` checks before each read that the file is unchanged (one ``fstat``).  Default:
        None, and the data file is checked by its path (one ``stat``)."""
        return None


H = TypeVar("H", bound=Handle)
T = TypeVar("T")


class Backend(abc.ABC, Generic[H]):
    """How one format stores its samples, in two phases.

    ``read_metadata(path)`` (a class method) reads the manifest and index
    without holding anything open afterwards.  An instance then knows the
    archive (``path``, ``manifest``, ``index``, and ``identity``: that of
    ``data_file()`` when the metadata was read) and opens one ``Handle`` per
    process with ``open()``; ``read`` and ``read_batch`` read through it.
    Backends raise ``PackedFormatError`` subclasses and never deal with
    processes or checksums: ``Reader`` does.
    """

    format_name: ClassVar[str] = ""
    # whether the index is the parts' of a set joined: each part checked its own when it was opened, and only
    # the CRC32s of a field are joined (its reads go to the part, which knows where the bytes lie)
    joins_parts: ClassVar[bool] = False

    def __init__(self, path: str, manifest: ArchiveManifest, index: SampleIndex,
                 identity: Optional[Identity] = None) -> None:
        self.path, self.manifest, self.index, self.identity = path, manifest, index, identity

    @classmethod
    @abc.abstractmethod
    def read_metadata(cls, path: str) -> Tuple[ArchiveManifest, SampleIndex]:
        """The archive's manifest and index (PackedFormatError subclasses when unreadable)."""

    @classmethod
    def load(cls, path: str) -> "Backend":
        """The backend of the archive at ``path``, its metadata read."""
        manifest, index = cls.read_metadata(path)
        return cls(path, manifest, index)

    def close(self) -> None:
        """Release what the backend holds besides its handles (nothing, but for composed formats)."""

    @abc.abstractmethod
    def open(self) -> H:
        """This process's handle."""

    @abc.abstractmethod
    def read(self, handle: H, i: int) -> Blob:
        """The stored bytes of sample i (pixels for raw, file bytes for encoded), unchecked."""

    def read_field(self, handle: H, name: str, i: int) -> Blob:
        """The stored bytes of field ``name`` of sample i, unchecked (formats that store fields override this)."""
        raise CorruptArchiveError(self.path, f"the {self.format_name} format stores no fields, yet the manifest "
                                             f"declares them", hint=DAMAGED_HINT)

    def read_batch(self, handle: H, idx: np.ndarray, out: np.ndarray) -> None:
        """Fill out[j] with raw sample idx[j]; formats override this when they can do better than a loop."""
        for j, i in enumerate(idx):
            out[j] = self.as_pixels(self.read(handle, int(i)), int(i))

    def data_file(self) -> Optional[str]:
        """The file whose identity must not change while the archive is in use (None: no such file)."""
        return self.path

    def files(self) -> List[str]:
        """Every file the archive consists of."""
        return [self.path]

    def watched_files(self) -> List[str]:
        """The files that must keep their identity while the archive is read, for a read to be this
        archive's: ``Reader`` checks them before each read or batch.  Default: every file of the
        archive, when it has a data file (a folder has none: it may gain files)."""
        return [] if self.data_file() is None else self.files()

    def data_file_identity(self) -> Optional[Identity]:
        """The identity ``data_file()`` has now (None: no such file, or it cannot be stat'ed)."""
        data_file = self.data_file()
        return None if data_file is None else file_identity(data_file)

    def sample_location(self, i: int) -> Optional[Tuple[str, int]]:
        """(file, byte offset) where sample i's stored bytes start, when the format knows it."""
        return None

    def structure_problems(self, handle: H, first: int, last: int) -> Dict[int, str]:
        """Samples first:last whose records in the format's own structure, which our reads never use
        but other tools do (a ZIP's local headers and central directory), disagree with the index:
        sample index -> problem.  Default: the format keeps no such records."""
        return {}

    # ---- helpers for formats ----
    @property
    def offsets(self) -> np.ndarray:
        """int64[N+1]: sample i's bytes are offsets[i]:offsets[i+1] of a flat store."""
        return self._required(self.index.offsets, "offsets")

    @property
    def positions(self) -> np.ndarray:
        """int64[N]: where sample i's bytes start in the file."""
        return self._required(self.index.positions, "positions")

    @property
    def shape(self) -> Tuple[int, int, int]:
        """(H, W, C) of a raw archive's samples."""
        return self._required(self.manifest.shape, "shape")

    @property
    def sample_nbytes(self) -> int:
        """Bytes of one raw sample."""
        return self._required(self.manifest.sample_nbytes, "shape")

    def _required(self, value: Optional[T], name: str) -> T:
        if value is None:
            problem = f"the index has no {name}, which this archive needs"
            raise CorruptArchiveError(self.path, problem, hint=DAMAGED_HINT)
        return value

    def corrupt(self, problem: str, i: int) -> CorruptSampleError:
        """A CorruptSampleError for sample i naming the archive, index and key."""
        return CorruptSampleError(self.path, problem, index=i, key=self.index.key(i), hint=DAMAGED_HINT)

    def as_pixels(self, blob: Blob, i: int) -> np.ndarray:
        """A raw sample's bytes as its HxWxC array (CorruptSampleError if the size is wrong)."""
        array = blob if isinstance(blob, np.ndarray) else np.frombuffer(blob, dtype=np.uint8)
        if array.size != self.sample_nbytes:
            raise self.corrupt(f"raw sample has {array.size} bytes, expected {self.sample_nbytes}", i)
        return array.reshape(self.shape)


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """Everything the registry needs to know about one format.

    ``sniff(path, head)`` says whether ``path`` is of this format, from the
    first 64 bytes of a file (``head``) or, for a directory, ``head=None``.
    ``writer`` is None for formats that are only read.

    Args:
        name: the format's name (``format=`` everywhere).
        backend: the ``Backend`` class that reads it.
        writer: the ``Writer`` class that writes it, or None.
        extensions: the file name endings that suggest it (".zip", ".h5", ...).
        sniff: ``sniff(path, head) -> bool``, as above.
    """

    name: str
    backend: Type[Backend]
    writer: Optional[Type["Writer"]]
    extensions: Tuple[str, ...]
    sniff: Callable[[str, Optional[bytes]], bool]


# ---- the one Reader ----------------------------------------------------------------------------------------
class Reader:
    """Read-only access to one archive; safe to share with DataLoader workers.

    ``read(i)`` returns a raw sample as an HxWxC uint8 array, an encoded one as
    its stored bytes; ``read_many(idx)`` returns one [B,H,W,C] array (raw) or a
    list of bytes (encoded).  ``verify`` checks samples against their stored
    CRC32: on every read (True), the first time each process reads a sample
    ("once"), or never (False).  Nothing is held open by the process that
    creates a Reader; each process opens its own handle on first read, and a
    Reader pickles as a description (path, metadata), never as a handle.

    Args:
        path: the archive.
        backend: the format's ``Backend`` class (``open_archive`` finds it from the content).
        verify: True, "once" or False, as above.
    """

    def __init__(self, path: "str | os.PathLike[str]", backend: Type[Backend], verify: VerifyPolicy = True) -> None:
        check_verify(verify)
        path = os.fspath(path)
        with named_failures(path, "cannot read the archive's metadata"):
            loaded = backend.load(path)
        if loaded.manifest.format != backend.format_name:
            raise FormatMismatchError(
                path, f"manifest says format {loaded.manifest.format!r}, expected {backend.format_name!r}"
            )
        self._attach(path, loaded, verify)

    @classmethod
    def of_backend(cls, backend: Backend, verify: VerifyPolicy = True, path: Optional[str] = None) -> "Reader":
        """A Reader over a backend already loaded (a remote set's), named ``path`` (default: the backend's)."""
        check_verify(verify)
        reader = cls.__new__(cls)
        reader._attach(backend.path if path is None else path, backend, verify)
        return reader

    def _attach(self, path: str, backend: Backend, verify: VerifyPolicy) -> None:
        self.path = path
        self.verify = verify
        self._closed = False
        self.backend: Backend = backend
        self.backend.identity = self.backend.data_file_identity()
        self._watched = self._watched_identities()
        self._check_index_consistent()
        self._check_index_checksums()
        # no bound method of self kept in it: a cycle would keep the handle open until the collector ran
        self._claim = SharedHandle(
            handle_key(backend.format_name, self.path, self.backend.identity), _close_handle, _discard_handle,
        )
        # one bit per sample, on a private anonymous map: untouched pages cost nothing (a calloc'd block
        # from the heap is cleared in full, so every worker would hold a byte per sample of its own)
        bits = (len(self) + 7) // 8 if verify == "once" else 0
        self._verified = ProcessLocal(functools.partial(anonymous_array, np.uint8, bits))

    # ---- metadata ----
    @property
    def format_name(self) -> str:
        return self.backend.format_name

    @property
    def manifest(self) -> ArchiveManifest:
        return self.backend.manifest

    @property
    def index(self) -> SampleIndex:
        return self.backend.index

    @property
    def handle_key(self) -> tuple:
        """The key of this archive's handle in ``handles.open_handles()``."""
        return self._claim.key

    def __len__(self) -> int:
        return self.manifest.count

    def __repr__(self) -> str:
        m = self.manifest
        layout = f"shape={m.shape}" if m.mode == "raw" else f"encoding={m.encoding}"
        return f"Reader({self.path!r}, format={m.format}, mode={m.mode}, count={m.count}, {layout})"

    @property
    def mode(self) -> str:
        return self.manifest.mode

    @property
    def labels(self) -> np.ndarray:
        return self.index.labels

    @property
    def part_starts(self) -> np.ndarray:
        """Each part's first sample, then the count (int64, len = parts + 1): a sharded archive's
        parts, else one part, ``[0, len]``."""
        starts = getattr(self.backend, "starts", None)
        return np.array([0, len(self)], dtype=np.int64) if starts is None else starts

    @property
    def classes(self) -> List[str]:
        return list(self.manifest.classes)

    def key(self, i: int) -> str:
        return self.index.key(self.check_index(i))

    def files(self) -> List[str]:
        """Every file the archive consists of."""
        return self.backend.files()

    # ---- process-local handle ----
    def _open_checked(self) -> Handle:
        identity, data_file = self.backend.identity, self.backend.data_file()
        if identity is not None and data_file is not None:
            now = file_identity(data_file)
            if now is None:
                raise ArchiveNotFoundError(
                    self.path, "no longer exists (deleted, moved, or a relative path after a change of directory)",
                    hint="open it again by its current path",
                )
            if now != identity:
                raise replaced_error(self.path)
        with named_failures(self.path, "cannot open the archive"):
            return self.backend.open()

    def handle(self) -> Handle:
        """This process's open handle (opened on first use; ClosedArchiveError after close())."""
        if self._closed:
            raise ClosedArchiveError(self.path, "the reader is closed")
        return self._claim.get(self._open_checked)

    def _unchanged_handle(self) -> Handle:
        """This process's handle, once ``check_unchanged`` has passed: what every read starts with.
        A changed archive's handle is released at once: HDF5 would hand a new reader of the file in this
        process the old one's cached structure, and LMDB refuses a second environment on it."""
        handle = self.handle()
        try:
            self.check_unchanged(handle)
        except ArchiveChangedError:
            self.release_handle()
            raise
        return handle

    def check_unchanged(self, handle: Optional[Handle] = None) -> None:
        """ArchiveChangedError when a file of the archive was rewritten in place since this reader opened it.

        Every read, and every batch (``read_many``: once, whatever its size), starts with this
        check: one ``fstat`` of the data file through the descriptor ``handle`` holds (one
        ``stat`` of its path where the handle holds none), and one ``stat`` of each other file
        the archive maps (memmap's index arrays); a sharded archive's parts check themselves,
        each when a batch reads from it.  A file is unchanged while its size and modification
        time are those it had when the reader was opened: a file rewritten in place (``cp
        other.zip train.zip``: the same file, often of the same size), truncated or grown is
        caught before any of its bytes, or of the index mapped from it, are served.  A file
        replaced at its path (``os.replace``, as ``convert`` publishes) or deleted is not an
        error: the reader keeps reading the file it has open or mapped, whole.

        What this cannot see: a rewrite that keeps the size and sets the modification time back
        to the very nanosecond it was (``cp -p``, ``rsync --inplace -t`` or ``touch -d`` from a
        file with that same time), and a rewrite during a read.  The status-change time (ctime)
        would catch the first, but chmod, chown, a new hard link and a rename change it too, and
        a job must not stop for those.
        """
        if not self._watched:
            return
        fd = None if handle is None else handle.fileno()
        for path, identity, through_handle in self._watched:
            now = fd_identity(fd) if through_handle and fd is not None else file_identity(path)
            if now is not None and now != identity and now[:2] == identity[:2]:  # the same file, changed
                raise changed_error(self.path, path, identity, now)

    def _watched_identities(self) -> Tuple[Tuple[str, Identity, bool], ...]:
        """(file, its identity now, whether it is the data file) for each file ``check_unchanged``
        checks: the data file's identity is the one recorded in ``backend.identity``."""
        data_file, watched = self.backend.data_file(), []
        for path in self.backend.watched_files():
            is_data = path == data_file
            identity = self.backend.identity if is_data else file_identity(path)
            if identity is not None:
                watched.append((path, identity, is_data))
        return tuple(watched)

    def release_handle(self) -> None:
        """Release this process's handle but stay open: the next read opens it again
        (how a sharded archive bounds the parts each process holds open)."""
        self._claim.release()

    def close(self) -> None:
        """Release this process's handle; further reads raise ClosedArchiveError."""
        self._claim.release()
        self.backend.close()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._claim.release()
        except Exception:
            pass

    # ---- pickling (spawn and forkserver workers) ----
    def __getstate__(self) -> dict:
        """A mapped index travels as the archive's description and is mapped again by the receiving
        process (pages shared through the page cache), never as a pickled copy of every array."""
        state = self.__dict__.copy()
        if self.backend.index.mapped() and not getattr(self.backend, "pickles_itself", False):
            state["backend"] = _MappedBackend(type(self.backend), self.path, self.backend.identity)
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["backend"], _MappedBackend):
            state["backend"] = state["backend"].load()
        self.__dict__.update(state)

    # ---- reading ----
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

    def check_indices(self, idx: "Sequence[int] | np.ndarray") -> np.ndarray:
        """idx as a fresh int64 array of non-negative indices, or SampleIndexError."""
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

    @drops_frames  # an error kept by its catcher must not keep this reader's handle open
    def read_bytes(self, i: int) -> bytes:
        """The stored bytes of sample i (pixels for raw, file bytes for encoded)."""
        i = self.check_index(i)
        return bytes(self._read_checked(self._unchanged_handle(), i))

    @drops_frames
    def read(self, i: int) -> "np.ndarray | bytes":
        """Sample i: HxWxC uint8 array (raw) or its encoded bytes (encoded)."""
        i = self.check_index(i)
        blob = self._read_checked(self._unchanged_handle(), i)
        if self.manifest.mode == "raw":
            return self.backend.as_pixels(blob, i).copy()
        return bytes(blob)

    @drops_frames
    def read_many(
        self, idx: "Sequence[int] | np.ndarray", out: Optional[np.ndarray] = None
    ) -> "np.ndarray | List[bytes]":
        """Samples idx, any order, repeats allowed: [B,H,W,C] array or list of bytes.

        For raw archives ``out`` may be a preallocated C-contiguous or strided
        [B,H,W,C] uint8 array (e.g. a view of a pinned tensor) to read into.
        """
        indices = self.check_indices(idx)
        handle = self._unchanged_handle()
        if self.manifest.mode != "raw":
            blobs = []  # a loop, not a comprehension: in its frame's closure an error's traceback would keep self
            for i in indices:
                blobs.append(bytes(self._read_checked(handle, int(i))))
            return blobs
        shape = (len(indices),) + self.backend.shape
        if out is None:
            out = np.empty(shape, dtype=np.uint8)
        elif out.shape != shape or out.dtype != np.uint8:
            raise ValueError(f"out must be uint8 {shape}, got {out.dtype} {out.shape}")
        if len(indices):
            with named_failures(self.path, "cannot read a batch of samples"):
                self.backend.read_batch(handle, indices, out)
            for j, i in enumerate(indices):
                self._verify(int(i), out[j])
        return out

    # ---- fields ----
    @property
    def fields(self) -> Tuple[FieldSpec, ...]:
        """What each sample holds besides its image and label (the manifest's declaration)."""
        return self.manifest.fields

    @drops_frames
    def read_field_bytes(self, i: int, name: str) -> bytes:
        """The stored bytes of field ``name`` of sample i, checked against their CRC32 (unless verify is False)."""
        self.manifest.field(name)
        i = self.check_index(i)
        return bytes(self._read_field_checked(self._unchanged_handle(), name, i))

    @drops_frames
    def read_field(self, i: int, name: str) -> Any:
        """Field ``name`` of sample i as its value (``FieldSpec.decode``): bytes of an image or of bytes, a numpy
        array, a str or a JSON value.  KeyError for a field the archive does not have."""
        spec = self.manifest.field(name)
        i = self.check_index(i)
        blob = self._read_field_checked(self._unchanged_handle(), name, i)
        try:
            return spec.decode(blob)
        except FieldValueError as exc:
            raise self.sample_error(i, str(exc)) from None

    def _read_field_checked(self, handle: Handle, name: str, i: int) -> Blob:
        with named_failures(self.path, f"cannot read field {name!r}", index=i, index_data=self.index):
            blob = self.backend.read_field(handle, name, i)
        crcs = self.index.fields.get(field_array(name, "crc32"))
        if self.verify is not False and crcs is not None:
            actual, expected = crc32(blob), int(crcs[i])
            if actual != expected:
                raise self.sample_error(i, f"field {name!r}: checksum mismatch (stored crc32 {expected:08x}, "
                                           f"read {actual:08x})")
        return blob

    # ---- checks ----
    def structure_problems(self, first: int, last: int) -> Dict[int, str]:
        """Samples first:last whose records in the format's own structure are damaged (see
        ``Backend.structure_problems``; ``verify_archive`` reports them): sample index -> problem."""
        first, last = max(first, 0), min(last, len(self))
        if first >= last:
            return {}
        with named_failures(self.path, "cannot check the archive's structure"):
            return self.backend.structure_problems(self._unchanged_handle(), first, last)

    def sample_error(self, i: int, problem: str) -> CorruptSampleError:
        """A CorruptSampleError for sample i (e.g. its bytes do not decode), naming the archive and key."""
        return self.backend.corrupt(problem, i)

    def check_sample(self, i: int, blob: Blob) -> None:
        """Check sample i's stored bytes against its CRC32, whatever the verify policy."""
        if self.index.crc32 is None:
            return
        actual = crc32(blob)
        expected = int(self.index.crc32[i])
        if actual != expected:
            raise self.sample_error(i, f"checksum mismatch (stored crc32 {expected:08x}, read {actual:08x})")

    def _read_checked(self, handle: Handle, i: int) -> Blob:
        with named_failures(self.path, "cannot read the sample", index=i, index_data=self.index):
            blob = self.backend.read(handle, i)
        self._verify(i, blob)
        return blob

    def _verify(self, i: int, blob: Blob) -> None:
        """Apply the verify policy to sample i's bytes."""
        if self.verify is False:
            return
        if self.verify == "once":
            verified, byte, bit = self._verified.get(), i >> 3, 1 << (i & 7)
            if verified[byte] & bit:
                return
            self.check_sample(i, blob)
            verified[byte] |= bit
            return
        self.check_sample(i, blob)

    def _check_index_checksums(self) -> None:
        """Every index array against the CRC32 its manifest recorded at seal time (archives of
        format version 2 on): a damaged label, key or offset must never read as another."""
        expected = dict(self.manifest.index_crc32)
        if not expected:
            return
        arrays = self.index.arrays()
        if set(arrays) != set(expected):
            raise CorruptArchiveError(
                self.path, f"the index holds arrays {sorted(arrays)}, its manifest lists {sorted(expected)}",
                hint=DAMAGED_HINT,
            )
        for name, array in arrays.items():
            if array_crc32(array) != expected[name]:
                raise CorruptArchiveError(
                    self.path, f"the index array {name!r} is damaged (its checksum does not match)", hint=DAMAGED_HINT
                )

    def _check_index_consistent(self) -> None:
        n = self.manifest.count
        for spec in self.manifest.fields:  # never a field read unchecked because its arrays were left out
            offsets, crcs = spec.array_names
            needed = ([] if self.backend.joins_parts else [offsets]) + ([crcs] if self.manifest.checksum else [])
            missing = [name for name in needed if name not in self.index.fields]
            if missing:
                raise CorruptArchiveError(self.path, f"the index lacks {missing}, which field {spec.name!r} needs",
                                          hint=DAMAGED_HINT)
        for name, array in self.index.arrays().items():
            expected = n + 1 if name.endswith("offsets") else n
            if len(array) != expected:
                raise CorruptArchiveError(
                    self.path,
                    f"index array {name!r} has {len(array)} entries, manifest says {n} samples",
                    hint=DAMAGED_HINT,
                )


@dataclasses.dataclass(frozen=True)
class _MappedBackend:
    """What a Reader with a mapped index pickles in place of its backend."""

    backend: Type[Backend]
    path: str
    identity: Optional[Identity]

    def load(self) -> Backend:
        """The backend again, its index mapped in this process: the same file, or ArchiveChangedError
        (the sending process checked the index; a changed file would not be the one it checked)."""
        with named_failures(self.path, "cannot read the archive's metadata"):
            backend = self.backend.load(self.path)
        backend.identity = backend.data_file_identity()
        if backend.identity != self.identity:
            raise replaced_error(self.path)
        return backend


def replaced_error(path: str) -> ArchiveChangedError:
    """The archive at ``path`` is no longer the file a reader opened."""
    return ArchiveChangedError(
        path, "the archive was replaced or modified after it was opened",
        hint="re-create the dataset; never rewrite an archive that is being read",
    )


def changed_error(archive: str, path: str, then: Identity, now: Identity) -> ArchiveChangedError:
    """The file ``path`` of the open ``archive`` was rewritten in place: its identity (device, inode,
    size, modification time) was ``then`` when the archive was opened, and is ``now``."""
    where = os.path.relpath(os.path.abspath(path), os.path.abspath(archive))
    what = "the file" if where == "." else f"its file {where}"
    change = "same size, new modification time"
    if now[2] != then[2]:
        change = f"its size went from {then[2]} to {now[2]} bytes"
    problem = f"{what} was rewritten in place while the archive was open ({change}): reads would mix two archives"
    return ArchiveChangedError(
        archive, problem,
        hint="open the dataset again (in a job: restart it) to read the archive as it is now; to update an "
             "archive that is being read, write the new one under another name and move it into place",
    )


@contextlib.contextmanager
def named_failures(
    path: str, doing: str, index: Optional[int] = None, index_data: Optional[SampleIndex] = None
) -> Iterator[None]:
    """Turn what a format library raises on damaged data (h5py's RuntimeError, numpy's parse
    errors, a file truncated under its map...) into a PackedFormatError naming the archive
    (and sample ``index``, with its key from ``index_data``)."""
    try:
        yield
    except TooManyOpenFilesError:
        raise
    except PackedFormatError as exc:
        if TooManyOpenFilesError.describes(exc):  # a backend took the failed open for damage
            raise _no_descriptor_left(path, doing) from None
        raise
    except FileTruncatedError as exc:
        raise ArchiveChangedError(
            path, str(exc), hint="an archive must not be rewritten in place while it is read; re-create it"
        ) from None
    except MemoryError:
        raise
    except Exception as exc:  # a damaged file can make a library fail in any way
        if TooManyOpenFilesError.describes(exc):
            raise _no_descriptor_left(path, doing) from None
        problem = f"{doing}: {type(exc).__name__}: {exc}"
        if index is None:
            raise CorruptArchiveError(path, problem, hint=DAMAGED_HINT) from None
        key = None if index_data is None else index_data.key(index)
        raise CorruptSampleError(path, problem, index=index, key=key, hint=DAMAGED_HINT) from None


def _no_descriptor_left(path: str, doing: str) -> TooManyOpenFilesError:
    """EMFILE or ENFILE, named as such: the archive is fine, the process is out of file descriptors."""
    usage = TooManyOpenFilesError.usage()
    return TooManyOpenFilesError(path, f"{doing}: too many open files ({usage})", hint=TooManyOpenFilesError.HINT)


def _close_handle(handle: Handle) -> None:
    handle.close()


def _discard_handle(handle: Handle) -> None:
    handle.discard_inherited()


class WriteTransaction(abc.ABC):
    """As a context manager: ``close()`` (publish) on success, ``abort()`` on error."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish and publish."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard everything written."""

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

    Args:
        path: where the archive will be.
        mode: "encoded" (image file bytes) or "raw" (decoded pixels of one ``shape``).
        shape: (H, W, C) of every raw sample.
        classes: the class names, label i naming ``classes[i]``.
        encoding: "jpeg" or "png", for pixels added to an encoded archive.
        quality: the JPEG quality of such pixels.
        overwrite: replace an archive already at ``path`` (else ArchiveExistsError).
        fields: what each sample holds besides its image and label (``fields.FieldSpec`` or ``NAME=KIND``
            strings); ``add`` then takes each sample's values as ``fields={name: value}``.
    """

    format_name: ClassVar[str] = ""
    stores_positions: ClassVar[bool] = False  # whether the index records each sample's file position
    stores_fields: ClassVar[bool] = False  # whether the format stores fields (``append_field``)

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
        fields: Sequence[Any] = (),
    ) -> None:
        self.path = os.fspath(path)
        self.fields = check_fields(fields)
        if self.fields and not self.stores_fields:
            raise ValueError(f"the {self.format_name} format stores no fields yet; of the formats, "
                             f"{', '.join(_field_formats())} do")
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
        self._builder = IndexBuilder(offsets=mode == "encoded" or self.stores_positions,
                                     positions=self.stores_positions)
        self._field_builder = FieldIndexBuilder([spec.name for spec in self.fields], positions=self.stores_positions)
        self._closed = False
        if os.path.lexists(self.path) and not overwrite:
            raise ArchiveExistsError(self.path, "already exists", hint="pass overwrite=True to replace it")
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise DestinationError(self.path, f"the destination directory {parent} does not exist")
        self.temp_path = temp_path_for(self.path)
        self._pid = os.getpid()  # a forked child must never clean up its parent's output
        self.begin(self.temp_path)

    # ---- what a backend provides -------------------------------------------------
    @abc.abstractmethod
    def begin(self, temp_path: str) -> None:
        """Create the archive at ``temp_path``."""

    @abc.abstractmethod
    def append(self, blob: bytes, i: int, crc: int) -> int:
        """Store sample i's bytes (``crc``: their CRC32, computed once for the index and any format
        that records it too); return its absolute file position or -1."""

    def append_field(self, name: str, blob: bytes, i: int, crc: int) -> int:
        """Store the bytes of field ``name`` of sample i (after the sample's image, fields in their declared
        order); return their absolute file position or -1.  Formats with ``stores_fields`` override this."""
        raise NotImplementedError(f"the {self.format_name} format stores no fields")

    def place_fields(self, arrays: Dict[str, np.ndarray]) -> None:
        """Called once every sample is appended, before the index is sealed: a format that kept its field
        values aside moves them into place and corrects their positions in ``arrays`` (default: nothing)."""

    @abc.abstractmethod
    def finish(self, index: SampleIndex, manifest: ArchiveManifest) -> None:
        """Write the index, then the manifest (the seal) last, and close."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Close whatever is open, quietly (the temporary output is removed after)."""

    def final_positions(self) -> Optional[np.ndarray]:
        """Each sample's file position, for formats that know them only once every sample is
        written (HDF5 allocates chunks itself); stored as the index's ``positions``, under its
        checksum.  None (the default): the positions ``append`` returned, if any."""
        return None

    @property
    def raw_shape(self) -> Tuple[int, int, int]:
        """(H, W, C) of a raw archive's samples."""
        if self.shape is None:
            raise ValueError("only a raw archive has a fixed sample shape")
        return self.shape

    # ---- the public writing API --------------------------------------------------
    def __len__(self) -> int:
        return self._builder.count

    def add(self, sample: Any, label: int, key: Optional[str] = None, fields: Optional[Dict[str, Any]] = None) -> int:
        """Append one sample (encoded bytes, HxWxC uint8 array or PIL image) and its ``fields`` (a value for
        each field the writer declares); return its index.  A sample that cannot be stored
        (InvalidSampleError) leaves nothing of itself written: the writer goes on with the next."""
        if self._closed:
            raise ClosedArchiveError(self.path, "the writer is closed")
        i = self._builder.count
        key = f"{i:08d}" if key is None else str(key)
        label = self._check_label(label, i, key)
        blob = self._to_blob(sample, i, key)
        values = self._field_blobs(fields, i, key)  # all checked before anything of the sample is written
        crc = crc32(blob)
        position = self.append(blob, i, crc)
        for name, value in values:
            value_crc = crc32(value)
            self._field_builder.append(name, value_crc, len(value), self.append_field(name, value, i, value_crc))
        self._builder.append(label, key, crc, len(blob), position)
        return i

    def _field_blobs(self, values: Optional[Dict[str, Any]], i: int, key: str) -> List[Tuple[str, bytes]]:
        """(name, stored bytes) of each declared field of sample i, in order (InvalidSampleError naming
        the field when one is missing, unknown or no value of its kind)."""
        values = {} if values is None else values
        unknown = sorted(set(values) - {spec.name for spec in self.fields})
        if unknown:
            declared = ", ".join(spec.describe() for spec in self.fields) or "none"
            raise InvalidSampleError(self.path, f"fields {unknown} are not declared (the writer's fields: {declared})",
                                     index=i, key=key, hint="declare them: fields=[...] or --field NAME=KIND")
        out = []
        for spec in self.fields:
            if spec.name not in values or values[spec.name] is None:
                raise InvalidSampleError(self.path, f"field {spec.name!r} has no value", index=i, key=key)
            try:
                out.append((spec.name, spec.encode(values[spec.name])))
            except FieldValueError as exc:
                raise InvalidSampleError(self.path, str(exc), index=i, key=key) from None
        return out

    def close(self) -> None:
        """Seal, spot-check and publish the archive at ``path``."""
        if self._closed:
            return
        self._closed = True
        try:
            index = self._builder.build()
            positions = self.final_positions()
            if positions is not None:
                index = dataclasses.replace(index, positions=np.asarray(positions, dtype=np.int64))
            if self.fields:
                arrays = self._field_builder.build(len(index))
                self.place_fields(arrays)
                index = dataclasses.replace(index, fields=arrays)
            checksums = [(name, array_crc32(array)) for name, array in index.arrays().items()]
            manifest = new_manifest(
                self.format_name, self.mode, len(index), self.classes, self.shape, self._manifest_encoding(), checksums,
                fields=self.fields,
            )
            self.finish(index, manifest)
            del index, positions  # the file holds the index now: the spot check maps it from there
            self._spot_check(manifest.count)
            publish(self.temp_path, self.path, overwrite=self.overwrite)
        except BaseException:
            self.discard()
            remove_path(self.temp_path)
            raise

    def abort(self) -> None:
        """Discard everything written; ``path`` is left as it was."""
        if not self._closed:
            self._closed = True
            self.discard()
        remove_path(self.temp_path)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_pid", None) == os.getpid():
            try:
                self.abort()
            except Exception:
                pass

    # ---- helpers -------------------------------------------------------------------
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
            pixels = codecs.to_array(sample, channels=self.raw_shape[2])
        except codecs.DecodeError as exc:
            raise InvalidSampleError(self.path, f"cannot store sample: {exc}", index=i, key=key) from None
        if pixels.shape != self.raw_shape:
            h, w, c = pixels.shape
            raise InvalidSampleError(
                self.path,
                f"image is {h}x{w}x{c} (HxWxC), the raw archive holds {'x'.join(map(str, self.raw_shape))}",
                index=i,
                key=key,
                hint="resize it first, e.g. packed-formats convert --size",
            )
        return np.ascontiguousarray(pixels).tobytes()

    def _spot_check(self, count: int) -> None:
        from . import spec

        with Reader(self.temp_path, spec(self.format_name).backend, verify=True) as reader:
            if len(reader) != count:
                raise CorruptArchiveError(self.path, f"wrote {count} samples but the archive holds {len(reader)}")
            for i in {0, count - 1} if count else ():
                reader.read(i)
                for field in self.fields:
                    reader.read_field(i, field.name)


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


def _field_formats() -> List[str]:
    """The registered formats whose writers store fields."""
    from . import SPECS

    return [spec.name for spec in SPECS if spec.writer is not None and spec.writer.stores_fields]

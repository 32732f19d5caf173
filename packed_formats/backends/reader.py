"""The one ``Reader``: read-only access to an archive of any format, safe to share with DataLoader workers.

It composes a format's ``Backend`` (``base.py``) with what no format implements itself: worker
safety (``handles.SharedHandle``: one handle per process), checksums and the verify policy, index
checks, the check that the archive's files are unchanged before each read, and error wording.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import numpy as np

from ..checksum import array_crc32, crc32
from ..errors import (
    ArchiveChangedError,
    ArchiveNotFoundError,
    ClosedArchiveError,
    CorruptArchiveError,
    CorruptSampleError,
    FormatMismatchError,
    SampleIndexError,
)
from ..fields import FieldSpec, FieldValueError
from ..handles import ProcessLocal, SharedHandle
from ..index import SampleIndex, anonymous_array, field_array
from ..manifest import NO_LABEL, ArchiveManifest
from ..native import planar_copy, to_interleaved, to_planar
from ..policy import VerifyPolicy, check_verify
from ..tracebacks import drops_frames
from .base import Backend, Blob, Handle
from .files import (
    DAMAGED_HINT,
    Identity,
    changed_error,
    fd_identity,
    file_identity,
    handle_key,
    named_failures,
    replaced_error,
)


class Reader:
    """Read-only access to one archive; safe to share with DataLoader workers.

    ``read(i)`` returns a raw sample as an HxWxC uint8 array, an encoded one as
    its stored bytes; ``read_many(idx)`` returns one [B,H,W,C] array (raw) or a
    list of bytes (encoded).  ``verify`` checks samples against their stored
    CRC32: on every read (True), the first time each process reads a sample
    ("once"), or never (False).  A raw archive stores each sample's pixels
    interleaved (``raw_layout`` "hwc") or planar ("chw"); every read hands
    them out as above either way, and ``read_many_planar`` reads [B,C,H,W]
    batches, a plain copy of a planar archive's bytes (``read_many_stored``:
    the bytes as stored).  Nothing is held open by the process that
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
        self._check_image_sizes()
        self._check_labels()
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
        if m.raw_layout != "hwc":
            layout += f", raw_layout={m.raw_layout}"
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
        """The stored bytes of sample i (pixels for raw, as laid out: planar in a "chw" archive; file bytes for
        encoded)."""
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
        if self.manifest.raw_layout == "hwc":
            return self._read_stored(handle, indices, out)
        if self._gather_moved(handle, indices, out, np.arange(len(indices)), planar=False):
            return out
        stored = self._read_stored(handle, indices, np.empty((len(indices),) + self.backend.stored_shape, np.uint8))
        return to_interleaved(stored, out)  # planar -> interleaved

    @drops_frames
    def read_many_stored(self, idx: "Sequence[int] | np.ndarray", out: Optional[np.ndarray] = None) -> np.ndarray:
        """Raw samples idx as the archive stores them: a [B] + stored shape array ([B,H,W,C], or [B,C,H,W]
        when the archive is planar), each sample's bytes copied as they are and checked (the verify policy).
        ``out``, when given, is such an array to read into."""
        indices = self.check_indices(idx)
        if self.manifest.mode != "raw":
            raise ValueError(f"{self.path}: only raw archives store pixels")
        shape = (len(indices),) + self.backend.stored_shape
        if out is None:
            out = np.empty(shape, dtype=np.uint8)
        elif out.shape != shape or out.dtype != np.uint8:
            raise ValueError(f"out must be uint8 {shape}, got {out.dtype} {out.shape}")
        return self._read_stored(self._unchanged_handle(), indices, out)

    def _read_stored(self, handle: Handle, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The checked ``indices`` into ``out`` ([B] + stored shape), as stored, each sample then verified."""
        if len(indices):
            with named_failures(self.path, "cannot read a batch of samples"):
                self.backend.read_batch(handle, indices, out)
            for j in self._unverified(indices):
                self._verify(int(indices[j]), out[j])
        return out

    def _gather_moved(self, handle: Handle, indices: np.ndarray, out: np.ndarray, places: np.ndarray,
                      planar: bool) -> bool:
        """Samples ``indices`` into rows ``places`` of ``out``, their channels parted (``planar``) or joined on
        the one copy, as one gather from the file's map (``MappedRows.gather_moved``), each sample's stored
        bytes checked there first (the verify policy).  False, nothing read, where the format keeps no map
        of its samples, ``out`` is not C-contiguous or the C module is not built (the caller then copies)."""
        if not len(indices) or not out.flags.c_contiguous or planar_copy() != "native":
            return False
        mapped = self.backend.rows_of(handle)
        if mapped is None:
            return False
        for j in self._unverified(indices):
            self._read_checked(handle, int(indices[j]))
        with named_failures(self.path, "cannot read a batch of samples"):
            mapped.gather_moved(indices, out, places, planar)
        return True

    def _unverified(self, indices: np.ndarray) -> "Sequence[int] | np.ndarray":
        """The places in ``indices`` whose samples the verify policy still has to check: none without
        verify, those not yet checked with "once" (found for the whole batch at once), else all."""
        if self.verify is False:
            return ()
        if self.verify == "once":
            verified = self._verified.get()
            return np.flatnonzero(((verified[indices >> 3] >> (indices & 7).astype(np.uint8)) & 1) == 0)
        return range(len(indices))

    @drops_frames
    def read_many_planar(self, idx: "Sequence[int] | np.ndarray", out: np.ndarray,
                         rows: Optional[np.ndarray] = None) -> np.ndarray:
        """Raw samples idx into ``out``, a uint8 [B,C,H,W] array (a contiguous NCHW batch, say): each
        sample copied once, straight from where the archive keeps it, its channels parted on the way,
        with no [B,H,W,C] batch between.  Each sample's stored bytes are checked (the verify policy)
        before they are copied, as ``read`` does.  A planar archive's batch is one plain read of its
        bytes (``read_many_stored``): nothing to part.  ``rows``: sample j goes to ``out[rows[j]]``
        (``out`` then any [R,C,H,W] batch the rows are in: a batch other archives fill the rest of).
        """
        indices = self.check_indices(idx)
        if self.manifest.mode != "raw":
            raise ValueError(f"{self.path}: only raw archives read into planar batches")
        h, w, c = self.backend.shape
        places = np.arange(len(indices)) if rows is None else np.asarray(rows, dtype=np.int64)
        if len(places) != len(indices) or (len(places) and not 0 <= places.min() <= places.max() < len(out)):
            raise ValueError(f"rows must give each of the {len(indices)} samples a row of out")
        shape = (len(indices) if rows is None else len(out), c, h, w)
        if out.shape != shape or out.dtype != np.uint8:
            raise ValueError(f"out must be uint8 {shape}, got {out.dtype} {out.shape}")
        handle = self._unchanged_handle()
        if self.manifest.raw_layout == "chw":
            if rows is None:
                return self._read_stored(handle, indices, out)
            out[places] = self._read_stored(handle, indices, np.empty((len(indices), c, h, w), np.uint8))
            return out
        if self._gather_moved(handle, indices, out, places, planar=True):
            return out
        for j, i in zip(places.tolist(), indices.tolist()):
            to_planar(self.backend.as_pixels(self._read_checked(handle, i), i), out[j])  # the one copy
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

    def _check_image_sizes(self) -> None:
        """The recorded image sizes (``widths`` and ``heights``), when there are any: both, of an encoded
        archive, int32, each side from 1, or both 0 (a header that did not read), so that no grouping
        by aspect ratio trusts a forged size.  A set's parts check their own."""
        widths, heights = self.index.widths, self.index.heights
        if (widths is None and heights is None) or self.backend.joins_parts:
            return
        if widths is None or heights is None or self.manifest.mode != "encoded":
            problem = ("the index records image widths or heights, not both" if self.manifest.mode == "encoded"
                       else "the index of a raw archive records image sizes (its manifest gives their shape)")
            raise CorruptArchiveError(self.path, problem, hint=DAMAGED_HINT)
        for name, array in (("widths", widths), ("heights", heights)):
            if array.dtype != np.int32 or array.ndim != 1:
                raise CorruptArchiveError(self.path, f"the index array {name!r} is {array.dtype} of {array.ndim} "
                                                     f"dimensions, not int32 of 1", hint=DAMAGED_HINT)
        w, h = np.asarray(widths), np.asarray(heights)
        bad = np.flatnonzero((w < 0) | (h < 0) | ((w == 0) != (h == 0)))
        if len(bad):
            i = int(bad[0])
            raise CorruptArchiveError(self.path, f"the index records sample {i}'s image size as {int(w[i])} x "
                                                 f"{int(h[i])} pixels (width x height), which no image has",
                                      index=i, key=self.index.key(i), hint=DAMAGED_HINT)

    def _check_labels(self) -> None:
        """Every label as the manifest declares them: -1 (``NO_LABEL``) in an archive without labels, else
        a class (>= 0, and below the number of classes where it names them), so that no sample of a set
        that has labels is read as having none, or the other way round.  A set's parts check their own."""
        labels = self.index.labels
        if self.backend.joins_parts or not len(labels):
            return
        low, high = int(labels.min()), int(labels.max())
        if not self.manifest.labelled:
            if low == high == NO_LABEL:
                return
            i = int(np.flatnonzero(np.asarray(labels) != NO_LABEL)[0])
            problem = f"the manifest says the samples have no label, but sample {i} has label {int(labels[i])}"
        else:
            top = len(self.manifest.classes)
            if low >= 0 and (high < top or not top):
                return
            i = int(np.flatnonzero((np.asarray(labels) < 0) | (np.asarray(labels) >= (top or high + 1)))[0])
            problem = (f"sample {i} has label {int(labels[i])}, no class of the archive's {top}" if top else
                       f"sample {i} has label {int(labels[i])}, but the manifest says the samples have labels")
        raise CorruptArchiveError(self.path, problem, index=i, key=self.index.key(i), hint=DAMAGED_HINT)

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


def _close_handle(handle: Handle) -> None:
    handle.close()


def _discard_handle(handle: Handle) -> None:
    handle.discard_inherited()

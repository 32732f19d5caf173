"""The contract a format implements: ``Handle``, ``Backend``, ``FormatSpec`` and ``WriteTransaction``.

A format is a ``Backend`` (how its samples are stored: metadata without a
handle, a per-process ``Handle``, reading sample ``i`` or a batch into
``out``) and a ``Writer``, registered with one ``FormatSpec``.  The rest
lives beside this file, once for every format:

* ``reader.py``: ``Reader``, which composes a ``Backend`` with worker safety
  (``handles.SharedHandle``), checksums and their policy, index checks and
  error wording.
* ``writer.py``: ``Writer`` (a ``WriteTransaction``), whose hooks (``begin``,
  ``append``, ``finish``, ``discard``; ``append_field`` and ``place_fields``
  for fields) a format overrides; it seals, spot-checks and publishes
  atomically.
* ``files.py``: what the backends share about files (identity, the errors
  for an archive changed under its reader, ``named_failures``, atomic
  publication); ``mapped.py``: gathers from memory maps.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, Generic, List, Optional, Tuple, Type, TypeVar

import numpy as np

from ..errors import CorruptArchiveError, CorruptSampleError
from ..index import SampleIndex
from ..manifest import ArchiveManifest
from .files import DAMAGED_HINT, Identity, file_identity

if TYPE_CHECKING:  # FormatSpec names the Writer class; writer.py imports this module
    from .mapped import MappedRows
    from .writer import Writer

Blob = Any  # bytes, memoryview or a 1-D uint8 numpy array


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

    def rows_of(self, handle: H) -> "Optional[MappedRows]":
        """A raw archive's samples as rows of a map of its file (see mapped.py), where the format keeps them
        so and the file holds them; None otherwise (the format's own reads then)."""
        return None

    def read_batch(self, handle: H, idx: np.ndarray, out: np.ndarray) -> None:
        """Fill out[j] with raw sample idx[j] as stored (``out``: [B] + ``stored_shape``, its bytes copied
        as they are, whatever the layout); formats override this when they can do better than a loop."""
        for j, i in enumerate(idx):
            out[j] = self.as_stored(self.read(handle, int(i)), int(i))

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
    def stored_shape(self) -> Tuple[int, int, int]:
        """The shape a raw sample's bytes are stored in: (H, W, C), or (C, H, W) in a planar archive."""
        return self._required(self.manifest.stored_shape, "shape")

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

    def as_stored(self, blob: Blob, i: int) -> np.ndarray:
        """A raw sample's bytes as the array they are stored as, ``stored_shape`` (CorruptSampleError if
        the size is wrong)."""
        array = blob if isinstance(blob, np.ndarray) else np.frombuffer(blob, dtype=np.uint8)
        if array.size != self.sample_nbytes:
            raise self.corrupt(f"raw sample has {array.size} bytes, expected {self.sample_nbytes}", i)
        return array.reshape(self.stored_shape)

    def as_pixels(self, blob: Blob, i: int) -> np.ndarray:
        """A raw sample's bytes as its HxWxC array (a view: strided when the archive is planar)."""
        stored = self.as_stored(blob, i)
        return stored.transpose(1, 2, 0) if self.manifest.raw_layout == "chw" else stored


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


# ---- what a writer is ----------------------------------------------------------------------------------
class WriteTransaction(abc.ABC):
    """As a context manager: ``close()`` (publish) on success, ``abort()`` on error.

    A format's writer extends ``writer.Writer``, which implements both and asks the format for its
    hooks (``begin``, ``append``, ``finish``, ``discard``; ``append_field`` and ``place_fields`` where
    it stores fields); a set of parts' writer (``sharded.ShardedWriter``) implements them itself.
    """

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

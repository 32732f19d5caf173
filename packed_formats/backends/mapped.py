"""Raw samples of one size at known file positions, gathered from a memory map (every format's map path).

Once a process has touched the pages, a shuffled batch is gathered from a
mapped file as fast as from ordinary memory.  Evenly spaced rows (memmap
archives by definition; ZIP archives written here, whose equal member names
make equal local headers; contiguous HDF5 datasets) are one strided view.
Rows that touch (memmap, HDF5) are a batch of one ``numpy.take``
(``mode="clip"``, the indices being checked already; the default mode buffers
the whole batch): a ``memcpy`` per row, with the GIL released, so that
threads gather side by side.  Measured on a 2-core machine, batches of 64
samples of 3x256x256 from a warm 384 MiB archive in one thread:
``numpy.take`` 44-47k samples/s, ``torch.index_select`` 39k (its copy loop is
slower than glibc's ``memcpy``, and two threads calling it got no faster
than one), one ``pread`` per sample slower still.  Rows apart (a ZIP's member
headers between them) are copied one by one, each a ``memcpy`` with the GIL
released: ``numpy.take`` makes a view that is not contiguous contiguous
first, a copy of the whole map for each batch (2,400 samples/s from a 576 MiB
ZIP, where the copies per row read 61-73k).  Samples
at uneven positions (HDF5 chunks, other ZIPs) are gathered with one
``torch.cat`` of their slices where the process has imported torch (a
DataLoader, ``PackedDataset``), else a loop of slice copies: reading batches
never costs torch's import (~0.5 GiB, seconds).

A mapped file truncated in place while it is read would kill the reader with
SIGBUS.  Archives are only ever replaced whole (``os.replace``), which leaves
mapped readers on the old file; against other writers, every gather first
checks that the file still holds what the map covers (one ``fstat``) and
raises ``FileTruncatedError`` if not.  A truncation between that check and
the copy can still end the process: that race is not closed.
"""

from __future__ import annotations

import mmap
import os
import sys
import warnings
from typing import TYPE_CHECKING, Optional, Tuple

import numpy as np

from .. import native

if TYPE_CHECKING:
    import torch

_CHUNK = 1 << 16  # positions checked per step: a temporary of 512 KiB whatever the archive's size (a larger
# one stays in the heap of every worker: glibc keeps freed blocks of several MiB for reuse)


class FileTruncatedError(OSError):
    """The mapped file became shorter than the samples mapped from it."""


def check_file_size(fd: int, needed: int) -> None:
    """FileTruncatedError when the open file ``fd`` is shorter than the ``needed`` bytes a map of it
    covers (reading a page past its end would end the process with SIGBUS)."""
    size = os.fstat(fd).st_size
    if size < needed:
        raise FileTruncatedError(f"the file was truncated to {size} bytes while mapped ({needed} bytes)")


def torch_imported() -> bool:
    """Whether this process has imported torch: only then are batches gathered with it (see above)."""
    return "torch" in sys.modules


def as_tensor(array: np.ndarray) -> "torch.Tensor":
    """A read-only mapped array as a tensor (torch warns that it is not writable; nothing writes to it)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def even_step(positions: np.ndarray) -> Optional[int]:
    """The distance between consecutive positions when it is one constant, else None."""
    if len(positions) < 2:
        return 0 if len(positions) else None
    step = int(positions[1]) - int(positions[0])
    if step <= 0:
        return None
    for start in range(0, len(positions) - 1, _CHUNK):  # in chunks: no N-sized temporary per process
        part = np.asarray(positions[start : start + _CHUNK + 1])
        if not (np.diff(part) == step).all():
            return None
    return step


class MappedRows:
    """Samples of ``nbytes`` in a read-only map of a file: at byte ``positions``, or ``count``
    rows one after the other from byte ``start``.

    Evenly spaced rows are one strided view and a batch is one ``numpy.take``;
    otherwise a batch is one ``torch.cat`` of the samples' slices.  The tensor
    over the map is made by the first such gather, so that a process that only
    reads single samples never imports torch.  The map is closed with the rows.
    """

    def __init__(self, map: mmap.mmap, nbytes: int, positions: Optional[np.ndarray] = None,
                 start: int = 0, count: int = 0) -> None:
        self.map = map
        self.size = len(map)  # bytes the map covers, which the file must keep
        self.data: Optional[np.ndarray] = np.frombuffer(map, dtype=np.uint8)  # the file's bytes, read-only
        self.nbytes = int(nbytes)
        self.positions = None if positions is None else np.asarray(positions, dtype=np.int64)
        self.even: Optional[Tuple[int, int, int]] = None  # (count, step, start) of evenly spaced rows
        step: Optional[int] = self.nbytes
        if self.positions is not None:
            step, start, count = even_step(self.positions), int(self.positions[0]), len(self.positions)
        if step is not None and step >= nbytes:
            self.even = (count, max(step, 1), start)
        self._flat: "Optional[torch.Tensor]" = None  # the map as a tensor, for uneven rows

    def _tensors(self) -> "torch.Tensor":
        """The whole map as a uint8 tensor, made on first use."""
        if self._flat is None:
            assert self.data is not None, "gather after close()"
            self._flat = as_tensor(self.data)
        return self._flat

    @classmethod
    def of(cls, fd: int, positions: np.ndarray, nbytes: int) -> Optional["MappedRows"]:
        """The rows at ``positions`` of the open file ``fd``, or None when one would lie past its end."""
        if not len(positions) or os.fstat(fd).st_size < int(np.max(positions)) + nbytes:
            return None  # a truncated file: let the positional reads say where
        return cls(mmap.mmap(fd, 0, access=mmap.ACCESS_READ), nbytes, positions)

    def gather(self, idx: np.ndarray, out: np.ndarray) -> None:
        """out[j] = row idx[j] (``out`` C-contiguous; every idx[j] a row); FileTruncatedError if the file shrank."""
        self.check_size()
        assert self.data is not None, "gather after close()"
        n, target = self.nbytes, out.reshape(len(idx), self.nbytes)
        if self.even is not None:
            count, step, start = self.even
            if step == n:  # rows that touch: one take
                rows = np.lib.stride_tricks.as_strided(self.data[start:], (count, n), (step, 1), writeable=False)
                np.take(rows, idx, axis=0, out=target, mode="clip")  # "raise" would buffer the batch
            else:  # rows apart: take would copy the whole map to make them touch
                self._copy_each(self.starts(idx), target)
            return
        if torch_imported():
            import torch

            flat = self._tensors()
            torch.cat([flat[p : p + n] for p in self.starts(idx).tolist()], out=torch.from_numpy(out).view(-1))
            return
        self._copy_each(self.starts(idx), target)

    def starts(self, idx: np.ndarray) -> np.ndarray:
        """The byte in the map where each row idx[j] starts (int64)."""
        if self.even is not None:
            _, step, start = self.even
            return start + idx.astype(np.int64) * step
        assert self.positions is not None
        return self.positions[idx]

    def gather_moved(self, idx: np.ndarray, out: np.ndarray, places: np.ndarray, planar: bool) -> None:
        """out[places[j]] = row idx[j], an image, its channels parted (``planar``: H x W x C rows into ``out``
        [R, C, H, W]) or joined (C x H x W rows into [R, H, W, C]): one call of the C module for the batch
        (``native.gather``, which needs it built and ``out`` C-contiguous)."""
        self.check_size()
        assert self.data is not None, "gather after close()"
        native.gather(self.data, self.starts(idx), out, places, planar)

    def _copy_each(self, starts: np.ndarray, target: np.ndarray) -> None:
        """target[j] = the row at byte ``starts[j]``: a copy (a ``memcpy``, the GIL released) per row."""
        assert self.data is not None, "gather after close()"
        n = self.nbytes
        for j, p in enumerate(starts.tolist()):
            target[j] = self.data[p : p + n]

    def check_size(self) -> None:
        """FileTruncatedError when the file no longer holds every mapped byte (reading them would SIGBUS)."""
        size = self.map.size()  # fstat of the mapped file
        if size < self.size:
            raise FileTruncatedError(f"the file was truncated to {size} bytes while mapped ({self.size} bytes)")

    def close(self) -> None:
        self.data = self._flat = None
        try:
            self.map.close()
        except BufferError:  # a view still lives somewhere; unmapped when it dies
            pass

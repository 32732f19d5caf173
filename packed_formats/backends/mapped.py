"""Raw samples of one size at known file positions, gathered from a memory map (every format's map path).

Once a process has touched the pages, ``torch.index_select`` over a mapped
file gathers a shuffled batch as fast as from ordinary memory: 256 samples of
256x256x3 in ~4 ms, against ~8-10 ms for one ``pread`` per sample (measured on
a warm 576 MiB archive).  memmap archives are laid out this way by definition;
ZIP archives written here are too (equal member names, so equal local
headers).  Samples at uneven positions (HDF5 chunks, other ZIPs) are gathered
with one ``torch.cat`` of their slices.

torch is used only where the process has imported it already (a DataLoader,
``PackedDataset``): ``Reader.read_many`` returns a numpy array, and a process
that never imported torch gathers with numpy instead (``numpy.take`` with
``mode="clip"``, the indices being checked already: ~5 ms for the batch above;
with the default mode it buffers the whole batch and takes ~14-19 ms), so that
reading batches never costs torch's import (~0.5 GiB, seconds).

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


def gather(rows: "torch.Tensor", idx: np.ndarray, out: np.ndarray) -> None:
    """out[j] = rows[idx[j]] with one ``index_select`` (``out`` C-contiguous, shaped like rows[idx])."""
    import torch

    target = torch.from_numpy(out).view((len(idx),) + tuple(rows.shape[1:]))
    torch.index_select(rows, 0, torch.from_numpy(np.asarray(idx, dtype=np.int64)), out=target)


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

    Evenly spaced rows are one strided view and a batch is one
    ``index_select``; otherwise a batch is one ``torch.cat`` of the samples'
    slices (~5 ms for the 256-sample batch above).  The tensors over the map
    are made by the first gather, so that a process that only reads single
    samples never imports torch.  The map is closed with the rows.
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
        self._views: "Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]" = None

    @property
    def flat(self) -> "Optional[torch.Tensor]":
        """The whole map as a uint8 tensor (None once closed)."""
        return None if self.data is None else self._tensors()[0]

    @property
    def rows(self) -> "Optional[torch.Tensor]":
        """The evenly spaced rows as one strided [count, nbytes] tensor, else (or once closed) None."""
        return None if self.data is None else self._tensors()[1]

    def _tensors(self) -> "Tuple[torch.Tensor, Optional[torch.Tensor]]":
        if self._views is None:
            assert self.data is not None, "gather after close()"
            flat = as_tensor(self.data)
            rows = None
            if self.even is not None:
                count, step, start = self.even
                rows = flat.as_strided((count, self.nbytes), (step, 1), start)
            self._views = (flat, rows)
        return self._views

    @classmethod
    def of(cls, fd: int, positions: np.ndarray, nbytes: int) -> Optional["MappedRows"]:
        """The rows at ``positions`` of the open file ``fd``, or None when one would lie past its end."""
        if not len(positions) or os.fstat(fd).st_size < int(np.max(positions)) + nbytes:
            return None  # a truncated file: let the positional reads say where
        return cls(mmap.mmap(fd, 0, access=mmap.ACCESS_READ), nbytes, positions)

    def gather(self, idx: np.ndarray, out: np.ndarray) -> None:
        """out[j] = row idx[j] (``out`` C-contiguous; every idx[j] a row); FileTruncatedError if the file shrank."""
        self.check_size()
        if not torch_imported():
            self._gather_numpy(idx, out)
            return
        import torch

        flat, rows = self._tensors()
        if rows is not None:
            gather(rows, idx, out)
            return
        assert self.positions is not None
        n = self.nbytes
        torch.cat([flat[p : p + n] for p in self.positions[idx].tolist()], out=torch.from_numpy(out).view(-1))

    def _gather_numpy(self, idx: np.ndarray, out: np.ndarray) -> None:
        assert self.data is not None, "gather after close()"
        n, target = self.nbytes, out.reshape(len(idx), self.nbytes)
        if self.even is not None:
            count, step, start = self.even
            rows = np.lib.stride_tricks.as_strided(self.data[start:], (count, n), (step, 1), writeable=False)
            np.take(rows, idx, axis=0, out=target, mode="clip")  # "raise" would buffer the batch
            return
        assert self.positions is not None
        for j, p in enumerate(self.positions[idx].tolist()):
            target[j] = self.data[p : p + n]

    def check_size(self) -> None:
        """FileTruncatedError when the file no longer holds every mapped byte (reading them would SIGBUS)."""
        size = self.map.size()  # fstat of the mapped file
        if size < self.size:
            raise FileTruncatedError(f"the file was truncated to {size} bytes while mapped ({self.size} bytes)")

    def close(self) -> None:
        self.data = self._views = None
        try:
            self.map.close()
        except BufferError:  # a view still lives somewhere; unmapped when it dies
            pass

"""Batches of images of one shape: ``shuffle=GroupByAspectRatio(k)``, torchvision's grouped batches.

Detection models batch images of different sizes by padding them to the largest of the batch; batches
whose images share an aspect ratio waste little padding.  Each sample falls in a bin of aspect ratio
(width / height), and a rank's share of the epoch's shuffled order is cut into batches bin by bin: a
batch is handed out as soon as its bin has ``batch_size`` samples, in the order the share fills them.
The samples left in part-filled bins at the end of the share are batched together, in the share's order
(those batches mix bins), so an epoch has as many batches as without grouping.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, List, Optional, Sequence

import numpy as np

from .. import codecs, policy
from ..errors import CorruptSampleError, PackedFormatError

if TYPE_CHECKING:
    from ..backends.reader import Reader

SCAN_CHUNK = 256  # samples read at once when their image sizes are looked up


class GroupByAspectRatio:
    """``make_loader(shuffle=GroupByAspectRatio(k=3))``: shuffled batches, each of one aspect-ratio bin.

    The bins are torchvision's (``create_aspect_ratio_groups``): edges ``2 ** linspace(-1, 1, 2k + 1)``
    of width / height, so ``2k + 2`` bins, the outer two open (below 1/2 and above 2).  Each epoch's order
    is the shuffled one of ``shuffle=True`` (seeded by seed and epoch, the same for any number of
    workers); each rank's share of it is cut into batches as the share fills each bin, and the samples
    left in part-filled bins at the end of the share are batched together in the share's order (bins
    mixed; with drop_last the short last batch goes), so that an epoch has as many batches as without
    grouping.  An encoded archive's image sizes come from its index, which records each image's size when
    it is written (a raw archive's images are all one size): no sample is read.  Only an archive written
    before the index recorded them (or an image whose header did not read then) has its images' headers
    read once, when the loader is made: a pass over the archive's bytes, which ``sizes`` saves where they
    are known (an annotation file's).  An epoch under way resumes exactly on the same
    number of ranks; on another it is refused (its batches do not follow the share's positions).
    Not for a ``Mixture``.

    Args:
        k: bins on each side of ratio 1 (torchvision's reference uses 3).
        sizes: int [N,2], each sample's (width, height), in the archive's order (None: the index's, else read).
    """

    def __init__(self, k: int = 3, sizes: "np.ndarray | Sequence[Sequence[int]] | None" = None) -> None:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= 64:
            raise ValueError(f"GroupByAspectRatio's k must be an integer from 1 to 64 (bins each side of a "
                             f"ratio of 1), got {k!r}")
        self.k: int = int(k)
        self.sizes: Optional[np.ndarray] = None if sizes is None else _checked_sizes(sizes)

    def edges(self) -> np.ndarray:
        """The bin edges of width / height: ``2 ** linspace(-1, 1, 2k + 1)``."""
        return np.power(2.0, np.linspace(-1, 1, 2 * self.k + 1))

    def groups(self, sizes: np.ndarray) -> np.ndarray:
        """int64 [N]: the bin of each of ``sizes`` (int [N,2] of (width, height)), as ``np.digitize`` gives it."""
        ratios = sizes[:, 0].astype(np.float64) / np.maximum(sizes[:, 1], 1)
        return np.digitize(ratios, self.edges()).astype(np.int64)

    def sizes_of(self, reader: "Reader", skip_bad: bool) -> np.ndarray:
        """int64 [N,2]: the (width, height) of each of ``reader``'s samples: ``sizes`` (ValueError when
        they are not as many), else the index's or read (``image_sizes``)."""
        if self.sizes is None:
            return image_sizes(reader, skip_bad)
        if len(self.sizes) != len(reader):
            raise ValueError(f"GroupByAspectRatio's sizes give {len(self.sizes)} samples' sizes, {reader.path} "
                             f"has {len(reader)} samples")
        return self.sizes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GroupByAspectRatio) and other.k == self.k

    def __hash__(self) -> int:
        return hash(("GroupByAspectRatio", self.k))

    def __repr__(self) -> str:
        return f"GroupByAspectRatio(k={self.k})"


def _checked_sizes(sizes: "np.ndarray | Sequence[Sequence[int]]") -> np.ndarray:
    """``sizes`` as int64 [N,2] of positive (width, height); ValueError saying what they must be."""
    array = np.asarray(sizes)
    if array.ndim != 2 or array.shape[1] != 2 or not np.issubdtype(array.dtype, np.integer) or (array < 1).any():
        raise ValueError(f"GroupByAspectRatio's sizes must be integers [N, 2], each sample's (width, height) from 1, "
                         f"got an array of {array.dtype} {list(array.shape)}")
    return array.astype(np.int64)


def image_sizes(reader: "Reader", skip_bad: bool) -> np.ndarray:
    """int64 [N,2]: each sample's stored (width, height): the index's record of them (a raw archive's
    from its shape), and read from the image's header where the index records none or an unknown size
    (0, 0).  With ``skip_bad``, a sample that does not read counts as square (its batch leaves it out
    later); else its CorruptSampleError is raised."""
    n = len(reader)
    shape = reader.manifest.shape
    if reader.mode == "raw":
        if shape is None:
            raise PackedFormatError(reader.path, "a raw archive whose manifest gives no sample shape")
        return np.tile(np.array([[shape[1], shape[0]]], dtype=np.int64), (n, 1))
    recorded = reader.index.image_sizes()  # checked when the archive was opened
    if recorded is None:
        sizes, unknown = np.ones((n, 2), dtype=np.int64), np.arange(n, dtype=np.int64)
    else:
        sizes, unknown = recorded, np.flatnonzero(recorded[:, 0] == 0)
        sizes[unknown] = 1
    for start in range(0, len(unknown), SCAN_CHUNK):
        idx = unknown[start : start + SCAN_CHUNK]
        try:
            blobs: List = list(reader.read_many(idx))
        except CorruptSampleError:
            if not skip_bad:
                raise
            blobs = [_bytes_or_none(reader, i) for i in idx.tolist()]
        for i, blob in zip(idx.tolist(), blobs):
            if blob is None:
                continue
            try:
                sizes[i] = policy.image_size(blob)
            except codecs.DecodeError as exc:
                if not skip_bad:
                    raise reader.sample_error(i, f"{exc} (reading its size for GroupByAspectRatio)") from None
    return sizes


def _bytes_or_none(reader: "Reader", i: int) -> "bytes | None":
    try:
        return reader.read_bytes(i)
    except CorruptSampleError:
        return None


def grouped_batches(order: np.ndarray, groups: np.ndarray, batch_size: int, drop_last: bool) -> List[np.ndarray]:
    """``order`` (a rank's share) cut into batches of one bin each (``groups[i]`` is sample i's), each
    handed out when its bin's ``batch_size``-th sample comes in the order; then the samples left in
    part-filled bins, in the order, cut into batches (the short last one dropped with ``drop_last``)."""
    order = np.asarray(order, dtype=np.int64)
    bins = groups[order]
    by_bin = np.argsort(bins, kind="stable")  # the share's positions, bin by bin, each bin in order
    counts = np.bincount(bins, minlength=int(bins.max(initial=0)) + 1)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank_in_bin = np.empty(len(order), dtype=np.int64)
    rank_in_bin[by_bin] = np.arange(len(order)) - np.repeat(starts, counts)
    full = rank_in_bin < (counts[bins] // batch_size) * batch_size  # positions in a full batch of their bin
    batches = []
    last = np.flatnonzero(full & (rank_in_bin % batch_size == batch_size - 1))  # where each full batch completes
    for end in last.tolist():
        b, r = bins[end], rank_in_bin[end]
        members = by_bin[starts[b] + r - batch_size + 1 : starts[b] + r + 1]
        batches.append(order[members])
    rest = order[~full]
    stop = (len(rest) // batch_size) * batch_size if drop_last else len(rest)
    batches.extend(rest[a : a + batch_size] for a in range(0, stop, batch_size))
    return batches

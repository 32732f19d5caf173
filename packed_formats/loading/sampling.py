"""Which samples, in which order, on which rank, and the seeds of each batch's randomness.

A ``BatchSampler`` yields one ``BatchPlan`` (epoch, batch number, sample
indices) per batch of this rank's share of an epoch.  Orders follow
``DistributedSampler`` (``shard_indices``); shuffle="window" shuffles a set's
parts, then the samples within each window of a few parts (``window_order``),
so that a bounded cache of parts fetches each part once an epoch.
Randomness comes from seeds mixed from (seed, epoch, rank, batch number):
reproducible, distinct per batch, epoch and rank, and independent of how
many workers make the batches.  An
``EpochPosition`` says how far an epoch has come, so that it can be continued
exactly, on the same number of ranks or on another.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import random
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..handles import leave_with_parent
from .aspect_groups import GroupByAspectRatio, grouped_batches


class BatchPlan(NamedTuple):
    """One batch to make: its epoch, its number within the epoch, and its sample indices."""

    epoch: int
    number: int
    indices: np.ndarray


# ---- order ------------------------------------------------------------------------------------------
Shuffle = Union[bool, str, GroupByAspectRatio]  # True, False, "window" or GroupByAspectRatio(k)
DEFAULT_WINDOW = 8  # parts per window of shuffle="window"


def check_shuffle(shuffle: Any, window: Any) -> Tuple[Shuffle, int]:
    """(shuffle, window) checked: shuffle True, False, "window" or a ``GroupByAspectRatio``; window a
    positive integer (parts).

    Raises:
        ValueError: naming ``shuffle`` or ``window`` and what it must be.
    """
    if isinstance(shuffle, (bool, np.bool_)):
        shuffle = bool(shuffle)
    elif not (isinstance(shuffle, str) and shuffle == "window") and not isinstance(shuffle, GroupByAspectRatio):
        raise ValueError(f"shuffle must be True or False, 'window' (parts shuffled, then samples within each "
                         f"window of `window` parts) or pf.GroupByAspectRatio(k), got {shuffle!r}")
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, numbers.Integral) or window < 1:
        raise ValueError(f"window must be a positive integer (parts whose samples are shuffled together), "
                         f"got {window!r}")
    return shuffle, int(window)


def epoch_order(n: int, *, epoch: int = 0, seed: int = 0, shuffle: Shuffle = True,
                starts: Optional[np.ndarray] = None, window: int = DEFAULT_WINDOW) -> np.ndarray:
    """The epoch's global order of all ``n`` samples, the same on every rank.

    shuffle=True (and a ``GroupByAspectRatio``, whose batches are cut from this order): ``torch.randperm``
    seeded with ``seed + epoch`` (as ``DistributedSampler``); False: 0..n-1; "window": ``window_order`` over the
    parts whose first samples are ``starts`` (None: one part, ``[0, n]``).
    """
    if shuffle == "window":
        return window_order(np.array([0, n]) if starts is None else starts, epoch=epoch, seed=seed, window=window)
    if shuffle:
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).numpy()
    return np.arange(n, dtype=np.int64)


def part_windows(parts: int, *, epoch: int = 0, seed: int = 0, window: int = DEFAULT_WINDOW) -> List[np.ndarray]:
    """The parts of each window of an epoch of ``window_order``, window after window (of ``parts`` parts).

    What a reader of parts fetches, in order: the parts of one window are all
    read while that window lasts, and none of them before or after it.  One
    window of all parts when ``window >= parts``.
    """
    if parts <= window:
        return [np.arange(parts, dtype=np.int64)]
    permuted = _window_generator(seed, epoch).permutation(parts)
    return [permuted[w : w + window] for w in range(0, parts, window)]


def _window_generator(seed: int, epoch: int) -> np.random.Generator:
    """The generator of an epoch of windows, from ``seed + epoch`` (as the global shuffle): numpy's, whose
    in-place shuffle of a window is several times faster than ``torch.randperm`` and a gather."""
    return np.random.default_rng((seed + epoch) % 2**64)


def window_order(starts: "np.ndarray | Sequence[int]", *, epoch: int = 0, seed: int = 0,
                 window: int = DEFAULT_WINDOW) -> np.ndarray:
    """The epoch's order of shuffle="window": the parts shuffled, then the samples of each window of
    ``window`` consecutive parts (of that order) shuffled together, window after window.

    ``starts`` are the parts' first samples with the total at the end (len = parts + 1,
    ``Reader.part_starts``).  So a cache of ``window`` parts fetches each part once an epoch.
    Seeded with ``seed + epoch``; with one part, or ``window >= parts``, it is the global
    shuffle (``epoch_order(n, shuffle=True)``).  Drawn in one vector pass over the samples
    and one in-place shuffle per window: about half a second for 14 million samples.
    """
    starts = np.asarray(starts, dtype=np.int64)
    parts, n = len(starts) - 1, int(starts[-1])
    if parts <= window:
        return epoch_order(n, epoch=epoch, seed=seed, shuffle=True)
    generator = _window_generator(seed, epoch)
    permuted = generator.permutation(parts)  # part_windows' draw: the same parts
    counts = np.diff(starts)[permuted]
    ends = np.cumsum(counts)  # in the parts' shuffled order: where each part's samples end
    # sample k of that order is k - (where its part begins there) + (where its part begins in the set)
    order = np.arange(n, dtype=np.int64) - np.repeat(ends - counts - starts[permuted], counts)
    bounds = np.concatenate([[0], ends[window - 1 :: window], [n]])
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        generator.shuffle(order[a:b])
    return order


def parts_in_order(order: np.ndarray, starts: "np.ndarray | Sequence[int]") -> np.ndarray:
    """The parts that the samples ``order`` (a slice of an epoch's order) read, in the order they are
    first read: what to fetch, and in what order, to follow it."""
    owner = np.searchsorted(np.asarray(starts, dtype=np.int64), order, side="right") - 1
    parts, first = np.unique(owner, return_index=True)
    return parts[np.argsort(first, kind="stable")]


def split_order(order: np.ndarray, *, rank: int = 0, world_size: int = 1, drop_last: bool = False) -> np.ndarray:
    """Rank ``rank``'s share of ``order``, exactly as ``DistributedSampler`` splits a dataset.

    With several ranks and ``drop_last=False`` the order is padded by repeating
    its first items until it divides evenly, so up to ``world_size - 1`` items
    are seen twice; with ``drop_last=True`` the tail is dropped instead.  Rank r
    takes every world_size-th item from r.
    """
    if world_size <= 1:
        return order
    n = len(order)
    if drop_last:
        order = order[: (n // world_size) * world_size]
    else:
        total = math.ceil(n / world_size) * world_size
        order = np.concatenate([order, np.resize(order, total - n)]) if total > n else order
    return order[rank::world_size]


def share_length(n: int, world_size: int, drop_last: bool) -> int:
    """How many items ``split_order`` gives each rank of ``n``."""
    if world_size <= 1:
        return n
    return n // world_size if drop_last else math.ceil(n / world_size)


def shard_indices(
    n: int, *, epoch: int = 0, seed: int = 0, shuffle: Shuffle = True, rank: int = 0, world_size: int = 1,
    drop_last: bool = False, start: int = 0, starts: Optional[np.ndarray] = None, window: int = DEFAULT_WINDOW,
) -> np.ndarray:
    """This rank's sample order for one epoch, exactly as ``DistributedSampler`` gives it.

    Every rank draws the same global order (``epoch_order``) and takes its
    share (``split_order``: interleaved, padded or cut to divide evenly).
    ``start`` > 0 splits only the global order's positions from ``start`` on:
    the rest of an epoch resumed on another number of ranks (``EpochPosition``).
    ``starts`` and ``window`` are those of shuffle="window" (``window_order``):
    as every rank splits the same order, all ranks read the same window at once.
    """
    order = epoch_order(n, epoch=epoch, seed=seed, shuffle=shuffle, starts=starts, window=window)
    return split_order(order[start:], rank=rank, world_size=world_size, drop_last=drop_last)


def batch_count(items: int, batch_size: int, drop_last: bool) -> int:
    """Batches of ``batch_size`` made of ``items`` (drop_last: without the short last one)."""
    return items // batch_size if drop_last else math.ceil(items / batch_size)


@dataclass
class EpochPosition:
    """How far an epoch has come on this rank: enough to continue it exactly.

    The epoch's global order (``epoch_order``) is split over ``world_size``
    ranks from its position ``start`` on (``shard_indices``), and each rank has
    delivered the first ``done`` steps of its share (a step is a batch for a
    loader, a sample for a sampler).  ``first_batch`` numbers the split's first
    batch, so batches keep the numbers (and so the random draws) they had.
    A fresh epoch is ``EpochPosition(epoch, world_size=...)``.
    """

    epoch: int
    start: int = 0
    world_size: int = 1
    done: int = 0
    first_batch: int = 0

    def positions_done(self, n: int, step: int) -> int:
        """Positions of the global order (of ``n``) that some rank has delivered.

        Rank r's i-th item is the split's position r + i*world_size, so after
        ``done`` steps of ``step`` items on every rank the split's first
        done*step*world_size positions are done (the padding lies beyond ``n``).
        """
        return min(n, self.start + self.done * step * self.world_size)

    def moved_to(self, world_size: int, n: int, step: int) -> "EpochPosition":
        """The same progress as a split over ``world_size`` ranks: the positions not yet done, split anew.

        Same world size: unchanged (each rank continues its own share).  Other
        world size: a new split from the first position no rank has delivered,
        its batches numbered on from the ones done.
        """
        if world_size == self.world_size:
            return self
        return EpochPosition(self.epoch, self.positions_done(n, step), world_size, 0, self.first_batch + self.done)


class BatchSampler(torch.utils.data.Sampler):
    """Yields one ``BatchPlan`` per batch of this rank's share of an epoch.

    ``epoch`` says which epoch the next iteration plans; the caller sets it.
    ``start``, ``first_batch`` and ``skip`` continue an interrupted epoch: the
    share is split from the global order's position ``start`` on
    (``shard_indices``), batches are numbered from ``first_batch``, and the
    first ``skip`` of them are left out (they were delivered before).
    ``set_epoch`` is ``DistributedSampler``'s: code written for a DataLoader
    calls it on ``loader.sampler``, and the loader that owns this sampler
    (``call_on_set_epoch``) decides what it means for a pass under way or resumed.
    ``shuffle`` is True, False or "window" (``window_order`` of ``window`` parts
    of those whose first samples are ``starts``; None: one part, ``[0, n]``).
    ``draw`` (a mixture's: ``draw(epoch, seed, shuffle)``) gives the epoch's global order
    of ``n`` positions in place of ``epoch_order``; it is split over ranks the same way.
    ``groups`` (int [n], each sample's aspect-ratio bin) goes with a ``GroupByAspectRatio`` shuffle:
    the share is then cut into batches bin by bin (``aspect_groups.grouped_batches``).
    """

    def __init__(self, n: int, batch_size: int, shuffle: Shuffle, drop_last: bool, seed: int, rank: int,
                 world_size: int, *, window: int = DEFAULT_WINDOW, starts: Optional[np.ndarray] = None,
                 draw: Optional[Callable[[int, int, Shuffle], np.ndarray]] = None,
                 groups: Optional[np.ndarray] = None) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.shuffle, self.window = check_shuffle(shuffle, window)
        self.n, self.batch_size, self.drop_last = n, batch_size, drop_last
        self.starts = np.array([0, n], dtype=np.int64) if starts is None else starts
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.draw, self.groups = draw, groups
        if isinstance(self.shuffle, GroupByAspectRatio) and (groups is None or len(groups) != n):
            raise ValueError("shuffle=GroupByAspectRatio needs the aspect-ratio bin of each of the samples (groups)")
        self.epoch = 0
        self.start, self.first_batch, self.skip = 0, 0, 0
        self._on_set_epoch: Optional[weakref.WeakMethod[Callable[[int], None]]] = None
        self.prefetcher: Any = None  # a remote set's: given the next batches' samples as each plan is made
        self.ahead_batches = 4

    def call_on_set_epoch(self, method: Callable[[int], None]) -> None:
        """Hand ``set_epoch`` to ``method``, a bound method held weakly: its loader must go (workers
        and all) as soon as its user drops it, not wait for the garbage collector to find a cycle."""
        self._on_set_epoch = weakref.WeakMethod(method)

    def set_epoch(self, epoch: int) -> None:
        """Plan ``epoch`` next (shuffled with ``seed + epoch``), as ``DistributedSampler.set_epoch`` does."""
        method = None if self._on_set_epoch is None else self._on_set_epoch()
        if method is not None:
            method(int(epoch))
        else:
            self.epoch = int(epoch)

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_on_set_epoch"] = None  # a weak reference does not pickle: the unpickled loader hands it again
        return state

    def place(self, position: EpochPosition) -> None:
        """Plan the next iteration from ``position`` (of this sampler's world size)."""
        self.epoch, self.start = position.epoch, position.start
        self.first_batch, self.skip = position.first_batch, position.done

    def __iter__(self) -> Iterator[BatchPlan]:
        """The plans of the next iteration, as placed now, made one by one as they are asked for.

        The epoch's order is drawn on the first request, not here: a DataLoader asks
        for an iterator twice before it uses one, and at millions of samples each
        draw costs a good part of a second, and a list of plans far more.
        """
        order_of = functools.partial(
            shard_indices, self.n, epoch=self.epoch, seed=self.seed, shuffle=self.shuffle, rank=self.rank,
            world_size=self.world_size, drop_last=self.drop_last, start=self.start, starts=self.starts,
            window=self.window,
        )
        if self.draw is not None:
            order_of = functools.partial(_drawn_share, self.draw, self.epoch, self.seed, self.shuffle, self.start,
                                         self.rank, self.world_size, self.drop_last)
        return self._plans(self.epoch, self.first_batch, self.skip, order_of)

    def _plans(self, epoch: int, first_batch: int, skip: int, order_of: Callable[[], np.ndarray]
               ) -> Iterator[BatchPlan]:
        order, bs, prefetcher = order_of(), self.batch_size, self.prefetcher
        if isinstance(self.shuffle, GroupByAspectRatio) and self.groups is not None:  # batches bin by bin
            batches = grouped_batches(order, self.groups, bs, self.drop_last)
            order = np.concatenate(batches) if batches else order[:0]  # in the order the batches read it
        if prefetcher is not None:
            prefetcher.new_epoch()
        try:
            for k in range(skip, batch_count(len(order), bs, self.drop_last)):
                if prefetcher is not None:  # this batch's parts kept, the next few batches' fetched meanwhile
                    prefetcher.ahead(order[k * bs : (k + 1 + self.ahead_batches) * bs], current=bs)
                yield BatchPlan(epoch, first_batch + k, order[k * bs : (k + 1) * bs])
        finally:
            if prefetcher is not None:
                prefetcher.close()

    def split_batches(self, start: int = 0) -> int:
        """Batches of this rank's share of a split from position ``start`` (0: a whole epoch)."""
        share = share_length(max(0, self.n - start), self.world_size, self.drop_last)
        return batch_count(share, self.batch_size, self.drop_last)

    def __len__(self) -> int:
        """Batches the next iteration yields."""
        return max(0, self.split_batches(self.start) - self.skip)


def _drawn_share(draw: Callable[[int, int, Shuffle], np.ndarray], epoch: int, seed: int, shuffle: Shuffle,
                 start: int, rank: int, world_size: int, drop_last: bool) -> np.ndarray:
    """This rank's share of a drawn epoch order from position ``start`` on (as ``shard_indices`` splits one,
    or as the draw splits itself: a mixture's whole batches per source are split batch by batch)."""
    if hasattr(draw, "split"):
        return draw.split(epoch, seed, shuffle, start, rank, world_size, drop_last)
    return split_order(draw(epoch, seed, shuffle)[start:], rank=rank, world_size=world_size, drop_last=drop_last)


def rank_and_world_size(distributed: Optional[bool]) -> Tuple[int, int]:
    """(rank, world size) of this process: torch.distributed's when ``distributed`` (None: when it
    is initialised), else (0, 1).  ValueError when asked for before it is initialised.

    With ``distributed=None``, a launcher's WORLD_SIZE > 1 but no process group gives one
    ``UnshardedWarning``: every rank would then read every sample.
    """
    ready = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed is None:
        distributed = ready
        if not ready:
            _warn_if_launched()
    if not distributed:
        return 0, 1
    if not ready:
        raise ValueError("distributed=True needs torch.distributed.init_process_group() to be called first")
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


class UnshardedWarning(UserWarning):
    """A launcher started several ranks, but the loader found no process group: it is not sharded."""


_warned_unsharded = False


def _warn_if_launched() -> None:
    global _warned_unsharded
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world > 1 and not _warned_unsharded:
        _warned_unsharded = True
        warnings.warn(
            UnshardedWarning(
                f"WORLD_SIZE={world} says a launcher started several ranks, but torch.distributed has no process "
                "group yet: every rank reads every sample.  Call torch.distributed.init_process_group() before "
                "iterating (the loader splits samples when an epoch starts), or pass distributed=False to mean it."
            ),
            stacklevel=4,
        )


# ---- seeds ------------------------------------------------------------------------------------------
def batch_seed(seed: int, epoch: int, rank: int, number: int) -> int:
    """A 64-bit seed for one batch, mixed from (seed, epoch, rank, batch number)."""
    state = np.random.SeedSequence([seed, epoch, rank, number]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 32 | int(state[1])


def batch_generator(seed: int, epoch: int, rank: int, number: int) -> torch.Generator:
    """The CPU generator for one batch's random transforms."""
    return torch.Generator().manual_seed(batch_seed(seed, epoch, rank, number))


def seed_globals(seed: int) -> None:
    """Seed this process's global RNGs (random, numpy, torch) for user callables."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class WorkerInit:
    """A picklable ``worker_init_fn`` (spawn and forkserver need one)."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank = seed, rank

    def __call__(self, worker_id: int) -> None:
        """Give each worker distinct global RNG states before its first batch, and make it end with its
        main process (``handles.leave_with_parent``)."""
        leave_with_parent()
        seed_globals(int(np.random.SeedSequence([self.seed, self.rank, worker_id, 0x5EED]).generate_state(1)[0]))

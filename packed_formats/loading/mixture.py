"""Weighted mixtures of archives: several archives read as one, each epoch a seeded draw from them.

``Mixture({"imagenet.zip": 0.8, "extra.lmdb": 0.2})`` is what ``make_loader`` (and
``PackedDataset``) take where they take an archive path.  Opened (``Mixture.open``), it is one
``Reader`` whose samples are the sources' samples end to end (source 0's first, as a set of
parts presents its parts: ``MixtureBackend``), with labels mapped to the mixture's classes.
An epoch is not that concatenation but a draw from it (``MixtureDraw``): ``samples_per_epoch``
positions, each source's share of them its weight's, every source a stream of its own
shuffled passes (or independent draws, with replacement), the sources interleaved at random.
The draw depends on nothing but (seed, epoch), so the loader's workers, slots, ranks and
resume work on it as on an archive's shuffled order.  With ``batches="per-source"`` the draw deals
whole batches to the sources instead of samples; with make_loader's ``shuffle="window"`` each
source's passes are window orders of its own parts (``sampling.window_order``), and the parts of
sources in object storage are fetched ahead through the node-local cache (``MixtureParts``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .. import storage
from ..archives import open_archive
from ..backends.reader import Reader
from ..backends.sharded import ShardedBackend, ShardedHandle
from ..checksum import array_crc32, crc32
from ..errors import CorruptSampleError, MixtureError
from ..index import JoinedArray, SampleIndex, part_of
from ..policy import VerifyPolicy, check_choice
from .sampling import DEFAULT_WINDOW, Shuffle, split_order, window_order

CLASS_MODES = ("merge", "separate")
BATCH_MODES = ("mixed", "per-source")
PASS_BLOCK = 1 << 16  # samples of a source's passes shuffled together (``MixtureDraw._passes``)
Source = Union[str, "os.PathLike[str]"]


class Mixture:
    """Several archives read as one, each drawn from in proportion to its weight.

    Give it to ``make_loader`` (or ``PackedDataset``) in place of an archive path:
    ``pf.make_loader(pf.Mixture({"imagenet.zip": 0.8, "extra.lmdb": 0.2}), batch_size=256)``.

    An epoch is ``samples_per_epoch`` samples (default: all the sources' samples
    together).  Source k's share of them is its weight's (``weight_k / sum of weights``,
    rounded so that the shares add up: ``shares``), the same every epoch; the positions
    of the epoch that each source fills are drawn at random, so every batch holds each
    source in proportion to its weight, within the spread of a random draw.  Without
    replacement (the default) each source is read as an endless stream of its own
    shuffled passes, cut into one share per epoch: a source smaller than its share
    repeats (each pass shuffled anew), a larger one is subsampled, and the next epoch
    goes on where this one stopped, so every sample of it is read before any is read
    again.  With replacement, each of a source's draws is any of its samples.
    ``shuffle=False`` (make_loader's) reads each source's passes in order and
    interleaves the sources evenly, in a fixed pattern.  ``shuffle="window"`` (without
    replacement only) makes each pass of a source a window order of its own parts, so
    that a cache smaller than the sources fetches each part of them once a pass.

    With ``batches="per-source"`` every batch comes from one source: the epoch's batches
    (``samples_per_epoch / batch_size``, rounded up) are dealt to the sources by their
    weights and drawn in a random order, each filled with the next ``batch_size`` draws of
    its source.  Raw sources of other shapes then mix without ``size=`` (each batch is of
    its source's shape).  Under ranks every rank's batch of one step comes from one source.

    The draw depends on (seed, epoch) only: the same for any number of workers and
    any start method, a new one after ``set_epoch``; ranks split it as they split an
    archive's order, and a loader's ``state_dict`` resumes it exactly, also on another
    number of ranks.  A state saved for another mixture (other sources, their order,
    weights, replacement, classes or samples per epoch) is refused.

    Args:
        sources: ``{path or URL: weight}`` (or a sequence of ``(path or URL, weight)``
            pairs), in the order the sources' samples are numbered; weights are positive
            numbers, in any scale.  Sources may be of any format, sets of parts or URLs,
            all raw (of one shape), or encoded ones with raw ones (read as images, so batches need
            ``size=`` or a transform that starts with a crop, as encoded images of mixed sizes do).
        samples_per_epoch: samples in an epoch (None: the sources' counts added up).
        replacement: draw with replacement (True), or not (False), for every source or
            ``{path or URL: bool}`` per source (those left out: False).
        classes: "merge" (the default): classes of the same name are one class, numbered in
            order of first appearance over the sources; "separate": each source keeps its
            own classes, numbered after the previous sources' and named ``"source/class"``.
        batches: "mixed" (the default): batches mixed sample by sample; "per-source": each batch
            wholly from one source, the batches dealt by the weights.

    The batches' labels are the mixture's (``loader.classes`` lists its classes);
    ``return_index`` gives each sample as ``(source, index in it)``.  Every source must
    hold the ``fields`` asked for (``MixtureError`` names the one that does not).
    """

    def __init__(self, sources: "Mapping[Source, float] | Sequence[Tuple[Source, float]]",
                 samples_per_epoch: Optional[int] = None, *,
                 replacement: "bool | Mapping[Source, bool]" = False, classes: str = "merge",
                 batches: str = "mixed") -> None:
        pairs = list(sources.items()) if isinstance(sources, Mapping) else list(sources)
        if not pairs:
            raise ValueError("a Mixture needs at least one source: {path or URL: weight}")
        self.sources: List[str] = []
        self.weights: List[float] = []
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"a Mixture's sources are {{path or URL: weight}} or (path or URL, weight) pairs, "
                                 f"got {pair!r}")
            source, weight = pair
            if not isinstance(source, (str, os.PathLike)):
                raise TypeError(f"a Mixture's source is an archive path or URL, got {type(source).__name__}")
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not (
                    math.isfinite(weight) and weight > 0):
                raise ValueError(f"the weight of {os.fspath(source)!r} must be a positive finite number, got "
                                 f"{weight!r}")
            self.sources.append(os.fspath(source))
            self.weights.append(float(weight))
        if len(set(self.sources)) != len(self.sources):
            raise ValueError(f"a Mixture names each source once, got {self.sources}")
        if samples_per_epoch is not None and (isinstance(samples_per_epoch, bool) or not isinstance(
                samples_per_epoch, numbers.Integral) or samples_per_epoch < 1):
            raise ValueError(f"samples_per_epoch must be a positive integer (or None: the sources' counts added "
                             f"up), got {samples_per_epoch!r}")
        self.samples_per_epoch = None if samples_per_epoch is None else int(samples_per_epoch)
        self.replacement = self._replacement(replacement)
        check_choice("classes", classes, CLASS_MODES)
        check_choice("batches", batches, BATCH_MODES)
        self.classes, self.batches = classes, batches

    def _replacement(self, replacement: "bool | Mapping[Source, bool]") -> List[bool]:
        if isinstance(replacement, Mapping):
            given = {os.fspath(k): v for k, v in replacement.items()}
            unknown = sorted(set(given) - set(self.sources))
            if unknown:
                raise ValueError(f"replacement names {unknown}, which are not sources of this Mixture")
            values = [given.get(s, False) for s in self.sources]
        else:
            values = [replacement] * len(self.sources)
        for source, value in zip(self.sources, values):
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"replacement of {source!r} must be True or False, got {value!r}")
        return [bool(v) for v in values]

    @property
    def names(self) -> List[str]:
        """Each source's name in messages and separate class names: its file name, or the whole path or URL
        where two sources share a file name."""
        short = [os.path.basename(s.rstrip("/" + os.sep)) or s for s in self.sources]
        return [b if short.count(b) == 1 else s for b, s in zip(short, self.sources)]

    def __repr__(self) -> str:
        weights = ", ".join(f"{s!r}: {w:g}" for s, w in zip(self.sources, self.weights))
        return (f"Mixture({{{weights}}}, samples_per_epoch={self.samples_per_epoch}, "
                f"replacement={self.replacement}, classes={self.classes!r}, batches={self.batches!r})")

    def open(self, verify: VerifyPolicy = True, format: Optional[str] = None, **remote: Any) -> Reader:
        """The mixture as one ``Reader`` (see ``MixtureBackend``): each source opened with ``verify``
        (each checks its own samples), ``format`` insisted on for each, ``remote`` (``cache_dir``,
        ``cache_limit``, ``storage_options``) for those that are URLs.

        Raises:
            MixtureError: the sources do not mix (raw ones of other shapes, or among encoded ones of
                other than uint8 RGB or grey pixels), or one is empty.
            PackedFormatError: a source cannot be opened (naming it).
        """
        readers: List[Reader] = []
        try:
            for source in self.sources:
                readers.append(open_archive(source, format=format, verify=verify, **remote))
            backend = MixtureBackend.of(self, readers)
            backend.opened_with = (format, dict(remote))
        except BaseException:
            for reader in readers:
                reader.close()
            raise
        return Reader.of_backend(backend, verify=False, path=backend.path)  # each source verifies its own reads


@dataclasses.dataclass(frozen=True)
class MixtureDraw:
    """The order of an epoch of a mixture: what ``BatchSampler`` splits over ranks and batches.

    ``sizes`` are the sources' sample counts (their samples numbered end to end), ``shares``
    each source's samples in an epoch, ``replacement`` each source's way of drawing.
    ``part_starts`` are each source's parts (``Reader.part_starts``) and ``window`` the parts of a
    window, for shuffle="window".  ``batch`` > 0 deals whole batches of that many samples to the
    sources by ``weights`` (``batches="per-source"``); 0 mixes them sample by sample.
    """

    sizes: Tuple[int, ...]
    shares: Tuple[int, ...]
    replacement: Tuple[bool, ...]
    part_starts: Tuple[Tuple[int, ...], ...] = ()
    window: int = DEFAULT_WINDOW
    weights: Tuple[float, ...] = ()
    batch: int = 0

    @property
    def batch_shares(self) -> Tuple[int, ...]:
        """Each source's batches in an epoch (``batch`` > 0): the epoch's batches (its samples over
        ``batch``, rounded up) dealt by the weights."""
        return shares(self.weights, -(-sum(self.shares) // self.batch)) if self.batch else ()

    def share(self, k: int) -> int:
        """Source k's samples in an epoch."""
        return self.batch_shares[k] * self.batch if self.batch else self.shares[k]

    @property
    def samples(self) -> int:
        return sum(self.share(k) for k in range(len(self.sizes)))

    def __call__(self, epoch: int, seed: int, shuffle: Shuffle = True) -> np.ndarray:
        """The epoch's order: ``samples`` indices into the sources' samples end to end (int64).

        Source k's draws fill the positions of the epoch its share was dealt (at random, or
        evenly when not ``shuffle``), in the order of its stream (``source_draws``); with
        ``batch``, whole batches of positions are dealt.
        """
        seed, epoch = int(seed) % 2**64, int(epoch) % 2**64
        starts = np.cumsum((0,) + self.sizes)
        dealt = self.batch_shares if self.batch else self.shares
        owner = np.repeat(np.arange(len(dealt), dtype=np.int64), dealt)
        if shuffle:
            np.random.default_rng([seed, epoch, 0x313] + ([0xBA7] if self.batch else [])).shuffle(owner)
        else:  # each source's k-th draw at (k + 1/2) / share of the epoch: evenly spread
            spread = np.concatenate([(np.arange(c) + 0.5) / c for c in dealt if c])
            owner = owner[np.argsort(spread, kind="stable")]
        if self.batch:
            owner = np.repeat(owner, self.batch)
        order = np.empty(len(owner), dtype=np.int64)
        positions = np.argsort(owner, kind="stable")  # source 0's positions in order, then source 1's...
        ends = np.cumsum([self.share(k) for k in range(len(self.sizes))])
        for k in range(len(self.sizes)):
            share = self.share(k)
            if share:
                draws = self.source_draws(k, epoch, seed, shuffle)
                order[positions[ends[k] - share : ends[k]]] = starts[k] + draws
        return order

    def split(self, epoch: int, seed: int, shuffle: Shuffle, start: int, rank: int, world_size: int,
              drop_last: bool) -> np.ndarray:
        """This rank's share of the epoch's order from position ``start`` on (``BatchSampler``'s split).

        Mixed batches: split as an archive's order is (``split_order``).  Whole batches per source:
        the batches are split, rank r taking every ``world_size``-th from r (padded with the first
        ones, or cut, to divide evenly), so every batch a rank makes is one of the draw's.
        """
        order = self(epoch, seed, shuffle)[start:]
        if not self.batch:
            return split_order(order, rank=rank, world_size=world_size, drop_last=drop_last)
        batches = order[: len(order) // self.batch * self.batch].reshape(-1, self.batch)
        picked = split_order(np.arange(len(batches)), rank=rank, world_size=world_size, drop_last=drop_last)
        return batches[picked].ravel()

    def source_draws(self, k: int, epoch: int, seed: int, shuffle: Shuffle) -> np.ndarray:
        """Source k's draws of an epoch, as indices into it.  With replacement: ``share`` independent
        uniform draws.  Without: positions ``epoch * share`` on of its stream of passes, pass p the
        source's samples shuffled with (seed, k, p) (in order, when not ``shuffle``; a window order of
        its parts, when "window")."""
        size, share = self.sizes[k], self.share(k)
        if self.replacement[k]:
            return np.random.default_rng([seed, epoch, k, 0x5EE]).integers(0, size, share, dtype=np.int64)
        first, last = epoch * share, (epoch + 1) * share  # Python ints: no overflow
        stream = self._passes(k, seed, first // size, (last - 1) // size, shuffle)
        offset = first - (first // size) * size
        return stream[offset : offset + share]

    def _passes(self, k: int, seed: int, first: int, last: int, shuffle: Shuffle) -> np.ndarray:
        """Passes ``first`` to ``last`` of source k's stream, end to end.  Pass p is a function of (seed, k, p)
        only: the passes of a block of ``PASS_BLOCK`` samples are shuffled together (row by row, one
        generator a block), so that a small source repeated many times an epoch costs a few vector calls.
        A window pass is ``window_order`` of the source's parts, seeded by (seed, k) and p."""
        size = self.sizes[k]
        if not shuffle:
            return np.tile(np.arange(size, dtype=np.int64), last - first + 1)
        if shuffle == "window":
            source_seed = int(np.random.SeedSequence([seed, k, 0x3D0]).generate_state(1, np.uint64)[0]) >> 2
            starts = np.asarray(self.part_starts[k], dtype=np.int64)
            return np.concatenate([window_order(starts, epoch=p % 2**62, seed=source_seed, window=self.window)
                                   for p in range(first, last + 1)])
        per_block = max(1, PASS_BLOCK // size)
        rows = []
        for b in range(first // per_block, last // per_block + 1):
            block = np.tile(np.arange(size, dtype=np.int64), (per_block, 1))
            block = np.random.default_rng([seed, k, b, 0x9A55]).permuted(block, axis=1)
            low, high = max(first, b * per_block) - b * per_block, min(last, (b + 1) * per_block - 1) - b * per_block
            rows.append(block[low : high + 1].ravel())
        return np.concatenate(rows)


def shares(weights: Sequence[float], samples: int) -> Tuple[int, ...]:
    """``samples`` dealt in proportion to ``weights``: each source's whole part, the rest one each to the
    largest remainders (the first source first among equals), so that they add up to ``samples``."""
    total = sum(weights)
    exact = [samples * w / total for w in weights]
    dealt = [int(math.floor(e)) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda k: (-(exact[k] - dealt[k]), k))
    for k in by_remainder[: samples - sum(dealt)]:
        dealt[k] += 1
    return tuple(dealt)


class MixtureBackend(ShardedBackend):
    """The sources of a mixture as one archive: their samples end to end, read by the source that holds
    them (as a set of parts is), their labels mapped to the mixture's classes.

    It opens nothing of its own and checks no checksum: each source's ``Reader`` checks its own reads
    with its verify policy, and its errors name it and the sample's index in it.
    """

    format_name = "mixture"
    pickles_itself = True  # its labels are its own array (each source maps its index again where unpickled)

    def __init__(self, path: str, manifest: Any, index: SampleIndex, parts: Sequence[Reader], *,
                 names: Sequence[str], draw: MixtureDraw, identity: int, offsets: Sequence[int]) -> None:
        super().__init__(path, manifest, index, parts)
        self.names, self.draw, self.mixture_crc32, self.drawn_crc32 = list(names), draw, identity, identity
        self.class_offsets = list(offsets)
        self.mixture: Optional[Mixture] = None  # what it was opened from, and how (``reopen``)
        self.opened_with: Tuple[Optional[str], Dict[str, Any]] = (None, {})

    def reopen(self, verify: VerifyPolicy) -> Reader:
        """The same mixture opened again, with ``verify`` (a loader's own reader of a PackedDataset's)."""
        assert self.mixture is not None
        format, remote = self.opened_with
        return self.mixture.open(verify, format=format, **remote)

    @classmethod
    def of(cls, mixture: Mixture, readers: List[Reader]) -> "MixtureBackend":
        """The backend of ``mixture``'s sources opened as ``readers`` (MixtureError if they do not mix)."""
        names = mixture.names
        _check_mix(readers, names, whole_batches=mixture.batches == "per-source")
        classes, tables, offsets = _mixed_classes(readers, names, mixture.classes)
        labels = np.concatenate([_mapped(np.asarray(r.labels), t) for r, t in zip(readers, tables)])
        samples = mixture.samples_per_epoch or sum(len(r) for r in readers)
        draw = MixtureDraw(tuple(len(r) for r in readers), shares(mixture.weights, samples),
                           tuple(mixture.replacement), tuple(tuple(r.part_starts.tolist()) for r in readers),
                           weights=tuple(mixture.weights))
        first = readers[0].manifest
        encodings = {r.manifest.encoding for r in readers}
        encoding: Optional[str]
        if any(r.mode != first.mode for r in readers):  # raw and encoded: raw samples are read as PPM images
            mode, shape, encoding = "encoded", None, "mixed"
        else:
            mode, shape = first.mode, first.shape
            if len({r.manifest.shape for r in readers}) > 1:  # raw ones of other shapes, whole batches of each
                shape = None
            encoding = (encodings.pop() if len(encodings) == 1 else "mixed") if first.mode != "raw" else None
        manifest = dataclasses.replace(
            first, format=cls.format_name, count=len(labels), classes=tuple(classes), checksum=None, mode=mode,
            shape=shape, encoding=encoding, index_crc32=(), part=-1, set_id="", fields=_common_fields(readers),
            raw_layout=first.raw_layout if mode == "raw" else "hwc",  # raw sources of other layouts read in this one
        )
        keys = JoinedArray(_SourceKeys(readers), np.cumsum([0] + [len(r) for r in readers]).astype(np.int64),
                           np.result_type(*[r.index.keys.dtype for r in readers]))
        index = SampleIndex(labels=labels, keys=keys)  # type: ignore[arg-type]
        description = ", ".join(f"{n} ({w:g})" for n, w in zip(names, mixture.weights))
        identity = crc32(json.dumps({
            "sources": [[n, len(r), array_crc32(np.asarray(r.labels))] for n, r in zip(names, readers)],
            "weights": mixture.weights, "samples": samples, "replacement": mixture.replacement,
            "classes": mixture.classes, **({"batches": mixture.batches} if mixture.batches != "mixed" else {}),
        }).encode())
        backend = cls(f"mixture of {description}", manifest, index, readers, names=names, draw=draw,
                      identity=identity, offsets=offsets)
        backend.mixture = mixture
        return backend

    def data_file(self) -> Optional[str]:
        return None  # no file of its own: each source checks its own files as it reads

    def plan(self, batch_size: int, shuffle: Shuffle, window: int) -> None:
        """Draw epochs for batches of ``batch_size`` (whole ones per source, when the mixture asks for
        them) and windows of ``window`` parts (shuffle="window"): what ``make_loader`` was asked for.
        A window draw depends on how each source is cut into parts, so its identity then does too."""
        per_source = self.mixture is not None and self.mixture.batches == "per-source"
        batch = int(batch_size) if per_source and batch_size > 0 else 0
        self.draw = dataclasses.replace(self.draw, window=int(window), batch=batch)
        self.mixture_crc32 = self.drawn_crc32  # the sources, weights and draw; with windows, their parts too
        if shuffle == "window":
            self.mixture_crc32 = crc32(json.dumps([self.drawn_crc32, self.draw.part_starts]).encode())

    def raw_reads(self, indices: np.ndarray) -> Tuple[Tuple[int, int, int], "RawRead", "RawRead"]:
        """How to read the raw samples ``indices`` (a batch): (their shape, ``read_many(idx, out)``,
        ``read_many_planar(idx, out)``), each source reading its own samples of the batch in one call
        (``read_by_source``), so that a batch costs a call a source and not a few a sample."""
        source = np.searchsorted(self.starts, np.asarray(indices), side="right") - 1
        shapes = {self.parts[k].manifest.shape for k in np.unique(source).tolist()}
        if len(shapes) > 1:  # raw sources of other shapes, mixed sample by sample: refused on opening
            raise MixtureError(self.path, "a batch holds samples of sources of other shapes",
                               hint="read raw sources of other shapes with Mixture(..., batches='per-source')")
        shape = shapes.pop() if shapes else self.manifest.shape
        if shape is None:
            raise MixtureError(self.path, "a raw source gives no sample shape", hint="convert it again")
        return (shape, functools.partial(read_by_source, self, False),
                functools.partial(read_by_source, self, True))

    def as_pixels(self, blob: Any, i: int) -> np.ndarray:
        """A raw sample's bytes as its source's HxWxC array (the sources may differ in shape)."""
        part, j = self.locate(i)
        return part.backend.as_pixels(blob, j)

    def prefetcher(self, shuffle: Shuffle, window: int, batch_size: int, lag: int) -> Optional[Any]:
        """For sources in object storage: each one's open parts bounded as a single set's are (a window and
        one, with shuffle="window"), a warning where its reading order thrashes the cache, and a
        ``Prefetcher`` of all their parts (None when every source is local)."""
        remote = [part.backend for part in self.parts if isinstance(part.backend, storage.RemoteSetBackend)]
        for backend in remote:
            if shuffle == "window" and backend.max_open_parts is None:
                backend.limit_open_parts(window + 1)
            storage.warn_if_cache_thrashes(backend, shuffle, window, batch_size)
        if shuffle == "window" and len(remote) > 1:  # their windows are read at once, through the one cache
            storage.warn_if_windows_thrash(remote, window)
        return storage.Prefetcher(MixtureParts(self), lag=lag) if remote else None

    def open(self) -> ShardedHandle:
        return ShardedHandle()

    def files(self) -> List[str]:
        return [f for part in self.parts for f in part.files()]

    def read(self, handle: ShardedHandle, i: int) -> bytes:
        """Sample i's bytes as its source stores them, checked by it; a raw source's, in a mixture with
        encoded ones, as a binary PPM image (its pixels after a short header: decoded by a copy)."""
        p, j = part_of(self.starts, i)
        with self._part(p) as part:
            # a raw mixture's as its source stores them (``as_pixels`` reads them so), among encoded ones interleaved
            data = part.read_bytes(j) if self.manifest.mode == "raw" else self.stored_bytes(part, j)
        if part.mode == "raw" and self.manifest.mode != "raw":
            h, w, c = part.manifest.shape or (0, 0, 0)
            return b"P%d\n%d %d\n255\n" % (6 if c == 3 else 5, w, h) + data
        return data

    def corrupt(self, problem: str, i: int) -> CorruptSampleError:
        """The source's own error for its sample: its path, the index in it and its key."""
        part, j = self.locate(i)
        return part.backend.corrupt(problem, j)

    def source_and_index(self, indices: np.ndarray) -> np.ndarray:
        """Indices of the mixture's samples as int64 [B, 2]: (source, index in that source)."""
        indices = np.asarray(indices, dtype=np.int64)
        source = np.searchsorted(self.starts, indices, side="right") - 1
        return np.stack([source, indices - self.starts[source]], axis=1)

    def check_fields(self, fields: "Sequence[str] | Mapping[str, str]") -> None:
        """MixtureError naming the first source that lacks a field of ``fields``, or holds another kind of it."""
        names = list(fields.keys()) if isinstance(fields, Mapping) else [fields] if isinstance(fields, str) \
            else list(fields)
        for name in names:
            kinds = {}
            for source, part in zip(self.names, self.parts):
                spec = next((f for f in part.fields if f.name == name), None)
                if spec is None:
                    have = ", ".join(f.name for f in part.fields) or "none"
                    raise MixtureError(part.path, f"has no field {name!r}, which fields= asks for (its fields: "
                                                  f"{have})",
                                       hint="every source of a Mixture must hold the fields asked for: leave the "
                                            "field out, or the source out of the mixture")
                kinds[source] = spec
            if len({spec.describe() for spec in kinds.values()}) > 1:
                held = "; ".join(f"{s}: {spec.describe()}" for s, spec in kinds.items())
                raise MixtureError(self.path, f"the sources hold field {name!r} as different kinds ({held})",
                                   hint="mix sources whose fields were declared alike")


@dataclasses.dataclass(frozen=True)
class _SourceKeys:
    """The sources' key arrays, in order (what the mixture's joined keys join; pickles as the sources)."""

    parts: List[Reader]

    def __call__(self) -> List[np.ndarray]:
        return [part.index.keys for part in self.parts]


def _check_mix(readers: List[Reader], names: Sequence[str], whole_batches: bool = False) -> None:
    """MixtureError unless the sources give batches of one kind: all raw of one shape (of any shapes, with
    ``whole_batches``), or encoded ones with raw ones of RGB or grey pixels (decoded to one size by
    ``size=`` or a crop)."""
    first, name = readers[0], names[0]
    mixed = len({r.mode for r in readers}) > 1
    for reader in readers:
        shape = reader.manifest.shape
        if mixed and reader.mode == "raw" and (shape is None or shape[2] not in (1, 3)
                                               or reader.manifest.dtype != "uint8"):
            raise MixtureError(
                reader.path, f"holds raw {reader.manifest.dtype} images of shape {shape}: among encoded sources a "
                             "raw one is read as an image, of uint8 RGB or grey pixels",
                hint="convert it to encoded mode (packed-formats convert --mode encoded)")
    for reader in readers[1:]:
        if not mixed and reader.mode == "raw" and (reader.manifest.dtype != first.manifest.dtype or (
                reader.manifest.shape != first.manifest.shape and not whole_batches)):
            raise MixtureError(
                reader.path, f"holds {reader.manifest.dtype} images of shape {reader.manifest.shape}, {name} of "
                             f"{first.manifest.shape}: the raw sources of a Mixture must hold one shape",
                hint="convert the sources at one size (packed-formats convert --size), or take each batch from "
                     "one source: Mixture(..., batches='per-source')")
    for reader, source in zip(readers, names):
        if len(reader) == 0:
            raise MixtureError(reader.path, f"source {source} holds no samples, so none can be drawn from it",
                               hint="leave it out of the Mixture")


def _mixed_classes(readers: List[Reader], names: Sequence[str], mode: str
                   ) -> Tuple[List[str], List[np.ndarray], List[int]]:
    """(the mixture's class names, each source's table from its labels to the mixture's, each source's
    first class number in the mixture)."""
    classes: List[str] = []
    tables, offsets = [], []
    if mode == "separate":
        for reader, name in zip(readers, names):
            offsets.append(len(classes))
            tables.append(np.arange(len(reader.classes), dtype=np.int64) + len(classes))
            classes.extend(f"{name}/{c}" for c in reader.classes)
        return classes, tables, offsets
    number: Dict[str, int] = {}
    for reader in readers:
        offsets.append(0)
        tables.append(np.array([number.setdefault(c, len(number)) for c in reader.classes], dtype=np.int64))
    return list(number), tables, offsets


def _mapped(labels: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``labels`` through ``table`` (a label outside it, as -1 for none, unchanged)."""
    labels = labels.astype(np.int64, copy=True)
    known = (labels >= 0) & (labels < len(table))
    labels[known] = table[labels[known]]
    return labels


def _common_fields(readers: List[Reader]) -> Tuple[Any, ...]:
    """The fields every source holds alike, in the first source's order."""
    rest = [{f.name: f.describe() for f in r.fields} for r in readers[1:]]
    return tuple(f for f in readers[0].fields if all(other.get(f.name) == f.describe() for other in rest))


def mixture_of(reader: Reader) -> Optional[MixtureBackend]:
    """``reader``'s mixture, when it reads one (else None)."""
    backend = reader.backend
    return backend if isinstance(backend, MixtureBackend) else None


class MixtureParts:
    """The parts of a mixture's sources numbered end to end, as a ``Prefetcher`` sees a remote set's: a
    source in object storage brings its parts, a local one is one part that needs no fetching."""

    def __init__(self, mixture: MixtureBackend) -> None:
        self.mixture = mixture
        starts, self.owners = [np.zeros(1, dtype=np.int64)], []
        for k, part in enumerate(mixture.parts):
            remote = isinstance(part.backend, storage.RemoteSetBackend)
            local = np.asarray(part.part_starts if remote else [0, len(part)], dtype=np.int64)
            starts.append(local[1:] + mixture.starts[k])
            self.owners += [(k, p if remote else -1) for p in range(len(local) - 1)]
        self.starts = np.concatenate(starts)

    def __getstate__(self) -> Dict[str, Any]:
        return {"mixture": self.mixture}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["mixture"])  # type: ignore[misc]

    def parts_that_fit(self) -> Optional[int]:
        """Parts (of the remote sources' average size) that their shared cache holds (None: no bound)."""
        remote = [part.backend for part in self.mixture.parts if isinstance(part.backend, storage.RemoteSetBackend)]
        limits = [b.cache.limit for b in remote if b.cache.limit is not None]
        if not limits:
            return None
        sizes = [p.info.size for b in remote for p in b.remote_parts]
        return max(1, int(min(limits) // max(1.0, sum(sizes) / max(1, len(sizes)))))

    def pin(self, p: int) -> Any:
        """A lease on part p: a remote source's part fetched into the cache, or nothing to hold."""
        k, q = self.owners[p]
        backend = self.mixture.parts[k].backend
        return backend.pin(q) if isinstance(backend, storage.RemoteSetBackend) and q >= 0 else _NoLease()


class _NoLease:
    """The lease on a local source's samples: nothing is held."""

    def release(self) -> None:
        pass


RawRead = Callable[[np.ndarray, np.ndarray], Any]


def read_by_source(mixture: MixtureBackend, planar: bool, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The mixture's raw samples ``indices`` into ``out`` ([B,H,W,C], or [B,C,H,W] when ``planar``): each
    source's of them read by it in one call (checked with its verify policy, its errors naming it and the
    index in it), straight into ``out`` when the batch is one source's, else gathered and put in place."""
    indices = np.asarray(indices, dtype=np.int64)
    source = np.searchsorted(mixture.starts, indices, side="right") - 1
    for k in np.unique(source).tolist():
        part = mixture.parts[k]
        read = part.read_many_planar if planar else part.read_many
        rows = np.flatnonzero(source == k)
        local = indices[rows] - mixture.starts[k]
        if len(rows) == len(indices):
            read(local, out=out)
        elif planar and part.manifest.raw_layout == "hwc":  # parted sample by sample: each straight to its row
            part.read_many_planar(local, out=out, rows=rows)
        else:
            gathered = _gathering(out.shape[1:], len(indices))[: len(rows)]
            read(local, out=gathered)
            out[rows] = gathered
    return out


_gathered = threading.local()


def _gathering(shape: Tuple[int, ...], rows: int) -> np.ndarray:
    """This thread's buffer for up to ``rows`` samples of ``shape``, kept from batch to batch: a fresh one each
    batch costs its pages' first touch, about as much as the copy out of it."""
    buffer = getattr(_gathered, "buffer", None)
    if buffer is None or buffer.shape[1:] != tuple(shape) or len(buffer) < rows:
        buffer = _gathered.buffer = np.empty((rows,) + tuple(shape), dtype=np.uint8)
    return buffer


def raw_reads(reader: Reader, indices: np.ndarray) -> Optional[Tuple[Tuple[int, int, int], RawRead, RawRead]]:
    """``MixtureBackend.raw_reads`` when ``reader`` reads a raw mixture (else None)."""
    mixture = mixture_of(reader)
    return None if mixture is None or reader.mode != "raw" else mixture.raw_reads(indices)


def check_source(source: Any, shuffle: Any) -> None:
    """ValueError for what a mixture does not take: shuffle="window" with replacement."""
    if isinstance(source, Mixture) and shuffle == "window":
        drawn = [s for s, r in zip(source.sources, source.replacement) if r]
        if drawn:
            raise ValueError(f"shuffle='window' reads each source's parts window by window, once a pass; "
                             f"{drawn} draw with replacement, which has no passes: use shuffle=True, or "
                             "replacement=False for them")

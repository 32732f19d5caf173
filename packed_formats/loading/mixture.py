"""Weighted mixtures of archives: several archives read as one, each epoch a seeded draw from them.

``Mixture({"imagenet.zip": 0.8, "extra.lmdb": 0.2})`` is what ``make_loader`` (and
``PackedDataset``) take where they take an archive path.  Opened (``Mixture.open``), it is one
``Reader`` whose samples are the sources' samples end to end (source 0's first, as a set of
parts presents its parts: ``MixtureBackend``), with labels mapped to the mixture's classes.
An epoch is not that concatenation but a draw from it (``MixtureDraw``): ``samples_per_epoch``
positions, each source's share of them its weight's, every source a stream of its own
shuffled passes (or independent draws, with replacement), the sources interleaved at random.
The draw depends on nothing but (seed, epoch), so the loader's workers, slots, ranks and
resume work on it as on an archive's shuffled order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..archives import open_archive
from ..backends.reader import Reader
from ..backends.sharded import ShardedBackend, ShardedHandle
from ..checksum import array_crc32, crc32
from ..errors import CorruptSampleError, MixtureError
from ..index import JoinedArray, SampleIndex, part_of
from ..policy import VerifyPolicy, check_choice

CLASS_MODES = ("merge", "separate")
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
    interleaves the sources evenly, in a fixed pattern.

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

    The batches' labels are the mixture's (``loader.classes`` lists its classes);
    ``return_index`` gives each sample as ``(source, index in it)``.  Every source must
    hold the ``fields`` asked for (``MixtureError`` names the one that does not).
    """

    def __init__(self, sources: "Mapping[Source, float] | Sequence[Tuple[Source, float]]",
                 samples_per_epoch: Optional[int] = None, *,
                 replacement: "bool | Mapping[Source, bool]" = False, classes: str = "merge") -> None:
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
        self.classes = classes

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
                f"replacement={self.replacement}, classes={self.classes!r})")

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
    """

    sizes: Tuple[int, ...]
    shares: Tuple[int, ...]
    replacement: Tuple[bool, ...]

    @property
    def samples(self) -> int:
        return sum(self.shares)

    def __call__(self, epoch: int, seed: int, shuffle: Any = True) -> np.ndarray:
        """The epoch's order: ``samples`` indices into the sources' samples end to end (int64).

        Source k's draws fill the positions of the epoch its share was dealt (at random, or
        evenly when not ``shuffle``), in the order of its stream (``source_draws``).
        """
        seed, epoch = int(seed) % 2**64, int(epoch) % 2**64
        starts = np.cumsum((0,) + self.sizes)
        owner = np.repeat(np.arange(len(self.shares), dtype=np.int64), self.shares)
        if shuffle:
            np.random.default_rng([seed, epoch, 0x313]).shuffle(owner)
        else:  # each source's k-th draw at (k + 1/2) / share of the epoch: evenly spread
            spread = np.concatenate([(np.arange(c) + 0.5) / c for c in self.shares if c])
            owner = owner[np.argsort(spread, kind="stable")]
        order = np.empty(len(owner), dtype=np.int64)
        positions = np.argsort(owner, kind="stable")  # source 0's positions in order, then source 1's...
        ends = np.cumsum(self.shares)
        for k, share in enumerate(self.shares):
            if share:
                draws = self.source_draws(k, epoch, seed, bool(shuffle))
                order[positions[ends[k] - share : ends[k]]] = starts[k] + draws
        return order

    def source_draws(self, k: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        """Source k's draws of an epoch, as indices into it.  With replacement: ``share`` independent
        uniform draws.  Without: positions ``epoch * share`` on of its stream of passes, pass p the
        source's samples shuffled with (seed, k, p) (in order, when not ``shuffle``)."""
        size, share = self.sizes[k], self.shares[k]
        if self.replacement[k]:
            return np.random.default_rng([seed, epoch, k, 0x5EE]).integers(0, size, share, dtype=np.int64)
        first, last = epoch * share, (epoch + 1) * share  # Python ints: no overflow
        stream = self._passes(k, seed, first // size, (last - 1) // size, shuffle)
        offset = first - (first // size) * size
        return stream[offset : offset + share]

    def _passes(self, k: int, seed: int, first: int, last: int, shuffle: bool) -> np.ndarray:
        """Passes ``first`` to ``last`` of source k's stream, end to end.  Pass p is a function of (seed, k, p)
        only: the passes of a block of ``PASS_BLOCK`` samples are shuffled together (row by row, one
        generator a block), so that a small source repeated many times an epoch costs a few vector calls."""
        size = self.sizes[k]
        if not shuffle:
            return np.tile(np.arange(size, dtype=np.int64), last - first + 1)
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
        self.names, self.draw, self.mixture_crc32 = list(names), draw, identity
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
        _check_mix(readers, names)
        classes, tables, offsets = _mixed_classes(readers, names, mixture.classes)
        labels = np.concatenate([_mapped(np.asarray(r.labels), t) for r, t in zip(readers, tables)])
        samples = mixture.samples_per_epoch or sum(len(r) for r in readers)
        draw = MixtureDraw(tuple(len(r) for r in readers), shares(mixture.weights, samples),
                           tuple(mixture.replacement))
        first = readers[0].manifest
        encodings = {r.manifest.encoding for r in readers}
        encoding: Optional[str]
        if any(r.mode != first.mode for r in readers):  # raw and encoded: raw samples are read as PPM images
            mode, shape, encoding = "encoded", None, "mixed"
        else:
            mode, shape = first.mode, first.shape
            encoding = (encodings.pop() if len(encodings) == 1 else "mixed") if first.mode != "raw" else None
        manifest = dataclasses.replace(
            first, format=cls.format_name, count=len(labels), classes=tuple(classes), checksum=None, mode=mode,
            shape=shape, encoding=encoding, index_crc32=(), part=-1, set_id="", fields=_common_fields(readers),
        )
        keys = JoinedArray(_SourceKeys(readers), np.cumsum([0] + [len(r) for r in readers]).astype(np.int64),
                           np.result_type(*[r.index.keys.dtype for r in readers]))
        index = SampleIndex(labels=labels, keys=keys)  # type: ignore[arg-type]
        description = ", ".join(f"{n} ({w:g})" for n, w in zip(names, mixture.weights))
        identity = crc32(json.dumps({
            "sources": [[n, len(r), array_crc32(np.asarray(r.labels))] for n, r in zip(names, readers)],
            "weights": mixture.weights, "samples": samples, "replacement": mixture.replacement,
            "classes": mixture.classes,
        }).encode())
        backend = cls(f"mixture of {description}", manifest, index, readers, names=names, draw=draw,
                      identity=identity, offsets=offsets)
        backend.mixture = mixture
        return backend

    def data_file(self) -> Optional[str]:
        return None  # no file of its own: each source checks its own files as it reads

    def open(self) -> ShardedHandle:
        return ShardedHandle()

    def files(self) -> List[str]:
        return [f for part in self.parts for f in part.files()]

    def read(self, handle: ShardedHandle, i: int) -> bytes:
        """Sample i's bytes as its source stores them, checked by it; a raw source's, in a mixture with
        encoded ones, as a binary PPM image (its pixels after a short header: decoded by a copy)."""
        p, j = part_of(self.starts, i)
        with self._part(p) as part:
            data = part.read_bytes(j)
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


def _check_mix(readers: List[Reader], names: Sequence[str]) -> None:
    """MixtureError unless the sources give batches of one kind: all raw of one shape, or encoded ones with
    raw ones of RGB or grey pixels (decoded to one size by ``size=`` or a crop)."""
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
        if not mixed and reader.mode == "raw" and (reader.manifest.shape, reader.manifest.dtype) != (
                first.manifest.shape, first.manifest.dtype):
            raise MixtureError(
                reader.path, f"holds {reader.manifest.dtype} images of shape {reader.manifest.shape}, {name} of "
                             f"{first.manifest.shape}: the raw sources of a Mixture must hold one shape",
                hint="convert the sources at one size (packed-formats convert --size)")
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


def check_source(source: Any, shuffle: Any) -> None:
    """ValueError for what a mixture does not take yet: shuffle="window"."""
    if isinstance(source, Mixture) and shuffle == "window":
        raise ValueError("shuffle='window' does not apply to a Mixture: each epoch is a draw from its sources "
                         "(use shuffle=True)")

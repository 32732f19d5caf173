"""Resuming mid-epoch: the saved state of a loader or a sampler, its checks, and ``ResumableSampler``.

A state is a small JSON-serialisable dict: where the epoch stands
(``sampling.EpochPosition``), the settings that decide the order (seed,
shuffle, drop_last, batch size, number of samples), an identity of the archive
and a format version.  Its size does not grow with the dataset.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, Mapping, Optional, Sized, Tuple, Union

import numpy as np
import torch

from ..backends.reader import Reader
from ..checksum import array_crc32, crc32
from .sampling import (
    DEFAULT_WINDOW,
    EpochPosition,
    Shuffle,
    batch_count,
    check_shuffle,
    rank_and_world_size,
    shard_indices,
    share_length,
)

if TYPE_CHECKING:  # Python 3.10 and later (only annotations use it)
    from typing import TypeGuard

STATE_VERSION = 1  # raise when a state's meaning changes; older states stay readable

POSITION_FIELDS = ("epoch", "start", "world_size", "first_batch")
ARCHIVE_FIELDS = ("name", "count", "classes", "classes_crc32", "labels_crc32")  # of ``archive_identity``
# settings a state leaves out at this value (so older versions read it), and that older states lack:
# those of shuffle="window" (``window_settings``), and the k of shuffle=GroupByAspectRatio(k) with a CRC32
# of each sample's bin (``groups_crc32``: sizes given or read decide them)
OPTIONAL_SETTINGS: Mapping[str, Any] = {"window": None, "parts_crc32": None, "mixture_crc32": None,
                                        "aspect_groups": None, "groups_crc32": None}


def archive_identity(reader: Reader) -> Dict[str, Any]:
    """What identifies an archive's samples: count, classes, and a CRC32 of every label.

    Its file name is kept for messages only: a staged or renamed copy is the same archive.
    """
    classes = "\n".join(reader.classes).encode()
    return {
        "name": os.path.basename(reader.path.rstrip(os.sep)),
        "count": len(reader),
        "classes": len(reader.classes),
        "classes_crc32": crc32(classes),
        "labels_crc32": array_crc32(reader.labels),
    }


@dataclass(frozen=True)
class StateSpec:
    """What a saved state must fit to be resumed by one loader or sampler.

    ``kind`` and ``done_name`` name the state and its count of steps done;
    ``settings`` are the values that decide the order (``samples`` and
    ``drop_last`` among them); ``step`` is the items of a step (the batch size
    for a loader, 1 for a sampler); ``world_size`` the current one; ``archive``
    the current ``archive_identity`` (None: unknown, as for a sampler over a length).
    """

    kind: str
    done_name: str
    settings: Mapping[str, Any]
    step: int
    world_size: int
    archive: Optional[Mapping[str, Any]]

    @property
    def fields(self) -> Tuple[str, ...]:
        return ("kind", "version", *POSITION_FIELDS, self.done_name, *self.settings, "rank", "archive")


def read_state(state: Any, spec: StateSpec) -> EpochPosition:
    """The ``EpochPosition`` saved in ``state`` (not yet moved to the current world size), after checking
    every field: present, none unknown, of its type (an int is an int: not a bool, a float or a string),
    in its range, the settings the same and the archive this one.

    A setting of ``OPTIONAL_SETTINGS`` that ``state`` lacks has its value there.

    Raises:
        ValueError: naming the first field that does not fit and what was expected.
    """
    _check_kind_and_version(state, spec.kind)
    state = {**{k: v for k, v in OPTIONAL_SETTINGS.items() if k in spec.settings}, **state}
    missing = [name for name in spec.fields if name not in state]
    if missing:
        raise ValueError(f"the {spec.kind} state lacks {', '.join(missing)}; pass what {spec.kind}.state_dict() "
                         "returned")
    unknown = sorted(map(repr, set(state) - set(spec.fields)))
    if unknown:
        raise ValueError(f"the {spec.kind} state has unknown field(s) {', '.join(unknown)}; a {spec.kind} state "
                         f"has exactly {', '.join(spec.fields)}")
    _check_archive_field(state["archive"], spec)
    for name, value in spec.settings.items():
        _check_setting(state, name, value, spec.kind)
    return _position(state, spec)


def _check_kind_and_version(state: Any, kind: str) -> None:
    if not isinstance(state, Mapping) or state.get("kind") != kind:
        found = state.get("kind") if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"not a {kind} state (found {found!r}); pass what {kind}.state_dict() returned")
    version = state.get("version")
    if not _is_int(version) or version < 1:
        raise ValueError(f"the {kind} state has no valid version ({version!r}): expected an integer from 1 to "
                         f"{STATE_VERSION}")
    if version > STATE_VERSION:
        raise ValueError(
            f"the {kind} state has version {version}, saved by a newer packed_formats; this one reads "
            f"versions up to {STATE_VERSION}: upgrade packed_formats to resume from it"
        )


def _is_int(value: Any) -> TypeGuard[int]:
    """An exact integer: Python's or numpy's, but not a bool (nor a float, however round)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def saved_settings(settings: Mapping[str, Any]) -> Dict[str, Any]:
    """``settings`` as a state holds them: those of ``OPTIONAL_SETTINGS`` left out at their value there."""
    return {k: v for k, v in settings.items() if k not in OPTIONAL_SETTINGS or v != OPTIONAL_SETTINGS[k]}


def window_settings(shuffle: Shuffle, window: int, starts: np.ndarray) -> Dict[str, Optional[int]]:
    """The settings of shuffle="window" (else None): ``window``, the parts per window, and ``parts_crc32``,
    a CRC32 of the parts' first samples ``starts``, on which the order depends (a set cut into other
    parts has the same samples, so the same ``archive_identity``, but another order)."""
    if shuffle != "window":
        return {"window": None, "parts_crc32": None}
    return {"window": window, "parts_crc32": array_crc32(np.asarray(starts, dtype=np.int64))}


def _check_setting(state: Mapping[str, Any], name: str, value: Any, kind: str) -> None:
    saved = state[name]
    if name == "shuffle":
        fits = isinstance(saved, (bool, np.bool_)) or (isinstance(saved, str) and saved == "window")
        expected = "True or False, or 'window'"
    elif name in OPTIONAL_SETTINGS:
        low = 1 if name == "window" else 0
        fits, expected = saved is None or (_is_int(saved) and saved >= low), f"None or an integer from {low}"
    elif isinstance(value, bool):
        fits, expected = isinstance(saved, (bool, np.bool_)), "True or False"
    else:
        fits, expected = _is_int(saved), "an integer"
    if not fits:
        raise ValueError(f"the {kind} state's {name} must be {expected}, got {saved!r}")
    if name == "mixture_crc32" and saved != value:
        raise ValueError(
            f"cannot resume: the state was saved for {_what_mixture(saved, state)}, this {kind} reads "
            f"{'a Mixture of another draw' if value is not None else 'one archive'}; its draw of the epoch would "
            "not be the interrupted run's (use the same Mixture: the same sources in the same order, weights, "
            "replacement, classes and samples_per_epoch, or start the epoch over)"
        )
    if saved != value:
        raise ValueError(
            f"cannot resume: the state was saved with {name}={saved!r}, this {kind} has "
            f"{name}={value!r}; the rest of the epoch would not be the samples the interrupted run "
            f"had left (use the same {name}, or start the epoch over)"
        )


def _what_mixture(saved: Optional[int], state: Mapping[str, Any]) -> str:
    """What a state's ``mixture_crc32`` (and its archive's name) says it was saved for, in words."""
    archive = state.get("archive")
    name = archive.get("name") if isinstance(archive, Mapping) else None
    if saved is None:
        return f"one archive ({name!r})"
    return f"a Mixture ({name!r}, draw crc32 {saved:08x})" if name else f"a Mixture (draw crc32 {saved:08x})"


def _check_archive_field(saved: Any, spec: StateSpec) -> None:
    """The state's ``archive`` is an archive identity (None only where ``spec`` has none) and the current one's."""
    if saved is None and spec.archive is None:
        return
    if saved is None and spec.archive is not None:
        raise ValueError(
            f"the {spec.kind} state's archive is None, where the identity of the archive it was saved for "
            f"({', '.join(ARCHIVE_FIELDS)}) is expected: without it this {spec.kind} cannot tell whether the state "
            f"is {spec.archive['name']!r}'s; pass what {spec.kind}.state_dict() returned"
        )
    problem = _identity_problem(saved)
    if problem:
        raise ValueError(f"the {spec.kind} state's archive must be a dict of {', '.join(ARCHIVE_FIELDS)} "
                         f"(what {spec.kind}.state_dict() saves): {problem}")
    if spec.archive is not None:
        check_archive(saved, spec.archive)


def _identity_problem(saved: Any) -> str:
    """What is wrong with ``saved`` as an ``archive_identity`` ("" if nothing)."""
    if not isinstance(saved, Mapping):
        return f"got {type(saved).__name__} {saved!r}"
    missing = [key for key in ARCHIVE_FIELDS if key not in saved]
    unknown = sorted(map(repr, set(saved) - set(ARCHIVE_FIELDS)))
    if missing or unknown:
        return f"it lacks {', '.join(missing) or 'nothing'} and has unknown {', '.join(unknown) or 'nothing'}"
    if not isinstance(saved["name"], str):
        return f"its name is {saved['name']!r}, not a string"
    for key in ("count", "classes", "classes_crc32", "labels_crc32"):
        high = 2**32 - 1 if key.endswith("crc32") else 2**63 - 1
        if not _is_int(saved[key]) or not 0 <= saved[key] <= high:
            return f"its {key} is {saved[key]!r}, not an integer from 0 to {high}"
    return ""


def check_archive(saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """ValueError when ``saved`` (a state's archive identity) is not ``current``'s archive."""
    differ = [k for k in ("count", "classes", "classes_crc32", "labels_crc32") if saved.get(k) != current[k]]
    if differ:
        raise ValueError(
            f"cannot resume: the state was saved for another archive ({saved.get('name')!r}: "
            f"{saved.get('count')} samples, {saved.get('classes')} classes) than this one "
            f"({current['name']!r}: {current['count']} samples, {current['classes']} classes); "
            f"they differ in {', '.join(differ)}"
        )


def _position(state: Mapping[str, Any], spec: StateSpec) -> EpochPosition:
    """The position fields, each an int in the range the others and the settings allow.

    A run on W ranks of n samples has rank < W; a world larger than both n and the current one
    has no samples for some of its ranks, so no such run saved the state.  Positions ``start``
    on are split (so start <= n); every batch numbered before ``start`` covered at least one
    of its positions (so first_batch <= start); ``done`` steps are at most the split's.
    """
    n, kind = spec.settings["samples"], spec.kind

    def field(name: str, low: int, high: int, why: str = "") -> int:
        value = state[name]
        if not _is_int(value) or not low <= value <= high:
            raise ValueError(f"the {kind} state's {name} must be an integer from {low} to {high}{why}, "
                             f"got {value!r}")
        return int(value)

    world = field("world_size", 1, max(n, spec.world_size), f" (at most the {n} samples or this world size)")
    field("rank", 0, world - 1, f" (a rank of the state's world_size {world})")
    seed = int(spec.settings.get("seed", 0))
    epoch = field("epoch", 0, 2**63 - 1 - max(seed, 0), " (seed + epoch seeds the shuffle)")
    start = field("start", 0, n, f" (a position of the {n} samples' order)")
    first = field("first_batch", 0, start, " (batches before the start each covered one of its positions)")
    share = share_length(n - start, world, spec.settings["drop_last"])
    steps = batch_count(share, spec.step, spec.settings["drop_last"])
    done = field(spec.done_name, 0, steps, f" (the steps of this rank's share from position {start} on "
                                           f"{world} rank(s))")
    return EpochPosition(epoch, start, world, done, first)


def position_state(position: EpochPosition, done_name: str) -> Dict[str, int]:
    """``position`` as state fields (its ``done`` named ``done_name``)."""
    return {"epoch": position.epoch, "start": position.start, "world_size": position.world_size,
            "first_batch": position.first_batch, done_name: position.done}


class ResumableSampler(torch.utils.data.Sampler[int]):
    """``DistributedSampler``'s order, with ``state_dict()``/``load_state_dict()`` to resume mid-epoch.

    For a plain ``DataLoader`` over a ``PackedDataset`` (``make_loader``'s
    loader resumes on its own).  It yields the same indices as
    ``torch.utils.data.DistributedSampler(dataset, world_size, rank, shuffle,
    seed, drop_last)`` after the same ``set_epoch``, so it can replace it.

    Args:
        dataset_or_len: the dataset (a PackedDataset's archive identity is kept
            in the state, so a state of another archive is refused) or its length.
        shuffle, seed, drop_last: as for DistributedSampler; shuffle may also be "window":
            parts shuffled, then the samples of each window of ``window`` parts together
            (``sampling.window_order``; a length, or an archive of one part, has one part).
        window: parts per window of shuffle="window" (as ``make_loader``'s).
        rank, world_size: this process's place (None: torch.distributed's when
            initialised, else a single process).

    Counting what was consumed: a DataLoader with workers takes indices from
    the sampler ahead of use (``prefetch_factor`` batches per worker), so what
    the sampler has yielded is more than the training loop has seen.  Hence
    ``state_dict(consumed=n)``: n is the number of samples the loop has taken
    from the DataLoader since this pass over the sampler began (add up
    ``len(labels)``).  Without ``consumed`` the sampler's own count is used,
    which is exact only with ``num_workers=0`` (the DataLoader then takes a
    batch's indices when that batch is asked for) or under
    ``torchdata.stateful_dataloader.StatefulDataLoader``: it calls this
    sampler's ``state_dict()`` as it hands out each batch's indices and keeps
    the state that matches the batch it returns, so
    ``StatefulDataLoader(dataset, batch_size=B, sampler=ResumableSampler(dataset),
    num_workers=W)`` resumes exactly with its own ``state_dict()`` /
    ``load_state_dict()``.

    Resuming on another number of ranks: every rank has consumed the same count
    c (the split is even), so the first c * world_size positions of the epoch's
    global order are done; the positions after them are split over the new
    ranks like DistributedSampler splits an epoch (every remaining sample once,
    plus up to world_size - 1 repeated with drop_last=False, less the tail with
    drop_last=True), and later epochs are as on that many ranks from the start.
    After ``load_state_dict``, ``sampler.epoch`` is the epoch to resume; a
    ``set_epoch`` with another epoch drops the resume.

    Example::

        sampler = pf.ResumableSampler(dataset, seed=0)
        loader = DataLoader(dataset, batch_size=256, sampler=sampler, num_workers=8)
        if resuming:
            sampler.load_state_dict(checkpoint["sampler"])
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)
            seen = 0
            for images, labels in loader:
                ...
                seen += len(labels)
                if must_stop:
                    save({..., "sampler": sampler.state_dict(consumed=seen)})
    """

    KIND = "ResumableSampler"

    def __init__(
        self,
        dataset_or_len: Union[Sized, int],
        shuffle: bool = True,
        seed: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        drop_last: bool = False,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        self._reader = getattr(dataset_or_len, "reader", None)
        self.shuffle, self.window = check_shuffle(shuffle, window)
        if not isinstance(self.shuffle, (bool, str)):  # a GroupByAspectRatio makes batches: make_loader's
            raise ValueError(f"ResumableSampler yields samples, not batches: shuffle={self.shuffle!r} is for "
                             "make_loader (use shuffle=True here)")
        self.n = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        if rank is None or world_size is None:
            this_rank, this_world = rank_and_world_size(None)
            rank = this_rank if rank is None else rank
            world_size = this_world if world_size is None else world_size
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        self.seed, self.drop_last = int(seed), bool(drop_last)
        self._starts = self._reader.part_starts if isinstance(self._reader, Reader) else np.array([0, self.n])
        self.rank, self.num_replicas = int(rank), int(world_size)
        self.epoch = 0
        self._pending: Optional[EpochPosition] = None  # loaded, for the next pass
        self._pass: Optional[EpochPosition] = None  # the pass in progress (or the last one)
        self._yielded = 0  # indices this pass has yielded
        self._identity: Optional[Dict[str, Any]] = None

    @property
    def num_samples(self) -> int:
        """Samples of a whole epoch on this rank (as DistributedSampler's)."""
        return share_length(self.n, self.num_replicas, self.drop_last)

    @property
    def total_size(self) -> int:
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use this epoch's order for the next pass (a loaded state of another epoch is dropped)."""
        self.epoch = int(epoch)
        if self._pending is not None and self._pending.epoch != self.epoch:
            self._pending = None
        if self._pass is not None and self._pass.epoch != self.epoch:
            self._pass = None  # the last pass is over: the state is this epoch's start

    def __iter__(self) -> Iterator[int]:
        position = self._pending if self._pending is not None else EpochPosition(self.epoch,
                                                                                 world_size=self.num_replicas)
        self._pending, self._pass, self._yielded = None, position, 0
        order = shard_indices(self.n, epoch=position.epoch, seed=self.seed, shuffle=self.shuffle, rank=self.rank,
                              world_size=self.num_replicas, drop_last=self.drop_last, start=position.start,
                              starts=self._starts, window=self.window)
        return self._count(order[position.done:].tolist())

    def _count(self, indices: list) -> Iterator[int]:
        for i in indices:
            self._yielded += 1
            yield i

    def _split_share(self, position: EpochPosition) -> int:
        return share_length(self.n - position.start, self.num_replicas, self.drop_last)

    def _settings(self) -> Dict[str, Any]:
        return {"samples": self.n, "shuffle": self.shuffle, **window_settings(self.shuffle, self.window, self._starts),
                "seed": self.seed, "drop_last": self.drop_last}

    def _archive(self) -> Optional[Dict[str, Any]]:
        if self._identity is None and isinstance(self._reader, Reader):
            self._identity = archive_identity(self._reader)
        return self._identity

    def state_dict(self, consumed: Optional[int] = None) -> Dict[str, Any]:
        """Where this rank's epoch stands, JSON-serialisable.

        Args:
            consumed: samples the training loop has taken from the DataLoader
                since the current pass over this sampler began (None: what the
                sampler yielded; see the class docstring for when that is exact).
        """
        position = self._position(consumed)
        state: Dict[str, Any] = {"kind": self.KIND, "version": STATE_VERSION, **position_state(position, "consumed")}
        state.update(saved_settings(self._settings()), rank=self.rank, archive=self._archive())
        return state

    def _position(self, consumed: Optional[int]) -> EpochPosition:
        if consumed is not None and not _is_int(consumed):  # never coerced: 2.5, True or "3" is no count
            raise ValueError(f"consumed must be an integer (the samples the loop has taken since this pass began) "
                             f"or None, got {consumed!r}")
        if self._pending is not None or self._pass is None:
            if consumed:
                raise ValueError("consumed must be 0 before the sampler has been iterated")
            return self._pending or EpochPosition(self.epoch, world_size=self.num_replicas)
        left = self._split_share(self._pass) - self._pass.done
        taken = self._yielded if consumed is None else int(consumed)
        if not 0 <= taken <= left:
            raise ValueError(f"consumed must be in [0, {left}] (this pass's samples), got {consumed}")
        if taken == left:  # the epoch is over: the next one starts
            following = self.epoch if self.epoch != self._pass.epoch else self._pass.epoch + 1
            return EpochPosition(following, world_size=self.num_replicas)
        p = self._pass
        return EpochPosition(p.epoch, p.start, p.world_size, p.done + taken, p.first_batch)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next pass continue where ``state`` stopped (ValueError if it cannot)."""
        spec = StateSpec(self.KIND, "consumed", self._settings(), 1, self.num_replicas, self._archive())
        position = read_state(state, spec).moved_to(self.num_replicas, self.n, 1)
        if position.done >= self._split_share(position):
            position = EpochPosition(position.epoch + 1, world_size=self.num_replicas)
        self._pending, self._pass, self.epoch = position, None, position.epoch

    def __repr__(self) -> str:
        return (f"ResumableSampler({self.n} samples, rank {self.rank} of {self.num_replicas}, "
                f"epoch {self.epoch}, shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last})")

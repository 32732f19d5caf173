"""sharded: several archives of one format opened as one dataset through a small JSON index.

``convert --shard-size N`` writes parts ``<stem>-00000<ext>``, ``<stem>-00001<ext>``...
beside the destination and, at the destination itself, an index::

    {"packed_formats_shards": 3, "format": "zip", "set_id": "3f2c9a0d51e47b86",
     "parts": [{"name": "train-00000.zip", "count": 1000, "content": "0c4e2f1a9b7d3e58"}, ...],
     "crc32": 2706264151}

Part names are relative to the index's directory.  Each part is a complete
archive of its own.  Beside the parts lies the set's sample index, ``<stem>-samples.npz``
(``set_samples``), which the index records (``samples``, and the set's ``manifest``) for a
reader that would otherwise fetch every part to index the set (``storage.remote_set``).
The index is sealed: ``crc32`` is the CRC32 of the canonical JSON text
(``manifest.canonical_json``) of everything else in it, and a damaged
index is refused (``index_text`` writes one, ``read_shard_index`` checks it).  Each
part's manifest names the set's id and the part's place in it (``set_id``,
``part``): a part listed twice, copied over another, renamed or taken from another
set is refused when the set is opened, naming the part and what it says, and so is
a part that differs from the first in mode, shape, dtype, classes, checksum kind or fields
(encodings may differ: the set's is then "mixed").

A set's id names the plan it was converted by (``writing.parts.set_id``), not
what its parts hold: two conversions of sources that list the same names with
other pixels share it.  So the index also records each part's content digest
(``part_digest``: of the CRC32s of the part's index arrays, which hold every
sample's CRC32, label and key), and a part whose own manifest gives another
digest is refused by name: a part of another set converted by the same plan
never reads as this set's.  An index of an older version (1: no seal, no set id;
2: no content digests) records nothing that could tell such a part, so a set
indexed so is refused when opened, saying to convert it again.

The sharded backend is a span layer over the parts'
Readers (each with its own per-process handle), used through their public API
only; the outer Reader checks checksums against the joined index (a field's
values too: each part reads them where its own index says they lie).

The joined index is the parts' own index arrays end to end (``JoinedArray``),
never concatenated: each part's arrays stay mapped from its file, so opening
the set holds no per-sample copy, and a spawn or forkserver worker receives the
parts' descriptions and maps them again, not a pickled copy of the index.

Open parts.  An open part holds one or two file descriptors (a file and its
map, or LMDB's environment and a size check) in each process that reads it,
and HDF5 some memory besides, so each process keeps at most ``max_open_parts``
parts of an archive open: a part is opened when a read needs it, and the part
least recently used is closed when one more would pass the bound.  A batch
may span any number of parts: each is read whole before the next is opened.
The bound is, the first that is given:

* ``open_archive(path, max_open_parts=n)`` (``make_loader`` keeps the bound of
  a Reader or PackedDataset it is given);
* the environment variable ``PF_MAX_OPEN_PARTS``, read when ``open_archive`` opens it;
* in each process, an eighth of its open-file limit (``ulimit -n``), so that
  parts hold at most a quarter of its descriptors, and never more than 128:
  128 parts under the common limit of 1,024, 16 under a limit of 128.

A bound that cannot fit the open-file limit is refused when the archive is
opened (``TooManyOpenFilesError``, saying which bound would fit), and a part
that cannot be opened for want of a descriptor raises the same error, naming
the archive and the part.  A larger bound trades descriptors (and HDF5's
memory) for fewer re-opens: a shuffled epoch over many more parts than the
bound opens a part again for most batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import re
import secrets
import threading
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import numpy as np

from ..checksum import crc32
from ..errors import (
    ArchiveChangedError,
    ArchiveExistsError,
    ArchiveNotFoundError,
    CorruptArchiveError,
    PackedFormatError,
    TooManyOpenFilesError,
)
from ..handles import ProcessLocal
from ..index import JoinedArray, SampleIndex, by_part, field_array, part_of
from ..manifest import ArchiveManifest, canonical_json, part_of_set
from ..native import to_planar
from .base import Backend, FormatSpec, Handle, WriteTransaction
from .files import publish, remove_path, temp_path_for
from .reader import Reader

INDEX_VERSION = 3  # 3: each part's content digest; 2: sealed (``crc32``), with the set's id; 1: neither
SEAL = "crc32"  # the index's key of its own checksum
_MAGIC = re.compile(rb'\s*\{\s*"packed_formats_shards"\s*:')
_SET_ID = re.compile(r"[0-9a-f]{16}")


def is_shard_index(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a shard index."""
    return _MAGIC.match(head) is not None


def part_name(path: str, k: int) -> str:
    """The file name of part ``k`` of the sharded archive at ``path``: <stem>-00000<ext>."""
    stem, ext = os.path.splitext(os.path.basename(os.path.abspath(path)))
    return f"{stem}-{k:05d}{ext}"


def new_set_id() -> str:
    """A new set's id: 16 random hexadecimal digits."""
    return secrets.token_hex(8)


def part_digest(manifest: ArchiveManifest) -> str:
    """The content digest of the part whose manifest is ``manifest`` (16 hexadecimal digits): of its
    sample count and the CRC32s of its index arrays, which hold every sample's CRC32 (its bytes), label
    and key, and each field's.  Parts that hold other samples differ in it, whatever set they name."""
    described = json.dumps({"count": manifest.count, "index_crc32": dict(manifest.index_crc32)}, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def index_text(format: str, parts: Sequence[Tuple[str, int, str]], set_id: Optional[str], **extra: Any) -> str:
    """The text of a set's index: its parts' format, (name, sample count, content digest) of each part
    in order, the set's id and any ``extra`` keys (an uploaded set's "samples" and "manifest"), sealed
    with the CRC32 of all of it.  ``set_id`` None writes the unsealed version 1 (no digests), for a set
    whose parts name no set (written by an older packed_formats).

    Raises:
        ValueError: ``set_id`` or a part's digest is not 16 lowercase hexadecimal digits, or ``extra``
            names a key of its own.
    """
    content: Dict[str, Any] = {
        "packed_formats_shards": INDEX_VERSION if set_id is not None else 1,  # first: what is_shard_index sees
        "format": format,
    }
    if set_id is not None:
        if not isinstance(set_id, str) or not _SET_ID.fullmatch(set_id):
            raise ValueError(f"a set id is 16 lowercase hexadecimal digits, got {set_id!r}")
        content["set_id"] = set_id
    if set_id is None:
        content["parts"] = [{"name": name, "count": int(count)} for name, count, _ in parts]
    else:
        for name, _, digest in parts:
            if not isinstance(digest, str) or not _SET_ID.fullmatch(digest):
                raise ValueError(f"part {name}'s content digest is 16 lowercase hexadecimal digits, got {digest!r}")
        content["parts"] = [{"name": name, "count": int(count), "content": digest} for name, count, digest in parts]
    clash = set(extra) & (set(content) | {"set_id", SEAL})
    if clash:
        raise ValueError(f"an index's own keys cannot be given as extra ones: {sorted(clash)}")
    content.update(extra)
    if set_id is not None:
        content[SEAL] = _seal(content)
    return json.dumps(content, indent=1) + "\n"


def _seal(content: Dict[str, Any]) -> int:
    """CRC32 of an index's content (all but its seal) in its canonical JSON text."""
    return crc32(canonical_json(content).encode())


def read_shard_index(path: str) -> dict:
    """The parsed index at ``path``: its parts' ``format``, their ``names``, ``counts`` and content
    digests (``contents``: None in an index older than version 3), its ``version`` and the set's
    ``set_id`` (None in a version 1 index).

    Parts are confined to the index's directory: each name is a plain file
    name (no separators, not "." or ".."), listed once, and each part is a
    packed archive of one format that is neither a folder nor another shard
    index.  An index of version 2 or later must match its seal.

    Raises:
        ArchiveNotFoundError: nothing at ``path``.
        CorruptArchiveError: not a valid index, or a damaged one (naming ``path``).
    """
    try:
        with open(path, "rb") as file:
            spec = json.loads(file.read())
        names = [str(p["name"]) for p in spec["parts"]]
        counts = [int(p["count"]) for p in spec["parts"]]
        version, part_format = int(spec["packed_formats_shards"]), str(spec["format"])
    except FileNotFoundError:
        raise ArchiveNotFoundError(path, "no such file") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptArchiveError(path, f"not a valid shard index: {exc}") from None
    if not 1 <= version <= INDEX_VERSION or not names:
        raise CorruptArchiveError(path, "not a valid shard index (unknown version, or no parts)")
    set_id = _check_seal(path, spec) if version >= 2 else None
    contents = _contents(path, spec["parts"]) if version >= 3 else None
    for name in names:
        if name in ("", ".", "..") or os.path.basename(name) != name or "/" in name or "\\" in name:
            raise CorruptArchiveError(path, f"part name {name!r} is not a plain file name beside the index")
    if len(set(names)) < len(names):
        name = next(n for n in names if names.count(n) > 1)
        first = names.index(name)
        raise CorruptArchiveError(
            path, f"part {name} is listed twice (as part {first} and part {names.index(name, first + 1)})",
            hint="the index was edited or damaged: restore it, or convert the set again",
        )
    if part_format in ("sharded", "folder") or part_format not in _packed_formats():
        raise CorruptArchiveError(path, f"parts of format {part_format!r} cannot be shards (a packed format is needed)")
    if any(c < 0 for c in counts):
        raise CorruptArchiveError(path, "a part has a negative sample count")
    return {"format": part_format, "names": names, "counts": counts, "version": version, "set_id": set_id,
            "contents": contents}


def _contents(path: str, parts: List[Any]) -> List[str]:
    """Each part's content digest, as a version 3 index at ``path`` lists them (CorruptArchiveError
    when one is missing or not 16 hexadecimal digits)."""
    contents = [p.get("content") for p in parts]
    for p, digest in enumerate(contents):
        if not isinstance(digest, str) or not _SET_ID.fullmatch(digest):
            raise CorruptArchiveError(path, f"not a valid shard index: part {p}'s content digest {digest!r} is not "
                                            "16 hexadecimal digits")
    return contents


def _check_seal(path: str, spec: Dict[str, Any]) -> str:
    """The set id of the version 2 index ``spec`` read from ``path``, once it matches its seal."""
    content = {k: v for k, v in spec.items() if k != SEAL}
    stored = spec.get(SEAL)
    if type(stored) is not int or stored != _seal(content):
        raise CorruptArchiveError(
            path, "the set's index is damaged: its content does not match its checksum"
                  if SEAL in spec else "the set's index has lost its checksum",
            hint="restore the index from a good copy, or convert (or join) the set again",
        )
    set_id = spec.get("set_id")
    if not isinstance(set_id, str) or not _SET_ID.fullmatch(set_id):
        raise CorruptArchiveError(path, f"not a valid shard index: its set id {set_id!r} is not 16 hexadecimal digits")
    return set_id


def _packed_formats() -> Tuple[str, ...]:
    from . import PACKED_FORMATS

    return PACKED_FORMATS


class ShardedHandle(Handle):
    """The index holds nothing open: each part keeps its own handle."""

    def close(self) -> None:
        """Nothing to release."""


# ---- how many parts a process keeps open ---------------------------------------------------------------
ENVIRONMENT_VARIABLE = "PF_MAX_OPEN_PARTS"
MOST_OPEN_PARTS = 128  # the default's ceiling: HDF5 holds memory per open file besides descriptors
DESCRIPTORS_PER_PART = 2  # at most, in any format: a file and its map, or LMDB's environment and a size check
RESERVED_DESCRIPTORS = 32  # left to the rest of the process (torch, its shared memory, pipes, other files)


def default_max_open_parts(limit: Optional[int]) -> int:
    """The bound of a process whose open-file limit is ``limit`` (None: unlimited): parts hold
    at most a quarter of its descriptors, and never more than ``MOST_OPEN_PARTS`` are open."""
    if limit is None:
        return MOST_OPEN_PARTS
    return max(1, min(MOST_OPEN_PARTS, limit // (4 * DESCRIPTORS_PER_PART)))


def check_max_open_parts(value: Any, source: str = "max_open_parts") -> int:
    """``value`` as a bound of open parts (ValueError, naming ``source``, unless a positive integer)."""
    try:
        bound = int(str(value).strip()) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        bound = 0
    if bound < 1 or (not isinstance(value, str) and bound != value):
        raise ValueError(f"{source} must be a positive integer (parts open at once), got {value!r}")
    return bound


def _bound_from_environment() -> Optional[int]:
    value = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    return check_max_open_parts(value, ENVIRONMENT_VARIABLE) if value else None


class _OpenParts:
    """One process's open parts of an archive, least recently used first, and the reads under
    way in each (a part being read by another thread is never closed under it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.recent: "OrderedDict[int, None]" = OrderedDict()
        self.reading: Dict[int, int] = {}

    def enter(self, p: int, bound: int) -> List[int]:
        """Count a read of part p starting; return the idle parts to close to stay within ``bound``."""
        self.recent[p] = None
        self.recent.move_to_end(p)
        self.reading[p] = self.reading.get(p, 0) + 1
        excess = len(self.recent) - bound
        if excess <= 0:
            return []
        closing = list(itertools.islice((q for q in self.recent if q not in self.reading), excess))
        for q in closing:
            del self.recent[q]
        return closing

    def idle(self) -> List[int]:
        """Forget every open part that no read is under way in; return them (to close)."""
        closing = [q for q in self.recent if q not in self.reading]
        for q in closing:
            del self.recent[q]
        return closing

    def leave(self, p: int) -> None:
        """Count a read of part p finished."""
        self.reading[p] -= 1
        if not self.reading[p]:
            del self.reading[p]


class ShardedBackend(Backend[ShardedHandle]):
    format_name = "sharded"
    joins_parts = True  # its index is its parts' (each part checked its own when opened)

    def __init__(self, path: str, manifest: ArchiveManifest, index: SampleIndex, parts: Sequence[Reader] = (),
                 max_open_parts: Optional[int] = None) -> None:
        super().__init__(path, manifest, index)
        self.parts = list(parts)
        self.starts = np.cumsum([0] + [len(p) for p in self.parts]).astype(np.int64)
        self.max_open_parts = max_open_parts  # None: from each process's open-file limit
        self._open = ProcessLocal(_OpenParts)

    @classmethod
    def load(cls, path: str) -> "ShardedBackend":
        from . import spec

        index_spec = read_shard_index(path)
        if index_spec["version"] < INDEX_VERSION:
            raise CorruptArchiveError(
                path, f"the set's index is of version {index_spec['version']} (written by an older packed_formats), "
                      "which does not record what each part holds: a part of another set converted with the same "
                      "source listing and options would be read as this set's",
                hint="convert the set again with this packed_formats (what its parts hold cannot be vouched for now)",
            )
        directory = os.path.dirname(os.path.abspath(path))
        backend = spec(index_spec["format"]).backend
        # each part's index stays mapped from its file (index_map's maps hold no descriptor)
        parts = [Reader(os.path.join(directory, n), backend, verify=False) for n in index_spec["names"]]
        try:
            _check_parts(path, parts, index_spec)
        except BaseException:
            for part in parts:
                part.close()
            raise
        return cls(path, _joined_manifest(parts), _joined_index(parts), parts)

    @classmethod
    def read_metadata(cls, path: str) -> Tuple[ArchiveManifest, SampleIndex]:
        backend = cls.load(path)
        backend.close()
        return backend.manifest, backend.index

    def open(self) -> ShardedHandle:
        if not os.path.isfile(self.path):
            raise ArchiveNotFoundError(self.path, "no such file")
        return ShardedHandle()

    def files(self) -> List[str]:
        return [self.path] + [f for part in self.parts for f in part.files()]

    def watched_files(self) -> List[str]:
        """None: each part checks its own files when a batch reads from it (one ``fstat`` per part
        touched), and the index, read once when the set is opened, decides nothing after that."""
        return []

    # ---- open parts ----
    def limit_open_parts(self, bound: int) -> None:
        """Keep at most ``bound`` parts open in each process; TooManyOpenFilesError if that many
        cannot fit this process's open-file limit."""
        bound = check_max_open_parts(bound)
        limit = TooManyOpenFilesError.limit()
        needed = min(bound, len(self.parts)) * DESCRIPTORS_PER_PART + RESERVED_DESCRIPTORS
        if limit is not None and needed > limit:
            raise TooManyOpenFilesError(
                self.path,
                f"max_open_parts={bound} needs up to {needed} open files ({DESCRIPTORS_PER_PART} a part, "
                f"{RESERVED_DESCRIPTORS} for the rest of the process), but this process may open {limit}",
                hint=_what_fits(limit, needed),
            )
        self.max_open_parts = bound

    def open_part_bound(self) -> int:
        """How many parts this process keeps open at most."""
        if self.max_open_parts is not None:
            return self.max_open_parts
        return default_max_open_parts(TooManyOpenFilesError.limit())

    def open_parts(self) -> List[int]:
        """The parts this process holds open (or is opening), least recently used first."""
        open_parts = self._open.get()
        with open_parts.lock:
            return list(open_parts.recent)

    @contextlib.contextmanager
    def _part(self, p: int) -> Iterator[Reader]:
        """Part p for one read, the parts least recently used closed first so that at most
        ``open_part_bound()`` are open (more only while other threads read them)."""
        open_parts, part = self._open.get(), self.parts[p]
        with open_parts.lock:
            for q in open_parts.enter(p, self.open_part_bound()):
                self.parts[q].release_handle()
        try:
            yield part
        except TooManyOpenFilesError:
            raise self._no_descriptor_for(p) from None
        except ArchiveChangedError:  # the set is being rewritten: hold none of its parts (see Reader)
            with open_parts.lock:
                for q in open_parts.idle():
                    self.parts[q].release_handle()
            raise
        finally:
            with open_parts.lock:
                open_parts.leave(p)

    def _no_descriptor_for(self, p: int) -> TooManyOpenFilesError:
        """The error for part p, which found no file descriptor left to open or read it with."""
        bound, name = self.open_part_bound(), os.path.basename(self.parts[p].path)
        return TooManyOpenFilesError(
            self.path,
            f"cannot open or read part {p} of {len(self.parts)} ({name}): too many open files "
            f"({TooManyOpenFilesError.usage()}; this archive keeps up to {bound} parts open in each process)",
            hint=f"{TooManyOpenFilesError.HINT}, or keep fewer parts open: max_open_parts={max(1, bound // 2)} "
                 f"(or {ENVIRONMENT_VARIABLE}={max(1, bound // 2)})",
        )

    # ---- reading ----
    def locate(self, i: int) -> Tuple[Reader, int]:
        """The part holding sample i, and i's index in it."""
        p, j = part_of(self.starts, i)
        return self.parts[p], j

    def read(self, handle: ShardedHandle, i: int) -> bytes:
        p, j = part_of(self.starts, i)
        with self._part(p) as part:
            return self.stored_bytes(part, j)

    def stored_bytes(self, part: Reader, j: int) -> bytes:
        """Sample j of ``part``, its stored bytes: a raw one's in this archive's layout, which a source of a
        Mixture may not share (a set's parts do: ``AGREEING_FIELDS``)."""
        if part.mode != "raw" or part.manifest.raw_layout == self.manifest.raw_layout:
            return part.read_bytes(j)
        pixels = cast(np.ndarray, part.read(j))  # H x W x C
        return (to_planar(pixels) if self.manifest.raw_layout == "chw" else pixels).tobytes()

    def read_batch(self, handle: ShardedHandle, idx: np.ndarray, out: np.ndarray) -> None:
        for p, mask, local in by_part(self.starts, idx):
            with self._part(p) as part:
                if part.manifest.raw_layout != self.manifest.raw_layout:  # a Mixture's source of another layout
                    pixels = cast(np.ndarray, part.read_many(local))
                    out[mask] = to_planar(pixels) if self.manifest.raw_layout == "chw" else pixels
                elif mask.all():
                    part.read_many_stored(local, out=out)
                else:
                    out[mask] = part.read_many_stored(local)

    def read_field(self, handle: ShardedHandle, name: str, i: int) -> bytes:
        p, j = part_of(self.starts, i)
        with self._part(p) as part:
            return part.read_field_bytes(j, name)

    def sample_location(self, i: int) -> Optional[Tuple[str, int]]:
        part, j = self.locate(i)
        return part.backend.sample_location(j)

    def structure_problems(self, handle: ShardedHandle, first: int, last: int) -> Dict[int, str]:
        """Each part's own (``Reader.structure_problems``), for the samples first:last it holds."""
        problems: Dict[int, str] = {}
        for p in range(part_of(self.starts, first)[0], part_of(self.starts, last - 1)[0] + 1):
            start = int(self.starts[p])
            with self._part(p) as part:
                found = part.structure_problems(max(first, start) - start, min(last, int(self.starts[p + 1])) - start)
            problems.update((start + j, problem) for j, problem in found.items())
        return problems

    def close(self) -> None:
        for part in self.parts:
            part.close()
        self._open.clear()


def limit_open_parts(reader: Reader, max_open_parts: Optional[int] = None) -> None:
    """Keep at most ``max_open_parts`` (None: ``PF_MAX_OPEN_PARTS``, if set) parts of ``reader``'s
    archive open in each process, when it is sharded (another archive is one file).

    Raises:
        ValueError: the bound is not a positive integer.
        TooManyOpenFilesError: so many parts cannot fit this process's open-file limit.
    """
    bound = None if max_open_parts is None else check_max_open_parts(max_open_parts)
    if isinstance(reader.backend, ShardedBackend):
        bound = _bound_from_environment() if bound is None else bound
        if bound is not None:
            reader.backend.limit_open_parts(bound)


def given_max_open_parts(reader: Reader) -> Optional[int]:
    """The bound of open parts given to ``reader``'s sharded archive (None: none given, or not sharded)."""
    return reader.backend.max_open_parts if isinstance(reader.backend, ShardedBackend) else None


def _what_fits(limit: int, needed: int) -> str:
    """What to do when a bound of open parts needs ``needed`` descriptors of a process allowed ``limit``."""
    raise_limit = f"raise the limit (`ulimit -n {max(needed, 1024)}` in the shell that starts Python)"
    fits = (limit - RESERVED_DESCRIPTORS) // DESCRIPTORS_PER_PART
    if fits < 1:
        return raise_limit
    return f"{raise_limit}, or keep at most {fits} parts open (max_open_parts, or {ENVIRONMENT_VARIABLE})"


AGREEING_FIELDS = ("mode", "shape", "raw_layout", "dtype", "classes", "checksum", "fields",
                   "labelled")  # every part's as the set's
# (encoding may differ)


def _check_parts(path: str, parts: List[Reader], index_spec: Dict[str, Any]) -> None:
    """Each part of the set whose index at ``path`` is ``index_spec`` holds the count the index
    says, names its place in the set, and agrees with the first (CorruptArchiveError otherwise)."""
    first = parts[0]
    for p, (part, count) in enumerate(zip(parts, index_spec["counts"])):
        if len(part) != count:
            raise CorruptArchiveError(path, f"part {part.path} holds {len(part)} samples, index says {count}")
        check_part(path, part.path, part.manifest, p, index_spec["set_id"], index_spec["format"])
        check_agreement(path, part.path, part.manifest, first.manifest, f"the first part, {first.path}")
        check_content(path, part.path, part.manifest, p, index_spec["set_id"], index_spec["contents"][p])


def check_part(path: str, part_path: str, manifest: ArchiveManifest, position: int, set_id: Optional[str],
               format: str) -> None:
    """That the part at ``part_path``, listed at ``position`` in the index at ``path`` of the set ``set_id``
    (None: a version 1 index, which names no set) and of ``format``, says it is that part.

    Raises:
        CorruptArchiveError: the part is of another format, names another set or place, names none
            under a sealed index, or names one under a version 1 index (naming the part and what it says).
    """
    hint = "a part was copied, renamed or moved, or the index replaced: restore the set's own files, or convert " \
           "it again"
    says = f"part {manifest.part} of set {manifest.set_id}"
    if manifest.format != format:
        raise CorruptArchiveError(path, f"part {part_path} is a {manifest.format} archive, the index lists "
                                        f"{format} parts", hint=hint)
    if set_id is None:
        if manifest.set_id or manifest.part >= 0:
            raise CorruptArchiveError(
                path, f"part {part_path} says it is {says}, but the index is of version 1, which names no set "
                      "(an index rewritten without its seal)", hint=hint)
        return
    if not manifest.set_id:
        raise CorruptArchiveError(
            path, f"part {part_path} names no set (written alone, or by an older packed_formats), but the sealed "
                  f"index lists it as part {position} of set {set_id}", hint=hint)
    if manifest.set_id != set_id:
        raise CorruptArchiveError(
            path, f"part {part_path} says it is {says}, another set: the index lists it as part {position} of "
                  f"set {set_id}", hint=hint)
    if manifest.part != position:
        raise CorruptArchiveError(
            path, f"part {part_path} says it is part {manifest.part} of this set, but the index lists it as "
                  f"part {position}", hint=hint)


def check_content(path: str, part_path: str, manifest: ArchiveManifest, position: int, set_id: Optional[str],
                  content: str) -> None:
    """That the part at ``part_path``, listed at ``position`` in the index at ``path`` of the set ``set_id``,
    holds what that part held when the set was written: its content digest is ``content``, the index's.

    Raises:
        CorruptArchiveError: the part holds other samples (naming the part and both digests).
    """
    digest = part_digest(manifest)
    if digest != content:
        raise CorruptArchiveError(
            path, f"part {part_path} holds other samples than part {position} of set {set_id} held when the set "
                  f"was written (its content digest is {digest}, the index records {content}): a part of another "
                  "conversion by the same plan (the same source listing, location and options), or one written again "
                  "since",
            hint="restore the set's own part, or convert the set again")


def check_agreement(path: str, part_path: str, manifest: ArchiveManifest, reference: ArchiveManifest,
                    reference_name: str) -> None:
    """That the part at ``part_path`` of the set at ``path`` agrees with ``reference`` (another part's
    manifest, or the set's) in every field of ``AGREEING_FIELDS``; CorruptArchiveError naming the field."""
    for field in AGREEING_FIELDS:
        mine, theirs = getattr(manifest, field), getattr(reference, field)
        if mine != theirs:
            if field == "classes":  # a list of thousands of names: say where they part
                at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                mine, theirs = _class_at(mine, at), _class_at(theirs, at)
            elif field == "fields":  # as --field declares them
                mine, theirs = (", ".join(f.describe() for f in fs) or "none" for fs in (mine, theirs))
            raise CorruptArchiveError(
                path, f"part {part_path} differs from {reference_name} in {field}: {mine!r}, not {theirs!r}",
                hint="a set's parts are of one layout: convert the set again from one source with one set of options",
            )


def _class_at(classes: Sequence[str], at: int) -> str:
    """Class ``at`` of ``classes``, in words, for a message saying where two lists differ."""
    return f"class {at} {classes[at]!r} of {len(classes)}" if at < len(classes) else f"{len(classes)} classes"


def _joined_manifest(parts: List[Reader]) -> ArchiveManifest:
    encodings = {p.manifest.encoding for p in parts}
    return dataclasses.replace(
        parts[0].manifest,
        format=ShardedBackend.format_name,
        count=sum(len(p) for p in parts),
        encoding=encodings.pop() if len(encodings) == 1 else "mixed",
        index_crc32=(),  # each part's index was checked against its own manifest
        part=-1,  # the whole set (its id stays)
    )


def _joined_index(parts: List[Reader]) -> SampleIndex:
    """The parts' indexes end to end, each array a JoinedArray over the parts' own (no copy).  Of a field's
    arrays only its CRC32s are joined: where its bytes lie each part knows, and its reads go to the part."""
    crc = None if any(p.index.crc32 is None for p in parts) else JoinedArray.of(_PartArrays(parts, "crc32"))
    field_crcs = [field_array(spec.name, "crc32") for spec in parts[0].manifest.fields]
    sized = all(p.index.widths is not None and p.index.heights is not None for p in parts)  # else none: read
    return SampleIndex(
        labels=cast(np.ndarray, JoinedArray.of(_PartArrays(parts, "labels"))),
        keys=cast(np.ndarray, JoinedArray.of(_PartArrays(parts, "keys"))),
        crc32=cast(Optional[np.ndarray], crc),
        widths=cast(Optional[np.ndarray], JoinedArray.of(_PartArrays(parts, "widths")) if sized else None),
        heights=cast(Optional[np.ndarray], JoinedArray.of(_PartArrays(parts, "heights")) if sized else None),
        fields={name: cast(np.ndarray, JoinedArray.of(_PartArrays(parts, name, field=True)))
                for name in field_crcs if all(name in p.index.fields for p in parts)},
    )


@dataclasses.dataclass(frozen=True)
class _PartArrays:
    """One index array of each part, in order: what a joined array of a sharded index joins (``field``: an
    array of the parts' ``index.fields``).  It pickles as the parts (each a description mapped again where it
    is unpickled)."""

    parts: List[Reader]
    name: str
    field: bool = False

    def __call__(self) -> List[np.ndarray]:
        if self.field:
            return [part.index.fields[self.name] for part in self.parts]
        return [getattr(part.index, self.name) for part in self.parts]


def _sniff(path: str, head: Optional[bytes]) -> bool:
    return head is not None and is_shard_index(head)


SPEC = FormatSpec("sharded", ShardedBackend, None, (), _sniff)


class ShardedWriter(WriteTransaction):
    """Writes parts of at most ``shard_size`` samples, their sample index (``set_samples``), then the
    index at ``path``.

    Parts are written into a temporary folder beside ``path`` and moved into
    place only at close(), parts first, then the sample index, and the index last, so an interrupted
    conversion leaves nothing at ``path``.  Options are those of Writer, and
    ``set_id``: the set's id (16 hexadecimal digits; by default a new random
    one), named by the index and by each part's manifest.
    """

    def __init__(
        self, path: "str | os.PathLike[str]", format: str, shard_size: int, overwrite: bool = False, **options: Any
    ) -> None:
        from . import writer_class

        self.path = os.fspath(path)
        if shard_size < 1:
            raise ValueError(f"shard size must be at least 1, got {shard_size}")
        if os.path.lexists(self.path) and not overwrite:
            raise ArchiveExistsError(self.path, "already exists", hint="pass overwrite=True to replace it")
        set_id = options.pop("set_id", None)  # not a Writer's option: the set's, named by every part
        self.format, self.shard_size, self.overwrite, self.options = format, shard_size, overwrite, options
        self.set_id: str = new_set_id() if set_id is None else set_id
        index_text(format, [], self.set_id)  # a set id it cannot write is refused now (ValueError)
        self._writer_class = writer_class(format)
        self.temp_path = temp_path_for(self.path)
        os.mkdir(self.temp_path)
        self._parts: List[Tuple[str, int, str]] = []  # (name, count, content digest)
        self._current: Optional[Any] = None
        self._count = 0
        self.paths: List[str] = []  # published parts, then the index
        self.samples_path: Optional[str] = None  # the published sample index (``set_samples``)

    def __len__(self) -> int:
        return self._count

    def add(self, sample: Any, label: int, key: Optional[str] = None, fields: Optional[Dict[str, Any]] = None
            ) -> int:
        """Append one sample and its fields (see Writer.add); return its index in the whole dataset."""
        if self._current is None or len(self._current) == self.shard_size:
            self._next_part()
        assert self._current is not None
        self._current.add(sample, label, key, fields=fields)
        self._count += 1
        return self._count - 1

    def _next_part(self) -> None:
        self._finish_part()
        name = part_name(self.path, len(self._parts))
        self._current = self._writer_class(os.path.join(self.temp_path, name), **self.options)
        self._parts.append((name, 0, ""))

    def _finish_part(self) -> None:
        if self._current is not None:
            with part_of_set(self.set_id, len(self._parts) - 1):  # the part's manifest is written at close
                self._current.close()
            name = self._parts[-1][0]
            self._parts[-1] = (name, len(self._current), file_digest(os.path.join(self.temp_path, name),
                                                                        self.format))
            self._current = None

    def close(self) -> None:
        """Seal the last part and move every part, then the index, into place."""
        try:
            if not self._parts:
                self._next_part()
            self._finish_part()
            index_temp = os.path.join(self.temp_path, "index.json")
            with open(index_temp, "w") as file:
                file.write(index_text(self.format, self._parts, self.set_id))
            samples_temp = self._write_samples(index_temp)
            self._publish_all(index_temp, samples_temp)
        except BaseException:
            self.abort()
            raise
        remove_path(self.temp_path)

    def _write_samples(self, index_temp: str) -> str:
        """Write the set's sample index beside the parts in the temporary folder, and the index at
        ``index_temp`` again, sealed over its record of it (``set_samples``); return the sample index's path."""
        from .set_samples import sample_index, samples_name

        name = samples_name(os.path.basename(self.path))
        data, text = sample_index(index_temp, name)
        samples_temp = os.path.join(self.temp_path, name)
        with open(samples_temp, "wb") as file:
            file.write(data)
        with open(index_temp, "w") as file:
            file.write(text)
        return samples_temp

    def _publish_all(self, index_temp: str, samples_temp: str) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        names = [name for name, _, _ in self._parts] + [os.path.basename(samples_temp)]
        finals = [os.path.join(directory, name) for name in names]
        if not self.overwrite:
            for final in finals:
                if os.path.lexists(final):
                    raise ArchiveExistsError(final, "already exists", hint="pass overwrite=True to replace it")
        for name, final in zip(names, finals):  # the parts, then their sample index, then the index
            publish(os.path.join(self.temp_path, name), final, overwrite=self.overwrite)
        publish(index_temp, self.path, overwrite=self.overwrite)
        self.paths, self.samples_path = finals[:-1] + [self.path], finals[-1]

    def abort(self) -> None:
        """Discard everything written; nothing at ``path`` changes."""
        if self._current is not None:
            self._current.abort()
            self._current = None
        remove_path(self.temp_path)


def file_digest(path: str, format: str) -> str:
    """The content digest of the part of ``format`` at ``path`` (just written, or staged and checked), read
    from its manifest."""
    from . import spec

    manifest, _ = spec(format).backend.read_metadata(path)
    return part_digest(manifest)


def existing_set_files(path: str) -> List[str]:
    """The files of the sharded archive now at ``path`` beside its index: its parts, then the sample index
    its index records, when it has the name a conversion gives it (none if it is not one)."""
    from .set_samples import recorded_samples, samples_name

    parts = existing_parts(path)
    try:
        record = recorded_samples(path) if parts else None
    except (OSError, ValueError, PackedFormatError):
        record = None
    name = samples_name(os.path.basename(path))
    if record is None or record["name"] != name:  # no other file beside it is taken for one
        return parts
    return parts + [os.path.join(os.path.dirname(os.path.abspath(path)), name)]


def existing_parts(path: str) -> List[str]:
    """The part paths of the sharded archive now at ``path`` (none if it is not one)."""
    try:
        with open(path, "rb") as file:
            if not is_shard_index(file.read(64)):
                return []
        names = read_shard_index(path)["names"]
    except (OSError, PackedFormatError):
        return []
    directory = os.path.dirname(os.path.abspath(path))
    return [os.path.join(directory, n) for n in names]

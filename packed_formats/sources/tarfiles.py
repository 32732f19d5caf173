"""Reading tar files in place: compression, a listing of the members, and their bytes in any order.

Nothing is ever extracted.  A tar is listed once (headers only: an
uncompressed tar is read by seeking from header to header; a compressed one
is decompressed once).  Then:

* uncompressed tars are read at random: each member's data offset is known,
  so any process reads any sample with one ``os.pread``;
* compressed tars (gz, bz2, xz) can only be read front to back.  Samples
  come out in the requested order from passes over the stream with a
  reorder buffer of at most ``REORDER_BUFFER_BYTES``: a member needed next is
  handed on at once, one needed later is kept if it fits (the earliest
  needed are kept first), anything else is left for the next pass.  A tar
  whose order is the requested one (or close to it, within the buffer) takes
  one pass; a shuffled one takes about (data size / buffer) passes.  Memory
  is bounded either way, and the stream is never seeked back.

Member tars (``class.tar`` inside a tar) are listed and read the same way,
through their parent.
"""

from __future__ import annotations

import bz2
import dataclasses
import heapq
import lzma
import os
import posixpath
import sys
import tarfile
import zlib
from array import array
from typing import (
    IO,
    Callable,
    ClassVar,
    Dict,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Set,
    Tuple,
    Type,
    cast,
)

import numpy as np

from ..errors import CorruptArchiveError, CorruptSampleError
from ..index import decode_key, encode_keys
from .base import (
    FilePool,
    Sample,
    Source,
    SourceOptions,
    UnsafeName,
    keep_last,
    member_path,
    unsafe_name_error,
    warn_members,
)
from .tarscan import BLOCK, Blocks, Entry, FileBlocks, Position, StreamBlocks, scan, valid_header

_STREAM_ERRORS: Tuple[Type[BaseException], ...] = (
    tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError, ValueError
)
try:
    from isal import igzip as _gzip
    from isal import isal_zlib

    _STREAM_ERRORS += (cast(Type[BaseException], isal_zlib.error),)  # its stub calls it an instance
except ImportError:  # pragma: no cover - isal is a dependency where wheels exist
    import gzip as _gzip  # type: ignore[no-redef]

REORDER_BUFFER_BYTES = 512 << 20
_MAGIC = ((b"\x1f\x8b", "gz"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"))
_CONTENT_LIMIT = 256 << 20  # a member read while listing (dataset.json, a label) may be at most this large


def compression(head: bytes) -> str:
    """"gz", "bz2", "xz" from a file's first bytes, or "" (not compressed)."""
    return next((name for magic, name in _MAGIC if head.startswith(magic)), "")


def open_decompressed(path: str, seeking: bool = False) -> IO[bytes]:
    """``path`` opened for reading, decompressed (ISA-L's gzip where available).

    ``seeking``: an uncompressed file is read by seeking from header to header,
    unbuffered (a buffer would read far past each 512-byte header).
    """
    with open(path, "rb") as file:
        kind = compression(file.read(6))
    if kind == "gz":
        return _gzip.open(path, "rb")
    if kind == "bz2":
        return bz2.open(path, "rb")
    if kind == "xz":
        return lzma.open(path, "rb")
    return open(path, "rb", buffering=0 if seeking else 1 << 20)


def is_tar(path: str) -> bool:
    """Whether ``path`` (compressed or not) starts with a valid tar header block."""
    try:
        with open_decompressed(path) as file:
            return valid_header(file.read(BLOCK))
    except _STREAM_ERRORS:
        return False


@dataclasses.dataclass
class TarListing:
    """Every file of one or more tars (``parts``), in archive order: entry ``seq`` is the seq-th file met.

    ``names[seq]`` is the clean relative path ("" for a member that is no
    usable file: an unsafe name, a link to nothing in the tar, or a name that a
    later member of the same tar repeats: the last one is kept, as tar extracts);
    ``outer[seq]`` the seq of the member tar it is inside of (-1: none);
    ``data[seq]`` the seq whose bytes it has (itself, or a link's target).
    """

    parts: List[str]
    compressed: List[bool]
    names: List[str] = dataclasses.field(default_factory=list)
    # Per member, as 8-byte integers (not lists of int objects: a tar may hold millions of members).
    outer: "array[int]" = dataclasses.field(default_factory=lambda: array("q"))
    part: "array[int]" = dataclasses.field(default_factory=lambda: array("q"))
    sizes: "array[int]" = dataclasses.field(default_factory=lambda: array("q"))
    offsets: "array[int]" = dataclasses.field(default_factory=lambda: array("q"))  # in the part file (-1: compressed)
    data: "array[int]" = dataclasses.field(default_factory=lambda: array("q"))
    dirs: List[str] = dataclasses.field(default_factory=list)
    contents: Dict[int, bytes] = dataclasses.field(default_factory=dict)
    expanded: Set[int] = dataclasses.field(default_factory=set)  # member tars listed inside
    unsafe: List[Tuple[str, str]] = dataclasses.field(default_factory=list)  # (part path, member name)
    # (part path, "'member' (why)"): devices, FIFOs, links out of the tar...
    left_out: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    replaced: List[Tuple[str, str]] = dataclasses.field(default_factory=list)  # (part path, "'member'") found again

    def where(self, seq: int) -> str:
        """``part.tar:member`` (``part.tar:outer.tar/member`` inside a member tar)."""
        return f"{self.parts[self.part[seq]]}:{_inner_name(self, seq)}"


class _Member(NamedTuple):
    seq: int
    part: int
    outer: int
    entry: Entry


def list_tars(
    parts: Sequence[str],
    keep_content: Callable[[str], bool] = lambda name: False,
    expand: Callable[[str], bool] = lambda name: False,
) -> TarListing:
    """List the files of ``parts``; read the members ``keep_content`` picks; list inside those ``expand`` picks.

    Raises CorruptArchiveError naming the part and member for a truncated or damaged tar.
    """
    listing = TarListing(list(parts), [bool(compression(_head(p))) for p in parts])
    links: List[Tuple[int, str, str]] = []  # (seq, target path, link name as stored)
    for member in _walk(listing, stream=False, expand=expand, record=True):
        entry, seq = member.entry, member.seq
        listing.part.append(member.part)
        listing.outer.append(member.outer)
        listing.offsets.append(entry.offset)
        listing.data.append(seq)
        listing.sizes.append(entry.size)
        try:
            name = member_path(entry.name)
        except UnsafeName:
            listing.unsafe.append((parts[member.part], entry.name))
            name = ""
        listing.names.append(name)
        if not name:
            continue
        if entry.kind != "file":
            links.append((seq, _link_target(name, entry), entry.linkname))
        elif keep_content(name) and entry.size <= _CONTENT_LIMIT:
            try:
                listing.contents[seq] = entry.read()
            except _STREAM_ERRORS as exc:  # the file shrank since its header was read
                raise CorruptArchiveError(parts[member.part], f"cannot read member {name!r} ({exc})") from None
    _keep_last(listing)
    _resolve_links(listing, links)
    return listing


def _keep_last(listing: TarListing) -> None:
    """Of members of one tar (or member tar) with the same name, keep the last, as extracting it does."""
    parts, outers = np.frombuffer(listing.part, dtype=np.int64), np.frombuffer(listing.outer, dtype=np.int64)
    scopes = parts * (len(listing.names) + 1) + outers + 1  # one number per (part, member tar)
    names = list(listing.names)
    blanked = keep_last(names, scopes)
    if not blanked:
        return
    listing.replaced.extend((listing.parts[listing.part[s]], repr(_inner_name(listing, s))) for s in blanked)
    listing.names[:] = names
    gone = set(blanked) & listing.expanded  # a member tar replaced: its members go with it
    if gone:
        for seq in np.flatnonzero(np.isin(outers, list(gone))).tolist():
            listing.names[seq] = ""


def _head(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read(6)


def _link_target(name: str, entry: Entry) -> str:
    if entry.kind == "hardlink":
        return entry.linkname
    return posixpath.normpath(posixpath.join(posixpath.dirname(name), entry.linkname))


def _resolve_links(listing: TarListing, links: List[Tuple[int, str, str]]) -> None:
    """Point each link at the file it names (same part and member tar), or drop it."""
    if not links:
        return
    linked = {seq for seq, _, _ in links}
    files = {
        (listing.part[s], listing.outer[s], name): s for s, name in enumerate(listing.names) if name and s not in linked
    }
    for seq, target, stored in links:
        if not listing.names[seq]:
            continue  # replaced by a later member of its name
        try:
            clean = member_path(target)
            where = "which is no file of the tar"
        except UnsafeName:
            clean, where = "", "outside the tar"
        found = files.get((listing.part[seq], listing.outer[seq], clean))
        if found is None:
            listing.left_out.append((listing.parts[listing.part[seq]],
                                     f"{_inner_name(listing, seq)!r} (a link to {stored!r}, {where})"))
            listing.names[seq] = ""
            continue
        listing.data[seq] = found
        listing.sizes[seq] = listing.sizes[found]
        listing.offsets[seq] = listing.offsets[found]


def _walk(listing: TarListing, stream: bool, expand: Callable[[str], bool], record: bool) -> Iterator[_Member]:
    """Every file member of every part in archive order, with the seq numbers the listing gives them.

    An uncompressed part is walked by seeking from header to header (unless
    ``stream``); anything else front to back.  ``record``: this is the
    listing pass (member tars that parse are noted in ``listing.expanded``);
    otherwise exactly the noted ones are opened.
    """
    seq = 0
    for p, path in enumerate(listing.parts):
        seeking = not stream and not listing.compressed[p]
        state = Position(path, dirs=[] if record else None)
        try:
            with open_decompressed(path, seeking=seeking) as raw:
                blocks: Blocks = FileBlocks(raw) if seeking else StreamBlocks(raw)
                end = os.fstat(raw.fileno()).st_size if seeking else sys.maxsize
                for entry in scan(blocks, 0, end, state, top=True):
                    outer = seq
                    yield _Member(seq, p, -1, entry if seeking else entry._replace(offset=-1))
                    seq += 1
                    opens = (expand(entry.name) and entry.kind == "file") if record else outer in listing.expanded
                    if not (opens and (valid_header(blocks.read_at(entry.offset, BLOCK)) or not record)):
                        continue  # (a member named .tar that is no tar is an ordinary member)
                    if record:
                        listing.expanded.add(outer)
                    state.outer = entry.name
                    for inner in scan(blocks, entry.offset, entry.offset + entry.size, state, top=False):
                        yield _Member(seq, p, outer, inner if seeking else inner._replace(offset=-1))
                        seq += 1
                    state.outer = None
        except _STREAM_ERRORS as exc:
            raise _error(state, exc) from None
        listing.left_out.extend((path, f"{name!r} ({what})") for name, what in state.special or ())
        for name in state.dirs or ():
            try:
                listing.dirs.append(member_path(name))
            except UnsafeName:
                pass


def _error(state: Position, exc: BaseException) -> CorruptArchiveError:
    """The error for a tar that fails at ``state``: truncated or damaged, naming the member."""
    if state.name is None:
        where = "before its first member"
    else:
        shown = f"{state.outer}/{state.name}" if state.outer else state.name
        where = f"at member {shown!r}"
    reason = str(exc) or type(exc).__name__
    return CorruptArchiveError(
        state.path, f"the tar is truncated or damaged {where} ({reason})", hint="download or copy it again"
    )


# ---- reading samples ---------------------------------------------------------------------------
class TarSamples:
    """The bytes of samples that are tar members: sample i is member ``seqs[i]`` of a listing."""

    def __init__(self, listing: TarListing, seqs: Sequence[int]) -> None:
        self.parts = listing.parts
        self.compressed = listing.compressed
        self.expanded = set(listing.expanded)
        self.members = len(listing.names)
        data = [listing.data[s] for s in seqs]
        self.seqs = np.asarray(data, dtype=np.int64)
        self.sizes = np.asarray([listing.sizes[s] for s in data], dtype=np.int64)
        self.offsets = np.asarray([listing.offsets[s] for s in data], dtype=np.int64)
        self.part = np.asarray([listing.part[s] for s in data], dtype=np.int32)
        self.names = encode_keys([_inner_name(listing, s) for s in seqs])
        self.files = FilePool()

    @property
    def random_access(self) -> bool:
        return not any(self.compressed)

    def where(self, i: int) -> str:
        """``part.tar:member`` of sample i."""
        return f"{self.parts[int(self.part[i])]}:{decode_key(self.names[i])}"

    def read(self, i: int, key: str) -> bytes:
        """Sample i's bytes with one pread (uncompressed tars only)."""
        size = int(self.sizes[i])
        path = self.parts[int(self.part[i])]
        try:
            data = self.files.pread(path, size, int(self.offsets[i]))
        except OSError as exc:
            raise CorruptSampleError(self.where(i), f"cannot read it: {exc.strerror}", index=i, key=key) from None
        if len(data) != size:
            raise CorruptSampleError(
                self.where(i), f"read {len(data)} of {size} bytes: the tar is truncated", index=i, key=key
            )
        return data

    def in_order(self, budget: Optional[int] = None) -> Iterator[bytes]:
        """Every sample's bytes in sample order, from passes over the (compressed) stream."""
        ranks = _Ranks(self.seqs, self.members)
        buffer = _ReorderBuffer(self.sizes, REORDER_BUFFER_BYTES if budget is None else budget)
        listing = TarListing(self.parts, self.compressed, expanded=self.expanded)
        while buffer.next < len(self.seqs):
            start = buffer.next
            for member in _walk(listing, stream=True, expand=_never, record=False):
                data: Optional[bytes] = None
                for r in ranks.of(member.seq):
                    if buffer.wants(r):
                        if data is None:
                            data = member.entry.read()
                        yield from buffer.take(r, data)
                if buffer.next == len(self.seqs):
                    return
            yield from buffer.flush()
            if buffer.next == start:
                raise CorruptArchiveError(
                    self.where(start), "the tar changed while it was read (a member listed before is gone)"
                )

    def passes(self, budget: Optional[int] = None, limit: int = 10) -> int:
        """How many passes ``in_order`` makes over the stream (counted up to ``limit``), from the listing alone."""
        archive_order = np.argsort(self.seqs, kind="stable").tolist()  # the samples as the stream meets them
        buffer = _ReorderBuffer(self.sizes, REORDER_BUFFER_BYTES if budget is None else budget)
        count = 0
        while buffer.next < len(self.seqs) and count < limit:
            count += 1
            for r in archive_order:
                if buffer.wants(r):
                    for _ in buffer.take(r, b""):
                        pass
                    if buffer.next == len(self.seqs):
                        break
            for _ in buffer.flush():
                pass
        return count

    def close(self) -> None:
        self.files.close()


def _never(name: str) -> bool:
    return False


def _inner_name(listing: TarListing, seq: int) -> str:
    """A member's name, with the member tar it is in (``outer.tar/name``)."""
    inside = f"{listing.names[listing.outer[seq]]}/" if listing.outer[seq] >= 0 else ""
    return inside + listing.names[seq]


class _Ranks:
    """The samples (ranks) whose bytes each member seq holds: usually one, several for links."""

    def __init__(self, seqs: np.ndarray, members: int) -> None:
        self.by_seq = np.argsort(seqs, kind="stable")
        self.start = np.searchsorted(seqs[self.by_seq], np.arange(members + 1))

    def of(self, seq: int) -> List[int]:
        lo, hi = int(self.start[seq]), int(self.start[seq + 1])
        return [] if lo == hi else self.by_seq[lo:hi].tolist()


class _ReorderBuffer:
    """Samples met before their turn, at most ``budget`` bytes, the earliest needed kept first."""

    def __init__(self, sizes: np.ndarray, budget: int) -> None:
        self.sizes = sizes
        self.budget = budget
        self.next = 0
        self.held: Dict[int, bytes] = {}
        self.bytes = 0
        self._heap: List[int] = []  # -rank of held samples (and stale entries of ones handed on)

    def wants(self, r: int) -> bool:
        return r >= self.next and r not in self.held

    def take(self, r: int, data: bytes) -> Iterator[bytes]:
        """Hand on ``data`` if sample r is next (and what it unblocks), else keep it if it fits."""
        if r == self.next:
            self.next += 1
            yield data
            yield from self.flush()
            return
        size = int(self.sizes[r])
        while self.bytes + size > self.budget and self._heap:
            last = -self._heap[0]
            if last not in self.held:
                heapq.heappop(self._heap)
            elif last > r:
                heapq.heappop(self._heap)
                self.bytes -= int(self.sizes[last])
                del self.held[last]
            else:
                break
        if self.bytes + size <= self.budget:
            self.held[r] = data
            self.bytes += size
            heapq.heappush(self._heap, -r)

    def flush(self) -> Iterator[bytes]:
        while self.next in self.held:
            data = self.held.pop(self.next)
            self.bytes -= int(self.sizes[self.next])
            self.next += 1
            yield data


# ---- the sources made of tar members -----------------------------------------------------------
def member_extension(name: str) -> str:
    """The webdataset extension of a member: everything after the first dot of its file name."""
    base = posixpath.basename(name)
    return base.split(".", 1)[1] if "." in base else ""


def list_for_sources(paths: Sequence[str], options: SourceOptions) -> TarListing:
    """The listing every tar kind decides from: with dataset.json and label members read, and member
    tars listed inside."""
    label_ext = (options.label_key or DEFAULT_LABEL_KEY).lower()

    def keep(name: str) -> bool:
        base = name.rpartition("/")[2]
        return base == "dataset.json" or base.partition(".")[2].lower() == label_ext

    return list_tars(
        paths,
        keep_content=keep,
        expand=lambda name: name.lower().endswith(".tar"),
    )


DEFAULT_LABEL_KEY = "cls"


class TarBackedSource(Source):
    """A source whose samples are members of tar files; the kinds differ in how they find them.

    A subclass implements ``matches(listing, options)`` (does this listing
    look like my kind?) and ``from_listing``.  Random access when every tar is
    uncompressed, else one ordered pass (see the module docstring).
    """

    container: ClassVar[str] = "tar"

    def __init__(self, path, classes, keys, labels, samples: TarSamples, skipped=0, failed=(), layout="") -> None:
        super().__init__(path, classes, keys, labels, skipped, failed, layout)
        self.samples = samples
        self.random_access = samples.random_access

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        return is_tar(path)

    @classmethod
    def matches(cls, listing: TarListing, options: SourceOptions) -> bool:
        raise NotImplementedError

    @classmethod
    def from_listing(cls, path: str, listing: TarListing, options: SourceOptions) -> "TarBackedSource":
        raise NotImplementedError

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "TarBackedSource":
        return cls.from_listing(path, list_for_sources([path], options), options)

    def location(self, i: int) -> str:
        return self.samples.where(i)

    def stored_size(self, i: int) -> Optional[int]:
        return int(self.samples.sizes[i])

    def load(self, i: int) -> bytes:
        return self.samples.read(i, self.key(i))

    def __iter__(self) -> Iterator[Sample]:
        if self.random_access:
            yield from super().__iter__()
            return
        for i, data in enumerate(self.samples.in_order()):
            yield Sample(self.key(i), int(self.labels[i]), data)

    def notes(self) -> List[str]:
        if self.random_access:
            return ["read at random (uncompressed): each worker reads its own samples"]
        passes = self.samples.passes()
        more = "+" if passes >= 10 else ""
        text = f"read in {passes}{more} pass{'es' if passes != 1 else ''} over the compressed stream"
        if passes > 1:
            text += " (its members are not in sorted order: an uncompressed tar or a ZIP is read in one)"
        return [text]

    def close(self) -> None:
        self.samples.close()


def screen_members(path: str, listing: TarListing, options: SourceOptions) -> List[str]:
    """Members with unsafe names: an error (on_error="raise") or the list of them as failures; then
    one warning listing the members left out (links out of the tar, devices, FIFOs) and one listing
    the names found twice (the last of each kept)."""
    errors = [unsafe_name_error(part, name) for part, name in listing.unsafe]
    if errors and options.on_error == "raise":
        raise errors[0]
    def shown(entries: List[Tuple[str, str]]) -> List[str]:
        return [text if len(listing.parts) == 1 else f"{part}: {text}" for part, text in entries]

    warn_members(path, shown(listing.left_out), shown(listing.replaced), "tar")
    return [str(e) for e in errors]


__all__ = [
    "DEFAULT_LABEL_KEY", "REORDER_BUFFER_BYTES", "TarBackedSource", "TarListing", "TarSamples", "compression", "is_tar",
    "list_for_sources", "list_tars", "member_extension", "screen_members",
]

"""What every source kind shares: the Source class, its options, and helpers for labels, names and files.

A Source lists its samples when it is opened (count, keys, labels, classes),
so the converter knows everything it writes into the archive's header before
the first image is read.  The samples themselves come either by index from
any process (``random_access``: folders, ZIP files, uncompressed tars, packed
archives; conversion workers read their own) or in order from one pass in
this process (``__iter__``: compressed tars, HDF5, pickled LMDB), which the
converter hands to its workers.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import warnings
from typing import Any, ClassVar, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from ..backends.folder import IMAGE_EXTENSIONS, SKIPPED_NAMES_KEPT, UNREAD_IMAGE_EXTENSIONS
from ..errors import InvalidSourceError, PackedFormatError
from ..fields import FieldSpec, check_fields
from ..index import decode_key, encode_keys
from ..policy import check_on_error

Data = Union[bytes, np.ndarray]
# Class names that are dataset splits rather than classes: a source whose classes are all
# of these was most probably meant to be read one split at a time (subdir=).
_SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing", "eval"})
# The image kinds a source reads, as a message names them (jpg for .jpg and .jpeg...).
IMAGE_KINDS = tuple(dict.fromkeys(e[1:].replace("jpeg", "jpg").replace("tiff", "tif") for e in IMAGE_EXTENSIONS))


class SourceWarning(UserWarning):
    """The source converts, but probably not as meant (one class, every label equal, splits as classes)."""


class UnpicklingWarning(SourceWarning):
    """Pickled records are being unpickled, which runs code from the file (``allow_pickle=True``)."""


class SourceMemberWarning(SourceWarning):
    """Members of a source container were left out (links out of it, devices, FIFOs) or replaced by a
    later member of the same name (the last one is kept, as extracting the container keeps it)."""


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """How to read a source; each kind uses the options that concern it.

    labels: label file of a flat folder of images.  subdir: the split to read
    inside a folder, ZIP or tar (``train``), or the group of an HDF5 file.
    source_format: a registered kind name, instead of detecting it.
    label_key / image_key: where labels and images are: the member extension
    of a webdataset sample (``cls``; ``jpg``...), the dataset name in an HDF5
    file (``labels``, ``images``) or the field of a pickled record.
    allow_pickle: read an LMDB of pickled records (unpickling runs code from the file).
    on_error: "raise" at the first unusable sample found while listing, or "skip" it.
    fields: the fields to read with each sample (``fields.FieldSpec``s, or ``NAME=KIND`` strings), and
    "auto" among them: what the kind finds in every sample too; () reads none (each kind says what it can read)
    but an archive's own, which "none" leaves out too.
    """

    labels: Optional[str] = None
    subdir: Optional[str] = None
    source_format: Optional[str] = None
    label_key: Optional[str] = None
    image_key: Optional[str] = None
    allow_pickle: bool = False
    on_error: str = "raise"
    fields: Tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        check_on_error(self.on_error)
        words = tuple(w for w in ("auto", "none") if w in self.fields)
        if words == ("auto", "none") or ("none" in words and len(self.fields) > 1):
            raise ValueError("fields 'none' goes alone: no field at all")
        object.__setattr__(self, "fields", check_fields([f for f in self.fields if f not in words]) + words)

    @property
    def auto_fields(self) -> bool:
        """Whether the fields found in every sample are read too (besides those declared)."""
        return "auto" in self.fields

    @property
    def declared_fields(self) -> Tuple[FieldSpec, ...]:
        return tuple(f for f in self.fields if f not in ("auto", "none"))

    @property
    def no_fields(self) -> bool:
        """Whether no field is to be read, not even those an archive carries ("none")."""
        return "none" in self.fields


def field_extension(name: str, extensions: Iterable[str], taken: Sequence[Optional[str]] = ()) -> Optional[str]:
    """Which of a sample's file ``extensions`` (the name's part after its stem: ``seg.png``) field ``name``
    takes: the extension ``name`` itself, else the first ``name.*`` in name order, never one in ``taken``
    (the sample's image and label); case does not count.  None when it has none."""
    lowered = name.lower()
    candidates = sorted(e for e in extensions if e not in taken
                        and (e.lower() == lowered or e.lower().startswith(lowered + ".")))
    exact = [e for e in candidates if e.lower() == lowered]
    chosen = exact or candidates
    return chosen[0] if chosen else None


class Sample(NamedTuple):
    """One sample as a source yields it; ``data`` is the error instead when it cannot be read (or one of its
    fields cannot); ``fields``: its value of each of the source's fields."""

    key: str
    label: int
    data: "Data | PackedFormatError"
    fields: Optional[Dict[str, Any]] = None


class Source:
    """The samples of one dataset, listed: ``classes``, and per sample a key and a label.

    A kind (a subclass) sets ``kind`` (its registry name) and
    ``random_access``, and implements ``sniff`` and ``open``, then ``load``
    (random access) or ``__iter__`` (one ordered pass).  ``skipped`` counts
    the files left out that are no image of a kind read (``skipped_names``: the
    first of them, relative to the source, to show); ``failed`` names samples
    left out while listing with on_error="skip" (as "where: problem").
    """

    kind: ClassVar[str] = "source"
    random_access: bool = True  # a class default; a kind may decide per source (compressed or not)
    fields: Tuple[FieldSpec, ...] = ()  # what each sample holds besides its image and label (``load_fields``)
    reads_fields: ClassVar[bool] = False  # whether the kind reads fields (SourceOptions.fields)
    # Where to look when every sample has one label; None: the labels are folder names (--subdir, dataset.json).
    label_advice: ClassVar[Optional[str]] = None
    # False: the images have no class of their own (detection, segmentation): every label 0, never warned of.
    image_labels: ClassVar[bool] = True
    # False: declared to have no labels (``label_key="none"``): no classes, every label -1, and the archive says so.
    labelled: bool = True

    def __init__(
        self,
        path: str,
        classes: Sequence[str],
        keys: "Sequence[str] | np.ndarray",
        labels: "Sequence[int] | np.ndarray",
        skipped: int = 0,
        failed: Sequence[str] = (),
        layout: str = "",
        skipped_names: Sequence[str] = (),
    ) -> None:
        self.path = path
        self.classes: Tuple[str, ...] = tuple(classes)
        self.keys = keys if isinstance(keys, np.ndarray) else encode_keys(list(keys))
        self.labels = np.asarray(labels, dtype=np.int64)
        self.skipped = skipped
        self.skipped_names = list(skipped_names[:SKIPPED_NAMES_KEPT])
        self.failed = list(failed)
        self.layout = layout  # a few words on what was found, for `info`

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        """Whether ``path`` is of this kind, from its content (``head``: its first 512 bytes; b"" for a folder)."""
        return False

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "Source":
        """The source at ``path``, listed (raises PackedFormatError when it does not fit this kind)."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.labels)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path!r}: {len(self)} samples, {len(self.classes)} classes>"

    def key(self, i: int) -> str:
        return decode_key(self.keys[i])

    def location(self, i: int) -> str:
        """What to name when sample i is bad (a file, or ``container:member``)."""
        return f"{self.path}:{self.key(i)}"

    def load(self, i: int) -> Data:
        """Sample i as stored (random-access sources; any process may call it).

        Raises PackedFormatError (CorruptSampleError) naming the sample when it cannot be read.
        """
        raise NotImplementedError(f"{type(self).__name__} is read in one ordered pass: iterate over it")

    def load_fields(self, i: int) -> Dict[str, Any]:
        """Sample i's value of each of ``fields``, checked against its declaration (a PackedFormatError
        naming the file and field when one is missing or no value of its kind)."""
        return {}

    def __iter__(self) -> Iterator[Sample]:
        """Every sample, in order; one that cannot be read comes with its error as ``data``."""
        for i in range(len(self)):
            try:
                data: "Data | PackedFormatError" = self.load(i)
            except PackedFormatError as exc:
                data = exc
            yield Sample(self.key(i), int(self.labels[i]), data)

    @property
    def raw_shape(self) -> Optional[Tuple[int, int, int]]:
        """(H, W, C) when every sample is a pixel array of that shape, else None."""
        return None

    def stored_size(self, i: int) -> Optional[int]:
        """Bytes sample i takes as stored, without reading it (None: unknown for this kind)."""
        return None

    def runs(self) -> Optional[np.ndarray]:
        """The first sample of each run of consecutive samples that one read brings in together (a row group
        of a parquet file), ascending from 0; None: each sample is read on its own.  A conversion hands
        each run to one worker whole where it can, so that no two workers read the same run."""
        return None

    def notes(self) -> List[str]:
        """Lines for ``info`` about how the source will be read (passes, buffering...)."""
        return []

    def close(self) -> None:
        """Release open files."""

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- labels and classes -------------------------------------------------------------------------
def classes_and_labels(path: str, values: Sequence[Any]) -> Tuple[Tuple[str, ...], List[int]]:
    """(classes, label per sample) from label values: integers give classes "0".."max",
    other values (names such as WordNet ids) the sorted distinct names."""
    words = [str(v).strip() for v in values]
    if all(_is_integer(w) for w in words):
        numbers = [int(w) for w in words]
        if numbers and min(numbers) < 0:
            raise InvalidSourceError(path, f"labels must be >= 0, found {min(numbers)}")
        return tuple(str(c) for c in range(max(numbers, default=-1) + 1)), numbers
    classes = tuple(sorted(set(words)))
    lookup = {name: c for c, name in enumerate(classes)}
    return classes, [lookup[w] for w in words]


def _is_integer(word: str) -> bool:
    return word.lstrip("-").isdigit()


def warn_if_suspicious(source: Source) -> None:
    """A SourceWarning when the source has one class, every label equal, or splits as classes."""
    classes, path = source.classes, source.path
    if len(source) == 0 or not source.image_labels or not source.labelled:
        return
    counts = np.bincount(source.labels, minlength=len(classes))
    if len(classes) == 1:
        reason = f"1 class found ({classes[0]!r})"
    elif np.count_nonzero(counts) == 1:
        reason = f"all {len(source)} samples have the same label ({classes[int(np.argmax(counts))]!r})"
    elif source.label_advice is not None:  # labels from a file or a store, not folders: no split to choose
        return
    elif set(name.lower() for name in classes) <= _SPLIT_NAMES:
        warnings.warn(
            f"{path}: the classes are {', '.join(classes)}, which look like dataset splits: "
            f"read one with --subdir (subdir=), e.g. --subdir {classes[0]}",
            SourceWarning, stacklevel=3,
        )
        return
    else:
        return
    advice = source.label_advice or "did you mean --subdir, or a dataset.json with the labels?"
    warnings.warn(f"{path}: {reason}: {advice}", SourceWarning, stacklevel=3)


def describe_skipped(count: int, names: Sequence[str], shown: Optional[int] = 5, more_hint: str = "",
                     verb: str = " skipped") -> str:
    """``N files skipped (no image of a kind read: ...): a, b and M more``: the files a source left out, the
    first ``shown`` of ``names`` (None: every name kept) named, and the kinds of image among them that are
    never read (GIF...), with what to do; ``more_hint`` follows the list when names are left out of it."""
    if not count:
        return f"no files{verb}"
    listed = [_printable(name) for name in (names if shown is None else names[:shown])]
    text = f"{count} file{'s' if count != 1 else ''}{verb} (no image of a kind read: {', '.join(IMAGE_KINDS)})"
    if listed:
        more = count - len(listed)
        text += ": " + ", ".join(listed) + (f" and {more} more" if more > 0 else "")
        if more > 0 and len(names) > len(listed) and more_hint:
            text += f" ({more_hint})"
        elif more > 0 and len(names) == len(listed) and shown is None:
            text += f" (the first {len(listed)} named)"
    unread = sorted({posixpath.splitext(n)[1].lower() for n in names if n.lower().endswith(UNREAD_IMAGE_EXTENSIONS)})
    if unread:
        text += (f"; {', '.join(unread)} images are never read, as by torchvision's ImageFolder: convert them "
                 "to PNG to pack them")
    return text


def _printable(name: str) -> str:
    """A file name as a message shows it: bytes that are not UTF-8 (surrogate-escaped) as ``\\xNN`` and control
    characters as Python writes them, so no name breaks the line or the terminal it is printed on."""
    text = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return _CONTROL.sub(lambda found: repr(found.group())[1:-1], text)


# ---- member names ------------------------------------------------------------------------------
_DRIVE = re.compile(r"^[A-Za-z]:")
# no "", ".", ".." parts, no control characters
_PLAIN = re.compile(r"(?!\.{1,2}(/|$))(?!.*/\.{0,2}(/|$))[^/\\:\x00-\x1f\x7f]+(/[^/\\\x00-\x1f\x7f]+)*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # NUL, newline, tab, escape...: never in a key or a class name
_CONTROL_BYTES = np.zeros(256, dtype=bool)  # a lookup table: which bytes are control characters
_CONTROL_BYTES[[*range(32), 127]] = True


class UnsafeName(ValueError):
    """An archive member name that is absolute, climbs out with '..', or holds a control character."""


def member_path(name: str) -> str:
    """A container member's name as a clean relative POSIX path ("./a//b" -> "a/b").

    Raises UnsafeName for absolute names, names with a ".." component and names
    with a control character (a NUL, a newline...): such a name never becomes a
    key (nothing is extracted, but a key is a path to whoever unpacks the
    archive later, and a line in whatever lists the keys).
    """
    if _PLAIN.fullmatch(name):
        return name  # the usual case, checked at once
    if name.startswith(("/", "\\")) or _DRIVE.match(name) or _CONTROL.search(name):
        raise UnsafeName(name)
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." or ".." in p.split("\\") for p in parts):
        raise UnsafeName(name)
    return "/".join(parts)


def unsafe_name_error(path: str, name: str) -> InvalidSourceError:
    """The error for a member whose name ``member_path`` refuses (the name shown escaped, as Python writes it)."""
    if _CONTROL.search(name):
        problem = "has a control character in its name (a NUL, a newline...; shown escaped)"
    else:
        problem = "has an unsafe path (absolute, or with '..')"
    return InvalidSourceError(
        path, f"member {name!r} {problem}: refused",
        hint="the archive may be malicious or damaged; --on-error skip leaves such members out",
    )


def check_names(source: Source) -> None:
    """InvalidSourceError when a class name or a key of ``source`` holds a control character.

    Whatever the source kind (a folder's file and directory names, a list file,
    label values, an HDF5 or LMDB source's keys): a newline or a NUL in a key
    or a class name would make it another name, or another line, to whoever
    reads the archive's index later.  The keys are checked as the bytes array
    they are kept in, a block at a time.
    """
    hint = "rename it; keys and class names must be printable"
    for name in source.classes:
        if _CONTROL.search(name):
            raise InvalidSourceError(
                source.path, f"class name {name!r} has a control character (shown escaped): refused", hint=hint
            )
    i = _first_key_with_control(source.keys)
    if i is not None:
        key = source.key(i)
        raise InvalidSourceError(
            source.location(i), f"key {key!r} has a control character (shown escaped): refused", index=i, key=key,
            hint=hint,
        )


def _first_key_with_control(keys: np.ndarray, block_bytes: int = 64 << 10) -> Optional[int]:
    """The index of the first key with a control character, or None.

    A fixed-width bytes array pads each key with NULs: a NUL counts only before
    another byte of the key.  Blocks of ``block_bytes`` keep the temporary arrays small.
    """
    if keys.dtype.kind != "S" or keys.dtype.itemsize == 0:
        return next((i for i, key in enumerate(keys) if _CONTROL.search(str(key))), None)
    width = keys.dtype.itemsize
    block = max(1, block_bytes // width)
    for first in range(0, len(keys), block):
        rows = np.ascontiguousarray(keys[first:first + block]).view(np.uint8).reshape(-1, width)
        bad = _CONTROL_BYTES[rows]  # NULs included: the padding, unless another byte follows
        nul = rows == 0
        bad &= ~nul | np.logical_or.accumulate(~nul[:, ::-1], axis=1)[:, ::-1]  # a NUL with a byte after it
        hit = np.flatnonzero(bad.any(axis=1))
        if len(hit):
            return first + int(hit[0])
    return None


def keep_last(names: List[str], scopes: "Optional[Sequence[int] | np.ndarray]" = None) -> List[int]:
    """Blank ("") each name that a later name of the same scope repeats, as extracting the container would
    overwrite it; the indices blanked, in order.

    ``scopes``: which file each name is in (a tar, a member tar), None: one.  A
    hash per name finds the candidates, so no dict of every name is built.
    """
    if not names:
        return []
    scope_of = scopes if scopes is not None else [0] * len(names)
    hashes = np.fromiter((hash((scope_of[j], name)) for j, name in enumerate(names)), dtype=np.int64,
                         count=len(names))
    _, inverse, counts = np.unique(hashes, return_inverse=True, return_counts=True)
    last: Dict[Tuple[int, str], int] = {}
    blanked: List[int] = []
    for j in np.flatnonzero(counts[inverse] > 1).tolist():
        name = names[j]
        if not name:
            continue
        earlier = last.get((scope_of[j], name))
        if earlier is not None:
            names[earlier] = ""
            blanked.append(earlier)
        last[(scope_of[j], name)] = j
    return sorted(blanked)


def warn_members(path: str, left_out: Sequence[str], replaced: Sequence[str], container: str) -> None:
    """One SourceMemberWarning listing the members left out, and one listing the names found twice."""
    if left_out:
        warnings.warn(SourceMemberWarning(
            f"{path}: left out {len(left_out)} member(s) that are no file of the {container}: {_some(left_out)}"
        ), stacklevel=4)
    if replaced:
        warnings.warn(SourceMemberWarning(
            f"{path}: {len(replaced)} member name(s) found more than once; the last of each is read, as "
            f"extracting the {container} would keep it: {_some(replaced)}"
        ), stacklevel=4)


def _some(items: Sequence[str], shown: int = 20) -> str:
    more = f" (and {len(items) - shown} more)" if len(items) > shown else ""
    return "; ".join(items[:shown]) + more


def is_junk(path: str) -> bool:
    """macOS metadata that ZIP tools add (``__MACOSX/``, ``._name`` AppleDouble files)."""
    return path.startswith("__MACOSX/") or posixpath.basename(path).startswith("._")


def folder_order(keys: Sequence[str]) -> List[int]:
    """Indices of ``keys`` (class/.../file relative paths) in the order an ImageFolder scan lists them.

    Like ``scan_image_folder``: by class, then directory path, then file name.
    """
    def sort_key(j: int) -> Tuple[str, str, str]:
        directory, name = posixpath.split(keys[j])
        return directory.split("/", 1)[0], directory, name

    return sorted(range(len(keys)), key=sort_key)


def in_folder_order(
    keys: Sequence[str], items: Sequence[Any], labels_of_class: Dict[str, int]
) -> Tuple[List[str], List[Any], List[int]]:
    """``keys`` and their ``items`` in ImageFolder order (``folder_order``), and each key's label from its class."""
    order = folder_order(keys)
    ordered = [keys[j] for j in order]
    return ordered, [items[j] for j in order], [labels_of_class[k.split("/", 1)[0]] for k in ordered]


# ---- files -------------------------------------------------------------------------------------
class FilePool:
    """Read-only descriptors of this process, by path, for ``os.pread`` (at most ``size`` open).

    Safe across fork: a child sees the parent's pid and opens its own.
    """

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._pid = os.getpid()
        self._fds: Dict[str, int] = {}

    def fd(self, path: str) -> int:
        if self._pid != os.getpid():
            self._pid, self._fds = os.getpid(), {}  # the parent's descriptors are the parent's business
        fd = self._fds.pop(path, None)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            while len(self._fds) >= self.size:
                os.close(self._fds.pop(next(iter(self._fds))))
        self._fds[path] = fd  # most recently used last
        return fd

    def pread(self, path: str, size: int, offset: int) -> bytes:
        return os.pread(self.fd(path), size, offset)

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds = {}

    def __getstate__(self) -> Dict[str, Any]:
        return {"size": self.size}  # descriptors do not cross processes

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.size, self._pid, self._fds = state["size"], os.getpid(), {}


def read_head(path: str, size: int = 512) -> bytes:
    """The first ``size`` bytes of a file (b"" for a folder)."""
    if os.path.isdir(path):
        return b""
    with open(path, "rb") as file:
        return file.read(size)

"""The archive's self-description, stored as JSON inside every archive."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import os
import time
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

from .checksum import crc32
from .errors import CorruptArchiveError, IncompleteArchiveError, UnsupportedVersionError
from .fields import FieldSpec, FieldValueError, check_fields
from .index import IMAGE_SIZE_ARRAYS

MODES = ("raw", "encoded")
CHECKSUM = "crc32"
# The newest archive layout this library reads and writes.  Version 2 adds the CRC32 of
# every index array (``index_crc32``) and of the manifest itself (``manifest_crc32``);
# version 1 archives are still read, their index unchecked.  Version 3: raw HDF5 archives
# store each image's chunk position in the index, and ZIP archives carry a locator of their
# manifest and index in the end record's comment (both read in constant time).  Versions 1
# and 2 are still read; a reader that knows only 2 says "upgrade" instead of "damaged".
# Version 4: a part of a sharded set names its set and its place in it (``set_id``, ``part``).
# An archive is stamped with the oldest version that holds all it stores: one that is no
# part of a set is still version 3 (byte for byte what it was), and a reader that knows only
# 3 says "upgrade" of a set's part instead of "damaged".
# Version 5: samples carry named fields besides the image and class (``fields``: see fields.py),
# each with its own index arrays; only an archive with fields is stamped 5.
# Version 6: raw pixels may be stored planar, channel by channel (``raw_layout``: "chw"), which the
# field names from this version on (it is required there); before it every raw archive is "hwc".  Only
# a planar archive is stamped 6, so that a reader that cannot part its channels refuses it.
# Version 7: an archive may declare that its samples have no label (``labelled``: false; every label
# -1, no classes); only such an archive is stamped 7.
# Version 8: an encoded archive's index records each image's size (the arrays ``widths`` and
# ``heights``, read from its header when written); only an archive whose index holds them is
# stamped 8, so that a reader that knows only 7 says "upgrade" of it instead of "damaged".
# An archive is stamped with the newest of the versions its content needs.
FORMAT_VERSION = 8
PLAIN_VERSION = 3  # an archive that is no part of a set
SET_VERSION = 4  # a part of a set
FIELDS_VERSION = 5  # an archive whose samples have fields
LAYOUT_VERSION = 6  # a raw archive whose pixels are stored planar
RAW_LAYOUTS = ("hwc", "chw")  # how a raw sample's bytes are laid out: interleaved (H x W x C), or planar
LABELS_VERSION = 7  # an archive whose samples have no label
SIZES_VERSION = 8  # an archive whose index records its images' sizes
NO_LABEL = -1  # every label of an archive that declares none


@dataclasses.dataclass(frozen=True)
class ArchiveManifest:
    """What an archive holds: format, layout of its samples, classes.

    ``shape`` (H, W, C) is set for raw archives; ``encoding`` ("jpeg", "png" or
    "mixed") for encoded ones.  ``complete`` is written last: an archive whose
    manifest is missing or says ``complete: false`` was never sealed, and
    from_json refuses it, as it refuses a ``format_version`` it does not know.
    ``index_crc32`` holds (array name, CRC32) of every index array
    (``checksum.array_crc32``); the stored JSON also carries the CRC32 of the
    manifest's own content, checked by from_json.

    Args:
        format: the archive format's name ("zip", "hdf5", "lmdb", "memmap", ...).
        mode: "raw" (decoded pixels of one shape) or "encoded" (image file bytes).
        count: the number of samples.
        classes: the class names, label i naming ``classes[i]``.
        shape: (H, W, C) of every raw sample; None for encoded archives.
        dtype: the raw samples' numpy dtype (uint8).
        encoding: "jpeg", "png" or "mixed" for encoded archives; None for raw ones.
        checksum: the per-sample checksum kind ("crc32"), or None.
        format_version: the layout version the archive was written with.
        created_with, created_at: the writing library's version and the UTC time of writing.
        complete: whether the archive was sealed.
        index_crc32: (array name, CRC32) of every index array.
        set_id: the id of the sharded set this archive is a part of ("" when it is none; a set's
            joined manifest carries its set's id).
        part: this archive's place in that set, counted from 0 (-1 when it is no part of a set).
        fields: what each sample holds besides its image and class (``fields.FieldSpec``), in order.
        raw_layout: how a raw sample's bytes are stored: "hwc" (interleaved, H x W x C) or "chw"
            (planar, C x H x W).  ``shape`` is (H, W, C) either way: the image's, not the bytes'.
        labelled: False when the samples have no label (detection, segmentation, unlabelled images): no
            classes, and every label ``NO_LABEL`` (-1), as a reader checks on open.
    """

    format: str
    mode: str
    count: int
    classes: Tuple[str, ...]
    shape: Optional[Tuple[int, int, int]] = None
    dtype: str = "uint8"
    encoding: Optional[str] = None
    checksum: Optional[str] = CHECKSUM
    format_version: int = FORMAT_VERSION
    created_with: str = ""
    created_at: str = ""
    complete: bool = True
    index_crc32: Tuple[Tuple[str, int], ...] = ()
    set_id: str = ""
    part: int = -1
    fields: Tuple[FieldSpec, ...] = ()
    raw_layout: str = "hwc"
    labelled: bool = True

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # no deep copy, unlike asdict
        if self.format_version < LAYOUT_VERSION:  # left out: before version 6 every raw archive is "hwc"
            if self.raw_layout != "hwc":
                raise ValueError(f"a {self.raw_layout} raw layout needs format version {LAYOUT_VERSION} or later")
            del data["raw_layout"]
        if self.labelled:  # left out: an archive with labels stays as it was
            del data["labelled"]
        elif self.format_version < LABELS_VERSION:
            raise ValueError(f"an archive without labels needs format version {LABELS_VERSION} or later")
        for name in _SET_FIELDS:  # left out when unset: an archive that is no part of a set stays as it was
            if data[name] == _UNSET[name]:
                del data[name]
        if self.fields:
            data["fields"] = [spec.to_json() for spec in self.fields]
        else:  # left out: an archive without fields stays byte for byte what it was
            del data["fields"]
        data["classes"] = list(self.classes)
        data["shape"] = None if self.shape is None else list(self.shape)
        data["index_crc32"] = dict(self.index_crc32)
        if self.format_version >= 2:
            data["manifest_crc32"] = _content_crc32(data)
        return canonical_json(data)

    @classmethod
    def from_json(cls, text: "str | bytes", path: "os.PathLike[str] | str | None" = None) -> "ArchiveManifest":
        """Parse a stored manifest; ``path`` (the archive) is named in the errors.

        Raises:
            UnsupportedVersionError: written by a newer packed_formats (upgrade it).
            IncompleteArchiveError: the manifest says ``complete: false``.
            ValueError: not a manifest (bad JSON, unknown fields).
        """
        data = _parse(text)
        if not isinstance(data, dict):
            raise ValueError(f"the manifest is a JSON {type(data).__name__}, not an object")
        _check_version(data, path)  # first: a newer version may add fields this one does not know
        stored_crc = data.pop("manifest_crc32", None)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown manifest fields {sorted(unknown)}")
        if data.get("complete", True) is not True:
            raise IncompleteArchiveError(
                path, "the manifest says complete: false: the archive was never sealed",
                hint="its writer was killed or failed; re-create it",
            )
        if data.get("format_version", 1) >= 2 and not _stored_text_matches(text, stored_crc) \
                and stored_crc != _content_crc32(dict(data, classes=list(data.get("classes", ())))):
            raise CorruptArchiveError(
                path, "the manifest is damaged (its content does not match its checksum)",
                hint="the archive is damaged: re-create it",
            )
        data["classes"] = tuple(data.get("classes", ()))
        if data.get("shape") is not None:
            data["shape"] = tuple(int(x) for x in data["shape"])
        if type(data.get("set_id", "")) is not str or type(data.get("part", -1)) is not int:
            raise ValueError("the manifest's set_id is not a string or its part not an integer")
        data["index_crc32"] = tuple(sorted((str(k), int(v)) for k, v in dict(data.get("index_crc32", {})).items()))
        data["fields"] = _parse_fields(data.get("fields", []))
        _check_raw_layout(data, path)
        _check_labelled(data, path)
        return cls(**data)

    def field(self, name: str) -> FieldSpec:
        """The field ``name`` (KeyError naming the fields there are when there is none)."""
        for spec in self.fields:
            if spec.name == name:
                return spec
        there = ", ".join(s.name for s in self.fields) or "none"
        raise KeyError(f"the archive has no field {name!r} (its fields: {there})")

    @property
    def stored_shape(self) -> Optional[Tuple[int, int, int]]:
        """The shape a raw sample's bytes are stored in: (H, W, C), or (C, H, W) when planar; None for
        encoded archives."""
        if self.shape is None:
            return None
        h, w, c = self.shape
        return (c, h, w) if self.raw_layout == "chw" else (h, w, c)

    @property
    def sample_nbytes(self) -> Optional[int]:
        """Bytes of one raw sample, None for encoded archives."""
        if self.shape is None:
            return None
        h, w, c = self.shape
        return h * w * c


_SET_FIELDS = ("set_id", "part")
_UNSET = {f.name: f.default for f in dataclasses.fields(ArchiveManifest) if f.name in _SET_FIELDS}
_PLACE: "contextvars.ContextVar[Optional[Tuple[str, int]]]" = contextvars.ContextVar("set_place", default=None)


@contextlib.contextmanager
def part_of_set(set_id: str, part: int) -> Iterator[None]:
    """Archives sealed in this block (in this thread) are part ``part`` of the set ``set_id``: how a
    set's writers (``ShardedWriter``, ``convert --part``) have each part's manifest name its place."""
    if not set_id or part < 0:
        raise ValueError(f"a part of a set needs a set id and a place from 0, got {set_id!r} and {part}")
    token = _PLACE.set((set_id, part))
    try:
        yield
    finally:
        _PLACE.reset(token)


def new_manifest(
    format: str,
    mode: str,
    count: int,
    classes: Sequence[str],
    shape: Optional[Tuple[int, int, int]],
    encoding: Optional[str],
    index_crc32: Sequence[Tuple[str, int]] = (),
    fields: Sequence[FieldSpec] = (),
    raw_layout: str = "hwc",
    labelled: bool = True,
) -> ArchiveManifest:
    """A sealed manifest stamped with this library's version.

    No wall-clock time is stored, so converting the same input twice gives
    byte-identical archives; ``created_at`` is set only from $SOURCE_DATE_EPOCH
    (the reproducible-builds convention) when a fixed date is wanted.  Within
    ``part_of_set``, the manifest names its set and its place in it.  A planar raw archive
    (``raw_layout="chw"``) needs version 6, which names its layout; an archive without labels
    (``labelled=False``) version 7; one whose index records its images' sizes version 8: it is
    stamped with the newest its content needs.
    """
    from . import __version__

    if raw_layout not in RAW_LAYOUTS or (raw_layout != "hwc" and mode != "raw"):
        raise ValueError(f"raw_layout must be one of {RAW_LAYOUTS} (and 'hwc' unless mode='raw'), got {raw_layout!r}")
    place = _PLACE.get()
    needs = [FIELDS_VERSION if fields else PLAIN_VERSION if place is None else SET_VERSION]
    needs += [LAYOUT_VERSION] if raw_layout != "hwc" else []
    needs += [] if labelled else [LABELS_VERSION]
    needs += [SIZES_VERSION] if any(name in IMAGE_SIZE_ARRAYS for name, _ in index_crc32) else []
    return ArchiveManifest(
        format=format,
        mode=mode,
        count=count,
        classes=tuple(classes),
        shape=None if shape is None else (int(shape[0]), int(shape[1]), int(shape[2])),
        encoding=encoding,
        created_with=f"packed_formats {__version__}",
        created_at=_source_date(),
        index_crc32=tuple(sorted(index_crc32)),
        format_version=max(needs),
        set_id="" if place is None else place[0],
        part=-1 if place is None else place[1],
        fields=tuple(fields),
        raw_layout=raw_layout,
        labelled=labelled,
    )


def _check_raw_layout(data: Dict[str, Any], path: "os.PathLike[str] | str | None") -> None:
    """CorruptArchiveError unless the manifest's ``raw_layout`` is one this library knows, named where its
    version requires it (6 on) and only there, and planar only for a raw archive: a field left out must
    never read a planar archive's pixels as interleaved ones."""
    version, layout = data.get("format_version", 1), data.get("raw_layout")  # no version: as old as the CRC check
    hint = "the manifest was damaged or edited: re-create the archive from its source"
    if version < LAYOUT_VERSION:
        if "raw_layout" in data:
            raise CorruptArchiveError(path, f"the manifest of format version {version} names a raw_layout "
                                            f"({layout!r}), which only version {LAYOUT_VERSION} on records", hint=hint)
        return
    if layout is None:
        raise CorruptArchiveError(path, f"the manifest of format version {version} does not say how raw pixels are "
                                        f"laid out (its raw_layout is missing)", hint=hint)
    if layout not in RAW_LAYOUTS:
        raise CorruptArchiveError(path, f"the manifest's raw_layout {layout!r} is none this packed_formats knows "
                                        f"({', '.join(RAW_LAYOUTS)})", hint=hint)
    if layout != "hwc" and data.get("mode") != "raw":
        raise CorruptArchiveError(path, f"the manifest gives an {data.get('mode')} archive the raw_layout "
                                        f"{layout!r}, which only raw archives have", hint=hint)


def _check_labelled(data: Dict[str, Any], path: "os.PathLike[str] | str | None") -> None:
    """CorruptArchiveError unless ``labelled`` is left out (the samples have labels) or a boolean of a manifest
    of version 7 on, and an archive without labels names no class (its labels are checked on open)."""
    if "labelled" not in data:
        return
    hint = "the manifest was damaged or edited: re-create the archive from its source"
    labelled, version = data["labelled"], data.get("format_version", 1)
    if type(labelled) is not bool or version < LABELS_VERSION:
        raise CorruptArchiveError(path, f"the manifest's labelled is {labelled!r} in format version {version} (a "
                                        f"boolean, from version {LABELS_VERSION} on)", hint=hint)
    if not labelled and data.get("classes"):
        raise CorruptArchiveError(path, f"the manifest says the samples have no label but names "
                                        f"{len(data['classes'])} classes", hint=hint)


def _parse_fields(data: Any) -> Tuple[FieldSpec, ...]:
    """The manifest's ``fields`` list as FieldSpecs (ValueError when it is no list of distinct fields)."""
    if not isinstance(data, list):
        raise ValueError(f"the manifest's fields are a list, got {type(data).__name__}")
    try:
        return check_fields([FieldSpec.from_json(item) for item in data])
    except FieldValueError as exc:  # the writer checks each declaration as this does: none wrote this one
        raise FieldValueError(f"{exc} (a declaration no writer makes: the manifest was damaged or edited; "
                              "re-create the archive from its source)") from None


def _content_crc32(data: Dict[str, Any]) -> int:
    """CRC32 of a manifest's fields (all but its own checksum), in their canonical JSON text."""
    return crc32(canonical_json(data).encode())


_CLASSES_KEY = '\n "classes": [\n'  # to_json's line of the top-level key (one space) of a non-empty list
_CLASSES_KEY_BYTES = (_CLASSES_KEY.encode(), b"\n ]", b"[]")
_RECENT_CLASSES: Dict["str | bytes", Tuple[Any, ...]] = {}  # the text of a class list -> its names, for equal lists


def _parse(text: "str | bytes") -> Any:
    """``json.loads(text)``, a class list laid out as ``to_json`` lays it parsed once for equal lists
    read recently, and then one tuple for all of them.  Every part of a sharded set stores the
    same list: parsing ImageNet-21k's 21,841 names took ~1 ms a part, and 1,400 parts' own copies
    of them would be 30M strings (~2 GiB) in every process that opens the set."""
    key, close, empty = (_CLASSES_KEY, "\n ]", "[]") if isinstance(text, str) else _CLASSES_KEY_BYTES
    start = text.find(key)  # type: ignore[arg-type]  # a string holds no raw newline: the top-level key
    if start < 0:
        return json.loads(text)
    opening = start + len(key) - 2
    for known in reversed(_RECENT_CLASSES):  # a list read recently, compared in place (no search, no hash)
        if type(known) is type(text) and text.startswith(known, opening):  # type: ignore[arg-type]
            listed, end = known, opening + len(known) - 3  # its first "\n ]" is its end, and so the text's
            break
    else:
        end = text.find(close, start)  # type: ignore[arg-type]  # the list's end, back at one space
        if end < 0:
            return json.loads(text)
        listed = text[opening : end + 3]  # '[\n  "a",\n  "b"\n ]'
    data = json.loads(text[:opening] + empty + text[end + 3 :])  # type: ignore[operator]
    if isinstance(data, dict):
        classes = _RECENT_CLASSES.get(listed)
        if classes is None:
            classes = _RECENT_CLASSES[listed] = tuple(json.loads(listed))
            if len(_RECENT_CLASSES) > 8:  # a bound: the oldest go (dicts keep insertion order)
                del _RECENT_CLASSES[next(iter(_RECENT_CLASSES))]
        data["classes"] = classes
    return data


def _stored_text_matches(text: "str | bytes", stored_crc: Any) -> bool:
    """Whether ``text`` is ``to_json``'s own text of content whose checksum is ``stored_crc``: the
    text less its checksum line is then the canonical text that was checked (top-level keys are
    the lines indented by one space, and a string holds no raw newline).  Re-encoding the parsed
    content is what a manifest written any other way is checked by."""
    if type(stored_crc) is not int:
        return False
    data = text.encode() if isinstance(text, str) else text
    line = f'\n "manifest_crc32": {stored_crc},\n'.encode()
    at = data.rfind(line)  # near the end, after the class names
    if at < 0:
        return False
    view = memoryview(data)
    return crc32(view[at + len(line) :], crc32(b"\n", crc32(view[:at]))) == stored_crc


_CLASSES_MARK = "\0classes\0"


def canonical_json(data: Dict[str, Any]) -> str:
    """``json.dumps(data, indent=1, sort_keys=True)``, the same text, made fast where it is slow.

    With an indent, ``json`` encodes in Python, value by value: ~20 ms for the
    21,841 class names of ImageNet-21k, in every part of a sharded set that a
    process opens (1,400 parts: 30 s).  The class names (a list of strings at
    the top level) are encoded here by the C encoder, with the separator the
    indent would put between them, and set into the rest's text."""
    classes = data.get("classes")
    if not isinstance(classes, list) or not classes or set(map(type, classes)) != {str}:
        return json.dumps(data, indent=1, sort_keys=True)
    text = json.dumps({**data, "classes": _CLASSES_MARK}, indent=1, sort_keys=True)
    mark = json.dumps(_CLASSES_MARK)
    if text.count(mark) != 1:  # another field holds the mark itself: the plain way
        return json.dumps(data, indent=1, sort_keys=True)
    items = json.dumps(classes, separators=(",\n  ", ": "))  # '["a",\n  "b"]': the C encoder
    return text.replace(mark, "[\n  " + items[1:-1] + "\n ]")


def _check_version(data: Dict[str, Any], path: "os.PathLike[str] | str | None") -> None:
    version = data.get("format_version", FORMAT_VERSION)
    if type(version) is not int or not 1 <= version <= FORMAT_VERSION:
        from . import __version__

        raise UnsupportedVersionError(
            path,
            f"archive format version {version!r} is not one this packed_formats {__version__} reads "
            f"(it reads version {FORMAT_VERSION})",
            hint="it was written by a newer packed_formats: upgrade packed_formats (pip install -U packed_formats)",
        )


def _source_date() -> str:
    """$SOURCE_DATE_EPOCH as an ISO 8601 UTC time, or "" (never the wall clock: archives stay reproducible)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not epoch.isdigit():
        return ""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(epoch)))

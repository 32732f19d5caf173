"""webdataset: samples spread over tar shards, each sample the members sharing a key.

``shards-{000..009}.tar`` (a brace pattern), a list of shard paths, or one
shard.  Members ``<key>.<ext>`` belong to sample ``<key>`` (the member name
up to the first dot of its file name); the image is the ``jpg``, ``jpeg``,
``png`` or ``webp`` member (``image_key``: another extension, or a
comma-separated list in order of preference), the label the text of the
``cls`` member (``label_key``): an integer, or a class name.  Samples keep
the shards' order; a sample's key in the archive is its image member's name.
A sample without label or image is an error naming the shard and key, or is
left out with on_error="skip".  ``label_key="none"`` (``--label-key none``)
declares shards without labels (detection, segmentation): no member is a
label, the archive has no classes, says it has no labels, and every label is -1.

With ``fields`` the sample's other members become fields of the archive: a
field NAME takes the member whose extension is NAME or starts with NAME and a
dot (``seg`` takes ``seg.png``).  ``("auto",)`` makes a field of each other
extension every sample has: images (png, jpg, jpeg, webp) as image fields,
json, txt (text) and the rest as bytes, named by the extension's first part
(``seg.png`` is ``seg``); an ``.npy`` member needs its declaration
(``--field depth=array:float32[N,4]``).  A sample without a field's member,
or whose member is no value of its field, is an error naming the member (or
is left out with on_error="skip").  From compressed shards, a sample's image
and its fields' members come in one ordered pass, as images alone do.
"""

from __future__ import annotations

import itertools
import os
import posixpath
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..errors import ArchiveNotFoundError, CorruptSampleError, InvalidSourceError
from ..fields import NAME, RESERVED, FieldSpec, FieldValueError
from ..manifest import NO_LABEL
from .base import Sample, SourceOptions, classes_and_labels, field_extension, is_junk
from .tarfiles import DEFAULT_LABEL_KEY, TarBackedSource, TarListing, TarSamples, member_extension, screen_members

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
_BRACE = re.compile(r"\{([^{}]*)\}")
NO_LABELS = "none"  # the label_key of shards declared to have no labels


class WebDatasetSource(TarBackedSource):
    """Samples grouped by key in one or more tar shards."""

    kind = "webdataset"
    label_advice = "is that right? Check the label members (--label-key names their extension)"
    reads_fields = True
    field_samples: Dict[str, TarSamples] = {}
    together: Optional[TarSamples] = None  # compressed shards with fields: every member a sample needs, in order

    @classmethod
    def matches(cls, listing: TarListing, options: SourceOptions) -> bool:
        label = (options.label_key or DEFAULT_LABEL_KEY).lower()
        if label == NO_LABELS:  # declared: shards without label members
            return True
        top = (name for s, name in enumerate(listing.names) if name and listing.outer[s] < 0)
        return len(listing.parts) > 1 or any(member_extension(name).lower() == label for name in top)

    @classmethod
    def from_listing(cls, path: str, listing: TarListing, options: SourceOptions) -> "WebDatasetSource":
        if options.subdir is not None:
            raise InvalidSourceError(path, "webdataset shards take no subdir option")
        label_ext = (options.label_key or DEFAULT_LABEL_KEY).lower()
        labelled = label_ext != NO_LABELS
        preferred = _imagemember_extensions(options.image_key)
        failed = screen_members(path, listing, options)
        grouped = _samples_by_key(listing)
        specs = _field_specs(path, listing, grouped, options, preferred, label_ext)
        seqs: List[int] = []
        keys: List[str] = []
        values: List[str] = []
        field_seqs: Dict[str, List[int]] = {spec.name: [] for spec in specs}
        skipped = 0
        for part, members in grouped:
            for key, found in members.items():
                image_ext = next((e for e in preferred if e in found), None)
                image = None if image_ext is None else found[image_ext]
                label = found.get(label_ext) if labelled else -1
                taken = (image_ext, label_ext)
                chosen = {spec.name: _field_member(spec.name, found, taken) for spec in specs}
                skipped += len(found) - (image is not None) - (label is not None and labelled) - sum(
                    s is not None for s in chosen.values())
                lacking = [name for name, s in chosen.items() if s is None]
                if image is None or label is None or lacking:
                    if image is None:
                        problem = f"has no image member ({', '.join(preferred)})"
                        hint = "fix the shard, name the image extension with --image-key, or --on-error skip"
                    elif label is None:
                        problem = f"has no .{label_ext} label member"
                        hint = ("fix the shard, name the label extension with --label-key, or --on-error skip (a "
                                "set whose images have no label at all is declared with --label-key none)")
                    else:
                        problem = f"has no member for field {lacking[0]!r} (.{lacking[0]} or .{lacking[0]}.*)"
                        hint = (f"add the member, leave out --field {lacking[0]}, or --on-error skip to leave such "
                                "samples out")
                    error = InvalidSourceError(listing.parts[part], f"sample {key!r} {problem}", key=key, hint=hint)
                    if options.on_error == "raise":
                        raise error
                    failed.append(str(error))
                    continue
                text = listing.contents.get(label, b"").decode("utf-8", "replace").strip() if labelled else ""
                seqs.append(image)
                keys.append(listing.names[image])
                values.append(text)
                for name, s in chosen.items():
                    field_seqs[name].append(int(s or 0))  # a sample lacking one was left out above
        classes, labels = classes_and_labels(path, values) if labelled else ((), [NO_LABEL] * len(values))
        shards = f"{len(listing.parts)} shard{'s' if len(listing.parts) != 1 else ''}"
        compressed = ", compressed" if any(listing.compressed) else ""
        described = f", fields {', '.join(spec.describe() for spec in specs)}" if specs else ""
        source = cls(path, classes, keys, labels, TarSamples(listing, seqs), skipped, failed,
                     f"webdataset, {shards}{compressed}{described}")
        source.fields, source.labelled = specs, labelled
        source.field_samples = {name: TarSamples(listing, s) for name, s in field_seqs.items()}
        if specs and any(listing.compressed):  # one ordered pass: each sample's image, then its fields' members
            names = [spec.name for spec in specs]
            source.together = TarSamples(listing, [s for i, image in enumerate(seqs)
                                                   for s in [image] + [field_seqs[n][i] for n in names]])
        return source

    def load_fields(self, i: int) -> Dict[str, Any]:
        key = self.key(i)
        return self._values(i, [self.field_samples[spec.name].read(i, key) for spec in self.fields])

    def _values(self, i: int, members: List[bytes]) -> Dict[str, Any]:
        """Sample i's fields from their members' bytes (CorruptSampleError naming the member of one that is
        no value of its field)."""
        out = {}
        for spec, data in zip(self.fields, members):
            try:
                out[spec.name] = spec.from_file(data)
            except FieldValueError as exc:
                raise CorruptSampleError(self.field_samples[spec.name].where(i), str(exc), index=i, key=self.key(i),
                                         hint="fix the member, declare the field otherwise (--field), or "
                                              "--on-error skip") from None
        return out

    def __iter__(self) -> Iterator[Sample]:
        """Compressed shards with fields: one ordered pass over each sample's image and field members."""
        if self.random_access or not self.fields:
            yield from super().__iter__()
            return
        assert self.together is not None  # from_listing made it for compressed shards with fields
        width, i = 1 + len(self.fields), 0
        group: List[bytes] = []
        for data in self.together.in_order():
            group.append(data)
            if len(group) < width:
                continue
            try:
                sample = Sample(self.key(i), int(self.labels[i]), group[0], self._values(i, group[1:]))
            except CorruptSampleError as exc:
                sample = Sample(self.key(i), int(self.labels[i]), exc)
            group, i = [], i + 1
            yield sample


def _field_specs(path: str, listing: TarListing, grouped, options: SourceOptions, preferred: List[str],
                 label_ext: str) -> Tuple[FieldSpec, ...]:
    """The fields to read: those declared, or (auto) one for each other extension every sample has."""
    if not options.fields:
        return ()
    declared = options.declared_fields
    if not options.auto_fields:
        return declared
    common: Optional[set] = None
    for _, members in grouped:
        for found in members.values():
            image_ext = next((e for e in preferred if e in found), None)
            others = {e for e in found if e not in (image_ext, label_ext)}
            common = others if common is None else common & others
    specs = list(declared)
    arrays: List[Tuple[str, str]] = []  # (extension, field name) of the .npy members, to declare
    for extension in sorted(common or ()):
        name, last = extension.split(".", 1)[0], extension.rsplit(".", 1)[-1]
        if not NAME.match(name) or name in RESERVED or name in {spec.name for spec in specs}:
            continue
        if last == "npy":
            arrays.append((extension, name))
            continue
        kind = "image" if last in IMAGE_EXTENSIONS else {"json": "json", "txt": "text"}.get(last, "bytes")
        specs.append(FieldSpec(name, kind))
    if arrays:  # every one named at once, not one per try
        members = [f".{extension}" for extension, _ in arrays]
        listed = members[0] if len(members) == 1 else f"{', '.join(members[:-1])} and {members[-1]}"
        raise InvalidSourceError(path, f"the {listed} members are arrays: declare their dtype and shape",
                                 hint=" ".join(f"--field {name}=array:DTYPE[N,...]" for _, name in arrays)
                                 + " (e.g. float32[N,4]), with --field auto")
    return tuple(specs)


def _field_member(name: str, found: Dict[str, int], taken: Tuple[Optional[str], str]) -> Optional[int]:
    """The member of a sample that field ``name`` takes (``field_extension``), never its image or label."""
    extension = field_extension(name, found, taken)
    return None if extension is None else found[extension]


def _samples_by_key(listing: TarListing) -> List[Tuple[int, Dict[str, Dict[str, int]]]]:
    """Per shard: {sample key: {extension: member seq}}, keys in order of appearance."""
    shards: List[Tuple[int, Dict[str, Dict[str, int]]]] = []
    current: Dict[str, Dict[str, int]] = {}
    part = -1
    for s, name in enumerate(listing.names):
        if listing.part[s] != part:
            part = listing.part[s]
            current = {}
            shards.append((part, current))
        if not name or listing.outer[s] >= 0 or is_junk(name):
            continue
        base = posixpath.basename(name)
        key = posixpath.join(posixpath.dirname(name), base.split(".", 1)[0])
        current.setdefault(key, {}).setdefault(member_extension(name).lower(), s)
    return shards


def _imagemember_extensions(option: "str | None") -> List[str]:
    if option is None:
        return list(IMAGE_EXTENSIONS)
    return [e.strip().lstrip(".").lower() for e in option.split(",") if e.strip()]


def expand_shards(pattern: "str | os.PathLike[str] | Sequence[str | os.PathLike[str]]") -> List[str]:
    """Shard paths from a list, or from brace patterns: ``a-{000..009}.tar``, ``{train,val}.tar``."""
    if not isinstance(pattern, (str, os.PathLike)):
        paths = [p for item in pattern for p in expand_shards(item)]
    else:
        paths = expand_braces(os.fspath(pattern))
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise ArchiveNotFoundError(
            missing[0], "no such shard", hint=f"{len(missing)} of {len(paths)} shards are missing"
        )
    return paths


def expand_braces(text: str) -> List[str]:
    """Every string a shell-style brace pattern stands for, in order (ranges keep their zero padding)."""
    match = _BRACE.search(text)
    if match is None:
        return [text]
    head, tail = text[: match.start()], text[match.end():]
    body = match.group(1)
    numbers = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numbers:
        first, last = numbers.groups()
        width = len(first) if first.startswith("0") else 0
        step = 1 if int(last) >= int(first) else -1
        choices = [str(n).zfill(width) for n in range(int(first), int(last) + step, step)]
    else:
        choices = body.split(",")
    return list(itertools.chain.from_iterable(expand_braces(head + c + tail) for c in choices))


def is_pattern(text: str) -> bool:
    return _BRACE.search(text) is not None

"""webdataset: samples spread over tar shards, each sample the members sharing a key.

``shards-{000..009}.tar`` (a brace pattern), a list of shard paths, or one
shard.  Members ``<key>.<ext>`` belong to sample ``<key>`` (the member name
up to the first dot of its file name); the image is the ``jpg``, ``jpeg``,
``png`` or ``webp`` member (``image_key``: another extension, or a
comma-separated list in order of preference), the label the text of the
``cls`` member (``label_key``): an integer, or a class name.  Samples keep
the shards' order; a sample's key in the archive is its image member's name.
A sample without label or image is an error naming the shard and key, or is
left out with on_error="skip".
"""

from __future__ import annotations

import itertools
import os
import posixpath
import re
from typing import Dict, List, Sequence, Tuple

from ..errors import ArchiveNotFoundError, InvalidSourceError
from .base import SourceOptions, classes_and_labels, is_junk
from .tarfiles import DEFAULT_LABEL_KEY, TarBackedSource, TarListing, TarSamples, member_extension, screen_members

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
_BRACE = re.compile(r"\{([^{}]*)\}")


class WebDatasetSource(TarBackedSource):
    """Samples grouped by key in one or more tar shards."""

    kind = "webdataset"

    @classmethod
    def matches(cls, listing: TarListing, options: SourceOptions) -> bool:
        label = (options.label_key or DEFAULT_LABEL_KEY).lower()
        top = (name for s, name in enumerate(listing.names) if name and listing.outer[s] < 0)
        return len(listing.parts) > 1 or any(member_extension(name).lower() == label for name in top)

    @classmethod
    def from_listing(cls, path: str, listing: TarListing, options: SourceOptions) -> "WebDatasetSource":
        if options.subdir is not None:
            raise InvalidSourceError(path, "webdataset shards take no subdir option")
        label_ext = (options.label_key or DEFAULT_LABEL_KEY).lower()
        preferred = _imagemember_extensions(options.image_key)
        failed = screen_members(path, listing, options)
        seqs: List[int] = []
        keys: List[str] = []
        values: List[str] = []
        skipped = 0
        for part, members in _samples_by_key(listing):
            for key, found in members.items():
                image = next((found[e] for e in preferred if e in found), None)
                label = found.get(label_ext)
                skipped += len(found) - (image is not None) - (label is not None)
                if image is None or label is None:
                    problem = f"has no image member ({', '.join(preferred)})" if image is None else (
                        f"has no .{label_ext} label member"
                    )
                    error = InvalidSourceError(
                        listing.parts[part], f"sample {key!r} {problem}", key=key,
                        hint="fix the shard, choose --label-key/--image-key, or --on-error skip",
                    )
                    if options.on_error == "raise":
                        raise error
                    failed.append(str(error))
                    continue
                text = listing.contents.get(label, b"").decode("utf-8", "replace").strip()
                seqs.append(image)
                keys.append(listing.names[image])
                values.append(text)
        classes, labels = classes_and_labels(path, values)
        shards = f"{len(listing.parts)} shard{'s' if len(listing.parts) != 1 else ''}"
        compressed = ", compressed" if any(listing.compressed) else ""
        return cls(path, classes, keys, labels, TarSamples(listing, seqs), skipped, failed,
                   f"webdataset, {shards}{compressed}")


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

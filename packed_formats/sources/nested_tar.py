"""nested-tar: a tar of per-class tars, as ImageNet's training set is distributed.

``n01440764.tar`` inside the tar is class ``n01440764``; its images get the
keys ``n01440764/<name>``, as if each member tar were extracted into a folder
named after it.  Uncompressed (the usual case), every image is read at random
from its offset inside the outer file.
"""

from __future__ import annotations

import posixpath
from typing import Dict, List

from ..backends.folder import is_image_file
from ..errors import InvalidSourceError
from .base import SourceOptions, in_folder_order, is_junk
from .tarfiles import TarBackedSource, TarListing, TarSamples, screen_members


class NestedTarSource(TarBackedSource):
    """Images inside the member tars of a tar, one class per member tar."""

    kind = "nested-tar"

    @classmethod
    def matches(cls, listing: TarListing, options: SourceOptions) -> bool:
        top = [s for s, name in enumerate(listing.names) if listing.outer[s] < 0 and name and not is_junk(name)]
        return bool(top) and all(s in listing.expanded for s in top)

    @classmethod
    def from_listing(cls, path: str, listing: TarListing, options: SourceOptions) -> "NestedTarSource":
        if options.subdir is not None:
            raise InvalidSourceError(path, "a tar of per-class tars takes no subdir option")
        failed = screen_members(path, listing, options)
        stems: Dict[int, str] = {}
        for s in sorted(listing.expanded):
            name = listing.names[s]
            if name and not is_junk(name):
                stems[s] = posixpath.basename(name)[: -len(".tar")]
        if not stems:
            raise InvalidSourceError(path, "has no member tars (class.tar) inside", hint="is it a tar of images?")
        if len(set(stems.values())) != len(stems):
            raise InvalidSourceError(path, "has two member tars of the same name: their classes would merge")
        classes = tuple(sorted(stems.values()))
        lookup = {name: c for c, name in enumerate(classes)}
        seqs: List[int] = []
        keys: List[str] = []
        skipped = 0
        for s, name in enumerate(listing.names):
            outer = listing.outer[s]
            if outer not in stems or not name or is_junk(name):
                continue
            if is_image_file(name):
                seqs.append(s)
                keys.append(f"{stems[outer]}/{name}")
            else:
                skipped += 1
        keys, seqs, labels = in_folder_order(keys, seqs, lookup)
        compressed = " (compressed)" if listing.compressed[0] else ""
        return cls(
            path, classes, keys, labels, TarSamples(listing, seqs), skipped, failed,
            f"{len(classes)} per-class tars{compressed}",
        )

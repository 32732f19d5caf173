"""tar: a tar file (uncompressed, .tar.gz/.tgz, .tar.bz2, .tar.xz) holding an ImageFolder tree,
or images plus a stylegan2-ada dataset.json.

Found from the content, not the name.  Keys, labels and order are those of
the extracted folder; see tarfiles.py for how members are read in that order.
"""

from __future__ import annotations

from ..errors import InvalidSourceError
from .base import SourceOptions
from .layout import DATASET_JSON, dataset_json_layout, dataset_json_member, image_folder_layout, looks_like_dataset_json
from .tarfiles import TarBackedSource, TarListing, TarSamples, screen_members


class TarSource(TarBackedSource):
    """Members of one tar file laid out as an ImageFolder tree (or labelled by a dataset.json)."""

    kind = "tar"

    @classmethod
    def matches(cls, listing: TarListing, options: SourceOptions) -> bool:
        return len(listing.parts) == 1

    @classmethod
    def from_listing(cls, path: str, listing: TarListing, options: SourceOptions) -> "TarSource":
        if len(listing.parts) != 1:
            raise InvalidSourceError(
                path, "several tar files are read as webdataset shards", hint="--source-format webdataset"
            )
        failed = screen_members(path, listing, options)
        names = [name if listing.outer[s] < 0 else "" for s, name in enumerate(listing.names)]
        where = dataset_json_member(names, options.subdir)
        if where == -1:
            raise InvalidSourceError(path, f"has several {DATASET_JSON} files", hint="choose one with --subdir")
        if where is not None and looks_like_dataset_json(listing.contents.get(where, b"")):
            layout = dataset_json_layout(path, names, where, listing.contents[where])
        else:
            layout = image_folder_layout(path, names, listing.dirs, options.subdir)
        compressed = " (compressed)" if listing.compressed[0] else ""
        source = cls(
            path, layout.classes, layout.keys, layout.labels, TarSamples(listing, layout.members),
            layout.skipped, failed, layout.description + compressed,
        )
        source.skipped_names = layout.skipped_names
        return source

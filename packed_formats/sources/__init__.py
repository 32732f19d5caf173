"""What a conversion reads: any dataset layout, in the container it was downloaded in.

One module per source kind, each a ``Source`` subclass with ``kind``,
``sniff(path, head)`` (from the content: magic bytes, not the name) and
``open(path, options)``; the kinds made of tar members share one listing
and choose among themselves with ``matches``.  Adding a kind is one module
and one line in ``KINDS`` (or ``register(cls)`` at run time).

Detection asks the kinds in ``KINDS`` order: archives packed_formats wrote
first (they are ZIP, HDF5 or LMDB files too), then folders, containers, and
the CSV/JSON list last.  The Hugging Face kinds (parquet shards, save_to_disk
folders) come after the image folder, so an image tree is never walked for them.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence, Type, Union

from ..backends import folder_denied, unsearchable_folder
from ..errors import ArchiveNotFoundError, ArchivePermissionError, InvalidSourceError, UnknownFormatError
from .base import (
    Sample,
    Source,
    SourceMemberWarning,
    SourceOptions,
    SourceWarning,
    UnpicklingWarning,
    check_names,
    read_head,
    warn_if_suspicious,
)
from .coco import CocoSource
from .flat_folder import FlatFolderSource, read_label_file
from .folder import FolderSource
from .hdf5 import HDF5Source
from .hub import ArrowSource, ParquetSource
from .listfile import ListSource
from .nested_tar import NestedTarSource
from .packed import PackedSource
from .pickled_lmdb import PickledLMDBSource
from .tar import TarSource
from .tarfiles import TarBackedSource, list_for_sources
from .voc import VocSource
from .webdataset import WebDatasetSource, expand_shards, is_pattern
from .zip import ZipSource

KINDS: List[Type[Source]] = [
    PackedSource,
    CocoSource,  # COCO and VOC layouts: image folders (or a ZIP file) with annotations beside them
    VocSource,
    FolderSource,
    ParquetSource,  # Hugging Face Hub shards, and save_to_disk folders
    ArrowSource,
    FlatFolderSource,
    ZipSource,
    NestedTarSource,  # the tar kinds: the first whose ``matches`` accepts the listing
    WebDatasetSource,
    TarSource,
    HDF5Source,
    PickledLMDBSource,
    ListSource,
]

SourcePath = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]


def register(kind: Type[Source], before: Optional[str] = None) -> None:
    """Add (or replace) a source kind, detected before the kind named ``before`` (default: before the list)."""
    KINDS[:] = [k for k in KINDS if k.kind != kind.kind]
    names = [k.kind for k in KINDS]
    KINDS.insert(names.index(before or ListSource.kind), kind)


def unregister(name: str) -> None:
    """Remove the kind ``name`` (one added with ``register``)."""
    KINDS[:] = [k for k in KINDS if k.kind != name]


def source_formats() -> List[str]:
    """The names ``source_format`` accepts."""
    return [k.kind for k in KINDS]


def open_source(
    path: SourcePath,
    labels: "str | os.PathLike[str] | None" = None,
    *,
    subdir: Optional[str] = None,
    source_format: Optional[str] = None,
    label_key: Optional[str] = None,
    image_key: Optional[str] = None,
    allow_pickle: bool = False,
    on_error: str = "raise",
    fields: Sequence[Any] = (),
) -> Source:
    """The Source at ``path`` (see SourceOptions for the options), its kind found from the content.

    ``path`` may also be a list of webdataset shards or a brace pattern
    (``shards-{000..009}.tar``).  Warns (SourceWarning) when the source has
    one class or every label equal, and (SourceMemberWarning) when members of
    a container are left out (links out of it, devices, FIFOs) or a name comes
    twice (the last is read, as extracting keeps it).

    Raises:
        ArchiveNotFoundError, UnknownFormatError (no kind reads it),
        InvalidSourceError (a kind reads it but something in it does not fit, such as a key or a
            class name with a control character),
        CorruptArchiveError (truncated or damaged container).
    """
    options = SourceOptions(
        labels=None if labels is None else os.fspath(labels), subdir=subdir, source_format=source_format,
        label_key=label_key, image_key=image_key, allow_pickle=allow_pickle, on_error=on_error, fields=tuple(fields),
    )
    paths = _paths(path)
    kind = _kind(paths, options)
    if issubclass(kind, TarBackedSource):
        source: Source = _open_tars(kind, paths, options, shown=_shown(path))
    else:
        if len(paths) != 1:
            raise InvalidSourceError(_shown(path), "several paths are read only as webdataset shards")
        source = kind.open(paths[0], options)
    if options.fields and not options.no_fields and not source.reads_fields:
        source.close()
        readers = ", ".join(k.kind for k in KINDS if k.reads_fields)
        hint = "convert it without --field"
        if source.kind == "tar":  # a webdataset shard without .cls members reads as a tar of class folders
            hint = ("for webdataset shards without labels (no .cls members), declare it with --label-key none "
                    "(label_key='none'); else " + hint)
        raise InvalidSourceError(source.path, f"fields are read from {readers} sources so far; this is a "
                                              f"{source.kind} source", hint=hint)
    if isinstance(source, PackedSource):
        return source
    if len(source) == 0:
        source.close()
        left_out = f"; {len(source.failed)} left out, e.g. {source.failed[0]}" if source.failed else ""
        raise InvalidSourceError(
            source.path, f"no images found ({source.kind}: {source.layout}){left_out}",
            hint="expected images in class folders, or name the layout with --source-format",
        )
    try:
        check_names(source)
    except InvalidSourceError:
        source.close()
        raise
    warn_if_suspicious(source)
    return source


def detect_source(path: SourcePath, *, deep: bool = True, **options: Any) -> str:
    """The kind name ``open_source`` would read ``path`` as (options as for open_source).

    Which of the tar kinds a tar is takes listing it (for a compressed tar,
    decompressing it once); ``deep=False`` answers "tar" without.
    """
    settings = SourceOptions(**options)
    paths = _paths(path)
    kind = _kind(paths, settings)
    if kind is TarBackedSource:
        return _tar_kind(list_for_sources(paths, settings), settings).kind if deep else TarSource.kind
    return kind.kind


def _paths(path: SourcePath) -> List[str]:
    if isinstance(path, (str, os.PathLike)):
        text = os.fspath(path)
        return expand_shards(text) if is_pattern(text) and not os.path.exists(text) else [text]
    paths = expand_shards(path)
    if not paths:
        raise InvalidSourceError(None, "an empty list of shards")
    return paths


def _shown(path: SourcePath) -> str:
    if isinstance(path, (str, os.PathLike)):
        return os.fspath(path)
    items = [os.fspath(p) for p in path]
    return items[0] if len(items) == 1 else f"{items[0]} (and {len(items) - 1} more)"


def _kind(paths: List[str], options: SourceOptions) -> Type[Source]:
    """The kind to read ``paths`` as (for the tar kinds: TarBackedSource, decided once listed)."""
    for path in paths:
        if not os.path.lexists(path):
            folder = unsearchable_folder(path)  # a folder this user may not search hides it
            if folder is not None:
                raise folder_denied(path, folder)
            raise ArchiveNotFoundError(path, "no such file or directory", hint="check the source path")
    if options.source_format is not None:
        return _forced(paths, options.source_format)
    if options.labels is not None:
        return FlatFolderSource
    if len(paths) > 1:
        return WebDatasetSource
    path = paths[0]
    try:  # unreadable, no kind can be told: said as opening it as an archive says it
        if os.path.isdir(path) and not os.access(path, os.R_OK | os.X_OK):  # nothing in it can be listed
            raise PermissionError(path)
        head = read_head(path)
    except PermissionError:
        raise ArchivePermissionError.denied(path) from None
    for kind in KINDS:
        if kind.sniff(path, head):
            return TarBackedSource if issubclass(kind, TarBackedSource) else kind
    if os.path.isdir(path) and _has_images_directly(path):
        raise UnknownFormatError(
            path,
            "a flat folder of images without class sub-directories",
            hint="give its labels with --labels FILE (one integer per line, or CSV filename,label)",
        )
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise UnknownFormatError(path, "empty file, not a dataset")
    raise UnknownFormatError(
        path,
        "not a dataset this library reads",
        hint="expected an image folder, a ZIP/tar/HDF5 dataset, webdataset shards, Hugging Face parquet or "
        "save_to_disk files, a CSV/JSON list of path,label "
        f"or an archive of ours; --source-format names the kind ({', '.join(source_formats())})",
    )


def _forced(paths: List[str], name: str) -> Type[Source]:
    by_name = {k.kind: k for k in KINDS}
    if name not in by_name:
        raise ValueError(f"source format must be one of {', '.join(by_name)}, got {name!r}")
    kind = by_name[name]
    if len(paths) == 1 and kind is not FlatFolderSource:
        if not kind.sniff(paths[0], read_head(paths[0])):
            raise UnknownFormatError(paths[0], f"is not a {name} source (as --source-format says)")
    return kind


def _tar_kind(listing, options: SourceOptions) -> Type[TarBackedSource]:
    for kind in KINDS:
        if issubclass(kind, TarBackedSource) and kind.matches(listing, options):
            return kind
    return TarSource


def _open_tars(kind: Type[TarBackedSource], paths: List[str], options: SourceOptions, shown: str) -> Source:
    """Tars listed once; their kind is ``kind``, or (TarBackedSource itself) the first tar kind that matches."""
    listing = list_for_sources(paths, options)
    chosen = kind if kind is not TarBackedSource else _tar_kind(listing, options)
    return chosen.from_listing(shown, listing, options)


def _has_images_directly(path: str) -> bool:
    from ..backends.folder import is_image_file

    try:
        with os.scandir(path) as entries:
            return any(e.is_file() and is_image_file(e.name) for e in entries)
    except OSError:
        return False


__all__ = [
    "KINDS",
    "Sample",
    "Source",
    "SourceMemberWarning",
    "SourceOptions",
    "SourceWarning",
    "UnpicklingWarning",
    "detect_source",
    "open_source",
    "read_label_file",
    "register",
    "source_formats",
    "unregister",
]

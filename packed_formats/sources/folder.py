"""folder: an ImageFolder tree (root/<class>/<image>), or a folder of images with a stylegan2-ada dataset.json.

Classes are the sorted sub-directory names and samples the images below
each, sorted (``scan_image_folder``, like torchvision).  A folder holding a
``dataset.json`` of the form ``{"labels": [[path, label], ...]}`` takes its
labels from it instead (its ``00000/`` sub-folders are no classes).
Random access: each conversion worker reads its own files.

With ``fields`` (declared: ``--field seg=image``), the files beside an image
that share its stem are its fields: field NAME of ``cat/0001.jpg`` is
``cat/0001.NAME`` or ``cat/0001.NAME.*`` (``0001.seg.png``, ``0001.json``
for ``json``).  Such files are fields, never samples of their own; an image
without one of its fields is an error naming it (or is left out with
on_error="skip").

The tree is listed into numpy arrays (``scan_image_folder``), one directory
at a time: never a Python string per image, which at fourteen million files
would cost the converting process gigabytes.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..backends.folder import is_image_file, looks_like_image_folder, scan_image_folder
from ..errors import ArchiveNotFoundError, CorruptSampleError, InvalidSourceError, UnknownFormatError
from ..fields import FieldSpec, FieldValueError
from ..index import decode_key, encode_keys
from .base import Source, SourceOptions, field_extension
from .layout import DATASET_JSON, dataset_json_layout, looks_like_dataset_json


class FolderSource(Source):
    """Image files below a folder, read by path."""

    kind = "folder"
    random_access = True
    reads_fields = True
    sidecars: Dict[str, np.ndarray] = {}  # each field's file beside each sample, relative to the root

    def __init__(self, root: str, classes, keys, labels, skipped: int = 0, layout: str = "ImageFolder tree",
                 skipped_names: Sequence[str] = ()) -> None:
        super().__init__(root, classes, keys, labels, skipped, layout=layout, skipped_names=skipped_names)
        self.root = root

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        return os.path.isdir(path) and (looks_like_image_folder(path) or _dataset_json(path) is not None)

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "FolderSource":
        if options.label_key is not None or options.image_key is not None:
            raise InvalidSourceError(path, "an image folder takes no label_key or image_key option")
        root = os.path.join(path, options.subdir) if options.subdir else path
        if not os.path.isdir(root):
            raise ArchiveNotFoundError(root, "no such folder", hint="check --subdir")
        labels_json = _dataset_json(root)
        if options.auto_fields:
            raise InvalidSourceError(root, "a folder's fields are named, not found: --field NAME=KIND for each "
                                           "file kind beside the images (0001.seg.png: --field seg=image)")
        if labels_json is not None:
            if options.fields:
                raise InvalidSourceError(root, "fields are read beside the images of a class-folder tree, not "
                                               "with a dataset.json")
            return cls._with_dataset_json(root, labels_json)
        skipped_names: List[str] = []
        classes, keys, labels, skipped = scan_image_folder(root, skipped_names)
        if not len(keys):
            raise UnknownFormatError(
                root, "no images found in class sub-directories", hint="expected root/<class>/<image>"
            )
        if not options.fields:
            return cls(root, classes, keys, labels, skipped, skipped_names=skipped_names)
        specs = options.declared_fields
        keys, labels, sidecars, failed = _with_sidecars(root, keys, labels, specs, options.on_error)
        source = cls(root, classes, keys, labels, skipped, skipped_names=skipped_names)
        source.failed = failed
        source.fields, source.sidecars = specs, sidecars
        return source

    def load_fields(self, i: int) -> Dict[str, Any]:
        files = {spec.name: os.path.join(self.root, decode_key(self.sidecars[spec.name][i])) for spec in self.fields}
        return {spec.name: self.field_from_file(spec, i, files[spec.name]) for spec in self.fields}

    def field_from_file(self, spec: FieldSpec, i: int, path: str) -> Any:
        """Field ``spec`` of sample i from the file at ``path`` (CorruptSampleError naming the file when it
        cannot be read or holds no value of the field)."""
        try:
            with open(path, "rb") as file:
                return spec.from_file(file.read())
        except FieldValueError as exc:
            raise CorruptSampleError(path, str(exc), index=i, key=self.key(i)) from None
        except OSError as exc:
            raise CorruptSampleError(path, f"field {spec.name!r}: cannot read it: {exc.strerror}", index=i,
                                     key=self.key(i)) from None

    @classmethod
    def _with_dataset_json(cls, root: str, content: bytes) -> "FolderSource":
        own = own_files(root)
        skipped_names = [n for n in own if not is_image_file(n)]
        _, keys, _, skipped = scan_image_folder(root, skipped_names)
        names = [DATASET_JSON] + [n for n in own if is_image_file(n)] + [decode_key(k) for k in keys]
        layout = dataset_json_layout(root, names, 0, content)
        skipped += len(own) - sum(map(is_image_file, own))
        return cls(root, layout.classes, layout.keys, layout.labels, skipped, layout.description, skipped_names)

    def location(self, i: int) -> str:
        return os.path.join(self.root, self.key(i))

    def stored_size(self, i: int) -> Optional[int]:
        try:
            return os.path.getsize(self.location(i))
        except OSError:
            return 0  # reported by the conversion itself

    def load(self, i: int) -> bytes:
        path = self.location(i)
        try:
            with open(path, "rb") as file:
                return file.read()
        except OSError as exc:
            raise CorruptSampleError(path, f"cannot read it: {exc.strerror}", index=i, key=self.key(i)) from None


def _with_sidecars(root: str, keys: np.ndarray, labels: np.ndarray, specs: Tuple[FieldSpec, ...], on_error: str
                   ) -> Tuple[np.ndarray, np.ndarray, Dict[str, np.ndarray], List[str]]:
    """(keys, labels, each field's file per sample, samples left out): the images whose stem has a file for
    every field, those files no samples of their own (a field's image file was listed as one)."""
    names = [decode_key(k) for k in keys]
    listing: Dict[str, Dict[str, List[str]]] = {}  # folder -> stem -> extensions there

    def extensions(folder: str) -> Dict[str, List[str]]:
        if folder not in listing:
            found: Dict[str, List[str]] = {}
            for entry in sorted(os.listdir(os.path.join(root, folder) if folder else root)):
                stem, dot, extension = entry.partition(".")
                if dot:
                    found.setdefault(stem, []).append(extension)
            listing[folder] = found
        return listing[folder]

    def field_of(extension: str) -> bool:
        return any(field_extension(s.name, [extension]) is not None for s in specs)

    kept: List[int] = []
    sidecars: Dict[str, List[str]] = {s.name: [] for s in specs}
    failed: List[str] = []
    for j, name in enumerate(names):
        folder, base = os.path.split(name)
        stem, _, extension = base.partition(".")
        if field_of(extension):  # a field's file (0001.seg.png), listed as an image: no sample
            continue
        there = extensions(folder)[stem]
        found = {}
        for spec in specs:
            match = field_extension(spec.name, there, (extension,))
            if match is not None:
                found[spec.name] = posixpath.join(folder, f"{stem}.{match}")
        lacking = [s.name for s in specs if s.name not in found]
        if lacking:
            error = CorruptSampleError(os.path.join(root, name), f"has no file for field {lacking[0]!r} beside it "
                                       f"({stem}.{lacking[0]} or {stem}.{lacking[0]}.*)", key=name,
                                       hint="add it, or --on-error skip")
            if on_error == "raise":
                raise error
            failed.append(str(error))
            continue
        kept.append(j)
        for spec in specs:
            sidecars[spec.name].append(found[spec.name])
    at = np.asarray(kept, dtype=np.int64)
    return keys[at], np.asarray(labels)[at], {n: encode_keys(v) for n, v in sidecars.items()}, failed


def own_files(root: str) -> List[str]:
    """The names of the files right in ``root`` (not below), the dataset.json left out, sorted."""
    with os.scandir(root) as entries:
        return sorted(e.name for e in entries if e.is_file() and e.name != DATASET_JSON)


def _dataset_json(root: str) -> Optional[bytes]:
    """The content of ``root/dataset.json`` when it has the stylegan2-ada shape, else None."""
    path = os.path.join(root, DATASET_JSON)
    try:
        with open(path, "rb") as file:
            content = file.read()
    except OSError:
        return None
    return content if looks_like_dataset_json(content) else None

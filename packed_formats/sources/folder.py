"""folder: an ImageFolder tree (root/<class>/<image>), or a folder of images with a stylegan2-ada dataset.json.

Classes are the sorted sub-directory names and samples the images below
each, sorted (``scan_image_folder``, like torchvision).  A folder holding a
``dataset.json`` of the form ``{"labels": [[path, label], ...]}`` takes its
labels from it instead (its ``00000/`` sub-folders are no classes).
Random access: each conversion worker reads its own files.

The tree is listed into numpy arrays (``scan_image_folder``), one directory
at a time: never a Python string per image, which at fourteen million files
would cost the converting process gigabytes.
"""

from __future__ import annotations

import os
from typing import Optional

from ..backends.folder import is_image_file, looks_like_image_folder, scan_image_folder
from ..errors import ArchiveNotFoundError, CorruptSampleError, InvalidSourceError, UnknownFormatError
from ..index import decode_key
from .base import Source, SourceOptions
from .layout import DATASET_JSON, dataset_json_layout, looks_like_dataset_json


class FolderSource(Source):
    """Image files below a folder, read by path."""

    kind = "folder"
    random_access = True

    def __init__(self, root: str, classes, keys, labels, skipped: int = 0, layout: str = "ImageFolder tree") -> None:
        super().__init__(root, classes, keys, labels, skipped, layout=layout)
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
        if labels_json is not None:
            return cls._with_dataset_json(root, labels_json)
        classes, keys, labels, skipped = scan_image_folder(root)
        if not len(keys):
            raise UnknownFormatError(
                root, "no images found in class sub-directories", hint="expected root/<class>/<image>"
            )
        return cls(root, classes, keys, labels, skipped)

    @classmethod
    def _with_dataset_json(cls, root: str, content: bytes) -> "FolderSource":
        _, keys, _, skipped = scan_image_folder(root)
        with os.scandir(root) as entries:
            own = sorted(e.name for e in entries if e.is_file() and e.name != DATASET_JSON)
        names = [DATASET_JSON] + [n for n in own if is_image_file(n)] + [decode_key(k) for k in keys]
        layout = dataset_json_layout(root, names, 0, content)
        skipped += len(own) - sum(map(is_image_file, own))
        return cls(root, layout.classes, layout.keys, layout.labels, skipped, layout.description)

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


def _dataset_json(root: str) -> Optional[bytes]:
    """The content of ``root/dataset.json`` when it has the stylegan2-ada shape, else None."""
    path = os.path.join(root, DATASET_JSON)
    try:
        with open(path, "rb") as file:
            content = file.read()
    except OSError:
        return None
    return content if looks_like_dataset_json(content) else None

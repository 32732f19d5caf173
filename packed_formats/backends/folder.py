"""folder: a plain ImageFolder tree (root/<class>/<image>), read-only.

The baseline every benchmark compares against, and a conversion source.  Like
torchvision's ImageFolder: classes are the sorted sub-directory names, samples
the image files below each (recursively), sorted.  No checksums: the files are
the source of truth.
"""

from __future__ import annotations

import os
from typing import List, Tuple

import numpy as np

from ..errors import ArchiveNotFoundError, UnknownFormatError
from ..index import SampleIndex, encode_keys
from ..manifest import ArchiveManifest
from .base import Reader

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def is_image_file(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def scan_image_folder(root: str) -> Tuple[List[str], List[str], List[int], int]:
    """(classes, relative image paths, labels, non-image files skipped) of an ImageFolder tree."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    keys: List[str] = []
    labels: List[int] = []
    skipped = 0
    for label, name in enumerate(classes):
        for directory, subdirs, files in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            subdirs.sort()
            for file in sorted(files):
                if is_image_file(file):
                    keys.append(os.path.relpath(os.path.join(directory, file), root))
                    labels.append(label)
                else:
                    skipped += 1
    return classes, keys, labels, skipped


def looks_like_image_folder(root: str) -> bool:
    try:
        for entry in os.scandir(root):
            if entry.is_dir() and not entry.name.startswith("."):
                for sub in os.scandir(entry.path):
                    if sub.is_file() and is_image_file(sub.name):
                        return True
    except OSError:
        return False
    return False


class FolderReader(Reader):
    format_name = "folder"

    def _open(self) -> str:
        if not os.path.isdir(self.path):
            raise ArchiveNotFoundError(self.path, "no such directory")
        return self.path

    @staticmethod
    def _close_handle(handle: str) -> None:
        """Nothing is held open between reads."""

    def _stat_fingerprint(self):
        return None  # a folder may legitimately gain files; each read opens its file anew

    def _read_metadata(self, root: str) -> Tuple[ArchiveManifest, SampleIndex]:
        classes, keys, labels, _ = scan_image_folder(root)
        if not keys:
            raise UnknownFormatError(
                self.path, "no images found in class sub-directories", hint="expected root/<class>/<image> files"
            )
        manifest = ArchiveManifest(
            format="folder", mode="encoded", count=len(keys), classes=tuple(classes), encoding="mixed", checksum=None
        )
        index = SampleIndex(labels=np.asarray(labels, dtype=np.int64), keys=encode_keys(keys))
        return manifest, index

    def _read_blob(self, root: str, i: int) -> bytes:
        path = os.path.join(root, self.index.key(i))
        try:
            with open(path, "rb") as file:
                return file.read()
        except OSError as exc:
            raise self._corrupt(f"cannot read {path}: {exc.strerror}", i) from None

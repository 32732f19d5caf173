"""What a conversion reads: an ImageFolder tree, a flat folder plus a label file, or any archive.

A Source is a description (paths, key and label arrays, a Reader that pickles
as its path), so it crosses into conversion worker processes cheaply and each
worker reads its own samples.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .backends import detect_format, open_archive
from .backends.base import Reader
from .backends.folder import is_image_file, scan_image_folder
from .errors import ArchiveNotFoundError, CorruptSampleError, InvalidSourceError, UnknownFormatError
from .index import decode_key, encode_keys


@dataclasses.dataclass
class Source:
    """The samples to convert, in their deterministic order.

    Folder sources read ``root/key`` files; archive sources read sample i of
    ``reader``.  ``skipped`` counts non-image files left out.
    """

    path: str
    classes: Tuple[str, ...]
    keys: np.ndarray
    labels: np.ndarray
    skipped: int = 0
    root: Optional[str] = None
    reader: Optional[Reader] = None

    def __len__(self) -> int:
        return len(self.labels)

    def key(self, i: int) -> str:
        return decode_key(self.keys[i])

    @property
    def raw_shape(self) -> Optional[Tuple[int, int, int]]:
        """(H, W, C) when the source is a raw archive, else None."""
        if self.reader is not None and self.reader.mode == "raw":
            return self.reader.manifest.shape
        return None

    def location(self, i: int) -> str:
        """The file to name when sample i is bad."""
        return os.path.join(self.root, self.key(i)) if self.root is not None else self.path

    def load(self, i: int) -> "bytes | np.ndarray":
        """Sample i as stored: file bytes, or the archive's bytes / HxWxC pixels."""
        if self.reader is not None:
            return self.reader.read(i)
        path = self.location(i)
        try:
            with open(path, "rb") as file:
                return file.read()
        except OSError as exc:
            raise CorruptSampleError(path, f"cannot read it: {exc.strerror}", index=i, key=self.key(i)) from None

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def open_source(path: "str | os.PathLike[str]", labels: "str | os.PathLike[str] | None" = None) -> Source:
    """The Source at ``path``: ImageFolder tree, flat folder (with ``labels``) or archive.

    Raises:
        ArchiveNotFoundError, UnknownFormatError, InvalidSourceError (bad label file).
    """
    path = os.fspath(path)
    if not os.path.lexists(path):
        raise ArchiveNotFoundError(path, "no such file or directory", hint="check the source path")
    if labels is not None:
        return flat_folder_source(path, os.fspath(labels))
    try:
        found = detect_format(path)
    except UnknownFormatError:
        if os.path.isdir(path) and _has_images_directly(path):
            raise UnknownFormatError(
                path,
                "a flat folder of images without class sub-directories",
                hint="give its labels with --labels FILE (one integer per line, or CSV filename,label)",
            ) from None
        raise
    if found == "folder":
        return image_folder_source(path)
    reader = open_archive(path, format=found, verify=True)
    return Source(path, tuple(reader.classes), reader.index.keys, reader.labels, reader=reader)


def image_folder_source(root: str) -> Source:
    """root/<class>/<image>, classes the sorted sub-directory names (like torchvision)."""
    classes, keys, labels, skipped = scan_image_folder(root)
    if not keys:
        raise UnknownFormatError(root, "no images found in class sub-directories", hint="expected root/<class>/<image>")
    return Source(root, tuple(classes), encode_keys(keys), np.asarray(labels, dtype=np.int64), skipped, root=root)


def flat_folder_source(root: str, labels_path: str) -> Source:
    """Images directly in ``root`` (sorted by name) labelled by a label file."""
    if not os.path.isdir(root):
        raise InvalidSourceError(root, "--labels needs a folder of images as the source")
    if not os.path.isfile(labels_path):
        raise ArchiveNotFoundError(labels_path, "no such label file")
    names = sorted(e.name for e in os.scandir(root) if e.is_file() and not e.name.startswith("."))
    labels_real = os.path.realpath(labels_path)
    names = [n for n in names if os.path.realpath(os.path.join(root, n)) != labels_real]
    images = [n for n in names if is_image_file(n)]
    if not images:
        raise UnknownFormatError(root, "no image files in this folder")
    classes, label_values = read_label_file(labels_path, images)
    return Source(
        root,
        classes,
        encode_keys(images),
        np.asarray(label_values, dtype=np.int64),
        skipped=len(names) - len(images),
        root=root,
    )


def read_label_file(path: str, images: Sequence[str]) -> Tuple[Tuple[str, ...], List[int]]:
    """(classes, label per image) from one integer per line or CSV ``filename,label`` rows.

    Integer labels give classes "0".."max"; other labels (e.g. WordNet ids) give
    the sorted distinct names.  Only the first word of a label field counts.
    """
    with open(path, newline="", encoding="utf-8") as file:
        rows = [row for row in csv.reader(file) if row and row[0].strip() and not row[0].startswith("#")]
    if rows and all(len(row) == 1 for row in rows):
        values = [_label_word(row[0]) for row in rows]
        if len(values) != len(images):
            raise InvalidSourceError(
                path,
                f"has {len(values)} labels but the folder has {len(images)} images",
                hint="one label per line, in sorted file name order",
            )
    else:
        values = _csv_labels(path, rows, images)
    return _classes_and_labels(path, values)


def _csv_labels(path: str, rows: List[List[str]], images: Sequence[str]) -> List[str]:
    by_name: Dict[str, int] = {name: j for j, name in enumerate(images)}
    by_stem = {os.path.splitext(name)[0]: j for j, name in enumerate(images)}
    if rows and rows[0][0].strip() not in by_name and rows[0][0].strip() not in by_stem and len(rows[0]) >= 2:
        if not _label_word(rows[0][1]).lstrip("-").isdigit():
            rows = rows[1:]  # a header row
    values: List[Optional[str]] = [None] * len(images)
    for line, row in enumerate(rows, 1):
        if len(row) < 2:
            raise InvalidSourceError(path, f"row {line} is not 'filename,label': {','.join(row)!r}")
        name = row[0].strip()
        j = by_name.get(name, by_stem.get(name))
        if j is None:
            raise InvalidSourceError(path, f"row {line} names {name!r}, which is not an image in the folder")
        values[j] = _label_word(row[1])
    missing = [images[j] for j, v in enumerate(values) if v is None]
    if missing:
        raise InvalidSourceError(path, f"has no label for {len(missing)} images, e.g. {missing[0]!r}")
    return [v for v in values if v is not None]  # all of them


def _classes_and_labels(path: str, values: List[str]) -> Tuple[Tuple[str, ...], List[int]]:
    if all(v.lstrip("-").isdigit() for v in values):
        numbers = [int(v) for v in values]
        if min(numbers) < 0:
            raise InvalidSourceError(path, f"labels must be >= 0, found {min(numbers)}")
        return tuple(str(c) for c in range(max(numbers) + 1)), numbers
    classes = tuple(sorted(set(values)))
    lookup = {name: c for c, name in enumerate(classes)}
    return classes, [lookup[v] for v in values]


def _label_word(field: str) -> str:
    words = field.split()
    return words[0] if words else ""


def _has_images_directly(path: str) -> bool:
    try:
        return any(e.is_file() and is_image_file(e.name) for e in os.scandir(path))
    except OSError:
        return False


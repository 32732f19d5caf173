"""flat-folder: images directly in one folder, labelled by a label file (``labels=`` / ``--labels``).

The label file has one integer per line (in sorted file name order) or CSV
``filename,label`` rows (a header row is recognised).  Never detected: it is
what a folder is read as when a label file is given.
"""

from __future__ import annotations

import csv
import os
from typing import Dict, List, Optional, Sequence, Tuple

from ..backends.folder import is_image_file
from ..errors import ArchiveNotFoundError, InvalidSourceError, UnknownFormatError
from .base import SourceOptions, classes_and_labels
from .folder import FolderSource


class FlatFolderSource(FolderSource):
    """Images in one folder plus a label file."""

    kind = "flat-folder"
    label_advice = "is that right? Check the --labels file"

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        return False  # chosen by giving a label file

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "FlatFolderSource":
        if options.labels is None:
            raise InvalidSourceError(path, "a flat folder needs its label file", hint="give it with --labels FILE")
        root, labels_path = path, os.fspath(options.labels)
        if not os.path.isdir(root):
            raise InvalidSourceError(root, "--labels needs a folder of images as the source")
        if not os.path.isfile(labels_path):
            raise ArchiveNotFoundError(labels_path, "no such label file")
        with os.scandir(root) as entries:
            names = sorted(e.name for e in entries if e.is_file() and not e.name.startswith("."))
        labels_real = os.path.realpath(labels_path)
        names = [n for n in names if os.path.realpath(os.path.join(root, n)) != labels_real]
        images = [n for n in names if is_image_file(n)]
        if not images:
            raise UnknownFormatError(root, "no image files in this folder")
        classes, values = read_label_file(labels_path, images)
        return cls(root, classes, images, values, skipped=len(names) - len(images), layout=f"labels from {labels_path}",
                   skipped_names=[n for n in names if not is_image_file(n)])


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
    return classes_and_labels(path, values)


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


def _label_word(field: str) -> str:
    words = field.split()
    return words[0] if words else ""

"""list: a CSV or JSON list of ``path,label`` pairs, the escape hatch for any other layout.

CSV: ``path,label`` rows (a header row is recognised; ``#`` lines are
comments).  JSON: ``[[path, label], ...]``, ``[{"path": ..., "label": ...}]``
or ``{"labels": [[path, label], ...]}``.  Paths are relative to the list's
folder (absolute ones are taken as they are); keys are the paths as written.
Labels are integers (classes "0".."max") or class names (sorted).  Samples
keep the list's order and are read at random, like a folder's files.
"""

from __future__ import annotations

import csv
import io
import json
import os
import posixpath
from typing import Any, List, Tuple

from ..backends.folder import is_image_file
from ..errors import InvalidSourceError
from .base import SourceOptions, classes_and_labels
from .folder import FolderSource

_SNIFF_BYTES = 1 << 16


class ListSource(FolderSource):
    """Image files named by a list, each with its label."""

    kind = "list"

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        if os.path.isdir(path) or b"\0" in head:
            return False
        with open(path, "rb") as file:
            text = file.read(_SNIFF_BYTES)
        try:
            decoded = text.decode("utf-8")
        except UnicodeDecodeError:
            return False
        start = decoded.lstrip()[:1]
        if start in ("[", "{"):
            try:
                return bool(_json_rows(path, json.loads(decoded)))
            except (ValueError, InvalidSourceError):
                return False  # not JSON, or cut short by the sniff: let open() say what is wrong
        rows = [r for r in csv.reader(io.StringIO(decoded)) if r and not r[0].startswith("#")][:3]
        return any(len(r) >= 2 and is_image_file(r[0].strip()) for r in rows)

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "ListSource":
        for name in ("subdir", "label_key", "image_key"):
            if getattr(options, name) is not None:
                raise InvalidSourceError(path, f"a list of path,label takes no {name} option")
        with open(path, "rb") as file:
            text = file.read().decode("utf-8-sig")
        if text.lstrip()[:1] in ("[", "{"):
            try:
                rows = _json_rows(path, json.loads(text))
            except ValueError as exc:
                raise InvalidSourceError(path, f"is not valid JSON ({exc})") from None
        else:
            rows = _csv_rows(path, text)
        if not rows:
            raise InvalidSourceError(path, "lists no images")
        classes, labels = classes_and_labels(path, [label for _, label in rows])
        keys = [posixpath.normpath(p.replace(os.sep, "/")) for p, _ in rows]
        source = cls(os.path.dirname(os.path.abspath(path)), classes, keys, labels, layout=f"list {path}")
        source.path = path
        return source


def _json_rows(path: str, document: Any) -> List[Tuple[str, Any]]:
    if isinstance(document, dict) and "labels" in document:
        document = document["labels"]
    if not isinstance(document, list):
        raise InvalidSourceError(path, "expected a JSON list of [path, label] pairs")
    rows = []
    for item in document:
        if isinstance(item, dict) and "path" in item and "label" in item:
            item = (item["path"], item["label"])
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidSourceError(path, f"entry {item!r} is not a [path, label] pair")
        rows.append((item[0], item[1]))
    return rows


def _csv_rows(path: str, text: str) -> List[Tuple[str, str]]:
    rows = [r for r in csv.reader(io.StringIO(text)) if r and r[0].strip() and not r[0].startswith("#")]
    if rows and len(rows[0]) >= 2 and not is_image_file(rows[0][0].strip()) and _header(rows[0]):
        rows = rows[1:]
    out = []
    for line, row in enumerate(rows, 1):
        if len(row) < 2:
            raise InvalidSourceError(path, f"row {line} is not 'path,label': {','.join(row)!r}")
        out.append((row[0].strip(), row[1].strip()))
    return out


def _header(row: List[str]) -> bool:
    return not row[1].strip().lstrip("-").isdigit() or row[0].strip().lower() in ("path", "file", "filename", "image")


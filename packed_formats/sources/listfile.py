"""list: a CSV or JSON list of ``path,label`` pairs, the escape hatch for any other layout.

CSV: ``path,label`` rows (a header row is recognised; ``#`` lines are
comments).  JSON: ``[[path, label], ...]``, ``[{"path": ..., "label": ...}]``
or ``{"labels": [[path, label], ...]}``; JSON lines: one ``{"path": ...,
"label": ...}`` object a line.  Paths are relative to the list's folder
(absolute ones are taken as they are); keys are the paths as written.
Labels are integers (classes "0".."max") or class names (sorted).  Samples
keep the list's order and are read at random, like a folder's files.

With ``fields``, a row's other columns (a CSV with a header row, or the keys
of JSON objects) are its fields: the column NAME is field NAME.  An image,
array (``.npy``) or bytes field's cell names a file (relative as the image's
path); a text field's cell is the text; a JSON field's is JSON (in CSV, its
text).  ``("auto",)`` makes a field of every other column: image files as
images, other strings as text, other JSON values as JSON; ``.npy`` files
need their declaration (``--field depth=array:float32[N,4]``).
"""

from __future__ import annotations

import csv
import io
import json
import os
import posixpath
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..backends.folder import is_image_file
from ..errors import CorruptSampleError, InvalidSourceError
from ..fields import RESERVED, FieldSpec, FieldValueError
from .base import SourceOptions, classes_and_labels
from .folder import FolderSource

_SNIFF_BYTES = 1 << 16


class ListSource(FolderSource):
    """Image files named by a list, each with its label."""

    kind = "list"
    label_advice = "is that right? Check the list's label column (path,label on each row)"
    reads_fields = True
    columns: Dict[str, "Cells"] = {}

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
                pass  # not JSON, or cut short by the sniff: let open() say what is wrong
            first = decoded.lstrip().split("\n", 1)[0]  # JSON lines: the first line is an object of its own
            try:
                return bool(_json_rows(path, [json.loads(first)]))
            except (ValueError, InvalidSourceError):
                return False
        rows = [r for r in csv.reader(io.StringIO(decoded)) if r and not r[0].startswith("#")][:3]
        return any(len(r) >= 2 and is_image_file(r[0].strip()) for r in rows)

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "ListSource":
        for name in ("subdir", "label_key", "image_key"):
            if getattr(options, name) is not None:
                raise InvalidSourceError(path, f"a list of path,label takes no {name} option")
        with open(path, "rb") as file:
            text = file.read().decode("utf-8-sig")
        extra: List[Dict[str, Any]] = []
        as_json = text.lstrip()[:1] in ("[", "{")
        if as_json:
            try:
                rows = _json_rows(path, _json_document(text), extra)
            except ValueError as exc:
                raise InvalidSourceError(path, f"is not valid JSON ({exc})") from None
        else:
            rows = _csv_rows(path, text, extra)
        if not rows:
            raise InvalidSourceError(path, "lists no images")
        classes, labels = classes_and_labels(path, [label for _, label in rows])
        keys = [posixpath.normpath(p.replace(os.sep, "/")) for p, _ in rows]
        specs = _list_fields(path, extra, options, as_json)
        source = cls(os.path.dirname(os.path.abspath(path)), classes, keys, labels, layout=f"list {path}")
        source.path = path
        source.fields = specs
        source.columns = {spec.name: Cells([row[spec.name] for row in extra], as_json) for spec in specs}
        return source

    def load_fields(self, i: int) -> Dict[str, Any]:
        out = {}
        for spec in self.fields:
            cell = self.columns[spec.name].value(i)
            where = f"{self.path} (row of {self.key(i)!r}, column {spec.name!r})"
            if spec.kind in ("image", "array", "bytes") and isinstance(cell, str) and cell:
                out[spec.name] = self.field_from_file(spec, i, os.path.join(self.root, cell))
                continue
            try:
                if spec.kind in ("image", "array", "bytes"):
                    raise FieldValueError(f"field {spec.name!r} ({spec.kind}): the cell names no file")
                if spec.kind == "json" and isinstance(cell, str) and not self.columns[spec.name].as_json:
                    out[spec.name] = spec.from_file(cell.encode("utf-8"))
                else:
                    spec.encode(cell)
                    out[spec.name] = cell
            except FieldValueError as exc:
                raise CorruptSampleError(where, str(exc), index=i, key=self.key(i)) from None
        return out


class Cells:
    """One column's cells: their text end to end and where each starts (no Python object per row).  JSON
    rows keep each cell as its JSON text."""

    def __init__(self, cells: Sequence[Any], as_json: bool) -> None:
        texts = [(json.dumps(c, ensure_ascii=False) if as_json else str(c)).encode("utf-8") for c in cells]
        self.as_json = as_json
        self.offsets = np.cumsum([0] + [len(t) for t in texts], dtype=np.int64)
        self.data = b"".join(texts)

    def value(self, i: int) -> Any:
        text = self.data[int(self.offsets[i]) : int(self.offsets[i + 1])].decode("utf-8")
        return json.loads(text) if self.as_json else text


def _json_document(text: str) -> Any:
    """A JSON document, or JSON lines (one object a line) as the list of their objects."""
    try:
        return json.loads(text)
    except ValueError:
        lines = [line for line in text.splitlines() if line.strip()]
        if len(lines) > 1 and all(line.lstrip().startswith("{") for line in lines):
            return [json.loads(line) for line in lines]
        raise


def _list_fields(path: str, extra: List[Dict[str, Any]], options: SourceOptions,
                 as_json: bool) -> Tuple[FieldSpec, ...]:
    """The fields to read: those declared (each a column of every row), and with auto the other columns."""
    if not options.fields:
        return ()
    columns = set(extra[0]) if extra else set()
    for row in extra[1:]:
        columns &= set(row)
    specs = list(options.declared_fields)
    missing = [spec.name for spec in specs if spec.name not in columns]
    if missing:
        there = ", ".join(sorted(columns)) or "none"
        raise InvalidSourceError(path, f"no column {missing[0]!r} in every row (the columns every row has: {there})",
                                 hint="CSV needs a header row naming its columns")
    if options.auto_fields:
        for name in sorted(columns - {spec.name for spec in specs}):
            if name in RESERVED:
                continue
            cells = [row[name] for row in extra]
            strings = all(isinstance(c, str) for c in cells)
            if strings and all(c.lower().endswith(".npy") for c in cells):
                raise InvalidSourceError(path, f"column {name!r} names .npy files: declare their dtype and shape",
                                         hint=f"--field {name}=array:DTYPE[N,...] (e.g. float32[N,4])")
            kind = "image" if strings and all(is_image_file(c) for c in cells) else "text" if strings else "json"
            specs.append(FieldSpec(name, kind))
    return tuple(specs)


def _json_rows(path: str, document: Any, extra: Optional[List[Dict[str, Any]]] = None) -> List[Tuple[str, Any]]:
    """(path, label) of each entry; ``extra``: each entry's other keys (an object's) are appended to it."""
    if isinstance(document, dict) and "labels" in document:
        document = document["labels"]
    if not isinstance(document, list):
        raise InvalidSourceError(path, "expected a JSON list of [path, label] pairs")
    rows = []
    for item in document:
        if isinstance(item, dict) and "path" in item and "label" in item:
            if extra is not None:
                extra.append({k: v for k, v in item.items() if k not in ("path", "label")})
            item = (item["path"], item["label"])
        elif extra is not None:
            extra.append({})
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidSourceError(path, f"entry {item!r} is not a [path, label] pair")
        rows.append((item[0], item[1]))
    return rows


def _csv_rows(path: str, text: str, extra: Optional[List[Dict[str, Any]]] = None) -> List[Tuple[str, str]]:
    """(path, label) of each row; ``extra``: each row's other cells, by the header's names, are appended to it."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r and r[0].strip() and not r[0].startswith("#")]
    header: List[str] = []
    if rows and len(rows[0]) >= 2 and not is_image_file(rows[0][0].strip()) and _header(rows[0]):
        header, rows = [name.strip() for name in rows[0]], rows[1:]
    out = []
    for line, row in enumerate(rows, 1):
        if len(row) < 2:
            raise InvalidSourceError(path, f"row {line} is not 'path,label': {','.join(row)!r}")
        out.append((row[0].strip(), row[1].strip()))
        if extra is not None:
            extra.append({name: cell for name, cell in zip(header[2:], row[2:]) if name})
    return out


def _header(row: List[str]) -> bool:
    return not row[1].strip().lstrip("-").isdigit() or row[0].strip().lower() in ("path", "file", "filename", "image")


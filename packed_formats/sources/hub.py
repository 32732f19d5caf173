"""parquet, arrow: datasets as the Hugging Face Hub hands them out, read without the ``datasets`` library.

* parquet: the shards ``hf download --repo-type dataset`` leaves
  (``data/train-00000-of-00004.parquet``, ``<config>/<split>/0000.parquet``),
  or one ``.parquet`` file.  Splits come from the dataset card's
  ``configs: data_files`` when it has them, else from the file names.
* arrow: a folder ``datasets``' ``save_to_disk`` wrote: Arrow IPC streams
  (``data-00000-of-00003.arrow``) named by ``state.json``, the features in
  ``dataset_info.json`` (a DatasetDict: ``dataset_dict.json`` and a folder per
  split), or one ``.arrow`` file.

Images are a struct column ``{bytes, path}`` (the Image feature) or a binary
column, labels an integer (or string) column: the columns the features mark
as Image and ClassLabel, or the only candidates, or ``image_key`` /
``label_key`` (``--image-column`` / ``--label-column``).  The split is
``subdir`` (``--split``); a folder of several splits needs it.  Class names
come from the ClassLabel's names (the card's front matter, ``dataset_info.json``
or the features each file carries), else from the label values.  Keys are the
row numbers in the split (``00000000``...).  An image without bytes is read
from its ``path`` only when that is a relative path inside the dataset's folder.

With ``fields`` other columns are fields of the archive, by their names: an
Image struct or binary column as an image field (a Sequence of them is not
one), a string column as text, any other column as JSON (lists, numbers,
structs), or as declared (``--field boxes=array:float32[N,4]`` reads a list
column as that array).  ``("auto",)`` takes every other column.  A null
cell, or one that is no value of its field, is an error naming the file, row
and column (or the row is left out with on_error="skip"); so is an array cell
with a null, NaN or infinity, a value its dtype does not hold as it is, or
ragged lists.  What the dataset says of itself (the card, the JSON files, the
class names) is checked by ``hub_checks`` before it is believed.

Random access: an index of row groups (parquet) or record batches (arrow) is
built once; each process reads the images of one slice of a row group at a
time (at most ``_BATCH_BYTES``), so memory stays bounded whatever the shard size; a conversion hands
each worker whole row groups (``runs``), so no two workers read the same one.
Needs pyarrow (the ``hub`` extra); PyYAML reads the dataset card when installed.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Type, TypeVar

import numpy as np

from ..errors import ArchiveNotFoundError, CorruptArchiveError, CorruptSampleError, InvalidSourceError
from ..fields import RESERVED, FieldSpec, FieldValueError
from .base import Source, SourceOptions, UnsafeName, member_path
from .hub_checks import (
    NotRegularFile,
    cell_array,
    class_names,
    load_card,
    load_json,
    not_regular_error,
    numbered_classes,
    open_regular,
    row_of,
    text_classes,
)

_BATCH_BYTES = 64 << 20  # at most about this much of a row group's images is held at once
_SNIFF_ENTRIES = 2000  # directory entries looked at to tell a Hub folder
_SHARD = re.compile(r"^(?P<split>.+?)-(?P<n>\d{5})-of-(?P<of>\d{5})(-[0-9a-f]{16,})?$")
_ARROW_STREAM = b"\xff\xff\xff\xff"
_ARROW_FILE = b"ARROW1"
_CARD = "README.md"
_T = TypeVar("_T", bound="TableSource")


class _Features:
    """What the ``datasets`` features say of the columns: the Image ones, and each ClassLabel's names (as
    found, with the file that holds them: only the label column's are checked, by ``class_names``)."""

    def __init__(self) -> None:
        self.images: Set[str] = set()
        self.names: Dict[str, Tuple[Any, str]] = {}

    def add_json(self, features: Any, where: str) -> None:
        """Features as ``dataset_info.json`` and the files' own metadata hold them: {column: {"_type": ...}}."""
        if not isinstance(features, dict):
            return
        for column, feature in features.items():
            if not isinstance(feature, dict):
                continue
            kind = feature.get("_type")
            if kind == "Image":
                self.images.add(str(column))
            elif kind == "ClassLabel" and isinstance(feature.get("names"), (list, dict)):
                self.names.setdefault(str(column), (feature["names"], where))

    def add_card(self, features: Any, where: str) -> None:
        """Features as a card's front matter holds them: [{name, dtype: image | {class_label: {names}}}]."""
        if not isinstance(features, list):
            return
        for feature in features:
            if not isinstance(feature, dict) or not isinstance(feature.get("name"), str):
                continue
            column, dtype = feature["name"], feature.get("dtype")
            if dtype == "image":
                self.images.add(column)
            elif isinstance(dtype, dict) and isinstance(dtype.get("class_label"), dict):
                names = dtype["class_label"].get("names")
                if isinstance(names, (list, dict)):
                    self.names.setdefault(column, (names, where))

    def class_names(self, column: str) -> Optional[List[str]]:
        """The ClassLabel names of ``column``, checked (InvalidSourceError naming their file); None: none."""
        if column not in self.names:
            return None
        found, where = self.names[column]
        return class_names(found, where, f"the ClassLabel names of column {column!r}")


class TableSource(Source):
    """Rows of Parquet or Arrow files: an image column and a label column, read by row group."""

    random_access = True
    reads_fields = True

    def __init__(self, path: str, root: str, files: Sequence[str], group_rows: Sequence[Sequence[int]],
                 image: str, rows: np.ndarray, classes, labels, failed: Sequence[str], layout: str) -> None:
        keys = [f"{r:08d}" for r in rows.tolist()]
        super().__init__(path, classes, keys, labels, failed=failed, layout=layout)
        self.root = root  # where an image's relative path is looked for
        self.files = list(files)
        self.image = image
        self.rows = rows  # each sample's row number in the split
        counts = [n for rows_of_file in group_rows for n in rows_of_file]
        self.group_file = np.array([f for f, g in enumerate(group_rows) for _ in g], dtype=np.int64)
        self.group_number = np.array([k for g in group_rows for k in range(len(g))], dtype=np.int64)
        self.group_start = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])[:-1].astype(np.int64)
        file_rows = [sum(g) for g in group_rows]
        self.file_start = np.concatenate([[0], np.cumsum(file_rows, dtype=np.int64)])[:-1].astype(np.int64)
        self._pid = -1
        self._open: Dict[int, Any] = {}
        # group, first row, rows, bytes, paths, and each field's column
        self._window: Optional[Tuple[int, int, int, Any, Any, List[Any]]] = None
        self._iterator: Optional[Tuple[int, Iterator[Any]]] = None

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_pid=-1, _open={}, _window=None, _iterator=None)  # open files stay in their process
        return state

    # ---- where a row is -----------------------------------------------------------------------------
    def _where(self, i: int) -> Tuple[int, int]:
        """(group, row in the group) of sample i."""
        row = int(self.rows[i])
        g = int(np.searchsorted(self.group_start, row, "right")) - 1
        return g, row - int(self.group_start[g])

    def runs(self) -> np.ndarray:
        """The first sample of each row group (parquet) or record batch (arrow): each is read whole."""
        groups = np.searchsorted(self.group_start, self.rows, "right")
        return np.flatnonzero(np.diff(groups, prepend=-1)).astype(np.int64)

    def location(self, i: int) -> str:
        row = int(self.rows[i])
        f = int(np.searchsorted(self.file_start, row, "right")) - 1
        return f"{self.files[f]}:row {row - int(self.file_start[f])}"

    # ---- reading ------------------------------------------------------------------------------------
    def load(self, i: int) -> bytes:
        import pyarrow as pa

        g, local = self._where(i)
        try:
            first, _, data, paths, _ = self._rows_of(g, local)
            k = local - first
            value = data[k].as_py()
            path = paths[k].as_py() if paths is not None else None
        except (pa.ArrowException, OSError, StopIteration) as exc:
            self._window = self._iterator = None
            raise CorruptSampleError(self.location(i), f"pyarrow cannot read its row group ({exc})", index=i,
                                     key=self.key(i), hint="the file is damaged: download it again") from None
        if value:
            return bytes(value)
        return self._from_path(i, path)

    def load_fields(self, i: int) -> Dict[str, Any]:
        import pyarrow as pa

        g, local = self._where(i)
        try:
            first, _, _, _, columns = self._rows_of(g, local)
            cells = [column.slice(local - first, 1) for column in columns]
        except (pa.ArrowException, OSError, StopIteration) as exc:
            self._window = self._iterator = None
            raise CorruptSampleError(self.location(i), f"pyarrow cannot read its row group ({exc})", index=i,
                                     key=self.key(i), hint="the file is damaged: download it again") from None
        out = {}
        for spec, cell in zip(self.fields, cells):
            where = f"{self.location(i)}, column {spec.name!r}"
            try:
                out[spec.name] = self._field_value(i, spec, cell)
            except FieldValueError as exc:
                raise CorruptSampleError(where, str(exc), index=i, key=self.key(i)) from None
            except (ValueError, TypeError, OverflowError, pa.ArrowException) as exc:  # a value Python cannot hold
                raise CorruptSampleError(where, f"field {spec.name!r} ({spec.kind}): {type(exc).__name__}: {exc}",
                                         index=i, key=self.key(i)) from None
        return out

    def _field_value(self, i: int, spec: FieldSpec, row: Any) -> Any:
        """A field's value from its cell (``row``: a one-row slice of its column; FieldValueError when it is
        none of its kind)."""
        import pyarrow as pa

        cell = row[0]
        if not cell.is_valid:
            raise FieldValueError(f"field {spec.name!r} ({spec.kind}): the cell is null")
        if spec.kind == "image" and pa.types.is_struct(cell.type):
            found = cell.as_py()
            value = found.get("bytes") or self._from_path(i, found.get("path"))
        elif spec.kind == "array":
            value = cell_array(row, spec)  # no null, NaN, or value the dtype does not hold as it is
        else:
            value = cell.as_py()
            if spec.kind == "bytes" and isinstance(value, str):
                value = value.encode("utf-8")
        spec.encode(value)
        return value

    def _from_path(self, i: int, path: Any) -> bytes:
        """The image an image struct names by path only: a file inside the dataset's folder."""
        if not isinstance(path, str) or not path:
            raise CorruptSampleError(self.location(i), "its image has neither bytes nor a path", index=i,
                                     key=self.key(i))
        try:
            clean = member_path(path)
        except UnsafeName:
            clean = ""
        full = os.path.join(self.root, clean)
        real_root = os.path.realpath(self.root)
        if not clean or not os.path.realpath(full).startswith(real_root.rstrip(os.sep) + os.sep):
            raise CorruptSampleError(
                self.location(i), f"its image has no bytes and its path {path!r} is outside the dataset's folder",
                index=i, key=self.key(i), hint="only relative paths inside the folder are read",
            )
        try:
            with open_regular(full) as file:  # a FIFO would wait for a writer for good
                return file.read()
        except OSError as exc:
            raise CorruptSampleError(self.location(i), f"its image has no bytes and its path {path!r} cannot be "
                                     f"read: {exc.strerror}", index=i, key=self.key(i)) from None

    def _handle(self, f: int) -> Tuple[Any, Any]:
        """(reader, file object to close or None) of file f in this process (one file open at a time)."""
        if self._pid != os.getpid():  # the parent's files are the parent's business
            self._pid, self._open, self._window, self._iterator = os.getpid(), {}, None, None
        if f not in self._open:
            self.close()
            self._pid = os.getpid()
            self._open = {f: self._open_file(self.files[f])}
        return self._open[f]

    def _rows_of(self, g: int, local: int) -> Tuple[int, int, Any, Any, List[Any]]:
        """(first row, row count, bytes array, paths array or None, field columns) of a slice of group g
        holding ``local``."""
        window = self._window
        if window is not None and window[0] == g and window[1] <= local < window[1] + window[2]:
            return window[1:]
        first, count, columns = self._read(g, local)
        data, paths = _image_arrays(columns[0])
        self._window = (g, first, count, data, paths, columns[1:])
        return first, count, data, paths, columns[1:]

    @property
    def read_columns(self) -> List[str]:
        """The columns a read takes: the image's, then each field's."""
        return [self.image] + [spec.name for spec in self.fields]

    def _read(self, g: int, local: int) -> Tuple[int, int, List[Any]]:
        raise NotImplementedError

    def _open_file(self, path: str) -> Tuple[Any, Any]:
        raise NotImplementedError

    def close(self) -> None:
        if self._pid == os.getpid():
            for _, handle in self._open.values():
                if handle is not None:
                    handle.close()
        self._open, self._window, self._iterator = {}, None, None

    # ---- listing ------------------------------------------------------------------------------------
    @classmethod
    def _listed(cls: Type[_T], path: str, root: str, files: List[str], image: str, label: str, labels: List[List[Any]],
                features: _Features, options: SourceOptions, description: str, schemas: List[Any]) -> _T:
        """The source of ``files`` (``labels``: each file's ``label`` column, an array per group; ``schemas``:
        each file's, whose other columns may be fields)."""
        import pyarrow as pa

        group_rows = [[len(g) for g in groups] for groups in labels]
        arrays = [c for groups in labels for g in groups for c in (g.chunks if isinstance(g, pa.ChunkedArray) else [g])]
        names = features.class_names(label)
        rows, numbers, failed, classes = _check_labels(files, group_rows, arrays, names, options.on_error, label)
        layout = f"{description}: images {image!r}, labels {label!r}"
        source = cls(path, root, files, group_rows, image, rows, classes, numbers, failed, layout)
        source.fields = _table_fields(files[0], schemas[0], options, image, label)
        for file, schema in zip(files, schemas):
            lacking = [spec.name for spec in source.fields if spec.name not in schema.names]
            if lacking:
                raise InvalidSourceError(file, f"has no column {lacking[0]!r} (its columns: {_columns(schema)})",
                                         hint="every file of a split must have the same columns")
        return source


def _table_fields(path: str, schema: Any, options: SourceOptions, image: str, label: str) -> Tuple[FieldSpec, ...]:
    """The fields to read: those declared (each a column), and with auto every other column."""
    if not options.fields:
        return ()
    specs = list(options.declared_fields)
    missing = [spec.name for spec in specs if spec.name not in schema.names or spec.name in (image, label)]
    if missing:
        raise InvalidSourceError(path, f"has no column {missing[0]!r} to read as a field besides its image and "
                                       f"label", hint=f"its columns: {_columns(schema)}")
    if options.auto_fields:
        import pyarrow as pa

        for name in schema.names:
            if name in (image, label) or name in RESERVED or name in {spec.name for spec in specs}:
                continue
            kind = schema.field(name).type
            if _is_image_type(kind):
                specs.append(FieldSpec(name, "image"))
            elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
                specs.append(FieldSpec(name, "text"))
            else:
                specs.append(FieldSpec(name, "json"))
    return tuple(specs)


def _check_columns(files: List[str], schemas: List[Any], image: str, label: str) -> None:
    """InvalidSourceError naming the first file without the image or the label column, or with one of
    another type (images: a struct with bytes, or binary; labels: integers or strings)."""
    hint = "every file of a split must have the same columns"
    for file, schema in zip(files, schemas):
        missing = [c for c in (image, label) if c not in schema.names]
        if missing:
            raise InvalidSourceError(file, f"has no column {missing[0]!r} (its columns: {_columns(schema)})",
                                     hint=hint)
        for name, fits in ((image, _is_image_type), (label, _is_label_type)):
            kind = schema.field(name).type
            if not fits(kind):
                raise InvalidSourceError(file, f"has column {name!r} of type {kind}, unlike the first file", hint=hint)


def _check_labels(files: List[str], group_rows: List[List[int]], arrays: List[Any], names: Optional[List[str]],
                  on_error: str, label: str) -> Tuple[np.ndarray, np.ndarray, List[str], Tuple[str, ...]]:
    """(rows kept, their labels, failures, classes) from the label column's arrays: a missing label, or one
    outside the class names, is refused (on_error "raise") or left out naming its file and row; classes made
    from the label values are bounded and checked (``numbered_classes``, ``text_classes``)."""
    import pyarrow as pa

    starts = np.cumsum([0] + [sum(g) for g in group_rows])
    valid = np.concatenate([_valid(a) for a in arrays]) if arrays else np.zeros(0, dtype=bool)
    integers = all(pa.types.is_integer(a.type) or pa.types.is_null(a.type) for a in arrays)
    if integers:
        numbers = np.concatenate([_integers(a) for a in arrays]) if arrays else np.zeros(0, dtype=np.int64)
        bad = ~valid | (numbers < 0) | (numbers >= len(names) if names is not None else False)
    else:
        bad = ~valid
    failed: List[str] = []
    for row in np.flatnonzero(bad).tolist():
        if not valid[row]:
            problem = "has no label"
        else:
            count = f"the {len(names)} class names" if names is not None else "the labels (they start at 0)"
            problem = f"has label {int(numbers[row])}, outside {count}"
        where = row_of(files, starts, row)
        if on_error == "raise":
            raise InvalidSourceError(where, problem, key=f"{row:08d}",
                                     hint="fix the file, or leave such rows out with --on-error skip")
        failed.append(f"{where} [sample key {row:08d}]: {problem}")
    kept = np.flatnonzero(~bad).astype(np.int64)
    if integers:
        chosen = numbers[kept]
        if names is not None:
            return kept, chosen, failed, tuple(names)
        if not len(chosen):
            return kept, chosen, failed, ()
        at = int(np.argmax(chosen))
        return kept, chosen, failed, numbered_classes(files, starts, int(kept[at]), int(chosen[at]) + 1, len(kept),
                                                       label)
    values = [v for a in arrays for v in a.to_pylist()]
    labels, classes = text_classes(files, starts, kept, [values[r] for r in kept.tolist()], label)
    return kept, labels, failed, classes


def _valid(array: Any) -> np.ndarray:
    """Which values of an Arrow array are not null (from its validity bitmap: no compute kernel is loaded)."""
    if array.null_count == 0:
        return np.ones(len(array), dtype=bool)
    bitmap = array.buffers()[0]
    if bitmap is None:  # a null-typed array
        return np.zeros(len(array), dtype=bool)
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[array.offset:array.offset + len(array)].astype(bool)


def _integers(array: Any) -> np.ndarray:
    """An integer Arrow array's values as int64 (nulls as 0)."""
    if array.null_count == 0:
        return np.asarray(array.to_numpy(), dtype=np.int64)
    if len(array) == array.null_count:
        return np.zeros(len(array), dtype=np.int64)
    values = array.to_numpy(zero_copy_only=False)  # floats, NaN for the nulls
    return np.where(np.isnan(values), 0, values).astype(np.int64)


def _image_arrays(column: Any) -> Tuple[Any, Any]:
    """(bytes array, paths array or None) of an image column (an Image struct or a binary column)."""
    import pyarrow as pa

    if pa.types.is_struct(column.type):
        # flatten(): the children with the struct's own nulls applied (a null image is no image)
        children = dict(zip([column.type.field(k).name for k in range(column.type.num_fields)], column.flatten()))
        return children["bytes"], children.get("path")
    return column, None


def _is_image_type(kind: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_struct(kind):
        at = kind.get_field_index("bytes")
        return at >= 0 and _is_binary(kind.field(at).type)
    return _is_binary(kind)


def _is_binary(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_binary(kind) or pa.types.is_large_binary(kind))


def _is_label_type(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind))


def _columns(schema: Any) -> str:
    return ", ".join(f"{name} ({schema.field(name).type})" for name in schema.names) or "none"


def _image_column(path: str, schema: Any, features: _Features, asked: Optional[str]) -> str:
    if asked is not None:
        if asked not in schema.names or not _is_image_type(schema.field(asked).type):
            raise InvalidSourceError(path, f"has no image column {asked!r} (a struct with bytes, or binary)",
                                     hint=f"its columns: {_columns(schema)}")
        return asked
    candidates = [n for n in schema.names if _is_image_type(schema.field(n).type)]
    marked = [n for n in candidates if n in features.images]
    structs = [n for n in candidates if not _is_binary(schema.field(n).type)]
    for choice in (marked, structs, candidates):
        if len(choice) == 1:
            return choice[0]
    problem = "has no image column" if not candidates else f"has several image columns ({', '.join(candidates)})"
    raise InvalidSourceError(path, problem, hint=f"name one with --image-column; its columns: {_columns(schema)}")


def _label_column(path: str, schema: Any, features: _Features, asked: Optional[str], image: str) -> str:
    if asked is not None:
        if asked not in schema.names or not _is_label_type(schema.field(asked).type):
            raise InvalidSourceError(path, f"has no label column {asked!r} (integers or strings)",
                                     hint=f"its columns: {_columns(schema)}")
        return asked
    marked = [n for n in schema.names if n in features.names and _is_label_type(schema.field(n).type)]
    import pyarrow as pa

    integers = [n for n in schema.names if n != image and pa.types.is_integer(schema.field(n).type)]
    for choice in (marked, integers):
        if len(choice) == 1:
            return choice[0]
    found = marked or integers
    problem = "has no label column" if not found else f"has several label columns ({', '.join(found)})"
    raise InvalidSourceError(path, problem, hint=f"name one with --label-column; its columns: {_columns(schema)}")


def _arrow_error(path: str, exc: Exception) -> "CorruptArchiveError | InvalidSourceError":
    if isinstance(exc, NotRegularFile):
        return not_regular_error(path, exc)
    return CorruptArchiveError(path, f"pyarrow cannot read it ({exc})",
                               hint="the file is truncated or damaged: download it again")


def _own_features(path: str, schema: Any, features: _Features) -> None:
    """Add the features ``datasets`` keeps in a file's schema metadata (b"huggingface")."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if raw is None:
        return
    try:
        document = json.loads(raw)
    except RecursionError:
        raise InvalidSourceError(path, 'has schema metadata (b"huggingface") that nests arrays or objects too '
                                 "deeply to be read: refused") from None
    except (ValueError, UnicodeDecodeError):
        return
    info = document.get("info") if isinstance(document, dict) else None
    if isinstance(info, dict):
        features.add_json(info.get("features"), path)


def _walk(root: str, suffix: str, limit: Optional[int] = None) -> List[str]:
    """Relative paths of the files ending in ``suffix`` below ``root`` (hidden folders skipped), sorted;
    ``limit``: stop after that many directory entries (for sniffing)."""
    found: List[str] = []
    seen = 0
    for directory, folders, names in os.walk(root):
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        seen += len(folders) + len(names)
        found += [os.path.relpath(os.path.join(directory, n), root) for n in names if n.endswith(suffix)]
        if limit is not None and (found or seen > limit):
            break
    return sorted(p.replace(os.sep, "/") for p in found)


def _choose(path: str, splits: Dict[str, List[str]], asked: Optional[str]) -> str:
    """The split to read among ``splits`` (names: "split" or "config/split")."""
    if asked is not None:
        asked = asked.strip("/")
        matches = [s for s in splits if s == asked or s.rsplit("/", 1)[-1] == asked]
        if len(matches) == 1:
            return matches[0]
        hint = f"its splits: {', '.join(sorted(splits))}"
        if matches:
            raise InvalidSourceError(path, f"has split {asked!r} in several configs", hint="name one: " + hint)
        raise InvalidSourceError(path, f"has no split {asked!r}", hint=hint)
    if len(splits) == 1:
        return next(iter(splits))
    raise InvalidSourceError(path, f"holds several splits ({', '.join(sorted(splits))})",
                             hint="choose one with --split (subdir=)")


# ---- parquet ------------------------------------------------------------------------------------------
class ParquetSource(TableSource):
    """Parquet shards of a Hub dataset (a folder of them, or one file)."""

    kind = "parquet"

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        if os.path.isdir(path):
            return bool(_walk(path, ".parquet", _SNIFF_ENTRIES))
        return head.startswith(b"PAR1")

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "ParquetSource":
        import pyarrow as pa
        import pyarrow.parquet as pq

        card = _read_card(path) if os.path.isdir(path) else None
        features = _Features()
        if os.path.isdir(path):
            root = path
            split, files = _parquet_split(path, card, options.subdir)
            description = f"parquet split {split!r} in {len(files)} file(s)"
            if card is not None:
                _card_features(card, split.split("/")[0] if "/" in split else None, features,
                               os.path.join(root, _CARD))
        else:
            root, files, description = os.path.dirname(os.path.abspath(path)), [path], "parquet file"
        schemas = []
        for file in files:
            try:
                with open_regular(file) as handle:
                    schemas.append(pq.ParquetFile(handle, pre_buffer=False).schema_arrow)
            except (pa.ArrowException, OSError) as exc:
                raise _arrow_error(file, exc) from None
            _own_features(file, schemas[-1], features)
        image = _image_column(files[0], schemas[0], features, options.image_key)
        label = _label_column(files[0], schemas[0], features, options.label_key, image)
        _check_columns(files, schemas, image, label)
        labels = []
        for file in files:
            try:
                with open_regular(file) as handle:
                    parquet = pq.ParquetFile(handle, pre_buffer=False)  # no I/O threads: workers fork after this
                    labels.append([parquet.read_row_group(k, columns=[label], use_threads=False).column(0)
                                   for k in range(parquet.num_row_groups)])
            except (pa.ArrowException, OSError) as exc:
                raise _arrow_error(file, exc) from None
        return cls._listed(path, root, files, image, label, labels, features, options, description,
                           schemas)

    def _open_file(self, path: str) -> Any:
        import pyarrow.parquet as pq

        handle = open_regular(path)
        try:
            return pq.ParquetFile(handle, pre_buffer=False), handle
        except BaseException:
            handle.close()
            raise

    def _read(self, g: int, local: int) -> Tuple[int, int, List[Any]]:
        """The rows of group g holding row ``local``: the whole group when it is at most _BATCH_BYTES, else a
        batch of it read in order from the group's start (an iterator kept per process: rows asked for in
        order are read once)."""
        f, k = int(self.group_file[g]), int(self.group_number[g])
        parquet = self._handle(f)[0]
        meta = parquet.metadata.row_group(k)
        if meta.total_byte_size <= _BATCH_BYTES:
            table = parquet.read_row_group(k, columns=self.read_columns, use_threads=False)
            columns = [c.chunk(0) if c.num_chunks == 1 else c.combine_chunks() for c in table.columns]
            return 0, table.num_rows, columns
        window = self._window
        if self._iterator is None or self._iterator[0] != g or window is None or window[0] != g or local < window[1]:
            per_row = max(1, meta.total_byte_size // max(1, meta.num_rows))
            batch = int(max(1, min(meta.num_rows, _BATCH_BYTES // per_row)))
            self._iterator = (g, parquet.iter_batches(batch_size=batch, row_groups=[k], columns=self.read_columns,
                                                      use_threads=False))
            first = 0
        else:
            first = window[1] + window[2]
        iterator = self._iterator[1]
        while True:
            rows = next(iterator)
            if local < first + rows.num_rows:
                return first, rows.num_rows, list(rows.columns)
            first += rows.num_rows


def _parquet_split(root: str, card: Optional[dict], asked: Optional[str]) -> Tuple[str, List[str]]:
    """(split name, its files) of a folder of parquet files."""
    found = _walk(root, ".parquet")
    if not found:
        raise InvalidSourceError(root, "holds no .parquet file")
    by_split: Dict[str, List[str]] = {}
    assigned = _card_splits(card, found)
    for name in found:
        by_split.setdefault(assigned.get(name) or _split_of_name(name), []).append(name)
    split = _choose(root, by_split, asked)
    files = by_split[split]
    _check_shards(root, files)
    return split, [os.path.join(root, f) for f in files]


def _split_of_name(name: str) -> str:
    """The split a file's name says: ``data/train-00000-of-00004.parquet`` is ``train``, so is
    ``cfg/train/0000.parquet`` (``cfg/train`` when the folder above is no ``data``)."""
    parts = name.split("/")
    stem = parts[-1][: -len(".parquet")]
    match = _SHARD.match(stem)
    if match:
        split = match["split"]
        above = parts[:-1]
    elif stem.isdigit() and len(parts) >= 2:
        split, above = parts[-2], parts[:-2]
    else:
        split, above = stem, parts[:-1]
    config = above[-1] if above and above[-1] != "data" else ""
    return f"{config}/{split}" if config else split


def _check_shards(root: str, files: List[str]) -> None:
    """InvalidSourceError when shards named ``-NNNNN-of-MMMMM`` miss one (a download cut short)."""
    groups: Dict[Tuple[str, str, int], Set[int]] = {}
    for name in files:
        match = _SHARD.match(os.path.basename(name)[: -len(".parquet")])
        if match:
            groups.setdefault((os.path.dirname(name), match["split"], int(match["of"])), set()).add(int(match["n"]))
    for (folder, split, total), have in groups.items():
        missing = sorted(set(range(total)) - have)
        if missing:
            first = os.path.join(root, folder, f"{split}-{missing[0]:05d}-of-{total:05d}.parquet")
            raise InvalidSourceError(first, f"is missing: {len(missing)} of the {total} shards of {split!r} are not "
                                     "there", hint="the download is incomplete: download the dataset again")


def _read_card(root: str) -> Optional[dict]:
    """The YAML front matter of the dataset card (README.md), or None (no card, no PyYAML, not YAML).
    InvalidSourceError naming the card when it is no regular file, or its YAML uses aliases or nests too deeply."""
    try:
        import yaml  # noqa: F401 - only whether it is there
    except ImportError:
        return None
    where = os.path.join(root, _CARD)
    try:
        with open_regular(where) as file:
            text = file.read(1 << 20).decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    except NotRegularFile as exc:
        raise not_regular_error(where, exc) from None
    except OSError as exc:
        raise InvalidSourceError(where, f"cannot be read: {exc.strerror}") from None
    match = re.match(r"^---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(\r?\n|$)", text, re.S)
    if not match:
        return None
    document = load_card(where, match.group(1))
    return document if isinstance(document, dict) else None


def _card_splits(card: Optional[dict], names: List[str]) -> Dict[str, str]:
    """{file: split} from the card's ``configs: [{config_name, data_files: [{split, path}]}]``."""
    configs = card.get("configs") if card else None
    if not isinstance(configs, list):
        return {}
    several = len(configs) > 1
    out: Dict[str, str] = {}
    for config in configs:
        if not isinstance(config, dict) or not isinstance(config.get("data_files"), list):
            continue
        prefix = f"{config.get('config_name')}/" if several else ""
        for entry in config["data_files"]:
            if not isinstance(entry, dict) or not isinstance(entry.get("split"), str):
                continue
            patterns = entry.get("path")
            for pattern in patterns if isinstance(patterns, list) else [patterns]:
                if isinstance(pattern, str):
                    for name in names:
                        if name not in out and fnmatch.fnmatchcase(name, pattern):
                            out[name] = prefix + entry["split"]
    return out


def _card_features(card: dict, config: Optional[str], features: _Features, where: str) -> None:
    """Add the features of the card's ``dataset_info`` (of ``config`` when it has several; ``where``: the card)."""
    info = card.get("dataset_info")
    infos: List[dict] = [i for i in (info if isinstance(info, list) else [info]) if isinstance(i, dict)]
    chosen = [i for i in infos if config is None or i.get("config_name") == config] if len(infos) > 1 else infos
    if len(chosen) == 1:
        features.add_card(chosen[0].get("features"), where)


# ---- arrow (save_to_disk) -------------------------------------------------------------------------------
class ArrowSource(TableSource):
    """Arrow streams that ``datasets``' ``save_to_disk`` wrote (a folder), or one ``.arrow`` file."""

    kind = "arrow"

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        if os.path.isdir(path):
            return any(os.path.isfile(os.path.join(path, n)) for n in ("state.json", "dataset_dict.json"))
        return head.startswith((_ARROW_STREAM, _ARROW_FILE))

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "ArrowSource":
        import pyarrow as pa

        features = _Features()
        if os.path.isdir(path):
            folder, split = _arrow_split(path, options.subdir)
            files = _state_files(folder)
            _info_features(folder, features)
            description = f"save_to_disk split {split!r} in {len(files)} file(s)" if split else \
                f"save_to_disk dataset in {len(files)} file(s)"
            root = folder
        else:
            root, files, description = os.path.dirname(os.path.abspath(path)), [path], "arrow file"
        schemas, batches = [], []
        for file in files:
            try:
                found, schema = _read_batches(file)
            except (pa.ArrowException, OSError) as exc:
                raise _arrow_error(file, exc) from None
            _own_features(file, schema, features)
            schemas.append(schema)
            batches.append(found)
        image = _image_column(files[0], schemas[0], features, options.image_key)
        label = _label_column(files[0], schemas[0], features, options.label_key, image)
        _check_columns(files, schemas, image, label)
        labels = [[batch.column(label) for batch in found] for found in batches]
        return cls._listed(path, root, files, image, label, labels, features, options, description,
                           schemas)

    def _open_file(self, path: str) -> Any:
        return _read_batches(path)[0], None

    def _read(self, g: int, local: int) -> Tuple[int, int, List[Any]]:
        batch = self._handle(int(self.group_file[g]))[0][int(self.group_number[g])]
        return 0, batch.num_rows, [batch.column(name) for name in self.read_columns]


def _read_batches(path: str) -> Tuple[List[Any], Any]:
    """(record batches, schema) of an Arrow stream or file, memory-mapped: nothing is copied."""
    import pyarrow as pa

    with open_regular(path) as file:  # first: a FIFO would wait for a writer for good
        magic = file.read(6)
    source = pa.memory_map(path)
    if magic == _ARROW_FILE:
        reader = pa.ipc.open_file(source)
        return [reader.get_batch(k) for k in range(reader.num_record_batches)], reader.schema
    stream = pa.ipc.open_stream(source)
    return list(stream), stream.schema


def _arrow_split(path: str, asked: Optional[str]) -> Tuple[str, Optional[str]]:
    """(folder of the split, its name) of a save_to_disk folder (a DatasetDict: a folder per split)."""
    listing = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(listing):
        document = _json(listing)
        splits = document.get("splits") if isinstance(document, dict) else None
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise InvalidSourceError(listing, 'has no "splits" list')
        for name in splits:
            if "/" in name or "\\" in name or name in ("", ".", ".."):
                raise InvalidSourceError(listing, f"names split {name!r}, which is no folder name: refused")
        chosen = _choose(path, {s: [] for s in splits}, asked)
        folder = os.path.join(path, chosen)
        if not os.path.isdir(folder):
            raise ArchiveNotFoundError(folder, "no such folder", hint="the dataset is incomplete")
        return folder, chosen
    state = _json(os.path.join(path, "state.json"))
    found = state.get("_split") if isinstance(state, dict) else None
    split = found if isinstance(found, str) else None
    if asked is not None and asked.strip("/") != split:
        raise InvalidSourceError(path, f"holds split {split!r} only, not {asked!r}")
    return path, split


def _state_files(folder: str) -> List[str]:
    """The data files ``state.json`` lists (plain names in ``folder`` only)."""
    where = os.path.join(folder, "state.json")
    state = _json(where)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list):
        raise InvalidSourceError(where, 'has no "_data_files" list')
    files = []
    for entry in entries:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise InvalidSourceError(where, f"names data file {name!r}, which is not a file of its folder: refused")
        full = os.path.join(folder, name)
        if not os.path.exists(full):  # a FIFO or a folder there is refused when it is read
            raise ArchiveNotFoundError(full, "no such file (state.json lists it)", hint="the dataset is incomplete")
        files.append(full)
    if not files:
        raise InvalidSourceError(where, "lists no data files")
    return files


def _info_features(folder: str, features: _Features) -> None:
    where = os.path.join(folder, "dataset_info.json")
    if os.path.lexists(where):  # a FIFO or a folder there is refused, not passed over
        info = _json(where)
        if isinstance(info, dict):
            features.add_json(info.get("features"), where)


def _json(path: str) -> Any:
    """The JSON document in file ``path`` (InvalidSourceError naming it when it is none, or nests too deeply)."""
    try:
        with open_regular(path) as file:
            data = file.read()
    except NotRegularFile as exc:
        raise not_regular_error(path, exc) from None
    except OSError as exc:
        raise ArchiveNotFoundError(path, f"cannot read it: {exc.strerror}") from None
    return load_json(path, data)

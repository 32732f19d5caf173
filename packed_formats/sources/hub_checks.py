"""What the Hub importer (``hub.py``) checks in what a dataset says of itself before it is believed.

A Hub dataset is a stranger's files: its card's YAML, ``state.json`` and
``dataset_info.json``, the features its files carry, the class names and the
cells of its columns.  None of it may make a conversion hang, exhaust memory
or store a value other than the one in the file:

* a file is read only when it is a regular file: a FIFO would wait for a
  writer for good (``open_regular``);
* JSON or YAML nested too deeply, and YAML aliases (which can make a small
  card expand without bound), are refused naming the file (``load_json``,
  ``load_card``);
* class names are strings, each once, none empty or path-like, at most
  ``_MOST_CLASSES`` of them (``class_names``, ``check_class_names``); without
  names, label values make no more classes than rows (past ``_FEW_CLASSES``:
  an id column taken for the label, or one stray huge value, would make
  millions) (``numbered_classes``, ``text_classes``);
* an array cell is lists of numbers, each list of a level as long as the
  others, with no null, no NaN or infinity, and no value the declared dtype
  does not hold as it is (out of its range, a fraction for an integer type)
  (``cell_array``): numpy would otherwise fill in NaN, round 1e300 to
  infinity, cut 1.5 to 1 or raise without naming the row.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from typing import Any, BinaryIO, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidSourceError
from ..fields import FieldSpec, FieldValueError

_MOST_CLASSES = 1 << 22  # class names a dataset may have (ImageNet-21k has 21,841; 4,194,304 are allowed)
_FEW_CLASSES = 1000  # label values may make this many classes (0..999) in a split of fewer rows
_MOST_DEPTH = 64  # how deep a card's YAML may nest (a real card nests fewer than ten levels)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NUMBER = re.compile(r"[0-9]+")


class NotRegularFile(OSError):
    """A path that names a FIFO, a device, a socket or a folder where a file is to be read."""


def open_regular(path: str) -> BinaryIO:
    """``path`` opened for reading, when it is a regular file; NotRegularFile when it is not.

    The file is opened without blocking (a FIFO would otherwise wait in ``open`` for a writer that
    never comes) and checked on the open descriptor, so nothing can be swapped in between.
    """
    nonblocking = getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, os.O_RDONLY | nonblocking | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(errno.EINVAL, f"not a regular file ({_file_kind(mode)})", path)
        if nonblocking:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "no file"


def not_regular_error(path: str, exc: NotRegularFile) -> InvalidSourceError:
    return InvalidSourceError(path, f"is {exc.strerror}: refused",
                              hint="a dataset's files are regular files: download the dataset again")


# ---- JSON and YAML --------------------------------------------------------------------------------------
def load_json(path: str, data: bytes) -> Any:
    """The JSON document ``data`` (the content of ``path``); InvalidSourceError naming it when it is not
    one, or nests too deeply to be read."""
    try:
        return json.loads(data)
    except RecursionError:
        raise InvalidSourceError(path, "nests arrays or objects too deeply to be read: refused") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidSourceError(path, f"is not valid JSON ({exc})") from None


def load_card(path: str, text: str) -> Any:
    """The YAML document ``text`` (a dataset card's front matter, from ``path``), or None when it is not YAML.

    InvalidSourceError naming the card when it uses an alias (``*name``: a few lines of aliases of aliases
    expand to billions of nodes) or nests deeper than _MOST_DEPTH levels.
    """
    import yaml

    try:
        return yaml.load(text, Loader=_card_loader())  # a SafeLoader, without aliases
    except _Refused as exc:
        raise InvalidSourceError(path, f"{exc}: refused", hint="a dataset card's front matter needs neither; "
                                 "fix the card or remove it (README.md)") from None
    except RecursionError:
        raise InvalidSourceError(path, f"nests deeper than {_MOST_DEPTH} levels: refused") from None
    except yaml.YAMLError:
        return None


class _Refused(Exception):
    """What the card loader refuses to compose (the message says what)."""


_LOADER: List[Any] = []


def _card_loader() -> Any:
    """A yaml.SafeLoader subclass that refuses aliases and deep nesting (made once, when PyYAML is there)."""
    if _LOADER:
        return _LOADER[0]
    import yaml

    class CardLoader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                raise _Refused(f"uses a YAML alias (*{self.peek_event().anchor})")
            self.depth += 1
            try:
                if self.depth > _MOST_DEPTH:
                    raise _Refused(f"nests deeper than {_MOST_DEPTH} levels")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    _LOADER.append(CardLoader)
    return CardLoader


# ---- class names --------------------------------------------------------------------------------------
def class_names(found: Any, where: str, what: str) -> Optional[List[str]]:
    """The class names of a ClassLabel: a list, or a mapping of class number ("0", 0) to name, where a gap is
    named by its number; None when ``found`` is neither.  InvalidSourceError naming ``where`` (and ``what``:
    which column's names) when a name is no string, a number is no number or comes twice, a gap's number is
    another class's name, or there are more than _MOST_CLASSES classes; then ``check_class_names``."""
    def refuse(problem: str, hint: Optional[str] = None) -> InvalidSourceError:
        return InvalidSourceError(where, f"{what}: {problem}: refused", hint=hint)

    if not isinstance(found, (list, dict)):
        return None
    if len(found) > _MOST_CLASSES:
        raise refuse(f"{len(found)} class names, more than the {_MOST_CLASSES} this reads")
    if isinstance(found, list):
        names = list(found)
    else:
        numbered: Dict[int, Any] = {}
        for key, name in found.items():
            if isinstance(key, bool) or not isinstance(key, (int, str)) or not _NUMBER.fullmatch(str(key)):
                raise refuse(f"{key!r} is no class number (0, 1, ...)")
            if int(key) in numbered:
                raise refuse(f"class number {int(key)} is given twice")
            numbered[int(key)] = name
        top = max(numbered, default=-1) + 1
        if top > _MOST_CLASSES or top > 10 * len(numbered) + 1000:
            raise refuse(f"class numbers reach {top - 1} for {len(numbered)} names",
                         hint=f"at most {_MOST_CLASSES} classes, and few without a name")
        given = {name: c for c, name in numbered.items() if isinstance(name, str)}
        for c in range(top):
            if c not in numbered and str(c) in given:
                raise refuse(f"class {c} has no name and its number {str(c)!r} is the name of class {given[str(c)]}",
                             hint="name every class")
        names = [numbered.get(c, str(c)) for c in range(top)]
    for name in names:
        if not isinstance(name, str):
            raise refuse(f"class name {name!r} ({type(name).__name__}) is no string",
                         hint="quote it: YAML reads yes, no, null and numbers unquoted as other values")
    check_class_names(where, what, names)
    return names


def check_class_names(where: str, what: str, names: Sequence[str]) -> None:
    """InvalidSourceError naming ``where`` when a class name is empty, path-like ('/' or '\\' in it, '.',
    '..'), has a control character (a NUL, a newline) or is given twice: whoever unpacks an archive by
    class makes a folder of each name."""
    seen: Dict[str, int] = {}
    for c, name in enumerate(names):
        problem = name_problem(name)
        if problem is None and name in seen:
            problem = f"is given twice (classes {seen[name]} and {c})"
        if problem is not None:
            raise InvalidSourceError(where, f"{what}: class name {name!r} {problem}: refused",
                                     hint="a class name is a folder's name to whoever unpacks the archive")
        seen[name] = c


def name_problem(name: str) -> Optional[str]:
    """What is wrong with a class name (None: nothing)."""
    if not name.strip():
        return "is empty"
    if _CONTROL.search(name):
        return "has a control character (shown escaped)"
    parts = name.replace("\\", "/").split("/")
    if name[:1] in ("/", "\\") or any(part in (".", "..") for part in parts):
        return "is a path (it may not start with '/' or '\\', nor hold a '.' or '..' part)"
    return None


# ---- classes the label values make -------------------------------------------------------------------
def row_of(files: List[str], starts: np.ndarray, row: int) -> str:
    """``file:row N`` of a row of the split (``starts``: each file's first row)."""
    f = int(np.searchsorted(starts, row, "right")) - 1
    return f"{files[f]}:row {row - int(starts[f])}"


def numbered_classes(files: List[str], starts: np.ndarray, row: int, top: int, count: int,
                     label: str) -> Tuple[str, ...]:
    """The classes "0".."top-1" that labels up to ``top - 1`` (the largest in ``row``, of ``count`` rows) make
    without class names.  InvalidSourceError naming that row when they would be more than the rows (past
    _FEW_CLASSES: the column is more likely an id than a label) or than _MOST_CLASSES, before a name is made."""
    if top > max(count, _FEW_CLASSES):
        problem = f"more than the {count} rows"
    elif top > _MOST_CLASSES:
        problem = f"more than the {_MOST_CLASSES} this reads"
    else:
        return tuple(str(c) for c in range(top))
    raise InvalidSourceError(
        f"{row_of(files, starts, row)}, column {label!r}",
        f"has label {top - 1}: without class names the classes are the label values 0 to {top - 1}, {top} "
        f"classes, {problem}: refused", key=f"{row:08d}",
        hint="the column may be no label (an id?): name the label column with --label-column, or give the class "
             "names in the dataset card (a ClassLabel)",
    )


def text_classes(files: List[str], starts: np.ndarray, rows: np.ndarray, words: List[str],
                 label: str) -> Tuple[np.ndarray, Tuple[str, ...]]:
    """(label of each row, classes) of a text label column: numbers written plainly ("0", "17") are classes
    "0".."max" as integer labels are; other words are the sorted distinct names, as written (none dropped or
    merged), each checked (InvalidSourceError naming the first row that has a bad one)."""
    if words and all(w.isascii() and w.isdigit() and (w == "0" or not w.startswith("0")) for w in words):
        numbers = [int(w) for w in words]
        at = max(range(len(numbers)), key=numbers.__getitem__)
        classes = numbered_classes(files, starts, int(rows[at]), numbers[at] + 1, len(numbers), label)
        return np.array(numbers, dtype=np.int64), classes
    classes = tuple(sorted(set(words)))
    lookup = {name: c for c, name in enumerate(classes)}
    for name in classes:
        if name_problem(name) is not None:
            row = int(rows[words.index(name)])
            check_class_names(f"{row_of(files, starts, row)}, column {label!r}", "its text label", [name])
    return np.array([lookup[w] for w in words], dtype=np.int64), classes


# ---- array cells ----------------------------------------------------------------------------------------
def cell_array(row: Any, spec: FieldSpec) -> np.ndarray:
    """The numbers of an array field's cell (``row``: a one-row Arrow array of nested lists of numbers),
    as numpy holds them; FieldValueError naming the field when a list or a value is null, lists of one
    level differ in length, a value is no number, is NaN or infinite, or is outside ``spec.dtype``'s range."""
    import pyarrow as pa

    def refuse(problem: str) -> FieldValueError:
        return FieldValueError(f"field {spec.name!r} (array): {problem}")

    array: Any = row
    dims: List[int] = []
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or \
            pa.types.is_fixed_size_list(array.type):
        if array.null_count:
            raise refuse(f"a null value where a list is (at depth {len(dims)})")
        if len(dims) >= 8:
            raise refuse("lists nest deeper than an array's 8 dimensions")
        if pa.types.is_fixed_size_list(array.type):
            lengths: np.ndarray = np.full(len(array), array.type.list_size, dtype=np.int64)
        else:
            lengths = np.diff(np.asarray(array.offsets, dtype=np.int64))
        if len(lengths) and (lengths != lengths[0]).any():
            other = lengths[np.flatnonzero(lengths != lengths[0])[0]]
            raise refuse(f"ragged: lists of {int(lengths[0])} and {int(other)} values at depth {len(dims) + 1}")
        dims.append(int(lengths[0]) if len(lengths) else 0)
        array = array.flatten()
    kind = array.type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
        raise refuse(f"{kind} values, not numbers")
    if array.null_count:
        raise refuse("a null value among its numbers")
    values = array.to_numpy(zero_copy_only=False)
    if values.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            raise refuse(f"value {values[bad[0]]} is not finite")
    bad = _outside(values, np.dtype(spec.dtype))
    if len(bad):
        value = values[bad[0]]
        if spec.dtype == "bool":
            raise refuse(f"value {value} is no bool (0 or 1)")
        if values.dtype.kind == "f" and np.dtype(spec.dtype).kind in "iu" and value != np.floor(value):
            raise refuse(f"value {value} is no whole number (the field is {spec.dtype})")
        raise refuse(f"value {value} is out of the range of {spec.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(spec.dtype).reshape(dims)


def _outside(values: np.ndarray, target: np.dtype) -> np.ndarray:
    """The positions of the (finite) ``values`` that ``target`` does not hold as they are: past its range,
    fractions for an integer type, other than 0 and 1 for bool."""
    if target.kind == "b" or values.dtype.kind == "b":
        return np.flatnonzero((values != 0) & (values != 1)) if target.kind == "b" else np.zeros(0, np.int64)
    if target.kind == "f":
        with np.errstate(over="ignore"):
            return np.flatnonzero(~np.isfinite(values.astype(target)))
    info = np.iinfo(target)
    if values.dtype.kind == "f":  # the bounds as floats: -2**k and 2**k are exact
        wrong = (values != np.floor(values)) | (values < float(info.min)) | (values >= float(info.max) + 1.0)
        return np.flatnonzero(wrong)
    if not len(values) or (int(values.min()) >= info.min and int(values.max()) <= info.max):
        return np.zeros(0, np.int64)
    return np.array([k for k, v in enumerate(values.tolist()) if not info.min <= v <= info.max])  # as Python ints

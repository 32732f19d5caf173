"""lmdb-pickle: an LMDB whose records are pickled Python objects, one sample each.

Unpickling runs code chosen by whoever wrote the file, so this kind is read
only with ``allow_pickle=True`` (``--allow-pickle``), and then with a
warning; without it the source is refused, saying why.

A record is ``(image, label)`` (a tuple or list, more items ignored) or a
dict with ``image``/``label`` fields (``image_key``/``label_key`` name
others).  The image is encoded bytes, a uint8 array or a PIL image; the
label an integer or a class name.  Records whose key starts with ``__``
(``__keys__``, ``__len__``: bookkeeping some writers add) are no samples.
Samples are in key order and keep their LMDB keys; the file is read in one
ordered pass (plus one to list the labels).
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import CorruptArchiveError, CorruptSampleError, InvalidSourceError
from .base import Data, Sample, Source, SourceOptions, UnpicklingWarning, classes_and_labels

_LMDB_MAGIC = b"\xde\xc0\xef\xbe"  # in the header page, at byte 16 of the data file
_IMAGE_FIELDS = ("image", "img", "data", "jpg", "png")
_LABEL_FIELDS = ("label", "target", "cls", "class")


class PickledLMDBSource(Source):
    """Samples unpickled from the records of an LMDB environment."""

    kind = "lmdb-pickle"
    label_advice = "is that right? Check the records' labels (--label-key names their field)"
    random_access = False

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        if os.path.isdir(path):
            return os.path.isfile(os.path.join(path, "data.mdb"))
        return head[16:20] == _LMDB_MAGIC

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "PickledLMDBSource":
        if not options.allow_pickle:
            raise InvalidSourceError(
                path,
                "this LMDB holds pickled Python objects, and unpickling runs code from the file",
                hint="pass allow_pickle=True (--allow-pickle) only for a file from a source you trust",
            )
        warnings.warn(
            f"{path}: unpickling its records runs code from the file (allow_pickle): only convert files you trust",
            UnpicklingWarning, stacklevel=3,
        )
        keys: List[str] = []
        values: List[Any] = []
        source = cls(path, (), [], [], options)
        for key, record in source._records():
            _, label = source._fields(key, record)
            try:
                values.append(_label_value(label))
            except ValueError as exc:
                raise InvalidSourceError(path, f"record {key!r}: {exc}", key=key) from None
            keys.append(key)
        if not keys:
            raise InvalidSourceError(path, "the LMDB holds no records")
        classes, labels = classes_and_labels(path, values)
        return cls(path, classes, keys, labels, options)

    def __init__(self, path, classes, keys, labels, options: SourceOptions) -> None:
        super().__init__(path, classes, keys, labels, layout="LMDB of pickled (image, label) records")
        self.options = options

    def _records(self) -> Iterator[Tuple[str, Any]]:
        """(key, unpickled record) of every sample record, in key order."""
        import lmdb

        from ..backends.lmdb_guard import open_readonly

        try:
            env, guard = open_readonly(self.path, max_spare_txns=0)
        except lmdb.Error as exc:
            raise CorruptArchiveError(self.path, f"LMDB cannot open it ({exc})", hint="the file is damaged") from None
        try:
            with env.begin(buffers=True) as txn:
                for raw_key, value in txn.cursor():
                    key = bytes(raw_key).decode("utf-8", "surrogateescape")
                    if key.startswith("__"):
                        continue
                    outside = guard.outside(value)
                    if outside:
                        raise CorruptSampleError(self.path, f"the record {outside}", key=key)
                    try:
                        record = pickle.loads(value)
                    except Exception as exc:  # whatever the pickle raises, name the record
                        raise CorruptSampleError(self.path, f"cannot unpickle the record: {exc!r}", key=key) from None
                    yield key, record
        except lmdb.Error as exc:
            raise CorruptArchiveError(self.path, f"LMDB cannot read it ({exc})", hint="the file is damaged") from None
        finally:
            env.close()

    def _fields(self, key: str, record: Any) -> Tuple[Any, Any]:
        """(image, label) of one record."""
        if isinstance(record, dict):
            image = _field(record, self.options.image_key, _IMAGE_FIELDS)
            label = _field(record, self.options.label_key, _LABEL_FIELDS)
            if image is not None and label is not None:
                return image, label
        elif isinstance(record, (tuple, list)) and len(record) >= 2:
            return record[0], record[1]
        raise InvalidSourceError(
            self.path, f"record {key!r} is a {type(record).__name__}, not (image, label) or a dict with both",
            key=key, hint="name its fields with --image-key / --label-key",
        )

    def location(self, i: int) -> str:
        return f"{self.path}:{self.key(i)}"

    def __iter__(self) -> Iterator[Sample]:
        for i, (key, record) in enumerate(self._records()):
            if i >= len(self) or key != self.key(i):
                raise CorruptArchiveError(self.path, "the LMDB changed while it was read")
            image, _ = self._fields(key, record)
            yield Sample(key, int(self.labels[i]), _image(image))


def _field(record: dict, chosen: Optional[str], names: Tuple[str, ...]) -> Any:
    if chosen is not None:
        return record.get(chosen)
    return next((record[n] for n in names if n in record), None)


def _image(image: Any) -> Data:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, np.ndarray):
        return image
    return np.asarray(image)  # a PIL image, or anything array-like


def _label_value(label: Any) -> Any:
    """A label as an int or a name (numpy scalars, 0-d arrays and bytes included)."""
    if isinstance(label, (np.generic, np.ndarray)) and np.size(label) == 1:
        label = np.asarray(label).item()
    if isinstance(label, bytes):
        label = label.decode("utf-8", "replace")
    if isinstance(label, bool) or not isinstance(label, (int, str)):
        raise ValueError(f"label {label!r} is neither an integer nor a class name")
    return label

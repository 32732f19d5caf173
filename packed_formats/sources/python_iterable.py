"""A source of samples drawn from a Python iterable or generator, whose length is known only at its end.

The items are drawn in this process, in one pass (an iterable cannot be
asked for item i); each is split into its image, label and field values
here, and the conversion's workers only resize, encode and check the
images.  The first few items are drawn ahead, when the source is opened:
they give the raw shape, the fields of ``fields="auto"``, and the bytes per
sample the free-space check estimates from (``len`` is the number of items
drawn so far).  The classes must be known before the first sample is
written (``classes=``, or the iterable's ``classes`` attribute), since an
iterable cannot be read twice to find them.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidSampleError, InvalidSourceError, PackedFormatError
from ..fields import FieldValueError
from .base import Sample, Source, SourceOptions
from .python import _field_of, _field_value, _image, _label_index, _split

_AHEAD = 8  # items drawn when the source is opened


class IterableSource(Source):
    """The items of ``iterable`` (``(image, label)`` pairs or dicts, as for PythonSource), in order."""

    kind = "python-iterable"
    random_access = False
    reads_fields = True
    known_length = None  # the progress bar counts up

    def __init__(self, iterable: Any, *, classes: Optional[Sequence[Any]] = None) -> None:
        name = type(iterable).__name__
        names = classes if classes is not None else getattr(iterable, "classes", None)
        super().__init__(f"<{name} iterable>", (), [], [], layout="Python items, one pass")
        if not isinstance(names, (list, tuple)) or not names:
            raise InvalidSourceError(self.path, "an iterable is read once, so its classes must be known before "
                                                "its first sample is written",
                                     hint="give classes= (the class names, in label order), or convert a map-style "
                                          "dataset (a list of the items will do)")
        self.classes = tuple(str(c) for c in names)
        self.labels: List[int] = []  # type: ignore[assignment]  # grows as items are drawn
        self.iterator = iter(iterable)
        self.ahead: List[Any] = []
        self.ended = False
        self._first_shape: Optional[Tuple[int, int, int]] = None
        self.one_size = False  # raw mode without a size: every item must have item 0's size

    def listed(self, options: SourceOptions) -> "IterableSource":
        """The first items drawn; the fields declared (or found in the first: ``"auto"``)."""
        while len(self.ahead) < _AHEAD and not self.ended:
            self.ahead.append(self._next(len(self.ahead)))
        self.fields = options.declared_fields
        first = self.ahead[0] if self.ahead else None
        if options.auto_fields and isinstance(first, tuple) and first[2]:
            declared = {f.name for f in self.fields}
            inferred = tuple(_field_of(n, v) for n, v in first[2].items() if n not in declared)
            self.fields += inferred
            print(f"{self.path}: fields found in item 0: {', '.join(f.describe() for f in inferred) or 'none'}",
                  flush=True)
        try:
            image = _image(self.path, 0, self.key(0), first[0]) if isinstance(first, tuple) else None
        except PackedFormatError:
            image = None  # the conversion names it
        if isinstance(image, np.ndarray):
            self._first_shape = (int(image.shape[0]), int(image.shape[1]), 3)
        return self

    def __len__(self) -> int:
        return max(len(self.ahead), len(self.labels))

    def key(self, i: int) -> str:
        return f"{i:08d}"

    def location(self, i: int) -> str:
        return self.path

    def _next(self, i: int) -> Any:
        """Item i split, or the error naming it, or None at the end; the iterable's own error ends the pass."""
        try:
            item = next(self.iterator)
        except StopIteration:
            self.ended = True
            return None
        except Exception as exc:
            self.ended = True
            raise InvalidSampleError(self.path, f"drawing item {i} raised {type(exc).__name__}: {exc}", index=i,
                                     hint="an iterable cannot go on after an error: fix it and convert again"
                                     ) from exc
        try:
            return _split(self.path, i, item)
        except PackedFormatError as exc:
            return exc

    def __iter__(self) -> Iterator[Sample]:
        i = 0
        while True:
            item = self.ahead.pop(0) if self.ahead else (None if self.ended else self._next(i))
            if item is None:
                return
            yield self._sample(i, item)
            i += 1

    def _sample(self, i: int, item: Any) -> Sample:
        key = self.key(i)
        label = -1
        try:
            if isinstance(item, PackedFormatError):
                raise item
            image, label_value, values = item
            label = _label_index(self.path, i, key, label_value, self.classes)
            data: Any = _image(self.path, i, key, image)
            if self._first_shape is not None and isinstance(data, np.ndarray) and self.one_size \
                    and data.shape[:2] != self._first_shape[:2]:
                h, w = self._first_shape[:2]
                raise InvalidSampleError(self.path, f"the image is {data.shape[0]}x{data.shape[1]}, item 0's is "
                                         f"{h}x{w}, and a raw archive holds one size", index=i, key=key,
                                         hint="give size= (--size) to resize every image to one size")
            fields = {spec.name: self._field(i, key, spec, values) for spec in self.fields}
        except PackedFormatError as exc:
            data, fields = exc, {}
        self.labels.append(max(label, 0))
        return Sample(key, max(label, 0), data, fields)

    def _field(self, i: int, key: str, spec: Any, values: dict) -> Any:
        if spec.name not in values:
            raise InvalidSampleError(self.path, f"no field {spec.name!r} ({spec.describe()}); this item has "
                                     f"{', '.join(sorted(values)) or 'none'}", index=i, key=key,
                                     hint="give every item the field, or leave it out of fields")
        try:
            spec.encode(_field_value(values[spec.name]))
        except FieldValueError as exc:
            raise InvalidSampleError(self.path, f"field {spec.name!r} is not a value of {spec.describe()}: {exc}",
                                     index=i, key=key) from None
        return _field_value(values[spec.name])

    @property
    def raw_shape(self) -> Optional[Tuple[int, int, int]]:
        return self._first_shape

    def stored_size(self, i: int) -> Optional[int]:
        """The mean stored size of the items drawn ahead."""
        sizes = []
        for j, item in enumerate(self.ahead):
            try:
                image = _image(self.path, j, self.key(j), item[0]) if isinstance(item, tuple) else None
            except PackedFormatError:
                continue
            if image is not None:
                sizes.append(len(image) if isinstance(image, bytes) else image.nbytes)
        return int(np.mean(sizes)) if sizes else 0


__all__ = ["IterableSource"]

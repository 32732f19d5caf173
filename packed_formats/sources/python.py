"""A source of samples made by Python code: a map-style dataset, or a function over a list of inputs.

``PythonSource`` is a Source like the others, so a conversion from it keeps
every option's meaning (format, mode, size, fields, shard_size, part,
workers, on_error...).  Its samples are its items, read by index in the
conversion's worker processes: the dataset (or the function and its inputs)
is pickled once to each of them, as a DataLoader does, so its own decoding
runs in parallel.  Items may be ``(image, label)`` pairs or dicts with
``image``, ``label`` and field values; an image may be a PIL image, a uint8
array (HxW or HxWxC) or tensor (CxHxW), JPEG/PNG bytes or a path.

Its keys are the items' indices (zero-padded), known before any item is read.
Declared with ``labelled=False``, its items have no label (an image alone, a dict
without ``label``, or a pair whose label is None or -1): the archive has no
classes, says it has no labels, and every label is -1.
Its labels come with its items (``label_at``), from the workers, unless the
classes have to be found from the labels themselves (no ``classes=``, no
``classes`` attribute, no ``datasets`` ClassLabel): then they are listed
first, from the dataset's ``targets`` where it has them, else by one pass
over its items in this process.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from .. import codecs
from ..errors import InvalidSampleError, InvalidSourceError, PackedFormatError
from ..fields import FieldSpec, FieldValueError
from ..manifest import NO_LABEL
from .base import Source, SourceOptions, classes_and_labels

_LEFT_OUT = object()  # what a function's None becomes: the input is left out of the archive
_SIZED_ITEMS = 8  # items read to estimate the bytes of every sample (the free-space check)
_IMAGE_NAMES = ("image", "img", "jpg", "png")  # a dict item's image, by the first of these names it has
_LABEL_NAMES = ("label", "cls", "target")
_KEY_WIDTH = 8


def is_python_source(value: Any, inputs: Any = None) -> bool:
    """Whether ``value`` is a Python object ``convert`` reads as a source (not a path or a list of paths)."""
    if isinstance(value, PythonSource) or inputs is not None:
        return True
    if isinstance(value, (str, bytes, os.PathLike)):
        return False
    if isinstance(value, (list, tuple)) and all(isinstance(p, (str, os.PathLike)) for p in value):
        return False  # webdataset shards
    return is_map_style(value)


def is_map_style(value: Any) -> bool:
    """Whether ``value`` has ``__len__`` and ``__getitem__`` (torch's IterableDataset has neither that works)."""
    if any(t.__name__ == "IterableDataset" for t in type(value).__mro__):
        return False
    return hasattr(value, "__len__") and hasattr(value, "__getitem__")


class PythonSource(Source):
    """The items of a map-style dataset (``__len__`` + ``__getitem__``), or ``function(input)`` for each of
    ``inputs`` (None: that input is left out), as a conversion's source.

    Args:
        data: the dataset, or the function when ``inputs`` is given.
        inputs: what ``data`` is called with, one sample each (litdata's form).
        classes: the class names, in label order (default: the dataset's ``classes`` attribute, a
            ``datasets`` ClassLabel feature's names, else the sorted label values).
        start_method: how the conversion's worker processes start (fork, spawn, forkserver; default: fork
            where there is fork).
        factory: ``(function, kwargs)`` that made ``data``: the workers call it themselves instead of
            receiving ``data`` pickled (``from_factory``).
        labelled: False when the items have no label (see the module's notes); no ``classes`` then.
    """

    kind = "python"
    random_access = True
    reads_fields = True
    label_advice = "give classes=, or check the dataset's labels"

    def __init__(self, data: Any, inputs: Optional[Sequence[Any]] = None, *,
                 classes: Optional[Sequence[Any]] = None, start_method: Optional[str] = None,
                 factory: Optional[Tuple[Callable[..., Any], Dict[str, Any]]] = None, labelled: bool = True) -> None:
        if inputs is not None and not callable(data):
            raise ValueError(f"inputs= goes with a function that makes a sample of each input, got {type(data)!r}")
        if inputs is None and (isinstance(data, (str, bytes)) or not is_map_style(data)):
            raise ValueError(f"a Python source is a map-style dataset (__len__ and __getitem__) or a function "
                             f"with inputs=, got {type(data).__name__}")
        self.data, self.factory, self.start_method = data, factory, start_method
        self.inputs = None if inputs is None else list(inputs)
        self.given_classes = None if classes is None else tuple(str(c) for c in classes)
        if not labelled and classes is not None:
            raise ValueError("a Python source without labels (labelled=False) takes no classes=")
        name = getattr(data, "__qualname__", None) or type(data).__name__
        path = f"<{name} over {len(self.inputs)} inputs>" if self.inputs is not None else f"<{name} dataset>"
        count = len(self.inputs) if self.inputs is not None else len(data)
        width = key_width(count)
        keys = [f"{i:0{width}d}" for i in range(count)]
        super().__init__(path, self.given_classes or (), keys, np.full(count, 0 if labelled else NO_LABEL, np.int64),
                         layout="Python items")
        self.labelled = bool(labelled)
        self.labels_listed = False  # whether ``labels`` holds the labels listed to find the classes
        self.one_size = False  # raw mode without a size: every item must have item 0's size (``check_shape``)
        self.inferred_fields: Tuple[FieldSpec, ...] = ()  # the fields found in item 0 (fields="auto")
        self.keep_files = False  # encoded mode: a plain ImageFolder's files are read as they are (``_file_item``)
        self._plain_folder = inputs is None and is_plain_image_folder(data)
        self._cached: Tuple[int, Any] = (-1, None)

    @classmethod
    def from_factory(cls, factory: Callable[..., Any], kwargs: Optional[Mapping[str, Any]] = None,
                     **options: Any) -> "PythonSource":
        """The dataset ``factory(**kwargs)`` makes, which each worker process makes again for itself (a
        dataset that holds what cannot be pickled: an open database, a file handle)."""
        kwargs = dict(kwargs or {})
        name = getattr(factory, "__qualname__", repr(factory))
        try:
            data = factory(**kwargs)
        except Exception as exc:
            raise InvalidSourceError(f"{getattr(factory, '__module__', '')}:{name}", f"the factory raised "
                                     f"{type(exc).__name__}: {exc}", hint="check its arguments (--python-arg)"
                                     ) from exc
        return cls(data, factory=(factory, kwargs), **options)

    @classmethod
    def from_spec(cls, spec: str, kwargs: Optional[Mapping[str, Any]] = None, **options: Any) -> "PythonSource":
        """``module:function`` (``--python``) imported (from the current folder too, as ``python -m`` does),
        then ``from_factory``."""
        module_name, _, attribute = spec.partition(":")
        if not module_name or not attribute:
            raise ValueError(f"--python takes MODULE:FUNCTION (as mypkg.data:make_train_set), got {spec!r}")
        if os.getcwd() not in sys.path and "" not in sys.path:  # as ``python -m`` would: the folder it runs in
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise InvalidSourceError(spec, f"cannot import {module_name}: {exc}",
                                     hint="run from the folder that holds it, or install its package") from exc
        factory: Any = module
        for part in attribute.split("."):
            factory = getattr(factory, part, None)
        if not callable(factory):
            raise InvalidSourceError(spec, f"{module_name} has no function {attribute}",
                                     hint="name a function that returns the dataset")
        return cls.from_factory(factory, kwargs, **options)

    # ---- listing ---------------------------------------------------------------------------------------
    def listed(self, options: SourceOptions) -> "PythonSource":
        """This source with its classes found, its fields declared (or inferred: ``"auto"``) and, where the
        classes come from the labels, its labels listed (see the module's notes)."""
        if options.no_fields or not options.auto_fields:
            self.fields = options.declared_fields
        else:
            inferred = self._inferred_fields({f.name for f in options.declared_fields})
            self.fields, self.inferred_fields = options.declared_fields + inferred, inferred
            found = ", ".join(f.describe() for f in inferred) or "none"
            print(f"{self.path}: fields found in item 0: {found}", flush=True)
        if not self.labelled:  # declared: no classes to find, every label -1
            return self
        classes = self.given_classes or self._dataset_classes()
        if classes is not None:
            self.classes = tuple(str(c) for c in classes)
            return self
        values = self._label_values()
        self.classes, labels = classes_and_labels(self.path, values)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.labels_listed = True
        return self

    def _dataset_classes(self) -> Optional[Sequence[Any]]:
        """The dataset's own class names: torchvision's ``classes``, or a ``datasets`` ClassLabel's names."""
        if self.inputs is not None:
            return None
        names = getattr(self.data, "classes", None)
        if isinstance(names, (list, tuple)) and names:
            return names
        features = getattr(self.data, "features", None)
        if isinstance(features, Mapping):
            for name in _LABEL_NAMES:
                found = getattr(features.get(name), "names", None)
                if isinstance(found, (list, tuple)) and found:
                    return found
        return None

    def _label_values(self) -> List[Any]:
        """Every item's label value: the dataset's ``targets`` when it has one per item, else each item's."""
        targets = getattr(self.data, "targets", None) if self.inputs is None else None
        if targets is not None and hasattr(targets, "__len__") and len(targets) == len(self):
            return [_plain_label(self.path, i, t) for i, t in enumerate(targets)]
        values: List[Any] = []
        for i in range(len(self)):
            try:
                item = self._draw(i)
                values.append(None if item is _LEFT_OUT else _plain_label(self.path, i, _split(self.path, i, item)[1]))
            except PackedFormatError:
                values.append(None)  # a bad item: the conversion names it (or skips it) when it comes to it
        present = [v for v in values if v is not None]
        if present and any(isinstance(v, str) for v in present) and not all(isinstance(v, str) for v in present):
            raise InvalidSourceError(self.path, "labels are class names in some items and numbers in others",
                                     hint="give classes= to say which is which")
        filler = present[0] if present else 0
        return [filler if v is None else v for v in values]  # a left-out input's label is never written

    def _inferred_fields(self, declared: set) -> Tuple[FieldSpec, ...]:
        item = self._draw(0) if len(self) else _LEFT_OUT
        if item is _LEFT_OUT or not isinstance(item, Mapping):
            return ()
        _, _, values = _split(self.path, 0, item, self.labelled)
        return tuple(_field_of(name, value) for name, value in values.items() if name not in declared)

    # ---- items -----------------------------------------------------------------------------------------
    def _draw(self, i: int) -> Any:
        """Item i as the dataset (or the function) gives it; the dataset's own error chained to ours."""
        if self.keep_files and self._plain_folder:
            found = self._file_item(i)
            if found is not None:
                return found
        try:
            item = self.data(self.inputs[i]) if self.inputs is not None else self.data[i]
        except PackedFormatError:
            raise
        except Exception as exc:
            what = f"{getattr(self.data, '__qualname__', 'the function')}(inputs[{i}])" if self.inputs is not None \
                else f"__getitem__({i})"
            raise InvalidSampleError(self.path, f"{what} raised {type(exc).__name__}: {exc}", index=i,
                                     key=self.key(i), hint="fix the dataset, or use on_error='skip'") from exc
        if item is None and self.inputs is not None:
            return _LEFT_OUT
        return item

    def _file_item(self, i: int) -> Optional[Tuple[bytes, int]]:
        """(the file's bytes, its class index) of item i of a plain ImageFolder, whose ``__getitem__`` would
        only decode that file with PIL for the conversion to encode the pixels again: the bytes are kept, as
        a conversion of the folder keeps them.  None (read the item) when the file is no JPEG or PNG."""
        path, target = self.data.samples[i]
        try:
            with open(path, "rb") as file:
                data = file.read()
        except OSError:
            return None  # the dataset's own __getitem__ raises, and _draw names it
        return (data, int(target)) if codecs.sniff(data) is not None else None

    def _item(self, i: int) -> Any:
        """Item i split into (image, label, field values), or _LEFT_OUT; the last one is kept (a worker asks
        for its image, label and fields in turn)."""
        if self._cached[0] != i:
            self._cached = (i, None)
            item = self._draw(i)
            self._cached = (i, item if item is _LEFT_OUT else _split(self.path, i, item, self.labelled))
        return self._cached[1]

    def label_at(self, i: int) -> Optional[int]:
        """Item i's label, checked against the classes (None: the function left the input out)."""
        item = self._item(i)
        if item is _LEFT_OUT:
            return None
        # the item's own label, even where the classes were found from a listing (``targets``): a dataset whose
        # __getitem__ maps its targets (torchvision's target_transform) is packed as it reads
        if not self.labelled:
            return NO_LABEL
        return _label_index(self.path, i, self.key(i), item[1], self.classes)

    def load(self, i: int) -> Any:
        item = self._item(i)
        if item is _LEFT_OUT:
            raise InvalidSampleError(self.path, "left out", index=i)  # label_at said so first: never a sample
        return _image(self.path, i, self.key(i), item[0])

    def check_shape(self, i: int) -> None:
        """InvalidSampleError when item i's pixels are not of item 0's size, which a raw conversion without a
        size takes for every item (``raw_shape``)."""
        shape = self.raw_shape
        image = self.load(i)
        if shape is not None and isinstance(image, np.ndarray) and image.shape[:2] != shape[:2]:
            raise InvalidSampleError(
                self.path, f"the image is {image.shape[0]}x{image.shape[1]}, item 0's is {shape[0]}x{shape[1]}, "
                "and a raw archive holds one size", index=i, key=self.key(i),
                hint="give size= (--size) to resize every image to one size")

    def load_fields(self, i: int) -> Dict[str, Any]:
        item = self._item(i)
        if item is _LEFT_OUT:
            raise InvalidSampleError(self.path, "left out", index=i)  # label_at said so first: never a sample
        values, out = item[2], {}
        for spec in self.fields:
            if spec.name not in values:
                whence = "found in item 0" if spec in self.inferred_fields else "declared"
                raise InvalidSampleError(self.path, f"no field {spec.name!r} ({spec.describe()}, {whence}); this "
                                         f"item has {', '.join(sorted(values)) or 'none'}", index=i, key=self.key(i),
                                         hint="give every item the field, or leave it out of fields")
            try:
                spec.encode(values[spec.name])
            except FieldValueError as exc:
                raise InvalidSampleError(self.path, f"field {spec.name!r} is not a value of {spec.describe()}: "
                                         f"{exc}", index=i, key=self.key(i)) from None
            out[spec.name] = _field_value(values[spec.name])
        return out

    @property
    def raw_shape(self) -> Optional[Tuple[int, int, int]]:
        """Item 0's (H, W, 3) when its image is pixels (what a raw conversion without a size takes)."""
        if not len(self):
            return None
        if not hasattr(self, "_first_shape"):
            item = self._item(0)
            image = None if item is _LEFT_OUT else _image(self.path, 0, self.key(0), item[0])
            self._first_shape = (int(image.shape[0]), int(image.shape[1]), 3) \
                if isinstance(image, np.ndarray) else None
        return self._first_shape

    def stored_size(self, i: int) -> Optional[int]:
        """The mean stored size of the first items (read once): what the free-space check estimates from."""
        if not hasattr(self, "_mean_size"):
            sizes = []
            for j in range(min(len(self), _SIZED_ITEMS)):
                try:
                    item = self._item(j)
                    image = None if item is _LEFT_OUT else _image(self.path, j, self.key(j), item[0])
                except PackedFormatError:
                    continue  # the conversion names it
                if image is not None:
                    sizes.append(len(image) if isinstance(image, bytes) else image.nbytes)
            self._mean_size = int(np.mean(sizes)) if sizes else 0
        return self._mean_size

    def notes(self) -> List[str]:
        return ["items are read by index in each worker process"]

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_cached"] = (-1, None)
        if self.factory is not None:
            state["data"] = None  # each worker makes it again
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.data is None and self.factory is not None:
            function, kwargs = self.factory
            self.data = function(**kwargs)


def is_plain_image_folder(data: Any) -> bool:
    """Whether ``data`` is a torchvision ImageFolder (a DatasetFolder) whose items are its files as PIL opens
    them: its own ``__getitem__``, torchvision's PIL loader, no transform of the image or the target."""
    folder = sys.modules.get("torchvision.datasets.folder")  # never imported here: a dataset of it has done so
    if folder is None or not isinstance(data, folder.DatasetFolder):
        return False
    if type(data).__getitem__ is not folder.DatasetFolder.__getitem__:
        return False
    if getattr(data, "loader", None) not in (folder.default_loader, folder.pil_loader):
        return False
    backend = sys.modules["torchvision"].get_image_backend()
    untransformed = all(getattr(data, name, None) is None for name in ("transform", "target_transform", "transforms"))
    return backend == "PIL" and untransformed and isinstance(getattr(data, "samples", None), list)


def key_width(count: int) -> int:
    """The digits of the keys of ``count`` items (at least 8: ``00000012``)."""
    return max(_KEY_WIDTH, len(str(max(count - 1, 0))))


# ---- what an item holds ---------------------------------------------------------------------------------------
def _split(path: str, i: int, item: Any, labelled: bool = True) -> Tuple[Any, Any, Dict[str, Any]]:
    """(image, label value, other values) of an item: an (image, label) pair or a dict; without labels
    (``labelled`` False) also an image alone or a dict without a label, and a label given must be None or -1."""
    if not labelled:
        image, label, values = _unlabelled_split(path, i, item)
        if label is not None and not (isinstance(label, (int, np.integer)) and int(label) == NO_LABEL):
            raise InvalidSampleError(path, f"the label {label!r} of an item of a source declared without labels "
                                           "(labelled=False): give None or -1, or leave it out", index=i)
        return image, NO_LABEL, values
    if isinstance(item, Mapping):
        image_name = next((n for n in _IMAGE_NAMES if n in item), None)
        label_name = next((n for n in _LABEL_NAMES if n in item), None)
        if image_name is None or label_name is None:
            raise InvalidSampleError(path, f"a dict item with the keys {', '.join(map(str, item)) or 'none'}: "
                                           "expected 'image' and 'label' (and field values)", index=i)
        values = {str(k): v for k, v in item.items() if k not in (image_name, label_name, "key", "__key__")}
        return item[image_name], item[label_name], values
    if isinstance(item, tuple) and len(item) == 2:
        return item[0], item[1], {}
    shape = f" of {len(item)} values" if isinstance(item, (tuple, list)) else ""
    raise InvalidSampleError(path, f"an item of type {type(item).__name__}{shape}: expected an (image, label) "
                                   "pair or a dict with 'image' and 'label'", index=i)


def _unlabelled_split(path: str, i: int, item: Any) -> Tuple[Any, Any, Dict[str, Any]]:
    """(image, label value or None, other values) of an item of a source without labels."""
    if isinstance(item, Mapping):
        image_name = next((n for n in _IMAGE_NAMES if n in item), None)
        if image_name is None:
            raise InvalidSampleError(path, f"a dict item with the keys {', '.join(map(str, item)) or 'none'}: "
                                           "expected 'image' (and field values)", index=i)
        label_name = next((n for n in _LABEL_NAMES if n in item), None)
        values = {str(k): v for k, v in item.items() if k not in (image_name, label_name, "key", "__key__")}
        return item[image_name], None if label_name is None else item[label_name], values
    if isinstance(item, tuple) and len(item) == 2:
        return item[0], item[1], {}
    return item, None, {}


def _image(path: str, i: int, key: str, value: Any) -> "bytes | np.ndarray":
    """An item's image as a Recipe takes it: JPEG/PNG bytes as they are, or HxWxC uint8 pixels."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if codecs.sniff(data) is None:
            raise InvalidSampleError(path, f"the image is {len(data)} bytes of no JPEG or PNG", index=i, key=key)
        return data
    if isinstance(value, (str, os.PathLike)):
        try:
            with open(value, "rb") as file:
                return _image(path, i, key, file.read())
        except OSError as exc:
            raise InvalidSampleError(path, f"cannot read the image file {os.fspath(value)}: {exc.strerror or exc}",
                                     index=i, key=key) from None
    if isinstance(value, Image.Image):  # alpha kept (a conversion notes that it drops it); 16-bit grey scaled
        return np.asarray(value.convert("RGBA")) if "A" in value.getbands() else codecs.pil_to_array(value, 3)
    if isinstance(value, np.ndarray) or type(value).__module__.startswith("torch"):
        try:
            return codecs.to_array(value, value_channels(value))
        except codecs.DecodeError as exc:
            raise InvalidSampleError(path, f"{exc} (an image array is HxW or HxWxC uint8, a tensor CxHxW uint8)",
                                     index=i, key=key) from None
    raise InvalidSampleError(path, f"the image is a {type(value).__name__}: expected a PIL image, a uint8 array or "
                                   "tensor, JPEG/PNG bytes or a path", index=i, key=key)


def value_channels(value: Any) -> int:
    """3, or 4 for an RGBA array (kept so a conversion can say an alpha channel was dropped)."""
    shape = tuple(getattr(value, "shape", ()))
    if type(value).__module__.startswith("torch") and len(shape) == 3 and shape[0] == 4:
        return 4
    return 4 if len(shape) == 3 and shape[-1] == 4 else 3


def _plain_label(path: str, i: int, value: Any) -> "int | str":
    """A label value as an int or a class name (a 0-d tensor or array, a numpy integer: its int)."""
    if hasattr(value, "shape") and tuple(value.shape) == () and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer, str)):
        raise InvalidSampleError(path, f"the label is {type(value).__name__} {value!r}: expected an int, a class "
                                       "name or a 0-d tensor", index=i)
    return value if isinstance(value, str) else int(value)


def _label_index(path: str, i: int, key: str, value: Any, classes: Sequence[str]) -> int:
    label = _plain_label(path, i, value)
    if isinstance(label, str):
        if label in classes:
            return classes.index(label)
    elif 0 <= label < len(classes):
        return label
    shown = ", ".join(classes[:5]) + (f" ... ({len(classes)})" if len(classes) > 5 else "")
    raise InvalidSampleError(path, f"the label {label!r} is none of the classes ({shown})", index=i, key=key,
                             hint="give every class in classes=, or fix the label")


def _field_value(value: Any) -> Any:
    """A field value as a FieldSpec encodes it (a tensor as an array, a PIL image as its pixels)."""
    if type(value).__module__.startswith("torch"):
        return value.detach().cpu().numpy()
    if isinstance(value, Image.Image):
        return np.asarray(value)
    return value


def _field_of(name: str, value: Any) -> FieldSpec:
    """The field a value of item 0 is: text, bytes (an image when it is JPEG/PNG), an image (PIL), an array
    (a numpy array or tensor: its first dimension any length), else JSON."""
    if isinstance(value, Image.Image):
        return FieldSpec(name, "image")
    value = _field_value(value)
    if isinstance(value, str):
        return FieldSpec(name, "text")
    if isinstance(value, bytes):
        return FieldSpec(name, "image" if codecs.sniff(value) else "bytes")
    if isinstance(value, np.ndarray) and value.ndim >= 1:
        return FieldSpec(name, "array", dtype=value.dtype.name, shape=(None, *value.shape[1:]))
    return FieldSpec(name, "json")


__all__ = ["PythonSource", "is_python_source"]

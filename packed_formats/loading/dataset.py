"""PackedDataset: a torch Dataset over any archive, safe with any DataLoader setup.

It stands in for ``torchvision.datasets.ImageFolder``: the same ``(PIL image,
label)`` items and the same attributes, with the per-sample ones (``targets``,
``samples``) kept in the index's numpy arrays instead of Python lists.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
from collections.abc import Sequence
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from PIL import Image

from .. import codecs, policy
from ..archives import open_archive
from ..backends import sniff_format
from ..backends.folder import IMAGE_EXTENSIONS
from ..backends.reader import Reader
from ..errors import ArchiveNotFoundError, PackedFormatError, SampleIndexError, note_fields
from ..handles import ProcessLocal
from ..index import SampleIndex, decode_key
from ..native import to_planar
from ..tracebacks import drops_frames
from . import sample_fields, targets, temp_dir
from .mixture import Mixture

OUTPUTS = ("tensor", "pil", "numpy")
_CHUNK = 1 << 16  # rows converted to Python objects at a time when a view is iterated


class PackedDataset(torch.utils.data.Dataset):
    """``(image, label)`` pairs from a packed archive or an ImageFolder tree.

    A drop-in for ``torchvision.datasets.ImageFolder(root, transform=...)``:
    items are ``(RGB PIL image, int)`` by default (``L`` for 1-channel raw
    archives), and ``root``, ``classes``, ``class_to_idx``, ``targets``,
    ``samples``/``imgs``, ``find_classes``, ``loader``, ``extensions``,
    ``transform``, ``target_transform`` and ``transforms`` are there.  The
    deliberate differences: ``targets`` and ``samples`` are read-only
    sequences over the archive's index arrays, not lists (see ``Targets``,
    ``SampleList``: a list of one Python object per sample grows every forked
    worker's memory), and a sample's path is its key inside the archive, read
    with ``loader(key)`` rather than opened as a file.

    Args:
        source: archive path (format auto-detected; ``~`` expanded as ImageFolder
            does), an open Reader, or a ``Mixture``: its sources' samples end to end (source 0's
            first), labelled with the mixture's classes (its weights are a loader's draw:
            ``make_loader``).
        transform: applied to the image (with ``fields``: to the whole item, below); a plain
            attribute that may be set after construction.
        target_transform: applied to the label alone; a plain attribute too.
        transforms: instead of those two, one callable of ``(image, target)`` returning both, as torchvision's
            datasets and its detection and segmentation references take it: items are ``(image, target)``,
            the target the label, or with ``fields`` a dict of ``label`` and the fields.
        output: what ``transform`` gets and an item holds: "pil" (RGB, or L for a
            1-channel raw archive), "tensor" (uint8 CxHxW) or "numpy" (uint8 HxWxC).
        verify: check each sample's CRC32 on read (CorruptSampleError on mismatch).
        format: insist on this format (FormatMismatchError otherwise).
        fields: the sample's fields to return besides its image and label (``sample_fields``): names, or
            ``{name: role}`` for torchvision's tv_tensors (``"mask"``, ``"instances"``: an instance map as
            a ``Mask`` [N,H,W], one mask per box of the boxes field, ``"boxes:XYXY"``, ``"image"``).  Items
            are then dicts of ``image``, ``label`` and each field; ``transform`` gets the whole dict
            (torchvision v2 transforms move masks and boxes with the image), ``target_transform`` the label.
            Batch them with ``collate_fn=dataset.collate``.  Without ``fields`` no field byte is read.
        target: "coco": items are ``(image, target)`` as torchvision's detection and segmentation references
            take them, the target a dict of ``boxes``, ``labels``, ``image_id``, ``area``, ``iscrowd`` and
            (where the archive has them) ``masks``, made from the fields the COCO and VOC importers write
            (``targets``); ``fields`` may then name the ones to read (leave ``masks`` out for boxes alone).
            ``transform`` gets the image, ``target_transform`` the target, ``transforms`` both (v2 transforms
            move boxes and masks with the image); ``collate`` batches them as tuples, as the references do.
        cache_dir, cache_limit, storage_options: for a URL (``s3://``, ``gs://``,
            ``https://``): the node-local cache of its parts and fsspec's options
            (see ``open_archive``).

    Nothing is held open in the process that creates the dataset; each process
    (DataLoader worker, forked, spawned or forkserver) opens its own handle on
    first use.  ``__getitems__`` reads a whole batch at once.
    """

    extensions: Tuple[str, ...] = IMAGE_EXTENSIONS  # the image files conversion takes from a folder, as ImageFolder's

    @drops_frames
    def __init__(
        self,
        source: "str | os.PathLike[str] | Reader | Mixture",
        transform: Optional[Callable] = None,
        target_transform: Optional[Callable] = None,
        output: str = "pil",
        verify: bool = True,
        format: Optional[str] = None,
        *,
        fields: "Sequence[str] | Dict[str, str] | None" = None,
        transforms: Optional[Callable] = None,
        target: Optional[str] = None,
        cache_dir: "str | os.PathLike[str] | None" = None,
        cache_limit: "int | str | None" = None,
        storage_options: Optional[Dict[str, Any]] = None,
    ) -> None:
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if transforms is not None and (transform is not None or target_transform is not None):
            raise ValueError("give transforms or transform/target_transform, not both (as torchvision's datasets)")
        self._joint = transforms
        if isinstance(source, Mixture):  # its sources end to end, labels the mixture's (no draw: the sampler's)
            source = source.open(verify, format=format, cache_dir=cache_dir, cache_limit=cache_limit,
                                 storage_options=storage_options)
        elif not isinstance(source, Reader):
            source = open_archive(os.path.expanduser(os.fspath(source)), format=format, verify=verify,
                                  cache_dir=cache_dir, cache_limit=cache_limit, storage_options=storage_options)
        self.reader = source
        self.transform = transform
        self.target_transform = target_transform
        self.output = output
        if target is not None:
            if target not in targets.TARGETS:
                raise ValueError(f"target must be one of {targets.TARGETS} or None, got {target!r}")
            if isinstance(fields, dict):
                raise ValueError("with target='coco', fields= names the fields to read (their roles are the target's)")
            fields = targets.coco_roles(fields, self.reader.fields)
        self.target = target
        self.fields = sample_fields.parse_roles(fields, self.reader.fields, output)
        self._cache: ProcessLocal[Dict[str, Any]] = ProcessLocal(dict)  # never pickled: see loader()

    # ---- ImageFolder-like metadata --------------------------------------------------
    @property
    def path(self) -> str:
        return self.reader.path

    @property
    def root(self) -> str:
        """The archive's path (ImageFolder's root directory)."""
        return self.reader.path

    @property
    def manifest(self):
        return self.reader.manifest

    @property
    def classes(self) -> List[str]:
        return self.reader.classes

    @property
    def class_to_idx(self) -> Dict[str, int]:
        return {name: i for i, name in enumerate(self.classes)}

    @property
    def targets(self) -> "Targets":
        """Every sample's label as a read-only ``Targets`` sequence of Python ints (see there)."""
        return self._view("targets", Targets)

    @property
    def samples(self) -> "SampleList":
        """Every sample's ``(key, label)``, as ImageFolder's ``(path, class_index)`` list (see ``SampleList``)."""
        return self._view("samples", SampleList)

    def _view(self, name: str, kind: type) -> Any:
        """One view of each kind per process, made on first use.  Not one per access: a loop over
        ``dataset.targets[i]`` in a forked worker would otherwise make millions of objects the
        garbage collector tracks, and its full collections write to every object the worker
        inherited, copying the parent's heap page by page.  Kept in this process's cache, never
        pickled: a view holds the index itself, and the receiving process makes its own."""
        cache = self._cache.get()
        if name not in cache:
            cache[name] = kind(self.reader.index)
        return cache[name]

    @property
    def imgs(self) -> "SampleList":
        """The same as ``samples`` (ImageFolder keeps both names)."""
        return self.samples

    @property
    def transforms(self) -> Optional[Callable]:
        """``transform`` and ``target_transform`` as one ``(image, label)`` callable, as torchvision's
        VisionDataset has it (None when neither is set); it follows later changes to either.  The joint
        callable given as ``transforms=`` when there is one."""
        if self._joint is not None:
            return self._joint
        if self.transform is None and self.target_transform is None:
            return None
        from torchvision.datasets.vision import StandardTransform

        return StandardTransform(self.transform, self.target_transform)

    def find_classes(self, directory: "str | os.PathLike[str]") -> Tuple[List[str], Dict[str, int]]:
        """``(classes, class_to_idx)`` of ``directory``, with ImageFolder's signature.

        This archive's own when ``directory`` is its path, another archive's
        from its manifest, and for a plain folder its sorted sub-folders, as
        ImageFolder finds them (hidden ones left out, as conversion does).
        Raises ArchiveNotFoundError (a FileNotFoundError) for a missing path or
        a folder without sub-folders.
        """
        path = os.path.expanduser(os.fspath(directory))
        if os.path.realpath(path) == os.path.realpath(self.root):
            classes = self.classes
        elif os.path.isdir(path) and sniff_format(path) in (None, "folder"):
            classes = _class_folders(path)
        else:
            with open_archive(path, verify=False) as reader:
                classes = reader.classes
        return classes, {name: i for i, name in enumerate(classes)}

    @drops_frames  # an error kept by its catcher must not keep this dataset's handle open
    def loader(self, sample: "str | int") -> Image.Image:
        """Sample ``key`` (a key of ``samples``) or at index ``i``, decoded as ImageFolder's loader opens a path.

        Gives the PIL image (RGB, or L for a 1-channel raw archive) before any
        transform, whatever ``output`` is.  SampleIndexError for a key the
        archive does not hold.
        """
        i = self._key_index(sample) if isinstance(sample, str) else self.reader.check_index(sample)
        return self._to_output(self.reader.read(i), i, "pil")

    def _key_index(self, key: str) -> int:
        """The index of the sample stored under ``key``, by binary search of the keys in sorted order."""
        wanted = key.encode("utf-8", "surrogateescape")
        if len(wanted) <= self.reader.index.keys.dtype.itemsize:  # a longer one would be cut to the width
            keys, order = self._sorted_keys()
            at = int(np.searchsorted(keys, wanted, sorter=order))
            if at < len(order) and keys[order[at]] == wanted:
                return int(order[at])
        raise SampleIndexError(self.path, f"no sample has the key {key!r}", hint="take keys from dataset.samples")

    def _sorted_keys(self) -> Tuple[np.ndarray, np.ndarray]:
        """(the keys, the order that sorts them): made on the first lookup in each process, never pickled
        (the keys of a sharded archive are joined into one array here, for the binary search)."""
        cache = self._cache.get()
        if "key_order" not in cache:
            keys = np.asarray(self.reader.index.keys)
            cache["keys"], cache["key_order"] = keys, np.argsort(keys, kind="stable")
        return cache["keys"], cache["key_order"]

    def key(self, i: int) -> str:
        """The sample's original relative path."""
        return self.reader.key(i)

    def __len__(self) -> int:
        return len(self.reader)

    def __repr__(self) -> str:
        return f"PackedDataset({self.reader!r}, output={self.output!r})"

    # ---- samples ----------------------------------------------------------------------
    @drops_frames
    def __getitem__(self, i: int) -> Tuple[Any, Any]:
        with _fields_noted_in_workers():
            i = self.reader.check_index(i)
            return self._sample(self.reader.read(i), i)

    @drops_frames
    def __getitems__(self, indices: Sequence[int]) -> List[Tuple[Any, Any]]:
        """The same list ``[self[i] for i in indices]`` would give, read as one batch."""
        with _fields_noted_in_workers():
            idx = self.reader.check_indices(indices)
            stored = self.reader.read_many(idx)
            samples = []  # a loop, not a comprehension: in its frame's closure an error's traceback would keep self
            for j, i in enumerate(idx):
                samples.append(self._sample(stored[j], int(i)))
            return samples

    def _sample(self, stored: Any, i: int) -> Any:
        if self.fields is not None:
            return self._sample_with_fields(stored, i, self.fields)
        image = self._to_output(stored, i, self.output)
        label = int(self.reader.labels[i])
        if self._joint is not None:
            return self._joint(image, label)
        if self.transform is not None:
            if self.output == "numpy":
                self._check_takes_numpy(self.transform)
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    @property
    def collate(self) -> Callable[[List[Any]], Any]:
        """The ``collate_fn`` for a DataLoader over this dataset's dicts (with ``fields``): variable-length
        fields (boxes, points), text and JSON batched as lists, labels as a tensor, the rest stacked.  With
        ``target``: ``(images, targets)``, each a tuple, as torchvision's references batch them."""
        if self.target is not None:
            return _as_tuples
        lists = sample_fields.variable(self.fields or {}, self.reader.fields)
        return functools.partial(sample_fields.collate, lists=tuple(lists))

    def _sample_with_fields(self, stored: Any, i: int, roles: Dict[str, str]) -> Any:
        """Sample i as a dict of its image, label and the fields asked for, transformed together (with
        ``target``, or ``transforms``: as the pair they make)."""
        image = self._to_output(stored, i, self.output)
        if isinstance(image, Image.Image):
            canvas = (image.size[1], image.size[0])
        else:
            canvas = (int(image.shape[-2]), int(image.shape[-1])) if isinstance(image, torch.Tensor) else (
                int(image.shape[0]), int(image.shape[1]))
        sample: Dict[str, Any] = {"image": image, "label": int(self.reader.labels[i])}
        if sample_fields.uses_tv_tensors(roles) and isinstance(image, torch.Tensor):  # a PIL image stays one
            from torchvision import tv_tensors

            sample["image"] = tv_tensors.Image(image)
        for name, role in roles.items():
            spec = self.reader.manifest.field(name)
            try:
                sample[name] = sample_fields.field_value(spec, role, self.reader.read_field(i, name), self.output,
                                                         canvas, self._channels())
            except (ValueError, codecs.DecodeError) as exc:
                raise self.reader.sample_error(i, f"field {name!r}: {exc}") from None
        for name, boxes in sample_fields.instance_boxes(roles).items():  # a mask per box, before any transform
            try:
                sample[name] = targets.instance_masks(sample[name], len(sample[boxes]))
            except ValueError as exc:
                raise self.reader.sample_error(i, f"field {name!r}: {exc}") from None
        if self.target is not None:
            return self._with_target(sample, i)
        if self._joint is not None:  # (image, target): the target the label and the fields
            image = sample.pop("image")
            return self._joint(image, sample)
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            sample["label"] = self.target_transform(sample["label"])
        return sample

    def _with_target(self, sample: Dict[str, Any], i: int) -> Tuple[Any, Any]:
        """``(image, target)`` of sample i's dict, as ``target`` asks, transformed as torchvision's datasets do."""
        image = sample.pop("image")
        target = targets.coco_target(sample, i)
        if self._joint is not None:
            return self._joint(image, target)
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def _to_output(self, stored: Any, i: int, output: str) -> Any:
        channels = self._channels()
        try:
            if output == "pil":
                if isinstance(stored, np.ndarray):
                    return Image.fromarray(stored[:, :, 0] if channels == 1 else stored)
                image = codecs.open_image(stored)
                return codecs.to_8bit(image).convert("L" if channels == 1 else "RGB")
            pixels = stored if isinstance(stored, np.ndarray) else policy.decode(stored, channels)
        except codecs.DecodeError as exc:
            raise self.reader.sample_error(i, str(exc)) from None
        if output == "numpy":
            return np.array(pixels, copy=True) if not pixels.flags.writeable else pixels
        return torch.from_numpy(to_planar(pixels))

    def _channels(self) -> int:
        shape = self.reader.manifest.shape
        return 3 if shape is None else shape[2]

    def _check_takes_numpy(self, transform: Callable) -> None:
        """TypeError when a torchvision transform would get numpy images: v2 passes them through
        untransformed (or fails to find an image in them), v1 refuses them."""
        refusing = _first_refusing_numpy(transform)
        if refusing is not None:
            raise TypeError(
                f"{self.path}: output='numpy' gives the transform uint8 HxWxC numpy arrays, which torchvision's "
                f"{refusing} does not transform (v2 passes them through unchanged, v1 refuses them); use "
                "output='pil' (the default, as ImageFolder) or output='tensor', or begin the pipeline with "
                "ToImage() (v2) or ToTensor() (v1)"
            )

    # ---- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> "PackedDataset":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# torchvision transforms that take an HxWxC numpy array as it is (Lambda: whatever its function does).
_TAKE_NUMPY = ("ToTensor", "ToImage", "ToPILImage", "Lambda")


def _first_refusing_numpy(transform: Callable) -> Optional[str]:
    """The name of the torchvision transform a numpy image meets first if it cannot take one, else None."""
    while _from_torchvision(transform) and type(transform).__name__ == "Compose":
        steps = getattr(transform, "transforms", None)
        if not steps:
            return None
        transform = steps[0]
    if not _from_torchvision(transform) or type(transform).__name__ in _TAKE_NUMPY:
        return None
    return type(transform).__name__


def _from_torchvision(transform: Callable) -> bool:
    return type(transform).__module__.startswith("torchvision.transforms")


def _as_tuples(batch: List[Tuple[Any, Any]]) -> Tuple[Tuple[Any, ...], ...]:
    """``(images, targets)`` of a batch of pairs, each a tuple (torchvision's references batch so)."""
    return tuple(zip(*batch))


def _class_folders(path: str) -> List[str]:
    """A folder's sorted, non-hidden sub-folders: ImageFolder's classes, as conversion takes them."""
    with os.scandir(path) as entries:
        classes = sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ArchiveNotFoundError(path, "no class folders in it", hint="expected root/<class>/<image> files")
    return classes


# ---- ImageFolder's per-sample lists, as views of the index arrays ----------------------------------------
class _IndexRows(Sequence):
    """A read-only sequence of some rows of a SampleIndex, made into Python objects only when read.

    Holds the index and a ``range`` of rows, never an object per sample, so
    forked DataLoader workers that read it share its pages.  Indexing follows
    a list's (negative indices; a slice is a view of the same kind).
    """

    __slots__ = ("_index", "_rows")

    def __init__(self, index: SampleIndex, rows: Optional[range] = None) -> None:
        self._index = index
        self._rows = range(len(index)) if rows is None else rows

    def _item(self, row: int) -> Any:
        raise NotImplementedError

    def _items(self, rows: slice) -> List[Any]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return type(self)(self._index, self._rows[i])
        try:
            row = self._rows[operator.index(i)]
        except IndexError:
            raise IndexError(f"index {i} is out of range for {len(self)} samples") from None
        return self._item(row)

    def __iter__(self) -> Iterator[Any]:
        for first in range(0, len(self._rows), _CHUNK):
            yield from self._items(_as_slice(self._rows[first:first + _CHUNK]))

    def __reduce__(self) -> Tuple[Any, ...]:
        return type(self), (self._index, self._rows)

    def _summary(self, name: str) -> str:
        n = len(self)
        if n <= 8:
            return f"{name}({list(self)!r})"
        head = ", ".join(repr(x) for x in self[:3])
        return f"{name}([{head}, ..., {self[-1]!r}], {n} samples)"


def _as_slice(rows: range) -> slice:
    """``rows`` (a slice of ``range(n)``) as the slice that takes the same rows of an array."""
    if not rows:
        return slice(0, 0)
    return slice(rows.start, None if rows.stop < 0 else rows.stop, rows.step)


class Targets(_IndexRows):
    """Every sample's label, in the archive's int64 array, where ImageFolder has a list of ints.

    Works as that list does in common recipes: ``len``, indexing (negative
    indices; slices), iteration and ``Counter`` (Python ints, so ``json.dumps``
    takes the counts), ``in``, ``count``, ``index``, ``==`` with a list,
    ``tolist()``, ``np.asarray``/``np.bincount`` (a fresh writable int64 array),
    ``torch.as_tensor``/``torch.tensor`` (fast, through DLPack, and without
    torch's read-only array warning), ``[w[t] for t in targets]``.

    What differs from a list: it is read-only (no assignment, append or sort:
    copy it with ``tolist()`` or ``np.array`` to change it), a slice is a
    ``Targets`` view, ``+`` and ``*`` are not supported, it is no
    ``isinstance(..., list)``, and ``torch.from_numpy`` needs ``np.asarray(targets)``.
    As the numpy array it once was, it also takes an index array or mask
    (``targets[[3, 1]]``: a numpy array) and compares with a number element by
    element (``targets == 2``: a numpy bool array; a list would say False).
    """

    __slots__ = ()

    def _labels(self) -> np.ndarray:
        return self._index.labels[_as_slice(self._rows)]

    def __getitem__(self, i: Any) -> Any:
        if not isinstance(i, slice) and np.ndim(i) > 0:  # an index array or mask, as numpy takes it
            chosen = np.asarray(i)
            return self._labels()[chosen if chosen.size else chosen.astype(np.int64)].copy()
        return super().__getitem__(i)

    def _item(self, row: int) -> int:
        return int(self._index.labels[row])

    def _items(self, rows: slice) -> List[int]:
        return self._index.labels[rows].tolist()

    def tolist(self) -> List[int]:
        return self._labels().tolist()

    def __contains__(self, value: object) -> bool:
        return bool(np.any(self._labels() == value))

    def count(self, value: object) -> int:
        return int(np.count_nonzero(self._labels() == value))

    def index(self, value: object, start: int = 0, stop: Optional[int] = None) -> int:
        first, last, _ = slice(start, stop).indices(len(self))
        found = np.flatnonzero(self._labels()[first:last] == value)
        if not found.size:
            raise ValueError(f"{value!r} is not in targets")
        return first + int(found[0])

    def __eq__(self, other: object) -> Any:
        if isinstance(other, Targets):
            return bool(np.array_equal(self._labels(), other._labels()))
        if isinstance(other, list):
            return len(other) == len(self) and bool(np.array_equal(self._labels(), np.asarray(other, dtype=object)))
        if isinstance(other, (int, float, np.number)) and not isinstance(other, bool):
            return self._labels() == other
        return NotImplemented

    def __ne__(self, other: object) -> Any:
        equal = self.__eq__(other)
        if equal is NotImplemented or isinstance(equal, bool):
            return equal if equal is NotImplemented else not equal
        return ~equal

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, as a list

    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> np.ndarray:
        """A fresh writable array (the shared read-only one itself only when ``copy=False`` asks for no copy)."""
        labels = self._labels()
        if copy is False and (dtype is None or np.dtype(dtype) == labels.dtype):
            return labels
        return np.array(labels, dtype=dtype, copy=True)

    def __dlpack__(self, **kwargs: Any) -> Any:
        return np.array(self._labels(), copy=True).__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._labels().__dlpack_device__()

    def __repr__(self) -> str:
        return self._summary("Targets")


class SampleList(_IndexRows):
    """Every sample's ``(key, label)``: ImageFolder's ``samples`` (and ``imgs``) of ``(path, class_index)``.

    The key is the sample's relative path inside the archive (``class/file.jpg``),
    not a file to open: ``dataset.loader(key)`` reads it.  Read-only, indexed
    and sliced like a list; pairs are made as they are read.
    """

    __slots__ = ()

    def _item(self, row: int) -> Tuple[str, int]:
        return self._index.key(row), int(self._index.labels[row])

    def _items(self, rows: slice) -> List[Tuple[str, int]]:
        keys = [decode_key(k) for k in self._index.keys[rows]]
        return list(zip(keys, self._index.labels[rows].tolist()))

    def __repr__(self) -> str:
        return self._summary("SampleList")


@contextlib.contextmanager
def _fields_noted_in_workers() -> Iterator[None]:
    """In a DataLoader worker, an archive error leaves with its fields noted in its traceback text
    (``errors.note_fields``), so that the one torch raises in the main process still names the
    path, sample index and key.  Also where a worker could not send what it reads (``temp_dir``)."""
    try:
        if torch.utils.data.get_worker_info() is not None:
            temp_dir.check(tensors_only=True)
        yield
    except PackedFormatError as error:
        if torch.utils.data.get_worker_info() is not None:
            note_fields(error)
        raise

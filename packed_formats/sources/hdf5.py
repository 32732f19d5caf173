"""hdf5: an HDF5 file with an ``images`` and a ``labels`` dataset (one that packed_formats did not write).

``images`` is either uint8 pixels, [N,H,W,C] (also [N,H,W] greyscale, or
[N,C,H,W] with C of 1 or 3), or encoded image files: a 1-D dataset of
variable-length uint8 arrays or of bytes.  ``labels`` holds N integers.
``image_key``/``label_key`` name other datasets, ``subdir`` a group.  Class
names come from a ``classes`` attribute or dataset when there is one, else
they are "0".."max".  Keys are the sample numbers (``00000000``...).

Read in one ordered pass, a slab of whole chunks at a time (a gzip-compressed
dataset is decompressed once, not once per image).
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import ArchiveNotFoundError, CorruptArchiveError, InvalidSourceError
from .base import Sample, Source, SourceOptions, classes_and_labels

_SLAB_BYTES = 64 << 20  # at most this much of the images dataset is read at once
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


class HDF5Source(Source):
    """Samples of an images dataset, labelled by a labels dataset."""

    kind = "hdf5"
    label_advice = "is that right? Check the labels dataset (--label-key names it)"
    random_access = False

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        return head.startswith(_HDF5_MAGIC)

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "HDF5Source":
        import h5py

        image_name = options.image_key or "images"
        label_name = options.label_key or "labels"
        try:
            with h5py.File(path, "r", locking=False) as file:
                group = _group(path, file, options.subdir)
                images = _dataset(path, group, image_name, "image_key")
                labels_data = _dataset(path, group, label_name, "label_key")
                layout, shape = _image_layout(path, images)
                values = np.asarray(labels_data[()])
                class_names = _class_names(group)
                count = images.shape[0]
        except OSError as exc:
            raise CorruptArchiveError(
                path, f"HDF5 cannot read it ({exc})", hint="the file is truncated or damaged"
            ) from None
        values = values.reshape(len(values), -1)[:, 0] if values.ndim == 2 and values.shape[1] == 1 else values
        if values.ndim != 1 or len(values) != count:
            raise InvalidSourceError(
                path, f"{label_name!r} has shape {values.shape}, expected one label per image ({count})"
            )
        if not (np.issubdtype(values.dtype, np.integer) or values.dtype.kind in "SUO"):
            raise InvalidSourceError(path, f"{label_name!r} holds {values.dtype} values, expected integer labels")
        words = [v.decode() if isinstance(v, bytes) else v for v in values.tolist()]
        classes, labels = classes_and_labels(path, words)
        if class_names is not None and np.issubdtype(values.dtype, np.integer) and len(class_names) >= len(classes):
            classes = tuple(class_names)
        keys = [f"{i:08d}" for i in range(count)]
        group_name = f"{options.subdir}/" if options.subdir else ""
        description = f"HDF5 {group_name}{image_name} ({layout}) + {group_name}{label_name}"
        return cls(path, classes, keys, labels, layout=description, dataset=(options.subdir, image_name), shape=shape)

    def __init__(self, path, classes, keys, labels, layout: str, dataset: Tuple[Optional[str], str],
                 shape: Optional[Tuple[int, int, int]]) -> None:
        super().__init__(path, classes, keys, labels, layout=layout)
        self.dataset = dataset
        self.shape = shape  # (H, W, C) of the stored pixels, None when encoded
        self.channels_first = "NCHW" in layout

    @property
    def raw_shape(self) -> Optional[Tuple[int, int, int]]:
        if self.shape is None:
            return None
        h, w, _ = self.shape
        return h, w, 3

    def location(self, i: int) -> str:
        group, name = self.dataset
        return f"{self.path}:{group + '/' if group else ''}{name}[{i}]"

    def __iter__(self) -> Iterator[Sample]:
        import h5py

        with h5py.File(self.path, "r", locking=False) as file:
            group = file[self.dataset[0]] if self.dataset[0] else file
            images = group[self.dataset[1]]
            step = _slab_rows(images)
            for start in range(0, len(self), step):
                try:
                    slab = images[start:start + step]
                except OSError as exc:
                    raise CorruptArchiveError(
                        self.path, f"cannot read {self.dataset[1]}[{start}:{start + step}] ({exc})",
                        hint="the file is truncated or damaged",
                    ) from None
                for j, item in enumerate(slab):
                    i = start + j
                    yield Sample(self.key(i), int(self.labels[i]), self._sample(item))

    def _sample(self, item: Any) -> "bytes | np.ndarray":
        if self.shape is None:
            return item.tobytes() if isinstance(item, np.ndarray) else bytes(item)
        return np.ascontiguousarray(item.transpose(1, 2, 0)) if self.channels_first else item


def _group(path: str, file: Any, subdir: Optional[str]) -> Any:
    if subdir is None:
        return file
    if subdir not in file:
        raise ArchiveNotFoundError(path, f"has no group {subdir!r}", hint=f"its groups: {', '.join(file.keys())}")
    return file[subdir]


def _dataset(path: str, group: Any, name: str, option: str) -> Any:
    if name not in group:
        present = ", ".join(sorted(group.keys())) or "none"
        raise InvalidSourceError(
            path, f"has no dataset {name!r} (it has: {present})", hint=f"name the one to use with {option}"
        )
    return group[name]


def _image_layout(path: str, images: Any) -> Tuple[str, Optional[Tuple[int, int, int]]]:
    """("NHWC"/"NCHW"/"NHW" pixels or "encoded", (H, W, C) of the pixels or None)."""
    import h5py

    shape, dtype = images.shape, images.dtype
    vlen = h5py.check_vlen_dtype(dtype)
    if len(shape) == 1 and (vlen is not None and vlen == np.uint8 or dtype.kind in "SOV"):
        return "encoded", None
    if dtype != np.uint8:
        raise InvalidSourceError(path, f"images are {dtype}: expected uint8 pixels or encoded image bytes")
    if len(shape) == 3:
        return "NHW pixels", (shape[1], shape[2], 1)
    if len(shape) == 4 and shape[3] in (1, 3, 4):
        return "NHWC pixels", (shape[1], shape[2], shape[3])
    if len(shape) == 4 and shape[1] in (1, 3):
        return "NCHW pixels", (shape[2], shape[3], shape[1])
    raise InvalidSourceError(path, f"images have shape {shape}: expected [N,H,W,C], [N,H,W] or encoded bytes")


def _class_names(group: Any) -> Optional[List[str]]:
    found = group.attrs.get("classes")
    if found is None and "classes" in group:
        found = group["classes"][()]
    if found is None:
        return None
    return [v.decode() if isinstance(v, bytes) else str(v) for v in np.asarray(found).reshape(-1).tolist()]


def _slab_rows(images: Any) -> int:
    row = max(1, int(np.prod(images.shape[1:])) * images.dtype.itemsize) if images.ndim > 1 else 1 << 16
    rows = max(1, _SLAB_BYTES // row)
    chunk = images.chunks[0] if images.chunks else 1
    return max(chunk, rows // chunk * chunk)

"""The ``Writer`` every packed format extends: checks each sample, builds the index and the manifest,
spot-checks the sealed archive and publishes it atomically.

A format overrides the hooks of its section "what a backend provides" (``begin``, ``append``,
``finish``, ``discard``; where it stores fields, ``append_field`` and ``place_fields``; where it
knows positions only at the end, ``final_positions``); the rest is the same for every format.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import codecs, policy
from ..checksum import array_crc32, crc32
from ..errors import ArchiveExistsError, ClosedArchiveError, CorruptArchiveError, DestinationError, InvalidSampleError
from ..fields import FieldValueError, check_fields
from ..index import FieldIndexBuilder, IndexBuilder, SampleIndex
from ..manifest import MODES, NO_LABEL, RAW_LAYOUTS, ArchiveManifest, new_manifest
from .base import WriteTransaction
from .files import publish, remove_path, temp_path_for
from .reader import Reader


class Writer(WriteTransaction):
    """Appends samples to a new archive; nothing appears at ``path`` until close().

    The archive is written under a temporary name beside ``path``, sealed
    (manifest last), re-opened and spot-checked, then moved into place with
    ``os.replace``.  On error or abort() the temporary output is removed.

    Args:
        path: where the archive will be.
        mode: "encoded" (image file bytes) or "raw" (decoded pixels of one ``shape``).
        shape: (H, W, C) of every raw sample.
        classes: the class names, label i naming ``classes[i]``.
        encoding: "jpeg" or "png", for pixels added to an encoded archive.
        quality: the JPEG quality of such pixels.
        overwrite: replace an archive already at ``path`` (else ArchiveExistsError).
        fields: what each sample holds besides its image and label (``fields.FieldSpec`` or ``NAME=KIND``
            strings); ``add`` then takes each sample's values as ``fields={name: value}``.
        raw_layout: how a raw archive stores each sample's pixels: "hwc" (interleaved) or "chw" (planar,
            channel by channel: a contiguous NCHW batch is then a plain copy of them).  ``add`` takes
            HxWxC images either way.
        labelled: False for samples that have no label (detection, segmentation, unlabelled images): no
            ``classes``, and ``add`` takes ``label`` None or -1, which every sample then reads as.
    """

    format_name: ClassVar[str] = ""
    stores_positions: ClassVar[bool] = False  # whether the index records each sample's file position
    stores_fields: ClassVar[bool] = False  # whether the format stores fields (``append_field``)

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        *,
        mode: str = "encoded",
        shape: Optional[Sequence[int]] = None,
        classes: Sequence[str] = (),
        encoding: str = "jpeg",
        quality: int = 90,
        overwrite: bool = False,
        fields: Sequence[Any] = (),
        raw_layout: str = "hwc",
        labelled: bool = True,
    ) -> None:
        self.path = os.fspath(path)
        self.fields = check_fields(fields)
        if self.fields and not self.stores_fields:
            raise ValueError(f"the {self.format_name} format stores no fields yet; of the formats, "
                             f"{', '.join(_field_formats())} do")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.shape = _check_shape(shape) if mode == "raw" else None
        if mode == "raw" and self.shape is None:
            raise ValueError("mode='raw' needs shape=(height, width, channels)")
        if raw_layout not in RAW_LAYOUTS or (raw_layout != "hwc" and mode != "raw"):
            raise ValueError(f"raw_layout must be one of {RAW_LAYOUTS}, and 'hwc' unless mode='raw', "
                             f"got {raw_layout!r} for mode={mode!r}")
        self.raw_layout = raw_layout
        self.labelled = bool(labelled)
        if not self.labelled and len(classes):
            raise ValueError("an archive without labels (labelled=False) names no classes")
        if encoding not in codecs.ENCODINGS:
            raise ValueError(f"encoding must be one of {codecs.ENCODINGS}, got {encoding!r}")
        self.classes = tuple(str(c) for c in classes)
        self.encoding = encoding
        self.quality = quality
        self.overwrite = overwrite
        self._encodings_seen: set = set()
        self._builder = IndexBuilder(offsets=mode == "encoded" or self.stores_positions,
                                     positions=self.stores_positions, image_sizes=mode == "encoded")
        self._field_builder = FieldIndexBuilder([spec.name for spec in self.fields], positions=self.stores_positions)
        self._closed = False
        if os.path.lexists(self.path) and not overwrite:
            raise ArchiveExistsError(self.path, "already exists", hint="pass overwrite=True to replace it")
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise DestinationError(self.path, f"the destination directory {parent} does not exist")
        self.temp_path = temp_path_for(self.path)
        self._pid = os.getpid()  # a forked child must never clean up its parent's output
        self.begin(self.temp_path)

    # ---- what a backend provides -------------------------------------------------
    @abc.abstractmethod
    def begin(self, temp_path: str) -> None:
        """Create the archive at ``temp_path``."""

    @abc.abstractmethod
    def append(self, blob: bytes, i: int, crc: int) -> int:
        """Store sample i's bytes (``crc``: their CRC32, computed once for the index and any format
        that records it too); return its absolute file position or -1."""

    def append_field(self, name: str, blob: bytes, i: int, crc: int) -> int:
        """Store the bytes of field ``name`` of sample i (after the sample's image, fields in their declared
        order); return their absolute file position or -1.  Formats with ``stores_fields`` override this."""
        raise NotImplementedError(f"the {self.format_name} format stores no fields")

    def place_fields(self, arrays: Dict[str, np.ndarray]) -> None:
        """Called once every sample is appended, before the index is sealed: a format that kept its field
        values aside moves them into place and corrects their positions in ``arrays`` (default: nothing)."""

    @abc.abstractmethod
    def finish(self, index: SampleIndex, manifest: ArchiveManifest) -> None:
        """Write the index, then the manifest (the seal) last, and close."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Close whatever is open, quietly (the temporary output is removed after)."""

    def final_positions(self) -> Optional[np.ndarray]:
        """Each sample's file position, for formats that know them only once every sample is
        written (HDF5 allocates chunks itself); stored as the index's ``positions``, under its
        checksum.  None (the default): the positions ``append`` returned, if any."""
        return None

    @property
    def raw_shape(self) -> Tuple[int, int, int]:
        """(H, W, C) of a raw archive's samples."""
        if self.shape is None:
            raise ValueError("only a raw archive has a fixed sample shape")
        return self.shape

    @property
    def stored_shape(self) -> Tuple[int, int, int]:
        """The shape each raw sample's bytes are stored in: (H, W, C), or (C, H, W) when planar."""
        h, w, c = self.raw_shape
        return (c, h, w) if self.raw_layout == "chw" else (h, w, c)

    # ---- the public writing API --------------------------------------------------
    def __len__(self) -> int:
        return self._builder.count

    def add(self, sample: Any, label: int, key: Optional[str] = None, fields: Optional[Dict[str, Any]] = None) -> int:
        """Append one sample (encoded bytes, HxWxC uint8 array or PIL image) and its ``fields`` (a value for
        each field the writer declares); return its index.  A sample that cannot be stored
        (InvalidSampleError) leaves nothing of itself written: the writer goes on with the next."""
        if self._closed:
            raise ClosedArchiveError(self.path, "the writer is closed")
        i = self._builder.count
        key = f"{i:08d}" if key is None else str(key)
        label = self._check_label(label, i, key)
        blob, size = self._to_blob(sample, i, key)
        values = self._field_blobs(fields, i, key)  # all checked before anything of the sample is written
        crc = crc32(blob)
        position = self.append(blob, i, crc)
        for name, value in values:
            value_crc = crc32(value)
            self._field_builder.append(name, value_crc, len(value), self.append_field(name, value, i, value_crc))
        self._builder.append(label, key, crc, len(blob), position, size)
        return i

    def _field_blobs(self, values: Optional[Dict[str, Any]], i: int, key: str) -> List[Tuple[str, bytes]]:
        """(name, stored bytes) of each declared field of sample i, in order (InvalidSampleError naming
        the field when one is missing, unknown or no value of its kind)."""
        values = {} if values is None else values
        unknown = sorted(set(values) - {spec.name for spec in self.fields})
        if unknown:
            declared = ", ".join(spec.describe() for spec in self.fields) or "none"
            raise InvalidSampleError(self.path, f"fields {unknown} are not declared (the writer's fields: {declared})",
                                     index=i, key=key, hint="declare them: fields=[...] or --field NAME=KIND")
        out = []
        for spec in self.fields:
            if spec.name not in values or values[spec.name] is None:
                raise InvalidSampleError(self.path, f"field {spec.name!r} has no value", index=i, key=key)
            try:
                out.append((spec.name, spec.encode(values[spec.name])))
            except FieldValueError as exc:
                raise InvalidSampleError(self.path, str(exc), index=i, key=key) from None
        return out

    def close(self) -> None:
        """Seal, spot-check and publish the archive at ``path``."""
        if self._closed:
            return
        self._closed = True
        try:
            index = self._builder.build()
            positions = self.final_positions()
            if positions is not None:
                index = dataclasses.replace(index, positions=np.asarray(positions, dtype=np.int64))
            if self.fields:
                arrays = self._field_builder.build(len(index))
                self.place_fields(arrays)
                index = dataclasses.replace(index, fields=arrays)
            checksums = [(name, array_crc32(array)) for name, array in index.arrays().items()]
            manifest = new_manifest(
                self.format_name, self.mode, len(index), self.classes, self.shape, self._manifest_encoding(), checksums,
                fields=self.fields, raw_layout=self.raw_layout, labelled=self.labelled,
            )
            self.finish(index, manifest)
            del index, positions  # the file holds the index now: the spot check maps it from there
            self._spot_check(manifest.count)
            publish(self.temp_path, self.path, overwrite=self.overwrite)
        except BaseException:
            self.discard()
            remove_path(self.temp_path)
            raise

    def abort(self) -> None:
        """Discard everything written; ``path`` is left as it was."""
        if not self._closed:
            self._closed = True
            self.discard()
        remove_path(self.temp_path)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_pid", None) == os.getpid():
            try:
                self.abort()
            except Exception:
                pass

    # ---- helpers -------------------------------------------------------------------
    def _manifest_encoding(self) -> Optional[str]:
        if self.mode == "raw":
            return None
        if len(self._encodings_seen) == 1:
            return next(iter(self._encodings_seen))
        return "mixed" if self._encodings_seen else self.encoding

    def _check_label(self, label: Any, i: int, key: str) -> int:
        if not self.labelled:
            if label is None or (isinstance(label, (int, np.integer)) and int(label) == NO_LABEL):
                return NO_LABEL
            raise InvalidSampleError(self.path, f"label {label!r} for an archive without labels (labelled=False): "
                                     "give None or -1", index=i, key=key)
        try:
            value = int(label)
        except (TypeError, ValueError):
            raise InvalidSampleError(self.path, f"label {label!r} is not an integer", index=i, key=key) from None
        if self.classes and not 0 <= value < len(self.classes):
            raise InvalidSampleError(
                self.path, f"label {value} is out of range for {len(self.classes)} classes", index=i, key=key
            )
        if value < 0:
            raise InvalidSampleError(self.path, f"label {value} is negative: labels count from 0", index=i, key=key,
                                     hint="for samples without labels, write the archive with labelled=False")
        return value

    def _to_blob(self, sample: Any, i: int, key: str) -> Tuple[bytes, Tuple[int, int]]:
        """The bytes to store of sample i, and (encoded) its image's (width, height) for the index: from
        the pixels encoded here, else from the file's header ((0, 0), unknown, when it does not read:
        the bytes are stored as given, and fail where they are decoded)."""
        try:
            if self.mode == "encoded":
                if isinstance(sample, (bytes, bytearray, memoryview)):
                    data = bytes(sample)
                    kind = codecs.sniff(data)
                    if kind is None:
                        raise codecs.DecodeError("not a JPEG or PNG file")
                    size = _header_size(data)
                else:
                    pixels = codecs.to_array(sample)
                    data, kind = codecs.encode(pixels, self.encoding, self.quality), self.encoding
                    size = (int(pixels.shape[1]), int(pixels.shape[0]))
                self._encodings_seen.add(kind)
                return data, size
            pixels = codecs.to_array(sample, channels=self.raw_shape[2])
        except codecs.DecodeError as exc:
            raise InvalidSampleError(self.path, f"cannot store sample: {exc}", index=i, key=key) from None
        if pixels.shape != self.raw_shape:
            h, w, c = pixels.shape
            raise InvalidSampleError(
                self.path,
                f"image is {h}x{w}x{c} (HxWxC), the raw archive holds {'x'.join(map(str, self.raw_shape))}",
                index=i,
                key=key,
                hint="resize it first, e.g. packed-formats convert --size",
            )
        if self.raw_layout == "chw":
            pixels = pixels.transpose(2, 0, 1)  # planar: each channel's plane in turn
        return np.ascontiguousarray(pixels).tobytes(), (0, 0)  # a raw archive's index records no sizes

    def _spot_check(self, count: int) -> None:
        from . import spec

        with Reader(self.temp_path, spec(self.format_name).backend, verify=True) as reader:
            if len(reader) != count:
                raise CorruptArchiveError(self.path, f"wrote {count} samples but the archive holds {len(reader)}")
            for i in {0, count - 1} if count else ():
                reader.read(i)
                for field in self.fields:
                    reader.read_field(i, field.name)


def _header_size(data: bytes) -> Tuple[int, int]:
    """An encoded image's (width, height) from its header alone (no decode), or (0, 0) when it does not read."""
    try:
        width, height = policy.image_size(data)
    except codecs.DecodeError:
        return 0, 0
    return (width, height) if 0 < width < 1 << 31 and 0 < height < 1 << 31 else (0, 0)


def _check_shape(shape: Optional[Sequence[int]]) -> Optional[Tuple[int, int, int]]:
    if shape is None:
        return None
    shape = tuple(int(x) for x in shape)
    if len(shape) == 2:
        shape = shape + (3,)
    if len(shape) != 3 or min(shape) <= 0 or shape[2] not in (1, 3):
        raise ValueError(f"shape must be (height, width, channels) with 1 or 3 channels, got {shape}")
    return shape


def _field_formats() -> List[str]:
    """The registered formats whose writers store fields."""
    from . import SPECS

    return [spec.name for spec in SPECS if spec.writer is not None and spec.writer.stores_fields]

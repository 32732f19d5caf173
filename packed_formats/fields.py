"""Fields of a sample beyond its image and class: what each kind stores, and how its bytes come back.

A sample may carry named fields besides its image: a segmentation mask, boxes, a caption, a depth
map, any metadata.  Each field is declared once per archive (``FieldSpec``, in the manifest) with a
kind, and each sample stores one value of it as bytes, under its own CRC32, read only when asked:

* ``image``: an encoded image (a mask as PNG, a second view as JPEG); arrays and PIL images given
  to the writer are stored as PNG (lossless, as a mask must be).
* ``array``: a numpy array of a declared ``dtype`` and ``shape``.  The first dimension may be
  ``None``: a variable number of rows (boxes ``[N, 4]`` float32, polygon points ``[N, 2]``).
* ``bytes``: bytes as given.
* ``text``: a str, stored as UTF-8.
* ``json``: a JSON value (finite numbers only), stored as compact UTF-8 JSON.

What is stored is a pure function of the value (arrays in little-endian C order), so the same input
gives the same archive byte for byte.  Decoding checks what it reads against the declaration: a
stored array whose size is no whole number of rows, text that is not UTF-8, JSON that does not
parse are ``CorruptSampleError``s naming the field, never a wrong value.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import numbers
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import codecs
from .index import field_array

KINDS = ("image", "array", "bytes", "text", "json")
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}\Z")
RESERVED = frozenset({"image", "label", "key", "index", "target"})  # what a sample's dict already holds
DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "float32",
          "float64", "bool")
KINDS_TEXT = "image, array:DTYPE[D0,...], bytes, text or json"  # the kinds as --field writes them
MAX_ROW_BYTES = 1 << 31  # bytes of a row of an array field (of a whole value, when its shape is fixed) at most
FIELD_ARRAY = re.compile(r"field\.[A-Za-z][A-Za-z0-9_]{0,63}\.(offsets|crc32|positions)\Z")


class FieldValueError(ValueError):
    """A value that field cannot store, or stored bytes that are no value of it (the message names the field)."""


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One field of every sample of an archive.

    Args:
        name: letters, digits and ``_``, starting with a letter, at most 64; not ``image``, ``label``,
            ``key``, ``index`` or ``target``.
        kind: "image", "array", "bytes", "text" or "json".
        dtype: an array's element type (``DTYPES``), for kind "array" only.
        shape: an array's shape, for kind "array" only; its first dimension may be None (any number
            of rows), the others are fixed.
    """

    name: str
    kind: str
    dtype: Optional[str] = None
    shape: Optional[Tuple[Optional[int], ...]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.match(self.name) or self.name in RESERVED:
            raise FieldValueError(f"field name {self.name!r} must be letters, digits and _ (starting with a letter, "
                                  f"at most 64), and none of {sorted(RESERVED)}")
        if self.kind not in KINDS:
            raise FieldValueError(f"field {self.name!r}: kind must be one of {KINDS_TEXT} "
                                  f"(such as {self.name}=image or {self.name}=array:float32[N,4]), got {self.kind!r}")
        if self.kind != "array":
            if self.dtype is not None or self.shape is not None:
                raise FieldValueError(f"field {self.name!r}: only an array field has a dtype and shape")
            return
        if self.dtype not in DTYPES:
            raise FieldValueError(f"field {self.name!r}: dtype must be one of {DTYPES}, got {self.dtype!r}")
        shape = self.shape
        if not isinstance(shape, (tuple, list)) or not 1 <= len(shape) <= 8:
            raise FieldValueError(f"field {self.name!r}: an array's shape has 1 to 8 dimensions, got {shape!r}")
        dims = tuple(None if d is None else _dimension(self.name, d) for d in shape)
        if None in dims[1:]:
            raise FieldValueError(f"field {self.name!r}: only the first dimension may vary, got {shape!r}")
        object.__setattr__(self, "shape", dims)
        _check_size(self)

    @classmethod
    def parse(cls, text: str) -> "FieldSpec":
        """A field from ``NAME=KIND``, ``NAME=array:DTYPE[D0,D1,...]`` (``D0`` may be ``N``: any number of
        rows), as the command line's ``--field`` takes it: ``mask=image``, ``boxes=array:float32[N,4]``."""
        name, sep, kind = text.partition("=")
        if not sep:
            meant = re.fullmatch(r"\s*(\w+)\s*[:,]\s*(\w+.*)", text)
            example = f"{meant.group(1)}={meant.group(2)}" if meant else "seg=image"
            raise FieldValueError(f"a field is NAME=KIND with KIND one of {KINDS_TEXT} (such as {example}), "
                                  f"got {text!r}")
        match = re.fullmatch(r"array:(\w+)\[([\w, ]*)\]", kind.strip())
        if match:
            dims = [d.strip() for d in match.group(2).split(",") if d.strip()]
            shape: Tuple[Any, ...] = tuple(  # a dimension that is no ASCII number left for the check to name
                None if d.upper() == "N" else int(d) if d.isascii() and d.isdigit() else d for d in dims)
            return cls(name.strip(), "array", match.group(1), shape)
        return cls(name.strip(), kind.strip())

    def describe(self) -> str:
        """``NAME=KIND`` as ``parse`` takes it."""
        if self.kind != "array":
            return f"{self.name}={self.kind}"
        dims = ",".join("N" if d is None else str(d) for d in self.shape or ())
        return f"{self.name}=array:{self.dtype}[{dims}]"

    def to_json(self) -> Dict[str, Any]:
        data: Dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "array":
            data["dtype"], data["shape"] = self.dtype, list(self.shape or ())
        return data

    @classmethod
    def from_json(cls, data: Any) -> "FieldSpec":
        """A field as the manifest stores it (FieldValueError when it is not one)."""
        if not isinstance(data, dict) or set(data) - {"name", "kind", "dtype", "shape"}:
            raise FieldValueError(f"a field is an object of name, kind, dtype and shape, got {data!r:.200}")
        shape = data.get("shape")
        if shape is not None and not isinstance(shape, list):
            raise FieldValueError(f"a field's shape is a list, got {shape!r:.200}")
        if data.get("kind") == "array" and (shape is None or "dtype" not in data):
            raise FieldValueError(f"an array field names its dtype and shape, got {data!r:.200}")
        return cls(str(data.get("name")), str(data.get("kind")), data.get("dtype"),
                   None if shape is None else tuple(shape))

    @property
    def array_names(self) -> Tuple[str, str]:
        """The index arrays of this field: each sample's offsets into its bytes, and their CRC32s."""
        return (field_array(self.name, "offsets"), field_array(self.name, "crc32"))

    @property
    def fixed(self) -> bool:
        """Whether every value has one shape (batched as one tensor): a fixed-shape array."""
        return self.kind == "array" and None not in (self.shape or (None,))

    # ---- values to bytes and back ----
    def encode(self, value: Any) -> bytes:
        """The bytes stored for ``value`` (FieldValueError naming the field when it is no value of it)."""
        try:
            return _ENCODERS[self.kind](self, value)
        except FieldValueError:
            raise
        except (TypeError, ValueError, OverflowError, codecs.DecodeError) as exc:
            raise FieldValueError(f"field {self.name!r} ({self.kind}): {exc}") from None

    def from_file(self, data: bytes) -> Any:
        """The value a source file's bytes hold (a webdataset member, a sidecar file): an image's or bytes'
        bytes as they are, text as UTF-8, JSON parsed, an array from ``.npy`` bytes, checked to be a value of
        this field.  FieldValueError naming the field when they are not."""
        try:
            if self.kind == "text":
                value: Any = data.decode("utf-8")
            elif self.kind == "json":
                value = _decode_json(self, data)
            elif self.kind == "array":
                value = np.load(io.BytesIO(data), allow_pickle=False)
            else:
                value = data
        except (UnicodeDecodeError, ValueError, OSError, EOFError, RecursionError) as exc:
            raise FieldValueError(f"field {self.name!r} ({self.kind}): {type(exc).__name__}: {exc}") from None
        self.encode(value)  # the check the writer makes, here where the file is known
        return value

    def decode(self, blob: Any) -> Any:
        """The value of stored bytes: bytes (image, bytes), a numpy array, a str or a JSON value.
        FieldValueError when the bytes are no value of this field."""
        data = blob if isinstance(blob, (bytes, np.ndarray)) else bytes(blob)
        try:
            return _DECODERS[self.kind](self, data)
        except FieldValueError:
            raise
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise FieldValueError(f"field {self.name!r} ({self.kind}): {type(exc).__name__}: {exc}") from None


def _dimension(name: str, value: Any) -> int:
    """A declared dimension: an integer from 1 to 2**31, never a bool, a float or a string however round (a
    manifest's ``true``, ``2.0`` or ``"2"`` is no shape its writer gave); FieldValueError naming the field."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)) and 0 < int(value) <= 1 << 31:
        return int(value)
    raise FieldValueError(f"field {name!r}: a dimension is a positive integer (at most 2**31) or N, got {value!r}")


def _check_size(spec: FieldSpec) -> None:
    """FieldValueError naming the field when one row of it (its whole value, for a fixed shape) would be more
    than ``MAX_ROW_BYTES``: no sample holds such a value, and its size would overflow int64 in numpy."""
    shape = spec.shape or ()
    fixed = shape if shape[0] is not None else shape[1:]
    nbytes = np.dtype(spec.dtype).itemsize * math.prod(int(d or 0) for d in fixed)  # Python's int: no overflow
    if nbytes > MAX_ROW_BYTES:
        what = "row" if shape[0] is None else "value"
        raise FieldValueError(f"field {spec.name!r}: {spec.describe()} declares a {what} of {nbytes} bytes, over "
                              f"the {MAX_ROW_BYTES} bytes (2 GiB) a {what} may hold")


def _row_shape(spec: FieldSpec) -> Tuple[int, ...]:
    return tuple(int(d or 0) for d in (spec.shape or ())[1:])  # only the first may be None


def _encode_image(spec: FieldSpec, value: Any) -> bytes:
    """Encoded bytes as they are; a PIL image as PNG in its own mode (a palette mask keeps its indices); an
    array as PNG: 2-D uint8 or uint16 (a mask of up to 65,536 classes) or HxWx3 uint8."""
    from PIL import Image

    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if codecs.sniff(data) is None:
            raise FieldValueError(f"field {spec.name!r} (image): the bytes are no JPEG or PNG file")
        return data
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if not isinstance(value, Image.Image):
        array = np.asarray(value)
        fits = (array.ndim == 2 and array.dtype in (np.uint8, np.uint16)) or (
            array.ndim == 3 and array.shape[2] == 3 and array.dtype == np.uint8)
        if not fits:
            raise FieldValueError(f"field {spec.name!r} (image): an image field takes 2-D uint8 or uint16 arrays "
                                  f"(masks) or HxWx3 uint8, got {array.dtype} {tuple(array.shape)}; store other "
                                  "arrays as an array field")
        value = Image.fromarray(np.ascontiguousarray(array))
    out = io.BytesIO()
    value.save(out, "PNG")
    return out.getvalue()


def _encode_array(spec: FieldSpec, value: Any) -> bytes:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    dtype = np.dtype(spec.dtype)
    if array.dtype != dtype and not np.can_cast(array.dtype, dtype, casting="same_kind"):
        raise FieldValueError(f"field {spec.name!r} (array): {array.dtype} values do not fit {dtype}")
    shape = spec.shape or ()
    if array.size == 0 and shape[0] is None:  # no rows, however given ([] is shape (0,))
        array = array.reshape((0,) + _row_shape(spec))
    if array.ndim != len(shape) or any(d is not None and d != n for d, n in zip(shape, array.shape)):
        wanted = "x".join("N" if d is None else str(d) for d in shape)
        raise FieldValueError(f"field {spec.name!r} (array): shape {tuple(array.shape)} is not [{wanted}]")
    if array.dtype.kind == "f" and dtype.kind in "iub":
        raise FieldValueError(f"field {spec.name!r} (array): {array.dtype} values do not fit {dtype}")
    return np.ascontiguousarray(array, dtype=dtype.newbyteorder("<")).tobytes()


def _decode_array(spec: FieldSpec, data: Any) -> np.ndarray:
    dtype = np.dtype(spec.dtype).newbyteorder("<")
    flat = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else np.asarray(data, dtype=np.uint8)
    rows = _row_shape(spec)
    row_bytes = dtype.itemsize * int(np.prod(rows, dtype=np.int64))
    shape = spec.shape or ()
    if shape[0] is None:
        if flat.size % row_bytes:
            raise FieldValueError(f"field {spec.name!r} (array): {flat.size} bytes are no whole number of "
                                  f"{row_bytes}-byte rows")
        dims: Tuple[int, ...] = (flat.size // row_bytes,) + rows
    else:
        dims = tuple(int(d) for d in shape)  # type: ignore[arg-type]
        if flat.size != row_bytes * dims[0]:
            raise FieldValueError(f"field {spec.name!r} (array): {flat.size} bytes, expected "
                                  f"{row_bytes * dims[0]} for {list(dims)} {spec.dtype}")
    return flat.view(dtype).reshape(dims).astype(dtype.newbyteorder("="), copy=True)


def _encode_text(spec: FieldSpec, value: Any) -> bytes:
    if not isinstance(value, str):
        raise FieldValueError(f"field {spec.name!r} (text): a str, got {type(value).__name__}")
    return value.encode("utf-8")


def _encode_json(spec: FieldSpec, value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _encode_bytes(spec: FieldSpec, value: Any) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise FieldValueError(f"field {spec.name!r} (bytes): bytes, got {type(value).__name__}")
    return bytes(value)


def _decode_json(spec: FieldSpec, data: Any) -> Any:
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is no JSON value")

    def finite(text: str) -> float:  # 1e999 parses as infinity, which the writer never stores
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"number {text} is not finite (out of a float's range)")
        return value

    return json.loads(bytes(data).decode("utf-8"), parse_constant=no_constants, parse_float=finite)


_ENCODERS = {"image": _encode_image, "array": _encode_array, "bytes": _encode_bytes, "text": _encode_text,
             "json": _encode_json}


def _decode_image(spec: FieldSpec, data: Any) -> bytes:
    data = bytes(data)
    if codecs.sniff(data) is None:
        raise FieldValueError(f"field {spec.name!r} (image): the stored bytes are no JPEG or PNG file")
    return data


_DECODERS = {
    "image": _decode_image,
    "array": _decode_array,
    "bytes": lambda spec, data: bytes(data),
    "text": lambda spec, data: bytes(data).decode("utf-8"),
    "json": _decode_json,
}


def check_fields(fields: Sequence[Any]) -> Tuple[FieldSpec, ...]:
    """``fields`` (FieldSpecs or ``NAME=KIND`` strings) as a tuple of FieldSpecs with distinct names."""
    specs = tuple(f if isinstance(f, FieldSpec) else FieldSpec.parse(str(f)) for f in fields)
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise FieldValueError(f"fields named more than once: {twice}")
    return specs


def field_arrays(specs: Sequence[FieldSpec]) -> List[str]:
    """The names of every index array the fields ``specs`` may have (positions: in formats that record them)."""
    return [name for spec in specs for name in spec.array_names + (field_array(spec.name, "positions"),)]


# ---- boxes ---------------------------------------------------------------------------------------------------
BOX_FORMATS = ("XYXY", "XYWH", "CXCYWH")  # torchvision's names: corners; corner and size; centre and size


def move_boxes(boxes: np.ndarray, fmt: str, region: Tuple[float, float, float, float], out_size: Tuple[int, int]
               ) -> np.ndarray:
    """[N,4] boxes in ``fmt`` (pixels of an image) as they lie once the image's ``region`` (top, left, height,
    width) is scaled to ``out_size`` (height, width): moved, scaled and clamped to it (a box outside the region
    keeps zero width or height, as torchvision's crops leave it, so the boxes stay aligned with any per-box
    field); float32.  What a crop at decode and a resize at conversion both do to boxes."""
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    top, left, height, width = region
    out_h, out_w = out_size
    xyxy = _to_xyxy(boxes, fmt)
    scale = np.array([out_w / width, out_h / height, out_w / width, out_h / height], dtype=np.float32)
    moved = (xyxy - np.array([left, top, left, top], dtype=np.float32)) * scale
    moved = np.clip(moved, 0, np.array([out_w, out_h, out_w, out_h], dtype=np.float32))
    return _from_xyxy(moved, fmt)


def _to_xyxy(boxes: np.ndarray, fmt: str) -> np.ndarray:
    x, y, a, b = boxes.T
    if fmt == "XYWH":
        return np.stack([x, y, x + a, y + b], axis=1)
    if fmt == "CXCYWH":
        return np.stack([x - a / 2, y - b / 2, x + a / 2, y + b / 2], axis=1)
    return boxes.copy()


def _from_xyxy(boxes: np.ndarray, fmt: str) -> np.ndarray:
    x0, y0, x1, y1 = boxes.T
    if fmt == "XYWH":
        return np.stack([x0, y0, x1 - x0, y1 - y0], axis=1).astype(np.float32)
    if fmt == "CXCYWH":
        return np.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], axis=1).astype(np.float32)
    return boxes.astype(np.float32)

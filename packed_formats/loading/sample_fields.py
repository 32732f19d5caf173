"""A sample's fields as a training loop takes them: tensors, torchvision's tv_tensors, and batches.

``PackedDataset(path, fields=...)`` returns each sample as a dict: ``image``, ``label`` and the fields
asked for.  Each field is asked for with a *role* saying what it becomes:

* ``"value"`` (a list of names asks for this): an image field in the dataset's ``output`` form, as the
  sample's image is given (RGB, whatever the file's own mode), an array field as a tensor, text as str,
  JSON as its value, bytes as bytes;
* ``"mask"``: a ``tv_tensors.Mask`` (an image field's one channel, or a 2-D array field);
* ``"instances"``: an instance map (an image field's one channel, or a 2-D integer array field: 0 where no
  instance is, k + 1 where box k's is) as a ``tv_tensors.Mask`` of N uint8 masks [N, H, W], N the boxes of
  the request's boxes field (``targets.instance_masks``), so that a transform dropping a box drops its mask;
* ``"boxes:FORMAT"``: a ``tv_tensors.BoundingBoxes`` of an ``[N, 4]`` array field in ``FORMAT`` (XYXY,
  XYWH or CXCYWH) on the sample image's canvas;
* ``"image"``: a ``tv_tensors.Image`` (a second view; beside a PIL image, a PIL image).

With any tv_tensors role the sample's image is a ``tv_tensors.Image`` too (with ``output="pil"`` it stays
the PIL image, which v2 transforms take as an image as well), so that torchvision's v2 transforms, given the
whole dict, move masks and boxes with the image.  ``PackedDataset.collate``
batches such dicts: variable-length fields (boxes, points), text and JSON as lists, the rest stacked.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import codecs, policy
from ..fields import BOX_FORMATS, FieldSpec

ROLES = ("value", "mask", "instances", "image", "boxes")


def parse_roles(fields: "Sequence[str] | Mapping[str, str] | None", specs: Sequence[FieldSpec],
                output: str) -> Optional[Dict[str, str]]:
    """{field: role} of what a dataset was asked for (None: no fields, the plain ``(image, label)``);
    KeyError for a field the archive lacks, ValueError for a role its kind cannot take."""
    if fields is None:
        return None
    roles = dict(fields) if isinstance(fields, Mapping) else {name: "value" for name in fields}
    by_name = {spec.name: spec for spec in specs}
    for name, role in roles.items():
        if name not in by_name:
            there = ", ".join(by_name) or "none"
            raise KeyError(f"the archive has no field {name!r} (its fields: {there})")
        spec, kind = by_name[name], str(role).split(":", 1)[0]
        if kind not in ROLES:
            raise ValueError(f"field {name!r}: role must be one of {ROLES} (boxes as boxes:XYXY), got {role!r}")
        if kind == "boxes" and (spec.kind != "array" or tuple(spec.shape or ())[1:] != (4,)
                                or role.split(":", 1)[-1].upper() not in BOX_FORMATS):
            raise ValueError(f"field {name!r} ({spec.describe()}): boxes are an [N,4] array field and a format "
                             f"of {BOX_FORMATS}, as boxes:XYXY; got {role!r}")
        if kind == "mask" and not (spec.kind == "image" or (spec.kind == "array" and len(spec.shape or ()) in (2, 3))):
            raise ValueError(f"field {name!r} ({spec.describe()}): a mask is an image field or a 2-D or 3-D array")
        if kind == "instances" and not (spec.kind == "image" or (spec.kind == "array" and len(spec.shape or ()) == 2
                                                                 and np.dtype(spec.dtype).kind in "iu")):
            raise ValueError(f"field {name!r} ({spec.describe()}): an instance map is an image field or a 2-D integer "
                             "array")
        if kind == "image" and spec.kind != "image":
            raise ValueError(f"field {name!r} ({spec.describe()}): only an image field is an image")
        if kind != "value" and output == "numpy":  # v2 transforms take a PIL image or a tensor, never numpy
            raise ValueError(f"field {name!r}: tv_tensors roles need output='pil' or 'tensor' (torchvision's v2 "
                             f"transforms pass numpy images through unchanged), got output={output!r}")
    instance_boxes(roles)
    return roles


def instance_boxes(roles: Mapping[str, str]) -> Dict[str, str]:
    """{instance map field: the boxes field whose boxes it splits into} for the ``"instances"`` roles of
    ``roles``; ValueError naming the field unless the request has exactly one boxes field."""
    maps = [name for name, role in roles.items() if str(role).split(":", 1)[0] == "instances"]
    boxes = [name for name, role in roles.items() if str(role).split(":", 1)[0] == "boxes"]
    if maps and len(boxes) != 1:
        found = f"got {len(boxes)}: {', '.join(boxes)}" if boxes else "got none"
        raise ValueError(f"field {maps[0]!r}: an instance map (\"instances\") is split into one mask per box, so the "
                         f"request needs one boxes field beside it (such as {{'boxes': 'boxes:XYXY'}}); {found}")
    return {name: boxes[0] for name in maps}


def uses_tv_tensors(roles: Optional[Dict[str, str]]) -> bool:
    return bool(roles) and any(role != "value" for role in roles.values())  # type: ignore[union-attr]


def field_value(spec: FieldSpec, role: str, value: Any, output: str, canvas: Tuple[int, int],
                channels: int = 3) -> Any:
    """A field's decoded value (``FieldSpec.decode``) in the form its role asks for, an image field's view
    in the sample image's ``channels``; ValueError or codecs.DecodeError when it cannot take it (the caller
    names the sample)."""
    kind = role.split(":", 1)[0]
    if kind == "value":
        if spec.kind == "image":
            return image_output(value, output, channels)
        return torch.from_numpy(value) if spec.kind == "array" else value
    from torchvision import tv_tensors

    if kind == "boxes":
        return tv_tensors.BoundingBoxes(torch.from_numpy(value), format=role.split(":", 1)[1].upper(),
                                        canvas_size=canvas)
    size = (canvas[1], canvas[0])  # a mask or a view is its image's size (torchvision's v2 transforms need it so)
    if kind in ("mask", "instances"):  # an instance map as stored: the caller splits it (``instance_boxes``)
        if spec.kind == "image":
            return tv_tensors.Mask(torch.from_numpy(mask_array(value, size)))
        check_mask_shape(value, size)
        return tv_tensors.Mask(torch.from_numpy(value))
    check_image_size(value, size, "a second view")
    if output == "pil":  # beside a PIL image a PIL view, so that a resize takes both the same way
        return image_output(value, "pil", channels)
    return tv_tensors.Image(image_output(value, "tensor", channels))


def check_image_size(data: bytes, size: Tuple[int, int], what: str) -> None:
    """ValueError unless an image field's encoded image is ``size`` (width, height), its sample image's: read
    from its header, before a pixel of it is decoded (a mask that says it is 13,000 x 13,000 never is)."""
    stored, _ = codecs.image_header(data)
    if tuple(stored) != tuple(size):
        raise ValueError(f"{what} of {stored[0]}x{stored[1]} for an image of {size[0]}x{size[1]} (width x height): "
                         f"{what} is its image's size")


def check_mask_shape(mask: np.ndarray, size: Tuple[int, int]) -> None:
    """ValueError unless an array mask ([H,W] or [H,W,C]) is ``size`` (width, height), its image's."""
    if mask.ndim not in (2, 3) or mask.shape[:2] != (size[1], size[0]):
        raise ValueError(f"a mask of shape {list(mask.shape)} for an image of {size[0]}x{size[1]} (width x height): "
                         "a mask is its image's size")


def mask_array(data: bytes, size: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """An image field's stored mask as its values: a palette image's indices, 8 or 16 bits as stored (never
    through a colour conversion, which would turn classes into grey levels).  ValueError for a colour image,
    and for a mask that is not ``size`` (width, height: its image's), told from its header before decoding."""
    if size is not None:
        check_image_size(data, size, "a mask")
    image = codecs.open_image(data)
    if image.mode in ("1", "L", "P"):
        return np.array(image, dtype=np.uint8)
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # a 16-bit PNG (older Pillows open it as 32-bit I)
        values = np.array(image)
        fits = values.size == 0 or (int(values.min()) >= 0 and int(values.max()) <= 0xFFFF)
        return values.astype(np.uint16) if fits else values
    raise ValueError(f"a {image.mode} image is no mask (one channel of class values)")


def image_output(data: bytes, output: str, channels: int = 3) -> Any:
    """An encoded image field's bytes as a view, given as the sample's image would be from them: decoded to
    ``channels`` (the archive's: RGB, or L where a raw archive's images are grey) whatever the file's own
    mode (a palette's colours, never its indices; a 1-bit image as 0 and 255; no alpha), as a PIL image,
    uint8 HxWxC numpy or CxHxW tensor.  One rule on every path: ``make_loader`` cuts views the same way."""
    if output == "pil":
        return codecs.to_8bit(codecs.open_image(data)).convert("L" if channels == 1 else "RGB")
    pixels = policy.decode(data, channels)
    if output == "numpy":
        return np.array(pixels, copy=True)
    return torch.from_numpy(np.array(pixels.transpose(2, 0, 1)))  # a copy: the decoded array is read-only


def collate(samples: List[Dict[str, Any]], lists: Sequence[str] = ()) -> Dict[str, Any]:
    """A batch of sample dicts: the keys in ``lists`` (variable-length fields: boxes, points) as lists, labels
    as an int64 tensor, other tensors stacked (a tv_tensor keeps its type; tensors of different shapes, as
    images not resized to one size, are a ValueError naming the key), anything else (text, JSON) as a list.
    ``PackedDataset.collate`` is this with the dataset's variable-length fields as ``lists``."""
    batch: Dict[str, Any] = {}
    for key in samples[0]:
        values = [sample[key] for sample in samples]
        first = values[0]
        if key in lists or not isinstance(first, torch.Tensor):
            batch[key] = torch.tensor(values, dtype=torch.int64) if key == "label" and all(
                isinstance(v, int) for v in values) else values
            continue
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            raise ValueError(f"the batch's {key!r} tensors have shapes {sorted(shapes)}: resize them to one "
                             f"(a transform), or batch {key!r} as a list")
        stacked = torch.stack([v.as_subclass(torch.Tensor) for v in values])
        batch[key] = stacked if type(first) is torch.Tensor else _rewrap(first, stacked)
    return batch


def variable(roles: Mapping[str, str], specs: Sequence[FieldSpec]) -> List[str]:
    """The fields of ``roles`` whose values vary in length from sample to sample (batched as lists): arrays
    of any number of rows, and instance maps split into a mask per box."""
    by_name = {spec.name: spec for spec in specs}
    return [name for name in roles if (by_name[name].kind == "array" and not by_name[name].fixed)
            or str(roles[name]).split(":", 1)[0] == "instances"]


def _rewrap(like: torch.Tensor, stacked: torch.Tensor) -> torch.Tensor:
    """``stacked`` as the tv_tensor type of ``like`` (an Image or Mask batch stays one)."""
    from torchvision import tv_tensors

    return tv_tensors.wrap(stacked, like=like)

"""Fields in ``make_loader``'s batches: read in the workers beside the images, cut with the same boxes,
transformed together, sent as a few tensors and handed out as one dict per batch.

A worker reads the batch's images as always (a crop-first transform cut while decoding), then each
sample's fields (``BatchFields.read``): a mask (an image field, or a 2-D array, asked for as ``"mask"``)
is cut from the same box of its image and resized to the same size by nearest neighbour (its values are
classes; an instance map, ``"instances"``, too, then split into a mask per box of the sample's boxes
field, ``targets.instance_masks``), a second view (``"image"``, or an image field asked for as a value)
through the image's own decode-and-crop, and boxes (``"boxes:FORMAT"``) moved and scaled into the crop.
What follows the crop in the transform (a flip, a colour jitter) is a torchvision v2 transform given
each sample as a dict of tv_tensors (``apply_per_sample``), so masks and boxes move with the image.  The
batch's fields then leave the worker as one tensor per field (``pack``): fixed shapes stacked,
variable-length ones (boxes, points) as their rows joined and each sample's row count, text and JSON as
a list, and ``unpack`` makes them the batch's entries again in the main process.

Values asked for as ``"value"`` are passed as stored: an array field is no picture, so no crop applies to
it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, cast

import numpy as np
import torch

from .. import codecs, policy
from ..backends.reader import Reader
from ..fields import FieldSpec, move_boxes
from .image_lists import join, split
from .sample_fields import (
    check_image_size,
    check_mask_shape,
    field_value,
    image_output,
    instance_boxes,
    mask_array,
    parse_roles,
    variable,
)
from .targets import instance_masks

# Where a sample's image came from: (top, left, height, width) of the stored image, its stored
# (width, height), and the output (height, width) that box was resized to.
Where = Tuple[Tuple[int, int, int, int], Tuple[int, int], Tuple[int, int]]


class BatchFields:
    """The fields a loader reads with each batch and the role each takes (picklable: names and specs).

    Args:
        specs: the archive's fields (``Reader.fields``).
        fields: names (each as a ``"value"``) or ``{name: role}``, as ``PackedDataset``'s ``fields``.
    """

    def __init__(self, specs: Sequence[FieldSpec], fields: "Sequence[str] | Mapping[str, str]") -> None:
        roles = parse_roles(fields, specs, "tensor")
        if not roles:
            raise ValueError("fields= names at least one field (leave it out for (images, labels) batches)")
        by_name = {spec.name: spec for spec in specs}
        self.roles: Dict[str, str] = roles
        self.specs: Dict[str, FieldSpec] = {name: by_name[name] for name in roles}
        self.lists = tuple(variable(roles, specs))
        self.instances = instance_boxes(roles)  # {instance map: its boxes field}

    def read(self, reader: Reader, i: int, where: Optional[Where], canvas: Optional[Tuple[int, int]] = None
             ) -> Dict[str, Any]:
        """Sample i's fields, each as its role asks (numpy arrays for pictures and arrays), the pictures
        cut from ``where``'s box as its image was (None: as stored, and then ``canvas``'s size, the
        (height, width) of its image as read).  A value that does not fit its image, or does not decode,
        is a CorruptSampleError naming the sample and the field."""
        out: Dict[str, Any] = {}
        size = where[1] if where is not None else None if canvas is None else (canvas[1], canvas[0])
        shape = reader.manifest.shape
        channels = 3 if shape is None else shape[2]  # a view's, as the sample's image is given
        for name, role in self.roles.items():
            spec, kind = self.specs[name], role.split(":", 1)[0]
            try:
                value = reader.read_field(i, name)
                if kind in ("mask", "instances") and spec.kind == "image":
                    out[name] = cut_mask(mask_array(value, size), where)  # its size from its header, first
                elif kind in ("mask", "instances"):
                    if where is None and size is not None:
                        check_mask_shape(value, size)
                    out[name] = cut_mask(value, where)
                elif spec.kind == "image":  # [C,H,W], as a dataset gives an image field
                    if size is not None:
                        check_image_size(value, size, "a second view")
                    out[name] = np.ascontiguousarray(cut_view(value, where, channels).transpose(2, 0, 1))
                elif kind == "boxes":
                    out[name] = cut_boxes(value, role.split(":", 1)[1].upper(), where)
                else:
                    out[name] = value
            except (ValueError, codecs.DecodeError) as exc:
                raise reader.sample_error(i, f"field {name!r}: {exc}") from None
        for name, boxes in self.instances.items():  # cut as a mask, then a mask per box: a transform drops both
            try:
                out[name] = instance_masks(out[name], len(out[boxes])).as_subclass(torch.Tensor).numpy()
            except ValueError as exc:
                raise reader.sample_error(i, f"field {name!r}: {exc}") from None
        return out

    def as_tv_tensors(self, values: Dict[str, Any], canvas: Tuple[int, int]) -> Dict[str, Any]:
        """A sample's ``read`` values as a v2 transform takes them: masks as ``Mask``, boxes as
        ``BoundingBoxes`` on ``canvas`` (height, width), views as ``Image``, arrays as tensors."""
        from torchvision import tv_tensors

        out: Dict[str, Any] = {}
        for name, value in values.items():
            kind = self.roles[name].split(":", 1)[0]
            if kind in ("mask", "instances"):
                out[name] = tv_tensors.Mask(torch.from_numpy(value))
            elif kind == "boxes":
                out[name] = field_value(self.specs[name], self.roles[name], value, "tensor", canvas)
            elif isinstance(value, np.ndarray) and self.specs[name].kind == "image":
                out[name] = tv_tensors.Image(torch.from_numpy(value))
            elif isinstance(value, np.ndarray):
                out[name] = torch.from_numpy(value)
            else:
                out[name] = value
        return out

    def pack(self, samples: List[Dict[str, Any]], own_sizes: bool = False) -> Dict[str, Any]:
        """The batch's fields as few tensors (what a worker sends): {name: ("stack", tensor) | ("rows",
        joined rows, row counts) | ("each", joined values, their shapes) | ("list", values)}; ``own_sizes``:
        the images keep their own sizes, and so masks and second views (``image_lists.join``; instance masks,
        [N,H,W] of any N, are always sent so).  ValueError
        naming the field when fixed-shape values differ in shape (a mask not cut to the image's size)."""
        packed: Dict[str, Any] = {}
        for name, spec in self.specs.items():
            values = [sample[name] for sample in samples]
            if spec.kind in ("text", "json", "bytes"):
                packed[name] = ("list", values)
                continue
            arrays = [v.as_subclass(torch.Tensor) if isinstance(v, torch.Tensor) else torch.from_numpy(
                np.ascontiguousarray(v)) for v in values]
            own = own_sizes and (self.roles[name] in ("mask", "image") or spec.kind == "image")
            if own or name in self.instances:  # instance masks: [N,H,W], N each sample's own
                packed[name] = ("each", *join(arrays))
                continue
            if name in self.lists:
                counts = torch.tensor([len(a) for a in arrays], dtype=torch.int64)
                tail = tuple(arrays[0].shape[1:]) if arrays else tuple(int(d or 0) for d in (spec.shape or ())[1:])
                joined = torch.cat(arrays) if arrays else torch.empty((0, *tail), dtype=torch.float32)
                packed[name] = ("rows", joined, counts)
                continue
            shapes = sorted({tuple(a.shape) for a in arrays})
            if len(shapes) > 1:
                raise ValueError(f"field {name!r}: the batch's values have shapes {shapes}; cut them to one size "
                                 "(a crop-first transform, or size=, cuts masks and views with their images)")
            packed[name] = ("stack", torch.stack(arrays) if arrays else torch.empty(0))
        return packed

    def unpack(self, packed: Mapping[str, Any], canvas: "Tuple[int, int] | Sequence[Tuple[int, int]]",
               device: Optional[torch.device] = None) -> Dict[str, Any]:
        """``pack``'s tensors as the batch's entries, on ``device`` (None: where they are): stacked tensors
        (a ``Mask`` or ``Image`` batch for those roles), lists of each sample's tensor (``BoundingBoxes`` on
        ``canvas`` for boxes: the batch's (height, width), or each image's), lists of text and JSON values."""
        out: Dict[str, Any] = {}
        for name, item in packed.items():
            kind, role = item[0], self.roles[name]
            if kind == "list":
                out[name] = list(item[1])
            elif kind == "each":
                out[name] = [_as_role(value, role) for value in split(item[1], item[2], device)]
            elif kind == "rows":
                rows = list(torch.split(item[1].to(device), item[2].tolist()))
                if role.startswith("boxes"):
                    from torchvision import tv_tensors

                    fmt = role.split(":", 1)[1].upper()
                    canvases = cast(Sequence[Tuple[int, int]],
                                    [canvas] * len(rows) if isinstance(canvas[0], int) else canvas)
                    rows = [tv_tensors.BoundingBoxes(r, format=fmt, canvas_size=(int(c[0]), int(c[1])))
                            for r, c in zip(rows, canvases)]
                out[name] = rows
            else:
                out[name] = _as_role(item[1].to(device), role)
        return out


def _as_role(stacked: torch.Tensor, role: str) -> torch.Tensor:
    kind = role.split(":", 1)[0]
    if kind == "value":
        return stacked
    from torchvision import tv_tensors

    return tv_tensors.Mask(stacked) if kind in ("mask", "instances") else tv_tensors.Image(stacked)


def cut_mask(mask: np.ndarray, where: Optional[Where]) -> np.ndarray:
    """A mask ([H,W] or [H,W,C] class values) cut from its image's box and resized to its output size by
    nearest neighbour by torchvision's rule (``policy.nearest_indices``); as stored when ``where`` is None.
    ValueError when it is not its image's size."""
    if where is None:
        return np.ascontiguousarray(mask)
    (top, left, height, width), (stored_w, stored_h), (out_h, out_w) = where
    if mask.ndim not in (2, 3) or mask.shape[:2] != (stored_h, stored_w):
        raise ValueError(f"a mask of shape {list(mask.shape)} for an image of {stored_w}x{stored_h} (width x height): "
                         "a mask is its image's size")
    rows = policy.nearest_indices(top, height, out_h)  # torchvision's rule: floor(d * in / out)
    cols = policy.nearest_indices(left, width, out_w)
    return np.take(np.take(mask, rows, axis=0), cols, axis=1)  # rows, then columns: 4x faster than one 2-D gather


def cut_view(data: bytes, where: Optional[Where], channels: int = 3) -> np.ndarray:
    """A second view (an encoded image field) as HxWxC uint8 in the image's ``channels`` (RGB, whatever the
    file's own mode, as a dataset gives it: ``image_output``), cut and resized as its image was (the same
    decode-and-crop, bilinear); whole when ``where`` is None.  ValueError when it is not its image's size."""
    if where is None:
        return image_output(data, "numpy", channels)
    image = codecs.open_image(data)
    box, stored, size = where
    if tuple(image.size) != tuple(stored):
        raise ValueError(f"an image of {image.size[0]}x{image.size[1]} beside its sample's image of "
                         f"{stored[0]}x{stored[1]} (width x height): a second view is its image's size")
    return policy.decode_crop(data, channels, box, size, stored)


def cut_boxes(boxes: np.ndarray, fmt: str, where: Optional[Where]) -> np.ndarray:
    """[N,4] boxes in ``fmt`` moved into the crop ``where`` took and scaled to its output size, clamped to
    it (a box outside the crop keeps zero width or height, as torchvision's crops leave it); float32."""
    if where is None:
        return np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    return move_boxes(boxes, fmt, where[0], where[2])


def apply_per_sample(transform: Callable, fields: BatchFields, images: "torch.Tensor | Sequence[torch.Tensor]",
                     labels: torch.Tensor, values: List[Dict[str, Any]], stack: bool = True
                     ) -> Tuple[Any, List[Dict[str, Any]]]:
    """A v2 transform given each sample as a dict (``image`` a ``tv_tensors.Image``, ``label``, the fields
    as tv_tensors, boxes on the image's own canvas), so that it moves masks and boxes with the image: (the
    images stacked, or their list when not ``stack``; each sample's fields as the transform returned them).
    ``images``: a batch, or a list of [C,H,W] images of different sizes.  ValueError naming each image's
    shape when the transformed images are to be stacked but differ in size."""
    from torchvision import tv_tensors

    out_images: List[torch.Tensor] = []
    out_values: List[Dict[str, Any]] = []
    for j, sample_values in enumerate(values):
        canvas = (int(images[j].shape[-2]), int(images[j].shape[-1]))
        sample = {"image": tv_tensors.Image(images[j]), "label": int(labels[j]),
                  **fields.as_tv_tensors(sample_values, canvas)}
        wide = [name for name, value in sample.items() if isinstance(value, tv_tensors.Mask)
                and value.dtype == torch.uint16]
        for name in wide:  # torch before 2.9 cannot flip uint16: the transform sees int32, the batch gets uint16
            sample[name] = tv_tensors.Mask(sample[name].as_subclass(torch.Tensor).to(torch.int32))
        result = transform(sample)
        if not isinstance(result, dict) or "image" not in result:
            raise TypeError("with fields, transform takes and returns a sample's dict (a torchvision v2 transform); "
                            f"it returned {type(result).__name__}")
        out_images.append(torch.as_tensor(result["image"]).as_subclass(torch.Tensor))
        out_values.append({name: result[name] for name in fields.roles})
        for name in wide:
            out_values[-1][name] = tv_tensors.Mask(result[name].as_subclass(torch.Tensor).to(torch.uint16))
    if not stack:
        return out_images, out_values
    if len({tuple(image.shape) for image in out_images}) > 1:
        raise ValueError(f"the transformed images have shapes {[list(image.shape) for image in out_images]}")
    return (torch.stack(out_images) if out_images else images), out_values


def refuse_batch_transforms(transform: Optional[Callable]) -> None:
    """ValueError for one of this library's batch transforms given with fields: it sees the images only,
    so a mask or boxes would no longer match their image."""
    if transform is not None and type(transform).__module__.startswith("packed_formats.transforms"):
        raise ValueError(
            f"with fields, transform is a torchvision v2 transform of each sample's dict (it moves masks and boxes "
            f"with the image); {type(transform).__name__} of packed_formats.transforms transforms image batches "
            "only. Use torchvision.transforms.v2 (a RandomResizedCrop first is still cut while decoding)")


"""Targets in a form training code takes as it is: ``PackedDataset(path, target="coco")``.

torchvision's detection and segmentation references (and its models) take each sample as ``(image,
target)``, the target a dict of one image's instances.  ``target="coco"`` makes that dict from the fields
the COCO and VOC importers write, so no wrapper is needed:

* ``boxes``: a ``tv_tensors.BoundingBoxes`` of the ``boxes`` field, XYXY (as the importers store them),
  on the image's canvas;
* ``labels``: the ``labels`` field, int64 [N] (each box's class, an index in ``classes``);
* ``image_id``: an int, the ``image_id`` field (COCO's own id, as the annotation file gives it, so that
  evaluation against that file matches) or, in an archive without one, the sample's index;
* ``area``: the ``area`` field, float32 [N], or each box's area where there is none;
* ``iscrowd``: the ``iscrowd`` field, int64 [N], or zeros where there is none;
* ``masks``: where the archive has a ``masks`` field (the COCO importer's instance map, box k's
  instance ``k + 1``), a ``tv_tensors.Mask`` of N uint8 masks [N, H, W], box k's ``masks[k]`` (read with
  the ``"instances"`` role, as ``fields=`` reads such a map).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import numpy as np
import torch

from ..fields import FieldSpec

TARGETS = ("coco",)
COCO_FIELDS = ("boxes", "labels", "image_id", "area", "iscrowd", "masks")
_REQUIRED = ("boxes", "labels")


def coco_roles(names: "Sequence[str] | None", specs: Sequence[FieldSpec]) -> Dict[str, str]:
    """{field: role} that ``target="coco"`` reads: ``names`` (a subset of ``COCO_FIELDS``), or each of them the
    archive has.  ValueError when the archive lacks boxes or labels, or a name is no part of the target."""
    there = {spec.name: spec for spec in specs}
    if names is None:
        names = [name for name in COCO_FIELDS if name in there]
    unknown = [name for name in names if name not in COCO_FIELDS]
    if unknown:
        raise ValueError(f"target='coco' reads the fields {COCO_FIELDS}; {unknown[0]!r} is none of them "
                         "(leave fields= out to read each of them the archive has)")
    lacking = [name for name in _REQUIRED if name not in names or name not in there]
    if lacking:
        listed = ", ".join(there) or "none"
        raise ValueError(f"target='coco' needs the fields boxes (array [N,4], XYXY) and labels (array [N]), as "
                         f"the COCO and VOC importers write them; this archive's fields: {listed}")
    return {name: "boxes:XYXY" if name == "boxes" else "instances" if name == "masks" else "value" for name in names}


def coco_target(sample: Dict[str, Any], index: int) -> Dict[str, Any]:
    """The target dict of a sample dict (``image`` popped by the caller, ``label`` dropped) read with
    ``coco_roles``'s roles (``masks`` already split into N masks, as the ``"instances"`` role gives them);
    ``index`` is the sample's, its ``image_id`` where the archive records none."""
    boxes = sample["boxes"]
    target: Dict[str, Any] = {"boxes": boxes, "labels": sample["labels"]}
    image_id: Optional[torch.Tensor] = sample.get("image_id")
    target["image_id"] = int(image_id.reshape(-1)[0]) if image_id is not None and image_id.numel() else index
    if "area" in sample:
        target["area"] = sample["area"]
    else:
        plain = boxes.as_subclass(torch.Tensor)
        target["area"] = ((plain[:, 2] - plain[:, 0]) * (plain[:, 3] - plain[:, 1])).to(torch.float32)
    target["iscrowd"] = sample["iscrowd"] if "iscrowd" in sample else torch.zeros(len(boxes), dtype=torch.int64)
    if "masks" in sample:
        target["masks"] = sample["masks"]
    return target


def instance_masks(instance_map: "torch.Tensor | np.ndarray", count: int) -> Any:
    """An instance map (0 where no instance is, k + 1 where box k's is) as ``count`` uint8 masks [N, H, W]
    (a ``tv_tensors.Mask``).  ValueError when the map holds an instance above ``count``: a map and boxes
    that do not go together, whose masks would be silently lost."""
    from torchvision import tv_tensors

    if isinstance(instance_map, np.ndarray):  # int64: every stored integer compares (a uint64 too big wraps, < 0)
        plain = torch.from_numpy(instance_map.astype(np.int64))
    else:
        plain = instance_map.as_subclass(torch.Tensor).to(torch.int64)
    if plain.ndim == 3 and plain.shape[0] == 1:  # [1, H, W]: an image field's one channel
        plain = plain[0]
    if plain.ndim != 2:
        raise ValueError(f"an instance map is one channel [H, W], got shape {list(plain.shape)}")
    lowest, highest = (int(plain.min()), int(plain.max())) if plain.numel() else (0, 0)
    if lowest < 0:
        raise ValueError(f"the instance map holds {lowest}: instances are 0 (none) or k + 1 (box k's)")
    if highest > count:
        raise ValueError(f"the instance map holds instance {highest} for {count} boxes (instance k + 1 is box "
                         "k's): the map and its boxes do not go together; convert the archive again")
    ids = torch.arange(1, count + 1, dtype=torch.int64).reshape(-1, 1, 1)
    return tv_tensors.Mask((plain.unsqueeze(0) == ids).to(torch.uint8))

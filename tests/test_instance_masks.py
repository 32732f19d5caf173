"""An instance map read with the ``"instances"`` role: one mask per box, so that a transform dropping a box drops
its mask too (``v2.SanitizeBoundingBoxes`` filters a ``Mask`` of one mask per box), on every path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import packed_formats as pf
from packed_formats.errors import CorruptSampleError
from packed_formats.loading.targets import instance_masks

v2 = pytest.importorskip("torchvision.transforms.v2")

FIELDS = ["boxes=array:float32[N,4]", "labels=array:int64[N]", "masks=image"]
ROLES = {"boxes": "boxes:XYXY", "labels": "value", "masks": "instances"}
THIN_AND_SQUARE = [[2, 2, 3, 18], [10, 10, 18, 18]]  # 1 px wide: gone after Resize(10); then [5, 5, 9, 9]


def instance_map(size: int, boxes) -> np.ndarray:
    """A map of each (integer) box filled with its instance, k + 1, the later on top."""
    out = np.zeros((size, size), np.uint8)
    for k, (x0, y0, x1, y1) in enumerate(boxes):
        out[y0:y1, x0:x1] = k + 1
    return out


def write(path, samples, size: int = 20) -> str:
    """An archive of ``samples`` (lists of integer boxes; box k's label k + 1) with their instance maps."""
    with pf.open_writer(path, format="zip", classes=["thing"], fields=FIELDS) as writer:
        for boxes in samples:
            writer.add(np.full((size, size, 3), 100, np.uint8), 0, fields={
                "boxes": np.array(boxes, np.float32).reshape(-1, 4), "labels": np.arange(1, len(boxes) + 1),
                "masks": instance_map(size, boxes)})
    return str(path)


def check_aligned(boxes, labels, masks, before) -> int:
    """Each mask fills its box exactly (so it is its own box's: the boxes differ in size) and each label is its
    box's; ``before``: the boxes as written, in their labels' order.  The number of boxes checked."""
    assert isinstance(masks, torch.Tensor) and masks.dtype == torch.uint8 and len(masks) == len(boxes)
    for box, label, mask in zip(boxes.tolist(), labels.tolist(), masks):
        x0, y0, x1, y1 = (int(round(v)) for v in box)
        inside = torch.zeros_like(mask)
        inside[y0:y1, x0:x1] = 1
        assert torch.equal(mask.as_subclass(torch.Tensor), inside), (box, label)
        assert 1 <= label <= len(before)
    return len(boxes)


def test_a_dropped_box_takes_its_mask_with_it_where_a_plain_mask_would_give_the_wrong_one(tmp_path):
    path = write(tmp_path / "det.zip", [THIN_AND_SQUARE])
    transform = v2.Compose([v2.Resize(10), v2.SanitizeBoundingBoxes()])
    try:
        plain = pf.PackedDataset(path, output="tensor", fields={**ROLES, "masks": "mask"}, transform=transform)[0]
    except IndexError:  # torchvision 0.23 (the floor tier's): Sanitize indexes every Mask by the boxes kept
        plain = None
    if plain is not None:  # a newer one leaves a Mask that is not one mask a box as it is
        assert plain["boxes"].tolist() == [[5, 5, 9, 9]] and plain["masks"].shape == (10, 10)
        wrong = plain["masks"] == 1  # split after the drop: the thin strip's mask for the square
        assert wrong[:, 1].any() and not wrong[5:9, 5:9].any()
        with pytest.raises(ValueError, match="instance 2 for 1 boxes"):  # the split refuses such a map
            instance_masks(plain["masks"], 1)
    for output in ("tensor", "pil"):
        sample = pf.PackedDataset(path, output=output, fields=ROLES, transform=transform)[0]
        assert sample["boxes"].tolist() == [[5, 5, 9, 9]] and sample["labels"].tolist() == [2]
        assert check_aligned(sample["boxes"], sample["labels"], sample["masks"], THIN_AND_SQUARE) == 1
    untransformed = pf.PackedDataset(path, output="tensor", fields=ROLES)[0]
    assert untransformed["masks"].shape == (2, 20, 20)
    check_aligned(untransformed["boxes"], untransformed["labels"], untransformed["masks"], THIN_AND_SQUARE)


def make_loader_batches(path, num_workers: int, size=None, transform=None) -> list:
    return list(pf.make_loader(path, batch_size=2, num_workers=num_workers, shuffle=False, size=size, seed=3,
                               fields=ROLES, transform=transform))


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_make_loader_gives_each_sample_its_boxes_masks_after_the_transform_drops_some(tmp_path, workers):
    samples = [THIN_AND_SQUARE, [[0, 0, 20, 20]], [], [[4, 4, 5, 12], [2, 2, 16, 10], [12, 12, 20, 20]]]
    path = write(tmp_path / "det.zip", samples)
    transform = v2.Compose([v2.Resize(10), v2.SanitizeBoundingBoxes()])
    for size in (None, "own"):
        batches = make_loader_batches(path, workers, size=size, transform=transform)
        masks = [m for batch in batches for m in batch["masks"]]
        boxes = [b for batch in batches for b in batch["boxes"]]
        labels = [t for batch in batches for t in batch["labels"]]
        assert [len(b) for b in boxes] == [1, 1, 0, 2] and [m.shape[1:] for m in masks] == [(10, 10)] * 4
        assert all(type(m).__name__ == "Mask" for m in masks)
        for b, t, m, before in zip(boxes, labels, masks, samples):
            check_aligned(b, t, m, before)
            assert (b * 2).tolist() == [before[k - 1] for k in t.tolist()]  # each label its box's
    untransformed = make_loader_batches(path, workers)
    assert [tuple(m.shape) for batch in untransformed for m in batch["masks"]] == [
        (2, 20, 20), (1, 20, 20), (0, 20, 20), (3, 20, 20)]


@pytest.mark.slow
def test_two_workers_keep_masks_with_their_boxes_through_a_random_crop(tmp_path):
    samples = [[[1, 1, 9, 3], [2, 6, 30, 14], [20, 20, 31, 30]], [[0, 0, 6, 6], [10, 18, 27, 31]]] * 2
    path = write(tmp_path / "det.zip", samples, size=32)
    transform = v2.Compose([v2.RandomCrop(16), v2.SanitizeBoundingBoxes()])
    for size in (None, "own"):
        batches = make_loader_batches(path, 2, size=size, transform=transform)
        checked = sum(check_aligned(b, t, m, before) for batch, pair in zip(batches, (samples[:2], samples[2:]))
                      for b, t, m, before in zip(batch["boxes"], batch["labels"], batch["masks"], pair))
        assert checked >= 1  # some box survives each crop: the checks saw masks


def test_an_instance_above_the_boxes_is_named(tmp_path):
    path = tmp_path / "det.zip"
    with pf.open_writer(path, format="zip", classes=["thing"], fields=FIELDS) as writer:
        writer.add(np.zeros((8, 8, 3), np.uint8), 0, key="ok.png", fields={
            "boxes": np.zeros((0, 4), np.float32), "labels": np.zeros(0, np.int64),
            "masks": np.zeros((8, 8), np.uint8)})
        writer.add(np.zeros((8, 8, 3), np.uint8), 0, key="bad.png", fields={
            "boxes": np.array([[0, 0, 4, 4]], np.float32), "labels": np.ones(1, np.int64),
            "masks": np.full((8, 8), 3, np.uint8)})
    dataset = pf.PackedDataset(path, output="tensor", fields=ROLES)
    assert dataset[0]["masks"].shape == (0, 8, 8)
    for read in (lambda: dataset[1], lambda: list(pf.make_loader(path, batch_size=2, shuffle=False, fields=ROLES)),
                 lambda: pf.PackedDataset(path, output="tensor", target="coco")[1]):
        with pytest.raises(CorruptSampleError, match="instance 3 for 1 boxes") as caught:
            read()
        assert "det.zip" in str(caught.value) and "bad.png" in str(caught.value) and "'masks'" in str(caught.value)


def test_the_role_needs_one_boxes_field_beside_it(tmp_path):
    path = write(tmp_path / "det.zip", [THIN_AND_SQUARE])
    fields = {"masks": "instances", "labels": "value"}
    for make in (lambda: pf.PackedDataset(path, output="tensor", fields=fields),
                 lambda: pf.make_loader(path, batch_size=1, fields=fields)):
        with pytest.raises(ValueError, match="field 'masks'.*one boxes field beside it.*got none"):
            make()
    with pytest.raises(ValueError, match="'labels'.*instance map is an image field or a 2-D integer array"):
        pf.PackedDataset(path, output="tensor", fields={**ROLES, "labels": "instances"})

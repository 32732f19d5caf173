"""``PackedDataset(transforms=...)``: the joint ``(image, target)`` callable torchvision's datasets take and its
detection and segmentation references pass, beside ``transform=``: items are ``(image, target)``, the target
the label (without fields) or a dict of the label and the fields, as the references' own datasets give it."""

from __future__ import annotations

import pytest
import torch

import packed_formats as pf

from .test_coco_source import write_coco

ROLES = {"boxes": "boxes:XYXY", "labels": "value", "masks": "mask", "image_id": "value"}


@pytest.fixture(scope="module")
def coco_archive(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco")
    out = root / "coco.zip"
    pf.convert(write_coco(root / "layout"), out, quiet=True, workers=1)
    return str(out)


def flip(image, target):
    """The references' joint transform, in the small: flip the image and move the boxes and masks with it."""
    from torchvision.transforms import v2

    return v2.RandomHorizontalFlip(p=1.0)(image, target)


def test_a_joint_transform_gets_the_image_and_a_target_of_the_label_and_fields(coco_archive):
    plain = pf.PackedDataset(coco_archive, output="tensor", fields=ROLES)
    joint = pf.PackedDataset(coco_archive, output="tensor", fields=ROLES, transforms=flip)
    assert joint.transforms is flip
    image, target = joint[0]
    item = plain[0]
    assert sorted(target) == ["boxes", "image_id", "label", "labels", "masks"]
    assert torch.equal(image, item["image"].flip(-1)) and torch.equal(target["masks"], item["masks"].flip(-1))
    width = image.shape[-1]
    assert torch.equal(target["boxes"], torch.stack([width - item["boxes"][:, 2], item["boxes"][:, 1],
                                                     width - item["boxes"][:, 0], item["boxes"][:, 3]], dim=1))
    assert torch.equal(target["labels"], item["labels"]) and target["label"] == 0


def test_without_fields_the_target_is_the_label(coco_archive):
    dataset = pf.PackedDataset(coco_archive, transforms=lambda image, label: (image.size, label + 1))
    assert dataset[1] == ((24, 20), 1)


def test_transforms_goes_alone(coco_archive):
    with pytest.raises(ValueError, match="transforms or transform/target_transform"):
        pf.PackedDataset(coco_archive, transform=lambda x: x, transforms=flip)


@pytest.mark.slow
def test_workers_apply_the_joint_transform_as_this_process_does(coco_archive):
    dataset = pf.PackedDataset(coco_archive, output="tensor", fields=ROLES, transforms=flip)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=2,
                                         collate_fn=lambda batch: tuple(zip(*batch)))  # the references' collate
    got = [(image, target) for images, targets in loader for image, target in zip(images, targets)]
    assert len(got) == 3
    for i, (image, target) in enumerate(got):
        want_image, want_target = dataset[i]
        assert torch.equal(image, want_image) and torch.equal(target["masks"], want_target["masks"])
        assert torch.equal(target["boxes"], want_target["boxes"])


def test_make_loader_refuses_a_dataset_with_a_joint_transform(coco_archive):
    dataset = pf.PackedDataset(coco_archive, transforms=flip)
    with pytest.raises(ValueError, match="pass transform= to make_loader, not the dataset"):
        pf.make_loader(dataset, batch_size=2, num_workers=0, size=16)

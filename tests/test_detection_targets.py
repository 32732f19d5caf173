"""Detection and segmentation sets as torchvision's references take them: ``target="coco"`` gives each sample's
``(image, target)`` with the annotation file's image ids, PIL images come with masks and boxes as tv_tensors
(v2 transforms move them as with tensor images), and a set may declare that its images have no label."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

import packed_formats as pf
from tests.test_coco_source import write_coco
from tests.test_fields import png

v2 = pytest.importorskip("torchvision.transforms.v2")


def converted_coco(tmp_path) -> tuple:
    """A COCO layout written here, converted; (the archive, the annotation file's content)."""
    root = write_coco(tmp_path / "coco")
    out = tmp_path / "coco.zip"
    pf.convert(root, out, quiet=True, workers=1)
    with open(os.path.join(root, "annotations", "instances_val2017.json")) as file:
        return str(out), json.load(file)


# ---- image ids and the COCO target ---------------------------------------------------------------------------
def test_target_coco_gives_each_image_its_annotation_files_id_and_instances(tmp_path):
    out, annotations = converted_coco(tmp_path)
    id_of = {image["file_name"]: image["id"] for image in annotations["images"]}
    dataset = pf.PackedDataset(out, output="tensor", target="coco")
    assert len(dataset) == 3
    for i in range(len(dataset)):
        image, target = dataset[i]
        assert set(target) == {"boxes", "labels", "image_id", "area", "iscrowd", "masks"}
        assert target["image_id"] == id_of[dataset.key(i)] and type(target["image_id"]) is int
        boxes = [a for a in annotations["annotations"] if a["image_id"] == target["image_id"]]
        want = [[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in boxes)]
        assert target["boxes"].tolist() == want and target["boxes"].canvas_size == tuple(image.shape[-2:])
        assert target["area"].tolist() == [a["area"] for a in boxes]
        assert target["iscrowd"].tolist() == [a.get("iscrowd", 0) for a in boxes]
        assert target["labels"].tolist() == [dataset.classes.index(
            next(c["name"] for c in annotations["categories"] if c["id"] == a["category_id"])) for a in boxes]
        assert target["masks"].shape == (len(boxes), *image.shape[-2:]) and target["masks"].dtype == torch.uint8
    _, target = dataset[0]  # box k's mask is the instance map's k + 1
    with pf.open_archive(out) as reader:
        instance_map = np.asarray(Image.open(io.BytesIO(reader.read_field(0, "masks"))))
    for k in range(2):
        assert np.array_equal(target["masks"][k].numpy(), (instance_map == k + 1).astype(np.uint8))
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=dataset.collate)
    images, batch_targets = next(iter(loader))  # as the references' collate_fn: a tuple of each
    assert len(images) == 2 and [t["image_id"] for t in batch_targets] == [1, 2]


def test_without_an_image_id_field_the_index_is_the_id_and_area_and_iscrowd_are_made(tmp_path):
    path = tmp_path / "det.zip"
    with pf.open_writer(path, format="zip", classes=["bg", "cat"],
                        fields=["boxes=array:float32[N,4]", "labels=array:int64[N]"]) as writer:
        for i in range(3):
            writer.add(np.full((20, 30, 3), i, np.uint8), 0,
                       fields={"boxes": np.array([[1, 2, 11, 7]] * i, np.float32), "labels": np.ones(i, np.int64)})
    dataset = pf.PackedDataset(path, target="coco", output="tensor")
    for i in range(3):
        _, target = dataset[i]
        assert target["image_id"] == i and "masks" not in target
        assert target["area"].tolist() == [50.0] * i and target["area"].dtype == torch.float32
        assert target["iscrowd"].tolist() == [0] * i and target["iscrowd"].dtype == torch.int64


def test_target_coco_reads_the_fields_named_and_refuses_an_archive_without_boxes(tmp_path):
    out, _ = converted_coco(tmp_path)
    _, target = pf.PackedDataset(out, target="coco", fields=["boxes", "labels", "image_id"])[1]
    assert set(target) == {"boxes", "labels", "image_id", "area", "iscrowd"} and target["image_id"] == 2
    with pytest.raises(ValueError, match="category_id"):
        pf.PackedDataset(out, target="coco", fields=["boxes", "labels", "category_id"])
    with pytest.raises(ValueError, match="target must be"):
        pf.PackedDataset(out, target="voc")
    plain = tmp_path / "plain.zip"
    with pf.open_writer(plain, format="zip", classes=["a"]) as writer:
        writer.add(np.zeros((4, 4, 3), np.uint8), 0)
    with pytest.raises(ValueError, match="needs the fields boxes"):
        pf.PackedDataset(plain, target="coco")


# ---- PIL images with fields ----------------------------------------------------------------------------------
def test_pil_images_come_with_masks_and_boxes_as_tv_tensors(tmp_path):
    from torchvision import tv_tensors

    out, _ = converted_coco(tmp_path)
    sample = pf.PackedDataset(out, fields={"masks": "mask", "boxes": "boxes:XYXY"})[0]  # output="pil"
    assert isinstance(sample["image"], Image.Image) and sample["image"].size == (40, 30)
    assert isinstance(sample["masks"], tv_tensors.Mask) and sample["masks"].shape[-2:] == (30, 40)
    assert isinstance(sample["boxes"], tv_tensors.BoundingBoxes) and sample["boxes"].canvas_size == (30, 40)
    with pytest.raises(ValueError, match="output='pil' or 'tensor'"):
        pf.PackedDataset(out, output="numpy", fields={"masks": "mask"})
    views = tmp_path / "views.zip"  # a second view beside a PIL image is one too: a resize takes both alike
    pixels = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    with pf.open_writer(views, format="zip", classes=["a"], encoding="png", fields=["view=image"]) as writer:
        writer.add(pixels, 0, fields={"view": pixels})
    dataset = pf.PackedDataset(views, fields={"view": "image"},
                               transform=v2.Compose([v2.RandomResizedCrop(16), v2.ToImage()]))
    torch.manual_seed(0)
    sample = dataset[0]
    assert torch.equal(sample["image"], sample["view"]) and sample["view"].shape == (3, 16, 16)


@pytest.mark.parametrize("target", [True, False], ids=["target", "fields"])
def test_a_v2_pipeline_moves_boxes_and_masks_with_a_pil_image_as_with_a_tensor_one(tmp_path, target):
    out, _ = converted_coco(tmp_path)
    pipeline = v2.Compose([v2.RandomZoomOut(side_range=(1.0, 2.0)),
                           v2.RandomIoUCrop(), v2.RandomHorizontalFlip(), v2.ToImage(),
                           v2.ToDtype(torch.float32, scale=True)])
    given = {"target": "coco", "transforms": pipeline} if target else {
        "fields": {"masks": "mask", "boxes": "boxes:XYXY"}, "transform": pipeline}
    results = {}
    for output in ("pil", "tensor"):
        dataset = pf.PackedDataset(out, output=output, **given)
        torch.manual_seed(3)
        results[output] = [dataset[i] for i in (0, 1, 0, 1)]
    for pil, tensor in zip(results["pil"], results["tensor"]):
        pil = {"image": pil[0], **pil[1]} if target else pil
        tensor = {"image": tensor[0], **tensor[1]} if target else tensor
        assert pil["image"].dtype == torch.float32
        for name in ("image", "boxes", "masks"):
            assert type(pil[name]) is type(tensor[name]) and torch.equal(pil[name], tensor[name]), name
        assert pil["boxes"].canvas_size == tensor["boxes"].canvas_size == tuple(pil["image"].shape[-2:])


# ---- sets without labels -------------------------------------------------------------------------------------
def write_shard(path, count: int = 4, cls_in=()) -> str:
    """A webdataset shard of images and masks; only the samples in ``cls_in`` have a .cls member."""
    with tarfile.open(path, "w") as tar:
        for i in range(count):
            members = {"png": png(np.full((12, 16, 3), 30 * i, np.uint8)),
                       "seg.png": png(np.eye(12, 16, dtype=np.uint8))}
            if i in cls_in:
                members["cls"] = b"1"
            for extension, data in members.items():
                info = tarfile.TarInfo(f"s{i:04d}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_a_webdataset_declared_without_labels_loads_with_label_minus_one_and_no_classes(tmp_path, capsys):
    from packed_formats import cli

    shard = write_shard(tmp_path / "seg.tar")
    out = tmp_path / "seg.zip"
    pf.convert(shard, out, label_key="none", fields=["seg=image"], quiet=True, workers=1)
    assert cli.main(["info", str(out)]) == 0 and "labels      none" in capsys.readouterr().out
    with pf.open_archive(out) as reader:
        assert reader.manifest.labelled is False and reader.classes == [] and list(reader.labels) == [-1] * 4
    dataset = pf.PackedDataset(out, output="tensor", fields={"seg": "mask"})
    assert dataset.classes == [] and [dataset[i]["label"] for i in range(4)] == [-1] * 4
    assert list(pf.PackedDataset(out).targets) == [-1] * 4
    loader = pf.make_loader(out, batch_size=2, num_workers=0, shuffle=False)
    assert loader.classes == [] and [labels.tolist() for _, labels in loader] == [[-1, -1], [-1, -1]]


def test_a_sample_without_cls_in_a_labelled_webdataset_is_still_an_error_naming_it(tmp_path):
    shard = write_shard(tmp_path / "part.tar", cls_in=(0, 1, 3))
    with pytest.raises(pf.InvalidSourceError, match=r"s0002.*no \.cls label member.*--label-key none"):
        pf.convert(shard, tmp_path / "out.zip", fields=["seg=image"], quiet=True, workers=1)
    none = write_shard(tmp_path / "none.tar")  # no .cls at all, not declared: the error says how to declare it
    with pytest.raises(pf.PackedFormatError, match="--label-key none"):
        pf.convert(none, tmp_path / "out.zip", fields=["seg=image"], quiet=True, workers=1)


def test_a_writer_declared_without_labels_takes_none_or_minus_one_and_a_labelled_one_refuses_them(tmp_path):
    with pf.open_writer(tmp_path / "u.zip", format="zip", labelled=False) as writer:
        writer.add(np.zeros((4, 4, 3), np.uint8), None)
        writer.add(np.zeros((4, 4, 3), np.uint8), -1)
        with pytest.raises(pf.InvalidSampleError, match="without labels"):
            writer.add(np.zeros((4, 4, 3), np.uint8), 0)
    with pytest.raises(ValueError, match="names no classes"):
        pf.open_writer(tmp_path / "v.zip", format="zip", labelled=False, classes=["a"])
    with pf.open_writer(tmp_path / "l.zip", format="zip") as writer:
        with pytest.raises(pf.InvalidSampleError, match="labelled=False"):
            writer.add(np.zeros((4, 4, 3), np.uint8), -1)
        writer.add(np.zeros((4, 4, 3), np.uint8), 0)
    with pf.open_archive(tmp_path / "u.zip") as reader:
        # version 7 holds an archive without labels, 8 (newer) its images' sizes: PNGs from the writer
        assert reader.manifest.format_version == 8 and list(reader.labels) == [-1, -1]


@pytest.mark.parametrize("edit, label, says", [
    ({"labelled": False, "classes": []}, 0, "no label, but sample 0 has label 0"),
    ({"labelled": "no"}, 0, "labelled is 'no'"),
    ({"labelled": False, "classes": ["a"]}, -1, "names 1 classes"),
    ({}, -1, "sample 0 has label -1, no class"),
    ({"classes": []}, -1, "sample 0 has label -1, but the manifest says the samples have labels"),
])
def test_a_manifest_whose_labels_do_not_fit_its_declaration_is_refused_on_open(tmp_path, edit, label, says):
    from packed_formats.backends import memmap
    from packed_formats.checksum import array_crc32
    from packed_formats.manifest import _content_crc32

    path = tmp_path / "a.memmap"
    with pf.open_writer(path, format="memmap", mode="raw", shape=(4, 4, 3), classes=["a"]) as writer:
        writer.add(np.zeros((4, 4, 3), np.uint8), 0)
    labels = np.array([label], np.int64)
    np.save(os.path.join(path, "labels.npy"), labels)  # under a checksum that fits: only the declaration is wrong
    name = os.path.join(path, memmap.MANIFEST)
    with open(name) as file:
        data = json.loads(file.read())
    data["index_crc32"]["labels"] = array_crc32(labels)
    data.update(edit)
    if "labelled" in edit:  # a declaration of version 7 on
        data.update(format_version=7, raw_layout="hwc")
    data.pop("manifest_crc32")
    with open(name, "w") as file:  # resealed, as a writer would: only the declaration is wrong
        file.write(json.dumps({**data, "manifest_crc32": _content_crc32(data)}))
    with pytest.raises(pf.CorruptArchiveError, match=says):
        pf.open_archive(path)


def test_a_python_source_declared_without_labels_takes_images_alone(tmp_path):
    images = [np.full((8, 10, 3), 20 * i, np.uint8) for i in range(3)]
    out = tmp_path / "py.zip"
    pf.convert(pf.PythonSource(images, labelled=False), out, quiet=True, workers=1)
    with pf.open_archive(out) as reader:
        assert reader.manifest.labelled is False and reader.classes == [] and list(reader.labels) == [-1] * 3
        assert np.array_equal(pf.PackedDataset(reader, output="numpy")[2][0], images[2])
    with pytest.raises(pf.InvalidSampleError, match="declared without labels"):
        pf.convert(pf.PythonSource([(images[0], 1)], labelled=False), tmp_path / "bad.zip", quiet=True, workers=1)
    with pytest.raises(ValueError, match="takes no classes"):
        pf.PythonSource(images, labelled=False, classes=["a"])

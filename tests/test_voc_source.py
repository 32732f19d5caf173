"""Pascal VOC's layout as a conversion source: ``JPEGImages`` with ``SegmentationClass`` palette masks and
``Annotations`` XML boxes, converted with the mask (its indices kept), boxes, labels and difficult flags as
fields.  The XML files are untrusted: each way one can be wrong is an error naming the file and the object."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

import packed_formats as pf
from packed_formats.sources import detect_source, open_source
from packed_formats.sources.voc import VOC_CLASSES

PALETTE = [v for k in range(256) for v in (k * 7 % 256, k * 13 % 256, k * 29 % 256)]
STEMS = ("2007_000032", "2007_000039", "2008_000002")


def xml(width=40, height=30, objects=(("aeroplane", (4, 5, 20, 25), 0), ("person", (10, 2, 40, 30), 1))) -> str:
    items = "".join(
        f"<object><name>{name}</name><pose>Unspecified</pose><truncated>0</truncated>"
        f"<difficult>{difficult}</difficult><bndbox><xmin>{box[0]}</xmin><ymin>{box[1]}</ymin>"
        f"<xmax>{box[2]}</xmax><ymax>{box[3]}</ymax></bndbox></object>"
        for name, box, difficult in objects)
    return (f"<annotation><folder>VOC2012</folder><filename>x.jpg</filename><size><width>{width}</width>"
            f"<height>{height}</height><depth>3</depth></size><segmented>1</segmented>{items}</annotation>")


def palette_mask(height=30, width=40, seed=0) -> Image.Image:
    mask = np.zeros((height, width), np.uint8)
    mask[5:25, 4:20] = 1
    mask[2:30, 20:40] = 15
    mask[4, :] = 255  # VOC's border
    mask[0, seed] = 7
    image = Image.fromarray(mask, "P")
    image.putpalette(PALETTE)
    return image


def write_voc(root, masks=STEMS[:2], xmls=STEMS) -> str:
    """VOCdevkit/VOC2012 as VOC's tar unpacks: images, the masks of some, the XML of all, and split lists."""
    voc = os.path.join(root, "VOCdevkit", "VOC2012")
    for folder in ("JPEGImages", "SegmentationClass", "Annotations", "ImageSets/Segmentation", "ImageSets/Main"):
        os.makedirs(os.path.join(voc, folder), exist_ok=True)
    for k, stem in enumerate(STEMS):
        Image.fromarray(np.full((30, 40, 3), 50 * k, np.uint8)).save(os.path.join(voc, "JPEGImages", stem + ".jpg"))
    for k, stem in enumerate(masks):
        palette_mask(seed=k).save(os.path.join(voc, "SegmentationClass", stem + ".png"))
    for stem in xmls:
        with open(os.path.join(voc, "Annotations", stem + ".xml"), "w") as file:
            file.write(xml())
    with open(os.path.join(voc, "ImageSets", "Segmentation", "val.txt"), "w") as file:
        file.write(f"{STEMS[1]}\n")
    with open(os.path.join(voc, "ImageSets", "Main", "val.txt"), "w") as file:
        file.write(f"{STEMS[1]}\n{STEMS[2]}\n")
    return str(root)


def test_a_voc_folder_converts_with_its_masks_and_boxes(tmp_path):
    root = write_voc(tmp_path / "voc")
    assert detect_source(root) == "voc"
    out = tmp_path / "out.zip"
    pf.convert(root, out, quiet=True, workers=2)
    with pf.open_archive(out) as reader:
        assert tuple(reader.classes) == VOC_CLASSES and list(reader.labels) == [0, 0]
        assert [reader.key(i) for i in range(len(reader))] == [STEMS[0] + ".jpg", STEMS[1] + ".jpg"]
        for i in range(2):
            mask = Image.open(io.BytesIO(reader.read_field(i, "mask")))
            assert mask.mode == "P"  # the palette PNG as it is: its indices are the classes
            np.testing.assert_array_equal(np.asarray(mask), np.asarray(palette_mask(seed=i)))
            np.testing.assert_array_equal(reader.read_field(i, "boxes"), [[4, 5, 20, 25], [10, 2, 40, 30]])
            assert reader.read_field(i, "labels").tolist() == [1, 15]  # aeroplane, person: the masks' indices
            assert reader.read_field(i, "difficult").tolist() == [0, 1]


def test_a_split_and_named_fields_choose_the_images(tmp_path):
    root = write_voc(tmp_path / "voc")
    with open_source(root, subdir="val") as source:
        assert [source.key(i) for i in range(len(source))] == [STEMS[1] + ".jpg"]
    boxes_only = ["boxes=array:float32[N,4]", "labels=array:int64[N]"]
    with open_source(root, subdir="val", fields=boxes_only) as source:  # ImageSets/Main: no mask needed
        assert len(source) == 2 and [spec.name for spec in source.fields] == ["boxes", "labels"]
    with open_source(root, fields=boxes_only) as source:
        assert len(source) == 3
    with pytest.raises(pf.InvalidSourceError, match="no field mask=text \\(its fields: mask=image, boxes="):
        open_source(root, fields=["mask=text"])


def test_other_object_names_are_classes_after_vocs(tmp_path):
    root = write_voc(tmp_path / "voc")
    path = os.path.join(root, "VOCdevkit", "VOC2012", "Annotations", STEMS[0] + ".xml")
    with open(path, "w") as file:
        file.write(xml(objects=(("zebra", (1, 1, 5, 5), 0), ("cat", (1, 1, 5, 5), 0))))
    with open_source(root) as source:
        assert source.classes == VOC_CLASSES + ("zebra",)
        assert source.load_fields(0)["labels"].tolist() == [21, 8]


@pytest.mark.parametrize("content,says", [
    (xml(objects=(("dog", (4, 5, 50, 25), 0),)), "object 0 \\(dog\\): bndbox \\[4, 5, 50, 25\\] is not inside"),
    (xml(objects=(("dog", (4, 5, "nan", 25), 0),)), "object 0 \\(dog\\): its bndbox is .* finite numbers"),
    (xml(objects=(("dog", (20, 5, 4, 25), 0),)), "object 0 \\(dog\\): .* not in order"),
    (xml(objects=(("", (4, 5, 20, 25), 0),)), "object 0: its name '' is empty"),
    (xml(objects=(("dog", (4, 5, 20, 25), 3),)), "object 0 \\(dog\\): difficult is 0 or 1"),
    (xml(width=0), "has objects but no size"),
    ("<annotation><object>", "is no XML file"),
    ('<!DOCTYPE a [<!ENTITY x "xx">]><annotation>&x;</annotation>', "has a DOCTYPE"),
])
def test_a_wrong_xml_is_a_named_error(tmp_path, content, says):
    root = write_voc(tmp_path / "voc")
    path = os.path.join(root, "VOCdevkit", "VOC2012", "Annotations", STEMS[1] + ".xml")
    with open(path, "w") as file:
        file.write(content)
    with pytest.raises(pf.InvalidSourceError, match=says) as caught:
        pf.convert(root, tmp_path / "out.zip", quiet=True, workers=1)
    assert path in str(caught.value)
    with open_source(root, on_error="skip") as source:
        assert [source.key(i) for i in range(len(source))] == [STEMS[0] + ".jpg"] and len(source.failed) == 1


def test_a_split_file_naming_a_path_is_refused(tmp_path):
    root = write_voc(tmp_path / "voc")
    listing = os.path.join(root, "VOCdevkit", "VOC2012", "ImageSets", "Segmentation", "val.txt")
    with open(listing, "w") as file:
        file.write("../../../etc/passwd\n")
    with pytest.raises(pf.InvalidSourceError, match="line 1: '../../../etc/passwd' is no image name"):
        open_source(root, subdir="val")


def test_a_mask_of_another_size_than_its_image_is_refused(tmp_path):
    root = write_voc(tmp_path / "voc")
    palette_mask(height=31).save(os.path.join(root, "VOCdevkit", "VOC2012", "SegmentationClass", STEMS[0] + ".png"))
    with pytest.raises(pf.PackedFormatError, match="the mask is 40 x 31 pixels, its image 40 x 30"):
        pf.convert(root, tmp_path / "out.zip", quiet=True, workers=1)


def test_a_folder_of_several_voc_years_asks_for_one(tmp_path):
    root = write_voc(tmp_path / "voc")
    os.rename(os.path.join(root, "VOCdevkit", "VOC2012"), os.path.join(root, "VOCdevkit", "VOC2007"))
    write_voc(tmp_path / "voc")
    with pytest.raises(pf.InvalidSourceError, match=r"several VOC folders \(VOCdevkit/VOC2007, VOCdevkit/VOC2012\)"):
        open_source(root)
    with open_source(os.path.join(root, "VOCdevkit", "VOC2007")) as source:
        assert len(source) == 2


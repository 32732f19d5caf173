"""COCO's layout as a conversion source: ``annotations/instances_<split>.json`` and its image folder, or a ZIP
file of them, converted with boxes, labels, iscrowd, area and masks (polygons, RLE lists and compressed RLE
strings decoded here without pycocotools) as fields.  Everything the annotation file says is untrusted: each
way it can be wrong is an error naming the file, the image id and the annotation id."""

from __future__ import annotations

import io
import json
import os
import zipfile

import numpy as np
import pytest
from PIL import Image

import packed_formats as pf
from packed_formats.sources import detect_source, open_source
from packed_formats.sources.coco_masks import MaskError, compressed_counts, rle_mask

SIZES = {1: (30, 40), 2: (20, 24), 7: (16, 16)}  # image id: (height, width)


def counts_of(mask: np.ndarray) -> list:
    """A mask's RLE counts: runs down each column, from background."""
    flat = mask.T.ravel().astype(np.uint8)
    edges = np.flatnonzero(np.diff(flat)) + 1
    runs = np.diff(np.concatenate([[0], edges, [flat.size]])).tolist()
    return runs if flat[0] == 0 else [0] + runs


def compressed(counts: list) -> str:
    """pycocotools' compressed RLE string of ``counts``, written here from its definition."""
    out = []
    for i, value in enumerate(counts):
        x = value - counts[i - 2] if i > 2 else value
        more = True
        while more:
            c = x & 0x1F
            x >>= 5
            more = x != -1 if c & 0x10 else x != 0
            out.append(chr((c | (0x20 if more else 0)) + 48))
    return "".join(out)


def block(height, width, x0, y0, x1, y1) -> np.ndarray:
    mask = np.zeros((height, width), bool)
    mask[y0:y1, x0:x1] = True
    return mask


def coco_json() -> dict:
    crowd = block(30, 40, 20, 10, 36, 26)
    small = block(20, 24, 2, 3, 8, 9)
    return {
        "images": [  # not in id order: samples come by id
            {"id": 7, "file_name": "c.png", "height": 16, "width": 16},
            {"id": 2, "file_name": "sub/b.png", "height": 20, "width": 24},
            {"id": 1, "file_name": "a.png", "height": 30, "width": 40},
        ],
        "categories": [{"id": 18, "name": "dog"}, {"id": 1, "name": "person"}],
        "annotations": [
            {"id": 100, "image_id": 1, "category_id": 1, "bbox": [2, 3, 10, 12], "area": 120.0, "iscrowd": 0,
             "segmentation": [[2, 3, 12, 3, 12, 15, 2, 15]]},
            {"id": 101, "image_id": 1, "category_id": 18, "bbox": [20, 10, 16, 16], "area": 256, "iscrowd": 1,
             "segmentation": {"size": [30, 40], "counts": counts_of(crowd)}},
            {"id": 102, "image_id": 2, "category_id": 18, "bbox": [2, 3, 6, 6], "area": 36.0,
             "segmentation": {"size": [20, 24], "counts": compressed(counts_of(small))}},
        ],
    }


def write_coco(root, data=None, split="val2017") -> str:
    """The layout COCO downloads unpack to: annotations/instances_<split>.json and <split>/<file_name>."""
    data = coco_json() if data is None else data
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    with open(os.path.join(root, "annotations", f"instances_{split}.json"), "w") as file:
        json.dump(data, file)
    for image in data["images"]:
        height, width = SIZES.get(image["id"], (16, 16))
        path = os.path.join(root, split, image["file_name"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.fromarray(np.full((height, width, 3), 10 * image["id"], np.uint8)).save(path)
    return str(root)


def zip_folder(root, out, top="coco") -> str:
    with zipfile.ZipFile(out, "w") as archive:
        for folder, _, files in os.walk(root):
            for name in files:
                path = os.path.join(folder, name)
                archive.write(path, f"{top}/{os.path.relpath(path, root)}")
    return str(out)


def check_converted(out) -> None:
    with pf.open_archive(out) as reader:
        assert list(reader.classes) == ["__background__", "person", "dog"]
        assert [reader.key(i) for i in range(3)] == ["a.png", "sub/b.png", "c.png"]
        assert list(reader.labels) == [0, 0, 0]
        assert [int(reader.read_field(i, "image_id")[0]) for i in range(3)] == [1, 2, 7]
        np.testing.assert_array_equal(reader.read_field(0, "boxes"), [[2, 3, 12, 15], [20, 10, 36, 26]])
        assert reader.read_field(0, "labels").tolist() == [1, 2]
        assert reader.read_field(0, "category_id").tolist() == [1, 18]
        assert reader.read_field(0, "iscrowd").tolist() == [0, 1]
        assert reader.read_field(0, "area").tolist() == [120.0, 256.0]
        assert reader.read_field(1, "iscrowd").tolist() == [0]  # not said: not a crowd
        assert reader.read_field(2, "boxes").shape == (0, 4) and reader.read_field(2, "labels").shape == (0,)
        masks = [np.asarray(Image.open(io.BytesIO(reader.read_field(i, "masks")))) for i in range(3)]
    assert masks[0].shape == (30, 40) and masks[2].shape == (16, 16) and not masks[2].any()
    np.testing.assert_array_equal(masks[0] == 2, block(30, 40, 20, 10, 36, 26))  # the list RLE
    np.testing.assert_array_equal(masks[1] == 1, block(20, 24, 2, 3, 8, 9))  # the compressed RLE
    polygon = masks[0] == 1  # rasterised with its outline: the corners' pixels and all between
    np.testing.assert_array_equal(polygon, block(30, 40, 2, 3, 13, 16))


def test_a_coco_folder_converts_with_its_annotations_as_fields(tmp_path):
    root = write_coco(tmp_path / "coco")
    assert detect_source(root) == "coco"
    out = tmp_path / "out.zip"
    pf.convert(root, out, quiet=True, workers=1)
    check_converted(out)


def test_a_zip_of_the_layout_converts_the_same(tmp_path):
    archive = zip_folder(write_coco(tmp_path / "coco"), tmp_path / "coco.zip")
    assert detect_source(archive) == "coco"
    out = tmp_path / "out.lmdb"
    pf.convert(archive, out, quiet=True, workers=2)
    check_converted(out)


def test_fields_may_be_named_or_left_out(tmp_path):
    root = write_coco(tmp_path / "coco")
    with open_source(root, fields=["boxes=array:float32[N,4]", "labels=array:int64[N]"]) as source:
        assert [spec.name for spec in source.fields] == ["boxes", "labels"]
    with open_source(root, fields=["none"]) as source:
        assert source.fields == ()
    with pytest.raises(pf.InvalidSourceError, match="no field boxes=array:float64.*its fields: image_id="):
        open_source(root, fields=["boxes=array:float64[N,4]"])


def test_a_split_is_chosen_when_there_are_several(tmp_path):
    root = write_coco(tmp_path / "coco")
    write_coco(root, split="train2017")
    with pytest.raises(pf.InvalidSourceError, match="several splits \\(train2017, val2017\\).*--subdir"):
        open_source(root)
    with open_source(root, subdir="train2017") as source:
        assert "COCO train2017" in source.layout and len(source) == 3


def test_a_detection_set_without_segmentations_has_no_masks(tmp_path):
    data = coco_json()
    for ann in data["annotations"]:
        del ann["segmentation"]
    root = write_coco(tmp_path / "coco", data)
    with open_source(root) as source:
        assert "masks" not in [spec.name for spec in source.fields]
    with pytest.raises(pf.InvalidSourceError, match="image 1, annotation 100: has no segmentation"):
        open_source(root, fields=["masks=image"])


def _edit(data, where, value):
    """``data`` with the item at path ``where`` (keys and indices) set to ``value``."""
    target = data
    for step in where[:-1]:
        target = target[step]
    target[where[-1]] = value
    return data


# (what is wrong, the path in the JSON to change, its new value, what the error says)
HOSTILE = [
    ("not an object", None, [1, 2], "an object with the lists 'images', 'annotations' and 'categories'"),
    ("images not a list", ("images",), {"id": 1}, "an object with the lists"),
    ("box out of the image", ("annotations", 0, "bbox"), [30, 3, 20, 12], "image 1, annotation 100: bbox .* is not "
                                                                           "inside the image's 40 x 30"),
    ("box with NaN", ("annotations", 0, "bbox"), [float("nan"), 3, 2, 2], "image 1, annotation 100: bbox is"),
    ("negative box size", ("annotations", 0, "bbox"), [5, 3, -2, 2], "annotation 100: bbox .* not inside"),
    ("polygon with NaN", ("annotations", 0, "segmentation"), [[2, 3, float("nan"), 3, 12, 15]],
     "image 1, annotation 100: segmentation: a polygon's coordinates are finite"),
    ("odd polygon", ("annotations", 0, "segmentation"), [[2, 3, 12, 3, 12]], "annotation 100: segmentation: a "
                                                                            "polygon is a list"),
    ("file_name with ..", ("images", 0, "file_name"), "../c.png", "image 7: file_name '../c.png' is no relative path"),
    ("absolute file_name", ("images", 0, "file_name"), "/etc/passwd", "image 7: file_name '/etc/passwd' is no"),
    ("category not listed", ("annotations", 1, "category_id"), 5, "image 1, annotation 101: category_id 5 is no "
                                                                  "category"),
    ("unknown image", ("annotations", 2, "image_id"), 9, "image 9, annotation 102: its image_id is no image"),
    ("string image id", ("images", 1, "id"), "2", "an image is an object with an integer 'id'"),
    ("bool iscrowd", ("annotations", 0, "iscrowd"), True, "annotation 100: iscrowd is 0 or 1"),
    ("negative area", ("annotations", 0, "area"), -1, "annotation 100: area is a finite number"),
    ("huge size", ("images", 0, "width"), 1 << 40, "image 7: width and height are integers"),
    ("category named twice", ("categories", 1, "name"), "dog", "come more than once"),
]


@pytest.mark.parametrize("what,where,value,says", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_wrong_annotation_file_is_a_named_error(tmp_path, what, where, value, says):
    data = coco_json()
    root = write_coco(tmp_path / "coco", data)
    data = value if where is None else _edit(data, where, value)
    json_path = os.path.join(root, "annotations", "instances_val2017.json")
    with open(json_path, "w") as file:
        json.dump(data, file)
    with pytest.raises(pf.InvalidSourceError, match=says) as caught:
        pf.convert(root, tmp_path / "out.zip", quiet=True, workers=1)
    assert json_path in str(caught.value)


def test_a_bad_image_is_left_out_with_on_error_skip(tmp_path):
    data = _edit(coco_json(), ("annotations", 0, "bbox"), [30, 3, 20, 12])
    root = write_coco(tmp_path / "coco", data)
    with open_source(root, on_error="skip") as source:
        assert [source.key(i) for i in range(len(source))] == ["sub/b.png", "c.png"]
        assert "annotation 100" in source.failed[0]


@pytest.mark.parametrize("counts,says", [
    ([0, 5, 3], "sum to 8, not the image's 30 x 40 = 1200"),
    ("0P", "ends inside a count"),
    ("0 ", "no count character"),
    ([5, -1, 1196], "never negative"),
])
def test_a_wrong_rle_is_a_named_error_when_converting(tmp_path, counts, says):
    data = _edit(coco_json(), ("annotations", 1, "segmentation", "counts"), counts)
    root = write_coco(tmp_path / "coco", data)
    with pytest.raises(pf.PackedFormatError, match=f"image 1, annotation 101: segmentation: .*{says}") as caught:
        pf.convert(root, tmp_path / "out.zip", quiet=True, workers=1)
    assert "instances_val2017.json" in str(caught.value)


def test_an_rle_of_another_size_than_its_image_is_refused():
    with pytest.raises(MaskError, match="size \\[4, 4\\] is not the image's \\[4, 5\\]"):
        rle_mask({"size": [4, 4], "counts": [16]}, 4, 5)
    with pytest.raises(MaskError, match="too long"):
        compressed_counts("o" * 100 + "0")


def test_an_image_of_another_size_than_the_file_says_is_refused(tmp_path):
    root = write_coco(tmp_path / "coco")
    Image.fromarray(np.zeros((31, 40, 3), np.uint8)).save(os.path.join(root, "val2017", "a.png"))
    with pytest.raises(pf.PackedFormatError, match="image 1 is 40 x 31 pixels, but the annotation file says 40 x 30"):
        pf.convert(root, tmp_path / "out.zip", quiet=True, workers=1)


def test_a_missing_image_file_is_named(tmp_path):
    root = write_coco(tmp_path / "coco")
    os.remove(os.path.join(root, "val2017", "sub", "b.png"))
    with pytest.raises(pf.InvalidSourceError, match="image 2: its file 'sub/b.png' is not in"):
        open_source(root)


def test_an_image_of_over_255_instances_has_16_bit_masks(tmp_path):
    data = coco_json()
    data["annotations"] = [{"id": 1000 + k, "image_id": 7, "category_id": 1, "bbox": [k % 16, k // 16, 1, 1],
                            "area": 1.0, "segmentation": {"size": [16, 16], "counts": [k, 1, 255 - k]}}
                           for k in range(256)]
    root = write_coco(tmp_path / "coco", data)
    with open_source(root) as source:
        masks = source.load_fields(2)["masks"]
    assert masks.dtype == np.uint16 and masks.T.ravel().tolist() == list(range(1, 257))



def test_where_instances_overlap_the_smaller_is_kept_in_either_order():
    from packed_formats.sources.coco_masks import instance_map

    big, small = block(8, 8, 0, 0, 8, 8), block(8, 8, 2, 2, 4, 4)
    for masks, small_value in (([big, small], 2), ([small, big], 1)):
        out = instance_map(masks, 8, 8, np.uint8)
        assert (out == small_value).sum() == 4 and (out == 3 - small_value).sum() == 60

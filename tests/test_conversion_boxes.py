"""Boxes through a conversion's resize: ``--boxes NAME=FORMAT`` says which array field holds boxes, and a
resize (``--size``, both modes) moves, scales and clamps them exactly as it takes the image; the mask beside
them, resized with nearest-neighbour sampling, still lies inside its moved box.  Boxes that are not declared so
are refused by name, never left where the resized image no longer has them."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

import packed_formats as pf

from .test_fields import npy, png

HEIGHT, WIDTH = 40, 60
# XYXY in the source's pixels: one inside, one reaching the right edge (a centre crop cuts it), one outside it
BOXES = np.array([[10, 5, 30, 25], [50, 0, 60, 40], [0, 30, 4, 40]], np.float32)


def write_detection_shard(path, fmt: str = "XYXY", dtype=np.float32, count: int = 3) -> str:
    """A webdataset shard whose samples hold an image, a mask drawn exactly under each box, and the boxes."""
    with tarfile.open(path, "w") as tar:
        for i in range(count):
            image = np.full((HEIGHT, WIDTH, 3), 40 * i, np.uint8)
            mask = np.zeros((HEIGHT, WIDTH), np.uint8)
            for k, (x0, y0, x1, y1) in enumerate(BOXES.astype(int)):
                mask[y0:y1, x0:x1] = k + 1
            boxes = BOXES.copy()
            if fmt == "XYWH":
                boxes[:, 2:] -= boxes[:, :2]
            members = {"png": png(image), "cls": str(i % 2).encode(), "seg.png": png(mask),
                       "boxes.npy": npy(boxes.astype(dtype)), "labels.npy": npy(np.arange(3, dtype=np.int64))}
            for extension, data in members.items():
                info = tarfile.TarInfo(f"s{i:04d}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def expected_xyxy(size, resize_mode) -> np.ndarray:
    """BOXES after the resize, worked out here by hand: the kept region of the source, scaled to ``size``."""
    height, width = size
    if resize_mode == "stretch":
        left, top, kept_w, kept_h = 0.0, 0.0, WIDTH, HEIGHT
    else:  # the shorter side fitted, the longer cropped in the middle
        scale = max(width / WIDTH, height / HEIGHT)
        kept_w, kept_h = width / scale, height / scale
        left, top = (WIDTH - kept_w) / 2, (HEIGHT - kept_h) / 2
    moved = (BOXES - [left, top, left, top]) * [width / kept_w, height / kept_h, width / kept_w, height / kept_h]
    return np.clip(moved, 0, [width, height, width, height]).astype(np.float32)


@pytest.mark.parametrize("mode", ["raw", "encoded"])
@pytest.mark.parametrize("resize_mode,size", [("stretch", (20, 30)), ("shorter-side-center-crop", (20, 20)),
                                              ("shorter-side-center-crop", (30, 15))])
def test_a_resize_moves_declared_boxes_as_it_takes_the_image_and_the_mask(tmp_path, mode, resize_mode, size):
    shard = write_detection_shard(tmp_path / "shard-000.tar")
    out = tmp_path / "out.zip"
    pf.convert(shard, out, fields=["seg=image", "boxes=array:float32[N,4]"], boxes={"boxes": "XYXY"}, mode=mode,
               size=size, resize_mode=resize_mode, quiet=True, workers=1)
    want = expected_xyxy(size, resize_mode)
    with pf.open_archive(out) as reader:
        for i in range(3):
            got = reader.read_field(i, "boxes")
            assert got.dtype == np.float32 and got.shape == (3, 4)
            np.testing.assert_allclose(got, want, atol=1e-4)
            mask = np.asarray(Image.open(io.BytesIO(reader.read_field(i, "seg"))))
            assert mask.shape == size
            for k, (x0, y0, x1, y1) in enumerate(got):  # the mask's block lies inside its moved box
                rows, cols = np.nonzero(mask == k + 1)
                if len(rows):
                    assert x0 - 1 <= cols.min() and cols.max() + 1 <= x1 + 1, (k, cols.min(), cols.max(), x0, x1)
                    assert y0 - 1 <= rows.min() and rows.max() + 1 <= y1 + 1, (k, rows.min(), rows.max(), y0, y1)
                else:  # cropped away: its box has no area left
                    assert x1 - x0 < 1 or y1 - y0 < 1


def test_boxes_keep_their_format_and_integer_dtype(tmp_path):
    shard = write_detection_shard(tmp_path / "shard-000.tar", fmt="XYWH", dtype=np.int32)
    out = tmp_path / "out.lmdb"
    pf.convert(shard, out, fields=["boxes=array:int32[N,4]"], boxes=["boxes=xywh"], mode="raw", size=(20, 30),
               quiet=True, workers=1)
    xyxy = expected_xyxy((20, 30), "stretch")
    xywh = np.concatenate([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], axis=1)
    with pf.open_archive(out) as reader:
        got = reader.read_field(0, "boxes")
        assert got.dtype == np.int32 and np.array_equal(got, np.rint(xywh).astype(np.int32))


def test_boxes_that_cannot_follow_are_refused_by_name(tmp_path):
    shard = write_detection_shard(tmp_path / "shard-000.tar")
    fields = ["seg=image", "boxes=array:float32[N,4]"]
    with pytest.raises(ValueError, match="array field boxes=array:float32\\[N,4\\].*--boxes NAME=XYXY"):
        pf.convert(shard, tmp_path / "a.zip", fields=fields, mode="raw", size=20, quiet=True)
    with pytest.raises(ValueError, match="array field labels=array:int64\\[N\\].*--unscaled NAME"):
        pf.convert(shard, tmp_path / "a.zip", fields=fields + ["labels=array:int64[N]"], boxes=["boxes=XYXY"],
                   mode="raw", size=20, quiet=True)
    with pytest.raises(ValueError, match="unscaled 'boxes' must be an array field that is not boxes \\(boxes too"):
        pf.convert(shard, tmp_path / "a.zip", fields=fields, boxes=["boxes=XYXY"], unscaled=["boxes"], mode="raw",
                   size=20, quiet=True)
    with pytest.raises(ValueError, match="unscaled 'seg' must be an array field that is not boxes \\(seg=image"):
        pf.convert(shard, tmp_path / "a.zip", fields=fields, unscaled=["seg"], mode="raw", size=20, quiet=True)
    with pytest.raises(ValueError, match="boxes 'seg' must be an array field of \\[N,4\\] or \\[4\\] \\(seg=image"):
        pf.convert(shard, tmp_path / "a.zip", fields=fields, boxes={"seg": "XYXY"}, mode="raw", size=20, quiet=True)
    with pytest.raises(ValueError, match="boxes 'nothing' must be an array field .*no such field"):
        pf.convert(shard, tmp_path / "a.zip", fields=fields, boxes=["nothing=XYXY"], mode="raw", size=20, quiet=True)
    with pytest.raises(ValueError, match="FORMAT one of XYXY, XYWH, CXCYWH .*got boxes=corners"):
        pf.convert(shard, tmp_path / "a.zip", fields=fields, boxes=["boxes=corners"], mode="raw", size=20, quiet=True)
    pf.convert(shard, tmp_path / "kept.zip", fields=fields, boxes=["boxes=XYXY"], quiet=True)  # no resize: as they are
    with pf.open_archive(tmp_path / "kept.zip") as reader:
        assert np.array_equal(reader.read_field(0, "boxes"), BOXES)


def test_the_command_line_moves_boxes_with_a_sets_resize(tmp_path):
    shard = write_detection_shard(tmp_path / "shard-000.tar", count=5)
    out = tmp_path / "set.memmap"
    done = subprocess.run([sys.executable, "-m", "packed_formats", "convert", shard, str(out), "--field",
                           "boxes=array:float32[N,4]", "--field", "labels=array:int64[N]", "--boxes", "boxes=XYXY",
                           "--unscaled", "labels", "--mode", "raw", "--size", "20x20",
                           "--resize-mode", "shorter-side-center-crop", "--shard-size", "2", "--quiet"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with pf.open_archive(out) as reader:
        assert reader.format_name == "sharded" and len(reader) == 5
        np.testing.assert_allclose(reader.read_field(4, "boxes"), expected_xyxy((20, 20), "shorter-side-center-crop"),
                                   atol=1e-4)
        assert np.array_equal(reader.read_field(4, "labels"), np.arange(3))  # per-box labels kept as they are
    bad = subprocess.run([sys.executable, "-m", "packed_formats", "convert", shard, str(tmp_path / "b.zip"),
                          "--field", "boxes=array:float32[N,4]", "--mode", "raw", "--size", "20"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--boxes NAME=XYXY" in bad.stderr and "Traceback" not in bad.stderr

"""The segmentation benchmark runs, and its reference and ours see the same set cut alike."""

from __future__ import annotations

import json

import numpy as np
import torch

from packed_formats.bench import segmentation


def test_the_segmentation_benchmark_writes_every_target_with_its_ratio(tmp_path, capsys):
    out = tmp_path / "seg.json"
    assert segmentation.main(["--images", "12", "--epochs", "1", "--batch-size", "4", "--workers", "2",
                              "--size", "32", "--raw-size", "40", "--sizes", "48-64", "--dir", str(tmp_path),
                              "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    names = list(result["results"])
    assert names[0] == segmentation.REFERENCE and len(names) == 3
    for name in names[1:]:
        ratio = result["results"][name]["ratio"]
        assert ratio > 0 and result["results"][name]["goal_met"] == (ratio >= result["goal"])
    assert result["set"]["images"] == 12
    printed = capsys.readouterr().out
    assert "the reference (goal 2x:" in printed and printed.count("images/s") == 1


def test_the_references_items_are_the_image_and_its_mask_cut_alike(tmp_path):
    root = tmp_path / "set"
    segmentation.make_segmentation_folder(str(root), 4, sizes=(40, 56))
    dataset = segmentation.FilesWithMasks(str(root), segmentation.transform(24))
    assert len(dataset) == 4
    for i in range(4):
        image, mask = dataset[i]
        assert image.shape == (3, 24, 24) and mask.shape == (24, 24) and mask.dtype == torch.uint8
        assert int(mask.max()) <= 4 and np.unique(mask.numpy()).size <= 5  # classes, never blended

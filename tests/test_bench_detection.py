"""The detection and segmentation references' benchmark runs, and its three ways see the same samples."""

from __future__ import annotations

import json

import pytest
import torch

from packed_formats.bench import detection


def test_the_references_benchmark_writes_each_pipeline_three_ways_with_ratios(tmp_path, capsys):
    out = tmp_path / "det.json"
    assert detection.main(["--images", "6", "--sizes", "40-72", "--rounds", "1", "--batch-size", "2",
                           "--workers", "0", "--scale", "0.05", "--pipelines", "detection-train,segmentation-eval",
                           "--dir", str(tmp_path), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["results"]) == ["detection-train", "segmentation-eval"] and result["set"]["images"] == 6
    for ways in result["results"].values():
        assert list(ways) == [detection.FILES, detection.DATASET, detection.LOADER]
        assert ways[detection.FILES]["ratio"] == 1.0 and all(way["median"] > 0 for way in ways.values())
    assert capsys.readouterr().out.count("(1.00x)") == 2
    with pytest.raises(SystemExit):
        detection.main(["--pipelines", "classification"])


def test_the_files_and_the_archive_give_the_same_evaluation_batches(tmp_path):
    import packed_formats as pf

    made = detection.make_reference_sets(str(tmp_path), 4, sizes=(40, 72))
    archive = str(tmp_path / "coco.zip")
    pf.convert(made["coco"], archive, mode="encoded", quiet=True, workers=1)
    sets = {"coco_root": made["coco"], "coco": archive}
    ways = detection.loaders("detection-eval", sets, workers=0, batch_size=2, scale=1.0)
    files, packed, ours = (list(loader) for loader, _ in ways.values())
    for (images, targets), (p_images, p_targets), batch in zip(files, packed, ours):
        for k, target in enumerate(targets):
            assert torch.equal(images[k], p_images[k]) and torch.equal(images[k], batch["image"][k])
            for got in (p_targets[k]["boxes"], batch["boxes"][k]):
                assert torch.equal(got.as_subclass(torch.Tensor), target["boxes"])
            assert target["image_id"] == p_targets[k]["image_id"] == int(batch["image_id"][k])

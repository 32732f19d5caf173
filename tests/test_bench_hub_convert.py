"""The parquet-against-folder conversion benchmark runs, and converts the same images both ways."""

from __future__ import annotations

import json

import pytest

from packed_formats.bench import hub_convert

from .test_sources import contents

pytest.importorskip("pyarrow")


@pytest.mark.slow
def test_the_hub_conversion_benchmark_reports_each_modes_ratio(tmp_path, capsys):
    out = tmp_path / "hub.json"
    assert hub_convert.main(["--images", "8", "--sizes", "40-60", "--runs", "1", "--size", "32",
                             "--rows-per-group", "3", "--dir", str(tmp_path), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["results"]) == ["encoded 32x32", "raw 32x32"]
    for found in result["results"].values():
        assert len(found["folder"]) == len(found["parquet"]) == 1
        assert found["ratio"] > 0 and found["cpu_ratio"] > 0 and found["goal_met"] == (found["ratio"] >= 0.9)
    assert result["set"]["images"] == 8 and result["set"]["rows_per_group"] == 3
    printed = capsys.readouterr().out
    assert printed.count("goal 0.9x:") == 2


def test_the_parquet_shards_hold_the_folders_images(tmp_path):
    made = hub_convert.make_sets(str(tmp_path), 8, (40, 60), 3)
    folder, hub = tmp_path / "folder.zip", tmp_path / "hub.zip"
    import packed_formats as pf

    pf.convert(made["folder"], folder, workers=1, quiet=True)
    pf.convert(made["hub"], hub, workers=1, quiet=True)
    ours, theirs = contents(hub), contents(folder)
    assert ours[1:] == theirs[1:]  # labels, classes and bytes; the keys are row numbers

"""The FFCV comparison's harness (packed_formats/bench/ffcv_peer.py), run where FFCV is not installed."""

import json

import pytest
import torch

from packed_formats.bench import ffcv_peer

without_ffcv_here = pytest.mark.skipif(ffcv_peer.ffcv_status()["installed"], reason="FFCV is installed here")


@pytest.fixture(scope="module")
def without_ffcv(tmp_path_factory):
    """One small run of the command line: (exit status, JSON report, table)."""
    out = tmp_path_factory.mktemp("ffcv")
    status = ffcv_peer.main([
        "--work", str(out / "data"), "--count", "8", "--sizes", "48", "80", "--raw-size", "40", "--size", "32",
        "--batch-size", "4", "--workers", "0", "--rounds", "1", "--cells", "jpeg-rrc-flip-uint8",
        "jpeg-center-float", "raw-none", "--json", str(out / "r.json"), "--table", str(out / "r.txt")])
    return status, json.loads((out / "r.json").read_text()), (out / "r.txt").read_text()


@without_ffcv_here
def test_without_ffcv_the_run_fails_and_says_how_to_install_it(without_ffcv):
    status, report, table = without_ffcv
    assert status == 1
    assert report["ffcv"]["installed"] is False and "No module named 'ffcv'" in report["ffcv"]["error"]
    assert "FFCV not installed" in table and "tools/bench_ffcv.sh" in table


@without_ffcv_here
def test_without_ffcv_ours_is_still_measured_in_every_cell_and_layout(without_ffcv):
    _, report, _ = without_ffcv
    measured = {(c["cell"], c["layout"]): c for c in report["cells"]}
    assert set(measured) == {(cell, layout) for cell in ("jpeg-rrc-flip-uint8", "jpeg-center-float", "raw-none")
                             for layout in ffcv_peer.LAYOUTS}
    for entry in measured.values():
        assert entry["packed_formats"]["images"] == 8 and entry["packed_formats"]["images_per_s"] > 0
        assert "ffcv" not in entry and entry["ours_over_ffcv"] is None


@without_ffcv_here
def test_each_cell_gives_the_batches_it_names(without_ffcv):
    _, report, _ = without_ffcv
    batches = {c["cell"]: (c["packed_formats"]["dtype"], c["packed_formats"]["shape"]) for c in report["cells"]}
    assert batches == {"jpeg-rrc-flip-uint8": ("uint8", [4, 3, 32, 32]),
                       "jpeg-center-float": ("float32", [4, 3, 32, 32]),
                       "raw-none": ("uint8", [4, 3, 40, 40])}


def test_a_loader_whose_batches_are_not_in_the_cells_layout_is_refused():
    contiguous = [(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2))]
    assert ffcv_peer.warm_up(contiguous, "loader", "nchw") == {"shape": [2, 3, 4, 4], "dtype": "uint8"}
    with pytest.raises(RuntimeError, match="not channels_last"):
        ffcv_peer.warm_up(contiguous, "loader", "channels_last")


def test_the_table_gives_ours_over_ffcv_per_cell():
    report = {"config": {"count": 10, "batch_size": 2, "workers": 2, "rounds": 3}, "cpus": 2, "torch": "2.14.1",
              "ffcv": {"installed": True, "version": "1.0.2", "install": ffcv_peer.INSTALL},
              "cells": [{"cell": "raw-none", "layout": "nchw", "packed_formats": {"images_per_s": 300.0},
                         "ffcv": {"images_per_s": 200.0}, "ours_over_ffcv": 1.5}]}
    row = ffcv_peer.format_table(report).splitlines()[5].split()
    assert row == ["raw-none", "nchw", "300", "200", "1.50x"]

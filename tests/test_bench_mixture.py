"""The mixture benchmark's own logic, tiny (``packed_formats/bench/mixture.py``; the peers are not run here)."""

from __future__ import annotations

import math

import pytest

from packed_formats.bench.mixture import format_table, harmonic_mean, run


def test_the_harmonic_mean_is_the_speed_of_reading_each_share_at_its_sources_speed():
    assert harmonic_mean([100.0, 100.0], [0.7, 0.3]) == pytest.approx(100.0)
    # 70 images at 100/s and 30 at 300/s: 100 images in 0.8 s
    assert harmonic_mean([100.0, 300.0], [7, 3]) == pytest.approx(125.0)


def test_a_tiny_run_reports_proportions_within_binomial_tolerance_and_each_contenders_speed(tmp_path):
    report = run(str(tmp_path), count=24, side=16, batch_size=4, workers=0, weight=0.75, rounds=1,
                 modes=("raw",), peers=(), say=lambda _: None)
    shares = report["proportions"]
    assert shares["epoch_share"] == pytest.approx([0.75, 0.25], abs=1e-9)  # the epoch's shares are exact
    assert shares["batches"] > 0 and shares["max_z"] < 3 * math.sqrt(math.log(shares["batches"]) + 1)
    assert shares["per_source_batch_share"] == pytest.approx([0.75, 0.25], abs=0.1)
    raw = report["modes"]["raw"]
    assert set(raw["median"]) == {"source a", "source b", "mixture", "per-source"} and min(raw["median"].values()) > 0
    assert raw["mixture_over_harmonic_mean"] > 0 and raw["per_source_over_harmonic_mean"] > 0
    assert not raw["peers_over_ours"]
    assert "weighted harmonic mean" in format_table(report)

"""The conversion comparison's harness (packed_formats/bench/convert_peers.py): what it records, never a speed."""

import json
import math
import statistics

import pytest

from packed_formats.bench import convert_peers

pytestmark = pytest.mark.slow  # conversions at 2 worker processes, each contender, two rounds

COUNT, ROUNDS = 8, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One small run of the command line: (exit status, JSON report)."""
    out = tmp_path_factory.mktemp("convert-peers")
    status = convert_peers.main(["--work", str(out / "work"), "--count", str(COUNT), "--side", "32",
                                 "--rounds", str(ROUNDS), "--json", str(out / "r.json")])
    return status, json.loads((out / "r.json").read_text())


def assert_consistent(entry, against):
    """Each ratio is the peer's seconds over ours in the same round; median and spread are of those."""
    seconds = entry["seconds"]
    assert len(seconds["ours"]) == len(seconds[against]) == ROUNDS
    ratio = entry["ratios"][against]
    assert ratio["rounds"] == pytest.approx([t / o for t, o in zip(seconds[against], seconds["ours"])])
    assert ratio["min"] <= ratio["median"] <= ratio["max"]
    assert all(math.isfinite(r) and r > 0 for r in ratio["rounds"])
    for name in ("ours", against):
        assert entry["samples_per_s"][name] == pytest.approx(COUNT / statistics.median(seconds[name]))


def test_imagefolder_is_timed_against_our_own_conversion_of_its_folder(run):
    status, report = run
    assert report["count"] == COUNT and report["rounds"] == ROUNDS and report["workers"] == 2
    assert set(report["cells"]) == set(convert_peers.CELL_NAMES)
    assert_consistent(report["cells"]["imagefolder-vs-folder"], "folder")
    absent = [name for name, peer in report["peers"].items() if not peer["installed"]]
    assert status == (1 if absent else 0)


@pytest.mark.parametrize("peer", convert_peers.PEERS)
def test_each_peer_is_timed_beside_ours_in_every_cell(run, peer):
    _, report = run
    found = report["peers"][peer]
    if not found["installed"]:
        pytest.skip(f"{peer} is not installed here ({found['error']}): {found['install']}")
    timed = [(cell.name, name) for cell in convert_peers.CELLS for name in cell.against
             if name.partition("-")[0] == peer]
    assert timed
    for cell, name in timed:
        assert_consistent(report["cells"][cell], name)


def test_a_contender_that_writes_fewer_samples_is_never_reported(tmp_path, monkeypatch):
    monkeypatch.setitem(convert_peers.CONTENDERS, "short", lambda source, out, mode, quality: len(source) - 1)
    with pytest.raises(RuntimeError, match="short wrote 2 samples of 3"):
        convert_peers.time_once("short", [1, 2, 3], str(tmp_path), "raw", 90, 3)

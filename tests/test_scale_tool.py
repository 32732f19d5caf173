"""``packed-formats bench --scale N``: what it measures, that every column is there and plausible, and its options."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys

import pytest
import torch

import packed_formats as pf
from packed_formats.bench import scale
from packed_formats.cli import main

from .conftest import once_per_run

N = 2000
WORKERS = 1  # the end-to-end runs start many fresh interpreters: one spawned worker each keeps them affordable
MIB = 2**20
END_TO_END = ("zip", "lmdb")  # each end-to-end format starts about eight fresh interpreters


def run_cli(*args, timeout=900):
    """``python -m packed_formats bench ARGS`` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "packed_formats", "bench", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def index_bytes_of(path):
    with pf.open_archive(path) as reader:
        return sum(a.nbytes for a in reader.index.arrays().values())


# ---- the measuring pieces, in this process -------------------------------------------------------------
@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_write_and_open_probes_report_the_archive_they_made(tmp_path, fmt):
    path = str(tmp_path / f"a.{fmt}")
    written = scale.probe_write({"format": fmt, "path": path, "count": 300, "shape": [4, 4, 3], "shards": None})
    opened = scale.probe_open({"path": path})
    assert written["seconds"] > 0 and written["peak_rss_bytes"] >= written["baseline_rss_bytes"] > 0
    assert opened["count"] == 300 and opened["seconds"] >= opened["open_s"] > 0
    assert opened["index_bytes"] == index_bytes_of(path)
    with pf.open_archive(path) as reader:
        assert reader.manifest.mode == "raw" and reader.manifest.shape == (4, 4, 3)
        assert reader.key(7) == "class7/img_00000007.png" and int(reader.labels[13]) == 3


def test_a_sharded_write_makes_the_parts_asked_for(tmp_path):
    path = str(tmp_path / "set.zip")
    scale.probe_write({"format": "zip", "path": path, "count": 100, "shape": [4, 4, 3], "shards": 3})
    with pf.open_archive(path) as reader:
        assert len(reader) == 100 and len(reader.files()) == 1 + 3 and len(reader.classes) == 10


def test_the_classes_asked_for_label_the_samples_and_fill_every_manifest(tmp_path):
    path = str(tmp_path / "set.zip")
    scale.probe_write({"format": "zip", "path": path, "count": 600, "shape": [4, 4, 3], "shards": 3, "classes": 500})
    with pf.open_archive(path) as reader:
        assert reader.classes == [f"class{k}" for k in range(500)]
        assert [part.manifest.classes for part in reader.backend.parts] == [tuple(reader.classes)] * 3
        assert int(reader.labels[503]) == 3 and reader.key(499) == "class499/img_00000499.png"


def test_the_peak_restarts_where_the_process_stands():
    assert scale.reset_peak()
    before = scale.status_bytes("VmRSS")
    # A fresh anonymous mapping with every page written: memory from the heap could already be resident (a
    # long-lived test process frees large blocks into it) and then raises neither RSS nor the peak.
    block = mmap.mmap(-1, 64 * MIB)
    for offset in range(0, 64 * MIB, mmap.PAGESIZE):
        block[offset] = 1
    assert scale.status_bytes("VmHWM") - before >= 60 * MIB
    block.close()
    assert scale.reset_peak() and scale.status_bytes("VmHWM") - scale.status_bytes("VmRSS") < 60 * MIB


def test_dataloader_workers_are_found_and_measured(tmp_path):
    path = str(tmp_path / "a.memmap")
    scale.probe_write({"format": "memmap", "path": path, "count": 256, "shape": [4, 4, 3], "shards": None})
    before = set(scale.worker_pids(os.getpid()))
    loader = torch.utils.data.DataLoader(pf.PackedDataset(path, output="tensor"), batch_size=16, num_workers=2,
                                         multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)
    workers = set(scale.worker_pids(os.getpid())) - before
    assert len(workers) == 2
    for pid in workers:
        assert scale.private_bytes(pid) > 0 and scale.open_fds(pid) > 0
    del batches
    assert scale.open_fds(os.getpid()) > 0


# ---- the options -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, says", [
    ([], "--scale N"),
    (["--scale", "100", "some.zip"], "no paths"),
    (["--scale", "100", "--workers", "1,2"], "one worker count"),
    (["--scale", "100", "--workers", "0"], "at least 1"),
    (["--scale", "10", "--shards", "11"], "--shards"),
    (["--scale", "10", "--dir", "/no/such/dir"], "no such directory"),
    (["--scale", "10", "--plot", "p.png"], "--plot"),
    (["some.zip", "--keep"], "only apply with --scale"),
    (["some.zip", "--classes", "5"], "only apply with --scale"),
])
def test_bad_scale_options_are_one_line_errors(capsys, args, says):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


@pytest.mark.parametrize("args", [["--scale", "0"], ["--scale", "many"], ["--scale", "9", "--formats", "tar"]])
def test_bad_scale_values_are_refused_by_the_parser(capsys, args):
    with pytest.raises(SystemExit) as exit:
        main(["bench", *args])
    assert exit.value.code == 2 and "error" in capsys.readouterr().err


# ---- the tool end to end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def every_format(tmp_path_factory):
    """One `bench --scale N --json --keep` over every packed format: (results, the --dir given); one a run,
    whichever xdist worker asks first (it takes 45 s)."""

    def make():
        where = tmp_path_factory.mktemp("scale")
        # two formats: the in-process probes above cover each format; this covers the tool end to end
        done = run_cli("--scale", N, "--formats", ",".join(END_TO_END), "--json", "--keep", "--dir", where,
                       "--workers", WORKERS)
        assert done.returncode in (0, 1), done.stderr[-3000:]
        results = json.loads(done.stdout)
        assert done.returncode == 0, [row["errors"] for row in results["rows"]]
        return results, str(where)

    return tuple(once_per_run(tmp_path_factory, "scale-tool", make))


@pytest.mark.slow
def test_there_is_a_row_without_errors_for_every_format_asked_for(every_format):
    results, _ = every_format
    assert [row["format"] for row in results["rows"]] == list(END_TO_END)
    assert all(row["errors"] == [] and row["count"] == N and row["parts"] == 1 for row in results["rows"])


@pytest.mark.slow
def test_write_and_open_columns_are_plausible(every_format):
    results, _ = every_format
    for row in results["rows"]:
        write, opened = row["write"], row["open"]
        assert write["seconds"] > 0 and write["peak_rss_bytes"] >= write["baseline_rss_bytes"] > 0
        assert write["peak_growth_bytes"] >= 0
        assert opened["seconds"] > 0 and opened["count"] == N
        assert opened["rss_growth_bytes"] >= 0 and opened["peak_growth_bytes"] >= 0


@pytest.mark.slow
def test_index_bytes_are_what_the_archive_index_holds(every_format):
    results, where = every_format
    for row in results["rows"]:
        assert row["path"].startswith(where) and os.path.exists(row["path"])  # --keep kept it
        assert row["index_bytes"] == index_bytes_of(row["path"]) > N  # labels alone take 8 bytes a sample


@pytest.mark.slow
def test_every_loader_and_start_method_reports_first_batch_and_worker_memory(every_format):
    results, _ = every_format
    for row in results["rows"]:
        for loader in scale.LOADERS:
            for method in ("fork", "spawn"):
                measured = row["loaders"][loader][method]
                assert measured["first_batch_s"] > 0
                assert len(measured["worker_private_bytes"]) == WORKERS
                assert all(b > 0 for b in measured["worker_private_bytes"]), (row["format"], loader, method)


@pytest.mark.slow
def test_a_full_epoch_reads_every_sample_and_counts_descriptors(every_format):
    results, _ = every_format
    for row in results["rows"]:
        full = row["full_read"]
        assert full["samples"] == N and full["epoch_s"] > 0
        assert full["peak_fds_main"] > 0 and len(full["peak_fds_workers"]) == WORKERS
        assert all(n > 0 for n in full["peak_fds_workers"])


@pytest.mark.slow
def test_the_table_has_a_row_and_every_column_for_every_format(every_format):
    results, _ = every_format
    lines = scale.format_scale_table(results).splitlines()
    header = next(line for line in lines if line.startswith("format"))
    for column in ("DL/fork", "DL/spawn", "ML/fork", "ML/spawn", "main/worker"):
        assert header.count(column) == (1 if column == "main/worker" else 2)
    for fmt in END_TO_END:
        cells = next(line for line in lines if line.startswith(fmt + " ")).split()
        assert len(cells) == len(header.split()) and "-" not in cells


@pytest.mark.slow
def test_shards_write_parts_count_descriptors_and_leave_nothing_behind(tmp_path):
    out = tmp_path / "r.json"
    where = tmp_path / "work"
    where.mkdir()
    done = run_cli("--scale", N, "--formats", "zip,memmap", "--shards", 4, "--workers", 2,
                   "--start-method", "fork", "--dir", where, "--out", out)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    results = json.loads(out.read_text())
    for row in results["rows"]:
        assert row["errors"] == [] and row["parts"] == 4
        assert row["open"]["files"] >= 1 + 4  # the index and every part's file(s)
        assert row["full_read"]["samples"] == N and row["full_read"]["peak_fds_main"] > 0
        assert len(row["full_read"]["peak_fds_workers"]) == 2 and min(row["full_read"]["peak_fds_workers"]) > 0
    assert os.listdir(where) == []  # without --keep, nothing stays
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("zip ", "memmap "))]
    assert [r[0] for r in rows] == ["zip", "memmap"] and all(r[2] == "4" for r in rows)

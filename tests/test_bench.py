"""The benchmark harness: its JSON report, plot, cold-cache eviction, reference points and baselines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from PIL import Image

import packed_formats as pf
from packed_formats import native
from packed_formats.bench import BenchConfig, format_table, run_benchmark
from packed_formats.bench.environment import archive_paths, filesystem_type
from packed_formats.bench.measure import MemorySampler, time_epoch
from packed_formats.bench.pagecache import evict, resident_bytes, warm
from packed_formats.bench.references import bare_decode_rate, copy_bound_rate
from packed_formats.bench.report import CHANNELS_PARTED_BY, add_ratios, rate
from packed_formats.bench.runner import DEVICE_DECODE, build_loader, describe_target
from packed_formats.bench.tensordict_memmap import TutorialMemmapData, TutorialRandomCrop, TutorialRandomHFlip
from packed_formats.cli import main

from .conftest import RAW_SHAPE

WORKERS = (0, 1)
EPOCHS = 2
SMALL = ["--batch-size", "8", "--epochs", str(EPOCHS), "--warmup", "1", "--size", "16",
         "--start-method", "fork", "--reference-seconds", "0.2"]
TARGET_KINDS = [("folder", "encoded"), ("memmap", "raw"), ("zip", "raw"), ("hdf5", "encoded"), ("lmdb", "raw")]


@pytest.fixture(scope="module")
def cli_run(archives, tmp_path_factory):
    """One real `packed-formats bench` run in a subprocess over five targets: (results, png path, stdout)."""
    out = tmp_path_factory.mktemp("bench")
    paths = [archives[k] for k in TARGET_KINDS]
    command = [sys.executable, "-m", "packed_formats", "bench", *paths, "--workers", "0,1", *SMALL,
               "--out", str(out / "r.json"), "--plot", str(out / "r.png")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    with open(out / "r.json") as file:
        return json.load(file), out / "r.png", done.stdout


@pytest.mark.slow
def test_json_has_a_run_for_every_target_and_worker_count(cli_run, archives):
    results, _, _ = cli_run
    measured = {(r["path"], r["workers"]) for r in results["runs"] if r["role"] == "target" or
                r["loader"] == "torchvision-imagefolder"}
    expected = {(os.path.abspath(archives[k]), w) for k in TARGET_KINDS for w in WORKERS}
    assert measured == expected


@pytest.mark.slow
def test_every_run_reports_positive_rates_per_epoch(cli_run):
    results, _, _ = cli_run
    for row in results["runs"]:
        assert row["error"] is None, row["error"]
        assert len(row["epochs"]) == EPOCHS
        for epoch in row["epochs"]:
            assert epoch["warmup_batches"] == 1
            assert epoch["timed_images"] > 0 and epoch["images_per_s"] > 0 and epoch["first_batch_s"] > 0
        assert row["images_per_s"]["min"] <= row["images_per_s"]["median"] <= row["images_per_s"]["max"]


@pytest.mark.slow
def test_a_start_method_given_measures_worker_processes(cli_run):
    results, _, _ = cli_run
    for row in results["runs"]:
        if row["loader"] == "make_loader":
            assert row.get("worker_kind") == (None if not row["workers"] else "processes"), row


def test_raw_batches_are_measured_as_make_loader_makes_them_by_default(archives):
    config = BenchConfig(workers=(1,), batch_size=8, epochs=1, warmup=0, references=False, tensordict_baseline=False)
    results = run_benchmark([archives[("memmap", "raw")], archives[("zip", "encoded")]], config, log=lambda _: None)
    kinds = {row["mode"]: row.get("worker_kind") for row in results["runs"]}
    assert kinds == {"raw": "threads", "encoded": "processes"}
    assert " 1 thr " in format_table(results)  # the table marks the threads' rows


@pytest.mark.slow
def test_every_epoch_delivers_the_whole_dataset(cli_run):
    results, _, _ = cli_run
    counts = {t["path"]: t["count"] for t in results["targets"]}
    for row in results["runs"]:
        assert [e["images"] for e in row["epochs"]] == [counts[row["path"]]] * EPOCHS


@pytest.mark.slow
def test_tensordict_baseline_runs_on_the_raw_memmap_archive(cli_run, archives):
    results, _, _ = cli_run
    baseline = [r for r in results["runs"] if r["loader"] == "tensordict-memmap"]
    assert {(r["path"], r["workers"]) for r in baseline} == {(os.path.abspath(archives[("memmap", "raw")]), w)
                                                          for w in WORKERS}


@pytest.mark.slow
def test_references_cover_raw_shapes_and_encoded_process_counts(cli_run):
    results, _, _ = cli_run
    copy = [r for r in results["references"] if r["name"] == "copy-bound"]
    decode = [r for r in results["references"] if r["name"] == "bare-decode"]
    assert [r["shape"] for r in copy] == [list(RAW_SHAPE)]
    assert {r["processes"] for r in decode} == {max(1, w) for w in WORKERS}
    assert all(r["images_per_s"] > 0 for r in results["references"])


@pytest.mark.slow
def test_every_run_has_its_ratio_to_its_limit(cli_run):
    results, _, _ = cli_run
    for row in results["runs"]:
        assert row["ratios"]["vs_limit"] == pytest.approx(rate(row) / row["limit"]["images_per_s"])
        expected = "copy-bound" if row["mode"] == "raw" else "bare-decode"
        assert row["limit"]["name"] == expected


@pytest.mark.slow
def test_raw_archives_get_ratios_to_raw_memmap_and_the_baselines(cli_run):
    results, _, _ = cli_run
    def find(**match):
        return next(r for r in results["runs"] if all(r[k] == v for k, v in match.items()))
    for w in WORKERS:
        row = find(format="zip", mode="raw", workers=w, role="target")
        memmap = find(format="memmap", mode="raw", workers=w, role="target")
        folder = find(loader="torchvision-imagefolder", workers=w)
        tensordict = find(loader="tensordict-memmap", workers=w)
        assert row["ratios"]["vs_raw_memmap"] == pytest.approx(rate(row) / rate(memmap))
        assert row["ratios"]["vs_imagefolder"] == pytest.approx(rate(row) / rate(folder))
        assert row["ratios"]["vs_tensordict"] == pytest.approx(rate(row) / rate(tensordict))


@pytest.mark.slow
def test_report_states_environment_sizes_and_memory(cli_run, archives):
    results, _, _ = cli_run
    env = results["environment"]
    assert env["cpus"]["logical"] >= 1 and env["versions"]["torch"] == torch.__version__
    assert isinstance(env["jpeg"]["pillow_libjpeg_turbo"], bool)
    assert env["channels_parted_by"] == native.planar_copy()  # the figures of raw NCHW batches depend on it
    assert f"channels parted by {CHANNELS_PARTED_BY[native.planar_copy()]}" in format_table(results)
    for target in results["targets"]:
        assert target["size"]["bytes_on_disk"] > 0 and target["size"]["files"] >= 1
        assert target["filesystem"] == filesystem_type(target["path"])
        if target["format"] != "folder":  # the folder target is the size reference
            assert target["size"]["vs_source"] > 0
    for row in results["runs"]:
        assert row["memory"]["peak_main_mib"] > 0
        assert row["memory"]["child_processes_seen"] >= row["workers"]


@pytest.mark.slow
def test_plot_is_a_valid_png(cli_run):
    _, png, _ = cli_run
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


@pytest.mark.slow
def test_terminal_table_lists_every_target(cli_run):
    results, _, stdout = cli_run
    for target in results["targets"]:
        assert target["name"] in stdout
    assert "copy-bound limit" in stdout and "bare decode" in stdout


@pytest.mark.slow
def test_cold_run_attempts_eviction_before_every_epoch(archives):
    config = BenchConfig(workers=[0], batch_size=8, epochs=2, warmup=1, size=16, cold=True,
                         references=False, tensordict_baseline=False, loader="dataset")
    results = run_benchmark([archives[("memmap", "raw")], archives[("folder", "encoded")]], config, log=lambda s: None)
    for row in results["runs"]:
        assert row["error"] is None, row["error"]
        for epoch in row["epochs"]:
            eviction = epoch["eviction"]
            assert eviction["attempted"] and eviction["files"] >= 1 and eviction["advised"] == eviction["files"]
            assert "resident_after" in eviction
    assert "cold (page cache evicted before each epoch)" in format_table(results)


@pytest.mark.slow
def test_val_and_train_pipelines_run_on_every_kind_of_target_and_the_baselines(archives):
    paths = [archives[k] for k in (("folder", "encoded"), ("memmap", "raw"), ("zip", "encoded"), ("lmdb", "raw"))]
    config = BenchConfig(workers=[0], batch_size=8, epochs=1, warmup=1, size=16, pipelines=["val", "train"],
                         references=False, reference_seconds=0.1)
    results = run_benchmark(paths, config, log=lambda s: None)
    runs = {(r["loader"], r["path"], r["pipeline"]) for r in results["runs"] if r["error"] is None}
    for pipeline in ("val", "train"):
        assert ("torchvision-imagefolder", os.path.abspath(paths[0]), pipeline) in runs
        assert ("tensordict-memmap", os.path.abspath(paths[1]), pipeline) in runs
        for path in paths[1:]:
            assert ("make_loader", os.path.abspath(path), pipeline) in runs
    assert all(r["error"] is None for r in results["runs"]), [r["error"] for r in results["runs"]]
    fast = [r for r in results["runs"] if r["loader"] == "make_loader" and r["pipeline"] == "train"]
    assert all(r["ratios"]["vs_imagefolder"] > 0 for r in fast)


def test_warm_run_reads_the_whole_target_into_the_page_cache_first(archives):
    config = BenchConfig(workers=[0], batch_size=8, epochs=1, warmup=1, size=16,
                         references=False, tensordict_baseline=False, loader="dataset")
    results = run_benchmark([archives[("memmap", "raw")], archives[("folder", "encoded")]], config, log=lambda s: None)
    for row in results["runs"]:
        files = archive_paths(row["path"])
        assert row["warmed"]["files"] == len(files)
        assert row["warmed"]["bytes_read"] == sum(os.path.getsize(f) for f in files)


@pytest.mark.parametrize("layout", ["nchw", "channels-last"])
def test_the_layout_of_untransformed_make_loader_batches_is_chosen(archives, layout):
    config = BenchConfig(workers=[0], batch_size=4, size=16, layout=layout)
    target = {"path": archives[("memmap", "raw")], "mode": "raw"}
    images, _ = next(iter(build_loader(target, "make_loader", "none", 0, config)))
    assert images.is_contiguous() == (layout == "nchw")
    assert images.is_contiguous(memory_format=torch.channels_last) == (layout == "channels-last")


def test_an_unknown_layout_is_refused(archives):
    with pytest.raises(SystemExit):
        main(["bench", archives[("memmap", "raw")], "--workers", "0", "--layout", "nhwc"])
    with pytest.raises(ValueError, match="layout"):
        BenchConfig(layout="nhwc").check()


def test_warm_brings_an_evicted_file_back(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(1 << 20))
    if resident_bytes(str(path)) is None or filesystem_type(str(path)) in ("tmpfs", "ramfs"):
        pytest.skip("page-cache residency cannot be measured or evicted here")
    evict(str(path))
    record = warm(str(path))
    assert record["bytes_read"] == 1 << 20 and record["resident_after"] == 1 << 20


def test_evict_drops_a_read_file_from_the_page_cache(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(1 << 20))
    path.read_bytes()
    if resident_bytes(str(path)) is None or filesystem_type(str(path)) in ("tmpfs", "ramfs"):
        pytest.skip("page-cache residency cannot be measured or evicted here")
    record = evict(str(path))
    assert record["evicted"] is True and record["resident_after"] == 0


def test_time_epoch_excludes_warmup_batches_and_counts_delivered_samples():
    batches = [(torch.zeros(n, 3, 2, 2, dtype=torch.uint8), torch.zeros(n)) for n in (8, 8, 5)]
    record = time_epoch(batches, warmup=1)
    assert (record["batches"], record["images"], record["timed_images"]) == (3, 21, 13)
    assert time_epoch(batches, warmup=1, max_batches=2)["images"] == 16


class Prefetching:
    """A loader whose thread makes a batch every ``pace`` seconds, up to ``ahead`` before they are taken
    (as DataLoader's workers or make_loader's threads do)."""

    def __init__(self, batches: int, pace: float, ahead: int = 4) -> None:
        self.batches, self.pace, self.ahead = batches, pace, ahead

    def __iter__(self):
        import queue
        import threading

        ready: "queue.Queue" = queue.Queue(self.ahead)

        def make() -> None:
            for _ in range(self.batches):
                time.sleep(self.pace)
                ready.put((torch.zeros(8, 3, 2, 2, dtype=torch.uint8), torch.zeros(8)))

        threading.Thread(target=make, daemon=True).start()
        for _ in range(self.batches):
            yield ready.get()


def test_what_the_harness_does_in_an_epoch_gives_a_prefetching_loader_no_untimed_batches():
    """The memory sample once ran at the first batch: a loader prefetching meanwhile had its next batches
    ready, untimed (1.8x the rate of threads gathering 8 batches an epoch).  A loader that makes a batch
    every 20 ms cannot be timed faster than that, whatever the harness does between its batches."""
    pace, sampled = 0.02, []
    record = time_epoch(Prefetching(12, pace), warmup=1, after_last_batch=lambda: (time.sleep(0.1),
                                                                                   sampled.append(1)))
    assert sampled == [1] and record["timed_images"] == 11 * 8
    assert record["images_per_s"] <= 1.1 * 8 / pace


def test_copy_bound_rate_gathers_batches_of_the_archive_shape():
    ref = copy_bound_rate(RAW_SHAPE, count=40, batch_size=16, seconds=0.05)
    assert ref["shape"] == list(RAW_SHAPE) and ref["batch_size"] == 16 and ref["images_per_s"] > 0
    # the fastest known way: each way measured, the fastest taken and named
    threads = f"numpy.take in {torch.get_num_threads()} thread(s)"
    assert set(ref["ways"]) == {"torch.index_select", f"{threads}, a share of each batch", f"{threads}, a batch each"}
    assert ref["way"] in ref["ways"] and ref["images_per_s"] == max(ref["ways"].values())
    # into buffers in turn, as a loader whose caller holds a batch; one buffer every batch reported beside it
    assert ref["out_buffers"] == 2 and ref["one_buffer"] > 0


def test_a_raw_run_is_measured_against_the_limit_measured_beside_each_of_its_epochs(archives):
    """The machine is shared: a limit measured before or after a run can meet it in another state (this
    machine's limit moved 45-84k images/s between runs); measured beside each epoch, the two meet alike."""
    path = archives[("memmap", "raw")]
    config = BenchConfig(workers=(0,), batch_size=8, epochs=3, warmup=1, tensordict_baseline=False,
                         reference_seconds=0.1)
    # a child the program had before (a fork server, a pool another part of it left) is not the loader's
    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        results = run_benchmark([path, archives[("zip", "encoded")]], config, log=lambda _: None)
    finally:
        before.kill()
        before.wait()
    raw, encoded = results["runs"]
    assert raw["error"] is None and encoded["error"] is None
    ways = {"torch.index_select", *(f"numpy.take in {torch.get_num_threads()} thread(s), {how}"
                                    for how in ("a share of each batch", "a batch each"))}
    for epoch in raw["epochs"]:  # a span of each way after each epoch
        assert set(epoch["beside"]) == ways and all(r > 0 for r in epoch["beside"].values())
    beside = raw["limit_beside"]
    medians = {way: float(np.median([e["beside"][way] for e in raw["epochs"]])) for way in ways}
    assert beside["spans"] == 3 and beside["images_per_s"] == max(medians.values()) == medians[beside["way"]]
    assert raw["limit"]["beside_epochs"] and raw["ratios"]["vs_limit"] == rate(raw) / beside["images_per_s"]
    assert "beside each epoch" in format_table(results)
    # neither that child nor the limit's own process is counted as the loader's, and the limit's has ended
    assert raw["memory"]["child_processes_seen"] == 0
    assert "limit_beside" not in encoded and all("beside" not in e for e in encoded["epochs"])
    mine = [p for p in psutil.Process().children(recursive=True) if "serve_bound" in " ".join(p.cmdline())]
    assert not mine
    # the reference point measured on its own is still reported
    assert [r["name"] for r in results["references"]][0] == "copy-bound"


def test_bare_decode_rate_runs_in_the_requested_number_of_processes(archives):
    with pf.open_archive(archives[("zip", "encoded")]) as reader:
        blobs = [reader.read_bytes(i) for i in range(4)]
    ref = bare_decode_rate(blobs, processes=2, context="fork", seconds=0.05, size=16)
    assert ref["processes"] == 2 and len(ref["per_process"]) == 2 and min(ref["per_process"]) > 0


def test_tensordict_baseline_dataset_returns_whole_batches_as_stored(archives):
    path = archives[("memmap", "raw")]
    images, targets = TutorialMemmapData(path).__getitems__([5, 0, 5])
    with pf.open_archive(path) as reader:
        expected = reader.read_many([5, 0, 5])
        labels = reader.labels[[5, 0, 5]]
    assert torch.equal(images, torch.from_numpy(expected).permute(0, 3, 1, 2))
    assert targets.tolist() == labels.tolist()


def test_tensordict_baseline_crop_and_flip_keep_whole_windows_per_sample():
    batch = torch.arange(4 * 3 * 10 * 12, dtype=torch.float32).reshape(4, 3, 10, 12)
    cropped = TutorialRandomCrop(6)(batch)
    assert cropped.shape == (4, 3, 6, 6)
    for image, window in zip(batch, cropped):
        top, left = np.argwhere((image[0] == window[0, 0, 0]).numpy())[0]
        assert torch.equal(window, image[:, top : top + 6, left : left + 6])
    flipped = TutorialRandomHFlip()(cropped)
    for before, after in zip(cropped, flipped):
        assert torch.equal(after, before) or torch.equal(after, before.flip(-1))


def test_bad_target_exits_2_naming_the_path(tmp_path, capsys):
    missing = tmp_path / "nope.zip"
    assert main(["bench", str(missing), "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and len(err.strip().splitlines()) == 1


def test_bad_settings_are_refused_before_anything_runs(archives, capsys):
    path = archives[("memmap", "raw")]
    assert main(["bench", path, "--workers", "0", "--epochs", "0"]) == 2
    assert "epochs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", path, "--workers", "two"])


def test_a_device_that_is_not_there_is_refused_in_one_line(archives, capsys):
    path = archives[("memmap", "raw")]
    assert main(["bench", path, "--workers", "0", "--device", "tpu"]) == 2
    assert "device must be cpu or cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", path, "--workers", "0", "--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert "cuda" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_time_epoch_counts_gpu_work_that_is_still_queued_when_a_batch_arrives():
    def batches():
        for _ in range(3):
            images = torch.zeros(4, 3, device="cuda")
            torch.cuda._sleep(200_000_000)  # queued behind the batch: ~0.1 s or more of GPU time
            yield images.add_(1), torch.zeros(4)

    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(200_000_000)
    torch.cuda.synchronize()
    one_sleep = time.perf_counter() - start
    record = time_epoch(batches(), warmup=1)
    assert record["timed_seconds"] >= 1.5 * one_sleep  # two timed batches, each waited for


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bench_times_make_loader_against_a_plain_copy_of_the_same_batches(archives):
    paths = [archives[("folder", "encoded")], archives[("memmap", "raw")], archives[("zip", "encoded")]]
    config = BenchConfig(workers=[0, 1], batch_size=8, epochs=2, warmup=1, size=16, start_method="spawn",
                         pipelines=["none", "train"], device="cuda", reference_seconds=0.2)
    results = run_benchmark(paths, config, log=lambda line: None)
    assert results["environment"]["gpu"]["name"] == torch.cuda.get_device_name()
    assert all(r["error"] is None for r in results["runs"]), [r["error"] for r in results["runs"]]
    def find(loader, path, pipeline, workers):
        rows = [r for r in results["runs"] if (r["loader"], r["path"], r["pipeline"], r["workers"]) ==
                (loader, os.path.abspath(path), pipeline, workers)]
        assert len(rows) == 1
        return rows[0]

    for pipeline in ("none", "train"):
        for path in paths[1:]:
            for w in (0, 1):
                fast, plain = find("make_loader", path, pipeline, w), find("plain-to-device", path, pipeline, w)
                assert fast["ratios"]["vs_plain_copy"] == pytest.approx(rate(fast) / rate(plain))
            fast, gpu = find("make_loader", paths[2], pipeline, w), find(DEVICE_DECODE, paths[2], pipeline, w)
            assert gpu["ratios"]["vs_worker_decode"] == pytest.approx(rate(gpu) / rate(fast))
    assert not any(r["loader"] == DEVICE_DECODE and r["mode"] == "raw" for r in results["runs"])
    assert any(g["goal"].startswith("encoded, train decoded on the GPU") for g in results["goals"])
    tensordict = {r["workers"] for r in results["runs"] if r["loader"] == "tensordict-memmap"}
    assert tensordict == {0}  # the tutorial moves batches to the GPU in collate_fn: main process only
    assert "plain .to" in format_table(results)


def test_decoding_on_the_device_is_measured_against_the_workers_decode(archives):
    """The GPU goal's plumbing, run on the CPU: the device-decode loader yields the same batches
    as the workers' decode, and its ratio and goal come from the make_loader row of the same run."""
    path = os.path.abspath(archives[("zip", "encoded")])
    config = BenchConfig(workers=[0], batch_size=8, size=16)
    target = describe_target(path, None)
    workers, device = (list(build_loader(target, name, "train", 0, config)) for name in ("make_loader", DEVICE_DECODE))
    assert len(workers) == len(device) and all(a[0].shape == b[0].shape == (len(a[1]), 3, 16, 16)
                                               for a, b in zip(workers, device))
    row = dict(path=path, target="zip", format="zip", mode="encoded", pipeline="train", workers=2, role="target",
               error=None)
    results = {"targets": [target], "references": [], "runs": [
        dict(row, loader="make_loader", images_per_s={"median": 1000.0}),
        dict(row, loader=DEVICE_DECODE, images_per_s={"median": 3500.0})]}
    add_ratios(results)
    assert results["runs"][1]["ratios"]["vs_worker_decode"] == pytest.approx(3.5)
    goal = [g for g in results["goals"] if g["goal"].startswith("encoded, train decoded on the GPU")]
    assert len(goal) == 1 and goal[0]["met"] and goal[0]["ratio"] == pytest.approx(3.5)


def test_the_memory_sampler_waits_longer_the_more_a_sample_costs():
    """Sampling smaps of processes that map big archives takes ~20 ms each: at a fixed 50 ms
    interval the sampler would take a core from the loader it measures."""
    sampler = MemorySampler(interval=0.05)
    sampler.last_cost = 0.001
    assert sampler.pause() == 0.05
    sampler.last_cost = 0.06
    assert sampler.pause() * sampler.MAX_SHARE >= 0.06 * (1 - sampler.MAX_SHARE) - 1e-9
    sampler.sample()
    assert sampler.last_cost > 0


def test_photo_folders_are_crops_of_real_photographs_deterministic_per_seed(tmp_path):
    """Benchmark data with real camera texture: sizes in range, only scaled down, same seed same bytes."""
    from packed_formats.synthetic import make_photo_folder, sample_photographs

    assert sample_photographs(), "matplotlib (a test dependency) ships the sample photograph"
    a = make_photo_folder(tmp_path / "a", images_per_class=3, classes=("x", "y"), sizes=(120, 300), seed=5)
    b = make_photo_folder(tmp_path / "b", images_per_class=3, classes=("x", "y"), sizes=(120, 300), seed=5)
    files = sorted(p.relative_to(a) for p in Path(a).rglob("*.jpg"))
    assert len(files) == 6 and [p.parts[0] for p in files] == ["x"] * 3 + ["y"] * 3
    for name in files:
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes()
        with Image.open(Path(a) / name) as image:
            assert image.format == "JPEG" and all(120 <= side <= 300 for side in image.size)
            pixels = np.asarray(image.convert("L"), dtype=np.float64)
        assert np.abs(np.diff(pixels, axis=1)).mean() > 1.0  # texture, not a flat synthetic fill

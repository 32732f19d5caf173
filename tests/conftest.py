"""Shared fixtures: a small generated ImageFolder and archives of every format and mode."""

from __future__ import annotations

import fcntl
import gc
import hashlib
import importlib
import json
import multiprocessing
import os
import random

import numpy as np
import pytest
import torch

import packed_formats as pf
from packed_formats import codecs
from packed_formats.synthetic import make_image_folder

from .s3_server import s3, s3_env, s3_proxy  # noqa: F401 (fixtures: a real S3 server, a fault proxy)

if os.environ.get("PF_TEST_EXTRA_FORMAT"):  # a module that registers one more format: the suite runs on it too
    importlib.import_module(os.environ["PF_TEST_EXTRA_FORMAT"])

RAW_SHAPE = (24, 32, 3)
CLASSES = ("boxes", "circles", "stripes")
PER_CLASS = 8  # 24 samples: small enough for spawn matrices, big enough to shard over workers

ARCHIVE_KINDS = [(f, m) for f in pf.PACKED_FORMATS for m in ("raw", "encoded")]
ALL_KINDS = ARCHIVE_KINDS + [("folder", "encoded")]


# ---- which tests run where ----------------------------------------------------------------------------
# ``make test`` (tools/run_tests.py) runs the suite in three streams: every test not marked ``serial`` or
# ``beside`` on two pytest-xdist workers, then the ``serial`` ones one at a time; from the start, beside
# both, the ``beside`` ones, one at a time.  A test is serial when it needs the whole machine:
SERIAL_MODULES = {
    "test_notebooks", "test_docs",  # notebooks run their own DataLoaders and servers; Sphinx executes them
    "test_writer_memory", "test_memory",  # memory ceilings: another test's load would decide them
    "test_slots",  # counts the shared-memory segments and descriptors of the whole machine's /dev/shm
    "test_fuzz",  # a read path silent for 15 s is a hang: its verdicts need the CPUs to themselves
}
# (The benchmark's and the scale tool's tests check what they record and that its ratios are consistent,
# never a speed, so they share the machine; so do torchrun's ranks, on a port each run picks.)
# A test runs beside the others when it mostly waits, on a service that exists once per machine or a
# session: the local Slurm cluster (its ports and state folder; jobs paced past a signal), batch scripts
# under a stand-in for it, the store servers (one moto server and fault proxy a session; their tests
# wait on stalls, retries and backoff), and pip building and installing the project into fresh venvs.
BESIDE_FIXTURES = {"slurm", "s3", "s3_env", "s3_proxy"}
BESIDE_MODULES = {
    "test_slurm_cluster", "test_slurm_examples", "test_slurm_recipes",
    "test_remote_https", "test_remote", "test_remote_untrusted", "test_s3_harness", "test_fuzz_sets",
    "test_packaging",
}
# The longest tests of the parallel pass start first, so that no worker is left with one of them at the end.
LONG_FIRST = (
    "test_the_shared_suite_passes_on_a_format_defined_outside_the_library",
    "test_the_benchmark_command_the_demo_prints_runs_on_the_demos_archives",
    "test_a_new_process_resumes_exactly_in_many_random_cases",
    "test_resuming_on_another_number_of_gloo_ranks",
    "test_every_sample_of_300_parts_reads_back_under_a_low_open_file_limit",
    "test_a_process_killed_after_a_checkpoint_resumes_and_sees_every_sample_once",
    "test_lightning_ddp_gives_each_rank_its_share",
    "test_there_is_a_row_without_errors_for_every_format_asked_for",  # the scale tool's run, 45 s
    "test_ranks_split_each_epoch_disjointly_and_cover_the_archive",  # torchrun's
)
# ``make test-fast`` (the quick tier: every test not marked ``slow``) leaves out these too, each over 3 s in a
# quick run (2026-11-29): they start processes, interpreters or servers, or wait out a time limit on
# purpose.  ``make test`` runs them; a name that no longer exists fails test_run_tests.
SLOW_FOR_THE_QUICK_TIER = {
    # a Slurm job, a fuzz of remote sets, the command line and benchmarks run in fresh interpreters
    "test_slurm_examples::test_training_example_checkpoints_on_sigusr1_requeues_and_resumes",
    "test_fuzz_sets::test_a_damaged_sample_index_or_listing_reads_intact_or_is_refused_and_writes_only_in_the_cache",
    "test_bench_gpu::test_the_gpu_benchmark_writes_every_cell_in_quick_cpu_mode",
    "test_run_tests::test_the_streams_select_every_test_exactly_once",  # collects the whole suite
    "test_demo::test_the_demo_packs_every_format_and_times_every_archive_batched",
    "test_doctor::test_doctor_json_on_a_tmpfs_directory",
    "test_doctor::test_doctor_json_structure_on_a_local_directory",
    "test_doctor::test_help_info_and_doctor_on_a_raw_archive_do_not_import_torchvision",
    # time limits waited out on purpose (a hung HDF5 child, stalled or overdue store requests, dead workers)
    "test_hdf5_hostile::test_an_archive_without_a_locator_that_hangs_hdf5_is_named_within_the_time_limit",
    "test_hdf5_hostile::test_a_damaged_chunk_index_never_crashes_or_hangs_a_reader",
    "test_remote_https::test_a_try_past_its_deadline_is_retried_even_with_the_protocols_timeouts_off",
    "test_remote_https::test_a_stalled_body_fails_within_seconds_by_name",
    "test_shard_limits::test_a_worker_killed_mid_epoch_fails_the_loader_in_seconds",
    "test_shard_limits::test_a_worker_that_cannot_hand_a_batch_back_fails_the_loader_in_seconds",
    "test_integrity::test_a_worker_killed_holding_the_stop_events_lock_is_still_reported",
    "test_integrity::test_a_message_without_the_fields_note_or_with_a_damaged_one_keeps_only_the_message",
    "test_slots::test_an_exception_in_a_worker_leaves_no_slot_file",
    # hundreds of parts, 200k samples, spawned and killed processes, every start method in one test
    "test_shard_limits::test_a_process_keeps_at_most_the_bound_of_parts_and_their_descriptors_open",
    "test_shard_limits::test_every_sample_of_300_parts_reads_back_under_a_low_open_file_limit",
    "test_shard_limits::test_make_loader_with_two_workers_reads_300_parts_under_a_low_open_file_limit",
    "test_zip_layout::test_writing_200k_samples_keeps_no_object_per_member",
    "test_remote::test_opening_reads_no_part",
    "test_resume::test_a_process_killed_after_a_checkpoint_resumes_and_sees_every_sample_once",
    "test_resume::test_a_new_process_resumes_exactly",
    "test_spawn_mapping::test_spawned_workers_of_a_sharded_archive_read_right_samples_and_labels",
    "test_remote_fields::test_make_loader_batches_the_fields_of_a_set_in_the_store_in_spawned_workers",
    "test_device_decode::test_workers_cut_crops_for_a_device_that_does_the_rest",
    "test_device_decode::test_device_decode_is_the_same_with_workers_and_every_start_method",
    "test_device_decode::test_a_damaged_stored_byte_is_named_by_its_checksum",
    "test_shard_limits::test_closing_a_sharded_reader_closes_every_part",
    # 40,000 files listed; the doctor's timed probes; 500 random credentials sent to a server and into errors
    "test_sources::test_listing_a_folder_holds_no_python_object_per_file",
    "test_doctor::test_doctor_on_a_raw_archive_leaves_the_decoder_unchecked_and_says_so",
    "test_urls::test_a_urls_credentials_reach_the_server_as_the_bytes_they_escape",
    "test_urls::test_an_error_for_a_url_with_credentials_never_holds_them",
}
# A forkserver (a DataLoader's multiprocessing_context="forkserver", the fuzz's batches) forks its workers
# from one process that imported these once, as a training script's does after
# multiprocessing.set_forkserver_preload: without it every worker imports torch anew (3.5 s of CPU here),
# and the tests over start methods pay that per worker and epoch.  A worker still receives its dataset by
# pickle, which is what those tests are about.
FORKSERVER_PRELOAD = ["torch", "packed_formats", "tests.probe"]


def pytest_addoption(parser):
    parser.addoption("--shuffle", metavar="SEED", default=None,
                     help="run the test modules, and the tests of each, in a random order drawn from SEED "
                          "('random': a fresh seed, shown)")


def pytest_configure(config):
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    if config.getoption("shuffle") == "random":  # drawn once, here: xdist workers receive the options as set
        config.option.shuffle = str(random.SystemRandom().randrange(1 << 32))


def pytest_report_header(config):
    seed = config.getoption("shuffle")
    return f"test order: shuffled by seed {seed} (--shuffle {seed} replays it)" if seed else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        fixtures = set(getattr(item, "fixturenames", ()))
        if module in BESIDE_MODULES or BESIDE_FIXTURES & fixtures:
            item.add_marker(pytest.mark.beside)
        elif module in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
        if f"{module}::{getattr(item, 'originalname', item.name)}" in SLOW_FOR_THE_QUICK_TIER:
            item.add_marker(pytest.mark.slow)
    seed = config.getoption("shuffle")
    if seed:  # the modules in a random order, and the tests of each: a module's fixtures are made once still
        rng, modules = random.Random(seed), {}
        for item in items:
            modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
        order = list(modules.values())
        rng.shuffle(order)
        for tests in order:
            rng.shuffle(tests)
        items[:] = [item for tests in order for item in tests]
    items.sort(key=lambda item: getattr(item, "originalname", item.name) not in LONG_FIRST)  # stable


def once_per_run(tmp_path_factory, name: str, make):
    """``make()``'s result (JSON-able), made once a test run: under pytest-xdist by whichever worker asks
    first while the others wait and read it, where a module's costly fixture would otherwise run on every
    worker that runs one of the module's tests."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        return make()
    folder = tmp_path_factory.getbasetemp().parent  # the run's, above each worker's own
    made = folder / f"{name}-{run}.json"
    with open(folder / f"{name}-{run}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if made.exists():
            return json.loads(made.read_text())
        value = make()
        made.write_text(json.dumps(value))
        return value


def kind_id(kind):
    return "-".join(kind)


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> str:
    """An ImageFolder tree of 24 JPEGs of varied sizes in 3 classes."""
    root = tmp_path_factory.mktemp("src") / "images"
    return make_image_folder(root, images_per_class=PER_CLASS, classes=CLASSES, sizes=(40, 90), seed=1)


def expected_samples(image_folder: str, mode: str):
    """(stored sample, label, key) per source image, as an archive of `mode` should hold them."""
    source = pf.open_archive(image_folder)
    out = []
    for i in range(len(source)):
        data = source.read(i)
        stored = data if mode == "encoded" else resize_raw(data)
        out.append((stored, int(source.labels[i]), source.key(i)))
    source.close()
    return out


def resize_raw(data: bytes) -> np.ndarray:
    image = codecs.open_image(data).convert("RGB").resize((RAW_SHAPE[1], RAW_SHAPE[0]))
    return np.asarray(image)


def write_archive(path, fmt: str, mode: str, samples, classes=CLASSES) -> str:
    with pf.open_writer(path, format=fmt, mode=mode, shape=RAW_SHAPE, classes=classes) as writer:
        for stored, label, key in samples:
            writer.add(stored, label, key)
    return os.fspath(path)


def small_remote_sets(root, images: str, per_part: int) -> dict:
    """{"zip": path, "memmap": path}: raw 16x16 sharded sets of ``per_part`` samples a part converted from
    ``images`` under ``root`` (what the tests of remote sets upload: a file format and a folder one)."""
    made = {}
    for fmt, ext in (("zip", ".zip"), ("memmap", ".memmap")):
        path = root / fmt / f"train{ext}"
        os.makedirs(path.parent)
        pf.convert(images, path, format=fmt, mode="raw", size=16, shard_size=per_part, workers=1)
        made[fmt] = str(path)
    return made


@pytest.fixture(scope="session")
def archives(tmp_path_factory, image_folder):
    """{(format, mode): path} for every packed format and mode, plus ("folder", "encoded")."""
    root = tmp_path_factory.mktemp("archives")
    made = {("folder", "encoded"): image_folder}
    for fmt, mode in ARCHIVE_KINDS:
        made[(fmt, mode)] = write_archive(root / f"data-{mode}.{fmt}", fmt, mode, expected_samples(image_folder, mode))
    return made


@pytest.fixture(params=ALL_KINDS, ids=kind_id)
def kind(request):
    return request.param


@pytest.fixture(params=ARCHIVE_KINDS, ids=kind_id)
def packed_kind(request):
    return request.param


@pytest.fixture(scope="session")
def uniform_archives(tmp_path_factory, image_folder):
    """{(format, mode): path} whose encoded samples are JPEGs of one size (RAW_SHAPE)."""
    root = tmp_path_factory.mktemp("uniform")
    samples = expected_samples(image_folder, "raw")
    encoded = [(pf.codecs.encode(pixels), label, key) for pixels, label, key in samples]
    return {
        (fmt, mode): write_archive(root / f"u-{mode}.{fmt}", fmt, mode, samples if mode == "raw" else encoded)
        for fmt, mode in ARCHIVE_KINDS
    }


@pytest.fixture(params=ARCHIVE_KINDS, ids=kind_id)
def uniform(request, uniform_archives):
    return uniform_archives[request.param]


def digest(image: torch.Tensor) -> str:
    return hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()


def sample_lookup(path) -> dict:
    """sha1 of each sample's [C,H,W] pixels -> its index (samples here are all distinct)."""
    dataset = pf.PackedDataset(path, output="tensor")
    return {digest(dataset[i][0]): i for i in range(len(dataset))}


def pytest_collection_finish(session):
    """Freeze what the imports and the collection made (torch, the test modules: about a million objects).
    The collector then never walks them again: not in a test's ``gc.collect()``, not in the collections
    that allocation sets off, and not in a forked DataLoader worker, where walking them would also copy
    every page they sit on.  It halves the CPU time of the tests that fork workers."""
    gc.collect()
    gc.freeze()

"""Raw batches that are only a copy, gathered by threads of the loading process (loading/threads.py).

The batches, their order, their labels and indices must be exactly those of
``num_workers=0`` and of worker processes; a batch the caller keeps must never
be written again; no process may be started; leaving an epoch early, resuming,
skipping a bad sample and letting the loader go must work as with processes.
"""

from __future__ import annotations

import gc
import os
import pickle
import threading
import time
import warnings

import numpy as np
import psutil
import pytest
import torch

import packed_formats as pf
from packed_formats.loading.threads import GatherThreads

from .test_loader import BAD, corrupt_copy

THREADED = list(pf.PACKED_FORMATS)  # every format (a set of parts keeps processes)


def gather_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("packed_formats-gather")]


def batches_of(loader, epochs=2):
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out.append([tuple(t.clone() for t in batch) for batch in loader])
    return out


@pytest.fixture(scope="module")
def planar(tmp_path_factory, uniform_archives):
    """The raw memmap archive converted again, stored channel by channel."""
    path = tmp_path_factory.mktemp("planar") / "chw.memmap"
    pf.convert(uniform_archives[("memmap", "raw")], path, format="memmap", mode="raw", raw_layout="chw", quiet=True)
    return str(path)


# ---- which loaders take threads -----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_threads_gather_only_local_raw_batches_with_nothing_to_run_on_them(uniform_archives, fmt, mode):
    path = uniform_archives[(fmt, mode)]
    expected = "threads" if mode == "raw" and fmt in THREADED else "processes"
    assert pf.make_loader(path, batch_size=4, num_workers=2).worker_kind == expected
    assert pf.make_loader(path, batch_size=4, num_workers=0).worker_kind is None
    # a start method asked for, a transform or fields to run: worker processes
    assert pf.make_loader(path, batch_size=4, num_workers=2, multiprocessing_context="fork").worker_kind == "processes"
    transform = pf.transforms.val(16) if mode == "raw" else None
    if transform is not None:
        assert pf.make_loader(path, batch_size=4, num_workers=2, transform=transform).worker_kind == "processes"


def test_a_sharded_set_keeps_worker_processes(uniform_archives, tmp_path):
    path = tmp_path / "set"
    pf.convert(uniform_archives[("memmap", "raw")], path, format="memmap", mode="raw", shard_size=8, quiet=True)
    assert pf.make_loader(path, batch_size=4, num_workers=2).worker_kind == "processes"


# ---- the same batches -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", THREADED)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_threads_give_the_batches_of_no_workers_and_of_worker_processes(uniform_archives, fmt, memory_format):
    path = uniform_archives[(fmt, "raw")]
    options = dict(batch_size=5, shuffle=True, seed=3, return_index=True, memory_format=memory_format)
    threaded = pf.make_loader(path, num_workers=2, **options)
    assert threaded.worker_kind == "threads"
    got = batches_of(threaded)
    for other in (pf.make_loader(path, num_workers=0, **options),
                  pf.make_loader(path, num_workers=2, multiprocessing_context="fork", **options)):
        expected = batches_of(other)
        assert len(expected) == len(got) and [len(e) for e in expected] == [len(g) for g in got]
        for epoch_got, epoch_expected in zip(got, expected):
            for a, b in zip(epoch_got, epoch_expected):
                assert all(torch.equal(x, y) for x, y in zip(a, b))
    images = next(iter(threaded))[0]
    assert images.is_contiguous(memory_format=memory_format)


def test_a_planar_archive_through_threads_gives_the_interleaved_ones_batches(uniform_archives, planar):
    options = dict(batch_size=7, shuffle=True, seed=1, num_workers=2)
    a = pf.make_loader(uniform_archives[("memmap", "raw")], **options)
    b = pf.make_loader(planar, **options)
    assert a.worker_kind == b.worker_kind == "threads"
    for (x, y), (u, v) in zip(a, b):
        assert torch.equal(x, u) and torch.equal(y, v) and x.is_contiguous() and u.is_contiguous()


def test_no_process_is_started(uniform_archives):
    loader = pf.make_loader(uniform_archives[("memmap", "raw")], batch_size=2, num_workers=2)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    for _ in loader:
        assert {p.pid for p in me.children(recursive=True)} <= before
    assert len(gather_threads()) >= 1


# ---- buffers ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep_every", [1, 3])
def test_batches_the_caller_keeps_are_never_written_again(uniform_archives, keep_every):
    path = uniform_archives[("memmap", "raw")]
    dataset = pf.PackedDataset(path, output="tensor")
    loader = pf.make_loader(path, batch_size=2, num_workers=2, shuffle=True, return_index=True)
    kept = []
    for _ in range(3):  # more batches than the buffers kept for reuse: later ones must not land in kept ones
        for k, (images, labels, index) in enumerate(loader):
            if k % keep_every == 0:
                kept.append((images, labels, index))
    for images, labels, index in kept:
        for image, label, i in zip(images, labels, index.tolist()):
            expected_image, expected_label = dataset[i]
            assert torch.equal(image, expected_image) and int(label) == int(expected_label)


def test_buffers_are_reused_once_dropped(uniform_archives):
    loader = pf.make_loader(uniform_archives[("memmap", "raw")], batch_size=2, num_workers=2, shuffle=False)
    pointers = set()
    for _ in range(3):
        for images, _ in loader:
            pointers.add(images.untyped_storage().data_ptr())
    assert len(pointers) <= GatherThreads.buffers_kept(2)


# ---- epochs left early, resuming, bad samples, the end ----------------------------------------------------------
def test_an_epoch_left_early_then_resumed_gives_the_rest_exactly(uniform_archives):
    path = uniform_archives[("zip", "raw")]
    options = dict(batch_size=3, shuffle=True, seed=5, num_workers=2, return_index=True)
    whole = [index.tolist() for _, _, index in pf.make_loader(path, **options)]
    loader = pf.make_loader(path, **options)
    seen = []
    for k, (_, _, index) in enumerate(loader):
        seen.append(index.tolist())
        if k == 2:
            break  # the threads still gather the next batches: they finish into buffers of their own
    state = loader.state_dict()
    resumed = pf.make_loader(path, **options)
    resumed.load_state_dict(state)
    assert resumed.worker_kind == "threads"
    assert seen + [index.tolist() for _, _, index in resumed] == whole
    loader.set_epoch(0)  # the epoch left early, read again whole by the same loader and threads
    assert [index.tolist() for _, _, index in loader] == whole


def test_a_bad_sample_is_skipped_or_raised_as_without_workers(uniform_archives, tmp_path):
    bad = corrupt_copy(uniform_archives[("memmap", "raw")], os.fspath(tmp_path / "bad.memmap"), "memmap", "raw")
    results = {}
    for workers in (0, 2):
        loader = pf.make_loader(bad, batch_size=4, num_workers=workers, shuffle=False, on_error="skip",
                                return_index=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[workers] = [index.tolist() for _, _, index in loader]
        assert any(isinstance(w.message, pf.SkippedSampleWarning) for w in caught)
        assert [s.index for s in loader.skipped] == [BAD]
    assert results[0] == results[2] and BAD not in sum(results[2], [])


def test_the_threads_end_with_the_loader(uniform_archives):
    loader = pf.make_loader(uniform_archives[("hdf5", "raw")], batch_size=2, num_workers=2)
    for _ in loader:
        pass
    mine = set(gather_threads())
    assert mine
    del loader
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in mine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.is_alive() for t in mine)


def test_a_threaded_loader_pickles_and_reads_again(uniform_archives):
    loader = pf.make_loader(uniform_archives[("memmap", "raw")], batch_size=4, num_workers=2, shuffle=False)
    first = [labels.tolist() for _, labels in loader]
    again = pickle.loads(pickle.dumps(loader))
    assert again.worker_kind == "threads"
    assert [labels.tolist() for _, labels in again] == first
    assert np.concatenate(first).tolist() == again.reader.labels.tolist()


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="needs fork")
def test_a_forked_child_reads_through_threads_of_its_own(uniform_archives, tmp_path):
    loader = pf.make_loader(uniform_archives[("memmap", "raw")], batch_size=4, num_workers=2, shuffle=False)
    expected = [labels.tolist() for _, labels in loader]  # the parent's threads exist now
    out = tmp_path / "child.txt"
    pid = os.fork()
    if pid == 0:  # the child: the inherited pool has no threads here; reading must not wait for them forever
        try:
            out.write_text(repr([labels.tolist() for _, labels in loader]))
        finally:
            os._exit(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung reading through the inherited threads")
    assert out.read_text() == repr(expected)


def test_an_error_kept_by_its_catcher_does_not_keep_the_threads(uniform_archives, tmp_path):
    bad = corrupt_copy(uniform_archives[("zip", "raw")], os.fspath(tmp_path / "bad.zip"), "zip", "raw")
    loader = pf.make_loader(bad, batch_size=4, num_workers=2, shuffle=False)
    before = set(gather_threads())
    kept = None
    try:
        for _ in loader:
            pass
    except pf.CorruptSampleError as error:
        kept = error
    mine = set(gather_threads()) - before
    assert kept is not None and kept.index == BAD and mine
    del loader
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in mine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.is_alive() for t in mine), "the kept error keeps the loader's threads"
    assert kept.path == bad

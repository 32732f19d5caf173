"""Worker batches arrive as slot numbers: mapped once, never a descriptor per tensor, never overwritten early."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np
import pytest
import torch
from torch.multiprocessing import reductions

import packed_formats as pf
from packed_formats import transforms as T
from packed_formats.loading import slots
from packed_formats.loading.slots import BatchSlots
from packed_formats.memory import FREE, SENT, SlotPool

from .test_loader import corrupt_copy

pytestmark = pytest.mark.skipif(not slots.available(), reason="needs a writable /dev/shm (Linux)")

START_METHODS = [m for m in ("fork", "spawn", "forkserver") if m in multiprocessing.get_all_start_methods()]
# spawn and forkserver start a fresh interpreter per worker: the quick tier keeps fork only
START_METHOD_PARAMS = [pytest.param(m, marks=pytest.mark.slow) if m != "fork" else m for m in START_METHODS]
SHAPE = (16, 20, 3)
N = 96
BATCH = 8  # 12 batches an epoch, 6 per worker: each worker's 4 slots are reused within an epoch


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    """A raw memmap archive of N distinct random images (their CRC32s in its index)."""
    path = tmp_path_factory.mktemp("slots") / "random.memmap"
    rng = np.random.default_rng(7)
    with pf.open_writer(path, format="memmap", mode="raw", shape=SHAPE, classes=["a", "b", "c"]) as writer:
        for i in range(N):
            writer.add(rng.integers(0, 256, SHAPE, dtype=np.uint8), i % 3, f"{i:03d}")
    return os.fspath(path)


def our_files(token: str) -> list:
    return [name for name in os.listdir(slots.SHARED_DIRECTORY) if name.startswith(f"{slots.PREFIX}{token}-")]


def check_pixels(images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor, reader) -> None:
    """Each image's pixels against the archive's CRC32 of its sample, each label against the archive's."""
    for image, label, i in zip(images, labels.tolist(), indices.tolist()):
        pixels = image.permute(1, 2, 0).contiguous().numpy().tobytes()  # stored as [H,W,C]
        assert zlib.crc32(pixels) == int(reader.index.crc32[i]), f"sample {i} differs from its CRC32"
        assert label == int(reader.labels[i])


@pytest.fixture
def counted(monkeypatch):
    """Counts, in this process, shared storages received through torch's sharing (a descriptor or a file
    name each) and shared storages made new."""
    counts = {"received": 0, "made": 0}
    for name in ("rebuild_storage_fd", "rebuild_storage_filename"):
        receive = getattr(reductions, name)

        def receiving(*args, _receive=receive):
            counts["received"] += 1
            return _receive(*args)

        # pickled by name where a worker sends a storage: the name must lead to this very function
        receiving.__module__, receiving.__qualname__, receiving.__name__ = reductions.__name__, name, name
        monkeypatch.setattr(reductions, name, receiving)
    for name in ("_new_shared", "_new_shared_fd_cpu", "_new_shared_filename_cpu"):
        make = getattr(torch.UntypedStorage, name, None)
        if make is None:
            continue

        def making(*args, _make=make, **kwargs):
            counts["made"] += 1
            return _make(*args, **kwargs)

        monkeypatch.setattr(torch.UntypedStorage, name, making)
    return counts


# ---- one slot per batch, mapped once --------------------------------------------------------------------
def test_cpu_loaders_with_worker_processes_send_batches_in_slots(archive):
    assert isinstance(pf.make_loader(archive, num_workers=2, multiprocessing_context="fork").batch_reader.pool,
                      BatchSlots)
    assert pf.make_loader(archive, num_workers=0).batch_reader.pool is None
    assert pf.make_loader(archive, num_workers=2).batch_reader.pool is None  # threads: nothing to hand over


def test_images_labels_and_indices_of_a_batch_lie_in_one_slot(archive):
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, return_index=True,
                            multiprocessing_context="fork")
    images, labels, indices = next(iter(loader))
    storage = images.untyped_storage()
    assert labels.untyped_storage().data_ptr() == storage.data_ptr() == indices.untyped_storage().data_ptr()
    check_pixels(images, labels, indices, loader.reader)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh-workers"])
@pytest.mark.parametrize("start_method", START_METHOD_PARAMS)
def test_after_the_first_epoch_no_descriptor_is_received_and_no_storage_made(archive, counted, start_method,
                                                                                persistent):
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, multiprocessing_context=start_method,
                            persistent_workers=persistent, return_index=True)
    pool = loader.batch_reader.pool
    sum(len(labels) for _, labels, _ in loader)  # the first epoch maps the slots
    counted.update(received=0, made=0)
    epochs = 3
    for _ in range(epochs):
        for images, labels, indices in loader:
            check_pixels(images, labels, indices, loader.reader)
    assert counted == {"received": 0, "made": 0}
    assert loader.batch_reader.pool is pool
    # each slot mapped once: for the loader's life by persistent workers, for their epoch by fresh ones
    assert pool.receiver.mapped <= pool.states.numel() * (1 if persistent else epochs + 1)
    assert our_files(pool.token) == []  # mapped slots leave no file behind


def test_the_count_sees_batches_handed_over_as_shared_tensors(archive, counted):
    """Control: the same counts over the shared-tensor pool, where every tensor of a batch is received anew."""
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, multiprocessing_context="fork")
    loader.batch_reader.pool = SlotPool(2, min_bytes=0)
    batches = sum(1 for _ in loader)
    assert counted["received"] >= 2 * batches


# ---- pixels, whatever the consumer does ----------------------------------------------------------------------
@pytest.mark.parametrize("pause", [0.0, 0.03], ids=["fast-consumer", "slow-consumer"])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh-workers"])
def test_every_batch_matches_the_archive_over_many_epochs(archive, pause, persistent):
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, multiprocessing_context="fork",
                            persistent_workers=persistent, return_index=True)
    for _ in range(4):
        seen = []
        for images, labels, indices in loader:
            time.sleep(pause)  # a batch held while the workers write the next ones
            check_pixels(images, labels, indices, loader.reader)
            seen.extend(indices.tolist())
        assert sorted(seen) == list(range(N))
    del images, labels, indices
    assert int((loader.batch_reader.pool.states == SENT).sum()) == 0  # every dropped batch gave its slot back


@pytest.mark.parametrize("start_method", START_METHOD_PARAMS)
def test_kept_batches_are_never_overwritten(archive, start_method):
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, multiprocessing_context=start_method,
                            return_index=True)
    kept = []  # every third batch, with a copy taken when it arrived
    for _ in range(3):
        for k, (images, labels, indices) in enumerate(loader):
            if k % 3 == 0:
                kept.append((images, labels, indices, images.clone()))
    pool = loader.batch_reader.pool
    assert int((pool.states == SENT).sum()) > 0  # the kept batches hold their slots
    for images, labels, indices, copy in kept:
        assert torch.equal(images, copy)
        check_pixels(images, labels, indices, loader.reader)
    del kept, images, labels, indices
    assert int((pool.states == SENT).sum()) == 0


def test_batches_beyond_the_slots_the_user_holds_still_arrive_intact(archive):
    # the user keeps every batch: each worker's slots are all held, and later batches travel the ordinary way
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, multiprocessing_context="fork",
                            return_index=True)
    kept = [batch for _ in range(2) for batch in loader]
    pool = loader.batch_reader.pool
    assert int((pool.states == SENT).sum()) == pool.states.numel()
    for images, labels, indices in kept:
        check_pixels(images, labels, indices, loader.reader)
    del kept
    gc.collect()
    assert int((pool.states == SENT).sum()) == 0


def test_augmented_float_batches_equal_those_made_in_the_main_process(archive):
    options = dict(batch_size=BATCH, transform=T.train(12), seed=3)
    expected = [images for images, _ in pf.make_loader(archive, num_workers=0, **options)]
    loader = pf.make_loader(archive, num_workers=2, multiprocessing_context="fork", **options)
    for _ in range(2):
        loader.set_epoch(0)
        got = [images for images, _ in loader]
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_two_passes_at_once_with_fresh_workers_each_get_every_sample(archive):
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, multiprocessing_context="fork",
                            persistent_workers=False, return_index=True)
    first, second = [], []
    for (a, la, ia), (b, lb, ib) in zip(loader, loader):
        check_pixels(a, la, ia, loader.reader)
        check_pixels(b, lb, ib, loader.reader)
        first.extend(ia.tolist())
        second.extend(ib.tolist())
    assert sorted(first) == sorted(second) == list(range(N))


# ---- every way out frees the slots --------------------------------------------------------------------------
def wait_for_no_files(token: str, seconds: float = 10.0) -> list:
    deadline = time.monotonic() + seconds
    while our_files(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    return our_files(token)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh-workers"])
def test_a_break_mid_epoch_leaves_no_slot_held(archive, persistent):
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, multiprocessing_context="fork",
                            persistent_workers=persistent, return_index=True)
    pool = loader.batch_reader.pool
    for _ in range(3):
        for k, _batch in enumerate(loader):
            if k == 2:
                break  # with batches in flight
        del _batch
    seen = []
    for images, labels, indices in loader:
        check_pixels(images, labels, indices, loader.reader)
        seen.extend(indices.tolist())
    assert sorted(seen) == list(range(N))
    del images, labels, indices
    assert int((pool.states == SENT).sum()) == 0
    token = pool.token
    del loader, pool
    assert wait_for_no_files(token) == []


def test_dropping_the_loader_mid_epoch_unlinks_its_slot_files(archive):
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, multiprocessing_context="fork")
    batches = iter(loader)
    held = next(batches)
    token = loader.batch_reader.pool.token
    del loader, batches
    assert wait_for_no_files(token) == []
    assert held[0].shape == (BATCH, SHAPE[2], SHAPE[0], SHAPE[1]) and int(held[0].sum()) > 0  # still readable
    del held


def test_a_corrupt_sample_in_a_worker_leaves_no_slot_file(archive, tmp_path):
    bad = corrupt_copy(archive, os.fspath(tmp_path / "bad.memmap"), "memmap", "raw")
    loader = pf.make_loader(bad, batch_size=BATCH, num_workers=2, multiprocessing_context="fork", shuffle=False)
    token = loader.batch_reader.pool.token
    with pytest.raises(pf.CorruptSampleError):
        for _ in loader:
            pass
    del loader
    gc.collect()
    assert wait_for_no_files(token) == []


def failing(batch):
    raise RuntimeError("a transform that fails")


def test_an_exception_in_a_worker_leaves_no_slot_file(archive):
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, multiprocessing_context="fork",
                            transform=T.Batched(failing))
    token = loader.batch_reader.pool.token
    with pytest.raises(RuntimeError, match="a transform that fails"):
        for _ in loader:
            pass
    del loader
    gc.collect()
    assert wait_for_no_files(token) == []


def test_after_a_worker_is_killed_the_slots_are_freed_and_the_next_pass_runs(archive):
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, multiprocessing_context="fork",
                            return_index=True)
    pool = loader.batch_reader.pool
    batches = iter(loader)
    next(batches)
    victim = loader.dataloader._iterator._workers[1].pid
    with pytest.raises(pf.DataLoaderWorkerError, match="killed by SIGKILL"):
        os.kill(victim, signal.SIGKILL)
        for batch in batches:
            del batch  # a batch kept here would rightly keep its slot (the survivor's batches arrive until the error)
    del batches
    gc.collect()
    seen = []
    for images, labels, indices in loader:  # fresh workers, the same slots
        check_pixels(images, labels, indices, loader.reader)
        seen.extend(indices.tolist())
    assert sorted(seen) == list(range(N)) and loader.batch_reader.pool is pool
    del images, labels, indices
    assert int((pool.states == SENT).sum()) == 0  # batches lost with the dead worker's pass gave their slots back
    token = pool.token
    del loader, pool
    assert wait_for_no_files(token) == []


# ---- a killed main process leaves nothing behind -----------------------------------------------------------
KILLED = os.path.join(os.path.dirname(__file__), "killed_loader.py")
KILL_CASES = [{"method": "fork", "fields": False}, {"method": "spawn", "fields": False},
              {"method": "fork", "fields": True}]  # persistent workers, a v2 transform, batches in their messages


def stat_of(pid: int):
    """(state, parent pid, start time) of a process, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), fields[19]


def children_of(parent: int) -> dict:
    """{pid: start time} of the live processes whose parent is ``parent``."""
    found = {}
    for entry in os.listdir("/proc"):
        stat = stat_of(int(entry)) if entry.isdigit() else None
        if stat is not None and stat[1] == parent and stat[0] != "Z":
            found[int(entry)] = stat[2]
    return found


def still_running(processes: dict) -> list:
    """Those of ``{pid: start time}`` that still run (not ended, reaped or a zombie)."""
    running = []
    for pid, start in processes.items():
        stat = stat_of(pid)
        if stat is not None and stat[2] == start and stat[0] != "Z":
            running.append(pid)
    return running


def kill_mid_epoch(path: str, case: dict, log: str, delay: float = 0.0) -> tuple:
    """Run ``tests/killed_loader.py`` on ``path`` with ``case``, SIGKILL it ``delay`` seconds after it is ready,
    and wait (30 s at most: a bound, not a speed asked for) for its slot files and workers to go: (slot files
    left, workers still running, workers seen).  Its stderr goes to the file ``log``."""
    directory = tempfile.mkdtemp(prefix="pf-test-", dir=slots.SHARED_DIRECTORY)  # a tmpfs folder of its own
    try:
        with open(log, "w") as errors:
            child = subprocess.Popen([sys.executable, KILLED, path, directory, json.dumps(case)],
                                     stdout=subprocess.PIPE, stderr=errors, text=True)
            try:
                ready = child.stdout.readline()
                workers = children_of(child.pid)  # the DataLoader workers (and spawn's resource tracker)
                time.sleep(delay)
            finally:
                child.kill()
                child.wait()
                child.stdout.close()
        with open(log) as errors:
            assert ready == "ready\n", errors.read()[-3000:]
        deadline = time.monotonic() + 30
        while (os.listdir(directory) or still_running(workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left, running = os.listdir(directory), still_running(workers)
        for pid in running:  # never leave them to the next test
            os.kill(pid, signal.SIGKILL)
        return left, running, workers
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", KILL_CASES, ids=lambda c: c["method"] + ("-fields" if c["fields"] else ""))
def test_a_main_process_killed_mid_epoch_leaves_no_slot_file_and_no_worker(archive, tmp_path, case):
    if case["fields"]:
        from .test_loader_fields import SIZES, write_ramps

        path = os.fspath(tmp_path / "ramps.zip")
        write_ramps(path, sizes=SIZES * 4)
    else:
        path = archive
    left, running, workers = kill_mid_epoch(path, case, os.fspath(tmp_path / "stderr.txt"))
    assert len(workers) >= 2
    assert left == [] and running == []


# ---- the pool on its own ---------------------------------------------------------------------------------
class _Info:
    def __init__(self, worker_id):
        self.id = worker_id


def test_a_slot_that_must_grow_gets_new_memory_and_no_file_is_left(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: _Info(0))
    pool = BatchSlots(1, slots=1, directory=os.fspath(tmp_path))
    small = pool.take((8, 8))
    pool.end_batch()  # let go unsent: never written again
    assert os.listdir(tmp_path) == []  # unlinked as soon as it was made: it goes with its last process
    big = pool.take((1 << 20,))
    assert int(pool.generations[0, 0]) == 2 and os.listdir(tmp_path) == []
    assert big.untyped_storage().data_ptr() != small.untyped_storage().data_ptr()
    pool.close()


def test_a_received_batch_maps_its_slot_and_frees_it_with_its_last_tensor(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: _Info(0))
    pool = BatchSlots(1, slots=2, directory=os.fspath(tmp_path))
    images = pool.take((4, 3, 5, 6))
    images.fill_(9)
    message = pool.hand_back((images, torch.arange(4)), "set.memmap")
    pool.end_batch()
    assert os.listdir(tmp_path) == [] and int(pool.states[0, 0]) == SENT  # no file: the message carries the slot
    received, labels = pickle.loads(pickle.dumps(message))  # as the main process receives it
    assert torch.all(received == 9) and labels.tolist() == [0, 1, 2, 3]
    assert labels.untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
    del received
    assert int(pool.states[0, 0]) == SENT  # the labels still hold the batch
    del labels
    assert int(pool.states[0, 0]) == FREE


def test_a_batch_left_empty_by_skipped_samples_arrives_empty(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: _Info(0))
    pool = BatchSlots(1, slots=2, directory=os.fspath(tmp_path))
    images = pool.take((4, 3, 5, 6))[torch.tensor([], dtype=torch.int64)]  # every sample left out
    empty = (images, torch.zeros(0, dtype=torch.int64), ("skipped",), torch.from_numpy(np.array([], np.int64)))
    message = pool.hand_back(empty, "set.memmap")
    pool.end_batch()
    received, labels, skipped, indices = pickle.loads(pickle.dumps(message))
    assert (received.shape, received.dtype, labels.shape, skipped, indices.shape) == (
        (0, 3, 5, 6), torch.uint8, (0,), ("skipped",), (0,))
    pool.close()


def test_a_slot_made_after_its_pool_closed_is_unlinked(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: _Info(0))
    pool = BatchSlots(1, directory=os.fspath(tmp_path))
    pool.close()  # as the main process does when it leaves, while a worker may still make a slot
    with pytest.raises(pf.PackedFormatError, match="closed"):
        pool.take((8, 8))
    assert os.listdir(tmp_path) == []


def test_a_worker_out_of_shared_memory_names_the_archive_and_the_remedy(monkeypatch, tmp_path):
    import errno

    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: _Info(0))

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    pool = BatchSlots(1, directory=os.fspath(tmp_path), path="/data/set.memmap")
    with pytest.raises(pf.PackedFormatError, match="no room left") as info:
        pool.take((64, 64))
    assert info.value.path == "/data/set.memmap" and "--shm-size" in info.value.hint
    assert os.listdir(tmp_path) == []


def test_registered_slots_must_be_a_bool(archive):
    with pytest.raises(ValueError, match="registered_slots"):
        pf.make_loader(archive, registered_slots="yes")


# ---- CUDA ---------------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_registered_slots_copy_straight_to_the_gpu(archive):
    expected = list(pf.make_loader(archive, batch_size=BATCH, num_workers=0, seed=5, return_index=True))
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, seed=5, device="cuda", registered_slots=True,
                            multiprocessing_context="fork", return_index=True)
    assert not loader.dataloader.pin_memory
    pool = loader.batch_reader.pool
    for _ in range(3):
        got = list(loader)
        assert len(got) == len(expected)
        for (a, la, ia), (b, lb, ib) in zip(expected, got):
            assert b.device.type == "cuda" and torch.equal(a, b.cpu()) and torch.equal(la, lb.cpu())
            assert torch.equal(ia, ib)
    assert pool.receiver.maps and all(m.registered for m in pool.receiver.maps.values())
    del got, b, lb, ib
    torch.cuda.synchronize()
    gc.collect()
    assert int((pool.states == SENT).sum()) == 0
    token = pool.token
    del loader, pool
    assert wait_for_no_files(token) == []


@needs_cuda
def test_cuda_keeps_the_pin_memory_thread_unless_registered_slots_are_asked_for(archive):
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, device="cuda")
    assert loader.dataloader.pin_memory and isinstance(loader.batch_reader.pool, SlotPool)



def test_an_environment_variable_turns_the_slots_off(archive, monkeypatch):
    monkeypatch.setenv("PF_BATCH_SLOTS", "0")
    loader = pf.make_loader(archive, batch_size=BATCH, num_workers=2, multiprocessing_context="fork")
    assert isinstance(loader.batch_reader.pool, SlotPool)
    assert sum(len(labels) for _, labels in loader) == N


def test_a_slot_lost_with_its_dying_worker_names_the_worker():
    """A worker killed while its batch is on the way: the main process cannot take the slot's memory over (the
    worker's descriptor sharer is gone), and may see that before the worker is reaped.  The error names the dead
    worker, as torch's own report of it is named."""
    import multiprocessing

    from packed_formats.loading.loader import _naming_dead_workers

    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    worker.start()

    class Batches:
        _workers = [worker]

        def __iter__(self):
            return self

        def __next__(self):
            os.kill(worker.pid, signal.SIGKILL)  # dies as its batch is received: reaped only later
            raise slots.HandoverError("set.zip", "cannot map DataLoader worker 0's batch slot 0: ConnectionResetError")

    with pytest.raises(pf.DataLoaderWorkerError, match=f"worker 0, pid {worker.pid}, killed by SIGKILL"):
        next(_naming_dead_workers(Batches(), "set.zip"))
    worker.join()

"""Batch buffers: huge-page allocation, and shared slots that workers reuse but never overwrite early."""

from __future__ import annotations

import gc
import multiprocessing
import subprocess
import sys
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from torch.multiprocessing import reductions

import packed_formats as pf
from packed_formats import memory
from packed_formats import transforms as T
from packed_formats.memory import FREE, SENT, SlotPool

from .conftest import digest, sample_lookup

# where this torch keeps received storages alive, the pool is off (test_compat checks that it says so)
POOLING = pytest.mark.skipif(not memory.storage_lifetime_is_tracked(), reason="batch slot pooling is off on this torch")
START_METHODS = [m for m in ("fork", "spawn", "forkserver") if m in multiprocessing.get_all_start_methods()]
# spawn and forkserver start a fresh interpreter per worker: the quick tier keeps fork only
START_METHOD_PARAMS = [pytest.param(m, marks=pytest.mark.slow) if m != "fork" else m for m in START_METHODS]


class _Info:
    def __init__(self, worker_id):
        self.id = worker_id


@pytest.fixture
def as_worker(monkeypatch):
    """Pretend this process is DataLoader worker 0."""
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: _Info(0))


def round_trip(obj):
    """What the main process gets when a worker returns obj (the DataLoader's pickling).

    torch's cache of shared storages is cleared in between, so that, as in
    another process, the receiver maps the memory anew instead of finding the
    sender's storage object.  Sending a file descriptor starts multiprocessing's
    resource sharer thread, which a worker has but the main process must not:
    it is stopped once the descriptor is received, so that no later fork finds it.
    """
    data = bytes(ForkingPickler.dumps(obj))
    reductions.shared_cache.clear()
    try:
        return ForkingPickler.loads(data)
    finally:
        resource_sharer.stop()


def test_empty_is_a_writable_tensor_of_the_asked_layout():
    t = memory.empty((4, 3, 64, 512), torch.float32, memory_format=torch.channels_last)
    assert t.shape == (4, 3, 64, 512) and t.dtype == torch.float32
    assert t.is_contiguous(memory_format=torch.channels_last)
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * t.numel()


@POOLING
def test_storage_lifetime_is_tracked_on_this_torch():
    # the pool's safety rests on this; if torch changes it, pooling turns itself off
    assert memory.storage_lifetime_is_tracked()


def test_take_outside_a_worker_gives_nothing():
    assert SlotPool(2, min_bytes=0).take((8, 8)) is None


@POOLING
def test_small_batches_are_not_pooled(as_worker):
    pool = SlotPool(1, min_bytes=1 << 20)
    assert pool.take((100, 100)) is None
    assert pool.take((1024, 1024)) is not None


@POOLING
def test_a_slot_is_reused_only_after_the_receiver_drops_the_batch(as_worker):
    pool = SlotPool(1, slots=2, min_bytes=0)
    first = pool.take((16, 16))
    first.fill_(1)
    received = round_trip(pool.send(first))
    pool.end_batch()
    assert pool.states[0, 0] == SENT and torch.all(received == 1)

    second = pool.take((16, 16))  # slot 0 is held: slot 1
    assert second.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    second.fill_(2)
    kept_view = round_trip(pool.send(second))[3:5]
    pool.end_batch()
    assert pool.take((16, 16)) is None  # both held: the worker must not write either
    pool.end_batch()

    del received
    gc.collect()
    assert pool.states[0, 0] == FREE and pool.states[0, 1] == SENT  # a view keeps its batch alive
    third = pool.take((16, 16))
    assert third.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    third.fill_(3)
    assert torch.all(kept_view == 2)


@POOLING
def test_a_batch_outside_the_pool_is_sent_as_a_copy_in_a_slot(as_worker):
    pool = SlotPool(1, slots=1, min_bytes=0)
    batch = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 4, 5, 3).permute(0, 3, 1, 2)  # channels last
    received = round_trip(pool.send(batch))
    pool.end_batch()
    assert torch.equal(received, batch) and received.is_contiguous(memory_format=torch.channels_last)
    assert pool.states[0, 0] == SENT
    assert round_trip(pool.send(batch.clone())).untyped_storage().data_ptr() != received.untyped_storage().data_ptr()


@POOLING
def test_slots_taken_within_one_batch_are_distinct_and_unsent_ones_are_never_reused(as_worker):
    pool = SlotPool(1, slots=3, min_bytes=0)
    a, b = pool.take((8, 8)), pool.take((8, 8))
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    a.fill_(7)
    pool.end_batch()  # a and b were not sent: whoever still holds them keeps them as they are
    c = pool.take((8, 8))
    c.fill_(0)
    assert torch.all(a == 7)
    assert c.untyped_storage().data_ptr() not in {a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()}


@pytest.mark.parametrize("transform", [T.Normalize(), T.ToFloat()], ids=["normalize", "to_float"])
@POOLING
def test_float_results_are_born_in_a_slot_and_sent_without_a_copy(as_worker, transform):
    pool = SlotPool(1, slots=2, min_bytes=0)
    batch = torch.randint(0, 256, (2, 5, 6, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
    expected = transform(batch)
    out = transform(batch, allocate=pool.take)
    assert torch.equal(out, expected) and out.is_contiguous(memory_format=torch.channels_last)
    sent = pool.send(out)
    assert sent.tensor is out and pool.states[0].tolist().count(SENT) == 1
    assert torch.equal(round_trip(sent), expected)


@POOLING
def test_a_too_small_free_slot_is_replaced(as_worker):
    pool = SlotPool(1, slots=1, min_bytes=0)
    small = pool.take((8, 8))
    pool.end_batch()
    big = pool.take((64, 64))
    assert big.untyped_storage().nbytes() >= 64 * 64
    assert big.untyped_storage().data_ptr() != small.untyped_storage().data_ptr()


def pooled_loader(path, **options):
    """A loader whose worker processes send batches in slots (raw batches would otherwise be gathered by threads)."""
    if options.get("num_workers"):
        options.setdefault("multiprocessing_context", "fork" if "fork" in START_METHODS else None)
    loader = pf.make_loader(path, **options)
    loader.batch_reader.pool.min_bytes = 0  # pool even these tiny test batches
    return loader


@POOLING
def test_kept_batches_stay_intact_while_workers_reuse_slots(uniform):
    check_kept_batches(uniform, "fork" if "fork" in START_METHODS else None)


@pytest.mark.parametrize("start_method", START_METHOD_PARAMS)
@pytest.mark.parametrize("kind", [("memmap", "raw"), ("zip", "encoded")], ids="-".join)
@POOLING
def test_kept_batches_stay_intact_under_every_start_method(uniform_archives, kind, start_method):
    check_kept_batches(uniform_archives[kind], start_method)


def check_kept_batches(path, start_method):
    lookup = sample_lookup(path)
    loader = pooled_loader(path, batch_size=2, num_workers=2, multiprocessing_context=start_method)
    kept = []
    for _ in range(2):
        kept.extend(images for images, _ in loader)
    pool = loader.batch_reader.pool
    assert int((pool.states == SENT).sum()) == 2 * pool.states.shape[1]  # every slot is held by us
    for images in kept:  # were any overwritten, their pixels would match no sample (or repeat)
        assert all(digest(image) in lookup for image in images)
    n = len(loader)
    per_epoch = [[lookup[digest(image)] for images in kept[k * n : (k + 1) * n] for image in images] for k in range(2)]
    assert all(sorted(order) == list(range(len(lookup))) for order in per_epoch)

    del kept, images
    gc.collect()
    assert int((pool.states == SENT).sum()) == 0  # dropped batches free their slots


@pytest.mark.parametrize("start_method", START_METHOD_PARAMS)
def test_pooled_float_batches_equal_the_in_process_ones(uniform_archives, start_method):
    path = uniform_archives[("memmap", "raw")]
    options = dict(batch_size=5, transform=T.train(16), seed=3)
    expected = [images for images, _ in pf.make_loader(path, num_workers=0, **options)]
    loader = pooled_loader(path, num_workers=2, multiprocessing_context=start_method, **options)
    for _ in range(2):  # the second epoch reuses the first epoch's slots
        got = [images.clone() for images, _ in loader]
        loader.set_epoch(0)
        assert len(got) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize(
    "persistent", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["persistent", "fresh-workers"]
)
def test_leaving_epochs_early_leaves_no_slot_held(uniform, persistent):
    loader = pooled_loader(uniform, batch_size=2, num_workers=2, persistent_workers=persistent)
    for _ in range(3):
        batches = iter(loader)
        held = [next(batches) for _ in range(3)]  # then leave the epoch with batches in flight
        del batches, held
    labels = np.concatenate([labels.numpy() for _, labels in loader])
    gc.collect()
    assert sorted(labels) == sorted(loader.reader.labels)
    assert int((loader.batch_reader.pool.states == SENT).sum()) == 0


@pytest.mark.slow
@POOLING
def test_pooling_works_under_the_file_system_sharing_strategy(uniform_archives, tmp_path):
    # HPC users switch to "file_system" when workers run out of file descriptors
    script = tmp_path / "probe.py"
    script.write_text(
        "import gc, sys, torch, torch.multiprocessing\n"
        "import packed_formats as pf\n"
        "torch.multiprocessing.set_sharing_strategy('file_system')\n"
        "loader = pf.make_loader(sys.argv[1], batch_size=2, num_workers=2, shuffle=False,\n"
        "                        multiprocessing_context='fork')  # worker processes, in slots\n"
        "loader.batch_reader.pool.min_bytes = 0\n"
        "kept = [images for _ in range(2) for images, _ in loader]\n"
        "dataset = pf.PackedDataset(sys.argv[1], output='tensor')\n"
        "expected = torch.stack([dataset[i][0] for i in range(len(loader.reader))])\n"
        "assert all(torch.equal(b, expected[2 * (k % len(loader)):][:2]) for k, b in enumerate(kept))\n"
        "states = loader.batch_reader.pool.states\n"
        "assert int(states.sum()) == states.numel(), states\n"
        "del kept\n"
        "gc.collect()\n"
        "assert int(states.sum()) == 0, states\n"
        "print('ok')\n"
    )
    path = uniform_archives[("lmdb", "raw")]
    done = subprocess.run([sys.executable, str(script), path], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# ---- read buffers a process reuses (memory.ReusedBuffers) ----------------------------------------


def test_a_read_buffer_is_reused_only_once_nothing_refers_to_it():
    buffers = memory.ReusedBuffers(keep=2)
    first = buffers.take((4, 5))
    address = first.data_ptr()
    second = buffers.take((4, 5))
    view = first[1:]
    del first
    assert buffers.take((4, 5)).data_ptr() not in (address, second.data_ptr())  # a view still uses it
    del view
    array = buffers.take((4, 5)).numpy()  # the tensor dies, a numpy array made from it does not
    assert array.ctypes.data == address
    assert buffers.take((2, 5)).data_ptr() != address
    del array
    assert buffers.take((2, 5)).data_ptr() == address  # smaller requests fit in a kept buffer


def test_in_process_batches_the_caller_keeps_are_never_overwritten(uniform):
    check_kept_batches_without_pool(uniform, num_workers=0)


@pytest.mark.parametrize("start_method", START_METHOD_PARAMS)
def test_a_transform_returning_a_view_of_the_read_buffer_keeps_its_batches(uniform_archives, start_method):
    """CenterCrop gives a view of the buffer a worker read into: that buffer must not be read into again
    before the batch has left the worker (the DataLoader pickles it later, in another thread)."""
    check_kept_batches_without_pool(uniform_archives[("memmap", "raw")], transform=T.CenterCrop(6), num_workers=2,
                                    multiprocessing_context=start_method)


def check_kept_batches_without_pool(path, transform=None, **options):
    dataset = pf.PackedDataset(path, output="tensor")
    as_delivered = transform or (lambda batch: batch)
    lookup = {digest(as_delivered(dataset[i][0][None])[0]): i for i in range(len(dataset))}
    loader = pf.make_loader(path, batch_size=3, transform=transform, **options)
    kept = [images for _ in range(2) for images, _ in loader]
    assert all(digest(image) in lookup for images in kept for image in images)
    n = len(loader)
    per_epoch = [[lookup[digest(image)] for images in kept[k * n : (k + 1) * n] for image in images] for k in range(2)]
    assert all(sorted(order) == list(range(len(lookup))) for order in per_epoch)
    if options["num_workers"] == 0:  # dropped batches give their memory back to the next reads
        addresses = set()
        del kept
        for images, _ in loader:
            addresses.add(images.data_ptr())
            del images
        # two buffers take turns (the loader's generator holds on to the batch it yielded last)
        assert len(addresses) <= 2 < len(loader)


def test_read_buffers_of_any_dtype_and_layout_are_reused_best_fit():
    buffers = memory.ReusedBuffers(keep=2)
    big = buffers.take((2, 3, 4, 5), torch.float32, torch.channels_last)
    assert big.dtype == torch.float32 and big.shape == (2, 3, 4, 5)
    assert big.is_contiguous(memory_format=torch.channels_last)
    small = buffers.take((8,))
    big_address, small_address = big.data_ptr(), small.data_ptr()
    del big, small
    assert buffers.take((8,)).data_ptr() == small_address  # the small one, though the big one is free too
    assert buffers.take((2, 3, 4, 5), torch.float32).data_ptr() == big_address


def test_in_process_augmented_batches_the_caller_keeps_are_never_overwritten(uniform_archives):
    path = uniform_archives[("memmap", "raw")]
    options = dict(batch_size=3, transform=T.train(16), seed=5, num_workers=0)
    kept = [images for images, _ in pf.make_loader(path, **options)]
    again = [images.clone() for images, _ in pf.make_loader(path, **options)]
    assert len(kept) == len(again) > 4
    assert all(torch.equal(a, b) for a, b in zip(kept, again))

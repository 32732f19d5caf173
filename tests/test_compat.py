"""What depends on the installed torch is checked at run time, and said when it is turned off.

The batch slot pool gives a shared-memory slot back when the main process drops the
last tensor over a received batch.  That rests on how torch keeps the Python object
of a received storage; where a release keeps it longer (torch 2.8 does, through its
cache of received storages), the pool must turn itself off and say so, never hold
every slot forever.  ``make test-compat`` runs these on the oldest and newest releases.
"""

from __future__ import annotations

import gc
import multiprocessing
import threading
import warnings
import weakref

import pytest
import torch
from torch.multiprocessing import reductions

import packed_formats as pf
from packed_formats import memory
from packed_formats.memory import PoolingOffWarning, SlotPool

FORK = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")


@pytest.fixture
def unchecked(monkeypatch):
    """The storage lifetime check and its warning as in a process that has not made a pool yet."""
    monkeypatch.setattr(memory, "_LIFETIME_TRACKED", None)
    monkeypatch.setattr(memory, "_WARNED_OFF", False)


def _send_a_shared_tensor(to_main, to_child) -> None:
    tensor = torch.empty(0, dtype=torch.uint8).set_(memory.shared_storage(64))
    to_main.put(tensor)
    to_child.get(timeout=60)  # hold the sender's side until the receiver is done


def _received_storage_goes_with_its_tensor() -> bool:
    """Send a shared tensor from a forked process, as a worker sends a batch, and watch its storage here."""
    context = multiprocessing.get_context("fork")
    to_main, to_child = torch.multiprocessing.get_context("fork").Queue(), context.Queue()
    child = context.Process(target=_send_a_shared_tensor, args=(to_main, to_child))
    child.start()
    try:
        received = to_main.get(timeout=60)
        fired = []
        weakref.finalize(received.untyped_storage(), fired.append, True)
        alive_while_used = not fired
        del received
        return alive_while_used and bool(fired)
    finally:
        to_child.put(None)
        child.join(60)


@FORK
def test_the_run_time_check_agrees_with_a_real_handover_between_processes(unchecked):
    assert memory.storage_lifetime_is_tracked() == _received_storage_goes_with_its_tensor()


def test_a_pool_says_once_when_this_torch_turns_it_off(unchecked):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pools = [SlotPool(2), SlotPool(3)]
    said = [w for w in record if issubclass(w.category, PoolingOffWarning)]
    on = memory.storage_lifetime_is_tracked()
    assert all(pool.enabled == on for pool in pools)
    assert len(said) == (0 if on else 1)
    assert all(len(str(w.message).splitlines()) == 1 for w in said)


def test_a_torch_that_keeps_received_storages_alive_turns_the_pool_off_with_a_warning(unchecked, monkeypatch):
    # as torch 2.8 does: something keeps a strong reference to every storage it receives
    kept = []
    for name in ("rebuild_storage_fd", "rebuild_storage_filename"):
        receive = getattr(reductions, name)

        def keeping(*args, _receive=receive):
            storage = _receive(*args)
            kept.append(storage)
            return storage

        monkeypatch.setattr(reductions, name, keeping)
    with pytest.warns(PoolingOffWarning, match="do not reuse batch slots"):
        pool = SlotPool(2, min_bytes=0)
    assert kept and not pool.enabled
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: type("Info", (), {"id": 0})())
    assert pool.take((8, 8)) is None  # each batch then gets fresh shared memory


def _threads() -> set:
    return {t for t in threading.enumerate() if t.is_alive()}


def test_checking_the_storage_lifetime_starts_no_thread(unchecked):
    # Python 3.12+ warns of forking while threads run, and a forked worker may deadlock on a lock
    # a thread held: nothing the main process does before workers fork may leave one behind
    before = _threads()
    SlotPool(2)
    assert _threads() == before


@FORK
def test_no_thread_of_ours_outlives_a_loader(uniform_archives):
    before = _threads()
    loader = pf.make_loader(uniform_archives[("memmap", "raw")], batch_size=8, num_workers=2,
                            multiprocessing_context="fork")
    for _ in range(2):
        assert sum(len(labels) for _, labels in loader) == 24
    del loader
    gc.collect()
    for thread in _threads() - before:  # multiprocessing's queue feeders end just after their queue closes
        thread.join(timeout=10)
    assert {t.name for t in _threads() - before} == set()

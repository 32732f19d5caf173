"""The per-process handle table (packed_formats/handles.py)."""

from __future__ import annotations

import gc
import threading

import packed_formats as pf
from packed_formats import handles


def test_a_reader_collected_while_another_handle_opens_does_not_deadlock(archives):
    """Opening can trigger garbage collection; a collected reader releases its handle from inside acquire()."""
    reader = pf.open_archive(archives[("zip", "raw")])
    reader.read(0)
    cycle = [reader]
    cycle.append(cycle)  # only the cycle collector frees it, at a moment of its choosing
    del reader, cycle

    def open_collecting():
        gc.collect()
        return "handle"

    done = []
    key = ("test", "collect-during-open")
    thread = threading.Thread(
        target=lambda: done.append(handles.acquire(key, open_collecting, lambda h: None)), daemon=True
    )
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "acquire() deadlocked while a collected reader released its handle"
    assert done == ["handle"]
    handles.release(key)
    assert key not in handles.open_handles()
    assert not any(k[0] == "zip" for k in handles.open_handles())


def test_handles_are_shared_and_closed_with_their_last_user():
    closed = []
    key = ("test", "shared")
    first = handles.acquire(key, lambda: object(), closed.append)
    second = handles.acquire(key, lambda: object(), closed.append)
    assert first is second and handles.open_handles()[key][2] == 2
    handles.release(key)
    assert closed == []
    handles.release(key)
    assert closed == [first] and key not in handles.open_handles()


def test_a_claim_keeps_no_opener_so_its_owner_goes_with_its_last_reference():
    """The opener is given to each get(): an owner that kept its bound method in its claim would be
    in a reference cycle, and its handle would stay open until the garbage collector ran."""
    closed = []

    class Owner:
        def __init__(self) -> None:
            self.claim = handles.SharedHandle(("test", "owner"), closed.append)

        def open(self) -> str:
            return "handle"

        def handle(self) -> str:
            return self.claim.get(self.open)

        def __del__(self) -> None:
            self.claim.release()

    gc.disable()
    try:
        owner = Owner()
        assert owner.handle() == "handle" and ("test", "owner") in handles.open_handles()
        del owner
        assert closed == ["handle"] and ("test", "owner") not in handles.open_handles()
    finally:
        gc.enable()

"""Real multi-process loading: every start method, worker count and persistence."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import zlib

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import packed_formats as pf
from packed_formats import codecs, handles

from .conftest import ALL_KINDS, kind_id
from .probe import Probe, as_list, mark_parent_handle

START_METHODS = ["fork", "spawn", "forkserver"]


def expected_crcs(dataset: pf.PackedDataset):
    out = []
    for i in range(len(dataset)):
        stored = dataset.reader.read(i)
        pixels = stored if isinstance(stored, np.ndarray) else codecs.decode(stored)
        out.append(zlib.crc32(np.ascontiguousarray(pixels.transpose(2, 0, 1)).tobytes()))
    return out


def context(method):
    return multiprocessing.get_context(method)  # a forkserver preloads what conftest.FORKSERVER_PRELOAD names


def run_epochs(dataset, epochs=2, **loader_options):
    loader = DataLoader(Probe(dataset), batch_size=5, shuffle=True, collate_fn=as_list, **loader_options)
    return [[item for batch in loader for item in batch] for _ in range(epochs)]


# Which start method runs with which archive.  fork runs with every format and mode: a forked worker
# inherits the parent's objects, its open handle among them, and every backend must notice.  spawn and
# forkserver start a fresh interpreter that receives the reader by pickle and opens it anew, which is the
# backend's doing, not the mode's: the mode only decides how a sample is decoded once read, the same under
# every start method (the fork cases check that for every mode).  So spawn runs with every format in raw
# mode and forkserver in encoded mode (a folder, encoded only, gets both): every format meets both fresh
# interpreters, and each mode meets one.
FRESH_INTERPRETER_MODE = {"spawn": "raw", "forkserver": "encoded"}


def loading_cases():
    cases = []
    for kind in ALL_KINDS:
        cases.append(pytest.param(kind, None, 0, False, id=f"{kind_id(kind)}-main-process"))
        for method in START_METHODS:
            if method in FRESH_INTERPRETER_MODE and kind[0] != "folder" and kind[1] != FRESH_INTERPRETER_MODE[method]:
                continue
            for persistent in (False, True):
                name = f"{kind_id(kind)}-{method}-{'persistent' if persistent else 'fresh'}"
                cases.append(pytest.param(kind, method, 2, persistent, id=name,
                                          marks=[] if method == "fork" else [pytest.mark.slow]))  # fresh interpreters
    return cases


@pytest.mark.parametrize("kind,method,workers,persistent", loading_cases())
def test_every_sample_once_per_epoch_exact_and_read_by_its_own_handle(archives, kind, method, workers, persistent):
    """The core safety test: the reader is touched in the main process first
    (so a handle is open when workers start), then two epochs are loaded."""
    gc.collect()  # a dataset an earlier test dropped in a reference cycle may still hold this archive's handle
    dataset = pf.PackedDataset(archives[kind], output="tensor")
    expected = expected_crcs(dataset)
    dataset[0]
    key = dataset.reader.handle_key
    assert handles.open_handles()[key][0] == os.getpid()
    options = {"num_workers": workers}
    if workers:
        options.update(multiprocessing_context=context(method), persistent_workers=persistent)
    epochs = run_epochs(dataset, **options)
    for epoch in epochs:
        assert sorted(item["index"] for item in epoch) == list(range(len(dataset)))
        for item in epoch:
            assert item["crc"] == expected[item["index"]], f"sample {item['index']} differs"
            assert item["label"] == int(dataset.targets[item["index"]])
            assert item["handle_pid"] == item["pid"], "a worker used a handle it did not open"
            assert item["opens"] >= 1
    if workers:
        worker_pids = {item["pid"] for epoch in epochs for item in epoch}
        assert os.getpid() not in worker_pids
        assert len(worker_pids) == (2 if persistent else 4)
    dataset.close()
    assert key not in handles.open_handles()


def load_touched_before_fork(path):
    """(parent's handle identity, items read in the main process, items read by 2 forked workers).

    The parent reads first, so its handle is open when the workers fork, and keeps
    that handle object alive (in every forked copy too) while they read.
    """
    dataset = pf.PackedDataset(path, output="tensor")
    expected = expected_crcs(dataset)
    dataset[0]
    parent_handle = dataset.reader.handle()  # noqa: F841 - kept alive on purpose
    parent = mark_parent_handle(dataset.reader)
    (in_main,) = run_epochs(dataset, epochs=1, num_workers=0)
    (in_workers,) = run_epochs(dataset, epochs=1, num_workers=2, multiprocessing_context=context("fork"))
    for item in in_main + in_workers:
        assert item["crc"] == expected[item["index"]], f"sample {item['index']} differs"
    dataset.close()
    return parent, in_main, in_workers


def test_forked_workers_read_through_their_own_handle_not_their_parents(archives, packed_kind):
    """A dataset read before the fork, checked below our handle table: the
    file a worker reads through must not be the one its parent opened (HDF5 hands a
    child's reopen the parent's open file unless the inherited one is closed first)."""
    parent, in_main, in_workers = load_touched_before_fork(archives[packed_kind])
    assert {item["handle"] for item in in_main} == {parent}  # the identity is stable within a process
    assert sorted(item["index"] for item in in_workers) == list(range(len(in_workers)))
    for item in in_workers:
        assert item["pid"] != os.getpid()
        assert item["handle_pid"] == item["pid"], "a worker used a handle entry its parent opened"
        assert item["handle"] != parent, f"worker {item['pid']} read through the handle its parent opened"


def test_creating_a_dataset_leaves_nothing_open(archives, kind):
    gc.collect()  # as above: only this test's own handles are counted
    before = set(handles.open_handles())
    dataset = pf.PackedDataset(archives[kind])
    assert set(handles.open_handles()) == before
    dataset[1]
    assert len(handles.open_handles()) == len(before) + 1
    dataset.close()
    assert set(handles.open_handles()) == before


def test_datasets_pickle_as_a_description_and_read_after(archives, kind):
    dataset = pf.PackedDataset(archives[kind], output="tensor")
    first = dataset[3][0]  # an open handle must not travel
    blob = pickle.dumps(dataset)
    index_bytes = sum(a.nbytes for a in dataset.reader.index.arrays().values())
    assert len(blob) < index_bytes + 4096
    clone = pickle.loads(blob)
    assert torch.equal(clone[3][0], first)
    clone.close()
    dataset.close()


def open_files():
    """This process's descriptors on files and directories, as {fd: target}.

    Pipes and sockets are left out: multiprocessing opens its own for the
    forkserver and resource tracker once per process, whichever test runs first.
    """
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (e.g. listdir's own descriptor)
            continue
        if target.startswith("/"):
            found[fd] = target
    return found


@pytest.mark.parametrize("workers", [0, 2])
def test_no_file_descriptors_leak_after_loading(archives, kind, workers):
    gc.collect()
    before = open_files()
    dataset = pf.PackedDataset(archives[kind], output="tensor")
    dataset[0]
    assert any(t.startswith(os.path.realpath(archives[kind])) for t in open_files().values()) or kind[0] == "folder"
    run_epochs(dataset, epochs=1, num_workers=workers)
    dataset.close()
    gc.collect()
    leaked = {fd: t for fd, t in open_files().items() if before.get(fd) != t}
    assert leaked == {}


def test_closed_datasets_and_readers_refuse_to_read(archives, kind):
    dataset = pf.PackedDataset(archives[kind])
    dataset[0]
    dataset.close()
    with pytest.raises(pf.ClosedArchiveError, match=os.path.basename(archives[kind])):
        dataset[0]
    with pytest.raises(pf.ClosedArchiveError):
        dataset.reader.read_many([0, 1])
    assert dataset.reader.closed


def test_two_datasets_on_one_path_share_one_handle_per_process(archives, packed_kind):
    path = archives[packed_kind]
    train, val = pf.PackedDataset(path, output="tensor"), pf.PackedDataset(path, output="tensor")
    assert torch.equal(train[2][0], val[2][0])
    key = train.reader.handle_key
    assert handles.open_handles()[key][2] == 2  # two users of one handle
    train.close()
    assert torch.equal(val[5][0], pf.PackedDataset(path, output="tensor")[5][0])
    val.close()


@pytest.mark.slow
def test_lmdb_survives_forty_epochs_of_fresh_workers(archives):
    """LMDB reader slots must not run out when workers come and go."""
    dataset = pf.PackedDataset(archives[("lmdb", "raw")], output="tensor")
    dataset[0]  # the main process holds the environment throughout
    loader = DataLoader(Probe(dataset), batch_size=6, num_workers=4, collate_fn=as_list)
    for _ in range(40):
        assert sorted(item["index"] for batch in loader for item in batch) == list(range(len(dataset)))
    dataset.close()

"""Handles and worker processes go with their last user, not when the garbage collector runs.

Each test runs with the collector off: whatever a reference cycle (or a kept
error's traceback) holds stays held, and the test sees it.  The format's own
tools must open an HDF5 or LMDB archive in the same process once its last
Reader or dataset is dropped: h5py refuses a second open with other locking
flags, and py-lmdb a second environment on one file.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import traceback

import h5py
import lmdb
import pytest
import torch

import packed_formats as pf
from packed_formats.backends.reader import Reader

from .conftest import RAW_SHAPE

FORMATS = ("hdf5", "lmdb")
KINDS = [(fmt, mode, sharded) for fmt in FORMATS for mode in ("raw", "encoded") for sharded in (False, True)]
TRACKED = {Reader, pf.PackedDataset, pf.PackedLoader, torch.utils.data.DataLoader,
           torch.utils.data.dataloader._SingleProcessDataLoaderIter,
           torch.utils.data.dataloader._MultiProcessingDataLoaderIter}
BAD = 12  # a sample in the middle (of a middle part, when sharded)


def kind_name(kind) -> str:
    fmt, mode, sharded = kind
    return f"{fmt}-{mode}" + ("-sharded" if sharded else "")


@pytest.fixture(scope="module")
def sources(tmp_path_factory, image_folder):
    """{(format, mode, sharded): archive path}, sharded ones in parts of 10 samples."""
    root = tmp_path_factory.mktemp("lifetimes")
    made = {}
    for fmt, mode, sharded in KINDS:
        path = os.fspath(root / f"{kind_name((fmt, mode, sharded))}.{fmt}")
        pf.convert(image_folder, path, format=fmt, mode=mode, size=RAW_SHAPE[:2] if mode == "raw" else None,
                   shard_size=10 if sharded else None, workers=1, quiet=True)
        made[(fmt, mode, sharded)] = path
    return made


def copy_archive(src: str, directory) -> str:
    """A copy of the archive (every file of it) in ``directory``: a test that fails leaves other tests' files alone."""
    with pf.open_archive(src) as reader:
        files = reader.files()
    for name in files:
        shutil.copyfile(name, os.path.join(directory, os.path.basename(name)))
    return os.path.join(directory, os.path.basename(src))


def stored_files(path: str):
    """The HDF5 files or LMDB environments the archive keeps its samples in (a sharded one's parts)."""
    with pf.open_archive(path) as reader:
        return [name for name in reader.files() if pf.detect_format(name) in FORMATS]


def assert_tools_open(files) -> None:
    """h5py or py-lmdb opens each of these files of an archive in this process, as the README says they do."""
    for name in files:
        if name.endswith(".hdf5"):
            h5py.File(name, "r").close()
        else:
            lmdb.open(name, readonly=True, lock=False, subdir=False).close()


def tracked() -> list:
    return [o for o in gc.get_objects() if type(o) in TRACKED]


EARLIER: list = []  # what was alive before a test turned the collector off (an earlier failure's traceback)


def left_over():
    """The readers, datasets, loaders and DataLoader iterators the garbage collector still tracks, that
    were not there before the collector was turned off."""
    return sorted(type(o).__name__ for o in tracked() if not any(o is e for e in EARLIER))


@contextlib.contextmanager
def collector_off():
    gc.collect()  # what earlier tests left in cycles
    EARLIER[:] = tracked()
    gc.disable()
    try:
        yield
    finally:
        EARLIER.clear()
        gc.enable()


def damage_sample(path: str, i: int) -> None:
    """Flip the middle byte of sample i where the format says it is stored, else of every stored copy of it
    (LMDB's copy-on-write pages may keep stale ones), as a disk might: the file keeps its size and time."""
    with pf.open_archive(path) as reader:
        payload, files, location = reader.read_bytes(i), reader.files(), reader.backend.sample_location(i)
    if location is not None:
        files = [location[0]]
    found = 0
    for name in files:
        times = os.stat(name)
        with open(name, "r+b") as file:
            content = file.read()
            start = content.find(payload) if location is None else location[1]
            while start >= 0:
                where = start + len(payload) // 2
                file.seek(where)
                file.write(bytes([content[where] ^ 0xFF]))
                found += 1
                start = content.find(payload, start + 1) if location is None else -1
        os.utime(name, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert found, "the sample's bytes must be stored contiguously"


def open_user(path: str, user: str):
    return pf.open_archive(path) if user == "reader" else pf.PackedDataset(path)


def read(user_object, call: str, i: int = 0) -> None:
    """Read sample i, alone ("one") or in a batch after another ("batch")."""
    if isinstance(user_object, Reader):
        user_object.read(i) if call == "one" else user_object.read_many([1, i])
    else:
        user_object[i] if call == "one" else user_object.__getitems__([1, i])


# ---- dropping the last user closes the file at once --------------------------------------------------------
@pytest.mark.parametrize("user", ["reader", "dataset"])
@pytest.mark.parametrize("kind", KINDS, ids=kind_name)
def test_dropping_the_last_user_closes_the_archive_at_once(sources, tmp_path, kind, user):
    path = copy_archive(sources[kind], tmp_path)
    files = stored_files(path)
    with collector_off():
        user_object = open_user(path, user)
        read(user_object, "one")
        del user_object
        assert left_over() == []
        assert_tools_open(files)


@pytest.mark.parametrize("user", ["reader", "dataset"])
def test_close_and_with_blocks_close_the_archive_at_once(sources, tmp_path, user):
    path = copy_archive(sources[("lmdb", "raw", True)], tmp_path)
    files = stored_files(path)
    with collector_off():
        kept = open_user(path, user)
        read(kept, "batch")
        kept.close()
        assert_tools_open(files)
        with open_user(path, user) as inside:
            read(inside, "batch")
        assert_tools_open(files)


# ---- an error kept by its catcher keeps no handle ----------------------------------------------------------
@pytest.mark.parametrize("user", ["reader", "dataset"])
@pytest.mark.parametrize("kind", KINDS, ids=kind_name)
def test_a_kept_error_does_not_keep_the_archive_open(sources, tmp_path, kind, user):
    """Alone or in a batch, sample BAD fails; its error, kept with ``sys.exc_info()``, holds no handle."""
    path = copy_archive(sources[kind], tmp_path)
    files = stored_files(path)
    damage_sample(path, BAD)
    with collector_off():
        for call in ("one", "batch"):
            user_object = None
            try:  # the calls in this frame, as a user makes them (a helper's frame in the traceback would hold them)
                user_object = open_user(path, user)
                if isinstance(user_object, Reader):
                    user_object.read(BAD) if call == "one" else user_object.read_many([1, BAD])
                else:
                    user_object[BAD] if call == "one" else user_object.__getitems__([1, BAD])
            except pf.PackedFormatError as error:  # HDF5 may find the damage when it opens, in what it checks then
                kept, info = error, sys.exc_info()
            del user_object
            assert left_over() == [], call
            assert_tools_open(files)
            assert info[1] is kept and isinstance(kept, (pf.CorruptSampleError, pf.CorruptArchiveError))
            assert kept.path in [path] + files
            if isinstance(kept, pf.CorruptSampleError):
                assert kept.index == BAD
            printed = "".join(traceback.format_exception(type(kept), kept, kept.__traceback__))  # Python 3.9's form
            assert "Traceback" in printed  # it still prints as before
            del kept, info


def test_a_kept_error_of_a_loader_in_this_process_keeps_neither_loader_nor_archive(sources, tmp_path):
    path = copy_archive(sources[("lmdb", "raw", False)], tmp_path)
    files = stored_files(path)
    damage_sample(path, BAD)
    with collector_off():
        loader = pf.make_loader(path, batch_size=8, shuffle=False, num_workers=0)
        with pytest.raises(pf.CorruptSampleError) as info:
            list(loader)
        del loader
        assert left_over() == []
        assert_tools_open(files)
        assert info.value.index == BAD


# ---- DataLoader workers go when their loader does, after an error in one ------------------------------------
def error_classes(cls=pf.PackedFormatError):
    yield cls
    for sub in cls.__subclasses__():
        yield from error_classes(sub)


def test_every_error_class_takes_its_message_by_name_as_torch_re_raises_it():
    """torch's DataLoader re-raises a worker's error of a class with a ``message`` as ``cls(message=text)``,
    leaving no reference cycle through its frame (see the test below): every class must take that form."""
    text = "Caught CorruptSampleError in DataLoader worker process 0.\nOriginal Traceback (most recent call last): ..."
    for cls in error_classes():
        assert getattr(cls, "message", None), cls
        error = cls(message=text)
        assert type(error) is cls and str(error) == error.message == text


@pytest.mark.slow
def test_an_error_in_a_worker_leaves_no_cycle_holding_the_loader_or_its_workers(sources, tmp_path):
    """With the collector off, so that a cycle would keep them: the workers end as soon as the loader
    (make_loader's or a plain DataLoader over a PackedDataset) is dropped, and nothing of it is left."""
    path = copy_archive(sources[("lmdb", "raw", False)], tmp_path)
    damage_sample(path, BAD)
    cases = [{"loader": "make_loader", "workers": 2, "keep": False},
             {"loader": "make_loader", "workers": 2, "keep": True},
             {"loader": "make_loader", "workers": 0, "keep": True},
             {"loader": "plain", "workers": 2, "keep": False},
             {"loader": "plain", "workers": 0, "keep": False}]
    worker = os.path.join(os.path.dirname(__file__), "lifetime_worker.py")
    done = subprocess.run([sys.executable, worker, path, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["case"] for r in results] == cases
    for result in results:
        case = result["case"]
        assert result["workers_seen"] == case["workers"], result
        assert result["workers_alive"] == [], result
        assert result["objects"] == [], result
        assert result["error"] == ([path, BAD] if case["keep"] else None), result

"""Damage around the pixels is named too: index files, shard indexes, files truncated under a reader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import packed_formats as pf

from .conftest import ARCHIVE_KINDS, kind_id

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- shard indexes are confined to their directory ---------------------------------------------------
def shard_index(tmp_path, archives, parts, format="zip"):
    path = tmp_path / "index.json"
    path.write_text(json.dumps({"packed_formats_shards": 1, "format": format, "parts": parts}))
    return path


@pytest.mark.parametrize("name", ["..", ".", "", "../data-raw.zip", "sub/data-raw.zip", "/etc/passwd"])
def test_a_shard_part_outside_the_index_directory_is_refused(tmp_path, archives, name):
    path = shard_index(tmp_path, archives, [{"name": name, "count": 24}], format="folder" if name == ".." else "zip")
    with pytest.raises(pf.CorruptArchiveError, match="index.json"):
        pf.PackedDataset(path)


@pytest.mark.parametrize("part_format", ["folder", "sharded", "nonsense"])
def test_a_shard_part_must_be_a_packed_archive(tmp_path, archives, part_format):
    shutil.copyfile(archives[("zip", "raw")], tmp_path / "part.zip")
    path = shard_index(tmp_path, archives, [{"name": "part.zip", "count": 24}], format=part_format)
    with pytest.raises(pf.CorruptArchiveError, match="cannot be shards"):
        pf.PackedDataset(path)


def test_a_shard_index_naming_itself_is_refused_not_recursed(tmp_path, archives):
    path = shard_index(tmp_path, archives, [{"name": "index.json", "count": 24}], format="sharded")
    with pytest.raises(pf.CorruptArchiveError):
        pf.PackedDataset(path)


# ---- truncation under a live reader ------------------------------------------------------------------------
TRUNCATE_UNDER_READER = """
import os, sys
import packed_formats as pf
path, data_file = sys.argv[1], sys.argv[2]
reader = pf.open_archive(path)
everything = list(range(len(reader)))
before = reader.read_many(everything)   # maps the file (raw) and reads every sample
os.truncate(data_file, os.path.getsize(data_file) // 2)
try:
    after = reader.read_many(everything)
except pf.PackedFormatError as exc:
    print(type(exc).__name__, exc)
    sys.exit(0)
same = all((a == b).all() if hasattr(a, "shape") else a == b for a, b in zip(before, after))
print("read from a cache, unchanged" if same else "silently changed")
sys.exit(0 if same else 1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ARCHIVE_KINDS, ids=kind_id)
def test_an_archive_truncated_under_a_live_reader_gives_a_named_error_not_a_signal(archives, tmp_path, kind):
    src = archives[kind]
    path = os.path.join(tmp_path, os.path.basename(src))
    (shutil.copytree if os.path.isdir(src) else shutil.copyfile)(src, path)
    with pf.open_archive(path) as reader:
        data_file = reader.backend.data_file()
    result = subprocess.run(
        [sys.executable, "-c", TRUNCATE_UNDER_READER, path, data_file],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stdout} {result.stderr[-2000:]}"
    assert os.path.basename(path) in result.stdout or result.stdout.startswith("read from a cache")


# ---- source scanning --------------------------------------------------------------------------------------
def test_a_symlink_loop_in_a_source_folder_is_skipped_with_a_warning_not_multiplied(tmp_path):
    from packed_formats.backends.folder import SourceLinkWarning
    from packed_formats.synthetic import make_image_folder

    root = make_image_folder(tmp_path / "s", images_per_class=3, classes=("a", "b"), sizes=(20, 30), seed=1)
    os.symlink("..", os.path.join(root, "b", "loop"))
    os.symlink(os.path.join("..", "a"), os.path.join(root, "b", "again"))
    with pytest.warns(SourceLinkWarning, match="loop"):
        dataset = pf.PackedDataset(root)
    assert len(dataset) == 6
    assert [dataset.key(i)[0] for i in range(6)] == ["a"] * 3 + ["b"] * 3
    assert list(dataset.targets) == [0, 0, 0, 1, 1, 1]


def test_a_linked_class_directory_is_followed(tmp_path):
    from packed_formats.synthetic import make_image_folder

    elsewhere = make_image_folder(tmp_path / "elsewhere", images_per_class=2, classes=("x",), sizes=(20, 30), seed=2)
    root = make_image_folder(tmp_path / "s", images_per_class=2, classes=("a",), sizes=(20, 30), seed=3)
    os.symlink(os.path.join(elsewhere, "x"), os.path.join(root, "b"))
    dataset = pf.PackedDataset(root)
    assert dataset.classes == ["a", "b"] and list(dataset.targets) == [0, 0, 1, 1]


# ---- errors keep their class through a plain DataLoader ----------------------------------------------------
def test_a_workers_corrupt_sample_error_is_caught_as_one_in_the_main_process(archives, tmp_path):
    import torch

    path = os.path.join(tmp_path, "bad.zip")
    shutil.copyfile(archives[("zip", "raw")], path)
    with pf.open_archive(path) as reader:
        where = reader.backend.sample_location(3)
    with open(where[0], "r+b") as file:
        file.seek(where[1] + 7)
        byte = file.read(1)
        file.seek(where[1] + 7)
        file.write(bytes([byte[0] ^ 0xFF]))
    batches = iter(torch.utils.data.DataLoader(pf.PackedDataset(path), batch_size=4, num_workers=2))
    with pytest.raises(pf.CorruptSampleError, match="bad.zip") as error:
        try:
            list(batches)
        finally:  # at once: freed later by the collector (the error's traceback holds it), torch's iterator
            batches._shutdown_workers()  # waits 5 s a worker for workers it can no longer stop
    assert "index 3" in str(error.value) and "checksum mismatch" in str(error.value)
    if sys.version_info >= (3, 11):  # the fields cross in a note of the traceback text
        with pf.open_archive(archives[("zip", "raw")]) as reader:
            key = reader.key(3)
        assert (error.value.path, error.value.index, error.value.key) == (path, 3, key)
        assert error.value.problem.startswith("checksum mismatch") and error.value.hint


def test_a_message_without_the_fields_note_or_with_a_damaged_one_keeps_only_the_message():
    from packed_formats.errors import FIELDS_NOTE

    for message in ("plain text", f"text\n{FIELDS_NOTE}{{not json", f"text\n{FIELDS_NOTE}{{\"path\": 3}}"):
        error = pf.CorruptSampleError(message)
        assert (error.path, error.index, error.key, error.problem, str(error)) == (None, None, None, message, message)


# ---- every byte that decides a sample is checksummed: index arrays and the manifest -------------------------
def flip_everywhere(files, needle: bytes, offset: int) -> int:
    """Flip the byte at ``offset`` of every copy of ``needle`` in ``files``; how many copies there were."""
    found = 0
    for name in files:
        with open(name, "r+b") as file:
            content = file.read()
            start = content.find(needle)
            while start >= 0:
                file.seek(start + offset)
                file.write(bytes([content[start + offset] ^ 0x01]))
                found += 1
                start = content.find(needle, start + 1)
    return found


def damaged_copy(archives, kind, tmp_path, what: str) -> str:
    src = archives[kind]
    path = os.path.join(tmp_path, os.path.basename(src))
    (shutil.copytree if os.path.isdir(src) else shutil.copyfile)(src, path)
    with pf.open_archive(path) as reader:
        files = reader.files()
        if what == "manifest":  # one letter of a class name
            needle, offset = b'"circles"', 2
        else:
            array = getattr(reader.index, what)
            needle = array.tobytes()
            offset = len(needle) // 2 + (array.itemsize - 1 if what == "labels" else 0)
    assert flip_everywhere(files, needle, offset) > 0, f"{what} not found in the archive's files"
    return path


@pytest.mark.parametrize("what", ["labels", "keys", "crc32", "manifest"])
@pytest.mark.parametrize("kind", ARCHIVE_KINDS, ids=kind_id)
def test_a_damaged_index_or_manifest_is_named_on_open_and_by_verify(archives, tmp_path, kind, what):
    path = damaged_copy(archives, kind, tmp_path, what)
    with pytest.raises(pf.CorruptArchiveError, match=os.path.basename(path)):
        pf.PackedDataset(path)
    with pytest.raises(pf.PackedFormatError):
        pf.verify_archive(path)


# ---- image content: bit depth ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_a_16_bit_png_converts_to_its_8_bit_values_not_to_white(tmp_path, mode):
    import io

    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 65535, 64).astype(np.uint16).reshape(8, 8)
    root = tmp_path / "src"
    (root / "a").mkdir(parents=True)
    buffer = io.BytesIO()
    Image.fromarray(ramp).save(buffer, "PNG")
    (root / "a" / "ramp.png").write_bytes(buffer.getvalue())
    pf.convert(root, tmp_path / "out.memmap", mode=mode, size=8 if mode == "raw" else None, workers=1, quiet=True)
    image = pf.PackedDataset(tmp_path / "out.memmap", output="numpy")[0][0]
    expected = (ramp / 257.0).round()
    assert np.abs(image[:, :, 0].astype(float) - expected).max() <= 1
    assert abs(float(image.mean()) - float(expected.mean())) < 1  # not near-white


def test_file_names_that_are_not_utf8_round_trip_as_keys(tmp_path):
    from packed_formats.synthetic import make_image_folder

    root = make_image_folder(tmp_path / "s", images_per_class=2, classes=("a",), sizes=(20, 30), seed=5)
    first = sorted(os.listdir(os.path.join(root, "a")))[0]
    odd = os.fsdecode(b"caf\xe9-latin1.jpg")  # a Latin-1 name: not valid UTF-8
    os.rename(os.path.join(root, "a", first), os.path.join(root, "a", odd))
    folder = pf.PackedDataset(root)
    keys = [folder.key(i) for i in range(len(folder))]
    assert os.path.join("a", odd) in keys
    pf.convert(root, tmp_path / "out.zip", workers=1, quiet=True)
    packed = pf.PackedDataset(tmp_path / "out.zip")
    assert [packed.key(i) for i in range(len(packed))] == keys
    assert os.path.exists(os.path.join(root, packed.key(keys.index(os.path.join("a", odd)))))


# ---- a dead worker is named -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [("memmap", "raw"), ("zip", "encoded")], ids=kind_id)
def test_a_killed_make_loader_worker_is_reported_by_number_pid_and_signal(uniform_archives, kind):
    import signal

    loader = pf.make_loader(uniform_archives[kind], batch_size=2, num_workers=2, shuffle=False,
                            multiprocessing_context="fork")  # worker processes, even for raw batches
    batches = iter(loader)
    next(batches)
    victim = loader.dataloader._iterator._workers[1].pid  # torch's worker processes (persistent)
    with pytest.raises(pf.DataLoaderWorkerError, match=rf"worker 1, pid {victim}, killed by SIGKILL"):
        os.kill(victim, signal.SIGKILL)  # torch notices in the main thread: here, inside the loop
        for _ in batches:
            pass


@pytest.mark.timeout(120)  # what it guards against is a hang
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_worker_killed_holding_the_stop_events_lock_is_still_reported(uniform_archives, start):
    """torch asks its workers' shared stop event whether it is set, for every index, and again when it
    notices a dead worker.  Where asking takes the event's lock, a worker killed while it held it (the
    out-of-memory killer picks no good moment) leaves it locked and the main process waits forever.
    The lock held here, for the whole read, stands for such a worker: the death is still reported."""
    import signal

    loader = pf.make_loader(uniform_archives[("memmap", "raw")], batch_size=2, num_workers=2, shuffle=False,
                            multiprocessing_context=start)
    batches = iter(loader)
    next(batches)
    iterator = loader.dataloader._iterator
    victim = iterator._workers[1].pid
    stop_lock = iterator._workers_done_event._cond
    assert stop_lock.acquire(timeout=10)
    try:
        with pytest.raises(pf.DataLoaderWorkerError, match=rf"worker 1, pid {victim}, killed by SIGKILL"):
            os.kill(victim, signal.SIGKILL)
            for _ in batches:
                pass
    finally:
        stop_lock.release()  # the loader's own shutdown sets the event: under the lock, as it should


@pytest.mark.parametrize("mode,warned", [("raw", True), ("encoded", False)])
def test_a_dropped_alpha_channel_is_said_once_per_conversion(tmp_path, mode, warned):
    import io
    import warnings

    import numpy as np
    from PIL import Image

    root = tmp_path / "src"
    (root / "a").mkdir(parents=True)
    for k in range(3):
        buffer = io.BytesIO()
        Image.fromarray(np.full((8, 8, 4), 60 * k, dtype=np.uint8), "RGBA").save(buffer, "PNG")
        (root / "a" / f"{k}.png").write_bytes(buffer.getvalue())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pf.convert(root, tmp_path / "out.zip", mode=mode, size=8 if mode == "raw" else None, workers=1, quiet=True)
    alpha = [w for w in caught if "transparency" in str(w.message)]
    assert len(alpha) == (1 if warned else 0)
    if warned:
        assert "3 image(s)" in str(alpha[0].message) and issubclass(alpha[0].category, pf.SourceWarning)


def test_verify_once_checks_a_sample_the_first_time_each_process_reads_it(uniform, monkeypatch):
    import mmap

    checked = []
    real = type(pf.open_archive(uniform)).check_sample
    monkeypatch.setattr(type(pf.open_archive(uniform)), "check_sample",
                        lambda self, i, blob: checked.append(i) or real(self, i, blob))
    with pf.open_archive(uniform, verify="once") as reader:
        reader.read(3), reader.read(3), reader.read(11)
        reader.read_many([3, 11, 12, 12])
        assert checked == [3, 11, 12]
        reader.read_many([len(reader) - 1])
        assert checked[-1] == len(reader) - 1
        # one bit per sample, on a private anonymous map: zero pages that cost nothing until set
        bits = reader._verified.get()
        assert bits.nbytes == (len(reader) + 7) // 8 and isinstance(getattr(bits.base, "obj", None), mmap.mmap)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a forked worker checks again, for itself
            checked.clear()
            reader.read(3)
            os.write(write, json.dumps(checked).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        assert json.loads(os.read(read, 100)) == [3]
        reader.read(3)
        assert checked == [3, 11, 12, len(reader) - 1]
    with pf.open_archive(uniform, verify=True) as reader:
        reader.read(3), reader.read(3)
    assert checked[-2:] == [3, 3]


def test_the_workers_context_keeps_the_start_method_and_reads_the_stop_event_without_its_lock(uniform_archives):
    import multiprocessing

    from packed_formats.loading.worker_context import LockFreeEvent, worker_context

    default = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    for given, method in [(None, default), ("spawn", "spawn"),
                          (multiprocessing.get_context("forkserver"), "forkserver")]:
        context = worker_context(given)
        assert isinstance(context, multiprocessing.context.BaseContext)
        assert context.get_start_method() == method and worker_context(context) is context
        event = context.Event()
        assert isinstance(event, LockFreeEvent) and not event.is_set()
        with event._cond:  # held, as by a killed worker: asking does not wait for it
            assert not event.is_set()
        event.set()
        assert event.is_set()
        event.clear()
        assert not event.is_set()
    assert worker_context("no-such-method") == "no-such-method"  # torch names the valid ones
    default_context = multiprocessing.context._default_context  # a context torch takes, not a standard one
    assert worker_context(default_context) is default_context
    with pytest.raises(ValueError, match="start method"):
        pf.make_loader(uniform_archives[("memmap", "raw")], num_workers=1, multiprocessing_context="no-such-method")

"""stage(): one verified node-local copy per node, however many processes ask at once."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import shutil
import time

import pytest

import packed_formats as pf
from packed_formats import cli
from packed_formats.backends.sharded import ShardedWriter
from packed_formats.stage import stage_archive
from packed_formats.verify import verify_archive

from .conftest import expected_samples

RANKS = 4


def copy_archive(path: str, directory) -> str:
    """A private copy of a fixture archive, safe to damage."""
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(os.fspath(directory), os.path.basename(path))
    if os.path.isdir(path):
        shutil.copytree(path, target)
    else:
        shutil.copyfile(path, target)
    return target


def archive_file_paths(path: str):
    if not os.path.isdir(path):
        return [path]
    return [os.path.join(path, name) for name in sorted(os.listdir(path))]


def corrupt_one_sample(path: str) -> int:
    """Flip one byte in the middle of a sample's stored bytes; return that sample's index."""
    with pf.open_archive(path) as reader:
        blobs = [reader.read_bytes(i) for i in range(len(reader))]
    for i in range(len(blobs) // 2, len(blobs)):
        for name in archive_file_paths(path):
            with open(name, "rb") as file:
                data = bytearray(file.read())
            at = data.find(blobs[i])
            if at >= 0 and data.find(blobs[i], at + 1) < 0:
                data[at + len(blobs[i]) // 2] ^= 0xFF
                with open(name, "wb") as file:
                    file.write(data)
                return i
    raise AssertionError(f"no sample of {path} is stored contiguously")


def leftovers(directory) -> list:
    """Entries of a staging directory other than archives and the lock files."""
    return sorted(n for n in os.listdir(directory)
                  if n.startswith(".") and not n.endswith((".pf-stage.lock", ".pf-staged")))


def assert_same_archive(copy: str, source: str) -> None:
    with pf.open_archive(copy) as staged, pf.open_archive(source) as original:
        assert staged.manifest == original.manifest
        assert staged.format_name == original.format_name
        assert [staged.read_bytes(i) for i in range(len(staged))] == [
            original.read_bytes(i) for i in range(len(original))
        ]
        assert list(staged.labels) == list(original.labels)


def test_stage_copies_the_archive_into_the_directory(archives, packed_kind, tmp_path):
    source = archives[packed_kind]
    result = stage_archive(source, tmp_path / "local")
    assert result.copied
    assert result.path == os.path.join(tmp_path / "local", os.path.basename(source))
    assert_same_archive(result.path, source)
    assert leftovers(tmp_path / "local") == []


def test_stage_returns_the_local_path(archives, tmp_path):
    source = archives[("zip", "raw")]
    assert pf.stage(source, tmp_path) == os.path.join(tmp_path, os.path.basename(source))


def _stage_in_process(source, directory, barrier, results):
    barrier.wait()
    try:
        result = stage_archive(source, directory)
    except Exception as exc:  # reported, so the parent never waits for a result that will not come
        results.put((os.getpid(), repr(exc), None))
        raise
    results.put((os.getpid(), result.path, result.copied))


def stage_from_ranks(source: str, directory: str) -> list:
    """Fork RANKS processes that call stage_archive at the same moment; their (pid, path, copied)."""
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(RANKS), context.Queue()
    work = (source, directory, barrier, results)
    ranks = [context.Process(target=_stage_in_process, args=work) for _ in range(RANKS)]
    for rank in ranks:
        rank.start()
    outcomes = [results.get(timeout=120) for _ in ranks]
    for rank in ranks:
        rank.join(timeout=60)
        assert rank.exitcode == 0
    return outcomes


def assert_one_verified_copy(outcomes: list, source: str, directory: str) -> None:
    assert len({pid for pid, _, _ in outcomes}) == RANKS
    assert len({path for _, path, _ in outcomes}) == 1
    assert sum(copied for _, _, copied in outcomes) == 1
    assert_same_archive(outcomes[0][1], source)
    assert leftovers(directory) == []


def test_concurrent_stage_from_forked_processes_makes_one_verified_copy(archives, packed_kind, tmp_path):
    source, directory = archives[packed_kind], os.fspath(tmp_path / "node-local")
    assert_one_verified_copy(stage_from_ranks(source, directory), source, directory)


def test_stage_reuses_an_identical_copy(archives, packed_kind, tmp_path):
    source = archives[packed_kind]
    first = stage_archive(source, tmp_path)
    identity = os.stat(first.path).st_ino
    second = stage_archive(source, tmp_path)
    assert (first.copied, second.copied) == (True, False)
    assert os.stat(second.path).st_ino == identity


def test_a_copy_damaged_after_staging_is_checked_and_replaced_not_reused(archives, packed_kind, tmp_path):
    source = archives[packed_kind]
    first = stage_archive(source, tmp_path)
    time.sleep(0.01)  # a later modification time even on coarse clocks
    corrupt_one_sample(first.path)
    second = stage_archive(source, tmp_path)
    assert second.copied
    assert_same_archive(second.path, source)
    assert verify_archive(second.path).ok
    assert not stage_archive(source, tmp_path).copied  # the new copy is stamped and reused


def test_a_copy_without_a_stamp_is_checked_once_then_reused(archives, tmp_path):
    source = archives[("zip", "raw")]
    first = stage_archive(source, tmp_path)
    stamp = os.path.join(tmp_path, f".{os.path.basename(first.path)}.pf-staged")
    os.remove(stamp)  # as staged by a release without stamps
    assert not stage_archive(source, tmp_path).copied
    assert os.path.exists(stamp)


def test_stage_replaces_a_different_archive_of_the_same_name(archives, tmp_path):
    old = copy_archive(archives[("hdf5", "encoded")], tmp_path / "old")
    new = copy_archive(archives[("hdf5", "raw")], tmp_path / "new")
    os.rename(old, os.path.join(tmp_path / "old", os.path.basename(new)))
    stage_archive(os.path.join(tmp_path / "old", os.path.basename(new)), tmp_path / "local")
    result = stage_archive(new, tmp_path / "local")
    assert result.copied
    assert_same_archive(result.path, new)


def test_stage_refuses_a_corrupted_source_and_leaves_no_copy(archives, packed_kind, tmp_path):
    source = copy_archive(archives[packed_kind], tmp_path)
    bad = corrupt_one_sample(source)
    directory = tmp_path / "local"
    with pytest.raises(pf.CorruptSampleError) as caught:
        stage_archive(source, directory)
    assert caught.value.path == source
    assert caught.value.index == bad
    with pf.open_archive(source, verify=False) as reader:
        assert caught.value.key == reader.key(bad)
    assert not os.path.lexists(os.path.join(directory, os.path.basename(source)))
    assert leftovers(directory) == []


def test_stage_does_not_replace_a_file_that_is_not_an_archive(archives, tmp_path):
    source = archives[("zip", "encoded")]
    precious = tmp_path / os.path.basename(source)
    precious.write_text("my notes")
    with pytest.raises(pf.ArchiveExistsError):
        stage_archive(source, tmp_path)
    assert precious.read_text() == "my notes"


def test_stage_removes_the_leftovers_of_a_killed_stager(archives, tmp_path):
    source = archives[("memmap", "encoded")]
    dead = tmp_path / f".{os.path.basename(source)}.pf-stage-99999-deadbeef"
    shutil.copytree(source, dead)
    stage_archive(source, tmp_path)
    assert leftovers(tmp_path) == []


def test_stage_refuses_an_image_folder(image_folder, tmp_path):
    with pytest.raises(pf.UnknownFormatError, match="convert"):
        stage_archive(image_folder, tmp_path)
    assert os.listdir(tmp_path) == []


def test_stage_of_a_missing_source_names_it(tmp_path):
    missing = os.fspath(tmp_path / "nope.zip")
    with pytest.raises(pf.ArchiveNotFoundError, match="nope.zip"):
        stage_archive(missing, tmp_path / "local")


def test_stage_gives_up_after_timeout_while_another_process_holds_the_lock(archives, tmp_path):
    source = archives[("lmdb", "raw")]
    lock = os.open(tmp_path / f".{os.path.basename(source)}.pf-stage.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(pf.PackedFormatError, match="staging"):
            stage_archive(source, tmp_path, timeout=0.2)
    finally:
        os.close(lock)
    assert not os.path.exists(tmp_path / os.path.basename(source))


def test_stage_command_prints_the_local_path(archives, tmp_path, capsys):
    source = archives[("zip", "raw")]
    assert cli.main(["stage", source, "--to", os.fspath(tmp_path), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == os.path.join(tmp_path, os.path.basename(source))


def test_stage_command_reports_a_corrupted_sample_in_one_line(archives, tmp_path, capsys):
    source = copy_archive(archives[("zip", "encoded")], tmp_path)
    bad = corrupt_one_sample(source)
    assert cli.main(["stage", source, "--to", os.fspath(tmp_path / "local")]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"index {bad}" in error and source in error


@pytest.fixture
def sharded_archive(tmp_path, image_folder) -> str:
    """A zip archive of 24 samples in 3 parts of 10, 10 and 4, behind one index file."""
    path = os.fspath(tmp_path / "shared" / "train.zip")
    os.makedirs(os.path.dirname(path))
    with ShardedWriter(path, "zip", shard_size=10, mode="encoded", classes=("boxes", "circles", "stripes")) as writer:
        for stored, label, key in expected_samples(image_folder, "encoded"):
            writer.add(stored, label, key)
    return path


def test_stage_copies_a_sharded_archive_with_all_its_parts(sharded_archive, tmp_path):
    result = stage_archive(sharded_archive, tmp_path / "local")
    assert result.copied
    assert sorted(n for n in os.listdir(tmp_path / "local") if not n.startswith(".")) == [
        "train-00000.zip", "train-00001.zip", "train-00002.zip", "train-samples.npz", "train.zip"
    ]  # the set's sample index too: a staged set copied on by any tool keeps it
    assert_same_archive(result.path, sharded_archive)
    assert not stage_archive(sharded_archive, tmp_path / "local").copied


def test_concurrent_stage_of_a_sharded_archive_makes_one_copy(sharded_archive, tmp_path):
    directory = os.fspath(tmp_path / "node-local")
    assert_one_verified_copy(stage_from_ranks(sharded_archive, directory), sharded_archive, directory)


def test_stage_refuses_a_sharded_archive_with_a_corrupted_part(sharded_archive, tmp_path):
    part = os.path.join(os.path.dirname(sharded_archive), "train-00001.zip")
    bad = corrupt_one_sample(part)
    with pytest.raises(pf.CorruptSampleError) as caught:
        stage_archive(sharded_archive, tmp_path / "local")
    assert (caught.value.path, caught.value.index) == (part, bad)
    assert not os.path.exists(tmp_path / "local" / "train.zip")
    assert not os.path.exists(tmp_path / "local" / "train-00001.zip")

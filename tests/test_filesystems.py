"""Real file-system faults: a disk that fills up mid-write, a read-only mount, many processes at once."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess

import pytest
import torch

import packed_formats as pf

from .conftest import kind_id

EXTENSION = {"zip": "zip", "hdf5": "h5", "lmdb": "lmdb", "memmap": "memmap"}


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 10 MiB tmpfs mounted for the test (skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.parametrize("fmt", ["zip", "hdf5", "lmdb", "memmap"])
def test_a_disk_filling_up_mid_conversion_gives_a_named_error_and_leaves_nothing(
    small_tmpfs, image_folder, monkeypatch, fmt
):
    convert_module = importlib.import_module("packed_formats.writing.convert")
    monkeypatch.setattr(convert_module, "check_free_space", lambda *args, **kwargs: None)  # let it start
    dst = small_tmpfs / f"out.{EXTENSION[fmt]}"
    with pytest.raises(pf.PackedFormatError) as error:  # raw 512x512: ~19 MiB, more than the disk holds
        pf.convert(image_folder, dst, format=fmt, mode="raw", size=512, workers=1, quiet=True)
    assert "out." in str(error.value)
    assert os.listdir(small_tmpfs) == [], "a partial archive or temporary file was left behind"


def test_archives_on_a_read_only_mount_read_and_verify_and_refuse_writes(small_tmpfs, archives, image_folder):
    src = archives[("zip", "raw")]
    path = small_tmpfs / "data.zip"
    path.write_bytes(open(src, "rb").read())
    remount = subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], capture_output=True)
    if remount.returncode != 0:
        pytest.skip("cannot remount read-only here")
    dataset = pf.PackedDataset(path, output="tensor")
    assert len(dataset) == 24 and dataset[23][0].shape[0] == 3
    assert pf.verify_archive(path).ok
    with pytest.raises(pf.PackedFormatError, match="small"):
        pf.convert(image_folder, small_tmpfs / "new.zip", quiet=True)


def _read_all(path: str) -> int:
    dataset = pf.PackedDataset(path)
    return sum(int(dataset[i][1]) for i in range(len(dataset)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", [("hdf5", "raw"), ("lmdb", "encoded"), ("zip", "raw"), ("memmap", "encoded")],
                         ids=kind_id)
def test_32_processes_open_and_read_one_archive_at_once(archives, kind):
    path = archives[kind]
    expected = _read_all(path)
    with multiprocessing.get_context("fork").Pool(32, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        assert pool.map(_read_all, [path] * 32) == [expected] * 32

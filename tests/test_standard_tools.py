"""Our archives stay readable by each format's own standard tools, without this library."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import zipfile

import h5py
import lmdb
import numpy as np
import pytest

import packed_formats as pf

MODES = ["raw", "encoded"]


def samples_of(path):
    with pf.open_archive(path) as reader:
        return [reader.read_bytes(i) for i in range(len(reader))], reader.labels.copy(), reader.manifest


@pytest.mark.parametrize("mode", MODES)
def test_zip_opens_with_zipfile_and_passes_its_crc_test(archives, mode):
    path = archives[("zip", mode)]
    samples, labels, manifest = samples_of(path)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
        members = sorted(n for n in archive.namelist() if n.startswith("samples/"))
        assert len(members) == len(samples)
        assert all(archive.getinfo(n).compress_type == zipfile.ZIP_STORED for n in members)
        assert [archive.read(n) for n in members] == samples
        assert json.loads(archive.read("manifest.json"))["count"] == len(samples)
        with archive.open("index/labels.npy") as member:
            np.testing.assert_array_equal(np.load(member), labels)


@pytest.mark.skipif(shutil.which("unzip") is None, reason="the unzip program is not installed")
@pytest.mark.parametrize("mode", MODES)
def test_zip_passes_unzip_t(archives, mode):
    run = subprocess.run(["unzip", "-t", archives[("zip", mode)]], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
    assert "No errors detected" in run.stdout


@pytest.mark.parametrize("mode", MODES)
def test_hdf5_opens_with_plain_h5py(archives, mode):
    path = archives[("hdf5", mode)]
    samples, labels, manifest = samples_of(path)
    with h5py.File(path, "r") as file:
        np.testing.assert_array_equal(file["labels"][()], labels)
        assert json.loads(file.attrs["packed_formats_manifest"])["count"] == len(samples)
        if mode == "raw":
            assert file["images"].shape == (len(samples),) + manifest.shape
            assert [file["images"][i].tobytes() for i in range(len(samples))] == samples
        else:
            offsets = file["offsets"][()]
            data = file["data"]
            assert [data[offsets[i] : offsets[i + 1]].tobytes() for i in range(len(samples))] == samples


@pytest.mark.parametrize("mode", MODES)
def test_lmdb_opens_with_plain_lmdb(archives, mode):
    path = archives[("lmdb", mode)]
    samples, labels, manifest = samples_of(path)
    with pf.open_archive(path) as reader:
        index_records = len(reader.index.arrays())
    gc.collect()  # lmdb allows one environment per file per process: a reader an earlier test dropped
    env = lmdb.open(path, subdir=False, readonly=True, lock=False)  # in a reference cycle may hold it
    try:
        assert env.stat()["entries"] == len(samples) + index_records + 1
        with env.begin() as txn:
            assert [txn.get(b"%010d" % i) for i in range(len(samples))] == samples
            assert json.loads(txn.get(b"__manifest__"))["mode"] == mode
    finally:
        env.close()
    assert not os.path.exists(path + "-lock"), "sealed archives need no lock file"


@pytest.mark.parametrize("mode", MODES)
def test_memmap_opens_with_numpy_load(archives, mode):
    path = archives[("memmap", mode)]
    samples, labels, manifest = samples_of(path)
    np.testing.assert_array_equal(np.load(os.path.join(path, "labels.npy")), labels)
    if mode == "raw":
        images = np.load(os.path.join(path, "images.npy"), mmap_mode="r")
        assert images.shape == (len(samples),) + manifest.shape
        assert [images[i].tobytes() for i in range(len(samples))] == samples
    else:
        data = np.load(os.path.join(path, "data.npy"), mmap_mode="r")
        offsets = np.load(os.path.join(path, "offsets.npy"))
        assert [data[offsets[i] : offsets[i + 1]].tobytes() for i in range(len(samples))] == samples

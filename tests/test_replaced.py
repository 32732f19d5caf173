"""An archive replaced or removed under a live reader never yields another archive's data."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.synthetic import make_image_folder

from .conftest import ARCHIVE_KINDS, kind_id

EXTENSION = {"zip": "zip", "hdf5": "h5", "lmdb": "lmdb", "memmap": "memmap"}


@pytest.fixture(scope="module")
def two_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("replaced")
    first = make_image_folder(root / "first", images_per_class=3, classes=("a", "b"), sizes=(20, 30), seed=3)
    second = make_image_folder(root / "second", images_per_class=5, classes=("a", "b", "c"), sizes=(20, 30), seed=4)
    return first, second


@pytest.mark.parametrize("kind", ARCHIVE_KINDS, ids=kind_id)
def test_reconverting_in_place_gives_new_datasets_the_new_archive(two_folders, tmp_path, kind):
    """In one process (a notebook), an old dataset still alive: the new one must not get its handle."""
    fmt, mode = kind
    first, second = two_folders
    path = tmp_path / f"data.{EXTENSION.get(fmt, fmt)}"
    pf.convert(first, path, format=fmt, mode=mode, size=16, workers=1, quiet=True)
    old = pf.PackedDataset(path, output="tensor")
    old_first = old[0][0].clone()
    other = "encoded" if mode == "raw" else "raw"
    pf.convert(second, path, format=fmt, mode=other, size=16, workers=1, quiet=True, overwrite=True)

    new = pf.PackedDataset(path)
    assert (len(new), new.reader.mode, new.classes) == (15, other, ["a", "b", "c"])
    assert [int(new[i][1]) for i in range(len(new))] == [0] * 5 + [1] * 5 + [2] * 5
    try:  # the old reader keeps its old file, or says it changed: never the new data
        assert np.array_equal(old[0][0].numpy(), old_first.numpy()) and len(old) == 6
    except pf.ArchiveChangedError:
        pass


@pytest.mark.parametrize("kind", ARCHIVE_KINDS, ids=kind_id)
def test_an_archive_removed_before_the_first_read_is_reported_as_not_found(archives, tmp_path, kind):
    path = os.path.join(tmp_path, "gone" + os.path.splitext(archives[kind])[1])
    (shutil.copytree if os.path.isdir(archives[kind]) else shutil.copyfile)(archives[kind], path)
    dataset = pf.PackedDataset(path)
    (shutil.rmtree if os.path.isdir(path) else os.unlink)(path)
    with pytest.raises(pf.ArchiveNotFoundError, match="gone"):
        dataset[0]


def test_a_link_to_a_deleted_archive_is_not_found(tmp_path, uniform_archives):
    target = tmp_path / "staged.zip"
    shutil.copy(uniform_archives[("zip", "raw")], target)
    link = tmp_path / "data.zip"
    link.symlink_to(target)
    target.unlink()
    with pytest.raises(pf.ArchiveNotFoundError, match="a link to .*staged.zip, which does not exist"):
        pf.open_archive(link)

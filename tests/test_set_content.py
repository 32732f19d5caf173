"""A set's id names the plan it was converted by, not what its parts hold: two conversions by one plan (the same
source listing, location and options) of other pixels or masks share it.  The set's index records each part's
content digest, so a part of the one put into the other is refused by name, on opening, by ``verify --decode``
and by ``join``; a ``--part`` task reading another folder that lists the same names is refused before it writes."""

from __future__ import annotations

import io
import json
import os
import re
import shutil

import numpy as np
import pytest
from PIL import Image

import packed_formats as pf
from packed_formats.backends.sharded import ShardedWriter, read_shard_index
from packed_formats.cli import main
from packed_formats.synthetic import make_image_folder
from packed_formats.writing import parts
from packed_formats.writing.convert import convert

from .test_fields import SHAPE, image_of
from .test_set_index import copy_over

FORMATS = ["zip", "memmap", "lmdb", "hdf5"]
EXT = {"zip": ".zip", "hdf5": ".h5", "lmdb": ".lmdb", "memmap": ".memmap"}
SHARD = 5  # 12 samples: parts of 5, 5 and 2


def source_folder(root, seed: int) -> str:
    """12 JPEGs in 2 classes, always under the same names: ``seed`` draws other pixels."""
    return make_image_folder(root, images_per_class=6, classes=("cat", "dog"), sizes=(30, 60), seed=seed)


def rewrite_in_place(folder: str, seed: int) -> None:
    """The same names and classes with other pixels, where they were: a corrected release, an augmentation
    written again."""
    shutil.rmtree(folder)
    source_folder(folder, seed)


def convert_set(src: str, dst: str, fmt: str, **options) -> str:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    convert(src, dst, format=fmt, mode="raw", size=16, shard_size=SHARD, workers=1, quiet=True, **options)
    return dst


def part(path: str, k: int) -> str:
    return os.path.join(os.path.dirname(path), parts.part_name(path, k))


def stat_of(path: str) -> list:
    info = os.stat(path)
    return [info.st_size, info.st_mtime_ns]


def copy_over_unseen(source: str, target: str, dst: str) -> None:
    """Copy one part over another of the set at ``dst`` unseen by its seal: the seal's sizes and times
    become the copy's, as when a copy keeps the ones it replaces (``touch -r``)."""
    copy_over(source, target)
    seal_file = parts.seal_path(dst, os.path.basename(target))
    with open(seal_file) as file:
        seal = json.load(file)
    if os.path.isdir(target):
        seal["files"] = [[name, *stat_of(os.path.join(target, name))] for name in sorted(os.listdir(target))]
    else:
        seal["files"] = [[os.path.basename(target), *stat_of(target)]]
    with open(seal_file, "w") as file:
        json.dump(seal, file)


def refused_part(path: str, k: int) -> str:
    return rf"part {re.escape(part(path, k))} holds other samples than part {k} of set [0-9a-f]{{16}}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_part_of_another_conversion_by_the_same_plan_is_refused_by_name(tmp_path, fmt, capsys):
    src = source_folder(tmp_path / "images", seed=1)
    a = convert_set(src, str(tmp_path / "a" / f"train{EXT[fmt]}"), fmt)
    rewrite_in_place(src, seed=2)
    b = convert_set(src, str(tmp_path / "b" / f"train{EXT[fmt]}"), fmt)
    assert read_shard_index(a)["set_id"] == read_shard_index(b)["set_id"]  # one plan: one set id
    with pf.open_archive(a) as x, pf.open_archive(b) as y:
        assert not np.array_equal(np.asarray(x.read(6)), np.asarray(y.read(6)))  # other pixels, same names
    copy_over(part(b, 1), part(a, 1))
    with pytest.raises(pf.CorruptArchiveError, match=refused_part(a, 1)):
        pf.open_archive(a)
    with pytest.raises(pf.CorruptArchiveError, match=refused_part(a, 1)):
        pf.PackedDataset(a)
    capsys.readouterr()
    assert main(["verify", "--decode", "--quiet", a]) != 0
    assert re.search(refused_part(a, 1), capsys.readouterr().err)
    assert main(["verify", "--decode", "--quiet", b]) == 0  # the other set is whole


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_part_with_other_masks_under_the_same_set_id_is_refused(tmp_path, fmt, capsys):
    set_id = "00c0ffee00c0ffee"  # as two conversions by one plan both derive it

    def write(path: str, variant: int) -> str:
        with ShardedWriter(path, fmt, 3, set_id=set_id, mode="raw", shape=SHAPE, classes=["a", "b"],
                           fields=["mask=image"]) as writer:
            for i in range(8):
                mask = np.zeros(SHAPE[:2], np.uint8)
                mask[2:12, 3 + variant : 20] = 1 + i % 2  # the same images, the masks drawn again
                writer.add(image_of(i), i % 2, key=f"k/{i}", fields={"mask": mask})
        return path

    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "b")
    a, b = write(str(tmp_path / "a" / f"set{EXT[fmt]}"), 0), write(str(tmp_path / "b" / f"set{EXT[fmt]}"), 4)
    copy_over(part(b, 2), part(a, 2))
    with pytest.raises(pf.CorruptArchiveError, match=refused_part(a, 2)):
        pf.open_archive(a)
    capsys.readouterr()
    assert main(["verify", "--decode", "--quiet", a]) != 0
    assert re.search(refused_part(a, 2), capsys.readouterr().err)
    with pf.open_archive(b) as reader:  # the set it came from reads it as its own
        assert int(np.asarray(Image.open(io.BytesIO(reader.read_field(7, "mask"))))[5, 5]) == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_join_refuses_a_part_of_another_conversion_by_the_same_plan_put_in_after_its_seal(tmp_path, fmt):
    src = source_folder(tmp_path / "images", seed=1)
    a, b = str(tmp_path / "a" / f"train{EXT[fmt]}"), str(tmp_path / "b" / f"train{EXT[fmt]}")
    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "b")
    for i in (0, 1):
        convert(src, a, format=fmt, mode="raw", size=16, shard_size=SHARD, workers=1, quiet=True, part=(i, 2))
    rewrite_in_place(src, seed=2)
    for i in (0, 1):
        convert(src, b, format=fmt, mode="raw", size=16, shard_size=SHARD, workers=1, quiet=True, part=(i, 2))
    os.remove(a)  # joined again, once its part 2 is the other conversion's
    copy_over_unseen(part(b, 2), part(a, 2), a)
    with pytest.raises(pf.CorruptArchiveError, match=rf"^{re.escape(a)}: {refused_part(a, 2)}"):
        parts.join(a)
    assert not os.path.exists(a)


def test_two_part_tasks_reading_folders_that_list_the_same_names_do_not_make_one_set(tmp_path):
    first = source_folder(tmp_path / "first", seed=1)
    second = source_folder(tmp_path / "second", seed=2)  # the same names, other pixels
    dst = str(tmp_path / "out" / "train.zip")
    os.makedirs(tmp_path / "out")
    convert(first, dst, format="zip", mode="raw", size=16, shard_size=SHARD, workers=1, quiet=True, part=(0, 2))
    with pytest.raises(pf.CorruptArchiveError, match=r"another source location: '.*first' \(in plan\.json\), this "
                                                     r"conversion has '.*second'"):
        convert(second, dst, format="zip", mode="raw", size=16, shard_size=SHARD, workers=1, quiet=True,
                part=(1, 2))
    assert not os.path.exists(part(dst, 1)) and not os.path.exists(part(dst, 2)) and not os.path.exists(dst)
    with pytest.raises(pf.IncompleteArchiveError, match=r"part train-00001\.zip is missing: re-run task 1 of 2"):
        parts.join(dst)

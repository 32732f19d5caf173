"""A sharded set's index is sealed and names the set; each part's manifest names the set and its place.

Every refusal here is of a set written by ShardedWriter, convert or join, then damaged or rearranged
the way files are on real disks: an index edited by hand, parts copied over each other, a part from
another set, an index rewritten by an older tool.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import zlib

import numpy as np
import pytest

import packed_formats as pf
from packed_formats import codecs, storage
from packed_formats.backends.sharded import (
    INDEX_VERSION,
    ShardedWriter,
    file_digest,
    index_text,
    part_digest,
    read_shard_index,
)
from packed_formats.cli import main
from packed_formats.manifest import FORMAT_VERSION, PLAIN_VERSION, SET_VERSION
from packed_formats.writing import parts
from packed_formats.writing.convert import convert

FORMATS = ["zip", "hdf5", "lmdb", "memmap"]
EXT = {"zip": ".zip", "hdf5": ".h5", "lmdb": ".lmdb", "memmap": ".memmap"}
SHAPE = (6, 5, 3)
SAMPLES, SHARD = 8, 3  # parts of 3, 3 and 2 samples


def pixels(i: int, shape=SHAPE) -> np.ndarray:
    return np.full(shape, i, dtype=np.uint8)


def write_set(directory, fmt: str, offset: int = 0, set_id=None, classes=("a", "b"), **options) -> str:
    """A set of SAMPLES raw samples (sample i all pixels ``offset + i``) in parts of SHARD; its index path."""
    options = {"mode": "raw", "shape": SHAPE, **options}
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"set{EXT[fmt]}")
    with ShardedWriter(path, fmt, SHARD, set_id=set_id, classes=list(classes), **options) as writer:
        for i in range(SAMPLES):
            if options["mode"] == "raw":
                writer.add(pixels(offset + i, options["shape"]), i % 2)
            else:  # image file bytes, stored as they are
                writer.add(codecs.encode(pixels(offset + i), options.get("encoding", "png"), 90), i % 2)
    return path


def part(path: str, k: int) -> str:
    return os.path.join(os.path.dirname(path), parts.part_name(path, k))


def canonical_crc32(content: dict) -> int:
    """The seal as the index defines it: CRC32 of the canonical JSON text of all but the seal."""
    return zlib.crc32(json.dumps(content, indent=1, sort_keys=True).encode())


def reseal(path: str, change) -> None:
    """Apply ``change`` to the index's content and seal it again, as a careful hand edit would."""
    with open(path) as file:
        content = json.load(file)
    del content["crc32"]
    change(content)
    content["crc32"] = canonical_crc32(content)
    with open(path, "w") as file:
        json.dump(content, file, indent=1)


def record_content(path: str, k: int) -> None:
    """Record part k's content digest as the set's index's, sealed again: an index that lists that part."""
    digest = file_digest(part(path, k), read_shard_index(path)["format"])
    reseal(path, lambda content: content["parts"][k].__setitem__("content", digest))


def copy_over(source: str, target: str) -> None:
    """Copy one part (a file, or a memmap folder) over another."""
    if os.path.isdir(target):
        shutil.rmtree(target)
        shutil.copytree(source, target)
    else:
        shutil.copyfile(source, target)


def write_legacy_set(directory, fmt: str) -> str:
    """A set as an older packed_formats wrote it: parts that name no set, a version 1 index with no seal."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"set{EXT[fmt]}")
    names = []
    for k, start in enumerate(range(0, SAMPLES, SHARD)):
        with pf.open_writer(part(path, k), format=fmt, mode="raw", shape=SHAPE, classes=["a", "b"]) as writer:
            for i in range(start, min(SAMPLES, start + SHARD)):
                writer.add(pixels(i), i % 2)
        names.append({"name": parts.part_name(path, k), "count": len(range(start, min(SAMPLES, start + SHARD)))})
    with open(path, "w") as file:
        json.dump({"packed_formats_shards": 1, "format": fmt, "parts": names}, file)
    return path


def read_every_sample(path: str) -> list:
    with pf.open_archive(path) as reader:
        return [int(reader.read(i)[0, 0, 0]) for i in range(len(reader))]


# ---- what is written ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_index_is_sealed_and_each_part_names_the_set_and_its_place(tmp_path, fmt):
    path = write_set(tmp_path, fmt)
    with open(path) as file:
        content = json.load(file)
    seal = content.pop("crc32")
    assert content["packed_formats_shards"] == INDEX_VERSION == 3
    assert re.fullmatch(r"[0-9a-f]{16}", content["set_id"]) and seal == canonical_crc32(content)
    assert [(p["name"], p["count"]) for p in content["parts"]] == [(parts.part_name(path, k), c)
                                                                  for k, c in enumerate((3, 3, 2))]
    for k in range(3):
        with pf.open_archive(part(path, k)) as reader:
            assert (reader.manifest.set_id, reader.manifest.part) == (content["set_id"], k)
            assert reader.manifest.format_version == SET_VERSION
            assert content["parts"][k]["content"] == part_digest(reader.manifest)  # what the part holds
    with pf.open_archive(path) as reader:
        assert (reader.manifest.set_id, reader.manifest.part) == (content["set_id"], -1)
    assert read_every_sample(path) == list(range(SAMPLES))


def test_two_sets_get_two_ids(tmp_path):
    a, b = write_set(tmp_path / "a", "zip"), write_set(tmp_path / "b", "zip")
    assert read_shard_index(a)["set_id"] != read_shard_index(b)["set_id"]


def test_a_set_id_the_index_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="16 lowercase hexadecimal digits"):
        ShardedWriter(tmp_path / "set.zip", "zip", SHARD, set_id="../other", mode="raw", shape=SHAPE)
    assert os.listdir(tmp_path) == []


def test_an_archive_that_is_no_part_of_a_set_keeps_the_older_layout(tmp_path):
    path = str(tmp_path / "one.zip")
    with pf.open_writer(path, format="zip", mode="raw", shape=SHAPE, classes=["a"]) as writer:
        writer.add(pixels(1), 0)
    with pf.open_archive(path) as reader:
        manifest = reader.manifest
    assert manifest.format_version == PLAIN_VERSION < FORMAT_VERSION  # readers of that version still read it
    assert (manifest.set_id, manifest.part) == ("", -1) and '"set_id"' not in manifest.to_json()


# ---- a damaged index ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_flipped_character_in_a_part_name_fails_the_seal(tmp_path, fmt):
    path = write_set(tmp_path, fmt)
    with open(path) as file:
        text = file.read()
    with open(path, "w") as file:  # part 0's name now names part 1, which would be read twice
        file.write(text.replace(parts.part_name(path, 0), parts.part_name(path, 1)))
    with pytest.raises(pf.CorruptArchiveError, match=rf"{re.escape(path)}: the set's index is damaged"):
        pf.open_archive(path)


def test_an_index_that_lost_its_seal_is_refused(tmp_path):
    path = write_set(tmp_path, "zip")
    with open(path) as file:
        content = json.load(file)
    del content["crc32"]
    with open(path, "w") as file:
        json.dump(content, file)
    with pytest.raises(pf.CorruptArchiveError, match="lost its checksum"):
        pf.open_archive(path)


def test_verify_fails_a_set_whose_index_is_damaged(tmp_path, capsys):
    path = write_set(tmp_path, "zip")
    assert main(["verify", "--quiet", path]) == 0
    with open(path) as file:
        text = file.read()
    with open(path, "w") as file:
        file.write(text.replace(parts.part_name(path, 0), parts.part_name(path, 1)))
    capsys.readouterr()
    assert main(["verify", "--quiet", path]) == 2
    captured = capsys.readouterr()
    assert "OK" not in captured.out and f"{path}: the set's index is damaged" in captured.err


# ---- parts that are not where the index says ------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_parts_listed_in_another_order_under_a_new_seal_are_refused(tmp_path, fmt):
    path = write_set(tmp_path, fmt)
    reseal(path, lambda content: content["parts"].reverse())  # counts 2, 3, 3: part 2 is listed first
    with pytest.raises(pf.CorruptArchiveError,
                       match=rf"part {re.escape(part(path, 2))} says it is part 2 of this set, but the index "
                             rf"lists it as part 0"):
        pf.open_archive(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_part_copied_over_another_is_refused(tmp_path, fmt):
    path = write_set(tmp_path, fmt)
    copy_over(part(path, 1), part(path, 0))
    with pytest.raises(pf.CorruptArchiveError,
                       match=rf"part {re.escape(part(path, 0))} says it is part 1 of this set, but the index "
                             rf"lists it as part 0"):
        pf.open_archive(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_part_of_another_set_of_the_same_shape_is_refused(tmp_path, fmt):
    path, other = write_set(tmp_path / "a", fmt), write_set(tmp_path / "b", fmt, offset=100)
    copy_over(part(other, 1), part(path, 1))
    other_id = read_shard_index(other)["set_id"]
    with pytest.raises(pf.CorruptArchiveError,
                       match=rf"part {re.escape(part(path, 1))} says it is part 1 of set {other_id}, another set"):
        pf.open_archive(path)


@pytest.mark.parametrize("version", [1, 2])
def test_an_index_listing_a_part_twice_is_refused(tmp_path, version):
    if version == 1:
        path = write_legacy_set(tmp_path, "zip")
        with open(path) as file:
            content = json.load(file)
        content["parts"][1] = dict(content["parts"][0])  # both hold 3 samples
        with open(path, "w") as file:
            json.dump(content, file)
    else:
        path = write_set(tmp_path, "zip")
        reseal(path, lambda content: content["parts"].__setitem__(1, dict(content["parts"][0])))
    with pytest.raises(pf.CorruptArchiveError, match=rf"part {parts.part_name(path, 0)} is listed twice"):
        pf.open_archive(path)


# ---- old sets, and indexes rewritten the old way ----------------------------------------------------------------
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_old_set_whose_index_records_no_content_is_refused_saying_to_convert_it_again(tmp_path, fmt, version,
                                                                                         capsys):
    if version == 1:  # as the oldest packed_formats wrote it
        path = write_legacy_set(tmp_path, fmt)
        assert read_shard_index(path)["set_id"] is None
    else:  # as the one before this wrote it: sealed, with a set id, no content digests
        path = write_set(tmp_path, fmt)
        reseal(path, lambda content: (content.__setitem__("packed_formats_shards", 2),
                                      [p.pop("content") for p in content["parts"]]))
        assert read_shard_index(path)["contents"] is None
    with pytest.raises(pf.CorruptArchiveError, match=rf"index is of version {version} .* does not record what each "
                                                     r"part holds.*convert the set again"):
        pf.open_archive(path)
    assert main(["verify", "--decode", path]) != 0
    assert "convert the set again" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_version_1_index_over_parts_that_name_a_set_is_refused(tmp_path, fmt):
    path = write_set(tmp_path, fmt)
    with open(path) as file:
        content = json.load(file)
    with open(path, "w") as file:  # what an older tool, or a hand, writes: no seal, no set id
        json.dump({"packed_formats_shards": 1, "format": content["format"], "parts": content["parts"]}, file)
    with pytest.raises(pf.CorruptArchiveError,
                       match=r"the set's index is of version 1 .* does not record what each part holds"):
        pf.open_archive(path)


def test_a_sealed_index_over_parts_that_name_no_set_is_refused(tmp_path):
    path = write_legacy_set(tmp_path, "hdf5")
    index = read_shard_index(path)
    with open(path, "w") as file:
        file.write(index_text("hdf5", [(name, count, file_digest(os.path.join(tmp_path, name), "hdf5"))
                                       for name, count in zip(index["names"], index["counts"])], "0123456789abcdef"))
    with pytest.raises(pf.CorruptArchiveError,
                       match=rf"part {re.escape(part(path, 0))} names no set .* lists it as part 0 of set "
                             r"0123456789abcdef"):
        pf.open_archive(path)


# ---- parts agree with each other -----------------------------------------------------------------------------
@pytest.mark.parametrize("field,options", [
    ("mode", {"mode": "encoded"}),
    ("shape", {"shape": (5, 6, 3)}),
    ("classes", {"classes": ("a", "c")}),
])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_part_that_differs_from_the_first_is_refused_naming_the_field(tmp_path, fmt, field, options):
    path = write_set(tmp_path / "a", fmt)
    set_id = read_shard_index(path)["set_id"]
    other = write_set(tmp_path / "b", fmt, set_id=set_id, **options)  # the same set id: only the field differs
    copy_over(part(other, 2), part(path, 2))
    with pytest.raises(pf.CorruptArchiveError,
                       match=rf"part {re.escape(part(path, 2))} differs from the first part, .* in {field}: "):
        pf.open_archive(path)


def test_parts_of_other_encodings_join_as_mixed(tmp_path):
    path = write_set(tmp_path / "a", "zip", mode="encoded", encoding="png")
    other = write_set(tmp_path / "b", "zip", set_id=read_shard_index(path)["set_id"], mode="encoded", encoding="jpeg")
    copy_over(part(other, 1), part(path, 1))
    record_content(path, 1)
    with pf.open_archive(path) as reader:
        assert reader.manifest.encoding == "mixed" and len(reader) == SAMPLES


# ---- sets written by tasks, and uploaded ------------------------------------------------------------------------
def test_the_tasks_of_a_set_name_one_set_id_derived_from_the_plan(image_folder, tmp_path):
    dst = str(tmp_path / "train.lmdb")
    for i in (1, 0, 2):
        convert(image_folder, dst, format="lmdb", mode="raw", size=8, shard_size=5, workers=1, quiet=True,
                part=(i, 3))
    index, plan = read_shard_index(dst), parts.read_plan(dst)
    assert plan is not None and index["set_id"] == parts.set_id(plan)
    for k, name in enumerate(index["names"]):
        with pf.open_archive(os.path.join(tmp_path, name)) as reader:
            assert (reader.manifest.set_id, reader.manifest.part) == (index["set_id"], k)
    with pf.open_archive(dst) as reader:
        assert len(reader) == 24


def test_an_uploaded_index_is_sealed_over_what_it_gained(s3, s3_env, tmp_path):
    path = write_set(tmp_path / "set", "zip")
    url = f"s3://{s3.bucket()}/set.zip"
    storage.upload(path, url)
    uploaded = tmp_path / "uploaded.zip"
    uploaded.write_bytes(s3.fs().cat(url.replace("s3://", "")))
    content = json.loads(uploaded.read_text())
    assert {"samples", "manifest"} <= set(content) and content["set_id"] == read_shard_index(path)["set_id"]
    assert read_shard_index(str(uploaded))["names"] == read_shard_index(path)["names"]
    content["samples"]["crc32"] += 1  # the seal covers the keys the upload added
    uploaded.write_text(json.dumps(content, indent=1))
    with pytest.raises(pf.CorruptArchiveError, match="damaged"):
        read_shard_index(str(uploaded))


def test_a_manifest_names_its_place_only_as_a_string_and_an_integer():
    manifest = pf.ArchiveManifest(format="zip", mode="raw", count=1, classes=("a",), shape=SHAPE, set_id="00ff" * 4,
                                  part=3, format_version=FORMAT_VERSION)
    assert pf.ArchiveManifest.from_json(manifest.to_json()) == manifest
    bad = json.loads(manifest.to_json())
    bad["part"] = "3"
    del bad["manifest_crc32"]
    bad["manifest_crc32"] = canonical_crc32(bad)  # well sealed: only the field's type is wrong
    with pytest.raises(ValueError, match="part"):
        pf.ArchiveManifest.from_json(json.dumps(bad))
    assert dataclasses.replace(manifest, set_id="", part=-1).to_json().count("set_id") == 0

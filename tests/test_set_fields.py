"""Sets of parts with fields: ``convert --shard-size`` and ``--part`` write each sample's fields into its part,
the set reads them as one archive does (each value under its CRC32, read only when asked), and parts that
disagree on their fields are refused by name.  Sets in object storage: tests/test_remote_fields.py."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

import packed_formats as pf
from packed_formats.backends.sharded import ShardedWriter
from packed_formats.manifest import part_of_set

from .test_fields import FIELD_FORMATS, SHAPE, assert_value, image_of, shard_members, values_of, write_shard

FIELDS = ["mask=image", "boxes=array:float32[N,4]", "caption=text", "meta=json"]


def write_set(path, fmt: str, count: int = 10, per_part: "int | None" = 3, mode: str = "raw") -> list:
    """A set of parts of ``per_part`` samples with FIELDS (None: one archive of the same samples); the values."""
    rng = np.random.default_rng(0)
    written = []
    options = dict(mode=mode, shape=SHAPE if mode == "raw" else None, classes=["a", "b", "c"], fields=FIELDS)
    with (pf.open_writer(path, format=fmt, **options) if per_part is None
          else ShardedWriter(path, fmt, per_part, **options)) as writer:
        for i in range(count):
            values = {k: v for k, v in values_of(i, rng).items() if k in ("mask", "boxes", "caption", "meta")}
            writer.add(image_of(i), i % 3, key=f"k/{i}", fields=values)
            written.append(values)
    return written


@pytest.mark.parametrize("fmt", FIELD_FORMATS)
def test_every_part_holds_its_samples_fields_and_the_set_reads_them_checked(tmp_path, fmt):
    path = tmp_path / f"set.{fmt}"
    written = write_set(path, fmt)
    with pf.open_archive(path) as reader:
        assert reader.format_name == "sharded" and len(reader.backend.parts) == 4
        assert [s.describe() for s in reader.fields] == FIELDS
        for i, values in enumerate(written):
            for name, want in values.items():
                assert_value(name, reader.read_field(i, name), want)
        assert pf.verify_archive(str(path)).ok
    dataset = pf.PackedDataset(str(path), fields=["mask", "boxes", "caption"])
    sample = dataset[7]
    assert sample["caption"] == written[7]["caption"] and tuple(sample["boxes"].shape) == written[7]["boxes"].shape


@pytest.mark.parametrize("fmt", ["zip", "memmap"])
def test_a_damaged_field_value_in_a_part_is_named_not_read(tmp_path, fmt):
    path = tmp_path / f"set.{fmt}"
    written = write_set(path, fmt, mode="raw")
    with pf.open_archive(path) as reader:
        part = reader.backend.parts[2]  # samples 6-8
        where = part.index.field_bytes("caption", 1)  # sample 7's caption
        data_file = part.backend.data_file() if fmt == "zip" else os.path.join(part.path, "field.caption.npy")
    # a memmap field's values are a flat .npy store (offsets into it); a ZIP's lie among its records
    start = where[0] + (np.load(data_file, mmap_mode="r").offset if fmt == "memmap" else 0)
    with open(data_file, "r+b") as file:
        file.seek(start + 3)
        byte = file.read(1)
        file.seek(start + 3)
        file.write(bytes([byte[0] ^ 0x20]))
    with pf.open_archive(path) as reader:
        with pytest.raises(pf.CorruptSampleError, match="field 'caption': checksum mismatch") as caught:
            reader.read_field(7, "caption")
        assert "k/7" in str(caught.value)
        assert reader.read_field(6, "caption") == written[6]["caption"]  # its neighbours read
        report = pf.verify_archive(str(path))
        assert not report.ok and [bad.key for bad in report.bad] == ["k/7"]


def test_a_part_whose_fields_differ_from_the_first_is_refused_naming_them(tmp_path):
    path = tmp_path / "set.zip"
    write_set(path, "zip", count=6, per_part=3)
    with pf.open_archive(path) as reader:
        second = reader.backend.parts[1]
        part, (set_id, place) = second.path, (second.manifest.set_id, second.manifest.part)
    os.unlink(part)  # the second part written again, in its place in the set, without its boxes
    rng = np.random.default_rng(1)
    with part_of_set(set_id, place), pf.open_writer(part, format="zip", mode="raw", shape=SHAPE,
                                                    classes=["a", "b", "c"],
                                                    fields=["mask=image", "caption=text", "meta=json"]) as writer:
        for i in range(3):
            values = values_of(i, rng)
            writer.add(image_of(i), 0, fields={k: values[k] for k in ("mask", "caption", "meta")})
    first = "mask=image, boxes=array:float32\\[N,4\\], caption=text, meta=json"
    second = "mask=image, caption=text, meta=json"
    with pytest.raises(pf.CorruptArchiveError, match=f"from the first part, .* in fields: '{second}', not '{first}'"):
        pf.open_archive(path)


@pytest.mark.parametrize("how", ["shard-size", "part"])
def test_converting_a_webdataset_into_a_set_keeps_every_field(tmp_path, how):
    shard = write_shard(tmp_path / "shard-000.tar", count=7)
    single, sharded = tmp_path / "one.lmdb", tmp_path / "set.lmdb"
    fields = ["seg=image", "txt=text", "json=json", "boxes=array:float32[N,4]"]
    pf.convert(shard, single, fields=fields, quiet=True, workers=1)
    if how == "shard-size":
        pf.convert(shard, sharded, fields=fields, shard_size=3, quiet=True, workers=2)
    else:  # two tasks, each its parts; the second joins the set
        for task in range(2):
            pf.convert(shard, sharded, fields=fields, shard_size=3, part=(task, 2), quiet=True, workers=1)
    with pf.open_archive(single) as one, pf.open_archive(sharded) as parts:
        assert parts.format_name == "sharded" and len(parts.backend.parts) == 3
        assert [s.describe() for s in parts.fields] == [s.describe() for s in one.fields]
        for i in range(7):
            assert parts.read(i) == one.read(i) == shard_members(i)["png"]
            for spec in one.fields:
                got, want = parts.read_field(i, spec.name), one.read_field(i, spec.name)
                if isinstance(want, np.ndarray):
                    assert np.array_equal(got, want) and got.dtype == want.dtype
                else:
                    assert got == want, (i, spec.name)
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(parts.read_field(4, "seg")))),
                              np.asarray(Image.open(io.BytesIO(shard_members(4)["seg.png"]))))


@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])  # spawn: 4 s
def test_make_loader_batches_a_sets_fields_in_workers_as_it_does_one_archives(tmp_path, start_method):
    path, single = tmp_path / "set.hdf5", tmp_path / "one.hdf5"
    write_set(path, "hdf5", count=10, per_part=4)  # the same samples (one seed), in parts and in one archive
    write_set(single, "hdf5", count=10, per_part=None)

    def batches(archive, workers):
        loader = pf.make_loader(str(archive), batch_size=4, shuffle=False, num_workers=workers,
                                fields=["mask", "boxes", "caption"], multiprocessing_context=start_method,
                                device="cpu")
        return list(loader)

    got, want = batches(path, 2), batches(single, 0)
    assert len(got) == len(want) == 3
    for mine, theirs in zip(got, want):
        assert torch.equal(mine["image"], theirs["image"]) and torch.equal(mine["mask"], theirs["mask"])
        assert mine["caption"] == theirs["caption"]
        assert all(torch.equal(a, b) for a, b in zip(mine["boxes"], theirs["boxes"]))

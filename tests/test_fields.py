"""Fields of a sample beyond its image and class: stored natively by every format that stores them, each
value under its own CRC32, read only when asked, and given to torchvision's v2 transforms with the image."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import packed_formats as pf
from packed_formats.backends import memmap
from packed_formats.fields import FieldSpec, FieldValueError
from packed_formats.loading import sample_fields
from packed_formats.manifest import FIELDS_VERSION, PLAIN_VERSION, SIZES_VERSION, ArchiveManifest

FIELD_FORMATS = tuple(f for f in pf.PACKED_FORMATS if pf.backends.writer_class(f).stores_fields)  # all of ours
FIELDS = ["mask=image", "boxes=array:float32[N,4]", "depth=array:float16[6,5]", "points=array:int32[N,2]",
          "caption=text", "meta=json", "raw=bytes"]
SHAPE = (24, 32, 3)


def values_of(i: int, rng: np.random.Generator) -> dict:
    mask = np.zeros(SHAPE[:2], np.uint8)
    mask[2 + i % 5 : 12, 3:20] = 1 + i % 3
    return {
        "mask": mask,
        "boxes": rng.random((i % 4, 4), dtype=np.float32) * 20,
        "depth": rng.random((6, 5)).astype(np.float16),
        "points": rng.integers(-5, 5, (i % 3, 2), dtype=np.int32),
        "caption": f"sample {i}: é, 猫, \n\"quoted\"",
        "meta": {"i": i, "tags": ["a", None, True], "score": 0.25 * i},
        "raw": bytes(range(i % 7)),
    }


def image_of(i: int) -> np.ndarray:
    pixels = np.zeros(SHAPE, np.uint8)
    pixels[..., 0] = (np.arange(SHAPE[1]) * 7 + i) % 256
    pixels[..., 1] = (np.arange(SHAPE[0])[:, None] * 5) % 256
    return pixels


def write(path, fmt: str, mode: str, count: int = 9, fields=FIELDS, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    written = []
    with pf.open_writer(path, format=fmt, mode=mode, shape=SHAPE, classes=["a", "b", "c"], fields=fields) as writer:
        for i in range(count):
            values = values_of(i, rng)
            writer.add(image_of(i), i % 3, key=f"k/{i}", fields=values)
            written.append(values)
    return written


def assert_value(name: str, got, want) -> None:
    if name == "mask":
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(got))), want)
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), name
    else:
        assert got == want, name


# ---- the declaration --------------------------------------------------------------------------------------
def test_a_field_is_declared_as_name_and_kind_and_reads_back_as_declared():
    for text in FIELDS:
        spec = FieldSpec.parse(text)
        assert spec.describe() == text
        assert FieldSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert FieldSpec.parse("boxes=array:float32[N,4]").shape == (None, 4)
    assert FieldSpec.parse("depth=array:float16[6,5]").fixed and not FieldSpec.parse("b=array:uint8[N]").fixed


@pytest.mark.parametrize("text", [
    "image=text", "label=json", "9lives=text", "a-b=text", "x" * 65 + "=text", "mask=picture", "mask",
    "boxes=array:float31[N,4]", "boxes=array:float32[4,N]", "boxes=array:float32[0,4]", "boxes=array:float32[]",
    "boxes=array:float32[-1,4]",
])
def test_a_field_that_cannot_be_declared_is_refused_by_name(text):
    with pytest.raises(FieldValueError):
        FieldSpec.parse(text)


@pytest.mark.parametrize("data", [
    [{"name": "a", "kind": "text", "extra": 1}], [{"name": "a", "kind": "array"}], [{"name": "a"}],
    [{"name": "a", "kind": "text"}, {"name": "a", "kind": "json"}], {"name": "a"}, [[1]],
    [{"name": "a", "kind": "array", "dtype": "float32", "shape": "N,4"}],
])
def test_a_manifest_declaring_fields_it_cannot_have_is_refused(data):
    text = json.dumps({"format": "zip", "mode": "raw", "count": 0, "classes": [], "format_version": 1,
                       "fields": data})
    with pytest.raises(ValueError):
        ArchiveManifest.from_json(text)


def reseal_field_shape(path, shape) -> None:
    """Give the first field of the memmap archive at ``path`` the declared ``shape`` (any JSON), and seal its
    manifest again as its writer would: only a reader's own checks of the declaration stand in the way."""
    from packed_formats.manifest import _content_crc32, canonical_json

    name = os.path.join(path, memmap.MANIFEST)
    with open(name) as file:
        data = json.load(file)
    del data["manifest_crc32"]
    data["fields"][0]["shape"] = shape
    data["manifest_crc32"] = _content_crc32(data)
    with open(name, "w") as file:
        file.write(canonical_json(data))


@pytest.mark.parametrize("shape, problem", [
    ([None, 2147483648, 2147483648, 2147483648], "row of 39614081257132168796771975168 bytes"),
    ([65536, 65536, 65536], "value of 1125899906842624 bytes"),
    ([None, 1 << 30, 4], "row of 17179869184 bytes"),
    ([None, True], "True"), ([None, 2.0], "2.0"), ([None, "2"], "'2'"), ([True, 4], "True"), ([4.0, 4], "4.0"),
])
def test_a_declared_shape_no_value_can_have_is_refused_by_name_when_the_manifest_is_read(tmp_path, shape, problem):
    """A resealed manifest whose array field's rows would not fit in memory (their size overflowing int64) or
    whose dimensions are no integers (true, 2.0, "2") is refused when the archive opens, naming the archive,
    the field and the dimension: never a ZeroDivisionError, a coerced shape or a wrong value later."""
    path = tmp_path / "a.memmap"
    with pf.open_writer(path, format="memmap", mode="raw", shape=SHAPE, classes=["a"],
                        fields=["boxes=array:float32[N,2]"]) as writer:
        for i in range(3):
            writer.add(image_of(i), 0, fields={"boxes": np.zeros((i, 2), np.float32)})
    reseal_field_shape(path, shape)
    for opening in (pf.open_archive, pf.verify_archive, lambda p: pf.PackedDataset(p, fields=["boxes"])[0]):
        with pytest.raises(pf.CorruptArchiveError, match="field 'boxes'") as caught:
            opening(path)
        assert str(path) in str(caught.value) and problem in str(caught.value)
    with pytest.raises(FieldValueError, match=f"field 'boxes'.*{re.escape(problem)}"):
        FieldSpec.from_json({"name": "boxes", "kind": "array", "dtype": "float32", "shape": shape})


def test_a_declared_shape_is_bounded_and_of_integers_however_it_is_given():
    """The command line's text and the Python API are held to the same bounds as the manifest."""
    assert FieldSpec("b", "array", "uint8", (None, np.int64(4))).shape == (None, 4)
    assert FieldSpec.parse("b=array:uint8[N,2147483648]").shape == (None, 1 << 31)  # a row of 2 GiB at most
    for bad in ("b=array:float32[N,2147483648]", "b=array:uint8[N,65536,65536]", "b=array:uint8[N,٢]"):
        with pytest.raises(FieldValueError, match="field 'b'"):
            FieldSpec.parse(bad)
    for dims in ((None, True), (None, 2.0), (None, "2"), (np.bool_(True), 2)):
        with pytest.raises(FieldValueError, match="field 'b'.*a dimension is a positive integer"):
            FieldSpec("b", "array", "uint8", dims)


# ---- storing and reading ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["raw", "encoded"])
@pytest.mark.parametrize("fmt", FIELD_FORMATS)
def test_every_kind_of_field_reads_back_exactly_in_every_format(tmp_path, fmt, mode):
    path = tmp_path / f"a.{fmt}"
    written = write(path, fmt, mode)
    with pf.open_archive(path) as reader:
        # an encoded archive's index records its images' sizes, which version 8 on holds
        assert reader.manifest.format_version == (SIZES_VERSION if mode == "encoded" else FIELDS_VERSION)
        assert [spec.describe() for spec in reader.fields] == FIELDS
        for i, values in enumerate(written):
            for name, want in values.items():
                assert_value(name, reader.read_field(i, name), want)
            assert reader.read_field_bytes(i, "caption") == values["caption"].encode()
        if mode == "raw":
            assert np.array_equal(reader.read_many([0, 8, 3]), np.stack([image_of(0), image_of(8), image_of(3)]))
    assert pf.verify_archive(path, decode=True).ok


@pytest.mark.parametrize("fmt", FIELD_FORMATS)
def test_an_archive_without_fields_is_written_as_before(tmp_path, fmt):
    path = tmp_path / f"a.{fmt}"
    with pf.open_writer(path, format=fmt, mode="raw", shape=SHAPE, classes=["a"]) as writer:
        writer.add(image_of(0), 0)
    with pf.open_archive(path) as reader:
        assert reader.manifest.format_version == PLAIN_VERSION and reader.fields == ()
        assert "fields" not in json.loads(reader.manifest.to_json())
        assert not [name for name in reader.index.arrays() if name.startswith("field.")]


def test_a_format_that_stores_no_fields_says_which_do(tmp_path):
    from . import tiny_format  # a format registered from outside the library, whose writer stores none

    pf.backends.register(tiny_format.SPEC)
    try:
        with pytest.raises(ValueError, match="zip, hdf5, lmdb, memmap"):
            pf.open_writer(tmp_path / "a.tiny", format="tiny", mode="raw", shape=SHAPE, fields=["caption=text"])
    finally:
        pf.backends.unregister("tiny")
    assert not os.listdir(tmp_path)


def test_a_damaged_or_resealed_hdf5_fields_header_is_refused_by_name(tmp_path):
    import h5py

    from packed_formats.backends import hdf5, hdf5_fields

    path = tmp_path / "a.h5"
    write(path, "hdf5", "raw", count=4)
    with h5py.File(path, "r") as file:
        at = file[hdf5_fields.NAME].id.get_offset()
    with open(path, "rb") as raw:
        raw.seek(at + 12)
        header = raw.read(200)
    damaged = tmp_path / "damaged.h5"
    damaged.write_bytes(path.read_bytes())
    with open(damaged, "r+b") as raw:
        raw.seek(at + 20)
        raw.write(b"X")
    with pytest.raises(pf.CorruptArchiveError, match="fields' header does not match its checksum"):
        pf.open_archive(damaged)
    # re-sealed: a span moved past the bundle's end, the locator's checksums written anew
    first = header.index(b"[") + 1
    digits = header[first : header.index(b",", first)]
    with open(path, "r+b") as raw:
        raw.seek(at + 12 + first)
        raw.write(b"9" * len(digits))
    hdf5.seal_metadata(str(path))
    with pytest.raises(pf.CorruptArchiveError, match="outside the bundle"):
        pf.open_archive(path)


@pytest.mark.parametrize("changes, problem", [
    ({"n": None}, "field 'n' has no value"),
    ({"other": 1}, "not declared"),
    ({"caption": 3}, "'caption' \\(text\\): a str"),
    ({"n": [[1, 2]]}, "shape \\(1, 2\\) is not \\[N\\]"),
    ({"n": [1.5]}, "float64 values do not fit int16"),
    ({"meta": float("nan")}, "'meta' \\(json\\)"),
    ({"meta": {"a": object()}}, "'meta' \\(json\\)"),
    ({"picture": b"not an image"}, "no JPEG or PNG"),
])
@pytest.mark.parametrize("fmt", FIELD_FORMATS)
def test_a_value_a_field_cannot_store_is_refused_by_name_and_nothing_of_its_sample_is_written(
        tmp_path, fmt, changes, problem):
    fields = ["caption=text", "n=array:int16[N]", "meta=json", "picture=image"]
    full = {"caption": "ok", "n": [1, 2], "meta": {"a": 1}, "picture": np.zeros((4, 4), np.uint8)}
    path = tmp_path / f"a.{fmt}"
    with pf.open_writer(path, format=fmt, mode="raw", shape=SHAPE, fields=fields) as writer:
        writer.add(image_of(0), 0, fields=full)
        with pytest.raises(pf.InvalidSampleError, match=problem) as caught:
            writer.add(image_of(1), 0, key="bad/one", fields=dict(full, **changes))
        assert caught.value.index == 1 and caught.value.key == "bad/one"
        writer.add(image_of(2), 0, key="next", fields=dict(full, caption="after"))
    with pf.open_archive(path) as reader:
        assert len(reader) == 2 and reader.key(1) == "next" and reader.read_field(1, "caption") == "after"
        assert np.array_equal(reader.read(1), image_of(2))
    assert pf.verify_archive(path).ok


# ---- damage -----------------------------------------------------------------------------------------------
def flip_field_byte(path, fmt: str, reader_index, name: str, i: int) -> None:
    """Flip one byte of field ``name``'s value of sample i where the format keeps it."""
    if fmt == "memmap":
        file = os.path.join(path, memmap.field_file_name(name))
        data = np.load(file, mmap_mode="r")
        at = int(data.offset) + int(reader_index.fields[f"field.{name}.offsets"][i])
    elif fmt == "zip":
        file, at = str(path), int(reader_index.fields[f"field.{name}.positions"][i])
    else:  # hdf5, lmdb: the value's bytes, found in the file
        file = str(path)
        with pf.open_archive(path) as reader:
            value = reader.read_field_bytes(i, name)
        with open(file, "rb") as raw:
            at = raw.read().find(value)
        assert at > 0
    with open(file, "r+b") as raw:
        raw.seek(at)
        byte = raw.read(1)
        raw.seek(at)
        raw.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("fmt", FIELD_FORMATS)
def test_a_damaged_field_value_is_a_named_error_and_verify_finds_it(tmp_path, fmt):
    path = tmp_path / f"a.{fmt}"
    write(path, fmt, "encoded")
    with pf.open_archive(path) as reader:
        index = reader.index
        flip_field_byte(path, fmt, index, "caption", 4)
    with pf.open_archive(path) as reader:
        with pytest.raises(pf.CorruptSampleError, match="field 'caption': checksum mismatch") as caught:
            reader.read_field(4, "caption")
        assert caught.value.index == 4 and caught.value.key == "k/4"
        assert reader.read_field(3, "caption") == values_of(3, np.random.default_rng(0))["caption"]
        reader.read(4)  # the image is not the damaged part
    report = pf.verify_archive(path)
    assert not report.ok and report.bad_count == 1 and report.bad[0].index == 4 and "caption" in report.bad[0].problem
    dataset = pf.PackedDataset(path, output="tensor")  # asks for no field: reads none
    assert [dataset[i][1] for i in range(len(dataset))] == [i % 3 for i in range(9)]


def test_an_index_resealed_without_a_fields_checksums_is_refused(tmp_path):
    path = tmp_path / "a.memmap"
    write(path, "memmap", "raw", count=3)
    name = os.path.join(path, memmap.MANIFEST)
    with open(name) as file:
        manifest = ArchiveManifest.from_json(file.read())
    os.unlink(os.path.join(path, "field.caption.crc32.npy"))
    kept = tuple((k, v) for k, v in manifest.index_crc32 if k != "field.caption.crc32")
    with open(name, "w") as file:
        file.write(dataclasses.replace(manifest, index_crc32=kept).to_json())
    with pytest.raises(pf.CorruptArchiveError, match="field.caption.crc32"):
        pf.open_archive(path)


def test_stored_bytes_that_are_no_value_of_their_field_are_refused():
    with pytest.raises(FieldValueError, match="no whole number"):
        FieldSpec.parse("b=array:float32[N,4]").decode(b"\0" * 20)
    with pytest.raises(FieldValueError, match="expected 60"):
        FieldSpec.parse("d=array:float16[6,5]").decode(b"\0" * 58)
    with pytest.raises(FieldValueError):
        FieldSpec.parse("t=text").decode(b"\xff\xfe")
    with pytest.raises(FieldValueError):
        FieldSpec.parse("j=json").decode(b"{")
    with pytest.raises(FieldValueError):
        FieldSpec.parse("j=json").decode(b"NaN")
    with pytest.raises(FieldValueError):
        FieldSpec.parse("m=image").decode(b"GIF89a")


# ---- the dataset ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FIELD_FORMATS)
def test_the_dataset_returns_the_fields_asked_for_as_a_dict(tmp_path, fmt):
    path = tmp_path / f"a.{fmt}"
    written = write(path, fmt, "encoded")
    dataset = pf.PackedDataset(path, output="tensor", fields=["mask", "boxes", "caption", "meta"])
    sample = dataset[5]
    assert set(sample) == {"image", "label", "mask", "boxes", "caption", "meta"}
    assert sample["label"] == 2 and sample["image"].shape == (3, 24, 32)
    assert torch.equal(sample["mask"][0], torch.from_numpy(written[5]["mask"]))
    assert torch.equal(sample["boxes"], torch.from_numpy(written[5]["boxes"]))
    assert sample["caption"] == written[5]["caption"] and sample["meta"] == written[5]["meta"]
    with pytest.raises(KeyError, match="no field 'nope'"):
        pf.PackedDataset(path, fields=["nope"])
    with pytest.raises(ValueError, match="boxes"):
        pf.PackedDataset(path, output="tensor", fields={"caption": "boxes:XYXY"})
    with pytest.raises(ValueError, match="output='pil' or 'tensor'"):  # v2 transforms pass numpy images through
        pf.PackedDataset(path, output="numpy", fields={"mask": "mask"})


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow),
                                    pytest.param("forkserver", marks=pytest.mark.slow)])
def test_v2_transforms_move_masks_and_boxes_with_the_image_in_workers(tmp_path, method):
    from torchvision.transforms import v2

    path = tmp_path / "a.zip"
    rng = np.random.default_rng(1)
    with pf.open_writer(path, format="zip", mode="encoded", classes=["a"], encoding="png",
                        fields=["mask=image", "boxes=array:float32[N,4]"]) as writer:
        for i in range(8):
            code = rng.integers(0, 200, SHAPE[:2], dtype=np.uint8)
            pixels = np.stack([code, code // 2, np.full_like(code, i)], axis=-1)  # lossless PNG: exact pixels
            boxes = np.array([[2, 3, 10, 12], [0, 0, 31, 23]], np.float32)
            writer.add(pixels, 0, fields={"mask": code, "boxes": boxes})
    transform = v2.Compose([v2.RandomCrop((16, 16)), v2.RandomHorizontalFlip(), v2.RandomVerticalFlip()])
    dataset = pf.PackedDataset(path, output="tensor", transform=transform,
                               fields={"mask": "mask", "boxes": "boxes:XYXY"})
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context=method,
                                         collate_fn=dataset.collate)
    batches = list(loader)
    assert len(batches) == 2
    for batch in batches:
        assert batch["image"].shape == (4, 3, 16, 16) and batch["mask"].shape == (4, 16, 16)
        assert torch.equal(batch["image"][:, 0], batch["mask"].as_subclass(torch.Tensor))  # cropped and flipped alike
        assert batch["label"].tolist() == [0] * 4
        for boxes in batch["boxes"]:
            assert type(boxes).__name__ == "BoundingBoxes" and tuple(boxes.canvas_size) == (16, 16)
            assert boxes.shape == (2, 4) and float(boxes.max()) <= 16


def test_collate_lists_variable_fields_stacks_the_rest_and_names_what_cannot_stack():
    samples = [{"image": torch.zeros(3, 4, 4), "label": i, "boxes": torch.zeros(2, 4), "caption": f"c{i}"}
               for i in range(3)]
    batch = sample_fields.collate(samples, lists=("boxes",))
    assert batch["image"].shape == (3, 3, 4, 4) and batch["label"].tolist() == [0, 1, 2]
    assert isinstance(batch["boxes"], list) and len(batch["boxes"]) == 3 and batch["caption"] == ["c0", "c1", "c2"]
    samples[1]["image"] = torch.zeros(3, 5, 4)
    with pytest.raises(ValueError, match="'image' tensors have shapes"):
        sample_fields.collate(samples, lists=("boxes",))


# ---- conversion -------------------------------------------------------------------------------------------
def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def shard_members(i: int) -> dict:
    """The members of webdataset sample i: a PNG image, its class, a segmentation mask, a caption, JSON, boxes."""
    mask = np.zeros((20, 30), np.uint8)
    mask[i : i + 5, 3:9] = 1 + i % 2
    return {"png": png(image_of(i)[:20, :30]), "cls": str(i % 2).encode(), "seg.png": png(mask),
            "txt": f"caption {i}".encode(), "json": json.dumps({"i": i}).encode(),
            "boxes.npy": npy(np.full((i % 3, 4), i, np.float32))}


def write_shard(path, count: int = 6, change=None, compressed: bool = False) -> str:
    import tarfile

    with tarfile.open(path, "w:gz" if compressed else "w") as tar:
        for i in range(count):
            members = shard_members(i)
            if change is not None:
                change(i, members)
            for extension, data in members.items():
                info = tarfile.TarInfo(f"s{i:04d}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.mark.parametrize("fmt", FIELD_FORMATS)
def test_webdataset_members_become_fields_declared_or_found(tmp_path, fmt):
    shard = write_shard(tmp_path / "shard-000.tar")
    dst = tmp_path / f"out.{fmt}"
    pf.convert(shard, dst, fields=["auto", "boxes=array:float32[N,4]"], workers=2, quiet=True)
    with pf.open_archive(dst) as reader:
        assert [s.describe() for s in reader.fields] == ["boxes=array:float32[N,4]", "json=json", "seg=image",
                                                         "txt=text"]
        for i in range(6):
            members = shard_members(i)
            assert reader.read(i) == members["png"]  # the image as it was
            assert reader.read_field_bytes(i, "seg") == members["seg.png"]
            assert reader.read_field(i, "txt") == f"caption {i}" and reader.read_field(i, "json") == {"i": i}
            assert np.array_equal(reader.read_field(i, "boxes"), np.full((i % 3, 4), i, np.float32))
    declared = tmp_path / f"declared.{fmt}"
    pf.convert(shard, declared, fields=["seg=image", "txt=text"], quiet=True)
    with pf.open_archive(declared) as reader:
        assert [s.name for s in reader.fields] == ["seg", "txt"]
    plain = tmp_path / f"plain.{fmt}"
    pf.convert(shard, plain, quiet=True)  # no --field: as before, no field
    with pf.open_archive(plain) as reader:
        assert reader.fields == () and len(reader) == 6


@pytest.mark.parametrize("change, problem", [
    (lambda i, m: m.update({"json": b"{not json"}) if i == 3 else None, "s0003.json.*'json' \\(json\\)"),
    (lambda i, m: m.pop("seg.png") if i == 3 else None, "sample 's0003' has no member for field 'seg'"),
    (lambda i, m: m.update({"boxes.npy": npy(np.zeros((2, 3), np.float32))}) if i == 3 else None,
     "s0003.boxes.npy.*shape \\(2, 3\\) is not \\[Nx4\\]"),
    (lambda i, m: m.update({"txt": b"\xff\xfe"}) if i == 3 else None, "s0003.txt.*'txt' \\(text\\)"),
])
def test_a_member_that_is_no_value_of_its_field_is_named_or_skipped(tmp_path, change, problem):
    shard = write_shard(tmp_path / "shard-000.tar", change=change)
    fields = ["seg=image", "txt=text", "json=json", "boxes=array:float32[N,4]"]
    with pytest.raises(pf.PackedFormatError, match=problem):
        pf.convert(shard, tmp_path / "out.zip", fields=fields, workers=1, quiet=True)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out") or ".out" in n]
    pf.convert(shard, tmp_path / "out.zip", fields=fields, workers=1, quiet=True, on_error="skip")
    with pf.open_archive(tmp_path / "out.zip") as reader:
        assert len(reader) == 5 and "s0003" not in " ".join(reader.key(i) for i in range(5))
        assert [reader.read_field(i, "txt") for i in range(5)] == [f"caption {i}" for i in (0, 1, 2, 4, 5)]


def test_auto_fields_name_every_array_member_to_declare_in_one_message(tmp_path):
    def more_arrays(i, members):
        members["depth.npy"] = npy(np.zeros((20, 30), np.uint16))
        members["points.npy"] = npy(np.zeros((2, 2), np.float32))

    shard = write_shard(tmp_path / "shard-000.tar", change=more_arrays)
    with pytest.raises(pf.InvalidSourceError, match="the .boxes.npy, .depth.npy and .points.npy members are arrays: "
                                                    "declare.*--field boxes=array:DTYPE\\[N,...\\] --field "
                                                    "depth=array:DTYPE\\[N,...\\] --field points=array:"):
        pf.convert(shard, tmp_path / "a.zip", fields=["auto"], quiet=True)
    pf.convert(shard, tmp_path / "b.zip", fields=["auto", "boxes=array:float32[N,4]", "depth=array:uint16[20,30]",
                                                 "points=array:float32[N,2]"], quiet=True, workers=1)


def test_fields_are_refused_where_they_cannot_be_packed(tmp_path):
    shard = write_shard(tmp_path / "shard-001.tar")
    with pytest.raises(ValueError, match="array field boxes=array:float32\\[N,4\\], which a resize of the images"):
        pf.convert(shard, tmp_path / "a.zip", fields=["seg=image", "boxes=array:float32[N,4]"], mode="raw", size=8,
                   quiet=True)
    with pytest.raises(pf.InvalidSourceError, match="arrays: declare"):
        pf.convert(shard, tmp_path / "a.zip", fields=["auto"], quiet=True)
    import tarfile

    with tarfile.open(tmp_path / "tree.tar", "w") as tar:  # a tar of a class-folder tree reads no fields yet
        for name in ("a/x.png", "a/x.txt", "b/y.png", "b/y.txt"):
            data = png(image_of(0)) if name.endswith(".png") else b"text"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(pf.InvalidSourceError, match="fields are read from .*; this is a tar source"):
        pf.convert(tmp_path / "tree.tar", tmp_path / "b.zip", fields=["txt=text"], quiet=True)
    assert sorted(os.listdir(tmp_path)) == ["shard-001.tar", "tree.tar"]


def test_an_archive_converted_to_another_format_keeps_its_fields(tmp_path):
    source = tmp_path / "a.lmdb"
    written = write(source, "lmdb", "encoded")
    pf.convert(source, tmp_path / "b.memmap", quiet=True)
    with pf.open_archive(tmp_path / "b.memmap") as reader:
        assert [s.describe() for s in reader.fields] == FIELDS
        for i, values in enumerate(written):
            for name, want in values.items():
                assert_value(name, reader.read_field(i, name), want)
    pf.convert(source, tmp_path / "c.zip", fields=["caption=text"], quiet=True)
    with pf.open_archive(tmp_path / "c.zip") as reader:
        assert [s.name for s in reader.fields] == ["caption"]
    with pytest.raises(ValueError, match="has the array field"):
        pf.convert(source, tmp_path / "d.zip", mode="raw", size=8, quiet=True)
    pf.convert(source, tmp_path / "e.zip", mode="raw", size=8, fields=["none"], quiet=True)  # left out on purpose
    with pf.open_archive(tmp_path / "e.zip") as reader:
        assert reader.fields == () and len(reader) == len(written)
    with pytest.raises(ValueError, match="'none' goes alone"):
        pf.convert(source, tmp_path / "f.zip", fields=["none", "caption=text"], quiet=True)


def test_the_command_line_packs_fields_and_info_lists_them(tmp_path):
    import subprocess
    import sys

    shard = write_shard(tmp_path / "shard-000.tar")
    run = [sys.executable, "-m", "packed_formats"]
    converted = subprocess.run(run + ["convert", shard, str(tmp_path / "a.zip"), "--field", "seg=image",
                                      "--field", "boxes=array:float32[N,4]", "--quiet"], capture_output=True, text=True)
    assert converted.returncode == 0, converted.stderr
    info = subprocess.run(run + ["info", str(tmp_path / "a.zip")], capture_output=True, text=True)
    assert "fields      seg=image, boxes=array:float32[N,4]" in info.stdout
    facts = json.loads(subprocess.run(run + ["info", "--json", str(tmp_path / "a.zip")], capture_output=True,
                                      text=True).stdout)
    assert facts["fields"] == ["seg=image", "boxes=array:float32[N,4]"]
    bad = subprocess.run(run + ["convert", shard, str(tmp_path / "b.zip"), "--field", "seg=picture"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "kind must be one of" in bad.stderr and "Traceback" not in bad.stderr


# ---- fields from list files and the Hub's tables ----------------------------------------------------------
def write_list_dataset(root, count: int = 5) -> list:
    """Images, masks and .npy boxes in ``root/img``, and the rows naming them (with a caption and JSON)."""
    os.makedirs(root / "img", exist_ok=True)
    rows = []
    for i in range(count):
        Image.fromarray(image_of(i)).save(root / "img" / f"{i}.png")
        Image.fromarray(np.full((8, 8), i, np.uint8)).save(root / "img" / f"{i}.mask.png")
        np.save(root / "img" / f"{i}.boxes.npy", np.full((i % 3, 4), i, np.float32))
        rows.append({"path": f"img/{i}.png", "label": i % 2, "mask": f"img/{i}.mask.png", "caption": f"cap, {i}",
                     "meta": {"i": i, "ok": True}, "boxes": f"img/{i}.boxes.npy"})
    return rows


def test_a_list_names_each_rows_fields_in_csv_json_and_json_lines(tmp_path):
    import csv

    rows = write_list_dataset(tmp_path)
    (tmp_path / "list.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "list.json").write_text(json.dumps(rows))
    with open(tmp_path / "list.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["path", "label", "mask", "caption", "meta", "boxes"])
        for r in rows:
            writer.writerow([r["path"], r["label"], r["mask"], r["caption"], json.dumps(r["meta"]), r["boxes"]])
    for name, fields in [("list.jsonl", ["auto", "boxes=array:float32[N,4]"]),
                         ("list.json", ["mask=image", "caption=text", "meta=json", "boxes=array:float32[N,4]"]),
                         ("list.csv", ["auto", "meta=json", "boxes=array:float32[N,4]"])]:
        out = tmp_path / f"{name}.zip"
        pf.convert(tmp_path / name, out, fields=fields, quiet=True)
        with pf.open_archive(out) as reader:
            assert {s.describe() for s in reader.fields} == {"mask=image", "caption=text", "meta=json",
                                                             "boxes=array:float32[N,4]"}, name
            for i, row in enumerate(rows):
                assert reader.read_field(i, "caption") == row["caption"] and reader.read_field(i, "meta") == row["meta"]
                assert reader.read_field_bytes(i, "mask") == (tmp_path / row["mask"]).read_bytes()
                assert np.array_equal(reader.read_field(i, "boxes"), np.full((i % 3, 4), i, np.float32))
    with pytest.raises(pf.InvalidSourceError, match="no column 'depth'"):
        pf.convert(tmp_path / "list.csv", tmp_path / "x.zip", fields=["depth=text"], quiet=True)
    with open(tmp_path / "bad.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["path", "label", "meta"])
        for i, r in enumerate(rows):
            writer.writerow([r["path"], r["label"], "{broken" if i == 2 else json.dumps(r["meta"])])
    with pytest.raises(pf.CorruptSampleError, match="column 'meta'.*'meta' \\(json\\)"):
        pf.convert(tmp_path / "bad.csv", tmp_path / "x.zip", fields=["meta=json"], workers=1, quiet=True)


@pytest.mark.parametrize("layout", ["parquet", "arrow"])
def test_the_hubs_columns_become_fields(tmp_path, layout):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from .test_hub_sources import image_table

    count = 7
    rows = [(png(image_of(i)), f"{i}.png", i % 3) for i in range(count)]
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    extra = {
        "mask": pa.array([{"bytes": png(np.full((6, 6), i, np.uint8)), "path": None} for i in range(count)], struct),
        "caption": pa.array([f"row {i}" for i in range(count)]),
        "boxes": pa.array([[[float(i)] * 4] * (i % 3) for i in range(count)], pa.list_(pa.list_(pa.float32()))),
        "score": pa.array([0.5 * i for i in range(count)]),
    }
    table = image_table(rows, extra=extra)
    src = tmp_path / ("data.parquet" if layout == "parquet" else "data.arrow")
    if layout == "parquet":
        pq.write_table(table, src, row_group_size=3)
    else:
        with pa.OSFile(str(src), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for chunk in table.to_batches(max_chunksize=3):
                writer.write_batch(chunk)
    out = tmp_path / "out.lmdb"
    pf.convert(src, out, fields=["auto", "boxes=array:float32[N,4]"], workers=2, quiet=True)
    with pf.open_archive(out) as reader:
        assert [s.describe() for s in reader.fields] == ["boxes=array:float32[N,4]", "mask=image", "caption=text",
                                                         "score=json"]
        for i in range(count):
            assert np.array_equal(reader.read_field(i, "boxes"), np.full((i % 3, 4), i, np.float32))
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(reader.read_field(i, "mask")))),
                                  np.full((6, 6), i, np.uint8))
            assert reader.read_field(i, "caption") == f"row {i}" and reader.read_field(i, "score") == 0.5 * i
    with pytest.raises(pf.InvalidSourceError, match="no column 'depth'"):
        pf.convert(src, tmp_path / "x.zip", fields=["depth=text"], quiet=True)
    with pytest.raises(pf.CorruptSampleError, match="column 'boxes'.*shape"):
        pf.convert(src, tmp_path / "y.zip", fields=["boxes=array:float32[N,3]"], workers=1, quiet=True)


def test_files_beside_a_folders_images_are_their_fields(tmp_path):
    root = tmp_path / "tree"
    for c, name in enumerate(["cat", "dog"]):
        (root / name).mkdir(parents=True)
        for i in range(3):
            stem = root / name / f"{name}{i}"
            Image.fromarray(image_of(3 * c + i)).save(f"{stem}.jpg")
            Image.fromarray(np.full((5, 5), i, np.uint8)).save(f"{stem}.seg.png")
            (root / name / f"{name}{i}.json").write_text(json.dumps({"n": 3 * c + i}))
    out = tmp_path / "out.zip"
    pf.convert(root, out, fields=["seg=image", "json=json"], quiet=True)
    with pf.open_archive(out) as reader:
        assert len(reader) == 6 and reader.classes == ["cat", "dog"]  # the masks are fields, not samples
        for i in range(6):
            name = reader.key(i)
            assert name.endswith(".jpg") and reader.read_field(i, "json") == {"n": i}
            assert reader.read_field_bytes(i, "seg") == (root / name.replace(".jpg", ".seg.png")).read_bytes()
    os.unlink(root / "dog" / "dog1.json")
    with pytest.raises(pf.CorruptSampleError, match="dog1.jpg .*: has no file for field 'json'"):
        pf.convert(root, tmp_path / "x.zip", fields=["seg=image", "json=json"], quiet=True)
    summary = pf.convert(root, tmp_path / "y.zip", fields=["seg=image", "json=json"], on_error="skip", quiet=True)
    assert summary.samples == 5 and len(summary.failed) == 1
    with pytest.raises(pf.InvalidSourceError, match="named, not found"):
        pf.convert(root, tmp_path / "z.zip", fields=["auto"], quiet=True)
    plain = tmp_path / "plain.zip"
    pf.convert(root, plain, quiet=True)  # without fields the masks are images like the others, as before
    with pf.open_archive(plain) as reader:
        assert len(reader) == 12


def test_a_set_where_one_part_has_fields_the_others_lack_is_refused_by_name(tmp_path):
    from packed_formats.backends.sharded import ShardedWriter
    from packed_formats.manifest import part_of_set

    path = tmp_path / "set.zip"
    with ShardedWriter(path, "zip", 2, mode="raw", shape=SHAPE, classes=["a"]) as writer:
        for i in range(4):
            writer.add(image_of(i), 0)
    with pf.open_archive(path) as reader:
        first = reader.backend.parts[0]
        part, (set_id, place) = first.path, (first.manifest.set_id, first.manifest.part)
    os.unlink(part)  # the first part written again, in its place in the set, with a field
    with part_of_set(set_id, place), pf.open_writer(part, format="zip", mode="raw", shape=SHAPE, classes=["a"],
                                                    fields=["caption=text"]) as writer:
        for i in range(2):
            writer.add(image_of(i), 0, fields={"caption": f"c{i}"})
    # the index's content digest of part 0 names it first; a part that agrees with it is compared by its fields
    # (tests/test_set_fields.py)
    with pytest.raises(pf.CorruptArchiveError, match=r"set-00000\.zip holds other samples than part 0"):
        pf.open_archive(path)


@pytest.mark.parametrize("resize_mode", ["stretch", "shorter-side-center-crop"])
def test_a_resize_takes_the_masks_along_with_nearest_neighbour_sampling(tmp_path, resize_mode):
    from packed_formats import policy

    shard = write_shard(tmp_path / "shard-000.tar")
    out = tmp_path / "raw.lmdb"
    pf.convert(shard, out, fields=["seg=image", "txt=text"], mode="raw", size=(12, 16), resize_mode=resize_mode,
               quiet=True)
    with pf.open_archive(out) as reader:
        for i in range(6):
            members = shard_members(i)
            mask = Image.open(io.BytesIO(reader.read_field(i, "seg")))
            assert mask.size == (16, 12) and mask.mode == "L"
            expected = policy.resize(Image.open(io.BytesIO(members["seg.png"])), (12, 16), resize_mode,
                                     resample=Image.Resampling.NEAREST)
            assert np.array_equal(np.asarray(mask), np.asarray(expected))
            assert set(np.unique(np.asarray(mask))) <= {0, 1, 2}  # classes, never blended
            assert reader.read(i).shape == (12, 16, 3) and reader.read_field(i, "txt") == f"caption {i}"


def test_compressed_shards_give_the_same_fields_in_one_ordered_pass(tmp_path):
    def bad_json(i, members):
        if i == 4:
            members["json"] = b"{"

    fields = ["seg=image", "txt=text", "json=json", "boxes=array:float32[N,4]"]
    for name, change in (("good", None), ("bad", bad_json)):
        plain = write_shard(tmp_path / f"{name}-000.tar", change=change)
        packed = write_shard(tmp_path / f"{name}-001.tar.gz", change=change, compressed=True)
        pf.convert(plain, tmp_path / f"{name}-plain.zip", fields=fields, on_error="skip", workers=2, quiet=True)
        summary = pf.convert(packed, tmp_path / f"{name}-packed.zip", fields=fields, on_error="skip", workers=2,
                             quiet=True)
        a, b = pf.open_archive(tmp_path / f"{name}-plain.zip"), pf.open_archive(tmp_path / f"{name}-packed.zip")
        with a, b:
            assert len(a) == len(b) == (6 if change is None else 5)
            for i in range(len(a)):
                assert a.key(i) == b.key(i) and a.read(i) == b.read(i)
                for spec in a.fields:
                    assert a.read_field_bytes(i, spec.name) == b.read_field_bytes(i, spec.name)
        if change is not None:
            assert len(summary.failed) == 1 and "s0004.json" in summary.failed[0]


# ---- damage anywhere: the fields read intact or fail by name, never wrong, never a hang or a crash --------
def read_every_field(path, reference, mode):
    """Every sample's stored image and field bytes against ``reference``: None when all are intact."""
    with pf.open_archive(path) as reader:
        if len(reader) != len(reference):
            return f"count {len(reader)}, expected {len(reference)}"
        for i, values in enumerate(reference):
            if reader.read_bytes(i) != values[""]:
                return f"sample {i}: its image differs"
            for name, want in values.items():
                if name and reader.read_field_bytes(i, name) != want:
                    return f"sample {i}: field {name!r} differs"
                if name:
                    reader.read_field(i, name)  # and decodes as its kind, or fails by name
    return None


def verify_every_field(path, reference, mode):
    """``verify_archive(decode=True)``: None when it passes every sample, Flagged when it reports one."""
    from . import fuzz_helpers as fuzz

    report = pf.verify_archive(path, decode=True)
    if not report.ok:
        raise fuzz.Flagged(report.lines()[-1])
    return None if report.count == len(reference) else f"verified {report.count} samples of {len(reference)}"


def field_fuzz(tmp_path, fmt: str, seed: int, trials: int) -> list:
    """``trials`` damaged copies of an archive with fields: the bad outcomes' descriptions."""
    from . import fuzz_helpers as fuzz

    good = tmp_path / f"good.{fmt}"
    write(good, fmt, "encoded", count=6)
    with pf.open_archive(good) as reader:
        reference = [{"": reader.read_bytes(i), **{s.name: reader.read_field_bytes(i, s.name) for s in reader.fields}}
                     for i in range(len(reader))]
    files = fuzz.archive_files(str(good))
    landmarks = dict(fuzz.landmarks_of(str(good), files))
    bad = []
    for n in range(trials):
        damage = fuzz.choose_damage(fuzz.trial_rng(seed, fmt, "fields", n), files, landmarks)
        copy = fuzz.copy_archive(str(good), str(tmp_path / f"trial-{n}.{fmt}"))
        fuzz.apply_damage(copy, damage)
        read = fuzz.run_isolated(read_every_field, copy, reference, "encoded", 15)
        verify = fuzz.run_isolated(verify_every_field, copy, reference, "encoded", 15)
        if read.verdict not in (fuzz.SAME, fuzz.NAMED):  # a wrong value, a foreign error, a hang, a crash
            bad.append(f"{fmt} trial {n} ({damage.describe()}): reading {read}")
        if verify.verdict not in (fuzz.SAME, fuzz.FLAGGED, fuzz.NAMED):
            bad.append(f"{fmt} trial {n} ({damage.describe()}): verify {verify}")
        if read.verdict == fuzz.NAMED and verify.verdict == fuzz.SAME:
            bad.append(f"{fmt} trial {n} ({damage.describe()}): verify passed what a read refused ({read})")
        (shutil.rmtree if os.path.isdir(copy) else os.unlink)(copy)
    return bad


@pytest.mark.parametrize("fmt", FIELD_FORMATS)
def test_damaged_archives_with_fields_read_intact_or_fail_by_name(tmp_path, fmt):
    assert field_fuzz(tmp_path, fmt, seed=5, trials=8) == []


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FIELD_FORMATS)
def test_many_damaged_archives_with_fields_read_intact_or_fail_by_name(tmp_path, fmt):
    import random

    seed = int(os.environ.get("PF_FUZZ_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"fields fuzz seed {seed} (replay with PF_FUZZ_SEED={seed})")
    assert field_fuzz(tmp_path, fmt, seed, trials=40) == [], f"seed {seed}"


def test_a_masks_class_values_survive_as_stored_palette_and_16_bit_alike(tmp_path):
    """A palette PNG's indices and a uint16 mask's values are the mask, never grey levels of a colour conversion."""
    palette = Image.fromarray(np.arange(24 * 32, dtype=np.uint8).reshape(24, 32) % 5, mode="P")
    palette.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 0, 9, 9, 9] + [0] * (768 - 15))
    wide = (np.arange(24 * 32, dtype=np.uint16).reshape(24, 32) * 97) % 60000
    path = tmp_path / "a.zip"
    with pf.open_writer(path, format="zip", mode="raw", shape=SHAPE, classes=["a"],
                        fields=["voc=image", "wide=image", "given=image"]) as writer:
        as_file = io.BytesIO()
        palette.save(as_file, "PNG")
        writer.add(image_of(0), 0, fields={"voc": palette, "wide": wide, "given": as_file.getvalue()})
        with pytest.raises(pf.InvalidSampleError, match="an image field takes 2-D uint8 or uint16"):
            writer.add(image_of(1), 0, fields={"voc": palette, "wide": wide.astype(np.float32), "given": b""})
    dataset = pf.PackedDataset(path, output="tensor", fields={"voc": "mask", "wide": "mask", "given": "mask"})
    sample = dataset[0]
    assert np.array_equal(sample["voc"].numpy(), np.asarray(palette)) and sample["voc"].max() == 4
    assert np.array_equal(sample["given"].numpy(), np.asarray(palette))
    assert sample["wide"].dtype == torch.uint16 and np.array_equal(sample["wide"].numpy(), wide)


@pytest.mark.parametrize("text", ["1e999", "[1, -1e400]", '{"a": 1E999}'])
def test_json_with_a_number_out_of_range_is_refused_not_read_as_infinity(text):
    spec = FieldSpec("meta", "json")
    with pytest.raises(FieldValueError, match="not finite"):
        spec.decode(text.encode())
    with pytest.raises(FieldValueError, match="not finite"):
        spec.from_file(text.encode())

"""Converting datasets from the containers they come in, without extracting them: every source kind.

Each kind is built here from the generated image folder and must convert to
what converting the extracted folder gives: the same keys, labels, classes
and stored bytes (pixels), whatever the number of workers.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import pickle
import random
import re
import shutil
import tarfile
import warnings
import zipfile
from typing import Any, Callable, Dict, List, Optional

import h5py
import lmdb
import numpy as np
import pytest

import packed_formats as pf
from packed_formats import cli, codecs, sources
from packed_formats.sources import (
    Sample,
    Source,
    SourceWarning,
    UnpicklingWarning,
    detect_source,
    open_source,
    source_formats,
    tarfiles,
)
from packed_formats.sources.voc import VOC_CLASSES
from packed_formats.writing.convert import convert

from .conftest import CLASSES, PER_CLASS, RAW_SHAPE

N = len(CLASSES) * PER_CLASS
SIZE = RAW_SHAPE[:2]


# ---- helpers ---------------------------------------------------------------------------------------
def folder_samples(image_folder):
    """(key, label, bytes) of every image of the folder, in its order."""
    with pf.open_archive(image_folder) as reader:
        return [(reader.key(i), int(reader.labels[i]), reader.read_bytes(i)) for i in range(len(reader))]


def contents(path):
    """(keys, labels, classes, stored samples) of an archive."""
    with pf.open_archive(path) as reader:
        return (
            [reader.key(i) for i in range(len(reader))],
            [int(x) for x in reader.labels],
            list(reader.classes),
            [reader.read(i) for i in range(len(reader))],
        )


def same_samples(a: List[Any], b: List[Any]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b)
    )


def write_tar(path, members, mode="w"):
    """A tar of (name, bytes) members, in the order given."""
    with tarfile.open(path, mode) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def tar_bytes(members) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def write_zip(path, members, compression=zipfile.ZIP_DEFLATED):
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        for name, data in members:
            archive.writestr(name, data)
    return str(path)


def shuffled(items, seed=0):
    items = list(items)
    random.Random(seed).shuffle(items)
    return items


def tree_members(samples, prefix="dataset/"):
    """The folder's files as container members below ``prefix``, in shuffled order (the output must be sorted)."""
    return shuffled((prefix + key, data) for key, _, data in samples)


def temp_files(directory):
    return [name for name in os.listdir(directory) if ".pf-tmp-" in name]


# ---- one case per source kind ----------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    """A source built from the image folder, and what converting it must give.

    like_folder: the output archive is byte-identical to converting the folder.
    Otherwise its keys and classes are ``keys``/``classes``, its labels the
    folder's, and its samples ``samples`` (default: the folder's bytes).
    """

    kind: str
    src: Any
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    like_folder: bool = True
    keys: Optional[List[str]] = None
    classes: Optional[List[str]] = None
    samples: Optional[List[Any]] = None
    mode: str = "encoded"  # converted in this mode (raw: at the source's own size)
    labels: Optional[List[int]] = None  # default: the folder's (a detection layout's are all 0)


def case_folder(tmp, folder, samples, archives):
    return Case("folder", folder)


def case_packed(tmp, folder, samples, archives):
    return Case("packed", archives[("zip", "encoded")])


def case_flat_folder(tmp, folder, samples, archives):
    root = tmp / "flat"
    root.mkdir()
    names = []
    for i, (_, _, data) in enumerate(samples):
        names.append(f"img_{i:03d}.jpg")
        (root / names[-1]).write_bytes(data)
    (tmp / "labels.txt").write_text("".join(f"{label}\n" for _, label, _ in samples))
    return Case("flat-folder", str(root), {"labels": str(tmp / "labels.txt")}, False, names, ["0", "1", "2"])


def case_zip(tmp, folder, samples, archives):
    return Case("zip", write_zip(tmp / "data.zip", tree_members(samples)))


def case_zip_stored(tmp, folder, samples, archives):
    return Case("zip", write_zip(tmp / "data.zip", tree_members(samples, "a/b/"), zipfile.ZIP_STORED))


def case_tar(tmp, folder, samples, archives):
    return Case("tar", write_tar(tmp / "data.tar", tree_members(samples)))


def case_tar_gz(tmp, folder, samples, archives):
    return Case("tar", write_tar(tmp / "data.tgz", tree_members(samples, "./dataset/"), "w:gz"))


def case_tar_bz2(tmp, folder, samples, archives):
    return Case("tar", write_tar(tmp / "data.tar.bz2", tree_members(samples, ""), "w:bz2"))


def case_tar_xz(tmp, folder, samples, archives):
    return Case("tar", write_tar(tmp / "data.tar.xz", tree_members(samples), "w:xz"))


def nested_members(samples):
    outer = []
    for c, name in enumerate(CLASSES):
        inner = [(key.split("/", 1)[1], data) for key, label, data in samples if label == c]
        outer.append((f"{name}.tar", tar_bytes(shuffled(inner))))
    return shuffled(outer)


def case_nested_tar(tmp, folder, samples, archives):
    return Case("nested-tar", write_tar(tmp / "train.tar", nested_members(samples)))


def case_nested_tar_gz(tmp, folder, samples, archives):
    return Case("nested-tar", write_tar(tmp / "train.tar.gz", nested_members(samples), "w:gz"))


def webdataset_shards(tmp, samples, shards=2, mode="w", ext="tar"):
    per = -(-len(samples) // shards)
    paths = []
    for s in range(shards):
        members = []
        for i, (_, label, data) in enumerate(samples[s * per:(s + 1) * per], s * per):
            members += [(f"{i:06d}.jpg", data), (f"{i:06d}.cls", f"{label}\n".encode()), (f"{i:06d}.json", b"{}")]
        paths.append(write_tar(tmp / f"shard-{s}.{ext}", members, mode))
    return paths, [f"{i:06d}.jpg" for i in range(len(samples))]


def case_webdataset(tmp, folder, samples, archives):
    _, keys = webdataset_shards(tmp, samples)
    return Case("webdataset", str(tmp / "shard-{0..1}.tar"), {}, False, keys, ["0", "1", "2"])


def case_webdataset_gz_list(tmp, folder, samples, archives):
    paths, keys = webdataset_shards(tmp, samples, 3, "w:gz", "tar.gz")
    return Case("webdataset", paths, {}, False, keys, ["0", "1", "2"])


def case_hdf5_raw(tmp, folder, samples, archives):
    pixels = np.stack([np.asarray(codecs.open_image(d).convert("RGB").resize(SIZE[::-1])) for _, _, d in samples])
    path = tmp / "data.h5"
    with h5py.File(path, "w") as file:
        file.create_dataset("images", data=pixels, chunks=(5,) + RAW_SHAPE, compression="gzip")
        file.create_dataset("labels", data=np.array([label for _, label, _ in samples], dtype=np.int32))
        file.attrs["classes"] = list(CLASSES)
    keys = [f"{i:08d}" for i in range(len(samples))]
    return Case("hdf5", str(path), {}, False, keys, list(CLASSES), list(pixels), "raw")


def case_hdf5_encoded(tmp, folder, samples, archives):
    path = tmp / "data.h5"
    with h5py.File(path, "w") as file:
        group = file.create_group("train")
        images = group.create_dataset("jpegs", (len(samples),), dtype=h5py.vlen_dtype(np.uint8))
        for i, (_, _, data) in enumerate(samples):
            images[i] = np.frombuffer(data, np.uint8)
        group.create_dataset("targets", data=np.array([label for _, label, _ in samples]))
    keys = [f"{i:08d}" for i in range(len(samples))]
    options = {"subdir": "train", "image_key": "jpegs", "label_key": "targets"}
    return Case("hdf5", str(path), options, False, keys, ["0", "1", "2"])


def case_lmdb_pickle(tmp, folder, samples, archives):  # the UnpicklingWarning is tested below
    path = tmp / "data.lmdb"
    env = lmdb.open(str(path), subdir=False, map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i, (_, label, data) in enumerate(samples):
            txn.put(b"%08d" % i, pickle.dumps((data, label)))
        txn.put(b"__len__", pickle.dumps(len(samples)))
    env.close()
    keys = [f"{i:08d}" for i in range(len(samples))]
    return Case("lmdb-pickle", str(path), {"allow_pickle": True}, False, keys, ["0", "1", "2"])


def copied_folder(tmp, folder):
    root = tmp / "copy"
    shutil.copytree(folder, root)
    return root


def case_list_csv(tmp, folder, samples, archives):
    root = copied_folder(tmp, folder)
    rows = "".join(f"{key},{CLASSES[label]}\n" for key, label, _ in samples)
    (root / "list.csv").write_text("path,label\n" + rows)
    return Case("list", str(root / "list.csv"))


def case_list_json(tmp, folder, samples, archives):
    root = copied_folder(tmp, folder)
    (root / "list.json").write_text(json.dumps([{"path": k, "label": CLASSES[label]} for k, label, _ in samples]))
    return Case("list", str(root / "list.json"))


def stylegan_members(samples):
    """The stylegan2-ada dataset_tool layout: 00000/img00000000.jpg ... + dataset.json."""
    names = [f"{i // 10:05d}/img{i:08d}.jpg" for i in range(len(samples))]
    labels = {"labels": [[name, label] for name, (_, label, _) in zip(names, samples)]}
    members = [(name, data) for name, (_, _, data) in zip(names, samples)]
    return shuffled(members + [("dataset.json", json.dumps(labels).encode())]), names


def case_dataset_json_zip(tmp, folder, samples, archives):
    members, names = stylegan_members(samples)
    return Case("zip", write_zip(tmp / "ffhq.zip", members), {}, False, names, ["0", "1", "2"])


def case_dataset_json_tar(tmp, folder, samples, archives):
    members, names = stylegan_members(samples)
    return Case("tar", write_tar(tmp / "ffhq.tar", [("ffhq/" + n, d) for n, d in members]), {}, False, names,
                ["0", "1", "2"])


def case_dataset_json_folder(tmp, folder, samples, archives):
    members, names = stylegan_members(samples)
    root = tmp / "ffhq"
    for name, data in members:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return Case("folder", str(root), {}, False, names, ["0", "1", "2"])


def case_parquet(tmp, folder, samples, archives):  # Hugging Face Hub shards (more in test_hub_sources)
    from .test_hub_sources import sample_rows, write_hub

    write_hub(tmp / "hub", sample_rows(folder))
    return Case("parquet", str(tmp / "hub"), {}, False, [f"{i:08d}" for i in range(len(samples))], list(CLASSES))


def case_arrow(tmp, folder, samples, archives):  # a save_to_disk folder
    from .test_hub_sources import sample_rows, write_saved

    write_saved(tmp / "saved", sample_rows(folder))
    return Case("arrow", str(tmp / "saved"), {}, False, [f"{i:08d}" for i in range(len(samples))], list(CLASSES))


def image_sizes(samples) -> List[Any]:
    from PIL import Image

    return [Image.open(io.BytesIO(data)).size for _, _, data in samples]


def case_coco(tmp, folder, samples, archives):  # annotations/instances_<split>.json and its image folder; masks
    # only, so that a resize needs no --boxes (the fields are tests/test_coco_source.py's)
    images = [{"id": 10 + i, "file_name": key, "width": w, "height": h}
              for i, ((key, _, _), (w, h)) in enumerate(zip(samples, image_sizes(samples)))]
    annotations = [{"id": i, "image_id": 10 + i, "category_id": 3, "bbox": [0, 0, 2, 2], "area": 4,
                    "segmentation": [[0, 0, 2, 0, 2, 2]]} for i in range(len(samples))]
    (tmp / "coco" / "annotations").mkdir(parents=True)
    (tmp / "coco" / "annotations" / "instances_val.json").write_text(json.dumps(
        {"images": images, "annotations": annotations, "categories": [{"id": 3, "name": "thing"}]}))
    for key, _, data in samples:
        (tmp / "coco" / "val" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "coco" / "val" / key).write_bytes(data)
    return Case("coco", str(tmp / "coco"), {"fields": ["masks=image"]}, False, [k for k, _, _ in samples],
                ["__background__", "thing"], labels=[0] * len(samples))


def case_voc(tmp, folder, samples, archives):  # VOCdevkit/VOC2012: JPEGImages, Annotations
    from .test_voc_source import xml

    root = tmp / "VOCdevkit" / "VOC2012"
    (root / "JPEGImages").mkdir(parents=True)
    (root / "Annotations").mkdir()
    stems = [f"{i:04d}_" + key.rsplit(".", 1)[0].replace("/", "_") for i, (key, _, _) in enumerate(samples)]
    for stem, (_, _, data), (w, h) in zip(stems, samples, image_sizes(samples)):
        (root / "JPEGImages" / f"{stem}.jpg").write_bytes(data)
        (root / "Annotations" / f"{stem}.xml").write_text(xml(w, h, objects=(("cat", (1, 1, 2, 2), 0),)))
    return Case("voc", str(tmp), {"fields": ["none"]}, False, [stem + ".jpg" for stem in stems], list(VOC_CLASSES),
                labels=[0] * len(samples))  # stems sorted in the folder's order


CASES: Dict[str, Callable[..., Case]] = {
    name[len("case_"):].replace("_", "-"): function for name, function in dict(globals()).items()
    if name.startswith("case_")
}


@pytest.fixture
def build(tmp_path, image_folder, archives):
    samples = folder_samples(image_folder)

    def make(name: str) -> Case:
        directory = tmp_path / f"source-{name}"
        directory.mkdir()
        return CASES[name](directory, image_folder, samples, archives)

    return make


def test_every_source_kind_has_a_case(build):
    assert set(source_formats()) <= {build(name).kind for name in CASES}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_kind_converts_as_its_extracted_folder(tmp_path, image_folder, build, name):
    case = build(name)
    assert detect_source(case.src, **case.options) == case.kind
    out = tmp_path / "out.zip"
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceWarning)  # three classes, all used: nothing to warn of
        warnings.simplefilter("ignore", UnpicklingWarning)
        summary = convert(case.src, out, mode=case.mode, workers=2, quiet=True, **case.options)
    assert summary.samples == N and summary.failed == []
    if case.like_folder:
        convert(image_folder, tmp_path / "folder.zip", workers=1, quiet=True)
        assert out.read_bytes() == (tmp_path / "folder.zip").read_bytes()
        return
    keys, labels, classes, stored = contents(out)
    samples = folder_samples(image_folder)
    assert keys == case.keys
    assert labels == (case.labels if case.labels is not None else [label for _, label, _ in samples])
    assert classes == case.classes
    assert same_samples(stored, case.samples or [data for _, _, data in samples])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::packed_formats.sources.UnpicklingWarning")
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_kind_converts_to_the_same_pixels_as_its_extracted_folder(tmp_path, image_folder, build, name):
    case = build(name)
    convert(case.src, tmp_path / "out.memmap", mode="raw", size=SIZE, workers=2, quiet=True, **case.options)
    convert(image_folder, tmp_path / "folder.memmap", mode="raw", size=SIZE, workers=1, quiet=True)
    _, labels, _, pixels = contents(tmp_path / "out.memmap")
    _, folder_labels, _, folder_pixels = contents(tmp_path / "folder.memmap")
    assert labels == (case.labels if case.labels is not None else folder_labels)
    assert same_samples(pixels, case.samples or folder_pixels)


# ---- tars ------------------------------------------------------------------------------------------
def test_a_shuffled_compressed_tar_is_read_in_sorted_order_within_a_small_buffer(
    tmp_path, image_folder, monkeypatch
):
    samples = folder_samples(image_folder)
    src = write_tar(tmp_path / "data.tar.gz", tree_members(samples), "w:gz")
    budget = 3 * max(len(data) for _, _, data in samples)
    monkeypatch.setattr(tarfiles, "REORDER_BUFFER_BYTES", budget)
    with open_source(src) as source:
        passes = source.samples.passes()
        assert 1 < passes < N and f"read in {passes} passes" in source.notes()[0]
        held = []
        original = tarfiles._ReorderBuffer.take

        def take(self, r, data):
            held.append(self.bytes)
            return original(self, r, data)

        monkeypatch.setattr(tarfiles._ReorderBuffer, "take", take)
        assert [sample.data for sample in source] == [data for _, _, data in samples]
        assert max(held) <= budget
    convert(src, tmp_path / "out.zip", workers=2, quiet=True)
    convert(image_folder, tmp_path / "folder.zip", workers=1, quiet=True)
    assert (tmp_path / "out.zip").read_bytes() == (tmp_path / "folder.zip").read_bytes()


def test_a_sorted_compressed_tar_is_read_in_one_pass(tmp_path, image_folder, monkeypatch):
    samples = folder_samples(image_folder)
    src = write_tar(tmp_path / "data.tar.gz", [("d/" + k, data) for k, _, data in samples], "w:gz")
    monkeypatch.setattr(tarfiles, "REORDER_BUFFER_BYTES", 1)  # nothing fits: it must not need to
    with open_source(src) as source:
        assert source.samples.passes() == 1
        assert [sample.data for sample in source] == [data for _, _, data in samples]


def test_the_container_is_found_from_its_content_not_its_name(tmp_path, image_folder):
    samples = folder_samples(image_folder)
    src = write_tar(tmp_path / "data.bin", tree_members(samples), "w:xz")
    assert detect_source(src) == "tar"
    convert(src, tmp_path / "out.zip", workers=1, quiet=True)
    assert contents(tmp_path / "out.zip")[0] == [k for k, _, _ in samples]


def test_subdir_picks_one_split_and_splits_as_classes_warn(tmp_path, image_folder):
    samples = folder_samples(image_folder)
    members = [("data/train/" + k, d) for k, _, d in samples] + [("data/val/" + k, d) for k, _, d in samples[:3]]
    src = write_zip(tmp_path / "splits.zip", members)
    with pytest.warns(SourceWarning, match="look like dataset splits.*--subdir"):
        open_source(src).close()
    convert(src, tmp_path / "train.zip", subdir="train", workers=2, quiet=True)
    convert(image_folder, tmp_path / "folder.zip", workers=1, quiet=True)
    assert (tmp_path / "train.zip").read_bytes() == (tmp_path / "folder.zip").read_bytes()
    with pytest.raises(pf.InvalidSourceError, match="no folder 'test'.*train, val"):
        open_source(src, subdir="test")


def test_non_image_members_are_skipped_and_counted_like_a_folders_files(tmp_path, image_folder):
    samples = folder_samples(image_folder)
    members = tree_members(samples) + [("dataset/boxes/notes.txt", b"hi"), ("dataset/README", b"x")]
    summary = convert(write_tar(tmp_path / "d.tar", members), tmp_path / "out.zip", workers=1, quiet=True)
    assert summary.samples == N and summary.skipped == 1  # like a folder: files beside the classes are not counted


def test_a_corrupt_member_is_named_and_follows_on_error(tmp_path, image_folder):
    samples = folder_samples(image_folder)
    broken = samples[0][2][: len(samples[0][2]) // 2]
    src = write_tar(tmp_path / "d.tar.gz", tree_members(samples) + [("dataset/boxes/broken.jpg", broken)], "w:gz")
    with pytest.raises(pf.CorruptSampleError) as error:
        convert(src, tmp_path / "out.zip", workers=2, quiet=True)
    assert error.value.path == f"{src}:dataset/boxes/broken.jpg" and error.value.key == "boxes/broken.jpg"
    assert os.listdir(tmp_path) == ["d.tar.gz"]
    summary = convert(src, tmp_path / "out.zip", workers=2, on_error="skip", quiet=True)
    assert summary.samples == N and "broken.jpg" in summary.failed[0]


@pytest.mark.parametrize("kind", ["tar", "tar.gz", "nested-tar"])
def test_a_truncated_tar_fails_naming_it_and_a_member_and_writes_nothing(tmp_path, image_folder, kind):
    samples = folder_samples(image_folder)
    if kind == "nested-tar":
        src = write_tar(tmp_path / "full.tar", nested_members(samples))
    else:
        src = write_tar(tmp_path / f"full.{kind}", tree_members(samples), "w:gz" if kind == "tar.gz" else "w")
    data = open(src, "rb").read()
    cut = tmp_path / f"cut.{kind}"
    cut.write_bytes(data[: len(data) * 2 // 3])
    dst = tmp_path / "out.zip"
    with pytest.raises(pf.CorruptArchiveError, match=r"truncated or damaged at member '[^']+'") as error:
        convert(cut, dst, workers=2, quiet=True)
    assert error.value.path == str(cut)
    assert not dst.exists() and temp_files(tmp_path) == []


def test_an_uncompressed_tar_cut_between_members_is_truncated_too(tmp_path, image_folder):
    members = tree_members(folder_samples(image_folder))
    whole = tar_bytes(members)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole[: _end_of_members(whole, 5)])
    with pytest.raises(pf.CorruptArchiveError, match="no end-of-archive block"):
        open_source(cut)


def _end_of_members(data: bytes, count: int) -> int:
    """The byte where the data of the first ``count`` members of a tar ends (padded to blocks)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = tar.getmembers()[count - 1]
    return member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


@pytest.mark.parametrize("name", ["../evil.jpg", "/etc/evil.jpg", "dataset/boxes/../../../evil.jpg"])
@pytest.mark.parametrize("container", ["tar", "zip"])
def test_a_member_with_a_path_traversal_name_is_refused(tmp_path, image_folder, name, container):
    samples = folder_samples(image_folder)
    members = tree_members(samples) + [(name, samples[0][2])]
    src = (write_tar if container == "tar" else write_zip)(tmp_path / f"evil.{container}", members)
    dst = tmp_path / "out.zip"
    with pytest.raises(pf.InvalidSourceError, match="unsafe path") as error:
        convert(src, dst, workers=1, quiet=True)
    assert repr(name) in str(error.value) and str(src) in str(error.value)
    assert not dst.exists()
    summary = convert(src, dst, workers=1, on_error="skip", quiet=True)
    assert summary.samples == N and len(summary.failed) == 1 and repr(name) in summary.failed[0]
    assert all(".." not in key and not key.startswith("/") for key in contents(dst)[0])


def test_links_inside_a_tar_read_their_targets(tmp_path, image_folder):
    samples = folder_samples(image_folder)
    src = tmp_path / "links.tar"
    with tarfile.open(src, "w") as tar:
        for name, data in [("d/" + k, data) for k, _, data in samples]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for kind, target in [(tarfile.SYMTYPE, "../boxes/" + samples[0][0].split("/")[1]),
                             (tarfile.LNKTYPE, "d/" + samples[1][0])]:
            info = tarfile.TarInfo(f"d/zlinks/{'sym' if kind == tarfile.SYMTYPE else 'hard'}.jpg")
            info.type, info.linkname = kind, target
            tar.addfile(info)
        gone = tarfile.TarInfo("d/zlinks/dangling.jpg")
        gone.type, gone.linkname = tarfile.SYMTYPE, "nowhere.jpg"
        tar.addfile(gone)
    compressed = tmp_path / "links.tar.gz"
    compressed.write_bytes(gzip.compress(src.read_bytes()))
    for path in (src, compressed):
        with pytest.warns(sources.SourceMemberWarning, match="'d/zlinks/dangling.jpg' .a link to 'nowhere.jpg'"):
            source = open_source(path)
        with source:
            by_key = {source.key(i): sample.data for i, sample in enumerate(source)}
        assert by_key["zlinks/sym.jpg"] == samples[0][2] and by_key["zlinks/hard.jpg"] == samples[1][2]
        assert "zlinks/dangling.jpg" not in by_key


# ---- ZIP -------------------------------------------------------------------------------------------
def test_a_truncated_zip_fails_naming_a_member_and_writes_nothing(tmp_path, image_folder):
    src = write_zip(tmp_path / "full.zip", tree_members(folder_samples(image_folder)))
    data = open(src, "rb").read()
    cut = tmp_path / "cut.zip"
    cut.write_bytes(data[: len(data) // 2])
    dst = tmp_path / "out.zip"
    with pytest.raises(pf.CorruptArchiveError, match=r"not a complete ZIP file.*member 'dataset/") as error:
        convert(cut, dst, workers=1, quiet=True)
    assert error.value.path == str(cut)
    assert not dst.exists() and temp_files(tmp_path) == []


def test_a_zip_member_failing_its_crc_is_a_corrupt_sample(tmp_path, image_folder):
    samples = folder_samples(image_folder)
    src = write_zip(tmp_path / "d.zip", [("d/" + k, data) for k, _, data in samples], zipfile.ZIP_STORED)
    raw = bytearray(open(src, "rb").read())
    with zipfile.ZipFile(src) as archive:
        info = archive.getinfo("d/" + samples[4][0])
    raw[info.header_offset + 30 + len(info.filename) + 100] ^= 0xFF
    open(src, "wb").write(bytes(raw))
    with pytest.raises(pf.CorruptSampleError, match="CRC32") as error:
        convert(src, tmp_path / "out.zip", workers=2, quiet=True)
    assert error.value.path == f"{src}:d/{samples[4][0]}"
    assert convert(src, tmp_path / "out.zip", workers=2, on_error="skip", quiet=True).samples == N - 1


# ---- webdataset -----------------------------------------------------------------------------------
def test_a_webdataset_sample_without_its_label_is_named_or_skipped(tmp_path, image_folder):
    samples = folder_samples(image_folder)
    members = []
    for i, (_, label, data) in enumerate(samples):
        members.append((f"s/{i:04d}.jpg", data))
        if i != 7:
            members.append((f"s/{i:04d}.cls", str(label).encode()))
    src = write_tar(tmp_path / "shard-000.tar", members)
    dst = tmp_path / "out.zip"
    with pytest.raises(pf.InvalidSourceError, match=r"sample 's/0007' has no .cls label member") as error:
        convert(src, dst, workers=1, quiet=True)
    assert error.value.path == src and error.value.key == "s/0007" and not dst.exists()
    summary = convert(src, dst, workers=1, on_error="skip", quiet=True)
    assert summary.samples == N - 1 and "s/0007" in summary.failed[0]
    assert "s/0007.jpg" not in contents(dst)[0]


def test_webdataset_label_and_image_keys_are_chosen(tmp_path, image_folder):
    samples = folder_samples(image_folder)[::4]
    members = []
    for i, (_, label, data) in enumerate(samples):
        members += [(f"{i}.seg.png", b"not this"), (f"{i}.JPEG", data), (f"{i}.target.txt", CLASSES[label].encode())]
    src = write_tar(tmp_path / "one.tar", members)
    with open_source(src, source_format="webdataset", label_key="target.txt", image_key="jpeg") as source:
        assert [s.data for s in source] == [d for _, _, d in samples]
        assert [source.classes[c] for c in source.labels] == [CLASSES[label] for _, label, _ in samples]


def test_shards_are_given_as_a_pattern_or_several_paths_on_the_command_line(tmp_path, image_folder, capsys):
    paths, keys = webdataset_shards(tmp_path, folder_samples(image_folder), shards=3)
    assert cli.main(["convert", str(tmp_path / "shard-{0..2}.tar"), str(tmp_path / "a.zip"), "--quiet"]) == 0
    assert cli.main(["convert", *paths, str(tmp_path / "b.zip"), "--quiet"]) == 0
    assert (tmp_path / "a.zip").read_bytes() == (tmp_path / "b.zip").read_bytes()
    assert contents(tmp_path / "a.zip")[0] == keys
    assert cli.main(["convert", str(tmp_path / "shard-{0..3}.tar"), str(tmp_path / "c.zip"), "--quiet"]) == 2
    assert "shard-3.tar: no such shard" in capsys.readouterr().err


# ---- labels: dataset.json, one class, pickles ------------------------------------------------------
def test_a_stylegan_folder_without_dataset_json_warns_of_its_one_class(tmp_path, image_folder):
    members, _ = stylegan_members(folder_samples(image_folder)[:8])
    root = tmp_path / "gan"
    for name, data in members:
        if name != "dataset.json":
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(data)
    with pytest.warns(SourceWarning, match=r"1 class found \('00000'\): did you mean --subdir, or a dataset.json"):
        convert(root, tmp_path / "out.zip", workers=1, quiet=True)


def test_null_dataset_json_labels_are_all_zero_with_a_warning(tmp_path, image_folder):
    members, names = stylegan_members(folder_samples(image_folder)[:12])
    members = [(n, json.dumps({"labels": None}).encode() if n == "dataset.json" else d) for n, d in members]
    src = write_zip(tmp_path / "uncond.zip", members)
    with pytest.warns(SourceWarning, match="1 class"):
        convert(src, tmp_path / "out.zip", workers=1, quiet=True)
    keys, labels, classes, _ = contents(tmp_path / "out.zip")
    assert keys == names and set(labels) == {0} and classes == ["0"]


def test_a_dataset_json_missing_a_label_is_refused(tmp_path, image_folder):
    members, names = stylegan_members(folder_samples(image_folder)[:5])
    table = {"labels": [[n, 0] for n in names[1:]]}
    members = [(n, json.dumps(table).encode() if n == "dataset.json" else d) for n, d in members]
    with pytest.raises(pf.InvalidSourceError, match=f"dataset.json: has no label for 1 images, e.g. '{names[0]}'"):
        open_source(write_tar(tmp_path / "d.tar", members))


def test_one_class_warns_on_the_command_line_in_one_line(tmp_path, image_folder, capsys):
    samples = [s for s in folder_samples(image_folder) if s[1] == 0]
    src = write_zip(tmp_path / "boxes.zip", [("boxes/" + k.split("/")[1], d) for k, _, d in samples])
    assert cli.main(["convert", src, str(tmp_path / "out.zip"), "--quiet", "--workers", "1"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"packed-formats convert: warning: {src}: 1 class found ('boxes'): "
        "did you mean --subdir, or a dataset.json with the labels?"
    ]


def test_a_pickled_lmdb_is_refused_without_allow_pickle(tmp_path, image_folder, build, capsys):
    case = build("lmdb-pickle")
    dst = tmp_path / "out.zip"
    with pytest.raises(pf.InvalidSourceError, match="pickled Python objects.*unpickling runs code.*allow_pickle"):
        convert(case.src, dst, workers=1, quiet=True)
    assert not dst.exists()
    assert cli.main(["convert", case.src, str(dst), "--quiet"]) == 2
    assert "--allow-pickle" in capsys.readouterr().err and not dst.exists()
    with pytest.warns(UnpicklingWarning, match="unpickling its records runs code from the file"):
        convert(case.src, dst, allow_pickle=True, workers=1, quiet=True)
    assert cli.main(["convert", case.src, str(tmp_path / "b.zip"), "--allow-pickle", "--quiet"]) == 0
    assert "warning:" in capsys.readouterr().err


def test_an_hdf5_without_the_named_datasets_says_which_it_has(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as file:
        file.create_dataset("x_train", data=np.zeros((2, 4, 4, 3), np.uint8))
        file.create_dataset("y_train", data=np.zeros(2, np.int64))
    with pytest.raises(pf.InvalidSourceError, match=r"no dataset 'images' \(it has: x_train, y_train\)"):
        open_source(path)
    with pytest.warns(SourceWarning, match="1 class found"):
        source = open_source(path, image_key="x_train", label_key="y_train")
    assert len(source) == 2 and source.raw_shape == (4, 4, 3)


@pytest.mark.parametrize("layout", ["NHW", "NCHW"])
def test_hdf5_greyscale_and_channels_first_pixels_convert_to_hwc(tmp_path, layout):
    pixels = np.random.default_rng(1).integers(0, 256, (4, 6, 5, 3), dtype=np.uint8)
    stored = pixels[..., 0] if layout == "NHW" else pixels.transpose(0, 3, 1, 2)
    expected = np.repeat(pixels[..., :1], 3, axis=3) if layout == "NHW" else pixels
    with h5py.File(tmp_path / "d.h5", "w") as file:
        file["images"], file["labels"] = stored, np.array([0, 1, 0, 1])
    convert(tmp_path / "d.h5", tmp_path / "out.memmap", mode="raw", workers=1, quiet=True)
    assert same_samples(contents(tmp_path / "out.memmap")[3], list(expected))


def test_existing_sources_are_detected_as_before(image_folder, archives):
    assert detect_source(image_folder) == "folder"
    for (fmt, mode), path in archives.items():
        assert detect_source(path) == ("folder" if fmt == "folder" else "packed"), (fmt, mode)


def test_a_file_that_is_no_dataset_is_refused_naming_the_kinds(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("just some notes\n")
    with pytest.raises(pf.UnknownFormatError, match="not a dataset this library reads.*--source-format"):
        open_source(path)
    with pytest.raises(pf.UnknownFormatError, match="is not a zip source"):
        open_source(path, source_format="zip")
    documents = write_zip(tmp_path / "docs.zip", [("docs/a/readme.txt", b"hello")])
    with pytest.raises(pf.InvalidSourceError, match=r"docs.zip: no images found \(zip: ImageFolder tree"):
        convert(documents, tmp_path / "out.zip", quiet=True)
    assert not (tmp_path / "out.zip").exists()


class NpySource(Source):
    """A kind added by a user: pixels in ``x.npy`` (uint8 [N,H,W,3]), labels in ``x.labels.npy``."""

    kind = "npy-pair"
    random_access = False

    @classmethod
    def sniff(cls, path, head):
        return head.startswith(b"\x93NUMPY") and os.path.exists(path[: -len(".npy")] + ".labels.npy")

    @classmethod
    def open(cls, path, options):
        labels = np.load(path[: -len(".npy")] + ".labels.npy")
        source = cls(path, [str(c) for c in range(labels.max() + 1)], [f"{i}" for i in range(len(labels))], labels)
        source.pixels = np.load(path, mmap_mode="r")
        return source

    def __iter__(self):
        for i in range(len(self)):
            yield Sample(self.key(i), int(self.labels[i]), np.array(self.pixels[i]))

    @property
    def raw_shape(self):
        return self.pixels.shape[1:]


def test_a_new_kind_is_one_class_and_one_registration(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "KINDS", list(sources.KINDS))
    sources.register(NpySource)
    pixels = np.random.default_rng(0).integers(0, 256, (6, 8, 10, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", pixels)
    np.save(tmp_path / "x.labels.npy", np.array([0, 1, 2, 0, 1, 2]))
    assert detect_source(tmp_path / "x.npy") == "npy-pair"
    convert(tmp_path / "x.npy", tmp_path / "out.memmap", mode="raw", workers=2, quiet=True)
    assert same_samples(contents(tmp_path / "out.memmap")[3], list(pixels))
    sources.unregister("npy-pair")
    with pytest.raises(pf.UnknownFormatError):
        detect_source(tmp_path / "x.npy")


# ---- info ------------------------------------------------------------------------------------------
def test_info_shows_what_convert_would_make_of_a_container(tmp_path, image_folder, capsys):
    samples = folder_samples(image_folder)
    src = write_tar(tmp_path / "data.tar.gz", tree_members(samples) + [("dataset/boxes/x.txt", b"")], "w:gz")
    assert cli.main(["info", src]) == 0
    out = capsys.readouterr().out
    assert "source      tar: ImageFolder tree under dataset/ (compressed)" in out
    assert f"samples     {N}" in out and "read in 1 pass over the compressed stream" in out
    assert "skipped     1 file (no image of a kind read" in out and "dataset/boxes/x.txt" in out
    assert f"classes     {len(CLASSES)}" in out
    for c, name in enumerate(CLASSES):
        assert re.search(rf"^ +{c} +{name} +{PER_CLASS}$", out, re.MULTILINE), name
    assert cli.main(["info", src, "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["source"] == "tar" and facts["classes"] == {name: PER_CLASS for name in CLASSES}
    assert os.listdir(tmp_path) == ["data.tar.gz"]  # nothing extracted, nothing written


def test_info_of_a_webdataset_and_an_hdf5_with_options(tmp_path, image_folder, build, capsys):
    case = build("hdf5-encoded")
    assert cli.main(["info", case.src, "--subdir", "train", "--image-key", "jpegs", "--label-key", "targets"]) == 0
    out = capsys.readouterr().out
    assert "source      hdf5: HDF5 train/jpegs (encoded) + train/targets" in out and f"samples     {N}" in out
    webdataset_shards(tmp_path, folder_samples(image_folder))
    assert cli.main(["info", str(tmp_path / "shard-{0..1}.tar")]) == 0
    assert "source      webdataset: webdataset, 2 shards" in capsys.readouterr().out


def _tricky_tree(root: str) -> str:
    """Nested directories, non-image files, a name that is not UTF-8, links to directories (one a
    loop, one a second way to a class), and names whose sort differs from their directories' walk."""
    for path in ("b/z/9.png", "b/z/1.jpg", "b/a.b/2.PNG", "b/a/3.jpg", "b/x.jpg", "b/notes.txt", "a/1.jpeg",
                 "a/deep/er/2.webp", "a/deep/er/readme", "c-empty/.keep"):
        os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
        open(os.path.join(root, path), "wb").close()
    open(os.fsencode(os.path.join(root, "a")) + b"/\xff-latin1.jpg", "wb").close()
    os.symlink("..", os.path.join(root, "b", "loop"))
    os.symlink(os.path.join("..", "a"), os.path.join(root, "b", "again"))
    return root


def test_a_folder_is_listed_into_arrays_image_by_image_as_imagefolder_would(tmp_path):
    from packed_formats.backends.folder import SourceLinkWarning, scan_image_folder

    root = _tricky_tree(str(tmp_path / "tree"))
    with pytest.warns(SourceLinkWarning):
        classes, keys, labels, skipped = scan_image_folder(root)
    assert keys.dtype.kind == "S" and labels.dtype == np.int64
    listed = [k.decode("utf-8", "surrogateescape") for k in keys]
    # by class, then directory, then name; the loop and the second way to class a left out
    assert classes == ["a", "b", "c-empty"] and skipped == 3  # notes.txt, readme, .keep
    assert listed == ["a/1.jpeg", "a/\udcff-latin1.jpg", "a/deep/er/2.webp",
                      "b/x.jpg", "b/a/3.jpg", "b/a.b/2.PNG", "b/z/1.jpg", "b/z/9.png"]
    assert labels.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    with pytest.warns(SourceLinkWarning):
        source = open_source(root)
    assert [source.key(i) for i in range(len(source))] == listed and source.skipped == 3


LISTED_FILES = 40_000


def test_listing_a_folder_holds_no_python_object_per_file(tmp_path):
    """Listing LISTED_FILES empty files (40 directories) allocates about twice the keys' bytes plus
    one directory's names, not a string (and its bytes) per file: a list of keys took ~8x the keys."""
    import tracemalloc

    root = tmp_path / "many"
    for d in range(40):
        os.makedirs(root / f"class{d:02d}")
        for f in range(LISTED_FILES // 40):
            open(root / f"class{d:02d}" / f"img_{d:02d}_{f:06d}.jpg", "wb").close()
    tracemalloc.start()
    try:
        source = open_source(str(root))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(source) == LISTED_FILES and source.key(LISTED_FILES - 1) == "class39/img_39_000999.jpg"
    keys_bytes = source.keys.nbytes
    assert peak < 3 * keys_bytes + (512 << 10), f"listing took {peak >> 10} KiB for {keys_bytes >> 10} KiB of keys"

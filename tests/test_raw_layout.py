"""Raw archives whose pixels are stored planar (``raw_layout="chw"``) read as interleaved ones do.

Every format, a set of parts, a Mixture and a remote set: the same images from ``read``,
``read_many``, ``PackedDataset`` and ``make_loader`` (NCHW and channels_last, with and without
workers) as from the same samples stored "hwc"; the manifest says which layout the bytes have,
and a manifest that does not, or names one this library does not know, is refused by name.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import zlib

import numpy as np
import pytest
import torch

import packed_formats as pf
from packed_formats import cli
from packed_formats import transforms as T
from packed_formats.backends import memmap
from packed_formats.backends.sharded import ShardedWriter
from packed_formats.bench import BenchConfig, format_table, run_benchmark
from packed_formats.loading.sampling import BatchPlan
from packed_formats.loading.worker import BatchReader
from packed_formats.manifest import FIELDS_VERSION, LAYOUT_VERSION, PLAIN_VERSION, canonical_json
from packed_formats.synthetic import make_image_folder

from .conftest import CLASSES, RAW_SHAPE, expected_samples
from .test_bad_input import copy_archive, flip_byte_inside_sample

FORMATS = list(pf.PACKED_FORMATS)
EXT = {"zip": ".zip", "hdf5": ".h5", "lmdb": ".lmdb", "memmap": ".memmap"}
LAYOUTS = ("hwc", "chw")


def write(path, fmt: str, layout: str, samples, **options) -> str:
    with pf.open_writer(path, format=fmt, mode="raw", shape=RAW_SHAPE, classes=CLASSES, raw_layout=layout,
                        **options) as writer:
        for pixels, label, key in samples:
            writer.add(pixels, label, key)
    return os.fspath(path)


@pytest.fixture(scope="module")
def samples(image_folder):
    return expected_samples(image_folder, "raw")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, samples):
    """{format: {layout: path}}: the same raw samples stored interleaved and planar, in every format."""
    root = tmp_path_factory.mktemp("layouts")
    return {fmt: {layout: write(root / f"{layout}{EXT.get(fmt, '.' + fmt)}", fmt, layout, samples)
                  for layout in LAYOUTS} for fmt in FORMATS}


@pytest.fixture(params=FORMATS)
def pair(request, pairs):
    return pairs[request.param]


def pixels_of(samples) -> np.ndarray:
    return np.stack([pixels for pixels, _, _ in samples])


def test_a_planar_archive_reads_the_images_an_interleaved_one_does(pair, samples):
    expected, idx = pixels_of(samples), [7, 3, 7, 20, 0]
    with pf.open_archive(pair["hwc"]) as hwc, pf.open_archive(pair["chw"]) as chw:
        assert (hwc.manifest.raw_layout, chw.manifest.raw_layout) == LAYOUTS
        assert hwc.manifest.format_version == PLAIN_VERSION and chw.manifest.format_version == LAYOUT_VERSION
        for reader in (hwc, chw):
            for i in range(len(reader)):
                image = reader.read(i)
                assert image.shape == RAW_SHAPE and image.flags.c_contiguous
                np.testing.assert_array_equal(image, expected[i])
            batch = reader.read_many(idx)
            assert batch.shape == (len(idx),) + RAW_SHAPE
            np.testing.assert_array_equal(batch, expected[idx])
            planar = np.empty((len(idx), 3) + RAW_SHAPE[:2], dtype=np.uint8)
            np.testing.assert_array_equal(reader.read_many_planar(idx, planar), expected[idx].transpose(0, 3, 1, 2))
        stored = chw.read_many_stored(idx)  # the bytes as the archive keeps them: planar
        np.testing.assert_array_equal(stored, expected[idx].transpose(0, 3, 1, 2))
        for i in range(len(chw)):  # each CRC32 is over the stored (planar) bytes
            data = chw.read_bytes(i)
            assert data == np.ascontiguousarray(expected[i].transpose(2, 0, 1)).tobytes()
            assert zlib.crc32(data) == int(chw.index.crc32[i])


def test_samples_read_planar_into_rows_of_a_batch_land_in_those_rows_only(pair, samples):
    """``rows=``: a source's samples of a batch that other sources fill the rest of (a Mixture's)."""
    expected, idx, rows = pixels_of(samples), [7, 3, 20], [4, 0, 2]
    for layout in LAYOUTS:
        with pf.open_archive(pair[layout]) as reader:
            batch = np.full((5, 3) + RAW_SHAPE[:2], 99, dtype=np.uint8)
            reader.read_many_planar(idx, batch, rows=np.array(rows))
            np.testing.assert_array_equal(batch[rows], expected[idx].transpose(0, 3, 1, 2))
            assert (batch[[1, 3]] == 99).all()
            with pytest.raises(ValueError, match="rows must give each"):
                reader.read_many_planar(idx, batch, rows=np.array([4, 0, 5]))


def test_a_planar_batch_is_one_batch_read_of_the_stored_bytes(pair):
    """NCHW from a planar archive: the format's one batch read (a gather), never a read and a copy per sample."""
    for layout, expected in (("hwc", {"read": 24}), ("chw", {"read_batch": 1})):
        with pf.open_archive(pair[layout]) as reader:
            calls: collections.Counter = collections.Counter()
            for name in ("read", "read_batch"):
                method = getattr(reader.backend, name)
                setattr(reader.backend, name, lambda *args, _m=method, _n=name, _c=calls: _c.update([_n]) or _m(*args))
            reader.read_many_planar(np.arange(24), np.empty((24, 3) + RAW_SHAPE[:2], dtype=np.uint8))
            assert calls == expected


def test_the_manifest_names_the_layout_only_from_its_version_on(pair):
    with pf.open_archive(pair["hwc"]) as hwc, pf.open_archive(pair["chw"]) as chw:
        assert "raw_layout" not in hwc.manifest.to_json()  # an interleaved archive is what it always was
        assert json.loads(chw.manifest.to_json())["raw_layout"] == "chw"
        assert chw.manifest.stored_shape == (3,) + RAW_SHAPE[:2] and hwc.manifest.stored_shape == RAW_SHAPE


def test_dataset_items_are_the_same_from_either_layout(pair):
    for output in ("tensor", "numpy"):
        hwc, chw = (pf.PackedDataset(pair[layout], output=output) for layout in LAYOUTS)
        for i in (0, 5, 23):
            a, b = hwc[i], chw[i]
            assert a[1] == b[1]
            np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
        for (a, la), (b, lb) in zip(hwc.__getitems__([4, 1, 4]), chw.__getitems__([4, 1, 4])):
            assert la == lb
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def batches(path, memory_format, workers=0, **options):
    loader = pf.make_loader(path, batch_size=5, shuffle=False, num_workers=workers, memory_format=memory_format,
                            **options)
    return [(images.clone(), labels.clone()) for images, labels in loader]


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_loader_batches_are_the_same_from_either_layout(pair, samples, memory_format):
    expected = torch.from_numpy(pixels_of(samples)).permute(0, 3, 1, 2)
    for layout in LAYOUTS:
        got = batches(pair[layout], memory_format)
        images = torch.cat([b[0] for b in got])
        assert all(b[0].is_contiguous(memory_format=memory_format) for b in got)
        assert torch.equal(images, expected)
        assert torch.cat([b[1] for b in got]).tolist() == [label for _, label, _ in samples]


def test_a_transform_sees_the_same_batches_from_either_layout(pairs):
    hwc, chw = (batches(pairs["memmap"][layout], torch.contiguous_format, transform=T.RandomCrop(16), seed=3)
                for layout in LAYOUTS)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(hwc, chw))


@pytest.mark.slow
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_workers_read_a_planar_archive_as_the_main_process_does(pairs, samples, memory_format):
    expected = torch.from_numpy(pixels_of(samples)).permute(0, 3, 1, 2)
    for fmt in ("zip", "lmdb"):
        got = batches(pairs[fmt]["chw"], memory_format, workers=2)
        assert all(b[0].is_contiguous(memory_format=memory_format) for b in got)
        assert torch.equal(torch.cat([b[0] for b in got]), expected)


def test_a_batch_for_another_device_is_read_as_a_plain_copy_of_a_planar_archive(pair, samples):
    """Batches a GPU converts itself (no memory format in the workers) leave a planar archive as contiguous NCHW:
    read as stored, nothing to convert on the device; an interleaved archive's leave as a channels-last view."""
    expected = torch.from_numpy(pixels_of(samples)[[4, 0, 9]]).permute(0, 3, 1, 2)
    for layout, contiguous in (("hwc", False), ("chw", True)):
        with pf.open_archive(pair[layout]) as reader:
            images = BatchReader(reader, memory_format=None)[BatchPlan(0, 0, np.array([4, 0, 9]))][0]
        assert torch.equal(images, expected) and images.is_contiguous() == contiguous


def test_a_damaged_planar_sample_is_named_and_skipped_never_served(pairs, samples, tmp_path):
    path = copy_archive(pairs["zip"]["chw"], tmp_path)
    flip_byte_inside_sample(path, "raw", 6)
    with pf.open_archive(path) as reader:
        with pytest.raises(pf.CorruptSampleError, match="checksum mismatch") as error:
            reader.read_many_planar([5, 6], np.empty((2, 3) + RAW_SHAPE[:2], dtype=np.uint8))
        assert error.value.index == 6
    with pytest.warns(UserWarning):
        got = batches(path, torch.contiguous_format, on_error="skip")
    expected = np.delete(pixels_of(samples), 6, axis=0).transpose(0, 3, 1, 2)
    assert torch.equal(torch.cat([b[0] for b in got]), torch.from_numpy(np.ascontiguousarray(expected)))


# ---- sets of parts, joins and mixtures ------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("layout-src") / "images", 3, sizes=(20, 36))


@pytest.mark.slow
def test_convert_writes_planar_sets_and_the_command_line_asks_for_them(small_folder, tmp_path, capsys):
    hwc = tmp_path / "hwc.zip"
    assert "raw 12x12x3 in" in pf.convert(small_folder, hwc, mode="raw", size=12, shard_size=4, workers=1,
                                          quiet=True).line()
    chw = tmp_path / "chw.zip"
    assert cli.main(["convert", small_folder, str(chw), "--mode", "raw", "--size", "12", "--shard-size", "4",
                        "--raw-layout", "chw", "--workers", "1"]) == 0
    assert "raw 12x12x3, stored planar in 5 parts" in capsys.readouterr().out  # the summary says so
    with pf.open_archive(hwc) as a, pf.open_archive(chw) as b:
        assert b.manifest.raw_layout == "chw" and len(b.backend.parts) == 5  # 18 samples, 4 a part
        assert all(part.manifest.raw_layout == "chw" for part in b.backend.parts)
        everything = np.arange(len(a))
        np.testing.assert_array_equal(a.read_many(everything), b.read_many(everything))
        planar = np.empty((len(a), 3, 12, 12), dtype=np.uint8)
        np.testing.assert_array_equal(b.read_many_planar(everything, planar),
                                      a.read_many(everything).transpose(0, 3, 1, 2))
    with pytest.raises(ValueError, match="raw layout"):
        pf.convert(small_folder, tmp_path / "enc.zip", mode="encoded", raw_layout="chw", workers=1, quiet=True)
    with pytest.raises(ValueError, match="raw layout must be one of"):
        pf.convert(small_folder, tmp_path / "x.zip", mode="raw", size=12, raw_layout="cwh", workers=1, quiet=True)


def test_a_set_whose_parts_differ_in_layout_is_refused_by_name(samples, tmp_path):
    def set_of(layout: str) -> str:
        path = tmp_path / layout / "train.memmap"
        os.makedirs(path.parent)
        with ShardedWriter(path, "memmap", 12, set_id="00ff00ff00ff00ff", mode="raw", shape=RAW_SHAPE,
                           classes=CLASSES, raw_layout=layout) as writer:
            for pixels, label, key in samples:
                writer.add(pixels, label, key)
        return os.fspath(path)

    hwc, chw = set_of("hwc"), set_of("chw")
    part = pf.open_archive(hwc).backend.parts[1].path
    shutil.rmtree(part)
    shutil.copytree(os.path.join(os.path.dirname(chw), os.path.basename(part)), part)
    with pytest.raises(pf.CorruptArchiveError, match=r"differs from the first part.* in raw_layout: 'chw', not 'hwc'"):
        pf.open_archive(hwc)


@pytest.mark.slow
def test_the_parts_of_one_set_are_written_in_one_layout(small_folder, tmp_path):
    dst, options = tmp_path / "train.zip", dict(mode="raw", size=12, shard_size=4, workers=1, quiet=True)
    pf.convert(small_folder, dst, part=(0, 3), raw_layout="chw", **options)
    with pytest.raises(pf.CorruptArchiveError, match="another raw layout: 'chw' .*, this conversion has 'hwc'"):
        pf.convert(small_folder, dst, part=(1, 3), **options)
    for task in (1, 2):  # the last one joins the set
        pf.convert(small_folder, dst, part=(task, 3), raw_layout="chw", **options)
    pf.convert(small_folder, tmp_path / "one.zip", **dict(options, shard_size=None))
    with pf.open_archive(dst) as joined, pf.open_archive(tmp_path / "one.zip") as one:
        assert joined.manifest.raw_layout == "chw" and one.manifest.raw_layout == "hwc"
        everything = np.arange(len(one))
        np.testing.assert_array_equal(joined.read_many(everything), one.read_many(everything))


def test_a_mixture_reads_each_source_in_its_own_layout(pairs, archives, samples):
    expected = pixels_of(samples)
    both = np.concatenate([expected, expected])
    for first, second in ((pairs["zip"]["chw"], pairs["memmap"]["hwc"]), (pairs["zip"]["hwc"], pairs["lmdb"]["chw"])):
        with pf.Mixture({first: 1, second: 1}).open() as reader:
            everything = np.arange(len(reader))
            np.testing.assert_array_equal(np.stack([reader.read(i) for i in everything]), both)
            np.testing.assert_array_equal(reader.read_many(everything[::-1]), both[::-1])
            planar = np.empty((len(reader), 3) + RAW_SHAPE[:2], dtype=np.uint8)
            np.testing.assert_array_equal(reader.read_many_planar(everything, planar), both.transpose(0, 3, 1, 2))
        loader = pf.make_loader(pf.Mixture({first: 1, second: 1}), batch_size=8, num_workers=0, return_index=True)
        for images, _, indices in loader:  # a mixture's indices: (source, index in it)
            assert torch.equal(images, torch.from_numpy(expected[indices[:, 1].numpy()]).permute(0, 3, 1, 2))
    with pf.Mixture({pairs["hdf5"]["chw"]: 1, archives[("zip", "encoded")]: 1}).open() as reader:  # as images
        for i in (0, 9, 23):
            np.testing.assert_array_equal(np.asarray(pf.codecs.open_image(reader.read(i))), expected[i])


# ---- the manifest -----------------------------------------------------------------------------------------
def sealed(data: dict) -> str:
    """``data`` as a manifest's JSON, its checksum recomputed (an edit, not damage)."""
    data = {k: v for k, v in data.items() if k != "manifest_crc32"}
    return canonical_json(dict(data, manifest_crc32=zlib.crc32(canonical_json(data).encode())))


def test_a_planar_manifest_without_its_layout_is_refused_by_name(pairs):
    path = pairs["memmap"]["chw"]
    data = json.loads(pf.open_archive(path).manifest.to_json())
    assert pf.ArchiveManifest.from_json(sealed(data)).raw_layout == "chw"
    with pytest.raises(pf.CorruptArchiveError, match="raw_layout is missing") as error:
        pf.ArchiveManifest.from_json(sealed({k: v for k, v in data.items() if k != "raw_layout"}), path=path)
    assert error.value.path == path and "re-create the archive" in str(error.value)
    with pytest.raises(pf.CorruptArchiveError, match=f"version {FIELDS_VERSION} names a raw_layout"):
        pf.ArchiveManifest.from_json(sealed(dict(data, format_version=FIELDS_VERSION)))  # an older one never does
    with pytest.raises(pf.CorruptArchiveError, match="only raw archives have"):
        pf.ArchiveManifest.from_json(sealed(dict(data, mode="encoded", shape=None, encoding="jpeg")))


def planar_copy_without_layout(pairs, tmp_path, **changes) -> str:
    """A copy of the planar memmap archive whose manifest lost its raw_layout (and took ``changes``),
    its checksum made again as a writer would."""
    path = tmp_path / "chw.memmap"
    shutil.copytree(pairs["memmap"]["chw"], path)
    name = os.path.join(path, memmap.MANIFEST)
    with open(name) as file:
        data = json.load(file)
    del data["raw_layout"]
    with open(name, "w") as file:
        file.write(sealed(dict(data, **changes)))
    return os.fspath(path)


def test_a_stored_manifest_that_loses_its_layout_is_refused_on_open(pairs, tmp_path):
    path = planar_copy_without_layout(pairs, tmp_path)
    with pytest.raises(pf.CorruptArchiveError, match="raw_layout is missing") as error:
        pf.open_archive(path)
    assert os.fspath(path) in str(error.value)


def test_a_planar_memmap_passed_off_as_an_older_interleaved_one_is_refused(pairs, tmp_path):
    """A manifest edited back to version 3 without its layout (its checksum made again): images.npy says the
    samples are planar, so the archive is refused rather than read with its channels taken for rows."""
    path = planar_copy_without_layout(pairs, tmp_path, format_version=PLAIN_VERSION)
    with pytest.raises(pf.CorruptArchiveError, match=r"images.npy holds samples of shape \(3, 24, 32\)"):
        pf.open_archive(path)


@pytest.mark.parametrize("layout", ["cwh", "CHW", "", 3, None])
def test_an_unknown_layout_is_refused_by_name(pairs, layout):
    data = dict(json.loads(pf.open_archive(pairs["zip"]["chw"]).manifest.to_json()), raw_layout=layout)
    problem = "raw_layout is missing" if layout is None else f"raw_layout {layout!r} is none this packed_formats knows"
    with pytest.raises(pf.CorruptArchiveError, match=problem):
        pf.ArchiveManifest.from_json(sealed(data), path="train.zip")
    with pytest.raises(ValueError, match="raw_layout must be one of"):
        pf.open_writer("unused.zip", format="zip", mode="raw", shape=RAW_SHAPE, raw_layout=str(layout))


@pytest.mark.slow
def test_a_remote_planar_set_reads_as_the_local_one(s3, s3_env, small_folder, tmp_path):
    pytest.importorskip("s3fs")
    local = tmp_path / "local" / "train.zip"
    os.makedirs(local.parent)
    pf.convert(small_folder, local, mode="raw", size=12, shard_size=4, raw_layout="chw", workers=1, quiet=True)
    url = f"s3://{s3.bucket()}/planar/train.zip"
    pf.storage.upload(os.fspath(local), url)
    with pf.open_archive(url, cache_dir=tmp_path / "cache") as remote, pf.open_archive(local) as near:
        assert remote.manifest.raw_layout == "chw"
        everything = np.arange(len(near))
        np.testing.assert_array_equal(remote.read_many(everything), near.read_many(everything))
        planar = np.empty((len(near), 3, 12, 12), dtype=np.uint8)
        np.testing.assert_array_equal(remote.read_many_planar(everything, planar),
                                      near.read_many(everything).transpose(0, 3, 1, 2))


@pytest.mark.slow
def test_the_commands_take_a_planar_archive_as_any_other(pairs, samples, tmp_path, capsys):
    path = pairs["zip"]["chw"]
    assert cli.main(["info", path]) == 0
    assert "stored planar (CxHxW: raw_layout chw)" in capsys.readouterr().out
    assert cli.main(["verify", path, "--decode", "--quiet"]) == 0
    staged = pf.stage(path, tmp_path / "staged")
    with pf.open_archive(staged) as reader:
        assert reader.manifest.raw_layout == "chw"
        np.testing.assert_array_equal(reader.read_many(np.arange(len(reader))), pixels_of(samples))
    back = tmp_path / "back.memmap"
    pf.convert(path, back, mode="raw", workers=1, quiet=True)  # an archive of ours as a source: its images
    with pf.open_archive(back) as reader:
        assert reader.manifest.raw_layout == "hwc"
        np.testing.assert_array_equal(reader.read_many(np.arange(len(reader))), pixels_of(samples))


def test_the_benchmark_names_each_raw_archives_layout(pairs):
    config = BenchConfig(workers=(0,), batch_size=8, epochs=1, warmup=1, layout="nchw", tensordict_baseline=False,
                         reference_seconds=0.1)
    results = run_benchmark([pairs["memmap"]["hwc"], pairs["memmap"]["chw"]], config, log=lambda line: None)
    assert [t["raw_layout"] for t in results["targets"]] == ["hwc", "chw"]
    assert [r["raw_layout"] for r in results["runs"]] == ["hwc", "chw"] and all(r["error"] is None
                                                                               for r in results["runs"])
    table = format_table(results)
    assert "memmap/raw chw" in table and "stored chw" in table and "stored hwc" in table

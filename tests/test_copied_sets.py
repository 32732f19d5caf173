"""A set copied into a store object by object with a plain S3 client, as ``aws s3 sync`` or ``rclone`` do.

A local sharded conversion and a join write the set's sealed sample index beside the parts (the file
``upload`` writes), so a copied set opens without fetching its parts: a cold node's first epoch, with a
cache of a quarter of the set, downloads the set about once.  The sample index is checked against the
parts when it is written and again wherever it is read, so one that disagrees with them is refused.
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.backends.set_samples import npz_arrays, npz_bytes, samples_name
from packed_formats.backends.sharded import index_text, read_shard_index
from packed_formats.synthetic import make_image_folder
from packed_formats.verify import verify_archive

SAMPLES, PER_PART = 48, 4  # 12 parts


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("copied-sources") / "images", SAMPLES // 6, sizes=(20, 36))


def convert_set(images, dst: str, how: str) -> None:
    """The set at ``dst``, written by one conversion or by two ``--part`` tasks (the last one joins it)."""
    options = dict(format="zip", mode="raw", size=16, shard_size=PER_PART, workers=1, quiet=True)
    if how == "convert":
        pf.convert(images, dst, **options)
    else:
        for task in range(2):
            pf.convert(images, dst, part=(task, 2), **options)


def copy_with_boto3(s3, directory: str, bucket: str) -> int:
    """Put every file of ``directory`` into ``bucket`` with boto3's put_object; return the bytes put."""
    boto3 = pytest.importorskip("boto3")
    client = boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    total = 0
    for name in sorted(os.listdir(directory)):
        if name.startswith("."):  # a conversion's own state (none is left by a finished one)
            continue
        with open(os.path.join(directory, name), "rb") as file:
            data = file.read()
        client.put_object(Bucket=bucket, Key=f"copied/{name}", Body=data)
        total += len(data)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("how", ["convert", "join"])
def test_a_set_copied_object_by_object_is_downloaded_once_in_a_cold_first_epoch(
        how, images, s3, s3_proxy, tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    os.makedirs(tmp_path / "set")
    dst = str(tmp_path / "set" / "train.zip")
    convert_set(images, dst, how)
    assert os.path.isfile(tmp_path / "set" / samples_name("train.zip"))
    bucket = s3.bucket()
    set_bytes = copy_with_boto3(s3, str(tmp_path / "set"), bucket)
    proxy = s3_proxy(rate=0.0)
    proxy.use_env(monkeypatch)
    with pf.open_archive(dst) as local:
        limit = sum(os.path.getsize(p.path) for p in local.backend.parts) // 4  # a quarter: 3 parts
        loader = pf.make_loader(f"s3://{bucket}/copied/train.zip", batch_size=4, num_workers=0, shuffle="window",
                                window=1, cache_dir=tmp_path / "cache", cache_limit=limit, return_index=True)
        seen = []
        for images_batch, labels, index in loader:
            seen.extend(index.tolist())
            assert np.array_equal(images_batch.numpy(), local.read_many(index.numpy()).transpose(0, 3, 1, 2))
            assert np.array_equal(labels.numpy(), np.asarray(local.index.labels)[index.numpy()])
    assert sorted(seen) == list(range(SAMPLES))
    served = sum(v["bytes"] for v in proxy.stats()["keys"].values())  # every object: parts, index, samples
    assert served <= 1.05 * set_bytes, (served, set_bytes)


def reseal(dst: str, arrays) -> None:
    """Replace the set's sample index with one of ``arrays`` and seal the index again over it, as one
    who edits both files would: the seal and the recorded CRC32 match, only the parts can tell."""
    directory, spec, index = os.path.dirname(dst), json.loads(open(dst).read()), read_shard_index(dst)
    data = npz_bytes(arrays)
    with open(os.path.join(directory, spec["samples"]["name"]), "wb") as file:
        file.write(data)
    text = index_text(index["format"], list(zip(index["names"], index["counts"], index["contents"])),
                      index["set_id"], samples=dict(spec["samples"], size=len(data), crc32=zlib.crc32(data)),
                      manifest=spec["manifest"])
    with open(dst, "w") as file:
        file.write(text)


def sample_arrays_of(dst: str):
    spec = json.loads(open(dst).read())
    with open(os.path.join(os.path.dirname(dst), spec["samples"]["name"]), "rb") as file:
        return {name: np.array(array) for name, array in npz_arrays(dst, file.read()).items()}


@pytest.mark.parametrize("how", ["convert", "join"])
def test_a_sharded_set_is_written_with_its_sample_index_sealed_in_its_index(how, images, tmp_path):
    dst = str(tmp_path / "train.zip")
    convert_set(images, dst, how)
    spec = json.loads(open(dst).read())
    assert spec["samples"]["name"] == samples_name("train.zip")
    with open(tmp_path / "train-samples.npz", "rb") as file:
        data = file.read()
    assert (spec["samples"]["size"], spec["samples"]["crc32"]) == (len(data), zlib.crc32(data))
    arrays = sample_arrays_of(dst)
    with pf.open_archive(dst) as reader:
        assert json.loads(spec["manifest"])["count"] == len(reader) == SAMPLES
        assert np.array_equal(arrays["labels"], np.asarray(reader.index.labels))
        assert np.array_equal(arrays["crc32"], np.asarray(reader.index.crc32))
        assert [k.decode() for k in arrays["keys"]] == [reader.index.key(i) for i in range(SAMPLES)]
        assert arrays["counts"].tolist() == [PER_PART] * (SAMPLES // PER_PART)
    assert verify_archive(dst).ok


def test_one_conversion_and_a_join_write_the_same_sample_index_byte_for_byte(images, tmp_path):
    one, many = str(tmp_path / "one" / "train.zip"), str(tmp_path / "many" / "train.zip")
    os.makedirs(os.path.dirname(one))
    os.makedirs(os.path.dirname(many))
    convert_set(images, one, "convert")
    convert_set(images, many, "join")
    for name in ("train.zip", "train-samples.npz"):
        with open(tmp_path / "one" / name, "rb") as a, open(tmp_path / "many" / name, "rb") as b:
            assert a.read() == b.read(), name


@pytest.mark.parametrize("change", ["label", "key", "crc32", "count", "left out", "damaged"])
def test_verify_refuses_a_sample_index_that_disagrees_with_the_parts(change, images, tmp_path):
    dst = str(tmp_path / "train.zip")
    convert_set(images, dst, "convert")
    arrays = sample_arrays_of(dst)
    field = {"label": "labels", "key": "keys", "crc32": "crc32", "count": "counts", "left out": "crc32"}.get(change)
    if change == "label":
        arrays["labels"][5] = (arrays["labels"][5] + 1) % 6
    elif change == "key":
        arrays["keys"][5] = arrays["keys"][6]
    elif change == "crc32":
        arrays["crc32"][5] ^= 1
    elif change == "count":
        arrays["counts"][0], arrays["counts"][1] = 3, 5
    elif change == "left out":  # a field the parts hold, missing: refused, never a check skipped
        del arrays["crc32"]
    if change == "damaged":  # the bytes changed after the index recorded them
        with open(tmp_path / "train-samples.npz", "r+b") as file:
            file.seek(-3, os.SEEK_END)
            file.write(b"\xff")
        match = r"train-samples\.npz.*not the one its index records"
    else:
        reseal(dst, arrays)
        match = rf"train-samples\.npz.*field '{field}' (differs from what the set's parts hold|is missing)"
    with pf.open_archive(dst) as reader:  # a local reader reads the parts' own indexes, never this file
        assert len(reader) == SAMPLES
    with pytest.raises(pf.CorruptArchiveError, match=match):
        verify_archive(dst)


@pytest.mark.slow
@pytest.mark.parametrize("change", ["label", "left out"])
def test_a_copied_set_whose_sample_index_disagrees_with_its_parts_is_refused_in_the_store(
        change, images, s3_env, tmp_path):
    pytest.importorskip("s3fs")
    os.makedirs(tmp_path / "set")
    dst = str(tmp_path / "set" / "train.zip")
    convert_set(images, dst, "convert")
    arrays = sample_arrays_of(dst)
    if change == "label":
        arrays["labels"][5] = (arrays["labels"][5] + 1) % 6
    else:
        del arrays["crc32"]
    reseal(dst, arrays)
    bucket = s3_env.bucket()
    copy_with_boto3(s3_env, str(tmp_path / "set"), bucket)
    refused = (pf.CorruptArchiveError, pf.RemoteChangedError)  # when the part arrives, or when the set opens
    with pytest.raises(refused, match="labels differ" if change == "label" else "'crc32' is missing"):
        with pf.open_archive(f"s3://{bucket}/copied/train.zip", cache_dir=tmp_path / "cache") as remote:
            remote.read(5)


def test_staging_a_set_copies_its_checked_sample_index(images, tmp_path):
    dst = str(tmp_path / "set" / "train.zip")
    os.makedirs(os.path.dirname(dst))
    convert_set(images, dst, "convert")
    staged = pf.stage(dst, tmp_path / "node")
    with open(tmp_path / "set" / "train-samples.npz", "rb") as a, open(tmp_path / "node" / "train-samples.npz",
                                                                       "rb") as b:
        assert a.read() == b.read()
    assert verify_archive(staged).ok
    arrays = sample_arrays_of(dst)
    arrays["labels"][0] = (arrays["labels"][0] + 1) % 6
    reseal(dst, arrays)
    with pytest.raises(pf.CorruptArchiveError, match=r"train-samples\.npz.*field 'labels' differs"):
        pf.stage(dst, tmp_path / "other-node")


def test_a_copy_that_left_out_the_sample_index_its_index_records_is_refused_by_name(images, s3_env, tmp_path):
    pytest.importorskip("s3fs")
    os.makedirs(tmp_path / "set")
    dst = str(tmp_path / "set" / "train.zip")
    convert_set(images, dst, "convert")
    os.remove(tmp_path / "set" / "train-samples.npz")  # as a copy of only the index and the parts
    bucket = s3_env.bucket()
    copy_with_boto3(s3_env, str(tmp_path / "set"), bucket)
    with pytest.raises(pf.RemoteNotFoundError, match=r"train-samples\.npz: no such object .* records it as the "
                                                     r"set's sample index.*copy every file of the set"):
        pf.open_archive(f"s3://{bucket}/copied/train.zip", cache_dir=tmp_path / "cache")

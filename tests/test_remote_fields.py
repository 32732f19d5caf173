"""A set with fields in object storage reads them through the node-local cache as a local set does: each
value checked against the CRC32 the set's sample index holds (``field_crc32``), which every part must match
when it arrives.  A sample index that drops, reshapes or rewrites those CRC32s, even re-sealed by hand, is a
named error, never a field read unchecked; a cached part whose field bytes are damaged is fetched again."""

from __future__ import annotations

import io
import json
import os
import zlib

import numpy as np
import pytest
import torch

import packed_formats as pf
from packed_formats.errors import CorruptArchiveError, PackedFormatError, RemoteChangedError

from .test_fields import assert_value
from .test_remote_untrusted import put_index
from .test_set_fields import FIELDS, write_set

pytest.importorskip("s3fs")


@pytest.fixture(scope="module")
def local_set(tmp_path_factory):
    """A zip set of 3 parts (3, 3, 1 samples) with image, array, text and JSON fields, and its values."""
    path = tmp_path_factory.mktemp("remote-fields") / "set.zip"
    return str(path), write_set(path, "zip", count=7, per_part=3)


def uploaded(s3, local: str) -> str:
    url = f"s3://{s3.bucket()}/{os.path.basename(local)}"
    pf.storage.upload(local, url)
    return url


@pytest.fixture(scope="module")
def remote_set(s3, local_set):
    """The local set uploaded once for the module's tests that only read it (each with a cache of its own)."""
    with pytest.MonkeyPatch.context() as patch:
        s3.use_env(patch)
        return uploaded(s3, local_set[0])


def samples_of(s3, url: str) -> tuple:
    """(the set's index, the arrays of its sample index) as they are in the store."""
    spec = json.loads(s3.fs().cat_file(url))
    data = s3.fs().cat_file(url.rsplit("/", 1)[0] + "/" + spec["samples"]["name"])
    with np.load(io.BytesIO(data)) as npz:
        return spec, {name: npz[name] for name in npz.files}


def put_samples(s3, url: str, spec: dict, arrays: dict, name: str) -> str:
    """Beside the set at ``url``, a set index ``name`` over the same parts with ``arrays`` as its sample index,
    sealed as a writer seals one (its checksum is no signature); its URL."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    data = buffer.getvalue()
    folder = url.rsplit("/", 1)[0]
    spec["samples"].update(name=f"{name}-samples.npz", size=len(data), crc32=zlib.crc32(data))
    s3.put(f"{folder}/{spec['samples']['name']}", data)
    put_index(s3, f"{folder}/{name}.zip", spec)
    return f"{folder}/{name}.zip"


def test_every_field_of_a_set_in_the_store_reads_back_checked(s3_env, local_set, remote_set, tmp_path):
    local, written = local_set
    url = remote_set
    _, arrays = samples_of(s3_env, url)
    assert arrays["field_crc32"].shape == (len(FIELDS), 7) and arrays["field_crc32"].dtype == np.uint32
    with pf.open_archive(url, cache_dir=str(tmp_path / "cache")) as reader:
        assert [s.describe() for s in reader.fields] == FIELDS
        for i, values in enumerate(written):
            for name, want in values.items():
                assert_value(name, reader.read_field(i, name), want)


def test_make_loader_batches_the_fields_of_a_set_in_the_store_in_spawned_workers(s3_env, local_set, remote_set,
                                                                                  tmp_path):
    local, url = local_set[0], remote_set

    def batches(source, workers):  # spawned workers receive the remote set pickled, its field CRC32s mapped again
        return list(pf.make_loader(source, batch_size=3, shuffle=False, num_workers=workers,
                                   fields=["mask", "caption"], multiprocessing_context="spawn",
                                   cache_dir=str(tmp_path / "cache")))

    remote, here = batches(url, 2), batches(local, 0)
    assert len(remote) == len(here) == 3
    for mine, theirs in zip(remote, here):
        assert torch.equal(mine["image"], theirs["image"]) and torch.equal(mine["mask"], theirs["mask"])
        assert mine["caption"] == theirs["caption"]


def test_a_single_archive_with_fields_in_the_store_is_indexed_from_itself(s3_env, local_set, tmp_path):
    local, written = local_set
    with pf.open_archive(local) as reader:
        part = reader.backend.parts[1].path  # samples 3-5, an archive of its own too
    url = f"s3://{s3_env.bucket()}/one.zip"
    s3_env.put(url, open(part, "rb").read())
    with pf.open_archive(url, cache_dir=str(tmp_path / "cache")) as reader:
        assert len(reader) == 3
        for j in range(3):
            assert reader.read_field(j, "caption") == written[3 + j]["caption"]


@pytest.mark.parametrize("case", ["missing", "a row short", "one sample's crc rewritten", "as a 1-D array",
                                  "on a set without fields"])
def test_a_sample_index_whose_field_crcs_do_not_fit_is_a_named_error_never_an_unchecked_read(
        case, s3_env, remote_set, tmp_path):
    spec, arrays = samples_of(s3_env, remote_set)
    rows = arrays["field_crc32"]
    if case == "missing":
        del arrays["field_crc32"]
    elif case == "a row short":
        arrays["field_crc32"] = rows[:-1]
    elif case == "one sample's crc rewritten":
        rows = rows.copy()
        rows[FIELDS.index("caption=text"), 4] ^= 1  # sample 4's caption, in part 1
        arrays["field_crc32"] = rows
    elif case == "as a 1-D array":
        arrays["field_crc32"] = rows.reshape(-1)
    else:  # the manifest re-sealed without the fields, the CRC32s left in place
        import dataclasses

        from packed_formats.manifest import ArchiveManifest

        spec["manifest"] = dataclasses.replace(ArchiveManifest.from_json(spec["manifest"]), fields=()).to_json()
    url = put_samples(s3_env, remote_set, spec, arrays, case.replace(" ", "-").replace("'", ""))
    expected = {"missing": (CorruptArchiveError, "field 'field_crc32' is missing"),
                "a row short": (CorruptArchiveError, "field 'field_crc32' has shape \\(3, 7\\), not \\(4 fields"),
                "one sample's crc rewritten": (RemoteChangedError, "field.caption.crc32 differ from the set's"),
                "as a 1-D array": (CorruptArchiveError, "field 'field_crc32' is not a 2-D array"),
                "on a set without fields": (CorruptArchiveError, "the set's manifest declares no field")}[case]
    with pytest.raises(expected[0], match=expected[1]) as caught:
        with pf.open_archive(url, cache_dir=str(tmp_path / "cache")) as reader:
            reader.read_field(4, "caption")
    assert str(caught.value).startswith("s3://")


def test_a_cached_part_whose_field_bytes_are_damaged_is_fetched_again(s3_env, local_set, remote_set, tmp_path):
    written, url = local_set[1], remote_set
    cache = str(tmp_path / "cache")
    with pf.open_archive(url, cache_dir=cache) as reader:
        assert reader.read_field(4, "caption") == written[4]["caption"]
        entry = reader.backend.entry_path(1)
    with pf.open_archive(entry) as part:
        start, _ = part.index.field_bytes("caption", 1)
    with open(entry, "r+b") as file:  # the cached copy damaged after its check on arrival
        file.seek(start + 2)
        byte = file.read(1)
        file.seek(start + 2)
        file.write(bytes([byte[0] ^ 0x40]))
    with pf.open_archive(url, cache_dir=cache) as reader:
        assert reader.read_field(4, "caption") == written[4]["caption"]
    with pf.open_archive(entry) as part:
        assert part.read_field(1, "caption") == written[4]["caption"]  # the entry was fetched again


def test_parts_that_disagree_on_their_fields_are_refused_when_the_set_is_indexed_from_them(s3_env, local_set,
                                                                                           tmp_path):
    local, _ = local_set
    url = uploaded(s3_env, local)
    spec, _ = samples_of(s3_env, url)
    from packed_formats.manifest import part_of_set

    with pf.open_archive(local) as reader:
        second = pf.open_archive(reader.backend.parts[1].path)
    plain = tmp_path / "plain.zip"  # the second part again, without its fields, uploaded over it
    with second, part_of_set(second.manifest.set_id, second.manifest.part), \
            pf.open_writer(plain, format="zip", mode="raw", shape=second.manifest.shape,
                           classes=list(second.classes)) as writer:
        for j in range(len(second)):
            writer.add(second.read(j), int(second.index.labels[j]), second.key(j))
    s3_env.put(url.rsplit("/", 1)[0] + "/" + spec["parts"][1]["name"], plain.read_bytes())
    del spec["samples"]  # a set copied without its sample index: indexed from its parts
    put_index(s3_env, url, spec)
    with pytest.raises(PackedFormatError, match="differs from the first part, .* in fields: 'none'"):
        with pytest.warns(UserWarning, match="no sample index"):
            pf.open_archive(url, cache_dir=str(tmp_path / "cache"))
